"""The miner with an engine that cheats, for the validator's tests and the local testnet.

    python scripts/cheating_miner.py --cheat truncate  <every neurons/miner.py flag>
    python scripts/cheating_miner.py --cheat none --token-delay-ms 50 ...   (an honest but slow miner)

Cheats (each one some verification tier must catch):
- truncate: the engine only sees the last 512 prompt tokens (cheaper long contexts), and the
  usage still reports the full prompt;
- buffer: the whole answer is generated first and every event is sent at once (a buffered stream
  that pretends to be streaming);
- inflate: usage reports more completion tokens than were generated;
- none: honest (with --token-delay-ms, a slow honest miner).
A "different weights" cheater needs no code: start the plain miner on a checkpoint made with
another seed (scripts/make_checkpoint.py --seed 1).
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import sys
import time
from pathlib import Path

from inference.serving import Engine, FinalEvent, GenerationRequest, TokenEvent, WrappedEngine
from neurons.miner_app.server import serve
from neurons.miner_app.settings import MinerSetupError, read_miner_settings
from neurons.observability import run_neuron
from neurons.settings import Option, non_negative_float

CHEATS = ("none", "truncate", "buffer", "inflate")
TRUNCATE_KEEP_TOKENS = 512

CHEAT_OPTIONS = (
    Option("cheat.kind", "--cheat", "K3_CHEAT", str,
           "how to cheat: truncate (last 512 prompt tokens only), buffer (send everything at the end), "
           "inflate (report more completion tokens), none", group="cheating", choices=CHEATS, default="none"),
    Option("cheat.token_delay_ms", "--token-delay-ms", "K3_CHEAT_TOKEN_DELAY_MS", non_negative_float,
           "add this much to every model step (throttles an honest miner's compute)", group="cheating", metavar="MS",
           default=0.0),
)


class CheatingEngine(WrappedEngine):
    """Wraps a real engine and cheats in one way; everything else passes through (scoring stays honest:
    the cheats are about what a generation costs and reports)."""

    def __init__(self, inner: Engine, cheat: str = "none", token_delay_ms: float = 0.0,
                 keep_tokens: int = TRUNCATE_KEEP_TOKENS):
        if cheat not in CHEATS:
            raise ValueError(f"unknown cheat {cheat!r}; use one of {CHEATS}")
        super().__init__(inner)
        self.cheat = cheat
        self.token_delay_s = token_delay_ms / 1000.0
        self.keep_tokens = keep_tokens
        model = getattr(inner, "model", None)
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
        if self.cheat == "truncate" and prompt_tokens > self.keep_tokens:
            request = dataclasses.replace(request, prompt_token_ids=request.prompt_token_ids[-self.keep_tokens:])
        stream = self.inner.generate(request)  # refusals still raise here, at once
        return self._events(stream, prompt_tokens)

    async def _events(self, stream, prompt_tokens: int):
        try:
            if self.cheat == "buffer":
                for event in [event async for event in stream]:
                    yield self._doctored(event, prompt_tokens)
                return
            async for event in stream:
                if isinstance(event, TokenEvent) and self.token_delay_s and getattr(self.inner, "model", None) is None:
                    await asyncio.sleep(self.token_delay_s)  # an engine without a model (remote): delay the relay
                yield self._doctored(event, prompt_tokens)
        finally:
            await stream.aclose()

    def _doctored(self, event, prompt_tokens: int):
        if not isinstance(event, FinalEvent):
            return event
        if self.cheat == "truncate":  # hide the truncation
            return dataclasses.replace(event, prompt_tokens=prompt_tokens)
        if self.cheat == "inflate":
            extra = max(1, event.completion_tokens // 4)
            return dataclasses.replace(event, completion_tokens=event.completion_tokens + extra)
        return event


def main(argv: list[str] | None = None) -> int:
    settings, extras = read_miner_settings(argv, extra=CHEAT_OPTIONS, prog="scripts/cheating_miner.py",
                                           description=__doc__)
    cheat = extras["cheat"]

    async def cheating_miner() -> int:
        logging.getLogger("k3.miner").warning("CHEATING MINER: cheat=%s token_delay_ms=%g", cheat["kind"],
                                              cheat["token_delay_ms"])
        return await serve(settings, wrap_engine=lambda engine: CheatingEngine(
            engine, cheat["kind"], cheat["token_delay_ms"]))

    return run_neuron(settings, cheating_miner, MinerSetupError, "k3.miner")


if __name__ == "__main__":
    sys.exit(main())
