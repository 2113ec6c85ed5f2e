"""Stage checks (scoring/stage_checks.py) and the stage judge (scoring/stage_judge.py) on real Stages of the trained
tiny K3, in process: route sessions driven through three blocks, each stage's recorded steps re-run on the
validator's reference and judged against the model's measured stage envelope.

- the comparison: malformed outputs and changed pass-through fail outright; the recheck of a session with a
  rewind in it equals the stage's own outputs bit for bit in fp32;
- the judge: the binomial verdict over a window, bounds set on half of the honest checks and counted on the other
  half, the floors, a malformed envelope section refused with the reason;
- honest stages in fp32, bf16 (weights and wire) and fp16 are never blamed over many sessions; every in-process
  cheater of localnet/cheats/stage.py is blamed within its stated number of checked sessions;
- the receipt audit: a driver's forged, foreign, edited, stale, gapped or replayed receipts are the driver's fault;
  a stage signing for layers it does not announce is blamed itself.
"""
import random
from pathlib import Path

import pytest
import torch
from bittensor.sp_core import Keypair

from benchmarks.stage_envelope import RouteStage, drive_session, prompt_ids, session_plan
from inference.model import load_tokenizer, read_config
from inference.model.k3 import ResidualState
from inference.serving.builders import load_reference_model
from inference.swarm.stage import HeadOutput, LayerRange, Stage
from localnet.cheats.stage import CHEAT_DEFAULT_DTYPES, CHEATS
from neurons.swarm.codec import encode_ids
from neurons.swarm.route import NUMERICS_ORDER
from protocol.stage import sign_receipt, state_sha256
from scoring.stage_checks import (OpenedStep, audit_receipts, compare_heads, compare_states, recheck_opened,
                                  reference_stage)
from scoring.model_envelope import binomial_tail
from scoring.stage_judge import (CheckStats, NumericsEnvelope, StageEnvelopeError, derive_envelope,
                                 load_stage_envelopes, parse_stage_section, stage_envelope_section, verdict)

ROOT = Path(__file__).resolve().parents[1]
ASSET = ROOT / "inference" / "model" / "assets" / "tiny_trained"
ENVELOPE = ROOT / "scoring" / "envelopes" / "tiny_trained.json"
BLOCKS = [(0, 3), (3, 9), (9, 13)]
# cheat: most checked sessions (in the middle block) until blamed with the shipped envelope
CHEATERS = {"echo": 5, "skip-layer": 5, "other-weights": 5, "sparse-liar": 5, "fewer-experts": 8, "quantized": 8,
            "misdeclared": 5, "watch-aware": 5, "replay": 6}
HONEST_SESSIONS = 6
HONEST_SEEDS = {"float32": 1, "bfloat16": 2, "float16": 3}  # fixed: the same sessions on every run


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def world():
    config = read_config(ASSET)
    model, _, _ = load_reference_model(ASSET, verify=False)
    return {"config": config, "tokenizer": load_tokenizer(ASSET, config),
            "references": [reference_stage(model, a, b) for a, b in BLOCKS],
            "envelopes": load_stage_envelopes(str(ENVELOPE))}


def route_of(middle: Stage, wire: str = "float32", dtype=torch.float32) -> list[RouteStage]:
    a, c = BLOCKS[0], BLOCKS[2]
    return [RouteStage(Stage.from_checkpoint(ASSET, LayerRange(*a, 13), dtype), wire),
            RouteStage(middle, wire), RouteStage(Stage.from_checkpoint(ASSET, LayerRange(*c, 13), dtype), wire)]


def sessions(world, route, n, seed):
    """`n` sessions through `route`; per session the recorded steps of each stage."""
    rng = random.Random(seed)
    out = []
    for k in range(n):
        prompt = prompt_ids(rng, world["tokenizer"], rng.randint(8, 120))
        out.append(drive_session(route, prompt, session_plan(rng, len(prompt), rng.randint(2, 24)),
                                 temperature=rng.choice([0.0, 0.8]), seed=rng.getrandbits(62), session=f"s{seed}-{k}"))
    return out


# ------------------------------------------------------------------ the comparison
def test_malformed_outputs_and_changed_pass_through_fail_outright():
    g = torch.Generator().manual_seed(0)
    want = ResidualState((4,), [torch.randn(4, 8, generator=g)], torch.randn(4, 8, generator=g))
    assert compare_states(want, want, 1, seed=3).ok
    shape = ResidualState((4,), [], want.partial)
    assert not compare_states(want, shape, 1, seed=3).ok
    nan = ResidualState((4,), want.blocks, want.partial.clone().fill_(float("nan")))
    assert "NaN" in compare_states(want, nan, 1, seed=3).reason
    moved = ResidualState((4,), [want.blocks[0] * 1.5], want.partial)
    assert "pass-through" in compare_states(want, moved, 1, seed=3).reason
    a = HeadOutput("score", logprobs=[None, -1.0], row_tops=[[], [(3, -1.0)]])
    assert compare_heads(a, a).ok and not compare_heads(a, HeadOutput("score", logprobs=[None])).ok
    b = HeadOutput("score", logprobs=[None, -1.5], row_tops=[[], [(3, -1.5)]])
    c = compare_heads(a, b)
    assert c.ok and c.bad == [True] and c.rel_l2 == [pytest.approx(0.5)]


def test_a_recheck_with_rewinds_equals_the_stage_bit_for_bit_in_fp32(world):
    """A session as a speculative route leaves it: a forward that rewinds two positions first. The reference,
    re-run over the recorded steps with the same rewind, gives the stage's outputs exactly."""
    stage = Stage.from_checkpoint(ASSET, LayerRange(*BLOCKS[1], 13))
    before = Stage.from_checkpoint(ASSET, LayerRange(*BLOCKS[0], 13))
    ids = torch.tensor(prompt_ids(random.Random(1), world["tokenizer"], 30))
    steps = []
    for s in (stage, before):
        s.open("r")
    x0 = before.forward("r", 0, ids[:20])
    steps.append(OpenedStep(0, 0, "none", None, 0, None, x0, stage.forward("r", 0, x0)))
    x1 = before.forward("r", 20, ids[20:26])
    steps.append(OpenedStep(1, 20, "none", None, 0, None, x1, stage.forward("r", 20, x1)))
    before.rewind("r", 24)
    x2 = before.forward("r", 24, ids[24:30])
    steps.append(OpenedStep(2, 24, "none", None, 0, 24, x2, stage.rewind_and_forward("r", 24, 24, x2)))
    c = recheck_opened(steps, world["references"][1], seed=1)
    assert c.ok and len(c.rel_l2) == 32 and max(c.rel_l2) == 0.0


# ------------------------------------------------------------------ the judge
def test_the_verdict_is_a_binomial_test_over_the_window():
    env = NumericsEnvelope("bfloat16", "state", 0.01, 0.2, 1000, 1000, 1, 0.003)
    assert not verdict([None] * 50, env).blame
    assert not verdict([None] * 20 + ["x"] * 2, env).blame  # two outside: an honest stage does that
    assert not verdict([None] * 20 + ["far off"] * 4, env).blame  # 4 of 24: chance 8e-7, not yet certain
    v = verdict([None] * 20 + ["far off"] * 5, env)
    assert v.blame and v.outside == 5 and v.chance < 1e-7 and "far off" in v.reason
    assert not verdict(["x"] * 4, NumericsEnvelope("float16", "state", 0.01, 0.2, 10, 10, 2, 0.3)).blame


def test_bounds_are_set_on_half_the_honest_checks_and_counted_on_the_rest():
    honest = [CheckStats(40, 0, 0.003 + 0.0001 * (i % 7), 0.006, 0.02) for i in range(200)]
    env = derive_envelope("bfloat16", "state", honest)
    assert env.checks == env.heldout == 100 and env.heldout_outside == 0 and 0 < env.p_outside < 0.035
    assert env.max_median == pytest.approx(2 * 0.0036)
    assert env.outside(CheckStats(40, 0, 0.02, 0.03, 0.05)) and not env.outside(CheckStats(3, 3, 1.0, 1.0, 1.0))
    exact = derive_envelope("float32", "state", [CheckStats(40, 0, 0.0, 0.0, 0.0)] * 10)
    assert exact.max_median == 1e-4  # the floor: other thread counts and kernels move fp32 a few ulps
    bad = derive_envelope("bfloat16", "state", [CheckStats(40, 2 * (i % 4 == 0), 0.003, 0.006, 0.1)
                                                 for i in range(40)])
    assert bad.max_bad_fraction == pytest.approx(0.1)  # 2 x the worst: 2 of 40
    assert "far off" in bad.outside(CheckStats(32, 20, 0.004, 0.3, 0.5))  # a liar below any window


def test_a_malformed_stage_section_is_refused_with_the_reason(tmp_path):
    good = stage_envelope_section([NumericsEnvelope("float32", "state", 1e-4, 0.0, 10, 10, 0, 0.2)])
    assert parse_stage_section(good)[("float32", "state")].max_median == 1e-4
    with pytest.raises(StageEnvelopeError, match="another version"):
        parse_stage_section({**good, "version": 99})
    bad = {**good, "numerics": {"float32": {"state": {**good["numerics"]["float32"]["state"], "p_outside": 0}}}}
    with pytest.raises(StageEnvelopeError, match="inconsistent"):
        parse_stage_section(bad)
    (tmp_path / "none.json").write_text("{}")
    assert load_stage_envelopes(str(tmp_path / "none.json")) is None  # no stage section: exact checks only


# ------------------------------------------------------------------ honest stages and cheaters
@pytest.mark.parametrize("dtype, wire", [(torch.float32, "float32"), (torch.bfloat16, "bfloat16"),
                                         (torch.float16, "float32")])
def test_honest_stages_stay_inside_their_envelope(world, dtype, wire):
    middle = Stage.from_checkpoint(ASSET, LayerRange(*BLOCKS[1], 13), dtype)
    route = route_of(middle, wire, dtype)
    numerics = str(dtype).split(".")[-1]
    outcomes = {i: [] for i in range(3)}
    for recorded in sessions(world, route, HONEST_SESSIONS, seed=HONEST_SEEDS[numerics]):
        for i, (ref, steps) in enumerate(zip(world["references"], recorded)):
            c = recheck_opened(steps, ref, seed=7)
            assert c.ok, c.reason
            kind = "head" if i == 2 else "state"
            outcomes[i].append(world["envelopes"][(numerics, kind)].outside(CheckStats.of(c)))
    for i, got in outcomes.items():
        kind = "head" if i == 2 else "state"
        envelope = world["envelopes"][(numerics, kind)]
        assert not verdict(got, envelope).blame, (i, got)
        # and no more checks outside than the envelope's measured share makes likely (1 in 1,000 for an honest stage)
        assert binomial_tail(len(got), sum(map(bool, got)), envelope.p_outside) > 1e-3, (envelope.p_outside, got)


@pytest.mark.parametrize("kind, limit", CHEATERS.items())
def test_each_cheater_is_blamed_within_its_limit(world, kind, limit):
    dtype_name, wire = CHEAT_DEFAULT_DTYPES.get(kind, ("float32", "float32"))
    cheat = CHEATS[kind].from_checkpoint(ASSET, LayerRange(*BLOCKS[1], 13), getattr(torch, dtype_name))
    route = route_of(cheat, wire)
    env = world["envelopes"][(max(cheat.numerics, wire, key=NUMERICS_ORDER.index), "state")]  # the validator's
    outcomes = []
    for recorded in sessions(world, route, limit, seed=len(kind)):
        c = recheck_opened(recorded[1], world["references"][1], seed=3)
        outcomes.append(env.outside(CheckStats.of(c)) if c.ok else f"exact: {c.reason}")
        if not c.ok or verdict(outcomes, env).blame:
            break
    assert (not c.ok) or verdict(outcomes, env).blame, f"{kind} not blamed in {limit} sessions: {outcomes}"


def test_two_adjacent_stages_covering_for_each_other_keep_the_answers_right_and_the_idle_one_is_blamed(world):
    """pair-cover: the first stage of an operator's pair computes nothing (echo), the next runs both blocks. The
    route's head sees what an honest route gives it, so the user's answers are right; the idle stage's own
    recorded outputs do not follow from its recorded inputs, which its check finds."""
    echo = CHEATS["pair-cover-echo"].from_checkpoint(ASSET, LayerRange(*BLOCKS[0], 13))
    cover = CHEATS["pair-cover"].from_checkpoint(ASSET, LayerRange(*BLOCKS[1], 13), cover=BLOCKS[0][0])
    last = Stage.from_checkpoint(ASSET, LayerRange(*BLOCKS[2], 13))
    paired, honest = [RouteStage(echo), RouteStage(cover), RouteStage(last)], route_of(
        Stage.from_checkpoint(ASSET, LayerRange(*BLOCKS[1], 13)))
    rng = random.Random(4)
    prompt = prompt_ids(rng, world["tokenizer"], 40)
    plan = session_plan(rng, len(prompt), 6)
    got = drive_session(paired, prompt, plan, temperature=0.0, seed=1, session="pair")
    want = drive_session(honest, prompt, plan, temperature=0.0, seed=1, session="honest")
    tokens = [[int(r.output.token_id) for r in run[2] if r.mode == "sample"] for run in (got, want)]
    assert tokens[0] == tokens[1] and len(tokens[0]) > 1  # the head's answers: the same tokens
    env = world["envelopes"][("float32", "state")]
    outcomes = []
    for recorded in sessions(world, paired, 6, seed=9):
        c = recheck_opened(recorded[0], world["references"][0], seed=3)
        outcomes.append(env.outside(CheckStats.of(c)) if c.ok else f"exact: {c.reason}")
        if not c.ok or verdict(outcomes, env).blame:
            break
    assert (not c.ok) or verdict(outcomes, env).blame, outcomes


# ------------------------------------------------------------------ receipts
KEYS = [Keypair.create_from_uri(f"//stage-check-{i}") for i in range(3)]
DRIVER = Keypair.create_from_uri("//stage-check-driver")
REGISTERED = {k.ss58_address: blk for k, blk in zip(KEYS, BLOCKS)}


def receipts_for(route_id: str, session: str, step: int, ids: list[int]) -> tuple[list, str]:
    """A chain of receipts for one step (hashes of made-up states), as three honest stages would sign it."""
    specs, body = encode_ids(ids)
    start = h = state_sha256(specs, body)
    out = []
    for i, (key, blk) in enumerate(zip(KEYS, BLOCKS)):
        nxt = state_sha256([], f"{session}:{step}:{i}".encode())
        out.append(sign_receipt(key, route_id=route_id, session=session, step=step, layers=list(blk),
                                fingerprint="tiny", input_sha256=h, output_sha256=nxt, driver=DRIVER.ss58_address))
        h = nxt
    return out, start


def test_driver_side_receipt_attacks_are_the_drivers_fault():
    chain, start = receipts_for("route-a", "s", 0, [5, 6, 7])
    assert audit_receipts(chain, "route-a", "s", 0, start, REGISTERED, 13).ok
    forged = sign_receipt(DRIVER, **chain[1].model_dump(exclude={"stage", "signature"}))
    a = audit_receipts([chain[0], forged.model_copy(update={"stage": KEYS[1].ss58_address}), chain[2]], "route-a",
                       "s", 0, start, REGISTERED, 13)
    assert not a.ok and a.blame == "driver" and "not signed" in a.problem
    a = audit_receipts([chain[0], forged, chain[2]], "route-a", "s", 0, start, REGISTERED, 13)
    assert not a.ok and a.blame == "driver" and "not a registered" in a.problem
    edited = chain[0].model_copy(update={"output_sha256": "0" * 64})
    assert audit_receipts([edited, *chain[1:]], "route-a", "s", 0, start, REGISTERED, 13).blame == "driver"
    a = audit_receipts(chain, "route-b", "s", 0, start, REGISTERED, 13)
    assert not a.ok and "another route" in a.problem
    a = audit_receipts([chain[0], chain[2]], "route-a", "s", 0, start, REGISTERED, 13)
    assert not a.ok and "missing" in a.problem
    a = audit_receipts(chain[:2], "route-a", "s", 0, start, REGISTERED, 13)
    assert not a.ok and "not covered" in a.problem
    a = audit_receipts(chain, "route-a", "s", 0, "1" * 64, REGISTERED, 13)
    assert not a.ok and "does not start" in a.problem
    seen: set = set()
    assert audit_receipts(chain, "route-a", "s", 0, start, REGISTERED, 13, seen).ok
    a = audit_receipts(chain, "route-a", "s", 0, start, REGISTERED, 13, seen)
    assert not a.ok and "presented before" in a.problem
    # the receipts of a session DRIVER opened, presented by another driver (copied: a stage on the route sees them)
    assert audit_receipts(chain, "route-a", "s", 0, start, REGISTERED, 13, driver=DRIVER.ss58_address).ok
    a = audit_receipts(chain, "route-a", "s", 0, start, REGISTERED, 13, driver=KEYS[0].ss58_address)
    assert not a.ok and a.blame == "driver" and f"a session {DRIVER.ss58_address} opened" in a.problem


def test_a_stage_claiming_other_layers_is_blamed_itself():
    chain, start = receipts_for("route-c", "s", 0, [1])
    registered = {**REGISTERED, KEYS[1].ss58_address: (3, 8)}
    a = audit_receipts(chain, "route-c", "s", 0, start, registered, 13)
    assert not a.ok and a.blame == KEYS[1].ss58_address

