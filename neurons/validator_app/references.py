"""The validator's one block reference: what its stage checks and the openings of whole-model miners' state
commitments re-run blocks on (inference.swarm.block_reference), read from --checkpoint on disk under
--reference-memory GB and made on first need. Nothing here loads the whole model; the whole-model reference
engine of tier-1 audits and canaries is the separate, explicit --reference-engine (docs/validating.md)."""
from __future__ import annotations

import logging
import threading

log = logging.getLogger("k3.validator.reference")


class SharedReference:
    """A BlockReference over `checkpoint` holding at most `memory_bytes` of weights on `device` in `dtype` (the
    validator's --device and --dtype: fp32 unless told otherwise), made once, on first `get()` (from any thread)."""

    def __init__(self, checkpoint: str, memory_bytes: int, device: str = "cpu", dtype: str = "float32"):
        self.checkpoint = checkpoint
        self.memory_bytes = int(memory_bytes)
        self.device, self.dtype = device, dtype
        self._reference = None
        self._lock = threading.Lock()

    def get(self):
        with self._lock:
            if self._reference is None:
                # torch, on first need
                from inference.model.device import resolve_device, resolve_dtype  # noqa: PLC0415
                from inference.swarm.block_reference import BlockReference  # noqa: PLC0415

                device = resolve_device(self.device)
                self._reference = BlockReference(self.checkpoint, self.memory_bytes,
                                                 resolve_dtype(self.dtype, device), device=device)
                log.info("block reference over %s on %s: at most %.2f GiB of weights held, %.2f GiB for one layer",
                         self.checkpoint, device, self.memory_bytes / 2**30,
                         self._reference.model.working_set_bytes() / 2**30)
            return self._reference

    @property
    def made(self) -> bool:
        return self._reference is not None

    def close(self) -> None:
        if self._reference is not None:
            self._reference.close()


def shared_reference(loop, settings) -> SharedReference:
    """The loop's block reference (`loop.block_reference`), made the first time a part of the validator asks."""
    existing = getattr(loop, "block_reference", None)
    if existing is None:
        existing = SharedReference(settings.engine.checkpoint, settings.reference_memory_bytes,
                                   settings.engine.device, settings.engine.dtype)
        loop.block_reference = existing
    return existing


__all__ = ["SharedReference", "shared_reference"]
