"""The local serving engine over the tiny reference model."""
import asyncio
import time

import pytest

from inference.model import ModelConfig
from inference.serving import EngineError, EngineSettings, GenerationRequest, LocalEngine, SamplingParams, TokenEvent

CONFIG = ModelConfig.tiny()


def make_engine(model, tokenizer, **settings):
    base = dict(max_context=16384, step_token_budget=256, min_prefill_chunk=32)
    base.update(settings)
    return LocalEngine(model, tokenizer, EngineSettings(**base), model_fingerprint="test")


async def collect(stream):
    tokens, final, stamps = [], None, []
    async for ev in stream:
        if isinstance(ev, TokenEvent):
            tokens.append(ev)
            stamps.append(time.perf_counter())
        else:
            final = ev
    return tokens, final, stamps


def prompt(i, n=20):
    return [(7 * i + 3 * j) % 256 for j in range(n)]


REQUESTS = [
    GenerationRequest(prompt(0, 5), SamplingParams(max_tokens=12)),
    GenerationRequest(prompt(1, 40), SamplingParams(max_tokens=9, temperature=0.9, seed=11, logprobs=3)),
    GenerationRequest(prompt(2, 77), SamplingParams(max_tokens=15, temperature=0.7, top_p=0.8, seed=5)),
    GenerationRequest(prompt(3, 3), SamplingParams(max_tokens=7, temperature=1.0, top_k=5, seed=99)),
    GenerationRequest(prompt(4, 130), SamplingParams(max_tokens=10)),
]


async def test_concurrent_requests_match_one_at_a_time(model, tokenizer):
    async with make_engine(model, tokenizer, step_token_budget=64) as engine:
        alone = []
        for req in REQUESTS:
            tokens, final, _ = await collect(engine.generate(req))
            alone.append([t.token_id for t in tokens])
            assert final.completion_tokens == len(tokens)
        together = await asyncio.gather(*(collect(engine.generate(r)) for r in REQUESTS))
    assert [[t.token_id for t in tokens] for tokens, _, _ in together] == alone
    for (tokens, final, _), req in zip(together, REQUESTS):
        assert final.prompt_tokens == len(req.prompt_token_ids)
        assert final.finish_reason in ("length", "eos")
        if req.sampling.logprobs:
            assert all(len(t.top_logprobs) == req.sampling.logprobs for t in tokens)


async def test_seeded_sampling_is_reproducible_and_seed_dependent(model, tokenizer):
    async with make_engine(model, tokenizer) as engine:
        def req(seed):
            return GenerationRequest(prompt(9, 10), SamplingParams(max_tokens=24, temperature=1.0, seed=seed))
        a, _, _ = await collect(engine.generate(req(1)))
        b, _, _ = await collect(engine.generate(req(1)))
        c, _, _ = await collect(engine.generate(req(2)))
    assert [t.token_id for t in a] == [t.token_id for t in b]
    assert [t.token_id for t in a] != [t.token_id for t in c]


async def test_short_request_is_served_during_a_long_prefill(model, tokenizer):
    long_prompt = [(j * 31) % 256 for j in range(3000)]
    async with make_engine(model, tokenizer, step_token_budget=256) as engine:
        long_stream = engine.generate(GenerationRequest(long_prompt, SamplingParams(max_tokens=2)))
        long_task = asyncio.create_task(collect(long_stream))
        while engine.steps < 2:  # the long prefill is under way
            await asyncio.sleep(0.001)
        short_tokens, _, short_stamps = await collect(
            engine.generate(GenerationRequest(prompt(5, 8), SamplingParams(max_tokens=3))))
        long_tokens, long_final, long_stamps = await long_task
    assert short_stamps[0] < long_stamps[0], "the short request waited for the whole long prefill"
    assert long_final.completion_tokens == 2


async def test_bad_requests_get_clear_errors_and_the_engine_keeps_serving(model, tokenizer):
    async with make_engine(model, tokenizer, max_context=1000) as engine:
        with pytest.raises(EngineError) as e:
            engine.generate(GenerationRequest(list(range(200)) * 6, SamplingParams(max_tokens=4)))
        assert e.value.code == "context_too_long" and "1000" in e.value.message
        with pytest.raises(EngineError) as e:
            engine.generate(GenerationRequest([1, 2, 3], SamplingParams(max_tokens=5000)))
        assert e.value.code == "context_too_long"
        for bad in (dict(temperature=-1.0), dict(top_p=0.0), dict(top_k=-2), dict(logprobs=21), dict(max_tokens=0)):
            with pytest.raises(EngineError) as e:
                engine.generate(GenerationRequest([1, 2, 3], SamplingParams(**bad)))
            assert e.value.code == "invalid_request" and next(iter(bad)) in e.value.message
        with pytest.raises(EngineError, match="outside the vocabulary"):
            engine.generate(GenerationRequest([1, CONFIG.vocab_size], SamplingParams()))
        with pytest.raises(EngineError, match="empty"):
            engine.generate(GenerationRequest([], SamplingParams()))
        tokens, final, _ = await collect(engine.generate(GenerationRequest([1, 2, 3], SamplingParams(max_tokens=4))))
        assert len(tokens) == 4 and final.finish_reason == "length"
        assert engine.health().ok


async def test_queue_full_is_refused_at_once(model, tokenizer):
    async with make_engine(model, tokenizer, max_concurrent_sequences=1, max_waiting=2) as engine:
        streams = [engine.generate(GenerationRequest(prompt(i), SamplingParams(max_tokens=3))) for i in range(3)]
        with pytest.raises(EngineError) as e:
            engine.generate(GenerationRequest(prompt(9), SamplingParams(max_tokens=3)))
        assert e.value.code == "queue_full"
        results = await asyncio.gather(*(collect(s) for s in streams))
    assert all(len(tokens) == 3 for tokens, _, _ in results)


async def test_cancelling_a_stream_frees_its_memory_and_spares_the_others(model, tokenizer):
    keep_req = GenerationRequest(prompt(6, 30), SamplingParams(max_tokens=20, ignore_eos=True))
    async with make_engine(model, tokenizer) as engine:
        solo, _, _ = await collect(engine.generate(keep_req))
        assert engine.reserved_bytes == 0
        keep = engine.generate(keep_req)
        doomed = engine.generate(GenerationRequest(prompt(7, 30), SamplingParams(max_tokens=500, ignore_eos=True)))
        keep_task = asyncio.create_task(collect(keep))
        first = await doomed.__anext__()
        assert isinstance(first, TokenEvent)
        both = engine.reserved_bytes
        assert both == engine.sequence_bytes(50) + engine.sequence_bytes(530)
        await doomed.aclose()
        kept, final, _ = await keep_task
        for _ in range(100):
            if engine.reserved_bytes == 0:
                break
            await asyncio.sleep(0.01)
        assert engine.reserved_bytes == 0 and engine.active_sequences == 0
    assert [t.token_id for t in kept] == [t.token_id for t in solo]
    assert final.finish_reason == "length"


async def test_scoring_a_greedy_generation_returns_it_as_top1(model, tokenizer):
    p = prompt(8, 25)
    async with make_engine(model, tokenizer) as engine:
        tokens, _, _ = await collect(engine.generate(GenerationRequest(p, SamplingParams(max_tokens=16, logprobs=2))))
        out = [t.token_id for t in tokens]
        full = p + out
        scored = await engine.score(full, positions=list(range(len(p), len(full))), top_k=5)
    assert [s.position for s in scored] == list(range(len(p), len(full)))
    for s, t in zip(scored, tokens):
        assert s.top[0][0] == s.token_id == t.token_id
        assert s.logprob == pytest.approx(t.logprob, abs=1e-4)


async def test_stop_strings_end_generation(model, tokenizer):
    async with make_engine(model, tokenizer) as engine:
        tokens, final, _ = await collect(engine.generate(GenerationRequest(prompt(2, 12), SamplingParams(max_tokens=30))))
        text = "".join(t.text for t in tokens)
        assert len(text) >= 6
        stop = text[3:5]
        tokens2, final2, _ = await collect(engine.generate(
            GenerationRequest(prompt(2, 12), SamplingParams(max_tokens=30, stop=(stop,)))))
    assert final2.finish_reason == "stop"
    text2 = "".join(t.text for t in tokens2)
    assert text2.endswith(stop) or stop in text2[-len(stop) - 1:]
    assert text.startswith(text2) and text2.find(stop) == text.find(stop)
    assert len(tokens2) < len(tokens)


async def test_metrics_are_exposed(model, tokenizer):
    async with make_engine(model, tokenizer) as engine:
        tokens, final, _ = await collect(engine.generate(GenerationRequest(prompt(1), SamplingParams(max_tokens=5))))
        text = engine.metrics.exposition().decode()
    from prometheus_client.parser import text_string_to_metric_families

    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for family in text_string_to_metric_families(text) for s in family.samples}
    model = engine.metrics.model_name
    assert model == engine.config.model_id

    def value(name, **labels):
        return samples[(name, tuple(sorted({"model_name": model, **labels}.items())))]

    assert value("k3:time_to_first_token_seconds_count") == 1
    assert value("k3:generation_tokens_total") == len(tokens)
    assert value("k3:prompt_tokens_total") == len(prompt(1))
    for reason in ("eos", "stop", "length", "cancelled"):
        assert value("k3:request_success_total", finished_reason=reason) == (reason == final.finish_reason)
    assert value("k3:e2e_request_latency_seconds_count") == 1
    assert value("k3:request_time_per_output_token_seconds_count") == (len(tokens) > 1)
    assert value("k3:time_to_first_token_seconds_bucket", le="1920.0") == 1  # buckets reach long prefills
    for name in ("k3:num_requests_waiting", "k3:num_requests_running", "k3:kv_cache_usage_perc",
                 "k3:request_queue_time_seconds_count", "k3:inter_token_latency_seconds_count"):
        value(name)
    assert "tokens_per_second" not in text  # a rate of k3:generation_tokens_total, not a precomputed gauge


def test_prefill_chunks_shrink_deep_into_a_long_prompt(model, tokenizer):
    engine = make_engine(model, tokenizer, step_token_budget=512, attention_cost_tokens=1024)
    seq = type("Seq", (), {"prompt_len": 40_000})()
    shallow = engine._prefill_fit(seq, 0, 512)
    deep = engine._prefill_fit(seq, 16_384, 512)
    for start, n in ((0, shallow), (16_384, deep)):
        assert engine._prefill_cost(start, n) <= 512 < engine._prefill_cost(start, n + 1)
    assert deep < shallow / 10
