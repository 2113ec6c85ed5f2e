"""The miner's settings: what it serves, where, who may call it and how much.

Each setting is stated once, on its dataclass field (default, help, flag); the flag table is derived
from the fields (neurons.base.settings.settings_options)."""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from inference.serving import EngineSpec
from neurons.base.settings import (CHAIN, LOG_FORMAT, LOG_LEVEL, WALLET, ChainSettings, Option, Section, WalletSettings,
                                   build_settings, byte_size, engine_section, expanded_path, name_list,
                                   non_negative_float, non_negative_int, port_number, positive_float, read_options,
                                   setting, settings_options)
from protocol.http_server import GuardSettings
from protocol.schemas import DEFAULT_LIMITS

METRICS_HOST = "127.0.0.1"  # Prometheus metrics are for the operator, never for the world
ENV_PREFIX = "K3_MINER_"


class MinerSetupError(RuntimeError):
    """The miner cannot start as configured; the message says what to change."""


@dataclass(frozen=True)
class ServerSettings:
    host: str = setting("0.0.0.0", "address to bind the API to")
    port: int = setting(8091, "API port (0 picks a free one)", read=port_number, aliases=("--axon.port",))
    external_ip: str | None = setting(None, "address published on chain, when validators reach you at another "
                                      "address than --host (NAT, proxy); default: --host", metavar="IP")
    external_port: int | None = setting(None, "port published on chain; default: the bound port", metavar="PORT")
    publish: bool = setting(True, "publish the endpoint on chain at start (ServeAxon)")
    publish_retry_s: float = setting(600.0, "when the published endpoint differs from ours (rate limited, not yet "
                                     "registered), retry publishing at most this often", read=positive_float)
    metrics: bool = setting(True, "serve Prometheus /metrics on --metrics-host:--metrics-port")
    metrics_port: int = setting(9091, "Prometheus port (0 picks a free one)", read=port_number)
    metrics_host: str = setting(METRICS_HOST, "address the metrics port binds; 0.0.0.0 (or a private address) lets a "
                                "Prometheus on another host or container scrape it: firewall it from the world")
    nonce_store: str = setting("~/.k3-subnet/miner-nonces.sqlite", "SQLite file of seen request nonces (replay "
                               "protection), shared by every worker of this miner; give each miner its own",
                               read=expanded_path, metavar="FILE")
    max_body_bytes: int = setting(DEFAULT_LIMITS.max_body_bytes, "largest request body, e.g. 64MiB (larger: 413)",
                                  flag="--max-body", read=byte_size, metavar="SIZE")
    max_output_tokens: int = setting(DEFAULT_LIMITS.max_tokens, "largest max_tokens a request may ask for")
    shutdown_grace_s: float = setting(30.0, "on SIGINT/SIGTERM, how long open streams may finish before they are "
                                      "ended", read=non_negative_float)
    first_event_timeout_s: float = setting(600.0, "longest wait for a generation's first token (covers the prefill)",
                                           read=positive_float)
    stall_timeout_s: float = setting(120.0, "longest wait between two tokens before the stream is ended with an "
                                     "error event", read=positive_float)
    # connection guard (protocol/http_server.py)
    max_connections: int = setting(512, "open connections at most (also kept below the free file descriptors)")
    max_connections_per_address: int = setting(64, "open connections at most per source address")
    header_timeout_s: float = setting(5.0, "a connection's request headers must arrive within this, or it is closed",
                                      read=positive_float)
    body_timeout_s: float = setting(10.0, "a request body must arrive within this (408)", read=positive_float)
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

    min_validator_stake: float = setting(1000.0, "least subnet stake (alpha) a caller with a validator permit needs",
                                         read=non_negative_float)
    window_s: float = setting(60.0, "length of the request-budget window", flag="--budget-window-s",
                              read=positive_float)
    requests_per_window: int = setting(1200, "requests per window for all validators together; each gets its share "
                                       "of validator stake", flag="--budget-requests")
    min_requests: int = setting(30, "requests per window every permitted validator gets, whatever its stake",
                                flag="--budget-min-requests")
    min_streams: int = setting(1, "concurrent streams every permitted validator gets, whatever its stake",
                               flag="--budget-min-streams")
    overcommit: float = setting(2.0, "a validator may hold up to (stake share x this) of the capacity in streams at "
                                "once", flag="--budget-overcommit", read=positive_float)
    max_streams: int = setting(0, "global cap on streams at once (0: the engine's capacity, --max-concurrent); "
                               "beyond it: 429", read=non_negative_int)
    # the operator's own hotkeys, for benchmarking and self-checking without a validator permit
    owner_hotkeys: tuple[str, ...] = setting((), "hotkeys of this miner's owner that may call it without a validator "
                                             "permit or stake (k3-bench --miner, k3-validator self-check): SS58 "
                                             "addresses, or hotkey names of this miner's own wallet; limited by "
                                             "--owner-requests and --owner-streams, every request logged",
                                             read=name_list, metavar="HOTKEY,...")
    owner_requests: int = setting(600, "requests per budget window each owner hotkey may send")
    owner_streams: int = setting(0, "streams each owner hotkey may hold at once (0: the miner's capacity)",
                                 read=non_negative_int)


@dataclass(frozen=True)
class MinerSettings:
    wallet: WalletSettings = WALLET.field(WalletSettings)
    chain: ChainSettings = CHAIN.field(ChainSettings)
    server: ServerSettings = Section(group="server").field(ServerSettings)
    access: AccessSettings = Section(group="validators and budgets").field(AccessSettings)
    engine: EngineSpec = engine_section().field(EngineSpec)
    log_level: str = LOG_LEVEL.field("INFO")
    log_format: str = LOG_FORMAT.field("text")

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
        if a.owner_requests < 1:
            out.append("--owner-requests must be at least 1")
        if a.requests_per_window < 1 or a.min_requests < 1 or a.min_streams < 1:
            out.append("--budget-requests, --budget-min-requests and --budget-min-streams must be at least 1")
        if a.overcommit <= 0 or a.window_s <= 0:
            out.append("--budget-overcommit and --budget-window-s must be positive")
        return out


def miner_options() -> tuple[Option, ...]:
    """Every flag of the miner, derived from MinerSettings' fields."""
    return settings_options(MinerSettings, ENV_PREFIX)


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
