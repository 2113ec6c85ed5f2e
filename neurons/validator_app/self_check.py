"""`validator.py self-check --endpoint URL`: this validator's checks run against a miner's served endpoint.

An operator points it at its own deployment before registering (or after a change of hardware,
kernels or precision): it plans ordinary rounds for the miner's declared capabilities (chat, long
context, bursts, probes, canaries computed by the local reference), sends them signed to the
endpoint, runs tier 0 on every answer, audits every answer teacher-forced against the local fp32
reference checkpoint (tier 1) and checks the canaries (tier 2), exactly as a validator with its own
reference engine would. The verdict:

- FAIL on any hard failure (what zeroes a miner for 24 h), on any other tier-0 failure (broken
  counts, logprobs, signatures: fix the deployment), on soft audit or canary failures over
  `SOFT_RATE_ALLOWED` of the audits (honest numerics stay under it; a validator zeroes at 15%), on
  more than one failed long-context audit at that rate (judged on their own), or when more than
  `ERROR_RATE_ALLOWED` of the requests end in an error;
- PASS otherwise.

    check = await check_endpoint(url, miner_hotkey, wallet, checkpoint, requests=60)
    print("\\n".join(check.summary_lines()))
"""
from __future__ import annotations

import asyncio
import random
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Callable, Optional

from inference.serving import EngineSettings, LocalEngine, load_reference_model
from protocol.client import (ClientTimeouts, GenerateResult, MinerClient, MinerError, MinerHTTPError, MinerTimeout,
                             MinerUnreachable)
from protocol.schemas import Capabilities
from scoring.audit_sequence import Verification, verify_item
from scoring.canaries import CanaryPool
from scoring.config import ScoringConfig
from scoring.failures import Failure
from scoring.workloads import WorkItem, WorkloadError, canary_item, canary_prompts, group_bursts, plan_round

from .rounds import _answer_counts, reference_capabilities

SOFT_RATE_ALLOWED = 0.01  # the false-positive rate the envelope promises honest numerics stay under
ERROR_RATE_ALLOWED = 0.1
HEALTH_TIMEOUTS = ClientTimeouts(connect=3.0, first_byte=5.0, between_events=5.0, total=8.0)


class SelfCheckError(RuntimeError):
    """The check could not run (endpoint unreachable, signature refused, ...); the message says why."""


@dataclass
class Answered:
    item: WorkItem
    verification: Optional[Verification] = None
    error: Optional[str] = None

    def failures(self, config: ScoringConfig) -> list[Failure]:
        if self.verification is None:
            return []
        v = self.verification
        return [f for f in v.failures if f not in v.answer or _answer_counts(self.item, config)]


@dataclass
class EndpointCheck:
    url: str
    capabilities: Capabilities
    reference_fingerprint: str
    config: ScoringConfig
    answered: list[Answered] = field(default_factory=list)
    seconds: float = 0.0

    # ---------------------------------------------------------------- counts
    @property
    def fingerprint_matches(self) -> bool:
        return self.capabilities.model_fingerprint == self.reference_fingerprint

    @property
    def errors(self) -> list[Answered]:
        return [a for a in self.answered if a.error is not None]

    def audits(self, long_only: bool = False) -> list[Answered]:
        return [a for a in self.answered if a.verification is not None and a.verification.audit is not None
                and a.verification.audit.passed is not None and (a.item.kind == "long_context" or not long_only)]

    def failed_audits(self, long_only: bool = False) -> list[Answered]:
        return [a for a in self.audits(long_only) if not a.verification.audit.passed]

    def canaries(self) -> list[Answered]:
        return [a for a in self.answered if a.verification is not None and a.verification.tier2 is not None]

    def hard_failures(self) -> list[tuple[Answered, Failure]]:
        return [(a, f) for a in self.answered for f in a.failures(self.config) if f.hard]

    def tier0_failures(self) -> list[tuple[Answered, Failure]]:
        return [(a, f) for a in self.answered if a.verification is not None for f in a.verification.tier0]

    def soft_failures(self) -> list[tuple[Answered, Failure]]:
        return [(a, f) for a in self.answered for f in a.failures(self.config) if not f.hard]

    # ---------------------------------------------------------------- the verdict
    def verdict(self) -> tuple[bool, list[str]]:
        """(passed, the reasons it failed)."""
        reasons = []
        if not self.fingerprint_matches:
            reasons.append(f"the endpoint serves model {self.capabilities.model_fingerprint}, the reference checkpoint "
                           f"is {self.reference_fingerprint}: it does not serve the released weights")
        hard = self.hard_failures()
        if hard:
            checks = Counter(f.check for _, f in hard)
            reasons.append(f"{len(hard)} hard failures ({_counted(checks)}): a validator zeroes this miner for 24 h")
        soft_tier0 = [(a, f) for a, f in self.tier0_failures() if not f.hard]
        if soft_tier0:
            reasons.append(f"{len(soft_tier0)} tier-0 failures ({_counted(Counter(f.check for _, f in soft_tier0))}): "
                           "the answers break the protocol's checks")
        audits, failed = self.audits(), self.failed_audits()
        failed_canaries = [a for a in self.canaries() if not a.verification.tier2.passed]
        soft_judged = len(failed) + len(failed_canaries)
        if soft_judged > SOFT_RATE_ALLOWED * max(1, len(audits)):
            checks = Counter(f.check for a in failed for f in a.verification.audit.failures)
            checks.update(f.check for a in failed_canaries for f in a.verification.tier2.failures)
            reasons.append(f"{len(failed)} of {len(audits)} audits and {len(failed_canaries)} of "
                           f"{len(self.canaries())} canaries failed ({_counted(checks)}); honest numerics fail under "
                           f"{SOFT_RATE_ALLOWED:.0%}")
        long_audits, long_failed = self.audits(True), self.failed_audits(True)
        if len(long_failed) >= 2 and len(long_failed) > SOFT_RATE_ALLOWED * len(long_audits):
            reasons.append(f"{len(long_failed)} of {len(long_audits)} long-context audits failed: the answers on long "
                           "prompts do not come from the model over the whole context")
        if len(self.errors) > ERROR_RATE_ALLOWED * max(1, len(self.answered)):
            reasons.append(f"{len(self.errors)} of {len(self.answered)} requests ended in an error (first: "
                           f"{self.errors[0].error})")
        if not audits and not reasons:
            reasons.append("no answer could be audited")
        return not reasons, reasons

    def summary_lines(self) -> list[str]:
        caps = self.capabilities
        kinds = Counter(a.item.kind for a in self.answered)
        audits, failed = self.audits(), self.failed_audits()
        hard = self.hard_failures()
        soft_audits = [a for a in failed if not a.verification.audit.hard]
        lines = [f"miner {self.url}: model {caps.model_id}, fingerprint {caps.model_fingerprint} "
                 f"({'matches' if self.fingerprint_matches else 'DIFFERS FROM'} the reference checkpoint), engine "
                 f"{caps.engine}, precision {caps.precision} (judged by the "
                 f"{'fp32' if caps.precision.lower() in self.config.exact_precisions else 'wide (bf16)'} envelope)",
                 f"requests: {len(self.answered)} ({_counted(kinds)}) in {self.seconds:.0f} s, errors: {len(self.errors)}",
                 f"tier 0 (every answer): {len(self.tier0_failures())} failures",
                 f"tier 1 audits against the fp32 reference: {len(audits)}, {len(failed) - len(soft_audits)} hard and "
                 f"{len(soft_audits)} soft failures (false-positive rate for an honest miner: "
                 f"{len(failed) / max(1, len(audits)):.4f}; long-context audits {len(self.failed_audits(True))} of "
                 f"{len(self.audits(True))} failed)",
                 f"tier 2 canaries: {len(self.canaries())}, "
                 f"{sum(1 for a in self.canaries() if not a.verification.tier2.passed)} failed"]
        shown = hard + [(a, f) for a, f in self.soft_failures()]
        if shown or self.errors:
            lines.append("failures:")
        for a, f in shown[:20]:
            lines.append(f"  {a.item.kind:13} {a.item.prompt_tokens:6d} prompt tokens  {f}")
        if len(shown) > 20:
            lines.append(f"  ... and {len(shown) - 20} more")
        for a in self.errors[:5]:
            lines.append(f"  {a.item.kind:13} {a.item.prompt_tokens:6d} prompt tokens  error: {a.error}")
        passed, reasons = self.verdict()
        if passed:
            lines.append(f"verdict: PASS - {len(audits)} audits, no hard failure, soft failures under "
                         f"{SOFT_RATE_ALLOWED:.0%}: this deployment is inside the honest-numerics envelope")
        else:
            lines.append("verdict: FAIL - " + "; ".join(reasons))
        return lines


def _counted(counter: Counter) -> str:
    return ", ".join(f"{name} {n}" for name, n in counter.most_common())


def explain_error(url: str, error: MinerError) -> str:
    """What a failed call to the endpoint means for the operator."""
    if isinstance(error, MinerUnreachable):
        return f"cannot reach the miner at {url} ({error}); is it running, and is --endpoint its http://HOST:PORT?"
    if isinstance(error, MinerTimeout):
        return f"the miner at {url} did not answer in time ({error}); is it overloaded or stuck?"
    if isinstance(error, MinerHTTPError) and (error.status == 401 or error.code == "wrong_receiver"):
        return (f"the miner at {url} refused the signed request ({error}); --miner-hotkey must be the ss58 address "
                "of the hotkey this miner serves with")
    if isinstance(error, MinerHTTPError) and error.status == 403:
        return (f"the miner at {url} does not accept the signing wallet ({error}); sign with a hotkey it serves: a "
                "validator on its subnet with a permit and the stake it asks (--wallet-name/--wallet-hotkey)")
    return f"the miner at {url} failed: {type(error).__name__}: {error}"


async def check_endpoint(url: str, miner_hotkey: str, wallet, checkpoint: str, *, requests: int = 60,
                         canaries: int = 8, config: Optional[ScoringConfig] = None,
                         timeouts: ClientTimeouts = ClientTimeouts(connect=5.0, first_byte=120.0, between_events=30.0,
                                                                   total=300.0),
                         seed: Optional[int] = None,
                         progress: Optional[Callable[[str], None]] = None) -> EndpointCheck:
    """Plan, send, verify and audit about `requests` requests on the endpoint (module docstring)."""
    config = config or ScoringConfig()
    rng = random.Random(seed)
    say = progress or (lambda line: None)
    async with MinerClient(wallet.hotkey, timeouts) as client:
        try:
            await client.health(url, HEALTH_TIMEOUTS)
            capabilities = await client.capabilities(url, miner_hotkey, HEALTH_TIMEOUTS)
        except MinerError as error:
            raise SelfCheckError(explain_error(url, error)) from None
        model, tokenizer, fingerprint = load_reference_model(checkpoint)
        max_context = min(capabilities.max_context, model.config.max_position_embeddings)
        engine = LocalEngine(model, tokenizer, EngineSettings(max_context=max_context, max_concurrent_sequences=16),
                             model_fingerprint=fingerprint)
        check = EndpointCheck(url, capabilities, fingerprint, config)
        if not check.fingerprint_matches:
            return check
        caps = capabilities.model_copy(update=dict(max_context=max_context))
        started = time.monotonic()
        await engine.start()
        try:
            pool = await CanaryPool.from_engine(engine, canary_prompts(rng, canaries, reference_capabilities(engine),
                                                                       config, tokenizer),
                                                config, model_fingerprint=fingerprint) if canaries else None
            items: list[WorkItem] = []
            while len(items) < requests:
                try:
                    items += plan_round(rng, caps, config, tokenizer=tokenizer, canaries=pool)
                except WorkloadError as error:
                    raise SelfCheckError(f"cannot plan work for this miner: {error}") from None
            while pool is not None and pool.remaining:  # every canary is sent (the rounds draw only some)
                canary = pool.take(rng, max_prompt_tokens=max_context - config.canary_tokens)
                if canary is None:
                    break
                items.append(canary_item(rng, canary, caps, config, tokenizer, max_tokens=config.canary_tokens))
            singles, bursts = group_bursts(items)
            units = [[item] for item in singles] + list(bursts.values())
            rng.shuffle(units)
            say(f"{len(items)} requests ({len(singles)} single, {len(bursts)} bursts) to {url}")
            for index, unit in enumerate(units):
                outcomes = await asyncio.gather(*(client.generate(url, miner_hotkey, item.request)
                                                  for item in unit), return_exceptions=True)
                for item, outcome in zip(unit, outcomes):
                    check.answered.append(await _verify(item, outcome, engine, tokenizer, capabilities,
                                                        miner_hotkey, config, rng))
                if (index + 1) % 10 == 0:
                    say(f"{len(check.answered)} answered, {len(check.failed_audits())} audits failed")
        finally:
            await engine.stop()
        check.seconds = time.monotonic() - started
        return check


async def _verify(item: WorkItem, outcome, engine, tokenizer, capabilities: Capabilities, miner_hotkey: str,
                  config: ScoringConfig, rng: random.Random) -> Answered:
    if isinstance(outcome, MinerError):
        return Answered(item, error=f"{type(outcome).__name__}: {outcome}")
    if isinstance(outcome, BaseException):
        raise outcome
    assert isinstance(outcome, GenerateResult)
    verification = await verify_item(item, outcome, tokenizer=tokenizer, capabilities=capabilities,
                                     miner_hotkey=miner_hotkey, config=config, reference=engine, audit=True, rng=rng)
    return Answered(item, verification)


__all__ = ["check_endpoint", "EndpointCheck", "SelfCheckError", "explain_error", "SOFT_RATE_ALLOWED"]
