"""Stage checks: challenges of one swarm stage against the validator's own computation of its block, the
audit of a route answer's receipt chain, and bisection of a failed route answer to the stage that diverged.

**Stage challenge.** The validator holds layer blocks in host memory (`reference_stage`: an in-process
`inference.swarm.Stage` over its own copy of the weights) and sends the stage under test a session that looks
like route traffic: a fresh session id, the residual states a real prompt produces entering the block (computed
by the validator's own layers before the block, or taken from a receipted route input), in prefill chunks then
single-token decode steps, at positions up to `max_tokens`. Every output is compared with the reference's
output on the same input:

- the new part of the state (block sums completed inside the block and the running partial) is projected per
  token on `projections` random Gaussian directions whose seed the validator committed to before the
  challenge (sha256 over a domain, the seed and a nonce) and reveals after; the statistics are the cosine and
  the relative L2 distance of the projected vectors per token, and a token far off is *bad*;
- the block sums the stage only passes through must come back as they went in (relative L2 within wire
  rounding);
- a head stage is challenged in teacher-forced `score` mode; a row is bad when its target logprob or a top-k
  logprob differs by too much.

A challenge fails when a window of consecutive tokens holds too many bad ones (`judge_tokens`): honest bf16
stages have isolated far-off tokens (router near-ties flipping an expert), cheaters have runs of them. The
thresholds (`Thresholds`) come from the honest drift measured for one block in fp32 and bf16
(benchmarks/stage_checks.py; numbers in docs/swarm.md section 10).

**Cross-check against two peers.** For a block the validator holds no copy of, `run_cross_check` sends the
same challenge to the stage under test and to two other stage miners of that block (the caller picks them on
other coldkeys than the challenged stage's and each other's), each in its own fresh session, and compares the
three answers pairwise with the same per-token statistics. The stage is blamed only when the two peers agree
with each other and both disagree with it; any other split (the peers disagree, or the stage agrees with one
peer only) is recorded as a disagreement and blames no one. A refused step, a replayed output or a malformed
answer of the challenged stage fails it as in a challenge; a peer that refuses leaves the check undecided.

**Route audit.** `audit_route` checks the receipts of one route answer: signed by the hotkeys registered for
the layers they claim, for this (fresh: validator-chosen) route id, session and step, chained from the hash of
what the driver sent (output hash of stage i = input hash of stage i + 1), covering every layer exactly once,
and, when the hop records are present, that the recorded states hash to what the stages signed. A receipt
that does not verify is the presenting driver's fault, not a stage's.

**Bisection.** `bisect_route` re-runs each stage's receipted inputs (every step of the session, in order) on
the validator's reference for that block and blames the first stage whose own outputs diverge from the
reference on its own inputs; stages after it computed honestly on a bad input and are not blamed.
"""
from __future__ import annotations

import hashlib
import json
import secrets
import time
from dataclasses import dataclass, field
from typing import Iterable, Protocol, Sequence

import numpy as np
import torch
from torch import Tensor

from inference.model.k3 import ResidualState
from inference.swarm.stage import HeadOutput, LayerRange, Stage, StageError
from protocol.stage import Receipt, WireTensorSpec, state_sha256, verify_receipt

COMMIT_DOMAIN = b"k3-subnet/stage-challenge/v1\n"


# ------------------------------------------------------------------ commitment to the projection seed
@dataclass(frozen=True)
class SeedCommitment:
    """The validator commits to `seed` (sha256 over domain, seed and a random nonce) before the challenge and
    reveals (seed, nonce) after, so the stage cannot know the checked directions beforehand and the validator
    cannot pick them afterwards to blame an honest stage."""

    seed: int
    nonce: str

    @classmethod
    def new(cls, seed: int | None = None) -> "SeedCommitment":
        return cls(secrets.randbits(63) if seed is None else int(seed), secrets.token_hex(16))

    @property
    def digest(self) -> str:
        return commitment_digest(self.seed, self.nonce)


def commitment_digest(seed: int, nonce: str) -> str:
    return hashlib.sha256(COMMIT_DOMAIN + f"{int(seed)}:{nonce}".encode()).hexdigest()


def verify_reveal(digest: str, seed: int, nonce: str) -> bool:
    return secrets.compare_digest(digest, commitment_digest(seed, nonce))


def projection(seed: int, width: int, k: int) -> Tensor:
    """[width, k] Gaussian directions from the revealed seed (same on every machine: torch's CPU generator)."""
    g = torch.Generator().manual_seed(int(seed) % (2**63))
    return torch.randn(width, k, generator=g, dtype=torch.float32) / k ** 0.5


# ------------------------------------------------------------------ comparison
@dataclass(frozen=True)
class Thresholds:
    """Pass limits per block, from the honest drift measured over one block of the tiny model, random and trained
    (fp32 reference vs bf16 weights and a bf16 wire, fp32 on other thread counts, chunked prefill;
    benchmarks/stage_rounds.py, numbers in docs/swarm.md section 10).

    Honest drift: fp32 stages on 1 or 2 threads and chunked prefill are bit-identical or within 1e-5; bf16 moves
    almost every token by ~0.3% (relative L2 of the projected new state), and a few tokens by up to 18% on the
    trained model (q99 0.02-0.04) and up to 60% on the random one, where bf16 flips a near-tied router's expert
    choice. So a single token can never condemn a stage. A token is *bad* when its cosine < `token_min_cosine`
    or its relative L2 > `token_max_rel_l2`: at 0.07 honest bf16 stages have 0.14% bad tokens on the trained
    model (1.0% on the random one) and at most 1 (4) in any 16, while every challenge of a stage serving other
    weights, skipping a layer or echoing its input holds >= 15 of 16 bad (at 0.1 one of 6 challenges of the
    other-weights stage on the trained model held only 11 of 16, and passed). A challenge fails when some window
    of `window` consecutive challenge tokens holds at least `window_bad` bad ones: 12 of 16, above the worst
    honest window measured on either model (9 of 16 on the random model in an earlier, longer run). Head stages:
    a row is bad when a target or top-k logprob differs by > `row_max_logprob_diff` (honest bf16 max 0.12 on the
    trained model). Pass-through block sums must come back within bf16 rounding."""

    token_min_cosine: float = 0.995
    token_max_rel_l2: float = 0.07
    row_max_logprob_diff: float = 0.15
    window: int = 16
    window_bad: int = 12
    max_passthrough_rel_l2: float = 0.02
    projections: int = 64


@dataclass
class Comparison:
    ok: bool  # False: the output is malformed (shape, non-finite, pass-through changed); tokens aside
    reason: str = ""
    cosine: list[float] = field(default_factory=list)  # per token (state) / 1.0 per row (head)
    rel_l2: list[float] = field(default_factory=list)  # per token (state) / logprob diff per row (head)
    bad: list[bool] = field(default_factory=list)  # per token or row
    passthrough_rel_l2: float = 0.0


def _new_part(state: ResidualState, input_blocks: int) -> Tensor:
    parts = list(state.blocks[input_blocks:]) + [state.partial]
    return torch.cat([p.float() for p in parts], dim=1)


def compare_states(reference: ResidualState, got: ResidualState, input_blocks: int, seed: int,
                   thresholds: Thresholds = Thresholds()) -> Comparison:
    """The stage's output state against the reference's for the same input, token by token (module doc)."""
    if len(got.blocks) != len(reference.blocks) or tuple(got.partial.shape) != tuple(reference.partial.shape) \
            or any(tuple(a.shape) != tuple(b.shape) for a, b in zip(got.blocks, reference.blocks)):
        return Comparison(False, f"output state has the wrong shape: {len(got.blocks)} block sums "
                                 f"{list(got.partial.shape)}, expected {len(reference.blocks)} "
                                 f"{list(reference.partial.shape)}")
    through = 0.0
    for a, b in zip(reference.blocks[:input_blocks], got.blocks[:input_blocks]):
        through = max(through, float((b.float() - a.float()).norm() / a.float().norm().clamp_min(1e-12)))
    ref, out = _new_part(reference, input_blocks), _new_part(got, input_blocks)
    if not bool(torch.isfinite(out).all()):
        return Comparison(False, "output holds NaN or infinite values")
    t = thresholds
    if through > t.max_passthrough_rel_l2:
        return Comparison(False, f"pass-through block sums changed (relative L2 {through:.3g} > "
                                 f"{t.max_passthrough_rel_l2})", passthrough_rel_l2=through)
    P = projection(seed, ref.shape[1], t.projections)
    pr, po = ref @ P, out @ P
    cos = torch.nn.functional.cosine_similarity(pr, po, dim=1, eps=1e-12)
    rel = (po - pr).norm(dim=1) / pr.norm(dim=1).clamp_min(1e-12)
    bad = (cos < t.token_min_cosine) | (rel > t.token_max_rel_l2)
    return Comparison(True, cosine=cos.tolist(), rel_l2=rel.tolist(), bad=bad.tolist(), passthrough_rel_l2=through)


def compare_heads(reference: HeadOutput, got: HeadOutput, thresholds: Thresholds = Thresholds()) -> Comparison:
    """Teacher-forced head answers, row by row: the target logprob and every top-k alternative the stage
    names that the reference also has; the alternatives' count must be what was asked."""
    if got.mode != reference.mode or len(got.logprobs) != len(reference.logprobs):
        return Comparison(False, f"head answer of the wrong kind ({got.mode}, {len(got.logprobs)} rows)")
    diffs, bad = [], []
    for r, (a, b) in enumerate(zip(reference.logprobs, got.logprobs)):
        if (a is None) != (b is None):
            return Comparison(False, f"row {r}: logprob present on one side only")
        if a is None:
            continue
        if not (isinstance(b, (int, float)) and np.isfinite(b)):
            return Comparison(False, f"row {r}: logprob {b!r} is not a finite number")
        worst = abs(a - b)
        ta, tb = reference.row_tops[r], got.row_tops[r] if r < len(got.row_tops) else []
        if len(ta) != len(tb):
            return Comparison(False, f"row {r}: {len(tb)} alternatives, asked for {len(ta)}")
        ref_lp = dict(ta)
        for tok, lp in tb:
            worst = max(worst, abs(ref_lp[tok] - lp) if tok in ref_lp else 0.0)
        diffs.append(worst)
        bad.append(worst > thresholds.row_max_logprob_diff)
    return Comparison(True, cosine=[1.0] * len(diffs), rel_l2=diffs, bad=bad)


def judge_tokens(bad: Sequence[bool], thresholds: Thresholds = Thresholds()) -> tuple[bool, str]:
    """(passes, reason): fails when a window of `window` consecutive tokens (all of them when fewer) holds
    `window_bad` or more bad ones (scaled down for shorter challenges)."""
    n = len(bad)
    if n == 0:
        return True, ""
    w = min(thresholds.window, n)
    need = max(1, -(-thresholds.window_bad * w // thresholds.window))
    counts = np.convolve(np.asarray(bad, dtype=np.int64), np.ones(w, dtype=np.int64), mode="valid")
    i = int(np.argmax(counts))
    if counts[i] >= need:
        return False, f"{int(counts[i])} of {w} tokens from challenge token {i} diverge (limit {need - 1})"
    return True, ""


# ------------------------------------------------------------------ the challenge
class StageUnderTest(Protocol):
    """What a challenge talks to: a `Stage` in process, or an adapter over the stage wire."""

    def open(self, session_id: str, route_id: str = "", **kw): ...

    def forward(self, session_id: str, position: int, inputs, mode: str = "none", targets=None,
                top_k: int = 0): ...

    def close(self, session_id: str) -> None: ...


def reference_stage(model, start: int, stop: int) -> Stage:
    """The validator's independent computation of layers [start, stop): a Stage over its own model copy."""
    return Stage(model, LayerRange(start, stop, model.config.num_layers), fingerprint="validator-reference")


@dataclass(frozen=True)
class ChallengeStep:
    position: int
    inputs: object  # token ids [n] or a ResidualState
    mode: str = "none"
    targets: list[int] | None = None
    top_k: int = 0


def plan_steps(rng: np.random.Generator, max_tokens: int, min_tokens: int = 8, max_chunk: int = 32,
               decode_steps: int = 3) -> list[tuple[int, int]]:
    """(position, tokens) of each forward: a length drawn log-uniformly in [min_tokens, max_tokens] (short
    and long positions both get checked), prefill in random chunks, the last `decode_steps` tokens one by one."""
    total = int(round(np.exp(rng.uniform(np.log(min_tokens), np.log(max_tokens)))))
    total = max(min_tokens, min(max_tokens, total))
    decode = min(decode_steps, total - 1)
    out, pos = [], 0
    while pos < total - decode:
        n = int(min(rng.integers(1, max_chunk + 1), total - decode - pos))
        out.append((pos, n))
        pos += n
    out += [(p, 1) for p in range(pos, total)]
    return out


def challenge_steps(validator_model, layers: LayerRange, token_ids: Sequence[int],
                    plan: list[tuple[int, int]], top_k: int = 4) -> list[ChallengeStep]:
    """The inputs a real route would send the block for this prompt, computed by the validator's own layers
    before the block (fresh states); head stages get teacher-forced `score` steps (targets: the next token)."""
    ids = torch.tensor(list(token_ids), dtype=torch.long)
    total = sum(n for _, n in plan)
    if len(ids) < total + (1 if layers.has_head else 0):
        raise ValueError(f"the prompt has {len(ids)} tokens; the plan needs {total + int(layers.has_head)}")
    if layers.has_embedding:
        inputs = [ids[p:p + n] for p, n in plan]
    else:
        before = reference_stage(validator_model, 0, layers.start)
        before.open("prefix")
        state = before.forward("prefix", 0, ids[:total])
        inputs = [ResidualState((n,), [b[p:p + n] for b in state.blocks], state.partial[p:p + n]) for p, n in plan]
    steps = []
    for (p, n), x in zip(plan, inputs):
        if layers.has_head:
            steps.append(ChallengeStep(p, x, "score", [int(t) for t in ids[p + 1:p + n + 1]], top_k))
        else:
            steps.append(ChallengeStep(p, x))
    return steps


class _TokenStats:
    """The summary numbers of a challenge's per-token statistics (`stats`), as the store keeps them."""

    stats: "Comparison"

    @property
    def median_rel_l2(self) -> float:
        return float(np.median(self.stats.rel_l2)) if self.stats.rel_l2 else 0.0

    @property
    def bad_fraction(self) -> float:
        return float(np.mean(self.stats.bad)) if self.stats.bad else 0.0


@dataclass
class ChallengeResult(_TokenStats):
    ok: bool
    reason: str
    commitment: str  # the sha256 digest the validator published before
    seed: int  # revealed after
    nonce: str
    steps: int
    tokens: int
    stats: Comparison  # per token over the whole challenge, in position order
    validator_cpu_s: float  # the reference computation and the comparison


def _compare(reference: Stage, want, got, seed: int, thresholds: Thresholds) -> Comparison:
    return _compare_outputs(reference.input_blocks, want, got, seed, thresholds)


def _compare_outputs(input_blocks: int, want, got, seed: int, thresholds: Thresholds) -> Comparison:
    if isinstance(want, HeadOutput):
        return compare_heads(want, got, thresholds) if isinstance(got, HeadOutput) else \
            Comparison(False, "a head stage answered a state")
    return compare_states(want, got, input_blocks, seed, thresholds) \
        if isinstance(got, ResidualState) else Comparison(False, "answered no residual state")


def _extend(acc: Comparison, c: Comparison) -> None:
    acc.cosine += c.cosine
    acc.rel_l2 += c.rel_l2
    acc.bad += c.bad
    acc.passthrough_rel_l2 = max(acc.passthrough_rel_l2, c.passthrough_rel_l2)


def run_challenge(stage: StageUnderTest, reference: Stage, steps: list[ChallengeStep],
                  commitment: SeedCommitment | None = None, thresholds: Thresholds = Thresholds(),
                  session_id: str | None = None, outputs_seen: dict[str, str] | None = None) -> ChallengeResult:
    """Send the steps to the stage (one fresh session), compare each output with the reference's, then judge
    the per-token statistics of the whole challenge (`judge_tokens`). A refused step, a malformed output, a
    changed pass-through, or an output bit-identical to one this stage gave for another input (`outputs_seen`,
    output digest -> input digest, kept per stage across challenges; honest compute never repeats bits for
    a different input) fails at once."""
    outputs_seen = {} if outputs_seen is None else outputs_seen
    commitment = commitment or SeedCommitment.new()
    sid = session_id or secrets.token_hex(12)
    ref_sid = "ref-" + sid
    cpu = 0.0
    acc = Comparison(True)
    reason = ""
    tokens = sum(_length(s.inputs) for s in steps)

    def result(ok: bool, why: str) -> ChallengeResult:
        return ChallengeResult(ok, why, commitment.digest, commitment.seed, commitment.nonce, len(steps), tokens,
                               acc, cpu)

    try:
        stage.open(sid, route_id=secrets.token_hex(8))
    except StageError as e:
        return result(False, f"the stage refused the session: {e.message}")
    reference.open(ref_sid)
    try:
        for i, step in enumerate(steps):
            try:
                got = stage.forward(sid, step.position, step.inputs, step.mode, step.targets, step.top_k)
            except StageError as e:
                reason = f"step {i} refused: {e.code}: {e.message}"
                break
            t0 = time.process_time()
            want = reference.forward(ref_sid, step.position, step.inputs, step.mode, step.targets, step.top_k)
            c = _compare(reference, want, got, commitment.seed, thresholds)
            if c.ok and isinstance(got, ResidualState):
                seen_for = outputs_seen.setdefault(_digest(got), _digest(step.inputs))
                if seen_for != _digest(step.inputs):
                    c = Comparison(False, "the output replays one given before for another input")
            cpu += time.process_time() - t0
            _extend(acc, c)
            if not c.ok:
                acc.ok = False
                reason = f"step {i} (positions {step.position}-{step.position + _length(step.inputs) - 1}): {c.reason}"
                break
    finally:
        reference.close(ref_sid)
        try:
            stage.close(sid)
        except StageError:
            pass
    if reason:
        return result(False, reason)
    ok, why = judge_tokens(acc.bad, thresholds)
    return result(ok, why)


@dataclass
class CrossCheckResult(_TokenStats):
    """A challenge judged against two peers instead of the validator's own computation."""

    verdict: str  # "pass", "blame" (both peers agree and both disagree with the stage) or "undecided"
    reason: str
    commitment: str
    seed: int
    nonce: str
    steps: int
    tokens: int
    stats: Comparison  # the stage against the first peer, per token
    peer_stats: Comparison  # the first peer against the second
    agree: dict[str, bool] = field(default_factory=dict)  # per pair ("stage-a", "stage-b", "a-b"): agreed

    @property
    def ok(self) -> bool:
        return self.verdict != "blame"


PAIRS = ("stage-a", "stage-b", "a-b")


def run_cross_check(stage: StageUnderTest, peers: Sequence[StageUnderTest], steps: list[ChallengeStep],
                    commitment: SeedCommitment | None = None, thresholds: Thresholds = Thresholds(),
                    outputs_seen: dict[str, str] | None = None) -> CrossCheckResult:
    """The challenge `steps` sent to `stage` and to two `peers` of the same block (fresh sessions each); the
    three answers compared pairwise per token (`compare_states` / `compare_heads`, the first named as the
    reference) and each pair judged by `judge_tokens` (module doc for the verdicts)."""
    if len(peers) != 2:
        raise ValueError(f"a cross-check needs two peers, got {len(peers)}")
    outputs_seen = {} if outputs_seen is None else outputs_seen
    commitment = commitment or SeedCommitment.new()
    acc = {k: Comparison(True) for k in PAIRS}
    broken: dict[str, str] = {}
    tokens = sum(_length(s.inputs) for s in steps)

    def result(verdict: str, why: str, agree: dict | None = None) -> CrossCheckResult:
        return CrossCheckResult(verdict, why, commitment.digest, commitment.seed, commitment.nonce, len(steps), tokens,
                                acc["stage-a"], acc["a-b"], agree or {})

    parties = [stage, *peers]
    sids = [secrets.token_hex(12) for _ in parties]
    opened = []
    try:
        for i, (party, sid) in enumerate(zip(parties, sids)):
            try:
                party.open(sid, route_id=secrets.token_hex(8))
            except StageError as e:
                if i == 0:
                    return result("blame", f"the stage refused the session: {e.message}")
                return result("undecided", f"peer {'ab'[i - 1]} refused the session: {e.message}")
            opened.append((party, sid))
        for i, step in enumerate(steps):
            answers = []
            for j, (party, sid) in enumerate(opened):
                try:
                    answers.append(party.forward(sid, step.position, step.inputs, step.mode, step.targets,
                                                 step.top_k))
                except StageError as e:
                    if j == 0:
                        return result("blame", f"step {i} refused: {e.code}: {e.message}")
                    return result("undecided", f"peer {'ab'[j - 1]} refused step {i}: {e.code}: {e.message}")
            got, a, b = answers
            if isinstance(got, ResidualState):
                seen_for = outputs_seen.setdefault(_digest(got), _digest(step.inputs))
                if seen_for != _digest(step.inputs):
                    return result("blame", f"step {i}: the output replays one given before for another input")
            blocks = len(step.inputs.blocks) if isinstance(step.inputs, ResidualState) else 0
            for key, want, have in (("stage-a", a, got), ("stage-b", b, got), ("a-b", a, b)):
                if key in broken:
                    continue
                c = _compare_outputs(blocks, want, have, commitment.seed, thresholds)
                _extend(acc[key], c)
                if not c.ok:
                    broken[key] = f"step {i} (positions {step.position}-{step.position + _length(step.inputs) - 1}): " \
                                  f"{c.reason}"
    finally:
        for party, sid in opened:
            try:
                party.close(sid)
            except StageError:
                pass
    why = {}
    for key in PAIRS:
        why[key] = broken.get(key) or judge_tokens(acc[key].bad, thresholds)[1]
    agree = {key: not why[key] for key in PAIRS}
    if agree["a-b"] and not agree["stage-a"] and not agree["stage-b"]:
        return result("blame", f"both peers agree with each other and not with this stage: against peer a "
                               f"{why['stage-a']}; against peer b {why['stage-b']}", agree)
    if agree["a-b"] and agree["stage-a"] and agree["stage-b"]:
        return result("pass", "", agree)
    if not agree["a-b"]:
        return result("undecided", f"the two peers disagree with each other ({why['a-b']}); the stage agrees with "
                                   + (" and ".join(f"peer {k[-1]}" for k in ("stage-a", "stage-b") if agree[k])
                                      or "neither"), agree)
    other = "a" if agree["stage-b"] else "b"
    return result("undecided", f"the peers agree, the stage agrees with one of them only (against peer {other}: "
                               f"{why['stage-' + other]})", agree)


def _digest(x) -> str:
    tensors = [x] if isinstance(x, Tensor) else list(x.blocks) + [x.partial]
    h = hashlib.sha256()
    for t in tensors:
        h.update(t.detach().contiguous().numpy().tobytes())
    return h.hexdigest()


def _length(x) -> int:
    return int(x.shape[0]) if isinstance(x, Tensor) else int(x.partial.shape[0])


# ------------------------------------------------------------------ wire states (as hashed in receipts)
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "int32": torch.int32}


def decode_wire_state(specs: Sequence[WireTensorSpec], body: bytes):
    """Token ids, a ResidualState, or (no specs) a head answer, from the bytes a stage signed the hash of."""
    if not specs:
        d = json.loads(bytes(body).decode())
        return HeadOutput(d["mode"], token_id=d["token_id"], logprob=d["logprob"],
                          top=[(int(a), float(b)) for a, b in d["top"]], logprobs=d["logprobs"],
                          row_tops=[[(int(a), float(b)) for a, b in r] for r in d["row_tops"]])
    tensors, offset = [], 0
    for s in specs:
        raw = bytearray(body[offset:offset + s.nbytes])
        offset += s.nbytes
        t = torch.frombuffer(raw, dtype=_DTYPES[s.dtype]).reshape(s.shape) if raw else \
            torch.empty(s.shape, dtype=_DTYPES[s.dtype])
        tensors.append(t)
    if offset != len(body):
        raise ValueError(f"{len(body) - offset} bytes after the last tensor")
    if len(specs) == 1 and specs[0].dtype == "int32":
        return tensors[0].to(torch.long)
    values = [t.float() for t in tensors]
    return ResidualState((int(values[-1].shape[0]),), values[:-1], values[-1])


# ------------------------------------------------------------------ route audit
@dataclass(frozen=True)
class HopRecord:
    """One stage's part of one route step, as a relaying validator saw it: the receipt the stage signed and
    the exact wire bytes of its input and output (their hashes are in the receipt)."""

    receipt: Receipt
    position: int
    input_specs: tuple[WireTensorSpec, ...]
    input_body: bytes
    output_specs: tuple[WireTensorSpec, ...]
    output_body: bytes
    mode: str = "none"
    targets: tuple[int, ...] | None = None
    top_k: int = 0


@dataclass
class RouteAudit:
    ok: bool
    problem: str = ""
    blame: str = ""  # a stage hotkey, or "driver" when the presented receipts were not the stages' work


def audit_receipts(receipts: Sequence[Receipt], route_id: str, session: str, step: int, input_sha256: str,
                   registered: dict[str, tuple[int, int]], num_layers: int,
                   seen_signatures: set[str] | None = None) -> RouteAudit:
    """One step's receipts: signed by registered hotkeys for the layers each is registered for, for this
    route id / session / step (route ids are the validator's fresh nonces: `seen_signatures` catches a
    receipt presented twice), chained from `input_sha256`, every layer covered exactly once, in order."""
    if not receipts:
        return RouteAudit(False, "no receipts", "driver")
    for i, r in enumerate(receipts):
        if r.stage not in registered:
            return RouteAudit(False, f"receipt {i} names {r.stage}, not a registered stage miner", "driver")
        if not verify_receipt(r):
            return RouteAudit(False, f"receipt {i} is not signed by {r.stage}", "driver")
        if (r.route_id, r.session, r.step) != (route_id, session, step):
            return RouteAudit(False, f"receipt {i} is for another route, session or step (stale or replayed)",
                              "driver")
        if seen_signatures is not None:
            if r.signature in seen_signatures:
                return RouteAudit(False, f"receipt {i} was presented before", "driver")
            seen_signatures.add(r.signature)
        if list(r.layers) != list(registered[r.stage]):
            return RouteAudit(False, f"receipt {i} claims layers {r.layers}, {r.stage} is registered for "
                                     f"{list(registered[r.stage])}", r.stage)
    expect_start, h = 0, input_sha256
    for i, r in enumerate(receipts):
        if r.layers[0] != expect_start:
            return RouteAudit(False, f"receipt {i} starts at layer {r.layers[0]}, layers from {expect_start} "
                                     "are " + ("covered twice" if r.layers[0] < expect_start else "missing"), "driver")
        if r.input_sha256 != h:
            return RouteAudit(False, f"receipt {i} ({r.stage}) does not start where the previous one ended",
                              "driver")
        expect_start, h = r.layers[1], r.output_sha256
    if expect_start != num_layers:
        return RouteAudit(False, f"layers {expect_start}-{num_layers - 1} are not covered", "driver")
    return RouteAudit(True)


def audit_route(records: Sequence[HopRecord], route_id: str, session: str, registered: dict[str, tuple[int, int]],
                num_layers: int, driver_inputs: dict[int, str] | None = None) -> RouteAudit:
    """Every step of a recorded route answer: the receipts (`audit_receipts`, chained from what the driver
    sent when `driver_inputs` {step: sha256} is given) and the recorded states against the signed hashes."""
    by_step: dict[int, list[HopRecord]] = {}
    for rec in records:
        by_step.setdefault(rec.receipt.step, []).append(rec)
    seen: set[str] = set()
    for step in sorted(by_step):
        hops = by_step[step]
        start_sha = (driver_inputs or {}).get(step, hops[0].receipt.input_sha256)
        a = audit_receipts([h.receipt for h in hops], route_id, session, step, start_sha, registered, num_layers,
                           seen)
        if not a.ok:
            return RouteAudit(False, f"step {step}: {a.problem}", a.blame)
        for h in hops:
            if state_sha256(list(h.input_specs), h.input_body) != h.receipt.input_sha256 or \
                    state_sha256(list(h.output_specs), h.output_body) != h.receipt.output_sha256:
                return RouteAudit(False, f"step {step}: the recorded states of {h.receipt.stage} are not what it "
                                         "signed", "driver")
    return RouteAudit(True)


@dataclass
class StageBlame:
    hotkey: str
    layers: tuple[int, int]
    ok: bool
    reason: str = ""
    stats: Comparison = field(default_factory=lambda: Comparison(True))


def recheck_stage(hops: Sequence[HopRecord], reference: Stage, seed: int,
                  thresholds: Thresholds = Thresholds()) -> StageBlame:
    """One stage's receipted steps of a session, in order, re-run on the reference for its block."""
    first = hops[0].receipt
    sid = "recheck-" + secrets.token_hex(8)
    acc = Comparison(True)
    reference.open(sid)
    try:
        for h in sorted(hops, key=lambda h: h.position):
            x = decode_wire_state(h.input_specs, h.input_body)
            got = decode_wire_state(h.output_specs, h.output_body)
            want = reference.forward(sid, h.position, x, h.mode, list(h.targets) if h.targets else None, h.top_k)
            c = _compare(reference, want, got, seed, thresholds)
            _extend(acc, c)
            if not c.ok:
                return StageBlame(first.stage, tuple(first.layers), False, f"step {h.receipt.step}: {c.reason}", acc)
    finally:
        reference.close(sid)
    ok, why = judge_tokens(acc.bad, thresholds)
    return StageBlame(first.stage, tuple(first.layers), ok, why, acc)


def bisect_route(records: Sequence[HopRecord], references: dict[tuple[int, int], Stage], seed: int,
                 thresholds: Thresholds = Thresholds()) -> tuple[str | None, list[StageBlame]]:
    """Re-run every stage's receipted inputs on the reference for its block, stage by stage in layer order;
    (hotkey of the first stage whose outputs diverge from the reference on its own inputs, or None; the
    verdict of each stage checked). Stages after it are not checked: they computed on the diverged state,
    and only the first divergence is blamed. The caller audited the records first (`audit_route`), so the
    states are the ones the stages signed."""
    per_stage: dict[str, list[HopRecord]] = {}
    for rec in records:
        per_stage.setdefault(rec.receipt.stage, []).append(rec)
    order = sorted(per_stage, key=lambda h: per_stage[h][0].receipt.layers[0])
    verdicts = []
    for hotkey in order:
        hops = per_stage[hotkey]
        verdict = recheck_stage(hops, references[tuple(hops[0].receipt.layers)], seed, thresholds)
        verdicts.append(verdict)
        if not verdict.ok:
            return hotkey, verdicts
    return None, verdicts



# ------------------------------------------------------------------ sessions opened after the fact
@dataclass(frozen=True)
class OpenedStep:
    """One forward of one stage as its ledger (or its neighbours') recorded it, decoded: what a recheck of the
    stage needs. `output` is the state the stage sent on, or its head answer."""

    step: int
    position: int
    mode: str
    targets: tuple[int, ...] | None
    top_k: int
    rewind: int | None
    inputs: object  # token ids [n] or a ResidualState
    output: object  # ResidualState or HeadOutput


def head_rows(step: OpenedStep) -> tuple[list[int], HeadOutput]:
    """A head's answer as teacher-forced rows: (targets, one per input token, -1 where none; the answer as a
    `score` HeadOutput). A sampled token, or each token a verify step emitted, is the target of the row whose
    logits chose it, with the logprob and alternatives the stage reported for it."""
    out, n = step.output, _length(step.inputs)
    targets = [-1] * n
    got = HeadOutput("score", logprobs=[None] * n, row_tops=[[] for _ in range(n)])
    if out.mode == "sample":
        emitted = [(out.token_id, out.logprob, out.top)]
        first = n - 1
    elif out.mode == "verify":
        emitted, first = out.verified, 0
    elif out.mode == "score":
        return [int(t) for t in (step.targets or [-1] * n)], out
    else:
        return targets, got
    for j, (token, logprob, top) in enumerate(emitted):
        if first + j >= n:
            break
        targets[first + j] = int(token)
        got.logprobs[first + j] = logprob
        got.row_tops[first + j] = list(top)
    return targets, got


def recheck_opened(steps: Sequence[OpenedStep], reference: Stage, seed: int,
                   thresholds: Thresholds = Thresholds()) -> Comparison:
    """Re-run one stage's recorded steps of a session, in order and with the rewinds they carried, on the
    reference for its block, and compare every output with the reference's on the same input (states per
    token, head answers per emitted token in teacher-forced form). `ok` is False at the first malformed or
    changed-pass-through output, with the reason."""
    sid = "recheck-" + secrets.token_hex(8)
    acc = Comparison(True)
    reference.open(sid)
    try:
        for s in sorted(steps, key=lambda s: s.step):
            if isinstance(s.output, HeadOutput):
                targets, got = head_rows(s)
                mode, top_k = ("score", max(s.top_k, max((len(t) for t in got.row_tops), default=0))) \
                    if any(t >= 0 for t in targets) else ("none", 0)
            else:
                targets, got, mode, top_k = None, s.output, "none", 0
            if s.rewind is not None:
                want = reference.rewind_and_forward(sid, s.rewind, s.position, s.inputs, mode, targets, top_k)
            else:
                want = reference.forward(sid, s.position, s.inputs, mode, targets, top_k)
            if mode == "none" and isinstance(s.output, HeadOutput):
                continue  # a head step that emitted nothing (its rows are not the answer's)
            c = _compare(reference, want, got, seed, thresholds)
            _extend(acc, c)
            if not c.ok:
                acc.ok = False
                acc_reason = f"step {s.step} (positions {s.position}-{s.position + _length(s.inputs) - 1}): {c.reason}"
                return Comparison(False, acc_reason, acc.cosine, acc.rel_l2, acc.bad, acc.passthrough_rel_l2)
    finally:
        reference.close(sid)
    return acc

__all__ = ["SeedCommitment", "commitment_digest", "verify_reveal", "projection", "Thresholds", "Comparison",
           "compare_states", "compare_heads", "judge_tokens", "recheck_stage", "reference_stage", "ChallengeStep",
           "plan_steps", "challenge_steps", "ChallengeResult", "run_challenge", "CrossCheckResult", "run_cross_check",
           "decode_wire_state", "HopRecord", "RouteAudit", "audit_receipts", "audit_route", "StageBlame",
           "bisect_route", "OpenedStep", "head_rows", "recheck_opened"]
