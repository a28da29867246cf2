"""An operator's decision needs a real name, through the Python API as through the CLI: the
audit must say who decided. A refused decision changes nothing."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from poimen import Caps, IntentState, Kernel, ToolContext, Unsafe
from poimen.operator._ops import OperatorInputError
from tests.contract.test_store_contract import dispatch

S = IntentState
BLANK = ["", " ", "\t\n "]


@pytest.fixture
def kernel(tmp_path: Path) -> Any:
    with Kernel(f"sqlite:///{tmp_path / 'log.db'}", notifiers=[]) as k:
        @k.tool(id="mail", effects=Unsafe(), caps=Caps(), timeout=5, requires_approval=True)
        def mail(ctx: ToolContext, to: str) -> str:
            return "sent"

        yield k


def _awaiting(k: Kernel) -> str:
    return k.call("mail", {"to": "bob"}, call_id=f"c{len(k.store.list_intents())}").intent_id


def _indeterminate(k: Kernel) -> str:
    iid = dispatch(k.store, f"d{len(k.store.list_intents())}", effect="unsafe")
    k.abandon(iid, operator="ann", reason="its host is gone")
    return iid


DECISIONS: dict[str, tuple[Callable[[Kernel], str], Callable[..., Any], S]] = {
    "resolve": (_indeterminate, lambda k, i, **kw: k.resolve(i, landed=False, **kw),
                S.RESOLVED_NOT_LANDED),
    "abandon": (lambda k: dispatch(k.store, "stuck", effect="unsafe"),
                lambda k, i, **kw: k.abandon(i, **kw), S.INDETERMINATE),
    "approve": (_awaiting, lambda k, i, **kw: k.approve(i, **kw), S.DISPATCHED),
    "reject": (_awaiting, lambda k, i, **kw: k.reject(i, **kw), S.FAILED),
}


@pytest.mark.parametrize("what", list(DECISIONS))
def test_a_decision_without_a_real_operator_name_is_refused(kernel: Kernel, what: str) -> None:
    make, decide, decided = DECISIONS[what]
    iid = make(kernel)
    before = kernel.store.get_intent(iid)
    history = kernel.store.events(iid)
    for name in BLANK:
        with pytest.raises(OperatorInputError, match="operator's name") as refused:
            decide(kernel, iid, operator=name, reason="r")
        assert refused.value.field == "operator"  # type: ignore[attr-defined]
        assert kernel.store.get_intent(iid) == before and kernel.store.events(iid) == history
    done = decide(kernel, iid, operator="  ann ", reason="r")
    assert done.state == decided
    assert [e.actor for e in kernel.store.events(iid)][len(history):][0] == "ann"
