"""Operator identity for the console: the operators file of ``name:hash`` lines.

Each operator has a random token of their own, ``<name>.<secret>``, shown once when the
operator is added. The file keeps only a salted scrypt hash of it::

    ann:scrypt$n=16384,r=8,p=1$<salt hex>$<hash hex>

so a stolen file gives no one a way in. The name in the token picks the one line to check,
so a login costs one scrypt whatever the number of operators.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import os
import re
import secrets
import sys
import tempfile
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from poimen.errors import DuplicateOperatorError, OperatorsFileError, UnknownOperatorError
from poimen.operator._ops import OperatorInputError

__all__ = [
    "Login",
    "Operators",
    "add_operator",
    "hash_token",
    "new_token",
    "operator_names",
    "read_operators",
    "remove_operator",
    "verify_token",
]

NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._@-]{0,63}")
#: scrypt's cost: 16 MiB and a few tens of milliseconds per check.
N, R, P = 2**14, 8, 1
SALT_BYTES, HASH_BYTES = 16, 32
#: What a line may ask of scrypt: beyond this a hand-edited file could stall every login.
MAX_MEMORY = 256 * 2**20
MAX_TOKEN = 1024
_LINE = re.compile(
    r"scrypt\$n=(?P<n>\d{1,9}),r=(?P<r>\d{1,3}),p=(?P<p>\d{1,3})"
    r"\$(?P<salt>(?:[0-9a-f]{2}){8,64})\$(?P<hash>(?:[0-9a-f]{2}){16,64})"
)


@dataclass(frozen=True, slots=True)
class _Hash:
    n: int
    r: int
    p: int
    salt: bytes
    digest: bytes


def check_name(name: str) -> str:
    """An operator's name: letters, digits and ``._@-``, at most 64, starting with a
    letter or digit (it is a line's key, part of its token, and shown in the audit)."""
    if not NAME.fullmatch(name):
        raise OperatorInputError(
            f"operator name {name[:80]!r} must be 1 to 64 letters, digits or ._@- "
            "(starting with a letter or digit)",
            field="name",
        )
    return name


def new_token(name: str) -> str:
    """A fresh random token for operator `name`."""
    return f"{check_name(name)}.{secrets.token_urlsafe(32)}"


def _scrypt(token: str, h: _Hash) -> bytes:
    return hashlib.scrypt(
        token.encode("utf-8", "replace"),
        salt=h.salt,
        n=h.n,
        r=h.r,
        p=h.p,
        maxmem=128 * h.r * (h.n + h.p + 2) + 2**20,
        dklen=len(h.digest),
    )


def hash_token(token: str) -> str:
    """The stored form of `token`: scrypt with a new random salt."""
    h = _Hash(N, R, P, secrets.token_bytes(SALT_BYTES), b"\0" * HASH_BYTES)
    return f"scrypt$n={N},r={R},p={P}${h.salt.hex()}${_scrypt(token, h).hex()}"


def _parse_hash(text: str) -> _Hash:
    m = _LINE.fullmatch(text)
    if m is None:
        raise ValueError("the hash is not scrypt$n=N,r=R,p=P$<salt hex>$<hash hex>")
    n, r, p = int(m["n"]), int(m["r"]), int(m["p"])
    if n < 2 or n & (n - 1) or not 1 <= r <= 32 or not 1 <= p <= 16:
        raise ValueError("scrypt's n must be a power of 2, r 1 to 32 and p 1 to 16")
    if 128 * r * n * p > MAX_MEMORY:
        raise ValueError(f"scrypt's n, r and p ask for more than {MAX_MEMORY >> 20} MiB")
    return _Hash(n, r, p, bytes.fromhex(m["salt"]), bytes.fromhex(m["hash"]))


def verify_token(token: str, stored: str) -> bool:
    """Whether `token` is the one `stored` was made from (compared in constant time)."""
    try:
        h = _parse_hash(stored)
    except ValueError:
        return False
    return _verify(token, h)


def _verify(token: str, h: _Hash) -> bool:
    if not token or len(token) > MAX_TOKEN:
        return False
    return hmac.compare_digest(_scrypt(token, h), h.digest)


# A check against nothing, so that an unknown name costs what a known one does.
_DUMMY = _Hash(N, R, P, b"\0" * SALT_BYTES, b"\0" * HASH_BYTES)


# The file.


def _read(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise OperatorsFileError(f"no operators file at {str(path)!r}", path=str(path)) from None
    except (OSError, UnicodeDecodeError) as exc:
        raise OperatorsFileError(
            f"cannot read the operators file {str(path)!r}: {exc}", path=str(path)
        ) from exc


def _parse(text: str, path: Path) -> dict[str, tuple[str, _Hash]]:
    """Name -> (stored hash text, parsed), in file order; comments and blank lines skipped."""
    out: dict[str, tuple[str, _Hash]] = {}
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue

        def bad(why: str, number: int = number) -> OperatorsFileError:
            return OperatorsFileError(
                f"operators file {str(path)!r}, line {number}: {why}", path=str(path), line=number
            )

        name, colon, stored = line.partition(":")
        if not colon:
            raise bad("not name:hash")
        if not NAME.fullmatch(name):
            raise bad(f"{name[:80]!r} is not an operator name")
        if name in out:
            raise bad(f"operator {name!r} is there twice")
        try:
            out[name] = (stored, _parse_hash(stored))
        except ValueError as exc:
            raise bad(str(exc)) from None
    return out


def read_operators(path: str | os.PathLike[str]) -> dict[str, str]:
    """Each operator's name and stored hash, in file order."""
    p = Path(path)
    return {name: stored for name, (stored, _) in _parse(_read(p), p).items()}


def operator_names(path: str | os.PathLike[str]) -> list[str]:
    return list(read_operators(path))


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    """Serialize the writers of one operators file (the console only reads it). The lock is
    a file beside it, since removing replaces the operators file itself."""
    if sys.platform == "win32":  # no flock: writers are the operator's own commands
        yield
        return
    import fcntl

    try:
        fd = os.open(path.with_name(path.name + ".lock"), os.O_RDWR | os.O_CREAT, 0o600)
    except OSError as exc:
        raise OperatorsFileError(
            f"cannot write beside the operators file {str(path)!r}: {exc}", path=str(path)
        ) from exc
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def add_operator(path: str | os.PathLike[str], name: str) -> str:
    """Add operator `name` to the file (made, readable by its owner only, if missing) and
    return their new token: the only time it exists in clear."""
    p = Path(path)
    check_name(name)
    with _locked(p):
        text = _read(p) if p.exists() else ""
        if name in _parse(text, p):
            raise DuplicateOperatorError(
                f"operator {name!r} is already in {str(p)!r}: remove them first to give a new "
                "token",
                name=name,
                path=str(p),
            )
        token = new_token(name)
        line = f"{name}:{hash_token(token)}\n"
        if text and not text.endswith("\n"):
            line = "\n" + line
        try:
            fd = os.open(p, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
            try:
                os.write(fd, line.encode())
                os.fsync(fd)
            finally:
                os.close(fd)
        except OSError as exc:
            raise OperatorsFileError(
                f"cannot write the operators file {str(p)!r}: {exc}", path=str(p)
            ) from exc
    return token


def remove_operator(path: str | os.PathLike[str], name: str) -> None:
    """Remove operator `name`: their token stops working at once, in a running console too.
    The file is replaced whole, so a console never reads half of it."""
    p = Path(path)
    with _locked(p):
        text = _read(p)
        if name not in _parse(text, p):
            raise UnknownOperatorError(
                f"no operator {name!r} in {str(p)!r}", name=name, path=str(p)
            )
        kept = [ln for ln in text.splitlines() if ln.strip().partition(":")[0] != name]
        try:
            fd, tmp = tempfile.mkstemp(dir=p.parent, prefix=f".{p.name}.")
            try:
                with os.fdopen(fd, "w", encoding="utf-8") as f:
                    f.write("".join(f"{ln}\n" for ln in kept))
                    f.flush()
                    os.fsync(f.fileno())
                os.replace(tmp, p)
            except BaseException:
                with contextlib.suppress(OSError):
                    os.unlink(tmp)
                raise
        except OSError as exc:
            raise OperatorsFileError(
                f"cannot write the operators file {str(p)!r}: {exc}", path=str(p)
            ) from exc


# The console's view of the file.


@dataclass(frozen=True, slots=True)
class Login:
    """An operator logged in with their token; `stored` is the line's hash it matched, so a
    login ends when that line goes (removed, or replaced by a new token)."""

    name: str
    stored: str


class Operators:
    """The operators file as a running console sees it: read again whenever it changes
    (another inode, size or modification time), and an unreadable file lets no one in."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self._lock = threading.Lock()
        self.problem: str | None = None
        # A file that cannot be used at start is the operator's mistake, said at once.
        self._seen: tuple[int, ...] | None = self._stamp()
        self._entries = _parse(_read(self.path), self.path)

    def _stamp(self) -> tuple[int, ...]:
        try:
            st = self.path.stat()
        except OSError as exc:
            raise OperatorsFileError(
                f"cannot read the operators file {str(self.path)!r}: {exc}", path=str(self.path)
            ) from exc
        return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)

    def _refresh(self) -> None:
        with self._lock:
            entries: dict[str, tuple[str, _Hash]] = {}
            try:
                seen: tuple[int, ...] | None = self._stamp()
                if seen == self._seen:
                    return
                entries = _parse(_read(self.path), self.path)
                problem = None
            except OperatorsFileError as exc:
                seen, problem = None, str(exc)
            self._seen, self._entries = seen, entries
            if problem is not None and problem != self.problem:
                print(f"poimen console: {problem}; nobody can log in", file=sys.stderr)
            self.problem = problem

    def names(self) -> list[str]:
        self._refresh()
        return list(self._entries)

    def login(self, token: str) -> Login | None:
        """The operator whose token this is, or None."""
        self._refresh()
        name = token.rpartition(".")[0]
        entry = self._entries.get(name)
        if entry is None:
            _verify(token, _DUMMY)
            return None
        return Login(name, entry[0]) if _verify(token, entry[1]) else None

    def holds(self, login: Login) -> bool:
        """Whether `login` is still good: its operator's line is still the one it matched."""
        self._refresh()
        entry = self._entries.get(login.name)
        return entry is not None and hmac.compare_digest(entry[0], login.stored)
