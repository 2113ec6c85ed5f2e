"""The soak's fault hooks behave as the real faults do (a node's RPC errors and stalls, a skewed clock, a full disk, a
cut link), its schedule is the seed's, and its checker reads a history right (localnet/soak.py, soak_check.py)."""
from __future__ import annotations

import asyncio
import json
import sqlite3
import time

import pytest
from bittensor.sp_core import Keypair

from chain.devnet import FAULT_FILE_ENV, DevnetChain
from chain.interface import ChainConnectionError
from localnet import soak_check
from localnet.linkproxy import DelayLink
from localnet.soak import FAULT_KINDS, Targets, draw_schedule
from neurons.validator_app.store import DISK_FULL, STORE_FULL_FILE_ENV, ValidatorStore
from protocol import auth
from protocol.auth import AuthFailure, check_auth_headers, sign_request
from scoring.metrics import Measurement

RECEIVER = "5FHneW46xGXgs5mUiveU4sbTyGBzmstUspZC92UhjJM694ty"


# ------------------------------------------------------------------ the devnet's RPC faults
async def test_the_devnet_fails_the_next_calls_of_each_process_as_a_node_would(tmp_path, monkeypatch):
    control = tmp_path / "faults.json"
    monkeypatch.setenv(FAULT_FILE_ENV, str(control))
    chain = DevnetChain(tmp_path / "devnet.sqlite", block_interval=1.0, create=True)
    try:
        assert await chain.block() >= 0  # no file: nothing happens
        control.write_text(json.dumps({"id": "f1", "mode": "error", "calls": 2, "until": time.time() + 60}))
        for _ in range(2):
            with pytest.raises(ChainConnectionError, match="connection refused .*f1"):
                await chain.block()
        assert await chain.block() >= 0  # two calls, then through
        control.write_text(json.dumps({"id": "f1", "mode": "error", "calls": 5, "until": time.time() + 60}))
        assert await chain.block() >= 0  # the same fault again is not a new one

        control.write_text(json.dumps({"id": "f2", "mode": "stall", "calls": 1, "stall_s": 0.4,
                                       "until": time.time() + 60}))
        started = time.monotonic()
        with pytest.raises(ChainConnectionError, match="no answer within 0.4 s"):
            await chain.block()
        assert time.monotonic() - started >= 0.4
        # the caller's own deadline fires first, as with a node that does not answer
        control.write_text(json.dumps({"id": "f3", "mode": "stall", "calls": 1, "stall_s": 5.0,
                                       "until": time.time() + 60}))
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(chain.block(), 0.2)

        control.write_text(json.dumps({"id": "f4", "mode": "error", "calls": 3, "until": time.time() - 1}))
        assert await chain.block() >= 0  # over already
    finally:
        await chain.close()


async def test_without_the_variable_the_devnet_reads_no_fault_file(tmp_path, monkeypatch):
    monkeypatch.delenv(FAULT_FILE_ENV, raising=False)
    (tmp_path / "faults.json").write_text(json.dumps({"id": "f1", "mode": "error", "calls": 9,
                                                      "until": time.time() + 60}))
    chain = DevnetChain(tmp_path / "devnet.sqlite", block_interval=1.0, create=True)
    try:
        assert await chain.block() >= 0
    finally:
        await chain.close()


# ------------------------------------------------------------------ a skewed clock
def test_a_skewed_clock_signs_and_checks_off_by_its_skew_within_btauth_tolerance(tmp_path, monkeypatch):
    skew = tmp_path / "skew"
    monkeypatch.setattr(auth, "_skew", auth._ClockSkew(str(skew)))
    key = Keypair.create_from_uri("//Alice")
    skew.write_text("1.5")
    before = time.time_ns()
    headers = sign_request(key, "POST", "/v1/generate", b"{}", RECEIVER)
    nonce = int(headers["X-Bittensor-Nonce"])
    assert nonce - before >= 1.4e9  # signed 1.5 s ahead
    assert check_auth_headers(headers, RECEIVER, now_ns=time.time_ns()) == key.ss58_address  # within the 2 s
    skew.write_text("5")
    time.sleep(0.01)  # a new modification time
    ahead = sign_request(key, "POST", "/v1/generate", b"{}", RECEIVER)
    with pytest.raises(AuthFailure, match="in the future"):
        check_auth_headers(ahead, RECEIVER, now_ns=time.time_ns())
    skew.write_text("")
    time.sleep(0.01)
    assert abs(auth.auth_clock_ns() - time.time_ns()) < 1e8  # an empty file is no skew


# ------------------------------------------------------------------ a full disk
def row(i: int, at: float) -> Measurement:
    return Measurement(uid=1, hotkey=RECEIVER, at=at, kind="chat", request_id=f"req-{i}", outcome="completed",
                       tier0_ok=True, prompt_tokens=10, completion_tokens=4, ttft_s=0.1, total_s=0.5)


def test_a_full_disk_keeps_appended_rows_and_writes_them_once_there_is_room(tmp_path, monkeypatch):
    full = tmp_path / "disk-full"
    monkeypatch.setenv(STORE_FULL_FILE_ENV, str(full))
    db = tmp_path / "v.sqlite"
    with ValidatorStore(db) as store:
        store.add_measurements([(row(0, 1.0), None)], 0, source="organic")
        full.write_text("full")
        store.add_measurements([(row(1, 2.0), None)], 0, source="organic")
        store.add_failures([{"uid": 1, "hotkey": RECEIVER, "check": "unreachable", "reason": "down"}], 0)
        store.add_measurements([(row(2, 3.0), None)], 0, source="organic")
        assert store.deferred_rows == 3
        with pytest.raises(sqlite3.OperationalError, match=DISK_FULL):  # what SQLite says, for other writes
            store.begin_round()
        assert store.measurement_count() == 1  # reads go on
        full.unlink()
        store.add_measurements([(row(3, 4.0), None)], 0, source="organic")
        assert store.deferred_rows == 0
        assert [r["request_id"] for r in store.measurement_rows()] == [f"req-{i}" for i in range(4)]
        assert len(store.failures()) == 1
        assert store.begin_round() == 1
    with sqlite3.connect(db) as conn:
        assert conn.execute("PRAGMA integrity_check").fetchone()[0] == "ok"


# ------------------------------------------------------------------ a cut link
async def closed(reader: asyncio.StreamReader) -> bool:
    """The connection was dropped: end of stream, or reset."""
    try:
        return await asyncio.wait_for(reader.read(4), 2.0) == b""
    except ConnectionResetError:
        return True


async def test_a_cut_link_drops_its_connections_and_refuses_new_ones_until_restored():
    async def echo(reader, writer):
        while data := await reader.read(1024):
            writer.write(data)
            await writer.drain()
        writer.close()

    server = await asyncio.start_server(echo, "127.0.0.1", 0)
    link = DelayLink(server.sockets[0].getsockname()[1])
    await link.start()
    try:
        r, w = await asyncio.open_connection("127.0.0.1", link.listen_port)
        w.write(b"ping")
        assert await asyncio.wait_for(r.read(4), 2.0) == b"ping"
        link.cut()
        assert await closed(r)  # dropped
        r2, w2 = await asyncio.open_connection("127.0.0.1", link.listen_port)
        w2.write(b"x")
        assert await closed(r2)  # refused at once
        link.restore()
        r3, w3 = await asyncio.open_connection("127.0.0.1", link.listen_port)
        w3.write(b"back")
        assert await asyncio.wait_for(r3.read(4), 2.0) == b"back"
        for writer in (w, w2, w3):
            writer.close()
    finally:
        await link.close()
        server.close()


# ------------------------------------------------------------------ the schedule
SWARM = Targets(miners=("miner0", "miner1"), sharded=("miner1",), route=("route",),
                stages=tuple((f"{kind}{i}", block) for i, block in enumerate(("0-2", "3-8", "9-12"))
                             for kind in ("stage", "spare")))


def test_the_schedule_is_the_seeds_and_holds_every_kind_over_an_hour():
    five = draw_schedule(7, 300, SWARM)
    assert five == draw_schedule(7, 300, SWARM) and five != draw_schedule(8, 300, SWARM)
    assert len(five) >= 20
    hour = draw_schedule(7, 3600, SWARM)
    assert len(hour) >= 200
    assert {f.kind for f in hour} == set(FAULT_KINDS)
    for i, f in enumerate(hour):  # one after another, never past the end
        assert f.at_s + f.duration_s <= 3600 and (i == 0 or f.at_s > hour[i - 1].at_s)
        if f.kind == "stage-leave":  # a joiner for its block next, and the stage that left is no target any more
            assert hour[i + 1].kind == "stage-join" and hour[i + 1].target == f.target
            assert all(g.target != f.target for g in hour[i + 2:])
    assert not {f.kind for f in draw_schedule(7, 3600, Targets(miners=("miner0",)))} & {
        "link-cut", "stage-leave", "kill-shard"}


# ------------------------------------------------------------------ the checker
def test_the_checker_attributes_requests_to_fault_windows_and_measures_restoration():
    faults = [{"id": "f1", "kind": "kill", "target": "miner0", "start": 100.0, "end": 101.0},
              {"id": "f2", "kind": "pause", "target": "stage1", "start": 130.0, "end": 134.0}]

    def req(rid, sent, seconds, ok=True, errors=0, kind="steady"):
        attempts = [{"ok": False, "error": "HTTP 502 miners_failed: none"}] * errors + ([{"ok": True}] if ok else [])
        return {"id": rid, "kind": kind, "sent_at": sent, "done_at": sent + seconds, "seconds": seconds, "ok": ok,
                "attempts": attempts}

    requests = [req("a", 90, 1.0), req("b", 95, 1.2), req("c", 102, 2.0, errors=1), req("d", 104, 1.0),
                req("e", 108, 1.1), req("f", 131, 1.0), req("g", 133, 0.9), req("h", 140, 1.0, ok=False, errors=2)]
    bounds = soak_check.slow_bounds(requests, faults)
    assert bounds["steady"] == soak_check.SLOW_FLOOR_S
    soak_check.restore_times(faults, requests, bounds, soak_end=150.0)
    # from the kill at 100: "d", the first good request sent after the failed attempt of "c", answered at 105
    assert faults[0]["restore_s"] == pytest.approx(105.0 - 100.0)
    assert faults[0]["bad_events"] == 1
    assert faults[1]["restore_s"] is None  # "h" failed and nothing came after it
    rows = {r["window"]: r for r in soak_check.traffic_rows(faults, requests)}
    assert (rows["no fault"]["sent"], rows["kill"]["sent"], rows["pause"]["sent"]) == (2, 3, 3)
    assert rows["pause"]["failed"] == 1 and rows["pause"]["why"] == {"HTTP 502 miners_failed": 1}
    assert rows["pause"]["failed_twice"] == 1 and rows["kill"]["retried"] == 1



def test_a_stage_is_judged_on_its_memory_less_its_bounded_ledger():
    """RSS growth within the bound of a stage's ledger (its health reports the ledger's bytes) is the ledger filling
    up, not a leak; growth beyond it, or of a process without such a cache, is."""
    def samples(name, rss, ledger=None):
        return [{"at": float(t), "name": name, "incarnation": 1, "rss_mb": rss(t), "fds": 20,
                 **({"bounded_mb": ledger(t)} if ledger else {})} for t in range(0, 301, 5)]

    filling = samples("stage1", lambda t: 300 + 0.4 * t, lambda t: 0.4 * t)
    leaking = samples("stage2", lambda t: 300 + 0.6 * t, lambda t: 0.2 * t)
    plain = samples("miner0", lambda t: 300 + 0.4 * t)
    rows, _ = soak_check.resource_rows(filling + leaking + plain)
    grew = {r["process"]: r["grew"] for r in rows}
    assert grew == {"stage1": [], "stage2": ["RSS"], "miner0": ["RSS"]}
    stage1 = next(r for r in rows if r["process"] == "stage1")
    assert stage1["bounded_end_mb"] > stage1["bounded_warm_mb"] and stage1["rss_less_bounded_end_mb"] == 300


def test_the_harness_is_sampled_less_the_connections_its_links_relay(tmp_path):
    """The stage links' relayed connections are the emulated network's: the harness's own descriptors exclude them
    (`links_fds`), so connection pools filling up between the parties do not read as the harness leaking."""
    import socket
    import types

    from localnet.soak import RESOURCES_LOG, ResourceSampler, StageLinks

    server = socket.create_server(("127.0.0.1", 0))
    links = StageLinks()
    ends = []  # this test's own sockets: 6 clients and the 6 ends the target accepted
    try:
        port = links.add("stage0", server.getsockname()[1])
        sampler = ResourceSampler(tmp_path, types.SimpleNamespace(parties={}), links)
        sampler.sample()
        for _ in range(6):
            ends.append(socket.create_connection(("127.0.0.1", port)))
            ends.append(server.accept()[0])
        deadline = time.monotonic() + 5
        while links.open_sockets() < 12 and time.monotonic() < deadline:
            time.sleep(0.05)
        sampler.sample()
    finally:
        for end in ends:
            end.close()
        links.stop()
        server.close()
    first, second = (json.loads(line) for line in (tmp_path / RESOURCES_LOG).read_text().splitlines()
                     if '"harness"' in line)
    assert (first["links_fds"], second["links_fds"]) == (0, 12)
    assert 12 <= second["fds"] - first["fds"] <= 14  # the test's own 12, not the link's 12 besides


def test_descriptors_grow_only_when_their_floor_rises():
    """A route's descriptors swing with the requests in flight (its connections to the stages open and close with
    each session): a busy last minute is not a leak; descriptors that are never closed raise the floor, and are."""
    def samples(name, fds):
        return [{"at": float(t), "name": name, "incarnation": 1, "rss_mb": 300.0, "fds": fds(t)}
                for t in range(0, 301, 5)]

    def swinging(t):  # quiet in the first minute after warm-up, bursts of 60 open connections at the end
        return 60 if t > 240 and t % 15 else 14

    rows, _ = soak_check.resource_rows(samples("route", swinging) + samples("leaky", lambda t: 14 + t // 5))
    grew = {r["process"]: r["grew"] for r in rows}
    assert grew == {"route": [], "leaky": ["descriptors"]}
    route = next(r for r in rows if r["process"] == "route")
    assert (route["fds_warm"], route["fds_end"]) == (14, 14)

# ------------------------------------------------------------------ a route through chain errors
async def test_a_route_keeps_the_stages_it_knows_when_the_chain_cannot_be_read():
    from inference.model.config import ModelConfig
    from inference.serving.engine import EngineError
    from neurons.swarm.route import RouteDriver, StageDirectory

    class Flaky(StageDirectory):
        def __init__(self):
            self.answers = [ChainConnectionError("no chain"), ["stage-a", "stage-b"], ChainConnectionError("no chain")]

        async def stages(self, http):
            answer = self.answers.pop(0)
            if isinstance(answer, Exception):
                raise answer
            return answer

    driver = RouteDriver(Flaky(), Keypair.create_from_uri("//driver"), ModelConfig.tiny())
    with pytest.raises(EngineError, match="could not be read from the chain"):  # nothing known yet: unavailable
        await driver.stages(refresh=True)
    assert await driver.stages(refresh=True) == ["stage-a", "stage-b"]
    assert await driver.stages(refresh=True) == ["stage-a", "stage-b"]  # the chain failed: the known ones stay


# ------------------------------------------------------------------ the soak's wiring
def test_the_soak_gives_every_block_a_spare_and_its_validator_a_valid_lighter_scoring(tmp_path, capsys):
    from localnet.testnet import SOAK_VALIDATOR_FLAGS, parse_args, swarm_neurons, swarm_ports
    from scoring.config import ScoringConfig

    args = parse_args(["--swarm", "3", "--soak", "300", "--base-port", "20000"])
    assert args.duration == 300
    stages = [n for n in swarm_neurons(args, tmp_path / "wallets") if n.role == "stage"]
    assert sorted(n.layers for n in stages if n.name.startswith("spare")) == ["0-2", "3-8", "9-12"]
    assert max(n.port for n in stages) < 20000 + swarm_ports(3)
    overrides = json.loads(SOAK_VALIDATOR_FLAGS[SOAK_VALIDATOR_FLAGS.index("--scoring-overrides") + 1])
    config = ScoringConfig.local_testnet(**{k: tuple(v) if isinstance(v, list) else v for k, v in overrides.items()})
    assert config.problems() == []
    for argv in (["--soak", "60", "--setup-only", "--run-dir", str(tmp_path)], ["--soak", "60", "--network", "local",
                                                                              "--netuid", "2"]):
        with pytest.raises(SystemExit):
            parse_args(argv)
        assert "--soak runs on the embedded devnet" in capsys.readouterr().err
