-- poimen intent log, SQLite dialect, version 1.
CREATE TABLE intents (
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
);

-- Recovery reads only unfinished intents: its cost follows them, not the log's size.
CREATE INDEX intents_unfinished ON intents (id) WHERE state = 'DISPATCHED';
CREATE INDEX intents_indeterminate ON intents (updated_at) WHERE state = 'INDETERMINATE';
CREATE INDEX intents_tool_created ON intents (tool_id, created_at);
CREATE INDEX intents_created ON intents (created_at);

CREATE TABLE attempts (
    intent_id    TEXT NOT NULL REFERENCES intents (id),
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
    PRIMARY KEY (intent_id, number),
    UNIQUE (intent_id, fence)
);

CREATE TABLE events (
    id         INTEGER PRIMARY KEY AUTOINCREMENT,
    intent_id  TEXT NOT NULL,
    at         REAL NOT NULL,
    kind       TEXT NOT NULL,
    from_state TEXT,
    to_state   TEXT,
    actor      TEXT NOT NULL,
    detail     TEXT
);
CREATE INDEX events_intent ON events (intent_id, id);

CREATE TABLE outbox (
    id              INTEGER PRIMARY KEY AUTOINCREMENT,
    delivery_id     TEXT NOT NULL UNIQUE,
    intent_id       TEXT NOT NULL,
    kind            TEXT NOT NULL,
    payload         TEXT NOT NULL,
    created_at      REAL NOT NULL,
    delivered_at    REAL,
    attempts        INTEGER NOT NULL DEFAULT 0,
    next_attempt_at REAL NOT NULL,
    last_error      TEXT
);
CREATE INDEX outbox_pending ON outbox (next_attempt_at) WHERE delivered_at IS NULL;

CREATE TABLE denials (
    id        INTEGER PRIMARY KEY AUTOINCREMENT,
    at        REAL NOT NULL,
    tool_id   TEXT NOT NULL,
    intent_id TEXT,
    attempt   INTEGER,
    action    TEXT NOT NULL,
    target    TEXT NOT NULL,
    reason    TEXT NOT NULL
);
CREATE INDEX denials_tool ON denials (tool_id, at);

-- The history is append-only: an auditor must be able to trust it.
CREATE TRIGGER events_append_only_u BEFORE UPDATE ON events
BEGIN SELECT RAISE(ABORT, 'events are append-only'); END;
CREATE TRIGGER events_append_only_d BEFORE DELETE ON events
BEGIN SELECT RAISE(ABORT, 'events are append-only'); END;
CREATE TRIGGER denials_append_only_u BEFORE UPDATE ON denials
BEGIN SELECT RAISE(ABORT, 'denials are append-only'); END;
CREATE TRIGGER denials_append_only_d BEFORE DELETE ON denials
BEGIN SELECT RAISE(ABORT, 'denials are append-only'); END;
