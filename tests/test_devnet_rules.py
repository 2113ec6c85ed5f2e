"""The devnet's extrinsic rules as subtensor's (issue 15): explicit zero weights, max-weight clipping, the
owner's exemptions, the weights and serving rate limits with their "wait N blocks" answers, the version key,
and commit-reveal; and the validator's weight setting on top of them (commit-reveal, waiting the blocks the
chain names). Real SQLite devnets, real bittensor wallets, a frozen clock moved by `advance_blocks`."""
from __future__ import annotations

import asyncio
from dataclasses import replace

import bittensor as bt
import pytest
from bittensor.intents import normalize as sdk_normalize
from bittensor.intents.weights import clip_to_max_weight as sdk_clip

from chain.devnet import DevnetChain
from chain.interface import InvalidWeights, NotEnoughStake, NoValidatorPermit, RateLimited
from chain.weights import U16_MAX, clip_to_max_weight, conform

FROZEN = 100_000.0
OWNER_COLDKEY = "5C4hrfjw9DjXZTzV3MwzrrAr9P1MJhSrvWGWqi1eSuyUpnhM"


@pytest.fixture(scope="module")
def wallets(tmp_path_factory) -> list:
    path = tmp_path_factory.mktemp("wallets")
    out = []
    for i in range(5):
        w = bt.Wallet(f"r{i}", "default", path=str(path))
        w.create_new_coldkey(use_password=False, suppress=True)
        w.create_new_hotkey(use_password=False, suppress=True)
        out.append(w)
    return out


@pytest.fixture
async def chain(tmp_path):
    c = DevnetChain(tmp_path / "devnet.sqlite", block_interval=FROZEN, create=True)
    yield c
    await c.close()


async def subnet_with(chain, wallets, count=3, stake=(10.0,), **hyperparameters):
    """A subnet (first epoch far away unless tempo is given) with `count` registered wallets at block 1."""
    hyperparameters.setdefault("tempo", 1000)
    netuid = await chain.create_subnet(OWNER_COLDKEY, **hyperparameters)
    await chain.advance_blocks(1)
    for w in wallets[:count]:
        await chain.register(w, netuid)
    for w, amount in zip(wallets, stake):
        await chain.add_stake(w, w, netuid, amount)
    await chain.advance_blocks(1)  # weights must postdate the registrations
    return netuid


# ---------------------------------------------------------------- set_weights
async def test_explicit_zero_weights_are_stored(chain, wallets):
    netuid = await subnet_with(chain, wallets, weights_rate_limit=0)
    outcome = await chain.set_weights(wallets[0], netuid, {1: 1.0, 2: 0.0}, 0)
    assert outcome.uids == (1, 2) and outcome.weights_u16 == (65535, 0)
    assert (await chain.weights(netuid))[0] == {1: 65535, 2: 0}


async def test_rows_over_the_max_weight_limit_are_clipped_as_the_sdk_clips_them(chain, wallets):
    netuid = await subnet_with(chain, wallets, count=4, weights_rate_limit=0, max_weight_limit=0.4)
    weights = {1: 0.7, 2: 0.2, 3: 0.1}
    outcome = await chain.set_weights(wallets[0], netuid, weights, 0)
    row = list(outcome.weights_u16)
    assert max(row) / sum(row) <= 0.4
    # The SDK submits the same row: its clip, then its quantisation.
    assert (list(outcome.uids), row) == sdk_normalize(list(weights), sdk_clip(list(weights.values()), 0.4))


@pytest.mark.parametrize("seed", range(30))
def test_clip_and_conform_match_the_sdk(seed):
    import random
    rng = random.Random(seed)
    n = rng.randint(1, 12)
    values = [rng.choice([0.0, rng.random(), rng.random() * 100]) for _ in range(n)]
    if not any(values):
        values[0] = 1.0
    limit = rng.choice([0.05, 0.1, 0.25, 0.5, 0.9, 1.0])
    if n * limit > 1 and sum(v > 0 for v in values) * limit > 1:
        assert clip_to_max_weight(values, limit) == pytest.approx(sdk_clip(values, limit), abs=1e-12)
    row = conform(dict(enumerate(values)), own_uid=None, max_weight_limit=limit)
    uids, expected = sdk_normalize(list(range(n)), sdk_clip(values, limit) if limit < 1 else values)
    if sum(v > 0 for v in values) * limit > 1 or limit >= 1 or n * limit <= 1:
        assert (list(row.uids), list(row.values)) == (uids, expected)


async def test_the_owner_needs_neither_stake_nor_permit(chain, wallets):
    owner, validator, miner = wallets[:3]
    netuid = await chain.create_subnet(OWNER_COLDKEY, owner_hotkey=owner.hotkey.ss58_address, tempo=1000,
                                       weights_rate_limit=0, stake_threshold=5.0, max_validators=1)
    await chain.advance_blocks(1)
    for w in (owner, validator, miner):
        await chain.register(w, netuid)
    await chain.add_stake(validator, validator, netuid, 10.0)
    await chain.advance_blocks(1)
    permits = [n.validator_permit for n in (await chain.metagraph(netuid)).neurons]
    assert permits == [True, True, False]  # the owner's permit is forced beside the top-1 stake
    await chain.set_weights(owner, netuid, {2: 1.0}, 0)  # no stake at all: allowed for the owner
    with pytest.raises(NotEnoughStake):
        await chain.set_weights(miner, netuid, {1: 1.0, 2: 1.0}, 0)
    await chain.add_stake(miner, miner, netuid, 6.0)
    with pytest.raises(NoValidatorPermit):  # enough stake now, but no permit (K = 1 and the owner's)
        await chain.set_weights(miner, netuid, {0: 1.0, 1: 1.0}, 0)


async def test_rate_limits_say_how_many_blocks_to_wait(chain, wallets):
    netuid = await subnet_with(chain, wallets, weights_rate_limit=10, serving_rate_limit=7)
    await chain.advance_blocks(10)  # the limit counts from the registration block, LastUpdate's first value
    await chain.set_weights(wallets[0], netuid, {1: 1.0}, 0)
    await chain.advance_blocks(4)
    with pytest.raises(RateLimited) as caught:
        await chain.set_weights(wallets[0], netuid, {1: 1.0}, 0)
    assert caught.value.name == "SettingWeightsTooFast" and caught.value.retry_after_blocks == 6
    await chain.advance_blocks(6)
    await chain.set_weights(wallets[0], netuid, {1: 1.0}, 0)

    await chain.publish_endpoint(wallets[1], netuid, "127.0.0.1", 9000)
    with pytest.raises(RateLimited) as caught:
        await chain.publish_endpoint(wallets[1], netuid, "127.0.0.1", 9001)
    assert caught.value.name == "ServingRateLimitExceeded" and caught.value.retry_after_blocks == 7


async def test_version_key(chain, wallets):
    netuid = await subnet_with(chain, wallets, weights_rate_limit=0, weights_version=5)
    with pytest.raises(InvalidWeights) as caught:
        await chain.set_weights(wallets[0], netuid, {1: 1.0}, 4)
    assert caught.value.name == "IncorrectWeightVersionKey"
    await chain.set_weights(wallets[0], netuid, {1: 1.0}, 5)
    await chain.set_weights(wallets[0], netuid, {1: 1.0}, 6)
    await chain.set_hyperparameter(netuid, "weights_version", 0)  # 0: any key passes
    await chain.set_weights(wallets[0], netuid, {1: 1.0}, 0)


# ---------------------------------------------------------------- commit-reveal
async def epoch_after(chain, netuid):
    """Advance to the subnet's next epoch (at an epoch block, blocks_until_next_epoch is 0: it has run)."""
    tempo = (await chain.hyperparameters(netuid)).tempo
    before = await chain.last_epoch(netuid)
    await chain.advance_blocks(await chain.blocks_until_next_epoch(netuid) or tempo + 1)
    epoch = await chain.last_epoch(netuid)
    assert before is None or epoch.block > before.block
    return epoch


@pytest.mark.parametrize("reveal_period", [1, 2])
async def test_commit_reveal_hides_weights_until_the_reveal_epoch(chain, wallets, reveal_period):
    netuid = await subnet_with(chain, wallets, tempo=10, weights_rate_limit=3, commit_reveal=True,
                               reveal_period=reveal_period)
    assert (await chain.hyperparameters(netuid)).commit_reveal
    await epoch_after(chain, netuid)
    outcome = await chain.set_weights(wallets[0], netuid, {1: 0.0, 2: 1.0}, 0)
    assert outcome.committed and outcome.extra["reveal_epoch"] == outcome.extra["commit_epoch"] + reveal_period
    assert 0 not in await chain.weights(netuid)  # nothing visible yet
    assert [c["weights"] for c in await chain.pending_commits(netuid)] == [{1: 0, 2: 65535}]
    assert (await chain.metagraph(netuid)).by_uid(0).last_update == outcome.block
    with pytest.raises(RateLimited) as caught:
        await chain.set_weights(wallets[0], netuid, {2: 1.0}, 0)
    assert caught.value.name == "CommittingWeightsTooFast"

    for _ in range(reveal_period - 1):
        epoch = await epoch_after(chain, netuid)
        assert epoch.by_uid(2).incentive == 0.0 and 0 not in await chain.weights(netuid)
    epoch = await epoch_after(chain, netuid)  # revealed just before this epoch, which counts them
    assert (await chain.weights(netuid))[0] == {1: 0, 2: 65535}
    assert epoch.by_uid(2).incentive == 1.0
    assert await chain.pending_commits(netuid) == []
    assert (await chain.metagraph(netuid)).by_uid(0).last_update == outcome.block  # kept at the commit block


async def test_a_revealed_row_the_chain_refuses_is_dropped(chain, wallets):
    netuid = await subnet_with(chain, wallets, tempo=10, weights_rate_limit=0, commit_reveal=True,
                               weights_version=2)
    await epoch_after(chain, netuid)
    await chain.set_weights(wallets[0], netuid, {2: 1.0}, 2)
    await chain.set_hyperparameter(netuid, "weights_version", 3)  # the committed key is now stale
    epoch = await epoch_after(chain, netuid)
    assert 0 not in await chain.weights(netuid) and epoch.by_uid(2).incentive == 0.0
    assert await chain.pending_commits(netuid) == []


# ---------------------------------------------------------------- the validator's weight setting
def validator_loop(chain, wallet, netuid, tmp_path, retry_s=0.02):
    from neurons.validator_app.rounds import ValidatorLoop
    from neurons.validator_app.settings import ValidatorSettings, WeightSettings
    from neurons.validator_app.store import ValidatorStore
    from scoring.rewards import EmaEntry

    settings = ValidatorSettings()
    settings = replace(settings, chain=replace(settings.chain, netuid=netuid),
                       weights=WeightSettings(retry_s=retry_s, retry_max_s=max(retry_s, 1.0)))
    store = ValidatorStore(tmp_path / "validator.sqlite")
    loop = ValidatorLoop(settings, chain=chain, wallet=wallet, store=store, tokenizer=None)
    return loop, store, EmaEntry


async def test_validator_sets_weights_under_commit_reveal(chain, wallets, tmp_path):
    netuid = await subnet_with(chain, wallets, tempo=10, weights_rate_limit=0, commit_reveal=True)
    await epoch_after(chain, netuid)
    loop, store, EmaEntry = validator_loop(chain, wallets[0], netuid, tmp_path)
    metagraph = await chain.metagraph(netuid)
    loop.ema = {1: EmaEntry(metagraph.by_uid(1).hotkey, 0.2), 2: EmaEntry(metagraph.by_uid(2).hotkey, 0.8)}
    try:
        assert await loop.set_weights()
        assert loop.last_weights_block == await chain.block()
        assert len(await chain.pending_commits(netuid)) == 1 and 0 not in await chain.weights(netuid)
        epoch = await epoch_after(chain, netuid)
        assert set((await chain.weights(netuid))[0]) == {1, 2}
        assert epoch.by_uid(2).incentive > epoch.by_uid(1).incentive > 0
    finally:
        await loop.close()
        store.close()


async def test_validator_waits_the_blocks_the_chain_names(chain, wallets, tmp_path):
    netuid = await subnet_with(chain, wallets, weights_rate_limit=5)
    await chain.advance_blocks(5)
    await chain.set_weights(wallets[0], netuid, {1: 1.0}, 0)
    first = await chain.block()
    loop, store, EmaEntry = validator_loop(chain, wallets[0], netuid, tmp_path)
    metagraph = await chain.metagraph(netuid)
    loop.ema = {2: EmaEntry(metagraph.by_uid(2).hotkey, 1.0)}
    try:
        task = asyncio.create_task(loop.set_weights())
        await asyncio.sleep(0.3)  # refused, told to wait 5 blocks; it polls the block meanwhile
        assert not task.done()
        refusals = [r for r in store.weight_attempts() if not r["ok"]]
        assert len(refusals) == 1 and "wait 5 more" in refusals[0]["error"]
        await chain.advance_blocks(3)
        await asyncio.sleep(0.2)
        assert not task.done()
        await chain.advance_blocks(2)
        assert await asyncio.wait_for(task, 5)
        assert loop.last_weights_block == first + 5
        assert (await chain.weights(netuid))[0] == {2: 65535}
        assert len([r for r in store.weight_attempts() if not r["ok"]]) == 1  # no retries on a timer
    finally:
        await loop.close()
        store.close()


def test_u16_max_is_subtensors():
    assert U16_MAX == 65535


async def test_a_pending_commit_masks_weights_to_a_uid_registered_after_it(chain, wallets):
    """subtensor's test_epoch_masks_incoming_to_sniped_uid_prevents_inheritance (epoch.rs): a validator with a
    commit pending since before a uid's registration cannot pass weight to the newcomer (tempo 10, reveal
    period 2, the two epochs run by trigger_epoch as the Rust test runs SubtensorModule::epoch)."""
    async def run(with_commit: bool) -> float:
        c = DevnetChain(chain.path + ("-commit" if with_commit else "-plain"), block_interval=FROZEN, create=True)
        try:
            netuid = await c.create_subnet(OWNER_COLDKEY, tempo=10, commit_reveal=True, reveal_period=2,
                                           max_uids=3, max_validators=3, immunity_period=0, min_non_immune_uids=0)
            val, old, filler, new = wallets[:4]
            for w, stake in ((val, 10_000.0), (old, 100.0), (filler, 5_000.0)):
                await c.register(w, netuid)
                await c.add_stake(w, w, netuid, stake)
            await c.advance_blocks(21)
            if with_commit:
                await c.set_weights(val, netuid, {0: 1.0}, 0)  # the dummy commit
            await c.advance_blocks(1)
            await c.set_hyperparameter(netuid, "commit_reveal", False)
            await c.set_hyperparameter(netuid, "weights_rate_limit", 0)
            await c.set_weights(val, netuid, {1: 1.0}, 0)
            await c.set_hyperparameter(netuid, "commit_reveal", True)
            await c.trigger_epoch(netuid, 1000.0)
            new_uid = await c.register(new, netuid)  # snipes the lowest-emission uid
            await c.add_stake(new, new, netuid, 10_000.0)
            await c.advance_blocks(1)
            await c.set_hyperparameter(netuid, "commit_reveal", False)
            await c.set_weights(val, netuid, {0: 0.5, new_uid: 0.5}, 0)
            await c.set_hyperparameter(netuid, "commit_reveal", True)
            epoch = await c.trigger_epoch(netuid, 1000.0)
            assert epoch.by_uid(new_uid).rank == 0.0
            return epoch.by_uid(new_uid).incentive
        finally:
            await c.close()

    assert await run(with_commit=True) == 0.0
    assert await run(with_commit=False) > 0.0  # the control: without the pending commit the weight counts


async def test_validators_without_weights_are_paid_by_stake(chain, wallets):
    """Issue 15's measurement: two staked validators that set no weights record [7.5, 2.5] per epoch of
    budget 10, as subtensor (no incentive and no dividends: paid by active stake, or by stake)."""
    netuid = await chain.create_subnet(OWNER_COLDKEY, tempo=10, emission_per_block=1.0)
    for w, stake in zip(wallets[:2], (3.0, 1.0)):
        await chain.register(w, netuid)
        await chain.add_stake(w, w, netuid, stake)
    for _ in range(3):
        epoch = await epoch_after(chain, netuid)
        assert [round(n.emission, 9) for n in epoch.neurons] == [7.5, 2.5]


async def test_a_commit_masks_only_registrations_after_it_and_only_while_pending(chain, wallets):
    """subtensor's test_epoch_does_not_mask_outside_window_but_masks_inside (epoch.rs), on the devnet's own
    schedule (tempo 8, reveal period 2): a commit made before uid 1 registered has expired by the vote, so
    uid 1 is not masked; a second commit made just before uids 2 and 3 registered is still pending, so the
    validator's weights to them are."""
    async def run(second_commit: bool) -> list[float]:
        c = DevnetChain(chain.path + ("-two" if second_commit else "-one"), block_interval=FROZEN, create=True)
        try:
            netuid = await c.create_subnet(OWNER_COLDKEY, tempo=8, commit_reveal=True, reveal_period=2,
                                           max_validators=1, weights_rate_limit=0)
            v, old, mid, new = wallets[:4]
            await c.register(v, netuid)
            await c.add_stake(v, v, netuid, 10_000.0)
            await c.advance_blocks(8)
            await c.set_weights(v, netuid, {0: 1.0}, 0)  # the first (dummy) commit
            await c.register(old, netuid)  # uid 1, outside the window
            await c.add_stake(old, old, netuid, 1_000.0)
            await c.advance_blocks(3 * 8)  # the first commit expires
            if second_commit:
                await c.set_weights(v, netuid, {0: 1.0}, 0)
            await c.advance_blocks(1)
            for w in (mid, new):  # uids 2 and 3, inside the window of the second commit
                await c.register(w, netuid)
                await c.add_stake(w, w, netuid, 1_000.0)
            await c.advance_blocks(1)
            await c.set_hyperparameter(netuid, "commit_reveal", False)
            await c.set_weights(v, netuid, {1: 1.0, 2: 1.0, 3: 1.0}, 0)
            await c.set_hyperparameter(netuid, "commit_reveal", True)
            epoch = await c.trigger_epoch(netuid, 1000.0)
            return [epoch.by_uid(u).incentive for u in (1, 2, 3)]
        finally:
            await c.close()

    old, mid, new = await run(second_commit=True)
    assert old > 0 and mid == 0.0 and new == 0.0
    assert all(x > 0 for x in await run(second_commit=False))  # control: no pending commit, no mask
