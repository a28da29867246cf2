"""The model check of the call protocol (verification.model) on bounded configurations.

Three kinds of test: configurations in which every property holds for the protocol as built
(among them those in which the check found its four violations, since fixed); the project's
rules with one rule broken on purpose, which the check must catch (else it could never fail);
and each finding's rule put back as it was, caught again, by a search and by its trace
replayed step by step (docs/verification.md, "What the model check found"). The same three
for the focused models of issue 20's rules (approvals, the key window, undo beside prune, a
spill beside a settle and readers), whose old rules are the defects that issue fixed.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from poimen._core import decide as _decide
from poimen._core.approval import approval_due
from poimen._core.decide import Defer, RetryDecision
from poimen._core.effects import EffectClass, Unsafe
from poimen._core.intents import Intent, IntentState
from verification.model import (
    OLD_RULES,
    ApprovalConfig,
    Config,
    KeyWindowConfig,
    Result,
    Rules,
    SpillConfig,
    UndoPruneConfig,
    explore,
    focused,
    main,
    replay,
)

QUERYABLE = Config(workers=1, intents=("queryable",), not_sent=False, refusals=False)
# Two workers, one cut off past its lease while its transaction is open (no crash needed).
TRANSACTIONAL = Config(workers=2, intents=("transactional",), crashes=False, not_sent=False,
                       refusals=False, lost_commit_replies=False)


def _holds(res: Result, at_least: int) -> None:
    print(res.report())  # the state count, in the test's output
    assert res.ok(), res.report()
    assert res.live_checked
    assert res.states > at_least  # the world was really explored


def test_the_rules_under_check_are_the_projects_own() -> None:
    r = Rules()
    assert r.decide is _decide.decide
    assert r.claimability is _decide.claimability
    assert r.takeover_deadline is _decide.takeover_deadline
    assert r.attempt_deadline is _decide.attempt_deadline
    assert r.failure_is_final is _decide.failure_is_final
    assert r.lookup_judged_as_asked and r.clock_before_read
    assert r.renewal_never_revives and r.defer_keeps_deadline and r.takeover_seizes
    assert r.marker_fences
    assert r.send_gate is _decide.send_gate
    assert r.approval_due is approval_due
    assert r.approval_window_checked and r.waiter_expires and r.gate_clock_at_send
    assert r.prune_keeps_undo_of_original and r.undo_reads_undone and r.prune_compares_history
    assert r.settle_checks_snapshot and r.history_one_snapshot


# The protocol as built holds every property.


@pytest.mark.parametrize("same_host", [True, False], ids=["one-host", "many-hosts"])
def test_unsafe_holds_every_property(same_host: bool) -> None:
    _holds(explore(Config(workers=2, intents=("unsafe",), same_host=same_host)), 2000)


def test_unsafe_holds_when_reads_are_judged_late() -> None:
    # Finding 3's configuration: a run slow between reading a row and judging it.
    _holds(explore(Config(workers=2, intents=("unsafe",), stale_reads=True)), 5000)


@pytest.mark.timeout(600)  # about 10 s of CPU: more than 120 s of a loaded machine's
def test_idempotent_holds_every_property() -> None:
    # Finding 2's: refused and unsent retries after an unknown outcome.
    _holds(explore(Config(workers=1, intents=("idempotent",))), 2000)
    _holds(explore(Config(workers=2, intents=("idempotent",))), 50_000)


@pytest.mark.timeout(600)
def test_queryable_holds_every_property() -> None:
    # Findings 1 and 4's: a slow lookup, a slow decision, a takeover that defers (finding 4's
    # was found with commits raising in their callers and no crashes).
    _holds(explore(QUERYABLE), 150_000)
    _holds(explore(dataclasses.replace(QUERYABLE, crashes=False)), 100_000)


@pytest.mark.timeout(600)
def test_transactional_holds_every_property() -> None:
    # The marker decides, and its lookup fences: one commit, never after "not landed", even
    # of an owner still running past its lease (not excused, unlike a Queryable request).
    _holds(explore(Config(workers=1, intents=("transactional",))), 2000)
    _holds(explore(TRANSACTIONAL), 100_000)


# Finding 5's configuration: a renewal applied up to a commit's time after its clock was read.


@pytest.mark.timeout(600)
def test_a_slow_renewal_never_revives_a_lease_a_recoverer_judged_run_out() -> None:
    _holds(explore(Config(workers=2, intents=("unsafe",), slow_renewals=True)), 1000)


# Issue 20's rules, each in a focused model: every property holds as built.


@pytest.mark.parametrize("cfg", focused("ci"), ids=lambda c: c.describe())
def test_a_focused_model_holds_every_property(cfg: Any) -> None:
    _holds(explore(cfg), 10)


# Broken rules the check must catch.


def _retrying_unsafe(
    current: EffectClass, intent: Intent, answer: Any, now: float, policy: _decide.Policy
) -> _decide.Decision:
    if isinstance(current, Unsafe) and intent.attempts < policy.max_attempts:
        return RetryDecision()
    return _decide.decide(current, intent, answer, now, policy)


def _trusting_not_landed(
    current: EffectClass, intent: Intent, answer: Any, now: float, policy: _decide.Policy
) -> _decide.Decision:
    return _decide.decide(
        current, dataclasses.replace(intent, deadline_at=None), answer, now, policy
    )


def _ignoring_liveness(intent: Intent, me: Any, *, held: bool, now: float, alive: Any) -> str:
    if intent.state != IntentState.DISPATCHED:
        return "settled"
    return "held" if held else "claimable"


def _deferring_forever(
    current: EffectClass, intent: Intent, answer: Any, now: float, policy: _decide.Policy
) -> _decide.Decision:
    return Defer(now + 1, intent.unknown_count, "never")


def _no_takeover_deadline(intent: Intent, now: float, margin: float) -> float | None:
    return None


def _gate_without_key_window(s: _decide.Send) -> _decide.Refused | None:
    return _decide.send_gate(dataclasses.replace(s, effect=Unsafe(), recorded="unsafe", attempt=1))


def _window_never_due(intent: Intent, now: float) -> bool:
    return False


@pytest.mark.parametrize(
    ("cfg", "rules", "expected"),
    [
        (Config(workers=1, intents=("unsafe",)), Rules(decide=_retrying_unsafe), "sent 2 times"),
        (QUERYABLE, Rules(decide=_trusting_not_landed), "landed 2 times"),
        (
            Config(workers=2, intents=("unsafe",), crashes=False),
            Rules(claimability=_ignoring_liveness),
            "whose lease never ran out",
        ),
        (
            Config(workers=1, intents=("unsafe",), crashes=False),
            Rules(decide=_deferring_forever),
            "no crash-free run settles every intent",
        ),
        (QUERYABLE, Rules(takeover_deadline=_no_takeover_deadline), "landed 2 times"),
        (KeyWindowConfig(), Rules(send_gate=_gate_without_key_window), "the key applied 2 times"),
        (
            ApprovalConfig(),
            Rules(approval_due=_window_never_due),
            "sent under an approval given after its window had ended",
        ),
    ],
    ids=[
        "unsafe-retried",
        "not-landed-trusted-early",
        "live-owner-taken",
        "never-settles",
        "no-takeover-deadline",
        "gate-without-key-window",
        "approval-window-never-ends",
    ],
)
def test_a_broken_rule_is_caught_with_a_trace(cfg: Any, rules: Rules, expected: str) -> None:
    res = explore(cfg, rules)
    assert res.violation is not None and expected in res.violation, res.report()
    text = res.report()
    assert "VIOLATION" in text and "trace" in text and "final state:" in text
    assert any(line.lstrip().startswith("t=") for line in res.trace)


# What the check found, each rule put back as it was before its fix: caught again.


@pytest.mark.parametrize(
    ("old_rule", "cfg", "expected"),
    [
        ("lookup-judged-when-answered", QUERYABLE, "landed 2 times"),
        (
            "refusal-always-final",
            Config(workers=1, intents=("idempotent",)),
            "is FAILED but its effect landed",
        ),
        (
            "clock-after-read",
            Config(workers=2, intents=("unsafe",), stale_reads=True),
            "whose lease never ran out",
        ),
        ("renewal-revives", Config(workers=2, intents=("unsafe",)), "renewed since"),
        ("defer-drops-deadline", QUERYABLE, "landed 2 times"),
        (
            "takeover-fence-only",
            Config(workers=2, intents=("unsafe",), slow_renewals=True),
            "renewed since",
        ),
        ("marker-lookup-reads-only", TRANSACTIONAL, "is FAILED but its write committed"),
        # Issue 20's defects, each in its focused model.
        (
            "approval-after-window",
            ApprovalConfig(),
            "sent under an approval given after its window had ended",
        ),
        (
            "waiter-ignores-window",
            ApprovalConfig(operators=0, upkeep=False),
            "no crash-free run settles every intent",
        ),
        ("gate-before-backoff", KeyWindowConfig(), "the key applied 2 times"),
        ("undo-twice-after-prune", UndoPruneConfig(), "the original was reversed 2 times"),
        ("prune-drops-undo", UndoPruneConfig(), "the original was reversed 2 times"),
        (
            "prune-updated-at-only",
            UndoPruneConfig(original_prunable=True),
            "committed, then lost: in neither the log nor the archive",
        ),
        ("settle-stale-snapshot", SpillConfig(), "COMPLETED and its attempt 1 never ended"),
        ("history-read-twice", SpillConfig(), "without attempt 1 or events"),
    ],
)
def test_a_findings_old_rule_is_caught_again(old_rule: str, cfg: Any, expected: str) -> None:
    res = explore(cfg, Rules(**OLD_RULES[old_rule]))
    assert res.violation is not None and expected in res.violation, res.report()
    if "no crash-free run" in expected:  # stuck from the start: nothing ends the window
        assert "call: AWAITING_APPROVAL" in "\n".join(res.trace), res.report()
    else:
        assert any(line.lstrip().startswith("t=") for line in res.trace)


NOT_LANDED_READ_EARLY = [
    "call", "commit:dispatch", "stamp", "invoke", "reply:unknown", "unknown", "tick", "tick",
    "commit:unknown", "decide", "lookup_read", "tick", "pool:landed", "tick", "tick",
    "lookup_answer:notlanded", "decide", "retry:claim", "commit:claim", "stamp", "invoke",
    "arrive:landed",
]  # fmt: skip
TAKEOVER_DEADLINE_FORGOTTEN = [
    "call", "commit:dispatch", "stamp", "tick", "tick", "invoke", "tick", "tick", "crash",
    "recover", "commit:seize", "take", "decide", "tick", "lookup_answer:unknown", "decide",
    "commit:defer", "recover", "commit:seize", "take", "decide", "lookup_read", "lookup_answer:notlanded", "decide",
    "retry:claim", "commit:claim", "stamp", "invoke", "arrive:landed", "pool:landed",
]  # fmt: skip


@pytest.mark.parametrize(
    ("steps", "old_rule"),
    [
        (NOT_LANDED_READ_EARLY, "lookup-judged-when-answered"),
        (TAKEOVER_DEADLINE_FORGOTTEN, "defer-drops-deadline"),
    ],
    ids=["finding-1", "finding-4"],
)
def test_a_findings_trace_replays_only_under_its_old_rule(steps: list[str], old_rule: str) -> None:
    res = replay(QUERYABLE, steps, Rules(**OLD_RULES[old_rule]))
    assert res.violation == "Queryable intent 0 landed 2 times", "\n".join(res.trace)
    # As built, the "not landed" answer is not trusted before the deadline: the run defers
    # where it retried, and cannot go on.
    with pytest.raises(ValueError, match=r"no transition 'retry:claim'") as err:
        replay(QUERYABLE, steps)
    assert "awaiting_deadline" in str(err.value)


def test_replay_refuses_a_run_that_is_not_possible() -> None:
    with pytest.raises(ValueError, match="no transition 'invoke' at t=0"):
        replay(QUERYABLE, ["invoke"])


def test_command_line_prints_states_and_exits_zero(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--workers", "1", "--intents", "unsafe"]) == 0
    out = capsys.readouterr().out
    assert "states explored:" in out and "1 of 1 configurations hold every property" in out


def test_command_line_runs_a_focused_model(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--model", "spill", "--set", "ci"]) == 0
    assert "1 of 1 configurations hold every property" in capsys.readouterr().out
    assert main(["--model", "spill", "--set", "ci", "--old-rule", "history-read-twice"]) == 1
    assert "VIOLATION: a reader found a dispatched intent" in capsys.readouterr().out


def test_command_line_exits_non_zero_on_a_violation(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--workers", "1", "--intents", "idempotent", "--old-rule", "refusal-always-final"]
    assert main(argv) == 1
    out = capsys.readouterr().out
    assert "not the protocol as built" in out
    assert "VIOLATION: intent 0 (idempotent) is FAILED but its effect landed" in out
