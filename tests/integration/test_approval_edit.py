"""Approve with edit and four eyes (docs/approvals.md), on both backends: the edited call is a
new intent bound to the edited arguments, the original is failed with a link to it, both
audited with the approver; a four-eyes call runs only after two distinct operators approved.
Effects are counted by the witness provider."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from poimen import Caps, Completed, Failed, IntentState, Kernel, Pending, ToolContext, Unsafe
from poimen.errors import NotAwaitingApprovalError, ReservedCallIdError, SameApproverError
from poimen.testing import ProviderClient, ProviderProcess

S = IntentState
GATED, FOUR = "mail.gated", "mail.four_eyes"


@pytest.fixture
def kernel(store_url: str, provider: ProviderProcess) -> Iterator[Kernel]:
    k = Kernel(store_url, notifiers=[])
    client = httpx.Client(base_url=provider.url, timeout=5)
    k.on_close(client.close)

    def post(ctx: ToolContext, to: str) -> Any:
        return client.post("/plain", json={"to": to, "call_id": ctx.call_id}).json()

    k.tool(id=GATED, effects=Unsafe(), caps=Caps(), timeout=5, requires_approval=True)(post)
    k.tool(id=FOUR, effects=Unsafe(), caps=Caps(), timeout=5, requires_approval=True,
           approvers=2)(post)
    try:
        yield k
    finally:
        k.close()


def detail(event: Any) -> Any:
    return json.loads(event.detail or "{}")


def sent_to(ledger: ProviderClient, to: str) -> int:
    return sum(1 for e in ledger.entries(kind="plain") if e["body"].get("to") == to)


def test_an_edited_approval_runs_the_edited_call_once_and_fails_the_original(
    kernel: Kernel, ledger: ProviderClient
) -> None:
    first = kernel.call(GATED, {"to": "bob"}, call_id="g/1", scope="g")
    edited = kernel.approve(first.intent_id, operator="ann", reason="bob left; eve instead",
                            args={"to": "eve"})
    assert edited.id != first.intent_id and edited.call_id == "edit/g/1"
    assert edited.state == S.DISPATCHED and edited.args == '{"to":"eve"}'
    original = kernel.store.get_intent(first.intent_id)
    assert original is not None and original.state == S.FAILED and original.reason == "edited"
    [link] = [e for e in kernel.store.events(first.intent_id) if e.kind == "edited"]
    assert link.actor == "ann" and detail(link)["edited_as"] == edited.id
    assert detail(link)["call_id"] == "edit/g/1"
    [approved] = [e for e in kernel.store.events(edited.id) if e.kind == "approved"]
    assert approved.actor == "ann" and detail(approved)["edit_of"] == first.intent_id
    # The caller of the original call id resumes with the edited call's outcome.
    done = kernel.wait_sync("g/1", timeout=30)
    assert isinstance(done, Completed) and done.intent_id == edited.id
    assert kernel.call(GATED, {"to": "bob"}, call_id="g/1", scope="g") == Failed(
        first.intent_id, original.error or "")
    assert kernel.outcome("g/1") == done and kernel.wait_sync("g/1", timeout=5) == done
    assert sent_to(ledger, "eve") == 1 and sent_to(ledger, "bob") == 0
    # Decided: a second decision on either is refused.
    with pytest.raises(NotAwaitingApprovalError):
        kernel.approve(first.intent_id, operator="bob", reason="again", args={"to": "joe"})
    assert sent_to(ledger, "joe") == 0


def test_a_four_eyes_call_runs_only_after_two_distinct_operators_approved(
    kernel: Kernel, ledger: ProviderClient
) -> None:
    first = kernel.call(FOUR, {"to": "bob"}, call_id="f/1")
    it = kernel.approve(first.intent_id, operator="ann", reason="fine")
    assert it.state == S.AWAITING_APPROVAL
    assert kernel.wait_sync("f/1", timeout=0.2) == Pending(first.intent_id, "awaiting_approval")
    with pytest.raises(SameApproverError):
        kernel.approve(first.intent_id, operator="ann", reason="fine, really")
    assert kernel.store.get_intent(first.intent_id).state == S.AWAITING_APPROVAL  # type: ignore[union-attr]
    assert sent_to(ledger, "bob") == 0
    it = kernel.approve(first.intent_id, operator="bea", reason="checked too")
    assert it.state == S.DISPATCHED
    assert isinstance(kernel.wait_sync("f/1", timeout=30), Completed)
    assert sent_to(ledger, "bob") == 1
    [approved] = [e for e in kernel.store.events(first.intent_id) if e.kind == "approved"]
    assert detail(approved)["approved_by"] == ["ann", "bea"]


def test_one_rejection_of_a_four_eyes_call_fails_it(kernel: Kernel, ledger: ProviderClient) -> None:
    first = kernel.call(FOUR, {"to": "bob"}, call_id="f/2")
    kernel.approve(first.intent_id, operator="ann", reason="fine")
    it = kernel.reject(first.intent_id, operator="bea", reason="not this one")
    assert it.state == S.FAILED and isinstance(kernel.wait_sync("f/2", timeout=5), Failed)
    assert sent_to(ledger, "bob") == 0


def test_an_edit_of_a_four_eyes_call_counts_the_editor_and_needs_another(
    kernel: Kernel, ledger: ProviderClient
) -> None:
    first = kernel.call(FOUR, {"to": "bob"}, call_id="f/3")
    edited = kernel.approve(first.intent_id, operator="ann", reason="eve", args={"to": "eve"})
    assert edited.state == S.AWAITING_APPROVAL and edited.call_id == "edit/f/3"
    with pytest.raises(SameApproverError):
        kernel.approve(edited.id, operator="ann", reason="mine")
    assert kernel.wait_sync("f/3", timeout=0.2) == Pending(edited.id, "awaiting_approval")
    kernel.approve(edited.id, operator="bea", reason="ok")
    done = kernel.wait_sync("f/3", timeout=30)
    assert isinstance(done, Completed) and done.intent_id == edited.id
    assert sent_to(ledger, "eve") == 1 and sent_to(ledger, "bob") == 0


def test_edited_call_ids_are_poimens(kernel: Kernel) -> None:
    with pytest.raises(ReservedCallIdError):
        kernel.call(GATED, {"to": "bob"}, call_id="edit/mine")
    assert kernel.outcome("edit/mine") is None
