"""Yuma Consensus: the epoch subtensor runs on a subnet at each tempo, in numpy for the devnet.

Follows subtensor's sparse `epoch_mechanism` (`pallets/subtensor/src/epoch/run_epoch.rs` with `math.rs`,
opentensor/subtensor at commit 14bc6f9f964b9cc362e9635dd110a487fa5d15a0, 2026-06-30) step by step, in its
order; `tests/subtensor_vectors/` holds subtensor's own epoch unit tests, transcribed, and
tests/test_subtensor_vectors.py runs them through this module and through the devnet. Yuma 3, what new
subnets run, is the default; the legacy bonds and dividends are `YumaParams(version="legacy")`.

Sparse matrices with presence: a weights (or bonds) matrix is a dense float64 array of values plus a
boolean array saying which entries are stored. A stored zero is not an absent entry: it survives the
permit, self-weight, outdated-weight and clipping masks like any other entry, and in the bond EMA of
liquid alpha it decays the old bond, `B = (1 - alpha) * B_old`, where an absent entry resets it to 0
(`mat_ema_alpha_sparse`). `EpochInputs.weights` is either a dense u16 matrix (with `weights_present`, or
by default "present where non-zero") or sparse rows {uid: {target: u16}}, exactly as stored.

float64 stands in for subtensor's I32F32; where the fixed point changes the last digit of what is
stored, the result follows it: u16 storage truncates (`fixed_proportion_to_u16`), and emission shares
are truncated to 32 fractional bits before they multiply the budget (subtensor's 274999999 RAO where
floats give 275000000). Subtensor no longer computes Rank or Trust; `EpochResult.rank` and `.trust`
are zeros, as its getters return.
"""
from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from chain.weights import max_upscale_u16 as weights_to_u16  # noqa: F401 - kept under its old name

U16_MAX = 65535
YUMA_VERSIONS = ("yuma3", "legacy")
FIXED_ONE = 2.0 ** 32  # I32F32 has 32 fractional bits
NO_COMMIT = np.iinfo(np.int64).max


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


SparseRows = Mapping[int, Mapping[int, int]]


@dataclass
class EpochInputs:
    block: int
    stake: np.ndarray  # [n] float64
    last_update: np.ndarray  # [n] int64
    block_at_registration: np.ndarray  # [n] int64
    validator_permit: np.ndarray  # [n] bool, as stored by the previous epoch
    weights: np.ndarray | SparseRows  # [n, n] u16 rows as stored by set_weights, or sparse rows
    bonds: np.ndarray | SparseRows  # [n, n] u16 as stored (absent = 0), or sparse rows
    # Bonds to these uids are dropped (step 10). None: subtensor's rule from last_epoch_block and tempo.
    registered_since_last_epoch: np.ndarray | None = None
    emission_budget: float = 0.0  # E for this epoch
    subnet_owner_uid: int | None = None
    weights_present: np.ndarray | None = None  # [n, n] bool beside a dense `weights`; None: non-zero entries
    last_epoch_block: int | None = None  # the block of the subnet's previous epoch (0 or None: none yet)
    tempo: int = 0
    # Commit-reveal: per uid, the block of its earliest commit not yet expired (None or NO_COMMIT: none).
    commit_blocks: np.ndarray | None = None


@dataclass
class EpochResult:
    active: np.ndarray  # [n] bool
    stake: np.ndarray  # [n] S, normalised stake above the threshold
    active_stake: np.ndarray  # [n] A
    rank: np.ndarray  # [n] zeros: subtensor no longer computes Rank
    trust: np.ndarray  # [n] zeros: subtensor no longer computes Trust
    consensus: np.ndarray  # [n] c
    incentive: np.ndarray  # [n] I
    dividends: np.ndarray  # [n] D
    validator_trust: np.ndarray  # [n] VT
    emission: np.ndarray  # [n] stored Emission = E * normalize(I + D) (or the fallback)
    miner_emission: np.ndarray  # [n] E * I / (sum I + sum D)
    validator_emission: np.ndarray  # [n] E * D / (sum I + sum D) (or the fallback)
    validator_permit: np.ndarray  # [n] bool, P' for the next epoch
    bonds: np.ndarray  # [n, n] uint16 to store
    bonds_present: np.ndarray | None = None  # [n, n] bool: the stored bond entries (zeros included)


def u16_of(x: np.ndarray) -> np.ndarray:
    """What subtensor stores for a proportion in [0, 1]: floor(65535 * x) (fixed_proportion_to_u16)."""
    return np.floor(np.clip(np.asarray(x, dtype=np.float64), 0.0, 1.0) * U16_MAX).astype(np.int64)


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


def to_fixed(x: np.ndarray) -> np.ndarray:
    """x truncated to I32F32's 32 fractional bits (non-negative x)."""
    return np.floor(np.asarray(x, dtype=np.float64) * FIXED_ONE) / FIXED_ONE


# ---------------------------------------------------------------- the epoch, one function per step
def active_mask(last_update: np.ndarray, block: int, activity_cutoff: int) -> np.ndarray:
    """Step 1: a uid is inactive when last_update + cutoff < block."""
    return ~(last_update + activity_cutoff < block)


def stake_weights(stake: np.ndarray, stake_threshold: float, subnet_owner_uid: int | None = None) -> np.ndarray:
    """Step 2: S = normalize(stake * [stake >= threshold]); the subnet owner is exempt from the threshold."""
    kept = stake >= stake_threshold
    if subnet_owner_uid is not None and 0 <= subnet_owner_uid < len(stake):
        kept[subnet_owner_uid] = True
    return normalize(np.where(kept, stake, 0.0))


def top_k_permits(S: np.ndarray, k: int) -> np.ndarray:
    """Step 3 (end of epoch): P' = the top-k non-zero stakes.

    An ascending stable sort drops the first n - k uids, so on equal stake the lower uid loses; with
    n < k every non-zero stake keeps a permit (subtensor's is_topk_nonzero).
    """
    permit = S > 0
    n = len(S)
    if n >= k:
        ascending = np.argsort(S, kind="stable")
        permit[ascending[: n - k]] = False
    return permit


def with_owner_permit(permit: np.ndarray, subnet_owner_uid: int | None) -> np.ndarray:
    """The subnet owner's validator permit is forced on, for this epoch and the next."""
    permit = permit.copy()
    if subnet_owner_uid is not None and 0 <= subnet_owner_uid < len(permit):
        permit[subnet_owner_uid] = True
    return permit


def active_validator_stake(S: np.ndarray, active: np.ndarray, permit: np.ndarray) -> np.ndarray:
    """Step 4: A = normalize(S * active * P)."""
    return normalize(S * active * permit)


def weights_mask(
    present: np.ndarray,
    permit: np.ndarray,
    last_update: np.ndarray,
    block_at_registration: np.ndarray,
    subnet_owner_uid: int | None,
    commit_blocks: np.ndarray | None = None,
) -> np.ndarray:
    """Step 5, the masks on stored entries: rows without P, the diagonal (except the owner's
    self-weight), weights set at or before the target's registration (meant for its previous holder),
    and under commit-reveal, weights of a uid whose pending commit predates the target's registration."""
    kept = present & permit[:, None]
    diagonal = np.arange(len(kept))
    if subnet_owner_uid is not None:
        diagonal = diagonal[diagonal != subnet_owner_uid]
    kept[diagonal, diagonal] = False
    kept &= ~(last_update[:, None] <= block_at_registration[None, :])
    if commit_blocks is not None:
        kept &= ~(commit_blocks[:, None] < block_at_registration[None, :])
    return kept


def epoch_weights(
    weights_u16: np.ndarray,
    permit: np.ndarray,
    last_update: np.ndarray,
    block_at_registration: np.ndarray,
    subnet_owner_uid: int | None,
    present: np.ndarray | None = None,
    commit_blocks: np.ndarray | None = None,
) -> np.ndarray:
    """Step 5: W, the masked and row-normalised weights (absent entries are 0)."""
    values = np.asarray(weights_u16, dtype=np.float64)
    if present is None:
        present = values > 0
    kept = weights_mask(present, permit, last_update, block_at_registration, subnet_owner_uid, commit_blocks)
    return row_normalize(np.where(kept, values, 0.0))


def stake_weighted_consensus(W: np.ndarray, A: np.ndarray, kappa: float) -> np.ndarray:
    """Step 6: c_j = max{x in W[:, j] : sum(Sh_i for W_ij >= x) >= kappa}, over rows with A_i > 0.

    Subtensor's weighted_median_col_sparse returns the value x with stake(< x) <= 1 - kappa <
    stake(<= x); with stake summing to 1 that is the largest x with stake(>= x) >= kappa. Sorting each
    column in descending order, the first position where the cumulative stake reaches kappa holds it.
    Absent entries count as 0.
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


def clip_to_consensus(W: np.ndarray, consensus: np.ndarray, present: np.ndarray | None = None):
    """Step 7: Wc_ij = min(W_ij, c_j); an entry above a consensus <= 0 is dropped (col_clip_sparse).

    Returns Wc, or (Wc, its presence) when `present` is given."""
    c = consensus[None, :]
    Wc = np.minimum(W, c)
    if present is None:
        return Wc
    kept = present & ~((W > c) & (c <= 0))
    return np.where(kept, Wc, 0.0), kept


def bond_weights(W: np.ndarray, Wc: np.ndarray, beta: float, present=None, clipped_present=None):
    """Step 9: Wb = W + beta (Wc - W); beta = 1 gives Wc, beta = 0 gives W (interpolate_sparse).

    With presence arrays, returns (Wb, presence): W's or Wc's at the ends, else the entries > 0."""
    if beta == 1.0:
        Wb, kept = Wc, clipped_present
    elif beta == 0.0:
        Wb, kept = W, present
    else:
        Wb = W + beta * (Wc - W)
        kept = Wb > 0
        Wb = np.where(kept, Wb, 0.0)
    return Wb if present is None else (Wb, kept)


def liquid_alpha(Wb: np.ndarray, B0: np.ndarray, consensus: np.ndarray, params: YumaParams) -> np.ndarray:
    """Per-entry EMA rate of Yuma 3 liquid alpha (subtensor's alpha_sigmoid).

    The distance is how far a weight runs ahead of consensus when it buys (W >= B), or how far the bond
    exceeds the weight when it sells; a sigmoid of it, centred on 0.5 with slope steepness/100 (its
    exponent clamped to [-20, 20] as exp_safe does), moves alpha from alpha_low to alpha_high.
    """
    buy = np.clip(Wb - consensus[None, :], 0.0, 1.0)
    sell = np.clip(B0 - Wb, 0.0, 1.0)
    distance = np.where(Wb >= B0, buy, sell)
    exponent = np.clip(-(params.alpha_steepness / 100.0) * (distance - 0.5), -20.0, 20.0)
    sigmoid = 1.0 / (1.0 + np.exp(exponent))
    alpha = params.alpha_low + sigmoid * (params.alpha_high - params.alpha_low)
    return np.clip(alpha, params.alpha_low, params.alpha_high)


def yuma3_bonds(
    Wb: np.ndarray, B0: np.ndarray, consensus: np.ndarray, params: YumaParams, present: np.ndarray | None = None
) -> np.ndarray:
    """Step 11, Yuma 3: B = alpha Wb + (1 - alpha) B0, bonds as proportions in [0, 1].

    Liquid alpha (when some consensus is non-zero) updates only the entries present in Wb, explicit
    zeros included (they decay); absent entries reset to 0. The plain EMA updates every entry."""
    if present is None:
        present = Wb > 0
    if params.liquid_alpha and np.any(consensus != 0):
        alpha = liquid_alpha(Wb, B0, consensus, params)
        B = np.minimum((1.0 - alpha) * B0 + np.maximum(alpha * Wb, 0.0), 1.0)
        return np.where(present, B, 0.0)
    alpha = params.bonds_alpha
    return alpha * Wb + (1.0 - alpha) * B0


def yuma3_dividends(B: np.ndarray, incentive: np.ndarray, A: np.ndarray) -> np.ndarray:
    """Step 12, Yuma 3: D = normalize(A_i * sum_j Bn_ij I_j), Bn = column-normalise(B)."""
    return normalize(A * (col_normalize(B) @ incentive))


def fixed_col_normalize(m: np.ndarray) -> np.ndarray:
    """inplace_col_normalize_sparse in I32F32: each quotient truncated to 32 fractional bits."""
    sums = m.sum(axis=0, keepdims=True)
    return np.where(sums > 0, to_fixed(np.divide(m, sums, out=np.zeros_like(m, dtype=np.float64), where=sums > 0)), m)


def fixed_col_max_upscale(m: np.ndarray) -> np.ndarray:
    """inplace_col_max_upscale_sparse in I32F32 (quotients truncated)."""
    maxes = m.max(axis=0, keepdims=True) if m.size else np.zeros((1, m.shape[1]))
    return np.where(maxes > 0, to_fixed(np.divide(m, maxes, out=np.zeros_like(m, dtype=np.float64), where=maxes > 0)),
                    0.0)


def fixed_bonds_alpha(params: YumaParams) -> float:
    """compute_ema_bonds_normal's alpha: 1 - I32F32(I64F64(bma) / 1e6); 900000 gives 0.1 + 2^-32 / 2.5."""
    bma = math.floor(params.bonds_moving_average / 1_000_000 * 2.0 ** 64) / 2.0 ** 64
    return 1.0 - math.floor(bma * FIXED_ONE) / FIXED_ONE


def legacy_bonds(Wb: np.ndarray, B0_u16: np.ndarray, A: np.ndarray, params: YumaParams) -> np.ndarray:
    """Step 11, legacy: B = column-normalise(alpha dB + (1 - alpha) column-normalise(B0)), dB = Wb * A.

    Stored legacy bonds are re-normalised every epoch, so I32F32's truncations accumulate in them: each step
    truncates as subtensor's does, which keeps the stored u16 exact (test_bonds of epoch.rs)."""
    delta = fixed_col_normalize(to_fixed(Wb * A[:, None]))
    alpha = fixed_bonds_alpha(params)
    B0 = fixed_col_normalize(np.asarray(B0_u16, dtype=np.float64))
    return fixed_col_normalize(to_fixed(alpha * delta) + to_fixed((1.0 - alpha) * B0))


def split_emission(
    incentive: np.ndarray, dividends: np.ndarray, A: np.ndarray, budget: float, S: np.ndarray | None = None
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Step 13: (stored emission, miner emission, validator emission) of the budget E.

    With no incentive and no dividends (no weights, all outdated, only self-weights) validators share E by
    active stake A, or by stake S when no stake is active (subtensor's fallback). Shares are truncated to
    I32F32 before they multiply E.
    """
    total = incentive.sum() + dividends.sum()
    if total > 0:
        miner = incentive / total
        validator = dividends / total
        combined = normalize(incentive + dividends)
    else:
        miner = np.zeros_like(incentive)
        fallback = A if A.sum() > 0 or S is None else S
        validator = combined = fallback
    return budget * to_fixed(combined), budget * to_fixed(miner), budget * to_fixed(validator)


def bond_mask_columns(inputs: "EpochInputs") -> np.ndarray:
    """Step 10: the uids whose stored bonds are dropped. Subtensor drops bonds to uids registered at or
    after `last_tempo`, the block after the previous epoch (or block - tempo before any epoch)."""
    n = len(inputs.stake)
    if inputs.registered_since_last_epoch is not None:
        return np.asarray(inputs.registered_since_last_epoch, dtype=bool)
    if inputs.last_epoch_block is None and not inputs.tempo:
        return np.zeros(n, dtype=bool)
    if inputs.last_epoch_block:
        last_tempo = inputs.last_epoch_block + 1
    else:
        last_tempo = max(0, inputs.block - inputs.tempo)
    return last_tempo <= inputs.block_at_registration


def run_epoch(inputs: EpochInputs, params: YumaParams = YumaParams()) -> EpochResult:
    """One epoch of Yuma Consensus over the subnet's stored state; the caller stores the result."""
    x, weights_u16, present, bonds_u16_in = _checked(inputs)
    n = len(x.stake)
    owner = x.subnet_owner_uid

    active = active_mask(x.last_update, x.block, params.activity_cutoff)  # 1
    S = stake_weights(x.stake, params.stake_threshold, owner)  # 2
    P = with_owner_permit(x.validator_permit, owner)  # 3: the permits stored by the previous epoch,
    new_permit = with_owner_permit(top_k_permits(S, params.max_validators), owner)  # P' for the next
    A = active_validator_stake(S, active, P)  # 4

    commit_blocks = None if x.commit_blocks is None else np.asarray(x.commit_blocks, dtype=np.int64)
    kept = weights_mask(present, P, x.last_update, x.block_at_registration, owner, commit_blocks)  # 5
    W = row_normalize(np.where(kept, weights_u16.astype(np.float64), 0.0))

    consensus = stake_weighted_consensus(W, A, params.kappa)  # 6
    Wc, kept_c = clip_to_consensus(W, consensus, kept)  # 7
    validator_trust = Wc.sum(axis=1)

    incentive = normalize(Wc.T @ A)  # 8

    Wb, kept_b = bond_weights(W, Wc, params.bonds_penalty, kept, kept_c)  # 9
    stored_bonds = bonds_u16_in.astype(np.float64)
    stored_bonds[:, bond_mask_columns(x)] = 0.0  # 10

    if params.version == "yuma3":  # 11, 12
        B = yuma3_bonds(Wb, stored_bonds / U16_MAX, consensus, params, kept_b)
        dividends = yuma3_dividends(B, incentive, A)
        bonds_present = B > 0
        bonds_u16 = proportion_to_u16(B)
    else:
        B = legacy_bonds(Wb, stored_bonds, A, params)
        dividends = normalize(B @ incentive)
        bonds_present = B > 0
        bonds_u16 = proportion_to_u16(fixed_col_max_upscale(B))
    bonds_u16[~new_permit, :] = 0  # rows losing (or never holding) a permit are cleared
    bonds_present[~new_permit, :] = False

    emission, miner_emission, validator_emission = split_emission(  # 13
        incentive, dividends, A, x.emission_budget, S
    )
    return EpochResult(
        active=active,
        stake=S,
        active_stake=A,
        rank=np.zeros(n),
        trust=np.zeros(n),
        consensus=consensus,
        incentive=incentive,
        dividends=dividends,
        validator_trust=validator_trust,
        emission=emission,
        miner_emission=miner_emission,
        validator_emission=validator_emission,
        validator_permit=new_permit,
        bonds=bonds_u16,
        bonds_present=bonds_present,
    )


def sparse_to_dense(rows: SparseRows, n: int, name: str) -> tuple[np.ndarray, np.ndarray]:
    """Sparse rows {uid: {target: u16}} as (values [n, n] int64, present [n, n] bool); uids and
    targets >= n are ignored, as subtensor's get_weights_sparse filters them."""
    values = np.zeros((n, n), dtype=np.int64)
    present = np.zeros((n, n), dtype=bool)
    for uid, row in rows.items():
        if not 0 <= int(uid) < n:
            continue
        for target, value in row.items():
            if not 0 <= int(value) <= U16_MAX:
                raise ValueError(f"{name}[{uid}][{target}] = {value} is not a u16")
            if 0 <= int(target) < n:
                values[int(uid), int(target)] = int(value)
                present[int(uid), int(target)] = True
    return values, present


def _checked(inputs: EpochInputs) -> tuple[EpochInputs, np.ndarray, np.ndarray, np.ndarray]:
    """(inputs with arrays of the right dtype and shape, weights u16, weights presence, bonds u16), or a
    ValueError saying which field is wrong."""
    stake = np.asarray(inputs.stake, dtype=np.float64).reshape(-1)
    n = len(stake)
    if not np.all(np.isfinite(stake)) or np.any(stake < 0):
        raise ValueError("stake must be finite and non-negative")

    def vector(name: str, dtype, value=None) -> np.ndarray:
        v = np.asarray(getattr(inputs, name) if value is None else value).reshape(-1)
        if v.shape != (n,):
            raise ValueError(f"{name} has {v.size} entries; stake has {n}")
        return v.astype(dtype)

    def u16_matrix(name: str) -> tuple[np.ndarray, np.ndarray | None]:
        m = getattr(inputs, name)
        if isinstance(m, Mapping):
            return sparse_to_dense(m, n, name)
        m = np.asarray(m)
        if m.size == 0 and n == 0:
            return np.zeros((0, 0), dtype=np.int64), None
        if m.shape != (n, n):
            raise ValueError(f"{name} must be [{n}, {n}], got {list(m.shape)}")
        if not np.issubdtype(m.dtype, np.integer):
            raise ValueError(f"{name} must hold stored u16 integers, got dtype {m.dtype}")
        if m.size and (m.min() < 0 or m.max() > U16_MAX):
            raise ValueError(f"{name} entries must lie in [0, 65535]")
        return m.astype(np.int64), None

    weights, present = u16_matrix("weights")
    if present is None:
        if inputs.weights_present is not None:
            present = np.asarray(inputs.weights_present, dtype=bool)
            if present.shape != weights.shape:
                raise ValueError(f"weights_present must be [{n}, {n}], got {list(present.shape)}")
        else:
            present = weights > 0
    bonds, _ = u16_matrix("bonds")

    budget = float(inputs.emission_budget)
    if not math.isfinite(budget) or budget < 0:
        raise ValueError(f"emission_budget must be finite and non-negative, got {inputs.emission_budget}")
    owner = inputs.subnet_owner_uid
    if owner is not None and not 0 <= owner < n:
        raise ValueError(f"subnet_owner_uid {owner} is not a uid of this subnet (n = {n})")
    registered = inputs.registered_since_last_epoch
    commits = inputs.commit_blocks
    checked = EpochInputs(
        block=int(inputs.block),
        stake=stake,
        last_update=vector("last_update", np.int64),
        block_at_registration=vector("block_at_registration", np.int64),
        validator_permit=vector("validator_permit", bool),
        weights=weights,
        bonds=bonds,
        registered_since_last_epoch=None if registered is None else vector("registered_since_last_epoch", bool),
        emission_budget=budget,
        subnet_owner_uid=owner,
        last_epoch_block=inputs.last_epoch_block,
        tempo=int(inputs.tempo or 0),
        commit_blocks=None if commits is None else vector("commit_blocks", np.int64),
    )
    return checked, weights, present, bonds


# ---------------------------------------------------------------- set-weights storage and pruning
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
