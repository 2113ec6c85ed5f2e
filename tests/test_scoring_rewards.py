"""Rewards: components, clipping, gates, coldkey dedup, EMA and S^2 weights, on small cases
computed by hand."""
import pytest

from scoring.config import ScoringConfig, ScoringConfigError
from scoring.metrics import Measurement, MeasurementWindow
from scoring.rewards import EmaEntry, score_miners, update_ema

CONFIG = ScoringConfig()
NOW = 1_000_000.0


class Rows:
    """Builds one miner's measurements."""

    def __init__(self, uid, hotkey):
        self.uid, self.hotkey, self.rows, self.k = uid, hotkey, [], 0

    def add(self, kind="chat", outcome="completed", at=None, **fields):
        self.k += 1
        fields.setdefault("tier0_ok", outcome == "completed")
        self.rows.append(Measurement(uid=self.uid, hotkey=self.hotkey, at=NOW - 60 if at is None else at, kind=kind,
                                     request_id=f"{self.uid}-{self.k}", outcome=outcome, **fields))
        return self

    def chats(self, n, decode, ttft, **fields):
        for _ in range(n):
            self.add(decode_tps=decode, ttft_per_1k_s=ttft, **fields)
        return self


def window_of(*miners):
    window = MeasurementWindow.for_config(CONFIG)
    for miner in miners:
        window.extend(miner.rows)
    return window


def test_components_scaled_to_the_best_and_clipped():
    a = Rows(1, "ha").chats(30, decode=100.0, ttft=0.2)
    b = Rows(2, "hb").chats(30, decode=50.0, ttft=0.4)
    a.add("burst_aggregate", burst_id="x", burst_tokens=1000, burst_wall_s=10.0)  # 100 tok/s
    b.add("burst_aggregate", burst_id="y", burst_tokens=150, burst_wall_s=5.0)
    b.add("burst_aggregate", burst_id="z", burst_tokens=50, burst_wall_s=5.0)  # pooled: 200 / 10 = 20 tok/s
    a.add("long_context", prompt_tokens=1000, long_context_success=True)
    a.add("long_context", prompt_tokens=3000, long_context_success=False)  # weighted share 0.25
    b.add("long_context", prompt_tokens=4000, long_context_success=True)
    scores = score_miners(window_of(a, b), CONFIG, NOW, {1: "ha", 2: "hb"}, {1: "ca", 2: "cb"})
    sa, sb = scores[1], scores[2]
    assert (sa.decode_tps, sa.ttft_per_1k_s, sa.burst_tps, sa.long_context_share) == (100.0, 0.2, 100.0, 0.25)
    assert (sb.decode_tps, sb.ttft_per_1k_s, sb.burst_tps, sb.long_context_share) == (50.0, 0.4, 20.0, 1.0)
    assert (sa.D, sa.F, sa.C, sa.L) == (1.0, 1.0, 1.0, 0.3)  # L 0.25 clipped up to 0.3
    assert (sb.D, sb.F, sb.C, sb.L) == (0.5, 0.5, 0.3, 1.0)  # C 0.2 clipped up to 0.3
    assert sa.perf == pytest.approx(0.30 + 0.20 + 0.30 + 0.20 * 0.3)
    assert sb.perf == pytest.approx(0.30 * 0.5 + 0.20 * 0.5 + 0.30 * 0.3 + 0.20)
    assert sa.gate == sb.gate == 1.0 and sa.reliability == sb.reliability == 1.0
    assert sa.score == pytest.approx(sa.perf) and sa.quality == 1.0  # no audits yet: quality 1


def test_percentiles_are_of_performance():
    # D is the 30th percentile of tokens/s; F, lower being better, the 70th percentile of the
    # seconds: both are the speed that 70% of the requests reach.
    miner = Rows(1, "h")
    for decode, ttft in zip((10, 20, 30, 40, 50), (5, 4, 3, 2, 1)):
        for _ in range(6):
            miner.add(decode_tps=float(decode), ttft_per_1k_s=float(ttft))
    score = score_miners(window_of(miner), CONFIG, NOW, {1: "h"}, {1: "c"})[1]
    # 30 values, six of each: sorted ranks 0..29, rank 0.3 * 29 = 8.7 -> between 20 (ranks 6-11): 20.
    assert score.decode_tps == pytest.approx(20.0)
    assert score.ttft_per_1k_s == pytest.approx(4.0)  # rank 0.7 * 29 = 20.3 -> 4 (ranks 18-23)


def test_reliability_quality_and_what_counts():
    miner = Rows(1, "h").chats(26, decode=10.0, ttft=1.0)
    miner.add(outcome="timeout").add(outcome="error").add(outcome="excused")  # 429 past capacity: not counted
    miner.add(tier0_ok=False, decode_tps=1000.0, ttft_per_1k_s=0.001)  # unverified: no speed, not answered
    miner.add(quality=1.0, audits=1).add(quality=0.5, audits=1)
    miner.add("burst", decode_tps=1.0, ttft_per_1k_s=100.0)  # burst streams feed C, not D or F
    score = score_miners(window_of(miner), CONFIG, NOW, {1: "h"}, {1: "c"})[1]
    assert score.requests == 26 + 2 + 1 + 2 + 1
    assert score.answered == 26 + 2 + 1
    assert score.reliability == pytest.approx(29 / 32)
    assert score.quality == pytest.approx(0.75)
    assert score.decode_tps == 10.0 and score.ttft_per_1k_s == 1.0
    assert score.score == pytest.approx(score.reliability * 0.75 * score.perf)


def test_gates():
    config = CONFIG
    clean = Rows(1, "h1").chats(30, 10.0, 1.0)
    hard = Rows(2, "h2").chats(30, 99.0, 0.1).add(hard_failure=True, failures="signature (hard): forged", at=NOW - 3600)
    old_hard = Rows(3, "h3").chats(30, 10.0, 1.0).add(hard_failure=True, at=NOW - 25 * 3600)
    failing = Rows(4, "h4").chats(30, 10.0, 1.0)
    for k in range(10):
        failing.add(audits=1, audit_failures=int(k < 2))  # 2 of 10 = 20% >= 15%
    passing = Rows(5, "h5").chats(30, 10.0, 1.0)
    for k in range(10):
        passing.add(audits=1, audit_failures=int(k < 1))  # 10%
    few_audits = Rows(6, "h6").chats(30, 10.0, 1.0)
    for k in range(9):
        few_audits.add(audits=1, audit_failures=1)  # 9 audits: below the minimum count
    newcomer = Rows(7, "h7").chats(24, 10.0, 1.0)
    window = MeasurementWindow(config.window_s, keep_s=2 * 24 * 3600.0)
    for miner in (clean, hard, old_hard, failing, passing, few_audits, newcomer):
        window.extend(miner.rows)
    hotkeys = {m.uid: m.hotkey for m in (clean, hard, old_hard, failing, passing, few_audits, newcomer)}
    scores = score_miners(window, config, NOW, hotkeys, {uid: f"c{uid}" for uid in hotkeys})
    assert scores[1].gate == 1.0 and not scores[1].zeroed
    assert scores[2].gate == 0.0 and scores[2].zeroed and scores[2].score == 0.0
    assert "hard failure" in scores[2].reasons[0] and "forged" in scores[2].reasons[0]
    assert scores[3].gate == 1.0  # its hard failure is more than 24 h old
    assert scores[4].gate == 0.0 and scores[4].zeroed and "failed 2 of 10 audits" in scores[4].reasons[0]
    assert scores[5].gate == 1.0
    assert scores[6].gate == 1.0
    # 24 requests, under the 25 a full EMA step needs: S is not capped, the EMA step shrinks
    assert scores[7].gate == 1.0 and not scores[7].zeroed and scores[7].evidence == 24 / 25
    assert "only 24 requests" in scores[7].reasons[0] and scores[1].evidence == 1.0
    # A zeroed cheater does not set the bar: uid 2's 99 tok/s is not the best used for D.
    assert scores[1].D == 1.0 and scores[1].F == 1.0


def test_one_hotkey_per_coldkey_keeps_the_best():
    a = Rows(1, "h1").chats(30, 100.0, 1.0)
    b = Rows(2, "h2").chats(30, 50.0, 1.0)
    c = Rows(3, "h3").chats(30, 50.0, 1.0)
    d = Rows(4, "h4").chats(30, 50.0, 1.0)
    coldkeys = {1: "shared", 2: "shared", 3: "tied", 4: "tied"}
    scores = score_miners(window_of(a, b, c, d), CONFIG, NOW, {1: "h1", 2: "h2", 3: "h3", 4: "h4"}, coldkeys)
    assert scores[1].score > 0 and scores[2].score == 0.0 and "keeps only its best uid (1)" in scores[2].reasons[-1]
    assert scores[3].score > 0 and scores[4].score == 0.0  # a tie keeps the lower uid
    assert not scores[2].zeroed  # not a punishment: its EMA decays rather than resets
    off = score_miners(window_of(a, b, c, d), CONFIG.replace(one_hotkey_per_coldkey=False), NOW,
                       {1: "h1", 2: "h2", 3: "h3", 4: "h4"}, coldkeys)
    assert off[2].score > 0


def test_measurements_of_a_previous_hotkey_do_not_count():
    old = Rows(1, "old").chats(30, 100.0, 0.1)
    new = Rows(1, "new").chats(3, 10.0, 1.0)
    score = score_miners(window_of(old, new), CONFIG, NOW, {1: "new"}, {1: "c"})[1]
    assert score.requests == 3 and score.decode_tps == 10.0
    nobody = score_miners(window_of(old), CONFIG, NOW, {1: "new"}, {1: "c"})[1]
    assert nobody.score == 0.0 and "no requests in the window" in nobody.reasons
    stale = Rows(1, "h").chats(30, 10.0, 1.0)
    for i, m in enumerate(stale.rows):
        stale.rows[i] = Measurement(**{**m.__dict__, "at": NOW - 25 * 3600})
    assert score_miners(window_of(stale), CONFIG, NOW, {1: "h"}, {1: "c"})[1].requests == 0


def test_ema_resets_on_hotkey_change_and_zeroing():
    a = Rows(1, "h1").chats(30, 100.0, 1.0)
    scores = score_miners(window_of(a), CONFIG, NOW, {1: "h1"}, {1: "c1"})
    s = scores[1].score
    ema = update_ema({}, scores, 0.2)
    assert ema == {1: EmaEntry("h1", pytest.approx(0.2 * s))}
    ema = update_ema(ema, scores, 0.2)
    assert ema[1].value == pytest.approx(0.2 * s + 0.8 * 0.2 * s)
    # The uid changes hands: the new hotkey starts from zero.
    reset = update_ema({1: ("someone-else", 0.9)}, scores, 0.2)
    assert reset[1].value == pytest.approx(0.2 * s)
    # A hard failure zeroes at once rather than decaying.
    cheat = Rows(1, "h1").chats(30, 100.0, 1.0).add(hard_failure=True)
    zeroed = update_ema({1: ("h1", 0.9), 5: ("gone", 0.5)},
                        score_miners(window_of(cheat), CONFIG, NOW, {1: "h1"}, {1: "c1"}), 0.2)
    assert zeroed == {1: EmaEntry("h1", 0.0)}  # and deregistered uid 5 is dropped
    with pytest.raises(ValueError):
        update_ema({}, scores, 0.0)


def test_missed_answer_probes_zero_a_miner_only_past_what_honest_misses_explain():
    from scoring.rewards import binomial_tail

    assert binomial_tail(5, 5, 0.1) == pytest.approx(1e-5)
    assert binomial_tail(10, 0, 0.3) == pytest.approx(1.0) and binomial_tail(20, 3, 0.1) == pytest.approx(0.3231, abs=1e-4)

    def miner(uid, answers):
        rows = Rows(uid, f"h{uid}").chats(30, 10.0, 1.0)
        for ok in answers:
            rows.add(kind="probe", probe_answer=ok)
        return rows

    never = miner(1, [False] * 5)  # another model: no probe answered
    honest = miner(2, [False, True, True, False] + [True] * 16)  # 2 of 20 missed: what a 90% model does
    unlucky_start = miner(3, [False, False, True])  # 2 of 3 missed: chance 0.028 for an honest miner
    careless = miner(4, [False] * 6 + [True] * 4)  # 6 of 10: chance 1.5e-4 ... over the line with 7
    careless.add(kind="probe", probe_answer=False)
    unscored = miner(5, [])
    for _ in range(5):
        unscored.add(kind="probe")  # probes of a kind not scored: no answer recorded
    window = window_of(never, honest, unlucky_start, careless, unscored)
    scores = score_miners(window, CONFIG, NOW, {u: f"h{u}" for u in range(1, 6)}, {u: f"c{u}" for u in range(1, 6)})
    assert scores[1].zeroed and "missed 5 of 5 answer probes" in scores[1].reasons[0], scores[1].reasons
    assert not scores[2].zeroed and not scores[3].zeroed and not scores[5].zeroed
    assert scores[4].zeroed and "missed 7 of 11" in scores[4].reasons[0]
    with pytest.raises(ScoringConfigError, match="probe_miss_rate"):
        ScoringConfig(probe_miss_rate=0.0)
