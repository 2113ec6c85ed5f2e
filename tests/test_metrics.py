"""Metrics of every process, scraped from real servers: a miner (in-process MinerServer on the tiny
model, real engine, devnet chain), a validator (run_validator with its organic gateway and /metrics)
scoring it and relaying one user request through the gateway, and a swarm stage miner (StageServer on the
tiny model's layers with its /metrics server, as `neurons.stage_miner --metrics` runs them) that a route
driver sent prefill, decode and score forwards through. Every metric the Grafana dashboard
(deploy/grafana/k3-subnet.json) queries must be exported by one of them, and every label a stage panel groups
by must be on the stage's series."""
from __future__ import annotations

import asyncio
import json
import logging
import re
import time
from pathlib import Path

import aiohttp
from conftest import unused_port
from prometheus_client.parser import text_string_to_metric_families

from chain import connect
from inference.serving import EngineSettings, EngineSpec, LocalEngine
from neurons.base.settings import ChainSettings, WalletSettings
from neurons.gateway import GatewaySettings
from neurons.miner_app import AccessSettings, MinerServer, MinerSettings, ServerSettings
from neurons.validator_app.rounds import run_validator
from neurons.validator_app.settings import (AuditSettings, RoundSettings, ScoringSettings, ValidatorSettings,
                                            WeightSettings)
from protocol.auth import SQLiteNonceStore

ROOT = Path(__file__).resolve().parent.parent
DASHBOARD = ROOT / "deploy" / "grafana" / "k3-subnet.json"
PROFILE = {
    "round_requests": 4, "mix_chat": 0.53, "mix_long_context": 0.0, "mix_burst": 0.34, "mix_probe": 0.13,
    "burst_capacity_fraction": [0.5, 0.5], "chat_prompt_tokens": [16, 64], "chat_max_tokens": [36, 40],
    "canary_tokens": 32, "copy_text_tokens": [8, 24], "long_context_sizes": [600], "long_context_max_tokens": [32, 32],
    "buffering_min_tokens": 32, "greedy_fraction": 1.0,
}


def samples(text: str) -> dict[tuple, float]:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


SUFFIXES = {"counter": ("_total",), "histogram": ("_bucket", "_count", "_sum"), "gauge": ("",)}


def names(text: str) -> set[str]:
    """Series names with samples, and those a declared family (# TYPE) will have once a labelled child
    exists (a counter by error code shows no series before the first error)."""
    declared = {family.name + suffix for family in text_string_to_metric_families(text)
                for suffix in SUFFIXES.get(family.type, ("",))}
    return {name for name, _ in samples(text)} | declared


STAGE = "k3_stage_"  # the stage miner's metrics (neurons/swarm/metrics.py); the others are the miner's and validator's


def dashboard_exprs() -> list[str]:
    panels = json.loads(DASHBOARD.read_text())["panels"]
    exprs = [t["expr"] for p in panels for t in p.get("targets", [])]
    assert len(exprs) >= 30
    return exprs


def metrics_in(expr: str) -> set[str]:
    """The metric names in a PromQL expression (functions and label names left out)."""
    return set(re.findall(r"\bk3[_:][A-Za-z0-9_:]+", expr))


def dashboard_metrics() -> set[str]:
    """The metric names in the dashboard's queries."""
    return {m for e in dashboard_exprs() for m in metrics_in(e)}


def grouped_by(expr: str) -> set[str]:
    """The labels an expression aggregates by (`sum by (a, b)`), less histogram_quantile's `le`."""
    return {label.strip() for group in re.findall(r"\bby \(([^)]*)\)", expr) for label in group.split(",")} - {"le"}


async def scrape(port: int) -> str:
    async with aiohttp.ClientSession() as session:
        async with session.get(f"http://127.0.0.1:{port}/metrics", timeout=aiohttp.ClientTimeout(total=10)) as r:
            assert r.status == 200
            return await r.text()


async def request_ids(session: aiohttp.ClientSession, url: str, component: str) -> list[str]:
    """X-Request-Id of three answers from `url`: to a sane client id (echoed), to one that is not (a
    spaced, over-long id: replaced by a new one) and to none (a new one)."""
    sent = [f"trace-{component}", "not a sane id " + "x" * 80, None]
    got = []
    for request_id in sent:
        headers = {"X-Request-Id": request_id} if request_id else {}
        async with session.get(url, headers=headers, timeout=aiohttp.ClientTimeout(total=10)) as response:
            assert response.status == 200, (url, response.status)
            got.append(response.headers.get("X-Request-Id"))
    assert got[0] == sent[0], (url, got)
    assert all(re.fullmatch(r"[0-9a-f]{16}", new) for new in got[1:]) and got[1] != got[2], (url, got)
    return got


def test_every_process_exports_what_the_dashboard_shows(tmp_path, make_wallets, make_subnet, tiny_checkpoint,
                                                        tiny_reference, caplog):
    caplog.set_level(logging.INFO, logger="k3.access")
    wallets = make_wallets(tmp_path / "wallets", ("owner", "miner", "validator"))
    devnet = tmp_path / "devnet.sqlite"
    netuid, _ = make_subnet(devnet, wallets, ("miner", "validator"), {"validator": 1000.0}, block_interval=0.1)
    traced = asyncio.run(_run_and_scrape(tmp_path, wallets, devnet, netuid, tiny_checkpoint, tiny_reference))
    # every server's access log has one line per request, with the id its answer carried
    access = [r for r in caplog.records if r.name == "k3.access"]
    for component, ids in traced.items():
        logged = [r.request_id for r in access if r.component == component]
        assert set(ids) <= set(logged), (component, ids, logged)


async def _run_and_scrape(tmp_path, wallets, devnet, netuid, tiny_checkpoint, tiny_reference):
    model, tokenizer, fingerprint = tiny_reference
    chain_settings = ChainSettings(network=f"devnet:{devnet}", netuid=netuid, metagraph_refresh_s=1.0, timeout_s=10.0)

    miner_settings = MinerSettings(
        chain=chain_settings,
        server=ServerSettings(host="127.0.0.1", port=0, publish=True, metrics_port=0, shutdown_grace_s=0.0,
                              nonce_store=str(tmp_path / "nonces.sqlite")),
        access=AccessSettings(min_validator_stake=5.0, requests_per_window=100_000, min_requests=1000))
    engine = LocalEngine(model, tokenizer, EngineSettings(max_context=2048, max_concurrent_sequences=4),
                         model_fingerprint=fingerprint, engine_kind="reference", layout={"processes": 1})
    miner_chain = connect(miner_settings.chain.network)
    miner = MinerServer(miner_settings, engine=engine, tokenizer=tokenizer, chain=miner_chain,
                        wallet=wallets["miner"], nonce_store=SQLiteNonceStore(miner_settings.server.nonce_store))
    await miner.start()

    keys = tmp_path / "keys.txt"
    keys.write_text("sk-test-key\n")
    metrics_port, gateway_port = unused_port(), unused_port()
    settings = ValidatorSettings(
        chain=chain_settings,
        wallet=WalletSettings(name="validator", hotkey="default", path=str(tmp_path / "wallets")),
        engine=EngineSpec(checkpoint=str(tiny_checkpoint)),
        reference_engine=True,  # a validator needs a trusted reference or a canary pool
        audits=AuditSettings(canaries=4),  # computed on the reference before the first round (the default is 64)
        db=str(tmp_path / "validator.sqlite"),
        rounds=RoundSettings(interval_s=1.0, deadline_s=120.0, seed=3),
        scoring=ScoringSettings(profile="local_testnet", overrides=json.dumps(PROFILE)),
        weights=WeightSettings(check_s=0.5),
        gateway=GatewaySettings(enabled=True, host="127.0.0.1", port=gateway_port, api_keys_file=str(keys),
                                min_score=-1.0, rate_limit_requests=2, rate_limit_window_s=600.0),
        metrics_port=metrics_port,
    )
    stop = asyncio.Event()
    validator = asyncio.create_task(run_validator(settings, stop))
    try:
        deadline = time.monotonic() + 240
        validator_text = ""
        while time.monotonic() < deadline:
            assert not validator.done(), validator.exception()
            try:
                validator_text = await scrape(metrics_port)
            except aiohttp.ClientError:
                validator_text = ""
            if samples(validator_text).get(("k3_validator_rounds_total", ()), 0) >= 1:
                break
            await asyncio.sleep(0.5)
        assert samples(validator_text).get(("k3_validator_rounds_total", ()), 0) >= 1, "no round completed"

        async with aiohttp.ClientSession() as session:
            body = {"model": "kimi-k3", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 8}
            async with session.post(f"http://127.0.0.1:{gateway_port}/v1/chat/completions", json=body,
                                    headers={"Authorization": "Bearer sk-test-key"}) as response:
                gateway_status = response.status
            async with session.post(f"http://127.0.0.1:{gateway_port}/v1/chat/completions", json=body,
                                    headers={"Authorization": "Bearer wrong"}) as response:
                assert response.status == 401
            statuses = []
            for _ in range(2):  # the key's budget is 2 requests per window: the second one here is refused
                async with session.post(f"http://127.0.0.1:{gateway_port}/v1/chat/completions", json=body,
                                        headers={"Authorization": "Bearer sk-test-key"}) as response:
                    statuses.append(response.status)
            assert statuses[-1] == 429
            async with session.post(f"http://127.0.0.1:{miner.port}/v1/generate", data=b"{}",
                                    headers={"X-Request-Id": "unsigned-1"}) as response:
                assert response.status == 401  # unsigned
                assert response.headers["X-Request-Id"] == "unsigned-1"  # refusals carry it too
            traced = {component: await request_ids(session, f"http://127.0.0.1:{port}{path}", component)
                      for component, port, path in (("miner", miner.port, "/health"),
                                                    ("miner-metrics", miner.metrics_port, "/metrics"),
                                                    ("gateway", gateway_port, "/health"),
                                                    ("validator-metrics", metrics_port, "/metrics"))}
            traced["miner"].append("unsigned-1")

        validator_text = await scrape(metrics_port)
        miner_text = await scrape(miner.metrics_port)
    finally:
        stop.set()
        await asyncio.wait_for(validator, 60)
        await miner.close(grace_s=0.0)
        await miner_chain.close()

    v, m = samples(validator_text), samples(miner_text)
    miner_uid = str(miner.uid) if getattr(miner, "uid", None) is not None else None
    scores = {labels: value for (name, labels), value in v.items() if name == "k3_validator_miner_score"}
    assert scores, "the validator exports the miner's score"
    if miner_uid is not None:
        assert any(dict(labels)["uid"] == miner_uid for labels in scores)
    # the gateway answered one request with this status, and refused one bad key
    assert v[("k3_gateway_requests_total", (("endpoint", "chat"), ("model_name", "kimi-k3"),
                                            ("status", str(gateway_status))))] == 1 + (statuses[0] == gateway_status)
    assert v[("k3_gateway_requests_total", (("endpoint", "chat"), ("model_name", "kimi-k3"), ("status", "429")))] == 1
    assert v[("k3_gateway_requests_total", (("endpoint", "chat"), ("model_name", "kimi-k3"), ("status", "401")))] == 1
    if gateway_status == 200:
        assert v[("k3_gateway_miner_attempts_total", (("result", "ok"),))] >= 1
        assert v[("k3_gateway_time_to_first_token_seconds_count", (("model_name", "kimi-k3"),))] >= 1
    # the miner's engine served the validator's round: vLLM-style counters with the model label
    model_label = (("model_name", engine.metrics.model_name),)
    assert m[("k3:generation_tokens_total", model_label)] > 0 and m[("k3:prompt_tokens_total", model_label)] > 0
    assert m[("k3:e2e_request_latency_seconds_count", model_label)] >= 1
    assert sum(value for (name, labels), value in m.items()
               if name == "k3_miner_request_duration_seconds_count") >= PROFILE["round_requests"]

    assert any(name == "k3_miner_auth_failures_total" and value >= 1 for (name, _), value in m.items())
    assert any(name == "k3_gateway_rate_limited_total" and value == 1 for (name, _), value in v.items())
    exported = names(validator_text) | names(miner_text)
    missing = sorted(metric for metric in dashboard_metrics() if not metric.startswith(STAGE) and metric not in exported)
    assert not missing, f"the dashboard queries metrics no process exports: {missing}"
    return traced


def test_a_stage_miner_exports_what_the_dashboards_stage_row_shows(tiny_checkpoint, make_wallets, tmp_path):
    """One stage serving every layer of the tiny model, driven through prefill, decode and score, and refused once."""
    from inference.decoding.sampling import SamplingParams
    from inference.model.config import ModelConfig
    from inference.model.tokenizer import load_tokenizer
    from inference.serving.engine import FinalEvent, GenerationRequest
    from inference.swarm.stage import LayerRange, Stage
    from neurons.base.observability import MetricsServer
    from neurons.swarm.route import RouteDriver, RouteEngine, StaticDirectory
    from neurons.swarm.settings import METRICS_HOST
    from neurons.swarm.stage_server import StageServer
    from protocol.stage import FORWARD_PATH

    wallets = make_wallets(tmp_path / "wallets", ("stage", "driver"))
    config = ModelConfig.tiny()

    async def main() -> str:
        every_layer = LayerRange.parse(f"0-{config.num_layers - 1}", config.num_layers)
        server = StageServer(Stage.from_checkpoint(tiny_checkpoint, every_layer), wallets["stage"].hotkey)
        server.warm_up()  # as the stage miner does: the first forward is not slow
        await server.start()
        metrics = MetricsServer(lambda: [server.metrics.registry], METRICS_HOST, 0, component="stage-metrics")
        await metrics.start()
        engine = RouteEngine(RouteDriver(StaticDirectory([server.url]), wallets["driver"].hotkey, config,
                                         hop_timeout_s=15.0), load_tokenizer(tiny_checkpoint, config), prefill_chunk=8)
        try:
            await engine.start()
            prompt = [(7 * j + 3) % 256 for j in range(10)]
            events = [e async for e in engine.generate(GenerationRequest(prompt, SamplingParams(max_tokens=3,
                                                                                                ignore_eos=True)))]
            assert isinstance(events[-1], FinalEvent) and len(events) == 4
            assert await engine.score(prompt)
            async with aiohttp.ClientSession() as session:
                async with session.post(server.url + FORWARD_PATH, data=b"unsigned") as response:
                    assert response.status == 401
            return await scrape(metrics.port)
        finally:
            await engine.stop()
            await metrics.close()
            await server.close()

    text = asyncio.run(asyncio.wait_for(main(), 120))
    got = samples(text)
    for kind in ("prefill", "decode", "score"):
        assert got[("k3_stage_forwards_total", (("kind", kind), ("layers", "0-12")))] >= 1, kind
    assert any(name == "k3_stage_refusals_total" and value >= 1 for (name, _), value in got.items())

    exported = names(text)
    stage_exprs = [e for e in dashboard_exprs() if any(m.startswith(STAGE) for m in metrics_in(e))]
    shown = {m for e in stage_exprs for m in metrics_in(e)}
    families = {re.sub(r"_total$", "", name) for name in re.findall(rf"^# TYPE ({STAGE}\w+) ", text, flags=re.M)
                if not name.endswith("_created")}  # prometheus_client's creation-time gauges
    assert len(families) >= 8 and families <= {re.sub(r"_(total|bucket|sum|count)$", "", m) for m in shown}, (
        f"a stage metric has no panel: {families}")
    missing = sorted(m for m in shown if m not in exported)
    assert not missing, f"the dashboard's stage row queries metrics the stage miner does not export: {missing}"
    labels = {name: set(dict(key)) for name, key in got}  # a family with no child yet (no failure) has no labels to see
    checked = [(expr, metric) for expr in stage_exprs for metric in metrics_in(expr) if metric in labels]
    assert len(checked) >= 8
    for expr, metric in checked:
        assert grouped_by(expr) <= labels[metric], (expr, metric, labels[metric])


def test_the_dashboard_check_can_fail():
    assert "k3:time_to_first_token_seconds_bucket" in dashboard_metrics()
    assert grouped_by("histogram_quantile(0.95, sum by (le, layers, kind) (rate(x[5m])))") == {"layers", "kind"}
    assert {"k3_stage_forwards_total", "k3_stage_step_duration_seconds_bucket"} <= dashboard_metrics()
    assert names("# TYPE k3_x counter\nk3_x_total 1.0\n") == {"k3_x_total"}
    assert "k3_no_such_metric" not in names("# TYPE k3_x counter\nk3_x_total 1.0\n")
