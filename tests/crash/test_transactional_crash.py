"""A Transactional call in a child process SIGKILLed before its transaction commits, during the
commit (PostgreSQL: the server finishes a COMMIT its client died in), and after it but before
the outcome commit; then recovered. The witness is the application's own table: each call's
row exactly once, never twice, never lost. SQLite and PostgreSQL, the table in the log's own
database and in another one."""

from __future__ import annotations

import signal
import time
from pathlib import Path

import pytest

from poimen import IntentState
from poimen.testing import kill_at_pause
from tests.helpers import recover_until_settled
from tests.integration.transactional_app import (
    app_sql,
    dbs,
    make_kernel,
    marker,
    rows,
    spawn,
)

__all__ = ["dbs"]
S = IntentState
# In the order a call passes them; the write is committed from after_effect on.
POINTS = ["after_dispatch_commit", "mid_call", "before_tx_commit", "after_effect"]


@pytest.mark.parametrize("point", POINTS)
def test_a_transactional_call_killed_anywhere_writes_exactly_once(
    dbs: tuple[str, str], tmp_path: Path, point: str
) -> None:
    log, app = dbs
    pause = tmp_path / "pause"
    child = spawn(log, app, "c1", POIMEN_PAUSE_AT=point, POIMEN_PAUSE_FILE=str(pause))
    assert kill_at_pause(child, pause) == point
    committed = point == "after_effect"
    assert rows(app, "c1") == (1 if committed else 0)
    with make_kernel(log, app) as k:
        intent = recover_until_settled(k, "c1")
        assert intent.state == S.COMPLETED
        assert intent.result == f'{{"attempt":{1 if committed else 2},"rows":1}}'
        if log != app:
            assert marker(app, intent.id)[1] == 1  # type: ignore[index]
        # Settled once: a later pass and a repeat of the call change nothing.
        k.recover()
        k.call("tx.note", {"text": "hello"}, call_id="c1")
    assert rows(app, "c1") == 1


@pytest.mark.postgres
@pytest.mark.parametrize("setup", ["postgres-own", "postgres-other"])
def test_a_child_killed_during_its_commit_on_postgres_writes_exactly_once(
    tmp_path: Path, setup: str
) -> None:
    import psycopg

    from tests.integration.transactional_app import databases

    with databases(setup, tmp_path) as (log, app), psycopg.connect(app, autocommit=True) as gate:
        # A deferred trigger makes the COMMIT itself wait for a lock this test holds: the
        # child is killed while the server runs it, so its answer never arrives.
        app_sql(app, "CREATE FUNCTION slow_commit() RETURNS trigger LANGUAGE plpgsql AS "
                     "$$ BEGIN PERFORM pg_advisory_xact_lock(7007); RETURN NULL; END $$")
        app_sql(app, "CREATE CONSTRAINT TRIGGER slow_commit AFTER INSERT ON notes "
                     "DEFERRABLE INITIALLY DEFERRED FOR EACH ROW EXECUTE FUNCTION slow_commit()")
        gate.execute("SELECT pg_advisory_lock(7007)")
        child = spawn(log, app, "d1")
        try:
            _wait_for(lambda: _committing(app, on_the_lock=True), "the child's COMMIT to wait")
        finally:
            child.send_signal(signal.SIGKILL)
            child.communicate(timeout=30)
            gate.execute("SELECT pg_advisory_unlock(7007)")
        assert child.returncode == -signal.SIGKILL
        # The server finishes the commit on its own: it learns of the client's death only
        # when it answers. The child never knew: its intent is DISPATCHED, the marker (or
        # on the log's database the outcome) committed with the write.
        _wait_for(lambda: not _committing(app), "the server to end the COMMIT")
        assert rows(app, "d1") == 1
        with make_kernel(log, app) as k:
            intent = recover_until_settled(k, "d1")
            assert intent.state == S.COMPLETED and intent.result == '{"attempt":1,"rows":1}'
        assert rows(app, "d1") == 1


def _committing(app: str, on_the_lock: bool = False) -> bool:
    """Is a poimen session running COMMIT on `app` (a fresh database: the child's only)? With
    `on_the_lock`, one waiting for this test's advisory lock: the write's own COMMIT, not an
    earlier one of the same session (the marker table's), which a poll may catch in passing."""
    waiting = " AND wait_event_type = 'Lock' AND wait_event = 'advisory'" if on_the_lock else ""
    return bool(app_sql(
        app, "SELECT 1 FROM pg_stat_activity WHERE datname = current_database() "
             "AND application_name = 'poimen-tx' AND state = 'active' AND query = 'COMMIT'"
             + waiting,
    ))


def _wait_for(cond: object, what: str, within: float = 60.0) -> None:
    end = time.monotonic() + within
    while not cond():  # type: ignore[operator]
        if time.monotonic() > end:
            raise TimeoutError(f"waited {within:g}s for {what}")
        time.sleep(0.01)
