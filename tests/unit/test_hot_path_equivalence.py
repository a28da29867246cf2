"""The call path's fast paths give exactly what the plain forms give (benchmark-driven code)."""

from __future__ import annotations

import hashlib
import json
import random
import re
from pathlib import Path
from typing import Any

import pytest

from poimen import Caps, Idempotent, Kernel, KeyDerivation, ToolContext
from poimen._core.keys import (
    KEY_DOMAIN,
    KEY_PREFIX,
    canonical,
    encode_args,
    hash_key,
    to_json_value,
)
from poimen._runtime import engine_of
from poimen.errors import ArgumentError
from poimen.store.sqlite import SqliteStore


def random_json(rng: random.Random, depth: int = 0) -> Any:
    kind = rng.randrange(8 if depth < 3 else 5)
    if kind == 0:
        return None
    if kind == 1:
        return rng.random() < 0.5
    if kind == 2:
        return rng.randrange(-(10**20), 10**20)
    if kind == 3:
        return "".join(chr(rng.randrange(32, 0x2FFF)) for _ in range(rng.randrange(6)))
    if kind == 4:
        return rng.uniform(-1e9, 1e9)
    if kind == 5:
        return [random_json(rng, depth + 1) for _ in range(rng.randrange(4))]
    if kind == 6:
        return (random_json(rng, depth + 1), random_json(rng, depth + 1))
    return {f"k{rng.randrange(9)}": random_json(rng, depth + 1) for _ in range(4)}


def plain_canonical(value: Any) -> str:
    return json.dumps(
        value, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False
    )


def plain_hash_key(tool_id: str, version: int, selected: Any) -> str:
    h = hashlib.sha256(KEY_DOMAIN)
    for part in (tool_id.encode(), str(version).encode(), plain_canonical(selected).encode()):
        h.update(len(part).to_bytes(8, "big"))
        h.update(part)
    return KEY_PREFIX + h.hexdigest()[:48]


def test_canonical_and_key_match_the_plain_definitions() -> None:
    rng = random.Random(6)  # a fixed seed: the same 500 cases every run
    for n in range(500):
        args = {f"a{i}" if i % 2 else "": random_json(rng) for i in range(rng.randrange(5))}
        tool_id, version = f"tool-{n % 7}", n % 3
        data = to_json_value(args, "<args>")
        assert canonical(data) == plain_canonical(data)
        assert hash_key(tool_id, version, data) == plain_hash_key(tool_id, version, data)
        top = [name for name in sorted(args) if name][:2]
        if top:
            kd = KeyDerivation.fields(*top)
            assert kd.derive(tool_id, data) == plain_hash_key(
                tool_id, 1, {name: data[name] for name in top}
            )


def test_record_dispatch_returns_the_row_it_wrote(tmp_path: Path) -> None:
    kernel = Kernel(SqliteStore(tmp_path / "log.db"), notifiers=[])

    @kernel.tool(id="t", effects=Idempotent(key=KeyDerivation.fields("a")), caps=Caps(), timeout=3)
    def t(ctx: ToolContext, a: str, n: int = 0) -> None:
        return None

    try:
        _, d, _ = engine_of(kernel).prepare("t", {"a": "é", "n": 2}, "call-1")
        returned, created = kernel.store.record_dispatch(d)
        assert created
        assert returned == kernel.store.get_intent(d.intent_id)
        again, created = kernel.store.record_dispatch(d)
        assert not created and again == returned
    finally:
        kernel.close()


def test_a_tools_call_plan_gives_the_key_its_derivation_gives(tmp_path: Path) -> None:
    # Engine.prepare takes the key from the tool's call plan (made at registration): the same
    # key as KeyDerivation.derive for every mode, and the same refusal of a missing field.
    kernel = Kernel(SqliteStore(tmp_path / "log.db"), notifiers=[])
    derivations = {
        "top": KeyDerivation.fields("a", "b"),
        "top2": KeyDerivation.fields("b", version=2),
        "nested": KeyDerivation.fields("a", "c.x"),
        "all": KeyDerivation.all_args(exclude=["b"]),
        "custom": KeyDerivation.custom(lambda args: [args["a"], args.get("b")]),
    }
    for tid, kd in derivations.items():

        @kernel.tool(id=tid, effects=Idempotent(key=kd), caps=Caps(), timeout=3)
        def t(ctx: ToolContext, a: Any = None, b: Any = None, c: Any = None) -> None:
            return None

    rng = random.Random(7)
    try:
        for _ in range(200):
            args = {"a": random_json(rng), "b": random_json(rng), "c": {"x": random_json(rng)}}
            data = to_json_value(args, "<args>")
            for tid, kd in derivations.items():
                plan = kernel._engine.plans[tid]
                assert plan.key is not None
                assert plan.key(data) == kd.derive(tid, data), tid
                assert engine_of(kernel).prepare(tid, args, f"c-{tid}")[1].key == kd.derive(
                    tid, data
                )
        top = kernel._engine.plans["top"].key
        assert top is not None
        with pytest.raises(ArgumentError, match="key field 'b' is missing"):
            top({"a": 1})
    finally:
        kernel.close()


def _perturbed(rng: random.Random, args: dict[str, Any]) -> dict[str, Any]:
    """The arguments as given, or with one wrong: a near type, one missing, one more."""
    out = dict(args)
    match rng.randrange(8):
        case 0:
            out[rng.choice(list(out))] = rng.choice([1.0, "1", True, 0, None, [1], "\ud800"])
        case 1:
            del out[rng.choice(list(out))]
        case 2:
            out["extra"] = 1
        case 3:
            out["s"] = "x" * (1 << 20)  # over the size limit
    return out


def test_plain_arguments_record_what_validation_records(tmp_path: Path) -> None:
    # Engine.prepare's one pass for a tool whose arguments are all plain str, int and bool
    # (CallPlan.plain) and its key from the arguments' own text (CallPlan.key_of_text): the
    # same text, digest, key, tool arguments and refusals as encoding, pydantic's validation
    # and the key's derivation give; the dispatch holds every field.
    from dataclasses import fields

    from poimen.errors import PoimenError
    from poimen.store import NewDispatch

    kernel = Kernel(SqliteStore(tmp_path / "log.db"), notifiers=[])
    derivations = {
        "all": KeyDerivation.fields("s", "n", "b"),
        "some": KeyDerivation.fields("s"),
    }
    for tid, kd in derivations.items():

        @kernel.tool(id=tid, effects=Idempotent(key=kd), caps=Caps(), timeout=3)
        def t(ctx: ToolContext, s: str, n: int, b: bool = False) -> None:
            return None

    e = engine_of(kernel)
    assert e.plans["all"].plain is not None and e.plans["all"].key_of_text is not None
    assert e.plans["some"].plain is not None and e.plans["some"].key_of_text is None
    rng = random.Random(8)
    try:
        for i in range(400):
            text = "".join(chr(rng.randrange(32, 0x2FFF)) for _ in range(rng.randrange(6)))
            n = rng.randrange(-(10**30), 10**30)
            given = _perturbed(rng, {"s": text, "n": n, "b": rng.random() < 0.5})
            for tid, kd in derivations.items():
                tool = e.tools[tid]
                try:
                    recorded, kwargs = tool.validate(encode_args(given)[0])
                except PoimenError as exc:  # the same refusal, word for word
                    with pytest.raises(type(exc), match=re.escape(str(exc))):
                        e.prepare(tid, given, f"c{i}")
                    continue
                want = plain_canonical(recorded)
                _, d, got = e.prepare(tid, given, f"c{i}")
                assert d.args == want
                assert d.args_hash == hashlib.sha256(want.encode()).hexdigest()
                assert d.key == kd.derive(tid, recorded)
                assert d.key == plain_hash_key(tid, 1, {p: recorded[p] for p in kd.paths})
                assert got == kwargs and [type(v) for v in got.values()] == [
                    type(kwargs[k]) for k in got
                ]
                assert d == NewDispatch(**{f.name: getattr(d, f.name) for f in fields(d)})
    finally:
        kernel.close()


def test_field_options_that_change_validation_or_recording_keep_pydantics_pass(
    tmp_path: Path,
) -> None:
    # A parameter declared with a pydantic Field option that changes what is accepted or what
    # is recorded (excluded from the record, another name to validate by) is not a plain one:
    # the call records what pydantic's pass records and refuses what it refuses.
    from pydantic import AliasChoices, Field

    from poimen.errors import PoimenError

    kernel = Kernel(SqliteStore(tmp_path / "log.db"), notifiers=[])
    options: dict[str, Any] = {
        "excluded": Field("d", exclude=True),
        "excluded_if": Field("d", exclude_if=lambda v: v == "y"),
        "validated_as": Field("d", validation_alias="B"),
        "validated_as_any": Field("d", validation_alias=AliasChoices("B", "bee")),
        "serialized_as": Field("d", serialization_alias="B"),
        "described": Field("d", description="schema only"),
    }
    for tid, default in options.items():

        @kernel.tool(id=tid, effects=Idempotent(key=KeyDerivation.fields("a", "b")), caps=Caps(),
                     timeout=3)
        def t(ctx: ToolContext, a: str, b: str = default) -> None:
            return None

    e = engine_of(kernel)
    assert e.plans["described"].plain is not None  # schema-only options keep the one pass
    try:
        for i, given in enumerate([{"a": "x", "b": "y"}, {"a": "x", "B": "y"}, {"a": "x"}]):
            for tid in options:
                tool = e.tools[tid]
                try:
                    recorded, kwargs = tool.validate(encode_args(given)[0])
                    want = plain_canonical(recorded)
                    key = KeyDerivation.fields("a", "b").derive(tid, recorded)
                except PoimenError as exc:
                    with pytest.raises(type(exc), match=re.escape(str(exc))):
                        e.prepare(tid, given, f"c{i}")
                    continue
                _, d, got = e.prepare(tid, given, f"c{i}")
                assert (d.args, d.key, got) == (want, key, kwargs), (tid, given)
    finally:
        kernel.close()
