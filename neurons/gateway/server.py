"""The validator's organic gateway: an OpenAI-compatible API that serves real users from the
subnet's best miners.

    POST /v1/chat/completions   messages -> the tokenizer's chat template -> token ids -> a miner
    POST /v1/completions        prompt text (tokenized here) or token ids -> a miner
    GET  /v1/models, /v1/models/{id}   with `max_model_len`: the largest context of the miners routed to
    GET  /health                unauthenticated liveness

Every call but /health carries `Authorization: Bearer KEY`, checked against a key file (one key
per line, `#` starts a comment; re-read when it changes) and limited per key (a token bucket).
The validator supplies the miners through a small seam, `MinerDirectory.ranked_miners()`, best
first. A request goes to the best miner; on a connection error, HTTP error, timeout, broken
stream or failed tier-0 check *before any byte went to the user* it fails over to the next one,
up to `max_attempts`. Once a stream has started, a failure ends it with an error chunk (the
`openai` client raises it as an APIError). Every answer goes through tier 0
(`scoring.tier0.check_tier0`: usage, finish reason, logprobs, buffering, response signature)
and every attempt's outcome is handed to the directory's optional `record_organic(uid=, hotkey=,
outcome=, prompt_ids=)` hook, so organic traffic counts like any other measurement.

What the user gets is the validator's own reading of the miner's tokens: the text is decoded
here from the token ids (a miner cannot send other text than the tokens it signed), and usage
is the validator's own count.

vLLM's request extensions that its clients (and `vllm bench serve`) send are honoured:
`return_tokens_as_token_ids` (logprob tokens named `token_id:N`), `skip_special_tokens`, `top_k`;
`repetition_penalty` only as 1 and `ignore_eos` only as false (the miners do not offer them).
"""
from __future__ import annotations

import asyncio
import inspect
import json
import logging
import secrets
import time
from contextlib import aclosing
from dataclasses import dataclass
from typing import Optional, Protocol, Sequence, Union

from aiohttp import web

from neurons.base.observability import CALLER, observed_app
from neurons.gateway.keys import ApiKeyFileError, ApiKeys, KeyRateLimiter
from neurons.gateway.metrics import GatewayMetrics
from neurons.gateway.schemas import ApiError, ChatCompletionBody, CompletionBody, RequestBody, parse_body
from neurons.gateway.settings import GatewaySettings, GatewaySetupError
from protocol.client import (ClientTimeouts, GenerateResult, MinerClient, MinerError, MinerStreamError, MinerTimeout,
                             MinerUnreachable)
from protocol.errors import ErrorCode
from protocol.http_server import (BodyRefusal, ConnectionGuard, GuardedSite, GuardSettings, defer_continue, read_body,
                                  runner_options)
from protocol.schemas import Capabilities, ErrorEvent, FinalMessage, GenerateRequest, TokenMessage
from scoring.config import ScoringConfig
from scoring.failures import Failure
from scoring.tier0 import check_tier0

log = logging.getLogger("k3.gateway")

# Miner error codes that say the request is at fault: answered 400, never retried elsewhere.
REQUEST_FAULTS = frozenset({ErrorCode.INVALID_REQUEST, ErrorCode.INVALID_JSON, ErrorCode.UNSUPPORTED_VERSION,
                            ErrorCode.TOKEN_OUT_OF_VOCAB, ErrorCode.CONTEXT_TOO_LONG, ErrorCode.CONTEXT_EXCEEDED,
                            ErrorCode.TOO_LARGE, ErrorCode.UNSUPPORTED_MEDIA_TYPE, ErrorCode.INVALID_BODY})
# Codes of an engine that failed on this very request: the request may be the cause, so no failover.
SUSPECT_FAULTS = frozenset({ErrorCode.ENGINE_FAILURE, ErrorCode.ENGINE_STALLED})
BUSY_RETRY_AFTER_S = 2.0  # every miner tried was busy (429): the user is told to come back this soon
SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
MINER_UID_HEADER = "x-k3-miner-uid"
# the request id the serving miner was sent (the validator's records of the request carry it)
REQUEST_ID_HEADER = "x-k3-request-id"
MODEL_CREATED = 1_767_225_600  # a fixed "created" for /v1/models (2026-01-01)


# ---------------------------------------------------------------- the seam to the validator
@dataclass(frozen=True)
class MinerTarget:
    """One miner the gateway may send users to. `capabilities`, when the validator already holds
    them, saves a call; otherwise the gateway asks the miner and caches the answer."""

    uid: int
    hotkey: str
    url: str
    score: float
    capabilities: Optional[Capabilities] = None


Outcome = Union[GenerateResult, MinerError]


class MinerDirectory(Protocol):
    """What the gateway needs from the validator.

    `ranked_miners()` returns the miners to use, best first: objects with `uid`, `hotkey`, `url`,
    `score` and optionally `capabilities` (a MinerTarget, or any object with those attributes);
    the gateway skips those with score <= `min_score`. It may also be a coroutine function.

    Optional hook, called once per generation attempt (sync, or a coroutine run in the
    background): `record_organic(uid=..., hotkey=..., outcome=..., prompt_ids=..., tier0=...,
    tier0_cpu_s=...)`, where `outcome` is the finished GenerateResult or the MinerError the attempt
    raised (its `.partial` holds the request and what had arrived), `prompt_ids` the prompt as the
    validator tokenized it and `tier0` the tier-0 failures of a finished answer (None for an error),
    with the CPU seconds they took. Tier 0 runs once, here (it decides on failover); the hook
    records the measurement with that verdict and does not run it again.
    """

    def ranked_miners(self) -> Sequence[MinerTarget]: ...


# ---------------------------------------------------------------- text out
class StopTrimmer:
    """Releases generated text as it comes, holding back just enough to cut it before the first
    stop string: OpenAI answers never contain the stop string, the miner's tokens do."""

    def __init__(self, stops: Sequence[str]):
        self.stops = [s for s in stops if s]
        self.hold = max((len(s) for s in self.stops), default=1) - 1
        self.pending = ""
        self.stopped = False

    def push(self, text: str) -> str:
        if self.stopped:
            return ""
        self.pending += text
        return self._release(final=False)

    def flush(self) -> str:
        return "" if self.stopped else self._release(final=True)

    def _release(self, final: bool) -> str:
        pending = self.pending
        hits = [i for i in (pending.find(s) for s in self.stops) if i >= 0]
        first = min(hits, default=len(pending))
        # where a stop string could still begin: its start matches the text up to the end (not decided
        # until more text comes, or the end); a longer stop beginning earlier beats a shorter one found later
        open_at = len(pending) if final else next(
            (j for j in range(max(0, len(pending) - self.hold), len(pending))
             if any(len(s) > len(pending) - j and s.startswith(pending[j:]) for s in self.stops)), len(pending))
        if hits and open_at >= first:
            self.pending, self.stopped = "", True
            return pending[:first]
        cut = min(open_at, first)
        self.pending = pending[cut:]
        return pending[:cut]


def _finish_reason(final: FinalMessage) -> str:
    return "length" if final.finish_reason == "length" else "stop"


@dataclass
class _Plan:
    """One user request, ready to route."""

    kind: str  # "chat" | "completion"
    body: RequestBody
    prompt_ids: list[int]
    max_tokens: Optional[int]  # None: as much as the miner's context allows, up to default_max_tokens
    user_logprobs: Optional[int]
    response_id: str
    created: int


# ---------------------------------------------------------------- the gateway
class OrganicGateway:
    def __init__(self, directory: MinerDirectory, miner_client: MinerClient, tokenizer, api_keys: ApiKeys,
                 settings: GatewaySettings, scoring_config: Optional[ScoringConfig] = None):
        problems = settings.problems(need_key_file=False)
        if problems:
            raise GatewaySetupError("; ".join(problems))
        self.directory = directory
        self.client = miner_client
        self.tokenizer = tokenizer
        self.api_keys = api_keys
        self.settings = settings
        self.scoring_config = scoring_config or ScoringConfig()
        self.limiter = KeyRateLimiter(settings.rate_limit_requests, settings.rate_limit_window_s)
        self.timeouts = settings.miner_timeouts
        self._capabilities: dict[tuple[str, str], tuple[Capabilities, float]] = {}
        self._cooldown_until: dict[str, float] = {}
        self._last_fault: dict[str, MinerError] = {}  # per hotkey: the last failure, until routing looks at it
        self._last_error: dict[str, str] = {}  # per hotkey, for the log line of a request that failed everywhere
        self._hook_tasks: set[asyncio.Task] = set()
        self.guard = ConnectionGuard(GuardSettings(), "gateway")
        self.metrics = GatewayMetrics(settings.model_name)
        self.app = observed_app("gateway", self.guard, self._errors, observe=self.metrics.observe_request,
                                client_max_size=settings.max_body_bytes)
        self.app.add_routes([
            web.post("/v1/chat/completions", self.handle_chat, expect_handler=defer_continue),
            web.post("/v1/completions", self.handle_completions, expect_handler=defer_continue),
            web.get("/v1/models", self.handle_models),
            web.get("/v1/models/{model}", self.handle_model),
            web.get("/health", self.handle_health),
        ])
        self.app.on_cleanup.append(self._drain_hooks)

    # ------------------------------------------------------------ plumbing
    @web.middleware
    async def _errors(self, request: web.Request, handler) -> web.StreamResponse:
        try:
            return await handler(request)
        except ApiError as error:
            response = error.response()
            if getattr(error, "close", False):
                response.force_close()
            return response
        except web.HTTPException as error:  # aiohttp's own (unknown path, wrong method, body too large)
            code = {404: "not_found", 405: "method_not_allowed", 413: "request_too_large"}.get(error.status)
            return ApiError(code, error.reason or "error", status=error.status).response()
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("unexpected failure answering %s %s", request.method, request.path)
            return ApiError(ErrorCode.INTERNAL_ERROR, "the gateway failed on this request").response()

    async def _read(self, request: web.Request) -> bytes:
        """The body, after the key and rate checks: uncompressed JSON, capped, within the body deadline."""
        try:
            # Content-Type is not insisted on here: curl -d and many SDKs label JSON otherwise
            return await read_body(request, self.settings.max_body_bytes, self.guard.settings.body_timeout_s,
                                   json_body=False)
        except BodyRefusal as refusal:
            code = ErrorCode.REQUEST_TOO_LARGE if refusal.code == ErrorCode.TOO_LARGE else refusal.code
            error = ApiError(code, refusal.message)
            error.close = True
            raise error from None

    def _authenticate(self, request: web.Request) -> str:
        header = request.headers.get("Authorization", "")
        scheme, _, key = header.partition(" ")
        key = key.strip()
        if scheme.lower() != "bearer" or not key:
            raise ApiError(ErrorCode.INVALID_API_KEY, "missing API key: send 'Authorization: Bearer YOUR_KEY'")
        who = self.api_keys.check(key)
        if who is None:
            raise ApiError(ErrorCode.INVALID_API_KEY, "incorrect API key")
        return who

    def _admit(self, request: web.Request) -> str:
        who = request[CALLER] = self._authenticate(request)
        wait = self.limiter.take(who)
        if wait is not None:
            self.metrics.rate_limited.labels(who).inc()
            raise ApiError(ErrorCode.RATE_LIMIT_EXCEEDED,
                           f"rate limit of {self.settings.rate_limit_requests} requests per "
                           f"{self.settings.rate_limit_window_s:g} s reached; retry in {wait:.1f} s", retry_after_s=wait)
        return who

    def _check_model(self, name: str) -> None:
        if name != self.settings.model_name:
            raise ApiError(ErrorCode.MODEL_NOT_FOUND, f"the model {name!r} does not exist; this gateway serves "
                                                      f"{self.settings.model_name!r}", param="model")

    # ------------------------------------------------------------ simple endpoints
    async def handle_health(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "ok", "model": self.settings.model_name})

    async def _model_entry(self) -> dict:
        entry = {"id": self.settings.model_name, "object": "model", "created": MODEL_CREATED, "owned_by": "k3-subnet"}
        context = await self._max_context()
        if context is not None:
            entry["max_model_len"] = context  # vLLM's field: clients size their requests by it
        return entry

    async def _max_context(self) -> Optional[int]:
        """The largest context among the miners a request may go to (what routing would try): the
        longest prompt plus max_tokens this gateway can serve right now; None when no miner answers."""
        contexts = []
        for target in (await self._ranked())[:self.settings.max_attempts]:
            try:
                contexts.append((await self._capabilities_of(target)).max_context)
            except MinerError:
                continue
        return max(contexts, default=None)

    async def handle_models(self, request: web.Request) -> web.Response:
        self._authenticate(request)
        return web.json_response({"object": "list", "data": [await self._model_entry()]})

    async def handle_model(self, request: web.Request) -> web.Response:
        self._authenticate(request)
        self._check_model(request.match_info["model"])
        return web.json_response(await self._model_entry())

    # ------------------------------------------------------------ generation endpoints
    async def handle_chat(self, request: web.Request) -> web.StreamResponse:
        self._admit(request)
        body: ChatCompletionBody = parse_body(ChatCompletionBody, await self._read(request))
        self._check_model(body.model)
        try:
            ids = self.tokenizer.apply_chat_template([m.as_template_message() for m in body.messages],
                                                     add_generation_prompt=True)
        except ValueError as error:
            raise ApiError(ErrorCode.INVALID_VALUE, str(error), param="messages") from None
        plan = _Plan("chat", body, ids, body.requested_max_tokens, body.user_logprobs,
                     "chatcmpl-" + secrets.token_hex(12), int(time.time()))
        return await self._serve(request, plan)

    async def handle_completions(self, request: web.Request) -> web.StreamResponse:
        self._admit(request)
        body: CompletionBody = parse_body(CompletionBody, await self._read(request))
        self._check_model(body.model)
        plan = _Plan("completion", body, self._completion_prompt(body.prompt), body.requested_max_tokens,
                     body.user_logprobs, "cmpl-" + secrets.token_hex(12), int(time.time()))
        return await self._serve(request, plan)

    def _completion_prompt(self, prompt) -> list[int]:
        if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
            if len(prompt) != 1:
                raise ApiError(ErrorCode.INVALID_VALUE, "this gateway takes one prompt per request", param="prompt")
            prompt = prompt[0]
        if isinstance(prompt, str):
            ids = self.tokenizer.encode(prompt)
        else:
            ids = list(prompt)
            vocab = self.tokenizer.vocab_size
            bad = next((t for t in ids if not 0 <= t < vocab), None)
            if bad is not None:
                raise ApiError(ErrorCode.INVALID_VALUE, f"token id {bad} is outside the vocabulary (0..{vocab - 1})",
                               param="prompt")
        if not ids:
            raise ApiError(ErrorCode.INVALID_VALUE, "the prompt is empty", param="prompt")
        return ids

    # ------------------------------------------------------------ routing
    async def _ranked(self) -> list[MinerTarget]:
        ranked = self.directory.ranked_miners()
        if inspect.isawaitable(ranked):
            ranked = await ranked
        targets = []
        for target in ranked:
            if not target.url.startswith(("http://", "https://")):
                log.warning("skipping uid %d: its URL %r is not http(s)", target.uid, target.url)
            elif target.score > self.settings.min_score:
                targets.append(target)
        now = time.monotonic()
        # Miners that could not be reached lately go last (kept in rank order among themselves).
        return sorted(targets, key=lambda t: self._cooldown_until.get(t.hotkey, 0.0) > now)

    async def _capabilities_of(self, target: MinerTarget) -> Capabilities:
        known = getattr(target, "capabilities", None)
        if known is not None:
            return known
        key = (target.hotkey, target.url)
        cached = self._capabilities.get(key)
        now = time.monotonic()
        if cached is not None and now - cached[1] < self.settings.capabilities_ttl_s:
            return cached[0]
        s = self.settings
        t = s.miner_timeouts
        timeouts = ClientTimeouts(connect=t.connect, first_byte=min(10.0, t.first_byte),
                                  between_events=t.between_events, total=min(20.0, t.total))
        caps = await self.client.capabilities(target.url, target.hotkey, timeouts)
        self._capabilities[key] = (caps, now)
        return caps

    def _wire_request(self, plan: _Plan, caps: Capabilities) -> Optional[GenerateRequest]:
        """The miner request for this plan, or None when it does not fit this miner's context."""
        limits = caps.limits
        n = len(plan.prompt_ids)
        room = min(caps.max_context - n, limits.max_tokens)
        if plan.max_tokens is None:
            max_tokens = min(self.settings.default_max_tokens, room)
        else:
            max_tokens = plan.max_tokens
        body = plan.body
        if max_tokens < 1 or max_tokens > room or n > limits.max_prompt_tokens:
            return None
        logprobs = min(max(plan.user_logprobs or 0, self.settings.request_logprobs), limits.max_logprobs)
        return GenerateRequest(
            request_id=secrets.token_hex(16), prompt_token_ids=list(plan.prompt_ids), max_tokens=max_tokens,
            temperature=body.temperature, top_p=body.top_p, top_k=body.top_k, seed=body.seed,
            stop=body.stop_strings, logprobs=logprobs)

    async def _serve(self, request: web.Request, plan: _Plan) -> web.StreamResponse:
        if plan.max_tokens is not None and plan.max_tokens > self.settings.max_tokens_cap:
            raise ApiError(ErrorCode.INVALID_VALUE, f"max_tokens is {plan.max_tokens}, above this gateway's limit of "
                                                    f"{self.settings.max_tokens_cap}", param="max_tokens")
        if plan.body.top_k > self.tokenizer.vocab_size:
            raise ApiError(ErrorCode.INVALID_VALUE,
                           f"top_k is {plan.body.top_k}, above the vocabulary size {self.tokenizer.vocab_size}",
                           param="top_k")
        writer = _SseWriter(request, plan, self.tokenizer, self.settings.model_name)
        try:
            async with asyncio.timeout(self.settings.request_timeout_s):
                return await self._route(plan, writer)
        except TimeoutError:
            if writer.response is None:
                raise ApiError(ErrorCode.TIMEOUT,
                               f"no miner answered within {self.settings.request_timeout_s:g} s") from None
            await writer.fail("the request took longer than the gateway allows")
            return writer.response

    async def _route(self, plan: _Plan, writer: "_SseWriter") -> web.StreamResponse:
        targets = await self._ranked()
        if not targets:
            raise ApiError(ErrorCode.NO_MINER_AVAILABLE, "no miner is available right now; retry later")
        attempts, too_small, busy, errors = 0, 0, 0, []
        for target in targets:
            if attempts >= self.settings.max_attempts:
                break
            try:
                caps = await self._capabilities_of(target)
            except MinerError as error:
                attempts += 1
                busy += getattr(error, "status", None) == 429
                self._note_failure(target, error)
                errors.append(f"uid {target.uid}: {error}")
                self.metrics.failovers.inc()
                continue
            wire = self._wire_request(plan, caps)
            if wire is None:
                too_small += 1
                continue
            attempts += 1
            if plan.body.stream:
                response = await self._attempt_stream(target, caps, wire, writer)
            else:
                response = await self._attempt_whole(target, caps, wire, plan)
            if response is not None:
                return response
            fault = self._stop_if_the_request_is_at_fault(target)
            busy += getattr(fault, "status", None) == 429
            errors.append(f"uid {target.uid}: {self._last_error.get(target.hotkey, 'failed')}")
            self.metrics.failovers.inc()
        if attempts == 0 and too_small:
            raise ApiError(ErrorCode.CONTEXT_LENGTH_EXCEEDED,
                           f"the prompt ({len(plan.prompt_ids)} tokens) plus max_tokens does not fit the "
                           "context of any available miner; shorten the prompt or lower max_tokens",
                           param="messages" if plan.kind == "chat" else "prompt")
        log.warning("organic request failed on %d miners: %s", attempts, "; ".join(errors))
        if attempts and busy == attempts:  # back-pressure, not a failure: the user retries after Retry-After
            raise ApiError(ErrorCode.OVER_CAPACITY, f"the {attempts} miners tried are all busy; retry in "
                                                    f"{BUSY_RETRY_AFTER_S:g} s", retry_after_s=BUSY_RETRY_AFTER_S)
        raise ApiError(ErrorCode.MINERS_FAILED,
                       f"{attempts} miners were tried and none gave a verified answer; retry later")

    def _stop_if_the_request_is_at_fault(self, target: MinerTarget) -> Optional[MinerError]:
        """No failover for a failure the request may have caused: a refusal of the request itself is the
        user's 400; an engine that failed or stalled on it may have been felled by it (a poison request),
        so it is not handed to the next miner (502). Anything else (unreachable, busy, unavailable, a
        tier-0 failure) is the miner's problem and the next miner is tried; returns that failure."""
        error = self._last_fault.pop(target.hotkey, None)
        if error is None:
            return None
        code = error.error_code
        status = getattr(error, "status", None)
        if code in REQUEST_FAULTS or (code is None and status in (400, 413)):
            raise ApiError(ErrorCode.INVALID_VALUE, f"the request was refused by the miner: {error}"[:500])
        if code in SUSPECT_FAULTS:
            raise ApiError(ErrorCode.MINER_FAILED, "the miner failed on this request; it is not retried elsewhere "
                                                   "because the request itself may be the cause")
        return error

    def _note_failure(self, target: MinerTarget, error: Union[MinerError, str]) -> None:
        if isinstance(error, MinerError) and hasattr(error, "error_code"):
            self._last_fault[target.hotkey] = error
        else:
            self._last_fault.pop(target.hotkey, None)
        log.info("uid %d failed an organic request: %s", target.uid, str(error)[:300])
        self._last_error[target.hotkey] = str(error)[:300]
        # unreachable, or silent past a deadline (stopped, or a route still recovering): the next users go to the
        # others first for a while, rather than each waiting out the same deadline
        unreachable = isinstance(error, MinerUnreachable) or (isinstance(error, MinerTimeout)
                                                              and error.kind in ("connect", "first_byte",
                                                                                 "between_events"))
        if unreachable and self.settings.miner_cooldown_s > 0:
            self._cooldown_until[target.hotkey] = time.monotonic() + self.settings.miner_cooldown_s

    def _verify(self, target: MinerTarget, caps: Capabilities, result: GenerateResult) -> tuple[list[Failure], float]:
        """Tier 0 on a finished answer, run here once: its failures decide on failover and go on to
        the validator's record_organic hook with the CPU time they took."""
        started = time.thread_time()
        failures = check_tier0(None, result, self.tokenizer, caps, target.hotkey, self.scoring_config)
        return failures, time.thread_time() - started

    async def _attempt_whole(self, target: MinerTarget, caps: Capabilities, wire: GenerateRequest,
                             plan: _Plan) -> Optional[web.Response]:
        try:
            result = await self.client.generate(target.url, target.hotkey, wire, self.timeouts)
        except MinerError as error:
            self._note_failure(target, error)
            self._report(target, error, wire)
            return None
        failures, cpu_s = self._verify(target, caps, result)
        self._report(target, result, wire, failures, cpu_s)
        if failures:
            self._note_failure(target, "tier 0: " + "; ".join(map(str, failures)))
            return None
        return web.json_response(_whole_answer(plan, result, self.tokenizer, self.settings.model_name, caps),
                                 headers={MINER_UID_HEADER: str(target.uid), REQUEST_ID_HEADER: wire.request_id})

    async def _attempt_stream(self, target: MinerTarget, caps: Capabilities, wire: GenerateRequest,
                              writer: "_SseWriter") -> Optional[web.StreamResponse]:
        """Relay one miner's stream. None (fail over) while nothing went to the user yet."""
        result = GenerateResult(request=wire, body=b"", started_at=time.time())
        events = self.client.stream_generate(target.url, target.hotkey, wire, self.timeouts, result)
        try:
            async with aclosing(events):
                async for timed in events:
                    event = timed.event
                    if isinstance(event, TokenMessage):
                        await writer.tokens(event, target, caps, wire.request_id)
                    elif isinstance(event, FinalMessage):
                        result.final = event
                    elif isinstance(event, ErrorEvent):
                        result.error = event
                        raise MinerStreamError(event.code, event.message)
        except MinerError as error:
            error.partial = result
            self._note_failure(target, error)
            self._report(target, error, wire)
            if writer.response is None:
                return None
            await writer.fail(f"the miner's stream broke: {error}")
            return writer.response
        except ConnectionError:  # the user left; closing the stream above freed the miner's sequence
            return writer.response or web.Response(status=499)
        failures, cpu_s = self._verify(target, caps, result)
        self._report(target, result, wire, failures, cpu_s)
        if failures:
            self._note_failure(target, "tier 0: " + "; ".join(map(str, failures)))
            if writer.response is None:
                return None
            await writer.fail("the miner's answer failed verification: "
                              + "; ".join(f.check for f in failures))
            return writer.response
        await writer.finish(result, target, caps, wire.request_id)
        return writer.response

    # ------------------------------------------------------------ the validator's hook
    def _report(self, target: MinerTarget, outcome: Outcome, wire: GenerateRequest,
                tier0: Optional[list[Failure]] = None, tier0_cpu_s: Optional[float] = None) -> None:
        self.metrics.observe_attempt(outcome, tier0)
        hook = getattr(self.directory, "record_organic", None)
        if hook is None:
            return
        try:
            done = hook(uid=target.uid, hotkey=target.hotkey, outcome=outcome,
                        prompt_ids=list(wire.prompt_token_ids), tier0=tier0, tier0_cpu_s=tier0_cpu_s)
        except Exception as error:  # the validator's bookkeeping must never fail a user's request
            log.warning("record_organic failed for uid %d: %r", target.uid, error)
            return
        if inspect.isawaitable(done):
            task = asyncio.ensure_future(done)
            self._hook_tasks.add(task)
            task.add_done_callback(self._hook_done)

    def _hook_done(self, task: asyncio.Task) -> None:
        self._hook_tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("record_organic failed: %r", task.exception())

    async def _drain_hooks(self, app=None) -> None:
        if self._hook_tasks:
            await asyncio.wait(list(self._hook_tasks), timeout=5.0)


# ---------------------------------------------------------------- answers
def _token_text(tokenizer, token_id: int, as_ids: bool = False) -> str:
    """A logprob entry's token: its text, or `token_id:N` (vLLM's return_tokens_as_token_ids)."""
    return f"token_id:{token_id}" if as_ids else tokenizer.decode([token_id])


def _token_bytes(tokenizer, token_id: int) -> list[int]:
    raw = tokenizer.token_bytes(token_id)
    return list(raw if raw is not None else tokenizer.decode([token_id]).encode())


def _chat_logprobs(tokenizer, events: Sequence[TokenMessage], n: int, as_ids: bool = False) -> list[dict]:
    out = []
    for event in events:
        for token, lp, top in zip(event.token_ids, event.logprobs, event.top_logprobs):
            out.append({
                "token": _token_text(tokenizer, token, as_ids), "logprob": lp,
                "bytes": _token_bytes(tokenizer, token),
                "top_logprobs": [{"token": _token_text(tokenizer, t.token_id, as_ids), "logprob": t.logprob,
                                  "bytes": _token_bytes(tokenizer, t.token_id)} for t in top[:n]],
            })
    return out


def _completion_logprobs(tokenizer, events: Sequence[TokenMessage], n: int, offset: int = 0,
                         as_ids: bool = False) -> dict:
    tokens, values, tops, offsets = [], [], [], []
    for event in events:
        for token, lp, top in zip(event.token_ids, event.logprobs, event.top_logprobs):
            name = _token_text(tokenizer, token, as_ids)
            tokens.append(name)
            values.append(lp)
            tops.append({_token_text(tokenizer, t.token_id, as_ids): t.logprob for t in top[:n]})
            offsets.append(offset)
            offset += len(tokenizer.decode([token]))
    return {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops, "text_offset": offsets}


def _usage(plan: _Plan, result: GenerateResult) -> dict:
    prompt, completion = len(plan.prompt_ids), len(result.token_ids)  # the validator's own count
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def _decoded_text(tokenizer, token_ids: Sequence[int], stops: Sequence[str], skip_special_tokens: bool = True) -> str:
    decoder = tokenizer.incremental_decoder(skip_special_tokens=skip_special_tokens)
    trimmer = StopTrimmer(stops)
    text = trimmer.push(decoder.push_many(token_ids) + decoder.flush())
    return text + trimmer.flush()


def _whole_answer(plan: _Plan, result: GenerateResult, tokenizer, model_name: str, caps: Capabilities) -> dict:
    body = plan.body
    text = _decoded_text(tokenizer, result.token_ids, body.stop_strings, body.skip_special_tokens)
    events = [timed.event for timed in result.token_events]
    as_ids = body.return_tokens_as_token_ids
    finish = _finish_reason(result.final)
    common = {"id": plan.response_id, "created": plan.created, "model": model_name,
              "system_fingerprint": caps.model_fingerprint, "usage": _usage(plan, result)}
    if plan.kind == "chat":
        logprobs = None
        if plan.user_logprobs is not None:
            logprobs = {"content": _chat_logprobs(tokenizer, events, plan.user_logprobs, as_ids)}
        choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": logprobs,
                  "finish_reason": finish}
        return {"object": "chat.completion", "choices": [choice], **common}
    logprobs = None
    if plan.user_logprobs is not None:
        logprobs = _completion_logprobs(tokenizer, events, plan.user_logprobs, as_ids=as_ids)
    choice = {"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish}
    return {"object": "text_completion", "choices": [choice], **common}


class _SseWriter:
    """The user's stream in OpenAI's chunk format. Nothing is sent before the first token, so
    that until then a failed miner can be replaced without the user noticing."""

    def __init__(self, request: web.Request, plan: _Plan, tokenizer, model_name: str):
        self.request = request
        self.plan = plan
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.response: Optional[web.StreamResponse] = None
        self.fingerprint: Optional[str] = None
        self.decoder = None
        self.trimmer = None
        self.offset = 0

    def _chunk(self, choices: list, **extra) -> bytes:
        obj = "chat.completion.chunk" if self.plan.kind == "chat" else "text_completion"
        payload = {"id": self.plan.response_id, "object": obj, "created": self.plan.created, "model": self.model_name,
                   "system_fingerprint": self.fingerprint, "choices": choices, **extra}
        return b"data: " + json.dumps(payload).encode() + b"\n\n"

    async def _open(self, target: MinerTarget, caps: Capabilities, request_id: str) -> None:
        self.fingerprint = caps.model_fingerprint
        self.decoder = self.tokenizer.incremental_decoder(skip_special_tokens=self.plan.body.skip_special_tokens)
        self.trimmer = StopTrimmer(self.plan.body.stop_strings)
        response = web.StreamResponse(status=200, headers={**SSE_HEADERS, MINER_UID_HEADER: str(target.uid),
                                                           REQUEST_ID_HEADER: request_id})
        await response.prepare(self.request)
        self.response = response
        if self.plan.kind == "chat":
            await response.write(self._chunk([{"index": 0, "delta": {"role": "assistant", "content": ""},
                                               "logprobs": None, "finish_reason": None}]))

    async def tokens(self, event: TokenMessage, target: MinerTarget, caps: Capabilities, request_id: str) -> None:
        if self.response is None:
            await self._open(target, caps, request_id)
        text = self.trimmer.push(self.decoder.push_many(event.token_ids))
        await self._piece(text, [event])

    def _choice(self, text: str, events: list[TokenMessage], finish: Optional[str] = None) -> dict:
        n, as_ids = self.plan.user_logprobs, self.plan.body.return_tokens_as_token_ids
        if self.plan.kind == "chat":
            logprobs = {"content": _chat_logprobs(self.tokenizer, events, n, as_ids)} if n is not None and events \
                else None
            delta = {"content": text} if text or finish is None else {}
            return {"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
        logprobs = _completion_logprobs(self.tokenizer, events, n, self.offset, as_ids) if n is not None and events \
            else None
        return {"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish}

    async def _piece(self, text: str, events: list[TokenMessage]) -> None:
        n = self.plan.user_logprobs
        if not text and (n is None or not events or self.trimmer.stopped):
            return
        choice = self._choice(text, events)
        self.offset += len(text)
        await self.response.write(self._chunk([choice]))

    async def finish(self, result: GenerateResult, target: MinerTarget, caps: Capabilities, request_id: str) -> None:
        if self.response is None:  # a generation without tokens (e.g. max_tokens reached at once)
            await self._open(target, caps, request_id)
        # The text still held (a stop string's look-ahead, an unfinished UTF-8 character) belongs to
        # tokens already sent: it goes with the finish reason, in the last chunk, without logprobs.
        tail = self.trimmer.push(self.decoder.flush()) + self.trimmer.flush()
        last = self._choice(tail, [], _finish_reason(result.final))
        await self.response.write(self._chunk([last]))
        if self.plan.body.include_usage:
            await self.response.write(self._chunk([], usage=_usage(self.plan, result)))
        await self.response.write(b"data: [DONE]\n\n")
        await self.response.write_eof()

    async def fail(self, message: str) -> None:
        """End a started stream with an error chunk (no [DONE]): the client raises it."""
        error = ApiError(ErrorCode.MINER_FAILED, message)
        try:
            await self.response.write(b"data: " + json.dumps(error.body()).encode() + b"\n\n")
            await self.response.write_eof()
        except ConnectionError:
            pass


# ---------------------------------------------------------------- running it
def build_gateway_app(directory: MinerDirectory, miner_client: MinerClient, tokenizer, api_keys: ApiKeys,
                      settings: GatewaySettings, *, scoring_config: Optional[ScoringConfig] = None
                      ) -> web.Application:
    """The gateway as an aiohttp application (`app[GATEWAY_KEY]` is the OrganicGateway)."""
    gateway = OrganicGateway(directory, miner_client, tokenizer, api_keys, settings, scoring_config)
    gateway.app[GATEWAY_KEY] = gateway
    return gateway.app


GATEWAY_KEY = web.AppKey("gateway", OrganicGateway)


class GatewayServer:
    """Serves the gateway on settings.host:settings.port: `await start()`, `url`, `await close()`."""

    def __init__(self, directory: MinerDirectory, miner_client: MinerClient, tokenizer, settings: GatewaySettings,
                 *, api_keys: Optional[ApiKeys] = None, scoring_config: Optional[ScoringConfig] = None):
        problems = settings.problems(need_key_file=False)
        if api_keys is None and not settings.api_keys_file:
            problems.append("the gateway needs --gateway-api-keys FILE (one API key per line)")
        if problems:
            raise GatewaySetupError("; ".join(problems))
        if api_keys is None:
            try:
                api_keys = ApiKeys(settings.api_keys_file)
            except ApiKeyFileError as error:
                raise GatewaySetupError(str(error)) from None
        self.settings = settings
        self.api_keys = api_keys
        self.app = build_gateway_app(directory, miner_client, tokenizer, api_keys, settings,
                                     scoring_config=scoring_config)
        self.gateway = self.app[GATEWAY_KEY]
        self._runner: Optional[web.AppRunner] = None
        self.port: Optional[int] = None

    async def start(self) -> None:
        # handler_cancellation: a user who disconnects cancels the handler, which closes the miner stream.
        guard = self.gateway.guard
        self._runner = web.AppRunner(self.app, handler_cancellation=True, access_log=None, shutdown_timeout=2.0,
                                     **runner_options(guard.settings))
        await self._runner.setup()
        await GuardedSite(self._runner, guard, self.settings.host, self.settings.port, reuse_address=True).start()
        self.port = self._runner.addresses[0][1]
        if len(self.api_keys) == 0:
            log.warning("the API key file %s holds no keys: every request gets 401", self.api_keys.path)
        log.info("organic gateway serving %s on %s", self.settings.model_name, self.url)

    @property
    def url(self) -> str:
        host = self.settings.host
        host = "127.0.0.1" if host in ("0.0.0.0", "") else ("[::1]" if host == "::" else host)
        return f"http://{host}:{self.port}"

    async def close(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None


__all__ = [
    "MinerTarget", "MinerDirectory", "Outcome", "StopTrimmer", "OrganicGateway", "build_gateway_app", "GatewayServer",
    "GATEWAY_KEY", "MINER_UID_HEADER", "REQUEST_ID_HEADER",
]
