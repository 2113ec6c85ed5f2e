"""Escalation to canaries: when a tier-1 audit's auditors disagree, the miner gets a greedy canary
(a prompt whose reference continuation is known), shaped like any other request."""
from __future__ import annotations

import logging
import random
from typing import Optional

from protocol.schemas import Capabilities

from .config import ScoringConfig
from .verify import Canary, CanaryPool
from .workloads import WorkItem, WorkloadError, canary_item

log = logging.getLogger("k3.scoring")


def canary_escalation(pool: Optional[CanaryPool], rng: random.Random, capabilities: Capabilities,
                      config: ScoringConfig, tokenizer) -> tuple[Optional[Canary], Optional[WorkItem]]:
    """(the canary taken from the pool, the work item that sends it). The canary is None when the
    pool has none that fits the miner's context; the item is None when none could be built from it
    (the canary is used up all the same, so the caller records it as used either way)."""
    if pool is None:
        return None, None
    canary = pool.take(rng, max_prompt_tokens=capabilities.max_context - config.chat_max_tokens[0])
    if canary is None:
        return None, None
    try:
        return canary, canary_item(rng, canary, capabilities, config, tokenizer)
    except WorkloadError as error:
        log.warning("cannot escalate with canary %s: %s", canary.canary_id, error)
        return canary, None
