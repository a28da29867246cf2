"""Agent frameworks on top of poimen: each module wraps a kernel's tools in one framework's
tool type, chooses call ids by the rule in `poimen.call_ids`, and tells the model each outcome
in the words of `Outcome.for_model()`. A module imports its framework; install it with the
extra of the same name (``pip install 'poimen[pydantic-ai]'``); imported without it, the
module raises `poimen.errors.MissingExtraError` (an `ImportError`) naming the extra."""
