"""scripts/setup_venv.sh on a machine whose `python3` is 3.10 (Ubuntu 22.04): it picks a Python >= 3.11 found
elsewhere on PATH, or stops with one line saying how to get one; it rebuilds a .venv made with an older Python; it
names the torch build it installs. Run in its dry-run mode (K3_SETUP_DRY_RUN=1: everything up to the installs), with
a PATH of shims, so that nothing is installed."""
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PYTHON_310 = """#!/bin/sh
case "$1" in
  --version) echo "Python 3.10.12" ;;
  -c) echo 3.10.12; exit 1 ;;
  *) echo "python 3.10 stand-in" >&2; exit 1 ;;
esac
"""


@pytest.fixture
def machine(tmp_path):
    """A checkout's files the script reads, a bin/ whose python3 is 3.10, and a tools/ with the few commands the
    script's early steps use."""
    checkout = tmp_path / "checkout"
    (checkout / "scripts").mkdir(parents=True)
    for name in ("scripts/setup_venv.sh", "pyproject.toml", "constraints.txt"):
        shutil.copyfile(ROOT / name, checkout / name)
    old = tmp_path / "bin"
    old.mkdir()
    (old / "python3").write_text(PYTHON_310)
    (old / "python3").chmod(0o755)
    tools = tmp_path / "tools"
    tools.mkdir()
    for tool in ("head", "rm", "cat", "sha256sum", "cut"):
        (tools / tool).symlink_to(shutil.which(tool))
    newer = tmp_path / "newer"
    newer.mkdir()
    (newer / "python3.11").symlink_to(sys.executable)  # this test's own interpreter: 3.11 or newer
    return dict(checkout=checkout, old=old, tools=tools, newer=newer)


def setup(machine, path: list[Path], **env) -> subprocess.CompletedProcess:
    environment = {"PATH": os.pathsep.join(map(str, path)), "HOME": str(machine["checkout"]), "K3_SETUP_DRY_RUN": "1",
                   **env}
    return subprocess.run([shutil.which("bash"), "scripts/setup_venv.sh"], cwd=machine["checkout"], env=environment,
                          capture_output=True, text=True, timeout=60)


def test_a_310_python3_first_on_path_is_passed_over_for_a_311_elsewhere(machine):
    done = setup(machine, [machine["old"], machine["tools"], machine["newer"]])
    assert done.returncode == 0, done.stderr
    assert "Python python3.11 (3.1" in done.stdout and ".venv created" in done.stdout
    assert "torch==2.13.0+cpu (CPU build)" in done.stdout and done.stderr == ""


def test_without_a_newer_python_it_stops_with_one_line_saying_how_to_get_one(machine):
    done = setup(machine, [machine["old"], machine["tools"]])
    assert done.returncode == 1 and done.stdout == ""
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, lines
    assert "needs Python 3.11 or newer, found Python 3.10.12" in lines[0]
    assert "sudo apt install python3.11 python3.11-venv" in lines[0] and "PYTHON=" in lines[0]
    bad = setup(machine, [machine["old"], machine["tools"], machine["newer"]], PYTHON=str(machine["old"] / "python3"))
    assert bad.returncode == 1 and len(bad.stderr.strip().splitlines()) == 1
    assert "is not Python 3.11 or newer (Python 3.10.12)" in bad.stderr


def test_a_venv_made_with_an_older_python_is_rebuilt_and_cuda_is_asked_for_by_name(machine):
    venv_bin = machine["checkout"] / ".venv" / "bin"
    venv_bin.mkdir(parents=True)
    shutil.copyfile(machine["old"] / "python3", venv_bin / "python")
    (venv_bin / "python").chmod(0o755)
    done = setup(machine, [machine["old"], machine["tools"], machine["newer"]], K3_TORCH="cuda")
    assert done.returncode == 0, done.stderr
    assert "[setup] .venv was made with Python 3.10.12: rebuilding it with python3.11" in done.stdout
    assert ".venv rebuilt" in done.stdout and "torch==2.13.0 (CUDA build" in done.stdout
    assert (venv_bin / "python").exists()  # a dry run removes nothing
    wrong = setup(machine, [machine["tools"], machine["newer"]], K3_TORCH="rocm")
    assert wrong.returncode == 1 and "K3_TORCH=rocm: use cpu or cuda" in wrong.stderr
