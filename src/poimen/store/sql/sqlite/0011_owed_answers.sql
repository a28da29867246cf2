-- poimen intent log, SQLite dialect, version 11: an answer owed (docs/design.md section 4). A
-- recovery pass that takes an intent of a scope over marks its answer owed: its caller is
-- gone, or was answered Pending. The first call that is answered with its settled outcome (its
-- own call id, an alias, or an identical call in the scope, which becomes its alias) takes it,
-- and clears the mark. The column is bookkeeping, not history: the audit chain does not hash
-- it, so clearing it on a settled row breaks no link.
ALTER TABLE intents ADD COLUMN answer_owed INTEGER NOT NULL DEFAULT 0;
CREATE INDEX intents_owed_answer ON intents (scope, tool_id, args_hash) WHERE answer_owed = 1;
