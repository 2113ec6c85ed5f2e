"""The fp8-dense honest variant of the envelope measurement (issue 17's precision lever).

A miner that holds the dense (non-expert) weights in float8 e4m3 with per-channel scales
(`inference.model.fp8.quantize_dense`, a plan's `dense_dtype: fp8`) serves the same model with rounder
numerics. `fp8_dense_variant(checkpoint)` is that miner as a `scoring.envelope.Variant` (declaring precision
"fp8", so it is judged by the non-exact envelope); `measure_with_fp8(checkpoint, ...)` runs
`scoring.envelope.measure_envelope` on it (one of the built-in variants) beside the fp32 and bf16 baselines,
so the audit statistics it moves can be read side by side:

    python benchmarks/fp8_envelope.py --checkpoint inference/model/assets/tiny_trained --audits 48
"""
from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Iterator, Sequence

from . import envelope
from .envelope import FP8_VARIANT, EnvelopeReport, fp8_dense_variant


@contextlib.contextmanager
def with_variants(extra) -> Iterator[None]:
    """measure_envelope with `extra(checkpoint)` appended to its honest variants, inside this block."""
    build = envelope.build_variants

    def extended(checkpoint, reference, **kw):
        variants = build(checkpoint, reference, **kw)
        honest = sum(1 for v in variants if v.honest)
        return variants[:honest] + [extra(checkpoint)] + variants[honest:]

    envelope.build_variants = extended
    try:
        yield
    finally:
        envelope.build_variants = build


def measure_with_fp8(checkpoint: str | Path, *, only: Sequence[str] | None = ("fp32-batched", "bf16", FP8_VARIANT),
                     **kw) -> EnvelopeReport:
    """measure_envelope(checkpoint, ...) on the fp8-dense variant (by default beside the fp32 and bf16 ones)."""
    return envelope.measure_envelope(checkpoint, only=list(only) if only else None, **kw)


__all__ = ["fp8_dense_variant", "measure_with_fp8", "with_variants", "FP8_VARIANT"]
