"""Bulk reconciliation after an email outage: hundreds of Indeterminate calls resolved in one
audited batch, from a filter or from a CSV built from the provider's sent log (the witness),
with a dry run first; a single resolve racing the batch leaves exactly one decision per
intent, on both backends."""

from __future__ import annotations

import csv
import json
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from poimen import Evidence, IntentState, Kernel
from poimen._core.intents import Intent
from poimen.errors import NotIndeterminateError
from poimen.operator import _reconcile as rc
from poimen.store import open_store
from poimen.testing import ProviderClient, ProviderProcess
from tests.integration.operator_app import poimen
from tests.integration.outage_app import MAIL, register_mail

S = IntentState


def outage(
    url: str, provider: str, n: int, *, prefix: str = "out", now: float | None = None
) -> list[Intent]:
    """`n` email calls whose connection broke: the even ones after the message went out
    (it is in the provider's sent log), the odd ones before. All INDETERMINATE."""
    store = open_store(url)
    if now is not None:
        store.now = lambda: now  # type: ignore[method-assign]
    k = Kernel(store, notifiers=[])
    register_mail(k, provider, evidence=Evidence(lambda ctx, call: []))
    import os

    os.environ["POIMEN_TEST_OUTAGE"] = "1"
    try:
        with k:
            outs = [
                k.call(MAIL, {"to": f"{prefix}{i}@example.com", "subject": "receipt",
                              "land": i % 2 == 0}, call_id=f"{prefix}/{i}")
                for i in range(n)
            ]
            intents = [k.store.get_intent(o.intent_id) for o in outs]
    finally:
        del os.environ["POIMEN_TEST_OUTAGE"]
    assert all(i is not None and i.state == S.INDETERMINATE for i in intents)
    return [i for i in intents if i is not None]


def states(url: str, intents: list[Intent]) -> dict[str, tuple[S, list[Any]]]:
    store = open_store(url, migrate=False)
    try:
        out = {}
        for i in intents:
            now = store.get_intent(i.id)
            assert now is not None
            out[i.call_id] = (now.state, [e for e in store.events(i.id) if e.kind == "resolved"])
        return out
    finally:
        store.close()


def sent_calls(ledger: ProviderClient) -> set[str]:
    return {e["body"]["meta"]["poimen_call"] for e in ledger.entries(kind="plain")}


def test_a_csv_from_the_sent_log_resolves_hundreds_in_one_audited_batch(
    tmp_path: Path, store_url: str, provider: ProviderProcess, ledger: ProviderClient
) -> None:
    intents = outage(store_url, provider.url, 300)
    landed = sent_calls(ledger)
    assert len(landed) == 150
    # The operator's export: every call of the outage, landed when the provider sent it.
    export = tmp_path / "sent-log-export.csv"
    with export.open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["call_id", "outcome", "result"])
        for i in intents:
            sent = i.call_id in landed
            w.writerow([i.call_id, "landed" if sent else "not_landed",
                        '{"sent": true}' if sent else ""])
        w.writerow(["out/999", "landed", ""])  # a call that is not in this log
    before = states(store_url, intents)

    dry = poimen("resolve", "--from-csv", str(export), "--dry-run", "--json", db=store_url)
    assert dry.returncode == 0, dry.stderr
    plan = json.loads(dry.stdout)
    assert plan["dry_run"] is True and len(plan["would_resolve"]) == 300
    assert {p["call_id"] for p in plan["would_resolve"] if p["decision"] == "landed"} == landed
    assert plan["problems"] == [{"source": "csv line 302", "ident": "out/999",
                                 "problem": "no INDETERMINATE intent has call_id 'out/999'"}]
    assert states(store_url, intents) == before  # a dry run changes nothing

    r = poimen("resolve", "--from-csv", str(export), "--operator", "ana", "--reason",
               "reconciled with the provider's sent log", "--json", db=store_url)
    assert r.returncode == 1, r.stderr  # one row matched nothing: said, and exit 1
    report = json.loads(r.stdout)
    batch = report["batch"]
    assert batch.startswith("rb_") and len(report["resolved"]) == 300
    assert [p["ident"] for p in report["refused"]] == ["out/999"]
    after = states(store_url, intents)
    for i in intents:
        state, events = after[i.call_id]
        # Each decision is the witness's: landed exactly when the provider sent it.
        assert state == (S.RESOLVED_LANDED if i.call_id in landed else S.RESOLVED_NOT_LANDED)
        [event] = events
        detail = json.loads(event.detail or "{}")
        assert detail["batch"] == batch and detail["batch_size"] == 300
        assert detail["batch_source"].startswith("csv sent-log-export.csv sha256:")
        assert detail["operator"] == "ana" and detail["identified_by"] == "cli"
    assert len(ledger.entries(kind="plain")) == 150  # nothing was sent again

    again = poimen("resolve", "--from-csv", str(export), "--dry-run", "--json", db=store_url)
    assert again.returncode == 1 and json.loads(again.stdout)["would_resolve"] == []


def test_a_filter_resolves_the_outage_window_after_a_dry_run(
    store_url: str, provider: ProviderProcess
) -> None:
    old = outage(store_url, provider.url, 200, prefix="old", now=time.time() - 7200)
    new = outage(store_url, provider.url, 20, prefix="new")
    terms = "tool=mail.send,reason=unsafe_unknown_outcome,created<1h"
    dry = poimen("resolve", "--filter", terms, "--not-landed", "--dry-run", db=store_url)
    assert dry.returncode == 0, dry.stderr
    assert "would resolve 200; nothing was changed" in dry.stdout
    assert all(i.id in dry.stdout for i in old) and not any(i.id in dry.stdout for i in new)
    assert {s for s, _ in states(store_url, old + new).values()} == {S.INDETERMINATE}

    r = poimen("resolve", "--filter", terms, "--not-landed", "--operator", "ana", "--reason",
               "the provider was down from 10:00 to 11:00; nothing went out", db=store_url)
    assert r.returncode == 0, r.stderr
    assert "resolved 200 by ana" in r.stdout
    batch = r.stdout.split()[1]
    for call_id, (state, events) in states(store_url, old).items():
        assert state == S.RESOLVED_NOT_LANDED, call_id
        assert json.loads(events[0].detail or "{}")["batch_source"] == f"filter {terms}"
        assert json.loads(events[0].detail or "{}")["batch"] == batch
    assert {s for s, _ in states(store_url, new).values()} == {S.INDETERMINATE}


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--filter", "colour=red", "--landed"], "filter term 'colour=red' is not one of"),
        (["--filter", "created=2h", "--landed"], "created takes < or >"),
        (["--filter", "tool=mail.send"], "--filter needs --landed or --not-landed"),
        (["--filter", " , ", "--landed"], "a filter needs at least one of"),
        (["--filter", "tool=a", "--from-csv", "x.csv"], "do not go together"),
        (["x", "--filter", "tool=a", "--landed"], "not both"),
        (["--filter", "tool=mail.send", "--landed"], "resolve needs --reason"),
        (["--dry-run", "x", "--landed"], "--dry-run goes with --filter or --from-csv"),
    ],
)
def test_a_bad_bulk_resolve_is_a_usage_error_and_changes_nothing(
    sqlite_url: str, provider: ProviderProcess, args: list[str], message: str
) -> None:
    intents = outage(sqlite_url, provider.url, 2)
    r = poimen("resolve", *args, "--operator", "ana", db=sqlite_url)
    assert r.returncode == 2 and message in r.stderr, (r.returncode, r.stderr)
    assert {s for s, _ in states(sqlite_url, intents).values()} == {S.INDETERMINATE}


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("call_id\nout/0\n", "must name one of intent_id, call_id, request_id, key and an outcome"),
        ("call_id,outcome\nout/0,maybe\n", "CSV line 2: outcome 'maybe' is not landed"),
        ("call_id,outcome\nout/0,landed\nout/0,not_landed\n",
         "csv line 2 and csv line 3 decide intent"),
        ("call_id,outcome,result\nout/1,not_landed,{}\n", "CSV line 2: a result goes only"),
        ("call_id,outcome,result\nout/0,landed,{nope\n", "CSV line 2: result is not valid JSON"),
        ("call_id,outcome\nout/0\n", "CSV line 2: 1 fields, the header has 2"),
        ("call_id,outcome\n", "the CSV has a header but no rows"),
        ("", "the CSV is empty"),
    ],
)
def test_a_bad_csv_is_refused_with_its_line_before_anything_changes(
    tmp_path: Path, sqlite_url: str, provider: ProviderProcess, text: str, message: str
) -> None:
    intents = outage(sqlite_url, provider.url, 2)
    path = tmp_path / "export.csv"
    path.write_text(text)
    r = poimen("resolve", "--from-csv", str(path), "--operator", "ana", "--reason", "x",
               db=sqlite_url)
    assert r.returncode == 2 and message in r.stderr, (r.returncode, r.stderr)
    assert {s for s, _ in states(sqlite_url, intents).values()} == {S.INDETERMINATE}


class Meeting:
    """A store whose `resolve` of an intent waits until the other decider arrives at the
    same intent: every intent is decided by both at once, in two threads, each with its own
    connections."""

    def __init__(self, url: str, barriers: dict[str, threading.Barrier]) -> None:
        self._inner = open_store(url, migrate=False)
        self._barriers = barriers

    def resolve(self, intent_id: str, **kw: Any) -> Intent:
        self._barriers[intent_id].wait(60)
        return self._inner.resolve(intent_id, **kw)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


def test_a_single_resolve_racing_the_batch_leaves_exactly_one_decision_per_intent(
    store_url: str, provider: ProviderProcess
) -> None:
    intents = outage(store_url, provider.url, 120, prefix="race")
    barriers = {i.id: threading.Barrier(2) for i in intents}
    bulk_store, single_store = Meeting(store_url, barriers), Meeting(store_url, barriers)
    report: list[rc.Report] = []
    singles: dict[str, bool] = {}
    errors: list[BaseException] = []
    plan = rc.plan_filter(bulk_store, rc.parse_filter(["call_id=race/"], time.time()),  # type: ignore[arg-type]
                          landed=False)
    assert len(plan.items) == 120

    def bulk() -> None:
        try:
            report.append(rc.apply(bulk_store, plan, operator="bulk", reason="outage"))  # type: ignore[arg-type]
        except BaseException as exc:
            errors.append(exc)

    def single() -> None:
        from poimen.operator import _ops as op

        try:
            for i in [item.intent for item in plan.items]:  # meeting the batch at each one
                try:
                    op.resolve(single_store, i.id, landed=True, operator="single",  # type: ignore[arg-type]
                               reason="saw it")
                    singles[i.id] = True
                except NotIndeterminateError:
                    singles[i.id] = False
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=bulk), threading.Thread(target=single)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    bulk_store.close()
    single_store.close()
    assert errors == [] and len(report) == 1
    by_bulk = {i.intent.id for i in report[0].resolved}
    by_single = {k for k, won in singles.items() if won}
    # What each decider says it did partitions the intents ...
    assert by_bulk.isdisjoint(by_single) and by_bulk | by_single == {i.id for i in intents}
    assert {p.ident for p in report[0].refused} == by_single
    # ... and the log holds exactly that: one decision per intent, the winner's.
    for call_id, (state, events) in states(store_url, intents).items():
        [event] = events
        intent_id = next(i.id for i in intents if i.call_id == call_id)
        if intent_id in by_bulk:
            assert state == S.RESOLVED_NOT_LANDED and event.actor == "bulk"
            assert json.loads(event.detail or "{}")["batch"] == report[0].batch
        else:
            assert state == S.RESOLVED_LANDED and event.actor == "single"
