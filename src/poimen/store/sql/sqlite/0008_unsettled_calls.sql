-- poimen intent log, SQLite dialect, version 8: an identical call is not dispatched again
-- while the first is unsettled (docs/design.md section 4). A call made in a scope records it;
-- in one scope, at most one intent of a tool with one argument set is DISPATCHED, awaiting
-- approval or INDETERMINATE at a time. A call that found one is an alias of it: its call id
-- answers with that intent from then on. Rows written before version 8 have no scope.
ALTER TABLE intents ADD COLUMN scope TEXT;
CREATE UNIQUE INDEX intents_unsettled_call ON intents (scope, tool_id, args_hash)
    WHERE scope IS NOT NULL AND state IN ('DISPATCHED', 'AWAITING_APPROVAL', 'INDETERMINATE');
CREATE TABLE call_aliases (
    call_id    TEXT PRIMARY KEY,
    intent_id  TEXT NOT NULL,
    created_at REAL NOT NULL
) WITHOUT ROWID;
CREATE INDEX call_aliases_intent ON call_aliases (intent_id);
