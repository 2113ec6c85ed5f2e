"""The stage miner's HTTP server: one `Stage` (a layer block) behind the signed stage wire (protocol/stage.py).

POST /stage/open|forward|rewind|fork|close are btauth/1-signed for this stage's hotkey. Order of checks on
every request: body size (413), btauth (401/403), parsing and bounds (400/413), the session (404 unknown,
403 wrong sender, 409 wrong position), the activations (400 wrong shape or non-finite); any refusal leaves
the session as it was. A forward may carry a rewind (`ForwardHeader.rewind`): it is checked like the rewind
message once the session's earlier forwards have run, and done in the worker right before the forward. A
forward is answered 202 once accepted; the stage then computes it (in order per
session, in a worker thread), appends its signed receipt and sends the output on to the next stage, or the
head's result to the route driver; failures go to the driver as an error result naming the failed hop.

GET /stage/capabilities returns the stage's capabilities signed by its hotkey (layer range, fingerprint of
exactly its tensors, the numerics it computes and sends in, capacity, measured step time, how long it keeps its
ledger); GET /stage/health is a cheap liveness probe.

POST /stage/ledger answers a session's record (neurons/swarm/ledger.py): every step's input and output bytes with
the receipt signed for them, for `retain_s` after the session ran. Only the callers `ledger_readers` admits may
ask (the subnet's validators; None: any signed caller).

Every answer carries X-Request-Id and makes one access-log line (neurons.base.observability.observed_app, component
"stage", the caller's hotkey once verified); `metrics` (neurons/swarm/metrics.py) counts forwards, tokens,
refusals and failures, and times each forward's compute.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import time
from dataclasses import dataclass

import aiohttp
import torch
from aiohttp import web
from bittensor.http_auth import InMemoryNonceStore

from inference.model.k3 import ResidualState
from inference.swarm.stage import HeadOutput, Stage, StageError
from inference.version import __version__
from neurons.base.engine_wire import stage_sampling_params
from neurons.base.observability import CALLER, observed_app
from neurons.swarm.codec import decode_inputs, encode_head_output, encode_state
from neurons.swarm.ledger import StageLedger
from neurons.swarm.metrics import StageMetrics
from neurons.swarm.signed_http import post_signed
from protocol.auth import AuthFailure, verify_request
from protocol.http_server import ConnectionGuard, GuardedSite, GuardSettings, runner_options
from protocol.schemas import error_body
from protocol.stage import (CAPABILITIES_PATH, CLOSE_PATH, DEFAULT_MAX_BODY_BYTES, FORK_PATH, FORWARD_PATH,
                            FRAME_CONTENT_TYPE, HEALTH_PATH, LEDGER_PATH, MAX_HEADER_BYTES, OPEN_PATH, RESULT_PATH,
                            REWIND_PATH, CloseRequest, ForkRequest, ForwardHeader, Hop, LedgerRequest, OpenRequest,
                            ResultError, ResultHeader, RewindRequest, StageWireError, decode_forward, encode_frame,
                            parse_model, sign_capabilities, sign_receipt, state_sha256)

log = logging.getLogger("k3.stage")


@dataclass(frozen=True)
class StageServerSettings:
    host: str = "127.0.0.1"
    port: int = 0
    public_url: str = ""  # what others reach this stage at (default http://host:port)
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    hop_timeout_s: float = 5.0  # sending to the next hop (connect + its 202)
    wire_dtype: str = "float32"  # what this stage sends on: float32 or bfloat16
    expiry_interval_s: float = 5.0
    watch_interval_s: float = 0.5  # how often a sharded block's shard set is checked (a dead one is restarted)
    restart_backoff_s: float = 5.0  # after a failed restart, wait this long before the next attempt
    # the ledger: every session's inputs and outputs as signed, for validators to check after the fact
    retain_s: float = 900.0
    ledger_bytes: int = 256 << 20
    # drivers and neighbouring stages are few addresses with many connections each
    guard: GuardSettings = GuardSettings(max_connections=512, max_connections_per_address=256)


class StageServer:
    def __init__(self, stage: Stage, keypair, settings: StageServerSettings = StageServerSettings(),
                 nonce_store=None, metrics: StageMetrics | None = None, ledger_readers=None):
        """`ledger_readers(hotkey) -> bool`: who may read the ledger (None: any signed caller)."""
        self.stage = stage
        self.ledger = StageLedger((stage.layers.start, stage.layers.stop), settings.retain_s, settings.ledger_bytes)
        self.ledger_readers = ledger_readers
        self.metrics = metrics or StageMetrics(str(stage.layers))
        self.metrics.sessions_open.labels(self.metrics.layers).set_function(lambda: len(self.stage.sessions))
        self.keypair = keypair
        self.hotkey = keypair.ss58_address
        self.settings = settings
        self.nonce_store = nonce_store or InMemoryNonceStore()
        self._executor = concurrent.futures.ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="stage", initializer=torch.set_num_threads,
            initargs=(torch.get_num_threads(),))
        self._queued: dict[str, int] = {}  # session -> position once the accepted forwards have run
        self._tails: dict[str, asyncio.Future] = {}  # session -> its last accepted forward's task
        self._runner: web.AppRunner | None = None
        self._http: aiohttp.ClientSession | None = None
        self._expiry: asyncio.Task | None = None
        self._watch: asyncio.Task | None = None
        self.port = settings.port
        self.refused = 0
        self.rewinds = {"message": 0, "forward": 0}  # rewinds done, by how they came (the message, a forward)

    # ------------------------------------------------------------ lifecycle
    @property
    def url(self) -> str:
        return self.settings.public_url or f"http://{self.settings.host}:{self.port}"

    async def start(self) -> None:
        guard = ConnectionGuard(self.settings.guard, "stage wire")
        app = observed_app("stage", guard, observe=self.metrics.observe_request,
                           client_max_size=self.settings.max_body_bytes + MAX_HEADER_BYTES + 64)
        app.router.add_get(HEALTH_PATH, self.handle_health)
        app.router.add_get(CAPABILITIES_PATH, self.handle_capabilities)
        app.router.add_post(OPEN_PATH, self._wrap(self.handle_open))
        app.router.add_post(FORWARD_PATH, self._wrap(self.handle_forward))
        app.router.add_post(REWIND_PATH, self._wrap(self.handle_rewind))
        app.router.add_post(FORK_PATH, self._wrap(self.handle_fork))
        app.router.add_post(CLOSE_PATH, self._wrap(self.handle_close))
        app.router.add_post(LEDGER_PATH, self._wrap(self.handle_ledger))
        self._http = aiohttp.ClientSession()
        self._runner = web.AppRunner(app, access_log=None, shutdown_timeout=2.0, **runner_options(guard.settings))
        await self._runner.setup()
        await GuardedSite(self._runner, guard, self.settings.host, self.settings.port).start()
        self.port = self._runner.addresses[0][1]
        self._expiry = asyncio.create_task(self._expire_loop())
        if self.stage.sharded:
            self._watch = asyncio.create_task(self._watch_shards())

    async def close(self) -> None:
        for task in (self._expiry, self._watch):
            if task:
                task.cancel()
        if self._runner:
            await self._runner.cleanup()
        if self._http:
            await self._http.close()
        self._executor.shutdown(wait=False, cancel_futures=True)

    async def _in_worker(self, fn, *args):
        """Run a call that takes the stage's lock in the compute thread, so the event loop never waits on a
        forward in progress (acks and health probes stay prompt)."""
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)

    async def _expire_loop(self) -> None:
        while True:
            await asyncio.sleep(self.settings.expiry_interval_s)
            for sid in await self._in_worker(self.stage.expire_idle):
                self._queued.pop(sid, None)
                self._tails.pop(sid, None)

    async def _watch_shards(self) -> None:
        """A sharded block: when its shard set failed (a process died or stopped beating, noticed here or by a
        forward), drop its sessions and restart it; the stage refuses opens (503) and says so in /health and
        its capabilities until the fresh set serves."""
        while True:
            await asyncio.sleep(self.settings.watch_interval_s)
            try:
                state, detail = await asyncio.to_thread(self.stage.status)
            except Exception as e:  # noqa: BLE001 (the store itself is gone: the set is as good as dead)
                state, detail = "failed", f"{type(e).__name__}: {e}"
            if state != "failed":
                continue
            log.warning("stage %s: shard set failed (%s); dropping %d sessions and restarting it",
                        self.stage.layers, detail, len(self.stage.sessions))
            self.stage.shard_state, self.stage.shard_detail = "failed", detail
            self.metrics.failed("shard_set_failed")
            try:
                await self._in_worker(self.stage.restart_shards)
            except Exception as e:  # noqa: BLE001 (stays "failed"; the next round tries again)
                log.error("stage %s: restarting the shard set failed: %s", self.stage.layers, e)
                await asyncio.sleep(self.settings.restart_backoff_s)
            else:
                log.warning("stage %s: shard set restarted (restart %d); serving again", self.stage.layers,
                            self.stage.shard_restarts)
            for sid in [sid for sid in self._queued if sid not in self.stage.sessions]:
                self._queued.pop(sid, None)
                self._tails.pop(sid, None)

    def warm_up(self) -> None:
        """One single-token forward on a throwaway session, so the capabilities carry a measured step time."""
        cfg, layers = self.stage.config, self.stage.layers
        sid = "warmup"
        self.stage.open(sid)
        try:
            if layers.has_embedding:
                x = torch.tensor([1])
            else:
                g = torch.Generator().manual_seed(0)
                x = ResidualState((1,), [torch.randn(1, cfg.hidden_size, generator=g)
                                         for _ in range(self.stage.input_blocks)],
                                  torch.randn(1, cfg.hidden_size, generator=g))
            for p in range(3):
                self.stage.decode_ms = None  # keep the last (warm) measurement only
                self.stage.forward(sid, p, x, mode="sample" if layers.has_head else "none")
        finally:
            self.stage.close(sid)

    # ------------------------------------------------------------ plumbing
    def _wrap(self, handler):
        async def run(request: web.Request) -> web.StreamResponse:
            try:
                body = await request.read()
                caller = verify_request(request.headers, body, request.method, request.raw_path, self.hotkey,
                                        self.nonce_store)
                request[CALLER] = caller  # for the access log
                return await handler(caller, body)
            except web.HTTPRequestEntityTooLarge:
                self._refuse("body_too_large")
                return _error(413, "body_too_large", f"bodies are limited to {self.settings.max_body_bytes} bytes")
            except AuthFailure as e:
                self._refuse(e.code)
                return web.Response(status=e.status, body=e.to_json(), content_type="application/json")
            except (StageWireError, StageError) as e:
                self._refuse(e.code)
                return _error(e.status, e.code, e.message)
        return run

    def _refuse(self, reason: str) -> None:
        self.refused += 1
        self.metrics.refused(reason)

    def _timed_forward(self, header: ForwardHeader, inputs):
        """stage.forward in the compute thread (after the rewind the header carries, if any); its compute time
        goes to the metrics."""
        t0 = time.perf_counter()
        if header.rewind is not None:
            out = self.stage.rewind_and_forward(header.session, header.rewind, header.position, inputs, header.mode,
                                                header.targets, header.top_k)
        else:
            out = self.stage.forward(header.session, header.position, inputs, header.mode, header.targets,
                                     header.top_k)
        tokens = int(inputs.shape[0]) if isinstance(inputs, torch.Tensor) else int(inputs.partial.shape[0])
        self.metrics.forward(header.mode, tokens, time.perf_counter() - t0)
        return out

    def _owned(self, caller: str, session_id: str):
        session = self.stage.get(session_id)
        if caller != session.owner:
            raise StageError(403, "not_owner", "only the party that opened a session may control it")
        return session

    async def _drain(self, session_id: str, timeout_s: float) -> None:
        tail = self._tails.get(session_id)
        if tail is not None and not tail.done():
            try:
                await asyncio.wait_for(asyncio.shield(tail), timeout_s)
            except asyncio.TimeoutError:
                raise StageError(409, "session_busy", "the session still has forwards in progress") from None

    # ------------------------------------------------------------ handlers
    async def handle_health(self, request: web.Request) -> web.Response:
        """200 {"status": "ok", ...} while serving; 503 with status "failed" or "restarting" (and why) while a
        sharded block's shard set is down or being restarted."""
        st = self.stage
        state, detail = await asyncio.to_thread(st.status) if st.sharded else ("ok", "")
        body = {"status": state, "layers": [st.layers.start, st.layers.stop], "hotkey": self.hotkey,
                "sessions": len(st.sessions), "forwards": st.forwards, "tokens": st.tokens,
                "step_ms": st.decode_ms, "evicted": st.evicted, "expired": st.expired,
                "refused": self.refused, "rewinds": dict(self.rewinds), "ledger_bytes": self.ledger.nbytes,
                "ledger_max_bytes": self.ledger.max_bytes}
        if st.sharded:
            body["shards"] = {**st.shard_layout(), "restarts": st.shard_restarts, "lost_sessions": st.lost_sessions,
                              "pids": sorted(st.model.pids.values())}
        if detail:
            body["detail"] = detail
        return web.json_response(body, status=200 if state == "ok" else 503)

    def capabilities(self):
        cfg, st = self.stage.config, self.stage
        return sign_capabilities(
            self.keypair, model_id=cfg.model_id, config_hash=cfg.config_hash(), num_layers=cfg.num_layers,
            hidden_size=cfg.hidden_size, vocab_size=cfg.vocab_size, layers=[st.layers.start, st.layers.stop],
            embedding=st.layers.has_embedding, head=st.layers.has_head, fingerprint=st.fingerprint or "unknown",
            capacity=st.capacity(), step_ms=st.decode_ms, dtype=st.numerics, wire_dtype=self.settings.wire_dtype,
            retain_s=self.settings.retain_s, max_body_bytes=self.settings.max_body_bytes,
            url=self.url, software_version=__version__, signed_at=time.time())

    async def handle_capabilities(self, request: web.Request) -> web.Response:
        return web.Response(body=self.capabilities().model_dump_json().encode(), content_type="application/json")

    async def handle_open(self, caller: str, body: bytes) -> web.Response:
        req: OpenRequest = parse_model(OpenRequest, body, "open")
        self.stage.check_serving()  # here, not behind a restart in the compute thread
        if not self.stage.layers.has_head and req.downstream is None:
            raise StageError(400, "no_downstream", "a stage that is not the last one needs a downstream hop")
        session = await self._in_worker(lambda: self.stage.open(
            req.session, route_id=req.route_id, seed=req.seed, prompt_tokens=req.prompt_tokens, owner=caller,
            upstream=req.upstream, sampling=stage_sampling_params(req.sampling),
            downstream=req.downstream.model_dump() if req.downstream else {}, reply_to=req.reply_to.model_dump()))
        self._queued[req.session] = session.position
        self.ledger.open(req.route_id, req.session, req.sampling, req.seed)
        return web.json_response({"session": req.session, "position": session.position})

    async def handle_forward(self, caller: str, body: bytes) -> web.Response:
        header, tensors, raw = decode_forward(body, self.settings.max_body_bytes)
        session = self.stage.get(header.session)
        if caller != session.upstream:
            raise StageError(403, "wrong_sender", "this session takes forwards only from its upstream hop")
        if header.route_id != session.route_id:
            raise StageError(400, "wrong_route", "the forward names another route than the session's")
        inputs = decode_inputs(tensors, self.stage.layers.has_embedding, self.stage.config.hidden_size)
        queued = self._queued.get(header.session, session.position)
        if header.rewind is not None:  # judged on the session as the forwards before it left it
            self.stage.check_rewind(session, header.rewind, queued)
            await self._drain(header.session, self.settings.hop_timeout_s)
            session = self.stage.get(header.session)
            self.stage.check_rewind(session, header.rewind)
            queued = header.rewind
        n = self.stage.check_forward(session, header.position, inputs, header.mode, header.targets, header.top_k,
                                     expected_position=queued)
        self._queued[header.session] = header.position + n
        if header.rewind is not None:
            self.rewinds["forward"] += 1
        input_sha = state_sha256(header.tensors, bytes(raw))
        previous = self._tails.get(header.session)
        self._tails[header.session] = asyncio.ensure_future(
            self._process(header, inputs, input_sha, previous, bytes(raw)))
        return web.json_response({"accepted": header.step}, status=202)

    async def handle_rewind(self, caller: str, body: bytes) -> web.Response:
        req: RewindRequest = parse_model(RewindRequest, body, "rewind")
        self._owned(caller, req.session)
        await self._drain(req.session, self.settings.hop_timeout_s)
        position = await self._in_worker(self.stage.rewind, req.session, req.position)
        self._queued[req.session] = position
        self.rewinds["message"] += 1
        return web.json_response({"session": req.session, "position": position})

    async def handle_fork(self, caller: str, body: bytes) -> web.Response:
        req: ForkRequest = parse_model(ForkRequest, body, "fork")
        self._owned(caller, req.session)
        await self._drain(req.session, self.settings.hop_timeout_s)
        copy = await self._in_worker(self.stage.fork, req.session, req.new_session)
        self._queued[req.new_session] = copy.position
        return web.json_response({"session": req.new_session, "position": copy.position})

    async def handle_ledger(self, caller: str, body: bytes) -> web.Response:
        req: LedgerRequest = parse_model(LedgerRequest, body, "ledger")
        if self.ledger_readers is not None and not self.ledger_readers(caller):
            raise StageError(403, "not_a_validator", "only the subnet's validators may read a stage's ledger")
        frame = self.ledger.answer(req.route_id, req.session, req.from_step, self.settings.max_body_bytes)
        if frame is None:
            raise StageError(404, "not_retained", f"no record of session {req.session} of route {req.route_id} "
                                                  f"(records are kept {self.settings.retain_s:g} s)")
        return web.Response(body=frame, content_type=FRAME_CONTENT_TYPE)

    async def handle_close(self, caller: str, body: bytes) -> web.Response:
        req: CloseRequest = parse_model(CloseRequest, body, "close")
        self._owned(caller, req.session)
        await self._drain(req.session, self.settings.hop_timeout_s)
        await self._in_worker(self.stage.close, req.session)
        self._queued.pop(req.session, None)
        self._tails.pop(req.session, None)
        return web.json_response({"session": req.session, "closed": True})

    # ------------------------------------------------------------ compute and send on
    async def _process(self, header: ForwardHeader, inputs, input_sha: str, previous, input_body: bytes) -> None:
        if previous is not None:
            try:
                await previous
            except Exception:  # noqa: BLE001 (its failure was reported already)
                pass
        session = self.stage.sessions.get(header.session)
        if session is None:
            return
        reply_to = Hop(**session.reply_to)
        loop = asyncio.get_running_loop()
        try:
            out = await loop.run_in_executor(self._executor, self._timed_forward, header, inputs)
        except StageError as e:
            self._queued[header.session] = self.stage.sessions[header.session].position \
                if header.session in self.stage.sessions else 0
            code = "shard_set_failed" if e.code == "shard_set_failed" else "stage_refused"
            await self._report(reply_to, header, code, e.message, "")
            return
        except Exception as e:  # noqa: BLE001 (a compute failure is the driver's to know)
            log.exception("forward failed")
            await self._report(reply_to, header, "stage_failure", f"{type(e).__name__}: {e}", "")
            return
        layers = self.stage.layers
        if isinstance(out, HeadOutput):
            body = encode_head_output(out)
            out_sha = state_sha256([], body)
        else:
            specs, body = encode_state(out, self.settings.wire_dtype)
            out_sha = state_sha256(specs, body)
        receipt = sign_receipt(self.keypair, route_id=header.route_id, session=header.session, step=header.step,
                               layers=[layers.start, layers.stop], fingerprint=self.stage.fingerprint or "unknown",
                               input_sha256=input_sha, output_sha256=out_sha, driver=session.owner)
        receipts = list(header.receipts) + [receipt]
        self.ledger.add(header.route_id, header.session, step=header.step, position=header.position,
                        mode=header.mode, targets=header.targets, top_k=header.top_k, rewind=header.rewind,
                        input_specs=header.tensors, input_body=input_body,
                        output_specs=[] if isinstance(out, HeadOutput) else specs, output_body=body, receipt=receipt)
        if isinstance(out, HeadOutput):
            hop, path = reply_to, RESULT_PATH
            frame = encode_frame(ResultHeader(route_id=header.route_id, session=header.session, step=header.step,
                                              receipts=receipts), body)
        else:
            hop, path = Hop(**session.downstream), FORWARD_PATH
            frame = encode_frame(header.model_copy(update={"receipts": receipts, "tensors": specs}), body)
        try:
            status, answer = await post_signed(self._http, self.keypair, hop, path, frame, self.settings.hop_timeout_s)
        except (asyncio.TimeoutError, aiohttp.ClientError, OSError) as e:
            await self._report(reply_to, header, "next_hop_unreachable",
                               f"{hop.url} did not accept the forward in {self.settings.hop_timeout_s} s: "
                               f"{type(e).__name__}", hop.hotkey)
            return
        if status >= 300:
            await self._report(reply_to, header, "next_hop_refused",
                               f"{hop.url} answered {status}: {answer[:300].decode(errors='replace')}", hop.hotkey)

    async def _report(self, reply_to: Hop, header: ForwardHeader, code: str, message: str, blame: str) -> None:
        self.metrics.failed(code)
        frame = encode_frame(ResultHeader(route_id=header.route_id, session=header.session, step=header.step,
                                          receipts=list(header.receipts),
                                          error=ResultError(code=code, message=message[:1000], stage=self.hotkey,
                                                            blame=blame)))
        try:
            await post_signed(self._http, self.keypair, reply_to, RESULT_PATH, frame, self.settings.hop_timeout_s)
        except (asyncio.TimeoutError, aiohttp.ClientError, OSError) as e:
            log.warning("could not report %s to the route driver at %s: %s", code, reply_to.url, e)


def _error(status: int, code: str, message: str) -> web.Response:
    return web.Response(status=status, body=error_body(code, message), content_type="application/json")


__all__ = ["StageServer", "StageServerSettings"]
