"""The replay of sampled answers (scoring/replay.py): the validator's engine recomputes, while it scores an answer,
the token k3-gumbel/1 draws at each generated index from the reported seed; an honest answer replays exactly, a
greedy one, one drawn with another seed or at another temperature does not, and the binomial judgement against
the honest rate fails it (hard on the validator's own engine)."""
import dataclasses
import json
import random

import pytest
from conftest import collect_events

from inference.decoding.sampling import ReplayKey
from inference.serving import EngineError, EngineSettings, FinalEvent, GenerationRequest, LocalEngine, SamplingParams
from protocol.client import GenerateResult, TimedEvent
from protocol.schemas import Capabilities, FinalMessage, GenerateRequest, Timings, TokenMessage, TopLogprob, Usage
from protocol.signature import sign_response
from scoring.audit_sequence import audit_probability
from scoring.config import ScoringConfig
from scoring.model_envelope import ModelEnvelopeError, build_replay, parse_envelope, with_replay
from scoring.replay import ReplayRule, ReplayStatistics, judge_replay, replay_rule
from scoring.tier0 import check_tier0
from scoring.tier1 import audit_tier1
from scoring.workloads import WorkItem, resend, with_resends

PROMPT = list(b"The river keeps its own counsel, and the town below it listens. ")
CONFIG = ScoringConfig.local_testnet()


def engine_for(model, tokenizer):
    return LocalEngine(model, tokenizer, EngineSettings(max_context=4096), model_fingerprint="tiny-fp")


async def answer(engine, params: SamplingParams, prompt=PROMPT):
    tokens, final = await collect_events(engine.generate(GenerationRequest(list(prompt), params)))
    return [t.token_id for t in tokens], [t.logprob for t in tokens], final


async def read_until_final(stream):
    """(token ids, final event) read as the miner's server reads an engine's stream: it stops at the final event
    and closes the stream."""
    tokens = []
    try:
        async for event in stream:
            if isinstance(event, FinalEvent):
                return tokens, event
            tokens.append(event.token_id)
    finally:
        await stream.aclose()
    raise AssertionError("the stream ended without a final event")


async def replayed(engine, tokens, params: SamplingParams, seed: int, prompt=PROMPT) -> ReplayStatistics:
    key = ReplayKey(params, seed, len(prompt))
    scored = await engine.score(list(prompt) + tokens, list(range(len(prompt), len(prompt) + len(tokens))), 5, key)
    assert [s.replayed.index for s in scored] == list(range(len(tokens)))
    return ReplayStatistics.of([s.replayed for s in scored], params.temperature)


async def test_the_engine_replays_its_own_sampled_answer_and_not_another_seeds(model, tokenizer):
    async with engine_for(model, tokenizer) as engine:
        for temperature in (0.3, 1.0):
            params = SamplingParams(max_tokens=24, temperature=temperature, seed=11, ignore_eos=True)
            tokens, _, final = await answer(engine, params)
            honest = await replayed(engine, tokens, params, final.seed)
            assert honest.positions == 24 and honest.mismatches == 0 and honest.worst_gap == 0.0
            other_seed = await replayed(engine, tokens, params, 12)
            assert other_seed.beyond(0.01) >= 4  # at least one token in six, even at a low temperature
        with pytest.raises(EngineError, match="temperature above 0"):
            await engine.score(PROMPT + tokens, None, 0, ReplayKey(SamplingParams(), 11, len(PROMPT)))


def test_the_judgement_is_a_binomial_tail_against_the_honest_rate():
    rule = ReplayRule(delta=0.1, rate=1e-3, source="a test")
    near = ReplayStatistics(64, 0.8, [0.0] * 60 + [0.05, 0.09, 0.0, 0.0], [1.0] * 64)
    assert near.mismatches == 2 and near.beyond(0.1) == 0 and judge_replay(near, rule, CONFIG, True) == []
    two = ReplayStatistics(64, 0.8, [0.0] * 62 + [0.5, 2.0], [1.0] * 64)
    assert judge_replay(two, rule, CONFIG, True) == []  # 2 in 64 at 1e-3: chance 2e-3, an honest miner could
    many = ReplayStatistics(64, 0.8, [0.0] * 56 + [0.5] * 8, [1.0] * 64)
    (failure,) = judge_replay(many, rule, CONFIG, True)
    assert failure.check == "replay_mismatch" and failure.hard and "8 of 64" in failure.reason
    assert not judge_replay(many, rule, CONFIG, trusted=False)[0].hard  # miner auditors never confirm hard
    (soft,) = judge_replay(ReplayStatistics(64, 0.8, [0.0] * 60 + [0.5] * 4, [1.0] * 64), rule, CONFIG, True)
    assert not soft.hard  # 4 in 64: chance 6e-7, under 1e-6 but not under 1e-12


def test_the_replay_section_of_an_envelope_file(tmp_path, trained_checkpoint):
    from inference.model import fingerprint
    rows = [("bf16", "bf16", 10, 200, [0.01, 0.04], [0.5] * 199 + [0.02]),
            ("bf16-gpu-kernels", "bfloat16", 10, 200, [0.03], [0.5] * 200),
            ("fp32-batched", "fp32", 10, 240, [], [0.5] * 240)]
    section = build_replay(rows)
    bf16, fp32 = section["precisions"]["bf16"], section["precisions"]["fp32"]
    assert bf16["positions"] == 400 and bf16["mismatches"] == 3 and bf16["delta"] == pytest.approx(0.06)
    assert bf16["beyond_delta"] == 0 and bf16["near_ties"] == 1 and 0.007 < bf16["rate_95"] < 0.008  # ~3/400
    assert fp32["delta"] == 1e-3 and fp32["worst_gap"] == 0.0
    base = {"format": "k3-model-envelope", "version": 1, "checkpoint": "x", "fingerprint": fingerprint(trained_checkpoint),
            "margin": 1.5, "precisions": {}}
    path = tmp_path / "envelope.json"
    path.write_text(json.dumps(with_replay(base, section)))
    config = CONFIG.replace(logprob_gap_envelope=str(path))
    rule = replay_rule(config, "bfloat16")
    assert (rule.delta, rule.rate) == (bf16["delta"], bf16["rate_95"]) and "bf16" in rule.source
    unmeasured = replay_rule(config, "fp16")  # not measured: the conservative values, said so
    assert (unmeasured.delta, unmeasured.rate) == (CONFIG.replay_delta_unmeasured, CONFIG.replay_rate_unmeasured)
    assert "no envelope" in unmeasured.source
    with pytest.raises(ModelEnvelopeError, match="replay section is not version 1"):
        parse_envelope({**base, "replay": {**section, "version": 2}})


def final_message(key, body: bytes, tokens, seed):
    return FinalMessage(finish_reason="length", usage=Usage(prompt_tokens=len(PROMPT), completion_tokens=len(tokens)),
                        timings=Timings(queue_ms=0.0, ttft_ms=1.0, total_ms=2.0), model_fingerprint="tiny-fp",
                        signature=sign_response(key, body, tokens, seed), seed=seed)


def result_of(request: GenerateRequest, tokens, logprobs, key, seed) -> GenerateResult:
    body = request.model_dump_json().encode()
    events = [TimedEvent(TokenMessage(index=i, token_ids=[t], text="", logprobs=[min(lp, 0.0)],
                                      top_logprobs=[[TopLogprob(token_id=t, logprob=min(lp, 0.0))]]), 0.001 * (i + 1))
              for i, (t, lp) in enumerate(zip(tokens, logprobs))]
    return GenerateResult(request=request, body=body, started_at=0.0, events=events,
                          final=final_message(key, body, tokens, seed))


async def test_audits_replay_a_k3_gumbel_miners_sampled_answers(model, tokenizer):
    """Tier 1 on the validator's engine: an honest sampled answer passes its replay; a greedy answer, an answer
    drawn with another seed or at half the temperature (each reporting the seed and temperature asked) fails hard;
    without replay (a miner declaring its engine's own sampler) the same greedy answer is not caught by it."""
    from bittensor.sp_core import Keypair
    key = Keypair.create_from_mnemonic(Keypair.generate_mnemonic())
    request = GenerateRequest(request_id="r1", prompt_token_ids=PROMPT, max_tokens=32, temperature=0.8, seed=5,
                              logprobs=1)
    asked = SamplingParams(max_tokens=32, temperature=0.8, seed=5, ignore_eos=True)
    async with engine_for(model, tokenizer) as engine:
        runs = {"honest": await answer(engine, asked),
                "greedy": await answer(engine, dataclasses.replace(asked, temperature=0.0)),
                "other seed": await answer(engine, dataclasses.replace(asked, seed=6)),
                "cooler": await answer(engine, dataclasses.replace(asked, temperature=0.4))}
        # what an envelope measured on fp32 would say (the random tiny model has none measured)
        fp32 = CONFIG.replace(replay_delta_unmeasured=1e-3, replay_rate_unmeasured=1e-3)
        audits = {}
        for name, (tokens, logprobs, _) in runs.items():
            result = result_of(request, tokens, logprobs, key, 5)
            audits[name] = await audit_tier1(PROMPT, result, engine, fp32, stop_ids=tokenizer.stop_ids,
                                             rng=random.Random(0), declared_precision="fp32", replay=True)
        unreplayed = await audit_tier1(PROMPT, result_of(request, *runs["greedy"][:2], key, 5), engine, fp32,
                                       stop_ids=tokenizer.stop_ids, rng=random.Random(0), declared_precision="fp32")
    assert audits["honest"].passed and audits["honest"].replay.mismatches == 0
    for name in ("greedy", "other seed", "cooler"):
        failures = [f for f in audits[name].failures if f.check == "replay_mismatch"]
        assert failures and failures[0].hard, (name, audits[name].failures)
    assert unreplayed.replay is None and not any(f.check == "replay_mismatch" for f in unreplayed.failures)


def test_tier0_holds_the_miner_to_the_seed_asked(tokenizer):
    from bittensor.sp_core import Keypair
    key = Keypair.create_from_mnemonic(Keypair.generate_mnemonic())
    caps = Capabilities(model_id="m", model_fingerprint="tiny-fp", vocab_size=272, max_context=4096,
                        max_concurrent_streams=4, engine="reference", precision="fp32", sampler="k3-gumbel/1",
                        software_version="0")
    request = GenerateRequest(request_id="r2", prompt_token_ids=PROMPT, max_tokens=2, temperature=0.7, seed=5,
                              logprobs=1)
    ok = result_of(request, [65, 66], [-1.0, -1.0], key, 5)
    assert check_tier0(None, ok, tokenizer, caps, key.ss58_address) == []
    other = result_of(request, [65, 66], [-1.0, -1.0], key, 9)  # signed, but not the seed asked
    assert [(f.check, f.hard) for f in check_tier0(None, other, tokenizer, caps, key.ss58_address)] == [("seed", True)]
    unseeded = request.model_copy(update={"seed": None})
    missing = result_of(unseeded, [65, 66], [-1.0, -1.0], key, None)
    assert [f.check for f in check_tier0(None, missing, tokenizer, caps, key.ss58_address)] == ["seed_missing"]
    engine_caps = caps.model_copy(update={"sampler": "engine"})
    assert check_tier0(None, missing, tokenizer, engine_caps, key.ss58_address) == []


def test_resends_repeat_an_earlier_sampled_prompt_with_another_seed_and_are_always_audited():
    rng = random.Random(3)
    sampled = [WorkItem("chat", GenerateRequest(request_id=f"r{i}", prompt_token_ids=PROMPT, max_tokens=8,
                                                temperature=0.5, seed=i), tuple(PROMPT)) for i in range(50)]
    greedy = WorkItem("chat", GenerateRequest(request_id="g", prompt_token_ids=PROMPT, max_tokens=8, temperature=0.0,
                                              seed=1), tuple(PROMPT))
    config = CONFIG.replace(replay_resend_rate=0.5)
    out = with_resends(rng, sampled + [greedy], sampled[:3], config)
    resent = [i for i in out if i.resend_of is not None]
    assert 10 < len(resent) < 40 and out[-1] is greedy  # only sampled chat items are replaced
    for item in resent:
        first = next(s for s in sampled[:3] if s.request.request_id == item.resend_of)
        assert item.request.prompt_token_ids == first.request.prompt_token_ids
        assert item.request.seed != first.request.seed and item.request.request_id != first.request.request_id
        assert item.request.temperature == first.request.temperature
    assert with_resends(rng, sampled, [], config) == sampled  # nothing sent before: nothing to resend
    one = resend(rng, sampled[0])
    assert audit_probability(one, CONFIG, new_or_suspect=False) == 1.0
    assert audit_probability(sampled[0], CONFIG, new_or_suspect=False) == CONFIG.audit_rate


async def test_the_sampling_cheats_run_the_real_model_but_not_the_sampler_asked(model, tokenizer):
    """localnet/cheats/miner.py's sampling cheats, each reporting the seed asked: what each one really ran."""
    from localnet.cheats.miner import CheatingEngine
    asked = SamplingParams(max_tokens=16, temperature=0.8, seed=5, ignore_eos=True)
    async with engine_for(model, tokenizer) as honest:
        want = {"honest": await answer(honest, asked),
                "greedy": await answer(honest, dataclasses.replace(asked, temperature=0.0)),
                "cooler": await answer(honest, dataclasses.replace(asked, temperature=0.4)),
                "seed 0": await answer(honest, dataclasses.replace(asked, seed=0))}
    runs = {"greedy-for-sampled": "greedy", "cooler-sampling": "cooler", "fixed-seed": "seed 0"}
    for cheat, ran in runs.items():
        async with CheatingEngine(engine_for(model, tokenizer), cheat) as engine:
            tokens, _, final = await answer(engine, asked)
            greedy, _, _ = await answer(engine, dataclasses.replace(asked, temperature=0.0))
        assert tokens == want[ran][0] != want["honest"][0] and final.seed == 5, cheat
        assert greedy == want["greedy"][0]  # greedy requests (canaries) are served honestly
    async with CheatingEngine(engine_for(model, tokenizer), "seed-ignoring-replay") as engine:
        first, _ = await read_until_final(engine.generate(GenerationRequest(list(PROMPT), asked)))  # as a miner does
        again, final = await read_until_final(engine.generate(GenerationRequest(list(PROMPT),
                                                                                dataclasses.replace(asked, seed=6))))
    assert first == want["honest"][0] and again == first and final.seed == 6  # the cached answer, the new seed
    async with CheatingEngine(engine_for(model, tokenizer), "coarse-experts-for-sampled") as engine:
        tokens, _, _ = await answer(engine, asked)
        greedy, _, _ = await answer(engine, dataclasses.replace(asked, temperature=0.0))
    assert tokens != want["honest"][0] and greedy == want["greedy"][0]
