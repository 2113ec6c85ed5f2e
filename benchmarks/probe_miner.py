"""An operator's own check of a miner against hostile clients (issue 12): a bounded run of each attack,
then a signed legitimate request, and a table of what passed.

    python -m benchmarks.probe_miner --url http://127.0.0.1:8091 --wallet-name v --wallet-hotkey default

The wallet signs the legitimate requests; when the miner's gate refuses it (not a validator of the subnet),
the attacks are still checked and the legitimate request is reported as refused by the gate (a 403 is a
pass for the attacks, since it comes on headers alone). Every check has a deadline; nothing is left open.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import re
import socket
import sys
import time
import zlib
from dataclasses import dataclass
from urllib.parse import urlparse

import aiohttp

from protocol.auth import hotkey_signer, sign_request
from protocol.schemas import CAPABILITIES_PATH, GENERATE_PATH, HEALTH_PATH, FinalMessage, decode_event
from protocol.signature import verify_final


@dataclass
class Check:
    name: str
    passed: bool
    detail: str


class Probe:
    def __init__(self, url: str, keypair, miner_hotkey: str | None = None, *, header_timeout_s: float = 5.0,
                 body_timeout_s: float = 10.0, flood: int = 300, flood_address: str | None = None):
        self.url = url.rstrip("/")
        parsed = urlparse(self.url)
        self.host, self.port = parsed.hostname, parsed.port or 80
        self.keypair = keypair
        self.miner_hotkey = miner_hotkey
        self.header_timeout_s, self.body_timeout_s = header_timeout_s, body_timeout_s
        self.flood = flood
        self.flood_address = flood_address
        self.checks: list[Check] = []

    # ------------------------------------------------------------ plumbing
    def signed(self, body: bytes, path: str = GENERATE_PATH, method: str = "POST") -> dict:
        return sign_request(self.keypair, method, path, body, self.miner_hotkey)

    async def post(self, body: bytes, headers: dict, path: str = GENERATE_PATH, timeout_s: float = 60.0):
        timeout = aiohttp.ClientTimeout(total=timeout_s)
        async with aiohttp.ClientSession(timeout=timeout, auto_decompress=False) as session:
            async with session.post(self.url + path, data=body, headers=headers) as response:
                return response.status, await response.read()

    async def raw(self, data: bytes, timeout_s: float = 10.0) -> bytes:
        """Send raw bytes, read until the server closes or answers; the first bytes of its answer."""
        reader, writer = await asyncio.wait_for(asyncio.open_connection(self.host, self.port), timeout_s)
        try:
            writer.write(data)
            await writer.drain()
            return await asyncio.wait_for(reader.read(4096), timeout_s)
        finally:
            writer.close()

    def note(self, name: str, passed: bool, detail: str) -> Check:
        check = Check(name, passed, detail)
        self.checks.append(check)
        return check

    def body(self, request_id: str, **fields) -> bytes:
        values = {"request_id": request_id, "prompt_token_ids": [1, 2, 3, 4], "max_tokens": 2, "temperature": 0.0}
        values.update(fields)
        return json.dumps(values).encode()

    # ------------------------------------------------------------ checks
    async def legitimate(self, phase: str) -> Check:
        """A signed generation: 200 with a verified response signature (or the gate's 403 for a foreign wallet)."""
        body = self.body(re.sub(r"[^A-Za-z0-9._:-]+", "-", f"probe-{phase}")[:60])
        headers = {**self.signed(body), "Content-Type": "application/json"}
        started = time.monotonic()
        try:
            status, raw = await self.post(body, headers, timeout_s=30.0)
        except (aiohttp.ClientError, TimeoutError) as error:
            return self.note(f"legitimate request after {phase}", False, f"no answer: {error!r}")
        took = time.monotonic() - started
        if status == 403:
            return self.note(f"legitimate request after {phase}", True,
                             f"403 from the gate in {took:.2f} s (this wallet is not a validator here)")
        if status != 200:
            return self.note(f"legitimate request after {phase}", False, f"HTTP {status}: {raw[:200]!r}")
        events = [decode_event(line) for line in raw.splitlines() if line.strip()]
        final = events[-1] if events else None
        ok = isinstance(final, FinalMessage)
        token_ids = [t for e in events[:-1] for t in e.token_ids]
        ok = ok and verify_final(final, body, token_ids, self.miner_hotkey)
        return self.note(f"legitimate request after {phase}", ok, f"200 in {took:.2f} s, signature "
                                                                  f"{'verified' if ok else 'NOT verified'}")

    async def edge_values(self) -> Check:
        """Sampling values at and past the edges: each answered 200 or 4xx, never 5xx."""
        cases = [dict(temperature=1e-39), dict(temperature=5e-324), dict(top_p=5e-324, temperature=1.0),
                 dict(top_k=2**32 - 1, temperature=1.0), dict(temperature=1e-3, top_p=1e-6, top_k=1),
                 dict(temperature=2.0, top_p=1.0), dict(max_tokens=-5), dict(logprobs=21)]
        bad = []
        for i, case in enumerate(cases):
            body = self.body(f"edge-{i}", **case)
            status, raw = await self.post(body, {**self.signed(body), "Content-Type": "application/json"})
            if status >= 500:
                bad.append(f"{case}: {status}")
        return self.note("edge sampling values", not bad, "; ".join(bad) or f"{len(cases)} cases, no 5xx")

    async def malformed(self) -> Check:
        body = self.body("dup", max_tokens=2)
        duplicate = body[:-1] + b', "max_tokens": -5}'
        corrupt = b"\x1f\x8b\x08\x00garbage-not-gzip"
        attempts = {
            "duplicate JSON keys": (duplicate, {**self.signed(duplicate), "Content-Type": "application/json"}),
            "corrupt gzip": (corrupt, {**self.signed(corrupt), "Content-Type": "application/json",
                                       "Content-Encoding": "gzip"}),
            "corrupt deflate": (b"\x78\x9cbroken", {"Content-Type": "application/json", "Content-Encoding": "deflate"}),
            "wrong content type": (body, {**self.signed(body), "Content-Type": "text/plain"}),
            "unsigned": (body, {"Content-Type": "application/json"}),
        }
        bad = []
        for name, (data, headers) in attempts.items():
            status, _ = await self.post(data, headers)
            if not 400 <= status < 500:
                bad.append(f"{name}: {status}")
        # bytes no client library would send: a non-text byte in a header, a duplicated auth header
        headers = self.signed(body)
        lines = [f"POST {GENERATE_PATH} HTTP/1.1", f"Host: {self.host}", "Content-Type: application/json",
                 f"Content-Length: {len(body)}", "Connection: close"]
        base = "\r\n".join(lines + [f"{k}: {v}" for k, v in headers.items()]).encode()
        non_text = base.replace(b"X-Bittensor-Hotkey: ", b"X-Bittensor-Hotkey: \xff", 1) + b"\r\n\r\n" + body
        twice = base + b"\r\nX-Bittensor-Hotkey: " + headers["X-Bittensor-Hotkey"].encode() + b"\r\n\r\n" + body
        for name, data in (("non-text header byte", non_text), ("duplicated auth header", twice)):
            answer = await self.raw(data)
            status = int(answer.split(b" ", 2)[1]) if answer.startswith(b"HTTP/1.1 ") else 0
            if status != 401:
                bad.append(f"{name}: {status or 'no answer'}")
        return self.note("malformed requests get 4xx", not bad, "; ".join(bad) or "all 4xx (and 401 for auth)")

    async def big_bodies(self, count: int = 16, size: int = 63 << 20) -> Check:
        """Unauthenticated bodies of `size` bytes (plain and deflate): refused on headers, fast."""
        started = time.monotonic()
        deflated = zlib.compress(b"\0" * (1 << 20), 9)

        async def one(i: int) -> int:
            compressed = i % 2 == 1
            headers = f"POST {GENERATE_PATH} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n" \
                      f"Content-Length: {len(deflated) * 63 if compressed else size}\r\n" \
                      f"{'Content-Encoding: deflate' + chr(13) + chr(10) if compressed else ''}\r\n"
            reader, writer = await asyncio.open_connection(self.host, self.port)
            try:
                writer.write(headers.encode())
                try:
                    for _ in range(63 if compressed else 63 * 16):
                        writer.write(deflated if compressed else b"\0" * (1 << 16))
                        await asyncio.wait_for(writer.drain(), 5)
                except (ConnectionError, TimeoutError):
                    pass
                answer = await asyncio.wait_for(reader.read(64), 10)
                return int(answer.split(b" ", 2)[1]) if answer.startswith(b"HTTP/1.1 ") else 0
            except (ConnectionError, TimeoutError):
                return 0  # closed on us: refused, also fine
            finally:
                writer.close()

        statuses = await asyncio.gather(*(one(i) for i in range(count)))
        bad = [s for s in statuses if s >= 500]
        return self.note(f"{count} unauthenticated 63 MiB bodies", not bad,
                         f"answers {sorted(set(statuses))} in {time.monotonic() - started:.1f} s")

    async def slow_client(self, kind: str) -> Check:
        """Headers (or a body) sent one byte at a time: the miner must close within its deadline."""
        limit = (self.header_timeout_s if kind == "headers" else self.body_timeout_s) + 3.0
        body = self.body("slow")
        if kind == "headers":
            head, trickle = b"", f"POST {GENERATE_PATH} HTTP/1.1\r\nHost: x\r\nX-Slow: ".encode() + b"a" * 4000
        else:
            signed = "".join(f"{k}: {v}\r\n" for k, v in self.signed(body).items())
            head = (f"POST {GENERATE_PATH} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                    f"Content-Length: {len(body)}\r\n{signed}\r\n").encode()
            trickle = body
        reader, writer = await asyncio.open_connection(self.host, self.port)
        started = time.monotonic()
        closed_after = None
        try:
            writer.write(head)
            for byte in trickle:
                writer.write(bytes([byte]))
                try:
                    await writer.drain()
                    data = await asyncio.wait_for(reader.read(4096), 0.5)
                except TimeoutError:
                    data = None
                except ConnectionError:
                    data = b""
                if data is not None:  # an answer (408/403) or EOF: the server ended it
                    closed_after = time.monotonic() - started
                    break
                if time.monotonic() - started > limit + 5:
                    break
        finally:
            writer.close()
        ok = closed_after is not None and closed_after <= limit
        return self.note(f"slow {kind} closed", ok, f"closed after {closed_after:.1f} s" if closed_after
                         else f"still open after {time.monotonic() - started:.1f} s")

    async def idle_flood(self) -> Check:
        """`flood` idle connections, then /health and a legitimate request must still be served within 1 s."""
        sockets = []
        loop = asyncio.get_running_loop()
        for _ in range(self.flood):
            s = socket.socket()
            s.setblocking(False)
            try:
                if self.flood_address:
                    s.bind((self.flood_address, 0))
                await asyncio.wait_for(loop.sock_connect(s, (self.host, self.port)), 2)
                sockets.append(s)
            except (OSError, TimeoutError):
                s.close()
        try:
            started = time.monotonic()
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as session:
                async with session.get(self.url + HEALTH_PATH) as response:
                    await response.read()
                    status = response.status
            took = time.monotonic() - started
            legit = await self.legitimate("an idle flood (connections still open)")
            return self.note(f"/health during {len(sockets)} idle connections", status == 200 and took < 1.0,
                             f"HTTP {status} in {took:.2f} s; legitimate: {legit.detail}")
        except (aiohttp.ClientError, TimeoutError) as error:
            return self.note(f"/health during {len(sockets)} idle connections", False, repr(error))
        finally:
            for s in sockets:
                s.close()

    async def run(self) -> list[Check]:
        await self.legitimate("start")
        for phase, attack in (("edge values", self.edge_values), ("malformed requests", self.malformed),
                              ("big bodies", self.big_bodies), ("slow headers", lambda: self.slow_client("headers")),
                              ("slow body", lambda: self.slow_client("body")), ("idle flood", self.idle_flood)):
            try:
                await attack()
            except Exception as error:  # a probe that breaks is a failed check, with its reason
                self.note(phase, False, f"the probe failed: {error!r}")
            await self.legitimate(phase)
        return self.checks


def table(checks: list[Check]) -> str:
    width = max(len(c.name) for c in checks)
    lines = [f"{'check':<{width}}  result  detail", "-" * (width + 40)]
    lines += [f"{c.name:<{width}}  {'pass' if c.passed else 'FAIL':<6}  {c.detail}" for c in checks]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", required=True)
    parser.add_argument("--miner-hotkey", required=True, help="the miner's ss58 hotkey (requests are bound to it)")
    parser.add_argument("--wallet-name", required=True)
    parser.add_argument("--wallet-hotkey", default="default")
    parser.add_argument("--wallet-path", default="~/.bittensor/wallets")
    parser.add_argument("--header-timeout-s", type=float, default=5.0)
    parser.add_argument("--body-timeout-s", type=float, default=10.0)
    parser.add_argument("--flood", type=int, default=300)
    parser.add_argument("--flood-address", default=None, help="source address of the idle flood (e.g. 127.0.0.2)")
    args = parser.parse_args(argv)
    import bittensor as bt  # noqa: PLC0415

    wallet = bt.Wallet(args.wallet_name, args.wallet_hotkey, path=args.wallet_path)
    probe = Probe(args.url, hotkey_signer(wallet), args.miner_hotkey, header_timeout_s=args.header_timeout_s,
                  body_timeout_s=args.body_timeout_s, flood=args.flood, flood_address=args.flood_address)
    checks = asyncio.run(probe.run())
    print(table(checks))
    return 0 if all(c.passed for c in checks) else 1


if __name__ == "__main__":
    sys.exit(main())
