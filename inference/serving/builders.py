"""Choosing and building the engine a miner (or a validator's reference) serves with.

One setting picks what runs underneath the same `Engine` interface:
- `reference`: the reference model in this process, from a checkpoint directory;
- `sharded`: the model split over several processes (a plan file, or a shard count for a simple plan);
- `remote`: an OpenAI-compatible server (vLLM, SGLang) that serves Kimi K3 on GPUs.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from inference.decoding.distilled import draft_model_problems, speculation_with_table
from inference.decoding.drafters import DRAFTER_KINDS
from inference.decoding.speculation import MAX_DRAFT_TOKENS, SpeculationConfig
from inference.model import (WEIGHT_DTYPES, DeviceError, KimiK3Model, device_problem, fingerprint, load_checkpoint,
                             load_tokenizer, read_config, resolve_device, resolve_dtype)
from inference.model.device import DTYPE_NAMES
from inference.serving.engine import Engine, EngineSettings
from inference.serving.local_engine import LocalEngine
from inference.serving.state_commitment import check_commit_layers, default_commit_layers

ENGINE_KINDS = ("reference", "sharded", "remote")
AUTO_COMMIT = -1  # EngineSpec.commit_layers: the reference engine's default commitment, others none
DEQUANTIZED_EXPERT_BUDGET = 1 << 30  # keep a dequantised fp32 copy of the experts when it fits in this


class EngineSpecError(ValueError):
    """The engine settings do not describe an engine that can be built."""


@dataclass(frozen=True)
class EngineSpec:
    kind: str = "reference"
    checkpoint: str | None = None  # reference and sharded: checkpoint directory
    plan: str | None = None  # sharded: a plan file from k3-plan
    shards: int | None = None  # sharded: number of local shard processes (a simple plan is built)
    shard_mode: str = "pipeline"  # sharded with a shard count: "pipeline", "expert" or "both" (3+ ranks)
    shard_store: str | None = None  # sharded across hosts: HOST:PORT of the rendezvous store ranks >= 1 join
    remote_url: str | None = None  # remote: base URL of the OpenAI-compatible server
    remote_model: str | None = None  # remote: the model name the server serves
    remote_api_key: str | None = None
    remote_score_mode: str = "prompt_logprobs"  # "prompt_logprobs" (vLLM) or "echo"
    remote_protocol: str = "vllm"  # "vllm" (OpenAI completions + vLLM extensions) or "sglang" (native /generate)
    remote_prefill_tokens_per_s: float = 1000.0  # first-token deadline: floor + prompt / this rate
    remote_first_token_floor_s: float = 60.0
    remote_stall_timeout_s: float = 30.0  # after the first token (the miner passes its --stall-timeout-s)
    dtype: str = "auto"  # "auto": bf16 on a GPU, fp32 on the CPU (inference.model.device.resolve_dtype)
    device: str = "cpu"  # reference: "cpu", "cuda" or "cuda:N"; sharded: "cpu" or "cuda" (rank r on GPU r)
    speculate: str = "none"  # reference, sharded: "ngram", "suffix" or "distilled" drafts, verified by the model
    draft_tokens: int = 8  # with speculate: most tokens drafted per step (fewer when drafts are poor)
    draft_model: str | None = None  # speculate "distilled": the draft table (scripts/distill_drafter.py)
    # sharded on one host: make every inter-shard message cross an emulated link (benchmarks; 0 = off)
    shard_link_latency_ms: float = 0.0
    shard_link_gbps: float = 0.0
    # state commitments (inference.serving.state_commitment): layers per committed block; AUTO_COMMIT: the
    # reference engine commits every `default_commit_layers(config)` layers, the others commit nothing; 0: never
    commit_layers: int = -1
    settings: EngineSettings = field(default_factory=EngineSettings)

    def problems(self) -> list[str]:
        out = []
        if self.kind not in ENGINE_KINDS:
            out.append(f"engine kind {self.kind!r} is not one of {ENGINE_KINDS}")
        if self.kind in ("reference", "sharded", "remote"):
            if not self.checkpoint:
                out.append(f"the {self.kind} engine needs a checkpoint directory")
            elif not (Path(self.checkpoint) / "config.json").exists():
                out.append(f"{self.checkpoint} is not a checkpoint directory (no config.json); "
                           "make one with k3-checkpoint")
        if self.kind == "sharded" and not (self.plan or self.shards):
            out.append("the sharded engine needs a plan file or a shard count")
        if self.kind == "remote" and not (self.remote_url and self.remote_model):
            out.append("the remote engine needs the server URL and the model name it serves")
        if self.kind == "remote" and not self.checkpoint:
            out.append("the remote engine needs a checkpoint directory with the model's config.json, manifest and "
                       "tokenizer (the weights may be absent): it gives the fingerprint and the tokenizer")
        if self.dtype not in WEIGHT_DTYPES and self.dtype not in DTYPE_NAMES:
            out.append(f"dtype {self.dtype!r} is not one of {list(WEIGHT_DTYPES)}")
        out += self._device_problems()
        if self.speculate not in DRAFTER_KINDS:
            out.append(f"speculate {self.speculate!r} is not one of {DRAFTER_KINDS}")
        elif self.speculate != "none" and self.kind not in ("reference", "sharded"):
            out.append(f"speculative decoding runs in the reference and sharded engines only (the {self.kind} "
                       "engine's caches cannot rewind): use --speculate none")
        out += draft_model_problems(self.speculate, self.draft_model)
        if not (self.shard_link_latency_ms >= 0 and self.shard_link_gbps >= 0):
            out.append("the emulated shard links need latency >= 0 ms and bandwidth >= 0 Gbit/s (0: unlimited)")
        if self.settings.micro_batches < 1:
            out.append(f"micro-batches must be >= 1 (got {self.settings.micro_batches})")
        elif self.settings.micro_batches > 1 and self.kind != "sharded":
            out.append(f"micro-batches {self.settings.micro_batches} keeps several steps in flight over pipeline "
                       f"stages: only the sharded engine can (the {self.kind} engine runs one step at a time); "
                       "use --micro-batches 1")
        if self.commit_layers > 0 and self.kind != "reference":
            out.append(f"state commitments (--commit-layers {self.commit_layers}) need the reference engine, which "
                       f"stops at layer boundaries; the {self.kind} engine cannot: use --commit-layers 0")
        if self.commit_layers < -1:
            out.append(f"--commit-layers must be -1 (auto), 0 (none) or a divisor of the model's Attention "
                       f"Residuals block size, got {self.commit_layers}")
        if not 1 <= self.draft_tokens <= MAX_DRAFT_TOKENS:
            out.append(f"draft tokens {self.draft_tokens} is outside 1..{MAX_DRAFT_TOKENS}")
        return out


    def _device_problems(self) -> list[str]:
        """The device must exist here (one line saying so when CUDA is asked for and absent); the sharded runtime
        places rank r on GPU r itself, and a remote engine's device is its server's."""
        if self.device == "cpu":
            return []
        if self.kind == "remote":
            return [f"device {self.device!r}: the remote engine computes on its server's devices; leave --device cpu"]
        if self.kind == "sharded" and self.device != "cuda":
            return [f"device {self.device!r}: the sharded engine puts rank r on GPU r of its host; give --device cuda"]
        problem = device_problem(self.device)
        return [problem] if problem else []


def load_reference_model(checkpoint: str | Path, dtype: str = "auto", verify: bool = True,
                         progress: bool = False, device: str | torch.device = "cpu") -> tuple[KimiK3Model, object, str]:
    """The reference model with its weights on `device` ("cpu", "cuda", "cuda:N"), its tokenizer and the checkpoint
    fingerprint. `dtype` "auto": bf16 on a GPU, fp32 on the CPU. The same path on every device: a skeleton on the
    meta device, then each tensor put on `device` as it is read (on a GPU the host never holds the model)."""
    # the skeleton builder of the shard processes and stages (imports the sharding runtime's module only here)
    from inference.sharding.worker import model_skeleton  # noqa: PLC0415

    config = read_config(checkpoint)
    try:
        where = resolve_device(device)
        weights = resolve_dtype(dtype, where)
    except DeviceError as error:
        raise EngineSpecError(str(error)) from None
    model = model_skeleton(config, weights)
    if where.type == "cuda":  # the batched expert path reads the experts stacked: load them into their places
        model.hold_experts_stacked(where)
    load_checkpoint(model, checkpoint, verify=verify, progress=progress, device=where)
    left = [k for k, t in model.state_dict().items() if t.is_meta]
    if left:  # a checkpoint's tensors are checked against the model's names; nothing may stay unloaded
        raise EngineSpecError(f"{len(left)} tensors of the model were not in {checkpoint} (first: {left[0]})")
    dense_expert_bytes = len(config.moe_layers) * config.num_experts * 3 * config.latent_size \
        * config.expert_intermediate_size * 4
    if config.mxfp4_experts and dense_expert_bytes <= DEQUANTIZED_EXPERT_BUDGET:
        model.set_dequantize_cache(True)  # small models: keep decoded experts (about 2x faster decode here)
    return model, load_tokenizer(checkpoint, config), fingerprint(checkpoint)


def build_sharded_engine(spec: EngineSpec, timeouts=None) -> LocalEngine:
    """The serving engine over a ShardedModel (EngineSpec kind "sharded": a plan file or a shard count).

    Ranks on other hosts: set `shard_store` on the spec (or K3_SHARD_STORE) to HOST:PORT to host the store
    there; see inference.sharding.worker for the commands to run on the other hosts."""
    # the sharded runtime spawns processes and pulls in torch.distributed: load it only when asked for
    from inference.sharding import STORE_ENV, LinkEmulation, ShardedModel, ShardTimeouts  # noqa: PLC0415

    store = spec.shard_store or os.environ.get(STORE_ENV) or None
    # like the reference engine, check every shard's hash first; with ranks elsewhere this host may hold
    # only rank 0's files, and each host's copy is checked by fingerprint when its shard joins
    dtype = str(resolve_dtype(spec.dtype, "cuda" if spec.device == "cuda" else "cpu")).replace("torch.", "")
    model = ShardedModel(spec.checkpoint, spec.plan, shards=spec.shards, mode=spec.shard_mode, dtype=dtype,
                         device=spec.device, store=store, timeouts=timeouts or ShardTimeouts(), verify=store is None,
                         link=LinkEmulation(spec.shard_link_latency_ms, spec.shard_link_gbps))
    try:
        tokenizer = load_tokenizer(spec.checkpoint, model.config)
        return LocalEngine(model, tokenizer, spec.settings, model_fingerprint=model.fingerprint,
                           engine_kind="sharded", layout=model.layout(),
                           speculation=_speculation(spec, model.fingerprint))
    except BaseException:
        model.close()
        raise


def _speculation(spec: EngineSpec, fingerprint: str) -> SpeculationConfig | None:
    speculation = SpeculationConfig(drafter=spec.speculate, max_draft_tokens=spec.draft_tokens)
    try:  # a distilled draft table must have been made from this checkpoint
        speculation = speculation_with_table(speculation, spec.draft_model, fingerprint)
    except ValueError as exc:
        raise EngineSpecError(str(exc)) from None
    return speculation if speculation.enabled else None


def build_engine(spec: EngineSpec) -> Engine:
    problems = spec.problems()
    if problems:
        raise EngineSpecError("; ".join(problems))
    if spec.kind == "reference":
        model, tokenizer, fp = load_reference_model(spec.checkpoint, spec.dtype, device=spec.device)
        layers = default_commit_layers(model.config) if spec.commit_layers == AUTO_COMMIT else spec.commit_layers
        try:
            check_commit_layers(model.config, layers) if layers else None
        except ValueError as exc:
            raise EngineSpecError(f"--commit-layers: {exc}") from None
        return LocalEngine(model, tokenizer, replace(spec.settings, commit_layers=layers), model_fingerprint=fp,
                           engine_kind="reference", speculation=_speculation(spec, fp),
                           layout={"processes": 1, "commit_layers": layers})
    if spec.kind == "sharded":
        return build_sharded_engine(spec)
    from inference.serving.remote import (RemoteSettings, RemoteSetupError, build_remote_engine,  # noqa: PLC0415
                                          check_served_model)

    settings = RemoteSettings(
        base_url=spec.remote_url, model_name=spec.remote_model, api_key=spec.remote_api_key,
        protocol=spec.remote_protocol, score_mode=spec.remote_score_mode, max_context=spec.settings.max_context,
        max_concurrent_sequences=spec.settings.max_concurrent_sequences,
        prefill_tokens_per_s=spec.remote_prefill_tokens_per_s, first_token_floor_s=spec.remote_first_token_floor_s,
        stall_timeout_s=spec.remote_stall_timeout_s)
    if settings.problems():
        raise EngineSpecError("; ".join(settings.problems()))
    try:
        engine = build_remote_engine(settings, spec.checkpoint)
        check_served_model(settings)  # a server that answers must serve this model with at least this context
        return engine
    except RemoteSetupError as error:
        raise EngineSpecError(str(error)) from None
