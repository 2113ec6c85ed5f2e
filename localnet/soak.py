"""The soak: the local testnet under organic traffic while faults drawn from a seed hit it (`k3-localnet --soak S`).

Everything it does is written to the run directory, for `k3-localnet check RUN_DIR` (localnet/soak_check.py) to read
afterwards:

- `organic.jsonl`: one line per organic request sent through the validator's gateway (steady Poisson arrivals,
  bursts of concurrent requests, long prompts): when, every attempt with its status or error, which miner served
  it (`x-k3-miner-uid`) and the request id the validator recorded it under (`x-k3-request-id`). The users behave
  like the `openai` client: a request whose connection was refused (the gateway's process is down) or that was
  told to come back (429, with Retry-After) is sent again, for up to GATEWAY_WAIT_S; one that failed in flight is
  sent again at most `MAX_ATTEMPTS - 1` times.
- `faults.jsonl`: one line per fault as it was injected: id, kind, target, pid, start and end (unix time),
  duration and details. The schedule (`draw_schedule`) comes from `--soak-seed`; `schedule.json` holds it.
- `events.jsonl`: every start, exit, readiness and stop of a process the soak looks after (`Supervisor`: a process
  that exits unasked is restarted, as systemd would, and the exit recorded as a crash).
- `resources.jsonl`: every `SAMPLE_S` seconds each process's RSS and open descriptors (its children, the shard
  processes, included; the harness's less the sockets its stage links relay) and the size of every SQLite store in
  the run directory.
- `soak.json`: the parties (name, role, hotkey, honest or not), the soak's start and end, the seed.

Fault kinds (`FAULT_KINDS`): SIGKILL and restart of a miner, a stage miner, the route miner or the validator
(at any time, mostly mid-round, or the moment it logs that weights are due: mid-weight-setting); SIGKILL of one
shard process of a sharded miner (the miner restarts its shard set itself); SIGSTOP, then SIGCONT a few seconds
later; delay, rate-limit or cut a stage's link (each stage miner is announced behind a `DelayLink`); chain RPC
errors or stalls (the devnet's test-only fault file, chain/devnet.py); a stage leaving for good and a new one
joining its block (registered, then announcing itself); a miner's clock skewed within btauth's tolerance (the
test-only clock skew file, protocol/auth.py); the validator's disk full (its store's test-only file,
neurons/validator_app/store.py). Faults never overlap on one target; a target that is still restarting is waited
for before the next fault on it.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import signal
import sqlite3
import threading
import time
import urllib.request
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Optional

import aiohttp
import psutil

from localnet.linkproxy import DelayLink

ORGANIC_LOG = "organic.jsonl"
FAULTS_LOG = "faults.jsonl"
EVENTS_LOG = "events.jsonl"
RESOURCES_LOG = "resources.jsonl"
SCHEDULE_FILE = "schedule.json"
SOAK_META = "soak.json"
DEVNET_FAULT_FILE = "devnet-faults.json"  # chain/devnet.py K3_DEVNET_FAULT_FILE
STORE_FULL_FILE = "validator-disk-full"  # neurons/validator_app/store.py K3_TEST_STORE_FULL_FILE
CLOCK_DIR = "clock"  # one skew file per process: protocol/auth.py K3_TEST_CLOCK_SKEW_FILE

SAMPLE_S = 5.0  # resource sampling period
MAX_ATTEMPTS = 3  # in-flight failures a user retries (the openai client's default of 2 retries)
GATEWAY_WAIT_S = 180.0  # how long a user keeps retrying a refused connection (the gateway's process restarting)
ATTEMPT_TIMEOUT_S = 90.0
KEEPALIVE_S = 10.0
READY_TIMEOUT_S = 240.0  # a restarted process that does not serve by then is reported as not recovering
# a process is hit again only once it served this long since it came back (longer than a long prompt takes on the
# loaded 2-core machine): one fault at a time for the requests it serves
TARGET_SETTLE_S = 45.0
CLOCK_SKEW_MAX_S = 1.5  # within btauth's tolerance (2 s ahead, 10 s behind): an honest clock that drifted

# kind -> (weight in the draw, duration range in seconds); the duration of a kill is the time the process stays down
FAULT_KINDS: dict[str, tuple[float, tuple[float, float]]] = {
    "kill": (5.0, (0.5, 3.0)),
    "kill-validator": (0.6, (0.5, 2.0)),
    "kill-validator-weights": (0.6, (0.5, 2.0)),
    "kill-shard": (1.0, (0.0, 0.0)),
    "pause": (2.0, (2.0, 6.0)),
    "link-delay": (1.0, (5.0, 10.0)),
    "link-rate": (1.0, (5.0, 10.0)),
    "link-cut": (1.0, (3.0, 8.0)),
    "chain-error": (1.5, (5.0, 15.0)),
    "chain-stall": (1.0, (5.0, 15.0)),
    "stage-leave": (0.5, (0.0, 0.0)),
    "stage-join": (0.0, (0.0, 0.0)),  # drawn after every stage-leave
    "clock-skew": (1.0, (10.0, 20.0)),
    "disk-full": (1.0, (5.0, 20.0)),
}
SWARM_ONLY = ("link-delay", "link-rate", "link-cut", "stage-leave", "stage-join")


def now() -> float:
    return time.time()


def append_line(path: Path, record: dict) -> None:
    with open(path, "a") as f:
        f.write(json.dumps(record, default=str) + "\n")


# ------------------------------------------------------------------ the schedule
@dataclass
class Fault:
    id: str
    at_s: float  # seconds after the soak started
    kind: str
    target: str
    duration_s: float
    params: dict = field(default_factory=dict)


@dataclass(frozen=True)
class Targets:
    """What the faults may hit, by name: every supervised process by role, and what is special."""

    miners: tuple[str, ...] = ()  # whole-model miners (the sharded ones too)
    sharded: tuple[str, ...] = ()
    stages: tuple[tuple[str, str], ...] = ()  # (name, block) of each stage miner behind a link
    route: tuple[str, ...] = ()  # the route miner
    validator: str = "validator"


def draw_schedule(seed: int, duration_s: float, targets: Targets, start_s: float = 20.0, end_margin_s: float = 20.0,
                  gap_s: tuple[float, float] = (3.0, 7.0)) -> list[Fault]:
    """The faults of one soak from its seed: one after another (each begins gap_s after the previous one's end),
    from start_s until end_margin_s before the end; every kind once first, in an order of the seed's, then kinds
    drawn by their weights. A stage-leave is followed by a stage-join for its block."""
    rng = random.Random(seed)
    kinds = [k for k, (w, _) in FAULT_KINDS.items() if w > 0 and (targets.stages or k not in SWARM_ONLY)]
    if not targets.sharded:
        kinds.remove("kill-shard")
    tour = rng.sample(kinds, len(kinds))
    stages = dict(targets.stages)  # the stages still there (a stage that left is no target any more)
    left_blocks: set[str] = set()
    faults: list[Fault] = []
    t = start_s
    while t < duration_s - end_margin_s:
        kind = tour.pop(0) if tour else rng.choices(kinds, [FAULT_KINDS[k][0] for k in kinds])[0]
        pool = tuple(stages)
        if kind == "stage-leave":  # a block leaves once at most: it keeps a stage while its joiner starts
            pool = tuple(n for n, block in stages.items() if block not in left_blocks)
            if not pool:
                continue
        low, high = FAULT_KINDS[kind][1]
        fault = Fault(f"f{len(faults) + 1}", round(t, 1), kind, _target(rng, kind, targets, pool),
                      round(rng.uniform(low, high), 1), _params(rng, kind))
        faults.append(fault)
        t += fault.duration_s + rng.uniform(*gap_s)
        if kind == "stage-leave":
            left_blocks.add(stages.pop(fault.target))
            faults.append(Fault(f"f{len(faults) + 1}", round(t, 1), "stage-join", fault.target, 0.0))
            t += rng.uniform(*gap_s)
    return faults


def _target(rng: random.Random, kind: str, t: Targets, stages: tuple[str, ...]) -> str:
    if kind in ("kill-validator", "kill-validator-weights", "disk-full"):
        return t.validator
    if kind.startswith("chain-"):
        return "devnet"
    if kind == "kill-shard":
        return rng.choice(t.sharded)
    if kind.startswith("link-") or kind == "stage-leave":
        return rng.choice(stages)
    if kind in ("kill", "clock-skew"):
        return rng.choice(t.miners + stages + t.route)
    return rng.choice(t.miners + stages + t.route + (t.validator,))  # pause


def _params(rng: random.Random, kind: str) -> dict:
    if kind == "link-delay":
        return {"one_way_delay_s": round(rng.uniform(0.05, 0.4), 3)}
    if kind == "link-rate":
        return {"rate_bps": int(rng.choice((2e5, 5e5, 1e6)))}
    if kind == "chain-error":
        return {"calls": rng.randint(3, 12)}
    if kind == "chain-stall":
        return {"calls": rng.randint(2, 6), "stall_s": round(rng.uniform(2.0, 8.0), 1)}
    if kind == "clock-skew":
        return {"skew_s": round(rng.choice((-1, 1)) * rng.uniform(0.5, CLOCK_SKEW_MAX_S), 2)}
    return {}


# ------------------------------------------------------------------ processes
@dataclass
class Party:
    """One process the soak looks after. `launch(append)` starts it (its log appended to on a restart) and returns
    the Popen; `ready()` says whether it serves."""

    name: str
    role: str  # "miner" | "stage" | "route" | "validator"
    hotkey: str
    honest: bool
    launch: Callable[[bool], object]
    ready: Callable[[], bool]
    log: Optional[Path] = None
    process: object = None
    incarnation: int = 0
    left: bool = False  # gone for good (a stage that left): not restarted
    busy: bool = False  # a fault is acting on it: the supervisor keeps its hands off
    ready_at: float = 0.0  # time.monotonic() when it last came to serve
    # MiB it holds in a store bounded by design (a stage's ledger, a miner's committed states), or None
    bounded_mb: Optional[Callable[[], Optional[float]]] = None


class Supervisor:
    """Starts, restarts and watches the parties; every start, exit and readiness goes to events.jsonl."""

    def __init__(self, run_dir: Path, parties: list[Party]):
        self.run_dir = run_dir
        self.parties = {p.name: p for p in parties}
        self.lock = threading.Lock()
        self.crashes = 0

    def event(self, party: Party, event: str, **fields) -> None:
        pid = getattr(party.process, "pid", None)
        append_line(self.run_dir / EVENTS_LOG, {"at": now(), "name": party.name, "role": party.role, "event": event,
                                               "pid": pid, "incarnation": party.incarnation, **fields})

    def adopt(self, party: Party, process) -> None:
        """A party the local testnet started itself (incarnation 1)."""
        with self.lock:
            party.process, party.incarnation, party.ready_at = process, 1, time.monotonic()
            self.parties[party.name] = party
        self.event(party, "start", why="initial")

    def start(self, party: Party, why: str) -> None:
        with self.lock:
            party.incarnation += 1
            party.process = party.launch(party.incarnation > 1)
            self.parties[party.name] = party
        self.event(party, "start", why=why)

    def alive(self, party: Party) -> bool:
        return party.process is not None and party.process.poll() is None

    async def wait_ready(self, party: Party, timeout_s: float = READY_TIMEOUT_S) -> Optional[float]:
        """Seconds until `party` serves (a ready event), or None when it did not within timeout_s."""
        started = time.monotonic()
        while time.monotonic() - started < timeout_s:
            if self.alive(party) and await asyncio.to_thread(party.ready):
                party.ready_at = time.monotonic()
                seconds = party.ready_at - started
                self.event(party, "ready", after_s=round(seconds, 2))
                return seconds
            await asyncio.sleep(0.25)
        self.event(party, "not_ready", after_s=timeout_s)
        return None

    async def until_ready_then_free(self, party: Party, on_ready: Optional[Callable[[Optional[float]], None]] = None
                                    ) -> None:
        """Wait for a restarted party to serve, then let faults and the watch have it again."""
        try:
            ready_s = await self.wait_ready(party)
            if on_ready is not None:
                on_ready(ready_s)
        finally:
            party.busy = False

    async def watch(self, stop: asyncio.Event) -> None:
        """Restart a party whose process exited unasked (a crash), as a service manager would."""
        waiting: set[asyncio.Task] = set()
        while not stop.is_set():
            for party in list(self.parties.values()):
                if party.busy or party.left or party.process is None or self.alive(party):
                    continue
                self.crashes += 1
                self.event(party, "exit", code=party.process.returncode, why="crash")
                party.busy = True
                await asyncio.sleep(1.0)
                await asyncio.to_thread(self.start, party, "restart after a crash")
                task = asyncio.create_task(self.until_ready_then_free(party))
                waiting.add(task)
                task.add_done_callback(waiting.discard)
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(stop.wait(), 1.0)
        for task in waiting:
            task.cancel()


def signal_group(process, sig: int) -> None:
    """`sig` to the process's whole group (its shard processes included)."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(process.pid, sig)


# ------------------------------------------------------------------ stage links
class StageLinks:
    """A `DelayLink` in front of each stage miner, on a loop of its own (`start()`, `stop()`): a stage announces the
    link's port, so everything sent to it (forwards, opens, ledger reads) goes over its link."""

    def __init__(self):
        self.loop = asyncio.new_event_loop()
        self.links: dict[str, DelayLink] = {}
        self._thread = threading.Thread(target=self.loop.run_forever, name="stage-links", daemon=True)
        self._thread.start()

    def add(self, name: str, target_port: int) -> int:
        """A link to 127.0.0.1:target_port; returns the port it listens on."""
        link = DelayLink(target_port)
        asyncio.run_coroutine_threadsafe(link.start(), self.loop).result(10.0)
        self.links[name] = link
        return link.listen_port

    def call(self, fn: Callable[[], None]) -> None:
        self.loop.call_soon_threadsafe(fn)

    def open_sockets(self) -> int:
        """Sockets of the connections the links relay now: the emulated network's, held in this process."""
        return sum(link.open_sockets for link in list(self.links.values()))

    def remove(self, name: str) -> None:
        """Take a stage's link down for good (its port refuses connections, as a host that left)."""
        link = self.links.pop(name, None)
        if link is not None:
            asyncio.run_coroutine_threadsafe(link.close(), self.loop).result(10.0)

    def stop(self) -> None:
        async def close_all():
            await asyncio.gather(*(link.close() for link in self.links.values()), return_exceptions=True)

        with contextlib.suppress(Exception):
            asyncio.run_coroutine_threadsafe(close_all(), self.loop).result(10.0)
        self.loop.call_soon_threadsafe(self.loop.stop)


# ------------------------------------------------------------------ the faults
class FaultInjector:
    """Carries out the schedule against the parties (module doc), writing each fault to faults.jsonl."""

    def __init__(self, run_dir: Path, supervisor: Supervisor, links: Optional[StageLinks], started_at: float,
                 join_stage: Optional[Callable[[str, str], Party]] = None, tempo_s: float = 30.0):
        self.run_dir = run_dir
        self.supervisor = supervisor
        self.links = links
        self.started_at = started_at
        self.join_stage = join_stage  # (name, the stage that left) -> a new Party for its block, registered, started
        self.tempo_s = tempo_s
        self.joined = 0
        self._recoveries: set[asyncio.Task] = set()
        (run_dir / CLOCK_DIR).mkdir(exist_ok=True)

    def party(self, name: str) -> Party:
        return self.supervisor.parties[name]

    async def run(self, schedule: list[Fault], stop: asyncio.Event) -> None:
        for fault in schedule:
            wait = self.started_at + fault.at_s - now()
            if wait > 0:
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(stop.wait(), wait)
            if stop.is_set():
                break
            try:
                await self.inject(fault, stop)
            except Exception as error:  # noqa: BLE001 (a fault that could not be made is recorded, the soak goes on)
                self.record(fault, now(), now(), error=f"{type(error).__name__}: {error}")
        await stop.wait()
        for task in list(self._recoveries):
            task.cancel()

    def _recovering(self, fault: Fault, party: Party) -> None:
        """Wait for a restarted (or joined) party in the background: the next faults go on meanwhile."""
        def done(ready_s: Optional[float]) -> None:
            append_line(self.run_dir / FAULTS_LOG, {"id": fault.id, "recovered": ready_s is not None,
                                                    "ready_s": ready_s, "ready_at": now()})

        task = asyncio.create_task(self.supervisor.until_ready_then_free(party, done))
        self._recoveries.add(task)
        task.add_done_callback(self._recoveries.discard)

    def record(self, fault: Fault, start: float, end: float, **details) -> None:
        append_line(self.run_dir / FAULTS_LOG, {**asdict(fault), "start": start, "end": end,
                                                "seconds": round(end - start, 3), **details})

    async def _target_up(self, name: str, stop: asyncio.Event) -> Party:
        """The party, once no other fault acts on it and it has served TARGET_SETTLE_S since it came back (waited
        for at most READY_TIMEOUT_S)."""
        party = self.party(name)
        deadline = time.monotonic() + READY_TIMEOUT_S

        def settled() -> bool:
            return not party.busy and self.supervisor.alive(party) and \
                time.monotonic() - party.ready_at >= TARGET_SETTLE_S

        while not settled() and time.monotonic() < deadline and not stop.is_set():
            await asyncio.sleep(0.5)
        return party

    async def inject(self, fault: Fault, stop: asyncio.Event) -> None:
        kind = fault.kind
        if kind in ("kill", "kill-validator", "kill-validator-weights"):
            await self.kill(fault, stop)
        elif kind == "kill-shard":
            await self.kill_shard(fault, stop)
        elif kind == "pause":
            await self.pause(fault, stop)
        elif kind.startswith("link-"):
            await self.link(fault)
        elif kind.startswith("chain-"):
            await self.chain(fault)
        elif kind == "stage-leave":
            await self.leave(fault, stop)
        elif kind == "stage-join":
            await self.join(fault)
        elif kind == "clock-skew":
            await self.skew(fault, stop)
        elif kind == "disk-full":
            await self.disk_full(fault)
        else:
            raise ValueError(f"unknown fault kind {kind!r}")

    async def kill(self, fault: Fault, stop: asyncio.Event) -> None:
        party = await self._target_up(fault.target, stop)
        party.busy = True
        try:
            details = {}
            if fault.kind == "kill-validator-weights":
                details = await self._until_weights_due(party)
            pid, start = party.process.pid, now()
            signal_group(party.process, signal.SIGKILL)
            await asyncio.to_thread(party.process.wait)
            self.supervisor.event(party, "exit", code=party.process.returncode, why=f"fault {fault.id}")
            await asyncio.sleep(fault.duration_s)
            await asyncio.to_thread(self.supervisor.start, party, f"restart after fault {fault.id}")
            self.record(fault, start, now(), pid=pid, **details)
        except BaseException:
            party.busy = False
            raise
        self._recovering(fault, party)

    async def _until_weights_due(self, party: Party) -> dict:
        """Wait (at most two tempos) for the validator to log that weights are due; the kill then lands while it
        sets them."""
        log = party.log or self.run_dir / "logs" / f"{party.name}.log"
        offset = log.stat().st_size if log.exists() else 0
        deadline = time.monotonic() + 2 * self.tempo_s + 10.0
        while time.monotonic() < deadline:
            if log.exists() and log.stat().st_size > offset:
                with open(log, "rb") as f:
                    f.seek(offset)
                    chunk = f.read()
                if b"weights due at block" in chunk:
                    return {"weights_due_seen": True}
            await asyncio.sleep(0.05)
        return {"weights_due_seen": False}

    async def kill_shard(self, fault: Fault, stop: asyncio.Event) -> None:
        party = await self._target_up(fault.target, stop)
        party.busy = True
        try:
            shards = shard_processes(party.process.pid)
            if not shards:
                self.record(fault, now(), now(), error="no shard process found")
                return
            victim, cmdline = random.Random(fault.id).choice(shards)
            start = now()
            victim.kill()
            self.record(fault, start, now(), pid=victim.pid, cmdline=cmdline)
        finally:
            party.busy = False

    async def pause(self, fault: Fault, stop: asyncio.Event) -> None:
        party = await self._target_up(fault.target, stop)
        party.busy = True
        try:
            start = now()
            signal_group(party.process, signal.SIGSTOP)
            await asyncio.sleep(fault.duration_s)
            signal_group(party.process, signal.SIGCONT)
            self.record(fault, start, now(), pid=party.process.pid)
        finally:
            party.busy = False

    async def link(self, fault: Fault) -> None:
        link = self.links.links[fault.target]
        start = now()
        if fault.kind == "link-cut":
            self.links.call(link.cut)
        elif fault.kind == "link-delay":
            self.links.call(lambda: setattr(link, "delay_s", fault.params["one_way_delay_s"]))
        else:
            self.links.call(lambda: setattr(link, "rate_bps", fault.params["rate_bps"]))
        await asyncio.sleep(fault.duration_s)
        self.links.call(link.restore if fault.kind == "link-cut" else lambda: (setattr(link, "delay_s", 0.0),
                                                                              setattr(link, "rate_bps", None)))
        self.record(fault, start, now())

    async def chain(self, fault: Fault) -> None:
        start = now()
        mode = "stall" if fault.kind == "chain-stall" else "error"
        write_json(self.run_dir / DEVNET_FAULT_FILE, {"id": fault.id, "mode": mode, "calls": fault.params["calls"],
                                                      "stall_s": fault.params.get("stall_s", 0.0),
                                                      "until": start + fault.duration_s})
        await asyncio.sleep(fault.duration_s)
        self.record(fault, start, now())

    async def leave(self, fault: Fault, stop: asyncio.Event) -> None:
        party = await self._target_up(fault.target, stop)
        party.busy = True
        start = now()
        party.left = True
        signal_group(party.process, signal.SIGTERM)
        try:
            await asyncio.to_thread(party.process.wait, 20.0)
        except Exception:  # noqa: BLE001 (it would not go: make it)
            signal_group(party.process, signal.SIGKILL)
            await asyncio.to_thread(party.process.wait)
        self.supervisor.event(party, "exit", code=party.process.returncode, why=f"fault {fault.id}: left for good")
        if self.links is not None:
            await asyncio.to_thread(self.links.remove, party.name)
        self.record(fault, start, now(), pid=party.process.pid)

    async def join(self, fault: Fault) -> None:
        start = now()
        self.joined += 1
        name = f"joiner{self.joined}"
        party = await asyncio.to_thread(self.join_stage, name, fault.target)
        party.busy, party.incarnation = True, 1
        self.supervisor.parties[name] = party
        self.supervisor.event(party, "start", why=f"fault {fault.id}: joined", hotkey=party.hotkey)
        self.record(fault, start, now(), joined=name, hotkey=party.hotkey)
        self._recovering(fault, party)

    async def skew(self, fault: Fault, stop: asyncio.Event) -> None:
        party = await self._target_up(fault.target, stop)
        path = self.run_dir / CLOCK_DIR / party.name
        start = now()
        path.write_text(str(fault.params["skew_s"]))
        await asyncio.sleep(fault.duration_s)
        path.write_text("")
        self.record(fault, start, now())

    async def disk_full(self, fault: Fault) -> None:
        path = self.run_dir / STORE_FULL_FILE
        start = now()
        path.write_text("full\n")
        await asyncio.sleep(fault.duration_s)
        path.unlink(missing_ok=True)
        self.record(fault, start, now())


def shard_processes(pid: int) -> list[tuple[psutil.Process, str]]:
    """The live shard processes under a sharded miner (with their command lines); zombies are no target."""
    out = []
    for child in psutil.Process(pid).children(recursive=True):
        with contextlib.suppress(psutil.Error):
            if child.status() == psutil.STATUS_ZOMBIE:
                continue
            cmdline = " ".join(child.cmdline())
            if "shard" in cmdline or "multiprocessing" in cmdline:
                out.append((child, cmdline[:200]))
    return out


def in_flight_failure(attempt: dict) -> bool:
    """An attempt that reached the gateway and failed (not one refused before, nor told to come back later)."""
    return not attempt["ok"] and not attempt.get("refused") and attempt.get("status") != 429


def write_json(path: Path, value) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(value))
    tmp.replace(path)


def fault_env(run_dir: Path, name: str, role: str) -> dict[str, str]:
    """The test-only control files a soak's process reads (module doc)."""
    env = {"K3_DEVNET_FAULT_FILE": str(run_dir / DEVNET_FAULT_FILE),
           "K3_TEST_CLOCK_SKEW_FILE": str(run_dir / CLOCK_DIR / name)}
    if role == "validator":
        env["K3_TEST_STORE_FULL_FILE"] = str(run_dir / STORE_FULL_FILE)
    return env


# ------------------------------------------------------------------ organic traffic
# prompts: short code and chat-like lines, and long ones (about LONG_PROMPT_WORDS words: some 1,700 tokens of the
# tiny model's byte-level tokenizer, well inside the local testnet's 4,096-token context)
LONG_PROMPT_WORDS = 250
WORDS = ("the", "model", "route", "stage", "token", "miner", "block", "layer", "weight", "chain", "epoch", "cache",
         "expert", "attention", "residual", "validator", "subnet", "request", "answer", "signal")


class SoakTraffic:
    """Users of the validator's gateway (module doc): steady arrivals at `rate` per second, a burst of
    `burst_size` concurrent requests every `burst_every_s` on average, and a share `long_share` of long prompts."""

    def __init__(self, gateway_url: str, api_key: str, run_dir: Path, seed: int, rate: float = 0.5,
                 burst_every_s: float = 45.0, burst_size: int = 4, long_share: float = 0.1, max_tokens: int = 8):
        self.url = gateway_url.rstrip("/") + "/v1/completions"
        self.api_key = api_key
        self.path = run_dir / ORGANIC_LOG
        self.rng = random.Random(seed)
        self.rate, self.burst_every_s, self.burst_size = rate, burst_every_s, burst_size
        self.long_share, self.max_tokens = long_share, max_tokens
        self.sent = self.served = 0
        self._tasks: set[asyncio.Task] = set()

    def _prompt(self, long: bool) -> str:
        if long:
            return " ".join(self.rng.choice(WORDS) for _ in range(LONG_PROMPT_WORDS))
        i = self.rng.randrange(10_000)
        return f"def f{i}(x):\n    return x * {i % 7}" if self.rng.random() < 0.5 else \
            f"In one line: what does stage {i % 13} of the route hold?"

    async def run(self, stop: asyncio.Event) -> None:
        next_burst = time.monotonic() + self.rng.expovariate(1.0 / self.burst_every_s)
        # idle connections are let go before the gateway closes them (15 s after an answer, docs/security.md), so
        # that no request is sent on a connection the server is closing
        connector = aiohttp.TCPConnector(keepalive_timeout=KEEPALIVE_S)
        async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {self.api_key}"},
                                         connector=connector) as http:
            while not stop.is_set():
                if time.monotonic() >= next_burst:
                    for _ in range(self.burst_size):
                        self._send(http, "burst", long=False)
                    next_burst = time.monotonic() + self.rng.expovariate(1.0 / self.burst_every_s)
                long = self.rng.random() < self.long_share
                self._send(http, "long" if long else "steady", long)
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(stop.wait(), self.rng.expovariate(self.rate))
            if self._tasks:  # requests in flight finish (or time out) before the soak ends
                await asyncio.wait(list(self._tasks), timeout=ATTEMPT_TIMEOUT_S * MAX_ATTEMPTS)

    def _send(self, http: aiohttp.ClientSession, kind: str, long: bool) -> None:
        self.sent += 1
        body = {"model": "kimi-k3", "prompt": self._prompt(long), "max_tokens": self.max_tokens, "temperature": 0.0}
        task = asyncio.ensure_future(self._request(http, f"r{self.sent}", kind, body))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _request(self, http: aiohttp.ClientSession, rid: str, kind: str, body: dict) -> None:
        record = {"id": rid, "kind": kind, "sent_at": now(), "ok": False, "attempts": [], "waited_for_gateway_s": 0.0}
        while sum(1 for a in record["attempts"] if in_flight_failure(a)) < MAX_ATTEMPTS:
            attempt = await self._attempt(http, body)
            if attempt.get("refused"):  # nothing reached the gateway: wait for it, as a client with retries does
                record["waited_for_gateway_s"] = round(now() - record["sent_at"], 3)
                if record["waited_for_gateway_s"] > GATEWAY_WAIT_S:
                    record["attempts"].append(attempt)
                    break
                await asyncio.sleep(1.0)
                continue
            record["attempts"].append(attempt)
            if attempt.get("status") == 429 and now() - record["sent_at"] < GATEWAY_WAIT_S:
                await asyncio.sleep(attempt.get("retry_after_s") or 1.0)  # back-pressure: come back, as told
                continue
            if attempt["ok"]:
                self.served += 1
                record.update(ok=True, miner_uid=attempt["miner_uid"], request_id=attempt["request_id"],
                              prompt_tokens=attempt["prompt_tokens"], completion_tokens=attempt["completion_tokens"])
                break
            status = attempt.get("status") or 0
            if 400 <= status < 500 and status not in (408, 429):  # the request itself is refused: no retry
                break
            # the openai client's backoff: 0.5 s doubling, or what the server says (Retry-After)
            await asyncio.sleep(attempt.get("retry_after_s") or 0.5 * 2 ** len(record["attempts"]))
        record["done_at"] = now()
        record["seconds"] = round(record["done_at"] - record["sent_at"], 3)
        append_line(self.path, record)

    async def _attempt(self, http: aiohttp.ClientSession, body: dict) -> dict:
        attempt = {"at": now(), "ok": False}
        try:
            async with http.post(self.url, json=body, timeout=aiohttp.ClientTimeout(total=ATTEMPT_TIMEOUT_S)) as resp:
                answer = await resp.json(content_type=None)
                if resp.status == 200 and answer.get("choices"):
                    usage = answer.get("usage") or {}
                    attempt.update(ok=True, status=200, miner_uid=resp.headers.get("x-k3-miner-uid", ""),
                                   request_id=resp.headers.get("x-k3-request-id", ""),
                                   prompt_tokens=usage.get("prompt_tokens"),
                                   completion_tokens=usage.get("completion_tokens"))
                else:
                    error = (answer.get("error") or {}) if isinstance(answer, dict) else {}
                    attempt.update(status=resp.status, error=f"HTTP {resp.status} {error.get('code', '')}: "
                                                             f"{str(error.get('message', answer))[:200]}")
                    with contextlib.suppress(TypeError, ValueError):
                        attempt["retry_after_s"] = min(10.0, float(resp.headers.get("Retry-After")))
        except aiohttp.ClientConnectorError as error:
            attempt.update(refused=True, error=f"refused: {error}"[:200])
        except Exception as error:  # noqa: BLE001 (any failure of an attempt is what we record)
            attempt.update(error=f"{type(error).__name__}: {error}"[:300])
        attempt["end"] = now()
        return attempt


# ------------------------------------------------------------------ resources
class ResourceSampler:
    """Every SAMPLE_S: RSS and open descriptors of each party (with its children) and of this process, and the
    size of every SQLite store of the run (with its -wal), to resources.jsonl. The harness's descriptors are
    counted less the sockets of the connections its stage links relay (`links_fds`): those are the emulated
    network's, and come and go with the parties' connection pools."""

    def __init__(self, run_dir: Path, supervisor: Supervisor, links: Optional[StageLinks] = None):
        self.run_dir = run_dir
        self.supervisor = supervisor
        self.links = links

    def sample(self) -> None:
        at = now()
        rows = [("harness", "harness", os.getpid(), 0, None)]
        rows += [(p.name, p.role, p.process.pid, p.incarnation, p.bounded_mb) for p in self.supervisor.parties.values()
                 if self.supervisor.alive(p) and not p.busy]
        with open(self.run_dir / RESOURCES_LOG, "a") as f:
            for name, role, pid, incarnation, bounded_mb in rows:
                # the harness's children are the parties themselves: it counts alone
                usage = process_usage(pid, children=name != "harness")
                bounded = bounded_mb() if bounded_mb is not None else None
                if usage is not None and bounded is not None:
                    usage["bounded_mb"] = round(bounded, 1)
                if usage is not None and name == "harness" and self.links is not None:
                    relayed = self.links.open_sockets()
                    usage.update(fds=max(0, usage["fds"] - relayed), links_fds=relayed)
                if usage is not None:
                    f.write(json.dumps({"at": at, "name": name, "role": role, "pid": pid, "incarnation": incarnation,
                                        **usage}) + "\n")
            f.write(json.dumps({"at": at, "stores": store_sizes(self.run_dir)}) + "\n")

    async def run(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            await asyncio.to_thread(self.sample)
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(stop.wait(), SAMPLE_S)


def process_usage(pid: int, children: bool = True) -> Optional[dict]:
    """RSS (MiB) and open descriptors of a process (and its children: shard processes); None when it is gone."""
    try:
        root = psutil.Process(pid)
        procs = [root] + (root.children(recursive=True) if children else [])
        rss = fds = 0
        for p in procs:
            with contextlib.suppress(psutil.Error):
                rss += p.memory_info().rss
                fds += p.num_fds()
        return {"rss_mb": round(rss / 2**20, 1), "fds": fds, "processes": len(procs)}
    except psutil.Error:
        return None


def store_sizes(run_dir: Path) -> dict[str, int]:
    """Bytes of every SQLite store in the run directory, its -wal included."""
    sizes = {}
    for db in sorted(run_dir.glob("*.sqlite")):
        sizes[db.name] = sum(p.stat().st_size for p in (db, Path(str(db) + "-wal")) if p.exists())
    return sizes


# ------------------------------------------------------------------ the whole soak
class Soak:
    """The soak's machinery on a loop of its own (`start()`, `stop()`): the supervisor, the organic traffic, the
    faults and the sampler."""

    def __init__(self, run_dir: Path, seed: int, duration_s: float, supervisor: Supervisor, traffic: SoakTraffic,
                 injector: FaultInjector, schedule: list[Fault]):
        self.run_dir, self.seed, self.duration_s = run_dir, seed, duration_s
        self.supervisor, self.traffic, self.injector, self.schedule = supervisor, traffic, injector, schedule
        self.sampler = ResourceSampler(run_dir, supervisor, injector.links)
        self._stop_soon: Optional[asyncio.Event] = None
        self._loop: Optional[asyncio.AbstractEventLoop] = None
        self._thread = threading.Thread(target=self._run, name="soak", daemon=True)
        self.error = ""

    def _run(self) -> None:
        async def go():
            self._loop = asyncio.get_running_loop()
            self._stop_soon = asyncio.Event()
            faults_stop = asyncio.Event()
            tasks = [asyncio.create_task(self.supervisor.watch(self._stop_soon)),
                     asyncio.create_task(self.sampler.run(self._stop_soon)),
                     asyncio.create_task(self.traffic.run(self._stop_soon)),
                     asyncio.create_task(self.injector.run(self.schedule, faults_stop))]
            await self._stop_soon.wait()
            faults_stop.set()
            await asyncio.gather(*tasks, return_exceptions=True)

        try:
            asyncio.run(go())
        except Exception as error:  # noqa: BLE001 (reported by the local testnet)
            self.error = f"{type(error).__name__}: {error}"

    def start(self) -> None:
        write_json(self.run_dir / SCHEDULE_FILE, [asdict(f) for f in self.schedule])
        self._thread.start()

    def stop(self, timeout_s: float = 300.0) -> None:
        while self._loop is None and self._thread.is_alive():
            time.sleep(0.1)
        if self._loop is not None and self._stop_soon is not None:
            self._loop.call_soon_threadsafe(self._stop_soon.set)
        self._thread.join(timeout_s)
        # every injected condition ends with the soak, whatever it was doing
        for party in self.supervisor.parties.values():
            if self.supervisor.alive(party):
                signal_group(party.process, signal.SIGCONT)
        meta_path = self.run_dir / SOAK_META
        if meta_path.exists():
            write_json(meta_path, {**json.loads(meta_path.read_text()), "ended_at": now(),
                                   "parties": [{"name": p.name, "role": p.role, "hotkey": p.hotkey, "honest": p.honest}
                                               for p in self.supervisor.parties.values()]})
        (self.run_dir / STORE_FULL_FILE).unlink(missing_ok=True)
        with contextlib.suppress(FileNotFoundError):
            (self.run_dir / DEVNET_FAULT_FILE).unlink()
        for skew in (self.run_dir / CLOCK_DIR).glob("*"):
            skew.write_text("")


def write_meta(run_dir: Path, parties: list[Party], seed: int, started_at: float, duration_s: float,
               **extra) -> None:
    write_json(run_dir / SOAK_META, {"seed": seed, "started_at": started_at, "duration_s": duration_s,
                                     "parties": [{"name": p.name, "role": p.role, "hotkey": p.hotkey,
                                                  "honest": p.honest} for p in parties], **extra})


def wait_warm(db: Path, timeout_s: float) -> Optional[float]:
    """Seconds until the validator's store holds a positive EMA (its first round scored a miner, so the gateway has
    miners to fail over to); None when it did not within timeout_s."""
    started = time.monotonic()
    while time.monotonic() - started < timeout_s:
        with contextlib.suppress(sqlite3.Error):
            if db.exists():
                with contextlib.closing(sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=5.0)) as conn:
                    if conn.execute("SELECT COUNT(*) FROM ema WHERE value > 0").fetchone()[0]:
                        return time.monotonic() - started
        time.sleep(2.0)
    return None


def http_ok(url: str, timeout_s: float = 2.0) -> bool:
    """GET url answers 200 (and, for a JSON health, not "down")."""
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as r:
            if r.status != 200:
                return False
            body = r.read(4096)
    except OSError:
        return False
    with contextlib.suppress(ValueError):
        return json.loads(body).get("status") != "down"
    return True


__all__ = ["FAULT_KINDS", "Fault", "in_flight_failure", "FaultInjector", "Party", "ResourceSampler", "Soak", "SoakTraffic", "StageLinks",
           "Supervisor", "Targets", "draw_schedule", "fault_env", "http_ok", "wait_warm", "write_meta"]
