"""Per-request measurements, burst aggregates and the rolling window (persisted through SQLite)."""
import sqlite3

import pytest
from bittensor.sp_core import Keypair

from protocol.client import GenerateResult, MinerHTTPError, MinerTimeout, MinerUnreachable, TimedEvent
from protocol.schemas import FinalMessage, GenerateRequest, Timings, TokenMessage, Usage
from protocol.signature import sign_response
from scoring.audit_sequence import Verification
from scoring.canaries import Tier2Result
from scoring.config import ScoringConfig
from scoring.failures import Failure
from scoring.metrics import (COLUMNS, Measurement, MeasurementWindow, classify_error, decode_tokens_per_s,
                             measure_burst, measure_request, ttft_per_1k)
from scoring.tier1 import AuditResult
from scoring.workloads import Expectation, WorkItem

CONFIG = ScoringConfig.local_testnet()
KEY = Keypair.create_from_mnemonic(Keypair.generate_mnemonic())


def make_result(arrivals, per_event=None, prompt_len=1000, started_at=1000.0, final_at=None, max_tokens=None):
    """A finished generation whose token events arrive at `arrivals` (seconds after the call
    started), with `per_event[k]` tokens in event k (1 each by default)."""
    per_event = per_event or [1] * len(arrivals)
    n = sum(per_event)
    request = GenerateRequest(request_id="r", prompt_token_ids=list(range(1, prompt_len + 1)),
                              max_tokens=max_tokens or n, logprobs=0)
    events, index = [], 0
    for at, count in zip(arrivals, per_event):
        ids = [7] * count
        events.append(TimedEvent(TokenMessage(index=index, token_ids=ids, text="a" * count, logprobs=[-0.5] * count,
                                            top_logprobs=[[] for _ in ids]), at))
        index += count
    final = FinalMessage(finish_reason="length", usage=Usage(prompt_tokens=prompt_len, completion_tokens=n),
                       timings=Timings(queue_ms=0, ttft_ms=0, total_ms=0), model_fingerprint="fp",
                       signature=sign_response(KEY, b"body", [7] * n))
    events.append(TimedEvent(final, final_at if final_at is not None else arrivals[-1] + 0.01))
    return GenerateResult(request=request, body=b"body", started_at=started_at, events=events, final=final)


def item_for(result, kind="chat", expect=None, burst_id=None):
    return WorkItem(kind, result.request, tuple(result.request.prompt_token_ids), expect or Expectation(),
                    burst_id=burst_id)


def test_decode_speed_excludes_ttft_and_the_first_event():
    # First token at 0.5 s, then one token every 0.1 s: 20 tokens after the first in 2.0 s.
    result = make_result([0.5 + 0.1 * k for k in range(21)])
    assert result.ttft_s == 0.5
    assert decode_tokens_per_s(result, 16) == pytest.approx(10.0)
    # A first event carrying 3 tokens (speculative decoding) counts in TTFT, not in decode.
    chunked = make_result([0.5] + [0.5 + 0.1 * k for k in range(1, 19)], per_event=[3] + [1] * 18)
    assert decode_tokens_per_s(chunked, 16) == pytest.approx(18 / 1.8)
    assert decode_tokens_per_s(make_result([0.5, 0.6, 0.7]), 16) is None  # too short to measure
    assert decode_tokens_per_s(make_result([0.5] * 20), 16) is None  # no interval at all
    assert ttft_per_1k(0.5, 2000) == pytest.approx(0.25)
    assert ttft_per_1k(None, 2000) is None and ttft_per_1k(0.5, 0) is None


def test_measure_a_verified_chat_request():
    result = make_result([0.4 + 0.05 * k for k in range(41)], prompt_len=800)
    audit = AuditResult(passed=True, quality=0.8)
    m = measure_request(3, "hk", item_for(result), result, Verification(audit=audit), CONFIG)
    assert (m.uid, m.hotkey, m.kind, m.outcome) == (3, "hk", "chat", "completed")
    assert m.at == pytest.approx(1000.0 + result.total_s)
    assert m.tier0_ok and m.verified and not m.hard_failure
    assert (m.prompt_tokens, m.completion_tokens) == (800, 41)
    assert m.ttft_s == pytest.approx(0.4) and m.ttft_per_1k_s == pytest.approx(0.5)
    assert m.decode_tps == pytest.approx(20.0)
    assert (m.audits, m.audit_failures, m.quality) == (1, 0, 0.8)
    assert m.long_context_success is None


def test_failed_checks_make_a_request_unverified():
    result = make_result([0.1 * k for k in range(1, 20)])
    soft = Verification(tier0=[Failure("logprobs_missing", "3 tokens")])
    m = measure_request(1, "hk", item_for(result), result, soft, CONFIG)
    assert not m.tier0_ok and not m.answered and not m.hard_failure and "logprobs_missing" in m.failures
    failed_audit = Verification(audit=AuditResult(passed=False, quality=0.9, failures=[Failure("outside_top_k", "9")]))
    m = measure_request(1, "hk", item_for(result), result, failed_audit, CONFIG)
    assert m.answered and not m.verified and (m.audits, m.audit_failures, m.quality) == (1, 1, 0.0)
    no_verdict = Verification(audit=AuditResult(passed=None, disagreement=True))
    m = measure_request(1, "hk", item_for(result), result, no_verdict, CONFIG)
    assert (m.audits, m.audit_failures, m.quality) == (0, 0, None)
    canary = Verification(tier2=Tier2Result(passed=False, compared=3, mismatch_at=3,
                                            failures=[Failure("canary_mismatch", "token 3", hard=True)]))
    m = measure_request(1, "hk", item_for(result, "probe"), result, canary, CONFIG)
    assert m.hard_failure and (m.audits, m.audit_failures) == (1, 1)
    # Copy and planted-fact probe answers are recorded only where the model can answer them, apart from audits
    # (misses are judged by their rate, scoring.rewards)
    copy_probe = item_for(result, "probe", Expectation(probe="copy", copy_text="x"))
    wrong = Verification(answer=[Failure("copy", "missing")])
    unscored = measure_request(1, "hk", copy_probe, result, wrong, CONFIG)
    assert unscored.probe_answer is None and unscored.audits == 0 and unscored.verified
    scored = CONFIG.replace(probes_scored=("copy", "planted_fact"))
    missed = measure_request(1, "hk", copy_probe, result, wrong, scored)
    assert missed.probe_answer is False and (missed.audits, missed.audit_failures) == (0, 0) and not missed.verified
    right = measure_request(1, "hk", copy_probe, result, Verification(), scored)
    assert right.probe_answer is True and right.verified
    with pytest.raises(ValueError, match="Verification"):
        measure_request(1, "hk", item_for(result), result, None, CONFIG)


def test_long_context_success_needs_audit_budget_and_optionally_the_answer():
    prompt = 4000
    budget = CONFIG.long_context_budget_s(prompt)
    fast = make_result([1.0, 1.1, 1.2], prompt_len=prompt)
    slow = make_result([budget, budget + 0.1, budget + 0.2], prompt_len=prompt)
    expect = Expectation(answer="123456", subject="A B")
    item = item_for(fast, "long_context", expect)
    passed = AuditResult(passed=True, quality=1.0)
    wrong_answer = [Failure("planted_fact", "not found")]

    def success(result, verification, config=CONFIG):
        return measure_request(1, "hk", item, result, verification, config).long_context_success

    assert success(fast, Verification(audit=passed, answer=wrong_answer)) is True  # answers not scored on the tiny model
    assert success(fast, Verification(audit=passed, answer=wrong_answer), CONFIG.replace(planted_fact_scored=True)) is False
    assert success(fast, Verification(audit=passed), CONFIG.replace(planted_fact_scored=True)) is True
    assert success(slow, Verification(audit=passed)) is False
    assert success(fast, Verification(audit=AuditResult(passed=False))) is False
    assert success(fast, Verification(audit=AuditResult(passed=None, error="reference down"))) is None
    assert success(fast, Verification(tier0=[Failure("signature", "bad", hard=True)])) is False
    error = MinerTimeout("total", 60)
    assert measure_request(1, "hk", item, error, None, CONFIG, at=5.0).long_context_success is False


def test_errors_timeouts_and_excused_429s():
    assert classify_error(MinerTimeout("between_events", 10)) == "timeout"
    assert classify_error(MinerUnreachable("refused")) == "error"
    busy = MinerHTTPError(429, "over_capacity", "busy")
    assert classify_error(busy, in_flight=9, capacity=8) == "excused"
    assert classify_error(busy, in_flight=8, capacity=8) == "error"  # within its declared capacity
    assert classify_error(MinerHTTPError(503, "engine_unavailable", "down"), in_flight=9, capacity=8) == "error"
    partial = make_result([0.2, 0.3], started_at=50.0, final_at=0.9)
    error = MinerTimeout("total", 1.0)
    error.partial = partial
    item = item_for(partial)
    m = measure_request(2, "hk", item, error, None, CONFIG)
    assert m.outcome == "timeout" and m.at == pytest.approx(50.9) and not m.answered and "timeout" in m.failures
    excused = measure_request(2, "hk", item, busy, None, CONFIG, in_flight=9, capacity=8, at=7.0)
    assert excused.outcome == "excused" and excused.at == 7.0


def test_burst_aggregate_counts_verified_tokens_over_the_wall_time():
    ok = Verification()
    a = make_result([0.5 + 0.1 * k for k in range(20)], started_at=100.0)  # 20 tokens, final at 100 + 2.41
    b = make_result([0.6 + 0.1 * k for k in range(30)], started_at=100.2)  # 30 tokens, final at 100.2 + 3.51
    c = make_result([0.5 + 0.1 * k for k in range(10)], started_at=100.1)  # 10 tokens, fails tier 0
    error = MinerHTTPError(429, "over_capacity", "busy")
    error.partial = GenerateResult(request=a.request, body=b"", started_at=99.9)  # sent first, refused
    streams = [(item_for(a, "burst", burst_id="B"), a, ok), (item_for(b, "burst", burst_id="B"), b, ok),
               (item_for(c, "burst", burst_id="B"), c, Verification(tier0=[Failure("signature", "bad", True)])),
               (item_for(a, "burst", burst_id="B"), error, None)]
    m = measure_burst(4, "hk", streams, CONFIG)
    assert m.kind == "burst_aggregate" and m.burst_id == "B"
    assert m.burst_tokens == 50
    assert m.burst_wall_s == pytest.approx(100.2 + b.total_s - 99.9)
    assert m.at == pytest.approx(100.2 + b.total_s)
    with pytest.raises(ValueError, match="share one burst_id"):
        measure_burst(4, "hk", [(item_for(a, "burst", burst_id="B"), a, ok), (item_for(b, "burst", burst_id="C"), b, ok)],
                      CONFIG)


def test_window_prunes_filters_and_round_trips_through_sqlite():
    window = MeasurementWindow(window_s=100.0, keep_s=300.0)
    rows = [
        Measurement(uid=1, hotkey="a", at=10.0, kind="chat", request_id="r1", outcome="completed", tier0_ok=True,
                    prompt_tokens=10, completion_tokens=5, ttft_s=0.1, decode_tps=20.0, quality=0.5,
                    audits=1, failures="x: y"),
        Measurement(uid=1, hotkey="a", at=250.0, kind="long_context", request_id="r2", outcome="completed",
                    tier0_ok=True, long_context_success=False, hard_failure=True),
        Measurement(uid=2, hotkey="b", at=260.0, kind="burst_aggregate", request_id="B", outcome="completed",
                    tier0_ok=True, burst_id="B", burst_tokens=40, burst_wall_s=2.0),
        Measurement(uid=2, hotkey="old", at=270.0, kind="chat", request_id="r3", outcome="timeout"),
    ]
    window.extend(rows)
    assert len(window) == 4 and window.uids() == [1, 2]
    assert [m.request_id for m in window.rows(2, "b")] == ["B"]
    assert [m.request_id for m in window.rows(since=255.0)] == ["B", "r3"]

    db = sqlite3.connect(":memory:")
    db.row_factory = sqlite3.Row
    db.execute(f"CREATE TABLE measurements ({', '.join(COLUMNS)})")
    db.executemany(f"INSERT INTO measurements VALUES ({', '.join('?' * len(COLUMNS))})", window.to_rows())
    restored = MeasurementWindow.from_rows(db.execute("SELECT * FROM measurements"), window_s=100.0, keep_s=300.0)
    assert sorted(restored.rows(), key=lambda m: m.at) == rows
    assert restored.rows(1)[1].long_context_success is False and restored.rows(1)[1].hard_failure is True
    assert sorted(MeasurementWindow.from_rows(window.to_rows()).rows(), key=lambda m: m.at) == rows

    assert window.prune(now=320.0) == 1  # r1 is older than keep_s
    assert [m.request_id for m in window.rows(1)] == ["r2"]
    window.forget(2)
    assert window.uids() == [1]
    with pytest.raises(ValueError, match="lacks columns"):
        MeasurementWindow.from_rows([{"uid": 1}])
    with pytest.raises(ValueError, match="outcome"):
        Measurement(uid=1, hotkey="a", at=0.0, kind="chat", request_id="r", outcome="fine")


def test_new_or_suspect_miners():
    config = CONFIG.replace(new_miner_requests=3)
    window = MeasurementWindow.for_config(config)
    good = dict(hotkey="a", kind="chat", outcome="completed", tier0_ok=True)
    window.extend(Measurement(uid=1, at=100.0 + k, request_id=f"r{k}", **good) for k in range(2))
    assert window.is_new_or_suspect(1, "a", 200.0, config)  # only 2 verified requests
    window.add(Measurement(uid=1, at=103.0, request_id="r3", **good))
    assert not window.is_new_or_suspect(1, "a", 200.0, config)
    window.add(Measurement(uid=1, at=104.0, request_id="r4", audits=1, audit_failures=1, **good))
    assert window.is_new_or_suspect(1, "a", 200.0, config)
