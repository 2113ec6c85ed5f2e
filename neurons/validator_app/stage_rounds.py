"""Stage miners in the validator's rounds: find them, challenge them over the stage wire, audit relayed routes,
blame, and pay them in the same weight vector as whole-model miners.

Each round (`StageRounds.run_round`, called from ValidatorLoop.run_round with the serving neurons):
1. **Find the stage miners**: every serving neuron whose endpoint answers GET /stage/capabilities signed by
   its own registered hotkey for this model (whole-model miners answer 404 and go on to the whole-model
   round, which gets only them).
2. **Challenge each stage miner** `challenges` times (for a block outside `own_layers`, the layers the
   validator checks with its own weights, against two other stage miners of that block on other coldkeys
   instead: `cross_check`) (scoring.stage_checks.run_challenge over the wire,
   `neurons.swarm.relay.RemoteStage`): the validator opens a fresh session with itself as upstream and
   downstream, commits to a projection seed (sha256 digest kept with the result, seed and nonce revealed in
   the same row), sends the residual states a real prompt produces entering the block (computed by its own
   layers before the block) as random prefill chunks then single-token steps, and compares each output with
   its own computation of the block (`reference_stage`, the validator's copy of the weights on CPU) by the
   per-token cosine / relative L2 over the committed projection (honest fp32 and bf16 pass; see the
   thresholds in stage_checks). Every receipt is checked (signed by the stage, for this step, hashing what
   was sent and what came back). A stage that is stopped mid-challenge, refuses a step, returns a malformed
   or replayed output or a bad receipt fails the challenge.
3. **Audit a relayed route** (`route_probes` per round): one stage per block, the validator relaying every
   hop (`relay_route`), the receipts audited (`audit_route`), the head's teacher-forced answer compared with
   the validator's own whole-model computation; a failing answer is bisected along the receipts
   (`bisect_route`) and only the first diverging stage is blamed.
4. **Decoys**: optionally the validator serves a block itself under a decoy hotkey (`DecoyServer`). A stage
   miner of the same block that opens a session there, or that relays there an input the validator just
   sent it in a challenge, hands its work on without saying so and is blamed.

Results go to the store (`stage_checks`, with the reason; `blame = 1` rows zero the stage for
`blame_s`). For the weights it gathers the evidence (`evidence`: stage miners' verified layer-tokens in passed
challenges and clean route audits, the validator-measured step time, the share of challenges answered, and the
blamed route drivers; `whole_model_work`: whole-model miners' verified model-tokens and decode speed), and
scoring.weights decides one vector over both kinds.

The gateway's own route (neurons/validator_app/gateway_route.py) hands its recorded steps to `settle_gateway_route`: a sample
of sessions is teacher-forced on the validator's whole-model reference (`check_recorded_answer`; a failing one
triggers a relayed route audit of the same stages, whose bisection blames), and every step's receipts are
audited (`audit_receipts`) before the stages are credited its tokens as `gateway_work`.

Route drivers that present receipts (a third party's: the route miner submits them to the validator's work
endpoint, neurons/validator_app/route_work.py, --stage-work-port; `claim_route_work`) are credited with
`credit_route`: receipts that do not audit (signed by nobody registered, forged, stale, gapped, credited before)
blame the driver (`route_receipts`), credit no stage, and zero the driver's whole-model weight (scoring.weights). Route
drivers follow trust through `TrustedDirectory` (blamed stages are left out).
"""
from __future__ import annotations

import asyncio
import logging
import random
import secrets
import time
from dataclasses import dataclass
from typing import Mapping, Optional, Sequence

import aiohttp
import numpy as np
import torch

from inference.swarm.stage import HeadOutput, LayerRange, Stage, StageError
from neurons.base.settings import open_wallet
from neurons.swarm.codec import encode_ids
from neurons.swarm.relay import LoopThread, RemoteStage, StageRelay, StageSink, relay_route
from neurons.swarm.route import StageDirectory, StageInfo, StaticDirectory, StepRecord, plan_route
from neurons.swarm.stage_server import StageServer, StageServerSettings
from neurons.validator_app.route_work import RouteWorkServer
from neurons.validator_app.settings import ValidatorSetupError
from protocol.stage import decode_forward, state_sha256
from scoring.corpus import code_snippet, paragraph
from scoring.stage_checks import (ChallengeResult, CrossCheckResult, SeedCommitment, Thresholds, audit_receipts,
                                  audit_route, bisect_route, challenge_steps, compare_heads, decode_wire_state,
                                  judge_tokens, plan_steps, reference_stage, run_challenge, run_cross_check)
from scoring.stage_rewards import MinerWork, active_params_per_layer
from scoring.weights import StageEvidence

log = logging.getLogger("k3.validator.stages")


@dataclass(frozen=True)
class StageMiner:
    uid: int
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
    challenges: int = 0
    failed: int = 0
    route_probes: int = 0
    blamed: list[str] = None  # hotkeys blamed this round

    def __post_init__(self):
        self.blamed = self.blamed or []


class _References(dict):
    """The validator's own computation of any block, made on first use."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def __missing__(self, key):
        self[key] = reference_stage(self.model, *key)
        return self[key]


class DecoyServer(StageServer):
    """A block served by the validator itself under a decoy hotkey; tells `watch` who opens sessions on it and
    the hash of every input it is sent."""

    def __init__(self, stage: Stage, keypair, settings: StageServerSettings, watch):
        super().__init__(stage, keypair, settings)
        self.watch = watch

    async def handle_open(self, caller: str, body: bytes):
        response = await super().handle_open(caller, body)
        self.watch(caller, None, (self.stage.layers.start, self.stage.layers.stop))
        return response

    async def handle_forward(self, caller: str, body: bytes):
        header, _, raw = decode_forward(body, self.settings.max_body_bytes)
        self.watch(caller, state_sha256(header.tensors, bytes(raw)), (self.stage.layers.start, self.stage.layers.stop))
        return await super().handle_forward(caller, body)


class StageRounds:
    def __init__(self, store, keypair, model, tokenizer, *, challenges: int = 2, max_tokens: int = 96,
                 route_probes: int = 1, thresholds: Thresholds = Thresholds(), seed: Optional[int] = None,
                 host: str = "127.0.0.1", port: int = 0, public_url: str = "", timeout_s: float = 15.0,
                 blame_s: float = 24 * 3600.0, window_s: float = 24 * 3600.0, decoy_keypair=None,
                 decoys: Mapping[tuple[int, int], int] = {}, own_layers: Optional[tuple[int, int]] = None,
                 work_port: Optional[int] = None):
        self.store = store
        self.keypair = keypair
        self.model = model  # the validator's copy of the weights (CPU); None: load on first need (loader)
        self.tokenizer = tokenizer
        self.challenges = challenges
        self.max_tokens = max_tokens
        self.route_probes = route_probes
        self.thresholds = thresholds
        self.rng = random.Random(seed if seed is not None else secrets.randbits(64))
        self.np_rng = np.random.default_rng(self.rng.getrandbits(63))
        self.host, self.port = host, port  # the sink's bind address (and the decoys')
        self.public_url = public_url  # where stage miners reach the validator's sink (a real network needs it)
        self.timeout_s = timeout_s
        self.blame_s = blame_s
        self.window_s = window_s
        self.decoy_keypair = decoy_keypair
        self.decoys = dict(decoys)  # block -> port the validator serves a decoy of it on
        self.own_layers = own_layers  # layers checked against the validator's own copy (None: all)
        self.work_port = work_port  # where outside route drivers submit their receipts (None: no endpoint)
        self.work_server = None  # neurons.validator_app.route_work.RouteWorkServer, once started
        self.serving: set[str] = set()  # hotkeys of the subnet's serving neurons in the last round
        self.miners: dict[str, StageMiner] = {}  # hotkey -> the stage miner, from the last round
        self._seen: dict[str, dict[str, str]] = {}  # per stage hotkey: output digest -> input digest (replays)
        self._recent_inputs: dict[str, tuple[str, float]] = {}  # input sha -> (challenged hotkey, when)
        self._refs: Optional[_References] = None
        self._sink: Optional[StageSink] = None
        self._http: Optional[aiohttp.ClientSession] = None
        self._decoy_servers: list[DecoyServer] = []
        self.relay: Optional[StageRelay] = None
        self.number = 0
        self._credited = _SeenReceipts()  # receipt signatures credited (the gateway's route and outside drivers)
        self.loader = None  # () -> model, called in a thread when model is None

    # ------------------------------------------------------------ lifecycle
    async def start(self) -> None:
        if self._sink is not None:
            return
        self._sink = StageSink(self.keypair, self.host, self.port, public_url=self.public_url)
        await self._sink.start()
        self._http = aiohttp.ClientSession()
        self.relay = StageRelay(self.keypair, self._sink, self._http, self.timeout_s)
        self._thread = LoopThread(asyncio.get_running_loop())
        if self.work_port is not None:

            self.work_server = RouteWorkServer(self.keypair, self.claim_route_work, self.host, self.work_port)
            await self.work_server.start()

    async def _start_decoys(self) -> None:
        if self._decoy_servers or not self.decoys:
            return
        for (a, b), port in self.decoys.items():
            stage = Stage(self.model, LayerRange(a, b, self.model.config.num_layers), fingerprint="decoy")
            server = DecoyServer(stage, self.decoy_keypair, StageServerSettings(host=self.host, port=port),
                                 self._decoy_saw)
            await server.start()
            self._decoy_servers.append(server)

    async def close(self) -> None:
        if self.work_server is not None:
            await self.work_server.close()
        for server in self._decoy_servers:
            await server.close()
        if self._sink is not None:
            await self._sink.close()
        if self._http is not None:
            await self._http.close()
        self._sink = self._http = None

    async def _ensure_model(self) -> None:
        if self.model is None and self.loader is not None:
            self.model = await asyncio.to_thread(self.loader)
        if self.model is None:
            raise RuntimeError("stage checks need the validator's copy of the model weights")
        if self._refs is None:
            self._refs = _References(self.model)
            self.layer_costs = active_params_per_layer(self.model)

    @property
    def num_layers(self) -> int:
        return self.model.config.num_layers

    # ------------------------------------------------------------ finding stage miners
    async def discover(self, serving: Sequence) -> list[StageMiner]:
        """The serving neurons that are stage miners (signed stage capabilities by their own hotkey)."""
        fetch = StaticDirectory([], timeout_s=min(5.0, self.timeout_s),
                                config_hash=self.model.config.config_hash() if self.model is not None else None)
        found = await asyncio.gather(*(fetch._one(self._http, n.endpoint.url) for n in serving))
        out = []
        for n, info in zip(serving, found):
            if info is not None and info.hotkey == n.hotkey:
                out.append(StageMiner(n.uid, n.hotkey, n.coldkey, info))
        return out

    async def run_round(self, serving: Sequence, number: int) -> list:
        """Check the stage miners among `serving`; return the other (whole-model) neurons."""
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
        config_hash = self.model.config.config_hash()
        miners = [m for m in miners if m.info.caps.config_hash == config_hash]
        self.miners = {m.hotkey: m for m in miners}
        self.store.save_stage_miners([dict(uid=m.uid, hotkey=m.hotkey, coldkey=m.coldkey, url=m.info.url,
                                           layers=m.label, fingerprint=m.info.caps.fingerprint,
                                           step_ms=m.info.caps.step_ms) for m in miners])
        report = StageRoundReport(stage_miners=len(miners))
        order = [m for m in miners for _ in range(self.challenges)]
        self.rng.shuffle(order)
        for m in order:
            result = await self.challenge(m)
            if result is None:
                continue
            report.challenges += 1
            if not result.ok:
                report.failed += 1
                report.blamed.append(m.hotkey)
        for _ in range(self.route_probes):
            blamed = await self.route_probe(miners)
            report.route_probes += 1
            if blamed:
                report.blamed.append(blamed)
        log.info("round %d: %d stage miners, %d challenges (%d failed), %d route probes; blamed %s", number,
                 len(miners), report.challenges, report.failed, report.route_probes, sorted(set(report.blamed)))
        self.last_report = report
        return rest

    # ------------------------------------------------------------ challenges
    def _prompt(self, n: int) -> list[int]:
        ids: list[int] = []
        while len(ids) < n:
            text = paragraph(self.rng) if self.rng.random() < 0.6 else code_snippet(self.rng)
            ids += self.tokenizer.encode(text)
        return ids[:n]

    def holds(self, layers: tuple[int, int]) -> bool:
        """Whether the validator checks this block against its own copy of the weights."""
        return self.own_layers is None or (self.own_layers[0] <= layers[0] and layers[1] <= self.own_layers[1])

    def peers_for(self, m: StageMiner) -> list[StageMiner]:
        """Two other stage miners of m's block, not blamed, on coldkeys other than m's and each other's (drawn at
        random); fewer when there are not two such. (Two peers on different coldkeys that serve the same wrong
        weights could still frame a stage: the check is only as strong as the peers' independence.)"""
        since = time.time() - self.blame_s
        others = [o for o in self.miners.values() if o.layers == m.layers and o.hotkey != m.hotkey
                  and o.coldkey != m.coldkey and not self.store.stage_blame(o.hotkey, since)]
        self.rng.shuffle(others)
        chosen: list[StageMiner] = []
        for o in others:
            if all(o.coldkey != c.coldkey for c in chosen):
                chosen.append(o)
            if len(chosen) == 2:
                break
        return chosen

    async def challenge(self, m: StageMiner) -> ChallengeResult | CrossCheckResult | None:
        """One challenge of one stage miner over the wire, against the validator's own computation of its block
        or (a block outside `own_layers`) against two peers (`cross_check`); the result is stored (failed:
        blamed). None: the block is not held and has no two peers on other coldkeys."""
        if not self.holds(m.layers):
            peers = self.peers_for(m)
            if len(peers) < 2:
                log.info("stage %s (%s): not checked, the validator holds no copy of its block and it has %d "
                         "peers on other coldkeys (2 needed)", m.hotkey, m.label, len(peers))
                return None
            return await self.cross_check(m, peers)
        await self._ensure_model()
        cpu0 = time.process_time()  # everything this process spends on the challenge (inputs, wire, compare)
        layers = LayerRange(m.info.start, m.info.stop, self.num_layers)
        plan = plan_steps(self.np_rng, self.max_tokens, min_tokens=16)
        ids = self._prompt(sum(n for _, n in plan) + 1)
        steps = await asyncio.to_thread(challenge_steps, self.model, layers, ids, plan)
        remote = RemoteStage(self.relay, m.info, self._thread, self.timeout_s)
        commitment = SeedCommitment.new(self.rng.getrandbits(63))
        log.debug("challenge of %s (%s): projection seed committed as %s", m.hotkey, m.label, commitment.digest)
        started = time.monotonic()
        seen = self._seen.setdefault(m.hotkey, {})
        watch = _InputWatch(remote, self._recent_inputs, m.hotkey)
        session = f"{self.rng.getrandbits(96):024x}"  # as random as a route driver's
        result = await asyncio.to_thread(run_challenge, watch, self._refs[m.layers], steps, commitment,
                                         self.thresholds, session, seen)
        wall = time.monotonic() - started
        self.store.add_stage_check(dict(
            round=self.number, uid=m.uid, hotkey=m.hotkey, layers=m.label, kind="challenge", passed=int(result.ok),
            blame=int(not result.ok), reason=result.reason, tokens=result.tokens, steps=result.steps,
            median_rel_l2=result.median_rel_l2, bad_fraction=result.bad_fraction, step_ms=remote.step_ms,
            cpu_s=time.process_time() - cpu0, wall_s=wall, commitment=result.commitment, seed=str(result.seed),
            nonce=result.nonce))
        if not result.ok:
            log.warning("stage %s (%s, uid %d) failed a challenge: %s", m.hotkey, m.label, m.uid, result.reason)
        return result

    async def cross_check(self, m: StageMiner, peers: Sequence[StageMiner]) -> CrossCheckResult:
        """One challenge of m judged against two peers of its block (scoring.stage_checks.run_cross_check): the
        same inputs, each party in its own fresh session. Stored as a `challenge` row of m (blame only when both
        peers agree with each other and not with m); a split verdict is stored as a `disagreement` row of each
        party, blaming no one."""
        await self._ensure_model()
        cpu0 = time.process_time()
        layers = LayerRange(m.info.start, m.info.stop, self.num_layers)
        plan = plan_steps(self.np_rng, self.max_tokens, min_tokens=16)
        ids = self._prompt(sum(n for _, n in plan) + 1)
        steps = await asyncio.to_thread(challenge_steps, self.model, layers, ids, plan)
        remote = RemoteStage(self.relay, m.info, self._thread, self.timeout_s)
        watch = _InputWatch(remote, self._recent_inputs, m.hotkey)
        others = [RemoteStage(self.relay, p.info, self._thread, self.timeout_s) for p in peers]
        commitment = SeedCommitment.new(self.rng.getrandbits(63))
        started = time.monotonic()
        result = await asyncio.to_thread(run_cross_check, watch, others, steps, commitment, self.thresholds,
                                         self._seen.setdefault(m.hotkey, {}))
        wall = time.monotonic() - started
        named = ", ".join(f"peer {'ab'[i]}: uid {p.uid} ({p.hotkey[:10]}, coldkey {p.coldkey[:10]})"
                          for i, p in enumerate(peers))
        row = dict(round=self.number, layers=m.label, steps=result.steps, tokens=result.tokens,
                   cpu_s=time.process_time() - cpu0, wall_s=wall, commitment=result.commitment, seed=str(result.seed),
                   nonce=result.nonce)
        if result.verdict == "undecided":
            for party in (m, *peers):
                self.store.add_stage_check(dict(row, uid=party.uid, hotkey=party.hotkey, kind="disagreement",
                                                passed=0, blame=0, tokens=0,
                                                reason=f"cross-check of uid {m.uid} against {named}: {result.reason}"))
            log.info("cross-check of %s (%s) against %s undecided: %s", m.hotkey, m.label, named, result.reason)
            return result
        self.store.add_stage_check(dict(
            row, uid=m.uid, hotkey=m.hotkey, kind="challenge", passed=int(result.ok), blame=int(not result.ok),
            reason=(f"against two peers ({named}): {result.reason}" if not result.ok else f"checked against {named}"),
            median_rel_l2=result.median_rel_l2, bad_fraction=result.bad_fraction, step_ms=remote.step_ms))
        if not result.ok:
            log.warning("stage %s (%s, uid %d) failed a cross-check: %s", m.hotkey, m.label, m.uid, result.reason)
        return result

    def _decoy_saw(self, caller: str, input_sha: Optional[str], block: tuple[int, int]) -> None:
        """A session opened or a forward sent on a decoy (the validator's own block under another hotkey)."""
        now = time.time()
        culprit, why = None, ""
        miner = self.miners.get(caller)
        if miner is not None and miner.layers == block:
            culprit, why = miner, (f"opened a session on a stage of its own block {miner.label} (the validator's "
                                   "decoy): it hands its work to another stage without saying so")
        elif input_sha is not None and input_sha in self._recent_inputs:
            hotkey, at = self._recent_inputs[input_sha]
            if hotkey != caller and now - at < 120 and hotkey in self.miners:
                culprit = self.miners[hotkey]
                why = (f"an input the validator sent it in a challenge reached the validator's decoy from {caller}: "
                       "it hands its work to another stage without saying so")
        if culprit is None:
            return
        if self.store.stage_blame(culprit.hotkey, now - 60, kind="decoy"):
            return  # one row per minute is enough
        log.warning("stage %s (%s): %s", culprit.hotkey, culprit.label, why)
        self.store.add_stage_check(dict(round=self.number, uid=culprit.uid, hotkey=culprit.hotkey,
                                        layers=culprit.label, kind="decoy", passed=0, blame=1, reason=why))

    # ------------------------------------------------------------ route audits
    async def route_probe(self, miners: Sequence[StageMiner]) -> Optional[str]:
        """A relayed, teacher-forced route answer over one stage per block (unblamed stages first); its
        receipts audited and the answer compared with the validator's own; a failing answer bisected. Returns
        the hotkey blamed, if any."""
        await self._ensure_model()
        now = time.time()
        blamed = {m.hotkey for m in miners if self.store.stage_blame(m.hotkey, now - self.blame_s)}
        infos = [m.info for m in miners]
        shuffled = list(infos)
        self.rng.shuffle(shuffled)
        route = plan_route(shuffled, self.num_layers, exclude=blamed) or plan_route(shuffled, self.num_layers)
        if route is None:
            return None
        by_hotkey = {m.hotkey: m for m in miners}
        n = self.rng.randint(16, self.max_tokens)
        ids = self._prompt(n + 1)
        chunks, left = [], n - 2
        while left > 0:
            c = min(left, self.rng.randint(4, 32))
            chunks.append(c)
            left -= c
        chunks += [1, 1]
        route_id, session = secrets.token_hex(8), secrets.token_hex(12)
        started = time.monotonic()
        try:
            records, inputs, heads = await relay_route(self.relay, route, ids, chunks, route_id, session)
        except StageError as e:
            culprit = by_hotkey.get(getattr(e, "stage", ""))
            self._route_row(culprit, "route_audit", False, f"a hop failed: {e.code}: {e.message}", 0, started,
                            blame=culprit is not None)
            return culprit.hotkey if culprit else None
        relayed = time.monotonic()
        registered = {m.hotkey: m.layers for m in miners}
        audit = audit_route(records, route_id, session, registered, self.num_layers, inputs)
        audited = time.monotonic()
        if not audit.ok:
            culprit = by_hotkey.get(audit.blame)
            self._route_row(culprit, "route_audit", False, audit.problem, 0, started, blame=culprit is not None)
            return culprit.hotkey if culprit else None
        t0 = time.process_time()
        verdict = await asyncio.to_thread(self._check_answer, ids, chunks, heads)
        cpu = time.process_time() - t0
        if verdict is None:
            for h in route:
                self._route_row(by_hotkey[h.hotkey], "route_audit", True, "", n, started, cpu_s=cpu)
            return None
        seed = self.rng.getrandbits(63)
        answered = time.monotonic()
        culprit_hotkey, verdicts = await asyncio.to_thread(bisect_route, records, self._refs, seed, self.thresholds)
        log.info("route probe over %d stages, %d tokens: relayed in %.1f s, receipts audited in %.1f s, answer "
                 "compared in %.1f s, bisected in %.1f s", len(route), n, relayed - started, audited - relayed,
                 answered - audited, time.monotonic() - answered)
        culprit = by_hotkey.get(culprit_hotkey) if culprit_hotkey else None
        for v in verdicts:
            m = by_hotkey[v.hotkey]
            self._route_row(m, "bisection", v.ok, v.reason if not v.ok else f"route answer failed ({verdict}); "
                            "this stage matched the validator on its own inputs", n, started,
                            blame=not v.ok)
        return culprit.hotkey if culprit else None

    def _check_answer(self, ids: list[int], chunks: list[int], heads) -> Optional[str]:
        """None when the route's teacher-forced answer matches the validator's whole-model computation."""
        ref = reference_stage(self.model, 0, self.num_layers)
        sid = "route-ref-" + secrets.token_hex(6)
        ref.open(sid)
        bad: list[bool] = []
        try:
            pos = 0
            for c, got in zip(chunks, heads):
                targets = ([int(t) for t in ids[pos + 1:pos + c + 1]] + [-1] * c)[:c]
                want = ref.forward(sid, pos, torch.tensor(ids[pos:pos + c]), "score", targets, 2)
                cmp = compare_heads(want, got, self.thresholds)
                if not cmp.ok:
                    return cmp.reason
                bad += cmp.bad
                pos += c
        finally:
            ref.close(sid)
        ok, why = judge_tokens(bad, self.thresholds)
        return None if ok else why

    def _route_row(self, m: Optional[StageMiner], kind: str, passed: bool, reason: str, tokens: int,
                   started: float, blame: bool = False, cpu_s: Optional[float] = None) -> None:
        if m is None:
            log.warning("route probe: %s", reason)
            return
        self.store.add_stage_check(dict(round=self.number, uid=m.uid, hotkey=m.hotkey, layers=m.label, kind=kind,
                                        passed=int(passed), blame=int(blame), reason=reason, tokens=tokens,
                                        wall_s=time.monotonic() - started, cpu_s=cpu_s))

    # ------------------------------------------------------------ receipts a driver presents
    def credit_route(self, records: Sequence, driver: str) -> Optional[str]:
        """Stage work a route driver claims (neurons.swarm.route.StepRecord list): every step's receipts must
        audit (signed by the registered stage miners for their layers, this route and step, chained from what
        the driver sent, every layer once, no receipt credited before, here or from the gateway's route); then
        each stage is credited the step's tokens. A failed audit blames the driver (or the stage that claims
        layers it does not serve; one row per minute and culprit) and credits no one. Returns the problem, or
        None."""
        registered = {m.hotkey: m.layers for m in self.miners.values()}
        seen = _NewReceipts(self._credited)
        for rec in records:
            a = audit_receipts(list(rec.receipts), rec.route_id, rec.session, rec.step,
                               state_sha256(list(rec.input_specs), rec.input_body), registered, self.num_layers, seen)
            if not a.ok:
                who = driver if a.blame == "driver" else a.blame
                problem = f"step {rec.step} of session {rec.session}: {a.problem}"
                m = self.miners.get(who)
                if not self.store.stage_blame(who, time.time() - 60, kind="route_receipts"):
                    log.warning("route driver %s presented receipts that do not audit: %s", driver, problem)
                    self.store.add_stage_check(dict(round=self.number, uid=m.uid if m else self._uid_of(who),
                                                    hotkey=who, layers=m.label if m else None,
                                                    kind="route_receipts", passed=0, blame=1,
                                                    reason=f"presented by route driver {driver}: {problem}"))
                return problem
        rows = []
        for rec in records:
            tokens = int(rec.input_specs[0].shape[0])
            for r in rec.receipts:
                m = self.miners[r.stage]
                rows.append(dict(round=self.number, uid=m.uid, hotkey=m.hotkey, layers=m.label, kind="route_work",
                                 passed=1, blame=0, tokens=tokens, reason=f"receipts from driver {driver}"))
        for row in rows:
            self.store.add_stage_check(row)
        seen.keep()
        return None

    def claim_route_work(self, work, driver: str) -> tuple[int, dict]:
        """A claim an outside route driver submitted (protocol.route_work.RouteWork, at the work endpoint):
        (HTTP status, answer). 503 until a round has found the stage miners; 403 when the driver is no serving
        neuron of the subnet; 422 (the driver blamed, nothing credited) when the receipts do not audit; else 200
        with the layer-tokens credited."""

        if self.model is None or not self.miners:
            return 503, {"code": "not_ready", "message": "the validator has not found the stage miners yet; submit "
                                                         "again after its next round"}
        if driver not in self.serving:
            return 403, {"code": "not_registered", "message": f"{driver} is not a serving neuron of this subnet"}
        records = []
        for s in work.steps:
            specs, body = encode_ids(list(s.token_ids))
            records.append(StepRecord(s.route_id, s.session, s.step, s.position, tuple(s.receipts), tuple(specs),
                                      body, b""))
        problem = self.credit_route(records, driver)
        if problem is not None:
            return 422, {"code": "receipts_rejected", "message": f"nothing credited, the driver is blamed: {problem}"}
        credited = sum(len(s.token_ids) * len(s.receipts) for s in work.steps)
        log.info("route driver %s: %d steps, %d layer-tokens credited", driver, len(work.steps), credited)
        return 200, {"steps": len(work.steps), "credited_tokens": credited}

    def blamed_drivers(self, now: Optional[float] = None) -> dict[str, str]:
        """Route drivers blamed for receipts that do not audit within `blame_s`: hotkey -> the latest reason."""
        since = (time.time() if now is None else now) - self.blame_s
        return {r["hotkey"]: r["reason"] for r in self.store.stage_checks(since=since)
                if r["blame"] and r["kind"] == "route_receipts"}

    # ------------------------------------------------------------ the gateway's own route
    def _uid_of(self, hotkey: str) -> Optional[int]:
        m = self.miners.get(hotkey)
        if m is not None:
            return m.uid
        return next((uid for uid, r in self.store.stage_miners().items() if r["hotkey"] == hotkey), None)

    def _stage_miner(self, info: StageInfo) -> StageMiner:
        m = self.miners.get(info.hotkey)
        return m if m is not None else StageMiner(self._uid_of(info.hotkey), info.hotkey, "", info)

    def check_recorded_answer(self, records: Sequence) -> Optional[str]:
        """Teacher-force one session the gateway's route served (its StepRecords: the token ids the driver fed
        and the head's signed results) on the validator's whole-model reference: each sampled token's logprob
        and top alternatives against the reference's at that position (`compare_heads`, judged by
        `judge_tokens`). None when it matches; else the problem. Sessions that do not start at position 0 (steps
        dropped from the record) or hold score steps are skipped (None)."""
        recs = sorted(records, key=lambda r: r.step)
        if not recs or recs[0].position != 0:
            return None
        ids: list[int] = []
        rows: list[tuple[int, HeadOutput]] = []
        for r in recs:
            if r.position != len(ids):
                return None
            ids += [int(t) for t in decode_wire_state(list(r.input_specs), r.input_body).tolist()]
            head = decode_wire_state([], r.result_body)
            if head.mode == "score":
                return None
            if head.mode == "sample":
                rows.append((len(ids) - 1, head))
        if not rows:
            return None
        top_k = len(rows[0][1].top)
        targets = [-1] * len(ids)
        got = HeadOutput("score", logprobs=[None] * len(ids), row_tops=[[] for _ in ids])
        for pos, head in rows:
            targets[pos] = int(head.token_id)
            got.logprobs[pos] = head.logprob
            got.row_tops[pos] = list(head.top)
        ref = reference_stage(self.model, 0, self.num_layers)
        sid = "gateway-audit-" + secrets.token_hex(6)
        ref.open(sid)
        try:
            want = ref.forward(sid, 0, torch.tensor(ids), "score", targets, top_k)
        finally:
            ref.close(sid)
        cmp = compare_heads(want, got, self.thresholds)
        if not cmp.ok:
            return cmp.reason
        ok, why = judge_tokens(cmp.bad, self.thresholds)
        return None if ok else why

    async def settle_gateway_route(self, records: Sequence, stages: Sequence[StageInfo], driver: str,
                                   audit_rate: float = 0.1, max_audit_tokens: int = 1024) -> dict:
        """Organic route work the validator's own gateway drove (its route driver's StepRecords, and the stages
        it routed from): a share `audit_rate` of the sessions is teacher-forced on the reference
        (`check_recorded_answer`); a session that fails is not credited, is recorded against its stages
        (`gateway_audit`, no blame: the driver saw no intermediate states) and triggers a relayed route audit of
        the same stages (`route_probe`, whose bisection blames the stage that diverged). Every other step's
        receipts are audited (signed by the stages the driver routed through for the layers they announce, for
        this route, session and step, chained from what the driver sent, every layer once, never credited
        before) and each stage is credited the step's tokens (`gateway_work`). Returns a summary."""
        await self.start()
        await self._ensure_model()
        registered = {s.hotkey: (s.start, s.stop) for s in stages}
        infos = {s.hotkey: s for s in stages}
        sessions: dict[str, list] = {}
        for rec in records:
            sessions.setdefault(rec.session, []).append(rec)
        out = {"sessions": len(sessions), "audited": 0, "failed": [], "credited_tokens": 0, "problems": [],
               "blamed": []}
        for session, recs in sessions.items():
            n = sum(int(r.input_specs[0].shape[0]) for r in recs)
            if self.rng.random() >= audit_rate or n > max_audit_tokens:
                continue
            t0 = time.process_time()
            problem = await asyncio.to_thread(self.check_recorded_answer, recs)
            cpu = time.process_time() - t0
            out["audited"] += 1
            route = [infos[r.stage] for r in sorted(recs[0].receipts, key=lambda r: r.layers[0]) if r.stage in infos]
            for info in route:
                m = self._stage_miner(info)
                self.store.add_stage_check(dict(
                    round=self.number, uid=m.uid, hotkey=m.hotkey, layers=m.label, kind="gateway_audit",
                    passed=int(problem is None), blame=0, tokens=0, cpu_s=cpu,
                    reason=(f"organic route answer (session {session}) failed on the reference: {problem}; a relayed "
                            "route audit of the same stages follows") if problem else "organic route answer matched"))
            if problem is None:
                continue
            out["failed"].append(session)
            log.warning("organic route answer of session %s failed on the reference: %s", session, problem)
            miners = [self._stage_miner(i) for i in route]
            blamed = await self.route_probe(miners)
            if blamed:
                out["blamed"].append(blamed)
        for session, recs in sessions.items():
            if session in out["failed"]:
                continue
            for rec in sorted(recs, key=lambda r: r.step):
                a = audit_receipts(list(rec.receipts), rec.route_id, rec.session, rec.step,
                                   state_sha256(list(rec.input_specs), rec.input_body), registered, self.num_layers,
                                   self._credited)
                if not a.ok:
                    out["problems"].append(a.problem)
                    if a.blame != "driver":  # a stage signing for layers it does not announce
                        m = self._stage_miner(infos[a.blame])
                        self.store.add_stage_check(dict(round=self.number, uid=m.uid, hotkey=m.hotkey, layers=m.label,
                                                        kind="gateway_receipts", passed=0, blame=1, reason=a.problem))
                        out["blamed"].append(m.hotkey)
                    else:
                        log.warning("the gateway's route driver %s recorded receipts that do not audit: %s", driver,
                                    a.problem)
                    continue
                tokens = int(rec.input_specs[0].shape[0])
                for r in rec.receipts:
                    m = self._stage_miner(infos[r.stage])
                    self.store.add_stage_check(dict(round=self.number, uid=m.uid, hotkey=m.hotkey, layers=m.label,
                                                    kind="gateway_work", passed=1, blame=0, tokens=tokens,
                                                    reason=f"organic traffic through the gateway's route ({driver})"))
                    out["credited_tokens"] += tokens
        return out

    # ------------------------------------------------------------ work and weights
    def stage_work(self, now: Optional[float] = None) -> dict[int, MinerWork]:
        """Per stage uid over the window: verified layer-tokens (passed challenges, clean route audits and
        credited route work), the validator-measured step time, the share of challenges answered, and the
        blame reasons."""
        now = time.time() if now is None else now
        out = {}
        rows = self.store.stage_checks(since=now - max(self.window_s, self.blame_s))
        miners = self.store.stage_miners()
        for uid, sm in miners.items():
            mine = [r for r in rows if r["hotkey"] == sm["hotkey"]]
            recent = [r for r in mine if r["at"] >= now - self.window_s]
            challenges = [r for r in recent if r["kind"] == "challenge"]
            answered = [r for r in challenges if r["passed"] or not _unanswered(r["reason"] or "")]
            tokens = sum(int(r["tokens"] or 0) for r in recent if r["passed"])
            steps = [r["step_ms"] for r in challenges if r["step_ms"]]
            blames = [f"{r['kind']}: {r['reason']}" for r in mine if r["blame"] and r["at"] >= now - self.blame_s]
            a, b = (int(x) for x in sm["layers"].split("-"))
            # availability: the share of challenges answered; a stage not challenged yet whose organic route work
            # verified (gateway_work) was there when it was needed
            available = len(answered) / len(challenges) if challenges else float(any(r["passed"] and r["tokens"]
                                                                                      for r in recent))
            out[uid] = MinerWork(sm["hotkey"], tokens, float(np.median(steps)) if steps else (sm["step_ms"] or 0.0),
                                 available, (a, b + 1), blames[-1:])
        return out

    def evidence(self) -> StageEvidence:
        """What the weights need of the stage rounds (scoring.weights): the stage miners' work, the blamed route
        drivers, and the layers' costs once the validator's copy of the model is loaded."""
        return StageEvidence(self.stage_work(), self.blamed_drivers(),
                             self.layer_costs if self._refs is not None else None)


class _SeenReceipts(dict):
    """Receipt signatures already credited (a set for audit_receipts), the oldest forgotten past `limit`."""

    limit = 200_000

    def add(self, signature: str) -> None:
        self[signature] = None
        while len(self) > self.limit:
            del self[next(iter(self))]


class _NewReceipts(set):
    """The receipt signatures one claim presents, checked against those already credited; `keep()` adds them to
    the credited ones (only once the whole claim audited)."""

    def __init__(self, credited: _SeenReceipts):
        super().__init__()
        self.credited = credited

    def __contains__(self, signature) -> bool:
        return super().__contains__(signature) or signature in self.credited

    def keep(self) -> None:
        for signature in self:
            self.credited.add(signature)


def _unanswered(reason: str) -> bool:
    return any(w in reason for w in ("unreachable", "timeout", "refused the session", "over_capacity"))


class _InputWatch:
    """A RemoteStage that remembers the hash of each input it sends (for the decoys). Not for a first block: its
    inputs are token ids, and a short run of them (a decode step is one token) recurs across challenges of
    different stages, so its hash would not say whose challenge it came from (a forwarder of a first block under
    its own hotkey is still caught when it opens a session on the decoy)."""

    def __init__(self, remote: RemoteStage, recent: dict, hotkey: str):
        self.remote, self.hotkey = remote, hotkey
        self.recent = recent if remote.info.start > 0 else {}

    def open(self, *a, **kw):
        return self.remote.open(*a, **kw)

    def close(self, *a, **kw):
        return self.remote.close(*a, **kw)

    def forward(self, *a, **kw):
        n = len(self.remote.inputs_sent)
        try:
            return self.remote.forward(*a, **kw)
        finally:
            now = time.time()
            for sha in self.remote.inputs_sent[n:]:
                self.recent[sha] = (self.hotkey, now)
            for sha in [s for s, (_, t) in self.recent.items() if now - t > 300]:
                del self.recent[sha]




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
    from dataclasses import replace  # noqa: PLC0415


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
    """Stage checks for a validator with its own copy of the weights (--reference-engine) and
    --stage-challenges > 0, configured by settings.stages (--stage-*: challenge length, route audits, timeouts,
    blame and work windows, the layers it checks itself, decoys, the sink's bind and public address); the
    weights are loaded on first need (the first stage miner found)."""
    challenges = getattr(settings.rounds, "stage_challenges", 0)
    if not settings.reference_engine or not challenges:
        return None
    from inference.serving.builders import load_reference_model  # noqa: PLC0415

    s = settings.stages
    decoys = s.decoy_ports()
    stage = StageRounds(loop.store, loop.wallet.hotkey, None, loop.tokenizer, challenges=challenges,
                        seed=settings.rounds.seed, max_tokens=s.max_tokens, route_probes=s.route_audits,
                        host=s.sink_host, port=s.sink_port, public_url=s.sink_url or "", timeout_s=s.timeout_s,
                        blame_s=s.blame_s, window_s=s.window_s, decoys=decoys,
                        decoy_keypair=decoy_keypair(settings) if decoys else None, own_layers=s.own_block(),
                        work_port=s.work_port)
    checkpoint = settings.engine.checkpoint
    stage.loader = lambda: load_reference_model(checkpoint, verify=False)[0]
    loop.stage = stage
    return stage


__all__ = ["DecoyServer", "StageMiner", "StageRoundReport", "StageRounds", "attach_stage_rounds",
           "whole_model_work"]
