"""The validator checks and pays swarm stage miners (neurons/validator_app/stage_rounds.py) against real stage
processes on loopback: `python -m localnet.cheats.stage` hosts serving the trained tiny K3 in three blocks (honest
fp32 stages, an honest bf16 stage with a bf16 wire, an identical honest fp32 spare, and stage cheaters), a real
SQLite store, real sr25519 hotkeys, a devnet subnet where every stage miner is registered and announces itself.

- sessions the validator drives through a route, checked after they ran from the stages' ledgers against the
  model's measured stage envelope: honest fp32 and bf16 stages are never blamed; each cheater is blamed within
  its stated number of checked sessions (CHEATERS), whatever it knows of how it is checked;
- a ValidatorLoop round on the devnet finds the stage miners, drives and checks its sessions, and gives the honest
  stages weight and the blamed cheaters 0 with the reason in `validator.py status`;
- identical honest stages of one block share the sessions and are paid in proportion to their measured weights;
- a stage that went away after serving is not checked, and not blamed;
- route work: genuine receipts for requests the validator sent the driver credit the stages (at most the tokens it
  measured for each request); sessions nobody asked for credit nothing; receipts the stages never signed blame
  the driver.
"""
import asyncio
import collections
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import aiohttp
import pytest
import torch

from chain.devnet import DevnetChain
from inference.decoding.sampling import SamplingParams
from inference.model import read_config
from inference.model.tokenizer import load_tokenizer
from inference.serving import EngineSpec
from inference.serving.builders import load_reference_model
from inference.serving.engine import GenerationRequest
from localnet.cheats.stage import start_hosts, stop_hosts
from neurons.base.settings import ChainSettings, WalletSettings
from neurons.swarm.route import RouteDriver, RouteEngine, StaticDirectory, TrustedDirectory
from neurons.validator_app.rounds import ValidatorLoop
from neurons.validator_app.settings import RoundSettings, ValidatorSettings
from neurons.validator_app.stage_rounds import StageMiner, StageRounds, attach_stage_rounds
from neurons.validator_app.status import status_report
from neurons.validator_app.store import ValidatorStore
from scoring.metrics import Measurement

ROOT = Path(__file__).resolve().parent.parent
ENVELOPE = ROOT / "scoring" / "envelopes" / "tiny_trained.json"
HONEST = {"h0": "0-2", "h1": "3-8", "h2": "9-12"}
SPARES = {"s1": "3-8"}  # fp32, identical to h1
BF16 = {"b1": "3-8"}
# name: (kind, layers, most checked sessions until blamed; docs/verification.md, stage checks)
CHEATERS = {"echo": ("echo", "3-8", 5), "fewer": ("fewer-experts", "3-8", 6), "sparse": ("sparse-liar", "3-8", 5),
            "watch": ("watch-aware", "3-8", 5), "ledger": ("ledger-liar", "3-8", 1),
            "hide": ("refuse-ledger", "3-8", 5), "skip": ("skip-layer", "9-12", 6)}


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread():
    """The validator's reference computations in this process on one thread (on a loaded 2-core box, torch's
    thread pool spinning against other processes makes them ~10x slower); restored afterwards."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def swarm(tmp_path_factory, make_wallets, make_subnet, trained_checkpoint):
    root = tmp_path_factory.mktemp("stage-rounds")
    names = [*HONEST, *SPARES, *BF16, *CHEATERS]
    wallets = make_wallets(root / "wallets", ["owner", "validator", "driver", "decoy", *names])
    netuid, uids = make_subnet(root / "devnet.sqlite", wallets, ["validator", "driver", *names], {"validator": 1000.0})
    hosts = {
        "honest": [f"{n}:honest:{l}" for n, l in {**HONEST, **SPARES}.items()],
        "bf16": [f"{n}:honest:{l}:bfloat16:bfloat16" for n, l in BF16.items()],
        "cheats": [f"{n}:{kind}:{l}" for n, (kind, l, _) in CHEATERS.items()],
    }
    chain = ["--network", f"devnet:{root / 'devnet.sqlite'}", "--netuid", str(netuid)]  # each stage announces itself
    procs, info = start_hosts(trained_checkpoint, root / "wallets", hosts, root, {h: chain for h in hosts})
    try:
        model, tokenizer, _ = load_reference_model(trained_checkpoint, verify=False)
        yield {"root": root, "ckpt": trained_checkpoint, "wallets": wallets, "netuid": netuid, "uids": uids,
               "info": info, "model": model, "tokenizer": tokenizer, "config": read_config(trained_checkpoint),
               "procs": procs}
    finally:
        stop_hosts(procs)


async def stage_rounds(swarm, store, names, seed=3, **kw) -> StageRounds:
    """StageRounds whose route driver sees the stages `names` only (a route through exactly them)."""
    directory = StaticDirectory([swarm["info"][n]["url"] for n in names])
    sr = StageRounds(store, swarm["wallets"]["validator"].hotkey, swarm["model"], swarm["tokenizer"], directory,
                     swarm["config"], seed=seed, envelope=str(ENVELOPE), timeout_s=10.0, **kw)
    await sr.start()
    await sr._ensure_model()
    infos = {i.hotkey: i for i in await directory.stages(sr._http)}
    sr.miners = {v["hotkey"]: StageMiner(swarm["uids"][n], v["hotkey"], "cold-" + n, infos[v["hotkey"]])
                 for n, v in swarm["info"].items() if v["hotkey"] in infos}
    store.save_stage_miners([dict(uid=m.uid, hotkey=m.hotkey, layers=m.label, url=m.info.url)
                             for m in sr.miners.values()])
    return sr


def rows_of(store, swarm, name):
    return [r for r in store.stage_checks() if r["hotkey"] == swarm["info"][name]["hotkey"]]


def test_a_stage_the_listing_dropped_after_it_served_is_still_credited(swarm, tmp_path):
    """A validator just restarted (no round yet: it knows no stage miners) serves a session through a route; by the
    time it is credited, its driver's listing has dropped a stage of that route (gone unhealthy, or left after
    serving it): the stage is credited all the same, for work done on the validator's own route (RouteDriver.routed).
    Without it the session's receipts did not audit and the request's record was lost (the 5-minute soak)."""
    store = ValidatorStore(tmp_path / "v.sqlite")

    async def scenario():
        sr = await stage_rounds(swarm, store, ["h0", "h1", "h2"])
        try:
            sr.miners = {}
            assert await sr.drive_session() == 1
            gone = swarm["info"]["h1"]["hotkey"]
            sr.driver._stages = [s for s in sr.driver._stages if s.hotkey != gone]
            assert gone not in {s.hotkey for s in sr.driver.known_stages()}
            sr.credit_finished()
        finally:
            await sr.close()

    asyncio.run(asyncio.wait_for(scenario(), 300))
    for name in ("h0", "h1", "h2"):
        credited = [r for r in rows_of(store, swarm, name) if r["kind"] == "validator_work"]
        assert credited and all(r["tokens"] > 0 for r in credited), name
    store.close()


def test_checked_sessions_blame_every_cheater_and_no_honest_stage(swarm, tmp_path):
    store = ValidatorStore(tmp_path / "v.sqlite")
    took = {}

    async def scenario():
        for route in (["h0", "h1", "h2"], ["h0", "b1", "h2"]):
            sr = await stage_rounds(swarm, store, route)
            try:
                for _ in range(3):
                    assert await sr.drive_session() == 1
                summary = await sr.settle()
                assert summary["checked"] == 9 and not summary["blamed"], summary
            finally:
                await sr.close()
        for name, (kind, layers, limit) in CHEATERS.items():
            route = ["h0", name, "h2"] if layers == "3-8" else ["h0", "h1", name]
            sr = await stage_rounds(swarm, store, route, seed=len(took))
            try:
                for k in range(1, limit + 1):
                    assert await sr.drive_session() == 1
                    blamed = (await sr.settle())["blamed"]
                    if swarm["info"][name]["hotkey"] in blamed:
                        break
                took[name] = k
            finally:
                await sr.close()

    asyncio.run(asyncio.wait_for(scenario(), 900))
    for name in [*HONEST, *BF16]:
        rows = rows_of(store, swarm, name)
        checks = [r for r in rows if r["kind"] == "session_check"]
        assert checks and not any(r["blame"] for r in rows), (name, [dict(r) for r in rows if r["blame"]])
        assert all(r["outside"] is None for r in checks), [r["outside"] for r in checks]
    bf16 = [r for r in rows_of(store, swarm, "b1") if r["kind"] == "session_check"]
    assert all(r["numerics"] == "bfloat16" and r["median_rel_l2"] > 0 for r in bf16)
    for name, (kind, _, limit) in CHEATERS.items():
        blames = [r for r in rows_of(store, swarm, name) if r["blame"]]
        assert blames, f"{kind} was not blamed in {limit} checked sessions"
        print(f"{kind}: blamed after {took[name]} checked sessions ({blames[0]['kind']}: {blames[0]['reason'][:120]})")
    assert [r["kind"] for r in rows_of(store, swarm, "ledger") if r["blame"]][0] == "session_lie"
    # the stage hiding its ledger was checked from its neighbours' ledgers all the same
    assert any(r["kind"] == "session_check" for r in rows_of(store, swarm, "hide"))

    async def trusted():
        async with aiohttp.ClientSession() as http:
            everyone = StaticDirectory([v["url"] for v in swarm["info"].values()])
            return {s.hotkey for s in await TrustedDirectory(everyone, store).stages(http)}

    routable = asyncio.run(trusted())  # a route driver following this validator's trust
    assert routable == {swarm["info"][n]["hotkey"] for n in [*HONEST, *SPARES, *BF16]}
    store.close()


def test_identical_honest_stages_share_the_sessions_and_the_pay(swarm, tmp_path):
    """The validator's driver draws each session's stage of a block weighted by capacity over measured step time:
    over 24 sessions h1 and its identical spare s1 each carry a share, each credited layer-tokens in proportion to
    the weight the driver measured for it (within 1.5x; the weights themselves follow the step times the machine
    gave each at the time, which on a loaded box drift apart)."""
    store = ValidatorStore(tmp_path / "v.sqlite")

    async def scenario():
        sr = await stage_rounds(swarm, store, ["h0", "h1", "s1", "h2"], seed=9, organic_audit_rate=0.0)
        try:
            sr.rng.seed(4)
            for _ in range(24):
                assert await sr.drive_session() == 1
            sr._own.clear()  # settle them as organic (unchecked): this test is about the sharing
            await sr.settle()
            return sr.stage_work(), sr.driver._measured_weights(sr.driver.known_stages())
        finally:
            await sr.close()

    work, weights = asyncio.run(asyncio.wait_for(scenario(), 600))
    uids, info = swarm["uids"], swarm["info"]
    a, b = work[uids["h1"]].verified_tokens, work[uids["s1"]].verified_tokens
    wa, wb = weights[info["h1"]["hotkey"]], weights[info["s1"]["hotkey"]]
    assert a > 0 and b > 0 and 1 / 1.5 <= (a / wa) / (b / wb) <= 1.5, (a, b, wa, wb)
    store.close()


def test_a_stage_gone_after_serving_is_not_checked_and_not_blamed(swarm, tmp_path):
    """Faults are not lies: a session ran, then every stage of its route stopped answering (SIGSTOP of their host
    processes): the validator can read no ledger, records an `unchecked` row for each stage, and blames no one. (One
    stage gone alone is still checked: its neighbours' ledgers hold its inputs and outputs; test_stage_sessions.)"""
    store = ValidatorStore(tmp_path / "v.sqlite")
    hosts = [swarm["procs"]["bf16"], swarm["procs"]["honest"]]

    async def scenario():
        sr = await stage_rounds(swarm, store, ["h0", "b1", "h2"], seed=5)
        sr.timeout_s = sr.auditor.timeout_s = 1.0
        try:
            assert await sr.drive_session() == 1
            for host in hosts:
                host.send_signal(signal.SIGSTOP)
            try:
                return await sr.settle()
            finally:
                for host in hosts:
                    host.send_signal(signal.SIGCONT)
        finally:
            await sr.close()

    summary = asyncio.run(asyncio.wait_for(scenario(), 300))
    for name in ("h0", "b1", "h2"):
        rows = rows_of(store, swarm, name)
        assert [r["kind"] for r in rows if r["kind"] != "validator_work"] == ["unchecked"], [dict(r) for r in rows]
    assert not summary["blamed"] and not any(r["blame"] for r in store.stage_checks())
    store.close()


@pytest.mark.timeout(900)
def test_a_validator_round_zeroes_cheaters_with_the_reason(swarm, tmp_path):
    """ValidatorLoop.run_round on the devnet, two rounds: the stage miners are found from the metagraph, the
    validator drives its sessions through them (balanced over the stages of each block), checks every one, and the
    weight vector gives every honest stage that served weight and every blamed cheater 0; `validator.py status`
    names the reason."""
    db = tmp_path / "validator.sqlite"
    w = swarm["wallets"]["validator"]
    settings = ValidatorSettings(
        chain=ChainSettings(network=f"devnet:{swarm['root'] / 'devnet.sqlite'}", netuid=swarm["netuid"],
                            metagraph_refresh_s=0.5, timeout_s=10.0),
        wallet=WalletSettings(name="validator", hotkey="default", path=str(swarm["root"] / "wallets")),
        engine=EngineSpec(checkpoint=str(swarm["ckpt"])), reference_engine=True, db=str(db),
        rounds=RoundSettings(interval_s=0.0, seed=11, stage_sessions=8))

    async def scenario():
        chain = DevnetChain(swarm["root"] / "devnet.sqlite")
        store = ValidatorStore(db)
        loop = ValidatorLoop(settings, chain=chain, wallet=w, store=store, tokenizer=swarm["tokenizer"])
        stage = attach_stage_rounds(loop, settings)
        stage.reference = swarm["model"]  # the same weights the block reference would read; loaded once here
        try:
            t0 = time.monotonic()
            for _ in range(2):
                await loop.run_round()
            return loop.current_weights(), time.monotonic() - t0
        finally:
            await loop.close()
            await chain.close()
            store.close()

    weights, seconds = asyncio.run(asyncio.wait_for(scenario(), 880))
    print(f"two validator rounds with {len(swarm['info'])} stage miners: {seconds:.1f} s")
    uids = swarm["uids"]
    with ValidatorStore(db, readonly=True) as store:
        status = {r["uid"]: r for r in status_report(store)["stage_miners"]}
    assert set(status) == {uids[n] for n in swarm["info"]}
    for name in [*HONEST, *SPARES, *BF16]:
        assert not status[uids[name]]["blamed"], (name, status[uids[name]])
    for name in HONEST:  # alone in their block: on every route
        assert weights[uids[name]] > 0, (name, status[uids[name]])
    caught = [n for n in CHEATERS if status[uids[n]]["blamed"]]
    # the skipper shares its block with one honest stage (half the sessions); the cheaters of 3-8 share theirs with
    # eight others, and some of them may not have been routed through often enough yet
    assert "skip" in caught, {n: status[uids[n]] for n in CHEATERS}
    for name in caught:
        assert weights.get(uids[name], 0.0) == 0.0 and status[uids[name]]["reason"]
    assert sum(weights.values()) == pytest.approx(1.0)
    out = subprocess.run([sys.executable, "-m", "neurons.validator", "status", "--db", str(db)],
                         capture_output=True, text=True, timeout=60, cwd=ROOT,
                         env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert out.returncode == 0 and "swarm stage miners" in out.stdout and "outside" in out.stdout


# ---------------------------------------------------------------- route work claimed by outside drivers
async def driven_records(swarm, key, request_id: str, tokens=6):
    """The StepRecords of one request a RouteDriver signed by `key` drove over the honest stages."""
    urls = [swarm["info"][n]["url"] for n in HONEST]
    driver = RouteDriver(StaticDirectory(urls), key, swarm["config"], record_steps=64)
    engine = RouteEngine(driver, load_tokenizer(swarm["ckpt"], swarm["config"]), prefill_chunk=8)
    try:
        await engine.start()
        request = GenerationRequest(list(range(40, 60)), SamplingParams(max_tokens=tokens, ignore_eos=True),
                                    request_id)
        [e async for e in engine.generate(request)]
        return list(driver.records)
    finally:
        await engine.stop()


def measured(store, request_id: str, hotkey: str, prompt: int, completion: int) -> None:
    """A measurement of a request this validator sent `hotkey` (what the route work is credited against)."""
    m = Measurement(uid=7, hotkey=hotkey, at=time.time(), kind="chat", request_id=request_id, outcome="completed",
                    prompt_tokens=prompt, completion_tokens=completion)
    store.add_measurements([(m, None)], 1)


def test_route_work_is_credited_only_for_requests_the_validator_sent(swarm, tmp_path):
    """The work endpoint (POST /route/work) over HTTP: the route miner's `WorkReport` claims its sessions; those
    serving a request this validator sent it are credited, at most the tokens it measured for the request; a
    self-driving route miner's sessions nobody asked for (`SelfDriver`: genuine receipts, a real request id
    reused) credit nothing more; receipts the stages never signed blame the driver (`ReceiptForger`) and zero
    it in the weights; bad claims get 4xx with a message."""
    from localnet.cheats.route import ReceiptForger
    from neurons.route_miner import WorkReport
    from neurons.swarm.signed_http import post_signed
    from protocol.route_work import ROUTE_WORK_PATH
    from protocol.stage import Hop
    from scoring.stage_rewards import MinerWork
    from scoring.weights import with_stage_miners

    store = ValidatorStore(tmp_path / "v.sqlite")
    driver_key = swarm["wallets"]["driver"].hotkey
    forger_key = swarm["wallets"]["owner"].hotkey
    validator_key = swarm["wallets"]["validator"].hotkey

    class Driver:  # what WorkReport reads of a RouteDriver: the records it drove
        def __init__(self, records):
            self.records = collections.deque(records)

    async def scenario():
        sr = await stage_rounds(swarm, store, list(HONEST), work_port=0)
        sr.serving = {driver_key.ss58_address, forger_key.ss58_address}
        hop = Hop(url=sr.work_server.url, hotkey=validator_key.ss58_address)
        asked = await driven_records(swarm, driver_key, "req-asked")
        measured(store, "req-asked", driver_key.ss58_address, prompt=20, completion=6)
        again = await driven_records(swarm, driver_key, "req-asked")  # the same request driven once more
        nobody = await driven_records(swarm, driver_key, "")  # a session of its own
        out = {}
        async with aiohttp.ClientSession() as http:
            out["asked"] = await WorkReport(Driver(asked), driver_key, hop).submit(http)
            out["again"] = await WorkReport(Driver(again + nobody), driver_key, hop).submit(http)
            forger = ReceiptForger(Driver(await driven_records(swarm, forger_key, "req-forger")), forger_key, hop)
            measured(store, "req-forger", forger_key.ss58_address, prompt=20, completion=6)
            out["forged"] = await forger.submit(http)
            status, answer = await post_signed(http, driver_key, hop, ROUTE_WORK_PATH, b'{"steps": []}', 10.0,
                                               "application/json")
            out["empty"] = (status, answer.decode())
        await sr.close()
        whole = {7: 1.0, 8: 1.0}
        work = {7: MinerWork(driver_key.ss58_address, 100, 10.0), 8: MinerWork(forger_key.ss58_address, 100, 10.0)}
        out["weights"] = with_stage_miners(whole, work, sr.evidence())
        out["fed"] = sum(int(r.input_specs[0].shape[0]) for r in asked)
        return out

    out = asyncio.run(asyncio.wait_for(scenario(), 300))
    assert out["asked"] == 200 and out["again"] == 200 and out["forged"] == 422
    assert out["empty"][0] == 400 and "route work" in out["empty"][1]
    work = [r for r in store.stage_checks() if r["kind"] == "route_work"]
    assert {r["hotkey"] for r in work} == {swarm["info"][n]["hotkey"] for n in HONEST}
    assert {r["request_id"] for r in work} == {"req-asked"}
    per_stage = collections.Counter()
    for r in work:
        per_stage[r["hotkey"]] += r["tokens"]
    # the request's fed tokens (prompt and completion but the last token), and of the second session of the same
    # request no more than fits twice what was measured for it (26 tokens; room for drafts and recoveries); the
    # session nobody asked for adds nothing
    assert len(set(per_stage.values())) == 1 and out["fed"] <= per_stage.most_common(1)[0][1] <= 2 * 26
    blamed = [r for r in store.stage_checks() if r["blame"]]
    assert [r["hotkey"] for r in blamed] == [forger_key.ss58_address] and blamed[0]["kind"] == "route_receipts"
    assert out["weights"].get(8, 0.0) == 0.0 and out["weights"].get(7, 0.0) > 0.0
    store.close()



def test_receipts_credit_only_the_driver_whose_session_they_are_and_its_retry_is_not_blamed(swarm, tmp_path):
    """Every stage's receipt names the driver that opened the session. A thief that saw an honest driver's
    receipts (a stage on its route sees those of the stages before it) presents them first, for a request the
    validator did send the thief: it is blamed and credited nothing, and the honest driver's claim is credited
    after it. The honest route miner's `WorkReport` then sends the same batch again (its answer was lost to a
    timeout: the validator was paused, or the link cut): told those steps were credited before, credited nothing
    twice, blamed for nothing. The session drawn for a check lets its claimed steps go once checked."""
    from neurons.route_miner import WorkReport
    from neurons.swarm.signed_http import post_signed
    from protocol.route_work import ROUTE_WORK_PATH, RouteWork
    from protocol.stage import Hop

    store = ValidatorStore(tmp_path / "v.sqlite")
    driver_key = swarm["wallets"]["driver"].hotkey
    thief_key = swarm["wallets"]["owner"].hotkey

    class Driver:
        def __init__(self, records):
            self.records = collections.deque(records)

    async def scenario():
        sr = await stage_rounds(swarm, store, list(HONEST), work_port=0, work_audit_rate=1.0)
        sr.serving = {driver_key.ss58_address, thief_key.ss58_address}
        sr.claim_settle_s = 0.2
        hop = Hop(url=sr.work_server.url, hotkey=swarm["wallets"]["validator"].hotkey.ss58_address)
        records = await driven_records(swarm, driver_key, "req-retry")
        measured(store, "req-retry", driver_key.ss58_address, prompt=20, completion=6)
        measured(store, "req-retry", thief_key.ss58_address, prompt=20, completion=6)
        body = RouteWork(steps=WorkReport(Driver([]), driver_key, hop).claims(records)).model_dump_json().encode()
        out = {}
        async with aiohttp.ClientSession() as http:
            for name, key in (("thief", thief_key), ("first", driver_key), ("again", driver_key)):
                status, answer = await post_signed(http, key, hop, ROUTE_WORK_PATH, body, 10.0, "application/json")
                out[name] = (status, json.loads(answer))
        await asyncio.wait_for(asyncio.gather(*sr._audits), 120)
        out["claimed"] = dict(sr._claimed)
        await sr.close()
        return out, len(records), {r.session for r in records}

    out, steps, sessions = asyncio.run(asyncio.wait_for(scenario(), 300))
    assert out["thief"][0] == 422 and f"a session {driver_key.ss58_address} opened" in \
        out["thief"][1]["error"]["message"], out["thief"]
    assert out["first"][0] == 200 and out["first"][1]["credited_tokens"] > 0, out["first"]
    assert out["again"] == (200, {"steps": steps, "credited_tokens": 0, "held_steps": 0, "uncredited_steps": 0,
                                  "credited_before_steps": steps}), out["again"]
    work = [r for r in store.stage_checks() if r["kind"] == "route_work"]
    assert sum(r["tokens"] for r in work) == out["first"][1]["credited_tokens"]
    assert {r["origin"] for r in work} == {driver_key.ss58_address}
    blamed = [r["hotkey"] for r in store.stage_checks() if r["blame"]]
    assert blamed == [thief_key.ss58_address]
    checked = {r["hotkey"] for r in store.stage_checks() if r["kind"] in ("session_check", "unchecked")}
    assert checked == {swarm["info"][n]["hotkey"] for n in HONEST}, store.stage_checks()  # the check ran
    assert out["claimed"] == {session: None for session in sessions}
    store.close()


def test_route_work_through_a_stage_the_round_did_not_find_waits_for_it_and_blames_nobody(swarm, tmp_path):
    """A stage that was restarting when the validator's round looked for stage miners (or registered since) is not
    in its list, yet an honest route driver's receipts name it: the claim is held, neither credited nor blamed, and
    credited once a round has found the stage. Receipts in the name of a stage the round did not find, signed by
    another key (`ReceiptForger`), still blame the driver."""
    from localnet.cheats.route import ReceiptForger
    from neurons.route_miner import WorkReport
    from protocol.stage import Hop

    store = ValidatorStore(tmp_path / "v.sqlite")
    driver_key = swarm["wallets"]["driver"].hotkey
    h1 = swarm["info"]["h1"]["hotkey"]

    class Driver:
        def __init__(self, records):
            self.records = collections.deque(records)

    async def scenario():
        sr = await stage_rounds(swarm, store, list(HONEST), work_port=0)
        sr.serving = {driver_key.ss58_address}
        found = dict(sr.miners)
        del sr.miners[h1]  # the round did not reach it
        hop = Hop(url=sr.work_server.url, hotkey=swarm["wallets"]["validator"].hotkey.ss58_address)
        out = {}
        async with aiohttp.ClientSession() as http:
            measured(store, "req-held", driver_key.ss58_address, prompt=20, completion=6)
            out["held"] = await WorkReport(Driver(await driven_records(swarm, driver_key, "req-held")), driver_key,
                                           hop).submit(http)
            out["rows_while_held"] = [dict(r) for r in store.stage_checks()
                                      if r["kind"] in ("route_work", "route_receipts")]
            sr.miners = found  # the next round finds it
            out["credited"] = sr.credit_held()
            # the first two blocks' stages not found again: receipts in their names they did not sign are forged
            sr.miners = {h: m for h, m in found.items() if h == swarm["info"]["h2"]["hotkey"]}
            measured(store, "req-forged", driver_key.ss58_address, prompt=20, completion=6)
            out["forged"] = await ReceiptForger(Driver(await driven_records(swarm, driver_key, "req-forged")),
                                                driver_key, hop).submit(http)
        await sr.close()
        return out

    out = asyncio.run(asyncio.wait_for(scenario(), 300))
    assert out["held"] == 200 and out["rows_while_held"] == []
    work = [r for r in store.stage_checks() if r["kind"] == "route_work"]
    assert out["credited"] > 0 and {r["request_id"] for r in work} == {"req-held"}
    assert {r["hotkey"] for r in work} == {swarm["info"][n]["hotkey"] for n in HONEST}
    assert out["forged"] == 422
    blamed = [r for r in store.stage_checks() if r["blame"]]
    assert [r["hotkey"] for r in blamed] == [driver_key.ss58_address] and "not a registered stage miner" in \
        blamed[0]["reason"]
    store.close()


def test_a_route_drivers_failed_answer_through_a_stage_since_blamed_is_excused(tmp_path):
    """The route miner served an answer through a stage that lied (not yet blamed: the driver could not know) and
    failed its audit: once the stage is blamed, the answer is excused (neither verified nor a failure), in the
    validator's window and its store. A failure on a route of honest stages, and a whole-model miner's, stand."""
    from dataclasses import replace

    from neurons.validator_app.stage_rounds import excuse_route_failures
    from scoring.metrics import MeasurementWindow

    store = ValidatorStore(tmp_path / "v.sqlite")
    now = time.time()

    def answer(request_id, hotkey, uid, hard):
        return Measurement(uid=uid, hotkey=hotkey, at=now - 30, kind="chat", request_id=request_id,
                           outcome="completed", prompt_tokens=20, completion_tokens=6, audits=1,
                           audit_failures=int(hard), quality=0.0 if hard else 1.0, hard_failure=hard,
                           failures="replay_mismatch (hard)" if hard else "")

    rows = [answer("r-liar", "driver", 5, True), answer("r-fine", "driver", 5, False),
            answer("r-honest-route", "driver", 5, True), answer("r-miner", "miner", 6, True)]
    store.add_measurements([(m, None) for m in rows], 1)
    window = MeasurementWindow()
    window.extend(rows)
    for request_id, route in (("r-liar", ("s0", "liar", "s2")), ("r-fine", ("s0", "spare", "s2")),
                              ("r-honest-route", ("s0", "spare", "s2"))):
        for hotkey in route:
            store.add_stage_check(dict(hotkey=hotkey, kind="route_work", passed=1, blame=0, tokens=26,
                                       request_id=request_id, origin="driver"))
    assert excuse_route_failures(store, window, now - 3600) == 0  # nobody blamed yet
    store.add_stage_check(dict(hotkey="liar", kind="session_check", passed=0, blame=1,
                               reason="verdict: 5 of its last 5 checks lie outside the honest float32 envelope"))
    assert excuse_route_failures(store, window, now - 3600) == 1
    got = {m.request_id: m for m in window.rows()}
    assert got["r-liar"].outcome == "excused" and not got["r-liar"].hard_failure and not got["r-liar"].audit_failures
    assert "stage liar" in got["r-liar"].failures and "replay_mismatch" in got["r-liar"].failures
    assert got["r-honest-route"].hard_failure and got["r-miner"].hard_failure and got["r-fine"].outcome == "completed"
    stored = store.request_measurement("r-liar", "driver")
    assert stored["outcome"] == "excused" and not stored["hard_failure"]
    assert excuse_route_failures(store, window, now - 3600) == 0  # once
    late = answer("r-after", "driver", 5, True)  # served through the stage after its blame: it could have avoided it
    late = replace(late, at=time.time() + 1)
    store.add_measurements([(late, None)], 2)
    window.add(late)
    store.add_stage_check(dict(hotkey="liar", kind="route_work", passed=1, blame=0, tokens=26, request_id="r-after",
                               origin="driver"))
    assert excuse_route_failures(store, window, now - 3600) == 0
    store.close()

# ---------------------------------------------------------------- the stage-round settings (no stage processes)
def stage_flags(ckpt, wallets_root, *more):
    from neurons.validator_app.settings import read_validator_settings

    return read_validator_settings(["--checkpoint", str(ckpt), "--reference-engine", "--netuid", "1",
                                    "--wallet.name", "validator", "--wallet.path", str(wallets_root), *more],
                                   environ={})


def test_stage_flags_reach_the_stage_rounds(tmp_path, make_wallets, trained_checkpoint):
    import types

    import bittensor as bt

    from neurons.validator_app.stage_rounds import decoy_keypair

    wallets = make_wallets(tmp_path / "wallets", ["validator"])
    bt.Wallet("validator", "decoy", path=str(tmp_path / "wallets")).create_new_hotkey(use_password=False,
                                                                                      suppress=True)
    settings = stage_flags(trained_checkpoint, tmp_path / "wallets", "--stage-sessions", "5", "--stage-max-tokens",
                           "24", "--stage-work-audit-rate", "0.5", "--stage-timeout-s", "7", "--stage-blame-s", "60",
                           "--stage-window-s", "120", "--stage-decoys", "6-8:9310, 9-12:9311", "--stage-decoy-hotkey",
                           "decoy", "--gateway-route-audit-rate", "0.3")
    assert settings.problems() == []
    store = ValidatorStore(tmp_path / "v.sqlite")
    loop = types.SimpleNamespace(store=store, wallet=wallets["validator"], tokenizer=None, stage=None, chain=None)
    sr = attach_stage_rounds(loop, settings)
    assert loop.stage is sr
    assert (sr.sessions, sr.max_tokens, sr.work_audit_rate, sr.organic_audit_rate, sr.timeout_s, sr.blame_s,
            sr.window_s) == (5, 24, 0.5, 0.3, 7.0, 60.0, 120.0)
    assert sr.decoys == {(6, 9): 9310, (9, 13): 9311}
    assert sr.envelope and Path(sr.envelope).name == "tiny_trained.json"  # the shipped envelope of this model
    assert sr.decoy_keypair.ss58_address == decoy_keypair(settings).ss58_address != \
        wallets["validator"].hotkey.ss58_address
    store.close()


@pytest.mark.parametrize("flags, problem", [
    (("--stage-sink-url", "ftp://203.0.113.7:9300", "--stage-sink-port", "9300"), "must be http(s)://HOST:PORT"),
    (("--stage-sink-url", "http://0.0.0.0:9300", "--stage-sink-port", "9300"), "0.0.0.0 is a bind address"),
    (("--stage-sink-url", "http://203.0.113.7:9300"), "needs a fixed --stage-sink-port"),
    (("--stage-sink-host", "0.0.0.0"), "give --stage-sink-url"),
    (("--stage-decoys", "6-8", "--stage-decoy-hotkey", "d"), "is not LAYERS:PORT"),
    (("--stage-decoys", "6-8:9310,6-8:9311", "--stage-decoy-hotkey", "d"), "names block 6-8 twice"),
    (("--stage-decoys", "6-8:9310",), "needs --stage-decoy-hotkey"),
    (("--stage-max-tokens", "2"), "at least 4"),
    (("--stage-work-audit-rate", "1.5"), "must lie in [0, 1]"),
    (("--gateway", "--gateway-api-keys", "k.txt", "--gateway-route", "first", "--stage-sessions", "0"),
     "--gateway-route needs the validator's stage checks"),
])
def test_bad_stage_flags_get_a_clear_error(tmp_path, trained_checkpoint, flags, problem):
    problems = stage_flags(trained_checkpoint, tmp_path, *flags).problems()
    assert any(problem in p for p in problems), problems


def test_the_decoy_hotkey_must_not_be_the_validators(tmp_path, make_wallets, trained_checkpoint):
    from neurons.validator_app.settings import ValidatorSetupError
    from neurons.validator_app.stage_rounds import decoy_keypair

    make_wallets(tmp_path / "wallets", ["validator"])
    for hotkey, problem in (("default", "must not be the validator's own"), ("missing", "'missing'")):
        settings = stage_flags(trained_checkpoint, tmp_path / "wallets", "--stage-decoys", "6-8:9310",
                               "--stage-decoy-hotkey", hotkey)
        with pytest.raises(ValidatorSetupError, match=problem):
            decoy_keypair(settings)




def test_outside_route_work_pays_a_blocks_checked_stages_by_their_own_work_not_by_the_drivers_choice():
    """A route miner that keeps one route sends all its (genuine, requested) work to the stages it favours; pooled
    per block and split by the work the validator's own driver spread by load, identical stages are paid alike,
    while a blamed stage keeps only what it did and takes no share."""
    from neurons.validator_app.stage_rounds import pooled_route_work
    from scoring.stage_rewards import MinerWork

    work = {1: MinerWork("a", 0, 10.0, layers=(0, 3)), 2: MinerWork("b", 0, 10.0, layers=(3, 9)),
            3: MinerWork("c", 0, 10.0, layers=(3, 9)), 4: MinerWork("d", 0, 10.0, layers=(3, 9), failed_checks=["x"]),
            5: MinerWork("e", 0, 10.0, layers=(9, 13))}
    own = {1: 100, 2: 100, 3: 110, 4: 90, 5: 0}
    outside = {1: 5000, 2: 5000, 3: 0, 4: 700, 5: 300}
    tokens = pooled_route_work(work, own, outside)
    assert tokens[1] == 5100  # alone in its block: all of it
    assert tokens[2] == 100 + round(5000 * 100 / 210) and tokens[3] == 110 + round(5000 * 110 / 210)
    assert 1 / 1.5 < tokens[2] / tokens[3] < 1.5  # the favoured stage and its identical rival: paid alike
    assert tokens[4] == 790  # blamed (zeroed anyway): its own, no share of the others'
    assert tokens[5] == 300  # no work of the validator's own in the block: left where it fell
    assert sum(tokens[u] for u in (2, 3)) == 100 + 110 + 5000
