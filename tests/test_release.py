"""`k3-checkpoint download|convert|verify` on a tiny Kimi K3 release the project writes in the Hugging Face layout
(config.json, the safetensors index and shards, tokenizer files; no k3_manifest.json, as on the Hub). The download
runs offline: its file selection goes through huggingface_hub's own pattern filter over a local copy of the release.
"""
import hashlib
import json
import shutil
from pathlib import Path

import pytest
from huggingface_hub.utils import filter_repo_objects
from safetensors.torch import load_file

from inference.model import ModelConfig, make_random_checkpoint
from inference.model.checkpoint import MANIFEST_FILE, fingerprint, read_weight_map, tensor_sha256
from inference.model.make_checkpoint import main as k3_checkpoint
from inference.model.release import (METADATA_PATTERNS, SHA256_FILE, Block, block_files, download, download_patterns,
                                     hash_shard, safetensors_layout)
from inference.swarm.stage import LayerRange, load_stage_model

SMALL_SHARD = 128 * 1024  # the tiny release (1.46 MB) in a dozen shards, layers spread over them
CONFIG = ModelConfig.tiny()


@pytest.fixture(scope="module")
def hub(tmp_path_factory) -> Path:
    """The release as the Hub holds it: no k3_manifest.json; the fingerprint the project's own writer gives."""
    path = tmp_path_factory.mktemp("hub") / "moonshotai--Kimi-K3-tiny"
    made = make_random_checkpoint(CONFIG, path, seed=0, max_shard_bytes=SMALL_SHARD)
    (path / "expected_fingerprint").write_text(made["fingerprint"])
    (path / MANIFEST_FILE).unlink()
    return path


def hub_sha256(hub: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in hub.glob("*.safetensors")}


class LocalHub:
    """snapshot_download's file selection (huggingface_hub's filter_repo_objects) over a local release; records
    every file it hands out."""

    def __init__(self, hub: Path, out: Path):
        self.hub, self.out, self.taken = hub, out, []

    def __call__(self, patterns: list[str]) -> Path:
        names = sorted(p.name for p in self.hub.iterdir() if p.name != "expected_fingerprint")
        for name in filter_repo_objects(names, allow_patterns=patterns):
            self.out.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(self.hub / name, self.out / name)
            self.taken.append(name)
        return self.out


def test_the_download_patterns_take_exactly_a_blocks_shard_files(hub):
    weight_map = read_weight_map(hub)
    every = sorted(set(weight_map.values()))
    assert len(every) >= 8
    middle = Block.parse("3-8", CONFIG.num_layers)
    files = block_files(weight_map, middle)
    holders = {f for name, f in weight_map.items() if any(f"model.layers.{i}." in name for i in range(3, 9))}
    assert set(files) == holders and set(files) < set(every)  # every file with a tensor of layers 3-8, nothing else
    first, last = Block.parse("0-2", 13), Block.parse("9-12", 13)
    assert weight_map["language_model.model.embed_tokens.weight"] in block_files(weight_map, first)
    assert weight_map["language_model.lm_head.weight"] in block_files(weight_map, last)
    # the patterns, through the Hub client's own filter, select the metadata and exactly those files
    patterns = download_patterns(weight_map, middle)
    chosen = list(filter_repo_objects([*every, "config.json", "tokenizer_config.json", "README.md",
                                       "model.safetensors.index.json", "original/consolidated.safetensors"],
                                      allow_patterns=patterns))
    assert sorted(c for c in chosen if c.endswith(".safetensors")) == files
    assert {"config.json", "tokenizer_config.json", "model.safetensors.index.json"} <= set(chosen)
    assert "README.md" not in chosen and download_patterns(None, None) == list(METADATA_PATTERNS)
    with pytest.raises(Exception, match="0 <= A <= B < 13"):
        Block.parse("5-13", 13)


def test_a_full_release_converts_and_verifies_and_a_flipped_byte_names_the_tensor_and_the_shard(hub, tmp_path,
                                                                                                   capsys):
    fetch = LocalHub(hub, tmp_path / "k3")
    download(fetch, tmp_path / "k3", None, lambda: hub_sha256(hub), say=lambda line: None)
    release = tmp_path / "k3"
    assert (release / SHA256_FILE).exists() and not (release / MANIFEST_FILE).exists()
    assert k3_checkpoint(["convert", str(release), "--quiet"]) == 0
    assert fingerprint(release) == (hub / "expected_fingerprint").read_text()  # the release's, as miners report it
    assert k3_checkpoint(["verify", str(release), "--quiet"]) == 0
    assert "they match the manifest" in capsys.readouterr().out

    weight_map = read_weight_map(release)
    name = "language_model.model.layers.4.self_attn.o_proj.weight"
    shard = release / weight_map[name]
    start, spans = safetensors_layout(shard)
    data = bytearray(shard.read_bytes())
    data[start + spans[name][0] + 7] ^= 0x01  # one bit of one tensor
    shard.write_bytes(bytes(data))
    assert k3_checkpoint(["verify", str(release), "--quiet"]) == 1
    err = capsys.readouterr().err
    assert f"tensor {name} in shard {shard.name} does not match" in err
    # a block that does not hold the tensor still verifies; the one that does names it
    assert k3_checkpoint(["verify", str(release), "--layers", "9-12", "--quiet"]) == 0
    assert k3_checkpoint(["verify", str(release), "--layers", "3-5", "--quiet"]) == 1
    assert name in capsys.readouterr().err


def test_a_stage_downloads_converts_verifies_and_loads_only_its_blocks_files(hub, tmp_path, capsys):
    out = tmp_path / "k3-3-8"
    fetch = LocalHub(hub, out)
    files = download(fetch, out, "3-8", lambda: hub_sha256(hub), say=lambda line: None)
    every = sorted(set(read_weight_map(hub).values()))
    shards_taken = sorted(n for n in fetch.taken if n.endswith(".safetensors"))
    assert shards_taken == files and len(files) < len(every)  # the other blocks' shards never came
    assert set(fetch.taken) - set(files) <= set(METADATA_PATTERNS)

    # its manifest: per-tensor hashes of what is here, every shard's hash from the release's list
    assert k3_checkpoint(["convert", str(out), "--layers", "3-8", "--quiet"]) == 0
    manifest = json.loads((out / MANIFEST_FILE).read_text())
    assert fingerprint(out) == (hub / "expected_fingerprint").read_text() and not manifest["weights_present"]
    assert k3_checkpoint(["verify", str(out), "--layers", "3-8", "--quiet"]) == 0
    assert f"in {len(files)} shard files of layers 3-8" in capsys.readouterr().out
    assert k3_checkpoint(["verify", str(out), "--layers", "0-2", "--quiet"]) == 1  # not downloaded: says so
    assert "k3-checkpoint download --layers 0-2" in capsys.readouterr().err

    # the stage miner loads it, checking each tensor it reads, and holds what a full checkpoint's stage holds
    full = tmp_path / "full"
    shutil.copytree(hub, full)
    assert k3_checkpoint(["convert", str(full), "--quiet"]) == 0
    layers = LayerRange.parse("3-8", CONFIG.num_layers)
    _, from_subset, _ = load_stage_model(out, layers)
    _, from_full, _ = load_stage_model(full, layers)
    assert from_subset == from_full


def test_convert_writes_a_stage_checkpoint_and_the_metadata_checkpoint(hub, tmp_path):
    release = tmp_path / "release"
    shutil.copytree(hub, release)
    assert k3_checkpoint(["convert", str(release), "--out", str(tmp_path / "stage"), "--layers", "9-12",
                          "--quiet"]) == 0
    stage_files = sorted(p.name for p in (tmp_path / "stage").glob("*.safetensors"))
    assert stage_files == block_files(read_weight_map(release), Block.parse("9-12", 13))
    assert fingerprint(tmp_path / "stage") == (hub / "expected_fingerprint").read_text()
    assert k3_checkpoint(["convert", str(release), "--meta-only", "--out", str(tmp_path / "meta"), "--quiet"]) == 0
    assert not list((tmp_path / "meta").glob("*.safetensors")) and (tmp_path / "meta" / "config.json").exists()
    assert fingerprint(tmp_path / "meta") == (hub / "expected_fingerprint").read_text()


def test_convert_refuses_a_release_that_is_not_this_layout_or_a_shard_that_differs_from_the_list(hub, tmp_path,
                                                                                                 capsys):
    release = tmp_path / "release"
    shutil.copytree(hub, release)
    (release / SHA256_FILE).write_text("".join(f"{h}  {f}\n" for f, h in hub_sha256(hub).items()))
    shard = sorted(release.glob("*.safetensors"))[2]
    start, spans = safetensors_layout(shard)
    data = bytearray(shard.read_bytes())
    data[-1] ^= 0xFF
    shard.write_bytes(bytes(data))
    assert k3_checkpoint(["convert", str(release), "--quiet"]) == 1
    assert f"shard {shard.name}: its sha256 differs from the release's list" in capsys.readouterr().err
    index = json.loads((release / "model.safetensors.index.json").read_text())
    del index["weight_map"]["language_model.model.norm.weight"]
    (release / "model.safetensors.index.json").write_text(json.dumps(index))
    assert k3_checkpoint(["convert", str(release), "--quiet"]) == 1
    assert "the index has no tensor language_model.model.norm.weight" in capsys.readouterr().err


def test_hashing_in_one_pass_gives_the_files_and_the_tensors_hashes(hub):
    shard = sorted(hub.glob("*.safetensors"))[0]
    file_sha, tensors = hash_shard(shard)
    assert file_sha == hashlib.sha256(shard.read_bytes()).hexdigest()
    assert tensors == {name: tensor_sha256(t) for name, t in load_file(shard).items()}
    some = sorted(tensors)[1:3]
    assert hash_shard(shard, some, whole_file=False) == (None, {n: tensors[n] for n in some})


def test_make_stays_the_default_command(tmp_path, capsys):
    assert k3_checkpoint(["--preset", "tiny", "--out", str(tmp_path / "a"), "--quiet"]) == 0
    assert k3_checkpoint(["make", "--preset", "tiny", "--out", str(tmp_path / "b"), "--quiet"]) == 0
    assert fingerprint(tmp_path / "a") == fingerprint(tmp_path / "b")
    assert k3_checkpoint([]) == 2 and "download" in capsys.readouterr().out
