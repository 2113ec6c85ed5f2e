"""`python -m inference generate --speculate ...` as an operator runs it."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def run(*args, check=True):
    proc = subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True, timeout=240,
                          env={"OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"})
    if check and proc.returncode != 0:
        raise AssertionError(f"{args} failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}")
    return proc


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    out = tmp_path_factory.mktemp("ckpt") / "tiny"
    run("scripts/make_checkpoint.py", "--preset", "tiny", "--out", str(out), "--seed", "0", "--quiet")
    return out


def test_generate_with_speculation_reports_drafts_and_matches_plain(checkpoint):
    base = ("-m", "inference", "generate", "--checkpoint", str(checkpoint), "--prompt", "ab ab ab ab ab ab ab",
            "--max-tokens", "16", "--json")
    plain = json.loads(run(*base).stdout)
    assert plain["speculate"] == "none" and plain["draft_proposed"] == 0
    for kind in ("ngram", "suffix"):
        spec = json.loads(run(*base, "--speculate", kind, "--draft-tokens", "4").stdout)
        assert spec["token_ids"] == plain["token_ids"]
        assert spec["speculate"] == kind
        assert 0 <= spec["draft_accepted"] <= spec["draft_proposed"]
        assert spec["verify_steps"] <= len(spec["token_ids"])


def test_speculation_flags_are_checked(checkpoint):
    base = ("-m", "inference", "generate", "--checkpoint", str(checkpoint), "--token-ids", "1,2")
    bad = run(*base, "--speculate", "medusa", check=False)
    assert bad.returncode == 2 and "invalid choice: 'medusa'" in bad.stderr
    bad = run(*base, "--speculate", "ngram", "--draft-tokens", "0", check=False)
    assert bad.returncode == 2 and "--draft-tokens must lie in 1..16" in bad.stderr
