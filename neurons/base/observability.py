"""Logs and metrics plumbing shared by the miner, the validator and the gateway.

- `setup_logging(level, fmt)`: one line per event on stderr, as text or as JSON (one object per line:
  ts, level, logger, message, and the event's fields such as request_id or status).
- `observed_app(...)`: an aiohttp application with the connection guard, the access log (one line per
  HTTP request: request id, caller hotkey or API key id, method, path, status, duration), a hook to
  observe the same in Prometheus (`request_middleware`), and the request id sent back as `X-Request-Id`
  on every response, streams and errors included.
- `MetricsServer`: Prometheus /metrics on 127.0.0.1 over any number of registries.
"""
from __future__ import annotations

import asyncio
import json
import logging
import re
import sys
import time
import uuid
from collections.abc import Callable, Coroutine, Iterable
from datetime import datetime, timezone
from typing import Any

from aiohttp import web
from prometheus_client import CollectorRegistry, generate_latest

from protocol.http_server import ConnectionGuard, GuardedSite, GuardSettings, runner_options

LOG_FORMATS = ("text", "json")
REQUEST_ID_HEADER = "X-Request-Id"
# A client's request id is echoed when it is a plain token; anything else gets a new id.
_SANE_REQUEST_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:+=/-]{0,63}")
access_log = logging.getLogger("k3.access")
# What a request carries for the access log (aiohttp's typed request keys): its id, and its caller once known
# (a verified hotkey, an API key's id), stored by the app as `request[CALLER] = ...`.
REQUEST_ID = web.RequestKey("request_id", str)
CALLER = web.RequestKey("caller", str)

# Attributes every LogRecord has; anything else on a record is an event field (logging's `extra=`).
_RECORD_FIELDS = set(vars(logging.LogRecord("", 0, "", 0, "", (), None))) | {"message", "asctime", "taskName"}


def event_fields(record: logging.LogRecord) -> dict:
    return {k: v for k, v in vars(record).items() if k not in _RECORD_FIELDS and not k.startswith("_")}


class TextFormatter(logging.Formatter):
    """`time level logger: message key=value ...` on one line (newlines of tracebacks escaped)."""

    def __init__(self):
        super().__init__("%(asctime)s %(levelname)s %(name)s: %(message)s")

    def format(self, record: logging.LogRecord) -> str:
        line = super().format(record)
        fields = event_fields(record)
        if fields:
            line += " " + " ".join(f"{k}={v}" for k, v in fields.items() if f"{k}=" not in record.getMessage())
        return line.replace("\r", "\\r").replace("\n", "\\n")


class JsonFormatter(logging.Formatter):
    """One JSON object per line: ts (UTC, ISO 8601), level, logger, message, the event's fields, exc."""

    def format(self, record: logging.LogRecord) -> str:
        event = {"ts": datetime.fromtimestamp(record.created, timezone.utc).isoformat(timespec="milliseconds"),
                 "level": record.levelname, "logger": record.name, "message": record.getMessage()}
        event.update(event_fields(record))
        if record.exc_info:
            event["exc"] = self.formatException(record.exc_info)
        elif record.exc_text:
            event["exc"] = record.exc_text
        return json.dumps(event, default=str, ensure_ascii=False)


def setup_logging(level: str = "INFO", fmt: str = "text", stream=None) -> None:
    """The process's logging: one handler on stderr (or `stream`) with the chosen format."""
    if fmt not in LOG_FORMATS:
        raise ValueError(f"log format {fmt!r} is not one of {LOG_FORMATS}")
    handler = logging.StreamHandler(stream or sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else TextFormatter())
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level)
    logging.getLogger("aiohttp.access").setLevel(logging.WARNING)  # ours is k3.access
    # httpx logs every request at INFO: the remote engine's health poll would add a line every 5 s
    logging.getLogger("httpx").setLevel(logging.WARNING if root.level > logging.DEBUG else logging.DEBUG)


def run_neuron(settings: Any, main: Callable[[], Coroutine[Any, Any, int]],
               setup_error: type[Exception] | tuple[type[Exception], ...], logger: str, described: str = "",
               prog: str = "") -> int:
    """An entry point's life: logging as `settings` say (log_level, log_format), `described` (the settings as
    flags) logged at DEBUG, then `main()` to its end. Its exit status, or 2 with the message on stderr (after
    "`prog`: " when given) when it raises `setup_error` (a setting that cannot work; or a tuple of them)."""
    setup_logging(settings.log_level, settings.log_format)
    if described:
        logging.getLogger(logger).debug("settings: %s", described)
    try:
        return asyncio.run(main())
    except setup_error as error:
        print(f"{prog + ': ' if prog else ''}error: {error}", file=sys.stderr)
        return 2


# ---------------------------------------------------------------- access log
def request_id_for(request: web.Request) -> str:
    """The client's X-Request-Id when it is sane (1 to 64 letters, digits and ._:+=/-, starting with a letter or
    a digit), else a new one."""
    given = request.headers.get(REQUEST_ID_HEADER, "")
    return given if _SANE_REQUEST_ID.fullmatch(given) else uuid.uuid4().hex[:16]


async def _send_request_id(request: web.Request, response: web.StreamResponse) -> None:
    """on_response_prepare: every response (a stream, an error aiohttp makes) carries the request's id."""
    if REQUEST_ID not in request:
        request[REQUEST_ID] = request_id_for(request)
    response.headers[REQUEST_ID_HEADER] = request[REQUEST_ID]


def observed_app(component: str, guard: ConnectionGuard, *middlewares, observe=None, **app_options) -> web.Application:
    """The web.Application of a listener: `guard`'s middleware first, then the access log and `observe`
    (see request_middleware), then the app's own `middlewares`; each response carries X-Request-Id."""
    app = web.Application(middlewares=[guard.middleware, request_middleware(component, observe), *middlewares],
                          **app_options)
    app.on_response_prepare.append(_send_request_id)
    return app


def request_middleware(component: str, observe: Callable[[web.Request, int, float], None] | None = None):
    """aiohttp middleware (first after the guard): a request id for every request (`request_id_for`), one
    access-log line when it ends, and `observe(request, status, seconds)` for metrics.
    The caller is what the app stored in request[CALLER] (a verified hotkey, an API key id)."""

    @web.middleware
    async def middleware(request: web.Request, handler) -> web.StreamResponse:
        request_id = request[REQUEST_ID] = request_id_for(request)
        started = time.perf_counter()
        status = 500
        try:
            response = await handler(request)
            status = response.status
            return response
        except web.HTTPException as error:
            status = error.status
            raise
        except asyncio.CancelledError:
            status = 499  # the client went away
            raise
        finally:
            seconds = time.perf_counter() - started
            if observe is not None:
                try:
                    observe(request, status, seconds)
                except Exception as error:  # metrics must never fail a request
                    logging.getLogger("k3.metrics").warning("observing %s failed: %r", request.path, error)
            caller = request.get(CALLER) or "-"
            access_log.info("%s %s %d %.1f ms", request.method, request.path, status, seconds * 1000, extra={
                "component": component, "request_id": request_id, "caller": caller, "method": request.method,
                "path": request.path, "status": status, "duration_ms": round(seconds * 1000, 3)})

    return middleware


# ---------------------------------------------------------------- /metrics
class MetricsServer:
    """Prometheus text format on http://127.0.0.1:PORT/metrics, concatenating `registries` (a callable
    returning them, so that registries made later, such as an engine's, are included)."""

    def __init__(self, registries: Callable[[], Iterable[CollectorRegistry]], host: str = "127.0.0.1",
                 port: int = 0, on_close: Callable[[], None] | None = None, component: str = "metrics"):
        self.registries = registries
        self.component = component  # in the access log
        self.host, self.port = host, port
        self.on_close = on_close
        self._runner: web.AppRunner | None = None

    def exposition(self) -> bytes:
        return b"".join(generate_latest(r) for r in self.registries())

    async def handle(self, request: web.Request) -> web.Response:
        return web.Response(body=self.exposition(), content_type="text/plain", charset="utf-8",
                            headers={"Cache-Control": "no-store"})

    async def start(self) -> int:
        # the same connection caps and header/body deadlines as every other listener (protocol.http_server)
        guard = ConnectionGuard(GuardSettings(max_connections=32, max_connections_per_address=16), "metrics")
        app = observed_app(self.component, guard, client_max_size=1024)
        app.add_routes([web.get("/metrics", self.handle)])
        self._runner = web.AppRunner(app, access_log=None, shutdown_timeout=1.0, **runner_options(guard.settings))
        await self._runner.setup()
        await GuardedSite(self._runner, guard, self.host, self.port, reuse_address=True).start()
        self.port = self._runner.addresses[0][1]
        return self.port

    async def close(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
        if self.on_close is not None:
            self.on_close()
            self.on_close = None
