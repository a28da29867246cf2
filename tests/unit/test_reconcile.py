"""Bulk reconciliation's inputs, pure: the filter's terms and the operator's CSV. A bad one is
refused with what is wrong (and the CSV's line), before anything is read from the log."""

from __future__ import annotations

import pytest

from poimen._core.intents import Intent, IntentState
from poimen.operator._ops import OperatorInputError
from poimen.operator._reconcile import Filter, Row, parse_filter, read_csv

NOW = 1_800_000_000.0


def intent(**kw: object) -> Intent:
    base: dict[str, object] = dict(
        id="in_1", call_id="out/1", tool_id="mail.send", effect="unsafe", args="{}",
        args_hash="h", key=None, request_id=None, state=IntentState.INDETERMINATE, fence=1,
        owner=None, lease_expires_at=None, timeout_s=5.0, deadline_at=None, next_check_at=None,
        unknown_count=0, attempts=1, result=None, error=None,
        reason="unsafe_unknown_outcome", created_at=NOW - 7200, updated_at=NOW - 7200,
    )
    base.update(kw)
    return Intent(**base)  # type: ignore[arg-type]


def test_a_filter_takes_the_calls_all_its_terms_name() -> None:
    f = parse_filter(["tool=mail.send,reason=unsafe_unknown_outcome", "created<1h"], NOW)
    assert f == Filter(text="tool=mail.send,reason=unsafe_unknown_outcome,created<1h",
                       tool="mail.send", reason="unsafe_unknown_outcome",
                       created_before=NOW - 3600)
    assert f.matches(intent())
    assert not f.matches(intent(created_at=NOW - 60))  # inside the last hour
    assert not f.matches(intent(tool_id="sms.send"))
    assert not f.matches(intent(reason="key_drift"))
    assert not f.matches(intent(state=IntentState.RESOLVED_LANDED))  # decided already
    window = parse_filter(["created>2026-11-30T10:00Z,created<2026-11-30T11:00Z,call_id=out/"],
                          NOW)
    assert window.created_after == 1796032800.0 and window.created_before == 1796036400.0
    assert window.call_id == "out/"


@pytest.mark.parametrize(
    ("terms", "message"),
    [
        ([], "a filter needs at least one of"),
        ([" , ,"], "a filter needs at least one of"),
        (["colour=red"], "filter term 'colour=red' is not one of"),
        (["tool"], "filter term 'tool' is not one of"),
        (["tool="], "filter term 'tool=' has no value"),
        (["created=1h"], "created takes < or >"),
        (["tool<x"], "created takes < or >, the others take ="),
        (["created<soon"], "is not a duration"),
        (["tool=a,tool=b"], "filter names tool twice"),
    ],
)
def test_a_bad_filter_says_what_is_wrong(terms: list[str], message: str) -> None:
    with pytest.raises(OperatorInputError, match=message):
        parse_filter(terms, NOW)


def test_a_csv_gives_each_call_its_outcome() -> None:
    text = (
        "\ufeffRequest_ID,Outcome,result,note\n"
        "rq_1,landed,\"{\"\"id\"\": 9}\",seen in the dashboard\n"
        "\n"
        "rq_2,Not Landed,,bounced\n"
    )
    assert read_csv(text) == [
        Row(2, "request_id", "rq_1", True, {"id": 9}),
        Row(4, "request_id", "rq_2", False, None),
    ]


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("call_id,request_id,outcome\na,b,landed\n", "must name one of intent_id, call_id"),
        ("call_id,outcome\n,landed\n", "CSV line 2: no call_id"),
        ('call_id,outcome\n"a,landed\n', "CSV line"),
        ("call_id,outcome\na,landed,extra\n", "CSV line 2: 3 fields, the header has 2"),
        ("call_id,outcome,result\na,landed,NaN\n", "CSV line 2: result is not valid JSON"),
    ],
)
def test_a_bad_csv_names_its_line(text: str, message: str) -> None:
    with pytest.raises(OperatorInputError, match=message):
        read_csv(text)
