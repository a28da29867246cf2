"""The PostgreSQL store's kept sessions: a session is used by one thread at a time, one whose
backend died is never kept, and a forked child never uses one of its parent's."""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Sequence
from typing import Any

import psycopg
import pytest

from poimen import Caps, Kernel, ToolContext, Unsafe
from poimen._core.intents import IntentState
from poimen.store.postgres import Connection, PostgresStore
from tests.contract.test_store_contract import dispatch

pytestmark = pytest.mark.postgres
S = IntentState


class _OneUserEach(PostgresStore):
    """Records when a session is lent to two threads at once."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.busy: set[int] = set()
        self.shared: list[int] = []
        super().__init__(*args, **kwargs)

    def _one_trip(self, conn: Connection, name: str, params: Sequence[Any]) -> bool:
        if id(conn) in self.busy:
            self.shared.append(id(conn))
        self.busy.add(id(conn))
        try:
            return super()._one_trip(conn, name, params)
        finally:
            self.busy.discard(id(conn))


def test_threads_never_share_a_session(postgres_url: str) -> None:
    store = _OneUserEach(postgres_url, min_size=1, max_size=3)
    errors: list[BaseException] = []

    def caller() -> None:
        try:
            for _ in range(40):
                iid = dispatch(store)
                assert store.record_outcome(iid, 1, S.COMPLETED, result="1", error=None, now=1.0)
                assert store.get_intent(iid) is not None
        except BaseException as exc:
            errors.append(exc)

    try:
        threads = [threading.Thread(target=caller) for _ in range(6)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert errors == [] and store.shared == []
    finally:
        store.close()


def _retries(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name == "poimen.store.postgres"]


def test_a_session_whose_backend_died_is_not_kept(
    postgres_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    store = PostgresStore(postgres_url, min_size=1, max_size=2, retry_for=10.0)
    try:
        dispatch(store)
        with psycopg.connect(postgres_url, autocommit=True) as admin:
            admin.execute(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                "WHERE datname = current_database() AND pid <> pg_backend_pid()"
            )
        with caplog.at_level(logging.WARNING, logger="poimen.store.postgres"):
            dispatch(store)  # meets the dead session, and is retried on a fresh one
            assert len(_retries(caplog)) == 1, caplog.records
            for _ in range(5):  # the dead session is gone: nothing more to retry
                dispatch(store)
            assert len(_retries(caplog)) == 1, caplog.records
    finally:
        store.close()


def test_a_forked_child_never_uses_its_parents_sessions(postgres_url: str) -> None:
    k = Kernel(postgres_url, notifiers=[], worker_id="forks")

    @k.tool(id="noop", effects=Unsafe(), caps=Caps(), timeout=5)
    def noop(ctx: ToolContext) -> int:
        return 1

    try:
        store = k.store
        assert isinstance(store, PostgresStore)
        k.call("noop", {}, call_id="parent-1")
        parents = {c.info.backend_pid for c in store._idle}
        assert parents  # the parent keeps a session
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child: never return into pytest
            code = 1
            try:
                k.call("noop", {}, call_id="child-1")
                [(mine,)] = store._read("SELECT pg_backend_pid()")
                os.write(w, f"{mine}\n".encode())
                code = 0
            except BaseException as exc:
                os.write(w, f"child failed: {exc!r}\n".encode())
            finally:
                os._exit(code)
        os.close(w)
        with os.fdopen(r) as out:
            told = out.read().strip()
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0, told
        assert int(told) not in parents
        k.call("noop", {}, call_id="parent-2")  # the parent's sessions still serve it
        assert {c.info.backend_pid for c in store._idle} & parents
    finally:
        k.close()
