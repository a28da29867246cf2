-- poimen intent log, SQLite dialect, version 3: delivery is per notifier.
-- Each outbox row is written for the notifiers of the process that wrote it, one row here
-- per notifier ('*': any notifier, for a writer that had none); a kernel delivers only to
-- its own notifiers. The outbox row counts as delivered once every row here is.
CREATE TABLE deliveries (
    notification_id INTEGER NOT NULL REFERENCES outbox (id),
    notifier        TEXT NOT NULL,
    delivered_at    REAL,
    attempts        INTEGER NOT NULL DEFAULT 0,
    last_error      TEXT,
    next_attempt_at REAL NOT NULL,
    PRIMARY KEY (notification_id, notifier)
) WITHOUT ROWID;
CREATE INDEX deliveries_pending ON deliveries (next_attempt_at) WHERE delivered_at IS NULL;

-- Rows written before version 3 named no notifier: any kernel that has some delivers them.
INSERT INTO deliveries (notification_id, notifier, attempts, last_error, next_attempt_at)
    SELECT id, '*', attempts, last_error, next_attempt_at FROM outbox WHERE delivered_at IS NULL;
