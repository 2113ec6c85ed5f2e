"""The remote (OpenAI-compatible) engine against a real server on loopback backed by the reference engine."""
import asyncio
import contextlib
import json

import pytest
from aiohttp import web
from conftest import collect_events

from inference.model import ByteTokenizer, ModelConfig
from inference.serving import (EngineError, EngineSettings, FinalEvent, GenerationRequest, LocalEngine,
                               OpenAICompatibleServer, RemoteEngine, RemoteSettings, SamplingParams, TokenEvent)

CONFIG = ModelConfig.tiny()
MODEL_NAME = "kimi-k3-tiny"


async def start_app(app):
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]
    return runner, f"http://127.0.0.1:{port}"


@pytest.fixture
async def served(model):
    tok = ByteTokenizer.from_config(CONFIG)
    local = LocalEngine(model, tok, EngineSettings(max_context=4096))
    await local.start()
    runner, url = await start_app(OpenAICompatibleServer(local, tok, MODEL_NAME).app)
    yield local, url
    await runner.cleanup()
    await local.stop()


def remote(url, **kw):
    return RemoteEngine(RemoteSettings(base_url=url, model_name=MODEL_NAME, max_context=4096, **kw),
                        vocab_size=CONFIG.vocab_size, eos_id=CONFIG.eos_token_id)


PROMPT = [(5 * j + 1) % 256 for j in range(30)]


@pytest.mark.parametrize("sampling", [SamplingParams(max_tokens=12, logprobs=4),
                                      SamplingParams(max_tokens=10, temperature=0.8, top_k=8, seed=3, logprobs=2)])
async def test_remote_generation_matches_the_local_engine(served, sampling):
    local, url = served
    expected, _ = await collect_events(local.generate(GenerationRequest(PROMPT, sampling)))
    async with remote(url) as engine:
        assert engine.health().ok
        tokens, final = await collect_events(engine.generate(GenerationRequest(PROMPT, sampling)))
    assert [t.token_id for t in tokens] == [t.token_id for t in expected]
    for got, want in zip(tokens, expected):
        assert got.logprob == pytest.approx(want.logprob, abs=1e-5)
        assert [i for i, _ in got.top_logprobs] == [i for i, _ in want.top_logprobs]
    assert isinstance(final, FinalEvent) and final.completion_tokens == len(tokens)
    assert final.prompt_tokens == len(PROMPT) and final.ttft_ms is not None
    # the seed sent to the server is reported: the request's, or one drawn (under 2^63 for any server)
    assert final.seed == sampling.seed if sampling.seed is not None else 0 <= final.seed < 2**63
    assert engine.capabilities().sampler == "engine"  # the server's own sampler: not replayable


@pytest.mark.parametrize("mode", ["prompt_logprobs", "echo"])
async def test_remote_scoring_matches_the_local_engine(served, mode):
    local, url = served
    positions = [3, 10, 29]
    expected = await local.score(PROMPT, positions, 5)
    async with remote(url, score_mode=mode) as engine:
        got = await engine.score(PROMPT, positions, 5)
    assert [s.position for s in got] == positions
    for g, w in zip(got, expected):
        assert g.token_id == w.token_id
        assert g.logprob == pytest.approx(w.logprob, abs=1e-5)
        assert [i for i, _ in g.top] == [i for i, _ in w.top]


async def test_remote_errors_are_mapped(served):
    local, url = served
    async with remote(url) as engine:
        with pytest.raises(EngineError) as e:
            await collect_events(engine.generate(GenerationRequest(PROMPT, SamplingParams(max_tokens=5000))))
        assert e.value.code == "context_too_long"
    # the server itself refuses (its context is 4096, the adapter is told 100000)
    async with RemoteEngine(RemoteSettings(base_url=url, model_name=MODEL_NAME, max_context=100000),
                            vocab_size=CONFIG.vocab_size) as engine:
        with pytest.raises(EngineError) as e:
            await collect_events(engine.generate(GenerationRequest(PROMPT * 200, SamplingParams(max_tokens=4))))
        assert e.value.code == "context_too_long" and "HTTP 400" in e.value.message
        tokens, _ = await collect_events(engine.generate(GenerationRequest(PROMPT, SamplingParams(max_tokens=3))))
        assert len(tokens) == 3
    async with RemoteEngine(RemoteSettings(base_url=url, model_name="another-model"),
                            vocab_size=CONFIG.vocab_size) as engine:
        assert not engine.health().ok and "does not serve" in engine.health().detail
        with pytest.raises(EngineError) as e:
            await collect_events(engine.generate(GenerationRequest(PROMPT, SamplingParams(max_tokens=3))))
        assert "HTTP 404" in e.value.message


async def test_dropped_connection_and_stalled_stream_fail_cleanly():
    released = asyncio.Event()  # the stalled handler is let go at the end, so that the server's cleanup need not wait

    async def models(request):
        return web.json_response({"data": [{"id": MODEL_NAME}]})

    async def one_token_then(request, stall: bool):
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        chunk = {"choices": [{"index": 0, "text": "a", "finish_reason": None,
                              "logprobs": {"tokens": ["token_id:97"], "token_logprobs": [-0.5],
                                           "top_logprobs": [{"token_id:97": -0.5}]}}]}
        await resp.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
        if stall:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(released.wait(), 30)
        else:
            request.transport.close()
        return resp

    async def dropping(request):
        return await one_token_then(request, stall=False)

    async def stalling(request):
        return await one_token_then(request, stall=True)

    app = web.Application()
    app.add_routes([web.get("/drop/v1/models", models), web.post("/drop/v1/completions", dropping),
                    web.get("/stall/v1/models", models), web.post("/stall/v1/completions", stalling)])
    runner, url = await start_app(app)
    loop = asyncio.get_running_loop()
    try:
        async with remote(url + "/drop") as engine:
            with pytest.raises(EngineError) as e:
                await asyncio.wait_for(collect_events(engine.generate(GenerationRequest(PROMPT, SamplingParams(max_tokens=5)))), 10)
            assert e.value.code == "engine_failure"
        async with remote(url + "/stall", stall_timeout_s=0.5) as engine:
            t0 = loop.time()
            with pytest.raises(EngineError) as e:
                await asyncio.wait_for(collect_events(engine.generate(GenerationRequest(PROMPT, SamplingParams(max_tokens=5)))), 10)
            assert e.value.code == "engine_stalled" and "stalled" in e.value.message
            assert loop.time() - t0 < 5
    finally:
        released.set()
        await runner.cleanup()


async def test_text_without_a_token_is_accepted_only_in_the_finishing_chunk():
    """A server's detokenizer may hold back text (an unfinished UTF-8 character) and send it with
    the finish reason; anywhere else, text without logprobs means ids were not sent, an error."""
    async def models(request):
        return web.json_response({"data": [{"id": MODEL_NAME}]})

    def token_chunk(finish=None):
        return {"choices": [{"index": 0, "text": "a", "finish_reason": finish,
                             "logprobs": {"tokens": ["token_id:97"], "token_logprobs": [-0.5],
                                          "top_logprobs": [{"token_id:97": -0.5}]}}]}

    async def stream(request, tail_finish):
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        tail = {"choices": [{"index": 0, "text": "\ufffd", "finish_reason": tail_finish, "logprobs": None}]}
        for chunk in (token_chunk(), tail) + ((token_chunk("length"),) if tail_finish is None else ()):
            await resp.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
        await resp.write(b"data: [DONE]\n\n")
        return resp

    async def at_finish(request):
        return await stream(request, "length")

    async def mid_stream(request):
        return await stream(request, None)

    app = web.Application()
    app.add_routes([web.get("/end/v1/models", models), web.post("/end/v1/completions", at_finish),
                    web.get("/mid/v1/models", models), web.post("/mid/v1/completions", mid_stream)])
    runner, url = await start_app(app)
    try:
        async with remote(url + "/end") as engine:
            tokens, final = await collect_events(engine.generate(GenerationRequest(PROMPT, SamplingParams(max_tokens=1))))
            assert [t.token_id for t in tokens] == [97] and final.finish_reason == "length"
        async with remote(url + "/mid") as engine:
            with pytest.raises(EngineError, match="text without logprobs"):
                await collect_events(engine.generate(GenerationRequest(PROMPT, SamplingParams(max_tokens=2))))
    finally:
        await runner.cleanup()
