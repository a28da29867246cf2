"""The pure decision rules, as a table and as properties over every input Hypothesis finds."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from poimen import (
    Idempotent,
    IntentState,
    KeyDerivation,
    Landed,
    NotLanded,
    Queryable,
    ReadOnly,
    Transactional,
    Unknown,
    Unsafe,
)
from poimen._core.decide import (
    Ask,
    Complete,
    Defer,
    Fail,
    KeyDerived,
    KeyFailed,
    MarkIndeterminate,
    Policy,
    Refused,
    RetryDecision,
    Send,
    Unasked,
    after_refusal,
    claimability,
    decide,
    send_gate,
    takeover_deadline,
)
from poimen._core.effects import effect_name
from poimen._core.intents import Intent, Owner

S = IntentState
POLICY = Policy(max_attempts=5, lookup_limit=8, lookup_backoff=1.0, max_backoff=300.0)
KEY = "pk1_k"
ME = Owner("w-me", "host-a", 100, "7")


def _lookup(rid: str) -> Any:
    return NotLanded()


IDEMPOTENT = Idempotent(key=KeyDerivation.fields("x"))
EXPIRING = Idempotent(key=KeyDerivation.fields("x"), key_ttl=60.0)
QUERYABLE = Queryable(lookup=_lookup)
UNSAFE = Unsafe()
TRANSACTIONAL = Transactional(database="sqlite:///app.db")


def intent(effect: str = "idempotent", **kw: Any) -> Intent:
    base = Intent(
        id="in_1", call_id="c1", tool_id="t", effect=effect, args='{"x":1}', args_hash="h",
        key=KEY if effect == "idempotent" else None,
        request_id="rq_1" if effect == "queryable" else None, state=S.DISPATCHED, fence=1,
        owner=Owner("w-dead", "host-a", 99, "1"), lease_expires_at=1000.0, timeout_s=10.0,
        deadline_at=1011.0, next_check_at=None, unknown_count=0, attempts=1, result=None,
        error=None, reason=None, created_at=1000.0, updated_at=1000.0,
    )
    return dataclasses.replace(base, **kw)


@pytest.mark.parametrize(
    ("current", "it", "answer", "now", "expected"),
    [
        # Idempotent: ask for the key, retry on the same key, anything else is an operator's.
        (IDEMPOTENT, intent(), Unasked(), 2000.0, Ask("key")),
        (IDEMPOTENT, intent(), KeyDerived(KEY), 2000.0, RetryDecision()),
        (IDEMPOTENT, intent(), KeyDerived("pk1_other"), 2000.0, MarkIndeterminate("key_drift")),
        (IDEMPOTENT, intent(), KeyFailed("KeyError"), 2000.0,
         MarkIndeterminate("key_derivation_failed")),
        (IDEMPOTENT, intent(attempts=5), KeyDerived(KEY), 2000.0,
         MarkIndeterminate("retries_exhausted")),
        # The key's window, as of when the retry's request may arrive (now + timeout).
        (EXPIRING, intent(), KeyDerived(KEY), 1050.0, RetryDecision()),
        (EXPIRING, intent(), Unasked(), 1051.0, MarkIndeterminate("key_expired")),
        # Queryable: landed completes; not landed is trusted only after the deadline.
        (QUERYABLE, intent("queryable"), Unasked(), 1005.0, Ask("lookup")),
        (QUERYABLE, intent("queryable"), Landed({"id": 7}), 1005.0, Complete({"id": 7})),
        (QUERYABLE, intent("queryable"), NotLanded(), 1005.0,
         Defer(1011.0, 0, "awaiting_deadline")),
        (QUERYABLE, intent("queryable"), NotLanded(), 1011.0, RetryDecision()),
        (QUERYABLE, intent("queryable", attempts=5), NotLanded(), 1011.0,
         MarkIndeterminate("retries_exhausted")),
        (QUERYABLE, intent("queryable", unknown_count=2), Unknown("503"), 1020.0,
         Defer(1024.0, 3, "lookup_unknown: 503")),
        (QUERYABLE, intent("queryable", unknown_count=7), Unknown("503"), 1020.0,
         MarkIndeterminate("lookup_unknown_limit")),
        # Transactional: the marker decides; asking fenced every attempt so far out of it, so
        # "not landed" is final at once (no deadline), and a spent policy is a plain FAILED.
        (TRANSACTIONAL, intent("transactional"), Unasked(), 1005.0, Ask("marker")),
        (TRANSACTIONAL, intent("transactional"), Landed({"n": 1}), 1005.0, Complete({"n": 1})),
        (TRANSACTIONAL, intent("transactional"), NotLanded(), 1005.0, RetryDecision()),
        (TRANSACTIONAL, intent("transactional", attempts=5), NotLanded(), 1005.0,
         Fail("retries_exhausted")),
        (TRANSACTIONAL, intent("transactional", unknown_count=2), Unknown("locked"), 1020.0,
         Defer(1024.0, 3, "lookup_unknown: locked")),
        (TRANSACTIONAL, intent("transactional", unknown_count=7), Unknown("down"), 1020.0,
         MarkIndeterminate("lookup_unknown_limit")),
        (TRANSACTIONAL, intent("idempotent"), Unasked(), 2000.0,
         MarkIndeterminate("effect_changed")),
        # Unsafe: never retried.
        (UNSAFE, intent("unsafe"), Unasked(), 2000.0, MarkIndeterminate("unsafe_unknown_outcome")),
        # The recorded class decides: a changed one is an operator's call.
        (QUERYABLE, intent("unsafe"), Unasked(), 2000.0, MarkIndeterminate("effect_changed")),
        (UNSAFE, intent("queryable"), Unasked(), 2000.0, MarkIndeterminate("effect_changed")),
        (IDEMPOTENT, intent("unsafe"), Unasked(), 2000.0, MarkIndeterminate("effect_changed")),
        (UNSAFE, intent("idempotent"), Unasked(), 2000.0, MarkIndeterminate("effect_changed")),
    ],
)
def test_decision_table(current: Any, it: Intent, answer: Any, now: float, expected: Any) -> None:
    assert decide(current, it, answer, now, POLICY) == expected


def test_lookups_answering_unknown_are_deferred_by_at_most_the_maximum() -> None:
    patient = Policy(max_attempts=5, lookup_limit=1000, lookup_backoff=1.0, max_backoff=300.0)
    waits = [
        decide(QUERYABLE, intent("queryable", unknown_count=n), Unknown("503"), 0.0, patient)
        for n in (0, 1, 8, 9, 40, 500)
    ]
    assert [d.at for d in waits if isinstance(d, Defer)] == [1.0, 2.0, 256.0, 300.0, 300.0, 300.0]


def test_an_answer_of_the_wrong_kind_is_a_programming_error() -> None:
    with pytest.raises(TypeError):
        decide(IDEMPOTENT, intent(), NotLanded(), 2000.0, POLICY)


# Properties.

effects = st.sampled_from([IDEMPOTENT, EXPIRING, QUERYABLE, UNSAFE, TRANSACTIONAL])
times = st.floats(min_value=0, max_value=1e6, allow_nan=False)
answers = st.one_of(
    st.just(Unasked()),
    st.builds(KeyDerived, st.sampled_from([KEY, "pk1_other"])),
    st.builds(KeyFailed, st.text(max_size=5)),
    st.builds(Landed, st.integers()),
    st.just(NotLanded()),
    st.builds(Unknown, st.text(max_size=5)),
)
intents = st.builds(
    intent,
    effect=st.sampled_from(["idempotent", "queryable", "unsafe", "transactional"]),
    attempts=st.integers(1, 8),
    unknown_count=st.integers(0, 10),
    deadline_at=st.one_of(st.none(), times),
    created_at=times,
)
policies = st.builds(
    Policy,
    max_attempts=st.integers(1, 6),
    lookup_limit=st.integers(1, 9),
    lookup_backoff=st.floats(0.01, 10),
    max_backoff=st.floats(0.01, 600),
)

_FOR = {
    "idempotent": (Unasked, KeyDerived, KeyFailed),
    "queryable": (Unasked, Landed, NotLanded, Unknown),
    "unsafe": (Unasked,),
    "transactional": (Unasked, Landed, NotLanded, Unknown),
}


@settings(max_examples=2000, deadline=None)
@given(current=effects, it=intents, answer=answers, now=times, policy=policies)
def test_no_rule_ever_risks_a_second_effect(
    current: Any, it: Intent, answer: Any, now: float, policy: Policy
) -> None:
    if effect_name(current) == it.effect and not isinstance(answer, _FOR[it.effect]):
        # An answer of another class is a programming error, unless no answer was needed.
        try:
            d = decide(current, it, answer, now, policy)
        except TypeError:
            return
        assert isinstance(d, MarkIndeterminate)
        return
    d = decide(current, it, answer, now, policy)
    assert d == decide(current, it, answer, now, policy)  # pure: the same input, the same answer
    if effect_name(current) != it.effect:
        assert d == MarkIndeterminate("effect_changed")
    if isinstance(d, RetryDecision):
        # A retry only where the class makes it safe, and within every bound.
        assert effect_name(current) == it.effect
        assert it.attempts < policy.max_attempts
        assert not isinstance(current, Unsafe)
        if isinstance(current, Idempotent):
            assert answer == KeyDerived(it.key or "")
            assert current.key_ttl is None or (
                now + it.timeout_s - it.created_at <= current.key_ttl
            )
        elif isinstance(current, Transactional):
            assert isinstance(answer, NotLanded)  # the lookup that fenced every attempt out
        else:
            assert isinstance(answer, NotLanded)
            assert it.deadline_at is None or now >= it.deadline_at
    if isinstance(d, Complete):
        assert isinstance(current, Queryable | Transactional) and isinstance(answer, Landed)
    if isinstance(d, Fail):
        # FAILED says no effect: only where nothing can have landed or land later.
        assert isinstance(current, ReadOnly) or (
            isinstance(answer, NotLanded) and isinstance(current, Transactional)
        )
    if isinstance(d, Defer):
        assert d.at >= now or d.reason == "awaiting_deadline"
        if isinstance(answer, Unknown):
            assert d.unknown_count == it.unknown_count + 1 < policy.lookup_limit
            assert d.at <= now + policy.max_backoff  # the back-off is capped
    if isinstance(current, Unsafe):
        assert isinstance(d, MarkIndeterminate)


owners = st.builds(
    Owner, st.sampled_from(["w-me", "w-b"]), st.sampled_from(["host-a", "host-b"]),
    st.sampled_from([100, 101]), st.sampled_from(["7", "8"]),
)


# The property below finds a live owner taken over only by chance (about one run in six
# missed it): these cases are always tried.
@pytest.mark.parametrize(
    ("owner", "alive"),
    [(Owner("w-b", "host-a", 101, "8"), True), (Owner("w-b", "host-b", 101, "8"), False)],
    ids=["alive-here", "another-host"],
)
def test_an_owner_whose_lease_has_not_run_out_keeps_its_call(owner: Owner, alive: bool) -> None:
    it = intent(owner=owner, lease_expires_at=1005.0)
    assert claimability(it, ME, held=False, now=1004.0, alive=lambda o: alive) == "live"
    assert claimability(it, ME, held=False, now=1005.0, alive=lambda o: alive) == "claimable"


@settings(max_examples=2000, deadline=None)
@given(
    it=intents, owner=st.one_of(st.none(), owners), held=st.booleans(), alive=st.booleans(),
    now=times, lease=st.one_of(st.none(), times), next_check=st.one_of(st.none(), times),
    state=st.sampled_from(list(S)),
)
def test_a_live_call_is_never_claimable(
    it: Intent, owner: Owner | None, held: bool, alive: bool, now: float, lease: float | None,
    next_check: float | None, state: S,
) -> None:
    it = dataclasses.replace(
        it, owner=owner, lease_expires_at=lease, next_check_at=next_check, state=state
    )
    c = claimability(it, ME, held=held, now=now, alive=lambda o: alive)
    if c != "claimable":
        return
    assert state == S.DISPATCHED and not held
    assert next_check is None or next_check <= now
    if owner is not None and owner != ME:
        # Someone else's: only once its lease ran out, or its process is gone (same host).
        assert (lease is not None and lease <= now) or (owner.host == ME.host and not alive)


@given(it=intents, now=times, margin=st.floats(0, 5))
def test_taking_over_a_stopped_attempt_never_moves_its_deadline_earlier(
    it: Intent, now: float, margin: float
) -> None:
    later = takeover_deadline(it, now, margin)
    if later is None:
        return
    assert later >= now + it.timeout_s + margin - 1e-6
    assert it.deadline_at is None or later > it.deadline_at
    deferred = dataclasses.replace(it, next_check_at=now)
    assert takeover_deadline(deferred, now, margin) is None


# The send gate: whether one request of a tool may leave its handle now.

READ_ONLY = ReadOnly()


def send(effect: Any = IDEMPOTENT, **kw: Any) -> Send:
    base = Send(
        effect=effect, recorded=effect_name(effect), write=True, live=True, state=S.DISPATCHED,
        attempt=1, writes=0, key_from=1000.0, now=1001.0, within=5.0,
    )
    return dataclasses.replace(base, **kw)


def _code(r: Refused | None) -> str | None:
    return None if r is None else r.reason


@pytest.mark.parametrize(
    ("s", "expected"),
    [
        # A first write of a dispatched live call goes, whatever its class.
        (send(IDEMPOTENT), None),
        (send(EXPIRING, now=5000.0), None),  # nothing went out under the key before
        (send(QUERYABLE), None),
        (send(UNSAFE), None),
        # A read changes nothing: it always goes.
        (send(READ_ONLY, write=False), None),
        (send(UNSAFE, write=False, attempt=2, live=False, state=S.AWAITING_APPROVAL), None),
        # The class recorded with the call decides, never the one registered since.
        (send(UNSAFE, recorded="idempotent"), "effect_changed"),
        # ReadOnly writes nothing; a sandbox kernel lets no write leave.
        (send(READ_ONLY), "read_only"),
        # Transactional writes only through its transaction, never a handle.
        (send(TRANSACTIONAL), "transactional"),
        (send(TRANSACTIONAL, live=False, attempt=2), "transactional"),
        (send(TRANSACTIONAL, write=False), None),
        (send(READ_ONLY, live=False), "read_only"),
        (send(IDEMPOTENT, live=False), "sandbox"),
        (send(UNSAFE, live=False), "sandbox"),
        # Only a dispatched call sends: one awaiting approval (or settled) does not.
        (send(UNSAFE, state=S.AWAITING_APPROVAL), "not_dispatched"),
        (send(IDEMPOTENT, state=S.COMPLETED), "not_dispatched"),
        # Unsafe: never a second attempt's request; more writes of its one attempt go.
        (send(UNSAFE, attempt=2), "unsafe_reissue"),
        (send(UNSAFE, writes=3), None),
        # Queryable: its retry follows "not landed" after the deadline; no window applies.
        (send(QUERYABLE, attempt=3, now=1e9), None),
        # Idempotent: after something may have gone out under the key, only while the
        # provider still remembers it when this request can arrive (now + within).
        (send(EXPIRING, attempt=2, now=1054.0), None),
        (send(EXPIRING, attempt=2, now=1055.0), None),
        (send(EXPIRING, attempt=2, now=1055.5), "key_expired"),
        (send(EXPIRING, writes=1, now=1056.0), "key_expired"),
        (send(EXPIRING, attempt=2, now=1050.0, within=11.0), "key_expired"),
        (send(IDEMPOTENT, attempt=2, now=1e9), None),  # no window: keys are kept for ever
    ],
)
def test_send_gate_table(s: Send, expected: str | None) -> None:
    assert _code(send_gate(s)) == expected


@pytest.mark.parametrize(
    ("effect", "attempt", "writes", "expected"),
    [
        # Nothing of the call can have gone out: FAILED.
        (IDEMPOTENT, 1, 0, Fail),
        (UNSAFE, 1, 0, Fail),
        (QUERYABLE, 2, 0, Fail),  # its attempt 1 did not land (a retry follows "not landed")
        (READ_ONLY, 4, 0, Fail),
        (TRANSACTIONAL, 3, 0, Fail),  # its retry follows a lookup that fenced attempts 1, 2 out
        # A write of this attempt went out, or an earlier attempt may have landed.
        (IDEMPOTENT, 1, 1, MarkIndeterminate),
        (QUERYABLE, 1, 2, MarkIndeterminate),
        (IDEMPOTENT, 2, 0, MarkIndeterminate),
        (UNSAFE, 2, 0, MarkIndeterminate),
    ],
)
def test_how_an_attempt_ends_after_a_refused_send(
    effect: Any, attempt: int, writes: int, expected: type
) -> None:
    got = after_refusal(effect, attempt, writes, Refused("key_expired", "gone"))
    assert type(got) is expected
    if isinstance(got, MarkIndeterminate):
        assert got.reason == "key_expired"


sends = st.builds(
    send,
    effect=st.sampled_from([IDEMPOTENT, EXPIRING, QUERYABLE, UNSAFE, READ_ONLY, TRANSACTIONAL]),
    recorded=st.sampled_from(["idempotent", "queryable", "unsafe", "readonly", "transactional"]),
    write=st.booleans(),
    live=st.booleans(),
    state=st.sampled_from(list(S)),
    attempt=st.integers(1, 5),
    writes=st.integers(0, 3),
    key_from=times,
    now=times,
    within=st.floats(0, 100),
)


@settings(max_examples=3000, deadline=None)
@given(s=sends)
def test_no_write_leaves_where_it_could_double_an_effect(s: Send) -> None:
    r = send_gate(s)
    assert r == send_gate(s)  # pure
    if r is None and s.write:
        assert s.live and s.state == S.DISPATCHED
        assert effect_name(s.effect) == s.recorded
        assert not isinstance(s.effect, ReadOnly | Transactional)
        assert not (isinstance(s.effect, Unsafe) and s.attempt > 1)
        if isinstance(s.effect, Idempotent) and s.effect.key_ttl is not None and (
            s.attempt > 1 or s.writes > 0
        ):
            # A second send under the key arrives while the provider remembers it.
            assert s.now + s.within - s.key_from <= s.effect.key_ttl
    if not s.write:
        assert r is None
    if r is not None:
        # A refused attempt is FAILED only if nothing of the call can have gone out.
        end = after_refusal(s.effect, s.attempt, s.writes, r)
        if s.writes > 0 or (s.attempt > 1 and isinstance(s.effect, Idempotent | Unsafe)):
            assert end == MarkIndeterminate(r.reason)
