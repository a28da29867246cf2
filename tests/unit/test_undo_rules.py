"""Undo declarations and the undo call-id rule: what is refused at registration, and the call
ids an undo is made under."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from poimen import MAX_CALL_ID_BYTES, Caps, Completed, Kernel, ToolContext, Unsafe
from poimen.call_ids import is_undo, original_of, undo_of
from poimen.errors import NondeterministicUndoError, PoimenError, RegistrationError


@pytest.fixture
def kernel(tmp_path: Path) -> Iterator[Kernel]:
    k = Kernel(f"sqlite:///{tmp_path / 'k.db'}", notifiers=[])
    yield k
    k.close()


def test_the_undo_call_id_rule() -> None:
    assert undo_of("run-9/step-3") == "undo/run-9/step-3"
    assert undo_of("run-9/step-3", 2) == "undo#2/run-9/step-3"
    for cid in ("undo/run-9/step-3", "undo#2/run-9/step-3", "undo#12/x"):
        assert is_undo(cid)
    for cid in ("run-9/undo/x", "undone/x", "undo#0/x", "undo#/x", "undo", "Undo/x"):
        assert not is_undo(cid), cid
    assert original_of("undo#2/run-9/step-3") == "run-9/step-3"
    assert original_of("run-9/step-3") is None
    long = "r/" + "é" * 254  # 510 bytes: fits as a call id, not with "undo/" before it
    first, second = undo_of(long), undo_of(long, 2)
    assert first.startswith("undo/sha256:") and second.startswith("undo#2/sha256:")
    assert max(len(first.encode()), len(second.encode())) <= MAX_CALL_ID_BYTES
    assert undo_of(long) == first and original_of(first) is None  # deterministic
    for bad in (0, -1, True, 1.5):
        with pytest.raises(PoimenError):
            undo_of("x", bad)  # type: ignore[arg-type]


def noop(ctx: ToolContext, order: str) -> None:
    return None


def test_bad_undo_declarations_are_refused(kernel: Kernel) -> None:
    def reg(tool_id: str, **kw: Any) -> None:
        kernel.tool(id=tool_id, effects=Unsafe(), caps=Caps(), timeout=1, **kw)(noop)

    with pytest.raises(RegistrationError, match="undo_args needs undo"):
        reg("a", undo_args=lambda a, r: a)
    for bad in (5, "", " ", "x" * 300):
        with pytest.raises(RegistrationError):
            reg("b", undo=bad)
    with pytest.raises(RegistrationError, match="must be a function"):
        reg("c", undo="d", undo_args="not callable")
    with pytest.raises(NondeterministicUndoError, match="reads time") as caught:
        reg("e", undo="d", undo_args=lambda a, r: {"order": a["order"], "at": time.time()})
    assert caught.value.data["names"] == ["time"]
    assert set(kernel.registered()) == set()  # nothing of a refused registration stays


def test_the_decorator_form_registers_the_undo_tool_once(kernel: Kernel) -> None:
    @kernel.tool(id="book", effects=Unsafe(), caps=Caps(), timeout=1)
    def book(ctx: ToolContext, order: str) -> dict[str, str]:
        return {"booked": order}

    seen: list[str] = []

    @book.undo(id="unbook", effects=Unsafe(), caps=Caps(), timeout=1)
    def unbook(ctx: ToolContext, order: str) -> None:  # default: the same arguments
        seen.append(order)

    with pytest.raises(RegistrationError, match="already has an undo"):
        @book.undo(id="unbook2", effects=Unsafe(), caps=Caps(), timeout=1)
        def unbook2(ctx: ToolContext, order: str) -> None:
            return None

    assert set(kernel.registered()) == {"book", "unbook"}  # unbook2 was never registered
    assert isinstance(book.call("s/1", order="o7"), Completed)
    report = kernel.undo("s/", operator="ann")
    assert [s.status for s in report.steps] == ["undone"] and seen == ["o7"]
    assert isinstance(unbook.call("other", order="o8"), Completed)  # an ordinary tool too


def test_a_closed_kernel_refuses_to_undo(tmp_path: Path) -> None:
    k = Kernel(f"sqlite:///{tmp_path / 'k.db'}", notifiers=[])
    k.close()
    with pytest.raises(PoimenError, match="closed"):
        k.undo("s/")
