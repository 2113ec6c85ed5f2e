"""Stage checks over the real wire (neurons/validator_app/stage_rounds.py) against real stage processes: per
stage cheater the challenges and seconds until blame, honest fp32 and bf16 stages never blamed (and their
per-token drift: median, q99 and max relative L2, smallest cosine, share of bad tokens, worst window), fp32
stages on 2 threads, the drift chunked prefill alone makes, and the validator's CPU per stage challenge. Prints
tables.

    OMP_NUM_THREADS=1 PYTHONPATH=$PWD python -m benchmarks.stage_rounds --repeats 5 --honest 4
    OMP_NUM_THREADS=1 PYTHONPATH=$PWD python -m benchmarks.stage_rounds --checkpoint random

Without --checkpoint the tiny K3 trained on real text (inference/model/assets/tiny_trained) is used; with
--checkpoint random the tiny model with random weights (seed 0).
"""
from __future__ import annotations

import argparse
import asyncio
import logging
import socket
import statistics
import tempfile
import time
from pathlib import Path

import bittensor as bt
import numpy as np
import torch

from inference.model import ModelConfig, make_random_checkpoint
from inference.serving.builders import load_reference_model
from inference.swarm.stage import LayerRange
from localnet.cheats.stage import CHEATS, start_hosts, stop_hosts
from neurons.swarm.route import StaticDirectory
from neurons.validator_app.stage_rounds import StageMiner, StageRounds
from neurons.validator_app.store import ValidatorStore
from scoring.corpus import code_snippet, paragraph
from scoring.stage_checks import (SeedCommitment, Thresholds, challenge_steps, compare_heads, compare_states,
                                  plan_steps, reference_stage)

TRAINED_TINY = Path(__file__).resolve().parents[1] / "inference" / "model" / "assets" / "tiny_trained"
BLOCKS = {"0-2": (0, 3), "3-5": (3, 6), "6-8": (6, 9), "9-12": (9, 13)}
CHEAT_BLOCK = {"other-weights": "3-5", "skip-layer": "9-12", "echo": "0-2", "session-liar": "3-5",
               "long-position-liar": "6-8", "replay": "6-8", "forwarder": "6-8"}


def hotkey(root: Path, name: str):
    w = bt.Wallet(name, "default", path=str(root))
    w.create_new_hotkey(use_password=False, suppress=True)
    return w.hotkey


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def worst_window(bad: list[bool], window: int) -> int:
    counts = np.convolve(np.asarray(bad, dtype=np.int64), np.ones(window, dtype=np.int64), mode="valid")
    return int(counts.max()) if len(counts) else int(sum(bad))


def drift(results) -> str:
    """Per-token statistics over challenges: median, q99, max relative L2, smallest cosine, bad tokens, worst
    window (state blocks: the projected new state; the head: |logprob diff|, cosine 1)."""
    rel = [x for r in results for x in r.stats.rel_l2]
    cos = [x for r in results for x in r.stats.cosine]
    bad = [x for r in results for x in r.stats.bad]
    if not rel:
        return "- | - | - | - | - | -"
    q = np.quantile(rel, [0.5, 0.99, 1.0])
    w = Thresholds().window
    return (f"{q[0]:.4f} | {q[1]:.4f} | {q[2]:.4f} | {min(cos):.4f} | {np.mean(bad):.2%} | "
            f"{max(worst_window(r.stats.bad, w) for r in results)}/{w}")


def chunking_drift(model, tokenizer, prompts: int, max_tokens: int, seed: int = 7) -> None:
    """The drift chunked prefill alone makes (fp32, in process): each block's output for a prompt fed in the
    challenge's random chunks against the same prompt in one forward."""
    import random  # noqa: PLC0415

    rng, np_rng = random.Random(seed), np.random.default_rng(seed)
    n_layers = model.config.num_layers
    print("\n| block | chunked vs one-piece prefill (fp32) | tokens | median | q99 | max | smallest cosine | "
          "bad tokens |")
    print("|---|---|---|---|---|---|---|---|")
    t = Thresholds()
    for label, (a, b) in BLOCKS.items():
        layers = LayerRange(a, b, n_layers)
        rel, cos, bad = [], [], []
        for i in range(prompts):
            ids: list[int] = []
            while len(ids) < max_tokens + 1:
                ids += tokenizer.encode(paragraph(rng) if rng.random() < 0.6 else code_snippet(rng))
            ids = ids[:max_tokens + 1]
            plan = plan_steps(np_rng, max_tokens, min_tokens=max_tokens)
            steps = challenge_steps(model, layers, ids, plan)
            whole = challenge_steps(model, layers, ids, [(0, max_tokens)])[0]
            chunked, one = reference_stage(model, a, b), reference_stage(model, a, b)
            chunked.open("c")
            one.open("o")
            got = [chunked.forward("c", s.position, s.inputs, s.mode, s.targets, s.top_k) for s in steps]
            want = one.forward("o", 0, whole.inputs, whole.mode, whole.targets, whole.top_k)
            seed_i = SeedCommitment.new(i).seed
            if layers.has_head:
                from inference.swarm.stage import HeadOutput  # noqa: PLC0415

                rows = HeadOutput("score", logprobs=[x for g in got for x in g.logprobs],
                                  row_tops=[x for g in got for x in g.row_tops])
                c = compare_heads(want, rows, t)
            else:
                from inference.model.k3 import ResidualState  # noqa: PLC0415

                cat = ResidualState((max_tokens,), [torch.cat([g.blocks[j] for g in got]) for j in
                                                    range(len(got[0].blocks))], torch.cat([g.partial for g in got]))
                c = compare_states(want, cat, chunked.input_blocks, seed_i, t)
            rel += c.rel_l2
            cos += c.cosine
            bad += c.bad
        q = np.quantile(rel, [0.5, 0.99, 1.0])
        print(f"| {label} | {prompts} prompts x {max_tokens} tokens | {len(rel)} | {q[0]:.2e} | {q[1]:.2e} | "
              f"{q[2]:.2e} | {min(cos):.6f} | {np.mean(bad):.2%} |")


async def bench(args, root: Path, ckpt: Path, info: dict, decoy_port: int) -> None:
    model, tokenizer, _ = load_reference_model(ckpt, verify=False)
    validator, decoy = hotkey(root / "wallets", "validator"), hotkey(root / "wallets", "decoy")

    async def rounds(seed: int, db: Path):
        store = ValidatorStore(db)
        sr = StageRounds(store, validator, model, tokenizer, seed=seed, max_tokens=args.max_tokens,
                         decoy_keypair=decoy, decoys={(6, 9): decoy_port})
        await sr.start()
        await sr._start_decoys()
        found = {i.hotkey: i for i in await StaticDirectory([v["url"] for v in info.values()],
                                                            timeout_s=30.0).stages(sr._http)}
        miners = {n: StageMiner(i, v["hotkey"], n, found[v["hotkey"]]) for i, (n, v) in enumerate(info.items())}
        sr.miners = {m.hotkey: m for m in miners.values()}
        store.save_stage_miners([dict(uid=m.uid, hotkey=m.hotkey, layers=m.label) for m in miners.values()])
        return store, sr, miners

    print("| stage | dtype / wire / threads | challenges | blamed | tokens / challenge | median rel L2 | q99 | max | "
          "smallest cosine | bad tokens | worst window | validator CPU ms / challenge (all) | of which reference + "
          "compare | wall ms / challenge |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    honest_all, cheat_all = [], {}
    store, sr, miners = await rounds(1, root / "honest.sqlite")
    try:
        for name, m in miners.items():
            if not name.startswith(("fp32", "fp2t", "bf16")):
                continue
            results = [await sr.challenge(m) for _ in range(args.honest)]
            honest_all += results
            rows = store.stage_checks(hotkey=m.hotkey)
            kind = {"fp32": "fp32 / fp32 / 1", "fp2t": "fp32 / fp32 / 2", "bf16": "bf16 / bf16 / 1"}[name[:4]]
            print(f"| {m.label} | {kind} | {len(results)} | {sum(not r.ok for r in results)} | "
                  f"{statistics.mean(r.tokens for r in results):.0f} | {drift(results)} | "
                  f"{statistics.mean(r['cpu_s'] for r in rows) * 1000:.0f} | "
                  f"{statistics.mean(r.validator_cpu_s for r in results) * 1000:.0f} | "
                  f"{statistics.mean(r['wall_s'] for r in rows) * 1000:.0f} |")
    finally:
        await sr.close()
        store.close()
    print("\n(state blocks: relative L2 and cosine of the projected new state per token; head block 9-12: |logprob "
          "diff| per row, cosine 1)")
    chunking_drift(model, tokenizer, args.chunk_prompts, args.max_tokens)
    print("\n| cheater | block | challenges until blamed (per run) | max | seconds until blamed (per run) | caught by "
          "| median rel L2 | q99 | max | smallest cosine | bad tokens | worst window |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for kind, block in CHEAT_BLOCK.items():
        counts, secs, how, results = [], [], set(), []
        for run in range(args.repeats):
            store, sr, miners = await rounds(100 + run, root / f"{kind}-{run}.sqlite")
            try:
                m = miners[f"cheat-{kind}"]
                t0 = time.monotonic()
                for k in range(1, args.limit + 1):
                    r = await sr.challenge(m)
                    cheat_all.setdefault(kind, []).append(r)
                    if not r.ok:
                        results.append(r)
                    blame = store.stage_blame(m.hotkey, 0)
                    if blame:
                        counts.append(k)
                        secs.append(time.monotonic() - t0)
                        how.add(blame[-1]["kind"])
                        break
                else:
                    counts.append(None)
            finally:
                await sr.close()
                store.close()
        shown = [c if c is not None else f">{args.limit}" for c in counts]
        worst = max(c for c in counts) if all(counts) else "not caught"
        print(f"| {kind} | {block} | {shown} | {worst} | {[round(s, 1) for s in secs]} | {', '.join(sorted(how))} | "
              f"{drift(results)} |")
    sweep(honest_all, cheat_all)


def sweep(honest, cheats) -> None:
    """Per candidate token limit (relative L2; cosine limit as now): the worst window of bad tokens over the
    honest challenges (each block, precision and thread count), and the share of challenges of each cheater
    that lies in every session that a window limit would fail."""
    t = Thresholds()
    print(f"\n| token limit: rel L2 > | honest: bad tokens | honest: worst window of {t.window} | always-lying "
          f"cheaters: worst window, smallest (per challenge) | share of their challenges failed at {t.window_bad}/"
          f"{t.window} | at 8/{t.window} |")
    print("|---|---|---|---|---|---|")
    lying = [r for k in ("other-weights", "skip-layer", "echo") for r in cheats.get(k, []) if r.stats.rel_l2]

    def windows(r, limit):
        bad = [rel > limit or cos < t.token_min_cosine for rel, cos in zip(r.stats.rel_l2, r.stats.cosine)]
        w = min(t.window, len(bad))
        return worst_window(bad, w), w, bad

    for limit in (0.15, 0.1, 0.07, 0.05, 0.03):
        hw = [windows(r, limit) for r in honest if r.stats.rel_l2]
        cw = [windows(r, limit) for r in lying]
        bad = [x for _, _, b in hw for x in b]
        need = [(max(1, -(-t.window_bad * w // t.window)), max(1, -(-8 * w // t.window))) for _, w, _ in cw]
        failed12 = np.mean([c >= n12 for (c, _, _), (n12, _) in zip(cw, need)]) if cw else float("nan")
        failed8 = np.mean([c >= n8 for (c, _, _), (_, n8) in zip(cw, need)]) if cw else float("nan")
        print(f"| {limit} | {np.mean(bad):.2%} | {max(c for c, _, _ in hw)}/{t.window} | "
              f"{min(c for c, _, _ in cw) if cw else '-'} (of {min(w for _, w, _ in cw) if cw else '-'}) | "
              f"{failed12:.0%} | {failed8:.0%} |")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=5, help="runs per cheater (a fresh validator each)")
    ap.add_argument("--honest", type=int, default=4, help="challenges per honest stage")
    ap.add_argument("--limit", type=int, default=30, help="give up on a cheater after this many challenges")
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--checkpoint", default=str(TRAINED_TINY),
                    help="the model (default: the tiny K3 trained on real text, inference/model/assets/tiny_trained); "
                         "random: the tiny model with random weights, seed 0")
    ap.add_argument("--chunk-prompts", type=int, default=6, help="prompts per block for the chunked-prefill drift")
    args = ap.parse_args()
    started = time.time()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        random = args.checkpoint == "random"
        ckpt = root / "ckpt" if random else Path(args.checkpoint).resolve()
        if random:
            make_random_checkpoint(ModelConfig.tiny(), ckpt, seed=0)
        print(f"model: {'tiny, random weights (seed 0)' if random else ckpt}")
        names = [f"fp32-{b}" for b in BLOCKS] + [f"fp2t-{b}" for b in BLOCKS] + [f"bf16-{b}" for b in BLOCKS] + \
            [f"cheat-{k}" for k in CHEATS]
        for n in names:
            hotkey(root / "wallets", n)
        decoy_port = free_port()
        hosts = {"fp32": [f"fp32-{b}:honest:{b}" for b in BLOCKS],
                 "bf16": [f"bf16-{b}:honest:{b}:bfloat16:bfloat16" for b in BLOCKS]}
        procs, info = start_hosts(ckpt, root / "wallets", hosts, root)
        try:
            more, two = start_hosts(ckpt, root / "wallets", {"fp2t": [f"fp2t-{b}:honest:{b}" for b in BLOCKS]}, root,
                                    threads=2)  # other thread counts
            procs.update(more)
            info.update(two)
            more, cheats = start_hosts(ckpt, root / "wallets", {"cheats": [
                f"cheat-{k}:{k}:{b}" for k, b in CHEAT_BLOCK.items()]}, root, {"cheats": [
                    "--forward-to", f"http://127.0.0.1:{decoy_port}", "--forward-to", info["fp32-6-8"]["url"]]})
            procs.update(more)
            info.update(cheats)
            print(f"stage processes ready in {time.time() - started:.0f} s\n")
            asyncio.run(bench(args, root, ckpt, info, decoy_port))
        finally:
            stop_hosts(procs)
    print(f"\n{time.time() - started:.0f} s; the forwarder hands each session to one of 2 stages of its block, one "
          "of them the validator's decoy")


if __name__ == "__main__":
    logging.getLogger("k3").setLevel(logging.ERROR)  # blame is in the tables
    main()
