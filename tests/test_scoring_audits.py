"""The audit policy (scoring/audit_sequence.py, scoring/auditors.py) and the canary escalation: who audits,
when an audit is drawn, and what a disagreement escalates to."""
import random

from inference.model import ByteTokenizer, ModelConfig
from protocol.schemas import Capabilities, GenerateRequest, Limits
from scoring.audit_sequence import canary_escalation, draw_audit
from scoring.auditors import AuditorCandidate, choose_auditors
from scoring.canaries import Canary, CanaryPool
from scoring.config import ScoringConfig
from scoring.failures import Failure
from scoring.workloads import WorkItem, canary_prompts

MODEL = ModelConfig.tiny()


def candidate(uid, coldkey, score, max_context=None, max_score_tokens=None):
    return AuditorCandidate(uid=uid, hotkey=f"hk{uid}", coldkey=coldkey, url=f"http://127.0.0.1:{9000 + uid}",
                            score=score, max_context=max_context, max_score_tokens=max_score_tokens)


def test_auditors_are_drawn_at_random_among_eligible_miners_on_other_coldkeys():
    pool = [candidate(1, "audited", 0.9), candidate(2, "a", 0.8), candidate(3, "a", 0.7), candidate(4, "b", 0.5),
            candidate(5, "c", 0.4)]
    picks = [tuple(sorted(c.uid for c in choose_auditors(0, "audited", pool, need_tokens=100, rng=random.Random(seed))))
             for seed in range(60)]
    for pick in picks:  # never the audited coldkey, one per coldkey
        assert 1 not in pick and len(pick) == 2 and not {2, 3} <= set(pick)
    # not the two best: every eligible miner audits sometimes, the weakest as well as the best
    assert {uid for pick in picks for uid in pick} == {2, 3, 4, 5}
    assert any(pick == (4, 5) for pick in picks)
    # the audited miner itself never audits
    assert 0 not in [c.uid for c in choose_auditors(0, "z", [candidate(0, "z2", 1.0)] + pool, 100, random.Random(0))]


def test_auditors_too_small_or_unscored_are_left_out():
    pool = [candidate(1, "a", 0.9, max_context=64, max_score_tokens=64), candidate(2, "b", 0.8),
            candidate(3, "c", 0.6), candidate(4, "d", 0.0)]
    assert sorted(c.uid for c in choose_auditors(0, "x", pool, 100, random.Random(0))) == [2, 3]
    # with fewer than two scored candidates the unscored ones may audit
    pool = [candidate(2, "b", 0.8), candidate(4, "d", 0.0)]
    assert sorted(c.uid for c in choose_auditors(0, "x", pool, 100, random.Random(0))) == [2, 4]
    # fewer than two possible auditors: none
    assert choose_auditors(0, "x", [candidate(2, "b", 0.8), candidate(3, "b", 0.7)], 100, random.Random(0)) == []


def test_ties_are_broken_at_random_but_seeded():
    pool = [candidate(uid, f"c{uid}", 0.5) for uid in range(1, 9)]
    picks = {tuple(c.uid for c in choose_auditors(0, "x", pool, 10, random.Random(seed))) for seed in range(20)}
    assert len(picks) > 1
    assert choose_auditors(0, "x", pool, 10, random.Random(3)) == choose_auditors(0, "x", pool, 10, random.Random(3))


def test_an_audit_is_drawn_at_its_rate_and_never_after_a_hard_tier0_failure():
    config = ScoringConfig(audit_rate=0.25, audit_rate_new_or_suspect=1.0)
    item = WorkItem("chat", GenerateRequest(request_id="r", prompt_token_ids=[1, 2], max_tokens=4), (1, 2))
    rng = random.Random(1)
    drawn = sum(draw_audit(rng, item, [], config, new_or_suspect=False) for _ in range(4000))
    assert 800 < drawn < 1200
    assert all(draw_audit(rng, item, [Failure("x", "soft")], config, new_or_suspect=True) for _ in range(50))
    hard = [Failure("usage_completion", "inflated", hard=True)]
    assert not any(draw_audit(rng, item, hard, config, new_or_suspect=True) for _ in range(50))
    # the draw is made either way: the random stream does not depend on tier 0
    a, b = random.Random(5), random.Random(5)
    draw_audit(a, item, hard, config, new_or_suspect=False)
    draw_audit(b, item, [], config, new_or_suspect=False)
    assert a.random() == b.random()


def test_a_disagreement_escalates_to_a_fitting_canary_once():
    tokenizer = ByteTokenizer.from_config(MODEL)
    caps = Capabilities(model_id=MODEL.model_id, model_fingerprint="fp", vocab_size=MODEL.vocab_size,
                        max_context=2048, max_concurrent_streams=4, engine="reference", precision="fp32",
                        software_version="0.1.0", limits=Limits())
    config = ScoringConfig.local_testnet(chat_prompt_tokens=(16, 200), chat_max_tokens=(64, 128))
    assert canary_escalation(None, random.Random(0), caps, config, tokenizer) == (None, None)
    prompts = canary_prompts(random.Random(2), 2, caps, config, tokenizer)
    pool = CanaryPool(Canary(f"c{k}", tuple(p), (1,) * 64, (1.0,) * 64) for k, p in enumerate(prompts))
    rng = random.Random(4)
    taken = []
    for _ in range(2):
        canary, item = canary_escalation(pool, rng, caps, config, tokenizer)
        assert item.expect.canary == canary and item.prompt_ids == canary.prompt_ids
        assert item.request.temperature == 0.0
        taken.append(canary.canary_id)
    assert sorted(taken) == ["c0", "c1"]
    assert canary_escalation(pool, rng, caps, config, tokenizer) == (None, None)  # the pool is used up
