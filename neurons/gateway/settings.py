"""The gateway's settings and its flags (dest "gateway.*", part of the validator's table)."""
from __future__ import annotations

import ipaddress
import math
import re
from dataclasses import dataclass
from typing import Optional
from urllib.parse import urlsplit

from neurons.base.settings import (Option, Section, Setting, byte_size, non_negative_float, port_number, positive_float,
                                   positive_rate, setting)
from neurons.gateway.schemas import MAX_USER_LOGPROBS
from protocol.client import ClientTimeouts


class GatewaySetupError(RuntimeError):
    """The gateway cannot start as configured; the message says what to change."""


def host_problem(host: str, flag_name: str) -> Optional[str]:
    """None when `host` is an IP address or a host name one can bind to; else the problem."""
    try:
        ipaddress.ip_address(host)
        return None
    except ValueError:
        pass
    if host and len(host) <= 253 and all(re.fullmatch(r"(?!-)[A-Za-z0-9-]{1,63}(?<!-)", part)
                                         for part in host.rstrip(".").split(".")):
        return None
    return f"{flag_name} {host!r} is not an IP address or a host name"


def public_url_problems(url: str, port: int, flag_name: str, port_flag: str) -> list[str]:
    """What is wrong with an advertised address http(s)://HOST:PORT of a server bound to `port` (none: [])."""
    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018 (raises ValueError for a port out of range)
    except ValueError as error:
        return [f"{flag_name} {url!r} is not a URL: {error}"]
    if parts.scheme not in ("http", "https") or not parts.hostname:
        return [f"{flag_name} {url!r} must be http(s)://HOST:PORT, e.g. http://203.0.113.7:9300"]
    if parts.path not in ("", "/") or parts.query or parts.fragment or parts.username:
        return [f"{flag_name} {url!r} must be just http(s)://HOST:PORT (no path, query or user)"]
    if parts.hostname in ("0.0.0.0", "::"):
        return [f"{flag_name} {url!r} names no reachable host (0.0.0.0 is a bind address)"]
    problem = host_problem(parts.hostname, f"{flag_name} host")
    if problem:
        return [problem]
    if port == 0:
        return [f"{flag_name} needs a fixed {port_flag} (0 picks a new port at every start, which the advertised "
                "address cannot follow)"]
    return []


@dataclass(frozen=True)
class GatewaySettings:
    enabled: bool = setting(False, "serve the OpenAI-compatible organic gateway (real users' requests to the best "
                            "miners)", flag="--gateway", env_key="GATEWAY_ENABLED")
    host: str = setting("127.0.0.1", "address the gateway binds to", flag="--gateway-host")
    port: int = setting(8000, "gateway port (0 picks a free one)", flag="--gateway-port", read=port_number)
    api_keys_file: Optional[str] = setting(None, "file of API keys, one per line, '#' starts a comment; re-read when "
                                           "it changes", flag="--gateway-api-keys", metavar="FILE")
    model_name: str = setting("kimi-k3", "model name users ask for (and /v1/models lists)",
                              flag="--gateway-model-name", metavar="NAME")
    max_attempts: int = setting(3, "miners tried per request before giving up (failover before the first byte)",
                                flag="--gateway-max-attempts")
    min_score: float = setting(0.0, "miners at or below this score get no organic traffic", flag="--gateway-min-score",
                               read=non_negative_float, metavar="X")
    rate_limit_requests: int = setting(60, "requests per key per window (beyond: 429)", flag="--gateway-rate-limit")
    rate_limit_window_s: float = setting(60.0, "rate-limit window", flag="--gateway-rate-limit-window-s",
                                         read=positive_float)
    default_max_tokens: int = setting(1024, "max_tokens of a chat request that gives none (bounded by the miner's "
                                      "context)", flag="--gateway-default-max-tokens")
    max_tokens_cap: int = setting(32768, "largest max_tokens a user may ask for", flag="--gateway-max-tokens")
    max_body_bytes: int = setting(16 * 1024 * 1024, "largest request body (larger: 413)", flag="--gateway-max-body",
                                  read=byte_size, metavar="SIZE")
    request_logprobs: int = 5  # asked of the miner on every request, so that tier 0 can check greedy tokens
    # Calls to miners; `total` is also the deadline of one user request, failovers included.
    miner_timeouts: ClientTimeouts = Section(fields=dict(
        connect=Setting("deadline to connect to a miner", flag="--gateway-connect-timeout-s", read=positive_float),
        first_byte=Setting("deadline for a miner's first token (covers the prefill)",
                           flag="--gateway-first-token-timeout-s", read=positive_float),
        between_events=Setting("deadline between two tokens of a miner", flag="--gateway-between-tokens-timeout-s",
                               read=positive_float),
        total=Setting("deadline of one user request, failovers included", flag="--gateway-request-timeout-s",
                      read=positive_float),
        prefill_tokens_per_s=Setting("a miner's first-token deadline grows by prompt tokens / this rate (inf: a "
                                     "flat --gateway-first-token-timeout-s)", flag="--gateway-prefill-tokens-per-s",
                                     read=positive_rate, metavar="RATE"),
    )).field(ClientTimeouts)
    route: str = setting("off", "also serve organic requests through a route of the subnet's swarm stage miners, "
                         "driven by this validator (stages it blamed are left out), tried before (first) or after "
                         "(last) the ranked whole-model miners; the route's work is credited to the stages and a "
                         "share of its sessions checked after the fact (needs --reference-engine and "
                         "--stage-sessions > 0)", flag="--gateway-route",
                         choices=("off", "first", "last"))
    route_audit_rate: float = setting(0.1, "share of the route's organic sessions checked after the fact, every stage "
                                      "re-run on the validator's reference over its recorded inputs",
                                      flag="--gateway-route-audit-rate", read=non_negative_float, metavar="X")
    route_refresh_s: float = setting(30.0, "how often the route re-reads the subnet's stage miners and this "
                                     "validator's blames (a stage blamed elsewhere leaves the route within this)",
                                     flag="--gateway-route-refresh-s", read=positive_float)
    route_log: Optional[str] = setting(None, "append one JSON line {at, route: [stage hotkeys]} per route the "
                                       "gateway's route plans", flag="--gateway-route-log", metavar="FILE")
    capabilities_ttl_s: float = 300.0
    miner_cooldown_s: float = setting(30.0, "a miner that could not be reached, or sent nothing within a deadline, is "
                                      "tried last for this long",
                                      flag="--gateway-miner-cooldown-s", read=non_negative_float)

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
        if self.route not in ("off", "first", "last"):
            out.append(f"--gateway-route {self.route!r} is not off, first or last")
        if not 0.0 <= self.route_audit_rate <= 1.0:
            out.append(f"--gateway-route-audit-rate must lie in [0, 1], got {self.route_audit_rate}")
        if self.max_body_bytes < 1024:
            out.append("--gateway-max-body must be at least 1 KiB")
        return out

    @property
    def request_timeout_s(self) -> float:
        return self.miner_timeouts.total


# How GatewaySettings sits in the validator's settings: one group, variables K3_ + the flag's words.
GATEWAY = Section(group="organic gateway", env_prefix="K3_")


def gateway_options() -> tuple[Option, ...]:
    """The gateway's flags (dest "gateway.*"), for the validator's option table."""
    return GATEWAY.options(GatewaySettings, "gateway")
