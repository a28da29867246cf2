"""An MCP stdio server over the test tools, for the kill tests (``python -m
tests.integrations.mcp_runner --db URL --provider URL [--scope S] [--pending-wait SECONDS]
[--wait-bound SECONDS]``); `mail_gated` needs an operator's approval, asked by elicitation."""

from __future__ import annotations

import argparse

from poimen import Kernel
from poimen.integrations.mcp import mcp_server, run_stdio
from poimen.testing import register_test_tools
from tests.integrations.runner import _gated


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--db", required=True)
    p.add_argument("--provider", required=True)
    p.add_argument("--scope")
    p.add_argument("--pending-wait", type=float, default=30.0)
    p.add_argument("--wait-bound", type=float, default=5.0)
    ns = p.parse_args()
    with Kernel(ns.db, notifiers=[], wait_bound=ns.wait_bound) as kernel:
        register_test_tools(kernel, ns.provider)
        _gated(kernel, ns.provider)
        kernel.launch()
        run_stdio(mcp_server(kernel, scope=ns.scope, pending_wait=ns.pending_wait))


if __name__ == "__main__":
    main()
