"""`python -m verification soak ...`: the kill soak's command (`scripts/soak`).

A module of its own, not `python -m verification.soak`: the soak's forkserver preloads
`verification.soak`, and a main module it had already imported would be run a second time
(with a warning, an error where warnings are errors)."""

from __future__ import annotations

import sys

from verification.soak import main

if __name__ == "__main__":
    if sys.argv[1:2] != ["soak"]:
        print("usage: python -m verification soak [options]  (the model check: "
              "python -m verification.model)", file=sys.stderr)
        raise SystemExit(2)
    raise SystemExit(main(sys.argv[2:]))
