"""The prepared GPU check: the project's engine and stage miners on one GPU, against the CPU reference, one JSON file.

    scripts/gpu_check.sh --out gpu_check.json            # --device cuda; the scaled K3 at 20 GB; < 8 min on an H100
    scripts/gpu_check.sh --device cpu --out dry.json     # the dry run on a CPU: the same steps, the scaled K3 at 0.2 GB
    python -m benchmarks.gpu_check --device cuda --work ~/k3-gpu-check --skip swarm

Steps (each records its seconds, and its error if it fails, so one failing step leaves the others' figures):
1. `tiny` and `scaled`: the tiny trained model (inference/model/assets/tiny_trained) and a K3-shaped model scaled
   down to --scaled-gb (K3's layer shapes at 20 GB and above, every width scaled below; written by k3-checkpoint),
   each in --dtype (bf16) on --device against the fp32 CPU reference: greedy tokens; teacher-forced logprobs of
   the device's answers judged by the tier-1 rules (scoring/tier1.py; with the model's measured envelope where one
   is shipped); the stage judge on each block of a 3-stage split (scoring.stage_checks.recheck_opened of a session
   through device stages, judged by scoring/stage_judge.py where the model has a measured stage envelope).
2. speed (both models): single-stream decode tokens/s, 16-stream aggregate, prefill tokens/s at --prefill-tokens.
3. `kda`: our KDA kernels against fla's Triton kernels on K3's KDA shapes (96 heads of 128): numerics and time.
4. `swarm`: three stage miner processes (neurons.stage_miner --device) on the one device serving the scaled model as
   a route, single-stream tokens/s next to the single process's (benchmarks/swarm.py's route over loopback).
5. `roofline`: the bytes of weights a single-stream decode step of the scaled model reads (dense weights, the routed
   experts it picks in MXFP4, one embedding row) over its step time, as a fraction of the card's bandwidth (data
   sheet, and a device-to-device copy measured here).
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import gc
import json
import math
import os
import platform
import random
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from types import SimpleNamespace

import torch

ROOT = Path(__file__).resolve().parent.parent
TINY_TRAINED = ROOT / "inference" / "model" / "assets" / "tiny_trained"
STEPS = ("tiny", "kda", "scaled", "swarm")
# Memory bandwidth by card name, bytes/s (data sheets); the first name a device's name contains wins.
CARD_BANDWIDTH = (("H200", 4.8e12), ("H100 NVL", 3.9e12), ("H100 PCIe", 2.0e12), ("H100", 3.35e12),
                  ("A100-SXM4-80GB", 2.039e12), ("A100", 1.555e12), ("RTX 5090", 1.792e12), ("RTX 4090", 1.008e12),
                  ("L40S", 0.864e12), ("MI355X", 8.0e12), ("B200", 8.0e12))


# ------------------------------------------------------------------------------------ the scaled K3
def _multiple(x: float, m: int) -> int:
    return max(m, m * math.ceil(x / m))


def scaled_k3_config(target_bytes: int, layers: int = 12, experts: int = 16, top_k: int = 4):
    """Kimi K3 cut down to about `target_bytes` of checkpoint: MLA every 4th layer and the last, layer 0 dense,
    Attention Residuals blocks of 4, `experts` routed experts of K3's shape per MoE layer (top `top_k`). Where K3's
    own widths fit (20 GB and up), they are kept (hidden 7168, 96 heads of 128, vocabulary 163840) with the fewest
    layers that reach the target (11 for 20 GB); below, `layers` layers with every width scaled by one factor (heads
    stay 128 wide, so fla's kernels apply), the smallest that reaches the target."""
    from inference.model import ModelConfig  # noqa: PLC0415 (torch)

    k3 = ModelConfig.kimi_k3()

    def build(w: float, n: int):
        heads = max(2, round(96 * w))
        vocab = max(1024, _multiple(163840 * w, 256))
        mla = tuple(sorted({i - 1 for i in range(4, n + 1, 4)} | {n - 1}))
        return dataclasses.replace(
            k3, model_id=f"kimi-k3-scaled-{target_bytes / 1e9:g}gb", vocab_size=vocab, bos_token_id=vocab - 256,
            eos_token_id=vocab - 254, pad_token_id=vocab - 1, max_position_embeddings=65536,
            hidden_size=_multiple(7168 * w, 64), num_layers=n, mla_layers=mla, attn_res_block_size=4,
            dense_intermediate_size=_multiple(33792 * w, 32), num_experts=experts, experts_per_token=top_k,
            expert_intermediate_size=_multiple(3072 * w, 32), latent_size=_multiple(3584 * w, 32), mla_heads=heads,
            kda_heads=heads, q_lora_rank=_multiple(1536 * w, 32), kv_lora_rank=_multiple(512 * w, 32),
            a_log_size=max(heads, 128))

    if target_bytes >= 0.8 * build(1.0, layers).checkpoint_bytes():  # K3's widths: the fewest layers that reach it
        n = 4
        while build(1.0, n).checkpoint_bytes() < target_bytes:
            n += 1
        return build(1.0, n)
    lo, hi = 0.0, 1.0
    for _ in range(30):
        mid = (lo + hi) / 2
        lo, hi = (lo, mid) if build(mid, layers).checkpoint_bytes() >= target_bytes else (mid, hi)
    return build(hi, layers)


def scaled_checkpoint_dir(config, work: Path) -> Path:
    return work / f"{config.model_id}-{config.num_layers}l-{config.checkpoint_bytes() // 10**6}mb"


def start_scaled_checkpoint(config, work: Path) -> tuple[Path, subprocess.Popen | None]:
    """The scaled checkpoint's directory, and the k3-checkpoint process writing it (None when `work` already holds
    it: a rerun on the same machine reuses it)."""
    from inference.model import CheckpointError, read_config  # noqa: PLC0415

    out = scaled_checkpoint_dir(config, work)
    try:
        if (out / "k3_manifest.json").exists() and read_config(out) == config:
            return out, None
    except CheckpointError:
        pass
    work.mkdir(parents=True, exist_ok=True)
    (work / "scaled-config.json").write_text(json.dumps(config.to_hf_config(), indent=1))
    cmd = [sys.executable, "-m", "inference.model.make_checkpoint", "--config", str(work / "scaled-config.json"),
           "--out", str(out), "--overwrite", "--quiet"]
    log = open(work / "make_checkpoint.log", "w")
    return out, subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                                 env={**os.environ, "PYTHONPATH": str(ROOT)})


# ------------------------------------------------------------------------------------------- helpers
def _sync(device) -> None:
    from inference.model import synchronize  # noqa: PLC0415
    synchronize(device)


def _timed(fn, device, repeats: int = 3) -> float:
    """Median seconds of `fn()` (after one warm-up), the device synchronised around each."""
    fn()
    times = []
    for _ in range(repeats):
        _sync(device)
        t0 = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]


def _release_memory() -> None:
    """After a model was dropped: its memory back (the next step loads another model on the device)."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _prompt(vocab: int, n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(min(vocab, 256)) for _ in range(n)]


def machine(device: torch.device) -> dict:
    out = {"python": platform.python_version(), "torch": torch.__version__, "cpu_count": os.cpu_count(),
           "device": str(device), "date": time.strftime("%Y-%m-%d %H:%M:%S %Z")}
    with contextlib.suppress(ImportError):
        import importlib.metadata as md  # noqa: PLC0415
        out["fla_core"] = md.version("fla-core")
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        out.update(name=props.name, memory_bytes=props.total_memory, cuda=torch.version.cuda,
                   multiprocessors=props.multi_processor_count)
        out["bandwidth_datasheet"] = next((bw for key, bw in CARD_BANDWIDTH if key in props.name), None)
    else:
        out["name"] = platform.processor() or platform.machine()
        out["bandwidth_datasheet"] = None
    out["bandwidth_measured"] = copy_bandwidth(device)
    return out


def copy_bandwidth(device: torch.device, nbytes: int = 1 << 30) -> float:
    """Bytes/s a copy moves on the device (bytes read plus bytes written), best of five."""
    nbytes = nbytes if device.type == "cuda" else nbytes // 8
    src = torch.empty(nbytes // 4, dtype=torch.float32, device=device).fill_(1.0)
    dst = torch.empty_like(src)
    best = math.inf
    for _ in range(5):
        _sync(device)
        t0 = time.perf_counter()
        dst.copy_(src)
        _sync(device)
        best = min(best, time.perf_counter() - t0)
    return 2 * nbytes / best


# ------------------------------------------------------------------------------- 1. against the reference
def greedy_tokens(model, prompt: list[int], n: int) -> list[int]:
    with torch.inference_mode():
        cache, out, ids = model.new_cache(), [], torch.tensor(prompt)
        for _ in range(n):
            logits = model.forward([ids], [cache])[0]
            out.append(int(logits.argmax()))
            ids = torch.tensor([out[-1]])
    return out


def teacher_forced(device_model, reference, checkpoint: Path, prompts: list[list[int]], new_tokens: int,
                   precision: str) -> dict:
    """The device's answers (greedy and sampled) teacher-forced on the reference, judged by the tier-1 rules with
    the model's shipped envelope (if any): what a validator's audit of this miner would find."""
    from inference.model import fingerprint  # noqa: PLC0415
    from scoring.config import ScoringConfig  # noqa: PLC0415
    from scoring.envelope import LogitsToHost, generate, reference_scores  # noqa: PLC0415
    from scoring.model_envelope import shipped_envelope  # noqa: PLC0415
    from scoring.tier1 import audit_statistics, judge_statistics  # noqa: PLC0415

    envelope = shipped_envelope(fingerprint(checkpoint))
    config = ScoringConfig.local_testnet(logprob_gap_envelope=str(envelope) if envelope else None)
    stop_ids = frozenset({reference.config.eos_token_id})
    temps = [0.0 if i % 2 == 0 else 0.8 for i in range(len(prompts))]
    answers = generate(LogitsToHost(device_model), prompts, temps, new_tokens, list(range(len(prompts))), stop_ids)
    rows, gaps = [], []
    for a, scores in zip(answers, reference_scores(reference, answers)):
        stats = audit_statistics(a.tokens, a.logprobs, a.temperature, scores, stop_ids, config)
        failures = judge_statistics(stats, config, trusted=True, exact=precision == "fp32", precision=precision,
                                    prompt_tokens=len(a.prompt))
        gaps += [abs(m - s.logprob) for m, s in zip(a.logprobs, scores)]
        rows.append({"temperature": a.temperature, "tokens": len(a.tokens),
                     "logprob_gap_mean": stats.logprob_gap_mean, "failures": [f.check for f in failures]})
    return {"envelope": envelope.name if envelope else None, "audits": len(rows),
            "failed": sum(1 for r in rows if r["failures"]), "max_abs_logprob_diff": max(gaps, default=0.0),
            "mean_abs_logprob_diff": sum(gaps) / max(1, len(gaps)), "answers": rows}


def stage_checks(device_model, reference, checkpoint: Path, prompt: list[int], new_tokens: int,
                 numerics: str) -> list[dict]:
    """One session through three device stages (the blocks of a 3-stage split, each a `Stage` over the device
    model), each block's recorded steps re-run on the reference (scoring.stage_checks.recheck_opened) and judged by
    the model's stage envelope for `numerics` where one is shipped."""
    from benchmarks.stage_envelope import RouteStage, drive_session, session_plan  # noqa: PLC0415
    from inference.model import fingerprint, model_device  # noqa: PLC0415
    from inference.planning.swarm_plan import stage_blocks  # noqa: PLC0415
    from inference.swarm.stage import LayerRange, Stage  # noqa: PLC0415
    from scoring.model_envelope import shipped_envelope  # noqa: PLC0415
    from scoring.stage_checks import recheck_opened, reference_stage  # noqa: PLC0415
    from scoring.stage_judge import CheckStats, load_stage_envelopes  # noqa: PLC0415

    config = reference.config
    shipped = shipped_envelope(fingerprint(checkpoint))
    envelopes = (load_stage_envelopes(str(shipped)) or {}) if shipped else {}
    blocks = stage_blocks(config.num_layers, config.attn_res_block_size, 3)
    wire = "bfloat16" if numerics == "bfloat16" else "float32"
    route = [RouteStage(Stage(device_model, LayerRange(a, b, config.num_layers)), wire) for a, b in blocks]
    plan = session_plan(random.Random(0), len(prompt), new_tokens)
    recorded = drive_session(route, prompt, plan, temperature=0.0, seed=1, session="gpu-check")
    # the validator's block reference on the same device (fp32, weights read from disk under a budget) rechecks the
    # same steps: its verdict and time beside the CPU reference's
    from inference.swarm.block_reference import BlockReference  # noqa: PLC0415

    lazy = BlockReference(checkpoint, 1 << 40, device=model_device(device_model))
    out = []
    for (a, b), steps in zip(blocks, recorded):
        t0 = time.perf_counter()
        c = recheck_opened(steps, reference_stage(reference, a, b), seed=7)
        cpu_s = time.perf_counter() - t0
        stats = CheckStats.of(c)
        kind = "head" if b == config.num_layers else "state"
        env = envelopes.get((numerics, kind))
        t0 = time.perf_counter()
        on_device = recheck_opened(steps, lazy[(a, b)], seed=7)
        _sync(model_device(device_model))
        out.append({"layers": [a, b - 1], "kind": kind, "exact_checks": "ok" if c.ok else c.reason,
                    "tokens": stats.tokens, "bad": stats.bad, "median": stats.median, "worst": stats.worst,
                    "judged_by": f"{numerics} {kind} envelope" if env else None,
                    "outside": (env.outside(stats) or "inside") if env else None, "recheck_cpu_s": cpu_s,
                    "device_block_reference": {"exact_checks": "ok" if on_device.ok else on_device.reason,
                                               "median": CheckStats.of(on_device).median,
                                               "seconds": time.perf_counter() - t0}})
    lazy.close()
    return out


def against_reference(checkpoint: Path, device: torch.device, dtype: str, *, prompt_tokens: int, new_tokens: int,
                      audits: int) -> dict:
    from inference.model import dtype_name, resolve_dtype  # noqa: PLC0415
    from inference.serving import load_reference_model  # noqa: PLC0415

    t0 = time.perf_counter()
    reference, _, _ = load_reference_model(checkpoint, "float32", device="cpu", verify=False)
    load_ref = time.perf_counter() - t0
    t0 = time.perf_counter()
    model, _, _ = load_reference_model(checkpoint, dtype, device=device, verify=False)
    load_dev = time.perf_counter() - t0
    numerics = dtype_name(resolve_dtype(dtype, device))
    precision = {"bfloat16": "bf16", "float16": "fp16"}.get(numerics, "fp32")
    vocab = reference.config.vocab_size
    prompt = _prompt(vocab, prompt_tokens, 0)
    out = {"numerics": numerics, "load_seconds": {"cpu_reference": load_ref, "device": load_dev}}
    t0 = time.perf_counter()
    want, got = greedy_tokens(reference, prompt, new_tokens), greedy_tokens(model, prompt, new_tokens)
    diverge = next((i for i, (a, b) in enumerate(zip(want, got)) if a != b), None)
    out["greedy"] = {"tokens": new_tokens, "equal": want == got, "first_difference": diverge,
                     "reference": want, "device": got, "seconds": time.perf_counter() - t0}
    t0 = time.perf_counter()
    prompts = [_prompt(vocab, prompt_tokens, s) for s in range(audits)]
    out["teacher_forced"] = teacher_forced(model, reference, checkpoint, prompts, new_tokens, precision)
    out["teacher_forced"]["seconds"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    out["stage_judge"] = stage_checks(model, reference, checkpoint, prompt, new_tokens, numerics)
    out["stage_judge_seconds"] = time.perf_counter() - t0
    del reference
    _release_memory()
    return out, model


# ---------------------------------------------------------------------------------------- 2. speed
def decode_speed(model, device, streams: int, prompt_tokens: int, steps: int) -> dict:
    """Tokens/s of `streams` sequences decoding together (one batched step per token) after their prompts."""
    vocab = model.config.vocab_size
    with torch.inference_mode():
        caches = [model.new_cache() for _ in range(streams)]
        logits = model.forward([torch.tensor(_prompt(vocab, prompt_tokens, s)) for s in range(streams)], caches)
        last = [torch.tensor([int(lg.argmax())]) for lg in logits]
        for _ in range(2):  # warm: kernels compiled and tuned, caches grown
            last = [torch.tensor([int(lg.argmax())]) for lg in model.forward(last, caches)]
        _sync(device)
        t0 = time.perf_counter()
        for _ in range(steps):
            last = [torch.tensor([int(lg.argmax())]) for lg in model.forward(last, caches)]
        _sync(device)
        elapsed = time.perf_counter() - t0
    return {"streams": streams, "steps": steps, "step_ms": 1000 * elapsed / steps,
            "tokens_per_s": streams * steps / elapsed}


def prefill_speed(model, device, tokens: int) -> dict:
    vocab = model.config.vocab_size
    ids = torch.tensor(_prompt(vocab, tokens, 3))

    def run():
        with torch.inference_mode():
            model.forward([ids], [model.new_cache()])

    seconds = _timed(run, device, repeats=1)
    return {"tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / seconds}


def speed(model, device, *, prefill_tokens: int, steps: int) -> dict:
    return {"decode_1": decode_speed(model, device, 1, 32, steps),
            "decode_16": decode_speed(model, device, 16, 32, max(2, steps // 2)),
            "prefill": prefill_speed(model, device, prefill_tokens)}


# ---------------------------------------------------------------------------------------- 3. KDA
def kda_kernels(device: torch.device, prefill_tokens: int, decode_batch: int = 16, heads: int = 96) -> dict:
    """Our chunked (prefill) and recurrent (decode) KDA against fla's chunk_kda and fused recurrent kernel on K3's
    KDA shapes: relative L2 distance of outputs and final states, and milliseconds of each."""
    from inference.model.kda import fla_kda, fla_usable, kda_chunked, kda_recurrent  # noqa: PLC0415

    def inputs(B, T, seed):
        g = torch.Generator().manual_seed(seed)
        q = torch.nn.functional.normalize(torch.randn(B, T, heads, 128, generator=g), dim=-1)
        k = torch.nn.functional.normalize(torch.randn(B, T, heads, 128, generator=g), dim=-1)
        v = torch.randn(B, T, heads, 128, generator=g)
        log_alpha = -5 * torch.sigmoid(torch.randn(B, T, heads, 128, generator=g))
        beta = torch.sigmoid(torch.randn(B, T, heads, generator=g))
        state = 0.1 * torch.randn(B, heads, 128, 128, generator=g)
        return [t.to(device) for t in (q, k, v, log_alpha, beta, state)]

    def rel(a, b) -> float:
        return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-12))

    out = {"heads": heads, "head_dim": 128}
    for name, (B, T), ours, chunked in (("prefill", (1, prefill_tokens), kda_chunked, True),
                                        ("decode", (decode_batch, 1), kda_recurrent, False)):
        q, k, v, g, beta, state = inputs(B, T, 1)
        with torch.inference_mode():
            o_ref, s_ref = ours(q, k, v, g, beta, initial_state=state)
            row = {"batch": B, "tokens": T,
                   "ours_ms": 1000 * _timed(lambda: ours(q, k, v, g, beta, initial_state=state), device)}
            if fla_usable(q, v):
                o, s = fla_kda(q, k, v, g, beta, initial_state=state, chunked=chunked)
                row.update(output_rel_l2=rel(o, o_ref), state_rel_l2=rel(s, s_ref), fla_ms=1000 * _timed(
                    lambda: fla_kda(q, k, v, g, beta, initial_state=state, chunked=chunked), device))
                row["speedup"] = row["ours_ms"] / row["fla_ms"]
            else:
                row["fla"] = "skipped: fla's Triton kernels need a CUDA device and fla-core installed"
        out[name] = row
    return out


# -------------------------------------------------------------------------------------- 4. the swarm
async def _route_tokens_per_s(engine, prompt: list[int], new_tokens: int, repeats: int) -> dict:
    from benchmarks.swarm import _measure  # noqa: PLC0415

    m = await _measure(engine, prompt, new_tokens, repeats)
    return {**m, "tokens_per_s": 1000.0 / m["median_ms"], "tokens_per_s_best": 1000.0 / m["min_ms"]}


async def swarm(checkpoint: Path, device: torch.device, dtype: str, work: Path, *, new_tokens: int,
                repeats: int) -> dict:
    """The single process (LocalEngine over the model on the device) and a route over three stage miner processes
    on the same device, each a third of the layers, single-stream greedy decode."""
    from benchmarks.swarm import start_delayed_route, stop_processes  # noqa: PLC0415
    from inference.model import load_tokenizer, read_config  # noqa: PLC0415
    from inference.serving import EngineSettings, LocalEngine, load_reference_model  # noqa: PLC0415

    config = read_config(checkpoint)
    tokenizer = load_tokenizer(checkpoint, config)
    prompt = _prompt(config.vocab_size, 32, 5)
    model, _, _ = load_reference_model(checkpoint, dtype, device=device, verify=False)
    async with LocalEngine(model, tokenizer, EngineSettings(max_context=1024, max_concurrent_sequences=1)) as local:
        single = await _route_tokens_per_s(local, prompt, new_tokens, repeats)
    del model, local
    _release_memory()
    args = SimpleNamespace(stages=3, threads=1, prefill_chunk=32, device=str(device), dtype=dtype)
    t0 = time.perf_counter()
    ranges, links, procs, engine = await start_delayed_route(checkpoint, config, tokenizer, work, args)
    started = time.perf_counter() - t0
    try:
        async with engine:
            route = await _route_tokens_per_s(engine, prompt, new_tokens, repeats)
    finally:
        stop_processes(procs)
        for link in links:
            await link.close()
    return {"stages": ranges, "stage_processes_started_s": started, "single_process": single, "swarm": route,
            "swarm_over_single": route["tokens_per_s"] / single["tokens_per_s"]}


# ------------------------------------------------------------------------------------- 5. the roofline
def weight_bytes_per_decode_step(model) -> dict:
    """Bytes of weights one single-stream decode step reads: every tensor but the embedding table and the routed
    experts, one embedding row, and per MoE layer the k experts the token picks (their MXFP4 bytes)."""
    from inference.model import tensor_site  # noqa: PLC0415

    config = model.config
    dense = experts = 0
    for key, t in model.state_dict().items():
        site = tensor_site(key)
        nbytes = t.numel() * t.element_size()
        if site.kind == "embedding":
            dense += nbytes // config.vocab_size
        elif site.kind == "expert":
            experts += nbytes * config.experts_per_token // config.num_experts
        else:
            dense += nbytes
    return {"dense": dense, "experts": experts, "total": dense + experts}


def roofline(model, step_s: float, machine_info: dict) -> dict:
    read = weight_bytes_per_decode_step(model)
    achieved = read["total"] / step_s
    out = {"weight_bytes_per_step": read, "step_ms": 1000 * step_s, "achieved_bytes_per_s": achieved}
    for source in ("datasheet", "measured"):
        bandwidth = machine_info.get(f"bandwidth_{source}")
        if bandwidth:
            out[f"fraction_of_{source}_bandwidth"] = achieved / bandwidth
            out[f"roofline_step_ms_{source}"] = 1000 * read["total"] / bandwidth
    return out


# ------------------------------------------------------------------------------------------- the run
def _step(results: dict, name: str, out_path: Path, fn) -> object:
    """Run one step into results[name] (its seconds, or its error), then write the JSON so far."""
    t0 = time.perf_counter()
    value = None
    try:
        value = fn()
        if isinstance(value, tuple):
            results[name], value = value
        else:
            results[name] = value
    except Exception as error:  # noqa: BLE001 (a failing step is recorded; the others still run)
        results[name] = {"error": f"{type(error).__name__}: {error}", "traceback": traceback.format_exc()[-4000:]}
    results.setdefault(name, {})
    if isinstance(results[name], dict):
        results[name]["seconds"] = time.perf_counter() - t0
    out_path.write_text(json.dumps(results, indent=1, default=str) + "\n")
    print(f"gpu_check: {name} done in {time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)
    return value


def run(args) -> dict:
    from inference.model import read_config, resolve_device  # noqa: PLC0415

    device = resolve_device(args.device)
    work = Path(args.work).expanduser() if args.work else Path(tempfile.mkdtemp(prefix="k3-gpu-check-"))
    out_path = Path(args.out)
    started = time.perf_counter()
    results: dict = {"command": "python -m benchmarks.gpu_check " + " ".join(args.argv), "dtype": args.dtype,
                     "machine": machine(device)}
    scaled_config = scaled_k3_config(int(args.scaled_gb * 1e9), layers=args.scaled_layers)
    scaled_dir, writer = (None, None)
    t_write = time.time()
    if "scaled" not in args.skip or "swarm" not in args.skip:  # written meanwhile the tiny model is checked
        scaled_dir, writer = start_scaled_checkpoint(scaled_config, work)
    sizes = dict(prompt_tokens=args.prompt_tokens, new_tokens=args.new_tokens)

    def model_step(checkpoint: Path, with_roofline: bool):
        report, model = against_reference(checkpoint, device, args.dtype, audits=args.audits, **sizes)
        report["config"] = read_config(checkpoint).summary()
        report["speed"] = speed(model, device, prefill_tokens=args.prefill_tokens, steps=args.decode_steps)
        if with_roofline:
            report["roofline"] = roofline(model, report["speed"]["decode_1"]["step_ms"] / 1000, results["machine"])
        del model
        _release_memory()
        return report

    if "tiny" not in args.skip:
        _step(results, "tiny", out_path, lambda: model_step(TINY_TRAINED, False))
    if "kda" not in args.skip:
        _step(results, "kda", out_path, lambda: kda_kernels(device, args.kda_tokens))
    if scaled_dir is not None:
        def wait_for_checkpoint():
            if writer is not None and writer.wait() != 0:
                raise RuntimeError(f"k3-checkpoint failed: {(work / 'make_checkpoint.log').read_text()[-2000:]}")
            # k3_manifest.json is the last file k3-checkpoint writes
            written = (scaled_dir / "k3_manifest.json").stat().st_mtime - t_write if writer is not None else 0.0
            return {"path": str(scaled_dir), "bytes": scaled_config.checkpoint_bytes(), "written_in_s": written,
                    "reused": writer is None}
        _step(results, "scaled_checkpoint", out_path, wait_for_checkpoint)
    if "scaled" not in args.skip and "error" not in results.get("scaled_checkpoint", {}):
        _step(results, "scaled", out_path, lambda: model_step(scaled_dir, True))
    if "swarm" not in args.skip and "error" not in results.get("scaled_checkpoint", {}):
        _step(results, "swarm", out_path, lambda: asyncio.run(swarm(
            scaled_dir, device, args.dtype, work, new_tokens=args.new_tokens, repeats=args.swarm_repeats)))
    for name in args.skip:
        results[name] = {"skipped": "--skip " + name}
    results["seconds"] = time.perf_counter() - started
    out_path.write_text(json.dumps(results, indent=1, default=str) + "\n")
    return results


def summary(results: dict) -> list[str]:
    lines = [f"# gpu_check on {results['machine'].get('name')} ({results['machine']['device']}), "
             f"{results['dtype']}, {results['seconds']:.0f} s"]
    for name in ("tiny", "scaled"):
        r = results.get(name, {})
        if "error" in r or "skipped" in r or not r:
            lines.append(f"{name}: {r.get('error') or r.get('skipped') or 'not run'}")
            continue
        s, tf = r["speed"], r["teacher_forced"]
        blocks = [b["outside"] or f"exact checks {b['exact_checks']}, no envelope" for b in r["stage_judge"]]
        lines.append(f"{name}: greedy equal {r['greedy']['equal']} (first difference {r['greedy']['first_difference']});"
                     f" {tf['failed']}/{tf['audits']} audits failed, max |dlogprob| {tf['max_abs_logprob_diff']:.3g};"
                     f" stage blocks {blocks}; the block reference on the device: "
                     f"{[b['device_block_reference']['exact_checks'] for b in r['stage_judge']]}")
        lines.append(f"  decode 1 stream {s['decode_1']['tokens_per_s']:.1f} tok/s, 16 streams "
                     f"{s['decode_16']['tokens_per_s']:.1f} tok/s, prefill {s['prefill']['tokens']} tokens "
                     f"{s['prefill']['tokens_per_s']:.0f} tok/s")
        if "roofline" in r:
            roof = r["roofline"]
            lines.append(f"  roofline: {roof['weight_bytes_per_step']['total'] / 1e9:.2f} GB per step in "
                         f"{roof['step_ms']:.1f} ms: {roof.get('fraction_of_datasheet_bandwidth', float('nan')):.0%} "
                         f"of the data sheet, {roof.get('fraction_of_measured_bandwidth', float('nan')):.0%} of "
                         "the measured copy bandwidth")
    kda = results.get("kda", {})
    for name in ("prefill", "decode"):
        if name in kda:
            row = kda[name]
            lines.append(f"kda {name}: ours {row['ours_ms']:.2f} ms" + (
                f", fla {row['fla_ms']:.2f} ms, rel L2 {row['output_rel_l2']:.2e}" if "fla_ms" in row else
                f", {row.get('fla')}"))
    sw = results.get("swarm", {})
    if "swarm_over_single" in sw:
        lines.append(f"swarm: 3 stages {sw['swarm']['tokens_per_s']:.1f} tok/s, single process "
                     f"{sw['single_process']['tokens_per_s']:.1f} tok/s")
    elif sw:
        lines.append(f"swarm: {sw.get('error') or sw.get('skipped')}")
    return lines


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    ap = argparse.ArgumentParser(prog="python -m benchmarks.gpu_check", description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda", help="cuda, cuda:N, or cpu for the dry run (default: cuda)")
    ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32", "auto"),
                    help="the device models' weights dtype (the reference is always fp32 on the CPU)")
    ap.add_argument("--out", default="gpu_check.json", help="the JSON file (rewritten after every step)")
    ap.add_argument("--work", help="where the scaled checkpoint and the stage miners' files go (kept: a rerun with "
                                   "the same --work reuses the checkpoint); default: a new temporary directory")
    ap.add_argument("--scaled-gb", type=float, default=None,
                    help="checkpoint size of the scaled K3 (default: 20 on a GPU, 0.2 with --device cpu)")
    ap.add_argument("--scaled-layers", type=int, default=12, help="layers of the scaled K3 (more are added in fours "
                                                                   "when K3's widths need them to reach --scaled-gb)")
    ap.add_argument("--prompt-tokens", type=int, default=24)
    ap.add_argument("--new-tokens", type=int, default=None, help="greedy tokens compared, answers' length (default: "
                                                                 "16 on a GPU, 8 on the CPU)")
    ap.add_argument("--audits", type=int, default=None, help="answers teacher-forced per model (default: 4 on a GPU, "
                                                             "2 on the CPU)")
    ap.add_argument("--decode-steps", type=int, default=None, help="timed decode steps (default: 32 on a GPU, 4 "
                                                                   "on the CPU)")
    ap.add_argument("--prefill-tokens", type=int, default=None, help="prefill timed (default: 8192 on a GPU, 256 "
                                                                     "on the CPU)")
    ap.add_argument("--kda-tokens", type=int, default=None, help="prefill length of the KDA kernel comparison "
                                                                 "(default: 8192 on a GPU, 256 on the CPU)")
    ap.add_argument("--swarm-repeats", type=int, default=2)
    ap.add_argument("--skip", action="append", default=[], choices=STEPS, help="leave out a step (repeatable)")
    args = ap.parse_args(argv)
    args.argv = argv
    gpu = args.device != "cpu"
    args.scaled_gb = args.scaled_gb if args.scaled_gb is not None else (20.0 if gpu else 0.2)
    args.new_tokens = args.new_tokens or (16 if gpu else 8)
    args.audits = args.audits or (4 if gpu else 2)
    args.decode_steps = args.decode_steps or (32 if gpu else 4)
    args.prefill_tokens = args.prefill_tokens or (8192 if gpu else 256)
    args.kda_tokens = args.kda_tokens or (8192 if gpu else 256)
    from inference.model import device_problem  # noqa: PLC0415
    if device_problem(args.device):
        ap.error(device_problem(args.device))
    results = run(args)
    print("\n".join(summary(results)))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
