"""The one metagraph watcher of the neurons (miner, validator, and the gateway through the validator).

It holds the latest snapshot of a subnet's metagraph and re-reads it with a deadline. A failed read
(a typed chain error, an SDK or OS error, the deadline) keeps the last good snapshot in use and is
counted, so a neuron keeps serving on what it last knew while the chain is unreachable.
"""
from __future__ import annotations

import asyncio
import logging
import time
from typing import Optional

from chain.interface import Chain, MetagraphSnapshot

log = logging.getLogger("k3.chain")


class MetagraphWatch:
    """The latest metagraph snapshot, re-read with a deadline; a failed read keeps the last one."""

    def __init__(self, chain: Chain, netuid: int, timeout_s: float):
        self.chain = chain
        self.netuid = netuid
        self.timeout_s = timeout_s
        self.snapshot: Optional[MetagraphSnapshot] = None
        self.read_at: Optional[float] = None  # monotonic time of the last good read
        self.last_error: Optional[str] = None  # why the latest read failed (None: it worked)
        self.failures = 0

    async def refresh(self) -> bool:
        """Read the metagraph now; True when the read worked (the snapshot is then the new one)."""
        try:
            snapshot = await asyncio.wait_for(self.chain.metagraph(self.netuid), self.timeout_s)
        except asyncio.CancelledError:
            raise
        except Exception as error:  # noqa: BLE001 - any failure to read must leave the last snapshot in use
            self.failures += 1
            self.last_error = "timed out" if isinstance(error, TimeoutError) else type(error).__name__
            log.warning("metagraph read failed (%s: %s); keeping the snapshot of block %s",
                        self.last_error, error, self.snapshot.block if self.snapshot else "none")
            return False
        self.snapshot, self.read_at, self.last_error = snapshot, time.monotonic(), None
        return True

    async def latest(self, max_age_s: float) -> Optional[MetagraphSnapshot]:
        """The snapshot in use, re-read first when it is older than `max_age_s` (or there is none)."""
        age = self.age_s
        if self.snapshot is None or age is None or age >= max_age_s:
            await self.refresh()
        return self.snapshot

    @property
    def age_s(self) -> Optional[float]:
        return None if self.read_at is None else time.monotonic() - self.read_at
