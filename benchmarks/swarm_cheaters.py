"""How fast the validator catches each stage cheater on the local swarm (benchmarks/swarm_cheaters.py).

For every cheater kind in turn it runs `localnet.py --swarm N --cheat-stage KIND --stop-when-caught` (devnet, honest
fp32 and bf16 stages, an honest spare for the cheated block, the route miner, a validator checking the stages,
serving a decoy of a forwarder's block and organic requests through its gateway) and reads its summary: how many
of the validator's challenges of the cheater ran until it was blamed (the blaming one included), seconds from the
start of the validator's first check of it to the blame, the reason, the validator's CPU seconds per stage
challenge (every stage's challenges of that run), and the organic requests served while it ran. A cheater not
caught before --duration says so. The route driver's cheat (forge-receipts: the route miner claims receipts the
stages never signed) has no block and no challenges: its row counts the validator's checks of it (the claims it
audited). A cheater blamed before any challenge of it (the driver; a forwarder whose route session reached the decoy)
is timed from the validator's first stage check (its first round, when the decoys start).
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

ROOT = Path(__file__).resolve().parents[2]


def run_one(kind: str, work: Path, stages: int, duration_s: float, challenges: int, tempo: int) -> dict:
    """One local swarm run with one cheater of `kind`; its row of the table."""
    run_dir, summary = work / kind / "run", work / kind / "summary.json"
    summary.parent.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "scripts/localnet.py", "--swarm", str(stages), "--cheat-stage", kind, "--stop-when-caught",
           "--duration", str(duration_s), "--stage-challenges", str(challenges), "--tempo", str(tempo),
           "--no-dashboard", "--run-dir", str(run_dir), "--summary", str(summary),
           "--base-port", str(free_port_block(swarm_ports(stages)))]
    started = time.monotonic()
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=duration_s + 400)
    wall = time.monotonic() - started
    if not summary.exists():
        raise RuntimeError(f"{kind}: localnet wrote no summary (exit {proc.returncode}):\n{proc.stdout[-2000:]}"
                           f"{proc.stderr[-2000:]}")
    state = json.loads(summary.read_text())
    rows = state.get("stages", [])
    driver = state.get("driver") or {}
    cheater = {**driver, "layers": "-"} if kind in DRIVER_CHEATS else next(s for s in rows if s["cheat"])
    honest_blamed = [s["name"] for s in rows if not s["cheat"] and s["blamed"]]
    first = state.get("first_stage_check_at")
    if cheater["blame"]["blamed"] and cheater["blame"]["challenges"] == 0 and first is not None:
        # blamed before any challenge of it (the route driver; a forwarder caught by the decoy on a route's session):
        # the seconds from the validator's first stage check (its first round, when the decoys start)
        cheater["blame"] = {**cheater["blame"], "seconds": cheater["blame"]["at"] - first}
    cpu = state.get("stage_challenge_cpu_s") or []
    organic = state.get("organic") or []
    blame = cheater["blame"]
    return {"kind": kind, "layers": cheater["layers"], "caught": bool(state.get("caught")),
            "blamed": blame["blamed"], "challenges": blame["challenges"], "checks": blame["checks"],
            "seconds": blame.get("seconds"), "reason": blame.get("reason") or "", "weight": cheater["weight"],
            "honest_blamed": honest_blamed, "cpu_s_per_challenge": statistics.mean(cpu) if cpu else None,
            "stage_challenges": len(cpu), "organic_ok": sum(1 for o in organic if o["ok"]),
            "organic_sent": len(organic), "run_s": wall,
            "route_work_tokens": sum(s.get("route_work_tokens") or 0 for s in rows)}


def table(rows: list[dict]) -> str:
    out = ["| cheater | block | blamed | challenges until blame | seconds until blame | weight after | reason | "
           "honest blamed | validator CPU s / stage challenge (n) | organic served / sent | route work credited to the "
           "stages (layer-tokens) | run s |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        secs = f"{r['seconds']:.1f}" if r["seconds"] is not None else "-"
        cpu = f"{r['cpu_s_per_challenge']:.2f} ({r['stage_challenges']})" if r["cpu_s_per_challenge"] is not None \
            else "-"
        until = str(r["challenges"]) if r["blamed"] else f"not in {r['challenges']}"
        if r["kind"] in DRIVER_CHEATS:  # no challenges: the claims of it the validator audited
            until = f"{r['checks']} claim(s) audited" if r["blamed"] else f"not in {r['checks']} claims"
        out.append(f"| {r['kind']} | {r['layers']} | {'yes' if r['blamed'] else 'NO'} | {until} | {secs} | "
                   f"{r['weight']:.3f} | {r['reason'][:60]} | {', '.join(r['honest_blamed']) or 'none'} | {cpu} | "
                   f"{r['organic_ok']} / {r['organic_sent']} | {r['route_work_tokens']} | {r['run_s']:.0f} |")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="bench_swarm_cheaters", description=__doc__.splitlines()[0])
    ap.add_argument("--cheats", default=",".join(STAGE_CHEATS + DRIVER_CHEATS),
                    help="comma-separated kinds, run in this order")
    ap.add_argument("--stages", type=int, default=3, help="stage miners (blocks) of the swarm")
    ap.add_argument("--duration", type=float, default=300.0, help="seconds each run may take to catch its cheater")
    ap.add_argument("--stage-challenges", type=int, default=2, help="validator challenges per stage per round")
    ap.add_argument("--tempo", type=int, default=20, help="devnet blocks per epoch (weights once per epoch)")
    ap.add_argument("--work-dir", type=Path, default=None, help="run directories kept here (default: a temp dir)")
    ap.add_argument("--json", type=Path, default=None, help="also write the rows as JSON here")
    args = ap.parse_args(argv)
    kinds = [k.strip() for k in args.cheats.split(",") if k.strip()]
    bad = [k for k in kinds if k not in STAGE_CHEATS + DRIVER_CHEATS]
    if bad:
        ap.error(f"unknown cheater(s) {bad}; choose from {', '.join(STAGE_CHEATS + DRIVER_CHEATS)}")
    with tempfile.TemporaryDirectory(prefix="bench-swarm-cheaters-") as tmp:
        work = args.work_dir or Path(tmp)
        rows = []
        for kind in kinds:
            rows.append(run_one(kind, work, args.stages, args.duration, args.stage_challenges, args.tempo))
            r = rows[-1]
            print(f"[bench] {kind}: {'blamed' if r['blamed'] else 'NOT blamed'} after {r['challenges']} challenges"
                  f" in {r['run_s']:.0f} s of run", flush=True)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))
    print(table(rows))
    return 0 if all(r["blamed"] and not r["honest_blamed"] for r in rows) else 1


__all__ = ["main", "run_one", "table"]


if __name__ == "__main__":
    sys.exit(main())
