"""`python -m inference`: generate from or score with a checkpoint on this machine.

    python -m inference generate --checkpoint DIR --prompt "Hello" --max-tokens 32 [--json]
    python -m inference generate --checkpoint DIR --token-ids 1,2,3 --temperature 0.8 --seed 7 --logprobs 5 --json
    python -m inference generate --checkpoint DIR --prompt "def f(x):" --speculate suffix --json
    python -m inference generate --checkpoint DIR --prompt "Hello" --device cuda          (bf16 on the GPU)
    python -m inference generate --checkpoint DIR --prompt "def f(x):" --speculate distilled --draft-model FILE
    python -m inference score --checkpoint DIR --token-ids 1,2,3,4 --top-k 5 --json
    python -m inference info --checkpoint DIR
    python -m inference manifest RELEASE_DIR [--sha256 SHA256SUMS] [--out DIR]

`manifest` writes the metadata checkpoint a miner in front of vLLM or SGLang needs (config.json,
tokenizer files and k3_manifest.json with the model fingerprint), from a release's files; the weights
may be absent when the release's sha256 list is given (inference/model/manifest.py).

Generation runs through the same engine a miner serves with, so its tokens (and, with a seed,
its samples) are exactly what a miner on this checkpoint would stream.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
from pathlib import Path

from inference.decoding.distilled import speculation_with_table
from inference.decoding.drafters import DRAFTER_KINDS
from inference.decoding.speculation import MAX_DRAFT_TOKENS, SpeculationConfig
from inference.model import WEIGHT_DTYPES, CheckpointError, ConfigError
from inference.serving import (EngineError, EngineSettings, EngineSpecError, GenerationRequest, LocalEngine,
                               SamplingParams, TokenEvent, load_reference_model)


class UsageError(Exception):
    pass


def _token_ids(text: str) -> list[int]:
    try:
        ids = [int(t) for t in text.replace(" ", "").split(",") if t != ""]
    except ValueError:
        raise UsageError(f"--token-ids must be comma-separated integers, got {text!r}") from None
    if not ids:
        raise UsageError("--token-ids is empty")
    return ids


def _parser() -> argparse.ArgumentParser:
    # named as started: the console script k3, else the module (never a file path inside the package)
    prog = "k3" if os.path.basename(sys.argv[0]) == "k3" else "python -m inference"
    p = argparse.ArgumentParser(prog=prog, description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    g = sub.add_parser("generate", help="generate a continuation")
    g.add_argument("--checkpoint", required=True, help="checkpoint directory (config.json + safetensors)")
    src = g.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="text prompt (BOS is prepended, as the model sees it)")
    src.add_argument("--token-ids", help="prompt as comma-separated token ids, used exactly as given")
    g.add_argument("--max-tokens", type=int, default=32)
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--logprobs", type=int, default=0, help="report this many top alternatives per token (0..20)")
    g.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    g.add_argument("--json", action="store_true", help="print a JSON object instead of the text")
    g.add_argument("--speculate", choices=DRAFTER_KINDS, default="none",
                   help="speculative decoding with a model-free drafter, or the distilled draft model (needs "
                        "--draft-model); the output is the same; --json reports the drafted and accepted tokens")
    g.add_argument("--draft-model", help="with --speculate distilled: the draft table scripts/distill_drafter.py "
                                         "made for this checkpoint")
    g.add_argument("--draft-tokens", type=int, default=8,
                   help=f"most tokens drafted per step (1..{MAX_DRAFT_TOKENS}); fewer when drafts are poor")
    _device_arguments(g)
    s = sub.add_parser("score", help="teacher-forced logprobs of given token ids")
    s.add_argument("--checkpoint", required=True)
    s.add_argument("--token-ids", required=True, help="comma-separated token ids, used exactly as given")
    s.add_argument("--top-k", type=int, default=0)
    s.add_argument("--json", action="store_true")
    _device_arguments(s)
    i = sub.add_parser("info", help="print the checkpoint's config summary and fingerprint")
    i.add_argument("--checkpoint", required=True)
    m = sub.add_parser("manifest", help="write k3_manifest.json (the fingerprint) for a release, weights optional")
    m.add_argument("release", help="directory with config.json, tokenizer files, model.safetensors.index.json")
    m.add_argument("--sha256", help="the release's published sha256 list (sha256sum format) for absent shards")
    m.add_argument("--out", help="write the metadata checkpoint here (copies the metadata files, not the weights)")
    m.add_argument("--quiet", action="store_true", help="no progress bar")
    return p


def _device_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N (default: cpu)")
    parser.add_argument("--dtype", choices=WEIGHT_DTYPES, default="auto",
                        help="weights dtype (auto: bfloat16 on a GPU, float32 on the CPU)")


def _load(args):
    """The reference model on --device in --dtype; a UsageError (one line) when the device is not here."""
    try:
        return load_reference_model(args.checkpoint, args.dtype, device=args.device)
    except EngineSpecError as error:
        raise UsageError(str(error)) from None


async def _generate(args) -> dict:
    speculation = SpeculationConfig(drafter=args.speculate, max_draft_tokens=args.draft_tokens)
    problems = [p for p in speculation.problems() if not (args.draft_model and p.startswith("speculate distilled"))]
    if problems:
        raise UsageError("; ".join(problems).replace("max_draft_tokens", "--draft-tokens"))
    model, tokenizer, fp = _load(args)
    try:
        speculation = speculation_with_table(speculation, args.draft_model, fp)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    prompt_ids = _token_ids(args.token_ids) if args.token_ids else tokenizer.encode(args.prompt, add_bos=True)
    sampling = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                              top_k=args.top_k, seed=args.seed, stop=tuple(args.stop), logprobs=args.logprobs)
    settings = EngineSettings(max_context=model.config.max_position_embeddings, max_concurrent_sequences=1)
    async with LocalEngine(model, tokenizer, settings, model_fingerprint=fp, speculation=speculation) as engine:
        tokens, final = [], None
        async for ev in engine.generate(GenerationRequest(prompt_ids, sampling)):
            if isinstance(ev, TokenEvent):
                tokens.append(ev)
                if not args.json:
                    sys.stdout.write(ev.text)
                    sys.stdout.flush()
            else:
                final = ev
    if not args.json:
        sys.stdout.write("\n")
    out = {
        "model_fingerprint": fp,
        "prompt_token_ids": prompt_ids,
        "token_ids": [t.token_id for t in tokens],
        "text": "".join(t.text for t in tokens),
        "finish_reason": final.finish_reason,
        "logprobs": [t.logprob for t in tokens],
        "speculate": args.speculate,
        "draft_proposed": final.draft_proposed,
        "draft_accepted": final.draft_accepted,
        "verify_steps": final.verify_steps,
    }
    if args.logprobs:
        out["top_logprobs"] = [[[i, lp] for i, lp in t.top_logprobs] for t in tokens]
    return out


async def _score(args) -> dict:
    model, tokenizer, fp = _load(args)
    ids = _token_ids(args.token_ids)
    settings = EngineSettings(max_context=model.config.max_position_embeddings, max_concurrent_sequences=1)
    async with LocalEngine(model, tokenizer, settings, model_fingerprint=fp) as engine:
        scored = await engine.score(ids, None, args.top_k)
    return {
        "model_fingerprint": fp,
        "token_ids": ids,
        "logprobs": [s.logprob for s in scored],
        "top": [[[i, lp] for i, lp in s.top] for s in scored],
    }


def main(argv=None) -> int:
    args = _parser().parse_args(argv)
    try:
        if args.command == "info":
            from inference.model import fingerprint, read_config

            config = read_config(args.checkpoint)
            print(json.dumps({**config.summary(), "fingerprint": fingerprint(args.checkpoint)}, indent=2))
            return 0
        if args.command == "manifest":
            from inference.model.manifest import make_manifest  # noqa: PLC0415

            manifest = make_manifest(args.release, args.sha256, args.out, progress=not args.quiet)
            print(json.dumps({"fingerprint": manifest["fingerprint"], "shards": manifest["num_shards"],
                              "weights_present": manifest["weights_present"],
                              "written": str(Path(args.out or args.release) / "k3_manifest.json")}))
            return 0
        if args.command == "generate":
            out = asyncio.run(_generate(args))
            if args.json:
                print(json.dumps(out))
            return 0
        out = asyncio.run(_score(args))
        if args.json:
            print(json.dumps(out))
        else:
            for pos, (lp, top) in enumerate(zip(out["logprobs"], out["top"]), start=1):
                print(f"{pos:6d} {out['token_ids'][pos]:8d} {lp:10.4f} {top}")
        return 0
    except (UsageError, EngineError, CheckpointError, ConfigError, FileNotFoundError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
