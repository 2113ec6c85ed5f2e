"""A dense split's ranks read only their parts of the tensors they share (inference.sharding.dense_split,
inference.model.checkpoint TensorSelection.parts), without processes: every read the loader makes of the
safetensors files is recorded, and each rank's bytes are compared with the parts computed from the config."""
import contextlib
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from inference.model import KimiK3Model, ModelConfig, load_checkpoint
from inference.model import checkpoint as ckpt
from inference.model.checkpoint import (PREFIX, CheckpointError, TensorPart, TensorSelection, expected_tensors,
                                        make_random_checkpoint, read_weight_map, row_absmax, tensor_site)
from inference.planning import Plan
from inference.sharding import worker
from inference.sharding.dense_split import head_part, layer_parts

CONFIG = ModelConfig.tiny()
SPECS = expected_tensors(CONFIG)
# what a rank sharing a layer's dense work keeps whole besides its parts (heads share these)
WHOLE_ON_EVERY_RANK = {
    "kda": ("self_attn.f_a_proj.weight", "self_attn.o_norm.weight", "self_attn.g_a_proj.weight"),
    "mla": ("self_attn.q_a_proj.weight", "self_attn.q_a_layernorm.weight", "self_attn.kv_a_proj_with_mqa.weight",
            "self_attn.kv_a_layernorm.weight"),
}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("k3split") / "ckpt"
    make_random_checkpoint(CONFIG, path, seed=5)
    return path


@pytest.fixture(scope="module")
def full(checkpoint):
    model = KimiK3Model(CONFIG, random_init=False)
    load_checkpoint(model, checkpoint, progress=False)
    return model.state_dict()


def plan_of(split: int) -> Plan:
    return Plan.simple(CONFIG, 2, "expert", memory_bytes=1 << 30, dense_split=split)


class RecordingSlice:
    def __init__(self, stored, name, reads):
        self.stored, self.name, self.reads = stored, name, reads

    def get_shape(self):
        return self.stored.get_shape()

    def get_dtype(self):
        return self.stored.get_dtype()

    def __getitem__(self, index):
        t = self.stored[index]
        self.reads.append((self.name, tuple(t.shape), t.numel() * t.element_size()))
        return t


class RecordingFile:
    def __init__(self, f, reads):
        self.f, self.reads = f, reads

    def keys(self):
        return self.f.keys()

    def get_tensor(self, name):
        t = self.f.get_tensor(name)
        self.reads.append((name, tuple(t.shape), t.numel() * t.element_size()))
        return t

    def get_slice(self, name):
        return RecordingSlice(self.f.get_slice(name), name, self.reads)


def record_reads(monkeypatch) -> list[tuple[str, tuple[int, ...], int]]:
    """Every tensor the loader materialises from a safetensors file: (name, shape, bytes)."""
    reads = []
    real = ckpt.safe_open

    @contextlib.contextmanager
    def recording(path, framework, **kwargs):
        with real(path, framework=framework, **kwargs) as f:
            yield RecordingFile(f, reads)

    monkeypatch.setattr(ckpt, "safe_open", recording)
    return reads


def rank_parts(plan: Plan, rank: int) -> dict[str, TensorPart]:
    """Model key -> the part `rank` holds, from the plan's groups and dense_split's definition of a part."""
    out = {}
    for layer, group in plan.dense_groups.items():
        if rank in group:
            for key, part in layer_parts(CONFIG, layer, group.index(rank), len(group)).items():
                out[f"model.layers.{layer}.{key}"] = part
    head = plan.head_group()
    if len(head) > 1 and rank in head:
        out["lm_head.weight"] = head_part(CONFIG, head.index(rank), len(head))
    return out


def expected_read(plan: Plan, rank: int, whole: bool = False) -> int:
    """Bytes of tensor data `rank` must read: whole tensors of its home layers (its parts of split ones), its
    experts, embedding and head; of a layer it only helps, its parts and what every rank keeps whole.
    whole: what loading the shared layers whole and cutting them afterwards read (the layers it takes part
    in, and the head when it shares it, in full)."""
    parts = rank_parts(plan, rank)
    experts = plan.experts_on(rank)
    total = 0
    for name, spec in SPECS.items():
        key = name[len(PREFIX):]
        site = tensor_site(key)
        if site.kind == "expert":
            held = site.expert in experts.get(site.layer, ())
        elif site.kind == "embedding":
            held = rank == plan.embedding_rank
        elif site.kind == "head":
            held = rank == plan.lm_head_rank or key in parts
        else:
            home = plan.layer_home[site.layer] == rank
            kind = "mla" if CONFIG.is_mla(site.layer) else "kda"
            within = key.split(".", 3)[3]
            shares = rank in plan.dense_group(site.layer)
            held = home or key in parts or shares and (whole or within in WHOLE_ON_EVERY_RANK[kind])
        if whole and site.kind == "head":
            held = rank in plan.head_group()
        if not held:
            continue
        part = None if whole else parts.get(key)
        if part is None or key.endswith(".A_log"):  # A_log (a few values per head) is read whole, then cut
            total += spec.nbytes
        else:
            total += spec.nbytes // spec.shape[part.dim] * (part.stop - part.start)
    return total


def test_each_rank_reads_only_its_parts_and_together_they_are_the_model(checkpoint, full, monkeypatch):
    plan = plan_of(2)
    assert plan.dense_groups and len(plan.head_group()) == 2
    held_parts: dict[str, list[torch.Tensor]] = {}
    for rank in range(2):
        reads = record_reads(monkeypatch)
        model, report = worker.load_shard_model(CONFIG, plan, rank, str(checkpoint))
        parts = rank_parts(plan, rank)
        assert report["parts"] == len(parts) > 0
        # no read of a split tensor returned more than this rank's part of it (A_log: a few floats, whole)
        for name, shape, _ in reads:
            key = name[len(PREFIX):]
            if key in parts and not key.endswith(".A_log"):
                assert shape == parts[key].shape_of(SPECS[name].shape), (rank, name, shape)
                assert shape != SPECS[name].shape
        # bytes: the loader's count is what it materialised, and that is exactly the rank's share
        assert report["bytes"] == sum(n for _, _, n in reads) == expected_read(plan, rank)
        assert report["largest_part"] == max(n for name, _, n in reads if name[len(PREFIX):] in parts
                                             and not name.endswith(".A_log"))
        held = {k: v for k, v in model.state_dict().items() if not v.is_meta}
        for key, part in parts.items():
            want = full[key].narrow(part.dim, part.start, part.stop - part.start)
            assert torch.equal(held[key], want), (rank, key)
            held_parts.setdefault(key, []).append((part, held[key]))
        for key, t in held.items():
            if key not in parts:
                assert torch.equal(t, full[key]), (rank, key)
    # the two ranks' parts of every split tensor make the whole tensor, in order
    for key, pieces in held_parts.items():
        assert len(pieces) == 2, key
        pieces.sort(key=lambda p: p[0].start)
        assert torch.equal(torch.cat([t for _, t in pieces], dim=pieces[0][0].dim), full[key]), key
    # and much less than loading the shared layers whole (then cutting them) read; the accounting from the
    # config alone (the snippet's Kimi K3 table) says the same
    for rank in range(2):
        assert expected_read(plan, rank) < 0.75 * expected_read(plan, rank, whole=True)
        for whole in (False, True):
            counted = worker.shard_read_bytes(CONFIG, plan, rank, whole_layers=whole)
            assert counted["dense"] + counted["experts"] == expected_read(plan, rank, whole), (rank, whole)


def test_a_part_is_checked_against_its_whole_tensors_sha256(checkpoint, full, tmp_path, monkeypatch):
    """verify_tensors streams a shared tensor through in row blocks: the rank holds only its part (and a block)
    yet checks every byte, so bytes altered in the other rank's part are caught too."""
    plan = plan_of(2)
    rank = 0
    key = "model.layers.0.self_attn.q_proj.weight"
    part = rank_parts(plan, rank)[key]
    assert part.dim == 0 and part.start == 0  # rank 0 reads the first rows only

    def load(path, verify):
        skeleton = worker.model_skeleton(CONFIG, torch.float32)
        split = worker.split_shard_model(skeleton, plan, rank)
        report = load_checkpoint(skeleton, path, verify=False, progress=False, verify_tensors=verify,
                                 select=worker.shard_selection(plan, rank, split=split))
        return skeleton, report

    _, plain = load(checkpoint, verify=False)
    monkeypatch.setattr(ckpt, "ROW_BLOCK_BYTES", 512)
    model, report = load(checkpoint, verify=True)
    assert report["verified"] == report["tensors"] and plain["verified"] == 0
    # streamed in blocks smaller than any part: what it held at once is no more than its largest part
    largest_whole = max(SPECS[PREFIX + k].nbytes for k in rank_parts(plan, rank))
    assert report["largest_part"] == plain["largest_part"] < largest_whole
    assert torch.equal(model.state_dict()[key], full[key][part.start:part.stop])

    bad = tmp_path / "ckpt"
    shutil.copytree(checkpoint, bad)
    fname = read_weight_map(bad)[PREFIX + key]
    tensors = load_file(bad / fname)
    tensors[PREFIX + key][-1, 0] += 1.0  # the last row: the other rank's part
    save_file(tensors, bad / fname, metadata={"format": "pt"})
    model, _ = load(bad, verify=False)  # only its part read: the altered row is not even seen
    assert torch.equal(model.state_dict()[key], full[key][part.start:part.stop])
    with pytest.raises(CheckpointError, match=f"{PREFIX + key}.*sha256"):
        load(bad, verify=True)


def test_row_absmax_streams_whole_rows(checkpoint, full, monkeypatch):
    monkeypatch.setattr(ckpt, "ROW_BLOCK_BYTES", 300)  # a few rows a block
    keys = ["model.layers.0.self_attn.o_proj.weight", "lm_head.weight"]
    got = row_absmax(checkpoint, keys)
    for key in keys:
        assert torch.equal(got[key], full[key].float().abs().amax(dim=1))
    with pytest.raises(CheckpointError, match="matrices"):
        row_absmax(checkpoint, ["model.layers.0.self_attn.dt_bias"])


def test_a_part_outside_its_tensor_is_refused(checkpoint):
    model = KimiK3Model(CONFIG, random_init=False)
    key = "model.layers.0.self_attn.q_proj.weight"
    rows = SPECS[PREFIX + key].shape[0]
    with pytest.raises(CheckpointError, match=f"{key}.*part"):
        load_checkpoint(model, checkpoint, verify=False, progress=False,
                        select=TensorSelection(parts={key: TensorPart(0, rows - 8, rows + 8)}))
    with pytest.raises(ValueError, match="dimension 0 or 1"):
        TensorPart(2, 0, 4)


@pytest.mark.parametrize("split", [1, 2])
def test_the_planners_memory_is_what_each_rank_reads(split):
    """The planner's weights per rank (compute_memory, bf16) are the bytes each rank's loader reads."""
    plan = plan_of(split)
    for rank in range(2):
        mem = plan.memory[rank]
        assert mem.weights_dense + mem.weights_experts == expected_read(plan, rank), (split, rank)
