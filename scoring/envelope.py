"""The honest-numerics envelope: what the tier-1 statistics look like when an honest miner serves the
released weights with other numerics, and when a cheater does not.

An honest miner may run the model in bf16 or fp16, with other kernels (another summation order), other
thread counts, batched with other sequences, with the prompt prefilled in other chunks, or split over
processes. Each variant generates answers that the fp32 reference then teacher-forces, exactly like a
tier-1 audit on the validator's own engine; `scoring.tier1.audit_statistics` measures them and
`judge_statistics` (the rules) and `legacy_failures` (the rules before this envelope) judge them. The
same is done for cheaters (another model, a truncated context, perturbed experts, fewer experts per
token, a swap on long prompts only) to measure the detection rate.

Every sampled answer is also replayed (scoring/replay.py): the reference's logits and the answer's seed give the
token the sampler k3-gumbel/1 picks at each index, and the gap by which the variant's token trails it. The honest
variants' gaps give each precision its near-tie allowance and honest rate (`replay_section`, the envelope
file's "replay"); the cheaters here and the sampling cheaters (greedy answers, a lowered temperature, a fixed
seed) show what the replay catches.

    report = measure_envelope(checkpoint, audits_per_variant=200)
    print(format_report(report))

`benchmarks/verification.py` is the command-line wrapper.
"""
from __future__ import annotations

import contextlib
import copy
import dataclasses
import math
import random
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator, Optional, Sequence

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from inference.decoding.sampling import SamplingParams, TokenSampler
from inference.model import KimiK3Model, ModelConfig, load_checkpoint, load_tokenizer, read_config, resolve_device
from inference.model.fp8 import quantize_dense

from .config import ScoringConfig
from .failures import Failure
from .model_envelope import MARGIN, build_envelope, build_replay
from .replay import ReplayStatistics, judge_replay, replay_rows, replay_rule
from .tier1 import AuditStatistics, audit_statistics, judge_statistics

REFERENCE_TOP_K = 20
MINER_LOGPROBS = 5
CHEATER_SHARE = 0.3  # cheaters run this share of the audits per variant (they are caught within a few)


# ------------------------------------------------------------------ models
def load_model(checkpoint: str | Path, dtype: torch.dtype = torch.float32,
               config: Optional[ModelConfig] = None, device: str = "cpu") -> KimiK3Model:
    """The checkpoint's model in `dtype` (optionally under a changed config of the same shapes), on `device`."""
    model = KimiK3Model(read_config(checkpoint), dtype=dtype, random_init=False).eval()
    load_checkpoint(model, checkpoint, verify=False, progress=False)
    model.to(resolve_device(device))
    if config is not None:  # e.g. fewer experts per token: every module reads the shared config at run time
        for module in model.modules():
            if hasattr(module, "config"):
                module.config = config
        model.config = config
    model.set_dequantize_cache(True)
    return model


def perturb_experts(model, relative_noise: float, seed: int = 0) -> None:
    """Re-quantise every routed expert of `model` in place with noise of `relative_noise` times the
    weight's RMS (the fingerprint, computed from the files, stays what the manifest says)."""
    from inference.model import mxfp4  # noqa: PLC0415

    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for layer in model.layers:
            if not layer.is_moe:
                continue
            moe = layer.block_sparse_moe
            for expert in moe.experts:
                for lin in (expert.w1, expert.w2, expert.w3):
                    if not hasattr(lin, "weight_packed"):  # dense experts (no MXFP4)
                        lin.weight.add_(relative_noise * lin.weight.float().pow(2).mean().sqrt()
                                        * torch.randn(lin.weight.shape, generator=gen).to(lin.weight.dtype))
                        continue
                    w = lin.dequantized_weight()
                    packed, scale = mxfp4.quantize(w + relative_noise * w.pow(2).mean().sqrt()
                                                   * torch.randn(w.shape, generator=gen))
                    lin.weight_packed.copy_(packed)
                    lin.weight_scale.copy_(scale)
            moe.set_dequantize_cache(moe.dequantize_cache)  # drop decoded copies of the old weights


def coarsen_experts(model, bits: int) -> None:
    """Round every routed expert weight of `model` in place to a `bits`-bit integer grid per output channel (2:
    -1, 0, 1 times the channel's scale), kept in the checkpoint's MXFP4 form: a cheaper expert set than the
    real one, under the same fingerprint."""
    from inference.model import mxfp4  # noqa: PLC0415

    top = 2 ** (bits - 1) - 1
    with torch.no_grad():
        for layer in model.layers:
            if not layer.is_moe:
                continue
            moe = layer.block_sparse_moe
            for expert in moe.experts:
                for lin in (expert.w1, expert.w2, expert.w3):
                    w = lin.dequantized_weight() if hasattr(lin, "weight_packed") else lin.weight.float()
                    scale = w.abs().amax(dim=1, keepdim=True).clamp_min(1e-12) / top
                    coarse = (w / scale).round().clamp(-top, top) * scale
                    if hasattr(lin, "weight_packed"):
                        packed, block_scale = mxfp4.quantize(coarse)
                        lin.weight_packed.copy_(packed)
                        lin.weight_scale.copy_(block_scale)
                    else:
                        lin.weight.copy_(coarse.to(lin.weight.dtype))
            moe.set_dequantize_cache(moe.dequantize_cache)  # drop decoded copies of the old weights


def perturbed_experts(model: KimiK3Model, relative_noise: float, seed: int = 0) -> KimiK3Model:
    """A copy whose routed experts are re-quantised with noise (`perturb_experts`), served under the
    original fingerprint: a cheaper or damaged expert set claimed unchanged."""
    other = copy.deepcopy(model)
    perturb_experts(other, relative_noise, seed)
    other.set_dequantize_cache(True)
    return other


# ------------------------------------------------------------------ GPU-kernel emulation
def _split_k_matmul(x: torch.Tensor, w_t: torch.Tensor, parts: int) -> torch.Tensor:
    """x @ w_t with the inner dimension summed in `parts` partial products, added last to first
    (a split-K GPU kernel's order) in fp32."""
    K = x.shape[-1]
    step = max(1, math.ceil(K / parts))
    partials = [torch.matmul(x[..., i:i + step].float(), w_t[..., i:i + step, :].float()) for i in range(0, K, step)]
    out = partials[-1]
    for p in reversed(partials[:-1]):
        out = out + p
    return out.to(x.dtype)


class ReorderedSummation(TorchFunctionMode):
    """Every linear layer and matmul sums its inner dimension in another order (split-K), like GPU
    kernels do; used with `reordered_attn_res` for the AttnRes softmax."""

    def __init__(self, parts: int = 4):
        super().__init__()
        self.parts = parts

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.linear and args[0].shape[-1] >= 2 * self.parts:
            x, w = args[0], args[1]
            bias = args[2] if len(args) > 2 else kwargs.get("bias")
            out = _split_k_matmul(x, w.t(), self.parts)
            return out if bias is None else out + bias
        if func in (torch.matmul, torch.Tensor.__matmul__, torch.bmm) and args[0].dim() >= 2 \
                and args[1].dim() >= 2 and args[0].shape[-1] >= 2 * self.parts:
            return _split_k_matmul(args[0], args[1], self.parts)
        return func(*args, **kwargs)


def reordered_attn_res(partial, blocks, proj_w, norm_w, eps):
    """Attention Residuals with the sources taken in reverse order and the logits summed in halves."""
    from inference.model.layers import rms_normalize  # noqa: PLC0415
    sources = [partial.float()] + [b.float() for b in reversed(blocks)]
    v = torch.stack(sources)
    k = rms_normalize(v, eps)
    query = norm_w.float() * proj_w.float().reshape(-1)
    half = query.shape[0] // 2
    logits = (k[..., half:] * query[half:]).sum(-1) + (k[..., :half] * query[:half]).sum(-1)
    p = torch.softmax(logits - logits.max(0, keepdim=True).values, dim=0)
    out = torch.zeros_like(v[0])
    for i in reversed(range(v.shape[0])):
        out = out + p[i].unsqueeze(-1) * v[i]
    return out


@contextlib.contextmanager
def gpu_kernel_emulation(parts: int = 4) -> Iterator[None]:
    import inference.model.k3 as k3  # noqa: PLC0415
    original = k3.attn_res
    k3.attn_res = reordered_attn_res
    try:
        with ReorderedSummation(parts):
            yield
    finally:
        k3.attn_res = original


@contextlib.contextmanager
def recurrent_prefill() -> Iterator[None]:
    """Every KDA prefill through the token-by-token recurrence instead of the chunked kernel."""
    import inference.model.kda as kda  # noqa: PLC0415
    original = kda.CHUNKED_MIN_TOKENS
    kda.CHUNKED_MIN_TOKENS = 1 << 30
    try:
        yield
    finally:
        kda.CHUNKED_MIN_TOKENS = original


@contextlib.contextmanager
def threads(n: int) -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


# ------------------------------------------------------------------ generation and scoring
@dataclass
class Answer:
    prompt: list[int]
    tokens: list[int]
    logprobs: list[float]  # the miner's raw logprobs of its tokens
    temperature: float
    long: bool = False
    seed: int = 0  # the sampler's seed (k3-gumbel/1): with the reference's logits it replays the answer


@dataclass
class Score:
    position: int
    token_id: int
    logprob: float
    top: list[tuple[int, float]]


def generate(model, prompts: Sequence[Sequence[int]], temperatures: Sequence[float], max_tokens: int,
             seeds: Sequence[int], stop_ids: frozenset, *, batched: bool = True,
             prefill_chunk: Optional[int] = None, free_cache: Optional[Callable] = None) -> list[Answer]:
    """Honest generation: prefill (whole or in chunks; all prompts in one forward when `batched`),
    then decode all sequences in one batch (`batched`) or one by one. Raw logprobs as reported."""
    with torch.inference_mode():
        groups = [list(range(len(prompts)))] if batched else [[i] for i in range(len(prompts))]
        answers: list[Optional[Answer]] = [None] * len(prompts)
        for group in groups:
            caches = [model.new_cache() for _ in group]
            samplers = [TokenSampler(SamplingParams(max_tokens=max_tokens, temperature=temperatures[i],
                                                    seed=seeds[i], logprobs=MINER_LOGPROBS)) for i in group]
            last = [None] * len(group)
            step = prefill_chunk or max(len(prompts[i]) for i in group)
            offset = 0
            while any(offset < len(prompts[i]) for i in group):
                rows = [r for r, i in enumerate(group) if offset < len(prompts[i])]
                chunks = [torch.tensor(prompts[group[r]][offset:offset + step]) for r in rows]
                logits = model.forward(chunks, [caches[r] for r in rows])
                for r, lg in zip(rows, logits):
                    last[r] = lg
                offset += step
            out_tokens = [[] for _ in group]
            out_lps = [[] for _ in group]
            active = list(range(len(group)))
            while active:
                nxt = []
                for r in active:
                    chosen = samplers[r].choose(last[r], len(out_tokens[r]))
                    out_tokens[r].append(chosen.token_id)
                    out_lps[r].append(chosen.logprob)
                    if chosen.token_id not in stop_ids and len(out_tokens[r]) < max_tokens:
                        nxt.append(r)
                active = nxt
                if active:
                    logits = model.forward([torch.tensor([out_tokens[r][-1]]) for r in active],
                                           [caches[r] for r in active])
                    for r, lg in zip(active, logits):
                        last[r] = lg
            for r, i in enumerate(group):
                answers[i] = Answer(list(prompts[i]), out_tokens[r], out_lps[r], temperatures[i], seed=seeds[i])
            if free_cache is not None:
                for c in caches:
                    free_cache(c)
    return answers  # type: ignore[return-value]


def reference_rows(model: KimiK3Model, answers: Sequence[Answer], batch: int = 8) -> list[torch.Tensor]:
    """The fp32 reference teacher-forcing prompt + answer: per answer the logits rows [len(tokens), V] that
    predict its output tokens."""
    out = []
    with torch.inference_mode():
        for start in range(0, len(answers), batch):
            group = answers[start:start + batch]
            seqs = [torch.tensor(a.prompt + a.tokens) for a in group]
            logits = model.forward(seqs, [model.new_cache() for _ in group], all_logits=True)
            out += [lg[len(a.prompt) - 1: -1].float() for a, lg in zip(group, logits)]
    return out


def scores_of(answer: Answer, rows: torch.Tensor) -> list[Score]:
    """Per output token its reference logprob and top-20, from the reference's rows."""
    lps = torch.log_softmax(rows, dim=-1)
    vals, ids = torch.topk(lps, REFERENCE_TOP_K, dim=-1)
    return [Score(len(answer.prompt) + j, t, float(lps[j, t]), list(zip(ids[j].tolist(), vals[j].tolist())))
            for j, t in enumerate(answer.tokens)]


def reference_scores(model: KimiK3Model, answers: Sequence[Answer], batch: int = 8) -> list[list[Score]]:
    """The fp32 reference teacher-forcing prompt + answer: per output token its logprob and top-20."""
    return [scores_of(a, rows) for a, rows in zip(answers, reference_rows(model, answers, batch))]


def replay_answer(answer: Answer, rows: torch.Tensor) -> Optional[ReplayStatistics]:
    """A sampled answer replayed from the reference's rows (None for a greedy one)."""
    if answer.temperature <= 0 or not answer.tokens:
        return None
    return replay_rows(rows, answer.tokens, SamplingParams(temperature=answer.temperature), answer.seed)


# ------------------------------------------------------------------ the rules before the envelope
def legacy_failures(stats: AuditStatistics, config: ScoringConfig) -> list[Failure]:
    """The tier-1 rules as they were before the envelope (docs/subnet.md section 4 and the project's
    greedy-mismatch count), on a trusted reference."""
    failures = []
    greedy = stats.greedy
    if stats.min_reference_logprob <= config.reference_logprob_floor:
        failures.append(Failure("reference_logprob_floor", "", greedy))
    allowance = 0.0
    if config.outside_top_k_sampling_sigmas is not None:
        e = stats.outside_expected if not greedy else 0.0
        allowance = e + config.outside_top_k_sampling_sigmas * math.sqrt(e)
    if stats.outside_top_k > config.max_outside_top_k + allowance:
        failures.append(Failure("outside_top_k", "", greedy))
    if stats.gaps_over(config.near_tie_margin) > config.max_greedy_mismatches:
        failures.append(Failure("greedy_mismatch", "", greedy))
    if stats.eos_ratio_count:
        failures.append(Failure("eos_avoided", "", greedy))
    return failures


# ------------------------------------------------------------------ variants and cheaters
@dataclass
class Variant:
    name: str
    description: str
    honest: bool
    run: Callable[[list, list, list, int], list[Answer]]  # (prompts, temperatures, seeds, max_tokens) -> answers
    share: float = 1.0  # of the audits per variant (slow variants run fewer)
    precision: str = "fp32"  # what the miner declares (Capabilities.precision): picks the envelope it is judged by
    # a context manager giving the run function for the whole variant (started once: shard processes)
    session: Optional[Callable[[], contextlib.AbstractContextManager]] = None

    def open(self) -> contextlib.AbstractContextManager:
        return self.session() if self.session is not None else contextlib.nullcontext(self.run)

    def exact(self, config: ScoringConfig) -> bool:
        return self.precision in config.exact_precisions


@dataclass
class VariantResult:
    variant: Variant
    statistics: list[AuditStatistics] = field(default_factory=list)
    answers: list[Answer] = field(default_factory=list)
    new_failures: list[list[Failure]] = field(default_factory=list)
    old_failures: list[list[Failure]] = field(default_factory=list)
    seconds: float = 0.0
    replays: list[Optional[ReplayStatistics]] = field(default_factory=list)  # per answer (None: greedy)
    replay_failures: list[list[Failure]] = field(default_factory=list)  # per answer, judged by the config's rule

    def rate(self, which: str, hard: Optional[bool] = None, long_only: bool = False) -> float:
        rows = getattr(self, which)
        picked = [f for f, a in zip(rows, self.answers) if a.long or not long_only]
        if not picked:
            return 0.0
        if hard is None:
            return sum(1 for f in picked if f) / len(picked)
        return sum(1 for f in picked if any(x.hard == hard for x in f)
                   and (hard or not any(x.hard for x in f))) / len(picked)


def prompt_texts(rng: random.Random, count: int, lengths: tuple[int, int], long_share: float,
                 long_length: int) -> list[tuple[str, bool]]:
    """Text prompts from the procedural corpus: `long_share` of them about `long_length` bytes."""
    from .corpus import paragraphs  # noqa: PLC0415
    out = []
    for _ in range(count):
        long = rng.random() < long_share
        size = long_length if long else rng.randint(*lengths)
        text = ""
        while len(text) < size:
            text += "\n".join(paragraphs(rng, max(size, 64))) + "\n"
        out.append((text[:size], long))
    return out


def _plain(model):
    def run(prompts, temps, seeds, max_tokens, stop_ids, **kw):
        return generate(model, prompts, temps, max_tokens, seeds, stop_ids, **kw)
    return run


class LogitsToHost:
    """A model on a GPU behind the surface `generate` uses: its logits come back to the host, where the samplers
    (each with its CPU generator) and the statistics run, as in a miner's engine."""

    def __init__(self, model: KimiK3Model):
        self.model, self.config = model, model.config

    def new_cache(self):
        return self.model.new_cache()

    def forward(self, token_ids, caches, all_logits: bool = False):
        return [t.cpu() for t in self.model.forward(token_ids, caches, all_logits=all_logits)]


def device_variants(checkpoint: str | Path, device: str) -> list[Variant]:
    """The honest miner on a GPU (`device`): the checkpoint there in fp32 and in bf16 (what `--device cuda` serves
    by default), so that the envelope includes the GPU's kernels (other reductions, fla's KDA, batched experts)."""
    return [Variant(f"fp32-{device}", f"fp32 on {device}, batched", True,
                    _plain(LogitsToHost(load_model(checkpoint, device=device)))),
            Variant(f"bf16-{device}", f"bf16 on {device}, batched", True,
                    _plain(LogitsToHost(load_model(checkpoint, torch.bfloat16, device=device))), precision="bf16")]


FP8_VARIANT = "fp8-dense"


def fp8_dense_variant(checkpoint: str | Path) -> Variant:
    """The honest fp8-dense miner: the checkpoint in fp32 activations with its dense weights in e4m3."""
    model = load_model(checkpoint)
    quantize_dense(model)
    return Variant(FP8_VARIANT, "fp8 e4m3 dense weights (per-channel scales), fp32 activations, batched", True,
                   _plain(model), precision="fp8")


def build_variants(checkpoint: str | Path, reference: KimiK3Model, *, sharded: bool = True,
                   other_checkpoint: Optional[str | Path] = None, seed: int = 0,
                   long_threshold: int = 512, device: str = "cpu") -> list[Variant]:
    """The honest variants and the cheaters, for one checkpoint (its fp32 model is the reference); with a GPU
    `device` also the honest miner on it (`device_variants`)."""
    config = reference.config
    ref_run = _plain(reference)
    bf16 = load_model(checkpoint, torch.bfloat16)
    fp16 = load_model(checkpoint, torch.float16)
    if other_checkpoint is not None:
        other = load_model(other_checkpoint)
    else:
        other = KimiK3Model(config, seed=seed + 1000).eval()
        other.set_dequantize_cache(True)
    fewer = load_model(checkpoint, config=dataclasses.replace(config, experts_per_token=max(1, config.experts_per_token // 2)))
    noisy = perturbed_experts(reference, 0.5, seed)

    def with_context(ctx_factory, run):
        def wrapped(*a, **kw):
            with ctx_factory():
                return run(*a, **kw)
        return wrapped

    def kw(run, **fixed):
        return lambda *a, **k: run(*a, **{**k, **fixed})

    def truncating(run):
        def wrapped(prompts, temps, seeds, max_tokens, stop_ids, **k):
            answers = run([p[-64:] for p in prompts], temps, seeds, max_tokens, stop_ids, **k)
            for a, p in zip(answers, prompts):
                a.prompt = list(p)
            return answers
        return wrapped

    truncated = truncating(ref_run)

    def long_swap(prompts, temps, seeds, max_tokens, stop_ids, **k):
        short = [i for i, p in enumerate(prompts) if len(p) < long_threshold]
        longs = [i for i, p in enumerate(prompts) if len(p) >= long_threshold]
        out: list = [None] * len(prompts)
        for idx, model in ((short, reference), (longs, other)):
            if idx:
                got = generate(model, [prompts[i] for i in idx], [temps[i] for i in idx], max_tokens,
                               [seeds[i] for i in idx], stop_ids, **k)
                for i, a in zip(idx, got):
                    out[i] = a
        return out

    def relabel(run, source):
        """Tokens from `source`, logprobs recomputed on the real model (a cheater that scores its cheap
        answer with the real model in one prefill pass)."""
        def wrapped(prompts, temps, seeds, max_tokens, stop_ids, **k):
            answers = source(prompts, temps, seeds, max_tokens, stop_ids, **k)
            for a, s in zip(answers, reference_scores(reference, answers)):
                a.logprobs = [x.logprob for x in s]
            return answers
        return wrapped

    variants = [
        Variant("fp32-batched", "fp32, decoded batched with other sequences", True, ref_run),
        Variant("fp32-alone", "fp32, each sequence alone", True, kw(ref_run, batched=False)),
        Variant("fp32-threads-2", "fp32, two threads (the reference runs on one)", True,
                with_context(lambda: threads(2), ref_run)),
        Variant("fp32-chunk-16", "fp32, prompt prefilled in chunks of 16", True, kw(ref_run, prefill_chunk=16)),
        Variant("fp32-chunk-128", "fp32, prompt prefilled in chunks of 128", True, kw(ref_run, prefill_chunk=128)),
        Variant("fp32-recurrent", "fp32, KDA prefill by the recurrence, not the chunked kernel", True,
                with_context(recurrent_prefill, ref_run)),
        Variant("fp32-gpu-kernels", "fp32, split-K matmuls and reordered AttnRes softmax", True,
                with_context(gpu_kernel_emulation, ref_run)),
        Variant("bf16", "bf16 weights and activations, batched", True, _plain(bf16), precision="bf16"),
        Variant("bf16-gpu-kernels", "bf16, split-K matmuls, reordered AttnRes", True,
                with_context(gpu_kernel_emulation, _plain(bf16)), precision="bf16"),
        Variant("bf16-chunk-64", "bf16, prompt prefilled in chunks of 64", True, kw(_plain(bf16), prefill_chunk=64),
                precision="bf16"),
        Variant("fp16", "fp16 weights and activations, batched", True, _plain(fp16), precision="fp16"),
        fp8_dense_variant(checkpoint),
    ]
    if device != "cpu":
        variants += device_variants(checkpoint, device)
    if sharded:
        variants += [
            Variant("sharded-pipeline", "fp32 over 2 pipeline shard processes", True, None,
                    session=_sharded_session(checkpoint, "pipeline")),
            Variant("sharded-expert", "fp32 over 2 expert-parallel shard processes", True, None,
                    session=_sharded_session(checkpoint, "expert")),
            Variant("sharded-expert-bf16", "bf16 over 2 expert-parallel shard processes", True, None,
                    session=_sharded_session(checkpoint, "expert", "bfloat16"), precision="bf16"),
        ]
    variants += [
        Variant("cheat-other-weights", "another model's weights under the real fingerprint", False, _plain(other),
                CHEATER_SHARE),
        Variant("cheat-other-weights-relabelled", "another model's tokens, logprobs rescored on the real model",
                False, relabel(None, _plain(other)), CHEATER_SHARE),
        Variant("cheat-truncated-context", "the real model on the last 64 prompt tokens only", False, truncated, CHEATER_SHARE),
        Variant("cheat-perturbed-experts", "experts re-quantised with 50% noise, fingerprint claimed unchanged",
                False, _plain(noisy), CHEATER_SHARE),
        Variant("cheat-half-experts", f"{max(1, config.experts_per_token // 2)} of {config.experts_per_token} "
                                      "routed experts per token", False, _plain(fewer), CHEATER_SHARE),
        Variant("cheat-long-swap", f"real model under {long_threshold} prompt tokens, another model above", False,
                long_swap, CHEATER_SHARE),
        Variant("cheat-bf16-half-experts", "bf16 and half the experts (cheaper than honest bf16)", False,
                _plain(load_model(checkpoint, torch.bfloat16, config=dataclasses.replace(
                    config, experts_per_token=max(1, config.experts_per_token // 2)))), CHEATER_SHARE,
                precision="bf16"),
        Variant("cheat-bf16-truncated-context", "bf16 on the last 64 prompt tokens only, declares bf16", False,
                truncating(_plain(bf16)), CHEATER_SHARE, precision="bf16"),
    ]
    return variants + sampling_cheaters(ref_run, bf16, checkpoint)


def sampling_cheaters(ref_run, bf16: KimiK3Model, checkpoint: str | Path) -> list[Variant]:
    """Miners that run the real model but not the sampler asked for: each reports the request's temperature and
    seed (the replay of sampled answers catches them; the statistical tests hardly do)."""
    def reported(run, temps_of=None, seeds_of=None):
        def wrapped(prompts, temps, seeds, max_tokens, stop_ids, **k):
            answers = run(prompts, temps_of(temps) if temps_of else temps, seeds_of(seeds) if seeds_of else seeds,
                          max_tokens, stop_ids, **k)
            for a, t, seed in zip(answers, temps, seeds):
                a.temperature, a.seed = t, seed
            return answers
        return wrapped

    coarse = load_model(checkpoint, torch.bfloat16)
    coarsen_experts(coarse, 2)
    return [
        Variant("cheat-greedy-for-sampled", "greedy answers whatever the temperature asked", False,
                reported(ref_run, temps_of=lambda temps: [0.0] * len(temps)), CHEATER_SHARE),
        Variant("cheat-cooler", "samples at half the temperature asked", False,
                reported(ref_run, temps_of=lambda temps: [t / 2 for t in temps]), CHEATER_SHARE),
        Variant("cheat-fixed-seed", "samples with seed 0 whatever the seed asked (cacheable answers)", False,
                reported(ref_run, seeds_of=lambda seeds: [0] * len(seeds)), CHEATER_SHARE),
        Variant("cheat-bf16-2bit-experts", "declares bf16, experts rounded to 2 bits per weight", False,
                _plain(coarse), CHEATER_SHARE, precision="bf16"),
    ]


def _sharded_session(checkpoint, mode: str, dtype: str = "float32"):
    """The shard processes started once per variant; the run function generates through them."""
    @contextlib.contextmanager
    def session():
        from inference.sharding import ShardedModel  # noqa: PLC0415
        with ShardedModel(checkpoint, shards=2, mode=mode, dtype=dtype, verify=False, threads_per_rank=1) as model:
            def run(prompts, temps, seeds, max_tokens, stop_ids, **kw):
                return generate(model, prompts, temps, max_tokens, seeds, stop_ids, free_cache=model.free_cache, **kw)
            yield run
    return session


# ------------------------------------------------------------------ the measurement
@dataclass
class EnvelopeReport:
    checkpoint: str
    config: ScoringConfig
    results: list[VariantResult]
    audit_rate: float

    @property
    def honest(self) -> list[VariantResult]:
        return [r for r in self.results if r.variant.honest]

    @property
    def cheaters(self) -> list[VariantResult]:
        return [r for r in self.results if not r.variant.honest]


def measure_envelope(checkpoint: str | Path, *, audits_per_variant: int = 200, max_tokens: int = 48,
                     prompt_lengths: tuple[int, int] = (16, 256), long_share: float = 0.2, long_length: int = 768,
                     greedy_share: float = 0.35, temperatures: tuple[float, float] = (0.3, 1.0),
                     sharded: bool = True, seed: int = 0, config: Optional[ScoringConfig] = None,
                     only: Optional[Sequence[str]] = None, other_checkpoint: Optional[str | Path] = None,
                     progress: Optional[Callable[[str], None]] = None,
                     on_variant: Optional[Callable[["EnvelopeReport"], None]] = None,
                     device: str = "cpu") -> EnvelopeReport:
    """`device` "cuda" / "cuda:N": the honest variants include the miner on that GPU (`device_variants`); the
    reference stays the fp32 model on the CPU."""
    config = config or ScoringConfig.local_testnet()
    torch.set_num_threads(1)  # the reference (and every variant but the thread one) on one thread
    reference = load_model(checkpoint)
    tokenizer = load_tokenizer(checkpoint, reference.config)
    stop_ids = frozenset(getattr(tokenizer, "stop_ids", None) or {reference.config.eos_token_id})
    variants = build_variants(checkpoint, reference, sharded=sharded, seed=seed, other_checkpoint=other_checkpoint,
                              long_threshold=long_length // 2, device=device)
    if only:  # those variants, in the order asked
        variants = sorted((v for v in variants if v.name in only), key=lambda v: list(only).index(v.name))
    results = []
    for variant in variants:
        rng = random.Random(f"{seed}:{variant.name}")
        count = max(4, int(round(audits_per_variant * variant.share)))
        texts = prompt_texts(rng, count, prompt_lengths, long_share, long_length)
        prompts = [tokenizer.encode(t, add_bos=True) for t, _ in texts]
        temps = [0.0 if rng.random() < greedy_share else round(rng.uniform(*temperatures), 2) for _ in prompts]
        seeds = [rng.randrange(1 << 30) for _ in prompts]
        result = VariantResult(variant)
        results.append(result)
        started = time.perf_counter()

        def saved(result=result, started=started):  # after every batch: a cut run keeps what it measured
            result.seconds = time.perf_counter() - started
            if on_variant:
                on_variant(EnvelopeReport(str(checkpoint), config, results, config.audit_rate))

        with variant.open() as run:
            _audit_variant(run, result, reference, prompts, texts, temps, seeds, max_tokens, stop_ids, config,
                           on_batch=saved)
        if progress:
            progress(f"{variant.name}: {count} audits in {result.seconds:.1f} s, new rules fail "
                     f"{result.rate('new_failures'):.3f}, old rules {result.rate('old_failures'):.3f}")
    return EnvelopeReport(str(checkpoint), config, results, config.audit_rate)


def _audit_variant(run, result: VariantResult, reference, prompts, texts, temps, seeds, max_tokens, stop_ids,
                   config: ScoringConfig, batch: int = 16, on_batch: Optional[Callable[[], None]] = None) -> None:
    """Generate with the variant in batches, teacher-force on the reference, measure and judge."""
    variant = result.variant
    for start in range(0, len(prompts), batch):
        sl = slice(start, start + batch)
        answers = run(prompts[sl], temps[sl], seeds[sl], max_tokens, stop_ids)
        for (_, long), a in zip(texts[sl], answers):
            a.long = long
        for a, rows in zip(answers, reference_rows(reference, answers)):
            scores = scores_of(a, rows)
            replayed = replay_answer(a, rows)
            result.replays.append(replayed)
            result.replay_failures.append(judge_variant_replay(replayed, variant, config))
            qrng = random.Random(len(result.answers))
            sample = []
            if len(a.tokens) >= config.quality_min_positions:
                sample = sorted(qrng.sample(range(len(a.tokens)), min(config.quality_sample_positions, len(a.tokens))))
            stats = audit_statistics(a.tokens, a.logprobs, a.temperature, scores, stop_ids, config, sample)
            result.answers.append(a)
            result.statistics.append(stats)
            result.new_failures.append(judge_statistics(stats, config, trusted=True, exact=variant.exact(config),
                                                        precision=variant.precision, prompt_tokens=len(a.prompt)))
            result.old_failures.append(legacy_failures(stats, config))
        if on_batch:
            on_batch()


def judge_variant_replay(replayed: Optional[ReplayStatistics], variant: Variant,
                         config: ScoringConfig) -> list[Failure]:
    """A sampled answer's replay judged as the validator judges a miner declaring the variant's precision."""
    if replayed is None:
        return []
    return judge_replay(replayed, replay_rule(config, variant.precision), config, trusted=True)


def rejudge(report: EnvelopeReport, config: ScoringConfig) -> EnvelopeReport:
    """The same measured statistics judged under other rules (thresholds)."""
    for r in report.results:
        r.new_failures = [judge_statistics(st, config, trusted=True, exact=r.variant.exact(config),
                                           precision=r.variant.precision, prompt_tokens=len(a.prompt) or None)
                          for st, a in zip(r.statistics, r.answers)]
        r.old_failures = [legacy_failures(st, ScoringConfig.local_testnet()) for st in r.statistics]
        r.replay_failures = [judge_variant_replay(rp, r.variant, config) for rp in r.replays]
    report.config = config
    return report


def save_report(report: EnvelopeReport, path: str | Path) -> None:
    """The measured statistics (not the judgements), to re-judge later without re-measuring."""
    import pickle  # noqa: PLC0415
    rows = [dict(name=r.variant.name, description=r.variant.description, honest=r.variant.honest,
                 precision=r.variant.precision, statistics=r.statistics, long=[a.long for a in r.answers],
                 prompt_tokens=[len(a.prompt) for a in r.answers], seconds=r.seconds, replays=r.replays)
            for r in report.results]
    Path(path).write_bytes(pickle.dumps(dict(checkpoint=report.checkpoint, rows=rows)))


def load_reports(paths: Sequence[str | Path], config: ScoringConfig) -> EnvelopeReport:
    """Several saved measurements (e.g. variants measured in parallel processes) as one report."""
    import pickle  # noqa: PLC0415
    results, checkpoint = [], ""
    for path in paths:
        data = pickle.loads(Path(path).read_bytes())  # our own files, written by save_report
        checkpoint = data["checkpoint"]
        for row in data["rows"]:
            precision = row.get("precision") or ("fp32" if row["name"].startswith(("fp32", "sharded", "cheat-"))
                                                 and "bf16" not in row["name"] else row["name"].split("-")[0])
            r = VariantResult(Variant(row["name"], row["description"], row["honest"], run=None, precision=precision))
            r.statistics = row["statistics"]
            lengths = row.get("prompt_tokens") or [0] * len(row["statistics"])  # older files: not recorded
            r.answers = [Answer([0] * n, [], [], st.temperature, long)
                         for st, long, n in zip(row["statistics"], row["long"], lengths)]
            r.replays = row.get("replays") or [None] * len(row["statistics"])  # older files: not replayed
            r.seconds = row["seconds"]
            results.append(r)
    order = {name: i for i, name in enumerate(VARIANT_ORDER)}
    results.sort(key=lambda r: order.get(r.variant.name, len(order)))
    return rejudge(EnvelopeReport(checkpoint, config, results, config.audit_rate), config)


def envelope_file(report: EnvelopeReport, margin: float = MARGIN) -> dict:
    """The per-model envelope (scoring/model_envelope.py) from the report's honest audits: per declared
    precision other than fp32, the soft logprob-gap bound of short and of long prompts."""
    from inference.model import fingerprint  # noqa: PLC0415
    try:
        print_ = fingerprint(report.checkpoint)
    except Exception:  # noqa: BLE001 - informative only
        print_ = None
    rows = [(r.variant.name, r.variant.precision, a.long, len(a.prompt), st.logprob_gap_mean)
            for r in report.honest for st, a in zip(r.statistics, r.answers)
            if st.logprob_gap_mean is not None and a.prompt]
    return build_envelope(rows, checkpoint=report.checkpoint, fingerprint=print_, margin=margin)


def replay_section(report: EnvelopeReport, margin: float = MARGIN) -> dict:
    """The envelope file's "replay" section (scoring/model_envelope.py) from the honest variants' sampled answers:
    per declared precision, fp32 included, the near-tie allowance and the honest rate beyond it."""
    rows = []
    for r in report.honest:
        replayed = [rp for rp in r.replays if rp is not None]
        rows.append((r.variant.name, r.variant.precision, len(replayed), sum(rp.positions for rp in replayed),
                     [g for rp in replayed for g in rp.gaps if g > 0.0], [m for rp in replayed for m in rp.margins]))
    return build_replay(rows, margin=margin)


def replay_table(report: EnvelopeReport) -> list[str]:
    """Per variant: sampled answers and tokens replayed, the tokens that were not the replayed one (all, and
    beyond the near-tie allowance its precision is judged by), the worst gap, and the answers failed."""
    lines = [f"{'variant':32} {'answers':>7} {'tokens':>7} {'mismatch':>8} {'beyond':>6} {'rate':>7} "
             f"{'worst gap':>9} {'failed':>6} {'hard':>5}"]
    for r in report.results:
        pairs = [(rp, f) for rp, f in zip(r.replays, r.replay_failures) if rp is not None]
        if not pairs:
            continue
        delta = replay_rule(report.config, r.variant.precision).delta
        tokens = sum(rp.positions for rp, _ in pairs)
        mismatched = sum(rp.mismatches for rp, _ in pairs)
        beyond = sum(rp.beyond(delta) for rp, _ in pairs)
        worst = max(rp.worst_gap for rp, _ in pairs)
        failed = sum(1 for _, f in pairs if f)
        hard = sum(1 for _, f in pairs if any(x.hard for x in f))
        lines.append(f"{r.variant.name:32} {len(pairs):7d} {tokens:7d} {mismatched:8d} {beyond:6d} "
                     f"{beyond / max(1, tokens):7.4f} {worst:9.4f} {failed:6d} {hard:5d}")
    return lines


def holdout_table(report: EnvelopeReport, margin: float = MARGIN) -> list[str]:
    """The envelope checked on audits it was not measured on: each variant's audits split in two halves
    (alternate audits), the envelope built from one half's honest audits, the other half (honest and
    cheaters) judged by it, then the other way round. Per variant: audits judged, soft and hard failures."""
    import json  # noqa: PLC0415
    import tempfile  # noqa: PLC0415

    def half(r: VariantResult, k: int) -> VariantResult:
        out = VariantResult(r.variant, r.statistics[k::2], r.answers[k::2])
        out.seconds = r.seconds
        return out

    lines = [f"{'variant':32} {'audits':>6} {'soft':>5} {'hard':>5} {'rate':>6}"]
    totals: dict[str, list[int]] = {}
    for k in (0, 1):
        fit = EnvelopeReport(report.checkpoint, report.config, [half(r, k) for r in report.honest], report.audit_rate)
        with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as tmp:
            json.dump(envelope_file(fit, margin), tmp)
        judged = rejudge(EnvelopeReport(report.checkpoint, report.config, [half(r, 1 - k) for r in report.results],
                                        report.audit_rate), report.config.replace(logprob_gap_envelope=tmp.name))
        for r in judged.results:
            row = totals.setdefault(r.variant.name, [0, 0, 0, int(r.variant.honest)])
            row[0] += len(r.answers)
            row[1] += sum(1 for f in r.new_failures if f and not any(x.hard for x in f))
            row[2] += sum(1 for f in r.new_failures if any(x.hard for x in f))
        Path(tmp.name).unlink()
    for name, (n, soft, hard, honest) in totals.items():
        lines.append(f"{name:32} {n:6d} {soft:5d} {hard:5d} {(soft + hard) / max(1, n):6.3f}"
                     + ("" if honest else "  (cheater: detection)"))
    honest_rows = [v for v in totals.values() if v[3]]
    n = sum(v[0] for v in honest_rows)
    lines.append(f"{'all honest':32} {n:6d} {sum(v[1] for v in honest_rows):5d} {sum(v[2] for v in honest_rows):5d} "
                 f"{sum(v[1] + v[2] for v in honest_rows) / max(1, n):6.3f}")
    return lines


VARIANT_ORDER = ("fp32-batched", "fp32-alone", "fp32-threads-2", "fp32-chunk-16", "fp32-chunk-128", "fp32-recurrent",
                 "fp32-gpu-kernels", "bf16", "bf16-gpu-kernels", "bf16-chunk-64", "fp16", "fp8-dense",
                 "sharded-pipeline", "sharded-expert", "sharded-expert-bf16",
                 "cheat-other-weights", "cheat-other-weights-relabelled", "cheat-truncated-context",
                 "cheat-perturbed-experts", "cheat-half-experts", "cheat-long-swap", "cheat-bf16-half-experts",
                 "cheat-bf16-truncated-context", "cheat-greedy-for-sampled", "cheat-cooler", "cheat-fixed-seed",
                 "cheat-bf16-2bit-experts")


# ------------------------------------------------------------------ the tables
def _pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    s = sorted(values)
    return s[min(len(s) - 1, int(q * (len(s) - 1) + 0.5))]


STATISTICS = (
    ("min ref logprob", lambda s: [s.min_reference_logprob], "low"),
    ("outside top-10", lambda s: [float(s.outside_top_k)], "high"),
    ("greedy gap (nats)", lambda s: s.greedy_gaps if s.greedy else [], "high"),
    ("greedy flips > 0.1", lambda s: [float(s.gaps_over(0.1))] if s.greedy else [], "high"),
    ("|lp miner - ref| mean", lambda s: [s.logprob_gap_mean] if s.logprob_gap_mean is not None else [], "high"),
    ("|p miner - ref| mean", lambda s: [s.quality_diff] if s.quality_diff is not None else [], "high"),
    ("|surprisal z|", lambda s: [abs(s.surprisal_z)] if s.surprisal_z is not None else [], "high"),
    ("-log10 P(no stop)", lambda s: [-s.log_p_no_stop / math.log(10)] if not s.greedy else [], "high"),
    ("eos ratio>100 count", lambda s: [float(s.eos_ratio_count)], "high"),
)


def statistic_table(results: Sequence[VariantResult]) -> list[str]:
    lines = [f"{'variant':32} {'statistic':22} {'p50':>9} {'p99':>9} {'worst':>9} {'n':>6}"]
    for r in results:
        for name, get, direction in STATISTICS:
            values = [v for s in r.statistics for v in get(s)]
            if not values:
                continue
            worst = min(values) if direction == "low" else max(values)
            p99 = _pct(values, 0.01 if direction == "low" else 0.99)
            lines.append(f"{r.variant.name:32} {name:22} {_pct(values, 0.5):9.4f} {p99:9.4f} {worst:9.4f} "
                         f"{len(values):6d}")
    return lines


def rate_table(report: EnvelopeReport) -> list[str]:
    lines = [f"{'variant':32} {'audits':>6} {'old soft':>8} {'old hard':>8} {'new soft':>8} {'new hard':>8}  "
             f"{'new fails on':30}"]
    total = {"n": 0, "os": 0.0, "oh": 0.0, "ns": 0.0, "nh": 0.0}
    for r in report.honest:
        n = len(r.answers)
        os_, oh = r.rate("old_failures", False), r.rate("old_failures", True)
        ns, nh = r.rate("new_failures", False), r.rate("new_failures", True)
        checks = sorted({f.check for fs in r.new_failures for f in fs})
        lines.append(f"{r.variant.name:32} {n:6d} {os_:8.3f} {oh:8.3f} {ns:8.3f} {nh:8.3f}  {','.join(checks)[:30]}")
        total["n"] += n
        for key, value in (("os", os_), ("oh", oh), ("ns", ns), ("nh", nh)):
            total[key] += value * n
    n = max(1, total["n"])
    lines.append(f"{'all honest':32} {total['n']:6d} {total['os'] / n:8.3f} {total['oh'] / n:8.3f} "
                 f"{total['ns'] / n:8.3f} {total['nh'] / n:8.3f}")
    return lines


def detection_table(report: EnvelopeReport) -> list[str]:
    """Per cheater: the share of its audits failed (any, hard) by the new and the old rules, and the
    expected requests until the first failed audit at the validator's audit rate (long-context
    answers are always audited)."""
    lines = [f"{'cheater':34} {'audits':>6} {'new det':>7} {'new hard':>8} {'old det':>7} {'long det':>8} "
             f"{'req to detect':>13}  {'caught by':30}"]
    for r in report.cheaters:
        n = len(r.answers)
        det, hard = r.rate("new_failures"), r.rate("new_failures", True)
        old = r.rate("old_failures")
        long_det = r.rate("new_failures", long_only=True) if any(a.long for a in r.answers) else float("nan")
        # long answers are audited at long_context_audit_rate (1.0), the rest at audit_rate
        cfg = report.config
        p_long = sum(1 for a in r.answers if a.long) / max(1, n)
        per_request = (1 - p_long) * cfg.audit_rate * _rate_of(r, False) + p_long * cfg.long_context_audit_rate * (
            _rate_of(r, True))
        req = 1.0 / per_request if per_request > 0 else float("inf")
        checks = sorted({f.check for fs in r.new_failures for f in fs})
        lines.append(f"{r.variant.name:34} {n:6d} {det:7.3f} {hard:8.3f} {old:7.3f} {long_det:8.3f} {req:13.1f}  "
                     f"{','.join(checks)[:30]}")
    return lines


def _rate_of(r: VariantResult, long: bool) -> float:
    rows = [bool(f) for f, a in zip(r.new_failures, r.answers) if a.long == long]
    return sum(rows) / len(rows) if rows else 0.0


def long_context_table(report: EnvelopeReport) -> list[str]:
    """The long-context answers of each variant on their own (the validator judges them apart from the
    short ones): the miner-vs-reference logprob gap and the share of those audits failed."""
    lines = [f"{'variant':32} {'long':>5} {'lp gap p50':>10} {'lp gap p99':>10} {'worst':>9} {'failed':>7}"]
    for r in report.results:
        gaps = [s.logprob_gap_mean for s, a in zip(r.statistics, r.answers) if a.long and s.logprob_gap_mean is not None]
        if not gaps:
            continue
        lines.append(f"{r.variant.name:32} {len(gaps):5d} {_pct(gaps, 0.5):10.4f} {_pct(gaps, 0.99):10.4f} "
                     f"{max(gaps):9.4f} {r.rate('new_failures', long_only=True):7.3f}")
    return lines


def markdown_tables(report: EnvelopeReport) -> list[str]:
    """The false-positive and detection tables in the docs' markdown form."""
    lines = ["| variant | audits | soft | hard | mean abs(lp miner - ref) p99 / worst | greedy gap worst (nats) |",
             "| --- | --- | --- | --- | --- | --- |"]
    total, soft, hard = 0, 0.0, 0.0
    for r in report.honest:
        n = len(r.answers)
        gaps = [st.logprob_gap_mean for st in r.statistics if st.logprob_gap_mean is not None]
        greedy = [g for st in r.statistics if st.greedy for g in st.greedy_gaps]
        s, h = r.rate("new_failures", False), r.rate("new_failures", True)
        lines.append(f"| {r.variant.name} | {n} | {s:.3f} | {h:.3f} | {_pct(gaps, 0.99):.4f} / "
                     f"{max(gaps, default=float('nan')):.4f} | {max(greedy, default=0.0):.4f} |")
        total, soft, hard = total + n, soft + s * n, hard + h * n
    lines.append(f"| all honest | {total} | {soft / max(1, total):.3f} | {hard / max(1, total):.3f} | | |")
    lines += ["", "| cheater (declares) | audits | detected | hard | long-context detected | requests to detect | "
                  "caught by |", "| --- | --- | --- | --- | --- | --- | --- |"]
    for row, r in zip(detection_table(report)[1:], report.cheaters):
        cells = row.split()
        checks = sorted({f.check for fs in r.new_failures for f in fs})
        lines.append(f"| {r.variant.name} ({r.variant.precision}) | {cells[1]} | {cells[2]} | {cells[3]} | {cells[5]} | "
                     f"{cells[6]} | {', '.join(checks) or '-'} |")
    return lines


def format_report(report: EnvelopeReport) -> str:
    parts = [f"checkpoint {report.checkpoint}", "", "== statistics per variant (reference: fp32, one process)",
             *statistic_table(report.results), "",
             "== false-positive rate per honest variant (share of audits; old = rules before the envelope)",
             *rate_table(report), "", "== detection per cheater (new rules)", *detection_table(report), "",
             "== long-context answers on their own", *long_context_table(report), "",
             "== replay of sampled answers (k3-gumbel/1; beyond: tokens past the near-tie allowance of the "
             "precision judged)", *replay_table(report)]
    return "\n".join(parts)


__all__ = ["measure_envelope", "format_report", "envelope_file", "replay_section", "replay_table", "rejudge",
           "holdout_table", "EnvelopeReport", "VariantResult", "Variant", "legacy_failures",
           "generate", "reference_rows", "reference_scores", "replay_answer", "gpu_kernel_emulation",
           "perturb_experts", "perturbed_experts", "coarsen_experts", "load_model"]
