"""An MCP stdio server over the test tools, for the kill test (``python -m
tests.integrations.mcp_runner --db URL --provider URL``)."""

from __future__ import annotations

import argparse

from poimen import Kernel
from poimen.integrations.mcp import mcp_server, run_stdio
from poimen.testing import register_test_tools


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--db", required=True)
    p.add_argument("--provider", required=True)
    ns = p.parse_args()
    with Kernel(ns.db, notifiers=[]) as kernel:
        register_test_tools(kernel, ns.provider)
        kernel.launch()
        run_stdio(mcp_server(kernel))


if __name__ == "__main__":
    main()
