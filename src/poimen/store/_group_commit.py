"""The SQLite store's writer: many callers' writes in one transaction, each caller returning
only after that commit is durable (group commit), and the merged statements a batch may use."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import sqlite3
import threading
from _thread import get_ident
from collections.abc import Callable
from typing import Any, Generic, TypeVar

from poimen.errors import StoreError, StoreUnavailableError
from poimen.store._base import Answer

T = TypeVar("T")
log = logging.getLogger("poimen")


class Op(Generic[T]):
    __slots__ = (
        "done",
        "error",
        "fn",
        "future",
        "may_lead",
        "merge",
        "payload",
        "value",
        "wake",
        "woken",
    )

    def __init__(
        self,
        fn: Callable[[sqlite3.Connection], T],
        merge: Merge | None = None,
        payload: Any = None,
    ) -> None:
        self.fn = fn
        # Ops with the same `merge` are written together, a few statements for the whole
        # batch; `merge` leaves the ops it cannot settle to their own `fn`.
        self.merge = merge
        self.payload = payload
        self.done = False
        self.value: T | None = None
        self.error: BaseException | None = None
        # A lock held on the waiter's behalf: released once its commit is durable, or (if
        # `may_lead`) to hand it the leader's role. None for a caller that led at once.
        self.wake: threading.Lock | None = None
        self.may_lead = False
        self.woken = False  # the role was handed to it and its lock released
        # An async caller's future instead: resolved on its loop once the commit is durable.
        self.future: asyncio.Future[T] | None = None


class _Thread:
    """The role's holder while the writer thread leads."""


_THREAD: Any = _Thread()


class GroupCommit:
    """Many callers' writes in one transaction; each caller returns only after that commit.

    A caller that finds no leader (then nothing is queued either) leads and commits its own
    write at once, inline, with no thread hop and no batch; callers arriving meanwhile queue,
    each waiting on its own lock. A leader wakes exactly the callers of the batch it
    committed and hands the role to the first caller still queued, which commits whatever
    is queued then, its own write included, so no caller is woken for nothing.

    An async caller cannot lead (its loop must not block): it queues a future, and when the
    role falls to it, the store's writer thread leads instead and resolves the futures of
    each batch on their loops, one callback per loop.

    Interrupts: a signal handler's exception (KeyboardInterrupt, an alarm) lands only on the
    main thread, anywhere. So the main thread never leads another caller's write, and is
    never handed the role while it waits: the writer thread leads in its place. An
    interrupted caller gets the interrupt and its own write's fate is unknown to it (it is
    committed or not; a caller retries with the same call id); the role always passes on,
    a transaction it opened is rolled back, and every other caller's answer stays true.
    """

    def __init__(self, conn: sqlite3.Connection) -> None:
        self._conn = conn
        self._lock = threading.Lock()
        self._queue: list[Op[Any]] = []
        # Who leads: an op (its caller's thread), _THREAD, or None. Set under `_lock`; the
        # role is handed on only by its holder, or for it by `_abandon`.
        self._holder: Any = None
        self._go = threading.Lock()  # released to make the writer thread lead once
        self._go.acquire()
        self._thread: threading.Thread | None = None
        self._thread_leads = False  # the role was handed to the thread, not yet taken up
        self._thread_gone = False
        self._stopped = False
        self._idle = threading.Condition(self._lock)  # notified when nobody leads

    def run(
        self,
        fn: Callable[[sqlite3.Connection], T],
        merge: Merge | None = None,
        payload: Any = None,
    ) -> T:
        # A caller that finds nobody leading commits its own write at once, with no Op and no
        # batch: nobody can have queued yet. Its token while it leads is its thread's id, an
        # int object no other call holds (`is` tells it from any other holder).
        me = get_ident()
        try:
            with self._lock:
                if self._stopped:
                    raise StoreUnavailableError("the store is closed")
                lone = self._holder is None and not self._queue
                if lone:
                    self._holder = me
            if lone:  # `_commit` of this one write, inline (a call fewer on every commit)
                conn = self._conn
                committing = False
                value = error = None
                try:
                    conn.execute("BEGIN IMMEDIATE")
                    try:
                        value = fn(conn)
                    except BaseException as exc:
                        error = exc
                    if error is None:
                        committing = True
                        conn.execute("COMMIT")
                    else:
                        conn.execute("ROLLBACK")
                except BaseException as exc:
                    err = self._failed(exc, committing)
                    if err is not None and error is None:
                        value, error = None, err
                    if not isinstance(exc, sqlite3.Error):
                        raise  # an interrupt: this caller gets it, its write's fate unknown
                finally:
                    with self._lock:
                        self._pass_role(me)  # to whoever queued meanwhile
        except BaseException:
            self._abandon(me)
            raise
        if not lone:
            return self._run_queued(fn, merge, payload)
        if error is not None:
            raise error
        return value  # type: ignore[return-value]

    def _run_queued(
        self,
        fn: Callable[[sqlite3.Connection], T],
        merge: Merge | None,
        payload: Any,
    ) -> T:
        """`run` behind a leader: wait for the batch that commits this write, or to lead it."""
        op: Op[T] = Op(fn, merge, payload)
        alone = threading.current_thread() is threading.main_thread()
        try:
            with self._lock:
                if self._stopped:
                    raise StoreUnavailableError("the store is closed")
                if self._holder is None:
                    self._holder = op
                    if not alone:  # leads whatever queues meanwhile, its own write first
                        self._queue.append(op)
                else:
                    if alone:  # the writer thread leads this write's batch
                        self._ensure_thread()
                    wake = threading.Lock()
                    wake.acquire()
                    op.wake, op.may_lead = wake, not alone
                    self._queue.append(op)
            if op.wake is not None:
                op.wake.acquire()  # our commit is durable, or we are the next leader
            if not op.done:
                self._lead(op, alone=alone)
        except BaseException:
            self._abandon(op)
            raise
        if op.error is not None:
            raise op.error
        return op.value  # type: ignore[return-value]

    def submit(
        self,
        fn: Callable[[sqlite3.Connection], T],
        merge: Merge | None = None,
        payload: Any = None,
    ) -> asyncio.Future[T]:
        """`run` for a caller on an event loop: the future resolves once the commit is
        durable, and the loop never blocks on the write."""
        op: Op[T] = Op(fn, merge, payload)
        fut: Answer[T] = Answer(loop=asyncio.get_running_loop())
        op.future = fut
        try:
            with self._lock:
                if self._stopped:
                    raise StoreUnavailableError("the store is closed")
                self._ensure_thread()
                self._queue.append(op)
                self._pass_role(None)  # to the thread, if nobody leads
        except BaseException:
            self._abandon(op)
            raise
        return fut

    def stop(self, within: float) -> bool:
        """Take no more writes and wait up to `within` seconds for the batch in flight and
        those queued before; True once nobody uses the connection any more."""
        with self._lock:
            self._stopped = True
            self._kick()  # an idle thread exits
        with self._idle:
            return self._idle.wait_for(lambda: self._holder is None, within)

    def _ensure_thread(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(
                target=self._thread_main, name="poimen-sqlite-writer", daemon=True
            )
            self._thread.start()

    def _kick(self) -> None:
        if self._thread is not None:
            try:  # noqa: SIM105 (suppress() is three calls more, on every commit)
                self._go.release()
            except RuntimeError:  # released already: it wakes all the same
                pass

    def _thread_main(self) -> None:
        while True:
            self._go.acquire()
            with self._lock:
                leads, self._thread_leads = self._thread_leads, False
                if not leads and self._stopped and self._holder is None:
                    self._thread_gone = True
                    return
            if leads:
                try:
                    self._lead(_THREAD, alone=False)
                except BaseException:  # the batch is settled and the role passed on: go on
                    log.exception("SQLite writer thread: a batch failed")

    def _lead(self, me: Any, *, alone: bool) -> None:
        """Commit a batch as the role's holder `me`, then hand the role on. `alone`: only
        `me`'s write, for the main thread, where an interrupt must reach no other caller."""
        batch = [me]
        if not alone:
            with self._lock:
                batch, self._queue = self._queue, []
        try:
            if me is _THREAD and self._stopped:  # queued async writes are refused on close
                self._commit(self._refuse_async(batch))
            else:
                self._commit(batch)  # marks every op of the batch done, success or not
        finally:
            self._wake(batch, me)
            with self._lock:
                self._pass_role(me)

    def _pass_role(self, holder: Any) -> None:
        """Hand the leader's role on from `holder`, under `_lock`: a no-op unless `holder`
        has it, so a caller interrupted midway may call it again. Each step sets the state
        before it wakes anyone, so an interrupt in between leaves work `_abandon` redoes."""
        if self._holder is not holder:
            return
        nxt = self._queue[0] if self._queue else None
        if nxt is None:
            if self._stopped:  # only `stop` waits for nobody to lead, and it stops first
                self._kick()  # the writer thread exits once nobody leads
                self._idle.notify_all()
            self._holder = None
        elif nxt.may_lead:
            self._holder = nxt
            self._wake_holder()
        elif self._thread is None or self._thread_gone:
            # Nobody can lead this write (its caller was interrupted mid-submit, or the
            # store closed): it was never committed, so say so.
            self._queue.remove(nxt)
            nxt.error, nxt.done = StoreUnavailableError("the store is closed"), True
            self._wake([nxt], None)
            self._pass_role(holder)
        else:
            self._holder = _THREAD
            self._thread_leads = True
            self._wake_holder()

    def _wake_holder(self) -> None:
        """Wake the role's holder if it was handed the role and not yet woken (idempotent)."""
        h = self._holder
        if h is _THREAD:
            if self._thread_leads:
                self._kick()
        elif isinstance(h, Op) and h.wake is not None and not h.woken:
            try:  # noqa: SIM105 (as in _kick)
                h.wake.release()
            except RuntimeError:  # released by an interrupted try
                pass
            h.woken = True

    def _abandon(self, op: Op[Any] | int) -> None:
        """After an exception anywhere in `op`'s caller (`op`: its Op, or the token it leads
        alone by): drop its write if no leader took it (then it is never committed), roll
        back a transaction it left open, and see the role handed on. Repeated until done: a
        second interrupt must not leave half of it."""
        for _ in range(8):
            try:
                with self._lock:
                    if op in self._queue:
                        self._queue.remove(op)
                    if self._holder is op:
                        with contextlib.suppress(sqlite3.Error):
                            if self._conn.in_transaction:
                                self._conn.execute("ROLLBACK")
                        self._pass_role(op)
                    self._wake_holder()
                    self._pass_role(None)  # a role dropped between two holders
                return
            except BaseException:  # a second interrupt: the first is the one raised
                continue

    def _refuse_async(self, batch: list[Op[Any]]) -> list[Op[Any]]:
        refused = [op for op in batch if op.future is not None]
        err = StoreUnavailableError("the store is closed")
        for op in refused:
            op.error, op.done = err, True
        return [op for op in batch if op.future is None]

    @staticmethod
    def _wake(batch: list[Op[Any]], me: Any) -> None:
        if len(batch) == 1:
            op = batch[0]
            if op is me:  # a lone caller's own write (never a future's)
                return
            if op.future is not None:  # one async write: its loop without a dict
                _answer(op.future.get_loop(), batch)
                return
        by_loop: dict[asyncio.AbstractEventLoop, list[Op[Any]]] = {}
        for op in batch:
            if op.future is not None:
                by_loop.setdefault(op.future.get_loop(), []).append(op)
            elif op is not me and op.wake is not None:
                try:  # noqa: SIM105 (as in _kick)
                    op.wake.release()
                except RuntimeError:  # its caller was interrupted
                    pass
        for loop, ops in by_loop.items():
            _answer(loop, ops)

    def _commit(self, batch: list[Op[Any]]) -> None:
        """Write and commit `batch`. Each op ends with an error, or with a value only if its
        write is committed, whatever stops the batch: what the connection says decides."""
        conn = self._conn
        committing = False
        try:
            if not batch:
                return
            conn.execute("BEGIN IMMEDIATE")
            if len(batch) == 1:
                op = batch[0]
                try:
                    op.value = op.fn(conn)
                except BaseException as exc:
                    op.error = exc
                failed = op.error is not None
            elif _run_all(conn, batch):
                failed = False
            else:
                # One op raised: undo the whole batch, then run it again with each op in its
                # own savepoint, so one caller's failure does not sink the others. An op
                # touches nothing but the connection, so running it twice is safe.
                if conn.in_transaction:
                    conn.execute("ROLLBACK")
                conn.execute("BEGIN IMMEDIATE")
                for op in batch:
                    op.value, op.error = None, None
                    conn.execute("SAVEPOINT op")
                    try:
                        op.value = op.fn(conn)
                        conn.execute("RELEASE op")
                    except BaseException as exc:
                        op.error = exc
                        conn.execute("ROLLBACK TO op")
                        conn.execute("RELEASE op")
                failed = all(op.error is not None for op in batch)
            if failed:
                conn.execute("ROLLBACK")
            else:
                committing = True
                conn.execute("COMMIT")
        except BaseException as exc:
            err = self._failed(exc, committing)
            if err is not None:
                for op in batch:
                    if op.error is None:
                        op.error, op.value = err, None
            if not isinstance(exc, sqlite3.Error):
                raise  # an interrupt: the leader's caller gets it
        finally:
            for op in batch:
                op.done = True

    def _failed(self, exc: BaseException, committing: bool) -> StoreError | None:
        """After `exc` stopped a commit: roll back the transaction it left open, and the error
        the ops without one end with, or None if their writes are committed all the same. A
        transaction still open never committed; a COMMIT that ran and raised nothing did,
        whatever was interrupted after it."""
        conn = self._conn
        try:
            if conn.in_transaction:
                conn.execute("ROLLBACK")
            elif committing and not isinstance(exc, sqlite3.Error):
                return None
        except sqlite3.Error:  # a closed store: nothing is committed
            pass
        err = StoreError(f"commit failed: {exc!r}")
        err.__cause__ = exc
        return err


def _answer(loop: asyncio.AbstractEventLoop, ops: list[Op[Any]]) -> None:
    """Resolve `ops`' futures on their `loop`, from the thread that committed them."""
    try:  # noqa: SIM105 (as in GroupCommit._kick)
        loop.call_soon_threadsafe(_resolve, ops)
    except RuntimeError:  # its loop is closed: nobody waits
        pass


def _resolve(ops: list[Op[Any]]) -> None:
    for op in ops:
        fut = op.future
        if fut is None or fut.done():  # cancelled: the write stands all the same
            continue
        try:
            if op.error is not None:
                fut.set_exception(op.error)
            else:
                fut.set_result(op.value)
        except (TypeError, RuntimeError) as exc:  # an error a future refuses: say so, go on
            fut.set_exception(StoreError(f"write failed: {op.error!r} ({exc})"))


def _run_all(conn: sqlite3.Connection, batch: list[Op[Any]]) -> bool:
    """Run every op of a batch without savepoints (two statements per op saved, and ops
    seldom fail): mergeable ops together, the rest one by one; False as soon as one raises.

    Statements, not rows, are what a batch pays for: each one hands the GIL back and has to
    win it again from the callers' threads."""
    groups: dict[Merge, list[Op[Any]]] = {}
    for op in batch:
        op.value = _UNSETTLED
        if op.merge is not None and _CAN_MERGE:
            groups.setdefault(op.merge, []).append(op)
    try:
        for merge, ops in groups.items():
            if len(ops) > 1:  # a lone op's own statements are quicker than a merged one
                for i in range(0, len(ops), _MERGE_ROWS):
                    merge(conn, ops[i : i + _MERGE_ROWS])
        for op in batch:
            if op.value is _UNSETTLED:
                op.value = op.fn(conn)
    except BaseException:
        return False
    return True


class _Unsettled:
    """The value of an op its merge left to its own `fn`."""


_UNSETTLED: Any = _Unsettled()
# A merged outcome is an UPDATE ... FROM, new in SQLite 3.33.
_CAN_MERGE = sqlite3.sqlite_version_info >= (3, 33, 0)
# 17 parameters per intent row, well inside SQLite's 32,766 variables per statement.
_MERGE_ROWS = 500


Merge = Callable[[sqlite3.Connection, list[Op[Any]]], None]
