"""`python -m poimen.testing`: the crash-test children and the drill (see `_main`)."""

from poimen.testing import _main

raise SystemExit(_main())
