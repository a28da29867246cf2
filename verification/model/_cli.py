"""The command line of the model check: `python -m verification.model`, `scripts/modelcheck`."""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Sequence
from typing import Any, cast

from verification.model._approvals import ApprovalConfig
from verification.model._explore import explore
from verification.model._keywindow import KeyWindowConfig
from verification.model._spill import SpillConfig
from verification.model._undoprune import UndoPruneConfig
from verification.model._world import KINDS, OLD_RULES, Config, Kind, Rules

#: The focused models of issue 20's rules, by the name `--model` gives them.
MODELS = {
    "approvals": ApprovalConfig,
    "keywindow": KeyWindowConfig,
    "undo": UndoPruneConfig,
    "spill": SpillConfig,
}


def focused(size: str) -> list[Any]:
    """The focused models' configurations of a named set (docs/verification.md)."""
    if size == "ci":
        return [
            ApprovalConfig(),
            ApprovalConfig(operators=2, waiters=2),
            ApprovalConfig(operators=0, upkeep=False),
            KeyWindowConfig(),
            KeyWindowConfig(approval_wait=2),
            UndoPruneConfig(),
            UndoPruneConfig(original_prunable=True),
            SpillConfig(readers=2, spills=2),
        ]
    return [
        ApprovalConfig(window=3, operators=2, waiters=2, commit_delay=2),
        ApprovalConfig(operators=0, upkeep=False, waiters=2),
        KeyWindowConfig(key_ttl=4, timeout=2, max_backoff=3, max_attempts=4),
        KeyWindowConfig(key_ttl=5, max_attempts=4, approval_wait=3),
        UndoPruneConfig(undo_runs=3),
        UndoPruneConfig(prunes=2, max_undos=3),
        UndoPruneConfig(prunes=2, original_prunable=True),
        SpillConfig(readers=3, spills=2),
    ]


def configs(size: str) -> list[Config]:
    """Named sets of the call protocol's model: `ci`, what the test suite explores as holding
    every property; `full`, every class with more workers, on one host and on many, and runs
    slow between reading a row and judging it. Queryable with two workers is larger than
    either (millions of states): run it on its own, with `--max-states` raised. `focused`
    gives the focused models' configurations of the same sets."""
    if size == "ci":
        return [
            *(Config(workers=2, intents=("unsafe",), same_host=h) for h in (True, False)),
            Config(workers=2, intents=("unsafe",), stale_reads=True),
            *(Config(workers=w, intents=("idempotent",)) for w in (1, 2)),
            *(
                Config(workers=1, intents=("queryable",), not_sent=False, refusals=False, crashes=c)
                for c in (True, False)
            ),
            Config(workers=1, intents=("transactional",)),
            Config(workers=2, intents=("transactional",), crashes=False, not_sent=False,
                   refusals=False, lost_commit_replies=False),
        ]
    return [
        *(
            Config(workers=w, intents=(k,), same_host=h)
            for k in ("unsafe", "idempotent")
            for w in (2, 3)
            for h in (True, False)
        ),
        Config(workers=1, intents=("queryable",)),
        Config(workers=2, intents=("transactional",)),
        *(Config(workers=2, intents=(k,), stale_reads=True) for k in ("unsafe", "idempotent")),
    ]


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m verification.model",
        description="Exhaustive model check of poimen's call and recovery protocol.",
    )
    p.add_argument("--set", choices=("ci", "full"), help="run a named set of configurations "
                   "(with --model, that model's configurations of the set)")
    p.add_argument("--model", choices=sorted(MODELS), help="a focused model of issue 20's "
                   "rules instead of the call protocol: its configurations of --set (full by "
                   "default)")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--intents", default="queryable", help="classes, comma separated")
    p.add_argument("--timeout", type=int, default=3)
    p.add_argument("--margin", type=int, default=2)
    p.add_argument("--lease-ttl", type=int, default=3)
    p.add_argument("--latency", type=int)
    p.add_argument("--commit-delay", type=int, default=2)
    p.add_argument("--max-attempts", type=int, default=2)
    p.add_argument("--lookup-limit", type=int, default=2)
    p.add_argument("--hosts", choices=("one", "many"), default="one")
    p.add_argument("--no-crashes", action="store_true")
    p.add_argument("--no-lapses", action="store_true")
    p.add_argument("--no-lost-commit-replies", action="store_true")
    p.add_argument("--no-not-sent", action="store_true")
    p.add_argument("--no-refusals", action="store_true")
    p.add_argument("--stale-reads", action="store_true")
    p.add_argument("--slow-renewals", action="store_true")
    p.add_argument(
        "--old-rule",
        action="append",
        choices=sorted(OLD_RULES),
        default=[],
        help="put back a rule as it was before a finding was fixed (not the protocol as "
        "built; docs/verification.md)",
    )
    p.add_argument("--no-liveness", action="store_true")
    p.add_argument("--max-states", type=int, default=3_000_000)
    ns = p.parse_args(argv)
    todo: list[Any]
    if ns.model:
        kind = MODELS[ns.model]
        todo = [c for c in focused(ns.set or "full") if isinstance(c, kind)]
    elif ns.set:
        todo = [dataclasses.replace(c, max_states=ns.max_states) for c in configs(ns.set)]
        todo += focused(ns.set)
    else:
        kinds = tuple(k.strip() for k in ns.intents.split(",") if k.strip())
        for k in kinds:
            if k not in KINDS:
                p.error(f"unknown class {k!r}; expected {', '.join(KINDS)}")
        todo = [
            Config(
                workers=ns.workers,
                intents=cast(tuple[Kind, ...], kinds),
                timeout=ns.timeout,
                margin=ns.margin,
                lease_ttl=ns.lease_ttl,
                latency=ns.latency,
                commit_delay=ns.commit_delay,
                max_attempts=ns.max_attempts,
                lookup_limit=ns.lookup_limit,
                same_host=ns.hosts == "one",
                crashes=not ns.no_crashes,
                lapses=not ns.no_lapses,
                lost_commit_replies=not ns.no_lost_commit_replies,
                not_sent=not ns.no_not_sent,
                stale_reads=ns.stale_reads,
                slow_renewals=ns.slow_renewals,
                refusals=not ns.no_refusals,
                max_states=ns.max_states,
            )
        ]
    changes: dict[str, object] = {}
    for name in ns.old_rule:
        changes.update(OLD_RULES[name])
    rules = Rules(**changes)  # type: ignore[arg-type]
    if ns.old_rule:
        print(f"old rules put back (not the protocol as built): {', '.join(ns.old_rule)}\n")
    failed = 0
    for cfg in todo:
        res = explore(cfg, rules, liveness=not ns.no_liveness)
        print(res.report(), flush=True)
        print(flush=True)
        failed += not res.ok()
    print(f"{len(todo) - failed} of {len(todo)} configurations hold every property")
    return 1 if failed else 0
