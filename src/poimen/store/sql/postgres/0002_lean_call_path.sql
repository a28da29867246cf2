-- poimen intent log, PostgreSQL dialect, version 2: a call maintains fewer indexes.
-- Listing orders by intent id, which starts with the creation time, so the created_at and
-- (tool_id, created_at) indexes go; attempts are found by intent, so the (intent_id, fence)
-- index goes; the Indeterminate queue is listed in id order.
DROP INDEX intents_tool_created;
DROP INDEX intents_created;
DROP INDEX intents_indeterminate;
CREATE INDEX intents_indeterminate ON intents (id) WHERE state = 'INDETERMINATE';
ALTER TABLE attempts DROP CONSTRAINT attempts_intent_id_fence_key;
