"""An in-memory subtensor behind the bittensor SDK's `bt.Substrate` protocol.

`bt.Subtensor(net, substrate=FakeSubstrate(...))` runs the SDK's real client,
reads and intent code (preflight, weight conforming, commit-reveal, the MEV
shield) against this object instead of a websocket. It answers where the SDK
looks, in the shapes the SDK decodes:

- storage reads keyed by (module, item, params), derived from the subnets and
  neurons held here, with the chain's defaults for value-type items;
- `runtime_call("SubnetInfoRuntimeApi", "get_metagraph", [netuid])` returning
  the runtime's metagraph record (u16 scores, rao amounts, packed axon ips),
  and `get_next_epoch_start_block`;
- `compose` returns the generated `Call` unchanged (tests read `composed`),
  `estimate_fee`, `account_next_index`, `mev_next_key`, `sign_extrinsic`,
  `find_extrinsic`;
- `submit` checks the signer's real signature and nonce, then either applies
  the call (registration, axon, weights, timelocked commits, Commitments'
  set_commitment with its field and per-epoch space limits; each block holds
  one extrinsic) or returns the outcome scripted for that call: a dispatch
  error inside a block or a transaction-pool rejection, built as the SDK's RPC
  backend builds them;
- connection trouble as the SDK reports it: `RpcConnectionError` for a refused
  or dropped node, a nameless `ChainError` raised from the OS error for a
  socket lost mid-submit, and a silent node that never answers.

State is the chain head's: reads at an older block see current storage, except
the metagraph record, which carries the block it was asked for.
"""
from __future__ import annotations

import asyncio
import hashlib
import ipaddress
from collections import defaultdict, deque
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Optional

import bittensor as bt
import bittensor_core
from bittensor._generated.calls import Call
from bittensor._generated.errors import ERRORS
from bittensor.result import chain_error_from_substrate_request

U16_MAX = 65535
ERROR_DOCS = {info.name: info.docs for info in ERRORS.values()}

# An ML-KEM-768 encapsulation key (1184 bytes). All-zero is a well-formed key;
# the fake never decrypts, it executes the sealed extrinsic it was shown.
SHIELD_KEY = bytes(1184)


# ------------------------------------------------------------------ scripted outcomes
@dataclass(frozen=True)
class DispatchError:
    """The extrinsic is included in a block and fails there with a module error."""

    name: str


@dataclass(frozen=True)
class PoolRejection:
    """The node refuses the extrinsic before inclusion, with this RPC error text
    (e.g. "Invalid Transaction: Custom error: 12", "Priority is too low: (1 vs 1)")."""

    message: str


@dataclass(frozen=True)
class ConnectionDrop:
    """The websocket dies while the extrinsic is being submitted."""


# ------------------------------------------------------------------ chain state
@dataclass
class FakeNeuron:
    hotkey: str
    coldkey: str
    alpha_stake_rao: int = 0
    tao_stake_rao: int = 0
    validator_permit: bool = False
    active: bool = True
    last_update: int = 0
    block_at_registration: int = 0
    rank: int = 0  # u16 scores, as the runtime reports them
    trust: int = 0
    consensus: int = 0
    incentive: int = 0
    dividends: int = 0
    pruning_score: int = 0
    emission_rao: int = 0
    axon: Optional[dict] = None

    def serve(self, ip: str, port: int, *, protocol: int = 4, version: int = 1, block: int = 0) -> None:
        address = ipaddress.ip_address(ip)
        self.axon = {
            "block": block, "version": version, "ip": int(address), "port": port,
            "ip_type": address.version, "protocol": protocol, "placeholder1": 0, "placeholder2": 0,
        }


@dataclass
class FakeSubnet:
    netuid: int
    owner_hotkey: str
    owner_coldkey: str
    tempo: int = 100
    weights_rate_limit: int = 100
    max_weights_limit: int = U16_MAX
    min_allowed_weights: int = 1
    max_allowed_uids: int = 256
    immunity_period: int = 5000
    activity_cutoff: int = 5000
    activity_cutoff_factor_milli: int = 0
    commit_reveal: bool = False
    reveal_period_epochs: int = 1
    weights_version: int = 0
    last_epoch_block: Optional[int] = None  # None: epochs every `tempo` blocks, aligned to 0
    epoch_index: int = 0
    burn_rao: int = 1_000_000_000
    consensus: str = "Yuma"
    name: str = "k3"
    symbol: str = "\u03b1"
    neurons: list[FakeNeuron] = field(default_factory=list)
    weights: dict[int, list[tuple[int, int]]] = field(default_factory=dict)
    commits: list[dict] = field(default_factory=list)

    def uid_of(self, hotkey: str) -> Optional[int]:
        for uid, neuron in enumerate(self.neurons):
            if neuron.hotkey == hotkey:
                return uid
        return None


@dataclass
class Submission:
    """One extrinsic the fake was asked to submit, signature checked."""

    call: Call
    signer: str
    nonce: int
    shielded: bool = False


def block_hash_of(block: int) -> str:
    return "0x" + block.to_bytes(32, "big").hex()


def block_of_hash(block_hash: str) -> int:
    return int(block_hash, 16)


class FakeSubstrate:
    """See the module docstring. `head` is the chain tip; each included extrinsic
    adds a block."""

    def __init__(self, *, head: int = 1000, block_time: float = 0.01, shield: bool = True, endpoint: str = "fake"):
        self.endpoint = endpoint
        self.head = head
        self._block_time = block_time
        self.shield_key: Optional[bytes] = SHIELD_KEY if shield else None
        self.subnets: dict[int, FakeSubnet] = {}
        self.token_symbols: dict[int, str] = {}
        self.nonces: dict[str, int] = defaultdict(int)
        self.fee_rao = 20_000
        # Commitments pallet: CommitmentOf records and UsedSpaceOf (epoch index, bytes used), by (netuid, hotkey)
        self.commitments: dict[tuple[int, str], dict] = {}
        self.commitment_usage: dict[tuple[int, str], tuple[int, int]] = {}
        self.commitment_max_space = 3100
        # Observations for tests.
        self.composed: list[Call] = []
        self.submitted: list[Submission] = []
        self.read_log: list[tuple] = []
        self.connects = 0
        self.closed = False
        # Failure injection.
        self.unreachable = False
        self.silent = False
        self._read_failures = 0
        self._read_error: Optional[BaseException] = None
        self._outcomes: dict[str, deque] = defaultdict(deque)
        self._sealed: dict[str, tuple[Call, str, int]] = {}
        self._included: dict[tuple[str, str], bt.ExtrinsicResult] = {}
        self._events: dict[int, list[dict]] = defaultdict(list)
        self._silence = asyncio.Event()  # never set: a silent node

    # -------------------------------------------------------------- test set-up
    def add_subnet(self, netuid: int, owner_hotkey: str, owner_coldkey: str, **params) -> FakeSubnet:
        subnet = FakeSubnet(netuid, owner_hotkey, owner_coldkey, **params)
        self.subnets[netuid] = subnet
        self.token_symbols[netuid] = subnet.symbol
        return subnet

    def add_neuron(self, netuid: int, hotkey: str, coldkey: str, **params) -> int:
        subnet = self.subnets[netuid]
        subnet.neurons.append(FakeNeuron(hotkey, coldkey, block_at_registration=self.head, **params))
        return len(subnet.neurons) - 1

    def last_epoch(self, subnet: FakeSubnet) -> int:
        if subnet.last_epoch_block is not None:
            return subnet.last_epoch_block
        return self.head - self.head % subnet.tempo if subnet.tempo else 0

    def script(self, function: str, *outcomes) -> None:
        """Queue outcomes for the next submissions of `function` (e.g. "set_mechanism_weights")."""
        self._outcomes[function].extend(outcomes)

    def fail_reads(self, count: int, error: Optional[BaseException] = None) -> None:
        """The next `count` chain reads fail as a dropped connection does (or with `error`:
        the RPC backend lets a transport TimeoutError through unwrapped)."""
        self._read_failures = count
        self._read_error = error

    def submissions(self, function: str) -> list[Submission]:
        return [s for s in self.submitted if s.call.function == function]

    def composed_calls(self, function: str) -> list[Call]:
        return [c for c in self.composed if c.function == function]

    # -------------------------------------------------------------- plumbing
    async def _reach(self, what: str, *key) -> None:
        """Every chain round-trip passes here: log it, then fail or stall if told to."""
        self.read_log.append((what, *key))
        if self.silent:
            await self._silence.wait()
        if self._read_failures > 0:
            self._read_failures -= 1
            raise self._read_error or bt.RpcConnectionError(
                f"connection to {self.endpoint} closed (code 1006) during {what}")

    def balance(self, rao: int, netuid: int = 0) -> bt.Balance:
        symbol = self.token_symbols.get(netuid) if netuid else None
        return bt.Balance(int(rao), netuid, symbol)

    # -------------------------------------------------------------- lifecycle
    async def connect(self) -> None:
        self.connects += 1
        if self.unreachable:
            raise bt.RpcConnectionError(f"could not connect to any endpoint: [Errno 111] Connect call failed ({self.endpoint})")
        if self.silent:
            await self._silence.wait()

    async def close(self) -> None:
        self.closed = True

    # -------------------------------------------------------------- block reads
    async def block_hash(self, block: Optional[int] = None) -> Optional[str]:
        await self._reach("block_hash", block)
        if block is None:
            return block_hash_of(self.head)
        return block_hash_of(block) if 0 <= block <= self.head else None

    async def block_number(self) -> int:
        await self._reach("block_number")
        return self.head

    async def finalized_block_number(self) -> int:
        await self._reach("finalized_block_number")
        return self.head

    async def block_time(self) -> float:
        return self._block_time

    async def spec_version(self) -> int:
        return 400

    async def get_block(self, block_number: Optional[int] = None, block_hash: Optional[str] = None) -> Optional[dict]:
        await self._reach("get_block", block_number, block_hash)
        number = block_of_hash(block_hash) if block_hash else (self.head if block_number is None else block_number)
        if number > self.head:
            return None
        return {"header": {"number": number, "hash": block_hash_of(number)}, "extrinsics": []}

    async def events(self, block_hash: Optional[str] = None) -> list[dict]:
        await self._reach("events", block_hash)
        return list(self._events[block_of_hash(block_hash) if block_hash else self.head])

    async def blocks(self, *, finalized: bool = False) -> AsyncIterator[dict]:
        seen = None
        while True:
            await self._reach("blocks")
            if self.head != seen:
                seen = self.head
                yield {"header": {"number": seen, "parentHash": block_hash_of(max(seen - 1, 0))}}
            await asyncio.sleep(self._block_time)

    # -------------------------------------------------------------- storage
    def _subtensor_item(self, item: str, params: list) -> Any:
        """SubtensorModule storage, from the subnets held here (chain defaults otherwise)."""
        netuid = params[0] if params else None
        subnet = self.subnets.get(netuid) if isinstance(netuid, int) else None
        per_subnet = {
            "Tempo": ("tempo", 360),
            "WeightsSetRateLimit": ("weights_rate_limit", 100),
            "MaxWeightsLimit": ("max_weights_limit", U16_MAX),
            "MinAllowedWeights": ("min_allowed_weights", 0),
            "MaxAllowedUids": ("max_allowed_uids", 256),
            "ImmunityPeriod": ("immunity_period", 4096),
            "ActivityCutoff": ("activity_cutoff", 5000),
            "ActivityCutoffFactorMilli": ("activity_cutoff_factor_milli", 0),
            "CommitRevealWeightsEnabled": ("commit_reveal", False),
            "RevealPeriodEpochs": ("reveal_period_epochs", 1),
            "WeightsVersionKey": ("weights_version", 0),
            "SubnetEpochIndex": ("epoch_index", 0),
            "Burn": ("burn_rao", 1_000_000_000),
            "SubnetEpochConsensus": ("consensus", "Yuma"),
        }
        if item in per_subnet:
            attr, default = per_subnet[item]
            return getattr(subnet, attr) if subnet else default
        if item == "NetworksAdded":
            return subnet is not None
        if item == "SubnetworkN":
            return len(subnet.neurons) if subnet else 0
        if item == "LastEpochBlock":
            return self.last_epoch(subnet) if subnet else 0
        if item == "BlocksSinceLastStep":
            return self.head - self.last_epoch(subnet) if subnet else 0
        if item in ("PendingEpochAt", "CollateralLockShare"):
            return 0
        if item == "Uids":  # an OptionQuery: None when not registered
            return subnet.uid_of(params[1]) if subnet else None
        if item == "Keys":
            return subnet.neurons[params[1]].hotkey if subnet and params[1] < len(subnet.neurons) else None
        if item == "LastUpdate":  # keyed by the mechanism storage index (= netuid for mechanism 0)
            return [n.last_update for n in subnet.neurons] if subnet else []
        if item == "ValidatorPermit":
            return [n.validator_permit for n in subnet.neurons] if subnet else []
        if item == "Axons":
            if not subnet:
                return None
            uid = subnet.uid_of(params[1])
            return None if uid is None else subnet.neurons[uid].axon
        return None

    def _storage(self, module: str, item: str, params: list) -> Any:
        if module == "SubtensorModule":
            return self._subtensor_item(item, params)
        if module == "MevShield" and item == "NextKey":
            return self.shield_key
        if module == "System" and item == "Account":
            return {"nonce": self.nonces[params[0]], "data": {"free": 10**12, "reserved": 0}}
        return None

    async def query(self, module: str, storage_function: str, params: Optional[list] = None,
                    block_hash: Optional[str] = None) -> Any:
        await self._reach("query", module, storage_function, tuple(params or []))
        return self._storage(module, storage_function, list(params or []))

    async def map_has_entries(self, module: str, storage_function: str, params: list,
                              block_hash: Optional[str] = None) -> bool:
        return bool(await self.query_map(module, storage_function, params, block_hash))

    async def query_map(self, module: str, storage_function: str, params: Optional[list] = None,
                        block_hash: Optional[str] = None) -> list[tuple[Any, Any]]:
        await self._reach("query_map", module, storage_function, tuple(params or []))
        if (module, storage_function) == ("SubtensorModule", "TokenSymbol"):
            return [(netuid, list(symbol.encode())) for netuid, symbol in self.token_symbols.items()]
        if (module, storage_function) == ("SubtensorModule", "Uids") and params:
            subnet = self.subnets.get(params[0])
            return [(n.hotkey, uid) for uid, n in enumerate(subnet.neurons)] if subnet else []
        if (module, storage_function) == ("Commitments", "CommitmentOf") and params:
            return [(hk, record) for (netuid, hk), record in self.commitments.items() if netuid == params[0]]
        return []  # revealed commitments and the rest: nothing stored

    async def query_batch(self, module: str, storage_function: str, param_sets: list[list],
                          block_hash: Optional[str] = None) -> list[Any]:
        return [await self.query(module, storage_function, p, block_hash) for p in param_sets]

    async def constant(self, module: str, name: str) -> Any:
        await self._reach("constant", module, name)
        known = {("Aura", "SlotDuration"): int(self._block_time * 1000),
                 ("SubtensorModule", "InitialStartCallDelay"): 0}
        if (module, name) not in known:
            raise bt.ChainError(f"constant {module}.{name} is not modelled by the fake")
        return known[(module, name)]

    async def decode_scale(self, type_string: str, data: Any) -> Any:
        raise NotImplementedError("the fake does not carry SCALE type metadata")

    # -------------------------------------------------------------- runtime APIs
    async def runtime_call(self, api: str, method: str, params: list, block_hash: Optional[str] = None) -> Any:
        await self._reach("runtime_call", api, method, tuple(params), block_hash)
        block = block_of_hash(block_hash) if block_hash else self.head
        if (api, method) == ("SubnetInfoRuntimeApi", "get_metagraph"):
            subnet = self.subnets.get(params[0])
            return None if subnet is None else self._metagraph_record(subnet, block)
        if (api, method) == ("SubnetInfoRuntimeApi", "get_next_epoch_start_block"):
            subnet = self.subnets.get(params[0])
            if subnet is None or subnet.tempo == 0:
                return None
            return self.last_epoch(subnet) + subnet.tempo
        raise bt.ChainError(f"runtime API {api}.{method} is not modelled by the fake")

    def _metagraph_record(self, subnet: FakeSubnet, block: int) -> dict:
        """The decoded `Metagraph` runtime record (subtensor's SubnetInfoRuntimeApi)."""
        neurons = subnet.neurons
        return {
            "netuid": subnet.netuid,
            "name": list(subnet.name.encode()),  # compact-u16 vectors of utf-8 bytes on the wire
            "symbol": list(subnet.symbol.encode()),
            "identity": None,
            "network_registered_at": 0,
            "owner_hotkey": subnet.owner_hotkey,
            "owner_coldkey": subnet.owner_coldkey,
            "block": block,
            "tempo": subnet.tempo,
            "last_step": self.last_epoch(subnet),
            "blocks_since_last_step": block - self.last_epoch(subnet),
            "num_uids": len(neurons),
            "max_uids": subnet.max_allowed_uids,
            "tao_in": 10**12,
            "alpha_in": 2 * 10**12,
            "moving_price": {"bits": 2**31},
            "hotkeys": [n.hotkey for n in neurons],
            "coldkeys": [n.coldkey for n in neurons],
            "identities": [None for _ in neurons],
            "axons": [n.axon or {"block": 0, "version": 0, "ip": 0, "port": 0, "ip_type": 0, "protocol": 0,
                                 "placeholder1": 0, "placeholder2": 0} for n in neurons],
            "active": [n.active for n in neurons],
            "validator_permit": [n.validator_permit for n in neurons],
            "pruning_score": [n.pruning_score for n in neurons],
            "last_update": [n.last_update for n in neurons],
            "emission": [n.emission_rao for n in neurons],
            "dividends": [n.dividends for n in neurons],
            "incentives": [n.incentive for n in neurons],
            "consensus": [n.consensus for n in neurons],
            "trust": [n.trust for n in neurons],
            "rank": [n.rank for n in neurons],
            "block_at_registration": [n.block_at_registration for n in neurons],
            "alpha_stake": [n.alpha_stake_rao for n in neurons],
            "tao_stake": [n.tao_stake_rao for n in neurons],
            "total_stake": [n.alpha_stake_rao + n.tao_stake_rao for n in neurons],
        }

    # -------------------------------------------------------------- calls and fees
    async def compose(self, call) -> Call:
        await self._reach("compose", getattr(call, "function", None))
        if not isinstance(call, Call):
            raise bt.ChainError(f"compose expects a generated Call, got {type(call).__name__}")
        self.composed.append(call)
        return call  # unchanged, so tests can read what the SDK built

    async def estimate_fee(self, call, keypair) -> bt.Balance:
        await self._reach("estimate_fee")
        return bt.Balance.from_rao(self.fee_rao)

    async def estimate_weight(self, call, keypair) -> dict:
        return {"ref_time": 1_000_000, "proof_size": 0}

    async def account_next_index(self, address: str) -> int:
        await self._reach("account_next_index", address)
        return self.nonces[address]

    async def mev_next_key(self) -> Optional[bytes]:
        await self._reach("mev_next_key")
        return self.shield_key

    # -------------------------------------------------------------- signing
    @staticmethod
    def _payload(call: Call, nonce: int) -> bytes:
        return repr((call.module, call.function, sorted(call.params.items()), nonce)).encode()

    def _signed_by(self, call: Call, keypair, nonce: int) -> bool:
        """Sign the payload with the signer the SDK handed over and verify it
        against the signer's address, as the node's signature check would."""
        payload = self._payload(call, nonce)
        signature = bytes(keypair.sign(payload))
        return bool(bittensor_core.verify(payload, signature, keypair.ss58_address))

    async def sign_extrinsic(self, call, keypair, *, nonce: int, period: int) -> tuple[bytes, str]:
        await self._reach("sign_extrinsic")
        if not self._signed_by(call, keypair, nonce):
            raise bt.ChainError("bad signature")
        raw = self._payload(call, nonce)
        extrinsic_hash = "0x" + hashlib.blake2b(raw, digest_size=32).hexdigest()
        self._sealed[extrinsic_hash] = (call, keypair.ss58_address, nonce)
        return raw, extrinsic_hash

    async def find_extrinsic(self, extrinsic_hash: str, block_hash: str) -> Optional[bt.ExtrinsicResult]:
        await self._reach("find_extrinsic", extrinsic_hash, block_hash)
        return self._included.get((block_hash, extrinsic_hash))

    # -------------------------------------------------------------- submission
    async def submit(self, call, keypair, *, nonce: Optional[int] = None, period: Optional[int] = 128,
                     wait_for_inclusion: bool = True, wait_for_finalization: bool = True) -> bt.ExtrinsicResult:
        await self._reach("submit", call.function)
        signer = keypair.ss58_address
        expected = self.nonces[signer]
        nonce = expected if nonce is None else nonce
        if not self._signed_by(call, keypair, nonce):
            return self._pool_rejection("Invalid Transaction: Transaction has a bad signature")
        if nonce < expected:
            return self._pool_rejection("Invalid Transaction: Transaction is outdated")
        if nonce > expected:
            return self._pool_rejection("Invalid Transaction: Transaction will be valid in the future")
        outcome = self._outcomes[call.function].popleft() if self._outcomes[call.function] else None
        if isinstance(outcome, ConnectionDrop):
            # RpcSubstrate._failed_submit: a non-RPC failure is re-raised as a
            # nameless ChainError from the original error.
            try:
                raise ConnectionResetError(104, "Connection reset by peer")
            except ConnectionResetError as error:
                raise bt.ChainError(str(error)) from error
        if isinstance(outcome, PoolRejection):
            return self._pool_rejection(outcome.message)
        self.submitted.append(Submission(call, signer, nonce))
        if not wait_for_inclusion and not wait_for_finalization:
            return bt.ExtrinsicResult(success=True, message="Submitted (not waiting).")
        result = self._include(call, signer, outcome)
        if result.success and (call.module, call.function) == ("MevShield", "submit_encrypted"):
            self._reveal_sealed(signer, block_hash_of(self.head))
        return result

    def _pool_rejection(self, message: str) -> bt.ExtrinsicResult:
        """As RpcSubstrate reports a pool refusal: failed, not included, nonce untouched."""
        error = chain_error_from_substrate_request(Exception(message))
        return bt.ExtrinsicResult(success=False, message=error.message, error=error)

    def _include(self, call: Call, signer: str, outcome: Any, index: int = 1) -> bt.ExtrinsicResult:
        """Include one extrinsic in a new block, apply it, and report it as the
        RPC backend does (block hash, "block-index" id, fee, events)."""
        self.head += 1
        self.nonces[signer] += 1
        block_hash = block_hash_of(self.head)
        extrinsic_id = f"{self.head}-{index:04d}"
        if outcome is None:
            name = self._apply(call, signer)
            outcome = DispatchError(name) if name else None
        if isinstance(outcome, DispatchError):
            text = ERROR_DOCS.get(outcome.name) or outcome.name
            self._events[self.head].append({"event": {"module_id": "System", "event_id": "ExtrinsicFailed",
                                                      "attributes": {"dispatch_error": outcome.name}}})
            return bt.ExtrinsicResult(success=False, message=text, block_hash=block_hash,
                                      extrinsic_id=extrinsic_id, error=bt.ChainError(text, outcome.name))
        events = [{"event": {"module_id": "System", "event_id": "ExtrinsicSuccess", "attributes": {}}}]
        self._events[self.head].extend(events)
        return bt.ExtrinsicResult(success=True, message="Success", block_hash=block_hash, extrinsic_id=extrinsic_id,
                                  fee=bt.Balance.from_rao(self.fee_rao), events=events)

    def _reveal_sealed(self, signer: str, block_hash: str) -> None:
        """The block author decrypts the carrier and runs the inner extrinsic in
        the same block; it is found there by its own hash."""
        for extrinsic_hash, (call, sealed_by, _nonce) in list(self._sealed.items()):
            if sealed_by != signer:
                continue
            del self._sealed[extrinsic_hash]
            self.submitted.append(Submission(call, signer, _nonce, shielded=True))
            outcome = self._outcomes[call.function].popleft() if self._outcomes[call.function] else None
            if outcome is not None and not isinstance(outcome, DispatchError):
                raise ValueError(f"a sealed extrinsic can only fail in its block, not with {outcome!r}")
            self.head -= 1  # same block as the carrier
            self._included[(block_hash, extrinsic_hash)] = self._include(call, signer, outcome, index=2)

    def _apply(self, call: Call, signer: str) -> Optional[str]:
        """The state change a successful call makes; a chain error name when the
        chain itself would refuse it."""
        params = call.params
        subnet = self.subnets.get(params.get("netuid"))
        if call.module == "MevShield":
            return None
        if (call.module, call.function) == ("Commitments", "set_commitment"):
            return self._set_commitment(subnet, signer, params["info"])
        if subnet is None:
            return "SubnetNotExists"
        if call.function == "burned_register":
            if subnet.uid_of(params["hotkey"]) is not None:
                return "HotKeyAlreadyRegisteredInSubNet"
            if len(subnet.neurons) >= subnet.max_allowed_uids:
                return "NoNeuronIdAvailable"
            subnet.neurons.append(FakeNeuron(params["hotkey"], signer, block_at_registration=self.head))
            return None
        uid = subnet.uid_of(signer)
        if uid is None:
            return "HotKeyNotRegisteredInSubNet"
        neuron = subnet.neurons[uid]
        if call.function == "serve_axon":
            neuron.axon = {key: params[key] for key in
                           ("version", "ip", "port", "ip_type", "protocol", "placeholder1", "placeholder2")}
            neuron.axon["block"] = self.head
            return None
        if call.function == "set_mechanism_weights":
            subnet.weights[uid] = list(zip(params["dests"], params["weights"]))
            neuron.last_update = self.head
            return None
        if call.function == "commit_timelocked_mechanism_weights":
            subnet.commits.append({"uid": uid, "block": self.head, **params})
            neuron.last_update = self.head
            return None
        raise NotImplementedError(f"the fake does not apply {call.module}.{call.function}")

    def _set_commitment(self, subnet: Optional[FakeSubnet], signer: str, info: dict) -> Optional[str]:
        """pallet_commitments::set_commitment: registered hotkeys only, at most 3 fields, Raw payloads of at
        most 128 bytes, max(100, bytes) of MaxSpace per (subnet epoch index)."""
        if subnet is None or subnet.uid_of(signer) is None:
            return "AccountNotAllowedCommit"
        fields = list(info.get("fields") or [])
        if len(fields) > 3:
            return "TooManyFieldsInCommitmentInfo"
        size = 0
        for entry in fields:
            [(variant, value)] = entry.items()
            raw = bytes.fromhex(value.removeprefix("0x"))
            if variant != f"Raw{len(raw)}" or len(raw) > 128:
                raise ValueError(f"{variant} cannot carry {len(raw)} bytes")  # the SCALE encoder refuses it
            size += len(raw)
        needed = max(100, size)
        epoch = (self.head + subnet.netuid + 1) // (subnet.tempo + 1)  # the block it lands in
        last_epoch, used = self.commitment_usage.get((subnet.netuid, signer), (epoch, 0))
        used = used if last_epoch == epoch else 0
        if used + needed > self.commitment_max_space:
            return "SpaceLimitExceeded"
        self.commitment_usage[(subnet.netuid, signer)] = (epoch, used + needed)
        # stored as a node's SCALE codec decodes it back: Raw<n> as "0x" hex, except Raw0 ([u8; 0]), an empty list
        # (tests/test_commitment_scale.py checks this against the real runtime metadata)
        stored = [{variant: [] if variant == "Raw0" else value} for entry in fields for variant, value in entry.items()]
        self.commitments[(subnet.netuid, signer)] = {"block": self.head, "deposit": 0, "info": {"fields": stored}}
        return None

    # -------------------------------------------------------------- not modelled
    async def prepare(self, call, **kwargs):
        raise NotImplementedError("offline signing is not modelled by the fake")

    async def submit_signature(self, unsigned, signature, **kwargs):
        raise NotImplementedError("offline signing is not modelled by the fake")

    async def submit_signed(self, extrinsic, keypair, **kwargs):
        raise NotImplementedError("pre-signed extrinsics are not modelled by the fake")

    def multisig_account(self, signatories: list[str], threshold: int):
        raise NotImplementedError("multisig is not modelled by the fake")

    async def submit_multisig(self, call, keypair, multisig_account, **kwargs):
        raise NotImplementedError("multisig is not modelled by the fake")
