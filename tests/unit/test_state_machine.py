"""The one table of allowed transitions; every other pair is refused."""

from __future__ import annotations

import itertools

import pytest

from poimen import IntentState
from poimen._core.intents import TERMINAL, TRANSITIONS, check_transition
from poimen.errors import IllegalTransitionError

S = IntentState
ALLOWED = {
    (None, S.DISPATCHED),
    (None, S.AWAITING_APPROVAL),
    (S.AWAITING_APPROVAL, S.DISPATCHED),
    (S.AWAITING_APPROVAL, S.FAILED),
    (S.DISPATCHED, S.DISPATCHED),
    (S.DISPATCHED, S.COMPLETED),
    (S.DISPATCHED, S.FAILED),
    (S.DISPATCHED, S.INDETERMINATE),
    (S.INDETERMINATE, S.RESOLVED_LANDED),
    (S.INDETERMINATE, S.RESOLVED_NOT_LANDED),
}
PAIRS = list(itertools.product([None, *S], list(S)))


@pytest.mark.parametrize(("src", "dst"), [p for p in PAIRS if p in ALLOWED])
def test_allowed_transitions_pass(src: IntentState | None, dst: IntentState) -> None:
    check_transition(src, dst)


@pytest.mark.parametrize(("src", "dst"), [p for p in PAIRS if p not in ALLOWED])
def test_every_other_transition_is_refused(src: IntentState | None, dst: IntentState) -> None:
    with pytest.raises(IllegalTransitionError) as err:
        check_transition(src, dst)
    assert err.value.target == dst


def test_table_covers_every_state_and_terminal_states_have_no_exit() -> None:
    assert set(TRANSITIONS) == {None, *S}
    assert {S.COMPLETED, S.FAILED, S.RESOLVED_LANDED, S.RESOLVED_NOT_LANDED} == TERMINAL
    # No path from INDETERMINATE leads back to DISPATCHED: an operator resolves, nothing retries.
    assert S.DISPATCHED not in TRANSITIONS[S.INDETERMINATE]
