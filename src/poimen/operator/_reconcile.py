"""Bulk reconciliation after an outage: many INDETERMINATE calls resolved in one audited
batch, chosen by a filter or matched from a CSV the operator exported from the provider
(docs/email-outage.md). What the CLI's ``poimen resolve --filter/--from-csv`` and the
console's *Resolve many* page share.

A plan is made first (what would change, and every row that matches nothing), then applied
one intent at a time through `poimen.operator._ops.resolve`: the store's compare-and-set on
the intent's state lets exactly one decision win per intent, so a single resolve racing the
batch either wins (the batch reports the intent as decided already) or finds it decided.
Each resolve event names the batch (``batch``), where its decisions came from
(``batch_source``) and how many it held (``batch_size``).
"""

from __future__ import annotations

import csv
import hashlib
import io
import re
import secrets
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from poimen._core.intents import Intent, IntentState
from poimen._core.present import MAX_LIMIT, OperatorInputError, parse_result, parse_since
from poimen.errors import NotIndeterminateError
from poimen.operator._ops import Identity, resolve
from poimen.store._base import Store

S = IntentState
#: A CSV an operator uploads: at most this many bytes and data rows.
MAX_CSV_BYTES = 5_000_000
MAX_ROWS = 100_000
#: The columns that can name a call, in the order they are tried.
ID_COLUMNS = ("intent_id", "call_id", "request_id", "key")
OUTCOMES = {"landed": True, "not_landed": False}


@dataclass(frozen=True, slots=True)
class Filter:
    """Which INDETERMINATE intents a bulk resolution takes: all of these that are given."""

    text: str
    tool: str | None = None
    reason: str | None = None
    call_id: str | None = None  # a prefix
    created_before: float | None = None
    created_after: float | None = None

    def matches(self, i: Intent) -> bool:
        return (
            i.state == S.INDETERMINATE
            and (self.tool is None or i.tool_id == self.tool)
            and (self.reason is None or i.reason == self.reason)
            and (self.call_id is None or i.call_id.startswith(self.call_id))
            and (self.created_before is None or i.created_at < self.created_before)
            and (self.created_after is None or i.created_at > self.created_after)
        )


_TERM = re.compile(r"^\s*(tool|reason|call_id|created)\s*(=|<|>)\s*(.*?)\s*$")


def parse_filter(terms: Sequence[str], now: float) -> Filter:
    """``tool=T``, ``reason=R``, ``call_id=PREFIX``, ``created<TIME``, ``created>TIME``
    (TIME: ``2h`` ago, an ISO 8601 time, epoch seconds), comma-separated or given apart;
    all must hold. At least one is needed: a filter never means "everything" by accident."""
    found: dict[str, Any] = {}
    parts = [p for t in terms for p in t.split(",") if p.strip()]
    if not parts:
        raise OperatorInputError(
            "a filter needs at least one of tool=, reason=, call_id=, created<, created>",
            field="filter",
        )
    for part in parts:
        m = _TERM.match(part)
        if m is None:
            raise OperatorInputError(
                f"filter term {part.strip()!r} is not one of tool=T, reason=R, call_id=PREFIX, "
                "created<TIME, created>TIME",
                field="filter",
            )
        name, op, value = m.groups()
        if not value:
            raise OperatorInputError(f"filter term {part.strip()!r} has no value", field="filter")
        if (name == "created") == (op == "="):
            raise OperatorInputError(
                f"filter term {part.strip()!r}: created takes < or >, the others take =",
                field="filter",
            )
        key = {"<": "created_before", ">": "created_after"}.get(op, name)
        if key in found:
            raise OperatorInputError(f"filter names {key} twice", field="filter")
        found[key] = parse_since(value, now) if name == "created" else value
    return Filter(text=",".join(p.strip() for p in parts), **found)


@dataclass(frozen=True, slots=True)
class Row:
    """One decision of a CSV: which call (by `column`), landed or not, an optional result."""

    line: int
    column: str
    ident: str
    landed: bool
    result: Any = None


def read_csv(text: str) -> list[Row]:
    """The rows of an operator's CSV: a header naming one of ``intent_id``, ``call_id``,
    ``request_id``, ``key`` and an ``outcome`` column (``landed`` or ``not_landed``), and
    optionally ``result`` (JSON, landed only). Anything else is refused with its line,
    before anything is changed."""
    if len(text.encode("utf-8", "replace")) > MAX_CSV_BYTES:
        raise OperatorInputError(f"the CSV is over {MAX_CSV_BYTES} bytes", field="csv")
    reader = csv.reader(io.StringIO(text.lstrip("\ufeff")))
    try:
        header = [h.strip().lower() for h in next(reader)]
    except StopIteration:
        raise OperatorInputError("the CSV is empty", field="csv") from None
    except csv.Error as exc:
        raise OperatorInputError(f"the CSV does not parse: {exc}", field="csv") from None
    ids = [c for c in ID_COLUMNS if c in header]
    if len(ids) != 1 or "outcome" not in header:
        raise OperatorInputError(
            "the CSV's first line must name one of intent_id, call_id, request_id, key and an "
            f"outcome column; it names {', '.join(header) or 'nothing'}",
            field="csv",
        )
    at, out = header.index(ids[0]), header.index("outcome")
    res = header.index("result") if "result" in header else None
    rows: list[Row] = []
    try:
        for cells in reader:
            line = reader.line_num
            if not any(c.strip() for c in cells):
                continue
            if len(rows) >= MAX_ROWS:
                raise OperatorInputError(f"the CSV has over {MAX_ROWS} rows", field="csv")
            if len(cells) != len(header):
                raise OperatorInputError(
                    f"CSV line {line}: {len(cells)} fields, the header has {len(header)}",
                    field="csv",
                )
            ident, outcome = cells[at].strip(), cells[out].strip().lower().replace(" ", "_")
            if not ident:
                raise OperatorInputError(f"CSV line {line}: no {ids[0]}", field="csv")
            if outcome not in OUTCOMES:
                raise OperatorInputError(
                    f"CSV line {line}: outcome {cells[out]!r} is not landed or not_landed",
                    field="csv",
                )
            raw = cells[res].strip() if res is not None else ""
            result = None
            if raw:
                if not OUTCOMES[outcome]:
                    raise OperatorInputError(
                        f"CSV line {line}: a result goes only with landed", field="csv"
                    )
                try:
                    result = parse_result(raw)
                except OperatorInputError as exc:
                    raise OperatorInputError(f"CSV line {line}: {exc}", field="csv") from None
            rows.append(Row(line, ids[0], ident, OUTCOMES[outcome], result))
    except csv.Error as exc:
        raise OperatorInputError(f"CSV line {reader.line_num}: {exc}", field="csv") from None
    if not rows:
        raise OperatorInputError("the CSV has a header but no rows", field="csv")
    return rows


@dataclass(frozen=True, slots=True)
class Item:
    """One decision the batch would make."""

    intent: Intent
    landed: bool
    result: Any
    source: str  # "filter", or "csv line N"


@dataclass(frozen=True, slots=True)
class Problem:
    """A row or an intent the batch leaves alone, and why."""

    source: str
    ident: str
    problem: str


@dataclass(frozen=True, slots=True)
class Plan:
    """What a bulk resolution would change (`items`) and what it cannot (`problems`)."""

    source: str
    items: tuple[Item, ...]
    problems: tuple[Problem, ...] = ()

    def to_json(self) -> dict[str, Any]:
        return {
            "source": self.source,
            "would_resolve": [_item_json(i) for i in self.items],
            "problems": [_plain(p) for p in self.problems],
        }


def _plain(p: Problem) -> dict[str, str]:
    return {"source": p.source, "ident": p.ident, "problem": p.problem}


def _item_json(i: Item) -> dict[str, Any]:
    return {
        "intent_id": i.intent.id,
        "call_id": i.intent.call_id,
        "tool_id": i.intent.tool_id,
        "reason": i.intent.reason,
        "created_at": i.intent.created_at,
        "decision": "landed" if i.landed else "not_landed",
        "source": i.source,
    }


def _open_intents(store: Store) -> list[Intent]:
    return store.list_intents(state=S.INDETERMINATE, limit=MAX_LIMIT)


def plan_filter(store: Store, flt: Filter, *, landed: bool) -> Plan:
    """Every INDETERMINATE intent the filter takes, oldest first, with one decision."""
    rows = store.list_intents(
        state=S.INDETERMINATE, tool_id=flt.tool, since=flt.created_after, limit=MAX_LIMIT
    )
    items = tuple(Item(i, landed, None, "filter") for i in rows if flt.matches(i))
    return Plan(source=f"filter {flt.text}", items=items)


def plan_csv(store: Store, rows: Sequence[Row], *, name: str, text: str) -> Plan:
    """Each CSV row matched to the INDETERMINATE intent it names; rows that match none (or
    an intent already decided) become problems. Two rows deciding one intent differently
    refuse the whole file."""
    index: dict[tuple[str, str], Intent] = {}
    for i in _open_intents(store):
        for column, value in (("intent_id", i.id), ("call_id", i.call_id),
                              ("request_id", i.request_id), ("key", i.key)):
            if value is not None:
                index.setdefault((column, value), i)
    chosen: dict[str, Item] = {}
    problems: list[Problem] = []
    for r in rows:
        where = f"csv line {r.line}"
        intent = index.get((r.column, r.ident))
        if intent is None:
            problems.append(Problem(where, r.ident, _why_unmatched(store, r)))
            continue
        before = chosen.get(intent.id)
        if before is not None:
            if before.landed != r.landed:
                raise OperatorInputError(
                    f"{before.source} and {where} decide intent {intent.id} differently",
                    field="csv",
                )
            continue
        chosen[intent.id] = Item(intent, r.landed, r.result, where)
    digest = hashlib.sha256(text.encode("utf-8", "replace")).hexdigest()[:16]
    return Plan(source=f"csv {name} sha256:{digest}", items=tuple(chosen.values()),
                problems=tuple(problems))


def _why_unmatched(store: Store, r: Row) -> str:
    found = None
    if r.column == "intent_id":
        found = store.get_intent(r.ident)
    elif r.column == "call_id":
        found = store.get_by_call_id(r.ident)
    if found is not None:
        return f"intent {found.id} is {found.state.value}, not INDETERMINATE"
    return f"no INDETERMINATE intent has {r.column} {r.ident!r}"


@dataclass(frozen=True, slots=True)
class Report:
    """What a bulk resolution did: its batch id, the intents it resolved, and those it did
    not (decided by someone else first, or matching nothing)."""

    batch: str
    source: str
    resolved: tuple[Item, ...]
    refused: tuple[Problem, ...] = field(default=())

    def to_json(self) -> dict[str, Any]:
        return {
            "batch": self.batch,
            "source": self.source,
            "resolved": [_item_json(i) for i in self.resolved],
            "refused": [_plain(p) for p in self.refused],
        }


def new_batch_id() -> str:
    return "rb_" + secrets.token_hex(8)


def apply(store: Store, plan: Plan, *, operator: str | Identity, reason: str,
          batch: str | None = None) -> Report:
    """Resolve every item of the plan, each in its own compare-and-set, all under one
    batch id; an intent someone decided meanwhile is reported, never decided twice."""
    batch = batch or new_batch_id()
    audit = {"batch": batch, "batch_source": plan.source, "batch_size": len(plan.items)}
    done: list[Item] = []
    refused = list(plan.problems)
    for item in plan.items:
        try:
            resolve(store, item.intent.id, landed=item.landed, result=item.result,
                    operator=operator, reason=reason, batch=audit)
        except NotIndeterminateError as exc:
            refused.append(Problem(item.source, item.intent.id, str(exc)))
            continue
        done.append(item)
    return Report(batch, plan.source, tuple(done), tuple(refused))


def plan_lines(plan: Plan) -> str:
    """The plan as the console carries it from its preview to its confirmation: one
    ``intent_id,landed|not_landed[,result JSON]`` per line."""
    out = io.StringIO()
    w = csv.writer(out, lineterminator="\n")
    for i in plan.items:
        w.writerow([i.intent.id, "landed" if i.landed else "not_landed",
                    "" if i.result is None else _json(i.result)])
    return out.getvalue()


def _json(value: Any) -> str:
    from poimen._core.keys import encode_value

    return encode_value(value, "result")


def plan_from_lines(store: Store, text: str, *, source: str) -> Plan:
    """The confirmed plan, read back: each intent as it is now (an intent decided since the
    preview is a problem, not a decision)."""
    items: list[Item] = []
    problems: list[Problem] = []
    seen: set[str] = set()
    try:
        rows = list(csv.reader(io.StringIO(text)))
    except csv.Error as exc:
        raise OperatorInputError(f"the plan does not parse: {exc}", field="plan") from None
    if len(rows) > MAX_ROWS:
        raise OperatorInputError(f"the plan has over {MAX_ROWS} rows", field="plan")
    for n, cells in enumerate(rows, 1):
        if not cells:
            continue
        if len(cells) != 3 or cells[1] not in OUTCOMES or cells[0] in seen:
            raise OperatorInputError(f"plan line {n} is not one the preview made", field="plan")
        seen.add(cells[0])
        landed = OUTCOMES[cells[1]]
        result = parse_result(cells[2]) if cells[2] else None
        if result is not None and not landed:
            raise OperatorInputError(f"plan line {n}: a result goes only with landed",
                                     field="plan")
        intent = store.get_intent(cells[0])
        if intent is None:
            problems.append(Problem(f"plan line {n}", cells[0], "no such intent"))
        elif intent.state != S.INDETERMINATE:
            problems.append(Problem(f"plan line {n}", cells[0],
                                    f"intent {intent.id} is {intent.state.value} now"))
        else:
            items.append(Item(intent, landed, result, f"plan line {n}"))
    return Plan(source=source, items=tuple(items), problems=tuple(problems))
