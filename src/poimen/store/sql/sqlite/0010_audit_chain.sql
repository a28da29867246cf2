-- poimen intent log, SQLite dialect, version 10: a tamper-evident audit (docs/audit.md).
-- Every event and denial, each intent once it is settled, and each prune's record carries a
-- link of the log's one hash chain: chain_seq, its position in commit order, and chain_hash,
-- SHA-256 over (the previous link's hash || the row's canonical bytes). audit_head holds the
-- last link; each chained write moves it inside its own transaction (SQLite has one writer
-- at a time), so the chain is one line. The triggers below make the links, whatever code
-- writes the rows: they call poimen_link(previous hash, kind, columns...), which the store's
-- writer connection provides (poimen._core.audit.sqlite_link, the one definition of the bytes).
CREATE TABLE audit_head (
    id     INTEGER PRIMARY KEY CHECK (id = 1),
    log_id TEXT NOT NULL,
    seq    INTEGER NOT NULL,
    hash   TEXT NOT NULL
);
INSERT INTO audit_head (id, log_id, seq, hash)
    VALUES (1, lower(hex(randomblob(16))), 0, substr(hex(zeroblob(32)), 1, 64));

ALTER TABLE events ADD COLUMN chain_seq INTEGER;
ALTER TABLE events ADD COLUMN chain_hash TEXT;
ALTER TABLE denials ADD COLUMN chain_seq INTEGER;
ALTER TABLE denials ADD COLUMN chain_hash TEXT;
ALTER TABLE intents ADD COLUMN chain_seq INTEGER;
ALTER TABLE intents ADD COLUMN chain_hash TEXT;

-- What a prune removed from the chain: runs of positions ([first, last, hash of last], JSON),
-- so the chain is still checked across them. Chained itself, never changed or removed.
CREATE TABLE audit_pruned (
    id         INTEGER PRIMARY KEY,
    at         REAL NOT NULL,
    ranges     TEXT NOT NULL,
    rows       INTEGER NOT NULL,
    chain_seq  INTEGER,
    chain_hash TEXT
);
CREATE TRIGGER audit_pruned_append_only_u BEFORE UPDATE OF id, at, ranges, rows ON audit_pruned
BEGIN SELECT RAISE(ABORT, 'audit_pruned is append-only'); END;
CREATE TRIGGER audit_pruned_append_only_d BEFORE DELETE ON audit_pruned
BEGIN SELECT RAISE(ABORT, 'audit_pruned is append-only'); END;

-- Events and denials stay append-only; their link is written once, by the triggers below.
DROP TRIGGER events_append_only_u;
CREATE TRIGGER events_append_only_u
BEFORE UPDATE OF id, intent_id, at, kind, from_state, to_state, actor, detail ON events
BEGIN SELECT RAISE(ABORT, 'events are append-only'); END;
DROP TRIGGER denials_append_only_u;
CREATE TRIGGER denials_append_only_u
BEFORE UPDATE OF id, at, tool_id, intent_id, attempt, action, target, reason ON denials
BEGIN SELECT RAISE(ABORT, 'denials are append-only'); END;
CREATE TRIGGER events_link_once BEFORE UPDATE OF chain_seq, chain_hash ON events
WHEN OLD.chain_seq IS NOT NULL
BEGIN SELECT RAISE(ABORT, 'events are append-only'); END;
CREATE TRIGGER denials_link_once BEFORE UPDATE OF chain_seq, chain_hash ON denials
WHEN OLD.chain_seq IS NOT NULL
BEGIN SELECT RAISE(ABORT, 'denials are append-only'); END;
CREATE TRIGGER audit_pruned_link_once BEFORE UPDATE OF chain_seq, chain_hash ON audit_pruned
WHEN OLD.chain_seq IS NOT NULL
BEGIN SELECT RAISE(ABORT, 'audit_pruned is append-only'); END;

-- The links. No head row: no chain (a log whose chain was turned off).
CREATE TRIGGER events_chain AFTER INSERT ON events
WHEN EXISTS (SELECT 1 FROM audit_head)
BEGIN
    UPDATE audit_head SET seq = seq + 1, hash = poimen_link(hash, 'event', NEW.id,
        NEW.intent_id, NEW.at, NEW.kind, NEW.from_state, NEW.to_state, NEW.actor, NEW.detail);
    UPDATE events SET chain_seq = (SELECT seq FROM audit_head),
        chain_hash = (SELECT hash FROM audit_head) WHERE id = NEW.id;
END;
CREATE TRIGGER denials_chain AFTER INSERT ON denials
WHEN EXISTS (SELECT 1 FROM audit_head)
BEGIN
    UPDATE audit_head SET seq = seq + 1, hash = poimen_link(hash, 'denial', NEW.id, NEW.at,
        NEW.tool_id, NEW.intent_id, NEW.attempt, NEW.action, NEW.target, NEW.reason);
    UPDATE denials SET chain_seq = (SELECT seq FROM audit_head),
        chain_hash = (SELECT hash FROM audit_head) WHERE id = NEW.id;
END;
CREATE TRIGGER audit_pruned_chain AFTER INSERT ON audit_pruned
WHEN EXISTS (SELECT 1 FROM audit_head)
BEGIN
    UPDATE audit_head SET seq = seq + 1,
        hash = poimen_link(hash, 'pruned', NEW.id, NEW.at, NEW.ranges, NEW.rows);
    UPDATE audit_pruned SET chain_seq = (SELECT seq FROM audit_head),
        chain_hash = (SELECT hash FROM audit_head) WHERE id = NEW.id;
END;
-- An intent is chained once, when it is settled for good: its row no longer changes then
-- (but for where its history is kept, inline_history, which is not hashed). poimen never
-- inserts an intent settled: one inserted so is a row without a link.
CREATE TRIGGER intents_chain_settle AFTER UPDATE OF state ON intents
WHEN OLD.state NOT IN ('COMPLETED', 'FAILED', 'RESOLVED_LANDED', 'RESOLVED_NOT_LANDED')
    AND NEW.state IN ('COMPLETED', 'FAILED', 'RESOLVED_LANDED', 'RESOLVED_NOT_LANDED')
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

-- The history written before this version joins the chain now, oldest first: each row of
-- audit_seal, in order, links the row it names (its triggers), then the table goes.
CREATE TABLE audit_seal (n INTEGER PRIMARY KEY, kind TEXT NOT NULL, ref TEXT NOT NULL);
CREATE TRIGGER audit_seal_event AFTER INSERT ON audit_seal WHEN NEW.kind = 'event'
BEGIN
    UPDATE audit_head SET seq = seq + 1, hash = (SELECT poimen_link(audit_head.hash, 'event',
        e.id, e.intent_id, e.at, e.kind, e.from_state, e.to_state, e.actor, e.detail)
        FROM events e WHERE e.id = CAST(NEW.ref AS INTEGER));
    UPDATE events SET chain_seq = (SELECT seq FROM audit_head),
        chain_hash = (SELECT hash FROM audit_head) WHERE id = CAST(NEW.ref AS INTEGER);
END;
CREATE TRIGGER audit_seal_denial AFTER INSERT ON audit_seal WHEN NEW.kind = 'denial'
BEGIN
    UPDATE audit_head SET seq = seq + 1, hash = (SELECT poimen_link(audit_head.hash, 'denial',
        d.id, d.at, d.tool_id, d.intent_id, d.attempt, d.action, d.target, d.reason)
        FROM denials d WHERE d.id = CAST(NEW.ref AS INTEGER));
    UPDATE denials SET chain_seq = (SELECT seq FROM audit_head),
        chain_hash = (SELECT hash FROM audit_head) WHERE id = CAST(NEW.ref AS INTEGER);
END;
CREATE TRIGGER audit_seal_intent AFTER INSERT ON audit_seal WHEN NEW.kind = 'intent'
BEGIN
    UPDATE audit_head SET seq = seq + 1, hash = (SELECT poimen_link(audit_head.hash, 'intent',
        i.id, i.call_id, i.tool_id, i.effect, i.args, i.args_hash, i.key, i.request_id,
        i.state, i.fence, i.owner_id, i.owner_host, i.owner_pid, i.owner_start,
        i.lease_expires_at, i.timeout_s, i.deadline_at, i.next_check_at, i.unknown_count,
        i.attempts, i.result, i.error, i.reason, i.created_at, i.updated_at, i.scope)
        FROM intents i WHERE i.id = NEW.ref);
    UPDATE intents SET chain_seq = (SELECT seq FROM audit_head),
        chain_hash = (SELECT hash FROM audit_head) WHERE id = NEW.ref;
END;
INSERT INTO audit_seal (kind, ref)
    SELECT kind, ref FROM (
        SELECT 'intent' AS kind, id AS ref, updated_at AS t, 0 AS o, 0 AS n FROM intents
            WHERE state IN ('COMPLETED', 'FAILED', 'RESOLVED_LANDED', 'RESOLVED_NOT_LANDED')
        UNION ALL SELECT 'event', CAST(id AS TEXT), at, 1, id FROM events
        UNION ALL SELECT 'denial', CAST(id AS TEXT), at, 2, id FROM denials
    ) ORDER BY t, o, n, ref;
DROP TABLE audit_seal;
