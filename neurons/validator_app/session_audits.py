"""Route sessions checked after they ran: the validator's stage check that looks, to every stage, exactly like
traffic, because it is traffic.

A session the validator can vouch for (its gateway's organic traffic, the sessions it drives itself through the
same route driver, or a route miner's session serving a request the validator sent) is picked for a check only
after it ended. Every stage had already committed to what it took in and sent on: its receipts carry the sha256 of
both, and the route driver holds them. The validator asks the stages of the route for their ledgers of that
session (neurons/swarm/ledger.py), keeps only bytes that hash to what was signed, and so has, for each stage, the
inputs and outputs of every step: from the stage itself, or from its neighbours (its input is the previous
stage's output, its output the next stage's input; the driver holds the first input and the head's answers).
Each stage is then re-run on the validator's reference of its block over exactly those inputs, rewinds
included (scoring.stage_checks.recheck_opened), and its outputs are compared token by token; the check's
statistics are judged against the honest envelope of the numerics the stage declares (scoring.stage_judge).

What is a lie and what is a fault:
- exact and final (the stage is blamed at once): a ledger entry whose bytes do not hash to the receipt the stage
  signed, two different receipts signed by one stage for one step, a malformed output or a changed pass-through
  on the recheck, an output replayed for another input;
- statistical (`scoring.stage_judge.verdict` over the stage's window of checks): outputs outside the envelope;
- a fault, never blame: a ledger not given (unreachable, slow, not retained), a session whose bytes cannot all be
  had; that stage is simply not checked this time.
"""
from __future__ import annotations

import asyncio
import hashlib
import logging
import secrets
import time
from dataclasses import dataclass, field
from typing import Mapping, Optional, Sequence

import aiohttp

from inference.swarm.stage import HeadOutput
from neurons.swarm.codec import decode_wire
from neurons.swarm.ledger import LedgerUnavailable, read_ledger
from neurons.swarm.route import NUMERICS_ORDER, StageInfo, StepRecord
from protocol.stage import LedgerStep, Receipt, WireTensorSpec, state_sha256, verify_receipt
from scoring.stage_checks import OpenedStep, Thresholds, recheck_opened
from scoring.stage_judge import CheckStats, NumericsEnvelope, StageVerdict, verdict

log = logging.getLogger("k3.validator.sessions")


def stage_numerics(info: StageInfo) -> str:
    """The coarsest of what a stage computes in and sends on: the envelope it is judged by."""
    ranks = [NUMERICS_ORDER.index(d) for d in (info.caps.dtype, info.caps.wire_dtype) if d in NUMERICS_ORDER]
    return NUMERICS_ORDER[max(ranks, default=0)]


@dataclass
class StageCheck:
    """One stage's part of one checked session."""

    hotkey: str
    layers: tuple[int, int]
    numerics: str
    kind: str  # "state" or "head"
    stats: Optional[CheckStats] = None
    outside: Optional[str] = None  # why the check lies outside the honest envelope
    lie: Optional[str] = None  # an exact failure: blamed at once
    unavailable: Optional[str] = None  # a fault: not checked this time
    cpu_s: float = 0.0
    steps: int = 0

    @property
    def checked(self) -> bool:
        return self.unavailable is None


@dataclass
class _Pool:
    """Wire bytes by the sha256 they hash to (only bytes that hash to a signed receipt's hash get in)."""

    items: dict[str, tuple[list[WireTensorSpec], bytes]] = field(default_factory=dict)
    bytes_read: int = 0

    def add(self, specs, body: bytes) -> str:
        sha = state_sha256(list(specs), body)
        self.items[sha] = (list(specs), body)
        return sha


class SessionAuditor:
    """Opens sessions from the stages' ledgers and re-runs each stage on the validator's reference."""

    def __init__(self, keypair, references: Mapping, *, num_layers: int, hidden_size: int,
                 envelopes: Optional[Mapping[tuple[str, str], NumericsEnvelope]] = None,
                 thresholds: Thresholds = Thresholds(), timeout_s: float = 10.0, alpha: float = 1e-7):
        """`references[(start, stop)]`: the validator's Stage for that block (made on first use). `envelopes`:
        (numerics, kind) -> honest bounds (scoring.stage_judge); None: the model has no measured stage
        envelope, and only exact checks apply."""
        self.keypair = keypair
        self.references = references
        self.num_layers = num_layers
        self.hidden_size = hidden_size
        self.envelopes = envelopes
        self.thresholds = thresholds
        self.timeout_s = timeout_s
        self.alpha = alpha
        self.seen_outputs: dict[str, dict[str, str]] = {}  # hotkey -> output digest -> input digest

    # ------------------------------------------------------------ opening
    async def open(self, http: aiohttp.ClientSession, records: Sequence[StepRecord],
                   stages: Mapping[str, StageInfo]) -> tuple[list[StageCheck], int]:
        """Check every stage of one recorded session; (one StageCheck per stage of its route, bytes read)."""
        records = sorted(records, key=lambda r: r.step)
        gap = recorded_prefix_problem(records)
        route = [r.stage for r in records[0].receipts]
        if gap:  # nothing to re-run from: a fault of the record, checked by nobody
            layers = {r.stage: tuple(r.layers) for r in records[0].receipts}
            return [StageCheck(h, layers[h], stage_numerics(stages[h]) if h in stages else "float32",
                               "head" if layers[h][1] == self.num_layers else "state", unavailable=gap)
                    for h in route], 0
        if any([r.stage for r in rec.receipts] != route for rec in records):
            return [], 0  # a session's route never changes (recovery opens a new session): not ours to judge
        pool = _Pool()
        for rec in records:
            pool.add(rec.input_specs, rec.input_body)
            if rec.result_body:
                pool.add([], rec.result_body)
        driver_receipts = {(r.stage, rec.step): r for rec in records for r in rec.receipts}
        ledgers = await asyncio.gather(*(self._ledger(http, stages.get(h), records[0]) for h in route))
        lies: dict[str, str] = {}
        meta: dict[tuple[str, int], LedgerStep] = {}
        for hotkey, got in zip(route, ledgers):
            if isinstance(got, str):
                continue
            problem = self._take(hotkey, got, driver_receipts, pool, meta)
            if problem:
                lies[hotkey] = problem
        checks = []
        for hotkey in route:
            info = stages.get(hotkey)
            layers = next(tuple(r.layers) for r in records[0].receipts if r.stage == hotkey)
            check = StageCheck(hotkey, layers, stage_numerics(info) if info else "float32",
                               "head" if layers[1] == self.num_layers else "state")
            if hotkey in lies:
                check.lie = lies[hotkey]
            else:
                steps, missing = self._assemble(hotkey, records, driver_receipts, pool, meta)
                if missing:
                    check.unavailable = missing
                else:
                    await self._recheck(check, steps)
            checks.append(check)
        return checks, pool.bytes_read

    async def _ledger(self, http, info: Optional[StageInfo], first: StepRecord):
        if info is None:
            return "the stage is not known"
        try:
            return await read_ledger(http, self.keypair, info.hop, first.route_id, first.session, self.timeout_s)
        except LedgerUnavailable as e:
            return str(e)

    def _take(self, hotkey: str, got, driver_receipts, pool: _Pool, meta: dict) -> Optional[str]:
        """Put a stage's ledger into the pool; the exact lie it holds, if any."""
        header, steps = got
        for step, raw_in, raw_out in steps:
            r: Receipt = step.receipt
            if r.stage != hotkey or not verify_receipt(r):
                continue  # not its own signature: says nothing about it (and cannot frame it)
            if (r.route_id, r.session, r.step) != (header.route_id, header.session, step.step):
                continue
            ours = driver_receipts.get((hotkey, step.step))
            if ours is not None and ours.signature != r.signature:
                return (f"signed two receipts for step {step.step} of session {r.session}: the one it sent on and "
                        "another in its ledger")
            if state_sha256(step.inputs, raw_in) != r.input_sha256 or \
                    state_sha256(step.outputs, raw_out) != r.output_sha256:
                return f"its ledger's bytes for step {step.step} of session {r.session} are not what it signed"
            pool.add(step.inputs, raw_in)
            pool.add(step.outputs, raw_out)
            pool.bytes_read += len(raw_in) + len(raw_out)
            meta[(hotkey, step.step)] = step
        return None

    def _assemble(self, hotkey: str, records: Sequence[StepRecord], driver_receipts, pool: _Pool,
                  meta: dict) -> tuple[list[OpenedStep], Optional[str]]:
        steps = []
        for rec in records:
            r = driver_receipts[(hotkey, rec.step)]
            got_in, got_out = pool.items.get(r.input_sha256), pool.items.get(r.output_sha256)
            if got_in is None or got_out is None:
                return [], f"step {rec.step}: its {'input' if got_in is None else 'output'} was given by no one"
            # where the step starts and what it rewound: the driver's record; the head's mode and targets: the
            # stage's own ledger, else any stage's (they all carried the same forward header)
            m = meta.get((hotkey, rec.step)) or next((v for (_, s), v in meta.items() if s == rec.step), None)
            if m is None:
                return [], f"step {rec.step}: no stage gave its forward's header fields"
            inputs = decode_wire(*got_in, r.layers[0] == 0, self.hidden_size)
            output = decode_wire(*got_out, False, self.hidden_size)
            steps.append(OpenedStep(rec.step, rec.position, m.mode, tuple(m.targets) if m.targets else None, m.top_k,
                                    rec.rewind, inputs, output))
        return steps, None

    async def _recheck(self, check: StageCheck, steps: list[OpenedStep]) -> None:
        reference = self.references[check.layers]
        t0 = time.process_time()
        comparison = await asyncio.to_thread(recheck_opened, steps, reference, secrets.randbits(62), self.thresholds)
        check.cpu_s = time.process_time() - t0
        check.steps = len(steps)
        check.stats = CheckStats.of(comparison)
        if not comparison.ok:
            check.lie = f"the recheck of its outputs failed: {comparison.reason}"
            return
        replayed = self._replayed(check.hotkey, steps)
        if replayed:
            check.lie = replayed
            return
        env = self.envelopes.get((check.numerics, check.kind)) if self.envelopes else None
        if env is not None:
            check.outside = env.outside(check.stats)

    def _replayed(self, hotkey: str, steps: Sequence[OpenedStep]) -> Optional[str]:
        """Honest compute never gives the same output bits for two different inputs."""
        seen = self.seen_outputs.setdefault(hotkey, {})
        for s in steps:
            if isinstance(s.output, HeadOutput):
                continue
            out, inp = _digest(s.output), _digest(s.inputs)
            if seen.setdefault(out, inp) != inp:
                return f"step {s.step}: its output replays one it gave before for another input"
        while len(seen) > 100_000:
            del seen[next(iter(seen))]
        return None

    # ------------------------------------------------------------ judging a stage's window
    def judge(self, outcomes: Sequence[Optional[str]], numerics: str, kind: str) -> Optional[StageVerdict]:
        """The verdict over a stage's window of checks (None: no envelope for its numerics, no statistics)."""
        env = self.envelopes.get((numerics, kind)) if self.envelopes else None
        return verdict(outcomes, env, self.alpha) if env is not None else None


def recorded_prefix_problem(records: Sequence[StepRecord]) -> Optional[str]:
    """Why these steps (sorted) cannot be re-run from the start of their session, or None: they must start at
    position 0 and each must start where the one before ended (or rewind into it)."""
    position = 0
    for i, rec in enumerate(records):
        rewound = rec.rewind is not None and rec.rewind == rec.position <= position
        if rec.step != records[0].step + i or not (rec.position == position or rewound):
            return f"the recorded steps of session {rec.session} do not run from its start (step {rec.step})"
        position = rec.position + int(rec.input_specs[0].shape[0])
    return None if records and records[0].position == 0 else "the session's first step was not recorded"


def _digest(x) -> str:
    tensors = [x] if not hasattr(x, "partial") else list(x.blocks) + [x.partial]
    h = hashlib.sha256()
    for t in tensors:
        h.update(t.detach().contiguous().float().numpy().tobytes())
    return h.hexdigest()


def describe(check: StageCheck) -> str:
    if check.lie:
        return check.lie
    if check.unavailable:
        return f"not checked: {check.unavailable}"
    if check.outside:
        return f"outside the honest {check.numerics} envelope: {check.outside}"
    s = check.stats
    return f"matched the reference over {s.tokens} tokens (median {s.median:.2g}, {s.bad} far off)" if s else ""


__all__ = ["SessionAuditor", "StageCheck", "describe", "stage_numerics"]

