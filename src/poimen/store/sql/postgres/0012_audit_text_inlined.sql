-- poimen intent log, PostgreSQL dialect, version 12: the chain's text encoder is declared
-- STABLE, as convert_to (which it calls) is. Declared IMMUTABLE, PostgreSQL never inlined it
-- and ran it as a SQL function of its own, planned again for each of the 11 to 15 texts a row
-- has (and, as IMMUTABLE over a constant, once more while planning the trigger's UPDATE):
-- about 0.9 ms of server CPU per settled intent, taken while the chain's head is locked. Inlined,
-- a settle costs about a fifth of that (docs/performance.md). The bytes are the same.
CREATE OR REPLACE FUNCTION poimen_audit_t(v TEXT) RETURNS BYTEA LANGUAGE sql STABLE AS $$
    SELECT CASE WHEN v IS NULL THEN decode('00', 'hex') ELSE decode('01', 'hex')
        || int4send(octet_length(convert_to(v, 'UTF8'))) || convert_to(v, 'UTF8') END
$$;
