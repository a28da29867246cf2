"""Real signals whose handler raises, landed at chosen points of the main thread's path through
a module: the store tests' tool for "an interrupt anywhere".

The interpreter runs a pending signal's handler on entering a function, after a call returns
(the handler's exception then comes out of that call) and at a loop's back edge. `Injection`
counts those points in the named module's frames and raises the signal at the `at`-th, from a
trace function, so its handler's exception lands exactly where a real signal's could."""

from __future__ import annotations

import dis
import signal
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from types import FrameType
from typing import Any

_CHECKED_AFTER = {"CALL", "JUMP_BACKWARD"}


class Interrupted(BaseException):
    """What the tests' signal handler raises, as KeyboardInterrupt would."""


@contextmanager
def raising_handler() -> Iterator[None]:
    """SIGUSR1's handler raises `Interrupted`, as Ctrl-C's raises KeyboardInterrupt."""

    def handler(signum: int, frame: FrameType | None) -> None:
        raise Interrupted(signum)

    old = signal.signal(signal.SIGUSR1, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGUSR1, old)


@dataclass
class Injection:
    """Raise SIGUSR1 on this thread at its `at`-th point in `module`'s code where a signal's
    handler can run; `where` names that point once it fired."""

    module: str  # the module's __file__
    at: int
    count: int = 0
    where: str = ""

    def __enter__(self) -> Injection:
        sys.settrace(self._call)
        return self

    def __exit__(self, *exc: object) -> None:
        sys.settrace(None)

    @property
    def fired(self) -> bool:
        return bool(self.where)

    def _call(self, frame: FrameType, event: str, arg: Any) -> Any:
        if frame.f_code.co_filename != self.module:
            return None
        frame.f_trace_opcodes = True
        last = ["CALL"]  # entering the function counts as a point

        def step(frame: FrameType, event: str, arg: Any) -> Any:
            if event == "opcode":
                code = frame.f_code
                checked, last[0] = (
                    last[0] in _CHECKED_AFTER,
                    dis.opname[code.co_code[frame.f_lasti]],
                )
                if checked:
                    self.count += 1
                    if self.count == self.at:
                        self.where = f"{code.co_name} line {frame.f_lineno}"
                        signal.raise_signal(signal.SIGUSR1)  # the handler raises right here
            return step

        return step


def every_point(module: str, scenario: Callable[[Injection], None], limit: int = 2000) -> int:
    """Run `scenario` once per point of this thread's path through `module` where a signal's
    handler can run, the signal raised there; returns how many points were covered."""
    for at in range(1, limit):
        inj = Injection(module, at)
        try:
            scenario(inj)
        except Exception as exc:
            raise AssertionError(f"interrupted at {inj.where or 'no point'}: {exc!r}") from exc
        if not inj.fired:
            return at - 1
    raise AssertionError(f"the path through {module} never ended within {limit} points")
