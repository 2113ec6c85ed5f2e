"""Openings: a whole-model miner's answer checked one block at a time against the states it committed to
(docs/verification.md, "State commitments").

With every answer a miner on the project's engine signs a commitment to the residual state of every position at
every committed layer boundary (inference.serving.state_commitment). After the answer is in, the validator may
open it (`StateOpenings.open`, drawn at `rate`):

1. **Plan** (`plan_opening`): one committed block [start, stop) drawn uniformly, so the miner cannot know which
   block will be looked at when it answers; the states entering it at every position of the answer (a block's
   output at position p depends on its inputs at every position up to p, so the whole prefix is needed anyway)
   and the states leaving it at the same positions; and the states entering the head at up to `head_rows`
   positions drawn among those that chose the answer's tokens.
2. **Ask** the miner (POST /v1/states, signed). Any answer but a valid opening (an error status, a malformed body,
   no answer after one retry) is a refusal: failed hard at once.
3. **Chain**: every opened row must hash into its boundary's committed root, and the boundary roots into the root
   the answer's signature covers; anything else is a forged opening: failed hard at once.
4. **Recompute** the block from disk on the validator's block reference (inference.swarm.block_reference: only
   that block's layers and the experts its tokens pick are read) over the opened inputs, and compare its output
   with the opened outputs position by position (scoring.stage_checks.compare_states: the projected new part of
   the state, cosine and relative L2). The head's logprob of each answer token at the drawn positions, from the
   opened final states, is compared with the logprob the miner streamed for that token: the final state must give
   the answer's tokens.
5. **Judge** like a stage check (scoring.stage_judge): the opening lies outside the honest envelope of the
   numerics the miner declares (its median distance or its share of far-off positions above what honest checks of
   that numerics show) or not; an opening outside is a soft failure, and the miner's window of openings is judged
   by the same binomial test as a stage's: blamed, it fails hard. A malformed or non-finite opened state, or a
   changed pass-through, is exact: failed hard at once. A model without a measured stage envelope gets the exact
   checks only (refusal, forgery, malformed states).

What an opening costs the validator (`OpeningRecord.cost`: CPU and wall seconds, weight bytes read, peak resident
weights and process memory) is stored beside the compute the checked miner spent on the same tokens
(`checked_flops`, 2 x active parameters x positions of the whole model) and the validator's (`check_flops`: the
block's share of that).
"""
from __future__ import annotations

import asyncio
import base64
import logging
import math
import random
import secrets
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Mapping, Optional, Sequence

import torch

from inference.model.k3 import ResidualState
from inference.serving.state_commitment import (OpenedRows, Opening, OpeningError, StateAsk, StateCommitment,
                                                block_starts_below, state_entering, verify_opening)
from protocol.client import ClientTimeouts, GenerateResult, MinerClient, MinerError, MinerTimeout, MinerUnreachable
from protocol.schemas import BoundaryPositions, StateOpening, StateOpeningRequest

from .failures import Failure
from .stage_checks import Comparison, Thresholds, compare_states
from .stage_judge import CheckStats, NumericsEnvelope, verdict
from .stage_rewards import active_params_per_layer

log = logging.getLogger("k3.scoring.openings")

HEAD_ROWS = 16  # answer tokens whose logprob is checked from the opened final states
POSITION_RATE_FLOOR = 1e-4  # the least per-position far-off rate assumed of honest numerics (fp32 shows none)
NUMERICS_OF_PRECISION = {"fp32": "float32", "float32": "float32", "bf16": "bfloat16", "bfloat16": "bfloat16",
                         "fp16": "float16", "float16": "float16"}


# ------------------------------------------------------------------ the wire's opening as the engine's
def state_commitment_of(message) -> StateCommitment:
    return StateCommitment(message.root, message.positions, tuple(message.boundaries), message.scheme)


def opening_of(message: StateOpening) -> Opening:
    """A wire opening as inference.serving.state_commitment.verify_opening takes it; OpeningError when its rows
    are not what it says."""
    opened = []
    for o in message.opened:
        try:
            raw = base64.b64decode(o.rows, validate=True)
        except ValueError:
            raise OpeningError(f"boundary {o.boundary}: rows are not base64") from None
        if len(raw) != 4 * len(o.positions) * message.hidden_size:
            raise OpeningError(f"boundary {o.boundary}: {len(raw)} bytes of rows for {len(o.positions)} positions "
                               f"of {message.hidden_size} values")
        rows = torch.frombuffer(bytearray(raw), dtype=torch.float32).reshape(len(o.positions), message.hidden_size)
        opened.append(OpenedRows(o.boundary, tuple(o.positions), rows, [bytes.fromhex(h) for h in o.proof]))
    if len(message.boundaries) != len(message.boundary_roots):
        raise OpeningError("the opening names a different number of boundaries and boundary roots")
    roots = {b: bytes.fromhex(r) for b, r in zip(message.boundaries, message.boundary_roots)}
    return Opening(message.root, message.positions, roots, opened)


# ------------------------------------------------------------------ planning
@dataclass(frozen=True)
class OpeningPlan:
    block: tuple[int, int]  # layers re-run
    positions: int  # positions re-run and compared: 0..positions-1
    head_positions: tuple[int, ...]  # positions whose head output must give the answer's next token
    asks: tuple[StateAsk, ...]


def commitment_problem(config, commitment: StateCommitment, needed: int) -> Optional[str]:
    """Why a commitment cannot be what the model's engine commits to (None when it can): its boundaries must rise
    to the head and include every Attention Residuals block start, and it must cover every position the answer
    ran (prompt and completion but the last token)."""
    b = list(commitment.boundaries)
    if b != sorted(set(b)) or not b or b[-1] != config.num_layers or b[0] < 1:
        return f"boundaries {b[:8]} do not rise to the head (layer {config.num_layers})"
    missing = [s for s in block_starts_below(config, config.num_layers) if s not in b]
    if missing:
        return f"boundaries leave out the Attention Residuals block starts {missing[:4]}"
    if commitment.positions < needed:
        return f"it covers {commitment.positions} positions, the answer ran {needed}"
    return None


def plan_opening(config, commitment: StateCommitment, prompt_tokens: int, completion_tokens: int,
                 rng: random.Random, head_rows: int = HEAD_ROWS, block: Optional[int] = None) -> OpeningPlan:
    """A block drawn uniformly among the committed ones (`block`: the index of the one to open instead: a
    benchmark opens each in turn), and what to open for it (module doc, 1)."""
    n = prompt_tokens + completion_tokens - 1
    bounds = [0] + list(commitment.boundaries)
    k = rng.randrange(len(bounds) - 1) if block is None else block
    start, stop = bounds[k], bounds[k + 1]
    heads = sorted(rng.sample(range(prompt_tokens - 1, n), min(head_rows, n - prompt_tokens + 1)))
    wanted: dict[int, set[int]] = {}
    if start > 0:
        for b in block_starts_below(config, start) + [start]:
            wanted.setdefault(b, set()).update(range(n))
    wanted.setdefault(stop, set()).update(range(n))
    if heads:
        for b in block_starts_below(config, config.num_layers) + [config.num_layers]:
            wanted.setdefault(b, set()).update(heads)
    asks = tuple(StateAsk(b, tuple(sorted(p))) for b, p in sorted(wanted.items()))
    return OpeningPlan((start, stop), n, tuple(heads), asks)


# ------------------------------------------------------------------ checking
@dataclass
class OpeningVerdict:
    check: str  # "" passed; "state_opening_refused" | "state_opening_forged" | "state_opening" (outside)
    reason: str = ""
    hard: bool = False
    state: Optional[CheckStats] = None
    head: Optional[CheckStats] = None
    outside: Optional[str] = None

    @property
    def passed(self) -> bool:
        return not self.check

    @property
    def failures(self) -> list[Failure]:
        return [Failure(self.check, self.reason, self.hard)] if self.check else []


def check_opening(plan: OpeningPlan, commitment: StateCommitment, opening: Opening, reference, token_ids: Sequence[int],
                  completion_logprobs: Sequence[float], prompt_tokens: int, seed: int,
                  envelopes: Optional[Mapping[tuple[str, str], NumericsEnvelope]], numerics: str,
                  thresholds: Thresholds = Thresholds()) -> OpeningVerdict:
    """Steps 3-5 of the module doc on the validator's block reference (`reference`: run_block, head, config)."""
    config = reference.config
    try:
        rows = verify_opening(commitment, opening, plan.asks, config.hidden_size)
    except OpeningError as e:
        return OpeningVerdict("state_opening_forged", f"{e}", hard=True)
    start, stop = plan.block
    n = plan.positions
    ids = torch.as_tensor(list(token_ids[:n + 1]), dtype=torch.long)
    embedding = reference.run_block(0, 0, ids[:n]).partial

    def stacked(b: int, positions: Sequence[int]):
        return torch.stack([rows[b][t] for t in positions])

    if start == 0:
        inputs = ids[:n]
    else:
        inputs = state_entering(config, start, embedding, {b: stacked(b, range(n))
                                                           for b in block_starts_below(config, start) + [start]})
    want = reference.run_block(start, stop, inputs)
    got = ResidualState(want.lengths, want.blocks, stacked(stop, range(n)))
    state = compare_states(want, got, len(want.blocks), seed, thresholds)
    if not state.ok:
        return OpeningVerdict("state_opening_forged", f"layers {start}-{stop - 1}: {state.reason}", hard=True)
    head = _head_comparison(plan, config, reference, rows, embedding, ids, completion_logprobs, prompt_tokens,
                            thresholds)
    out = OpeningVerdict("", state=CheckStats.of(state), head=CheckStats.of(head) if head.rel_l2 else None)
    for kind, stats in (("state", out.state), ("head", out.head)):
        env = envelopes.get((numerics, kind)) if envelopes else None
        why = env.outside(stats) if env is not None and stats is not None else None
        if why:
            where = f"layers {start}-{stop - 1}" if kind == "state" else "the head"
            out.outside = f"{where}: {why}"
            out.check, out.reason = "state_opening", f"the opened states lie outside the honest {numerics} " \
                                                     f"envelope: {out.outside}"
            break
    return out


def _head_comparison(plan: OpeningPlan, config, reference, rows, embedding, ids, completion_logprobs,
                     prompt_tokens: int, thresholds: Thresholds) -> Comparison:
    """The logprob of the answer's token at each drawn position, from the opened state entering the head, against
    the one the miner streamed (module doc, 4)."""
    q = list(plan.head_positions)
    if not q:
        return Comparison(True)
    L = config.num_layers
    final = state_entering(config, L, embedding[q], {b: torch.stack([rows[b][t] for t in q])
                                                      for b in block_starts_below(config, L) + [L]})
    lp = torch.log_softmax(reference.head(final).float(), dim=-1)
    diffs = [abs(float(lp[j, int(ids[t + 1])]) - float(completion_logprobs[t + 1 - prompt_tokens]))
             for j, t in enumerate(q)]
    return Comparison(True, cosine=[1.0] * len(diffs), rel_l2=diffs,
                      bad=[d > thresholds.row_max_logprob_diff for d in diffs])


# ------------------------------------------------------------------ the validator's openings
@dataclass
class OpeningRecord:
    """One opening, for the validator to store."""

    verdict: OpeningVerdict
    block: Optional[tuple[int, int]] = None
    positions: int = 0
    cost: object = None  # inference.swarm.block_reference.CheckCost
    wall_s: float = 0.0
    bytes_received: int = 0
    check_flops: float = 0.0  # the validator's compute: the block over the answer's positions, the head rows
    checked_flops: float = 0.0  # the miner's: the whole model over the same positions
    numerics: str = ""


@dataclass
class StateOpenings:
    """The validator's openings of whole-model miners' commitments (module doc): `reference` is the block
    reference (or a () -> reference made on first need), `rate` the share of committed answers opened, `envelopes`
    the model's stage envelopes ((numerics, kind) -> bounds; None: exact checks only)."""

    reference: object
    client: MinerClient
    rate: float = 0.1
    rate_new: float = 0.25
    envelopes: Optional[Mapping[tuple[str, str], NumericsEnvelope]] = None
    timeouts: Optional[ClientTimeouts] = None
    rng: random.Random = field(default_factory=lambda: random.Random(secrets.randbits(64)))
    window_s: float = 24 * 3600.0
    alpha: float = 1e-7
    thresholds: Thresholds = field(default_factory=Thresholds)
    history: dict[str, deque] = field(default_factory=dict)  # hotkey -> (time, why outside or None)

    def draw(self, new_or_suspect: bool) -> bool:
        return self.rng.random() < (self.rate_new if new_or_suspect else self.rate)

    def _reference(self):
        if callable(self.reference) and not hasattr(self.reference, "run_block"):
            self.reference = self.reference()
        return self.reference

    async def open(self, prompt_ids: Sequence[int], result: GenerateResult, precision: Optional[str], *, url: str,
                   hotkey: str, block: Optional[int] = None) -> OpeningRecord:
        """Open one committed answer and judge it (module doc, 1-5)."""
        final = result.final
        commitment = state_commitment_of(final.state_commitment)
        reference = await asyncio.to_thread(self._reference)
        config = reference.config
        completion = list(result.token_ids)
        numerics = NUMERICS_OF_PRECISION.get((precision or "").lower(), (precision or "unknown").lower())
        needed = len(prompt_ids) + len(completion) - 1
        problem = commitment_problem(config, commitment, needed) if completion else "the answer has no tokens"
        if problem:
            return self._judged(hotkey, OpeningRecord(OpeningVerdict("state_opening_forged", f"the commitment "
                                                                     f"cannot be the model's: {problem}", True),
                                                      numerics=numerics))
        plan = plan_opening(config, commitment, len(prompt_ids), len(completion), self.rng, block=block)
        started = time.monotonic()
        wire, received = await self._ask(url, hotkey, result.request.request_id, commitment, plan)
        if isinstance(wire, str):
            return self._judged(hotkey, OpeningRecord(OpeningVerdict("state_opening_refused", wire, True), plan.block,
                                                      plan.positions, numerics=numerics))
        record = await asyncio.to_thread(self._check, plan, commitment, wire, reference, list(prompt_ids) + completion,
                                         result.logprobs, len(prompt_ids), envelopes=self.envelopes, numerics=numerics)
        record.wall_s = time.monotonic() - started
        record.bytes_received = received
        costs = active_params_per_layer(config)
        start, stop = plan.block
        record.checked_flops = 2.0 * sum(costs) * plan.positions
        record.check_flops = 2.0 * (sum(costs[start:stop]) * plan.positions + config.hidden_size * config.vocab_size
                                    * len(plan.head_positions))
        return self._judged(hotkey, record)

    async def _ask(self, url: str, hotkey: str, request_id: str, commitment: StateCommitment, plan: OpeningPlan):
        """(the StateOpening, bytes received) or (why it is a refusal, 0); a connection failure or timeout is
        tried once more."""
        request = StateOpeningRequest(request_id=request_id, root=commitment.root,
                                      open=[BoundaryPositions(boundary=a.boundary, positions=list(a.positions))
                                            for a in plan.asks])
        for attempt in (1, 2):
            try:
                answer = await self.client.open_states(url, hotkey, request, self.timeouts)
                return answer, len(answer.model_dump_json())
            except (MinerUnreachable, MinerTimeout) as e:
                if attempt == 2:
                    return f"did not open its committed states (twice): {type(e).__name__}: {e}", 0
            except MinerError as e:
                return f"refused to open its committed states: {type(e).__name__}: {e}", 0
        return "did not open its committed states", 0

    def _check(self, plan, commitment, wire, reference, token_ids, logprobs, prompt_tokens, *, envelopes,
               numerics) -> OpeningRecord:
        try:
            opening = opening_of(wire)
        except OpeningError as e:
            return OpeningRecord(OpeningVerdict("state_opening_forged", str(e), True), plan.block, plan.positions,
                                 numerics=numerics)
        track = getattr(reference, "track", None)
        seed = secrets.randbits(62)
        with track() as cost:
            verdict_ = check_opening(plan, commitment, opening, reference, token_ids, logprobs, prompt_tokens, seed,
                                     envelopes, numerics, self.thresholds)
        return OpeningRecord(verdict_, plan.block, plan.positions, cost, numerics=numerics)

    def _judged(self, hotkey: str, record: OpeningRecord) -> OpeningRecord:
        """The miner's window of openings after this one (`judge_window`): blamed, the opening fails hard."""
        v = record.verdict
        if v.hard:
            log.warning("miner %s: %s: %s", hotkey, v.check, v.reason)
            return record
        now = time.time()
        window = self.history.setdefault(hotkey, deque())
        stats = v.state
        window.append((now, v.outside, stats.bad if stats else 0, stats.tokens if stats else 0))
        while window and window[0][0] < now - self.window_s:
            window.popleft()
        env = self.envelopes.get((record.numerics, "state")) if self.envelopes else None
        why = judge_window(list(window), env, self.alpha) if env is not None else None
        if why:
            v.check, v.hard, v.reason = "state_openings", True, f"{why} (openings of its committed states)"
            log.warning("miner %s blamed by its openings: %s", hotkey, v.reason)
        return record


def judge_window(window: Sequence[tuple], env: NumericsEnvelope, alpha: float = 1e-7) -> Optional[str]:
    """Why a miner's window of openings ((time, why outside or None, far-off positions, positions) each) shows it
    lies, or None. Two tests, each with a false-positive chance under `alpha` for an honest miner of the
    declared numerics: the stage judge's over whole openings (k of n outside the envelope, `verdict`), and one
    over positions: far-off positions in all openings together against the most an honest check of the numerics
    has (`max_bad_fraction`, at least POSITION_RATE_FLOOR), which catches a lie at a single position of every
    answer once a few openings hit its block."""
    outcomes = [why for _, why, _, _ in window]
    if any(outcomes):
        judged = verdict(outcomes, env, alpha)
        if judged.blame:
            return judged.reason
    bad, tokens = sum(b for _, _, b, _ in window), sum(n for _, _, _, n in window)
    rate = max(env.max_bad_fraction, POSITION_RATE_FLOOR)
    if bad and rate < 1.0:
        chance = binomial_upper_tail(tokens, bad, rate)
        if chance < alpha:
            return (f"{bad} of the {tokens} positions of its last {len(window)} openings are far off; honest "
                    f"{env.numerics} states are far off at most {rate:.2%} of the time (chance {chance:.1e})")
    return None


def binomial_upper_tail(n: int, k: int, p: float) -> float:
    """P(X >= k) for X ~ Binomial(n, p), summed in log space (any n)."""
    if k <= 0:
        return 1.0
    if k > n:
        return 0.0
    log_p, log_q = math.log(p), math.log1p(-p)
    total = 0.0
    for i in range(k, n + 1):
        term = math.exp(math.lgamma(n + 1) - math.lgamma(i + 1) - math.lgamma(n - i + 1) + i * log_p
                        + (n - i) * log_q)
        total += term
        if i > n * p and term < total * 1e-16:
            break
    return min(1.0, total)


__all__ = ["HEAD_ROWS", "OpeningPlan", "OpeningRecord", "OpeningVerdict", "StateOpenings", "binomial_upper_tail",
           "check_opening", "commitment_problem", "judge_window", "opening_of", "plan_opening", "state_commitment_of"]
