"""`scope_for` skips `scope_of`'s encoding for a call id that does not name the tool: the
scope it finds must be `scope_of`'s for every call id."""

from __future__ import annotations

from typing import Any

from hypothesis import given
from hypothesis import strategies as st

from poimen.call_ids import derived, scope_for, scope_of

ARGS: dict[str, Any] = {"order_id": "o-1", "amount_cents": 1200}


@given(
    st.sampled_from(["t.pay", "pay", "a/b", "x"]),
    st.one_of(
        st.text(),
        st.builds(
            lambda s, n: derived(s, "t.pay", ARGS, n), st.text(min_size=1), st.integers(1, 9)
        ),
        st.builds(lambda s: derived(s, "pay", {"other": 1}), st.text(min_size=1)),
    ),
)
def test_scope_for_finds_scope_ofs_scope(tool: str, call_id: str) -> None:
    if call_id.startswith(("undo/", "undo#", "edit/")):
        return
    assert scope_for(call_id, tool, ARGS, None, True) == scope_of(call_id, tool, ARGS)


def test_a_derived_id_keeps_its_scope() -> None:
    assert scope_for(derived("conv-1", "t.pay", ARGS, 2), "t.pay", ARGS, None, True) == "conv-1"
    assert scope_for("c1", "t.pay", ARGS, None, True) is None
