"""The swarm's settings: the stage miner's (which layer block it serves, where, as whom, and whether it announces
itself) and the route miner's (one whole model over the subnet's stage miners, behind the miner protocol).

Each setting is stated once, on its dataclass field (neurons.base.settings.setting); the wallet and the logging
groups are the shared ones (btcli's --wallet-name/-w, --wallet-hotkey/-H, --wallet-path and BT_* variables,
the template's dotted aliases). The stage miner's chain group spells --network/-n and --netuid as the miner
does, but is optional: without --network the stage announces nothing. The route miner needs the chain (its
stages are found there) and is a miner server: its server and validator groups are the miner's own settings
classes, with defaults for a process that usually shares a host (127.0.0.1, a free port, metrics off)."""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from inference.decoding.distilled import draft_model_problems
from inference.decoding.drafters import DRAFTER_KINDS
from inference.decoding.speculation import MAX_DRAFT_TOKENS
from inference.model import device_problem
from inference.serving import EngineSpec
from inference.swarm.stage import SHARD_MODES, StageLimits
from neurons.base.settings import (CHAIN, LOG_FORMAT, LOG_LEVEL, WALLET, BadValue, ChainSettings, Option, Section,
                                   Setting, WalletSettings, build_settings, byte_size, device_spec, network_spec,
                                   non_negative_int, port_number, positive_float, read_options, setting,
                                   settings_options)
from neurons.miner_app.settings import AccessSettings, MinerSettings, ServerSettings
from protocol.stage import DEFAULT_MAX_BODY_BYTES, Hop

METRICS_HOST = "127.0.0.1"  # Prometheus metrics are for the operator, never for the world
ENV_PREFIX = "K3_STAGE_"
DTYPES = ("bfloat16", "float32")
_LIMITS = StageLimits()


def optional_network(text: str) -> str:
    """A chain (see neurons.base.settings.network_spec), or nothing: an empty value announces nowhere."""
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
    dtype: str = setting("auto", "weights dtype of the block (auto: bfloat16 on a GPU, float32 on the CPU)",
                         choices=("auto",) + DTYPES)
    device: str = setting("cpu", "where the block computes: cpu, cuda or cuda:N (with --shard-ranks N: cuda puts rank "
                          "r on GPU r); one line and exit 2 when CUDA is asked for and absent", read=device_spec,
                          metavar="DEVICE")
    wire_dtype: str = setting("float32", "dtype of the activations this stage sends on", choices=DTYPES)
    threads: int = setting(0, "torch threads (0: leave torch's default)", read=non_negative_int)
    shard_ranks: int = setting(1, "local processes the block is sharded over (the sharded runtime: gloo on the CPU, "
                               "NCCL on GPUs); 1: in this process", read=positive_int, metavar="N")
    shard_mode: str = setting("expert", "how --shard-ranks split the block: expert (layer homes rotate, every MoE "
                              "layer's experts spread over all ranks) or pipeline (each rank a contiguous sub-block)",
                              choices=SHARD_MODES)
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
    ledger_retain_s: float = setting(900.0, "how long the stage keeps each session's inputs and outputs as it signed "
                                     "them, for validators to check after the fact (POST /stage/ledger)",
                                     read=positive_float)
    ledger_bytes: int = setting(256 << 20, "most bytes the ledger keeps (the oldest sessions go first)", read=byte_size,
                                metavar="SIZE")
    ready_file: str = setting("", "once listening, write {url, hotkey, pid, layers, fingerprint, step_ms, "
                              "metrics_url} there as JSON", metavar="FILE")
    metrics: bool = setting(False, "serve Prometheus /metrics on --metrics-host:--metrics-port")
    metrics_port: int = setting(9094, "Prometheus port (0 picks a free one)", read=port_number, metavar="PORT")
    metrics_host: str = setting(METRICS_HOST, "address the metrics port binds; 0.0.0.0 (or a private address) lets a "
                                "Prometheus on another host or container scrape it: firewall it from the world")


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
        s, c, b = self.server, self.chain, self.block
        problem = device_problem(b.device)
        if problem:
            out.append(problem)
        elif b.shard_ranks > 1 and b.device.startswith("cuda:"):
            out.append(f"--device {b.device} with --shard-ranks {b.shard_ranks}: the ranks take GPUs 0..N-1; give "
                       "--device cuda")
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


# ---------------------------------------------------------------- the route miner
ROUTE_ENV_PREFIX = "K3_ROUTE_"


@dataclass(frozen=True)
class RouteSettings:
    """The model the route serves (config and tokenizer only: no weights are loaded) and how it drives the stages."""

    checkpoint: str = setting("", "the model's checkpoint directory (its config and tokenizer are read, no weights)",
                              required=True, metavar="DIR")
    hop_timeout_s: float = setting(5.0, "deadline of one hop; a step waits hop timeout x (stages + 1) before the "
                                   "route driver blames a stage and routes around it", read=positive_float)
    prefill_chunk: int = setting(128, "prompt tokens per prefill forward (chunks are sent back to back)",
                                 read=positive_int, metavar="N")
    max_context: int = setting(4096, "largest prompt plus output, in tokens", read=positive_int, metavar="N")
    max_concurrent: int = setting(8, "generations served at once (the miner's declared capacity)", read=positive_int,
                                  metavar="N")
    speculate: str = setting("none", "speculative decoding across the route with model-free drafts (ngram: prompt "
                             "lookup; suffix: a suffix index over prompt and output) or a draft table distilled from "
                             "the checkpoint (distilled: needs --draft-model), verified exactly by the last stage; "
                             "rejected drafts are rewound on every stage", choices=DRAFTER_KINDS)
    draft_model: str = setting("", "with --speculate distilled: the draft table scripts/distill_drafter.py made for "
                               "the checkpoint (refused at startup when it was made for another one)", metavar="FILE")
    draft_tokens: int = setting(8, "with --speculate: most tokens drafted per step (fewer when drafts are poor)",
                                read=positive_int, metavar="N")
    ready_file: str = setting("", "once serving, write {url, hotkey, pid, route, health} there as JSON",
                              metavar="FILE")
    trust_db: str = setting("", "a validator's store: leave the stages it blamed out of routes (read at each "
                            "refresh of the stage list)", metavar="FILE")
    route_log: str = setting("", "append each route planned there (JSON lines: at, route)", metavar="FILE")
    report_work: str = setting("", "submit the receipts of every step it drives to a validator's work endpoint "
                               "(its --stage-work-port), which credits the stages: HOTKEY@http(s)://HOST:PORT",
                               metavar="HOTKEY@URL")
    report_work_s: float = setting(5.0, "seconds between two submissions of receipts (--report-work)",
                                   read=positive_float)


# The chain is the miner's (--network/-n, --netuid, BT_NETWORK); one refresh period serves both the stage list and
# the validators' stakes, also spelled --refresh-s (the route miner's first flag for it).
ROUTE_CHAIN = Section(group="chain", env_prefix="K3_", fields=dict(metagraph_refresh_s=Setting(
    "seconds between reads of the subnet: the stage miners' announcements and the validators' stakes",
    read=positive_float, aliases=("--refresh-s",))))


@dataclass(frozen=True)
class RouteMinerSettings:
    wallet: WalletSettings = WALLET.field(WalletSettings)
    chain: ChainSettings = ROUTE_CHAIN.field(ChainSettings, metagraph_refresh_s=30.0)
    route: RouteSettings = Section(group="route").field(RouteSettings)
    server: ServerSettings = Section(group="server").field(
        ServerSettings, host="127.0.0.1", port=0, metrics=False, metrics_port=9093,
        nonce_store="~/.k3-subnet/route-miner-nonces.sqlite", shutdown_grace_s=2.0)
    access: AccessSettings = Section(group="validators and budgets").field(AccessSettings)
    log_level: str = LOG_LEVEL.field("WARNING")
    log_format: str = LOG_FORMAT.field("text")

    def miner_settings(self) -> MinerSettings:
        """The miner server's settings (its engine is the route; `engine` only names the checkpoint read)."""
        return MinerSettings(wallet=self.wallet, chain=self.chain, server=self.server, access=self.access,
                             engine=EngineSpec(checkpoint=self.route.checkpoint), log_level=self.log_level,
                             log_format=self.log_format)

    def problems(self) -> list[str]:
        """Everything wrong with these settings (the miner's checks: netuid, reachable address, ports, budgets, a
        checkpoint directory), each with what to do about it."""
        out = self.miner_settings().problems()
        if self.route.report_work:
            try:
                work_hop(self.route.report_work)
            except ValueError as error:
                out.append(str(error))
        if not 1 <= self.route.draft_tokens <= MAX_DRAFT_TOKENS:
            out.append(f"--draft-tokens must lie in 1..{MAX_DRAFT_TOKENS} (got {self.route.draft_tokens})")
        out += draft_model_problems(self.route.speculate, self.route.draft_model)
        return out


def work_hop(text: str):
    """--report-work HOTKEY@URL -> the validator's Hop; ValueError saying what is wrong."""
    hotkey, sep, url = text.partition("@")
    try:
        if not sep:
            raise ValueError
        return Hop(url=url.rstrip("/"), hotkey=hotkey)
    except ValueError:  # pydantic's ValidationError is one
        raise ValueError(f"--report-work {text!r} is not HOTKEY@http(s)://HOST:PORT (the validator's hotkey and "
                         "its work endpoint)") from None


def route_miner_options() -> tuple[Option, ...]:
    """Every flag of the route miner, derived from RouteMinerSettings' fields."""
    return settings_options(RouteMinerSettings, ROUTE_ENV_PREFIX)


def read_route_miner_settings(argv: Sequence[str] | None = None, environ: Mapping[str, str] | None = None,
                              prog: str | None = None, description: str | None = None) -> RouteMinerSettings:
    """Settings from flags, else environment, else defaults; a bad value exits with status 2 and a message."""
    values = read_options(route_miner_options(), argv, environ, prog=prog, description=description)
    return build_settings(RouteMinerSettings, values)
