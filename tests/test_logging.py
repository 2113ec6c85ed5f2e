"""Logs: one line per event, as text or JSON; the access log of a real aiohttp server."""
import asyncio
import io
import json
import logging
import re
import time

import aiohttp
import pytest
from aiohttp import web

from neurons.base.observability import CALLER, observed_app, request_middleware, setup_logging
from protocol.http_server import ConnectionGuard, GuardedSite, GuardSettings, runner_options


@pytest.fixture
def log_stream():
    stream = io.StringIO()
    yield stream
    setup_logging("WARNING", "text")  # leave the root logger as a test run expects


def test_json_logs_are_one_object_per_line_with_the_event_fields(log_stream):
    setup_logging("INFO", "json", stream=log_stream)
    logging.getLogger("k3.test").info("round %d done", 7, extra={"uid": 3, "duration_ms": 12.5})
    try:
        raise ValueError("bad\nvalue")
    except ValueError:
        logging.getLogger("k3.test").exception("failed")
    logging.getLogger("k3.test").debug("not shown at INFO")
    lines = log_stream.getvalue().splitlines()
    assert len(lines) == 2
    first, second = map(json.loads, lines)
    assert first["message"] == "round 7 done" and first["uid"] == 3 and first["level"] == "INFO"
    assert first["logger"] == "k3.test" and first["ts"].endswith("+00:00")
    assert second["level"] == "ERROR" and "ValueError: bad\nvalue" in second["exc"]


def test_text_logs_keep_a_traceback_on_one_line(log_stream):
    setup_logging("DEBUG", "text", stream=log_stream)
    try:
        raise RuntimeError("boom")
    except RuntimeError:
        logging.getLogger("k3.test").exception("multi\nline")
    lines = log_stream.getvalue().splitlines()
    assert len(lines) == 1 and "multi\\nline" in lines[0] and "RuntimeError: boom" in lines[0]
    with pytest.raises(ValueError):
        setup_logging("INFO", "yaml")


async def test_the_access_log_has_request_id_caller_status_and_duration(log_stream):
    setup_logging("INFO", "json", stream=log_stream)
    seen = []

    async def hello(request):
        request[CALLER] = "5Caller"
        return web.json_response({"ok": True}, status=201)

    app = web.Application(middlewares=[request_middleware("test", lambda r, s, t: seen.append((r.path, s, t)))])
    app.add_routes([web.get("/hello", hello)])
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    port = runner.addresses[0][1]
    try:
        async with aiohttp.ClientSession() as session:
            async with session.get(f"http://127.0.0.1:{port}/hello", headers={"X-Request-Id": "req-1"}) as r:
                assert r.status == 201
            async with session.get(f"http://127.0.0.1:{port}/missing") as r:
                assert r.status == 404
    finally:
        await runner.cleanup()
    events = [json.loads(line) for line in log_stream.getvalue().splitlines()]
    access = [e for e in events if e["logger"] == "k3.access"]
    assert [(e["path"], e["status"], e["caller"]) for e in access] == [("/hello", 201, "5Caller"), ("/missing", 404, "-")]
    assert access[0]["request_id"] == "req-1" and len(access[1]["request_id"]) == 16
    assert all(e["duration_ms"] >= 0 and e["component"] == "test" for e in access)
    assert [(p, s) for p, s, _ in seen] == [("/hello", 201), ("/missing", 404)]


async def test_every_answer_carries_the_request_id_streams_and_errors_included(log_stream):
    """observed_app (every listener's app): X-Request-Id on a JSON answer, on a stream prepared by the
    handler, on aiohttp's own 404 and on the 500 of a handler that fails; the access log has the same id."""
    setup_logging("INFO", "json", stream=log_stream)

    async def stream(request):
        response = web.StreamResponse()
        await response.prepare(request)
        await response.write(b"data: 1\n\n")
        return response

    async def boom(request):
        raise RuntimeError("handler bug")

    guard = ConnectionGuard(GuardSettings(), "test")
    app = observed_app("test", guard)
    app.add_routes([web.get("/stream", stream), web.get("/boom", boom)])
    runner = web.AppRunner(app, access_log=None, **runner_options(guard.settings))
    await runner.setup()
    await GuardedSite(runner, guard, "127.0.0.1", 0).start()
    port = runner.addresses[0][1]
    answers = []
    try:
        async with aiohttp.ClientSession() as session:
            for path, sent in (("/stream", "abc-1"), ("/missing", "x" * 65), ("/boom", None), ("/stream", "a b")):
                headers = {"X-Request-Id": sent} if sent else {}
                async with session.get(f"http://127.0.0.1:{port}{path}", headers=headers) as r:
                    await r.read()
                    answers.append((r.status, r.headers.get("X-Request-Id")))
    finally:
        await runner.cleanup()
    assert [status for status, _ in answers] == [200, 404, 500, 200]
    assert answers[0][1] == "abc-1"  # a sane id is echoed; too long, absent, with a space: a new one
    assert all(re.fullmatch(r"[0-9a-f]{16}", rid) for _, rid in answers[1:]) and len({r for _, r in answers}) == 4
    access = [json.loads(line) for line in log_stream.getvalue().splitlines() if '"k3.access"' in line]
    assert [(e["path"], e["status"], e["request_id"]) for e in access] == [
        (path, status, rid) for path, (status, rid) in zip(("/stream", "/missing", "/boom", "/stream"), answers)]


async def test_idle_keep_alive_connections_are_not_logged_as_slow_clients(caplog):
    """A connection that got its answer and then sat idle is closed at DEBUG; one that began a request's headers and
    never finished them (a slowloris client) is a warning."""
    async def ok(request):
        return web.Response(text="ok")

    guard = ConnectionGuard(GuardSettings(header_timeout_s=0.3, idle_timeout_s=0.3, log_interval_s=0.5), "test")
    app = observed_app("test", guard)
    app.add_routes([web.get("/", ok)])
    runner = web.AppRunner(app, access_log=None, **runner_options(guard.settings))
    await runner.setup()
    await GuardedSite(runner, guard, "127.0.0.1", 0).start()
    port = runner.addresses[0][1]
    try:
        with caplog.at_level(logging.DEBUG, logger="k3.http"):
            idle = []
            for _ in range(3):  # answered, then left open: what a client's connection pool does
                reader, writer = await asyncio.open_connection("127.0.0.1", port)
                writer.write(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
                await reader.readuntil(b"ok")
                idle.append(writer)
            reader, slow = await asyncio.open_connection("127.0.0.1", port)
            slow.write(b"GET / HTTP/1.1\r\nHost: x\r\n")  # headers begun, never finished
            await slow.drain()
            assert await reader.read() == b""  # closed by the guard
            deadline = time.monotonic() + 10.0  # past the idle deadlines, however busy the machine
            while guard.idle_tally.totals.get("idle keep-alive connections closed", 0) < 3:
                assert time.monotonic() < deadline, guard.idle_tally.totals
                await asyncio.sleep(0.05)
            await asyncio.sleep(0.6)  # one log interval: the tallies are written by their own timers
            for writer in idle + [slow]:
                writer.close()
    finally:
        await runner.cleanup()
    lines = [(r.levelno, r.getMessage()) for r in caplog.records if "connection guard" in r.getMessage()]
    idle_closed = [int(n) for level, m in lines if level == logging.DEBUG
                   for n in re.findall(r"(\d+) idle keep-alive connections closed", m)]
    assert sum(idle_closed) == 3, lines  # one line or several, as the closes fell into the log intervals
    warnings = [m for level, m in lines if level == logging.WARNING]
    assert len(warnings) == 1 and "1 connections closed for slow or missing headers" in warnings[0], lines
