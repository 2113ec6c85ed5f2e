"""The validator judges by the envelope measured on the model it serves: the shipped one when --checkpoint is that
model, none (the wide bound) for another model, and a given envelope measured on another model is refused."""
import json
import shutil
from pathlib import Path

import pytest

from inference.model import fingerprint
from neurons.validator_app.settings import ValidatorSetupError, read_validator_settings
from scoring.model_envelope import SHIPPED, load_envelope

ROOT = Path(__file__).resolve().parent.parent
TRAINED = ROOT / "inference" / "model" / "assets" / "tiny_trained"


def settings(checkpoint: Path, *extra: str):
    return read_validator_settings(["--netuid", "1", "--checkpoint", str(checkpoint), *extra], environ={})


def test_the_shipped_envelope_of_the_served_model_is_used():
    config = settings(TRAINED).scoring_config()
    assert config.logprob_gap_envelope is not None
    assert Path(config.logprob_gap_envelope).parent == SHIPPED
    envelope = load_envelope(config.logprob_gap_envelope)
    assert envelope.soft_bound("bfloat16", 64) < 0.75  # tighter than the wide bound where it was measured


def test_another_model_gets_no_envelope_and_a_mismatched_one_is_refused(tiny_checkpoint, tmp_path):
    assert settings(tiny_checkpoint).scoring_config().logprob_gap_envelope is None
    shipped = next(SHIPPED.glob("*.json"))
    override = json.dumps({"logprob_gap_envelope": str(shipped)})
    with pytest.raises(ValidatorSetupError, match="was measured on model"):
        settings(tiny_checkpoint, "--scoring-overrides", override).scoring_config()
    # an envelope measured on this model (same file, its fingerprint) is taken as given
    mine = tmp_path / "mine.json"
    mine.write_text(json.dumps({**json.loads(shipped.read_text()), "fingerprint": fingerprint(tiny_checkpoint)}))
    given = settings(tiny_checkpoint, "--scoring-overrides", json.dumps({"logprob_gap_envelope": str(mine)}))
    assert given.scoring_config().logprob_gap_envelope == str(mine)


def test_a_checkpoint_without_a_manifest_keeps_the_wide_bound(tmp_path):
    bare = tmp_path / "bare"
    bare.mkdir()
    shutil.copy(TRAINED / "config.json", bare / "config.json")
    assert settings(bare).scoring_config().logprob_gap_envelope is None
