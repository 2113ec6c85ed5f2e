"""Model configuration of Kimi K3 (docs/model.md sections 1, 7 and 8).

One `ModelConfig` describes every size of the architecture: the full release
(`ModelConfig.kimi_k3()`), the tiny test model (`ModelConfig.tiny()`) and its
variants, or whatever an HF-style `config.json` says (`from_hf_config`).
Layer indices are zero-based everywhere inside the project; the release's
config lists them 1-based and `from_hf_config` converts.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from inference.model.files import read_document

MXFP4_BLOCK = 32
MXFP4_BYTES_PER_WEIGHT = 0.5  # plus one scale byte per 32 weights


class ConfigError(ValueError):
    """A model configuration that cannot describe a working model."""


@dataclass(frozen=True)
class ModelConfig:
    # identity and vocabulary
    model_id: str = "kimi-k3"
    vocab_size: int = 163840
    bos_token_id: int = 163584
    eos_token_id: int = 163586
    pad_token_id: int = 163839
    max_position_embeddings: int = 1_048_576
    # trunk
    hidden_size: int = 7168
    num_layers: int = 93
    mla_layers: tuple[int, ...] = ()  # zero-based; every other layer is KDA
    first_k_dense: int = 1  # layers [0, first_k_dense) use the dense MLP
    dense_intermediate_size: int = 33792
    rms_norm_eps: float = 1e-5
    attn_res_block_size: int = 12
    situ_beta: float = 4.0
    situ_linear_beta: float = 25.0
    # MoE
    num_experts: int = 896
    experts_per_token: int = 16
    num_shared_experts: int = 2
    expert_intermediate_size: int = 3072
    latent_size: int = 3584  # routed_expert_hidden_size: experts live in this latent
    latent_moe_norm: bool = True
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    renormalize: bool = True
    mxfp4_experts: bool = True
    # MLA
    mla_heads: int = 96
    q_lora_rank: int = 1536  # 0 means a plain q projection (Kimi Linear)
    kv_lora_rank: int = 512
    qk_nope_head_dim: int = 128
    qk_rope_head_dim: int = 64  # "rope" channels; K3 applies no rotation (NoPE)
    v_head_dim: int = 128
    mla_output_gate: bool = True
    mla_norm_eps: float = 1e-6
    # KDA
    kda_heads: int = 96
    kda_head_dim: int = 128
    conv_kernel_size: int = 4
    gate_lower_bound: float | None = -5.0  # None: the Kimi Linear softplus gate
    full_rank_output_gate: bool = True  # False: low-rank g_a/g_b pair (Kimi Linear)
    a_log_size: int = 128  # entries A_log is stored with (>= kda_heads; the first H are used)

    # ------------------------------------------------------------------ presets
    @classmethod
    def kimi_k3(cls) -> "ModelConfig":
        """The released Kimi K3 (2.78T parameters)."""
        return cls(mla_layers=_one_based_to_zero(_k3_full_attn_layers(93)))

    @classmethod
    def tiny(cls, **overrides) -> "ModelConfig":
        """About 1.2M parameters with every structural feature of K3 (model.md section 8)."""
        base = dict(
            model_id="kimi-k3-tiny",
            vocab_size=272,  # 256 bytes + 16 special tokens
            bos_token_id=256,
            eos_token_id=257,
            pad_token_id=271,
            max_position_embeddings=65536,
            hidden_size=64,
            num_layers=13,
            mla_layers=_one_based_to_zero([4, 8, 12, 13]),
            first_k_dense=1,
            dense_intermediate_size=128,
            attn_res_block_size=3,
            num_experts=16,
            experts_per_token=4,
            num_shared_experts=2,
            expert_intermediate_size=32,
            latent_size=32,
            mla_heads=4,
            q_lora_rank=32,
            kv_lora_rank=32,
            qk_nope_head_dim=16,
            qk_rope_head_dim=8,
            v_head_dim=16,
            kda_heads=4,
            kda_head_dim=16,
            a_log_size=16,  # stored padded, like the release's [128] for 96 heads
        )
        base.update(overrides)
        return cls(**base)

    @classmethod
    def tiny_grouped(cls) -> "ModelConfig":
        """Tiny variant exercising grouped top-k routing."""
        return cls.tiny(model_id="kimi-k3-tiny-grouped", n_group=4, topk_group=2)

    @classmethod
    def tiny_trained(cls) -> "ModelConfig":
        """The tiny shape with grouped top-k routing, as trained on stdlib text (inference/model/training.py)."""
        return cls.tiny(model_id="kimi-k3-tiny-trained", n_group=4, topk_group=2)

    @classmethod
    def tiny_kimi_linear(cls) -> "ModelConfig":
        """Tiny variant with the Kimi Linear switches: softplus gate, low-rank output gate, no q_lora."""
        return cls.tiny(
            model_id="kimi-linear-tiny",
            gate_lower_bound=None,
            full_rank_output_gate=False,
            q_lora_rank=0,
            a_log_size=4,
        )

    @classmethod
    def kimi_k3_scaled(cls) -> "ModelConfig":
        """Kimi K3's shape scaled down to a ~12.7 GB checkpoint (benchmarks of what a validator holds): every
        structural feature and K3's ratios where they matter to memory and disk (MLA every 4th layer and the
        last, a dense first layer, Attention Residuals blocks of 12, a latent of half the width, MXFP4 routed
        experts that are ~95% of the bytes, 2 shared experts); fewer layers, a narrower trunk, 416 experts
        (top 8) and a 32k vocabulary."""
        return cls(
            model_id="kimi-k3-scaled", vocab_size=32768, bos_token_id=32000, eos_token_id=32001, pad_token_id=32767,
            max_position_embeddings=65536, hidden_size=1024, num_layers=24,
            mla_layers=_one_based_to_zero(_k3_full_attn_layers(24)), first_k_dense=1, dense_intermediate_size=4096,
            attn_res_block_size=12, num_experts=416, experts_per_token=8, num_shared_experts=2,
            expert_intermediate_size=1536, latent_size=512, mla_heads=8, q_lora_rank=256, kv_lora_rank=128,
            qk_nope_head_dim=64, qk_rope_head_dim=32, v_head_dim=64, kda_heads=8, kda_head_dim=64, a_log_size=16)

    @classmethod
    def presets(cls) -> dict[str, Callable[[], "ModelConfig"]]:
        """The preset names (what --model and --preset take) and their constructors."""
        return {
            "kimi_k3": cls.kimi_k3,
            "kimi-k3": cls.kimi_k3,
            "kimi_k3_scaled": cls.kimi_k3_scaled,
            "tiny": cls.tiny,
            "tiny_grouped": cls.tiny_grouped,
            "tiny_trained": cls.tiny_trained,
            "tiny_kimi_linear": cls.tiny_kimi_linear,
        }

    @classmethod
    def preset(cls, name: str) -> "ModelConfig":
        presets = cls.presets()
        if name not in presets:
            raise ConfigError(f"unknown preset {name!r}; choose one of {sorted(presets)}")
        return presets[name]()

    @classmethod
    def from_file(cls, path: str | Path) -> "ModelConfig":
        """Read a `config.json` (HF style) or a checkpoint directory holding one."""
        path = Path(path)
        if path.is_dir():
            path = path / "config.json"
        document = read_document(path, ConfigError, "config")
        try:
            return cls.from_hf_config(document)
        except ConfigError:
            raise
        except (TypeError, ValueError, KeyError, AttributeError) as exc:
            raise ConfigError(
                f"{path} is not a Kimi K3 config.json ({type(exc).__name__}: {exc}); "
                "it needs the release's keys (num_hidden_layers, hidden_size, linear_attn_config, ...)"
            ) from None

    # ------------------------------------------------------------ HF config io
    @classmethod
    def from_hf_config(cls, d: dict) -> "ModelConfig":
        """Build from an HF-style config dict (the release's keys, or DeepSeek-style aliases)."""
        top = d
        t = dict(d.get("text_config") or d)

        def pick(*names, default=None):
            for n in names:
                if n in t and t[n] is not None:
                    return t[n]
                if n in top and top[n] is not None:
                    return top[n]
            return default

        num_layers = int(pick("num_hidden_layers"))
        lin = t.get("linear_attn_config") or {}
        if "full_attn_layers" in lin:
            mla_layers = _one_based_to_zero(lin["full_attn_layers"])
        else:
            mla_layers = ()
        if "kda_layers" in lin:
            kda = _one_based_to_zero(lin["kda_layers"])
            covered = sorted(list(kda) + list(mla_layers))
            if covered != list(range(num_layers)):
                raise ConfigError(
                    "linear_attn_config: kda_layers and full_attn_layers must together list "
                    f"every layer 1..{num_layers} exactly once"
                )
        quant = t.get("quantization_config") or top.get("quantization_config") or {}
        mxfp4 = "mxfp4" in str(quant.get("format", "")).lower()
        kda_heads = int(lin.get("num_heads", pick("num_attention_heads", default=96)))
        kda_head_dim = int(lin.get("head_dim", 128))
        gate_lower_bound = lin.get("gate_lower_bound")
        num_experts = int(pick("num_experts", "n_routed_experts"))
        top_k = int(pick("num_experts_per_token", "num_experts_per_tok"))
        cfg = cls(
            model_id=str(top.get("model_id", top.get("_name_or_path", top.get("model_type", "kimi-k3")))),
            vocab_size=int(pick("vocab_size")),
            bos_token_id=int(pick("bos_token_id", default=0)),
            eos_token_id=int(pick("eos_token_id", default=0)),
            pad_token_id=int(pick("pad_token_id", default=0)),
            max_position_embeddings=int(pick("max_position_embeddings", default=1_048_576)),
            hidden_size=int(pick("hidden_size")),
            num_layers=num_layers,
            mla_layers=mla_layers,
            first_k_dense=int(pick("first_k_dense_replace", default=1)),
            dense_intermediate_size=int(pick("intermediate_size")),
            rms_norm_eps=float(pick("rms_norm_eps", default=1e-5)),
            attn_res_block_size=int(pick("attn_res_block_size", default=12)),
            situ_beta=float(pick("activation_situ_beta", default=4.0)),
            situ_linear_beta=float(pick("activation_situ_linear_beta", default=25.0)),
            num_experts=num_experts,
            experts_per_token=top_k,
            num_shared_experts=int(pick("num_shared_experts", "n_shared_experts", default=1)),
            expert_intermediate_size=int(pick("moe_intermediate_size")),
            latent_size=int(pick("routed_expert_hidden_size", default=pick("hidden_size"))),
            latent_moe_norm=bool(pick("latent_moe_use_norm", default=True)),
            n_group=int(pick("num_expert_group", "n_group", default=1)),
            topk_group=int(pick("topk_group", default=1)),
            routed_scaling_factor=float(pick("routed_scaling_factor", default=1.0)),
            renormalize=bool(pick("moe_renormalize", "norm_topk_prob", default=True)),
            mxfp4_experts=mxfp4,
            mla_heads=int(pick("num_attention_heads")),
            q_lora_rank=int(pick("q_lora_rank", default=0) or 0),
            kv_lora_rank=int(pick("kv_lora_rank")),
            qk_nope_head_dim=int(pick("qk_nope_head_dim")),
            qk_rope_head_dim=int(pick("qk_rope_head_dim")),
            v_head_dim=int(pick("v_head_dim")),
            mla_output_gate=bool(pick("mla_use_output_gate", default=False)),
            kda_heads=kda_heads,
            kda_head_dim=kda_head_dim,
            conv_kernel_size=int(lin.get("short_conv_kernel_size", 4)),
            gate_lower_bound=None if gate_lower_bound is None else float(gate_lower_bound),
            full_rank_output_gate=bool(lin.get("use_full_rank_gate", False)),
            a_log_size=int(
                lin.get("a_log_size", max(kda_heads, kda_head_dim) if gate_lower_bound is not None else kda_heads)
            ),
        )
        return cfg

    def to_hf_config(self) -> dict:
        """The HF-style `config.json` this config round-trips through (release key names)."""
        one_based_mla = [i + 1 for i in self.mla_layers]
        one_based_kda = [i + 1 for i in self.kda_layers]
        lin = {
            "num_heads": self.kda_heads,
            "head_dim": self.kda_head_dim,
            "short_conv_kernel_size": self.conv_kernel_size,
            "use_full_rank_gate": self.full_rank_output_gate,
            "full_attn_layers": one_based_mla,
            "kda_layers": one_based_kda,
            "a_log_size": self.a_log_size,
        }
        if self.gate_lower_bound is not None:
            lin["gate_lower_bound"] = self.gate_lower_bound
        text = {
            "model_type": "kimi_linear",
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "num_hidden_layers": self.num_layers,
            "hidden_act": "situ",
            "activation_situ_beta": self.situ_beta,
            "activation_situ_linear_beta": self.situ_linear_beta,
            "intermediate_size": self.dense_intermediate_size,
            "first_k_dense_replace": self.first_k_dense,
            "moe_layer_freq": 1,
            "num_experts": self.num_experts,
            "num_experts_per_token": self.experts_per_token,
            "num_shared_experts": self.num_shared_experts,
            "moe_intermediate_size": self.expert_intermediate_size,
            "routed_expert_hidden_size": self.latent_size,
            "latent_moe_use_norm": self.latent_moe_norm,
            "moe_router_activation_func": "sigmoid",
            "moe_renormalize": self.renormalize,
            "routed_scaling_factor": self.routed_scaling_factor,
            "use_grouped_topk": True,
            "num_expert_group": self.n_group,
            "topk_group": self.topk_group,
            "num_attention_heads": self.mla_heads,
            "num_key_value_heads": self.mla_heads,
            "q_lora_rank": self.q_lora_rank or None,
            "kv_lora_rank": self.kv_lora_rank,
            "qk_nope_head_dim": self.qk_nope_head_dim,
            "qk_rope_head_dim": self.qk_rope_head_dim,
            "v_head_dim": self.v_head_dim,
            "mla_use_nope": True,
            "mla_use_output_gate": self.mla_output_gate,
            "linear_attn_config": lin,
            "attn_res_block_size": self.attn_res_block_size,
            "rms_norm_eps": self.rms_norm_eps,
            "max_position_embeddings": self.max_position_embeddings,
            "num_nextn_predict_layers": 0,
        }
        if self.mxfp4_experts:
            text["quantization_config"] = {
                "quant_method": "compressed-tensors",
                "format": "mxfp4-pack-quantized",
                "config_groups": {
                    "group_0": {
                        "targets": ["Linear"],
                        "weights": {
                            "num_bits": 4,
                            "type": "float",
                            "strategy": "group",
                            "group_size": MXFP4_BLOCK,
                            "symmetric": True,
                            "scale_dtype": "torch.uint8",
                        },
                    }
                },
                "ignore": [
                    "re:.*self_attn.*",
                    "re:.*shared_experts.*",
                    "re:.*mlp\\.(gate|up|gate_up|down)_proj.*",
                    "re:.*lm_head.*",
                    "re:.*vision_tower.*",
                    "re:.*mm_projector.*",
                ],
            }
        return {
            "architectures": ["KimiK3ForConditionalGeneration"],
            "model_type": "kimi_k3",
            "model_id": self.model_id,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": self.eos_token_id,
            "pad_token_id": self.pad_token_id,
            "tie_word_embeddings": False,
            "text_config": text,
        }

    def config_hash(self) -> str:
        """sha256 of the canonical JSON of this config (part of the checkpoint manifest)."""
        blob = json.dumps(dataclasses.asdict(self), sort_keys=True, default=list).encode()
        return hashlib.sha256(blob).hexdigest()

    # ----------------------------------------------------------- validation
    def __post_init__(self):
        object.__setattr__(self, "mla_layers", tuple(int(i) for i in self.mla_layers))
        self.validate()

    def validate(self) -> None:
        problems = []
        if self.num_layers < 1:
            problems.append("num_layers must be >= 1")
        bad = [i for i in self.mla_layers if not 0 <= i < self.num_layers]
        if bad:
            problems.append(f"MLA layer indices {bad} are outside 0..{self.num_layers - 1}")
        if len(set(self.mla_layers)) != len(self.mla_layers):
            problems.append("MLA layer list has duplicates")
        if not 0 <= self.first_k_dense <= self.num_layers:
            problems.append("first_k_dense must lie in 0..num_layers")
        if self.experts_per_token > self.num_experts:
            problems.append(
                f"top-k {self.experts_per_token} exceeds the number of experts {self.num_experts}"
            )
        if self.experts_per_token < 1:
            problems.append("experts_per_token must be >= 1")
        if self.num_experts % self.n_group:
            problems.append(f"{self.num_experts} experts do not split into {self.n_group} groups")
        if not 1 <= self.topk_group <= self.n_group:
            problems.append(f"topk_group {self.topk_group} must lie in 1..n_group ({self.n_group})")
        elif self.n_group > 1 and self.topk_group * (self.num_experts // self.n_group) < self.experts_per_token:
            problems.append("the kept expert groups hold fewer experts than top-k")
        if self.mxfp4_experts:
            for name in ("latent_size", "expert_intermediate_size"):
                value = getattr(self, name)
                if value % MXFP4_BLOCK:
                    problems.append(
                        f"{name}={value} is not a multiple of {MXFP4_BLOCK}, which MXFP4 experts need"
                    )
        if self.a_log_size < self.kda_heads and self.num_kda_layers:
            problems.append(f"a_log_size {self.a_log_size} is smaller than the {self.kda_heads} KDA heads")
        for name in ("hidden_size", "vocab_size", "kda_heads", "kda_head_dim", "mla_heads",
                     "kv_lora_rank", "qk_nope_head_dim", "v_head_dim", "conv_kernel_size",
                     "attn_res_block_size", "num_experts", "latent_size", "expert_intermediate_size"):
            if getattr(self, name) < 1:
                problems.append(f"{name} must be >= 1")
        for name in ("bos_token_id", "eos_token_id", "pad_token_id"):
            if not 0 <= getattr(self, name) < self.vocab_size:
                problems.append(f"{name}={getattr(self, name)} is outside the vocabulary (0..{self.vocab_size - 1})")
        if problems:
            raise ConfigError("invalid model config: " + "; ".join(problems))

    # -------------------------------------------------------------- derived
    @property
    def kda_layers(self) -> tuple[int, ...]:
        mla = set(self.mla_layers)
        return tuple(i for i in range(self.num_layers) if i not in mla)

    @property
    def num_mla_layers(self) -> int:
        return len(self.mla_layers)

    @property
    def num_kda_layers(self) -> int:
        return self.num_layers - len(self.mla_layers)

    @property
    def moe_layers(self) -> tuple[int, ...]:
        return tuple(range(self.first_k_dense, self.num_layers))

    def is_mla(self, layer: int) -> bool:
        return layer in self.mla_layers

    def is_moe(self, layer: int) -> bool:
        return layer >= self.first_k_dense

    @property
    def kda_proj_size(self) -> int:
        """P = H * d, the width of the KDA q/k/v projections."""
        return self.kda_heads * self.kda_head_dim

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def mla_cache_width(self) -> int:
        """Values cached per token per MLA layer: normalised c_kv plus the shared k_pe."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def shared_expert_intermediate_size(self) -> int:
        return self.num_shared_experts * self.expert_intermediate_size

    # ------------------------------------------------------ parameter counts
    def _kda_params(self) -> tuple[int, int]:
        """(bf16 parameters, fp32 parameters) of one KDA layer."""
        D, H, d, P = self.hidden_size, self.kda_heads, self.kda_head_dim, self.kda_proj_size
        bf16 = 3 * D * P + P * D  # q, k, v projections and o_proj
        bf16 += d * D + P * d  # f_a, f_b (gate low-rank pair)
        bf16 += H * D  # b_proj
        if self.full_rank_output_gate:
            bf16 += P * D  # g_proj
        else:
            bf16 += d * D + P * d  # g_a, g_b
        fp32 = 3 * P * self.conv_kernel_size + self.a_log_size + P + d
        return bf16, fp32

    def _mla_params(self) -> int:
        D, Hm = self.hidden_size, self.mla_heads
        n = 0
        if self.q_lora_rank:
            n += self.q_lora_rank * D + self.q_lora_rank + Hm * self.qk_head_dim * self.q_lora_rank
        else:
            n += Hm * self.qk_head_dim * D
        n += self.mla_cache_width * D + self.kv_lora_rank
        n += Hm * (self.qk_nope_head_dim + self.v_head_dim) * self.kv_lora_rank
        if self.mla_output_gate:
            n += Hm * self.v_head_dim * D
        n += D * Hm * self.v_head_dim
        return n

    def _expert_params(self) -> int:
        return 3 * self.latent_size * self.expert_intermediate_size

    def _expert_bytes(self) -> int:
        if not self.mxfp4_experts:
            return 2 * self._expert_params()
        w = self._expert_params()
        return w // 2 + w // MXFP4_BLOCK

    def _moe_dense_params(self) -> tuple[int, int]:
        """(bf16, fp32) parameters of one MoE layer, routed experts excluded."""
        D, E, Lt = self.hidden_size, self.num_experts, self.latent_size
        bf16 = E * D  # router
        bf16 += 2 * Lt * D + (Lt if self.latent_moe_norm else 0)
        bf16 += 3 * D * self.shared_expert_intermediate_size
        return bf16, E  # fp32: e_score_correction_bias

    def _layer_common_params(self) -> int:
        return 6 * self.hidden_size  # 2 RMSNorms + 2 AttnRes sites (norm D, proj D)

    def _breakdown(self, active: bool) -> dict[str, tuple[int, int, int]]:
        """Per component: (bf16 params, fp32 params, routed expert count)."""
        D, V = self.hidden_size, self.vocab_size
        kda_bf16, kda_fp32 = self._kda_params()
        moe_bf16, moe_fp32 = self._moe_dense_params()
        n_moe = len(self.moe_layers)
        experts = n_moe * (self.experts_per_token if active else self.num_experts)
        return {
            "kda": (self.num_kda_layers * kda_bf16, self.num_kda_layers * kda_fp32, 0),
            "mla": (self.num_mla_layers * self._mla_params(), 0, 0),
            "layer_norms_attn_res": (self.num_layers * self._layer_common_params(), 0, 0),
            "dense_mlp": (self.first_k_dense * 3 * D * self.dense_intermediate_size, 0, 0),
            "moe_non_expert": (n_moe * moe_bf16, n_moe * moe_fp32, 0),
            "routed_experts": (0, 0, experts),
            "embedding": (0 if active else V * D, 0, 0),
            "lm_head_final": (V * D + 3 * D, 0, 0),
        }

    def num_parameters(self) -> int:
        """All text parameters (MXFP4 weights counted as parameters)."""
        return sum(b + f + e * self._expert_params() for b, f, e in self._breakdown(False).values())

    def num_active_parameters(self) -> int:
        """Parameters touched per token (top-k routed experts only), input embedding excluded."""
        return sum(b + f + e * self._expert_params() for b, f, e in self._breakdown(True).values())

    def num_routed_active_parameters(self) -> int:
        return len(self.moe_layers) * self.experts_per_token * self._expert_params()

    def checkpoint_bytes(self) -> int:
        """Bytes of the text weights as released: experts MXFP4, fp32 extras, the rest bf16."""
        return sum(2 * b + 4 * f + e * self._expert_bytes() for b, f, e in self._breakdown(False).values())

    def expert_bytes(self) -> int:
        """Bytes of one routed expert (w1, w2, w3 with scales)."""
        return self._expert_bytes()

    def kda_state_bytes_per_sequence(self) -> int:
        """Recurrent KDA state of one sequence (fp32), independent of its length."""
        return self.num_kda_layers * self.kda_heads * self.kda_head_dim * self.kda_head_dim * 4

    def kda_conv_bytes_per_sequence(self, dtype_bytes: int = 4) -> int:
        """Short-convolution windows of one sequence (q, k, v; kernel-1 past inputs each)."""
        return self.num_kda_layers * 3 * self.kda_proj_size * (self.conv_kernel_size - 1) * dtype_bytes

    def mla_cache_bytes_per_token(self, dtype_bytes: int = 2) -> int:
        return self.num_mla_layers * self.mla_cache_width * dtype_bytes

    def summary(self) -> dict:
        return {
            "model_id": self.model_id,
            "parameters": self.num_parameters(),
            "active_parameters": self.num_active_parameters(),
            "checkpoint_bytes": self.checkpoint_bytes(),
            "layers": self.num_layers,
            "kda_layers": self.num_kda_layers,
            "mla_layers": self.num_mla_layers,
            "experts": f"{self.num_experts} (top {self.experts_per_token})",
        }


def _k3_full_attn_layers(num_layers: int) -> list[int]:
    """1-based MLA layers of K3: every 4th, plus the last."""
    layers = list(range(4, num_layers + 1, 4))
    if layers[-1] != num_layers:
        layers.append(num_layers)
    return layers


def _one_based_to_zero(layers) -> tuple[int, ...]:
    layers = [int(i) for i in layers]
    if any(i < 1 for i in layers):
        raise ConfigError(f"layer lists in config.json are 1-based; got {layers}")
    return tuple(i - 1 for i in layers)


__all__ = ["ModelConfig", "ConfigError", "MXFP4_BLOCK"]
