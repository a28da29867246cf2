-- poimen intent log, PostgreSQL dialect, version 13 (PostgreSQL only: SQLite's chain is made
-- by a function of the connection, with no plan to cache). The chain's trigger plans its
-- UPDATE of the head once per session. With the plan cache's default choice it planned it
-- again on every settle: a custom plan, with NEW's columns as constants, is estimated cheaper
-- than the generic one, and planning it inlines the row's bytes (some 30 SQL functions) each
-- time, about 0.5 ms of server CPU per settled intent under the head's lock
-- (docs/performance.md). The bytes and the links are the same.
ALTER FUNCTION poimen_audit_link() SET plan_cache_mode = force_generic_plan;
