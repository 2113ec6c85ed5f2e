"""Held-out bits per byte of the trained tiny K3 against the random tiny models and a byte unigram, and
whether it answers the validator's answer probes (planted fact, exact copy) greedily.

    python -m benchmarks.tiny_model                       # the shipped inference/model/assets/tiny_trained
    python -m benchmarks.tiny_model --checkpoint DIR --eval-bytes 65536 --probes 20

Held-out text: the stdlib files the training split holds out (inference/model/training.py). Each model
scores windows of --seq-len bytes through the inference forward (positions 1..T-1 of each window).
Probes use the validator's own wording and names (scoring/corpus.py) at three sizes: the fact right before
the question, the fact inside ~150 bytes of filler, and a short exact-copy request; and then the validator's
own probe prompts (scoring/workloads.py, planted fact and exact copy, local-testnet prompt sizes), judged by
its own check (scoring.audit_sequence.check_answer: the answer contains the value or the text).

    python -m benchmarks.tiny_model --write-probes scoring/envelopes/tiny_trained.json --probes 100

records how often the checkpoint answers the validator's probes, in fp32, bf16 and bf16 with emulated GPU kernels,
in the model's envelope file (its "probes"; the fingerprints must match): a validator serving this model then
scores the probe kinds it answers (scoring/model_envelope.py, PROBE_MIN_PASS).
"""
from __future__ import annotations

import argparse
import contextlib
import json
import random
import sys
import time
from pathlib import Path

import torch

from inference.model.checkpoint import fingerprint
from inference.model.config import ModelConfig
from inference.model.k3 import KimiK3Model
from inference.model.tokenizer import ByteTokenizer
from inference.model.training import (bits_per_byte, greedy_answer, heldout_windows, load_model, random_model,
                                      stdlib_corpus, unigram_bits_per_byte)
from scoring import corpus as probe_text
from scoring.config import ScoringConfig
from scoring.envelope import gpu_kernel_emulation, load_model as load_in_dtype
from scoring.model_envelope import ModelEnvelopeError, parse_envelope, with_probes
from scoring.workloads import _log_uniform_at, _PromptBuilder, _task_content

DEFAULT_CHECKPOINT = Path(__file__).resolve().parents[1] / "inference" / "model" / "assets" / "tiny_trained"


def probe_prompts(rng: random.Random, n: int) -> dict[str, list[tuple[str, str]]]:
    """(user content, expected answer) per probe kind."""
    kinds = {"fact_then_question": [], "fact_in_150B_filler": [], "copy_16_48B": []}
    for _ in range(n):
        subject, value = probe_text.person_name(rng), probe_text.access_code(rng)
        fact, question = probe_text.planted_fact(subject, value), probe_text.planted_question(subject)
        kinds["fact_then_question"].append((f"{fact}\n\n{question}", value))
        filler = " ".join(probe_text.paragraphs(rng, 150))[:150]
        kinds["fact_in_150B_filler"].append((f"{filler}\n\n{fact}\n\n{question}", value))
        passage = probe_text.paragraph(rng, "story")[: rng.randint(16, 48)]
        kinds["copy_16_48B"].append(
            (f"Repeat the following text exactly, with nothing before or after it:\n\n{passage}", passage))
    return kinds


def validator_probes(rng: random.Random, n: int, tokenizer: ByteTokenizer) -> dict[str, list[tuple[list[int], str]]]:
    """(prompt ids, expected text) of the validator's own planted-fact and exact-copy probes, local-testnet sizes."""
    config = ScoringConfig.local_testnet()
    builder = _PromptBuilder(tokenizer, config)
    kinds: dict[str, list[tuple[list[int], str]]] = {"validator_planted_fact": [], "validator_copy": []}
    for _ in range(n):
        for kind, task in (("validator_planted_fact", "planted_fact"), ("validator_copy", "copy")):
            size = _log_uniform_at(rng.random(), *config.chat_prompt_tokens)
            _, ids, expect = _task_content(rng, task, size, builder, config)
            kinds[kind].append((ids, expect.answer if task == "planted_fact" else expect.copy_text.strip()))
    return kinds


def run_probes(model: KimiK3Model, n: int, log=None) -> dict[str, tuple[int, int, str]]:
    """kind -> (passed, probes, first answer) for greedy answers of `model` (n probes of each kind)."""
    tok = ByteTokenizer.from_config(model.config)
    stops = sorted(tok.stop_ids)
    prompts = {kind: [(tok.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True),
                       answer) for content, answer in items]
               for kind, items in probe_prompts(random.Random(0), n).items()}
    prompts.update(validator_probes(random.Random(1), n, tok))
    out = {}
    for kind, items in prompts.items():
        passed, example = 0, ""
        for ids, answer in items:
            text = tok.decode(greedy_answer(model, ids, max_new=len(answer) + 16, stop_ids=stops),
                              skip_special_tokens=True)
            passed += answer in text
            example = example or repr(text[:40])
        out[kind] = (passed, len(items), example)
        if log:
            log(f"| {kind} | {passed}/{len(items)} | {example} |")
    return out


PROBE_KINDS = {"validator_planted_fact": "planted_fact", "validator_copy": "copy"}
HONEST_VARIANTS = ("fp32", "bf16", "bf16-gpu-kernels")


def answered(model: KimiK3Model, items: list[tuple[list[int], str]]) -> int:
    tok = ByteTokenizer.from_config(model.config)
    stops = sorted(tok.stop_ids)
    return sum(answer in tok.decode(greedy_answer(model, ids, max_new=len(answer) + 16, stop_ids=stops),
                                    skip_special_tokens=True) for ids, answer in items)


def write_probes(checkpoint: Path, path: Path, n: int, log=print) -> dict:
    """Measure the validator's planted-fact and copy probes (n of each) in each honest variant and record the
    counts in the envelope file at `path`, which must have been measured on this checkpoint."""
    try:
        data = json.loads(path.read_text())
        measured_on = parse_envelope(data, str(path)).fingerprint
    except (OSError, json.JSONDecodeError, ModelEnvelopeError) as error:
        raise SystemExit(f"error: cannot use {path} as an envelope file: {error}")
    model_fp = fingerprint(checkpoint)
    if measured_on != model_fp:
        raise SystemExit(f"error: {path} was measured on model {measured_on}, {checkpoint} is model {model_fp}")
    fp32, bf16 = load_in_dtype(checkpoint), load_in_dtype(checkpoint, torch.bfloat16)
    probes = validator_probes(random.Random(2), n, ByteTokenizer.from_config(fp32.config))
    runs = {"fp32": (fp32, contextlib.nullcontext), "bf16": (bf16, contextlib.nullcontext),
            "bf16-gpu-kernels": (bf16, gpu_kernel_emulation)}
    sizes = ScoringConfig.local_testnet().chat_prompt_tokens  # what validator_probes draws the prompt sizes from
    for kind, name in PROBE_KINDS.items():
        lengths = [len(ids) for ids, _ in probes[kind]]
        passed = {}
        for variant in HONEST_VARIANTS:
            model, context = runs[variant]
            with context():
                passed[variant] = (answered(model, probes[kind]), n)
            log(f"| {name} | {variant} | {passed[variant][0]}/{n} | {min(lengths)}-{max(lengths)} |")
        data = with_probes(data, name, sizes, passed)
    path.write_text(json.dumps(data, indent=1) + "\n")
    return data


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--checkpoint", type=Path, default=DEFAULT_CHECKPOINT)
    parser.add_argument("--eval-bytes", type=int, default=1 << 15)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--probes", type=int, default=10, help="probes of each kind (0: none)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--write-probes", type=Path, metavar="ENVELOPE",
                        help="measure --probes validator probes of each kind per honest variant and record the counts "
                             "in this envelope file of the checkpoint (nothing else is measured)")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    if not (args.checkpoint / "config.json").exists():
        print(f"error: no checkpoint at {args.checkpoint} (make one with scripts/train_tiny.py)", file=sys.stderr)
        return 1
    if args.write_probes:
        print("| probe | variant | answered | prompt tokens |\n|---|---|---|---|")
        write_probes(args.checkpoint, args.write_probes, args.probes)
        print(f"written to {args.write_probes}")
        return 0
    corpus = stdlib_corpus()
    windows = heldout_windows(corpus, args.eval_bytes, args.seq_len)
    trained = load_model(args.checkpoint)
    rows = [("trained tiny (this checkpoint, MXFP4 experts)", lambda: bits_per_byte(trained, windows)),
            (f"random {trained.config.model_id} (seed 0)", lambda: bits_per_byte(random_model(trained.config), windows)),
            ("random kimi-k3-tiny (seed 0)", lambda: bits_per_byte(random_model(ModelConfig.tiny()), windows)),
            ("byte unigram fitted on the training text", lambda: unigram_bits_per_byte(corpus.train, windows)),
            ("uniform over 256 bytes", lambda: 8.0)]
    print(f"held-out text: {windows.numel():,} bytes in {windows.shape[0]} windows of {args.seq_len} "
          f"(stdlib {corpus.root}, data {corpus.fingerprint})")
    print(f"| model | held-out bits/byte | seconds |\n|---|---|---|")
    for name, measure in rows:
        t = time.perf_counter()
        value = measure()
        print(f"| {name} | {value:.3f} | {time.perf_counter() - t:.1f} |", flush=True)
    if args.probes:
        print("\n| probe (greedy, chat template) | passed | example answer |\n|---|---|---|")
        run_probes(trained, args.probes, log=lambda line: print(line, flush=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
