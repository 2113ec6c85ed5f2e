"""The miner's HTTP server in-process (aiohttp AppRunner on loopback) against a real devnet file,
real wallets, a real tiny checkpoint and the real reference engine (wrapped only to count calls)."""
import asyncio
import dataclasses
import itertools
import json
import re
import threading
import time
from contextlib import aclosing
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import hypothesis
import pytest
from aiohttp import web
from bittensor import http_auth
from hypothesis import strategies as st

from chain import connect
from inference.model import ModelConfig
from inference.serving import (Engine, EngineSettings, GenerationRequest, LocalEngine, OpenAICompatibleServer,
                               RemoteEngine, SamplingParams, TokenEvent as EngineTokenEvent, build_engine)
from localnet.cheats import miner as cheats
from neurons.base.settings import ChainSettings
from neurons.miner_app import (AccessSettings, MinerServer, MinerSettings, ServerSettings, load_tokenizer_for,
                               prompt_token_ids, read_miner_settings)
from protocol.auth import SQLiteNonceStore, sign_request
from protocol.client import MinerClient, MinerHTTPError
from protocol.schemas import (CAPABILITIES_PATH, GENERATE_PATH, HEALTH_PATH, SCORE_PATH, ErrorBody, ErrorEvent,
                              FinalMessage, GenerateRequest, ScoreRequest, TokenMessage, decode_event)
from protocol.signature import verify_final, verify_response

CONFIG = ModelConfig.tiny()
MAX_CONTEXT = 1024
CAPACITY = 2
MAX_BODY = 256 * 1024
CHAIN_TIMEOUT_S = 1.0
PROMPT = [(11 * j + 5) % 256 for j in range(24)]
ROOT = Path(__file__).resolve().parent.parent


@dataclass
class World:
    root: Path
    checkpoint: Path
    devnet: Path
    netuid: int
    wallets: dict
    model: object
    tokenizer: object
    fingerprint: str

    def key(self, name):
        return self.wallets[name].hotkey


@pytest.fixture(scope="module")
def world(tmp_path_factory, make_wallets, make_subnet, tiny_checkpoint, tiny_reference) -> World:
    root = tmp_path_factory.mktemp("miner")
    model, tokenizer, fingerprint = tiny_reference
    names = ("owner", "miner", "other_miner", "validator", "small", "poor", "nopermit", "stranger")
    wallets = make_wallets(root / "wallets", names)
    netuid, _ = make_subnet(root / "devnet.sqlite", wallets,
                            ("miner", "other_miner", "validator", "small", "poor", "nopermit"),
                            {"validator": 1000.0, "small": 10.0, "poor": 2.0})
    return World(root, tiny_checkpoint, root / "devnet.sqlite", netuid, wallets, model, tokenizer, fingerprint)


class CountingEngine(Engine):
    """The real engine, counting what reaches it (to prove refused requests never do)."""

    def __init__(self, inner: Engine):
        self.inner = inner
        self.generate_calls = 0
        self.score_calls = 0

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def generate(self, request):
        self.generate_calls += 1
        return self.inner.generate(request)

    async def score(self, token_ids, positions=None, top_k=0):
        self.score_calls += 1
        return await self.inner.score(token_ids, positions, top_k)

    def capabilities(self):
        return self.inner.capabilities()

    def health(self):
        return self.inner.health()

    async def start(self):
        await self.inner.start()

    async def stop(self):
        await self.inner.stop()

    @property
    def calls(self) -> int:
        return self.generate_calls + self.score_calls


def local_engine(world: World, **settings) -> LocalEngine:
    base = dict(max_context=MAX_CONTEXT, max_concurrent_sequences=CAPACITY, step_token_budget=256)
    base.update(settings)
    return LocalEngine(world.model, world.tokenizer, EngineSettings(**base), model_fingerprint=world.fingerprint,
                       engine_kind="reference", layout={"processes": 1})


def miner_settings(world: World, tmp_path: Path, access: dict | None = None, refresh_s: float = 60.0,
                   **server) -> MinerSettings:
    access_values = dict(min_validator_stake=5.0, requests_per_window=100_000, min_requests=3)
    access_values.update(access or {})
    server_values = dict(host="127.0.0.1", port=0, publish=False, metrics_port=0, max_body_bytes=MAX_BODY,
                         nonce_store=str(tmp_path / "nonces.sqlite"), shutdown_grace_s=0.0)
    server_values.update(server)
    return MinerSettings(
        chain=ChainSettings(network=f"devnet:{world.devnet}", netuid=world.netuid, metagraph_refresh_s=refresh_s,
                            timeout_s=CHAIN_TIMEOUT_S),
        server=ServerSettings(**server_values),
        access=AccessSettings(**access_values),
    )


@pytest.fixture
async def start_miner(world, tmp_path):
    """Start in-process miners; each is closed (and its engine stopped) at the end of the test."""
    started = []

    async def start(engine: Engine | None = None, access: dict | None = None, chain=None, wallet="miner",
                    refresh_s: float = 60.0, **server) -> MinerServer:
        engine = engine or CountingEngine(local_engine(world))
        settings = miner_settings(world, tmp_path, access, refresh_s, **server)
        chain = chain or connect(settings.chain.network)
        miner = MinerServer(settings, engine=engine, tokenizer=world.tokenizer, chain=chain,
                            wallet=world.wallets[wallet],
                            nonce_store=SQLiteNonceStore(settings.server.nonce_store))
        started.append((miner, chain))
        await miner.start()
        return miner

    yield start
    for miner, chain in started:
        await miner.close(grace_s=0.0)
        await chain.close()


_last_nonce = 0


def fresh_nonce() -> int:
    global _last_nonce
    _last_nonce = max(time.time_ns(), _last_nonce + 1)
    return _last_nonce


def body_of(**fields) -> bytes:
    values = dict(request_id="req-1", prompt_token_ids=PROMPT, max_tokens=2, temperature=0.0)
    values.update(fields)
    return json.dumps(values, separators=(",", ":")).encode()


def fast_sign(keypair, method: str, path: str, body: bytes, receiver_ss58: str, nonce_ns: int) -> dict[str, str]:
    """btauth/1 headers without http_auth.sign's signer resolution (a slow runtime protocol check):
    the fuzz test signs thousands of requests. Checked against http_auth.sign below."""
    payload = http_auth.build_payload(scheme="sr25519", method=method, path=path, body=body, nonce_ns=nonce_ns,
                                      sender_ss58=keypair.ss58_address, receiver_ss58=receiver_ss58)
    return {http_auth.HEADER_VERSION: http_auth.VERSION, http_auth.HEADER_HOTKEY: keypair.ss58_address,
            http_auth.HEADER_NONCE: str(nonce_ns), http_auth.HEADER_SIGNATURE: "0x" + bytes(keypair.sign(payload)).hex(),
            http_auth.HEADER_RECEIVER: receiver_ss58}


async def signed_call(session, miner, key, body: bytes = b"", path: str = GENERATE_PATH, method: str = "POST",
                      signed_body: bytes | None = None, receiver: str | None = None, nonce: int | None = None,
                      headers: dict | None = None, sign=sign_request):
    """Send `body`, signed by `key` over `signed_body` (default: the body itself); returns
    (status, headers, raw body)."""
    if headers is None:
        headers = sign(key, method, path, body if signed_body is None else signed_body,
                       receiver or miner.hotkey, nonce_ns=nonce or fresh_nonce())
    if method == "POST":
        headers = {"Content-Type": "application/json", **headers}
    async with session.request(method, miner.url + path, data=body, headers=headers) as response:
        return response.status, response.headers, await response.read()


def error_of(raw: bytes):
    return ErrorBody.model_validate_json(raw).error


def events_of(raw: bytes):
    return [decode_event(line) for line in raw.splitlines() if line.strip()]


async def direct_run(engine: Engine, prompt: list[int], sampling: SamplingParams) -> list[EngineTokenEvent]:
    return [event async for event in engine.generate(GenerationRequest(prompt, sampling))
            if isinstance(event, EngineTokenEvent)]


async def scrape_metrics(miner: MinerServer) -> str:
    async with aiohttp.ClientSession() as session:
        async with session.get(f"http://127.0.0.1:{miner.metrics_port}/metrics") as response:
            assert response.status == 200
            return await response.text()


def metric_value(text: str, name: str, **labels) -> float:
    for line in text.splitlines():
        if line.startswith(name) and all(f'{k}="{v}"' in line for k, v in labels.items()):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


# ---------------------------------------------------------------- the happy path
async def test_permitted_validator_gets_a_signed_stream_equal_to_a_direct_engine_run(world, start_miner):
    miner = await start_miner()
    engine = miner.engine
    request = GenerateRequest(request_id="ids-1", prompt_token_ids=PROMPT, max_tokens=8, logprobs=3,
                              temperature=0.0)
    text_request = GenerateRequest(request_id="text-1", prompt="The quick brown fox", max_tokens=6,
                                   temperature=0.9, seed=7, add_special_tokens=True)
    async with MinerClient(world.key("validator")) as client:
        result = await client.generate(miner.url, miner.hotkey, request)
        text_result = await client.generate(miner.url, miner.hotkey, text_request)
    assert engine.generate_calls == 2

    direct = await direct_run(engine.inner, PROMPT, SamplingParams(max_tokens=8, logprobs=3))
    assert result.token_ids == [event.token_id for event in direct]
    assert result.logprobs == pytest.approx([event.logprob for event in direct], abs=1e-5)
    first = result.token_events[0].event
    assert [t.token_id for t in first.top_logprobs[0]] == [t for t, _ in direct[0].top_logprobs]
    assert [t.logprob for t in first.top_logprobs[0]] == pytest.approx([lp for _, lp in direct[0].top_logprobs],
                                                                       abs=1e-5)
    assert result.text == "".join(event.text for event in direct)
    final = result.final
    assert final.usage.prompt_tokens == len(PROMPT) and final.usage.completion_tokens == 8
    assert final.finish_reason == "length" and final.model_fingerprint == world.fingerprint
    assert final.timings.ttft_ms <= final.timings.total_ms
    assert verify_final(final, result.body, result.token_ids, miner.hotkey)
    assert not verify_final(final, result.body, result.token_ids[:-1], miner.hotkey)

    text_ids = world.tokenizer.encode("The quick brown fox", add_bos=True)
    direct_text = await direct_run(engine.inner, text_ids,
                                   SamplingParams(max_tokens=6, temperature=0.9, seed=7))
    assert text_result.token_ids == [event.token_id for event in direct_text]
    assert text_result.final.usage.prompt_tokens == len(text_ids)
    assert verify_final(text_result.final, text_result.body, text_result.token_ids, miner.hotkey)
    # the seed is reported and signed: the request's (7), or one the engine drew, with which the answer replays
    assert text_result.final.seed == 7 and final.seed is not None
    assert not verify_response(text_result.final.signature, text_result.body, text_result.token_ids, miner.hotkey, 8)


async def test_chat_prompts_go_through_the_chat_template(world):
    request = GenerateRequest(request_id="chat", prompt="hi there", max_tokens=1)
    chat_ids = prompt_token_ids(request, world.tokenizer, chat=True)
    assert chat_ids == world.tokenizer.apply_chat_template([{"role": "user", "content": "hi there"}],
                                                           add_generation_prompt=True)
    assert prompt_token_ids(request, world.tokenizer) == world.tokenizer.encode("hi there")
    assert chat_ids != world.tokenizer.encode("hi there")


async def test_score_capabilities_health_and_metrics(world, start_miner):
    miner = await start_miner()
    async with MinerClient(world.key("validator")) as client:
        scored = await client.score(miner.url, miner.hotkey,
                                    ScoreRequest(request_id="s1", token_ids=PROMPT, positions=[1, 5, 9], top_k=3))
        caps = await client.capabilities(miner.url, miner.hotkey)
        health = await client.health(miner.url)
    direct = await miner.engine.inner.score(PROMPT, [1, 5, 9], 3)
    assert [s.logprob for s in scored.scores] == pytest.approx([d.logprob for d in direct], abs=1e-5)
    assert [[t.token_id for t in s.top] for s in scored.scores] == [[t for t, _ in d.top] for d in direct]
    assert scored.model_fingerprint == world.fingerprint
    assert caps.model_fingerprint == world.fingerprint and caps.max_concurrent_streams == CAPACITY
    assert caps.max_context == MAX_CONTEXT and caps.engine == "reference" and caps.vocab_size == CONFIG.vocab_size
    assert caps.sampler == "k3-gumbel/1"  # the project's engine: its sampled answers replay
    assert caps.limits.max_body_bytes == MAX_BODY
    assert health.status == "ok"

    async with aiohttp.ClientSession() as session:  # /health needs no signature and tells nothing sensitive
        async with session.get(miner.url + HEALTH_PATH) as response:
            assert response.status == 200 and response.content_type == "application/json"
            text = await response.text()
    assert str(world.devnet) not in text and miner.hotkey not in text

    assert miner._metrics_runner.addresses[0][0] == "127.0.0.1"
    metrics = await scrape_metrics(miner)
    assert metric_value(metrics, "k3_miner_requests_total", endpoint="score", status="200") == 1
    assert metric_value(metrics, "k3_miner_requests_total", endpoint="capabilities", status="200") == 1
    assert "k3:time_to_first_token_seconds" in metrics and "k3_miner_streams_active" in metrics


class ChangingLayoutEngine(CountingEngine):
    """The real engine, whose declared layout changes while it serves (as a route's does after churn)."""

    layout = {"stages": "first"}

    def capabilities(self):
        caps = self.inner.capabilities()
        return dataclasses.replace(caps, layout=dict(self.layout))


async def test_capabilities_follow_the_engine_after_start(world, start_miner):
    engine = ChangingLayoutEngine(local_engine(world))
    miner = await start_miner(engine=engine)
    async with MinerClient(world.key("validator")) as client:
        before = await client.capabilities(miner.url, miner.hotkey)
        engine.layout = {"stages": "after a spare took over"}
        after = await client.capabilities(miner.url, miner.hotkey)
    assert before.layout == {"stages": "first"}
    assert after.layout == {"stages": "after a spare took over"}
    assert after.model_fingerprint == before.model_fingerprint == world.fingerprint


# ---------------------------------------------------------------- authentication and the gate
async def test_every_auth_and_gate_failure_has_its_status_and_never_reaches_the_engine(world, start_miner):
    miner = await start_miner()
    engine = miner.engine
    body = body_of()
    async with aiohttp.ClientSession() as session:
        cases = {
            "tampered": await signed_call(session, miner, world.key("validator"), body_of(max_tokens=3),
                                          signed_body=body),
            "stale": await signed_call(session, miner, world.key("validator"), body,
                                       nonce=time.time_ns() - 30 * 10**9),
            "future": await signed_call(session, miner, world.key("validator"), body,
                                        nonce=time.time_ns() + 30 * 10**9),
            "wrong_receiver": await signed_call(session, miner, world.key("validator"), body,
                                                receiver=world.key("other_miner").ss58_address),
            "unknown": await signed_call(session, miner, world.key("stranger"), body),
            "no_permit": await signed_call(session, miner, world.key("nopermit"), body),
            "low_stake": await signed_call(session, miner, world.key("poor"), body),
            "no_headers": await signed_call(session, miner, None, body, headers={}),
            "wrong_path": await signed_call(session, miner, world.key("validator"), body, path=SCORE_PATH,
                                            headers=sign_request(world.key("validator"), "POST", GENERATE_PATH,
                                                                 body, miner.hotkey, nonce_ns=fresh_nonce())),
        }
        expected = {
            "tampered": (401, "bad_signature"), "stale": (401, "stale_request"), "future": (401, "stale_request"),
            "wrong_receiver": (403, "wrong_receiver"), "unknown": (403, "not_registered"),
            "no_permit": (403, "no_validator_permit"), "low_stake": (403, "insufficient_stake"),
            "no_headers": (401, "missing_auth"), "wrong_path": (401, "bad_signature"),
        }
        for name, (status, headers, raw) in cases.items():
            assert (status, error_of(raw).code) == expected[name], name
            assert headers["Content-Type"].startswith("application/json")
            assert error_of(raw).message
        assert engine.calls == 0

        # A replay: the first send is served, the identical second one is refused before the engine.
        headers = sign_request(world.key("validator"), "POST", GENERATE_PATH, body, miner.hotkey,
                               nonce_ns=fresh_nonce())
        first = await signed_call(session, miner, None, body, headers=headers)
        second = await signed_call(session, miner, None, body, headers=headers)
    assert first[0] == 200 and isinstance(events_of(first[2])[-1], FinalMessage)
    assert (second[0], error_of(second[2]).code) == (401, "replayed_request")
    assert engine.calls == 1

    metrics = await scrape_metrics(miner)
    for reason in ("bad_signature", "stale_request", "wrong_receiver", "not_registered", "no_validator_permit",
                   "insufficient_stake", "missing_auth", "replayed_request"):
        assert metric_value(metrics, "k3_miner_auth_failures_total", reason=reason) >= 1, reason


# ---------------------------------------------------------------- bad input
async def test_malformed_requests_get_a_4xx_with_a_message_and_no_engine_work(world, start_miner):
    miner = await start_miner()
    v = world.key("validator")
    too_long_text = "a" * (MAX_CONTEXT + 10)
    cases = [
        (GENERATE_PATH, b"{not json", 400, "invalid_json", ""),
        (GENERATE_PATH, b"[1, 2, 3]", 400, "invalid_request", "object"),
        (GENERATE_PATH, b"", 400, "invalid_json", ""),
        (GENERATE_PATH, b"[" * 50_000 + b"]" * 50_000, 400, None, ""),
        (GENERATE_PATH, body_of(max_tokens="5"), 400, "invalid_request", "max_tokens"),
        (GENERATE_PATH, body_of(max_tokens=2.0), 400, "invalid_request", "max_tokens"),
        (GENERATE_PATH, body_of(temperature=3.5), 400, "invalid_request", "temperature"),
        (GENERATE_PATH, body_of(top_p=0), 400, "invalid_request", "top_p"),
        (GENERATE_PATH, body_of(logprobs=21), 400, "invalid_request", "logprobs"),
        (GENERATE_PATH, body_of(seed=-1), 400, "invalid_request", "seed"),
        (GENERATE_PATH, body_of(stop=["x"] * 9), 400, "invalid_request", "stop"),
        (GENERATE_PATH, body_of(request_id="has space"), 400, "invalid_request", "request_id"),
        (GENERATE_PATH, body_of(surprise=1), 400, "invalid_request", "surprise"),
        (GENERATE_PATH, body_of(prompt="hi"), 400, "invalid_request", "exactly one"),
        (GENERATE_PATH, body_of(protocol_version=2), 400, "unsupported_version", "version"),
        (GENERATE_PATH, body_of(prompt_token_ids=[1, CONFIG.vocab_size]), 400, "token_out_of_vocab", "vocabulary"),
        (GENERATE_PATH, body_of(prompt_token_ids=[1, -3]), 400, "invalid_request", "prompt_token_ids"),
        (GENERATE_PATH, body_of(top_k=CONFIG.vocab_size + 1), 400, "invalid_request", "top_k"),
        (GENERATE_PATH, body_of(max_tokens=MAX_CONTEXT - 10), 400, "context_exceeded", "context"),
        (GENERATE_PATH, body_of(max_tokens=5000), 413, "too_large", "max_tokens"),
        (GENERATE_PATH, body_of(prompt_token_ids=None, prompt=too_long_text), 400, "context_exceeded", "context"),
        (SCORE_PATH, json.dumps(dict(request_id="s", token_ids=PROMPT, positions=[0])).encode(), 400,
         "invalid_request", "positions"),
        (SCORE_PATH, json.dumps(dict(request_id="s", token_ids=PROMPT, positions=[3, 2])).encode(), 400,
         "invalid_request", "increasing"),
        (SCORE_PATH, json.dumps(dict(request_id="s", token_ids=[1, 999])).encode(), 400, "token_out_of_vocab", ""),
    ]
    async with aiohttp.ClientSession() as session:
        for path, body, status, code, mentioned in cases:
            got, headers, raw = await signed_call(session, miner, v, body, path=path)
            detail = error_of(raw)
            assert got == status, (body[:80], got, detail)
            assert code is None or detail.code == code, (body[:80], detail)
            assert mentioned in detail.message and detail.message, (body[:80], detail)
            assert headers["Content-Type"].startswith("application/json")
        # Oversized bodies: refused from the Content-Length, and from the bytes when it is chunked.
        big = b"x" * (MAX_BODY + 1)
        got, _, raw = await signed_call(session, miner, v, big)
        assert (got, error_of(raw).code) == (413, "too_large")

        async def chunks():
            for _ in range(8):
                yield b"y" * (MAX_BODY // 4)

        headers = sign_request(v, "POST", GENERATE_PATH, b"", miner.hotkey, nonce_ns=fresh_nonce())
        async with session.post(miner.url + GENERATE_PATH, data=chunks(), headers={**headers, "Content-Type": "application/json"}) as response:
            assert response.status == 413 and error_of(await response.read()).code == "too_large"
        # Unknown paths and methods answer JSON too.
        async with session.get(miner.url + GENERATE_PATH) as response:
            assert response.status == 405 and error_of(await response.read()).code == "method_not_allowed"
    assert miner.engine.calls == 0


# ---------------------------------------------------------------- capacity, disconnects, budgets
async def test_a_flood_beyond_capacity_gets_prompt_429s_and_admitted_streams_complete(world, start_miner):
    miner = await start_miner()
    prompt = PROMPT[:10]
    body_fields = dict(prompt_token_ids=prompt, max_tokens=12)

    async def one(session, name, i):
        body = body_of(request_id=f"{name}-{i}", **body_fields)
        started = time.perf_counter()
        headers = sign_request(world.key(name), "POST", GENERATE_PATH, body, miner.hotkey, nonce_ns=fresh_nonce())
        async with session.post(miner.url + GENERATE_PATH, data=body, headers={**headers, "Content-Type": "application/json"}) as response:
            answered = time.perf_counter() - started
            raw = await response.read()
            return name, body, response.status, response.headers, raw, answered, time.perf_counter() - started

    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=100)) as session:
        results = await asyncio.gather(*[one(session, "validator", i) for i in range(30)],
                                       *[one(session, "small", i) for i in range(10)])
    statuses = [r[2] for r in results]
    assert set(statuses) <= {200, 429}, statuses
    served = [r for r in results if r[2] == 200]
    refused = [r for r in results if r[2] == 429]
    assert len(served) >= CAPACITY and len(refused) >= 30
    codes = {error_of(r[4]).code for r in refused}
    assert codes <= {"over_capacity", "caller_streams"} and "over_capacity" in codes
    assert all(int(r[3]["Retry-After"]) >= 1 for r in refused)
    # Refusals do not wait for capacity: each came back before the first admitted stream had finished.
    assert max(r[5] for r in refused) < min(r[6] for r in served)
    direct = await direct_run(miner.engine.inner, prompt, SamplingParams(max_tokens=12))
    for name, body, _, _, raw, _, _ in served:
        events = events_of(raw)
        ids = [t for e in events if isinstance(e, TokenMessage) for t in e.token_ids]
        assert ids == [e.token_id for e in direct]
        assert verify_final(events[-1], body, ids, miner.hotkey)
    assert miner.engine.inner.active_sequences == 0 and miner.budgets.streams_in_flight == 0


async def test_a_client_that_disconnects_mid_stream_frees_its_sequence(world, start_miner):
    miner = await start_miner()
    inner = miner.engine.inner
    body = body_of(max_tokens=400)
    async with aiohttp.ClientSession() as session:
        headers = sign_request(world.key("validator"), "POST", GENERATE_PATH, body, miner.hotkey,
                               nonce_ns=fresh_nonce())
        response = await session.post(miner.url + GENERATE_PATH, data=body, headers={**headers, "Content-Type": "application/json"})
        assert response.status == 200
        line = await response.content.readline()
        assert isinstance(decode_event(line), TokenMessage)
        assert inner.active_sequences == 1 and inner.reserved_bytes > 0
        response.close()  # drop the connection mid-stream
    deadline = time.monotonic() + 10
    while (inner.active_sequences or inner.reserved_bytes or miner.budgets.streams_in_flight) \
            and time.monotonic() < deadline:
        await asyncio.sleep(0.02)
    assert inner.active_sequences == 0 and inner.reserved_bytes == 0 and miner.budgets.streams_in_flight == 0
    assert metric_value(await scrape_metrics(miner), "k3_miner_client_disconnects_total") == 1


async def test_a_low_stake_validator_hits_its_limits_before_a_high_stake_one(world, start_miner):
    miner = await start_miner(access=dict(requests_per_window=100, min_requests=3, min_streams=1))
    small, big = miner.access.budget_of(world.key("small").ss58_address), \
        miner.access.budget_of(world.key("validator").ss58_address)
    assert (small.requests_per_window, small.max_streams) == (3, 1)
    assert big.requests_per_window == 100 and big.max_streams == CAPACITY  # ceil(100 * 1000 / 1010)

    async with aiohttp.ClientSession() as session:
        # Streams: with one stream of its own open, the small validator is refused a second; the big one is not.
        long_body = body_of(request_id="long", max_tokens=60)
        headers = sign_request(world.key("small"), "POST", GENERATE_PATH, long_body, miner.hotkey,
                               nonce_ns=fresh_nonce())
        held = await session.post(miner.url + GENERATE_PATH, data=long_body, headers={**headers, "Content-Type": "application/json"})
        assert held.status == 200
        status, _, raw = await signed_call(session, miner, world.key("small"), body_of(request_id="second"))
        assert (status, error_of(raw).code) == (429, "caller_streams")
        status, _, raw = await signed_call(session, miner, world.key("validator"), body_of(request_id="big"))
        assert status == 200 and isinstance(events_of(raw)[-1], FinalMessage)
        held.close()
        # Requests per window: the small validator has spent 1 of its 3 (its caller_streams refusal came
        # on headers and took nothing); the big one has 100.
        small_answers = [await signed_call(session, miner, world.key("small"), path=CAPABILITIES_PATH, method="GET")
                         for _ in range(3)]
        big_answers = [await signed_call(session, miner, world.key("validator"), path=CAPABILITIES_PATH,
                                         method="GET") for _ in range(10)]
    assert [a[0] for a in small_answers] == [200, 200, 429]
    assert error_of(small_answers[2][2]).code == "rate_limited"
    assert int(small_answers[2][1]["Retry-After"]) >= 1
    assert [a[0] for a in big_answers] == [200] * 10


# ---------------------------------------------------------------- the chain
async def test_an_unreadable_chain_keeps_the_last_snapshot_and_health_says_so(world, start_miner):
    chain = connect(f"devnet:{world.devnet}")
    miner = await start_miner(chain=chain)
    assert miner.health().status == "ok"
    await chain.close()  # the database is gone from under the miner
    assert await miner.refresh_metagraph() is False
    health = miner.health()
    assert health.status == "degraded" and "stale" in health.detail
    async with MinerClient(world.key("validator")) as client, MinerClient(world.key("stranger")) as stranger:
        caps = await client.capabilities(miner.url, miner.hotkey)  # still gated by the last snapshot
        assert caps.model_fingerprint == world.fingerprint
        with pytest.raises(MinerHTTPError) as refused:
            await stranger.capabilities(miner.url, miner.hotkey)
    assert (refused.value.status, refused.value.code) == (403, "not_registered")
    assert metric_value(await scrape_metrics(miner), "k3_miner_metagraph_read_failures_total") == 1


async def test_a_chain_that_never_answers_times_out_and_callers_get_503(world, start_miner):
    async def silent(reader, writer):
        await asyncio.sleep(30)

    listener = await asyncio.start_server(silent, "127.0.0.1", 0)
    port = listener.sockets[0].getsockname()[1]
    try:
        chain = connect(f"ws://127.0.0.1:{port}")
        started = time.monotonic()
        miner = await start_miner(chain=chain)  # its first read times out after the chain timeout
        assert time.monotonic() - started < CHAIN_TIMEOUT_S + 5
        assert miner.metagraph.last_error == "timed out"
        assert miner.health().status == "down"  # no metagraph: validators cannot be served
        async with MinerClient(world.key("validator")) as client:
            assert "metagraph has not been read" in (await client.health(miner.url)).detail  # (answered 503)
            with pytest.raises(MinerHTTPError) as refused:
                await client.capabilities(miner.url, miner.hotkey)
        assert (refused.value.status, refused.value.code) == (503, "metagraph_unavailable")
    finally:
        listener.close()


async def test_endpoint_publication_and_the_serving_rate_limit(world, start_miner):
    first = await start_miner(wallet="other_miner", publish=True, external_ip="127.0.0.1")
    assert first.publication == "published"
    chain = connect(f"devnet:{world.devnet}")

    async def on_chain():
        return (await chain.metagraph(world.netuid)).by_hotkey(first.hotkey).endpoint

    try:
        entry = await on_chain()
        assert (entry.ip, entry.port) == ("127.0.0.1", first.port)
        # Published again at once with another port: rate limited; the existing entry stays, serving goes on.
        second = await start_miner(wallet="other_miner", publish=True, external_ip="127.0.0.1",
                                   external_port=first.port + 1, nonce_store=str(world.root / "n2.sqlite"),
                                   refresh_s=0.2, publish_retry_s=0.2)
        assert second.publication == "rate_limited"
        entry = await on_chain()
        assert (entry.ip, entry.port) == ("127.0.0.1", first.port)
        assert second.health().status == "ok"
        # The same endpoint as on chain needs no new publication.
        third = await start_miner(wallet="other_miner", publish=True, external_ip="127.0.0.1",
                                  external_port=first.port, nonce_store=str(world.root / "n3.sqlite"))
        assert third.publication == "published"
        # Once the rate limit allows, the rate-limited miner publishes its own endpoint by itself.
        await chain.set_hyperparameter(world.netuid, "serving_rate_limit", 0)
        deadline = time.monotonic() + 10
        while (await on_chain()).port != first.port + 1 and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        assert (await on_chain()).port == first.port + 1 and second.publication == "published"
    finally:
        await chain.close()


# ---------------------------------------------------------------- the remote engine
async def test_the_remote_engine_chosen_by_settings_streams_through_the_miner_and_refusals_are_statuses(
        world, start_miner):
    backend = local_engine(world)
    await backend.start()
    runner = web.AppRunner(OpenAICompatibleServer(backend, world.tokenizer, "kimi-k3-tiny").app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    url = f"http://127.0.0.1:{runner.addresses[0][1]}"
    try:
        settings, _ = read_miner_settings(
            ["--netuid", str(world.netuid), "--engine", "remote", "--remote-url", url, "--remote-model",
             "kimi-k3-tiny", "--checkpoint", str(world.checkpoint), "--max-context", str(MAX_CONTEXT),
             "--max-concurrent", str(CAPACITY)], {})
        remote = build_engine(settings.engine)
        assert isinstance(remote, RemoteEngine) and remote.capabilities().model_fingerprint == world.fingerprint
        assert load_tokenizer_for(settings.engine, remote).encode("abc") == world.tokenizer.encode("abc")
        miner = await start_miner(engine=CountingEngine(remote))
        request = GenerateRequest(request_id="remote-1", prompt_token_ids=PROMPT, max_tokens=6, logprobs=2,
                                  temperature=0.0)
        async with MinerClient(world.key("validator")) as client:
            result = await client.generate(miner.url, miner.hotkey, request)
            direct = await direct_run(backend, PROMPT, SamplingParams(max_tokens=6, logprobs=2))
            assert result.token_ids == [e.token_id for e in direct]
            assert result.logprobs == pytest.approx([e.logprob for e in direct], abs=1e-5)
            assert verify_final(result.final, result.body, result.token_ids, miner.hotkey)
            assert (await client.capabilities(miner.url, miner.hotkey)).engine == "remote"
            await runner.cleanup()  # the backend goes away: the refusal comes at the first event
            runner = None
            with pytest.raises(MinerHTTPError) as refused:
                await client.generate(miner.url, miner.hotkey, request.model_copy(update={"request_id": "remote-2"}))
        assert (refused.value.status, refused.value.code) == (503, "engine_unavailable")
    finally:
        if runner is not None:
            await runner.cleanup()
        await backend.stop()


async def test_streams_that_outlive_the_shutdown_grace_end_with_an_error_event(world, start_miner):
    miner = await start_miner()
    async with MinerClient(world.key("validator")) as client:
        events = []
        request = GenerateRequest(request_id="long", prompt_token_ids=PROMPT, max_tokens=500, temperature=0.0)
        async with aclosing(client.stream_generate(miner.url, miner.hotkey, request)) as stream:
            async for timed in stream:
                events.append(timed.event)
                if len(events) == 1:
                    closing = asyncio.create_task(miner.close(grace_s=0.3))
        await closing
    assert isinstance(events[-1], ErrorEvent) and events[-1].code == "engine_unavailable"
    assert 1 <= len(events) - 1 < 500
    assert miner.engine.inner.active_sequences == 0 and miner.budgets.streams_in_flight == 0
    assert miner.health().status == "down"


# ---------------------------------------------------------------- the cheating miner's engine
async def _generate(world, miner, request):
    async with MinerClient(world.key("validator")) as client:
        return await client.generate(miner.url, miner.hotkey, request)


async def test_cheat_truncate_changes_the_answer_to_a_long_prompt(world, start_miner):
    cheating = cheats
    long_prompt = [(7 * j + 3) % 256 for j in range(600)]
    request = GenerateRequest(request_id="long", prompt_token_ids=long_prompt, max_tokens=4, temperature=0.0)
    honest = await _generate(world, await start_miner(), request)
    cheater = await start_miner(engine=cheating.CheatingEngine(local_engine(world), "truncate"))
    cheat = await _generate(world, cheater, request)
    assert cheat.final.usage.prompt_tokens == honest.final.usage.prompt_tokens == 600  # it hides the cut
    assert cheat.logprobs != pytest.approx(honest.logprobs, abs=1e-3)


async def test_cheat_buffer_sends_every_event_at_once(world, start_miner):
    cheating = cheats
    request = GenerateRequest(request_id="buf", prompt_token_ids=PROMPT, max_tokens=12, temperature=0.0)
    honest = await _generate(world, await start_miner(), request)
    cheater = await start_miner(engine=cheating.CheatingEngine(local_engine(world), "buffer"))
    cheat = await _generate(world, cheater, request)
    assert cheat.token_ids == honest.token_ids
    spread = lambda result: result.token_arrivals_s[-1] - result.token_arrivals_s[0]  # noqa: E731
    assert spread(cheat) < 0.25 * spread(honest)


async def test_cheat_inflate_reports_more_tokens_than_it_sent_and_delay_throttles(world, start_miner):
    cheating = cheats
    request = GenerateRequest(request_id="infl", prompt_token_ids=PROMPT, max_tokens=5, temperature=0.0)
    inflated = await _generate(world, await start_miner(
        engine=cheating.CheatingEngine(local_engine(world), "inflate")), request)
    assert inflated.final.usage.completion_tokens > len(inflated.token_ids) == 5
    slow = await _generate(world, await start_miner(
        engine=cheating.CheatingEngine(local_engine(world), "none", token_delay_ms=150)), request)
    gaps = [b - a for a, b in itertools.pairwise(slow.token_arrivals_s)]
    assert min(gaps) >= 0.12 and slow.final.usage.completion_tokens == 5


# ---------------------------------------------------------------- fuzzing
_VALID = dict(request_id="fuzz", prompt_token_ids=[1, 2, 3], max_tokens=2, temperature=0.0)
_FIELDS = set(GenerateRequest.model_fields)
_json_scalars = st.one_of(st.none(), st.booleans(), st.integers(), st.floats(allow_nan=False), st.text(max_size=20))
_json_values = st.recursive(_json_scalars, lambda inner: st.one_of(
    st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=8), inner, max_size=4)), max_leaves=12)
# Wrong types (None is left out: it is a valid value of the optional fields, and is added where it is not).
_not_str = st.one_of(st.booleans(), st.integers(), st.floats(allow_nan=False),
                     st.lists(st.integers(), min_size=1, max_size=3))
_not_int = st.one_of(st.booleans(), st.floats(allow_nan=False), st.text(max_size=5), st.lists(st.integers(), max_size=2))
_not_number = st.one_of(st.booleans(), st.text(max_size=5), st.lists(st.floats(), max_size=2))


def _with(field, values):
    return values.map(lambda value: {**_VALID, field: value})


_BAD_REQUESTS = st.one_of(
    _with("max_tokens", st.one_of(st.integers(max_value=0), st.integers(min_value=MAX_CONTEXT - 2), _not_int,
                                  st.none())),
    _with("temperature", st.one_of(st.floats(max_value=-1e-6), st.floats(min_value=2.001), _not_number,
                                   st.none())),
    _with("top_p", st.one_of(st.floats(max_value=0.0), st.floats(min_value=1.001), _not_number, st.none())),
    _with("top_k", st.one_of(st.integers(max_value=-1), st.integers(min_value=CONFIG.vocab_size + 1), _not_int,
                             st.none())),
    _with("seed", st.one_of(st.integers(max_value=-1), st.integers(min_value=2**64), _not_int)),
    _with("logprobs", st.one_of(st.integers(max_value=-1), st.integers(min_value=21), _not_int, st.none())),
    _with("stop", st.one_of(st.lists(st.text(min_size=1, max_size=3), min_size=9, max_size=12),
                            st.lists(st.text(min_size=65, max_size=80), min_size=1, max_size=2),
                            st.just([""]), st.lists(st.integers(), min_size=1, max_size=3), _not_str, st.none())),
    _with("request_id", st.one_of(st.just(""), st.text(min_size=129, max_size=140, alphabet="abc"),
                                  st.text(min_size=1, max_size=10).filter(lambda t: re.search(r"[^A-Za-z0-9._:\-]", t)),
                                  _not_str, st.none())),
    _with("prompt_token_ids", st.one_of(
        st.just([]), st.none(), _not_str.filter(lambda v: not isinstance(v, list)),
        st.lists(st.integers(min_value=CONFIG.vocab_size), min_size=1, max_size=4),
        st.lists(st.integers(max_value=-1), min_size=1, max_size=4),
        st.lists(st.one_of(st.floats(allow_nan=False), st.text(max_size=2), st.booleans()), min_size=1, max_size=4))),
    _with("protocol_version", st.one_of(st.integers().filter(lambda v: v != 1), _not_int, st.none())),
    _with("add_special_tokens", st.one_of(st.just(True), st.integers(), st.text(max_size=3), st.none())),
    _with("prompt", st.one_of(st.text(max_size=20), _not_str)),  # both prompts given, or a bad one
    st.builds(lambda key, value: {**_VALID, key: value},
              st.text(min_size=1, max_size=12).filter(lambda k: k not in _FIELDS), _json_values),
    st.sampled_from(sorted(_FIELDS & set(_VALID) - {"temperature"})).map(
        lambda k: {f: v for f, v in _VALID.items() if f != k}),  # a required field (or the prompt) missing
    st.dictionaries(st.text(max_size=10).filter(lambda k: k != "max_tokens"), _json_values, max_size=5),
    _json_values.filter(lambda v: not isinstance(v, dict)),
).map(lambda value: json.dumps(value).encode())
_BAD_BODIES = st.one_of(_BAD_REQUESTS, st.binary(max_size=64).filter(lambda b: not b.strip().startswith(b"{")))


FUZZ_REQUESTS = 2000
FUZZ_BATCH = 20


class ThreadedMiner:
    """A miner on its own event loop in a thread, so that a synchronous hypothesis test can drive it."""

    def __init__(self):
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def run(self, coroutine, timeout_s: float = 60.0):
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result(timeout_s)

    def close(self):
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)
        self.loop.close()


def test_fast_signing_makes_the_headers_http_auth_makes(world):
    key, receiver, body, nonce = world.key("validator"), world.key("miner").ss58_address, b'{"a":1}', fresh_nonce()
    fast = fast_sign(key, "POST", GENERATE_PATH, body, receiver, nonce)
    plain = sign_request(key, "POST", GENERATE_PATH, body, receiver, nonce_ns=nonce)
    signature = http_auth.HEADER_SIGNATURE
    assert {k: v for k, v in fast.items() if k != signature} == {k: v for k, v in plain.items() if k != signature}
    for headers in (fast, plain):  # sr25519 signatures are randomised: both must verify
        caller = http_auth.verify(headers, body, method="POST", path=GENERATE_PATH, self_hotkey_ss58=receiver,
                                  nonce_store=http_auth.InMemoryNonceStore())
        assert caller.hotkey_ss58 == key.ss58_address
    with pytest.raises(http_auth.BadSignature):
        http_auth.verify(fast, body + b" ", method="POST", path=GENERATE_PATH, self_hotkey_ss58=receiver,
                         nonce_store=http_auth.InMemoryNonceStore())


def test_fuzzed_malformed_signed_requests_all_get_4xx_and_the_miner_keeps_serving(world, tmp_path):
    threaded = ThreadedMiner()
    settings = miner_settings(world, tmp_path)
    engine = CountingEngine(local_engine(world))
    key = world.key("validator")

    async def start():
        chain = connect(settings.chain.network)
        miner = MinerServer(settings, engine=engine, tokenizer=world.tokenizer, chain=chain,
                            wallet=world.wallets["miner"], nonce_store=SQLiteNonceStore(settings.server.nonce_store))
        await miner.start()
        return miner, chain, aiohttp.ClientSession()

    async def stop():
        await session.close()
        await miner.close(grace_s=0.0)
        await chain.close()

    miner, chain, session = threaded.run(start())
    answers: list[int] = []
    try:
        # Each example is a batch sent at once: hypothesis's per-example overhead, not the miner, would
        # otherwise dominate the run time.
        @hypothesis.settings(max_examples=FUZZ_REQUESTS // FUZZ_BATCH + 5, deadline=None, database=None,
                             derandomize=True, phases=[hypothesis.Phase.generate],
                             suppress_health_check=list(hypothesis.HealthCheck))
        @hypothesis.given(st.lists(_BAD_BODIES, min_size=FUZZ_BATCH, max_size=FUZZ_BATCH))
        def send(bodies: list[bytes]):
            async def batch():
                return await asyncio.gather(*(signed_call(session, miner, key, body, sign=fast_sign)
                                              for body in bodies))

            for body, (status, _, raw) in zip(bodies, threaded.run(batch())):
                answers.append(status)
                assert 400 <= status < 500, (status, body, raw)
                assert error_of(raw).message

        send()
        assert len(answers) >= FUZZ_REQUESTS
        assert engine.calls == 0
        status, _, raw = threaded.run(signed_call(session, miner, key, body_of(request_id="after-fuzz")))
        assert status == 200 and isinstance(events_of(raw)[-1], FinalMessage)
        assert engine.calls == 1
    finally:
        threaded.run(stop())
        threaded.close()
