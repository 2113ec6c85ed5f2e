"""Stage checks: the comparison of a stage's outputs with the validator's own computation of its block, the
audit of a route step's receipt chain, and the recheck of a whole session a stage served.

**Comparison.** The validator holds the block (`reference_stage`: an in-process `inference.swarm.Stage` over its
own copy of the weights) and runs it on exactly the input the stage was given. Per token, the new part of the
state (block sums completed inside the block and the running partial) is projected on `projections` random
Gaussian directions (a seed the validator picks after the stage answered) and compared by cosine and relative L2
distance; a token far off is *bad* (`Thresholds`). The block sums the stage only passes through must come back
as they went in (within wire rounding); anything malformed or non-finite fails outright. A head stage's answer is
compared row by row: the logprob of each token it emitted (or scored) and its top alternatives. How many far-off
tokens, and how far, an honest stage of each numerics shows is the honest envelope scoring/stage_judge.py
judges by; no single token condemns a stage.

**Receipts.** `audit_receipts` checks one step's receipts: signed by the hotkeys registered for the layers they
claim, for this route id, session and step, chained from the hash of what the driver sent (the output hash of
stage i is the input hash of stage i + 1), covering every layer exactly once, none presented before. A receipt
that does not verify is the presenting driver's fault, not a stage's.

**Sessions.** `recheck_opened` re-runs every recorded step of one stage in one session (rewinds included), in
order, on the reference, from the stage's ledger or its neighbours' (neurons/validator_app/session_audits.py).
"""
from __future__ import annotations

import secrets
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np
import torch
from torch import Tensor

from inference.model.k3 import ResidualState
from inference.swarm.stage import HeadOutput, LayerRange, Stage
from protocol.stage import Receipt, verify_receipt


# ------------------------------------------------------------------ comparison
def projection(seed: int, width: int, k: int) -> Tensor:
    """[width, k] Gaussian directions from the revealed seed (same on every machine: torch's CPU generator)."""
    g = torch.Generator().manual_seed(int(seed) % (2**63))
    return torch.randn(width, k, generator=g, dtype=torch.float32) / k ** 0.5


@dataclass(frozen=True)
class Thresholds:
    """What makes one token far off, and what pass-through must hold. Honest bf16 moves almost every token by
    ~0.3% (relative L2 of the projected new state) and a few by up to 18% on the trained tiny model, where bf16
    flips a near-tied router's expert choice; fp32 on other thread counts stays within 1e-5. A token is *bad* when
    its cosine < `token_min_cosine` or its relative L2 > `token_max_rel_l2`; a head row when a target or top-k
    logprob differs by more than `row_max_logprob_diff`. How often honest stages show bad tokens, per numerics,
    is measured (benchmarks/stage_envelope.py) and judged by scoring/stage_judge.py. Pass-through block sums
    must come back within bf16 rounding."""

    token_min_cosine: float = 0.995
    token_max_rel_l2: float = 0.07
    row_max_logprob_diff: float = 0.15
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


def reference_stage(model, start: int, stop: int) -> Stage:
    """The validator's independent computation of layers [start, stop): a Stage over its own model copy."""
    return Stage(model, LayerRange(start, stop, model.config.num_layers), fingerprint="validator-reference")


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


def _length(x) -> int:
    return int(x.shape[0]) if isinstance(x, Tensor) else int(x.partial.shape[0])


# ------------------------------------------------------------------ route audit
@dataclass
class RouteAudit:
    ok: bool
    problem: str = ""
    blame: str = ""  # a stage hotkey, or "driver" when the presented receipts were not the stages' work


def audit_receipts(receipts: Sequence[Receipt], route_id: str, session: str, step: int, input_sha256: str,
                   registered: dict[str, tuple[int, int]], num_layers: int,
                   seen_signatures: set[str] | None = None, driver: str | None = None) -> RouteAudit:
    """One step's receipts: signed by registered hotkeys for the layers each is registered for, for this
    route id / session / step and for a session `driver` opened (a driver presenting the receipts of another's
    session copied them; `seen_signatures` catches a receipt presented twice), chained from `input_sha256`,
    every layer covered exactly once, in order."""
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
        if driver is not None and r.driver != driver:
            return RouteAudit(False, f"receipt {i} is for a session {r.driver} opened, not {driver}", "driver")
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

__all__ = ["projection", "Thresholds", "Comparison", "compare_states", "compare_heads", "reference_stage", "RouteAudit",
           "audit_receipts", "OpenedStep", "head_rows", "recheck_opened"]
