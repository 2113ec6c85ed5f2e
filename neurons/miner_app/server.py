"""The miner: serves Kimi K3 generations to the subnet's validators over signed HTTP.

Every authenticated request passes, in this order, and the first four on its
headers alone, before a byte of the body is read:
1. btauth/1 headers: present once each, printable ASCII, well formed, bound
   to this receiver, fresh (401, or 403 for a request signed for another miner);
2. the validator gate for the hotkey the headers claim, from the latest
   metagraph snapshot: registered on the subnet (403 not_registered), holding
   a validator permit (403 no_validator_permit), with at least the configured
   stake (403 insufficient_stake); no snapshot yet is 503;
3. the caller's budget, proportional to its share of validator stake with a
   floor: requests per window (429 rate_limited; looked at, not yet taken), and
   for generate and score streams at once (429 caller_streams), under the
   global cap of the engine's capacity (429 over_capacity). A 429 carries
   Retry-After and never waits;
4. the body's headers: uncompressed (415), application/json (415), declared
   length within the endpoint's cap (413);
5. the body, read capped per endpoint and within a deadline (413, 408), then
   the signature over it and the replay store (written only for callers that
   passed the gate), and only then a request is taken from the budget.
Connections are capped in total and per source address, and closed when their
headers or body come too slowly (protocol/http_server.py).
Only then is the body parsed (400/413 with a message naming the field) and
handed to the engine. A generation is streamed as NDJSON: the engine's first
event is awaited before the headers go out, so that a refusal by the engine
is a proper HTTP status; later failures become an `error` event. The final
event carries usage, timings, the model fingerprint and the hotkey's
signature over the exact request bytes and every emitted token id.

The metagraph is re-read in the background with a timeout; when the chain
cannot be read the last snapshot is kept and /health says so (200 while
validators can be served, 503 while they cannot). The endpoint is published on
chain at start, or once the engine serves when it does not yet (a serving rate
limit keeps the existing entry). The owner's hotkeys (--owner-hotkeys) pass the
validator gate with a budget of their own. Prometheus metrics are served on a
separate port (127.0.0.1 unless --metrics-host says otherwise).
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import signal
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from pathlib import Path

from aiohttp import web

from chain import connect
from chain.interface import Chain, ChainError, NotRegistered, RateLimited
from chain.watch import MetagraphWatch
from inference.serving import (Engine, EngineError, EngineSpec, EngineSpecError, FinalEvent as EngineFinalEvent,
                               GenerationRequest, TokenEvent as EngineTokenEvent, build_engine)
from inference.serving.state_commitment import OpeningError
from inference.version import __version__
from neurons.base.engine_wire import (final_message, opening_asks, opening_message, sampling_params,
                                      scored_position_message, token_message)
from neurons.base.observability import CALLER, observed_app
from neurons.base.settings import WalletNotFound, WalletSettings, hotkey_address, open_wallet as open_cli_wallet
from neurons.miner_app.access import (CallerBudget, CallerBudgets, Refusal, ValidatorAccess, engine_refusal,
                                      public_message, wire_code)
from neurons.miner_app.metrics import ENDPOINTS, MinerMetrics
from neurons.miner_app.settings import MinerSettings, MinerSetupError
from protocol.auth import AuthFailure, SQLiteNonceStore, check_auth_headers, hotkey_signer, verify_request
from protocol.errors import ErrorCode
from protocol.http_server import ConnectionGuard, GuardedSite, defer_continue, read_body, runner_options
from protocol.schemas import (CAPABILITIES_PATH, DEFAULT_LIMITS, GENERATE_PATH, HEALTH_PATH, JSON_CONTENT_TYPE,
                              NDJSON_CONTENT_TYPE, SCORE_PATH, STATES_PATH, Capabilities, ErrorEvent, FinalMessage,
                              GenerateRequest, Health, Limits, ProtocolError, ScoreRequest, ScoreResponse, Timings,
                              encode_event, encode_model, parse_generate, parse_score, parse_state_opening)
from protocol.signature import sign_response

log = logging.getLogger("k3.miner")

# Bodies above this are hashed, parsed and tokenised in a worker thread: a
# 64 MiB prompt would otherwise stall every other stream for a noticeable time.
OFF_LOOP_BYTES = 1 << 20
MAX_MILLIS = 1e9
# While the engine is not serving at start: look every ENGINE_POLL_S, warn every ENGINE_WAIT_WARN_S.
ENGINE_POLL_S = 0.5
ENGINE_WAIT_WARN_S = 5.0


# ---------------------------------------------------------------- requests and timings
def _millis(value: float | None, fallback: float) -> float:
    value = fallback if value is None or not math.isfinite(value) else value
    return float(min(max(value, 0.0), MAX_MILLIS))


def prompt_token_ids(request: GenerateRequest, tokenizer, chat: bool = False) -> list[int]:
    """The prompt as token ids: given ids as they are; text through the tokenizer, as one user turn of
    the chat template when `chat` is asked (the template ends with the assistant's turn opening)."""
    if request.prompt_token_ids is not None:
        return list(request.prompt_token_ids)
    if chat:
        return tokenizer.apply_chat_template([{"role": "user", "content": request.prompt}],
                                             add_generation_prompt=True, add_bos=request.add_special_tokens)
    return tokenizer.encode(request.prompt, add_bos=request.add_special_tokens)


@dataclass
class Admission:
    hotkey: str
    budget: CallerBudget
    body: bytes


# ---------------------------------------------------------------- the server
class MinerServer:
    """The HTTP API over one engine. `start()` serves; `close()` drains and stops (engine included)."""

    def __init__(self, settings: MinerSettings, *, engine: Engine, tokenizer, chain: Chain, wallet,
                 nonce_store: SQLiteNonceStore, owners: Mapping[str, str] | None = None):
        self.settings = settings
        self.engine = engine
        self.tokenizer = tokenizer
        self.chain = chain
        self.wallet = wallet  # what the chain takes for publication (a bt.Wallet, or anything with .hotkey)
        self.keypair = hotkey_signer(wallet)
        self.hotkey = self.keypair.ss58_address
        self.nonce_store = nonce_store
        caps = engine.capabilities()
        if not caps.model_fingerprint:
            raise MinerSetupError("the engine reports no model fingerprint; give --checkpoint (its k3_manifest.json "
                                  "names the model the validators check)")
        self.engine_capabilities = caps
        declared = caps.max_concurrent_sequences
        self.capacity = min(settings.access.max_streams, declared) if settings.access.max_streams else declared
        self.limits = Limits(
            max_body_bytes=settings.server.max_body_bytes,
            max_tokens=max(1, min(settings.server.max_output_tokens, caps.max_context - 1)),
            max_prompt_tokens=min(DEFAULT_LIMITS.max_prompt_tokens, caps.max_context),
            max_score_tokens=min(DEFAULT_LIMITS.max_score_tokens, caps.max_context),
        )
        self.metrics = MinerMetrics()
        self.metrics.streams_active.set_function(lambda: self.budgets.streams_in_flight)
        self.metrics.metagraph_age.set_function(lambda: self.metagraph.age_s or 0.0)
        self.metagraph = MetagraphWatch(chain, settings.chain.netuid, settings.chain.timeout_s)
        self.owners = dict(owners or {})  # the owner's hotkeys (SS58 -> name): no permit needed, own budget
        self.access = ValidatorAccess(None, settings.access, self.capacity, self.owners)
        self.budgets = CallerBudgets(settings.access.window_s, self.capacity)
        s = settings.server
        self.guard = ConnectionGuard(s.guard(), "miner API")
        self.metrics_guard = ConnectionGuard(s.guard(max_connections=32, max_connections_per_address=16),
                                             "miner metrics")
        self.app = self._build_app()
        self.draining = False
        self.port: int | None = None
        self.metrics_port: int | None = None
        self.publication: str = "not attempted"
        self._last_publish_attempt = -math.inf
        self._runner: web.AppRunner | None = None
        self._metrics_runner: web.AppRunner | None = None
        self._refresher: asyncio.Task | None = None
        self._publisher: asyncio.Task | None = None
        self._skip_grace = asyncio.Event()
        self._closed = False

    # ------------------------------------------------------------ lifecycle
    def _build_app(self) -> web.Application:
        app = observed_app("miner", self.guard, self._answer_errors, observe=self.metrics.observe_request,
                           client_max_size=self.settings.server.max_body_bytes)
        app.add_routes([
            web.post(GENERATE_PATH, self.handle_generate, expect_handler=defer_continue),
            web.post(SCORE_PATH, self.handle_score, expect_handler=defer_continue),
            web.post(STATES_PATH, self.handle_states, expect_handler=defer_continue),
            web.get(CAPABILITIES_PATH, self.handle_capabilities),
            web.get(HEALTH_PATH, self.handle_health),
        ])
        return app

    async def start(self) -> None:
        s = self.settings.server
        await self.engine.start()
        if not await self.refresh_metagraph():
            log.error("cannot read the metagraph of subnet %d yet: every validator gets 503 until a read works",
                      self.settings.chain.netuid)
        # handler_cancellation: a client that disconnects cancels its handler at once, which closes the
        # engine stream and frees the sequence even while the engine is still prefilling.
        self._runner = web.AppRunner(self.app, handler_cancellation=True, access_log=None, shutdown_timeout=2.0,
                                     **runner_options(self.guard.settings))
        await self._runner.setup()
        await GuardedSite(self._runner, self.guard, s.host, s.port, reuse_address=True).start()
        self.port = self._runner.addresses[0][1]
        if s.metrics:
            metrics_app = observed_app("miner-metrics", self.metrics_guard, client_max_size=1024)
            metrics_app.add_routes([web.get("/metrics", self.handle_metrics)])
            self._metrics_runner = web.AppRunner(metrics_app, access_log=None, shutdown_timeout=1.0,
                                                 **runner_options(self.metrics_guard.settings))
            await self._metrics_runner.setup()
            await GuardedSite(self._metrics_runner, self.metrics_guard, s.metrics_host, s.metrics_port,
                              reuse_address=True).start()
            self.metrics_port = self._metrics_runner.addresses[0][1]
        engine = self.engine.health()
        log.info("miner %s %s %s on %s:%d (capacity %d streams)%s", self.hotkey,
                 "serving" if engine.status != "down" else "listening (engine not serving yet) for",
                 self.engine_capabilities.model_fingerprint, s.host, self.port, self.capacity,
                 f"; metrics on http://{s.metrics_host}:{self.metrics_port}/metrics" if self.metrics_port else "")
        if s.publish:
            if engine.status == "down":
                # validators would find nothing behind a published endpoint: publish once the engine answers
                self._publisher = asyncio.create_task(self._publish_once_serving(), name="k3-publish")
            else:
                await self.publish_endpoint()
        self._refresher = asyncio.create_task(self._refresh_loop(), name="k3-metagraph")

    async def _publish_once_serving(self) -> None:
        """Wait until the engine answers, warning every ENGINE_WAIT_WARN_S, then publish the endpoint."""
        waited_from = time.monotonic()
        warned_at = -math.inf
        while (health := self.engine.health()).status == "down":
            now = time.monotonic()
            if now - warned_at >= ENGINE_WAIT_WARN_S:
                log.warning("the engine is not serving (%s); /health answers 503 and the endpoint is not published "
                            "until it does (waiting %.0f s)", health.detail or "no detail", now - waited_from)
                warned_at = now
            await asyncio.sleep(ENGINE_POLL_S)
        log.info("the engine serves after %.1f s: publishing the endpoint", time.monotonic() - waited_from)
        await self.publish_endpoint()

    @property
    def url(self) -> str:
        host = self.settings.server.host
        host = "127.0.0.1" if host in ("0.0.0.0", "") else ("[::1]" if host == "::" else host)
        return f"http://{host}:{self.port}"

    def skip_grace(self) -> None:
        """A second signal: end open streams now instead of waiting for them."""
        self._skip_grace.set()

    async def close(self, grace_s: float | None = None) -> None:
        """Stop accepting, let open streams finish within the grace period, then end the rest
        (the engine is stopped, so each gets an error event) and stop everything."""
        if self._closed:
            return
        self._closed = True
        grace_s = self.settings.server.shutdown_grace_s if grace_s is None else grace_s
        self.draining = True
        if self._runner is not None:
            for site in list(self._runner.sites):
                await site.stop()
        if self.budgets.streams_in_flight:
            log.info("waiting up to %.0f s for %d open streams", grace_s, self.budgets.streams_in_flight)
        await self._wait_for_streams(grace_s)
        for task in (self._refresher, self._publisher):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        if self.budgets.streams_in_flight:
            log.warning("ending %d streams that outlived the grace period", self.budgets.streams_in_flight)
        await self.engine.stop()
        self._skip_grace.clear()
        await self._wait_for_streams(2.0)  # let the error events go out
        if self._runner is not None:
            await self._runner.cleanup()
        if self._metrics_runner is not None:
            await self._metrics_runner.cleanup()
        log.info("miner stopped")

    async def _wait_for_streams(self, limit_s: float) -> None:
        deadline = time.monotonic() + limit_s
        while self.budgets.streams_in_flight and time.monotonic() < deadline and not self._skip_grace.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._skip_grace.wait(), min(0.05, max(0.0, deadline - time.monotonic())))

    # ------------------------------------------------------------ metagraph and endpoint
    def _use_snapshot(self) -> None:
        snapshot = self.metagraph.snapshot
        self.access = ValidatorAccess(snapshot, self.settings.access, self.capacity, self.owners)
        self.metrics.metagraph_block.set(snapshot.block)

    async def refresh_metagraph(self) -> bool:
        ok = await self.metagraph.refresh()
        if ok:
            self._use_snapshot()
        else:
            self.metrics.metagraph_failures.inc()
        return ok

    async def _refresh_loop(self) -> None:
        while True:
            await asyncio.sleep(self.settings.chain.metagraph_refresh_s)
            await self.refresh_metagraph()
            s = self.settings.server
            if (s.publish and self._publisher_done() and self._needs_publication()
                    and self.engine.health().status != "down"
                    and time.monotonic() - self._last_publish_attempt >= s.publish_retry_s):
                await self.publish_endpoint()

    def _publisher_done(self) -> bool:
        return self._publisher is None or self._publisher.done()

    def _needs_publication(self) -> bool:
        """Our endpoint is not (or no longer) the one on chain: never published, rate limited, changed
        by a re-registration."""
        snapshot = self.metagraph.snapshot
        mine = snapshot.by_hotkey(self.hotkey) if snapshot is not None else None
        if mine is None:
            return self.publication != "published"
        return mine.endpoint is None or (mine.endpoint.ip, mine.endpoint.port) != self.external_endpoint()

    def external_endpoint(self) -> tuple[str, int]:
        s = self.settings.server
        return (s.external_ip or s.host), (s.external_port or self.port)

    async def publish_endpoint(self) -> str:
        """ServeAxon when the chain's entry differs from ours. Returns (and keeps in `publication`)
        "published", "rate_limited" (the existing entry stays), "not_registered" or "failed"."""
        ip, port = self.external_endpoint()
        netuid = self.settings.chain.netuid
        self._last_publish_attempt = time.monotonic()
        snapshot = self.metagraph.snapshot
        mine = snapshot.by_hotkey(self.hotkey) if snapshot is not None else None
        if mine is not None and mine.endpoint is not None and (mine.endpoint.ip, mine.endpoint.port) == (ip, port):
            log.info("endpoint %s:%d is already published for uid %d", ip, port, mine.uid)
            self.publication = "published"
            return self.publication
        try:
            await asyncio.wait_for(self.chain.publish_endpoint(self.wallet, netuid, ip, port),
                                   self.settings.chain.timeout_s)
        except RateLimited as error:
            existing = f"{mine.endpoint.ip}:{mine.endpoint.port}" if mine and mine.endpoint else "none"
            log.warning("serving rate limit: keeping the existing on-chain endpoint (%s) for now; will retry "
                        "publishing %s:%d (%s)", existing, ip, port, error)
            self.publication = "rate_limited"
        except NotRegistered:
            log.error("hotkey %s is not registered on subnet %d: register it, then the miner publishes %s:%d "
                      "on its own", self.hotkey, netuid, ip, port)
            self.publication = "not_registered"
        except (ChainError, TimeoutError, OSError, ValueError) as error:
            log.error("could not publish %s:%d on subnet %d: %s", ip, port, netuid, error)
            self.publication = "failed"
        else:
            log.info("published endpoint %s:%d on subnet %d", ip, port, netuid)
            self.publication = "published"
        return self.publication

    # ------------------------------------------------------------ admission
    @web.middleware
    async def _answer_errors(self, request: web.Request, handler) -> web.StreamResponse:
        endpoint = ENDPOINTS.get(request.path, "other")
        try:
            response = await handler(request)
        except Refusal as refusal:
            response = refusal.response()
            if refusal.status == 429:
                self.metrics.rejections.labels(refusal.code).inc()
        except ProtocolError as error:
            response = Refusal(error.code, error.message, status=error.status,
                               close=getattr(error, "close", False)).response()
        except web.HTTPException as error:  # aiohttp's own answers (unknown path, wrong method): JSON too
            code = {404: "not_found", 405: "method_not_allowed", 413: "too_large"}.get(error.status, "http_error")
            response = Refusal(code, error.reason or code, status=error.status).response()
        except asyncio.CancelledError:
            self.metrics.disconnects.inc()
            raise
        except Exception:
            log.exception("unexpected failure answering %s %s", request.method, request.path)
            response = Refusal(ErrorCode.INTERNAL_ERROR, "the miner failed on this request").response()
        self.metrics.requests.labels(endpoint, str(response.status)).inc()
        return response

    async def _admit(self, request: web.Request, body_limit: int | None = None, streams: bool = False) -> Admission:
        """Headers first (btauth/1 shape, receiver and freshness; validator gate; budget; body headers), then
        the body capped at `body_limit` (the limits' max_body_bytes when None), then the signature and the
        replay store. `streams`: the caller also needs a free stream slot (looked at here, taken later)."""
        if self.draining:
            raise Refusal(ErrorCode.SHUTTING_DOWN, "this miner is shutting down; retry later")
        limit = self.limits.max_body_bytes if body_limit is None else body_limit
        try:
            claimed = check_auth_headers(request.headers, self.hotkey)
        except AuthFailure as failure:
            self.metrics.auth_failures.labels(failure.code).inc()
            raise Refusal(failure.code, failure.message, status=failure.status, close=True) from None
        try:
            try:
                budget = self.access.check(claimed)
            except Refusal as refusal:
                self.metrics.auth_failures.labels(refusal.code).inc()
                raise
            self.budgets.check_request(claimed, budget)
            if streams:
                self.budgets.check_stream(claimed, budget)
        except Refusal as refusal:
            refusal.close = True  # the unread body is not worth draining
            raise
        body = await read_body(request, limit, self.settings.server.body_timeout_s, json_body=request.method == "POST")
        args = (request.headers, body, request.method, request.raw_path, self.hotkey, self.nonce_store)
        try:
            if len(body) > OFF_LOOP_BYTES:
                hotkey = await asyncio.to_thread(verify_request, *args)
            else:
                hotkey = verify_request(*args)
        except AuthFailure as failure:
            self.metrics.auth_failures.labels(failure.code).inc()
            raise Refusal(failure.code, failure.message, status=failure.status) from None
        request[CALLER] = hotkey
        self.budgets.take_request(hotkey, budget)
        if budget.owner:
            log.info("owner hotkey %s (%s) calls %s %s (no validator permit needed; %d requests per %g s)", hotkey,
                     budget.owner, request.method, request.path, budget.requests_per_window, self.budgets.window_s)
        return Admission(hotkey, budget, body)

    async def _off_loop_if_large(self, size: int, function: Callable, *args):
        if size > OFF_LOOP_BYTES:
            return await asyncio.to_thread(function, *args)
        return function(*args)

    def _parse_generate(self, body: bytes) -> tuple[GenerateRequest, list[int]]:
        caps = self.engine_capabilities
        parsed = parse_generate(body, self.limits)
        parsed.check_against(caps.vocab_size, caps.max_context)
        # `chat` is the proposed wire switch for the chat template (protocol/schemas.py does not carry it
        # yet); a text prompt is plain text until it does.
        ids = prompt_token_ids(parsed, self.tokenizer, chat=bool(getattr(parsed, "chat", False)))
        if parsed.prompt is not None:
            parsed.check_context(len(ids), caps.max_context)
        return parsed, ids

    def _parse_score(self, body: bytes) -> ScoreRequest:
        caps = self.engine_capabilities
        parsed = parse_score(body, self.limits)
        parsed.check_against(caps.vocab_size, caps.max_context)
        return parsed

    # ------------------------------------------------------------ handlers
    async def handle_health(self, request: web.Request) -> web.Response:
        """200 while validators can be served (status ok, or degraded: serving with a stale metagraph or an engine
        that reported a failure); 503 when they cannot (down: no engine, no metagraph yet, shutting down), so that a
        status-code health check (Docker, a load balancer) sees the truth."""
        health = self.health()
        return _json(encode_model(health), status=503 if health.status == "down" else 200)

    def health(self) -> Health:
        if self.draining:
            return Health(status="down", detail="shutting down")
        engine = self.engine.health()
        if engine.status == "down":
            return Health(status="down", detail=f"the engine is not serving ({engine.detail or 'no detail'})")
        watch = self.metagraph
        if watch.snapshot is None:
            return Health(status="down", detail="the metagraph has not been read yet: validators cannot be "
                                                 "told apart from strangers")
        problems = []
        if engine.status != "ok":
            problems.append("the engine reported a failure")
        if watch.last_error is not None:
            problems.append(f"metagraph stale: using block {watch.snapshot.block} read {watch.age_s:.0f} s ago; "
                            f"the latest read failed ({watch.last_error})")
        kept = getattr(self.engine, "committed_bytes", None)
        if problems:
            return Health(status="degraded", detail="; ".join(problems), committed_bytes=kept)
        return Health(status="ok", detail=f"metagraph block {watch.snapshot.block} read {watch.age_s:.0f} s ago",
                      committed_bytes=kept)

    async def handle_metrics(self, request: web.Request) -> web.Response:
        engine_metrics = getattr(self.engine, "metrics", None)
        body = self.metrics.exposition()
        if engine_metrics is not None and hasattr(engine_metrics, "exposition"):
            body += engine_metrics.exposition()
        return web.Response(body=body, headers={"Content-Type": "text/plain; version=0.0.4; charset=utf-8"})

    async def handle_capabilities(self, request: web.Request) -> web.Response:
        await self._admit(request, body_limit=0)
        return _json(self.capabilities_document())

    def capabilities_document(self) -> bytes:
        """What the miner declares, read from the engine at each request: a route's stages change with churn.

        The fingerprint, the capacity and the limits stay those checked at start (requests are bounded by them).
        """
        caps = self.engine.capabilities()
        fixed = self.engine_capabilities
        return encode_model(Capabilities(
            model_id=fixed.model_id, model_fingerprint=fixed.model_fingerprint, vocab_size=fixed.vocab_size,
            max_context=fixed.max_context, max_concurrent_streams=self.capacity, engine=fixed.engine_kind,
            layout=dict(caps.layout), precision=caps.precision or fixed.precision or "unknown",
            sampler=fixed.sampler, software_version=__version__, limits=self.limits,
        ))

    async def handle_score(self, request: web.Request) -> web.Response:
        admission = await self._admit(request, streams=True)
        with self.budgets.stream_slot(admission.hotkey, admission.budget):
            parsed = await self._off_loop_if_large(len(admission.body), self._parse_score, admission.body)
            positions = parsed.resolved_positions()
            try:
                scored = await asyncio.wait_for(
                    self.engine.score(list(parsed.token_ids), None if parsed.positions is None else positions,
                                      parsed.top_k),
                    self.settings.server.first_event_timeout_s)
            except EngineError as error:
                raise engine_refusal(error) from None
            except TimeoutError:
                raise Refusal(ErrorCode.ENGINE_STALLED, "the engine did not finish scoring in time") from None
            if [p.position for p in scored] != positions:
                log.error("the engine scored positions other than those asked")
                raise Refusal(ErrorCode.ENGINE_FAILURE, "the engine failed on this request; retry later")
            body = await self._off_loop_if_large(len(positions) * (1 + parsed.top_k) * 64, self._score_answer,
                                                 parsed, scored)
            return _json(body)

    def _score_answer(self, parsed: ScoreRequest, scored) -> bytes:
        return encode_model(ScoreResponse(
            request_id=parsed.request_id, model_fingerprint=self.engine_capabilities.model_fingerprint,
            scores=[scored_position_message(p) for p in scored],
        ))

    async def handle_states(self, request: web.Request) -> web.Response:
        """Open an answer's committed states for the validator that asked for the answer (docs/verification.md,
        "State commitments"): 404 when the engine does not (or no longer) keep it, 400 from an engine that commits
        to nothing."""
        admission = await self._admit(request)
        parsed = parse_state_opening(admission.body, self.limits)
        try:
            opening = await asyncio.to_thread(self.engine.open_states, parsed.request_id, parsed.root,
                                              opening_asks(parsed), admission.hotkey)
        except OpeningError as error:
            raise Refusal(ErrorCode.NOT_FOUND, str(error), status=404) from None
        except EngineError as error:
            raise engine_refusal(error) from None
        hidden = int(opening.opened[0].rows.shape[1])
        return _json(await asyncio.to_thread(lambda: encode_model(opening_message(parsed.request_id, opening,
                                                                                  hidden))))

    async def handle_generate(self, request: web.Request) -> web.StreamResponse:
        arrived = time.perf_counter()
        admission = await self._admit(request, streams=True)
        with self.budgets.stream_slot(admission.hotkey, admission.budget):
            parsed, prompt_ids = await self._off_loop_if_large(len(admission.body), self._parse_generate,
                                                               admission.body)
            engine_request = GenerationRequest(prompt_ids, sampling_params(parsed), parsed.request_id,
                                               owner=admission.hotkey)
            try:
                stream = self.engine.generate(engine_request)
            except EngineError as error:
                raise engine_refusal(error) from None
            try:
                try:
                    first = await self._next_event(stream, self._first_event_wait_s(len(prompt_ids)))
                except EngineError as error:
                    raise engine_refusal(error) from None
                response = web.StreamResponse(status=200, headers={"Cache-Control": "no-store"})
                response.content_type = NDJSON_CONTENT_TYPE
                await response.prepare(request)
                try:
                    await self._relay(stream, first, response, admission.body, arrived)
                except ConnectionError:  # the client left; closing the stream below frees the sequence
                    self.metrics.disconnects.inc()
                return response
            finally:
                await stream.aclose()

    def _first_event_wait_s(self, prompt_tokens: int) -> float:
        """--first-event-timeout-s, or longer when the engine's own first-token deadline (prefill-scaled) is."""
        engine_deadline = getattr(self.engine, "first_token_deadline_s", None)
        floor = self.settings.server.first_event_timeout_s
        return max(floor, engine_deadline(prompt_tokens) + 1.0) if callable(engine_deadline) else floor

    async def _next_event(self, stream, timeout_s: float):
        """The engine's next event; EngineError for a refusal, a failure, a stall or a cut stream."""
        try:
            async with asyncio.timeout(timeout_s):
                return await anext(stream)
        except TimeoutError:
            raise EngineError("engine_stalled", f"the engine sent nothing for {timeout_s:g} s") from None
        except StopAsyncIteration:
            raise EngineError("engine_failure", "the engine ended the stream without a final event") from None

    async def _relay(self, stream, event, response: web.StreamResponse, body: bytes, arrived: float) -> None:
        token_ids: list[int] = []
        first_token_at = None
        try:
            while True:
                if isinstance(event, EngineTokenEvent):
                    if event.index != len(token_ids):
                        raise EngineError("engine_failure", f"the engine sent token index {event.index}, "
                                                            f"expected {len(token_ids)}")
                    line = encode_event(token_message(event))
                    token_ids.append(int(event.token_id))
                    await response.write(line)
                    first_token_at = first_token_at or time.perf_counter()
                elif isinstance(event, EngineFinalEvent):
                    await response.write(encode_event(self._final_event(event, body, token_ids, arrived,
                                                                        first_token_at)))
                    break
                else:
                    raise EngineError("engine_failure", f"the engine sent a {type(event).__name__}")
                event = await self._next_event(stream, self.settings.server.stall_timeout_s)
        except EngineError as error:
            log.warning("generation ended by the engine after %d tokens: %s: %s", len(token_ids), error.code,
                        error.message)
            self.metrics.stream_errors.labels(wire_code(error.code)).inc()
            await response.write(encode_event(ErrorEvent(code=wire_code(error.code),
                                                         message=public_message(error))))
        await response.write_eof()

    def _final_event(self, final: EngineFinalEvent, body: bytes, token_ids: list[int], arrived: float,
                     first_token_at: float | None) -> FinalMessage:
        if final.finish_reason not in ("eos", "stop", "length"):
            raise EngineError(wire_code(final.finish_reason or "engine_failure"),
                              f"the generation ended as {final.finish_reason!r}")
        if final.completion_tokens != len(token_ids):
            log.warning("the engine reports %d completion tokens but streamed %d", final.completion_tokens,
                        len(token_ids))
        now = time.perf_counter()
        total_ms = (now - arrived) * 1000.0
        ttft_ms = total_ms if first_token_at is None else (first_token_at - arrived) * 1000.0
        prefill_rate = None
        if final.prefill_ms and final.prefill_ms > 0:
            prefill_rate = min(final.prompt_tokens / (final.prefill_ms / 1000.0), 1e12)
        decode_rate = None
        if len(token_ids) > 1 and first_token_at is not None and now > first_token_at:
            decode_rate = min((len(token_ids) - 1) / (now - first_token_at), 1e12)
        return final_message(
            final,
            timings=Timings(queue_ms=_millis(final.queue_ms, 0.0), ttft_ms=_millis(ttft_ms, total_ms),
                            total_ms=_millis(total_ms, 0.0), prefill_tokens_per_s=prefill_rate,
                            decode_tokens_per_s=decode_rate),
            model_fingerprint=self.engine_capabilities.model_fingerprint,
            signature=sign_response(self.keypair, body, token_ids, final.seed,
                                    state_root=final.state_commitment.root if final.state_commitment is not None
                                    else None),
        )


def _json(body: bytes, status: int = 200) -> web.Response:
    return web.Response(status=status, body=body, content_type=JSON_CONTENT_TYPE)


# ---------------------------------------------------------------- running it
def open_wallet(settings: WalletSettings):
    """The wallet this neuron signs with (neurons.base.settings.open_wallet), as a setup error when missing."""
    try:
        return open_cli_wallet(settings)
    except WalletNotFound as error:
        raise MinerSetupError(str(error)) from None


def owner_hotkeys(settings: MinerSettings) -> dict[str, str]:
    """--owner-hotkeys as {SS58: the name given}: a name is a hotkey of this miner's own wallet."""
    owners = {}
    for entry in settings.access.owner_hotkeys:
        try:
            owners[hotkey_address(settings.wallet, entry)] = entry
        except WalletNotFound as error:
            raise MinerSetupError(f"--owner-hotkeys {entry}: not an SS58 address, and {error}") from None
    if owners:
        log.info("owner hotkeys (no validator permit needed, %d requests per %g s each): %s",
                 settings.access.owner_requests, settings.access.window_s,
                 ", ".join(f"{name} {ss58}" if name != ss58 else ss58 for ss58, name in owners.items()))
    return owners


def load_tokenizer_for(spec: EngineSpec, engine: Engine):
    """The tokenizer of text prompts: the engine's own when it has one, else the checkpoint's."""
    tokenizer = getattr(engine, "tokenizer", None)
    if tokenizer is not None:
        return tokenizer
    from inference.model import load_tokenizer  # noqa: PLC0415
    from inference.model import read_config  # noqa: PLC0415

    return load_tokenizer(spec.checkpoint, read_config(spec.checkpoint))


async def serve(settings: MinerSettings, wrap_engine: Callable[[Engine], Engine] | None = None,
                stop: asyncio.Event | None = None) -> int:
    """Run a miner until SIGINT/SIGTERM (or `stop` is set); a second signal skips the grace period.
    Returns the process exit status."""
    problems = settings.problems()
    if problems:
        raise MinerSetupError("; ".join(problems))
    wallet = open_wallet(settings.wallet)
    nonce_store = SQLiteNonceStore(Path(settings.server.nonce_store).expanduser())
    chain = connect(settings.chain.network)
    try:
        try:
            # a remote engine's stall timer is the miner's own (--stall-timeout-s)
            spec = replace(settings.engine, remote_stall_timeout_s=settings.server.stall_timeout_s)
            engine = await asyncio.to_thread(build_engine, spec)
        except EngineSpecError as error:
            raise MinerSetupError(str(error)) from None
        tokenizer = load_tokenizer_for(settings.engine, engine)
        if wrap_engine is not None:
            engine = wrap_engine(engine)
        server = MinerServer(settings, engine=engine, tokenizer=tokenizer, chain=chain, wallet=wallet,
                             nonce_store=nonce_store, owners=owner_hotkeys(settings))
        stop = stop or asyncio.Event()
        loop = asyncio.get_running_loop()

        def on_signal(name: str) -> None:
            if stop.is_set():
                log.warning("%s again: ending open streams now", name)
                server.skip_grace()
            else:
                log.info("%s: shutting down", name)
                stop.set()

        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, on_signal, sig.name)
        try:
            await server.start()
            await stop.wait()
        finally:
            await server.close()
            for sig in (signal.SIGINT, signal.SIGTERM):
                loop.remove_signal_handler(sig)
    finally:
        await chain.close()
        nonce_store.close()
    return 0
