"""The endpoint benchmark (benchmarks/endpoint.py) at tiny sizes against (a) a real miner on loopback (signed protocol,
devnet permit and stake, capacity 2 so that a wave of 5 gets 429s) and (b) the OpenAI-compatible
server over the reference engine, with the same checkpoint as the reference for audits and canaries."""
import dataclasses
import json
import math
import random
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web
from tokenizers import Tokenizer
from tokenizers.models import WordLevel
from tokenizers.pre_tokenizers import Whitespace

from benchmarks import endpoint as bench
from chain import connect
from inference.model import KimiK3Model, ModelConfig
from inference.serving import EngineSettings, LocalEngine, OpenAICompatibleServer
from neurons.base.settings import ChainSettings
from neurons.gateway import GatewayServer, GatewaySettings, MinerTarget
from neurons.miner_app import AccessSettings, MinerServer, MinerSettings, ServerSettings
from protocol.auth import SQLiteNonceStore
from protocol.client import ClientTimeouts, MinerClient
from protocol.schemas import Capabilities, Limits, encode_event

ROOT = Path(__file__).resolve().parent.parent
CONFIG = ModelConfig.tiny()
MODEL_NAME = "kimi-k3-tiny"
CAPACITY = 2




@pytest.fixture(scope="module")
def world(tmp_path_factory, make_wallets, make_subnet, tiny_checkpoint, tiny_reference):
    root = tmp_path_factory.mktemp("bench")
    model, tokenizer, fingerprint = tiny_reference
    wallets = make_wallets(root / "wallets", ("owner", "validator", "miner"))
    netuid, _ = make_subnet(root / "devnet.sqlite", wallets, ("validator", "miner"), {"validator": 1000.0})
    return dict(root=root, ckpt=tiny_checkpoint, model=model, tokenizer=tokenizer, fingerprint=fingerprint,
                wallets=wallets, netuid=netuid)


def engine_of(world) -> LocalEngine:
    return LocalEngine(world["model"], world["tokenizer"],
                       EngineSettings(max_context=512, max_concurrent_sequences=CAPACITY, step_token_budget=256),
                       model_fingerprint=world["fingerprint"], engine_kind="reference")


@pytest.fixture
async def miner(world, tmp_path):
    settings = MinerSettings(
        chain=ChainSettings(network=f"devnet:{world['root'] / 'devnet.sqlite'}", netuid=world["netuid"], timeout_s=2.0),
        server=ServerSettings(host="127.0.0.1", port=0, publish=False, metrics=False,
                              nonce_store=str(tmp_path / "nonces.sqlite"), shutdown_grace_s=0.0),
        access=AccessSettings(min_validator_stake=5.0, requests_per_window=100_000),
    )
    chain = connect(settings.chain.network)
    server = MinerServer(settings, engine=engine_of(world), tokenizer=world["tokenizer"], chain=chain,
                         wallet=world["wallets"]["miner"], nonce_store=SQLiteNonceStore(settings.server.nonce_store))
    await server.start()
    yield server
    await server.close(grace_s=0.0)
    server.nonce_store.close()
    await chain.close()


@pytest.fixture
async def serve_openai(world):
    """Start OpenAI-compatible servers over the checkpoint's model (or another one); yields their URLs."""
    running = []

    async def start(model=None) -> str:
        engine = engine_of(world) if model is None else LocalEngine(
            model, world["tokenizer"], EngineSettings(max_context=512, max_concurrent_sequences=CAPACITY))
        await engine.start()
        runner = web.AppRunner(OpenAICompatibleServer(engine, world["tokenizer"], MODEL_NAME).app, access_log=None)
        running.append((runner, engine))
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        return f"http://127.0.0.1:{runner.addresses[0][1]}"

    yield start
    for runner, engine in running:
        await runner.cleanup()
        await engine.stop()


@pytest.fixture
async def openai_server(serve_openai):
    return await serve_openai()


def ordered(stats: dict) -> bool:
    return stats["min"] <= stats["p50"] <= stats["p90"] <= stats["p99"] <= stats["max"] and stats["min"] > 0


async def test_a_miner_benchmark_reports_speeds_tier0_and_429s_beyond_capacity(world, miner, tmp_path):
    argv = ["--miner", miner.url, "--miner-hotkey", miner.hotkey, "--wallet-name", "validator",
            "--wallet-hotkey", "default", "--wallet-path", str(world["root"] / "wallets"),
            "--tokenizer-checkpoint", str(world["ckpt"]), "--prompt-lengths", "32,48", "--output-lengths", "6",
            "--concurrency", "1,5", "--repeats", "1", "--seed", "3", "--probes", "0", "--out-dir", str(tmp_path),
            "--between-tokens-timeout-s", "60"]  # a loaded test machine stalls streams for seconds
    settings = bench.read_benchmark_settings(argv, environ={})
    lines = []
    report = await bench.run_benchmark(settings, argv, say=lines.append)
    assert lines[0].startswith(f"miner at {miner.url}: model ") and "4 workloads, 12 requests" in lines[0]
    assert [line.split(":")[0] for line in lines if line.startswith("workload")] == [
        "workload 1/4 random P=32 O=6 C=1", "workload 2/4 random P=32 O=6 C=5", "workload 3/4 random P=48 O=6 C=1",
        "workload 4/4 random P=48 O=6 C=5"]  # a line per workload as it ends: progress on a run of minutes
    bench.write_report(report, str(tmp_path))
    saved = json.loads((tmp_path / "report.json").read_text())
    assert saved == json.loads(json.dumps(report))
    assert "| prompt | output | conc |" in (tmp_path / "report.md").read_text()

    assert saved["target"] == {"kind": "miner", "url": miner.url, "hotkey": miner.hotkey}
    assert saved["model_fingerprint"] == world["fingerprint"] and saved["precision"] == "float32"
    assert saved["endpoint"]["capabilities"]["max_concurrent_streams"] == CAPACITY
    assert saved["declared_concurrency"] == CAPACITY
    assert [(w["prompt_tokens"], w["concurrency"]) for w in saved["workloads"]] == [(32, 1), (32, 5), (48, 1), (48, 5)]
    for w in saved["workloads"]:
        if w["concurrency"] == 1:
            assert w["completed"] == 1 and w["errors"] == {} and not w["beyond_declared_capacity"]
            for key in ("ttft_s", "prefill_tokens_per_s", "decode_tokens_per_s", "latency_s"):
                assert ordered(w[key]), key
            assert w["aggregate_tokens_per_s"] > 0
            assert w["ttft_s"]["p50"] <= w["latency_s"]["p50"]
            assert w["prefill_tokens_per_s"]["p50"] == pytest.approx(w["prompt_tokens"] / w["ttft_s"]["p50"])
        else:
            # Five streams at a miner that serves two: the rest are refused with 429, reported as such.
            assert w["beyond_declared_capacity"] and w["requests"] == 5
            assert set(w["errors"]) == {"http_429"} and w["errors"]["http_429"] >= 1
            assert 1 <= w["completed"] and w["completed"] + w["errors"]["http_429"] == 5
            assert w["aggregate_tokens_per_s"] > 0
        assert 1 <= w["completion_tokens"]["max"] <= 6 and w["tier0_failed"] == 0
    totals = saved["totals"]
    assert totals["requests"] == 12 and totals["completed"] + totals["errors"]["http_429"] == 12
    tier0 = saved["quality"]["tier0"]
    assert tier0["checked"] == totals["completed"] == tier0["passed"] and tier0["not_applicable"] == []
    assert saved["quality"]["audits"] == {"skipped": "no --reference-checkpoint"}

    # The request set is a function of the settings and the tokenizer alone.
    caps = miner.engine.capabilities()
    declared = Capabilities(model_id="m", model_fingerprint="f", vocab_size=CONFIG.vocab_size,
                            max_context=caps.max_context, max_concurrent_streams=CAPACITY, engine="reference",
                            precision="float32", software_version="x", limits=Limits(max_tokens=511))
    again = bench.plan_cells(settings.workload, world["tokenizer"], declared)
    assert bench.request_set_digest(again) == saved["request_set_sha256"]
    other = bench.plan_cells(dataclasses.replace(settings.workload, seed=4), world["tokenizer"], declared)
    assert bench.request_set_digest(other) != saved["request_set_sha256"]
    assert all(len(r.prompt_token_ids) == c.prompt_tokens for c in again for wave in c.waves for r in wave)


async def test_an_openai_server_benchmark_with_reference_audits_and_canaries(world, openai_server, tmp_path):
    argv = ["--openai", openai_server, "--model", MODEL_NAME, "--reference-checkpoint", str(world["ckpt"]),
            "--prompt-lengths", "32", "--output-lengths", "6", "--concurrency", "1,2", "--repeats", "1",
            "--audits", "2", "--canaries", "1", "--probes", "0"]
    report = await bench.run_benchmark(bench.read_benchmark_settings(argv, environ={}), argv)
    assert report["target"]["kind"] == "openai" and report["endpoint"]["model"]["max_model_len"] == 512
    assert report["totals"] == {"requests": 3, "completed": 3, "errors": {}}
    for w in report["workloads"]:
        assert w["completed"] == w["requests"] == w["concurrency"]
        assert ordered(w["ttft_s"]) and ordered(w["decode_tokens_per_s"]) and w["aggregate_tokens_per_s"] > 0
    tier0 = report["quality"]["tier0"]
    assert tier0 == {"checked": 3, "passed": 3, "failures": {}, "not_applicable": ["signature", "fingerprint"]}
    audits = report["quality"]["audits"]
    assert audits["audited"] == 2 and audits["passed"] == 2 and audits["failed"] == 0
    canaries = report["quality"]["canaries"]
    assert canaries["checked"] == canaries["passed"] == 1 and canaries["tokens_per_canary"] == 6
    assert report["reference_fingerprint"] == world["fingerprint"]
    table = bench.markdown_report(report)
    assert "tier-1 audits: 2 passed" in table and "| 32 | 6 | 2 | 2/2 |" in table


async def test_audits_and_canaries_catch_a_server_that_serves_other_weights(world, serve_openai):
    impostor = await serve_openai(KimiK3Model(CONFIG, seed=1).eval())  # same shape, other weights
    argv = ["--openai", impostor, "--model", MODEL_NAME, "--reference-checkpoint", str(world["ckpt"]),
            "--prompt-lengths", "32", "--output-lengths", "8", "--concurrency", "1", "--repeats", "1",
            "--warmup", "0", "--audits", "1", "--canaries", "1", "--probes", "1"]
    report = await bench.run_benchmark(bench.read_benchmark_settings(argv, environ={}), argv)
    assert report["quality"]["tier0"]["passed"] == 1  # self-consistent: only the reference can tell
    probes = report["quality"]["probes"]  # one answer probe ran (a random model fails it; it is reported)
    assert probes["copy"]["checked"] + probes["planted_fact"]["checked"] == 1 and probes["errors"] == 0
    assert probes["tier0_failed"] == 0
    audits, canaries = report["quality"]["audits"], report["quality"]["canaries"]
    assert audits["audited"] == 1 and audits["failed"] == 1 and audits["failures"]
    assert canaries["checked"] == 1 and canaries["failed"] == 1


def other_models_tokenizer(directory: Path, vocab_size: int) -> Path:
    """A tokenizer of another family than Kimi K3's: word-level (not byte-level BPE), bos <s>, no chat tokens."""
    words = {"<unk>": 0, "<s>": 1, "</s>": 2} | {f"w{i}": i for i in range(3, vocab_size)}
    tokenizer = Tokenizer(WordLevel(words, unk_token="<unk>"))
    tokenizer.pre_tokenizer = Whitespace()
    tokenizer.add_special_tokens(["<unk>", "<s>", "</s>"])
    directory.mkdir()
    tokenizer.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>"}))
    (directory / "config.json").write_text(json.dumps({"model_type": "llama", "vocab_size": vocab_size,
                                                       "eos_token_id": 2}))
    return directory


async def test_another_models_tokenizer_files_are_taken_as_vllm_bench_serve_takes_them(world, openai_server,
                                                                                      tmp_path):
    tok = other_models_tokenizer(tmp_path / "other", CONFIG.vocab_size)
    argv = ["--openai", openai_server, "--model", MODEL_NAME, "--tokenizer-checkpoint", str(tok),
            "--prompt-lengths", "24", "--output-lengths", "4", "--concurrency", "1", "--repeats", "2",
            "--warmup", "0", "--save-result"]
    settings = bench.read_benchmark_settings(argv, environ={})
    report = await bench.run_benchmark(settings, argv)
    assert report["totals"]["completed"] == report["totals"]["requests"] == 2
    assert [r["prompt_tokens"] for r in report["per_request"]] == [24, 24]  # exact lengths, the bos included
    assert report["quality"]["probes"] == {"skipped": "another model's tokenizer: the answer probes are Kimi chat turns"}
    tokenizer = bench.OtherModelTokenizer(tok)
    prompt = bench.exact_prompt(random.Random(0), tokenizer, 10)
    assert len(prompt) == 10 and prompt[0] == 1 and 2 not in prompt


async def test_requests_that_cannot_fit_are_refused_before_anything_is_sent(world, openai_server):
    base = ["--openai", openai_server, "--model", MODEL_NAME, "--tokenizer-checkpoint", str(world["ckpt"]),
            "--output-lengths", "6", "--concurrency", "1", "--repeats", "1", "--probes", "0"]
    with pytest.raises(bench.BenchmarkSetupError, match="does not fit the endpoint"):
        await bench.run_benchmark(bench.read_benchmark_settings(base + ["--prompt-lengths", "600"], environ={}))
    with pytest.raises(bench.BenchmarkSetupError, match="no room for content"):
        await bench.run_benchmark(bench.read_benchmark_settings(base + ["--prompt-lengths", "10"], environ={}))
    wrong = ["--openai", openai_server, "--model", "another", "--tokenizer-checkpoint", str(world["ckpt"])]
    with pytest.raises(bench.BenchmarkSetupError, match="does not serve 'another'"):
        await bench.run_benchmark(bench.read_benchmark_settings(wrong, environ={}))


def test_bad_command_lines_exit_2_with_a_message(world, capsys):
    with pytest.raises(SystemExit) as caught:
        bench.main(["--tokenizer-checkpoint", str(world["ckpt"])])
    assert caught.value.code == 2 and "exactly one target" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        bench.main(["--openai", "http://127.0.0.1:1", "--model", "m", "--concurrency", "1,0"])
    assert "--concurrency: invalid list of integers value" in capsys.readouterr().err
    assert bench.main(["--miner", "http://127.0.0.1:1", "--miner-hotkey", "5abc", "--wallet-name", "nobody",
                       "--wallet-path", str(world["root"] / "wallets"),
                       "--tokenizer-checkpoint", str(world["ckpt"])]) == 2
    assert "no hotkey file" in capsys.readouterr().err
    assert bench.percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.5 and math.isclose(bench.percentile([5.0], 99), 5.0)


# ---------------------------------------------------------------- serving-benchmark features
def in_flight_max(rows: list[dict]) -> int:
    """The most requests of a workload that were in flight at one time (from requests.jsonl)."""
    edges = sorted([(r["sent_s"], 1) for r in rows] + [(r["sent_s"] + r["e2el_ms"] / 1000, -1) for r in rows],
                   key=lambda edge: (edge[0], edge[1]))
    most = now = 0
    for _, step in edges:
        now += step
        most = max(most, now)
    return most


def test_arrivals_are_poisson_at_the_rate_and_burstiness_shapes_them():
    rng = __import__("random").Random(0)
    assert bench.arrival_times(5, math.inf, 1.0, rng) == [0.0] * 5
    assert bench.arrival_times(4, 2.0, math.inf, rng) == [0.0, 0.5, 1.0, 1.5]
    for burstiness in (1.0, 0.25, 4.0):
        times = bench.arrival_times(4001, 10.0, burstiness, rng)
        gaps = [b - a for a, b in zip(times, times[1:])]
        mean = sum(gaps) / len(gaps)
        cv2 = sum((g - mean) ** 2 for g in gaps) / len(gaps) / mean ** 2
        assert mean == pytest.approx(0.1, rel=0.08)  # the rate holds whatever the burstiness
        assert cv2 == pytest.approx(1 / burstiness, rel=0.2)  # gamma(k): squared coefficient of variation 1/k


async def test_open_loop_traffic_with_a_concurrency_cap_goodput_percentiles_and_jsonl(world, openai_server, tmp_path):
    base = ["--openai", openai_server, "--model", MODEL_NAME, "--tokenizer-checkpoint", str(world["ckpt"]),
            "--prompt-lengths", "24", "--output-lengths", "5", "--request-rate", "inf,40", "--max-concurrency", "2",
            "--num-prompts", "6", "--warmup", "0", "--probes", "0", "--metric-percentiles", "25,75,99"]
    argv = base + ["--goodput", "ttft:60000", "tpot:60000", "--save-result", "--out-dir", str(tmp_path)]
    bench.write_report(await bench.run_benchmark(bench.read_benchmark_settings(argv, environ={}), argv), str(tmp_path))
    report = json.loads((tmp_path / "report.json").read_text())
    rows = [json.loads(line) for line in (tmp_path / "requests.jsonl").read_text().splitlines()]
    assert len(rows) == 12 and all(r["ok"] and r["completion_tokens"] >= 1 and r["good"] for r in rows), [r for r in rows if not r["ok"]][:2]
    assert report["settings"]["goodput_slos_ms"] == {"tpot": 60000.0, "ttft": 60000.0}
    assert [(w["request_rate"], w["max_concurrency"], w["requests"]) for w in report["workloads"]] == [
        ("inf", 2, 6), (40.0, 2, 6)]
    for w in report["workloads"]:
        mine = [r for r in rows if r["workload"] == w["workload"]]
        assert len(mine) == 6 and in_flight_max(mine) <= 2  # the cap held
        assert w["completed"] == 6 and w["goodput"]["good"] == 6
        assert w["goodput"]["requests_per_s"] == pytest.approx(w["request_throughput"])
        assert w["request_throughput"] == pytest.approx(6 / w["duration_s"])
        out = sum(r["completion_tokens"] for r in mine)
        assert w["output_throughput"] == pytest.approx(out / w["duration_s"])
        assert w["total_token_throughput"] == pytest.approx((out + 6 * 24) / w["duration_s"])
        for metric in ("ttft_ms", "tpot_ms", "e2el_ms"):
            stats = w[metric]
            assert set(stats) >= {"p25", "p75", "p99", "mean", "std"} and "p50" not in stats
            assert stats["min"] <= stats["p25"] <= stats["p75"] <= stats["p99"] <= stats["max"]
        assert w["ttft_ms"]["mean"] == pytest.approx(sum(r["ttft_ms"] for r in mine) / 6)
    at_rate = sorted(r["sent_s"] for r in rows if "rate=40" in r["workload"])
    assert at_rate[-1] > 0.02  # spread out by the arrivals (mean gap 25 ms), not sent at once
    table = (tmp_path / "report.md").read_text()
    assert "| workload | ok/req | duration s | req/s | goodput req/s |" in table and "| TTFT |" in table
    # an SLO nobody meets: goodput 0, the same requests otherwise
    strict = bench.read_benchmark_settings(base + ["--request-rate", "inf", "--goodput", "ttft:0.001"], environ={})
    report = await bench.run_benchmark(strict)
    assert report["workloads"][0]["goodput"]["good"] == 0 and report["workloads"][0]["completed"] == 6
    assert "per_request" not in report


def write_sharegpt(path: Path) -> list[dict]:
    data = [
        {"id": "a", "conversations": [{"from": "human", "value": "What is the capital of France?"},
                                      {"from": "gpt", "value": "Paris is the capital."},
                                      {"from": "human", "value": "And of Italy?"}]},
        {"id": "b", "conversations": [{"from": "gpt", "value": "a reply first: skipped"},
                                      {"from": "human", "value": "x"}]},
        {"id": "c", "conversations": [{"from": "human", "value": "Write one line about the sea."},
                                      {"from": "gpt", "value": "The sea keeps every colour of the sky."}]},
        {"id": "d", "conversations": [{"from": "human", "value": "only a question"}]},
    ]
    path.write_text(json.dumps(data))
    return data


async def test_sharegpt_and_shared_prefix_datasets(world, openai_server, tmp_path):
    tokenizer = world["tokenizer"]
    data = write_sharegpt(tmp_path / "sharegpt.json")
    argv = ["--openai", openai_server, "--model", MODEL_NAME, "--tokenizer-checkpoint", str(world["ckpt"]),
            "--dataset-name", "sharegpt", "--dataset-path", str(tmp_path / "sharegpt.json"), "--request-rate", "inf",
            "--num-prompts", "4", "--warmup", "0", "--probes", "0", "--prompt-lengths", "32", "--output-lengths", "4"]
    settings = bench.read_benchmark_settings(argv, environ={})
    report = await bench.run_benchmark(settings, argv)
    w = report["workloads"][0]
    assert w["dataset"] == "sharegpt" and w["completed"] == w["requests"] == 4
    caps = Capabilities(model_id="m", model_fingerprint="f", vocab_size=CONFIG.vocab_size, max_context=512,
                        max_concurrent_streams=2, engine="reference", precision="float32", software_version="x")
    [cell] = bench.plan_cells(settings.workload, tokenizer, caps, settings.dataset)
    # the first exchange of the two usable conversations, in turn: the human turn in the chat template,
    # max_tokens the reply's length
    expected = {tuple(bench.framed(tokenizer, tokenizer.encode(c["conversations"][0]["value"]))):
                len(tokenizer.encode(c["conversations"][1]["value"])) for c in (data[0], data[2])}
    sent = [(tuple(r.prompt_token_ids), r.max_tokens) for r in cell.waves[0]]
    assert set(sent) == set(expected.items()) and len(sent) == 4
    assert w["input_tokens"]["mean"] == pytest.approx(sum(len(p) for p, _ in sent) / 4)
    fixed = dataclasses.replace(settings.dataset, sharegpt_output_len=3)
    assert {r.max_tokens for r in bench.plan_cells(settings.workload, tokenizer, caps, fixed)[0].waves[0]} == {3}

    shared = ["--dataset-name", "shared-prefix", "--shared-prefix-tokens", "12", "--shared-prefix-groups", "2",
              "--prompt-lengths", "40", "--output-lengths", "4", "--concurrency", "3", "--repeats", "2"]
    settings = bench.read_benchmark_settings(["--openai", openai_server, "--model", MODEL_NAME,
                                              "--tokenizer-checkpoint", str(world["ckpt"])] + shared, environ={})
    [cell] = bench.plan_cells(settings.workload, tokenizer, caps, settings.dataset)
    prompts = [r.prompt_token_ids for wave in cell.waves for r in wave]
    frame, at = bench.chat_frame(tokenizer)
    assert len(prompts) == 6 and all(len(p) == 40 for p in prompts)
    heads = [tuple(p[at:at + 12]) for p in prompts]
    assert heads[0::2] == [heads[0]] * 3 and heads[1::2] == [heads[1]] * 3 and heads[0] != heads[1]
    assert len({tuple(p) for p in prompts}) == 6  # the suffixes differ
    report = await bench.run_benchmark(settings)
    assert report["totals"]["completed"] == 6 and report["workloads"][0]["dataset"] == "shared-prefix"


def test_new_flags_are_checked(world, capsys):
    base = ["--openai", "http://127.0.0.1:1", "--model", "m", "--tokenizer-checkpoint", str(world["ckpt"])]
    for extra, message in ((["--dataset-name", "sharegpt"], "needs --dataset-path"),
                           (["--request-rate", "0"], "--request-rate: invalid list of rates value"),
                           (["--goodput", "ttfb:5"], "--goodput: invalid SLO list value"),
                           (["--metric-percentiles", "100"], "invalid list of percentiles value"),
                           (["--random-range-ratio", "1.5"], "--random-range-ratio must lie in"),
                           (["--max-concurrency", "0"], "--max-concurrency must be at least 1")):
        with pytest.raises(SystemExit):
            bench.read_benchmark_settings(base + extra, environ={})
        assert message in capsys.readouterr().err, extra
    miner = ["--miner", "http://127.0.0.1:1", "--miner-hotkey", "5abc", "--tokenizer-checkpoint", str(world["ckpt"])]
    with pytest.raises(SystemExit):
        bench.read_benchmark_settings(miner + ["--endpoint-type", "chat"], environ={})
    assert "needs an --openai target" in capsys.readouterr().err
    parsed = bench.read_benchmark_settings(base + ["--goodput", "ttft:500", "e2el:9000", "--request-rate", "inf,2.5"],
                                           environ={})
    assert parsed.result.goodput == (("e2el", 9000.0), ("ttft", 500.0))
    assert parsed.workload.request_rates == (math.inf, 2.5)


GATEWAY_KEY = "sk-bench-0123456789abcdef"


@pytest.fixture
async def gateway(world, miner, tmp_path):
    """The validator's organic gateway in front of the loopback miner: what an organic user (or a
    benchmark) sees of the subnet."""
    keys = tmp_path / "keys.txt"
    keys.write_text(GATEWAY_KEY + "\n")
    target = MinerTarget(uid=1, hotkey=miner.hotkey, url=miner.url, score=1.0)

    class Directory:
        def ranked_miners(self):
            return [target]

    # generous deadlines: the machine running the tests may be loaded many times over
    timeouts = ClientTimeouts(first_byte=120.0, between_events=60.0, total=300.0)
    client = MinerClient(world["wallets"]["validator"], timeouts)
    server = GatewayServer(Directory(), client, world["tokenizer"], GatewaySettings(
        enabled=True, host="127.0.0.1", port=0, api_keys_file=str(keys), model_name=MODEL_NAME,
        rate_limit_requests=10_000, miner_timeouts=timeouts))
    await server.start()
    yield server
    await server.close()
    await client.close()


async def test_the_gateway_as_a_benchmark_target_in_completions_and_chat_mode(world, gateway, tmp_path):
    for mode in ("completions", "chat"):
        argv = ["--openai", gateway.url, "--model", MODEL_NAME, "--api-key", GATEWAY_KEY, "--tokenizer-checkpoint",
                str(world["ckpt"]), "--prompt-lengths", "32", "--output-lengths", "5", "--request-rate", "inf",
                "--max-concurrency", str(CAPACITY), "--num-prompts", "4", "--warmup", "0", "--probes", "0",
                "--endpoint-type", mode, "--first-token-timeout-s", "120", "--between-tokens-timeout-s", "60"]
        report = await bench.run_benchmark(bench.read_benchmark_settings(argv, environ={}), argv)
        assert report["max_context"] == 512  # the miner's, from the gateway's /v1/models max_model_len
        w = report["workloads"][0]
        assert w["completed"] == w["requests"] == 4, (mode, w["errors"], w["error_examples"])
        tier0 = report["quality"]["tier0"]
        assert tier0["checked"] == tier0["passed"] == 4, (mode, tier0)  # the ids and logprobs are the miner's
        assert w["completion_tokens"]["min"] >= 1 and w["ttft_ms"]["mean"] > 0
        if mode == "chat":
            assert "usage_prompt" in tier0["not_applicable"]
            assert w["input_tokens"]["mean"] > 0  # counted by the gateway with its template


def pooled_connections(endpoint) -> list:
    """The HTTP connections the endpoint's client keeps open (httpcore's pool)."""
    http = endpoint.http if isinstance(endpoint, bench.ChatEndpoint) else endpoint.engine._client
    return list(http._transport._pool.connections)


async def test_the_openai_endpoints_keep_one_connection_across_requests(world, gateway):
    """Keep-alive, as `vllm bench serve`'s client has: each streamed answer is read to the end of its
    body after [DONE], so the next request goes out on the same connection instead of a new one
    (whose connect and server-side setup would count in its TTFT)."""
    tokenizer = world["tokenizer"]
    for mode in ("completions", "chat"):
        settings = bench.read_benchmark_settings(
            ["--openai", gateway.url, "--model", MODEL_NAME, "--api-key", GATEWAY_KEY, "--tokenizer-checkpoint",
             str(world["ckpt"]), "--endpoint-type", mode, "--concurrency", "1", "--first-token-timeout-s", "120",
             "--between-tokens-timeout-s", "60"], environ={})
        endpoint = bench.open_endpoint(settings)
        try:
            await endpoint.capabilities(tokenizer)
            # (the adapter's health watcher polls /v1/models on the same client: on a loaded machine its
            # poll may come while a request streams, and rightly takes a second connection; stopped here)
            endpoint.engine._health_task.cancel()
            seen = []
            for k in range(3):
                text = f"Request {k} of a keep-alive check:"
                asked = {"prompt": text} if mode == "chat" else {"prompt_token_ids": tokenizer.encode(text)}
                request = bench.GenerateRequest(request_id=f"keep-{mode}-{k}", max_tokens=3, temperature=0.0,
                                                logprobs=1, **asked)
                result = await endpoint.generate(request)
                assert result.final is not None and len(result.token_ids) >= 1
                connections = pooled_connections(endpoint)
                assert len(connections) == 1 and connections[0].is_idle(), (mode, k, connections)
                seen.append(id(connections[0]))
            assert len(set(seen)) == 1, (mode, seen)  # one connection served all three
        finally:
            await endpoint.close()


async def test_the_gateway_honours_vllm_extensions(world, gateway):
    tokenizer = world["tokenizer"]
    headers = {"Authorization": f"Bearer {GATEWAY_KEY}"}
    prompt = tokenizer.encode("The tide came in and")
    body = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": 6, "temperature": 0.0, "logprobs": 2,
            "seed": 3, "repetition_penalty": 1.0, "ignore_eos": False}
    async with aiohttp.ClientSession(headers=headers) as http:
        async def post(path, **extra):
            async with http.post(gateway.url + path, json={**body, **extra}) as response:
                return response.status, await response.json()

        status, plain = await post("/v1/completions")
        assert status == 200, plain
        status, as_ids = await post("/v1/completions", return_tokens_as_token_ids=True)
        assert status == 200, as_ids
        ids = [int(t.removeprefix("token_id:")) for t in as_ids["choices"][0]["logprobs"]["tokens"]]
        assert all(t.startswith("token_id:") for t in as_ids["choices"][0]["logprobs"]["tokens"])
        # greedy: the same tokens; their text is what the plain answer names them
        assert [tokenizer.decode([t]) for t in ids] == plain["choices"][0]["logprobs"]["tokens"]
        assert all(k.startswith("token_id:") for top in as_ids["choices"][0]["logprobs"]["top_logprobs"] for k in top)
        assert as_ids["choices"][0]["text"] == plain["choices"][0]["text"]
        kept = tokenizer.decode(ids, skip_special_tokens=False)
        status, raw = await post("/v1/completions", skip_special_tokens=False)
        assert status == 200 and raw["choices"][0]["text"] == kept
        status, chat = await post("/v1/chat/completions", prompt=None, messages=[{"role": "user", "content": "Hi"}],
                                  logprobs=True, top_logprobs=2, return_tokens_as_token_ids=True)
        assert status == 400  # `prompt` is not a chat parameter (sent as null here): refused by name
        del body["prompt"], body["logprobs"]
        status, chat = await post("/v1/chat/completions", messages=[{"role": "user", "content": "Hi"}],
                                  logprobs=True, top_logprobs=2, return_tokens_as_token_ids=True)
        assert status == 200, chat
        assert all(e["token"].startswith("token_id:") for e in chat["choices"][0]["logprobs"]["content"])
        for extra, word in (({"repetition_penalty": 1.2}, "repetition_penalty"), ({"ignore_eos": True}, "ignore_eos")):
            status, refused = await post("/v1/chat/completions", messages=[{"role": "user", "content": "Hi"}], **extra)
            assert status == 400 and word in refused["error"]["message"], refused
        async with http.get(gateway.url + "/v1/models") as response:
            listing = await response.json()
        assert listing["data"][0]["max_model_len"] == 512


async def test_a_miner_and_an_openai_server_put_the_same_tokens_on_the_wire(world, miner, openai_server):
    """One engine<->wire adapter (neurons/base/engine_wire.py): the same greedy generation of the same model,
    streamed by a miner and read by the benchmark from an OpenAI-compatible server, is the same token events
    byte for byte."""
    tokenizer = world["tokenizer"]
    targets = {"miner": ["--miner", miner.url, "--miner-hotkey", miner.hotkey, "--wallet-name", "validator",
                         "--wallet-hotkey", "default", "--wallet-path", str(world["root"] / "wallets")],
               "openai": ["--openai", openai_server, "--model", MODEL_NAME]}
    lines = {}
    for name, argv in targets.items():
        settings = bench.read_benchmark_settings(
            argv + ["--tokenizer-checkpoint", str(world["ckpt"]), "--concurrency", "1"], environ={})
        endpoint = bench.open_endpoint(settings)
        try:
            await endpoint.capabilities(tokenizer)
            request = bench.GenerateRequest(request_id=f"same-{name}", prompt_token_ids=tokenizer.encode(
                "The tide came in and"), max_tokens=8, temperature=0.0, logprobs=3)
            result = await endpoint.generate(request)
        finally:
            await endpoint.close()
        lines[name] = [encode_event(timed.event) for timed in result.token_events]
    assert len(lines["miner"]) >= 2 and lines["miner"] == lines["openai"]
