-- poimen intent log, PostgreSQL dialect, version 4: a read-only effect class and calls
-- awaiting an operator's approval.
ALTER TABLE intents DROP CONSTRAINT intents_effect_check;
ALTER TABLE intents ADD CONSTRAINT intents_effect_check
    CHECK (effect IN ('idempotent', 'queryable', 'unsafe', 'readonly'));
ALTER TABLE intents DROP CONSTRAINT intents_state_check;
ALTER TABLE intents ADD CONSTRAINT intents_state_check
    CHECK (state IN ('AWAITING_APPROVAL', 'DISPATCHED', 'COMPLETED', 'FAILED', 'INDETERMINATE',
                     'RESOLVED_LANDED', 'RESOLVED_NOT_LANDED'));
CREATE INDEX intents_awaiting ON intents (id) WHERE state = 'AWAITING_APPROVAL';
