"""The trained tiny K3 ships in the wheel, an installed k3-localnet finds it, and the benchmarks run on it
unless told `--checkpoint random`."""
from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from benchmarks.checkpoint_choice import TRAINED_TINY, add_checkpoint_argument, resolve_checkpoint

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("inference", "protocol", "scoring", "neurons", "chain", "benchmarks", "localnet")


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """A wheel built (pip, no isolation, no dependencies) from a copy of the source tree."""
    src = tmp_path_factory.mktemp("src")
    shutil.copy(ROOT / "pyproject.toml", src)
    for name in ("README.md", "LICENSE"):
        if (ROOT / name).exists():
            shutil.copy(ROOT / name, src)
    for package in PACKAGES:
        shutil.copytree(ROOT / package, src / package, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    out = tmp_path_factory.mktemp("wheel")
    done = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                           "-w", str(out), str(src)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    (built,) = out.glob("*.whl")
    return built


def test_the_wheel_holds_every_file_of_the_trained_asset(wheel):
    shipped = {p.name: _sha(p.read_bytes()) for p in TRAINED_TINY.iterdir() if p.is_file()}
    assert "k3_manifest.json" in shipped and any(name.endswith(".safetensors") for name in shipped)
    prefix = "inference/model/assets/tiny_trained/"
    with zipfile.ZipFile(wheel) as z:
        in_wheel = {name[len(prefix):]: _sha(z.read(name)) for name in z.namelist() if name.startswith(prefix)}
    assert in_wheel == shipped


def test_an_installed_localnet_defaults_to_the_trained_model(wheel, tmp_path):
    site = tmp_path / "site"
    with zipfile.ZipFile(wheel) as z:
        z.extractall(site)
    probe = ("import localnet.testnet as l; print(l.__file__); print(l.TRAINED_ASSET); print(l.default_model()); "
             "print(l.parse_args(['--duration', '1']).model)")
    env = {**os.environ, "PYTHONPATH": str(site)}
    done = subprocess.run([sys.executable, "-c", probe], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    module, asset, default, parsed = done.stdout.split()
    assert Path(module).is_relative_to(site)  # the installed copy, not this checkout
    assert Path(asset) == site / "inference" / "model" / "assets" / "tiny_trained"
    assert (Path(asset) / "k3_manifest.json").read_bytes() == (TRAINED_TINY / "k3_manifest.json").read_bytes()
    assert default == parsed == "trained"

    # without the asset (an older wheel), the installed localnet falls back to the random model
    shutil.rmtree(asset)
    done = subprocess.run([sys.executable, "-c", probe], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split()[2:] == ["random", "random"]


def test_checkpoint_choice_defaults_to_trained_and_random_is_one_flag_away(tmp_path):
    parser = argparse.ArgumentParser()
    add_checkpoint_argument(parser)
    assert resolve_checkpoint(parser.parse_args([]).checkpoint, tmp_path) == TRAINED_TINY
    random_dir = resolve_checkpoint(parser.parse_args(["--checkpoint", "random"]).checkpoint, tmp_path)
    from inference.model.config import ModelConfig
    assert ModelConfig.from_file(random_dir).model_id == ModelConfig.tiny().model_id
    assert ModelConfig.from_file(TRAINED_TINY).model_id == ModelConfig.tiny_trained().model_id
    assert resolve_checkpoint(str(random_dir), tmp_path) == random_dir
    with pytest.raises(SystemExit, match="no checkpoint at"):
        resolve_checkpoint(str(tmp_path / "missing"), tmp_path)


@pytest.mark.parametrize("bench", ["miner", "validator", "stage_checks"])
def test_benchmarks_take_the_checkpoint_choice(bench):
    done = subprocess.run([sys.executable, "-m", f"benchmarks.{bench}", "--help"], cwd=ROOT,
                          env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "--checkpoint trained|random|DIR" in done.stdout
    assert "trained (default)" in " ".join(done.stdout.split())
