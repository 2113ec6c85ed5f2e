"""Speculative decoding benchmark (issue 17): accepted tokens per verify step and single-stream speed-up.

Table 1, per prompt kind (code-like, repetitive, novel) and drafter (ngram, suffix, and "oracle" drafters
of known quality that replay the plain greedy output, all right, every 4th token wrong or all wrong, the
last also without adaptive k's pauses: they show what the verification machinery delivers at that
acceptance, apart from drafting, and how fast adaptive k gives up on drafts that are never right): decode tokens/s
through the serving engine, one stream, greedy, plain and speculative runs alternated and repeated
(median; every other repeat runs the speculative variants before plain), by wall clock and by process CPU
time (steadier when other work shares the machine), with the drafted / accepted counts. Speculative output
is checked equal to plain output. "ceiling": the speed-up if verification were free and every token of the
plain output that the drafter's one-token guess gets right were accepted, (n - 1) / (n - 1 - right): about
what the model's own output allows a copying drafter, whatever k and the verify path do (a continuation
copied further can now and then be right where the one-token guess at that position was not).

Table 1b, verify forward cost: CPU time of one decode forward of 1 + k positions (with mark and rewind)
against a plain one-position step, on the model being benchmarked.

Table 2, rollback cost: the KDA rewind modes ("snapshot": keep every step's state; "replay": keep the
kernel inputs and re-run the kept steps) per KDA layer at the tiny and the full K3 head sizes, against
"recompute" (clone the whole cache before verifying, re-run the accepted tokens through the model after).

    python -m benchmarks.speculative --checkpoint ckpt/tiny [--tokens 64] [--repeats 3] [--json OUT]
"""
from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from inference.decoding.distilled import DistilledDrafter, load_table
from inference.decoding.drafters import DRAFTER_KINDS, ReplayDrafter, make_drafter
from inference.decoding.sampling import SamplingParams
from inference.decoding.speculation import SpeculationConfig
from inference.model.checkpoint import make_random_checkpoint
from inference.model.config import ModelConfig
from inference.model.kda import KDALayerCache
from inference.serving.builders import load_reference_model
from inference.serving.engine import EngineSettings, GenerationRequest, TokenEvent
from inference.serving.local_engine import LocalEngine

PROMPTS = {
    "code-like": (
        "def add(a, b):\n    return a + b\n\n\ndef sub(a, b):\n    return a - b\n\n\n"
        "def mul(a, b):\n    return a * b\n\n\ndef div(a, b):\n    return a / b\n\n\ndef "
    ),
    "repetitive": "the quick brown fox jumps over the lazy dog. " * 4 + "the quick",
    "novel": "Marigold ferries drift past quiet harbours while a violinist tunes beneath the awning",
}


async def _one_run(model, tokenizer, prompt_ids, max_tokens, speculation):
    settings = EngineSettings(max_context=model.config.max_position_embeddings, max_concurrent_sequences=1)
    async with LocalEngine(model, tokenizer, settings, speculation=speculation) as engine:
        tokens, final, cpu_first = [], None, None
        async for ev in engine.generate(GenerationRequest(prompt_ids, SamplingParams(max_tokens=max_tokens,
                                                                                     ignore_eos=True))):
            if isinstance(ev, TokenEvent):
                tokens.append(ev.token_id)
                if cpu_first is None:
                    cpu_first = time.process_time()
            else:
                final = ev
        cpu_s = time.process_time() - cpu_first
    decode_s = (final.total_ms - final.ttft_ms) / 1000.0
    return tokens, final, (len(tokens) - 1) / decode_s, (len(tokens) - 1) / cpu_s


def copy_ceiling(drafter_kind: str, prompt_ids: list[int], output: list[int], drafter=None) -> tuple[int, float]:
    """(right, ceiling): how many of output[1:] the drafter's one-token guess from the history before each
    gets right, and the decode speed-up that would give with free verification (see the module docstring).
    `drafter`: use this one instead of a fresh `drafter_kind`."""
    drafter = drafter if drafter is not None else make_drafter(drafter_kind)
    history = list(prompt_ids) + list(output[:1])
    right = 0
    for token in output[1:]:
        guess = drafter.propose(history, 1).tokens
        right += bool(guess) and guess[0] == token
        history.append(token)
    steps = len(output) - 1
    return right, steps / max(steps - right, 1)


def speedup_table(model, tokenizer, max_tokens: int, repeats: int, drafters: list[str] | None = None,
                  draft_table=None) -> list[dict]:
    """`drafters`: the variants to run (default all: ngram, suffix, distilled when `draft_table` is given, and
    the oracles). `draft_table`: a DistilledTable for the "distilled" rows."""
    rows = []
    for kind, text in PROMPTS.items():
        prompt_ids = tokenizer.encode(text, add_bos=True)
        plain_tokens = asyncio.run(_one_run(model, tokenizer, prompt_ids, max_tokens, None))[0]

        def oracle(wrong_every):
            def factory(prompt):
                return ReplayDrafter(len(prompt), plain_tokens, model.config.vocab_size, wrong_every)
            return factory

        variants = {
            "ngram": SpeculationConfig(drafter="ngram"),
            "suffix": SpeculationConfig(drafter="suffix"),
            **({"distilled": SpeculationConfig(drafter="distilled",
                                               drafter_factory=lambda prompt: DistilledDrafter(draft_table))}
               if draft_table is not None else {}),
            "oracle (all right)": SpeculationConfig(drafter_factory=oracle(0)),
            "oracle (1 in 4 wrong)": SpeculationConfig(drafter_factory=oracle(4)),
            "oracle (all wrong)": SpeculationConfig(drafter_factory=oracle(1)),  # adaptive k must give up fast
            "oracle (all wrong, no pauses)": SpeculationConfig(drafter_factory=oracle(1), miss_limit=0),
        }
        variants = {name: c for name, c in variants.items() if drafters is None or name.split()[0] in drafters}
        plain_runs: list = []
        results: dict[str, list] = {name: [] for name in variants}
        for rep in range(repeats):  # alternate so that load changes on this machine hit both alike
            if rep % 2 == 0:
                plain_runs.append(asyncio.run(_one_run(model, tokenizer, prompt_ids, max_tokens, None)))
            for name, config in variants.items():
                results[name].append(asyncio.run(_one_run(model, tokenizer, prompt_ids, max_tokens, config)))
            if rep % 2 == 1:
                plain_runs.append(asyncio.run(_one_run(model, tokenizer, prompt_ids, max_tokens, None)))
        plain_rate = statistics.median(r[2] for r in plain_runs)
        plain_cpu_rate = statistics.median(r[3] for r in plain_runs)
        rows.append(dict(prompt=kind, drafter="plain", tokens=len(plain_tokens), proposed=0, accepted=0,
                         verify_steps=0, accepted_per_verify=0.0, tokens_per_s=plain_rate, speedup=1.0,
                         cpu_speedup=1.0, ceiling=1.0, same_output=all(r[0] == plain_tokens for r in plain_runs)))
        for name, runs in results.items():
            tokens, final = runs[0][:2]
            rate = statistics.median(r[2] for r in runs)
            rows.append(dict(
                prompt=kind, drafter=name, tokens=len(tokens), proposed=final.draft_proposed,
                accepted=final.draft_accepted, verify_steps=final.verify_steps,
                accepted_per_verify=final.draft_accepted / max(final.verify_steps, 1),
                tokens_per_s=rate, speedup=rate / plain_rate,
                cpu_speedup=statistics.median(r[3] for r in runs) / plain_cpu_rate,
                ceiling=copy_ceiling(name, prompt_ids, plain_tokens, variants[name].drafter_factory(prompt_ids)
                                     if name == "distilled" else None)[1]
                if name in DRAFTER_KINDS else float("nan"),
                same_output=all(r[0] == plain_tokens for r in runs)))
    return rows


def _time(fn, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


@torch.inference_mode()
def rewind_table(model, k: int = 8, keep: int = 3, repeats: int = 5) -> list[dict]:
    """Cost of rolling back a verify step of k drafts that kept `keep` positions."""
    rows = []
    T = k + 1
    for label, H, d, P, kernel in [("tiny", model.config.kda_heads, model.config.kda_head_dim,
                                    model.config.kda_proj_size, model.config.conv_kernel_size),
                                   ("full K3", 96, 128, 96 * 128, 4)]:
        g = torch.Generator().manual_seed(0)
        q = torch.nn.functional.normalize(torch.randn(T, H, d, generator=g), dim=-1)
        kk = torch.nn.functional.normalize(torch.randn(T, H, d, generator=g), dim=-1)
        v = torch.randn(T, H, d, generator=g)
        gate = -torch.rand(T, H, d, generator=g)
        beta = torch.rand(T, H, generator=g)
        columns = torch.randn(3, P, T, generator=g)
        cache = KDALayerCache(torch.zeros(3, P, kernel - 1), torch.randn(H, d, d, generator=g))
        states = [torch.randn(H, d, d, generator=g) for _ in range(T)]
        for mode in ("snapshot", "replay"):
            def step():
                cache.mark(mode)
                cache._record(columns, states, (q, kk, v, gate, beta))
                cache.rewind(keep)
            step()
            cache.mark(mode)
            cache._record(columns, states, (q, kk, v, gate, beta))
            nbytes = cache.rewind_nbytes
            cache.unmark()
            rows.append(dict(size=label, method=f"{mode} (per KDA layer)", ms=_time(step, repeats) * 1e3,
                             log_bytes=nbytes))
    # recompute: clone the whole sequence cache before the verify, re-run the kept tokens after it
    cache = model.new_cache()
    model.forward([torch.arange(40) % 200], [cache])
    kept = torch.arange(keep) + 7

    def recompute():
        backup = cache.clone()
        model.forward([kept], [backup])
    layers = model.config.num_kda_layers
    rows.append(dict(size="tiny", method=f"recompute (whole model, / {layers} KDA layers)",
                     ms=_time(recompute, repeats) * 1e3 / layers, log_bytes=cache.kda_nbytes // layers))
    return rows


@torch.inference_mode()
def verify_cost_table(model, prompt_ids: list[int], sizes=(1, 2, 3, 5, 9, 17), repeats: int = 15) -> list[dict]:
    """CPU time of one decode forward of T positions (T = 1: a plain step; T = k + 1: a verify step of k
    drafts, with its mark and rewind) after `prompt_ids`, best of `repeats`, and its ratio to T = 1."""
    cache = model.new_cache()
    model.forward([torch.tensor(prompt_ids, dtype=torch.long)], [cache])
    base = cache.length
    rows = []
    for T in sizes:
        fed = torch.arange(T, dtype=torch.long) % model.config.vocab_size
        best = float("inf")
        for _ in range(repeats):
            t0 = time.process_time()
            cache.mark("snapshot")
            model.forward([fed], [cache], all_logits=T > 1)
            cache.rewind(base)
            best = min(best, time.process_time() - t0)
        rows.append(dict(positions=T, ms=best * 1e3, ratio=best / rows[0]["ms"] * 1e3 if rows else 1.0))
    return rows


def format_table(rows: list[dict], columns: list[tuple[str, str, str]]) -> str:
    head = " | ".join(title for _, title, _ in columns)
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(" | ".join(format(r[key], fmt) for key, _, fmt in columns))
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoint", help="checkpoint directory (default: a random tiny one, seed 0)")
    parser.add_argument("--tokens", type=int, default=64, help="tokens generated per run")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1, help="torch threads")
    parser.add_argument("--json", type=Path, help="also write the rows here")
    parser.add_argument("--drafters", type=lambda s: s.split(","), default=None,
                        help="comma-separated subset of ngram,suffix,distilled,oracle (default all)")
    parser.add_argument("--draft-model", type=Path, help="a distilled draft table for the checkpoint "
                        "(scripts/distill_drafter.py): adds the \"distilled\" rows")
    parser.add_argument("--skip-rewind-table", action="store_true", help="leave out the rollback cost table")
    parser.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N (where the model computes)")
    parser.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16"),
                    help="weights dtype (auto: bfloat16 on a GPU, float32 on the CPU)")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = args.checkpoint
        if ckpt is None:
            ckpt = Path(tmp) / "tiny"
            make_random_checkpoint(ModelConfig.tiny(), ckpt, seed=0, progress=False)
        model, tokenizer, fp = load_reference_model(ckpt, args.dtype, device=args.device)
    print(f"checkpoint {args.checkpoint or 'random tiny (seed 0)'} ({fp}), {args.tokens} tokens per run, "
          f"greedy, one stream, median of {args.repeats}, {args.threads} thread(s)\n")
    table = load_table(args.draft_model, fp) if args.draft_model else None
    if table is not None:
        print(f"distilled draft table {args.draft_model}: {len(table.entries)} contexts, "
              f"{args.draft_model.stat().st_size} bytes\n")
    rows = speedup_table(model, tokenizer, args.tokens, args.repeats, args.drafters, table)
    print(format_table(rows, [
        ("prompt", "prompt", "<10"), ("drafter", "drafter", "<29"), ("tokens", "tokens", ">6"),
        ("proposed", "drafted", ">7"), ("accepted", "accepted", ">8"), ("verify_steps", "verifies", ">8"),
        ("accepted_per_verify", "acc/verify", ">10.2f"), ("tokens_per_s", "tok/s", ">7.1f"),
        ("speedup", "speed-up", ">8.2f"), ("cpu_speedup", "CPU-time speed-up", ">17.2f"),
        ("ceiling", "ceiling", ">7.2f"), ("same_output", "same", ">5")]))
    print("\n(acc/verify: accepted drafts per verify step; a verify step emits that plus one token. speed-up: "
          "decode tokens/s over plain, wall clock; CPU-time speed-up: the same from this process's CPU time, "
          "steadier on a shared machine; ceiling: the speed-up with free verification if every token of the plain "
          "output that the drafter's one-token guess gets right were accepted.)")
    cost = verify_cost_table(model, tokenizer.encode(PROMPTS["code-like"], add_bos=True))
    print("\nverify forward cost (CPU time, best of 15; positions = 1 + drafts):\n")
    print(format_table(cost, [("positions", "positions", ">9"), ("ms", "ms", ">8.2f"),
                              ("ratio", "x plain step", ">12.2f")]))
    rewind = [] if args.skip_rewind_table else rewind_table(model)
    if rewind:
        print("\nrollback of a verify step of 8 drafts keeping 3 positions:\n")
        print(format_table(rewind, [("size", "size", "<8"), ("method", "method", "<44"), ("ms", "ms", ">8.3f"),
                                    ("log_bytes", "bytes kept", ">12,")]))
    if args.json:
        args.json.write_text(json.dumps({"speedup": rows, "verify_cost": cost, "rewind": rewind}, indent=2))
    return 0 if all(r["same_output"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
