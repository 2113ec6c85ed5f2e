"""The miner's settings: what it serves, where, who may call it and how much; the flag table.

Defaults live in the dataclasses; the flag table reads them from there."""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from inference.serving import EngineSpec
from neurons.settings import (ChainSettings, Option, WalletSettings, bind_defaults, build_settings, byte_size,
                              chain_options, engine_options, expanded_path, flag, logging_options, non_negative_float,
                              non_negative_int, optional_int, optional_text, port_number, positive_float, read_options,
                              wallet_options)
from protocol.http_server import GuardSettings
from protocol.schemas import DEFAULT_LIMITS

METRICS_HOST = "127.0.0.1"  # Prometheus metrics are for the operator, never for the world


class MinerSetupError(RuntimeError):
    """The miner cannot start as configured; the message says what to change."""


@dataclass(frozen=True)
class ServerSettings:
    host: str = "0.0.0.0"
    port: int = 8091
    external_ip: str | None = None
    external_port: int | None = None
    publish: bool = True
    publish_retry_s: float = 600.0
    metrics: bool = True
    metrics_port: int = 9091
    nonce_store: str = "~/.k3-subnet/miner-nonces.sqlite"
    max_body_bytes: int = DEFAULT_LIMITS.max_body_bytes
    max_output_tokens: int = DEFAULT_LIMITS.max_tokens
    shutdown_grace_s: float = 30.0
    first_event_timeout_s: float = 600.0
    stall_timeout_s: float = 120.0
    # connection guard (protocol/http_server.py)
    max_connections: int = 512
    max_connections_per_address: int = 64
    header_timeout_s: float = 5.0
    body_timeout_s: float = 10.0
    idle_timeout_s: float = 15.0

    def guard(self, **overrides) -> GuardSettings:
        values = dict(max_connections=self.max_connections,
                      max_connections_per_address=self.max_connections_per_address,
                      header_timeout_s=self.header_timeout_s, body_timeout_s=self.body_timeout_s,
                      idle_timeout_s=self.idle_timeout_s)
        values.update(overrides)
        return GuardSettings(**values)


@dataclass(frozen=True)
class AccessSettings:
    """Who may call, and how much. Budgets are shares of the miner by stake, with floors."""

    min_validator_stake: float = 1000.0
    window_s: float = 60.0
    requests_per_window: int = 1200  # all validators together; each gets its stake share
    min_requests: int = 30  # per window, whatever the stake: small validators can still measure
    min_streams: int = 1
    overcommit: float = 2.0  # a validator may open up to share * overcommit of the capacity
    max_streams: int = 0  # global cap; 0 = the engine's declared capacity


@dataclass(frozen=True)
class MinerSettings:
    chain: ChainSettings = field(default_factory=ChainSettings)
    wallet: WalletSettings = field(default_factory=WalletSettings)
    server: ServerSettings = field(default_factory=ServerSettings)
    access: AccessSettings = field(default_factory=AccessSettings)
    engine: EngineSpec = field(default_factory=EngineSpec)
    log_level: str = "INFO"
    log_format: str = "text"

    def problems(self) -> list[str]:
        """Everything wrong with these settings, each with what to do about it."""
        out = list(self.engine.problems())
        s, a, c = self.server, self.access, self.chain
        if self.engine.kind == "remote" and not self.engine.checkpoint:
            out.append("the remote engine needs --checkpoint: a directory with the served model's config.json, "
                       "k3_manifest.json (its fingerprint) and tokenizer files")
        if not 0 <= c.netuid <= 65535:
            out.append(f"--netuid {c.netuid} is not a netuid (0..65535)")
        if s.publish and not s.external_ip and s.host in ("0.0.0.0", "::", ""):
            out.append(f"--host {s.host or '(all)'} is not an address validators can reach: set --external-ip "
                       "(the public address to publish on chain), or --no-publish")
        if s.metrics and s.metrics_port and s.metrics_port == s.port:
            out.append(f"--metrics-port and --port are both {s.port}; give metrics its own port")
        if s.max_body_bytes < 1024:
            out.append("--max-body must be at least 1 KiB")
        if s.max_output_tokens < 1:
            out.append("--max-output-tokens must be at least 1")
        if a.min_validator_stake < 0:
            out.append("--min-validator-stake cannot be negative")
        if a.requests_per_window < 1 or a.min_requests < 1 or a.min_streams < 1:
            out.append("--budget-requests, --budget-min-requests and --budget-min-streams must be at least 1")
        if a.overcommit <= 0 or a.window_s <= 0:
            out.append("--budget-overcommit and --budget-window-s must be positive")
        return out


def server_options() -> tuple[Option, ...]:
    p, g = "K3_MINER_", "server"
    return (
        Option("server.host", "--host", f"{p}HOST", str, "address to bind the API to", group=g),
        Option("server.port", "--port", f"{p}PORT", port_number, "API port (0 picks a free one)", group=g,
               aliases=("--axon.port",)),
        Option("server.external_ip", "--external-ip", f"{p}EXTERNAL_IP", optional_text,
               "address published on chain, when validators reach you at another address than --host "
               "(NAT, proxy); default: --host", group=g, metavar="IP"),
        Option("server.external_port", "--external-port", f"{p}EXTERNAL_PORT", optional_int,
               "port published on chain; default: the bound port", group=g, metavar="PORT"),
        Option("server.publish", "--publish", f"{p}PUBLISH", flag, "publish the endpoint on chain at start (ServeAxon)",
               group=g),
        Option("server.publish_retry_s", "--publish-retry-s", f"{p}PUBLISH_RETRY_S", positive_float,
               "when the published endpoint differs from ours (rate limited, not yet registered), retry "
               "publishing at most this often", group=g),
        Option("server.metrics", "--metrics", f"{p}METRICS", flag, f"serve Prometheus /metrics on {METRICS_HOST}",
               group=g),
        Option("server.metrics_port", "--metrics-port", f"{p}METRICS_PORT", port_number,
               f"Prometheus port, bound to {METRICS_HOST} only (0 picks a free one)", group=g),
        Option("server.nonce_store", "--nonce-store", f"{p}NONCE_STORE", expanded_path,
               "SQLite file of seen request nonces (replay protection), shared by every worker of this miner; "
               "give each miner its own", group=g, metavar="FILE"),
        Option("server.max_body_bytes", "--max-body", f"{p}MAX_BODY", byte_size,
               "largest request body, e.g. 64MiB (larger: 413)", group=g, metavar="SIZE"),
        Option("server.max_output_tokens", "--max-output-tokens", f"{p}MAX_OUTPUT_TOKENS", int,
               "largest max_tokens a request may ask for", group=g),
        Option("server.shutdown_grace_s", "--shutdown-grace-s", f"{p}SHUTDOWN_GRACE_S", non_negative_float,
               "on SIGINT/SIGTERM, how long open streams may finish before they are ended", group=g),
        Option("server.first_event_timeout_s", "--first-event-timeout-s", f"{p}FIRST_EVENT_TIMEOUT_S", positive_float,
               "longest wait for a generation's first token (covers the prefill)", group=g),
        Option("server.stall_timeout_s", "--stall-timeout-s", f"{p}STALL_TIMEOUT_S", positive_float,
               "longest wait between two tokens before the stream is ended with an error event", group=g),
        Option("server.max_connections", "--max-connections", f"{p}MAX_CONNECTIONS", int,
               "open connections at most (also kept below the free file descriptors)", group=g),
        Option("server.max_connections_per_address", "--max-connections-per-address",
               f"{p}MAX_CONNECTIONS_PER_ADDRESS", int, "open connections at most per source address", group=g),
        Option("server.header_timeout_s", "--header-timeout-s", f"{p}HEADER_TIMEOUT_S", positive_float,
               "a connection's request headers must arrive within this, or it is closed", group=g),
        Option("server.body_timeout_s", "--body-timeout-s", f"{p}BODY_TIMEOUT_S", positive_float,
               "a request body must arrive within this (408)", group=g),
    )


def access_options() -> tuple[Option, ...]:
    p, g = "K3_MINER_", "validators and budgets"
    return (
        Option("access.min_validator_stake", "--min-validator-stake", f"{p}MIN_VALIDATOR_STAKE", non_negative_float,
               "least subnet stake (alpha) a caller with a validator permit needs", group=g),
        Option("access.window_s", "--budget-window-s", f"{p}BUDGET_WINDOW_S", positive_float,
               "length of the request-budget window", group=g),
        Option("access.requests_per_window", "--budget-requests", f"{p}BUDGET_REQUESTS", int,
               "requests per window for all validators together; each gets its share of validator stake", group=g),
        Option("access.min_requests", "--budget-min-requests", f"{p}BUDGET_MIN_REQUESTS", int,
               "requests per window every permitted validator gets, whatever its stake", group=g),
        Option("access.min_streams", "--budget-min-streams", f"{p}BUDGET_MIN_STREAMS", int,
               "concurrent streams every permitted validator gets, whatever its stake", group=g),
        Option("access.overcommit", "--budget-overcommit", f"{p}BUDGET_OVERCOMMIT", positive_float,
               "a validator may hold up to (stake share x this) of the capacity in streams at once", group=g),
        Option("access.max_streams", "--max-streams", f"{p}MAX_STREAMS", non_negative_int,
               "global cap on streams at once (0: the engine's capacity, --max-concurrent); beyond it: 429", group=g),
    )


def miner_options() -> tuple[Option, ...]:
    """Every flag of the miner, with its default from MinerSettings."""
    return bind_defaults(MinerSettings, wallet_options() + chain_options() + server_options() + access_options()
                         + engine_options() + logging_options())


def read_miner_settings(
    argv: Sequence[str] | None = None,
    environ: Mapping[str, str] | None = None,
    extra: Sequence[Option] = (),
    prog: str | None = None,
    description: str | None = None,
) -> tuple[MinerSettings, dict[str, Any]]:
    """Settings from flags and environment; `extra` options (a script's own) come back as a dict."""
    options = miner_options() + tuple(extra)
    values = read_options(options, argv, environ, prog=prog, description=description)
    extras = {top: values.pop(top) for top in {o.dest.split(".")[0] for o in extra}}
    return build_settings(MinerSettings, values), extras
