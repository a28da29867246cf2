-- poimen intent log, SQLite dialect, version 12: the same rules, cheaper to write. SQLite codes
-- an IN list of three or more constants as a temporary b-tree, built again for each row a
-- statement checks: the intents CHECKs of effect and state built two on every dispatch and
-- one on every settle (102k of the 658k instructions a call's two commits took,
-- bench.instructions), the settle trigger's WHEN two more (66k). The same tests, written as
-- comparisons, build none; what they accept and which rows are linked, and how, is unchanged.
--
-- The CHECKs are edited in the schema's text (SQLite's documented way to change a CHECK
-- without rewriting the table: every row met the old one, and the new one is the same test);
-- the migrator bumps the schema cookie after a migration that does so, so every connection
-- reads the new text.
PRAGMA writable_schema = ON;
UPDATE sqlite_master SET sql = replace(replace(sql,
    'CHECK (effect IN (''idempotent'', ''queryable'', ''unsafe'',
                         ''readonly'', ''transactional''))',
    'CHECK (effect = ''idempotent'' OR effect = ''queryable'' OR effect = ''unsafe''
                         OR effect = ''readonly'' OR effect = ''transactional'')'),
    'CHECK (state IN (''AWAITING_APPROVAL'', ''DISPATCHED'',
                         ''COMPLETED'', ''FAILED'', ''INDETERMINATE'', ''RESOLVED_LANDED'',
                         ''RESOLVED_NOT_LANDED''))',
    'CHECK (state = ''AWAITING_APPROVAL'' OR state = ''DISPATCHED''
                         OR state = ''COMPLETED'' OR state = ''FAILED'' OR state = ''INDETERMINATE''
                         OR state = ''RESOLVED_LANDED'' OR state = ''RESOLVED_NOT_LANDED'')')
WHERE type = 'table' AND name = 'intents';
PRAGMA writable_schema = OFF;
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
