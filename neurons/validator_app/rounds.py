"""The validator: rounds of workloads against miners, verification, scores, and weights on chain.

One round (`ValidatorLoop.run_round`):
1. re-read the metagraph through the chain interface, with a deadline (a failed read keeps the
   last snapshot);
2. take the organic measurements the gateway recorded since the last round;
3. pick the miners: every neuron with an endpoint except this validator, or, when
   `--sample-size` is set, that many of them, those evaluated least recently first;
4. fetch each miner's capabilities (cached per uid and endpoint, refreshed periodically);
5. send each miner its planned work (scoring.workloads.plan_round; a share of its sampled chat
   requests are resends of its earlier ones with another seed, scoring.workloads.with_resends), bursts as simultaneous
   streams, with bounded concurrency overall and per miner (and, optionally, a bound on miners
   evaluated at once), per-request client timeouts and a deadline per miner from the start of
   its evaluation: what is still in flight then is cut and measured as a timeout, so a miner
   that stops answering is scored as unreliable and the round ends on time;
6. verify every answer: tier 0 always, a tier-1 audit on a sample (against the validator's own
   reference engine when it has one, else two other miners on different coldkeys that must
   agree; disagreement escalates to a tier-2 canary), tier 2 on canaries;
7. persist every measurement, failure and audit as it happens, then score every serving
   miner over the window, update the EMA and save both.

Weights are set by a separate task (`weights_loop`), once per epoch window of the subnet
(no weights since the latest epoch, and the weights rate limit passed), with the version key
of `inference.version`; transient chain errors (connection, rate limit, deadline) are retried
with exponential backoff while rounds go on.

Everything is in the SQLite store (neurons/validator_app/store.py): a restart resumes the round
counter, the measurement window, the EMA, the last weights and the used canaries.
"""
from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import random
import secrets
import signal
import sqlite3
import time
from collections.abc import Sequence
from contextlib import aclosing
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Optional

from chain import connect
from chain.interface import (Chain, ChainConnectionError, ChainError, Hyperparameters, MetagraphSnapshot, NeuronInfo,
                             RateLimited)
from chain.watch import MetagraphWatch
from inference.version import version_key
from neurons.base.settings import WalletNotFound, WalletSettings, open_wallet as open_cli_wallet
from neurons.gateway.server import GatewayServer
from neurons.gateway.settings import GatewaySetupError
from neurons.validator_app.gateway_route import RouteAndMiners, start_gateway_route
from neurons.validator_app.metrics import serve_validator_metrics
from neurons.validator_app.references import shared_reference
from neurons.validator_app.settings import ValidatorSettings, ValidatorSetupError
from neurons.validator_app.stage_rounds import attach_stage_rounds, excuse_route_failures, whole_model_work
from neurons.validator_app.store import DEFERRED_RETRY_S, ValidatorStore
from protocol.client import ClientTimeouts, GenerateResult, MinerClient, MinerError, MinerStreamError, MinerTimeout
from protocol.schemas import Capabilities, ErrorEvent, FinalMessage
from scoring.audit_sequence import AuditRecord, AuditSequence, CheckedAnswer, Verification
from scoring.auditors import AuditorCandidate
from scoring.canaries import CanaryPool, CanaryPoolError
from scoring.config import ScoringConfig
from scoring.failures import Failure
from scoring.metrics import Measurement, measure_auditor_failure, measure_burst, measure_request
from scoring.openings import OpeningRecord, StateOpenings
from scoring.replay import replays
from scoring.rewards import EmaEntry, MinerScore, score_miners, update_ema
from scoring.stage_judge import load_stage_envelopes
from scoring.tier0 import check_tier0, validator_prompt_ids
from scoring.weights import WeightEvidence, miner_weights, weights_from_ema, weights_to_submit
from scoring.workloads import WorkItem, WorkloadError, canary_prompts, group_bursts, plan_round, with_resends

log = logging.getLogger("k3.validator")

TRANSIENT_CHAIN_ERRORS = (ChainConnectionError, RateLimited, TimeoutError, OSError)
RESEND_MEMORY = 64  # sampled chat items remembered per miner, to resend with another seed


# ---------------------------------------------------------------- small pieces
class _Slots:
    """A counting semaphore that hands out several permits at once (a burst needs all its streams)."""

    def __init__(self, total: int):
        self.total = max(1, total)
        self.free = self.total
        self._changed = asyncio.Condition()

    @contextlib.asynccontextmanager
    async def hold(self, n: int):
        n = min(max(1, n), self.total)
        async with self._changed:
            await self._changed.wait_for(lambda: self.free >= n)
            self.free -= n
        try:
            yield
        finally:
            async with self._changed:
                self.free += n
                self._changed.notify_all()


@dataclass
class CpuStats:
    """Validator CPU spent verifying: tier 0 on the event loop's thread (exact), audits as wall time
    and process CPU time while they ran (approximate when audits overlap)."""

    tier0_s: float = 0.0
    tier0_count: int = 0
    audit_wall_s: float = 0.0
    audit_cpu_s: float = 0.0
    audit_count: int = 0


@dataclass(frozen=True)
class RankedMiner:
    uid: int
    hotkey: str
    url: str
    score: float  # EMA of S
    weight: float  # share of EMA^exponent among ranked miners


@dataclass
class MinerRound:
    uid: int
    hotkey: str
    sent: int = 0
    measured: int = 0
    timeouts: int = 0
    errors: int = 0
    cut_by_deadline: int = 0
    failures: int = 0
    audits: int = 0


@dataclass
class RoundReport:
    round: int
    started_at: float
    duration_s: float = 0.0
    miners: dict[int, MinerRound] = field(default_factory=dict)
    scores: dict[int, MinerScore] = field(default_factory=dict)
    skipped: Optional[str] = None  # why no round ran (no metagraph yet, no miners)


# ---------------------------------------------------------------- the state the gateway reads
class ValidatorState:
    """The validator's view, for the organic gateway (in this process or another, through the database).

    `ranked_miners()` orders the miners by EMA; `record_organic(...)` stores an organic generation
    with its tier-0 verdict (the gateway's, or its own when none is given) as a measurement (source
    "organic"), which the next round folds into the scoring window."""

    def __init__(self, store: ValidatorStore, tokenizer=None, config: Optional[ScoringConfig] = None):
        self.store = store
        self.tokenizer = tokenizer
        self.config = config or ScoringConfig()

    @classmethod
    def open(cls, db_path: str | Path, tokenizer=None, config: Optional[ScoringConfig] = None) -> "ValidatorState":
        """A view on a running validator's database (the gateway's entry point)."""
        return cls(ValidatorStore(db_path), tokenizer, config)

    def ranked_miners(self, limit: Optional[int] = None, min_score: float = 0.0) -> list[RankedMiner]:
        """Miners with an endpoint and an EMA above `min_score`, best first (ties by uid)."""
        ema = self.store.load_ema()
        miners = self.store.miners()
        rows = []
        for uid, entry in ema.items():
            miner = miners.get(uid)
            if miner is None or miner.url is None or miner.hotkey != entry.hotkey or entry.value <= min_score:
                continue
            rows.append((uid, miner.hotkey, miner.url, float(entry.value)))
        rows.sort(key=lambda r: (-r[3], r[0]))
        if limit is not None:
            rows = rows[:limit]
        shares = weights_from_ema({uid: score for uid, _, _, score in rows}, self.config.weight_exponent)
        return [RankedMiner(uid, hotkey, url, score, shares.get(uid, 0.0)) for uid, hotkey, url, score in rows]

    def record_organic(self, uid: int, hotkey: str, outcome: GenerateResult | MinerError,
                       prompt_ids: Optional[Sequence[int]] = None, tier0: Optional[list[Failure]] = None,
                       tier0_cpu_s: Optional[float] = None) -> Optional[Verification]:
        """An organic generation (a GenerateResult, or the MinerError raised), stored for the next
        round with its tier-0 verdict. `tier0` is the verdict the gateway already reached (tier 0
        runs once per organic request); without it tier 0 runs here. Returns the verification
        (None for an error)."""
        if self.tokenizer is None:
            raise ValueError("record_organic needs the model's tokenizer: ValidatorState(store, tokenizer)")
        miner = self.store.miners().get(uid)
        if miner is None or miner.hotkey != hotkey or miner.capabilities is None:
            raise ValueError(f"uid {uid} ({hotkey}) has no known capabilities yet; a validator round fetches them")
        capabilities = Capabilities.model_validate(miner.capabilities)
        request = outcome.partial.request if isinstance(outcome, MinerError) and outcome.partial else getattr(
            outcome, "request", None)
        if request is None:
            raise ValueError("the outcome carries no request (a MinerError without .partial)")
        ids = tuple(prompt_ids) if prompt_ids is not None else tuple(validator_prompt_ids(request, self.tokenizer))
        item = WorkItem("chat", request, ids)
        verification, cpu_s = None, None
        if isinstance(outcome, GenerateResult) and outcome.final is not None:
            if tier0 is not None:
                verification, cpu_s = Verification(tier0=list(tier0)), tier0_cpu_s
            else:
                started = time.thread_time()
                verification = Verification(tier0=check_tier0(item, outcome, self.tokenizer, capabilities, hotkey,
                                                              self.config))
                cpu_s = time.thread_time() - started
        measurement = measure_request(uid, hotkey, item, outcome, verification, self.config)
        round_number = self.store.round
        self.store.add_measurements([(measurement, cpu_s)], round_number, source="organic")
        self.store.add_failures(_failure_rows(measurement, item, verification, outcome, self.config), round_number,
                                source="organic")
        return verification


def _failure_rows(m: Measurement, item: WorkItem, verification: Optional[Verification],
                  outcome: GenerateResult | MinerError, config: ScoringConfig) -> list[dict]:
    base = dict(at=m.at, uid=m.uid, hotkey=m.hotkey, request_id=item.request.request_id, kind=item.kind)
    if isinstance(outcome, MinerError):
        if m.outcome == "excused":
            return []
        check = "round_deadline" if isinstance(outcome, MinerTimeout) and outcome.kind == "round_deadline" else m.outcome
        return [dict(base, check=check, reason=str(outcome), hard=False)]
    if outcome.final is None:
        return [dict(base, check="incomplete", reason="no final event", hard=False)]
    if verification is None:
        return []
    return [dict(base, check=f.check, reason=f.reason, hard=f.hard) for f in verification.failures
            if f not in verification.answer or _answer_counts(item, config)]


def _audit_row(neuron: NeuronInfo, item: WorkItem, record: AuditRecord) -> dict:
    """The store's row for one audit of an answer (tier 2: a canary; tier 1: against a reference)."""
    base = dict(uid=neuron.uid, hotkey=neuron.hotkey, request_id=item.request.request_id, kind=item.kind,
                tier=record.tier, reference=record.reference, cpu_s=record.cpu_s)
    result = record.result
    if record.tier == 2:
        return dict(base, passed=int(result.passed), positions=result.compared,
                    failures="; ".join(map(str, result.failures)))
    return dict(base, passed=None if result.passed is None else int(result.passed), quality=result.quality,
                mean_prob_diff=result.mean_prob_diff, positions=result.positions,
                greedy_mismatches=result.greedy_mismatches, outside_top_k=result.outside_top_k,
                disagreement=int(result.disagreement), error=result.error,
                failures="; ".join(map(str, result.failures)), wall_s=record.wall_s)


def _opening_row(neuron: NeuronInfo, item: WorkItem, record: OpeningRecord, number: int) -> dict:
    """The store's row for one opening of a whole-model miner's committed states (kind `state_opening`), with
    what it cost the validator beside the compute the miner spent on the same tokens."""
    v, stats = record.verdict, record.verdict.state
    cost = record.cost.as_row() if record.cost is not None else {}
    return dict(round=number, uid=neuron.uid, hotkey=neuron.hotkey, kind="state_opening",
                layers=f"{record.block[0]}-{record.block[1] - 1}" if record.block else None,
                passed=int(v.passed), blame=int(v.hard), reason=v.reason or "matched the recomputed block",
                tokens=stats.tokens if stats else record.positions, steps=1,
                median_rel_l2=stats.median if stats else None, bad=stats.bad if stats else None,
                bad_fraction=stats.bad_fraction if stats else None, q90_rel_l2=stats.q90 if stats else None,
                worst_rel_l2=stats.worst if stats else None, numerics=record.numerics, outside=v.outside,
                cpu_s=record.cost.cpu_s if record.cost is not None else None, wall_s=record.wall_s,
                request_id=item.request.request_id, origin="validator", bytes_read=record.bytes_received,
                check_flops=record.check_flops or None, checked_flops=record.checked_flops or None, **cost)


def _answer_counts(item: WorkItem, config: ScoringConfig) -> bool:
    """Whether a wrong answer (copy, planted fact) counts against the miner under this config; on the
    tiny random model nothing answers correctly, and such failures would only be noise."""
    if item.kind == "long_context":
        return config.planted_fact_scored
    return item.is_probe and item.expect.probe in config.probes_scored


# ---------------------------------------------------------------- the loop
class ValidatorLoop:
    """Rounds, verification, scoring and weight setting for one validator hotkey.

    Built by `build_validator(settings)` from the command line, or directly in tests with a chain
    (or a wrapper around one), a wallet, a store, the tokenizer and optionally a reference engine
    and a canary pool."""

    def __init__(self, settings: ValidatorSettings, *, chain: Chain, wallet, store: ValidatorStore, tokenizer,
                 reference=None, canaries: Optional[CanaryPool] = None, expected_fingerprint: Optional[str] = None,
                 client: Optional[MinerClient] = None, rng: Optional[random.Random] = None):
        self.settings = settings
        self.config = settings.scoring_config()
        self.chain = chain
        self.wallet = wallet
        self.hotkey = wallet.hotkey.ss58_address
        self.netuid = settings.chain.netuid
        self.store = store
        self.tokenizer = tokenizer
        self.expected_fingerprint = expected_fingerprint
        self.client = client or MinerClient(wallet.hotkey, settings.timeouts)
        self._owns_client = client is None
        seed = settings.rounds.seed
        self.rng = rng or random.Random(seed if seed is not None else secrets.randbits(64))
        # the order of checks per answer (and the auditors an escalation canary will settle) is scoring's
        self.block_reference = None  # neurons.validator_app.references.SharedReference, made on first need
        self.audits = AuditSequence(self.config, self.rng, tokenizer, reference=reference, canaries=canaries,
                                    client=self.client, timeouts=settings.timeouts,
                                    audit_timeout_s=settings.audits.timeout_s,
                                    openings=self._openings(settings, seed))
        self.state = ValidatorState(store, tokenizer, self.config)
        self.window, self._last_row = store.load_window(self.config.window_s, self.config.hard_failure_s)
        self.ema: dict[int, EmaEntry] = store.load_ema()
        self.metagraph = MetagraphWatch(chain, self.netuid, settings.chain.timeout_s)
        self._capabilities: dict[int, tuple[str, str, Capabilities, float]] = {}  # uid -> hotkey, url, caps, at
        self._unreplayable: set[str] = set()  # hotkeys already logged as declaring a sampler that does not replay
        self._sent_chat: dict[str, collections.deque] = {}  # hotkey -> its recent sampled chat items (resends)
        self.in_flight: dict[int, int] = {}  # uid -> our requests to it in flight now
        self.cpu = CpuStats()
        self._global_slots: Optional[_Slots] = None
        self._hyperparameters: Optional[tuple[Hyperparameters, float]] = None
        self._weights_hold_until = 0.0
        self.rounds_run = 0
        self.last_report: Optional[RoundReport] = None
        last = store.last_weights()
        self.last_weights_block: Optional[int] = last.block
        self.stage = None  # neurons.validator_app.stage_rounds.StageRounds, when it checks stage miners
        if not self.config.statistical_checks:
            log.warning("no honest-numerics envelope is measured for this model (scoring/envelopes/, matched by "
                        "fingerprint): tier 1's statistical tests are recorded, not judged; exact checks only (tier 0, "
                        "canaries, the greedy check, the replay of sampled answers with the conservative near-tie "
                        "allowance of %g nats and honest rate %g)", self.config.replay_delta_unmeasured,
                        self.config.replay_rate_unmeasured)
        if store.round:
            log.info("resuming at round %d: %d measurements, EMA of %d uids, weights last set at block %s",
                     store.round, len(self.window), len(self.ema), last.block)

    def _openings(self, settings: ValidatorSettings, seed: Optional[int]) -> Optional[StateOpenings]:
        """Openings of whole-model miners' state commitments, on the validator's block reference (with
        --reference-memory or --reference-engine); their draws have a random stream of their own."""
        if not settings.block_checks or not settings.engine.checkpoint:
            return None
        envelope = self.config.logprob_gap_envelope
        envelopes = load_stage_envelopes(str(envelope)) if envelope else None
        if envelopes is None:
            log.warning("no measured stage envelope for this model: openings of committed states are held to the "
                        "exact checks only (refusal, forgery, malformed states)")
        return StateOpenings(shared_reference(self, settings).get, self.client, rate=settings.audits.opening_rate,
                             rate_new=settings.audits.opening_rate_new, envelopes=envelopes,
                             timeouts=settings.timeouts,
                             rng=random.Random(secrets.randbits(64) if seed is None else seed + 0x0BE11))

    @property
    def reference(self):
        """The validator's own reference engine (None: its audits go to miner auditors)."""
        return self.audits.reference

    @reference.setter
    def reference(self, engine) -> None:
        self.audits.reference = engine

    @property
    def canaries(self) -> Optional[CanaryPool]:
        return self.audits.canaries

    @canaries.setter
    def canaries(self, pool: Optional[CanaryPool]) -> None:
        self.audits.canaries = pool

    async def close(self) -> None:
        if self.stage is not None:
            await self.stage.close()
        if self.block_reference is not None:
            self.block_reference.close()
        if self._owns_client:
            await self.client.close()

    # ------------------------------------------------------------ the rounds
    async def run(self, stop: Optional[asyncio.Event] = None, max_rounds: Optional[int] = None) -> int:
        """Rounds every `interval_s` (and the weight task beside them) until `stop` is set or
        `max_rounds` rounds ran (settings.rounds.max_rounds when None; 0 = no limit)."""
        stop = stop or asyncio.Event()
        max_rounds = self.settings.rounds.max_rounds if max_rounds is None else max_rounds
        weights = (asyncio.create_task(self.weights_loop(stop), name="k3-weights")
                   if self.settings.weights.enabled else None)
        kept_rows = asyncio.create_task(self.write_deferred_rows(stop), name="k3-deferred-rows")
        ran = 0
        try:
            while not stop.is_set():
                started = time.monotonic()
                if await self._round_unless_stopped(stop):
                    ran += 1
                if max_rounds and ran >= max_rounds:
                    break
                wait = self.settings.rounds.interval_s - (time.monotonic() - started)
                if wait > 0:
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(stop.wait(), wait)
        finally:
            for task in (weights, kept_rows):
                if task is not None:
                    task.cancel()
                    with contextlib.suppress(asyncio.CancelledError):
                        await task
        return ran

    async def write_deferred_rows(self, stop: asyncio.Event) -> None:
        """Write the rows a full disk kept back as soon as it has room (store.py), not only with the next row."""
        while not stop.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), DEFERRED_RETRY_S)
            if self.store.deferred_rows:
                try:
                    self.store.write_deferred()
                except sqlite3.Error as error:
                    log.warning("cannot write the rows a full disk kept back yet: %s", error)

    async def _round_unless_stopped(self, stop: asyncio.Event) -> bool:
        """One round; a stop cuts it short (what was measured is already stored). False when the
        round did not complete."""
        round_task = asyncio.create_task(self.run_round(), name="k3-round")
        stopping = asyncio.create_task(stop.wait())
        try:
            await asyncio.wait({round_task, stopping}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            stopping.cancel()
        if not round_task.done():
            log.info("stopping: cutting the round short")
            round_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await round_task
            return False
        try:
            round_task.result()
        except (ValueError, OSError, RuntimeError, KeyError, TypeError, AttributeError, sqlite3.Error) as error:
            # A validator-side fault in one round (a full disk included) must not end the validator; the next round
            # retries.
            log.exception("round failed: %s", error)
            return False
        return True

    async def run_round(self) -> RoundReport:
        number = self.store.begin_round()
        # one shape seed per round: every miner gets the same sizes, lengths, temperatures and bursts
        self.round_shape_seed = self.rng.getrandbits(64)
        report = RoundReport(number, time.time())
        started = time.monotonic()
        snapshot = await self.refresh_metagraph()
        self.ingest_organic()
        if snapshot is None:
            report.skipped = "no metagraph has been read yet"
            log.warning("round %d skipped: %s", number, report.skipped)
            return self._finish(report, started)
        serving = self.serving_miners(snapshot)
        if self.stage is not None:  # swarm stage miners: checked and paid in stage_rounds; the rest go on
            serving = await self.stage.run_round(serving, number)
        for neuron in serving:
            self.store.save_miner(neuron.uid, neuron.hotkey, neuron.coldkey, neuron.endpoint.url)
        self.store.forget_miners(n.uid for n in serving)
        chosen = self.select_miners(serving)
        if not chosen:
            report.skipped = "no serving miners on the subnet"
            log.warning("round %d: %s", number, report.skipped)
        self._global_slots = _Slots(self.settings.rounds.concurrency)
        self._refill_canaries_soon(len(chosen))
        at_once = asyncio.Semaphore(self.settings.rounds.miners_at_once or max(1, len(chosen)))
        results = await asyncio.gather(*(self._evaluate(neuron, number, at_once) for neuron in chosen),
                                       return_exceptions=True)
        for neuron, outcome in zip(chosen, results):
            if isinstance(outcome, asyncio.CancelledError):
                raise outcome
            if isinstance(outcome, BaseException):
                # Our fault, not the miner's: logged, and the miner is simply not measured this round.
                log.error("evaluating uid %d failed in the validator", neuron.uid,
                          exc_info=(type(outcome), outcome, outcome.__traceback__))
                continue
            report.miners[outcome.uid] = outcome
        report.scores = self.score(serving, number)
        return self._finish(report, started)

    def _finish(self, report: RoundReport, started: float) -> RoundReport:
        report.duration_s = time.monotonic() - started
        self.rounds_run += 1
        self.last_report = report
        if not report.skipped:
            best = sorted(report.scores, key=lambda uid: -self.ema.get(uid, EmaEntry("", 0.0)).value)[:8]
            scores = report.scores.values()
            silent = sum(1 for s in scores if not s.answered)  # unreachable, or failing every request
            zeroed = sum(1 for s in scores if s.zeroed)
            log.info("round %d: %d miners evaluated in %.1f s: %d answered, %d answered nothing (unreachable or "
                     "failing every request), %d zeroed by a failed check; best EMA: %s", report.round,
                     len(report.miners), report.duration_s, len(report.scores) - silent, silent, zeroed,
                     ", ".join(f"uid {uid} S={report.scores[uid].score:.3f} EMA={self.ema[uid].value:.3f}"
                               for uid in best if uid in self.ema) or "none yet")
        return report

    def ingest_organic(self) -> int:
        """Fold the organic measurements the gateway stored since the last call into the window."""
        rows, self._last_row = self.store.measurements_after(self._last_row, "organic")
        if rows:
            self.window.extend(rows)
            log.info("took %d organic measurements from the gateway", len(rows))
        return len(rows)

    # ------------------------------------------------------------ metagraph and miners
    @property
    def snapshot(self) -> Optional[MetagraphSnapshot]:
        return self.metagraph.snapshot

    @property
    def metagraph_failures(self) -> int:
        return self.metagraph.failures

    async def refresh_metagraph(self) -> Optional[MetagraphSnapshot]:
        """Re-read the metagraph (at most every metagraph_refresh_s) with a deadline; keep the last
        snapshot when the read fails."""
        return await self.metagraph.latest(self.settings.chain.metagraph_refresh_s)

    def serving_miners(self, snapshot: MetagraphSnapshot) -> list[NeuronInfo]:
        """Neurons with a published endpoint, except this validator (validators without endpoints
        drop out by themselves)."""
        return [n for n in snapshot.neurons if n.endpoint is not None and n.hotkey != self.hotkey]

    def select_miners(self, serving: list[NeuronInfo]) -> list[NeuronInfo]:
        only = self.settings.rounds.only_uids()
        if only is not None:
            serving = [n for n in serving if n.uid in only]
        size = self.settings.rounds.sample_size
        if not size or size >= len(serving):
            return list(serving)
        stored = self.store.miners()

        def staleness(n: NeuronInfo):
            last = stored.get(n.uid)
            evaluated = last.last_round if last is not None and last.hotkey == n.hotkey else None
            return (-1 if evaluated is None else evaluated, self.rng.random())

        return sorted(serving, key=staleness)[:size]

    async def capabilities_of(self, neuron: NeuronInfo, deadline: float) -> tuple[Optional[Capabilities], Optional[str]]:
        """The miner's capabilities (cached per uid, hotkey and endpoint); on failure the cached
        answer when there is one. Returns (capabilities, error)."""
        url = neuron.endpoint.url
        cached = self._capabilities.get(neuron.uid)
        now = time.monotonic()
        if cached is not None and cached[:2] == (neuron.hotkey, url) \
                and now - cached[3] < self.settings.rounds.capabilities_refresh_s:
            return cached[2], None
        budget = max(0.1, min(self.settings.rounds.capabilities_timeout_s,
                              deadline - asyncio.get_running_loop().time()))
        timeouts = ClientTimeouts(connect=min(self.settings.timeouts.connect, budget), first_byte=budget,
                                  between_events=budget, total=budget)
        try:
            caps = await self.client.capabilities(url, neuron.hotkey, timeouts)
        except MinerError as error:
            if cached is not None and cached[:2] == (neuron.hotkey, url):
                return cached[2], None
            return None, f"{type(error).__name__}: {error}"
        self._capabilities[neuron.uid] = (neuron.hotkey, url, caps, now)
        if not replays(caps.sampler) and neuron.hotkey not in self._unreplayable:
            self._unreplayable.add(neuron.hotkey)
            log.info("uid %d (%s) declares sampler %r, not k3-gumbel/1: its sampled answers cannot be replayed and "
                     "are checked statistically only", neuron.uid, neuron.hotkey, caps.sampler)
        self.store.save_miner(neuron.uid, neuron.hotkey, neuron.coldkey, url, caps.model_dump(mode="json"),
                              time.time())
        if self.expected_fingerprint and caps.model_fingerprint != self.expected_fingerprint:
            # Informational: a miner can claim any fingerprint; the audits decide. It helps operators.
            self.store.add_failures([dict(uid=neuron.uid, hotkey=neuron.hotkey, check="declared_model", hard=False,
                                          reason=f"declares model {caps.model_fingerprint}, the validator's is "
                                                 f"{self.expected_fingerprint}")], self.store.round)
        return caps, None

    # ------------------------------------------------------------ one miner's round
    async def _evaluate(self, neuron: NeuronInfo, number: int, at_once: asyncio.Semaphore) -> MinerRound:
        async with at_once:
            deadline = asyncio.get_running_loop().time() + self.settings.rounds.deadline_s
            return await self._evaluate_until(neuron, number, deadline)

    async def _evaluate_until(self, neuron: NeuronInfo, number: int, deadline: float) -> MinerRound:
        report = MinerRound(neuron.uid, neuron.hotkey)
        try:
            caps, error = await self.capabilities_of(neuron, deadline)
            if caps is None:
                self._record_unreachable(neuron, number, error or "no capabilities")
                report.errors += 1
                return report
            try:
                items = plan_round(self.rng, caps, self.config, tokenizer=self.tokenizer, canaries=self.canaries,
                                   shape_seed=getattr(self, "round_shape_seed", None))
                items = self._with_resends(neuron.hotkey, items)
            except WorkloadError as error:
                self._record_unreachable(neuron, number, f"cannot plan work for its declared limits: {error}",
                                         check="capabilities")
                report.errors += 1
                return report
            self.store.mark_canaries_used(i.expect.canary.canary_id for i in items if i.expect.canary is not None)
            singles, bursts = group_bursts(items)
            units: list[list[WorkItem]] = [[item] for item in singles] + list(bursts.values())
            self.rng.shuffle(units)
            slots = _Slots(min(self.settings.rounds.miner_concurrency, caps.max_concurrent_streams))
            escalations: list[WorkItem] = []
            await asyncio.gather(*(self._run_unit(neuron, caps, unit, slots, number, deadline, report, escalations)
                                   for unit in units))
            if escalations:
                await asyncio.gather(*(self._run_unit(neuron, caps, [item], slots, number, deadline, report, [])
                                       for item in escalations))
        finally:
            self.store.save_miner(neuron.uid, neuron.hotkey, neuron.coldkey, neuron.endpoint.url, last_round=number)
        return report

    def _with_resends(self, hotkey: str, items: list[WorkItem]) -> list[WorkItem]:
        """Some sampled chat items replaced by resends of this miner's earlier ones (another seed: a cache of
        answers by prompt fails their replay); this round's own sampled chat items are remembered for later."""
        earlier = self._sent_chat.setdefault(hotkey, collections.deque(maxlen=RESEND_MEMORY))
        items = with_resends(self.rng, items, list(earlier), self.config)
        earlier.extend(i for i in items if i.sampled_chat and i.resend_of is None)
        return items

    def _record_unreachable(self, neuron: NeuronInfo, number: int, reason: str, check: str = "unreachable") -> None:
        """A miner we could not even plan a round for: one failed request, so that it is unreliable."""
        now = time.time()
        m = Measurement(uid=neuron.uid, hotkey=neuron.hotkey, at=now, kind="chat",
                        request_id=f"capabilities-{secrets.token_hex(8)}",
                        outcome="timeout" if "Timeout" in reason else "error", failures=reason[:1000])
        self.window.add(m)
        self.store.add_measurements([(m, None)], number)
        self.store.add_failures([dict(at=now, uid=neuron.uid, hotkey=neuron.hotkey, check=check, reason=reason)],
                                number)
        log.warning("uid %d (%s): %s", neuron.uid, neuron.hotkey, reason)

    async def _run_unit(self, neuron: NeuronInfo, caps: Capabilities, unit: list[WorkItem], slots: _Slots,
                        number: int, deadline: float, report: MinerRound, escalations: list[WorkItem]) -> None:
        """One request, or one burst's streams at once: send, then verify and measure."""
        acquired = contextlib.AsyncExitStack()
        try:
            async with asyncio.timeout_at(deadline):
                await acquired.enter_async_context(slots.hold(len(unit)))
                await acquired.enter_async_context(self._global_slots.hold(len(unit)))
        except TimeoutError:
            await acquired.aclose()
            return  # never sent: the round's time ran out first
        try:
            sends = await asyncio.gather(*(self._send(neuron, item, deadline) for item in unit))
        finally:
            await acquired.aclose()
        report.sent += len(unit)
        measured: list[tuple[Measurement, Optional[float]]] = []
        failure_rows: list[dict] = []
        streams = []
        for item, (outcome, in_flight) in zip(unit, sends):
            verification, cpu_s = None, None
            if isinstance(outcome, GenerateResult) and outcome.final is not None:
                verification, cpu_s = await self._verify(neuron, caps, item, outcome, number, report, escalations)
            m = measure_request(neuron.uid, neuron.hotkey, item, outcome, verification, self.config,
                                in_flight=in_flight, capacity=caps.max_concurrent_streams)
            if isinstance(outcome, MinerError):
                report.timeouts += m.outcome == "timeout"
                report.errors += m.outcome == "error"
                report.cut_by_deadline += isinstance(outcome, MinerTimeout) and outcome.kind == "round_deadline"
            measured.append((m, cpu_s))
            rows = _failure_rows(m, item, verification, outcome, self.config)
            report.failures += len(rows)
            failure_rows += rows
            streams.append((item, outcome, verification))
        if unit[0].burst_id is not None:
            measured.append((measure_burst(neuron.uid, neuron.hotkey, streams, self.config), None))
        for m, _ in measured:
            self.window.add(m)
        report.measured += len(measured)
        # Persisted as soon as measured: a crash mid-round loses nothing already measured.
        self.store.add_measurements(measured, number)
        self.store.add_failures(failure_rows, number)

    async def _send(self, neuron: NeuronInfo, item: WorkItem, deadline: float) -> tuple[Any, int]:
        """(GenerateResult or MinerError with .partial, our requests in flight to it counting this one)."""
        uid = neuron.uid
        self.in_flight[uid] = self.in_flight.get(uid, 0) + 1
        in_flight = self.in_flight[uid]
        result = GenerateResult(request=item.request, body=b"", started_at=time.time())
        try:
            async with asyncio.timeout_at(deadline):
                async with aclosing(self.client.stream_generate(neuron.endpoint.url, neuron.hotkey, item.request,
                                                                result=result)) as events:
                    async for timed in events:
                        if isinstance(timed.event, FinalMessage):
                            result.final = timed.event
                        elif isinstance(timed.event, ErrorEvent):
                            result.error = timed.event
                            raise MinerStreamError(timed.event.code, timed.event.message)
            return result, in_flight
        except MinerError as error:
            error.partial = result
            return error, in_flight
        except TimeoutError:
            error = MinerTimeout("round_deadline", self.settings.rounds.deadline_s)
            error.partial = result
            return error, in_flight
        finally:
            self.in_flight[uid] -= 1

    async def _verify(self, neuron: NeuronInfo, caps: Capabilities, item: WorkItem, result: GenerateResult,
                      number: int, report: MinerRound, escalations: list[WorkItem]) -> tuple[Verification, float]:
        """The audit sequence (scoring.audit_sequence) decides every check; this stores what it found and
        queues the escalation canary it asks for."""
        new_or_suspect = self.window.is_new_or_suspect(neuron.uid, neuron.hotkey, time.time(), self.config)
        checked = await self.audits.check(item, result, caps, uid=neuron.uid, hotkey=neuron.hotkey,
                                          coldkey=neuron.coldkey, new_or_suspect=new_or_suspect,
                                          candidates=self._auditor_candidates, url=neuron.endpoint.url)
        for record in checked.openings:
            self.store.add_stage_check(_opening_row(neuron, item, record, number))
        self._count_cpu(checked)
        report.audits += len(checked.audits)
        for record in checked.audits:
            self.store.add_audit(_audit_row(neuron, item, record), number)
        for finding in checked.against_auditors:
            self._record_against(finding.auditor, finding.check, finding.reason, number)
        if checked.canaries_used:
            self.store.mark_canaries_used(checked.canaries_used)
        if checked.escalation is not None:
            escalations.append(checked.escalation)
        return checked.verification, checked.cpu_s

    def _count_cpu(self, checked: CheckedAnswer) -> None:
        self.cpu.tier0_s += checked.cpu_s
        self.cpu.tier0_count += 1
        audit = checked.tier1
        if audit is not None:
            self.cpu.audit_wall_s += audit.wall_s
            self.cpu.audit_cpu_s += audit.cpu_s
            self.cpu.audit_count += 1

    def _auditor_candidates(self) -> list[AuditorCandidate]:
        """Every serving miner with its EMA and the limits it declared, for scoring.auditors to choose from."""
        candidates = []
        for other in self.serving_miners(self.snapshot) if self.snapshot is not None else []:
            cached = self._capabilities.get(other.uid)
            known = cached[2] if cached is not None and cached[0] == other.hotkey else None
            ema = self.ema.get(other.uid)
            candidates.append(AuditorCandidate(
                uid=other.uid, hotkey=other.hotkey, coldkey=other.coldkey, url=other.endpoint.url,
                score=ema.value if ema is not None and ema.hotkey == other.hotkey else 0.0,
                max_context=known.max_context if known else None,
                max_score_tokens=known.limits.max_score_tokens if known else None))
        return candidates

    def _record_against(self, auditor: AuditorCandidate, check: str, reason: str, number: int) -> None:
        """A failed audit against an auditor (scoring.metrics.measure_auditor_failure), stored."""
        m = measure_auditor_failure(auditor.uid, auditor.hotkey, check, reason)
        self.window.add(m)
        self.store.add_measurements([(m, None)], number)
        self.store.add_failures([dict(at=m.at, uid=auditor.uid, hotkey=auditor.hotkey, check=check, reason=reason)],
                                number)
        log.warning("auditor uid %d (%s): %s: %s", auditor.uid, auditor.hotkey, check, reason)

    # ------------------------------------------------------------ canaries on the reference
    def _refill_canaries_soon(self, miners: int) -> None:
        """Engine-computed pools are topped up between rounds when fewer canaries are left than
        miners to probe (computing them takes the reference a while)."""
        if self.reference is None or self.canaries is None or self.settings.audits.canary_pool:
            return
        if self.canaries.remaining >= max(1, miners):
            return
        log.info("only %d canaries left: computing %d more on the reference", self.canaries.remaining,
                 self.settings.audits.canaries)
        task = asyncio.create_task(self.add_reference_canaries(self.settings.audits.canaries))
        task.add_done_callback(lambda t: t.exception() and log.error("canary refill failed: %s", t.exception()))

    async def add_reference_canaries(self, count: int) -> int:
        """Compute `count` canaries on the reference engine and add them to the pool (and the store)."""
        if self.reference is None or count <= 0:
            return 0
        caps = reference_capabilities(self.reference)
        prompts = canary_prompts(self.rng, count, caps, self.config, self.tokenizer)
        fresh = await CanaryPool.from_engine(self.reference, prompts, self.config, caps.model_fingerprint)
        if self.canaries is None:
            self.canaries = CanaryPool([], model_fingerprint=caps.model_fingerprint)
        added = [c for c in fresh.canaries.values() if c.canary_id not in self.canaries.canaries]
        for canary in added:
            self.canaries.canaries[canary.canary_id] = canary
        entries = fresh.to_json()["canaries"]
        self.store.save_canaries((e["id"], e) for e in entries if e["id"] in {c.canary_id for c in added})
        return len(added)

    # ------------------------------------------------------------ scoring
    def score(self, serving: list[NeuronInfo], number: int) -> dict[int, MinerScore]:
        """Score every serving miner over the window, update the EMA, save both (one transaction)."""
        now = time.time()
        self.window.prune(now)
        if self.stage is not None:  # a route driver's failures on a route through a stage since blamed
            excuse_route_failures(self.store, self.window, now - self.window.keep_s)
        hotkeys = {n.uid: n.hotkey for n in serving}
        coldkeys = {n.uid: n.coldkey for n in serving}
        scores = score_miners(self.window, self.config, now, hotkeys, coldkeys)
        self.ema = update_ema(self.ema, scores, self.config.ema_alpha)
        self.store.save_round(number, scores, self.ema, now)
        self.store.prune(now - self.window.keep_s)
        return scores

    def weight_evidence(self) -> WeightEvidence:
        """What this validator's weights depend on: the EMA, the share of each miner's answers that carried a state
        commitment, and with stage rounds the work of both kinds."""
        committed = self.committed_shares()
        if self.stage is None:
            return WeightEvidence(self.ema, committed=committed)
        return WeightEvidence(self.ema, whole_model_work(self), self.stage.evidence(), committed=committed)

    def committed_shares(self) -> dict[int, float]:
        """uid -> the share of its completed answers in the window that carried a state commitment."""
        out = {}
        for uid in self.window.uids():
            seen = [m.committed for m in self.window.rows(uid) if m.outcome == "completed" and m.committed is not None]
            if seen:
                out[uid] = sum(seen) / len(seen)
        return out

    def current_weights(self) -> dict[int, float]:
        """uid -> weight as scoring.weights decides it (zeros kept)."""
        return miner_weights(self.weight_evidence(), self.config)

    # ------------------------------------------------------------ weights
    async def _chain(self, awaitable):
        return await asyncio.wait_for(awaitable, self.settings.chain.timeout_s)

    async def hyperparameters(self) -> Hyperparameters:
        cached = self._hyperparameters
        if cached is not None and time.monotonic() - cached[1] < 600.0:
            return cached[0]
        hp = await self._chain(self.chain.hyperparameters(self.netuid))
        self._hyperparameters = (hp, time.monotonic())
        return hp

    async def weights_due(self) -> tuple[bool, Optional[int], str]:
        """(due, block, why): weights are due once per epoch window, when none were set since the
        subnet's latest epoch and the weights rate limit has passed."""
        if not self.ema and not (self.stage is not None and self.stage.miners):
            return False, None, "no scores yet"
        if time.monotonic() < self._weights_hold_until:
            return False, None, "holding after a chain refusal"
        block = await self._chain(self.chain.block())
        hp = await self.hyperparameters()
        until = await self._chain(self.chain.blocks_until_next_epoch(self.netuid))
        last = self.last_weights_block
        if last is None:
            return True, block, "no weights set yet"
        if last > block:
            return True, block, f"the chain is at block {block}, before our last weights at {last} (a new chain?)"
        latest_epoch = block + until - (hp.tempo + 1)
        if last >= latest_epoch:  # an epoch runs before the block's transactions: weights at its block count
            return False, block, f"weights already set at block {last}, after the epoch at {latest_epoch}"
        if block - last < hp.weights_rate_limit:
            return False, block, f"rate limit: {hp.weights_rate_limit - (block - last)} more blocks"
        return True, block, f"no weights since the epoch at block {latest_epoch}"

    async def set_weights(self, stop: Optional[asyncio.Event] = None) -> bool:
        """Submit the weights scoring.weights decides from the current evidence, retrying transient chain
        errors with exponential backoff (rounds go on meanwhile). False when the chain refused for good or
        `stop` was set."""
        w = self.settings.weights
        attempt = 0
        while stop is None or not stop.is_set():
            submitted = weights_to_submit(self.weight_evidence(), self.config)
            if not submitted:
                self.store.record_weight_attempt(False, "every miner has weight 0: nothing to submit")
                log.warning("not setting weights: every miner's EMA is 0")
                self._weights_hold_until = time.monotonic() + w.retry_max_s
                return False
            try:
                outcome = await self._chain(self.chain.set_weights(self.wallet, self.netuid, submitted, version_key()))
            except TRANSIENT_CHAIN_ERRORS as error:
                if getattr(error, "retry_after_blocks", None):  # the chain said how many blocks to wait
                    self.store.record_weight_attempt(False, f"{type(error).__name__}: {error}", weights=submitted)
                    log.info("set-weights: the chain asks us to wait %d blocks (%s)", error.retry_after_blocks, error)
                    if not await self._wait_blocks(error.retry_after_blocks, stop):
                        return False
                    continue
                delay = min(w.retry_s * 2 ** attempt, w.retry_max_s)
                attempt += 1
                reason = f"{type(error).__name__}: {error}"
                self.store.record_weight_attempt(False, reason, weights=submitted)
                log.warning("set-weights attempt %d failed (%s); retrying in %.1f s", attempt, reason, delay)
                if stop is None:
                    await asyncio.sleep(delay)
                else:
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(stop.wait(), delay)
                continue
            except (ChainError, ValueError, TypeError) as error:
                reason = f"{type(error).__name__}: {error}"
                self.store.record_weight_attempt(False, reason, weights=submitted)
                log.error("the chain refused our weights (%s); trying again in %.0f s", reason, w.retry_max_s)
                self._weights_hold_until = time.monotonic() + w.retry_max_s
                return False
            hotkeys = {uid: e.hotkey for uid, e in self.ema.items()}
            # on chain now, whether or not the store can record it (a full disk): said and remembered first
            self.last_weights_block = outcome.block
            log.info("weights set at block %d for %d uids (version key %d)", outcome.block, len(submitted),
                     version_key())
            self.store.save_weights(submitted, hotkeys, outcome.block, version_key())
            return True
        return False

    async def _wait_blocks(self, blocks: int, stop: Optional[asyncio.Event]) -> bool:
        """Until the chain is `blocks` blocks on from now, polling every retry_s; False when `stop` is set."""
        target = None
        while stop is None or not stop.is_set():
            with contextlib.suppress(*TRANSIENT_CHAIN_ERRORS):
                now = await self._chain(self.chain.block())
                target = now + blocks if target is None else target
                if now >= target:
                    return True
            if stop is None:
                await asyncio.sleep(self.settings.weights.retry_s)
            else:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), self.settings.weights.retry_s)
        return False

    async def _safe_hyperparameters(self) -> Optional[Hyperparameters]:
        try:
            return await self.hyperparameters()
        except (*TRANSIENT_CHAIN_ERRORS, ChainError):
            return self._hyperparameters[0] if self._hyperparameters else None

    async def weights_loop(self, stop: asyncio.Event) -> None:
        """Check every `check_s` whether weights are due; set them when they are."""
        while not stop.is_set():
            try:
                due, block, why = await self.weights_due()
                if due:
                    log.info("weights due at block %s (%s)", block, why)
                    await self.set_weights(stop)
            except asyncio.CancelledError:
                raise
            except TRANSIENT_CHAIN_ERRORS as error:
                log.warning("cannot tell whether weights are due (%s: %s)", type(error).__name__, error)
            except Exception:  # noqa: BLE001 - the weight task must outlive any one failure
                log.exception("weight task failure")
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), self.settings.weights.check_s)


# ---------------------------------------------------------------- wiring from settings
def reference_capabilities(engine) -> Capabilities:
    """The reference engine's capabilities in wire form (for planning canary prompts)."""
    from inference.version import __version__  # noqa: PLC0415

    caps = engine.capabilities()
    return Capabilities(model_id=caps.model_id, model_fingerprint=caps.model_fingerprint or "reference",
                        vocab_size=caps.vocab_size, max_context=caps.max_context,
                        max_concurrent_streams=max(1, caps.max_concurrent_sequences), engine=caps.engine_kind,
                        precision=caps.precision or "unknown", sampler=caps.sampler, software_version=__version__)


def open_wallet(settings: WalletSettings):
    """The wallet this neuron signs with (neurons.base.settings.open_wallet), as a setup error when missing."""
    try:
        return open_cli_wallet(settings)
    except WalletNotFound as error:
        raise ValidatorSetupError(str(error)) from None


@dataclass
class Validator:
    """A validator built from settings: the loop and what it owns."""

    loop: ValidatorLoop
    chain: Chain
    store: ValidatorStore
    engine: Any = None
    owns_chain: bool = True

    async def close(self) -> None:
        await self.loop.close()
        if self.engine is not None:
            await self.engine.stop()
        if self.owns_chain:
            await self.chain.close()
        self.store.close()


async def build_validator(settings: ValidatorSettings, *, chain: Optional[Chain] = None, wallet=None) -> Validator:
    """Open the wallet, the chain, the store, the tokenizer, the reference engine and the canary pool."""
    problems = settings.problems()
    if problems:
        raise ValidatorSetupError("; ".join(problems))
    from inference.model import load_tokenizer  # noqa: PLC0415
    from inference.model import CheckpointError, fingerprint, read_config  # noqa: PLC0415
    from inference.serving import EngineSpecError, build_engine  # noqa: PLC0415

    wallet = wallet or open_wallet(settings.wallet)
    checkpoint = settings.engine.checkpoint
    tokenizer = load_tokenizer(checkpoint, read_config(checkpoint))
    try:
        expected = fingerprint(checkpoint)
    except (CheckpointError, OSError, ValueError, KeyError):
        expected = None
    owns_chain = chain is None
    chain = chain or connect(settings.chain.network)
    store = ValidatorStore(settings.db)
    engine = None
    try:
        if settings.reference_engine:
            try:
                # the validator's own engine answers nobody's openings: it commits to nothing
                engine = await asyncio.to_thread(build_engine, replace(settings.engine, commit_layers=0))
            except EngineSpecError as error:
                raise ValidatorSetupError(str(error)) from None
            await engine.start()
        canaries = None
        if settings.audits.canary_pool:
            try:
                canaries = CanaryPool.from_file(settings.audits.canary_pool, used=store.used_canaries())
            except CanaryPoolError as error:
                raise ValidatorSetupError(str(error)) from None
        elif engine is not None and store.stored_canaries():
            canaries = CanaryPool.from_json({"format": CanaryPool.FORMAT, "version": CanaryPool.VERSION,
                                             "canaries": store.stored_canaries()}, used=store.used_canaries())
        loop = ValidatorLoop(settings, chain=chain, wallet=wallet, store=store, tokenizer=tokenizer, reference=engine,
                             canaries=canaries, expected_fingerprint=expected)

        attach_stage_rounds(loop, settings)
        if engine is not None and not settings.audits.canary_pool:
            missing = settings.audits.canaries - (canaries.remaining if canaries else 0)
            if missing > 0:
                log.info("computing %d canaries on the reference engine", missing)
                await loop.add_reference_canaries(missing)
        try:
            uid = await asyncio.wait_for(chain.uid_of(wallet.hotkey.ss58_address, settings.chain.netuid),
                                         settings.chain.timeout_s)
        except (ChainError, TimeoutError, OSError) as error:
            log.warning("cannot look up this validator's uid yet (%s)", error)
        else:
            if uid is None:
                log.warning("hotkey %s is not registered on subnet %d: rounds run, weights cannot be set until it is",
                            wallet.hotkey.ss58_address, settings.chain.netuid)
        return Validator(loop, chain, store, engine, owns_chain)
    except BaseException:
        if engine is not None:
            await engine.stop()
        if owns_chain:
            await chain.close()
        store.close()
        raise


async def run_validator(settings: ValidatorSettings, stop: Optional[asyncio.Event] = None) -> int:
    """Run until SIGINT/SIGTERM, `stop`, or --max-rounds. Returns the exit status."""
    validator = await build_validator(settings)
    stop = stop or asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    gateway = metrics = route = None
    try:
        if settings.gateway.enabled:
            # organic traffic: routed to the best miners by this validator's own scores, checked by tier 0
            directory = validator.loop.state
            if settings.gateway.route != "off":  # and through a route of stage miners, credited as stage work

                route = await start_gateway_route(validator.loop, settings)
                directory = RouteAndMiners(directory, route, settings.gateway.route)
            try:
                gateway = GatewayServer(directory, validator.loop.client, validator.loop.state.tokenizer,
                                        settings.gateway, scoring_config=validator.loop.config)
            except GatewaySetupError as error:
                raise ValidatorSetupError(f"gateway: {error}") from None
            await gateway.start()
            log.info("organic gateway on http://%s:%s/v1", settings.gateway.host, gateway.port)
        metrics = await serve_validator_metrics(settings, validator, gateway)
        await validator.loop.run(stop)
    finally:
        if metrics is not None:
            await metrics.close()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)
        if gateway is not None:
            await gateway.close()
        if route is not None:
            await route.close()
        await validator.close()
    return 0


__all__ = [
    "CpuStats", "MinerRound", "RankedMiner", "RoundReport", "Validator", "ValidatorLoop", "ValidatorState",
    "build_validator", "reference_capabilities", "run_validator",
]
