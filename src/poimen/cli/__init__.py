"""The ``poimen`` operator CLI (console script ``poimen = poimen.cli:main``)."""

from __future__ import annotations

import sys

__all__ = ["main"]


def main(argv: list[str] | None = None) -> int:
    from poimen.cli._main import main as run

    return run(sys.argv[1:] if argv is None else argv)


if __name__ == "__main__":
    raise SystemExit(main())
