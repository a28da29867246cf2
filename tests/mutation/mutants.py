"""The mutants: each the smallest change that breaks one safety rule of docs/design.md, and the
tests that must notice it. Versioned with the code: a mutant whose text no longer occurs
fails the run as NOT APPLIED, so the catalogue cannot silently rot."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Mutant:
    id: str
    rule: str
    file: str  # under src/, or verification/... (the soak and the model check)
    find: str
    replace: str
    tests: tuple[str, ...]

    @property
    def path(self) -> str:
        """The file under the repository root."""
        return self.file if self.file.startswith("verification/") else f"src/{self.file}"


DECIDE = "poimen/_core/decide.py"
PROTOCOL = "poimen/_engine/protocol.py"
RUNNERS = "poimen/_engine/runners.py"
CAP = "poimen/_capability/context.py"
HANDLES = "poimen/_capability/handles.py"
GUARD = "poimen/_capability/guard.py"
SQL = "poimen/store/_statements.py"
STORE = "poimen/store/_sql.py"
PG = "poimen/store/postgres.py"
UNDO = "poimen/_undo.py"
ENGINE = "poimen/_engine/engine.py"
FLAT = "poimen/_engine/flat.py"
BACKOFF = "poimen/_core/backoff.py"
AUDIT = "poimen/_core/audit.py"
AUDIT_OP = "poimen/operator/_audit.py"
RETENTION = "poimen/store/_retention.py"
TX = "poimen/_engine/transactional.py"
TX_TOOL = "poimen/_capability/tx.py"
OTEL = "poimen/otel.py"
MODEL = "verification/model/_system.py"
SOAK_CHECK = "verification/soak_check.py"
T_DECIDE = ("tests/unit/test_decide.py",)
T_AUDIT = ("tests/integration/test_audit_chain.py",)
T_LIFE = ("tests/integration/test_lifecycle.py", "-k", "sqlite or not postgres")
T_CAP = ("tests/integration/test_keyed_capability.py", "-k", "sqlite or not postgres")
T_BAD = ("tests/integration/test_bad_input.py", "-k", "sqlite or not postgres")
T_STORE = ("tests/contract/test_store_machine.py", "tests/contract/test_store_contract.py",
           "-k", "sqlite")
T_GATE = ("tests/integration/test_send_gate.py",)
T_UNSETTLED = ("tests/integration/test_unsettled_calls.py", "-k", "sqlite or not postgres")
T_OWED = ("tests/integration/test_unsettled_calls.py", "-k",
          "sqlite and (recovery_settled or given_once or operator_decided)")
T_FENCED = ("tests/integration/test_flat_path.py", "-k", "refused_on_its_fence")
T_FLAT_RAISED = ("tests/integration/test_flat_path.py", "-k", "interrupt_after or log_closed")
T_AFENCED = ("tests/integration/test_flat_path.py", "-k", "acall_whose")
T_GROUP = ("tests/unit/test_group_commit.py",)
T_ACANCEL = ("tests/integration/test_lifecycle.py", "-k", "each_await")
T_LATE = ("tests/integration/test_unsettled_calls.py", "-k", "sqlite and settled_its_call")
T_TX = ("tests/integration/test_transactional.py",)
T_HOT = ("tests/unit/test_hot_path_equivalence.py",)
T_TX_CRASH = ("tests/crash/test_transactional_crash.py", "-k", "sqlite")
# The crash tests of the provider-backed classes (Transactional's have mutants of their own).
T_RECOVERY = ("tests/integration/test_effect_recovery.py", "tests/crash/test_crash_points.py",
              "tests/crash/test_undo_crash.py", "-k",
              "sqlite or not postgres")

MUTANTS: list[Mutant] = [
    # The decision rules.
    Mutant("unsafe-retried", "Unsafe is never retried", DECIDE,
           'return MarkIndeterminate("unsafe_unknown_outcome")', "return RetryDecision()",
           T_DECIDE + T_RECOVERY[:-2]),
    Mutant("queryable-no-lookup", "a Queryable retry only after asking the provider", DECIDE,
           '                case Unasked():\n                    return Ask("lookup")',
           "                case Unasked():\n                    return RetryDecision()", T_DECIDE),
    Mutant("queryable-before-deadline", "not landed is trusted only after the deadline", DECIDE,
           "if intent.deadline_at is not None and now < intent.deadline_at:", "if False:",
           T_DECIDE),
    Mutant("key-drift-ignored", "a changed key derivation is never retried", DECIDE,
           "if key != intent.key:", "if False:", T_DECIDE),
    Mutant("effect-changed-ignored", "the recorded class decides", DECIDE,
           "if effect_name(current) != intent.effect:", "if False:", T_DECIDE),
    Mutant("key-window-ignored", "no retry past the provider's key window", DECIDE,
           "if key_window_passed(ttl, intent.created_at, now + intent.timeout_s):", "if False:",
           T_DECIDE),
    Mutant("attempts-unbounded", "retries stop at the attempt bound", DECIDE,
           "                    if intent.attempts >= policy.max_attempts:\n"
           '                        return MarkIndeterminate("retries_exhausted")\n'
           "                    return RetryDecision()\n        case Queryable():",
           "                    return RetryDecision()\n        case Queryable():", T_DECIDE),
    Mutant("lookup-limit-ignored", "Unknown lookups stop at their limit", DECIDE,
           "if n >= policy.lookup_limit:", "if n >= policy.lookup_limit + 10**6:", T_DECIDE),
    Mutant("lease-ignored", "a live owner's call is never taken over", DECIDE,
           "if intent.lease_expires_at is not None and intent.lease_expires_at <= now:",
           "if intent.lease_expires_at is not None:", T_DECIDE),
    Mutant("held-ignored", "a kernel never takes over a call it drives", DECIDE,
           '    if held:\n        return "held"\n', "", (*T_DECIDE, "tests/integration/test_in_process_races.py")),
    Mutant("pid-judged-elsewhere", "a pid means something only on its own host", DECIDE,
           "if o.host == me.host and not alive(o):", "if not alive(o):", T_DECIDE),
    # The protocol.
    Mutant("no-takeover-deadline", "a dead owner's request may land until a timeout later",
           PROTOCOL, "if later is not None and t.registration.effects.has_deadline:",
           "if False:", T_LIFE),
    Mutant("no-deadline-restamp", "a slow commit does not eat the deadline", PROTOCOL,
           "    if not t.registration.effects.has_deadline:\n        return intent\n"
           "    for _ in range(3):",
           "    if True:\n        return intent\n    for _ in range(3):", T_LIFE),
    Mutant("no-unknown-deadline", "an unknown outcome moves the deadline past its end",
           PROTOCOL, "            intent = dataclasses.replace(intent, deadline_at=deadline)\n",
           "            deadline = None\n", T_LIFE),
    # The flat path hands every other end of its run to the protocol.
    Mutant("flat-unknown-completed", "the flat path settles only a definite outcome; an "
           "unknown one goes on in the protocol", FLAT,
           'if run.kind == "completed" or (', 'if run.kind in ("completed", "unknown") or (',
           ("tests/integration/test_call_path.py", "-k", "sqlite or not postgres")),
    Mutant("flat-fenced-settled", "the flat path's outcome commit refused on its fence answers "
           "what the log says", FLAT,
           'out = w.settled(e, intent) if ok else run_sync(e, fenced_out(e, intent, "outcome"))',
           "out = w.settled(e, intent)", T_FENCED),
    # Issue 25: `acall` of an async tool takes the flat path too (`flat_acall`), each await a
    # step of `run_async`: a cancelled caller is treated as the protocol treats it.
    Mutant("aflat-unknown-completed", "the async flat path settles only a definite outcome; an "
           "unknown one goes on in the protocol", FLAT,
           '        run.kind == "completed"\n        or (run.kind == "failed"',
           '        run.kind in ("completed", "unknown")\n        or (run.kind == "failed"',
           ("tests/integration/test_flat_path.py", "-k", "async_flat")),
    Mutant("aflat-fenced-settled", "the async flat path's outcome commit refused on its fence "
           "answers what the log says", FLAT,
           '        out = await drive_async(e, fenced_out(e, intent, "outcome"), c)',
           "        out = w.settled(e, intent)", T_AFENCED),
    Mutant("aflat-cancel-untold", "a cancelled acall raises CancelledError once its steps are "
           "done, on the async flat path", FLAT,
           "    if c.cancelled:  # told once the call's steps are done",
           "    if False:  # told once the call's steps are done", T_ACANCEL),
    Mutant("aflat-untried-run", "a call cancelled during its dispatch commit never runs its "
           "tool, on the async flat path", FLAT,
           "        return await drive_async(e, untried(e, intent), c)\n", "        pass\n",
           T_ACANCEL),
    Mutant("aflat-hold-kept", "an acall that ends, cancelled or not, holds its intent no more",
           FLAT, "        e.holds.drop(d.intent_id)  # an async tool", "        pass  #",
           T_ACANCEL),
    Mutant("tx-interrupt-kept-open", "an interrupt out of a sync Transactional tool rolls its "
           "transaction back at once", RUNNERS, '            tx._abort("the call was interrupted")',
           "            pass", ("tests/integration/test_transactional.py", "-k", "interrupt_out")),
    Mutant("flat-hold-kept", "a call that ends, raised or not, holds its intent no more (its "
           "lease runs out)", FLAT, "        e.holds.drop(d.intent_id)\n", "        pass\n",
           T_FLAT_RAISED),
    Mutant("protocol-hold-kept", "a call that ends, raised or not, holds its intent no more "
           "(its lease runs out)", PROTOCOL, "        e.holds.drop(d.intent_id)\n",
           "        pass\n", T_FLAT_RAISED),
    Mutant("flat-late-untaken", "a caller seized after its lease ran out takes its answer, on "
           "the flat path", FLAT, "        return given(store, out) if late(d, c) else out",
           "        return out", T_LATE),
    Mutant("aflat-late-untaken", "a caller seized after its lease ran out takes its answer, on "
           "the async flat path", FLAT,
           "    if late(d, c):\n        out = await block_async(e, Block(given, (store, out)), c)",
           "    if False:\n        out = await block_async(e, Block(given, (store, out)), c)",
           T_LATE),
    Mutant("protocol-late-untaken", "a caller seized after its lease ran out takes its answer, "
           "on the generator protocol", PROTOCOL,
           "        return (yield from taken(e, out, late(d, c)))", "        return out", T_LATE),
    Mutant("protocol-fenced-settled", "an outcome commit refused on its fence answers what the "
           "log says", PROTOCOL, '    return (yield from fenced_out(e, intent, "outcome"))',
           "    return w.settled(e, intent)", T_FENCED),
    Mutant("cancel-releases-hold", "a cancelled caller leaves its tool held until it returns",
           RUNNERS, "                    _continue_in_thread(e, gen, cf)",
           "                    gen.close()", T_LIFE),
    # Issue 25: an async caller awaits its SQLite commit's answer without asyncio.shield, the
    # answer refusing to be cancelled.
    Mutant("cancel-drops-commit", "a cancelled async caller waits for its commit in flight",
           "poimen/store/_base.py", "    def cancel(self, msg: Any = None) -> bool:\n        return False",
           "    def cancel(self, msg: Any = None) -> bool:\n        return super().cancel(msg)",
           T_LIFE),
    # Issue 25: a caller that finds nobody leading commits its own write at once, no batch.
    Mutant("lone-commit-beside-leader", "a lone caller commits at once only when nobody leads",
           "poimen/store/_group_commit.py", "lone = self._holder is None and not self._queue",
           "lone = not self._queue", T_GROUP),
    Mutant("lone-commit-drops-error", "a lone caller's failed write is rolled back and its "
           "error raised, as a batch's", "poimen/store/_group_commit.py",
           "                        error = exc\n                    if error is None:",
           "                        pass\n                    if error is None:", T_GROUP),
    # ctx.http raises NotSent only if nothing went out, but a tool may raise NotSent itself:
    # the rule lives in the classification of the tool's exception, which checks both.
    Mutant("not-sent-after-write", "a request that never left is FAILED only if nothing went "
           "out", RUNNERS,
           "if any(isinstance(x, NotSent) for x in chain) and writes == 0:",
           "if any(isinstance(x, NotSent) for x in chain):", T_LIFE),
    # Issue 20, defect 1: an exception the tool caught (its __context__) says nothing of what
    # it did next; only what it raised, and its explicit causes, count.
    Mutant("outcome-from-context", "never sent / refused is read from the exception the tool "
           "raised, not one it caught", RUNNERS,
           "        seen = seen.__cause__\n",
           "        seen = seen.__cause__ or seen.__context__\n",
           (*T_GATE, "-k", "sqlite and (own_client or denial_the_tool)")),
    # Defect 2: a sink write is a write of the attempt, whatever the class.
    Mutant("sink-write-uncounted", "every handle write, sinks included, counts as a write of "
           "the attempt", HANDLES,
           'self._record.admit("sink", lambda: self._name, True, None)',
           'self._record.admit("sink", lambda: self._name, False, None)',
           (*T_GATE, "-k", "sqlite and (sink or nothing_sent)")),
    # The send gate (docs/design.md §6): each rule, and the end of an attempt it refused.
    Mutant("gate-key-window", "no second send under a key the provider may have forgotten",
           DECIDE, "        and key_window_passed(s.effect.key_ttl, s.key_from, s.now + s.within)",
           "        and False", (*T_GATE, *T_DECIDE, "-k", "sqlite or gate or refusal")),
    Mutant("gate-key-window-no-transit", "the key's age is judged when the request can arrive",
           DECIDE, "s.key_from, s.now + s.within)", "s.key_from, s.now)", T_DECIDE),
    Mutant("gate-key-window-ignores-writes", "a write of the attempt is a send under the key",
           DECIDE, "    earlier = s.attempt > 1 or s.writes > 0\n",
           "    earlier = s.attempt > 1\n", T_DECIDE),
    Mutant("gate-read-only", "a ReadOnly tool writes nothing", DECIDE,
           "    if isinstance(s.effect, ReadOnly):\n        return Refused(",
           "    if False:\n        return Refused(",
           ("tests/integration/test_public_api.py", "tests/integration/test_send_gate.py", "-k",
            "(read_only or nothing_sent) and sqlite")),
    Mutant("gate-sandbox", "a shadow or replay kernel lets no write leave", DECIDE,
           "    if not s.live:\n", "    if False:\n", T_DECIDE),
    Mutant("gate-not-dispatched", "only a dispatched (approved) call sends", DECIDE,
           "    if s.state != IntentState.DISPATCHED:\n", "    if False:\n", T_DECIDE),
    Mutant("gate-unsafe-reissue", "an Unsafe call's request never leaves twice", DECIDE,
           "    if isinstance(s.effect, Unsafe) and s.attempt > 1:\n", "    if False:\n",
           T_DECIDE),
    Mutant("gate-effect-changed", "a request leaves under the class recorded with the call",
           DECIDE, "    if effect_name(s.effect) != s.recorded:\n", "    if False:\n", T_DECIDE),
    Mutant("refusal-final-after-unknown", "a refused attempt is FAILED only if nothing of the "
           "call can have gone out", DECIDE,
           "    landed_before = attempt > 1 and not isinstance(effect, Queryable | ReadOnly | "
           "Transactional)\n",
           "    landed_before = False\n", (*T_DECIDE, *T_GATE, "-k", "gate or refusal or key")),
    Mutant("refusal-final-after-write", "a refused attempt is FAILED only if none of its "
           "writes went out", DECIDE, "    if writes == 0 and not landed_before:\n",
           "    if not landed_before:\n", T_DECIDE),
    # The gate reads the clock as the request leaves and counts the key's age from the call's
    # creation (an approved call's wait included), not from its attempt's start.
    Mutant("gate-clock-at-attempt", "the gate judges the key's age when the request leaves",
           CAP, "        now = issuer.store.now()\n        with self._lock:",
           "        now = it.updated_at\n        with self._lock:",
           (*T_GATE, "-k", "sqlite and key_window")),
    Mutant("key-age-from-attempt", "the key's age counts from the call's creation, its wait "
           "for approval included", CAP, "                    key_from=it.created_at,",
           "                    key_from=it.updated_at,", (*T_GATE, "-k", "sqlite and key_age")),
    Mutant("writes-uncounted", "every write let out counts as a write of the attempt", CAP,
           "                if write:\n                    self.writes += 1\n", "",
           (*T_GATE, "-k", "sqlite and (own_client or sink or denial_the_tool)")),
    Mutant("refusal-swallowed", "a refused send decides its attempt, whatever the tool does "
           "with the refusal", RUNNERS,
           "    refused = None if record is None else record.outcome()\n"
           "    if refused is not None:\n        return _after_refusal(refused)\n"
           '    return Run("completed", value=value)',
           '    return Run("completed", value=value)',
           (*T_GATE, "-k", "sqlite and swallow")),
    Mutant("key-from-raw-args", "the key is derived from the recorded arguments", ENGINE,
           "            key = p.key(recorded)\n",
           "            key = p.key(dict(args))\n",
           ("tests/integration/test_public_api.py", "-k", "recorded_arguments and sqlite")),
    # Tool ids and model-facing names never name two different tools.
    Mutant("id-is-a-name", "a tool id is never another tool's model-facing name", ENGINE,
           "        if registration.id in names:", "        if False:",
           ("tests/unit/test_registration.py", "-k", "model_facing")),
    Mutant("name-is-an-id", "a model-facing name is never another tool's id or name",
           "poimen/_core/spec.py", "        if name not in taken:\n            return name\n",
           "        return name\n",
           ("tests/unit/test_registration.py", "tests/integrations/test_mcp.py", "-k",
            "model_facing or filter_by_id")),
    # Integrations: a Pending call ends in the framework's own deferral.
    Mutant("agents-sdk-pending-told", "a call still Pending stops an Agents SDK run with an "
           "interruption", "poimen/integrations/openai_agents.py",
           "        return await _still_pending(kernel, d, params, pending_wait)",
           "        return False",
           ("tests/integrations/test_openai_agents.py", "tests/integrations/test_agent_restarts.py",
            "-k", "still_pending or agents_sdk_restart")),
    Mutant("hold-taken-twice", "a kernel never holds one intent twice", "poimen/_engine/steps.py",
           "            if intent_id in self._ids:\n                return False\n", "",
           ("tests/integration/test_in_process_races.py", "-k", "run_it_once and sqlite")),
    # Identity and background duties.
    Mutant("fork-keeps-identity", "a forked child is a new owner", "poimen/_runtime.py",
           "        owner = current_owner(f", "        owner = self.owner or current_owner(f",
           T_LIFE),
    Mutant("duplicate-worker", "one identity per live kernel", "poimen/_engine/workers.py",
           "if other is not None and other is not k and not other.closed:", "if False:",
           T_LIFE),
    Mutant("recovery-not-isolated", "one bad intent does not stop recovery",
           "poimen/_engine/recovery.py",
           '    except Exception:\n        log.exception("recovery of intent %s failed',
           '    except ZeroDivisionError:\n        log.exception("recovery of intent %s failed',
           T_LIFE),
    # The keyed capability and the guard.
    Mutant("forged-token-allowed", "a forged write token is denied", CAP,
           'if problem == "forged":', "if False:", T_CAP),
    Mutant("denial-not-audited", "a denial is recorded before the tool sees it", CAP,
           "denial = store.record_denial(now=store.now(), **data)",
           "denial = type('D', (), {'id': None})()", T_CAP),
    Mutant("purge-not-a-write", "every method but GET/HEAD/OPTIONS/TRACE carries the key",
           HANDLES,
           'READ_METHODS = frozenset({"GET", "HEAD", "OPTIONS", "TRACE"})',
           'READ_METHODS = frozenset({"GET", "HEAD", "OPTIONS", "TRACE", "PURGE"})', T_BAD),
    Mutant("guard-open-flags", "an out-of-band file write is denied", GUARD,
           "_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR", "_WRITE_FLAGS = os.O_RDWR", T_CAP),
    Mutant("guard-sqlite-writes", "an out-of-band SQLite write is denied", GUARD,
           '    "sqlite3.connect": _sqlite,\n', "", T_CAP + T_BAD[:1]),
    # The store's compare-and-set rules.
    Mutant("indeterminate-stale-fence", "a stale owner changes nothing", SQL,
           '"UPDATE intents SET state = \'INDETERMINATE\', reason = ?, lease_expires_at = NULL, "\n'
           '            "next_check_at = NULL, updated_at = ? "\n'
           '            "WHERE id = ? AND fence = ?',
           '"UPDATE intents SET state = \'INDETERMINATE\', reason = ?, lease_expires_at = NULL, "\n'
           '            "next_check_at = NULL, updated_at = ? "\n'
           '            "WHERE id = ? AND fence >= ?', T_STORE),
    Mutant("renewal-shortens", "a renewal never shortens a lease", SQL,
           'f"UPDATE intents SET lease_expires_at = {g}(COALESCE(lease_expires_at, ?), ?) "',
           'f"UPDATE intents SET lease_expires_at = COALESCE(?, ?) "', T_STORE),
    # Both stores decide under a lock (SQLite's one writer, PostgreSQL's FOR UPDATE): the
    # UPDATE's own state test is a second guard, so the one that counts is the read's.
    Mutant("resolve-two-winners", "an operator's decision has exactly one winner", STORE,
           "        if row[0] != S.INDETERMINATE:\n            raise NotIndeterminateError(",
           "        if False:\n            raise NotIndeterminateError(", T_STORE),
    # A second approval is stopped twice: by the state read under the row lock (FOR UPDATE on
    # PostgreSQL) and by the approve statement's fence and state. A mutant of either alone is
    # equivalent (approve-two-winners, dropping the statement's, survived once the row lock
    # came): no single change breaks the rule, which test_approval.py's `one_winner` tests
    # check on both backends.
    # A decision after the window ends the call (approval_expired) under the row lock. The
    # approve statement's own window clause is a second guard under the same lock and clock:
    # a mutant of it alone is equivalent (it survived: nothing reaches it past the window).
    Mutant("late-decision-not-expired", "a decision after the approval window expires the call",
           "poimen/store/_approvals.py",
           "            if it.next_check_at is not None and it.next_check_at <= now:",
           "            if False:", ("tests/integration/test_approval.py", "-k", "window and sqlite")),
    Mutant("approval-repeat-mismatch", "a call id awaiting approval names that call only",
           PROTOCOL,
           "approval.approvers)\n    )\n    if not created:\n"
           "        return (yield from existing_steps(e, t, intent, d, c))",
           "approval.approvers)\n    )\n    if not created:\n        return answer(intent)",
           ("tests/integration/test_approval.py", "-k", "names_that_call and sqlite")),
    Mutant("wait-ignores-window", "a waiting caller expires a call past its approval window",
           ENGINE, "        if approval_due(intent, read_at):", "        if False:",
           ("tests/integration/test_approval.py", "-k", "window and sqlite")),
    Mutant("repeat-ignores-window", "a repeated call expires a call past its approval window",
           PROTOCOL, "        if approval_due(intent, read_at):", "        if False:",
           ("tests/integration/test_approval.py", "-k", "window and sqlite")),
    Mutant("abandon-not-notified", "an abandoned intent is notified like any Indeterminate one",
           STORE, "                    self._insert_note(ex, intent_id, note, now)\n"
           "                    done = self._intent_or_none(ex, intent_id)",
           "                    done = self._intent_or_none(ex, intent_id)",
           ("tests/integration/test_webhook.py", "-k", "abandoned and sqlite")),
    Mutant("append-only-sqlite", "events are append-only", "poimen/store/sql/sqlite/0006_retention.sql",
           "CREATE TRIGGER events_append_only_d BEFORE DELETE ON events\n"
           "WHEN NOT EXISTS (SELECT 1 FROM poimen_pruning)",
           "CREATE TRIGGER events_append_only_d BEFORE DELETE ON events\nWHEN 0",
           (*T_STORE, "tests/integration/test_retention.py")),
    Mutant("truncate-postgres", "the history cannot be truncated",
           "poimen/store/sql/postgres/0001_initial.sql",
           "CREATE TRIGGER events_append_only_t BEFORE TRUNCATE ON events\n"
           "    FOR EACH STATEMENT EXECUTE FUNCTION poimen_append_only();\n", "",
           ("tests/contract/test_store_contract.py", "-k", "append_only and postgres")),
    Mutant("prune-unfinished", "a prune never removes an unfinished intent",
           "poimen/store/_retention.py",
           'PRUNABLE = ("COMPLETED", "FAILED", "RESOLVED_LANDED", "RESOLVED_NOT_LANDED")',
           'PRUNABLE = ("COMPLETED", "FAILED", "RESOLVED_LANDED", "RESOLVED_NOT_LANDED", '
           '"DISPATCHED")', ("tests/integration/test_retention.py", "-k", "sqlite")),
    # PostgreSQL's settle, the history readers, the server clock, lost claims.
    Mutant("settle-stale-snapshot", "a settle ends the attempt a concurrent spill wrote", PG,
           '_SETTLE = f"{SQL.settle_inline} RETURNING 1"', '_SETTLE = f"{SQL.settle} RETURNING 1"',
           ("tests/contract/test_spill_races.py", "-k", "settle")),
    Mutant("history-read-unsnapshotted-sqlite", "a history is read in one snapshot",
           "poimen/store/sqlite.py", '            conn.execute("BEGIN")\n', "",
           ("tests/contract/test_spill_races.py", "-k", "history and sqlite")),
    Mutant("history-read-unsnapshotted-postgres", "a history is read in one snapshot", PG,
           '_SNAPSHOT = "SET TRANSACTION ISOLATION LEVEL REPEATABLE READ, READ ONLY"',
           '_SNAPSHOT = "SET TRANSACTION READ ONLY"',
           ("tests/contract/test_spill_races.py", "-k", "history and postgres")),
    Mutant("clock-wall-elapsed", "a wall-clock step never moves the server clock", PG,
           "        return server + (mono - at)\n", "        return server + (time.time() - wall)\n",
           ("tests/contract/test_postgres_clock.py",)),
    Mutant("clock-stall-unnoticed", "a stalled monotonic clock is measured again", PG,
           "due = mono >= self._clock_next or time.time() - wall - (mono - at) > _STALL",
           "due = mono >= self._clock_next", ("tests/contract/test_postgres_clock.py",)),
    Mutant("session-kept-dead", "a session whose backend died is not kept for the next use", PG,
           "if conn.pgconn.transaction_status == _IDLE and not self._closed:",
           "if not self._closed:",
           ("tests/contract/test_postgres_sessions.py", "-k", "died")),
    Mutant("session-shared-by-threads", "a kept session is lent to one thread at a time", PG,
           "            conn = idle.pop()\n", "            conn = idle[-1]\n",
           ("tests/contract/test_postgres_sessions.py", "-k", "threads")),
    Mutant("session-inherited-by-fork", "a forked child never uses its parent's sessions", PG,
           "        self._idle = []\n", "",
           ("tests/contract/test_postgres_sessions.py", "-k", "fork")),
    Mutant("lost-claim-adopted", "a lost claim is ours only if it carries our nonce", PG,
           "if mine and it and it.state == S.DISPATCHED and it.fence == fence + 1:",
           "if it and it.state == S.DISPATCHED and it.fence == fence + 1:",
           ("tests/integration/test_postgres_lost_commit.py", "-k", "rival")),
    # Undo and retention.
    Mutant("prefix-misses-last-code-point", "a prefix search finds every call id of the scope",
           "poimen/store/sqlite.py", "        end = prefix_end(prefix)\n",
           '        end = prefix + "\\U0010ffff"\n',
           ("tests/contract/test_prefix_search.py", "-k", "sqlite")),
    # Two runs of one undo meet in record_event: the check for an equal event is made under
    # the intent's row lock (SQLite's one writer needs none, so the race is PostgreSQL's).
    Mutant("event-check-unlocked", "an equal event is written once", STORE,
           "if ex.execute(self._sql.intent_locked, (intent_id,)).fetchone() is None:",
           "if ex.execute(self._sql.intent_by_id, (intent_id,)).fetchone() is None:",
           ("tests/contract/test_record_event.py", "-k", "two_connections and postgres")),
    Mutant("undone-takes-new-undo", "an original with an 'undone' event takes no new undo "
           "(the store)", STORE, "        if undone:\n            raise AlreadyUndoneError(",
           "        if False:\n            raise AlreadyUndoneError(",
           ("tests/contract/test_record_event.py", "-k", "undone_call and sqlite")),
    Mutant("undone-event-ignored", "an original with an 'undone' event is undone (undo)",
           UNDO, "    if done is not None:  # undone for good", "    if False:  # undone for good",
           ("tests/integration/test_undo_retention.py", "-k", "undone_event and sqlite")),
    Mutant("reserved-call-id-open", "an application's call id never uses undo's prefix", ENGINE,
           "if (is_undo(call_id) or is_edit(call_id)) and MAKING.get() != call_id:", "if False:",
           ("tests/integration/test_undo.py", "-k", "prefix_is_refused and sqlite")),
    Mutant("foreign-undo-taken", "undo takes as the reversal only its own undo", UNDO,
           "        foreign = _not_its_undo(latest, it, r, undo_tool)\n",
           "        foreign = None\n",
           ("tests/integration/test_undo.py", "-k", "prefix_is_refused and sqlite")),
    Mutant("older-undo-taken", "an undo made before the call is not its undo", UNDO,
           "    elif found.created_at < it.created_at:", "    elif False:",
           ("tests/integration/test_undo_retention.py", "-k", "used_again and sqlite")),
    Mutant("undo-past-unknown", "undo stops at an undo whose outcome is unknown", UNDO,
           "        if latest.state == S.INDETERMINATE:  # a second undo",
           "        if False:  # a second undo",
           ("tests/integration/test_undo.py", "-k", "never_run_past and sqlite")),
    Mutant("prune-undo-before-original", "an undo intent is never pruned while its original "
           "remains", "poimen/store/_retention.py",
           "if not self._undo_of_one_staying(ex, str(c), going)]", "]",
           ("tests/contract/test_prune_store.py", "-k", "undo_intent_stays and sqlite")),
    Mutant("prune-changed-batch", "a batch is deleted only if unchanged since it was archived",
           "poimen/store/_retention.py", "        if changed:\n            raise _Changed(",
           "        if False:\n            raise _Changed(",
           ("tests/contract/test_prune_store.py", "-k", "written_to and sqlite")),
    # The undo's call id shortened to a hash: its original is found by its undo events.
    Mutant("prune-hashed-undo", "an undo intent is never pruned while its original remains, "
           "its call id shortened or not", "poimen/store/_retention.py",
           "            params = [f'%\"undo_call_id\": \"{call_id}\"%']",
           "            params = [f'%\"undo_call_id\": \"{call_id}!\"%']",
           ("tests/contract/test_prune_store.py", "-k", "undo_intent_stays and sqlite")),
    Mutant("prune-key-window-ignored", "a prune keeps an intent inside its tool's key window",
           "poimen/operator/_prune.py", "now - max(older_than, ttls.get(i.tool_id, 0))]",
           "now - older_than]", ("tests/integration/test_retention.py", "-k", "sqlite")),
    Mutant("prune-undelivered", "a prune keeps an intent whose notification is undelivered",
           "poimen/store/_retention.py",
           '"WHERE o.intent_id = i.id AND o.delivered_at IS NULL) "',
           '"WHERE o.intent_id = i.id AND o.delivered_at IS NULL AND 1 = 0) "',
           ("tests/integration/test_retention.py", "-k", "sqlite")),
    Mutant("prune-indeterminate", "a prune never removes an unresolved Indeterminate intent",
           "poimen/store/_retention.py",
           'PRUNABLE = ("COMPLETED", "FAILED", "RESOLVED_LANDED", "RESOLVED_NOT_LANDED")',
           'PRUNABLE = ("COMPLETED", "FAILED", "RESOLVED_LANDED", "RESOLVED_NOT_LANDED", '
           '"INDETERMINATE")', ("tests/integration/test_retention.py", "-k", "sqlite")),
    Mutant("undo-blind", "an Indeterminate call is undone only by an Idempotent undo "
           "(else an operator resolves it first)", UNDO,
           "    if not resume and it.state == S.INDETERMINATE and not isinstance(",
           "    if False and it.state == S.INDETERMINATE and not isinstance(",
           ("tests/integration/test_undo.py", "-k", "not_undone_blindly and sqlite")),
    # The operator path.
    Mutant("redaction-skipped", "secrets are redacted wherever they are shown",
           "poimen/_core/present.py",
           'return SECRET_NAME.search(name.lower().replace("-", "_")) is not None',
           "return False", ("tests/unit/test_operator.py", "tests/integration/test_cli.py",
                            "-k", "redact or secret")),
    Mutant("event-detail-unredacted", "event details are redacted in JSON output",
           "poimen/operator/_ops.py", "    detail = _redacted_json(e.detail)\n",
           "    detail = json.loads(e.detail) if e.detail else None\n",
           ("tests/unit/test_operator.py", "tests/integration/test_cli.py", "-k",
            "redact or secret")),
    Mutant("operator-name-blank", "an operator's decision needs a real name",
           "poimen/operator/_ops.py",
           "    if not isinstance(operator, str) or not operator.strip():\n",
           "    if not isinstance(operator, str):\n",
           ("tests/integration/test_operator_names.py",)),
    Mutant("webhook-future-timestamp", "a webhook signature from the future is refused",
           "poimen/_engine/notify.py",
           "if abs((time.time() if now is None else now) - int(timestamp)) > tolerance:",
           "if (time.time() if now is None else now) - int(timestamp) > tolerance:",
           ("tests/unit/test_operator.py", "tests/integration/test_webhook.py", "-k",
            "signature or timestamp")),
    Mutant("webhook-id-unsigned", "a webhook's signature covers its id (Standard Webhooks)",
           "poimen/_engine/notify.py",
           'signed = msg_id.encode("utf-8") + b"." + timestamp.encode("ascii")',
           'signed = timestamp.encode("ascii")',
           ("tests/unit/test_operator.py", "-k", "signature or webhook")),
    Mutant("remote-drive-allowed", "a SQLite log on a network drive is refused (Windows)",
           "poimen/store/_fs.py",
           "if mount is None or not (mount.remote or is_network(mount.fstype)):",
           "if mount is None or not is_network(mount.fstype):",
           ("tests/integration/test_filesystems.py", "-k", "windows")),
    Mutant("foreign-url-shown", "a mistyped store URL is shown without its password",
           "poimen/store/__init__.py",
           "shown = redact_store_url(url) if isinstance(url, str) else type(url).__name__",
           "shown = url", ("tests/integration/test_bad_input_operator.py", "-k", "foreign")),
    Mutant("half-registered", "a registration is all or nothing", ENGINE,
           "        spec = spec_of(tool, name, description)\n",
           "        self.tools[registration.id] = tool\n"
           "        spec = spec_of(tool, name, description)\n",
           ("tests/integrations/test_mcp_bad_input.py", "-k", "local_tool")),
    Mutant("error-text-unredacted", "error texts are shown without the credentials of URLs",
           "poimen/operator/_ops.py",
           "    return None if text is None else redact_urls(text)\n",
           "    return text\n",
           ("tests/integration/test_bad_input_operator.py", "-k", "error_texts and sqlite")),
    Mutant("view-read", "a SQLite file holding a view is refused", "poimen/store/sqlite.py",
           "        if views:\n", "        if False:\n",
           ("tests/integration/test_bad_input_operator.py", "-k", "recursive_view")),
    Mutant("row-checks-skipped", "verify judges every row by the schema's constraints",
           "poimen/store/_sqlite_checks.py", "        out += _row_problems(store, reference)\n", "",
           ("tests/integration/test_bad_input_operator.py", "-k", "verify_finds")),
    Mutant("csrf-skipped", "a console change needs the session's CSRF token",
           "poimen/console/_session.py", "        return _same(form_value, v.session.csrf)",
           "        return True", ("tests/integration/test_console.py",)),
    Mutant("origin-skipped", "a console change comes from the console's own origin",
           "poimen/console/_session.py",
           'if origin is not None and origin != f"{request.url.scheme}://{request.url.netloc}":',
           "if False:", ("tests/integration/test_console.py",)),
    Mutant("login-cross-site", "a login another site starts is refused",
           "poimen/console/_session.py",
           'return request.headers.get("sec-fetch-site", "same-origin") in ("same-origin", "none")',
           "return True", ("tests/integration/test_console_signin.py", "-k", "another_site")),
    Mutant("login-unlimited", "failed logins are rate limited before their hash",
           "poimen/console/_app.py", "    if not c.logins.allowed(_client(request)):",
           "    if False:", ("tests/integration/test_console_signin.py", "-k", "rate_limited")),
    Mutant("approval-expiry-ignored", "an approval window ends", "poimen/_engine/recovery.py",
           "    gone = e.store.expire_approvals(e.store.now())\n", "    gone = []\n",
           ("tests/integration/test_approval.py", "-k", "sqlite")),
    # Issue 29: back-off is capped; a custom key derivation is derived twice at call time.
    Mutant("lookup-backoff-uncapped", "a lookup's back-off never exceeds max_backoff", BACKOFF,
           "cap: float = min(self.maximum, self.initial * 2 ** min(max(n - 1, 0), 62))",
           "cap: float = self.initial * 2 ** min(max(n - 1, 0), 62)",
           ("tests/integration/test_call_bounds.py", *T_DECIDE, "-k",
            "(sqlite or not postgres) and (unknown or decision)")),
    Mutant("retry-backoff-uncapped", "the call path's back-off never exceeds Retry.maximum",
           BACKOFF, "cap: float = min(self.maximum, self.initial * 2 ** min(max(n - 1, 0), 62))",
           "cap: float = self.initial * 2 ** min(max(n - 1, 0), 62)",
           ("tests/integration/test_call_bounds.py", "-k", "(sqlite or not postgres) and retr")),
    Mutant("custom-key-once", "a custom key derivation gives one key for one set of arguments",
           ENGINE, "if p.key_twice and p.key(recorded) != key:",
           "if False:", ("tests/integration/test_call_bounds.py", "-k", "sqlite and custom")),
    # An identical call in a scope is not dispatched while the first is unsettled.
    Mutant("coalesce-skipped", "an unsettled identical call is never dispatched again",
           "poimen/call_ids.py",
           "    if isinstance(given, str):\n        return given\n", "    return None\n",
           T_UNSETTLED),
    Mutant("unsettled-lookup-skipped", "an unsettled identical call answers the new one",
           STORE,
           "row = ex.execute(self._sql.unsettled_same, same).fetchone()",
           "row = None", T_UNSETTLED),
    Mutant("unsettled-unlocked", "scoped first commits of one call run one at a time", PG,
           '        ex.execute("SELECT pg_advisory_xact_lock(hashtextextended(%s, 0))", (key,))\n',
           "        pass\n",
           ("tests/integration/test_unsettled_calls.py", "-k", "threads and postgres")),
    Mutant("alias-forgotten", "a coalesced call id answers with the call it found", STORE,
           "            row = ex.execute(self._sql.known_by_alias, (call_id,)).fetchone()\n",
           "            pass\n", T_UNSETTLED),
    Mutant("pending-counted", "a Pending or Indeterminate answer is not a result",
           "poimen/call_ids.py", 'if getattr(outcome, "terminal", True):', "if True:",
           T_UNSETTLED),
    # A call recovery settled owes its answer to the first identical call, and to one only.
    Mutant("owed-answer-forgotten", "a call settled by recovery answers an identical call",
           "poimen/_engine/recovery.py", "orphan_steps(e, tool, it, CallState(), owed=True)",
           "orphan_steps(e, tool, it, CallState(), owed=False)", T_OWED),
    Mutant("owed-answer-matched-late", "a call settled by recovery answers an identical call",
           STORE, "row = ex.execute(self._sql.owed_same, same).fetchone()", "pass", T_OWED),
    Mutant("owed-answer-given-twice", "an owed answer is taken by one call only", STORE,
           "took = owed and ex.execute(self._sql.take_answer, (first.id,)).rowcount == 1",
           "took = owed", T_OWED),
    Mutant("owed-answer-kept", "an answer given to its call id is not owed any more", STORE,
           "if owed and known.state in TERMINAL:", "if False:", T_OWED),
    Mutant("owed-answer-read-kept", "an answer read by call id is not owed any more",
           PROTOCOL, "        store.take_answer(out.intent_id)\n", "        pass\n", T_OWED),
    Mutant("owed-answer-late-caller", "a caller seized after its lease ran out takes its answer",
           PROTOCOL, "    return time.monotonic() - c.began >= (d.lease_expires_at - d.now) / 2",
           "    return False",
           ("tests/integration/test_unsettled_calls.py", "-k", "sqlite and settled_its_call")),
    Mutant("owed-answer-after-undo", "an undone call owes no answer", "poimen/_undo.py",
           "    store.take_answer(it.id)\n", "    pass\n",
           ("tests/integration/test_unsettled_calls.py", "-k", "sqlite and was_undone")),
    Mutant("owed-answer-after-decision", "an operator's decision owes no answer", SQL,
           '"UPDATE intents SET state = ?, result = ?, updated_at = ?, answer_owed = 0 "',
           '"UPDATE intents SET state = ?, result = ?, updated_at = ? "', T_OWED),
    Mutant("four-eyes-ignored", "a four-eyes call needs its distinct approvers",
           "poimen/store/_approvals.py",
           "if approve and edit is None and len(given) + 1 < needed:", "if False:",
           ("tests/integration/test_approval_edit.py", "-k", "sqlite")),
    Mutant("same-approver-counted", "one operator's approvals count once",
           "poimen/store/_approvals.py", "if approve and operator in given:", "if False:",
           ("tests/integration/test_approval_edit.py", "-k", "sqlite")),
    Mutant("edit-link-ignored", "the caller of an edited call resumes with the edited call",
           ENGINE,
           'if intent.state == IntentState.FAILED and intent.reason == "edited":', "if False:",
           ("tests/integration/test_approval_edit.py", "-k", "sqlite")),
    Mutant("impure-nested", "a key derivation reading the clock in a nested function is refused",
           "poimen/_core/effects.py",
           "        stack.extend(k for k in c.co_consts if isinstance(k, types.CodeType))\n", "",
           ("tests/unit/test_keys.py", "tests/unit/test_registration.py")),
    # poimen crashtest and poimen scan (docs/design.md section 11).
    Mutant("crashtest-double-missed", "a write applied more often than in the clean run is a "
           "double effect", "poimen/crashtest/_run.py", "if n <= max(clean[sig], 1):",
           "if n <= max(clean[sig], 1) + 1:",
           ("tests/crashtest/test_crashtest.py", "-k", "table or (without_poimen and plain)")),
    Mutant("crashtest-unfinished-ignored", "a call left DISPATCHED after the restart fails the "
           "case", "poimen/crashtest/_run.py",
           'status = "double" if doubles else "unfinished" if kw.get("unfinished") else "ok"',
           'status = "double" if doubles else "ok"',
           ("tests/crashtest/test_crashtest.py", "-k", "left_dispatched")),
    Mutant("crashtest-other-call-killed", "a case stops only its own call",
           "poimen/_engine/crashpoints.py",
           "    if _CALL is not None and call_id != _CALL:\n        return\n", "",
           ("tests/crashtest/test_crashtest.py", "-k", "with_poimen and plain")),
    Mutant("witness-key-applied-twice", "the witness applies a keyed write once per key",
           "poimen/crashtest/_witness.py", "        if w.key is not None:", "        if False:",
           ("tests/unit/test_crashtest_witness.py",)),
    Mutant("scan-post-missed", "an HTTP POST in a tool is a write", "poimen/scan/_finder.py",
           '_WRITE_METHODS = frozenset({"post", "put", "patch", "delete"})',
           '_WRITE_METHODS = frozenset({"put", "patch", "delete"})', ("tests/scan/test_scan.py",)),
    Mutant("scan-kernel-call-ignored", "a tool calling kernel.call is under poimen",
           "poimen/scan/_finder.py",
           '"kernel" in ast.unparse(c.func.value).lower():\n                    return True',
           '"kernel" in ast.unparse(c.func.value).lower():\n                    return False',
           ("tests/scan/test_scan.py",)),
    # Evidence, ageing and bulk resolution (docs/design.md sections 3 and 7).
    Mutant("evidence-writes", "an evidence function only reads", "poimen/_engine/evidence.py",
           "read_only=True)", "read_only=False)",
           ("tests/integration/test_evidence.py", "-k", "only_read")),
    Mutant("evidence-in-recovery", "evidence is gathered on the delivery duty, never in a "
           "caller's recovery or delivery", "poimen/_aids.py",
           "        hold = self.gatherer.scan() if self.gatherer.rules else set()\n",
           "        hold = self.gatherer.scan() if self.gatherer.rules else set()\n"
           "        while self.gatherer.gather_pending():\n            hold = set()\n",
           ("tests/integration/test_evidence.py", "-k", "never_holds")),
    Mutant("exit-drops-evidence", "a process about to exit finishes the gathering in flight",
           "poimen/_aids.py", "not (finish and self.gatherer.wait_idle())",
           "not (False and self.gatherer.wait_idle())",
           ("tests/integration/test_evidence.py", "-k", "about_to_exit")),
    Mutant("evidence-not-awaited", "an intent's notifications wait for its evidence",
           "poimen/_engine/notify.py", "        if n.intent_id in hold:\n            continue\n", "",
           ("tests/integration/test_evidence.py", "-k", "killed_email and sqlite")),
    Mutant("suggestion-not-audited", "a decision records the suggestion in force",
           "poimen/operator/_ops.py", "        **_evidence.audit_of(store.events(intent_id), landed),\n",
           "", ("tests/integration/test_evidence.py", "-k", "suggests_not_landed")),
    Mutant("escalation-line-skipped", "an overdue call is escalated to escalate_to too",
           "poimen/_aids.py", "notifier_names([*notifiers, *self.escalate_to])",
           "notifier_names(notifiers)", ("tests/integration/test_ageing.py", "-k", "sqlite")),
    Mutant("overdue-late", "a call is overdue once its tool's threshold has passed",
           "poimen/operator/_ageing.py", "if now - i.created_at >= after)",
           "if now - i.created_at >= 2 * after)",
           ("tests/integration/test_ageing.py", "-k", "sqlite")),
    Mutant("filter-takes-all", "a bulk filter never means every call by accident",
           "poimen/operator/_reconcile.py", "    if not parts:\n", "    if False:\n",
           ("tests/unit/test_reconcile.py",)),
    # The tamper-evident audit (docs/design.md section 7, docs/audit.md).
    Mutant("audit-hash-unchecked", "each link is the hash of the one before and its row",
           AUDIT, "    good = [x for x in at if link(prev, x.kind, x.values) == x.hash]\n",
           "    good = list(at)\n", (*T_AUDIT, "-k", "edited and sqlite")),
    Mutant("audit-link-fast-bytes", "the triggers' link hashes the definition's bytes of every "
           "value (the generated fast path: an integer's tag)", AUDIT,
           "h{i} = INT(2, v{i})", "h{i} = INT(3, v{i})",
           ("tests/unit/test_audit_bytes.py", "-k", "sqlite_link_is_the_definitions")),
    Mutant("audit-gap-unnamed", "a position missing from the chain is a deleted row", AUDIT,
           "        while expect < to:\n", "        while False:\n",
           (*T_AUDIT, "-k", "deleted and sqlite")),
    Mutant("audit-unlinked-ignored", "a row without a link was inserted behind the log's back",
           AUDIT_OP, "        stray = next(iter(view.unlinked()), None)\n", "        stray = None\n",
           (*T_AUDIT, "-k", "test_an_inserted_row and sqlite")),
    Mutant("audit-head-unchecked", "the head is the hash of the last row", AUDIT,
           "    if prev != head.hash:\n", "    if False:\n",
           (*T_AUDIT, "-k", "cut_off and sqlite")),
    Mutant("audit-move-called-edit", "a row moved in the chain is named reordered", AUDIT,
           "        if link(y.hash, x.kind, x.values) == x.hash:\n", "        if False:\n",
           (*T_AUDIT, "-k", "exchanged_in_the_chain and sqlite")),
    Mutant("audit-published-ignored", "a published head must be a link of the chain", AUDIT,
           "            w.published = _cmp(x.hash, want_hash)\n",
           '            w.published = "ok"\n', (*T_AUDIT, "-k", "published and sqlite")),
    Mutant("audit-archive-unchecked", "an archived row is the link the chain removed", AUDIT,
           "        if prev is not None and link(prev, x.kind, x.values) != x.hash:\n",
           "        if False:\n", (*T_AUDIT, "-k", "prune and sqlite")),
    Mutant("audit-prune-unrecorded", "a prune records the positions it removed", RETENTION,
           "        if chain:\n            self._record_pruned(",
           "        if False:\n            self._record_pruned(",
           (*T_AUDIT, "-k", "prune and sqlite")),
    Mutant("audit-settled-unlinked-sqlite", "each settled intent carries a link",
           "poimen/store/sql/sqlite/0012_settle_link_without_lists.sql",
           "CREATE TRIGGER intents_chain_settle AFTER UPDATE OF state ON intents\n"
           "WHEN NOT (OLD.state",
           "CREATE TRIGGER intents_chain_settle AFTER UPDATE OF state ON intents\n"
           "WHEN 0 AND NOT (OLD.state",
           (*T_AUDIT, "-k", "every_usual_way and sqlite")),
    Mutant("audit-settled-unlinked-postgres", "each settled intent carries a link",
           "poimen/store/sql/postgres/0010_audit_chain.sql",
           "CREATE TRIGGER intents_chain_settle BEFORE UPDATE ON intents FOR EACH ROW\n"
           "    WHEN (OLD.state",
           "CREATE TRIGGER intents_chain_settle BEFORE UPDATE ON intents FOR EACH ROW\n"
           "    WHEN (false AND OLD.state",
           (*T_AUDIT, "-k", "every_usual_way and postgres")),
    Mutant("audit-head-unlocked-postgres", "links are made one transaction at a time: one "
           "linear chain", "poimen/store/sql/postgres/0010_audit_chain.sql",
           "    UPDATE audit_head SET seq = seq + 1,\n"
           "        hash = encode(sha256(decode(hash, 'hex') || poimen_audit_bytes(NEW)), 'hex')\n"
           "        RETURNING seq, hash INTO NEW.chain_seq, NEW.chain_hash;\n",
           "    SELECT seq + 1, encode(sha256(decode(hash, 'hex') || poimen_audit_bytes(NEW)), "
           "'hex')\n        INTO NEW.chain_seq, NEW.chain_hash FROM audit_head;\n"
           "    PERFORM pg_sleep(0.01);\n"
           "    UPDATE audit_head SET seq = NEW.chain_seq, hash = NEW.chain_hash;\n",
           ("tests/integration/test_audit_writers.py", "-k", "processes and postgres")),
    Mutant("audit-export-unsigned", "an export verifies only with its signer's key",
           "poimen/operator/_audit_export.py", "        public_key.verify(sig, _DOMAIN + digest.digest())\n",
           "        pass\n", (*T_AUDIT, "-k", "one_byte and sqlite")),
    # The batch goes through the store's one-winner check like a single resolve does.
    Mutant("bulk-two-winners", "a single resolve racing a batch: one decision per intent",
           STORE, "        if row[0] != S.INDETERMINATE:\n            raise NotIndeterminateError(",
           "        if False:\n            raise NotIndeterminateError(",
           ("tests/integration/test_bulk_resolve.py", "-k", "racing")),
    # Transactional: the marker commits with the write; recovery reads it, and fences.
    Mutant("tx-marker-apart", "a Transactional marker is written in the tool's transaction", TX,
           "            landed = s.execute(s.q(_LAND),",
           "            s.commit()\n            landed = s.execute(s.q(_LAND),", T_TX_CRASH),
    Mutant("tx-no-marker-read", "Transactional recovery reads the marker before a retry", DECIDE,
           '                case Unasked():\n                    return Ask("marker")',
           "                case Unasked():\n                    return RetryDecision()", T_DECIDE),
    Mutant("tx-lookup-no-fence", "a marker lookup fences out the attempts it answers for", TX,
           "            s.execute(s.q(_FENCE), (intent.id, intent.attempts, time.time()))\n", "",
           (*T_TX, "-k", "fences")),
    Mutant("tx-marker-not-unique", "of two attempts one marker lands; a fenced one never", TX,
           '    f"WHERE {MARKERS}.landed = 0 AND {MARKERS}.attempt < excluded.attempt"\n)\n'
           "# A lookup", '    "WHERE 1 = 1"\n)\n# A lookup', (*T_TX, "-k", "fences or two_open")),
    Mutant("tx-own-unfenced", "on the log's database the outcome commits only on its fence",
           STORE, "        if not self._settle(conn, o):\n            conn.rollback()",
           "        if not (self._settle(conn, o) or True):\n            conn.rollback()",
           (*T_TX, "-k", "only_on_its_fence and sqlite")),
    Mutant("tx-write-sent", "a Transactional tool's handle writes are refused", DECIDE,
           "    if isinstance(s.effect, Transactional):\n        return Refused(",
           "    if False:\n        return Refused(", (*T_TX, "-k", "handle and sqlite-other")),
    Mutant("tx-denial-under-lock", "a denied write rolls its transaction back first", CAP,
           "        if abort is not None:\n            abort()\n", "",
           (*T_TX, "-k", "handle and sqlite-own")),
    Mutant("tx-timeout-unbounded", "a transaction is bounded by the tool's timeout", TX,
           "        if spent > self._timeout:", "        if False:",
           (*T_TX, "-k", "outlives and sqlite")),
    Mutant("tx-shadow-commits", "a shadow kernel's transaction always rolls back", TX,
           'if run.kind != "completed" or not self._live:', 'if run.kind != "completed":',
           (*T_TX, "-k", "shadow")),
    Mutant("tx-stays-open", "ctx.tx is closed once the call is over", TX_TOOL,
           "        why = self._closed\n        if why is not None:",
           "        why = self._closed\n        if False:", (*T_TX, "-k", "closed_once")),
    Mutant("tx-tool-commit-ignored", "a transaction the tool ended is an operator's", TX,
           "        if ended:\n            s.rollback()", "        if False:\n            s.rollback()",
           (*T_TX, "-k", "sql_that_ends and postgres")),
    Mutant("otel-hook-unguarded", "an observer cannot break a call (one called directly too)",
           OTEL, '            failed(self, "call_started")\n            return None',
           "            raise",
           ("tests/integration/test_observe_direct.py", "-k", "raises and sqlite")),
    # Issue 25: prepare's one pass for plain arguments records what validation records (a
    # changed byte is a key that drifts on recovery).
    Mutant("plain-args-subtype", "plain arguments are recorded as validation records them",
           ENGINE, "                if type(args.get(name)) is not kind:",
           "                if not isinstance(args.get(name), kind):", T_HOT),
    Mutant("key-of-text-partial", "a key of the arguments' own text only where it covers them",
           ENGINE, "            if set(d.paths) == set(t.params) and _as_declared(t):",
           "            if set(d.paths) <= set(t.params) and _as_declared(t):", T_HOT),
    Mutant("plain-field-options", "a field's alias or exclusion keeps pydantic's pass",
           ENGINE, "    if not _as_declared(t):\n        return None\n",
           "    if not _as_declared(t):\n        pass\n", T_HOT),
    Mutant("key-of-text-excluded", "a key of the arguments' text only where none is left out",
           ENGINE, "            if set(d.paths) == set(t.params) and _as_declared(t):",
           "            if set(d.paths) == set(t.params):", T_HOT),
    # The checkers themselves (verification/, outside the wheel): a check that cannot fail.
    Mutant("model-unsafe-sends-unseen", "the model check sees an Unsafe call sent twice", MODEL,
           'if kind == "unsafe" and g.sends > 1:', 'if kind == "unsafe" and g.sends > 2:',
           ("tests/model/test_model_check.py", "-k", "unsafe-retried")),
    Mutant("soak-live-takeover-unseen", "the soak sees a live call taken over", SOAK_CHECK,
           "if lease <= at + CLOCK_TOLERANCE:", "if lease <= math.inf:",
           ("tests/integration/test_soak.py", "-k", "broken_rule")),
]
