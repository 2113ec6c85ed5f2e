"""State commitments: with every answer the engine commits, in one hash, to the residual state of every position
at every committed layer boundary, and keeps the states a while so that a validator can open any of them.

**What is committed** (docs/verification.md, "State commitments"). The engine stops at the layer boundaries
`commit_boundaries(config, layers)` (every `layers` layers, and the end of the last layer: the state entering the
head) and records, per position, the running partial sum of the residual state there, D fp32 values. That is
all the state that is new at a boundary: the block sums completed so far were partial sums at earlier boundaries
(`layers` divides the Attention Residuals block size, so every block start is a boundary), and the embedding is
the token's row of the embedding table. So the full state entering any boundary is rebuilt from the leaves of
that boundary and of the block starts below it (`state_entering`).

**The tree.** A leaf is sha256("k3-state-leaf/1", boundary, position, the D values as fp32 little-endian). Each
boundary has a binary Merkle tree over its positions (an odd node is carried up unchanged); the commitment root
is sha256 over the scheme, the number of positions, and (boundary, root of its tree) for every boundary in order.
The root goes into the answer's signature, so a miner cannot change it after the fact.

**Openings.** A validator names boundaries and positions (`StateAsk`); the engine answers with the rows at those
positions and one multiproof per boundary (the sibling hashes needed to rebuild the boundary's root from exactly
those leaves), plus the roots of every boundary (`opening`). `verify_opening` rebuilds every named boundary's
root from the opened rows and the commitment root from the boundary roots; any difference is a forged opening.

The states are kept (`CommittedStates`) for `retain_s` seconds and at most `max_bytes`, oldest first out.
Committing costs one stop per boundary in the forward, a copy of D values per position per boundary, and one
sha256 per leaf when the sequence finishes; with no commitment asked (`EngineSettings.commit_layers` 0) the
forward runs as before.
"""
from __future__ import annotations

import hashlib
import struct
import sys
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Mapping, Sequence

import torch
from torch import Tensor

from inference.model.config import ModelConfig
from inference.model.k3 import ResidualState

SCHEME = "k3-states/1"
LEAF_DOMAIN = b"k3-state-leaf/1\n"
NODE_DOMAIN = b"k3-state-node/1\n"
ROOT_DOMAIN = SCHEME.encode() + b"\n"
MAX_COMMIT_LAYERS = 4  # the default commitment block: the largest divisor of the AttnRes block size up to this


class OpeningError(ValueError):
    """An opening that cannot be made (unknown answer, positions outside it) or that does not verify."""


# ------------------------------------------------------------------ where states are committed
def default_commit_layers(config: ModelConfig) -> int:
    """Layers per committed block: the largest divisor of the Attention Residuals block size up to 4 (4 for
    Kimi K3, whose blocks are 12 layers: an opening re-runs 4 of 93 layers)."""
    size = config.attn_res_block_size
    return max(d for d in range(1, min(size, MAX_COMMIT_LAYERS) + 1) if size % d == 0)


def check_commit_layers(config: ModelConfig, layers: int) -> None:
    """ValueError unless `layers` divides the AttnRes block size (then every block start is a boundary, and the
    state entering any boundary is rebuilt from committed partial sums)."""
    if layers < 1 or config.attn_res_block_size % layers:
        raise ValueError(f"committed blocks of {layers} layers do not divide the Attention Residuals block size "
                         f"{config.attn_res_block_size}: give a divisor of it")


def commit_boundaries(config: ModelConfig, layers: int) -> tuple[int, ...]:
    """The layer boundaries committed to: every `layers` layers, then the state entering the head."""
    check_commit_layers(config, layers)
    inner = range(layers, config.num_layers, layers)
    return tuple(inner) + (config.num_layers,)


def block_starts_below(config: ModelConfig, boundary: int) -> list[int]:
    """The AttnRes block starts strictly below `boundary` and above 0: whose partial sums are the completed block
    sums (after the embedding) of the state entering `boundary`."""
    size = config.attn_res_block_size
    return list(range(size, boundary, size)) if boundary > 0 else []


def state_entering(config: ModelConfig, boundary: int, embedding: Tensor, partials: Mapping[int, Tensor]
                   ) -> ResidualState:
    """The residual state entering layer `boundary` (0 < boundary <= num_layers) of some positions: blocks are the
    embedding then the partial sums at the block starts below it, the partial the one at `boundary`. `partials`:
    boundary -> rows [n, D] of the same positions (the block starts below and the boundary itself)."""
    blocks = [embedding.float()] + [partials[b].float() for b in block_starts_below(config, boundary)]
    return ResidualState((int(embedding.shape[0]),), blocks, partials[boundary].float())


# ------------------------------------------------------------------ hashing
def leaf_bytes(row: Tensor) -> bytes:
    return row.detach().to(torch.float32).contiguous().numpy().tobytes()


def leaf_hash(boundary: int, position: int, data: bytes) -> bytes:
    return hashlib.sha256(LEAF_DOMAIN + struct.pack("<II", boundary, position) + data).digest()


def _node(left: bytes, right: bytes) -> bytes:
    return hashlib.sha256(NODE_DOMAIN + left + right).digest()


def merkle_levels(leaves: Sequence[bytes]) -> list[list[bytes]]:
    """Every level of the tree over `leaves`, leaves first, root last (an odd node is carried up unchanged)."""
    if not leaves:
        raise ValueError("a Merkle tree needs at least one leaf")
    levels = [list(leaves)]
    while len(levels[-1]) > 1:
        level = levels[-1]
        levels.append([_node(level[i], level[i + 1]) if i + 1 < len(level) else level[i]
                       for i in range(0, len(level), 2)])
    return levels


def multiproof(levels: list[list[bytes]], indices: Sequence[int]) -> list[bytes]:
    """The sibling hashes that, with the leaves at `indices`, rebuild the root: level by level, in index order,
    each sibling not itself known."""
    known = sorted(set(indices))
    proof = []
    for level in levels[:-1]:
        have = set(known)
        for i in known:
            sibling = i ^ 1
            if sibling < len(level) and sibling not in have:
                proof.append(level[sibling])
                have.add(sibling)
        known = sorted({i // 2 for i in known})
    return proof


def root_from_multiproof(count: int, leaves: Mapping[int, bytes], proof: Sequence[bytes]) -> bytes:
    """The root of a tree of `count` leaves, from some leaves (index -> hash) and their multiproof; OpeningError
    when the proof has too few or too many hashes."""
    if not leaves or count < 1 or any(not 0 <= i < count for i in leaves):
        raise OpeningError(f"leaves {sorted(leaves)[:5]} are not inside a tree of {count}")
    nodes, width, used = dict(leaves), count, 0
    while width > 1:
        for i in sorted(nodes):
            sibling = i ^ 1
            if sibling < width and sibling not in nodes:
                if used >= len(proof):
                    raise OpeningError("the proof ends before the root")
                nodes[sibling] = proof[used]
                used += 1
        parents = {}
        for i in sorted(nodes):
            p = i // 2
            if p in parents:
                continue
            left, right = nodes.get(2 * p), nodes.get(2 * p + 1)
            parents[p] = _node(left, right) if 2 * p + 1 < width else left
        nodes, width = parents, (width + 1) // 2
    if used != len(proof):
        raise OpeningError(f"the proof holds {len(proof) - used} hashes more than the root needs")
    return nodes[0]


def commitment_root(positions: int, boundary_roots: Mapping[int, bytes]) -> bytes:
    h = hashlib.sha256(ROOT_DOMAIN + struct.pack("<II", positions, len(boundary_roots)))
    for boundary in sorted(boundary_roots):
        h.update(struct.pack("<I", boundary) + boundary_roots[boundary])
    return h.digest()


# ------------------------------------------------------------------ what the engine records and keeps
@dataclass(frozen=True)
class StateCommitment:
    """What an answer commits to: `root` (hex) over `positions` positions at `boundaries`."""

    root: str
    positions: int
    boundaries: tuple[int, ...]
    scheme: str = SCHEME


class StateLog:
    """The partial sums of one sequence at `boundaries`, position by position, as its forwards ran (a forward
    that starts before the end, after a rewind, replaces what it covers)."""

    def __init__(self, boundaries: Sequence[int]):
        self.boundaries = tuple(boundaries)
        self._rows: dict[int, list[Tensor]] = {b: [] for b in self.boundaries}
        self._ends: dict[int, int] = {b: 0 for b in self.boundaries}

    def record(self, boundary: int, start: int, rows: Tensor) -> None:
        chunks, end = self._rows[boundary], self._ends[boundary]
        if start > end:
            raise ValueError(f"state rows at boundary {boundary} start at {start}, after the {end} recorded")
        while end > start:  # a rewound sequence: drop what it ran past `start`
            last = chunks[-1]
            keep = max(0, last.shape[0] - (end - start))
            end -= last.shape[0] - keep
            if keep:
                chunks[-1] = last[:keep]
            else:
                chunks.pop()
        chunks.append(rows.detach().to(torch.float32).clone())
        self._ends[boundary] = start + int(rows.shape[0])

    def rows(self, boundary: int, positions: int) -> Tensor:
        """[positions, D]: the first `positions` rows at `boundary`."""
        if self._ends[boundary] < positions:
            raise ValueError(f"boundary {boundary} holds {self._ends[boundary]} positions, not {positions}")
        return torch.cat(self._rows[boundary])[:positions]


HASH_HELD_BYTES = sys.getsizeof(bytes(32)) + 8  # one 32-byte hash in a tree: the bytes object and its list slot


@dataclass
class CommittedAnswer:
    """One answer's states and trees, kept for openings."""

    commitment: StateCommitment
    rows: dict[int, Tensor]  # boundary -> [positions, D] fp32
    levels: dict[int, list[list[bytes]]]  # boundary -> its tree
    owner: str = ""  # who may open it (the caller who asked for the answer; "" anyone)
    kept_at: float = field(default_factory=time.monotonic)

    @property
    def nbytes(self) -> int:
        """The memory it holds: its rows, and each tree's hashes as Python holds them (object and list slot)."""
        return sum(r.numel() * 4 for r in self.rows.values()) + sum(HASH_HELD_BYTES * sum(len(lv) for lv in levels)
                                                                     for levels in self.levels.values())


def commit(log: StateLog, positions: int) -> tuple[StateCommitment, dict[int, Tensor], dict[int, list[list[bytes]]]]:
    """The commitment over the first `positions` positions of a sequence's log (its trees and rows with it)."""
    rows, levels, roots = {}, {}, {}
    for b in log.boundaries:
        rows[b] = log.rows(b, positions)
        levels[b] = merkle_levels([leaf_hash(b, t, leaf_bytes(rows[b][t])) for t in range(positions)])
        roots[b] = levels[b][-1][0]
    root = commitment_root(positions, roots).hex()
    return StateCommitment(root, positions, log.boundaries), rows, levels


@dataclass(frozen=True)
class StateAsk:
    """Open `positions` (sorted, distinct) at `boundary`."""

    boundary: int
    positions: tuple[int, ...]


@dataclass
class OpenedRows:
    boundary: int
    positions: tuple[int, ...]
    rows: Tensor  # [len(positions), D] fp32
    proof: list[bytes]


@dataclass
class Opening:
    """What an engine answers an opening with."""

    root: str
    positions: int
    boundary_roots: dict[int, bytes]
    opened: list[OpenedRows]


class CommittedStates:
    """The answers' states an engine keeps for openings, bounded in age and bytes (oldest first out)."""

    def __init__(self, retain_s: float = 900.0, max_bytes: int = 1 << 30):
        self.retain_s = retain_s
        self.max_bytes = max_bytes
        self._answers: OrderedDict[str, CommittedAnswer] = OrderedDict()
        self.nbytes = 0
        self.dropped = 0  # answers forgotten before retain_s for want of room
        self._lock = threading.Lock()

    def keep(self, request_id: str, answer: CommittedAnswer) -> None:
        with self._lock:
            self._forget(request_id)
            self._answers[request_id] = answer
            self.nbytes += answer.nbytes
            self._bound()

    def open(self, request_id: str, root: str, asks: Sequence[StateAsk], caller: str = "") -> Opening:
        """The rows and multiproofs of `asks` for the answer `request_id` with commitment `root`; OpeningError when
        it is not (or no longer) kept, is another caller's, or an ask lies outside it."""
        with self._lock:
            self._expire()
            answer = self._answers.get(request_id)
        if answer is None or answer.commitment.root != root:
            raise OpeningError(f"no answer {request_id!r} with commitment {root[:16]}... is kept (retained "
                               f"{self.retain_s:g} s)")
        if answer.owner and caller and answer.owner != caller:
            raise OpeningError(f"answer {request_id!r} was given to another caller")
        c = answer.commitment
        opened = []
        for ask in asks:
            if ask.boundary not in answer.rows:
                raise OpeningError(f"boundary {ask.boundary} is not committed (boundaries {list(c.boundaries)})")
            if not ask.positions or list(ask.positions) != sorted(set(ask.positions)) \
                    or not 0 <= ask.positions[0] <= ask.positions[-1] < c.positions:
                raise OpeningError(f"positions at boundary {ask.boundary} must be distinct, sorted and inside "
                                   f"0..{c.positions - 1}")
            index = torch.as_tensor(ask.positions, dtype=torch.long)
            opened.append(OpenedRows(ask.boundary, tuple(ask.positions), answer.rows[ask.boundary][index],
                                     multiproof(answer.levels[ask.boundary], ask.positions)))
        roots = {b: levels[-1][0] for b, levels in answer.levels.items()}
        return Opening(c.root, c.positions, roots, opened)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._answers

    def _forget(self, request_id: str) -> None:
        old = self._answers.pop(request_id, None)
        if old is not None:
            self.nbytes -= old.nbytes

    def _expire(self) -> None:
        cutoff = time.monotonic() - self.retain_s
        while self._answers:
            request_id, answer = next(iter(self._answers.items()))
            if answer.kept_at >= cutoff:
                break
            self._forget(request_id)

    def _bound(self) -> None:
        self._expire()
        while self.nbytes > self.max_bytes and len(self._answers) > 1:
            self._forget(next(iter(self._answers)))
            self.dropped += 1


# ------------------------------------------------------------------ the validator's side
def verify_opening(commitment: StateCommitment, opening: Opening, asks: Sequence[StateAsk], hidden_size: int
                   ) -> dict[int, dict[int, Tensor]]:
    """Check that `opening` answers exactly `asks` and chains to `commitment`: every opened row hashes into its
    boundary's root through its multiproof, and the boundary roots give the commitment root. Returns boundary ->
    position -> row [D]; OpeningError saying what does not chain."""
    if opening.root != commitment.root or opening.positions != commitment.positions:
        raise OpeningError("the opening is for another commitment than the answer's")
    if sorted(opening.boundary_roots) != sorted(commitment.boundaries):
        raise OpeningError(f"the opening names boundaries {sorted(opening.boundary_roots)}, the commitment "
                           f"{sorted(commitment.boundaries)}")
    if commitment_root(commitment.positions, opening.boundary_roots).hex() != commitment.root:
        raise OpeningError("the boundary roots do not hash to the committed root")
    wanted = {(a.boundary, a.positions) for a in asks}
    if {(o.boundary, tuple(o.positions)) for o in opening.opened} != wanted or len(opening.opened) != len(asks):
        raise OpeningError("the opening does not hold exactly the boundaries and positions asked")
    out: dict[int, dict[int, Tensor]] = {}
    for o in opening.opened:
        if tuple(o.rows.shape) != (len(o.positions), hidden_size) or not bool(torch.isfinite(o.rows).all()):
            raise OpeningError(f"boundary {o.boundary}: rows of shape {list(o.rows.shape)} (finite values "
                               f"[{len(o.positions)}, {hidden_size}] asked)")
        leaves = {t: leaf_hash(o.boundary, t, leaf_bytes(o.rows[j])) for j, t in enumerate(o.positions)}
        root = root_from_multiproof(commitment.positions, leaves, o.proof)
        if root != opening.boundary_roots[o.boundary]:
            raise OpeningError(f"the rows opened at boundary {o.boundary} do not chain to its committed root")
        out.setdefault(o.boundary, {}).update({t: o.rows[j] for j, t in enumerate(o.positions)})
    return out


__all__ = ["SCHEME", "CommittedAnswer", "CommittedStates", "Opening", "OpenedRows", "OpeningError", "StateAsk",
           "StateCommitment", "StateLog", "block_starts_below", "check_commit_layers", "commit", "commit_boundaries",
           "commitment_root", "default_commit_layers", "leaf_bytes", "leaf_hash", "merkle_levels", "multiproof",
           "root_from_multiproof", "state_entering", "verify_opening"]
