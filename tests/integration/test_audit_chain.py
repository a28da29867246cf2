"""The tamper-evident audit (docs/audit.md) on each backend, with the rows changed behind the
log's back as someone with write access to the database would: `poimen audit verify` names
the first row edited, deleted, inserted or reordered; a published head catches a rewrite of
the whole chain; a prune keeps the chain verifiable and its archive matches it."""

from __future__ import annotations

import json
import sqlite3
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from poimen import (
    Caps,
    Completed,
    Idempotent,
    Kernel,
    KeyDerivation,
    ToolContext,
    Transactional,
    Unsafe,
)
from poimen._core.audit import COLUMNS, GENESIS, SETTLED, TABLES, Link, link
from poimen.audit import verify
from poimen.operator import prune, read_archive
from poimen.store._chain import CHAIN_VERSION
from tests.contract.test_store_contract import raw
from tests.integration.operator_app import poimen

TERMINAL = "(" + ", ".join(f"'{s}'" for s in SETTLED) + ")"


def app(url: str) -> Kernel:
    """A kernel with a tool that completes and one that ends Indeterminate."""
    k = Kernel(url, notifiers=[])

    @k.tool(id="add", effects=Idempotent(key=KeyDerivation.fields("n")), caps=Caps(), timeout=5)
    def add(ctx: ToolContext, n: int, note: str = "") -> dict[str, Any]:
        return {"n": n + 1, "note": note}

    @k.tool(id="post", effects=Unsafe(), caps=Caps(), timeout=5)
    def post(ctx: ToolContext, n: int) -> int:
        raise ConnectionResetError("the connection dropped after the request left")

    # A write to the application's table in the log's own database: its outcome commits in
    # the tool's transaction, on the application's connection.
    @k.tool(id="note", effects=Transactional(database=url), caps=Caps(), timeout=5)
    def note(ctx: ToolContext, text: str) -> int:
        ctx.tx.execute("INSERT INTO app_notes (text) VALUES (%s)" if is_pg(url)
                       else "INSERT INTO app_notes (text) VALUES (?)", (text,))
        return 1

    return k


def history(url: str) -> Kernel:
    """A log written by the usual paths: calls, an Indeterminate call resolved, events of
    their own (spilling a settled call's history), a denial; text and numbers at the edges."""
    k = app(url)
    raw(url, "CREATE TABLE IF NOT EXISTS app_notes (text TEXT NOT NULL)")
    for i in range(4):
        k.call("add", {"n": i, "note": "ünïcödé ✓ \u2028"}, call_id=f"run/{i}")
    done = k.call("note", {"text": "written with its outcome"}, call_id="run/note")
    assert isinstance(done, Completed), done
    out = k.call("post", {"n": 1}, call_id="run/post")
    k.resolve(out.intent_id, landed=False, operator="ann", reason="no row at the provider")
    first = k.store.get_by_call_id("run/0")
    assert first is not None
    k.store.record_event(first.id, "noted", actor="ann", detail={"why": "é", "n": 1e-300},
                         now=k.store.now())
    k.store.record_denial(tool_id="add", intent_id=first.id, attempt=1, action="http",
                          target="POST https://x.example/", reason="no_key", now=k.store.now())
    return k


def is_pg(url: str) -> bool:
    return not url.startswith("sqlite:///")


def tamper(url: str, *stmts: str) -> None:
    """Statements run behind the log's back, in one connection, as a person with write
    access to the database runs them: on SQLite without poimen's functions."""
    if not is_pg(url):
        conn = sqlite3.connect(url[len("sqlite:///") :], isolation_level=None)
        try:
            for s in stmts:
                conn.execute(s)
        finally:
            conn.close()
        return
    import psycopg

    with psycopg.connect(url, autocommit=True) as pg:
        for s in stmts:
            pg.execute(s)  # type: ignore[call-overload]


def unguard(url: str, table: str, *triggers: str) -> list[str]:
    """The statements that take `table`'s protection away (append-only, chain)."""
    if is_pg(url):
        return [f"ALTER TABLE {table} DISABLE TRIGGER {t}" for t in triggers]
    return [f"DROP TRIGGER {t}" for t in triggers]


def append_only(url: str, table: str) -> tuple[str, ...]:
    if is_pg(url):
        return (f"{table}_append_only",)
    return (f"{table}_append_only_u", f"{table}_append_only_d")


def links(url: str) -> list[Link]:
    """Every linked row, read behind the log's back, in position order."""
    out = []
    for kind, cols in COLUMNS.items():
        names = ", ".join(c for c, _ in cols)
        where = f"chain_seq IS NOT NULL{f' AND state IN {TERMINAL}' if kind == 'intent' else ''}"
        for r in raw(url, f"SELECT chain_seq, chain_hash, {names} FROM {TABLES[kind]} "
                          f"WHERE {where}"):
            out.append(Link(int(r[0]), str(r[1]), kind, tuple(r[2:])))
    return sorted(out, key=lambda x: x.seq)


def at(url: str, kind: str, pick: int = 0) -> Link:
    return [x for x in links(url) if x.kind == kind][pick]


def check(url: str, *args: str) -> tuple[int, str, str]:
    r = poimen("audit", "verify", *args, db=url)
    return r.returncode, r.stdout.strip(), r.stderr.strip()


def found(url: str, *args: str) -> str:
    """What `poimen audit verify` says of a log it must fail: exit 6, one line."""
    code, out, err = check(url, *args)
    assert code == 6 and "\n" not in err and not out, (code, out, err)
    return err


def test_a_log_written_every_usual_way_verifies_and_links_every_row(store_url: str) -> None:
    k = history(store_url)
    try:
        assert k.store.schema_version() >= CHAIN_VERSION
        report = verify(k.store)
        assert report.ok, report.line()
        head = k.store.audit_head()  # type: ignore[attr-defined]
    finally:
        k.close()
    # The witness: the rows themselves. Every event, denial and settled intent is linked,
    # at positions 1..head with none twice, and each link is recomputed here, outside poimen's
    # store, from the columns as the database holds them (PostgreSQL made them in PL/pgSQL).
    counts = [raw(store_url, f"SELECT COUNT(*) FROM {t}")[0][0] for t in ("events", "denials")]
    settled = raw(store_url, f"SELECT COUNT(*) FROM intents WHERE state IN {TERMINAL}")[0][0]
    rows = links(store_url)
    assert [x.seq for x in rows] == list(range(1, head.seq + 1))
    assert len(rows) == sum(counts) + settled == report.rows
    prev = GENESIS
    for x in rows:
        assert link(prev, x.kind, x.values) == x.hash, x
        prev = x.hash
    assert prev == head.hash
    assert {x.kind for x in rows} == {"event", "denial", "intent"}
    code, out, err = check(store_url)
    assert code == 0 and out.startswith("the audit chain holds") and not err, (code, out, err)
    assert poimen("verify", db=store_url).returncode == 0


def test_an_edited_settled_record_is_named(store_url: str) -> None:
    history(store_url).close()
    x = at(store_url, "intent", 1)
    tamper(store_url, f"UPDATE intents SET result = '{{\"n\": 99}}' WHERE id = '{x.values[0]}'")
    msg = found(store_url)
    assert msg == (f"edited: the settled record of intent {x.values[0]} (COMPLETED) at chain "
                   f"position {x.seq} does not match its hash"), msg
    # `poimen verify` says it too, among its checks.
    r = poimen("verify", "--json", db=store_url)
    assert r.returncode == 6
    assert {"check": "audit chain", "message": msg} in json.loads(r.stdout)["problems"]


def test_an_edited_event_is_named(store_url: str) -> None:
    history(store_url).close()
    x = next(y for y in links(store_url) if y.kind == "event" and y.values[3] == "resolved")
    tamper(store_url, *unguard(store_url, "events", *append_only(store_url, "events")),
           f"UPDATE events SET actor = 'mallory' WHERE id = {x.values[0]}")
    assert found(store_url) == (f"edited: event {x.values[0]} (resolved) of intent "
                                f"{x.values[1]} at chain position {x.seq} does not match its hash")


def test_a_deleted_row_is_named_by_its_position(store_url: str) -> None:
    history(store_url).close()
    rows = links(store_url)
    x = next(y for y in rows if y.kind == "intent" and y.seq > 1)
    before = next(y for y in rows if y.seq == x.seq - 1)
    after = next(y for y in rows if y.seq == x.seq + 1)
    tamper(store_url, f"DELETE FROM intents WHERE id = '{x.values[0]}'")
    assert found(store_url) == (f"deleted: chain position {x.seq} is missing (after "
                                f"{before.label()}, before {after.label()})")


def test_a_deleted_event_and_a_deleted_last_row_are_named(store_url: str) -> None:
    history(store_url).close()
    last = links(store_url)[-1]
    assert last.kind == "denial"
    tamper(store_url, *unguard(store_url, "denials", *append_only(store_url, "denials")),
           f"DELETE FROM denials WHERE id = {last.values[0]}")
    assert found(store_url).startswith(f"deleted: chain position {last.seq} is missing (after ")
    e = at(store_url, "event")
    tamper(store_url, *unguard(store_url, "events", *append_only(store_url, "events")),
           f"DELETE FROM events WHERE id = {e.values[0]}")
    assert found(store_url).startswith(f"deleted: chain position {e.seq} is missing")


def test_an_inserted_row_is_named(store_url: str) -> None:
    history(store_url).close()
    intent = at(store_url, "intent").values[0]
    cols = "intent_id, at, kind, from_state, to_state, actor, detail"
    row = f"'{intent}', 1.0, 'resolved', 'INDETERMINATE', 'RESOLVED_LANDED', 'mallory', '{{}}'"
    # Without a link: the chain's trigger taken away first (SQLite's needs poimen's function).
    tamper(store_url, *unguard(store_url, "events", "events_chain"),
           f"INSERT INTO events ({cols}) VALUES ({row})")
    new = raw(store_url, "SELECT MAX(id) FROM events")[0][0]
    assert found(store_url) == (f"inserted: event {new} (resolved) of intent {intent} carries "
                                "no chain link")


def test_a_row_inserted_at_a_taken_position_is_named(store_url: str) -> None:
    history(store_url).close()
    x = at(store_url, "event")
    cols = "intent_id, at, kind, from_state, to_state, actor, detail, chain_seq, chain_hash"
    row = (f"'{x.values[1]}', {x.values[2]!r}, 'abandoned', NULL, NULL, 'mallory', '{{}}', "
           f"{x.seq}, '{x.hash}'")
    tamper(store_url, *unguard(store_url, "events", "events_chain"),
           f"INSERT INTO events ({cols}) VALUES ({row})")
    new = raw(store_url, "SELECT MAX(id) FROM events")[0][0]
    assert found(store_url) == (f"inserted: event {new} (abandoned) of intent {x.values[1]} "
                                f"claims chain position {x.seq}, held by {x.label()}")


def test_two_rows_exchanged_in_the_chain_are_named_reordered(store_url: str) -> None:
    history(store_url).close()
    a, b = at(store_url, "intent", 1), at(store_url, "intent", 2)
    assert b.seq == a.seq + 1
    tamper(store_url, f"UPDATE intents SET chain_seq = CASE WHEN chain_seq = {a.seq} THEN "
                      f"{b.seq} ELSE {a.seq} END WHERE chain_seq IN ({a.seq}, {b.seq})")
    assert found(store_url) == (f"reordered: {b.label()} sits at chain position {a.seq} but "
                                f"was chained after position {b.seq} ({a.label()})")


def test_two_events_whose_ids_were_exchanged_are_named_reordered(store_url: str) -> None:
    k = history(store_url)
    it = k.store.get_by_call_id("run/1")
    assert it is not None
    for kind in ("asked", "answered"):
        k.store.record_event(it.id, kind, actor="ann", detail={}, now=k.store.now())
    k.close()
    asked, answered = [x for x in links(store_url) if x.values[3] in ("asked", "answered")]
    i, j = asked.values[0], answered.values[0]
    fix = (["ALTER TABLE events ALTER COLUMN id SET GENERATED BY DEFAULT"]
           if is_pg(store_url) else [])
    tamper(store_url, *unguard(store_url, "events", *append_only(store_url, "events")), *fix,
           f"UPDATE events SET id = -1 WHERE id = {i}",
           f"UPDATE events SET id = {i} WHERE id = {j}",
           f"UPDATE events SET id = {j} WHERE id = -1")
    assert [e.kind for e in Kernel(store_url, notifiers=[]).store.events(it.id)][-2:] == [
        "answered", "asked"]  # the history now reads the other way round
    assert found(store_url) == (
        f"reordered: event {j} (asked) of intent {it.id} at chain position {asked.seq} was "
        f"written as id {i}: the ids of two events rows were exchanged")


def test_a_published_head_catches_a_rewrite_of_the_whole_chain(store_url: str) -> None:
    history(store_url).close()
    r = poimen("audit", "head", "--json", db=store_url)
    assert r.returncode == 0, r.stderr
    published = json.loads(r.stdout)
    token = f"{published['seq']}:{published['hash']}"
    assert check(store_url, "--head", token)[0] == 0
    k = app(store_url)
    k.call("add", {"n": 50}, call_id="later")  # the log goes on: the old head stays a link
    k.close()
    code, out, _ = check(store_url, "--head", token)
    assert code == 0 and "the published head is a link of it" in out, out
    # Someone with the database rewrites the chain from an edited row on, hashes and head
    # included: the log alone cannot tell, the published head can.
    rows = links(store_url)
    x = next(y for y in rows if y.kind == "intent")
    edited = dict(zip([c for c, _ in COLUMNS["intent"]], x.values, strict=True))
    edited["result"] = '{"n": 1000}'
    tamper(store_url, f"UPDATE intents SET result = '{edited['result']}' WHERE id = '{x.values[0]}'")
    prev = next((y.hash for y in rows if y.seq == x.seq - 1), GENESIS)
    stmts = []
    for y in rows[x.seq - 1:]:
        values = tuple(edited.values()) if y is x else y.values
        prev = link(prev, y.kind, values)
        key = f"'{y.values[0]}'" if y.kind == "intent" else str(y.values[0])
        stmts.append(f"UPDATE {TABLES[y.kind]} SET chain_hash = '{prev}' WHERE id = {key}")
    stmts.append(f"UPDATE audit_head SET hash = '{prev}'")
    guards = [g for t in ("events", "denials") for g in unguard(
        store_url, t, *(append_only(store_url, t) if is_pg(store_url) else (f"{t}_link_once",)))]
    tamper(store_url, *guards, *stmts)
    assert check(store_url)[0] == 0  # a consistent rewrite
    assert found(store_url, "--head", token) == (
        "rewritten: the published head is not the link this log holds at its position")
    assert found(store_url, "--head", published["hash"]) == (
        "rewritten: the published head is no link of this log's chain")


def test_a_bad_head_option_is_a_usage_error(store_url: str) -> None:
    history(store_url).close()
    r = poimen("audit", "verify", "--head", "12:nothex", db=store_url)
    assert r.returncode == 2 and "SEQ:HASH" in r.stderr and r.stderr.count("\n") == 1, r.stderr


def wait_past(k: Kernel, t: float) -> None:
    """Until the store's clock has passed `t` (a prune window of a few milliseconds)."""
    while k.store.now() <= t:
        time.sleep(0.001)


def test_prune_keeps_the_chain_verifiable_and_its_archive_matches_it(
    store_url: str, tmp_path: Path
) -> None:
    # run/post is resolved but stays (its notification was never delivered), as does an
    # Indeterminate call whose history goes on between the pruned rows.
    k = history(store_url)
    try:
        k.call("post", {"n": 2}, call_id="open")  # Indeterminate: never pruned
        kept = k.store.get_by_call_id("open")
        resolved = k.store.get_by_call_id("run/post")
        assert kept is not None and resolved is not None
        k.call("add", {"n": 7}, call_id="between")
        k.store.record_event(kept.id, "asked", actor="ann", detail={}, now=k.store.now())
        k.store.record_denial(tool_id="add", intent_id=None, attempt=None, action="dispatch",
                              target="x", reason="sandbox", now=k.store.now())
        wait_past(k, k.store.now() + 0.01)
        archive = tmp_path / "pruned.jsonl"
        report = prune(k.store, older_than=0.005, allow_short=True, archive=archive, batch=2)
        assert report.pruned == 6 and report.denials == 1, report
        k.call("add", {"n": 8}, call_id="after")  # the chain goes on past the prune
        v = verify(k.store)
    finally:
        k.close()
    assert v.ok and v.pruned > 0, v.line()
    left = links(store_url)
    assert {x.values[1] for x in left if x.kind == "event"} == {kept.id, resolved.id}
    # The archive carries the segment: each pruned row with its link, checked against the
    # prune records' hashes and the links around them.
    archived = [c for line in read_archive(archive) for c in line["chain"]]
    assert len({c["seq"] for c in archived}) == len(archived) > 0
    code, out, _ = check(store_url, "--archive", str(archive))
    assert code == 0 and f"{len(archived)} archived rows match it" in out, out
    lines = archive.read_text().splitlines()
    first = json.loads(lines[0])
    first["chain"][0]["row"]["result" if first["chain"][0]["kind"] == "intent" else "at"] = 7
    bad = tmp_path / "bad.jsonl"
    bad.write_text("\n".join([json.dumps(first), *lines[1:]]) + "\n")
    assert found(store_url, "--archive", str(bad)).startswith("edited: the archived ")
    # A row deleted next to a pruned run is still a deletion.
    e = next(x for x in left if x.kind == "event")
    tamper(store_url, *unguard(store_url, "events", *append_only(store_url, "events")),
           f"DELETE FROM events WHERE id = {e.values[0]}")
    assert found(store_url).startswith(f"deleted: chain position {e.seq} is missing")


def test_a_signed_export_verifies_offline_and_fails_when_one_byte_changes(
    store_url: str, tmp_path: Path
) -> None:
    history(store_url).close()
    key = tmp_path / "audit.key"
    r = poimen("audit", "keygen", "--out", str(key))
    assert r.returncode == 0, r.stderr
    assert (key.stat().st_mode & 0o777) == 0o600 and Path(f"{key}.pub").is_file()
    assert poimen("audit", "keygen", "--out", str(key)).returncode == 2  # never overwritten
    out = tmp_path / "export.jsonl"
    r = poimen("audit", "export", "--sign", str(key), "--out", str(out), db=store_url)
    assert r.returncode == 0, r.stderr
    body = out.read_bytes()
    rows = links(store_url)
    assert len(body.splitlines()) == len(rows) + 2  # header, the rows, the signature

    def verify_export(path: Path, public: Path = Path(f"{key}.pub")) -> tuple[int, str]:
        v = poimen("audit", "verify-export", str(path), "--public-key", str(public))
        return v.returncode, (v.stdout + v.stderr).strip()

    code, text = verify_export(out)
    assert code == 0 and f"{len(rows)} rows up to position {rows[-1].seq}" in text, text
    # Without the log: the export alone, anywhere.
    moved = tmp_path / "elsewhere.jsonl"
    moved.write_bytes(body)
    assert verify_export(moved)[0] == 0
    # One byte changed, wherever: in the header, a row's value, a hash, the signature.
    changed = tmp_path / "changed.jsonl"
    lines = body.splitlines(keepends=True)
    spots = [5, len(lines[0]) + lines[1].index(b'"row"') + 12,
             len(lines[0]) + lines[1].index(b'"hash"') + 10, len(body) - 20, len(body) - 2]
    for spot in spots:
        b = bytearray(body)
        b[spot] = ord("0") if b[spot] != ord("0") else ord("1")
        changed.write_bytes(bytes(b))
        code, text = verify_export(changed)
        assert code == 6 and text.startswith("the signature does not match"), (spot, text)
    # Another key's public half does not verify it.
    other = tmp_path / "other.key"
    assert poimen("audit", "keygen", "--out", str(other)).returncode == 0
    code, text = verify_export(out, Path(f"{other}.pub"))
    assert code == 6 and "another key signed it (it names key" in text, text


def test_a_log_whose_chain_does_not_hold_is_not_exported(store_url: str, tmp_path: Path) -> None:
    history(store_url).close()
    key = tmp_path / "audit.key"
    assert poimen("audit", "keygen", "--out", str(key)).returncode == 0
    x = at(store_url, "intent", 1)  # its history in its row: nothing refers to it
    tamper(store_url, f"DELETE FROM intents WHERE id = '{x.values[0]}'")
    out = tmp_path / "export.jsonl"
    r = poimen("audit", "export", "--sign", str(key), "--out", str(out), db=store_url)
    assert r.returncode == 6 and r.stderr.startswith("poimen: not exported: deleted: "), r.stderr
    assert not out.exists()


def test_signing_without_the_extra_says_which_extra(tmp_path: Path) -> None:
    # The `audit` extra missing: cryptography cannot be imported.
    code = ("import sys; sys.modules['cryptography'] = None\n"
            "from poimen.cli import main\n"
            f"raise SystemExit(main(['audit', 'keygen', '--out', {str(tmp_path / 'k')!r}]))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2, r.stderr
    assert "pip install 'poimen[audit]'" in r.stderr and r.stderr.count("\n") == 1, r.stderr
    assert not (tmp_path / "k").exists()


def test_rows_cut_off_the_end_with_the_head_moved_back_are_named(store_url: str) -> None:
    history(store_url).close()
    rows = links(store_url)
    last = rows[-1]
    assert last.kind == "denial"
    # The last row removed and the head's position moved back over it: its hash gives it away.
    tamper(store_url, *unguard(store_url, "denials", *append_only(store_url, "denials")),
           f"DELETE FROM denials WHERE id = {last.values[0]}",
           f"UPDATE audit_head SET seq = {last.seq - 1}")
    assert found(store_url).startswith(
        f"edited: the chain head ({last.seq - 1}:{last.hash[:16]}...) is not the hash of the "
        "last row")
