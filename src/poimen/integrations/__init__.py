"""Adapters that put poimen under agent frameworks; each needs its extra."""
