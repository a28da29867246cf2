-- poimen intent log, PostgreSQL dialect, version 9: the Transactional effect class, a tool
-- whose write commits with a marker of its call (docs/design.md section 2).
ALTER TABLE intents DROP CONSTRAINT intents_effect_check;
ALTER TABLE intents ADD CONSTRAINT intents_effect_check
    CHECK (effect IN ('idempotent', 'queryable', 'unsafe', 'readonly', 'transactional'));
ALTER TABLE sandbox_calls DROP CONSTRAINT sandbox_calls_effect_check;
ALTER TABLE sandbox_calls ADD CONSTRAINT sandbox_calls_effect_check
    CHECK (effect IN ('idempotent', 'queryable', 'unsafe', 'readonly', 'transactional'));
