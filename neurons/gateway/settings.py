"""The gateway's settings and its flags (dest "gateway.*", part of the validator's table)."""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional

from neurons.gateway.schemas import MAX_USER_LOGPROBS
from neurons.settings import (Option, bind_defaults, byte_size, flag, non_negative_float, optional_text, port_number,
                              positive_float)
from protocol.client import ClientTimeouts


class GatewaySetupError(RuntimeError):
    """The gateway cannot start as configured; the message says what to change."""


@dataclass(frozen=True)
class GatewaySettings:
    enabled: bool = False
    host: str = "127.0.0.1"
    port: int = 8000
    api_keys_file: Optional[str] = None
    model_name: str = "kimi-k3"
    max_attempts: int = 3
    min_score: float = 0.0
    rate_limit_requests: int = 60
    rate_limit_window_s: float = 60.0
    default_max_tokens: int = 1024
    max_tokens_cap: int = 32768
    max_body_bytes: int = 16 * 1024 * 1024
    request_logprobs: int = 5  # asked of the miner on every request, so that tier 0 can check greedy tokens
    # Calls to miners; `total` is also the deadline of one user request, failovers included.
    miner_timeouts: ClientTimeouts = field(default_factory=ClientTimeouts)
    capabilities_ttl_s: float = 300.0
    miner_cooldown_s: float = 30.0

    def problems(self, need_key_file: bool = True) -> list[str]:
        out = []
        if need_key_file and self.enabled and not self.api_keys_file:
            out.append("the gateway needs --gateway-api-keys FILE (one API key per line)")
        for name in ("max_attempts", "rate_limit_requests", "default_max_tokens", "max_tokens_cap"):
            if getattr(self, name) < 1:
                out.append(f"gateway {name} must be at least 1, got {getattr(self, name)}")
        if not 0 <= self.request_logprobs <= MAX_USER_LOGPROBS:
            out.append(f"gateway request_logprobs must lie in 0..{MAX_USER_LOGPROBS}")
        for name in ("rate_limit_window_s", "capabilities_ttl_s"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value > 0):
                out.append(f"gateway {name} must be a positive number of seconds, got {value}")
        if self.max_body_bytes < 1024:
            out.append("--gateway-max-body must be at least 1 KiB")
        return out

    @property
    def request_timeout_s(self) -> float:
        return self.miner_timeouts.total


def gateway_options() -> tuple[Option, ...]:
    """The gateway's flags (dest "gateway.*"), for the validator's option table."""
    p, g = "K3_GATEWAY_", "organic gateway"
    return bind_defaults(GatewaySettings, (
        Option("gateway.enabled", "--gateway", f"{p}ENABLED", flag,
               "serve the OpenAI-compatible organic gateway (real users' requests to the best miners)", group=g),
        Option("gateway.host", "--gateway-host", f"{p}HOST", str, "address the gateway binds to", group=g),
        Option("gateway.port", "--gateway-port", f"{p}PORT", port_number, "gateway port (0 picks a free one)", group=g),
        Option("gateway.api_keys_file", "--gateway-api-keys", f"{p}API_KEYS", optional_text,
               "file of API keys, one per line, '#' starts a comment; re-read when it changes", group=g, metavar="FILE"),
        Option("gateway.model_name", "--gateway-model-name", f"{p}MODEL_NAME", str,
               "model name users ask for (and /v1/models lists)", group=g, metavar="NAME"),
        Option("gateway.max_attempts", "--gateway-max-attempts", f"{p}MAX_ATTEMPTS", int,
               "miners tried per request before giving up (failover before the first byte)", group=g),
        Option("gateway.min_score", "--gateway-min-score", f"{p}MIN_SCORE", non_negative_float,
               "miners at or below this score get no organic traffic", group=g, metavar="X"),
        Option("gateway.rate_limit_requests", "--gateway-rate-limit", f"{p}RATE_LIMIT", int,
               "requests per key per window (beyond: 429)", group=g),
        Option("gateway.rate_limit_window_s", "--gateway-rate-limit-window-s", f"{p}RATE_LIMIT_WINDOW_S",
               positive_float, "rate-limit window", group=g),
        Option("gateway.default_max_tokens", "--gateway-default-max-tokens", f"{p}DEFAULT_MAX_TOKENS", int,
               "max_tokens of a chat request that gives none (bounded by the miner's context)", group=g),
        Option("gateway.max_tokens_cap", "--gateway-max-tokens", f"{p}MAX_TOKENS", int,
               "largest max_tokens a user may ask for", group=g),
        Option("gateway.max_body_bytes", "--gateway-max-body", f"{p}MAX_BODY", byte_size,
               "largest request body (larger: 413)", group=g, metavar="SIZE"),
        Option("gateway.miner_timeouts.connect", "--gateway-connect-timeout-s", f"{p}CONNECT_TIMEOUT_S", positive_float,
               "deadline to connect to a miner", group=g),
        Option("gateway.miner_timeouts.first_byte", "--gateway-first-token-timeout-s", f"{p}FIRST_TOKEN_TIMEOUT_S",
               positive_float, "deadline for a miner's first token (covers the prefill)", group=g),
        Option("gateway.miner_timeouts.between_events", "--gateway-between-tokens-timeout-s",
               f"{p}BETWEEN_TOKENS_TIMEOUT_S", positive_float, "deadline between two tokens of a miner", group=g),
        Option("gateway.miner_timeouts.total", "--gateway-request-timeout-s", f"{p}REQUEST_TIMEOUT_S", positive_float,
               "deadline of one user request, failovers included", group=g),
        Option("gateway.miner_cooldown_s", "--gateway-miner-cooldown-s", f"{p}MINER_COOLDOWN_S", non_negative_float,
               "a miner that could not be reached is tried last for this long", group=g),
    ), prefix="gateway")
