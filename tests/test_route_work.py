"""The settings around the validator's route work endpoint (no processes; the endpoint itself over HTTP is in
tests/test_stage_rounds.py): the route miner's --report-work HOTKEY@URL and the validator's --stage-work-port are
checked with clear messages, and a claim's schema holds its bounds."""
import pytest
from bittensor.sp_core import Keypair

from neurons.swarm.settings import read_route_miner_settings
from neurons.validator_app.settings import read_validator_settings
from protocol.route_work import MAX_STEP_TOKENS, MAX_WORK_STEPS, RouteWork
from protocol.stage import StageWireError, parse_model

HOTKEY = Keypair.create_from_uri("//validator").ss58_address


def route_miner(*more):
    return read_route_miner_settings(["--checkpoint", "/ckpt", "--netuid", "2", *more], {}, prog="route-test")


def test_report_work_takes_the_validators_hotkey_and_url():
    s = route_miner("--report-work", f"{HOTKEY}@http://127.0.0.1:9400", "--report-work-s", "2")
    assert (s.route.report_work, s.route.report_work_s) == (f"{HOTKEY}@http://127.0.0.1:9400", 2.0)
    assert not any("--report-work" in p for p in s.problems())
    for bad in ("http://127.0.0.1:9400", f"{HOTKEY}@127.0.0.1:9400", "nokey@http://127.0.0.1:9400",
                f"{HOTKEY}@ftp://x:1"):
        problems = route_miner("--report-work", bad).problems()
        assert any("is not HOTKEY@http(s)://HOST:PORT" in p for p in problems), (bad, problems)
    with pytest.raises(SystemExit):
        route_miner("--report-work-s", "0")


def test_stage_work_port_is_its_own_port(tmp_path):
    def validator(*more):
        return read_validator_settings(["--checkpoint", "/ckpt", "--reference-engine", "--netuid", "1", *more],
                                       environ={})

    assert validator().stages.work_port is None  # off unless asked for
    assert validator("--stage-work-port", "0").stages.work_port == 0
    s = validator("--stage-work-port", "9400", "--stage-sink-port", "9400", "--stage-sink-url", "http://1.2.3.4:9400")
    assert any("--stage-work-port 9400 is also --stage-sink-port" in p for p in s.stages.problems())
    s = validator("--stage-work-port", "9401", "--stage-decoys", "3-5:9401", "--stage-decoy-hotkey", "decoy")
    assert any("port 9401 is used twice" in p for p in s.stages.problems())
    with pytest.raises(SystemExit):
        validator("--stage-work-port", "70000")


def test_a_claim_holds_its_bounds():
    receipt = {"route_id": "r", "session": "s", "step": 0, "layers": [0, 3], "fingerprint": "f",
               "input_sha256": "0" * 64, "output_sha256": "1" * 64, "stage": HOTKEY, "driver": HOTKEY,
               "signature": "ab"}
    step = {"route_id": "r", "session": "s", "step": 0, "position": 0, "token_ids": [1, 2], "receipts": [receipt]}
    work = parse_model(RouteWork, {"steps": [step]}, "route work")
    assert work.tokens() == 2
    for bad, field in (({"steps": [step] * (MAX_WORK_STEPS + 1)}, "steps"),
                       ({"steps": [{**step, "token_ids": [1] * (MAX_STEP_TOKENS + 1)}]}, "token_ids"),
                       ({"steps": [{**step, "token_ids": [-1]}]}, "token_ids"),
                       ({"steps": [{**step, "receipts": []}]}, "receipts"),
                       ({"steps": [{**step, "session": "a b"}]}, "session"),
                       ({"steps": [step], "extra": 1}, "extra")):
        with pytest.raises(StageWireError) as err:
            parse_model(RouteWork, bad, "route work")
        assert err.value.status == 400 and field in err.value.message, (field, err.value.message)
