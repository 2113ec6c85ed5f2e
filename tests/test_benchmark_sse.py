"""The benchmark's lean stream reader: server-sent events as the standard frames them (CR, LF or
CRLF line ends, comments, multi-line data, split anywhere), from a real HTTP server on loopback; and a
stream left before its end (a deadline, a cancelled run) closes its connection, so that the server
sees the client go, and leaves no descriptor behind."""
import asyncio
import gc
import json
import os

import aiohttp
import psutil
import pytest
from aiohttp import web

from benchmarks import endpoint as bench
from benchmarks.endpoint import sse_data
from protocol.client import ClientTimeouts, MinerTimeout

BODY = (b": a comment\r\ndata: {\"a\":\r\ndata: 1}\r\n\r\nretry: 10\rdata: two\r\rdata: three\n\n"
        b"data: caf\xc3\xa9\n\ndata: [DONE]\n\ndata: never ended")


async def _read(pieces):
    async def stream(request):
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        for piece in pieces:
            await response.write(piece)
            await asyncio.sleep(0.01)
        await response.write_eof()
        return response

    app = web.Application()
    app.router.add_get("/", stream)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as session:
            async with session.get(f"http://127.0.0.1:{port}/") as response:
                return [data async for data in sse_data(response)]
    finally:
        await runner.cleanup()


def test_events_are_framed_as_the_standard_says_however_the_body_is_split():
    want = ['{"a":\n1}', "two", "three", "café", "[DONE]"]
    assert asyncio.run(_read([BODY])) == want
    # split inside a CRLF, inside a UTF-8 character, and byte by byte
    crlf, utf8 = BODY.index(b"\r\n") + 1, BODY.index(b"\xc3") + 1
    cut = [BODY[:crlf], BODY[crlf:utf8], BODY[utf8:]]
    assert asyncio.run(_read(cut)) == want
    assert asyncio.run(_read([BODY[k:k + 1] for k in range(len(BODY))])) == want


# ---------------------------------------------------------------- leaving a stream before its end
class EndlessCompletions:
    """A real HTTP server shaped like vLLM's completions stream that never ends on its own: one token
    every 10 ms, or (stall=True) three tokens and then silence. It notes when the client goes away,
    which is all vLLM has to abort a request on (it aborts only on a disconnect)."""

    def __init__(self):
        self.sent = 0
        self.stall = False
        self.gone = asyncio.Event()
        app = web.Application()
        app.router.add_get("/v1/models", self.models)
        app.router.add_post("/v1/completions", self.completions)
        self.runner = web.AppRunner(app, access_log=None)

    async def start(self) -> str:
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        self.port = self.runner.addresses[0][1]
        return f"http://127.0.0.1:{self.port}"

    async def models(self, request):
        return web.json_response({"data": [{"id": "endless", "max_model_len": 512}]})

    async def completions(self, request):
        self.sent, self.gone = 0, asyncio.Event()
        await request.read()
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        chunk = {"choices": [{"index": 0, "text": "a", "finish_reason": None, "logprobs": {
            "tokens": ["token_id:97"], "token_logprobs": [-0.5], "top_logprobs": [{"token_id:97": -0.5}]}}]}
        line = b"data: " + json.dumps(chunk).encode() + b"\n\n"
        try:
            while request.transport is not None and not request.transport.is_closing():
                if not (self.stall and self.sent >= 3):
                    await response.write(line)
                    self.sent += 1
                await asyncio.sleep(0.01)
        except ConnectionError:  # aiohttp's "cannot write to closing transport"
            pass
        self.gone.set()
        return response

    def open_connections(self) -> int:
        """This process's established TCP connections to the server (the client's ends)."""
        return sum(1 for c in psutil.Process().net_connections("tcp")
                   if c.raddr and c.raddr.port == self.port and c.status == psutil.CONN_ESTABLISHED)


def open_fds() -> int:
    gc.collect()  # (what an earlier test left for the collector is not counted)
    return len(os.listdir("/proc/self/fd"))


async def test_leaving_a_stream_early_closes_its_connection_and_leaks_nothing(tokenizer):
    server = EndlessCompletions()
    url = await server.start()
    fds_before = open_fds()
    endpoint = bench.OpenAIEndpoint(bench.TargetSettings(openai_url=url, model="endless"),
                                    ClientTimeouts(first_byte=10.0, between_events=0.3, total=60.0), concurrency=1)
    try:
        await endpoint.capabilities(tokenizer)
        endpoint.engine._health_task.cancel()  # (its /v1/models polls are not what is counted here)
        kept = server.open_connections()  # the adapter's health check keeps its own connection
        for k in range(10):
            request = bench.GenerateRequest(request_id=f"leave-{k}", prompt_token_ids=[1, 2, 3], max_tokens=400,
                                            logprobs=1)
            server.stall = k % 2 == 1
            if server.stall:  # left by the stall deadline
                with pytest.raises(MinerTimeout) as failure:
                    await endpoint.generate(request)
                assert failure.value.kind == "between_events" and len(failure.value.partial.token_ids) == 3
            else:  # left by the run's cancellation (a deadline, Ctrl-C) in the middle of the stream
                task = asyncio.create_task(endpoint.generate(request))
                while server.sent < 5:
                    await asyncio.sleep(0.005)
                task.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await task
            # the server sees the client go at once, and no connection is kept for a body left unread
            await asyncio.wait_for(server.gone.wait(), 2.0)
            assert server.open_connections() == kept, k
    finally:
        await endpoint.close()
        await server.runner.cleanup()
    await asyncio.sleep(0.05)  # (closed transports give their descriptors back on the next loop turns)
    assert open_fds() <= fds_before  # nothing grows across the streams left
