"""The validator checks and pays swarm stage miners (neurons/validator_app/stage_rounds.py), against real stage
processes on loopback: three processes of `python -m localnet.cheats.stage` (honest fp32 stages for every block,
honest bf16 stages with a bf16 wire for two blocks, and every stage cheater), a real SQLite store, real sr25519
hotkeys, a devnet subnet where every stage miner is registered and announces itself (endpoint and stage
announcement, as stage_miner does).

- challenges over the stage wire: honest fp32 and bf16 stages are never blamed; each cheater is blamed within
  its stated number of challenges (CHEATERS); the forwarder is caught by the validator's decoy;
- a block the validator holds no copy of: each challenge is checked against two other stage miners of the block
  on other coldkeys; a cheater is blamed when both peers agree and disagree with it, an honest stage (fp32 or
  bf16) never, not even with a cheating peer (then the disagreement is recorded);
- a relayed route with one cheater in it: the answer fails, bisection blames that stage only;
- a ValidatorLoop round on the devnet finds the stage miners, challenges them, zeroes the cheaters in the
  weight vector with the reason in `validator.py status`;
- a route driver's receipts: genuine ones credit the stages, receipts the stages never signed blame the driver.
"""
import asyncio
import collections
import json
import os
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from bittensor.sp_core import Keypair

from chain.devnet import DevnetChain
from inference.model import ModelConfig
from inference.model.tokenizer import load_tokenizer
from inference.serving import EngineSpec
from inference.serving.builders import load_reference_model
from localnet.cheats.stage import start_hosts, stop_hosts
from neurons.base.settings import ChainSettings, WalletSettings
from neurons.swarm.route import RouteDriver, RouteEngine, StaticDirectory, TrustedDirectory
from neurons.validator_app.rounds import ValidatorLoop
from neurons.validator_app.settings import RoundSettings, ValidatorSettings
from neurons.validator_app.stage_rounds import StageMiner, StageRounds, attach_stage_rounds
from neurons.validator_app.status import status_report
from neurons.validator_app.store import ValidatorStore
from protocol.stage import sign_receipt

ROOT = Path(__file__).resolve().parent.parent
HONEST = {"h0": "0-2", "h1": "3-5", "h2": "6-8", "h3": "9-12"}
BF16 = {"b1": "3-5", "b3": "9-12", "b4": "3-5"}
# name: (kind, layers, most challenges until blamed; miss chances in docs/swarm.md section 10)
CHEATERS = {"weights": ("other-weights", "3-5", 1), "skip": ("skip-layer", "9-12", 1), "echo": ("echo", "0-2", 1),
            "sessions": ("session-liar", "3-5", 12), "long": ("long-position-liar", "6-8", 12),
            "replay": ("replay", "6-8", 3), "forwarder": ("forwarder", "6-8", 12)}
HONEST_CHALLENGES = 3


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread():
    """The validator's reference computations in this process on one thread (on a loaded 2-core box, torch's
    thread pool spinning against other processes makes them ~10x slower); restored afterwards."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def swarm(tmp_path_factory, make_wallets, make_subnet, tiny_checkpoint, free_port):
    root = tmp_path_factory.mktemp("stage-rounds")
    names = [*HONEST, *BF16, *CHEATERS]
    wallets = make_wallets(root / "wallets", ["owner", "validator", "driver", "decoy", *names])
    netuid, uids = make_subnet(root / "devnet.sqlite", wallets, ["validator", *names], {"validator": 1000.0})
    decoy_port = free_port()
    hosts = {
        "honest": [f"{n}:honest:{l}" for n, l in HONEST.items()],
        "bf16": [f"{n}:honest:{l}:bfloat16:bfloat16" for n, l in BF16.items()],
    }
    chain = ["--network", f"devnet:{root / 'devnet.sqlite'}", "--netuid", str(netuid)]  # each stage announces itself
    procs, info = start_hosts(tiny_checkpoint, root / "wallets", hosts, root, {h: chain for h in hosts})
    try:
        # the forwarder hands its sessions to the honest 6-8 stage or to the validator's decoy
        more, cheats = start_hosts(tiny_checkpoint, root / "wallets",
                                   {"cheats": [f"{n}:{kind}:{l}" for n, (kind, l, _) in CHEATERS.items()]}, root,
                                   {"cheats": chain + ["--forward-to", f"http://127.0.0.1:{decoy_port}",
                                                       "--forward-to", info["h2"]["url"]]})
        procs.update(more)
        info.update(cheats)

        async def announced():
            chain = DevnetChain(root / "devnet.sqlite")
            try:
                return {n.hotkey for n in (await chain.metagraph(netuid)).neurons if n.endpoint is not None}, \
                    set(await chain.commitments(netuid))
            finally:
                await chain.close()

        endpoints, commitments = asyncio.run(announced())
        assert {v["hotkey"] for v in info.values()} <= endpoints & commitments
        model, tokenizer, _ = load_reference_model(tiny_checkpoint, verify=False)
        yield {"root": root, "ckpt": tiny_checkpoint, "wallets": wallets, "netuid": netuid, "uids": uids,
               "info": info, "model": model, "tokenizer": tokenizer, "decoy_port": decoy_port}
    finally:
        stop_hosts(procs)


async def stage_rounds(swarm, store, seed=3):
    sr = StageRounds(store, swarm["wallets"]["validator"].hotkey, swarm["model"], swarm["tokenizer"], seed=seed,
                     decoy_keypair=swarm["wallets"]["decoy"].hotkey, decoys={(6, 9): swarm["decoy_port"]})
    await sr.start()
    await sr._start_decoys()
    infos = {i.hotkey: i for i in await StaticDirectory([v["url"] for v in swarm["info"].values()]).stages(sr._http)}
    miners = {}
    for name, v in swarm["info"].items():
        miners[name] = StageMiner(swarm["uids"][name], v["hotkey"], "cold-" + name, infos[v["hotkey"]])
    sr.miners = {m.hotkey: m for m in miners.values()}
    store.save_stage_miners([dict(uid=m.uid, hotkey=m.hotkey, layers=m.label, url=m.info.url) for m in miners.values()])
    return sr, miners


def test_challenges_blame_every_cheater_and_no_honest_stage(swarm, tmp_path):
    store = ValidatorStore(tmp_path / "v.sqlite")
    table = {}

    async def scenario():
        sr, miners = await stage_rounds(swarm, store)
        try:
            for name in [*HONEST, *BF16]:
                for _ in range(HONEST_CHALLENGES):
                    r = await sr.challenge(miners[name])
                    assert r.ok, f"honest stage {name} ({miners[name].label}) blamed: {r.reason}"
            for name, (kind, _, limit) in CHEATERS.items():
                t0 = time.monotonic()
                for k in range(1, limit + 1):
                    r = await sr.challenge(miners[name])
                    if not r.ok or store.stage_blame(miners[name].hotkey, 0):
                        break
                blame = store.stage_blame(miners[name].hotkey, 0)
                assert blame, f"{kind} passed {limit} challenges"
                table[kind] = (k, time.monotonic() - t0, blame[-1]["kind"], blame[-1]["reason"])
        finally:
            await sr.close()

    async def trusted():
        import aiohttp

        async with aiohttp.ClientSession() as http:
            everyone = StaticDirectory([v["url"] for v in swarm["info"].values()])
            return {s.hotkey for s in await TrustedDirectory(everyone, store).stages(http)}

    asyncio.run(asyncio.wait_for(scenario(), 300))
    routable = asyncio.run(trusted())  # a route driver following this validator's trust
    assert routable == {swarm["info"][n]["hotkey"] for n in [*HONEST, *BF16]}
    for kind, (k, s, how, why) in table.items():
        print(f"{kind}: blamed after {k} challenges, {s:.1f} s ({how}: {why[:100]})")
    assert table["forwarder"][2] == "decoy" and "without saying so" in table["forwarder"][3]
    honest = [r for r in store.stage_checks() if r["hotkey"] in {swarm["info"][n]["hotkey"] for n in [*HONEST, *BF16]}]
    assert len(honest) == HONEST_CHALLENGES * (len(HONEST) + len(BF16))
    assert all(r["passed"] and not r["blame"] for r in honest)
    bf16 = [r for r in honest if r["hotkey"] in {swarm["info"][n]["hotkey"] for n in BF16}]
    assert all(r["median_rel_l2"] < 0.05 for r in bf16) and any(r["median_rel_l2"] > 0 for r in bf16)
    assert all(r["commitment"] and r["seed"] and r["nonce"] for r in honest)  # committed, then revealed
    store.close()


def test_cross_checks_against_two_peers_blame_only_when_both_peers_agree(swarm, tmp_path):
    store = ValidatorStore(tmp_path / "v.sqlite")
    verdicts = {}

    async def scenario():
        sr, miners = await stage_rounds(swarm, store, seed=7)
        sr.own_layers = (0, 3)  # the validator checks 0-2 itself; 3-5 only against peers
        try:
            for name, peers in (("h1", ("b1", "b4")), ("b1", ("h1", "b4")), ("b4", ("b1", "h1"))):
                for _ in range(2):
                    r = await sr.cross_check(miners[name], [miners[p] for p in peers])
                    assert r.verdict == "pass", f"honest {name} vs {peers}: {r.verdict}: {r.reason}"
            r = await sr.cross_check(miners["weights"], [miners["h1"], miners["b1"]])
            verdicts["weights"] = r
            # an honest stage with one cheating peer: the peers disagree, nobody is blamed
            verdicts["honest-with-cheating-peer"] = await sr.cross_check(miners["h1"], [miners["b4"],
                                                                                      miners["weights"]])
            for k in range(1, CHEATERS["sessions"][2] + 1):
                r = await sr.cross_check(miners["sessions"], [miners["h1"], miners["b4"]])
                if r.verdict == "blame":
                    break
            verdicts["sessions"] = (k, r)
            # peers are picked on other coldkeys than the stage's and each other's, never a blamed stage
            sr.miners[miners["b4"].hotkey] = replace(miners["b4"], coldkey=miners["h1"].coldkey)
            assert len(sr.peers_for(miners["b1"])) == 1  # h1 and b4 share a coldkey; the cheaters are blamed
            verdicts["no-peers"] = await sr.challenge(miners["b1"])
            sr.miners[miners["b4"].hotkey] = miners["b4"]
            picked = sr.peers_for(miners["b1"])
            assert {p.hotkey for p in picked} == {miners["h1"].hotkey, miners["b4"].hotkey}
            verdicts["picked"] = await sr.challenge(miners["b1"])  # outside own_layers: a cross-check
            verdicts["own"] = await sr.challenge(miners["h0"])  # inside: against the validator's own copy
        finally:
            await sr.close()

    asyncio.run(asyncio.wait_for(scenario(), 300))
    assert verdicts["weights"].verdict == "blame" and "both peers agree" in verdicts["weights"].reason
    mixed = verdicts["honest-with-cheating-peer"]
    assert mixed.verdict == "undecided" and mixed.agree["stage-a"] and not mixed.agree["a-b"], mixed.reason
    k, r = verdicts["sessions"]
    assert r.verdict == "blame", f"the session liar passed {k} cross-checks"
    assert verdicts["no-peers"] is None
    assert verdicts["picked"].verdict == "pass" and not hasattr(verdicts["own"], "verdict") and verdicts["own"].ok
    hk = {n: swarm["info"][n]["hotkey"] for n in swarm["info"]}
    rows = store.stage_checks()
    assert {r["hotkey"] for r in rows if r["blame"]} == {hk["weights"], hk["sessions"]}
    disagreements = [r for r in rows if r["kind"] == "disagreement"]
    assert {r["hotkey"] for r in disagreements} >= {hk["h1"], hk["b4"], hk["weights"]}
    assert all(not r["blame"] for r in disagreements)
    passed = [r for r in rows if r["kind"] == "challenge" and r["passed"] and r["hotkey"] in (hk["h1"], hk["b1"])]
    assert passed and all("checked against" in r["reason"] and r["tokens"] > 0 for r in passed)
    print(f"session liar blamed by two peers after {k} cross-checks")
    store.close()


def test_a_route_with_one_cheater_bisects_to_it(swarm, tmp_path):
    store = ValidatorStore(tmp_path / "v.sqlite")

    async def scenario():
        sr, miners = await stage_rounds(swarm, store, seed=5)
        try:
            route = [miners[n] for n in ("h0", "weights", "h2", "b3")]
            t0 = time.monotonic()
            a = await sr.route_probe(route)
            t1 = time.monotonic()
            b = await sr.route_probe([miners[n] for n in ("h0", "b1", "h2", "h3")])
            print(f"route probes: {t1 - t0:.1f} s with a cheater (bisected), {time.monotonic() - t1:.1f} s clean")
            return a, b
        finally:
            await sr.close()

    blamed, clean = asyncio.run(asyncio.wait_for(scenario(), 120))
    assert blamed == swarm["info"]["weights"]["hotkey"] and clean is None
    rows = store.stage_checks()
    blamed_rows = [r for r in rows if r["blame"]]
    assert [r["hotkey"] for r in blamed_rows] == [blamed] and blamed_rows[0]["kind"] == "bisection"
    assert {r["hotkey"] for r in rows if r["kind"] == "bisection" and r["passed"]} == {swarm["info"]["h0"]["hotkey"]}
    store.close()


def test_a_validator_round_zeroes_cheaters_with_the_reason(swarm, tmp_path):
    """ValidatorLoop.run_round on the devnet: the stage miners are found from the metagraph, challenged, and
    the weight vector gives every honest stage weight and every blamed cheater 0 (forwarder included: the
    validator serves a decoy); `validator.py status` names the reason."""
    db = tmp_path / "validator.sqlite"
    w = swarm["wallets"]["validator"]
    settings = ValidatorSettings(
        chain=ChainSettings(network=f"devnet:{swarm['root'] / 'devnet.sqlite'}", netuid=swarm["netuid"],
                            metagraph_refresh_s=0.5, timeout_s=10.0),
        wallet=WalletSettings(name="validator", hotkey="default", path=str(swarm["root"] / "wallets")),
        engine=EngineSpec(checkpoint=str(swarm["ckpt"])), reference_engine=True, db=str(db),
        rounds=RoundSettings(interval_s=0.0, seed=11, stage_challenges=2))

    async def scenario():
        chain = DevnetChain(swarm["root"] / "devnet.sqlite")
        store = ValidatorStore(db)
        loop = ValidatorLoop(settings, chain=chain, wallet=w, store=store, tokenizer=swarm["tokenizer"])
        stage = attach_stage_rounds(loop, settings)
        stage.model = swarm["model"]  # the same weights the loader would read; loaded once for the module
        stage.decoy_keypair, stage.decoys = swarm["wallets"]["decoy"].hotkey, {(6, 9): swarm["decoy_port"]}
        try:
            t0 = time.monotonic()
            report = await loop.run_round()
            return report, loop.current_weights(), time.monotonic() - t0
        finally:
            await loop.close()
            await chain.close()
            store.close()

    report, weights, seconds = asyncio.run(asyncio.wait_for(scenario(), 300))
    print(f"validator round with {len(swarm['info'])} stage miners: {seconds:.1f} s")
    uids = swarm["uids"]
    with ValidatorStore(db, readonly=True) as store:
        status = {r["uid"]: r for r in status_report(store)["stage_miners"]}
    assert set(status) == {uids[n] for n in swarm["info"]}
    for name in [*HONEST, *BF16]:
        assert weights[uids[name]] > 0 and not status[uids[name]]["blamed"], (name, status[uids[name]])
    caught = [n for n in CHEATERS if status[uids[n]]["blamed"]]
    for name in ("weights", "skip", "echo", "replay"):  # blamed at their first challenge
        assert name in caught, (name, status[uids[name]])
    for name in caught:
        assert weights.get(uids[name], 0.0) == 0.0 and status[uids[name]]["reason"]
    assert sum(weights.values()) == pytest.approx(1.0)
    out = subprocess.run([sys.executable, str(ROOT / "neurons" / "validator.py"), "status", "--db", str(db)],
                         capture_output=True, text=True, timeout=60, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert out.returncode == 0 and "swarm stage miners" in out.stdout and "diverge" in out.stdout


def test_route_driver_receipts_credit_stages_and_forged_ones_blame_the_driver(swarm, tmp_path):
    """`credit_route` in process: genuine receipts credit the stages once; forged, unsigned, stranger-signed and
    re-presented receipts blame the driver and credit nobody."""
    store = ValidatorStore(tmp_path / "v.sqlite")
    driver_key = swarm["wallets"]["driver"].hotkey

    async def scenario():
        sr, miners = await stage_rounds(swarm, store)
        records = await driven_records(swarm, driver_key)
        genuine = sr.credit_route(records[1:], driver_key.ss58_address)
        rec = records[0]  # the forgeries start from a step not credited yet
        victim = Keypair.create_from_uri("//not-a-stage")
        forged = sign_receipt(driver_key, **rec.receipts[1].model_dump(exclude={"stage", "signature"}))
        forged = forged.model_copy(update={"stage": rec.receipts[1].stage})
        bad = [replace(rec, receipts=(rec.receipts[0], forged, *rec.receipts[2:]))]
        unsigned = [replace(rec, receipts=tuple(r.model_copy(update={"signature": ""}) for r in rec.receipts))]
        stranger = sign_receipt(victim, **rec.receipts[2].model_dump(exclude={"stage", "signature"}))
        other = [replace(rec, receipts=(*rec.receipts[:2], stranger, rec.receipts[3]))]
        await sr.close()
        out = [sr.credit_route(x, driver_key.ss58_address) for x in (bad, unsigned, other)]
        return genuine, out, sr.credit_route(records[1:2], driver_key.ss58_address)

    genuine, (forged, unsigned, stranger), again = asyncio.run(asyncio.wait_for(scenario(), 120))
    assert genuine is None and "not signed" in forged and "not signed" in unsigned and "not a registered" in stranger
    assert "presented before" in again  # credited once, never twice
    rows = store.stage_checks()
    work = [r for r in rows if r["kind"] == "route_work"]
    assert {r["hotkey"] for r in work} == {swarm["info"][n]["hotkey"] for n in HONEST}
    assert sum(r["tokens"] for r in work) == 4 * 11  # 19 fed tokens in steps of 8, 8, 3; all but the first credited
    blamed = [r for r in rows if r["blame"]]
    # one blame row per minute and driver
    assert len(blamed) == 1 and blamed[0]["hotkey"] == driver_key.ss58_address and "not signed" in blamed[0]["reason"]
    store.close()


async def driven_records(swarm, key, tokens=20):
    """The StepRecords of one teacher-forced request a RouteDriver signed by `key` drove over the honest stages."""
    urls = [swarm["info"][n]["url"] for n in HONEST]
    driver = RouteDriver(StaticDirectory(urls), key, ModelConfig.tiny(), record_steps=8)
    engine = RouteEngine(driver, load_tokenizer(swarm["ckpt"], ModelConfig.tiny()), prefill_chunk=8)
    try:
        await engine.start()
        await engine.score(list(range(40, 40 + tokens)))
        return list(driver.records)
    finally:
        await engine.stop()


def test_route_work_endpoint_credits_a_drivers_receipts_and_blames_a_forger(swarm, tmp_path):
    """The validator's work endpoint (--stage-work-port, POST /route/work) over HTTP: the route miner's
    `WorkReport` submits what its driver drove and the stages are credited; the forging driver of the local swarm
    (`ReceiptForger`) is blamed with the reason, credits no one and is zeroed in the weights; bad claims get 4xx
    with a message, and nothing is taken before a round found the stage miners (503)."""
    import aiohttp

    from localnet.cheats.route import ReceiptForger
    from neurons.route_miner import WorkReport
    from neurons.swarm.signed_http import post_signed
    from protocol.route_work import MAX_WORK_STEPS, ROUTE_WORK_PATH
    from protocol.stage import Hop
    from scoring.stage_rewards import MinerWork
    from scoring.weights import with_stage_miners

    store = ValidatorStore(tmp_path / "v.sqlite")
    honest_key, forger_key = swarm["wallets"]["driver"].hotkey, Keypair.create_from_uri("//forger")
    validator_key = swarm["wallets"]["validator"].hotkey

    class Driver:  # what WorkReport reads of a RouteDriver: the records it drove
        def __init__(self, records):
            self.records = collections.deque(records)

    async def scenario():
        sr = StageRounds(store, validator_key, swarm["model"], swarm["tokenizer"], seed=5, work_port=0)
        await sr.start()
        hop = Hop(url=sr.work_server.url, hotkey=validator_key.ss58_address)
        honest = WorkReport(Driver(await driven_records(swarm, honest_key)), honest_key, hop)
        forger = ReceiptForger(Driver(await driven_records(swarm, forger_key, 12)), forger_key, hop)
        out = {}
        async with aiohttp.ClientSession() as http:
            out["not ready"] = await honest.submit(http)  # no round yet: kept for the next submission
            _, miners = await stage_rounds(swarm, store)
            sr.miners = {m.hotkey: m for m in miners.values()}
            sr.serving = {honest_key.ss58_address}
            out["stranger"] = await forger.submit(http)  # not a serving neuron
            sr.serving |= {forger_key.ss58_address}
            out["honest"], out["honest again"] = await honest.submit(http), await honest.submit(http)
            forger.driver.records.extend(await driven_records(swarm, forger_key, 12))
            out["forged"] = await forger.submit(http)

            async def raw(body: bytes, key=honest_key, content_type="application/json"):
                status, answer = await post_signed(http, key, hop, ROUTE_WORK_PATH, body, 10.0, content_type)
                return status, answer.decode()

            out["not json"] = await raw(b"{steps")
            out["empty"] = await raw(b'{"steps": []}')
            step = {"route_id": "r", "session": "s", "step": 0, "position": 0, "token_ids": [1],
                    "receipts": [{"x": 1}]}
            out["bad receipt"] = await raw(json.dumps({"steps": [step]}).encode())
            out["too many"] = await raw(json.dumps({"steps": [step] * (MAX_WORK_STEPS + 1)}).encode())
            async with http.post(sr.work_server.url + ROUTE_WORK_PATH, data=b'{"steps": []}') as r:
                out["unsigned"] = r.status
            async with http.get(sr.work_server.url + ROUTE_WORK_PATH) as r:
                out["GET"] = r.status
        await sr.close()
        whole = {7: 1.0, 8: 1.0}
        work = {7: MinerWork(honest_key.ss58_address, 100, 10.0), 8: MinerWork(forger_key.ss58_address, 100, 10.0)}
        out["weights"] = with_stage_miners(whole, work, sr.evidence())
        return out

    out = asyncio.run(asyncio.wait_for(scenario(), 180))
    assert out["not ready"] == 503 and out["stranger"] == 403
    assert out["honest"] == 200 and out["honest again"] is None  # everything pending went in one claim
    assert out["forged"] == 422
    for what in ("not json", "empty", "bad receipt", "too many"):
        assert out[what][0] == 400 and "route work" in out[what][1], (what, out[what])
    assert out["unsigned"] == 401 and out["GET"] == 405
    rows = store.stage_checks()
    work = [r for r in rows if r["kind"] == "route_work"]
    assert {r["hotkey"] for r in work} == {swarm["info"][n]["hotkey"] for n in HONEST}
    assert sum(r["tokens"] for r in work) == 4 * 19 and all(honest_key.ss58_address in r["reason"] for r in work)
    blamed = [r for r in rows if r["blame"]]
    assert [r["hotkey"] for r in blamed] == [forger_key.ss58_address] and blamed[0]["kind"] == "route_receipts"
    assert "not signed by" in blamed[0]["reason"]
    assert out["weights"].get(8, 0.0) == 0.0 and out["weights"].get(7, 0.0) > 0.0  # the forger zeroed
    store.close()


# ---------------------------------------------------------------- the stage-round settings (no stage processes)
def stage_flags(ckpt, wallets_root, *more):
    from neurons.validator_app.settings import read_validator_settings

    return read_validator_settings(["--checkpoint", str(ckpt), "--reference-engine", "--netuid", "1",
                                    "--wallet.name", "validator", "--wallet.path", str(wallets_root), *more],
                                   environ={})


def test_stage_flags_reach_the_stage_rounds_and_the_sink_listens_where_it_says(tmp_path, make_wallets,
                                                                               tiny_checkpoint):
    import types

    import bittensor as bt

    from neurons.validator_app.stage_rounds import decoy_keypair

    wallets = make_wallets(tmp_path / "wallets", ["validator"])
    bt.Wallet("validator", "decoy", path=str(tmp_path / "wallets")).create_new_hotkey(use_password=False,
                                                                                      suppress=True)
    sink_port = free_port()
    settings = stage_flags(tiny_checkpoint, tmp_path / "wallets", "--stage-max-tokens", "48", "--stage-route-audits",
                           "2", "--stage-timeout-s", "7", "--stage-blame-s", "60", "--stage-window-s", "120",
                           "--stage-own-layers", "0-5", "--stage-decoys", "6-8:9310, 9-12:9311",
                           "--stage-decoy-hotkey", "decoy", "--stage-sink-host", "127.0.0.1", "--stage-sink-port",
                           str(sink_port), "--stage-sink-url", f"http://localhost:{sink_port}")
    assert settings.problems() == []
    store = ValidatorStore(tmp_path / "v.sqlite")
    loop = types.SimpleNamespace(store=store, wallet=wallets["validator"], tokenizer=None, stage=None)
    sr = attach_stage_rounds(loop, settings)
    assert loop.stage is sr and (sr.max_tokens, sr.route_probes, sr.timeout_s, sr.blame_s, sr.window_s) == \
        (48, 2, 7.0, 60.0, 120.0)
    assert sr.own_layers == (0, 6) and sr.holds((3, 6)) and not sr.holds((6, 9))
    assert sr.decoys == {(6, 9): 9310, (9, 13): 9311}
    decoy = decoy_keypair(settings).ss58_address
    assert sr.decoy_keypair.ss58_address == decoy != wallets["validator"].hotkey.ss58_address

    async def sink():
        await sr.start()
        try:
            async with aiohttp.ClientSession() as http:  # the advertised address reaches the bound one
                async with http.post(sr._sink.url + "/stage/forward", data=b"x") as resp:
                    return sr._sink.url, sr._sink.port, resp.status
        finally:
            await sr.close()

    import aiohttp

    url, port, status = asyncio.run(sink())
    assert url == f"http://localhost:{sink_port}" and port == sink_port and status == 401  # unsigned: refused
    store.close()


@pytest.mark.parametrize("flags, problem", [
    (("--stage-sink-url", "ftp://203.0.113.7:9300", "--stage-sink-port", "9300"), "must be http(s)://HOST:PORT"),
    (("--stage-sink-url", "http://0.0.0.0:9300", "--stage-sink-port", "9300"), "0.0.0.0 is a bind address"),
    (("--stage-sink-url", "http://203.0.113.7:9300/sink", "--stage-sink-port", "9300"), "no path"),
    (("--stage-sink-url", "http://203.0.113.7:99999", "--stage-sink-port", "9300"), "is not a URL"),
    (("--stage-sink-url", "http://203.0.113.7:9300"), "needs a fixed --stage-sink-port"),
    (("--stage-sink-host", "0.0.0.0"), "give --stage-sink-url"),
    (("--stage-sink-host", "bad_host!"), "is not an IP address or a host name"),
    (("--stage-decoys", "6-8", "--stage-decoy-hotkey", "d"), "is not LAYERS:PORT"),
    (("--stage-decoys", "8-6:9310", "--stage-decoy-hotkey", "d"), "is not a layer block"),
    (("--stage-decoys", "6-8:9310,6-8:9311", "--stage-decoy-hotkey", "d"), "names block 6-8 twice"),
    (("--stage-decoys", "6-8:9310,0-2:9310", "--stage-decoy-hotkey", "d"), "used twice"),
    (("--stage-decoys", "6-8:9310",), "needs --stage-decoy-hotkey"),
    (("--stage-own-layers", "five"), "is not a layer block"),
    (("--stage-max-tokens", "8"), "at least 16"),
    (("--gateway", "--gateway-api-keys", "k.txt", "--gateway-route", "first", "--stage-challenges", "0"),
     "--gateway-route needs the validator's stage checks"),
    (("--gateway-route-url", "http://203.0.113.7:9400"), "needs a fixed --gateway-route-port"),
    (("--gateway-route-url", "203.0.113.7:9400", "--gateway-route-port", "9400"), "must be http(s)://HOST:PORT"),
])
def test_bad_stage_flags_get_a_clear_error(tmp_path, tiny_checkpoint, flags, problem):
    problems = stage_flags(tiny_checkpoint, tmp_path, *flags).problems()
    assert any(problem in p for p in problems), problems


def test_the_decoy_hotkey_must_not_be_the_validators(tmp_path, make_wallets, tiny_checkpoint):
    from neurons.validator_app.settings import ValidatorSetupError
    from neurons.validator_app.stage_rounds import decoy_keypair

    make_wallets(tmp_path / "wallets", ["validator"])
    for hotkey, problem in (("default", "must not be the validator's own"), ("missing", "'missing'")):
        settings = stage_flags(tiny_checkpoint, tmp_path / "wallets", "--stage-decoys", "6-8:9310",
                               "--stage-decoy-hotkey", hotkey)
        with pytest.raises(ValidatorSetupError, match=problem):
            decoy_keypair(settings)


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
