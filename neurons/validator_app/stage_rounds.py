"""Stage miners in the validator's rounds: find them, drive sessions through them, check sessions after they ran,
blame, and pay them in the same weight vector as whole-model miners.

Nothing a stage can observe tells a check from traffic, because every check is traffic:

1. **Find the stage miners**: every serving neuron whose endpoint answers GET /stage/capabilities signed by its
   own hotkey for this model (whole-model miners answer 404 and go on to the whole-model round).
2. **Drive sessions** (`sessions` per round): chat-like prompts of random lengths, greedy or sampled, through the
   validator's route driver (`driver`: a balanced `RouteDriver` over the stages the validator trusts, signing as
   the validator). It is the same driver, engine and result endpoint that serve the gateway's organic route
   (neurons/validator_app/gateway_route.py), so a stage sees one driver and one kind of session.
3. **Settle** (`settle`): every recorded step of the driver, whoever asked for it, has its receipts audited
   (signed by the stages for the layers they announce, chained from what the driver sent, never credited
   before) and each stage is credited the step's tokens (`validator_work` for the validator's own sessions,
   `gateway_work` for organic ones; an organic request's steps are credited at once, `credit_finished`, before
   the gateway ends the user's answer). Then a share of the sessions (all of the validator's own, `organic_audit_rate`
   of the organic ones) is checked after the fact (neurons/validator_app/session_audits.py): the stages' ledgers
   are read, every byte checked against what was signed, and every stage re-run on the validator's reference of
   its block over exactly its recorded inputs. Each check is a `session_check` row with its statistics and
   whether it lies outside the honest envelope of the stage's declared numerics; the stage's window of checks
   is then judged (scoring.stage_judge: a binomial test with a stated false-positive budget) and a `verdict`
   row blames it when the evidence is certain. Exact lies (a ledger of other bytes than signed, two receipts
   for one step, a malformed output, a replayed one) are blamed at once (`session_lie`). A ledger not given, a
   timeout or a disconnect is a fault: the stage is not checked that time (`unchecked`), lowers its
   availability, and is never blamed for it.
4. **Route work of others** (`claim_route_work`, at the work endpoint, neurons/validator_app/route_work.py): a
   route driver (the route miner) claims the receipts of the sessions it drove, each naming the request it
   served. Only requests this validator sent that driver are credited, each at most the tokens the validator
   measured for it (work nobody asked for earns nothing); receipts that do not audit blame the driver (and zero
   its whole-model weight); `work_audit_rate` of the credited sessions are checked after the fact like the
   validator's own.
5. **Decoys**: optionally the validator serves a block itself under a decoy hotkey (`DecoyServer`); a stage
   miner of the same block that opens a session there hands its work on without saying so and is blamed.

Weights (`evidence`, scoring.weights): stage miners' credited layer-tokens over the window, the route-measured
step time, the share of their sampled checks that could be made (availability), and 0 for a blamed stage.
"""
from __future__ import annotations

import asyncio
import collections
import hashlib
import logging
import math
import random
import secrets
import statistics
import time
from dataclasses import dataclass, field, replace
from typing import Mapping, Optional, Sequence

import aiohttp

from inference.decoding.sampling import SamplingParams
from inference.serving.engine import GenerationRequest
from inference.swarm.block_reference import references_for
from inference.swarm.stage import LayerRange, Stage
from neurons.base.settings import open_wallet
from neurons.swarm.codec import encode_ids
from neurons.swarm.route import (LoggedRouteDriver, RouteEngine, StageDirectory, StageInfo, StaticDirectory, StepRecord,
                                 TrustedDirectory)
from neurons.swarm.stage_server import StageServer, StageServerSettings
from neurons.validator_app.references import shared_reference
from neurons.validator_app.route_work import RouteWorkServer
from neurons.validator_app.session_audits import SessionAuditor, StageCheck, describe
from neurons.validator_app.settings import ValidatorSetupError
from neurons.validator_app.store import OWN_WORK_KINDS, WORK_KINDS, StageTotals
from protocol.stage import state_sha256, verify_receipt
from scoring.corpus import code_snippet, paragraph
from scoring.stage_checks import audit_receipts
from scoring.stage_judge import load_stage_envelopes
from scoring.stage_rewards import MinerWork, active_params_per_layer
from scoring.weights import StageEvidence

log = logging.getLogger("k3.validator.stages")

OWN_REQUEST_PREFIX = "stage-session-"  # request ids of the validator's own sessions (never sent to a stage)
SAMPLED_KINDS = ("session_check", "unchecked", "session_lie")  # a sampled session: checked, or could not be
MAX_HELD_STEPS = 4096  # per driver: claimed steps waiting for the validator to measure their request
# a request's route work is credited up to this many times its measured prompt and completion tokens (a verify step
# of speculative decoding runs its drafts through every stage, and a recovery re-prefills)
SPECULATION_ROOM = 2


@dataclass(frozen=True)
class StageMiner:
    uid: Optional[int]
    hotkey: str
    coldkey: str
    info: StageInfo

    @property
    def layers(self) -> tuple[int, int]:
        return self.info.start, self.info.stop

    @property
    def label(self) -> str:
        return f"{self.info.start}-{self.info.stop - 1}"


@dataclass
class StageRoundReport:
    stage_miners: int = 0
    sessions: int = 0  # driven by the validator this round
    checked: int = 0  # stage checks made (settled sessions times their stages)
    outside: int = 0
    blamed: list[str] = field(default_factory=list)  # hotkeys blamed this round


class DecoyServer(StageServer):
    """A block served by the validator itself under a decoy hotkey; tells `watch` who opens sessions on it."""

    def __init__(self, stage: Stage, keypair, settings: StageServerSettings, watch):
        super().__init__(stage, keypair, settings)
        self.watch = watch

    async def handle_open(self, caller: str, body: bytes):
        response = await super().handle_open(caller, body)
        self.watch(caller, (self.stage.layers.start, self.stage.layers.stop))
        return response


def pooled_route_work(work: Mapping[int, MinerWork], own: Mapping[int, int],
                      outside: Mapping[int, int]) -> dict[int, int]:
    """Each stage's credited layer-tokens: its own (the validator's and its gateway's sessions, which the
    validator's driver spreads over a block's stages by load for weight) plus a share of its block's route work of
    outside drivers, in proportion to its own. An outside driver picks its routes, so the stages it favours would
    otherwise take all the pay of the work it brings, and identical stages of a block end far apart; pooled per
    block, the demand outside drivers bring pays the block's checked capacity, whichever stage they sent it to.
    A block none of whose unblamed stages has work of the validator's own keeps its route work where it fell."""
    blocks: dict[tuple, list[int]] = {}
    for uid, w in work.items():
        blocks.setdefault(w.layers, []).append(uid)
    out = {}
    for uids in blocks.values():
        fair = [u for u in uids if not work[u].failed_checks]
        pool = sum(outside[u] for u in fair)
        base = sum(own[u] for u in fair)
        for u in uids:
            if work[u].failed_checks or base == 0:
                out[u] = own[u] + outside[u]
            else:
                out[u] = own[u] + round(pool * own[u] / base)
    return out


def excuse_route_failures(store, window, since: float) -> int:
    """A route driver's answer that failed its audits on a route through a stage blamed after it was the stage's
    lie, not the driver's: the driver could not know before the validator did (a failure after the blame could
    have avoided the stage, and stands). Each such measurement in the validator's `window` (and in `store`) is
    excused: neither verified work nor a failure. How many."""
    failed = [m for m in window.rows(since=since)
              if (m.hard_failure or m.audit_failures) and m.request_id and m.outcome != "excused"]
    blamed = store.blamed_stages(since) if failed else {}
    excused = 0
    for m in failed if blamed else []:
        liar = next((h for h in sorted(store.route_stages(m.request_id, m.hotkey))
                     if h in blamed and m.at < blamed[h][0]), None)
        if liar is None:
            continue
        why = f"excused: served through stage {liar}, since blamed ({blamed[liar][1][:160]}); was: {m.failures}"
        window.replace(m, replace(m, outcome="excused", audits=0, audit_failures=0, quality=None,
                                  hard_failure=False, failures=why[:1000]))
        store.excuse_measurement(m.request_id, m.hotkey, why[:1000])
        log.info("route driver %s: answer %s %s", m.hotkey, m.request_id, why[:200])
        excused += 1
    return excused


class StageRounds:
    def __init__(self, store, keypair, reference, tokenizer, directory: StageDirectory, config, *, sessions: int = 2,
                 max_tokens: int = 48, max_prompt_tokens: int = 160, organic_audit_rate: float = 0.1,
                 work_audit_rate: float = 0.25, seed: Optional[int] = None, host: str = "127.0.0.1", port: int = 0,
                 public_url: str = "", timeout_s: float = 15.0, blame_s: float = 24 * 3600.0,
                 window_s: float = 24 * 3600.0, decoy_keypair=None, decoys: Mapping[tuple[int, int], int] = {},
                 work_port: Optional[int] = None, envelope: Optional[str] = None, model_fingerprint: str = ""):
        """`reference`: the validator's reference of any block, `reference[(start, stop)] -> Stage`
        (inference.swarm.block_reference: a BlockReference reading the checkpoint as checks need it, or a model held
        in memory); None: `loader` makes one on first need. `directory`: where the validator's route driver finds
        the stage miners (the metagraph's); the stages blamed in `store` are left out. `config`: the model's (the
        driver and the layers' costs need no weights). `envelope`: the model envelope file whose `stages` section
        holds the honest bounds of each numerics (None: the model has none, and only exact checks apply)."""
        self.store = store
        self.keypair = keypair
        self.reference = reference  # the validator's reference of any block; None: made on first need (loader)
        self.tokenizer = tokenizer
        self.directory = directory
        self.config = config
        self.sessions = sessions
        self.max_tokens = max_tokens
        self.max_prompt_tokens = max_prompt_tokens
        self.organic_audit_rate = organic_audit_rate
        self.work_audit_rate = work_audit_rate
        self.rng = random.Random(seed if seed is not None else secrets.randbits(64))
        self.host, self.port = host, port  # the driver's result endpoint (and the decoys')
        self.public_url = public_url  # where stage miners reach the driver's result endpoint
        self.timeout_s = timeout_s
        self.blame_s = blame_s
        self.window_s = window_s
        self.decoy_keypair = decoy_keypair
        self.decoys = dict(decoys)  # block -> port the validator serves a decoy of it on
        self.work_port = work_port  # where outside route drivers submit their receipts (None: no endpoint)
        self.envelope = envelope
        self.model_fingerprint = model_fingerprint
        self.work_server = None  # neurons.validator_app.route_work.RouteWorkServer, once started
        self.serving: set[str] = set()  # hotkeys of the subnet's serving neurons in the last round
        self.miners: dict[str, StageMiner] = {}  # hotkey -> the stage miner, from the last round
        self.driver: Optional[LoggedRouteDriver] = None
        self.engine: Optional[RouteEngine] = None
        self.auditor: Optional[SessionAuditor] = None
        self._refs = None  # the reference as a mapping block -> Stage, once made
        self.layer_costs = active_params_per_layer(config)  # per-layer compute: the blocks' shares of the work
        self._http: Optional[aiohttp.ClientSession] = None
        self._decoy_servers: list[DecoyServer] = []
        # request ids of the validator's own sessions not settled yet, and of those the ones whose generation ended
        # (insertion-ordered, the oldest forgotten past MAX_OWN: a session that never produced records)
        self._own: dict[str, None] = {}
        self._finished: dict[str, None] = {}
        self._settling = asyncio.Lock()
        self._unchecked: collections.deque = collections.deque()  # (steps, stages, own) credited, to check
        self._unsettled = _no_sessions()  # what was credited since the last settle
        self._audits: set[asyncio.Task] = set()  # checks of claimed route work, in the background
        # session -> the steps drivers claimed of it while it waits for its check, None when not drawn or checked
        # (insertion-ordered, the oldest forgotten past 4096)
        self._claimed: dict[str, Optional[list[StepRecord]]] = {}
        self._held: dict[str, list] = {}  # driver -> [(when, claimed step)] whose request is not measured yet
        self.hold_s = 600.0
        self._claimed_at: dict[str, float] = {}  # session -> when a step of it was last credited
        self.claim_settle_s = 20.0  # a sampled claimed session is checked once no step came for this long
        self.number = 0
        self.last_report = StageRoundReport()
        self._credited = _SeenReceipts()  # receipts credited (the validator's driver and outside drivers): to whom
        self.loader = None  # () -> the reference (a BlockReference), called in a thread when reference is None

    # ------------------------------------------------------------ lifecycle
    async def start(self) -> None:
        """The validator's route driver and engine (shared with the gateway's route) and the work endpoint."""
        if self._http is not None:
            return
        self._http = aiohttp.ClientSession()
        self.driver = LoggedRouteDriver(TrustedDirectory(self.directory, self.store, self.blame_s), self.keypair,
                                        self.config, host=self.host, port=self.port, public_url=self.public_url,
                                        hop_timeout_s=self.timeout_s, record_steps=65536)
        self.engine = RouteEngine(self.driver, self.tokenizer, model_fingerprint=self.model_fingerprint)
        await self.engine.start()
        if self.work_port is not None:
            self.work_server = RouteWorkServer(self.keypair, self.claim_route_work, self.host, self.work_port)
            await self.work_server.start()

    async def _ensure_model(self) -> None:
        if self.reference is None and self.loader is not None:
            self.reference = await asyncio.to_thread(self.loader)
        if self.reference is None:
            raise RuntimeError("stage checks need the validator's reference of the model's blocks")
        if self._refs is None:
            self._refs = references_for(self.reference)
            envelopes = load_stage_envelopes(self.envelope) if self.envelope else None
            if envelopes is None:
                log.warning("no measured stage envelope for this model: stage outputs are held to the exact checks "
                            "only (no statistical verdicts)")
            cfg = self.config
            self.auditor = SessionAuditor(self.keypair, self._refs, num_layers=cfg.num_layers,
                                          hidden_size=cfg.hidden_size, envelopes=envelopes, timeout_s=self.timeout_s)

    async def close(self) -> None:
        for task in list(self._audits):
            task.cancel()
        if self.work_server is not None:
            await self.work_server.close()
        for server in self._decoy_servers:
            await server.close()
        if self.engine is not None:
            await self.engine.stop()
        if self._http is not None:
            await self._http.close()
        self._http = self.engine = self.driver = None

    @property
    def num_layers(self) -> int:
        return self.config.num_layers

    # ------------------------------------------------------------ finding stage miners
    async def discover(self, serving: Sequence) -> list[StageMiner]:
        """The serving neurons that are stage miners (signed stage capabilities by their own hotkey)."""
        fetch = StaticDirectory([], timeout_s=min(5.0, self.timeout_s), config_hash=self.config.config_hash())
        found = await asyncio.gather(*(fetch._one(self._http, n.endpoint.url) for n in serving))
        return [StageMiner(n.uid, n.hotkey, n.coldkey, info) for n, info in zip(serving, found)
                if info is not None and info.hotkey == n.hotkey]

    async def run_round(self, serving: Sequence, number: int) -> list:
        """Drive and settle this round's sessions through the stage miners among `serving`; return the other
        (whole-model) neurons."""
        await self.start()
        self.number = number
        self.serving = {n.hotkey for n in serving}
        miners = await self.discover(serving)
        stage_hotkeys = {m.hotkey for m in miners}
        rest = [n for n in serving if n.hotkey not in stage_hotkeys]
        if not miners:
            return rest
        await self._ensure_model()
        await self._start_decoys()
        self.miners = {m.hotkey: m for m in miners}
        self.store.save_stage_miners([dict(uid=m.uid, hotkey=m.hotkey, coldkey=m.coldkey, url=m.info.url,
                                           layers=m.label, fingerprint=m.info.caps.fingerprint,
                                           step_ms=m.info.caps.step_ms) for m in miners])
        report = StageRoundReport(stage_miners=len(miners))
        await self.driver.stages(refresh=True)
        self.credit_held()
        for _ in range(self.sessions):
            report.sessions += await self.drive_session()
        settled = await self.settle()
        report.checked, report.outside, report.blamed = settled["checked"], settled["outside"], settled["blamed"]
        log.info("round %d: %d stage miners, %d sessions driven, %d stage checks (%d outside the envelope); blamed "
                 "%s", number, len(miners), report.sessions, report.checked, report.outside, sorted(report.blamed))
        self.last_report = report
        return rest

    # ------------------------------------------------------------ the validator's own sessions
    def _prompt(self, n: int) -> list[int]:
        ids: list[int] = []
        while len(ids) < n:
            text = paragraph(self.rng) if self.rng.random() < 0.6 else code_snippet(self.rng)
            ids += self.tokenizer.encode(text)
        return ids[:n]

    async def drive_session(self) -> int:
        """One session through the validator's driver, shaped like organic traffic (a chat-sized prompt, a
        completion, greedy or sampled); 1 when it completed, 0 when no route could serve it (a fault)."""
        request_id = OWN_REQUEST_PREFIX + secrets.token_hex(8)
        n = int(2 ** self.rng.uniform(4, math.log2(max(16, self.max_prompt_tokens))))  # log-uniform, 16 up
        # what a user's request asks for: no logprobs, a common temperature and nucleus, stopping at the end of
        # text (the head stage sees these; nothing about them may tell a check from a user)
        params = SamplingParams(max_tokens=self.rng.randint(4, max(4, self.max_tokens)),
                                temperature=self.rng.choice((0.0, 0.6, 0.7, 1.0)),
                                top_p=self.rng.choice((1.0, 1.0, 0.95, 0.9)), seed=self.rng.getrandbits(62))
        _remember(self._own, request_id)
        try:
            stream = self.engine.generate(GenerationRequest(self._prompt(n), params, request_id))
            async for event in stream:
                if getattr(event, "finish_reason", None) == "error":
                    return 0
        except Exception as e:  # noqa: BLE001 (no route, a stage down: a fault, retried next round)
            log.info("the validator's own session found no route: %s", e)
            return 0
        finally:
            _remember(self._finished, request_id)  # its records are complete, closed or not
        return 1

    # ------------------------------------------------------------ settling recorded sessions
    def credit_finished(self, request_id: Optional[str] = None) -> None:
        """Credit at once, without awaiting anything, every complete session the validator's driver recorded:
        closed, or of a request whose generation ended (`request_id`, marked ended here). The gateway calls it
        before it writes the answer's end to the user, so a validator killed once the user was answered has
        lost no record of the work; the sessions' checks wait for `settle()`."""
        if request_id:
            _remember(self._finished, request_id)
        if self.driver is not None:
            self._credit_done({s.hotkey: s for s in self.driver.known_stages()})

    async def settle(self) -> dict:
        """Credit and check every step the validator's driver recorded since the last settle (module doc, 3).
        Returns a summary: sessions, credited layer-tokens, checks made, outside, blamed hotkeys (with what
        `credit_finished` credited since the last settle)."""
        async with self._settling:
            stages = {s.hotkey: s for s in (await self.driver.stages() if self.driver else [])}
            self._credit_done(stages)
            out, self._unsettled = {**self._unsettled, "checked": 0, "outside": 0, "blamed": []}, _no_sessions()
            for _ in range(len(self._unchecked)):  # those credited since come with the next settle
                recs, known, own = self._unchecked.popleft()
                if own or self.rng.random() < self.organic_audit_rate:
                    await self._check(recs, known, "validator" if own else "organic", out)
            return out

    def _credit_done(self, stages: dict[str, StageInfo]) -> None:
        """Take the driver's records of complete sessions, audit and credit them (module doc, 3), and queue them
        for their checks; what was credited is added to the next settle's summary."""
        records, open_ = [], []
        while self.driver is not None and self.driver.records:
            rec = self.driver.records.popleft()
            done = rec.session in self.driver.closed or rec.request_id in self._finished
            (records if done else open_).append(rec)
        if self.driver is not None:
            self.driver.records.extendleft(reversed(open_))  # sessions still running: credited once closed
            # a session was planned on stages its driver's listing may have dropped since (gone unhealthy, or left
            # after serving it): their receipts are still for work done on the validator's own route
            stages.update({h: info for h, info in self.driver.routed.items() if h not in stages})
        stages.update({m.hotkey: m.info for m in self.miners.values() if m.hotkey not in stages})
        sessions: dict[str, list[StepRecord]] = {}
        for rec in records:
            sessions.setdefault(rec.session, []).append(rec)
        out = self._unsettled
        out["sessions"] += len(sessions)
        for session, recs in sessions.items():
            own = any(r.request_id in self._own for r in recs)
            problem = self._credit(recs, stages, self.keypair.ss58_address,
                                   "validator_work" if own else "gateway_work")
            if problem:
                out["problems"].append(problem)
                continue
            out["credited_tokens"] += sum(int(r.input_specs[0].shape[0]) * len(r.receipts) for r in recs)
            self._unchecked.append((recs, stages, own))
        for r in records:
            self._own.pop(r.request_id, None)
            self._finished.pop(r.request_id, None)

    def _credit(self, recs: Sequence[StepRecord], stages: Mapping[str, StageInfo], driver: str,
                kind: str) -> Optional[str]:
        """Audit a session's receipts and credit its stages the tokens of each step; the problem otherwise (the
        stage that signs for layers it does not announce is blamed; anything else is the recording driver's)."""
        registered = {h: (s.start, s.stop) for h, s in stages.items()}
        seen = _NewReceipts(self._credited, driver)
        for rec in sorted(recs, key=lambda r: r.step):
            a = audit_receipts(list(rec.receipts), rec.route_id, rec.session, rec.step,
                               state_sha256(list(rec.input_specs), rec.input_body), registered, self.num_layers, seen,
                               driver)
            if not a.ok:
                if a.blame != "driver" and a.blame in stages:
                    m = self._stage_miner(stages[a.blame])
                    self._row(m, "session_receipts", passed=0, blame=1, reason=a.problem, session=rec.session)
                else:
                    log.warning("driver %s recorded receipts that do not audit: %s", driver, a.problem)
                return a.problem
        seen.keep()
        for rec in recs:
            tokens = int(rec.input_specs[0].shape[0])
            for r in rec.receipts:
                self._row(self._stage_miner(stages[r.stage]), kind, passed=1, tokens=tokens, session=rec.session,
                          route_id=rec.route_id, request_id=rec.request_id or None, origin=driver,
                          reason=f"{kind.split('_')[0]} session through driver {driver}")
        return None

    async def _check(self, recs: Sequence[StepRecord], stages: Mapping[str, StageInfo], origin: str,
                     out: dict) -> None:
        started = time.monotonic()
        try:
            checks, read = await self.auditor.open(self._http, recs, stages)
        except Exception:  # noqa: BLE001 (a check that breaks must not stop the others; nobody is blamed for it)
            log.exception("checking session %s failed", recs[0].session)
            return
        wall = time.monotonic() - started
        for c in checks:
            info = stages.get(c.hotkey)
            if info is None:
                continue
            m = self._stage_miner(info)
            self._store_check(m, c, recs[0], origin, read, wall, sum(int(r.input_specs[0].shape[0]) for r in recs))
            if c.checked:
                out["checked"] += 1
                out["outside"] += bool(c.outside)
            blamed = self._judge(m, c)
            if blamed:
                out["blamed"].append(m.hotkey)

    def _store_check(self, m: StageMiner, c: StageCheck, rec: StepRecord, origin: str, read: int,
                     wall: float, tokens: int) -> None:
        """One check's row, with what it cost: the validator re-ran the stage's block over every token the stage
        ran, so its compute equals the checked work (`check_flops` = `checked_flops`, 2 x the block's active
        parameters x tokens)."""
        s = c.stats
        kind = "session_lie" if c.lie else ("unchecked" if c.unavailable else "session_check")
        flops = 2.0 * sum(self.layer_costs[c.layers[0]:c.layers[1]]) * tokens if c.checked else None
        cost = c.cost.as_row() if c.cost is not None else {}
        self._row(m, kind, passed=int(c.checked and not c.lie and not c.outside), blame=int(bool(c.lie)),
                  reason=f"session {rec.session} ({origin}): {describe(c)}", tokens=s.tokens if s else 0,
                  steps=c.steps, median_rel_l2=s.median if s else None, bad_fraction=s.bad_fraction if s else None,
                  bad=s.bad if s else None, q90_rel_l2=s.q90 if s else None, worst_rel_l2=s.worst if s else None,
                  numerics=c.numerics, outside=c.outside, cpu_s=c.cpu_s, wall_s=c.cost.wall_s if c.cost else wall,
                  session=rec.session, route_id=rec.route_id, origin=origin, bytes_read=read, check_flops=flops,
                  checked_flops=flops, **cost)
        if c.lie:
            log.warning("stage %s (%s) lied in session %s: %s", m.hotkey, m.label, rec.session, c.lie)

    def _judge(self, m: StageMiner, c: StageCheck) -> bool:
        """The statistical verdict over the stage's window of checks, after a new one (a `verdict` row when it
        blames); True when the stage stands blamed now."""
        if c.lie:
            return True
        if not c.checked:
            return False
        rows = [r for r in self.store.stage_checks(since=time.time() - self.window_s, hotkey=m.hotkey,
                                                   kinds=["session_check"]) if r["numerics"] == c.numerics]
        v = self.auditor.judge([r["outside"] for r in rows], c.numerics, c.kind)
        if v is None or not v.blame:
            return False
        if not self.store.stage_blame(m.hotkey, time.time() - self.blame_s, kind="verdict"):
            log.warning("stage %s (%s) blamed: %s", m.hotkey, m.label, v.reason)
            self._row(m, "verdict", passed=0, blame=1, reason=v.reason, numerics=c.numerics)
        return True

    def _row(self, m: StageMiner, kind: str, **fields) -> None:
        self.store.add_stage_check(dict(round=self.number, uid=m.uid, hotkey=m.hotkey, layers=m.label, kind=kind,
                                        passed=fields.pop("passed", 0), blame=fields.pop("blame", 0), **fields))

    # ------------------------------------------------------------ decoys
    async def _start_decoys(self) -> None:
        if self._decoy_servers or not self.decoys:
            return
        for (a, b), port in self.decoys.items():
            stage = Stage(self._refs.model, LayerRange(a, b, self.num_layers), fingerprint="decoy")
            server = DecoyServer(stage, self.decoy_keypair, StageServerSettings(host=self.host, port=port),
                                 self._decoy_saw)
            await server.start()
            self._decoy_servers.append(server)

    def _decoy_saw(self, caller: str, block: tuple[int, int]) -> None:
        """A session opened on a decoy (the validator's own block under another hotkey)."""
        miner = self.miners.get(caller)
        if miner is None or miner.layers != block:
            return
        now = time.time()
        if self.store.stage_blame(miner.hotkey, now - 60, kind="decoy"):
            return  # one row per minute is enough
        why = (f"opened a session on a stage of its own block {miner.label} (the validator's decoy): it hands its "
               "work to another stage without saying so")
        log.warning("stage %s (%s): %s", miner.hotkey, miner.label, why)
        self._row(miner, "decoy", passed=0, blame=1, reason=why)

    # ------------------------------------------------------------ route work of outside drivers
    def claim_route_work(self, work, driver: str) -> tuple[int, dict]:
        """A claim an outside route driver submitted (protocol.route_work.RouteWork, at the work endpoint):
        (HTTP status, answer). 503 until a round has found the stage miners; 403 when the driver is no serving
        neuron of the subnet; 422 (the driver blamed, nothing credited) when the receipts do not audit; else 200
        with the layer-tokens credited, the steps held (their request is not measured yet: credited once it is,
        within `hold_s`) and the steps not credited (no request of this validator's, or more tokens than it
        measured for the request)."""
        if self._refs is None or not self.miners:
            return 503, {"code": "not_ready", "message": "the validator has not found the stage miners yet; submit "
                                                         "again after its next round"}
        if driver not in self.serving:
            return 403, {"code": "not_registered", "message": f"{driver} is not a serving neuron of this subnet"}
        self.credit_held()
        return self._credit_steps(list(work.steps), driver, hold=True)

    def credit_held(self, now: Optional[float] = None) -> int:
        """Credit the held steps whose request the validator has measured since (or drop them past `hold_s`);
        the layer-tokens credited."""
        now = time.time() if now is None else now
        credited = 0
        for driver, held in list(self._held.items()):
            ready = [s for at, s in held if self.store.request_measurement(s.request_id, driver) is not None
                     and not self._undiscovered(s)]
            self._held[driver] = [(at, s) for at, s in held if now - at < self.hold_s and s not in ready]
            if ready:
                status, answer = self._credit_steps(ready, driver, hold=False)
                credited += answer.get("credited_tokens", 0) if status == 200 else 0
        return credited

    def _undiscovered(self, step) -> bool:
        """Whether a claimed step holds a receipt its stage really signed, of a stage the last round did not find
        (one that registered since, or was restarting when the round looked): its layers are not known yet, and
        that is no sign of a lie. Such steps wait for a round that finds the stage (within `hold_s`), neither
        credited nor blamed. A receipt not signed by the hotkey it names is a forgery whoever that is."""
        return any(r.stage not in self.miners and verify_receipt(r) for r in step.receipts)

    def _credit_steps(self, steps, driver: str, hold: bool) -> tuple[int, dict]:
        stages = {m.hotkey: m.info for m in self.miners.values()}
        before = [self._credited.credited_to_all(s.receipts, driver) for s in steps]
        resent = [s for s, b in zip(steps, before) if b]
        steps = [s for s, b in zip(steps, before) if not b]
        waiting = [s for s in steps if self._undiscovered(s)]
        found = [s for s in steps if not self._undiscovered(s)]
        room = max(0, MAX_HELD_STEPS - len(self._held.get(driver, ()))) if hold else 0
        self._held.setdefault(driver, []).extend((time.time(), s) for s in waiting[:room])
        records, uncredited, held = self._asked_for(found, driver, hold)
        uncredited, held = uncredited + len(waiting[room:]), held + len(waiting[:room])
        registered = {h: (s.start, s.stop) for h, s in stages.items()}
        seen = _NewReceipts(self._credited, driver)
        for rec in records:
            a = audit_receipts(list(rec.receipts), rec.route_id, rec.session, rec.step,
                               state_sha256(list(rec.input_specs), rec.input_body), registered, self.num_layers, seen,
                               driver)
            if not a.ok:
                self._blame_driver(driver, a, rec)
                return 422, {"code": "receipts_rejected",
                             "message": f"nothing credited, the driver is blamed: step {rec.step} of session "
                                        f"{rec.session}: {a.problem}"}
        credited = 0
        for rec in records:
            tokens = int(rec.input_specs[0].shape[0])
            for r in rec.receipts:
                self._row(self._stage_miner(stages[r.stage]), "route_work", passed=1, tokens=tokens,
                          session=rec.session, route_id=rec.route_id, request_id=rec.request_id, origin=driver,
                          reason=f"route work of driver {driver} for request {rec.request_id}")
                credited += tokens
        seen.keep()
        self._sample_claimed(records, stages, driver)
        log.info("route driver %s: %d steps, %d layer-tokens credited, %d held, %d not credited, %d credited before",
                 driver, len(steps) + len(resent), credited, held, uncredited, len(resent))
        return 200, {"steps": len(steps) + len(resent), "credited_tokens": credited, "held_steps": held,
                     "uncredited_steps": uncredited, "credited_before_steps": len(resent)}

    def _sample_claimed(self, records: Sequence[StepRecord], stages: Mapping[str, StageInfo], driver: str) -> None:
        """A session is drawn for a check once, at its first claimed step; the claimed steps of a drawn session are
        kept until it is checked, of the others only that they were seen."""
        for rec in records:
            if rec.session not in self._claimed:
                drawn = self.rng.random() < self.work_audit_rate
                self._claimed[rec.session] = [] if drawn else None
                if drawn:
                    task = asyncio.ensure_future(self._check_claimed(rec.session, stages, driver))
                    self._audits.add(task)
                    task.add_done_callback(self._audits.discard)
            known = self._claimed[rec.session]
            if known is not None:
                known.append(rec)
                self._claimed_at[rec.session] = time.monotonic()
        while len(self._claimed) > 4096:
            self._claimed_at.pop(next(iter(self._claimed)), None)
            del self._claimed[next(iter(self._claimed))]

    def _asked_for(self, steps, driver: str, hold: bool) -> tuple[list[StepRecord], int, int]:
        """The claimed steps that serve a request this validator sent `driver`, within the tokens it measured for
        each request (prompt and completion, less what was credited for it before): (records, steps left out,
        steps held: with `hold`, a step whose request is not measured yet waits for it)."""
        budget: dict[str, int] = {}
        spent: set[str] = set()
        records, left_out, held = [], 0, 0
        for s in sorted(steps, key=lambda s: (s.request_id, s.session, s.step)):
            if s.request_id not in budget:
                m = self.store.request_measurement(s.request_id, driver) if s.request_id else None
                if m is None and hold and s.request_id and len(self._held.get(driver, ())) < MAX_HELD_STEPS:
                    budget[s.request_id] = -1  # not measured yet: hold its steps
                else:
                    budget[s.request_id] = 0 if m is None else \
                        SPECULATION_ROOM * (int(m["prompt_tokens"] or 0) + int(m["completion_tokens"] or 0)) - \
                        self.store.credited_request_tokens(s.request_id) // max(1, len(s.receipts))
            if budget[s.request_id] < 0 and s.request_id not in spent:
                self._held.setdefault(driver, []).append((time.time(), s))
                held += 1
                continue
            if s.request_id in spent or len(s.token_ids) > budget[s.request_id]:
                spent.add(s.request_id)  # the rest of this request's steps: a gap would leave nothing to re-run
                left_out += 1
                continue
            budget[s.request_id] -= len(s.token_ids)
            specs, body = encode_ids(list(s.token_ids))
            records.append(StepRecord(s.route_id, s.session, s.step, s.position, tuple(s.receipts), tuple(specs), body,
                                      b"", s.rewind, s.request_id))
        return records, left_out, held

    def _blame_driver(self, driver: str, audit, rec: StepRecord) -> None:
        who = driver if audit.blame == "driver" else audit.blame
        if self.store.stage_blame(who, time.time() - 60, kind="route_receipts"):
            return
        m = self.miners.get(who)
        problem = f"step {rec.step} of session {rec.session}: {audit.problem}"
        log.warning("route driver %s presented receipts that do not audit: %s", driver, problem)
        self.store.add_stage_check(dict(round=self.number, uid=m.uid if m else self._uid_of(who), hotkey=who,
                                        layers=m.label if m else None, kind="route_receipts", passed=0, blame=1,
                                        reason=f"presented by route driver {driver}: {problem}"))

    async def _check_claimed(self, session: str, stages: Mapping[str, StageInfo], driver: str) -> None:
        """Check a claimed session once no step of it was credited for `claim_settle_s` (its steps come in over
        several claims, some held until their request is measured): what was credited by then."""
        while True:
            quiet = time.monotonic() - self._claimed_at.get(session, 0.0)
            if quiet >= self.claim_settle_s:
                break
            await asyncio.sleep(self.claim_settle_s - quiet)
        recs = sorted(self._claimed.get(session) or [], key=lambda r: r.step)
        if session in self._claimed:
            self._claimed[session] = None  # checked: its steps are let go, the session stays seen
        self._claimed_at.pop(session, None)
        if not recs:  # forgotten while it settled (more than 4096 sessions claimed since)
            return
        try:
            await self._check(recs, stages, f"route work of {driver}", {"checked": 0, "outside": 0, "blamed": []})
        except Exception:  # noqa: BLE001 (a background check must never take the validator down)
            log.exception("checking route work of %s failed", driver)

    def blamed_drivers(self, now: Optional[float] = None) -> dict[str, str]:
        """Route drivers blamed for receipts that do not audit within `blame_s`: hotkey -> the latest reason."""
        since = (time.time() if now is None else now) - self.blame_s
        return {r["hotkey"]: r["reason"]
                for r in self.store.stage_checks(since=since, kinds=["route_receipts"], blamed=True)}

    def _uid_of(self, hotkey: str) -> Optional[int]:
        m = self.miners.get(hotkey)
        if m is not None:
            return m.uid
        return next((uid for uid, r in self.store.stage_miners().items() if r["hotkey"] == hotkey), None)

    def _stage_miner(self, info: StageInfo) -> StageMiner:
        m = self.miners.get(info.hotkey)
        return m if m is not None else StageMiner(self._uid_of(info.hotkey), info.hotkey, "", info)

    # ------------------------------------------------------------ work and weights
    def stage_work(self, now: Optional[float] = None) -> dict[int, MinerWork]:
        """Per stage uid over the window: credited layer-tokens, the step time of the routes it served (the
        announced one until it served any), availability (the share of its sampled checks that could be made),
        and the blame reasons within `blame_s`."""
        now = time.time() if now is None else now
        # added up by the store: the credited work is most of the table, and this runs every round
        totals = self.store.stage_totals(now - self.window_s, WORK_KINDS, SAMPLED_KINDS)
        latest_blame = {r["hotkey"]: f"{r['kind']}: {r['reason']}"
                        for r in self.store.stage_checks(since=now - self.blame_s, blamed=True)}
        out, own, outside = {}, {}, {}
        for uid, sm in self.store.stage_miners().items():
            mine = totals.get(sm["hotkey"]) or StageTotals()
            own[uid] = sum(mine.tokens.get(k, 0) for k in OWN_WORK_KINDS)
            outside[uid] = mine.tokens.get("route_work", 0)
            sampled = sum(mine.rows.get(k, 0) for k in SAMPLED_KINDS)
            available = (sampled - mine.rows.get("unchecked", 0)) / sampled if sampled else 1.0
            blames = [latest_blame[sm["hotkey"]]] if sm["hotkey"] in latest_blame else []
            a, b = (int(x) for x in sm["layers"].split("-"))
            out[uid] = MinerWork(sm["hotkey"], 0, self._step_ms(sm), available, (a, b + 1), blames)
        for uid, tokens in pooled_route_work(out, own, outside).items():
            out[uid].verified_tokens = tokens
        return out

    def _step_ms(self, sm) -> float:
        """The decode step time of the routes through this stage, shared by their stages (the driver measures
        routes, not stages), else the stage's announced step time."""
        times = self.driver.step_times.get(sm["hotkey"]) if self.driver is not None else None
        return statistics.median(times) if times else float(sm["step_ms"] or 0.0)

    def evidence(self) -> StageEvidence:
        """What the weights need of the stage rounds (scoring.weights): the stage miners' work, the blamed route
        drivers, and the layers' costs (from the model's config)."""
        return StageEvidence(self.stage_work(), self.blamed_drivers(), self.layer_costs)


MAX_OWN = 10_000


def _no_sessions() -> dict:
    return {"sessions": 0, "credited_tokens": 0, "problems": []}


def _remember(ids: dict, key: str) -> None:
    ids[key] = None
    while len(ids) > MAX_OWN:
        del ids[next(iter(ids))]


class _SeenReceipts(dict):
    """The receipts already credited, each with the driver it was credited to, the oldest forgotten past `limit`.
    A receipt is kept by a 16-byte digest of its signature (not the 128 hex characters: a third of the memory)."""

    limit = 200_000

    @staticmethod
    def key(signature: str) -> bytes:
        return hashlib.blake2b(signature.encode(), digest_size=16).digest()

    def add(self, signature: str, driver: str) -> None:
        self[self.key(signature)] = driver
        while len(self) > self.limit:
            del self[next(iter(self))]

    def __contains__(self, signature) -> bool:
        return super().__contains__(self.key(signature))

    def credited_to_all(self, receipts, driver: str) -> bool:
        """Whether every one of a step's receipts was credited to `driver` before: the same driver presenting its
        own claim again (a retry after an answer it never got) is told so, not blamed."""
        return bool(receipts) and all(self.get(self.key(r.signature)) == driver for r in receipts)


class _NewReceipts(set):
    """The receipt signatures one claim presents, checked against those already credited; `keep()` adds them to
    the credited ones, for `driver` (only once the whole claim audited)."""

    def __init__(self, credited: _SeenReceipts, driver: str):
        super().__init__()
        self.credited, self.driver = credited, driver

    def __contains__(self, signature) -> bool:
        return super().__contains__(signature) or signature in self.credited

    def keep(self) -> None:
        for signature in self:
            self.credited.add(signature, self.driver)


def whole_model_work(loop) -> dict[int, MinerWork]:
    """Whole-model miners' verified model-tokens over the window, decode speed and reliability (the market's
    terms), from the ValidatorLoop's window and last scores."""
    latest = loop.store.latest_scores()
    out = {}
    for uid in loop.window.uids():
        rows = [m for m in loop.window.rows(uid) if m.verified]
        score = latest.get(uid)
        tps = score["decode_tps"] if score is not None else None
        tokens = sum((m.prompt_tokens or 0) + (m.completion_tokens or 0) for m in rows)
        hotkey = rows[0].hotkey if rows else (score["hotkey"] if score is not None else "")
        out[uid] = MinerWork(hotkey, tokens, 1000.0 / tps if tps else 0.0,
                             float(score["reliability"]) if score is not None and score["reliability"] is not None
                             else 1.0)
    return out


def decoy_keypair(settings):
    """The hotkey the decoys sign as (--stage-decoy-hotkey of the validator's wallet); ValidatorSetupError when
    it is missing or is the validator's own."""
    s = settings.stages
    if not s.decoy_hotkey:
        raise ValidatorSetupError("--stage-decoys needs --stage-decoy-hotkey NAME")
    try:
        key = open_wallet(replace(settings.wallet, hotkey=s.decoy_hotkey)).hotkey
    except Exception as error:  # noqa: BLE001 (a missing or unreadable key file: say which)
        raise ValidatorSetupError(f"--stage-decoy-hotkey {s.decoy_hotkey!r}: {error}") from None
    if settings.wallet.hotkey == s.decoy_hotkey:
        raise ValidatorSetupError("--stage-decoy-hotkey must not be the validator's own hotkey (stage miners would "
                                  "recognise the decoy)")
    return key


def attach_stage_rounds(loop, settings) -> Optional[StageRounds]:
    """Stage checks for a validator with a block reference (--reference-memory GB, or --reference-engine) and
    --stage-sessions > 0, configured by settings.stages (--stage-*: session lengths, audit rates, timeouts, blame
    and work windows, decoys, the driver's result endpoint); the reference is the loop's one block reference
    (neurons.validator_app.references), made on first need (the first stage miner found): it reads the blocks from
    --checkpoint on disk as checks need them, never the whole model."""
    sessions = getattr(settings.rounds, "stage_sessions", 0)
    if not settings.block_checks or not sessions:
        return None
    from inference.model.checkpoint import CheckpointError, fingerprint, read_config  # noqa: PLC0415 (torch)
    from neurons.swarm.route import MetagraphDirectory  # noqa: PLC0415

    s = settings.stages
    checkpoint = settings.engine.checkpoint
    try:
        model_fp = fingerprint(checkpoint)
    except CheckpointError:
        model_fp = ""
    config = read_config(checkpoint)
    directory = MetagraphDirectory(loop.chain, settings.chain.netuid, config_hash=config.config_hash(),
                                   model_fingerprint=model_fp or None)
    envelope = settings.scoring_config().logprob_gap_envelope
    decoys = s.decoy_ports()
    stage = StageRounds(loop.store, loop.wallet.hotkey, None, loop.tokenizer, directory, config, sessions=sessions,
                        seed=settings.rounds.seed, max_tokens=s.max_tokens,
                        organic_audit_rate=settings.gateway.route_audit_rate,
                        work_audit_rate=s.work_audit_rate, host=s.sink_host, port=s.sink_port,
                        public_url=s.sink_url or "", timeout_s=s.timeout_s, blame_s=s.blame_s, window_s=s.window_s,
                        decoys=decoys, decoy_keypair=decoy_keypair(settings) if decoys else None,
                        work_port=s.work_port, envelope=str(envelope) if envelope else None,
                        model_fingerprint=model_fp)
    stage.loader = shared_reference(loop, settings).get
    loop.stage = stage
    return stage


__all__ = ["DecoyServer", "OWN_REQUEST_PREFIX", "StageMiner", "StageRoundReport", "StageRounds", "attach_stage_rounds",
           "decoy_keypair", "pooled_route_work", "whole_model_work"]
