"""Stage checks (scoring/stage_checks.py) against real Stages of the tiny checkpoint: honest stages in fp32 and
in bf16 (weights and wire) are never blamed, each cheater of localnet/cheats/stage.py is blamed within its
stated number of challenges, the receipt-chain audit catches a driver's forged, stale, gapped or tampered
receipts, and bisection of a recorded route names the one cheating stage wherever it sits in a 4-stage chain.
Receipts are signed with real sr25519 keys; the validator's reference is its own copy of the weights."""
import zlib

import numpy as np
import pytest
import torch
from bittensor.sp_core import Keypair

from inference.serving.builders import load_reference_model
from inference.swarm.stage import HeadOutput, LayerRange, Stage
from localnet.cheats.stage import (EchoStage, LongPositionLiarStage, OtherWeightsStage, ReplayStage, SessionLiarStage,
                                   SkipLayerStage, WireRounding)
from neurons.swarm.codec import decode_inputs, encode_head_output, encode_ids, encode_state
from protocol.stage import Receipt, sign_receipt, state_sha256
from scoring.stage_checks import (HopRecord, SeedCommitment, Thresholds, audit_receipts, audit_route, bisect_route,
                                  challenge_steps, decode_wire_state, judge_tokens, plan_steps, projection,
                                  reference_stage, run_challenge, verify_reveal)

BLOCKS = [(0, 3), (3, 6), (6, 9), (9, 13)]
TEXT = (b"The validator sends a stage a residual state and compares the output with its own computation of "
        b"the same layer block. Honest numerics drift a little in bf16; a stage that skips a layer drifts a lot. "
        b"def route(stages):\n    for s in stages:\n        x = s.forward(x)\n    return x\n") * 3


@pytest.fixture(scope="module")
def validator_model(tiny_checkpoint):
    model, _, _ = load_reference_model(tiny_checkpoint, verify=False)
    return model


def prompt(rng, n=100):
    off = int(rng.integers(0, len(TEXT) - n))
    return list(TEXT[off:off + n])


def challenge(stage, model, layers, rng, seen=None, max_tokens=96, min_tokens=16):
    plan = plan_steps(rng, max_tokens, min_tokens=min_tokens)
    steps = challenge_steps(model, layers, prompt(rng), plan)
    return run_challenge(stage, reference_stage(model, layers.start, layers.stop), steps,
                         session_id=f"s{int(rng.integers(1 << 40)):x}", outputs_seen=seen)


def test_commitment_reveal_and_projection():
    c = SeedCommitment.new()
    assert verify_reveal(c.digest, c.seed, c.nonce)
    assert not verify_reveal(c.digest, c.seed + 1, c.nonce)
    assert not verify_reveal(c.digest, c.seed, c.nonce[:-1] + ("0" if c.nonce[-1] != "0" else "1"))
    assert torch.equal(projection(7, 128, 16), projection(7, 128, 16))
    assert not torch.equal(projection(7, 128, 16), projection(8, 128, 16))


def test_judge_tokens_needs_a_run_of_bad_tokens():
    t = Thresholds()
    scattered = [i % 20 == 0 for i in range(200)]  # 5% isolated outliers: the honest bf16 picture
    assert judge_tokens(scattered, t)[0]
    clustered = [False] * 50 + [True] * 9 + [False] * 50  # the worst honest bf16 window measured
    assert judge_tokens(clustered, t)[0]
    run = [False] * 50 + [True] * 12 + [False] * 50
    ok, why = judge_tokens(run, t)
    assert not ok and "12 of 16" in why
    assert not judge_tokens([True] * 4, t)[0] and judge_tokens([True, False, False, False, False], t)[0]


def test_wire_states_decode_to_what_was_hashed():
    g = torch.Generator().manual_seed(0)
    from inference.model.k3 import ResidualState
    state = ResidualState((5,), [torch.randn(5, 64, generator=g)], torch.randn(5, 64, generator=g))
    for dtype in ("float32", "bfloat16"):
        specs, body = encode_state(state, dtype)
        back = decode_wire_state(specs, body)
        ref = decode_inputs([(s, memoryview(body)[o:o + s.nbytes]) for s, o in
                             zip(specs, np.cumsum([0] + [s.nbytes for s in specs])[:-1])], False, 64)
        assert torch.equal(back.partial, ref.partial) and torch.equal(back.blocks[0], ref.blocks[0])
    specs, body = encode_ids([3, 4, 5])
    assert decode_wire_state(specs, body).tolist() == [3, 4, 5]
    head = HeadOutput("score", logprobs=[None, -1.5], row_tops=[[], [(3, -0.5)]])
    assert decode_wire_state([], encode_head_output(head)).row_tops == [[], [(3, -0.5)]]


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_honest_stages_are_never_blamed(tiny_checkpoint, validator_model, precision):
    rng = np.random.default_rng({"fp32": 11, "bf16": 12}[precision])
    results = []
    for a, b in BLOCKS:
        layers = LayerRange(a, b, 13)
        if precision == "fp32":
            stage = Stage.from_checkpoint(tiny_checkpoint, layers)
        else:
            stage = WireRounding(Stage.from_checkpoint(tiny_checkpoint, layers, dtype=torch.bfloat16))
        seen: dict = {}
        for _ in range(2):
            r = challenge(stage, validator_model, layers, rng, seen)
            results.append(r)
            assert r.ok, f"honest {precision} stage {a}-{b - 1} blamed: {r.reason}"
    if precision == "fp32":  # same weights, same code: bit-identical
        assert all(max(r.stats.rel_l2) == 0.0 for r in results)
    else:  # bf16 drifts, but the median token by < 1% (state) or < 0.05 nats (head)
        assert max(r.median_rel_l2 for r in results[:-2]) < 0.01
        assert max(r.median_rel_l2 for r in results[-2:]) < 0.05
        assert any(max(r.stats.rel_l2) > 0 for r in results)


# cheater, its block, the most challenges it may take (stated in docs/swarm.md section 10)
CHEATERS = [
    (OtherWeightsStage, (3, 6), 1, {}),
    (OtherWeightsStage, (9, 13), 1, {}),
    (SkipLayerStage, (0, 3), 1, {}),
    (SkipLayerStage, (6, 9), 1, {"skip_layer": 7}),
    (EchoStage, (3, 6), 1, {}),
    (ReplayStage, (6, 9), 1, {}),
    (SessionLiarStage, (3, 6), 12, {"one_in": 3}),
    # caught only by a challenge of >= 60 tokens (12 lying positions past 48 in a window of 16): lengths are
    # log-uniform in [16, 96], so P = ln(96/60)/ln(6) = 0.26 per challenge; 24 challenges miss with 0.07%
    (LongPositionLiarStage, (6, 9), 24, {"from_position": 48}),
]


@pytest.mark.parametrize("cls,block,limit,kw", CHEATERS, ids=lambda v: getattr(v, "__name__", None))
def test_each_cheater_is_blamed_within_its_limit(tiny_checkpoint, validator_model, cls, block, limit, kw):
    layers = LayerRange(block[0], block[1], 13)
    stage = cls.from_checkpoint(tiny_checkpoint, layers, **kw)
    rng = np.random.default_rng(zlib.crc32(f"{cls.__name__}{block}".encode()))  # the same draws every run
    seen: dict = {}
    for k in range(1, limit + 1):
        r = challenge(stage, validator_model, layers, rng, seen)
        if not r.ok:
            break
    assert not r.ok, f"{cls.__name__} on {block} passed {limit} challenges"
    assert r.reason


def test_a_liar_is_honest_where_it_does_not_lie(tiny_checkpoint, validator_model):
    """The selective liars really pass short or unlucky challenges: a validator must vary both."""
    layers = LayerRange(6, 9, 13)
    liar = LongPositionLiarStage.from_checkpoint(tiny_checkpoint, layers, from_position=48)
    r = challenge(liar, validator_model, layers, np.random.default_rng(0), max_tokens=40)
    assert r.ok and max(r.stats.rel_l2) == 0.0


# ------------------------------------------------------------------ routes: receipts, audit, bisection
KEYS = [Keypair.create_from_uri(f"//stage-check-{i}") for i in range(4)]
DRIVER = Keypair.create_from_uri("//stage-check-driver")
REGISTERED = {k.ss58_address: blk for k, blk in zip(KEYS, BLOCKS)}


def relay(stages, route_id, session, token_ids, chunks, wire_dtype="float32", score=True):
    """The validator relaying a route (each stage's output comes back to it before it goes on): per step and
    stage a HopRecord with the stage's signed receipt and the exact wire bytes in and out. Returns
    (records, {step: sha256 of what the driver sent}, head outputs)."""
    records, driver_inputs, heads, pos = [], {}, [], 0
    for step, n in enumerate(chunks):
        ids = token_ids[pos:pos + n]
        specs, body = encode_ids(ids)
        driver_inputs[step] = state_sha256(specs, body)
        for (stage, key) in stages:
            x = decode_wire_state(specs, body)
            head = stage.layers.has_head
            targets = ([int(t) for t in token_ids[pos + 1:pos + n + 1]] + [-1] * n)[:n] if head and score else None
            out = stage.forward(session, pos, x, "score" if head else "none", targets, 2 if head else 0)
            if isinstance(out, HeadOutput):
                out_specs, out_body = [], encode_head_output(out)
                heads.append(out)
            else:
                out_specs, out_body = encode_state(out, wire_dtype)
            receipt = sign_receipt(key, route_id=route_id, session=session, step=step,
                                   layers=[stage.layers.start, stage.layers.stop], fingerprint="tiny",
                                   input_sha256=state_sha256(specs, body),
                                   output_sha256=state_sha256(out_specs, out_body))
            records.append(HopRecord(receipt, pos, tuple(specs), bytes(body), tuple(out_specs), bytes(out_body),
                                     "score" if head else "none", tuple(targets) if targets else None,
                                     2 if head else 0))
            specs, body = out_specs, out_body
        pos += n
    return records, driver_inputs, heads


def open_route(stages, session):
    for s, _ in stages:
        s.open(session)


@pytest.fixture(scope="module")
def honest_stages(tiny_checkpoint):
    return [Stage.from_checkpoint(tiny_checkpoint, LayerRange(a, b, 13)) for a, b in BLOCKS]


@pytest.fixture(scope="module")
def references(validator_model):
    return {blk: reference_stage(validator_model, *blk) for blk in BLOCKS}


def test_an_honest_route_audits_clean_and_bisects_to_nobody(honest_stages, references):
    stages = list(zip(honest_stages, KEYS))
    open_route(stages, "honest")
    ids = list(TEXT[:40])
    records, inputs, heads = relay(stages, "route-honest", "honest", ids, [24, 8, 1, 1, 1], "bfloat16")
    assert audit_route(records, "route-honest", "honest", REGISTERED, 13, inputs).ok
    blamed, verdicts = bisect_route(records, references, seed=5)
    assert blamed is None and len(verdicts) == 4 and all(v.ok for v in verdicts)


@pytest.mark.parametrize("position", range(4))
def test_bisection_blames_the_one_cheater_wherever_it_sits(tiny_checkpoint, honest_stages, references, position):
    blk = BLOCKS[position]
    cheat = SkipLayerStage.from_checkpoint(tiny_checkpoint, LayerRange(*blk, 13))
    stages = [(cheat if i == position else s, k) for i, (s, k) in enumerate(zip(honest_stages, KEYS))]
    sid = f"cheat-at-{position}"
    open_route(stages, sid)
    records, inputs, _ = relay(stages, f"route-{position}", sid, list(TEXT[5:45]), [24, 8, 1, 1, 1])
    assert audit_route(records, f"route-{position}", sid, REGISTERED, 13, inputs).ok  # receipts are genuine
    blamed, verdicts = bisect_route(records, references, seed=9)
    assert blamed == KEYS[position].ss58_address
    assert [v.ok for v in verdicts] == [True] * position + [False]  # honest ones before it pass; none after


def _recipe(records, i, **update):
    r = records[i].receipt.model_copy(update=update)
    return records[:i] + [HopRecord(r, *[getattr(records[i], f) for f in
                                         ("position", "input_specs", "input_body", "output_specs", "output_body",
                                          "mode", "targets", "top_k")])] + records[i + 1:]


def test_driver_side_receipt_attacks_are_the_drivers_fault(honest_stages):
    stages = list(zip(honest_stages, KEYS))
    open_route(stages, "attacked")
    records, inputs, _ = relay(stages, "route-a", "attacked", list(TEXT[:30]), [20, 1])
    assert audit_route(records, "route-a", "attacked", REGISTERED, 13, inputs).ok

    # receipts the stages never signed: the driver signs in a stage's name
    forged = sign_receipt(DRIVER, **records[1].receipt.model_dump(exclude={"stage", "signature"}))
    forged = forged.model_copy(update={"stage": KEYS[1].ss58_address})
    bad = records[:1] + [HopRecord(forged, *[getattr(records[1], f) for f in (
        "position", "input_specs", "input_body", "output_specs", "output_body", "mode", "targets", "top_k")])] \
        + records[2:]
    a = audit_route(bad, "route-a", "attacked", REGISTERED, 13, inputs)
    assert not a.ok and a.blame == "driver" and "not signed" in a.problem

    # a receipt signed by a key that is not a registered stage miner
    own = sign_receipt(DRIVER, **records[2].receipt.model_dump(exclude={"stage", "signature"}))
    a = audit_route(records[:2] + [HopRecord(own, *[getattr(records[2], f) for f in (
        "position", "input_specs", "input_body", "output_specs", "output_body", "mode", "targets", "top_k")])]
        + records[3:], "route-a", "attacked", REGISTERED, 13, inputs)
    assert not a.ok and a.blame == "driver" and "not a registered" in a.problem

    # an edited receipt (the signature no longer covers it)
    a = audit_route(_recipe(records, 0, output_sha256="0" * 64), "route-a", "attacked", REGISTERED, 13, inputs)
    assert not a.ok and a.blame == "driver"

    # stale: genuine receipts of another route presented for this one
    a = audit_route(records, "route-b", "attacked", REGISTERED, 13, inputs)
    assert not a.ok and "another route" in a.problem

    # a stage left out: layers not covered / the chain broken
    step0 = [r.receipt for r in records if r.receipt.step == 0]
    a = audit_receipts(step0[:2] + step0[3:], "route-a", "attacked", 0, inputs[0], REGISTERED, 13)
    assert not a.ok and "missing" in a.problem
    a = audit_receipts(step0[:3], "route-a", "attacked", 0, inputs[0], REGISTERED, 13)
    assert not a.ok and "not covered" in a.problem

    # the driver's input is not what the first stage signed for
    a = audit_receipts(step0, "route-a", "attacked", 0, "1" * 64, REGISTERED, 13)
    assert not a.ok and "does not start" in a.problem

    # tampered recorded state (to get an honest stage blamed in bisection)
    rec = records[1]
    body = bytearray(rec.output_body)
    body[0] ^= 1
    tampered = records[:1] + [HopRecord(rec.receipt, rec.position, rec.input_specs, rec.input_body,
                                        rec.output_specs, bytes(body), rec.mode, rec.targets, rec.top_k)] + records[2:]
    a = audit_route(tampered, "route-a", "attacked", REGISTERED, 13, inputs)
    assert not a.ok and a.blame == "driver" and "not what it signed" in a.problem

    # the same receipt presented twice
    a = audit_route(records + records[:1], "route-a", "attacked", REGISTERED, 13, inputs)
    assert not a.ok and a.blame == "driver"


def test_a_stage_claiming_other_layers_is_blamed(honest_stages):
    stages = list(zip(honest_stages, KEYS))
    open_route(stages, "claims")
    records, inputs, _ = relay(stages, "route-c", "claims", list(TEXT[:12]), [12])
    registered = dict(REGISTERED)
    registered[KEYS[2].ss58_address] = (6, 10)
    a = audit_route(records, "route-c", "claims", registered, 13, inputs)
    assert not a.ok and a.blame == KEYS[2].ss58_address
    assert isinstance(records[0].receipt, Receipt)


def test_a_route_over_the_wire_records_steps_that_audit(tiny_checkpoint):
    """Stage servers on loopback (in this process), the route driver with `record_steps`: every recorded step's
    receipts pass the audit against the stages' registered layers; a receipt the driver forges does not."""
    import asyncio

    from inference.model.config import ModelConfig
    from inference.model.tokenizer import load_tokenizer
    from neurons.swarm.route import RouteDriver, RouteEngine, StaticDirectory
    from neurons.swarm.stage_server import StageServer

    async def main():
        servers = [StageServer(Stage.from_checkpoint(tiny_checkpoint, LayerRange(a, b, 13)), k)
                   for (a, b), k in zip(BLOCKS, KEYS)]
        for s in servers:
            await s.start()
        driver = RouteDriver(StaticDirectory([s.url for s in servers]), DRIVER, ModelConfig.tiny(), record_steps=8)
        engine = RouteEngine(driver, load_tokenizer(tiny_checkpoint, ModelConfig.tiny()), prefill_chunk=8)
        try:
            await engine.start()
            scored = await engine.score(list(TEXT[:20]))
            return scored, list(driver.records)
        finally:
            await engine.stop()
            for s in servers:
                await s.close()

    scored, records = asyncio.run(asyncio.wait_for(main(), 120))
    assert len(scored) == 19 and len(records) == 3  # 20 tokens in chunks of 8
    for rec in records:
        a = audit_receipts(list(rec.receipts), rec.route_id, rec.session, rec.step,
                           state_sha256(list(rec.input_specs), rec.input_body), REGISTERED, 13)
        assert a.ok, a.problem
        assert rec.receipts[-1].output_sha256 == state_sha256([], rec.result_body)
    rec = records[0]
    forged = sign_receipt(DRIVER, **rec.receipts[2].model_dump(exclude={"stage", "signature"}))
    forged = forged.model_copy(update={"stage": KEYS[2].ss58_address})
    a = audit_receipts([*rec.receipts[:2], forged, rec.receipts[3]], rec.route_id, rec.session, rec.step,
                       state_sha256(list(rec.input_specs), rec.input_body), REGISTERED, 13)
    assert not a.ok and a.blame == "driver"
