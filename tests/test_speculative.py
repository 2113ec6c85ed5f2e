"""Speculative decoding: drafters, the acceptance rule, and the speculative loop against plain decoding
(token for token, greedy and sampled, under the protocol's sampler k3-gumbel/1)."""
import random

import pytest
import torch

from inference.decoding.acceptance import accept_drafts
from inference.decoding.drafters import Draft, Drafter, NgramDrafter, ReplayDrafter, SuffixDrafter, make_drafter
from inference.decoding.sampling import SamplingParams, TokenSampler, gumbel_choice
from inference.decoding.speculation import DraftLength, SequenceSpeculation, SpeculationConfig, speculative_generate
from inference.model.config import ModelConfig
from inference.model.k3 import KimiK3Model

_models: dict = {}


def model_for() -> KimiK3Model:
    if "tiny" not in _models:
        _models["tiny"] = KimiK3Model(ModelConfig.tiny(), seed=3)
    return _models["tiny"]


# ----------------------------------------------------------------------------------- drafters
def brute_force_longest_earlier_suffix(h: list[int]) -> int:
    L = len(h)
    for m in range(L - 1, 0, -1):
        suffix = h[L - m:]
        if any(h[s:s + m] == suffix for s in range(0, L - m)):
            return m
    return 0


def test_suffix_automaton_finds_the_longest_earlier_suffix_incrementally():
    rng = random.Random(0)
    for trial in range(20):
        drafter = SuffixDrafter(min_match=1)
        h: list[int] = []
        for step in range(60):
            h.extend(rng.choice([0, 1, 2]) for _ in range(rng.randint(1, 3)))  # a few tokens per call
            draft = drafter.propose(h, 4)
            m = brute_force_longest_earlier_suffix(h)
            assert drafter.match_length == m, (trial, step)
            if m:  # the proposal continues an earlier occurrence of that suffix
                ext = h + draft.tokens
                starts = [s for s in range(len(h) - m) if h[s:s + m] == h[len(h) - m:]]
                assert any(ext[s + m: s + m + 4] == draft.tokens for s in starts)
            else:
                assert draft.tokens == []


def test_ngram_drafter_prefers_long_recent_matches_and_loops_past_the_end():
    d = NgramDrafter(min_n=2, max_n=4)
    h = [5, 6, 1, 2, 3, 9, 9, 1, 2, 3, 4, 7, 1, 2, 3]
    # "1 2 3" occurred twice before; the most recent one was followed by 4 7
    assert d.propose(h, 3).tokens == [4, 7, 1]
    assert d.propose(h + [8, 8], 3).tokens == []  # "3 8 8" / "8 8": never seen before
    # a loop: "7 8 9 7 8" matches at distance 3, so the copy goes on periodically past the end
    assert NgramDrafter().propose([7, 8, 9, 7, 8], 6).tokens == [9, 7, 8, 9, 7, 8]
    assert SuffixDrafter().propose([7, 8, 9, 7, 8, 9, 7], 4).tokens == [8, 9, 7, 8]


def test_drafter_errors_and_factory():
    assert make_drafter("none") is None
    assert isinstance(make_drafter("ngram"), NgramDrafter) and isinstance(make_drafter("suffix"), SuffixDrafter)
    with pytest.raises(ValueError, match="ngram, suffix"):
        make_drafter("medusa")
    with pytest.raises(ValueError, match="min_n"):
        NgramDrafter(min_n=3, max_n=2)
    d = SuffixDrafter()
    d.propose([1, 2, 3, 4], 2)
    with pytest.raises(ValueError, match="append-only"):
        d.propose([1, 2], 2)


# ------------------------------------------------------------------------------- acceptance rule
def test_greedy_acceptance_stops_at_the_first_mismatch():
    logits = torch.full((4, 6), -5.0)
    for row, best in enumerate([2, 4, 1, 5]):
        logits[row, best] = 5.0
    greedy = TokenSampler(SamplingParams(max_tokens=8))
    v = accept_drafts([2, 4, 1], logits, greedy, 0)
    assert v.accepted == 3 and [t.token_id for t in v.tokens] == [2, 4, 1, 5]  # all accepted, plus the bonus
    v = accept_drafts([2, 3, 1], logits, greedy, 0)
    assert v.accepted == 1 and [t.token_id for t in v.tokens] == [2, 4]  # correction replaces the mismatch
    v = accept_drafts([], logits[:1], greedy, 0)
    assert v.accepted == 0 and [t.token_id for t in v.tokens] == [2]
    assert v.tokens[0].logprob == pytest.approx(float(torch.log_softmax(logits[0], -1)[2]))
    with pytest.raises(ValueError, match="3 drafts need 4 rows"):
        accept_drafts([1, 2, 3], logits[:3], greedy, 0)


@pytest.mark.parametrize("params", [SamplingParams(temperature=1.0, seed=5),
                                    SamplingParams(temperature=0.7, top_k=4, seed=6),
                                    SamplingParams(temperature=1.3, top_p=0.8, seed=7)])
def test_sampled_acceptance_keeps_exactly_the_tokens_plain_sampling_draws(params):
    """A sampled draft is accepted exactly when it is the k3-gumbel/1 draw at its index, and every emitted
    token is that draw: the verify step emits what plain sampling with the same seed would."""
    V, k = 8, 3
    logits = torch.randn(k + 1, V, generator=torch.Generator().manual_seed(0)) * 1.5
    sampler = TokenSampler(params)
    for first in (0, 11):
        plain = [gumbel_choice(logits[i], params, params.seed, first + i) for i in range(k + 1)]
        assert accept_drafts(plain[:k], logits, sampler, first).accepted == k  # the right guesses: all kept
        for wrong_at in range(k):
            drafts = list(plain[:k])
            drafts[wrong_at] = (drafts[wrong_at] + 1) % V
            v = accept_drafts(drafts, logits, sampler, first)
            assert v.accepted == wrong_at
            assert [t.token_id for t in v.tokens] == plain[:wrong_at + 1]  # the correction is plain's token


# ----------------------------------------------------------------------- the loop against plain
class WrongDrafter(Drafter):
    """Always proposes tokens the greedy model will not choose (accepts nothing)."""

    def __init__(self, plain: list[int], prompt_len: int):
        self.plain, self.prompt_len = plain, prompt_len

    def propose(self, history, k):
        i = len(history) - self.prompt_len
        return Draft([(self.plain[j] + 1) % 256 for j in range(i, min(i + k, len(self.plain)))])


PROMPTS = {
    "repetitive": list(b"the cat sat on the mat. the cat sat on the mat. the cat sat on the"),
    "code": list(b"def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\ndef mul(a, b):\n"),
    "novel": list(b"Quiet lynx wove bright jumpers"),
}


def test_greedy_speculative_equals_greedy_plain_token_for_token():
    model = model_for()
    greedy = SamplingParams(max_tokens=16)
    for name, prompt in PROMPTS.items():
        plain, stats = speculative_generate(model, prompt, greedy, SpeculationConfig())
        assert stats["draft_proposed"] == 0 and len(plain) == 16
        for kind in ("ngram", "suffix"):  # always drafting 3 tokens when the drafter has a guess
            got, stats = speculative_generate(model, prompt, greedy,
                                              SpeculationConfig(drafter=kind, fixed_draft_tokens=3))
            assert got == plain, (name, kind)
        if name == "code":
            # drafts that are mostly right (one in 5 altered) accept a lot ...
            good = ReplayDrafter(len(prompt), plain, 256, wrong_every=5)
            got, stats = speculative_generate(model, prompt, greedy, SpeculationConfig(fixed_draft_tokens=6),
                                              drafter=good)
            assert got == plain
            assert stats["draft_accepted"] >= 0.6 * stats["draft_proposed"] > 0
            assert stats["verify_steps"] <= 7  # 16 tokens in far fewer forwards
            # ... drafts that are always wrong accept nothing, and the output is still the same
            got, stats = speculative_generate(model, prompt, greedy, SpeculationConfig(fixed_draft_tokens=4),
                                              drafter=WrongDrafter(plain, len(prompt)))
            assert got == plain and stats["draft_accepted"] == 0 and stats["draft_proposed"] > 12


@pytest.mark.parametrize("mode", ["snapshot", "replay"])
def test_greedy_equality_with_adaptive_k_and_both_rewind_modes(mode):
    model = model_for()
    prompt = PROMPTS["code"]
    greedy = SamplingParams(max_tokens=20)
    plain, _ = speculative_generate(model, prompt, greedy, SpeculationConfig())
    good = ReplayDrafter(len(prompt), plain, 256, wrong_every=7)
    got, stats = speculative_generate(model, prompt, greedy, SpeculationConfig(rewind_mode=mode), drafter=good)
    assert got == plain and stats["draft_accepted"] > 0


def test_sampled_speculative_equals_plain_sampling_token_for_token():
    """Under k3-gumbel/1 a sampled request's speculative output is plain sampling's with the same seed, whatever
    the drafter (copying, mostly right, always wrong), the draft length and the filter (temperature, top-k,
    top-p)."""
    model = model_for()
    compared = accepted = 0
    for seed, params in enumerate([dict(temperature=1.0), dict(temperature=0.7, top_k=5),
                                   dict(temperature=1.2, top_p=0.9)]):
        p = SamplingParams(max_tokens=16, ignore_eos=True, seed=seed, **params)
        for name, prompt in PROMPTS.items():
            plain, stats = speculative_generate(model, prompt, p, SpeculationConfig())
            assert stats["draft_proposed"] == 0 and len(plain) == 16
            runs = [(SpeculationConfig(drafter=kind, fixed_draft_tokens=3), None) for kind in ("ngram", "suffix")]
            runs += [(SpeculationConfig(fixed_draft_tokens=4), ReplayDrafter(len(prompt), plain, 256, wrong_every=5)),
                     (SpeculationConfig(fixed_draft_tokens=2), WrongDrafter(plain, len(prompt)))]
            for config, drafter in runs:
                got, stats = speculative_generate(model, prompt, p, config, drafter=drafter)
                assert got == plain, (seed, name, config.drafter, type(drafter).__name__)
                compared += 1
                accepted += stats["draft_accepted"]
    assert compared == 36 and accepted > 0  # drafts were judged both ways


def test_adaptive_k_drops_to_plain_on_poor_drafts_and_recovers():
    config = SpeculationConfig(drafter="suffix", max_draft_tokens=8, verify_cost=0.1)
    length = DraftLength(config)
    assert 1 <= length.best_k() <= 8
    for _ in range(10):
        length.observe_verdict(4, 0)  # every first draft rejected
    assert length.best_k() == 0
    for _ in range(20):
        length.observe_verdict(4, 4)  # every draft accepted
    assert length.best_k() == 8
    assert SpeculationConfig(drafter="x").problems() and SpeculationConfig(max_draft_tokens=0).problems()
    assert not SpeculationConfig(drafter="ngram").problems()


def test_adaptive_k_makes_novel_text_mostly_plain_steps():
    model = model_for()
    got, stats = speculative_generate(model, PROMPTS["novel"], SamplingParams(max_tokens=24),
                                      SpeculationConfig(drafter="ngram"))
    plain, _ = speculative_generate(model, PROMPTS["novel"], SamplingParams(max_tokens=24), SpeculationConfig())
    assert got == plain
    assert stats["plain_steps"] >= 15  # drafts of a random model on novel text are rarely right


class _FixedGuess(Drafter):
    """Always guesses `token` (k times)."""

    def __init__(self, token: int):
        self.token = token

    def propose(self, history, k):
        return Draft([self.token] * k)


def test_misses_pause_drafting_with_growing_pauses_and_right_guesses_resume_it():
    # verify_cost 0: the acceptance estimate alone never gives k = 0, so only the pauses stop drafting
    config = SpeculationConfig(drafter="ngram", miss_limit=2, pause_steps=3, max_pause_steps=6, verify_cost=0.0)
    spec = SequenceSpeculation(config, SamplingParams(), _FixedGuess(7))
    history = [1, 2, 3]

    def plain_steps_before_a_draft(chosen=8):
        n = 0
        while not spec.drafts(history, 8).tokens:
            spec.observe_plain(chosen)
            n += 1
            assert n < 100
        return n

    assert plain_steps_before_a_draft() == 0
    spec.record_verdict(2, 0)
    assert plain_steps_before_a_draft() == 0  # one miss: still drafting
    spec.record_verdict(2, 0)  # two in a row: a pause of 3 plain steps
    assert plain_steps_before_a_draft() == 3
    spec.record_verdict(1, 0)  # the probe fails: twice as long
    assert plain_steps_before_a_draft() == 6
    spec.record_verdict(1, 0)  # capped at max_pause_steps
    assert plain_steps_before_a_draft() == 6
    spec.record_verdict(1, 1)  # an accepted draft ends the misses and resets the pause length
    assert plain_steps_before_a_draft() == 0
    spec.record_verdict(2, 0)
    spec.record_verdict(2, 0)
    assert spec.paused == 3 and spec.pauses == 4
    assert not spec.drafts(history, 8).tokens
    spec.observe_plain(7)  # the drafter's free guess was right: the pause ends at once
    assert spec.drafts(history, 8).tokens
    # fixed_draft_tokens (benchmarks, tests): no pauses
    fixed = SequenceSpeculation(SpeculationConfig(drafter="ngram", max_draft_tokens=4, fixed_draft_tokens=4),
                                SamplingParams(), _FixedGuess(7))
    for _ in range(5):
        assert len(fixed.drafts(history, 8).tokens) == 4
        fixed.record_verdict(4, 0)
    assert SpeculationConfig(pause_steps=0).problems() and SpeculationConfig(miss_limit=-1).problems()
    assert SpeculationConfig(pause_steps=8, max_pause_steps=4).problems()


def test_novel_text_pauses_after_two_wrong_drafts():
    """A drafter that is always wrong costs at most `miss_limit` verify steps per pause, and output is plain."""
    model = model_for()
    params = SamplingParams(max_tokens=24)
    plain, _ = speculative_generate(model, PROMPTS["novel"], params, SpeculationConfig())
    wrong = (plain[0] + 1) % ModelConfig.tiny().vocab_size
    got, stats = speculative_generate(model, PROMPTS["novel"], params, SpeculationConfig(), drafter=_FixedGuess(wrong))
    assert got == plain
    # 2 misses, a pause of 8 (its wrong free guesses bring the estimate to k = 0 meanwhile)
    assert stats["verify_steps"] <= 3 and stats["pauses"] >= 1
    _, slow = speculative_generate(model, PROMPTS["novel"], params, SpeculationConfig(miss_limit=0),
                                   drafter=_FixedGuess(wrong))
    assert slow["verify_steps"] > stats["verify_steps"] + 2  # the estimate alone takes longer to give up


def test_adaptive_k_uses_run_lengths_of_accepted_drafts():
    """Copied drafts come in runs: when half the steps' first drafts are rejected but an accepted first
    draft is followed by long accepted runs, k grows to the cap; when accepted runs stop after one token, it
    stays small. The independent-acceptance model would give both the same k."""
    config = SpeculationConfig(drafter="ngram", max_draft_tokens=8, verify_cost=0.1)
    runs, shorts = DraftLength(config), DraftLength(config)
    for _ in range(10):
        runs.observe_verdict(8, 0)
        runs.observe_verdict(8, 8)
        shorts.observe_verdict(2, 0)
        shorts.observe_verdict(2, 1)
    assert 0.4 < runs.acceptance < 0.6 and 0.4 < shorts.acceptance < 0.6
    assert runs.best_k() == 8
    assert 1 <= shorts.best_k() <= 2
    assert runs.expected_tokens(8) > 4.0 and shorts.expected_tokens(8) < 1.7
    # free guesses on plain steps move only the first-draft rate
    before = runs.run.value
    for _ in range(30):
        runs.observe_guess(False)
    assert runs.run.value == before and runs.best_k() == 0
    assert SpeculationConfig(prior_run=1.0).problems()


def test_copy_ceiling_counts_the_drafters_right_one_token_guesses():
    from benchmarks.speculative import copy_ceiling
    prompt = [1, 2, 3, 4, 5]
    # the output repeats the prompt: after [.., 5, 1] no 2-gram matches yet, then [1, 2] does: 5 of 6 right
    right, ceiling = copy_ceiling("ngram", prompt, [1, 2, 3, 4, 5, 1, 2])
    assert (right, ceiling) == (5, 6.0)
    right, ceiling = copy_ceiling("suffix", prompt, [9, 8, 7, 6])  # nothing to copy
    assert (right, ceiling) == (0, 1.0)


def test_verify_cost_table_times_a_forward_of_each_size():
    from benchmarks.speculative import verify_cost_table
    model = model_for()
    rows = verify_cost_table(model, PROMPTS["novel"], sizes=(1, 3), repeats=2)
    assert [r["positions"] for r in rows] == [1, 3]
    assert rows[0]["ratio"] == 1.0 and all(r["ms"] > 0 and r["ratio"] > 0 for r in rows)
