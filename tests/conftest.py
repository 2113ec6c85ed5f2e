"""Fixtures shared by the test files: real bittensor wallets, the tiny checkpoint and a devnet subnet, the
tiny model (`model`, `tokenizer`; a file may define its own), `reference_greedy` (the single-process model's
greedy tokens) and `collect_events` for engine streams.

Factories are session fixtures so that a module-scoped `world` fixture can use them:

    def world(tmp_path_factory, make_wallets, make_subnet, tiny_checkpoint): ...
"""
from __future__ import annotations

import asyncio
import os
import socket
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


async def collect_events(stream) -> tuple[list[TokenEvent], object]:
    """(token events, final event) of an engine's generate() stream."""
    tokens, final = [], None
    async for event in stream:
        if isinstance(event, TokenEvent):
            tokens.append(event)
        else:
            final = event
    return tokens, final
