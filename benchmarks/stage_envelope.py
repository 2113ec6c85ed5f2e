"""The honest envelope of stage checks: route sessions through honest stages in several numerics, each stage's
recorded steps re-run on the validator's fp32 reference of its block, the per-check statistics tabulated, and
(with --write FILE) the bounds a validator judges stage checks by written into a model envelope file.

A session here is what a route driver sends (scoring's validator does the same from stage ledgers): a prompt of
chat-like text prefilled in random chunks, then decode steps, the head sampling (greedy or T = 0.8) with the
session's seed; each stage's output crosses the wire codec in the stage's wire dtype, as it would between two
stage miners. Honest variants: fp32 (1 thread), fp32 on 2 threads, bf16 weights with a bf16 wire, fp16 weights
(fp32 wire), and a block sharded over 2 local processes (expert parallel, fp32).

With --cheats KIND,... it also runs each stage cheater of localnet/cheats/stage.py in the middle block, in
process, `--repeats` times: sessions through [honest, cheater, honest] until the judge blames the cheater with the
envelope in --envelope (the shipped one of the model by default), and prints how many checked sessions and how
many tokens of lying each took.

    python -m benchmarks.stage_envelope --sessions 150 --write scoring/envelopes/tiny_trained.json
    python -m benchmarks.stage_envelope --sessions 0 --cheats echo,fewer-experts,sparse-liar --repeats 5
    python -m benchmarks.stage_envelope --sessions 140 --seed 23 --rows checks.json     # fresh honest checks
    python -m benchmarks.stage_envelope --from-rows checks.json --validate                 # judged: false positives
    python -m benchmarks.stage_envelope --sessions 150 --device cuda --write FILE   # with honest GPU stages
"""
from __future__ import annotations

import argparse
import contextlib
import json
import random
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator, Sequence

import numpy as np
import torch

from benchmarks.checkpoint_choice import add_checkpoint_argument, resolve_checkpoint
from inference.decoding.sampling import SamplingParams
from inference.model import device_problem, load_tokenizer, read_config
from inference.model.checkpoint import fingerprint
from inference.planning.swarm_plan import stage_blocks
from inference.serving.builders import load_reference_model
from inference.swarm.stage import HeadOutput, LayerRange, Stage
from localnet.cheats.stage import CHEAT_DEFAULT_DTYPES, CHEATS
from neurons.swarm.codec import decode_inputs, encode_state
from neurons.swarm.route import NUMERICS_ORDER
from scoring.corpus import code_snippet, paragraph
from scoring.model_envelope import shipped_envelope
from scoring.stage_checks import OpenedStep, recheck_opened, reference_stage
from scoring.stage_judge import (CheckStats, NumericsEnvelope, derive_envelope, load_stage_envelopes,
                                 stage_envelope_section, verdict, write_stage_section)

NUMERICS = {"fp32": "float32", "fp32-2-threads": "float32", "bf16": "bfloat16", "fp16": "float16",
            "sharded-fp32": "float32"}
# honest stages on the GPU of --device (its kernels: cuBLAS reductions, fla's KDA, experts batched by expert)
GPU_NUMERICS = {"gpu-fp32": "float32", "gpu-bf16": "bfloat16"}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class RouteStage:
    stage: Stage
    wire_dtype: str = "float32"
    threads: int = 1


@contextlib.contextmanager
def threads(n: int) -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def wire(state, dtype: str):
    """A state as the next stage decodes it from the wire (the stage's wire dtype)."""
    specs, body = encode_state(state, dtype)
    view = memoryview(body)
    tensors, offset = [], 0
    for s in specs:
        tensors.append((s, view[offset:offset + s.nbytes]))
        offset += s.nbytes
    return decode_inputs(tensors, False, state.partial.shape[1])


def session_plan(rng: random.Random, prompt_tokens: int, decode_tokens: int) -> list[int]:
    """Forward sizes: the prompt in random chunks (1-64 tokens), then one token per decode step."""
    chunks, left = [], prompt_tokens
    while left:
        c = min(left, rng.randint(1, 64))
        chunks.append(c)
        left -= c
    return chunks + [1] * decode_tokens


def drive_session(route: Sequence[RouteStage], prompt: list[int], plan: list[int], *, temperature: float,
                  seed: int, session: str, wrap: Callable = lambda i, s: s) -> list[list[OpenedStep]]:
    """One session through the route: per stage, its steps as its ledger records them. The head samples on the
    last prompt chunk and every decode step; the token it emits is the next decode step's input."""
    sampling = SamplingParams(temperature=temperature, logprobs=2)
    for r in route:
        r.stage.open(session, sampling=sampling, seed=seed)
    recorded: list[list[OpenedStep]] = [[] for _ in route]
    ids, position = list(prompt), 0
    try:
        for step, n in enumerate(plan):
            x = torch.tensor(ids[position:position + n])
            mode = "sample" if position + n >= len(prompt) else "none"
            for i, r in enumerate(route):
                stage = wrap(i, r.stage)
                with threads(r.threads):
                    out = stage.forward(session, position, x, mode if r.stage.layers.has_head else "none")
                if not isinstance(out, HeadOutput):
                    out = wire(out, r.wire_dtype)
                recorded[i].append(OpenedStep(step, position, mode if r.stage.layers.has_head else "none", None, 0,
                                              None, x, out))
                x = out
            position += n
            if isinstance(x, HeadOutput) and x.mode == "sample" and position >= len(ids):
                ids.append(int(x.token_id))
    finally:
        for r in route:
            r.stage.close(session)
    return recorded


def prompt_ids(rng: random.Random, tokenizer, n: int) -> list[int]:
    ids: list[int] = []
    while len(ids) < n:
        ids += tokenizer.encode(paragraph(rng) if rng.random() < 0.7 else code_snippet(rng))
    return ids[:n]


def honest_routes(ckpt: Path, blocks: list[tuple[int, int]], num_layers: int, only: Sequence[str],
                  device: str = "cpu") -> dict:
    routes = {}
    for name in only:
        numerics = {**NUMERICS, **GPU_NUMERICS}[name]
        shard = 2 if name.startswith("sharded") else 1
        routes[name] = [RouteStage(Stage.from_checkpoint(ckpt, LayerRange(a, b, num_layers), DTYPES[numerics],
                                                         shard_ranks=shard if b - a >= 2 else 1,
                                                         threads_per_rank=1,
                                                         device=device if name in GPU_NUMERICS else "cpu"),
                                   "bfloat16" if numerics == "bfloat16" else "float32",
                                   2 if name == "fp32-2-threads" else 1)
                        for a, b in blocks]
    return routes


def measure(ckpt: Path, sessions: int, *, variants: Sequence[str], stages: int, seed: int,
            max_prompt: int, max_decode: int, device: str = "cpu") -> list[tuple[str, str, str, CheckStats, int]]:
    """(variant, numerics, kind "state"|"head", statistics, block index) of every stage check. The `gpu-*` variants
    run their stages on `device`; the references stay fp32 on the CPU."""
    config = read_config(ckpt)
    tokenizer = load_tokenizer(ckpt, config)
    model, _, _ = load_reference_model(ckpt, verify=False)
    blocks = stage_blocks(config.num_layers, config.attn_res_block_size, stages)
    references = [reference_stage(model, a, b) for a, b in blocks]
    routes = honest_routes(ckpt, blocks, config.num_layers, variants, device)
    rng = random.Random(seed)
    rows = []
    try:
        for k in range(sessions):
            prompt = prompt_ids(rng, tokenizer, rng.randint(8, max_prompt))
            plan = session_plan(rng, len(prompt), rng.randint(1, max_decode))
            temperature = rng.choice([0.0, 0.8])
            for name, route in routes.items():
                s_seed = rng.getrandbits(62)
                recorded = drive_session(route, prompt, plan, temperature=temperature, seed=s_seed,
                                         session=f"{name}-{k}")
                for i, ((a, b), ref, steps) in enumerate(zip(blocks, references, recorded)):
                    c = recheck_opened(steps, ref, seed=rng.getrandbits(62))
                    kind = "head" if b == config.num_layers else "state"
                    rows.append((name, {**NUMERICS, **GPU_NUMERICS}[name], kind, CheckStats.of(c), i))
            if (k + 1) % 10 == 0:
                print(f"[stage_envelope] {k + 1}/{sessions} sessions, {len(rows)} checks", file=sys.stderr,
                      flush=True)
    finally:
        for route in routes.values():
            for r in route:
                r.stage.shutdown()
    return rows


IN_PROCESS_CHEATS = ("other-weights", "skip-layer", "echo", "session-liar", "long-position-liar", "replay",
                     "watch-aware", "sparse-liar", "fewer-experts", "quantized", "stale-state", "late-switch",
                     "misdeclared")  # the others lie on the wire or with a partner


def checks_to_blame(ckpt: Path, kind: str, envelopes: dict, *, repeats: int, limit: int, seed: int,
                    max_prompt: int, max_decode: int) -> list[dict]:
    """Per run: sessions through [honest, `kind`, honest] (the cheater declaring what it declares), each
    rechecked and judged with the judge's window test, until it is blamed (or `limit` sessions)."""
    config = read_config(ckpt)
    tokenizer = load_tokenizer(ckpt, config)
    model, _, _ = load_reference_model(ckpt, verify=False)
    blocks = stage_blocks(config.num_layers, config.attn_res_block_size, 3)
    references = [reference_stage(model, a, b) for a, b in blocks]
    dtype_name, wire = CHEAT_DEFAULT_DTYPES.get(kind, ("float32", "float32"))
    dtype = DTYPES[dtype_name]
    runs = []
    for r in range(repeats):
        rng = random.Random(seed * 1000 + r)
        a, b = blocks[1]
        extra = {"late-switch": {"honest_forwards": 40}}.get(kind, {})
        cheat = CHEATS[kind].from_checkpoint(ckpt, LayerRange(a, b, config.num_layers), dtype, **extra)
        route = [RouteStage(Stage.from_checkpoint(ckpt, LayerRange(*blocks[0], config.num_layers))),
                 RouteStage(cheat, wire),
                 RouteStage(Stage.from_checkpoint(ckpt, LayerRange(*blocks[2], config.num_layers)))]
        env = envelopes[(max(cheat.numerics, wire, key=NUMERICS_ORDER.index), "state")]  # as the validator judges
        outcomes, lying_tokens, blamed_at = [], 0, None
        for k in range(1, limit + 1):
            prompt = prompt_ids(rng, tokenizer, rng.randint(8, max_prompt))
            plan = session_plan(rng, len(prompt), rng.randint(1, max_decode))
            recorded = drive_session(route, prompt, plan, temperature=rng.choice([0.0, 0.8]),
                                     seed=rng.getrandbits(62), session=f"{kind}-{r}-{k}")
            c = recheck_opened(recorded[1], references[1], seed=rng.getrandbits(62))
            st = CheckStats.of(c)
            outcomes.append(env.outside(st) if c.ok else f"exact: {c.reason}")
            lying_tokens += st.tokens
            if not c.ok or verdict(outcomes, env).blame:
                blamed_at = k
                break
        runs.append({"kind": kind, "blamed_at": blamed_at, "tokens": lying_tokens, "outside": sum(map(bool, outcomes))})
    return runs


def cheat_table(runs: dict[str, list[dict]], limit: int) -> str:
    out = ["| cheat (middle block, in process) | blamed (runs) | checked sessions to blame: median | max | "
           "tokens served before blame: median |", "|---|---|---|---|---|"]
    for kind, rs in runs.items():
        at = [r["blamed_at"] for r in rs if r["blamed_at"]]
        toks = [r["tokens"] for r in rs if r["blamed_at"]]
        out.append(f"| {kind} | {len(at)}/{len(rs)} | {statistics.median(at) if at else f'>{limit}'} | "
                   f"{max(at) if len(at) == len(rs) else f'>{limit}'} | {statistics.median(toks) if toks else '-'} |")
    return "\n".join(out)


def false_positives(rows, envelopes: dict) -> str:
    """The honest checks judged as a validator judges them: per variant and block, every check's outcome against
    the envelope of its numerics, and the verdict over all of them as one window (a stage blamed is a false
    positive)."""
    out = ["| variant | numerics | block | checks | outside | verdict |", "|---|---|---|---|---|---|"]
    per_stage: dict[tuple[str, str, str, int], list] = {}
    for name, numerics, kind, st, block in rows:
        per_stage.setdefault((name, numerics, kind, block), []).append(st)
    total = blamed = 0
    for (name, numerics, kind, block), stats in per_stage.items():
        env = envelopes[(numerics, kind)]
        outcomes = [env.outside(st) for st in stats]
        v = verdict(outcomes, env)
        total += len(stats)
        blamed += v.blame
        out.append(f"| {name} | {numerics} | {block} ({kind}) | {len(stats)} | {sum(map(bool, outcomes))} | "
                   f"{'BLAMED' if v.blame else 'not blamed'} (chance {v.chance:.2g}) |")
    out.append(f"\n{total} honest stage checks, {blamed} stages blamed")
    return "\n".join(out)


def table(rows, envelopes: dict[tuple[str, str], NumericsEnvelope]) -> str:
    out = ["| variant | numerics | kind | checks | tokens | median of medians | worst median | bad tokens | "
           "worst bad fraction | outside the envelope |", "|---|---|---|---|---|---|---|---|---|---|"]
    groups: dict[tuple[str, str, str], list[CheckStats]] = {}
    for name, numerics, kind, st, _ in rows:
        groups.setdefault((name, numerics, kind), []).append(st)
    for (name, numerics, kind), stats in groups.items():
        env = envelopes[(numerics, kind)]
        outside = sum(1 for s in stats if env.outside(s))
        tokens = sum(s.tokens for s in stats)
        out.append(f"| {name} | {numerics} | {kind} | {len(stats)} | {tokens} | "
                   f"{np.median([s.median for s in stats]):.2e} | {max(s.median for s in stats):.2e} | "
                   f"{sum(s.bad for s in stats) / max(1, tokens):.3%} | "
                   f"{max(s.bad_fraction for s in stats):.3f} | {outside} |")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.stage_envelope", description=__doc__.split("\n\n")[0])
    add_checkpoint_argument(ap)
    ap.add_argument("--sessions", type=int, default=40, help="sessions per honest variant")
    ap.add_argument("--stages", type=int, default=3, help="stages on the route (blocks of the model)")
    ap.add_argument("--variants", default="", help=f"comma-separated, of {list(NUMERICS)} (default: all), and "
                                                   f"with --device {list(GPU_NUMERICS)}")
    ap.add_argument("--device", default="cpu", help="cuda or cuda:N: also honest stages on that GPU (fp32 and bf16), "
                                                    "so the envelope includes the GPU's numerics")
    ap.add_argument("--max-prompt", type=int, default=160)
    ap.add_argument("--max-decode", type=int, default=32)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--write", metavar="FILE", help="write the bounds into this model envelope file (its `stages`)")
    ap.add_argument("--cheats", default="", help=f"comma-separated, of {list(IN_PROCESS_CHEATS)}")
    ap.add_argument("--repeats", type=int, default=5, help="--cheats: runs per cheat")
    ap.add_argument("--limit", type=int, default=30, help="--cheats: give up on a cheat after this many sessions")
    ap.add_argument("--envelope", metavar="FILE", help="--cheats, --validate: judge by this envelope file (default: "
                                                       "the shipped one of the model, or the one just measured)")
    ap.add_argument("--validate", action="store_true", help="judge the honest checks by the envelope (--envelope or "
                                                            "the shipped one) instead of deriving one: the false "
                                                            "positive table")
    ap.add_argument("--rows", metavar="FILE", help="write every check's statistics here as JSON")
    ap.add_argument("--from-rows", metavar="FILE", help="take the checks from a --rows file of an earlier run "
                                                        "instead of measuring (with --validate: judge them by an "
                                                        "envelope measured since)")
    args = ap.parse_args(argv)
    known = list(NUMERICS) + (list(GPU_NUMERICS) if args.device != "cpu" else [])
    variants = [v for v in args.variants.split(",") if v] or known
    cheats = [c for c in args.cheats.split(",") if c]
    unknown = sorted(set(variants) - set(known)) + sorted(set(cheats) - set(IN_PROCESS_CHEATS))
    if unknown:
        ap.error(f"unknown variants or cheats {unknown}; known: {known}, {list(IN_PROCESS_CHEATS)}")
    if device_problem(args.device):
        ap.error(device_problem(args.device))
    started = time.time()
    torch.set_num_threads(1)  # the stages and the reference take turns; a variant sets its own threads
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = resolve_checkpoint(args.checkpoint, Path(tmp))
        envelopes = {}
        if args.sessions or args.from_rows:
            rows = read_rows(Path(args.from_rows)) if args.from_rows else measure(
                ckpt, args.sessions, variants=variants, stages=args.stages, seed=args.seed,
                max_prompt=args.max_prompt, max_decode=args.max_decode, device=args.device)
            if args.rows:
                Path(args.rows).write_text(json.dumps([[v, n, k, b, st.__dict__] for v, n, k, st, b in rows]))
            if args.validate:
                print(false_positives(rows, judged_by(ckpt, args.envelope)))
                print(f"\n{len(rows)} stage checks in {time.time() - started:.0f} s")
                return 0
            envelopes = {(n, k): derive_envelope(n, k, [s for _, n2, k2, s, _ in rows if (n2, k2) == (n, k)])
                         for n, k in {(n, k) for _, n, k, _, _ in rows}}
            print(table(rows, envelopes))
            print()
            for (numerics, kind), env in sorted(envelopes.items()):
                print(f"{numerics:9s} {kind:5s} {json.dumps(env.to_json())}")
            print(f"\n{len(rows)} stage checks in {time.time() - started:.0f} s")
            if args.write:
                write_stage_section(Path(args.write), stage_envelope_section(envelopes.values(), command=" ".join(
                    ["python -m benchmarks.stage_envelope"] + (argv if argv is not None else sys.argv[1:]))))
                print(f"wrote the stage envelope into {args.write}")
        if cheats:
            envelopes = judged_by(ckpt, args.envelope) or envelopes
            runs = {kind: checks_to_blame(ckpt, kind, envelopes, repeats=args.repeats, limit=args.limit,
                                          seed=args.seed, max_prompt=args.max_prompt, max_decode=args.max_decode)
                    for kind in cheats}
            print(cheat_table(runs, args.limit))
    return 0


def read_rows(path: Path) -> list[tuple[str, str, str, CheckStats, int]]:
    """The checks a --rows file holds, as `measure` returns them."""
    try:
        return [(v, n, k, CheckStats(**st), b) for v, n, k, b, st in json.loads(path.read_text())]
    except (OSError, ValueError, TypeError) as exc:
        raise SystemExit(f"--from-rows {path}: not a --rows file of this benchmark ({exc})") from None


def judged_by(ckpt: Path, path: str | None) -> dict:
    """The stage envelope to judge cheats by: the given file's, else the one shipped for this checkpoint."""
    path = path or shipped_envelope(fingerprint(ckpt))
    return (load_stage_envelopes(str(path)) or {}) if path else {}


if __name__ == "__main__":
    sys.exit(main())
