"""The step scheduler on its own: no threads, no event loop, no model. Sequences are plain objects; a step
"runs" by accounting its plan and appending one made-up token to each sequence past its prompt, as the
engine appends the token it sampled."""
import random

import pytest

from inference.decoding.sampling import SamplingParams
from inference.decoding.speculation import SequenceSpeculation, SpeculationConfig
from inference.serving.engine import EngineError, EngineSettings
from inference.serving.scheduler import ScheduledSequence, StepScheduler

FIXED_BYTES, BYTES_PER_TOKEN = 1_000, 10


def scheduler(**settings) -> StepScheduler:
    base = dict(max_context=4096, step_token_budget=64, min_prefill_chunk=8, attention_cost_tokens=4096)
    base.update(settings)
    return StepScheduler(EngineSettings(**base), max_context=base["max_context"], fixed_bytes=FIXED_BYTES,
                         bytes_per_token=BYTES_PER_TOKEN)


def submit(s: StepScheduler, prompt_len: int, max_tokens: int = 4, first: int = 0) -> ScheduledSequence:
    seq = ScheduledSequence([(first + i) % 256 for i in range(prompt_len)], max_tokens)
    seq.reserved = s.admissible(prompt_len + max_tokens)
    s.enqueue(seq)
    return seq


def run_step(s: StepScheduler, plan) -> None:
    """The engine's part of a step: each sequence that has read its whole prompt gets one token; one that has
    all its tokens is done."""
    s.account_step(plan)
    for seq, _ in plan:
        if not seq.in_prefill:
            seq.generated.append(len(seq.generated) % 256)
            seq.token_ids.append(seq.generated[-1])
            if len(seq.generated) >= seq.max_tokens:
                s.release(seq)


def bytes_of(length: int) -> int:
    return FIXED_BYTES + BYTES_PER_TOKEN * length


# ------------------------------------------------------------ admission
def test_a_sequence_that_does_not_fit_waits_for_memory_and_runs_once_freed():
    s = scheduler(cache_memory_budget_bytes=2 * bytes_of(100) + bytes_of(50))
    first, second, third = (submit(s, 96) for _ in range(3))
    assert s.admit() == [first, second]  # the third needs bytes_of(100): only bytes_of(50) is left
    assert s.waiting == (third,) and s.reserved_bytes == 2 * bytes_of(100)
    assert s.admit() == [] and s.waiting == (third,)
    s.release(first)
    assert first.finished and s.reserved_bytes == bytes_of(100)
    assert s.admit() == [third] and s.running == (second, third) and s.reserved_bytes == 2 * bytes_of(100)


def test_a_sequence_that_could_never_fit_is_refused_with_a_clear_error():
    s = scheduler(cache_memory_budget_bytes=bytes_of(1000), max_context=4096)
    assert s.admissible(1000) == bytes_of(1000)  # exactly the whole budget: it fits an empty engine
    with pytest.raises(EngineError) as too_big:
        s.admissible(1001)
    assert too_big.value.code == "context_too_long"
    assert f"needs {bytes_of(1001)} bytes" in too_big.value.message and str(bytes_of(1000)) in too_big.value.message
    with pytest.raises(EngineError) as too_long:
        scheduler(max_context=512).admissible(513)
    assert too_long.value.code == "context_too_long" and "context of 512" in too_long.value.message


def test_admission_is_first_come_first_served_within_the_sequence_slots():
    s = scheduler(max_concurrent_sequences=2, cache_memory_budget_bytes=bytes_of(300))
    small = submit(s, 20)
    large = submit(s, 250)  # does not fit beside `small`
    behind = submit(s, 10)  # would fit, but does not overtake the large one
    assert s.admit() == [small] and s.waiting == (large, behind)
    s.release(small)
    assert s.admit() == [large] and s.waiting == (behind,)
    extra = submit(s, 5)
    s.release(large)
    assert s.admit() == [behind, extra]
    assert s.admit() == [] and s.running_count == 2  # both slots are taken


def test_the_wait_queue_is_bounded():
    s = scheduler(max_waiting=2, max_concurrent_sequences=1)
    submit(s, 10), submit(s, 10)
    with pytest.raises(EngineError) as full:
        submit(s, 10)
    assert full.value.code == "queue_full" and "2 requests" in full.value.message
    s.admit()  # one runs: room in the queue again
    submit(s, 10)
    assert s.waiting_count == 2


# ------------------------------------------------------------ prefill and decode
def test_prefill_is_chunked_by_the_step_budget_and_covers_the_prompt_in_order():
    s = scheduler(step_token_budget=64, attention_cost_tokens=1 << 20)  # attention nearly free: units ~ tokens
    seq = submit(s, 200, max_tokens=1)
    s.admit()
    chunks = []
    while seq.in_prefill:
        plan = s.plan_step()
        assert [q for q, _ in plan] == [seq]
        chunks.append(plan[0][1])
        run_step(s, plan)
    # 64 units a step: the oldest's minimum chunk (8 units: 7 whole tokens), then 56 more (rounded down too)
    assert [len(c) for c in chunks] == [63, 63, 63, 11]
    assert sum(chunks, []) == seq.token_ids[:200]  # consecutive slices of the prompt
    assert seq.finished  # its one token came with the last chunk


def test_prefill_chunks_shrink_deep_into_a_long_prompt():
    s = scheduler(step_token_budget=512, attention_cost_tokens=1024)
    seq = ScheduledSequence(list(range(256)) * 160)
    shallow, deep = s.prefill_fit(seq, 0, 512), s.prefill_fit(seq, 16_384, 512)
    for start, n in ((0, shallow), (16_384, deep)):
        assert s.prefill_cost(start, n) <= 512 < s.prefill_cost(start, n + 1)
    assert deep < shallow / 10
    assert s.prefill_fit(seq, len(seq.token_ids) - 5, 512) == 5  # never past the prompt


def test_decoding_sequences_run_their_last_token_first_and_prefill_gets_the_rest_of_the_budget():
    s = scheduler(step_token_budget=64, min_prefill_chunk=8, attention_cost_tokens=1 << 20)
    decoding = [submit(s, 4, max_tokens=50, first=i) for i in range(3)]
    s.admit()
    run_step(s, s.plan_step())  # their prompts: each now has one token to decode
    assert not any(q.in_prefill for q in decoding)
    long = submit(s, 500)
    s.admit()
    plan = s.plan_step()
    assert [q for q, _ in plan] == decoding + [long]
    for seq, chunk in plan[:3]:
        assert chunk == [seq.token_ids[-1]] and seq.consumed == len(seq.token_ids) - 1
    assert len(plan[3][1]) == 60  # 64 units less the 3 decode tokens, each grant rounded down


def test_the_oldest_prefill_advances_even_when_decoding_takes_the_whole_budget():
    s = scheduler(step_token_budget=16, min_prefill_chunk=8, attention_cost_tokens=1 << 20)
    decoding = [submit(s, 1, max_tokens=1000, first=i) for i in range(20)]
    s.admit()
    while any(q.in_prefill for q in decoding):
        run_step(s, s.plan_step())
    long, later = submit(s, 100), submit(s, 3)
    s.admit()
    plan = dict((id(q), chunk) for q, chunk in s.plan_step())
    assert all(len(plan[id(q)]) == 1 for q in decoding)  # 20 decode tokens, over the 16 of the budget
    assert len(plan[id(long)]) == 7  # min_prefill_chunk units of work
    assert id(later) not in plan  # and nothing more


def test_no_sequence_starves_under_a_stream_of_short_prompts():
    """A long prompt keeps advancing while a short request arrives every step, each short prompt overtakes it
    (shortest remaining first), and every decoding sequence gets its token in every step."""
    s = scheduler(step_token_budget=48, min_prefill_chunk=8, max_concurrent_sequences=64)
    long = submit(s, 2000, max_tokens=2)
    s.admit()
    shorts, progress = [], []
    for step in range(400):
        short = submit(s, 6, max_tokens=5, first=step)
        shorts.append(short)
        s.admit()
        plan = s.plan_step()
        planned = {id(q) for q, _ in plan}
        assert all(id(q) in planned for q in s.running if not q.in_prefill)
        before = long.consumed
        run_step(s, plan)
        assert not short.in_prefill  # its whole prompt ran in the step it arrived
        progress.append(long.consumed - before)
        if long.finished:
            break
    assert long.finished, f"the long prompt read {long.consumed} of 2000 tokens in 400 steps"
    assert min(progress) > 0 and len(progress) < 100  # it advanced in every step
    assert all(q.finished for q in shorts[:-4])  # a short request's 5 tokens take 5 steps


def test_random_workloads_keep_the_budgets_and_finish_every_request():
    rng = random.Random(7)
    budget = bytes_of(600)
    s = scheduler(cache_memory_budget_bytes=budget, max_concurrent_sequences=5, step_token_budget=40,
                  min_prefill_chunk=4, max_waiting=1000)
    seqs = []
    for step in range(3000):
        if step < 300 and rng.random() < 0.3:
            seqs.append(submit(s, rng.randint(1, 400), max_tokens=rng.randint(1, 30), first=step))
        s.admit()
        assert s.running_count <= 5 and s.reserved_bytes == sum(q.reserved for q in s.running) <= budget
        if not s.running:
            if step >= 300 and not s.waiting:
                break
            continue
        plan = s.plan_step()
        decode = sum(len(c) for q, c in plan if not q.in_prefill)
        prefill = [(q.consumed, len(c)) for q, c in plan if q.in_prefill]
        assert prefill or decode, "a step with running sequences planned nothing"
        # prefill work within what the decode tokens leave (at least min_prefill_chunk); the oldest's two grants
        # are priced apart, so its chunk may cost up to min_prefill_chunk * units / attention_cost_tokens more
        units = max(40 - decode, 4)
        assert sum(s.prefill_cost(start, n) for start, n in prefill) <= units * (1 + 4 / 4096)
        run_step(s, plan)
    assert all(q.finished and len(q.generated) == q.max_tokens for q in seqs) and len(seqs) > 50


# ------------------------------------------------------------ speculation
def speculating(s: StepScheduler, text: bytes, max_tokens: int) -> ScheduledSequence:
    """A sequence whose ngram drafter always proposes 3 tokens, past its prompt with one token emitted."""
    seq = ScheduledSequence(list(text), max_tokens)
    config = SpeculationConfig(drafter="ngram", max_draft_tokens=3, fixed_draft_tokens=3, min_match=1)
    seq.speculation = SequenceSpeculation.for_request(config, SamplingParams(max_tokens=max_tokens), seq.token_ids)
    seq.reserved = s.admissible(len(text) + max_tokens)
    s.enqueue(seq)
    s.admit()
    s.account_step(s.plan_step())  # the prompt, in one chunk
    emit(seq, ord("c"))
    return seq


def emit(seq: ScheduledSequence, token: int) -> None:
    seq.generated.append(token)
    seq.token_ids.append(token)


def test_a_speculating_sequence_runs_its_drafts_after_its_last_token():
    s = scheduler(step_token_budget=64, attention_cost_tokens=1 << 20)
    seq = speculating(s, b"abcabcabcab", max_tokens=10)
    other = submit(s, 100)
    s.admit()
    plan = s.plan_step()
    assert plan[0] == (seq, list(b"cabc"))  # its last token "c", then the ngram's guess "abc"
    assert seq.draft.tokens == list(b"abc")
    assert plan[1][0] is other and len(plan[1][1]) == 59  # 64 units less the 4 positions, rounded down
    assert s.account_step(plan) == [11, 0] and seq.consumed == 15  # the engine rewinds what it rejects


def test_drafts_never_run_past_max_tokens():
    s = scheduler()
    seq = speculating(s, b"abcabcabcab", max_tokens=3)
    plan = s.plan_step()
    assert plan == [(seq, list(b"ca"))]  # 2 tokens owed: this step's own and one draft
    start, = s.account_step(plan)
    seq.consumed = start + 1  # the draft was rejected; the model's own token is emitted
    emit(seq, ord("x"))
    assert s.plan_step() == [(seq, [ord("x")])] and seq.draft.tokens == []  # one owed: no room for a draft


# ------------------------------------------------------------ micro-batches
def test_micro_batches_balance_the_groups_and_a_sequence_keeps_its_group():
    s = scheduler(micro_batches=3, step_token_budget=64)
    seqs = [submit(s, 10, first=i) for i in range(7)]
    s.admit()
    s.assign_groups()
    assert [q.group for q in seqs] == [0, 1, 2, 0, 1, 2, 0]
    for g in range(3):
        members = s.prune_group(g)
        assert members == [q for q in seqs if q.group == g]
        assert [q for q, _ in s.plan_step(g)] == members  # a group's step carries its members only
    s.release(seqs[1]), s.release(seqs[4])  # group 1's sequences finish
    assert s.prune_group(1) == [] and s.plan_step(1) == []
    late = submit(s, 10)
    s.admit()
    s.assign_groups()
    assert late.group == 1  # the smallest group
    assert [q.group for q in seqs] == [0, 1, 2, 0, 1, 2, 0]  # nobody moved


def test_each_group_gets_the_whole_step_budget():
    s = scheduler(micro_batches=2, step_token_budget=32, attention_cost_tokens=1 << 20)
    a, b = submit(s, 500), submit(s, 500)
    s.admit()
    s.assign_groups()
    assert [(q, len(c)) for q, c in s.plan_step(0)] == [(a, 31)]
    assert [(q, len(c)) for q, c in s.plan_step(1)] == [(b, 31)]
    assert [(q, len(c)) for q, c in s.plan_step()] == [(a, 31)]  # without groups, one budget for both


def test_micro_batches_below_one_are_refused():
    with pytest.raises(ValueError, match="micro_batches must be >= 1"):
        scheduler(micro_batches=0)


# ------------------------------------------------------------ cancellation
def test_a_cancelled_waiting_sequence_is_dropped_and_frees_its_place():
    s = scheduler(max_concurrent_sequences=1)
    running, cancelled, behind = submit(s, 10), submit(s, 10), submit(s, 10)
    s.admit()
    cancelled.cancelled = True
    s.release(running)
    assert s.admit() == [behind] and cancelled.finished and s.waiting == ()


def test_a_cancelled_running_sequence_is_reported_and_its_memory_goes_to_the_next():
    s = scheduler(cache_memory_budget_bytes=bytes_of(200))
    first, second = submit(s, 150), submit(s, 150)
    s.admit()
    assert s.cancelled() == [] and s.waiting == (second,)
    first.cancelled = True
    assert s.cancelled() == [first]  # the engine ends it (a final "cancelled" event), then releases it
    s.release(first)
    assert s.reserved_bytes == 0 and s.admit() == [second] and s.reserved_bytes == bytes_of(154)
    assert s.plan_step()[0][0] is second  # the cancelled one is planned no more


def test_drain_forgets_every_sequence_and_the_budget():
    s = scheduler(max_concurrent_sequences=1, micro_batches=2)
    a, b = submit(s, 10), submit(s, 10)
    s.admit()
    s.assign_groups()
    assert s.drain() == [a, b]
    assert s.running == () and s.waiting == () and s.reserved_bytes == 0 and s.prune_group(0) == []
    c = submit(s, 10)
    assert s.admit() == [c]
