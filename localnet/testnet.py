"""The whole subnet on one machine: a chain, miners (one sharded, one cheating), a validator, a dashboard.

    scripts/localnet.sh                          # devnet, 3 miners, 1 validator, until Ctrl-C
    k3-localnet --run-dir /tmp/k3-run            # the same from an installed package (pip install k3-subnet)
    scripts/localnet.sh --duration 300 --miners 4 --cheat buffer
    scripts/localnet.sh --swarm 3 --cheat-stage other-weights --cheat-stage replay --duration 300 --stop-when-caught
    scripts/localnet.sh --network local --netuid 2 --wallet-path ~/.bittensor/wallets \\
        --validator-wallet val --miner-wallets m1,m2,m3     # a real subtensor node (wallets registered with btcli)

With the embedded devnet (the default) it creates, in a fresh run directory: the tiny checkpoint (once, in
--checkpoints, default ./checkpoints: with --model trained, the default in a checkout, a copy of the tiny K3
trained on real text, inference/model/assets/tiny_trained, as checkpoints/tiny-trained; with --model random, the
random seed-0 one, checkpoints/tiny; the "weights" cheat serves random weights of the same configuration, seed 1,
from checkpoints/<name>-seed1), a devnet with one subnet, wallets without passwords, registrations and stake;
then it starts the miners (miner 0 single-process, miner 1 sharded over 2 processes, the last one cheating) and the
validator as separate processes, and shows a live dashboard. Logs of every process are in RUN_DIR/logs.
Ctrl-C or the end of --duration stops everything it started (whole process groups, shards included).
`--summary FILE` writes what happened (weights, incentive, failures) as JSON at the end.
`--bf16-miners N` serves N honest miners (after the sharded ones) in bf16. A sampling cheat (`--cheat
greedy-for-sampled`, `seed-ignoring-replay`, `cooler-sampling`, `fixed-seed`, `coarse-experts-for-sampled`:
localnet/cheats/miner.py) runs the real model but not the sampler asked; with `--stop-when-caught` the run ends
once the validator zeroed the cheater and set weights with it at 0 and every honest miner above 0, and the
summary says after how many of the cheater's audits.

`--swarm N` (devnet) runs the tiny model as a swarm instead (`run_swarm`): N stage miners holding its layers in
blocks cut at Attention Residuals block boundaries, one spare for the middle block, a route miner (a route driver
behind the signed miner protocol, finding the stages from the chain), and a validator; it serves one greedy
completion through the route, checks it against the single-process model, shows the stages and the route, and
then runs until --duration ends or Ctrl-C. Each stage miner announces its layer block on chain itself.

`--swarm N --cheat-stage KIND` (repeatable: `--cheat-stage echo --cheat-stage replay`) makes the stage miner of a
block a cheater (KIND as in localnet/cheats/stage.py; pair-cover is two adjacent cheaters; the validator serves a
decoy of a forwarder's block, which the forwarder finds among the stages of its block), gives every cheated block
an honest spare, and runs one honest stage in bf16; `--cheat-stage forge-receipts` or `self-driver` makes the
route miner a cheating route driver (localnet/cheats/route.py). The validator drives sessions of its own through
the stages (--stage-sessions per round) and checks them after they ran against its own copy of the weights, and
credits the stages the route work the route miner submits to its work endpoint (--stage-work-port) for requests
the validator sent it; organic requests go through the validator's organic gateway all along (with an API key,
as a user's), which serves them through the same route driver (--gateway-route first, re-reading the stages and
its blames every 2 s, each route it plans logged to RUN_DIR/gateway-routes.jsonl), credits the stages that work
and checks a share of it; the dashboard shows each stage's layers, tokens, route work, weight and, for a blamed one, weight 0
with the reason, and the route driver's credited work and blame. `--stop-when-caught` ends the run once every
cheater is blamed and zeroed on chain, every honest stage is checked and paid, and the gateway's organic traffic
goes through the spares.

`--soak SECONDS` (devnet; with or without --swarm) runs the subnet under organic traffic through the validator's
gateway while faults drawn from --soak-seed hit it, restarting what was killed, and then prints the checker's table
(localnet/soak.py, localnet/soak_check.py; `k3-localnet check RUN_DIR` prints it again). With --swarm, every block
gets a spare, each stage miner is announced behind a link the soak can slow or cut, and --miners whole-model miners
run beside the stages.

`--setup-only` (devnet) makes the checkpoint, the devnet, the wallets, registrations and stake in --run-dir,
writes RUN_DIR/localnet.json (chain, netuid, each neuron's wallet and hotkey) and exits: compose.yaml's
setup service, after which the miners and the validator run as containers of their own. Run again on a
set-up directory, it changes nothing.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import bittensor as bt
from rich.console import Console, Group
from rich.live import Live
from rich.progress import BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn
from rich.table import Table

from chain import connect
from chain.cli import DeprecatedFlag
from chain.devnet import DevnetChain
from inference.model.checkpoint import make_random_checkpoint
from inference.model.config import ModelConfig
from localnet import soak_check
from localnet.soak import (FaultInjector, Party, Soak, SoakTraffic, StageLinks, Supervisor, Targets, draw_schedule,
                           fault_env, http_ok, wait_warm, write_meta)

# how the last miner cheats (localnet.cheats.miner.CHEATS but "weights", which serves another checkpoint; named here
# so --help needs no torch)
SAMPLING_CHEATS = ("greedy-for-sampled", "seed-ignoring-replay", "cooler-sampling", "fixed-seed",
                   "coarse-experts-for-sampled")
CHEATS = ("inflate", "buffer", "truncate", "weights", "none") + SAMPLING_CHEATS
# how a swarm stage miner can cheat (localnet.cheats.stage.CHEATS; named here so --help needs no torch)
STAGE_CHEATS = ("other-weights", "skip-layer", "echo", "session-liar", "long-position-liar", "replay", "forwarder",
                "watch-aware", "driver-aware", "sparse-liar", "fewer-experts", "quantized", "stale-state", "late-switch",
                "misdeclared", "refuse-ledger", "ledger-liar", "pair-cover")
# how the route driver (the route miner) can cheat (localnet.cheats.route): claim receipts the stages never signed,
# or drive sessions nobody asked for and claim their genuine receipts
DRIVER_CHEATS = ("forge-receipts", "self-driver")
# The directory holding the packages: a checkout (with pyproject.toml) or site-packages.
PACKAGE_ROOT = Path(__file__).resolve().parents[1]
# The tiny K3 trained on real text (scripts/train_tiny.py), shipped with a checkout and in the wheel
# (pyproject.toml package-data).
TRAINED_ASSET = PACKAGE_ROOT / "inference" / "model" / "assets" / "tiny_trained"
MODELS = ("trained", "random")
VALIDATOR_STAKE = 10_000.0
MINER_MIN_VALIDATOR_STAKE = 1_000.0


@dataclass
class Neuron:
    name: str
    role: str  # "miner" | "validator"
    wallet: bt.Wallet
    port: int = 0
    kind: str = ""  # what the dashboard shows: reference, sharded x2, cheat: ...
    layers: str = ""  # a swarm stage: its block A-B
    cheat: str = ""  # a swarm stage: how it cheats (a key of localnet.cheats.stage.CHEATS), "" when honest
    dtype: str = "float32"  # a swarm stage: weights and wire dtype
    decoy_port: int = 0  # a forwarder: where the validator serves the decoy of its block
    gateway_port: int = 0  # the swarm's validator: its organic gateway (OpenAI-compatible, through its own route)
    process: subprocess.Popen | None = None
    log: Path | None = None
    cmd: list[str] = field(default_factory=list)  # how it was started (a soak restarts it so)
    env: dict[str, str] = field(default_factory=dict)  # what it was started with beyond this process's environment


def parse_args(argv=None, prog: str = "k3-localnet") -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog=prog, description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--miners", type=int, default=3, help="number of miners (>= 2; the last one cheats)")
    ap.add_argument("--sharded-miners", type=int, default=1,
                    help="how many miners (after the first) run sharded over 2 processes")
    ap.add_argument("--bf16-miners", type=int, default=0,
                    help="how many honest miners (after the sharded ones) serve the model in bf16")
    ap.add_argument("--cheat", choices=CHEATS, default="inflate",
                    help="how the last miner cheats: inflate usage counts, buffer its stream, truncate prompts to "
                         "their last 512 tokens, serve different weights, a sampling cheat (" +
                         ", ".join(SAMPLING_CHEATS) + "), or none (all honest)")
    ap.add_argument("--duration", type=float, default=0.0, help="seconds to run (0 = until Ctrl-C)")
    ap.add_argument("--base-port", type=int, default=18091, help="miners listen on base, base+1, ... (the swarm: "
                    "its stage miners, route miner and validator)")
    ap.add_argument("--metrics-base-port", type=int, default=None,
                    help="the miners' metrics ports, then the validator's (default: --base-port + 1000)")
    ap.add_argument("--run-dir", type=Path, default=None, help="default: ./runs/localnet-<time>")
    ap.add_argument("--model", choices=MODELS, default=default_model(),
                    help="the tiny model every honest neuron serves: trained (on real text, the default in a "
                         "checkout, copied from inference/model/assets/tiny_trained) or random (seed 0; the "
                         "default where the trained asset is not shipped)")
    ap.add_argument("--checkpoints", type=Path, default=Path("checkpoints"),
                    help="where the tiny checkpoints are made once and kept (default: ./checkpoints)")
    ap.add_argument("--network", "-n", "--subtensor.network", "--subtensor.chain_endpoint", dest="chain",
                    default="devnet", help="devnet (embedded), or a subtensor node as btcli names one: local, "
                                           "test, finney, ws://HOST:PORT")
    ap.add_argument("--chain", dest="chain", action=DeprecatedFlag, new="--network", help=argparse.SUPPRESS)
    ap.add_argument("--netuid", type=int, default=None, help="subnet on a real node (devnet: created)")
    ap.add_argument("--wallet-path", "--wallet.path", type=Path, default=None,
                    help="real node: where the registered wallets are")
    ap.add_argument("--validator-wallet", "--wallet-name", "--wallet.name", "-w", dest="validator_wallet",
                    default="validator", help="real node: the validator's wallet name (btcli's --wallet-name)")
    ap.add_argument("--miner-wallets", default="", help="real node: comma-separated miner wallet names")
    ap.add_argument("--block-interval", type=float, default=0.5, help="devnet seconds per block")
    ap.add_argument("--tempo", type=int, default=60, help="devnet blocks per epoch")
    ap.add_argument("--round-interval", type=float, default=10.0, help="validator seconds between rounds")
    ap.add_argument("--no-dashboard", action="store_true",
                    help="plain lines instead of the live dashboard (the default when stdout is not a terminal: "
                         "piped to tee, a file, a service's journal)")
    ap.add_argument("--summary", type=Path, default=None, help="write a JSON summary here at the end")
    ap.add_argument("--setup-only", action="store_true",
                    help="devnet: create the chain, wallets, registrations and stake in --run-dir, write "
                         "localnet.json there and exit (nothing is started)")
    ap.add_argument("--stop-after-epochs", type=int, default=0,
                    help="devnet: stop once this many epochs have run after the validator's first weights (0 = no)")
    ap.add_argument("--swarm", type=int, default=0, metavar="N",
                    help="devnet: serve the tiny model as a swarm of N stage miners (plus a spare and a route miner)")
    ap.add_argument("--swarm-tokens", type=int, default=8, help="--swarm: tokens of the completion served")
    ap.add_argument("--cheat-stage", action="append", choices=STAGE_CHEATS + DRIVER_CHEATS, default=[], metavar="KIND",
                    help="--swarm: one stage miner cheats this way (repeat for several, each on another block; "
                         "each cheated block gets an honest spare): " + ", ".join(STAGE_CHEATS) + "; or the route "
                         "miner, as a route driver: " + ", ".join(DRIVER_CHEATS))
    ap.add_argument("--stage-sessions", type=int, default=2,
                    help="--swarm: sessions the validator drives through the stages per round (each checked after "
                         "it ran)")
    ap.add_argument("--stop-when-caught", action="store_true",
                    help="--swarm with --cheat-stage: stop once every cheater is blamed and at weight 0 on chain, "
                         "every honest stage is checked and paid, and an organic request went through the spares; "
                         "whole-model miners: stop once the validator zeroed the cheating miner and set weights with "
                         "it at 0 and every honest miner above 0 (exit 1 if --duration ends first)")
    ap.add_argument("--soak", type=float, default=0.0, metavar="SECONDS",
                    help="devnet: run this long under organic traffic through the validator's gateway while faults "
                         "drawn from --soak-seed hit the subnet (kills and restarts, pauses, stage links, chain RPC "
                         "errors, a stage leaving and one joining, clock skew, the validator's disk full), then print "
                         "the checker's table (exit 1 when a criterion is not met; docs/localnet.md)")
    ap.add_argument("--soak-seed", type=int, default=0, help="--soak: the seed of the fault schedule and the traffic")
    ap.add_argument("--soak-rate", type=float, default=0.5,
                    help="--soak: organic requests per second (steady; bursts and long prompts come on top)")
    args = ap.parse_args(argv)
    if args.soak and (args.chain != "devnet" or args.setup_only or args.stop_when_caught or args.stop_after_epochs):
        ap.error("--soak runs on the embedded devnet, without --setup-only, --stop-when-caught or --stop-after-epochs")
    if args.soak:
        args.duration = args.soak
    if args.cheat_stage and not args.swarm:
        ap.error("--cheat-stage KIND needs a swarm: go with --swarm N")
    if args.stop_when_caught and not args.swarm and (args.cheat == "none" or args.chain != "devnet"):
        ap.error("--stop-when-caught on whole-model miners needs a --cheat other than none, on the devnet")
    if args.sharded_miners + args.bf16_miners > args.miners - (args.cheat != "none"):
        ap.error("--sharded-miners plus --bf16-miners must leave the last miner to cheat")
    if sum(2 if k == "pair-cover" else 1 for k in args.cheat_stage if k in STAGE_CHEATS) > args.swarm:
        ap.error(f"--cheat-stage: at most one cheater per block ({args.swarm} blocks)")
    if args.stop_when_caught and args.swarm and not args.cheat_stage:
        ap.error("--stop-when-caught needs at least one --cheat-stage")
    if args.swarm and (args.chain != "devnet" or args.setup_only or args.swarm < 2):
        ap.error("--swarm N runs on the embedded devnet (no --network, no --setup-only) with N >= 2")
    if args.model == "trained" and not (TRAINED_ASSET / "k3_manifest.json").exists():
        ap.error(f"--model trained: the trained tiny checkpoint is not here ({TRAINED_ASSET}); use --model random")
    if args.miners < 2:
        ap.error("--miners must be at least 2 (one honest, one cheating)")
    if args.chain != "devnet" and (args.netuid is None or args.wallet_path is None or not args.miner_wallets):
        ap.error("with a real node, give --netuid, --wallet-path and --miner-wallets (wallets registered with btcli)")
    if args.setup_only and (args.chain != "devnet" or args.run_dir is None):
        ap.error("--setup-only sets up the embedded devnet: give --run-dir and no --network")
    if args.metrics_base_port is None:
        args.metrics_base_port = args.base_port + 1000
    if args.chain != "devnet":  # a real node's miners are the wallets given
        args.miners = len([w for w in args.miner_wallets.split(",") if w.strip()])
    # the neurons run in the run directory: paths given relative to where k3-localnet started must stay right
    if args.wallet_path is not None:
        args.wallet_path = args.wallet_path.expanduser().resolve()
    if args.chain.startswith("devnet:"):
        args.chain = "devnet:" + str(Path(args.chain[len("devnet:"):]).expanduser().resolve())
    args.checkpoints = args.checkpoints.expanduser().resolve()
    if args.run_dir is not None:
        args.run_dir = args.run_dir.expanduser().resolve()
    return args


# ------------------------------------------------------------------ setup
def default_model() -> str:
    """The trained tiny model where its asset ships (a checkout or an installed wheel); the random one otherwise."""
    return "trained" if (TRAINED_ASSET / "k3_manifest.json").exists() else "random"


def model_config(args) -> ModelConfig:
    return ModelConfig.tiny_trained() if args.model == "trained" else ModelConfig.tiny()


def checkpoint_dir(args, cheat_weights: bool = False) -> Path:
    """The tiny checkpoint the honest neurons serve; for the "different weights" cheat, another model of the same
    configuration (random weights of another seed)."""
    name = "tiny-trained" if args.model == "trained" else "tiny"
    return args.checkpoints / (f"{name}-seed1" if cheat_weights else name)


def ensure_checkpoints(args) -> None:
    """Make (or copy) the checkpoints once into --checkpoints: nothing is ever written into the package's assets.
    The trained copy is renewed when the shipped asset changes (another manifest)."""
    honest = checkpoint_dir(args)
    if args.model == "trained":
        manifest = (TRAINED_ASSET / "k3_manifest.json").read_text()
        copied = honest / "k3_manifest.json"
        if not copied.exists() or copied.read_text() != manifest:
            print(f"[localnet] copying the trained tiny checkpoint to {honest}")
            partial = honest.with_name(honest.name + ".partial")
            shutil.rmtree(partial, ignore_errors=True)
            shutil.copytree(TRAINED_ASSET, partial)
            shutil.rmtree(honest, ignore_errors=True)
            partial.rename(honest)
    elif not (honest / "config.json").exists():
        print(f"[localnet] making the tiny checkpoint in {honest}")
        make_random_checkpoint(ModelConfig.tiny(), honest, seed=0, progress=True)
    cheat = checkpoint_dir(args, cheat_weights=True)
    if args.cheat == "weights" and not (cheat / "config.json").exists():
        make_random_checkpoint(model_config(args), cheat, seed=1, progress=True)


def ephemeral_port_range() -> tuple[int, int]:
    """The ports the kernel hands out for port-0 binds and outgoing connections (Linux; else its default)."""
    try:
        low, high = (int(v) for v in Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
        return low, high
    except (OSError, ValueError):
        return 32768, 60999


def free_port_block(n: int) -> int:
    """A base port with n consecutive loopback ports after it that were free a moment ago (for --base-port),
    below the kernel's ephemeral range when there is room: a port there can be taken meanwhile by any port-0
    bind or outgoing connection (the processes' own sinks and clients), before the process meant to listen on it
    binds it."""
    low, _ = ephemeral_port_range()
    pick = random.Random()
    for _attempt in range(200):
        if low - n > 10000:
            base = pick.randrange(10000, low - n)
        else:  # no room below the ephemeral range: take one the kernel just gave out
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                base = s.getsockname()[1]
        if base + n >= 65535:
            continue
        try:
            for port in range(base, base + n):
                with socket.socket() as t:
                    t.bind(("127.0.0.1", port))
        except OSError:
            continue
        return base
    raise RuntimeError("no block of free ports")


def make_wallet(path: Path, name: str) -> bt.Wallet:
    w = bt.Wallet(name=name, hotkey="default", path=str(path))
    if not w.coldkeypub_file.exists_on_device():
        w.create_new_coldkey(use_password=False, suppress=True)
    if not w.hotkey_file.exists_on_device():
        w.create_new_hotkey(use_password=False, suppress=True)
    return w


async def setup_devnet(run_dir: Path, args, neurons: list[Neuron], step=lambda what: None) -> tuple[str, int]:
    """The devnet, its subnet, registrations and stake; `step(what)` is called as each one is done."""
    db = run_dir / "devnet.sqlite"
    chain = DevnetChain(str(db), block_interval=args.block_interval, create=True)
    owner = make_wallet(run_dir / "wallets", "owner")
    netuid = await chain.create_subnet(owner, tempo=args.tempo, weights_rate_limit=5, immunity_period=5000,
                                       serving_rate_limit=5, min_allowed_weights=1, max_validators=8)
    step(f"subnet {netuid} created")
    for n in neurons:
        await chain.register(n.wallet, netuid)
        step(f"{n.name} registered")
    validator = next(n for n in neurons if n.role == "validator")
    await chain.add_stake(validator.wallet, validator.wallet.hotkey.ss58_address, netuid, VALIDATOR_STAKE)
    step("validator staked")
    await chain.close()
    return f"devnet:{db}", netuid


@contextlib.contextmanager
def setup_progress(total: int):
    """A rich progress bar over the setup steps (on stderr), or one plain line per step when stderr is not a
    terminal; yields step(what)."""
    console = Console(stderr=True)
    if not console.is_terminal:
        done = [0]

        def step(what: str) -> None:
            done[0] += 1
            print(f"[localnet] setup {done[0]}/{total}: {what}", file=sys.stderr, flush=True)

        yield step
        return
    columns = (SpinnerColumn(), TextColumn("[localnet] {task.description}"), BarColumn(), MofNCompleteColumn(),
               TimeElapsedColumn())
    with Progress(*columns, console=console) as progress:
        task = progress.add_task("setting up", total=total)
        yield lambda what: progress.update(task, advance=1, description=what)


SETUP_FILE = "localnet.json"


def write_setup(path: Path, chain_spec: str, netuid: int, neurons: list[Neuron], args) -> None:
    """What --setup-only made, for the processes started after it; written last, so its presence
    means the setup finished."""
    setup = {"chain": chain_spec, "netuid": netuid, "checkpoint": str(checkpoint_dir(args)),
             "neurons": [{"name": n.name, "role": n.role, "kind": n.kind, "wallet_name": n.wallet.name,
                          "wallet_hotkey": "default", "wallet_path": str(Path(n.wallet.path)),
                          "hotkey": n.wallet.hotkey.ss58_address} for n in neurons]}
    partial = path.with_suffix(".partial")
    partial.write_text(json.dumps(setup, indent=2))
    partial.replace(path)


def miner_command(n: Neuron, index: int, args, chain_spec: str, netuid: int, run_dir: Path) -> list[str]:
    cheat = args.cheat if n.kind.startswith("cheat") else None
    module = "localnet.cheats.miner" if cheat else "neurons.miner"
    checkpoint = checkpoint_dir(args, cheat_weights=cheat == "weights")
    cmd = [sys.executable, "-m", module,
           "--network", chain_spec, "--netuid", str(netuid),
           "--wallet-name", n.wallet.name, "--wallet-hotkey", "default", "--wallet-path", str(Path(n.wallet.path)),
           "--host", "127.0.0.1", "--port", str(n.port),
           "--metrics-port", str(args.metrics_base_port + index),
           "--nonce-store", str(run_dir / f"{n.name}-nonces.sqlite"),
           "--min-validator-stake", str(MINER_MIN_VALIDATOR_STAKE),
           "--checkpoint", str(checkpoint), "--max-context", "4096", "--max-concurrent", "16",
           "--metagraph-refresh-s", "5"]
    if n.kind.startswith("sharded"):
        cmd += ["--engine", "sharded", "--shards", "2", "--shard-mode", "pipeline"]
    if n.kind.endswith("bf16") or cheat == "coarse-experts-for-sampled":  # that cheat declares bf16
        cmd += ["--dtype", "bfloat16"]
    if cheat and cheat != "weights":
        cmd += ["--cheat", cheat]
    elif cheat == "weights":
        cmd += ["--cheat", "none"]
    return cmd


def honest_kind(i: int, args) -> str:
    """Honest miner i: miner 0 single-process in fp32, then --sharded-miners sharded ones, then --bf16-miners in
    bf16, then single-process fp32 again."""
    if 1 <= i <= args.sharded_miners:
        return "sharded x2"
    if args.sharded_miners < i <= args.sharded_miners + args.bf16_miners:
        return "reference bf16"
    return "reference"


def validator_command(n: Neuron, args, chain_spec: str, netuid: int, run_dir: Path) -> list[str]:
    return [sys.executable, "-m", "neurons.validator", "run",
            "--network", chain_spec, "--netuid", str(netuid),
            "--wallet-name", n.wallet.name, "--wallet-hotkey", "default", "--wallet-path", str(Path(n.wallet.path)),
            "--checkpoint", str(checkpoint_dir(args)), "--reference-engine",
            "--db", str(run_dir / "validator.sqlite"),
            "--scoring-profile", "local_testnet", "--round-interval-s", str(args.round_interval),
            "--weights-check-s", "2", "--canaries", "8", "--miners-at-once", "1", "--metagraph-refresh-s", "5",
            # after the miners' metrics ports, so that --base-port (or --metrics-base-port) moves it too
            "--metrics-port", str(args.metrics_base_port + args.miners)]


def start(n: Neuron, cmd: list[str], log_dir: Path, env: dict[str, str] | None = None, append: bool = False) -> None:
    """Start `n` (a session of its own), its output to log_dir/NAME.log (appended to with `append`: a restart)."""
    n.log, n.cmd, n.env = log_dir / f"{n.name}.log", list(cmd), dict(env or {})
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", **n.env)
    if (PACKAGE_ROOT / "pyproject.toml").exists():  # a checkout: `python -m neurons...` imports it from any directory
        env["PYTHONPATH"] = os.pathsep.join([str(PACKAGE_ROOT), *filter(None, env.get("PYTHONPATH", "").split(os.pathsep))])
    with open(n.log, "a" if append else "w") as log:
        log.write("$ " + " ".join(cmd) + "\n")
        log.flush()
        # a session of its own: stopping the group also stops its shard processes
        n.process = subprocess.Popen(cmd, cwd=log_dir.parent, stdout=log, stderr=subprocess.STDOUT, env=env,
                                     start_new_session=True)


def wait_until_serving(miners: list[Neuron], timeout_s: float = 180.0) -> None:
    """Every miner answers /health (the sharded one starts its shard processes first)."""
    deadline = time.monotonic() + timeout_s
    waiting = list(miners)
    while waiting and time.monotonic() < deadline:
        for n in list(waiting):
            if n.process.poll() is not None:
                raise SystemExit(f"[localnet] {n.name} exited at start (code {n.process.returncode}); see {n.log}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{n.port}/health", timeout=2) as r:
                    if r.status == 200:
                        waiting.remove(n)
            except OSError:
                pass
        time.sleep(0.5)
    if waiting:
        print(f"[localnet] still starting after {timeout_s:.0f} s: {', '.join(n.name for n in waiting)}")


def stop_all(neurons: list[Neuron], grace_s: float = 10.0) -> None:
    live = [n for n in neurons if n.process and n.process.poll() is None]
    for n in live:
        try:
            os.killpg(n.process.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + grace_s
    for n in live:
        try:
            n.process.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
    for n in neurons:
        if n.process is None:
            continue
        try:  # whatever is left of each group, shards included
            os.killpg(n.process.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        try:
            n.process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            pass


# ------------------------------------------------------------------ dashboard
async def snapshot(chain, netuid: int, run_dir: Path, neurons: list[Neuron]) -> dict:
    from neurons.validator_app.status import status_report
    from neurons.validator_app.store import ValidatorStore, ValidatorStoreError

    block = await chain.block()
    meta = await chain.metagraph(netuid)
    until = await chain.blocks_until_next_epoch(netuid)
    view = {}
    db = run_dir / "validator.sqlite"
    if db.exists():
        try:
            with ValidatorStore(db, readonly=True) as store:
                view = {m["uid"]: m for m in status_report(store)["miners"]}
        except (ValidatorStoreError, Exception):  # the validator may be creating it right now
            view = {}
    rows = []
    for n in neurons:
        info = meta.by_hotkey(n.wallet.hotkey.ss58_address)
        uid = info.uid if info else None
        v = view.get(uid, {})
        rows.append({"name": n.name, "role": n.role, "kind": n.kind, "uid": uid,
                     "alive": n.process is not None and n.process.poll() is None,
                     "incentive": info.incentive if info else 0.0, "dividends": info.dividends if info else 0.0,
                     "stake": info.stake if info else 0.0, "validator": v})
    state = {"block": block, "blocks_until_epoch": until, "rows": rows}
    if isinstance(chain, DevnetChain):  # what the chain itself says: the validator's weight row and epochs
        vinfo = meta.by_hotkey(neurons[0].wallet.hotkey.ss58_address)
        row = (await chain.weights(netuid)).get(vinfo.uid, {}) if vinfo else {}
        state["weights_row"] = {str(uid): w for uid, w in row.items()}
        state["validator_last_update"] = vinfo.last_update if vinfo else None
        state["validator_registered_at"] = vinfo.block_at_registration if vinfo else None
    return state


def render(state: dict, started: float) -> Group:
    head = (f"block {state['block']}  next epoch in {state['blocks_until_epoch']} blocks  "
            f"running {time.monotonic() - started:.0f} s")
    t = Table(title="k3-subnet localnet", caption=head)
    for col in ("neuron", "uid", "kind", "up", "TTFT s/1k", "tok/s", "burst tok/s", "long ctx", "quality", "fails",
                "score", "weight", "incentive", "last failure"):
        t.add_column(col, overflow="fold")

    def f(x, d=3):
        return "-" if x is None else f"{x:.{d}f}"

    for r in state["rows"]:
        v = r["validator"]
        t.add_row(r["name"], str(r["uid"]), r["kind"], "yes" if r["alive"] else "NO",
                  f(v.get("ttft_per_1k_s")), f(v.get("decode_tps"), 1), f(v.get("burst_tps"), 1),
                  f(v.get("long_context_share"), 2), f(v.get("quality"), 2), str(v.get("failures", "-")),
                  f(v.get("score"), 3), f(v.get("weight"), 3), f(r["incentive"], 3),
                  (v.get("last_failure") or "")[:40])
    return Group(t)


def zeroed_at(run_dir: Path, uid: int) -> dict | None:
    """When the validator first zeroed `uid` (a hard failure or the audit failure rate): the round, the reason,
    and how many audits (tier 1 and tier 2) of it the validator had made until then: up to its first hard failure,
    or by the end of the round whose failure rate zeroed it; None while it was never zeroed."""
    from neurons.validator_app.store import ValidatorStore  # noqa: PLC0415 (needs the validator's packages)

    db = run_dir / "validator.sqlite"
    if not db.exists():
        return None
    with ValidatorStore(db, readonly=True) as store:
        for number in range(1, store.round + 1):
            score = store.scores_of_round(number).get(uid)
            reasons = json.loads(score["reasons"] or "[]") if score is not None else []
            zeroing = [r for r in reasons if r.startswith(("hard failure", "failed "))]
            if zeroing:
                hard = [f["at"] for f in store.failures(uid) if f["hard"] and f["round"] <= number]
                audits = [a for a in store.audits(uid) if a["round"] <= number and (not hard or a["at"] <= min(hard))]
                return {"round": number, "reason": zeroing[0], "audits": len(audits),
                        "tier1_audits": sum(1 for a in audits if a["tier"] == 1)}
    return None


def caught_cheater(state: dict, run_dir: Path, zeroed_block: int | None) -> tuple[dict | None, int | None]:
    """(what --stop-when-caught waits for: the cheating miner zeroed by the validator and at weight 0 in weights
    set after the block where that was first seen, `zeroed_block`, with every honest miner above 0 there, or None
    until then; the block where the zeroing was first seen)."""
    miners = [r for r in state["rows"] if r["role"] == "miner" and r["uid"] is not None]
    cheater = next((r for r in miners if r["kind"].startswith("cheat")), None)
    zeroed = zeroed_at(run_dir, cheater["uid"]) if cheater is not None else None
    if zeroed is None:
        return None, None
    zeroed_block = state["block"] if zeroed_block is None else zeroed_block
    row = {int(uid): w for uid, w in (state.get("weights_row") or {}).items()}
    honest = [r for r in miners if r is not cheater]
    if (state.get("validator_last_update") or 0) <= zeroed_block or row.get(cheater["uid"], 0) > 0 \
            or any(row.get(r["uid"], 0) <= 0 for r in honest):
        return None, zeroed_block
    return {**zeroed, "cheat": cheater["kind"], "weights_block": state["validator_last_update"],
            "honest_weights": {r["name"]: row[r["uid"]] for r in honest}}, zeroed_block


PLAIN_EVERY_S = 30.0  # plain lines: the rows again at least this often, else only when something changed


def plain_rows(state: dict) -> list[str]:
    """The dashboard's rows as plain lines, one per miner, for a log (no terminal: no table to redraw)."""
    def f(x, d=3):
        return "-" if x is None else f"{x:.{d}f}"

    lines = []
    for r in state["rows"]:
        if r["role"] != "miner":
            continue
        v = r["validator"]
        lines.append(f"  {r['name']} uid {r['uid']} ({r['kind']}, {'up' if r['alive'] else 'DOWN'}): "
                     f"ttft/1k {f(v.get('ttft_per_1k_s'))} s, {f(v.get('decode_tps'), 1)} tok/s, burst "
                     f"{f(v.get('burst_tps'), 1)} tok/s, long ctx {f(v.get('long_context_share'), 2)}, quality "
                     f"{f(v.get('quality'), 2)}, fails {v.get('failures', '-')}, score {f(v.get('score'))}, weight "
                     f"{f(v.get('weight'))}, incentive {f(r['incentive'])}"
                     + (f"; last failure: {v['last_failure'][:100]}" if v.get("last_failure") else ""))
    return lines


async def watch(args, chain_spec: str, netuid: int, run_dir: Path, neurons: list[Neuron], t_launch: float,
                supervised: bool = False) -> dict:
    """The live dashboard until --duration, Ctrl-C, --stop-after-epochs or (unless a soak restarts them) a process
    dying."""
    chain = connect(chain_spec)
    started = time.monotonic()
    first_weights = None
    caught, zeroed_block = None, None
    console = Console()
    printed, printed_at = [], -math.inf  # plain lines: the rows last printed, and when
    state = await snapshot(chain, netuid, run_dir, neurons)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    signalled = on_stop_signals(loop, stop)
    plain = args.no_dashboard or not console.is_terminal
    live = None if plain else Live(render(state, started), console=console, refresh_per_second=1)
    if live:
        live.start()
    say = console.print if live else (lambda text: print(text, flush=True))  # a log's lines are never wrapped
    try:
        while not stop.is_set():
            if args.duration and time.monotonic() - started >= args.duration:
                break
            dead = [n.name for n in neurons if n.process and n.process.poll() is not None]
            if dead and not supervised:
                say(f"[localnet] stopped unexpectedly: {', '.join(dead)} (see {run_dir}/logs)")
                break
            try:
                await asyncio.wait_for(stop.wait(), timeout=2.0)
            except asyncio.TimeoutError:
                pass
            try:
                state = await snapshot(chain, netuid, run_dir, neurons)
            except Exception as exc:  # a locked database for a moment: keep the last view
                say(f"[localnet] dashboard refresh failed: {exc}")
            if state.get("weights_row") and first_weights is None:
                first_weights = {"block": state["validator_last_update"], "elapsed_s": time.monotonic() - t_launch,
                                 "row": state["weights_row"]}
                say(f"[localnet] first weights on chain at block {first_weights['block']}, "
                              f"{first_weights['elapsed_s']:.0f} s after start: {first_weights['row']}")
            if first_weights is not None and isinstance(chain, DevnetChain):
                epochs = await chain.epoch_history(netuid, limit=None, since_block=first_weights["block"])
                state["epochs_after_weights"] = [
                    {"block": e.block, "incentive": {str(n.uid): n.incentive for n in e.neurons}} for e in epochs]
                if args.stop_after_epochs and len(epochs) >= args.stop_after_epochs:
                    say(f"[localnet] {len(epochs)} epoch(s) after the first weights: stopping")
                    break
            if args.stop_when_caught:
                caught, zeroed_block = caught_cheater(state, run_dir, zeroed_block)
                if caught is not None:
                    say(f"[localnet] the cheater was zeroed in round {caught['round']} after "
                                  f"{caught['audits']} audits ({caught['reason'][:120]}); weights at block "
                                  f"{caught['weights_block']} hold it at 0 and every honest miner above 0: stopping")
                    break
            if live:
                live.update(render(state, started))
            else:
                rows = plain_rows(state)
                if rows != printed or time.monotonic() - printed_at >= PLAIN_EVERY_S:
                    print(f"[localnet] block {state['block']} (next epoch in {state['blocks_until_epoch']} blocks), "
                          f"running {time.monotonic() - started:.0f} s:", *rows, sep="\n", flush=True)
                    printed, printed_at = rows, time.monotonic()
    finally:
        if live:
            live.stop()
        await chain.close()
        off_stop_signals(loop, signalled)
    state["first_weights"] = first_weights
    state["caught"] = caught
    state["watch_s"] = time.monotonic() - started
    return state


def on_stop_signals(loop: asyncio.AbstractEventLoop, stop: asyncio.Event) -> list[int]:
    """SIGINT and SIGTERM end a watch: `stop` is set, and the signal noted in the list returned."""
    signalled: list[int] = []
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, lambda sig=sig: (signalled.append(sig), stop.set()))
    return signalled


def off_stop_signals(loop: asyncio.AbstractEventLoop, signalled: list[int]) -> None:
    """The end of a watch: a signal ended it, so the shutdown begins (`shutting_down`), else SIGTERM leaves through
    the caller's `finally` again (asyncio would put the defaults back)."""
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.remove_signal_handler(sig)
    if signalled:
        shutting_down()
    else:
        signal.signal(signal.SIGTERM, exit_on_sigterm)


def shutting_down() -> None:
    """From here on a second Ctrl-C (or SIGTERM) is ignored: the shutdown that stops every process it started is
    bounded (stop_all's grace, then SIGKILL), and one cut short would leave them holding their ports."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)


def exit_on_sigterm(signum, frame) -> None:
    """SIGTERM outside the dashboard (while processes start): leave through the `finally` that stops them."""
    raise SystemExit(128 + signum)


def miner_neurons(args, wallet_dir: Path, names: list[str], first_port: int, devnet: bool = True) -> list[Neuron]:
    """The whole-model miners: honest ones as `honest_kind` lays them out, the last one cheating (--cheat, unless
    none)."""
    miners = []
    for i, name in enumerate(names):
        cheat = i == len(names) - 1 and args.cheat != "none"
        kind = f"cheat: {args.cheat}" if cheat else honest_kind(i, args)
        wallet = make_wallet(wallet_dir, name) if devnet else bt.Wallet(name, "default", path=str(wallet_dir))
        miners.append(Neuron(name, "miner", wallet, port=first_port + i, kind=kind))
    return miners


def main(argv=None, prog: str = "k3-localnet") -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["check"]:  # the soak's checker on a run directory
        return soak_check.main(argv[1:])
    args = parse_args(argv, prog)
    signal.signal(signal.SIGTERM, exit_on_sigterm)
    t_launch = time.monotonic()
    run_dir = args.run_dir or Path("runs").resolve() / time.strftime("localnet-%Y%m%d-%H%M%S")
    log_dir = run_dir / "logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    print(f"[localnet] run directory {run_dir}")
    if args.swarm:
        return run_swarm(args, run_dir, t_launch)
    if args.setup_only and (run_dir / SETUP_FILE).exists():
        print(f"[localnet] already set up: {run_dir / SETUP_FILE}")
        return 0
    ensure_checkpoints(args)

    neurons: list[Neuron] = []
    if args.chain == "devnet":
        wallet_dir = run_dir / "wallets"
        neurons.append(Neuron("validator", "validator", make_wallet(wallet_dir, "validator")))
        names = [f"miner{i}" for i in range(args.miners)]
    else:
        wallet_dir = args.wallet_path
        neurons.append(Neuron("validator", "validator", bt.Wallet(args.validator_wallet, "default", path=str(wallet_dir))))
        names = [w.strip() for w in args.miner_wallets.split(",") if w.strip()]
    neurons += miner_neurons(args, wallet_dir, names, args.base_port, devnet=args.chain == "devnet")

    if args.chain == "devnet":
        with setup_progress(len(neurons) + 2) as step:
            chain_spec, netuid = asyncio.run(setup_devnet(run_dir, args, neurons, step))
    else:
        chain_spec, netuid = args.chain, args.netuid
    print(f"[localnet] chain {chain_spec}, netuid {netuid}")
    if args.setup_only:
        write_setup(run_dir / SETUP_FILE, chain_spec, netuid, neurons, args)
        print(f"[localnet] set up; wrote {run_dir / SETUP_FILE}")
        return 0

    state = {}
    soak = None
    try:
        miners = [n for n in neurons if n.role == "miner"]
        for i, n in enumerate(miners):
            start(n, miner_command(n, i, args, chain_spec, netuid, run_dir), log_dir, soak_env(args, run_dir, n))
            print(f"[localnet] {n.name} ({n.kind}) on 127.0.0.1:{n.port}, log {n.log}")
        wait_until_serving(miners)
        validator = neurons[0]
        command = validator_command(validator, args, chain_spec, netuid, run_dir)
        if args.soak:  # users reach the subnet through the validator's gateway
            validator.gateway_port = args.base_port + len(miners)
            command += gateway_flags(validator, run_dir) + SOAK_VALIDATOR_FLAGS
        start(validator, command, log_dir, soak_env(args, run_dir, validator))
        print(f"[localnet] validator started, log {validator.log}")
        if args.soak:
            soak = start_soak(args, run_dir, neurons, chain_spec, netuid)
        state = asyncio.run(watch(args, chain_spec, netuid, run_dir, neurons, t_launch, supervised=soak is not None))
    finally:
        shutting_down()
        if soak is not None:
            soak.stop()
        print("[localnet] stopping every process it started")
        stop_all(neurons)
    if args.summary:
        args.summary.write_text(json.dumps({"chain": chain_spec, "netuid": netuid, "run_dir": str(run_dir),
                                            **state}, indent=2, default=str))
    if args.stop_when_caught and not state.get("caught"):
        print("[localnet] --duration ended before the cheater was caught")
        return 1
    return soak_report(run_dir) if soak is not None else 0


# ------------------------------------------------------------------ the soak (localnet/soak.py)
# The soak's validator: rounds sized so that it scores the miners within a minute or two on two loaded cores (the
# soak is about what users see and who is blamed while faults hit, not about measuring speed), and a first-token
# deadline for the tiny model (its prefills take under 3 s here; 60 s is for full-size prompts on real hardware), so
# that a miner or route that stopped answering is given up for the next one within seconds.
SOAK_VALIDATOR_FLAGS = ["--scoring-overrides", json.dumps({"round_requests": 6, "chat_max_tokens": [24, 48],
                                                           "canary_tokens": 24, "copy_text_tokens": [8, 16],
                                                           "long_context_sizes": [512, 1024],
                                                           "long_context_max_tokens": [8, 16]}),
                        "--gateway-first-token-timeout-s", "15"]
SOAK_WARMUP_S = 900.0  # at most this long for the validator's first scores before the soak begins


def soak_env(args, run_dir: Path, n: Neuron) -> dict[str, str]:
    """The test-only fault control files a soak's process reads; nothing without --soak."""
    return fault_env(run_dir, n.name, n.role) if args.soak else {}


def gateway_flags(validator: Neuron, run_dir: Path) -> list[str]:
    """The validator's organic gateway on its gateway_port, for the API key GATEWAY_KEY."""
    keys = run_dir / "gateway-keys.txt"
    keys.write_text(GATEWAY_KEY + "\n")
    return ["--gateway", "--gateway-port", str(validator.gateway_port), "--gateway-api-keys", str(keys),
            "--gateway-rate-limit", "100000"]


def soak_party(n: Neuron, run_dir: Path) -> Party:
    """A neuron as the soak looks after it: restarted with its own command (its log appended to), serving when
    its health answers (a stage or the route miner: once it wrote its ready file again)."""
    role = "route" if n.name == "route" else n.role
    ready_file = run_dir / f"{n.name}.ready"

    def launch(append: bool):
        ready_file.unlink(missing_ok=True)
        start(n, n.cmd, run_dir / "logs", n.env, append=append)
        return n.process

    def ready() -> bool:
        if role == "validator":
            return http_ok(f"http://127.0.0.1:{n.gateway_port}/health")
        if role == "miner":
            return http_ok(f"http://127.0.0.1:{n.port}/health")
        if not ready_file.exists():
            return False
        return http_ok(served_url() + ("/stage/health" if role == "stage" else "/health"))

    def served_url() -> str:
        return json.loads(ready_file.read_text())["url"].rstrip("/")

    def bounded_mb() -> float | None:
        """What the party holds by design in a store bounded in bytes and age, from its health: a stage's ledger
        (--ledger-bytes, --ledger-retain-s), a whole-model miner's committed states (--commit-max-bytes,
        --commit-retain-s); None when it does not answer or keeps none."""
        url, key = ((served_url() + "/stage/health", "ledger_bytes") if role == "stage"
                    else (f"http://127.0.0.1:{n.port}/health", "committed_bytes"))
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                kept = json.loads(r.read())[key]
        except (OSError, ValueError, KeyError):
            return None
        return kept / 2**20 if isinstance(kept, (int, float)) else None

    honest = not n.cheat and not n.kind.startswith("cheat")
    return Party(n.name, role, n.wallet.hotkey.ss58_address, honest, launch, ready, log=n.log,
                 bounded_mb=bounded_mb if role in ("stage", "miner") else None)


def start_soak(args, run_dir: Path, neurons: list[Neuron], chain_spec: str, netuid: int,
               links: StageLinks | None = None, join_stage=None) -> Soak:
    """Once the validator's gateway serves: the soak's supervisor, traffic, faults and sampler (localnet/soak.py)."""
    validator = next(n for n in neurons if n.role == "validator")
    asyncio.run(wait_gateway(f"http://127.0.0.1:{validator.gateway_port}", validator))
    warm = wait_warm(run_dir / "validator.sqlite", SOAK_WARMUP_S)
    print(f"[localnet] the validator scored its first miners after {warm:.0f} s more: the soak begins" if warm is not None
          else f"[localnet] the validator scored no miner within {SOAK_WARMUP_S:.0f} s: the soak begins anyway")
    parties = [soak_party(n, run_dir) for n in neurons]
    supervisor = Supervisor(run_dir, [])
    for n, p in zip(neurons, parties):
        supervisor.adopt(p, n.process)
    whole = [n for n in neurons if n.role == "miner" and n.name != "route" and not n.kind.startswith("cheat")]
    targets = Targets(miners=tuple(n.name for n in whole),
                      sharded=tuple(n.name for n in whole if n.kind.startswith("sharded")),
                      stages=tuple((n.name, n.layers) for n in neurons if n.role == "stage" and not n.cheat
                                   and links is not None and n.name in links.links),
                      route=tuple(n.name for n in neurons if n.name == "route" and not n.cheat),
                      validator=validator.name)
    schedule = draw_schedule(args.soak_seed, args.soak, targets)
    started = time.time()
    write_meta(run_dir, parties, args.soak_seed, started, args.soak, netuid=netuid, chain=chain_spec)
    traffic = SoakTraffic(f"http://127.0.0.1:{validator.gateway_port}", GATEWAY_KEY, run_dir, args.soak_seed,
                          rate=args.soak_rate)
    injector = FaultInjector(run_dir, supervisor, links, started, join_stage,
                             tempo_s=(args.tempo + 1) * args.block_interval)
    soak = Soak(run_dir, args.soak_seed, args.soak, supervisor, traffic, injector, schedule)
    soak.start()
    print(f"[localnet] soak of {args.soak:.0f} s: {len(schedule)} faults drawn from seed {args.soak_seed} "
          f"({run_dir / 'schedule.json'}), organic traffic at {args.soak_rate:g} requests/s")
    return soak


def soak_report(run_dir: Path) -> int:
    """The checker's table for the soak just ended (exit status 1 when a criterion is not met)."""
    report = soak_check.check(run_dir)
    print(soak_check.render(report))
    return 0 if all(c["met"] for c in report["criteria"].values()) else 1


# ------------------------------------------------------------------ the swarm
SWARM_PROMPT = [(11 * j + 5) % 256 for j in range(21)]


def swarm_neurons(args, wallet_dir: Path) -> list[Neuron]:
    """The validator, stage0..stage{N-1} (one per block), the spares, and the route miner.

    Without --cheat-stage: one spare, for the middle block (with --soak, one for every block), every stage honest
    in fp32. With --cheat-stage K1
    [--cheat-stage K2 ...]: cheater i serves block (N // 2 + i) mod N in place of its honest stage, each cheated
    block has an honest spare ("spare", "spare1", ...) that takes over once the cheater is blamed, and one honest
    stage serves its block in bf16 with a bf16 wire (the last honest stage0..N-1, else the last spare)."""
    from inference.planning.swarm_plan import stage_blocks  # noqa: PLC0415

    config = model_config(args)
    blocks = stage_blocks(config.num_layers, config.attn_res_block_size, args.swarm)
    cheats = [k for k in args.cheat_stage or [] if k in STAGE_CHEATS]
    # pair-cover is two adjacent stages of one operator: one that computes nothing, the next covering for it
    cheats = [c for k in cheats for c in (("pair-cover-echo", "pair-cover") if k == "pair-cover" else (k,))]
    mid = len(blocks) // 2 if "pair-cover" not in cheats else (len(blocks) - 1) // 2
    cheated = {(mid + i) % len(blocks): kind for i, kind in enumerate(cheats)}
    port = iter(range(args.base_port, args.base_port + swarm_ports(args.swarm)))
    neurons = [Neuron("validator", "validator", make_wallet(wallet_dir, "validator"))]
    layers = [f"{a}-{b - 1}" for a, b in blocks]
    for i, block in enumerate(layers):
        cheat = cheated.get(i, "")
        neurons.append(Neuron(f"stage{i}", "stage", make_wallet(wallet_dir, f"stage{i}"), port=next(port),
                              kind=f"layers {block}" + (f" cheat: {cheat}" if cheat else ""), layers=block,
                              cheat=cheat))
    spares = []
    # a soak kills and cuts stages at random: every block gets a spare so that a route stays open meanwhile
    for j, i in enumerate(sorted(cheated) or (list(range(len(blocks))) if args.soak else [mid])):
        name = "spare" if j == 0 else f"spare{j}"
        spares.append(Neuron(name, "stage", make_wallet(wallet_dir, name), port=next(port),
                             kind=f"layers {layers[i]} (spare)", layers=layers[i]))
    neurons += spares
    if args.cheat_stage:
        honest = [n for n in neurons[1:] if n.role == "stage" and not n.cheat and n.name.startswith("stage")]
        bf16 = honest[-1] if honest else spares[-1]
        bf16.dtype, bf16.kind = "bfloat16", bf16.kind + " bf16"
    driver_cheat = next((k for k in args.cheat_stage or [] if k in DRIVER_CHEATS), "")
    neurons.append(Neuron("route", "miner", make_wallet(wallet_dir, "route"), port=next(port),
                          kind="route" + (f" cheat: {driver_cheat}" if driver_cheat else ""), cheat=driver_cheat))
    neurons[0].port = next(port)  # the validator's route work endpoint
    neurons[0].gateway_port = next(port)  # and its organic gateway
    for n in neurons:
        if n.cheat == "forwarder":  # the validator serves a decoy of its block (not announced on chain)
            n.decoy_port = next(port)
    return neurons


def swarm_ports(n: int) -> int:
    """Ports --swarm N takes from --base-port: N stages, N spares at most, the route miner, the validator's work
    endpoint and gateway, and one decoy per block at most."""
    return 3 * n + 3


def stage_command(n: Neuron, args, chain_spec: str, netuid: int, run_dir: Path, neurons: list[Neuron],
                  extra: list[str] = ()) -> list[str]:
    """An honest stage miner (neurons.stage_miner), or a cheating one (localnet.cheats.stage: the same
    stage server and announcement, a dishonest block)."""
    common = ["--network", chain_spec, "--netuid", str(netuid), "--wallet-path", str(Path(n.wallet.path)),
              "--port", str(n.port), "--threads", "1", "--ready-file", str(run_dir / f"{n.name}.ready")]
    if n.cheat:
        cmd = [sys.executable, "-m", "localnet.cheats.stage", "--checkpoint", str(checkpoint_dir(args)),
               "--stage", f"{n.name}:{n.cheat}:{n.layers}", *common]
        if n.cheat == "driver-aware":  # honest for the validator's own sessions only
            cmd += ["--watched", next(v.wallet.hotkey.ss58_address for v in neurons if v.role == "validator")]
        if n.cheat == "pair-cover":  # it computes its partner's block (the one before) too
            partner = next(s for s in neurons if s.cheat == "pair-cover-echo")
            cmd += ["--cover", partner.layers.split("-")[0]]
        if n.cheat == "forwarder":  # it hands its sessions to the other stages of its block: the honest spare and
            # the validator's decoy (found by the forwarder itself, as a forwarder would find other stages)
            cmd += [a for s in neurons if s.role == "stage" and s.layers == n.layers and not s.cheat
                    for a in ("--forward-to", f"http://127.0.0.1:{s.port}")]
            cmd += ["--forward-to", f"http://127.0.0.1:{n.decoy_port}"]
        return cmd + list(extra)
    return [sys.executable, "-m", "neurons.stage_miner", "--checkpoint", str(checkpoint_dir(args)),
            "--serve-layers", n.layers, "--wallet-name", n.wallet.name, "--wallet-hotkey", "default",
            "--host", "127.0.0.1", "--dtype", n.dtype, "--wire-dtype", n.dtype, *common, *extra]


def route_command(n: Neuron, args, chain_spec: str, netuid: int, run_dir: Path, validator: Neuron) -> list[str]:
    """The route miner; it follows the local validator's trust (stages blamed in its store are left out) and
    submits the receipts of its routes to the validator's work endpoint, which credits the stages. With
    --cheat-stage forge-receipts it also claims receipts the stages never signed (localnet.cheats.route)."""
    module = ["localnet.cheats.route", "--cheat", n.cheat] if n.cheat else ["neurons.route_miner"]
    return [sys.executable, "-m", *module, "--network", chain_spec, "--netuid", str(netuid),
            "--checkpoint", str(checkpoint_dir(args)),
            "--wallet-name", n.wallet.name, "--wallet-hotkey", "default", "--wallet-path", str(Path(n.wallet.path)),
            "--host", "127.0.0.1", "--port", str(n.port), "--nonce-store", str(run_dir / "route-nonces.sqlite"),
            "--min-validator-stake", str(MINER_MIN_VALIDATOR_STAKE), "--refresh-s", str(ROUTE_REFRESH_S),
            "--trust-db", str(run_dir / "validator.sqlite"), "--route-log", str(run_dir / ROUTE_LOG),
            "--ready-file", str(run_dir / f"{n.name}.ready"),
            "--report-work", f"{validator.wallet.hotkey.ss58_address}@http://127.0.0.1:{validator.port}",
            "--report-work-s", str(REPORT_WORK_S)]


REPORT_WORK_S = 2.0  # how often the route miner submits its receipts to the validator
ROUTE_LOG = "routes.jsonl"  # the route miner's log of every route it plans


GATEWAY_ROUTE_LOG = "gateway-routes.jsonl"  # the validator's gateway route's log of every route it plans
GATEWAY_KEY = "sk-localnet-organic-0123456789"  # the organic traffic's API key (RUN_DIR/gateway-keys.txt)


def planned_routes(run_dir: Path, log: str = ROUTE_LOG) -> list[dict]:
    """Every route the route miner (or with log=GATEWAY_ROUTE_LOG the validator's gateway route) planned so far:
    [{at, route: [stage hotkeys]}]."""
    path = run_dir / log
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip().endswith("}")]


DECOY_HOTKEY = "decoy"  # the hotkey of the validator's wallet its decoys sign as


def swarm_validator_command(n: Neuron, args, chain_spec: str, netuid: int, run_dir: Path,
                            neurons: list[Neuron]) -> list[str]:
    """The validator, checking the stage miners (--stage-sessions sessions per round through them, each checked
    after it ran against its own copy of the weights), serving a decoy of each forwarder's block, crediting the route miner's receipts (its work
    endpoint on its port), checking the route miner as a whole-model miner, and serving organic requests on its
    gateway (its gateway_port, key GATEWAY_KEY) through its own route of the stages (--gateway-route first: it
    re-reads the stages and its blames every ROUTE_REFRESH_S and logs each route to RUN_DIR/GATEWAY_ROUTE_LOG),
    whose work it audits and credits to the stages."""
    keys = run_dir / "gateway-keys.txt"
    keys.write_text(GATEWAY_KEY + "\n")
    if any(s.decoy_port for s in neurons):
        decoy = bt.Wallet(name=n.wallet.name, hotkey=DECOY_HOTKEY, path=str(Path(n.wallet.path)))
        if not decoy.hotkey_file.exists_on_device():
            decoy.create_new_hotkey(use_password=False, suppress=True)
    decoys = [f"{s.layers}:{s.decoy_port}" for s in neurons if s.decoy_port]
    flags = ["--stage-decoys", ",".join(decoys), "--stage-decoy-hotkey", DECOY_HOTKEY] if decoys else []
    return validator_command(n, args, chain_spec, netuid, run_dir) + flags + [
        "--stage-sessions", str(args.stage_sessions), "--canaries", "0", "--stage-work-port", str(n.port),
        # nothing to submit before the first stage checks land: hold a few seconds, not the default two minutes
        "--weights-retry-max-s", "4",
        # the route miner takes 8 streams per caller: leave room beside the validator's own requests to it for the
        # gateway's (signed by the same hotkey) should the gateway fail over to it
        "--miner-concurrency", "4",
        "--gateway", "--gateway-port", str(n.gateway_port), "--gateway-api-keys", str(keys),
        "--gateway-rate-limit", "100000", "--gateway-route", "first", "--gateway-route-refresh-s", str(ROUTE_REFRESH_S),
        "--gateway-route-log", str(run_dir / GATEWAY_ROUTE_LOG)]


def wait_ready(neurons: list[Neuron], run_dir: Path, timeout_s: float = 180.0) -> dict[str, dict]:
    """What each process wrote to RUN_DIR/NAME.ready once it served (a SystemExit naming one that died)."""
    deadline = time.monotonic() + timeout_s
    info: dict[str, dict] = {}
    while len(info) < len(neurons):
        for n in neurons:
            path = run_dir / f"{n.name}.ready"
            if n.name not in info and path.exists():
                info[n.name] = json.loads(path.read_text())
            elif n.process.poll() is not None:
                raise SystemExit(f"[localnet] {n.name} exited at start (code {n.process.returncode}); see {n.log}")
        if time.monotonic() > deadline:
            missing = ", ".join(n.name for n in neurons if n.name not in info)
            raise SystemExit(f"[localnet] not serving after {timeout_s:.0f} s: {missing}")
        time.sleep(0.2)
    return info


def reference_greedy(checkpoint: Path, prompt: list[int], n: int) -> list[int]:
    """The single-process model's greedy tokens (the whole checkpoint in this process)."""
    import torch  # noqa: PLC0415

    from inference.serving.builders import load_reference_model  # noqa: PLC0415

    model, _, _ = load_reference_model(checkpoint, verify=False)
    cache = model.new_cache()
    with torch.no_grad():
        logits = model.forward([torch.tensor(prompt)], [cache])[0]
        out = []
        for _ in range(n):
            out.append(int(torch.argmax(logits)))
            logits = model.forward([torch.tensor([out[-1]])], [cache])[0]
    return out


async def swarm_completion(route: Neuron, url: str, caller, prompt: list[int], max_tokens: int,
                           client=None, request_id: str = "") -> dict:
    """One greedy completion through the route miner, signed by `caller` (the validator's hotkey); "route" is
    the route the miner planned for it (its capabilities right after)."""
    from protocol.client import MinerClient  # noqa: PLC0415
    from protocol.schemas import GenerateRequest  # noqa: PLC0415

    started = time.monotonic()
    async with contextlib.AsyncExitStack() as stack:
        if client is None:
            client = await stack.enter_async_context(MinerClient(caller))
        hotkey = route.wallet.hotkey.ss58_address
        result = await client.generate(url, hotkey, GenerateRequest(
            request_id=request_id or f"swarm-{time.time_ns()}", prompt_token_ids=prompt, max_tokens=max_tokens,
            temperature=0.0))
        caps = await client.capabilities(url, hotkey)
    return {"tokens": list(result.token_ids), "seconds": time.monotonic() - started,
            "route": (caps.layout or {}).get("route", [])}


async def wait_gateway(url: str, validator: Neuron, timeout_s: float = 180.0) -> None:
    """Until the validator's gateway answers GET /health (a SystemExit when the validator died or it never does)."""
    import aiohttp  # noqa: PLC0415

    deadline = time.monotonic() + timeout_s
    async with aiohttp.ClientSession() as http:
        while True:
            with contextlib.suppress(aiohttp.ClientError, asyncio.TimeoutError):
                async with http.get(url + "/health", timeout=aiohttp.ClientTimeout(total=2.0)) as resp:
                    if resp.status == 200:
                        return
            if validator.process.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"[localnet] the validator's gateway {url} is not serving; see {validator.log}")
            await asyncio.sleep(0.5)


GATEWAY_ROUTE_UID = "-1"  # the gateway's x-k3-miner-uid for an answer of its own route (neurons.validator_app.gateway_route)


async def organic_traffic(gateway_url: str, stop: threading.Event, sent: list[dict], run_dir: Path,
                          pause_s: float = 1.0, timeout_s: float = 60.0) -> None:
    """Organic requests through the validator's organic gateway (a user's greedy /v1/completions with its API key),
    one after another until `stop`: each appended to `sent` as {at, ok, seconds, miner_uid, route | error};
    miner_uid: the gateway's x-k3-miner-uid (GATEWAY_ROUTE_UID: its own route served it); route: the stage
    hotkeys of the last route that route (or, had the gateway failed over to the route miner, the route miner)
    planned before the answer came back."""
    import aiohttp  # noqa: PLC0415

    async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {GATEWAY_KEY}"}) as http:
        i = 0
        while not stop.is_set():
            entry = {"at": time.time(), "ok": False}
            body = {"model": "kimi-k3", "prompt": f"def f{i}(x):\n    return x * {i % 7}", "max_tokens": 4,
                    "temperature": 0.0}
            try:
                async with http.post(gateway_url + "/v1/completions", json=body,
                                     timeout=aiohttp.ClientTimeout(total=timeout_s)) as resp:
                    answer = await resp.json(content_type=None)
                    uid = resp.headers.get("x-k3-miner-uid", "")
                if resp.status != 200 or not answer.get("choices"):
                    raise RuntimeError(f"HTTP {resp.status}: {json.dumps(answer)[:200]}")
                log = GATEWAY_ROUTE_LOG if uid == GATEWAY_ROUTE_UID else ROUTE_LOG
                routes = [r for r in planned_routes(run_dir, log) if r["at"] <= time.time()]
                entry.update(ok=True, seconds=time.time() - entry["at"], miner_uid=uid,
                             route=routes[-1]["route"] if routes else [])
            except Exception as exc:  # noqa: BLE001 (any failure of an organic request is what we record)
                entry.update(seconds=time.time() - entry["at"], error=f"{type(exc).__name__}: {exc}"[:300])
            sent.append(entry)
            i += 1
            await asyncio.to_thread(stop.wait, pause_s)


class OrganicTraffic:
    """`organic_traffic` in a thread of its own from the moment the validator's gateway serves (`start()`) until
    `stop()`, so that users are served while the validator's first rounds catch cheaters; `sent` is its
    records."""

    def __init__(self, gateway_url: str, validator: Neuron, run_dir: Path):
        self.gateway_url, self.validator, self.run_dir = gateway_url, validator, run_dir
        self.sent: list[dict] = []
        self.error = ""  # why the traffic never started (the gateway did not come up)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="organic-traffic", daemon=True)

    def _run(self) -> None:
        async def go():
            await wait_gateway(self.gateway_url, self.validator)
            await organic_traffic(self.gateway_url, self._stop, self.sent, self.run_dir)

        try:
            asyncio.run(go())
        except SystemExit as exc:
            self.error = str(exc)

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout_s: float = 70.0) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout_s)


def read_validator(run_dir: Path) -> dict:
    """The validator's view from its store: `validator.py status`'s report, every stage check (not the credited
    work, most of the table: read every 2 s for an hour, it would be the dashboard's whole cost) and the route work
    credited per stage and per driver (empty while the store does not exist yet)."""
    from neurons.validator_app.status import status_report  # noqa: PLC0415
    from neurons.validator_app.store import WORK_KINDS, ValidatorStore  # noqa: PLC0415

    db = run_dir / "validator.sqlite"
    if not db.exists():
        return {}
    try:
        with ValidatorStore(db, readonly=True) as store:
            return {"status": status_report(store), "checks": [dict(r) for r in store.stage_checks(without=WORK_KINDS)],
                    "route_work": {who: t.tokens.get("route_work", 0)
                                   for who, t in store.stage_totals(0.0, ["route_work"], ()).items()},
                    "route_work_by_driver": {who: t.tokens.get("route_work", 0) for who, t in
                                             store.stage_totals(0.0, ["route_work"], (), by="origin").items()}}
    except Exception:  # noqa: BLE001 (the validator may be creating or migrating it right now)
        return {}


SESSION_CHECKS = ("session_check", "session_lie")  # a stage's sessions checked after the fact


def blame_timeline(checks: list[dict], hotkey: str) -> dict:
    """For one stage: its checks until the first blame: sessions checked (and rows of every kind) up to and
    including the blaming one, seconds from the start of its first row, and the reason."""
    mine = [c for c in checks if c["hotkey"] == hotkey]
    first = next((c for c in mine if c["blame"]), None)
    if first is None:
        return {"blamed": False, "sessions": sum(1 for c in mine if c["kind"] in SESSION_CHECKS), "checks": len(mine)}
    before = [c for c in mine if c["id"] <= first["id"]]
    begun = min(c["at"] - (c["wall_s"] or 0.0) for c in before)
    return {"blamed": True, "sessions": sum(1 for c in before if c["kind"] in SESSION_CHECKS), "checks": len(before),
            "seconds": first["at"] - begun, "at": first["at"], "kind": first["kind"],
            "reason": f"{first['kind']}: {first['reason']}"}


async def stage_health(url: str, timeout_s: float = 2.0) -> dict:
    """A stage's own counters (GET /stage/health: tokens computed, sessions, step time); {} when unreachable."""
    import aiohttp  # noqa: PLC0415

    try:
        async with aiohttp.ClientSession() as http:
            async with http.get(url.rstrip("/") + "/stage/health", timeout=aiohttp.ClientTimeout(total=timeout_s)) as r:
                return await r.json() if r.status == 200 else {}
    except Exception:  # noqa: BLE001 (a stopped stage)
        return {}


async def swarm_stages(chain, netuid: int, stages: list[Neuron], ready: dict[str, dict], run_dir: Path,
                       view: dict | None = None) -> list[dict]:
    """Every stage miner as the chain, its process and the validator see it: uid, layers, kind, what it
    announced, step time, tokens it computed, the layer-tokens the validator credited, sessions checked (and how many
    lay outside the honest envelope), weight, and for a blamed stage the reason (and its blame timeline)."""
    meta, commitments = await chain.metagraph(netuid), await chain.commitments(netuid)
    view = read_validator(run_dir) if view is None else view
    by_hotkey = {s["hotkey"]: s for s in (view.get("status") or {}).get("stage_miners", [])}
    health = await asyncio.gather(*(stage_health(ready[n.name]["url"]) for n in stages))
    rows = []
    for n, h in zip(stages, health):
        hotkey = n.wallet.hotkey.ss58_address
        info, r, v = meta.by_hotkey(hotkey), ready[n.name], by_hotkey.get(hotkey, {})
        role = f"cheat: {n.cheat}" if n.cheat else \
            ("spare " if n.name.startswith("spare") else "") + ("bf16" if n.dtype == "bfloat16" else "fp32")
        rows.append({"name": n.name, "hotkey": hotkey, "uid": info.uid if info else None, "layers": r["layers"],
                     "kind": n.kind, "role": role, "cheat": n.cheat, "dtype": n.dtype, "url": r["url"],
                     "step_ms": v.get("step_ms") or r.get("step_ms") or 0.0, "fingerprint": r["fingerprint"],
                     "announced": commitments[hotkey].data if hotkey in commitments else None,
                     "alive": n.process is not None and n.process.poll() is None,
                     "tokens": h.get("tokens"), "verified_tokens": v.get("tokens", 0),
                     "route_work_tokens": view.get("route_work", {}).get(hotkey, 0),
                     "checked": v.get("checked", 0), "outside": v.get("outside", 0),
                     "weight": v.get("weight", 0.0), "blamed": v.get("blamed", False), "reason": v.get("reason"),
                     "blame": blame_timeline(view.get("checks", []), hotkey),
                     "incentive": info.incentive if info else 0.0})
    return rows


def swarm_driver(route: Neuron, view: dict) -> dict:
    """The route miner as a route driver: what it cheats, the stage work credited from its receipts, whether the
    validator blamed it (and why), and its weight (a whole-model miner's) in the weights set last."""
    hotkey = route.wallet.hotkey.ss58_address
    checks = view.get("checks", [])
    miner = next((m for m in (view.get("status") or {}).get("miners", []) if m["hotkey"] == hotkey), {})
    blame = blame_timeline(checks, hotkey)
    return {"name": route.name, "hotkey": hotkey, "cheat": route.cheat, "uid": miner.get("uid"),
            "weight": miner.get("weight", 0.0), "blamed": blame["blamed"], "reason": blame.get("reason"),
            "blame": blame, "credited_tokens": view.get("route_work_by_driver", {}).get(hotkey, 0)}


def swarm_table(stages: list[dict], route: list[dict], caption: str = "") -> Table:
    on_route = {r["hotkey"] for r in route}
    t = Table(title="k3-subnet swarm", caption=caption)
    for col in ("stage", "uid", "layers", "serves", "port", "step ms", "tokens", "credited", "route work", "checked",
                "on route", "up", "weight", "incentive", "zeroed because"):
        t.add_column(col, overflow="fold")
    for s in stages:
        reason = s.get("reason") or ""
        t.add_row(s["name"], str(s["uid"]), s["layers"], s.get("role", ""), s["url"].rsplit(":", 1)[-1],
                  f"{s['step_ms']:.1f}", str(s.get("tokens", "-")), str(s.get("verified_tokens", "-")),
                  str(s.get("route_work_tokens", "-")),
                  f"{s.get('checked', 0)} ({s.get('outside', 0)} outside)",
                  "yes" if s["hotkey"] in on_route else "-", "yes" if s["alive"] else "NO",
                  f"{s.get('weight', 0.0):.3f}" + (" BLAMED" if s.get("blamed") else ""), f"{s['incentive']:.3f}",
                  reason[:70])
    return t


MIN_ORGANIC = 3  # organic requests served before --stop-when-caught may stop
ROUTE_REFRESH_S = 2.0  # the route miner's --refresh-s: how often it re-reads the stages and the validator's trust
ROUTE_SETTLE_S = 2 * ROUTE_REFRESH_S + 1.0  # after a blame, every route the route miner plans avoids the stage


def caught_everyone(rows: list[dict], view: dict, organic: list[dict], driver: dict | None = None) -> bool:
    """Every cheating stage (and a cheating route driver) blamed and at weight 0 in weights set after its blame, no
    honest stage (nor an honest driver) blamed, every honest stage checked and paid in those weights (and an honest
    route driver paid: answers it served through a stage since blamed are excused),
    at least MIN_ORGANIC organic requests served by the gateway, one of them sent ROUTE_SETTLE_S after the last blame
    and served through the gateway's own route of unblamed stages."""
    parties = rows + ([driver] if driver else [])
    cheaters = [r for r in parties if r["cheat"]]
    status = view.get("status") or {}
    set_at = status.get("weights_set_at") or 0.0
    if not cheaters or any(r["blamed"] for r in parties if not r["cheat"]):
        return False
    if not all(r["blame"]["blamed"] and r["weight"] == 0.0 and set_at > r["blame"]["at"] for r in cheaters):
        return False
    if not all(r["checked"] >= 1 and r["verified_tokens"] > 0 and r["weight"] > 0 for r in rows if not r["cheat"]):
        return False
    if driver and not driver["cheat"] and driver.get("weight", 0.0) <= 0:
        return False
    last = max(r["blame"]["at"] for r in cheaters)
    blamed = {r["hotkey"] for r in rows if r["cheat"]}
    served = [o for o in organic if o["ok"]]
    # sent once the gateway's route has surely re-read the validator's blames: every route planned from then on
    # avoids the blamed stages (what a test of the run may check), and this one did
    return len(served) >= MIN_ORGANIC and any(o["at"] > last + ROUTE_SETTLE_S and not blamed & set(o["route"])
                                              and o["miner_uid"] == GATEWAY_ROUTE_UID for o in served)


async def watch_swarm(args, chain_spec: str, netuid: int, run_dir: Path, neurons: list[Neuron],
                      ready: dict[str, dict], traffic: OrganicTraffic | None = None, supervised: bool = False,
                      soak_traffic: SoakTraffic | None = None) -> dict:
    """The live swarm dashboard until --duration, Ctrl-C, a process dying (unless a soak restarts them) or
    (--stop-when-caught) every cheater caught; with --cheat-stage, organic requests go through the validator's
    gateway all along (with a soak, its users' requests are counted: `soak_traffic`)."""
    stages = [n for n in neurons if n.role == "stage" and n.name in ready]
    route = next(n for n in neurons if n.name == "route")
    console, started = Console(), time.monotonic()
    stop, organic = asyncio.Event(), traffic.sent if traffic else []
    loop = asyncio.get_running_loop()
    signalled = on_stop_signals(loop, stop)
    state: dict = {"caught": False, "rows": []}
    live = None if args.no_dashboard or not console.is_terminal else Live(console=console, refresh_per_second=1)
    if live:
        live.start()
    say = console.print if live else (lambda text: print(text, flush=True))  # a log's lines are never wrapped
    try:
        async with connect(chain_spec) as chain:
            while not stop.is_set():
                elapsed = time.monotonic() - started
                view = await asyncio.to_thread(read_validator, run_dir)
                try:
                    rows = await swarm_stages(chain, netuid, stages, ready, run_dir, view)
                except Exception as exc:  # noqa: BLE001 (a locked devnet database for a moment: keep the last view)
                    say(f"[localnet] dashboard refresh failed: {exc}")
                    rows = state["rows"]
                ok = sum(1 for o in organic if o["ok"])
                last_route = next((o["route"] for o in reversed(organic) if o["ok"]), [])
                names = {r["hotkey"]: r["name"] for r in rows}
                driver = swarm_driver(route, view)
                served, sent = (soak_traffic.served, soak_traffic.sent) if soak_traffic else (ok, len(organic))
                caption = (f"running {elapsed:.0f} s; organic requests (gateway) {served} served / {sent} sent; "
                           "last route "
                           + " > ".join(names.get(h, h[:8]) for h in last_route)
                           + f"; route driver ({driver['cheat'] or 'honest'}): {driver['credited_tokens']} "
                             f"layer-tokens credited from its receipts, weight {driver['weight']:.3f}"
                           + (f" BLAMED: {driver['reason'][:90]}" if driver["blamed"] else ""))
                state.update(rows=rows, driver=driver,
                             caught=caught_everyone(rows, view, organic, driver) if rows else False)
                if live:
                    live.update(swarm_table(rows, [{"hotkey": h} for h in last_route], caption))
                else:
                    say(caption + " | " + " | ".join(
                        f"{r['name']} w={r['weight']:.3f}{' BLAMED' if r['blamed'] else ''}" for r in rows))
                dead = [n.name for n in neurons if n.process and n.process.poll() is not None]
                if traffic is not None and traffic.error:
                    say(f"[localnet] no organic traffic: {traffic.error}")
                    break
                if dead and not supervised:
                    say(f"[localnet] stopped unexpectedly: {', '.join(dead)} (see {run_dir}/logs)")
                    break
                if args.stop_when_caught and state["caught"]:
                    say(f"[localnet] every cheater blamed and zeroed after {elapsed:.0f} s: stopping")
                    break
                if args.duration and elapsed >= args.duration:
                    break
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(stop.wait(), 2.0)
    finally:
        stop.set()
        if traffic is not None:
            await asyncio.to_thread(traffic.stop)
        if live:
            live.stop()
        off_stop_signals(loop, signalled)
    view = read_validator(run_dir)
    state.update(organic=organic, seconds=time.monotonic() - started, routes=planned_routes(run_dir),
                 gateway_routes=planned_routes(run_dir, GATEWAY_ROUTE_LOG),
                 driver=swarm_driver(route, view),
                 stage_check_cpu_s=[c["cpu_s"] for c in view.get("checks", [])
                                     if c["kind"] in SESSION_CHECKS and c["cpu_s"] is not None],
                 first_stage_check_at=min((c["at"] - (c["wall_s"] or 0.0) for c in view.get("checks", [])),
                                          default=None))
    return state


def run_swarm(args, run_dir: Path, t_launch: float, stage_flags: dict[str, list[str]] | None = None) -> int:
    """`--swarm N`: the devnet, N stage miners (+ spares, cheaters with --cheat-stage), the route miner and a
    validator; one completion through the route (compared with the single-process model when every stage is
    honest), then the dashboard. `stage_flags` adds command-line flags per stage miner, by name ("stage0", ...,
    "spare"). Returns the exit status: 1 when the honest route's answer differs from the model's, or with
    --stop-when-caught when the run ended before every cheater was caught."""
    stage_flags = stage_flags or {}
    log_dir = run_dir / "logs"
    ensure_checkpoints(args)
    neurons = swarm_neurons(args, run_dir / "wallets")
    miners = []
    if args.soak:  # whole-model miners beside the stages (one market), after the swarm's ports
        miners = miner_neurons(args, run_dir / "wallets", [f"miner{i}" for i in range(args.miners)],
                               args.base_port + swarm_ports(args.swarm))
        neurons[-1:-1] = miners
    with setup_progress(len(neurons) + 2) as step:
        chain_spec, netuid = asyncio.run(setup_devnet(run_dir, args, neurons, step))
    print(f"[localnet] chain {chain_spec}, netuid {netuid}")
    stages = [n for n in neurons if n.role == "stage"]
    route, validator = neurons[-1], neurons[0]
    summary: dict = {"chain": chain_spec, "netuid": netuid, "run_dir": str(run_dir),
                     "cheat_stages": list(args.cheat_stage or [])}
    status, traffic, soak = 0, None, None
    links = StageLinks() if args.soak else None  # each honest stage announced behind a link the soak can slow or cut
    try:
        for n in stages:
            flags = list(stage_flags.get(n.name, ()))
            if links is not None and not n.cheat:
                flags += ["--external-port", str(links.add(n.name, n.port))]
            start(n, stage_command(n, args, chain_spec, netuid, run_dir, neurons, flags), log_dir,
                  soak_env(args, run_dir, n))
        for i, n in enumerate(miners):
            start(n, miner_command(n, i, args, chain_spec, netuid, run_dir), log_dir, soak_env(args, run_dir, n))
        ready = wait_ready(stages, run_dir)
        wait_until_serving(miners)
        print(f"[localnet] {len(stages)} stage miners serving and announced on chain: "
              + ", ".join(f"{n.name} ({n.kind})" for n in stages)
              + (f"; whole-model miners {', '.join(n.name for n in miners)}" if miners else ""))
        start(route, route_command(route, args, chain_spec, netuid, run_dir, validator), log_dir,
              soak_env(args, run_dir, route))
        ready.update(wait_ready([route], run_dir))
        start(validator, swarm_validator_command(validator, args, chain_spec, netuid, run_dir, neurons)
              + (SOAK_VALIDATOR_FLAGS if args.soak else []), log_dir, soak_env(args, run_dir, validator))
        print(f"[localnet] route miner on {ready['route']['url']}, validator started (logs in {log_dir})")
        if args.cheat_stage and (args.duration or args.stop_when_caught):  # users from the moment its gateway serves
            traffic = OrganicTraffic(f"http://127.0.0.1:{validator.gateway_port}", validator, run_dir)
            traffic.start()
        done = asyncio.run(swarm_completion(route, ready["route"]["url"], validator.wallet.hotkey, SWARM_PROMPT,
                                            args.swarm_tokens))
        want = reference_greedy(checkpoint_dir(args), SWARM_PROMPT, args.swarm_tokens)
        done.update(reference=want, match=done["tokens"] == want, route=done["route"] or ready["route"]["route"])
        print(f"[localnet] completion through {len(done['route'])} stages in {done['seconds']:.2f} s: "
              f"{done['tokens']} ({'equals' if done['match'] else 'DIFFERS FROM'} the single-process model's {want})")
        if not args.cheat_stage:  # with cheaters (and a bf16 stage) on the route the answer may differ
            status = 0 if done["match"] else 1
        summary["completion"] = done
        if args.soak:
            soak = start_soak(args, run_dir, neurons, chain_spec, netuid, links,
                              soak_joiner(args, run_dir, neurons, chain_spec, netuid))
        if args.duration or args.stop_when_caught:
            watched = asyncio.run(watch_swarm(args, chain_spec, netuid, run_dir, neurons, ready, traffic,
                                              supervised=soak is not None,
                                              soak_traffic=soak.traffic if soak is not None else None))
            summary.update(caught=watched["caught"], organic=watched["organic"], watch_s=watched["seconds"],
                           routes=watched["routes"], gateway_routes=watched["gateway_routes"],
                           driver=watched["driver"],
                           stage_check_cpu_s=watched["stage_check_cpu_s"],
                           first_stage_check_at=watched["first_stage_check_at"])
            if args.stop_when_caught and not watched["caught"]:
                print("[localnet] the run ended before every cheating stage was blamed and zeroed")
                status = 1

        async def final():
            async with connect(chain_spec) as chain:
                return await swarm_stages(chain, netuid, stages, ready, run_dir)

        summary["stages"] = asyncio.run(final())
        Console(width=None if sys.stdout.isatty() else 200).print(swarm_table(summary["stages"], done["route"]))
    finally:
        shutting_down()
        if traffic is not None:
            traffic.stop()
        if soak is not None:
            soak.stop()
        if links is not None:
            links.stop()
        print("[localnet] stopping every process it started")
        stop_all(neurons)
    if args.summary:
        args.summary.write_text(json.dumps(summary, indent=2, default=str))
    return soak_report(run_dir) if soak is not None else status


def soak_joiner(args, run_dir: Path, neurons: list[Neuron], chain_spec: str, netuid: int):
    """The soak's stage-join: a new stage miner for the block of one that left, registered on the devnet, started
    (it announces itself) and added to `neurons` (stopped with them)."""
    def join_stage(name: str, left: str) -> Party:
        old = next(n for n in neurons if n.name == left)
        n = Neuron(name, "stage", make_wallet(run_dir / "wallets", name), port=free_port_block(1),
                   kind=f"layers {old.layers} (joined)", layers=old.layers)

        async def register():
            async with connect(chain_spec) as chain:
                await chain.register(n.wallet, netuid)

        asyncio.run(register())
        start(n, stage_command(n, args, chain_spec, netuid, run_dir, neurons), run_dir / "logs",
              soak_env(args, run_dir, n))
        neurons.append(n)
        return soak_party(n, run_dir)

    return join_stage


if __name__ == "__main__":
    sys.exit(main())
