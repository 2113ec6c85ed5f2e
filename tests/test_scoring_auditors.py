"""Miner auditors checked on canary text (scoring.auditors.check_auditor) with real engines: an honest
auditor in fp32 or bf16 passes, a framing one (false low scores) and a shielding one (always agrees)
fail; and the perturbed-experts cheat changes what the model computes while the fingerprint stays."""
import asyncio
import random

import pytest
import torch

from inference.model import KimiK3Model, ModelConfig, load_tokenizer, make_random_checkpoint
from inference.serving import EngineSettings, LocalEngine
from localnet.cheats.miner import CheatingEngine
from scoring.auditors import check_auditor
from scoring.canaries import CanaryPool
from scoring.config import ScoringConfig

CONFIG = ScoringConfig.local_testnet()


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("aud") / "tiny"
    make_random_checkpoint(ModelConfig.tiny(), path, seed=0, progress=False)
    return path


def engine(checkpoint, dtype=torch.float32, cheat=None):
    config = ModelConfig.tiny()
    model = KimiK3Model(config, dtype=dtype, seed=0).eval()
    inner = LocalEngine(model, load_tokenizer(checkpoint, config), EngineSettings(max_context=4096),
                        model_fingerprint="fp")
    return inner if cheat is None else CheatingEngine(inner, cheat)


async def check_all(checkpoint):
    reference = engine(checkpoint)
    await reference.start()
    rng = random.Random(0)
    prompts = [[256] + [rng.randrange(32, 127) for _ in range(rng.randint(20, 60))] for _ in range(4)]
    pool = await CanaryPool.from_engine(reference, prompts, CONFIG)
    out = {}
    try:
        for name, auditor in (("fp32", reference), ("bf16", engine(checkpoint, torch.bfloat16)),
                              ("frame", engine(checkpoint, cheat="frame")),
                              ("shield", engine(checkpoint, cheat="shield"))):
            if auditor is not reference:
                await auditor.start()
            out[name] = [await check_auditor(auditor, canary, CONFIG) for canary in pool.canaries.values()]
            if auditor is not reference:
                await auditor.stop()
    finally:
        await reference.stop()
    out["clear"] = [sum(m > CONFIG.greedy_gap_soft for m in c.margins) for c in pool.canaries.values()]
    return out


@pytest.fixture(scope="module")
def results(checkpoint):
    return asyncio.run(check_all(checkpoint))


def test_auditors_are_checked_on_canary_text(results):
    assert results["fp32"] == [None] * 4
    assert results["bf16"] == [None] * 4  # other numerics are no lie
    # shielding ranks every token first: the decoy (the reference's clear runner-up) gives it away
    assert all(f is not None and "nats behind" in f.reason for f in results["shield"])


def test_a_framing_auditor_is_caught_on_every_canary(results):
    # framing (false low scores) moves the auditor's logprobs of the canary tokens far from the reference's,
    # whatever the margins (on the random tiny model few tokens are clear enough for a ranking test)
    assert all(f is not None and f.check == "auditor_canary" and "nats off the reference" in f.reason
               for f in results["frame"]), results["frame"]


def test_perturbed_experts_keep_the_fingerprint_but_not_the_numbers(checkpoint):
    honest, cheat = engine(checkpoint), engine(checkpoint, cheat="perturb-experts")
    assert cheat.capabilities().model_fingerprint == honest.capabilities().model_fingerprint
    ids = [torch.arange(30) % 200]
    a = honest.model.forward(ids, [honest.model.new_cache()])[0]
    b = cheat.inner.model.forward(ids, [cheat.inner.model.new_cache()])[0]
    assert (torch.log_softmax(a, -1) - torch.log_softmax(b, -1)).abs().mean() > 0.05
