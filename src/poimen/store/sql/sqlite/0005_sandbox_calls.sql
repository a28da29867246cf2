-- poimen intent log, SQLite dialect, version 5: what a sandbox kernel (shadow or replay mode)
-- answered instead of dispatching. These rows are not intents: recovery never reads this
-- table, so nothing recorded here can ever be dispatched, by this kernel or a live one that
-- opens the log later. A row is never changed.
CREATE TABLE sandbox_calls (
    id         TEXT PRIMARY KEY,
    call_id    TEXT NOT NULL UNIQUE,
    mode       TEXT NOT NULL CHECK (mode IN ('shadow', 'replay')),
    tool_id    TEXT NOT NULL,
    effect     TEXT NOT NULL CHECK (effect IN ('idempotent', 'queryable', 'unsafe',
                   'readonly')),
    args       TEXT NOT NULL,
    args_hash  TEXT NOT NULL,
    answer     TEXT NOT NULL CHECK (answer IN ('recorded', 'live', 'would_have_called',
                   'not_in_recording', 'refused')),
    source     TEXT,
    outcome    TEXT,
    divergence TEXT,
    created_at REAL NOT NULL
) WITHOUT ROWID;

CREATE TRIGGER sandbox_calls_append_only_u BEFORE UPDATE ON sandbox_calls
BEGIN SELECT RAISE(ABORT, 'sandbox_calls are append-only'); END;
CREATE TRIGGER sandbox_calls_append_only_d BEFORE DELETE ON sandbox_calls
BEGIN SELECT RAISE(ABORT, 'sandbox_calls are append-only'); END;
