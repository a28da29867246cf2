"""The commands that help an operator decide (docs/email-outage.md): ``poimen evidence``,
``poimen resolve --filter/--from-csv [--dry-run]`` (one audited batch), ``poimen status
--older-than``."""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any

from poimen._kernel import Kernel
from poimen.cli import _main as m
from poimen.cli import _render as render
from poimen.operator import _ageing
from poimen.operator import _ops as op
from poimen.operator import _reconcile as rc
from poimen.store import Store


def console_options(kernel: Kernel) -> dict[str, Any]:
    """What the console takes from the app besides its checks: the evidence functions (run
    from the intent page) and the tools' escalation thresholds (the overdue badge)."""
    return {
        "evidence": kernel.evidence,
        "evidence_tools": kernel.evidence_tools,
        "escalations": kernel.escalations,
    }


def cmd_evidence(ns: argparse.Namespace) -> int:
    """Gather one call's evidence now with the app's evidence function; prints it."""
    name = ns.operator if ns.operator is not None else os.environ.get("POIMEN_OPERATOR")
    account = op.os_user()
    who = op.Identity((name or account or "cli").strip() or "cli", via="cli", os_user=account)
    kernel = m._app_on_db(ns)
    try:
        found = kernel.evidence(ns.intent, operator=who)
        detail = op.show(kernel.store, ns.intent)
    finally:
        kernel.close()
    if found is None:
        raise m.CliError("the evidence was gathered but could not be read back", code=m.STORE)
    m._emit(
        ns,
        {"intent_id": detail.intent.id, "evidence": found.to_json(),
         "suggestion": detail.suggestion},
        lambda: "\n".join([f"intent {detail.intent.id} ({detail.intent.state})",
                           *render.evidence_lines(found, detail.suggestion)]),
    )
    return m.OK if found.error is None else m.NOT_FOUND


def cmd_bulk(ns: argparse.Namespace, store: Store) -> int:
    """`resolve --filter` or `--from-csv`: plan, then (unless --dry-run) one audited batch."""
    if ns.intent is not None:
        raise m.CliError("name one intent, or use --filter / --from-csv: not both", code=m.USAGE)
    if ns.filter and ns.from_csv:
        raise m.CliError("--filter and --from-csv do not go together", code=m.USAGE)
    if ns.result is not None:
        raise m.CliError("--result is for one intent; a CSV has a result column", code=m.USAGE)
    if ns.filter:
        if not (ns.landed or ns.not_landed):
            raise m.CliError("--filter needs --landed or --not-landed", code=m.USAGE)
        flt = rc.parse_filter(ns.filter, store.now())
        plan = rc.plan_filter(store, flt, landed=ns.landed)
    else:
        if ns.landed or ns.not_landed:
            raise m.CliError(
                "--from-csv takes each call's outcome from the CSV: drop --landed/--not-landed",
                code=m.USAGE,
            )
        text = _read(ns.from_csv)
        plan = rc.plan_csv(store, rc.read_csv(text), name=Path(ns.from_csv).name, text=text)
    if ns.dry_run:
        m._emit(ns, {"dry_run": True, **plan.to_json()}, lambda: _plan_text(plan))
        return m.OK if plan.items else m.NOT_FOUND
    if not ns.reason or not ns.reason.strip():
        raise m.CliError("resolve needs --reason: what you checked", code=m.USAGE)
    who = m._decider(ns, "resolve")
    if not plan.items:
        m._emit(ns, {"dry_run": False, **plan.to_json()}, lambda: _plan_text(plan))
        return m.NOT_FOUND
    report = rc.apply(store, plan, operator=who, reason=ns.reason)
    m._emit(ns, report.to_json(), lambda: _report_text(report, who, ns.reason))
    return m.OK if not report.refused else m.NOT_FOUND


def _read(path: str) -> str:
    try:
        size = os.path.getsize(path)
        if size > rc.MAX_CSV_BYTES:
            raise m.CliError(f"{path}: over {rc.MAX_CSV_BYTES} bytes", code=m.USAGE)
        return Path(path).read_text(encoding="utf-8-sig")
    except OSError as exc:
        raise m.CliError(f"cannot read {path}: {exc.strerror or exc}", code=m.USAGE) from exc
    except UnicodeDecodeError as exc:
        raise m.CliError(f"{path} is not UTF-8 text: {exc.reason}", code=m.USAGE) from exc


def _rows(items: tuple[rc.Item, ...]) -> str:
    return render.table(
        ["intent", "call id", "tool", "reason", "created", "decision", "from"],
        [
            (i.intent.id, i.intent.call_id, i.intent.tool_id, i.intent.reason,
             op.fmt_time(i.intent.created_at), "landed" if i.landed else "not landed", i.source)
            for i in items
        ],
    )


def _problems(problems: tuple[rc.Problem, ...]) -> list[str]:
    if not problems:
        return []
    return ["", f"left alone ({len(problems)}):",
            render.table(["from", "names", "why"],
                         [(p.source, p.ident, p.problem) for p in problems])]


def _plan_text(plan: rc.Plan) -> str:
    head = f"dry run ({plan.source}): would resolve {len(plan.items)}; nothing was changed"
    return "\n".join([head, *([_rows(plan.items)] if plan.items else []),
                      *_problems(plan.problems)])


def _report_text(report: rc.Report, who: op.Identity, reason: str) -> str:
    head = (f"batch {report.batch} ({report.source}): resolved {len(report.resolved)} "
            f"{m._by(who, reason)}")
    return "\n".join([head, *([_rows(report.resolved)] if report.resolved else []),
                      *_problems(report.refused)])


def status_older(ns: argparse.Namespace, store: Store, st: op.Status) -> int:
    """`status --older-than D`: the status, and the calls waiting for a person longer."""
    seconds = op.parse_duration(ns.older_than, "older_than")
    rows = _ageing.older_than(store, seconds)
    data: dict[str, Any] = {
        **st.to_json(),
        "older_than": {
            "seconds": seconds,
            "intents": [{**op.intent_summary(i), "age_s": st.now - i.created_at} for i in rows],
        },
    }

    def text() -> str:
        lines = [render.status_text(st), "",
                 f"waiting for a person longer than {op.fmt_age(seconds)}: {len(rows)}"]
        if rows:
            lines.append(render.table(
                ["intent", "state", "tool", "reason", "age", "call id"],
                [(i.id, i.state, i.tool_id, i.reason, op.fmt_age(st.now - i.created_at),
                  i.call_id) for i in rows],
            ))
        return "\n".join(lines)

    m._emit(ns, data, text)
    return m.INDETERMINATE if rows else m.OK
