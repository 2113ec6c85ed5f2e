"""`python -m inference manifest`: the metadata checkpoint a remote-engine miner runs with.

Made from a real (random) K3 checkpoint: the fingerprint from the weights equals the one made from
the release's sha256 list without the weights, equals `checkpoint.fingerprint` of the full checkpoint;
missing hashes and a corrupt shard are clear errors; the miner's setup error names the command.
"""
import hashlib
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from inference.model.checkpoint import CheckpointError, fingerprint, make_random_checkpoint
from inference.model.config import ModelConfig
from inference.model.manifest import make_manifest
from inference.serving.builders import EngineSpec, EngineSpecError, build_engine

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def release(tmp_path_factory):
    root = tmp_path_factory.mktemp("release")
    ckpt = root / "k3"
    make_random_checkpoint(ModelConfig.tiny(), ckpt, seed=1)
    (ckpt / "tokenizer_config.json").write_text(json.dumps({"added_tokens_decoder": {}}))
    sums = root / "SHA256SUMS"
    sums.write_text("".join(f"{hashlib.sha256(p.read_bytes()).hexdigest()}  {p.name}\n"
                            for p in sorted(ckpt.glob("*.safetensors"))))
    return ckpt, sums


def run_cli(*args):
    return subprocess.run([sys.executable, "-m", "inference", "manifest", *args], capture_output=True, text=True,
                          cwd=ROOT, timeout=300)


def test_the_fingerprint_is_the_same_with_and_without_the_weights(release, tmp_path):
    ckpt, sums = release
    full = fingerprint(ckpt)  # the checkpoint maker's own manifest
    out = run_cli(str(ckpt), "--out", str(tmp_path / "meta-a"), "--quiet")
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["fingerprint"] == full and json.loads(out.stdout)["weights_present"] is True
    meta = tmp_path / "meta-a"
    assert sorted(p.name for p in meta.iterdir()) == ["config.json", "k3_manifest.json",
                                                       "model.safetensors.index.json", "tokenizer_config.json"]
    # the metadata directory alone (no weights) plus the published list gives the same fingerprint
    again = make_manifest(meta, sums)
    assert again["fingerprint"] == full and again["weights_present"] is False
    assert fingerprint(meta) == full


def test_missing_hashes_and_a_corrupt_shard_are_errors(release, tmp_path):
    ckpt, sums = release
    meta = tmp_path / "meta"
    make_manifest(ckpt, out=meta)
    out = run_cli(str(meta))  # no weights and no list
    assert out.returncode == 2 and "--sha256" in out.stderr and "Traceback" not in out.stderr
    bad = tmp_path / "bad"
    shutil.copytree(ckpt, bad)
    shard = sorted(bad.glob("*.safetensors"))[0]
    data = bytearray(shard.read_bytes())
    data[-1] ^= 0xFF
    shard.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="differs from the published list"):
        make_manifest(bad, sums)


def test_a_remote_engine_without_a_manifest_says_which_command_makes_it(release, tmp_path):
    ckpt, _ = release
    meta = tmp_path / "no-manifest"
    make_manifest(ckpt, out=meta)
    (meta / "k3_manifest.json").unlink()
    spec = EngineSpec(kind="remote", checkpoint=str(meta), remote_url="http://127.0.0.1:9", remote_model="m")
    with pytest.raises(EngineSpecError, match="python -m inference manifest"):
        build_engine(spec)


def test_the_hf_byte_level_tokenizer_round_trips_and_keeps_specials_out_of_text(tmp_path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from inference.model.hf_tokenizer import HFByteLevelTokenizer

    specials = ["[BOS]", "[EOS]", "[PAD]", "<|im_system|>", "<|im_user|>", "<|im_assistant|>", "<|im_middle|>",
                "<|im_end|>"]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator([Path(json.__file__).read_text()] * 2, trainers.BpeTrainer(
        vocab_size=400, special_tokens=specials, show_progress=False, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"bos_token": "[BOS]", "eos_token": "[EOS]",
                                                                 "pad_token": "[PAD]"}))
    ours = HFByteLevelTokenizer.from_dir(tmp_path, {"vocab_size": 416})
    assert ours.vocab_size == 416 and ours.eos_id == tok.token_to_id("[EOS]")
    text = "def decode(self, s):\n    return 'é ✓' + \"<|im_end|>\""
    ids = ours.encode(text)
    assert ours.decode(ids) == text
    assert tok.token_to_id("<|im_end|>") not in ids  # a special's name in user text stays text
    plain = "import json\nx = json.loads(s)  # comment"
    assert ours.encode(plain) == tok.encode(plain, add_special_tokens=False).ids  # same ids as the library
    assert ours.decode(ours.apply_chat_template([{"role": "user", "content": "hi"}])).startswith("<|im_user|>user")
