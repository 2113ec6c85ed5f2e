"""`k3-validator canaries`: the canary pool a validator without a reference engine settles audits with.

A validator on CPU (no `--reference-engine`) needs canaries computed on a real deployment of the model: prompts
that read like chat, with the reference's greedy continuation, its top-1/top-2 margins and logprobs
(scoring/canaries.py). This command plans them as the validator plans its own (scoring.workloads.canary_prompts)
and computes them on any engine: the project's reference or sharded engine on the checkpoint, or a vLLM/SGLang
server (`--engine remote`). The pool is written in batches with a progress line per batch, and names the model's
fingerprint, which the validator checks against its checkpoint.

    k3-validator canaries --checkpoint /data/kimi-k3 --engine sharded --plan plan.yaml --count 500 --out canaries.json
    k3-validator canaries --engine remote --remote-url http://127.0.0.1:8000 --remote-model kimi-k3 \\
        --checkpoint ckpt/k3-meta --count 500 --out canaries.json
"""
from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

from inference.model import load_tokenizer, read_config
from inference.serving import Engine, EngineSpec, EngineSpecError, build_engine
from neurons.base.settings import Option, engine_options, expanded_path, non_negative_int, optional_text
from neurons.validator_app.rounds import reference_capabilities
from neurons.validator_app.settings import ScoringSettings, ValidatorSettings, ValidatorSetupError
from scoring.canaries import CanaryPool
from scoring.config import ScoringConfig
from scoring.workloads import WorkloadError, canary_prompts

BATCH = 16  # canaries computed at once, and between two progress lines

CANARY_OPTIONS = engine_options("K3_CANARIES_ENGINE_") + (
    Option("out", "--out", None, expanded_path, "the pool file to write (JSON, what --canary-pool reads)",
           group="canaries", metavar="FILE", required=True, default=None),
    Option("count", "--count", None, non_negative_int, "canaries in the pool (each is used once)",
           group="canaries", metavar="N", default=200),
    Option("seed", "--seed", None, int, "seed of the prompts (default: random, so pools differ between validators)",
           group="canaries", metavar="N", default=None),
    Option("profile", "--scoring-profile", None, str, "the scoring numbers the canaries are sized by",
           group="canaries", choices=("production", "local_testnet"), default="production"),
    Option("overrides", "--scoring-overrides", None, optional_text, "JSON object of scoring/config.py fields to "
           "change", group="canaries", metavar="JSON", default=None),
)


class CanaryPoolSetupError(ValidatorSetupError):
    """The pool cannot be made as asked; the message says what to change."""


def scoring_config(profile: str, overrides: str | None) -> ScoringConfig:
    return ValidatorSettings(scoring=ScoringSettings(profile, overrides)).scoring_config()


def _tokenizer_of(engine: Engine, spec: EngineSpec):
    return getattr(engine, "tokenizer", None) or load_tokenizer(spec.checkpoint, read_config(spec.checkpoint))


async def write_canary_pool(spec: EngineSpec, count: int, out: str | Path, config: ScoringConfig,
                            seed: int | None = None, say: Callable[[str], None] = print) -> CanaryPool:
    """Compute `count` canaries on the engine `spec` describes and write the pool to `out`."""
    if count < 1:
        raise CanaryPoolSetupError("--count must be at least 1")
    spec = replace(spec, speculate="none")  # greedy tokens as the model gives them, nothing else
    try:
        engine = await asyncio.to_thread(build_engine, spec)
    except EngineSpecError as error:
        raise CanaryPoolSetupError(str(error)) from None
    await engine.start()
    try:
        if engine.health().status == "down":
            raise CanaryPoolSetupError(f"the engine is not serving: {engine.health().detail}")
        tokenizer = _tokenizer_of(engine, spec)
        fingerprint = engine.capabilities().model_fingerprint
        try:
            prompts = canary_prompts(random.Random(seed), count, reference_capabilities(engine), config, tokenizer)
        except WorkloadError as error:
            raise CanaryPoolSetupError(f"cannot plan canary prompts: {error} (raise --max-context)") from None
        if len(prompts) < count:
            say(f"only {len(prompts)} distinct prompts could be planned (asked {count})")
        canaries, started = [], time.monotonic()
        for first in range(0, len(prompts), BATCH):
            batch = await CanaryPool.from_engine(engine, prompts[first:first + BATCH], config, fingerprint)
            canaries += batch.canaries.values()
            say(f"canaries {len(canaries)}/{len(prompts)} ({time.monotonic() - started:.0f} s)")
        pool = CanaryPool(canaries, model_fingerprint=fingerprint)
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        pool.to_file(out)
        say(f"wrote {len(pool)} canaries of {config.canary_tokens} tokens for model {fingerprint} to {out}")
        return pool
    finally:
        await engine.stop()
