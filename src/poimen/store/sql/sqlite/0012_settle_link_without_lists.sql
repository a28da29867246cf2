-- poimen intent log, SQLite dialect, version 12: the same audit chain, cheaper to write. SQLite
-- codes an IN list of three or more constants as a temporary b-tree, built again for each row
-- a statement checks: the settle trigger's WHEN built two on every settle (66k of the 658k
-- instructions a call's two commits took, bench.instructions). The same test, written as
-- comparisons, builds none; which rows are linked, and how, is unchanged (state is NOT NULL).
DROP TRIGGER intents_chain_settle;
CREATE TRIGGER intents_chain_settle AFTER UPDATE OF state ON intents
WHEN NOT (OLD.state = 'COMPLETED' OR OLD.state = 'FAILED' OR OLD.state = 'RESOLVED_LANDED'
        OR OLD.state = 'RESOLVED_NOT_LANDED')
    AND (NEW.state = 'COMPLETED' OR NEW.state = 'FAILED' OR NEW.state = 'RESOLVED_LANDED'
        OR NEW.state = 'RESOLVED_NOT_LANDED')
    AND EXISTS (SELECT 1 FROM audit_head)
BEGIN
    UPDATE audit_head SET seq = seq + 1, hash = poimen_link(hash, 'intent', NEW.id,
        NEW.call_id, NEW.tool_id, NEW.effect, NEW.args, NEW.args_hash, NEW.key, NEW.request_id,
        NEW.state, NEW.fence, NEW.owner_id, NEW.owner_host, NEW.owner_pid, NEW.owner_start,
        NEW.lease_expires_at, NEW.timeout_s, NEW.deadline_at, NEW.next_check_at,
        NEW.unknown_count, NEW.attempts, NEW.result, NEW.error, NEW.reason, NEW.created_at,
        NEW.updated_at, NEW.scope);
    UPDATE intents SET chain_seq = (SELECT seq FROM audit_head),
        chain_hash = (SELECT hash FROM audit_head) WHERE id = NEW.id;
END;
