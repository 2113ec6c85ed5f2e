"""Yuma Consensus (chain/yuma.py) against docs/yuma.md: the worked example, each masking rule, and properties."""
import math

import numpy as np
import pytest

from chain.yuma import (EpochInputs, YumaParams, prune_candidate, run_epoch, stake_weighted_consensus, top_k_permits,
                        weights_to_u16)

LEGACY = YumaParams(version="legacy")


def subnet(stake, weights, permit=None, block=1000, last_update=None, registered=None, bonds=None,
           new_uids=(), budget=1000.0, owner=None):
    """EpochInputs for a small subnet; `weights` maps a uid to {uid: weight} as a validator would set it."""
    stake = np.asarray(stake, dtype=np.float64)
    n = len(stake)
    W = np.zeros((n, n), dtype=np.uint16)
    for i, row in weights.items():
        uids = list(row)
        W[i, uids] = weights_to_u16([row[j] for j in uids])
    return EpochInputs(
        block=block,
        stake=stake,
        last_update=np.full(n, block - 1, dtype=np.int64) if last_update is None else np.asarray(last_update),
        block_at_registration=np.zeros(n, dtype=np.int64) if registered is None else np.asarray(registered),
        validator_permit=(stake > 0) if permit is None else np.asarray(permit, dtype=bool),
        weights=W,
        bonds=np.zeros((n, n), dtype=np.uint16) if bonds is None else np.asarray(bonds, dtype=np.uint16),
        registered_since_last_epoch=np.isin(np.arange(n), list(new_uids)),
        emission_budget=budget,
        subnet_owner_uid=owner,
    )


def next_epoch(inputs, result, **changes):
    """The inputs of the following epoch: the stored bonds and permits of `result`, plus `changes`."""
    fields = dict(inputs.__dict__, bonds=result.bonds, validator_permit=result.validator_permit)
    fields.update(changes)
    return EpochInputs(**fields)


def worked_example():
    # yuma.md: validators A, B, C (uids 0-2), miners M1, M2, M3 (uids 3-5).
    return subnet(
        stake=[0.5, 0.3, 0.2, 0, 0, 0],
        weights={0: {3: 60, 4: 40}, 1: {3: 60, 4: 40}, 2: {3: 40, 4: 20, 5: 40}},
    )


def assert_no_nan(result):
    for name, value in result.__dict__.items():
        assert not np.any(np.isnan(np.asarray(value, dtype=np.float64))), name


# ---------------------------------------------------------------- the worked example of yuma.md
def test_worked_example_yuma3_two_epochs():
    inputs = worked_example()
    r1 = run_epoch(inputs)
    np.testing.assert_allclose(r1.consensus[3:], [0.6, 0.4, 0.0], atol=5e-5)
    np.testing.assert_allclose(r1.incentive[3:], [0.6087, 0.3913, 0.0], atol=5e-5)
    np.testing.assert_allclose(r1.validator_trust[:3], [1.0, 1.0, 0.6], atol=5e-5)
    assert r1.bonds[:3, 3:].tolist() == [[3932, 2621, 0], [3932, 2621, 0], [2621, 1310, 0]]
    np.testing.assert_allclose(r1.dividends[:3], [0.5436, 0.3262, 0.1302], atol=5e-5)
    np.testing.assert_allclose(r1.miner_emission[3:], [304.35, 195.65, 0.0], atol=5e-3)
    np.testing.assert_allclose(r1.validator_emission[:3], [271.81, 163.08, 65.11], atol=5e-3)
    assert r1.validator_permit.tolist() == [True, True, True, False, False, False]
    assert r1.bonds[3:].sum() == 0 and r1.bonds[:, :3].sum() == 0
    np.testing.assert_allclose(r1.emission, r1.miner_emission + r1.validator_emission)

    r2 = run_epoch(next_epoch(inputs, r1))
    assert r2.bonds[:3, 3:].tolist() == [[7470, 4980, 0], [7470, 4980, 0], [4980, 2489, 0]]
    np.testing.assert_allclose(r2.dividends[:3], [0.5436, 0.3262, 0.1302], atol=5e-5)
    np.testing.assert_allclose(r2.incentive[3:], [0.6087, 0.3913, 0.0], atol=5e-5)


def test_worked_example_legacy():
    inputs = worked_example()
    r1 = run_epoch(inputs, LEGACY)
    np.testing.assert_allclose(r1.consensus[3:], [0.6, 0.4, 0.0], atol=5e-5)
    np.testing.assert_allclose(r1.incentive[3:], [0.6087, 0.3913, 0.0], atol=5e-5)
    np.testing.assert_allclose(r1.dividends[:3], [0.5435, 0.3261, 0.1304], atol=5e-5)
    # Storage is column max-upscaled: each miner column's largest bond is 65535, the rest in proportion
    # to the stake-weighted clipped weights (M1: 0.5*0.6, 0.3*0.6, 0.2*0.4).
    assert r1.bonds[:3, 3:5].max(axis=0).tolist() == [65535, 65535]
    np.testing.assert_allclose(r1.bonds[:3, 3], 65535 * np.array([1.0, 0.6, 0.08 / 0.3]), atol=1.0)
    np.testing.assert_allclose(r1.bonds[:3, 4], 65535 * np.array([1.0, 0.6, 0.2]), atol=1.0)
    r2 = run_epoch(next_epoch(inputs, r1), LEGACY)
    np.testing.assert_allclose(r2.dividends[:3], [0.5435, 0.3261, 0.1304], atol=5e-5)


# ---------------------------------------------------------------- consensus and clipping
def test_one_validator_weights_become_incentive():
    r = run_epoch(subnet(stake=[1.0, 0, 0, 0], weights={0: {1: 3.0, 2: 2.0, 3: 1.0}}))
    stored = np.array(weights_to_u16([3.0, 2.0, 1.0]), dtype=np.float64)
    np.testing.assert_allclose(r.incentive[1:], stored / stored.sum(), rtol=1e-12)
    np.testing.assert_allclose(r.consensus[1:], stored / stored.sum(), rtol=1e-12)
    assert r.validator_trust[0] == pytest.approx(1.0)
    assert r.dividends.tolist() == [1.0, 0.0, 0.0, 0.0]
    np.testing.assert_allclose(r.emission, [500.0, *(500.0 * stored / stored.sum())])


def test_minority_weight_on_ignored_miner_is_clipped_away():
    inputs = subnet(
        stake=[0.45, 0.35, 0.2, 0, 0, 0],
        weights={0: {3: 1, 4: 1}, 1: {3: 1, 4: 1}, 2: {3: 1, 4: 1, 5: 2}},
    )
    r = run_epoch(inputs)
    assert r.consensus[5] == 0.0
    assert r.incentive[5] == 0.0 and r.miner_emission[5] == 0.0
    # Subtensor no longer computes Trust or Rank: both read 0.
    assert r.trust.tolist() == [0.0] * 6 and r.rank.tolist() == [0.0] * 6
    assert r.validator_trust[2] == pytest.approx(0.5, abs=1e-4)  # half of C's row was on the clipped miner
    assert r.validator_trust[0] == pytest.approx(1.0)
    # Bonds, hence dividends, follow the clipped weights: C earns less than its stake share.
    assert r.bonds[2, 5] == 0
    assert r.dividends[2] < 0.2 * r.dividends.sum()


def plain_consensus(W, A, kappa):
    """The definition of yuma.md step 6, one column and one candidate value at a time."""
    voters = [i for i in range(len(A)) if A[i] > 0]
    total = sum(A[i] for i in voters)
    result = []
    for j in range(W.shape[1]):
        best = 0.0
        for x in [W[i, j] for i in voters]:
            if sum(A[i] / total for i in voters if W[i, j] >= x) >= kappa:
                best = max(best, x)
        result.append(best)
    return np.array(result)


def test_consensus_at_exactly_kappa():
    # Exact binary fractions: half the stake at or above 0.5 is enough with kappa = 0.5.
    W = np.array([[1.0], [0.5], [0.0]])
    A = np.array([0.25, 0.25, 0.5])
    assert stake_weighted_consensus(W, A, 0.5).tolist() == [0.5]
    assert stake_weighted_consensus(W, A, 0.25).tolist() == [1.0]
    assert stake_weighted_consensus(W, A, 32767 / 65535).tolist() == [0.5]
    assert stake_weighted_consensus(W, A, 0.5 + 1e-9).tolist() == [0.0]


@pytest.mark.parametrize("seed", range(20))
def test_consensus_matches_plain_definition(seed):
    rng = np.random.default_rng(seed)
    v, n = rng.integers(1, 8), rng.integers(1, 10)
    # Few distinct values so that ties between validators are common.
    W = rng.integers(0, 4, size=(v, n)).astype(np.float64) / 3.0
    A = rng.random(v) * (rng.random(v) < 0.8)
    kappa = [32767 / 65535, 0.5, 0.25, 0.9][seed % 4]
    np.testing.assert_array_equal(stake_weighted_consensus(W, A, kappa), plain_consensus(W, A, kappa))


# ---------------------------------------------------------------- properties over random subnets
def random_subnet(rng, budget=1000.0):
    n = int(rng.integers(1, 16))
    stake = rng.random(n) * 100 * (rng.random(n) < 0.6)
    weights = rng.integers(0, 65536, size=(n, n)) * (rng.random((n, n)) < rng.random())
    block = 20_000
    return EpochInputs(
        block=block,
        stake=stake,
        last_update=block - rng.integers(0, 8000, size=n),
        block_at_registration=rng.integers(0, block, size=n),
        validator_permit=rng.random(n) < 0.7,
        weights=weights.astype(np.uint16),
        bonds=(rng.integers(0, 65536, size=(n, n)) * (rng.random((n, n)) < 0.5)).astype(np.uint16),
        registered_since_last_epoch=rng.random(n) < 0.1,
        emission_budget=budget,
    )


@pytest.mark.parametrize("params", [YumaParams(), LEGACY, YumaParams(liquid_alpha=True),
                                    YumaParams(bonds_penalty=0.5, max_validators=3)],
                         ids=["yuma3", "legacy", "liquid", "beta-half-k3"])
def test_sums_and_ranges_on_random_subnets(params):
    rng = np.random.default_rng(7)
    seen_rank = seen_fallback = 0
    for _ in range(40):
        inputs = random_subnet(rng)
        r = run_epoch(inputs, params)
        assert_no_nan(r)
        if (r.incentive > 0).any():
            seen_rank += 1
            assert r.incentive.sum() == pytest.approx(1.0)
        if r.incentive.sum() + r.dividends.sum() > 0 or r.stake.sum() > 0:
            seen_fallback += r.incentive.sum() + r.dividends.sum() == 0
            # I32F32 truncation of each share loses at most 2^-32 of the budget per uid.
            assert r.emission.sum() == pytest.approx(inputs.emission_budget, abs=len(r.emission) * 2e-7)
        else:
            assert r.emission.sum() == 0.0
        np.testing.assert_allclose(r.emission, r.miner_emission + r.validator_emission, atol=1e-6)
        assert not r.rank.any() and not r.trust.any()
        for name in ("trust", "consensus", "validator_trust", "incentive", "dividends"):
            values = getattr(r, name)
            assert values.min(initial=0) >= 0 and values.max(initial=0) <= 1 + 1e-12, name
        assert r.bonds.dtype == np.uint16
        assert r.bonds[~r.validator_permit].sum() == 0
        assert r.validator_permit.sum() <= params.max_validators
    assert seen_rank > 10  # the random subnets did exercise the interesting cases
    assert seen_fallback > 0


# ---------------------------------------------------------------- bonds
def test_bonds_follow_the_ema_over_epochs():
    # Two validators set the same weights, so consensus equals them and nothing is clipped: Wb = W.
    # Each row as set_weights stores it for miners 2, 3, 4 (0.5 of 65535 rounds up to 32768).
    schedule = [({2: 1.0, 3: 0.5}, [65535, 32768, 0])] * 3 + [({3: 1.0, 4: 1.0}, [0, 65535, 65535])] * 3
    inputs = subnet(stake=[0.6, 0.4, 0, 0, 0], weights={})
    expected_bonds = [0, 0, 0]  # validator 0 to miners 2, 3, 4, as stored u16
    for row, u16 in schedule:
        inputs = subnet(stake=[0.6, 0.4, 0, 0, 0], weights={0: row, 1: row},
                        bonds=inputs.bonds, permit=inputs.validator_permit)
        result = run_epoch(inputs)
        # Plain floats: the row normalised, then the EMA with alpha 0.1 and the floor of storage.
        w = [x / sum(u16) for x in u16]
        expected_bonds = [math.floor(65535 * (0.1 * w[k] + 0.9 * (expected_bonds[k] / 65535))) for k in range(3)]
        assert result.bonds[0, 2:].tolist() == expected_bonds
        assert result.bonds[1, 2:].tolist() == expected_bonds
        inputs = next_epoch(inputs, result)
    assert expected_bonds[0] > 0 and expected_bonds[2] > 0  # the old miner decays, the new one grows


def test_bonds_to_newly_registered_uids_are_dropped():
    bonds = np.zeros((4, 4), dtype=np.uint16)
    bonds[0, 2:] = 30000
    r = run_epoch(subnet(stake=[1.0, 0, 0, 0], weights={0: {2: 1, 3: 1}}, bonds=bonds, new_uids=[2]))
    assert r.bonds[0, 2] == math.floor(65535 * 0.1 * 0.5)  # the old holder's bond is gone
    assert r.bonds[0, 3] == math.floor(65535 * (0.1 * 0.5 + 0.9 * 30000 / 65535))


@pytest.mark.parametrize("params", [YumaParams(), LEGACY], ids=["yuma3", "legacy"])
def test_bond_rows_cleared_when_the_permit_is_lost(params):
    bonds = np.zeros((3, 3), dtype=np.uint16)
    bonds[:2, 2] = 20000
    # uid 1 unstaked: it still votes this epoch (stored permit) but gets no permit for the next.
    r = run_epoch(subnet(stake=[1.0, 0, 0], weights={0: {2: 1}, 1: {2: 1}}, bonds=bonds,
                         permit=[True, True, False]), params)
    assert r.validator_permit.tolist() == [True, False, False]
    assert r.bonds[1].sum() == 0 and r.bonds[0, 2] > 0


def test_liquid_alpha_runs_and_keeps_bonds_in_range():
    params = YumaParams(liquid_alpha=True)
    inputs = subnet(stake=[0.6, 0.4, 0, 0, 0], weights={0: {2: 1.0, 3: 0.5}, 1: {2: 1.0, 3: 0.5}})
    r = run_epoch(inputs, params)
    w = np.array([65535, 32768]) / (65535 + 32768)
    # From zero bonds each entry moves by its own alpha, between alpha_low and alpha_high.
    assert np.all(r.bonds[0, 2:4] >= np.floor(65535 * 0.7 * w))
    assert np.all(r.bonds[0, 2:4] <= np.floor(65535 * 0.9 * w) + 1)
    for _ in range(5):
        inputs = next_epoch(inputs, r)
        r = run_epoch(inputs, params)
        assert_no_nan(r)
        assert r.bonds.max() <= 65535
    # Switching away from miner 2: liquid alpha resets bonds absent from the new weights.
    inputs = subnet(stake=[0.6, 0.4, 0, 0, 0], weights={0: {3: 1.0}, 1: {3: 1.0}},
                    bonds=r.bonds, permit=r.validator_permit)
    r = run_epoch(inputs, params)
    assert r.bonds[0, 2] == 0 and r.bonds[0, 3] > 0
    # Plain Yuma 3 keeps the decayed bond instead.
    assert run_epoch(inputs).bonds[0, 2] > 0


def test_stored_zero_decays_a_liquid_bond_where_an_absent_entry_resets_it():
    params = YumaParams(liquid_alpha=True, alpha_low=0.1, alpha_high=0.3)
    bonds = np.zeros((3, 3), dtype=np.uint16)
    bonds[0, 1:] = [30000, 30000]
    base = dict(stake=[1.0, 0, 0], bonds=bonds)
    # Dense u16 with a presence mask: the zero to uid 2 is stored.
    with_zero = subnet(weights={0: {1: 1}}, **base)
    present = np.zeros((3, 3), dtype=bool)
    present[0, 1:] = True
    with_zero.weights_present = present
    absent = subnet(weights={0: {1: 1}}, **base)
    decayed, reset = run_epoch(with_zero, params), run_epoch(absent, params)
    assert reset.bonds[0, 2] == 0
    # (1 - alpha) * B0 with alpha between alpha_low and alpha_high.
    assert math.floor(0.7 * 30000) <= decayed.bonds[0, 2] <= math.floor(0.9 * 30000)
    # Sparse rows say the same.
    sparse = EpochInputs(**dict(absent.__dict__, weights={0: {1: 65535, 2: 0}}))
    assert run_epoch(sparse, params).bonds[0, 2] == decayed.bonds[0, 2]


def test_subnet_owner_is_exempt_from_the_threshold_and_always_permitted():
    params = YumaParams(stake_threshold=5.0, max_validators=1)
    inputs = subnet(stake=[10.0, 1.0, 0.0], weights={1: {2: 1}}, permit=[True, False, False], owner=1)
    r = run_epoch(inputs, params)
    assert r.stake[1] == pytest.approx(1.0 / 11.0)  # its stake counts below the threshold
    assert r.validator_permit.tolist() == [True, True, False]  # forced permit next to the top-1
    assert r.active_stake[1] == pytest.approx(1.0 / 11.0)  # and forced for this epoch: its stake is active
    plain = run_epoch(subnet(stake=[10.0, 1.0, 0.0], weights={1: {2: 1}}, permit=[True, False, False]), params)
    assert plain.stake[1] == 0.0 and plain.validator_permit.tolist() == [True, False, False]


def test_commit_reveal_masks_weights_committed_before_a_registration():
    inputs = subnet(stake=[1.0, 0, 0], weights={0: {1: 1, 2: 1}}, registered=[0, 0, 900], last_update=[950, 0, 0])
    assert run_epoch(inputs).incentive[2] == pytest.approx(0.5)
    inputs.commit_blocks = np.array([800, np.iinfo(np.int64).max, np.iinfo(np.int64).max])
    r = run_epoch(inputs)  # the commit predates uid 2's registration: its weight to uid 2 is dropped
    assert r.incentive.tolist() == [0.0, 1.0, 0.0]


def test_bonds_mask_follows_the_last_epoch_block():
    bonds = np.zeros((3, 3), dtype=np.uint16)
    bonds[0, 1:] = 30000
    inputs = subnet(stake=[1.0, 0, 0], weights={0: {1: 1, 2: 1}}, bonds=bonds, registered=[0, 0, 500], block=600)
    inputs.registered_since_last_epoch = None
    inputs.last_epoch_block = 500  # registered in the block of the previous epoch: kept (last_tempo = 501)
    kept = run_epoch(inputs)
    inputs.last_epoch_block = 499  # registered after it: dropped
    dropped = run_epoch(inputs)
    assert kept.bonds[0, 2] == math.floor(65535 * (0.05 + 0.9 * 30000 / 65535))
    assert dropped.bonds[0, 2] == math.floor(65535 * 0.05)


# ---------------------------------------------------------------- masks
def test_inactive_validators_do_not_count():
    block, cutoff = 10_000, 5000
    inputs = subnet(stake=[0.5, 0.3, 0.2, 0, 0], weights={0: {3: 1}, 1: {4: 1}, 2: {3: 1}}, block=block,
                    last_update=[9000, block - cutoff - 1, block - cutoff, 9000, 9000])
    r = run_epoch(inputs)
    assert r.active.tolist() == [True, False, True, True, True]  # last_update + cutoff == block is active
    assert r.active_stake[1] == 0.0
    np.testing.assert_allclose(r.active_stake[[0, 2]], [0.5 / 0.7, 0.2 / 0.7])
    assert r.incentive[4] == 0.0 and r.incentive[3] == pytest.approx(1.0)
    assert r.dividends[1] == 0.0
    assert r.validator_permit[1]  # inactivity does not cost the permit, only the vote


def test_weights_set_before_a_miners_registration_are_dropped():
    inputs = subnet(stake=[1.0, 0, 0], weights={0: {1: 1, 2: 1}}, last_update=[500, 0, 0],
                    registered=[0, 500, 499], block=600)
    r = run_epoch(inputs)
    assert r.incentive.tolist() == [0.0, 0.0, 1.0]
    assert r.consensus[1] == 0.0 and r.consensus[2] == 1.0  # the row renormalised over what is left


def test_rows_without_permit_are_dropped():
    inputs = subnet(stake=[0.2, 0.8, 0, 0], weights={0: {2: 1}, 1: {2: 1, 3: 1}}, permit=[True, False, False, False])
    r = run_epoch(inputs)
    assert r.active_stake.tolist() == [1.0, 0.0, 0.0, 0.0]
    assert r.incentive[3] == 0.0 and r.incentive[2] == 1.0
    # Its vote for miner 2 agrees with consensus, yet builds no bond: the whole row is dropped.
    assert r.bonds[1].sum() == 0 and r.bonds[0, 2] > 0
    assert r.validator_permit[1]  # permitted from the next epoch on


def test_self_weights_are_dropped_except_the_owners():
    inputs = subnet(stake=[1.0, 0], weights={0: {0: 1, 1: 1}})
    r = run_epoch(inputs)
    assert r.incentive.tolist() == [0.0, 1.0]
    # subtensor keeps the subnet owner's self-weight.
    owned = run_epoch(subnet(stake=[1.0, 0], weights={0: {0: 1, 1: 1}}, owner=0))
    np.testing.assert_allclose(owned.incentive, [0.5, 0.5])


def test_a_new_validators_weights_count_from_its_second_epoch():
    inputs = subnet(stake=[0.3, 0.7, 0, 0], weights={0: {2: 1}, 1: {3: 1}}, permit=[True, False, False, False])
    r1 = run_epoch(inputs)
    assert r1.incentive[3] == 0.0 and r1.incentive[2] == 1.0
    assert r1.validator_permit.tolist() == [True, True, False, False]
    r2 = run_epoch(next_epoch(inputs, r1))
    assert r2.active_stake[1] == pytest.approx(0.7)
    assert r2.incentive[3] == 1.0 and r2.incentive[2] == 0.0  # 0.7 of the stake now outvotes 0.3


# ---------------------------------------------------------------- permits and stake
def test_permits_top_k_with_the_tie_rule():
    assert top_k_permits(np.array([5.0, 5.0, 5.0, 1.0]), 2).tolist() == [False, True, True, False]
    assert top_k_permits(np.array([1.0, 3.0, 2.0]), 1).tolist() == [False, True, False]
    r = run_epoch(subnet(stake=[5, 5, 5, 1], weights={}), YumaParams(max_validators=2))
    assert r.validator_permit.tolist() == [False, True, True, False]


def test_permits_when_k_exceeds_n():
    assert top_k_permits(np.array([0.0, 2.0, 1.0]), 64).tolist() == [False, True, True]
    assert top_k_permits(np.array([0.0, 2.0, 1.0]), 3).tolist() == [False, True, True]
    assert top_k_permits(np.array([]), 64).tolist() == []


def test_stake_below_threshold_counts_as_zero():
    r = run_epoch(subnet(stake=[10.0, 1.0, 0], weights={0: {2: 1}, 1: {2: 1}}), YumaParams(stake_threshold=5))
    assert r.stake.tolist() == [1.0, 0.0, 0.0]
    assert r.validator_permit.tolist() == [True, False, False]


# ---------------------------------------------------------------- edge cases
@pytest.mark.parametrize("params", [YumaParams(), LEGACY], ids=["yuma3", "legacy"])
def test_empty_subnet(params):
    r = run_epoch(subnet(stake=[], weights={}), params)
    assert r.emission.shape == (0,) and r.bonds.shape == (0, 0) and r.validator_permit.shape == (0,)


@pytest.mark.parametrize("params", [YumaParams(), LEGACY], ids=["yuma3", "legacy"])
def test_single_uid_with_only_a_self_weight(params):
    r = run_epoch(subnet(stake=[3.0], weights={0: {0: 1}}), params)
    assert_no_nan(r)
    assert r.incentive.tolist() == [0.0] and r.validator_emission.tolist() == [1000.0]
    assert r.validator_permit.tolist() == [True]


@pytest.mark.parametrize("params", [YumaParams(), LEGACY], ids=["yuma3", "legacy"])
def test_without_weights_validators_share_by_active_stake(params):
    r = run_epoch(subnet(stake=[3.0, 1.0, 0], weights={}), params)
    assert_no_nan(r)
    np.testing.assert_allclose(r.validator_emission, [750.0, 250.0, 0.0])
    np.testing.assert_allclose(r.emission, [750.0, 250.0, 0.0])
    assert r.miner_emission.sum() == 0.0


def test_nothing_to_pay_emits_nothing():
    for params in (YumaParams(), LEGACY):
        r = run_epoch(subnet(stake=[0.0, 0.0, 0.0], weights={0: {2: 1}}, permit=[True, True, False]), params)
        assert_no_nan(r)
        assert r.emission.sum() == 0.0 and r.incentive.sum() == 0.0


@pytest.mark.parametrize("params", [YumaParams(), LEGACY], ids=["yuma3", "legacy"])
def test_without_active_stake_validators_share_by_stake(params):
    # No permit yet (a new subnet's first epoch): active stake is all zero, so subtensor pays by stake S.
    r = run_epoch(subnet(stake=[3.0, 1.0, 0.0], weights={0: {2: 1}}, permit=[False, False, False]), params)
    assert r.active_stake.sum() == 0.0 and r.incentive.sum() == 0.0
    np.testing.assert_allclose(r.validator_emission, [750.0, 250.0, 0.0], atol=1e-6)
    np.testing.assert_allclose(r.emission, [750.0, 250.0, 0.0], atol=1e-6)
    # Inactive validators with permits: the same fallback (yuma_emergency_mode in epoch_logs.rs).
    inactive = run_epoch(subnet(stake=[1.0, 1.0, 0.0], weights={}, block=10_000, last_update=[0, 0, 0]), params)
    np.testing.assert_allclose(inactive.emission, [500.0, 500.0, 0.0], atol=1e-6)


def test_bad_inputs_are_rejected():
    good = subnet(stake=[1.0, 0], weights={0: {1: 1}})
    with pytest.raises(ValueError, match="last_update"):
        run_epoch(EpochInputs(**dict(good.__dict__, last_update=np.zeros(3, dtype=np.int64))))
    with pytest.raises(ValueError, match="weights"):
        run_epoch(EpochInputs(**dict(good.__dict__, weights=np.zeros((2, 2)))))
    with pytest.raises(ValueError, match="stake"):
        run_epoch(EpochInputs(**dict(good.__dict__, stake=np.array([1.0, -1.0]))))
    with pytest.raises(ValueError, match="subnet_owner_uid"):
        run_epoch(EpochInputs(**dict(good.__dict__, subnet_owner_uid=5)))
    with pytest.raises(ValueError, match="version"):
        YumaParams(version="yuma2")


# ---------------------------------------------------------------- set-weights storage and pruning
def test_weights_to_u16_rounding():
    assert weights_to_u16([0.5, 1.0]) == [32768, 65535]  # 32767.5 rounds away from zero
    assert weights_to_u16([1, 2, 2, 0]) == [32768, 65535, 65535, 0]
    assert weights_to_u16([1, 3]) == [21845, 65535]
    assert weights_to_u16([0.25, 1.0]) == [16384, 65535]  # 16383.75
    assert weights_to_u16([1, 4000]) == [16, 65535]  # 16.38375
    assert weights_to_u16([7]) == [65535]


@pytest.mark.parametrize("bad", [[], [-1.0, 1.0], [float("nan"), 1.0], [0.0, 0.0], [float("inf")], [[1.0]]])
def test_weights_to_u16_rejects(bad):
    with pytest.raises(ValueError):
        weights_to_u16(bad)


def test_prune_candidate_takes_the_lowest_non_immune():
    emission, registered = [5.0, 1.0, 1.0, 3.0], [0, 20, 10, 0]
    none = [False] * 4
    assert prune_candidate(emission, registered, none, none, 0) == 2  # equal emission: older registration
    assert prune_candidate([1.0, 1.0, 2.0], [10, 10, 0], [False] * 3, [False] * 3, 0) == 0  # then lower uid
    # The owner is never pruned, and immune uids are skipped while enough others are not immune.
    assert prune_candidate(emission, registered, none, [False, False, True, False], 0) == 1
    assert prune_candidate(emission, registered, [False, True, True, False], none, 1) == 3


def test_prune_candidate_falls_back_to_immune_uids():
    emission, registered = [5.0, 1.0, 2.0, 3.0], [0, 20, 10, 0]
    immune = [False, False, True, True]
    assert prune_candidate(emission, registered, immune, [False] * 4, 2) == 2  # 2 non-immune is not > 2
    assert prune_candidate(emission, registered, immune, [False] * 4, 1) == 1
    # Too few non-immune and no immune uid: registration fails.
    assert prune_candidate([1.0, 2.0], [0, 0], [False, False], [False, False], 10) is None
    assert prune_candidate([1.0], [0], [True], [True], 0) is None
