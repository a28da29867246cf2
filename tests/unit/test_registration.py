"""Registration: no default effect class, only the three classes, no time-like key fields."""

from __future__ import annotations

import datetime as dt
import hashlib
import random
import time
from pathlib import Path
from typing import Any

import pydantic
import pytest

from poimen import (
    Caps,
    Idempotent,
    Kernel,
    KeyDerivation,
    NotLanded,
    Queryable,
    ReadOnly,
    ToolContext,
    ToolRegistration,
    Unsafe,
)
from poimen.errors import NondeterministicKeyError, RegistrationError


@pytest.fixture
def kernel(tmp_path: Path) -> Any:
    k = Kernel(f"sqlite:///{tmp_path / 'k.db'}")
    yield k
    k.close()


class Slot(pydantic.BaseModel):
    room: str
    day: dt.date


def noop(ctx: ToolContext, order_id: str, amount_cents: int) -> None:
    return None


def test_effect_classes_require_what_recovery_needs() -> None:
    with pytest.raises(TypeError, match="key"):
        Idempotent()  # type: ignore[call-arg]
    with pytest.raises(TypeError, match="lookup"):
        Queryable()  # type: ignore[call-arg]
    with pytest.raises(TypeError, match="effects"):
        ToolRegistration(id="t", caps=Caps(), timeout=1)  # type: ignore[call-arg]


@pytest.mark.parametrize("bad", [None, "idempotent", Idempotent, object(), 3])
def test_a_non_class_value_is_refused(kernel: Kernel, bad: object) -> None:
    with pytest.raises(RegistrationError, match="effects must be"):
        kernel.tool(id="t", effects=bad, caps=Caps(), timeout=1)(noop)  # type: ignore[arg-type]
    assert kernel.registered() == {}


def test_the_same_id_twice_is_refused(kernel: Kernel) -> None:
    kernel.tool(id="t", effects=Unsafe(), caps=Caps(), timeout=1)(noop)
    with pytest.raises(RegistrationError, match="already registered"):
        kernel.tool(id="t", effects=Unsafe(), caps=Caps(), timeout=1)(noop)


def test_an_id_that_is_another_tools_model_facing_name_is_refused(kernel: Kernel) -> None:
    kernel.tool(id="billing.refund", effects=Unsafe(), caps=Caps(), timeout=1)(noop)
    assert kernel.spec("billing.refund").name == "billing_refund"
    with pytest.raises(RegistrationError, match=r"'billing_refund'.*'billing\.refund'"):
        kernel.tool(id="billing_refund", effects=ReadOnly(), caps=Caps(), timeout=1)(noop)
    assert set(kernel.registered()) == {"billing.refund"}
    assert kernel.tool_id("billing_refund") == "billing.refund"  # its name, one tool


def test_a_model_facing_name_never_takes_another_tools_id(kernel: Kernel) -> None:
    # The id the name of "billing.refund" would get once "billing_refund" is taken.
    taken = f"billing_refund_{hashlib.sha256(b'billing.refund').hexdigest()[:8]}"
    for tool_id in (taken, "billing_refund", "billing.refund"):
        kernel.tool(id=tool_id, effects=ReadOnly(), caps=Caps(), timeout=1)(noop)
    names = {s.name: s.id for s in kernel.specs()}
    assert len(names) == 3  # three tools, three names
    for tool_id in kernel.registered():  # an id resolves to itself, a name to its own tool
        assert kernel.tool_id(tool_id) == tool_id
        assert kernel.tool_id(kernel.spec(tool_id).name) == tool_id
        assert kernel.spec(tool_id).id == tool_id
    assert names[taken] == taken and names["billing_refund"] == "billing_refund"


@pytest.mark.parametrize("timeout", [0, -1, float("nan"), float("inf"), True])
def test_timeout_must_be_a_positive_number(timeout: float) -> None:
    with pytest.raises(RegistrationError, match="timeout"):
        ToolRegistration(id="t", effects=Unsafe(), caps=Caps(), timeout=timeout)


def test_a_tool_must_take_the_context_first(kernel: Kernel) -> None:
    def bare() -> None: ...

    with pytest.raises(RegistrationError, match="ToolContext"):
        kernel.tool(id="t", effects=Unsafe(), caps=Caps(), timeout=1)(bare)


def test_variadic_parameters_are_refused(kernel: Kernel) -> None:
    def star(ctx: ToolContext, **kw: Any) -> None: ...

    with pytest.raises(RegistrationError, match="'kw' is variadic"):
        kernel.tool(id="t", effects=Unsafe(), caps=Caps(), timeout=1)(star)


def test_a_time_like_key_field_is_refused(kernel: Kernel) -> None:
    def book(ctx: ToolContext, room: str, at: dt.datetime) -> None: ...

    with pytest.raises(RegistrationError, match="'at' is time-like") as err:
        kernel.tool(id="book", effects=Idempotent(key=KeyDerivation.fields("room", "at")),
                    caps=Caps(), timeout=1)(book)
    assert err.value.field == "at"
    assert "book" not in kernel.registered()


def test_optional_and_nested_time_fields_are_refused(kernel: Kernel) -> None:
    def book(ctx: ToolContext, slot: Slot, until: dt.time | None = None) -> None: ...

    with pytest.raises(RegistrationError, match=r"'slot\.day'"):
        kernel.tool(id="a", effects=Idempotent(key=KeyDerivation.fields("slot.day")),
                    caps=Caps(), timeout=1)(book)
    with pytest.raises(RegistrationError, match="'until'"):
        kernel.tool(id="b", effects=Idempotent(key=KeyDerivation.fields("until")),
                    caps=Caps(), timeout=1)(book)
    kernel.tool(id="c", effects=Idempotent(key=KeyDerivation.fields("slot.room")),
                caps=Caps(), timeout=1)(book)
    assert "c" in kernel.registered()


def test_all_args_refuses_a_time_parameter_unless_excluded(kernel: Kernel) -> None:
    def book(ctx: ToolContext, room: str, at: dt.datetime) -> None: ...

    with pytest.raises(RegistrationError, match=r"exclude=\('at',\)"):
        kernel.tool(id="x", effects=Idempotent(key=KeyDerivation.all_args()), caps=Caps(),
                    timeout=1)(book)
    kernel.tool(id="y", effects=Idempotent(key=KeyDerivation.all_args(exclude=("at",))),
                caps=Caps(), timeout=1)(book)
    assert "y" in kernel.registered()


def test_key_fields_must_name_parameters(kernel: Kernel) -> None:
    with pytest.raises(RegistrationError, match="'orderid' is not a parameter"):
        kernel.tool(id="t", effects=Idempotent(key=KeyDerivation.fields("orderid")),
                    caps=Caps(), timeout=1)(noop)


def test_custom_derivations_reading_clocks_or_randomness_are_refused() -> None:
    with pytest.raises(NondeterministicKeyError, match="time"):
        KeyDerivation.custom(lambda a: (a["x"], time.time()))
    with pytest.raises(NondeterministicKeyError, match="random"):
        KeyDerivation.custom(lambda a: (a["x"], random.random()))
    pure = KeyDerivation.custom(lambda a: a["order_id"])
    assert pure.derive("t", {"order_id": "o"}) == pure.derive("t", {"order_id": "o"})


def test_a_clock_read_in_a_nested_function_or_comprehension_is_refused_too() -> None:
    def nested(a: Any) -> Any:
        def stamp() -> float:
            return time.monotonic()

        return (a["x"], stamp())

    with pytest.raises(NondeterministicKeyError, match="monotonic"):
        KeyDerivation.custom(nested)
    with pytest.raises(NondeterministicKeyError, match="random"):
        KeyDerivation.custom(lambda a: [random.random() for _ in a])


def test_queryable_lookup_must_be_callable() -> None:
    with pytest.raises(RegistrationError, match="callable"):
        ToolRegistration(id="q", effects=Queryable(lookup="nope"), caps=Caps(),  # type: ignore[arg-type]
                         timeout=1)
    ToolRegistration(id="q", effects=Queryable(lookup=lambda rid: NotLanded()), caps=Caps(),
                     timeout=1)


@pytest.mark.parametrize("name", ["_private", "model_config", "json", "schema"])
def test_parameter_names_the_schema_reserves_are_refused(kernel: Kernel, name: str) -> None:
    ns: dict[str, Any] = {"ToolContext": ToolContext}
    exec(f"def tool(ctx: ToolContext, {name}: int) -> None: ...", ns)
    with pytest.raises(RegistrationError, match=f"parameter {name!r} cannot be an argument"):
        kernel.tool(id="t", effects=Unsafe(), caps=Caps(), timeout=1)(ns["tool"])
    assert kernel.registered() == {}
