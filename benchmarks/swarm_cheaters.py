"""How fast the validator catches each cheater on the local swarm, over several runs: the red team's table.

For every cheater kind, `--repeats` times, it runs `k3-localnet --swarm N --cheat-stage KIND --stop-when-caught`
(devnet; honest fp32 stages and one honest bf16 stage with a bf16 wire, an honest spare for the cheated block,
the route miner, a validator driving its own sessions through the stages and checking sessions after they ran,
serving a decoy of a forwarder's block and organic requests through its gateway) and reads the run's summary:
how many of the cheater's sessions the validator checked until it was blamed (the blaming one included), the
seconds from the validator's first stage check to the blame, the cheater's weight in the last weights set, and
the smallest weight of any honest stage (and of the honest route miner). A route driver's cheat (forge-receipts,
self-driver) counts the validator's rows of it instead of session checks. The table gives the median and the
maximum over the runs; any honest party blamed, or any cheater not caught before --duration, is said.

    python -m benchmarks.swarm_cheaters --repeats 5 --cheats echo,sparse-liar,fewer-experts
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from localnet.testnet import DRIVER_CHEATS, STAGE_CHEATS, free_port_block, swarm_ports

ROOT = Path(__file__).resolve().parents[1]


def run_one(kind: str, work: Path, stages: int, duration_s: float, sessions: int, tempo: int) -> dict:
    """One local swarm run with one cheater of `kind`; its measurements."""
    run_dir, summary = work / "run", work / "summary.json"
    work.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "localnet.testnet", "--swarm", str(stages), "--cheat-stage", kind,
           "--stop-when-caught", "--duration", str(duration_s), "--stage-sessions", str(sessions), "--tempo",
           str(tempo), "--no-dashboard", "--run-dir", str(run_dir), "--summary", str(summary),
           "--base-port", str(free_port_block(swarm_ports(stages)))]
    started = time.monotonic()
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=duration_s + 400)
    wall = time.monotonic() - started
    if not summary.exists():
        raise RuntimeError(f"{kind}: the local swarm wrote no summary (exit {proc.returncode}):\n"
                           f"{proc.stdout[-2000:]}{proc.stderr[-2000:]}")
    state = json.loads(summary.read_text())
    rows = state.get("stages", [])
    driver = state.get("driver") or {}
    cheaters = [driver] if kind in DRIVER_CHEATS else [s for s in rows if s["cheat"]]
    blames = [c["blame"] for c in cheaters]
    first = state.get("first_stage_check_at")
    honest = [s for s in rows if not s["cheat"]]
    return {"kind": kind, "caught": bool(state.get("caught")), "blamed": all(b["blamed"] for b in blames),
            "sessions": max(b.get("sessions", 0) for b in blames), "checks": max(b["checks"] for b in blames),
            "seconds": max((b["at"] - first for b in blames if b["blamed"] and first), default=None),
            "reason": next((b.get("reason") or "" for b in blames if b["blamed"]), ""),
            "weight": max(c["weight"] for c in cheaters),
            "honest_blamed": [s["name"] for s in honest if s["blamed"]] + ([driver["name"]] if driver.get("blamed")
                                                                          and kind not in DRIVER_CHEATS else []),
            "min_honest_weight": min((s["weight"] for s in honest), default=0.0),
            "route_weight": driver.get("weight", 0.0) if kind not in DRIVER_CHEATS else None,
            "cpu_s": state.get("stage_check_cpu_s") or [], "run_s": wall}


def summarise(kind: str, runs: list[dict]) -> dict:
    caught = [r for r in runs if r["blamed"]]
    counts = [r["checks"] if kind in DRIVER_CHEATS else r["sessions"] for r in caught]
    cpu = [c for r in runs for c in r["cpu_s"]]
    return {"kind": kind, "runs": len(runs), "caught": len(caught),
            "median": statistics.median(counts) if counts else None, "max": max(counts) if counts else None,
            "seconds": statistics.median([r["seconds"] for r in caught if r["seconds"] is not None] or [0.0]),
            "weight": max(r["weight"] for r in runs), "honest_blamed": sorted({h for r in runs for h in r["honest_blamed"]}),
            "min_honest_weight": min(r["min_honest_weight"] for r in runs),
            "cpu_s": statistics.mean(cpu) if cpu else None, "reason": next((r["reason"] for r in caught), ""),
            "route_weight": min((r["route_weight"] for r in runs if r["route_weight"] is not None), default=None)}


def table(rows: list[dict]) -> str:
    out = ["| cheat | caught (runs) | checks to blame: median | max | seconds to blame (median) | weight at the end | "
           "honest blamed | smallest honest stage weight | smallest honest route miner weight | validator CPU s per "
           "stage check | reason |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        unit = " rows" if r["kind"] in DRIVER_CHEATS else ""
        med = f"{r['median']:g}{unit}" if r["median"] is not None else "-"
        cpu = f"{r['cpu_s']:.2f}" if r["cpu_s"] is not None else "-"
        route = f"{r['route_weight']:.3f}" if r["route_weight"] is not None else "(the cheater)"
        out.append(f"| {r['kind']} | {r['caught']}/{r['runs']} | {med} | {r['max'] if r['max'] is not None else '-'} | "
                   f"{r['seconds']:.0f} | {r['weight']:.3f} | {', '.join(r['honest_blamed']) or 'none'} | "
                   f"{r['min_honest_weight']:.3f} | {route} | {cpu} | {r['reason'][:80]} |")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.swarm_cheaters", description=__doc__.splitlines()[0])
    ap.add_argument("--cheats", default=",".join(STAGE_CHEATS + DRIVER_CHEATS),
                    help="comma-separated kinds, run in this order")
    ap.add_argument("--repeats", type=int, default=5, help="runs per cheat")
    ap.add_argument("--stages", type=int, default=3, help="stage miners (blocks) of the swarm")
    ap.add_argument("--duration", type=float, default=300.0, help="seconds each run may take to catch its cheater")
    ap.add_argument("--stage-sessions", type=int, default=2, help="sessions the validator drives per round")
    ap.add_argument("--tempo", type=int, default=20, help="devnet blocks per epoch (weights once per epoch)")
    ap.add_argument("--work-dir", type=Path, default=None, help="run directories kept here (default: a temp dir)")
    ap.add_argument("--json", type=Path, default=None, help="also write every run as JSON here")
    args = ap.parse_args(argv)
    kinds = [k.strip() for k in args.cheats.split(",") if k.strip()]
    bad = [k for k in kinds if k not in STAGE_CHEATS + DRIVER_CHEATS]
    if bad:
        ap.error(f"unknown cheater(s) {bad}; choose from {', '.join(STAGE_CHEATS + DRIVER_CHEATS)}")
    runs: dict[str, list[dict]] = {}
    with tempfile.TemporaryDirectory(prefix="swarm-cheaters-") as tmp:
        work = args.work_dir or Path(tmp)
        for kind in kinds:
            for i in range(args.repeats):
                r = run_one(kind, work / kind / str(i), args.stages, args.duration, args.stage_sessions, args.tempo)
                runs.setdefault(kind, []).append(r)
                print(f"[{kind} {i + 1}/{args.repeats}] {'blamed' if r['blamed'] else 'NOT blamed'} after "
                      f"{r['sessions']} checked sessions ({r['checks']} rows), weight {r['weight']:.3f}, honest blamed "
                      f"{r['honest_blamed'] or 'none'}, {r['run_s']:.0f} s", flush=True)
                if args.json:
                    args.json.write_text(json.dumps(runs, indent=1))
    rows = [summarise(k, v) for k, v in runs.items()]
    print(table(rows))
    return 0 if all(r["caught"] == r["runs"] and not r["honest_blamed"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
