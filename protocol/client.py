"""The one HTTP client for talking to miners (aiohttp).

Every call serialises its request once, signs those exact bytes with btauth/1
(bound to the miner's hotkey) and sends them. Every wait has a deadline:

- `connect`: the TCP connection to the miner;
- `first_byte`: from the start of the call until the response headers and,
  for a generation, the first complete event (upload, prefill, first token);
  a floor to which the prompt's prefill is added: `first_byte + prompt tokens /
  prefill_tokens_per_s` (the rule of the remote engine adapter), so a long
  prompt is not cut off by a deadline sized for a short one;
- `between_events`: from one complete event (or body chunk, for JSON
  answers) to the next; only complete NDJSON lines count, so a miner cannot
  keep a stalled stream alive by trickling bytes or blank lines;
- `total`: the whole call.

Failures are typed: MinerUnreachable, MinerHTTPError (non-200 with its JSON
error body), MinerTimeout(kind), MinerProtocolError (malformed or oversized
answers, a stream without a final event), MinerStreamError (the miner sent an
error event mid-stream). `generate` records, on the client's monotonic clock,
when each event arrived, for TTFT and stream-buffering checks.
"""
from __future__ import annotations

import asyncio
import math
import time
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import AsyncIterator, Awaitable, Optional, TypeVar, Union

import aiohttp
from pydantic import BaseModel, ValidationError

from .auth import auth_clock_ns, hotkey_signer, sign_request
from .errors import ErrorCode
from .schemas import (CAPABILITIES_PATH, GENERATE_PATH, HEALTH_PATH, JSON_CONTENT_TYPE, NDJSON_CONTENT_TYPE, SCORE_PATH,
                      STATES_PATH, Capabilities, ErrorEvent, FinalMessage, GenerateRequest, Health, ScoreRequest,
                      ScoreResponse, StateOpening, StateOpeningRequest, TokenMessage, decode_event,
                      describe_validation_error, encode_model, parse_error_body)

DEFAULT_MAX_RESPONSE_BYTES = 64 * 1024 * 1024
# Error bodies are small; past this the body is not read further.
MAX_ERROR_BODY_BYTES = 64 * 1024

Model = TypeVar("Model", bound=BaseModel)
Event = Union[TokenMessage, FinalMessage, ErrorEvent]


@dataclass(frozen=True)
class ClientTimeouts:
    """Seconds; see the module docstring for what each one bounds.

    The one timeouts type of every client of a miner (validator, gateway, endpoint benchmark),
    with one set of defaults, so that all of them hold a miner to the same deadlines:
    connect: a reachable host answers a SYN in well under a second, 3 s allows for a far one;
    first_byte: a full-context prefill on the reference hardware takes tens of seconds;
    between_events: a serving miner emits a token every few hundred ms, 10 s of silence is a stall;
    total: 600 s covers the longest generation a validator or a user asks for;
    prefill_tokens_per_s: the slowest prefill rate a miner is allowed (1000 tokens/s, the remote
    engine adapter's default): a 131k-token prompt gets first_byte + 131 s for its first token."""

    connect: float = 3.0
    first_byte: float = 60.0
    between_events: float = 10.0
    total: float = 600.0
    prefill_tokens_per_s: float = 1000.0

    def __post_init__(self):
        for name in ("connect", "first_byte", "between_events", "total"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
                raise ValueError(f"ClientTimeouts.{name} must be a positive number of seconds, got {value!r}")
        rate = self.prefill_tokens_per_s
        if not (isinstance(rate, (int, float)) and not math.isnan(rate) and rate > 0):
            raise ValueError(f"ClientTimeouts.prefill_tokens_per_s must be a positive rate (inf: no prefill "
                             f"allowance), got {rate!r}")

    def first_event_s(self, prompt_tokens: int) -> float:
        """Seconds from a call's start by which its first event is due: the floor plus the prefill."""
        return self.first_byte + max(0, prompt_tokens) / self.prefill_tokens_per_s


# ---------------------------------------------------------------- errors
class MinerError(Exception):
    """A call to a miner failed. `partial` holds what a generation had received."""

    partial: Optional["GenerateResult"] = None


class MinerUnreachable(MinerError):
    """The connection could not be made or was dropped."""


class MinerHTTPError(MinerError):
    """A non-200 answer. `code` is the error body's code as sent; `error_code` is it as an
    ErrorCode, or None for a code this protocol does not define."""

    def __init__(self, status: int, code: str, message: str):
        super().__init__(f"HTTP {status} {code}: {message}")
        self.status = status
        self.code = str(code)
        self.message = message

    @property
    def error_code(self) -> Optional[ErrorCode]:
        return ErrorCode.parse(self.code)


class MinerTimeout(MinerError):
    """`kind` is "connect", "first_byte", "between_events" or "total"."""

    def __init__(self, kind: str, limit_s: float):
        super().__init__(f"{kind} timeout after {limit_s:g} s")
        self.kind = kind
        self.limit_s = limit_s


class MinerProtocolError(MinerError):
    """The answer broke the protocol: malformed, too large, out of order or incomplete."""


class MinerStreamError(MinerError):
    """The miner ended a generation with an error event."""

    def __init__(self, code: str, message: str):
        super().__init__(f"miner error {code}: {message}")
        self.code = str(code)
        self.message = message

    @property
    def error_code(self) -> Optional[ErrorCode]:
        return ErrorCode.parse(self.code)


# ---------------------------------------------------------------- results
@dataclass(frozen=True)
class TimedEvent:
    event: Event
    arrived_s: float  # when its last byte was read, seconds after the call started


@dataclass
class GenerateResult:
    request: GenerateRequest
    body: bytes  # the exact bytes sent and signed: verify_response needs them
    started_at: float  # wall clock (time.time()) at the start of the call
    headers_s: Optional[float] = None  # response headers, seconds after the start
    events: list[TimedEvent] = field(default_factory=list)
    final: Optional[FinalMessage] = None
    error: Optional[ErrorEvent] = None

    @property
    def token_events(self) -> list[TimedEvent]:
        return [timed for timed in self.events if isinstance(timed.event, TokenMessage)]

    @property
    def token_ids(self) -> list[int]:
        """All generated tokens in order: what the response signature covers."""
        return [token for timed in self.token_events for token in timed.event.token_ids]

    @property
    def token_arrivals_s(self) -> list[float]:
        """Arrival time of each token (tokens of one event share its time)."""
        return [timed.arrived_s for timed in self.token_events for _ in timed.event.token_ids]

    @property
    def logprobs(self) -> list[float]:
        return [lp for timed in self.token_events for lp in timed.event.logprobs]

    @property
    def text(self) -> str:
        return "".join(timed.event.text for timed in self.token_events)

    @property
    def ttft_s(self) -> Optional[float]:
        events = self.token_events
        return events[0].arrived_s if events else None

    @property
    def total_s(self) -> Optional[float]:
        return self.events[-1].arrived_s if self.events else None


# ---------------------------------------------------------------- deadlines
class _CallClock:
    """The deadlines of one call, on the event loop's monotonic clock."""

    def __init__(self, timeouts: ClientTimeouts, prompt_tokens: int = 0):
        self.loop = asyncio.get_running_loop()
        self.timeouts = timeouts
        self.start = self.loop.time()
        self.total_at = self.start + timeouts.total
        self.first_limit = timeouts.first_event_s(prompt_tokens)  # first_byte plus the prefill allowance
        self.first_at = self.start + self.first_limit

    def elapsed(self) -> float:
        return self.loop.time() - self.start

    async def within(self, awaitable: Awaitable, kind: str, at: float):
        """Await with a deadline `at` for `kind`, capped by the total deadline."""
        limit = self.first_limit if kind == "first_byte" else getattr(self.timeouts, kind)
        if at >= self.total_at:
            kind, at, limit = "total", self.total_at, self.timeouts.total
        try:
            async with asyncio.timeout_at(at):
                return await awaitable
        except aiohttp.ServerTimeoutError:  # aiohttp's own (sock_connect) timeout
            raise MinerTimeout("connect", self.timeouts.connect) from None
        except TimeoutError:
            raise MinerTimeout(kind, limit) from None


# ---------------------------------------------------------------- client
class MinerClient:
    """Signed calls to miners with one hotkey. Use as `async with MinerClient(...)`
    or call `close()`; a session passed in is left open for its owner."""

    def __init__(
        self,
        keypair,
        timeouts: ClientTimeouts = ClientTimeouts(),
        max_response_bytes: int = DEFAULT_MAX_RESPONSE_BYTES,
        session: Optional[aiohttp.ClientSession] = None,
        max_connections: int = 1024,
    ):
        if max_response_bytes < 1024:
            raise ValueError("max_response_bytes must be at least 1024")
        self.signer = hotkey_signer(keypair)
        self.timeouts = timeouts
        self.max_response_bytes = max_response_bytes
        self.max_connections = max_connections
        self._session = session
        self._owns_session = session is None
        self._last_nonce = 0

    async def __aenter__(self) -> "MinerClient":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    async def close(self) -> None:
        if self._owns_session and self._session is not None:
            await self._session.close()
            self._session = None

    def _session_now(self) -> aiohttp.ClientSession:
        if self._session is None:
            # auto_decompress off: we ask for identity encoding, and the size
            # limit then counts exactly the bytes the miner sent.
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=self.max_connections),
                auto_decompress=False,
                timeout=aiohttp.ClientTimeout(total=None),
            )
        return self._session

    def _sign(self, method: str, path: str, body: bytes, receiver_ss58: str) -> dict[str, str]:
        # Strictly increasing nonces, so two requests signed in the same
        # nanosecond by this client never look like a replay to the miner.
        nonce = max(auth_clock_ns(), self._last_nonce + 1)
        self._last_nonce = nonce
        return sign_request(self.signer, method, path, body, receiver_ss58, nonce_ns=nonce)

    # ------------------------------------------------------------ generate
    async def stream_generate(
        self,
        base_url: str,
        receiver_ss58: str,
        request: GenerateRequest,
        timeouts: Optional[ClientTimeouts] = None,
        result: Optional[GenerateResult] = None,
    ) -> AsyncIterator[TimedEvent]:
        """Yield the events of one generation as they arrive; the last one is a
        FinalMessage or an ErrorEvent. Close the iterator if you stop early
        (`contextlib.aclosing`). `result`, when given, is filled as events arrive."""
        body = encode_model(request)
        clock = _CallClock(timeouts or self.timeouts, _prompt_size(request))
        if result is not None:
            result.body = body
        headers = self._sign("POST", GENERATE_PATH, body, receiver_ss58)
        response = await self._send(clock, "POST", _url(base_url, GENERATE_PATH), body, headers, NDJSON_CONTENT_TYPE)
        try:
            if result is not None:
                result.headers_s = clock.elapsed()
            await self._raise_for_status(response, clock)
            _expect_content_type(response, NDJSON_CONTENT_TYPE)
            async for timed in self._events(response, clock):
                if result is not None:
                    result.events.append(timed)
                yield timed
        finally:
            _finish(response)

    async def generate(
        self,
        base_url: str,
        receiver_ss58: str,
        request: GenerateRequest,
        timeouts: Optional[ClientTimeouts] = None,
    ) -> GenerateResult:
        """Run one generation to its final event. On failure the raised MinerError
        carries what had arrived in `.partial`."""
        result = GenerateResult(request=request, body=b"", started_at=time.time())
        try:
            async with aclosing(self.stream_generate(base_url, receiver_ss58, request, timeouts, result)) as events:
                async for timed in events:
                    if isinstance(timed.event, FinalMessage):
                        result.final = timed.event
                    elif isinstance(timed.event, ErrorEvent):
                        result.error = timed.event
                        raise MinerStreamError(timed.event.code, timed.event.message)
        except MinerError as error:
            error.partial = result
            raise
        return result

    async def _events(self, response: aiohttp.ClientResponse, clock: _CallClock) -> AsyncIterator[TimedEvent]:
        timeouts = clock.timeouts
        kind, at = "first_byte", clock.first_at
        buffer = bytearray()
        received = 0
        next_index = 0
        count = 0
        ended = False
        while not ended:
            chunk = await _read_chunk(response, clock, kind, at)
            at_eof = not chunk
            arrived = clock.elapsed()
            received += len(chunk)
            if received > self.max_response_bytes:
                raise MinerProtocolError(f"response larger than {self.max_response_bytes} bytes")
            buffer += chunk
            lines = buffer.split(b"\n")
            # The last piece is an incomplete line, kept for the next chunk (at EOF: the last line).
            buffer = bytearray() if at_eof else bytearray(lines.pop())
            for line in lines:
                if not line.strip():
                    continue
                if ended:
                    raise MinerProtocolError("data after the final event")
                count += 1
                try:
                    event = decode_event(bytes(line))
                except ValidationError as error:
                    raise MinerProtocolError(f"event {count} is malformed: {describe_validation_error(error)[0]}") from None
                if isinstance(event, TokenMessage):
                    if event.index != next_index:
                        raise MinerProtocolError(f"token event {count} has index {event.index}, expected {next_index}")
                    next_index += len(event.token_ids)
                else:
                    ended = True
                yield TimedEvent(event, arrived)
                kind, at = "between_events", clock.start + arrived + timeouts.between_events
            if at_eof and not ended:
                raise MinerProtocolError("stream ended without a final event")

    # ------------------------------------------------------------ JSON calls
    async def score(
        self,
        base_url: str,
        receiver_ss58: str,
        request: ScoreRequest,
        timeouts: Optional[ClientTimeouts] = None,
    ) -> ScoreResponse:
        """Teacher-forced logprobs; checks the answer covers exactly the asked positions."""
        body = encode_model(request)
        answer = await self._json_call("POST", base_url, SCORE_PATH, body, receiver_ss58, ScoreResponse, timeouts,
                                       prompt_tokens=len(request.token_ids))
        if answer.request_id != request.request_id:
            raise MinerProtocolError(f"score answer is for request {answer.request_id!r}, not {request.request_id!r}")
        positions = request.resolved_positions()
        if [scored.position for scored in answer.scores] != positions:
            raise MinerProtocolError("score answer does not cover exactly the requested positions, in order")
        for scored in answer.scores:
            if scored.token_id != request.token_ids[scored.position]:
                raise MinerProtocolError(f"score answer at position {scored.position} names the wrong token id")
            if len(scored.top) != request.top_k:
                raise MinerProtocolError(
                    f"score answer at position {scored.position} has {len(scored.top)} alternatives, asked {request.top_k}"
                )
        return answer

    async def open_states(
        self,
        base_url: str,
        receiver_ss58: str,
        request: StateOpeningRequest,
        timeouts: Optional[ClientTimeouts] = None,
    ) -> StateOpening:
        """The committed states an answer opens (POST /v1/states); checks it answers this answer's commitment
        and the boundaries and positions asked (whether they chain to the root is the caller's check)."""
        answer = await self._json_call("POST", base_url, STATES_PATH, encode_model(request), receiver_ss58,
                                       StateOpening, timeouts)
        if answer.request_id != request.request_id or answer.root != request.root:
            raise MinerProtocolError("state opening answers another answer's commitment")
        if [(o.boundary, o.positions) for o in answer.opened] != [(a.boundary, a.positions) for a in request.open]:
            raise MinerProtocolError("state opening does not hold exactly the boundaries and positions asked, in order")
        return answer

    async def capabilities(
        self, base_url: str, receiver_ss58: str, timeouts: Optional[ClientTimeouts] = None
    ) -> Capabilities:
        return await self._json_call("GET", base_url, CAPABILITIES_PATH, None, receiver_ss58, Capabilities, timeouts)

    async def health(self, base_url: str, timeouts: Optional[ClientTimeouts] = None) -> Health:
        """Unauthenticated liveness. A miner that is not serving answers 503 with its Health ("down" and why),
        returned here like a 200's."""
        return await self._json_call("GET", base_url, HEALTH_PATH, None, None, Health, timeouts, body_on=(200, 503))

    async def _json_call(self, method, base_url, path, body, receiver_ss58, model: type[Model], timeouts,
                         prompt_tokens: int = 0, body_on: tuple[int, ...] = (200,)) -> Model:
        clock = _CallClock(timeouts or self.timeouts, prompt_tokens)
        headers = {} if receiver_ss58 is None else self._sign(method, path, body or b"", receiver_ss58)
        response = await self._send(clock, method, _url(base_url, path), body, headers, JSON_CONTENT_TYPE)
        try:
            if response.status not in body_on or (response.status != 200
                                                  and response.content_type.lower() != JSON_CONTENT_TYPE):
                await self._raise_for_status(response, clock)
            _expect_content_type(response, JSON_CONTENT_TYPE)
            raw = await self._read_body(response, clock, self.max_response_bytes, over_limit="error")
        finally:
            _finish(response)
        try:
            return model.model_validate_json(raw)
        except ValidationError as error:
            if response.status != 200:  # not the model's body: an error answer (a proxy's 503, say)
                detail = parse_error_body(raw)
                code, message = (detail.code, detail.message) if detail else (ErrorCode.UNPARSEABLE_ERROR, "")
                raise MinerHTTPError(response.status, code, message or f"HTTP {response.status}") from None
            raise MinerProtocolError(f"{model.__name__} answer is malformed: {describe_validation_error(error)[0]}") from None

    # ------------------------------------------------------------ HTTP plumbing
    async def _send(self, clock, method, url, body, headers, accept) -> aiohttp.ClientResponse:
        headers = {**headers, "Accept": accept, "Accept-Encoding": "identity"}
        if body is not None:
            headers["Content-Type"] = JSON_CONTENT_TYPE
        request = self._session_now().request(
            method,
            url,
            data=body,
            headers=headers,
            allow_redirects=False,  # a redirect would re-send a request signed for another path
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=clock.timeouts.connect),
        )
        try:
            return await clock.within(request, "first_byte", clock.first_at)
        except aiohttp.ClientResponseError as error:
            raise MinerProtocolError(f"bad HTTP response: {error.message}") from None
        except (aiohttp.ClientError, OSError) as error:
            raise MinerUnreachable(f"cannot reach {url}: {error}") from None

    async def _raise_for_status(self, response: aiohttp.ClientResponse, clock: _CallClock) -> None:
        if response.status == 200:
            return
        raw = await self._read_body(response, clock, MAX_ERROR_BODY_BYTES, over_limit="truncate")
        detail = parse_error_body(raw)
        if detail is not None:
            raise MinerHTTPError(response.status, detail.code, detail.message)
        raise MinerHTTPError(
            response.status, ErrorCode.UNPARSEABLE_ERROR, f"HTTP {response.status} without a JSON error body"
        )

    async def _read_body(self, response, clock: _CallClock, limit: int, over_limit: str) -> bytes:
        data = bytearray()
        while True:
            chunk = await _read_chunk(
                response, clock, "between_events", clock.loop.time() + clock.timeouts.between_events
            )
            if not chunk:
                return bytes(data)
            data += chunk
            if len(data) > limit:
                if over_limit == "truncate":
                    return bytes(data[:limit])
                raise MinerProtocolError(f"response larger than {limit} bytes")


async def _read_chunk(response: aiohttp.ClientResponse, clock: _CallClock, kind: str, at: float) -> bytes:
    """The next bytes of the body (b"" at its end)."""
    try:
        return await clock.within(response.content.readany(), kind, at)
    except aiohttp.ClientPayloadError as error:
        raise MinerProtocolError(f"broken response body: {error}") from None
    except (aiohttp.ClientError, OSError) as error:
        raise MinerUnreachable(f"connection dropped mid-response: {error}") from None


def _prompt_size(request: GenerateRequest) -> int:
    """The prompt's size in tokens for the prefill allowance (a text prompt: its characters / 4, the
    usual bytes per token, as the miner's own tokenizer is not known here)."""
    if request.prompt_token_ids is not None:
        return len(request.prompt_token_ids)
    return len(request.prompt or "") // 4


def _expect_content_type(response: aiohttp.ClientResponse, expected: str) -> None:
    if response.content_type.lower() != expected:
        raise MinerProtocolError(f"expected Content-Type {expected}, got {response.content_type!r}")


def _finish(response: aiohttp.ClientResponse) -> None:
    # A body not read to its end would leave the connection mid-response: close it.
    if response.content.at_eof():
        response.release()
    else:
        response.close()


def _url(base_url: str, path: str) -> str:
    if not base_url.startswith(("http://", "https://")):
        raise ValueError(f"miner URL must start with http:// or https://, got {base_url!r}")
    return base_url.rstrip("/") + path
