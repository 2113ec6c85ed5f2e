"""The swarm's HTTP plumbing shared by stages, route drivers and validators: a signed POST to a hop, and the
small result endpoint a driver or relay serves."""
from __future__ import annotations

import aiohttp
from aiohttp import web

from protocol.auth import sign_request
from protocol.stage import FRAME_CONTENT_TYPE, Hop


async def start_result_site(app: web.Application, host: str, port: int,
                            shutdown_timeout: float) -> tuple[web.AppRunner, int]:
    """Serve `app` (a driver's or relay's small result endpoint) on host:port; returns the runner and the bound
    port (port 0 picks a free one)."""
    runner = web.AppRunner(app, access_log=None, shutdown_timeout=shutdown_timeout)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    await site.start()
    return runner, site._server.sockets[0].getsockname()[1]


async def post_signed(http: aiohttp.ClientSession, keypair, hop: Hop, path: str, body: bytes, timeout_s: float,
                      content_type: str = FRAME_CONTENT_TYPE) -> tuple[int, bytes]:
    """POST `body` to `hop` signed for its hotkey; (status, response bytes). Raises asyncio.TimeoutError or
    aiohttp.ClientError when the hop cannot be reached in time."""
    headers = sign_request(keypair, "POST", path, body, hop.hotkey)
    headers["Content-Type"] = content_type
    async with http.post(hop.url + path, data=body, headers=headers,
                         timeout=aiohttp.ClientTimeout(total=timeout_s)) as resp:
        return resp.status, await resp.read()


__all__ = ["post_signed", "start_result_site"]
