"""Shadow and replay modes against the provider's ledger (the witness, not the log): no run in
either mode changes it, divergences are detected and kept, recordings are only read."""

from __future__ import annotations

import asyncio
import hashlib
import os
import shutil
import stat
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from poimen import (
    Caps,
    Completed,
    Failed,
    IntentState,
    Kernel,
    Pending,
    ReadOnly,
    ToolContext,
    call_ids,
)
from poimen.errors import (
    CallIdMismatchError,
    DivergenceError,
    PoimenError,
    SandboxDeniedError,
)
from poimen.sandbox import diff
from poimen.store import _sandbox as records
from poimen.store import open_store
from poimen.testing import CHARGE, EMAIL, SHIP, ProviderClient, ProviderProcess, register_test_tools
from tests.conftest import fresh_postgres_database
from tests.integration.test_lifecycle import intent_of, orphan

S = IntentState
READ = "test.read"  # ReadOnly: reads the ledger's size
SNEAK = "test.sneak"  # ReadOnly, but tries to write

# Per tool: the recorded call's arguments, and a changed call's.
CASES: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {
    CHARGE: ({"order_id": "o-1", "amount_cents": 100}, {"order_id": "o-1", "amount_cents": 200}),
    SHIP: ({"order_id": "o-1", "address": "1 Main St"}, {"order_id": "o-1", "address": "2 Elm St"}),
    EMAIL: ({"to": "bob@example.com", "subject": "hi"}, {"to": "eve@example.com", "subject": "hi"}),
    READ: ({"kind": "plain"}, {"kind": "keyed"}),
}


@pytest.fixture
def sandbox_url(store_url: str, tmp_path: Path) -> Iterator[str]:
    """A second, empty log on the same backend as `store_url`: the sandbox kernel's own."""
    if store_url.startswith("sqlite"):
        yield f"sqlite:///{tmp_path / 'sandbox.db'}"
        return
    with fresh_postgres_database() as url:
        yield url


def tools(k: Kernel, provider_url: str) -> list[str]:
    """poimen's test tools (one per writing class) and two ReadOnly ones; the list grows by
    the id of each ReadOnly tool whose body runs."""
    register_test_tools(k, provider_url)
    host = httpx.URL(provider_url)
    caps = Caps(hosts=(f"{host.host}:{host.port}",))
    bodies: list[str] = []

    @k.tool(id=READ, effects=ReadOnly(), caps=caps, timeout=5)
    def read(ctx: ToolContext, kind: str) -> int:
        bodies.append(READ)
        return int(ctx.http.get(f"{provider_url}/ledger", params={"kind": kind}).json()["count"])

    @k.tool(id=SNEAK, effects=ReadOnly(), caps=caps, timeout=5)
    def sneak(ctx: ToolContext, to: str) -> Any:
        bodies.append(SNEAK)
        return ctx.http.post(f"{provider_url}/plain", json={"to": to}).json()

    return bodies


def record_run(url: str, provider_url: str, calls: list[tuple[str, dict[str, Any], str]]) -> None:
    with Kernel(url, notifiers=[]) as live:
        tools(live, provider_url)
        for tool, args, call_id in calls:
            assert isinstance(live.call(tool, args, call_id=call_id), Completed)


def log_rows(url: str) -> list[Any]:
    store = open_store(url, readonly=True)
    try:
        return store.list_intents(limit=1000)
    finally:
        store.close()


@pytest.mark.parametrize("mode", ["replay", "shadow"])
@pytest.mark.parametrize("tool", list(CASES))
def test_no_sandbox_run_changes_the_providers_ledger(
    store_url: str, sandbox_url: str, provider: ProviderProcess, ledger: ProviderClient,
    tool: str, mode: str,
) -> None:
    args, changed = CASES[tool]
    record_run(store_url, provider.url, [(tool, args, "run-1/a")])
    recorded = log_rows(store_url)
    witness = ledger.entries()
    assert witness or tool == READ  # the live run had its effect
    source = ({"recording": store_url, "on_divergence": "record"} if mode == "replay"
              else {"live": store_url})
    with Kernel(sandbox_url, mode=mode, notifiers=[], **source) as k:  # type: ignore[arg-type]
        bodies = tools(k, provider.url)
        k.launch()
        same = asyncio.run(k.acall(tool, args, call_id="run-1/a"))
        new = k.call(tool, changed, call_id="run-1/b")
        if mode == "shadow" and tool == READ:  # reads run for real, on the shadow log
            assert isinstance(same, Completed) and isinstance(new, Completed)
            assert same.result == _result(recorded[0].result) and same.intent_id != recorded[0].id
            assert bodies == [READ, READ]
        else:
            assert same == Completed(recorded[0].id, _result(recorded[0].result))
            reason = "would_have_called" if mode == "shadow" else "not_in_recording"
            assert isinstance(new, Pending) and new.reason == reason and new.terminal
            assert "not carried out" in new.for_model()
            assert bodies == []
            assert k.outcome("run-1/a") == same and k.outcome("run-1/b") == new
            assert k.wait_sync("run-1/b", timeout=0) == new
        unsafe = [d.target for d in k.denials() if d.reason == f"unsafe tool in {mode} mode"]
        assert unsafe == (["run-1/a", "run-1/b"] if tool == EMAIL else [])
    assert ledger.entries() == witness
    assert log_rows(store_url) == recorded  # the recording is never written


def _result(text: str | None) -> Any:
    import json

    return None if text is None else json.loads(text)


def test_shadow_mode_never_dispatches_idempotent_or_queryable_calls(
    store_url: str, provider: ProviderProcess, ledger: ProviderClient
) -> None:
    # Before sandbox records, shadow mode denied Unsafe calls only: these reached the provider.
    with Kernel(store_url, mode="shadow", notifiers=[]) as k:
        tools(k, provider.url)
        for tool in (CHARGE, SHIP, EMAIL):
            out = k.call(tool, CASES[tool][0], call_id=f"s-{tool}")
            assert isinstance(out, Pending) and out.reason == "would_have_called", out
            assert k.store.get_by_call_id(f"s-{tool}") is None  # no intent: nothing to recover
    assert ledger.entries() == []
    assert {r.tool_id for r in records.sandbox_calls(open_store(store_url), None)} == {
        CHARGE, SHIP, EMAIL}


def test_a_read_only_tool_that_writes_in_shadow_mode_is_denied_and_audited(
    store_url: str, sandbox_url: str, provider: ProviderProcess, ledger: ProviderClient
) -> None:
    record_run(store_url, provider.url, [])
    with Kernel(sandbox_url, mode="shadow", live=store_url, notifiers=[]) as k:
        bodies = tools(k, provider.url)
        out = k.call(SNEAK, {"to": "eve@example.com"}, call_id="s-1")
        assert isinstance(out, Failed) and "read_only" in out.error
        assert bodies == [SNEAK]
        [denial] = k.denials(SNEAK)
        assert denial.reason.startswith("read_only") and denial.action == "http"
    assert ledger.entries() == []


def test_every_kind_of_divergence_is_refused_with_what_differs(
    store_url: str, sandbox_url: str, provider: ProviderProcess, ledger: ProviderClient
) -> None:
    bob, eve = CASES[EMAIL]
    emails = call_ids.CallIds("conv-1")
    bob_id = emails.next(EMAIL, bob)
    record_run(store_url, provider.url, [
        (CHARGE, CASES[CHARGE][0], "conv-1/charge-a"),
        (CHARGE, CASES[CHARGE][0], "conv-1/charge-b"),
        (EMAIL, bob, bob_id),
    ])
    witness = ledger.entries()
    with Kernel(sandbox_url, mode="replay", recording=store_url, scope="conv-1/",
                notifiers=[]) as k:
        tools(k, provider.url)

        def refused(tool: str, args: dict[str, Any], call_id: str) -> DivergenceError:
            with pytest.raises(DivergenceError) as err:
                k.call(tool, args, call_id=call_id)
            assert isinstance(err.value, SandboxDeniedError)
            assert (err.value.call_id, err.value.tool_id) == (call_id, tool)  # type: ignore[attr-defined]
            return err.value

        e = refused(CHARGE, CASES[CHARGE][1], "conv-1/charge-a")
        assert e.data["kind"] == "arguments_changed"
        assert e.data["difference"] == [{"path": "/amount_cents", "recording": 100, "run": 200}]
        assert "/amount_cents: 100 -> 200" in str(e)

        e = refused(SHIP, CASES[SHIP][0], "conv-1/charge-b")
        assert (e.data["kind"], e.data["recorded_tool"]) == ("tool_changed", CHARGE)

        eve_id = call_ids.CallIds("conv-1").next(EMAIL, eve)  # rule 2: another call id
        e = refused(EMAIL, eve, eve_id)
        assert (e.data["kind"], e.data["recorded_call_id"]) == ("not_in_recording", bob_id)
        assert e.data["difference"] == [
            {"path": "/to", "recording": "bob@example.com", "run": "eve@example.com"}]

        e = refused(CHARGE, CASES[CHARGE][0], "conv-1/charge-c")
        assert (e.data["kind"], e.data["recorded_call_id"], e.data["difference"]) == (
            "not_in_recording", None, [])

        # Outside the scope, the recording's calls are not there for this replay.
        record_run(store_url, provider.url, [(CHARGE, CASES[CHARGE][0], "conv-2/charge")])
        witness = ledger.entries()
        assert refused(CHARGE, CASES[CHARGE][0], "conv-2/charge").data["kind"] == (
            "not_in_recording")

        # A refused call id asked again is refused again; with other arguments it is misused.
        assert refused(CHARGE, CASES[CHARGE][1], "conv-1/charge-a").data["kind"] == (
            "arguments_changed")
        with pytest.raises(CallIdMismatchError):
            k.call(CHARGE, CASES[CHARGE][0], call_id="conv-1/charge-a")
        kept = {r.call_id: r.answer for r in records.sandbox_calls(k.store, None)}
        assert kept == dict.fromkeys(
            ["conv-1/charge-a", "conv-1/charge-b", eve_id, "conv-1/charge-c", "conv-2/charge"],
            "refused")
    assert ledger.entries() == witness

    # The diff reports each divergence, and the recorded call the replay never made.
    d = diff(store_url, sandbox_url, scope="conv-1/")
    kinds = {(e.kind, e.call_id) for e in d.entries}
    assert kinds == {
        ("arguments_changed", "conv-1/charge-a"),
        ("tool_changed", "conv-1/charge-b"),
        ("arguments_changed", eve_id),  # paired with bob's call: the same tool and occurrence
        ("only_in_run", "conv-1/charge-c"),
    }
    [changed] = [e for e in d.entries if e.call_id == eve_id]
    assert changed.recording is not None and changed.recording.call_id == bob_id
    assert changed.effect == "unsafe" and changed.run is not None
    assert changed.run.outcome == "refused"


def test_divergences_answered_not_in_recording_let_the_run_go_on(
    store_url: str, sandbox_url: str, provider: ProviderProcess, ledger: ProviderClient
) -> None:
    record_run(store_url, provider.url, [
        (CHARGE, CASES[CHARGE][0], "r/1"), (EMAIL, CASES[EMAIL][0], "r/2")])
    witness = ledger.entries()
    with Kernel(sandbox_url, mode="replay", recording=store_url, on_divergence="record",
                notifiers=[]) as k:
        tools(k, provider.url)
        first = k.call(CHARGE, CASES[CHARGE][1], call_id="r/1")
        assert isinstance(first, Pending) and first.reason == "not_in_recording"
        assert k.call(CHARGE, CASES[CHARGE][1], call_id="r/1") == first  # the same answer
        assert isinstance(k.call(SHIP, CASES[SHIP][0], call_id="r/3"), Pending)
        [one, three] = records.sandbox_calls(k.store, None)
        assert (one.answer, three.answer) == ("not_in_recording", "not_in_recording")
    assert ledger.entries() == witness
    d = diff(store_url, sandbox_url)
    assert [(e.kind, e.call_id, e.effect) for e in d.entries] == [
        ("arguments_changed", "r/1", "idempotent"),
        ("only_in_recording", "r/2", "unsafe"),
        ("only_in_run", "r/3", "queryable"),
    ]


def test_replay_reads_a_read_only_copy_of_the_log(
    store_url: str, tmp_path: Path, provider: ProviderProcess, ledger: ProviderClient
) -> None:
    record_run(store_url, provider.url, [(CHARGE, CASES[CHARGE][0], "r/1")])
    witness = ledger.entries()
    if store_url.startswith("sqlite"):
        recording, undo, digest = _read_only_sqlite_copy(store_url, tmp_path)
    else:
        recording, undo, digest = _read_only_role(store_url)
    try:
        before = digest()
        with Kernel(f"sqlite:///{tmp_path / 'replay.db'}", mode="replay", recording=recording,
                    notifiers=[]) as k:
            tools(k, provider.url)
            out = k.call(CHARGE, CASES[CHARGE][0], call_id="r/1")
            assert isinstance(out, Completed) and out.result["key"].startswith("pk1_")
            with pytest.raises(DivergenceError):
                k.call(CHARGE, CASES[CHARGE][1], call_id="r/2")
        d = diff(recording, f"sqlite:///{tmp_path / 'replay.db'}")
        assert [e.kind for e in d.entries] == ["same", "only_in_run"]
        assert digest() == before
    finally:
        undo()
    assert ledger.entries() == witness


def _read_only_sqlite_copy(url: str, tmp_path: Path) -> tuple[str, Any, Any]:
    """The log copied into a folder nobody may write, the file itself read-only."""
    folder = tmp_path / "copy"
    folder.mkdir()
    src = Path(url[len("sqlite:///"):])
    for f in src.parent.glob(src.name + "*"):
        shutil.copy2(f, folder / f.name)
    copied = folder / src.name
    copied.chmod(stat.S_IRUSR | stat.S_IRGRP)
    folder.chmod(stat.S_IRUSR | stat.S_IXUSR)

    def undo() -> None:
        folder.chmod(stat.S_IRWXU)
        copied.chmod(stat.S_IRUSR | stat.S_IWUSR)

    def digest() -> list[tuple[str, str]]:
        # Reading a WAL-mode log may make SQLite's shared-memory index (-shm) and an empty
        # -wal beside it (where the folder lets it, as it does for root): never the log.
        files = [f for f in folder.iterdir()
                 if not (f.name.endswith("-shm") or (f.name.endswith("-wal") and not f.stat().st_size))]
        return sorted((f.name, hashlib.sha256(f.read_bytes()).hexdigest()) for f in files)

    return f"sqlite:///{copied}", undo, digest


def _read_only_role(url: str) -> tuple[str, Any, Any]:
    """A PostgreSQL role that may only read the log's tables."""
    import psycopg

    role = f"poimen_ro_{uuid.uuid4().hex[:12]}"
    with psycopg.connect(url, autocommit=True) as admin:
        admin.execute(f"CREATE ROLE {role} LOGIN")
        admin.execute(f"GRANT USAGE ON SCHEMA public TO {role}")
        admin.execute(f"GRANT SELECT ON ALL TABLES IN SCHEMA public TO {role}")

    def undo() -> None:
        with psycopg.connect(url, autocommit=True) as admin:
            admin.execute(f"REVOKE ALL ON ALL TABLES IN SCHEMA public FROM {role}")
            admin.execute(f"REVOKE ALL ON SCHEMA public FROM {role}")
            admin.execute(f"DROP ROLE {role}")

    def digest() -> list[Any]:
        with psycopg.connect(url, autocommit=True) as admin:
            return [admin.execute(f"SELECT * FROM {t} ORDER BY 1").fetchall()
                    for t in ("intents", "attempts", "events", "denials", "sandbox_calls")]

    scheme, rest = url.split("://", 1)
    return f"{scheme}://{role}@{rest.split('@', 1)[1]}", undo, digest


def test_a_live_kernel_that_opens_a_shadow_log_dispatches_nothing_it_holds(
    store_url: str, sandbox_url: str, provider: ProviderProcess, ledger: ProviderClient
) -> None:
    record_run(store_url, provider.url, [])
    with Kernel(sandbox_url, mode="shadow", live=store_url, notifiers=[]) as k:
        tools(k, provider.url)
        for tool in (CHARGE, SHIP, EMAIL):
            assert isinstance(k.call(tool, CASES[tool][0], call_id=f"s/{tool}"), Pending)
    with Kernel(sandbox_url, notifiers=[]) as live:  # someone opens it as a live log
        tools(live, provider.url)
        report = live.launch(background=False)
        assert report.scanned == 0
        assert all(live.outcome(f"s/{tool}") is None for tool in (CHARGE, SHIP, EMAIL))
    assert ledger.entries() == []


@pytest.mark.parametrize("mode", ["replay", "shadow"])
def test_a_sandbox_kernels_recovery_runs_only_what_its_mode_may_run(
    store_url: str, sandbox_url: str, provider: ProviderProcess, ledger: ProviderClient, mode: str
) -> None:
    """Unfinished intents in a sandbox kernel's own log (a log that once was live): replay
    dispatches none; shadow re-runs only the ReadOnly one."""
    record_run(store_url, provider.url, [])
    source = {"recording": store_url} if mode == "replay" else {"live": store_url}
    with Kernel(sandbox_url, mode=mode, notifiers=[], **source) as k:  # type: ignore[arg-type]
        bodies = tools(k, provider.url)
        for tool in (CHARGE, EMAIL, READ):
            orphan(k, tool, k.spec(tool).effect, CASES[tool][0], f"o/{tool}",
                   key="pk1_" + "0" * 48 if tool == CHARGE else None)
        report = k.launch(background=False)
        state = {t: intent_of(k, f"o/{t}").state for t in (CHARGE, EMAIL, READ)}
        if mode == "replay":
            assert state == dict.fromkeys((CHARGE, EMAIL, READ), S.DISPATCHED)
            assert bodies == [] and len(report.unregistered) == 3
        else:
            assert state == {CHARGE: S.DISPATCHED, EMAIL: S.DISPATCHED, READ: S.COMPLETED}
            assert bodies == [READ]
        # Waiting on one drives nothing either.
        assert isinstance(k.wait_sync(f"o/{CHARGE}", timeout=0), Pending)
        assert intent_of(k, f"o/{CHARGE}").state == S.DISPATCHED
    assert ledger.entries() == []


def test_sandbox_settings_that_do_not_fit_are_refused_naming_the_setting(
    store_url: str, sandbox_url: str
) -> None:
    for kw, field in (
        ({"mode": "replay"}, "recording"),
        ({"mode": "replay", "recording": store_url, "live": store_url}, "live"),
        ({"mode": "shadow", "recording": store_url}, "recording"),
        ({"mode": "live", "recording": store_url}, "mode"),
        ({"mode": "replay", "recording": store_url, "on_divergence": "ignore"}, "on_divergence"),
        ({"mode": "replay", "recording": store_url, "scope": ""}, "scope"),
        ({"mode": "shadow", "on_divergence": "record"}, "on_divergence"),
        ({"mode": "replay", "recording": 42}, "recording"),
        ({"mode": "replay", "recording": _alias(store_url), "store": store_url}, "recording"),
        ({"mode": "shadow", "live": _alias(store_url), "store": store_url}, "live"),
    ):
        target = kw.pop("store", sandbox_url)
        with pytest.raises(PoimenError) as err:
            Kernel(target, notifiers=[], worker_id="w-check", **kw)  # type: ignore[arg-type]
        assert err.value.data.get("field") == field, (kw, err.value)
    Kernel(sandbox_url, notifiers=[], worker_id="w-check").close()  # the id was given back
    with pytest.raises(Exception, match=r"(?i)no poimen intent log|no such file|cannot|does not"):
        Kernel(sandbox_url, mode="replay", notifiers=[],
               recording=f"sqlite:///{os.devnull}.missing.db")


def _alias(url: str) -> str:
    """Another name of the same log."""
    if not url.startswith("sqlite:///"):
        return url
    path = Path(url[len("sqlite:///"):])
    return f"sqlite:///{path.parent}/./{path.name}"
