-- poimen intent log, PostgreSQL dialect, version 6: retention. Events and denials stay
-- append-only, except for DELETEs inside a prune transaction, which sets the transaction-local
-- setting poimen.pruning: only `poimen prune` deletes history. UPDATE and TRUNCATE are always
-- refused.
CREATE OR REPLACE FUNCTION poimen_append_only() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF TG_OP = 'DELETE' AND current_setting('poimen.pruning', true) = 'on' THEN
        RETURN OLD;
    END IF;
    RAISE EXCEPTION '% are append-only', TG_TABLE_NAME USING ERRCODE = 'restrict_violation';
END;
$$;
