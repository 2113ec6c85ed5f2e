"""Speculative decoding across swarm stages, with real stage miner processes on loopback.

The route driver drafts (n-gram, suffix, or a drafter of known quality), sends [last token, k drafts] through
the route as one forward in verify mode, the last stage judges the drafts, and on a rejection the driver
rewinds every stage (the rewind message) to the last accepted position. Greedy with speculation equals greedy
without (the single-process model), token for token and logprobs within 1e-4 (fp32), over 2 and 3 stages,
for drafts that are always accepted, never accepted, and the model-free drafters; sampled output (plain and
speculating) equals the single-process model's sampling with the same seed (k3-gumbel/1); the final event
reports the proposed and accepted draft tokens and the seed. Plus the stage's own checks of a verify forward.
"""
import asyncio

import bittensor as bt
import pytest
import torch
from conftest import collect_events, reference_greedy

from benchmarks.swarm import launch_stages, stop_processes
from inference.decoding.drafters import ReplayDrafter
from inference.decoding.sampling import SamplingParams
from inference.decoding.speculation import SpeculationConfig
from inference.model.checkpoint import fingerprint, make_random_checkpoint
from inference.model.config import ModelConfig
from inference.model.tokenizer import load_tokenizer
from inference.serving.builders import load_reference_model
from inference.serving.engine import GenerationRequest
from inference.swarm.stage import Stage, StageError
from neurons.swarm.route import RouteDriver, RouteEngine, StaticDirectory

HOP_TIMEOUT_S = 5.0
RANGES = {"a": "0-3", "b": "4-5", "c": "6-12", "f": "4-12"}
ROUTES = {2: ["a", "f"], 3: ["a", "b", "c"]}
NOVEL = [(11 * j + 5) % 256 for j in range(21)]
REPEATING = [65, 66] * 10  # the tiny model soon repeats one token after it: the drafters find that
NEW_TOKENS = 20


@pytest.fixture(scope="module")
def swarm(tmp_path_factory):
    root = tmp_path_factory.mktemp("spec_route")
    ckpt = root / "ckpt"
    make_random_checkpoint(ModelConfig.tiny(), ckpt, seed=0)
    for name in [*RANGES, "driver"]:
        bt.Wallet(name, "default", path=str(root / "wallets")).create_new_hotkey(use_password=False, suppress=True)
    names = list(RANGES)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the reference model in this process: 2 threads on a loaded 2-core box crawl
    procs, infos = launch_stages(ckpt, [RANGES[n] for n in names], root / "wallets", names, root,
                                 extra=["--hop-timeout-s", str(HOP_TIMEOUT_S), "--max-tokens-per-forward", "64"],
                                 timeout_s=240.0)
    try:
        model, _, _ = load_reference_model(ckpt, verify=False)
        greedy = {tuple(p): reference_greedy(model, p, NEW_TOKENS) for p in (NOVEL, REPEATING)}
        yield {"ckpt": ckpt, "model": model, "greedy": greedy, "urls": {n: i["url"] for n, i in zip(names, infos)},
               "driver": bt.Wallet("driver", "default", path=str(root / "wallets")).hotkey,
               "tokenizer": load_tokenizer(ckpt, ModelConfig.tiny())}
    finally:
        stop_processes(procs)
        torch.set_num_threads(threads)


def make_engine(swarm, hops, speculation):
    driver = RouteDriver(StaticDirectory([swarm["urls"][n] for n in ROUTES[hops]]), swarm["driver"],
                         ModelConfig.tiny(), hop_timeout_s=HOP_TIMEOUT_S)
    return RouteEngine(driver, swarm["tokenizer"], prefill_chunk=8, model_fingerprint=fingerprint(swarm["ckpt"]),
                       speculation=speculation)


async def generate(engine, prompt, params):
    async with engine:
        events, final = await collect_events(engine.generate(GenerationRequest(prompt, params)))
    return [e.token_id for e in events], [e.logprob for e in events], final


def replay(swarm, prompt, wrong_every):
    """A drafter that proposes the plain greedy continuation, every `wrong_every`-th token altered (1: every
    draft wrong), always 4 tokens a step."""
    want, _ = swarm["greedy"][tuple(prompt)]
    factory = lambda ids: ReplayDrafter(len(ids), want, ModelConfig.tiny().vocab_size, wrong_every)  # noqa: E731
    return SpeculationConfig(max_draft_tokens=4, fixed_draft_tokens=4, drafter_factory=factory)


CASES = {
    "always_accepted": lambda swarm, prompt: replay(swarm, prompt, 0),
    "never_accepted": lambda swarm, prompt: replay(swarm, prompt, 1),
    "ngram": lambda swarm, prompt: SpeculationConfig(drafter="ngram", max_draft_tokens=6),
    "suffix": lambda swarm, prompt: SpeculationConfig(drafter="suffix", max_draft_tokens=6, min_match=2),
}


@pytest.mark.parametrize("hops", [2, 3])
@pytest.mark.parametrize("case", list(CASES))
def test_speculative_route_equals_plain_greedy(swarm, hops, case):
    prompt = NOVEL if case.endswith("accepted") else REPEATING
    want, want_lp = swarm["greedy"][tuple(prompt)]
    params = SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True)
    got, lps, final = asyncio.run(generate(make_engine(swarm, hops, CASES[case](swarm, prompt)), prompt, params))
    assert got == want
    assert max(abs(a - b) for a, b in zip(lps, want_lp)) < 1e-4
    assert final.completion_tokens == NEW_TOKENS and final.verify_steps > 0 and final.draft_proposed > 0
    if case == "always_accepted":
        assert final.draft_accepted == final.draft_proposed
        assert final.verify_steps <= NEW_TOKENS // 4  # every step emits its 4 drafts and the bonus token
    elif case == "never_accepted":
        assert final.draft_accepted == 0
        # one token per step, each after a rewind; the last decode step has no room for a draft
        assert final.verify_steps == NEW_TOKENS - 2
    else:
        assert final.draft_accepted > 0  # the tiny model's greedy text repeats: the drafters find it


def test_plain_route_reports_no_drafts(swarm):
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    got, _, final = asyncio.run(generate(make_engine(swarm, 2, None), NOVEL, params))
    assert got == swarm["greedy"][tuple(NOVEL)][0][:6]
    assert (final.draft_proposed, final.draft_accepted, final.verify_steps) == (0, 0, 0)


@pytest.mark.parametrize("hops", [2, 3])
def test_sampled_route_equals_plain_sampling_with_and_without_speculation(swarm, hops):
    """Sampled over the route: the head samples under k3-gumbel/1 with the request's seed and generated-token
    index, so the route's tokens are those the single-process model samples with that seed, plain or
    speculating (the drafts judged on the last stage), and the final event names the seed."""
    from inference.decoding.speculation import speculative_generate

    params = SamplingParams(max_tokens=12, ignore_eos=True, temperature=0.8, seed=2**64 - 7)
    for prompt in (REPEATING, NOVEL):
        want, _ = speculative_generate(swarm["model"], prompt, params, SpeculationConfig())
        for spec in (None, SpeculationConfig(drafter="ngram", max_draft_tokens=4),
                     SpeculationConfig(max_draft_tokens=4, fixed_draft_tokens=4, drafter_factory=lambda ids, w=want:
                                       ReplayDrafter(len(ids), w, ModelConfig.tiny().vocab_size, 3))):
            got, _, final = asyncio.run(generate(make_engine(swarm, hops, spec), prompt, params))
            assert got == want, (prompt[:4], spec)
            assert final.seed == params.seed
            if spec is not None and spec.drafter_factory is not None:
                assert final.draft_accepted > 0 and final.draft_proposed > final.draft_accepted
    _, _, drawn = asyncio.run(generate(make_engine(swarm, hops, None), NOVEL, SamplingParams(max_tokens=3,
                                                                                              temperature=1.0)))
    assert drawn.seed is not None  # a request without a seed gets one, reported so the answer replays


def test_verify_forward_checks_and_rewind(swarm):
    """In process: a verify forward needs the k drafts as targets; after one, a rewind into it (the cheap
    path: the cache's rewind log) leaves the stage as if the rejected drafts were never seen."""
    stage = Stage.from_checkpoint(swarm["ckpt"], "0-12")
    stage.open("s")
    prompt = torch.tensor(NOVEL)
    stage.forward("s", 0, prompt, mode="sample")
    for targets in (None, [1], [1, 2, 3], [-1, 2], [10**6, 2]):
        with pytest.raises(StageError) as e:
            stage.forward("s", len(NOVEL), torch.tensor([5, 6, 7]), mode="verify", targets=targets)
        assert e.value.status == 400
    assert stage.sessions["s"].position == len(NOVEL)
    out = stage.forward("s", len(NOVEL), torch.tensor([5, 6, 7]), mode="verify", targets=[6, 7])
    assert out.mode == "verify" and 1 <= len(out.verified) <= 3 and out.accepted == len(out.verified) - 1
    assert stage.sessions["s"].cache.marked
    stage.rewind("s", len(NOVEL) + 1)
    assert not stage.sessions["s"].cache.marked
    after = stage.forward("s", len(NOVEL) + 1, torch.tensor([9]), mode="score", targets=[4])
    stage.open("t")
    stage.forward("t", 0, torch.cat([prompt, torch.tensor([5])]), mode="none")
    plain = stage.forward("t", len(NOVEL) + 1, torch.tensor([9]), mode="score", targets=[4])
    assert abs(after.logprobs[0] - plain.logprobs[0]) < 1e-5
