"""A stage block sharded over the operator's own processes (`--shard-ranks N --shard-mode expert|pipeline`): the
sharded runtime restricted to the block's layers (ShardedModel(layers=(A, B + 1))) over gloo ranks, expert parallel
or as a pipeline of contiguous sub-blocks (`block_plan(..., "pipeline")`), taking and giving the residual state at the
block's edges.

- in process: a sharded block's output states (or head logprobs) equal the unsharded block's within 1e-4 (fp32)
  through prefill, decode, a verify forward and both kinds of rewind (into the verify forward, and a replay from
  0), in both modes, for a block with the embedding and one taking a residual state and ending with the head;
- real processes: a route through a pipeline-sharded first stage miner and an expert-sharded head stage miner
  (2 local ranks each) gives the single-process model's greedy tokens (and logprobs within 1e-4), plain, with
  every draft rejected (a rewind every step) and with n-gram speculation.
"""
import asyncio
import os

import bittensor as bt
import pytest
import torch
from conftest import collect_events, reference_greedy

from benchmarks.swarm import launch_stages, stop_processes
from inference.decoding.drafters import ReplayDrafter
from inference.decoding.sampling import SamplingParams
from inference.decoding.speculation import SpeculationConfig
from inference.model.checkpoint import fingerprint, make_random_checkpoint
from inference.model.config import ModelConfig
from inference.model.tokenizer import load_tokenizer
from inference.serving.builders import load_reference_model
from inference.serving.engine import GenerationRequest
from inference.swarm.stage import Stage, StageError
from neurons.swarm.route import RouteDriver, RouteEngine, StaticDirectory

PROMPT = [(11 * j + 5) % 256 for j in range(21)]
REPEATING = [65, 66] * 10


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    path = tmp_path_factory.mktemp("swarm_sharded") / "ckpt"
    make_random_checkpoint(ModelConfig.tiny(), path, seed=0)
    return path


def states_close(a, b) -> float:
    assert len(a.blocks) == len(b.blocks)
    return max(float((x - y).abs().max()) for x, y in zip(a.blocks + [a.partial], b.blocks + [b.partial]))


STEPS = [(0, PROMPT, "none", None), (21, [3, 4, 5], "verify", [4, 5]), ("rewind", 22),
         (22, [9], "none", None), ("rewind", 10), (10, [7, 8], "none", None), (12, [1], "none", None)]


def state_inputs(ckpt, stop: int):
    """The residual states entering layer `stop` for every forward of STEPS (from a plain stage 0..stop-1)."""
    front = Stage.from_checkpoint(ckpt, f"0-{stop - 1}")
    front.open("x")
    out = {}
    for step in STEPS:
        if step[0] == "rewind":
            front.rewind("x", step[1])
        else:
            out[step[0]] = front.forward("x", step[0], torch.tensor(step[1]))
    return out


@pytest.mark.parametrize("mode, layers", [("expert", "0-4"), ("pipeline", "0-4"), ("pipeline", "5-12")])
def test_sharded_block_equals_unsharded_block(ckpt, mode, layers):
    """0-4 is a non-block cut (block size 3); 5-12 takes a residual state and ends with the head."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    inputs = state_inputs(ckpt, 5) if layers == "5-12" else None
    sharded = Stage.from_checkpoint(ckpt, layers, shard_ranks=2, threads_per_rank=1, shard_mode=mode)
    try:
        plain = Stage.from_checkpoint(ckpt, layers)
        assert sharded.sharded and not plain.sharded and sharded.fingerprint == plain.fingerprint
        layout = sharded.model.layout()
        assert layout["processes"] == 2
        if mode == "pipeline":  # two contiguous sub-blocks of the stage's layers, one per rank
            start, stop = sharded.layers.start, sharded.layers.stop
            homes = layout["layer_home"][start:stop]
            assert homes == sorted(homes) and set(homes) == {0, 1}
            assert all(set(r["homed_layers"]) <= set(range(start, stop)) for r in sharded.model.ranks)
        else:
            assert layout["layer_home"][:5] == [0, 1, 0, 1, 0]
        for s in (sharded, plain):
            s.open("x")
        for step in STEPS:
            if step[0] == "rewind":
                assert sharded.rewind("x", step[1]) == plain.rewind("x", step[1]) == step[1]
                continue
            position, ids, step_mode, targets = step
            x = torch.tensor(ids) if inputs is None else inputs[position]
            if inputs is not None and step_mode == "none":  # the head scores the next prompt token instead
                step_mode, targets = "score", [(t + 1) % 256 for t in ids]
            a = sharded.forward("x", position, x, mode=step_mode, targets=targets)
            b = plain.forward("x", position, x, mode=step_mode, targets=targets)
            if inputs is None:
                assert states_close(a, b) < 1e-4, step
            elif step_mode == "verify":
                assert [t[0] for t in a.verified] == [t[0] for t in b.verified], step
                assert max(abs(p[1] - q[1]) for p, q in zip(a.verified, b.verified)) < 1e-4, step
            else:
                assert max(abs(p - q) for p, q in zip(a.logprobs, b.logprobs)) < 1e-4, step
        with pytest.raises(StageError) as e:
            sharded.fork("x", "y")
        assert e.value.status == 501
    finally:
        sharded.shutdown()
        torch.set_num_threads(threads)
    assert sharded.model.health().status != "ok"  # closed


def test_pipeline_needs_a_layer_per_rank(ckpt):
    with pytest.raises(ValueError, match="at least 3 layers"):
        Stage.from_checkpoint(ckpt, "0-1", shard_ranks=3, shard_mode="pipeline")
    with pytest.raises(ValueError, match="shard mode"):
        Stage.from_checkpoint(ckpt, "0-1", shard_ranks=2, shard_mode="tensor")


@pytest.fixture(scope="module")
def swarm(ckpt, tmp_path_factory):
    root = tmp_path_factory.mktemp("sharded_route")
    for name in ("a", "f", "driver"):
        bt.Wallet(name, "default", path=str(root / "wallets")).create_new_hotkey(use_password=False, suppress=True)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    procs, infos = launch_stages(ckpt, ["0-3"], root / "wallets", ["a"], root,
                                 extra=["--hop-timeout-s", "10", "--shard-ranks", "2", "--shard-mode", "pipeline"],
                                 timeout_s=300.0)
    try:
        sharded_procs, sharded_infos = launch_stages(ckpt, ["4-12"], root / "wallets", ["f"], root,
                                                     extra=["--hop-timeout-s", "10", "--shard-ranks", "2"],
                                                     timeout_s=300.0)
    except BaseException:
        stop_processes(procs)
        raise
    try:
        model, _, _ = load_reference_model(ckpt, verify=False)
        yield {"urls": [infos[0]["url"], sharded_infos[0]["url"]], "infos": [infos[0], sharded_infos[0]], "model": model,
               "driver": bt.Wallet("driver", "default", path=str(root / "wallets")).hotkey, "ckpt": ckpt}
    finally:
        stop_processes(procs + sharded_procs)
        torch.set_num_threads(threads)


async def generate(swarm, prompt, n, speculation=None):
    driver = RouteDriver(StaticDirectory(swarm["urls"]), swarm["driver"], ModelConfig.tiny(), hop_timeout_s=10.0)
    engine = RouteEngine(driver, load_tokenizer(swarm["ckpt"], ModelConfig.tiny()), prefill_chunk=8,
                         model_fingerprint=fingerprint(swarm["ckpt"]), speculation=speculation)
    async with engine:
        events, final = await collect_events(engine.generate(
            GenerationRequest(prompt, SamplingParams(max_tokens=n, ignore_eos=True))))
    return [e.token_id for e in events], [e.logprob for e in events], final


def test_route_through_a_sharded_stage_miner_equals_single_process(swarm):
    for info in swarm["infos"]:  # each block runs on its own 2 local ranks
        pids = info["shard_pids"]
        assert len(pids) == 2 and all(os.path.exists(f"/proc/{p}") for p in pids)
    assert swarm["infos"][0]["shard_layout"] == {"ranks": 2, "mode": "pipeline", "layer_home": [0, 0, 1, 1]}
    assert swarm["infos"][1]["shard_layout"]["mode"] == "expert"
    plain, plain_lp = reference_greedy(swarm["model"], PROMPT, 12)
    wrong = SpeculationConfig(max_draft_tokens=3, fixed_draft_tokens=3, drafter_factory=lambda ids: ReplayDrafter(
        len(ids), plain, ModelConfig.tiny().vocab_size, wrong_every=1))  # every draft rejected: a rewind a step
    cases = [(PROMPT, None), (PROMPT, wrong), (REPEATING, SpeculationConfig(drafter="ngram", max_draft_tokens=6))]
    for prompt, speculation in cases:
        want, want_lp = (plain, plain_lp) if prompt is PROMPT else reference_greedy(swarm["model"], prompt, 12)
        got, lps, final = asyncio.run(generate(swarm, prompt, 12, speculation))
        assert got == want
        assert max(abs(a - b) for a, b in zip(lps, want_lp)) < 1e-4
        if speculation is wrong:
            assert final.draft_proposed > 0 and final.draft_accepted == 0
        elif speculation is not None:
            assert final.draft_accepted > 0
