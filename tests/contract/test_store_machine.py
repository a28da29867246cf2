"""The store's compare-and-set rules under any sequence of operations from several owners with
stale fences, on both backends: a Hypothesis state machine against a model of the rules."""

from __future__ import annotations

import dataclasses
import uuid
from collections.abc import Iterator

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    consumes,
    invariant,
    rule,
    run_state_machine_as_test,
)

from poimen._core.intents import TERMINAL, IntentState, Owner
from poimen.errors import NotIndeterminateError
from poimen.store import NewDispatch, NewNotification, Store, open_store

S = IntentState
OWNERS = [Owner(f"w-{c}", f"host-{c}", 100 + i, str(i)) for i, c in enumerate("abc")]


@dataclasses.dataclass
class Model:
    state: S = S.DISPATCHED
    fence: int = 1
    attempts: int = 1
    deadline: float = 0.0
    lease: float = 0.0


@pytest.fixture
def store(store_url: str) -> Iterator[Store]:
    s = open_store(store_url)
    try:
        yield s
    finally:
        s.close()


def test_compare_and_set_rules_hold_for_any_sequence(store: Store) -> None:
    class Machine(RuleBasedStateMachine):
        intents = Bundle("intents")

        def __init__(self) -> None:
            super().__init__()
            self.model: dict[str, Model] = {}
            self.events: dict[str, int] = {}

        def _fence(self, iid: str, skew: int) -> int:
            return self.model[iid].fence + skew

        @rule(target=intents, owner=st.sampled_from(OWNERS))
        def dispatch(self, owner: Owner) -> str:
            now = store.now()
            iid = f"in_{uuid.uuid4().hex}"
            d = NewDispatch(
                intent_id=iid, call_id=f"c-{iid}", tool_id="t", effect="queryable",
                args="{}", args_hash="h", key=None, request_id=f"rq-{iid}", owner=owner,
                lease_expires_at=now + 30, timeout_s=1.0, deadline_at=now + 2, now=now,
            )
            _, created = store.record_dispatch(d)
            assert created
            self.model[iid] = Model(deadline=now + 2, lease=now + 30)
            return iid

        @rule(iid=intents, owner=st.sampled_from(OWNERS), skew=st.sampled_from([-1, 0, 0, 1]),
              new_attempt=st.booleans())
        def claim(self, iid: str, owner: Owner, skew: int, new_attempt: bool) -> None:
            m = self.model[iid]
            now = store.now()
            got = store.claim(iid, self._fence(iid, skew), owner, lease_expires_at=now + 30,
                              new_attempt=new_attempt, deadline_at=None, now=now)
            ok = m.state == S.DISPATCHED and skew == 0
            assert (got is not None) == ok
            if ok:
                assert got is not None and got.owner == owner
                m.fence += 1
                m.attempts += int(new_attempt)
                m.lease = now + 30

        @rule(iid=intents, skew=st.sampled_from([-1, 0, 0, 1]),
              state=st.sampled_from([S.COMPLETED, S.FAILED]))
        def outcome(self, iid: str, skew: int, state: S) -> None:
            m = self.model[iid]
            ok = store.record_outcome(iid, self._fence(iid, skew), state, result='"r"',
                                      error=None if state == S.COMPLETED else "no", now=store.now())
            assert ok == (m.state == S.DISPATCHED and skew == 0)
            if ok:
                m.state = state

        @rule(iid=intents, skew=st.sampled_from([-1, 0, 0, 1]))
        def landed(self, iid: str, skew: int) -> None:
            m = self.model[iid]
            ok = store.complete_landed(iid, self._fence(iid, skew), '"r"', store.now())
            assert ok == (m.state == S.DISPATCHED and skew == 0)
            if ok:
                m.state = S.COMPLETED

        @rule(iid=intents, skew=st.sampled_from([-1, 0, 0, 1]))
        def indeterminate(self, iid: str, skew: int) -> None:
            m = self.model[iid]
            note = NewNotification(f"{iid}:{uuid.uuid4().hex}", "indeterminate", "{}")
            ok = store.mark_indeterminate(iid, self._fence(iid, skew), "r", note, store.now())
            assert ok == (m.state == S.DISPATCHED and skew == 0)
            if ok:
                m.state = S.INDETERMINATE

        @rule(iid=intents, skew=st.sampled_from([-1, 0, 0, 1]))
        def unknown(self, iid: str, skew: int) -> None:
            m = self.model[iid]
            now = store.now()
            store.record_unknown(iid, self._fence(iid, skew), "timeout", now, now + 5)
            if m.state == S.DISPATCHED and skew == 0:
                m.deadline = max(m.deadline, now + 5)

        @rule(iid=intents, skew=st.sampled_from([-1, 0, 0, 1]), by=st.floats(-5, 5))
        def extend(self, iid: str, skew: int, by: float) -> None:
            m = self.model[iid]
            now = store.now()
            ok = store.extend_deadline(iid, self._fence(iid, skew), m.deadline + by, now)
            assert ok == (m.state == S.DISPATCHED and skew == 0)
            if ok:
                m.deadline = max(m.deadline, m.deadline + by)

        @rule(iid=intents, skew=st.sampled_from([-1, 0, 0, 1]))
        def defer(self, iid: str, skew: int) -> None:
            m = self.model[iid]
            now = store.now()
            ok = store.defer(iid, self._fence(iid, skew), next_check_at=now + 1, unknown_count=1,
                             reason="later", now=now)
            assert ok == (m.state == S.DISPATCHED and skew == 0)
            if ok:
                m.lease = now + 1  # a deferred intent's lease ends when its next check is due

        @rule(owner=st.sampled_from(OWNERS), by=st.floats(-60, 60))
        def renew(self, owner: Owner, by: float) -> None:
            now = store.now()
            ids = list(self.model)
            before = {iid: store.get_intent(iid) for iid in ids}
            store.renew_leases(owner.worker_id, ids, now + by, now)
            for iid in ids:
                it, was = store.get_intent(iid), before[iid]
                assert it is not None and was is not None
                m = self.model[iid]
                if it.state == S.DISPATCHED and it.lease_expires_at is not None:
                    assert it.lease_expires_at >= m.lease - 1e-6, "a renewal shortened a lease"
                    if was.lease_expires_at is not None and was.lease_expires_at <= now:
                        assert it.lease_expires_at == was.lease_expires_at, "revived a lease"
                    m.lease = it.lease_expires_at

        @rule(iid=consumes(intents), landed=st.booleans())
        def resolve(self, iid: str, landed: bool) -> None:
            m = self.model[iid]
            try:
                store.resolve(iid, landed=landed, result=None, operator="op", reason="checked",
                              now=store.now())
            except NotIndeterminateError:
                assert m.state != S.INDETERMINATE
                return
            assert m.state == S.INDETERMINATE
            m.state = S.RESOLVED_LANDED if landed else S.RESOLVED_NOT_LANDED

        @invariant()
        def the_log_agrees_with_the_model(self) -> None:
            for iid, m in self.model.items():
                it = store.get_intent(iid)
                assert it is not None
                assert (it.state, it.fence, it.attempts) == (m.state, m.fence, m.attempts)
                if it.state == S.DISPATCHED:
                    assert it.deadline_at is not None and it.deadline_at >= m.deadline - 1e-6
                n = len(store.events(iid))
                assert n >= self.events.get(iid, 0), "an event disappeared"
                self.events[iid] = n
                if m.state in TERMINAL:
                    assert it.lease_expires_at is None

    run_state_machine_as_test(
        Machine,
        settings=settings(
            max_examples=25,
            stateful_step_count=25,
            deadline=None,
            suppress_health_check=[HealthCheck.too_slow],
        ),
    )
