-- poimen intent log, SQLite dialect, version 2: a call writes fewer pages per commit.
-- Every B-tree a call touches is one more page in the write-ahead log at each commit, so the
-- call path keeps only what deduplication, recovery and the history need:
--   intents and attempts are clustered on their primary key (WITHOUT ROWID: no separate
--   key index); listing orders by intent id, which starts with the creation time, so the
--   created_at and (tool_id, created_at) indexes go; attempts are found by intent, so the
--   (intent_id, fence) index goes; event ids stay increasing without AUTOINCREMENT's
--   sqlite_sequence row, because events are never deleted.
PRAGMA defer_foreign_keys = ON;

CREATE TABLE intents_v2 (
    id               TEXT PRIMARY KEY,
    call_id          TEXT NOT NULL UNIQUE,
    tool_id          TEXT NOT NULL,
    effect           TEXT NOT NULL CHECK (effect IN ('idempotent', 'queryable', 'unsafe')),
    args             TEXT NOT NULL,
    args_hash        TEXT NOT NULL,
    key              TEXT,
    request_id       TEXT,
    state            TEXT NOT NULL CHECK (state IN ('DISPATCHED', 'COMPLETED', 'FAILED',
                         'INDETERMINATE', 'RESOLVED_LANDED', 'RESOLVED_NOT_LANDED')),
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
INSERT INTO intents_v2 SELECT id, call_id, tool_id, effect, args, args_hash, key, request_id,
    state, fence, owner_id, owner_host, owner_pid, owner_start, lease_expires_at, timeout_s,
    deadline_at, next_check_at, unknown_count, attempts, result, error, reason, created_at,
    updated_at FROM intents;

-- Refers to intents_v2, renamed with it: a reference to the old table would count its
-- rows as orphans when that table is dropped.
CREATE TABLE attempts_v2 (
    intent_id    TEXT NOT NULL REFERENCES intents_v2 (id),
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
INSERT INTO attempts_v2 SELECT intent_id, number, fence, owner_id, owner_host, owner_pid,
    owner_start, started_at, ended_at, outcome, result, error, late_outcome, late_result
    FROM attempts;

CREATE TABLE events_v2 (
    id         INTEGER PRIMARY KEY,
    intent_id  TEXT NOT NULL,
    at         REAL NOT NULL,
    kind       TEXT NOT NULL,
    from_state TEXT,
    to_state   TEXT,
    actor      TEXT NOT NULL,
    detail     TEXT
);
INSERT INTO events_v2 SELECT id, intent_id, at, kind, from_state, to_state, actor, detail
    FROM events;

DROP TABLE events;
DROP TABLE attempts;
DROP TABLE intents;
ALTER TABLE intents_v2 RENAME TO intents;
ALTER TABLE attempts_v2 RENAME TO attempts;
ALTER TABLE events_v2 RENAME TO events;

-- Recovery reads only unfinished intents: its cost follows them, not the log's size.
CREATE INDEX intents_unfinished ON intents (id) WHERE state = 'DISPATCHED';
CREATE INDEX intents_indeterminate ON intents (id) WHERE state = 'INDETERMINATE';
CREATE INDEX events_intent ON events (intent_id, id);

-- The history is append-only: an auditor must be able to trust it.
CREATE TRIGGER events_append_only_u BEFORE UPDATE ON events
BEGIN SELECT RAISE(ABORT, 'events are append-only'); END;
CREATE TRIGGER events_append_only_d BEFORE DELETE ON events
BEGIN SELECT RAISE(ABORT, 'events are append-only'); END;
