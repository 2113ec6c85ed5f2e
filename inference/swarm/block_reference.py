"""The validator's reference of any block of layers, read from its checkpoint on disk as checks need it.

`BlockReference(checkpoint, memory_bytes)` answers `reference[(start, stop)]` with a `Stage` over layers
[start, stop) (what a stage check re-runs a stage's recorded session on: scoring.stage_checks.recheck_opened),
and runs a block over one sequence (`run_block`) or the head over some rows (`head`) for the openings of a
whole-model miner's state commitment (scoring.openings). Every block shares one `LazyK3Model`
(inference.model.lazy): the checkpoint is never loaded whole; a check reads the layers it runs and, of each MoE
layer, the routed experts its tokens pick, and holds at most `memory_bytes` of weights, evicting what was used
least recently. With `device` "cuda" the weights and the computation are on the GPU, under a budget of its
memory; states come in from and go back to the host, where the checks compare them.

What a check costs is measured (`track()`: the bytes it read from the checkpoint, the tensors and sites it read
and evicted, the process CPU seconds and wall seconds it took, the most weight bytes the reference held, and the
process's peak resident memory while it ran, where the kernel lets a process reset that peak). Checks run one at
a time (`track` holds the reference), so those numbers are each check's own.

`ModelReferences(model)` is the same mapping over a model already in memory (tests, benchmarks, a validator
given `--reference-engine` for its whole-model audits that also wants its stage checks on the same copy).
"""
from __future__ import annotations

import contextlib
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Optional, Sequence

import torch
from torch import Tensor

from inference.model.device import model_device
from inference.model.k3 import KimiK3Model, ResidualState
from inference.model.lazy import LazyK3Model, WeightTraffic
from inference.swarm.stage import LayerRange, Stage

REFERENCE_FINGERPRINT = "validator-reference"
_PROC_STATUS = Path("/proc/self/status")
_PROC_CLEAR_REFS = Path("/proc/self/clear_refs")


@dataclass
class CheckCost:
    """What one check cost the validator."""

    bytes_read: int = 0  # weight bytes read from the checkpoint
    tensors_read: int = 0
    sites_loaded: int = 0  # layers, experts, embedding or head made resident
    sites_evicted: int = 0
    cpu_s: float = 0.0  # process CPU seconds
    wall_s: float = 0.0
    peak_resident_bytes: int = 0  # the most weight bytes the reference held
    peak_rss_bytes: Optional[int] = None  # the process's peak resident memory while the check ran (Linux)

    def as_row(self) -> dict:
        return {"weights_read": self.bytes_read, "peak_resident": self.peak_resident_bytes,
                "peak_rss": self.peak_rss_bytes}


def rss_peak() -> Optional[int]:
    """This process's peak resident memory since it started or was last reset (VmHWM; None off Linux)."""
    try:
        for line in _PROC_STATUS.read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def reset_rss_peak() -> bool:
    """Reset the kernel's record of this process's peak resident memory to what it holds now (Linux)."""
    try:
        _PROC_CLEAR_REFS.write_text("5")
        return True
    except OSError:
        return False


class _References:
    """The mapping part: one Stage per block, made on first use, over one model."""

    model: KimiK3Model

    def __init__(self):
        self._stages: dict[tuple[int, int], Stage] = {}
        self._check = threading.Lock()
        self.rss_high_water = 0  # the process's peak resident memory before the latest check reset it

    def __getitem__(self, block: tuple[int, int]) -> Stage:
        start, stop = (int(x) for x in block)
        stage = self._stages.get((start, stop))
        if stage is None:
            stage = Stage(self.model, LayerRange(start, stop, self.model.config.num_layers),
                          fingerprint=REFERENCE_FINGERPRINT)
            self._stages[(start, stop)] = stage
        return stage

    @property
    def config(self):
        return self.model.config

    def run_block(self, start: int, stop: int, inputs) -> ResidualState:
        """Layers [start, stop) over one fresh sequence: `inputs` are token ids [N] when start == 0, else the
        ResidualState entering layer `start` at positions 0..N-1; the state leaving layer stop - 1."""
        cache = self.model.new_cache(range(start, stop))
        device = model_device(self.model)
        with torch.inference_mode():
            if start == 0:
                state = self.model.embed(torch.as_tensor(inputs, dtype=torch.long).to(device))
            else:
                state = _on(ResidualState((int(inputs.partial.shape[0]),), inputs.blocks, inputs.partial), device)
            return _on(self.model.run_layers(start, stop, state, [cache]), torch.device("cpu"))

    def head(self, state: ResidualState, rows: Sequence[int] | None = None) -> Tensor:
        """fp32 logits [n, V] of the head at `rows` of the state entering it (all rows when None), on the host."""
        with torch.inference_mode():
            return self.model.head(_on(state, model_device(self.model)), rows).cpu()

    def _traffic(self) -> WeightTraffic:
        return WeightTraffic()

    @contextlib.contextmanager
    def track(self) -> Iterator[CheckCost]:
        """Hold the reference for one check and measure it; the CheckCost is filled when the block exits."""
        with self._check:
            cost = CheckCost()
            before = self._traffic().copy()
            traffic = self._traffic()
            traffic.peak_resident_bytes = traffic.resident_bytes
            self.rss_high_water = max(self.rss_high_water, rss_peak() or 0)  # what the reset forgets
            reset = reset_rss_peak()
            cpu, wall = time.process_time(), time.perf_counter()
            try:
                yield cost
            finally:
                after = self._traffic()
                cost.cpu_s = time.process_time() - cpu
                cost.wall_s = time.perf_counter() - wall
                cost.bytes_read = after.bytes_read - before.bytes_read
                cost.tensors_read = after.tensors_read - before.tensors_read
                cost.sites_loaded = after.sites_loaded - before.sites_loaded
                cost.sites_evicted = after.sites_evicted - before.sites_evicted
                cost.peak_resident_bytes = after.peak_resident_bytes
                cost.peak_rss_bytes = rss_peak() if reset else None


def _on(state: ResidualState, device: torch.device) -> ResidualState:
    """The state as fp32 on `device` (the checks read the host's; the blocks compute on the reference's)."""
    return ResidualState(tuple(state.lengths), [b.to(device, torch.float32) for b in state.blocks],
                         state.partial.to(device, torch.float32))


class BlockReference(_References):
    """Blocks of the checkpoint at `checkpoint`, holding at most `memory_bytes` of weights (module doc) on `device`
    (its memory, a GPU's on "cuda")."""

    def __init__(self, checkpoint: str | Path, memory_bytes: int, dtype: torch.dtype = torch.float32,
                 verify_tensors: bool | None = None, device: torch.device | str = "cpu"):
        super().__init__()
        self.model = LazyK3Model(checkpoint, memory_bytes, dtype, verify_tensors, device=device)
        self.memory_bytes = int(memory_bytes)

    def _traffic(self) -> WeightTraffic:
        return self.model.traffic

    def close(self) -> None:
        self.model.close()


class ModelReferences(_References):
    """Blocks of a model already held in memory (the whole model; nothing is read or evicted)."""

    def __init__(self, model: KimiK3Model):
        super().__init__()
        self.model = model


def references_for(source) -> _References:
    """A BlockReference or ModelReferences as given, or ModelReferences over a model given instead."""
    return source if isinstance(source, _References) else ModelReferences(source)


__all__ = ["BlockReference", "CheckCost", "ModelReferences", "REFERENCE_FINGERPRINT", "references_for", "reset_rss_peak",
           "rss_peak"]
