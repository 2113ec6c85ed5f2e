"""The swarm with real processes on loopback: stage miners (`python -m neurons.stage_miner`), each
holding a layer block of one tiny checkpoint, and a route driver in this process.

- routes over 2, 3 and 4 stages (block and non-block cuts) give the single-process model's greedy tokens
  exactly and its logprobs within 1e-4 (fp32), for chunked prefill, decode and teacher-forced scoring, with
  receipts that chain;
- rewind k tokens then regenerate = never having generated them;
- hostile stage traffic gets 4xx and leaves the session intact;
- a stage killed mid-generation is replaced by its spare with the same greedy tokens; a hung last stage with
  no spare ends the generation with a clear error within the timeout.
The stage processes start once for the module (in parallel); the churn tests kill theirs, so they run last.
"""
import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import aiohttp
import bittensor as bt
import pytest
import torch
from conftest import reference_greedy

from inference.decoding.sampling import SamplingParams
from inference.model.checkpoint import fingerprint, make_random_checkpoint
from inference.model.config import ModelConfig
from inference.model.k3 import ResidualState
from inference.model.tokenizer import load_tokenizer
from inference.serving.builders import load_reference_model
from inference.serving.engine import EngineError, FinalEvent, GenerationRequest
from localnet.cheats.stage import stop_hosts
from neurons.swarm.codec import encode_ids, encode_state
from neurons.swarm.route import MetagraphDirectory, RouteDriver, RouteEngine, StaticDirectory
from protocol.auth import sign_request
from protocol.stage import (CLOSE_PATH, FORWARD_PATH, ForwardHeader, StageAnnouncement, WireTensorSpec, encode_frame,
                            verify_receipt)

ROOT = Path(__file__).resolve().parent.parent
START_TIMEOUT_S = 240.0
HOP_TIMEOUT_S = 3.0
PROMPT = [(11 * j + 5) % 256 for j in range(21)]
STAGES = {"a": "0-3", "b": "4-5", "c": "6-8", "c2": "6-8", "d": "9-12", "e": "6-12", "f": "4-12"}
ROUTES = {2: ["a", "f"], 3: ["a", "b", "e"], 4: ["a", "b", "c", "d"]}


def hotkey_wallet(root: Path, name: str):
    wallet = bt.Wallet(name, "default", path=str(root))
    wallet.create_new_hotkey(use_password=False, suppress=True)
    return wallet


@pytest.fixture(scope="module")
def swarm(tmp_path_factory):
    root = tmp_path_factory.mktemp("swarm")
    ckpt = root / "ckpt"
    make_random_checkpoint(ModelConfig.tiny(), ckpt, seed=0)
    wallets = {name: hotkey_wallet(root / "wallets", name) for name in [*STAGES, "driver", "attacker"]}
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
           "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    procs, ready = {}, {}
    for name, layers in STAGES.items():
        ready[name] = root / f"{name}.ready"
        procs[name] = subprocess.Popen(
            [sys.executable, "-m", "neurons.stage_miner", "--checkpoint", str(ckpt), "--serve-layers", layers,
             "--wallet-name", name, "--wallet-path", str(root / "wallets"), "--threads", "1",
             "--hop-timeout-s", str(HOP_TIMEOUT_S), "--max-body-bytes", str(1 << 20), "--max-tokens-per-forward",
             "64", "--ready-file", str(ready[name])],
            cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=open(root / f"{name}.log", "w"))
    info = {}
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while len(info) < len(STAGES):
            for name, path in ready.items():
                if name not in info and path.exists():
                    info[name] = json.loads(path.read_text())
                if procs[name].poll() is not None:
                    raise RuntimeError(f"stage {name} exited: {(root / f'{name}.log').read_text()[-2000:]}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"stages not ready in {START_TIMEOUT_S} s: {sorted(set(STAGES) - set(info))}")
            time.sleep(0.2)
        model, _, _ = load_reference_model(ckpt, verify=False)
        yield {"root": root, "ckpt": ckpt, "wallets": wallets, "procs": procs, "info": info, "model": model,
               "config": ModelConfig.tiny(), "tokenizer": load_tokenizer(ckpt, ModelConfig.tiny())}
    finally:
        stop_hosts(procs)


def make_engine(swarm, names, prefill_chunk=8):
    urls = [swarm["info"][n]["url"] for n in names]
    driver = RouteDriver(StaticDirectory(urls), swarm["wallets"]["driver"].hotkey, swarm["config"],
                         hop_timeout_s=HOP_TIMEOUT_S)
    return RouteEngine(driver, swarm["tokenizer"], prefill_chunk=prefill_chunk,
                       model_fingerprint=fingerprint(swarm["ckpt"]))


async def generate(engine, prompt, n, on_token=None):
    stream = engine.generate(GenerationRequest(prompt, SamplingParams(max_tokens=n, ignore_eos=True, logprobs=2)))
    tokens, lps, final = [], [], None
    async for ev in stream:
        if isinstance(ev, FinalEvent):
            final = ev
        else:
            tokens.append(ev.token_id)
            lps.append(ev.logprob)
            if on_token:
                await on_token(len(tokens))
    return tokens, lps, final


@pytest.mark.parametrize("hops", [2, 3, 4])
def test_route_matches_single_process(swarm, hops):
    want, want_lp = reference_greedy(swarm["model"], PROMPT, 8)
    seq = PROMPT + want
    ref = torch.log_softmax(swarm["model"].forward([torch.tensor(seq)], [swarm["model"].new_cache()],
                                                   all_logits=True)[0], -1)

    async def main():
        engine = make_engine(swarm, ROUTES[hops])
        async with engine:
            assert [s.hotkey for s in engine.driver.current] == [swarm["info"][n]["hotkey"] for n in ROUTES[hops]]
            tokens, lps, final = await generate(engine, PROMPT, 8)
            receipts = engine.driver.last_receipts
            scored = await engine.score(seq, top_k=2)
            return tokens, lps, final, receipts, scored

    tokens, lps, final, receipts, scored = asyncio.run(main())
    assert tokens == want
    assert max(abs(a - b) for a, b in zip(lps, want_lp)) < 1e-4
    assert final.finish_reason == "length" and final.completion_tokens == 8
    # one signed receipt per stage, in route order, chaining output to input
    assert [r.stage for r in receipts] == [swarm["info"][n]["hotkey"] for n in ROUTES[hops]]
    assert all(verify_receipt(r) for r in receipts)
    assert all(a.output_sha256 == b.input_sha256 for a, b in zip(receipts, receipts[1:]))
    assert [r.layers for r in receipts][0][0] == 0 and receipts[-1].layers[1] == 13
    assert [s.position for s in scored] == list(range(1, len(seq)))
    for s in scored:
        assert abs(s.logprob - float(ref[s.position - 1, seq[s.position]])) < 1e-4
        assert s.top[0][0] == int(torch.argmax(ref[s.position - 1]))


def test_rewind_then_regenerate(swarm):
    alt = [65, 66, 67]

    async def run_tokens(driver, rs, tokens):
        outs = []
        for t in tokens:
            outs.append((await driver.run(rs, [([t], "sample", None)]))[0])
        return outs

    async def main():
        engine = make_engine(swarm, ROUTES[4])
        async with engine:
            d = engine.driver
            rs = await d.open(SamplingParams(), 0)
            first = (await d.run(rs, [(PROMPT, "sample", None)]))[0]
            gen = [first.token_id]
            for _ in range(5):
                gen.append((await run_tokens(d, rs, [gen[-1]]))[0].token_id)
            # 6 generated, 5 fed; rewind 3 of them and feed the same ones again: the same continuation
            await d.rewind(rs, len(PROMPT) + 2)
            again = await run_tokens(d, rs, gen[2:5])
            # rewind into the prompt and feed something else: as if a fresh session had seen only that
            await d.rewind(rs, len(PROMPT) - 4)
            other = await run_tokens(d, rs, alt)
            fresh = await d.open(SamplingParams(), 0)
            base = (await d.run(fresh, [(PROMPT[:-4], "none", None)]))[0]
            fresh_other = await run_tokens(d, fresh, alt)
            # fork: two sessions from one state continue identically and independently
            forked = await d.fork(rs)
            one = await run_tokens(d, rs, [7, 8])
            two = await run_tokens(d, forked, [7, 8])
            for x in (rs, fresh, forked):
                await d.close(x)
            assert [o.token_id for o in one] == [o.token_id for o in two]
            assert max(abs(a.logprob - b.logprob) for a, b in zip(one, two)) < 1e-6
            return gen, again, other, fresh_other, base

    gen, again, other, fresh_other, base = asyncio.run(main())
    want, _ = reference_greedy(swarm["model"], PROMPT, 6)
    assert gen == want
    assert [o.token_id for o in again] == gen[3:6]
    assert [o.token_id for o in other] == [o.token_id for o in fresh_other]
    assert max(abs(a.logprob - b.logprob) for a, b in zip(other, fresh_other)) < 1e-5
    assert base.mode == "none"


def test_hostile_traffic_is_refused_and_sessions_survive(swarm):
    info, wallets = swarm["info"], swarm["wallets"]
    target = info["b"]  # layers 4-5: its upstream is stage a
    upstream_key, attacker = wallets["a"].hotkey, wallets["attacker"].hotkey
    D = swarm["config"].hidden_size

    def state_frame(rs, position, n=2, width=D, blocks=2, fill=None, dtype="float32", step=99):
        g = torch.Generator().manual_seed(1)
        st = ResidualState((n,), [torch.randn(n, width, generator=g) for _ in range(blocks)],
                           torch.randn(n, width, generator=g))
        if fill is not None:
            st.partial[0, 0] = fill
        specs, body = encode_state(st, dtype)
        return encode_frame(ForwardHeader(route_id=rs.route_id, session=rs.session, step=step, position=position,
                                          tensors=specs), body)

    async def post(http, key, path, body, receiver=None, headers=None):
        h = headers or sign_request(key, "POST", path, body, receiver or target["hotkey"])
        async with http.post(target["url"] + path, data=body, headers=h) as r:
            return r.status, await r.read(), h

    async def main():
        engine = make_engine(swarm, ROUTES[4])
        async with engine:
            d = engine.driver
            rs = await d.open(SamplingParams(), 0)
            out = (await d.run(rs, [(PROMPT, "sample", None)]))[0]
            pos = rs.position
            statuses = {}
            async with aiohttp.ClientSession() as http:
                good = state_frame(rs, pos)
                statuses["unsigned"] = (await post(http, None, FORWARD_PATH, good, headers={"X": "1"}))[0]
                h = sign_request(upstream_key, "POST", FORWARD_PATH, good, target["hotkey"])
                statuses["tampered"] = (await post(http, None, FORWARD_PATH, good[:-4] + b"\0\0\0\0", headers=h))[0]
                statuses["wrong_receiver"] = (await post(http, upstream_key, FORWARD_PATH, good,
                                                         receiver=attacker.ss58_address))[0]
                statuses["not_upstream"] = (await post(http, attacker, FORWARD_PATH, good))[0]
                close = json.dumps({"session": "nope"}).encode()
                s1, _, h1 = await post(http, attacker, CLOSE_PATH, close)
                statuses["unknown_session"] = s1
                statuses["replay"] = (await post(http, None, CLOSE_PATH, close, headers=h1))[0]
                statuses["wrong_width"] = (await post(http, upstream_key, FORWARD_PATH, state_frame(rs, pos, width=D + 1)))[0]
                statuses["wrong_blocks"] = (await post(http, upstream_key, FORWARD_PATH, state_frame(rs, pos, blocks=3)))[0]
                statuses["nan"] = (await post(http, upstream_key, FORWARD_PATH, state_frame(rs, pos, fill=float("nan"))))[0]
                statuses["inf_bf16"] = (await post(http, upstream_key, FORWARD_PATH,
                                                   state_frame(rs, pos, fill=float("inf"), dtype="bfloat16")))[0]
                statuses["wrong_position"] = (await post(http, upstream_key, FORWARD_PATH, state_frame(rs, pos + 3)))[0]
                statuses["oversized"] = (await post(http, upstream_key, FORWARD_PATH, good + b"\0" * (1 << 20)))[0]
                statuses["garbage"] = (await post(http, upstream_key, FORWARD_PATH, b"not a frame at all"))[0]
                short = bytearray(good)
                statuses["truncated"] = (await post(http, upstream_key, FORWARD_PATH, bytes(short[:-8])))[0]
                ids_specs, ids_body = encode_ids([1, 2])
                statuses["ids_to_middle"] = (await post(http, upstream_key, FORWARD_PATH, encode_frame(
                    ForwardHeader(route_id=rs.route_id, session=rs.session, step=9, position=pos,
                                  tensors=ids_specs), ids_body)))[0]
                lying = encode_frame(ForwardHeader(route_id=rs.route_id, session=rs.session, step=9, position=pos,
                                                   tensors=[WireTensorSpec(name="partial", dtype="float32",
                                                                       shape=[1 << 16, 1 << 16])]), b"")
                statuses["lying_shape"] = (await post(http, upstream_key, FORWARD_PATH, lying))[0]
                statuses["control_by_stranger"] = (await post(
                    http, attacker, CLOSE_PATH, json.dumps({"session": rs.session}).encode()))[0]
            # the session is intact: the route continues exactly like the reference
            nxt = (await d.run(rs, [([out.token_id], "sample", None)]))[0]
            await d.close(rs)
            return statuses, [out.token_id, nxt.token_id]

    statuses, tokens = asyncio.run(main())
    expected = {"unsigned": 401, "tampered": 401, "wrong_receiver": 403, "not_upstream": 403,
                "unknown_session": 404, "replay": 401, "wrong_width": 400, "wrong_blocks": 400, "nan": 400,
                "inf_bf16": 400, "wrong_position": 409, "oversized": 413, "garbage": 400, "truncated": 400,
                "ids_to_middle": 400, "lying_shape": 400, "control_by_stranger": 403}
    assert statuses == expected
    assert tokens == reference_greedy(swarm["model"], PROMPT, 2)[0]


def announcement(info: dict, config_hash: str, **change) -> str:
    start, stop = (int(x) for x in info["layers"].split("-"))
    fields = dict(config_hash=config_hash, start=start, stop=stop + 1, fingerprint=info["fingerprint"])
    return StageAnnouncement(**{**fields, **change}).text()


def test_metagraph_directory_finds_announced_stages(swarm):
    """Stages are found from the chain: a registered hotkey's commitment announces (model, layers, stage
    fingerprint), its axon says where; the capabilities it serves must be its own and say the same."""
    from chain.devnet import DevnetChain

    root, info, wallets = swarm["root"], swarm["info"], swarm["wallets"]
    config_hash = swarm["config"].config_hash()
    owner = bt.Wallet("owner", "default", path=str(root / "wallets"))
    owner.create_new_coldkey(use_password=False, suppress=True)
    owner.create_new_hotkey(use_password=False, suppress=True)

    def port(name):
        return int(info[name]["url"].rsplit(":", 1)[1])

    async def main():
        chain = DevnetChain(root / "devnet.sqlite", create=True, block_interval=0.2)
        try:
            netuid = await chain.create_subnet(owner, tempo=10_000)
            cold = owner.coldkeypub.ss58_address
            for name in [*ROUTES[4], "e", "f"]:
                await chain.register_hotkey(netuid, info[name]["hotkey"], cold)
                await chain.publish_endpoint(info[name]["hotkey"], netuid, "127.0.0.1", port(name))
            for name in ROUTES[4]:
                await chain.publish_commitment(info[name]["hotkey"], netuid, announcement(info[name], config_hash))
            # e announces layers it does not serve; f announces nothing (a whole-model miner looks like this)
            await chain.publish_commitment(info["e"]["hotkey"], netuid,
                                           announcement(info["e"], config_hash, stop=9))
            # a neuron announcing and pointing at another stage's endpoint is not that stage
            impostor = wallets["attacker"].hotkey.ss58_address
            await chain.register_hotkey(netuid, impostor, cold)
            await chain.publish_endpoint(impostor, netuid, "127.0.0.1", port("b"))
            await chain.publish_commitment(impostor, netuid, announcement(info["b"], config_hash))
            directory = MetagraphDirectory(chain, netuid, config_hash=config_hash)
            driver = RouteDriver(directory, wallets["driver"].hotkey, swarm["config"], hop_timeout_s=HOP_TIMEOUT_S)
            engine = RouteEngine(driver, swarm["tokenizer"])
            async with engine:
                found = await driver.stages(refresh=True)
                tokens, _, _ = await generate(engine, PROMPT, 3)
            announced = {n.hotkey for n, _ in await directory.announced()}
            other_model = await MetagraphDirectory(chain, netuid, config_hash="0" * 16).announced()
            return {s.hotkey for s in found}, [s.hotkey for s in driver.current], tokens, announced, other_model
        finally:
            await chain.close()

    found, route, tokens, announced, other_model = asyncio.run(main())
    assert found == {info[n]["hotkey"] for n in ROUTES[4]}
    assert route == [info[n]["hotkey"] for n in ROUTES[4]]
    assert tokens == reference_greedy(swarm["model"], PROMPT, 3)[0]
    assert info["f"]["hotkey"] not in announced and info["e"]["hotkey"] in announced and other_model == []


def test_miner_protocol_serves_a_route_unchanged(swarm):
    """The miner server (signed generate/score for validators) over a RouteEngine instead of a whole model."""
    from chain import connect
    from chain.devnet import DevnetChain
    from neurons.base.settings import ChainSettings
    from neurons.miner_app import AccessSettings, MinerServer, MinerSettings, ServerSettings
    from protocol.auth import SQLiteNonceStore
    from protocol.client import MinerClient
    from protocol.schemas import GenerateRequest, ScoreRequest
    from protocol.signature import verify_final

    root = swarm["root"]
    people = {}
    for name in ("m_owner", "m_miner", "m_validator"):
        w = bt.Wallet(name, "default", path=str(root / "wallets"))
        w.create_new_coldkey(use_password=False, suppress=True)
        w.create_new_hotkey(use_password=False, suppress=True)
        people[name] = w
    devnet = root / "miner_devnet.sqlite"

    async def main():
        chain = DevnetChain(devnet, create=True, block_interval=0.2)
        try:
            netuid = await chain.create_subnet(people["m_owner"], tempo=10_000)
            await chain.register(people["m_miner"], netuid)
            await chain.register(people["m_validator"], netuid)
            await chain.add_stake(people["m_validator"], people["m_validator"], netuid, 100.0)
        finally:
            await chain.close()
        settings = MinerSettings(
            chain=ChainSettings(network=f"devnet:{devnet}", netuid=netuid, metagraph_refresh_s=60.0, timeout_s=10.0),
            server=ServerSettings(host="127.0.0.1", port=0, publish=False, metrics=False, metrics_port=0,
                                  nonce_store=str(root / "m_nonces.sqlite"), shutdown_grace_s=0.0),
            access=AccessSettings(min_validator_stake=5.0))
        miner_chain = connect(settings.chain.network)
        miner = MinerServer(settings, engine=make_engine(swarm, ROUTES[3]), tokenizer=swarm["tokenizer"],
                            chain=miner_chain, wallet=people["m_miner"],
                            nonce_store=SQLiteNonceStore(settings.server.nonce_store))
        await miner.start()
        try:
            hotkey = people["m_miner"].hotkey.ss58_address
            async with MinerClient(people["m_validator"].hotkey) as client:
                caps = await client.capabilities(miner.url, hotkey)
                result = await client.generate(miner.url, hotkey, GenerateRequest(
                    request_id="swarm-1", prompt_token_ids=PROMPT, max_tokens=4, temperature=0.0))
                scored = await client.score(miner.url, hotkey, ScoreRequest(
                    request_id="swarm-2", token_ids=PROMPT[:8]))
            ok = verify_final(result.final, result.body, result.token_ids, hotkey)
            return caps, result.token_ids, ok, scored
        finally:
            await miner.close(grace_s=0.0)
            await miner_chain.close()

    caps, tokens, signed, scored = asyncio.run(main())
    assert tokens == reference_greedy(swarm["model"], PROMPT, 4)[0] and signed
    # the miner takes the engine's capabilities once, before the engine planned its first route
    assert caps.layout["swarm"] is True and caps.engine == "sharded"
    ref = torch.log_softmax(swarm["model"].forward([torch.tensor(PROMPT[:8])], [swarm["model"].new_cache()],
                                                   all_logits=True)[0], -1)
    got = {p.position: p.logprob for p in scored.scores}
    assert set(got) == set(range(1, 8))
    assert max(abs(got[q] - float(ref[q - 1, PROMPT[q]])) for q in got) < 1e-4


def test_killed_stage_is_replaced_by_spare(swarm):
    want, want_lp = reference_greedy(swarm["model"], PROMPT, 12)
    procs, info = swarm["procs"], swarm["info"]

    async def main():
        engine = make_engine(swarm, ["a", "b", "c", "c2", "d"])
        async with engine:
            killed = {}

            async def on_token(n):
                if n == 4:
                    victim = next(name for name in ("c", "c2")
                                  if info[name]["hotkey"] == engine.driver.current[2].hotkey)
                    procs[victim].kill()
                    procs[victim].wait()
                    killed["name"] = victim
            tokens, lps, final = await generate(engine, PROMPT, 12, on_token)
            route = [s.hotkey for s in engine.driver.current]
            return tokens, lps, final, engine.recoveries, killed["name"], route

    tokens, lps, final, recoveries, victim, route = asyncio.run(main())
    spare = "c2" if victim == "c" else "c"
    assert tokens == want and max(abs(a - b) for a, b in zip(lps, want_lp)) < 1e-4
    assert recoveries >= 1 and final.finish_reason == "length"
    assert route == [info[n]["hotkey"] for n in ("a", "b", spare, "d")]
    swarm["dead"] = victim


def test_hung_last_stage_without_spare_is_a_clear_error(swarm):
    procs = swarm["procs"]
    alive = "c2" if swarm.get("dead") == "c" else "c"
    limit = HOP_TIMEOUT_S * 5 + 10  # the step deadline for 4 hops, a probe and the re-plan

    async def main():
        engine = make_engine(swarm, ["a", "b", alive, "d"])
        async with engine:
            stamps = {}

            async def on_token(n):
                if n == 2:
                    procs["d"].send_signal(signal.SIGSTOP)  # hangs: accepts TCP, never answers
                    stamps["t"] = time.monotonic()
            with pytest.raises(EngineError) as e:
                await generate(engine, PROMPT, 12, on_token)
            return e.value, time.monotonic() - stamps["t"]

    try:
        error, elapsed = asyncio.run(main())
    finally:
        procs["d"].send_signal(signal.SIGCONT)
    assert error.code == "engine_unavailable" and "layer 9" in error.message
    assert elapsed < limit
