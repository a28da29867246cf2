-- poimen intent log, SQLite dialect, version 7: a call that dispatches and settles without
-- incident writes one row per commit. Its attempt 1 (fence 1, the owner, started at
-- created_at, ended at updated_at once settled) and its two events (dispatched, then
-- completed or failed) are read from the intent row itself while inline_history = 1; the
-- first write that deviates from that path (a claim, an unknown outcome, a deferral, an
-- event of any kind...) first copies them into attempts and events and sets it to 0, then
-- writes as before. Rows written before version 7 keep their history in those tables (0).
ALTER TABLE intents ADD COLUMN inline_history INTEGER NOT NULL DEFAULT 0;
