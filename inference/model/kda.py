"""Kimi Delta Attention (docs/model.md section 2).

Two kernels with one contract (the same as fla-core's `naive_recurrent_kda`):

    kda_recurrent(q, k, v, g, beta, scale=None, initial_state=None) -> (o, final_state)
    kda_chunked(q, k, v, g, beta, scale=None, initial_state=None, chunk_size=64) -> (o, final_state)

    q, k [B, T, H, K]   used as given (the layer L2-normalises them); q is scaled by `scale` (K^-1/2) inside
    v    [B, T, H, V]
    g    [B, T, H, K]   log-decay per key channel (<= 0)
    beta [B, T, H]      delta-rule write strength
    initial_state / final_state [B, H, K, V]
    o    [B, T, H, V]

Both compute in fp32 (fp64 when q is fp64, which the tests use for a tight check) and return fp32
outputs; the caller casts. `kda_recurrent` is the per-token recurrence written as the spec states it:
it is the reference and the decode path. `kda_chunked` is the chunkwise-parallel prefill form and is
tested against it.

On a GPU the layer runs fla-core's Triton kernels instead (`fla_kda`: `chunk_kda` for prefill, the fused
recurrent kernel for decode) when fla is installed and the head size is one its kernels are made for; the two
above stay their oracles (tests/test_gpu.py compares them wherever CUDA is present). `KDAAttention.fast_kernels
= False` keeps a layer on the plain kernels everywhere.

`KDAAttention` is the full layer (projections, short convolutions, gates, kernel, gated output norm)
with an explicit per-sequence `KDALayerCache` whose size never depends on the sequence length.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from inference.model.config import ModelConfig

# Prefills at least this long use the chunked kernel; shorter ones (and decode) the recurrence. A chunk
# costs about as much as 16 to 32 recurrent steps, at the tiny size and at the full one alike.
CHUNKED_MIN_TOKENS = 32
# Log-decays below this are floored before exp (see `_decay`).
_MIN_EXPONENT = -30.0
# Values per [span, B*H, chunk, K] tensor in kda_chunked: bounds memory and keeps the span in cache.
_SPAN_ELEMENTS = 1 << 17
# eps inside the square root of the q/k L2 normalisation (model.md section 2, step 3).
_L2_EPS = 1e-6
# kda_chunked_autograd factors pair decays inside a chunk while they span at most this many nats.
_FACTOR_LIMIT = 60.0
# Head sizes fla's KDA kernels are built and tested for (K3's is 128); other sizes (the tiny model's 16) stay on
# the plain kernels.
FLA_HEAD_DIMS = (64, 128, 256)


# ---------------------------------------------------------------------------------------- kernels
def _check_kernel_inputs(q, k, v, g, beta, initial_state) -> tuple[int, int, int, int, int]:
    if q.dim() != 4:
        raise ValueError(f"q must be [B, T, H, K]; got shape {tuple(q.shape)}")
    B, T, H, K = q.shape
    V = v.shape[-1]
    expected = {
        "k": (k, (B, T, H, K)),
        "v": (v, (B, T, H, V)),
        "g": (g, (B, T, H, K)),
        "beta": (beta, (B, T, H)),
    }
    if initial_state is not None:
        expected["initial_state"] = (initial_state, (B, H, K, V))
    for name, (tensor, shape) in expected.items():
        if tuple(tensor.shape) != shape:
            raise ValueError(f"{name} must have shape {shape} to match q {tuple(q.shape)}; got {tuple(tensor.shape)}")
    return B, T, H, K, V


def _compute_dtype(q: torch.Tensor) -> torch.dtype:
    return torch.float64 if q.dtype == torch.float64 else torch.float32


def kda_recurrent(q, k, v, g, beta, scale=None, initial_state=None, step_states=None):
    """The KDA recurrence, one token at a time (model.md section 2, step 6). Returns (o, final_state).

    `step_states`, if a list, receives the state after each step ([B, H, K, V] each). Each step makes a new
    state tensor anyway, so keeping them costs memory, not copies (speculative rewind, see KDALayerCache).
    """
    B, T, H, K, V = _check_kernel_inputs(q, k, v, g, beta, initial_state)
    dtype = _compute_dtype(q)
    scale = K ** -0.5 if scale is None else scale
    q = q.to(dtype) * scale
    k, v, beta = k.to(dtype), v.to(dtype), beta.to(dtype)
    alpha = g.to(dtype).exp()  # every exponent is <= 0
    if initial_state is None:
        S = q.new_zeros(B, H, K, V)
    else:
        S = initial_state.to(dtype).clone()
    o = q.new_empty(B, T, H, V)
    for t in range(T):
        k_t = k[:, t]  # [B, H, K]
        S = S * alpha[:, t, :, :, None]  # decay the key channels
        pred = torch.einsum("bhk,bhkv->bhv", k_t, S)  # predict with the decayed state
        S = S + torch.einsum("bhk,bhv->bhkv", beta[:, t, :, None] * k_t, v[:, t] - pred)  # delta-rule write
        o[:, t] = torch.einsum("bhk,bhkv->bhv", q[:, t], S)  # read the updated state
        if step_states is not None:
            step_states.append(S)
    return o, S


def _decay(G_to: torch.Tensor, G_from: torch.Tensor) -> torch.Tensor:
    """exp(G_to - G_from), the decay from one position to a later one (exponent <= 0), floored at e^-30.

    A factor below e^-30 (1e-13) cannot show next to the O(1) terms it is summed with (the tests
    hold fp64 results to 1e-10), and flooring both factors of a split pair keeps their products far
    from the denormal range (below e^-87), where CPUs compute exp and products on a slow path, up to
    30 times slower.
    """
    return torch.sub(G_to, G_from).clamp_(min=_MIN_EXPONENT).exp_()


def _decayed_scores(X2, K, G, A2):
    """Fill A2[..., i, x, j] = sum_c X2[..., i, x, c] exp(G[..., i, c] - G[..., j, c]) K[..., j, c] for
    x = 0, 1 and j < i, and the diagonal A2[..., i, 0, i] = X2[..., i, 0, :] . K[..., i, :] (exp(0) = 1).

    X2: [..., C, 2, Kd], two row inputs side by side (queries and beta-scaled keys) so that each
    product below serves both; K, G: [..., C, Kd], C a power of two; A2: [..., C, 2, C] zero-filled.
    Entries above the diagonal stay zero.

    Only pairs i >= j are exponentiated, and every exponent is <= 0. Exponentiating each pair directly
    costs a [C, C, Kd] tensor, so the pairs are split by halving: in a block [lo, hi) with midpoint m,
    a pair in the lower-left quarter (i >= m > j) factors at m as exp(G_i - G_m) * exp(G_m - G_j),
    both exponents <= 0 (nothing overflows, and what underflows is negligible next to the terms it
    joins), which turns the quarter into one matrix product. The two diagonal quarters are the same
    problem at half the size, down to single pairs i = j.
    """
    *lead, C, Kd = K.shape
    A2[..., 0, :].diagonal(0, -2, -1).copy_((X2[..., 0, :] * K).sum(-1))
    L = C
    while L >= 2:
        nb, h = C // L, L // 2
        Gb, Kb = G.unflatten(-2, (nb, L)), K.unflatten(-2, (nb, L))  # [..., nb, L, Kd], views
        G_mid = Gb[..., h:h + 1, :]
        col = _decay(G_mid, Gb[..., :h, :]).mul_(Kb[..., :h, :])  # columns j < m, decayed up to m
        rows = X2.unflatten(-3, (nb, L))[..., h:, :, :]  # [..., nb, h, 2, Kd]: rows i >= m
        if h > 1:
            rows = rows * _decay(Gb[..., h:, :], G_mid).unsqueeze(-2)  # ... decayed back to m
        quarter = rows.reshape(*lead, nb, 2 * h, Kd) @ col.transpose(-1, -2)  # [..., nb, 2h, h]
        blocks = A2.view(*lead, nb, L, 2, nb, L).diagonal(0, -5, -2)  # [..., L, 2, L, nb]: diagonal blocks
        blocks[..., h:, :, :h, :].copy_(quarter.view(*lead, nb, h, 2, h).movedim(-4, -1))
        L = h


def kda_chunked(q, k, v, g, beta, scale=None, initial_state=None, chunk_size=64):
    """Chunkwise-parallel KDA (model.md section 2, "Chunkwise-parallel form"). Returns (o, final_state).

    Equal to `kda_recurrent` up to rounding. chunk_size must be a power of two. The work inside each
    chunk is vectorised over batch, heads and a span of chunks; only the state pass runs chunk by
    chunk. Spans hold about _SPAN_ELEMENTS values per [span, B*H, C, K] tensor, so memory stays
    bounded for any T and the working set stays in cache.
    """
    B, T, H, K, V = _check_kernel_inputs(q, k, v, g, beta, initial_state)
    if chunk_size < 1 or chunk_size & (chunk_size - 1):
        raise ValueError(f"chunk_size must be a power of two; got {chunk_size}")
    dtype = _compute_dtype(q)
    scale = K ** -0.5 if scale is None else scale
    if initial_state is None:
        S = torch.zeros(B * H, K, V, dtype=dtype, device=q.device)
    else:
        S = initial_state.to(dtype).reshape(B * H, K, V)
    o = torch.empty(B, T, H, V, dtype=dtype, device=q.device)
    span = chunk_size * max(1, _SPAN_ELEMENTS // (B * H * chunk_size * max(K, V)))
    for t0 in range(0, T, span):
        t = slice(t0, min(T, t0 + span))
        S = _kda_span(q[:, t], k[:, t], v[:, t], g[:, t], beta[:, t], scale, S, chunk_size, out=o[:, t])
    return o, S.reshape(B, H, K, V)


def _kda_span(q, k, v, g, beta, scale, S, C, out):
    """Chunked KDA over the tokens of one span, from state S [B*H, K, V]; writes `out`, returns the state."""
    B, T, H, K = k.shape
    V = v.shape[-1]
    dtype, device = S.dtype, S.device
    n = -(-T // C)
    pad = n * C - T
    lead = (n, B, H)
    batch = n * B * H

    def to_chunks(x):
        # [B, T, H, ...] -> [n, B, H, C, ...], a view of x where possible: never written to.
        # Padding rows have k = 0, beta = 0, g = 0: identity steps.
        x = x.to(dtype)
        if pad:
            x = F.pad(x, (0, 0) * (x.dim() - 2) + (0, pad))
        return x.unflatten(1, (n, C)).movedim(3, 2).transpose(0, 1)

    Kc, Vc = to_chunks(k), to_chunks(v)
    bc = to_chunks(beta).unsqueeze(-1)  # [n, B, H, C, 1]
    G = torch.empty(*lead, C, K, dtype=dtype, device=device)
    torch.cumsum(to_chunks(g), dim=-2, out=G)  # row i sums the log-decays of steps 0..i of its chunk
    X2 = torch.empty(*lead, C, 2, K, dtype=dtype, device=device)
    Q, K_beta = X2[..., 0, :], X2[..., 1, :]
    Q.copy_(to_chunks(q))  # the scale is applied to the output
    torch.mul(Kc, bc, out=K_beta)

    # Aqk[i, j] for j <= i, and N[i, j] = beta_i (K_i decayed K_j) for i > j, side by side.
    A2 = torch.zeros(*lead, C, 2, C, dtype=dtype, device=device)
    _decayed_scores(X2, Kc, G, A2)
    A_qk, N = A2[..., 0, :], A2[..., 1, :]
    # (I + N) [W | U] = diag(beta) [exp(G) K | V]: forward substitution on a unit lower triangular
    # matrix; the solver reads neither the diagonal nor the upper part of N. It is posed transposed,
    # [W | U]^T (I + N)^T = rhs^T, because that hands LAPACK both operands in its column-major layout.
    exp_G = G.clamp(min=_MIN_EXPONENT).exp_()  # the decay from the chunk start (see `_decay`)
    rhs = torch.empty(*lead, C, K + V, dtype=dtype, device=device)
    torch.mul(K_beta, exp_G, out=rhs[..., :K])
    torch.mul(Vc, bc, out=rhs[..., K:])
    WU = torch.linalg.solve_triangular(N.mT, rhs.mT, upper=True, left=False, unitriangular=True).mT
    W, U = WU[..., :K].reshape(n, B * H, C, K), WU[..., K:].reshape(n, B * H, C, V)

    # The state pass, chunk by chunk: Vn = U - W S, then S = exp(G_last) S + (exp(G_last - G) K)^T Vn.
    state_decay = exp_G[..., -1, :, None].reshape(n, B * H, K, 1)  # the decay over a whole chunk
    K_to_end_t = _decay(G[..., -1:, :], G).mul_(Kc).transpose(-1, -2).reshape(n, B * H, K, C)
    states = torch.empty(n + 1, B * H, K, V, dtype=dtype, device=device)  # states[c] enters chunk c
    states[0] = S
    V_new = torch.empty(n, B * H, C, V, dtype=dtype, device=device)
    for c in range(n):
        torch.baddbmm(U[c], W[c], states[c], alpha=-1, out=V_new[c])
        torch.baddbmm(state_decay[c] * states[c], K_to_end_t[c], V_new[c], out=states[c + 1])
    # O = Q exp(G) S + Aqk Vn, for all chunks of the span at once
    O = torch.baddbmm(
        torch.bmm(A_qk.reshape(batch, C, C), V_new.view(batch, C, V)),
        (Q * exp_G).reshape(batch, C, K),
        states[:n].view(batch, K, V),
    )
    torch.mul(O.view(*lead, C, V).permute(1, 0, 3, 2, 4).reshape(B, n * C, H, V)[:, :T], scale, out=out)
    return states[n]


def kda_chunked_autograd(q, k, v, g, beta, scale=None, initial_state=None, chunk_size=16):
    """Chunkwise-parallel KDA written out of place, so that autograd can differentiate it (training).

    Same contract and result as `kda_chunked` (up to rounding); the inference paths never call it. Inside a
    chunk the pair decays factor around the chunk's middle row m, exp(G_i - G_j) = exp(G_i - G_m) exp(G_m - G_j),
    which turns the pair sums into matrix products. That is safe only while every |G_i - G_m| stays far inside
    the fp32 range: with the K3 gate (log-decay >= -5 per step) and chunks of 16 it stays within 40. Larger
    spans (a stronger gate, a longer chunk) raise ValueError rather than overflow.
    """
    B, T, H, K, V = _check_kernel_inputs(q, k, v, g, beta, initial_state)
    if chunk_size < 1 or chunk_size & (chunk_size - 1):
        raise ValueError(f"chunk_size must be a power of two; got {chunk_size}")
    dtype = _compute_dtype(q)
    scale = K ** -0.5 if scale is None else scale
    C = chunk_size
    n = -(-T // C)
    pad = n * C - T

    def to_chunks(x):  # [B, T, H, ...] -> [B, H, n, C, ...]; padding rows are identity steps
        x = x.to(dtype)
        if pad:
            x = F.pad(x, (0, 0) * (x.dim() - 2) + (0, pad))
        return x.unflatten(1, (n, C)).movedim(3, 1)

    Q, Kc, Vc = to_chunks(q) * scale, to_chunks(k), to_chunks(v)
    bc = to_chunks(beta)[..., None]  # [B, H, n, C, 1]
    G = to_chunks(g).cumsum(-2)  # [B, H, n, C, K]: row i sums the log-decays of steps 0..i of its chunk
    rel = G - G[..., C // 2: C // 2 + 1, :]
    span = float(rel.detach().abs().max()) if rel.numel() else 0.0
    if span > _FACTOR_LIMIT:
        raise ValueError(f"kda_chunked_autograd: decays span {span:.0f} nats inside a chunk of {C} "
                         f"(limit {_FACTOR_LIMIT:.0f}); use a smaller chunk_size")
    up, down = rel.exp(), (-rel).exp()  # exp(G_i - G_m), exp(G_m - G_j)
    K_down = Kc * down
    lower = torch.ones(C, C, dtype=torch.bool, device=q.device).tril()  # j <= i
    A_qk = ((Q * up) @ K_down.transpose(-1, -2)).masked_fill(~lower, 0.0)
    N = ((Kc * bc * up) @ K_down.transpose(-1, -2)).masked_fill(~lower.tril(-1), 0.0)  # j < i
    eye = torch.eye(C, dtype=dtype, device=q.device)
    exp_G = G.exp()  # the decay from the chunk start (exponent <= 0)
    rhs = torch.cat([Kc * exp_G, Vc], dim=-1) * bc
    WU = torch.linalg.solve_triangular(eye + N, rhs, upper=False, unitriangular=True)
    W, U = WU[..., :K], WU[..., K:]
    K_to_end = (G[..., -1:, :] - G).exp() * Kc  # exp(G_last - G_j) K_j, exponent <= 0
    state_decay = exp_G[..., -1, :, None]  # [B, H, n, K, 1]
    Q_start = Q * exp_G
    S = (torch.zeros(B, H, K, V, dtype=dtype, device=q.device) if initial_state is None
         else initial_state.to(dtype).clone())  # a copy: the caller may update its cache in place
    outs = []
    for c in range(n):
        V_new = U[:, :, c] - W[:, :, c] @ S
        outs.append(Q_start[:, :, c] @ S + A_qk[:, :, c] @ V_new)
        S = state_decay[:, :, c] * S + K_to_end[:, :, c].transpose(-1, -2) @ V_new
    o = torch.stack(outs, dim=2).flatten(2, 3)[:, :, :T]  # [B, H, T, V]
    return o.transpose(1, 2), S


# ------------------------------------------------------------------------------ fla's Triton kernels
_FLA = {}


def fla_kernels():
    """fla-core's (chunk_kda, fused_recurrent_kda), or None when fla is not installed (imported on first use:
    only a GPU path asks, and the import takes seconds)."""
    if "kernels" not in _FLA:
        try:
            from fla.ops.kda import chunk_kda, fused_recurrent_kda  # noqa: PLC0415 (optional, GPU only)
            _FLA["kernels"] = (chunk_kda, fused_recurrent_kda)
        except ImportError:
            _FLA["kernels"] = None
    return _FLA["kernels"]


def fla_usable(q: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether `fla_kda` can take these inputs: on a CUDA device, fla installed, head sizes it is made for."""
    return q.is_cuda and q.shape[-1] in FLA_HEAD_DIMS and v.shape[-1] in FLA_HEAD_DIMS and fla_kernels() is not None


def fla_kda(q, k, v, g, beta, scale=None, initial_state=None, chunked: bool = True):
    """The `kda_recurrent` contract through fla's Triton kernels: `chunk_kda` (chunked) or `fused_recurrent_kda`.
    Inputs stay in fp32 (the layer computes them so) and the state is fp32, as fla requires; returns fp32 outputs.
    fla applies `scale` to q itself and takes g as the log-decay, as ours do (docs/model.md section 2)."""
    B, T, H, K, V = _check_kernel_inputs(q, k, v, g, beta, initial_state)
    chunk_kda, fused_recurrent_kda = fla_kernels()
    scale = K ** -0.5 if scale is None else scale
    if initial_state is None:
        initial_state = q.new_zeros(B, H, K, V, dtype=torch.float32)
    kernel = chunk_kda if chunked else fused_recurrent_kda
    args = [t.float().contiguous() for t in (q, k, v, g, beta)]
    o, state = kernel(*args, scale=scale, initial_state=initial_state.float().contiguous(), output_final_state=True)
    return o.float(), state


# ------------------------------------------------------------------------------------------ layer
REWIND_MODES = ("snapshot", "replay")


@dataclass
class KDARewindLog:
    """What a KDA layer keeps between `KDALayerCache.mark()` and the rewind, so that the cache can go back to
    any position since the mark (speculative decoding: drafted tokens the target model rejects).

    Both modes keep the state at the mark (one copy) and the conv input columns since the mark (the window
    after j positions is columns j .. j+kernel-2 of [window at mark | new columns]). For the recurrent state:
    - "snapshot": the state after every position (the recurrent kernel makes them anyway: memory, no copies);
    - "replay": the kernel inputs (q, k, v, g, beta) of every position; a rewind re-runs the recurrence over
      the kept positions from the state at the mark (time on rejection, memory of a few vectors per token).
    """

    mode: str
    start_state: torch.Tensor  # [H, d, d] at the mark
    conv_columns: list[torch.Tensor] = field(default_factory=list)  # [3, P, kernel-1] at the mark, then [3, P, T]...
    states: list[torch.Tensor] = field(default_factory=list)  # snapshot: [H, d, d] after each position
    kernel_inputs: list[tuple[torch.Tensor, ...]] = field(default_factory=list)  # replay: (q, k, v, g, beta) [T, ...]
    positions: int = 0  # positions seen since the mark


@dataclass
class KDALayerCache:
    """Decode cache of one KDA layer for one sequence; its size does not depend on the length."""

    conv: torch.Tensor  # [3, P, kernel-1] fp32: last inputs of the q, k, v convolutions, oldest first
    state: torch.Tensor  # [H, d, d] fp32: the recurrent state (key channels x value channels)
    rewind_log: KDARewindLog | None = None  # set between mark() and rewind()/unmark()

    @property
    def nbytes(self) -> int:
        return self.conv.nbytes + self.state.nbytes

    def clone(self) -> "KDALayerCache":
        """A copy of the state (without any rewind log)."""
        return KDALayerCache(conv=self.conv.clone(), state=self.state.clone())

    # ------------------------------------------------------------------ speculative rewind
    @torch.inference_mode()
    def mark(self, mode: str = "snapshot") -> None:
        """Start keeping what `rewind` needs to return to any position from here on."""
        if mode not in REWIND_MODES:
            raise ValueError(f"KDA rewind mode must be one of {REWIND_MODES}; got {mode!r}")
        self.rewind_log = KDARewindLog(mode, self.state.clone(), [self.conv.clone()])

    def unmark(self) -> None:
        self.rewind_log = None

    @property
    def rewind_nbytes(self) -> int:
        """Bytes the rewind log holds now."""
        log = self.rewind_log
        if log is None:
            return 0
        tensors = [log.start_state, *log.conv_columns, *log.states] + [t for ins in log.kernel_inputs for t in ins]
        return sum(t.numel() * t.element_size() for t in tensors)

    def _record(self, new_columns: torch.Tensor, states: list[torch.Tensor] | None, kernel_inputs: tuple) -> None:
        """Called by the layer after T new positions: new_columns [3, P, T]; states T x [H, d, d] (snapshot);
        kernel_inputs (q, k, v, g, beta) each [T, ...] (replay)."""
        log = self.rewind_log
        log.conv_columns.append(new_columns)
        if log.mode == "snapshot":
            log.states.extend(states)
        else:
            log.kernel_inputs.append(kernel_inputs)
        log.positions += new_columns.shape[-1]

    @torch.inference_mode()
    def rewind(self, keep: int) -> None:
        """Go back to `keep` positions after the mark, as if the later ones were never seen; ends the log."""
        log = self.rewind_log
        if log is None:
            raise ValueError("rewind needs a mark() first")
        if not 0 <= keep <= log.positions:
            raise ValueError(f"can rewind to 0..{log.positions} positions after the mark, not {keep}")
        if keep < log.positions:
            columns = torch.cat(log.conv_columns, dim=-1)
            self.conv.copy_(columns[..., keep: keep + self.conv.shape[-1]])
            if keep == 0:
                self.state.copy_(log.start_state)
            elif log.mode == "snapshot":
                self.state.copy_(log.states[keep - 1])
            else:
                q, k, v, g, beta = (torch.cat(parts)[:keep][None] for parts in zip(*log.kernel_inputs))
                _, state = kda_recurrent(q, k, v, g, beta, scale=q.shape[-1] ** -0.5,
                                         initial_state=log.start_state[None])
                self.state.copy_(state[0])
        self.rewind_log = None


def _l2_normalise(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt(x.square().sum(-1, keepdim=True) + _L2_EPS)


class KDAAttention(nn.Module):
    """One KDA layer (model.md section 2). Attribute names equal the checkpoint's `self_attn.*` names."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        D, H, d = config.hidden_size, config.kda_heads, config.kda_head_dim
        P, kernel = config.kda_proj_size, config.conv_kernel_size
        self.num_heads, self.head_dim, self.proj_size, self.kernel_size = H, d, P, kernel
        self.gate_lower_bound = config.gate_lower_bound

        self.q_proj = nn.Linear(D, P, bias=False)
        self.k_proj = nn.Linear(D, P, bias=False)
        self.v_proj = nn.Linear(D, P, bias=False)
        self.q_conv1d = nn.Conv1d(P, P, kernel, groups=P, bias=False)
        self.k_conv1d = nn.Conv1d(P, P, kernel, groups=P, bias=False)
        self.v_conv1d = nn.Conv1d(P, P, kernel, groups=P, bias=False)
        self.f_a_proj = nn.Linear(D, d, bias=False)
        self.f_b_proj = nn.Linear(d, P, bias=False)
        self.b_proj = nn.Linear(D, H, bias=False)
        # exp(A_log) in [1, 16] per head; dt_bias small per channel. The checkpoint overwrites both.
        self.A_log = nn.Parameter(torch.empty(H).uniform_(1.0, 16.0).log())
        self.dt_bias = nn.Parameter(0.1 * torch.randn(P))
        if config.full_rank_output_gate:
            self.g_proj = nn.Linear(D, P, bias=False)
        else:
            self.g_a_proj = nn.Linear(D, d, bias=False)
            self.g_b_proj = nn.Linear(d, P, bias=False)
        self.o_norm = nn.RMSNorm(d, eps=config.rms_norm_eps)
        self.o_proj = nn.Linear(P, D, bias=False)
        # Training only: prefill through kda_chunked_autograd, which autograd can differentiate.
        self.differentiable_prefill = False
        # On a GPU with fla installed: fla's Triton kernels (False: the plain kernels, their oracles, everywhere).
        self.fast_kernels = True

    # -------------------------------------------------------------------------------- cache
    def new_cache(self, device=None) -> KDALayerCache:
        device = self.A_log.device if device is None else device
        H, d, P = self.num_heads, self.head_dim, self.proj_size
        return KDALayerCache(
            conv=torch.zeros(3, P, self.kernel_size - 1, dtype=torch.float32, device=device),
            state=torch.zeros(H, d, d, dtype=torch.float32, device=device),
        )

    def _check_cache(self, cache: KDALayerCache) -> None:
        H, d, P = self.num_heads, self.head_dim, self.proj_size
        conv_shape, state_shape = (3, P, self.kernel_size - 1), (H, d, d)
        if tuple(cache.conv.shape) != conv_shape or tuple(cache.state.shape) != state_shape:
            raise ValueError(
                f"KDA cache has conv {tuple(cache.conv.shape)} and state {tuple(cache.state.shape)}; this layer "
                f"needs conv {conv_shape} and state {state_shape} (make it with new_cache())"
            )

    def _check_input(self, x: torch.Tensor, what: str) -> None:
        D = self.config.hidden_size
        if x.dim() != 2 or x.shape[-1] != D or x.shape[0] < 1:
            raise ValueError(f"KDAAttention expects {what} of shape [n >= 1, {D}]; got {tuple(x.shape)}")

    # ------------------------------------------------------------------------------ pieces
    def _short_conv(self, x: torch.Tensor, window: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Causal depthwise conv + SiLU of q, k, v, continuing from the cached window.

        x: [B, T, D]; window: [B, 3, P, kernel-1] fp32. Returns (q, k, v each [B, T, P] fp32, new window,
        the T new input columns [B, 3, P, T]).
        """
        B, T, _ = x.shape
        P = self.proj_size
        projected = torch.cat([self.q_proj(x), self.k_proj(x), self.v_proj(x)], dim=-1).float()  # [B, T, 3P]
        inputs = torch.cat([window.reshape(B, 3 * P, -1), projected.transpose(1, 2)], dim=-1)  # [B, 3P, k-1+T]
        weight = torch.cat([self.q_conv1d.weight, self.k_conv1d.weight, self.v_conv1d.weight]).float()
        out = F.silu(F.conv1d(inputs, weight, groups=3 * P)).transpose(1, 2)  # [B, T, 3P]
        new_window = inputs[..., inputs.shape[-1] - (self.kernel_size - 1):].reshape(B, 3, P, -1)
        q, k, v = out.split(P, dim=-1)
        return q, k, v, new_window, projected.transpose(1, 2).reshape(B, 3, P, T)

    def log_decay(self, g_raw: torch.Tensor) -> torch.Tensor:
        """log_alpha [..., H, d] fp32 from the gate input g_raw [..., H, d] (model.md section 2, step 4)."""
        H, d = self.num_heads, self.head_dim
        a = self.A_log.float().exp()[:, None]  # [H, 1]: one rate per head, over its d channels
        z = g_raw.float() + self.dt_bias.float().view(H, d)
        if self.gate_lower_bound is None:  # Kimi Linear
            return -a * F.softplus(z)
        return self.gate_lower_bound * torch.sigmoid(a * z)  # K3: in (lower bound, 0)

    def _output_gate(self, x: torch.Tensor) -> torch.Tensor:
        if self.config.full_rank_output_gate:
            return self.g_proj(x)
        return self.g_b_proj(self.g_a_proj(x))

    def _attend(self, x: torch.Tensor, window: torch.Tensor, state: torch.Tensor, chunked: bool,
                trace: dict | None = None):
        """x [B, T, D], window [B, 3, P, k-1], state [B, H, d, d] -> (y [B, T, D], window, state).

        `trace`, if a dict, receives what a rewind log needs: "columns" [B, 3, P, T] (new conv inputs),
        "kernel_inputs" (q, k, v, g, beta) and "states" (the state after each step; recurrent kernel only)."""
        B, T, _ = x.shape
        H, d = self.num_heads, self.head_dim
        q, k, v, window, columns = self._short_conv(x, window)
        q = _l2_normalise(q.view(B, T, H, d))
        k = _l2_normalise(k.view(B, T, H, d))
        v = v.view(B, T, H, d)
        g = self.log_decay(self.f_b_proj(self.f_a_proj(x)).view(B, T, H, d))
        beta = torch.sigmoid(self.b_proj(x).float())  # [B, T, H]
        if trace is None and self.fast_kernels and not self.differentiable_prefill and fla_usable(q, v):
            # every prefill through chunk_kda (no recurrence loop of launches), decode through the fused recurrence
            o, state = fla_kda(q, k, v, g, beta, scale=d ** -0.5, initial_state=state, chunked=T > 1)
        elif trace is None:
            kernel = kda_chunked if chunked else kda_recurrent
            if chunked and self.differentiable_prefill:  # training (inference.model.training) switches it on
                kernel = kda_chunked_autograd
            o, state = kernel(q, k, v, g, beta, scale=d ** -0.5, initial_state=state)  # o [B, T, H, d] fp32
        else:
            trace["states"] = []
            o, state = kda_recurrent(q, k, v, g, beta, scale=d ** -0.5, initial_state=state,
                                     step_states=trace["states"])
            trace["kernel_inputs"] = (q, k, v, g, beta)
            trace["columns"] = columns
        # o_norm by hand: in fp32 whatever dtype the module was cast to
        o = o * torch.rsqrt(o.square().mean(-1, keepdim=True) + self.o_norm.eps) * self.o_norm.weight.float()
        o = o * torch.sigmoid(self._output_gate(x).float().view(B, T, H, d))
        y = self.o_proj(o.reshape(B, T, H * d).to(x.dtype))
        return y, window, state

    # ------------------------------------------------------------------------------ forward
    def forward(self, x: torch.Tensor, cache: KDALayerCache) -> torch.Tensor:
        """x [T, D]: T >= 1 new tokens of one sequence after those in `cache`, which is updated in place.
        A marked cache (cache.mark()) also logs what a rewind needs; it always takes the recurrent kernel."""
        self._check_input(x, "x")
        self._check_cache(cache)
        trace = None if cache.rewind_log is None else {}
        chunked = x.shape[0] >= CHUNKED_MIN_TOKENS and trace is None
        y, window, state = self._attend(x[None], cache.conv[None], cache.state[None], chunked, trace)
        cache.conv.copy_(window[0])
        cache.state.copy_(state[0])
        if trace is not None:
            cache._record(trace["columns"][0], [s[0] for s in trace["states"]],
                          tuple(t[0] for t in trace["kernel_inputs"]))
        return y[0]

    def forward_batch_decode(self, x: torch.Tensor, caches: list[KDALayerCache]) -> torch.Tensor:
        """x [B, D]: one new token for each of B sequences, computed as one batch; updates each cache."""
        self._check_input(x, "x (one token per sequence)")
        if len(caches) != x.shape[0]:
            raise ValueError(f"forward_batch_decode got {x.shape[0]} tokens but {len(caches)} caches")
        for cache in caches:
            self._check_cache(cache)
        window = torch.stack([c.conv for c in caches])
        state = torch.stack([c.state for c in caches])
        trace = {} if any(c.rewind_log is not None for c in caches) else None
        y, window, state = self._attend(x[:, None], window, state, chunked=False, trace=trace)
        for b, cache in enumerate(caches):
            cache.conv.copy_(window[b])
            cache.state.copy_(state[b])
            if cache.rewind_log is not None:
                # clones: a view would keep the whole batch's tensors alive
                cache._record(trace["columns"][b].clone(), [s[b].clone() for s in trace["states"]],
                              tuple(t[b].clone() for t in trace["kernel_inputs"]))
        return y[:, 0]


__all__ = ["kda_recurrent", "kda_chunked", "kda_chunked_autograd", "KDALayerCache", "KDARewindLog", "REWIND_MODES",
           "KDAAttention", "CHUNKED_MIN_TOKENS", "FLA_HEAD_DIMS", "fla_kda", "fla_kernels", "fla_usable"]
