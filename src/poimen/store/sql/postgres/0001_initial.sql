-- poimen intent log, PostgreSQL dialect, version 1. Same tables as the SQLite dialect.
-- Times are seconds since the epoch by the database server's clock (DOUBLE PRECISION).
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
    fence            BIGINT NOT NULL,
    owner_id         TEXT,
    owner_host       TEXT,
    owner_pid        INTEGER,
    owner_start      TEXT,
    lease_expires_at DOUBLE PRECISION,
    timeout_s        DOUBLE PRECISION NOT NULL,
    deadline_at      DOUBLE PRECISION,
    next_check_at    DOUBLE PRECISION,
    unknown_count    INTEGER NOT NULL DEFAULT 0,
    attempts         INTEGER NOT NULL DEFAULT 0,
    result           TEXT,
    error            TEXT,
    reason           TEXT,
    created_at       DOUBLE PRECISION NOT NULL,
    updated_at       DOUBLE PRECISION NOT NULL
);

-- Recovery reads only unfinished intents: its cost follows them, not the log's size.
CREATE INDEX intents_unfinished ON intents (id) WHERE state = 'DISPATCHED';
CREATE INDEX intents_indeterminate ON intents (updated_at) WHERE state = 'INDETERMINATE';
CREATE INDEX intents_tool_created ON intents (tool_id, created_at);
CREATE INDEX intents_created ON intents (created_at);

CREATE TABLE attempts (
    intent_id    TEXT NOT NULL REFERENCES intents (id),
    number       INTEGER NOT NULL,
    fence        BIGINT NOT NULL,
    owner_id     TEXT,
    owner_host   TEXT,
    owner_pid    INTEGER,
    owner_start  TEXT,
    started_at   DOUBLE PRECISION NOT NULL,
    ended_at     DOUBLE PRECISION,
    outcome      TEXT CHECK (outcome IN ('completed', 'failed', 'unknown')),
    result       TEXT,
    error        TEXT,
    late_outcome TEXT,
    late_result  TEXT,
    PRIMARY KEY (intent_id, number),
    UNIQUE (intent_id, fence)
);

CREATE TABLE events (
    id         BIGINT GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    intent_id  TEXT NOT NULL,
    at         DOUBLE PRECISION NOT NULL,
    kind       TEXT NOT NULL,
    from_state TEXT,
    to_state   TEXT,
    actor      TEXT NOT NULL,
    detail     TEXT
);
CREATE INDEX events_intent ON events (intent_id, id);

CREATE TABLE outbox (
    id              BIGINT GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    delivery_id     TEXT NOT NULL UNIQUE,
    intent_id       TEXT NOT NULL,
    kind            TEXT NOT NULL,
    payload         TEXT NOT NULL,
    created_at      DOUBLE PRECISION NOT NULL,
    delivered_at    DOUBLE PRECISION,
    attempts        INTEGER NOT NULL DEFAULT 0,
    next_attempt_at DOUBLE PRECISION NOT NULL,
    last_error      TEXT
);
CREATE INDEX outbox_pending ON outbox (next_attempt_at) WHERE delivered_at IS NULL;

CREATE TABLE denials (
    id        BIGINT GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    at        DOUBLE PRECISION NOT NULL,
    tool_id   TEXT NOT NULL,
    intent_id TEXT,
    attempt   INTEGER,
    action    TEXT NOT NULL,
    target    TEXT NOT NULL,
    reason    TEXT NOT NULL
);
CREATE INDEX denials_tool ON denials (tool_id, at);

-- The history is append-only: an auditor must be able to trust it.
CREATE FUNCTION poimen_append_only() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    RAISE EXCEPTION '% are append-only', TG_TABLE_NAME USING ERRCODE = 'restrict_violation';
END;
$$;
CREATE TRIGGER events_append_only BEFORE UPDATE OR DELETE ON events
    FOR EACH ROW EXECUTE FUNCTION poimen_append_only();
CREATE TRIGGER events_append_only_t BEFORE TRUNCATE ON events
    FOR EACH STATEMENT EXECUTE FUNCTION poimen_append_only();
CREATE TRIGGER denials_append_only BEFORE UPDATE OR DELETE ON denials
    FOR EACH ROW EXECUTE FUNCTION poimen_append_only();
CREATE TRIGGER denials_append_only_t BEFORE TRUNCATE ON denials
    FOR EACH STATEMENT EXECUTE FUNCTION poimen_append_only();
