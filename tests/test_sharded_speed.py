"""Speed paths of the sharded runtime against plain references (real shard processes over gloo on loopback):
speculative decoding with its cache rewinds carried to the shards, several micro-batches in flight over
pipeline stages, and emulated links (latency and bandwidth on every inter-shard message)."""
import asyncio
import dataclasses
import time

import pytest
import torch

from inference.decoding.drafters import Draft
from inference.decoding.speculation import SpeculationConfig, speculative_generate
from inference.model import ModelConfig
from inference.planning import CostModel, CostParams, Plan
from inference.planning.plan import Link, Links
from inference.serving import EngineSettings, GenerationRequest, LocalEngine, SamplingParams, TokenEvent
from inference.sharding import LinkEmulation, ShardedModel, ShardTimeouts
from inference.sharding.messages import MARK, REWIND, STEP, CacheOp, StepHeader

CONFIG = ModelConfig.tiny()
TIMEOUTS = ShardTimeouts(comm=30.0, heartbeat=10.0, startup=180.0, keepalive=0.5)
ATOL = 1e-4
LATENCY_MS = 50.0


@pytest.fixture(scope="module")
def pipeline2(tiny_checkpoint):
    with ShardedModel(tiny_checkpoint, shards=2, mode="pipeline", timeouts=TIMEOUTS, threads_per_rank=1) as model:
        yield model


@pytest.fixture(scope="module")
def slow_links(tiny_checkpoint):
    """The same 2-stage pipeline, every message delayed LATENCY_MS and held to 10 Mbit/s."""
    with ShardedModel(tiny_checkpoint, shards=2, mode="pipeline", timeouts=TIMEOUTS, threads_per_rank=1,
                      link=LinkEmulation(latency_ms=LATENCY_MS, gbps=0.01)) as model:
        yield model


def prompts(n: int, seed: int = 5) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, CONFIG.vocab_size, (3 + 2 * i,), generator=g) for i in range(n)]


def greedy_decode(model, groups: list[list[torch.Tensor]], steps: int, pipelined: bool) -> list[list[torch.Tensor]]:
    """Prefill then `steps` greedy steps of each group of sequences (a micro-batch); every step's logits.
    pipelined: every group's step is submitted before any is collected (forward_pipelined)."""
    caches = [[model.new_cache() for _ in g] for g in groups]
    feed = groups
    out = []
    for _ in range(steps + 1):
        batches = [(ids, c, False) for ids, c in zip(feed, caches)]
        if pipelined:
            logits = model.forward_pipelined(batches)
        else:
            logits = [model.forward(*b) for b in batches]
        out.append([torch.stack(rows) for rows in logits])
        feed = [[row.argmax().reshape(1) for row in rows] for rows in logits]
    return out


def test_pipelined_micro_batches_equal_one_at_a_time_and_the_single_process_model(pipeline2, tiny_reference):
    groups = [prompts(2, seed=1), prompts(3, seed=2), prompts(1, seed=3)]
    one_at_a_time = greedy_decode(pipeline2, groups, 4, pipelined=False)
    pipelined = greedy_decode(pipeline2, groups, 4, pipelined=True)
    reference = greedy_decode(tiny_reference[0], groups, 4, pipelined=False)
    for a, b, r in zip(one_at_a_time, pipelined, reference):
        for x, y, z in zip(a, b, r):
            assert torch.equal(x, y)  # the same micro-batches: bit for bit
            torch.testing.assert_close(x, z, atol=ATOL, rtol=0)


def test_steps_in_flight_are_collected_in_any_order(pipeline2, tiny_reference):
    ref = tiny_reference[0]
    seqs = prompts(3, seed=9)
    caches = [pipeline2.new_cache() for _ in seqs]
    tickets = [pipeline2.submit([s], [c]) for s, c in zip(seqs, caches)]
    got = [pipeline2.collect(t) for t in reversed(tickets)][::-1]
    for s, rows in zip(seqs, got):
        torch.testing.assert_close(rows[0], ref.forward([s], [ref.new_cache()])[0], atol=ATOL, rtol=0)
    with pytest.raises(ValueError, match="not submitted"):
        pipeline2.collect(tickets[0])


def test_sharded_speculative_generate_equals_plain_greedy(pipeline2, tiny_reference):
    """Drafts that are always wrong, half right and always right: every rewind, and the plain tokens."""
    ref = tiny_reference[0]
    prompt = list(range(40, 60)) * 2
    params = SamplingParams(max_tokens=12)
    plain, _ = speculative_generate(ref, prompt, params, SpeculationConfig())

    class Known:  # drafts from the known output, every `every`-th token altered
        def __init__(self, every):
            self.every = every

        def propose(self, history, k):
            done = len(history) - len(prompt)
            out = [(t + 1) % CONFIG.vocab_size if (done + i) % self.every == 0 else t
                   for i, t in enumerate(plain[done:done + k])]
            return Draft(out)

    for every in (1, 2, 1000):
        spec = SpeculationConfig(drafter="ngram", max_draft_tokens=4, fixed_draft_tokens=4)
        got, stats = speculative_generate(pipeline2, prompt, params, spec, drafter=Known(every))
        assert got == plain, every
        assert stats["verify_steps"] > 0
        if every == 1:
            assert stats["draft_accepted"] == 0 and stats["draft_proposed"] > 0
        if every == 1000:
            assert stats["draft_accepted"] == stats["draft_proposed"] > 0


def test_cache_ops_travel_in_the_step_header():
    ops = [CacheOp(7, MARK, 1), CacheOp(7, REWIND, 42), CacheOp(3, MARK, 0)]
    h = StepHeader(STEP, 5, [7, 3], [2, 1], torch.tensor([1, 2, 3]), [9], True, cache_ops=ops)
    meta, payload = h.encode()
    assert StepHeader.payload_len(meta.tolist()) == payload.numel()
    back = StepHeader.decode(meta.tolist(), payload)
    assert back.cache_ops == ops and back.slots == [7, 3] and back.freed == [9] and back.ids.tolist() == [1, 2, 3]


def test_shard_cache_mark_and_rewind_are_checked(pipeline2):
    cache = pipeline2.new_cache()
    with pytest.raises(ValueError, match="needs a mark"):
        cache.rewind(0)
    with pytest.raises(ValueError, match="rewind mode"):
        cache.mark("teleport")
    pipeline2.forward([torch.tensor([1, 2, 3])], [cache])
    cache.mark()
    pipeline2.forward([torch.tensor([4, 5])], [cache])
    with pytest.raises(ValueError, match="can rewind to 3..5"):
        cache.rewind(2)
    cache.rewind(4)
    assert cache.length == 4 and not cache.marked


@pytest.mark.timeout(300)
async def test_sharded_engine_with_speculation_equals_the_single_process_plain_engine(tiny_checkpoint,
                                                                                     tiny_reference):
    """Continuous batching over 3 shards (experts dispatched across ranks), drafts in every step that has a
    guess: the plain single-process engine's tokens and logprobs."""
    model, tokenizer, _ = tiny_reference
    settings = EngineSettings(max_context=4096, step_token_budget=64, min_prefill_chunk=16)
    requests = [
        GenerationRequest(list(b"the cat sat on the mat. the cat sat on the mat. the cat"), SamplingParams(max_tokens=12)),
        GenerationRequest(list(range(256)) + list(b"abc"), SamplingParams(max_tokens=8, logprobs=2)),
        GenerationRequest(list(b"def f(a):\n    return a\n" * 3), SamplingParams(max_tokens=10)),
    ]

    async def run(engine):
        async with engine:
            return await asyncio.gather(*(collect(engine, r) for r in requests))

    want = await run(LocalEngine(model, tokenizer, settings, model_fingerprint="test"))
    sharded = ShardedModel(tiny_checkpoint, shards=3, mode="both", timeouts=TIMEOUTS, threads_per_rank=1)
    spec = SpeculationConfig(drafter="ngram", max_draft_tokens=3, fixed_draft_tokens=3, min_match=1)
    got = await run(LocalEngine(sharded, tokenizer, settings, model_fingerprint="test", speculation=spec))
    proposed = accepted = 0
    for (want_tokens, _), (tokens, final) in zip(want, got):
        assert [t.token_id for t in tokens] == [t.token_id for t in want_tokens]
        for a, b in zip(tokens, want_tokens):
            assert a.logprob == pytest.approx(b.logprob, abs=ATOL)
            assert [i for i, _ in a.top_logprobs] == [i for i, _ in b.top_logprobs]
        proposed += final.draft_proposed
        accepted += final.draft_accepted
    assert proposed > accepted and proposed >= 10  # drafts were verified, and rejected ones rewound


async def collect(engine, request):
    tokens, final = [], None
    async for ev in engine.generate(request):
        if isinstance(ev, TokenEvent):
            tokens.append(ev)
        else:
            final = ev
    return tokens, final


def step_seconds(model, micro_batches: int, pipelined: bool, repeats: int = 3) -> float:
    """Best of `repeats`: one decode step of `micro_batches` one-sequence micro-batches."""
    caches = [model.new_cache() for _ in range(micro_batches)]
    model.forward_pipelined([([torch.tensor([1, 2])], [c], False) for c in caches])
    best = float("inf")
    for _ in range(repeats):
        batches = [([torch.tensor([3])], [c], False) for c in caches]
        t0 = time.perf_counter()
        if pipelined:
            model.forward_pipelined(batches)
        else:
            for b in batches:
                model.forward(*b)
        best = min(best, time.perf_counter() - t0)
    return best


def test_emulated_links_delay_every_message_and_change_no_result(slow_links, pipeline2):
    groups = [prompts(2, seed=4)]
    torch.testing.assert_close(greedy_decode(slow_links, groups, 2, False)[-1][0],
                               greedy_decode(pipeline2, groups, 2, False)[-1][0], atol=0, rtol=0)
    link = slow_links.link
    # the critical path of a step: the residual state into stage 1, the logits back to rank 0
    hop = link.seconds(2 * 1 * CONFIG.hidden_size * 4)
    logits = link.seconds(CONFIG.vocab_size * 4)
    one = step_seconds(slow_links, 1, pipelined=False)
    assert one >= hop + logits
    # two micro-batches in flight overlap their link waits; one after the other they add up
    sequential = step_seconds(slow_links, 2, pipelined=False)
    pipelined = step_seconds(slow_links, 2, pipelined=True)
    assert pipelined < 0.8 * sequential, (pipelined, sequential)


def test_bad_link_settings_are_refused(tiny_checkpoint):
    with pytest.raises(ValueError, match="link_latency_ms"):
        ShardedModel(tiny_checkpoint, shards=2, mode="pipeline", link=LinkEmulation(latency_ms=-1), start=False)
    with pytest.raises(ValueError, match="link_gbps"):
        ShardedModel(tiny_checkpoint, shards=2, mode="pipeline", link=LinkEmulation(gbps=float("nan")), start=False)


# ------------------------------------------------------------------ the cost model's speed terms
def link_plan(stages: int, latency_s: float, bandwidth: float = 1e9) -> Plan:
    plan = Plan.simple(CONFIG, stages, "pipeline", memory_bytes=8 << 30)
    link = Link(bandwidth=bandwidth, latency=latency_s)
    policy = dataclasses.replace(plan.memory_policy, activation_dtype_bytes=4)  # the runtime's fp32 hops
    return dataclasses.replace(plan, links=Links(link, link), memory_policy=policy)


def test_cost_model_pipelined_round_is_the_loop_or_the_busiest_stage():
    model = CostModel(CONFIG, link_plan(3, 1e-3), CostParams(return_logits=True))
    for m in (1, 2, 3):
        r = model.decode_round(16, m, context=64)
        loop = sum(sum(st.values()) for st in model.stage_times(-(-16 // m), 64))
        busy = [sum(st.values()) for st in model.stage_times(-(-16 // m), 64, propagation=False)]
        assert r["round_s"] == pytest.approx(max(loop, m * max(busy)))
        assert r["tokens_per_s"] == pytest.approx(16 / r["round_s"])
    assert model.throughput(16, context=64)["tokens_per_s"] == pytest.approx(
        max(model.decode_round(16, m, context=64)["tokens_per_s"] for m in (1, 2, 3)))
    with pytest.raises(ValueError):
        model.decode_round(4, 5)


def test_link_latency_delays_the_loop_but_does_not_occupy_a_stage():
    """30 ms one way between 2 stages: one micro-batch at a time pays it in the loop; with 2 in flight the
    round is bound by the loop / 2, not by a stage 'busy' for the latency."""
    slow, fast = (CostModel(CONFIG, link_plan(2, latency), CostParams(return_logits=True)) for latency in (0.03, 0.0))
    one, two = slow.decode_round(16, 2, context=64, in_flight=1), slow.decode_round(16, 2, context=64)
    assert one["loop_s"] - fast.decode_round(16, 2, context=64, in_flight=1)["loop_s"] == pytest.approx(
        2 * 0.03, rel=1e-6)  # the loop crosses the link there and back
    assert one["round_s"] == pytest.approx(2 * one["loop_s"])
    assert two["round_s"] == pytest.approx(one["loop_s"]) and two["bound"] == "loop latency"
    assert two["slowest_stage_s"] == pytest.approx(fast.decode_round(16, 2, context=64)["slowest_stage_s"])


def test_stages_sharing_cores_cannot_run_faster_than_the_cores():
    own = CostModel(CONFIG, link_plan(3, 0.0), CostParams(return_logits=True))
    shared = CostModel(CONFIG, link_plan(3, 0.0), CostParams(return_logits=True, shared_cores=2))
    busy = [sum(st.values()) for st in own.stage_times(6, 64, propagation=False)]
    r = shared.decode_round(16, 3, context=64)
    assert r["bound"] == "shared cores" and r["round_s"] == pytest.approx(3 * sum(busy) / 2)
    assert own.decode_round(16, 3, context=64)["round_s"] < r["round_s"]
    # one micro-batch at a time already runs one stage at once: the cores change nothing
    assert shared.decode_round(16, 3, context=64, in_flight=1)["round_s"] == pytest.approx(
        own.decode_round(16, 3, context=64, in_flight=1)["round_s"])
    with pytest.raises(ValueError, match="shared_cores"):
        CostParams(shared_cores=-1)


def test_cost_model_logits_return_and_step_overhead():
    plan = link_plan(2, 0.0, bandwidth=1e6)
    plain = CostModel(CONFIG, plan).token_time(context=32).total
    logits = CostModel(CONFIG, plan, CostParams(return_logits=True)).token_time(context=32).total
    assert logits - plain == pytest.approx((CONFIG.vocab_size * 4 - 8) / (1e6 * CostParams().link_efficiency))
    extra = CostModel(CONFIG, plan, CostParams(step_overhead_s=0.01)).token_time(context=32).total
    assert extra - plain == pytest.approx(0.01)


def test_cost_model_speculation_terms():
    assert CostModel.tokens_per_verify(0.0, 4) == 1.0
    assert CostModel.tokens_per_verify(1.0, 4) == 5.0
    assert CostModel.tokens_per_verify(0.5, 2) == pytest.approx(1.75)
    model = CostModel(CONFIG, link_plan(2, 1e-4))
    none = model.speculative_token_time(0.0, context=64)
    assert none["draft_tokens"] == 0 and none["speedup"] == pytest.approx(1.0)
    good = model.speculative_token_time(0.9, context=64)
    assert good["draft_tokens"] > 0 and 1.0 < good["speedup"] <= good["draft_tokens"] + 1
    fixed = model.speculative_token_time(0.9, draft_tokens=3, context=64)
    assert fixed["step_s"] >= fixed["plain_token_s"] and fixed["speedup"] <= good["speedup"] + 1e-12


def test_cost_model_link_terms_match_the_emulated_link(slow_links, pipeline2):
    """A plain step pays the link on its critical path (state into stage 1, logits back): what the emulated
    link adds to the measured step is what the cost model adds for the same link (compute cancels)."""
    link = slow_links.link
    params = CostParams(return_logits=True, link_efficiency=1.0)
    bandwidth = link.gbps * 1e9 / 8
    with_link = CostModel(CONFIG, link_plan(2, link.latency_ms / 1e3, bandwidth), params)
    without = CostModel(CONFIG, link_plan(2, 0.0, 1e15), params)
    predicted = with_link.token_time(context=4).total - without.token_time(context=4).total
    slow = step_seconds(slow_links, 1, pipelined=False, repeats=5)
    fast = step_seconds(pipeline2, 1, pipelined=False, repeats=5)
    # the link is a floor no scheduling can shorten: the slow step alone pays at least the predicted link time
    # (the difference can fall below it on a loaded machine, where a process's wake-up wait overlaps the link's)
    assert slow >= 0.98 * predicted, (slow, predicted)
    # and the link adds no more than the cost model says, up to timing noise (compute cancels)
    assert slow - fast <= 1.5 * predicted, (slow, fast, predicted)
