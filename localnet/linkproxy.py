"""A userspace delay-and-rate link for emulating stage links on loopback (this machine's kernel has no netem).

`DelayLink(target_port, one_way_delay_s, rate_bps)` listens on 127.0.0.1 and relays every TCP connection to
the target, delaying each direction by the one-way delay and serialising it at `rate_bps` (bits per second;
None for no limit): a chunk of b bytes leaves the link at max(arrival, link free) + 8b / rate and arrives one
delay later, in order. A request-response over the link costs one RTT = 2 x delay plus serialisation.
Delay and rate may be changed while it runs (they apply to chunks read afterwards). `cut()` drops every
connection over the link and refuses new ones (closed at once, as a broken link's peer sees it) until
`restore()`.
"""
from __future__ import annotations

import asyncio
import time


class DelayLink:
    def __init__(self, target_port: int, one_way_delay_s: float = 0.0, rate_bps: float | None = None,
                 target_host: str = "127.0.0.1", listen_port: int = 0):
        self.target = (target_host, target_port)
        self.delay_s = one_way_delay_s
        self.rate_bps = rate_bps
        self.listen_port = listen_port
        self._server: asyncio.AbstractServer | None = None
        self._tasks: set[asyncio.Task] = set()
        self._writers: set[asyncio.StreamWriter] = set()
        self.bytes_relayed = 0
        self.is_cut = False

    @property
    def open_sockets(self) -> int:
        """Sockets of the connections it relays now (two a connection: the client's and the target's)."""
        return len(self._writers)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.listen_port}"

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._accept, "127.0.0.1", self.listen_port)
        self.listen_port = self._server.sockets[0].getsockname()[1]

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
        for t in list(self._tasks):
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    def cut(self) -> None:
        """Drop every connection over the link and refuse new ones until `restore()`."""
        self.is_cut = True
        for writer in list(self._writers):
            writer.transport.abort()
        self._writers.clear()

    def restore(self) -> None:
        self.is_cut = False

    async def _accept(self, client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        if self.is_cut:
            client_w.transport.abort()
            return
        try:
            target_r, target_w = await asyncio.wait_for(asyncio.open_connection(*self.target), 5.0)
        except (OSError, asyncio.TimeoutError):
            client_w.close()
            return
        self._writers.update((client_w, target_w))
        for src, dst in ((client_r, target_w), (target_r, client_w)):
            task = asyncio.ensure_future(self._direction(src, dst))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _direction(self, src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
        queue: asyncio.Queue = asyncio.Queue()
        free_at = 0.0

        async def deliver() -> None:
            try:
                while True:
                    item = await queue.get()
                    if item is None:
                        break
                    at, data = item
                    wait = at - time.monotonic()
                    if wait > 0:
                        await asyncio.sleep(wait)
                    dst.write(data)
                    await dst.drain()
            finally:
                dst.close()
                self._writers.discard(dst)

        sender = asyncio.ensure_future(deliver())
        try:
            while True:
                data = await src.read(65536)
                if not data:
                    break
                now = time.monotonic()
                depart = max(now, free_at) + (len(data) * 8 / self.rate_bps if self.rate_bps else 0.0)
                free_at = depart
                self.bytes_relayed += len(data)
                queue.put_nowait((depart + self.delay_s, data))
        except (ConnectionError, OSError):
            pass
        finally:
            queue.put_nowait(None)
            try:
                await sender
            except (ConnectionError, OSError):
                pass
