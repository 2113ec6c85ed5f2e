"""Wire schemas of the subnet protocol (docs/subnet.md section 2), version 1.

Every body on the wire is one of these pydantic v2 models: `extra="forbid"`,
strict types (no "5" for 5, no 1.0 for a token id, no true for an int) and an
explicit bound on every field. Bounds that a deployment may change (prompt
size, max_tokens cap, ...) live in `Limits` and reach the validators through
the pydantic validation context (`parse_generate(raw, limits)`); without a
context the defaults apply. Bounds that depend on the served model (token ids
inside the vocabulary, prompt plus output inside the context window) are
checked after parsing by `check_against(vocab_size, max_context)`.

Streams are NDJSON: one `StreamEvent` per line. A generation is zero or more
`token` events, then exactly one `final` event (or one `error` event if the
miner gives up mid-stream). Every sampled token, including the EOS that ends a
generation and the token that completes a stop string, appears in exactly one
token event; text pieces are the plain detokenisation (stop strings are not
trimmed). Reported logprobs are under the model's unmodified distribution
(temperature 1, no top-k/top-p truncation), so a validator can compare them
with `/v1/score` on a reference engine.
"""
from __future__ import annotations

import json
from typing import Annotated, Any, Literal, Optional, Union

from pydantic import (AfterValidator, BaseModel, ConfigDict, Field, TypeAdapter, ValidationError, ValidationInfo,
                      field_validator, model_validator)
from pydantic_core import PydanticCustomError

from .errors import http_status

PROTOCOL_VERSION = 1

GENERATE_PATH = "/v1/generate"
SCORE_PATH = "/v1/score"
STATES_PATH = "/v1/states"  # open an answer's committed residual states (StateOpeningRequest -> StateOpening)
CAPABILITIES_PATH = "/v1/capabilities"
HEALTH_PATH = "/health"

JSON_CONTENT_TYPE = "application/json"
NDJSON_CONTENT_TYPE = "application/x-ndjson"

# Hard ceilings that no Limits can raise: the spec caps top-k alternatives at 20.
MAX_LOGPROBS = 20
U64_MAX = 2**64 - 1
# Token ids travel as u32 in the response signature; any real vocabulary is far below.
MAX_TOKEN_ID = 2**32 - 1
# A token event may carry several tokens (e.g. speculative decoding accepts a few at once).
MAX_TOKENS_PER_EVENT = 64
MAX_TOKEN_TEXT = 16_384  # characters of text one token event may carry
# The chosen token's logprob may round slightly above 0 in float arithmetic.
LOGPROB_CEILING = 1e-3
LOGPROB_FLOOR = -1e6
# Sampling bounds, the same on the miner and on the gateway (inference.decoding.sampling states the same
# numbers; a test checks): temperature is 0 (greedy) or in [TEMPERATURE_MIN, TEMPERATURE_MAX]; top_p in
# [TOP_P_MIN, 1]. Smaller positive values would be greedy in all but name and only invite overflow.
TEMPERATURE_MIN = 1e-3
TEMPERATURE_MAX = 2.0
TOP_P_MIN = 1e-6

_ID_PATTERN = r"^[A-Za-z0-9._:\-]+$"
_SS58_PATTERN = r"^[1-9A-HJ-NP-Za-km-z]{40,60}$"
_HEX64 = r"^[0-9a-f]{64}$"
_HEX128 = r"^[0-9a-f]{128}$"
_ERROR_CODE_PATTERN = r"^[a-z0-9_]{1,64}$"


class _WireModel(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)


def _check_version(value: int) -> int:
    if value != PROTOCOL_VERSION:
        raise PydanticCustomError(
            "unsupported_version",
            "unsupported protocol version {got}; this side speaks version {want}",
            {"got": value, "want": PROTOCOL_VERSION},
        )
    return value


ProtocolVersion = Annotated[int, Field(ge=0, le=1_000_000), AfterValidator(_check_version)]
RequestId = Annotated[str, Field(min_length=1, max_length=128, pattern=_ID_PATTERN)]
Logprob = Annotated[float, Field(ge=LOGPROB_FLOOR, le=LOGPROB_CEILING, allow_inf_nan=False)]
TokenId = Annotated[int, Field(ge=0, le=MAX_TOKEN_ID)]


def _check_id_range(token_ids: list[int]) -> list[int]:
    # One min/max pass instead of a per-item constraint: ~1.5x faster on 1M-token prompts.
    if token_ids and (min(token_ids) < 0 or max(token_ids) > MAX_TOKEN_ID):
        index = next(i for i, t in enumerate(token_ids) if not 0 <= t <= MAX_TOKEN_ID)
        raise PydanticCustomError(
            "token_id_range", "token id at index {index} is {value}, outside 0..{top}",
            {"index": index, "value": token_ids[index], "top": MAX_TOKEN_ID},
        )
    return token_ids


# fail_fast: a million non-integers must produce one error, not a million error objects.
TokenIds = Annotated[list[int], Field(fail_fast=True), AfterValidator(_check_id_range)]
Millis = Annotated[float, Field(ge=0, le=1e9, allow_inf_nan=False)]
Count = Annotated[int, Field(ge=0, le=2**31 - 1)]


# ---------------------------------------------------------------- limits
class Limits(_WireModel):
    """The configurable size bounds of requests. Defaults fit 1M-token contexts."""

    max_body_bytes: int = Field(64 * 1024 * 1024, ge=1024, le=2**34)
    max_prompt_chars: int = Field(8_000_000, ge=1, le=2**31 - 1)
    max_prompt_tokens: int = Field(1_048_576, ge=1, le=2**31 - 1)
    max_tokens: int = Field(32_768, ge=1, le=2**31 - 1)
    max_stop_strings: int = Field(8, ge=0, le=64)
    max_stop_chars: int = Field(64, ge=1, le=1024)
    max_logprobs: int = Field(MAX_LOGPROBS, ge=0, le=MAX_LOGPROBS)
    max_score_tokens: int = Field(1_048_576 + 32_768, ge=2, le=2**31 - 1)
    max_score_positions: int = Field(4096, ge=1, le=2**31 - 1)


DEFAULT_LIMITS = Limits()


def _limits(info: ValidationInfo) -> Limits:
    context = info.context or {}
    return context.get("limits") or DEFAULT_LIMITS


def _too_large(what: str, got: int, limit: int) -> PydanticCustomError:
    # A distinct error type so that parsing maps it to 413 rather than 400.
    return PydanticCustomError(
        "too_large", "{what} is {got}, above this server's limit of {limit}",
        {"what": what, "got": got, "limit": limit},
    )


class ProtocolError(Exception):
    """A request that the server refuses: `status` (from the code, protocol.errors) is the HTTP status to answer with."""

    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code = str(code)
        self.message = message
        self.status = http_status(code, 400)

    def to_json(self) -> bytes:
        return error_body(self.code, self.message)

    def __repr__(self) -> str:
        return f"ProtocolError({self.code!r}, {self.message!r}, status={self.status})"


def _check_token_ids(token_ids: list[int], vocab_size: int, field: str) -> None:
    if token_ids and max(token_ids) >= vocab_size:
        highest = max(token_ids)
        raise ProtocolError(
            "token_out_of_vocab",
            f"{field}[{token_ids.index(highest)}] = {highest} is outside the vocabulary "
            f"(ids must be below {vocab_size})",
        )


# ---------------------------------------------------------------- requests
class GenerateRequest(_WireModel):
    """POST /v1/generate. Exactly one of `prompt` (text) and `prompt_token_ids`."""

    protocol_version: ProtocolVersion = PROTOCOL_VERSION
    request_id: RequestId
    prompt: Optional[str] = Field(None, min_length=1)
    prompt_token_ids: Optional[TokenIds] = Field(None, min_length=1)
    # Text prompts only: let the tokenizer add the model's special prefix (BOS).
    add_special_tokens: bool = False
    # Text prompts only: wrap the prompt as one user turn in the model's chat template.
    chat: bool = False
    max_tokens: int = Field(ge=1, le=2**31 - 1)
    temperature: float = Field(1.0, ge=0.0, le=TEMPERATURE_MAX, allow_inf_nan=False)
    top_p: float = Field(1.0, ge=TOP_P_MIN, le=1.0, allow_inf_nan=False)
    top_k: int = Field(0, ge=0, le=MAX_TOKEN_ID)  # 0 = no top-k truncation
    seed: Optional[int] = Field(None, ge=0, le=U64_MAX)
    stop: list[str] = Field(default_factory=list, max_length=64)
    logprobs: int = Field(0, ge=0, le=MAX_LOGPROBS)  # top-k alternatives per token

    @field_validator("temperature")
    @classmethod
    def _temperature(cls, value: float) -> float:
        if 0.0 < value < TEMPERATURE_MIN:
            raise PydanticCustomError(
                "temperature_range", "temperature must be 0 (greedy) or at least {low} (got {got})",
                {"low": TEMPERATURE_MIN, "got": value},
            )
        return value

    @field_validator("prompt")
    @classmethod
    def _prompt_size(cls, value: Optional[str], info: ValidationInfo) -> Optional[str]:
        limits = _limits(info)
        if value is not None and len(value) > limits.max_prompt_chars:
            raise _too_large("prompt length in characters", len(value), limits.max_prompt_chars)
        return value

    @field_validator("prompt_token_ids")
    @classmethod
    def _prompt_tokens(cls, value: Optional[list[int]], info: ValidationInfo) -> Optional[list[int]]:
        limits = _limits(info)
        if value is not None and len(value) > limits.max_prompt_tokens:
            raise _too_large("prompt length in tokens", len(value), limits.max_prompt_tokens)
        return value

    @field_validator("max_tokens")
    @classmethod
    def _max_tokens(cls, value: int, info: ValidationInfo) -> int:
        limits = _limits(info)
        if value > limits.max_tokens:
            raise _too_large("max_tokens", value, limits.max_tokens)
        return value

    @field_validator("stop")
    @classmethod
    def _stop(cls, value: list[str], info: ValidationInfo) -> list[str]:
        limits = _limits(info)
        if len(value) > limits.max_stop_strings:
            raise PydanticCustomError(
                "stop_count", "at most {limit} stop strings are allowed, got {got}",
                {"limit": limits.max_stop_strings, "got": len(value)},
            )
        for i, text in enumerate(value):
            if not 1 <= len(text) <= limits.max_stop_chars:
                raise PydanticCustomError(
                    "stop_length", "stop[{i}] must have 1 to {limit} characters, got {got}",
                    {"i": i, "limit": limits.max_stop_chars, "got": len(text)},
                )
        return value

    @field_validator("logprobs")
    @classmethod
    def _logprobs(cls, value: int, info: ValidationInfo) -> int:
        limits = _limits(info)
        if value > limits.max_logprobs:
            raise PydanticCustomError(
                "logprobs_limit", "logprobs may be at most {limit}, got {got}",
                {"limit": limits.max_logprobs, "got": value},
            )
        return value

    @model_validator(mode="after")
    def _one_prompt(self) -> "GenerateRequest":
        if (self.prompt is None) == (self.prompt_token_ids is None):
            raise PydanticCustomError(
                "prompt_choice", "give exactly one of prompt (text) or prompt_token_ids"
            )
        if (self.add_special_tokens or self.chat) and self.prompt is None:
            raise PydanticCustomError(
                "prompt_choice", "add_special_tokens and chat only apply to a text prompt"
            )
        return self

    def check_against(self, vocab_size: int, max_context: int) -> None:
        """Model-dependent bounds, for token-id prompts. Raises ProtocolError (400).

        A text prompt is only counted after tokenisation: call
        `check_context(len(prompt_ids), max_context)` then.
        """
        if self.top_k > vocab_size:
            raise ProtocolError("invalid_request", f"top_k = {self.top_k} exceeds the vocabulary size {vocab_size}")
        if self.prompt_token_ids is not None:
            _check_token_ids(self.prompt_token_ids, vocab_size, "prompt_token_ids")
            self.check_context(len(self.prompt_token_ids), max_context)

    def check_context(self, prompt_tokens: int, max_context: int) -> None:
        if prompt_tokens + self.max_tokens > max_context:
            raise ProtocolError(
                "context_exceeded",
                f"prompt ({prompt_tokens} tokens) + max_tokens ({self.max_tokens}) exceeds the "
                f"model's context of {max_context} tokens; shorten the prompt or lower max_tokens",
            )


class ScoreRequest(_WireModel):
    """POST /v1/score: teacher-forced logprobs of given tokens, no generation.

    For a position p the answer is the logprob of token_ids[p] given
    token_ids[:p]; `positions` (strictly increasing, each in 1..len-1) picks
    which ones, None means every position 1..len-1.
    """

    protocol_version: ProtocolVersion = PROTOCOL_VERSION
    request_id: RequestId
    token_ids: TokenIds = Field(min_length=2)
    # validate_default: "None = all positions" must also respect max_score_positions.
    positions: Optional[Annotated[list[int], Field(fail_fast=True)]] = Field(None, min_length=1, validate_default=True)
    top_k: int = Field(0, ge=0, le=MAX_LOGPROBS)

    @field_validator("token_ids")
    @classmethod
    def _token_count(cls, value: list[int], info: ValidationInfo) -> list[int]:
        limits = _limits(info)
        if len(value) > limits.max_score_tokens:
            raise _too_large("token_ids length", len(value), limits.max_score_tokens)
        return value

    @field_validator("positions")
    @classmethod
    def _positions(cls, value: Optional[list[int]], info: ValidationInfo) -> Optional[list[int]]:
        limits = _limits(info)
        token_ids = info.data.get("token_ids")
        if token_ids is None:  # already reported as a token_ids error
            return value
        count = len(token_ids) - 1 if value is None else len(value)
        if count > limits.max_score_positions:
            what = "number of positions" if value is not None else "number of positions (all of token_ids)"
            raise _too_large(what, count, limits.max_score_positions)
        if value is None:
            return value
        previous = 0
        for i, position in enumerate(value):
            if not 1 <= position < len(token_ids):
                raise PydanticCustomError(
                    "position_range", "positions[{i}] = {p} is outside 1..{last}",
                    {"i": i, "p": position, "last": len(token_ids) - 1},
                )
            if position <= previous:
                raise PydanticCustomError(
                    "position_order", "positions must be strictly increasing (positions[{i}] = {p})",
                    {"i": i, "p": position},
                )
            previous = position
        return value

    @field_validator("top_k")
    @classmethod
    def _top_k(cls, value: int, info: ValidationInfo) -> int:
        limits = _limits(info)
        if value > limits.max_logprobs:
            raise PydanticCustomError(
                "logprobs_limit", "top_k may be at most {limit}, got {got}",
                {"limit": limits.max_logprobs, "got": value},
            )
        return value

    def resolved_positions(self) -> list[int]:
        return list(range(1, len(self.token_ids))) if self.positions is None else list(self.positions)

    def check_against(self, vocab_size: int, max_context: int) -> None:
        _check_token_ids(self.token_ids, vocab_size, "token_ids")
        if len(self.token_ids) > max_context:
            raise ProtocolError(
                "context_exceeded",
                f"token_ids has {len(self.token_ids)} tokens, above the model's context of {max_context}",
            )


# ---------------------------------------------------------------- responses
class TopLogprob(_WireModel):
    token_id: TokenId
    logprob: Logprob


TopLogprobs = Annotated[list[TopLogprob], Field(max_length=MAX_LOGPROBS)]


class ScoredPositionMessage(_WireModel):
    position: int = Field(ge=1, le=2**31 - 1)
    token_id: TokenId
    logprob: Logprob
    top: TopLogprobs = Field(default_factory=list)


class ScoreResponse(_WireModel):
    protocol_version: ProtocolVersion = PROTOCOL_VERSION
    request_id: RequestId
    model_fingerprint: str = Field(min_length=1, max_length=128, pattern=_ID_PATTERN)
    scores: list[ScoredPositionMessage]


class ResponseSignature(_WireModel):
    """The miner's hotkey signature over sha256(request body) || sha256(token ids).

    See protocol/signature.py for the exact signed bytes.
    """

    hotkey: str = Field(pattern=_SS58_PATTERN)
    request_sha256: str = Field(pattern=_HEX64)
    tokens_sha256: str = Field(pattern=_HEX64)
    signature: str = Field(pattern=_HEX128)  # sr25519, 64 bytes, lowercase hex


class TokenMessage(_WireModel):
    """One or more generated tokens. `index` is the position in the completion of
    token_ids[0]; `logprobs[i]` and `top_logprobs[i]` belong to token_ids[i]."""

    type: Literal["token"] = "token"
    index: int = Field(ge=0, le=2**31 - 1)
    token_ids: Annotated[list[TokenId], Field(min_length=1, max_length=MAX_TOKENS_PER_EVENT)]
    text: str = Field(max_length=MAX_TOKEN_TEXT)
    logprobs: Annotated[list[Logprob], Field(max_length=MAX_TOKENS_PER_EVENT)]
    top_logprobs: Annotated[list[TopLogprobs], Field(max_length=MAX_TOKENS_PER_EVENT)]

    @model_validator(mode="after")
    def _aligned(self) -> "TokenMessage":
        if not len(self.token_ids) == len(self.logprobs) == len(self.top_logprobs):
            raise PydanticCustomError(
                "misaligned", "token_ids, logprobs and top_logprobs must have one entry per token"
            )
        return self


class Usage(_WireModel):
    prompt_tokens: Count
    completion_tokens: Count


class Timings(_WireModel):
    """As measured by the miner; validators keep their own clock."""

    queue_ms: Millis
    ttft_ms: Millis
    total_ms: Millis
    prefill_tokens_per_s: Optional[Annotated[float, Field(ge=0, le=1e12, allow_inf_nan=False)]] = None
    decode_tokens_per_s: Optional[Annotated[float, Field(ge=0, le=1e12, allow_inf_nan=False)]] = None


MAX_COMMITTED_BOUNDARIES = 1024
MAX_OPENED_POSITIONS = 1 << 17


class StateCommitmentMessage(_WireModel):
    """The miner's commitment to the residual states of every position at every committed layer boundary of the
    answer (docs/verification.md, "State commitments"): `root` is covered by the response signature."""

    scheme: Literal["k3-states/1"] = "k3-states/1"
    root: str = Field(pattern=_HEX64)
    positions: int = Field(ge=1, le=2**31 - 1)  # positions the model ran (prompt and fed completion tokens)
    boundaries: Annotated[list[Annotated[int, Field(ge=1, le=1_000_000)]],
                          Field(min_length=1, max_length=MAX_COMMITTED_BOUNDARIES)]


class FinalMessage(_WireModel):
    """Last event of a successful stream. finish_reason: "eos" (end-of-sequence
    token), "stop" (a stop string), "length" (max_tokens reached). `seed`: the seed
    the sampler ran with (the request's, or one the miner drew), covered by the
    signature; with the miner's declared sampler it replays the answer. `state_commitment`: present when the
    engine commits to its layer states (the project's engine; None for engines that cannot)."""

    type: Literal["final"] = "final"
    finish_reason: Literal["stop", "length", "eos"]
    usage: Usage
    timings: Timings
    model_fingerprint: str = Field(min_length=1, max_length=128, pattern=_ID_PATTERN)
    signature: ResponseSignature
    seed: Optional[int] = Field(None, ge=0, le=U64_MAX)
    state_commitment: Optional[StateCommitmentMessage] = None


class BoundaryPositions(_WireModel):
    boundary: int = Field(ge=1, le=1_000_000)
    positions: Annotated[list[Annotated[int, Field(ge=0, le=2**31 - 1)]],
                         Field(min_length=1, max_length=MAX_OPENED_POSITIONS)]

    @model_validator(mode="after")
    def _sorted(self) -> "BoundaryPositions":
        if any(b <= a for a, b in zip(self.positions, self.positions[1:])):
            raise PydanticCustomError("unsorted", "positions must be strictly increasing")
        return self


class StateOpeningRequest(_WireModel):
    """POST /v1/states: open some positions at some boundaries of an answer's committed states (the answer's
    request id and commitment root)."""

    protocol_version: ProtocolVersion = PROTOCOL_VERSION
    request_id: RequestId
    root: str = Field(pattern=_HEX64)
    open: Annotated[list[BoundaryPositions], Field(min_length=1, max_length=MAX_COMMITTED_BOUNDARIES)]


class OpenedBoundary(_WireModel):
    """The rows at `positions` of one boundary (base64 of fp32 little-endian [len(positions), hidden]) and the
    multiproof that rebuilds the boundary's root from them."""

    boundary: int = Field(ge=1, le=1_000_000)
    positions: Annotated[list[Annotated[int, Field(ge=0, le=2**31 - 1)]],
                         Field(min_length=1, max_length=MAX_OPENED_POSITIONS)]
    rows: str = Field(max_length=1 << 30)
    proof: Annotated[list[Annotated[str, Field(pattern=_HEX64)]], Field(max_length=MAX_OPENED_POSITIONS * 32)]


class StateOpening(_WireModel):
    protocol_version: ProtocolVersion = PROTOCOL_VERSION
    request_id: RequestId
    root: str = Field(pattern=_HEX64)
    positions: int = Field(ge=1, le=2**31 - 1)
    hidden_size: int = Field(ge=1, le=1 << 20)
    boundary_roots: Annotated[list[Annotated[str, Field(pattern=_HEX64)]],
                              Field(min_length=1, max_length=MAX_COMMITTED_BOUNDARIES)]  # in boundary order
    boundaries: Annotated[list[Annotated[int, Field(ge=1, le=1_000_000)]],
                          Field(min_length=1, max_length=MAX_COMMITTED_BOUNDARIES)]
    opened: Annotated[list[OpenedBoundary], Field(max_length=MAX_COMMITTED_BOUNDARIES)]


class ErrorDetail(_WireModel):
    code: str = Field(pattern=_ERROR_CODE_PATTERN)
    message: str = Field(max_length=1024)


class ErrorEvent(_WireModel):
    """The miner gave up mid-stream; no final event follows."""

    type: Literal["error"] = "error"
    code: str = Field(pattern=_ERROR_CODE_PATTERN)
    message: str = Field(max_length=1024)


StreamEvent = Annotated[Union[TokenMessage, FinalMessage, ErrorEvent], Field(discriminator="type")]
STREAM_EVENT = TypeAdapter(StreamEvent)


class ErrorBody(_WireModel):
    """Body of every non-2xx answer: {"error": {"code", "message"}}."""

    error: ErrorDetail


EngineKind = Literal["reference", "sharded", "remote"]
# The sampler a miner declares (inference.decoding.sampling.SAMPLERS states the same names; a test checks):
# "k3-gumbel/1", the protocol's replayable sampler, or "engine", a serving engine's own (not replayable).
SamplerName = Literal["k3-gumbel/1", "engine"]


class Capabilities(_WireModel):
    protocol_version: ProtocolVersion = PROTOCOL_VERSION
    model_id: str = Field(min_length=1, max_length=128)
    model_fingerprint: str = Field(min_length=1, max_length=128, pattern=_ID_PATTERN)
    vocab_size: int = Field(ge=2, le=MAX_TOKEN_ID)
    max_context: int = Field(ge=2, le=2**31 - 1)
    max_concurrent_streams: int = Field(ge=1, le=1_000_000)
    engine: EngineKind
    layout: dict[str, Any] = Field(default_factory=dict, max_length=64)  # shards, placement plan, ...
    precision: str = Field(min_length=1, max_length=64)
    sampler: SamplerName = "engine"  # undeclared: the miner's own sampler, checked statistically only
    software_version: str = Field(min_length=1, max_length=64)
    limits: Limits = DEFAULT_LIMITS  # the request bounds this miner enforces


class Health(_WireModel):
    protocol_version: ProtocolVersion = PROTOCOL_VERSION
    status: Literal["ok", "degraded", "down"]
    detail: str = Field("", max_length=1024)
    # memory the answers' committed states hold, bounded by design (--commit-max-bytes, --commit-retain-s); None
    # from an engine that does not commit
    committed_bytes: Optional[int] = Field(None, ge=0)


# ---------------------------------------------------------------- encoding / parsing
def encode_model(model: BaseModel) -> bytes:
    """The exact bytes to send (and to sign): compact JSON, deterministic for a model."""
    return model.model_dump_json().encode()


def encode_event(event: Union[TokenMessage, FinalMessage, ErrorEvent]) -> bytes:
    """One NDJSON line."""
    return event.model_dump_json().encode() + b"\n"


def error_body(code: str, message: str) -> bytes:
    return encode_model(ErrorBody(error=ErrorDetail(code=str(code), message=message[:1024])))


def describe_validation_error(error: ValidationError, max_items: int = 5) -> tuple[str, set[str]]:
    """A one-line message naming each bad field ("temperature: Input should be ..."),
    never echoing the input; plus the set of error types."""
    items = error.errors(include_url=False, include_input=False, include_context=False)
    parts = []
    for item in items[:max_items]:
        location = ".".join(str(p) for p in item["loc"]) or "body"
        parts.append(f"{location}: {item['msg']}")
    if len(items) > max_items:
        parts.append(f"(+{len(items) - max_items} more)")
    return "; ".join(parts), {item["type"] for item in items}


class _DuplicateKey(ValueError):
    pass


def _no_duplicate_keys(pairs: list[tuple[str, Any]]) -> None:
    seen = set()
    for key, _ in pairs:
        if key in seen:
            raise _DuplicateKey(key)
        seen.add(key)
    return None  # the parsed value is not kept: pydantic parses the body again, strictly


def check_unique_keys(raw: bytes) -> None:
    """ProtocolError (400) when any JSON object in `raw` repeats a key: a lenient reader (a proxy, a log)
    and this server would otherwise read different requests from the same bytes."""
    try:
        json.loads(raw, object_pairs_hook=_no_duplicate_keys)
    except _DuplicateKey as duplicate:
        raise ProtocolError("invalid_json", f"duplicate key {str(duplicate)[:64]!r} in a JSON object") from None
    except (ValueError, RecursionError):
        return  # not JSON at all: pydantic's parse says so, with its own message


def _parse(model: type[BaseModel], raw: bytes, limits: Limits) -> Any:
    if len(raw) > limits.max_body_bytes:
        raise ProtocolError(
            "too_large", f"request body is {len(raw)} bytes, above the limit of {limits.max_body_bytes}"
        )
    check_unique_keys(raw)
    try:
        return model.model_validate_json(raw, context={"limits": limits})
    except ValidationError as error:
        message, kinds = describe_validation_error(error)
        if "json_invalid" in kinds or "json_type" in kinds:
            raise ProtocolError("invalid_json", f"body is not a JSON object: {message}") from None
        if "too_large" in kinds:
            raise ProtocolError("too_large", message) from None
        if "unsupported_version" in kinds:
            raise ProtocolError("unsupported_version", message) from None
        raise ProtocolError("invalid_request", message) from None


def parse_generate(raw: bytes, limits: Limits = DEFAULT_LIMITS) -> GenerateRequest:
    """Bytes of a /v1/generate body -> GenerateRequest, or ProtocolError (400/413)."""
    return _parse(GenerateRequest, raw, limits)


def parse_state_opening(raw: bytes, limits: Limits = DEFAULT_LIMITS) -> StateOpeningRequest:
    """Bytes of a /v1/states body -> StateOpeningRequest, or ProtocolError (400/413)."""
    return _parse(StateOpeningRequest, raw, limits)


def parse_score(raw: bytes, limits: Limits = DEFAULT_LIMITS) -> ScoreRequest:
    """Bytes of a /v1/score body -> ScoreRequest, or ProtocolError (400/413)."""
    return _parse(ScoreRequest, raw, limits)


def decode_event(line: bytes) -> Union[TokenMessage, FinalMessage, ErrorEvent]:
    """One NDJSON line -> event; raises pydantic ValidationError when malformed."""
    return STREAM_EVENT.validate_json(line)


def parse_error_body(raw: bytes) -> Optional[ErrorDetail]:
    """The {"error": {...}} of a failed answer, or None when the body is not one."""
    try:
        return ErrorBody.model_validate_json(raw).error
    except ValidationError:
        return None

