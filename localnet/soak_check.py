"""The soak's checker: reads a soak's run directory afterwards and prints what users saw, what the validator did and
what the processes cost (`k3-localnet check RUN_DIR`, or `python -m localnet.soak_check RUN_DIR`).

It reads what localnet/soak.py wrote (organic.jsonl, faults.jsonl, events.jsonl, resources.jsonl, soak.json), the
validator's store (validator.sqlite, read-only), the devnet's epochs (devnet.sqlite) and the validator's log, and
judges the soak's criteria (docs/localnet.md):

- organic requests: sent, served, failed (and why), p50/p99 latency, per kind of fault window (a request belongs
  to the window of the last fault that began before it was sent; "no fault" before the first);
- a request is *served* when one of its attempts was answered; it *failed twice* when two attempts failed in
  flight (a refused connection while the gateway's process was down, and a 429 telling the user to come back, are
  waited out, not failures);
- service restored: per fault, from its start to the answer of the first request sent after the last failed attempt
  or slow answer in its window (slow: over SLOW_FACTOR x the median of its kind of request away from faults, and
  over SLOW_FLOOR_S); 0 when nothing in the window failed or was slow. A fault is active from its start until it
  ends and, for a kill, until the restarted process serves again;
- weights: every epoch window (from one epoch to the next) during which the validator's process served from
  start to end holds a weight setting (from its log, "weights set at block N");
- honest parties zeroed or blamed: scores with `zeroed`, hard failures and stage checks with `blame` for a party
  soak.json calls honest, each with the fault whose window it fell in;
- records: every served request recorded once in the validator's store: a whole-model miner's answer as one
  organic `measurements` row of its request id, a route's answer as `gateway_work` rows of its request id (at
  most ROUTE_CREDIT_ROOM x its tokens per stage: more would be a duplicate); `PRAGMA integrity_check` of the
  validator's store and the devnet;
- resources: per process, RSS and open descriptors over its longest-lived run: for RSS the median of the samples
  of the minute after WARMUP_S, and of its last minute; for descriptors the fewest open in each of those minutes
  (the connections of the requests in flight come and go with the traffic, 14 to 60 for a route; a leaked
  descriptor is never closed and raises the floor); it grew when the second exceeds the first by more than
  GROWTH_LIMIT and by more than the slack (GROWTH_SLACK_MB, GROWTH_SLACK_FDS: the allocator's and the connection
  pools' noise at these sizes); and each store's size at the soak's start and end.

Exit status 0 when every criterion is met, 1 otherwise (the table says which).
"""
from __future__ import annotations

import argparse
import json
import re
import sqlite3
import statistics
import sys
from collections import defaultdict
from pathlib import Path
from typing import Optional

from localnet.soak import EVENTS_LOG, FAULTS_LOG, ORGANIC_LOG, RESOURCES_LOG, SOAK_META, in_flight_failure

REPORT_FILE = "soak-report.json"
SLOW_FACTOR = 3.0
SLOW_FLOOR_S = 10.0
RESTORE_LIMIT_S = 10.0
SERVED_SHARE = 0.99
GROWTH_LIMIT = 0.10
GROWTH_SLACK_MB = 16.0
GROWTH_SLACK_FDS = 16
WARMUP_S = 60.0
ROUTE_CREDIT_ROOM = 2  # neurons/validator_app/stage_rounds.py SPECULATION_ROOM: a request's work, drafts included


def read_lines(path: Path) -> list[dict]:
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        line = line.strip()
        if line.endswith("}"):
            try:
                out.append(json.loads(line))
            except ValueError:
                continue  # a line cut short by a kill of the harness
    return out


def median_of(rows: list[dict], key: str) -> Optional[float]:
    return statistics.median(r[key] for r in rows) if rows else None


def least_of(rows: list[dict], key: str) -> Optional[float]:
    return min(r[key] for r in rows) if rows else None


def percentile(values: list[float], q: float) -> Optional[float]:
    if not values:
        return None
    values = sorted(values)
    k = min(len(values) - 1, max(0, round(q * (len(values) - 1))))
    return values[k]


# ------------------------------------------------------------------ faults and windows
def load_faults(run_dir: Path) -> list[dict]:
    """Each injected fault with its outcome (recovered, ready_s), in order of start."""
    rows = read_lines(run_dir / FAULTS_LOG)
    faults = {r["id"]: dict(r) for r in rows if "start" in r}
    for r in rows:
        if "start" not in r and r.get("id") in faults:
            faults[r["id"]].update(recovered=r.get("recovered"), ready_s=r.get("ready_s"), ready_at=r.get("ready_at"))
    return sorted(faults.values(), key=lambda f: f["start"])


def window_of(faults: list[dict], at: float) -> Optional[dict]:
    """The last fault that began at or before `at` (None: before the first)."""
    last = None
    for f in faults:
        if f["start"] <= at:
            last = f
        else:
            break
    return last


def active_until(fault: dict) -> float:
    """When the fault stopped acting: its end, or for a kill when the restarted process served again."""
    return max(fault["end"], fault.get("ready_at") or fault["end"])


def in_fault(faults: list[dict], at: float) -> bool:
    return any(f["start"] <= at <= active_until(f) + 2.0 for f in faults)


# ------------------------------------------------------------------ organic traffic
def classify_failure(request: dict) -> str:
    """Why a request was not served, in a few words (its last attempt's error)."""
    last = request["attempts"][-1] if request["attempts"] else {}
    error = last.get("error") or "unknown"
    m = re.match(r"HTTP (\d+) (\w*)", error)
    if m is None and last.get("status"):
        return f"HTTP {last['status']}"
    if m:
        return f"HTTP {m.group(1)} {m.group(2)}".strip()
    if error.startswith("refused"):
        return "gateway unreachable"
    return error.split(":", 1)[0]


def slow_bounds(requests: list[dict], faults: list[dict]) -> dict[str, float]:
    """Per request kind: the latency above which an answer counts as slow (module doc)."""
    bounds = {}
    for kind in {r["kind"] for r in requests}:
        quiet = [r["seconds"] for r in requests if r["kind"] == kind and r["ok"] and len(r["attempts"]) == 1
                 and not in_fault(faults, r["sent_at"])]
        p50 = percentile(quiet, 0.5)
        bounds[kind] = max(SLOW_FLOOR_S, SLOW_FACTOR * p50) if p50 is not None else SLOW_FLOOR_S * 3
    return bounds


def good(request: dict, bounds: dict[str, float]) -> bool:
    return request["ok"] and len(request["attempts"]) == 1 and request["seconds"] <= bounds[request["kind"]]


def failed_in_flight(request: dict) -> int:
    return sum(1 for a in request["attempts"] if in_flight_failure(a))


def bad_events(requests: list[dict], bounds: dict[str, float]) -> list[float]:
    """When users saw trouble: the end of every failed attempt, and the answer of every slow request."""
    events = [a.get("end", a.get("at", r["sent_at"])) for r in requests for a in r["attempts"] if not a["ok"]]
    events += [r["done_at"] for r in requests if r["ok"] and r["seconds"] > bounds[r["kind"]]]
    return sorted(events)


def restore_times(faults: list[dict], requests: list[dict], bounds: dict[str, float], soak_end: float) -> None:
    """Per fault: `restore_s` (module doc), None when service was not back before the end."""
    starts = [f["start"] for f in faults] + [soak_end]
    events = bad_events(requests, bounds)
    for i, f in enumerate(faults):
        mine = [t for t in events if f["start"] <= t < starts[i + 1]]
        f["requests"] = sum(1 for r in requests if f["start"] <= r["sent_at"] < starts[i + 1])
        f["bad_events"] = len(mine)
        if not mine:
            f["restore_s"] = 0.0
            continue
        after = sorted((r for r in requests if r["sent_at"] >= mine[-1] and good(r, bounds)),
                       key=lambda r: r["sent_at"])
        f["restore_s"] = round(after[0]["done_at"] - f["start"], 2) if after else None


def traffic_rows(faults: list[dict], requests: list[dict]) -> list[dict]:
    """Per kind of fault window (and "no fault"): sent, served, failed and why, p50/p99 of served requests."""
    groups: dict[str, list[dict]] = defaultdict(list)
    for r in requests:
        f = window_of(faults, r["sent_at"])
        groups[f["kind"] if f else "no fault"].append(r)
    rows = []
    for kind in ["no fault"] + sorted(k for k in groups if k != "no fault"):
        rs = groups.get(kind, [])
        if not rs and kind == "no fault":
            continue
        served = [r for r in rs if r["ok"]]
        why: dict[str, int] = defaultdict(int)
        for r in rs:
            if not r["ok"]:
                why[classify_failure(r)] += 1
        times = [r["seconds"] for r in served]
        mine = [f for f in faults if f["kind"] == kind]
        restores = [f.get("restore_s") for f in mine]
        rows.append({"window": kind, "faults": len(mine), "sent": len(rs), "served": len(served),
                     "failed": len(rs) - len(served), "why": dict(why),
                     "retried": sum(1 for r in served if len(r["attempts"]) > 1),
                     "failed_twice": sum(1 for r in rs if failed_in_flight(r) >= 2),
                     "p50_s": percentile(times, 0.5), "p99_s": percentile(times, 0.99),
                     "worst_restore_s": max((x for x in restores if x is not None), default=None) if mine else None,
                     "not_restored": sum(1 for x in restores if x is None) if mine else 0})
    return rows


# ------------------------------------------------------------------ the validator's store and the chain
def open_readonly(path: Path) -> sqlite3.Connection:
    conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=30.0)
    conn.row_factory = sqlite3.Row
    return conn


def integrity(path: Path) -> str:
    if not path.exists():
        return "missing"
    with open_readonly(path) as conn:
        return conn.execute("PRAGMA integrity_check").fetchone()[0]


def record_check(db: Path, requests: list[dict]) -> dict:
    """Every served request recorded once in the validator's store (module doc)."""
    served = [r for r in requests if r["ok"]]
    lost, duplicated, no_id, route_lost = [], [], 0, []
    with open_readonly(db) as conn:
        for r in served:
            rid = r.get("request_id")
            if not rid:
                no_id += 1
                continue
            if str(r.get("miner_uid")) == "-1":
                rows = conn.execute("SELECT hotkey, SUM(tokens) AS t, COUNT(*) AS n FROM stage_checks WHERE "
                                    "request_id = ? AND kind = 'gateway_work' GROUP BY hotkey", (rid,)).fetchall()
                budget = ROUTE_CREDIT_ROOM * ((r.get("prompt_tokens") or 0) + (r.get("completion_tokens") or 0))
                if not rows:
                    lost.append(r["id"])
                    route_lost.append(r["id"])
                elif any((row["t"] or 0) > budget for row in rows):
                    duplicated.append(r["id"])
            else:
                n = conn.execute("SELECT COUNT(*) FROM measurements WHERE request_id = ? AND source = 'organic'",
                                 (rid,)).fetchone()[0]
                if n == 0:
                    lost.append(r["id"])
                elif n > 1:
                    duplicated.append(r["id"])
    return {"served": len(served), "lost": lost, "lost_route_served": route_lost, "duplicated": duplicated,
            "without_request_id": no_id, "route_served": sum(1 for r in served if str(r.get("miner_uid")) == "-1"),
            "integrity": integrity(db)}


def honest_blames(db: Path, parties: list[dict], faults: list[dict], since: float) -> list[dict]:
    """Zeroed scores, hard failures and stage blames of honest parties since `since`, each with its fault window."""
    honest = {p["hotkey"]: p["name"] for p in parties if p["honest"]}
    found = []
    with open_readonly(db) as conn:
        rows = [("zeroed", r["at"], r["hotkey"], r["reasons"]) for r in
                conn.execute("SELECT at, hotkey, reasons FROM scores WHERE zeroed > 0 AND at >= ?", (since,))]
        rows += [("hard failure", r["at"], r["hotkey"], f"{r['check_name']}: {r['reason']}") for r in
                 conn.execute("SELECT at, hotkey, check_name, reason FROM failures WHERE hard = 1 AND at >= ?",
                              (since,))]
        rows += [(f"blamed ({r['kind']})", r["at"], r["hotkey"], r["reason"]) for r in
                 conn.execute("SELECT at, hotkey, kind, reason FROM stage_checks WHERE blame = 1 AND at >= ?",
                              (since,))]
    for what, at, hotkey, reason in rows:
        if hotkey not in honest:
            continue
        f = window_of(faults, at)
        found.append({"party": honest[hotkey], "what": what, "at": at, "reason": str(reason)[:300],
                      "fault": f"{f['id']} {f['kind']} on {f['target']} ({at - f['start']:.0f} s before)"
                      if f else "none"})
    return found


def unchecked_counts(db: Path, since: float) -> int:
    with open_readonly(db) as conn:
        return conn.execute("SELECT COUNT(*) FROM stage_checks WHERE kind = 'unchecked' AND at >= ?",
                            (since,)).fetchone()[0]


def up_intervals(events: list[dict], name: str, end: float) -> list[tuple[float, float]]:
    """When the process `name` served: from each ready event to the exit after it (or the soak's end)."""
    out, up = [], None
    for e in sorted((e for e in events if e["name"] == name), key=lambda e: e["at"]):
        if e["event"] in ("ready", "start") and e.get("why") == "initial" and up is None:
            up = e["at"]
        elif e["event"] == "ready" and up is None:
            up = e["at"]
        elif e["event"] == "exit" and up is not None:
            out.append((up, e["at"]))
            up = None
    if up is not None:
        out.append((up, end))
    return out


def weight_epochs(run_dir: Path, meta: dict, events: list[dict], soak_start: float, soak_end: float) -> dict:
    """Epoch windows in which the validator served throughout, and those of them with weights set (module doc)."""
    devnet = run_dir / "devnet.sqlite"
    with open_readonly(devnet) as conn:
        genesis, interval = (float(v) for (v,) in conn.execute(
            "SELECT value FROM meta WHERE key IN ('genesis_time', 'block_interval') ORDER BY key DESC"))
        blocks = [r[0] for r in conn.execute("SELECT block FROM epochs WHERE netuid = ? ORDER BY block",
                                             (meta["netuid"],))]
    log = run_dir / "logs" / "validator.log"
    weights = sorted(int(b) for b in re.findall(r"weights set at block (\d+)", log.read_text(errors="replace"))) \
        if log.exists() else []
    first = weights[0] if weights else None
    ups = up_intervals(events, "validator", soak_end)
    windows, missed = 0, []
    for a, b in zip(blocks, blocks[1:]):
        ta, tb = genesis + a * interval, genesis + b * interval
        if ta < soak_start or tb > soak_end or first is None or a < first:
            continue
        if not any(u <= ta and tb <= v for u, v in ups):
            continue
        windows += 1
        if not any(a <= w < b for w in weights):
            missed.append(a)
    return {"windows_up": windows, "with_weights": windows - len(missed), "missed_epochs_at": missed,
            "weights_set": len([w for w in weights if genesis + w * interval >= soak_start]),
            "devnet_integrity": integrity(devnet)}


# ------------------------------------------------------------------ resources
def resource_rows(samples: list[dict]) -> tuple[list[dict], dict]:
    """Per process: RSS and descriptors after warm-up and at the end of its longest run; store sizes."""
    runs: dict[tuple[str, int], list[dict]] = defaultdict(list)
    stores = [s for s in samples if "stores" in s]
    for s in samples:
        if "name" in s:
            runs[(s["name"], s["incarnation"])].append(s)
    best: dict[str, list[dict]] = {}
    for (name, _), rows in runs.items():
        if name not in best or rows[-1]["at"] - rows[0]["at"] > best[name][-1]["at"] - best[name][0]["at"]:
            best[name] = rows
    out = []
    for name, rows in sorted(best.items()):
        begin, end = rows[0]["at"], rows[-1]["at"]
        warm = [r for r in rows if begin + WARMUP_S <= r["at"] < begin + 2 * WARMUP_S]
        last = [r for r in rows if r["at"] > end - WARMUP_S]
        row = {"process": name, "incarnation": rows[0]["incarnation"], "runs": sum(1 for k in runs if k[0] == name),
               "span_s": round(end - begin), "rss_start_mb": rows[0]["rss_mb"],
               "rss_warm_mb": median_of(warm, "rss_mb"), "rss_end_mb": median_of(last, "rss_mb"),
               "fds_warm": least_of(warm, "fds"), "fds_end": least_of(last, "fds")}
        rss_key = "rss_mb"
        if any("bounded_mb" in r for r in rows):  # a stage: its ledger fills to its bound by design, the rest must not
            for r in rows:
                if "bounded_mb" in r:
                    r["rss_less_bounded_mb"] = r["rss_mb"] - r["bounded_mb"]
            warm, last = ([r for r in part if "bounded_mb" in r] for part in (warm, last))
            rss_key = "rss_less_bounded_mb"
            row.update(bounded_warm_mb=median_of(warm, "bounded_mb"), bounded_end_mb=median_of(last, "bounded_mb"),
                       rss_less_bounded_warm_mb=median_of(warm, rss_key),
                       rss_less_bounded_end_mb=median_of(last, rss_key))
        if warm and last and end - begin >= 3 * WARMUP_S:  # a minute after warm-up and a last one that do not overlap
            row["grew"] = [what for what, warm_value, end_value, slack in (
                ("RSS", median_of(warm, rss_key), median_of(last, rss_key), GROWTH_SLACK_MB),
                ("descriptors", row["fds_warm"], row["fds_end"], GROWTH_SLACK_FDS))
                if end_value > warm_value * (1 + GROWTH_LIMIT) + slack]
        out.append(row)
    sizes = {"start": stores[0]["stores"] if stores else {}, "end": stores[-1]["stores"] if stores else {}}
    return out, sizes


# ------------------------------------------------------------------ the report
def check(run_dir: Path) -> dict:
    run_dir = Path(run_dir)
    meta = json.loads((run_dir / SOAK_META).read_text())
    start, end = meta["started_at"], meta.get("ended_at") or meta["started_at"] + meta["duration_s"]
    faults = load_faults(run_dir)
    requests = read_lines(run_dir / ORGANIC_LOG)
    events = read_lines(run_dir / EVENTS_LOG)
    bounds = slow_bounds(requests, faults)
    restore_times(faults, requests, bounds, end)
    traffic = traffic_rows(faults, requests)
    db = run_dir / "validator.sqlite"
    records = record_check(db, requests)
    blames = honest_blames(db, meta["parties"], faults, start)
    epochs = weight_epochs(run_dir, meta, events, start, end)
    processes, stores = resource_rows(read_lines(run_dir / RESOURCES_LOG))
    served = sum(1 for r in requests if r["ok"])
    failed_twice = sum(1 for r in requests if failed_in_flight(r) >= 2)
    restores = [f.get("restore_s") for f in faults if "restore_s" in f]
    crashes = [e for e in events if e["event"] == "exit" and e.get("why") == "crash"]
    criteria = {
        "faults": (len(faults), len(faults) >= (200 if meta["duration_s"] >= 3600 else 20)),
        "served share": (round(served / max(1, len(requests)), 4), served >= SERVED_SHARE * len(requests)),
        "requests that failed twice": (failed_twice, failed_twice == 0),
        "honest parties zeroed or blamed": (len({b["party"] for b in blames}), not blames),
        "records lost / duplicated": (f"{len(records['lost'])} ({len(records['lost_route_served'])} served by the "
                                      f"validator's route) / {len(records['duplicated'])}",
                                      not records["lost"] and not records["duplicated"]),
        "store integrity (validator, devnet)": (f"{records['integrity']}, {epochs['devnet_integrity']}",
                                                records["integrity"] == "ok" and epochs["devnet_integrity"] == "ok"),
        "epochs with weights / validator up throughout": (f"{epochs['with_weights']} / {epochs['windows_up']}",
                                                          not epochs["missed_epochs_at"]),
        "RSS and descriptors within 10% after warm-up": (
            "grew: " + (", ".join(f"{p['process']} ({'/'.join(p['grew'])})" for p in processes if p.get("grew"))
                        or "none") + f"; {sum(1 for p in processes if 'grew' in p)} of {len(processes)} ran long "
                                     "enough to tell",
            not any(p.get("grew") for p in processes)),
        "service restored within 10 s of each fault": (
            f"{sum(1 for x in restores if x is not None and x <= RESTORE_LIMIT_S)} of {len(restores)}; worst "
            + (f"{max(x for x in restores if x is not None):.1f} s" if any(x is not None for x in restores) else "-"),
            all(x is not None and x <= RESTORE_LIMIT_S for x in restores)),
        "unasked exits (crashes)": (len(crashes), not crashes),
    }
    report = {"run_dir": str(run_dir), "seed": meta["seed"], "duration_s": meta["duration_s"], "sent": len(requests),
              "served": served, "slow_bounds_s": bounds, "traffic": traffic, "faults": faults, "records": records,
              "honest_blames": blames, "epochs": epochs, "processes": processes, "stores": stores,
              "crashes": crashes, "unchecked_stage_checks": unchecked_counts(db, start),
              "criteria": {k: {"value": v, "met": ok} for k, (v, ok) in criteria.items()}}
    (run_dir / REPORT_FILE).write_text(json.dumps(report, indent=2, default=str))
    return report


def _f(x, digits: int = 2) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def render(report: dict) -> str:
    """The report as Markdown tables (what docs/benchmarks.md holds)."""
    lines = [f"soak of {report['duration_s']:.0f} s, seed {report['seed']}: {len(report['faults'])} faults, "
             f"{report['sent']} organic requests, {report['served']} served", "",
             "| window | faults | sent | served | failed (why) | retried | failed twice | p50 s | p99 s | "
             "worst restore s |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in report["traffic"]:
        why = ", ".join(f"{k} {v}" for k, v in r["why"].items())
        restore = _f(r["worst_restore_s"], 1) + (f" ({r['not_restored']} not back)" if r["not_restored"] else "")
        lines.append(f"| {r['window']} | {r['faults']} | {r['sent']} | {r['served']} | {r['failed']}"
                     f"{f' ({why})' if why else ''} | {r['retried']} | {r['failed_twice']} | {_f(r['p50_s'])} | "
                     f"{_f(r['p99_s'])} | {restore if r['faults'] else '-'} |")
    lines += ["", "| process | runs | longest run s | RSS MiB warm -> end | descriptors warm -> end |",
              "|---|---|---|---|---|"]
    for p in report["processes"]:
        lines.append(f"| {p['process']} | {p['runs']} | {p['span_s']} | {_f(p['rss_warm_mb'], 0)} -> "
                     f"{_f(p['rss_end_mb'], 0)} | {_f(p['fds_warm'], 0)} -> {_f(p['fds_end'], 0)} |")
    start, end = report["stores"]["start"], report["stores"]["end"]
    lines += ["", "| store | size at start KiB | size at end KiB |", "|---|---|---|"]
    lines += [f"| {name} | {start.get(name, 0) // 1024} | {end.get(name, 0) // 1024} |" for name in sorted(end)]
    lines += ["", "| criterion | measured | met |", "|---|---|---|"]
    lines += [f"| {k} | {v['value']} | {'yes' if v['met'] else 'NO'} |" for k, v in report["criteria"].items()]
    for b in report["honest_blames"]:
        lines.append(f"honest {b['party']} {b['what']} in the window of {b['fault']}: {b['reason'][:160]}")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="k3-localnet check", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("run_dir", type=Path, help="the soak's run directory (k3-localnet --soak S --run-dir DIR)")
    args = ap.parse_args(argv)
    if not (args.run_dir / SOAK_META).exists():
        print(f"error: {args.run_dir} holds no soak ({SOAK_META} is missing): run k3-localnet --soak SECONDS "
              f"--run-dir {args.run_dir}", file=sys.stderr)
        return 2
    report = check(args.run_dir)
    print(render(report))
    print(f"\n(full report: {args.run_dir / REPORT_FILE})")
    return 0 if all(c["met"] for c in report["criteria"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
