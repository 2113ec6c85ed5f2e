"""`python -m inference` (also with --speculate) and `k3-checkpoint` as an operator runs them."""
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
    run("-m", "inference.model.make_checkpoint", "--preset", "tiny", "--out", str(out), "--seed", "0", "--quiet")
    return out


def test_generate_json_and_score_agree(checkpoint):
    gen = json.loads(run("-m", "inference", "generate", "--checkpoint", str(checkpoint), "--prompt", "Hello",
                         "--max-tokens", "12", "--logprobs", "3", "--json").stdout)
    assert gen["prompt_token_ids"][0] == 256  # BOS, as the model saw it
    assert gen["prompt_token_ids"][1:] == list(b"Hello")
    assert 1 <= len(gen["token_ids"]) <= 12
    assert all(len(t) == 3 for t in gen["top_logprobs"])
    ids = gen["prompt_token_ids"] + gen["token_ids"]
    sc = json.loads(run("-m", "inference", "score", "--checkpoint", str(checkpoint),
                        "--token-ids", ",".join(map(str, ids)), "--top-k", "2", "--json").stdout)
    assert len(sc["logprobs"]) == len(ids) - 1
    n = len(gen["prompt_token_ids"])
    for k, tok in enumerate(gen["token_ids"]):
        top1 = sc["top"][n - 1 + k][0]
        assert top1[0] == tok
        assert sc["logprobs"][n - 1 + k] == pytest.approx(gen["logprobs"][k], abs=1e-4)


def test_seeded_sampling_from_the_cli_is_reproducible(checkpoint):
    args = ("-m", "inference", "generate", "--checkpoint", str(checkpoint), "--token-ids", "1,2,3",
            "--max-tokens", "10", "--temperature", "1.0", "--seed", "5", "--json")
    a = json.loads(run(*args).stdout)
    b = json.loads(run(*args).stdout)
    assert a["token_ids"] == b["token_ids"] and a["prompt_token_ids"] == [1, 2, 3]


def test_cli_errors_are_clear(checkpoint, tmp_path):
    bad = run("-m", "inference", "score", "--checkpoint", str(checkpoint), "--token-ids", "1,x", check=False)
    assert bad.returncode == 2 and "comma-separated integers" in bad.stderr
    bad = run("-m", "inference", "score", "--checkpoint", str(checkpoint), "--token-ids", "1,99999", check=False)
    assert bad.returncode == 2 and "outside the vocabulary" in bad.stderr
    bad = run("-m", "inference", "info", "--checkpoint", str(tmp_path), check=False)
    assert bad.returncode == 2 and "error:" in bad.stderr


# ------------------------------------------------------------ --speculate
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
