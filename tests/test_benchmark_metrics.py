"""The endpoint benchmark's additions: TPOT and ITL as `vllm bench serve` defines them, a served
model's tokenizer.json for non-K3 test models, and a non-zero exit when no request succeeded
(a real server on loopback that refuses every generation)."""
import asyncio
import json
import threading

from aiohttp import web

import benchmarks.endpoint as bench
from inference.model.config import ModelConfig
from protocol.client import GenerateResult, TimedEvent
from protocol.schemas import GenerateRequest, TokenMessage


def test_tpot_and_itl_follow_vllm_bench_serve_definitions():
    request = GenerateRequest(request_id="r", prompt_token_ids=[1, 2], max_tokens=4)
    result = GenerateResult(request=request, body=b"{}", started_at=0.0)
    for k, t in enumerate([0.5, 0.6, 0.8, 0.8]):  # the last two tokens arrive in one event
        result.events.append(TimedEvent(TokenMessage.model_construct(type="token", index=k, token_ids=[k], text="",
                                                                   logprobs=[0.0], top_logprobs=[[]]), t))
    result.events.append(TimedEvent(result.events[-1].event, 1.0))  # stands for the final event's arrival
    # TPOT = (end - first token) / (tokens - 1); ITL = gaps between consecutive tokens
    assert bench.time_per_output_token_ms(result) == (1.0 - 0.5) * 1000 / (len(result.token_ids) - 1)
    gaps = bench.inter_token_latencies_ms(result)
    assert len(gaps) == len(result.token_ids) - 1 and abs(gaps[0] - 100) < 1e-9 and gaps[-1] >= 0


def refusing_server():
    """An OpenAI-compatible server that lists a model and refuses every completion (503)."""
    async def models(request):
        return web.json_response({"data": [{"id": "m", "max_model_len": 512}]})

    async def completions(request):
        return web.json_response({"error": {"message": "overloaded", "code": 503}}, status=503)

    app = web.Application()
    app.add_routes([web.get("/v1/models", models), web.post("/v1/completions", completions)])
    loop = asyncio.new_event_loop()
    ready = threading.Event()
    box = {}

    def serve():
        asyncio.set_event_loop(loop)
        runner = web.AppRunner(app)
        loop.run_until_complete(runner.setup())
        site = web.TCPSite(runner, "127.0.0.1", 0)
        loop.run_until_complete(site.start())
        box["url"] = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"
        box["runner"] = runner
        ready.set()
        loop.run_forever()
        loop.run_until_complete(runner.cleanup())

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    ready.wait(30)
    return box["url"], loop, thread


def test_the_benchmark_exits_non_zero_when_no_request_succeeded(tmp_path, capsys):
    ckpt = tmp_path / "tok"
    ckpt.mkdir()
    (ckpt / "config.json").write_text(json.dumps(ModelConfig.tiny().to_hf_config()))
    url, loop, thread = refusing_server()
    try:
        code = bench.main(["--openai", url, "--model", "m", "--tokenizer-checkpoint", str(ckpt), "--prompt-lengths",
                           "64", "--output-lengths", "4", "--concurrency", "1", "--repeats", "1", "--warmup", "0",
                           "--probes", "0"])
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join(30)
    assert code == 1
    assert "no request succeeded" in capsys.readouterr().err
