"""poimen's benchmark suite: `scripts/bench` (or `python -m bench`) from the repository root."""
