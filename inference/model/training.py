"""Train the tiny Kimi K3 on text every machine has: the Python standard library's own sources.

    result = train(TrainConfig(steps=..., seed=0, threads=2), out_dir)   # writes a release-layout checkpoint

Every structural feature of the architecture trains: KDA (prefill through `kda_chunked_autograd`, the
differentiable chunked form), MLA (the naive form, batched), Stable LatentMoE with grouped noaux_tc routing
(router learnt through the gate weights; the selection bias `e_score_correction_bias` steered by the
aux-loss-free balancing rule: raise the bias of under-loaded experts, lower that of over-loaded ones) and
block Attention Residuals. Routed experts train in fp32 and are quantised to MXFP4 at the end; with
`fake_quant` they train through the MXFP4 grid with a straight-through estimator, so the final quantisation
changes nothing. The checkpoint goes through the project's writer (`inference.model.checkpoint`), so it has
the shards, index, config.json and k3_manifest.json (fingerprint) of any other checkpoint; the byte tokenizer
needs no files (the random tiny checkpoint has none either). `training_info.json` beside them records the
data, the settings and the measured bits per byte.

Data: the interpreter's stdlib `.py` files (tests and site-packages excluded), sorted; a file is held out when
the sha256 of its relative path falls in a 1/20 bucket, so the split does not depend on which other files
exist. A share of the training sequences are synthetic chat exchanges that teach retrieval and copying in
the format the validator's probes use: a document holding "The access code for NAME is NUMBER." (among
distractors), the question "What is the access code for NAME? Reply with the number only.", and the answer;
and "Repeat the following text exactly" requests with their answer. Knobs for those exchanges (all off by
default, which keeps the shipped recipe's data stream bit for bit): `answer_weight` (loss weight of the answer
tokens), `pack_tasks` (exchanges back to back in a row), `fact_doc_bytes` / `curriculum_steps` (filler around
the fact, growing over the run), `max_distractors`, `copy_share` and `random_copy_share` (copy requests whose
text is random codes and names, which only copying predicts). None of the recipes tried so far taught the
answer probes within the budget (docs/model.md section 9 has the recipe that does).

Determinism: one seed and one thread count give the same weights bit for bit (the data order comes from
seeded generators, torch runs with deterministic algorithms; tests/test_training.py checks it). Another
Python version has other stdlib files, so `training_info.json` records a fingerprint of the data.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import random
import sys
import sysconfig
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from inference.model import mxfp4
from inference.model.checkpoint import (load_checkpoint, random_checkpoint_tensors, state_dict_to_checkpoint_tensors,
                                        write_checkpoint)
from inference.model.config import ModelConfig
from inference.model.k3 import KimiK3Model
from inference.model.kda import CHUNKED_MIN_TOKENS, KDAAttention
from inference.model.layers import attn_res
from inference.model.mla import MLAAttention
from inference.model.moe import Expert, LatentMoE, situ_glu
from inference.model.tokenizer import ByteTokenizer

INFO_FILE = "training_info.json"
EXCLUDED_DIRS = frozenset({"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"})
HELDOUT_BUCKETS = 20  # one file in 20 (by path hash) is held out
LN2 = math.log(2.0)
TRAIN_LM_HEAD_SCALE = 0.1  # lm_head starts at a tenth of the random recipe's (logit std ~0.3, not ~3)
RECALL_EMBED_SCALE = 0.3  # init_for_recall: embedding std
RESIDUAL_BRANCH_OUTPUTS = ("self_attn.o_proj.weight", "mlp.down_proj.weight", "shared_experts.down_proj.weight",
                           "routed_expert_up_proj.weight")

# Repeat rows: a random string between two marker bytes that stdlib text never holds, later the same again.
REPEAT_OPEN, REPEAT_CLOSE = 0x1E, 0x1F
REPEAT_ALPHABET = tuple(b"abcdefghijklmnopqrstuvwxyz0123456789")
REPEAT_DIGITS = tuple(b"0123456789")  # half the strings: digits only, where one token of context is not enough
# The probe formats of the validator (scoring/corpus.py words them the same way; inference/ cannot import it).
FACT_TEMPLATE = "The access code for {subject} is {value}."
QUESTION_TEMPLATE = "What is the access code for {subject}? Reply with the number only."
COPY_TEMPLATE = "Repeat the following text exactly, with nothing before or after it:\n\n{text}"
_FIRST = ("Ada", "Ben", "Chen", "Dana", "Emil", "Farah", "Goran", "Hana", "Ivo", "Jun", "Kofi", "Lena", "Mara",
          "Nils", "Omar", "Pia", "Quinn", "Rosa", "Sami", "Tara", "Uma", "Viktor", "Wen", "Xenia", "Yusuf", "Zoe")
_LAST = ("Alvarez", "Brandt", "Costa", "Dahl", "Eriksen", "Fischer", "Garcia", "Horvat", "Ito", "Jensen", "Kowalski",
         "Larsen", "Moreau", "Novak", "Okafor", "Petrov", "Quist", "Rossi", "Sato", "Tanaka", "Ueda", "Varga",
         "Weber", "Xu", "Yilmaz", "Zhang")


# --------------------------------------------------------------------------- configuration
def trained_tiny_config() -> ModelConfig:
    """The configuration the trained tiny model uses (ModelConfig.tiny_trained)."""
    return ModelConfig.tiny_trained()


@dataclass(frozen=True)
class TrainConfig:
    preset: str = "tiny_trained"
    seed: int = 0
    threads: int = 1
    steps: int = 500
    batch_size: int = 8
    seq_len: int = 256
    lr: float = 1e-2
    min_lr_ratio: float = 0.1
    warmup_steps: int = 10
    weight_decay: float = 0.01
    grad_clip: float = 1.0
    fake_quant: bool = False  # experts train through the MXFP4 grid (straight-through estimator)
    task_fraction: float = 0.7  # share of sequences that start with a synthetic probe-style exchange
    copy_share: float = 0.05  # of those exchanges, the share that are exact-copy requests (the rest planted facts)
    answer_weight: float = 1.0  # loss weight of an exchange's answer tokens (the rest weigh 1)
    fact_doc_bytes: int = 100  # filler around a planted fact: up to this many bytes (0: seq_len - 150)
    curriculum_steps: int = 0  # the filler limit grows linearly from 0 to fact_doc_bytes over these steps
    max_distractors: int = 0  # other people's access codes planted beside the asked one (0..this many)
    random_copy_share: float = 0.5  # of the copy requests, the share whose text is random codes and names
    pack_tasks: bool = True  # a task row holds exchanges back to back (else one, then stdlib text)
    repeat_steps: int = 150  # the first steps train on repeat rows only (random strings, each said again later)
    repeat_share: float = 0.3  # after them, the share of rows that are repeat rows
    repeat_gap: int = 120  # most bytes of stdlib text between a string and its repeat...
    repeat_gap_steps: int = 100  # ...a limit that grows linearly from 0 over these steps (0: from the start)
    balance_rate: float = 1e-3  # aux-loss-free balancing: bias step per training step
    kda_chunk: int = 32  # chunk of the differentiable KDA prefill
    recall_init: bool = True  # start from init_for_recall (KDA as a next-token memory, zero branch outputs)
    kda_decay_init: tuple[float, float] | None = (0.003, 0.3)  # (slowest, fastest) per-token decay in nats: dt_bias is
    # set so that each KDA channel's decay at z = dt_bias starts on a geometric ladder between them (the
    # model's own init gives about 2.5 nats a token, which forgets within a byte or two); None: model init
    eval_bytes: int = 1 << 15  # held-out bytes scored at the end
    stdlib_dir: str | None = None  # default: the running interpreter's Lib directory

    def model_config(self) -> ModelConfig:
        return ModelConfig.preset(self.preset)


# --------------------------------------------------------------------------- data
@dataclass
class Corpus:
    train: bytes
    heldout: bytes
    train_files: int
    heldout_files: int
    root: str

    @property
    def fingerprint(self) -> str:
        h = hashlib.sha256()
        h.update(hashlib.sha256(self.train).digest())
        h.update(hashlib.sha256(self.heldout).digest())
        return h.hexdigest()[:16]


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def is_heldout(relpath: str) -> bool:
    return hashlib.sha256(relpath.encode()).digest()[0] % HELDOUT_BUCKETS == 0


def stdlib_corpus(root: str | Path | None = None) -> Corpus:
    """The stdlib's .py files (sorted by relative path, tests excluded), split into train and held-out."""
    root = Path(root) if root else stdlib_root()
    if not root.is_dir():
        raise FileNotFoundError(f"no standard library directory at {root}")
    files = sorted((p for p in root.rglob("*.py") if not EXCLUDED_DIRS & set(p.relative_to(root).parts[:-1])),
                   key=lambda p: p.relative_to(root).as_posix())
    train, held, n_train, n_held = [], [], 0, 0
    for path in files:
        rel = path.relative_to(root).as_posix()
        text = path.read_bytes()
        if not text.strip():
            continue
        if is_heldout(rel):
            held.append(text)
            n_held += 1
        else:
            train.append(text)
            n_train += 1
    if not n_train or not n_held:
        raise ValueError(f"{root} holds too few .py files to split into train and held-out text")
    return Corpus(b"\n\n".join(train), b"\n\n".join(held), n_train, n_held, str(root))


def person_name(rng: random.Random) -> str:
    if rng.random() < 0.5:
        return f"{rng.choice(_FIRST)} {rng.choice(_LAST)}"
    # invented names, so that answering needs copying the name, not remembering a list
    def word():
        return "".join(rng.choice("bcdfghklmnprstvz") + rng.choice("aeiou") for _ in range(rng.randint(1, 3))).title()
    return f"{word()} {word()}"


def access_code(rng: random.Random) -> str:
    return str(rng.randint(100_000, 999_999))


def _filler(rng: random.Random, text: bytes, n_chars: int) -> list[str]:
    """A few snippets of stdlib text (whole lines) adding up to about n_chars characters."""
    out, total = [], 0
    while total < n_chars:
        start = rng.randrange(0, len(text) - 400)
        start = text.find(b"\n", start) + 1
        snippet = text[start: start + rng.randint(40, 160)].decode("utf-8", "ignore")
        snippet = snippet.rsplit("\n", 1)[0] if "\n" in snippet else snippet
        if snippet.strip():
            out.append(snippet.strip("\n"))
            total += len(snippet) + 2
    return out


def planted_fact_exchange(rng: random.Random, text: bytes, tokenizer: ByteTokenizer, size: int,
                          max_distractors: int = 2) -> tuple[list[int], int]:
    """Token ids of one chat exchange (a document with planted access codes, the question, the answer) and
    where the answer starts."""
    subject, value = person_name(rng), access_code(rng)
    body = _filler(rng, text, rng.randint(min(20, size), max(21, size))) if size > 0 else []
    for _ in range(rng.randint(0, max_distractors)):
        other = person_name(rng)
        if other != subject:
            body.insert(rng.randint(0, len(body)), FACT_TEMPLATE.format(subject=other, value=access_code(rng)))
    body.insert(rng.randint(0, len(body)), FACT_TEMPLATE.format(subject=subject, value=value))
    content = "\n\n".join(body) + "\n\n" + QUESTION_TEMPLATE.format(subject=subject)
    return _exchange(tokenizer, content, value)


def random_passage(rng: random.Random, n_chars: int) -> str:
    """Access codes and invented names in random order: text no n-gram statistics predict, only copying."""
    words: list[str] = []
    while len(" ".join(words)) < n_chars:
        words.append(access_code(rng) if rng.random() < 0.4 else person_name(rng).split()[rng.randint(0, 1)])
    return " ".join(words)[:n_chars]


def copy_exchange(rng: random.Random, text: bytes, tokenizer: ByteTokenizer,
                  random_share: float = 0.0) -> tuple[list[int], int]:
    if random_share and rng.random() < random_share:
        passage = random_passage(rng, rng.randint(16, 48))
    else:
        passage = " ".join(" ".join(_filler(rng, text, rng.randint(16, 48))).split())[: rng.randint(16, 48)]
    return _exchange(tokenizer, COPY_TEMPLATE.format(text=passage), passage)


def _exchange(tokenizer: ByteTokenizer, content: str, answer: str) -> tuple[list[int], int]:
    ids = tokenizer.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True)
    return ids + tokenizer.encode(answer) + [tokenizer.special_tokens["<|im_end|>"]], len(ids)


class Batches:
    """Seeded training batches [B, T + 1]: random windows of the training text, some opening with a
    synthetic exchange (the rest of the row continues with stdlib text); with each, the loss weight of
    every target [B, T] (an exchange's answer tokens weigh `answer_weight`)."""

    def __init__(self, corpus: Corpus, tc: TrainConfig, tokenizer: ByteTokenizer):
        self.text = corpus.train
        self.data = torch.frombuffer(bytearray(corpus.train), dtype=torch.uint8)
        self.tc, self.tokenizer = tc, tokenizer
        self.rng = random.Random(tc.seed)

    def fact_doc_limit(self, step: int) -> int:
        tc = self.tc
        limit = tc.fact_doc_bytes or tc.seq_len - 150
        if tc.curriculum_steps <= 0:
            return limit
        return round(limit * min(1.0, step / tc.curriculum_steps))

    def repeat_gap_limit(self, step: int) -> int:
        tc = self.tc
        if tc.repeat_gap_steps <= 0:
            return tc.repeat_gap
        return round(tc.repeat_gap * min(1.0, (step + 1) / tc.repeat_gap_steps))

    def repeat_row(self, step: int, n: int) -> list[int]:
        """n tokens of repeat units: OPEN string CLOSE, stdlib text, then OPEN string CLOSE again. Only copying
        predicts the second string, from wherever it was said: the lesson that in-context recall is built on."""
        rng, ids = self.rng, []
        while len(ids) < n:
            alphabet = REPEAT_DIGITS if rng.random() < 0.5 else REPEAT_ALPHABET
            unit = [REPEAT_OPEN] + [rng.choice(alphabet) for _ in range(rng.randint(6, 16))] + [REPEAT_CLOSE]
            gap = rng.randint(0, self.repeat_gap_limit(step))
            start = rng.randrange(0, len(self.text) - gap)
            ids += unit + list(self.text[start: start + gap]) + unit
        return ids[:n]

    def next(self, step: int = 0) -> tuple[Tensor, Tensor]:
        tc, rng = self.tc, self.rng
        rows, weights = [], []
        n = tc.seq_len + 1
        for _ in range(tc.batch_size):
            ids: list[int] = []
            weight = torch.ones(tc.seq_len)
            if step < tc.repeat_steps or (tc.repeat_share and rng.random() < tc.repeat_share):
                rows.append(torch.tensor(self.repeat_row(step, n), dtype=torch.long))
                weights.append(weight)
                continue
            if rng.random() < tc.task_fraction:
                while True:  # one exchange, or (pack_tasks) exchanges back to back until the row is full
                    if rng.random() < 1.0 - tc.copy_share:
                        exchange, answer_at = planted_fact_exchange(rng, self.text, self.tokenizer,
                                                                    self.fact_doc_limit(step), tc.max_distractors)
                    else:
                        exchange, answer_at = copy_exchange(rng, self.text, self.tokenizer, tc.random_copy_share)
                    start = len(ids)
                    ids = (ids + exchange)[:n]
                    weight[start + answer_at - 1: len(ids) - 1] = tc.answer_weight  # targets: the answer's tokens
                    if not tc.pack_tasks or len(ids) >= n:
                        break
            start = rng.randrange(0, len(self.data) - n)
            rest = self.data[start: start + n - len(ids)].long()
            rows.append(torch.cat([torch.tensor(ids, dtype=torch.long), rest]))
            weights.append(weight)
        return torch.stack(rows), torch.stack(weights)


# --------------------------------------------------------------------------- the training forward
class FakeQuantLinear(nn.Linear):
    """A routed expert's matrix during training: forward through its MXFP4 rounding, gradients straight through."""

    def on_grid_weight(self) -> Tensor:
        """The weight rounded to the MXFP4 grid in the forward, its gradient passed straight through."""
        w = self.weight
        packed, scale = mxfp4.quantize(w.detach())
        return w + (mxfp4.dequantize(packed, scale, w.dtype) - w).detach()

    def forward(self, x: Tensor) -> Tensor:
        return F.linear(x, self.on_grid_weight())


def _mla_attention(attn: MLAAttention, x: Tensor, B: int, T: int) -> Tensor:
    """The naive MLA form (MLAAttention.forward_naive) for B whole sequences of T tokens at once; x [B*T, D].
    The causal softmax runs in torch's fused attention kernel (scores never materialised), the shared k_pe
    channel broadcast to every head."""
    H, nope, r = attn.num_heads, attn.nope, attn.kv_rank
    q = attn._queries(x).view(B, T, H, -1).transpose(1, 2)  # [B, H, T, nope + rope]
    lat = attn.latents(x).view(B, T, -1)
    kv = attn.kv_b_proj(lat[..., :r]).float().view(B, T, H, nope + attn.v_dim).transpose(1, 2)
    k_pe = lat[..., r:].float().unsqueeze(1).expand(B, H, T, attn.rope)
    k = torch.cat([kv[..., :nope], k_pe], dim=-1)
    o = F.scaled_dot_product_attention(q, k, kv[..., nope:].contiguous(), is_causal=True, scale=attn.scale)
    return attn._output(o.transpose(1, 2).reshape(B * T, H * attn.v_dim), x)


def _effective_weight(linear: nn.Linear) -> Tensor:
    """The weight a routed expert's matrix multiplies by in training (through the MXFP4 grid when fake-quantised)."""
    return linear.on_grid_weight() if isinstance(linear, FakeQuantLinear) else linear.weight


def _moe_forward(moe: LatentMoE, x: Tensor) -> Tensor:
    """LatentMoE.forward for training: the routed experts run as three batched matmuls over their stacked
    weights, each expert on its own tokens (padded to the busiest expert's count), instead of one small matmul
    chain per expert. Same routing, weights and sums as `LatentMoE.expert_partial`."""
    ids, weights = moe.route(x)
    z = moe.down(x)
    N, k = ids.shape
    E, Lat = moe.config.num_experts, moe.config.latent_size
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=E)
    cap = int(counts.max())
    first = torch.cumsum(counts, 0) - counts  # where each expert's run starts in `order`
    expert_sorted = flat[order]
    slot = expert_sorted * cap + torch.arange(N * k, device=x.device) - first[expert_sorted]
    token_of = order // k
    packed = z.new_zeros(E * cap, Lat).index_copy(0, slot, z[token_of]).view(E, cap, Lat)
    w1, w3, w2 = (torch.stack([_effective_weight(getattr(ex, name)) for ex in moe.experts])
                  for name in ("w1", "w3", "w2"))
    act = situ_glu(torch.bmm(packed, w1.transpose(1, 2)), torch.bmm(packed, w3.transpose(1, 2)),
                   moe.config.situ_beta, moe.config.situ_linear_beta)
    out = torch.bmm(act.to(z.dtype), w2.transpose(1, 2)).view(E * cap, Lat)[slot]
    y = torch.zeros(N, Lat, dtype=torch.float32, device=x.device).index_add(
        0, token_of, out.float() * weights.reshape(-1)[order, None].float())
    return moe.finish(y, x)


def _kda_attention(attn: KDAAttention, x: Tensor, B: int, T: int) -> Tensor:
    window = x.new_zeros(B, 3, attn.proj_size, attn.kernel_size - 1, dtype=torch.float32)
    state = x.new_zeros(B, attn.num_heads, attn.head_dim, attn.head_dim, dtype=torch.float32)
    y, _, _ = attn._attend(x.view(B, T, -1), window, state, chunked=T >= CHUNKED_MIN_TOKENS)
    return y.reshape(B * T, -1)


def training_logits(model: KimiK3Model, ids: Tensor) -> Tensor:
    """ids [B, T] (each row a whole sequence from position 0) -> fp32 logits [B, T, V], differentiable.

    The same computation as KimiK3Model.forward (DecoderLayer.attend, the MLP, the head) outside inference
    mode, with the sequences batched in the attention kernels; tests/test_training.py checks they agree.
    """
    cfg = model.config
    B, T = ids.shape
    eps = cfg.rms_norm_eps
    partial = model.model.embed_tokens(ids.reshape(-1)).float()
    blocks: list[Tensor] = []
    for layer in model.layers:
        h = attn_res(partial, blocks, layer.self_attention_res_proj.weight, layer.self_attention_res_norm.weight,
                     eps) if blocks else partial
        if layer.layer_idx % cfg.attn_res_block_size == 0:
            blocks.append(partial)
            partial = None
        x = layer.input_layernorm(h).to(layer.compute_dtype)
        attend = _mla_attention if layer.is_mla else _kda_attention
        a = attend(layer.self_attn, x, B, T).float()
        partial = a if partial is None else partial + a
        h = attn_res(partial, blocks, layer.mlp_res_proj.weight, layer.mlp_res_norm.weight, eps)
        x = layer.post_attention_layernorm(h).to(layer.compute_dtype)
        partial = partial + (_moe_forward(layer.block_sparse_moe, x) if layer.is_moe else layer.mlp(x)).float()
    h = attn_res(partial, blocks, model.model.output_attn_res_proj.weight, model.model.output_attn_res_norm.weight, eps)
    return model.lm_head(model.model.norm(h).to(model.dtype)).float().view(B, T, -1)


def init_kda_decay(attn: KDAAttention, slowest: float, fastest: float) -> None:
    """Set dt_bias so that channel c of the layer decays by t_c nats a token when its gate input is zero,
    t_c geometric from `fastest` to `slowest` over the layer's channels, interleaved over the heads (each
    head holds slow and fast channels); inverts KDAAttention.log_decay for the layer's own A_log."""
    H, d = attn.num_heads, attn.head_dim
    t = torch.logspace(math.log10(fastest), math.log10(slowest), H * d, dtype=torch.float64)
    t = t.view(d, H).t()  # channel j of head h: rung j * H + h
    a = attn.A_log.detach().double().exp()[:, None]
    if attn.gate_lower_bound is None:  # -a softplus(z) = -t
        z = torch.log(torch.expm1(t / a))
    else:  # lb sigmoid(a z) = -t
        p = t / -attn.gate_lower_bound
        z = torch.log(p / (1 - p)) / a
    with torch.no_grad():
        attn.dt_bias.copy_(z.reshape(-1).to(attn.dt_bias.dtype))


def init_for_recall(model: KimiK3Model, embed_scale: float = RECALL_EMBED_SCALE) -> None:
    """An initialisation from which copying and in-context recall form within a few hundred steps (the model's
    own recipe plateaus for longer than the whole training budget: 0 of 25 answer probes after 900 steps).

    - Each KDA layer starts as an associative memory of "which token followed this one": the short convolutions
      start as one-tap filters (q and v read the current token, k the previous one) and k_proj starts equal to
      q_proj, so a query matches the keys written one token after the same token, and the value read back is the
      token that followed. This is mimetic initialisation (Trockman and Kolter, 2023: start W_q W_k^T near the
      identity) applied to the delta rule. The gate's low-rank input starts at zero, so each channel's decay is
      its dt_bias (set on a ladder by `init_kda_decay`) until training moves it.
    - Every branch that writes into the residual stream (attention o_proj, MLP and shared-expert down_proj, the
      LatentMoE up_proj) starts at zero, so the network starts as its embedding and lm_head and each branch grows
      only as far as it helps (with 13 layers of random branches mixed by the Attention Residuals, the signal of
      the first layers' memory drowns and no recall forms).
    - The embedding is scaled down (std `embed_scale`), so that what the branches add is not small beside it.
    Everything stays trainable; only the starting point changes.
    """
    with torch.no_grad():
        model.model.embed_tokens.weight.mul_(embed_scale)
        for name, param in model.named_parameters():
            if name.endswith(RESIDUAL_BRANCH_OUTPUTS):
                param.zero_()
        for module in model.modules():
            if isinstance(module, KDAAttention):
                for conv, lag in ((module.q_conv1d, 0), (module.k_conv1d, 1), (module.v_conv1d, 0)):
                    taps = conv.weight.shape[-1]
                    conv.weight.zero_()
                    conv.weight[:, 0, taps - 1 - lag] = 1.0
                module.k_proj.weight.copy_(module.q_proj.weight)
                module.f_b_proj.weight.zero_()


def make_trainable(release: ModelConfig, seed: int, fake_quant: bool,
                   decay_init: tuple[float, float] | None = None, recall_init: bool = False) -> KimiK3Model:
    """A float-expert copy of the architecture for training, initialised by the model's own recipe (and, with
    `recall_init`, moved to the starting point of `init_for_recall`)."""
    model = KimiK3Model(dataclasses.replace(release, mxfp4_experts=False), seed=seed)
    with torch.no_grad():  # start near uniform next-byte distributions (the random recipe aims at peaked ones)
        model.lm_head.weight.mul_(TRAIN_LM_HEAD_SCALE)
    if recall_init:
        init_for_recall(model)
    for module in model.modules():
        if isinstance(module, KDAAttention):
            module.differentiable_prefill = True
            if decay_init is not None:
                init_kda_decay(module, *decay_init)
        if fake_quant and isinstance(module, Expert):
            for name in ("w1", "w2", "w3"):
                old = getattr(module, name)
                new = FakeQuantLinear(old.in_features, old.out_features, bias=False)
                new.weight = old.weight
                setattr(module, name, new)
    return model


def release_state_dict(model: KimiK3Model) -> dict[str, Tensor]:
    """The trained model's state_dict with each routed expert matrix quantised to MXFP4 (packed, scale)."""
    out = {}
    for key, t in model.state_dict().items():
        if ".experts." in key and key.endswith(".weight"):
            packed, scale = mxfp4.quantize(t.float())
            base = key[: -len(".weight")]
            out[base + ".weight_packed"], out[base + ".weight_scale"] = packed, scale
        else:
            out[key] = t.detach().clone()
    return out


# --------------------------------------------------------------------------- evaluation
def heldout_windows(corpus: Corpus, n_bytes: int, seq_len: int) -> Tensor:
    """The first n_bytes of the held-out text as non-overlapping windows [N, seq_len]."""
    data = torch.frombuffer(bytearray(corpus.heldout[:n_bytes]), dtype=torch.uint8).long()
    n = data.numel() // seq_len
    return data[: n * seq_len].view(n, seq_len)


def bits_per_byte(model: KimiK3Model, windows: Tensor, batch: int = 32) -> float:
    """Mean next-byte cross-entropy in bits over positions 1..T-1 of each window, through the inference
    forward (prefill of each window from an empty cache)."""
    total, count = 0.0, 0
    for b0 in range(0, windows.shape[0], batch):
        rows = windows[b0: b0 + batch]
        logits = model.forward(list(rows), [model.new_cache() for _ in range(rows.shape[0])], all_logits=True)
        for row, lg in zip(rows, logits):
            nll = F.cross_entropy(lg[:-1].float(), row[1:], reduction="sum")
            total += float(nll)
            count += row.numel() - 1
    return total / count / LN2


def unigram_bits_per_byte(train: bytes, windows: Tensor) -> float:
    """Held-out bits per byte of a byte unigram fitted on the training text (add-one smoothing)."""
    counts = torch.bincount(torch.frombuffer(bytearray(train), dtype=torch.uint8).long(), minlength=256).double() + 1
    logp = (counts / counts.sum()).log()
    targets = windows[:, 1:].reshape(-1)
    return float(-logp[targets].mean()) / LN2


def load_model(ckpt_dir: str | Path, verify: bool = True) -> KimiK3Model:
    from inference.model.checkpoint import read_config
    model = KimiK3Model(read_config(ckpt_dir), random_init=False)
    load_checkpoint(model, ckpt_dir, verify=verify, progress=False)
    return model.eval()


def random_model(config: ModelConfig, seed: int = 0) -> KimiK3Model:
    """The seeded random checkpoint of `config` (what make_checkpoint writes), loaded into the model."""
    model = KimiK3Model(config, random_init=False)
    tensors = random_checkpoint_tensors(config, seed)
    with torch.no_grad():
        targets = model.state_dict(keep_vars=True)
        for name, t in tensors.items():
            key = name[len("language_model."):]
            target = targets[key]
            if key.endswith(".A_log"):
                t = t.reshape(-1)[: target.numel()]
            target.copy_(t.reshape(target.shape))
    return model.eval()


@torch.inference_mode()
def greedy_answer(model: KimiK3Model, prompt_ids: Sequence[int], max_new: int, stop_ids: Sequence[int]) -> list[int]:
    """Greedy continuation through the inference forward (prefill, then one token at a time)."""
    cache = model.new_cache()
    logits = model.forward([torch.tensor(list(prompt_ids))], [cache])[0]
    out: list[int] = []
    for _ in range(max_new):
        token = int(logits.argmax())
        if token in stop_ids:
            break
        out.append(token)
        logits = model.forward([torch.tensor([token])], [cache])[0]
    return out


# --------------------------------------------------------------------------- training
def _log(message: str) -> None:
    print(message, flush=True)


def _lr_at(step: int, tc: TrainConfig) -> float:
    if step < tc.warmup_steps:
        return tc.lr * (step + 1) / tc.warmup_steps
    progress = (step - tc.warmup_steps) / max(1, tc.steps - tc.warmup_steps)
    return tc.lr * (tc.min_lr_ratio + (1 - tc.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


def train_model(tc: TrainConfig, corpus: Corpus | None = None, log=_log) -> tuple[KimiK3Model, dict]:
    """Train in memory; returns the (float-expert) model and a record of the run."""
    torch.set_num_threads(tc.threads)
    torch.use_deterministic_algorithms(True)
    torch.manual_seed(tc.seed)
    corpus = corpus or stdlib_corpus(tc.stdlib_dir)
    release = tc.model_config()
    tokenizer = ByteTokenizer.from_config(release)
    model = make_trainable(release, tc.seed, tc.fake_quant, tc.kda_decay_init, tc.recall_init)
    model.train()
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        (decay if p.dim() >= 2 and "embed" not in name else no_decay).append(p)
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": tc.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}], lr=tc.lr, betas=(0.9, 0.95), eps=1e-8)
    loads: dict[int, Tensor] = {}

    def observe(layer_idx: int, ids: Tensor) -> None:
        loads[layer_idx] = torch.bincount(ids.reshape(-1), minlength=release.num_experts)

    model.routing_observer = observe
    batches = Batches(corpus, tc, tokenizer)
    start, losses = time.perf_counter(), []
    for step in range(tc.steps):
        for group in opt.param_groups:
            group["lr"] = _lr_at(step, tc)
        ids, weights = batches.next(step)
        logits = training_logits(model, ids[:, :-1])
        nll = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1), reduction="none")
        loss = nll.mean()
        weighted = loss if tc.answer_weight == 1.0 else (nll * weights.reshape(-1)).sum() / weights.sum()
        opt.zero_grad(set_to_none=True)
        weighted.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), tc.grad_clip)
        opt.step()
        with torch.no_grad():  # aux-loss-free balancing of the expert selection
            for layer in model.layers:
                if layer.is_moe and layer.layer_idx in loads:
                    load = loads[layer.layer_idx].float()
                    layer.block_sparse_moe.gate.e_score_correction_bias.add_(
                        tc.balance_rate * torch.sign(load.mean() - load))
        losses.append(float(loss.detach()))
        if log and (step % 10 == 0 or step == tc.steps - 1):
            log(f"step {step:5d}  loss {losses[-1]:.4f} ({losses[-1] / LN2:.3f} bits/token)  "
                f"{time.perf_counter() - start:6.1f} s")
    model.routing_observer = None
    record = {"train_seconds": round(time.perf_counter() - start, 1), "final_loss": losses[-1],
              "loss_first_50": sum(losses[:50]) / min(50, len(losses)),
              "loss_last_50": sum(losses[-50:]) / min(50, len(losses))}
    return model, record


def write_trained_checkpoint(model: KimiK3Model, release: ModelConfig, out_dir: str | Path) -> dict:
    tensors = state_dict_to_checkpoint_tensors(release_state_dict(model), release)
    return write_checkpoint(tensors, release, out_dir, overwrite=True)


def train(tc: TrainConfig, out_dir: str | Path, log=_log) -> dict:
    """Train, write the checkpoint to out_dir, measure held-out bits per byte; returns training_info.
    `log`: where progress lines go (None: nowhere)."""
    if log is None:
        log = lambda *_: None  # noqa: E731
    wall = time.perf_counter()
    corpus = stdlib_corpus(tc.stdlib_dir)
    log(f"stdlib text from {corpus.root}: {len(corpus.train):,} train bytes ({corpus.train_files} files), "
        f"{len(corpus.heldout):,} held-out bytes ({corpus.heldout_files} files), data {corpus.fingerprint}")
    model, record = train_model(tc, corpus, log)
    release = tc.model_config()
    manifest = write_trained_checkpoint(model, release, out_dir)
    windows = heldout_windows(corpus, tc.eval_bytes, tc.seq_len)
    model.eval()
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, KDAAttention):
                m.differentiable_prefill = False
        float_bpb = bits_per_byte(model, windows)
    shipped_bpb = bits_per_byte(load_model(out_dir), windows)
    info = {
        "train_config": dataclasses.asdict(tc),
        "python": sys.version.split()[0],
        "data": {"root": corpus.root, "fingerprint": corpus.fingerprint, "train_bytes": len(corpus.train),
                 "heldout_bytes": len(corpus.heldout), "train_files": corpus.train_files,
                 "heldout_files": corpus.heldout_files, "eval_bytes": int(windows.numel())},
        "torch": torch.__version__,
        **record,
        "heldout_bits_per_byte": {"trained_fp32_experts": round(float_bpb, 4), "checkpoint": round(shipped_bpb, 4),
                                  "unigram": round(unigram_bits_per_byte(corpus.train, windows), 4)},
        "fingerprint": manifest["fingerprint"],
        "wall_seconds": round(time.perf_counter() - wall, 1),
    }
    (Path(out_dir) / INFO_FILE).write_text(json.dumps(info, indent=1))
    return info


__all__ = ["TrainConfig", "Corpus", "stdlib_corpus", "train", "train_model", "training_logits", "make_trainable",
           "release_state_dict", "write_trained_checkpoint", "bits_per_byte", "unigram_bits_per_byte",
           "heldout_windows", "load_model", "random_model", "greedy_answer", "planted_fact_exchange",
           "FACT_TEMPLATE", "QUESTION_TEMPLATE"]
