"""Speculative decoding inside the serving engine: continuous batching with per-sequence drafts, output equal
to the plain engine's (greedy, and sampled for the same seed), the counts and the seed in the final event, and
clear refusals."""
import asyncio
import dataclasses

import pytest
from conftest import collect_events

from inference.decoding.drafters import ReplayDrafter
from inference.decoding.sampling import SamplingParams
from inference.decoding.speculation import SpeculationConfig
from inference.model.config import ModelConfig
from inference.model.k3 import KimiK3Model
from inference.serving.engine import EngineSettings, GenerationRequest
from inference.serving.local_engine import LocalEngine

CONFIG = ModelConfig.tiny()


@pytest.fixture(scope="module")
def model():
    return KimiK3Model(CONFIG, seed=3)


def engine(model, tokenizer, speculation=None):
    settings = EngineSettings(max_context=4096, step_token_budget=64, min_prefill_chunk=16)
    return LocalEngine(model, tokenizer, settings, model_fingerprint="test", speculation=speculation)


REQUESTS = [
    GenerationRequest(list(b"the cat sat on the mat. the cat sat on the mat. the cat"), SamplingParams(max_tokens=14)),
    GenerationRequest(list(b"def f(a):\n    return a\n\ndef g(a):\n    return a\n" * 3), SamplingParams(max_tokens=10)),
    GenerationRequest(list(b"Quiet lynx wove bright jumpers"), SamplingParams(max_tokens=12, logprobs=2)),
]


@pytest.mark.parametrize("kind", ["ngram", "suffix"])
async def test_greedy_batched_speculation_equals_the_plain_engine(model, tokenizer, kind):
    # always draft 3 tokens when the drafter has a guess: many verify steps, rejections and rewinds, in
    # batches that mix verify steps, plain steps and the prefill of the longer prompts
    # (min_match 1: a random model's bytes rarely repeat longer n-grams)
    # A prompt holding every byte: whatever byte the random model emits has been seen, so the drafters
    # always have a guess (acceptance itself is tested with drafts of known quality below).
    requests = REQUESTS + [GenerationRequest(list(range(256)) + list(b"abc"), SamplingParams(max_tokens=8))]
    async with engine(model, tokenizer) as plain:
        want = await asyncio.gather(*(collect_events(plain.generate(r)) for r in requests))
    spec = SpeculationConfig(drafter=kind, max_draft_tokens=3, fixed_draft_tokens=3, min_match=1)
    async with engine(model, tokenizer, spec) as fast:
        got = await asyncio.gather(*(collect_events(fast.generate(r)) for r in requests))
    proposed = accepted = 0
    for (want_tokens, want_final), (tokens, final) in zip(want, got):
        assert [t.token_id for t in tokens] == [t.token_id for t in want_tokens]
        for a, b in zip(tokens, want_tokens):
            assert a.logprob == pytest.approx(b.logprob, abs=1e-4)
            assert [i for i, _ in a.top_logprobs] == [i for i, _ in b.top_logprobs]
        assert final.finish_reason == want_final.finish_reason and final.completion_tokens == len(tokens)
        assert want_final.draft_proposed == 0
        proposed += final.draft_proposed
        accepted += final.draft_accepted
    assert proposed > accepted and proposed >= 10  # drafts were verified and rejected ones rewound


async def test_batched_speculation_with_drafts_that_mostly_accept(model, tokenizer):
    """Drafts of known quality (the plain output, every 4th token altered): several tokens per verify step
    for every sequence of the batch, and still the plain engine's tokens."""
    async with engine(model, tokenizer) as plain:
        want = await asyncio.gather(*(collect_events(plain.generate(r)) for r in REQUESTS))
    continuations = {tuple(r.prompt_token_ids): [t.token_id for t in w[0]] for r, w in zip(REQUESTS, want)}

    def replay(prompt_ids):
        return ReplayDrafter(len(prompt_ids), continuations[tuple(prompt_ids)], CONFIG.vocab_size, wrong_every=4)

    async with engine(model, tokenizer, SpeculationConfig(drafter_factory=replay)) as fast:
        got = await asyncio.gather(*(collect_events(fast.generate(r)) for r in REQUESTS))
    for (want_tokens, _), (tokens, final) in zip(want, got):
        assert [t.token_id for t in tokens] == [t.token_id for t in want_tokens]
        assert final.draft_accepted >= 0.5 * final.draft_proposed > 0
        assert final.verify_steps < 0.6 * len(tokens)


async def test_batched_sampled_speculation_equals_the_plain_engine_and_reports_its_seed(model, tokenizer):
    """Sampled requests batched together, with drafts that mostly accept: the speculating engine emits the plain
    engine's tokens for the same seed (k3-gumbel/1), stops at max_tokens, and every final event names the seed,
    a drawn one too, with which the answer replays."""
    requests = [GenerationRequest(r.prompt_token_ids, SamplingParams(max_tokens=r.sampling.max_tokens, temperature=t,
                                                                     top_p=top_p, seed=seed, logprobs=2))
                for r, (t, top_p, seed) in zip(REQUESTS, [(0.8, 1.0, 4), (1.0, 0.9, 5), (0.5, 1.0, None)])]
    async with engine(model, tokenizer) as plain:
        assert plain.capabilities().sampler == "k3-gumbel/1"
        want = await asyncio.gather(*(collect_events(plain.generate(r)) for r in requests))
    assert [f.seed for _, f in want[:2]] == [4, 5] and want[2][1].seed is not None  # the drawn seed is reported
    replays = [dataclasses.replace(r, sampling=dataclasses.replace(r.sampling, seed=f.seed))
               for r, (_, f) in zip(requests, want)]
    continuations = {tuple(r.prompt_token_ids): [t.token_id for t in w[0]] for r, w in zip(requests, want)}

    def replay(prompt_ids):
        return ReplayDrafter(len(prompt_ids), continuations[tuple(prompt_ids)], CONFIG.vocab_size, wrong_every=4)

    async with engine(model, tokenizer, SpeculationConfig(drafter_factory=replay)) as fast:
        got = await asyncio.gather(*(collect_events(fast.generate(r)) for r in replays))
    for (want_tokens, want_final), (tokens, final), r in zip(want, got, requests):
        assert [t.token_id for t in tokens] == [t.token_id for t in want_tokens]
        assert [t.index for t in tokens] == list(range(len(tokens)))
        assert final.seed == want_final.seed and final.finish_reason == want_final.finish_reason
        assert final.draft_accepted >= 0.5 * final.draft_proposed > 0
    assert len(got[0][0]) == requests[0].sampling.max_tokens or got[0][1].finish_reason == "eos"


def test_engine_refuses_bad_speculation_settings(model, tokenizer):
    with pytest.raises(ValueError, match="speculate must be one of"):
        engine(model, tokenizer, SpeculationConfig(drafter="medusa"))

    class NoRewindModel:  # the surface of a model whose caches cannot rewind (like the sharded runtime's)
        config = CONFIG

        def new_cache(self):
            return object()

    with pytest.raises(ValueError, match="caches that rewind"):
        LocalEngine(NoRewindModel(), tokenizer, speculation=SpeculationConfig(drafter="ngram"))
    # "none" is plain decoding, accepted by any model
    LocalEngine(NoRewindModel(), tokenizer, speculation=SpeculationConfig(drafter="none"))


async def test_the_miner_flag_builds_a_speculating_engine_with_the_plain_output(tiny_checkpoint):
    from inference.serving import build_engine
    from neurons.miner_app import read_miner_settings

    base = ["--netuid", "1", "--network", "devnet:/nonexistent.sqlite", "--checkpoint", str(tiny_checkpoint)]
    plain_settings, _ = read_miner_settings(base, {})
    fast_settings, _ = read_miner_settings(base + ["--speculate", "ngram", "--draft-tokens", "4"], {})
    assert fast_settings.engine.speculate == "ngram" and fast_settings.engine.draft_tokens == 4
    request = GenerationRequest(REQUESTS[0].prompt_token_ids, SamplingParams(max_tokens=6))
    async with build_engine(plain_settings.engine) as plain:
        assert plain.speculation is None
        want, _ = await collect_events(plain.generate(request))
    async with build_engine(fast_settings.engine) as fast:
        assert fast.speculation.drafter == "ngram" and fast.speculation.max_draft_tokens == 4
        got, final = await collect_events(fast.generate(request))
    assert [t.token_id for t in got] == [t.token_id for t in want]
    assert final.draft_proposed >= final.draft_accepted
