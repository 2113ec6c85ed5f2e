"""The validator and sampled answers, end to end: real miner processes (neurons/miner.py and
localnet/cheats/miner.py) on a devnet, the validator's rounds in process with its own reference engine, SQLite.

1. An honest whole-model miner serving the random tiny checkpoint in bf16: that model has no measured
   honest-numerics envelope, so the validator judges it by exact checks only (tier 0, canaries, the greedy check,
   the replay of its sampled answers with the conservative near-tie allowance) and never zeroes it. (Judged by
   the statistical tests, whose thresholds assume measured numerics, its sampled answers fail `surprisal` hard:
   random bf16 logits sit nats away from fp32's.)
2. On the trained tiny model (its envelope measures the replay): miners that answer sampled requests greedily, or
   return a cached answer for a prompt sent again with another seed, are zeroed by the replay of their sampled
   answers (k3-gumbel/1), while honest fp32 and bf16 miners keep their weight.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from chain.devnet import DevnetChain
from inference.serving import EngineSettings, EngineSpec, LocalEngine, load_reference_model
from neurons.base.settings import ChainSettings, WalletSettings
from neurons.validator_app.rounds import ValidatorLoop
from neurons.validator_app.settings import (AuditSettings, RoundSettings, ScoringSettings, ValidatorSettings,
                                            WeightSettings)
from neurons.validator_app.store import ValidatorStore
from protocol.client import ClientTimeouts, MinerClient

ROOT = Path(__file__).resolve().parent.parent
MAX_CONTEXT = 1024
VALIDATOR_STAKE = 10_000.0
# Sampled chat only (every request audited), short answers: the rounds judge what sampling is judged by.
PROFILE = {
    "round_requests": 8, "mix_chat": 1.0, "mix_long_context": 0.0, "mix_burst": 0.0, "mix_probe": 0.0,
    "greedy_fraction": 0.0, "temperature_range": [0.3, 1.0], "chat_prompt_tokens": [16, 128],
    "chat_max_tokens": [32, 48], "canary_tokens": 32, "copy_text_tokens": [8, 24], "long_context_sizes": [600],
    "buffering_min_tokens": 48, "long_context_max_tokens": [16, 32],
}


def miner_command(root: Path, devnet: Path, netuid: int, name: str, checkpoint: Path, extra: list[str]) -> list[str]:
    script = "localnet/cheats/miner.py" if "--cheat" in extra else "neurons/miner.py"
    return [sys.executable, script, "--network", f"devnet:{devnet}", "--netuid", str(netuid),
            "--wallet-name", name, "--wallet-hotkey", "default", "--wallet-path", str(root / "wallets"),
            "--engine", "reference", "--checkpoint", str(checkpoint), "--host", "127.0.0.1", "--port", "0",
            "--no-metrics", "--nonce-store", str(root / f"{name}-nonces.sqlite"), "--max-context", str(MAX_CONTEXT),
            "--max-concurrent", "4", "--min-validator-stake", "100", "--budget-requests", "100000",
            "--budget-min-requests", "10000", "--shutdown-grace-s", "0", "--log-level", "WARNING", *extra]


async def wait_for_miners(devnet: Path, netuid: int, uids: dict, processes: dict, key, timeout_s: float = 180.0):
    chain = DevnetChain(devnet)
    deadline = asyncio.get_running_loop().time() + timeout_s
    try:
        async with MinerClient(key) as client:
            pending = set(processes)
            while pending:
                for name in list(pending):
                    if processes[name].poll() is not None:
                        raise RuntimeError(f"miner {name} exited with {processes[name].returncode}")
                    neuron = (await chain.metagraph(netuid)).by_uid(uids[name])
                    if neuron.endpoint is None:
                        continue
                    with contextlib.suppress(Exception):
                        health = await client.health(neuron.endpoint.url, ClientTimeouts(connect=1, first_byte=2,
                                                                                         between_events=2, total=3))
                        if health.status != "down":
                            pending.discard(name)
                if asyncio.get_running_loop().time() > deadline:
                    raise RuntimeError(f"miners {sorted(pending)} did not come up")
                await asyncio.sleep(0.3)
    finally:
        await chain.close()


@contextlib.contextmanager
def subnet(root: Path, checkpoint: Path, miners: dict, make_wallets, make_subnet):
    """A devnet with the validator and `miners` (name -> extra miner flags) registered and serving."""
    wallets = make_wallets(root / "wallets", ("owner", "validator", *miners))
    devnet = root / "devnet.sqlite"
    netuid, uids = make_subnet(devnet, wallets, ("validator", *miners), {"validator": VALIDATOR_STAKE},
                               block_interval=0.1, tempo=20, weights_rate_limit=5)
    env = {"OMP_NUM_THREADS": "1", "PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": os.environ.get("HOME", "/tmp"),
           "PYTHONUNBUFFERED": "1", "PYTHONPATH": str(ROOT)}
    processes = {}
    try:
        for name, extra in miners.items():
            with open(root / f"{name}.log", "w") as log:
                processes[name] = subprocess.Popen(miner_command(root, devnet, netuid, name, checkpoint, extra),
                                                   cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                                                   start_new_session=True)
        asyncio.run(wait_for_miners(devnet, netuid, uids, processes, wallets["validator"].hotkey))
        yield devnet, netuid, wallets, uids
    finally:
        for process in processes.values():
            if process.poll() is None:
                process.terminate()
        for process in processes.values():
            try:
                process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(timeout=5)
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(process.pid, signal.SIGKILL)


def run_rounds(root: Path, checkpoint: Path, devnet: Path, netuid: int, wallets, rounds: int, profile: dict,
               until=None, openings: bool = True) -> tuple[list, dict, ValidatorLoop]:
    """`rounds` validator rounds (fewer when `until(loop)` says so after one) with its own reference engine on
    `checkpoint`, opening state commitments at the default rates unless `openings` is False; (the round reports, the
    weights it would set, the loop)."""
    opening_rates = {} if openings else dict(opening_rate=0.0, opening_rate_new=0.0)
    settings = ValidatorSettings(
        chain=ChainSettings(network=f"devnet:{devnet}", netuid=netuid, metagraph_refresh_s=0.5, timeout_s=10.0),
        wallet=WalletSettings(name="validator", hotkey="default", path=str(root / "wallets")),
        engine=EngineSpec(checkpoint=str(checkpoint)), reference_engine=True, db=str(root / "validator.sqlite"),
        rounds=RoundSettings(interval_s=0.0, concurrency=16, miner_concurrency=4, deadline_s=240.0, seed=7),
        timeouts=ClientTimeouts(connect=2.0, first_byte=60.0, between_events=20.0, total=120.0),
        audits=AuditSettings(rate=1.0, rate_new=1.0, canaries=8, timeout_s=120.0, **opening_rates),
        scoring=ScoringSettings(profile="local_testnet", overrides=json.dumps(profile)),
        weights=WeightSettings(check_s=0.2, retry_s=0.2, retry_max_s=1.0))
    model, tokenizer, fp = load_reference_model(checkpoint)

    async def scenario():
        engine = LocalEngine(model, tokenizer, EngineSettings(max_context=MAX_CONTEXT, forward_stall_s=600.0),
                             model_fingerprint=fp)
        chain = DevnetChain(devnet)
        await engine.start()
        loop = ValidatorLoop(settings, chain=chain, wallet=wallets["validator"], store=ValidatorStore(settings.db),
                             tokenizer=tokenizer, reference=engine, expected_fingerprint=fp)
        try:
            reports = []
            for _ in range(rounds):
                reports.append(await loop.run_round())
                if until is not None and until(loop):
                    break
            return reports, loop.current_weights(), loop
        finally:
            await loop.close()
            await engine.stop()
            await chain.close()
            loop.store.close()

    return asyncio.run(scenario())


def failures_of(root: Path, uid: int) -> list[dict]:
    with ValidatorStore(root / "validator.sqlite", readonly=True) as store:
        return [dict(f) for f in store.failures(uid)]


@pytest.mark.timeout(900)  # a miner process and three rounds of audited sampled answers
def test_an_honest_bf16_miner_of_a_model_without_an_envelope_is_never_zeroed(tmp_path_factory, tiny_checkpoint,
                                                                             make_wallets, make_subnet, caplog):
    root = tmp_path_factory.mktemp("random_bf16")
    # low temperatures (the validator sends 0..1): where random bf16's tokens look least like fp32's draws
    profile = {**PROFILE, "temperature_range": [0.05, 0.35]}
    with subnet(root, tiny_checkpoint, {"honest_bf16": ["--dtype", "bfloat16"]}, make_wallets, make_subnet) as world:
        devnet, netuid, wallets, uids = world
        with caplog.at_level("WARNING", logger="k3.validator"):
            reports, weights, loop = run_rounds(root, tiny_checkpoint, devnet, netuid, wallets, 3, profile)
    uid = uids["honest_bf16"]
    assert sum(r.miners[uid].measured for r in reports) >= 20  # sampled answers, every one audited
    hard = [f for f in failures_of(root, uid) if f["hard"]]
    assert not hard, [(f["check_name"], f["reason"][:100]) for f in hard]
    assert not any(r.scores[uid].zeroed for r in reports), [r.scores[uid].reasons for r in reports]
    assert weights[uid] > 0
    assert not loop.config.statistical_checks  # the random tiny model has no envelope: exact checks only
    assert sum("no honest-numerics envelope" in r.message for r in caplog.records) == 1  # said once, at start


@pytest.mark.exclusive
@pytest.mark.timeout(2400)  # four miner processes and up to six rounds of audited sampled answers
def test_greedy_and_seed_ignoring_miners_are_zeroed_by_the_replay(tmp_path_factory, trained_checkpoint, make_wallets,
                                                                  make_subnet):
    """Two cheaters that run the real model, each caught by the replay of its sampled answers: one answers every
    sampled request greedily, one returns a cached answer when a prompt comes again with another seed (the
    validator resends a share of its sampled prompts; here half, to meet it within a few rounds)."""
    root = tmp_path_factory.mktemp("sampling_cheats")
    miners = {"honest_fp32": [], "honest_bf16": ["--dtype", "bfloat16"],
              "greedy": ["--cheat", "greedy-for-sampled"], "cache": ["--cheat", "seed-ignoring-replay"]}
    profile = {**PROFILE, "replay_resend_rate": 0.5}
    with subnet(root, trained_checkpoint, miners, make_wallets, make_subnet) as world:
        devnet, netuid, wallets, uids = world
        cheaters = [uids["greedy"], uids["cache"]]

        def caught(loop) -> bool:
            scores = loop.last_report.scores
            return all(scores[u].zeroed for u in cheaters)

        # the replay alone: an opening of the cache's answer catches it too, first when drawn first (its cached
        # answer's states are not kept for the new request, and a refusal fails hard: tests/test_state_openings.py)
        reports, weights, _ = run_rounds(root, trained_checkpoint, devnet, netuid, wallets, 6, profile, until=caught,
                                         openings=False)
    for name in ("greedy", "cache"):
        uid = uids[name]
        hard = {f["check_name"] for f in failures_of(root, uid) if f["hard"]}
        assert weights[uid] == 0.0 and reports[-1].scores[uid].zeroed, (name, reports[-1].scores[uid].reasons)
        assert "replay_mismatch" in hard, (name, hard)
    for name in ("honest_fp32", "honest_bf16"):
        uid = uids[name]
        assert not [f for f in failures_of(root, uid) if f["hard"]], name
        assert weights[uid] > 0 and not any(r.scores[uid].zeroed for r in reports), name
