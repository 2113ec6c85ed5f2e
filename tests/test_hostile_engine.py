"""The engine never dies of one request: numerically safe sampling over every admitted value, one
sequence's failure ends only that sequence, and a scheduler that ends or stalls is reported and restarted."""
import asyncio
import threading
import time

import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

from inference.decoding.sampling import MAX_TEMPERATURE, MIN_TEMPERATURE, MIN_TOP_P, TokenSampler, filtered_probs
from inference.model import ModelConfig
from inference.serving import EngineError, EngineSettings, GenerationRequest, LocalEngine, SamplingParams, TokenEvent

CONFIG = ModelConfig.tiny()
V = CONFIG.vocab_size


def engine_for(model, tokenizer, **settings):
    base = dict(max_context=2048, step_token_budget=64, scheduler_stall_s=2.0, forward_stall_s=2.0, watchdog_s=0.2)
    base.update(settings)
    return LocalEngine(model, tokenizer, EngineSettings(**base), model_fingerprint="test")


async def served(engine, max_tokens=2, **sampling):
    """Token ids of one small generation, or the EngineError it ended with."""
    ids = []
    try:
        async for event in engine.generate(GenerationRequest([5, 6, 7], SamplingParams(max_tokens=max_tokens,
                                                                                        **sampling))):
            if isinstance(event, TokenEvent):
                ids.append(event.token_id)
    except EngineError as error:
        return error
    return ids


# floats over the whole range the old schema admitted, subnormals included
any_temperature = st.floats(min_value=0.0, max_value=MAX_TEMPERATURE, allow_subnormal=True, allow_nan=False)
any_top_p = st.floats(min_value=5e-324, max_value=1.0, allow_subnormal=True, allow_nan=False)
any_top_k = st.integers(min_value=0, max_value=2**32 - 1)
LOGITS = torch.randn(V, generator=torch.Generator().manual_seed(3)) * 30.0


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(temperature=any_temperature, top_p=any_top_p, top_k=any_top_k, seed=st.integers(0, 2**64 - 1))
def test_sampling_returns_a_valid_token_for_every_admitted_value(temperature, top_p, top_k, seed):
    params = SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k, seed=seed, logprobs=3)
    # numerically safe even below the bounds that problems() now enforces
    token = TokenSampler(params).choose(LOGITS.clone(), 0)
    assert 0 <= token.token_id < V
    assert token.logprob <= 0.0 and token.logprob == token.logprob
    if temperature:
        probs = filtered_probs(LOGITS, params)
        assert torch.isfinite(probs).all() and abs(float(probs.sum()) - 1.0) < 1e-9
    # the stated bounds: 0 or [1e-3, 2] for temperature, [1e-6, 1] for top_p
    problems = params.problems()
    bad_temperature = temperature != 0.0 and temperature < MIN_TEMPERATURE
    assert any("temperature" in p for p in problems) == bad_temperature
    assert any("top_p" in p for p in problems) == (top_p < MIN_TOP_P)


def test_tiny_temperature_and_top_p_sample_the_best_token():
    for temperature, top_p in [(1e-39, 1.0), (5e-324, 1.0), (1.0, 5e-324), (1e-45, 5e-324)]:
        token = TokenSampler(SamplingParams(temperature=temperature, top_p=top_p, seed=1)).choose(LOGITS.clone(), 0)
        assert token.token_id == int(torch.argmax(LOGITS))


def test_nan_logits_fail_the_sequence_not_silently():
    bad = LOGITS.clone()
    bad[4] = float("nan")
    with pytest.raises(ValueError):
        TokenSampler(SamplingParams(temperature=1.0, seed=1)).choose(bad, 0)


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                              HealthCheck.function_scoped_fixture])
@given(temperature=any_temperature, top_p=any_top_p, top_k=any_top_k)
def test_engine_serves_the_next_request_after_any_sampling_values(model, tokenizer, temperature, top_p, top_k):
    async def run():
        async with engine_for(model, tokenizer) as engine:
            first = await served(engine, max_tokens=1, temperature=temperature, top_p=top_p, top_k=top_k, seed=1)
            if isinstance(first, EngineError):
                assert first.code == "invalid_request"  # refused up front, by the stated bounds
            else:
                assert len(first) == 1 and 0 <= first[0] < V
            assert len(await served(engine)) == 2
            assert engine.health().ok
    asyncio.run(run())


class FailingDecoderTokenizer:
    """The real tokenizer, whose decoder fails on one marked request (a detokenisation bug)."""

    def __init__(self, tokenizer):
        self.inner = tokenizer
        self.eos_id = tokenizer.eos_id
        self.stop_ids = getattr(tokenizer, "stop_ids", None)
        self.fail_next = False

    def incremental_decoder(self, **kwargs):
        decoder = self.inner.incremental_decoder(**kwargs)
        if self.fail_next:
            self.fail_next = False

            class Broken:
                def push(self, token_id):
                    raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "broken decoder")

                def flush(self):
                    return ""
            return Broken()
        return decoder


async def test_a_failure_in_one_sequence_ends_only_that_sequence(model, tokenizer):
    broken = FailingDecoderTokenizer(tokenizer)
    async with engine_for(model, broken) as engine:
        healthy = asyncio.create_task(served(engine, max_tokens=4))
        broken.fail_next = True
        failed = await served(engine, max_tokens=4)
        assert isinstance(failed, EngineError) and failed.code == "engine_failure"
        assert "detok" in failed.message or "sampling" in failed.message
        assert len(await healthy) == 4
        assert len(await served(engine)) == 2
        assert engine.health().ok and engine.scheduler_restarts == 0


async def wait_for(predicate, limit_s):
    start = time.monotonic()
    while not predicate():
        assert time.monotonic() - start < limit_s, "condition not met in time"
        await asyncio.sleep(0.05)
    return time.monotonic() - start


async def test_a_killed_scheduler_is_reported_and_restarted(model, tokenizer):
    async with engine_for(model, tokenizer) as engine:
        assert len(await served(engine)) == 2
        engine._task.cancel()
        await asyncio.sleep(0)
        assert engine.health().status == "down"  # at once, not after a timeout
        await wait_for(lambda: engine.scheduler_restarts == 1, 5.0)
        assert engine.health().ok
        assert len(await served(engine)) == 2


class StallingModel:
    """The real model; a step blocks while `stall` is set (a hung kernel or shard)."""

    def __init__(self, model):
        self.inner, self.config = model, model.config
        self.stall = threading.Event()
        self.release = threading.Event()

    def new_cache(self):
        return self.inner.new_cache()

    def forward(self, ids, caches, all_logits=False):
        if self.stall.is_set():
            self.release.wait(30)
        return self.inner.forward(ids, caches, all_logits=all_logits)


async def test_a_stalled_scheduler_is_reported_within_5_s_and_recovers(model, tokenizer):
    stalling = StallingModel(model)
    async with engine_for(stalling, tokenizer, forward_stall_s=1.0) as engine:
        try:
            stalling.stall.set()
            stuck = asyncio.create_task(served(engine))
            took = await wait_for(lambda: not engine.health().ok or engine.scheduler_restarts, 5.0)
            assert took < 5.0
            stalling.stall.clear()
            error = await asyncio.wait_for(stuck, 5.0)
            assert isinstance(error, EngineError) and error.code == "engine_failure"
            await wait_for(lambda: engine.health().ok, 5.0)
            assert engine.scheduler_restarts == 1
            assert len(await asyncio.wait_for(served(engine), 30.0)) == 2
        finally:
            stalling.release.set()


async def test_a_bug_outside_the_model_fails_that_step_and_the_scheduler_goes_on(model, tokenizer):
    async with engine_for(model, tokenizer) as engine:
        plan = engine._plan_step
        calls = {"n": 0}

        def broken_once():
            calls["n"] += 1
            if calls["n"] == 1:
                raise RuntimeError("a scheduling bug")
            return plan()
        engine._plan_step = broken_once
        failed = await served(engine)
        assert isinstance(failed, EngineError) and failed.code == "engine_failure"
        assert len(await served(engine)) == 2
        assert engine.health().ok and engine.scheduler_restarts == 0
