"""The remote engine's SGLang path against SGLang's native /generate, built from SGLang's own schema.

SGLang itself needs CUDA, so the server here is an aiohttp app that speaks SGLang's native HTTP
API with SGLang's own types (`sglang.api.v1.api_types` from the PyPI package, tests/sglang_protocol.py):
every request body is decoded by `GenerateRequest.from_json_value` (unknown sampling fields are
refused with SGLang's own contract error, as its server does), every answer is encoded by
`GenerateResponse(...).to_json_value()`. The tokens come from the project's reference engine, so the
adapter's output is compared with the reference engine's exactly. Both of SGLang's stream styles
(cumulative, its default, and `--incremental-streaming-output`) are served, and SSE framing with
CRLF line ends, comments and data split over several lines.
"""
from __future__ import annotations

import json

import pytest
from aiohttp import web
from conftest import collect_events
from sglang_protocol import load_api_types

from inference.decoding.sampling import SamplingParams
from inference.model.config import ModelConfig
from inference.model.tokenizer import ByteTokenizer
from inference.serving.engine import EngineError, EngineSettings, FinalEvent, GenerationRequest, TokenEvent
from inference.serving.local_engine import LocalEngine
from inference.serving.remote import RemoteEngine, RemoteSettings

pytestmark = pytest.mark.timeout(1200)
CONFIG = ModelConfig.tiny()
MODEL_NAME = "kimi-k3-tiny"
api = load_api_types()


class SGLangNativeServer:
    """SGLang's /generate and /v1/models over a LocalEngine, in SGLang's types."""

    def __init__(self, engine: LocalEngine, tokenizer, incremental: bool = False, crlf: bool = False):
        self.engine, self.tokenizer, self.incremental, self.crlf = engine, tokenizer, incremental, crlf
        self.bodies: list[dict] = []
        self.app = web.Application()
        self.app.add_routes([web.post("/generate", self.generate), web.get("/v1/models", self.models)])

    async def models(self, request):
        # SGLang lists its models on its OpenAI-compatible /v1/models (OpenAI's list shape)
        return web.json_response({"object": "list", "data": [{"id": MODEL_NAME, "object": "model", "root": MODEL_NAME,
                                                              "max_model_len": 4096}]})

    def _event(self, value: dict) -> bytes:
        data = json.dumps(value)
        if not self.crlf:
            return b"data: " + data.encode() + b"\n\n"
        # the same event as another server may frame it: CRLF, a comment, a retry field, data on two lines
        cut = data.index(",") + 1
        return (": keep-alive\r\nretry: 3000\r\ndata: " + data[:cut] + "\r\ndata: " + data[cut:] + "\r\n\r\n").encode()

    async def generate(self, request: web.Request):
        raw = await request.json()
        self.bodies.append(raw)
        try:
            req = api.GenerateRequest.from_json_value(raw)
        except api.JsonContractError as exc:
            return web.json_response({"error": str(exc)}, status=400)  # SGLang's contract gate answer
        ids = list(req.input_ids)
        if any(not 0 <= i < CONFIG.vocab_size for i in ids):
            return web.json_response({"error": {"message": f"token id out of the vocabulary of {CONFIG.vocab_size}"}},
                                     status=400)
        sp = req.sampling_params or api.SamplingParams()
        if not req.stream:
            return await self._score(req, ids)
        top_k = 0 if sp.top_k in (None, 1 << 30) else sp.top_k
        stop = tuple([sp.stop] if isinstance(sp.stop, str) else sp.stop or ())
        sampling = SamplingParams(max_tokens=sp.max_new_tokens, temperature=sp.temperature, top_p=sp.top_p,
                                  top_k=top_k, seed=sp.sampling_seed, stop=stop, logprobs=req.top_logprobs_num or 0,
                                  ignore_eos=bool(sp.ignore_eos))
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        entries, tops, emitted = [], [], 0
        stop_ids = set(sp.stop_token_ids or ())
        stream = self.engine.generate(GenerationRequest(ids, sampling))
        try:
            async for ev in stream:
                if isinstance(ev, TokenEvent):
                    # the text field carries the token's text (digits for byte "7"): a reader must use token_id
                    entries.append(api.LogprobEntry(logprob=ev.logprob, token_id=ev.token_id, text=ev.text or None))
                    tops.append([api.LogprobEntry(logprob=lp, token_id=i, text=None) for i, lp in ev.top_logprobs])
                    # SGLang stops at a stop token id and names it as the match
                    finish = api.FinishStop(matched=ev.token_id) if ev.token_id in stop_ids else None
                elif ev.finish_reason == "length":
                    finish = api.FinishLength(length=ev.completion_tokens)
                elif ev.finish_reason == "eos":
                    finish = api.FinishStop(matched=entries[-1].token_id)
                else:
                    finish = api.FinishStop(matched=stop[0] if stop else None)
                start = emitted if self.incremental else 0
                meta = api.GenerateMetaInfo(id="req-1", prompt_tokens=len(ids), completion_tokens=len(entries),
                                            finish_reason=finish, output_token_logprobs=entries[start:],
                                            output_top_logprobs=tops[start:])
                out = api.GenerateResponse(text="", output_ids=[e.token_id for e in entries[start:]], meta_info=meta)
                await resp.write(self._event(out.to_json_value()))
                emitted = len(entries)
                if finish is not None:
                    break
        finally:
            await stream.aclose()
        await resp.write(b"data: [DONE]\n\n")
        return resp

    async def _score(self, req, ids):
        if req.logprob_start_len != 0 or not req.return_logprob:
            return web.json_response({"error": {"message": "this test server scores from position 0 only"}}, status=400)
        scored = await self.engine.score(ids, None, req.top_logprobs_num or 0)
        entries = [api.LogprobEntry(logprob=None, token_id=ids[0], text=None)]
        tops = [None]
        for s in scored:
            entries.append(api.LogprobEntry(logprob=s.logprob, token_id=s.token_id, text=None))
            tops.append([api.LogprobEntry(logprob=lp, token_id=i, text=None) for i, lp in s.top])
        meta = api.GenerateMetaInfo(id="score-1", prompt_tokens=len(ids), completion_tokens=0,
                                    finish_reason=api.FinishLength(length=0), input_token_logprobs=entries,
                                    input_top_logprobs=tops)
        return web.json_response(api.GenerateResponse(text="", output_ids=[], meta_info=meta).to_json_value())


async def start_app(app):
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    return runner, f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"


async def serve_sglang(model, mode: str):
    tok = ByteTokenizer.from_config(CONFIG)
    local = LocalEngine(model, tok, EngineSettings(max_context=4096))
    await local.start()
    server = SGLangNativeServer(local, tok, incremental=mode == "incremental", crlf=mode == "crlf")
    runner, url = await start_app(server.app)
    return local, server, url, runner


@pytest.fixture
async def served(model):
    local, server, url, runner = await serve_sglang(model, "cumulative")
    yield local, server, url
    await runner.cleanup()
    await local.stop()


def sglang_engine(url, **kw):
    tok = ByteTokenizer.from_config(CONFIG)
    kw.setdefault("first_token_floor_s", 600.0)  # not a deadline test: a loaded CI machine is slow
    return RemoteEngine(RemoteSettings(base_url=url, model_name=MODEL_NAME, protocol="sglang", max_context=4096, **kw),
                        vocab_size=CONFIG.vocab_size, eos_id=CONFIG.eos_token_id, stop_ids=tok.stop_ids, tokenizer=tok)


# bytes of "7", "42" and other digits among them: token text that looks like an id
PROMPT = [CONFIG.bos_token_id] + list(b"route 7 to 42: ") + [(5 * j + 1) % 256 for j in range(16)]


GREEDY = SamplingParams(max_tokens=8, logprobs=4)
SAMPLED = SamplingParams(max_tokens=6, temperature=0.8, top_k=8, seed=3, logprobs=2)


@pytest.mark.parametrize("mode,sampling", [("cumulative", GREEDY), ("cumulative", SAMPLED), ("incremental", SAMPLED),
                                           ("crlf", GREEDY)])
async def test_sglang_generation_matches_the_reference_engine(model, mode, sampling):
    local, server, url, runner = await serve_sglang(model, mode)
    try:
        expected, want_final = await collect_events(local.generate(GenerationRequest(PROMPT, sampling)))
        async with sglang_engine(url) as engine:
            assert engine.health().ok, engine.health().detail
            tokens, final = await collect_events(engine.generate(GenerationRequest(PROMPT, sampling)))
    finally:
        await runner.cleanup()
        await local.stop()
    assert [t.token_id for t in tokens] == [t.token_id for t in expected]
    for got, want in zip(tokens, expected):
        assert got.logprob == pytest.approx(want.logprob, abs=1e-6)
        assert got.top_logprobs == [(i, pytest.approx(lp, abs=1e-6)) for i, lp in want.top_logprobs]
    assert "".join(t.text for t in tokens) == "".join(t.text for t in expected)
    assert isinstance(final, FinalEvent) and final.finish_reason == want_final.finish_reason
    assert final.completion_tokens == len(tokens) and final.prompt_tokens == len(PROMPT)
    body = server.bodies[-1]  # what the adapter sent passed SGLang's own request schema
    assert api.GenerateRequest.from_json_value(body).input_ids == PROMPT
    # every request carries a seed (the request's, or one the adapter drew and the final event reports)
    assert body["sampling_params"].get("sampling_seed") == (sampling.seed if sampling.seed is not None else final.seed)
    assert final.seed is not None


async def test_sglang_finish_reasons(served):
    local, server, url = served
    async with sglang_engine(url) as engine:
        _, final = await collect_events(engine.generate(GenerationRequest(PROMPT, SamplingParams(max_tokens=3))))
        assert final.finish_reason == "length"
        free, _ = await collect_events(engine.generate(GenerationRequest(PROMPT, SamplingParams(max_tokens=8))))
        text = "".join(t.text for t in free)
        stop = text[len(text) // 2:len(text) // 2 + 1]
        tokens, final = await collect_events(engine.generate(GenerationRequest(PROMPT, SamplingParams(max_tokens=8, stop=(stop,)))))
        assert final.finish_reason == "stop" and len(tokens) < len(free)
        # SGLang names the stop token it matched: one of ours is eos
        assert server.bodies[-1]["sampling_params"]["stop_token_ids"] == sorted(engine.stop_ids)
    first = free[0].token_id
    eos_engine = RemoteEngine(RemoteSettings(base_url=url, model_name=MODEL_NAME, protocol="sglang", max_context=4096,
                                             first_token_floor_s=600.0),
                              vocab_size=CONFIG.vocab_size, eos_id=first)
    async with eos_engine:
        tokens, final = await collect_events(eos_engine.generate(GenerationRequest(PROMPT, SamplingParams(max_tokens=8))))
    assert [t.token_id for t in tokens] == [first] and final.finish_reason == "eos"


async def test_sglang_scoring_matches_the_reference_engine(served):
    local, server, url = served
    positions = [3, 10, len(PROMPT) - 1]
    expected = await local.score(PROMPT, positions, 5)
    async with sglang_engine(url) as engine:
        got = await engine.score(PROMPT, positions, 5)
    assert [s.position for s in got] == positions
    for g, w in zip(got, expected):
        assert g.token_id == w.token_id and g.logprob == pytest.approx(w.logprob, abs=1e-6)
        assert [i for i, _ in g.top] == [i for i, _ in w.top]
    assert server.bodies[-1]["logprob_start_len"] == 0 and server.bodies[-1]["top_logprobs_num"] == 5


async def test_sglang_refusals_map_to_our_errors(served):
    local, server, url = served
    async with sglang_engine(url) as engine:
        with pytest.raises(EngineError) as err:
            await collect_events(engine.generate(GenerationRequest([1, 2, CONFIG.vocab_size + 5], SamplingParams(max_tokens=2))))
        assert err.value.code == "invalid_request" and "HTTP 400" in err.value.message
        # a body SGLang's schema refuses comes back with SGLang's own contract error text
        deadline = __import__("asyncio").get_running_loop().time() + 10
        with pytest.raises(EngineError) as err:
            await engine._send("/generate", {"input_ids": [1, 2], "sampling_params": {"max_tokens": 2}}, deadline,
                               stream=False)
        assert err.value.code == "invalid_request" and "unknown field `max_tokens`" in err.value.message


def test_a_token_text_is_never_read_as_an_id():
    from inference.serving.remote import _sglang_entry, parse_token_key

    assert _sglang_entry([-0.5, 42, "7"]) == (-0.5, 42)
    with pytest.raises(EngineError):
        _sglang_entry([-0.5, "42", "42"])  # an id field that is text is refused, not converted
    with pytest.raises(EngineError):
        parse_token_key("42")  # vLLM tokens must come as token_id:N; digits are token text
    assert parse_token_key("token_id:42") == 42
