"""A relaying party: talks to one stage at a time and receives that stage's output itself (it opens the session
with itself as the upstream, the downstream and the reply-to hop: `StageSink`, its own small signed endpoint).
A route driver never does this; the one party that does is a stage that secretly hands its work to another
stage (localnet/cheats/stage.py `ForwardingStage`), which the validator's decoys catch.

Every call has a timeout; what the stage answers is checked against what was sent: the receipt must be
signed by the stage's hotkey for this route, session, step and its layers, and hash exactly the input sent
and the output received (else `StageError(502, "bad_receipt")`).
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import time
from dataclasses import dataclass

import aiohttp
import torch
from aiohttp import web
from bittensor.http_auth import InMemoryNonceStore

from inference.swarm.stage import StageError
from neurons.swarm.codec import encode_ids, encode_state
from neurons.swarm.route import StageInfo
from neurons.swarm.signed_http import post_signed, start_result_site
from protocol.auth import AuthFailure, verify_request
from protocol.schemas import error_body
from protocol.stage import (CLOSE_PATH, DEFAULT_MAX_BODY_BYTES, FORWARD_PATH, MAX_HEADER_BYTES, OPEN_PATH, RESULT_PATH,
                            CloseRequest, ForwardHeader, Hop, OpenRequest, Receipt, ResultHeader, StageWireError,
                            WireSampling, WireTensorSpec, encode_frame, parse_model, split_frame, state_sha256,
                            verify_receipt)


@dataclass
class RelayedHop:
    """One stage's answer to one forward: its receipt and the exact bytes in and out."""

    receipt: Receipt
    input_specs: tuple[WireTensorSpec, ...]
    input_body: bytes
    output_specs: tuple[WireTensorSpec, ...]
    output_body: bytes
    wall_s: float


class StageSink:
    """The relaying party's endpoint: POST /stage/forward (a stage's output, sent to its downstream) and
    POST /route/result (a head's result or a stage's error report), btauth-signed for this hotkey, accepted
    only from the stage a forward is awaited from."""

    def __init__(self, keypair, host: str = "127.0.0.1", port: int = 0,
                 max_body_bytes: int = DEFAULT_MAX_BODY_BYTES, public_url: str = ""):
        self.keypair = keypair
        self.hotkey = keypair.ss58_address
        self.host, self.port = host, port
        self.public_url = public_url  # what stages reach this sink at (default http://host:port)
        self.max_body_bytes = max_body_bytes
        self.nonce_store = InMemoryNonceStore()
        self._pending: dict[tuple[str, int], tuple[str, asyncio.Future]] = {}
        self._runner: web.AppRunner | None = None

    @property
    def url(self) -> str:
        return self.public_url or f"http://{self.host}:{self.port}"

    @property
    def hop(self) -> Hop:
        return Hop(url=self.url, hotkey=self.hotkey)

    async def start(self) -> None:
        app = web.Application(client_max_size=self.max_body_bytes + MAX_HEADER_BYTES + 64)
        app.router.add_post(FORWARD_PATH, self._handle)
        app.router.add_post(RESULT_PATH, self._handle)
        self._runner, self.port = await start_result_site(app, self.host, self.port, shutdown_timeout=1.0)

    async def close(self) -> None:
        for _, fut in self._pending.values():
            if not fut.done():
                fut.cancel()
        if self._runner:
            await self._runner.cleanup()

    def expect(self, session: str, step: int, hotkey: str) -> asyncio.Future:
        fut = asyncio.get_running_loop().create_future()
        self._pending[(session, step)] = (hotkey, fut)
        return fut

    def forget(self, session: str, step: int) -> None:
        self._pending.pop((session, step), None)

    async def _handle(self, request: web.Request) -> web.Response:
        body = await request.read()
        try:
            caller = verify_request(request.headers, body, "POST", request.raw_path, self.hotkey, self.nonce_store)
            raw, payload = split_frame(body, self.max_body_bytes)
            model = ForwardHeader if request.path == FORWARD_PATH else ResultHeader
            header = parse_model(model, raw, f"{model.__name__}")
        except AuthFailure as e:
            return web.Response(status=e.status, body=e.to_json(), content_type="application/json")
        except StageWireError as e:
            return web.Response(status=e.status, body=error_body(e.code, e.message), content_type="application/json")
        waiting = self._pending.get((header.session, header.step))
        if waiting is None:
            return web.Response(status=404, body=error_body("unknown_session", "no forward awaits this output"),
                                content_type="application/json")
        hotkey, fut = waiting
        if caller != hotkey:
            return web.Response(status=403, body=error_body("wrong_sender", "not the stage this step was sent to"),
                                content_type="application/json")
        if not fut.done():
            fut.set_result((header, bytes(payload)))
        return web.json_response({"accepted": header.step}, status=202 if model is ForwardHeader else 200)


class StageRelay:
    """Open, forward and close on single stages, with every output coming back to `sink`."""

    def __init__(self, keypair, sink: StageSink, http: aiohttp.ClientSession, timeout_s: float = 10.0):
        self.keypair = keypair
        self.sink = sink
        self.http = http
        self.timeout_s = timeout_s

    async def _post(self, stage: StageInfo, path: str, body: bytes, content_type: str) -> tuple[int, bytes]:
        try:
            return await post_signed(self.http, self.keypair, stage.hop, path, body, self.timeout_s, content_type)
        except (asyncio.TimeoutError, aiohttp.ClientError, OSError) as e:
            raise StageError(503, "unreachable", f"{stage.url} did not answer {path} in {self.timeout_s} s: "
                                                 f"{type(e).__name__}") from None

    async def open(self, stage: StageInfo, session: str, route_id: str, sampling: WireSampling = WireSampling(),
                   seed: int = 0, prompt_tokens: int = 0) -> None:
        req = OpenRequest(route_id=route_id, session=session, upstream=self.keypair.ss58_address,
                          downstream=None if stage.caps.head else self.sink.hop, reply_to=self.sink.hop,
                          sampling=sampling, seed=seed, prompt_tokens=prompt_tokens)
        status, answer = await self._post(stage, OPEN_PATH, req.model_dump_json().encode(), "application/json")
        if status != 200:
            raise StageError(status, "open_refused", answer[:300].decode(errors="replace"))

    async def close(self, stage: StageInfo, session: str) -> None:
        body = CloseRequest(session=session).model_dump_json().encode()
        try:
            await self._post(stage, CLOSE_PATH, body, "application/json")
        except StageError:
            pass

    async def forward(self, stage: StageInfo, session: str, route_id: str, step: int, position: int,
                      specs: list[WireTensorSpec], body: bytes, mode: str = "none", targets=None,
                      top_k: int = 0) -> RelayedHop:
        header = ForwardHeader(route_id=route_id, session=session, step=step, position=position, mode=mode,
                               targets=targets, top_k=top_k, tensors=list(specs))
        fut = self.sink.expect(session, step, stage.hotkey)
        started = time.perf_counter()
        try:
            status, answer = await self._post(stage, FORWARD_PATH, encode_frame(header, body), "application/x-k3-stage-frame")
            if status != 202:
                raise StageError(status, "forward_refused", answer[:300].decode(errors="replace"))
            try:
                got, out_body = await asyncio.wait_for(fut, self.timeout_s)
            except asyncio.TimeoutError:
                raise StageError(504, "timeout", f"{stage.url} sent no output within {self.timeout_s} s") from None
        finally:
            self.sink.forget(session, step)
        wall = time.perf_counter() - started
        if isinstance(got, ResultHeader) and got.error is not None:
            raise StageError(502, got.error.code, got.error.message)
        out_specs = list(got.tensors)
        if not got.receipts:
            raise StageError(502, "bad_receipt", "the output came without a receipt")
        r = got.receipts[-1]
        problem = None
        if r.stage != stage.hotkey or not verify_receipt(r):
            problem = "the receipt is not signed by the stage"
        elif (r.route_id, r.session, r.step) != (route_id, session, step):
            problem = "the receipt is for another route, session or step"
        elif list(r.layers) != [stage.start, stage.stop]:
            problem = f"the receipt claims layers {r.layers}, the stage announced {[stage.start, stage.stop]}"
        elif r.input_sha256 != state_sha256(list(specs), body):
            problem = "the receipt hashes another input than the one sent"
        elif r.output_sha256 != state_sha256(out_specs, out_body):
            problem = "the receipt hashes another output than the one received"
        if problem:
            raise StageError(502, "bad_receipt", problem)
        return RelayedHop(r, tuple(specs), bytes(body), tuple(out_specs), out_body, wall)


def encode_input(inputs, dtype: str = "float32") -> tuple[list[WireTensorSpec], bytes]:
    if isinstance(inputs, torch.Tensor):
        return encode_ids([int(t) for t in inputs])
    return encode_state(inputs, dtype)


class LoopThread:
    """An asyncio loop in a daemon thread, for synchronous callers (the challenge runs in a worker thread
    beside the reference computation)."""

    def __init__(self, loop: asyncio.AbstractEventLoop | None = None):
        import threading  # noqa: PLC0415

        if loop is None:
            loop = asyncio.new_event_loop()
            threading.Thread(target=loop.run_forever, daemon=True, name="relay-loop").start()
        self.loop = loop

    def call(self, coro, timeout_s: float):
        fut = asyncio.run_coroutine_threadsafe(coro, self.loop)
        try:
            return fut.result(timeout_s)
        except concurrent.futures.TimeoutError:
            fut.cancel()
            raise StageError(504, "timeout", f"no answer within {timeout_s} s") from None


__all__ = ["LoopThread", "RelayedHop", "StageRelay", "StageSink", "encode_input"]
