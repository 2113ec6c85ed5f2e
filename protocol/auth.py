"""btauth/1 request signing and verification (bittensor.http_auth), and the
replay store shared by every worker process of a server.

Client: `sign_request(...)` over the exact body bytes that will be sent,
bound to the receiving miner's hotkey; every send (each retry too) signs
again, for a fresh nonce. Server: `verify_request(...)` on the raw body before
parsing it; it returns the caller's hotkey or raises `AuthFailure` with the
HTTP status to answer with. Verification does not look at the chain:
metagraph membership, validator permit and stake are the caller's checks.

Both sides read the clock through `auth_clock_ns()`. Test-only: when the
environment variable `K3_TEST_CLOCK_SKEW_FILE` names a file holding a number
of seconds, that many seconds are added to this process's clock for signing
and for freshness checks (re-read when the file changes; a missing or empty
file is no skew). The local testnet's soak skews a miner's clock with it
(docs/localnet.md); nothing else sets it.
"""
from __future__ import annotations

import os
import sqlite3
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Optional

from bittensor import http_auth

from .errors import ErrorCode
from .schemas import error_body

AUTH_MAX_AGE_S = http_auth.DEFAULT_MAX_AGE  # 10 s freshness window
AUTH_ALLOWED_SKEW_S = http_auth.DEFAULT_ALLOWED_SKEW  # 2 s of forward clock drift
DEFAULT_NONCE_RETENTION_S = 60.0
CLOCK_SKEW_FILE_ENV = "K3_TEST_CLOCK_SKEW_FILE"  # test-only (module doc)

_REQUIRED_HEADERS = (
    http_auth.HEADER_VERSION,
    http_auth.HEADER_HOTKEY,
    http_auth.HEADER_RECEIVER,
    http_auth.HEADER_NONCE,
    http_auth.HEADER_SIGNATURE,
)

# http_auth error class -> our error code (its HTTP status: protocol.errors). http_auth's messages
# never echo the signature or payload, so they are returned to the caller.
_FAILURES: tuple[tuple[type[http_auth.AuthError], ErrorCode], ...] = (
    (http_auth.WrongReceiver, ErrorCode.WRONG_RECEIVER),
    (http_auth.MalformedAuth, ErrorCode.MALFORMED_AUTH),
    (http_auth.StaleRequest, ErrorCode.STALE_REQUEST),
    (http_auth.BadSignature, ErrorCode.BAD_SIGNATURE),
    (http_auth.ReplayedRequest, ErrorCode.REPLAYED_REQUEST),
)


class AuthFailure(Exception):
    """A request that failed authentication; answer with `status` and `to_json()`."""

    def __init__(self, code: ErrorCode, message: str):
        super().__init__(message)
        self.status = code.http_status
        self.code = str(code)
        self.message = message

    def to_json(self) -> bytes:
        return error_body(self.code, self.message)

    def __repr__(self) -> str:
        return f"AuthFailure({self.status}, {self.code!r}, {self.message!r})"


class _ClockSkew:
    """The test-only clock skew of this process (module doc), read again when its file changes."""

    def __init__(self, path: str):
        self.path = path
        self._mtime: Optional[float] = None
        self.seconds = 0.0

    def offset_ns(self) -> int:
        try:
            mtime = os.stat(self.path).st_mtime
        except OSError:
            self._mtime, self.seconds = None, 0.0
            return 0
        if mtime != self._mtime:
            self._mtime = mtime
            try:
                text = Path(self.path).read_text().strip()
                self.seconds = float(text) if text else 0.0
            except (OSError, ValueError):
                self._mtime = None  # being written: read it again at the next call
        return int(self.seconds * 1e9)


_skew = _ClockSkew(os.environ[CLOCK_SKEW_FILE_ENV]) if os.environ.get(CLOCK_SKEW_FILE_ENV) else None


def auth_clock_ns() -> int:
    """Now, in nanoseconds, as this process signs and checks freshness (the wall clock, plus the test-only skew)."""
    now = time.time_ns()
    return now if _skew is None else now + _skew.offset_ns()


def hotkey_signer(key):
    """The hotkey Keypair to sign with: a Keypair passes through; a wallet gives
    its `.hotkey` once (a Wallet handed to http_auth re-reads its key file on
    every signature)."""
    if hasattr(key, "sign") and hasattr(key, "ss58_address"):
        return key
    if hasattr(key, "hotkey"):
        return key.hotkey
    raise TypeError(f"cannot sign with {type(key).__name__}: pass a hotkey Keypair or a wallet")


def sign_request(
    hotkey_keypair,
    method: str,
    path: str,
    body: bytes,
    receiver_ss58: str,
    nonce_ns: Optional[int] = None,
) -> dict[str, str]:
    """btauth/1 headers for sending exactly `body` to `path` (with its query
    string, as sent) on the server whose hotkey is `receiver_ss58`."""
    return http_auth.sign(
        hotkey_keypair, method=method, path=path, body=body, receiver_ss58=receiver_ss58,
        nonce_ns=auth_clock_ns() if nonce_ns is None else nonce_ns,
    )


def _header_values(headers: Mapping[str, str], name: str) -> list[str]:
    getall = getattr(headers, "getall", None)
    if getall is not None:  # a multidict (aiohttp): every copy of the header
        return list(getall(name, []))
    return [value for key, value in headers.items() if key.lower() == name.lower()]


def check_auth_headers(
    headers: Mapping[str, str],
    own_hotkey_ss58: str,
    max_age_s: float = AUTH_MAX_AGE_S,
    allowed_skew_s: float = AUTH_ALLOWED_SKEW_S,
    now_ns: Optional[int] = None,
) -> str:
    """Everything btauth/1 headers can decide without the body: present once each, printable ASCII,
    well-formed, bound to this receiver, fresh. Returns the hotkey the caller claims (not yet proven:
    the signature covers the body). Raises AuthFailure (401; 403 for another receiver)."""
    values: dict[str, str] = {}
    for name in _REQUIRED_HEADERS + (http_auth.HEADER_CRYPTO,):
        found = _header_values(headers, name)
        if len(found) > 1:
            raise AuthFailure(ErrorCode.MALFORMED_AUTH, f"{name} is given {len(found)} times; send it once")
        if found:
            value = found[0]
            if not (value.isascii() and value.isprintable()) or len(value) > 256:
                raise AuthFailure(ErrorCode.MALFORMED_AUTH, f"{name} must be printable ASCII of at most 256 characters")
            values[name] = value
    missing = [name for name in _REQUIRED_HEADERS if name not in values]
    if missing:
        raise AuthFailure(
            ErrorCode.MISSING_AUTH,
            f"missing btauth/1 headers: {', '.join(missing)}; sign the request with "
            "bittensor.http_auth.sign(..., receiver_ss58=<this server's hotkey>)",
        )
    if values[http_auth.HEADER_VERSION] != http_auth.VERSION:
        raise AuthFailure(ErrorCode.MALFORMED_AUTH, f"unsupported {http_auth.HEADER_VERSION} "
                                                    f"(expected {http_auth.VERSION!r})")
    nonce_text = values[http_auth.HEADER_NONCE]
    if not (nonce_text.isdigit() and len(nonce_text) <= 24):
        raise AuthFailure(ErrorCode.MALFORMED_AUTH, f"{http_auth.HEADER_NONCE} is not a decimal integer")
    signature = values[http_auth.HEADER_SIGNATURE].removeprefix("0x")
    if len(signature) != 128 or any(c not in "0123456789abcdefABCDEF" for c in signature):
        raise AuthFailure(ErrorCode.MALFORMED_AUTH, f"{http_auth.HEADER_SIGNATURE} is not 64 bytes of hex")
    if values[http_auth.HEADER_RECEIVER] != own_hotkey_ss58:
        raise AuthFailure(ErrorCode.WRONG_RECEIVER, "request was signed for a different receiving hotkey")
    now = auth_clock_ns() if now_ns is None else now_ns
    nonce = int(nonce_text)
    if now - nonce > max_age_s * 1e9:
        raise AuthFailure(ErrorCode.STALE_REQUEST, f"nonce is older than the {max_age_s:g}s freshness window")
    if nonce - now > allowed_skew_s * 1e9:
        raise AuthFailure(ErrorCode.STALE_REQUEST, f"nonce is more than {allowed_skew_s:g}s in the future")
    return values[http_auth.HEADER_HOTKEY]


def verify_request(
    headers: Mapping[str, str],
    body: bytes,
    method: str,
    path: str,
    own_hotkey_ss58: str,
    nonce_store: http_auth.NonceStore,
    max_age_s: float = AUTH_MAX_AGE_S,
    allowed_skew_s: float = AUTH_ALLOWED_SKEW_S,
) -> str:
    """Authenticate a received request; returns the caller's hotkey ss58.

    `body` is the raw received bytes, `path` the request target as received
    (aiohttp: `request.raw_path`, which keeps the query string). Raises
    AuthFailure: 403 for a request signed for another receiver, 401 for
    anything else (missing headers, stale, bad signature, replay), 503 when
    the replay store cannot be reached.
    """
    check_auth_headers(headers, own_hotkey_ss58, max_age_s, allowed_skew_s)
    try:
        caller = http_auth.verify(
            headers,
            body,
            method=method,
            path=path,
            self_hotkey_ss58=own_hotkey_ss58,
            max_age=max_age_s,
            allowed_skew=allowed_skew_s,
            require_receiver=True,
            nonce_store=nonce_store,
        )
    except http_auth.AuthError as error:
        for kind, code in _FAILURES:
            if isinstance(error, kind):
                raise AuthFailure(code, str(error)) from None
        raise AuthFailure(ErrorCode.UNAUTHORIZED, str(error)) from None
    except (UnicodeError, ValueError):  # an address or value the SDK cannot even encode
        raise AuthFailure(ErrorCode.MALFORMED_AUTH, "malformed btauth/1 headers") from None
    except sqlite3.Error:
        raise AuthFailure(ErrorCode.REPLAY_STORE_UNAVAILABLE, "the replay store is unavailable; retry") from None
    return caller.hotkey_ss58


class SQLiteNonceStore:
    """Replay store for http_auth, shared by all worker processes of one server
    through one SQLite file (WAL).

    `check_and_store` is a single INSERT against a (hotkey, nonce) primary key,
    so of two workers racing on the same nonce exactly one wins. Rows older than
    `retention` seconds are pruned; `retention` must cover the verifier's
    freshness window plus skew (http_auth checks this attribute). Each process
    opens its own connection, lazily (safe across fork).
    """

    def __init__(self, path: str | os.PathLike, retention_s: float = DEFAULT_NONCE_RETENTION_S,
                 busy_timeout_s: float = 5.0):
        if retention_s < AUTH_MAX_AGE_S + AUTH_ALLOWED_SKEW_S:
            raise ValueError(
                f"retention_s={retention_s} is shorter than the btauth freshness window "
                f"({AUTH_MAX_AGE_S + AUTH_ALLOWED_SKEW_S} s): replays inside the gap would pass"
            )
        self.path = Path(path)
        self.retention = float(retention_s)
        self.busy_timeout_s = busy_timeout_s
        self._lock = threading.Lock()
        self._connection: Optional[sqlite3.Connection] = None
        self._pid = -1
        self._next_prune = 0.0
        self._connect()  # fail early on a bad path

    def _connect(self) -> sqlite3.Connection:
        if self._connection is None or self._pid != os.getpid():
            self.path.parent.mkdir(parents=True, exist_ok=True)
            # isolation_level=None: autocommit, every INSERT is its own transaction.
            connection = sqlite3.connect(
                self.path, timeout=self.busy_timeout_s, isolation_level=None, check_same_thread=False
            )
            connection.execute("PRAGMA journal_mode=WAL")
            # Survives a process crash; only a power loss can drop the newest rows.
            connection.execute("PRAGMA synchronous=NORMAL")
            connection.execute(
                "CREATE TABLE IF NOT EXISTS btauth_nonces ("
                " hotkey TEXT NOT NULL, nonce NOT NULL, seen_at REAL NOT NULL,"
                " PRIMARY KEY (hotkey, nonce)) WITHOUT ROWID"
            )
            connection.execute("CREATE INDEX IF NOT EXISTS btauth_nonces_seen_at ON btauth_nonces (seen_at)")
            self._connection, self._pid = connection, os.getpid()
        return self._connection

    def check_and_store(self, hotkey_ss58: str, nonce_ns: int) -> bool:
        """True (and remembered) if this (hotkey, nonce) was never seen, else False."""
        now = time.time()
        # The nonce column has no type affinity: integers outside SQLite's signed
        # 64-bit range are kept exactly, as text, instead of being rounded to REAL.
        nonce_key = nonce_ns if -(2**63) <= nonce_ns < 2**63 else str(nonce_ns)
        with self._lock:
            connection = self._connect()
            if now >= self._next_prune:
                connection.execute("DELETE FROM btauth_nonces WHERE seen_at < ?", (now - self.retention,))
                self._next_prune = now + self.retention / 4
            cursor = connection.execute(
                "INSERT OR IGNORE INTO btauth_nonces (hotkey, nonce, seen_at) VALUES (?, ?, ?)",
                (hotkey_ss58, nonce_key, now),
            )
            return cursor.rowcount == 1

    def close(self) -> None:
        with self._lock:
            if self._connection is not None and self._pid == os.getpid():
                self._connection.close()
            self._connection = None
