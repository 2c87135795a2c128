"""Independent tests of flowrl/credit/group.py against docs/algorithms.md, "Group advantages" (and the invariant:
advantages are always finite; a zero-variance group gets zeros and its edges are skipped, counted).

Expected advantages are hand-computed from A_i = (r_i − b_g)/(scale + 1e-4).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from flowrl.credit.group import GroupAdvantage
from flowrl.rollout.forest import Forest
from flowrl_rewards import MultiReward, Reward

EPS = 1e-4


def _np(t):
    return t.detach().double().numpy()


# ---------------------------------------------------------------------------------------------
# normalise on [P, G] tables
# ---------------------------------------------------------------------------------------------
TABLE = torch.tensor(
    [
        [1.0, 2.0, 3.0, 6.0],  # mean 3, deviations (−2, −1, 0, 3), var 14/4 = 3.5
        [0.5, 0.5, 0.5, 0.5],  # zero variance
        [4.0, 0.0, 2.0, 2.0],  # mean 2, deviations (2, −2, 0, 0), var 8/4 = 2
    ]
)


def test_mean_baseline_group_std():
    adv, zero_var, dropped = GroupAdvantage(baseline="mean", scale="group").normalise(TABLE)
    s0, s2 = math.sqrt(3.5), math.sqrt(2.0)  # ddof 0
    expected = np.array(
        [
            [-2 / (s0 + EPS), -1 / (s0 + EPS), 0.0, 3 / (s0 + EPS)],
            [0.0, 0.0, 0.0, 0.0],
            [2 / (s2 + EPS), -2 / (s2 + EPS), 0.0, 0.0],
        ]
    )
    np.testing.assert_allclose(_np(adv), expected, rtol=1e-6, atol=1e-7)
    assert zero_var.tolist() == [False, True, False]
    assert not dropped.any(), "the mean baseline drops nothing"


def test_group_std_is_population_std_not_sample_std():
    adv, _, _ = GroupAdvantage(baseline="mean", scale="group").normalise(torch.tensor([[0.0, 2.0]]))
    # mean 1, population std 1 (sample std would be sqrt(2))
    np.testing.assert_allclose(_np(adv), [[-1 / (1 + EPS), 1 / (1 + EPS)]], rtol=1e-6)


def test_mean_baseline_global_std():
    adv, zero_var, _ = GroupAdvantage(baseline="mean", scale="global").normalise(TABLE)
    flat = TABLE.double().numpy().ravel()
    g = math.sqrt(((flat - flat.mean()) ** 2).mean())  # ddof 0 over the whole batch
    means = np.array([3.0, 0.5, 2.0])[:, None]
    expected = (TABLE.double().numpy() - means) / (g + EPS)
    expected[1] = 0.0  # zero-variance group
    np.testing.assert_allclose(_np(adv), expected, rtol=1e-6, atol=1e-7)
    assert zero_var.tolist() == [False, True, False]


def test_global_std_uses_gather():
    """``gather`` (all processes) widens the pool the global std is computed over."""
    other = torch.tensor([10.0, -10.0, 0.0, 0.0])
    adv, _, _ = GroupAdvantage(baseline="mean", scale="global").normalise(TABLE, gather=lambda t: torch.cat([t, other]))
    pool = np.concatenate([TABLE.numpy().ravel(), other.numpy()]).astype(np.float64)
    g = pool.std()
    np.testing.assert_allclose(_np(adv[0]), np.array([-2, -1, 0, 3]) / (g + EPS), rtol=1e-6)


def test_median_baseline_mad_scale_drops_median_sample():
    table = torch.tensor(
        [
            [1.0, 5.0, 2.0, 8.0, 3.0],  # median 3 (index 4); |r−3| = (2, 2, 1, 5, 0) → MAD 2
            [2.0, 2.0, 2.0, 2.0, 2.0],  # zero variance
            [0.0, 10.0, 4.0, 9.0, 7.0],  # median 7 (index 4); |r−7| = (7, 3, 3, 2, 0) → MAD 3
        ]
    )
    adv, zero_var, dropped = GroupAdvantage(baseline="median", scale="mad").normalise(table)
    expected = np.array(
        [
            [
                (1 - 3) / (2 + 1e-3 + EPS),
                (5 - 3) / (2 + 1e-3 + EPS),
                (2 - 3) / (2 + 1e-3 + EPS),
                (8 - 3) / (2 + 1e-3 + EPS),
                0.0,
            ],
            [0.0] * 5,
            [
                (0 - 7) / (3 + 1e-3 + EPS),
                (10 - 7) / (3 + 1e-3 + EPS),
                (4 - 7) / (3 + 1e-3 + EPS),
                (9 - 7) / (3 + 1e-3 + EPS),
                0.0,
            ],
        ]
    )
    np.testing.assert_allclose(_np(adv), expected, rtol=1e-6, atol=1e-7)
    assert zero_var.tolist() == [False, True, False]
    assert dropped[0].tolist() == [False, False, False, False, True], "the median sample must be dropped"
    assert dropped[2].tolist() == [False, False, False, False, True]
    assert int(dropped[1].sum()) <= 1


def test_median_baseline_tied_median_drops_exactly_one():
    table = torch.tensor([[0.0, 10.0, 4.0, 4.0, 7.0]])  # median 4, shared by samples 2 and 3
    adv, _, dropped = GroupAdvantage(baseline="median", scale="group").normalise(table)
    assert int(dropped.sum()) == 1 and bool(dropped[0, 2] | dropped[0, 3])
    std = np.std([0.0, 10.0, 4.0, 4.0, 7.0])
    np.testing.assert_allclose(
        _np(adv), [[-4 / (std + EPS), 6 / (std + EPS), 0, 0, 3 / (std + EPS)]], rtol=1e-6, atol=1e-7
    )


def test_mad_scale_is_about_the_median_even_with_mean_baseline():
    """Group advantages: `mad` = median|r − median| + 1e-3, whatever the baseline."""
    r = [1.0, 5.0, 2.0, 8.0, 3.0]  # mean 3.8, median 3, MAD about the median 2 (about the mean: 1.8)
    adv, _, _ = GroupAdvantage(baseline="mean", scale="mad").normalise(torch.tensor([r]))
    expected = (np.array(r) - 3.8) / (2.0 + 1e-3 + EPS)
    np.testing.assert_allclose(
        _np(adv)[0],
        expected,
        rtol=1e-6,
        err_msg="SPEC MISMATCH (flowrl/credit/group.py normalise, scale='mad'): docs/algorithms.md defines "
        "mad = median|r − median| + 1e-3, but the code uses median|r − baseline| so with "
        "baseline='mean' it divides by the median absolute deviation about the MEAN (1.8 here, not 2)",
    )


def test_scale_none():
    adv, zero_var, _ = GroupAdvantage(baseline="mean", scale="none").normalise(TABLE)
    expected = np.array([[-2, -1, 0, 3], [0, 0, 0, 0], [2, -2, 0, 0]], dtype=np.float64)
    # scale none: A = r − b (the 1e-4 guard may or may not be applied: relative 1e-4)
    np.testing.assert_allclose(_np(adv), expected, rtol=2e-4, atol=1e-7)
    assert zero_var.tolist() == [False, True, False]
    adv_m, _, dropped = GroupAdvantage(baseline="median", scale="none").normalise(torch.tensor([[1.0, 9.0, 4.0]]))
    np.testing.assert_allclose(_np(adv_m), [[-3, 5, 0]], rtol=2e-4)
    assert dropped.tolist() == [[False, False, True]]


@pytest.mark.parametrize(
    "baseline,scale", [(b, s) for b in ("mean", "median") for s in ("group", "global", "mad", "none")]
)
def test_all_finite_and_zero_variance_groups_zero(baseline, scale):
    table = torch.tensor(
        [
            [1e6, 1e6, 1e6],  # zero variance, large values
            [0.3, 0.3 + 2e-7, 0.3],  # numerically zero variance (spread 2e-7, not exactly 0)
            [-1.0, 0.0, 1.0],
            [5.0, 5.0, 5.0],
        ]
    )
    adv, zero_var, _ = GroupAdvantage(baseline=baseline, scale=scale).normalise(table)
    assert torch.isfinite(adv).all()
    assert zero_var.tolist() == [True, True, False, True]
    assert torch.all(adv[[0, 1, 3]] == 0)
    assert (adv[2, 0] < 0) and (adv[2, 2] > 0)
    # all groups zero-variance (global std 0): still finite zeros
    adv, zero_var, _ = GroupAdvantage(baseline=baseline, scale=scale).normalise(torch.full((2, 4), 3.0))
    assert torch.isfinite(adv).all() and torch.all(adv == 0) and zero_var.all()


def test_bad_options_raise():
    with pytest.raises(ValueError, match="baseline"):
        GroupAdvantage(baseline="mode")
    with pytest.raises(ValueError, match="scale"):
        GroupAdvantage(scale="iqr")


# ---------------------------------------------------------------------------------------------
# assign on a hand-built chains forest
# ---------------------------------------------------------------------------------------------
def chains_forest():
    """2 groups × 3 chains × 2 edges. Nodes: roots 0–5, step-1 states 6–11, leaves 12–17.

    Group 0 (chains 0–2): edge 1 SDE (flow_grpo), edge 2 ODE.
    Group 1 (chains 3–5): edge 1 ODE, edge 2 SDE (dance).
    """
    f = Forest(prompts=["a red circle", "two blue squares"])
    roots = f.add_roots(torch.randn(6, 2, 4, 4), group=[0, 0, 0, 1, 1, 1], seed=[10, 11, 12, 13, 14, 15])
    b = f.new_batch_id()
    s1a = f.add_children(
        roots[:3],
        torch.randn(3, 2, 4, 4),
        sigma=0.5,
        step=1,
        logp=torch.randn(3),
        std=torch.full((3,), 0.3),
        kernel="flow_grpo",
        eta=0.7,
        batch=b,
    )
    s1b = f.add_children(
        roots[3:],
        torch.randn(3, 2, 4, 4),
        sigma=0.5,
        step=1,
        logp=torch.zeros(3),
        std=torch.zeros(3),
        kernel="ode",
        eta=0.0,
        batch=b,
    )
    b = f.new_batch_id()
    f.add_children(
        s1a,
        torch.randn(3, 2, 4, 4),
        sigma=0.0,
        step=2,
        logp=torch.zeros(3),
        std=torch.zeros(3),
        kernel="ode",
        eta=0.0,
        batch=b,
    )
    f.add_children(
        s1b,
        torch.randn(3, 2, 4, 4),
        sigma=0.0,
        step=2,
        logp=torch.randn(3),
        std=torch.full((3,), 0.2),
        kernel="dance",
        eta=0.3,
        batch=b,
    )
    return f


CHAIN_OF = {n: n % 6 for n in range(18)}  # node → chain index (root, step-1, leaf)


def test_forest_fixture_shape():
    f = chains_forest()
    assert f.leaves().tolist() == list(range(12, 18))
    assert f.edges(trainable=False).tolist() == list(range(6, 18))
    assert f.edges(trainable=True).tolist() == [6, 7, 8, 15, 16, 17]


def test_assign_chains_mean_group_std():
    f = chains_forest()
    rewards = torch.tensor([1.0, 2.0, 4.0, 3.0, 3.0, 3.0])  # group 1 has zero variance
    stats = GroupAdvantage(baseline="mean", scale="group").assign(_scored(f, rewards))
    dev = np.array([1.0, 2.0, 4.0]) - 7.0 / 3.0
    std = math.sqrt(14.0) / 3.0  # population std of (1, 2, 4)
    leaf_adv = np.concatenate([dev / (std + EPS), np.zeros(3)])
    for n in range(6, 18):  # every edge of a chain carries its leaf's advantage
        assert float(f.advantage[n]) == pytest.approx(leaf_adv[CHAIN_OF[n]], rel=1e-6, abs=1e-7), f"edge into {n}"
    assert torch.isfinite(f.advantage).all()
    # zero-variance group: marked flat (policy objectives skip it; leaf objectives keep it), not excluded
    for n in (9, 10, 11, 15, 16, 17):
        assert float(f.flat[n]) == 1.0 and float(f.weight[n]) == 1.0, f"edge into {n} (zero-variance group) is flat"
    for n in (6, 7, 8):
        assert float(f.weight[n]) > 0 and float(f.flat[n]) == 0.0
    # ODE edges are never trainable; zero-variance edges are skipped
    assert f.edges(trainable=True).tolist() == [6, 7, 8]
    assert f.edges(trainable=False).tolist() == list(range(6, 18))
    assert stats["zero_std_ratio"] == pytest.approx(0.5)
    assert stats["skipped_edges"] == 3  # the three SDE edges of group 1


def test_assign_global_scale():
    f = chains_forest()
    rewards = torch.tensor([0.0, 1.0, 5.0, 2.0, 6.0, 4.0])
    GroupAdvantage(baseline="mean", scale="global").assign(_scored(f, rewards))
    r = rewards.double().numpy()
    g = r.std()
    expected = np.concatenate([r[:3] - r[:3].mean(), r[3:] - r[3:].mean()]) / (g + EPS)
    np.testing.assert_allclose(_np(f.advantage[12:18]), expected, rtol=1e-6)
    np.testing.assert_allclose(_np(f.advantage[6:12]), expected, rtol=1e-6)
    assert f.edges(trainable=True).tolist() == [6, 7, 8, 15, 16, 17]


def test_assign_median_drops_median_chain():
    f = chains_forest()
    rewards = torch.tensor([1.0, 5.0, 3.0, 9.0, 0.0, 4.0])  # medians: 3 (chain 2), 4 (chain 5)
    GroupAdvantage(baseline="median", scale="mad").assign(_scored(f, rewards))
    # group 0: |r−3| = (2, 2, 0) → MAD 2; group 1: |r−4| = (5, 4, 0) → MAD 4
    expected = np.array([-2 / (2.001 + EPS), 2 / (2.001 + EPS), 0.0, 5 / (4.001 + EPS), -4 / (4.001 + EPS), 0.0])
    np.testing.assert_allclose(_np(f.advantage[12:18]), expected, rtol=1e-6, atol=1e-7)
    assert float(f.weight[8]) == 0 and float(f.weight[17]) == 0, "the median sample's edges are not trained"
    assert f.edges(trainable=True).tolist() == [6, 7, 15, 16]


class _Term(Reward):
    def score(self, images, prompts, meta):  # never called: the test records scores directly
        raise AssertionError


def _term(name: str) -> Reward:
    term = _Term()
    term.name = name
    return term


def test_assign_multi_reward_weighted_raw_sum_vs_group_normalised_rewards():
    """Credit reads the combined reward; the MultiReward alone combines terms (raw weighted sum, or
    ``normalize="group"``: the weighted sum of each term's group z-scores, DanceGRPO's aggregation)."""
    comps = {
        "a": torch.tensor([1.0, 2.0, 4.0, 0.0, 1.0, 2.0]),
        "b": torch.tensor([10.0, 0.0, 5.0, 3.0, 3.0, 3.0]),  # zero variance in group 1
    }

    def z(x, eps=EPS):
        x = np.asarray(x, dtype=np.float64)
        sd = x.std()
        return np.zeros_like(x) if np.ptp(x) == 0 else (x - x.mean()) / (sd + eps)

    def scored(normalize):
        f = chains_forest()
        f.record_scores(f.leaves(), comps)
        f.combine_scores(MultiReward([_term("a"), _term("b")], weights=[1.0, 0.5], normalize=normalize).combine)
        return f

    # weighted sum of raw rewards, then one z-score
    f = scored("none")
    stats = GroupAdvantage(baseline="mean", scale="group").assign(f)
    total = comps["a"].double().numpy() + 0.5 * comps["b"].double().numpy()
    expected_raw = np.concatenate([z(total[:3]), z(total[3:])])
    np.testing.assert_allclose(_np(f.advantage[12:18]), expected_raw, rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(_np(f.reward_components["b"][12:18]), comps["b"].numpy())

    # normalize="group": weighted sum of each reward's group z-scores, used as the advantage (scale none)
    f = scored("group")
    stats = GroupAdvantage(baseline="mean", scale="none").assign(f)
    a, b = comps["a"].double().numpy(), comps["b"].double().numpy()
    expected_norm = np.concatenate([z(a[:3], 0) + 0.5 * z(b[:3], 0), z(a[3:], 0) + 0.5 * z(b[3:], 0)]) / (1 + EPS)
    np.testing.assert_allclose(_np(f.advantage[12:18]), expected_norm, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(_np(f.advantage[6:12]), expected_norm, rtol=1e-5, atol=1e-6)
    assert not np.allclose(expected_norm, expected_raw)  # the two modes differ on this table
    # group 1 still varies in reward "a": it is trained
    assert f.edges(trainable=True).tolist() == [6, 7, 8, 15, 16, 17]
    assert stats["zero_std_ratio"] == 0.0
    assert torch.isfinite(f.advantage).all()


def test_assign_accepts_chains_below_a_shared_trunk():
    """A group's chains branching off one root (shared_noise): each edge still leads to one leaf."""
    f = Forest(prompts=["p"])
    root = f.add_roots(torch.randn(1, 2, 4, 4), group=[0], seed=[0])
    kids = f.add_children(
        root.repeat(2),
        torch.randn(2, 2, 4, 4),
        sigma=0.5,
        step=1,
        logp=torch.randn(2),
        std=torch.full((2,), 0.3),
        kernel="dance",
        eta=0.3,
        batch=0,
    )
    f.add_children(
        kids,
        torch.randn(2, 2, 4, 4),
        sigma=0.0,
        step=2,
        logp=torch.randn(2),
        std=torch.full((2,), 0.3),
        kernel="dance",
        eta=0.3,
        batch=1,
    )
    GroupAdvantage(scale="group").assign(_scored(f, torch.tensor([1.0, 2.0])))
    assert f.advantage.tolist() == pytest.approx([0.0, -1.0, 1.0, -1.0, 1.0], abs=1e-3)
    assert f.weight.tolist() == [0.0, 1.0, 1.0, 1.0, 1.0]  # the trunk (root) is not a chain node
    assert f.edges(trainable=True).tolist() == [1, 2, 3, 4]


def test_assign_refuses_a_branch_below_a_stochastic_edge():
    f = Forest(prompts=["p"])
    root = f.add_roots(torch.randn(1, 2, 4, 4), group=[0], seed=[0])
    kid = f.add_children(
        root,
        torch.randn(1, 2, 4, 4),
        sigma=0.5,
        step=1,
        logp=torch.randn(1),
        std=torch.full((1,), 0.3),
        kernel="dance",
        eta=0.3,
        batch=0,
    )
    f.add_children(
        kid.repeat(2),
        torch.randn(2, 2, 4, 4),
        sigma=0.0,
        step=2,
        logp=torch.randn(2),
        std=torch.full((2,), 0.3),
        kernel="dance",
        eta=0.3,
        batch=1,
    )
    with pytest.raises(ValueError, match="tree credit rule"):
        GroupAdvantage(scale="group").assign(_scored(f, torch.tensor([1.0, 2.0])))


def _scored(f: Forest, rewards: torch.Tensor) -> Forest:
    """``f`` with ``rewards`` [L] on its leaves (as the trainer's scoring leaves them)."""
    f.reward[f.leaves()] = rewards
    return f
