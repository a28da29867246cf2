-- poimen intent log, SQLite dialect, version 9: the Transactional effect class, a tool whose
-- write commits with a marker of its call (docs/design.md section 2). SQLite cannot change a
-- CHECK constraint in place: intents, attempts (which refers to it) and sandbox_calls are
-- copied into tables that allow the new value (the same columns, in the same order).
PRAGMA defer_foreign_keys = ON;

CREATE TABLE intents_v9 (
    id               TEXT PRIMARY KEY,
    call_id          TEXT NOT NULL UNIQUE,
    tool_id          TEXT NOT NULL,
    effect           TEXT NOT NULL CHECK (effect IN ('idempotent', 'queryable', 'unsafe',
                         'readonly', 'transactional')),
    args             TEXT NOT NULL,
    args_hash        TEXT NOT NULL,
    key              TEXT,
    request_id       TEXT,
    state            TEXT NOT NULL CHECK (state IN ('AWAITING_APPROVAL', 'DISPATCHED',
                         'COMPLETED', 'FAILED', 'INDETERMINATE', 'RESOLVED_LANDED',
                         'RESOLVED_NOT_LANDED')),
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
    scope            TEXT
) WITHOUT ROWID;
INSERT INTO intents_v9 SELECT id, call_id, tool_id, effect, args, args_hash, key, request_id,
    state, fence, owner_id, owner_host, owner_pid, owner_start, lease_expires_at, timeout_s,
    deadline_at, next_check_at, unknown_count, attempts, result, error, reason, created_at,
    updated_at, inline_history, scope FROM intents;

CREATE TABLE attempts_v9 (
    intent_id    TEXT NOT NULL REFERENCES intents_v9 (id),
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
INSERT INTO attempts_v9 SELECT intent_id, number, fence, owner_id, owner_host, owner_pid,
    owner_start, started_at, ended_at, outcome, result, error, late_outcome, late_result
    FROM attempts;

DROP TABLE attempts;
DROP TABLE intents;
ALTER TABLE intents_v9 RENAME TO intents;
ALTER TABLE attempts_v9 RENAME TO attempts;

CREATE INDEX intents_unfinished ON intents (id) WHERE state = 'DISPATCHED';
CREATE INDEX intents_indeterminate ON intents (id) WHERE state = 'INDETERMINATE';
CREATE INDEX intents_awaiting ON intents (id) WHERE state = 'AWAITING_APPROVAL';
CREATE UNIQUE INDEX intents_unsettled_call ON intents (scope, tool_id, args_hash)
    WHERE scope IS NOT NULL AND state IN ('DISPATCHED', 'AWAITING_APPROVAL', 'INDETERMINATE');

CREATE TABLE sandbox_calls_v9 (
    id         TEXT PRIMARY KEY,
    call_id    TEXT NOT NULL UNIQUE,
    mode       TEXT NOT NULL CHECK (mode IN ('shadow', 'replay')),
    tool_id    TEXT NOT NULL,
    effect     TEXT NOT NULL CHECK (effect IN ('idempotent', 'queryable', 'unsafe',
                   'readonly', 'transactional')),
    args       TEXT NOT NULL,
    args_hash  TEXT NOT NULL,
    answer     TEXT NOT NULL CHECK (answer IN ('recorded', 'live', 'would_have_called',
                   'not_in_recording', 'refused')),
    source     TEXT,
    outcome    TEXT,
    divergence TEXT,
    created_at REAL NOT NULL
) WITHOUT ROWID;
INSERT INTO sandbox_calls_v9 SELECT id, call_id, mode, tool_id, effect, args, args_hash,
    answer, source, outcome, divergence, created_at FROM sandbox_calls;
DROP TABLE sandbox_calls;
ALTER TABLE sandbox_calls_v9 RENAME TO sandbox_calls;
CREATE TRIGGER sandbox_calls_append_only_u BEFORE UPDATE ON sandbox_calls
BEGIN SELECT RAISE(ABORT, 'sandbox_calls are append-only'); END;
CREATE TRIGGER sandbox_calls_append_only_d BEFORE DELETE ON sandbox_calls
BEGIN SELECT RAISE(ABORT, 'sandbox_calls are append-only'); END;
