"""``python -m poimen``: the `poimen` command."""

from poimen.cli import main

raise SystemExit(main())
