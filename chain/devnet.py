"""The embedded devnet: a local stand-in for subtensor, its whole state in one SQLite file.

What it keeps from subtensor (docs/subnet.md section 6, docs/yuma.md; checked against subtensor's own epoch unit
tests, tests/subtensor_vectors/, at opentensor/subtensor commit 14bc6f9f964b9cc362e9635dd110a487fa5d15a0):
- blocks: `block = floor((now - genesis) / block_interval)`, genesis and interval stored in the file, so
  every process sees the same block and a restart loses nothing;
- subnets with a tempo; the epoch of subnet `netuid` runs at every block `b` where subtensor's
  `blocks_until_next_epoch` is 0, i.e. `(b + netuid + 1) % (tempo + 1) == tempo`, with a budget of
  `emission_per_block * tempo`; epochs run by `chain.yuma.run_epoch` on the stored sparse weights (explicit
  zeros included) and bonds; bonds to a uid registered at or after the block after the previous epoch are
  dropped (subtensor's LastMechansimStepBlock rule);
- registration (append, or replace the uid `prune_candidate` picks when the subnet is full), stake per
  hotkey on a subnet, validator permits (the owner's forced), ServeAxon with subtensor's serving rate limit,
  SetWeights with subtensor's checks in subtensor's order and its error names: UidsLengthExceedUidsInSubNet,
  HotKeyNotRegisteredInSubNet,
  NotEnoughStakeToSetWeights (the owner exempt), IncorrectWeightVersionKey, SettingWeightsTooFast (with
  `retry_after_blocks`; a LastUpdate of 0 is never limited), NeuronNoValidatorPermit (a lone self-weight and
  the owner exempt), DuplicateUids, UidVecContainInvalidOne, WeightVecLengthIsLow (explicit zeros count),
  MaxWeightExceeded;
- commit-reveal when the subnet's `commit_reveal` is on: set_weights commits (CommittingWeightsTooFast,
  TooManyUnrevealedCommits), LastUpdate moves to the commit block, and the row is revealed, through the
  checks above, just before the epoch `reveal_period` epochs later runs (the SDK's timelocked commits are
  revealed by the chain the same way); until then Yuma does not see it, and a pending commit older than a
  uid's registration masks the committer's weights to it.

Deliberate differences, for a local trust domain:
- No signatures are checked: whoever can open the file can act for any hotkey or coldkey. A "wallet" is
  only a source of ss58 addresses (`wallet.hotkey.ss58_address`, `wallet.coldkeypub.ss58_address`), and
  where only a hotkey is needed a plain ss58 string works too.
- No economics: registration is free, stake is set by `add_stake`/`remove_stake`, and emission is
  recorded per uid but not paid into stake, so stake weights stay what the operator set.
- Permits before the first epoch: until an epoch has granted a permit, permits are recomputed as the
  epoch would grant them (top `max_validators` by stake, `chain.yuma.top_k_permits`) whenever a
  registration or a stake change happens. A fresh local testnet's validators can then set weights as
  soon as they are registered and staked (and the weights rate limit allows); after that, permits come
  only from the epoch (P'), as on subtensor.
- SetWeights behaves as the SDK plus the chain: `chain.weights.conform` clips a row over max_weight_limit
  (where the chain alone would refuse it) and max-upscales it to u16; unlike the SDK it keeps the zeros
  given, as the chain stores them when they are submitted.
- Admin calls a real chain gives only to sudo or to its tests: `set_hyperparameter`, `trigger_epoch` (run the
  epoch now, as subtensor's tests call SubtensorModule::epoch), `set_validator_permits`, `reset_bonds`.
- Epochs that fell due while no process touched the file run, in order and each at its own block, at
  the start of the next transaction that reads or writes the subnet (at most `max_catch_up_epochs` per
  subnet at a time; older ones are skipped with a warning). The weights rate limit counts from the
  registration block, as subtensor's LastUpdate starts there.

Injected faults (test-only, for the local testnet's soak, docs/localnet.md): when the environment variable
`K3_DEVNET_FAULT_FILE` names a file, every call first looks at it (only when its modification time changed). A
JSON object `{"id", "mode": "error" | "stall", "calls": N, "stall_s": S, "until": UNIX_TIME}` makes the next N
calls of each process fail, until `until`, as a node's RPC would: `error` raises ChainConnectionError (a refused
or dropped connection), `stall` waits S seconds without an answer and then raises it (the caller's own timeout
usually fires first). A new `id` starts a new fault. Without the variable nothing is read.

Concurrency: WAL mode, a busy timeout, and every write inside `BEGIN IMMEDIATE`, so several processes
(miners publishing, validators setting weights, a dashboard reading) can share the file. A failed
operation rolls back to a savepoint taken after the due epochs ran: the state is unchanged, the epochs
are kept.
"""
from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import json
import logging
import math
import numbers
import os
import sqlite3
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from chain.interface import (COMMITMENT_MAX_SPACE, AlreadyRegistered, Chain, ChainConnectionError, ChainError,
                             Commitment, Endpoint, Hyperparameters, InvalidWeights, MetagraphSnapshot, NeuronInfo,
                             NotEnoughStake, NotRegistered, NoValidatorPermit, RateLimited, RegistrationFailed,
                             SetWeightsOutcome, SubnetNotFound, commitment_data, commitment_fields, commitment_space)
from chain.weights import WeightsError, conform, exceeds_max_weight, too_few_weights, validated_pairs
from chain.yuma import (NO_COMMIT, YUMA_VERSIONS, EpochInputs, YumaParams, prune_candidate, run_epoch, stake_weights,
                        top_k_permits, with_owner_permit)

log = logging.getLogger(__name__)

SCHEMA_VERSION = 2
U16_MAX = 65535
DEFAULT_BLOCK_INTERVAL = 1.0
MAX_UNREVEALED_COMMITS = 10  # subtensor's TooManyUnrevealedCommits bound, per hotkey
FAULT_FILE_ENV = "K3_DEVNET_FAULT_FILE"  # test-only: a control file of injected RPC faults (module doc)
FAULT_MODES = ("error", "stall")


# ---------------------------------------------------------------- hyperparameters
@dataclass(frozen=True)
class HyperparameterSpec:
    kind: type  # int, float, bool or str
    default: Any
    check: Callable[[Any], bool]
    rule: str  # what `check` demands, for the error message


def _non_negative(v) -> bool:
    return v >= 0


# Subtensor's defaults for a new subnet (docs/yuma.md), except tempo: 100 blocks so that a local testnet
# at one block a second sees an epoch every ~100 s rather than every 6 minutes.
HYPERPARAMETERS: dict[str, HyperparameterSpec] = {
    "tempo": HyperparameterSpec(int, 100, lambda v: 1 <= v <= 65535, "an integer in [1, 65535]"),
    # Commit-reveal (subtensor's CommitRevealWeightsEnabled, RevealPeriodEpochs): set_weights commits, and the
    # weights reach Yuma when the epoch `reveal_period` epochs after the commit's runs.
    "commit_reveal": HyperparameterSpec(bool, False, lambda v: True, "true or false"),
    "reveal_period": HyperparameterSpec(int, 1, lambda v: 1 <= v <= 100, "an integer in [1, 100]"),
    # subtensor's BondsResetOn: `reset_bonds` clears the bonds held to a uid only when it is on.
    "bonds_reset": HyperparameterSpec(bool, False, lambda v: True, "true or false"),
    "max_uids": HyperparameterSpec(int, 256, lambda v: 1 <= v <= 4096, "an integer in [1, 4096]"),
    "immunity_period": HyperparameterSpec(int, 5000, _non_negative, "a non-negative integer"),
    "weights_rate_limit": HyperparameterSpec(int, 100, _non_negative, "a non-negative integer"),
    "min_allowed_weights": HyperparameterSpec(int, 1, _non_negative, "a non-negative integer"),
    "max_weight_limit": HyperparameterSpec(float, 1.0, lambda v: 0 < v <= 1, "a fraction in (0, 1]"),
    "max_validators": HyperparameterSpec(int, 64, _non_negative, "a non-negative integer"),
    "activity_cutoff": HyperparameterSpec(int, 5000, _non_negative, "a non-negative integer"),
    "serving_rate_limit": HyperparameterSpec(int, 50, _non_negative, "a non-negative integer"),
    "emission_per_block": HyperparameterSpec(float, 1.0, lambda v: 0 <= v < math.inf, "a finite number >= 0"),
    "weights_version": HyperparameterSpec(int, 0, _non_negative, "a non-negative integer"),
    "min_non_immune_uids": HyperparameterSpec(int, 10, _non_negative, "a non-negative integer"),
    # Subtensor's StakeThreshold: the epoch ignores smaller stakes and SetWeights refuses them.
    "stake_threshold": HyperparameterSpec(float, 0.0, lambda v: 0 <= v < math.inf, "a finite number >= 0"),
    # Yuma Consensus parameters (chain.yuma.YumaParams validates their ranges too).
    "kappa": HyperparameterSpec(float, 32767 / 65535, lambda v: 0 <= v <= 1, "a fraction in [0, 1]"),
    "bonds_moving_average": HyperparameterSpec(int, 900_000, lambda v: 0 <= v <= 1_000_000,
                                               "an integer in [0, 1000000]"),
    "bonds_penalty": HyperparameterSpec(float, 1.0, lambda v: 0 <= v <= 1, "a fraction in [0, 1]"),
    "liquid_alpha": HyperparameterSpec(bool, False, lambda v: True, "true or false"),
    "alpha_low": HyperparameterSpec(float, 0.7, lambda v: 0 <= v <= 1, "a fraction in [0, 1]"),
    "alpha_high": HyperparameterSpec(float, 0.9, lambda v: 0 <= v <= 1, "a fraction in [0, 1]"),
    "alpha_steepness": HyperparameterSpec(float, 1000.0, lambda v: 0 <= v < math.inf, "a finite number >= 0"),
    "yuma_version": HyperparameterSpec(str, "yuma3", lambda v: v in YUMA_VERSIONS, f"one of {YUMA_VERSIONS}"),
}


def coerce_hyperparameter(name: str, value: Any) -> Any:
    """The value as the hyperparameter's type (strings from a command line accepted), or ValueError."""
    spec = HYPERPARAMETERS.get(name)
    if spec is None:
        raise ValueError(f"unknown hyperparameter {name!r}; known: {', '.join(sorted(HYPERPARAMETERS))}")
    try:
        if spec.kind is bool:
            if isinstance(value, str):
                if value.lower() not in ("true", "false", "1", "0", "yes", "no", "on", "off"):
                    raise ValueError
                v = value.lower() in ("true", "1", "yes", "on")
            elif isinstance(value, (bool, np.bool_)) or value in (0, 1):
                v = bool(value)
            else:
                raise ValueError
        elif spec.kind is int:
            if isinstance(value, bool):
                raise ValueError
            if isinstance(value, str):
                v = int(value.strip())
            elif isinstance(value, numbers.Integral):
                v = int(value)
            elif isinstance(value, numbers.Real) and float(value).is_integer():
                v = int(value)
            else:
                raise ValueError
        elif spec.kind is float:
            if isinstance(value, bool):
                raise ValueError
            v = float(value)
            if math.isnan(v):
                raise ValueError
        else:
            v = str(value)
    except (ValueError, TypeError):
        raise ValueError(f"hyperparameter {name} must be {spec.rule}, got {value!r}") from None
    if not spec.check(v):
        raise ValueError(f"hyperparameter {name} must be {spec.rule}, got {value!r}")
    return v


def yuma_params(params: Mapping[str, Any]) -> YumaParams:
    return YumaParams(
        kappa=params["kappa"],
        bonds_moving_average=params["bonds_moving_average"],
        bonds_penalty=params["bonds_penalty"],
        liquid_alpha=params["liquid_alpha"],
        alpha_low=params["alpha_low"],
        alpha_high=params["alpha_high"],
        alpha_steepness=params["alpha_steepness"],
        max_validators=params["max_validators"],
        activity_cutoff=params["activity_cutoff"],
        stake_threshold=params["stake_threshold"],
        version=params["yuma_version"],
    )


# ---------------------------------------------------------------- epoch history records
@dataclass(frozen=True)
class EpochNeuron:
    """One uid's outcome of one epoch."""

    uid: int
    hotkey: str
    stake: float  # raw stake at the epoch
    active: bool
    validator_permit: bool  # P' granted by this epoch
    rank: float
    trust: float
    consensus: float
    incentive: float
    dividends: float
    emission: float
    validator_trust: float
    miner_emission: float
    validator_emission: float
    bonds: dict[int, int] = field(default_factory=dict)  # target uid -> u16 bond stored after the epoch
    stake_weight: float = 0.0  # S: normalised stake above the threshold
    active_stake: float = 0.0  # A
    permit_used: bool = False  # the permit this epoch counted (P)


@dataclass(frozen=True)
class EpochRecord:
    netuid: int
    block: int
    emission_budget: float
    neurons: tuple[EpochNeuron, ...] = ()

    def by_uid(self, uid: int) -> EpochNeuron | None:
        for n in self.neurons:
            if n.uid == uid:
                return n
        return None


# ---------------------------------------------------------------- storage
_SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS subnets (
    netuid INTEGER PRIMARY KEY,
    owner_coldkey TEXT NOT NULL,
    owner_hotkey TEXT,
    created_block INTEGER NOT NULL,
    epochs_through INTEGER NOT NULL,           -- every epoch due at a block <= this one has run
    permits_from_epoch INTEGER NOT NULL DEFAULT 0, -- 1 once an epoch has granted a permit
    epoch_index INTEGER NOT NULL DEFAULT 0,    -- epochs run so far (subtensor's SubnetEpochIndex)
    last_epoch_block INTEGER                   -- the block of the latest epoch (NULL: none yet)
);
CREATE TABLE IF NOT EXISTS subnet_params (
    netuid INTEGER NOT NULL, name TEXT NOT NULL, value,
    PRIMARY KEY (netuid, name)
);
CREATE TABLE IF NOT EXISTS neurons (
    netuid INTEGER NOT NULL,
    uid INTEGER NOT NULL,
    hotkey TEXT NOT NULL,
    coldkey TEXT NOT NULL,
    block_at_registration INTEGER NOT NULL,
    last_update INTEGER NOT NULL,
    validator_permit INTEGER NOT NULL DEFAULT 0,
    registered_since_last_epoch INTEGER NOT NULL DEFAULT 1,
    axon_ip TEXT, axon_port INTEGER, axon_protocol INTEGER, axon_version INTEGER, axon_block INTEGER,
    active INTEGER NOT NULL DEFAULT 1,
    rank REAL NOT NULL DEFAULT 0, trust REAL NOT NULL DEFAULT 0, consensus REAL NOT NULL DEFAULT 0,
    incentive REAL NOT NULL DEFAULT 0, dividends REAL NOT NULL DEFAULT 0, emission REAL NOT NULL DEFAULT 0,
    validator_trust REAL NOT NULL DEFAULT 0,
    PRIMARY KEY (netuid, uid),
    UNIQUE (netuid, hotkey)
);
-- rows are little-endian uint16 pairs (target uid, value), sparse as subtensor stores them
CREATE TABLE IF NOT EXISTS weights (netuid INTEGER NOT NULL, uid INTEGER NOT NULL, row BLOB NOT NULL,
                                    PRIMARY KEY (netuid, uid));
CREATE TABLE IF NOT EXISTS bonds (netuid INTEGER NOT NULL, uid INTEGER NOT NULL, row BLOB NOT NULL,
                                  PRIMARY KEY (netuid, uid));
CREATE TABLE IF NOT EXISTS stakes (
    netuid INTEGER NOT NULL, hotkey TEXT NOT NULL, coldkey TEXT NOT NULL, amount REAL NOT NULL,
    PRIMARY KEY (netuid, hotkey, coldkey)
);
CREATE TABLE IF NOT EXISTS epochs (netuid INTEGER NOT NULL, block INTEGER NOT NULL,
                                   emission_budget REAL NOT NULL, PRIMARY KEY (netuid, block));
CREATE TABLE IF NOT EXISTS epoch_neurons (
    netuid INTEGER NOT NULL, block INTEGER NOT NULL, uid INTEGER NOT NULL, hotkey TEXT NOT NULL,
    stake REAL, active INTEGER, validator_permit INTEGER, rank REAL, trust REAL, consensus REAL,
    incentive REAL, dividends REAL, emission REAL, validator_trust REAL, miner_emission REAL,
    validator_emission REAL, bonds BLOB, stake_weight REAL, active_stake REAL, permit_used INTEGER,
    PRIMARY KEY (netuid, block, uid)
);
-- commit-reveal: a committed row waits here until the epoch of commit_epoch + reveal_period reveals it
CREATE TABLE IF NOT EXISTS weight_commits (
    netuid INTEGER NOT NULL, hotkey TEXT NOT NULL, commit_block INTEGER NOT NULL, commit_epoch INTEGER NOT NULL,
    row BLOB NOT NULL, version_key INTEGER NOT NULL, seq INTEGER PRIMARY KEY AUTOINCREMENT
);
"""

# The Commitments pallet's CommitmentOf and UsedSpaceOf; created on every open, so files made before them gain
# them (same schema version: nothing else changed).
_COMMITMENT_TABLES = """
CREATE TABLE IF NOT EXISTS commitments (
    netuid INTEGER NOT NULL, hotkey TEXT NOT NULL, block INTEGER NOT NULL, data BLOB NOT NULL,
    PRIMARY KEY (netuid, hotkey)
);
CREATE TABLE IF NOT EXISTS commitment_space (
    netuid INTEGER NOT NULL, hotkey TEXT NOT NULL, epoch INTEGER NOT NULL, used INTEGER NOT NULL,
    PRIMARY KEY (netuid, hotkey)
)
"""

# Schema 1 files (before explicit zeros, commit-reveal and the epoch counter) gain the new columns and table.
_MIGRATE_1_TO_2 = """
ALTER TABLE subnets ADD COLUMN epoch_index INTEGER NOT NULL DEFAULT 0;
ALTER TABLE subnets ADD COLUMN last_epoch_block INTEGER;
ALTER TABLE epoch_neurons ADD COLUMN stake_weight REAL;
ALTER TABLE epoch_neurons ADD COLUMN active_stake REAL;
ALTER TABLE epoch_neurons ADD COLUMN permit_used INTEGER;
CREATE TABLE IF NOT EXISTS weight_commits (
    netuid INTEGER NOT NULL, hotkey TEXT NOT NULL, commit_block INTEGER NOT NULL, commit_epoch INTEGER NOT NULL,
    row BLOB NOT NULL, version_key INTEGER NOT NULL, seq INTEGER PRIMARY KEY AUTOINCREMENT
)
"""


def _pack_row(targets, values) -> bytes:
    return np.column_stack([np.asarray(targets), np.asarray(values)]).astype("<u2").tobytes()


def _unpack_row(blob: bytes) -> np.ndarray:
    """[k, 2] int64: (target uid, u16 value)."""
    return np.frombuffer(blob, dtype="<u2").reshape(-1, 2).astype(np.int64)


def epoch_blocks(netuid: int, tempo: int, after: int, upto: int) -> range:
    """The blocks in (after, upto] at which subnet `netuid` runs its epoch (subtensor's rule:
    `blocks_until_next_epoch == 0`, i.e. `(b + netuid + 2) % (tempo + 1) == 0`)."""
    period = tempo + 1
    first = after + 1 + (-(after + 1 + netuid + 2)) % period
    return range(first, upto + 1, period)


def blocks_until_epoch(netuid: int, tempo: int, block: int) -> int:
    """Subtensor's blocks_until_next_epoch: 0 at an epoch block, tempo just after one."""
    return tempo - (block + netuid + 1) % (tempo + 1)


def _checked_ss58(address: str, what: str) -> str:
    from bittensor.sp_core import ss58_decode  # imported late: it loads the whole SDK (~1 s)

    try:
        ss58_decode(address)
    except (ValueError, TypeError):
        raise ValueError(f"{what} {address!r} is not a valid ss58 address") from None
    return address


def _hotkey_of(wallet) -> str:
    """The hotkey address of a wallet (or of anything with `.hotkey.ss58_address`), or an ss58 string."""
    return _address_of(wallet, "hotkey", "hotkey")


def _coldkey_of(wallet) -> str:
    """The coldkey address of a wallet (`.coldkeypub.ss58_address`), or an ss58 string."""
    return _address_of(wallet, "coldkey", "coldkeypub")


def _address_of(wallet, what: str, keypair: str) -> str:
    if isinstance(wallet, str):
        return _checked_ss58(wallet, what)
    try:
        return getattr(wallet, keypair).ss58_address
    except AttributeError:
        raise TypeError(f"expected a wallet with a {what} or an ss58 address, got {type(wallet).__name__}") from None


def _checked_endpoint(ip: str, port: int, protocol: int, version: int) -> tuple[str, int]:
    try:
        address = ipaddress.ip_address(str(ip).strip())
    except ValueError:
        raise ValueError(f"invalid ip {ip!r}: give an IPv4 or IPv6 address such as 127.0.0.1") from None
    if address.is_unspecified or address.is_multicast:
        raise ValueError(f"ip {ip} cannot be reached by others: publish a concrete address such as 127.0.0.1")
    if isinstance(port, bool) or not isinstance(port, numbers.Integral) or not 1 <= port <= 65535:
        raise ValueError(f"invalid port {port!r}: give an integer in [1, 65535]")
    for name, v in (("protocol", protocol), ("version", version)):
        if isinstance(v, bool) or not isinstance(v, numbers.Integral) or v < 0:
            raise ValueError(f"invalid {name} {v!r}: give a non-negative integer")
    return str(address), int(port)


def _stake_amount(amount) -> float:
    if isinstance(amount, bool) or not isinstance(amount, numbers.Real) or not (0 < amount < math.inf):
        raise ValueError(f"stake amount must be a positive finite number, got {amount!r}")
    return float(amount)


def _weight_pairs(weights) -> list[tuple[int, float]]:
    """(uid, weight) pairs from a dict or a sequence of pairs (which can hold a duplicate uid)."""
    items = weights.items() if isinstance(weights, Mapping) else list(weights)
    pairs = []
    for item in items:
        try:
            uid, value = item
        except (TypeError, ValueError):
            raise TypeError(f"weights must be a dict uid -> weight or (uid, weight) pairs, got {item!r}") from None
        if isinstance(uid, bool) or not isinstance(uid, numbers.Integral):
            raise TypeError(f"weight uids must be integers, got {uid!r}")
        try:
            value = float(value)
        except (TypeError, ValueError):
            raise InvalidWeights(f"weight for uid {uid} is {value!r}, not a number") from None
        if not math.isfinite(value) or value < 0:
            raise InvalidWeights(f"weight for uid {uid} is {value}; weights must be finite and non-negative")
        pairs.append((int(uid), value))
    return pairs


# ---------------------------------------------------------------- the chain
class InjectedFaults:
    """The test-only fault control file of one process (module doc): `next_fault()` is None for a call that goes
    through, else the fault's (mode, id, stall seconds). Read again only when the file's mtime changes."""

    def __init__(self, path: str):
        self.path = path
        self._mtime: float | None = None
        self._fault: dict = {}
        self._seen_ids: set[str] = set()
        self._left = 0

    def next_fault(self) -> tuple[str, str, float] | None:
        try:
            mtime = os.stat(self.path).st_mtime
        except OSError:
            return None
        if mtime != self._mtime:
            self._mtime = mtime
            try:
                with open(self.path) as f:
                    fault = json.load(f)
            except (OSError, ValueError):
                return None  # being written: read it at the next call
            fid = str(fault.get("id", ""))
            if fault.get("mode") in FAULT_MODES and fid not in self._seen_ids:
                self._seen_ids.add(fid)
                self._fault, self._left = fault, int(fault.get("calls", 0))
        if self._left <= 0 or time.time() >= float(self._fault.get("until", 0.0)):
            return None
        self._left -= 1
        return self._fault["mode"], str(self._fault.get("id", "")), float(self._fault.get("stall_s", 0.0))


class DevnetChain(Chain):
    """`Chain` over one SQLite file. See the module docstring for what it models and what it skips.

    `DevnetChain(path)` opens an existing devnet (ChainConnectionError when the file is missing);
    `DevnetChain(path, create=True)` creates it if needed, with `block_interval` seconds per block
    (stored in the file; an existing file keeps its own and a different explicit value is an error).
    """

    def __init__(
        self,
        path: str | os.PathLike,
        block_interval: float | None = None,
        create: bool = False,
        busy_timeout_s: float = 10.0,
        epoch_history: int = 1000,
        max_catch_up_epochs: int = 1000,
    ):
        self.path = os.fspath(path)
        if block_interval is not None and not (block_interval > 0 and math.isfinite(block_interval)):
            raise ValueError(f"block_interval must be a positive number of seconds, got {block_interval!r}")
        if epoch_history < 1 or max_catch_up_epochs < 1:
            raise ValueError("epoch_history and max_catch_up_epochs must be at least 1")
        self.history_limit = int(epoch_history)
        self.max_catch_up_epochs = int(max_catch_up_epochs)
        exists = os.path.exists(self.path)
        if not exists and not create:
            raise ChainConnectionError(
                f"devnet database {self.path} does not exist; create it with "
                f"`python -m chain devnet create --db {self.path}`"
            )
        try:
            self._conn = sqlite3.connect(
                self.path, timeout=busy_timeout_s, isolation_level=None, check_same_thread=False
            )
        except sqlite3.Error as e:
            raise ChainConnectionError(f"cannot open devnet database {self.path}: {e}") from e
        self._lock = threading.Lock()
        self._epochs_ran = 0  # epochs run at the start of the current write transaction
        fault_file = os.environ.get(FAULT_FILE_ENV, "")
        self._faults = InjectedFaults(fault_file) if fault_file else None
        try:
            self._conn.execute("PRAGMA journal_mode=WAL")
            # NORMAL is durable across process crashes in WAL mode; only a power cut may lose the last commit.
            self._conn.execute("PRAGMA synchronous=NORMAL")
            if create:
                self._initialise(block_interval or DEFAULT_BLOCK_INTERVAL)
            self._check_devnet(block_interval)
            for statement in _COMMITMENT_TABLES.split(";"):
                if statement.strip():
                    self._conn.execute(statement)
        except sqlite3.Error as e:
            self._conn.close()
            raise ChainConnectionError(f"cannot use devnet database {self.path}: {e}") from e
        except BaseException:
            self._conn.close()
            raise

    def _initialise(self, block_interval: float) -> None:
        c = self._conn
        c.execute("BEGIN IMMEDIATE")
        try:
            for statement in _SCHEMA.split(";"):
                if statement.strip():
                    c.execute(statement)
            c.executemany(
                "INSERT OR IGNORE INTO meta (key, value) VALUES (?, ?)",
                [
                    ("schema_version", str(SCHEMA_VERSION)),
                    ("genesis_time", repr(time.time())),
                    ("block_interval", repr(float(block_interval))),
                ],
            )
            c.execute("COMMIT")
        except BaseException:
            if c.in_transaction:
                c.execute("ROLLBACK")
            raise

    def _check_devnet(self, block_interval: float | None) -> None:
        try:
            rows = dict(self._conn.execute("SELECT key, value FROM meta").fetchall())
        except sqlite3.OperationalError:
            rows = {}
        if "genesis_time" not in rows:
            raise ValueError(f"{self.path} is not a devnet database (no genesis); create one with "
                             f"`python -m chain devnet create --db PATH`")
        if int(rows.get("schema_version", 0)) == 1:
            self._migrate_from_1()
            rows["schema_version"] = str(SCHEMA_VERSION)
        if int(rows.get("schema_version", 0)) != SCHEMA_VERSION:
            raise ValueError(f"{self.path} has devnet schema {rows.get('schema_version')}, "
                             f"this code reads {SCHEMA_VERSION}: recreate it")
        stored = float(rows["block_interval"])
        if block_interval is not None and not math.isclose(stored, block_interval):
            raise ValueError(f"{self.path} runs at {stored} s per block; {block_interval} was asked for "
                             f"(leave block_interval unset to use the stored one)")
        self.block_interval = stored

    def _migrate_from_1(self) -> None:
        c = self._conn
        c.execute("BEGIN IMMEDIATE")
        try:
            if int(c.execute("SELECT value FROM meta WHERE key = 'schema_version'").fetchone()[0]) == 1:
                for statement in _MIGRATE_1_TO_2.split(";"):
                    if statement.strip():
                        c.execute(statement)
                c.execute("UPDATE meta SET value = ? WHERE key = 'schema_version'", (str(SCHEMA_VERSION),))
            c.execute("COMMIT")
        except BaseException:
            if c.in_transaction:
                c.execute("ROLLBACK")
            raise

    # ------------------------------------------------------------ transactions
    def _clock(self) -> int:
        genesis, interval = (
            float(v) for (v,) in self._conn.execute(
                "SELECT value FROM meta WHERE key IN ('genesis_time', 'block_interval') ORDER BY key DESC"
            )
        )
        return max(0, math.floor((time.time() - genesis) / interval))

    def _write_sync(self, operation: Callable[[int], Any]) -> Any:
        """BEGIN IMMEDIATE; run the epochs that fell due; run `operation(block)`; COMMIT.

        A ChainError or ValueError from the operation rolls back to the savepoint after the epochs, so the
        operation leaves no trace but the epochs are kept.
        """
        c = self._conn
        with self._lock:
            try:
                c.execute("BEGIN IMMEDIATE")
            except sqlite3.OperationalError as e:
                raise ChainConnectionError(f"devnet database {self.path} is busy: {e}") from e
            with self._rolled_back_on_failure():
                block = self._clock()
                self._epochs_ran = self._run_due_epochs(block)
                c.execute("SAVEPOINT operation")
                try:
                    result = operation(block)
                except (ChainError, ValueError, TypeError):
                    c.execute("ROLLBACK TO operation")
                    c.execute("RELEASE operation")
                    c.execute("COMMIT")
                    raise
                c.execute("RELEASE operation")
                c.execute("COMMIT")
                return result

    def _read_sync(self, query: Callable[[int], Any]) -> Any:
        """A read in a deferred transaction; when epochs are due it becomes a write that runs them first."""
        c = self._conn
        with self._lock:
            with self._rolled_back_on_failure():
                c.execute("BEGIN")
                block = self._clock()
                if not self._epochs_due(block):
                    result = query(block)
                    c.execute("COMMIT")
                    return result
                c.execute("ROLLBACK")
        return self._write_sync(query)

    @contextlib.contextmanager
    def _rolled_back_on_failure(self):
        """Any exception rolls the open transaction back; an SQLite error becomes a ChainConnectionError."""
        c = self._conn
        try:
            yield
        except sqlite3.Error as e:
            if c.in_transaction:
                c.execute("ROLLBACK")
            raise ChainConnectionError(f"devnet database {self.path}: {e}") from e
        except BaseException:
            if c.in_transaction:
                c.execute("ROLLBACK")
            raise

    async def _write(self, operation: Callable[[int], Any]) -> Any:
        await self._injected_fault()
        return await asyncio.to_thread(self._write_sync, operation)

    async def _read(self, query: Callable[[int], Any]) -> Any:
        await self._injected_fault()
        return await asyncio.to_thread(self._read_sync, query)

    async def _injected_fault(self) -> None:
        """Fail this call as the test-only fault file says (module doc); nothing without K3_DEVNET_FAULT_FILE."""
        fault = self._faults.next_fault() if self._faults is not None else None
        if fault is None:
            return
        mode, fid, stall_s = fault
        if mode == "stall":
            await asyncio.sleep(stall_s)
            raise ChainConnectionError(f"devnet {self.path}: no answer within {stall_s:g} s (injected fault {fid})")
        raise ChainConnectionError(f"devnet {self.path}: connection refused (injected fault {fid})")

    # ------------------------------------------------------------ subnet state
    def _params(self, netuid: int) -> dict[str, Any]:
        rows = self._conn.execute("SELECT name, value FROM subnet_params WHERE netuid = ?", (netuid,)).fetchall()
        if not rows:
            raise SubnetNotFound(f"subnet {netuid} does not exist on the devnet {self.path}")
        params = {name: spec.default for name, spec in HYPERPARAMETERS.items()}
        for name, value in rows:
            if name in HYPERPARAMETERS:
                params[name] = HYPERPARAMETERS[name].kind(value)
        return params

    def _subnet_row(self, netuid: int) -> tuple[str, str | None, int]:
        row = self._conn.execute(
            "SELECT owner_coldkey, owner_hotkey, permits_from_epoch FROM subnets WHERE netuid = ?", (netuid,)
        ).fetchone()
        if row is None:
            raise SubnetNotFound(f"subnet {netuid} does not exist on the devnet {self.path}")
        return row

    def _uid(self, netuid: int, hotkey: str) -> int | None:
        row = self._conn.execute(
            "SELECT uid FROM neurons WHERE netuid = ? AND hotkey = ?", (netuid, hotkey)
        ).fetchone()
        return None if row is None else row[0]

    def _owner_uid(self, netuid: int) -> int | None:
        """The uid of the subnet owner's hotkey, when it is registered (subtensor's get_owner_uid)."""
        row = self._conn.execute(
            "SELECT n.uid FROM subnets s JOIN neurons n ON n.netuid = s.netuid AND n.hotkey = s.owner_hotkey "
            "WHERE s.netuid = ?", (netuid,),
        ).fetchone()
        return None if row is None else row[0]

    def _neuron_count(self, netuid: int) -> int:
        return self._conn.execute("SELECT COUNT(*) FROM neurons WHERE netuid = ?", (netuid,)).fetchone()[0]

    def _stakes(self, netuid: int) -> np.ndarray:
        """Stake per uid (the sum over coldkeys staking to the uid's hotkey on this subnet)."""
        rows = self._conn.execute(
            "SELECT n.uid, COALESCE(SUM(s.amount), 0) FROM neurons n LEFT JOIN stakes s "
            "ON s.netuid = n.netuid AND s.hotkey = n.hotkey WHERE n.netuid = ? GROUP BY n.uid ORDER BY n.uid",
            (netuid,),
        ).fetchall()
        return np.array([amount for _, amount in rows], dtype=np.float64)

    def _matrix(self, table: str, netuid: int, n: int) -> np.ndarray:
        m = np.zeros((n, n), dtype=np.int64)
        for uid, blob in self._conn.execute(f"SELECT uid, row FROM {table} WHERE netuid = ?", (netuid,)):
            entries = _unpack_row(blob)
            if uid < n and len(entries):
                keep = entries[:, 0] < n
                m[uid, entries[keep, 0]] = entries[keep, 1]
        return m

    def _sparse(self, table: str, netuid: int) -> dict[int, dict[int, int]]:
        return {
            uid: {int(t): int(v) for t, v in _unpack_row(blob)}
            for uid, blob in self._conn.execute(
                f"SELECT uid, row FROM {table} WHERE netuid = ? ORDER BY uid", (netuid,)
            )
        }

    def _refresh_early_permits(self, netuid: int) -> None:
        """Before any epoch has granted a permit, permits are what the next epoch would grant (P')."""
        _, _, permits_from_epoch = self._subnet_row(netuid)
        if permits_from_epoch:
            return
        params = self._params(netuid)
        stake = self._stakes(netuid)
        owner = self._owner_uid(netuid)
        permit = with_owner_permit(
            top_k_permits(stake_weights(stake, params["stake_threshold"], owner), params["max_validators"]), owner)
        self._conn.executemany(
            "UPDATE neurons SET validator_permit = ? WHERE netuid = ? AND uid = ?",
            [(int(p), netuid, uid) for uid, p in enumerate(permit)],
        )

    # ------------------------------------------------------------ epochs
    def _due_subnets(self) -> list[tuple[int, int, int]]:
        return self._conn.execute(
            "SELECT s.netuid, s.epochs_through, p.value FROM subnets s JOIN subnet_params p "
            "ON p.netuid = s.netuid AND p.name = 'tempo' ORDER BY s.netuid"
        ).fetchall()

    def _epochs_due(self, block: int) -> bool:
        return any(
            len(epoch_blocks(netuid, int(tempo), through, block))
            for netuid, through, tempo in self._due_subnets()
        )

    def _run_due_epochs(self, block: int) -> int:
        ran = 0
        for netuid, through, tempo in self._due_subnets():
            due = epoch_blocks(netuid, int(tempo), through, block)
            if not len(due):
                continue
            if len(due) > self.max_catch_up_epochs:
                log.warning(
                    "devnet subnet %d: %d epochs fell due while nothing touched %s; running the last %d",
                    netuid, len(due), self.path, self.max_catch_up_epochs,
                )
                due = due[-self.max_catch_up_epochs:]
            for epoch_block in due:
                self._run_epoch(netuid, epoch_block)
                ran += 1
            self._conn.execute("UPDATE subnets SET epochs_through = ? WHERE netuid = ?", (due[-1], netuid))
        return ran

    def _run_epoch(self, netuid: int, block: int, budget: float | None = None, scheduled: bool = True) -> None:
        """The epoch at `block`. A scheduled one moves the commit-reveal clock (the subnet's epoch counter,
        reveals before it runs); an extra one (`trigger_epoch`) does not, as SubtensorModule::epoch does not."""
        c = self._conn
        params = self._params(netuid)
        index, last_epoch_block = c.execute(
            "SELECT epoch_index, last_epoch_block FROM subnets WHERE netuid = ?", (netuid,)
        ).fetchone()
        current = index + 1 if scheduled else index  # subtensor's current_epoch_with_lookahead
        if params["commit_reveal"] and scheduled:
            self._reveal_commits(netuid, block, current, params)  # before the epoch, as subtensor's block step
        if budget is None:
            budget = params["emission_per_block"] * params["tempo"]
        if c.execute("SELECT 1 FROM epochs WHERE netuid = ? AND block = ?", (netuid, block)).fetchone():
            raise ValueError(f"subnet {netuid} already ran an epoch at block {block}")
        c.execute("INSERT INTO epochs (netuid, block, emission_budget) VALUES (?, ?, ?)", (netuid, block, budget))
        c.execute("UPDATE subnets SET epoch_index = ?, last_epoch_block = ? WHERE netuid = ?",
                  (current, block, netuid))
        rows = c.execute(
            "SELECT uid, hotkey, last_update, block_at_registration, validator_permit "
            "FROM neurons WHERE netuid = ? ORDER BY uid",
            (netuid,),
        ).fetchall()
        n = len(rows)
        if n == 0:
            return
        hotkeys = [r[1] for r in rows]
        stake = self._stakes(netuid)
        owner_uid = self._owner_uid(netuid)
        commit_blocks = self._commit_blocks(netuid, hotkeys, current, params) if params["commit_reveal"] else None
        inputs = EpochInputs(
            block=block,
            stake=stake,
            last_update=np.array([r[2] for r in rows], dtype=np.int64),
            block_at_registration=np.array([r[3] for r in rows], dtype=np.int64),
            validator_permit=np.array([bool(r[4]) for r in rows]),
            weights=self._sparse("weights", netuid),
            bonds=self._sparse("bonds", netuid),
            emission_budget=budget,
            subnet_owner_uid=owner_uid,
            last_epoch_block=last_epoch_block,
            tempo=params["tempo"],
            commit_blocks=commit_blocks,
        )
        result = run_epoch(inputs, yuma_params(params))
        permit_used = with_owner_permit(inputs.validator_permit, owner_uid)

        c.executemany(
            "UPDATE neurons SET active = ?, validator_permit = ?, rank = ?, trust = ?, consensus = ?, incentive = ?, "
            "dividends = ?, emission = ?, validator_trust = ?, registered_since_last_epoch = 0 "
            "WHERE netuid = ? AND uid = ?",
            [
                (
                    int(result.active[u]), int(result.validator_permit[u]), float(result.rank[u]),
                    float(result.trust[u]), float(result.consensus[u]), float(result.incentive[u]),
                    float(result.dividends[u]), float(result.emission[u]), float(result.validator_trust[u]),
                    netuid, u,
                )
                for u in range(n)
            ],
        )
        bond_rows = {}
        for u in range(n):
            targets = np.flatnonzero(result.bonds[u])
            if len(targets):
                bond_rows[u] = _pack_row(targets, result.bonds[u, targets])
        c.execute("DELETE FROM bonds WHERE netuid = ?", (netuid,))
        c.executemany(
            "INSERT INTO bonds (netuid, uid, row) VALUES (?, ?, ?)",
            [(netuid, u, blob) for u, blob in bond_rows.items()],
        )
        if result.validator_permit.any():
            c.execute("UPDATE subnets SET permits_from_epoch = 1 WHERE netuid = ?", (netuid,))

        c.executemany(
            "INSERT INTO epoch_neurons (netuid, block, uid, hotkey, stake, active, validator_permit, rank, trust, "
            "consensus, incentive, dividends, emission, validator_trust, miner_emission, validator_emission, bonds, "
            "stake_weight, active_stake, permit_used) "
            "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
            [
                (
                    netuid, block, u, hotkeys[u], float(stake[u]), int(result.active[u]),
                    int(result.validator_permit[u]), float(result.rank[u]), float(result.trust[u]),
                    float(result.consensus[u]), float(result.incentive[u]), float(result.dividends[u]),
                    float(result.emission[u]), float(result.validator_trust[u]), float(result.miner_emission[u]),
                    float(result.validator_emission[u]), bond_rows.get(u, b""), float(result.stake[u]),
                    float(result.active_stake[u]), int(permit_used[u]),
                )
                for u in range(n)
            ],
        )
        self._trim_history(netuid)

    # ------------------------------------------------------------ commit-reveal
    def _reveal_commits(self, netuid: int, block: int, epoch: int, params: dict) -> None:
        """Before the epoch numbered `epoch` runs: drop commits older than its reveal epoch
        (epoch - reveal_period) and reveal those of the reveal epoch, oldest first, each through the
        chain's set-weights checks (no rate limit, LastUpdate kept at the commit block); a revealed row the
        checks refuse is dropped, as subtensor drops it."""
        c = self._conn
        reveal_epoch = epoch - params["reveal_period"]
        c.execute("DELETE FROM weight_commits WHERE netuid = ? AND commit_epoch < ?", (netuid, reveal_epoch))
        if reveal_epoch < 0:
            return
        commits = c.execute(
            "SELECT seq, hotkey, row, version_key FROM weight_commits WHERE netuid = ? AND commit_epoch = ? "
            "ORDER BY seq", (netuid, reveal_epoch),
        ).fetchall()
        for seq, hotkey, blob, version_key in commits:
            c.execute("DELETE FROM weight_commits WHERE seq = ?", (seq,))
            found = c.execute(
                "SELECT uid, last_update FROM neurons WHERE netuid = ? AND hotkey = ?", (netuid, hotkey)
            ).fetchone()
            if found is None:
                continue
            entries = _unpack_row(blob)
            uids, row = [int(u) for u in entries[:, 0]], [int(v) for v in entries[:, 1]]
            try:
                self._check_weights(netuid, found[0], uids, row, version_key, block, found[1], params,
                                    rate_limited=False)
            except ChainError as error:
                log.info("devnet subnet %d: the revealed weights of %s are refused (%s: %s)",
                         netuid, hotkey, error.name, error)
                continue
            c.execute("INSERT OR REPLACE INTO weights (netuid, uid, row) VALUES (?, ?, ?)",
                      (netuid, found[0], blob))

    def _commit_blocks(self, netuid: int, hotkeys: list[str], epoch: int, params: dict) -> np.ndarray:
        """Per uid, the block of its earliest commit not yet expired (NO_COMMIT when none)."""
        blocks = np.full(len(hotkeys), NO_COMMIT, dtype=np.int64)
        uid_of = {hk: u for u, hk in enumerate(hotkeys)}
        for hotkey, first in self._conn.execute(
            "SELECT hotkey, MIN(commit_block) FROM weight_commits WHERE netuid = ? AND commit_epoch + ? >= ? "
            "GROUP BY hotkey", (netuid, params["reveal_period"], epoch),
        ):
            if hotkey in uid_of:
                blocks[uid_of[hotkey]] = first
        return blocks

    def _trim_history(self, netuid: int) -> None:
        oldest_kept = self._conn.execute(
            "SELECT block FROM epochs WHERE netuid = ? ORDER BY block DESC LIMIT 1 OFFSET ?",
            (netuid, self.history_limit - 1),
        ).fetchone()
        if oldest_kept is not None:
            self._conn.execute("DELETE FROM epochs WHERE netuid = ? AND block < ?", (netuid, oldest_kept[0]))
            self._conn.execute("DELETE FROM epoch_neurons WHERE netuid = ? AND block < ?", (netuid, oldest_kept[0]))

    # ------------------------------------------------------------ Chain: reads
    async def block(self) -> int:
        return await self._read(lambda block: block)

    async def metagraph(self, netuid: int) -> MetagraphSnapshot:
        def query(block: int) -> MetagraphSnapshot:
            params = self._params(netuid)
            stake = self._stakes(netuid)
            rows = self._conn.execute(
                "SELECT uid, hotkey, coldkey, validator_permit, axon_ip, axon_port, axon_protocol, axon_version, "
                "last_update, block_at_registration, incentive, dividends, emission, rank, trust, consensus, "
                "validator_trust, active FROM neurons WHERE netuid = ? ORDER BY uid",
                (netuid,),
            ).fetchall()
            neurons = tuple(
                NeuronInfo(
                    uid=r[0], hotkey=r[1], coldkey=r[2], stake=float(stake[r[0]]), validator_permit=bool(r[3]),
                    endpoint=None if r[4] is None else Endpoint(r[4], r[5], r[6], r[7]),
                    last_update=r[8], block_at_registration=r[9], incentive=r[10], dividends=r[11],
                    emission=r[12], rank=r[13], trust=r[14], consensus=r[15], validator_trust=r[16],
                    active=bool(r[17]),
                )
                for r in rows
            )
            return MetagraphSnapshot(netuid=netuid, block=block, neurons=neurons, tempo=params["tempo"])

        return await self._read(query)

    async def hyperparameters(self, netuid: int) -> Hyperparameters:
        def query(block: int) -> Hyperparameters:
            p = self._params(netuid)
            return Hyperparameters(
                tempo=p["tempo"], weights_rate_limit=p["weights_rate_limit"], max_weight_limit=p["max_weight_limit"],
                min_allowed_weights=p["min_allowed_weights"], max_uids=p["max_uids"],
                immunity_period=p["immunity_period"], commit_reveal=p["commit_reveal"],
                weights_version=p["weights_version"],
                activity_cutoff=p["activity_cutoff"],
            )

        return await self._read(query)

    async def blocks_until_next_epoch(self, netuid: int) -> int:
        return await self._read(lambda block: blocks_until_epoch(netuid, self._params(netuid)["tempo"], block))

    async def uid_of(self, hotkey: str, netuid: int) -> int | None:
        def query(block: int) -> int | None:
            self._subnet_row(netuid)
            return self._uid(netuid, hotkey)

        return await self._read(query)

    # ------------------------------------------------------------ Chain: writes
    async def register(self, wallet, netuid: int) -> int:
        """Register the wallet's hotkey under its coldkey (free on the devnet); returns the uid."""
        return await self.register_hotkey(netuid, _hotkey_of(wallet), _coldkey_of(wallet))

    async def register_hotkey(self, netuid: int, hotkey: str, coldkey: str) -> int:
        """Devnet: register by addresses. Appends a uid, or replaces `prune_candidate`'s when full."""
        for address, what in ((hotkey, "hotkey"), (coldkey, "coldkey")):
            if not isinstance(address, str):
                raise TypeError(f"{what} must be an ss58 address string, got {address!r}")
            _checked_ss58(address, what)

        def operation(block: int) -> int:
            params = self._params(netuid)
            _, owner_hotkey, _ = self._subnet_row(netuid)
            if self._uid(netuid, hotkey) is not None:
                raise AlreadyRegistered(f"hotkey {hotkey} is already registered on subnet {netuid}")
            n = self._neuron_count(netuid)
            if n < params["max_uids"]:
                uid = n
                self._conn.execute(
                    "INSERT INTO neurons (netuid, uid, hotkey, coldkey, block_at_registration, last_update) "
                    "VALUES (?, ?, ?, ?, ?, ?)",
                    (netuid, uid, hotkey, coldkey, block, block),
                )
            else:
                uid = self._prune_for(netuid, block, params, owner_hotkey)
                self._replace_neuron(netuid, uid, hotkey, coldkey, block)
            self._refresh_early_permits(netuid)
            return uid

        return await self._write(operation)

    def _prune_for(self, netuid: int, block: int, params: dict, owner_hotkey: str | None) -> int:
        rows = self._conn.execute(
            "SELECT uid, hotkey, emission, block_at_registration FROM neurons WHERE netuid = ? ORDER BY uid",
            (netuid,),
        ).fetchall()
        registered_at = [r[3] for r in rows]
        uid = prune_candidate(
            emission=[r[2] for r in rows],
            registered_at=registered_at,
            immune=[block - at < params["immunity_period"] for at in registered_at],
            is_owner=[r[1] == owner_hotkey for r in rows],
            min_non_immune=params["min_non_immune_uids"],
        )
        if uid is None:
            raise RegistrationFailed(
                f"subnet {netuid} is full ({len(rows)} of max_uids {params['max_uids']}) and no uid can be "
                f"replaced (only the owner's); raise max_uids or try later"
            )
        return uid

    def _replace_neuron(self, netuid: int, uid: int, hotkey: str, coldkey: str, block: int) -> None:
        """The new hotkey takes `uid`: the old one's weights, bonds, scores, endpoint and permit go, and
        other rows' weights to `uid` become explicit zeros (subtensor's clear_neuron)."""
        c = self._conn
        c.execute(
            "UPDATE neurons SET hotkey = ?, coldkey = ?, block_at_registration = ?, last_update = ?, "
            "validator_permit = 0, registered_since_last_epoch = 1, axon_ip = NULL, axon_port = NULL, "
            "axon_protocol = NULL, axon_version = NULL, axon_block = NULL, active = 1, rank = 0, trust = 0, "
            "consensus = 0, incentive = 0, dividends = 0, emission = 0, validator_trust = 0 "
            "WHERE netuid = ? AND uid = ?",
            (hotkey, coldkey, block, block, netuid, uid),
        )
        c.execute("DELETE FROM weights WHERE netuid = ? AND uid = ?", (netuid, uid))
        c.execute("DELETE FROM bonds WHERE netuid = ? AND uid = ?", (netuid, uid))
        updates = []
        for row_uid, blob in c.execute("SELECT uid, row FROM weights WHERE netuid = ?", (netuid,)).fetchall():
            entries = _unpack_row(blob)
            hit = entries[:, 0] == uid
            if hit.any():
                entries[hit, 1] = 0
                updates.append((_pack_row(entries[:, 0], entries[:, 1]), netuid, row_uid))
        c.executemany("UPDATE weights SET row = ? WHERE netuid = ? AND uid = ?", updates)

    async def publish_endpoint(
        self, wallet, netuid: int, ip: str, port: int, protocol: int = 4, version: int = 1
    ) -> None:
        """ServeAxon. Raises ValueError for a bad address, NotRegistered, and RateLimited
        (ServingRateLimitExceeded) when re-published within `serving_rate_limit` blocks."""
        hotkey = _hotkey_of(wallet)
        ip, port = _checked_endpoint(ip, port, protocol, version)

        def operation(block: int) -> None:
            params = self._params(netuid)
            row = self._conn.execute(
                "SELECT uid, axon_block FROM neurons WHERE netuid = ? AND hotkey = ?", (netuid, hotkey)
            ).fetchone()
            if row is None:
                raise NotRegistered(f"hotkey {hotkey} is not registered on subnet {netuid}")
            uid, last_served = row
            limit = params["serving_rate_limit"]
            # subtensor's axon_passes_rate_limit: no limit, never served (block 0) or limit blocks since.
            if limit and last_served and block - last_served < limit:
                raise RateLimited(
                    f"uid {uid} published its endpoint at block {last_served}; the serving rate limit is "
                    f"{limit} blocks (now {block}, wait {limit - (block - last_served)} more)",
                    name="ServingRateLimitExceeded", retry_after_blocks=limit - (block - last_served),
                )
            self._conn.execute(
                "UPDATE neurons SET axon_ip = ?, axon_port = ?, axon_protocol = ?, axon_version = ?, axon_block = ? "
                "WHERE netuid = ? AND uid = ?",
                (ip, port, int(protocol), int(version), block, netuid, uid),
            )

        await self._write(operation)

    async def publish_commitment(self, wallet, netuid: int, data: str) -> None:
        """Commitments.set_commitment as subtensor runs it: the hotkey must be registered on the subnet
        (AccountNotAllowedCommit), each call uses max(100, bytes) of the hotkey's COMMITMENT_MAX_SPACE bytes per
        epoch (SpaceLimitExceeded, a RateLimited until the subnet's next epoch index), and the new commitment
        replaces the old one. Data that cannot be sent as Raw fields is a ValueError before anything happens."""
        hotkey = _hotkey_of(wallet)
        fields = commitment_fields(data)
        needed = commitment_space(fields)

        def operation(block: int) -> None:
            params = self._params(netuid)
            if self._uid(netuid, hotkey) is None:
                raise NotRegistered(f"hotkey {hotkey} is not registered on subnet {netuid}: it cannot commit",
                                    name="AccountNotAllowedCommit")
            # subtensor's get_epoch_index: (block + netuid + 1) // (tempo + 1); usage resets when it changes
            epoch = (block + netuid + 1) // (params["tempo"] + 1)
            row = self._conn.execute("SELECT epoch, used FROM commitment_space WHERE netuid = ? AND hotkey = ?",
                                     (netuid, hotkey)).fetchone()
            used = row[1] if row and row[0] == epoch else 0
            if used + needed > COMMITMENT_MAX_SPACE:
                wait = blocks_until_epoch(netuid, params["tempo"], block) + 1
                raise RateLimited(
                    f"hotkey {hotkey} used {used} of {COMMITMENT_MAX_SPACE} commitment bytes this epoch; this "
                    f"one needs {needed}", name="SpaceLimitExceeded", retry_after_blocks=wait)
            self._conn.execute("INSERT OR REPLACE INTO commitment_space (netuid, hotkey, epoch, used) "
                               "VALUES (?, ?, ?, ?)", (netuid, hotkey, epoch, used + needed))
            self._conn.execute("INSERT OR REPLACE INTO commitments (netuid, hotkey, block, data) VALUES (?, ?, ?, ?)",
                               (netuid, hotkey, block, b"".join(fields)))

        await self._write(operation)

    async def commitments(self, netuid: int) -> dict[str, Commitment]:
        def query(block: int) -> dict[str, Commitment]:
            self._params(netuid)
            rows = self._conn.execute(
                "SELECT c.hotkey, c.block, c.data FROM commitments c JOIN neurons n "
                "ON n.netuid = c.netuid AND n.hotkey = c.hotkey WHERE c.netuid = ?", (netuid,)).fetchall()
            return {hk: Commitment(hk, b, commitment_data([bytes(d)])) for hk, b, d in rows}

        return await self._read(query)

    async def set_weights(self, wallet, netuid: int, weights, version_key: int) -> SetWeightsOutcome:
        """SetWeights as the SDK and the chain do it together. `weights` is {uid: weight} (or (uid, weight)
        pairs); `chain.weights.conform` clips them to max_weight_limit (where subtensor would refuse with
        MaxWeightExceeded) and max-upscales them to u16, keeping explicit zeros (subtensor stores them). Then
        subtensor's checks in its order: registered, stake threshold (the owner is exempt), version key,
        rate limit, permit (unless a lone self-weight or the owner), duplicates, uids, length, max weight.

        With commit_reveal on, the row is committed instead (checks: registered, CommittingWeightsTooFast,
        TooManyUnrevealedCommits) and revealed before the epoch `reveal_period` epochs later, where the
        other checks run; the outcome has committed=True and extra["reveal_epoch"]."""
        hotkey = _hotkey_of(wallet)
        if isinstance(version_key, bool) or not isinstance(version_key, numbers.Integral) or version_key < 0:
            raise ValueError(f"version_key must be a non-negative integer, got {version_key!r}")
        try:
            pairs = validated_pairs(weights)
        except WeightsError as error:
            raise InvalidWeights(str(error)) from None

        def operation(block: int) -> SetWeightsOutcome:
            params = self._params(netuid)
            n = self._neuron_count(netuid)
            if len(pairs) > n:
                raise InvalidWeights(f"{len(pairs)} weights given; subnet {netuid} has only {n} uids",
                                     name="UidsLengthExceedUidsInSubNet")
            found = self._conn.execute(
                "SELECT uid, last_update FROM neurons WHERE netuid = ? AND hotkey = ?", (netuid, hotkey)
            ).fetchone()
            if found is None:
                raise NotRegistered(f"hotkey {hotkey} is not registered on subnet {netuid}")
            uid, last_update = found
            try:
                conformed = conform(pairs, uid, params["max_weight_limit"], keep_zeros=True)
            except WeightsError as error:
                raise InvalidWeights(str(error)) from None
            uids, row = list(conformed.uids), list(conformed.values)
            if params["commit_reveal"]:
                return self._commit_weights(netuid, uid, hotkey, uids, row, version_key, block, last_update, params)
            self._check_weights(netuid, uid, uids, row, version_key, block, last_update, params, rate_limited=True)
            self._conn.execute(
                "INSERT OR REPLACE INTO weights (netuid, uid, row) VALUES (?, ?, ?)",
                (netuid, uid, _pack_row(uids, row)),
            )
            self._conn.execute(
                "UPDATE neurons SET last_update = ? WHERE netuid = ? AND uid = ?", (block, netuid, uid)
            )
            return SetWeightsOutcome(block=block, uids=tuple(uids), weights_u16=tuple(row))

        return await self._write(operation)

    def _rate_limit_error(self, uid: int, last_update: int, block: int, limit: int, name: str) -> RateLimited | None:
        """Subtensor's check_rate_limit: a uid that never set weights (LastUpdate 0) passes; otherwise
        block - last_update must reach the limit."""
        if last_update == 0 or block - last_update >= limit:
            return None
        wait = limit - (block - last_update)
        return RateLimited(
            f"uid {uid} last set weights at block {last_update}; the rate limit is {limit} blocks "
            f"(now {block}, wait {wait} more)", name=name, retry_after_blocks=wait,
        )

    def _check_weights(self, netuid: int, uid: int, uids: list[int], row: list[int], version_key: int, block: int,
                       last_update: int, params: dict, rate_limited: bool) -> None:
        """Subtensor's internal_set_weights checks after registration, in its order."""
        self_weight_only = len(row) == 1 and uids[:1] == [uid]
        is_owner = self._owner_uid(netuid) == uid
        stake = float(self._stakes(netuid)[uid])
        if not is_owner and stake < params["stake_threshold"]:
            raise NotEnoughStake(
                f"uid {uid} has stake {stake}, below the subnet's stake threshold {params['stake_threshold']}"
            )
        if params["weights_version"] != 0 and version_key < params["weights_version"]:
            raise InvalidWeights(
                f"version_key {version_key} is below the subnet's weights_version {params['weights_version']}",
                name="IncorrectWeightVersionKey",
            )
        if rate_limited:
            error = self._rate_limit_error(uid, last_update, block, params["weights_rate_limit"],
                                           "SettingWeightsTooFast")
            if error is not None:
                raise error
        permit = self._conn.execute(
            "SELECT validator_permit FROM neurons WHERE netuid = ? AND uid = ?", (netuid, uid)
        ).fetchone()[0]
        if not (self_weight_only or is_owner or permit):
            raise NoValidatorPermit(f"uid {uid} has no validator permit on subnet {netuid}")
        if len(set(uids)) != len(uids):
            raise InvalidWeights("the weights name a uid more than once", name="DuplicateUids")
        n = self._neuron_count(netuid)
        invalid = [u for u in uids if not 0 <= u < n]
        if invalid:
            raise InvalidWeights(
                f"uids {invalid} are not on subnet {netuid} (it has uids 0..{n - 1})",
                name="UidVecContainInvalidOne",
            )
        if too_few_weights(len(uids), params["min_allowed_weights"], n, self_weight_only):
            raise InvalidWeights(
                f"{len(uids)} weights given; subnet {netuid} needs at least "
                f"{min(params['min_allowed_weights'], n)}", name="WeightVecLengthIsLow",
            )
        if exceeds_max_weight(row, round(params["max_weight_limit"] * U16_MAX), self_weight_only):
            raise InvalidWeights(
                f"a weight is above the subnet's max_weight_limit {params['max_weight_limit']}",
                name="MaxWeightExceeded",
            )

    def _commit_weights(self, netuid: int, uid: int, hotkey: str, uids: list[int], row: list[int],
                        version_key: int, block: int, last_update: int, params: dict) -> SetWeightsOutcome:
        error = self._rate_limit_error(uid, last_update, block, params["weights_rate_limit"],
                                       "CommittingWeightsTooFast")
        if error is not None:
            raise error
        pending = self._conn.execute(
            "SELECT COUNT(*) FROM weight_commits WHERE netuid = ? AND hotkey = ?", (netuid, hotkey)
        ).fetchone()[0]
        if pending >= MAX_UNREVEALED_COMMITS:
            raise InvalidWeights(f"{pending} commits of uid {uid} wait for their reveal",
                                 name="TooManyUnrevealedCommits")
        epoch = self._conn.execute("SELECT epoch_index FROM subnets WHERE netuid = ?", (netuid,)).fetchone()[0]
        self._conn.execute(
            "INSERT INTO weight_commits (netuid, hotkey, commit_block, commit_epoch, row, version_key) "
            "VALUES (?, ?, ?, ?, ?, ?)", (netuid, hotkey, block, epoch, _pack_row(uids, row), int(version_key)),
        )
        self._conn.execute("UPDATE neurons SET last_update = ? WHERE netuid = ? AND uid = ?", (block, netuid, uid))
        return SetWeightsOutcome(block=block, uids=tuple(uids), weights_u16=tuple(row), committed=True,
                                 extra={"commit_epoch": epoch, "reveal_epoch": epoch + params["reveal_period"]})

    async def close(self) -> None:
        self.close_sync()

    def close_sync(self) -> None:
        with self._lock:
            self._conn.close()

    # ------------------------------------------------------------ devnet administration
    async def create_subnet(self, owner, owner_hotkey: str | None = None, netuid: int | None = None,
                            **hyperparameters) -> int:
        """Create a subnet owned by `owner` (a wallet or a coldkey ss58); returns its netuid (the lowest
        free one from 1; 0 is subtensor's root). Keyword arguments are hyperparameters (HYPERPARAMETERS).
        A wallet owner's hotkey, when its file exists, becomes the owner hotkey (never pruned)."""
        owner_coldkey = _coldkey_of(owner)
        if owner_hotkey is None and not isinstance(owner, str):
            try:
                owner_hotkey = owner.hotkey.ss58_address
            except Exception:  # a coldkey-only wallet has no hotkey file; the subnet then has no owner hotkey
                owner_hotkey = None
        params = {name: spec.default for name, spec in HYPERPARAMETERS.items()}
        for name, value in hyperparameters.items():
            params[name] = coerce_hyperparameter(name, value)
        yuma_params(params)  # the Yuma parameters must also agree with each other
        if netuid is not None and (isinstance(netuid, bool) or not isinstance(netuid, int) or not 1 <= netuid <= 65535):
            raise ValueError(f"netuid must be an integer in [1, 65535], got {netuid!r}")

        def operation(block: int) -> int:
            taken = {r[0] for r in self._conn.execute("SELECT netuid FROM subnets")}
            chosen = netuid
            if chosen is None:
                chosen = next(i for i in range(1, len(taken) + 2) if i not in taken)
            elif chosen in taken:
                raise ValueError(f"subnet {chosen} already exists on {self.path}")
            self._conn.execute(
                "INSERT INTO subnets (netuid, owner_coldkey, owner_hotkey, created_block, epochs_through) "
                "VALUES (?, ?, ?, ?, ?)",
                (chosen, owner_coldkey, owner_hotkey, block, block),
            )
            self._conn.executemany(
                "INSERT INTO subnet_params (netuid, name, value) VALUES (?, ?, ?)",
                [(chosen, name, value) for name, value in params.items()],
            )
            return chosen

        return await self._write(operation)

    async def set_hyperparameter(self, netuid: int, name: str, value) -> Any:
        """Set one hyperparameter (sudo on the devnet); returns the value stored. Epochs due under the old
        value run first."""
        value = coerce_hyperparameter(name, value)

        def operation(block: int) -> Any:
            params = self._params(netuid)
            params[name] = value
            yuma_params(params)
            if name == "max_uids" and value < self._neuron_count(netuid):
                raise ValueError(
                    f"subnet {netuid} has {self._neuron_count(netuid)} uids; max_uids cannot go below that"
                )
            self._conn.execute(
                "INSERT OR REPLACE INTO subnet_params (netuid, name, value) VALUES (?, ?, ?)", (netuid, name, value)
            )
            if name in ("max_validators", "stake_threshold"):
                self._refresh_early_permits(netuid)
            if name == "tempo":
                # Epochs due under the old tempo ran at the start of this transaction; the new one starts now.
                self._conn.execute("UPDATE subnets SET epochs_through = ? WHERE netuid = ?", (block, netuid))
            return value

        return await self._write(operation)

    async def add_stake(self, coldkey, hotkey, netuid: int, amount: float) -> float:
        """Stake `amount` from a coldkey (wallet or ss58) to a registered hotkey (wallet or ss58) on the
        subnet; returns the hotkey's total stake there."""
        return await self._change_stake(_coldkey_of(coldkey), _hotkey_of(hotkey), netuid, _stake_amount(amount))

    async def remove_stake(self, coldkey, hotkey, netuid: int, amount: float) -> float:
        """Unstake; NotEnoughStake when the coldkey staked less than `amount` to the hotkey."""
        return await self._change_stake(_coldkey_of(coldkey), _hotkey_of(hotkey), netuid, -_stake_amount(amount))

    async def _change_stake(self, coldkey: str, hotkey: str, netuid: int, delta: float) -> float:
        def operation(block: int) -> float:
            self._subnet_row(netuid)
            uid = self._uid(netuid, hotkey)
            if uid is None:
                raise NotRegistered(f"hotkey {hotkey} is not registered on subnet {netuid}; register it first")
            row = self._conn.execute(
                "SELECT amount FROM stakes WHERE netuid = ? AND hotkey = ? AND coldkey = ?", (netuid, hotkey, coldkey)
            ).fetchone()
            current = row[0] if row else 0.0
            if current + delta < 0:
                raise NotEnoughStake(f"coldkey {coldkey} has {current} staked to {hotkey}; cannot remove {-delta}")
            self._conn.execute(
                "INSERT OR REPLACE INTO stakes (netuid, hotkey, coldkey, amount) VALUES (?, ?, ?, ?)",
                (netuid, hotkey, coldkey, current + delta),
            )
            self._refresh_early_permits(netuid)
            return float(self._stakes(netuid)[uid])

        return await self._write(operation)

    async def trigger_epoch(self, netuid: int, emission_budget: float | None = None) -> EpochRecord:
        """Run the subnet's epoch now, at the current block, after this block's transactions so far (what
        subtensor's tests do with SubtensorModule::epoch); `emission_budget` defaults to the tempo's. It
        counts as the latest epoch for the bonds mask but leaves the commit-reveal clock alone (no reveal,
        the epoch counter unchanged), as SubtensorModule::epoch does."""
        if emission_budget is not None and not (0 <= float(emission_budget) < math.inf):
            raise ValueError(f"emission_budget must be a finite number >= 0, got {emission_budget!r}")

        def operation(block: int) -> None:
            self._subnet_row(netuid)
            self._run_epoch(netuid, block, None if emission_budget is None else float(emission_budget),
                            scheduled=False)

        await self._write(operation)
        return await self.last_epoch(netuid)

    async def set_validator_permits(self, netuid: int, permits) -> None:
        """Sudo: overwrite the stored validator permits (one bool per uid), as a storage write would; the next
        epoch uses them and grants its own."""
        flags = [bool(p) for p in permits]

        def operation(block: int) -> None:
            self._subnet_row(netuid)
            if len(flags) != self._neuron_count(netuid):
                raise ValueError(f"give one permit per uid: subnet {netuid} has {self._neuron_count(netuid)} uids")
            self._conn.executemany("UPDATE neurons SET validator_permit = ? WHERE netuid = ? AND uid = ?",
                                   [(int(p), netuid, u) for u, p in enumerate(flags)])
            self._conn.execute("UPDATE subnets SET permits_from_epoch = 1 WHERE netuid = ?", (netuid,))

        await self._write(operation)

    async def reset_bonds(self, netuid: int, hotkey) -> bool:
        """Subtensor's do_reset_bonds: with the subnet's bonds_reset on, every bond held to the hotkey's uid is
        removed. Returns whether anything was reset."""
        hotkey = _hotkey_of(hotkey)

        def operation(block: int) -> bool:
            params = self._params(netuid)
            uid = self._uid(netuid, hotkey)
            if not params["bonds_reset"] or uid is None:
                return False
            updates = []
            for row_uid, blob in self._conn.execute("SELECT uid, row FROM bonds WHERE netuid = ?", (netuid,)).fetchall():
                entries = _unpack_row(blob)
                keep = entries[:, 0] != uid
                updates.append((_pack_row(entries[keep, 0], entries[keep, 1]), netuid, row_uid))
            self._conn.executemany("UPDATE bonds SET row = ? WHERE netuid = ? AND uid = ?", updates)
            return True

        return await self._write(operation)

    async def pending_commits(self, netuid: int) -> list[dict[str, Any]]:
        """Commit-reveal: the committed rows not yet revealed, oldest first."""

        def query(block: int) -> list[dict[str, Any]]:
            self._subnet_row(netuid)
            return [
                {"hotkey": hk, "commit_block": cb, "commit_epoch": ce, "version_key": vk,
                 "weights": {int(t): int(v) for t, v in _unpack_row(blob)}}
                for hk, cb, ce, blob, vk in self._conn.execute(
                    "SELECT hotkey, commit_block, commit_epoch, row, version_key FROM weight_commits "
                    "WHERE netuid = ? ORDER BY seq", (netuid,))
            ]

        return await self._read(query)

    async def run_pending_epochs(self) -> int:
        """Run every epoch that has fallen due (any read or write does this too); returns how many ran."""
        return await self._write(lambda block: self._epochs_ran)

    async def advance_blocks(self, blocks: int) -> int:
        """Move the clock forward by `blocks` for every process (genesis moves back); the epochs that fall
        due run at once. Returns the new block."""
        if isinstance(blocks, bool) or not isinstance(blocks, int) or blocks < 0:
            raise ValueError(f"blocks must be a non-negative integer, got {blocks!r}")

        def operation(block: int) -> int:
            self._conn.execute(
                "UPDATE meta SET value = ? WHERE key = 'genesis_time'",
                (repr(float(self._conn.execute("SELECT value FROM meta WHERE key = 'genesis_time'").fetchone()[0])
                      - blocks * self.block_interval),),
            )
            now = self._clock()
            self._run_due_epochs(now)
            return now

        return await self._write(operation)

    async def subnets(self) -> list[int]:
        return await self._read(
            lambda block: [r[0] for r in self._conn.execute("SELECT netuid FROM subnets ORDER BY netuid")]
        )

    async def subnet_info(self, netuid: int) -> dict[str, Any]:
        """Owner, creation block and the block through which epochs have run."""

        def query(block: int) -> dict[str, Any]:
            self._subnet_row(netuid)
            row = self._conn.execute(
                "SELECT owner_coldkey, owner_hotkey, created_block, epochs_through, permits_from_epoch "
                "FROM subnets WHERE netuid = ?", (netuid,),
            ).fetchone()
            return dict(zip(("owner_coldkey", "owner_hotkey", "created_block", "epochs_through",
                             "permits_from_epoch"), row[:4] + (bool(row[4]),)))

        return await self._read(query)

    async def subnet_parameters(self, netuid: int) -> dict[str, Any]:
        """Every hyperparameter of the subnet, devnet-only ones included."""
        return await self._read(lambda block: self._params(netuid))

    async def weights(self, netuid: int) -> dict[int, dict[int, int]]:
        """Stored weight rows: uid -> {target uid: u16} (explicit zeros kept)."""
        return await self._read(lambda block: (self._subnet_row(netuid), self._sparse("weights", netuid))[1])

    async def bonds(self, netuid: int) -> dict[int, dict[int, int]]:
        """Stored bonds after the last epoch: uid -> {target uid: u16}."""
        return await self._read(lambda block: (self._subnet_row(netuid), self._sparse("bonds", netuid))[1])

    async def epoch_history(
        self, netuid: int, limit: int | None = 10, since_block: int | None = None
    ) -> list[EpochRecord]:
        """The latest `limit` epochs (all kept ones when None) after `since_block`, oldest first."""

        def query(block: int) -> list[EpochRecord]:
            self._subnet_row(netuid)
            sql = "SELECT block, emission_budget FROM epochs WHERE netuid = ? AND block > ? ORDER BY block DESC"
            args: list = [netuid, -1 if since_block is None else since_block]
            if limit is not None:
                sql += " LIMIT ?"
                args.append(int(limit))
            epochs = self._conn.execute(sql, args).fetchall()[::-1]
            if not epochs:
                return []
            by_block: dict[int, list[EpochNeuron]] = {b: [] for b, _ in epochs}
            for r in self._conn.execute(
                "SELECT block, uid, hotkey, stake, active, validator_permit, rank, trust, consensus, incentive, "
                "dividends, emission, validator_trust, miner_emission, validator_emission, bonds, stake_weight, "
                "active_stake, permit_used FROM epoch_neurons "
                "WHERE netuid = ? AND block >= ? AND block <= ? ORDER BY block, uid",
                (netuid, epochs[0][0], epochs[-1][0]),
            ):
                if r[0] in by_block:
                    by_block[r[0]].append(EpochNeuron(
                        uid=r[1], hotkey=r[2], stake=r[3], active=bool(r[4]), validator_permit=bool(r[5]),
                        rank=r[6], trust=r[7], consensus=r[8], incentive=r[9], dividends=r[10], emission=r[11],
                        validator_trust=r[12], miner_emission=r[13], validator_emission=r[14],
                        bonds={int(t): int(v) for t, v in _unpack_row(r[15] or b"")},
                        stake_weight=r[16] or 0.0, active_stake=r[17] or 0.0, permit_used=bool(r[18]),
                    ))
            return [EpochRecord(netuid, b, budget, tuple(by_block[b])) for b, budget in epochs]

        return await self._read(query)

    async def last_epoch(self, netuid: int) -> EpochRecord | None:
        history = await self.epoch_history(netuid, limit=1)
        return history[-1] if history else None
