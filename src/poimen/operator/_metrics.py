"""What the log says, as metrics: a snapshot of a store (intents by tool and state, the open
Indeterminate ones and the oldest one's age, unfinished intents, the outbox backlog) for the
OpenTelemetry gauges, and the Prometheus text format for the console's ``/metrics``.

The text format is written here rather than with a client library: it is a few lines of
``name{label="value"} number``, and the console should not need another dependency.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from poimen._core.intents import IntentState
from poimen.operator._ageing import Oldest, oldest_by_tool
from poimen.store._base import Store

S = IntentState
#: How many undelivered notifications a snapshot counts at most (reading more is slow).
BACKLOG_CAP = 100_000


@dataclass(frozen=True, slots=True)
class Snapshot:
    """The log at one moment: `counts` by (tool, state); ages in seconds."""

    counts: Mapping[tuple[str, str], int]
    oldest_indeterminate_age: float
    outbox_backlog: int
    # Per tool, the oldest waiting call's age.
    oldest: Oldest = field(default_factory=lambda: Oldest({}, {}))

    def by_tool(self, state: IntentState) -> dict[str, int]:
        out: dict[str, int] = {}
        for (tool, st), n in self.counts.items():
            if st == state:
                out[tool] = out.get(tool, 0) + n
        return out


def snapshot(store: Store) -> Snapshot:
    now = store.now()
    counts = store.counts()
    oldest = store.list_intents(state=S.INDETERMINATE, limit=1)
    backlog = len(store.due_notifications(float(2**62), BACKLOG_CAP))
    return Snapshot(
        counts=counts,
        oldest_indeterminate_age=max(0.0, now - oldest[0].created_at) if oldest else 0.0,
        outbox_backlog=backlog,
        oldest=oldest_by_tool(store, counts, now),
    )


class DenialCounter:
    """Denials by tool since the log began, read incrementally: each read fetches the denials
    recorded since the last one (and those of the last few seconds again, skipped by id)."""

    PAGE = 1000
    # Writers stamp a denial a little before it commits: read back this far.
    SLACK = 5.0

    def __init__(self) -> None:
        self._by_tool: dict[str, int] = {}
        self._last_id = 0
        self._last_at: float | None = None
        self._lock = threading.Lock()

    def read(self, store: Store) -> dict[str, int]:
        with self._lock:
            since = None if self._last_at is None else self._last_at - self.SLACK
            limit = self.PAGE
            while True:
                page = store.denials(since=since, limit=limit)
                for d in page:
                    if d.id > self._last_id:
                        self._by_tool[d.tool_id] = self._by_tool.get(d.tool_id, 0) + 1
                        self._last_id = d.id
                    self._last_at = d.at if self._last_at is None else max(self._last_at, d.at)
                if len(page) < limit:
                    return dict(self._by_tool)
                later = page[-1].at - self.SLACK
                if since is not None and later <= since:
                    limit *= 2  # a whole page within the slack: read more of it at once
                else:
                    since = later


# The Prometheus text format (version 0.0.4).

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


@dataclass(frozen=True, slots=True)
class Family:
    name: str
    kind: str  # "gauge" or "counter"
    help: str
    samples: tuple[tuple[Mapping[str, str], float], ...]


def _label(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _number(v: float) -> str:
    if math.isnan(v):
        return "NaN"
    if math.isinf(v):
        return "+Inf" if v > 0 else "-Inf"
    return str(int(v)) if float(v).is_integer() and abs(v) < 2**53 else repr(float(v))


def prometheus_text(families: Iterable[Family]) -> str:
    lines: list[str] = []
    for f in families:
        lines.append(f"# HELP {f.name} {f.help}")
        lines.append(f"# TYPE {f.name} {f.kind}")
        for labels, value in f.samples:
            inner = ",".join(f'{k}="{_label(v)}"' for k, v in sorted(labels.items()))
            lines.append(
                f"{f.name}{{{inner}}} {_number(value)}" if inner else f"{f.name} {_number(value)}"
            )
    return "\n".join(lines) + "\n"


def store_families(store: Store, denials: DenialCounter) -> list[Family]:
    """The console's metrics: everything read from the log, so any process can serve them."""
    began = time.perf_counter()
    snap = snapshot(store)
    by_tool = denials.read(store)

    def per_tool(state: IntentState) -> tuple[tuple[Mapping[str, str], float], ...]:
        return tuple(({"tool": t}, float(n)) for t, n in sorted(snap.by_tool(state).items()))

    return [
        Family(
            "poimen_intents",
            "gauge",
            "Intents in the log by tool and state (calls by tool and outcome).",
            tuple(({"tool": t, "state": s}, float(n)) for (t, s), n in sorted(snap.counts.items())),
        ),
        Family(
            "poimen_indeterminate_open",
            "gauge",
            "INDETERMINATE intents waiting for an operator, by tool.",
            per_tool(S.INDETERMINATE),
        ),
        Family(
            "poimen_indeterminate_oldest_age_seconds",
            "gauge",
            "Age of the oldest INDETERMINATE intent (0 when there is none).",
            (({}, snap.oldest_indeterminate_age),),
        ),
        Family(
            "poimen_indeterminate_oldest_seconds",
            "gauge",
            "Per tool, how long the oldest INDETERMINATE intent has existed (since its call).",
            tuple(({"tool": t}, age) for t, age in sorted(snap.oldest.indeterminate.items())),
        ),
        Family(
            "poimen_approval_oldest_seconds",
            "gauge",
            "Per tool, how long the oldest call awaiting approval has waited.",
            tuple(({"tool": t}, age) for t, age in sorted(snap.oldest.approval.items())),
        ),
        Family(
            "poimen_intents_unfinished",
            "gauge",
            "DISPATCHED intents (running, or waiting for recovery), by tool.",
            per_tool(S.DISPATCHED),
        ),
        Family(
            "poimen_approvals_awaiting",
            "gauge",
            "Calls awaiting an operator's approval, by tool.",
            per_tool(S.AWAITING_APPROVAL),
        ),
        Family(
            "poimen_outbox_backlog",
            "gauge",
            f"Notifications not yet delivered (counted up to {BACKLOG_CAP}).",
            (({}, float(snap.outbox_backlog)),),
        ),
        Family(
            "poimen_denials_total",
            "counter",
            "Writes the capability layer denied, by tool.",
            tuple(({"tool": t}, float(n)) for t, n in sorted(by_tool.items())),
        ),
        Family(
            "poimen_metrics_read_seconds",
            "gauge",
            "How long reading these metrics from the log took.",
            (({}, time.perf_counter() - began),),
        ),
    ]
