"""What every check reports: a `Failure(check, reason, hard)` (docs/verification.md).

Hard failures are the ones only a cheater produces (bad signature, inflated counts, buffered stream,
canary mismatch, a greedy answer the trusted reference says came from another model); a confirmed hard
failure zeroes the miner for 24 h. Soft failures make a request unverified (and, for audits, count
towards the audit failure rate).
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Failure:
    check: str  # short machine name, e.g. "usage_completion", "buffered_stream", "canary_mismatch"
    reason: str  # what was seen, for logs and for the miner's operator
    hard: bool = False

    def __str__(self) -> str:
        return f"{self.check}{' (hard)' if self.hard else ''}: {self.reason}"


__all__ = ["Failure"]
