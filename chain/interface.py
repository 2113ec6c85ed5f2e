"""The one chain interface the neurons and scripts use.

Two implementations: `SubtensorChain` (bittensor SDK 11, a real node) and
`DevnetChain` (embedded, SQLite). Neurons never import the SDK; they hold a
`Chain` and react to the typed errors below.
"""
from __future__ import annotations

import abc
from dataclasses import dataclass, field


# ---------------------------------------------------------------- errors
class ChainError(Exception):
    """A chain operation failed. `name` is subtensor's error name when there is one."""

    name: str = "ChainError"
    transient: bool = False

    def __init__(self, message: str, name: str | None = None):
        super().__init__(message)
        if name:
            self.name = name


class NotRegistered(ChainError):
    """The hotkey has no uid on the subnet (subtensor: HotKeyNotRegisteredInSubNet)."""

    name = "HotKeyNotRegisteredInSubNet"


class AlreadyRegistered(ChainError):
    name = "HotKeyAlreadyRegisteredInSubNet"


class RateLimited(ChainError):
    """Too soon: SettingWeightsTooFast, CommittingWeightsTooFast, ServingRateLimitExceeded, registration
    limits. `retry_after_blocks` is how many blocks the chain said to wait, when it said (else None)."""

    name = "SettingWeightsTooFast"
    transient = True

    def __init__(self, message: str, name: str | None = None, retry_after_blocks: int | None = None):
        super().__init__(message, name)
        self.retry_after_blocks = retry_after_blocks


class NoValidatorPermit(ChainError):
    name = "NeuronNoValidatorPermit"


class NotEnoughStake(ChainError):
    name = "NotEnoughStakeToSetWeights"


class InvalidWeights(ChainError):
    """Too few weights, out-of-range uids, a max-weight violation, a stale version key."""

    name = "InvalidWeights"


class SubnetNotFound(ChainError):
    name = "SubnetNotExists"


class RegistrationFailed(ChainError):
    """The subnet is full and nothing can be pruned, or the burn could not be paid."""

    name = "RegistrationFailed"


class ChainConnectionError(ChainError):
    """The node (or the devnet's database) cannot be reached; retry later."""

    name = "ConnectionError"
    transient = True


# ---------------------------------------------------------------- data
@dataclass(frozen=True)
class Endpoint:
    ip: str
    port: int
    protocol: int = 4
    version: int = 1

    @property
    def url(self) -> str:
        host = f"[{self.ip}]" if ":" in self.ip else self.ip
        return f"http://{host}:{self.port}"


@dataclass(frozen=True)
class NeuronInfo:
    uid: int
    hotkey: str
    coldkey: str
    stake: float  # subnet stake in alpha units (float); weights of consensus follow it
    validator_permit: bool
    endpoint: Endpoint | None
    last_update: int
    block_at_registration: int
    incentive: float = 0.0
    dividends: float = 0.0
    emission: float = 0.0
    rank: float = 0.0
    trust: float = 0.0
    consensus: float = 0.0
    validator_trust: float = 0.0
    active: bool = True


@dataclass(frozen=True)
class MetagraphSnapshot:
    netuid: int
    block: int
    neurons: tuple[NeuronInfo, ...] = ()
    tempo: int = 0

    def by_hotkey(self, hotkey: str) -> NeuronInfo | None:
        for n in self.neurons:
            if n.hotkey == hotkey:
                return n
        return None

    def by_uid(self, uid: int) -> NeuronInfo | None:
        for n in self.neurons:
            if n.uid == uid:
                return n
        return None

    @property
    def validators(self) -> tuple[NeuronInfo, ...]:
        return tuple(n for n in self.neurons if n.validator_permit)

    def __len__(self) -> int:
        return len(self.neurons)


@dataclass(frozen=True)
class Hyperparameters:
    tempo: int
    weights_rate_limit: int
    max_weight_limit: float  # fraction in (0, 1]; 1.0 means disabled
    min_allowed_weights: int
    max_uids: int
    immunity_period: int
    commit_reveal: bool = False
    weights_version: int = 0
    activity_cutoff: int = 5000


@dataclass(frozen=True)
class Commitment:
    """What a hotkey published with `publish_commitment` (subtensor's Commitments pallet, plain Raw fields)."""

    hotkey: str
    block: int  # the block it was published at
    data: str


# subtensor's Commitments pallet (runtime MaxCommitFieldsInner, Data::Raw0..Raw128, the per-epoch space quota)
COMMITMENT_MAX_FIELDS = 3
COMMITMENT_FIELD_BYTES = 128
COMMITMENT_MIN_SPACE = 100  # every set_commitment uses at least this much of the quota
COMMITMENT_MAX_SPACE = 3100  # MaxSpace's default: bytes per hotkey per subnet per epoch


def commitment_fields(data: str) -> list[bytes]:
    """`data` as the Raw fields of one set_commitment (UTF-8, at most 3 x 128 bytes); ValueError when it does
    not fit. Empty data is one empty field (the pallet stores it, and it clears what a reader sees)."""
    if not isinstance(data, str):
        raise ValueError(f"commitment data must be a string, got {type(data).__name__}")
    raw = data.encode("utf-8")
    limit = COMMITMENT_MAX_FIELDS * COMMITMENT_FIELD_BYTES
    if len(raw) > limit:
        raise ValueError(f"commitment data is {len(raw)} bytes; the chain takes at most {limit} "
                         f"({COMMITMENT_MAX_FIELDS} fields of {COMMITMENT_FIELD_BYTES})")
    return [raw[i:i + COMMITMENT_FIELD_BYTES] for i in range(0, len(raw), COMMITMENT_FIELD_BYTES)] or [b""]


def commitment_info(data: str) -> dict:
    """`data` as set_commitment's `info` argument (CommitmentInfo): {"fields": [{"Raw<n>": "0x<n bytes hex>"}, ...]},
    the shape the SDK's SCALE codec composes (Data::Raw<n> is variant n + 1, its n bytes follow; see
    tests/test_commitment_scale.py for the bytes against the runtime's own metadata)."""
    return {"fields": [{f"Raw{len(raw)}": "0x" + raw.hex()} for raw in commitment_fields(data)]}


def commitment_data(fields: list[bytes]) -> str:
    """What a reader sees of a commitment's Raw fields, as the SDK reads CommitmentOf: the bytes joined, as UTF-8
    when they are, else "0x" + hex."""
    raw = b"".join(fields)
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return "0x" + raw.hex()


def commitment_space(fields: list[bytes]) -> int:
    """How much of the epoch's quota one set_commitment with these fields uses."""
    return max(COMMITMENT_MIN_SPACE, sum(len(f) for f in fields))


@dataclass(frozen=True)
class SetWeightsOutcome:
    """What a successful set-weights did: the block it landed at and the u16 row stored."""

    block: int
    uids: tuple[int, ...] = ()
    weights_u16: tuple[int, ...] = ()
    committed: bool = False  # commit-reveal: the chain will reveal later
    extra: dict = field(default_factory=dict)


# ---------------------------------------------------------------- interface
class Chain(abc.ABC):
    """Everything a neuron needs from the chain. All methods are async and time-bounded.

    `wallet` arguments are bittensor wallets (`bt.Wallet`) or anything with
    `.hotkey` and `.coldkeypub` keypairs (`.coldkey` where the operation is the coldkey's).
    """

    @abc.abstractmethod
    async def block(self) -> int: ...

    @abc.abstractmethod
    async def metagraph(self, netuid: int) -> MetagraphSnapshot: ...

    @abc.abstractmethod
    async def hyperparameters(self, netuid: int) -> Hyperparameters: ...

    @abc.abstractmethod
    async def blocks_until_next_epoch(self, netuid: int) -> int: ...

    @abc.abstractmethod
    async def uid_of(self, hotkey: str, netuid: int) -> int | None: ...

    @abc.abstractmethod
    async def register(self, wallet, netuid: int) -> int:
        """Register the wallet's hotkey; returns its uid. Raises AlreadyRegistered, RegistrationFailed."""

    @abc.abstractmethod
    async def publish_endpoint(self, wallet, netuid: int, ip: str, port: int) -> None:
        """ServeAxon. Raises RateLimited (name ServingRateLimitExceeded) when re-published too soon."""

    @abc.abstractmethod
    async def publish_commitment(self, wallet, netuid: int, data: str) -> None:
        """set_commitment (signed by the hotkey): publish `data` (at most 384 UTF-8 bytes, else ValueError) for
        the hotkey on the subnet, replacing its previous one. Raises NotRegistered (AccountNotAllowedCommit) and
        RateLimited (SpaceLimitExceeded: each call uses max(100, bytes) of 3100 per epoch)."""

    @abc.abstractmethod
    async def commitments(self, netuid: int) -> dict[str, Commitment]:
        """Every registered hotkey's current commitment on the subnet, by hotkey."""

    @abc.abstractmethod
    async def set_weights(self, wallet, netuid: int, weights: dict[int, float], version_key: int) -> SetWeightsOutcome:
        """Raises NotRegistered, NoValidatorPermit, NotEnoughStake, RateLimited (with `retry_after_blocks`
        when the chain said how long to wait), InvalidWeights, ChainConnectionError. Under commit-reveal the
        outcome has committed=True: the weights reach the epoch only after the reveal period."""

    async def close(self) -> None:
        return None

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc):
        await self.close()
