"""The embedded devnet against real SQLite files, real bittensor wallets and real processes.

Most tests use a very long block interval and move the clock with `advance_blocks`, so block numbers are
exact; the wall-clock tests use 0.05 s blocks.
"""
from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import bittensor as bt
import numpy as np
import pytest

from chain.__main__ import main as cli_main
from chain.devnet import DevnetChain, epoch_blocks
from chain.interface import (AlreadyRegistered, ChainConnectionError, InvalidWeights, NotRegistered, NoValidatorPermit,
                             RateLimited, RegistrationFailed, SubnetNotFound)
from chain.yuma import EpochInputs, YumaParams, run_epoch, weights_to_u16

REPO = Path(__file__).resolve().parents[1]
FROZEN = 100_000.0  # seconds per block: the block only moves when a test advances it
OWNER = "5C4hrfjw9DjXZTzV3MwzrrAr9P1MJhSrvWGWqi1eSuyUpnhM"  # ss58 of the all-zero key


@pytest.fixture(scope="module")
def wallet_dir(tmp_path_factory, make_wallets) -> Path:
    path = tmp_path_factory.mktemp("wallets")
    make_wallets(path, [f"w{i}" for i in range(10)])
    return path


@pytest.fixture(scope="module")
def wallets(wallet_dir) -> list:
    return [bt.Wallet(f"w{i}", "default", path=str(wallet_dir)) for i in range(10)]


@pytest.fixture
async def chain(tmp_path):
    c = DevnetChain(tmp_path / "devnet.sqlite", block_interval=FROZEN, create=True)
    yield c
    await c.close()


def rule_epoch_blocks(netuid: int, tempo: int, after: int, upto: int) -> list[int]:
    """Plain reading of subtensor's rule: an epoch at b when blocks_until_next_epoch(b) == 0."""
    return [b for b in range(after + 1, upto + 1) if tempo - (b + netuid + 1) % (tempo + 1) == 0]


def dense(rows: dict[int, dict[int, int]], n: int) -> np.ndarray:
    m = np.zeros((n, n), dtype=np.int64)
    for i, row in rows.items():
        for j, v in row.items():
            m[i, j] = v
    return m


async def wait_for_block(chain: DevnetChain, block: int, timeout: float = 5.0) -> int:
    deadline = time.monotonic() + timeout
    while (now := await chain.block()) < block:
        assert time.monotonic() < deadline, f"block {block} not reached"
        await asyncio.sleep(chain.block_interval / 2)
    return now


# ---------------------------------------------------------------- blocks, files, processes
def test_epoch_schedule_is_subtensors_rule():
    for netuid in (0, 1, 7):
        for tempo in (1, 3, 10, 360):
            for after in (-1, 0, 5, 97):
                assert list(epoch_blocks(netuid, tempo, after, after + 800)) == rule_epoch_blocks(
                    netuid, tempo, after, after + 800)


async def test_opening_errors(tmp_path):
    with pytest.raises(ChainConnectionError, match="devnet create"):
        DevnetChain(tmp_path / "missing.sqlite")
    junk = tmp_path / "junk.sqlite"
    junk.write_bytes(b"")
    with pytest.raises(ValueError, match="not a devnet"):
        DevnetChain(junk)
    c = DevnetChain(tmp_path / "d.sqlite", block_interval=0.5, create=True)
    await c.close()
    with pytest.raises(ValueError, match="0.5 s per block"):
        DevnetChain(tmp_path / "d.sqlite", block_interval=0.2)


async def test_block_follows_wall_clock_and_state_survives_reopening(tmp_path, wallets):
    path = tmp_path / "devnet.sqlite"
    c = DevnetChain(path, block_interval=0.05, create=True)
    netuid = await c.create_subnet(OWNER, tempo=1000)
    uid = await c.register(wallets[0], netuid)
    t0 = time.time()
    start = await c.block()
    await asyncio.sleep(0.3)
    end = await c.block()
    elapsed = time.time() - t0
    assert 0.3 / 0.05 - 1 <= end - start <= elapsed / 0.05 + 1
    await c.close()

    again = DevnetChain(path)  # no block interval given: the file's own
    assert again.block_interval == 0.05
    snapshot = await again.metagraph(netuid)
    assert snapshot.block >= start + 6
    assert snapshot.by_hotkey(wallets[0].hotkey.ss58_address).uid == uid
    assert snapshot.neurons[0].coldkey == wallets[0].coldkeypub.ss58_address
    assert await again.uid_of(wallets[1].hotkey.ss58_address, netuid) is None
    with pytest.raises(SubnetNotFound):
        await again.metagraph(netuid + 5)
    await again.close()


WORKER = r"""
import asyncio, json, sys, time
import bittensor as bt
from chain.devnet import DevnetChain

db, wallet_path, name, netuid, target, miners, ops, port0, start_at = json.loads(sys.argv[1])

async def main():
    chain = DevnetChain(db)
    me = bt.Wallet(name, "default", path=wallet_path)
    me.hotkey, me.coldkeypub
    time.sleep(max(0.0, start_at - time.time()))  # both workers start writing at the same moment
    last = None
    for i in range(ops):
        await chain.add_stake(me, target, netuid, 1.0)
        last = await chain.set_weights(me, netuid, {miners[0]: i + 1, miners[1]: ops}, 0)
        await chain.publish_endpoint(me, netuid, "127.0.0.1", port0 + i)
        snapshot = await chain.metagraph(netuid)
        assert snapshot.by_hotkey(me.hotkey.ss58_address).endpoint.port == port0 + i
    await chain.close()
    print(json.dumps({"block": last.block, "uids": last.uids, "weights": last.weights_u16}))

asyncio.run(main())
"""


async def test_two_processes_writing_at_once_lose_nothing(tmp_path, wallets, wallet_dir):
    path = tmp_path / "devnet.sqlite"
    c = DevnetChain(path, block_interval=0.05, create=True)
    netuid = await c.create_subnet(OWNER, tempo=4, weights_rate_limit=0, serving_rate_limit=0)
    uids = [await c.register(w, netuid) for w in wallets[:4]]  # two validators, two miners
    for w in wallets[:2]:
        await c.add_stake(w, w, netuid, 100.0)
    target = wallets[2].hotkey.ss58_address
    ops = 40
    start_at = time.time() + 3.0  # after both interpreters have started
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", WORKER, json.dumps(
                [str(path), str(wallet_dir), f"w{i}", netuid, target, uids[2:], ops, 20000 + 1000 * i, start_at])],
            cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"},
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )
        for i in range(2)
    ]
    reads = 0
    while any(p.poll() is None for p in procs):  # a third party reads while they write
        snapshot = await c.metagraph(netuid)
        assert len(snapshot) == 4
        reads += 1
        await asyncio.sleep(0.01)
    results = []
    for p in procs:
        out, err = p.communicate(timeout=60)
        assert p.returncode == 0, err
        results.append(json.loads(out))
    assert reads > 0
    await c.close()

    reopened = DevnetChain(path)
    snapshot = await reopened.metagraph(netuid)
    assert snapshot.by_uid(uids[2]).stake == pytest.approx(2 * ops)  # every read-modify-write landed
    stored = await reopened.weights(netuid)
    for i, result in enumerate(results):
        neuron = snapshot.by_uid(uids[i])
        assert neuron.last_update == result["block"]
        assert neuron.endpoint.port == 20000 + 1000 * i + ops - 1
        assert stored[uids[i]] == dict(zip(result["uids"], result["weights"]))
        assert result["weights"] == weights_to_u16([ops, ops])
    history = await reopened.epoch_history(netuid, limit=None)
    assert [e.block for e in history] == sorted({e.block for e in history})
    await reopened.close()


# ---------------------------------------------------------------- set weights and serving
async def test_set_weights_checks_in_order_and_leave_state_unchanged(chain, wallets):
    netuid = await chain.create_subnet(
        OWNER, tempo=1000, weights_rate_limit=5, min_allowed_weights=2, weights_version=3, max_weight_limit=0.6)
    await chain.advance_blocks(1)  # LastUpdate 0 (registered at block 0) is never rate limited, as on subtensor
    v, m0, m1, m2 = wallets[:4]
    for w in (v, m0, m1, m2):
        await chain.register(w, netuid)
    await chain.add_stake(v, v, netuid, 10.0)
    assert [n.validator_permit for n in (await chain.metagraph(netuid)).neurons] == [True, False, False, False]

    async def state():
        snapshot = await chain.metagraph(netuid)
        return await chain.weights(netuid), [n.last_update for n in snapshot.neurons]

    async def refused(error, name, wallet, weights, version_key=3):
        before = await state()
        with pytest.raises(error) as caught:
            await chain.set_weights(wallet, netuid, weights, version_key)
        assert caught.value.name == name
        assert await state() == before
        return caught.value

    await refused(NotRegistered, "HotKeyNotRegisteredInSubNet", wallets[9], {1: 1.0, 2: 1.0})
    await refused(InvalidWeights, "IncorrectWeightVersionKey", v, {1: 1.0, 2: 1.0}, version_key=2)
    err = await refused(RateLimited, "SettingWeightsTooFast", v, {1: 1.0, 2: 1.0})
    assert err.transient
    await chain.advance_blocks(5)
    await refused(NoValidatorPermit, "NeuronNoValidatorPermit", m0, {0: 1.0, 2: 1.0})
    await refused(InvalidWeights, "DuplicateUids", v, [(1, 1.0), (1, 0.5), (2, 1.0)])
    await refused(InvalidWeights, "UidVecContainInvalidOne", v, {1: 1.0, 9: 1.0})
    await refused(InvalidWeights, "WeightVecLengthIsLow", v, {1: 1.0})
    # Rows over max_weight_limit are clipped (as the SDK does); one positive weight cannot be clipped.
    await refused(InvalidWeights, "MaxWeightExceeded", v, {1: 1.0, 2: 0.0})
    await refused(InvalidWeights, "InvalidWeights", v, {1: float("nan"), 2: 1.0})
    await refused(InvalidWeights, "InvalidWeights", v, {1: -1.0, 2: 1.0})

    outcome = await chain.set_weights(v, netuid, {1: 0.5, 2: 0.3, 3: 0.2}, 3)
    assert outcome.block == 6 and outcome.uids == (1, 2, 3)
    assert list(outcome.weights_u16) == weights_to_u16([0.5, 0.3, 0.2])
    weights, last_update = await state()
    assert weights[0] == dict(zip(outcome.uids, outcome.weights_u16))
    assert last_update[0] == 6
    await refused(RateLimited, "SettingWeightsTooFast", v, {1: 1.0, 2: 1.0})
    # A miner without a permit may still set its self weight (it is exempt from the length minimum too).
    self_only = await chain.set_weights(m0, netuid, {1: 1.0}, 3)
    assert self_only.uids == (1,) and self_only.weights_u16 == (65535,)


async def test_publish_endpoint_rate_limit_and_validation(chain, wallets):
    netuid = await chain.create_subnet(OWNER, tempo=1000, serving_rate_limit=10)
    await chain.advance_blocks(1)  # an endpoint served at block 0 counts as never served, as on subtensor
    miner = wallets[0]
    await chain.register(miner, netuid)
    with pytest.raises(NotRegistered):
        await chain.publish_endpoint(wallets[1], netuid, "127.0.0.1", 8000)
    for ip, port in (("1.2.3", 8000), ("0.0.0.0", 8000), ("127.0.0.1", 0), ("127.0.0.1", 70000), ("x", 1)):
        with pytest.raises(ValueError):
            await chain.publish_endpoint(miner, netuid, ip, port)
    assert (await chain.metagraph(netuid)).neurons[0].endpoint is None

    await chain.publish_endpoint(miner, netuid, "127.0.0.1", 8000)
    with pytest.raises(RateLimited) as caught:
        await chain.publish_endpoint(miner, netuid, "127.0.0.2", 9000)
    assert caught.value.name == "ServingRateLimitExceeded"
    endpoint = (await chain.metagraph(netuid)).neurons[0].endpoint
    assert (endpoint.ip, endpoint.port, endpoint.protocol, endpoint.version) == ("127.0.0.1", 8000, 4, 1)

    await chain.advance_blocks(10)
    await chain.publish_endpoint(miner, netuid, "::1", 9000)
    assert (await chain.metagraph(netuid)).neurons[0].endpoint.url == "http://[::1]:9000"


async def test_commitments_as_the_pallet_limits_them(chain, wallets):
    """set_commitment: registered hotkeys only, at most 3 x 128 bytes, max(100, bytes) of 3100 per epoch
    index (block + netuid + 1) // (tempo + 1), the newest replacing the last; a failure changes nothing."""
    netuid = await chain.create_subnet(OWNER, tempo=99)
    miner, other = wallets[0], wallets[1]
    await chain.register(miner, netuid)
    with pytest.raises(NotRegistered) as caught:
        await chain.publish_commitment(other, netuid, "k3-stage/1")
    assert caught.value.name == "AccountNotAllowedCommit"
    with pytest.raises(ValueError):
        await chain.publish_commitment(miner, netuid, "z" * 385)
    assert await chain.commitments(netuid) == {}

    long = "k3-stage/1 " + "y" * 300  # 311 bytes: three fields, 311 of the quota
    await chain.publish_commitment(miner, netuid, long)
    [(hotkey, got)] = (await chain.commitments(netuid)).items()
    assert hotkey == miner.hotkey.ss58_address and got.data == long and got.block == await chain.block()
    for i in range(27):  # 311 + 27 x 100 = 3011: one more short one (100) would pass 3100
        await chain.publish_commitment(miner, netuid, f"short {i}")
    with pytest.raises(RateLimited) as caught:
        await chain.publish_commitment(miner, netuid, "one too many")
    assert caught.value.name == "SpaceLimitExceeded" and caught.value.retry_after_blocks >= 1
    assert (await chain.commitments(netuid))[miner.hotkey.ss58_address].data == "short 26"
    await chain.advance_blocks(caught.value.retry_after_blocks)  # the next epoch index: a fresh quota
    await chain.publish_commitment(miner, netuid, "one too many")
    assert (await chain.commitments(netuid))[miner.hotkey.ss58_address].data == "one too many"


# ---------------------------------------------------------------- epochs
async def test_epochs_match_yuma_and_the_worked_example(chain, wallets):
    # docs/yuma.md's worked example: validators A, B, C (stake .5 .3 .2), miners M1..M3, E = 1000.
    netuid = await chain.create_subnet(OWNER, tempo=10, weights_rate_limit=0, emission_per_block=100.0)
    for w in wallets[:6]:
        await chain.register(w, netuid)
    for w, stake in zip(wallets[:3], (0.5, 0.3, 0.2)):
        await chain.add_stake(w, w, netuid, stake)
    await chain.advance_blocks(1)  # weights must postdate the miners' registration to count
    rows = [{3: 60, 4: 40}, {3: 60, 4: 40}, {3: 40, 4: 20, 5: 40}]
    for w, row in zip(wallets[:3], rows):
        await chain.set_weights(w, netuid, row, 0)
    first_epoch = rule_epoch_blocks(netuid, 10, 0, 100)[0]
    await chain.advance_blocks(first_epoch - 1)
    [epoch] = await chain.epoch_history(netuid)
    assert epoch.block == first_epoch and epoch.emission_budget == 1000.0

    weights = dense(await chain.weights(netuid), 6).astype(np.uint16)
    inputs = EpochInputs(
        block=first_epoch, stake=np.array([0.5, 0.3, 0.2, 0, 0, 0]), last_update=np.array([1, 1, 1, 0, 0, 0]),
        block_at_registration=np.zeros(6, dtype=np.int64), validator_permit=np.array([1, 1, 1, 0, 0, 0], bool),
        weights=weights, bonds=np.zeros((6, 6), dtype=np.uint16),
        registered_since_last_epoch=np.ones(6, bool), emission_budget=1000.0,
    )
    expected = run_epoch(inputs, YumaParams())
    for name in ("rank", "trust", "consensus", "incentive", "dividends", "emission", "validator_trust"):
        np.testing.assert_allclose([getattr(n, name) for n in epoch.neurons], getattr(expected, name), atol=1e-12)
    assert [n.validator_permit for n in epoch.neurons] == list(expected.validator_permit)
    np.testing.assert_array_equal(dense({n.uid: n.bonds for n in epoch.neurons}, 6), expected.bonds)

    # The documented numbers, and miners' incentive follows the validators' weights.
    np.testing.assert_allclose([n.incentive for n in epoch.neurons[3:]], [0.6087, 0.3913, 0], atol=1e-4)
    np.testing.assert_allclose([n.dividends for n in epoch.neurons[:3]], [0.5436, 0.3262, 0.1302], atol=1e-4)
    np.testing.assert_allclose([n.miner_emission for n in epoch.neurons[3:]], [304.35, 195.65, 0], atol=0.01)
    assert epoch.by_uid(0).bonds == {3: 3932, 4: 2621}
    snapshot = await chain.metagraph(netuid)
    assert [n.incentive for n in snapshot.neurons] == [n.incentive for n in epoch.neurons]
    assert [n.emission for n in snapshot.neurons] == [n.emission for n in epoch.neurons]

    await chain.advance_blocks(11)
    second = await chain.last_epoch(netuid)
    assert second.block == first_epoch + 11
    assert second.by_uid(0).bonds == {3: 7470, 4: 4980} and second.by_uid(2).bonds == {3: 4980, 4: 2489}
    assert await chain.bonds(netuid) == {u: epoch_neuron.bonds for u, epoch_neuron in enumerate(second.neurons)
                                         if epoch_neuron.bonds}


async def test_epochs_that_fell_due_unobserved_run_in_order(tmp_path, wallets):
    path = tmp_path / "devnet.sqlite"
    tempo, cutoff = 3, 6
    c = DevnetChain(path, block_interval=0.05, create=True)
    netuid = await c.create_subnet(OWNER, tempo=tempo, weights_rate_limit=0, activity_cutoff=cutoff)
    validator, miner = wallets[0], wallets[1]
    await c.register(validator, netuid)
    registered = await c.block()
    await c.register(miner, netuid)
    await c.add_stake(validator, validator, netuid, 1.0)
    await wait_for_block(c, (await c.metagraph(netuid)).by_uid(1).block_at_registration + 1)
    outcome = await c.set_weights(validator, netuid, {1: 1.0}, 0)
    info = await c.subnet_info(netuid)
    assert info["created_block"] <= registered
    await c.close()

    time.sleep(1.3)  # nobody looks: ~26 blocks, ~6 epochs fall due
    reopened = DevnetChain(path)
    snapshot = await reopened.metagraph(netuid)
    history = await reopened.epoch_history(netuid, limit=None)
    now = await reopened.block()  # the wall clock moves on: epochs up to the history's read block ran
    assert [e.block for e in history][:len(rule_epoch_blocks(netuid, tempo, info["created_block"], snapshot.block))] \
        == rule_epoch_blocks(netuid, tempo, info["created_block"], snapshot.block)
    assert set(e.block for e in history) <= set(rule_epoch_blocks(netuid, tempo, info["created_block"], now))
    later = [e for e in history if e.block > outcome.block]
    assert len(later) >= 4

    # Replay each unobserved epoch with Yuma from the one before: each ran at its own block, in order.
    last_update = np.array([n.last_update for n in snapshot.neurons])
    registered_at = np.array([n.block_at_registration for n in snapshot.neurons])
    weights = dense(await reopened.weights(netuid), 2).astype(np.uint16)
    for before, after in zip(later, later[1:]):
        expected = run_epoch(EpochInputs(
            block=after.block, stake=np.array([1.0, 0.0]), last_update=last_update,
            block_at_registration=registered_at,
            validator_permit=np.array([n.validator_permit for n in before.neurons]),
            weights=weights, bonds=dense({n.uid: n.bonds for n in before.neurons}, 2).astype(np.uint16),
            registered_since_last_epoch=np.zeros(2, bool), emission_budget=float(tempo),
        ), YumaParams(activity_cutoff=cutoff))
        assert [n.active for n in after.neurons] == list(expected.active)
        np.testing.assert_allclose([n.incentive for n in after.neurons], expected.incentive, atol=1e-12)
        np.testing.assert_allclose([n.emission for n in after.neurons], expected.emission, atol=1e-12)
        np.testing.assert_array_equal(dense({n.uid: n.bonds for n in after.neurons}, 2), expected.bonds)
    # The validator goes inactive once its weights are older than the cutoff, epoch by epoch.
    assert [e.by_uid(0).active for e in later] == [outcome.block + cutoff >= e.block for e in later]
    assert any(e.by_uid(0).active for e in later) and not all(e.by_uid(0).active for e in later)
    assert await reopened.run_pending_epochs() >= 0
    await reopened.close()


async def test_permits_from_stake_until_the_first_epoch_then_from_epochs(chain, wallets):
    netuid = await chain.create_subnet(OWNER, tempo=10, max_validators=2)
    for w in wallets[:3]:
        await chain.register(w, netuid)
    for w, stake in zip(wallets[:3], (3.0, 2.0, 1.0)):
        await chain.add_stake(w, w, netuid, stake)
    permits = lambda s: [n.validator_permit for n in s.neurons]  # noqa: E731
    assert permits(await chain.metagraph(netuid)) == [True, True, False]
    await chain.advance_blocks(rule_epoch_blocks(netuid, 10, 0, 100)[0])
    assert (await chain.subnet_info(netuid))["permits_from_epoch"]
    await chain.add_stake(wallets[2], wallets[2], netuid, 10.0)  # now the largest
    assert permits(await chain.metagraph(netuid)) == [True, True, False]  # P' waits for the epoch
    await chain.advance_blocks(11)
    assert permits(await chain.metagraph(netuid)) == [True, False, True]


# ---------------------------------------------------------------- registration
async def test_registration_when_full_prunes_the_lowest_emission_outside_immunity(chain, wallets):
    netuid = await chain.create_subnet(
        OWNER, tempo=4, max_uids=3, immunity_period=10, min_non_immune_uids=0, weights_rate_limit=0)
    v, good, weak = wallets[:3]
    for w in (v, good, weak):
        await chain.register(w, netuid)
    with pytest.raises(AlreadyRegistered):
        await chain.register(good, netuid)
    await chain.add_stake(v, v, netuid, 1.0)
    await chain.advance_blocks(1)
    await chain.set_weights(v, netuid, {1: 1.0, 2: 0.01}, 0)
    await chain.advance_blocks(12)  # past immunity, epochs ran
    snapshot = await chain.metagraph(netuid)
    emission = [n.emission for n in snapshot.neurons]
    assert emission[2] < emission[1] and emission[2] < emission[0]

    newcomer = wallets[3]
    assert await chain.register(newcomer, netuid) == 2
    snapshot = await chain.metagraph(netuid)
    replaced = snapshot.by_uid(2)
    assert replaced.hotkey == newcomer.hotkey.ss58_address and replaced.coldkey == newcomer.coldkeypub.ss58_address
    assert replaced.block_at_registration == snapshot.block and replaced.emission == 0
    assert replaced.endpoint is None and not replaced.validator_permit
    assert await chain.uid_of(weak.hotkey.ss58_address, netuid) is None
    assert (await chain.weights(netuid))[0] == {1: 65535, 2: 0}  # explicit zero to the new holder

    # uid 2 is now immune with the lowest emission (0); the next registration takes a non-immune uid.
    expected = min((0, 1), key=lambda u: (emission[u], u))
    assert await chain.register(wallets[4], netuid) == expected
    assert (await chain.metagraph(netuid)).by_uid(2).hotkey == newcomer.hotkey.ss58_address


async def test_registration_fails_when_only_the_owner_is_left(chain, wallets):
    owner = wallets[0]
    netuid = await chain.create_subnet(owner, tempo=1000, max_uids=1, immunity_period=0)
    assert (await chain.subnet_info(netuid))["owner_hotkey"] == owner.hotkey.ss58_address
    await chain.register(owner, netuid)
    with pytest.raises(RegistrationFailed):
        await chain.register(wallets[1], netuid)
    assert (await chain.metagraph(netuid)).neurons[0].hotkey == owner.hotkey.ss58_address


async def test_hyperparameters_and_admin_validation(chain, wallets):
    netuid = await chain.create_subnet(OWNER, tempo=7, max_weight_limit=0.5)
    hp = await chain.hyperparameters(netuid)
    assert (hp.tempo, hp.max_weight_limit, hp.commit_reveal) == (7, 0.5, False)
    assert await chain.set_hyperparameter(netuid, "weights_version", "4") == 4
    assert (await chain.hyperparameters(netuid)).weights_version == 4
    for name, value in (("tempo", 0), ("max_weight_limit", 1.5), ("nonsense", 1), ("yuma_version", "y9")):
        with pytest.raises(ValueError):
            await chain.set_hyperparameter(netuid, name, value)
    with pytest.raises(SubnetNotFound):
        await chain.set_hyperparameter(netuid + 1, "tempo", 5)
    with pytest.raises(NotRegistered):
        await chain.add_stake(wallets[0], wallets[0], netuid, 1.0)
    await chain.register(wallets[0], netuid)
    with pytest.raises(ValueError):
        await chain.add_stake(wallets[0], wallets[0], netuid, -1.0)
    # A new tempo applies from now on: no epochs appear retroactively for the blocks already past.
    slow = await chain.create_subnet(OWNER, tempo=1000)
    await chain.advance_blocks(50)
    await chain.set_hyperparameter(slow, "tempo", 5)
    assert await chain.epoch_history(slow) == []
    await chain.advance_blocks(6)
    assert [e.block for e in await chain.epoch_history(slow)] == rule_epoch_blocks(slow, 5, 50, 56)
    for _ in range(9):  # the next epoch block, as the rule places it, from every phase of the tempo
        until = await chain.blocks_until_next_epoch(netuid)
        block = await chain.block()
        assert block + until == rule_epoch_blocks(netuid, 7, block - 1, block + 8)[0]
        await chain.advance_blocks(1)


# ---------------------------------------------------------------- the CLI
def cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "chain", *args], cwd=REPO, capture_output=True, text=True, timeout=60,
        env={**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"},
    )


def test_cli_create_register_metagraph_and_user_errors(tmp_path, capsys):
    db = str(tmp_path / "devnet.sqlite")
    created = cli("devnet", "create", "--db", db, "--block-interval", "0.1", "--tempo", "5")
    assert created.returncode == 0, created.stderr
    netuid = created.stdout.strip()
    assert netuid == "1"
    wallet = ["--wallet-path", str(tmp_path / "wallets"), "--wallet-name", "cli", "--wallet-hotkey", "hk"]
    made = cli("wallet", "create", *wallet, "--json")
    assert made.returncode == 0, made.stderr
    keys = json.loads(made.stdout)
    wallet_obj = bt.Wallet("cli", "hk", path=str(tmp_path / "wallets"))
    assert (keys["hotkey"], keys["coldkey"]) == (wallet_obj.hotkey.ss58_address, wallet_obj.coldkeypub.ss58_address)
    registered = cli("register", "--db", db, "--netuid", netuid, *wallet)
    assert registered.returncode == 0, registered.stderr
    assert registered.stdout.strip() == "0"
    # The rest in-process (same entry point, a subprocess start costs ~1 s on a busy machine).
    assert cli_main(["stake", "--db", db, "--netuid", netuid, *wallet, "--amount", "2.5"]) == 0
    assert capsys.readouterr().out.strip() == "2.5"
    shown = cli("metagraph", "--db", db, "--netuid", netuid, "--json")
    assert shown.returncode == 0, shown.stderr
    metagraph = json.loads(shown.stdout)
    [neuron] = metagraph["neurons"]
    assert neuron["hotkey"] == keys["hotkey"] and neuron["coldkey"] == keys["coldkey"]
    assert neuron["stake"] == 2.5 and neuron["validator_permit"] is True and metagraph["tempo"] == 5

    missing_db = cli("metagraph", "--db", str(tmp_path / "nope.sqlite"), "--netuid", "1")
    assert missing_db.returncode == 2 and "devnet create" in missing_db.stderr and not missing_db.stdout
    for argv, message in (
        (["register", "--db", db, "--netuid", netuid, *wallet], "HotKeyAlreadyRegisteredInSubNet"),
        (["metagraph", "--db", db, "--netuid", "9"], "subnet 9 does not exist"),
        (["register", "--db", db, "--netuid", netuid, "--wallet-path", str(tmp_path), "--wallet-name", "ghost",
          "--wallet-hotkey", "default"], "wallet create"),
        (["devnet", "create", "--db", db], "already exists"),
        (["devnet", "create", "--db", str(tmp_path / "x.sqlite"), "--tempo", "zero"], "tempo must be"),
    ):
        assert cli_main(argv) == 2
        out = capsys.readouterr()
        assert message in out.err and out.err.startswith("error: ") and not out.out
    assert not (tmp_path / "x.sqlite").exists()


def test_cli_names_the_chain_as_btcli_does(tmp_path, capsys):
    """--network devnet:PATH is --db PATH; a subtensor node is reached through the SDK (a refused port here: the
    error is one line), and what only the devnet can do says which btcli command does it on a node."""
    db = str(tmp_path / "devnet.sqlite")
    assert cli_main(["devnet", "create", "--db", db, "--tempo", "7"]) == 0
    capsys.readouterr()
    assert cli_main(["hyperparameters", "--network", f"devnet:{db}", "--netuid", "1", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["tempo"] == 7
    assert cli_main(["block", "--network", "ws://127.0.0.1:1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("error: ") and "127.0.0.1" in err[-1]
    wallet = ["--wallet-path", str(tmp_path), "-w", "w", "-H", "h"]
    assert cli_main(["stake", "--network", "test", "--netuid", "1", *wallet, "--amount", "1"]) == 2
    assert "btcli stake add --netuid N --amount-tao X" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli_main(["metagraph", "--network", "mainnet", "--netuid", "1"])
    assert "finney, test, local" in capsys.readouterr().err
