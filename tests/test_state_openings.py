"""State commitments of whole-model miners and the validator's openings (inference/serving/state_commitment.py,
scoring/openings.py, the miner's POST /v1/states): real miner servers on loopback over the trained tiny model, a
real devnet and wallets, the validator's lazy block reference on the checkpoint on disk.

Honest miners in fp32 and bf16 open every block and pass; a miner that lies in one block (at a third of the
positions, or at a single position) fails the openings of that block and is blamed by its window of openings;
one that refuses to open, or opens states that do not chain to its root, fails hard at once."""
from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from chain import connect
from inference.serving import EngineSettings, LocalEngine, WrappedEngine
from inference.serving.builders import load_reference_model
from inference.serving.state_commitment import (OpenedRows, OpeningError, StateAsk, commit_boundaries, leaf_hash,
                                                merkle_levels, multiproof, root_from_multiproof)
from inference.swarm.block_reference import BlockReference
from neurons.base.settings import ChainSettings
from neurons.miner_app import AccessSettings, MinerServer, MinerSettings, ServerSettings
from protocol.auth import SQLiteNonceStore
from protocol.client import MinerClient
from protocol.schemas import GenerateRequest
from protocol.signature import verify_final, verify_response
from scoring.openings import StateOpenings, judge_window
from scoring.stage_judge import load_stage_envelopes

ENVELOPE = Path(__file__).resolve().parents[1] / "scoring" / "envelopes" / "tiny_trained.json"
PROMPT = [(7 * j + 3) % 200 + 32 for j in range(40)]
BLOCKS = 5  # the trained tiny model: 13 layers, AttnRes blocks of 3, committed every 3 layers: 3, 6, 9, 12, 13


@pytest.fixture(autouse=True)
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def world(tmp_path_factory, make_wallets, make_subnet, trained_checkpoint):
    root = tmp_path_factory.mktemp("openings")
    wallets = make_wallets(root / "wallets", ["owner", "miner", "validator"])
    netuid, _ = make_subnet(root / "devnet.sqlite", wallets, ("miner", "validator"), {"validator": 1000.0})
    models = {d: load_reference_model(trained_checkpoint, d, verify=False) for d in ("float32", "bfloat16")}
    return dict(root=root, wallets=wallets, netuid=netuid, ckpt=trained_checkpoint, models=models,
                reference=BlockReference(trained_checkpoint, 32 << 20), envelopes=load_stage_envelopes(str(ENVELOPE)))


def engine(world, dtype="float32", commit_layers=3) -> LocalEngine:
    model, tokenizer, fp = world["models"][dtype]
    return LocalEngine(model, tokenizer, EngineSettings(max_context=1024, step_token_budget=16,
                                                        commit_layers=commit_layers),
                       model_fingerprint=fp, engine_kind="reference")


@pytest.fixture
async def miner(world, tmp_path):
    started = []

    async def start(eng) -> MinerServer:
        settings = MinerSettings(
            chain=ChainSettings(network=f"devnet:{world['root'] / 'devnet.sqlite'}", netuid=world["netuid"],
                                timeout_s=2.0),
            server=ServerSettings(host="127.0.0.1", port=0, publish=False, metrics=False, shutdown_grace_s=0.0,
                                  nonce_store=str(tmp_path / f"nonces-{len(started)}.sqlite")),
            access=AccessSettings(min_validator_stake=5.0, requests_per_window=100_000))
        chain = connect(settings.chain.network)
        server = MinerServer(settings, engine=eng, tokenizer=world["models"]["float32"][1], chain=chain,
                             wallet=world["wallets"]["miner"], nonce_store=SQLiteNonceStore(settings.server.nonce_store))
        started.append((server, chain))
        await server.start()
        return server

    yield start
    for server, chain in started:
        await server.close(grace_s=0.0)
        await chain.close()


def openings(world, client, seed=1) -> StateOpenings:
    return StateOpenings(world["reference"], client, rate=1.0, envelopes=world["envelopes"], rng=random.Random(seed))


async def answer(client, server, n=12, request_id="r", temperature=0.0):
    request = GenerateRequest(request_id=request_id, prompt_token_ids=PROMPT, max_tokens=n, temperature=temperature,
                              logprobs=1)
    return await client.generate(server.url, server.hotkey, request)


# ------------------------------------------------------------------ miners that lie
class LiarModelHook:
    """Adds a large error to the state leaving layer `layer` at the positions `lie_at(position)` picks: the miner
    computes every later layer honestly on its lie, commits to what it computed, and streams what it gives."""

    def __init__(self, model, layer: int, lie_at):
        self.lie_at = lie_at
        self.handle = model.layers[layer].register_forward_hook(self.hook)

    def hook(self, module, args, out):
        state, caches = args
        partial, row = out.partial.clone(), 0
        for n, cache in zip(state.lengths, caches):
            for j in range(n):
                if self.lie_at(cache.length + j):
                    partial[row + j] += 0.5 * partial[row + j].norm() / partial.shape[1] ** 0.5
            row += n
        return type(out)(out.lengths, out.blocks, partial)

    def remove(self):
        self.handle.remove()


class RefusingEngine(WrappedEngine):
    def open_states(self, request_id, root, asks, caller=""):
        raise OpeningError("not kept")


class ForgingEngine(WrappedEngine):
    """Opens what it committed to, but with the rows of one boundary changed (honest-looking states it did not
    commit to)."""

    def open_states(self, request_id, root, asks, caller=""):
        opening = self.inner.open_states(request_id, root, asks, caller)
        o = opening.opened[-1]
        opening.opened[-1] = OpenedRows(o.boundary, o.positions, o.rows * 1.001, o.proof)
        return opening


# ------------------------------------------------------------------ the tree
def test_multiproofs_rebuild_the_root_and_nothing_else():
    rng = random.Random(3)
    for n in (1, 2, 3, 7, 16, 33):
        leaves = [leaf_hash(6, t, bytes([t]) * 8) for t in range(n)]
        levels = merkle_levels(leaves)
        for _ in range(4):
            picked = sorted(rng.sample(range(n), rng.randint(1, n)))
            proof = multiproof(levels, picked)
            assert root_from_multiproof(n, {i: leaves[i] for i in picked}, proof) == levels[-1][0]
            other = {i: leaves[i] for i in picked} | {picked[0]: leaf_hash(6, picked[0], b"x")}
            assert root_from_multiproof(n, other, proof) != levels[-1][0]
            if proof:
                with pytest.raises(OpeningError):
                    root_from_multiproof(n, {i: leaves[i] for i in picked}, proof + proof[:1])


# ------------------------------------------------------------------ honest miners
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
async def test_honest_miners_commit_and_every_block_opens_and_passes(world, miner, dtype):
    server = await miner(engine(world, dtype))
    assert server.health().committed_bytes == 0
    async with MinerClient(world["wallets"]["validator"].hotkey) as client:
        opener = openings(world, client)
        result = await answer(client, server, temperature=0.0 if dtype == "float32" else 0.8, request_id=dtype)
        final = result.final
        c = final.state_commitment
        assert c is not None and c.boundaries == [3, 6, 9, 12, 13]
        # the health says what the kept states hold (the soak judges the miner's memory less that bounded store)
        rows = c.positions * len(c.boundaries) * world["models"]["float32"][0].config.hidden_size * 4
        assert rows < server.health().committed_bytes < 4 * rows
        assert c.positions == len(PROMPT) + len(result.token_ids) - 1
        assert verify_final(final, result.body, result.token_ids, server.hotkey)
        assert verify_response(final.signature, result.body, result.token_ids, server.hotkey, final.seed, state_root=c.root)
        assert not verify_response(final.signature, result.body, result.token_ids, server.hotkey, final.seed)  # root covered
        precision = server.capabilities_document().decode()
        for block in range(BLOCKS):
            record = await opener.open(PROMPT, result, dtype, url=server.url, hotkey=server.hotkey, block=block)
            v = record.verdict
            assert v.passed, (block, v.reason)
            assert v.state.tokens == c.positions and v.head is not None and v.head.tokens >= 4
            assert record.cost.bytes_read >= 0 and record.cost.peak_resident_bytes <= 32 << 20
            assert 0 < record.check_flops < record.checked_flops
        assert dtype in precision


# ------------------------------------------------------------------ liars
@pytest.mark.parametrize("layer, lie_at, name", [
    (4, lambda t: t % 3 == 0, "a third of the positions in layers 3-5"),
    (11, lambda t: t == 17, "one position in layers 9-11"),
])
async def test_a_miner_lying_in_one_block_is_caught_by_its_openings(world, miner, layer, lie_at, name):
    eng = engine(world)
    liar = LiarModelHook(eng.model, layer, lie_at)
    try:
        server = await miner(eng)
        async with MinerClient(world["wallets"]["validator"].hotkey) as client:
            opener = openings(world, client)
            lying_block = layer // 3
            blamed_after = None
            for k in range(12):
                result = await answer(client, server, request_id=f"liar-{layer}-{k}")
                record = await opener.open(PROMPT, result, "float32", url=server.url, hotkey=server.hotkey,
                                           block=[lying_block, (lying_block + 1 + k) % BLOCKS][k % 2])
                v = record.verdict
                if record.block != (3 * lying_block, 3 * lying_block + 3):
                    assert v.passed or v.check == "state_openings", (record.block, v.reason)  # later blocks: consistent
                elif layer == 4:
                    assert not v.passed and v.check in ("state_opening", "state_openings"), v.reason
                if v.hard:
                    blamed_after = k + 1
                    assert v.check == "state_openings" and ("far off" in v.reason or "outside" in v.reason)
                    break
            assert blamed_after is not None and blamed_after <= 12, name
    finally:
        liar.remove()


async def test_a_refusal_and_an_opening_that_does_not_chain_fail_hard_at_once(world, miner):
    for wrap, check in ((RefusingEngine, "state_opening_refused"), (ForgingEngine, "state_opening_forged")):
        server = await miner(wrap(engine(world)))
        async with MinerClient(world["wallets"]["validator"].hotkey) as client:
            result = await answer(client, server, request_id=check)
            record = await openings(world, client).open(PROMPT, result, "float32", url=server.url,
                                                        hotkey=server.hotkey, block=2)
            assert record.verdict.check == check and record.verdict.hard, record.verdict
            assert [f.hard for f in record.verdict.failures] == [True]


async def test_only_the_validator_that_asked_can_open_an_answer(world, miner, make_wallets, tmp_path):
    server = await miner(engine(world))
    async with MinerClient(world["wallets"]["validator"].hotkey) as client:
        result = await answer(client, server, request_id="mine")
    c = result.final.state_commitment
    eng = server.engine
    asks = [StateAsk(3, (0, 1))]
    assert eng.open_states("mine", c.root, asks, world["wallets"]["validator"].hotkey.ss58_address).opened
    with pytest.raises(OpeningError):
        eng.open_states("mine", c.root, asks, "5Someone")
    with pytest.raises(OpeningError, match="positions"):
        eng.open_states("mine", c.root, [StateAsk(3, (c.positions,))], world["wallets"]["validator"].hotkey.ss58_address)


def test_no_commitment_costs_nothing_in_the_forward(world):
    """With commitments off, the engine's forward never stops at boundaries; with them on it records the states
    it committed to, and the boundaries follow the model's block size."""
    model = world["models"]["float32"][0]
    assert commit_boundaries(model.config, 3) == (3, 6, 9, 12, 13)
    assert commit_boundaries(model.config, 1) == tuple(range(1, 14))
    with pytest.raises(ValueError, match="divide"):
        commit_boundaries(model.config, 2)
    cache = model.new_cache()
    assert cache.state_log is None
    calls = []
    model._run_recording, original = (lambda *a: calls.append(1)), model._run_recording
    try:
        model.forward([torch.tensor(PROMPT)], [cache])
    finally:
        model._run_recording = original
    assert not calls


def test_the_window_blames_a_lie_at_a_single_position_and_never_an_honest_window():
    env = load_stage_envelopes(str(ENVELOPE))[("float32", "state")]
    honest = [(0.0, None, 0, 50)] * 400
    assert judge_window(honest, env) is None
    single = [(0.0, None, 1 if k % 4 == 0 else 0, 50) for k in range(28)]  # 7 far-off positions in 1,400
    assert judge_window(single, env) and "far off" in judge_window(single, env)
    bf16 = load_stage_envelopes(str(ENVELOPE))[("bfloat16", "state")]
    assert judge_window([(0.0, None, 2, 50)] * 40, bf16) is None  # bf16 moves a few positions honestly
