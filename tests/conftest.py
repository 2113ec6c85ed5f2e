"""Fixtures shared by the test files: real bittensor wallets, the tiny checkpoint and a devnet subnet, the
tiny model (`model`, `tokenizer`; a file may define its own), `reference_greedy` (the single-process model's
greedy tokens), `collect_events` for engine streams and `start_route_miner` (a swarm route miner process).

Factories are session fixtures so that a module-scoped `world` fixture can use them:

    def world(tmp_path_factory, make_wallets, make_subnet, tiny_checkpoint): ...
"""
from __future__ import annotations

import asyncio
import fcntl
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Iterable, Mapping

import bittensor as bt
import pytest
import torch

from chain.devnet import DevnetChain
from inference.model import ByteTokenizer, KimiK3Model, ModelConfig, make_random_checkpoint
from inference.serving import TokenEvent, load_reference_model

# One torch (OpenMP/MKL) thread in this process and in every process a test starts (they inherit the
# environment): the tiny model gains nothing from a second thread, and on a 2-core machine running
# servers, miners and shard processes side by side, OpenMP threads spinning on every core starve the
# processes that have work to do (a test that wants more sets them itself).
os.environ.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1")
torch.set_num_threads(1)

# ---------------------------------------------------------------- two workers (pytest-xdist, scripts/test.sh)
# Files whose tests take longest (seconds on the 2-core CI machine), run first so that the two workers
# finish together (xdist hands out whole files in this order: --dist loadfile --no-loadscope-reorder).
# The soak first, on one worker for its 6 minutes, while the other runs files with no `exclusive` test (an exclusive
# test waits for every running test to end, the soak's included), then the files that have them.
SLOW_FILES_FIRST = (
    "test_soak.py", "test_localnet.py", "test_stage_rounds.py", "test_envelope_bf16_cheats.py",
    "test_gateway_route.py", "test_speculative_route.py", "test_sharded.py", "test_selfcheck_endpoint.py",
    "test_swarm.py", "test_scoring_envelope.py", "test_lm_eval.py", "test_sharded_pipelined_engine.py",
    "test_swarm_shard_restart.py",
    "test_validator_e2e.py", "test_vllm_real.py", "test_validator_sampling.py", "test_hostile_miner.py",
    "test_benchmark_endpoint.py", "test_scoring_verify.py", "test_metrics.py", "test_packaging.py", "test_cli.py",
    "test_engine.py",
)


def pytest_collection_modifyitems(config, items):
    if os.environ.get("PYTEST_XDIST_WORKER"):  # a stable sort: a file's own tests keep their order
        rank = {name: i for i, name in enumerate(SLOW_FILES_FIRST)}
        items.sort(key=lambda item: rank.get(item.path.name, len(rank)))


class _ExclusiveLock:
    """A lock shared by the workers of one xdist run: a test marked `exclusive` (it measures speed or
    timing) runs while no other worker runs a test; the others share it. A turnstile lets an exclusive
    test in as soon as the test running on the other worker ends."""

    def __init__(self, run: str):
        base = Path(tempfile.gettempdir()) / f"k3-tests-{run}"
        self.paths = (base.with_suffix(".turn"), base.with_suffix(".lock"))
        self.turn, self.lock = (os.open(path, os.O_RDWR | os.O_CREAT, 0o600) for path in self.paths)

    def acquire(self, exclusive: bool) -> None:
        fcntl.flock(self.turn, fcntl.LOCK_EX)
        try:
            fcntl.flock(self.lock, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
        finally:
            fcntl.flock(self.turn, fcntl.LOCK_UN)

    def release(self) -> None:
        fcntl.flock(self.lock, fcntl.LOCK_UN)

    def close(self) -> None:
        for fd, path in zip((self.turn, self.lock), self.paths):
            os.close(fd)
            path.unlink(missing_ok=True)


_exclusive_lock: _ExclusiveLock | None = None


def pytest_configure(config):
    global _exclusive_lock
    if os.environ.get("PYTEST_XDIST_WORKER") and int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")) > 1:
        _exclusive_lock = _ExclusiveLock(os.environ["PYTEST_XDIST_TESTRUNUID"])


def pytest_unconfigure(config):
    if _exclusive_lock is not None:
        _exclusive_lock.close()


@pytest.hookimpl(hookwrapper=True, tryfirst=True)  # outside pytest-timeout's timer: waiting is not the test's time
def pytest_runtest_protocol(item, nextitem):
    if _exclusive_lock is None:
        yield
        return
    _exclusive_lock.acquire(item.get_closest_marker("exclusive") is not None)
    try:
        yield
    finally:
        _exclusive_lock.release()


def unused_port() -> int:
    """A loopback port that was free a moment ago (for a server started next, or one nobody serves)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def new_wallet(root: Path, name: str) -> bt.Wallet:
    """A real wallet (coldkey and hotkey "default", no password) under `root`."""
    wallet = bt.Wallet(name, "default", path=str(root))
    wallet.create_new_coldkey(use_password=False, suppress=True)
    wallet.create_new_hotkey(use_password=False, suppress=True)
    return wallet


def new_wallets(root: Path, names: Iterable[str]) -> dict[str, bt.Wallet]:
    return {name: new_wallet(root, name) for name in names}


async def new_subnet(path: Path, wallets: Mapping[str, bt.Wallet], register: Iterable[str],
                     stakes: Mapping[str, float] | None = None, *, owner: str = "owner",
                     block_interval: float = 1.0, tempo: int = 10_000, **subnet) -> tuple[int, dict[str, int]]:
    """A devnet at `path` with one subnet created by `owner`: `register` names registered (uids in
    that order), each name in `stakes` staking that much on itself. The default tempo is long: no
    epoch runs during a test, so permits stay as staked. Returns (netuid, uid by name)."""
    chain = DevnetChain(path, create=True, block_interval=block_interval)
    try:
        netuid = await chain.create_subnet(wallets[owner], tempo=tempo, **subnet)
        uids = {name: await chain.register(wallets[name], netuid) for name in register}
        for name, stake in (stakes or {}).items():
            await chain.add_stake(wallets[name], wallets[name], netuid, stake)
        return netuid, uids
    finally:
        await chain.close()


@pytest.fixture(scope="session")
def free_port():
    """unused_port() -> a loopback port free a moment ago."""
    return unused_port


@pytest.fixture(scope="session")
def make_wallet():
    """new_wallet(root, name) -> a real bittensor wallet."""
    return new_wallet


@pytest.fixture(scope="session")
def make_wallets():
    """new_wallets(root, names) -> {name: wallet}."""
    return new_wallets


@pytest.fixture(scope="session")
def make_subnet():
    """A blocking new_subnet: make_subnet(path, wallets, register, stakes, **options) -> (netuid, uids)."""
    def make(*args, **kwargs) -> tuple[int, dict[str, int]]:
        return asyncio.run(new_subnet(*args, **kwargs))
    return make


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory) -> Path:
    """The tiny model's checkpoint, seed 0, written once per session (read-only for the tests)."""
    path = tmp_path_factory.mktemp("tiny") / "ckpt"
    make_random_checkpoint(ModelConfig.tiny(), path, seed=0)
    return path


TRAINED_ASSET = Path(__file__).resolve().parents[1] / "inference" / "model" / "assets" / "tiny_trained"


@pytest.fixture(scope="session")
def trained_checkpoint(tmp_path_factory) -> Path:
    """A copy of the tiny K3 trained on real text (inference/model/assets/tiny_trained), once per session, so
    that no test writes into the package's assets."""
    path = tmp_path_factory.mktemp("tiny_trained") / "ckpt"
    shutil.copytree(TRAINED_ASSET, path)
    return path


@pytest.fixture(scope="session")
def tiny_reference(tiny_checkpoint):
    """(model, tokenizer, fingerprint) of the tiny checkpoint, loaded once per session."""
    return load_reference_model(tiny_checkpoint)


@pytest.fixture(scope="module")
def model():
    """The tiny model with random weights (torch seed 0), fresh for each test module (a test may wrap it)."""
    torch.manual_seed(0)
    return KimiK3Model(ModelConfig.tiny()).eval()


@pytest.fixture(scope="module")
def tokenizer():
    """The tiny model's byte tokenizer."""
    return ByteTokenizer.from_config(ModelConfig.tiny())


def reference_greedy(model, prompt: list[int], n: int) -> tuple[list[int], list[float]]:
    """The single-process model's first `n` greedy tokens after `prompt` and their logprobs (the plain
    reference that distributed runs are compared with)."""
    cache = model.new_cache()
    logits = model.forward([torch.tensor(prompt)], [cache])[0]
    out, lps = [], []
    for _ in range(n):
        lp = torch.log_softmax(logits, -1)
        t = int(torch.argmax(logits))
        out.append(t)
        lps.append(float(lp[t]))
        logits = model.forward([torch.tensor([t])], [cache])[0]
    return out, lps


def start_route_miner(argv: list[str], workdir: Path, env: Mapping[str, str] | None = None,
                      timeout_s: float = 120.0) -> tuple[subprocess.Popen, dict]:
    """`python -m neurons.route_miner ARGV` (stderr in workdir/route.log, `env` added to this one's), and
    its ready file's {url, hotkey, route, health, ...} once it serves; stop the process with
    localnet.cheats.stage.stop_hosts. It is killed when it exits or is not ready within `timeout_s`."""
    root = Path(__file__).resolve().parent.parent
    ready, log = workdir / "route.ready", workdir / "route.log"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
           "PYTHONPATH": str(root) + os.pathsep + os.environ.get("PYTHONPATH", ""), **(env or {})}
    with open(log, "w") as stderr:
        proc = subprocess.Popen([sys.executable, "-m", "neurons.route_miner", *argv, "--ready-file", str(ready)],
                                cwd=root, env=env, stdout=subprocess.DEVNULL, stderr=stderr)
    deadline = time.monotonic() + timeout_s
    while not ready.exists():
        problem = "exited" if proc.poll() is not None else \
            f"was not ready in {timeout_s:g} s" if time.monotonic() > deadline else None
        if problem:
            proc.kill()
            proc.wait()
            raise AssertionError(f"the route miner {problem}: {log.read_text()[-2000:]}")
        time.sleep(0.2)
    return proc, json.loads(ready.read_text())


async def collect_events(stream) -> tuple[list[TokenEvent], object]:
    """(token events, final event) of an engine's generate() stream."""
    tokens, final = [], None
    async for event in stream:
        if isinstance(event, TokenEvent):
            tokens.append(event)
        else:
            final = event
    return tokens, final
