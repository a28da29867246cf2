"""What every integration tells a model, besides `Outcome.for_model()`."""

from __future__ import annotations


def refusal(error: Exception) -> str:
    """Arguments refused before anything was recorded: the model may correct them."""
    return f"The call was refused and had no effect: {error}. Correct the input and call it again."
