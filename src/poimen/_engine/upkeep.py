"""A kernel's background duties, each on a thread of its own and supervised.

- renewal: extends the leases of the intents this kernel holds, and does nothing else, so a
  slow recovery pass or a webhook receiver that never answers cannot let a live call's lease
  run out (another worker would then take it over).
- recovery: the periodic restart scan (after `launch(background=True)`).
- delivery: the outbox, handed to the notifiers (woken as soon as a notification is written).
- audit (with ``audit_head_every``): publishes the audit chain's head (poimen._audit_head).

A duty that raises is logged with its traceback and runs again at its next period; a duty
whose thread died is started again by the next `ensure()` (every hold, every renewal round).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

log = logging.getLogger("poimen.upkeep")


class Duty:
    """One background duty: `fn` every `period` seconds, or sooner when woken."""

    def __init__(self, name: str, fn: Callable[[], object], period: Callable[[], float]) -> None:
        self.name = name
        self._fn = fn
        self._period = period
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        # True from a thread's start until it ends (it clears it itself): every call's
        # ensure() reads a flag, not Thread.is_alive() (four frames and a lock).
        self._live = False
        self._lock = threading.Lock()
        self.failures = 0
        self.rounds = 0

    def ensure(self) -> None:
        """Start the duty's thread if it is not running (never started, or died)."""
        if self._live:
            return
        with self._lock:
            th = self._thread
            if self._stop.is_set() or (th is not None and th.is_alive()):
                return
            if th is not None:
                log.error("poimen %s duty had stopped; starting it again", self.name)
            self._live = True
            self._thread = threading.Thread(
                target=self._run, name=f"poimen-{self.name}", daemon=True
            )
            self._thread.start()

    def wake(self) -> None:
        self._wake.set()

    def running(self) -> bool:
        th = self._thread
        return th is not None and th.is_alive()

    def is_current(self) -> bool:
        """Whether the caller runs on this duty's thread."""
        return self._thread is threading.current_thread()

    def _run(self) -> None:
        try:
            self._loop()
        finally:  # stopped, or died of a BaseException: the next ensure() looks again
            self._live = False

    def _loop(self) -> None:
        while not self._stop.is_set():
            self._wake.wait(self._period())
            self._wake.clear()
            if self._stop.is_set():
                return
            try:
                self._fn()
                self.rounds += 1
            except Exception:
                self.failures += 1
                log.exception("poimen %s duty failed; it runs again next round", self.name)

    def stop(self, within: float) -> bool:
        self._stop.set()
        self._wake.set()
        th = self._thread
        if th is None or th is threading.current_thread():
            return True
        th.join(within)
        return not th.is_alive()

    def after_fork(self) -> None:
        """In a forked child: the parent's thread does not exist here, its locks may be held."""
        self._wake = threading.Event()
        self._lock = threading.Lock()
        self._thread = None
        self._live = False


class Upkeep:
    """The duties of a kernel: three, and the audit head's when asked for."""

    def __init__(
        self,
        *,
        renew: Callable[[], object],
        recover: Callable[[], object],
        deliver: Callable[[], object],
        lease_ttl: float,
        recover_interval: float,
        publish: Callable[[], object] | None = None,
        publish_every: float = 3600.0,
    ) -> None:
        self.background = False  # periodic recovery and delivery, after launch()
        self.renewal = Duty("renewal", self._renew_round(renew), lambda: min(lease_ttl / 3, 1.0))
        self.recovery = Duty("recovery", recover, lambda: recover_interval)
        self.delivery = Duty(
            "delivery", deliver, lambda: recover_interval if self.background else 3600.0
        )
        # The audit chain's head, published every `publish_every` seconds (poimen._audit_head).
        self.publish = None if publish is None else Duty("audit", publish, lambda: publish_every)

    def _renew_round(self, renew: Callable[[], object]) -> Callable[[], object]:
        def run() -> object:
            # The renewal thread watches the others: a duty that died starts again.
            if self.background:
                self.recovery.ensure()
                self.delivery.ensure()
                if self.publish is not None:
                    self.publish.ensure()
            return renew()

        return run

    def duties(self) -> tuple[Duty, ...]:
        extra = () if self.publish is None else (self.publish,)
        return (self.renewal, self.recovery, self.delivery, *extra)

    def start(self, *, background: bool) -> None:
        if background:
            self.background = True
            self.recovery.ensure()
            if self.publish is not None:
                self.publish.ensure()
                self.publish.wake()  # the head as the kernel starts, then at each period
        self.renewal.ensure()
        self.delivery.ensure()
        self.delivery.wake()  # its period changed

    def held(self) -> None:
        """A call is held: its lease must be renewed from now on."""
        self.renewal.ensure()

    def notify_soon(self) -> None:
        self.delivery.ensure()
        self.delivery.wake()

    def stop(self, within: float) -> None:
        end = time.monotonic() + within
        for d in self.duties():
            if not d.stop(max(0.0, end - time.monotonic())):
                log.warning("poimen %s duty still running at close", d.name)

    def after_fork(self) -> None:
        for d in self.duties():
            d.after_fork()
