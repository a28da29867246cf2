"""Canonical encoding and key derivation (docs/design.md §2)."""

from __future__ import annotations

import datetime as dt
import json
import math
import subprocess
import sys

import pytest
from hypothesis import given
from hypothesis import strategies as st

from poimen import MAX_ARGS_BYTES, KeyDerivation
from poimen._core.keys import canonical, encode_args, hash_key
from poimen.errors import ArgumentEncodingError, ArgumentTooLargeError

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text()
    | st.floats(allow_nan=False, allow_infinity=False),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(), inner, max_size=4),
    max_leaves=20,
)


def test_canonical_form_is_sorted_compact_utf8() -> None:
    assert canonical({"b": 1, "a": [1, "é"], "c": {"z": None, "y": True}}) == (
        '{"a":[1,"é"],"b":1,"c":{"y":true,"z":null}}'
    )


@given(st.dictionaries(st.text(), json_values, max_size=6))
def test_encoding_ignores_insertion_order_and_round_trips(args: dict[str, object]) -> None:
    _, text = encode_args(args)
    _, reordered = encode_args(dict(reversed(list(args.items()))))
    assert text == reordered
    assert json.loads(text) == json.loads(canonical(json.loads(text)))


@pytest.mark.parametrize(
    ("args", "named"),
    [
        ({"amount": math.nan}, "amount"),
        ({"order": {"price": math.inf}}, "order.price"),
        ({"items": [1, -math.inf]}, "items[1]"),
        ({"blob": b"\x00\x01"}, "blob"),
        ({"thing": object()}, "thing"),
        ({"m": {1: "x"}}, "m"),
        ({"s": {1, 2}}, "s"),
    ],
)
def test_unencodable_arguments_are_refused_naming_the_argument(
    args: dict[str, object], named: str
) -> None:
    with pytest.raises(ArgumentEncodingError) as err:
        encode_args(args)
    assert err.value.argument == named
    assert repr(named) in str(err.value)


def test_oversized_arguments_are_refused_naming_the_largest() -> None:
    with pytest.raises(ArgumentTooLargeError) as err:
        encode_args({"small": "x", "big": "y" * (MAX_ARGS_BYTES + 1)})
    assert err.value.argument == "big"
    assert err.value.limit == MAX_ARGS_BYTES


def test_time_values_encode_as_iso_text() -> None:
    data, _ = encode_args({"at": dt.datetime(2026, 1, 2, 3, 4, 5, tzinfo=dt.UTC)})
    assert data == {"at": "2026-01-02T03:04:05+00:00"}


def test_key_depends_on_tool_version_and_selected_values_only() -> None:
    d = KeyDerivation.fields("order_id", "amount_cents")
    base = d.derive("charge", {"order_id": "o1", "amount_cents": 5, "note": "a"})
    assert base.startswith("pk1_")
    assert d.derive("charge", {"order_id": "o1", "amount_cents": 5, "note": "b"}) == base
    assert d.derive("charge", {"order_id": "o1", "amount_cents": 6, "note": "a"}) != base
    assert d.derive("refund", {"order_id": "o1", "amount_cents": 5}) != base
    v2 = KeyDerivation.fields("order_id", "amount_cents", version=2)
    assert v2.derive("charge", {"order_id": "o1", "amount_cents": 5}) != base


def test_dotted_paths_select_nested_values() -> None:
    d = KeyDerivation.fields("order.id")
    a = d.derive("t", {"order": {"id": "x", "note": 1}})
    assert a == d.derive("t", {"order": {"id": "x", "note": 2}})
    assert a != d.derive("t", {"order": {"id": "y", "note": 1}})


def test_all_args_excludes_named_arguments() -> None:
    d = KeyDerivation.all_args(exclude=("trace",))
    assert d.derive("t", {"a": 1, "trace": "x"}) == d.derive("t", {"a": 1, "trace": "y"})
    assert d.derive("t", {"a": 1}) != d.derive("t", {"a": 2})


def test_length_prefixing_keeps_parts_apart() -> None:
    assert hash_key("ab", 1, "c") != hash_key("a", 1, "bc")


def test_key_is_identical_in_another_process() -> None:
    args = {"order_id": "o-ü", "amount_cents": 1200, "meta": {"b": [1, 2.5], "a": None}}
    here = KeyDerivation.all_args().derive("charge", args)
    code = (
        "import json,sys; from poimen import KeyDerivation; "
        "print(KeyDerivation.all_args().derive('charge', json.loads(sys.argv[1])))"
    )
    there = subprocess.run(
        [sys.executable, "-c", code, json.dumps(args)], capture_output=True, text=True, check=True,
        env={"PYTHONHASHSEED": "12345", "PATH": "/usr/bin:/bin"},
    ).stdout.strip()
    assert there == here


@given(json_values | st.floats(allow_nan=False) | st.integers(min_value=-(10**30)))
def test_the_canonical_text_is_json_dumps_sorted_compact(value: object) -> None:
    # canonical() runs json's C encoder made once (poimen._core.keys._FAST): keys are derived
    # from these bytes, so they must be json.dumps's for every value, scalars at the top too.
    try:
        want = json.dumps(
            value, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False
        )
    except ValueError:
        with pytest.raises(ArgumentEncodingError):
            canonical(value)  # type: ignore[arg-type]
        return
    assert canonical(value) == want  # type: ignore[arg-type]


def test_a_cycle_is_refused_as_too_deep() -> None:
    loop: list[object] = []
    loop.append(loop)
    with pytest.raises(ArgumentEncodingError, match="nested more than"):
        canonical(loop)  # type: ignore[arg-type]


utf8_text = st.text(st.characters(blacklist_categories=("Cs",)))
scalar_args = st.dictionaries(
    utf8_text, st.none() | st.booleans() | st.integers() | utf8_text, max_size=5
)


@given(scalar_args, st.dictionaries(utf8_text, json_values, max_size=3), st.booleans())
def test_a_call_keeps_its_given_text_only_where_the_recorded_text_is_the_same(
    args: dict[str, object], changed: dict[str, object], same: bool
) -> None:
    """`prepare` skips the second encoding when `_same_scalars` holds: then the bytes (and
    so the keys) are those the recorded arguments encode to."""
    from poimen._engine.engine import _same_scalars

    recorded = dict(args) if same else {**args, **changed}
    try:
        canonical(recorded)
    except ArgumentEncodingError:
        return  # a float's NaN cannot occur here, a surrogate in json_values' text can
    if _same_scalars(args, recorded):
        assert encode_args(args)[1] == canonical(recorded)
    assert not _same_scalars({"n": 1}, {"n": 1.0})
    assert not _same_scalars({"n": 1}, {"n": True})
    assert not _same_scalars({"n": 0}, {"n": False})
    assert not _same_scalars({"n": None}, {})
