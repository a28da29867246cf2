"""A spill beside a settle and the readers of a history: the store's statements on one intent
whose history is in its row (docs/verification.md, "The rules of issue 20").

An intent on the happy path holds its attempt 1 and its events in its own row (schema 7,
`store/_inline.py`). A write off that path on the same fence (a deferral, an unknown outcome,
undo's event) first spills them: one transaction that takes the row's lock, writes attempt 1
and the events into their tables, and clears the row's flag. Beside it:

- the owner's settle, on PostgreSQL one statement (`postgres._SETTLE`): it takes its snapshot
  when it starts, waits for the row's lock, then re-checks the row's newest version (READ
  COMMITTED); the rest of the statement (ending attempt 1 in the attempts table, writing the
  event) sees its snapshot only. As built it matches only where its snapshot put the history,
  else it falls back to a write whose statements each see what is committed;
- readers of the history (`store.events`, `store.attempts`, prune's `histories`): the tables,
  then, if they hold nothing, the row. As built both in one snapshot.

The database is modelled as PostgreSQL documents it: a transaction's writes appear at its
commit; a statement sees the snapshot it started with, except the row an UPDATE locks, which
it re-reads. Properties: a COMPLETED intent's attempt 1 has ended; a reader never finds a
dispatched intent without its attempt 1 and events.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import NamedTuple

from poimen._core.intents import IntentState
from verification.model._focus import Focused, Step
from verification.model._world import Rules, put

S = IntentState


@dataclass(frozen=True, slots=True)
class SpillConfig:
    """One bounded world."""

    readers: int = 1
    spills: int = 1  # writers on the same fence that spill (a deferral, an unknown outcome)
    max_states: int = 100_000

    def describe(self) -> str:
        return f"spill vs settle and readers: readers={self.readers} spills={self.spills}"

    def system(self, rules: Rules) -> Spill:
        return Spill(self, rules)


class Db(NamedTuple):
    """What is committed."""

    st: IntentState
    inline: bool  # attempt 1 and the events are in the row
    attempt: str  # attempt 1 in its table: "" (none), "open", "ended"
    events: int  # events in their table


class State(NamedTuple):
    db: Db
    locked: int  # the spill transaction holding the row's lock, -1: none
    spills: tuple[str, ...]  # each: idle, locked, done
    settle: tuple[str, Db | None]  # idle, started (its snapshot), done
    readers: tuple[tuple[str, Db | None], ...]  # idle, tables (what they held), done


class Spill(Focused):
    name = "spill"
    cfg: SpillConfig

    def initial(self) -> State:
        c = self.cfg
        return State(
            Db(S.DISPATCHED, True, "", 0),
            -1,
            ("idle",) * c.spills,
            ("idle", None),
            (("idle", None),) * c.readers,
        )

    def check(self, s: State) -> str | None:
        d = s.db
        if d.st == S.COMPLETED and not d.inline and d.attempt != "ended":
            return "the intent is COMPLETED and its attempt 1 never ended"
        return None

    def settled(self, s: State) -> bool:
        return (
            all(x == "done" for x in s.spills)
            and s.settle[0] == "done"
            and all(r[0] == "done" for r in s.readers)
        )

    def successors(self, s: State) -> Iterator[Step]:
        for k, x in enumerate(s.spills):
            yield from self._spill(s, k, x)
        yield from self._settle(s)
        for k, r in enumerate(s.readers):
            yield from self._reader(s, k, r)

    def _spill(self, s: State, k: int, x: str) -> Iterator[Step]:
        who = f"spill {k}"
        if x == "idle" and s.locked < 0:
            yield Step((who, "locks the row (FOR UPDATE)"),
                       s._replace(locked=k, spills=put(s.spills, k, "locked")))
        elif x == "locked":
            d = s.db
            if d.inline:  # attempt 1 and the events, as the row says, into their tables
                ended = d.st == S.COMPLETED
                d = Db(d.st, False, "ended" if ended else "open", 1 + ended)
            d = d._replace(events=d.events + (d.st == S.DISPATCHED))  # its own write's event
            yield Step((who, "spills and writes; commits"),
                       s._replace(db=d, locked=-1, spills=put(s.spills, k, "done")))

    def _settle(self, s: State) -> Iterator[Step]:
        pc, snap = s.settle
        d = s.db
        if pc == "idle":
            yield Step(("settle", "the statement starts: its snapshot"),
                       s._replace(settle=("started", d)))
        elif pc == "started" and s.locked < 0:
            assert snap is not None
            # The UPDATE re-checks the newest row (fence, DISPATCHED); as built, also that
            # the row's history is where the snapshot saw it.
            match = d.st == S.DISPATCHED and (
                not self.rules.settle_checks_snapshot or d.inline == snap.inline
            )
            if match and d.inline:
                nd = d._replace(st=S.COMPLETED)
                label = "matches the row: COMPLETED, its history in the row"
            elif match:
                # Attempt 1 and the event as the snapshot sees them: a row spilled since
                # is not there for this statement.
                att = "ended" if snap.attempt else d.attempt
                nd = d._replace(st=S.COMPLETED, attempt=att, events=d.events + 1)
                label = "matches the row: COMPLETED; ends attempt 1 " + (
                    "(in its snapshot)" if snap.attempt else "(not in its snapshot: none)"
                )
            else:
                # The shared write: each statement sees what is committed.
                nd = d._replace(st=S.COMPLETED) if d.inline else d._replace(
                    st=S.COMPLETED, attempt="ended", events=d.events + 1
                )
                label = "matches nothing; the fallback write settles it"
            yield Step(("settle", label), s._replace(db=nd, settle=("done", None)))

    def _reader(self, s: State, k: int, r: tuple[str, Db | None]) -> Iterator[Step]:
        who = f"reader {k}"
        pc, tables = r
        d = s.db
        if pc == "idle" and self.rules.history_one_snapshot:
            found = d.attempt != "" or d.inline
            label = "reads the tables and the row in one snapshot"
            yield self._read(s, k, who, label, found)
        elif pc == "idle":
            yield Step((who, "reads the tables" + ("" if d.attempt else ": nothing")),
                       s._replace(readers=put(s.readers, k, ("tables", d))))
        elif pc == "tables":
            assert tables is not None
            found = tables.attempt != "" or d.inline
            yield self._read(s, k, who, "then the row", found)

    def _read(self, s: State, k: int, who: str, label: str, found: bool) -> Step:
        nxt = s._replace(readers=put(s.readers, k, ("done", None)))
        if found:
            return Step((who, f"{label}: attempt 1 and its events"), nxt)
        return Step((who, f"{label}: no history"), nxt, False,
                    "a reader found a dispatched intent without attempt 1 or events")

    def show(self, s: State) -> list[str]:
        d = s.db
        return [
            f"intent: {d.st.value}, history in the "
            + ("row" if d.inline else f"tables (attempt 1 {d.attempt or 'missing'}, "
               f"{d.events} events)"),
            f"spills: {list(s.spills)}; settle: {s.settle[0]}; "
            f"readers: {[r[0] for r in s.readers]}",
        ]
