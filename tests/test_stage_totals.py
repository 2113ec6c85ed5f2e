"""The stage miners' work and checks added up by the store (ValidatorStore.stage_totals, filtered stage_checks) equal
the same figures read row by row, which is how the validator's weights and its status used to compute them: on a
store of random rows of every kind, times and hotkeys, blames and drivers included."""
from __future__ import annotations

import random
import time
import types

import pytest

from neurons.validator_app.stage_rounds import SAMPLED_KINDS, StageRounds
from neurons.validator_app.status import stage_miner_rows
from neurons.validator_app.store import OWN_WORK_KINDS, WORK_KINDS, LastWeights, ValidatorStore

KINDS = WORK_KINDS + SAMPLED_KINDS + ("verdict", "route_receipts", "session_receipts", "state_opening", "decoy")
HOTKEYS = [f"5Stage{i}" for i in range(5)] + ["5Driver"]


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    rng = random.Random(3)
    now = time.time()
    store = ValidatorStore(tmp_path_factory.mktemp("totals") / "v.sqlite")
    store.save_stage_miners([dict(uid=i, hotkey=h, layers=f"{3 * i}-{3 * i + 2}", step_ms=10.0 + i)
                             for i, h in enumerate(HOTKEYS[:5])])
    for _ in range(3000):
        kind = rng.choice(KINDS)
        store.add_stage_check(dict(
            at=now - rng.uniform(0, 3 * 3600), round=1, uid=0, hotkey=rng.choice(HOTKEYS), layers="0-2", kind=kind,
            passed=int(rng.random() < 0.8), blame=int(kind not in WORK_KINDS and rng.random() < 0.05),
            reason=f"reason {rng.randrange(1000)}", tokens=rng.choice([None, 0, rng.randrange(1, 500)]),
            outside=rng.choice([None, "", "median above"]), numerics=rng.choice(["float32", "bfloat16"]),
            origin=rng.choice(HOTKEYS[-2:]) if kind == "route_work" else None))
    yield store, now
    store.close()


def work_row_by_row(store, now, window_s, blame_s):
    """What StageRounds.stage_work computed by reading every row of the window."""
    rows = store.stage_checks(since=now - max(window_s, blame_s))
    out = {}
    for uid, sm in store.stage_miners().items():
        mine = [r for r in rows if r["hotkey"] == sm["hotkey"]]
        recent = [r for r in mine if r["at"] >= now - window_s]
        sampled = [r for r in recent if r["kind"] in SAMPLED_KINDS]
        blames = [f"{r['kind']}: {r['reason']}" for r in mine if r["blame"] and r["at"] >= now - blame_s]
        out[uid] = (sum(int(r["tokens"] or 0) for r in recent if r["kind"] in OWN_WORK_KINDS),
                    sum(int(r["tokens"] or 0) for r in recent if r["kind"] == "route_work"),
                    sum(r["kind"] != "unchecked" for r in sampled) / len(sampled) if sampled else 1.0, blames[-1:])
    return out


@pytest.mark.parametrize("window_s,blame_s", [(3600.0, 7200.0), (7200.0, 1800.0), (60.0, 60.0)])
def test_stage_work_adds_up_as_reading_every_row(store, window_s, blame_s, monkeypatch):
    store, now = store
    seen = {}
    monkeypatch.setattr("neurons.validator_app.stage_rounds.pooled_route_work",
                        lambda out, own, outside: seen.update(own=own, outside=outside) or {})
    rounds = types.SimpleNamespace(store=store, window_s=window_s, blame_s=blame_s,
                                   _step_ms=lambda sm: float(sm["step_ms"]))
    work = StageRounds.stage_work(rounds, now)
    want = work_row_by_row(store, now, window_s, blame_s)
    assert set(work) == set(want)
    if window_s >= 3600:  # a window that holds work of both kinds
        assert sum(seen["own"].values()) > 0 and sum(seen["outside"].values()) > 0
    for uid, (own, outside, available, blames) in want.items():
        assert (seen["own"][uid], seen["outside"][uid]) == (own, outside), uid
        assert work[uid].availability == pytest.approx(available) and work[uid].failed_checks == blames, uid
    assert any(w.failed_checks for w in work.values()) or blame_s < 600


def test_the_status_rows_add_up_as_reading_every_row(store):
    store, now = store
    rows = {r["uid"]: r for r in stage_miner_rows(store, LastWeights({}, {}, None, None, None), blame_s=5000.0)}
    checks = store.stage_checks(since=time.time() - 5000.0)
    for uid, sm in store.stage_miners().items():
        mine = [c for c in checks if c["hotkey"] == sm["hotkey"]]
        checked = [c for c in mine if c["kind"] in ("session_check", "session_lie")]
        blames = [c for c in mine if c["blame"]]
        assert rows[uid]["tokens"] == sum(int(c["tokens"] or 0) for c in mine if c["kind"] in WORK_KINDS) > 0
        assert rows[uid]["checked"] == len(checked) and rows[uid]["blamed"] == bool(blames)
        assert rows[uid]["unchecked"] == sum(1 for c in mine if c["kind"] == "unchecked")
        assert rows[uid]["reason"] == (f"{blames[-1]['kind']}: {blames[-1]['reason']}" if blames else None)


def test_filtered_reads_and_the_totals_per_driver(store):
    store, now = store
    every = store.stage_checks()
    assert [r["id"] for r in store.stage_checks(without=WORK_KINDS)] == \
        [r["id"] for r in every if r["kind"] not in WORK_KINDS]
    assert [r["id"] for r in store.stage_checks(kinds=["verdict", "decoy"], blamed=True)] == \
        [r["id"] for r in every if r["kind"] in ("verdict", "decoy") and r["blame"]]
    assert [r["id"] for r in store.stage_blame("5Stage1", now - 3600.0)] == \
        [r["id"] for r in every if r["hotkey"] == "5Stage1" and r["blame"] and r["at"] >= now - 3600.0]
    by_driver = store.stage_totals(0.0, ["route_work"], (), by="origin")
    for driver in HOTKEYS[-2:]:
        assert by_driver[driver].tokens["route_work"] == sum(int(r["tokens"] or 0) for r in every
                                                             if r["kind"] == "route_work" and r["origin"] == driver)
    with pytest.raises(ValueError, match="hotkey or origin"):
        store.stage_totals(0.0, ["route_work"], (), by="reason; DROP TABLE stage_checks")
