"""The intent diff: what one run called that another did not, call by call.

    from poimen.sandbox import diff
    d = diff("sqlite:///yesterday.db", "sqlite:///replay.db", scope="conv-42/")
    for e in d.differences: print(e.kind, e.call_id, e.effect, e.changes)

A log's calls are its intents and, in the log of a sandbox kernel (shadow or replay mode), the
calls it answered without dispatching (`poimen.store._sandbox.SandboxCall`). Calls are matched
by call id (with the scope cut off, so one log's ``run-1/`` can be compared with another's
``run-2/``). Two calls of rule 2 of `poimen.call_ids` (``scope/tool/digest/occurrence``)
whose arguments differ have different call ids; they are paired as "arguments changed" when
they share the scope, the tool and the occurrence, in call order.

Every log is opened read-only: a diff never writes to either of them.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Literal

from poimen._core.intents import Intent
from poimen.errors import PoimenError, StoreError
from poimen.operator._ops import REDACTED, is_secret_name, redact, redact_store_url
from poimen.store import Store, open_store
from poimen.store import _sandbox as records

__all__ = ["Call", "Entry", "IntentDiff", "diff", "json_changes", "log_name", "open_log"]

Kind = Literal["same", "arguments_changed", "tool_changed", "only_in_recording", "only_in_run"]
MAX_CALLS = 100_000
LABELS: dict[str, str] = {
    "same": "same",
    "arguments_changed": "arguments changed",
    "tool_changed": "tool changed",
    "only_in_recording": "only in recording",
    "only_in_run": "only in run",
}


@dataclass(frozen=True, slots=True)
class Call:
    """One call as a log holds it. `outcome` is the intent's state (``COMPLETED``, ...), or
    for a call a sandbox kernel did not dispatch, its answer (``would_have_called``,
    ``recorded``, ...); `id` is the intent id or the sandbox record id."""

    call_id: str
    tool_id: str
    effect: str
    args: Any
    args_hash: str
    outcome: str
    id: str
    created_at: float

    def to_json(self) -> dict[str, Any]:
        return {
            "call_id": self.call_id,
            "tool_id": self.tool_id,
            "effect": self.effect,
            "args": redact(self.args),
            "outcome": self.outcome,
            "id": self.id,
        }


@dataclass(frozen=True, slots=True)
class Entry:
    """One call of either run: the same in both, changed, or only in one of them. `changes`
    lists what differs in the arguments, recording to run (``path`` is a JSON pointer;
    ``recording`` or ``run`` is left out where that side has no value there)."""

    kind: Kind
    recording: Call | None
    run: Call | None
    changes: tuple[dict[str, Any], ...] = ()

    @property
    def call_id(self) -> str:
        side = self.run or self.recording
        assert side is not None
        return side.call_id

    @property
    def effect(self) -> str:
        """The effect class of the call (the run's, when both have it)."""
        side = self.run or self.recording
        assert side is not None
        return side.effect

    @property
    def tool_id(self) -> str:
        side = self.run or self.recording
        assert side is not None
        return side.tool_id

    def text(self) -> str:
        sign = {"same": "=", "only_in_recording": "-", "only_in_run": "+"}.get(self.kind, "~")
        head = f"{sign} {LABELS[self.kind]:<18} {self.effect:<10} {self.tool_id}"
        ids = self.call_id
        if self.recording and self.run and self.recording.call_id != self.run.call_id:
            ids = f"{self.recording.call_id} -> {self.run.call_id}"
        outcomes = " -> ".join(c.outcome for c in (self.recording, self.run) if c is not None)
        lines = [f"{head}  {ids}  [{outcomes}]"]
        if self.kind == "tool_changed":
            assert self.recording is not None and self.run is not None
            lines.append(f"    tool: {self.recording.tool_id} -> {self.run.tool_id}")
        lines += [f"    {change_text(c)}" for c in self.changes]
        if self.kind in ("only_in_recording", "only_in_run"):
            side = self.recording or self.run
            assert side is not None
            lines.append(f"    args {json.dumps(redact(side.args), ensure_ascii=False)}")
        return "\n".join(lines)

    def to_json(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "call_id": self.call_id,
            "tool_id": self.tool_id,
            "effect": self.effect,
            "recording": None if self.recording is None else self.recording.to_json(),
            "run": None if self.run is None else self.run.to_json(),
            "changes": list(self.changes),
        }


@dataclass(frozen=True, slots=True)
class IntentDiff:
    recording: str
    run: str
    scope: str | None
    run_scope: str | None
    entries: tuple[Entry, ...]

    @property
    def differences(self) -> list[Entry]:
        return [e for e in self.entries if e.kind != "same"]

    def counts(self) -> dict[str, int]:
        out = dict.fromkeys(LABELS, 0)
        for e in self.entries:
            out[e.kind] += 1
        return out

    def text(self, *, all_calls: bool = False) -> str:
        """For a terminal: the counts, then each difference (every call with `all_calls`)."""
        n = self.counts()
        scope = f", scope {self.scope}" if self.scope else ""
        if self.run_scope:
            scope += f" -> {self.run_scope}"
        lines = [
            f"recording {self.recording}\nrun       {self.run}{scope}",
            ", ".join(f"{v} {LABELS[k]}" for k, v in n.items()),
        ]
        for e in self.entries if all_calls else self.differences:
            lines.append(e.text())
        if not self.differences:
            lines.append("the run made the same calls as the recording")
        return "\n".join(lines)

    def to_json(self) -> dict[str, Any]:
        return {
            "recording": self.recording,
            "run": self.run,
            "scope": self.scope,
            "run_scope": self.run_scope,
            "counts": self.counts(),
            "entries": [e.to_json() for e in self.entries],
        }


# JSON differences.


def _pointer(path: str, key: str | int) -> str:
    return f"{path}/{str(key).replace('~', '~0').replace('/', '~1')}"


def _same(a: Any, b: Any) -> bool:
    # 1, 1.0 and true are different JSON: compare types too.
    return type(a) is type(b) and a == b


def json_changes(recording: Any, run: Any, path: str = "") -> list[dict[str, Any]]:
    """Where two JSON values differ: ``{"path", "recording", "run"}`` per difference, a side
    left out where it has no value (a key added or removed, a list grown or shrunk)."""
    if isinstance(recording, dict) and isinstance(run, dict):
        out: list[dict[str, Any]] = []
        for k in sorted(set(recording) | set(run), key=str):
            p = _pointer(path, k)
            if k not in run:
                out.append({"path": p, "recording": recording[k]})
            elif k not in recording:
                out.append({"path": p, "run": run[k]})
            else:
                out += json_changes(recording[k], run[k], p)
        return out
    if isinstance(recording, list) and isinstance(run, list):
        out = []
        for i in range(max(len(recording), len(run))):
            p = _pointer(path, i)
            if i >= len(run):
                out.append({"path": p, "recording": recording[i]})
            elif i >= len(recording):
                out.append({"path": p, "run": run[i]})
            else:
                out += json_changes(recording[i], run[i], p)
        return out
    if isinstance(recording, dict | list) or isinstance(run, dict | list):
        return [] if recording == run else [{"path": path, "recording": recording, "run": run}]
    return [] if _same(recording, run) else [{"path": path, "recording": recording, "run": run}]


def change_text(c: dict[str, Any]) -> str:
    """One change in a line: ``/to: "alice" -> "bob"``."""
    where = c["path"] or "(arguments)"
    old = json.dumps(c["recording"], ensure_ascii=False) if "recording" in c else "(none)"
    new = json.dumps(c["run"], ensure_ascii=False) if "run" in c else "(none)"
    return f"{where}: {old} -> {new}"


# Rule-2 call ids: scope/tool/digest/occurrence.


def rule2_slot(call_id: str, tool_id: str) -> tuple[str, int] | None:
    """(``scope/tool/``, occurrence) when `call_id` has rule 2's form for `tool_id`."""
    m = re.fullmatch(rf"(.*)/{re.escape(tool_id)}/[0-9a-f]{{16}}/([1-9][0-9]*)", call_id, re.S)
    if m is None:
        return None
    return f"{m.group(1)}/{tool_id}/", int(m.group(2))


# Reading a log.


def open_log(log: str | Store) -> tuple[Store, bool]:
    """A log to read: a Store as given, or a URL opened read-only without migrating it
    (a copy of a production log needs no write access). Returns (store, whether we opened
    it and must close it)."""
    if not isinstance(log, str):
        return log, False
    store = open_store(log, migrate=False, readonly=True)
    try:
        if store.schema_version() == 0:
            raise StoreError(f"{log} holds no poimen intent log", url=log)
    except BaseException:
        store.close()
        raise
    return store, True


def _of_intent(i: Intent) -> Call:
    return Call(i.call_id, i.tool_id, i.effect, _loads(i.args), i.args_hash, i.state.value, i.id,
                i.created_at)


def _of_record(r: records.SandboxCall) -> Call:
    return Call(r.call_id, r.tool_id, r.effect, _loads(r.args), r.args_hash, r.answer, r.id,
                r.created_at)


def _loads(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return text


def _paged(fetch: Any, prefix: str | None) -> Iterator[Any]:
    after = ""
    while True:
        page = fetch(prefix, after_id=after, limit=1000)
        yield from page
        if len(page) < 1000:
            return
        after = page[-1].id


def calls(store: Store, prefix: str | None, *, limit: int = MAX_CALLS) -> list[Call]:
    """Every call of a log whose call id starts with `prefix`, in the order they were made."""
    out: list[Call] = []
    for i in _paged(lambda *a, **k: records.intents(store, *a, **k), prefix):
        out.append(_of_intent(i))
        _check_size(out, limit, prefix)
    for r in _paged(lambda *a, **k: records.sandbox_calls(store, *a, **k), prefix):
        out.append(_of_record(r))
        _check_size(out, limit, prefix)
    out.sort(key=lambda c: (c.created_at, c.id))
    return out


def _check_size(out: list[Call], limit: int, prefix: str | None) -> None:
    if len(out) > limit:
        raise PoimenError(
            f"more than {limit} calls {'under ' + repr(prefix) if prefix else 'in the log'}: "
            "give a narrower scope (a run's call-id prefix)",
            field="scope",
        )


# The diff.


def diff(
    recording: str | Store,
    run: str | Store,
    *,
    scope: str | None = None,
    run_scope: str | None = None,
    limit: int = MAX_CALLS,
) -> IntentDiff:
    """Compare the calls under `scope` in the `recording` log with those under `run_scope`
    (default: `scope`) in the `run` log. Both are read only."""
    for name, value in (("scope", scope), ("run_scope", run_scope)):
        if value is not None and (not isinstance(value, str) or not value):
            raise PoimenError(f"{name} must be a non-empty call-id prefix, not {value!r}",
                              field=name)
    run_scope = scope if run_scope is None else run_scope
    a_store, close_a = open_log(recording)
    try:
        b_store, close_b = open_log(run)
        try:
            a = calls(a_store, scope, limit=limit)
            b = calls(b_store, run_scope, limit=limit)
        finally:
            if close_b:
                b_store.close()
    finally:
        if close_a:
            a_store.close()
    return IntentDiff(
        recording=log_name(recording),
        run=log_name(run),
        scope=scope,
        run_scope=run_scope if run_scope != scope else None,
        entries=tuple(match(a, b, scope, run_scope)),
    )


def log_name(log: str | Store) -> str:
    """The log's URL as it may be shown: the password and every secret-looking query value
    (``password=``, ``sslpassword=``, ``sslkey=``, ...) masked."""
    return redact_store_url(log if isinstance(log, str) else log.url)


def _key(c: Call, scope: str | None) -> str:
    return c.call_id[len(scope):] if scope else c.call_id


def _slot(c: Call, scope: str | None) -> tuple[str, int] | None:
    """A rule-2 call's (scope/tool/, occurrence), its scope cut off."""
    slot = rule2_slot(c.call_id, c.tool_id)
    if slot is None:
        return None
    stem, n = slot
    return (stem[len(scope):] if scope else stem), n


def _compare(a: Call, b: Call) -> Entry:
    if a.tool_id == b.tool_id and a.args_hash == b.args_hash:
        return Entry("same", a, b)
    changes = tuple(redact_change(c) for c in json_changes(a.args, b.args))
    return Entry("arguments_changed" if a.tool_id == b.tool_id else "tool_changed", a, b, changes)


def redact_change(c: dict[str, Any]) -> dict[str, Any]:
    """A change with the values under a secret-looking name hidden, as `poimen show` does."""
    names = [n.replace("~1", "/").replace("~0", "~") for n in c["path"].split("/")[1:]]
    secret = any(is_secret_name(n) for n in names)
    return {k: (REDACTED if secret else redact(v)) if k != "path" else v for k, v in c.items()}


def match(a: list[Call], b: list[Call], scope: str | None, run_scope: str | None) -> list[Entry]:
    """Pair the calls of two runs (each in call order) and order the entries by the
    recording, with the run's new calls where the run made them."""
    b_by_key = {_key(c, run_scope): c for c in b}
    pair: dict[str, Call] = {}  # recording call id -> run call
    for c in a:
        other = b_by_key.get(_key(c, scope))
        if other is not None:
            pair[c.call_id] = other
    taken = {c.id for c in pair.values()}
    # Rule 2: the same scope, tool and occurrence with other arguments.
    slots: dict[tuple[str, int], list[Call]] = {}
    for c in b:
        slot = _slot(c, run_scope) if c.id not in taken else None
        if slot is not None:
            slots.setdefault(slot, []).append(c)
    for c in a:
        if c.call_id in pair:
            continue
        slot = _slot(c, scope)
        if slot is not None and slots.get(slot):
            pair[c.call_id] = slots[slot].pop(0)
    taken = {c.id for c in pair.values()}

    index_in_a: dict[str, int] = {}
    positioned: list[tuple[tuple[int, int, int], Entry]] = []
    for i, c in enumerate(a):
        other = pair.get(c.call_id)
        entry = Entry("only_in_recording", c, None) if other is None else _compare(c, other)
        if other is not None:
            index_in_a[other.id] = i
        positioned.append(((i, 1, 0), entry))
    # A new call of the run goes just before the next call both runs made (after what the
    # recording did there instead), as a diff puts removals before additions.
    nxt = len(a)
    for j in range(len(b) - 1, -1, -1):
        c = b[j]
        if c.id in taken:
            nxt = index_in_a[c.id]
        else:
            positioned.append(((nxt, 0, j), Entry("only_in_run", None, c)))
    positioned.sort(key=lambda p: p[0])
    return [e for _, e in positioned]
