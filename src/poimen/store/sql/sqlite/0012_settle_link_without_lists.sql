-- poimen intent log, SQLite dialect, version 12: the same rules, cheaper to check. SQLite 3.40
-- codes an IN list of three or more constants as a temporary b-tree, built again for each row
-- a statement checks: the intents CHECKs of effect and state built two on every dispatch and
-- one on every settle, the settle trigger's WHEN two more (about 170k of the 660k instructions
-- a call's two commits took, bench.instructions). The same tests written as comparisons build
-- none; what they accept, and which rows are linked and how, is unchanged (state and effect
-- are NOT NULL). SQLite cannot change a CHECK in place (editing sqlite_master is refused in
-- defensive mode): intents, and attempts, which refers to it, are copied into tables with the
-- same columns in the same order, every row as it was, links included (the chain hashes the
-- values, not where they are kept).
PRAGMA defer_foreign_keys = ON;

CREATE TABLE intents_v12 (
    id               TEXT PRIMARY KEY,
    call_id          TEXT NOT NULL UNIQUE,
    tool_id          TEXT NOT NULL,
    effect           TEXT NOT NULL CHECK (effect = 'idempotent' OR effect = 'queryable'
                         OR effect = 'unsafe' OR effect = 'readonly'
                         OR effect = 'transactional'),
    args             TEXT NOT NULL,
    args_hash        TEXT NOT NULL,
    key              TEXT,
    request_id       TEXT,
    state            TEXT NOT NULL CHECK (state = 'AWAITING_APPROVAL' OR state = 'DISPATCHED'
                         OR state = 'COMPLETED' OR state = 'FAILED'
                         OR state = 'INDETERMINATE' OR state = 'RESOLVED_LANDED'
                         OR state = 'RESOLVED_NOT_LANDED'),
    fence            INTEGER NOT NULL,
    owner_id         TEXT,
    owner_host       TEXT,
    owner_pid        INTEGER,
    owner_start      TEXT,
    lease_expires_at REAL,
    timeout_s        REAL NOT NULL,
    deadline_at      REAL,
    next_check_at    REAL,
    unknown_count    INTEGER NOT NULL DEFAULT 0,
    attempts         INTEGER NOT NULL DEFAULT 0,
    result           TEXT,
    error            TEXT,
    reason           TEXT,
    created_at       REAL NOT NULL,
    updated_at       REAL NOT NULL,
    inline_history   INTEGER NOT NULL DEFAULT 0,
    scope            TEXT,
    chain_seq        INTEGER,
    chain_hash       TEXT,
    answer_owed      INTEGER NOT NULL DEFAULT 0
) WITHOUT ROWID;
INSERT INTO intents_v12 SELECT id, call_id, tool_id, effect, args, args_hash, key, request_id,
    state, fence, owner_id, owner_host, owner_pid, owner_start, lease_expires_at, timeout_s,
    deadline_at, next_check_at, unknown_count, attempts, result, error, reason, created_at,
    updated_at, inline_history, scope, chain_seq, chain_hash, answer_owed FROM intents;

CREATE TABLE attempts_v12 (
    intent_id    TEXT NOT NULL REFERENCES intents_v12 (id),
    number       INTEGER NOT NULL,
    fence        INTEGER NOT NULL,
    owner_id     TEXT,
    owner_host   TEXT,
    owner_pid    INTEGER,
    owner_start  TEXT,
    started_at   REAL NOT NULL,
    ended_at     REAL,
    outcome      TEXT CHECK (outcome IN ('completed', 'failed', 'unknown')),
    result       TEXT,
    error        TEXT,
    late_outcome TEXT,
    late_result  TEXT,
    PRIMARY KEY (intent_id, number)
) WITHOUT ROWID;
INSERT INTO attempts_v12 SELECT intent_id, number, fence, owner_id, owner_host, owner_pid,
    owner_start, started_at, ended_at, outcome, result, error, late_outcome, late_result
    FROM attempts;

DROP TABLE attempts;
DROP TABLE intents;
ALTER TABLE intents_v12 RENAME TO intents;
ALTER TABLE attempts_v12 RENAME TO attempts;

CREATE INDEX intents_unfinished ON intents (id) WHERE state = 'DISPATCHED';
CREATE INDEX intents_indeterminate ON intents (id) WHERE state = 'INDETERMINATE';
CREATE INDEX intents_awaiting ON intents (id) WHERE state = 'AWAITING_APPROVAL';
CREATE UNIQUE INDEX intents_unsettled_call ON intents (scope, tool_id, args_hash)
    WHERE scope IS NOT NULL AND state IN ('DISPATCHED', 'AWAITING_APPROVAL', 'INDETERMINATE');
CREATE INDEX intents_owed_answer ON intents (scope, tool_id, args_hash) WHERE answer_owed = 1;

-- An intent is chained once, when it is settled for good (version 10's trigger, its WHEN
-- written as comparisons; the table it was on is gone).
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
