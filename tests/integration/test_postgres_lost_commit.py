"""A COMMIT that reaches the server but whose answer never comes back (issue 4, faults), and one
that never reaches it (issue 29, rule 7).

A real TCP proxy sits between poimen and PostgreSQL; armed, it forwards one COMMIT and then cuts
both sockets before the server's reply can pass. The retry must recognise the write that landed:
never apply it twice, never mistake it for someone else's. Armed with `land=False`, it drops the
COMMIT and the server's side, lets a rival act while poimen still waits, then cuts poimen's side.
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple
from urllib.parse import urlsplit

import pytest

from poimen import Kernel
from poimen._core.intents import Owner
from poimen.store import NewDispatch
from poimen.store.postgres import PostgresStore
from poimen.testing import CHARGE, EMAIL, ProviderClient, register_test_tools

pytestmark = pytest.mark.postgres


class Cut(NamedTuple):
    land: bool  # the COMMIT reaches the server, or never does
    meanwhile: Callable[[], None]  # run once the server's side is gone, before poimen's goes


class CommitCutter:
    """Forwards bytes both ways; `arm(skip)` lets `skip` COMMITs through, then cuts the next."""

    def __init__(self, upstream: tuple[str, int]) -> None:
        self.upstream = upstream
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self._lock = threading.Lock()
        self._skip: int | None = None
        self._cut = Cut(True, lambda: None)
        self.cuts = 0
        threading.Thread(target=self._accept, daemon=True).start()

    def arm(
        self, skip: int = 0, *, land: bool = True, meanwhile: Callable[[], None] = lambda: None
    ) -> None:
        with self._lock:
            self._skip, self._cut = skip, Cut(land, meanwhile)

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            server = socket.create_connection(self.upstream)
            cut = threading.Event()  # set: nothing more passes from server to client
            held = threading.Event()  # clear: poimen's side stays open for now
            held.set()
            for args in ((client, server, cut, held, True), (server, client, cut, held, False)):
                threading.Thread(target=self._pump, args=args, daemon=True).start()

    def _cut_here(self, chunk: bytes) -> Cut | None:
        if b"COMMIT\x00" not in chunk:
            return None
        with self._lock:
            if self._skip is None:
                return None
            if self._skip > 0:
                self._skip -= 1
                return None
            self._skip = None
            self.cuts += 1
            return self._cut

    def _pump(
        self,
        src: socket.socket,
        dst: socket.socket,
        cut: threading.Event,
        held: threading.Event,
        from_client: bool,
    ) -> None:
        try:
            while chunk := src.recv(65536):
                plan = self._cut_here(chunk) if from_client else None
                if plan is not None:
                    cut.set()
                    if plan.land:
                        dst.sendall(chunk)
                        time.sleep(0.2)  # the server commits; its answer dies with the sockets
                    else:  # the server never sees it, and rolls back once its side is gone
                        held.clear()
                        dst.shutdown(socket.SHUT_RDWR)
                        try:
                            plan.meanwhile()
                        finally:
                            held.set()
                    break
                if cut.is_set():
                    break
                dst.sendall(chunk)
        except OSError:
            pass
        held.wait(120)
        for s in (src, dst):
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)
            s.close()

    def close(self) -> None:
        self.listener.close()


@pytest.fixture
def cutter(postgres_url: str) -> Iterator[tuple[CommitCutter, str]]:
    u = urlsplit(postgres_url)
    proxy = CommitCutter((u.hostname or "127.0.0.1", u.port or 5432))
    # No TLS, so the proxy can see the COMMIT go by.
    url = u._replace(netloc=f"{u.username}@127.0.0.1:{proxy.port}").geturl()
    yield proxy, f"{url}?sslmode=disable&gssencmode=disable"
    proxy.close()


@pytest.fixture
def kernel(cutter: tuple[CommitCutter, str], provider: Any) -> Iterator[Kernel]:
    _, url = cutter
    k = Kernel(PostgresStore(url, retry_for=10.0), deadline_margin=0.1)
    register_test_tools(k, provider.url, timeout=2.0)
    yield k
    k.close()


def test_lost_dispatch_commit_is_still_our_call(
    cutter: tuple[CommitCutter, str], kernel: Kernel, ledger: ProviderClient
) -> None:
    proxy, _ = cutter
    proxy.arm(skip=0)  # the dispatch record's COMMIT
    out = kernel.call(EMAIL, {"to": "a@example.com", "subject": "hi"}, call_id="lost-d")
    assert proxy.cuts == 1
    assert type(out).__name__ == "Completed", out  # not mistaken for someone else's intent
    it = kernel.store.get_by_call_id("lost-d")
    assert it is not None and it.state.value == "COMPLETED"
    assert [e.kind for e in kernel.store.events(it.id)] == ["dispatched", "completed"]
    assert ledger.count(kind="plain") == 1


def test_lost_outcome_commit_is_not_recorded_as_a_late_outcome(
    cutter: tuple[CommitCutter, str], kernel: Kernel, ledger: ProviderClient
) -> None:
    proxy, _ = cutter
    proxy.arm(skip=1)  # let the dispatch through, cut the outcome's COMMIT
    out = kernel.call(CHARGE, {"order_id": "o-1", "amount_cents": 5}, call_id="lost-o")
    assert proxy.cuts == 1
    assert type(out).__name__ == "Completed", out
    it = kernel.store.get_by_call_id("lost-o")
    assert it is not None and (it.state.value, it.fence) == ("COMPLETED", 1)
    [attempt] = kernel.store.attempts(it.id)
    assert (attempt.outcome, attempt.late_outcome) == ("completed", None)
    assert [e.kind for e in kernel.store.events(it.id)] == ["dispatched", "completed"]
    assert ledger.count(kind="keyed", key=it.key) == 1


def _orphan(kernel: Kernel, tool: str, args: str, key: str | None) -> str:
    """A dispatch record left by a process of this host that no longer exists."""
    store = kernel.store
    now = store.now()
    dead = Owner("gone", kernel.owner.host, 2**22 + 7, "0")
    it, _ = store.record_dispatch(
        NewDispatch(
            f"in_orphan_{tool}",
            f"orphan-{tool}",
            tool,
            "idempotent" if key else "unsafe",
            args,
            "x",
            key,
            None,
            dead,
            now + 60,
            2.0,
            now + 2.1,
            now,
        )
    )
    return it.id


def test_lost_claim_commit_is_recognised_as_our_claim(
    cutter: tuple[CommitCutter, str], kernel: Kernel, ledger: ProviderClient
) -> None:
    from poimen._core.effects import KeyDerivation

    args = {"order_id": "o-claim", "amount_cents": 9}
    key = KeyDerivation.fields("order_id", "amount_cents").derive(CHARGE, args)
    iid = _orphan(kernel, CHARGE, '{"amount_cents":9,"order_id":"o-claim"}', key)
    proxy, _ = cutter
    proxy.arm(skip=0)  # the claim's COMMIT
    report = kernel.recover()
    assert proxy.cuts == 1
    assert (report.completed, report.lost_race) == (1, 0), report
    it = kernel.store.get_intent(iid)
    assert it is not None and (it.state.value, it.fence, it.attempts) == ("COMPLETED", 2, 2)
    assert [e.kind for e in kernel.store.events(iid)] == ["dispatched", "retry", "completed"]
    assert ledger.count(kind="keyed", key=key) == 1


def test_lost_indeterminate_commit_notifies_once(
    cutter: tuple[CommitCutter, str], kernel: Kernel
) -> None:
    iid = _orphan(kernel, EMAIL, '{"subject":"hi","to":"b@example.com"}', None)
    proxy, _ = cutter
    proxy.arm(skip=0)
    report = kernel.recover()
    assert proxy.cuts == 1
    assert report.indeterminate == 1, report
    assert [e.kind for e in kernel.store.events(iid)] == ["dispatched", "indeterminate"]
    assert len(kernel.store.notifications(iid)) == 1


RIVALS = {
    "another worker": Owner("rival", "host-r", 4242, "1"),
    "another thread of this worker": None,  # the kernel's own owner
}


@pytest.mark.parametrize("rival", list(RIVALS))
def test_a_claim_whose_commit_never_landed_is_not_taken_for_a_rivals(
    cutter: tuple[CommitCutter, str],
    kernel: Kernel,
    ledger: ProviderClient,
    postgres_url: str,
    rival: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Our claim's COMMIT never reaches the server; a rival claims the intent at the next fence
    before our retry looks. The retry finds a claim at `fence + 1`, but not its own: it reports
    a lost race, and the call runs only for the rival (which, here, never runs it)."""
    from poimen._core.effects import KeyDerivation

    args = {"order_id": "o-rival", "amount_cents": 9}
    key = KeyDerivation.fields("order_id", "amount_cents").derive(CHARGE, args)
    iid = _orphan(kernel, CHARGE, '{"amount_cents":9,"order_id":"o-rival"}', key)
    owner = RIVALS[rival] or kernel.owner
    direct = PostgresStore(postgres_url)
    claimed: list[Any] = []

    def rival_claims() -> None:
        # Once the server has rolled our claim back, its row is free to claim.
        give_up = time.monotonic() + 60
        while not claimed and time.monotonic() < give_up:
            now = direct.now()
            it = direct.claim(
                iid, 1, owner, lease_expires_at=now + 600, new_attempt=True,
                deadline_at=None, now=now,
            )  # fmt: skip
            if it is not None:
                claimed.append(it)
            time.sleep(0.01)

    proxy, _ = cutter
    proxy.arm(skip=1, land=False, meanwhile=rival_claims)  # the seize passes, the claim not
    try:
        report = kernel.recover()
        assert proxy.cuts == 1 and len(claimed) == 1
        # The claim's own try was the one cut, and its retry looked for it.
        retried = [r.getMessage() for r in caplog.records if r.name == "poimen.store.postgres"]
        assert [m.split(":")[0] for m in retried] == ["claim"], retried
        assert (report.completed, report.lost_race) == (0, 1), report
        it = direct.get_intent(iid)
        assert it is not None and (it.state.value, it.fence, it.owner) == ("DISPATCHED", 2, owner)
        assert ledger.count(kind="keyed", key=key) == 0  # the rival holds it and has not run it
    finally:
        direct.close()
