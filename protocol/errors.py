"""Every error code the subnet's servers answer with, and the one map to HTTP status.

An error travels as its code (the `code` of an error body or error event, or of an
`EngineError`); nobody recovers an error's kind from its English message. The miner,
the gateway, the protocol client and the endpoint benchmark all read this table.

The engine's codes (`inference.serving.engine.EngineError`) are plain strings because
`inference/` does not import `protocol/`; a test checks that each of them is here.
"""
from __future__ import annotations

import enum
from typing import Optional


class ErrorCode(str, enum.Enum):
    """A machine-readable error kind; the value is what goes on the wire."""

    # the request itself (protocol/schemas.py)
    INVALID_REQUEST = "invalid_request"
    INVALID_JSON = "invalid_json"
    UNSUPPORTED_VERSION = "unsupported_version"
    TOKEN_OUT_OF_VOCAB = "token_out_of_vocab"
    CONTEXT_TOO_LONG = "context_too_long"
    CONTEXT_EXCEEDED = "context_exceeded"
    TOO_LARGE = "too_large"
    UNSUPPORTED_MEDIA_TYPE = "unsupported_media_type"
    REQUEST_TIMEOUT = "request_timeout"
    INVALID_BODY = "invalid_body"
    # btauth/1 (protocol/auth.py)
    MISSING_AUTH = "missing_auth"
    MALFORMED_AUTH = "malformed_auth"
    STALE_REQUEST = "stale_request"
    BAD_SIGNATURE = "bad_signature"
    REPLAYED_REQUEST = "replayed_request"
    UNAUTHORIZED = "unauthorized"
    WRONG_RECEIVER = "wrong_receiver"
    REPLAY_STORE_UNAVAILABLE = "replay_store_unavailable"
    # the miner's validator gate and budgets
    NOT_REGISTERED = "not_registered"
    NO_VALIDATOR_PERMIT = "no_validator_permit"
    INSUFFICIENT_STAKE = "insufficient_stake"
    METAGRAPH_UNAVAILABLE = "metagraph_unavailable"
    RATE_LIMITED = "rate_limited"
    CALLER_STREAMS = "caller_streams"
    SHUTTING_DOWN = "shutting_down"
    INTERNAL_ERROR = "internal_error"
    # the engine (inference/serving/engine.py), and the miner's watch over its stream
    OVER_CAPACITY = "over_capacity"
    QUEUE_FULL = "queue_full"
    ENGINE_UNAVAILABLE = "engine_unavailable"
    ENGINE_FAILURE = "engine_failure"
    ENGINE_STALLED = "engine_stalled"
    CANCELLED = "cancelled"  # the engine dropped the request (it is stopping)
    # the gateway's OpenAI-format answers
    INVALID_API_KEY = "invalid_api_key"
    RATE_LIMIT_EXCEEDED = "rate_limit_exceeded"
    MODEL_NOT_FOUND = "model_not_found"
    UNSUPPORTED_PARAMETER = "unsupported_parameter"
    INVALID_VALUE = "invalid_value"
    CONTEXT_LENGTH_EXCEEDED = "context_length_exceeded"
    NOT_FOUND = "not_found"
    METHOD_NOT_ALLOWED = "method_not_allowed"
    REQUEST_TOO_LARGE = "request_too_large"
    NO_MINER_AVAILABLE = "no_miner_available"
    MINER_FAILED = "miner_failed"
    MINERS_FAILED = "miners_failed"
    TIMEOUT = "timeout"
    # the protocol client's own, for a non-200 answer without a JSON error body
    UNPARSEABLE_ERROR = "unparseable_error"

    def __str__(self) -> str:
        return self.value

    @property
    def http_status(self) -> int:
        return HTTP_STATUS[self]

    @property
    def retry_after_s(self) -> Optional[float]:
        """Seconds a caller should wait before retrying (the Retry-After header), or None."""
        return RETRY_AFTER_S.get(self)

    @classmethod
    def parse(cls, code: str) -> Optional["ErrorCode"]:
        """The known code spelled `code`, or None (a foreign server may send others)."""
        try:
            return cls(code)
        except ValueError:
            return None


E = ErrorCode
HTTP_STATUS: dict[ErrorCode, int] = {
    E.INVALID_REQUEST: 400, E.INVALID_JSON: 400, E.UNSUPPORTED_VERSION: 400, E.TOKEN_OUT_OF_VOCAB: 400,
    E.CONTEXT_TOO_LONG: 400, E.CONTEXT_EXCEEDED: 400, E.TOO_LARGE: 413,
    E.UNSUPPORTED_MEDIA_TYPE: 415, E.REQUEST_TIMEOUT: 408, E.INVALID_BODY: 400,
    E.MISSING_AUTH: 401, E.MALFORMED_AUTH: 401, E.STALE_REQUEST: 401, E.BAD_SIGNATURE: 401,
    E.REPLAYED_REQUEST: 401, E.UNAUTHORIZED: 401, E.WRONG_RECEIVER: 403, E.REPLAY_STORE_UNAVAILABLE: 503,
    E.NOT_REGISTERED: 403, E.NO_VALIDATOR_PERMIT: 403, E.INSUFFICIENT_STAKE: 403, E.METAGRAPH_UNAVAILABLE: 503,
    E.RATE_LIMITED: 429, E.CALLER_STREAMS: 429, E.SHUTTING_DOWN: 503, E.INTERNAL_ERROR: 500,
    E.OVER_CAPACITY: 429, E.QUEUE_FULL: 429, E.ENGINE_UNAVAILABLE: 503,
    # 503, not 500: an engine failure is the serving side's trouble on this request (a crashed
    # forward pass, a broken remote stream), not a fault of the request; the caller should retry
    # later or elsewhere, and 503 with Retry-After says exactly that.
    E.ENGINE_FAILURE: 503, E.ENGINE_STALLED: 503, E.CANCELLED: 503,
    E.INVALID_API_KEY: 401, E.RATE_LIMIT_EXCEEDED: 429, E.MODEL_NOT_FOUND: 404, E.UNSUPPORTED_PARAMETER: 400,
    E.INVALID_VALUE: 400, E.CONTEXT_LENGTH_EXCEEDED: 400, E.NOT_FOUND: 404, E.METHOD_NOT_ALLOWED: 405,
    E.REQUEST_TOO_LARGE: 413, E.NO_MINER_AVAILABLE: 503, E.MINER_FAILED: 502, E.MINERS_FAILED: 502,
    E.TIMEOUT: 504, E.UNPARSEABLE_ERROR: 502,
}
# A refusal that passes by itself: a short wait for a full queue, a longer one for a sick engine.
RETRY_AFTER_S: dict[ErrorCode, float] = {
    E.QUEUE_FULL: 1.0, E.OVER_CAPACITY: 1.0, E.CALLER_STREAMS: 1.0,
    E.METAGRAPH_UNAVAILABLE: 5.0, E.SHUTTING_DOWN: 5.0, E.REPLAY_STORE_UNAVAILABLE: 5.0,
    E.ENGINE_UNAVAILABLE: 5.0, E.ENGINE_FAILURE: 5.0, E.ENGINE_STALLED: 5.0, E.CANCELLED: 5.0,
}
del E


def http_status(code: str, default: int = 500) -> int:
    """The HTTP status of `code` (an ErrorCode or its wire spelling); `default` for an unknown one."""
    known = ErrorCode.parse(code)
    return HTTP_STATUS[known] if known is not None else default
