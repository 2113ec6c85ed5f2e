"""SubtensorChain against the bittensor SDK's real client and intent code.

The adapter runs `bt.Subtensor("local", substrate=FakeSubstrate(...))`: the
SDK's own reads, preflight checks, weight conforming, commit-reveal encryption
and MEV shield run unchanged, and return the SDK's real result types. The fake
(tests/fake_substrate.py) stands in for the node only. Wallets are real
bittensor wallets on disk; the fake verifies every signature they make.
"""
from __future__ import annotations

import asyncio
import math
import socket
import time

import bittensor as bt
import numpy as np
import pytest
from fake_substrate import ConnectionDrop, DispatchError, FakeSubstrate, PoolRejection, block_hash_of

from chain import connect
from chain.interface import (AlreadyRegistered, ChainConnectionError, ChainError, Endpoint, InvalidWeights,
                             NotEnoughStake, NotRegistered, NoValidatorPermit, RateLimited, RegistrationFailed,
                             SubnetNotFound)
from chain.subtensor import SubtensorChain, failure_error, typed_error

NETUID = 7
U16_MAX = 65535
RAO = 10**9


def hotkey(wallet) -> str:
    return wallet.hotkey.ss58_address


def coldkey(wallet) -> str:
    return wallet.coldkeypub.ss58_address


@pytest.fixture(scope="module")
def wallets(tmp_path_factory, make_wallets) -> dict[str, bt.Wallet]:
    return make_wallets(tmp_path_factory.mktemp("wallets"), ("owner", "validator", "miner", "newcomer"))


@pytest.fixture(autouse=True)
def symbol_cache(tmp_path, monkeypatch):
    # Connecting caches token symbols under ~/.bittensor unless told otherwise.
    monkeypatch.setenv("BTCLI_TOKEN_SYMBOLS_CACHE", str(tmp_path / "symbols.json"))


@pytest.fixture
def fake(wallets) -> FakeSubstrate:
    """Subnet 7: uid 0 a permitted validator, uid 1 a serving miner, uid 2 idle."""
    node = FakeSubstrate(head=1000, block_time=0.005)
    owner, validator, miner = wallets["owner"], wallets["validator"], wallets["miner"]
    node.add_subnet(NETUID, hotkey(owner), coldkey(owner), tempo=100, weights_rate_limit=50,
                    min_allowed_weights=1, max_allowed_uids=64, immunity_period=4000,
                    weights_version=2, activity_cutoff=5000)
    node.add_neuron(NETUID, hotkey(validator), coldkey(validator), alpha_stake_rao=1_234_500_000_000,
                    tao_stake_rao=10 * RAO, validator_permit=True, last_update=900, dividends=32768,
                    trust=100, consensus=200, rank=300, emission_rao=2_500_000_000)
    node.add_neuron(NETUID, hotkey(miner), coldkey(miner), alpha_stake_rao=7 * RAO, incentive=65535,
                    emission_rao=RAO // 2)
    node.subnets[NETUID].neurons[1].serve("203.0.113.5", 8091, version=3)
    idle = bt.sp_core.Keypair.create_from_uri("//Idle")
    node.add_neuron(NETUID, idle.ss58_address, idle.ss58_address, active=False)
    return node


@pytest.fixture
async def chain(fake):
    adapter = SubtensorChain("local", substrate=fake, timeout_s=2.0, write_timeout_s=5.0,
                             retries=3, backoff_s=0.01)
    yield adapter
    await adapter.close()


def submit_attempts(fake: FakeSubstrate, function: str) -> int:
    return sum(1 for entry in fake.read_log if entry[:2] == ("submit", function))


# ------------------------------------------------------------------ reads
async def test_block_and_connect_through_the_package(fake):
    chain = connect("local", substrate=fake)
    assert isinstance(chain, SubtensorChain)
    async with chain:
        assert await chain.block() == 1000
        fake.head = 1005
        assert await chain.block() == 1005
    assert fake.closed


async def test_metagraph_maps_sdk_neurons(chain, fake, wallets):
    graph = await chain.metagraph(NETUID)
    assert graph.netuid == NETUID and graph.tempo == 100
    assert graph.block == 1000 - 3  # read metagraph_lag_blocks behind the tip
    asked = [e for e in fake.read_log if e[:3] == ("runtime_call", "SubnetInfoRuntimeApi", "get_metagraph")]
    assert asked[-1][4] == block_hash_of(997)
    assert len(graph) == 3

    validator = graph.by_hotkey(hotkey(wallets["validator"]))
    assert validator.uid == 0 and validator.coldkey == coldkey(wallets["validator"])
    assert validator.stake == pytest.approx(1234.5)  # alpha stake only, in alpha units
    assert validator.validator_permit and validator.endpoint is None
    assert validator.last_update == 900 and validator.block_at_registration == 1000
    assert validator.dividends == pytest.approx(32768 / U16_MAX)
    assert validator.trust == pytest.approx(100 / U16_MAX)
    assert validator.consensus == pytest.approx(200 / U16_MAX)
    assert validator.rank == pytest.approx(300 / U16_MAX)
    assert validator.emission == pytest.approx(2.5)

    miner = graph.by_uid(1)
    assert miner.hotkey == hotkey(wallets["miner"])
    assert miner.stake == pytest.approx(7.0) and miner.incentive == pytest.approx(1.0)
    assert miner.endpoint == Endpoint("203.0.113.5", 8091, protocol=4, version=3)
    assert miner.endpoint.url == "http://203.0.113.5:8091"
    assert not graph.by_uid(2).active
    assert [n.uid for n in graph.validators] == [0]


async def test_metagraph_ipv6_endpoint_and_lag_setting(fake):
    fake.subnets[NETUID].neurons[1].serve("2001:db8::1", 9000)
    async with SubtensorChain("local", substrate=fake, metagraph_lag_blocks=0) as chain:
        graph = await chain.metagraph(NETUID)
    assert graph.block == 1000
    assert graph.by_uid(1).endpoint == Endpoint("2001:db8::1", 9000)
    assert graph.by_uid(1).endpoint.url == "http://[2001:db8::1]:9000"


async def test_metagraph_of_missing_subnet(chain):
    with pytest.raises(SubnetNotFound) as raised:
        await chain.metagraph(99)
    assert raised.value.name == "SubnetNotExists"
    with pytest.raises(ValueError):
        await chain.metagraph(-1)


async def test_hyperparameters(chain, fake):
    fake.subnets[NETUID].max_weights_limit = 32767
    params = await chain.hyperparameters(NETUID)
    assert params.tempo == 100
    assert params.weights_rate_limit == 50
    assert params.max_weight_limit == pytest.approx(32767 / U16_MAX)
    assert params.min_allowed_weights == 1
    assert params.max_uids == 64
    assert params.immunity_period == 4000
    assert params.commit_reveal is False
    assert params.weights_version == 2
    assert params.activity_cutoff == 5000

    fake.subnets[NETUID].commit_reveal = True
    fake.subnets[NETUID].activity_cutoff_factor_milli = 2500  # the epoch uses factor x tempo / 1000
    params = await chain.hyperparameters(NETUID)
    assert params.commit_reveal is True and params.activity_cutoff == 250

    with pytest.raises(SubnetNotFound):
        await chain.hyperparameters(99)


async def test_epochs_and_uids(chain, fake, wallets):
    assert await chain.blocks_until_next_epoch(NETUID) == 100  # epoch just ran at 1000
    fake.head = 1042
    assert await chain.blocks_until_next_epoch(NETUID) == 58
    with pytest.raises(SubnetNotFound):
        await chain.blocks_until_next_epoch(99)
    fake.subnets[NETUID].tempo = 0
    with pytest.raises(ChainError, match="tempo 0"):
        await chain.blocks_until_next_epoch(NETUID)

    assert await chain.uid_of(hotkey(wallets["miner"]), NETUID) == 1
    assert await chain.uid_of(hotkey(wallets["newcomer"]), NETUID) is None
    with pytest.raises(ValueError, match="ss58"):
        await chain.uid_of("not-an-address", NETUID)


# ------------------------------------------------------------------ set_weights
def max_upscaled(weights: dict[int, float]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Plain reference for an unclipped row: scale so the largest is 65535, drop zeros."""
    top = max(weights.values())
    row = {uid: round(w / top * U16_MAX) for uid, w in sorted(weights.items())}
    kept = {uid: v for uid, v in row.items() if v}
    return tuple(kept), tuple(kept.values())


async def test_set_weights_plain(chain, fake, wallets):
    weights = {1: 0.75, 0: 0.25, 2: 0.0}
    outcome = await chain.set_weights(wallets["validator"], NETUID, weights, version_key=5)
    assert (outcome.uids, outcome.weights_u16) == max_upscaled(weights)
    assert not outcome.committed and outcome.block == fake.head == 1001

    [call] = fake.composed_calls("set_mechanism_weights")
    assert call.params["dests"] == list(outcome.uids)
    assert call.params["weights"] == list(outcome.weights_u16)
    assert call.params["version_key"] == 5 and call.params["netuid"] == NETUID
    [sent] = fake.submissions("set_mechanism_weights")
    assert sent.signer == hotkey(wallets["validator"])  # signed by the hotkey
    assert fake.subnets[NETUID].neurons[0].last_update == 1001


async def test_set_weights_reports_the_clipped_row_sent(chain, fake, wallets):
    fake.subnets[NETUID].max_weights_limit = U16_MAX // 2
    outcome = await chain.set_weights(wallets["validator"], NETUID, {0: 1.0, 1: 1.0, 2: 8.0}, version_key=2)
    [call] = fake.composed_calls("set_mechanism_weights")
    assert (list(outcome.uids), list(outcome.weights_u16)) == (call.params["dests"], call.params["weights"])
    assert max(outcome.weights_u16) / sum(outcome.weights_u16) <= 0.5 + 1e-4  # the limit holds
    assert max_upscaled({0: 1.0, 1: 1.0, 2: 8.0})[1] != outcome.weights_u16  # it was clipped


async def test_set_weights_commit_reveal(chain, fake, wallets):
    fake.subnets[NETUID].commit_reveal = True
    outcome = await chain.set_weights(wallets["validator"], NETUID, {0: 0.5, 1: 0.5}, version_key=2)
    assert outcome.committed
    [call] = fake.composed_calls("commit_timelocked_mechanism_weights")
    assert outcome.extra["reveal_round"] == call.params["reveal_round"] > 0
    assert isinstance(call.params["commit"], bytes) and len(call.params["commit"]) > 0
    assert fake.composed_calls("set_mechanism_weights") == []
    assert fake.subnets[NETUID].commits[0]["uid"] == 0
    assert outcome.uids == (0, 1) and outcome.weights_u16 == (U16_MAX, U16_MAX)


async def test_set_weights_sdk_preflight_not_registered(chain, fake, wallets):
    with pytest.raises(NotRegistered) as raised:
        await chain.set_weights(wallets["newcomer"], NETUID, {0: 1.0}, version_key=2)
    assert raised.value.name == "HotKeyNotRegisteredInSubNet"
    assert isinstance(raised.value.__cause__, bt.ChainError)  # the SDK's own preflight refused
    assert fake.submitted == []


async def test_set_weights_sdk_preflight_too_few_weights(chain, fake, wallets):
    fake.subnets[NETUID].min_allowed_weights = 3
    with pytest.raises(InvalidWeights, match="at least 3"):
        await chain.set_weights(wallets["validator"], NETUID, {1: 1.0, 2: 0.0, 3: 1.0}, version_key=2)
    assert fake.submitted == []


async def test_set_weights_sdk_preflight_rate_limit(chain, fake, wallets):
    fake.subnets[NETUID].neurons[0].last_update = fake.head - 10  # limit is 50 blocks
    with pytest.raises(RateLimited) as raised:
        await chain.set_weights(wallets["validator"], NETUID, {1: 1.0}, version_key=2)
    assert raised.value.name == "SettingWeightsTooFast" and raised.value.transient
    assert raised.value.retry_after_blocks == 40  # the SDK's "Retry in ~40 blocks", for the validator to wait
    assert fake.submitted == []


@pytest.mark.parametrize("weights", [{0: -1.0}, {0: math.nan}, {0: 0.0, 1: 0.0}, {"a": 1.0}, {70000: 1.0}, [0.5]])
async def test_set_weights_rejects_bad_weights(chain, fake, wallets, weights):
    with pytest.raises(InvalidWeights):
        await chain.set_weights(wallets["validator"], NETUID, weights, version_key=2)
    assert fake.submitted == []


async def test_set_weights_accepts_numpy_scalars(chain, fake, wallets):
    outcome = await chain.set_weights(wallets["validator"], NETUID, {np.int64(1): np.float32(0.5), 2: 1.0}, 2)
    assert outcome.uids == (1, 2) and outcome.weights_u16 == (32768, U16_MAX)


async def test_set_weights_rejects_bad_version_key(chain, wallets):
    with pytest.raises(ValueError):
        await chain.set_weights(wallets["validator"], NETUID, {1: 1.0}, version_key=-1)


@pytest.mark.parametrize(
    ("outcome", "error", "name"),
    [
        (DispatchError("SettingWeightsTooFast"), RateLimited, "SettingWeightsTooFast"),
        (PoolRejection("Invalid Transaction: Custom error: 6"), RateLimited, "RateLimitExceeded"),
        (DispatchError("NeuronNoValidatorPermit"), NoValidatorPermit, "NeuronNoValidatorPermit"),
        (DispatchError("NotEnoughStakeToSetWeights"), NotEnoughStake, "NotEnoughStakeToSetWeights"),
        (PoolRejection("Invalid Transaction: Custom error: 1"), NotEnoughStake, "StakeAmountTooLow"),
        (DispatchError("IncorrectWeightVersionKey"), InvalidWeights, "IncorrectWeightVersionKey"),
        (DispatchError("UidVecContainInvalidOne"), InvalidWeights, "UidVecContainInvalidOne"),
        (PoolRejection("Invalid Transaction: Custom error: 19"), NotRegistered, "HotKeyNotRegisteredInSubNet"),
        (DispatchError("MechanismDoesNotExist"), SubnetNotFound, "MechanismDoesNotExist"),
    ],
)
async def test_set_weights_chain_failures(chain, fake, wallets, outcome, error, name):
    fake.script("set_mechanism_weights", outcome)
    with pytest.raises(error) as raised:
        await chain.set_weights(wallets["validator"], NETUID, {1: 1.0}, version_key=2)
    assert raised.value.name == name
    assert submit_attempts(fake, "set_mechanism_weights") == 1  # a chain refusal is not retried


async def test_transient_pool_rejections_are_retried_with_backoff(chain, fake, wallets):
    fake.script("set_mechanism_weights", PoolRejection("Priority is too low: (1 vs 1)"),
                PoolRejection("Invalid Transaction: Transaction is outdated"))
    started = time.monotonic()
    outcome = await chain.set_weights(wallets["validator"], NETUID, {1: 1.0}, version_key=2)
    assert outcome.uids == (1,)
    assert submit_attempts(fake, "set_mechanism_weights") == 3
    assert time.monotonic() - started >= 0.01 + 0.02  # backoff 0.01 s, doubling


async def test_transient_pool_rejections_give_up_after_retries(chain, fake, wallets):
    fake.script("set_mechanism_weights", *[PoolRejection("Priority is too low: (1 vs 1)")] * 5)
    with pytest.raises(ChainError) as raised:
        await chain.set_weights(wallets["validator"], NETUID, {1: 1.0}, version_key=2)
    assert type(raised.value) is ChainError  # not the subnet's RateLimited
    assert raised.value.name == "PriorityTooLow" and raised.value.transient
    assert submit_attempts(fake, "set_mechanism_weights") == 4  # 1 + retries


async def test_socket_lost_mid_submit_is_a_retried_connection_error(chain, fake, wallets):
    fake.script("set_mechanism_weights", ConnectionDrop())
    outcome = await chain.set_weights(wallets["validator"], NETUID, {1: 1.0}, version_key=2)
    assert outcome.block == fake.head
    assert submit_attempts(fake, "set_mechanism_weights") == 2


# ------------------------------------------------------------------ publish_endpoint
async def test_publish_endpoint_round_trip(chain, fake, wallets):
    await chain.publish_endpoint(wallets["validator"], NETUID, "198.51.100.7", 8443)
    [call] = fake.composed_calls("serve_axon")
    assert call.params["port"] == 8443 and call.params["ip_type"] == 4 and call.params["protocol"] == 4
    fake.head += 3  # past the metagraph lag
    graph = await chain.metagraph(NETUID)
    assert graph.by_uid(0).endpoint == Endpoint("198.51.100.7", 8443)


@pytest.mark.parametrize("outcome", [PoolRejection("Invalid Transaction: Custom error: 12"),
                                     DispatchError("ServingRateLimitExceeded")])
async def test_publish_endpoint_rate_limited(chain, fake, wallets, outcome):
    fake.script("serve_axon", outcome)
    with pytest.raises(RateLimited) as raised:
        await chain.publish_endpoint(wallets["miner"], NETUID, "198.51.100.8", 9000)
    assert raised.value.name == "ServingRateLimitExceeded"
    assert submit_attempts(fake, "serve_axon") == 1
    assert fake.subnets[NETUID].neurons[1].axon["port"] == 8091  # the existing entry stays


async def test_publish_endpoint_bad_input_and_unregistered(chain, fake, wallets):
    with pytest.raises(ValueError):
        await chain.publish_endpoint(wallets["miner"], NETUID, "300.1.2.3", 9000)  # the SDK parses the IP
    with pytest.raises(ValueError):
        await chain.publish_endpoint(wallets["miner"], NETUID, "198.51.100.8", 70000)
    assert fake.composed_calls("serve_axon") == []
    with pytest.raises(NotRegistered) as raised:
        await chain.publish_endpoint(wallets["newcomer"], NETUID, "198.51.100.9", 9000)
    assert raised.value.name == "HotKeyNotRegisteredInSubNet"


async def test_wallet_by_name_needs_wallet_path(fake, wallets):
    path = wallets["miner"].path
    async with SubtensorChain("local", substrate=fake, wallet_path=path) as chain:
        await chain.publish_endpoint("miner/default", NETUID, "198.51.100.10", 9001)
    assert fake.subnets[NETUID].neurons[1].axon["port"] == 9001
    async with SubtensorChain("local", substrate=fake) as chain:
        with pytest.raises(ValueError, match="wallet_path"):
            await chain.publish_endpoint("miner/default", NETUID, "198.51.100.10", 9001)


# ------------------------------------------------------------------ register
async def test_register_through_the_mev_shield(chain, fake, wallets):
    newcomer = wallets["newcomer"]
    uid = await chain.register(newcomer, NETUID)
    assert uid == 3 and await chain.uid_of(hotkey(newcomer), NETUID) == 3
    [carrier] = fake.submissions("submit_encrypted")
    [inner] = fake.submissions("burned_register")
    assert carrier.signer == inner.signer == coldkey(newcomer)  # paid by the coldkey
    assert inner.shielded and inner.call.params == {"netuid": NETUID, "hotkey": hotkey(newcomer)}
    assert inner.nonce == carrier.nonce + 1


async def test_register_without_shield_key_uses_the_plain_call(wallets, fake):
    fake.shield_key = None  # a local dev node
    async with SubtensorChain("local", substrate=fake) as chain:
        assert await chain.register(wallets["newcomer"], NETUID) == 3
    [plain] = fake.submissions("burned_register")
    assert not plain.shielded and fake.submissions("submit_encrypted") == []


class ShieldKeyVanishes(FakeSubstrate):
    """NextKey is in storage when looked at, but gone when the SDK fetches it."""

    async def mev_next_key(self):
        await self._reach("mev_next_key")
        return None


async def test_register_falls_back_when_the_sdk_shield_path_fails(wallets):
    node = ShieldKeyVanishes(head=500, block_time=0.002)
    owner = wallets["owner"]
    node.add_subnet(NETUID, hotkey(owner), coldkey(owner))
    async with SubtensorChain("local", substrate=node) as chain:
        assert await chain.register(wallets["newcomer"], NETUID) == 0
    assert sum(1 for e in node.read_log if e[0] == "mev_next_key") == 3  # the SDK tried, then gave up
    [plain] = node.submissions("burned_register")
    assert not plain.shielded


async def test_register_already_registered(chain, fake, wallets):
    with pytest.raises(AlreadyRegistered) as raised:
        await chain.register(wallets["miner"], NETUID)
    assert raised.value.name == "HotKeyAlreadyRegisteredInSubNet"
    assert fake.submitted == []
    # A race: someone registered the hotkey between the check and inclusion.
    fake.script("burned_register", DispatchError("HotKeyAlreadyRegisteredInSubNet"))
    with pytest.raises(AlreadyRegistered) as raised:
        await chain.register(wallets["newcomer"], NETUID)
    assert raised.value.name == "HotKeyAlreadyRegisteredInSubNet"


@pytest.mark.parametrize(
    ("outcome", "error", "name"),
    [
        (DispatchError("NoNeuronIdAvailable"), RegistrationFailed, "NoNeuronIdAvailable"),
        (PoolRejection("Invalid Transaction: Custom error: 2"), RegistrationFailed, "NotEnoughBalanceToStake"),
        (PoolRejection("Invalid Transaction: Inability to pay some fees"), RegistrationFailed, "Payment"),
        (DispatchError("SubNetRegistrationDisabled"), RegistrationFailed, "SubNetRegistrationDisabled"),
        (DispatchError("TooManyRegistrationsThisInterval"), RateLimited, "TooManyRegistrationsThisInterval"),
    ],
)
async def test_register_failures(wallets, fake, outcome, error, name):
    fake.shield_key = None
    fake.script("burned_register", outcome)
    async with SubtensorChain("local", substrate=fake) as chain:
        with pytest.raises(error) as raised:
            await chain.register(wallets["newcomer"], NETUID)
    assert raised.value.name == name


async def test_register_full_subnet_and_missing_subnet(chain, fake, wallets):
    fake.subnets[NETUID].max_allowed_uids = 3  # full, nothing prunable in the fake
    with pytest.raises(RegistrationFailed) as raised:
        await chain.register(wallets["newcomer"], NETUID)
    assert raised.value.name == "NoNeuronIdAvailable"
    with pytest.raises(SubnetNotFound):
        await chain.register(wallets["newcomer"], 99)


# ------------------------------------------------------------------ connection trouble
async def test_dropped_reads_are_retried(chain, fake):
    fake.fail_reads(2)  # both hit the connect (its token-symbol scan), which is retried
    assert await chain.block() == 1000
    assert fake.connects == 3
    fake.fail_reads(2)
    fake.head = 1001
    assert await chain.block() == 1001
    assert sum(1 for e in fake.read_log if e[0] == "block_number") == 4  # 1 + 1 failed twice, then ok


async def test_a_timeout_inside_the_sdk_is_retried(chain, fake):
    assert await chain.block() == 1000
    fake.fail_reads(1, TimeoutError())
    assert await chain.hyperparameters(NETUID)
    fake.fail_reads(5, TimeoutError())
    with pytest.raises(ChainConnectionError, match="TimeoutError"):
        await chain.block()


async def test_unreachable_node_is_a_connection_error_after_retries(fake):
    fake.unreachable = True
    started = time.monotonic()
    async with SubtensorChain("local", substrate=fake, retries=2, backoff_s=0.01) as chain:
        with pytest.raises(ChainConnectionError) as raised:
            await chain.metagraph(NETUID)
    assert raised.value.transient and "Connect call failed" in str(raised.value)
    assert fake.connects == 3
    assert time.monotonic() - started < 1.0


async def test_silent_node_times_out(fake, wallets):
    fake.silent = True
    async with SubtensorChain("local", substrate=fake, timeout_s=0.3, write_timeout_s=0.3) as chain:
        started = time.monotonic()
        with pytest.raises(ChainConnectionError, match="within 0.3s"):
            await chain.block()
        assert time.monotonic() - started < 0.8
        with pytest.raises(ChainConnectionError, match="may still land"):
            await chain.set_weights(wallets["validator"], NETUID, {1: 1.0}, version_key=2)


async def test_refused_port_with_the_real_rpc_backend():
    with socket.socket() as probe:  # a port nothing listens on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    async with SubtensorChain(f"ws://127.0.0.1:{port}", timeout_s=5.0, retries=1, backoff_s=0.01) as chain:
        started = time.monotonic()
        with pytest.raises(ChainConnectionError):
            await chain.block()
        assert time.monotonic() - started < 5.0


def test_unknown_network_is_refused():
    with pytest.raises(ValueError, match="unknown network"):
        SubtensorChain("mainnet")


# ------------------------------------------------------------------ the mapping itself
@pytest.mark.parametrize(
    ("operation", "name", "expected"),
    [
        ("set_weights", "HotKeyNotRegisteredInSubNet", NotRegistered),
        ("set_weights", "WeightVecLengthIsLow", InvalidWeights),
        ("set_weights", "MaxWeightExceeded", InvalidWeights),
        ("set_weights", "CommittingWeightsTooFast", RateLimited),
        ("set_weights", "StakeAmountTooLow", NotEnoughStake),
        ("register", "StakeAmountTooLow", RegistrationFailed),  # the umbrella Custom(1) code, by context
        ("publish_endpoint", "StakeAmountTooLow", ChainError),
        ("register", "TooManyRegistrationsThisBlock", RateLimited),
        ("publish_endpoint", "SubnetNotExists", SubnetNotFound),
        ("read", "SomethingNew", ChainError),
    ],
)
def test_mapping_of_named_sdk_errors(operation, name, expected):
    result = bt.ExtrinsicResult(success=False, message="refused", error=bt.ChainError("refused", name))
    typed = failure_error(result, operation)
    assert type(typed) is expected and typed.name == name
    assert typed.__cause__ is result.error


def test_mapping_of_unnamed_sdk_errors():
    rate = typed_error(bt.ChainError("wait", code=bt.ErrorCode.RATE_LIMITED), "publish_endpoint")
    assert isinstance(rate, RateLimited) and rate.name == "ServingRateLimitExceeded"
    assert isinstance(typed_error(bt.BittensorError("All weights are zero"), "set_weights"), InvalidWeights)
    assert type(typed_error(bt.BittensorError("odd"), "read")) is ChainError
    assert isinstance(typed_error(bt.RpcPolicyError("429", status_code=429), "read"), ChainConnectionError)
    assert isinstance(failure_error(bt.ExtrinsicResult(success=False, message="?"), "read"), ChainError)
    try:
        raise ConnectionResetError(104, "reset")
    except ConnectionResetError as cause:
        dropped = bt.ChainError(str(cause))
        dropped.__cause__ = cause
    assert isinstance(typed_error(dropped, "set_weights"), ChainConnectionError)


async def test_concurrent_first_calls_connect_once(fake):
    async with SubtensorChain("local", substrate=fake) as chain:
        blocks = await asyncio.gather(*(chain.block() for _ in range(5)))
    assert blocks == [1000] * 5 and fake.connects == 1


# ------------------------------------------------------------------ commitments (stage announcements)
async def test_publish_commitment_round_trip(chain, fake, wallets):
    text = "k3-stage/1 " + "x" * 150  # two Raw fields
    await chain.publish_commitment(wallets["miner"], NETUID, text)
    [call] = fake.composed_calls("set_commitment")
    assert call.module == "Commitments" and call.params["netuid"] == NETUID
    assert [next(iter(f)) for f in call.params["info"]["fields"]] == ["Raw128", "Raw33"]
    [submission] = fake.submissions("set_commitment")
    assert submission.signer == hotkey(wallets["miner"])  # signed by the hotkey, not the coldkey
    fake.head += 3  # past the metagraph lag
    found = await chain.commitments(NETUID)
    assert set(found) == {hotkey(wallets["miner"])}
    assert found[hotkey(wallets["miner"])].data == text


async def test_publish_commitment_limits(chain, fake, wallets):
    with pytest.raises(ValueError):  # more than 3 x 128 bytes: refused before anything is sent
        await chain.publish_commitment(wallets["miner"], NETUID, "y" * 385)
    assert fake.composed_calls("set_commitment") == []
    with pytest.raises(NotRegistered) as raised:
        await chain.publish_commitment(wallets["newcomer"], NETUID, "k3-stage/1")
    assert raised.value.name == "AccountNotAllowedCommit"
    # each call uses at least 100 of the epoch's MaxSpace bytes (3100; 300 here): the 4th short one is refused
    fake.commitment_max_space = 300
    before = submit_attempts(fake, "set_commitment")
    for _ in range(3):
        await chain.publish_commitment(wallets["miner"], NETUID, "short")
    with pytest.raises(RateLimited) as raised:
        await chain.publish_commitment(wallets["miner"], NETUID, "short")
    assert raised.value.name == "SpaceLimitExceeded"
    assert submit_attempts(fake, "set_commitment") - before == 4  # not retried
    assert (await chain.commitments(NETUID))[hotkey(wallets["miner"])].data == "short"
    fake.head += 101  # the next epoch resets the quota
    await chain.publish_commitment(wallets["miner"], NETUID, "again")
