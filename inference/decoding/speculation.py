"""Per-sequence speculative decoding: how many tokens to draft, the verify step, and the statistics.

A decode step for a sequence with speculation runs 1 + k positions: the last emitted token and k drafted
ones (k = 0 is a plain step). `SequenceSpeculation.drafts()` decides k and gets the drafts; the caller
marks the cache (`cache.mark()`), runs the forward with all logits, calls `judge()`, and rewinds the cache
to the kept positions (`cache.rewind(start + 1 + verdict.accepted)`). `speculative_generate` is that loop
for one sequence on a model; the serving engine runs the same per sequence inside its batches.

Adaptive k. A copying drafter's guesses come in runs: once the copied text agrees with the model, the next
copied token very likely agrees too, and a wrong guess usually ends the run. So the model of acceptance has
two rates: a (the first draft of a step is accepted) and r (a draft is accepted given the one before it
was). A verify step of k drafts then emits E(k) = 1 + a * (1 - r^k) / (1 - r) tokens (1 + a + a*r + ...
+ a*r^(k-1)) and costs about 1 + c*k plain steps (c = `verify_cost`: the price of one more position in a
forward). k is the argmax of E(k) / (1 + c*k) over 0..max_draft_tokens: 0 when first drafts are poor, so
novel text decodes plainly, and large once runs of accepted drafts are long. Both estimates are decayed
counts (a prior worth `prior_weight` trials each). On a plain step the drafter is still asked for one
token (free: no model work), and whether it equals the token the step chose updates a, so a sequence
whose text turns repetitive starts speculating again without paying for probes.

Pauses. The estimate of a moves slowly (a prior worth two drafts, then a decayed count), so on novel text,
where a drafter's rare guesses are all wrong, it would take several wasted verify steps before k reaches 0.
So `miss_limit` verify steps in a row that accepted nothing pause drafting for `pause_steps` plain steps; each
probe after a pause that accepts nothing again doubles the pause (up to `max_pause_steps`), and any accepted
draft ends the misses and resets the pause length. A right guess of the drafter on a plain step (the free
check above) ends a pause early: the text has turned repetitive. `fixed_draft_tokens` turns all of this off.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from inference.decoding.acceptance import Verdict, accept_drafts
from inference.decoding.drafters import DRAFTER_KINDS, Draft, Drafter, make_drafter
from inference.decoding.sampling import SamplingParams, TokenSampler
from inference.model.kda import REWIND_MODES

MAX_DRAFT_TOKENS = 16


@dataclass(frozen=True)
class SpeculationConfig:
    drafter: str = "none"  # "none" | "ngram" | "suffix" | "distilled" (with drafter_factory set)
    max_draft_tokens: int = 8
    verify_cost: float = 0.1  # extra cost of one more position in a forward, relative to a one-token step
    rewind_mode: str = "snapshot"  # how KDA layers roll back (kda.KDARewindLog)
    prior_acceptance: float = 0.5  # a (first draft of a step accepted) before anything was judged
    prior_run: float = 0.8  # r (a draft accepted given the one before it was) before anything was judged
    prior_weight: float = 2.0  # ... each worth this many judged drafts
    memory: float = 0.9  # decay of the acceptance counts per judged step
    miss_limit: int = 2  # verify steps in a row that accept nothing before drafting pauses (0: never pause)
    pause_steps: int = 8  # plain steps of the first pause; each failed probe after a pause doubles it ...
    max_pause_steps: int = 64  # ... up to this many
    fixed_draft_tokens: int | None = None  # benchmarks/tests: always draft this many (no adaptation)
    min_match: int | None = None  # shortest history match a drafter copies from (None: the drafter's default)
    # A drafter of one's own per sequence, called with the prompt's token ids (a draft model; a benchmark's
    # drafter of known quality). Overrides `drafter`.
    drafter_factory: Callable[[list[int]], Drafter] | None = None

    @property
    def enabled(self) -> bool:
        return self.drafter != "none" or self.drafter_factory is not None

    def problems(self) -> list[str]:
        out = []
        if self.drafter not in DRAFTER_KINDS:
            out.append(f"speculate must be one of {', '.join(DRAFTER_KINDS)} (got {self.drafter!r})")
        elif self.drafter == "distilled" and self.drafter_factory is None:
            out.append("speculate distilled needs its draft table (--draft-model FILE, made by "
                       "scripts/distill_drafter.py)")
        if not 1 <= self.max_draft_tokens <= MAX_DRAFT_TOKENS:
            out.append(f"max_draft_tokens must lie in 1..{MAX_DRAFT_TOKENS} (got {self.max_draft_tokens})")
        if not self.verify_cost >= 0.0:
            out.append(f"verify_cost must be >= 0 (got {self.verify_cost})")
        if self.rewind_mode not in REWIND_MODES:
            out.append(f"rewind_mode must be one of {', '.join(REWIND_MODES)} (got {self.rewind_mode!r})")
        if not 0.0 < self.prior_acceptance < 1.0 or not 0.0 < self.prior_run < 1.0 or not 0.0 < self.memory <= 1.0:
            out.append("prior_acceptance and prior_run must lie in (0, 1) and memory in (0, 1]")
        if self.min_match is not None and self.min_match < 1:
            out.append(f"min_match must be >= 1 (got {self.min_match})")
        if self.miss_limit < 0 or not 1 <= self.pause_steps <= self.max_pause_steps:
            out.append(f"miss_limit must be >= 0 and 1 <= pause_steps <= max_pause_steps (got {self.miss_limit}, "
                       f"{self.pause_steps}, {self.max_pause_steps})")
        if self.fixed_draft_tokens is not None and not 0 <= self.fixed_draft_tokens <= self.max_draft_tokens:
            out.append(f"fixed_draft_tokens must lie in 0..max_draft_tokens (got {self.fixed_draft_tokens})")
        return out


class _Rate:
    """A decayed success count over a decayed trial count, starting from a prior."""

    def __init__(self, prior: float, weight: float, memory: float):
        self.successes, self.trials, self.memory = prior * weight, weight, memory

    @property
    def value(self) -> float:
        return self.successes / self.trials

    def observe(self, successes: float, trials: float) -> None:
        if trials > 0:
            self.successes = self.memory * self.successes + successes
            self.trials = self.memory * self.trials + trials


class DraftLength:
    """The adaptive k of one sequence (see the module docstring)."""

    def __init__(self, config: SpeculationConfig):
        self.config = config
        self.first = _Rate(config.prior_acceptance, config.prior_weight, config.memory)  # a
        self.run = _Rate(config.prior_run, config.prior_weight, config.memory)  # r

    @property
    def acceptance(self) -> float:
        """a: the probability that a step's first draft is accepted."""
        return self.first.value

    def observe_verdict(self, drafted: int, accepted: int) -> None:
        """A verify step of `drafted` drafts accepted the first `accepted` of them."""
        if drafted <= 0:
            return
        self.first.observe(1.0 if accepted > 0 else 0.0, 1.0)
        if accepted > 0:  # drafts 2 .. min(accepted + 1, drafted) were judged after an accepted one
            self.run.observe(accepted - 1, min(accepted + 1, drafted) - 1)

    def observe_guess(self, right: bool) -> None:
        """The drafter's free one-token guess on a plain step was (not) the chosen token."""
        self.first.observe(1.0 if right else 0.0, 1.0)

    def expected_tokens(self, k: int) -> float:
        """E(k): tokens a verify step of k drafts emits (1 + a + a*r + ... + a*r^(k-1))."""
        a, r = self.first.value, min(self.run.value, 0.999)
        return 1.0 + a * (1.0 - r ** k) / (1.0 - r)

    def best_k(self) -> int:
        c = self.config
        if c.fixed_draft_tokens is not None:
            return c.fixed_draft_tokens
        best, best_rate = 0, 1.0
        for k in range(1, c.max_draft_tokens + 1):
            rate = self.expected_tokens(k) / (1.0 + c.verify_cost * k)
            if rate > best_rate:
                best, best_rate = k, rate
        return best


class SequenceSpeculation:
    """Drafter, adaptive k and counters of one sequence."""

    def __init__(self, config: SpeculationConfig, params: SamplingParams, drafter: Drafter | None = None):
        """`drafter` overrides the one config.drafter names (a draft model, or a test's drafter)."""
        self.config = config
        self.params = params
        self.drafter = drafter if drafter is not None else make_drafter(config.drafter, config.min_match)
        self.length = DraftLength(config)
        self.proposed = 0  # drafted tokens sent to verification
        self.accepted = 0  # of which accepted
        self.verify_steps = 0  # steps that verified at least one draft
        self.plain_steps = 0
        self._shadow: int | None = None  # the drafter's guess on a plain step, judged afterwards
        self.misses = 0  # verify steps in a row that accepted nothing
        self.paused = 0  # plain steps left before drafting resumes
        self.pause_len = config.pause_steps  # the next pause's length
        self.pauses = 0  # pauses begun

    @classmethod
    def for_request(cls, config: SpeculationConfig, params: SamplingParams,
                    prompt_ids: list[int]) -> "SequenceSpeculation":
        drafter = config.drafter_factory(list(prompt_ids)) if config.drafter_factory is not None else None
        return cls(config, params, drafter)

    def drafts(self, history: Sequence[int], limit: int) -> Draft:
        """Drafts for this step (possibly none), at most `limit` (room left in max_tokens and the context)."""
        self._shadow = None
        if self.drafter is None:
            return Draft([])
        k = 0 if self.paused > 0 else min(self.length.best_k(), max(0, limit))
        if self.paused > 0:
            self.paused -= 1
        draft = self.drafter.propose(history, max(k, 1))
        if k == 0:
            self._shadow = draft.tokens[0] if draft.tokens else None
            return Draft([])
        return draft

    def judge(self, draft: Draft, logits: torch.Tensor, sampler: TokenSampler, first_index: int) -> Verdict:
        """Accept or reject `draft` with the verify logits [k+1, V], row 0 being generated-token index
        `first_index`; updates the statistics."""
        verdict = accept_drafts(draft.tokens, logits, sampler, first_index)
        self.record_verdict(len(draft.tokens), verdict.accepted)
        return verdict

    def record_verdict(self, drafted: int, accepted: int) -> None:
        """Count a verify step judged elsewhere (a swarm route's last stage judges the drafts it verifies)."""
        self.proposed += drafted
        self.accepted += accepted
        self.verify_steps += 1
        self.length.observe_verdict(drafted, accepted)
        if self.config.fixed_draft_tokens is not None or self.config.miss_limit == 0:
            return
        if accepted > 0:
            self.misses, self.pause_len = 0, self.config.pause_steps
            return
        self.misses += 1
        if self.misses >= self.config.miss_limit:  # a first pause, or a probe after one that failed again
            self.paused = self.pause_len
            self.pause_len = min(2 * self.pause_len, self.config.max_pause_steps)
            self.pauses += 1

    def observe_plain(self, chosen: int) -> None:
        """After a plain step that chose `chosen`: judge the drafter's unused guess for free. Counting a
        success when guess == chosen estimates the acceptance probability p(guess) without bias, greedy or
        sampled."""
        self.plain_steps += 1
        if self._shadow is not None:
            right = self._shadow == chosen
            self.length.observe_guess(right)
            self._shadow = None
            if right:
                self.paused = 0  # the drafter guesses right again: probe on the next step

    def final_counts(self) -> dict:
        """The counts a request's final event reports."""
        return {"draft_proposed": self.proposed, "draft_accepted": self.accepted, "verify_steps": self.verify_steps}

    def stats(self) -> dict:
        return {**self.final_counts(), "plain_steps": self.plain_steps, "pauses": self.pauses}


@torch.inference_mode()
def speculative_generate(model, prompt_ids: Sequence[int], params: SamplingParams,
                         config: SpeculationConfig, stop_ids: frozenset[int] = frozenset(),
                         drafter: Drafter | None = None) -> tuple[list[int], dict]:
    """Generate up to params.max_tokens for one sequence on `model` (KimiK3Model surface), speculating as
    `config` says (drafter "none" and no `drafter`: plain decoding). Returns (token ids, stats)."""
    problems = config.problems() + params.problems()
    if problems:
        raise ValueError("; ".join(problems))
    sampler = TokenSampler(params)
    spec = SequenceSpeculation(config, params, drafter) if drafter is not None else \
        SequenceSpeculation.for_request(config, params, list(prompt_ids))
    history = [int(t) for t in prompt_ids]
    cache = model.new_cache()
    logits = model.forward([torch.tensor(history, dtype=torch.long)], [cache])[0]
    out: list[int] = []
    token = sampler.choose(logits, 0).token_id
    while True:
        out.append(token)
        history.append(token)
        if len(out) >= params.max_tokens or (token in stop_ids and not params.ignore_eos):
            break
        limit = min(params.max_tokens - len(out) - 1, model.config.max_position_embeddings - len(history) - 1)
        draft = spec.drafts(history, limit)
        fed = torch.tensor([token] + draft.tokens, dtype=torch.long)
        if not draft.tokens:
            logits = model.forward([fed], [cache])[0]
            token = sampler.choose(logits, len(out)).token_id
            spec.observe_plain(token)
            continue
        start = cache.length
        cache.mark(config.rewind_mode)
        rows = model.forward([fed], [cache], all_logits=True)[0]
        verdict = spec.judge(draft, rows, sampler, len(out))
        cache.rewind(start + 1 + verdict.accepted)
        emitted = [t.token_id for t in verdict.tokens]
        for t in emitted[:-1]:  # accepted drafts: already in the cache
            out.append(t)
            history.append(t)
            if len(out) >= params.max_tokens or (t in stop_ids and not params.ignore_eos):
                return out, spec.stats()
        token = emitted[-1]
    return out, spec.stats()


__all__ = ["SpeculationConfig", "SequenceSpeculation", "DraftLength", "speculative_generate", "MAX_DRAFT_TOKENS"]
