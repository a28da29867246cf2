from poimen.cli import main

raise SystemExit(main())
