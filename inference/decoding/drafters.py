"""Drafters: guess the next tokens of a sequence from its history, for the target model to verify.

A drafter proposes up to k tokens that may follow `history` (the prompt and every accepted token so far,
append-only). The target accepts a draft exactly when it equals the token the protocol's sampler picks at
that index (inference.decoding.acceptance), so a drafter needs no distribution of its own: only its guesses.

- `NgramDrafter` (prompt lookup): the longest n-gram (max_n down to min_n) ending the history that occurred
  before; proposes what followed its most recent earlier occurrence.
- `SuffixDrafter`: a suffix automaton over the whole history finds the longest suffix of any length that
  occurred before (no n-gram cap); proposes what followed its first occurrence.

Both continue periodically past the end of the history: if the match is at distance P from the end, the
j-th proposal is the token P positions back in history + proposals, which is how a repeating loop goes on.
Both index the history incrementally (each call looks only at tokens added since the last one), so a
drafter instance belongs to one sequence.

`inference.decoding.distilled.DistilledDrafter` is a draft model behind the same interface: a context
table of the target's own greedy choices, distilled from it.
"""
from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import Sequence

DRAFTER_KINDS = ("none", "ngram", "suffix", "distilled")  # distilled: a table file (speculative.distilled)


@dataclass
class Draft:
    tokens: list[int]


class Drafter(abc.ABC):
    """Proposes continuations of one sequence's token history."""

    @abc.abstractmethod
    def propose(self, history: Sequence[int], k: int) -> Draft:
        """Up to k tokens that may follow `history` (fewer, or none, when the drafter has no guess)."""


def _continue_from(history: Sequence[int], start: int, k: int) -> list[int]:
    """Copy k tokens from (history + the copy itself)[start:]: past the end of the history this repeats the
    last len(history) - start tokens, as a loop would."""
    L = len(history)
    out: list[int] = []
    for i in range(start, start + k):
        out.append(int(history[i]) if i < L else out[i - L])
    return out


class NgramDrafter(Drafter):
    """Prompt lookup: match the last n tokens (n = max_n .. min_n) against earlier positions."""

    def __init__(self, min_n: int = 2, max_n: int = 6):
        if not 1 <= min_n <= max_n:
            raise ValueError(f"n-gram sizes need 1 <= min_n <= max_n (got {min_n}, {max_n})")
        self.min_n, self.max_n = min_n, max_n
        self._last_end: list[dict[tuple[int, ...], int]] = [{} for _ in range(max_n + 1)]  # n -> gram -> end
        self._indexed = 0  # n-grams ending at 1 .. _indexed are in the index

    def _index(self, history: Sequence[int], upto: int) -> None:
        for end in range(self._indexed + 1, upto + 1):
            for n in range(self.min_n, min(self.max_n, end) + 1):
                self._last_end[n][tuple(history[end - n:end])] = end
        self._indexed = max(self._indexed, upto)

    def propose(self, history: Sequence[int], k: int) -> Draft:
        L = len(history)
        if L < self._indexed:
            raise ValueError("an n-gram drafter follows one append-only history; this one got shorter")
        self._index(history, L - 1)  # grams ending before the last position: an earlier occurrence
        if k <= 0:
            return Draft([])
        for n in range(min(self.max_n, L), self.min_n - 1, -1):
            end = self._last_end[n].get(tuple(history[L - n:L]))
            if end is not None:
                return Draft(_continue_from(history, end, k))
        return Draft([])


class SuffixDrafter(Drafter):
    """Longest earlier-occurring suffix of the history, found with an online suffix automaton.

    The automaton over history h has one state per class of substrings with the same end positions. The
    state of the whole of h is `last`; its suffix link is the state of the longest suffix of h that also
    ends earlier, and that state's `first_end` (end of its first occurrence) says where to copy from.
    Adding a token costs amortised O(1); memory is at most 2 states per token.
    """

    def __init__(self, min_match: int = 3):
        if min_match < 1:
            raise ValueError(f"min_match must be >= 1 (got {min_match})")
        self.min_match = min_match
        self._len = [0]
        self._link = [-1]
        self._next: list[dict[int, int]] = [{}]
        self._first_end = [0]
        self._last = 0
        self._indexed = 0

    def _extend(self, token: int) -> None:
        cur = len(self._len)
        self._len.append(self._len[self._last] + 1)
        self._link.append(-1)
        self._next.append({})
        self._first_end.append(self._len[cur])
        p = self._last
        while p != -1 and token not in self._next[p]:
            self._next[p][token] = cur
            p = self._link[p]
        if p == -1:
            self._link[cur] = 0
        else:
            q = self._next[p][token]
            if self._len[p] + 1 == self._len[q]:
                self._link[cur] = q
            else:
                clone = len(self._len)
                self._len.append(self._len[p] + 1)
                self._link.append(self._link[q])
                self._next.append(dict(self._next[q]))
                self._first_end.append(self._first_end[q])
                while p != -1 and self._next[p].get(token) == q:
                    self._next[p][token] = clone
                    p = self._link[p]
                self._link[q] = clone
                self._link[cur] = clone
        self._last = cur

    def propose(self, history: Sequence[int], k: int) -> Draft:
        L = len(history)
        if L < self._indexed:
            raise ValueError("a suffix drafter follows one append-only history; this one got shorter")
        for t in history[self._indexed:]:
            self._extend(int(t))
        self._indexed = L
        match = self._link[self._last]
        if k <= 0 or match <= 0 or self._len[match] < self.min_match:
            return Draft([])
        return Draft(_continue_from(history, self._first_end[match], k))

    @property
    def match_length(self) -> int:
        """Length of the longest earlier-occurring suffix after the last propose()."""
        match = self._link[self._last]
        return self._len[match] if match > 0 else 0


class ReplayDrafter(Drafter):
    """Proposes a known continuation (e.g. the plain greedy output) with every `wrong_every`-th position
    altered: a drafter of chosen quality, to measure the verification machinery apart from drafting (the
    benchmark's "oracle" rows, and tests that need drafts that are mostly accepted or never accepted)."""

    def __init__(self, prompt_len: int, continuation: Sequence[int], vocab_size: int, wrong_every: int = 0):
        self.prompt_len, self.continuation = prompt_len, [int(t) for t in continuation]
        self.vocab_size, self.wrong_every = vocab_size, wrong_every

    def _at(self, i: int) -> int:
        t = self.continuation[i]
        if self.wrong_every and (i + 1) % self.wrong_every == 0:
            return (t + 1) % self.vocab_size
        return t

    def propose(self, history: Sequence[int], k: int) -> Draft:
        start = len(history) - self.prompt_len
        stop = min(start + max(k, 0), len(self.continuation))
        return Draft([self._at(i) for i in range(max(start, 0), stop)])


def make_drafter(kind: str, min_match: int | None = None) -> Drafter | None:
    """A fresh drafter for one sequence: "ngram", "suffix", or None for "none". `min_match`: the shortest
    match it copies from (n-gram: min_n, raising max_n if needed; suffix: min_match); None keeps the defaults."""
    if kind == "none":
        return None
    if kind == "ngram":
        return NgramDrafter() if min_match is None else NgramDrafter(min_match, max(min_match, 6))
    if kind == "suffix":
        return SuffixDrafter() if min_match is None else SuffixDrafter(min_match)
    if kind == "distilled":
        raise ValueError("the distilled drafter needs its table: give --draft-model FILE "
                         "(made by scripts/distill_drafter.py; SpeculationConfig.drafter_factory)")
    raise ValueError(f"unknown drafter {kind!r}; choose one of {', '.join(DRAFTER_KINDS)}")


__all__ = ["Draft", "Drafter", "NgramDrafter", "SuffixDrafter", "ReplayDrafter", "make_drafter", "DRAFTER_KINDS"]
