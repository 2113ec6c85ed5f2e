"""Shard-set restart: a stage whose block runs over local shard processes loses one of them.

- in process: the forward that meets the dead set fails within seconds with 503 "shard_set_failed", every session
  is dropped (their state lived in the set), `status()` says failed, opens get 503 "stage_restarting";
  `restart_shards()` starts a fresh set that serves new sessions with the unsharded block's numbers;
- a stopped (SIGSTOP) shard fails the forward within the heartbeat timeout; the restart replaces it;
- real processes: a shard process of the head stage miner is SIGKILLed mid-generation. With no spare the route
  driver waits for the stage to restart and re-prefills through it; with a spare it re-prefills through the
  spare. Either way the generation ends with the uninterrupted greedy tokens (logprobs within 1e-4), /health
  answers 503 and the signed capabilities say `serving: 0` while the set is down, and afterwards the stage
  serves again (restarts 1, new shard pids) and a new generation through it gives the same tokens; an idle
  stage (no traffic) notices a dead shard by itself and restarts it.
"""
import asyncio
import os
import signal
import threading
import time

import aiohttp
import bittensor as bt
import pytest
import torch
from conftest import reference_greedy

from benchmarks.swarm import launch_stages, stop_processes
from inference.decoding.sampling import SamplingParams
from inference.model.checkpoint import fingerprint, make_random_checkpoint
from inference.model.config import ModelConfig
from inference.model.tokenizer import load_tokenizer
from inference.serving.builders import load_reference_model
from inference.serving.engine import GenerationRequest, TokenEvent
from inference.sharding.driver import ShardTimeouts
from inference.swarm.stage import Stage, StageError
from neurons.swarm.route import RouteDriver, RouteEngine, StaticDirectory
from protocol.stage import CAPABILITIES_PATH, HEALTH_PATH

PROMPT = [(7 * j + 3) % 256 for j in range(17)]
N_TOKENS = 40


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    path = tmp_path_factory.mktemp("shard_restart") / "ckpt"
    make_random_checkpoint(ModelConfig.tiny(), path, seed=1)
    return path


def test_dead_shard_set_fails_its_sessions_then_restarts(ckpt):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    stage = Stage.from_checkpoint(ckpt, "0-5", shard_ranks=2, threads_per_rank=1, shard_mode="pipeline",
                                  shard_timeouts=ShardTimeouts(startup=120.0))
    try:
        plain = Stage.from_checkpoint(ckpt, "0-5")
        stage.open("a")
        stage.forward("a", 0, torch.tensor(PROMPT))
        assert stage.status() == ("ok", "")
        os.kill(stage.model.pids[1], signal.SIGKILL)
        t0 = time.monotonic()
        with pytest.raises(StageError) as e:
            stage.forward("a", len(PROMPT), torch.tensor([5]))
        assert e.value.status == 503 and e.value.code == "shard_set_failed"
        assert time.monotonic() - t0 < 5.0
        assert "shard rank 1" in e.value.message and "SIGKILL" in e.value.message
        assert stage.sessions == {} and stage.lost_sessions == 1 and stage.status()[0] == "failed"
        assert stage.capacity()["serving"] == 0
        with pytest.raises(StageError) as e:
            stage.open("b")
        assert (e.value.status, e.value.code) == (503, "stage_restarting")
        old = set(stage.model.pids.values())
        stage.restart_shards()
        assert stage.status() == ("ok", "") and stage.shard_restarts == 1 and stage.capacity()["serving"] == 1
        assert not old & set(stage.model.pids.values())
        for s in (stage, plain):
            s.open("b")
        a = stage.forward("b", 0, torch.tensor(PROMPT))
        b = plain.forward("b", 0, torch.tensor(PROMPT))
        assert max(float((x - y).abs().max()) for x, y in zip(a.blocks + [a.partial], b.blocks + [b.partial])) < 1e-4
    finally:
        stage.shutdown()
        torch.set_num_threads(threads)


def test_a_hung_shard_fails_the_forward_within_the_heartbeat_timeout(ckpt):
    """A stopped (SIGSTOP) shard process: its heartbeat goes silent; the forward waiting on it fails with
    shard_set_failed within the heartbeat timeout, and the restart replaces the stopped process too."""
    stage = Stage.from_checkpoint(ckpt, "6-12", shard_ranks=2, threads_per_rank=1, shard_mode="pipeline",
                                  shard_timeouts=ShardTimeouts(heartbeat=2.0, startup=120.0))
    try:
        front = Stage.from_checkpoint(ckpt, "0-5")
        front.open("a")
        x = front.forward("a", 0, torch.tensor(PROMPT))
        stage.open("a")
        stage.forward("a", 0, x, mode="sample")
        stopped = stage.model.pids[1]
        os.kill(stopped, signal.SIGSTOP)
        y = front.forward("a", len(PROMPT), torch.tensor([5]))
        t0 = time.monotonic()
        with pytest.raises(StageError) as e:
            stage.forward("a", len(PROMPT), y, mode="sample")
        waited = time.monotonic() - t0
        assert e.value.code == "shard_set_failed" and "heartbeat" in e.value.message
        assert waited < 2.0 + 3.0
        stage.restart_shards()
        assert stage.status() == ("ok", "") and stopped not in stage.model.pids.values()
        assert not os.path.exists(f"/proc/{stopped}")  # killed and reaped, not left stopped
        stage.open("b")
        stage.forward("b", 0, x, mode="sample")
    finally:
        stage.shutdown()


@pytest.fixture(scope="module")
def swarm(ckpt, tmp_path_factory):
    root = tmp_path_factory.mktemp("restart_route")
    for name in ("a", "f", "s", "driver"):
        bt.Wallet(name, "default", path=str(root / "wallets")).create_new_hotkey(use_password=False, suppress=True)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    common = ["--hop-timeout-s", "10"]
    procs, infos = launch_stages(ckpt, ["0-3", "4-12"], root / "wallets", ["a", "s"], root, extra=common)
    try:
        sharded, sharded_infos = launch_stages(ckpt, ["4-12"], root / "wallets", ["f"], root,
                                               extra=common + ["--shard-ranks", "2", "--shard-mode", "pipeline"])
    except BaseException:
        stop_processes(procs)
        raise
    try:
        model, _, _ = load_reference_model(ckpt, verify=False)
        yield {"first": infos[0]["url"], "spare": infos[1], "sharded": sharded_infos[0], "model": model,
               "driver": bt.Wallet("driver", "default", path=str(root / "wallets")).hotkey, "ckpt": ckpt,
               "logs": root}
    finally:
        stop_processes(procs + sharded)
        torch.set_num_threads(threads)


async def health(http, url):
    async with http.get(url + HEALTH_PATH, timeout=aiohttp.ClientTimeout(total=3)) as resp:
        return resp.status, await resp.json()


async def serving(http, url):
    async with http.get(url + CAPABILITIES_PATH, timeout=aiohttp.ClientTimeout(total=3)) as resp:
        return (await resp.json())["capacity"]["serving"]


async def generate_killing_a_shard(swarm, urls, spare_url=None):
    """A greedy generation over `urls`; after its first token one shard process of the sharded stage is killed
    (and `spare_url` joins the directory). Returns (tokens, logprobs, what was seen of the stage meanwhile, driver)."""
    directory = StaticDirectory(urls)
    driver = RouteDriver(directory, swarm["driver"], ModelConfig.tiny(), hop_timeout_s=10.0, restart_wait_s=120.0)
    engine = RouteEngine(driver, load_tokenizer(swarm["ckpt"], ModelConfig.tiny()), prefill_chunk=8,
                         model_fingerprint=fingerprint(swarm["ckpt"]))
    url = swarm["sharded"]["url"]
    seen = {"health": set(), "serving": set(), "recoveries": 0}
    tokens, lps = [], []
    async with engine, aiohttp.ClientSession() as http:
        _, before = await health(http, url)
        stream = engine.generate(GenerationRequest(PROMPT, SamplingParams(max_tokens=N_TOKENS, ignore_eos=True)))
        async for event in stream:
            if not isinstance(event, TokenEvent):
                break
            tokens.append(event.token_id)
            lps.append(event.logprob)
            if len(tokens) == 1:
                if spare_url:
                    directory.urls.append(spare_url)
                os.kill(before["shards"]["pids"][1], signal.SIGKILL)
                deadline = time.monotonic() + 10
                while time.monotonic() < deadline and 503 not in seen["health"]:  # while it is down
                    seen["health"].add((await health(http, url))[0])
                    seen["serving"].add(await serving(http, url))
                    await asyncio.sleep(0.05)
        deadline = time.monotonic() + 120
        status, after = await health(http, url)
        while status != 200 and time.monotonic() < deadline:
            await asyncio.sleep(0.25)
            status, after = await health(http, url)
        seen["after"], seen["before"] = after, before
        seen["recoveries"] = engine.recoveries
        seen["route"] = [s.url for s in driver.current]
    return tokens, lps, seen


async def plain_generation(swarm, urls):
    driver = RouteDriver(StaticDirectory(urls), swarm["driver"], ModelConfig.tiny(), hop_timeout_s=10.0)
    engine = RouteEngine(driver, load_tokenizer(swarm["ckpt"], ModelConfig.tiny()), prefill_chunk=8,
                         model_fingerprint=fingerprint(swarm["ckpt"]))
    async with engine:
        stream = engine.generate(GenerationRequest(PROMPT, SamplingParams(max_tokens=N_TOKENS, ignore_eos=True)))
        return [e.token_id async for e in stream if isinstance(e, TokenEvent)], [s.url for s in driver.current]


@pytest.mark.parametrize("with_spare", [False, True])
def test_killing_a_shard_mid_generation(swarm, with_spare):
    want, want_lp = reference_greedy(swarm["model"], PROMPT, N_TOKENS)
    urls = [swarm["first"], swarm["sharded"]["url"]]
    spare = swarm["spare"]["url"]
    tokens, lps, seen = asyncio.run(generate_killing_a_shard(swarm, urls, spare if with_spare else None))
    assert tokens == want
    assert max(abs(a - b) for a, b in zip(lps, want_lp)) < 1e-4
    assert seen["recoveries"] >= 1  # the kill did land mid-generation
    assert 503 in seen["health"] and 0 in seen["serving"]  # it said so while down
    assert seen["route"][1] == (spare if with_spare else swarm["sharded"]["url"])
    before, after = seen["before"]["shards"], seen["after"]["shards"]
    assert seen["after"]["status"] == "ok" and after["restarts"] == before["restarts"] + 1
    assert not set(before["pids"]) & set(after["pids"]) and after["lost_sessions"] >= 1
    # and it serves new sessions afterwards
    tokens, route = asyncio.run(plain_generation(swarm, urls))
    assert tokens == want and route == urls


def test_an_idle_stage_notices_a_dead_shard_and_restarts(swarm):
    """No traffic at all: the stage's own watch finds the dead shard, says so, restarts it and serves again."""
    async def run():
        url = swarm["sharded"]["url"]
        async with aiohttp.ClientSession() as http:
            status, before = await health(http, url)
            assert status == 200
            os.kill(before["shards"]["pids"][0], signal.SIGKILL)  # rank 0 this time
            seen, deadline = set(), time.monotonic() + 120
            while time.monotonic() < deadline:
                status, now = await health(http, url)
                seen.add((status, now["status"]))
                if status == 200 and now["shards"]["restarts"] == before["shards"]["restarts"] + 1:
                    break
                await asyncio.sleep(0.05)
            return seen, before["shards"], now["shards"]
    seen, before, after = asyncio.run(run())
    assert (503, "failed") in seen or (503, "restarting") in seen
    assert after["restarts"] == before["restarts"] + 1 and not set(before["pids"]) & set(after["pids"])
    tokens, route = asyncio.run(plain_generation(swarm, [swarm["first"], swarm["sharded"]["url"]]))
    assert tokens == reference_greedy(swarm["model"], PROMPT, N_TOKENS)[0]


def test_health_reads_never_fail_while_the_shard_set_restarts(ckpt):
    """/health reads the shard pids and the set's health from the event loop while the compute thread restarts
    the set: those reads must never raise (an exception there was an HTTP 500 instead of 503 "restarting")."""
    stage = Stage.from_checkpoint(ckpt, "0-5", shard_ranks=2, threads_per_rank=1, shard_mode="pipeline",
                                  shard_timeouts=ShardTimeouts(startup=120.0))
    errors, done = [], threading.Event()

    def probe():
        while not done.is_set():
            try:
                stage.status()
                sorted(stage.model.pids.values())
                stage.shard_layout()
            except Exception as e:  # noqa: BLE001 (collected and asserted on below)
                errors.append(repr(e))

    try:
        reader = threading.Thread(target=probe, daemon=True)
        reader.start()
        for _ in range(2):
            os.kill(stage.model.pids[1], signal.SIGKILL)
            stage.restart_shards()
        done.set()
        reader.join(10)
        assert errors == [] and stage.status() == ("ok", "") and stage.shard_restarts == 2
    finally:
        done.set()
        stage.shutdown()
