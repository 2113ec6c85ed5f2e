"""End to end: short local testnets as an operator runs them (devnet, miners, a validator; the swarm, honest
and with cheating stages)."""
import json
import subprocess
import sys
from pathlib import Path

import psutil

from neurons.localnet import free_port_block

ROOT = Path(__file__).resolve().parents[1]


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


def test_localnet_swarm_serves_the_models_greedy_answer_through_a_route(tmp_path):
    """`--swarm 3`: stage miners announce their blocks on the devnet, the route miner finds them there, and the
    completion it serves is the single-process model's greedy output."""
    import torch

    from inference.serving.builders import load_reference_model
    from neurons.localnet import SWARM_PROMPT
    from protocol.stage import StageAnnouncement

    run_dir, summary = tmp_path / "run", tmp_path / "summary.json"
    cmd = [sys.executable, "scripts/localnet.py", "--swarm", "3", "--swarm-tokens", "6", "--run-dir", str(run_dir),
           "--summary", str(summary), "--no-dashboard", "--base-port", str(free_port_block(5))]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    state = json.loads(summary.read_text())

    model, _, _ = load_reference_model(ROOT / "checkpoints" / "tiny", verify=False)
    cache, want = model.new_cache(), []
    with torch.no_grad():
        logits = model.forward([torch.tensor(SWARM_PROMPT)], [cache])[0]
        for _ in range(6):
            want.append(int(torch.argmax(logits)))
            logits = model.forward([torch.tensor([want[-1]])], [cache])[0]
    assert state["completion"]["tokens"] == want and state["completion"]["match"] is True

    stages = {s["name"]: s for s in state["stages"]}
    assert set(stages) == {"stage0", "stage1", "stage2", "spare"}
    assert [stages[f"stage{i}"]["layers"] for i in range(3)] == ["0-2", "3-8", "9-12"]  # block boundaries (size 3)
    assert stages["spare"]["layers"] == stages["stage1"]["layers"]
    for s in stages.values():  # each announced itself on chain: the commitment names its block and fingerprint
        a = StageAnnouncement.parse(s["announced"])
        assert (a.start, a.stop - 1) == tuple(int(x) for x in s["layers"].split("-"))
        assert a.fingerprint == s["fingerprint"] and s["uid"] is not None
    route = state["completion"]["route"]
    assert [r["layers"] for r in route] == ["0-2", "3-8", "9-12"]

    leftovers = [p for p in psutil.process_iter(["cmdline"]) if str(run_dir) in " ".join(p.info["cmdline"] or [])]
    assert not leftovers, [p.info["cmdline"] for p in leftovers]


# --swarm with cheating stage miners: two cheaters on blocks 1 (3-8) and 2 (9-12); stage0 (0-2) honest in bf16
SWARM_CHEATS = ("other-weights", "replay")
ROUTE_REFRESH_S = 2.0  # the route miner's --refresh-s in localnet


def test_localnet_swarm_blames_each_cheater_and_keeps_serving_through_the_spares(tmp_path):
    """`--swarm 3 --cheat-stage other-weights --cheat-stage replay --stop-when-caught` as an operator runs it:
    stage miners as real processes (honest fp32, honest bf16 with a bf16 wire, two cheaters on different blocks,
    an honest spare for each cheated block), the route miner following the validator's trust, a validator with
    its own copy of the weights challenging every stage, organic requests through the route miner all along; the
    run stops as soon as every cheater is blamed and zeroed on chain."""
    run_dir, summary = tmp_path / "run", tmp_path / "summary.json"
    cmd = [sys.executable, "scripts/localnet.py", "--swarm", "3", "--run-dir", str(run_dir), "--summary",
           str(summary), "--no-dashboard", "--base-port", str(free_port_block(7)), "--tempo", "20",
           "--stop-when-caught", "--duration", "300"]
    cmd += [a for kind in SWARM_CHEATS for a in ("--cheat-stage", kind)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=480)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-3000:]
    state = json.loads(summary.read_text())
    assert state["caught"] is True and state["cheat_stages"] == list(SWARM_CHEATS)

    stages = {s["name"]: s for s in state["stages"]}
    assert set(stages) == {"stage0", "stage1", "stage2", "spare", "spare1"}
    cheaters = {s["cheat"]: s for s in stages.values() if s["cheat"]}
    assert set(cheaters) == set(SWARM_CHEATS)
    assert cheaters["other-weights"]["layers"] == "3-8" and cheaters["replay"]["layers"] == "9-12"
    assert {stages["spare"]["layers"], stages["spare1"]["layers"]} == {"3-8", "9-12"}
    for kind, s in cheaters.items():  # blamed for what it returned, zeroed in the weights set after the blame
        blame = s["blame"]
        assert s["blamed"] and s["weight"] == 0.0, (kind, s)
        assert blame["kind"] in ("challenge", "bisection"), (kind, blame)
        assert any(w in s["reason"] for w in ("diverge", "replays")), (kind, s["reason"])
        assert blame["challenges"] <= 3, (kind, blame)
    honest = [s for s in stages.values() if not s["cheat"]]
    assert {s["dtype"] for s in honest} == {"float32", "bfloat16"} and stages["stage0"]["dtype"] == "bfloat16"
    for s in honest:  # fp32 and bf16 alike: checked, never blamed, paid
        assert not s["blamed"] and s["reason"] is None, s
        assert s["challenges"] >= 1 and s["failed"] == 0 and s["verified_tokens"] > 0 and s["weight"] > 0, s

    # organic traffic never failed, and once the cheaters were blamed it went through the spares
    organic = state["organic"]
    assert len(organic) >= 3 and all(o["ok"] for o in organic), [o for o in organic if not o["ok"]]
    blamed = {s["hotkey"] for s in cheaters.values()}
    last_blame = max(s["blame"]["at"] for s in cheaters.values())
    # the run may stop within one route refresh of the last blame: every route planned once the route miner
    # has had time to see the blame avoids the blamed stages, and so does the last one planned
    settled = [r for r in state["routes"] if r["at"] > last_blame + 2 * ROUTE_REFRESH_S + 1.0]
    assert all(not blamed & set(r["route"]) for r in settled), settled
    last_route = state["routes"][-1]
    assert not blamed & set(last_route["route"]), (last_blame, state["routes"][-3:])
    spares = {stages["spare"]["hotkey"], stages["spare1"]["hotkey"]}
    after = [o for o in organic if o["at"] > last_blame and not blamed & set(o["route"])]
    assert after and spares <= set(after[-1]["route"]), after

    leftovers = [p for p in psutil.process_iter(["cmdline"]) if str(run_dir) in " ".join(p.info["cmdline"] or [])]
    assert not leftovers, [p.info["cmdline"] for p in leftovers]


def test_swarm_cheaters_go_on_distinct_blocks_each_with_a_spare(tmp_path, capsys):
    """The layout `--cheat-stage` asks for, without starting anything: cheater i on block (N // 2 + i) mod N, an
    honest spare per cheated block, one honest bf16 stage; the kinds are the stage cheaters there are; bad
    combinations are refused with a message."""
    import pytest

    from neurons.localnet import STAGE_CHEATS, parse_args, swarm_neurons
    from neurons.swarm.cheats import CHEATS

    assert set(STAGE_CHEATS) == set(CHEATS)
    args = parse_args(["--swarm", "3", "--cheat-stage", "echo", "--cheat-stage", "replay", "--cheat-stage", "forwarder"])
    stages = [n for n in swarm_neurons(args, tmp_path / "wallets") if n.role == "stage"]
    by_name = {n.name: n for n in stages}
    assert [(by_name[f"stage{i}"].layers, by_name[f"stage{i}"].cheat) for i in range(3)] == \
        [("0-2", "forwarder"), ("3-8", "echo"), ("9-12", "replay")]
    assert sorted(n.layers for n in stages if n.name.startswith("spare")) == ["0-2", "3-8", "9-12"]
    assert [n.name for n in stages if n.dtype == "bfloat16"] == ["spare2"]  # every stage0..2 cheats here
    assert len({n.port for n in stages}) == len(stages)

    one = [n for n in swarm_neurons(parse_args(["--swarm", "3", "--cheat-stage", "skip-layer"]), tmp_path / "w1")
           if n.role == "stage"]
    assert [(n.name, n.layers, n.cheat, n.dtype) for n in one] == [
        ("stage0", "0-2", "", "float32"), ("stage1", "3-8", "skip-layer", "float32"),
        ("stage2", "9-12", "", "bfloat16"), ("spare", "3-8", "", "float32")]

    for argv, message in ((["--cheat-stage", "echo"], "go with --swarm"),
                          (["--swarm", "2", "--cheat-stage", "echo", "--cheat-stage", "echo", "--cheat-stage", "echo"],
                           "one cheater per block"),
                          (["--swarm", "3", "--stop-when-caught"], "needs at least one --cheat-stage"),
                          (["--swarm", "3", "--cheat-stage", "lazy"], "invalid choice")):
        with pytest.raises(SystemExit):
            parse_args(argv)
        assert message in capsys.readouterr().err
