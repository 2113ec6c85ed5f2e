"""The organic gateway on loopback, driven by the official `openai` client, in front of real miners
(in-process MinerServers over the tiny checkpoint's reference engine) that accept the gateway's
signed requests because its hotkey holds a validator permit and stake on a devnet."""
import asyncio
import json
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import openai
import pytest
from hypothesis import given, settings as hypothesis_settings, strategies as st

from chain import connect
from inference.model import ModelConfig
from inference.serving import EngineSettings, GenerationRequest, LocalEngine, SamplingParams, TokenEvent
from localnet.cheats import miner as cheats
from neurons.base.settings import ChainSettings, build_settings, read_options
from neurons.gateway import (ApiKeyFileError, ApiKeys, GatewayServer, GatewaySettings, GatewaySetupError,
                             KeyRateLimiter, MinerTarget, StopTrimmer, gateway_options, read_api_keys)
from neurons.miner_app import AccessSettings, MinerServer, MinerSettings, ServerSettings
from protocol.auth import SQLiteNonceStore
from protocol.client import ClientTimeouts, GenerateResult, MinerClient, MinerUnreachable
from protocol.schemas import Capabilities
from scoring.tier0 import check_tier0

ROOT = Path(__file__).resolve().parent.parent
CONFIG = ModelConfig.tiny()
KEY = "sk-test-organic-0123456789"
OTHER_KEY = "sk-test-second-key-abcdef"
MODEL = "kimi-k3-test"
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour."}]


@pytest.fixture(scope="module")
def world(tmp_path_factory, make_wallets, make_subnet, tiny_reference):
    root = tmp_path_factory.mktemp("gateway")
    model, tokenizer, fingerprint = tiny_reference
    wallets = make_wallets(root / "wallets", ("owner", "validator", "miner_a", "miner_b", "cheater"))
    netuid, _ = make_subnet(root / "devnet.sqlite", wallets, ("validator", "miner_a", "miner_b", "cheater"),
                            {"validator": 1000.0})
    keys = root / "keys.txt"
    keys.write_text(f"# organic users\n{KEY}   # alice\n\n")
    return dict(root=root, model=model, tokenizer=tokenizer, fingerprint=fingerprint, wallets=wallets,
                netuid=netuid, keys=keys)


def cheating_engine(inner, cheat):
    return cheats.CheatingEngine(inner, cheat)


def engine_of(world) -> LocalEngine:
    return LocalEngine(world["model"], world["tokenizer"],
                       EngineSettings(max_context=512, max_concurrent_sequences=4, step_token_budget=256),
                       model_fingerprint=world["fingerprint"], engine_kind="reference")


class Directory:
    """The validator's side of the seam, in its simplest form: a fixed ranking and a log of reports."""

    def __init__(self, targets):
        self.targets = list(targets)
        self.reports = []
        self.verdicts = []  # the gateway's tier-0 failures per report (None for an error)

    def ranked_miners(self):
        return list(self.targets)

    def record_organic(self, *, uid, hotkey, outcome, prompt_ids, tier0, tier0_cpu_s):
        self.reports.append((uid, hotkey, outcome, list(prompt_ids)))
        self.verdicts.append(tier0)
        assert (tier0 is None) == (tier0_cpu_s is None) and (tier0_cpu_s is None or tier0_cpu_s >= 0)


class AsyncDirectory(Directory):
    """A directory that reads its ranking asynchronously (e.g. from the validator's database)."""

    async def ranked_miners(self):
        await asyncio.sleep(0)
        return list(self.targets)


@pytest.fixture
async def subnet(world, tmp_path):
    """Start miners and a gateway in-process; everything is closed at the end of the test."""
    started, gateways = [], []
    client = MinerClient(world["wallets"]["validator"],
                         ClientTimeouts(connect=1.0, first_byte=20.0, between_events=10.0, total=60.0))

    async def miner(name: str, uid: int, score: float, cheat: str | None = None) -> MinerTarget:
        engine = engine_of(world)
        if cheat:
            engine = cheating_engine(engine, cheat)
        settings = MinerSettings(
            chain=ChainSettings(network=f"devnet:{world['root'] / 'devnet.sqlite'}", netuid=world["netuid"],
                                timeout_s=2.0),
            server=ServerSettings(host="127.0.0.1", port=0, publish=False, metrics=False,
                                  nonce_store=str(tmp_path / f"{name}-nonces.sqlite"), shutdown_grace_s=0.0),
            access=AccessSettings(min_validator_stake=5.0, requests_per_window=100_000),
        )
        chain = connect(settings.chain.network)
        server = MinerServer(settings, engine=engine, tokenizer=world["tokenizer"], chain=chain,
                             wallet=world["wallets"][name], nonce_store=SQLiteNonceStore(settings.server.nonce_store))
        started.append((server, chain))
        await server.start()
        return MinerTarget(uid=uid, hotkey=server.hotkey, url=server.url, score=score)

    async def gateway(directory, **overrides) -> GatewayServer:
        values = dict(enabled=True, host="127.0.0.1", port=0, api_keys_file=str(world["keys"]), model_name=MODEL,
                      default_max_tokens=6,
                      miner_timeouts=ClientTimeouts(first_byte=20.0, between_events=15.0, total=60.0))
        values.update(overrides)
        server = GatewayServer(directory, client, world["tokenizer"], GatewaySettings(**values))
        gateways.append(server)
        await server.start()
        return server

    async def stop(target: MinerTarget) -> None:
        for server, _ in started:
            if server.hotkey == target.hotkey:
                await server.close(grace_s=0.0)

    yield miner, gateway, stop
    for server in gateways:
        await server.close()
    for server, chain in started:
        await server.close(grace_s=0.0)
        await chain.close()
    await client.close()


def openai_client(gateway: GatewayServer, key: str = KEY) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=gateway.url + "/v1", api_key=key, max_retries=0, timeout=60.0)


def tier0(world, target: MinerTarget, result: GenerateResult):
    caps = Capabilities(model_id=CONFIG.model_id, model_fingerprint=world["fingerprint"], vocab_size=CONFIG.vocab_size,
                        max_context=512, max_concurrent_streams=4, engine="reference", precision="float32",
                        software_version="test")
    return check_tier0(None, result, world["tokenizer"], caps, target.hotkey)


async def greedy_reference(world, prompt_ids: list[int], max_tokens: int) -> list[int]:
    """The same prompt on a plain engine run in this process: what the miner must have produced."""
    async with engine_of(world) as engine:
        stream = engine.generate(GenerationRequest(prompt_ids, SamplingParams(max_tokens=max_tokens, temperature=0.0)))
        return [event.token_id async for event in stream if isinstance(event, TokenEvent)]


# ---------------------------------------------------------------- the happy path
async def test_chat_and_completions_streamed_and_whole_through_the_openai_client(world, subnet):
    start_miner, start_gateway, _ = subnet
    best = await start_miner("miner_a", uid=1, score=0.9)
    second = await start_miner("miner_b", uid=2, score=0.5)
    directory = Directory([best, second])
    gateway = await start_gateway(directory)
    tokenizer = world["tokenizer"]
    prompt_ids = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True)
    expected_ids = await greedy_reference(world, prompt_ids, 6)
    expected_text = tokenizer.decode(expected_ids, skip_special_tokens=True)

    async with openai_client(gateway) as client:
        raw = await client.chat.completions.with_raw_response.create(
            model=MODEL, messages=MESSAGES, max_tokens=6, temperature=0, logprobs=True, top_logprobs=2)
        chat = raw.parse()
        assert raw.headers["x-k3-miner-uid"] == "1"  # the best miner served it
        assert chat.choices[0].message.content == expected_text
        assert chat.choices[0].finish_reason in ("stop", "length")
        assert chat.usage.prompt_tokens == len(prompt_ids)
        assert chat.usage.completion_tokens == len(expected_ids) and chat.usage.total_tokens == len(prompt_ids) + len(
            expected_ids)
        assert chat.system_fingerprint == world["fingerprint"]
        lps = chat.choices[0].logprobs.content
        assert len(lps) == len(expected_ids) and all(len(t.top_logprobs) == 2 for t in lps)
        assert all(t.logprob == pytest.approx(t.top_logprobs[0].logprob, abs=1e-4) for t in lps)  # greedy

        stream = await client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=6, temperature=0,
                                                      stream=True, stream_options={"include_usage": True},
                                                      logprobs=True, top_logprobs=1)
        chunks = [chunk async for chunk in stream]
        assert chunks[0].choices[0].delta.role == "assistant"
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == expected_text
        streamed_lps = [t for c in chunks if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.content]
        assert [t.logprob for t in streamed_lps] == pytest.approx([t.logprob for t in lps], abs=1e-6)
        assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == [
            chat.choices[0].finish_reason]
        assert chunks[-1].usage.completion_tokens == len(expected_ids) and not chunks[-1].choices

        text_prompt = "The harbour at dawn"
        completion = await client.completions.create(model=MODEL, prompt=text_prompt, max_tokens=5, temperature=0,
                                                     logprobs=1)
        completion_ids = await greedy_reference(world, tokenizer.encode(text_prompt), 5)
        assert completion.choices[0].text == tokenizer.decode(completion_ids, skip_special_tokens=True)
        assert completion.usage.prompt_tokens == len(tokenizer.encode(text_prompt))
        assert len(completion.choices[0].logprobs.token_logprobs) == completion.usage.completion_tokens

        # Streamed, with a stop string that the greedy answer contains: the answer ends before it, as OpenAI's do.
        text = completion.choices[0].text
        stop = next(c for i, c in enumerate(text) if i > 0 and c.isascii() and c.isalpha() and text.index(c) == i)
        pieces, reasons = [], []
        async for chunk in await client.completions.create(model=MODEL, prompt=tokenizer.encode(text_prompt),
                                                           max_tokens=5, temperature=0, stream=True, stop=[stop],
                                                           logprobs=1):
            pieces.append(chunk.choices[0].text)
            reasons.append(chunk.choices[0].finish_reason)
            if chunk.choices[0].logprobs is not None:
                assert len(chunk.choices[0].logprobs.tokens) == len(chunk.choices[0].logprobs.token_logprobs) == 1
        assert "".join(pieces) == text[:text.index(stop)] and reasons[-1] == "stop"

        models = await client.models.list()
        assert [m.id for m in models.data] == [MODEL]
        assert (await client.models.retrieve(MODEL)).id == MODEL

    # Every attempt reached the validator's hook: the best miner's signed, tier-0-clean generations.
    assert [(uid, hotkey) for uid, hotkey, _, _ in directory.reports] == [(1, best.hotkey)] * 4
    assert directory.reports[0][3] == prompt_ids and directory.reports[2][3] == tokenizer.encode(text_prompt)
    for uid, hotkey, outcome, _ in directory.reports:
        assert isinstance(outcome, GenerateResult) and tier0(world, best, outcome) == []
    assert directory.verdicts == [[]] * 4  # tier 0 ran once, in the gateway, and its verdict came along


async def test_keys_rate_limits_and_bad_requests_get_openai_style_errors(world, subnet, tmp_path, free_port):
    start_miner, start_gateway, _ = subnet
    keys = tmp_path / "keys.txt"
    keys.write_text(KEY + "\n")
    directory = Directory([MinerTarget(uid=9, hotkey=world["wallets"]["miner_a"].hotkey.ss58_address,
                                       url=f"http://127.0.0.1:{free_port()}", score=1.0)])
    gateway = await start_gateway(directory, api_keys_file=str(keys), rate_limit_requests=3,
                                  rate_limit_window_s=600.0)
    async with openai_client(gateway, key="sk-not-a-valid-key-0000") as bad:
        with pytest.raises(openai.AuthenticationError) as caught:
            await bad.chat.completions.create(model=MODEL, messages=MESSAGES)
        assert caught.value.status_code == 401 and caught.value.code == "invalid_api_key"

    # The key file is re-read when it changes: a new key works at once, a removed one no longer does.
    async with openai_client(gateway, key=OTHER_KEY) as newcomer:
        with pytest.raises(openai.AuthenticationError):
            await newcomer.models.list()
        keys.write_text(f"{OTHER_KEY}  # bob\n")
        assert [m.id for m in (await newcomer.models.list()).data] == [MODEL]
    async with openai_client(gateway) as old:
        with pytest.raises(openai.AuthenticationError):
            await old.models.list()

    async with aiohttp.ClientSession() as session:
        async def post(path, body, key=OTHER_KEY):
            async with session.post(gateway.url + path, data=json.dumps(body),
                                    headers={"Authorization": f"Bearer {key}"}) as response:
                return response.status, await response.json(), response.headers

        status, body, _ = await post("/v1/chat/completions", {"model": MODEL, "messages": MESSAGES, "n": 2})
        assert status == 400 and body["error"]["param"] == "n" and body["error"]["type"] == "invalid_request_error"
        status, body, _ = await post("/v1/chat/completions", {"model": MODEL, "messages": MESSAGES, "tools": []})
        assert status == 400 and body["error"]["code"] == "unsupported_parameter"
        # The fourth request in the window is over the limit of 3: 429 with Retry-After, before parsing.
        status, body, _ = await post("/v1/completions", {"model": "gpt-4", "prompt": "x"})
        assert status == 404 and body["error"]["code"] == "model_not_found"
        status, body, headers = await post("/v1/completions", {"model": MODEL, "prompt": [CONFIG.vocab_size]})
        assert status == 429 and body["error"]["code"] == "rate_limit_exceeded" and int(headers["Retry-After"]) >= 1
        async with session.post(gateway.url + "/v1/completions", data=b"{}") as response:
            assert response.status == 401 and "Bearer" in (await response.json())["error"]["message"]
    assert directory.reports == []  # nothing invalid reached a miner


async def test_bad_values_are_400_and_an_oversized_request_does_not_reach_a_miner(world, subnet, free_port):
    start_miner, start_gateway, _ = subnet
    directory = Directory([MinerTarget(uid=9, hotkey=world["wallets"]["miner_a"].hotkey.ss58_address,
                                       url=f"http://127.0.0.1:{free_port()}", score=1.0)])
    gateway = await start_gateway(directory, max_tokens_cap=100)
    async with openai_client(gateway) as client:
        for kwargs in (dict(temperature=3.0), dict(max_tokens=101), dict(stop=["a", "b", "c", "d", "e"]),
                       dict(presence_penalty=0.5), dict(top_p=0.0)):
            with pytest.raises(openai.BadRequestError):
                await client.chat.completions.create(model=MODEL, messages=MESSAGES, **kwargs)
        with pytest.raises(openai.BadRequestError) as caught:
            await client.completions.create(model=MODEL, prompt=[1, 2, CONFIG.vocab_size])
        assert "vocabulary" in caught.value.message
        with pytest.raises(openai.BadRequestError):
            await client.chat.completions.create(model=MODEL, messages=[{"role": "tool", "content": "x"}])
    assert directory.reports == []


# ---------------------------------------------------------------- failover
async def test_failover_past_an_unreachable_miner_and_a_stopped_one(world, subnet, free_port):
    start_miner, start_gateway, stop_miner = subnet
    a = await start_miner("miner_a", uid=1, score=0.8)
    b = await start_miner("miner_b", uid=2, score=0.7)
    dead = MinerTarget(uid=7, hotkey=world["wallets"]["cheater"].hotkey.ss58_address,
                       url=f"http://127.0.0.1:{free_port()}", score=1.0)
    directory = AsyncDirectory([dead, a, b])
    gateway = await start_gateway(directory)
    async with openai_client(gateway) as client:
        raw = await client.chat.completions.with_raw_response.create(model=MODEL, messages=MESSAGES, max_tokens=4,
                                                                     temperature=0)
        assert raw.headers["x-k3-miner-uid"] == "1" and raw.parse().usage.completion_tokens >= 1
        # The dead one failed before any generation (its capabilities could not be read): nothing to record.
        assert [(uid, type(o)) for uid, _, o, _ in directory.reports] == [(1, GenerateResult)]

        await stop_miner(a)  # the best live miner goes away: streaming still works, from the next one
        directory.reports.clear()
        stream = await client.chat.completions.with_raw_response.create(
            model=MODEL, messages=MESSAGES, max_tokens=4, temperature=0, stream=True)
        assert stream.headers["x-k3-miner-uid"] == "2"
        text = "".join([c.choices[0].delta.content or "" async for c in stream.parse() if c.choices])
        assert text == raw.parse().choices[0].message.content  # the same model, greedy
        assert [(uid, type(o)) for uid, _, o, _ in directory.reports] == [(1, MinerUnreachable), (2, GenerateResult)]

        await stop_miner(b)  # nobody left: a clear 502, not a hang
        with pytest.raises(openai.InternalServerError) as caught:
            await client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=4)
        assert caught.value.status_code == 502


async def test_a_tier0_failure_fails_over_before_the_first_byte_and_ends_a_started_stream(world, subnet):
    start_miner, start_gateway, _ = subnet
    cheater = await start_miner("cheater", uid=3, score=1.0, cheat="inflate")  # reports more tokens than sent
    honest = await start_miner("miner_b", uid=2, score=0.5)
    directory = Directory([cheater, honest])
    gateway = await start_gateway(directory)
    async with openai_client(gateway) as client:
        raw = await client.chat.completions.with_raw_response.create(model=MODEL, messages=MESSAGES, max_tokens=4)
        assert raw.headers["x-k3-miner-uid"] == "2"
        (uid, _, outcome, _), (uid2, _, outcome2, _) = directory.reports
        assert uid == 3 and uid2 == 2
        failures = tier0(world, cheater, outcome)  # what made the gateway move on, as the validator sees it
        assert {f.check for f in failures} == {"usage_completion"} and all(f.hard for f in failures)
        assert tier0(world, honest, outcome2) == []
        assert directory.verdicts == [failures, []]  # the validator gets the gateway's verdict, not a rerun

        # Streaming from the cheater alone: its tokens flow, then verification fails at the end and the
        # stream ends with an error chunk that the client raises.
        directory.targets = [cheater]
        received = []
        with pytest.raises(openai.APIError) as caught:
            async for chunk in await client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=4,
                                                                    stream=True):
                received.append(chunk)
        assert received and received[0].choices[0].delta.role == "assistant"
        assert "verification" in caught.value.message and "usage_completion" in caught.value.message


# ---------------------------------------------------------------- pieces
def naive_cut(text: str, stops: list[str]) -> str:
    hits = [text.find(s) for s in stops if s in text]
    return text[:min(hits)] if hits else text


@hypothesis_settings(max_examples=200, deadline=None)
@given(st.text(alphabet="abc", max_size=30), st.lists(st.text(alphabet="abc", min_size=1, max_size=4), max_size=3),
       st.lists(st.integers(0, 30), max_size=6))
def test_stop_trimming_in_pieces_equals_cutting_the_whole_text(text, stops, cuts):
    trimmer = StopTrimmer(stops)
    bounds = sorted({0, len(text), *[min(c, len(text)) for c in cuts]})
    out = "".join(trimmer.push(text[a:b]) for a, b in zip(bounds, bounds[1:])) + trimmer.flush()
    assert out == naive_cut(text, stops)


@dataclass(frozen=True)
class SettingsHolder:
    gateway: GatewaySettings = field(default_factory=GatewaySettings)


def test_key_files_flags_and_rate_buckets(tmp_path):
    path = tmp_path / "keys"
    path.write_text("# comment\nsk-aaaaaaaaaa\n  sk-bbbbbbbbbb # note\n")
    assert read_api_keys(path) == {"sk-aaaaaaaaaa", "sk-bbbbbbbbbb"}
    keys = ApiKeys(path)
    assert keys.check("sk-aaaaaaaaaa") and keys.check("sk-bbbbbbbbbb") and not keys.check("sk-cccccccccc")
    path.write_text("sk-aaaaaaaaaa sk-bbbbbbbbbb\n")  # a bad edit keeps the last good keys
    assert keys.check("sk-bbbbbbbbbb") and keys.reload_error and ":1:" in keys.reload_error
    path.write_text("short\n")
    with pytest.raises(ApiKeyFileError, match="at least"):
        ApiKeys(path)
    with pytest.raises(ApiKeyFileError, match="cannot read"):
        ApiKeys(tmp_path / "missing")
    with pytest.raises(GatewaySetupError, match="--gateway-api-keys"):
        GatewayServer(Directory([]), None, None, GatewaySettings(enabled=True))

    # The flags the validator's entry point takes over (dest "gateway.*"), flag over environment.
    values = read_options(gateway_options(), ["--gateway", "--gateway-port", "0", "--gateway-api-keys", str(path)],
                          environ={"K3_GATEWAY_RATE_LIMIT": "5", "K3_GATEWAY_PORT": "9"})
    holder = build_settings(SettingsHolder, values)
    assert holder.gateway.enabled and holder.gateway.port == 0 and holder.gateway.rate_limit_requests == 5
    assert holder.gateway.api_keys_file == str(path) and holder.gateway.problems() == []

    limiter = KeyRateLimiter(2, 10.0)
    assert limiter.take("k", now=0.0) is None and limiter.take("k", now=0.0) is None
    assert limiter.take("k", now=0.0) == pytest.approx(5.0)
    assert limiter.take("other", now=0.0) is None
    assert limiter.take("k", now=5.0) is None
