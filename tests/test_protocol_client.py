"""MinerClient against real aiohttp servers on loopback, and response signatures.

The test miner authenticates with the real btauth/1 verifier and signs its
answers with a real hotkey; `request_id` picks how it behaves, so each
timeout and protocol violation is produced by a real server over real TCP.
"""
import asyncio
import hashlib
import itertools
import math
import socket
import time

import pytest
from aiohttp import web

from protocol.auth import AuthFailure, SQLiteNonceStore, verify_request
from protocol.client import (ClientTimeouts, MinerClient, MinerHTTPError, MinerProtocolError, MinerStreamError,
                             MinerTimeout, MinerUnreachable)
from protocol.schemas import (CAPABILITIES_PATH, GENERATE_PATH, HEALTH_PATH, NDJSON_CONTENT_TYPE, SCORE_PATH,
                              Capabilities, ErrorEvent, FinalMessage, GenerateRequest, Health, ProtocolError,
                              ScoredPositionMessage, ScoreRequest, ScoreResponse, Timings, TokenMessage, TopLogprob,
                              Usage, encode_event, encode_model, error_body, parse_generate, parse_score)
from protocol.signature import encode_token_ids, response_digest, sign_response, verify_final, verify_response

FAST = ClientTimeouts(connect=1.0, first_byte=2.0, between_events=2.0, total=10.0)
# A timeout must fire no earlier than its bound and no later than this after it (2 busy cores).
SLACK_S = 0.6
STEP_S = 0.05
FOREVER_S = 30.0


@pytest.fixture(scope="module")
def keys(tmp_path_factory, make_wallets):
    wallets = make_wallets(tmp_path_factory.mktemp("wallets"), ("validator", "miner", "other"))
    return {name: wallet.hotkey for name, wallet in wallets.items()}


def token(index, token_id=None, logprobs=2):
    token_id = 10 + index if token_id is None else token_id
    top = [TopLogprob(token_id=token_id, logprob=-0.5)] + [
        TopLogprob(token_id=900 + k, logprob=-1.0 - k) for k in range(logprobs - 1)
    ]
    return TokenMessage(index=index, token_ids=[token_id], text=f"t{index}", logprobs=[-0.5], top_logprobs=[top])


def final(miner, body, token_ids, prompt_tokens=3):
    return FinalMessage(
        finish_reason="length",
        usage=Usage(prompt_tokens=prompt_tokens, completion_tokens=len(token_ids)),
        timings=Timings(queue_ms=0.1, ttft_ms=1.0, total_ms=2.0),
        model_fingerprint="test-fp",
        signature=sign_response(miner, body, token_ids),
    )


class Refusal(Exception):
    def __init__(self, status: int, body: bytes):
        self.status, self.body = status, body


def json_error(status: int, body: bytes) -> Refusal:
    return Refusal(status, body)


@web.middleware
async def answer_refusals(request, handler):
    try:
        return await handler(request)
    except Refusal as refusal:
        return web.Response(status=refusal.status, body=refusal.body, content_type="application/json")


class LoopbackMiner:
    """A small miner: verifies btauth/1, parses with the protocol, misbehaves on request."""

    def __init__(self, miner_key, store):
        self.key = miner_key
        self.store = store
        self.requests = []

    def app(self) -> web.Application:
        app = web.Application(middlewares=[answer_refusals])
        app.router.add_post(GENERATE_PATH, self.generate)
        app.router.add_post(SCORE_PATH, self.score)
        app.router.add_get(CAPABILITIES_PATH, self.capabilities)
        app.router.add_get(HEALTH_PATH, self.health)
        return app

    async def authenticate(self, request: web.Request) -> bytes:
        body = await request.read()
        try:
            verify_request(request.headers, body, request.method, request.raw_path, self.key.ss58_address, self.store)
        except AuthFailure as failure:
            raise json_error(failure.status, failure.to_json()) from None
        return body

    async def generate(self, request: web.Request) -> web.StreamResponse:
        body = await self.authenticate(request)
        try:
            parsed = parse_generate(body)
        except ProtocolError as error:
            raise json_error(error.status, error.to_json()) from None
        self.requests.append(body)
        scenario = parsed.request_id
        if scenario == "over-capacity":
            raise json_error(429, error_body("over_capacity", "all 4 streams busy"))
        if scenario == "bad-gateway":
            return web.Response(status=502, text="<html>bad gateway</html>", content_type="text/html")
        if scenario == "wrong-type":
            return web.json_response({"type": "final"})
        if scenario == "delay-headers":
            await asyncio.sleep(FOREVER_S)
        stream = web.StreamResponse(headers={"Content-Type": NDJSON_CONTENT_TYPE})
        await stream.prepare(request)
        if scenario == "delay-first-event":
            await asyncio.sleep(FOREVER_S)
        if scenario.startswith("prefill-at-"):  # a prefill at N tokens/s before the first token
            await asyncio.sleep(len(parsed.prompt_token_ids) / int(scenario.rsplit("-", 1)[1]))
        if scenario == "blank-lines":
            while True:
                await asyncio.sleep(STEP_S)
                await stream.write(b"\n")
        if scenario == "trickle":  # one event, then bytes that never complete another
            await stream.write(encode_event(token(0)) + b'{"type": "tok')
            while True:
                await asyncio.sleep(STEP_S)
                await stream.write(b"e")
        if scenario == "forever":
            for i in itertools.count():
                await stream.write(encode_event(token(i)))
                await asyncio.sleep(STEP_S)
        if scenario == "huge":
            big = TokenMessage(index=0, token_ids=[1], text="x" * 16_000, logprobs=[-1.0], top_logprobs=[[]])
            for i in range(1000):
                await stream.write(encode_event(big.model_copy(update={"index": i})))
            return stream
        if scenario == "malformed":
            await stream.write(encode_event(token(0)) + b"this is not json\n")
            return stream
        if scenario == "bad-schema":
            await stream.write(encode_event(token(0)).replace(b'"text"', b'"extra":1,"text"'))
            return stream
        if scenario == "index-gap":
            await stream.write(encode_event(token(0)) + encode_event(token(2)))
            return stream
        ids = []
        for i in range(parsed.max_tokens):
            event = token(i, logprobs=parsed.logprobs)
            await stream.write(encode_event(event))
            ids += event.token_ids
            if scenario == "stall" and i == 1:
                await asyncio.sleep(FOREVER_S)
            if scenario == "error" and i == 1:
                await stream.write(encode_event(ErrorEvent(code="engine_failed", message="shard 3 lost")))
                return stream
            await asyncio.sleep(STEP_S)
        if scenario == "no-final":
            return stream
        await stream.write(encode_event(final(self.key, body, ids)))
        if scenario == "after-final":
            await stream.write(encode_event(token(parsed.max_tokens)))
        return stream

    async def score(self, request: web.Request) -> web.Response:
        body = await self.authenticate(request)
        parsed = parse_score(body)
        positions = parsed.resolved_positions()
        if parsed.request_id == "skip-position":
            positions = positions[1:]
        scores = [
            ScoredPositionMessage(position=p, token_id=parsed.token_ids[p], logprob=-1.0 / p,
                           top=[TopLogprob(token_id=k, logprob=-2.0 - k) for k in range(parsed.top_k)])
            for p in positions
        ]
        answer = ScoreResponse(request_id=parsed.request_id, model_fingerprint="test-fp", scores=scores)
        return web.Response(body=encode_model(answer), content_type="application/json")

    async def capabilities(self, request: web.Request) -> web.Response:
        await self.authenticate(request)
        answer = Capabilities(model_id="kimi-k3-tiny", model_fingerprint="test-fp", vocab_size=1000,
                              max_context=4096, max_concurrent_streams=4, engine="reference",
                              precision="fp32", software_version="0.1.0")
        return web.Response(body=encode_model(answer), content_type="application/json")

    async def health(self, request: web.Request) -> web.Response:
        return web.Response(body=encode_model(Health(status="ok")), content_type="application/json")


@pytest.fixture
async def miner(keys, tmp_path):
    store = SQLiteNonceStore(tmp_path / "nonces.sqlite")
    test_miner = LoopbackMiner(keys["miner"], store)
    runner = web.AppRunner(test_miner.app(), shutdown_timeout=0.2, handler_cancellation=True)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    host, port = runner.addresses[0][:2]
    test_miner.url = f"http://{host}:{port}"
    yield test_miner
    await runner.cleanup()
    store.close()


@pytest.fixture
async def client(keys):
    async with MinerClient(keys["validator"], timeouts=FAST, max_response_bytes=1_000_000) as miner_client:
        yield miner_client


def ask(request_id, max_tokens=4, logprobs=2):
    return GenerateRequest(request_id=request_id, prompt_token_ids=[1, 2, 3], max_tokens=max_tokens,
                           temperature=0.0, logprobs=logprobs)


# ---------------------------------------------------------------- generation
async def test_generate_streams_typed_events_with_arrival_times(keys, miner, client):
    request = ask("ok", max_tokens=5)
    result = await client.generate(miner.url, keys["miner"].ss58_address, request)
    assert result.body == miner.requests[-1] == encode_model(request)  # the bytes signed are the bytes sent
    assert result.token_ids == [10, 11, 12, 13, 14]
    assert result.text == "t0t1t2t3t4"
    assert isinstance(result.final, FinalMessage) and result.final.usage.completion_tokens == 5
    assert [len(timed.event.top_logprobs[0]) for timed in result.token_events] == [2] * 5
    arrivals = result.token_arrivals_s
    assert result.headers_s <= arrivals[0] == result.ttft_s
    gaps = [later - earlier for earlier, later in zip(arrivals, arrivals[1:])]
    assert all(gap >= STEP_S * 0.8 for gap in gaps), gaps  # streamed, not buffered
    assert result.total_s >= arrivals[-1]
    assert verify_final(result.final, result.body, result.token_ids, keys["miner"].ss58_address)


async def test_stream_generate_yields_events_as_they_arrive(keys, miner, client):
    seen = []
    async for timed in client.stream_generate(miner.url, keys["miner"].ss58_address, ask("ok", max_tokens=3)):
        seen.append((type(timed.event).__name__, time.monotonic()))
    assert [name for name, _ in seen] == ["TokenMessage"] * 3 + ["FinalMessage"]
    assert seen[-1][1] - seen[0][1] >= 2 * STEP_S * 0.8


@pytest.mark.parametrize(
    "scenario, kind, timeouts",
    [
        ("delay-headers", "first_byte", ClientTimeouts(connect=1, first_byte=0.4, between_events=5, total=10)),
        ("delay-first-event", "first_byte", ClientTimeouts(connect=1, first_byte=0.4, between_events=5, total=10)),
        ("stall", "between_events", ClientTimeouts(connect=1, first_byte=5, between_events=0.4, total=10)),
        ("trickle", "between_events", ClientTimeouts(connect=1, first_byte=5, between_events=0.4, total=10)),
        ("blank-lines", "first_byte", ClientTimeouts(connect=1, first_byte=0.4, between_events=5, total=10)),
        ("forever", "total", ClientTimeouts(connect=1, first_byte=5, between_events=5, total=0.8)),
    ],
)
async def test_each_timeout_fires_within_its_bound(keys, miner, client, scenario, kind, timeouts):
    started = time.monotonic()
    with pytest.raises(MinerTimeout) as caught:
        await client.generate(miner.url, keys["miner"].ss58_address, ask(scenario), timeouts=timeouts)
    elapsed = time.monotonic() - started
    assert caught.value.kind == kind
    bound = getattr(timeouts, kind)
    if kind == "between_events":
        # measured from the last complete event, which came after a step or two
        assert bound <= elapsed <= bound + 2 * STEP_S + SLACK_S
    else:
        assert bound <= elapsed + 0.01 <= bound + SLACK_S
    if scenario == "stall":
        assert caught.value.partial.token_ids == [10, 11]
    if scenario == "trickle":  # trickled bytes never count as an event
        assert caught.value.partial.token_ids == [10]


async def test_the_first_event_deadline_grows_with_the_prompt(keys, miner, client):
    """first_byte is a floor; the prompt's prefill at prefill_tokens_per_s is added to it, so a long
    prompt served at the allowed rate passes where a flat deadline would cut it off."""
    hotkey = keys["miner"].ss58_address
    prompt = list(range(1, 1601))  # 1600 tokens: 0.64 s at 2500 tokens/s, 1.6 s at 1000

    def asked(scenario):
        return GenerateRequest(request_id=scenario, prompt_token_ids=prompt, max_tokens=2, logprobs=2)

    scaled = ClientTimeouts(connect=1, first_byte=0.3, between_events=5, total=10, prefill_tokens_per_s=2000)
    assert scaled.first_event_s(1600) == pytest.approx(1.1)
    result = await client.generate(miner.url, hotkey, asked("prefill-at-2500"), timeouts=scaled)
    assert result.token_ids == [10, 11] and 0.6 <= result.ttft_s < 1.1
    # the same server with a flat deadline (no prefill allowance) times out at the floor
    flat = ClientTimeouts(connect=1, first_byte=0.3, between_events=5, total=10, prefill_tokens_per_s=math.inf)
    started = time.monotonic()
    with pytest.raises(MinerTimeout) as caught:
        await client.generate(miner.url, hotkey, asked("prefill-at-2500"), timeouts=flat)
    assert caught.value.kind == "first_byte" and 0.3 <= time.monotonic() - started + 0.01 <= 0.3 + SLACK_S
    # a server slower than the allowed rate is cut off at floor + prefill allowance
    started = time.monotonic()
    with pytest.raises(MinerTimeout) as caught:
        await client.generate(miner.url, hotkey, asked("prefill-at-1000"), timeouts=scaled)
    elapsed = time.monotonic() - started
    assert caught.value.kind == "first_byte" and caught.value.limit_s == pytest.approx(1.1)
    assert 1.1 <= elapsed + 0.01 <= 1.1 + SLACK_S
    with pytest.raises(ValueError, match="prefill_tokens_per_s"):
        ClientTimeouts(prefill_tokens_per_s=0)


async def test_connect_timeout(keys):
    # A listening socket whose accept queue is full drops new SYNs: connect hangs.
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(0)
    port = server.getsockname()[1]
    fillers = []
    for _ in range(4):
        filler = socket.socket()
        filler.setblocking(False)
        try:
            filler.connect(("127.0.0.1", port))
        except BlockingIOError:
            pass
        fillers.append(filler)
    await asyncio.sleep(0.1)
    timeouts = ClientTimeouts(connect=0.4, first_byte=5, between_events=5, total=10)
    try:
        async with MinerClient(keys["validator"], timeouts=timeouts) as miner_client:
            started = time.monotonic()
            with pytest.raises(MinerTimeout) as caught:
                await miner_client.health(f"http://127.0.0.1:{port}")
            assert caught.value.kind == "connect"
            assert 0.4 <= time.monotonic() - started + 0.01 <= 0.4 + SLACK_S
    finally:
        for sock in fillers + [server]:
            sock.close()


async def test_refused_connection_is_unreachable(keys):
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    async with MinerClient(keys["validator"], timeouts=FAST) as miner_client:
        with pytest.raises(MinerUnreachable):
            await miner_client.health(f"http://127.0.0.1:{port}")


async def test_maximum_response_size_is_enforced(keys, miner, client):
    started = time.monotonic()
    with pytest.raises(MinerProtocolError, match="larger than 1000000 bytes"):
        await client.generate(miner.url, keys["miner"].ss58_address, ask("huge"))
    assert time.monotonic() - started < 5


@pytest.mark.parametrize(
    "scenario, message",
    [
        ("malformed", "event 2 is malformed"),
        ("bad-schema", "extra: Extra inputs"),
        ("index-gap", "index 2, expected 1"),
        ("no-final", "without a final event"),
        ("after-final", "after the final event"),
        ("wrong-type", "Content-Type"),
    ],
)
async def test_protocol_violations_raise_miner_protocol_error(keys, miner, client, scenario, message):
    with pytest.raises(MinerProtocolError, match=message):
        await client.generate(miner.url, keys["miner"].ss58_address, ask(scenario))


async def test_error_event_raises_with_the_partial_result(keys, miner, client):
    with pytest.raises(MinerStreamError) as caught:
        await client.generate(miner.url, keys["miner"].ss58_address, ask("error"))
    assert (caught.value.code, caught.value.message) == ("engine_failed", "shard 3 lost")
    assert caught.value.partial.token_ids == [10, 11] and caught.value.partial.final is None


async def test_http_errors_are_parsed(keys, miner, client):
    with pytest.raises(MinerHTTPError) as caught:
        await client.generate(miner.url, keys["miner"].ss58_address, ask("over-capacity"))
    assert (caught.value.status, caught.value.code, caught.value.message) == (429, "over_capacity", "all 4 streams busy")
    with pytest.raises(MinerHTTPError) as caught:
        await client.generate(miner.url, keys["miner"].ss58_address, ask("bad-gateway"))
    assert (caught.value.status, caught.value.code) == (502, "unparseable_error")
    # signed for another hotkey: the miner's verifier answers 403
    with pytest.raises(MinerHTTPError) as caught:
        await client.generate(miner.url, keys["other"].ss58_address, ask("ok"))
    assert (caught.value.status, caught.value.code) == (403, "wrong_receiver")
    # a bound the server enforces comes back as a 400 naming the field
    bad = GenerateRequest.model_construct(**{**ask("ok").model_dump(), "temperature": 5.0})
    with pytest.raises(MinerHTTPError) as caught:
        await client.generate(miner.url, keys["miner"].ss58_address, bad)
    assert caught.value.status == 400 and caught.value.message.startswith("temperature")


async def test_many_concurrent_requests_each_get_a_fresh_nonce(keys, miner, client):
    results = await asyncio.gather(
        *[client.generate(miner.url, keys["miner"].ss58_address, ask("ok", max_tokens=1)) for _ in range(20)]
    )
    assert all(result.token_ids == [10] for result in results)


# ---------------------------------------------------------------- JSON endpoints
async def test_score_capabilities_and_health(keys, miner, client):
    miner_ss58 = keys["miner"].ss58_address
    request = ScoreRequest(request_id="audit-1", token_ids=[5, 6, 7, 8], positions=[2, 3], top_k=3)
    answer = await client.score(miner.url, miner_ss58, request)
    assert [(s.position, s.token_id, len(s.top)) for s in answer.scores] == [(2, 7, 3), (3, 8, 3)]
    with pytest.raises(MinerProtocolError, match="requested positions"):
        await client.score(miner.url, miner_ss58, ScoreRequest(request_id="skip-position", token_ids=[5, 6, 7]))
    capabilities = await client.capabilities(miner.url, miner_ss58)
    assert capabilities.engine == "reference" and capabilities.max_context == 4096
    with pytest.raises(MinerHTTPError) as caught:
        await client.capabilities(miner.url, keys["other"].ss58_address)
    assert caught.value.status == 403
    assert (await client.health(miner.url)).status == "ok"


def test_timeouts_must_be_positive():
    with pytest.raises(ValueError, match="between_events"):
        ClientTimeouts(between_events=0)
    with pytest.raises(ValueError, match="total"):
        ClientTimeouts(total=float("inf"))


# ---------------------------------------------------------------- response signatures
BODY = b'{"request_id":"r-9","prompt":"hello","max_tokens":3}'
IDS = [101, 7, 65_000]


def test_token_encoding_is_little_endian_u32():
    assert encode_token_ids([1, 256, 2**32 - 1]) == b"\x01\x00\x00\x00" b"\x00\x01\x00\x00" b"\xff\xff\xff\xff"
    assert encode_token_ids([]) == b""
    with pytest.raises(ValueError):
        encode_token_ids([2**32])
    digest = response_digest(BODY, IDS)
    assert digest == hashlib.sha256(BODY).digest() + hashlib.sha256(encode_token_ids(IDS)).digest()


def test_valid_response_signature_verifies(keys):
    signature = sign_response(keys["miner"], BODY, IDS)
    assert signature.hotkey == keys["miner"].ss58_address
    assert verify_response(signature, BODY, IDS, keys["miner"].ss58_address)


def test_response_signature_fails_on_any_change(keys):
    miner_ss58 = keys["miner"].ss58_address
    signature = sign_response(keys["miner"], BODY, IDS)
    assert not verify_response(signature, BODY, IDS[:-1], miner_ss58)
    assert not verify_response(signature, BODY, [102, 7, 65_000], miner_ss58)
    assert not verify_response(signature, BODY + b" ", IDS, miner_ss58)
    assert not verify_response(signature, BODY, IDS, keys["other"].ss58_address)
    assert not verify_response(signature, BODY, [-1], miner_ss58)
    # hashes rewritten to match other content: the signature no longer covers them
    forged = signature.model_copy(update={"tokens_sha256": response_digest(BODY, [1])[32:].hex()})
    assert not verify_response(forged, BODY, [1], miner_ss58)
    # another hotkey's signature presented under the miner's name
    other = sign_response(keys["other"], BODY, IDS)
    assert not verify_response(other.model_copy(update={"hotkey": miner_ss58}), BODY, IDS, miner_ss58)
    # a signature over the bare digest (no domain prefix) is not a response signature
    bare = keys["miner"].sign(response_digest(BODY, IDS)).hex()
    assert not verify_response(signature.model_copy(update={"signature": bare}), BODY, IDS, miner_ss58)


def test_response_signature_binds_the_answer_to_its_seed(keys):
    """The reported seed is signed: the same answer under another seed, or with its seed left out (or one
    added), no longer verifies, so a miner can neither disown the seed it reported nor have it swapped."""
    miner_ss58 = keys["miner"].ss58_address
    seeded = sign_response(keys["miner"], BODY, IDS, 2**64 - 1)
    assert verify_response(seeded, BODY, IDS, miner_ss58, 2**64 - 1)
    assert not verify_response(seeded, BODY, IDS, miner_ss58, 2**64 - 2)
    assert not verify_response(seeded, BODY, IDS, miner_ss58)  # the seed dropped
    assert not verify_response(seeded, BODY, IDS, miner_ss58, 2**64)  # not a u64
    assert not verify_response(sign_response(keys["miner"], BODY, IDS), BODY, IDS, miner_ss58, 0)  # one added
    with pytest.raises(ValueError, match="seed"):
        sign_response(keys["miner"], BODY, IDS, -1)
