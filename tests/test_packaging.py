"""`pip install .` gives working console scripts: the project is built from a copy of its sources and
installed (not editable) into a fresh virtual environment, then every console script runs from an
unrelated directory, with no PYTHONPATH, so only the installed package can answer.

To stay fast the new environment borrows the test environment's third-party packages through a .pth
file (torch and bittensor are not reinstalled) and pip installs with --no-deps --no-build-isolation;
what is tested is the project's own packaging: its metadata, packages, package data and entry points.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("inference", "protocol", "scoring", "neurons", "chain", "benchmarks", "localnet")

# console script -> (arguments, text its output must contain)
SCRIPTS = {
    "k3": (["--help"], "generate"),
    "k3-miner": (["--help"], "--wallet-name"),
    "k3-validator": (["--help"], "run,status"),
    "k3-bench": (["--help"], "--miner"),
    "k3-plan": (["--help"], "--cluster"),
    "k3-chain": (["--help"], "devnet"),
    "k3-checkpoint": (["--help"], "--preset"),
    "k3-localnet": (["--help"], "--miners"),
}


def clean_env() -> dict[str, str]:
    """The environment without anything that would let the source tree be imported."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}
    env.update(PIP_NO_INDEX="1", PIP_DISABLE_PIP_VERSION_CHECK="1", OMP_NUM_THREADS="1")
    return env


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    """(venv, a working directory outside the source tree) with the project installed into venv."""
    base = tmp_path_factory.mktemp("packaging")
    source = base / "src"
    source.mkdir()
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        shutil.copy2(ROOT / name, source / name)
    for package in PACKAGES:
        shutil.copytree(ROOT / package, source / package, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))

    venv = base / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=60)
    python = venv / "bin" / "python"
    site = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          capture_output=True, text=True, check=True, timeout=30).stdout.strip()
    # A plain path line: the borrowed directory is searched, its own .pth files (the editable install
    # of the source tree) are not run.
    Path(site, "_borrowed_packages.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")

    proc = subprocess.run([str(python), "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation",
                           "--ignore-installed", str(source)],
                          capture_output=True, text=True, env=clean_env(), cwd=base, timeout=180)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    elsewhere = base / "elsewhere"
    elsewhere.mkdir()
    shutil.rmtree(source)  # what runs from now on can only come from the installed copy
    return venv, elsewhere


def test_every_entry_point_in_pyproject_is_tested():
    declared = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert set(declared) == set(SCRIPTS)


def test_installed_package_is_the_one_imported(installed):
    venv, elsewhere = installed
    code = ("import importlib.metadata as md, neurons, inference.planning, inference.version as v;"
            "print(neurons.__file__); print(md.version('k3-subnet'), v.__version__);"
            "print(md.metadata('k3-subnet')['Requires-Python']); print(md.metadata('k3-subnet')['License-Expression'])")
    out = subprocess.run([str(venv / "bin" / "python"), "-c", code], cwd=elsewhere, env=clean_env(),
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    location, versions, requires, license_ = out.stdout.strip().splitlines()
    assert Path(location).resolve().is_relative_to(venv.resolve()), location
    installed_version, code_version = versions.split()
    assert installed_version == code_version  # version is read from inference/version.py
    assert requires == ">=3.11" and license_ == "MIT"
    site = Path(location).parents[1]
    clusters = sorted(p.name for p in (site / "inference" / "planning" / "clusters").glob("*.yaml"))
    assert clusters == sorted(p.name for p in (ROOT / "inference" / "planning" / "clusters").glob("*.yaml"))
    assert list(site.glob("k3_subnet-*.dist-info/licenses/LICENSE"))


def test_console_scripts_answer_help_from_another_directory(installed):
    venv, elsewhere = installed
    env = clean_env()
    # All at once: each pays for importing torch and bittensor, and waiting on disk overlaps.
    running = {name: subprocess.Popen([str(venv / "bin" / name), *args], cwd=elsewhere, env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
               for name, (args, _) in SCRIPTS.items()}
    results = {}
    try:
        for name, proc in running.items():
            results[name] = (proc.communicate(timeout=240)[0], proc.returncode)
    finally:
        for proc in running.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=10)
    for name, (output, code) in results.items():
        expected = SCRIPTS[name][1]
        assert code == 0, f"{name} exited {code}:\n{output[-2000:]}"
        assert "usage:" in output and expected in output, f"{name}:\n{output[-2000:]}"
        # the usage line names the program as the user typed it
        assert usage_line(output).startswith(f"usage: {name} "), f"{name}: {usage_line(output)}"


def usage_line(output: str) -> str:
    return next((line for line in output.splitlines() if line.startswith("usage: ")), "(no usage line)")


def test_usage_lines_name_the_program_as_typed_from_the_source_tree():
    """`python neurons/miner.py`, `python -m neurons.miner`, `python -m chain`: each --help says so (never
    a file path inside a package, never another program's name)."""
    typed = {"python neurons/miner.py": ["neurons/miner.py", "--help"],
             "python -m neurons.miner": ["-m", "neurons.miner", "--help"],
             "python neurons/validator.py run": ["neurons/validator.py", "run", "--help"],
             "python -m neurons.validator status": ["-m", "neurons.validator", "status", "--help"],
             "python -m chain": ["-m", "chain", "--help"],
             "python -m inference": ["-m", "inference", "--help"]}
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    running = {name: subprocess.Popen([sys.executable, *args], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True) for name, args in typed.items()}
    try:
        outputs = {name: proc.communicate(timeout=240)[0] for name, proc in running.items()}
    finally:
        for proc in running.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=10)
    for name, output in outputs.items():
        assert re.match(rf"usage: {re.escape(name)}( |$)", usage_line(output)), f"{name}: {output[-2000:]}"


def test_planner_finds_a_shipped_cluster_by_name(installed):
    """The cluster files travel as package data: `--cluster b300_8` works without a checkout."""
    venv, elsewhere = installed
    proc = subprocess.run([str(venv / "bin" / "k3-plan"), "--model", "kimi_k3", "--cluster", "b300_8",
                           "--concurrency", "1", "--json"], cwd=elsewhere, env=clean_env(),
                          capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert '"' in proc.stdout and "b300" in proc.stdout.lower()
    bad = subprocess.run([str(venv / "bin" / "k3-plan"), "--model", "kimi_k3", "--cluster", "no_such_cluster"],
                         cwd=elsewhere, env=clean_env(), capture_output=True, text=True, timeout=180)
    assert bad.returncode == 2 and "b300_8" in bad.stderr  # the message lists the shipped clusters


def test_installed_localnet_sets_up_a_devnet_the_installed_chain_cli_reads(installed):
    """Beyond --help: k3-localnet --setup-only (compose.yaml's setup service) from the installed package
    copies the shipped trained tiny checkpoint, makes the devnet, wallets, registrations and stake; k3-chain
    reads them back."""
    venv, elsewhere = installed
    run_dir = elsewhere / "net"
    setup = [str(venv / "bin" / "k3-localnet"), "--setup-only", "--run-dir", str(run_dir), "--miners", "2",
             "--checkpoints", str(elsewhere / "checkpoints")]
    proc = subprocess.run(setup, cwd=elsewhere, env=clean_env(), capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    made = json.loads((run_dir / "localnet.json").read_text())
    # the wheel ships the trained tiny K3, so the installed localnet serves it (copied next to the run)
    assert (elsewhere / "checkpoints" / "tiny-trained" / "config.json").exists()
    assert not (elsewhere / "checkpoints" / "tiny").exists()
    meta = subprocess.run([str(venv / "bin" / "k3-chain"), "metagraph", "--db", str(run_dir / "devnet.sqlite"),
                           "--netuid", str(made["netuid"]), "--json"], cwd=elsewhere, env=clean_env(),
                          capture_output=True, text=True, timeout=120)
    assert meta.returncode == 0, meta.stderr[-2000:]
    neurons = {n["hotkey"]: n for n in json.loads(meta.stdout)["neurons"]}
    assert set(neurons) == {n["hotkey"] for n in made["neurons"]}
    validator = next(n for n in made["neurons"] if n["role"] == "validator")
    assert neurons[validator["hotkey"]]["stake"] > 0 and neurons[validator["hotkey"]]["validator_permit"]
    again = subprocess.run(setup, cwd=elsewhere, env=clean_env(), capture_output=True, text=True, timeout=240)
    assert again.returncode == 0 and "already set up" in again.stdout
    assert json.loads((run_dir / "localnet.json").read_text()) == made
