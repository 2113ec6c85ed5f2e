"""The swarm stage miner's settings: which layer block it serves, where, as whom, and whether it announces itself.

Each setting is stated once, on its dataclass field (neurons.settings.setting); the wallet and the logging
groups are the shared ones (btcli's --wallet-name/-w, --wallet-hotkey/-H, --wallet-path and BT_* variables,
the template's dotted aliases), the chain group spells --network/-n and --netuid as the miner does, but is
optional here: without --network the stage announces nothing."""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from inference.swarm.stage import StageLimits
from neurons.settings import (CHAIN, LOG_FORMAT, LOG_LEVEL, WALLET, BadValue, Option, Section, WalletSettings,
                              build_settings, byte_size, network_spec, non_negative_float, non_negative_int,
                              port_number, positive_float, read_options, setting, settings_options)
from protocol.stage import DEFAULT_MAX_BODY_BYTES

METRICS_HOST = "127.0.0.1"  # Prometheus metrics are for the operator, never for the world
ENV_PREFIX = "K3_STAGE_"
DTYPES = ("bfloat16", "float32")
_LIMITS = StageLimits()


def optional_network(text: str) -> str:
    """A chain (see neurons.settings.network_spec), or nothing: an empty value announces nowhere."""
    return "" if text.strip() == "" else network_spec(text)


optional_network.__name__ = "network"


def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise BadValue(f"{text!r} must be an integer >= 1")
    return value


positive_int.__name__ = "integer >= 1"


@dataclass(frozen=True)
class BlockSettings:
    """The layer block and how it is computed."""

    checkpoint: str = setting("", "checkpoint directory (only the block's tensors are read)", required=True,
                              metavar="DIR")
    serve_layers: str = setting("", "inclusive layer range A-B (0 includes the embedding, the last layer the head)",
                                required=True, metavar="A-B")
    dtype: str = setting("float32", "weights dtype of the block", choices=DTYPES)
    wire_dtype: str = setting("float32", "dtype of the activations this stage sends on", choices=DTYPES)
    threads: int = setting(0, "torch threads (0: leave torch's default)", read=non_negative_int)
    shard_ranks: int = setting(1, "local processes the block is sharded over (the sharded runtime, expert "
                               "parallel, gloo on CPU); 1: in this process", read=positive_int, metavar="N")
    max_sessions: int = setting(_LIMITS.max_sessions, "sessions held at once (when full, an idle one may be evicted)",
                                read=positive_int, metavar="N")
    max_context: int = setting(_LIMITS.max_context, "largest session, in tokens", read=positive_int, metavar="N")
    max_tokens_per_forward: int = setting(_LIMITS.max_tokens_per_forward, "most tokens in one forward (larger: 413)",
                                          read=positive_int, metavar="N")
    idle_expiry_s: float = setting(_LIMITS.idle_expiry_s, "a session unused this long is closed",
                                   read=positive_float)
    max_snapshots: int = setting(_LIMITS.max_snapshots, "KDA state snapshots kept per session (rewind)",
                                 read=non_negative_int)
    rewind_window: int = setting(_LIMITS.rewind_window, "positions of recorded inputs kept per session",
                                 read=non_negative_int)

    def limits(self) -> StageLimits:
        return StageLimits(max_sessions=self.max_sessions, max_context=self.max_context,
                           max_tokens_per_forward=self.max_tokens_per_forward, idle_expiry_s=self.idle_expiry_s,
                           max_snapshots=self.max_snapshots, rewind_window=self.rewind_window)


@dataclass(frozen=True)
class StageListenSettings:
    """Where the stage wire listens, what it accepts, and the operator's metrics port."""

    host: str = setting("127.0.0.1", "address to bind the stage wire to")
    port: int = setting(0, "stage wire port (0 picks a free one)", read=port_number, metavar="PORT",
                        aliases=("--axon.port",))
    public_url: str = setting("", "URL others reach this stage at (default http://host:port)", metavar="URL")
    external_ip: str = setting("", "IP published on chain (default: --host)", metavar="IP")
    external_port: int = setting(0, "port published on chain (default: the listening one)", read=port_number,
                                 metavar="PORT")
    max_body_bytes: int = setting(DEFAULT_MAX_BODY_BYTES, "largest request body, in bytes or e.g. 64MiB (larger: 413)",
                                  read=byte_size, metavar="SIZE")
    hop_timeout_s: float = setting(5.0, "deadline for sending on to the next hop (connect and its 202)",
                                   read=positive_float)
    ready_file: str = setting("", "once listening, write {url, hotkey, pid, layers, fingerprint, step_ms, "
                              "metrics_url} there as JSON", metavar="FILE")
    metrics: bool = setting(False, f"serve Prometheus /metrics on {METRICS_HOST}")
    metrics_port: int = setting(9092, f"Prometheus port, bound to {METRICS_HOST} only (0 picks a free one)",
                                read=port_number, metavar="PORT")


@dataclass(frozen=True)
class AnnounceSettings:
    """The chain to announce on: btcli's --network/-n (BT_NETWORK) with the template's aliases, and --netuid."""

    network: str = setting("", "chain to announce on: finney, test, local, a ws:// / wss:// URL, or devnet:PATH; "
                           "empty: announce nothing", env="BT_NETWORK", read=optional_network, metavar="NETWORK",
                           aliases=("-n", "--subtensor.network", "--subtensor.chain_endpoint"))
    netuid: int | None = setting(None, "the subnet's netuid (needed with --network)", metavar="N")


@dataclass(frozen=True)
class StageMinerSettings:
    block: BlockSettings = Section(group="stage").field(BlockSettings)
    server: StageListenSettings = Section(group="server").field(StageListenSettings)
    wallet: WalletSettings = WALLET.field(WalletSettings)
    chain: AnnounceSettings = CHAIN.field(AnnounceSettings)
    log_level: str = LOG_LEVEL.field("WARNING")
    log_format: str = LOG_FORMAT.field("text")

    def problems(self) -> list[str]:
        """Everything wrong with these settings, each with what to do about it."""
        out = []
        s, c = self.server, self.chain
        if c.network and c.netuid is None:
            out.append("--network needs --netuid (the subnet to announce on)")
        if c.netuid is not None and not 0 <= c.netuid <= 65535:
            out.append(f"--netuid {c.netuid} is not a netuid (0..65535)")
        if s.metrics and s.metrics_port and s.metrics_port == s.port:
            out.append(f"--metrics-port and --port are both {s.port}; give metrics its own port")
        return out


def stage_miner_options() -> tuple[Option, ...]:
    """Every flag of the stage miner, derived from StageMinerSettings' fields."""
    return settings_options(StageMinerSettings, ENV_PREFIX)


def read_stage_miner_settings(argv: Sequence[str] | None = None, environ: Mapping[str, str] | None = None,
                              prog: str | None = None, description: str | None = None) -> StageMinerSettings:
    """Settings from flags, else environment, else defaults; a bad value exits with status 2 and a message."""
    values = read_options(stage_miner_options(), argv, environ, prog=prog, description=description)
    return build_settings(StageMinerSettings, values)
