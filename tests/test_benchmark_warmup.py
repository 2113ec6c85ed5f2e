"""The endpoint benchmark's warm-up (benchmarks/endpoint.py, Runner.warm_up) against a real
OpenAI-compatible server on loopback (the tiny reference engine behind aiohttp) that records the
TCP connection (the client's port) of every request: the first measured wave must find a connection
per stream already open, as `vllm bench serve`'s does after its warm-up, instead of opening new ones
inside its TTFT."""
import json

import pytest
from aiohttp import web

from benchmarks import endpoint as bench
from inference.serving import EngineSettings, LocalEngine, OpenAICompatibleServer

MODEL_NAME = "kimi-k3-tiny"
STREAMS = 3


@pytest.fixture
async def recording_server(tiny_checkpoint, tiny_reference):
    """(url, log): log gets (client port, max_tokens) of each /v1/completions request, in arrival order."""
    model, tokenizer, fingerprint = tiny_reference
    engine = LocalEngine(model, tokenizer, EngineSettings(max_context=512, max_concurrent_sequences=STREAMS + 1,
                                                          step_token_budget=256),
                         model_fingerprint=fingerprint, engine_kind="reference")
    await engine.start()
    log = []

    @web.middleware
    async def record(request, handler):
        if request.path == "/v1/completions":
            body = json.loads(await request.read())
            log.append((request.transport.get_extra_info("peername")[1], body["max_tokens"]))
        return await handler(request)

    server = OpenAICompatibleServer(engine, tokenizer, MODEL_NAME)
    server.app.middlewares.append(record)
    runner = web.AppRunner(server.app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    yield f"http://127.0.0.1:{runner.addresses[0][1]}", log
    await runner.cleanup()
    await engine.stop()


def argv(url, ckpt, *extra) -> list[str]:
    return ["--openai", url, "--model", MODEL_NAME, "--tokenizer-checkpoint", str(ckpt), "--prompt-lengths", "24",
            "--output-lengths", "4", "--probes", "0", "--seed", "5", "--first-token-timeout-s", "120",
            "--between-tokens-timeout-s", "60", *extra]


TRAFFIC = {
    "open loop": ["--request-rate", "inf", "--max-concurrency", str(STREAMS), "--num-prompts", "6"],
    "closed waves": ["--concurrency", str(STREAMS), "--repeats", "2"],
}


@pytest.mark.parametrize("traffic", TRAFFIC)
async def test_the_first_measured_wave_opens_no_connection(recording_server, tiny_checkpoint, traffic):
    url, log = recording_server
    args = argv(url, tiny_checkpoint, "--warmup", "1", *TRAFFIC[traffic])
    report = await bench.run_benchmark(bench.read_benchmark_settings(args, environ={}), args)
    w = report["workloads"][0]
    assert w["completed"] == w["requests"] == 6, (w["errors"], w["error_examples"])  # warm-ups not counted
    warm, measured = log[:-6], log[-6:]
    warm_ports = {port for port, _ in warm}
    assert {port for port, _ in measured} <= warm_ports, (warm, measured)  # no connect inside a measured TTFT
    assert len({port for port, _ in measured}) == STREAMS, measured
    # one warm-up request (4 tokens), then a one-token request per stream, all at once
    assert [tokens for _, tokens in warm] == [4] + [1] * STREAMS, warm
    assert all(tokens == 4 for _, tokens in measured), measured


async def test_no_warmup_sends_nothing_before_the_measured_requests(recording_server, tiny_checkpoint):
    url, log = recording_server
    args = argv(url, tiny_checkpoint, "--warmup", "0", *TRAFFIC["open loop"])
    report = await bench.run_benchmark(bench.read_benchmark_settings(args, environ={}), args)
    assert report["workloads"][0]["completed"] == 6
    assert [tokens for _, tokens in log] == [4] * 6, log


async def test_more_warmups_than_streams_go_at_most_streams_at_once(recording_server, tiny_checkpoint):
    """Five warm-ups over three streams: waves of three and two, then no one-token wave (the first
    wave already opened a connection per stream)."""
    url, log = recording_server
    args = argv(url, tiny_checkpoint, "--warmup", "5", *TRAFFIC["open loop"])
    report = await bench.run_benchmark(bench.read_benchmark_settings(args, environ={}), args)
    assert report["workloads"][0]["completed"] == 6
    warm, measured = log[:-6], log[-6:]
    assert [tokens for _, tokens in warm] == [4] * 5, warm
    assert len({port for port, _ in warm[:STREAMS]}) == STREAMS
    assert {port for port, _ in measured} <= {port for port, _ in warm}, (warm, measured)


def test_streams_in_flight_is_the_widest_workload_capped():
    def cell(concurrency=None, max_concurrency=None, n=4):
        return bench.Cell(prompt_tokens=8, output_tokens=2, concurrency=concurrency, waves=[[None] * n],
                          rate=None if concurrency else float("inf"), max_concurrency=max_concurrency)

    assert bench.streams_in_flight([cell(concurrency=1), cell(concurrency=8)]) == 8
    assert bench.streams_in_flight([cell(max_concurrency=4, n=32)]) == 4
    assert bench.streams_in_flight([cell(n=32)]) == 32  # open loop without a cap: every request at once
    assert bench.streams_in_flight([cell(n=1000)]) == bench.MAX_WARM_CONNECTIONS
