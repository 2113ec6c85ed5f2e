"""The route miner's distilled draft model (`--speculate distilled --draft-model FILE`) over real stage miner
processes on loopback: the trained tiny checkpoint (inference/model/assets/tiny_trained) served as two stage
miners announced on a devnet subnet, with the draft table shipped for it (tiny_trained_drafter.k3d).

- The route engine the route miner's settings make (`route_speculation`) drafts from the table: greedy output
  equals the single-process model's, token for token and logprobs within 1e-4 (fp32), and the final event
  reports the accepted drafts.
- A route miner process with those flags finds the stages on the chain and serves a validator's greedy request
  through the signed miner protocol with the same tokens, in fewer route traversals than tokens (the last
  stage's forward count): the drafts were accepted.
(A table made for another checkpoint is refused at startup: tests/test_route_miner_settings.py.)
"""
import asyncio
from pathlib import Path

import aiohttp
import pytest
import torch
from conftest import collect_events, reference_greedy, start_route_miner

from benchmarks.swarm import CODE_LIKE, launch_stages, stop_processes
from inference.decoding.sampling import SamplingParams
from inference.model.checkpoint import fingerprint, read_config
from inference.model.tokenizer import load_tokenizer
from inference.serving.builders import load_reference_model
from inference.serving.engine import GenerationRequest
from localnet.cheats.stage import stop_hosts
from neurons.route_miner import route_speculation
from neurons.swarm.route import RouteDriver, RouteEngine, StaticDirectory
from neurons.swarm.settings import read_route_miner_settings
from protocol.client import MinerClient
from protocol.schemas import GenerateRequest
from protocol.stage import HEALTH_PATH

ROOT = Path(__file__).resolve().parent.parent
SHIPPED_TABLE = ROOT / "inference" / "model" / "assets" / "tiny_trained_drafter.k3d"
RANGES = {"s0": "0-3", "s1": "4-12"}
NEW_TOKENS = 32
PREFILL_CHUNK = 64  # the whole prompt in one forward
HOP_TIMEOUT_S = 5.0


@pytest.fixture(scope="module")
def swarm(tmp_path_factory, make_wallets, make_subnet, trained_checkpoint):
    root = tmp_path_factory.mktemp("route_distilled")
    wallets = make_wallets(root / "wallets", ["owner", "validator", "route", *RANGES])
    devnet = root / "devnet.sqlite"
    netuid, _ = make_subnet(devnet, wallets, ["validator", "route", *RANGES], {"validator": 100.0},
                            block_interval=0.1)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the reference model in this process: 2 threads on a loaded 2-core box crawl
    procs, infos = launch_stages(trained_checkpoint, list(RANGES.values()), root / "wallets", list(RANGES), root,
                                 extra=["--network", f"devnet:{devnet}", "--netuid", str(netuid),
                                        "--hop-timeout-s", str(HOP_TIMEOUT_S)], timeout_s=240.0)
    try:
        model, tokenizer, _ = load_reference_model(trained_checkpoint, verify=False)
        prompt = tokenizer.encode(CODE_LIKE, add_bos=True)
        yield {"root": root, "ckpt": trained_checkpoint, "devnet": devnet, "netuid": netuid, "wallets": wallets,
               "stages": {name: info for name, info in zip(RANGES, infos)}, "tokenizer": tokenizer,
               "prompt": prompt, "greedy": reference_greedy(model, prompt, NEW_TOKENS)}
    finally:
        stop_processes(procs)
        torch.set_num_threads(threads)


def distilled_flags(swarm) -> list[str]:
    return ["--checkpoint", str(swarm["ckpt"]), "--netuid", str(swarm["netuid"]), "--speculate", "distilled",
            "--draft-model", str(SHIPPED_TABLE), "--prefill-chunk", str(PREFILL_CHUNK)]


async def last_stage_forwards(swarm) -> int:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as http:
        async with http.get(swarm["stages"]["s1"]["url"] + HEALTH_PATH) as r:
            return (await r.json())["forwards"]


def test_the_route_with_the_shipped_draft_table_equals_plain_greedy(swarm):
    settings = read_route_miner_settings(distilled_flags(swarm), {})
    ckpt = swarm["ckpt"]
    speculation = route_speculation(settings.route, fingerprint(ckpt))
    assert speculation.drafter == "distilled" and speculation.drafter_factory is not None
    driver = RouteDriver(StaticDirectory([swarm["stages"][n]["url"] for n in RANGES]), swarm["wallets"]["route"].hotkey,
                         read_config(ckpt), hop_timeout_s=HOP_TIMEOUT_S)
    engine = RouteEngine(driver, load_tokenizer(ckpt, read_config(ckpt)), model_fingerprint=fingerprint(ckpt),
                         prefill_chunk=settings.route.prefill_chunk, speculation=speculation)

    async def generate():
        async with engine:
            return await collect_events(engine.generate(GenerationRequest(
                swarm["prompt"], SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True))))

    events, final = asyncio.run(generate())
    want, want_logprobs = swarm["greedy"]
    assert [e.token_id for e in events] == want
    for e, lp in zip(events, want_logprobs):
        assert e.logprob == pytest.approx(lp, abs=1e-4)
    # the table guesses the trained model's own continuation: most tokens come from accepted drafts
    assert final.draft_accepted >= NEW_TOKENS // 2, (final.draft_proposed, final.draft_accepted)
    assert 0 < final.verify_steps < NEW_TOKENS // 2


def test_a_route_miner_process_serves_the_distilled_drafts(swarm):
    root = swarm["root"]
    proc, info = start_route_miner(
        [*distilled_flags(swarm), "-n", f"devnet:{swarm['devnet']}", "-w", "route", "--wallet-path",
         str(root / "wallets"), "--nonce-store", str(root / "nonces.sqlite"), "--min-validator-stake", "5",
         "--refresh-s", "1", "--hop-timeout-s", str(HOP_TIMEOUT_S)], root)
    try:
        async def ask():
            before = await last_stage_forwards(swarm)
            async with MinerClient(swarm["wallets"]["validator"].hotkey) as client:
                result = await client.generate(info["url"], info["hotkey"], GenerateRequest(
                    request_id="distilled-1", prompt_token_ids=swarm["prompt"], max_tokens=NEW_TOKENS,
                    temperature=0.0))
            return result, await last_stage_forwards(swarm) - before

        result, forwards = asyncio.run(ask())
        want, _ = swarm["greedy"]
        assert result.token_ids == want, (root / "route.log").read_text()[-2000:]
        assert result.final.model_fingerprint == fingerprint(swarm["ckpt"])
        # one forward for the prompt, then one per decode or verify step: plain decoding would take one per token
        assert forwards - 1 < NEW_TOKENS // 2, forwards
    finally:
        stop_hosts({"route": proc})
