"""What clients and models do between runs of a poimen MCP server (issue 22), with the server
a real stdio child process SIGKILLed and the provider's ledger as the witness: a call approved
by elicitation whose server died after the approval or after the email went out, called again
with the client's saved call id; a client asking again (a new call id) after Pending; a model
re-prompted after a restart. One effect each, never a second."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
from mcp import Client, types
from mcp.shared.exceptions import MCPError

from poimen import Completed, Kernel
from poimen.integrations.mcp import CALL_ID_META, INTENT_META, OUTCOME_META, RETRY_CALL_ID_META
from poimen.testing import ProviderClient, ProviderProcess
from tests.integrations.conftest import KILL_TIMEOUT
from tests.integrations.test_mcp import meta, stdio_params, wait_for_pause

BOB = {"to": "bob@example.com", "subject": "hello"}
SHIP = {"order_id": "o-1", "address": "x"}
Body = Callable[[Client], Awaitable[Any]]


class Server:
    """The MCP server's database, started as a stdio child process for each client session."""

    def __init__(self, tmp_path: Path, provider: ProviderProcess, *options: str) -> None:
        self.db = f"sqlite:///{tmp_path / 'server.db'}"
        self.tmp_path = tmp_path
        self.provider = provider
        self.options = ["--scope", "conv-5", *options]
        self.asked: list[str] = []

    async def _elicit(self, context: Any, params: Any) -> types.ElicitResult:
        self.asked.append(params.message)
        return types.ElicitResult(action="accept", content={
            "decision": "approve", "operator": "ann", "reason": "checked"})

    def session(self, body: Body, *options: str) -> Any:
        async def go() -> Any:
            params = stdio_params(self.db, self.provider.url, {}, *self.options, *options)
            async with Client(params, elicitation_callback=self._elicit) as c:
                return await body(c)

        return asyncio.run(go())

    def killed_at(self, point: str, tool: str, args: dict[str, Any], call_id: str) -> None:
        """A session whose server is SIGKILLed at `point` of the call."""
        marker = self.tmp_path / f"paused-{point}"

        async def go() -> None:
            env = {"POIMEN_PAUSE_AT": point, "POIMEN_PAUSE_FILE": str(marker)}
            params = stdio_params(self.db, self.provider.url, env, *self.options)
            async with Client(params, elicitation_callback=self._elicit) as c:
                call = asyncio.ensure_future(c.call_tool(tool, args, meta={CALL_ID_META: call_id}))
                os.kill(await asyncio.to_thread(wait_for_pause, marker, 120), signal.SIGKILL)
                with pytest.raises(MCPError, match="Connection closed"):
                    await call

        asyncio.run(go())


def call(tool: str, args: dict[str, Any], call_id: str) -> Body:
    return lambda c: c.call_tool(tool, args, meta={CALL_ID_META: call_id})


@KILL_TIMEOUT
@pytest.mark.parametrize("kill_at", ["after_approval", "after_effect"])
def test_a_server_killed_after_an_approval_answers_the_call_again_without_a_second_email(
    kill_at: str, tmp_path: Path, provider: ProviderProcess, ledger: ProviderClient
) -> None:
    server = Server(tmp_path, provider)
    server.killed_at(kill_at, "mail_gated", BOB, "call-1")
    assert len(server.asked) == 1
    assert ledger.count(kind="plain") == (1 if kill_at == "after_effect" else 0)
    # The client calls again with the call id it saved before the approval: the decision is
    # in the log, so nobody is asked again, and the call is not made twice.
    again = server.session(call("mail_gated", BOB, "call-1"))
    assert len(server.asked) == 1 and ledger.count(kind="plain") == 1
    expected = "indeterminate" if kill_at == "after_effect" else "completed"
    assert meta(again)[OUTCOME_META] == expected


@KILL_TIMEOUT
def test_a_client_asking_again_after_pending_under_a_new_call_id_is_the_same_call(
    tmp_path: Path, provider: ProviderProcess, ledger: ProviderClient
) -> None:
    server = Server(tmp_path, provider, "--pending-wait", "0", "--wait-bound", "0.1")
    server.killed_at("mid_call", "test_ship", SHIP, "call-1")
    assert ledger.count() == 0
    ledger.set_lookup_mode("error")  # Pending however long the restart takes to start

    async def twice(c: Client) -> tuple[types.CallToolResult, types.CallToolResult]:
        first = await c.call_tool("test_ship", SHIP, meta={CALL_ID_META: "call-1"})
        # The model, told "still in progress", asks again: its client sends a new call id.
        return first, await c.call_tool("test_ship", SHIP, meta={CALL_ID_META: "call-2"})

    first, again = server.session(twice)
    for r in (first, again):
        assert r.is_error and meta(r)[OUTCOME_META] == "pending"
    assert meta(first)[RETRY_CALL_ID_META] == "call-1"
    assert meta(again)[INTENT_META] == meta(first)[INTENT_META]
    ledger.set_lookup_mode("truthful")
    with Kernel(server.db, notifiers=[], worker_id="later") as k:
        from poimen.testing import register_test_tools

        register_test_tools(k, provider.url)
        assert isinstance(k.wait_sync("conv-5/call-1", timeout=120), Completed)
    done = server.session(call("test_ship", SHIP, "call-2"))
    assert meta(done)[OUTCOME_META] == "completed" and ledger.count() == 1


@KILL_TIMEOUT
def test_a_restart_that_re_prompts_the_model_sends_one_email(
    tmp_path: Path, provider: ProviderProcess, ledger: ProviderClient
) -> None:
    server = Server(tmp_path, provider)
    server.killed_at("after_effect", "test_email", BOB, "call-1")
    assert ledger.count(kind="plain") == 1
    # The agent restarts and asks its model again, which mints a new tool-call id: the same
    # email, unsettled in the conversation's scope, is answered, not sent again.
    again = server.session(call("test_email", BOB, "call-2"))
    assert meta(again)[OUTCOME_META] == "indeterminate" and not again.is_error
    assert ledger.count(kind="plain") == 1


@KILL_TIMEOUT
def test_a_client_asking_again_under_a_new_call_id_after_recovery_settled_the_call_ships_once(
    tmp_path: Path, provider: ProviderProcess, ledger: ProviderClient
) -> None:
    server = Server(tmp_path, provider)
    server.killed_at("mid_call", "test_ship", SHIP, "call-1")
    assert ledger.count() == 0

    async def settled_then_asked_again(c: Client) -> types.CallToolResult:
        # The restarted server's recovery lands the shipment; its client, cut off, never got
        # the answer. Re-prompting its model, it asks again under a new call id.
        await asyncio.to_thread(settled, server.db, "conv-5/call-1")
        return await c.call_tool("test_ship", SHIP, meta={CALL_ID_META: "call-2"})

    again = server.session(settled_then_asked_again)
    assert meta(again)[OUTCOME_META] == "completed" and not again.is_error
    assert ledger.count() == 1
    with Kernel(server.db, notifiers=[], worker_id="reader") as k:
        first = k.store.get_by_call_id("conv-5/call-1")
        assert first is not None and meta(again)[INTENT_META] == first.id


def settled(db: str, call_id: str) -> None:
    """Until the call is settled, read by intent (`outcome` would give its answer away)."""
    with Kernel(db, notifiers=[], worker_id="reader") as k:
        end = time.monotonic() + 120
        while (it := k.store.get_by_call_id(call_id)) is None or it.state != "COMPLETED":
            assert time.monotonic() < end, it
            time.sleep(0.05)
