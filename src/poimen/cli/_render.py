"""Human-readable output: plain tables and a progress bar, no dependencies."""

from __future__ import annotations

import sys
import time
from collections.abc import Mapping, Sequence
from typing import Any, TextIO

from poimen._core.intents import Delivery, Denial, Intent, IntentState, Notification
from poimen._engine.evidence import Found
from poimen._undo import UndoReport
from poimen.operator._ops import (
    IntentDetail,
    Status,
    escape_text,
    fmt_age,
    fmt_time,
    redact_urls,
    safe_json,
)


def table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    cells = [[_cell(v) for v in r] for r in rows]
    widths = [len(h) for h in headers]
    for r in cells:
        for i, c in enumerate(r):
            widths[i] = max(widths[i], len(c))
    lines = ["  ".join(h.ljust(w) for h, w in zip(headers, widths, strict=True)).rstrip()]
    for r in cells:
        lines.append("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip())
    return "\n".join(lines)


def _cell(v: Any) -> str:
    # Recorded text (a call id, a provider's error) may hold newlines or escape sequences:
    # shown as escapes, it can neither add a line nor drive the operator's terminal.
    if v is None:
        return "-"
    text = escape_text(str(v))
    return text if len(text) <= 80 else text[:77] + "..."


def status_text(st: Status) -> str:
    out = [
        f"intents: {st.total} total, {st.unfinished} unfinished (DISPATCHED), "
        f"{st.indeterminate} INDETERMINATE"
    ]
    o = st.oldest_indeterminate
    if o is not None:
        out.append(
            f"oldest INDETERMINATE: {o.id}  {escape_text(o.tool_id)}  "
            f"{escape_text(o.reason or '-')}  "
            f"created {fmt_time(o.created_at)} ({fmt_age(st.now - o.created_at)} ago)"
        )
    out.append(f"undelivered notifications: {st.undelivered_notifications}")
    out.append("")
    out.append(table(["state", "count"], [(s, n) for s, n in st.by_state.items()]))
    if st.by_tool:
        states = [s.value for s in IntentState]
        out.append("")
        out.append(
            table(
                ["tool", *states],
                [(tool, *(c.get(s, 0) for s in states)) for tool, c in st.by_tool.items()],
            )
        )
    return "\n".join(out)


def intents_text(rows: Sequence[Intent]) -> str:
    return table(
        ["id", "created", "state", "tool", "effect", "reason", "attempts", "call_id"],
        [
            (
                i.id,
                fmt_time(i.created_at),
                i.state,
                i.tool_id,
                i.effect,
                i.reason,
                i.attempts,
                i.call_id,
            )
            for i in rows
        ],
    )


def _owner(o: Any) -> str:
    return "-" if o is None else f"{o.worker_id}@{o.host} pid {o.pid}"


def _indent(text: str, n: int = 2) -> str:
    return "\n".join(" " * n + line for line in text.splitlines())


def _pretty(value: Any) -> str:
    return safe_json(value, indent=2)


def detail_text(d: IntentDetail) -> str:
    i = d.intent
    head = [
        ("intent", i.id),
        ("call id", i.call_id),
        ("tool", f"{i.tool_id} ({i.effect})"),
        ("state", f"{i.state}" + (f" ({i.reason})" if i.reason else "")),
        ("key", i.key),
        ("request id", i.request_id),
        ("fence", i.fence),
        ("owner", _owner(i.owner)),
        ("created", f"{fmt_time(i.created_at)} ({fmt_age(d.now - i.created_at)} ago)"),
        ("updated", fmt_time(i.updated_at)),
    ]
    if i.error:
        head.append(("error", i.error))
    for u in d.undone_by:
        head.append((
            "undone by",
            f"{u['undo_intent_id']} ({u['undo_call_id']}, {u['undo_tool']}) asked by "
            f"{u['asked_by']} at {fmt_time(u['at'])}",
        ))
    if d.undoes is not None:
        head.append(("undoes", f"{d.undoes.id} ({d.undoes.call_id}, {d.undoes.tool_id})"))
    out = [f"{k + ':':12} {'-' if v is None else escape_text(str(v))}" for k, v in head]
    out += ["", "arguments (secrets redacted):", _indent(_pretty(d.args))]
    if d.result is not None:
        out += ["result:", _indent(_pretty(d.result))]
    if d.evidence is not None:
        out += ["", *evidence_lines(d.evidence, d.suggestion)]
    out += ["", f"attempts ({len(d.attempts)}):"]
    out.append(
        _indent(
            table(
                ["#", "fence", "owner", "started", "ended", "outcome", "error", "late"],
                [
                    (
                        a.number,
                        a.fence,
                        _owner(a.owner),
                        fmt_time(a.started_at),
                        fmt_time(a.ended_at),
                        a.outcome,
                        a.error,
                        a.late_outcome,
                    )
                    for a in d.attempts
                ],
            )
        )
    )
    out += ["", f"events ({len(d.events)}):"]
    out.append(
        _indent(
            table(
                ["at", "kind", "transition", "actor", "detail"],
                [
                    (
                        fmt_time(e.at),
                        e.kind,
                        f"{e.from_state or '-'} -> {e.to_state or '-'}" if e.to_state else "-",
                        d.actor(e),
                        safe_json(d.event_detail(e)),
                    )
                    for e in d.events
                ],
            )
        )
    )
    out += ["", f"notifications ({len(d.notifications)}):"]
    if d.notifications:
        out.append(
            _indent(
                table(
                    ["delivery id", "kind", "notifier", "queued", "delivered", "tries", "error"],
                    [
                        (
                            n.delivery_id,
                            n.kind,
                            x.notifier,
                            fmt_time(n.created_at),
                            fmt_time(x.delivered_at),
                            x.attempts,
                            None if x.last_error is None else redact_urls(x.last_error),
                        )
                        for n in d.notifications
                        # A row from before per-notifier delivery has no delivery rows.
                        for x in d.deliveries_of(n) or [_whole(n)]
                    ],
                )
            )
        )
    if d.resolvable:
        out += [
            "",
            "resolve with: poimen resolve "
            f"{i.id} --landed|--not-landed --operator NAME --reason TEXT",
        ]
    return "\n".join(out)


def evidence_lines(f: Found, suggestion: Mapping[str, Any] | None = None) -> list[str]:
    """A gathering as `poimen show` and `poimen evidence` print it: facts, links, the
    rule's suggestion (or the failure)."""
    out = [
        f"evidence (gathered {fmt_time(f.at)} by {escape_text(f.actor)}, "
        f"{escape_text(f.trigger)}; facts, not a decision):"
    ]
    for fact in f.facts:
        out.append(f"  - {escape_text(str(fact.get('text', '')))}")
        if fact.get("link"):
            out.append(f"    {escape_text(str(fact['link']))}")
        if fact.get("data") is not None:
            out.append(f"    {safe_json(fact['data'])}")
    if f.omitted:
        out.append(f"  ({f.omitted} more facts not kept)")
    if f.error:
        out.append(f"  failed: {escape_text(f.error)}")
    elif not f.facts:
        out.append("  (nothing found)")
    if f.suggest_error:
        out.append(f"  the rule failed: {escape_text(f.suggest_error)}")
    if suggestion is not None:
        out.append(
            f"  suggested: {suggestion['decision'].replace('_', ' ')}: "
            f"{escape_text(str(suggestion['reason']))} (a person decides: poimen resolve)"
        )
    return out


def _whole(n: Notification) -> Delivery:
    return Delivery(n.id, "-", n.delivered_at, n.attempts, n.last_error, n.next_attempt_at)


def denials_text(rows: Sequence[Denial]) -> str:
    return table(
        ["at", "tool", "intent", "attempt", "action", "target", "reason"],
        [
            (fmt_time(d.at), d.tool_id, d.intent_id, d.attempt, d.action, d.target, d.reason)
            for d in rows
        ],
    )


def undo_text(report: UndoReport) -> str:
    if not report.steps:
        return f"no calls have call ids starting with {report.scope!r}"
    rows = [
        (s.call_id, s.tool_id, s.state, s.status, s.undo_call_id, s.undo_intent_id)
        for s in report.steps
    ]
    heads = ["call id", "tool", "state", "undo", "undo call id", "undo intent"]
    out = [report.summary(), "", table(heads, rows)]
    why = [f"  {escape_text(s.call_id)}: {s.reason}" for s in report.steps if s.reason]
    return "\n".join(out + (["", "why:", *why] if why else []))


class ProgressBar:
    """``recover [#####-----] 120/300  40%`` redrawn in place, at most ten times a second."""

    def __init__(
        self, total: int, *, stream: TextIO | None = None, width: int = 30, label: str = "recover"
    ) -> None:
        self.total = total
        self.label = label
        self.stream = stream or sys.stderr
        self.width = width
        self._last = 0.0
        self._shown = -1

    def update(self, done: int) -> None:
        now = time.monotonic()
        if done < self.total and now - self._last < 0.1:
            return
        self._last = now
        self._draw(done)

    def _draw(self, done: int) -> None:
        total = max(self.total, done, 1)
        filled = self.width * done // total
        bar = "#" * filled + "-" * (self.width - filled)
        self.stream.write(f"\r{self.label} [{bar}] {done}/{total} {100 * done // total:3d}%")
        self.stream.flush()
        self._shown = done

    def finish(self, done: int) -> None:
        if self._shown != done:
            self._draw(done)
        self.stream.write("\n")
        self.stream.flush()


def verification_text(v: Any) -> str:
    """`poimen verify`: what was checked, what is wrong, the intents nothing will finish."""
    out = [
        f"{v.backend} log, schema version {v.schema_version} (this poimen knows "
        f"{v.known_version})",
        f"checked: {', '.join(v.checks)}",
    ]
    out += [f"note: {n}" for n in v.notes]
    for p in v.problems:
        out.append(f"PROBLEM ({p.check}): {escape_text(p.message)}")
    if v.orphans:
        out.append(
            f"{len(v.orphans)} unfinished intents whose owner is gone (recovery takes them over "
            "once a kernel with their tools runs, or `poimen recover --app ...`):"
        )
        out.append(
            table(
                ["id", "tool", "call_id", "why"],
                [(o.intent.id, o.intent.tool_id, o.intent.call_id, o.why) for o in v.orphans],
            )
        )
    out.append("ok" if v.ok else "verify FAILED")
    return "\n".join(out)


def doctor_text(info: dict[str, Any]) -> str:
    """`poimen doctor`: one `name: value` per line, nested sections indented."""
    out = ["poimen doctor (secrets redacted; paste it into a bug report)"]

    def walk(d: dict[str, Any], indent: str) -> None:
        for k, v in d.items():
            if isinstance(v, dict):
                out.append(f"{indent}{k}:" + ("" if v else " -"))
                walk(v, indent + "  ")
            else:
                out.append(f"{indent}{k}: {escape_text('-' if v is None else str(v))}")

    walk(info, "")
    return "\n".join(out)
