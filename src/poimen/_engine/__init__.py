"""The runtime: the call protocol and its two runners, recovery, background duties, the outbox,
identity after a fork. Imports the layers below it only (docs/design.md, module map)."""
