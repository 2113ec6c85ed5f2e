"""The validator's status report: its current view of every miner, read from its database
(what `python neurons/validator.py status` prints)."""
from __future__ import annotations

import json
import time

from neurons.validator_app.store import WORK_KINDS, ValidatorStore

STATUS_COLUMNS = ("uid", "hotkey", "ttft_per_1k_s", "decode_tps", "burst_tps", "long_context_share", "quality",
                  "failures", "last_failure", "score", "ema", "weight", "zero_weight_reason")
# the score reasons that zero a miner (scoring.rewards.score_miners)
_ZEROING = ("hard failure", "failed ", "coldkey ")


def zero_weight_reason(score, ema, weight: float, weights_set: bool) -> str | None:
    """Why a miner holds no weight, in one line (None when it holds some)."""
    if weight > 0:
        return None
    if score is None:
        return "not scored yet"
    reasons = json.loads(score["reasons"]) if score["reasons"] else []
    zeroing = [r for r in reasons if r.startswith(_ZEROING)]
    if zeroing:
        return "; ".join(zeroing)
    if not score["requests"]:
        return "no requests in the window"
    if not score["score"]:
        parts = [f"{name} {score[name]:.2f}" for name in ("reliability", "quality", "perf")
                 if score[name] is not None and score[name] <= 0]
        return "score 0: " + (", ".join(parts) or "gate 0")
    if not ema:
        return "EMA still 0"
    return "scored since the weights were last set" if weights_set else "no weights set yet"


def utc_time(epoch: float | None) -> str | None:
    """A Unix time as ISO 8601 in UTC ("2026-12-07T03:12:05Z"); None stays None."""
    return None if epoch is None else time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(epoch))


def age(epoch: float | None, now: float | None = None) -> str:
    """How long ago a Unix time was, in the largest unit that fits ("45 s", "12 min", "3.5 h", "2.0 d")."""
    if epoch is None:
        return "never"
    seconds = max(0.0, (time.time() if now is None else now) - epoch)
    if seconds < 120:
        return f"{seconds:.0f} s ago"
    if seconds < 7200:
        return f"{seconds / 60:.0f} min ago"
    return f"{seconds / 3600:.1f} h ago" if seconds < 172800 else f"{seconds / 86400:.1f} d ago"


def status_report(store: ValidatorStore) -> dict:
    """The validator's current view per miner, from its database."""
    meta = store.meta()
    latest = store.latest_scores()
    ema = store.load_ema()
    miners = store.miners()
    last = store.last_weights()
    failures: dict[int, list] = {}
    for row in store.failures():
        failures.setdefault(int(row["uid"]), []).append(row)
    uids = sorted(set(latest) | set(ema) | set(miners))
    # whole-model miners blamed as route drivers (receipts the stages never signed): zeroed, and why
    day = time.time() - 24 * 3600.0
    drivers = {c["hotkey"]: f"{c['kind']}: {c['reason']}"
               for c in store.stage_checks(since=day, kinds=["route_receipts"], blamed=True)}
    openings = store.stage_checks(since=day, kinds=["state_opening"])
    rows = []
    for uid in uids:
        score = latest.get(uid)
        miner = miners.get(uid)
        hotkey = (miner.hotkey if miner else None) or (score["hotkey"] if score else None) or \
            (ema[uid].hotkey if uid in ema else "")
        mine = [f for f in failures.get(uid, []) if f["hotkey"] == hotkey]
        last_failure = mine[-1] if mine else None
        rows.append({
            "uid": uid, "hotkey": hotkey, "url": miner.url if miner else None,
            "ttft_per_1k_s": score["ttft_per_1k_s"] if score else None,
            "decode_tps": score["decode_tps"] if score else None,
            "burst_tps": score["burst_tps"] if score else None,
            "long_context_share": score["long_context_share"] if score else None,
            "quality": score["quality"] if score else None,
            "reliability": score["reliability"] if score else None,
            "requests": int(score["requests"]) if score else 0,
            "failures": len(mine),
            "last_failure": f"{last_failure['check_name']}: {last_failure['reason']}" if last_failure else None,
            "last_failure_at": last_failure["at"] if last_failure else None,
            "score": score["score"] if score else None,
            "reasons": json.loads(score["reasons"]) if score and score["reasons"] else [],
            "ema": ema[uid].value if uid in ema and ema[uid].hotkey == hotkey else None,
            "weight": last.weights.get(uid, 0.0) if last.hotkeys.get(uid) in (None, hotkey) else 0.0,
        })
        rows[-1]["zero_weight_reason"] = zero_weight_reason(score, rows[-1]["ema"], rows[-1]["weight"],
                                                            last.block is not None)
        # state commitments: the share of its answers that carried one (the rest are paid at the stated discount,
        # scoring.weights), and the openings of them this validator made
        rows[-1]["committed"] = store.committed_share(uid, hotkey, time.time() - 24 * 3600.0)
        opened = [c for c in openings if c["hotkey"] == hotkey]
        rows[-1]["openings"] = len(opened)
        rows[-1]["openings_failed"] = sum(1 for c in opened if not c["passed"])
        rows[-1]["driver_blame"] = drivers.get(hotkey)
        if rows[-1]["driver_blame"] and rows[-1]["weight"] == 0:
            rows[-1]["zero_weight_reason"] = rows[-1]["driver_blame"]
    return {
        "db": str(store.path), "round": int(meta.get("round", 0)),
        "completed_round": int(meta.get("completed_round", 0)),
        "weights_set_at": last.set_at, "weights_set_at_utc": utc_time(last.set_at), "weights_block": last.block,
        "version_key": last.version_key,
        "miners": rows,
        "stage_miners": stage_miner_rows(store, last),
    }


def stage_miner_rows(store: ValidatorStore, last, blame_s: float = 24 * 3600.0) -> list[dict]:
    """Swarm stage miners: layers, sessions checked (and how many lay outside the honest envelope, how many could
    not be checked), layer-tokens credited, the weight last set, and why a zeroed one is zeroed (its latest
    blame)."""
    since = time.time() - blame_s
    # the credited work is added up by the store (it is most of the table); the checks themselves are read
    work = store.stage_totals(since, WORK_KINDS, ())
    checks = store.stage_checks(since=since, without=WORK_KINDS)
    rows = []
    for uid, sm in store.stage_miners().items():
        mine = [c for c in checks if c["hotkey"] == sm["hotkey"]]
        checked = [c for c in mine if c["kind"] in ("session_check", "session_lie")]
        blames = [c for c in mine if c["blame"]]
        credited = work.get(sm["hotkey"])
        rows.append({
            "uid": uid, "hotkey": sm["hotkey"], "url": sm["url"], "layers": sm["layers"],
            "checked": len(checked), "outside": sum(1 for c in checked if c["outside"] or c["blame"]),
            "unchecked": sum(1 for c in mine if c["kind"] == "unchecked"),
            "tokens": sum(credited.tokens.values()) if credited else 0,
            "step_ms": sm["step_ms"],
            "blamed": bool(blames),
            "reason": f"{blames[-1]['kind']}: {blames[-1]['reason']}" if blames else None,
            "weight": last.weights.get(uid, 0.0) if last.hotkeys.get(uid) in (None, sm["hotkey"]) else 0.0,
        })
    return rows
