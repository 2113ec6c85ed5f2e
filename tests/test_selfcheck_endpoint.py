"""`neurons/validator.py self-check --endpoint URL` against real miner processes on a devnet file: an honest
miner passes, checked by its owner with a hotkey of its own wallet (--owner-hotkeys: no validator permit, no
stake); a cheating one (localnet/cheats/miner.py --cheat perturb-experts: experts re-quantised with
noise, the fingerprint claimed unchanged) fails with the reason; an unreachable endpoint and a wrong
miner hotkey are clear CLI errors. Both miners start at once so that their start-up times overlap."""
import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path

import bittensor as bt
import pytest

from benchmarks.hostile import published_url

ROOT = Path(__file__).resolve().parent.parent
START_TIMEOUT_S = 600.0  # cold Python processes importing torch on a 2-core machine other jobs load
pytestmark = pytest.mark.timeout(2400)  # three CLI runs, each importing torch and loading the model
# Small rounds of the local-testnet profile: chats, long contexts of 600 tokens, bursts and canaries
PROFILE = {"round_requests": 6, "chat_prompt_tokens": [16, 96], "chat_max_tokens": [16, 24],
           "long_context_sizes": [600], "long_context_max_tokens": [16, 16], "canary_tokens": 16,
           "copy_text_tokens": [4, 12], "burst_capacity_fraction": [1.0, 1.0]}
MINERS = {"honest": ("neurons/miner.py", "--owner-hotkeys", "selfcheck"), "cheater": ("localnet/cheats/miner.py", "--cheat", "perturb-experts")}


@pytest.fixture(scope="module")
def miners(tmp_path_factory, make_wallets, make_subnet, tiny_checkpoint):
    root = tmp_path_factory.mktemp("selfcheck")
    wallets = make_wallets(root / "wallets", ("owner", "validator", *MINERS))
    bt.Wallet("honest", "selfcheck", path=str(root / "wallets")).create_new_hotkey(use_password=False, suppress=True)
    devnet = root / "devnet.sqlite"
    netuid, _ = make_subnet(devnet, wallets, ("validator", *MINERS), {"validator": 100.0})
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    processes, logs = {}, {}
    for name, (script, *extra) in MINERS.items():
        logs[name] = root / f"{name}.log"
        with open(logs[name], "w") as log:
            processes[name] = subprocess.Popen(
                [sys.executable, str(ROOT / script), "--network", f"devnet:{devnet}", "--netuid", str(netuid),
                 "--wallet-name", name, "--wallet-hotkey", "default", "--wallet-path", str(root / "wallets"),
                 "--engine", "reference", "--checkpoint", str(tiny_checkpoint), "--max-context", "1024",
                 "--max-concurrent", "2", "--host", "127.0.0.1", "--port", "0", "--no-metrics",
                 "--nonce-store", str(root / f"{name}-nonces.sqlite"), "--min-validator-stake", "5",
                 "--metagraph-refresh-s", "2", "--shutdown-grace-s", "0", *extra],
                env=env, cwd=root, stdout=log, stderr=subprocess.STDOUT)
    try:
        urls = {}
        for name, process in processes.items():
            hotkey = wallets[name].hotkey.ss58_address
            urls[name] = asyncio.run(published_url(devnet, netuid, hotkey, process, logs[name].read_text,
                                                   START_TIMEOUT_S))
        yield dict(root=root, wallets=wallets, urls=urls, checkpoint=tiny_checkpoint)
    finally:
        for process in processes.values():
            if process.poll() is None:
                process.terminate()
        for process in processes.values():
            try:
                process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(timeout=5)


def self_check(miners, url: str, miner_hotkey: str, *extra: str, timeout_s: float = 900.0,
               wallet=("validator", "default")):
    command = [sys.executable, "neurons/validator.py", "self-check", "--checkpoint", str(miners["checkpoint"]),
               "--endpoint", url, "--miner-hotkey", miner_hotkey, "--wallet-name", wallet[0],
               "--wallet-hotkey", wallet[1], "--wallet-path", str(miners["root"] / "wallets"), "--scoring-profile", "local_testnet",
               "--scoring-overrides", json.dumps(PROFILE), "--seed", "3", *extra]
    return subprocess.run(command, cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True,
                          text=True, timeout=timeout_s)


def test_an_honest_miner_passes_checked_by_its_owner(miners):
    done = self_check(miners, miners["urls"]["honest"], miners["wallets"]["honest"].hotkey.ss58_address,
                      "--audits", "6", "--canaries", "2", wallet=("honest", "selfcheck"))
    assert done.returncode == 0, done.stdout + done.stderr
    out = done.stdout
    assert "matches the reference checkpoint" in out and "precision float32" in out
    assert "0 hard and 0 soft failures" in out and "tier 0 (every answer): 0 failures" in out
    assert "tier 2 canaries: 2, 0 failed" in out  # every canary computed was sent
    assert "verdict: PASS" in out


def test_a_cheating_miner_fails_with_the_reason(miners):
    done = self_check(miners, miners["urls"]["cheater"], miners["wallets"]["cheater"].hotkey.ss58_address,
                      "--audits", "4", "--canaries", "0")
    assert done.returncode == 1, done.stdout + done.stderr
    verdict = next(line for line in done.stdout.splitlines() if line.startswith("verdict:"))
    # the perturbed experts move greedy tokens off the reference's top-1 (the random tiny model has no measured
    # envelope, so the exact checks judge it: scoring.config.statistical_checks)
    assert verdict.startswith("verdict: FAIL") and "greedy_mismatch" in verdict and "audits" in verdict, done.stdout
    assert "greedy_mismatch" in done.stdout.split("failures:")[1]  # each failed audit listed with its reason


def test_clear_errors_for_an_endpoint_that_cannot_be_checked(miners, free_port):
    nobody = self_check(miners, f"http://127.0.0.1:{free_port()}", miners["wallets"]["honest"].hotkey.ss58_address,
                        timeout_s=120)
    assert nobody.returncode == 2 and "cannot reach the miner at" in nobody.stderr, nobody.stderr
    assert "Traceback" not in nobody.stderr
    wrong_key = self_check(miners, miners["urls"]["honest"], miners["wallets"]["cheater"].hotkey.ss58_address,
                           timeout_s=120)
    assert wrong_key.returncode == 2 and "--miner-hotkey must be the ss58 address" in wrong_key.stderr, \
        wrong_key.stderr
    no_scheme = self_check(miners, "127.0.0.1:8091", miners["wallets"]["honest"].hotkey.ss58_address, timeout_s=120)
    assert no_scheme.returncode == 2 and "must be the miner's http://HOST:PORT" in no_scheme.stderr
