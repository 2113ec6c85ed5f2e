#!/usr/bin/env python3
"""Distil a draft table from a checkpoint (inference/decoding/distilled.py): the target's own greedy choices
after byte contexts of its training corpus (the stdlib's training files; held-out files and anything sharing a
16-byte piece with bench_speculative.py's prompts are left out), teacher-forced and from its own greedy
continuations. Deterministic; a few CPU minutes for the tiny model.

    python scripts/distill_drafter.py --checkpoint inference/model/assets/tiny_trained --out drafts.k3d
    python -m inference generate --checkpoint ... --prompt "def f(x):" --speculate distilled --draft-model drafts.k3d
"""
import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from benchmarks.speculative import PROMPTS  # noqa: E402
from inference.decoding.distilled import distill  # noqa: E402
from inference.model.training import stdlib_corpus  # noqa: E402
from inference.serving.builders import load_reference_model  # noqa: E402


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoint", required=True)
    p.add_argument("--out", required=True, type=Path)
    p.add_argument("--stdlib-dir", default=None, help="corpus root (default: this interpreter's Lib)")
    p.add_argument("--n-max", type=int, default=12, help="longest context (tokens)")
    p.add_argument("--forced-windows", type=int, default=2048, help="teacher-forced windows of --window bytes")
    p.add_argument("--window", type=int, default=128)
    p.add_argument("--generated", type=int, default=1024, help="greedy continuations of the target")
    p.add_argument("--gen-tokens", type=int, default=96)
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    t0, c0 = time.perf_counter(), time.process_time()
    model, tokenizer, fp = load_reference_model(args.checkpoint)
    corpus = stdlib_corpus(args.stdlib_dir)
    banned = [text.encode() for text in PROMPTS.values()]
    table = distill(model, fp, [corpus.train], model.config.bos_token_id, n_max=args.n_max,
                    forced_windows=args.forced_windows, window=args.window, generated=args.generated,
                    gen_tokens=args.gen_tokens, banned=banned,
                    log=lambda m: print(f"[{time.perf_counter() - t0:6.1f}s] {m}", flush=True))
    table.source["corpus"] = f"stdlib train files ({corpus.train_files}), held-out excluded"
    size = table.save(args.out)
    print(f"{args.out}: {len(table.entries)} contexts, {size} bytes, for checkpoint {fp}; "
          f"{time.perf_counter() - t0:.1f} s wall, {time.process_time() - c0:.1f} s CPU")
    return 0


if __name__ == "__main__":
    sys.exit(main())
