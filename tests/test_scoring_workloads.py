"""Workload generation: seeded, in the configured mix, within the miner's declared limits, with
nothing in a request that tells a probe from ordinary traffic."""
import json
import random
import re
from collections import Counter

import pytest

from inference.model import ByteTokenizer, ModelConfig
from protocol.schemas import Capabilities, Limits, encode_model
from scoring import corpus
from scoring.canaries import Canary, CanaryPool
from scoring.config import ScoringConfig, ScoringConfigError
from scoring.workloads import WorkloadError, canary_prompts, group_bursts, plan_round

MODEL = ModelConfig.tiny()
# Small prompts keep hundreds of rounds fast; the logic is the same at any size.
def wide_testnet(**overrides) -> ScoringConfig:
    """The local testnet profile with the wider ranges these tests exercise (32k contexts, 64-stream bursts)."""
    base = dict(round_requests=40, chat_prompt_tokens=(16, 1024), chat_max_tokens=(64, 256),
                long_context_sizes=(2048, 4096, 8192, 16_384, 32_768), long_context_max_tokens=(16, 48),
                burst_streams=(2, 64))
    base.update(overrides)
    return ScoringConfig.local_testnet(**base)


FAST = wide_testnet(chat_prompt_tokens=(16, 200), long_context_sizes=(256, 512))


@pytest.fixture(scope="module")
def tokenizer():
    return ByteTokenizer.from_config(MODEL)


def capabilities(max_context=1024, streams=8, **limits):
    return Capabilities(model_id=MODEL.model_id, model_fingerprint="fp", vocab_size=MODEL.vocab_size,
                        max_context=max_context, max_concurrent_streams=streams, engine="reference",
                        precision="fp32", software_version="0.1.0", limits=Limits(**limits))


@pytest.fixture(scope="module")
def many_rounds(tokenizer):
    caps = capabilities()
    rng = random.Random(11)
    return [plan_round(rng, caps, FAST, tokenizer=tokenizer) for _ in range(150)]


def test_plan_is_deterministic_per_seed(tokenizer):
    caps = capabilities(max_context=8192)
    config = wide_testnet()

    def plan(seed):
        items = plan_round(random.Random(seed), caps, config, tokenizer=tokenizer)
        return [(i.kind, encode_model(i.request), i.prompt_ids, i.expect, i.burst_id) for i in items]

    assert plan(5) == plan(5)
    assert plan(5) != plan(6)


def test_mix_fractions_over_many_rounds(many_rounds):
    kinds = Counter(item.kind for items in many_rounds for item in items)
    total = sum(kinds.values())
    expected_total = 150 * FAST.round_requests
    assert abs(total - expected_total) < 0.05 * expected_total
    for kind, share in FAST.mix.items():
        assert abs(kinds[kind] / total - share) < 0.02, (kind, kinds[kind] / total)


def test_bursts_are_sized_by_declared_capacity(tokenizer, many_rounds):
    sizes = []
    for items in many_rounds:
        _, bursts = group_bursts(items)
        for burst_id, streams in bursts.items():
            assert {s.burst_size for s in streams} == {len(streams)}
            assert all(s.kind == "burst" for s in streams)
            sizes.append(len(streams))
    assert min(sizes) >= 4 and max(sizes) <= 8  # [0.5, 1.0] x 8 declared streams
    assert len(set(sizes)) > 2
    # A miner declaring 1000 streams gets bursts of at most burst_streams[1], now and then.
    rng = random.Random(1)
    big = [len(s) for _ in range(30)
           for s in group_bursts(plan_round(rng, capabilities(streams=1000), FAST, tokenizer=tokenizer))[1].values()]
    assert big and set(big) == {FAST.burst_streams[1]}


def _public(request) -> dict:
    return json.loads(encode_model(request))


def test_probes_look_like_chat(many_rounds):
    chat = [i.request for items in many_rounds for i in items if i.kind == "chat"]
    probes = [i for items in many_rounds for i in items if i.kind == "probe"]
    assert {p.expect.probe for p in probes} == {"copy", "planted_fact"}  # no canary pool given
    chat_bodies = [_public(r) for r in chat]
    probe_bodies = [_public(p.request) for p in probes]
    # Same fields, and every constant field has the same value in both.
    assert {tuple(sorted(b)) for b in chat_bodies} == {tuple(sorted(b)) for b in probe_bodies}
    for name in ("protocol_version", "prompt", "add_special_tokens", "top_p", "top_k", "stop", "logprobs"):
        assert {json.dumps(b[name]) for b in probe_bodies} <= {json.dumps(b[name]) for b in chat_bodies}, name
    # Random request ids and seeds of one shape.
    for body in chat_bodies + probe_bodies:
        assert re.fullmatch(r"[0-9a-f]{32}", body["request_id"]) and isinstance(body["seed"], int)
    assert len({b["request_id"] for b in chat_bodies + probe_bodies}) == len(chat_bodies) + len(probe_bodies)
    # Numeric parameters inside the ranges ordinary chat uses; greedy is common in chat too.
    for name in ("max_tokens", "temperature"):
        values = [b[name] for b in chat_bodies]
        assert all(min(values) <= b[name] <= max(values) for b in probe_bodies), name
    chat_temperatures = [b["temperature"] for b in chat_bodies]
    assert 0.1 < chat_temperatures.count(0.0) / len(chat_temperatures) < 0.4
    # Ordinary chat asks for copies and planted facts too, with prompts of the same sizes, so
    # neither the wording nor the size marks a probe.
    family_sizes = {"copy": [], "planted_fact": []}
    for items in many_rounds:
        for item in items:
            if item.kind == "chat":
                text = bytes(t for t in item.prompt_ids if t < 256).decode()
                if "Repeat the following text exactly" in text:
                    family_sizes["copy"].append(item.prompt_tokens)
                elif "What is the access code for" in text:
                    family_sizes["planted_fact"].append(item.prompt_tokens)
    for family, chat_sizes in family_sizes.items():
        probe_sizes = sorted(p.prompt_tokens for p in probes if p.expect.probe == family)
        assert len(chat_sizes) > 50 and len(probe_sizes) > 50
        chat_sizes.sort()
        assert 0.9 * chat_sizes[0] <= probe_sizes[0] and probe_sizes[-1] <= 1.1 * chat_sizes[-1], family
        median_ratio = probe_sizes[len(probe_sizes) // 2] / chat_sizes[len(chat_sizes) // 2]
        assert 0.8 < median_ratio < 1.25, family


def test_text_prompts_everywhere_when_configured(tokenizer):
    config = FAST.replace(prompt_format="text")
    items = plan_round(random.Random(3), capabilities(), config, tokenizer=tokenizer)
    assert all(i.request.prompt is not None and i.request.prompt_token_ids is None for i in items)
    for item in items:
        assert list(item.prompt_ids) == tokenizer.encode(item.request.prompt)


def test_long_context_plants_a_fact_at_varied_depths(tokenizer):
    caps = capabilities(max_context=16384)
    config = wide_testnet()
    rng = random.Random(8)
    longs = [i for _ in range(6) for i in plan_round(rng, caps, config, tokenizer=tokenizer) if i.kind == "long_context"]
    depths = []
    for item in longs:
        text = tokenizer.decode(item.prompt_ids)
        fact = corpus.planted_fact(item.expect.subject, item.expect.answer)
        assert text.count(fact) == 1
        user_message = text.split("<|im_end|>")[0]
        assert user_message.endswith(corpus.planted_question(item.expect.subject))
        assert text.count(item.expect.answer) == 1  # distractors carry other codes
        measured = text.index(fact) / len(text)
        assert abs(measured - item.expect.depth) < 0.02
        depths.append(item.expect.depth)
    assert min(depths) < 0.3 and max(depths) > 0.7
    sizes = {i.prompt_tokens for i in longs}
    assert len(sizes) >= 3


def test_sizes_stay_within_the_declared_limits(tokenizer):
    for max_context, max_tokens_limit in ((4096, 32768), (16384, 100), (40000, 32768)):
        caps = capabilities(max_context=max_context, max_tokens=max_tokens_limit)
        config = wide_testnet(chat_max_tokens=(64, 256))
        items = plan_round(random.Random(max_context), caps, config, tokenizer=tokenizer)
        for item in items:
            assert item.prompt_tokens + item.request.max_tokens <= max_context
            assert item.request.max_tokens <= max_tokens_limit
        longs = [i.prompt_tokens for i in items if i.kind == "long_context"]
        # The declared maximum itself gets tested (within a paragraph of it).
        top = min(max_context, caps.limits.max_prompt_tokens) - config.long_context_max_tokens[1]
        all_sizes = [i.prompt_tokens for _ in range(3)
                     for i in plan_round(random.Random(_), caps, config, tokenizer=tokenizer) if i.kind == "long_context"]
        assert max(longs + all_sizes) > 0.9 * top


def test_a_context_too_small_is_a_clear_error(tokenizer):
    with pytest.raises(WorkloadError, match="declares a context of 200 tokens"):
        plan_round(random.Random(0), capabilities(max_context=200), FAST, tokenizer=tokenizer)


def test_canaries_are_used_once_and_run_out(tokenizer):
    caps = capabilities(max_context=2048)
    config = wide_testnet(chat_prompt_tokens=(16, 200), chat_max_tokens=(64, 128),
                                         probe_weights=(5.0, 1.0, 1.0))
    prompts = canary_prompts(random.Random(2), 6, caps, config, tokenizer)
    pool = CanaryPool(Canary(f"c{k}", tuple(p), (1,) * 64, (1.0,) * 64) for k, p in enumerate(prompts))
    rng = random.Random(4)
    seen = []
    for _ in range(4):
        for item in plan_round(rng, caps, config, tokenizer=tokenizer, canaries=pool):
            if item.expect.probe == "canary":
                seen.append(item.expect.canary.canary_id)
                assert item.request.temperature == 0.0 and item.prompt_ids == item.expect.canary.prompt_ids
                assert config.chat_max_tokens[0] <= item.request.max_tokens <= config.chat_max_tokens[1]
    assert sorted(seen) == [f"c{k}" for k in range(6)]  # all used, none twice
    assert pool.remaining == 0


def test_config_refuses_inconsistent_values():
    with pytest.raises(ScoringConfigError, match="add up to 1"):
        ScoringConfig(mix_chat=0.5)
    with pytest.raises(ScoringConfigError, match="canary_tokens"):
        ScoringConfig(chat_max_tokens=(32, 2048))
    with pytest.raises(ScoringConfigError, match="buffered"):
        ScoringConfig(long_context_max_tokens=(16, 100))
    with pytest.raises(ScoringConfigError, match="prompt_format"):
        ScoringConfig(prompt_format="xml")
    assert ScoringConfig().quality_from_margin(0.1) == 1.0
    assert ScoringConfig().quality_from_margin(0.1875) == pytest.approx(0.5)
    assert ScoringConfig().quality_from_margin(0.3) == 0.0


def test_corpus_is_seeded_and_varied():
    assert corpus.paragraphs(random.Random(1), 2000) == corpus.paragraphs(random.Random(1), 2000)
    texts = [corpus.paragraph(random.Random(k), genre) for k, genre in enumerate(corpus.GENRES)]
    assert len(set(texts)) == len(corpus.GENRES)
    assert "def " in corpus.paragraph(random.Random(0), "code")
    words = set(" ".join(corpus.paragraphs(random.Random(2), 20000)).split())
    assert len(words) > 800
    code = corpus.access_code(random.Random(3))
    assert re.fullmatch(r"[1-9][0-9]{5}", code)
    with pytest.raises(ValueError, match="unknown genre"):
        corpus.paragraph(random.Random(0), "poetry")
