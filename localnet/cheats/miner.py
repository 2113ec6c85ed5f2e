"""The miner with an engine that cheats, for the validator's tests and the local testnet.

    python localnet/cheats/miner.py --cheat truncate  <every neurons/miner.py flag>
    python localnet/cheats/miner.py --cheat none --token-delay-ms 50 ...   (an honest but slow miner)

Cheats (each one some verification tier must catch):
- truncate: the engine only sees the last 512 prompt tokens (cheaper long contexts), and the
  usage still reports the full prompt;
- buffer: the whole answer is generated first and every event is sent at once (a buffered stream
  that pretends to be streaming);
- inflate: usage reports more completion tokens than were generated;
- perturb-experts: the routed experts re-quantised with noise at start, the manifest fingerprint
  claimed unchanged (a cheaper or damaged expert set);
- long-swap: the real model on prompts under --cheat-long-tokens, another (random) model above, at
  every temperature (cheaper long contexts);
- frame: an auditor whose /v1/score lowers every scored token's logprob by 6 nats (to fail
  competitors' audits); its own answers are honest;
- shield: an auditor whose /v1/score says every scored token was the top-1 at logprob 0 (to pass a
  partner's audits whatever it served);
- greedy-for-sampled: answers every sampled request greedily (cheaper: no sampling, and cacheable);
- seed-ignoring-replay: caches sampled answers by prompt and returns the cached tokens, paced as they first
  came (no buffered stream to see), when the same prompt comes again with another seed (reporting that seed);
- cooler-sampling: samples at half the temperature asked (answers that look more fluent);
- fixed-seed: samples every request with seed 0 and reports the seed asked (answers cacheable by prompt);
- coarse-experts-for-sampled: a bf16-declared miner (run it with --dtype bfloat16) that answers sampled
  requests with a copy of the model whose experts are rounded to 2 bits per weight (greedy ones, where
  canaries are, with the real model);
- none: honest (with --token-delay-ms, a slow honest miner).
The sampling cheats report the request's temperature and seed; the replay of sampled answers (the sampler
k3-gumbel/1, scoring/replay.py) is what catches them.
A "different weights" cheater needs no code: start the plain miner on a checkpoint made with
another seed (k3-checkpoint --seed 1).
"""
from __future__ import annotations

import asyncio
import copy
import dataclasses
import logging
import sys
import time
from pathlib import Path

from inference.decoding.sampling import MIN_TEMPERATURE
from inference.serving import Engine, FinalEvent, GenerationRequest, SamplingParams, TokenEvent, WrappedEngine
from neurons.base.observability import run_neuron
from neurons.base.settings import Option, non_negative_float
from neurons.miner_app.server import serve
from neurons.miner_app.settings import MinerSetupError, read_miner_settings

SAMPLING_CHEATS = ("greedy-for-sampled", "seed-ignoring-replay", "cooler-sampling", "fixed-seed",
                   "coarse-experts-for-sampled")
CHEATS = ("none", "truncate", "buffer", "inflate", "perturb-experts", "long-swap", "frame", "shield") + SAMPLING_CHEATS
COARSE_EXPERT_BITS = 2
TRUNCATE_KEEP_TOKENS = 512
EXPERT_NOISE = 0.5  # relative to each expert weight's RMS
FRAME_NATS = 6.0

CHEAT_OPTIONS = (
    Option("cheat.kind", "--cheat", "K3_CHEAT", str,
           "how to cheat: truncate (last 512 prompt tokens only), buffer (send everything at the end), "
           "inflate (report more completion tokens), a sampling cheat (greedy-for-sampled, seed-ignoring-replay, "
           "cooler-sampling, fixed-seed, coarse-experts-for-sampled), none", group="cheating", choices=CHEATS,
           default="none"),
    Option("cheat.token_delay_ms", "--token-delay-ms", "K3_CHEAT_TOKEN_DELAY_MS", non_negative_float,
           "add this much to every model step (throttles an honest miner's compute)", group="cheating", metavar="MS",
           default=0.0),
    Option("cheat.long_tokens", "--cheat-long-tokens", "K3_CHEAT_LONG_TOKENS", int,
           "long-swap: prompts of at least this many tokens go to the other model", group="cheating",
           metavar="N", default=512),
)


class CheatingEngine(WrappedEngine):
    """Wraps a real engine and cheats in one way; everything else passes through."""

    def __init__(self, inner: Engine, cheat: str = "none", token_delay_ms: float = 0.0,
                 keep_tokens: int = TRUNCATE_KEEP_TOKENS, long_tokens: int = 512):
        if cheat not in CHEATS:
            raise ValueError(f"unknown cheat {cheat!r}; use one of {CHEATS}")
        super().__init__(inner)
        self.cheat = cheat
        self.token_delay_s = token_delay_ms / 1000.0
        self.keep_tokens = keep_tokens
        self.long_tokens = long_tokens
        self.other: Engine | None = None
        self.answers: dict[tuple, list] = {}  # seed-ignoring-replay: the events of a sampled answer, by prompt
        model = getattr(inner, "model", None)
        if cheat in ("perturb-experts", "long-swap", "coarse-experts-for-sampled") and model is None:
            raise ValueError(f"the {cheat} cheat needs an engine with the model in this process")
        if cheat == "perturb-experts":
            from scoring.envelope import perturb_experts  # noqa: PLC0415
            perturb_experts(model, EXPERT_NOISE)
        if cheat == "long-swap":
            from inference.model import KimiK3Model  # noqa: PLC0415
            from inference.serving import LocalEngine  # noqa: PLC0415
            other = KimiK3Model(model.config, dtype=getattr(model, "dtype", None) or model.lm_head.weight.dtype,
                                seed=4242).eval()
            self.other = LocalEngine(other, inner.tokenizer, inner.settings,
                                     model_fingerprint=inner.capabilities().model_fingerprint)
        if cheat == "coarse-experts-for-sampled":
            from inference.serving import LocalEngine  # noqa: PLC0415
            from scoring.envelope import coarsen_experts  # noqa: PLC0415
            coarse = copy.deepcopy(model)
            coarsen_experts(coarse, COARSE_EXPERT_BITS)
            self.other = LocalEngine(coarse, inner.tokenizer, inner.settings,
                                     model_fingerprint=inner.capabilities().model_fingerprint)
        if self.token_delay_s and model is not None:
            # throttle the compute itself: every model step takes token_delay longer, so the delay adds to
            # the engine's own time per token instead of hiding behind it when steps are slow
            forward, delay = model.forward, self.token_delay_s

            def slower_forward(*args, **kwargs):
                time.sleep(delay)
                return forward(*args, **kwargs)

            model.forward = slower_forward

    def __getattr__(self, name):  # metrics, reserved_bytes, tokenizer, ... of the real engine
        return getattr(self.inner, name)

    def generate(self, request: GenerationRequest):
        prompt_tokens = len(request.prompt_token_ids)
        asked = request.sampling
        if self.cheat == "truncate" and prompt_tokens > self.keep_tokens:
            request = dataclasses.replace(request, prompt_token_ids=request.prompt_token_ids[-self.keep_tokens:])
        if self.cheat in SAMPLING_CHEATS and asked.temperature > 0:
            cached = self.answers.get(self._prompt_key(request)) if self.cheat == "seed-ignoring-replay" else None
            if cached is not None:
                return self._cached(cached, asked.seed)
            request = dataclasses.replace(request, sampling=self._sampling(asked))
        if self.cheat == "long-swap":
            engine = self.other if prompt_tokens >= self.long_tokens else self.inner
        elif self.cheat == "coarse-experts-for-sampled":
            engine = self.other if asked.temperature > 0 else self.inner
        else:
            engine = self.inner
        stream = engine.generate(request)  # refusals still raise here, at once
        if self.cheat == "seed-ignoring-replay" and asked.temperature > 0:
            return self._caching(stream, self._prompt_key(request))
        return self._events(stream, prompt_tokens, asked.seed)

    def _sampling(self, asked: SamplingParams) -> SamplingParams:
        """What a sampling cheat runs instead of the sampling asked (it reports the seed asked)."""
        if self.cheat == "greedy-for-sampled":
            return dataclasses.replace(asked, temperature=0.0)
        if self.cheat == "cooler-sampling":
            return dataclasses.replace(asked, temperature=max(MIN_TEMPERATURE, asked.temperature / 2))
        if self.cheat == "fixed-seed":
            return dataclasses.replace(asked, seed=0)
        return asked

    @staticmethod
    def _prompt_key(request: GenerationRequest) -> tuple:
        p = request.sampling
        return tuple(request.prompt_token_ids), p.max_tokens, p.temperature, p.top_p, p.top_k, p.stop

    async def _caching(self, stream, key: tuple):
        """A sampled answer relayed as it comes, and kept (each event with the time since the one before) for the
        next time this prompt comes."""
        events, last = [], time.monotonic()
        try:
            async for event in stream:
                now = time.monotonic()
                events.append((now - last, event))
                last = now
                if isinstance(event, FinalEvent) and event.finish_reason != "cancelled":
                    self.answers[key] = events  # kept before the final event goes out: the reader stops there
                yield event
        finally:
            await stream.aclose()

    async def _cached(self, events: list, seed):
        """A cached answer, paced as it first came, under the seed asked this time."""
        for wait, event in events:
            await asyncio.sleep(wait)
            yield dataclasses.replace(event, seed=seed) if isinstance(event, FinalEvent) else event

    async def _events(self, stream, prompt_tokens: int, seed=None):
        try:
            if self.cheat == "buffer":
                for event in [event async for event in stream]:
                    yield self._doctored(event, prompt_tokens, seed)
                return
            async for event in stream:
                if isinstance(event, TokenEvent) and self.token_delay_s and getattr(self.inner, "model", None) is None:
                    await asyncio.sleep(self.token_delay_s)  # an engine without a model (remote): delay the relay
                yield self._doctored(event, prompt_tokens, seed)
        finally:
            await stream.aclose()

    def _doctored(self, event, prompt_tokens: int, seed=None):
        if not isinstance(event, FinalEvent):
            return event
        if self.cheat == "fixed-seed" and seed is not None:  # claim the seed asked
            event = dataclasses.replace(event, seed=seed)
        if self.cheat == "truncate":  # hide the truncation
            return dataclasses.replace(event, prompt_tokens=prompt_tokens)
        if self.cheat == "inflate":
            extra = max(1, event.completion_tokens // 4)
            return dataclasses.replace(event, completion_tokens=event.completion_tokens + extra)
        return event

    async def score(self, token_ids, positions=None, top_k=0, replay=None):
        scores = await self.inner.score(token_ids, positions, top_k, replay)
        if self.cheat == "frame":  # every token looks far less likely than it is: honest answers fail audits
            return [dataclasses.replace(s, logprob=s.logprob - FRAME_NATS,
                                        top=[(t, lp - FRAME_NATS if t == s.token_id else lp) for t, lp in s.top])
                    for s in scores]
        if self.cheat == "shield":  # every token was the certain top-1: any answer passes
            return [dataclasses.replace(s, logprob=0.0, top=[(s.token_id, 0.0)] + [(t, -30.0) for t, _ in s.top
                                                                                   if t != s.token_id][:max(0, top_k - 1)])
                    for s in scores]
        return scores  # the other cheats are about what a generation costs and reports

    async def start(self) -> None:
        await self.inner.start()
        if self.other is not None:
            await self.other.start()

    async def stop(self) -> None:
        if self.other is not None:
            await self.other.stop()
        await self.inner.stop()


def main(argv: list[str] | None = None) -> int:
    settings, extras = read_miner_settings(argv, extra=CHEAT_OPTIONS, prog="localnet/cheats/miner.py",
                                           description=__doc__)
    cheat = extras["cheat"]

    async def cheating_miner() -> int:
        logging.getLogger("k3.miner").warning("CHEATING MINER: cheat=%s token_delay_ms=%g", cheat["kind"],
                                              cheat["token_delay_ms"])
        return await serve(settings, wrap_engine=lambda engine: CheatingEngine(
            engine, cheat["kind"], cheat["token_delay_ms"], long_tokens=cheat["long_tokens"]))

    return run_neuron(settings, cheating_miner, MinerSetupError, "k3.miner")


if __name__ == "__main__":
    sys.exit(main())
