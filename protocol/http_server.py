"""Hardened HTTP serving shared by every listener of the subnet (miner API, gateway, metrics ports).

aiohttp alone reads whole bodies before a handler can refuse, inflates gzip/deflate bodies, never times
out a client that sends its headers or body slowly, and accepts connections until the process runs out
of file descriptors. This module adds what is missing:

- `ConnectionGuard`: counts open connections in total and per source address and refuses (closes at
  once) a connection beyond either cap; the total is also kept below the process's free file descriptors,
  so `accept()` never fails with EMFILE. A connection must deliver complete request headers within
  `header_timeout_s` of opening (or of its previous answer, on keep-alive: `idle_timeout_s`), or it is
  closed. Refusals and closings are logged as one count per interval, never one line per event: as a
  warning, except a kept-alive connection that served its requests and then sat idle (every client pool
  leaves those), which is logged at DEBUG.
- `GuardedSite`: a `web.TCPSite` whose connections go through the guard.
- `runner_options()`: keyword arguments for `web.AppRunner` (no automatic inflation of bodies, header
  size caps, keep-alive timeout).
- `read_body(request, limit, timeout_s)`: called by a handler only after everything its headers can
  decide; refuses compressed bodies and non-JSON content types (415), bodies over `limit` (413, counted
  as they arrive, never buffered beyond the cap), a body not complete within `timeout_s` (408) and a
  malformed chunked body (400). A deferred `Expect: 100-continue` is answered only here.
"""
from __future__ import annotations

import asyncio
import logging
import os
import resource
import socket
from dataclasses import dataclass

from aiohttp import web

from .errors import ErrorCode
from .schemas import JSON_CONTENT_TYPE, ProtocolError

log = logging.getLogger("k3.http")

FD_RESERVE = 64  # descriptors kept free for everything else a process opens (files, databases, outbound)
ACCEPT_BURST = FD_RESERVE // 4  # connections accepted per wake-up of a listening socket, before the guard sees them


@dataclass(frozen=True)
class GuardSettings:
    max_connections: int = 512
    max_connections_per_address: int = 64
    header_timeout_s: float = 5.0
    idle_timeout_s: float = 15.0  # keep-alive: the next request's headers must be in within this
    body_timeout_s: float = 10.0
    log_interval_s: float = 10.0


class BodyRefusal(ProtocolError):
    """A refused body: the connection is closed after the answer (the rest is not worth reading)."""

    close = True


def runner_options(settings: GuardSettings) -> dict:
    """Keyword arguments for web.AppRunner that go with a guarded site. aiohttp's own keep-alive deadline is a
    second behind the guard's, so that the guard closes (and counts) an idle connection, and aiohttp only backs it."""
    return dict(auto_decompress=False, keepalive_timeout=settings.idle_timeout_s + 1.0, max_line_size=8190,
                max_field_size=8190)


_process_open = 0  # guarded connections open in this process, every guard together
_fd_budget: int | None = None


def fd_budget() -> int:
    """How many connections this process can hold: free descriptors (soft RLIMIT_NOFILE minus those open
    when first asked) less a reserve."""
    global _fd_budget
    if _fd_budget is None:
        soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
        try:
            used = len(os.listdir("/proc/self/fd"))
        except OSError:
            used = 64
        limit = soft if soft != resource.RLIM_INFINITY else 1 << 20
        _fd_budget = max(8, limit - used - FD_RESERVE)
    return _fd_budget


class _Tally:
    """Counts events by kind and logs them as one line per interval."""

    def __init__(self, name: str, interval_s: float, level: int = logging.WARNING):
        self.name, self.interval_s, self.level = name, interval_s, level
        self.counts: dict[str, int] = {}
        self.totals: dict[str, int] = {}
        self._flush: asyncio.TimerHandle | None = None
        self.lines = 0

    def add(self, kind: str) -> None:
        self.counts[kind] = self.counts.get(kind, 0) + 1
        self.totals[kind] = self.totals.get(kind, 0) + 1
        if self._flush is None:
            try:
                self._flush = asyncio.get_running_loop().call_later(self.interval_s, self.flush)
            except RuntimeError:
                self.flush()

    def flush(self) -> None:
        self._flush = None
        if self.counts:
            parts = ", ".join(f"{n} {kind}" for kind, n in sorted(self.counts.items()))
            log.log(self.level, "%s: in the last %g s: %s", self.name, self.interval_s, parts)
            self.lines += 1
            self.counts = {}


class _GuardedConnection(asyncio.Protocol):
    """Sits between the transport and aiohttp's protocol: admission, the header deadline, the counts."""

    def __init__(self, guard: "ConnectionGuard", inner: asyncio.Protocol):
        self.guard, self.inner = guard, inner
        self.address = ""
        self.transport: asyncio.Transport | None = None
        self.timer: asyncio.TimerHandle | None = None
        self.busy = 0
        self.answered = 0  # requests finished on this connection
        self.partial = False  # bytes of a next request arrived (its headers not yet complete)

    def connection_made(self, transport) -> None:
        peer = transport.get_extra_info("peername")
        self.address = str(peer[0]) if peer else "?"
        refusal = self.guard._admit(self.address)
        if refusal is not None:
            self.guard.tally.add(refusal)
            self.inner = None
            transport.abort()
            return
        self.transport = transport
        self.guard._connections[transport] = self
        self._arm(self.guard.settings.header_timeout_s)
        self.inner.connection_made(transport)

    def _arm(self, seconds: float) -> None:
        if self.timer is not None:
            self.timer.cancel()
        self.timer = asyncio.get_running_loop().call_later(seconds, self._expire)

    def _expire(self) -> None:
        self.timer = None
        if self.busy == 0 and self.transport is not None:
            if self.answered and not self.partial:  # an ordinary kept-alive connection nobody used again
                self.guard.idle_tally.add("idle keep-alive connections closed")
            else:  # nothing, or a request's headers begun and never finished: what a slowloris client does
                self.guard.tally.add("connections closed for slow or missing headers")
            self.transport.abort()

    def request_started(self) -> None:
        self.busy += 1
        self.partial = False
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None

    def request_finished(self) -> None:
        self.busy = max(0, self.busy - 1)
        self.answered += 1
        self.partial = False
        if self.busy == 0 and self.transport is not None and not self.transport.is_closing():
            self._arm(self.guard.settings.idle_timeout_s)

    def data_received(self, data: bytes) -> None:
        if self.busy == 0 and data:
            self.partial = True
        if self.inner is not None:
            self.inner.data_received(data)

    def eof_received(self):
        return self.inner.eof_received() if self.inner is not None else None

    def pause_writing(self) -> None:
        if self.inner is not None:
            self.inner.pause_writing()

    def resume_writing(self) -> None:
        if self.inner is not None:
            self.inner.resume_writing()

    def connection_lost(self, exc) -> None:
        if self.inner is None:
            return
        if self.timer is not None:
            self.timer.cancel()
        self.guard._release(self)
        self.inner.connection_lost(exc)


class ConnectionGuard:
    """Connection caps and header deadlines for one listener (see the module's text)."""

    def __init__(self, settings: GuardSettings = GuardSettings(), name: str = "http"):
        self.settings = settings
        self.name = name
        self.tally = _Tally(f"{name} connection guard", settings.log_interval_s)
        # kept-alive connections closed after idle_timeout_s are what every client's pool leaves: DEBUG, not WARNING
        self.idle_tally = _Tally(f"{name} connection guard", settings.log_interval_s, logging.DEBUG)
        self._connections: dict[asyncio.BaseTransport, _GuardedConnection] = {}
        self._per_address: dict[str, int] = {}

    @property
    def open_connections(self) -> int:
        return len(self._connections)

    def _admit(self, address: str) -> str | None:
        global _process_open
        s = self.settings
        if len(self._connections) >= s.max_connections or _process_open >= fd_budget():
            return "connections refused (total cap)"
        if self._per_address.get(address, 0) >= s.max_connections_per_address:
            return "connections refused (per-address cap)"
        self._per_address[address] = self._per_address.get(address, 0) + 1
        _process_open += 1
        return None

    def _release(self, connection: _GuardedConnection) -> None:
        global _process_open
        if self._connections.pop(connection.transport, None) is None:
            return
        _process_open -= 1
        left = self._per_address.get(connection.address, 1) - 1
        if left > 0:
            self._per_address[connection.address] = left
        else:
            self._per_address.pop(connection.address, None)

    def factory(self, inner_factory):
        return lambda: _GuardedConnection(self, inner_factory())

    @web.middleware
    async def middleware(self, request: web.Request, handler):
        """Tells the connection that its headers are in (the header deadline stops) and when the answer
        is done (the keep-alive deadline starts). Put it first in the application's middlewares."""
        connection = self._connections.get(request.transport) if request.transport is not None else None
        if connection is not None:
            connection.request_started()
        try:
            return await handler(request)
        finally:
            if connection is not None:
                connection.request_finished()


class GuardedSite(web.TCPSite):
    """A TCP site whose connections pass the guard. Use with `web.AppRunner(app, **runner_options(...))`."""

    __slots__ = ("_guard",)

    def __init__(self, runner: web.BaseRunner, guard: ConnectionGuard, host: str | None = None,
                 port: int | None = None, **kwargs):
        super().__init__(runner, host, port, **kwargs)
        self._guard = guard

    async def start(self) -> None:
        """asyncio accepts up to `backlog` connections per wake-up of the listening socket, and the guard can
        refuse one only once it is accepted, so a flood may hold `fd_budget()` connections plus a whole burst.
        The burst is kept within the descriptor reserve (ACCEPT_BURST), so accept() never meets EMFILE; the
        kernel's queue of connections waiting to be accepted keeps the site's backlog."""
        self._runner._reg_site(self)
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(
            self._guard.factory(self._runner.server), self._host, self._port, ssl=self._ssl_context,
            backlog=min(self._backlog, ACCEPT_BURST), reuse_address=self._reuse_address,
            reuse_port=self._reuse_port)
        for sock in self._server.sockets:  # the queue itself as long as asked (listen() on a duplicate of it)
            with socket.socket(fileno=os.dup(sock.fileno())) as same:
                same.listen(self._backlog)
        self._bound_port = self._server.sockets[0].getsockname()[1] if self._server.sockets else self._port


async def defer_continue(request: web.Request) -> None:
    """An expect_handler that sends no `100 Continue` before the handler has looked at the headers."""
    return None


def check_body_headers(request: web.Request, limit: int, json_body: bool = True) -> None:
    """What the headers say about the body: encoding, type, declared length. Raises BodyRefusal."""
    encodings = [e.strip().lower() for v in request.headers.getall("Content-Encoding", []) for e in v.split(",")]
    if any(e not in ("", "identity") for e in encodings):
        raise BodyRefusal(ErrorCode.UNSUPPORTED_MEDIA_TYPE,
                          "compressed request bodies are not accepted; send the body uncompressed")
    if json_body and (request.body_exists or request.method == "POST"):
        content_type = request.headers.get("Content-Type", "")
        if content_type.split(";")[0].strip().lower() != JSON_CONTENT_TYPE:
            raise BodyRefusal(ErrorCode.UNSUPPORTED_MEDIA_TYPE,
                              f"Content-Type must be {JSON_CONTENT_TYPE}")
    length = request.content_length
    if length is not None and length > limit:
        raise BodyRefusal(ErrorCode.TOO_LARGE, f"request body is {length} bytes, above the limit of {limit}")


async def read_body(request: web.Request, limit: int, timeout_s: float, json_body: bool = True) -> bytes:
    """The raw body, at most `limit` bytes, complete within `timeout_s`; BodyRefusal otherwise."""
    check_body_headers(request, limit, json_body)
    if request.headers.get("Expect", "").lower() == "100-continue":
        await request.writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
    chunks, size = [], 0
    try:
        async with asyncio.timeout(timeout_s):
            while True:
                chunk = await request.content.read(1 << 16)
                if not chunk:
                    break
                size += len(chunk)
                if size > limit:
                    raise BodyRefusal(ErrorCode.TOO_LARGE, f"request body is above the limit of {limit} bytes")
                chunks.append(chunk)
    except TimeoutError:
        raise BodyRefusal(ErrorCode.REQUEST_TIMEOUT,
                          f"the request body did not arrive within {timeout_s:g} s") from None
    except BodyRefusal:
        raise
    except Exception as error:  # a malformed chunked body, a cut connection
        raise BodyRefusal(ErrorCode.INVALID_BODY, f"the request body could not be read ({type(error).__name__})") from None
    return b"".join(chunks)


def guarded_runner(app: web.Application, settings: GuardSettings, **kwargs) -> web.AppRunner:
    return web.AppRunner(app, **runner_options(settings), **kwargs)

