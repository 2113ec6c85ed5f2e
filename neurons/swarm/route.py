"""The route driver: one Kimi K3 over a route of stage miners, behind the same `Engine` interface as a
whole-model engine (generate / score), so the miner protocol, the gateway and the benchmark run on it as is.

A route is an ordered list of stages covering layers 0..L-1, embedding to head, planned from a
`StageDirectory` (a static list of stage URLs, or `MetagraphDirectory`: the stages announced on chain): stages
are chosen by fewest hops, then measured step time, keeping the current stages when they are still alive. Tokens travel
driver -> stage 1 -> ... -> stage N -> driver: each stage sends its output straight to the next, and the last
one sends the head's result (a sampled token, or teacher-forced logprobs) to this driver's own small HTTP
server. Prefill goes in chunks sent back to back, so the stages work on different chunks at once.

Every result carries the stages' signed receipts; the driver checks that they chain (the output hash of each
stage is the input hash of the next, starting from the hash of what the driver sent) and keeps the last ones.

Speculative decoding (`RouteEngine(speculation=SpeculationConfig(drafter="ngram"|"suffix"))`, or a distilled
draft table's `drafter_factory`): per request a drafter (inference.decoding) proposes k tokens with adaptive
k, without model work; the driver sends [last token, d_1..d_k] through the route as one forward in mode
"verify", the last stage judges the drafts against its logits (a draft is kept when it is the token the
protocol's sampler, k3-gumbel/1, picks at its index, so the output is plain decoding's, greedy or sampled) and
answers the accepted drafts plus one token;
when it rejected some, every stage's session must return to the last accepted position (KDA, convolution and
MLA state). The driver sends that rewind with the next forward (`ForwardHeader.rewind`) when every stage of
the route takes it there (`capacity["forward_rewind"]`), else as the rewind message to every stage in
parallel. The final event reports the drafted and accepted tokens. One verify step costs one traversal, with
or without a rejection (one more parallel round trip per rejection on routes of older stages).

Churn: a hop that cannot be reached, answers an error, or a step that does not come back within
hop_timeout_s x (N + 1) marks the stage at fault (the one a stage names as its unreachable next hop, or the
ones that fail a health probe); the driver plans a new route without it (a spare for its block, or another
cut), opens a fresh session on every stage of the new route and re-prefills the committed tokens (prompt
plus every token already streamed), then continues. The caller sees a pause. When no route exists without
the failed stages, the request ends with EngineError("engine_unavailable") naming the uncovered layers.
A stage whose block runs sharded over local processes says when that shard set failed (result error
"shard_set_failed": its sessions are gone) and refuses opens while it restarts the set (503 "stage_restarting";
its capabilities say `serving: 0`): the driver routes around it like any failed stage, and when no route exists
without it, waits up to restart_wait_s for it to serve again, then re-prefills through it.
"""
from __future__ import annotations

import abc
import asyncio
import collections
import hashlib
import json
import logging
import math
import secrets
import time
from dataclasses import dataclass, field
from typing import Sequence

import aiohttp
from aiohttp import web
from bittensor.http_auth import InMemoryNonceStore

from chain.interface import ChainError, NeuronInfo
from inference.decoding.sampling import MAX_LOGPROBS, ReplayKey, SamplingParams, draw_seed, find_stop
from inference.decoding.speculation import MAX_DRAFT_TOKENS, SequenceSpeculation, SpeculationConfig
from inference.model.config import ModelConfig
from inference.serving.engine import (Engine, EngineCapabilities, EngineError, EngineHealth, EventStream, FinalEvent,
                                      GenerationRequest, ScoredPosition, TokenEvent)
from inference.swarm.stage import HeadOutput
from neurons.base.engine_wire import wire_sampling
from neurons.swarm.codec import decode_head_output, encode_ids
from neurons.swarm.signed_http import post_signed, start_result_site
from protocol.auth import AuthFailure, verify_request
from protocol.schemas import error_body
from protocol.stage import (CAPABILITIES_PATH, CLOSE_PATH, FORK_PATH, FORWARD_PATH, HEALTH_PATH, OPEN_PATH, RESULT_PATH,
                            REWIND_PATH, CloseRequest, ForwardHeader, Hop, OpenRequest, Receipt, ResultHeader,
                            RewindRequest, StageAnnouncement, StageCapabilities, StageWireError, encode_frame,
                            parse_model, split_frame, state_sha256, verify_capabilities, verify_receipt_chain)

log = logging.getLogger("k3.route")


class RouteFailure(Exception):
    """A step that did not complete on the route; `blame` holds the hotkeys of the stages at fault."""

    def __init__(self, message: str, blame: set[str] | None = None, lost_session: bool = False,
                 restarting: dict[str, str] | None = None):
        super().__init__(message)
        self.blame = set(blame or ())
        self.lost_session = lost_session
        self.restarting = dict(restarting or {})  # hotkey -> url of blamed stages restarting their shard set


# ------------------------------------------------------------------ the directory of stages
@dataclass(frozen=True)
class StageInfo:
    caps: StageCapabilities

    @property
    def url(self) -> str:
        return self.caps.url

    @property
    def hotkey(self) -> str:
        return self.caps.hotkey

    @property
    def start(self) -> int:
        return self.caps.layers[0]

    @property
    def stop(self) -> int:
        return self.caps.layers[1]

    @property
    def hop(self) -> Hop:
        return Hop(url=self.url, hotkey=self.hotkey)

    def describe(self) -> dict:
        return {"url": self.url, "hotkey": self.hotkey, "layers": f"{self.start}-{self.stop - 1}",
                "fingerprint": self.caps.fingerprint, "step_ms": self.caps.step_ms}


class StageDirectory(abc.ABC):
    """Where the route driver finds stage miners (the metagraph's axons in production)."""

    @abc.abstractmethod
    async def stages(self, http: aiohttp.ClientSession) -> list[StageInfo]: ...


class StaticDirectory(StageDirectory):
    """A fixed list of stage URLs; each is asked for its signed capabilities (unreachable ones are left out)."""

    def __init__(self, urls: list[str], timeout_s: float = 3.0, config_hash: str | None = None):
        self.urls = list(urls)
        self.timeout_s = timeout_s
        self.config_hash = config_hash

    async def _one(self, http: aiohttp.ClientSession, url: str) -> StageInfo | None:
        try:
            async with http.get(url.rstrip("/") + CAPABILITIES_PATH,
                                timeout=aiohttp.ClientTimeout(total=self.timeout_s)) as resp:
                if resp.status != 200:
                    return None
                caps = StageCapabilities.model_validate_json(await resp.read())
        except Exception:  # noqa: BLE001 (unreachable, slow or malformed: not a stage for now)
            return None
        if not verify_capabilities(caps) or (self.config_hash and caps.config_hash != self.config_hash):
            log.warning("stage at %s: capabilities unsigned or for another model; ignored", url)
            return None
        if caps.capacity.get("serving", 1) == 0:  # its shard set is restarting: not a stage for now
            return None
        return StageInfo(caps)

    async def stages(self, http: aiohttp.ClientSession) -> list[StageInfo]:
        found = await asyncio.gather(*(self._one(http, u) for u in self.urls))
        return [s for s in found if s is not None]


class MetagraphDirectory(StageDirectory):
    """The stage miners of a subnet, from the chain: every registered neuron whose commitment is a stage
    announcement (`StageAnnouncement`: model, layer block, stage fingerprint) for this model and that publishes an
    endpoint. Each is asked for its signed capabilities, which must be signed by that neuron's own hotkey and say
    what it announced (whole-model miners announce nothing and are never contacted). `config_hash` (and
    `model_fingerprint` when given) select the model; without a config hash every announced stage is taken."""

    def __init__(self, chain, netuid: int, timeout_s: float = 3.0, config_hash: str | None = None,
                 model_fingerprint: str | None = None):
        self.chain = chain
        self.netuid = netuid
        self.config_hash = config_hash
        self.model_fingerprint = model_fingerprint
        self.fetch = StaticDirectory([], timeout_s, config_hash)

    async def announced(self) -> list[tuple[NeuronInfo, StageAnnouncement]]:
        """(neuron, announcement) for every neuron announcing a stage of this model at a published endpoint."""
        deadline = self.fetch.timeout_s * 4
        snapshot, commitments = await asyncio.wait_for(
            asyncio.gather(self.chain.metagraph(self.netuid), self.chain.commitments(self.netuid)), deadline)
        found = []
        for n in snapshot.neurons:
            c = commitments.get(n.hotkey)
            a = StageAnnouncement.parse(c.data) if c is not None else None
            if a is None or n.endpoint is None:
                continue
            if self.config_hash and a.config_hash != self.config_hash:
                continue
            if self.model_fingerprint and a.model_fingerprint != self.model_fingerprint:
                continue
            found.append((n, a))
        return found

    async def stages(self, http: aiohttp.ClientSession) -> list[StageInfo]:
        announced = await self.announced()
        found = await asyncio.gather(*(self.fetch._one(http, n.endpoint.url) for n, _ in announced))
        stages = []
        for s, (n, a) in zip(found, announced):
            if s is None:
                continue
            if s.hotkey != n.hotkey or not a.matches(s.caps):
                log.warning("uid %d at %s serves other layers, another model or another hotkey than it announced; "
                            "ignored", n.uid, n.endpoint.url)
                continue
            stages.append(s)
        return stages


def stage_weight(s: StageInfo, step_ms: float | None = None) -> float:
    """A stage's share of the traffic among the stages of its block: its session capacity over its step time (the
    measured one when given, else the announced one), so identical stages get the same share."""
    sessions = max(1, int(s.caps.capacity.get("sessions", 1)))
    return sessions / max(float(step_ms or s.caps.step_ms or 1.0), 0.05)


def plan_route(stages: list[StageInfo], num_layers: int, exclude: set[str] = frozenset(),
               prefer: set[str] = frozenset(), load: dict[str, float] | None = None,
               weights: dict[str, float] | None = None) -> list[StageInfo] | None:
    """Stages covering [0, num_layers) in order, or None: fewest hops first; among the stages of one block, with
    `load` (tokens each stage was sent so far), the one least loaded for its weight (`weights`, default
    `stage_weight`: a balanced driver spreads its traffic so), else the current stages (`prefer`), then the
    measured step time."""
    by_start: dict[int, list[StageInfo]] = {}
    for s in stages:
        if s.hotkey not in exclude and s.caps.num_layers == num_layers:
            by_start.setdefault(s.start, []).append(s)
    dead_ends: set[int] = set()

    def order(s: StageInfo):
        if load is not None:
            w = (weights or {}).get(s.hotkey) or stage_weight(s)
            return (-s.stop, load.get(s.hotkey, 0.0) / w, s.hotkey)
        return (s.hotkey not in prefer, -s.stop, s.caps.step_ms or math.inf)

    def search(pos: int, used: frozenset) -> list[StageInfo] | None:
        if pos == num_layers:
            return []
        if pos in dead_ends:
            return None
        for s in sorted((s for s in by_start.get(pos, []) if s.hotkey not in used), key=order):
            rest = search(s.stop, used | {s.hotkey})
            if rest is not None:
                return [s] + rest
        dead_ends.add(pos)
        return None

    return search(0, frozenset())


NUMERICS_ORDER = ("float32", "float16", "bfloat16")  # from the finest to the coarsest
MAX_ROUTED = 4096  # stages a driver remembers having routed through (RouteDriver.routed)


def route_numerics(stages: Sequence[StageInfo]) -> str:
    """The numerics a route's answers come in: the coarsest of what its stages compute in and send on (a route
    through one bf16 stage, or over one bf16 wire, answers in bf16), so a validator judges it by that envelope."""
    worst = 0
    for s in stages:
        for d in (s.caps.dtype, s.caps.wire_dtype):
            worst = max(worst, NUMERICS_ORDER.index(d) if d in NUMERICS_ORDER else len(NUMERICS_ORDER) - 1)
    return NUMERICS_ORDER[worst]


def uncovered(stages: list[StageInfo], num_layers: int, exclude: set[str]) -> str:
    """The first layer no usable stage reaches (for error messages)."""
    reach, frontier = {0}, [0]
    while frontier:
        pos = frontier.pop()
        for s in stages:
            if s.hotkey not in exclude and s.start == pos and s.stop not in reach:
                reach.add(s.stop)
                frontier.append(s.stop)
    return f"layer {max(reach)}" if num_layers not in reach else ""


def server_failure(stage: StageInfo, status: int, answer: bytes) -> RouteFailure:
    """A stage's 5xx answer as a RouteFailure blaming it (503 stage_restarting: its shard set restarts)."""
    try:
        code = json.loads(answer)["error"]["code"]
    except Exception:  # noqa: BLE001 (no JSON error body)
        code = ""
    restarting = {stage.hotkey: stage.url} if status == 503 and code == "stage_restarting" else {}
    return RouteFailure(f"stage {stage.url} ({stage.start}-{stage.stop - 1}) failed: {status} {code}".rstrip(),
                        {stage.hotkey}, restarting=restarting)


# ------------------------------------------------------------------ the driver
@dataclass
class RouteSession:
    route: list[StageInfo]
    route_id: str
    session: str
    step: int = 0
    position: int = 0
    receipts: list[Receipt] = field(default_factory=list)  # of the last step
    rewind_to: int | None = None  # a rewind the stages have not done yet: it goes with the next forward
    request_id: str = ""  # the request this session serves (a route miner claims its work against it)


@dataclass
class _Pending:
    future: asyncio.Future
    input_sha: str
    hotkeys: list[str]
    position: int = 0
    input: tuple = ()  # (specs, body) of what the driver sent, kept only when the driver records steps
    rewind: int | None = None
    sent_at: float = field(default_factory=time.monotonic)
    tokens: int = 0


@dataclass(frozen=True)
class StepRecord:
    """One completed step as the driver saw it (opt-in, `record_steps`): what it sent the first stage, the
    stages' receipts, and the head's result bytes; for the route audit (scoring.stage_checks.audit_receipts).
    The states between stages go stage to stage and are not seen here."""

    route_id: str
    session: str
    step: int
    position: int
    receipts: tuple[Receipt, ...]
    input_specs: tuple
    input_body: bytes
    result_body: bytes
    rewind: int | None = None  # the rewind the forward carried (its stages went back there first)
    request_id: str = ""  # the request the session served (RouteSession.request_id)


class RouteDriver:
    """Opens sessions on a route, runs forwards across it and collects the head's results."""

    def __init__(self, directory: StageDirectory, keypair, config: ModelConfig, *, host: str = "127.0.0.1",
                 port: int = 0, hop_timeout_s: float = 5.0, probe_timeout_s: float = 1.5, refresh_s: float = 30.0,
                 public_url: str = "", record_steps: int = 0, rewind_in_forward: bool = True,
                 restart_wait_s: float = 60.0, balance: bool = True):
        """`rewind_in_forward`: send a deferred rewind (`rewind(..., with_next_forward=True)`) in the next
        forward's header where every stage of the route takes it (False: always the rewind message).
        `restart_wait_s`: when no route exists without stages that are restarting their shard sets, wait up to
        this long for one of them to serve again (then re-plan through it). `balance`: spread sessions over the
        stages of each block (`plan_route` with a weighted draw) instead of keeping one route."""
        self.directory = directory
        self.balance = balance
        self.load: dict[str, float] = {}  # per stage hotkey: tokens sent through it (what balancing evens out)
        self.keypair = keypair
        self.hotkey = keypair.ss58_address
        self.config = config
        self.host, self.port = host, port
        self.public_url = public_url  # what the last stage reaches this driver at (default http://host:port)
        self.hop_timeout_s = hop_timeout_s
        self.probe_timeout_s = probe_timeout_s
        self.refresh_s = refresh_s
        self.nonce_store = InMemoryNonceStore()
        self._pending: dict[tuple[str, int], _Pending] = {}
        self._http: aiohttp.ClientSession | None = None
        self._runner: web.AppRunner | None = None
        self._stages: list[StageInfo] = []
        self._stages_at = 0.0
        self.current: list[StageInfo] = []  # the route last planned
        self.failed: dict[str, float] = {}  # hotkey -> when it failed (kept out of routes for refresh_s)
        self.restarting: dict[str, str] = {}  # hotkey -> url of failed stages restarting their shard set
        self.restart_wait_s = restart_wait_s
        self.recoveries = 0
        self.last_receipts: list[Receipt] = []
        self.record_steps = record_steps  # keep the last this many StepRecords (0: none)
        self.rewind_in_forward = rewind_in_forward
        self.rewind_messages = 0  # rewind round trips made (one per rewind, to all stages in parallel)
        self.records: collections.deque[StepRecord] = collections.deque(maxlen=max(1, record_steps))
        # per stage hotkey: the recent decode step times of the routes it was on, each divided by their stages
        self.step_times: dict[str, collections.deque] = {}
        self.closed: dict[str, None] = {}  # sessions this driver closed (their records are complete), oldest first
        self.routed: dict[str, StageInfo] = {}  # every stage of a route it planned, the latest last (MAX_ROUTED)

    @property
    def url(self) -> str:
        return self.public_url or f"http://{self.host}:{self.port}"

    async def start(self) -> None:
        """Start the result endpoint (once: an engine and a miner server over it may both ask)."""
        if self._runner is not None:
            return
        self._http = aiohttp.ClientSession()
        app = web.Application(client_max_size=64 * 1024 * 1024)
        app.router.add_post(RESULT_PATH, self.handle_result)
        self._runner, self.port = await start_result_site(app, self.host, self.port, shutdown_timeout=2.0)

    async def stop(self) -> None:
        for p in self._pending.values():
            if not p.future.done():
                p.future.cancel()
        if self._runner:
            await self._runner.cleanup()
        if self._http:
            await self._http.close()
        self._runner = self._http = None

    # ------------------------------------------------------------ routes
    async def stages(self, refresh: bool = False) -> list[StageInfo]:
        """The stages of the directory, re-read every refresh_s (or now); a chain that cannot be read keeps the
        stages known (a request is not dropped for a chain error), and with none known the route is unavailable."""
        if refresh or not self._stages or time.monotonic() - self._stages_at > self.refresh_s:
            try:
                self._stages = await self.directory.stages(self._http)
            except (ChainError, asyncio.TimeoutError) as e:
                if not self._stages:
                    raise EngineError("engine_unavailable", f"the stages could not be read from the chain: "
                                                            f"{e or type(e).__name__}") from None
                log.warning("could not re-read the stages (%s); keeping the %d known", e or type(e).__name__,
                            len(self._stages))
            self._stages_at = time.monotonic()
        return self._stages

    def _measured_weights(self, stages: list[StageInfo]) -> dict[str, float]:
        """Each stage's weight from the step times this driver measured of the routes it was on, where it has
        some (a stage cannot draw traffic by announcing a fast step it does not have)."""
        out = {}
        for s in stages:
            times = self.step_times.get(s.hotkey)
            if times:
                out[s.hotkey] = stage_weight(s, sorted(times)[len(times) // 2])
        return out

    def known_stages(self) -> list[StageInfo]:
        """The stages the directory last listed (any of them may be on a route)."""
        return list(self._stages)

    def _excluded(self) -> set[str]:
        now = time.monotonic()
        return {h for h, t in self.failed.items() if now - t < self.refresh_s}

    async def plan(self, refresh: bool = False) -> list[StageInfo]:
        """A route for the next session: with `balance`, the least loaded live stage of each block for its
        weight (`plan_route`), else the current stages while they live."""
        stages = await self.stages(refresh)
        exclude = self._excluded()
        load, weights = (self.load, self._measured_weights(stages)) if self.balance else (None, None)
        route = plan_route(stages, self.config.num_layers, exclude, {s.hotkey for s in self.current}, load, weights)
        if route is None and self.restarting and await self._await_restarts():
            stages = await self.stages(refresh=True)
            exclude = self._excluded()
            route = plan_route(stages, self.config.num_layers, exclude, {s.hotkey for s in self.current}, load,
                               weights)
        if route is None:
            where = uncovered(stages, self.config.num_layers, exclude) or "the model"
            raise EngineError("engine_unavailable",
                              f"no route: no live stage miner continues at {where} (layers 0-"
                              f"{self.config.num_layers - 1}; {len(stages)} stages known, {len(exclude)} failed)")
        self.current = route
        for s in route:  # what a session's receipts may name, whatever the listing says later
            self.routed.pop(s.hotkey, None)
            self.routed[s.hotkey] = s
        while len(self.routed) > MAX_ROUTED:
            del self.routed[next(iter(self.routed))]
        return route

    async def _await_restarts(self) -> bool:
        """Poll the health of the stages restarting their shard sets until one serves again (it is then no
        longer held as failed) or restart_wait_s passes (then they are no longer waited for: the next request
        does not wait again); whether any came back."""
        deadline = time.monotonic() + self.restart_wait_s
        while self.restarting:
            for hotkey, url in list(self.restarting.items()):
                try:
                    async with self._http.get(url + HEALTH_PATH,
                                              timeout=aiohttp.ClientTimeout(total=self.probe_timeout_s)) as resp:
                        back = resp.status == 200
                except Exception:  # noqa: BLE001 (not answering yet)
                    back = False
                if back:
                    del self.restarting[hotkey]
                    self.failed.pop(hotkey, None)
                    return True
            if time.monotonic() >= deadline:
                self.restarting.clear()
                return False
            await asyncio.sleep(0.25)
        return False

    async def note_restarting(self, failure: RouteFailure, route: list[StageInfo]) -> None:
        """Remember the blamed stages that are restarting their shard sets: the ones the failure names, and those
        whose /health answers 503 "failed" or "restarting" (a neighbour may have met one first, as a refused
        hop)."""
        self.restarting.update(failure.restarting)
        urls = {s.hotkey: s.url for s in route}

        async def one(hotkey: str) -> None:
            try:
                async with self._http.get(urls[hotkey] + HEALTH_PATH,
                                          timeout=aiohttp.ClientTimeout(total=self.probe_timeout_s)) as resp:
                    state = (await resp.json()).get("status") if resp.status == 503 else None
            except Exception:  # noqa: BLE001 (unreachable or not JSON: a plain failure)
                state = None
            if state in ("failed", "restarting"):
                self.restarting[hotkey] = urls[hotkey]
        await asyncio.gather(*(one(h) for h in failure.blame - set(self.restarting) if h in urls))

    async def open(self, sampling: SamplingParams, seed: int, request_id: str = "",
                   prompt_tokens: int = 0) -> RouteSession:
        """Sessions on every stage of a planned route; the head samples with `seed` and counts generated tokens
        from `prompt_tokens` (k3-gumbel/1's index). The stages before the head are told none of these: a check and a
        user's request look alike to them whatever the sampling."""
        route = await self.plan()
        rs = RouteSession(route, route_id=secrets.token_hex(8), session=secrets.token_hex(12), request_id=request_id)
        me = Hop(url=self.url, hotkey=self.hotkey)
        wire = wire_sampling(sampling)

        async def open_one(i: int, s: StageInfo) -> None:
            head = i + 1 == len(route)  # only the head samples: the other stages learn nothing of how
            req = OpenRequest(route_id=rs.route_id, session=rs.session,
                              upstream=self.hotkey if i == 0 else route[i - 1].hotkey,
                              downstream=None if head else route[i + 1].hop, reply_to=me,
                              **(dict(sampling=wire, seed=seed, prompt_tokens=prompt_tokens) if head else {}))
            await self._control(s, OPEN_PATH, req.model_dump_json().encode())

        results = await asyncio.gather(*(open_one(i, s) for i, s in enumerate(route)), return_exceptions=True)
        failures = [r for r in results if isinstance(r, BaseException)]
        if failures:
            await self.close(rs)
            if any(isinstance(f, RouteFailure) for f in failures):
                blame = set().union(*(f.blame for f in failures if isinstance(f, RouteFailure)))
                restarting = {h: u for f in failures if isinstance(f, RouteFailure) for h, u in f.restarting.items()}
                raise RouteFailure(f"opening the session failed: {failures[0]}", blame, restarting=restarting)
            raise failures[0]
        return rs

    async def _control(self, stage: StageInfo, path: str, body: bytes, timeout_s: float | None = None) -> dict:
        try:
            status, answer = await post_signed(self._http, self.keypair, stage.hop, path, body,
                                               timeout_s or self.hop_timeout_s, "application/json")
        except (asyncio.TimeoutError, aiohttp.ClientError, OSError) as e:
            raise RouteFailure(f"stage {stage.url} ({stage.start}-{stage.stop - 1}) is unreachable: "
                               f"{type(e).__name__}", {stage.hotkey}) from None
        if status == 404:
            raise RouteFailure(f"stage {stage.url} lost the session", set(), lost_session=True)
        if status >= 500:
            raise server_failure(stage, status, answer)
        if status >= 400:
            raise EngineError("engine_failure", f"stage {stage.url} refused {path}: {status} "
                                                f"{answer[:300].decode(errors='replace')}")
        return json.loads(answer or b"{}")

    async def close(self, rs: RouteSession) -> None:
        self.closed[rs.session] = None
        while len(self.closed) > 65536:
            del self.closed[next(iter(self.closed))]
        body = CloseRequest(session=rs.session).model_dump_json().encode()
        await asyncio.gather(*(self._control(s, CLOSE_PATH, body, self.probe_timeout_s) for s in rs.route),
                             return_exceptions=True)

    def takes_forward_rewind(self, rs: RouteSession) -> bool:
        """Whether every stage of the route takes a rewind in a forward's header."""
        return self.rewind_in_forward and all(s.caps.capacity.get("forward_rewind", 0) == 1 for s in rs.route)

    async def rewind(self, rs: RouteSession, position: int, with_next_forward: bool = False) -> None:
        """Every stage of the route back to `position` (the head's next draw then is the token at it).
        `with_next_forward`: when the route takes it, the rewind goes with the next forward (`run`) instead of
        its own round trip now; `rs.position` is `position` either way."""
        if with_next_forward and self.takes_forward_rewind(rs):
            if not 0 <= position <= rs.position:
                raise ValueError(f"can rewind only to 0..{rs.position}, not {position}")
            rs.rewind_to = position if rs.rewind_to is None else min(rs.rewind_to, position)
            rs.position = position
            return
        body = RewindRequest(session=rs.session, position=position).model_dump_json().encode()
        self.rewind_messages += 1
        results = await asyncio.gather(*(self._control(s, REWIND_PATH, body) for s in rs.route),
                                       return_exceptions=True)
        for r in results:
            if isinstance(r, BaseException):
                raise r
        rs.position = position
        rs.rewind_to = None

    async def flush_rewind(self, rs: RouteSession) -> None:
        """Do a rewind that waits for the next forward now (the rewind message)."""
        if rs.rewind_to is not None:
            await self.rewind(rs, rs.rewind_to)

    async def fork(self, rs: RouteSession) -> RouteSession:
        """A copy of the session on every stage of its route (same position and state), under a new id."""
        await self.flush_rewind(rs)
        copy = RouteSession(rs.route, rs.route_id, secrets.token_hex(12), step=rs.step, position=rs.position)
        body = json.dumps({"session": rs.session, "new_session": copy.session}).encode()
        results = await asyncio.gather(*(self._control(s, FORK_PATH, body) for s in rs.route), return_exceptions=True)
        for r in results:
            if isinstance(r, BaseException):
                await self.close(copy)
                raise r
        return copy

    async def probe(self, route: list[StageInfo]) -> set[str]:
        """Hotkeys of the stages that do not answer a health probe in time."""
        async def one(s: StageInfo) -> str | None:
            try:
                async with self._http.get(s.url + HEALTH_PATH,
                                          timeout=aiohttp.ClientTimeout(total=self.probe_timeout_s)) as resp:
                    return None if resp.status == 200 else s.hotkey
            except Exception:  # noqa: BLE001
                return s.hotkey
        return {h for h in await asyncio.gather(*(one(s) for s in route)) if h}

    # ------------------------------------------------------------ forwards
    async def run(self, rs: RouteSession, chunks: list[tuple[list[int], str, list[int] | None]],
                  top_k: int = 0) -> list[HeadOutput]:
        """Send chunks (token ids, mode, targets) one after another from rs.position; await every result."""
        first = rs.route[0]
        waits: list[tuple[int, _Pending]] = []
        try:
            for ids, mode, targets in chunks:
                specs, body = encode_ids(ids)
                step = rs.step
                header = ForwardHeader(route_id=rs.route_id, session=rs.session, step=step, position=rs.position,
                                       mode=mode, targets=targets, top_k=top_k, rewind=rs.rewind_to, tensors=specs)
                pending = _Pending(asyncio.get_running_loop().create_future(), state_sha256(specs, body),
                                   [s.hotkey for s in rs.route], rs.position,
                                   (tuple(specs), body) if self.record_steps else (), rs.rewind_to,
                                   tokens=len(ids))
                self._pending[(rs.session, step)] = pending
                waits.append((step, pending))
                try:
                    status, answer = await post_signed(self._http, self.keypair, first.hop, FORWARD_PATH,
                                                       encode_frame(header, body), self.hop_timeout_s)
                except (asyncio.TimeoutError, aiohttp.ClientError, OSError) as e:
                    raise RouteFailure(f"the first stage {first.url} did not accept the forward: "
                                       f"{type(e).__name__}", {first.hotkey}) from None
                if status == 404:
                    raise RouteFailure(f"stage {first.url} lost the session", set(), lost_session=True)
                if status >= 500:
                    raise server_failure(first, status, answer)
                if status != 202:
                    raise EngineError("engine_failure", f"the first stage refused the forward: {status} "
                                                        f"{answer[:300].decode(errors='replace')}")
                rs.step += 1
                rs.position += len(ids)
                for st in rs.route:
                    self.load[st.hotkey] = self.load.get(st.hotkey, 0.0) + len(ids)
                rs.rewind_to = None  # the first stage took it; the forward carries it down the route
            outputs = []
            for step, pending in waits:
                outputs.append(await self._await_result(rs, step, pending))
            return outputs
        finally:
            for step, _ in waits:
                self._pending.pop((rs.session, step), None)

    async def _await_result(self, rs: RouteSession, step: int, pending: _Pending) -> HeadOutput:
        limit = self.hop_timeout_s * (len(rs.route) + 1)
        try:
            header, body = await asyncio.wait_for(asyncio.shield(pending.future), limit)
        except asyncio.TimeoutError:
            blame = await self.probe(rs.route)
            raise RouteFailure(f"step {step} did not come back within {limit:.1f} s"
                               + (f"; not answering: {sorted(blame)}" if blame else ""), blame) from None
        if header.error is not None:
            e = header.error
            blame = {e.blame} if e.blame else {e.stage}
            if e.code == "stage_refused" and "no session" in e.message:
                raise RouteFailure(f"a stage lost the session: {e.message}", set(), lost_session=True)
            if e.code == "shard_set_failed":  # its sessions are gone; it restarts (a spare, or wait for it)
                urls = {st.hotkey: st.url for st in rs.route}
                raise RouteFailure(f"stage {e.stage} reports {e.code}: {e.message}", {e.stage}, lost_session=True,
                                   restarting={e.stage: urls[e.stage]} if e.stage in urls else {})
            raise RouteFailure(f"stage {e.stage} reports {e.code}: {e.message}", blame)
        problem = verify_receipt_chain(header.receipts, rs.route_id, rs.session, step, pending.input_sha,
                                       pending.hotkeys, driver=self.hotkey)
        if problem is None and header.receipts[-1].output_sha256 != state_sha256([], body):
            problem = "the last receipt does not match the result"
        if problem is not None:
            on_route = [r for r in header.receipts if r.stage in pending.hotkeys]
            bad = next((r.stage for r in on_route if r.driver != self.hotkey),
                       on_route[0].stage if on_route else pending.hotkeys[-1])
            raise RouteFailure(f"receipts do not chain: {problem}", {bad})
        rs.receipts = list(header.receipts)
        self.last_receipts = rs.receipts
        if pending.tokens == 1:  # a decode step: the route's step time, shared by its stages
            share = (time.monotonic() - pending.sent_at) * 1000.0 / len(pending.hotkeys)
            for hotkey in pending.hotkeys:
                self.step_times.setdefault(hotkey, collections.deque(maxlen=256)).append(share)
        if self.record_steps:
            self.records.append(StepRecord(rs.route_id, rs.session, step, pending.position, tuple(header.receipts),
                                           pending.input[0], bytes(pending.input[1]), bytes(body), pending.rewind,
                                           rs.request_id))
        return decode_head_output(body)

    async def handle_result(self, request: web.Request) -> web.Response:
        body = await request.read()
        try:
            caller = verify_request(request.headers, body, "POST", request.raw_path, self.hotkey, self.nonce_store)
            raw, payload = split_frame(body)
            header: ResultHeader = parse_model(ResultHeader, raw, "result header")
        except AuthFailure as e:
            return web.Response(status=e.status, body=e.to_json(), content_type="application/json")
        except StageWireError as e:
            return web.Response(status=e.status, body=error_body(e.code, e.message), content_type="application/json")
        pending = self._pending.get((header.session, header.step))
        if pending is None:
            return web.Response(status=404, body=error_body("unknown_step", "no step awaits this result"),
                                content_type="application/json")
        if caller not in pending.hotkeys:
            return web.Response(status=403, body=error_body("not_on_route", "the sender is not on this route"),
                                content_type="application/json")
        if not pending.future.done():
            pending.future.set_result((header, bytes(payload)))
        return web.json_response({"ok": True})


# ------------------------------------------------------------------ the engine
class RouteEngine(Engine):
    """generate / score over routes of stage miners."""

    def __init__(self, driver: RouteDriver, tokenizer, *, model_fingerprint: str = "", max_context: int = 4096,
                 max_concurrent: int = 8, prefill_chunk: int = 128, max_recoveries: int = 3,
                 speculation: SpeculationConfig | None = None):
        """`speculation` (the route miner's --speculate ngram|suffix|distilled, --draft-tokens, --draft-model):
        draft on the driver and verify the drafts across the route, exactly (greedy output equals plain greedy
        output)."""
        if speculation is not None and speculation.problems():
            raise ValueError("; ".join(speculation.problems()))
        self.speculation = speculation if speculation is not None and speculation.enabled else None
        self.driver = driver
        self.config: ModelConfig = driver.config
        self.tokenizer = tokenizer
        self.model_fingerprint = model_fingerprint
        self.max_context = min(max_context, self.config.max_position_embeddings)
        self.max_concurrent = max_concurrent
        self.prefill_chunk = prefill_chunk
        self.max_recoveries = max_recoveries
        self._stop_ids = frozenset(getattr(tokenizer, "stop_ids", None) or {tokenizer.eos_id})
        self._tasks: set[asyncio.Task] = set()
        self._health = EngineHealth("down", "not started")
        self.recoveries = 0

    async def start(self) -> None:
        await self.driver.start()
        try:
            await self.driver.plan(refresh=True)
            self._health = EngineHealth("ok")
        except EngineError as e:
            self._health = EngineHealth("degraded", e.message)

    async def stop(self) -> None:
        for t in list(self._tasks):
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self.driver.stop()
        self._health = EngineHealth("down", "stopped")

    def health(self) -> EngineHealth:
        return self._health

    def capabilities(self) -> EngineCapabilities:
        route = self.driver.current
        context = min([self.max_context] + [s.caps.capacity.get("context", self.max_context) for s in route])
        sessions = min([self.max_concurrent] + [s.caps.capacity.get("sessions", self.max_concurrent) for s in route])
        # without the whole checkpoint's fingerprint, name the route by its stages' fingerprints
        fp = self.model_fingerprint or "route-" + hashlib.sha256(
            " ".join(s.caps.fingerprint for s in route).encode()).hexdigest()[:16]
        return EngineCapabilities(
            model_id=self.config.model_id, model_fingerprint=fp,
            vocab_size=self.config.vocab_size, max_context=context, max_concurrent_sequences=sessions,
            engine_kind="sharded",  # the miner protocol's kinds; layout says it is a swarm route
            layout={"swarm": True, "route": [s.describe() for s in route]},
            precision=route_numerics(self.driver.known_stages() or route))

    # ------------------------------------------------------------ requests
    def _check(self, token_ids: list[int], total: int) -> None:
        V = self.config.vocab_size
        bad = next((t for t in token_ids if not isinstance(t, int) or not 0 <= t < V), None)
        if bad is not None:
            raise EngineError("invalid_request", f"token id {bad!r} is outside the vocabulary 0..{V - 1}")
        if total > self.max_context:
            raise EngineError("context_too_long", f"{total} tokens exceed this route's context of {self.max_context}")
        if len(self._tasks) >= self.max_concurrent:
            raise EngineError("over_capacity", f"this route driver serves at most {self.max_concurrent} requests")

    def generate(self, request: GenerationRequest) -> EventStream:
        request.check()
        p = request.sampling
        self._check(request.prompt_token_ids, len(request.prompt_token_ids) + p.max_tokens)
        queue: asyncio.Queue = asyncio.Queue()
        task = asyncio.ensure_future(self._generate(request, queue))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return EventStream(queue, task.cancel)

    def _chunks(self, rs: RouteSession, ids: list[int], mode: str, targets: list[int] | None = None):
        size = min([self.prefill_chunk] + [s.caps.capacity.get("tokens_per_forward", self.prefill_chunk)
                                           for s in rs.route])
        out = []
        for i in range(0, len(ids), size):
            last = i + size >= len(ids)
            out.append((ids[i:i + size], mode if last or mode == "score" else "none",
                        None if targets is None else targets[i:i + size]))
        return out

    async def _recover(self, failure: RouteFailure, rs: RouteSession | None, attempt: int) -> None:
        self.recoveries += 1
        self.driver.recoveries += 1
        log.warning("route step failed (%s); blaming %s; recovering", failure, sorted(failure.blame))
        for h in failure.blame:
            self.driver.failed[h] = time.monotonic()
        await self.driver.note_restarting(failure, rs.route if rs is not None else self.driver.current)
        if rs is not None:
            await self.driver.close(rs)
        if attempt > self.max_recoveries:
            raise EngineError("engine_failure", f"the route failed {attempt} times; last: {failure}")
        await self.driver.stages(refresh=True)

    async def _generate(self, request: GenerationRequest, queue: asyncio.Queue) -> None:
        p = request.sampling
        t0 = time.perf_counter()
        seed = p.seed if p.seed is not None else draw_seed()
        committed = list(request.prompt_token_ids)
        decoder = self.tokenizer.incremental_decoder(skip_special_tokens=True)
        generated: list[int] = []
        text = ""
        first_at = prefill_at = None
        rs: RouteSession | None = None
        attempt = 0
        spec = SequenceSpeculation.for_request(self.speculation, p, committed) if self.speculation else None
        try:
            out: HeadOutput | None = None
            while True:
                try:
                    if rs is None:
                        rs = await self.driver.open(p, seed, request.request_id, len(request.prompt_token_ids))
                        out = (await self.driver.run(rs, self._chunks(rs, committed, "sample"), 0))[-1]
                        prefill_at = prefill_at or time.perf_counter()
                    while True:
                        # a plain step emits one token; a verify step the accepted drafts and one more
                        emitted = out.verified if out.mode == "verify" else [(out.token_id, out.logprob, out.top)]
                        for token, logprob, top in emitted:
                            index = len(generated)
                            generated.append(token)
                            now = time.perf_counter()
                            first_at = first_at or now
                            is_eos = token in self._stop_ids and not p.ignore_eos
                            piece, stop_hit = "", False
                            if not is_eos:
                                before = len(text)
                                text += decoder.push(token)
                                if len(generated) >= p.max_tokens:
                                    text += decoder.flush()
                                stop_hit = bool(p.stop) and find_stop(text, p.stop, before) != -1
                                piece = text[before:]
                            queue.put_nowait(TokenEvent(index, token, piece, logprob, list(top)))
                            reason = "eos" if is_eos else "stop" if stop_hit else \
                                "length" if len(generated) >= p.max_tokens else None
                            if reason:
                                ms = lambda a: None if a is None else (a - t0) * 1000.0  # noqa: E731
                                counts = spec.final_counts() if spec is not None else {}
                                queue.put_nowait(FinalEvent(reason, len(request.prompt_token_ids), len(generated),
                                                            0.0, ms(first_at), (time.perf_counter() - t0) * 1000.0,
                                                            ms(prefill_at), seed=seed, **counts))
                                return
                            committed.append(token)
                        out = await self._step(rs, committed, spec, p.max_tokens - len(generated))
                except RouteFailure as failure:
                    attempt += 1
                    await self._recover(failure, rs, attempt)
                    rs = None
        except EngineError as e:
            queue.put_nowait(e)
        except asyncio.CancelledError:
            pass
        except Exception as e:  # noqa: BLE001 (anything else ends this request with a clear error)
            log.exception("route generation failed")
            queue.put_nowait(EngineError("engine_failure", f"{type(e).__name__}: {e}"))
        finally:
            if rs is not None:
                asyncio.ensure_future(self.driver.close(rs))

    async def _step(self, rs: RouteSession, committed: list[int], spec: SequenceSpeculation | None,
                    room: int) -> HeadOutput:
        """One decode step across the route from the last committed token (not yet fed), with `room` tokens
        left to generate. With speculation and a draft: one forward of [last, d_1..d_k] in verify mode, the
        last stage judging the drafts; when it rejects some, every stage is rewound to the last accepted
        position, so their KDA, convolution and MLA state is as if the rejected drafts had never been seen: the
        rewind goes with the next step's forward (or as the rewind message, on routes of older stages)."""
        token = committed[-1]
        if spec is not None:
            per_forward = min([MAX_DRAFT_TOKENS + 1] + [s.caps.capacity.get("tokens_per_forward", MAX_DRAFT_TOKENS + 1)
                                                        for s in rs.route])
            limit = min(room - 1, self.max_context - len(committed), per_forward - 1)
            draft = spec.drafts(committed, limit)
            if draft.tokens:
                start = rs.position
                out = (await self.driver.run(rs, [([token] + draft.tokens, "verify", list(draft.tokens))], 0))[0]
                spec.record_verdict(len(draft.tokens), out.accepted)
                if out.accepted < len(draft.tokens):
                    await self.driver.rewind(rs, start + 1 + out.accepted, with_next_forward=True)
                return out
        out = (await self.driver.run(rs, [([token], "sample", None)], 0))[0]
        if spec is not None:
            spec.observe_plain(out.token_id)
        return out

    async def score(self, token_ids: list[int], positions: list[int] | None = None, top_k: int = 0,
                    replay: ReplayKey | None = None) -> list[ScoredPosition]:
        if replay is not None:
            raise EngineError("invalid_request", "a route's head stage answers logprobs, not logits rows: it cannot "
                                                 "replay sampled tokens")
        if len(token_ids) < 2:
            raise EngineError("invalid_request", "scoring needs at least 2 tokens")
        if not 0 <= top_k <= MAX_LOGPROBS:
            raise EngineError("invalid_request", f"top_k must lie in 0..{MAX_LOGPROBS}")
        self._check(token_ids, len(token_ids))
        n = len(token_ids)
        wanted = set(range(1, n)) if positions is None else set(positions)
        bad = sorted(q for q in wanted if not 1 <= q < n)
        if bad:
            raise EngineError("invalid_request", f"positions {bad[:5]} are outside 1..{n - 1}")
        # row r predicts token r + 1; only rows whose next position is wanted are scored
        targets = [token_ids[r + 1] if r + 1 in wanted else -1 for r in range(n - 1)] + [-1]
        feed = token_ids
        while feed and targets[len(feed) - 1] == -1 and len(feed) > 1:  # no need to feed past the last wanted row
            feed, targets = feed[:-1], targets[:-1]
        attempt, rs = 0, None
        while True:
            try:
                rs = await self.driver.open(SamplingParams(), 0)
                outs = await self.driver.run(rs, self._chunks(rs, feed, "score", targets), top_k)
                break
            except RouteFailure as failure:
                attempt += 1
                await self._recover(failure, rs, attempt)
                rs = None
            finally:
                if rs is not None:
                    await self.driver.close(rs)
                    rs = None
        scored, row = [], 0
        for out in outs:
            for r, lp in enumerate(out.logprobs):
                pos = row + r + 1
                if lp is not None and pos in wanted:
                    scored.append(ScoredPosition(pos, token_ids[pos], float(lp), list(out.row_tops[r])))
            row += len(out.logprobs)
        return sorted(scored, key=lambda s: s.position)

class TrustedDirectory(StageDirectory):
    """A route driver's directory that follows the validator's trust: the stages of `directory` minus those
    blamed in the validator's store within `blame_s` (the gateway's driver never routes organic traffic
    through a blamed stage); the store is read at every refresh (another process may be writing it)."""

    def __init__(self, directory: StageDirectory, store, blame_s: float = 24 * 3600.0):
        self.directory = directory
        self.store = store
        self.blame_s = blame_s

    def blamed(self) -> set[str]:
        return {r["hotkey"] for r in self.store.stage_checks(since=time.time() - self.blame_s) if r["blame"]}

    async def stages(self, http: aiohttp.ClientSession) -> list[StageInfo]:
        blamed = self.blamed()
        return [s for s in await self.directory.stages(http) if s.hotkey not in blamed]

class LoggedRouteDriver(RouteDriver):
    """A route driver that appends every route it plans to a JSON-lines file."""

    route_log = ""

    async def plan(self, refresh: bool = False):
        route = await super().plan(refresh)
        if self.route_log:
            with open(self.route_log, "a") as f:
                f.write(json.dumps({"at": time.time(), "route": [s.hotkey for s in route]}) + "\n")
        return route


__all__ = ["LoggedRouteDriver", "MetagraphDirectory", "RouteDriver", "RouteEngine", "RouteFailure", "RouteSession",
           "StageDirectory", "StageInfo", "StaticDirectory", "StepRecord", "TrustedDirectory", "plan_route"]
