"""Yuma Consensus: the epoch subtensor runs on a subnet at each tempo, in numpy for the devnet.

Follows subtensor's sparse epoch (`pallets/subtensor/src/epoch/run_epoch.rs` with `math.rs`, runtime spec
424, mid-2026) in the order docs/yuma.md lists it. Yuma 3, what new subnets run, is the default; the legacy
bonds and dividends are `YumaParams(version="legacy")`. Dense float64 matrices stand in for the chain's
sparse I32F32 ones (an absent entry is a zero); what reaches storage keeps the chain's u16 encodings:
weights rows max-upscaled by set_weights, Yuma 3 bonds as floor(65535 * B), legacy bonds column
max-upscaled.

Subtensor behaviours kept on purpose, beyond the step list of yuma.md:
- the subnet owner's self-weight survives the diagonal mask (`mask_diag_sparse_except_index`);
- liquid alpha applies only when some consensus is non-zero, and only to Yuma 3 (the legacy branch always
  uses the plain EMA rate);
- `rank` is stored normalised, as subtensor's Rank storage is (so it equals `incentive`).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import numpy as np

U16_MAX = 65535
YUMA_VERSIONS = ("yuma3", "legacy")


@dataclass(frozen=True)
class YumaParams:
    kappa: float = 32767 / 65535
    bonds_moving_average: int = 900_000  # alpha = 1 - bma/1e6
    bonds_penalty: float = 1.0  # beta
    liquid_alpha: bool = False
    alpha_low: float = 0.7
    alpha_high: float = 0.9
    alpha_steepness: float = 1000.0
    max_validators: int = 64  # K
    activity_cutoff: int = 5000
    stake_threshold: float = 0.0
    version: str = "yuma3"  # or "legacy"

    def __post_init__(self):
        if self.version not in YUMA_VERSIONS:
            raise ValueError(f"YumaParams.version must be one of {YUMA_VERSIONS}, got {self.version!r}")
        if not 0.0 <= self.kappa <= 1.0:
            raise ValueError(f"kappa must lie in [0, 1], got {self.kappa}")
        if not 0 <= self.bonds_moving_average <= 1_000_000:
            raise ValueError(f"bonds_moving_average must lie in [0, 1000000], got {self.bonds_moving_average}")
        if not 0.0 <= self.bonds_penalty <= 1.0:
            raise ValueError(f"bonds_penalty must lie in [0, 1], got {self.bonds_penalty}")
        if not 0.0 <= self.alpha_low <= self.alpha_high <= 1.0:
            raise ValueError(f"need 0 <= alpha_low <= alpha_high <= 1, got {self.alpha_low}, {self.alpha_high}")
        if self.max_validators < 0 or self.activity_cutoff < 0 or self.stake_threshold < 0:
            raise ValueError("max_validators, activity_cutoff and stake_threshold must be non-negative")

    @property
    def bonds_alpha(self) -> float:
        """EMA rate of bonds: 1 - bma/1e6, computed as (1e6 - bma)/1e6 so 900000 gives exactly 0.1."""
        return (1_000_000 - self.bonds_moving_average) / 1_000_000


@dataclass
class EpochInputs:
    block: int
    stake: np.ndarray  # [n] float64
    last_update: np.ndarray  # [n] int64
    block_at_registration: np.ndarray  # [n] int64
    validator_permit: np.ndarray  # [n] bool, as stored by the previous epoch
    weights: np.ndarray  # [n, n] uint16 rows as stored by set_weights (0 = absent or zero)
    bonds: np.ndarray  # [n, n] uint16 as stored
    registered_since_last_epoch: np.ndarray  # [n] bool: bonds to these uids are dropped (step 10)
    emission_budget: float  # E for this epoch
    subnet_owner_uid: int | None = None


@dataclass
class EpochResult:
    active: np.ndarray  # [n] bool
    stake: np.ndarray  # [n] S, normalised stake above the threshold
    active_stake: np.ndarray  # [n] A
    rank: np.ndarray  # [n] normalised R (subtensor's stored Rank; equals incentive)
    trust: np.ndarray  # [n] R_j / preR_j
    consensus: np.ndarray  # [n] c
    incentive: np.ndarray  # [n] I
    dividends: np.ndarray  # [n] D
    validator_trust: np.ndarray  # [n] VT
    emission: np.ndarray  # [n] stored Emission = E * normalize(I + D)
    miner_emission: np.ndarray  # [n] E * I / (sum I + sum D)
    validator_emission: np.ndarray  # [n] E * D / (sum I + sum D)
    validator_permit: np.ndarray  # [n] bool, P' for the next epoch
    bonds: np.ndarray  # [n, n] uint16 to store


# ---------------------------------------------------------------- vector and matrix normalisation
def normalize(x: np.ndarray) -> np.ndarray:
    """x / sum(x); a zero vector stays zero (subtensor's inplace_normalize)."""
    total = x.sum()
    return x / total if total > 0 else np.zeros_like(x, dtype=np.float64)


def row_normalize(m: np.ndarray) -> np.ndarray:
    sums = m.sum(axis=1, keepdims=True)
    return np.divide(m, sums, out=np.zeros_like(m, dtype=np.float64), where=sums > 0)


def col_normalize(m: np.ndarray) -> np.ndarray:
    sums = m.sum(axis=0, keepdims=True)
    return np.divide(m, sums, out=np.zeros_like(m, dtype=np.float64), where=sums > 0)


def col_max_upscale(m: np.ndarray) -> np.ndarray:
    maxes = m.max(axis=0, keepdims=True) if m.size else np.zeros((1, m.shape[1]))
    return np.divide(m, maxes, out=np.zeros_like(m, dtype=np.float64), where=maxes > 0)


def proportion_to_u16(x: np.ndarray) -> np.ndarray:
    """floor(65535 * x) for x in [0, 1]: subtensor's fixed_proportion_to_u16 truncates."""
    return np.floor(np.clip(x, 0.0, 1.0) * U16_MAX).astype(np.uint16)


# ---------------------------------------------------------------- the epoch, one function per step
def active_mask(last_update: np.ndarray, block: int, activity_cutoff: int) -> np.ndarray:
    """Step 1: a uid is inactive when last_update + cutoff < block."""
    return ~(last_update + activity_cutoff < block)


def stake_weights(stake: np.ndarray, stake_threshold: float) -> np.ndarray:
    """Step 2: S = normalize(stake * [stake >= threshold])."""
    return normalize(np.where(stake >= stake_threshold, stake, 0.0))


def top_k_permits(S: np.ndarray, k: int) -> np.ndarray:
    """Step 3 (end of epoch): P' = the top-k non-zero stakes.

    An ascending stable sort drops the first n - k uids, so on equal stake the lower uid loses; with
    n <= k every non-zero stake keeps a permit (subtensor's is_topk_nonzero).
    """
    permit = S > 0
    n = len(S)
    if n > k:
        ascending = np.argsort(S, kind="stable")
        permit[ascending[: n - k]] = False
    return permit


def active_validator_stake(S: np.ndarray, active: np.ndarray, permit: np.ndarray) -> np.ndarray:
    """Step 4: A = normalize(S * active * P)."""
    return normalize(S * active * permit)


def epoch_weights(
    weights_u16: np.ndarray,
    permit: np.ndarray,
    last_update: np.ndarray,
    block_at_registration: np.ndarray,
    subnet_owner_uid: int | None,
) -> np.ndarray:
    """Step 5: drop rows without P, the diagonal and weights older than the miner's registration; W."""
    W = weights_u16.astype(np.float64)
    W[~permit, :] = 0.0
    diagonal = np.arange(len(W))
    if subnet_owner_uid is not None:
        # subtensor keeps the owner's self-weight: the owner may point emission at itself.
        diagonal = diagonal[diagonal != subnet_owner_uid]
    W[diagonal, diagonal] = 0.0
    # Set at or before j's registration means the weight was meant for j's previous holder.
    outdated = last_update[:, None] <= block_at_registration[None, :]
    W[outdated] = 0.0
    return row_normalize(W)


def stake_weighted_consensus(W: np.ndarray, A: np.ndarray, kappa: float) -> np.ndarray:
    """Step 6: c_j = max{x in W[:, j] : sum(Sh_i for W_ij >= x) >= kappa}, over rows with A_i > 0.

    Sorting each column in descending order, the first position where the cumulative stake reaches kappa
    holds c_j: every larger value has less than kappa stake at or above it (weighted_median_col_sparse).
    """
    voters = A > 0
    n_cols = W.shape[1]
    if not voters.any():
        return np.zeros(n_cols)
    Sh = normalize(A[voters])
    Wv = W[voters]  # [v, n]
    order = np.argsort(-Wv, axis=0, kind="stable")
    descending = np.take_along_axis(Wv, order, axis=0)
    cumulative = np.cumsum(Sh[order], axis=0)
    reached = cumulative >= kappa
    # A rounding shortfall (kappa = 1 with stake summing to 1 - ulp) falls back to the smallest value.
    first = np.where(reached.any(axis=0), reached.argmax(axis=0), len(Sh) - 1)
    return descending[first, np.arange(n_cols)]


def clip_to_consensus(W: np.ndarray, consensus: np.ndarray) -> np.ndarray:
    """Step 7: Wc_ij = min(W_ij, c_j); a weight above a zero consensus is dropped (min gives 0)."""
    return np.minimum(W, consensus[None, :])


def bond_weights(W: np.ndarray, Wc: np.ndarray, beta: float) -> np.ndarray:
    """Step 9: Wb = W + beta (Wc - W); beta = 1 gives Wc, beta = 0 gives W."""
    if beta == 1.0:
        return Wc
    if beta == 0.0:
        return W
    return np.maximum(W + beta * (Wc - W), 0.0)


def liquid_alpha(Wb: np.ndarray, B0: np.ndarray, consensus: np.ndarray, params: YumaParams) -> np.ndarray:
    """Per-entry EMA rate of Yuma 3 liquid alpha (subtensor's alpha_sigmoid).

    The distance is how far a weight runs ahead of consensus when it buys (W >= B), or how far the bond
    exceeds the weight when it sells; a sigmoid of it, centred on 0.5 with slope steepness/100, moves
    alpha from alpha_low to alpha_high.
    """
    buy = np.clip(Wb - consensus[None, :], 0.0, 1.0)
    sell = np.clip(B0 - Wb, 0.0, 1.0)
    distance = np.where(Wb >= B0, buy, sell)
    slope = params.alpha_steepness / 100.0
    sigmoid = 0.5 * (1.0 + np.tanh(0.5 * slope * (distance - 0.5)))  # overflow-free logistic
    alpha = params.alpha_low + sigmoid * (params.alpha_high - params.alpha_low)
    return np.clip(alpha, params.alpha_low, params.alpha_high)


def yuma3_bonds(
    Wb: np.ndarray, B0: np.ndarray, consensus: np.ndarray, params: YumaParams
) -> np.ndarray:
    """Step 11, Yuma 3: B = alpha Wb + (1 - alpha) B0, bonds as proportions in [0, 1]."""
    if params.liquid_alpha and np.any(consensus != 0):
        alpha = liquid_alpha(Wb, B0, consensus, params)
        B = np.minimum((1.0 - alpha) * B0 + alpha * Wb, 1.0)
        # mat_ema_alpha_sparse emits only entries present in the new weights: the rest reset to 0.
        return np.where(Wb > 0, B, 0.0)
    alpha = params.bonds_alpha
    return alpha * Wb + (1.0 - alpha) * B0


def yuma3_dividends(B: np.ndarray, incentive: np.ndarray, A: np.ndarray) -> np.ndarray:
    """Step 12, Yuma 3: D = normalize(A_i * sum_j Bn_ij I_j), Bn = column-normalise(B)."""
    return normalize(A * (col_normalize(B) @ incentive))


def legacy_bonds(Wb: np.ndarray, B0_u16: np.ndarray, A: np.ndarray, params: YumaParams) -> np.ndarray:
    """Step 11, legacy: B = column-normalise(alpha dB + (1 - alpha) column-normalise(B0)), dB = Wb * A."""
    delta = col_normalize(Wb * A[:, None])
    alpha = params.bonds_alpha
    return col_normalize(alpha * delta + (1.0 - alpha) * col_normalize(B0_u16))


def split_emission(
    incentive: np.ndarray, dividends: np.ndarray, A: np.ndarray, budget: float
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Step 13: (stored emission, miner emission, validator emission) of the budget E.

    With no incentive and no dividends (no weights, all outdated, only self-weights) validators share E by
    active stake; with no active stake either nothing is emitted. Subtensor would fall back to S there.
    """
    total = incentive.sum() + dividends.sum()
    if total > 0:
        miner = budget * incentive / total
        validator = budget * dividends / total
    else:
        miner = np.zeros_like(incentive)
        validator = budget * A
    return miner + validator, miner, validator


def run_epoch(inputs: EpochInputs, params: YumaParams = YumaParams()) -> EpochResult:
    """One epoch of Yuma Consensus over the subnet's stored state; the caller stores the result."""
    x = _checked(inputs)
    n = len(x.stake)

    active = active_mask(x.last_update, x.block, params.activity_cutoff)  # 1
    S = stake_weights(x.stake, params.stake_threshold)  # 2
    P = x.validator_permit  # 3: this epoch uses the permits stored by the previous one,
    new_permit = top_k_permits(S, params.max_validators)  # and P' is stored for the next
    A = active_validator_stake(S, active, P)  # 4
    W = epoch_weights(x.weights, P, x.last_update, x.block_at_registration, x.subnet_owner_uid)  # 5

    consensus = stake_weighted_consensus(W, A, params.kappa)  # 6
    Wc = clip_to_consensus(W, consensus)  # 7
    validator_trust = Wc.sum(axis=1)

    pre_rank = W.T @ A  # 8
    R = Wc.T @ A
    # Trust as subtensor computes it (vecdiv(ranks, preranks)): the share of rank left after clipping.
    trust = np.divide(R, pre_rank, out=np.zeros(n), where=pre_rank > 0)
    incentive = normalize(R)

    Wb = bond_weights(W, Wc, params.bonds_penalty)  # 9
    stored_bonds = x.bonds.astype(np.float64)
    stored_bonds[:, x.registered_since_last_epoch] = 0.0  # 10

    if params.version == "yuma3":  # 11, 12
        B = yuma3_bonds(Wb, stored_bonds / U16_MAX, consensus, params)
        dividends = yuma3_dividends(B, incentive, A)
        bonds_u16 = proportion_to_u16(B)
    else:
        B = legacy_bonds(Wb, stored_bonds, A, params)
        dividends = normalize(B @ incentive)
        bonds_u16 = proportion_to_u16(col_max_upscale(B))
    bonds_u16[~new_permit, :] = 0  # rows losing (or never holding) a permit are cleared

    emission, miner_emission, validator_emission = split_emission(  # 13
        incentive, dividends, A, x.emission_budget
    )
    return EpochResult(
        active=active,
        stake=S,
        active_stake=A,
        rank=incentive.copy(),
        trust=trust,
        consensus=consensus,
        incentive=incentive,
        dividends=dividends,
        validator_trust=validator_trust,
        emission=emission,
        miner_emission=miner_emission,
        validator_emission=validator_emission,
        validator_permit=new_permit,
        bonds=bonds_u16,
    )


def _checked(inputs: EpochInputs) -> EpochInputs:
    """Arrays of the right dtype and shape, or a ValueError saying which field is wrong."""
    stake = np.asarray(inputs.stake, dtype=np.float64).reshape(-1)
    n = len(stake)
    if not np.all(np.isfinite(stake)) or np.any(stake < 0):
        raise ValueError("stake must be finite and non-negative")

    def vector(name: str, dtype) -> np.ndarray:
        v = np.asarray(getattr(inputs, name)).reshape(-1)
        if v.shape != (n,):
            raise ValueError(f"{name} has {v.size} entries; stake has {n}")
        return v.astype(dtype)

    def u16_matrix(name: str) -> np.ndarray:
        m = np.asarray(getattr(inputs, name))
        if m.size == 0 and n == 0:
            return np.zeros((0, 0), dtype=np.int64)
        if m.shape != (n, n):
            raise ValueError(f"{name} must be [{n}, {n}], got {list(m.shape)}")
        if not np.issubdtype(m.dtype, np.integer):
            raise ValueError(f"{name} must hold stored u16 integers, got dtype {m.dtype}")
        if m.size and (m.min() < 0 or m.max() > U16_MAX):
            raise ValueError(f"{name} entries must lie in [0, 65535]")
        return m.astype(np.int64)

    budget = float(inputs.emission_budget)
    if not math.isfinite(budget) or budget < 0:
        raise ValueError(f"emission_budget must be finite and non-negative, got {inputs.emission_budget}")
    owner = inputs.subnet_owner_uid
    if owner is not None and not 0 <= owner < n:
        raise ValueError(f"subnet_owner_uid {owner} is not a uid of this subnet (n = {n})")
    return EpochInputs(
        block=int(inputs.block),
        stake=stake,
        last_update=vector("last_update", np.int64),
        block_at_registration=vector("block_at_registration", np.int64),
        validator_permit=vector("validator_permit", bool),
        weights=u16_matrix("weights"),
        bonds=u16_matrix("bonds"),
        registered_since_last_epoch=vector("registered_since_last_epoch", bool),
        emission_budget=budget,
        subnet_owner_uid=owner,
    )


# ---------------------------------------------------------------- set-weights storage and pruning
def weights_to_u16(values: Sequence[float]) -> list[int]:
    """A weights row as set_weights stores it: round(v * 65535 / max(v)), ties away from zero."""
    v = np.asarray(values, dtype=np.float64)
    if v.ndim != 1 or v.size == 0:
        raise ValueError("weights must be a non-empty list of numbers")
    if not np.all(np.isfinite(v)):
        raise ValueError("weights must be finite numbers (no NaN or infinity)")
    if np.any(v < 0):
        raise ValueError("weights must be non-negative")
    top = v.max()
    if top == 0:
        raise ValueError("weights are all zero; give at least one positive weight")
    scaled = v * U16_MAX / top
    whole = np.floor(scaled)
    rounded = whole + (scaled - whole >= 0.5)  # half rounds up: away from zero, all values being >= 0
    return [int(w) for w in np.clip(rounded, 0, U16_MAX)]


def prune_candidate(
    emission: Sequence[float],
    registered_at: Sequence[int],
    immune: Sequence[bool],
    is_owner: Sequence[bool],
    min_non_immune: int,
) -> int | None:
    """The uid a registration on a full subnet replaces, or None when none may be replaced.

    The minimum of (Emission, registration block, uid) among non-immune uids, never the owner; only when
    more than `min_non_immune` uids are non-immune, otherwise the same minimum among immune uids.
    """
    emission = np.asarray(emission, dtype=np.float64)
    registered_at = np.asarray(registered_at, dtype=np.int64)
    immune = np.asarray(immune, dtype=bool)
    is_owner = np.asarray(is_owner, dtype=bool)
    n = len(emission)
    if not (len(registered_at) == len(immune) == len(is_owner) == n):
        raise ValueError("emission, registered_at, immune and is_owner must have one entry per uid")

    def lowest(candidates: np.ndarray) -> int | None:
        uids = np.flatnonzero(candidates)
        if len(uids) == 0:
            return None
        # lexsort sorts by the last key first: emission, then registration block, then uid.
        return int(uids[np.lexsort((uids, registered_at[uids], emission[uids]))[0]])

    non_immune = ~immune & ~is_owner
    if non_immune.sum() > min_non_immune:
        return lowest(non_immune)
    return lowest(immune & ~is_owner)
