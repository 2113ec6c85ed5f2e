"""The gateway serving organic requests through a route of real stage processes (neurons/validator_app/gateway_route.py),
over the validator's own route driver: its work credited to the stages and a share of its sessions checked after
the fact.

Real parts: stage processes (`python -m localnet.cheats.stage` serving the trained tiny K3: honest stages for every
block, a spare for 3-8, and a stage that serves other weights for 3-8), the validator's gateway on loopback with
real API keys, the route's signed miner API (a MinerServer over the validator's RouteEngine, signing as the
validator, whose permit is on a devnet), the validator's SQLite store and its StageRounds with its own copy of the
weights and the model's measured stage envelope.

1. Through the honest route: every answer is served; every stage is credited the layer-tokens it served
   (`gateway_work`), before the gateway ends the user's answer, and every session (audit rate 1) is checked
   clean; the work is in the stage weights and in `validator.py status`; the same records presented again credit
   nothing.
2. Through a route with the cheater: the users are still answered; each of its sessions is checked after the fact
   and lies outside the honest envelope; after a few the cheater is blamed (a `verdict` row), and no honest stage.
3. The cheater is then left out of the route (trust); the spare carries the next request and is credited.

The route's log (--gateway-route-log) names the stages of every route it planned, in order.
"""
import asyncio
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import aiohttp
import pytest
import torch

from inference.model import read_config
from inference.serving.builders import load_reference_model
from localnet.cheats.stage import start_hosts, stop_hosts
from neurons.base.settings import ChainSettings
from neurons.gateway import GatewayServer, GatewaySettings
from neurons.swarm.route import StaticDirectory
from neurons.validator_app.gateway_route import ROUTE_UID, GatewayRoute, RouteAndMiners
from neurons.validator_app.stage_rounds import StageRounds
from neurons.validator_app.status import status_report
from neurons.validator_app.store import ValidatorStore
from protocol.client import MinerClient
from scoring.weights import with_stage_miners

ROOT = Path(__file__).resolve().parent.parent
KEY = "sk-test-route-0123456789"
MODEL = "kimi-k3-test"
HONEST = {"h0": "0-2", "h1": "3-8", "h2": "9-12", "spare": "3-8"}
ENVELOPE = ROOT / "scoring" / "envelopes" / "tiny_trained.json"


class NoMiners:
    """No whole-model miner is ranked: every organic request goes through the route."""

    def __init__(self):
        self.reports = []

    def ranked_miners(self):
        return []

    def record_organic(self, **kw):
        self.reports.append(kw)


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def world(tmp_path_factory, make_wallets, make_subnet, trained_checkpoint):
    root = tmp_path_factory.mktemp("gateway-route")
    names = [*HONEST, "cheat"]
    wallets = make_wallets(root / "wallets", ["owner", "validator", *names])
    netuid, uids = make_subnet(root / "devnet.sqlite", wallets, ["validator", *names], {"validator": 1000.0})
    procs, info = start_hosts(trained_checkpoint, root / "wallets",
                              {"honest": [f"{n}:honest:{l}" for n, l in HONEST.items()],
                               "cheats": ["cheat:other-weights:3-8"]}, root)
    keys = root / "keys.txt"
    keys.write_text(f"{KEY}\n")
    try:
        model, tokenizer, fingerprint = load_reference_model(trained_checkpoint, verify=False)
        yield dict(root=root, wallets=wallets, netuid=netuid, uids=uids, info=info, model=model, tokenizer=tokenizer,
                   fingerprint=fingerprint, keys=keys, config=read_config(trained_checkpoint))
    finally:
        stop_hosts(procs)


class CreditedBeforeAnswered(RouteAndMiners):
    """The gateway's directory, noting how many `gateway_work` rows the store holds for a route attempt's request
    when the gateway's hook returns, before the gateway writes the answer's end to the user."""

    def __init__(self, store, *args):
        super().__init__(*args)
        self.store = store
        self.rows_at_answer: list[int] = []

    def record_organic(self, *, uid, hotkey, outcome, **kw):
        done = super().record_organic(uid=uid, hotkey=hotkey, outcome=outcome, **kw)
        if uid == ROUTE_UID:
            rid = outcome.request.request_id
            self.rows_at_answer.append(sum(1 for r in self.store.stage_checks()
                                           if r["kind"] == "gateway_work" and r["request_id"] == rid))
        return done


async def complete(http, url: str, prompt: str, stream: bool) -> tuple[int, str, str]:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 16, "temperature": 0.0, "stream": stream}
    async with http.post(url + "/v1/completions", json=body, headers={"Authorization": f"Bearer {KEY}"},
                         timeout=aiohttp.ClientTimeout(total=120)) as resp:
        return resp.status, resp.headers.get("x-k3-miner-uid", ""), await resp.text()


async def settled(route: GatewayRoute, n: int, timeout_s: float = 120.0) -> dict:
    deadline = time.monotonic() + timeout_s
    while len(route.settled) < n:
        assert time.monotonic() < deadline, f"the route settled {len(route.settled)} of {n} attempts"
        await asyncio.sleep(0.1)
    return route.settled[n - 1]


def test_gateway_route_work_is_credited_and_checked_and_a_cheater_blamed(world, tmp_path):
    from chain import connect

    db = tmp_path / "validator.sqlite"
    store = ValidatorStore(db)
    info, uids = world["info"], world["uids"]
    hk = {n: v["hotkey"] for n, v in info.items()}
    store.save_stage_miners([dict(uid=uids[n], hotkey=hk[n], layers=l, url=info[n]["url"], step_ms=20.0)
                             for n, l in [*HONEST.items(), ("cheat", "3-8")]])
    validator = world["wallets"]["validator"]
    chain_settings = ChainSettings(network=f"devnet:{world['root'] / 'devnet.sqlite'}", netuid=world["netuid"],
                                   timeout_s=10.0)
    out = {}

    async def scenario():
        chain = connect(chain_settings.network)
        urls = StaticDirectory([info[n]["url"] for n in ("h0", "h1", "h2")], timeout_s=20.0)
        sr = StageRounds(store, validator.hotkey, world["model"], world["tokenizer"], urls, world["config"], seed=4,
                         organic_audit_rate=1.0, timeout_s=20.0, envelope=str(ENVELOPE),
                         model_fingerprint=world["fingerprint"])
        route = GatewayRoute(sr, validator, world["tokenizer"], chain, chain_settings,
                             nonce_store_path=str(tmp_path / "route-nonces.sqlite"), refresh_s=0.5,
                             route_log=str(tmp_path / "routes.jsonl"))
        await route.start()
        await sr._ensure_model()
        directory = CreditedBeforeAnswered(store, NoMiners(), route, "first")
        gateway = GatewayServer(directory, MinerClient(validator),
                                world["tokenizer"], GatewaySettings(enabled=True, port=0, model_name=MODEL,
                                                                    api_keys_file=str(world["keys"]), max_attempts=1))
        await gateway.start()
        try:
            async with aiohttp.ClientSession() as http:
                # 1. the honest route
                out["answers"] = [await complete(http, gateway.url, "def add(a, b):", False),
                                  await complete(http, gateway.url, "import os\n", True)]
                out["rows_at_answer"] = list(directory.rows_at_answer)
                out["honest"] = [await settled(route, 1), await settled(route, 2)]
                records = [r for r in store.stage_checks() if r["kind"] == "gateway_work"]
                out["work"], out["weights"] = sr.stage_work(), with_stage_miners({}, {}, sr.evidence())
                out["credited_rows"] = len(records)
                # 2. a route through the cheater, until it is blamed
                urls.urls = [info[n]["url"] for n in ("h0", "cheat", "h2")]
                await route.driver.stages(refresh=True)
                out["cheated"] = []
                for k in range(6):
                    out["cheated"].append(await complete(http, gateway.url, f"class Point{k}:\n", False))
                    summary = await settled(route, 3 + k)
                    if hk["cheat"] in summary["blamed"]:
                        break
                out["caught_after"] = k + 1
                # 3. the spare is back in the list with the cheater: trust leaves the cheater out
                urls.urls = [info[n]["url"] for n in ("h0", "cheat", "spare", "h2")]
                await route.driver.stages(refresh=True)
                out["spare"] = await complete(http, gateway.url, "for i in range(3):", False)
                out["after"] = await settled(route, len(route.settled) + 1)
        finally:
            await gateway.close()
            await route.close()
            await sr.close()
            await chain.close()

    asyncio.run(asyncio.wait_for(scenario(), 600))
    for status, uid, text in [*out["answers"], *out["cheated"], out["spare"]]:
        assert status == 200 and uid == str(ROUTE_UID), text[:300]
    assert "data: [DONE]" in out["answers"][1][2]
    # the stages were credited before the users' answers ended (a validator killed after answering loses nothing)
    assert len(out["rows_at_answer"]) == 2 and all(n > 0 for n in out["rows_at_answer"]), out["rows_at_answer"]
    rows = store.stage_checks()
    for s in out["honest"]:
        assert s["checked"] == 3 * s["sessions"] and not s["outside"] and not s["problems"] and not s["blamed"], s
    credited = sum(s["credited_tokens"] for s in out["honest"])
    assert credited > 0 and credited % 3 == 0  # every step's tokens, once per stage of the 3-stage route
    for n in ("h0", "h1", "h2"):  # organic work alone earns weight
        assert out["work"][uids[n]].verified_tokens > 0 and out["weights"][uids[n]] > 0, (n, out["work"][uids[n]])
    assert out["weights"].get(uids["spare"], 0.0) == 0.0 and sum(out["weights"].values()) == pytest.approx(1.0)
    blamed = [r for r in rows if r["blame"]]
    assert {r["hotkey"] for r in blamed} == {hk["cheat"]} and blamed[0]["kind"] == "verdict", [dict(r) for r in blamed]
    outside = [r for r in rows if r["kind"] == "session_check" and r["outside"]]
    assert {r["hotkey"] for r in outside} == {hk["cheat"]} and len(outside) == out["caught_after"]
    logged = [json.loads(line) for line in (tmp_path / "routes.jsonl").read_text().splitlines()]
    names = {v: n for n, v in hk.items()}
    planned = [[names[h] for h in r["route"]] for r in logged]
    assert [r for i, r in enumerate(planned) if i == 0 or r != planned[i - 1]] == [
        ["h0", "h1", "h2"], ["h0", "cheat", "h2"], ["h0", "spare", "h2"]], planned
    assert out["after"]["credited_tokens"] > 0 and not out["after"]["blamed"]
    status = {r["uid"]: r for r in status_report(store)["stage_miners"]}
    assert status[uids["spare"]]["tokens"] > 0 and status[uids["cheat"]]["blamed"]
    assert "honest" in status[uids["cheat"]]["reason"]
    store.close()
    shown = subprocess.run([sys.executable, "-m", "neurons.validator", "status", "--db", str(db)], cwd=ROOT,
                           capture_output=True, text=True, timeout=240, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert shown.returncode == 0 and "swarm stage miners" in shown.stdout, shown.stderr[-2000:]
    print(f"gateway route: {credited} layer-tokens credited through the honest route; the cheater was blamed after "
          f"{out['caught_after']} checked organic sessions")


def test_the_gateway_route_needs_the_validators_stage_checks(tmp_path, tiny_checkpoint):
    import types

    from neurons.validator_app.gateway_route import start_gateway_route
    from neurons.validator_app.settings import ValidatorSetupError, read_validator_settings

    settings = read_validator_settings(["--checkpoint", str(tiny_checkpoint), "--netuid", "1", "--gateway",
                                        "--gateway-api-keys", "k.txt", "--gateway-route", "last"], environ={})
    assert any("--gateway-route needs the validator's stage checks" in p for p in settings.problems())
    assert settings.gateway.route_refresh_s == 30.0 and settings.gateway.route_log is None
    tuned = read_validator_settings(["--checkpoint", str(tiny_checkpoint), "--netuid", "1", "--gateway-route-refresh-s",
                                     "2", "--gateway-route-log", "routes.jsonl"], environ={})
    assert tuned.gateway.route_refresh_s == 2.0 and tuned.gateway.route_log == "routes.jsonl"
    with pytest.raises(SystemExit):
        read_validator_settings(["--checkpoint", str(tiny_checkpoint), "--netuid", "1", "--gateway-route-refresh-s",
                                 "0"], environ={})
    with pytest.raises(ValidatorSetupError, match="needs the validator's stage checks"):
        asyncio.run(start_gateway_route(types.SimpleNamespace(stage=None), settings))
    with pytest.raises(ValueError, match="not first or last"):
        RouteAndMiners(NoMiners(), None, "middle")
