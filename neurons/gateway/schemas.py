"""The OpenAI request bodies the gateway accepts, and OpenAI's error format."""
from __future__ import annotations

import math
from typing import Any, Literal, Optional, Union

from aiohttp import web
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator
from pydantic_core import PydanticCustomError

from protocol.errors import ErrorCode, http_status
from protocol.schemas import (MAX_TOKEN_ID, TEMPERATURE_MAX, TEMPERATURE_MIN, TOP_P_MIN, U64_MAX, ProtocolError,
                              check_unique_keys, describe_validation_error)

MAX_STOP_STRINGS = 4  # OpenAI's bound; the wire allows more
MAX_STOP_CHARS = 64
MAX_USER_LOGPROBS = 20


# ---------------------------------------------------------------- OpenAI errors
class ApiError(Exception):
    """An answer in OpenAI's error format: {"error": {"message", "type", "param", "code"}}.

    The status comes from the code (protocol.errors); `status` is given only for aiohttp's
    own answers, whose status may have no code of its own."""

    def __init__(self, code: Optional[ErrorCode | str], message: str, param: Optional[str] = None,
                 kind: Optional[str] = None, retry_after_s: Optional[float] = None, status: Optional[int] = None):
        super().__init__(message)
        self.status = status if status is not None else http_status(code)
        self.message = message
        self.code = None if code is None else str(code)
        self.param = param
        self.kind = kind or _ERROR_KIND.get(self.status, "server_error" if self.status >= 500 else "invalid_request_error")
        self.retry_after_s = retry_after_s

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}

    def response(self) -> web.Response:
        headers = {}
        if self.retry_after_s is not None:
            headers["Retry-After"] = str(max(1, math.ceil(self.retry_after_s)))
        return web.json_response(self.body(), status=self.status, headers=headers)


_ERROR_KIND = {400: "invalid_request_error", 401: "invalid_request_error", 404: "invalid_request_error",
               413: "invalid_request_error", 429: "rate_limit_error"}


# ---------------------------------------------------------------- OpenAI request bodies
class RequestBody(BaseModel):
    # strict: no "0.5" for 0.5 or true for 1; extra="forbid": an unsupported option is an error, not ignored.
    model_config = ConfigDict(extra="forbid", strict=True)

    model: str = Field(min_length=1, max_length=256)
    max_tokens: Optional[int] = Field(None, ge=1)
    # the miner's bounds (protocol/schemas.py): what a miner would refuse is refused here first
    temperature: float = Field(1.0, ge=0.0, le=TEMPERATURE_MAX, allow_inf_nan=False)
    top_p: float = Field(1.0, ge=TOP_P_MIN, le=1.0, allow_inf_nan=False)
    top_k: int = Field(0, ge=0, le=MAX_TOKEN_ID)  # an extension (vLLM, SGLang): 0 = off
    n: int = Field(1, ge=1, le=1)

    @field_validator("temperature")
    @classmethod
    def _temperature(cls, value: float) -> float:
        if 0.0 < value < TEMPERATURE_MIN:
            raise PydanticCustomError("temperature_range",
                                      "temperature must be 0 (greedy) or at least {low}", {"low": TEMPERATURE_MIN})
        return value
    seed: Optional[int] = Field(None, ge=0, le=U64_MAX)
    stop: Optional[Union[str, list[str]]] = None
    stream: bool = False
    stream_options: Optional[dict[str, Any]] = None
    presence_penalty: Optional[float] = None  # accepted only as "off" (0)
    frequency_penalty: Optional[float] = None
    user: Optional[str] = Field(None, max_length=256)
    # vLLM's extensions, which its clients and `vllm bench serve` send:
    # logprob tokens as "token_id:N" instead of text (exact ids, whatever the bytes)
    return_tokens_as_token_ids: bool = False
    # keep special tokens (e.g. <|im_end|>) in the text
    skip_special_tokens: bool = True
    repetition_penalty: Optional[float] = None  # accepted only as "off" (1)
    ignore_eos: bool = False  # accepted only as false: the subnet's miners always stop at the end of sequence

    @model_validator(mode="after")
    def _checks(self):
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(self, name):
                raise ValueError(f"{name} is not supported (only 0)")
        if self.repetition_penalty not in (None, 1.0):
            raise ValueError("repetition_penalty is not supported (only 1)")
        if self.ignore_eos:
            raise ValueError("ignore_eos is not supported: the subnet's miners always stop at the end of sequence")
        for i, text in enumerate(self.stop_strings):
            if not 1 <= len(text) <= MAX_STOP_CHARS:
                raise ValueError(f"stop[{i}] must have 1 to {MAX_STOP_CHARS} characters")
        if len(self.stop_strings) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings are allowed")
        unknown = set(self.stream_options or {}) - {"include_usage"}
        if unknown:
            raise ValueError(f"stream_options supports only include_usage, not {sorted(unknown)}")
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed with stream: true")
        return self

    @property
    def stop_strings(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    @property
    def include_usage(self) -> bool:
        return bool((self.stream_options or {}).get("include_usage"))


class _TextPart(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    role: Literal["system", "developer", "user", "assistant"]
    content: Union[str, list[_TextPart]]
    name: Optional[str] = Field(None, max_length=64)

    def as_template_message(self) -> dict:
        text = self.content if isinstance(self.content, str) else "".join(part.text for part in self.content)
        # "developer" is OpenAI's newer name for system instructions.
        return {"role": "system" if self.role == "developer" else self.role, "content": text}


class ChatCompletionBody(RequestBody):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: Optional[int] = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: Optional[int] = Field(None, ge=0, le=MAX_USER_LOGPROBS)

    @model_validator(mode="after")
    def _chat_checks(self):
        if self.max_tokens is not None and self.max_completion_tokens is not None:
            raise ValueError("give max_tokens or max_completion_tokens, not both")
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs: true")
        return self

    @property
    def requested_max_tokens(self) -> Optional[int]:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    @property
    def user_logprobs(self) -> Optional[int]:
        return (self.top_logprobs or 0) if self.logprobs else None


class CompletionBody(RequestBody):
    prompt: Union[str, list[int], list[str], list[list[int]]]
    logprobs: Optional[int] = Field(None, ge=0, le=MAX_USER_LOGPROBS)
    echo: bool = False
    best_of: Optional[int] = Field(None, ge=1, le=1)
    suffix: Optional[str] = None

    @model_validator(mode="after")
    def _completion_checks(self):
        if self.echo:
            raise ValueError("echo is not supported")
        if self.suffix:
            raise ValueError("suffix is not supported")
        return self

    @property
    def requested_max_tokens(self) -> int:
        return 16 if self.max_tokens is None else self.max_tokens  # OpenAI's default for completions

    @property
    def user_logprobs(self) -> Optional[int]:
        return self.logprobs


def parse_body(model: type[RequestBody], raw: bytes) -> Any:
    try:
        check_unique_keys(raw)
    except ProtocolError as error:
        raise ApiError(ErrorCode.INVALID_JSON, error.message) from None
    try:
        return model.model_validate_json(raw)
    except ValidationError as error:
        message, kinds = describe_validation_error(error)
        if "json_invalid" in kinds or "json_type" in kinds:
            raise ApiError(ErrorCode.INVALID_JSON, "the body is not a JSON object") from None
        first = error.errors(include_url=False, include_input=False)[0]
        param = ".".join(str(p) for p in first["loc"]) or None
        if first["type"] == "extra_forbidden":
            raise ApiError(ErrorCode.UNSUPPORTED_PARAMETER, f"unsupported parameter: {param}",
                           param=param) from None
        raise ApiError(ErrorCode.INVALID_VALUE, message, param=param) from None
