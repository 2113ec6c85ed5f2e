"""End to end: short local testnets as an operator runs them (devnet, miners, a validator; the swarm, honest
and with cheating stages)."""
import json
import re
import shlex
import subprocess
import sys
from pathlib import Path

import psutil

from chain.__main__ import main as chain_main
from localnet.testnet import GATEWAY_ROUTE_UID, ROUTE_SETTLE_S, free_port_block, swarm_ports

ROOT = Path(__file__).resolve().parents[1]


GUIDE = ROOT / "docs" / "local-node.md"


def guide_commands() -> list[list[str]]:
    """The commands of the local-node guide's devnet rehearsal, in order, as a person would type them."""
    section = GUIDE.read_text().split("## Rehearse it on the embedded devnet", 1)[1]
    block = re.search(r"```bash\n(.*?)```", section, flags=re.S).group(1)
    return [shlex.split(line) for line in block.splitlines() if line.strip()]


def test_the_local_node_guide_walked_on_the_devnet_sets_weights_and_the_cheater_earns_nothing(tmp_path, monkeypatch,
                                                                                            capsys):
    """docs/local-node.md's devnet rehearsal as written: k3-chain creates the devnet, wallets, registrations and
    stake, then k3-localnet runs on them (real-node mode, with --network devnet:PATH) until an epoch after the first
    weights. Its output is piped, as `k3-localnet ... | tee log` would be: the log must be plain lines."""
    *setup, localnet = guide_commands()
    assert {words[0] for words in setup} == {"k3-chain"} and localnet[0] == "scripts/localnet.sh"
    monkeypatch.chdir(tmp_path)
    for words in setup:
        assert chain_main(words[1:]) == 0, f"{' '.join(words)}: {capsys.readouterr().err}"
    run_dir = tmp_path / "run"
    summary = tmp_path / "summary.json"
    metrics = free_port_block(3)
    cmd = [sys.executable, "-m", "localnet.testnet", *localnet[1:], "--run-dir", str(run_dir), "--summary", str(summary),
           "--base-port", str(free_port_block(2)), "--metrics-base-port", str(metrics)]
    proc = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=540)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    # a readable log: whole lines (no table wrapped into cells, no escape codes), one row per miner and refresh
    for line in proc.stdout.splitlines() + proc.stderr.splitlines():
        assert line.startswith(("[localnet] ", "  miner")) and "\x1b" not in line and "│" not in line, line
    rows = [line for line in proc.stdout.splitlines() if line.startswith("  miner1 ")]
    assert rows and "(cheat: inflate, up)" in rows[-1] and "weight 0.000" in rows[-1], rows[-1:]
    # the validator's metrics port follows the miners' (it moves with --base-port / --metrics-base-port)
    assert f"metrics on http://127.0.0.1:{metrics + 2}/metrics" in (run_dir / "logs" / "validator.log").read_text()
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
    completion it serves is the single-process model's greedy output. Then the operator presses Ctrl-C, and again
    and again while it stops: the first starts the shutdown, the others are ignored until every process it started
    has stopped (none is left holding its port), and it writes its summary without a traceback."""
    import signal
    import time

    import torch

    from inference.serving.builders import load_reference_model
    from localnet.testnet import SWARM_PROMPT
    from protocol.stage import StageAnnouncement

    run_dir, summary = tmp_path / "run", tmp_path / "summary.json"
    cmd = [sys.executable, "-m", "localnet.testnet", "--swarm", "3", "--swarm-tokens", "6", "--run-dir", str(run_dir),
           "--summary", str(summary), "--no-dashboard", "--base-port", str(free_port_block(swarm_ports(3))),
           "--duration", "600"]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    seen = []
    try:
        for line in proc.stdout:  # up to the completion: every process is up
            seen.append(line)
            if "completion through" in line:
                break
        time.sleep(2.0)  # into the watch
        deadline = time.monotonic() + 5.0
        while proc.poll() is None and time.monotonic() < deadline:  # Ctrl-C, and again, while it stops
            proc.send_signal(signal.SIGINT)
            time.sleep(0.1)
        seen.append(proc.communicate(timeout=120)[0])
    finally:
        if proc.poll() is None:
            proc.kill()
    text = "".join(seen)
    leftovers = [p for p in psutil.process_iter(["cmdline"]) if str(run_dir) in " ".join(p.info["cmdline"] or [])]
    for p in leftovers:  # not left to the rest of the suite
        p.kill()
    assert not leftovers, (text[-3000:], [p.info["cmdline"] for p in leftovers])
    assert proc.returncode == 0 and "Traceback" not in text, text[-3000:]
    state = json.loads(summary.read_text())

    model, _, _ = load_reference_model(ROOT / "checkpoints" / "tiny-trained", verify=False)  # the default model
    assert model.config.model_id == "kimi-k3-tiny-trained"
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


# --swarm with cheaters: three cheating stages, on blocks 1 (3-8), 2 (9-12) and 0 (0-2), each with an honest spare
# (the last, 9-12, in bf16), and the route miner as a cheating route driver
SWARM_CHEATS = ("other-weights", "replay", "forwarder", "forge-receipts")


def test_localnet_swarm_blames_each_cheater_and_keeps_serving_through_the_spares(tmp_path):
    """`--swarm 3 --cheat-stage other-weights --cheat-stage replay --cheat-stage forwarder --cheat-stage
    forge-receipts --stop-when-caught` as an operator runs it: stage miners as real processes (three cheaters on
    different blocks, an honest spare for each, fp32 and bf16 with a bf16 wire), the route miner following the
    validator's trust and submitting forged receipts beside its real ones, a validator with its own copy of the
    weights driving sessions through the stages and checking them after they ran, serving a decoy of the
    forwarder's block and taking the route miner's receipts at its work endpoint, organic requests through the validator's organic gateway (its own route of the
    stages, following its blames) all along; the run stops as soon as every cheater is blamed and zeroed on
    chain."""
    run_dir, summary = tmp_path / "run", tmp_path / "summary.json"
    cmd = [sys.executable, "-m", "localnet.testnet", "--swarm", "3", "--run-dir", str(run_dir), "--summary",
           str(summary), "--no-dashboard", "--base-port", str(free_port_block(swarm_ports(3))), "--tempo", "20",
           "--stop-when-caught", "--duration", "300",
           # the forwarder takes the decoy for a session with probability 1/2
           "--stage-sessions", "3"]
    cmd += [a for kind in SWARM_CHEATS for a in ("--cheat-stage", kind)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=480)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-3000:]
    state = json.loads(summary.read_text())
    assert state["caught"] is True and state["cheat_stages"] == list(SWARM_CHEATS)

    stages = {s["name"]: s for s in state["stages"]}
    assert set(stages) == {"stage0", "stage1", "stage2", "spare", "spare1", "spare2"}
    cheaters = {s["cheat"]: s for s in stages.values() if s["cheat"]}
    assert set(cheaters) == {"other-weights", "replay", "forwarder"}
    assert [cheaters[k]["layers"] for k in ("other-weights", "replay", "forwarder")] == ["3-8", "9-12", "0-2"]
    assert sorted(stages[n]["layers"] for n in ("spare", "spare1", "spare2")) == ["0-2", "3-8", "9-12"]
    for kind, s in cheaters.items():  # blamed, zeroed in the weights set after the blame
        assert s["blamed"] and s["weight"] == 0.0, (kind, s)
    for kind in ("other-weights", "replay"):  # for what they returned
        blame, reason = cheaters[kind]["blame"], cheaters[kind]["reason"]
        assert blame["kind"] in ("verdict", "session_lie"), (kind, blame)
        assert any(w in reason for w in ("honest", "replays", "pass-through")), (kind, reason)
        # benchmarks/swarm_cheaters.py measured a handful of checked sessions to blame (docs/verification.md)
        assert blame["sessions"] <= 8, (kind, blame)
    # the forwarder's answers are right (the honest spare's or the decoy's): the decoy catches it
    forwarder = cheaters["forwarder"]
    assert forwarder["blame"]["kind"] == "decoy" and "without saying so" in forwarder["reason"], forwarder
    # the route driver claimed receipts the stages never signed: blamed for it and zeroed, no stage credited
    driver = state["driver"]
    assert driver["cheat"] == "forge-receipts" and driver["blamed"] and driver["weight"] == 0.0, driver
    assert driver["blame"]["kind"] == "route_receipts" and "not signed by" in driver["reason"], driver
    assert driver["credited_tokens"] == 0 and all(s["route_work_tokens"] == 0 for s in stages.values())
    honest = [s for s in stages.values() if not s["cheat"]]
    assert {s["dtype"] for s in honest} == {"float32", "bfloat16"} and stages["spare2"]["dtype"] == "bfloat16"
    for s in honest:  # fp32 and bf16 alike: checked, never blamed (by a check or the decoy), paid (the run stops
        # only then)
        assert not s["blamed"] and s["reason"] is None, s
        assert s["checked"] >= 1 and s["verified_tokens"] > 0 and s["weight"] > 0, s

    # organic traffic through the validator's gateway never failed, and once the cheaters were blamed it went
    # through the spares
    organic = state["organic"]
    assert len(organic) >= 3 and all(o["ok"] for o in organic), [o for o in organic if not o["ok"]]
    blamed = {s["hotkey"] for s in cheaters.values()}
    last_blame = max(s["blame"]["at"] for s in [*cheaters.values(), driver])
    # the run stops only after a request sent ROUTE_SETTLE_S after the last blame was served by the gateway's own
    # route (by then it has re-read the validator's blames): every route it planned from then on, the last one
    # included, avoids the blamed stages, and that request went through the three spares
    routes = state["gateway_routes"]
    assert routes and all(len(r["route"]) == 3 for r in routes), routes
    settled = [r for r in routes if r["at"] > last_blame + ROUTE_SETTLE_S]
    assert settled and all(not blamed & set(r["route"]) for r in settled), settled
    assert routes[-1] in settled
    spares = {stages[n]["hotkey"] for n in ("spare", "spare1", "spare2")}
    after = [o for o in organic if o["at"] > last_blame + ROUTE_SETTLE_S]
    assert after and all(o["miner_uid"] == GATEWAY_ROUTE_UID and set(o["route"]) == spares for o in after), after
    assert any(o["at"] < last_blame for o in organic), organic  # served while a cheater was still being caught

    leftovers = [p for p in psutil.process_iter(["cmdline"]) if str(run_dir) in " ".join(p.info["cmdline"] or [])]
    assert not leftovers, [p.info["cmdline"] for p in leftovers]


def test_swarm_cheaters_go_on_distinct_blocks_each_with_a_spare(tmp_path, capsys):
    """The layout `--cheat-stage` asks for, without starting anything: cheater i on block (N // 2 + i) mod N, an
    honest spare per cheated block, one honest bf16 stage; the kinds are the stage cheaters there are; bad
    combinations are refused with a message."""
    import pytest

    from localnet.cheats.stage import CHEATS
    from localnet.testnet import STAGE_CHEATS, parse_args, swarm_neurons

    assert set(STAGE_CHEATS) == set(CHEATS) - {"pair-cover-echo"}  # the pair's first half, started by pair-cover
    args = parse_args(["--swarm", "3", "--cheat-stage", "echo", "--cheat-stage", "replay", "--cheat-stage", "forwarder"])
    stages = [n for n in swarm_neurons(args, tmp_path / "wallets") if n.role == "stage"]
    by_name = {n.name: n for n in stages}
    assert [(by_name[f"stage{i}"].layers, by_name[f"stage{i}"].cheat) for i in range(3)] == \
        [("0-2", "forwarder"), ("3-8", "echo"), ("9-12", "replay")]
    assert sorted(n.layers for n in stages if n.name.startswith("spare")) == ["0-2", "3-8", "9-12"]
    assert [n.name for n in stages if n.dtype == "bfloat16"] == ["spare2"]  # every stage0..2 cheats here
    assert len({n.port for n in stages}) == len(stages)

    # the forwarder is given the validator's decoy of its block among its targets; the route miner forges receipts
    # and submits them to the validator's work endpoint
    from localnet.testnet import DRIVER_CHEATS, GATEWAY_KEY, route_command, stage_command, swarm_validator_command

    args = parse_args(["--swarm", "3", "--cheat-stage", "forwarder", "--cheat-stage", "forge-receipts",
                       "--base-port", "20000"])
    neurons = swarm_neurons(args, tmp_path / "w2")
    validator, route = neurons[0], neurons[-1]
    forwarder = next(n for n in neurons if n.cheat == "forwarder")
    ports = [n.port for n in neurons if n.port] + [forwarder.decoy_port, validator.gateway_port]
    assert len(set(ports)) == len(ports) and max(ports) < 20000 + swarm_ports(3) and forwarder.layers == "3-8"
    assert route.cheat == "forge-receipts" and set(DRIVER_CHEATS) == {"forge-receipts", "self-driver"}
    run = tmp_path / "run"
    run.mkdir()
    cmd = stage_command(forwarder, args, "devnet:x", 1, run, neurons)
    assert f"http://127.0.0.1:{forwarder.decoy_port}" in cmd and \
        f"http://127.0.0.1:{next(n.port for n in neurons if n.name == 'spare')}" in cmd
    vcmd = swarm_validator_command(validator, args, "devnet:x", 1, run, neurons)
    assert vcmd[vcmd.index("--stage-decoys") + 1] == f"3-8:{forwarder.decoy_port}"
    assert vcmd[vcmd.index("--stage-work-port") + 1] == str(validator.port) and "--stage-decoy-hotkey" in vcmd
    # the organic traffic goes to the validator's gateway, served first through its own route of the stages
    assert vcmd[vcmd.index("--gateway-port") + 1] == str(validator.gateway_port) and "--gateway" in vcmd
    assert vcmd[vcmd.index("--gateway-route") + 1] == "first" and "--gateway-route-log" in vcmd
    assert (run / "gateway-keys.txt").read_text().split() == [GATEWAY_KEY]
    from neurons.validator_app.gateway_route import ROUTE_UID
    assert GATEWAY_ROUTE_UID == str(ROUTE_UID)  # what the gateway's x-k3-miner-uid says for its own route
    rcmd = route_command(route, args, "devnet:x", 1, run, validator)
    assert rcmd[2] == "localnet.cheats.route"
    assert rcmd[rcmd.index("--report-work") + 1] == f"{validator.wallet.hotkey.ss58_address}@http://127.0.0.1:" \
                                                   f"{validator.port}"

    one = [n for n in swarm_neurons(parse_args(["--swarm", "3", "--cheat-stage", "skip-layer"]), tmp_path / "w1")
           if n.role == "stage"]
    assert [(n.name, n.layers, n.cheat, n.dtype) for n in one] == [
        ("stage0", "0-2", "", "float32"), ("stage1", "3-8", "skip-layer", "float32"),
        ("stage2", "9-12", "", "bfloat16"), ("spare", "3-8", "", "float32")]

    for argv, message in ((["--cheat-stage", "echo"], "go with --swarm"),
                          (["--swarm", "2", "--cheat-stage", "echo", "--cheat-stage", "echo", "--cheat-stage", "echo"],
                           "one cheater per block"),
                          (["--swarm", "3", "--stop-when-caught"], "needs at least one --cheat-stage"),
                          (["--swarm", "3", "--cheat-stage", "lazy"], "invalid choice"),
                          (["--swarm", "2", "--cheat-stage", "echo", "--cheat-stage", "echo", "--cheat-stage", "echo",
                            "--cheat-stage", "forge-receipts"], "one cheater per block")):
        with pytest.raises(SystemExit):
            parse_args(argv)
        assert message in capsys.readouterr().err


def test_the_trained_model_is_the_default_and_the_random_one_stays_a_flag_away(tmp_path):
    """--model trained (the default in a checkout) copies the shipped asset into --checkpoints, renewed when the
    asset changes; the weights cheat gets random weights of the same configuration; --model random is the seed-0
    random model as before. Nothing is written into the package's asset directory."""
    from inference.model.config import ModelConfig
    from localnet.testnet import TRAINED_ASSET, checkpoint_dir, ensure_checkpoints, parse_args

    asset_before = {p.name: p.stat().st_mtime_ns for p in TRAINED_ASSET.iterdir()}
    args = parse_args(["--checkpoints", str(tmp_path), "--cheat", "weights"])
    assert args.model == "trained" and checkpoint_dir(args) == tmp_path / "tiny-trained"
    ensure_checkpoints(args)
    honest, other = checkpoint_dir(args), checkpoint_dir(args, cheat_weights=True)
    assert (honest / "k3_manifest.json").read_text() == (TRAINED_ASSET / "k3_manifest.json").read_text()
    assert ModelConfig.from_file(other) == ModelConfig.from_file(honest) == ModelConfig.tiny_trained()
    assert json.loads((other / "k3_manifest.json").read_text())["fingerprint"] != \
        json.loads((honest / "k3_manifest.json").read_text())["fingerprint"]
    (honest / "k3_manifest.json").write_text("{}")  # a stale copy is renewed
    ensure_checkpoints(args)
    assert (honest / "k3_manifest.json").read_text() == (TRAINED_ASSET / "k3_manifest.json").read_text()
    assert {p.name: p.stat().st_mtime_ns for p in TRAINED_ASSET.iterdir()} == asset_before

    random_args = parse_args(["--checkpoints", str(tmp_path), "--model", "random"])
    assert checkpoint_dir(random_args) == tmp_path / "tiny"
    assert checkpoint_dir(random_args, cheat_weights=True) == tmp_path / "tiny-seed1"


def test_whole_model_layout_with_bf16_miners_and_a_sampling_cheat(tmp_path, capsys):
    """`--miners 4 --sharded-miners 1 --bf16-miners 1 --cheat KIND`: miner0 fp32, miner1 sharded, miner2 bf16,
    miner3 the cheater (in bf16 when it claims bf16 numerics); the sampling cheats are those localnet/cheats/miner.py
    runs; --stop-when-caught works on whole-model miners with a cheater."""
    import pytest

    from localnet.cheats.miner import SAMPLING_CHEATS as RUN
    from localnet.testnet import SAMPLING_CHEATS, Neuron, honest_kind, miner_command, parse_args

    assert SAMPLING_CHEATS == RUN
    args = parse_args(["--miners", "4", "--sharded-miners", "1", "--bf16-miners", "1", "--cheat",
                       "coarse-experts-for-sampled", "--stop-when-caught"])
    assert [honest_kind(i, args) for i in range(3)] == ["reference", "sharded x2", "reference bf16"]
    wallet = type("Wallet", (), {"name": "m", "path": str(tmp_path)})()  # what the command reads of a wallet
    commands = {}
    for kind in ("reference", "reference bf16", "cheat: coarse-experts-for-sampled"):
        n = Neuron("m", "miner", wallet, port=1, kind=kind)
        commands[kind] = miner_command(n, 0, args, "devnet:x", 1, tmp_path)
    assert "--dtype" not in commands["reference"]
    assert commands["reference bf16"][-2:] == ["--dtype", "bfloat16"]
    cheat = commands["cheat: coarse-experts-for-sampled"]
    assert cheat[2] == "localnet.cheats.miner" and "bfloat16" in cheat and "coarse-experts-for-sampled" in cheat
    for argv, message in ((["--stop-when-caught", "--cheat", "none"], "needs a --cheat other than none"),
                          (["--miners", "3", "--sharded-miners", "1", "--bf16-miners", "2"], "must leave the last")):
        with pytest.raises(SystemExit):
            parse_args(argv)
        assert message in capsys.readouterr().err

