-- poimen intent log, SQLite dialect, version 4: a read-only effect class and calls awaiting
-- an operator's approval. SQLite cannot change a CHECK constraint in place: the intents table
-- is copied into one that allows the new values (the same columns, the same clustering).
PRAGMA defer_foreign_keys = ON;

CREATE TABLE intents_v4 (
    id               TEXT PRIMARY KEY,
    call_id          TEXT NOT NULL UNIQUE,
    tool_id          TEXT NOT NULL,
    effect           TEXT NOT NULL CHECK (effect IN ('idempotent', 'queryable', 'unsafe',
                         'readonly')),
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
    updated_at       REAL NOT NULL
) WITHOUT ROWID;
INSERT INTO intents_v4 SELECT id, call_id, tool_id, effect, args, args_hash, key, request_id,
    state, fence, owner_id, owner_host, owner_pid, owner_start, lease_expires_at, timeout_s,
    deadline_at, next_check_at, unknown_count, attempts, result, error, reason, created_at,
    updated_at FROM intents;

-- attempts refers to intents: it is copied too, referring to the new table.
CREATE TABLE attempts_v4 (
    intent_id    TEXT NOT NULL REFERENCES intents_v4 (id),
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
INSERT INTO attempts_v4 SELECT intent_id, number, fence, owner_id, owner_host, owner_pid,
    owner_start, started_at, ended_at, outcome, result, error, late_outcome, late_result
    FROM attempts;

DROP TABLE attempts;
DROP TABLE intents;
ALTER TABLE intents_v4 RENAME TO intents;
ALTER TABLE attempts_v4 RENAME TO attempts;

CREATE INDEX intents_unfinished ON intents (id) WHERE state = 'DISPATCHED';
CREATE INDEX intents_indeterminate ON intents (id) WHERE state = 'INDETERMINATE';
CREATE INDEX intents_awaiting ON intents (id) WHERE state = 'AWAITING_APPROVAL';
