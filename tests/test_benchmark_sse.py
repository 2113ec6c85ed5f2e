"""The benchmark's lean stream reader: server-sent events as the standard frames them (CR, LF or
CRLF line ends, comments, multi-line data, split anywhere), from a real HTTP server on loopback."""
import asyncio

import aiohttp
from aiohttp import web

from neurons.benchmark import sse_data

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
