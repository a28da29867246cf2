"""A signed export of a log's audit chain, checked offline (docs/audit.md).

The export is JSON Lines: a header (the log, its head, the signer's key), one line per link
in position order (its position, hash, kind and columns), and a last line with the Ed25519
signature over SHA-256 of every byte before it. `verify_export` needs only the file and the
public key: it checks the signature (one byte changed anywhere fails it), then walks the
chain the lines carry with the log's own rules (`poimen._core.audit.walk`). Ed25519 comes from
the ``cryptography`` package: ``pip install 'poimen[audit]'``.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from poimen._core.audit import COLUMNS, Finding, Head, Link, Report, pruned_ranges, walk
from poimen._core.present import OperatorInputError
from poimen.errors import MissingExtraError
from poimen.operator._audit import check_view

FORMAT = "poimen-audit-export"
VERSION = 1
# What the signature covers: this, then the SHA-256 of every byte before the signature line.
_DOMAIN = b"poimen-audit-export-v1\n"


def _crypto() -> Any:
    try:
        from cryptography.hazmat.primitives.asymmetric import ed25519
    except ImportError as exc:
        raise MissingExtraError.of("poimen audit (signing)", "audit", exc) from exc
    return ed25519


def _serialization() -> Any:
    _crypto()
    from cryptography.hazmat.primitives import serialization

    return serialization


def _line(obj: Any) -> bytes:
    return (json.dumps(obj, sort_keys=True, separators=(",", ":")) + "\n").encode("ascii")


def key_id(public_raw: bytes) -> str:
    """A public key's short name: the first 16 hex digits of SHA-256 of its 32 bytes."""
    return hashlib.sha256(public_raw).hexdigest()[:16]


# Keys.


def keygen(path: str | os.PathLike[str]) -> tuple[Path, Path]:
    """A new Ed25519 key pair: the private key at `path` (PEM, owner-only), the public one
    beside it (`path`.pub). An existing file is never overwritten."""
    ed = _crypto()
    ser = _serialization()
    private = Path(path)
    public = private.with_name(private.name + ".pub")
    key = ed.Ed25519PrivateKey.generate()
    pem = key.private_bytes(
        ser.Encoding.PEM, ser.PrivateFormat.PKCS8, ser.NoEncryption()
    )
    pub = key.public_key().public_bytes(
        ser.Encoding.PEM, ser.PublicFormat.SubjectPublicKeyInfo
    )
    for target, data, mode in ((private, pem, 0o600), (public, pub, 0o644)):
        try:
            fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
        except FileExistsError:
            raise OperatorInputError(
                f"{os.fspath(target)!r} exists: a key is never overwritten", field="out"
            ) from None
        except OSError as exc:
            raise OperatorInputError(
                f"cannot write {os.fspath(target)!r}: {exc.strerror}", field="out"
            ) from None
        with os.fdopen(fd, "wb") as f:
            f.write(data)
    return private, public


def _read_key(path: str | os.PathLike[str], what: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as exc:
        raise OperatorInputError(
            f"the {what} {os.fspath(path)!r} cannot be read: {exc.strerror}", field=what
        ) from None


def load_private(path: str | os.PathLike[str]) -> Any:
    ed = _crypto()
    data = _read_key(path, "signing key")
    try:
        key = _serialization().load_pem_private_key(data, password=None)
    except (ValueError, TypeError) as exc:
        raise OperatorInputError(
            f"{os.fspath(path)!r} is not an unencrypted PEM private key ({exc})",
            field="signing key",
        ) from None
    if not isinstance(key, ed.Ed25519PrivateKey):
        raise OperatorInputError(
            f"{os.fspath(path)!r} is not an Ed25519 key (poimen audit keygen makes one)",
            field="signing key",
        )
    return key


def load_public(path: str | os.PathLike[str]) -> Any:
    ed = _crypto()
    data = _read_key(path, "public key")
    try:
        key = _serialization().load_pem_public_key(data)
    except (ValueError, TypeError) as exc:
        raise OperatorInputError(
            f"{os.fspath(path)!r} is not a PEM public key ({exc})", field="public key"
        ) from None
    if not isinstance(key, ed.Ed25519PublicKey):
        raise OperatorInputError(
            f"{os.fspath(path)!r} is not an Ed25519 public key", field="public key"
        )
    return key


def _raw(public: Any) -> bytes:
    ser = _serialization()
    raw: bytes = public.public_bytes(ser.Encoding.Raw, ser.PublicFormat.Raw)
    return raw


# Export.


@dataclass(frozen=True, slots=True)
class Exported:
    """What `export` wrote: the chain's check, and the lines (0 when refused)."""

    report: Report
    rows: int
    key: str


def export(store: Any, out: IO[bytes], signing_key: Any, *, now: float) -> Exported:
    """Write the log's chain to `out`, signed with `signing_key` (`load_private`), as of one
    snapshot. A chain that does not hold is not exported (nothing written): the report says
    why."""
    public = _raw(signing_key.public_key())
    kid = key_id(public)
    with store.audit_chain() as view:
        report = check_view(view)
        if not report.ok or report.head is None:
            return Exported(report, 0, kid)
        h = report.head
        digest = hashlib.sha256()
        rows = 0

        def put(obj: Any) -> None:
            b = _line(obj)
            digest.update(b)
            out.write(b)

        put({
            "format": FORMAT, "version": VERSION, "log_id": h.log_id,
            "head": {"seq": h.seq, "hash": h.hash}, "exported_at": now,
            "key": kid, "public_key": base64.b64encode(public).decode("ascii"),
        })  # fmt: skip
        for x in view.links():
            put({"seq": x.seq, "hash": x.hash, "kind": x.kind, "row": x.row})
            rows += 1
    sig = signing_key.sign(_DOMAIN + digest.digest())
    out.write(_line({"signature": base64.b64encode(sig).decode("ascii"), "alg": "ed25519",
                     "key": kid}))
    out.flush()
    return Exported(report, rows, kid)


# Offline check.


def _fail(message: str) -> Report:
    return Report(None, 0, 0, Finding("signature", None, message))


def verify_export(path: str | os.PathLike[str], public_key: Any) -> Report:
    """Check an export with the signer's public key (`load_public`): the signature over every
    byte, then the chain its lines carry. Nothing but the file and the key is read."""
    _crypto()
    from cryptography.exceptions import InvalidSignature

    file = Path(path)
    try:
        size = file.stat().st_size
        with file.open("rb") as f:
            digest = hashlib.sha256()
            last = b""
            for b in f:
                if last:
                    digest.update(last)
                last = b
    except OSError as exc:
        raise OperatorInputError(
            f"the export {os.fspath(path)!r} cannot be read: {exc.strerror}", field="file"
        ) from None
    if size == 0 or not last:
        return _fail("not an export: the file is empty")
    try:
        sig_line = json.loads(last)
        sig = base64.b64decode(sig_line["signature"], validate=True)
    except (ValueError, KeyError, TypeError):
        return _fail("the signature does not match: the last line is not a signature "
                     "(the file was changed or cut short)")
    given = _raw(public_key)
    try:
        public_key.verify(sig, _DOMAIN + digest.digest())
    except InvalidSignature:
        named = sig_line.get("key")
        other = f" (it names key {named}; this key is {key_id(given)})" if (
            named != key_id(given)) else ""
        return _fail("the signature does not match: the file was changed after it was "
                     f"signed, or another key signed it{other}")
    return _check_lines(file)


def _check_lines(file: Path) -> Report:
    """The chain a signed export carries, walked as the log's would be."""

    def rows() -> Iterator[Link]:
        with file.open("rb") as f:
            next(f, None)
            for b in f:
                obj = json.loads(b)
                if "signature" in obj:
                    return
                kind = obj["kind"]
                row = obj["row"]
                values = tuple(row.get(name) for name, _ in COLUMNS[kind])
                yield Link(int(obj["seq"]), str(obj["hash"]), kind, values)

    try:
        with file.open("rb") as f:
            header = json.loads(next(f))
        if header.get("format") != FORMAT or header.get("version") != VERSION:
            return _fail(f"not a {FORMAT} version {VERSION} file")
        head = Head(str(header["log_id"]), int(header["head"]["seq"]),
                    str(header["head"]["hash"]))
        ranges = pruned_ranges(x for x in rows() if x.kind == "pruned")
        w = walk(rows(), head, ranges, again=rows)
    except (ValueError, KeyError, TypeError, StopIteration) as exc:
        return _fail(f"the export does not parse: {exc}")
    return Report(head, w.rows, w.pruned, w.finding)
