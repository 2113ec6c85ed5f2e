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


def _envelope_with_probes(tmp_path, checkpoint, probes) -> Path:
    shipped = json.loads(next(SHIPPED.glob("*.json")).read_text())
    path = tmp_path / f"probed{len(list(tmp_path.glob('probed*.json')))}.json"  # files are read once per path
    path.write_text(json.dumps({**shipped, "fingerprint": fingerprint(checkpoint), "probes": probes}))
    return path


def test_the_probes_the_model_was_measured_to_answer_are_scored(tiny_checkpoint, tmp_path):
    probes = {"planted_fact": {"prompt_tokens": [16, 4096], "variants": {"fp32": [96, 100], "bf16": [93, 100]}},
              "copy": {"prompt_tokens": [16, 4096], "variants": {"fp32": [100, 100], "bf16": [80, 100]}}}
    path = _envelope_with_probes(tmp_path, tiny_checkpoint, probes)
    overrides = {"logprob_gap_envelope": str(path)}
    config = settings(tiny_checkpoint, "--scoring-overrides", json.dumps(overrides)).scoring_config()
    assert tuple(config.probes_scored) == ("planted_fact",)  # copy: one variant under 90 %
    # misses are judged against the 95% bound of the worst measured miss rate (7 of 100)
    assert config.probe_miss_rate == pytest.approx(0.1275, abs=5e-4)
    # --scoring-overrides says what to score: it wins over the file
    config = settings(tiny_checkpoint, "--scoring-overrides",
                      json.dumps({**overrides, "probes_scored": [], "probe_miss_rate": 0.2})).scoring_config()
    assert tuple(config.probes_scored) == () and config.probe_miss_rate == 0.2
    # too few probes measured say nothing
    few = {"planted_fact": {"prompt_tokens": [16, 4096], "variants": {"fp32": [20, 20]}}}
    path = _envelope_with_probes(tmp_path, tiny_checkpoint, few)
    config = settings(tiny_checkpoint, "--scoring-overrides",
                      json.dumps({"logprob_gap_envelope": str(path)})).scoring_config()
    assert tuple(config.probes_scored) == ()
    # measured on short prompts: scored where the validator's prompts are that short (the local testnet's 16-256
    # tokens), not where they reach 4096 tokens (the default profile)
    short = {"planted_fact": {"prompt_tokens": [16, 256], "variants": {"fp32": [100, 100], "bf16": [99, 100]}}}
    path = _envelope_with_probes(tmp_path, tiny_checkpoint, short)
    given = json.dumps({"logprob_gap_envelope": str(path)})
    local = settings(tiny_checkpoint, "--scoring-profile", "local_testnet", "--scoring-overrides", given)
    assert tuple(local.scoring_config().probes_scored) == ("planted_fact",)
    assert tuple(settings(tiny_checkpoint, "--scoring-overrides", given).scoring_config().probes_scored) == ()
    # without an envelope file with a probes section the profile's own choice stands
    plain = settings(tiny_checkpoint, "--scoring-profile", "local_testnet").scoring_config()
    assert tuple(plain.probes_scored) == () and plain.probe_miss_rate == 0.1
    assert "planted_fact" in settings(tiny_checkpoint).scoring_config().probes_scored


def test_the_shipped_model_is_held_to_the_planted_fact_probe_on_short_prompts():
    """The shipped envelope records that the trained tiny model answers the validator's planted-fact probes (in
    fp32, bf16 and bf16 with GPU kernels) and not its copy probes: a local-testnet validator scores the first."""
    config = settings(TRAINED, "--scoring-profile", "local_testnet").scoring_config()
    assert tuple(config.probes_scored) == ("planted_fact",)
    record = load_envelope(config.logprob_gap_envelope).probes["planted_fact"]
    assert set(record.passed) == {"fp32", "bf16", "bf16-gpu-kernels"}
    assert all(n >= 100 and ok >= 0.9 * n for ok, n in record.passed.values())
    assert 0.1 < config.probe_miss_rate < 0.2
    assert tuple(settings(TRAINED).scoring_config().probes_scored) == ()  # prompts of up to 4096 tokens: not


def test_a_bad_probes_section_is_refused_with_its_reason(tiny_checkpoint, tmp_path):
    for probes, reason in (({"poetry": {"prompt_tokens": [1, 2], "variants": {"fp32": [1, 1]}}}, "unknown probe kind"),
                           ({"copy": {"prompt_tokens": [1, 2], "variants": {"fp32": [5, 3]}}}, "outside 0..probes"),
                           ({"copy": {"variants": {"fp32": [1, 1]}}}, "malformed probes")):
        path = _envelope_with_probes(tmp_path, tiny_checkpoint, probes)
        with pytest.raises(ValidatorSetupError, match=reason):
            settings(tiny_checkpoint, "--scoring-overrides",
                     json.dumps({"logprob_gap_envelope": str(path)})).scoring_config()
    with pytest.raises(ValidatorSetupError, match="probes_scored may name"):
        settings(tiny_checkpoint, "--scoring-overrides", json.dumps({"probes_scored": ["poetry"]})).scoring_config()
