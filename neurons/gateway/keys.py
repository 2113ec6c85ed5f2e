"""The gateway's API keys (a key file, re-read when it changes; keys compared by digest in constant
time) and the per-key rate limit."""
from __future__ import annotations

import hashlib
import hmac
import logging
import os
from pathlib import Path
from typing import Optional, Union

from neurons.base.rate_limit import TokenBuckets

log = logging.getLogger("k3.gateway")


class ApiKeyFileError(ValueError):
    """An API key file that cannot be used."""


MIN_KEY_CHARS = 8


def read_api_keys(path: Union[str, Path]) -> set[str]:
    """Keys of a key file: one per line; `#` starts a comment (so keys hold no `#` and no spaces)."""
    try:
        text = Path(path).read_text()
    except OSError as error:
        raise ApiKeyFileError(f"cannot read the API key file {path}: {error.strerror or error}") from None
    keys = set()
    for lineno, line in enumerate(text.splitlines(), start=1):
        key = line.split("#", 1)[0].strip()
        if not key:
            continue
        if any(ch.isspace() for ch in key):
            raise ApiKeyFileError(f"{path}:{lineno}: one key per line, without spaces")
        if len(key) < MIN_KEY_CHARS:
            raise ApiKeyFileError(f"{path}:{lineno}: a key needs at least {MIN_KEY_CHARS} characters")
        keys.add(key)
    return keys


def key_id(key: str) -> str:
    """A short name of a key for logs and rate limits (never the key itself)."""
    return hashlib.sha256(key.encode()).hexdigest()[:12]


class ApiKeys:
    """The accepted keys, re-read whenever the file changes (a bad edit keeps the last good set)."""

    def __init__(self, path: Union[str, Path]):
        self.path = Path(path).expanduser()
        self._stamp: Optional[tuple] = None
        self._digests: set[bytes] = set()
        self.reload_error: Optional[str] = None
        self._load(raise_errors=True)

    def _file_stamp(self) -> Optional[tuple]:
        try:
            st = os.stat(self.path)
        except OSError:
            return None
        return (st.st_mtime_ns, st.st_size, st.st_ino)

    def _load(self, raise_errors: bool = False) -> None:
        stamp = self._file_stamp()
        try:
            keys = read_api_keys(self.path)
        except ApiKeyFileError as error:
            if raise_errors:
                raise
            if self.reload_error != str(error):
                log.error("keeping the previous %d API keys: %s", len(self._digests), error)
            self.reload_error = str(error)
            self._stamp = stamp
            return
        self._digests = {hashlib.sha256(k.encode()).digest() for k in keys}
        self._stamp = stamp
        self.reload_error = None
        log.info("loaded %d API keys from %s", len(keys), self.path)

    def __len__(self) -> int:
        self._refresh()
        return len(self._digests)

    def _refresh(self) -> None:
        if self._file_stamp() != self._stamp:
            self._load()

    def check(self, key: str) -> Optional[str]:
        """The key's id when it is accepted, else None."""
        self._refresh()
        digest = hashlib.sha256(key.encode()).digest()
        # Compare digests in constant time: nothing about a valid key leaks through timing.
        accepted = False
        for known in self._digests:
            accepted |= hmac.compare_digest(known, digest)
        return key_id(key) if accepted else None


class KeyRateLimiter:
    """`requests` per `window_s` per key, as a token bucket (bursts up to a window's worth)."""

    def __init__(self, requests: int, window_s: float):
        self.size = requests
        self._buckets = TokenBuckets(window_s)

    def take(self, key: str, now: Optional[float] = None) -> Optional[float]:
        """None when the request may go; else the seconds to wait."""
        return self._buckets.take(key, self.size, now)
