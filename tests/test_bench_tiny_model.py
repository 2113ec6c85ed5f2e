"""benchmarks/tiny_model.py --write-probes: the validator's answer probes measured per honest variant and recorded
in the model's envelope file, refused for an envelope of another model."""
import json
import subprocess
import sys
from pathlib import Path

from inference.model import fingerprint
from scoring.model_envelope import SHIPPED, load_envelope

ROOT = Path(__file__).resolve().parent.parent


def bench(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "benchmarks.tiny_model", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=600)


def test_write_probes_records_each_variant_in_the_models_envelope(tiny_checkpoint, tmp_path):
    shipped = json.loads(next(SHIPPED.glob("*.json")).read_text())
    mine = tmp_path / "mine.json"
    mine.write_text(json.dumps({**shipped, "fingerprint": fingerprint(tiny_checkpoint)}))
    done = bench("--checkpoint", str(tiny_checkpoint), "--write-probes", str(mine), "--probes", "3")
    assert done.returncode == 0, done.stderr[-2000:]
    data = json.loads(mine.read_text())
    assert data["precisions"] == shipped["precisions"]  # the gap bounds are kept as they were
    envelope = load_envelope(str(mine))
    assert set(envelope.probes) == {"copy", "planted_fact"}
    for record in envelope.probes.values():
        assert (record.low, record.high) == (16, 256)  # the local testnet's prompt sizes, which the probes drew
        assert set(record.passed) == {"fp32", "bf16", "bf16-gpu-kernels"}
        assert all(n == 3 and 0 <= ok <= 3 for ok, n in record.passed.values())
    assert "| planted_fact | bf16-gpu-kernels |" in done.stdout
    assert envelope.answered_probes((16, 256)) == ()  # 3 probes say nothing, whatever was answered

    other = tmp_path / "other.json"
    other.write_text(json.dumps(shipped))  # measured on another model
    refused = bench("--checkpoint", str(tiny_checkpoint), "--write-probes", str(other), "--probes", "3")
    assert refused.returncode != 0 and "was measured on model" in refused.stderr
    assert json.loads(other.read_text()) == shipped  # nothing written


def test_the_shipped_model_answers_the_validators_planted_fact_probes(tiny_checkpoint):
    """What the shipped envelope's probes section claims, checked on the model itself: greedy answers to the
    validator's own planted-fact prompts (local-testnet sizes) contain the planted value; a random model's do not."""
    import random

    import torch

    from inference.model.tokenizer import ByteTokenizer
    from inference.model.training import load_model
    from benchmarks.tiny_model import answered, validator_probes

    torch.set_num_threads(1)
    trained = load_model(ROOT / "inference" / "model" / "assets" / "tiny_trained")
    probes = validator_probes(random.Random(7), 12, ByteTokenizer.from_config(trained.config))
    assert answered(trained, probes["validator_planted_fact"]) >= 9  # it answered 91 of 100 when measured
    assert answered(load_model(tiny_checkpoint), probes["validator_planted_fact"]) == 0
