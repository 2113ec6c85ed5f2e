"""The serving engine over a pipeline-sharded model with several micro-batches in flight (EngineSettings
micro_batches > 1, issue 17): real shard processes over gloo on loopback; every output equals the
single-process engine's, with late arrivals, scoring, speculation and a cancellation mid-flight. A restart of
the shard set drops every step still in flight (the driver keeps nothing of the old set), and a pipelined step
that hangs is caught by the engine's watchdog, which restarts the shard set and goes on serving."""
import asyncio
import dataclasses
import os
import signal
import time

import psutil
import pytest
import torch

from inference.decoding.speculation import SpeculationConfig
from inference.serving import (EngineError, EngineSettings, EngineSpec, GenerationRequest, LocalEngine, SamplingParams,
                               TokenEvent)
from inference.sharding import ShardedModel, ShardFailure, ShardTimeouts

TIMEOUTS = ShardTimeouts(comm=30.0, heartbeat=10.0, startup=180.0, keepalive=0.5)
ATOL = 1e-4
SETTINGS = EngineSettings(max_context=4096, step_token_budget=64, min_prefill_chunk=16)


@pytest.fixture
def pipeline2(tiny_checkpoint):
    """A fresh 2-stage pipeline for each test: stopping the engine closes its model."""
    with ShardedModel(tiny_checkpoint, shards=2, mode="pipeline", timeouts=TIMEOUTS, threads_per_rank=1) as model:
        yield model


def requests(longer: int = 0) -> list[tuple[float, GenerationRequest]]:
    """(delay before it arrives, request): prompts and outputs of different lengths (`longer` more tokens
    each), three arriving late."""
    texts = [b"the cat sat on the mat. the cat", b"abc", bytes(range(40, 120)), b"def f(a):\n    return a\n" * 2,
             b"x", b"hello hello hello", b"0123456789" * 3]
    return [(0.0 if i < 4 else 0.05 * i,
             GenerationRequest(list(t), SamplingParams(max_tokens=4 + 2 * i + longer, logprobs=1)))
            for i, t in enumerate(texts)]


async def collect(engine, request, delay=0.0, cancel_after=None):
    await asyncio.sleep(delay)
    tokens, final = [], None
    stream = engine.generate(request)
    async for ev in stream:
        if isinstance(ev, TokenEvent):
            tokens.append(ev)
            if cancel_after is not None and len(tokens) >= cancel_after:
                await stream.aclose()
                return tokens, None
        else:
            final = ev
    return tokens, final


async def serve(engine, reqs, cancel=None, score=None, then=None):
    """Every request through the engine (the one at index `cancel` closed after 2 tokens), then `then` once."""
    async with engine:
        jobs = [collect(engine, r, d, cancel_after=2 if i == cancel else None) for i, (d, r) in enumerate(reqs)]
        if score is not None:
            jobs.append(engine.score(score, None, 2))
        out = await asyncio.gather(*jobs)
        if then is not None:
            out.append(await collect(engine, then))
            assert engine.active_sequences == 0 and engine.reserved_bytes == 0
        return out


def assert_same(got, want, skip=()):
    for i, ((tokens, final), (want_tokens, want_final)) in enumerate(zip(got, want)):
        if i in skip:
            continue
        assert [t.token_id for t in tokens] == [t.token_id for t in want_tokens], f"request {i}"
        for a, b in zip(tokens, want_tokens):
            assert a.logprob == pytest.approx(b.logprob, abs=ATOL)
        assert final.finish_reason == want_final.finish_reason


@pytest.mark.timeout(300)
async def test_pipelined_engine_equals_the_single_process_engine(pipeline2, tiny_reference):
    model, tokenizer, _ = tiny_reference
    score_ids = list(b"scoring rides along")
    want = await serve(LocalEngine(model, tokenizer, SETTINGS, model_fingerprint="t"), requests(), score=score_ids)
    engine = LocalEngine(pipeline2, tokenizer, dataclasses.replace(SETTINGS, micro_batches=2), model_fingerprint="t")
    got = await serve(engine, requests(), score=score_ids)
    assert_same(got[:-1], want[:-1])
    for a, b in zip(got[-1], want[-1]):  # the scoring request
        assert (a.position, a.token_id) == (b.position, b.token_id)
        assert a.logprob == pytest.approx(b.logprob, abs=ATOL)
    assert engine.most_steps_in_flight == 2  # the groups' steps really overlapped


@pytest.mark.timeout(300)
async def test_pipelined_engine_over_three_stages(tiny_checkpoint, tiny_reference):
    model, tokenizer, _ = tiny_reference
    want = await serve(LocalEngine(model, tokenizer, SETTINGS, model_fingerprint="t"), requests())
    with ShardedModel(tiny_checkpoint, shards=3, mode="pipeline", timeouts=TIMEOUTS, threads_per_rank=1) as sharded:
        engine = LocalEngine(sharded, tokenizer, dataclasses.replace(SETTINGS, micro_batches=3), model_fingerprint="t")
        got = await serve(engine, requests())
    assert_same(got, want)
    assert engine.most_steps_in_flight == 3


@pytest.mark.timeout(300)
async def test_pipelined_engine_with_speculation(pipeline2, tiny_reference):
    model, tokenizer, _ = tiny_reference
    want = await serve(LocalEngine(model, tokenizer, SETTINGS, model_fingerprint="t"), requests(12))
    spec = SpeculationConfig(drafter="ngram", max_draft_tokens=3, fixed_draft_tokens=3, min_match=1)
    engine = LocalEngine(pipeline2, tokenizer, dataclasses.replace(SETTINGS, micro_batches=2), model_fingerprint="t",
                         speculation=spec)
    got = await serve(engine, requests(12))
    assert_same(got, want)
    proposed = sum(final.draft_proposed for _, final in got)
    accepted = sum(final.draft_accepted for _, final in got)
    assert proposed > accepted and proposed >= 10  # drafts were verified, and rejected ones rewound


@pytest.mark.timeout(300)
async def test_a_cancellation_mid_flight_leaves_the_others_correct(pipeline2, tiny_reference):
    model, tokenizer, _ = tiny_reference
    reqs = requests()
    want = await serve(LocalEngine(model, tokenizer, SETTINGS, model_fingerprint="t"), reqs)
    # three groups over two stages: a group waits while the others run
    engine = LocalEngine(pipeline2, tokenizer, dataclasses.replace(SETTINGS, micro_batches=3), model_fingerprint="t")
    got = await serve(engine, reqs, cancel=6, then=reqs[1][1])  # and the engine goes on serving after it
    assert_same(got[:-1], want, skip=(6,))
    assert [t.token_id for t in got[6][0]] == [t.token_id for t in want[6][0]][:2] and got[6][1] is None
    assert_same(got[-1:], want[1:2])
    assert engine.most_steps_in_flight == 3


def test_micro_batches_need_a_model_with_steps_in_flight(tiny_reference, tiny_checkpoint):
    model, tokenizer, _ = tiny_reference
    with pytest.raises(ValueError, match="submit/collect"):
        LocalEngine(model, tokenizer, EngineSettings(micro_batches=2))
    with pytest.raises(ValueError, match=">= 1"):
        LocalEngine(model, tokenizer, EngineSettings(micro_batches=0))
    LocalEngine(model, tokenizer, EngineSettings(micro_batches=1))  # the default loop
    spec = EngineSpec(kind="reference", checkpoint=str(tiny_checkpoint), settings=EngineSettings(micro_batches=2))
    assert any("only the sharded engine" in p for p in spec.problems())
    spec = EngineSpec(kind="sharded", checkpoint=str(tiny_checkpoint), shards=2,
                      settings=EngineSettings(micro_batches=2))
    assert spec.problems() == []


@pytest.mark.timeout(300)
async def test_a_lost_shard_fails_every_step_in_flight_and_the_engine_recovers(pipeline2, tiny_reference):
    model, tokenizer, _ = tiny_reference
    reqs = requests(200)[:4]  # long enough to be streaming when the shard dies
    after = requests()[1][1]
    want = await serve(LocalEngine(model, tokenizer, SETTINGS, model_fingerprint="t"), [(0.0, after)])
    engine = LocalEngine(pipeline2, tokenizer, dataclasses.replace(SETTINGS, micro_batches=2), model_fingerprint="t")
    old = dict(pipeline2.pids)

    async def until_failure(request):
        seen = 0
        with pytest.raises(EngineError) as failure:
            async for ev in engine.generate(request):
                seen += 1
                if seen == 3 and pipeline2.pids == old:
                    os.kill(old[1], signal.SIGKILL)
        return failure.value.code

    async with engine:
        codes = await asyncio.gather(*(until_failure(r) for _, r in reqs))
        assert codes == ["engine_failure"] * 4 and engine.most_steps_in_flight == 2
        deadline = time.monotonic() + 120
        while not (engine.health().ok and pipeline2.health().ok):
            assert time.monotonic() < deadline, engine.health()
            await asyncio.sleep(0.1)
        assert set(pipeline2.pids.values()).isdisjoint(old.values())
        again = await collect(engine, after)
    assert [t.token_id for t in again[0]] == [t.token_id for t in want[0][0]]
    assert pipeline2.steps_in_flight == 0 and pipeline2._results == {}  # nothing kept of the lost set's steps


@pytest.mark.timeout(300)
def test_a_restart_drops_every_step_in_flight(pipeline2, tiny_reference):
    """Steps submitted and not collected when the shard set restarts (recover()), or when a shard dies under
    them and the set restarts, are dropped: the driver keeps neither the steps nor answers for them, collecting
    one raises ShardFailure naming the restart, and the next steps are served as the single-process model."""
    model, _, _ = tiny_reference
    prompts = [list(b"abc"), list(b"hello hello"), list(b"xyz")]

    def submit_all():
        caches = [pipeline2.new_cache() for _ in prompts]
        return [pipeline2.submit([torch.tensor(p)], [c]) for p, c in zip(prompts, caches)]

    tickets = submit_all()
    assert pipeline2.steps_in_flight == 3
    pipeline2.recover()  # a restart with steps in flight (some answers may have come back, some not)
    assert pipeline2.steps_in_flight == 0 and pipeline2._results == {}
    with pytest.raises(ShardFailure, match="restarted"):
        pipeline2.collect(tickets[1])

    victim = pipeline2.pids[1]
    os.kill(victim, signal.SIGKILL)  # a shard dies; the steps submitted next fail under it
    tickets = submit_all()
    with pytest.raises(ShardFailure, match="rank 1"):
        pipeline2.collect(tickets[0])
    pipeline2.recover()
    assert pipeline2.steps_in_flight == 0 and pipeline2._results == {}
    for ticket in tickets:
        with pytest.raises(ShardFailure, match="restarted"):
            pipeline2.collect(ticket)

    caches = [pipeline2.new_cache() for _ in prompts]
    got = pipeline2.forward_pipelined([([torch.tensor(p)], [c], False) for p, c in zip(prompts, caches)])
    for p, (logits,) in zip(prompts, got):
        want = model.forward([torch.tensor(p)], [model.new_cache()])[0]
        assert torch.allclose(logits, want, atol=ATOL)


# the shard set's own fault detection far away: only the engine's watchdog can catch a stage that stops answering
HANG_TIMEOUTS = ShardTimeouts(comm=120.0, heartbeat=120.0, startup=180.0, keepalive=0.5)
FORWARD_STALL_S = 15.0  # above a shard-set restart on this loaded box (a recovery is watched like a step)


@pytest.mark.timeout(300)
async def test_the_watchdog_catches_a_pipelined_step_that_hangs(tiny_checkpoint, tiny_reference):
    """A stage stops answering (SIGSTOP) while both groups have steps in flight, and neither its heartbeat nor a
    transfer timeout will say so for 120 s: the engine's watchdog gives up on the step after forward_stall_s,
    every request in flight fails with its reason, the shard set is killed (the stopped process too) and
    restarted, the driver keeps nothing of the old set, and the next request is served."""
    model, tokenizer, _ = tiny_reference
    reqs = requests(200)[:4]  # long enough to be streaming when the stage stops
    after = requests()[1][1]
    want = await serve(LocalEngine(model, tokenizer, SETTINGS, model_fingerprint="t"), [(0.0, after)])
    settings = dataclasses.replace(SETTINGS, micro_batches=2, forward_stall_s=FORWARD_STALL_S, watchdog_s=0.2)
    with ShardedModel(tiny_checkpoint, shards=2, mode="pipeline", timeouts=HANG_TIMEOUTS,
                      threads_per_rank=1) as sharded:
        engine = LocalEngine(sharded, tokenizer, settings, model_fingerprint="t")
        old = dict(sharded.pids)
        stopped: dict[str, float] = {}

        async def until_failure(request):
            seen = 0
            with pytest.raises(EngineError) as failure:
                async for _ in engine.generate(request):
                    seen += 1
                    if seen == 3 and not stopped:
                        os.kill(old[1], signal.SIGSTOP)
                        stopped["at"] = time.monotonic()
            return failure.value, time.monotonic()

        async with engine:
            failures = await asyncio.gather(*(until_failure(r) for _, r in reqs))
            for error, at in failures:
                assert error.code == "engine_failure" and "a model step has run for" in error.message, error
                assert at - stopped["at"] < FORWARD_STALL_S + 10, f"failed {at - stopped['at']:.1f} s after the stop"
            assert engine.scheduler_restarts >= 1 and engine.most_steps_in_flight == 2
            deadline = time.monotonic() + 120
            while not (engine.health().ok and sharded.health().ok):
                assert time.monotonic() < deadline, engine.health()
                await asyncio.sleep(0.1)
            assert set(sharded.pids.values()).isdisjoint(old.values())
            for pid in old.values():  # killed and reaped, the stopped one included
                assert not psutil.pid_exists(pid), f"old shard process {pid} is still there"
            assert sharded.steps_in_flight == 0 and sharded._results == {}
            again = await asyncio.wait_for(collect(engine, after), 120)
    assert [t.token_id for t in again[0]] == [t.token_id for t in want[0][0]]
