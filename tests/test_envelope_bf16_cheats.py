"""The per-model envelope (scoring/model_envelope.py): a bf16 miner that also halves its experts or truncates
the context passes under the wide logprob-gap bound (set on the random tiny model) and fails under the bound
measured for the trained tiny model, while honest bf16 passes both; through `audit_tier1` on a real engine."""
import asyncio
import json
import random
from pathlib import Path

import pytest
import torch

from inference.model import load_tokenizer
from inference.serving import EngineSettings, LocalEngine
from protocol.client import GenerateResult, TimedEvent
from protocol.schemas import GenerateRequest, TokenMessage
from scoring.config import ScoringConfig, ScoringConfigError
from scoring.envelope import Answer, generate, load_model, measure_envelope
from scoring.model_envelope import build_envelope, load_envelope, parse_envelope
from scoring.tier1 import audit_tier1, judge_statistics, logprob_gap_bound

ROOT = Path(__file__).resolve().parents[1]
TRAINED_TINY = ROOT / "inference" / "model" / "assets" / "tiny_trained"
ENVELOPE = str(ROOT / "scoring" / "envelopes" / "tiny_trained.json")  # bench_verification.py --write-envelope


def test_bounds_cover_what_was_measured_and_nothing_else(tmp_path):
    rows = [("bf16", "bf16", False, n, 0.01 + n / 10_000) for n in range(20, 130)]
    rows += [("bf16", "bf16", True, 513, 0.02)] * 60 + [("fp32", "fp32", False, 40, 0.0)] * 60
    rows += [("fp8-dense", "fp8", False, 40, 0.05)] * 49  # too few to tighten anything
    data = build_envelope(rows, checkpoint="ckpt", margin=1.5)
    assert set(data["precisions"]) == {"bf16"}  # fp32 has its own (exact) bound
    short, long = data["precisions"]["bf16"]["bins"]
    assert short["prompt_tokens"] == [20, 129] and short["worst"] == pytest.approx(0.0229)
    assert short["soft"] == pytest.approx(1.5 * 0.0229, abs=1e-4) and long["soft"] == pytest.approx(0.03)
    env = parse_envelope(data)
    assert env.soft_bound("bfloat16", 50) == pytest.approx(short["soft"])  # declared names are normalised
    assert env.soft_bound("bf16", 513) == pytest.approx(0.03)
    assert env.soft_bound("bf16", 300) == pytest.approx(max(short["soft"], 0.03))  # between bins: the larger
    assert env.soft_bound("bf16", 514) is None  # longer than anything measured: not tightened
    assert env.soft_bound("bf16", 5) is None
    assert env.soft_bound("fp16", 50) is None and env.soft_bound("fp8", 40) is None  # not (or too little) measured
    path = tmp_path / "env.json"
    path.write_text(json.dumps(data))
    config = ScoringConfig.local_testnet(logprob_gap_envelope=str(path))
    assert logprob_gap_bound(config, "bf16", 50)[0] == pytest.approx(short["soft"])
    assert logprob_gap_bound(config, "fp8", 40)[0] == config.logprob_gap_soft
    (tmp_path / "bad.json").write_text('{"format": "k3-model-envelope", "version": 1, "precisions": {"bf16": {}}}')
    for bad, says in ((tmp_path / "missing.json", "cannot read"), (tmp_path / "bad.json", "malformed")):
        with pytest.raises(ScoringConfigError, match=says):
            ScoringConfig.local_testnet(logprob_gap_envelope=str(bad))


def test_shipped_envelope_is_the_trained_models():
    env = load_envelope(ENVELOPE)
    assert env.fingerprint and set(env.bins) >= {"bf16", "fp16", "fp8"}
    assert all(b.audits >= 100 for b in env.bins["bf16"])
    assert 0.02 < env.soft_bound("bf16", 60) < 0.2  # far under the wide 0.75


@pytest.fixture(scope="module")
def measured():
    config = ScoringConfig.local_testnet(logprob_gap_envelope=ENVELOPE)
    common = dict(audits_per_variant=30, max_tokens=24, prompt_lengths=(16, 128), long_length=512, sharded=False,
                  seed=11, config=config)  # seed 11: prompts the envelope was not measured on
    cheats = {**common, "audits_per_variant": 60}  # cheaters run 30% of the audits: 18 each
    runs = [("", measure_envelope(TRAINED_TINY, long_share=0.0, only=["bf16"], **common)),
            ("", measure_envelope(TRAINED_TINY, long_share=0.0, only=["cheat-bf16-half-experts"], **cheats)),
            (":long", measure_envelope(TRAINED_TINY, long_share=1.0, only=["bf16"], **common)),
            (":long", measure_envelope(TRAINED_TINY, long_share=1.0, only=["cheat-bf16-truncated-context"], **cheats))]
    return {r.variant.name + suffix: r for suffix, rep in runs for r in rep.results}


def test_honest_bf16_passes_and_bf16_cheats_fail_under_the_measured_envelope(measured):
    wide = ScoringConfig.local_testnet()
    for name in ("bf16", "bf16:long"):
        r = measured[name]
        assert len(r.answers) == 30 and not any(r.new_failures), (name, r.new_failures)
    half, truncated = measured["cheat-bf16-half-experts"], measured["cheat-bf16-truncated-context:long"]
    for r in (half, truncated):  # each fails at least the audit failure rate that zeroes a miner (15%)
        least = ScoringConfig.local_testnet().audit_failure_rate
        checks = {f.check for fs in r.new_failures for f in fs}
        # (on the retrained model a truncated context also moves sampled choices: some fail the surprisal test)
        gap_failed = sum(any(f.check == "logprob_gap" for f in fs) for fs in r.new_failures) / len(r.new_failures)
        assert gap_failed >= least and checks <= {"logprob_gap", "surprisal"}, (r.variant.name, checks, gap_failed)
        assert not any(f.hard for fs in r.new_failures for f in fs)  # soft: rounding-sized gaps never zero for 24 h
        # the wide bound lets their logprobs through: the measured envelope is what catches them by the gap
        assert not any(f.check == "logprob_gap" for st, a in zip(r.statistics, r.answers)
                       for f in judge_statistics(st, wide, True, False, "bf16", len(a.prompt)))


def _result(prompt: list[int], answer: Answer, temperature: float) -> GenerateResult:
    request = GenerateRequest(request_id="r" * 16, prompt_token_ids=prompt, max_tokens=len(answer.tokens),
                              temperature=temperature, logprobs=1)
    events = [TimedEvent(TokenMessage(index=i, token_ids=[t], text="", logprobs=[min(lp, 0.0)], top_logprobs=[[]]), 0.0)
              for i, (t, lp) in enumerate(zip(answer.tokens, answer.logprobs))]
    return GenerateResult(request=request, body=b"", started_at=0.0, events=events)


def test_audit_tier1_judges_a_declared_bf16_miner_by_the_envelope():
    """The validator's path: audit_tier1 on a LocalEngine over the fp32 checkpoint, with declared_precision."""
    import dataclasses  # noqa: PLC0415
    torch.set_num_threads(1)
    reference = load_model(TRAINED_TINY)
    tokenizer = load_tokenizer(TRAINED_TINY, reference.config)
    honest = load_model(TRAINED_TINY, torch.bfloat16)
    half = load_model(TRAINED_TINY, torch.bfloat16, config=dataclasses.replace(
        reference.config, experts_per_token=max(1, reference.config.experts_per_token // 2)))
    rng = random.Random(3)
    from scoring.corpus import paragraphs  # noqa: PLC0415
    prompts = [tokenizer.encode("\n".join(paragraphs(rng, 96))[:rng.randint(40, 120)], add_bos=True) for _ in range(8)]
    temps = [0.0 if i % 3 == 0 else 0.8 for i in range(len(prompts))]
    stop = frozenset(tokenizer.stop_ids)
    config = ScoringConfig.local_testnet(logprob_gap_envelope=ENVELOPE)

    async def audits(model, precision):
        answers = generate(model, prompts, temps, 24, list(range(len(prompts))), stop)
        engine = LocalEngine(reference, tokenizer, EngineSettings(max_context=4096, step_token_budget=1024))
        async with engine:
            return [await audit_tier1(p, _result(p, a, t), engine, config, stop_ids=stop, rng=random.Random(0),
                                      declared_precision=precision) for p, a, t in zip(prompts, answers, temps)]

    honest_audits = asyncio.run(audits(honest, "bfloat16"))
    cheat_audits = asyncio.run(audits(half, "bfloat16"))
    assert all(a.passed is True for a in honest_audits), [a.failures for a in honest_audits]
    failed = [a for a in cheat_audits if a.passed is False]
    assert len(failed) >= 2 and all({f.check for f in a.failures} == {"logprob_gap"} for a in failed)
    assert all("envelope measured for this model in bf16" in a.failures[0].reason for a in failed)
    # declared fp32, the same honest-bf16 answers fail the exact envelope (what a miner must declare matters)
    wrong_claim = asyncio.run(audits(honest, "fp32"))
    assert any(a.passed is False for a in wrong_claim)
