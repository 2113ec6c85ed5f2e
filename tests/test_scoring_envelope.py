"""The tier-1 rules calibrated on the honest-numerics envelope (scoring/tier1.py audit_statistics,
judge_statistics; scoring/envelope.py): honest numerics pass, other models fail, hard only with
evidence far outside the envelope on a trusted reference; and a small real envelope measurement."""
import math
import random

import pytest
import torch

from inference.model import ModelConfig, load_tokenizer, make_random_checkpoint
from scoring.config import ScoringConfig
from scoring.envelope import (generate, gpu_kernel_emulation, legacy_failures, load_model, measure_envelope,
                              reference_scores, rejudge)
from scoring.tier1 import audit_statistics, judge_statistics

CONFIG = ScoringConfig.local_testnet()
STOP = frozenset({257})


class S:  # a reference score row
    def __init__(self, position, token_id, logprob, top):
        self.position, self.token_id, self.logprob, self.top = position, token_id, logprob, top


def distribution(rng, n=20, sharp=1.0):
    logits = [rng.gauss(0, sharp) for _ in range(n)]
    norm = math.log(sum(math.exp(x) for x in logits) + 0.05)  # a little mass beyond the top-20
    pairs = sorted(((i, x - norm) for i, x in enumerate(logits)), key=lambda p: -p[1])
    return pairs


def sample(rng, pairs, temperature):
    if temperature == 0:
        return pairs[0][0]
    weights = [math.exp(lp / temperature) for _, lp in pairs]
    return rng.choices([t for t, _ in pairs], weights=weights)[0]


def answer(rng, n, temperature, *, noise=0.0, other=False, sharp=2.0):
    """(tokens, miner logprobs, reference scores): the miner samples from the reference's distribution
    (its logprobs off by `noise`, like other numerics), or from an unrelated one (`other`)."""
    tokens, lps, scores = [], [], []
    for j in range(n):
        ref = distribution(rng, sharp=sharp)
        mine = distribution(rng, sharp=sharp) if other else ref
        token = sample(rng, mine, temperature)
        ref_lp = dict(ref)[token]
        miner_lp = dict(mine)[token] + (rng.gauss(0, noise) if noise else 0.0)
        tokens.append(token + 1000 if token == 257 else token)
        lps.append(miner_lp)
        scores.append(S(j, token, ref_lp, ref))
    return tokens, lps, scores


@pytest.mark.parametrize("temperature", [0.0, 0.5, 1.0])
def test_honest_numerics_never_fail(temperature):
    rng = random.Random(1)
    failed = 0
    for _ in range(300):
        tokens, lps, scores = answer(rng, 32, temperature, noise=0.05)
        stats = audit_statistics(tokens, lps, temperature, scores, STOP, CONFIG, sample=list(range(16)))
        failed += bool(judge_statistics(stats, CONFIG, trusted=True))
    assert failed <= 3  # the stated error rates are far under 1%; 300 draws allow a stray one


@pytest.mark.parametrize("temperature", [0.0, 0.7])
def test_another_model_fails_hard_on_a_trusted_reference_only(temperature):
    rng = random.Random(2)
    tokens, lps, scores = answer(rng, 32, temperature, other=True)
    stats = audit_statistics(tokens, lps, temperature, scores, STOP, CONFIG)
    trusted = judge_statistics(stats, CONFIG, trusted=True)
    assert any(f.hard for f in trusted), trusted
    untrusted = judge_statistics(stats, CONFIG, trusted=False)
    assert untrusted and not any(f.hard for f in untrusted)


def test_relabelled_logprobs_are_caught_by_the_token_choices():
    """Tokens from another model, logprobs copied from the reference: the logprob test sees nothing,
    the surprisal test (sampled) and the greedy gaps do."""
    rng = random.Random(3)
    for temperature in (0.0, 1.0):
        tokens, _, scores = answer(rng, 48, temperature, other=True)
        lps = [s.logprob for s in scores]
        stats = audit_statistics(tokens, lps, temperature, scores, STOP, CONFIG)
        checks = {f.check for f in judge_statistics(stats, CONFIG, trusted=True)}
        assert "logprob_gap" not in checks and checks & {"surprisal", "greedy_mismatch", "outside_top_k"}


def test_eos_avoidance_is_judged_on_the_whole_answer():
    """An honest sampler passes a likely EOS now and then (the old rule failed that); a miner that
    never stops where an honest one almost surely would, fails."""
    def row(j, eos_lp, token_lp):
        top = sorted([(257, eos_lp), (5, token_lp)] + [(10 + i, -9.0) for i in range(18)], key=lambda p: -p[1])
        return S(j, 5, token_lp, top)

    one = [row(0, math.log(0.9), math.log(0.008))] + [row(j, -8.0, math.log(0.9)) for j in range(1, 20)]
    stats = audit_statistics([5] * 20, [s.logprob for s in one], 1.0, one, STOP, CONFIG)
    assert legacy_failures(stats, CONFIG)  # p(eos)/p(chosen) > 100 once: the old rule failed it
    assert judge_statistics(stats, CONFIG, trusted=True) == []
    many = [row(j, math.log(0.9), math.log(0.05)) for j in range(20)]
    stats = audit_statistics([5] * 20, [s.logprob for s in many], 1.0, many, STOP, CONFIG)
    failures = judge_statistics(stats, CONFIG, trusted=True)
    assert "eos_avoided" in {f.check for f in failures} and any(f.hard for f in failures)


def test_a_bf16_flip_at_a_near_tie_is_not_a_mismatch():
    rng = random.Random(4)
    tokens, lps, scores = answer(rng, 32, 0.0)
    for j in (3, 9, 15, 21, 27):  # five flips to the runner-up, 0.4 nats behind
        top = scores[j].top
        top[1] = (top[1][0], top[0][1] - 0.4)
        tokens[j] = top[1][0]
        scores[j] = S(j, tokens[j], top[1][1], top)
        lps[j] = top[1][1] + 0.05
    stats = audit_statistics(tokens, lps, 0.0, scores, STOP, CONFIG)
    assert legacy_failures(stats, CONFIG)  # the old rule: 5 > 3 flips beyond 0.1, hard
    assert judge_statistics(stats, CONFIG, trusted=True) == []


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("env") / "tiny"
    make_random_checkpoint(ModelConfig.tiny(), path, seed=0, progress=False)
    return path


def test_gpu_kernel_emulation_changes_rounding_only(checkpoint):
    torch.set_num_threads(1)
    model = load_model(checkpoint)
    ids = [torch.arange(40) % 250]
    plain = model.forward(ids, [model.new_cache()])[0]
    with gpu_kernel_emulation():
        other = model.forward(ids, [model.new_cache()])[0]
    diff = (plain - other).abs().max().item()
    assert 0 < diff < 1e-3  # another summation order: not bit-equal, but the same model


def test_a_small_envelope_separates_honest_bf16_from_another_model(checkpoint):
    report = measure_envelope(checkpoint, audits_per_variant=6, max_tokens=16, prompt_lengths=(16, 64),
                              long_share=0.0, sharded=False, only=["fp32-batched", "bf16", "cheat-other-weights"])
    by_name = {r.variant.name: r for r in report.results}
    assert len(by_name["bf16"].answers) == 6
    for name in ("fp32-batched", "bf16"):
        assert by_name[name].rate("new_failures") == 0.0, by_name[name].new_failures
    assert by_name["cheat-other-weights"].rate("new_failures", hard=True) == 1.0
    # the reference scores the fp32 miner's own answers: bit-equal logprobs
    assert max(s.logprob_gap_mean for s in by_name["fp32-batched"].statistics) < 1e-4
    rejudge(report, CONFIG.replace(logprob_gap_soft=1e-9, logprob_gap_hard=1e-8))
    assert report.results[1].rate("new_failures", hard=True) == 1.0  # the test can fail


def test_the_envelope_replays_sampled_answers_and_writes_the_replay_section(checkpoint):
    """Every sampled answer is replayed from the reference's logits: the fp32 miner's tokens are the replayed ones,
    a greedy miner's and a fixed-seed miner's are not; the honest variants give the replay section (the near-tie
    allowance and the honest rate per precision), which judges the cheaters."""
    from scoring.envelope import replay_section
    report = measure_envelope(checkpoint, audits_per_variant=8, max_tokens=16, prompt_lengths=(16, 64),
                              long_share=0.0, sharded=False, greedy_share=0.0, temperatures=(0.5, 1.0),
                              only=["fp32-batched", "bf16", "cheat-greedy-for-sampled", "cheat-fixed-seed"])
    by_name = {r.variant.name: r for r in report.results}
    assert all(rp is not None for rp in by_name["fp32-batched"].replays)  # every answer sampled, every one replayed
    assert sum(rp.mismatches for rp in by_name["fp32-batched"].replays) == 0
    for cheat in ("cheat-greedy-for-sampled", "cheat-fixed-seed"):
        assert sum(rp.mismatches for rp in by_name[cheat].replays) >= 4, cheat
    section = replay_section(report)
    assert set(section["precisions"]) == {"fp32", "bf16"}  # the honest variants only
    fp32 = section["precisions"]["fp32"]
    assert fp32["positions"] == sum(rp.positions for rp in by_name["fp32-batched"].replays)
    assert fp32["mismatches"] == 0 and fp32["delta"] == 1e-3 and fp32["beyond_delta"] == 0


def test_a_sharded_variant_runs_its_shard_processes_once_for_all_its_audits(checkpoint, monkeypatch):
    """The expert-parallel variant: 2 gloo shard processes started once for the variant's 20 audits (two
    generation batches), its fp32 answers scored by the single-process reference within fp32's envelope."""
    from inference.sharding import ShardedModel  # noqa: PLC0415
    starts = []
    original = ShardedModel.__init__

    def counting_init(self, *args, **kwargs):
        starts.append(kwargs.get("mode"))
        original(self, *args, **kwargs)

    monkeypatch.setattr(ShardedModel, "__init__", counting_init)
    report = measure_envelope(checkpoint, audits_per_variant=20, max_tokens=8, prompt_lengths=(16, 48),
                              long_share=0.0, only=["sharded-expert"])
    (result,) = report.results
    assert starts == ["expert"] and len(result.answers) == 20
    assert result.rate("new_failures") == 0.0, result.new_failures
    assert max(s.logprob_gap_mean for s in result.statistics) < CONFIG.logprob_gap_soft_exact


def test_the_declared_precision_picks_the_envelope():
    """A miner that declares fp32 is held to fp32's envelope (soft only); bf16 gets the wide one."""
    rng = random.Random(3)
    tokens, lps, scores = answer(rng, 32, 0.0, noise=0.05)  # 0.05 nats off: no fp32 kernel does that
    stats = audit_statistics(tokens, lps, 0.0, scores, STOP, CONFIG, [])
    assert CONFIG.logprob_gap_soft_exact < stats.logprob_gap_mean < CONFIG.logprob_gap_soft
    assert judge_statistics(stats, CONFIG, trusted=True) == []
    declared = judge_statistics(stats, CONFIG, trusted=True, exact=True)
    assert [(f.check, f.hard) for f in declared] == [("logprob_gap", False)] and "declares fp32" in declared[0].reason
    exact_tokens, exact_lps, exact_scores = answer(rng, 32, 0.0)
    exact = audit_statistics(exact_tokens, exact_lps, 0.0, exact_scores, STOP, CONFIG, [])
    assert judge_statistics(exact, CONFIG, trusted=True, exact=True) == []


def test_self_check_prints_the_false_positive_rate():
    """`validator.py self-check`: this validator's rules on honest bf16 answers of the trained tiny model."""
    import subprocess  # noqa: PLC0415
    import sys  # noqa: PLC0415
    from pathlib import Path  # noqa: PLC0415
    root = Path(__file__).resolve().parent.parent
    out = subprocess.run([sys.executable, "neurons/validator.py", "self-check", "--checkpoint",
                          "inference/model/assets/tiny_trained", "--dtype", "bfloat16", "--audits", "4"],
                         cwd=root, capture_output=True, text=True, timeout=300, env={"OMP_NUM_THREADS": "1",
                                                                                      "PATH": "/usr/bin:/bin"})
    assert out.returncode == 0, out.stdout + out.stderr
    assert "8 honest bfloat16 audits against the fp32 reference: 0 hard and 0 soft failures" in out.stdout
    missing = subprocess.run([sys.executable, "neurons/validator.py", "self-check", "--checkpoint", "/nonexistent"],
                             cwd=root, capture_output=True, text=True, timeout=120)
    assert missing.returncode == 2 and "checkpoint" in missing.stderr
