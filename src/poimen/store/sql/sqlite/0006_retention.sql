-- poimen intent log, SQLite dialect, version 6: retention. Events and denials stay
-- append-only, except inside a prune transaction, which marks itself with a row in
-- poimen_pruning (and deletes it before it commits): only `poimen prune` deletes history, and
-- only what it archived first when asked to.
CREATE TABLE poimen_pruning (started_at REAL NOT NULL);

DROP TRIGGER events_append_only_d;
CREATE TRIGGER events_append_only_d BEFORE DELETE ON events
WHEN NOT EXISTS (SELECT 1 FROM poimen_pruning)
BEGIN SELECT RAISE(ABORT, 'events are append-only'); END;
DROP TRIGGER denials_append_only_d;
CREATE TRIGGER denials_append_only_d BEFORE DELETE ON denials
WHEN NOT EXISTS (SELECT 1 FROM poimen_pruning)
BEGIN SELECT RAISE(ABORT, 'denials are append-only'); END;
-- The pruning mark itself is never left behind by a committed transaction of poimen's.
