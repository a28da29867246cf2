-- poimen intent log, PostgreSQL dialect, version 10: a tamper-evident audit (docs/audit.md).
-- Every event and denial, each intent once it is settled, and each prune's record carries a
-- link of the log's one hash chain: chain_seq, its position in commit order, and chain_hash,
-- SHA-256 over (the previous link's hash || the row's canonical bytes). audit_head holds the
-- last link; each chained write moves it, and so holds its row lock until it commits: the
-- chain stays one line however many processes write. The triggers below make the links,
-- whatever code writes the rows; poimen_audit_bytes is the PL/pgSQL copy of
-- poimen._core.audit.row_bytes (a test checks that the two agree).
CREATE TABLE audit_head (
    id     INTEGER PRIMARY KEY CHECK (id = 1),
    log_id TEXT NOT NULL,
    seq    BIGINT NOT NULL,
    hash   TEXT NOT NULL
);
INSERT INTO audit_head (id, log_id, seq, hash)
    VALUES (1, md5(random()::text || clock_timestamp()::text), 0, repeat('0', 64));

ALTER TABLE events ADD COLUMN chain_seq BIGINT, ADD COLUMN chain_hash TEXT;
ALTER TABLE denials ADD COLUMN chain_seq BIGINT, ADD COLUMN chain_hash TEXT;
ALTER TABLE intents ADD COLUMN chain_seq BIGINT, ADD COLUMN chain_hash TEXT;

-- What a prune removed from the chain: runs of positions ([first, last, hash of last], JSON),
-- so the chain is still checked across them. Chained itself, never changed or removed.
CREATE TABLE audit_pruned (
    id         BIGINT GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    at         DOUBLE PRECISION NOT NULL,
    ranges     TEXT NOT NULL,
    rows       BIGINT NOT NULL,
    chain_seq  BIGINT,
    chain_hash TEXT
);
CREATE FUNCTION poimen_audit_never() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    RAISE EXCEPTION '% is append-only', TG_TABLE_NAME USING ERRCODE = 'restrict_violation';
END;
$$;
CREATE TRIGGER audit_pruned_append_only BEFORE UPDATE OR DELETE ON audit_pruned
    FOR EACH ROW EXECUTE FUNCTION poimen_audit_never();
CREATE TRIGGER audit_pruned_append_only_t BEFORE TRUNCATE ON audit_pruned
    FOR EACH STATEMENT EXECUTE FUNCTION poimen_audit_never();

-- A row's canonical bytes: its kind, then each column: NULL 00; text 01, its UTF-8 length
-- (4 bytes) and bytes; integer 02, 8 bytes; float 03, IEEE 754 double; all big-endian.
CREATE FUNCTION poimen_audit_t(v TEXT) RETURNS BYTEA LANGUAGE sql IMMUTABLE AS $$
    SELECT CASE WHEN v IS NULL THEN decode('00', 'hex') ELSE decode('01', 'hex')
        || int4send(octet_length(convert_to(v, 'UTF8'))) || convert_to(v, 'UTF8') END
$$;
CREATE FUNCTION poimen_audit_i(v BIGINT) RETURNS BYTEA LANGUAGE sql IMMUTABLE AS $$
    SELECT CASE WHEN v IS NULL THEN decode('00', 'hex') ELSE decode('02', 'hex') || int8send(v) END
$$;
CREATE FUNCTION poimen_audit_f(v DOUBLE PRECISION) RETURNS BYTEA LANGUAGE sql IMMUTABLE AS $$
    SELECT CASE WHEN v IS NULL THEN decode('00', 'hex') ELSE decode('03', 'hex') || float8send(v)
        END
$$;
CREATE FUNCTION poimen_audit_bytes(r events) RETURNS BYTEA LANGUAGE sql STABLE AS $$
    SELECT poimen_audit_t('event') || poimen_audit_i(r.id) || poimen_audit_t(r.intent_id)
        || poimen_audit_f(r.at) || poimen_audit_t(r.kind) || poimen_audit_t(r.from_state)
        || poimen_audit_t(r.to_state) || poimen_audit_t(r.actor) || poimen_audit_t(r.detail)
$$;
CREATE FUNCTION poimen_audit_bytes(r denials) RETURNS BYTEA LANGUAGE sql STABLE AS $$
    SELECT poimen_audit_t('denial') || poimen_audit_i(r.id) || poimen_audit_f(r.at)
        || poimen_audit_t(r.tool_id) || poimen_audit_t(r.intent_id) || poimen_audit_i(r.attempt)
        || poimen_audit_t(r.action) || poimen_audit_t(r.target) || poimen_audit_t(r.reason)
$$;
CREATE FUNCTION poimen_audit_bytes(r audit_pruned) RETURNS BYTEA LANGUAGE sql STABLE AS $$
    SELECT poimen_audit_t('pruned') || poimen_audit_i(r.id) || poimen_audit_f(r.at)
        || poimen_audit_t(r.ranges) || poimen_audit_i(r.rows)
$$;
CREATE FUNCTION poimen_audit_bytes(r intents) RETURNS BYTEA LANGUAGE sql STABLE AS $$
    SELECT poimen_audit_t('intent') || poimen_audit_t(r.id) || poimen_audit_t(r.call_id)
        || poimen_audit_t(r.tool_id) || poimen_audit_t(r.effect) || poimen_audit_t(r.args)
        || poimen_audit_t(r.args_hash) || poimen_audit_t(r.key) || poimen_audit_t(r.request_id)
        || poimen_audit_t(r.state) || poimen_audit_i(r.fence) || poimen_audit_t(r.owner_id)
        || poimen_audit_t(r.owner_host) || poimen_audit_i(r.owner_pid)
        || poimen_audit_t(r.owner_start) || poimen_audit_f(r.lease_expires_at)
        || poimen_audit_f(r.timeout_s) || poimen_audit_f(r.deadline_at)
        || poimen_audit_f(r.next_check_at) || poimen_audit_i(r.unknown_count)
        || poimen_audit_i(r.attempts) || poimen_audit_t(r.result) || poimen_audit_t(r.error)
        || poimen_audit_t(r.reason) || poimen_audit_f(r.created_at)
        || poimen_audit_f(r.updated_at) || poimen_audit_t(r.scope)
$$;

-- The link of the row being written; the head's row lock is held until the transaction
-- ends, so links are made one transaction at a time, in commit order. No head row: no chain.
CREATE FUNCTION poimen_audit_link() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    UPDATE audit_head SET seq = seq + 1,
        hash = encode(sha256(decode(hash, 'hex') || poimen_audit_bytes(NEW)), 'hex')
        RETURNING seq, hash INTO NEW.chain_seq, NEW.chain_hash;
    IF NOT FOUND THEN
        NEW.chain_seq := NULL;
        NEW.chain_hash := NULL;
    END IF;
    RETURN NEW;
END;
$$;
CREATE TRIGGER events_chain BEFORE INSERT ON events
    FOR EACH ROW EXECUTE FUNCTION poimen_audit_link();
CREATE TRIGGER denials_chain BEFORE INSERT ON denials
    FOR EACH ROW EXECUTE FUNCTION poimen_audit_link();
CREATE TRIGGER audit_pruned_chain BEFORE INSERT ON audit_pruned
    FOR EACH ROW EXECUTE FUNCTION poimen_audit_link();
-- An intent is chained once, when it is settled for good: its row no longer changes then
-- (but for where its history is kept, inline_history, which is not hashed). poimen never
-- inserts an intent settled: one inserted so is a row without a link.
CREATE TRIGGER intents_chain_settle BEFORE UPDATE ON intents FOR EACH ROW
    WHEN (OLD.state NOT IN ('COMPLETED', 'FAILED', 'RESOLVED_LANDED', 'RESOLVED_NOT_LANDED')
        AND NEW.state IN ('COMPLETED', 'FAILED', 'RESOLVED_LANDED', 'RESOLVED_NOT_LANDED'))
    EXECUTE FUNCTION poimen_audit_link();

-- The history written before this version joins the chain now, oldest first.
ALTER TABLE events DISABLE TRIGGER events_append_only;
ALTER TABLE denials DISABLE TRIGGER denials_append_only;
DO $$
DECLARE
    r RECORD;
    s BIGINT;
    h TEXT;
BEGIN
    FOR r IN
        SELECT kind, ref FROM (
            SELECT 'intent' AS kind, id AS ref, updated_at AS t, 0 AS o, 0::BIGINT AS n
                FROM intents WHERE state IN ('COMPLETED', 'FAILED', 'RESOLVED_LANDED',
                                             'RESOLVED_NOT_LANDED')
            UNION ALL SELECT 'event', id::TEXT, at, 1, id FROM events
            UNION ALL SELECT 'denial', id::TEXT, at, 2, id FROM denials
        ) x ORDER BY t, o, n, ref
    LOOP
        IF r.kind = 'event' THEN
            UPDATE audit_head SET seq = seq + 1, hash = encode(sha256(decode(hash, 'hex')
                || (SELECT poimen_audit_bytes(e) FROM events e WHERE e.id = r.ref::BIGINT)),
                'hex') RETURNING seq, hash INTO s, h;
            UPDATE events SET chain_seq = s, chain_hash = h WHERE id = r.ref::BIGINT;
        ELSIF r.kind = 'denial' THEN
            UPDATE audit_head SET seq = seq + 1, hash = encode(sha256(decode(hash, 'hex')
                || (SELECT poimen_audit_bytes(d) FROM denials d WHERE d.id = r.ref::BIGINT)),
                'hex') RETURNING seq, hash INTO s, h;
            UPDATE denials SET chain_seq = s, chain_hash = h WHERE id = r.ref::BIGINT;
        ELSE
            UPDATE audit_head SET seq = seq + 1, hash = encode(sha256(decode(hash, 'hex')
                || (SELECT poimen_audit_bytes(i) FROM intents i WHERE i.id = r.ref)),
                'hex') RETURNING seq, hash INTO s, h;
            UPDATE intents SET chain_seq = s, chain_hash = h WHERE id = r.ref;
        END IF;
    END LOOP;
END;
$$;
ALTER TABLE events ENABLE TRIGGER events_append_only;
ALTER TABLE denials ENABLE TRIGGER denials_append_only;
