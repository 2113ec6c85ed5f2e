"""Seeded workloads that look like ordinary traffic (docs/subnet.md section 3).

`plan_round(rng, capabilities, config, tokenizer=...)` returns the round's `WorkItem`s for one
miner: chat, long-context, burst streams and quality probes, in the configured mix (fractions
of requests; a burst of N streams counts N). Each item holds the `GenerateRequest` to send and,
on the validator's side only, what it expects (`Expectation`: the planted answer, the text to
copy, the canary). Nothing in a request tells a probe from ordinary traffic:

- every request has the same fields, a random 128-bit request id, a random seed, the same
  `logprobs`, top_p = 1, top_k = 0, no stop strings, and the same prompt format;
- chat, burst and probe requests draw max_tokens and prompt sizes from the same ranges, and
  a share of ordinary requests is greedy, so greedy canaries blend in;
- probes use the same task templates as chat (ordinary chat also asks for copies and planted
  facts); a probe is only a chat request whose answer the validator checks.

Long-context requests are recognisable by their size, which is fine: they are ordinary
traffic of their own kind, and whether one is audited is decided after the answer arrives.

Resends (`with_resends`): a share of a round's sampled chat requests are replaced by a sampled chat
request the same miner answered in an earlier round, sent again with another seed and request id
(users repeat prompts too). A miner that caches answers by prompt returns the cached tokens, drawn
with the first seed; every resend is audited, and the replay of the new seed fails it.
"""
from __future__ import annotations

import math
import random
from dataclasses import dataclass, field
from typing import Optional

from protocol.schemas import Capabilities, GenerateRequest

from . import corpus
from .canaries import Canary, CanaryPool
from .config import ScoringConfig

KINDS = ("chat", "long_context", "burst", "probe")
PROBE_KINDS = ("canary", "copy", "planted_fact")
# Task families shared by chat and probes, so that a probe's wording marks nothing.
TASKS = ("summarise", "continue", "explain_code", "bullet_list", "question", "copy", "planted_fact")


class WorkloadError(ValueError):
    """A workload that cannot be built for this miner (e.g. its declared context is too small)."""


@dataclass(frozen=True)
class Expectation:
    """What the validator expects of an answer. Never sent to the miner."""

    probe: Optional[str] = None  # "canary" | "copy" | "planted_fact" for a quality probe
    answer: Optional[str] = None  # planted value a correct answer contains
    subject: Optional[str] = None  # whose access code was planted
    depth: Optional[float] = None  # fraction of the prompt's tokens before the planted fact
    copy_text: Optional[str] = None  # text an exact-copy answer must contain
    canary: Optional[Canary] = None  # known greedy continuation (tier 2)


@dataclass(frozen=True)
class WorkItem:
    kind: str  # one of KINDS
    request: GenerateRequest
    prompt_ids: tuple[int, ...]  # the validator's tokenization: what the miner must condition on
    expect: Expectation = field(default_factory=Expectation)
    burst_id: Optional[str] = None  # streams of one burst share it; send them at the same time
    burst_size: int = 1
    resend_of: Optional[str] = None  # a resend: the request id of the earlier request with this prompt

    @property
    def sampled_chat(self) -> bool:
        """An ordinary chat request at a temperature above 0: what a resend repeats."""
        return self.kind == "chat" and self.burst_id is None and self.request.temperature > 0

    @property
    def prompt_tokens(self) -> int:
        return len(self.prompt_ids)

    @property
    def is_probe(self) -> bool:
        return self.expect.probe is not None


# ------------------------------------------------------------------ random draws
def request_id(rng: random.Random) -> str:
    return f"{rng.getrandbits(128):032x}"


def _log_uniform_int(rng: random.Random, low: int, high: int) -> int:
    return _log_uniform_at(rng.random(), low, high)


def _log_uniform_at(u: float, low: int, high: int) -> int:
    """The log-uniform integer in [low, high] at quantile u."""
    if high <= low:
        return low
    value = int(round(math.exp(math.log(low) + u * (math.log(high) - math.log(low)))))
    return min(max(value, low), high)


class _Shape:
    """The shape of one item (prompt size, max_tokens, temperature) as quantiles drawn from the
    round's shape stream: four draws per item whatever its kind, so that every miner of a round,
    planned from the same shape seed, gets the same sizes, lengths and temperatures in the same
    order (content and request ids still differ per miner)."""

    def __init__(self, rng: random.Random):
        self.size, self.new, self.greedy, self.temperature = (rng.random() for _ in range(4))

    def temperature_for(self, config: ScoringConfig) -> float:
        if self.greedy < config.greedy_fraction:
            return 0.0
        low, high = config.temperature_range
        return round(low + self.temperature * (high - low), 3)


def _stochastic_round(rng: random.Random, x: float) -> int:
    whole = math.floor(x)
    return whole + (1 if rng.random() < x - whole else 0)


def draw_temperature(rng: random.Random, config: ScoringConfig) -> float:
    if rng.random() < config.greedy_fraction:
        return 0.0
    return round(rng.uniform(*config.temperature_range), 3)


# ------------------------------------------------------------------ prompt building
class _PromptBuilder:
    """Turns task content into prompt ids (and text) of about a target size, within limits."""

    def __init__(self, tokenizer, config: ScoringConfig):
        self.tokenizer = tokenizer
        self.config = config
        sample = "\n\n".join(corpus.paragraph(random.Random(7), genre) for genre in corpus.GENRES)
        self.chars_per_token = max(len(sample) / max(len(tokenizer.encode(sample)), 1), 0.25)
        self.overhead = len(self.ids(""))

    def ids(self, content: str) -> list[int]:
        if self.config.prompt_format == "token_ids":
            return self.tokenizer.apply_chat_template([{"role": "user", "content": content}])
        return self.tokenizer.encode(content)

    def fit(self, head: str, body: list[str], tail: str, limit: int, keep: int = 0,
            strict: bool = True) -> tuple[str, list[int], int]:
        """Join head, body paragraphs and tail; drop body paragraphs from the end, keeping at least
        the first `keep` + 1, until the prompt has at most `limit` tokens. When the kept part alone
        is over the limit: raise if `strict`, else return it. Returns (content, ids, paragraphs kept)."""
        body = list(body)
        while True:
            content = head + "\n\n".join(body) + tail
            ids = self.ids(content)
            if len(ids) <= limit:
                return content, ids, len(body)
            droppable = len(body) - (keep + 1)
            if droppable <= 0:
                if strict:
                    raise WorkloadError(f"cannot fit the task into {limit} prompt tokens ({len(ids)} needed)")
                return content, ids, len(body)
            # Drop about enough paragraphs at once (one pass for large prompts), at least one.
            over, drop, excess = len(ids) - limit, 0, 0.0
            for text in reversed(body[keep + 1:]):
                drop += 1
                excess += (len(text) + 2) / self.chars_per_token
                if excess >= over:
                    break
            body = body[: len(body) - drop]

    def with_fact(self, head: str, body: list[str], tail: str, fact: str, limit: int, depth: float,
                  strict: bool = True) -> tuple[str, list[int]]:
        """Trim the body to leave room for `fact`, then insert it at `depth` (fraction of the body)."""
        reserve = len(self.tokenizer.encode(fact)) + 4
        _, _, kept = self.fit(head, body, tail, max(limit - reserve, 1), strict=False)
        body = body[:kept]
        total = sum(len(text) + 2 for text in body)
        at, running = 0, 0.0
        while at < len(body) and running + len(body[at]) + 2 <= depth * total:
            running += len(body[at]) + 2
            at += 1
        body.insert(at, fact)
        content, ids, _ = self.fit(head, body, tail, limit, keep=at, strict=strict)
        return content, ids

    def chars_for(self, tokens: int) -> int:
        return max(int(tokens * self.chars_per_token), 1)


def _copy_text(rng: random.Random, builder: _PromptBuilder, config: ScoringConfig) -> str:
    target = rng.randint(*config.copy_text_tokens)
    text = corpus.paragraph(rng, rng.choice(("story", "report", "manual", "letter", "recipe")))
    while len(builder.tokenizer.encode(text)) < target:
        text += " " + corpus.paragraph(rng, "story")
    words = text.split(" ")
    while len(words) > 1 and len(builder.tokenizer.encode(" ".join(words))) > target:
        words.pop()
    return " ".join(words)


def _task_content(rng: random.Random, task: str, size: int, builder: _PromptBuilder,
                  config: ScoringConfig) -> tuple[str, list[int], Expectation]:
    """A chat-style task of about `size` prompt tokens (never more). The expectation names what
    a correct answer contains, for the tasks that have one."""
    chars = builder.chars_for(max(size - builder.overhead, 1))
    if task == "copy":
        text = _copy_text(rng, builder, config)
        content = f"Repeat the following text exactly, with nothing before or after it:\n\n{text}"
        return content, builder.ids(content), Expectation(copy_text=text)
    if task == "planted_fact":
        subject, value = corpus.person_name(rng), corpus.access_code(rng)
        content, ids = builder.with_fact("", corpus.paragraphs(rng, chars), "\n\n" + corpus.planted_question(subject),
                                         corpus.planted_fact(subject, value), size, rng.random(), strict=False)
        return content, ids, Expectation(answer=value, subject=subject)
    if task == "explain_code":
        head = "Explain what this code does, step by step:\n\n"
        body = [corpus.code_snippet(rng)]
        while sum(len(b) for b in body) < chars:
            body.append(corpus.code_snippet(rng))
        content, ids, _ = builder.fit(head, body, "", size, strict=False)
        return content, ids, Expectation()
    heads = {
        "summarise": "Summarise the following text in a few sentences.\n\n",
        "continue": "Continue the following text in the same style.\n\n",
        "bullet_list": "Rewrite the key points of the following text as a bulleted list.\n\n",
        "question": f"Answer briefly: what does the text below say about {rng.choice(corpus.TOPICS)}?\n\n",
    }
    if task not in heads:
        raise ValueError(f"unknown task {task!r}; use one of {TASKS}")
    content, ids, _ = builder.fit(heads[task], corpus.paragraphs(rng, chars), "", size, strict=False)
    return content, ids, Expectation()


# ------------------------------------------------------------------ items
class _Planner:
    def __init__(self, rng: random.Random, capabilities: Capabilities, config: ScoringConfig, tokenizer,
                 shape_rng: Optional[random.Random] = None):
        self.rng = rng
        self.shapes = shape_rng or rng
        self.shape = _Shape(self.shapes)
        self.caps = capabilities
        self.config = config
        self.tokenizer = tokenizer
        self.builder = _PromptBuilder(tokenizer, config)
        limits = capabilities.limits
        self.max_new = min(config.chat_max_tokens[1], limits.max_tokens)
        self.min_new = min(config.chat_max_tokens[0], self.max_new)
        self.max_prompt = min(limits.max_prompt_tokens, capabilities.max_context - self.max_new)
        if self.max_prompt < max(config.chat_prompt_tokens[0], self.builder.overhead + 8):
            raise WorkloadError(
                f"the miner declares a context of {capabilities.max_context} tokens (max_tokens limit "
                f"{limits.max_tokens}); chat requests need room for a {config.chat_prompt_tokens[0]}-token prompt "
                f"plus up to {self.max_new} new tokens"
            )
        self.logprobs = min(config.request_logprobs, limits.max_logprobs, capabilities.vocab_size)

    def request(self, content: str, ids: list[int], max_tokens: int, temperature: float) -> GenerateRequest:
        common = dict(
            request_id=request_id(self.rng), max_tokens=max_tokens, temperature=temperature, top_p=1.0,
            top_k=0, seed=self.rng.getrandbits(63), logprobs=self.logprobs,
        )
        if self.config.prompt_format == "token_ids":
            return GenerateRequest(prompt_token_ids=list(ids), **common)
        if len(content) > self.caps.limits.max_prompt_chars:
            raise WorkloadError(f"a {len(content)}-character prompt exceeds the miner's limit of "
                                f"{self.caps.limits.max_prompt_chars} characters")
        return GenerateRequest(prompt=content, **common)

    def chat_size(self) -> int:
        low, high = self.config.chat_prompt_tokens
        return _log_uniform_at(self.shape.size, low, min(high, self.max_prompt))

    def task(self, task: str) -> tuple[str, list[int], Expectation]:
        content, ids, expect = _task_content(self.rng, task, self.chat_size(), self.builder, self.config)
        if len(ids) > self.max_prompt:
            raise WorkloadError(
                f"a {task} prompt needs {len(ids)} tokens, but the miner's context of {self.caps.max_context} "
                f"leaves only {self.max_prompt} beside {self.max_new} new tokens"
            )
        return content, ids, expect

    def chat(self, kind: str = "chat", burst_id: Optional[str] = None, burst_size: int = 1) -> WorkItem:
        rng = self.rng
        self.shape = _Shape(self.shapes)
        content, ids, _ = self.task(rng.choice(TASKS))
        max_tokens = _log_uniform_at(self.shape.new, self.min_new, self.max_new)
        request = self.request(content, ids, max_tokens, self.shape.temperature_for(self.config))
        return WorkItem(kind, request, tuple(ids), Expectation(), burst_id, burst_size)

    def probe(self, canaries: Optional[CanaryPool]) -> WorkItem:
        rng = self.rng
        self.shape = _Shape(self.shapes)
        weights = list(self.config.probe_weights)
        if canaries is None or canaries.remaining == 0:
            weights[0] = 0.0
        probe = rng.choices(PROBE_KINDS, weights=weights)[0]
        max_tokens = _log_uniform_at(self.shape.new, self.min_new, self.max_new)
        if probe == "canary":
            canary = canaries.take(rng, max_prompt_tokens=self.caps.max_context - max_tokens)
            if canary is not None:
                return canary_item(rng, canary, self.caps, self.config, self.tokenizer, max_tokens=max_tokens)
            probe = rng.choices(PROBE_KINDS[1:], weights=weights[1:])[0]
        content, ids, expect = self.task(probe)
        request = self.request(content, ids, max_tokens, 0.0)  # answers are checkable when greedy
        return WorkItem("probe", request, tuple(ids), _with(expect, probe=probe))

    def long_context_sizes(self) -> list[int]:
        top_new = self.config.long_context_max_tokens[1]
        room = min(self.caps.max_context - top_new, self.caps.limits.max_prompt_tokens)
        sizes = {s for s in self.config.long_context_sizes if s <= room}
        sizes.add(room)  # always try the declared maximum itself
        # Below a few hundred tokens there is no room for material around the fact and question.
        return sorted(s for s in sizes if s > self.builder.overhead + 256)

    def long_context(self) -> WorkItem:
        rng, config = self.rng, self.config
        self.shape = _Shape(self.shapes)
        sizes = self.long_context_sizes()
        if not sizes:
            raise WorkloadError(f"the miner's context of {self.caps.max_context} tokens is too small for long-context work")
        size = sizes[min(len(sizes) - 1, int(self.shape.size * len(sizes)))]
        subject, value = corpus.person_name(rng), corpus.access_code(rng)
        head = "Read the document below, then answer the question at the end.\n\n"
        tail = "\n\n" + corpus.planted_question(subject)
        body = corpus.paragraphs(rng, self.builder.chars_for(size))
        # Distractors: other people's codes, so that retrieval needs the right name, not any number.
        for _ in range(rng.randint(*config.planted_distractors)):
            other = corpus.person_name(rng)
            if other != subject:
                body.insert(rng.randint(0, len(body)), corpus.planted_fact(other, corpus.access_code(rng)))
        fact = corpus.planted_fact(subject, value)
        content, ids = self.builder.with_fact(head, body, tail, fact, size, rng.uniform(*config.planted_depth_range))
        depth = len(self.tokenizer.encode(content[: content.index(fact)])) / len(ids)
        low, high = config.long_context_max_tokens
        max_tokens = min(high, low + int(self.shape.new * (high - low + 1)))
        request = self.request(content, ids, max_tokens, self.shape.temperature_for(config))
        expect = Expectation(answer=value, subject=subject, depth=max(0.0, min(1.0, depth)))
        return WorkItem("long_context", request, tuple(ids), expect)

    def burst(self, n: int) -> list[WorkItem]:
        burst_id = request_id(self.rng)
        return [self.chat("burst", burst_id, n) for _ in range(n)]

    def burst_size(self) -> int:
        low, high = self.config.burst_streams
        fraction = self.shapes.uniform(*self.config.burst_capacity_fraction)
        return min(max(round(fraction * self.caps.max_concurrent_streams), low), high)


def _with(expect: Expectation, **changes) -> Expectation:
    return Expectation(**{**expect.__dict__, **changes})


def plan_round(rng: random.Random, capabilities: Capabilities, config: ScoringConfig, *, tokenizer,
               canaries: Optional[CanaryPool] = None, shape_seed: Optional[int] = None) -> list[WorkItem]:
    """One round of work for one miner, in random order. Streams of a burst share a `burst_id`
    and must be sent together (`group_bursts`). Canaries are taken from `canaries` (marked used).

    With `shape_seed` (one per round, the same for every miner) the round's shapes come from that
    seed: how many items of each kind, prompt sizes, max_tokens, temperatures and burst sizes are
    the same for every miner with the same declared limits, so that miners are compared on the same
    work; prompt content, request ids and sampling seeds still come from `rng`."""
    shapes = random.Random(shape_seed) if shape_seed is not None else rng
    planner = _Planner(rng, capabilities, config, tokenizer, shape_rng=shapes)
    total = config.round_requests
    items: list[WorkItem] = []
    counts = [_stochastic_round(shapes, total * share)
              for share in (config.mix_chat, config.mix_long_context, config.mix_probe)]
    items += [planner.chat() for _ in range(counts[0])]
    items += [planner.long_context() for _ in range(counts[1])]
    items += [planner.probe(canaries) for _ in range(counts[2])]
    # Bursts: whole bursts of a size set by the miner's capacity; the last one is sent with the
    # probability that makes the expected number of burst streams exactly total * mix_burst.
    remaining = total * config.mix_burst
    while remaining > 0:
        size = planner.burst_size()
        if size <= remaining or shapes.random() < remaining / size:
            burst = planner.burst(size)
            items += burst
            remaining -= len(burst)
        else:
            break
    rng.shuffle(items)
    return items


def resend(rng: random.Random, item: WorkItem) -> WorkItem:
    """`item` sent again: the same prompt and sampling, another seed and request id."""
    request = item.request.model_copy(update={"request_id": request_id(rng), "seed": rng.getrandbits(63)})
    return WorkItem(item.kind, request, item.prompt_ids, item.expect, resend_of=item.request.request_id)


def with_resends(rng: random.Random, items: list[WorkItem], earlier: list[WorkItem],
                 config: ScoringConfig) -> list[WorkItem]:
    """The round's items with each sampled chat request replaced, with probability `config.replay_resend_rate`, by
    a resend of one of `earlier` (sampled chat requests this miner answered before)."""
    out = []
    for item in items:
        chosen = rng.random() < config.replay_resend_rate and item.sampled_chat
        out.append(resend(rng, rng.choice(earlier)) if chosen and earlier else item)
    return out


def canary_item(rng: random.Random, canary: Canary, capabilities: Capabilities, config: ScoringConfig,
                tokenizer, *, max_tokens: Optional[int] = None) -> WorkItem:
    """A greedy request for a canary, shaped like any other request (for escalations, too)."""
    planner = _Planner(rng, capabilities, config, tokenizer)
    if max_tokens is None:
        max_tokens = _log_uniform_int(rng, planner.min_new, planner.max_new)
    ids = list(canary.prompt_ids)
    content = ""
    if config.prompt_format == "text":
        content = tokenizer.decode(ids)
        if tokenizer.encode(content) != ids:
            raise WorkloadError(f"canary {canary.canary_id} has prompt ids that do not survive text round-trip; "
                                "use prompt_format='token_ids'")
    if len(ids) + max_tokens > capabilities.max_context:
        raise WorkloadError(f"canary {canary.canary_id} ({len(ids)} prompt tokens) does not fit the miner's context")
    request = planner.request(content, ids, max_tokens, 0.0)
    return WorkItem("probe", request, tuple(ids), Expectation(probe="canary", canary=canary))


def canary_prompts(rng: random.Random, n: int, capabilities: Capabilities, config: ScoringConfig,
                   tokenizer) -> list[list[int]]:
    """Prompt ids for canaries computed by the validator's reference engine (local testnet):
    ordinary chat tasks, so that a canary reads like chat."""
    planner = _Planner(rng, capabilities, config, tokenizer)
    prompts, seen = [], set()
    for _ in range(10 * n):  # distinct prompts (a canary is named by its prompt); short ones can repeat
        if len(prompts) == n:
            break
        _, ids, _ = planner.task(rng.choice(TASKS))
        if tuple(ids) not in seen:
            seen.add(tuple(ids))
            prompts.append(list(ids))
    return prompts


def group_bursts(items: list[WorkItem]) -> tuple[list[WorkItem], dict[str, list[WorkItem]]]:
    """Split a round into single requests and bursts (burst_id -> its streams)."""
    singles, bursts = [], {}
    for item in items:
        if item.burst_id is None:
            singles.append(item)
        else:
            bursts.setdefault(item.burst_id, []).append(item)
    return singles, bursts


__all__ = [
    "KINDS", "PROBE_KINDS", "TASKS", "Expectation", "WorkItem", "WorkloadError", "plan_round", "resend",
    "with_resends",
    "canary_item", "canary_prompts", "group_bursts", "draw_temperature", "request_id",
]
