"""The tool side: the context a tool is handed, its keyed write handles, the audit hook that
catches out-of-band writes (docs/capability.md)."""
