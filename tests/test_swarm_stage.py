"""Stage compute without the wire: a chain of `Stage`s over layer blocks of the tiny checkpoint gives the
whole model's logits, greedy tokens and teacher-forced logprobs (fp32, block and non-block cuts); rewind,
fork, limits, idle expiry and eviction; refused forwards leave the session as it was."""
import pytest
import torch
from conftest import reference_greedy

from inference.decoding.sampling import SamplingParams
from inference.model.checkpoint import make_random_checkpoint
from inference.model.config import ModelConfig
from inference.serving.builders import load_reference_model
from inference.swarm.stage import (HeadOutput, LayerRange, Stage, StageError, StageLimits, blocks_before,
                                   load_stage_model, wire_bytes_per_token)

PROMPT = [(7 * j + 3) % 256 for j in range(20)]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    path = tmp_path_factory.mktemp("swarm_stage") / "ckpt"
    make_random_checkpoint(ModelConfig.tiny(), path, seed=0)
    return path


@pytest.fixture(scope="module")
def reference(ckpt):
    model, _, _ = load_reference_model(ckpt, verify=False)
    return model


def chain(ckpt, cuts, limits=StageLimits()):
    bounds = [0, *cuts, 13]
    return [Stage.from_checkpoint(ckpt, f"{a}-{b - 1}", limits=limits) for a, b in zip(bounds, bounds[1:])]


def run_chain(stages, sid, position, ids, mode="sample", targets=None, top_k=0):
    x = torch.tensor(ids)
    for s in stages:
        x = s.forward(sid, position, x, mode=mode if s.layers.has_head else "none", targets=targets, top_k=top_k)
    return x


def greedy_chain(stages, sid, prompt, n, chunk=None):
    for s in stages:
        s.open(sid)
    pos, out, lps = 0, [], []
    chunk = chunk or len(prompt)
    for i in range(0, len(prompt), chunk):
        piece = prompt[i:i + chunk]
        res = run_chain(stages, sid, pos, piece, mode="sample" if i + chunk >= len(prompt) else "none")
        pos += len(piece)
    for _ in range(n):
        out.append(res.token_id)
        lps.append(res.logprob)
        if len(out) == n:
            break
        res = run_chain(stages, sid, pos, [res.token_id])
        pos += 1
    return out, lps


def test_layer_range_parsing_and_block_counts():
    r = LayerRange.parse("4-8", 13)
    assert (r.start, r.stop, str(r)) == (4, 9, "4-8") and not r.has_embedding and not r.has_head
    assert LayerRange.parse("9-12", 13).has_head and LayerRange.parse("0-3", 13).has_embedding
    for bad in ("8-4", "a-b", "0-13", "1-2-3"):
        with pytest.raises(ValueError):
            LayerRange.parse(bad, 13)
    assert [blocks_before(i, 3) for i in (0, 1, 3, 4, 6, 7, 13)] == [0, 1, 1, 2, 2, 3, 5]


def test_wire_cost_of_cuts_follows_the_block_count():
    k3 = ModelConfig.kimi_k3()
    # docs/swarm.md section 3: after 12, 48 and 84 layers, 2, 5 and 8 vectors of 7168 bf16 values per token
    assert [wire_bytes_per_token(k3, c) for c in (12, 48, 84)] == [2 * 7168 * 2, 5 * 7168 * 2, 8 * 7168 * 2]
    assert wire_bytes_per_token(k3, 13) > wire_bytes_per_token(k3, 12)  # one past a boundary costs a vector more


def test_stage_loads_only_its_tensors(ckpt):
    model, fp, nbytes = load_stage_model(ckpt, LayerRange.parse("4-8", 13))
    held = {k for k, v in model.state_dict().items() if not v.is_meta}
    assert held and all(k.startswith(tuple(f"model.layers.{i}." for i in range(4, 9))) for k in held)
    assert len(fp) == 16 and nbytes > 0
    _, fp2, _ = load_stage_model(ckpt, LayerRange.parse("4-9", 13))
    assert fp2 != fp


@pytest.mark.parametrize("cuts", [(6,), (4, 6), (4, 6, 9)], ids=["2-block", "3-mixed", "4-mixed"])
def test_chain_matches_whole_model(ckpt, reference, cuts):
    stages = chain(ckpt, cuts)
    want, want_lp = reference_greedy(reference, PROMPT, 8)
    got, got_lp = greedy_chain(stages, "s", PROMPT, 8)
    assert got == want
    assert max(abs(a - b) for a, b in zip(got_lp, want_lp)) < 1e-4
    # chunked prefill gives the same tokens
    got2, lp2 = greedy_chain(stages, "t", PROMPT, 8, chunk=7)
    assert got2 == want and max(abs(a - b) for a, b in zip(lp2, want_lp)) < 1e-4
    # teacher-forced scoring: one forward, every row
    seq = PROMPT + want
    for s in stages:
        s.open("score")
    res = run_chain(stages, "score", 0, seq, mode="score", targets=seq[1:] + [-1], top_k=3)
    ref = torch.log_softmax(reference.forward([torch.tensor(seq)], [reference.new_cache()], all_logits=True)[0], -1)
    for r in range(len(seq) - 1):
        assert abs(res.logprobs[r] - float(ref[r, seq[r + 1]])) < 1e-4
        assert res.row_tops[r][0][0] == int(torch.argmax(ref[r]))
    assert res.logprobs[-1] is None


def test_rewind_and_fork(ckpt):
    stages = chain(ckpt, (4, 9))
    never, never_lp = greedy_chain(stages, "a", PROMPT + [65, 66], 5)
    got, _ = greedy_chain(stages, "b", PROMPT, 6)
    # b generated 6 tokens (5 fed through); rewind to the end of the prompt, feed 65, 66 instead
    for s in stages:
        assert s.rewind("b", len(PROMPT)) == len(PROMPT)
    res = run_chain(stages, "b", len(PROMPT), [65, 66])
    regen = [res.token_id]
    lps = [res.logprob]
    pos = len(PROMPT) + 2
    while len(regen) < 5:
        res = run_chain(stages, "b", pos, [regen[-1]])
        regen.append(res.token_id)
        lps.append(res.logprob)
        pos += 1
    assert regen == never and max(abs(a - b) for a, b in zip(lps, never_lp)) < 1e-5
    # a rewind into the middle of a prefill chunk replays the recorded inputs
    for s in stages:
        s.rewind("b", 9)
    res = run_chain(stages, "b", 9, PROMPT[9:])
    want, _ = greedy_chain(stages, "c", PROMPT, 1)
    assert res.token_id == want[0]
    # fork: two independent continuations
    for s in stages:
        s.fork("c", "d")
    r1 = run_chain(stages, "c", len(PROMPT), [want[0]])
    r2 = run_chain(stages, "d", len(PROMPT), [want[0]])
    assert r1.token_id == r2.token_id and abs(r1.logprob - r2.logprob) < 1e-6
    with pytest.raises(StageError) as e:
        stages[0].rewind("c", 99)
    assert e.value.status == 400


def test_refused_forwards_leave_session_intact(ckpt):
    first, second = chain(ckpt, (4,))
    first.open("x")
    second.open("x")
    state = first.forward("x", 0, torch.tensor(PROMPT[:5]))
    bad = [
        (3, state),  # wrong position
        (0, type(state)((5,), state.blocks, state.partial[:, :10])),  # wrong width
        (0, type(state)((5,), state.blocks[:1] * 3, state.partial)),  # wrong block count
        (0, type(state)((5,), state.blocks, state.partial.clone().index_fill_(0, torch.tensor([2]), float("nan")))),
        (0, torch.tensor([1, 2])),  # token ids to a middle stage
    ]
    for pos, x in bad:
        with pytest.raises(StageError) as e:
            second.forward("x", pos, x, mode="sample")
        assert 400 <= e.value.status < 500
        assert second.sessions["x"].position == 0 and second.sessions["x"].cache.length == 0
    with pytest.raises(StageError) as e:
        second.forward("nope", 0, state, mode="sample")
    assert e.value.status == 404
    out = second.forward("x", 0, state, mode="sample")
    assert isinstance(out, HeadOutput) and out.token_id is not None


def test_limits_expiry_and_eviction(ckpt):
    stage = Stage.from_checkpoint(ckpt, "0-12", limits=StageLimits(max_sessions=2, max_tokens_per_forward=8,
                                                                   max_context=16, idle_expiry_s=60, evict_idle_s=0.0))
    stage.open("a", sampling=SamplingParams())
    stage.open("b")
    stage.open("c")  # evicts the least recently used idle session
    assert set(stage.sessions) == {"b", "c"} and stage.evicted == 1
    with pytest.raises(StageError) as e:
        stage.forward("b", 0, torch.tensor(list(range(9))), mode="sample")
    assert e.value.status == 413
    stage.forward("b", 0, torch.tensor(list(range(8))), mode="sample")
    stage.forward("b", 8, torch.tensor(list(range(8))), mode="sample")
    with pytest.raises(StageError) as e:
        stage.forward("b", 16, torch.tensor([1]), mode="sample")
    assert e.value.status == 413
    import time
    assert stage.expire_idle(now=time.monotonic() + 61) and not stage.sessions
    strict = Stage(stage.model, stage.layers, limits=StageLimits(max_sessions=1, evict_idle_s=3600))
    strict.open("a")
    with pytest.raises(StageError) as e:
        strict.open("b")
    assert e.value.status == 429


def test_stage_checks_its_tensors_against_the_manifests_sha256(tmp_path):
    """The manifest lists a sha256 per tensor; a stage checks exactly the tensors it reads: one altered byte in
    its block is refused naming the tensor, while a stage of another block still loads."""
    import json
    import shutil
    import struct

    from inference.model.checkpoint import CheckpointError, load_tensors, read_manifest, read_weight_map, tensor_sha256

    src = tmp_path / "ckpt"
    make_random_checkpoint(ModelConfig.tiny(), src, seed=3)
    tensors = read_manifest(src)["tensors"]
    assert set(tensors) == set(read_weight_map(src))
    name = next(n for n in tensors if ".layers.7." in n and "proj" in n)
    assert tensor_sha256(load_tensors(src, [name])[name]) == tensors[name]  # the hash is of the stored bytes

    bad = tmp_path / "altered"
    shutil.copytree(src, bad)
    shard = bad / read_weight_map(bad)[name]
    raw = bytearray(shard.read_bytes())
    (header_len,) = struct.unpack("<Q", raw[:8])
    start, _ = json.loads(raw[8:8 + header_len])[name]["data_offsets"]
    raw[8 + header_len + start] ^= 0x01  # one bit of the tensor's first value
    shard.write_bytes(bytes(raw))
    config = ModelConfig.tiny()
    with pytest.raises(CheckpointError, match=name.replace(".", r"\.")):
        load_stage_model(bad, LayerRange.parse("6-8", config.num_layers))
    load_stage_model(bad, LayerRange.parse("0-5", config.num_layers))  # does not hold the altered tensor

    # a manifest from before per-tensor hashes: checked when asked for, with a clear error, else loaded
    manifest = json.loads((bad / "k3_manifest.json").read_text())
    del manifest["tensors"]
    (bad / "k3_manifest.json").write_text(json.dumps(manifest))
    load_stage_model(bad, LayerRange.parse("6-8", config.num_layers))
    with pytest.raises(CheckpointError, match="no per-tensor sha256"):
        load_stage_model(bad, LayerRange.parse("6-8", config.num_layers), verify_tensors=True)
