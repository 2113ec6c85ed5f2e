"""End to end: a short local testnet (devnet, two miners, one validator, one epoch) as an operator runs it."""
import json
import socket
import subprocess
import sys
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parents[1]


def free_port_block(n: int) -> int:
    """A base port with n consecutive free ports after it."""
    for _ in range(50):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            base = s.getsockname()[1]
        if base + n >= 65535:
            continue
        ok = True
        for p in range(base, base + n):
            with socket.socket() as t:
                try:
                    t.bind(("127.0.0.1", p))
                except OSError:
                    ok = False
                    break
        if ok:
            return base
    raise RuntimeError("no block of free ports")


def test_localnet_sets_weights_and_the_cheater_earns_nothing(tmp_path):
    run_dir = tmp_path / "run"
    summary = tmp_path / "summary.json"
    cmd = [sys.executable, "scripts/localnet.py", "--miners", "2", "--sharded-miners", "0", "--cheat", "inflate",
           "--run-dir", str(run_dir), "--summary", str(summary), "--no-dashboard",
           "--base-port", str(free_port_block(2)), "--metrics-base-port", str(free_port_block(2)),
           "--stop-after-epochs", "1", "--duration", "420"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=540)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    state = json.loads(summary.read_text())
    rows = {r["name"]: r for r in state["rows"]}
    honest, cheater = rows["miner0"], rows["miner1"]
    assert cheater["kind"] == "cheat: inflate"

    first = state["first_weights"]
    assert first is not None, "the validator never set weights:\n" + proc.stdout[-3000:]
    weights = {int(uid): w for uid, w in first["row"].items()}
    assert weights.get(honest["uid"], 0) > 0
    assert weights.get(cheater["uid"], 0) == 0

    epochs = state["epochs_after_weights"]
    assert epochs, "no epoch ran after the first weights"
    incentive = {int(uid): v for uid, v in epochs[0]["incentive"].items()}
    assert incentive[cheater["uid"]] == 0.0
    assert incentive[honest["uid"]] > 0.0

    # every process the local testnet started is gone
    leftovers = [p for p in psutil.process_iter(["cmdline"]) if str(run_dir) in " ".join(p.info["cmdline"] or [])]
    assert not leftovers, [p.info["cmdline"] for p in leftovers]
    assert (run_dir / "logs" / "validator.log").exists() and (run_dir / "logs" / "miner0.log").exists()
