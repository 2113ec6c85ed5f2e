"""A draft model distilled from the target: a variable-order context table of the target's own greedy choices.

The table maps token contexts of length n_max down to n_min to the token the target model picks after them
(its argmax), with how often it did so among the times the context was seen. It is collected from the target
itself (scripts/distill_drafter.py): teacher-forced forwards over corpus windows (one forward gives the
argmax at every position) and the target's own greedy continuations started from corpus windows (small
models fall into habitual continuations that the corpus alone does not show). Drafting looks up the longest
context ending the history that the table holds, appends its token and goes on from there on its own
drafts: k dictionary look-ups per step, no model work.

A table belongs to one checkpoint: it records the target's manifest fingerprint, and `load_table` refuses a
table made for another one. Its drafts are guesses like any drafter's: the target keeps those equal to what
it would emit itself (inference.decoding.acceptance), so greedy and sampled output are those of plain decoding.

File: gzip'd JSON (written with mtime 0, entries sorted, so a rebuild from the same inputs is the same
bytes): {"format", "target_fingerprint", "n_min", "n_max", "min_confidence", "source", "entries": [[context
token ids, token, confidence percent], ...]}. Entries whose token equals the one their one-shorter suffix
gives are dropped (the backoff would propose it anyway), which keeps the file small without changing a draft.
"""
from __future__ import annotations

import gzip
import json
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

from inference.decoding.drafters import Draft, Drafter

TABLE_FORMAT = "k3-distilled-drafter/1"


class DraftModelMismatch(ValueError):
    """The draft table was distilled from another checkpoint than the one it would draft for."""


@dataclass
class DistilledTable:
    target_fingerprint: str
    n_min: int
    n_max: int
    entries: dict[tuple[int, ...], tuple[int, int]]  # context -> (token, confidence percent)
    source: dict = field(default_factory=dict)
    min_confidence: int = 0  # drafting stops at a context whose confidence is below this (percent)

    def predict(self, context: Sequence[int]) -> tuple[int, int] | None:
        """(token, confidence) of the longest context ending `context` that the table holds, or None."""
        L = len(context)
        for n in range(min(self.n_max, L), self.n_min - 1, -1):
            hit = self.entries.get(tuple(context[L - n:]))
            if hit is not None:
                return hit
        return None

    def to_json(self) -> dict:
        rows = sorted([list(ctx), tok, conf] for ctx, (tok, conf) in self.entries.items())
        return {"format": TABLE_FORMAT, "target_fingerprint": self.target_fingerprint, "n_min": self.n_min,
                "n_max": self.n_max, "min_confidence": self.min_confidence, "source": self.source, "entries": rows}

    def save(self, path: str | Path) -> int:
        """Write the table (deterministic bytes); returns the file size."""
        raw = json.dumps(self.to_json(), separators=(",", ":"), sort_keys=True).encode()
        data = gzip.compress(raw, compresslevel=9, mtime=0)
        Path(path).write_bytes(data)
        return len(data)


def load_table(path: str | Path, target_fingerprint: str | None) -> DistilledTable:
    """Read a table; with `target_fingerprint`, refuse one distilled from another checkpoint."""
    try:
        doc = json.loads(gzip.decompress(Path(path).read_bytes()))
    except (OSError, EOFError, ValueError) as e:
        raise ValueError(f"{path} is not a distilled draft table ({e})") from None
    if doc.get("format") != TABLE_FORMAT:
        raise ValueError(f"{path} is not a distilled draft table (format {doc.get('format')!r}, "
                         f"expected {TABLE_FORMAT!r})")
    fp = doc["target_fingerprint"]
    if target_fingerprint is not None and fp != target_fingerprint:
        raise DraftModelMismatch(
            f"the draft table {path} was distilled from checkpoint {fp}, not from this one ({target_fingerprint}); "
            "rebuild it with scripts/distill_drafter.py --checkpoint DIR --out FILE")
    entries = {tuple(ctx): (int(tok), int(conf)) for ctx, tok, conf in doc["entries"]}
    return DistilledTable(fp, int(doc["n_min"]), int(doc["n_max"]), entries, doc.get("source", {}),
                          int(doc.get("min_confidence", 0)))


class DistilledDrafter(Drafter):
    """Drafts k tokens by longest-context look-ups in a DistilledTable, each on the history plus the drafts
    before it. Stateless apart from the table, so one table serves every sequence."""

    def __init__(self, table: DistilledTable):
        self.table = table

    def propose(self, history: Sequence[int], k: int) -> Draft:
        t = self.table
        ctx = list(history[max(0, len(history) - t.n_max):])
        out: list[int] = []
        while len(out) < k:
            hit = t.predict(ctx)
            if hit is None or hit[1] < t.min_confidence:
                break
            out.append(hit[0])
            ctx.append(hit[0])
        return Draft(out)


# --------------------------------------------------------------------------- building
class ContextCounter:
    """Counts, for every context of length n_min..n_max seen before a position, the target's choices there."""

    def __init__(self, n_min: int, n_max: int):
        if not 1 <= n_min <= n_max:
            raise ValueError(f"context lengths need 1 <= n_min <= n_max (got {n_min}, {n_max})")
        self.n_min, self.n_max = n_min, n_max
        self.counts: dict[tuple[int, ...], Counter] = {}

    def add(self, tokens: Sequence[int], choices: Sequence[int], start: int = 1) -> None:
        """choices[i]: the target's choice after tokens[:i + 1]; counted for i >= start - 1 (positions whose
        context the table should learn)."""
        tokens = [int(t) for t in tokens]
        for i in range(max(start - 1, 0), len(choices)):
            end = i + 1
            choice = int(choices[i])
            for n in range(self.n_min, min(self.n_max, end) + 1):
                key = tuple(tokens[end - n:end])
                c = self.counts.get(key)
                if c is None:
                    self.counts[key] = c = Counter()
                c[choice] += 1

    def table(self, target_fingerprint: str, min_count_long: int = 1, source: dict | None = None,
              min_confidence: int = 0) -> DistilledTable:
        """The majority choice per context (ties: the smaller token id, for determinism), pruned of entries
        their suffix already predicts and of contexts longer than n_min seen fewer than `min_count_long` times."""
        best: dict[tuple[int, ...], tuple[int, int, int]] = {}
        for ctx, c in self.counts.items():
            total = sum(c.values())
            tok, n = min(c.items(), key=lambda kv: (-kv[1], kv[0]))
            best[ctx] = (tok, n * 100 // total, total)
        entries = {}
        for ctx, (tok, conf, total) in best.items():
            if len(ctx) > self.n_min:
                if total < min_count_long:
                    continue
                parent = best.get(ctx[1:])
                same_stop = (parent is not None) and (parent[1] >= min_confidence) == (conf >= min_confidence)
                if same_stop and parent[0] == tok:
                    continue
            entries[ctx] = (tok, conf)
        return DistilledTable(target_fingerprint, self.n_min, self.n_max, entries, source or {}, min_confidence)


def overlaps(banned: Sequence[bytes], probe: int = 16):
    """A predicate: does a byte string share a `probe`-byte piece with any banned text (a benchmark's prompts)?"""
    pieces = {b[i:i + probe] for b in banned for i in range(0, max(len(b) - probe, 0) + 1)}

    def hit(w: bytes) -> bool:
        return any(w[i:i + probe] in pieces for i in range(0, max(len(w) - probe, 0) + 1))
    return hit



def _argmax_rows(model, rows) -> list[list[int]]:
    import torch  # noqa: PLC0415

    logits = model.forward([torch.tensor(r, dtype=torch.long) for r in rows], [model.new_cache() for _ in rows],
                           all_logits=True)
    return [lg.argmax(dim=-1).tolist() for lg in logits]


def _greedy_batch(model, prompts: list[list[int]], steps: int) -> list[list[int]]:
    """Greedy continuations of equal-length prompts, batched one decode step at a time."""
    import torch  # noqa: PLC0415

    caches = [model.new_cache() for _ in prompts]
    logits = model.forward([torch.tensor(p, dtype=torch.long) for p in prompts], caches)
    outs = [[] for _ in prompts]
    for step in range(steps):
        toks = [int(lg.argmax()) for lg in logits]
        for o, t in zip(outs, toks):
            o.append(t)
        if step + 1 < steps:
            logits = model.forward([torch.tensor([t], dtype=torch.long) for t in toks], caches)
    return outs


def distill(model, target_fingerprint: str, texts: Sequence[bytes], bos: int, *, n_min: int = 1, n_max: int = 12,
            window: int = 128, forced_windows: int = 2048, generated: int = 1024, prompt_bytes: int = 48,
            gen_tokens: int = 96, batch: int = 32, min_count_long: int = 1, min_confidence: int = 0,
            banned: Sequence[bytes] = (), log=None) -> DistilledTable:
    """Collect the table from `model`: `forced_windows` teacher-forced windows of `window` bytes evenly spaced
    over `texts` joined, and `generated` greedy continuations of `gen_tokens` after `prompt_bytes`-byte corpus
    windows (BOS first, as prompts are encoded). Windows sharing a 16-byte piece with a `banned` text (the
    benchmark's prompts) are skipped. Deterministic: the windows are evenly spaced, decoding greedy."""
    import torch  # noqa: PLC0415

    data = b"\n\n".join(texts)
    counter = ContextCounter(n_min, n_max)
    with torch.inference_mode():
        step = max((len(data) - window) // max(forced_windows, 1), 1)
        hit = overlaps(banned)
        starts = [s for s in range(0, len(data) - window, step)[:forced_windows] if not hit(data[s:s + window])]
        for b0 in range(0, len(starts), batch):
            rows = [[bos] + list(data[s:s + window]) for s in starts[b0:b0 + batch]]
            for row, choices in zip(rows, _argmax_rows(model, rows)):
                counter.add(row, choices)
            if log and b0 % (batch * 16) == 0:
                log(f"teacher-forced {b0 + len(rows)}/{len(starts)} windows, {len(counter.counts)} contexts")
        gstep = max((len(data) - prompt_bytes) // max(generated, 1), 1)
        gstarts = [s + gstep // 2 for s in range(0, len(data) - prompt_bytes - gstep, gstep)][:generated]
        gstarts = [s for s in gstarts if not hit(data[s:s + prompt_bytes])]
        for b0 in range(0, len(gstarts), batch):
            prompts = [[bos] + list(data[s:s + prompt_bytes]) for s in gstarts[b0:b0 + batch]]
            for p, out in zip(prompts, _greedy_batch(model, prompts, gen_tokens)):
                # the choice after p is out[0]; after p + out[:j] it is out[j]
                counter.add(p + out[:-1], [0] * (len(p) - 1) + out, start=len(p))
            if log and b0 % (batch * 8) == 0:
                log(f"generated {b0 + len(prompts)}/{len(gstarts)} continuations, {len(counter.counts)} contexts")
    source = dict(window=window, forced_windows=len(starts), excluded_texts=len(banned), generated=len(gstarts),
                  prompt_bytes=prompt_bytes, gen_tokens=gen_tokens, corpus_bytes=len(data))
    return counter.table(target_fingerprint, min_count_long, source, min_confidence)


def draft_model_problems(speculate: str, draft_model: str | None) -> list[str]:
    """What is wrong with a --speculate / --draft-model pair before anything loads: a distilled drafter without
    its table, a table for another drafter, a table that is not a file."""
    if speculate == "distilled" and not draft_model:
        return ["speculate distilled needs its draft table (--draft-model FILE, made by scripts/distill_drafter.py)"]
    if draft_model and speculate != "distilled":
        return ["--draft-model is for --speculate distilled"]
    if draft_model and not Path(draft_model).is_file():
        return [f"draft model {draft_model} is not a file"]
    return []


def speculation_with_table(config, path: str | Path | None, target_fingerprint: str):
    """`config` (a SpeculationConfig) with the distilled drafter of the table at `path` when config.drafter is
    "distilled" (the table checked against the target's fingerprint); other drafters: `config` unchanged, and
    a table given with them is refused rather than ignored."""
    import dataclasses  # noqa: PLC0415

    if config is None or config.drafter != "distilled":
        if path:
            raise ValueError("--draft-model is for --speculate distilled")
        return config
    if not path:
        raise ValueError(draft_model_problems("distilled", path)[0])
    if not target_fingerprint:
        raise ValueError("speculate distilled checks its draft table against the checkpoint's fingerprint, and the "
                         "checkpoint has none (no k3_manifest.json): python -m inference manifest DIR writes it")
    table = load_table(path, target_fingerprint)
    return dataclasses.replace(config, drafter_factory=lambda prompt: DistilledDrafter(table))


__all__ = ["DistilledTable", "DistilledDrafter", "ContextCounter", "DraftModelMismatch", "load_table", "distill",
           "overlaps", "TABLE_FORMAT", "draft_model_problems", "speculation_with_table"]
