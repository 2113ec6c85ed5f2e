"""Verification tiers against real generations: a loopback HTTP miner over a LocalEngine running
the tiny model, the real MinerClient, real sr25519 response signatures."""
import asyncio
import dataclasses
import random
from contextlib import asynccontextmanager

import pytest
from aiohttp import web
from bittensor.sp_core import Keypair

from inference.model import ByteTokenizer, KimiK3Model, ModelConfig
from inference.serving import EngineSettings, FinalEvent as EngineFinal, GenerationRequest, LocalEngine, SamplingParams
from protocol.client import ClientTimeouts, GenerateResult, MinerClient, TimedEvent
from protocol.schemas import (GENERATE_PATH, NDJSON_CONTENT_TYPE, SCORE_PATH, Capabilities, FinalMessage,
                              GenerateRequest, ScoredPositionMessage, ScoreResponse, Timings, TokenMessage, TopLogprob,
                              Usage, encode_event, encode_model, parse_generate, parse_score)
from protocol.signature import sign_response
from scoring import corpus
from scoring.audit_sequence import AuditSequence, check_answer, verify_item
from scoring.auditors import AuditorCandidate
from scoring.canaries import Canary, CanaryPool, CanaryPoolError, check_tier2
from scoring.config import ScoringConfig
from scoring.tier0 import check_tier0
from scoring.tier1 import (ConsensusReference, MinerScoreReference, ReferenceDisagreement, audit_tier1,
                           outside_top_k_bound)
from scoring.workloads import Expectation, WorkItem, canary_item

MODEL = ModelConfig.tiny()
FINGERPRINT = "tiny-fp"
# Short canaries and outputs keep the module fast; every check still runs at its real thresholds.
CONFIG = ScoringConfig.local_testnet(canary_tokens=24, chat_max_tokens=(24, 24), copy_text_tokens=(8, 16))
CAPS = Capabilities(model_id=MODEL.model_id, model_fingerprint=FINGERPRINT, vocab_size=MODEL.vocab_size,
                    max_context=16384, max_concurrent_streams=8, engine="reference", precision="fp32",
                    software_version="0.1.0")
TIMEOUTS = ClientTimeouts(connect=3, first_byte=60, between_events=30, total=120)


@pytest.fixture(scope="module")
def tokenizer():
    return ByteTokenizer.from_config(MODEL)


@pytest.fixture(scope="module")
def models():
    return {"honest": KimiK3Model(MODEL, seed=0).eval(), "other": KimiK3Model(MODEL, seed=1).eval()}


@pytest.fixture(scope="module")
def keys():
    return {name: Keypair.create_from_mnemonic(Keypair.generate_mnemonic()) for name in ("miner", "validator", "other")}


class EosBias:
    """The model with a constant added to the end-of-sequence logit: +b makes a model that
    wants to stop; -1e4 a miner that never stops (it is paid per token)."""

    def __init__(self, base, eos_id: int, bias: float):
        self.base, self.eos_id, self.bias = base, eos_id, bias
        self.config = base.config

    def new_cache(self):
        return self.base.new_cache()

    def forward(self, token_ids, caches, all_logits=False):
        outs = self.base.forward(token_ids, caches, all_logits=all_logits)
        for out in outs:
            out[..., self.eos_id] += self.bias
        return outs


def engine_for(model, tokenizer):
    return LocalEngine(model, tokenizer, EngineSettings(max_context=16384, step_token_budget=1024),
                       model_fingerprint=FINGERPRINT)


class EngineMiner:
    """What neurons/miner.py does, in brief (no btauth check: the client side is under test),
    plus one way to cheat: generate from only the last `truncate_to` prompt tokens."""

    def __init__(self, engine, tokenizer, key, truncate_to=None):
        self.engine, self.tokenizer, self.key, self.truncate_to = engine, tokenizer, key, truncate_to

    async def generate(self, request: web.Request) -> web.StreamResponse:
        body = await request.read()
        ask = parse_generate(body)
        prompt = ask.prompt_token_ids or self.tokenizer.encode(ask.prompt, add_bos=ask.add_special_tokens)
        used = prompt[-self.truncate_to:] if self.truncate_to else prompt
        params = SamplingParams(max_tokens=ask.max_tokens, temperature=ask.temperature, top_p=ask.top_p,
                                top_k=ask.top_k, seed=ask.seed, stop=tuple(ask.stop), logprobs=ask.logprobs)
        stream = web.StreamResponse(headers={"Content-Type": NDJSON_CONTENT_TYPE})
        await stream.prepare(request)
        tokens = []
        async for event in self.engine.generate(GenerationRequest(list(used), params, ask.request_id)):
            if isinstance(event, EngineFinal):
                final = FinalMessage(
                    finish_reason=event.finish_reason,
                    usage=Usage(prompt_tokens=len(prompt), completion_tokens=len(tokens)),
                    timings=Timings(queue_ms=event.queue_ms, ttft_ms=event.ttft_ms or 0.0, total_ms=event.total_ms),
                    model_fingerprint=FINGERPRINT, signature=sign_response(self.key, body, tokens))
                await stream.write(encode_event(final))
            else:
                tokens.append(event.token_id)
                top = [TopLogprob(token_id=i, logprob=min(lp, 0.0)) for i, lp in event.top_logprobs]
                await stream.write(encode_event(TokenMessage(index=event.index, token_ids=[event.token_id], text=event.text,
                                                           logprobs=[min(event.logprob, 0.0)], top_logprobs=[top])))
        return stream

    async def score(self, request: web.Request) -> web.Response:
        ask = parse_score(await request.read())
        scored = await self.engine.score(ask.token_ids, ask.positions, ask.top_k)
        answer = ScoreResponse(request_id=ask.request_id, model_fingerprint=FINGERPRINT, scores=[
            ScoredPositionMessage(position=s.position, token_id=s.token_id, logprob=min(s.logprob, 0.0),
                           top=[TopLogprob(token_id=i, logprob=min(lp, 0.0)) for i, lp in s.top]) for s in scored])
        return web.Response(body=encode_model(answer), content_type="application/json")


@asynccontextmanager
async def serving(model, tokenizer, key, **cheats):
    """An engine over `model` behind a loopback HTTP miner; yields (url, engine)."""
    async with engine_for(model, tokenizer) as engine:
        miner = EngineMiner(engine, tokenizer, key, **cheats)
        app = web.Application()
        app.router.add_post(GENERATE_PATH, miner.generate)
        app.router.add_post(SCORE_PATH, miner.score)
        runner = web.AppRunner(app, shutdown_timeout=0.2)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        host, port = runner.addresses[0][:2]
        try:
            yield f"http://{host}:{port}", engine
        finally:
            await runner.cleanup()


def chat_item(tokenizer, seed, prompt_chars=300, max_tokens=64, temperature=0.7, kind="chat", expect=None):
    rng = random.Random(seed)
    text = "Summarise the following text.\n\n" + "\n\n".join(corpus.paragraphs(rng, prompt_chars))
    ids = tokenizer.apply_chat_template([{"role": "user", "content": text}])
    request = GenerateRequest(request_id=f"{rng.getrandbits(128):032x}", prompt_token_ids=ids, max_tokens=max_tokens,
                              temperature=temperature, seed=rng.getrandbits(63), logprobs=5)
    return WorkItem(kind, request, tuple(ids), expect or Expectation())


async def generate(url, keys, item):
    async with MinerClient(keys["validator"], timeouts=TIMEOUTS) as client:
        return await client.generate(url, keys["miner"].ss58_address, item.request)


TRUNCATE_TO = 32
EOS_BIAS = 12.0


def items(tokenizer) -> dict[str, WorkItem]:
    return {
        "greedy": chat_item(tokenizer, seed=2, max_tokens=20, temperature=0.0),
        "hot": chat_item(tokenizer, seed=3, max_tokens=32, temperature=1.0),
        "long": chat_item(tokenizer, seed=4, prompt_chars=1500, max_tokens=24, temperature=0.0),
        "eos": chat_item(tokenizer, seed=5, max_tokens=16, temperature=0.5),
    }


async def generate_all(models, tokenizer, keys):
    """Every miner-side generation of this module, run concurrently so the engines batch them."""
    work = items(tokenizer)
    eos = tokenizer.eos_id
    prompts = [list(chat_item(tokenizer, seed=s).prompt_ids) for s in (7, 8)]
    async with serving(models["honest"], tokenizer, keys["miner"]) as (honest, reference), \
            serving(models["other"], tokenizer, keys["miner"]) as (other, _), \
            serving(models["honest"], tokenizer, keys["miner"], truncate_to=TRUNCATE_TO) as (truncating, _), \
            serving(EosBias(models["honest"], eos, -1e4), tokenizer, keys["miner"]) as (never_stops, _), \
            serving(EosBias(models["honest"], eos, EOS_BIAS), tokenizer, keys["miner"]) as (wants_to_stop, _):
        jobs = {
            "greedy": generate(honest, keys, work["greedy"]),
            "hot": generate(honest, keys, work["hot"]),
            "hot_other": generate(other, keys, work["hot"]),
            "truncated": generate(truncating, keys, work["long"]),
            "eos_avoided": generate(never_stops, keys, work["eos"]),
            "eos_honest": generate(wants_to_stop, keys, work["eos"]),
            "pool": CanaryPool.from_engine(reference, prompts, CONFIG, model_fingerprint=FINGERPRINT),
        }
        done = dict(zip(jobs, await asyncio.gather(*jobs.values())))
        canary = done["pool"].take(random.Random(0))
        canary_work = canary_item(random.Random(1), canary, CAPS, CONFIG, tokenizer)
        done["canary_item"], done["canary"] = canary_work, canary
        done["canary_honest"], done["canary_other"] = await asyncio.gather(
            generate(honest, keys, canary_work), generate(other, keys, canary_work))
    return work, done


@pytest.fixture(scope="module")
def runs(models, tokenizer, keys):
    # Plain data (items and results) outlives this event loop; each test audits in its own.
    return asyncio.run(generate_all(models, tokenizer, keys))


def with_events(result: GenerateResult, tokens, final=None) -> GenerateResult:
    """The result with other token events (and final event), the final arriving when it did."""
    final = final or result.final
    return dataclasses.replace(result, events=list(tokens) + [TimedEvent(final, result.events[-1].arrived_s)],
                               final=final)


def token_events(result):
    return [t for t in result.events if isinstance(t.event, TokenMessage)]


def checks(failures):
    return {f.check for f in failures}


# ------------------------------------------------------------------ tier 0
def test_tier0_passes_honest_and_catches_each_doctoring(runs, tokenizer, keys):
    work, done = runs
    item, result = work["hot"], done["hot"]
    miner = keys["miner"].ss58_address
    n = len(result.token_ids)
    assert check_tier0(item, result, tokenizer, CAPS, miner, CONFIG) == []
    assert check_tier0(None, result, tokenizer, CAPS, miner, CONFIG) == []  # counts the prompt itself

    # Inflated usage: hard. Under-reported: soft.
    final = result.final
    inflated = final.model_copy(update={"usage": Usage(prompt_tokens=final.usage.prompt_tokens,
                                                       completion_tokens=n + 3)})
    failures = check_tier0(item, with_events(result, token_events(result), inflated), tokenizer, CAPS, miner, CONFIG)
    assert [(f.check, f.hard) for f in failures] == [("usage_completion", True)]
    short = final.model_copy(update={"usage": Usage(prompt_tokens=final.usage.prompt_tokens - 1, completion_tokens=n)})
    failures = check_tier0(item, with_events(result, token_events(result), short), tokenizer, CAPS, miner, CONFIG)
    assert [(f.check, f.hard) for f in failures] == [("usage_prompt", False)]

    # Missing alternatives on one token.
    events = token_events(result)
    first = events[3].event
    events[3] = TimedEvent(first.model_copy(update={"top_logprobs": [first.top_logprobs[0][:2]]}), events[3].arrived_s)
    assert checks(check_tier0(item, with_events(result, events), tokenizer, CAPS, miner, CONFIG)) == {"logprobs_missing"}

    # Buffered: every token arrives in the last moments of the call. This stream has 32 tokens, so
    # the detector's 60-token minimum is lowered to make it apply (to the honest stream too).
    total = result.total_s
    detector = CONFIG.replace(buffering_min_tokens=n - 1, long_context_max_tokens=(8, 16))
    assert check_tier0(item, result, tokenizer, CAPS, miner, detector) == []
    buffered = [TimedEvent(t.event, total * 0.9 + 0.0001 * k) for k, t in enumerate(token_events(result))]
    failures = check_tier0(item, with_events(result, buffered), tokenizer, CAPS, miner, detector)
    assert [(f.check, f.hard) for f in failures] == [("buffered_stream", True)]
    assert check_tier0(item, with_events(result, buffered), tokenizer, CAPS, miner, CONFIG) == []  # too short

    # Signature by another key, or over other tokens.
    forged = final.model_copy(update={"signature": sign_response(keys["other"], result.body, result.token_ids)})
    failures = check_tier0(item, with_events(result, token_events(result), forged), tokenizer, CAPS, miner, CONFIG)
    assert [(f.check, f.hard) for f in failures] == [("signature", True)]
    events = token_events(result)
    swapped = events[0].event.model_copy(update={"token_ids": [(events[0].event.token_ids[0] + 1) % 256]})
    events[0] = TimedEvent(swapped, events[0].arrived_s)
    assert "signature" in checks(check_tier0(item, with_events(result, events), tokenizer, CAPS, miner, CONFIG))

    # More tokens than max_tokens (re-signed by the miner itself): hard.
    extra = token_events(result)[-1].event.model_copy(update={"index": n})
    longer = token_events(result) + [TimedEvent(extra, total)]
    ids = [t for e in longer for t in e.event.token_ids]
    over = final.model_copy(update={"usage": Usage(prompt_tokens=item.prompt_tokens, completion_tokens=n + 1),
                                    "signature": sign_response(keys["miner"], result.body, ids)})
    failures = check_tier0(item, with_events(result, longer, over), tokenizer, CAPS, miner, CONFIG)
    assert ("max_tokens", True) in [(f.check, f.hard) for f in failures]

    # A model fingerprint other than the declared one.
    renamed = final.model_copy(update={"model_fingerprint": "another-model"})
    failures = check_tier0(item, with_events(result, token_events(result), renamed), tokenizer, CAPS, miner, CONFIG)
    assert [(f.check, f.hard) for f in failures] == [("fingerprint", False)]


def test_tier0_greedy_token_must_be_the_miners_own_top1(runs, tokenizer, keys):
    work, done = runs
    item, result = work["greedy"], done["greedy"]
    miner = keys["miner"].ss58_address
    assert check_tier0(item, result, tokenizer, CAPS, miner, CONFIG) == []
    # The miner streams its second choice at position 2, with that token's logprob, and signs it.
    events = token_events(result)
    event = events[2].event
    second = event.top_logprobs[0][1]
    events[2] = TimedEvent(event.model_copy(update={"token_ids": [second.token_id], "logprobs": [second.logprob]}),
                           events[2].arrived_s)
    ids = [t for e in events for t in e.event.token_ids]
    resigned = result.final.model_copy(update={"signature": sign_response(keys["miner"], result.body, ids)})
    failures = check_tier0(item, with_events(result, events, resigned), tokenizer, CAPS, miner, CONFIG)
    assert checks(failures) == {"greedy_not_top1"}
    # The same tokens are fine when the request was sampled.
    sampled_request = item.request.model_copy(update={"temperature": 0.5})
    sampled = dataclasses.replace(with_events(result, events, resigned), request=sampled_request)
    sampled_item = dataclasses.replace(item, request=sampled_request)
    assert "greedy_not_top1" not in checks(check_tier0(sampled_item, sampled, tokenizer, CAPS, miner, CONFIG))


# ------------------------------------------------------------------ tier 1
async def test_tier1_honest_generation_passes_with_full_quality(runs, models, tokenizer):
    work, done = runs
    item, result = work["hot"], done["hot"]
    async with engine_for(models["honest"], tokenizer) as reference:
        audit = await audit_tier1(item.prompt_ids, result, reference, CONFIG, stop_ids=tokenizer.stop_ids,
                                  rng=random.Random(0))
        # The spec's literal rule (no sampling allowance) fails this honest temperature-1 answer.
        literal = await audit_tier1(item.prompt_ids, result, reference,
                                    CONFIG.replace(outside_top_k_sampling_sigmas=None), stop_ids=tokenizer.stop_ids)
    assert audit.passed is True and audit.failures == []
    assert audit.quality == 1.0 and audit.mean_prob_diff < 1e-4
    assert audit.quality_positions == min(len(result.token_ids), CONFIG.quality_sample_positions) >= 16
    assert audit.outside_top_k > CONFIG.max_outside_top_k  # sampled tokens do leave the top-10 ...
    assert audit.outside_top_k <= CONFIG.max_outside_top_k + audit.outside_allowance  # ... as often as expected
    assert literal.passed is False and checks(literal.failures) == {"outside_top_k"}


async def test_tier1_other_weights_fail(runs, models, tokenizer, keys):
    work, done = runs
    item, result = work["hot"], done["hot_other"]
    assert check_tier0(item, result, tokenizer, CAPS, keys["miner"].ss58_address, CONFIG) == []  # self-consistent
    async with engine_for(models["honest"], tokenizer) as reference:
        audit = await audit_tier1(item.prompt_ids, result, reference, CONFIG, stop_ids=tokenizer.stop_ids)
    assert audit.passed is False
    assert "outside_top_k" in checks(audit.failures)
    assert audit.quality < 0.5
    # sampled, yet its logprobs are nats away from the reference's: far outside the honest-numerics
    # envelope, so hard on the validator's own reference at any temperature
    assert audit.hard and "logprob_gap" in checks(f for f in audit.failures if f.hard)


async def test_tier1_truncated_context_fails(runs, models, tokenizer):
    """The miner kept only the last 32 of 1500+ prompt tokens; teacher-forced on the whole prompt, its
    greedy tokens stop being the reference's top-1 (the random tiny model barely depends on far
    context, so its probabilities move little and the greedy rule is what decides)."""
    work, done = runs
    item, result = work["long"], done["truncated"]
    assert item.prompt_tokens > 1500 and len(result.token_ids) >= 16
    async with engine_for(models["honest"], tokenizer) as reference:
        audit = await audit_tier1(item.prompt_ids, result, reference, CONFIG, stop_ids=tokenizer.stop_ids)
        honest = await audit_tier1(item.prompt_ids[-TRUNCATE_TO:], result, reference, CONFIG,
                                   stop_ids=tokenizer.stop_ids)
    assert honest.passed is True and honest.greedy_mismatches == 0  # it is honest about the short prompt
    # Its logprobs sit far outside what fp32 numerics give (bit-equal here, < 1e-4 in the envelope)...
    assert audit.statistics.logprob_gap_mean > 0.1 and honest.statistics.logprob_gap_mean < 1e-4
    # ...but on the random tiny model, whose far context barely matters, inside what honest bf16 gives
    # (up to 0.51 nats, benchmarks/verification.py): the envelope rules cannot tell it from bf16.
    # Truncation is caught where context matters (the trained tiny model) and by the long-context gate.
    assert audit.statistics.logprob_gap_mean < CONFIG.logprob_gap_soft


async def test_tier1_detects_eos_avoidance(runs, models, tokenizer):
    work, done = runs
    item, avoided, stopped = work["eos"], done["eos_avoided"], done["eos_honest"]
    eos = tokenizer.eos_id
    assert stopped.final.finish_reason == "eos" and len(stopped.token_ids) < item.request.max_tokens
    assert len(avoided.token_ids) == item.request.max_tokens and eos not in avoided.token_ids
    async with engine_for(EosBias(models["honest"], eos, EOS_BIAS), tokenizer) as reference:
        audit = await audit_tier1(item.prompt_ids, avoided, reference, CONFIG, stop_ids=tokenizer.stop_ids)
        fair = await audit_tier1(item.prompt_ids, stopped, reference, CONFIG, stop_ids=tokenizer.stop_ids)
    assert audit.eos_avoided > 0 and "eos_avoided" in checks(audit.failures)
    assert fair.eos_avoided == 0 and fair.passed is True


async def test_miner_references_and_consensus(runs, models, tokenizer, keys):
    work, done = runs
    item, result = work["hot"], done["hot"]
    async with serving(models["honest"], tokenizer, keys["miner"]) as (url, _), \
            serving(models["honest"], tokenizer, keys["other"]) as (other_honest_url, _), \
            serving(models["other"], tokenizer, keys["other"]) as (liar_url, _):
        async with MinerClient(keys["validator"], timeouts=TIMEOUTS) as client:
            auditor = MinerScoreReference(client, url, keys["miner"].ss58_address)
            second = MinerScoreReference(client, other_honest_url, keys["other"].ss58_address)
            liar = MinerScoreReference(client, liar_url, keys["other"].ss58_address)
            unreachable = MinerScoreReference(client, "http://127.0.0.1:9", keys["other"].ss58_address)
            single, agreed, split, broken = await asyncio.gather(*(
                audit_tier1(item.prompt_ids, result, reference, CONFIG, stop_ids=tokenizer.stop_ids)
                for reference in (auditor, ConsensusReference([auditor, second]), ConsensusReference([auditor, liar]),
                                  unreachable)))
            # Used directly, the consensus answers only when its references agree.
            greedy = list(work["greedy"].prompt_ids) + done["greedy"].token_ids
            outputs = list(range(work["greedy"].prompt_tokens, len(greedy)))
            assert len(await ConsensusReference([auditor, second]).score(greedy, outputs, 0)) == len(outputs)
            with pytest.raises(ReferenceDisagreement):
                await ConsensusReference([auditor, liar]).score(greedy, outputs, 0)
    assert single.passed is True and single.quality == 1.0
    assert agreed.passed is True and not agreed.disagreement
    assert split.passed is None and split.disagreement  # escalate to tier 2
    assert broken.passed is None and "reference failed" in broken.error


def test_outside_top_k_bound_is_exact_at_temperature_one_and_zero_when_greedy():
    import math
    probs = [0.5, 0.2, 0.1, 0.05, 0.05, 0.04, 0.02, 0.01, 0.01, 0.005, 0.004, 0.003, 0.002]
    lps = [math.log(p) for p in probs]
    outside_mass = 1.0 - sum(probs[:3])
    assert outside_top_k_bound(lps, 3, 1.0) == pytest.approx(outside_mass)
    assert outside_top_k_bound(lps, 3, 0.0) == 0.0
    colder = outside_top_k_bound(lps, 3, 0.5)
    assert 0 < colder < outside_mass
    # The bound holds for the true distribution (the listed tokens plus an unseen tail of tiny tokens).
    tail = [(1.0 - sum(probs)) / 50] * 50
    full = probs + tail
    weights = [p ** 2 for p in full]
    assert sum(weights[3:]) / sum(weights) <= colder


# ------------------------------------------------------------------ tier 2
def test_canaries_match_mismatch_and_near_ties(runs, tmp_path):
    _, done = runs
    pool, canary, item = done["pool"], done["canary"], done["canary_item"]
    honest, cheat = done["canary_honest"], done["canary_other"]
    assert item.request.temperature == 0.0 and item.request.max_tokens >= len(canary.tokens) == CONFIG.canary_tokens
    assert item.prompt_ids == canary.prompt_ids

    match = check_tier2(canary, honest, CONFIG, exact=True)
    assert match.passed and match.compared == len(canary.tokens) and match.near_tie_at is None
    mismatch = check_tier2(canary, cheat, CONFIG, exact=True)
    assert not mismatch.passed and [f.check for f in mismatch.failures] == ["canary_mismatch"]
    # hard only where the reference was sure by more than greedy_gap_hard at the divergence
    assert mismatch.failures[0].hard == (canary.margins[mismatch.mismatch_at] > CONFIG.greedy_gap_hard)

    # Near-tie: the reference's greedy token at 5 differs from the miner's, with a 0.05 margin.
    at = 5
    tokens = list(canary.tokens)
    tokens[at] = (honest.token_ids[at] + 1) % 256
    tie = dataclasses.replace(canary, tokens=tuple(tokens),
                              margins=tuple(0.05 if i == at else m for i, m in enumerate(canary.margins)),
                              runner_up_ids=tuple(honest.token_ids[at] if i == at else r
                                                  for i, r in enumerate(canary.runner_up_ids)))
    near = check_tier2(tie, honest, CONFIG, exact=True)
    assert near.passed and near.near_tie_at == at and near.compared == at
    wrong_runner_up = dataclasses.replace(tie, runner_up_ids=tuple((r + 1) % 256 for r in tie.runner_up_ids))
    assert not check_tier2(wrong_runner_up, honest, CONFIG).passed
    # The honest-numerics envelope: a flip to the runner-up at a 1-nat margin is what bf16 does (no failure),
    # a miner that declares fp32 does not flip there (soft), and at 7 nats nothing honest flips (hard).
    def at_margin(m):
        return dataclasses.replace(tie, margins=tuple(m if i == at else x for i, x in enumerate(canary.margins)))
    assert check_tier2(at_margin(1.0), honest, CONFIG).passed
    soft = check_tier2(at_margin(1.0), honest, CONFIG, exact=True)
    assert not soft.passed and soft.mismatch_at == at and not soft.failures[0].hard
    for exact in (False, True):
        sure = check_tier2(at_margin(7.0), honest, CONFIG, exact=exact)
        assert not sure.passed and sure.failures[0].hard and "margin 7.000" in sure.failures[0].reason

    # The pool file round-trips; each canary is used once.
    path = tmp_path / "canaries.json"
    pool.to_file(path)
    loaded = CanaryPool.from_file(path, used=pool.used)
    assert loaded.to_json() == pool.to_json() and len(loaded) == 2 and loaded.remaining == 1
    assert loaded.canaries[canary.canary_id].logprobs == canary.logprobs and len(canary.logprobs) == len(canary.tokens)
    rng = random.Random(0)
    last = loaded.take(rng)
    assert last.canary_id != canary.canary_id
    assert loaded.take(rng) is None and loaded.remaining == 0


def test_canary_pool_rejects_bad_files(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text('{"format": "k3-canaries", "version": 1, "canaries": [{"id": "a", "prompt_ids": [1], '
                   '"tokens": [1, 2], "margins": [0.5]}]}')
    with pytest.raises(CanaryPoolError, match="one margin per token"):
        CanaryPool.from_file(bad)
    bad.write_text('{"format": "something-else"}')
    with pytest.raises(CanaryPoolError, match="not a canary pool"):
        CanaryPool.from_file(bad)
    with pytest.raises(CanaryPoolError, match="cannot read"):
        CanaryPool.from_file(tmp_path / "missing.json")
    bad.write_text('{"format": "k3-canaries", "version": 1, "canaries": [{"id": "a", "prompt_ids": [1], '
                   '"tokens": [1, 2], "margins": [0.5, 0.5], "logprobs": [-0.1, 0.3]}]}')
    with pytest.raises(CanaryPoolError, match="one logprob"):
        CanaryPool.from_file(bad)
    with pytest.raises(CanaryPoolError, match="twice"):
        CanaryPool([Canary("a", (1,), (2,), (1.0,)), Canary("a", (3,), (4,), (1.0,))])


# ------------------------------------------------------------------ answers and the whole item
async def test_verify_item_runs_every_applicable_tier(runs, models, tokenizer, keys):
    work, done = runs
    expect = Expectation(probe="planted_fact", answer="123456", subject="Ana Silva")
    item = dataclasses.replace(work["greedy"], kind="probe", expect=expect)
    result = done["greedy"]
    async with engine_for(models["honest"], tokenizer) as reference:
        verification = await verify_item(item, result, tokenizer=tokenizer, capabilities=CAPS,
                                         miner_hotkey=keys["miner"].ss58_address, config=CONFIG,
                                         reference=reference, audit=True)
        skipped = await verify_item(item, result, tokenizer=tokenizer, capabilities=CAPS,
                                    miner_hotkey=keys["other"].ss58_address, config=CONFIG,
                                    reference=reference, audit=True)
    assert verification.tier0_ok and verification.audit.passed is True
    assert [f.check for f in verification.answer] == ["planted_fact"]  # a random model never knows the code
    assert verification.hard_failures == []
    # A hard tier-0 failure (signed by another hotkey than expected) settles it: no audit is spent.
    assert [f.check for f in skipped.hard_failures] == ["signature"] and skipped.audit is None


# ------------------------------------------------------------------ the audit sequence
def auditor(uid, url, key, coldkey):
    return AuditorCandidate(uid=uid, hotkey=key.ss58_address, coldkey=coldkey, url=url, score=1.0)


async def test_the_audit_sequence_escalates_a_disagreement_and_settles_the_auditors(runs, models, tokenizer, keys):
    """Miner auditors that disagree (one honest, one serving other weights) void the audit; the audited miner
    gets a canary, and its answer settles the auditors: the one that failed an honest miner has it recorded."""
    work, done = runs
    item, result = work["greedy"], done["greedy"]
    config = CONFIG.replace(audit_rate=1.0, audit_rate_new_or_suspect=1.0)
    pool = CanaryPool(list(done["pool"].canaries.values()), model_fingerprint=FINGERPRINT)
    async with serving(models["honest"], tokenizer, keys["miner"]) as (honest_url, _), \
            serving(models["other"], tokenizer, keys["other"]) as (liar_url, _):
        async with MinerClient(keys["validator"], timeouts=TIMEOUTS) as client:
            sequence = AuditSequence(config, random.Random(3), tokenizer, canaries=pool, client=client,
                                     timeouts=TIMEOUTS)
            candidates = [auditor(1, honest_url, keys["miner"], "c1"), auditor(2, liar_url, keys["other"], "c2")]
            audited = await sequence.check(item, result, CAPS, uid=0, hotkey=keys["miner"].ss58_address,
                                           coldkey="c0", new_or_suspect=False, candidates=lambda: candidates)
            escalation = audited.escalation
            answer = await generate(honest_url, keys, escalation)
            settled = await sequence.check(escalation, answer, CAPS, uid=0, hotkey=keys["miner"].ss58_address,
                                           coldkey="c0", new_or_suspect=False)
    assert audited.verification.tier0_ok and audited.verification.audit.disagreement
    [record] = audited.audits
    assert record.tier == 1 and record.reference.startswith("miners:")
    assert set(record.reference.removeprefix("miners:").split(",")) == {c.hotkey for c in candidates}
    assert escalation.expect.canary is not None and audited.canaries_used == [escalation.expect.canary.canary_id]
    assert audited.against_auditors == []
    assert [(a.tier, a.reference, a.result.passed) for a in settled.audits] == [(2, "canary", True)]
    assert [(f.auditor.uid, f.check) for f in settled.against_auditors] == [(2, "auditor_wrong")]
    assert sequence.pending == {} and settled.escalation is None


async def test_the_audit_sequence_audits_on_the_validators_own_engine(runs, models, tokenizer, keys):
    """With its own engine the validator trusts the audit: another model's answer fails hard, with nothing to
    escalate; an answer whose tier 0 failed hard is not audited (the draw happens all the same)."""
    work, done = runs
    config = CONFIG.replace(audit_rate=1.0, audit_rate_new_or_suspect=1.0)
    async with engine_for(models["honest"], tokenizer) as reference:
        sequence = AuditSequence(config, random.Random(3), tokenizer, reference=reference)
        other = await sequence.check(work["hot"], done["hot_other"], CAPS, uid=0, hotkey=keys["miner"].ss58_address,
                                     coldkey="c0", new_or_suspect=False)
        unsigned = await sequence.check(work["hot"], done["hot"], CAPS, uid=0, hotkey=keys["other"].ss58_address,
                                        coldkey="c0", new_or_suspect=False)
    record = other.tier1
    assert record.reference == "local" and record.result.passed is False and record.result.hard
    assert other.verification.audit is record.result and other.escalation is None and record.wall_s > 0
    assert [f.check for f in unsigned.verification.hard_failures] == ["signature"] and unsigned.audits == []


def test_check_answer_reads_the_streamed_text():
    request = GenerateRequest(request_id="r1", prompt_token_ids=[1, 2], max_tokens=8)

    def result_with(text):
        event = TokenMessage(index=0, token_ids=[1], text=text, logprobs=[-0.1], top_logprobs=[[]])
        return GenerateResult(request=request, body=b"", started_at=0.0, events=[TimedEvent(event, 0.1)])

    copy_item = WorkItem("probe", request, (1, 2), Expectation(probe="copy", copy_text="Dear Ana, the figures"))
    assert check_answer(copy_item, result_with("Dear Ana, the figures")) == []
    assert [f.check for f in check_answer(copy_item, result_with("Dear Ana, figures"))] == ["copy"]
    fact_item = WorkItem("long_context", request, (1, 2), Expectation(answer="481516", subject="Bo Li"))
    assert check_answer(fact_item, result_with("The code is 481516.")) == []
    assert [f.hard for f in check_answer(fact_item, result_with("The code is 481517."))] == [False]
