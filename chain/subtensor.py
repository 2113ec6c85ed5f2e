"""`SubtensorChain`: the `Chain` interface on a subtensor node, through the bittensor SDK 11.

Reads go through the SDK's typed namespaces, writes through its intents
(`ServeAxon`, `SetWeights`, `BurnedRegister`) and `execute`, so the SDK's own
preflight checks, weight conforming and commit-reveal choice apply. This module
adds what a neuron needs on top:

- every SDK failure, raised or returned in an `ExtrinsicResult`, becomes one of
  the interface's typed errors, keeping subtensor's error name in `.name`;
- connection failures and the pool rejections that clear up within a block are
  retried with exponential backoff, bounded in count and in time;
- every call runs under a deadline (`asyncio.timeout_at`, retries included):
  reads within `timeout_s`, writes within `write_timeout_s` (inclusion takes a
  block or two).

The backend is injectable (`substrate=`, any `bt.Substrate`), which is how the
tests drive the SDK's real intent code without a node.
"""
from __future__ import annotations

import asyncio
import logging
import math
import numbers
import re
from typing import Any, Awaitable, Callable, TypeVar

import bittensor as bt
from bittensor.result import ErrorCode

from chain.interface import (AlreadyRegistered, Chain, ChainConnectionError, ChainError, Commitment, Endpoint,
                             Hyperparameters, InvalidWeights, MetagraphSnapshot, NeuronInfo, NotEnoughStake,
                             NotRegistered, NoValidatorPermit, RateLimited, RegistrationFailed, SetWeightsOutcome,
                             SubnetNotFound, commitment_info)
from chain.weights import conform

log = logging.getLogger(__name__)

T = TypeVar("T")

U16_MAX = 65535
NETWORKS = ("finney", "test", "local")
SubtensorModule = bt.storage.SubtensorModule

# ------------------------------------------------------------------ error mapping
# Subtensor error names (module errors, and the names the SDK gives pool
# rejections) -> the interface error a neuron reacts to.
ERROR_BY_NAME: dict[str, type[ChainError]] = {
    "HotKeyNotRegisteredInSubNet": NotRegistered,
    "HotKeyNotRegisteredInNetwork": NotRegistered,
    "HotKeyAccountNotExists": NotRegistered,
    "HotKeyAlreadyRegisteredInSubNet": AlreadyRegistered,
    "NeuronNoValidatorPermit": NoValidatorPermit,
    "NotEnoughStakeToSetWeights": NotEnoughStake,
    "SettingWeightsTooFast": RateLimited,
    "CommittingWeightsTooFast": RateLimited,
    "TooManyUnrevealedCommits": RateLimited,
    "ServingRateLimitExceeded": RateLimited,
    "RateLimitExceeded": RateLimited,  # pool rejection Custom(6): weights/tx rate limits
    "TooManyRegistrationsThisBlock": RateLimited,
    "TooManyRegistrationsThisInterval": RateLimited,
    "WeightVecNotEqualSize": InvalidWeights,
    "DuplicateUids": InvalidWeights,
    "UidVecContainInvalidOne": InvalidWeights,
    "WeightVecLengthIsLow": InvalidWeights,
    "MaxWeightExceeded": InvalidWeights,
    "IncorrectWeightVersionKey": InvalidWeights,
    "UidsLengthExceedUidsInSubNet": InvalidWeights,
    "CommitPayloadTooLarge": InvalidWeights,
    "SubnetNotExists": SubnetNotFound,
    "AccountNotAllowedCommit": NotRegistered,  # Commitments: the hotkey is not registered on the subnet
    "SpaceLimitExceeded": RateLimited,  # Commitments: the epoch's byte quota is used up
    "TooManyFieldsInCommitmentInfo": ChainError,
    "MechanismDoesNotExist": SubnetNotFound,
    "RootNetworkDoesNotExist": SubnetNotFound,
    "NoNeuronIdAvailable": RegistrationFailed,
    "NotEnoughBalanceToStake": RegistrationFailed,
    "SubNetRegistrationDisabled": RegistrationFailed,
    "RegistrationNotPermittedOnRootSubnet": RegistrationFailed,
}

# Names whose meaning depends on the operation that met them.
ERROR_BY_OPERATION_AND_NAME: dict[tuple[str, str], type[ChainError]] = {
    # Pool rejection Custom(1) covers both "stake amount too low" and
    # NotEnoughStakeToSetWeights; on a weights call it can only be the latter.
    ("set_weights", "StakeAmountTooLow"): NotEnoughStake,
    ("register", "Payment"): RegistrationFailed,
    ("register", "InsufficientBalance"): RegistrationFailed,
    ("register", "BalanceWithdrawalError"): RegistrationFailed,
}

# For errors without a name (the SDK's client-side preflight raises with a
# code only), the SDK's semantic code decides.
ERROR_BY_CODE: dict[ErrorCode, type[ChainError]] = {
    ErrorCode.NOT_REGISTERED: NotRegistered,
    ErrorCode.RATE_LIMITED: RateLimited,
    ErrorCode.SUBNET_NOT_EXISTS: SubnetNotFound,
}
ERROR_BY_OPERATION_AND_CODE: dict[tuple[str, ErrorCode], type[ChainError]] = {
    ("set_weights", ErrorCode.INVALID_ARGUMENT): InvalidWeights,  # too few weights
    ("set_weights", ErrorCode.NOT_AUTHORIZED): NoValidatorPermit,  # Null-consensus sole permit
    ("register", ErrorCode.ALREADY_EXISTS): AlreadyRegistered,
    ("register", ErrorCode.INSUFFICIENT_BALANCE): RegistrationFailed,
    ("register", ErrorCode.LIMIT_EXCEEDED): RegistrationFailed,
    ("register", ErrorCode.DISABLED): RegistrationFailed,
}

# The name a nameless rate-limit refusal gets, so a caller can tell them apart.
RATE_LIMIT_NAME_BY_OPERATION = {
    "set_weights": "SettingWeightsTooFast",
    "publish_endpoint": "ServingRateLimitExceeded",
    "publish_commitment": "SpaceLimitExceeded",
    "register": "TooManyRegistrationsThisInterval",
}

# Pool rejections that clear up within a block or so (a competing extrinsic at
# the same nonce, a full block, a nonce race). Resubmitting signs afresh with
# the pool's next nonce. The SDK's own check looks for "priority is too low" /
# "outdated" / "stale" in the message; it misses Stale once the SDK has
# replaced the node's text with its description, so the names are used here.
TRANSIENT_POOL_REJECTIONS = frozenset(
    {"PriorityTooLow", "Stale", "Future", "Dropped", "Usurped", "Retracted", "ExhaustsResources"}
)


def _caused_by_connection_loss(error: BaseException) -> bool:
    """The SDK reports a socket dropped mid-submit as a nameless ChainError
    raised from the OS error; look down the cause chain for it."""
    seen = 0
    cause = error.__cause__ or error.__context__
    while cause is not None and seen < 8:
        if isinstance(cause, (ConnectionError, TimeoutError, bt.RpcConnectionError)):
            return True
        cause = cause.__cause__ or cause.__context__
        seen += 1
    return False


def typed_error(error: BaseException, operation: str) -> ChainError:
    """The interface error for an SDK failure met during `operation`
    ("read", "register", "publish_endpoint", "set_weights")."""
    if isinstance(error, ChainError):
        return error
    if isinstance(error, (bt.RpcConnectionError, bt.ConnectionNotReady, ConnectionError, TimeoutError)):
        return ChainConnectionError(f"{operation}: {str(error) or type(error).__name__}")
    if isinstance(error, bt.ChainError):
        name = error.name
        cls = ERROR_BY_OPERATION_AND_NAME.get((operation, name or "")) or ERROR_BY_NAME.get(name or "")
        if cls is None and name is None and _caused_by_connection_loss(error):
            return ChainConnectionError(f"{operation}: connection lost: {error.message}")
        if cls is None and name in TRANSIENT_POOL_REJECTIONS:
            # Not the subnet's rate limits (the SDK files PriorityTooLow under
            # rate_limited): a pool race that a resubmission usually clears.
            typed = ChainError(f"{operation}: {error.message}", name)
            typed.transient = True
            return typed
        if cls is None:
            cls = ERROR_BY_OPERATION_AND_CODE.get((operation, error.code)) or ERROR_BY_CODE.get(error.code)
        if cls is None:
            return ChainError(f"{operation}: {error.message}", name)
        if name is None and cls is RateLimited:
            name = RATE_LIMIT_NAME_BY_OPERATION.get(operation)
        if cls is RateLimited:
            # The SDK's preflight says how long: "... Retry in ~N blocks (~Ss)."
            wait = re.search(r"[Rr]etry in ~?(\d+) blocks?", error.message or "")
            return RateLimited(f"{operation}: {error.message}", name,
                               retry_after_blocks=int(wait.group(1)) if wait else None)
        return cls(f"{operation}: {error.message}", name)
    if isinstance(error, bt.BittensorError):
        # SetWeights raises a plain BittensorError for all-zero, negative,
        # non-finite or duplicate weights.
        if operation == "set_weights":
            return InvalidWeights(f"{operation}: {error}")
        return ChainError(f"{operation}: {error}")
    return ChainError(f"{operation}: {type(error).__name__}: {error}")


def failure_error(result: bt.ExtrinsicResult, operation: str) -> ChainError:
    """The interface error for an `ExtrinsicResult` that reports failure."""
    sdk_error = result.error or bt.ChainError(result.message or "extrinsic failed")
    typed = typed_error(sdk_error, operation)
    typed.__cause__ = sdk_error
    return typed


def _retryable(error: ChainError) -> bool:
    # RateLimited is `transient` for the caller (try again later), but waiting
    # out a rate limit takes many blocks: not this loop's business.
    return isinstance(error, ChainConnectionError) or error.name in TRANSIENT_POOL_REJECTIONS


# ------------------------------------------------------------------ mapping helpers
def _alpha(balance: bt.Balance | None) -> float:
    # Subnet balances are alpha; `.tao` raises on them by design.
    return 0.0 if balance is None else float(balance.amount)


def _endpoint(axon: str | None, raw: Any) -> Endpoint | None:
    """Endpoint from the SDK's "ip:port" / "[v6]:port" (None when nothing is served)."""
    if not axon:
        return None
    host, _, port = axon.rpartition(":")
    host = host.strip("[]")
    if not host or not port.isdigit() or int(port) == 0:
        return None
    protocol, version = 4, 1
    if isinstance(raw, dict):
        protocol = int(raw.get("protocol", protocol) or 0)
        version = int(raw.get("version", version) or 0)
    return Endpoint(ip=host, port=int(port), protocol=protocol, version=version)


def _neuron(n: bt.MetagraphNeuron, raw_axon: Any) -> NeuronInfo:
    return NeuronInfo(
        uid=n.uid,
        hotkey=n.hotkey,
        coldkey=n.coldkey,
        stake=_alpha(n.alpha_stake),
        validator_permit=n.validator_permit,
        endpoint=_endpoint(n.axon, raw_axon),
        last_update=n.last_update,
        block_at_registration=n.block_at_registration,
        incentive=n.incentive,
        dividends=n.dividends,
        emission=_alpha(n.emission),
        rank=n.rank,
        trust=n.trust,
        consensus=n.consensus,
        validator_trust=0.0,  # the SDK's MetagraphNeuron does not carry it
        active=n.active,
    )


def _block_of(result: bt.ExtrinsicResult) -> int | None:
    """Inclusion block from the result's "block-index" extrinsic id."""
    height, _, _ = (result.extrinsic_id or "").partition("-")
    return int(height) if height.isdigit() else None


def _check_netuid(netuid: int) -> None:
    if isinstance(netuid, bool) or not isinstance(netuid, int) or not 0 <= netuid <= U16_MAX:
        raise ValueError(f"netuid must be an integer in 0..{U16_MAX}, got {netuid!r}")


def _check_ss58(address: str) -> None:
    try:
        bt.sp_core.ss58_decode(address)
    except Exception:
        raise ValueError(f"{address!r} is not an ss58 address") from None


def _weight_items(weights: dict[int, float]) -> list[tuple[int, float]]:
    """Validated (uid, weight) pairs sorted by uid, as the SDK orders them."""
    if not isinstance(weights, dict):
        raise InvalidWeights(f"weights must be a {{uid: weight}} dict, got {type(weights).__name__}")
    items = []
    for uid, weight in weights.items():
        # numbers.* so numpy scalars from a scoring pipeline are accepted.
        if isinstance(uid, bool) or not isinstance(uid, numbers.Integral) or not 0 <= uid <= U16_MAX:
            raise InvalidWeights(f"uid {uid!r} is not an integer in 0..{U16_MAX}")
        if isinstance(weight, bool) or not isinstance(weight, numbers.Real) or not math.isfinite(weight):
            raise InvalidWeights(f"weight for uid {uid} must be a finite number, got {weight!r}")
        if weight < 0:
            raise InvalidWeights(f"weight for uid {uid} is negative ({weight})")
        items.append((int(uid), float(weight)))
    return sorted(items)


def conformed_row(
    items: list[tuple[int, float]], own_uid: int | None, max_weight_limit_u16: int
) -> tuple[list[int], list[int]]:
    """The u16 row `SetWeights` submits: clip to max_weight_limit (a lone
    self-weight is exempt), max-upscale to u16, drop zeros (chain.weights.conform,
    which tests/test_devnet_rules.py checks against the SDK's own helpers)."""
    row = conform(items, own_uid, max_weight_limit_u16 / U16_MAX, keep_zeros=False)
    return list(row.uids), list(row.values)


# ------------------------------------------------------------------ the adapter
class SubtensorChain(Chain):
    """`Chain` on a subtensor node (`finney`, `test`, `local` or a ws:// / wss:// URL).

    `substrate` swaps the SDK's chain backend (any `bt.Substrate`; tests pass an
    in-memory fake). `wallet_path` lets wallet arguments be given by name
    ("coldkey/hotkey"). The metagraph is read `metagraph_lag_blocks` behind the
    tip so that every validator sees the same, settled state. Transient failures
    are retried up to `retries` times with backoff `backoff_s * 2**n`, all within
    the call's timeout.
    """

    def __init__(
        self,
        network: str,
        *,
        substrate: bt.Substrate | None = None,
        wallet_path: str | None = None,
        metagraph_lag_blocks: int = 3,
        timeout_s: float = 30.0,
        write_timeout_s: float = 120.0,
        retries: int = 3,
        backoff_s: float = 0.5,
    ):
        if network not in NETWORKS and not network.startswith(("ws://", "wss://")):
            raise ValueError(f"unknown network {network!r}: use finney, test, local, or a ws:// / wss:// URL")
        if timeout_s <= 0 or write_timeout_s <= 0:
            raise ValueError("timeouts must be positive")
        if retries < 0 or backoff_s < 0 or metagraph_lag_blocks < 0:
            raise ValueError("retries, backoff_s and metagraph_lag_blocks must be >= 0")
        self.network = network
        self.wallet_path = wallet_path
        self.metagraph_lag_blocks = int(metagraph_lag_blocks)
        self.timeout_s = float(timeout_s)
        self.write_timeout_s = float(write_timeout_s)
        self.retries = int(retries)
        self.backoff_s = float(backoff_s)
        # Construction does no I/O; the first await connects, on the caller's loop.
        self._subtensor = bt.Subtensor(network, substrate=substrate)
        self._client: bt.Client | None = None
        self._connect_lock = asyncio.Lock()

    def __repr__(self) -> str:
        return f"SubtensorChain({self.network!r})"

    # -------------------------------------------------------------- plumbing
    async def _connected(self) -> bt.Client:
        if self._client is None:
            async with self._connect_lock:
                if self._client is None:
                    self._client = await self._subtensor
        return self._client

    async def _call(self, operation: str, attempt: Callable[[bt.Client], Awaitable[T]], *, write: bool = False) -> T:
        """Run `attempt` with a deadline, retrying transient failures with backoff.

        A write that times out is not retried: it may still land, and a blind
        resubmission could register twice or trip the weights rate limit.
        """
        loop = asyncio.get_running_loop()
        budget = self.write_timeout_s if write else self.timeout_s
        deadline = loop.time() + budget
        for n in range(self.retries + 1):
            deadline_guard = asyncio.timeout_at(deadline)
            try:
                async with deadline_guard:
                    return await attempt(await self._connected())
            except (ValueError, TypeError, FileNotFoundError, PermissionError):
                raise  # bad input (an IP that does not parse, a missing key file): the caller's to fix
            except ChainError as typed:
                error = typed
            except TimeoutError as timeout:
                if not deadline_guard.expired():  # a timeout inside the SDK, not ours
                    error = typed_error(timeout, operation)
                else:
                    hint = "; the extrinsic may still land, check chain state before resubmitting" if write else ""
                    raise ChainConnectionError(
                        f"{operation}: no answer from {self.network} within {budget:g}s{hint}"
                    ) from None
            except Exception as sdk_error:  # noqa: BLE001 - every SDK failure is mapped
                error = typed_error(sdk_error, operation)
                error.__cause__ = sdk_error
            delay = self.backoff_s * 2**n
            if not _retryable(error) or n == self.retries or loop.time() + delay >= deadline:
                raise error
            log.warning("%s on %s failed (%s: %s); retry %d/%d in %.2fs",
                        operation, self.network, error.name, error, n + 1, self.retries, delay)
            await asyncio.sleep(delay)
        raise AssertionError("unreachable")  # the loop always returns or raises

    def _wallet(self, wallet: Any) -> Any:
        if isinstance(wallet, str):
            if self.wallet_path is None:
                raise ValueError(f"wallet {wallet!r} given by name: pass wallet_path= to SubtensorChain")
            return bt.Wallet(wallet, path=self.wallet_path)
        # Checked without touching `.hotkey`, which would unlock an encrypted key.
        if not isinstance(wallet, bt.Wallet) and not hasattr(wallet, "hotkey"):
            raise TypeError(f"expected a bittensor wallet (with .hotkey/.coldkeypub), got {type(wallet).__name__}")
        return wallet

    @staticmethod
    def _hotkey_ss58(wallet: Any) -> str:
        return bt.public_view(wallet, "hotkey").ss58_address

    # -------------------------------------------------------------- reads
    async def block(self) -> int:
        return await self._call("read", lambda client: client.block())

    async def metagraph(self, netuid: int) -> MetagraphSnapshot:
        _check_netuid(netuid)

        async def read(client: bt.Client) -> MetagraphSnapshot:
            # A few blocks behind the tip: settled state that validators agree on.
            at = max(0, await client.block() - self.metagraph_lag_blocks)
            graph = await client.subnets.metagraph(netuid, block=at, commitments=False)
            if graph is None:
                raise SubnetNotFound(f"subnet {netuid} does not exist on {self.network}", "SubnetNotExists")
            raw_axons = list((graph.raw or {}).get("axons") or [])
            neurons = tuple(
                _neuron(n, raw_axons[n.uid] if n.uid < len(raw_axons) else None) for n in graph.neurons
            )
            return MetagraphSnapshot(netuid=netuid, block=graph.block, neurons=neurons, tempo=graph.tempo)

        return await self._call("read", read)

    async def hyperparameters(self, netuid: int) -> Hyperparameters:
        _check_netuid(netuid)

        async def read(client: bt.Client) -> Hyperparameters:
            view = await client.at()  # one block for every value
            if not await view.query(SubtensorModule.NetworksAdded, [netuid]):
                raise SubnetNotFound(f"subnet {netuid} does not exist on {self.network}", "SubnetNotExists")
            hp = view.hyperparameters
            (info, rate_limit, max_limit, min_weights, immunity, commit_reveal,
             max_uids, version, cutoff, cutoff_factor) = await asyncio.gather(
                view.subnets.info(netuid),
                hp.weights_rate_limit(netuid),
                hp.max_weight_limit(netuid),
                hp.min_allowed_weights(netuid),
                hp.immunity_period(netuid),
                view.subnets.commit_reveal_enabled(netuid),
                view.query(SubtensorModule.MaxAllowedUids, [netuid]),
                view.query(SubtensorModule.WeightsVersionKey, [netuid]),
                view.query(SubtensorModule.ActivityCutoff, [netuid]),
                view.query(SubtensorModule.ActivityCutoffFactorMilli, [netuid]),
            )
            # The epoch derives the cutoff from the per-mille factor when set.
            activity_cutoff = int(cutoff_factor) * info.tempo // 1000 if cutoff_factor else int(cutoff or 0)
            return Hyperparameters(
                tempo=info.tempo,
                weights_rate_limit=int(rate_limit),
                max_weight_limit=int(max_limit) / U16_MAX,
                min_allowed_weights=int(min_weights),
                max_uids=int(max_uids or 0),
                immunity_period=int(immunity),
                commit_reveal=bool(commit_reveal),
                weights_version=int(version or 0),
                activity_cutoff=activity_cutoff,
            )

        return await self._call("read", read)

    async def blocks_until_next_epoch(self, netuid: int) -> int:
        _check_netuid(netuid)

        async def read(client: bt.Client) -> int:
            blocks = await client.epochs.blocks_until_next_epoch(netuid)
            if blocks is not None:
                return int(blocks)
            if not await client.query(SubtensorModule.NetworksAdded, [netuid]):
                raise SubnetNotFound(f"subnet {netuid} does not exist on {self.network}", "SubnetNotExists")
            raise ChainError(f"subnet {netuid} has tempo 0: it never runs an epoch")

        return await self._call("read", read)

    async def uid_of(self, hotkey: str, netuid: int) -> int | None:
        _check_netuid(netuid)
        _check_ss58(hotkey)
        return await self._call("read", lambda client: client.neurons.uid(hotkey, netuid))

    # -------------------------------------------------------------- writes
    async def register(self, wallet, netuid: int) -> int:
        _check_netuid(netuid)
        wallet = self._wallet(wallet)
        hotkey = self._hotkey_ss58(wallet)
        existing = await self.uid_of(hotkey, netuid)
        if existing is not None:
            raise AlreadyRegistered(f"register: hotkey {hotkey} already holds uid {existing} on subnet {netuid}")

        async def submit(client: bt.Client) -> None:
            result = await self._burned_register(client, wallet, netuid, hotkey)
            if not result.success:
                raise failure_error(result, "register")

        await self._call("register", submit, write=True)
        uid = await self.uid_of(hotkey, netuid)
        if uid is None:
            raise RegistrationFailed(f"register: included, but hotkey {hotkey} has no uid on subnet {netuid}")
        return uid

    async def _burned_register(self, client: bt.Client, wallet: Any, netuid: int, hotkey: str) -> bt.ExtrinsicResult:
        """`BurnedRegister` through the MEV shield, as the SDK requires; on a
        node without a shield key (local dev nodes) the plain call instead.
        Finney never falls back: there the shield guards the collateral buy."""
        shielded = self.network == "finney" or await self._shield_key_present(client)
        if shielded:
            try:
                return await client.execute(
                    bt.BurnedRegister(netuid=netuid, hotkey_ss58=hotkey), wallet, wait_for_finalization=False
                )
            except bt.ChainError as error:
                # The SDK gives up with this (nameless) error when NextKey stays empty.
                if self.network == "finney" or "NextKey" not in error.message:
                    raise
                log.warning("MEV shield unavailable on %s (%s); registering unshielded", self.network, error)
        return await client.submit_call(
            bt.calls.SubtensorModule.burned_register(netuid=netuid, hotkey=hotkey),
            wallet,
            wait_for_finalization=False,
        )

    @staticmethod
    async def _shield_key_present(client: bt.Client) -> bool:
        try:
            return bool(await client.query(bt.storage.MevShield.NextKey))
        except bt.ChainError:  # no MevShield pallet on this runtime
            return False

    async def publish_endpoint(self, wallet, netuid: int, ip: str, port: int) -> None:
        _check_netuid(netuid)
        if isinstance(port, bool) or not isinstance(port, int) or not 1 <= port <= U16_MAX:
            raise ValueError(f"port must be an integer in 1..{U16_MAX}, got {port!r}")
        wallet = self._wallet(wallet)
        intent = bt.ServeAxon(netuid=netuid, ip=ip, port=port)  # the SDK parses `ip` (ValueError if bad)

        async def submit(client: bt.Client) -> None:
            result = await client.execute(intent, wallet, wait_for_finalization=False)
            if not result.success:
                raise failure_error(result, "publish_endpoint")

        await self._call("publish_endpoint", submit, write=True)

    async def publish_commitment(self, wallet, netuid: int, data: str) -> None:
        """Commitments.set_commitment, signed by the hotkey (the SDK has no intent for it: a raw call). The data
        goes as plain Raw fields, as the SDK's metagraph reads them back."""
        _check_netuid(netuid)
        info = commitment_info(data)
        wallet = self._wallet(wallet)
        call = bt.calls.Commitments.set_commitment(netuid=netuid, info=info)

        async def submit(client: bt.Client) -> None:
            result = await client.submit_call(call, wallet, signer="hotkey", wait_for_finalization=False)
            if not result.success:
                raise failure_error(result, "publish_commitment")

        await self._call("publish_commitment", submit, write=True)

    async def commitments(self, netuid: int) -> dict[str, Commitment]:
        _check_netuid(netuid)

        async def read(client: bt.Client) -> dict[str, Commitment]:
            at = max(0, await client.block() - self.metagraph_lag_blocks)
            graph = await client.subnets.metagraph(netuid, block=at, commitments=True)
            if graph is None:
                raise SubnetNotFound(f"subnet {netuid} does not exist on {self.network}", "SubnetNotExists")
            found = {}
            for n in graph.neurons:
                c = graph.commitments[n.uid]
                if c is not None and c.is_revealed:
                    found[n.hotkey] = Commitment(hotkey=n.hotkey, block=c.block, data=c.value or "")
            return found

        return await self._call("read", read)

    async def set_weights(self, wallet, netuid: int, weights: dict[int, float], version_key: int) -> SetWeightsOutcome:
        _check_netuid(netuid)
        if isinstance(version_key, bool) or not isinstance(version_key, int) or version_key < 0:
            raise ValueError(f"version_key must be a non-negative integer, got {version_key!r}")
        items = _weight_items(weights)
        wallet = self._wallet(wallet)
        hotkey = self._hotkey_ss58(wallet)
        try:
            intent = bt.SetWeights(netuid=netuid, weights=dict(items), version_key=version_key)
        except bt.BittensorError as error:
            raise typed_error(error, "set_weights") from error

        async def submit(client: bt.Client) -> SetWeightsOutcome:
            # Read what the SDK conforms against, to report the row it sends.
            own_uid, limit = await asyncio.gather(
                client.query(SubtensorModule.Uids, [netuid, hotkey]),
                client.query(SubtensorModule.MaxWeightsLimit, [netuid]),
            )
            # Preflight (registration, rate limit, weight count), conforming and
            # the plaintext / timelocked-commit choice all happen in here.
            result = await client.execute(intent, wallet, wait_for_finalization=False)
            if not result.success:
                raise failure_error(result, "set_weights")
            uids, row = conformed_row(
                items, None if own_uid is None else int(own_uid), U16_MAX if limit is None else int(limit)
            )
            block = _block_of(result)
            if block is None:
                block = await client.block()
            extra: dict[str, Any] = {"extrinsic_id": result.extrinsic_id, "block_hash": result.block_hash}
            committed = "reveal_round" in result.data
            if committed:
                extra["reveal_round"] = int(result.data["reveal_round"])
            return SetWeightsOutcome(
                block=block, uids=tuple(uids), weights_u16=tuple(row), committed=committed, extra=extra
            )

        return await self._call("set_weights", submit, write=True)

    # -------------------------------------------------------------- lifecycle
    async def close(self) -> None:
        if self._client is None:
            return
        self._client = None
        try:
            await asyncio.wait_for(self._subtensor.__aexit__(None, None, None), self.timeout_s)
        except Exception as error:  # noqa: BLE001 - closing must not fail the caller
            log.warning("closing %s: %s", self.network, error)
