"""Stage cheaters: real `Stage` subclasses that serve a block dishonestly, for the stage checks' tests (and a
local swarm run with a cheating stage). Each saves compute or hides a cheaper model behind valid receipts:

- `OtherWeightsStage`: serves other weights for its block (every tensor of the block perturbed, like a
  cheaper fine-tune or a different checkpoint);
- `SkipLayerStage`: skips one layer of its block;
- `EchoStage`: returns its input (no layer run; completed block sums it should produce are copies of the
  partial);
- `SessionLiarStage`: skips its last layer only for some sessions (a fraction chosen by the session id);
- `LongPositionLiarStage`: skips its last layer only at positions >= `from_position`;
- `ReplayStage`: computes an output once per forward length and replays it for every later input of that
  length.

The driver-side attack (receipts the stages never signed) lives in the tests: it needs no stage.
"""
from __future__ import annotations

import hashlib

import torch

from inference.model.k3 import ResidualState
from inference.swarm.stage import LayerRange, Stage, StageLimits, load_stage_model


class _Cheat(Stage):
    @classmethod
    def from_checkpoint(cls, checkpoint, layers, dtype=torch.float32, limits: StageLimits = StageLimits(), **kw):
        stage = super().from_checkpoint(checkpoint, layers, dtype, limits)
        for k, v in kw.items():
            setattr(stage, k, v)
        stage.setup()
        return stage

    def setup(self) -> None:
        pass

    def _input_state(self, inputs) -> ResidualState:
        if self.layers.has_embedding:
            return self.model.embed(inputs.to(torch.long))
        return ResidualState((int(inputs.partial.shape[0]),), [b.float() for b in inputs.blocks],
                             inputs.partial.float())

    def _run_skipping(self, session, inputs, skip: set[int]) -> ResidualState:
        state = self._input_state(inputs)
        for i in range(self.layers.start, self.layers.stop):
            if i not in skip:
                state = self.model.run_layer(i, state, [session.cache])
        state = self._fill_blocks(state)
        session.cache.advance(int(state.partial.shape[0]))
        return state

    def _fill_blocks(self, state: ResidualState) -> ResidualState:
        """A skipped layer that would have closed a block: fake the block sum so the shape is right."""
        while len(state.blocks) < self.output_blocks:
            state = ResidualState(state.lengths, list(state.blocks) + [state.partial], state.partial)
        return state


class OtherWeightsStage(_Cheat):
    """Every tensor of the block perturbed by `relative_noise` x its own scale (seeded)."""

    relative_noise = 0.1
    noise_seed = 1

    def setup(self) -> None:
        g = torch.Generator().manual_seed(self.noise_seed)
        with torch.no_grad():
            for i in range(self.layers.start, self.layers.stop):
                for p in self.model.layers[i].parameters():
                    if p.is_floating_point() and p.numel() > 1:
                        noise = torch.randn(p.shape, generator=g).to(p.dtype)
                        p.add_(noise * (p.float().std() * self.relative_noise).to(p.dtype))
                for mod in self.model.layers[i].modules():  # decoded expert caches hold the old weights
                    if hasattr(mod, "set_dequantize_cache"):
                        mod.set_dequantize_cache(False)
                        mod.set_dequantize_cache(True)


class SkipLayerStage(_Cheat):
    skip_layer: int | None = None  # default: the block's last layer

    def _run(self, session, inputs):
        return self._run_skipping(session, inputs, {self.layers.stop - 1 if self.skip_layer is None
                                                    else self.skip_layer})


class EchoStage(_Cheat):
    def _run(self, session, inputs):
        return self._run_skipping(session, inputs, set(range(self.layers.start, self.layers.stop)))


class SessionLiarStage(_Cheat):
    """Honest for most sessions; for one session in `one_in` (by its id) it skips its last layer."""

    one_in = 3

    def lies_for(self, session_id: str) -> bool:
        return hashlib.sha256(session_id.encode()).digest()[0] % self.one_in == 0

    def _run(self, session, inputs):
        if self.lies_for(session.session_id):
            return self._run_skipping(session, inputs, {self.layers.stop - 1})
        return super()._run(session, inputs)


class LongPositionLiarStage(_Cheat):
    """Honest at short positions; skips its last layer for forwards that reach `from_position`."""

    from_position = 48

    def _run(self, session, inputs):
        n = int(inputs.shape[0]) if isinstance(inputs, torch.Tensor) else int(inputs.partial.shape[0])
        if session.position + n > self.from_position:
            return self._run_skipping(session, inputs, {self.layers.stop - 1})
        return super()._run(session, inputs)


class ReplayStage(_Cheat):
    """The first output of each forward length is computed; later inputs of that length get it back."""

    def setup(self) -> None:
        self.replay: dict[int, ResidualState] = {}

    def _run(self, session, inputs):
        n = int(inputs.shape[0]) if isinstance(inputs, torch.Tensor) else int(inputs.partial.shape[0])
        if n in self.replay:
            session.cache.advance(n)
            return self.replay[n]
        out = super()._run(session, inputs)
        self.replay[n] = out
        return out


CHEATS = {"other-weights": OtherWeightsStage, "skip-layer": SkipLayerStage, "echo": EchoStage,
          "session-liar": SessionLiarStage, "long-position-liar": LongPositionLiarStage, "replay": ReplayStage}

__all__ = ["CHEATS", "WireRounding", "OtherWeightsStage", "SkipLayerStage", "EchoStage", "SessionLiarStage",
           "LongPositionLiarStage", "ReplayStage", "LayerRange", "load_stage_model"]


class WireRounding:
    """An honest stage whose outputs cross a bfloat16 wire (what `--wire-dtype bfloat16` sends): wraps any
    stage, rounds every output state to bf16 and back. Not a cheat: the checks must pass it."""

    def __init__(self, stage: Stage, dtype: torch.dtype = torch.bfloat16):
        self.stage = stage
        self.dtype = dtype

    def __getattr__(self, name):
        return getattr(self.stage, name)

    def forward(self, *args, **kw):
        out = self.stage.forward(*args, **kw)
        if isinstance(out, ResidualState):
            r = lambda t: t.to(self.dtype).float()  # noqa: E731
            return ResidualState(out.lengths, [r(b) for b in out.blocks], r(out.partial))
        return out
