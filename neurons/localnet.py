"""The whole subnet on one machine: a chain, miners (one sharded, one cheating), a validator, a dashboard.

    scripts/localnet.sh                          # devnet, 3 miners, 1 validator, until Ctrl-C
    k3-localnet --run-dir /tmp/k3-run            # the same from an installed package (pip install k3-subnet)
    scripts/localnet.sh --duration 300 --miners 4 --cheat buffer
    scripts/localnet.sh --network local --netuid 2 --wallet-path ~/.bittensor/wallets \\
        --validator-wallet val --miner-wallets m1,m2,m3     # a real subtensor node (wallets registered with btcli)

With the embedded devnet (the default) it creates, in a fresh run directory: the tiny checkpoint (once, in
--checkpoints, default ./checkpoints), a devnet with one subnet, wallets without passwords, registrations and stake; then it starts
the miners (miner 0 single-process, miner 1 sharded over 2 processes, the last one cheating) and the
validator as separate processes, and shows a live dashboard. Logs of every process are in RUN_DIR/logs.
Ctrl-C or the end of --duration stops everything it started (whole process groups, shards included).
`--summary FILE` writes what happened (weights, incentive, failures) as JSON at the end.

`--swarm N` (devnet) runs the tiny model as a swarm instead (`run_swarm`): N stage miners holding its layers in
blocks cut at Attention Residuals block boundaries, one spare for the middle block, a route miner (a route driver
behind the signed miner protocol, finding the stages from the chain), and a validator; it serves one greedy
completion through the route, checks it against the single-process model, shows the stages and the route, and
then runs until --duration ends or Ctrl-C. Each stage miner announces its layer block on chain itself.

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
import os
import signal
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass
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

CHEATS = ("inflate", "buffer", "truncate", "weights", "none")
# The directory holding the packages: a checkout (with pyproject.toml) or site-packages.
PACKAGE_ROOT = Path(__file__).resolve().parents[1]
VALIDATOR_STAKE = 10_000.0
MINER_MIN_VALIDATOR_STAKE = 1_000.0


@dataclass
class Neuron:
    name: str
    role: str  # "miner" | "validator"
    wallet: bt.Wallet
    port: int = 0
    kind: str = ""  # what the dashboard shows: reference, sharded x2, cheat: ...
    process: subprocess.Popen | None = None
    log: Path | None = None


def parse_args(argv=None, prog: str = "k3-localnet") -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog=prog, description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--miners", type=int, default=3, help="number of miners (>= 2; the last one cheats)")
    ap.add_argument("--sharded-miners", type=int, default=1,
                    help="how many miners (after the first) run sharded over 2 processes")
    ap.add_argument("--cheat", choices=CHEATS, default="inflate",
                    help="how the last miner cheats: inflate usage counts, buffer its stream, truncate prompts to "
                         "their last 512 tokens, serve different weights, or none (all honest)")
    ap.add_argument("--duration", type=float, default=0.0, help="seconds to run (0 = until Ctrl-C)")
    ap.add_argument("--base-port", type=int, default=18091, help="miners listen on base, base+1, ...")
    ap.add_argument("--metrics-base-port", type=int, default=19091, help="miners' local metrics ports")
    ap.add_argument("--run-dir", type=Path, default=None, help="default: ./runs/localnet-<time>")
    ap.add_argument("--checkpoints", type=Path, default=Path("checkpoints"),
                    help="where the tiny checkpoints are made once and kept (default: ./checkpoints)")
    ap.add_argument("--network", "-n", "--subtensor.network", "--subtensor.chain_endpoint", dest="chain",
                    default="devnet", help="devnet (embedded), or a subtensor node as btcli names one: local, "
                                           "test, finney, ws://HOST:PORT")
    ap.add_argument("--chain", dest="chain", action=DeprecatedFlag, new="--network", help=argparse.SUPPRESS)
    ap.add_argument("--netuid", type=int, default=None, help="subnet on a real node (devnet: created)")
    ap.add_argument("--wallet-path", "--wallet.path", type=Path, default=None,
                    help="real node: where the registered wallets are")
    ap.add_argument("--validator-wallet", default="validator", help="real node: validator wallet name")
    ap.add_argument("--miner-wallets", default="", help="real node: comma-separated miner wallet names")
    ap.add_argument("--block-interval", type=float, default=0.5, help="devnet seconds per block")
    ap.add_argument("--tempo", type=int, default=60, help="devnet blocks per epoch")
    ap.add_argument("--round-interval", type=float, default=10.0, help="validator seconds between rounds")
    ap.add_argument("--no-dashboard", action="store_true", help="print one status line per refresh instead")
    ap.add_argument("--summary", type=Path, default=None, help="write a JSON summary here at the end")
    ap.add_argument("--setup-only", action="store_true",
                    help="devnet: create the chain, wallets, registrations and stake in --run-dir, write "
                         "localnet.json there and exit (nothing is started)")
    ap.add_argument("--stop-after-epochs", type=int, default=0,
                    help="devnet: stop once this many epochs have run after the validator's first weights (0 = no)")
    ap.add_argument("--swarm", type=int, default=0, metavar="N",
                    help="devnet: serve the tiny model as a swarm of N stage miners (plus a spare and a route miner)")
    ap.add_argument("--swarm-tokens", type=int, default=8, help="--swarm: tokens of the completion served")
    args = ap.parse_args(argv)
    if args.swarm and (args.chain != "devnet" or args.setup_only or args.swarm < 2):
        ap.error("--swarm N runs on the embedded devnet (no --network, no --setup-only) with N >= 2")
    if args.miners < 2:
        ap.error("--miners must be at least 2 (one honest, one cheating)")
    if args.chain != "devnet" and (args.netuid is None or args.wallet_path is None or not args.miner_wallets):
        ap.error("with a real node, give --netuid, --wallet-path and --miner-wallets (wallets registered with btcli)")
    if args.setup_only and (args.chain != "devnet" or args.run_dir is None):
        ap.error("--setup-only sets up the embedded devnet: give --run-dir and no --network")
    args.checkpoints = args.checkpoints.expanduser().resolve()
    if args.run_dir is not None:
        args.run_dir = args.run_dir.expanduser().resolve()
    return args


# ------------------------------------------------------------------ setup
def checkpoint_dir(args, cheat_weights: bool = False) -> Path:
    """The tiny checkpoint, or for the "different weights" cheat the same model with another seed."""
    return args.checkpoints / ("tiny-seed1" if cheat_weights else "tiny")


def ensure_checkpoints(args) -> None:
    honest = checkpoint_dir(args)
    if not (honest / "config.json").exists():
        print(f"[localnet] making the tiny checkpoint in {honest}")
        make_random_checkpoint(ModelConfig.tiny(), honest, seed=0, progress=True)
    cheat = checkpoint_dir(args, cheat_weights=True)
    if args.cheat == "weights" and not (cheat / "config.json").exists():
        make_random_checkpoint(ModelConfig.tiny(), cheat, seed=1, progress=True)


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
    """A rich progress bar over the setup steps (on stderr); yields step(what)."""
    columns = (SpinnerColumn(), TextColumn("[localnet] {task.description}"), BarColumn(), MofNCompleteColumn(),
               TimeElapsedColumn())
    with Progress(*columns, console=Console(stderr=True)) as progress:
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
    module = "neurons.miner_app.cheats" if cheat else "neurons.miner"
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
    if cheat and cheat != "weights":
        cmd += ["--cheat", cheat]
    elif cheat == "weights":
        cmd += ["--cheat", "none"]
    return cmd


def validator_command(n: Neuron, args, chain_spec: str, netuid: int, run_dir: Path) -> list[str]:
    return [sys.executable, "-m", "neurons.validator", "run",
            "--network", chain_spec, "--netuid", str(netuid),
            "--wallet-name", n.wallet.name, "--wallet-hotkey", "default", "--wallet-path", str(Path(n.wallet.path)),
            "--checkpoint", str(checkpoint_dir(args)), "--reference-engine",
            "--db", str(run_dir / "validator.sqlite"),
            "--scoring-profile", "local_testnet", "--round-interval-s", str(args.round_interval),
            "--weights-check-s", "2", "--canaries", "8", "--miners-at-once", "1", "--metagraph-refresh-s", "5"]


def start(n: Neuron, cmd: list[str], log_dir: Path) -> None:
    n.log = log_dir / f"{n.name}.log"
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    if (PACKAGE_ROOT / "pyproject.toml").exists():  # a checkout: `python -m neurons...` imports it from any directory
        env["PYTHONPATH"] = os.pathsep.join([str(PACKAGE_ROOT), *filter(None, env.get("PYTHONPATH", "").split(os.pathsep))])
    with open(n.log, "w") as log:
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
    from neurons.validator_app import status_report
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


async def watch(args, chain_spec: str, netuid: int, run_dir: Path, neurons: list[Neuron], t_launch: float) -> dict:
    chain = connect(chain_spec)
    started = time.monotonic()
    first_weights = None
    console = Console()
    state = await snapshot(chain, netuid, run_dir, neurons)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    live = None if args.no_dashboard else Live(render(state, started), console=console, refresh_per_second=1)
    if live:
        live.start()
    try:
        while not stop.is_set():
            if args.duration and time.monotonic() - started >= args.duration:
                break
            dead = [n.name for n in neurons if n.process and n.process.poll() is not None]
            if dead:
                console.print(f"[localnet] stopped unexpectedly: {', '.join(dead)} (see {run_dir}/logs)")
                break
            try:
                await asyncio.wait_for(stop.wait(), timeout=2.0)
            except asyncio.TimeoutError:
                pass
            try:
                state = await snapshot(chain, netuid, run_dir, neurons)
            except Exception as exc:  # a locked database for a moment: keep the last view
                console.print(f"[localnet] dashboard refresh failed: {exc}")
            if state.get("weights_row") and first_weights is None:
                first_weights = {"block": state["validator_last_update"], "elapsed_s": time.monotonic() - t_launch,
                                 "row": state["weights_row"]}
                console.print(f"[localnet] first weights on chain at block {first_weights['block']}, "
                              f"{first_weights['elapsed_s']:.0f} s after start: {first_weights['row']}")
            if first_weights is not None and isinstance(chain, DevnetChain):
                epochs = await chain.epoch_history(netuid, limit=None, since_block=first_weights["block"])
                state["epochs_after_weights"] = [
                    {"block": e.block, "incentive": {str(n.uid): n.incentive for n in e.neurons}} for e in epochs]
                if args.stop_after_epochs and len(epochs) >= args.stop_after_epochs:
                    console.print(f"[localnet] {len(epochs)} epoch(s) after the first weights: stopping")
                    break
            if live:
                live.update(render(state, started))
            else:
                line = " | ".join(f"{r['name']} w={r['validator'].get('weight')} inc={r['incentive']:.3f}"
                                  for r in state["rows"] if r["role"] == "miner")
                console.print(f"block {state['block']}: {line}")
    finally:
        if live:
            live.stop()
        await chain.close()
    state["first_weights"] = first_weights
    return state


def main(argv=None, prog: str = "k3-localnet") -> int:
    args = parse_args(argv, prog)
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
    for i, name in enumerate(names):
        cheat = i == len(names) - 1 and args.cheat != "none"
        kind = f"cheat: {args.cheat}" if cheat else ("sharded x2" if 1 <= i <= args.sharded_miners else "reference")
        wallet = make_wallet(wallet_dir, name) if args.chain == "devnet" else bt.Wallet(name, "default", path=str(wallet_dir))
        neurons.append(Neuron(name, "miner", wallet, port=args.base_port + i, kind=kind))

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
    miners = []
    try:
        miners = [n for n in neurons if n.role == "miner"]
        for i, n in enumerate(miners):
            start(n, miner_command(n, i, args, chain_spec, netuid, run_dir), log_dir)
            print(f"[localnet] {n.name} ({n.kind}) on 127.0.0.1:{n.port}, log {n.log}")
        wait_until_serving(miners)
        validator = neurons[0]
        start(validator, validator_command(validator, args, chain_spec, netuid, run_dir), log_dir)
        print(f"[localnet] validator started, log {validator.log}")
        state = asyncio.run(watch(args, chain_spec, netuid, run_dir, neurons, t_launch))
    finally:
        print("[localnet] stopping every process it started")
        stop_all(neurons)
    if args.summary:
        args.summary.write_text(json.dumps({"chain": chain_spec, "netuid": netuid, "run_dir": str(run_dir),
                                            **state}, indent=2, default=str))
    return 0



# ------------------------------------------------------------------ the swarm
SWARM_PROMPT = [(11 * j + 5) % 256 for j in range(21)]


def swarm_neurons(args, wallet_dir: Path) -> list[Neuron]:
    """The validator, stage0..stage{N-1} (kind "layers A-B"), a spare for the middle block, and the route miner."""
    from inference.planning.swarm_plan import stage_blocks  # noqa: PLC0415

    config = ModelConfig.tiny()
    blocks = stage_blocks(config.num_layers, config.attn_res_block_size, args.swarm)
    port = iter(range(args.base_port, args.base_port + args.swarm + 2))
    neurons = [Neuron("validator", "validator", make_wallet(wallet_dir, "validator"))]
    for i, (a, b) in enumerate(blocks):
        neurons.append(Neuron(f"stage{i}", "stage", make_wallet(wallet_dir, f"stage{i}"), port=next(port),
                              kind=f"layers {a}-{b - 1}"))
    spare = neurons[1 + len(blocks) // 2]
    neurons.append(Neuron("spare", "stage", make_wallet(wallet_dir, "spare"), port=next(port),
                          kind=spare.kind + " (spare)"))
    neurons.append(Neuron("route", "miner", make_wallet(wallet_dir, "route"), port=next(port), kind="route"))
    return neurons


def stage_command(n: Neuron, args, chain_spec: str, netuid: int, run_dir: Path, extra: list[str]) -> list[str]:
    layers = n.kind.split()[1]
    return [sys.executable, "-m", "neurons.swarm.stage_miner", "--checkpoint", str(checkpoint_dir(args)),
            "--serve-layers", layers, "--network", chain_spec, "--netuid", str(netuid),
            "--wallet-name", n.wallet.name, "--wallet-hotkey", "default", "--wallet-path", str(Path(n.wallet.path)),
            "--host", "127.0.0.1", "--port", str(n.port), "--threads", "1",
            "--ready-file", str(run_dir / f"{n.name}.ready"), *extra]


def route_command(n: Neuron, args, chain_spec: str, netuid: int, run_dir: Path) -> list[str]:
    return [sys.executable, "-m", "neurons.swarm.route_miner", "--network", chain_spec, "--netuid", str(netuid),
            "--checkpoint", str(checkpoint_dir(args)),
            "--wallet-name", n.wallet.name, "--wallet-hotkey", "default", "--wallet-path", str(Path(n.wallet.path)),
            "--host", "127.0.0.1", "--port", str(n.port), "--nonce-store", str(run_dir / "route-nonces.sqlite"),
            "--min-validator-stake", str(MINER_MIN_VALIDATOR_STAKE), "--refresh-s", "5",
            "--ready-file", str(run_dir / f"{n.name}.ready")]


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


async def swarm_completion(route: Neuron, url: str, caller, prompt: list[int], max_tokens: int) -> dict:
    """One greedy completion through the route miner, signed by `caller` (the validator's hotkey)."""
    from protocol.client import MinerClient  # noqa: PLC0415
    from protocol.schemas import GenerateRequest  # noqa: PLC0415

    started = time.monotonic()
    async with MinerClient(caller) as client:
        caps = await client.capabilities(url, route.wallet.hotkey.ss58_address)
        result = await client.generate(url, route.wallet.hotkey.ss58_address, GenerateRequest(
            request_id=f"swarm-{int(time.time())}", prompt_token_ids=prompt, max_tokens=max_tokens, temperature=0.0))
    return {"tokens": list(result.token_ids), "seconds": time.monotonic() - started,
            "route": (caps.layout or {}).get("route", [])}


def swarm_table(stages: list[dict], route: list[dict]) -> Table:
    on_route = {r["hotkey"] for r in route}
    t = Table(title="k3-subnet swarm")
    for col in ("stage", "uid", "layers", "port", "step ms", "on route", "up", "incentive"):
        t.add_column(col)
    for s in stages:
        t.add_row(s["name"], str(s["uid"]), s["layers"], s["url"].rsplit(":", 1)[-1], f"{s['step_ms']:.1f}",
                  "yes" if s["hotkey"] in on_route else "-", "yes" if s["alive"] else "NO", f"{s['incentive']:.3f}")
    return t


def run_swarm(args, run_dir: Path, t_launch: float, stage_flags: dict[str, list[str]] | None = None) -> int:
    """`--swarm N`: the devnet, N stage miners (+ a spare), the route miner and a validator; one completion through
    the route compared with the single-process model. `stage_flags` adds command-line flags per stage miner, by
    name ("stage0", ..., "spare"), e.g. a cheating stage's. Returns the exit status (1 when the route's answer
    differs from the model's)."""
    stage_flags = stage_flags or {}
    log_dir = run_dir / "logs"
    ensure_checkpoints(args)
    neurons = swarm_neurons(args, run_dir / "wallets")
    with setup_progress(len(neurons) + 2) as step:
        chain_spec, netuid = asyncio.run(setup_devnet(run_dir, args, neurons, step))
    print(f"[localnet] chain {chain_spec}, netuid {netuid}")
    stages = [n for n in neurons if n.role == "stage"]
    route, validator = neurons[-1], neurons[0]
    summary: dict = {"chain": chain_spec, "netuid": netuid, "run_dir": str(run_dir)}
    status = 0
    try:
        for n in stages:
            start(n, stage_command(n, args, chain_spec, netuid, run_dir, list(stage_flags.get(n.name, ()))), log_dir)
        ready = wait_ready(stages, run_dir)
        print(f"[localnet] {len(stages)} stage miners serving and announced on chain")
        start(route, route_command(route, args, chain_spec, netuid, run_dir), log_dir)
        ready.update(wait_ready([route], run_dir))
        start(validator, validator_command(validator, args, chain_spec, netuid, run_dir), log_dir)
        print(f"[localnet] route miner on {ready['route']['url']}, validator started (logs in {log_dir})")
        done = asyncio.run(swarm_completion(route, ready["route"]["url"], validator.wallet.hotkey, SWARM_PROMPT,
                                            args.swarm_tokens))
        want = reference_greedy(checkpoint_dir(args), SWARM_PROMPT, args.swarm_tokens)
        # the miner protocol's capabilities are the route miner's at its start: its ready file names the route
        done.update(reference=want, match=done["tokens"] == want, route=done["route"] or ready["route"]["route"])
        print(f"[localnet] completion through {len(done['route'])} stages in {done['seconds']:.2f} s: "
              f"{done['tokens']} ({'equals' if done['match'] else 'DIFFERS FROM'} the single-process model's {want})")
        status = 0 if done["match"] else 1
        summary["completion"] = done
        if args.duration:
            summary.update(asyncio.run(watch(args, chain_spec, netuid, run_dir, neurons, t_launch)))
        summary["stages"] = asyncio.run(swarm_stages(chain_spec, netuid, stages, ready))
        Console().print(swarm_table(summary["stages"], done["route"]))
    finally:
        print("[localnet] stopping every process it started")
        stop_all(neurons)
    if args.summary:
        args.summary.write_text(json.dumps(summary, indent=2, default=str))
    return status


async def swarm_stages(chain_spec: str, netuid: int, stages: list[Neuron], ready: dict[str, dict]) -> list[dict]:
    """Every stage miner as the chain and its process see it: uid, layers, what it announced, step time,
    weight."""
    async with connect(chain_spec) as chain:
        meta, commitments = await chain.metagraph(netuid), await chain.commitments(netuid)
    rows = []
    for n in stages:
        hotkey = n.wallet.hotkey.ss58_address
        info, r = meta.by_hotkey(hotkey), ready[n.name]
        rows.append({"name": n.name, "hotkey": hotkey, "uid": info.uid if info else None, "layers": r["layers"],
                     "url": r["url"], "step_ms": r.get("step_ms") or 0.0, "fingerprint": r["fingerprint"],
                     "announced": commitments[hotkey].data if hotkey in commitments else None,
                     "alive": n.process is not None and n.process.poll() is None,
                     "incentive": info.incentive if info else 0.0})
    return rows


if __name__ == "__main__":
    sys.exit(main())
