"""The service files in deploy/ (systemd units with their environment files, the pm2 ecosystem file, the compose
file of a real miner) start the programs with settings the programs accept: each command line and each environment
file goes through the program's own option parser, every variable is one the program reads, and the stop timeouts
leave the miner its shutdown grace. (systemd, pm2 and Docker themselves are not on the test machine.)"""
import configparser
import json
import shlex
from pathlib import Path

import pytest
import yaml

from neurons.base.settings import read_options
from neurons.miner_app import miner_options, read_miner_settings
from neurons.validator_app.settings import read_validator_settings, validator_options

DEPLOY = Path(__file__).resolve().parent.parent / "deploy"
GRACE_S = 30.0  # the miner's default --shutdown-grace-s


def env_file(path: Path) -> dict[str, str]:
    """systemd's EnvironmentFile= format: VARIABLE=value lines, # comments."""
    out = {}
    for line in path.read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            name, _, value = line.partition("=")
            out[name] = value
    return out


def unit(path: Path) -> configparser.ConfigParser:
    parser = configparser.ConfigParser(strict=False, interpolation=None)
    parser.optionxform = str
    parser.read_string(path.read_text())
    return parser


def known_variables(options) -> set[str]:
    return {o.env for o in options if o.env} | {e for o in options for e in o.deprecated_env}


@pytest.mark.parametrize("name, read, options, command", [
    ("miner", read_miner_settings, miner_options, "k3-miner"),
    ("validator", read_validator_settings, validator_options, "k3-validator run"),
])
def test_the_systemd_units_start_the_program_with_their_environment_files(name, read, options, command):
    service = unit(DEPLOY / "systemd" / f"k3-{name}.service")["Service"]
    assert service["EnvironmentFile"] == f"/etc/k3-subnet/{name}.env"
    assert shlex.split(service["ExecStart"]) == [f"/opt/k3-subnet/.venv/bin/{command.split()[0]}", *command.split()[1:]]
    assert float(service["TimeoutStopSec"]) > GRACE_S and service["KillSignal"] == "SIGTERM"
    environment = env_file(DEPLOY / "systemd" / f"{name}.env")
    unknown = set(environment) - known_variables(options())
    assert not unknown, f"{name}.env sets variables {name} does not read: {unknown}"
    settings = read([], environ=environment)[0] if name == "miner" else read([], environ=environment)
    assert settings.chain.network == "finney" and settings.wallet.name == name


def problems_here(settings) -> list[str]:
    """What the settings say is wrong, less that this machine lacks the deployment's checkpoint directory."""
    return [p for p in settings.problems() if "is not a checkpoint directory" not in p]


def test_the_miner_environment_file_describes_a_miner_in_front_of_vllm():
    settings, _ = read_miner_settings([], environ=env_file(DEPLOY / "systemd" / "miner.env"))
    assert settings.engine.kind == "remote" and settings.engine.remote_url == "http://127.0.0.1:8000"
    assert settings.access.owner_hotkeys == ("bench",) and settings.server.external_ip
    assert problems_here(settings) == []


def test_the_pm2_apps_run_the_console_scripts_with_arguments_they_accept():
    apps = {app["name"]: app for app in json.loads((DEPLOY / "pm2" / "ecosystem.json").read_text())["apps"]}
    assert set(apps) == {"k3-miner", "k3-validator"}
    for name, app in apps.items():
        assert app["interpreter"] == "none" and app["script"] == f"/opt/k3-subnet/.venv/bin/{name}"
        assert app["kill_timeout"] > GRACE_S * 1000
        assert set(app["env"]) - {"PYTHONUNBUFFERED"} <= known_variables(miner_options())
    miner, _ = read_miner_settings(apps["k3-miner"]["args"], environ=apps["k3-miner"]["env"])
    assert miner.engine.kind == "remote" and problems_here(miner) == []
    run, *args = apps["k3-validator"]["args"]
    assert run == "run"
    validator = read_validator_settings(args, environ=apps["k3-validator"]["env"])
    assert validator.audits.canary_pool.endswith("canaries.json")


def test_the_compose_miner_waits_for_vllm_and_is_healthy_only_on_200():
    services = yaml.safe_load((DEPLOY / "compose" / "miner.yaml").read_text())["services"]
    miner, vllm = services["miner"], services["vllm"]
    assert miner["depends_on"]["vllm"]["condition"] == "service_healthy"
    assert miner["command"] == ["k3-miner"] and miner["env_file"] == "/srv/k3/miner.env"
    environment = {**env_file(DEPLOY / "systemd" / "miner.env"), **miner["environment"]}
    assert set(miner["environment"]) <= known_variables(miner_options())
    settings, _ = read_miner_settings([], environ=environment)
    assert settings.engine.remote_url == "http://vllm:8000" and settings.engine.remote_model in vllm["command"]
    assert "--max-model-len" in vllm["command"]
    served_context = int(vllm["command"][vllm["command"].index("--max-model-len") + 1])
    assert served_context >= settings.engine.settings.max_context  # else the miner refuses to start
    assert "/health" in " ".join(miner["healthcheck"]["test"])  # urlopen raises on the miner's 503
    assert float(miner["stop_grace_period"].rstrip("s")) > GRACE_S
    assert read_options(miner_options(), [], environ=environment)["server"]["metrics_host"] == "0.0.0.0"
