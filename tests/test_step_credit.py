"""Step-level credit (docs/step_credit.md): the ``probed`` plan (ODE completions, x̂0 projections), TP-GRPO's
turning points (``credit.rule: turning_point``) and VGPO's value anchoring (``credit.rule: value_anchor``)
on chains and on hand-built branching forests; forward counts, the pure-ODE reference, replay, learning."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
import torch
from conftest import make_model, train_redness, with_lora

from flowrl.config.schema import ConfigError, TrainConfig
from flowrl.core.seeding import derive_seed, seeded_normal
from flowrl.credit.turning_point import (
    TurningPoint,
    balance_signs,
    step_rewards,
    turning_points,
)
from flowrl.credit.value_anchor import ValueAnchor, discounted_values, temporal_weights
from flowrl.objectives.replay import replay, replay_batches
from flowrl.paths import CONFIG_DIR
from flowrl.rollout.base import RolloutContext, RolloutPlan, advance
from flowrl.rollout.chains import Chains, SDEWindow
from flowrl.rollout.forest import Forest
from flowrl.rollout.probes import Probed, decision_states, state_values
from flowrl.rollout.sampling import ode_sample
from flowrl.rollout.tree import Tree

PROMPTS = ["a red circle", "two blue squares"]
CONFIGS = CONFIG_DIR


def z(values: list[float], eps: float = 1e-4) -> torch.Tensor:
    """Group z-score by hand (population std)."""
    v = torch.tensor(values, dtype=torch.float32)
    return (v - v.mean()) / (v.std(unbiased=False) + eps)


# ---- turning points on hand-written reward sequences ----------------------------------------------
@pytest.mark.parametrize(
    "R, tie_eps, expected_tp, expected_r",
    [
        # first step: d_0 and R_n − R_1 agree → turning point, r_0 = R_n − R_0 = Δ; the last step never is one
        ([0.0, 1.0, 2.0], 0.0, [True, False], [2.0, 1.0]),
        # first step against the rest of the path (R_n − R_1 < 0): no turning point, r = d
        ([0.0, 1.0, 0.5], 0.0, [False, False], [1.0, -0.5]),
        # a flip against a rising path (Δ > 0): step 1 turns the trend, and the rest agrees → r_1 = R_n − R_1
        ([0.0, -1.0, 1.0, 2.0], 0.0, [False, True, False], [-1.0, 3.0, 1.0]),
        # the same flip on a falling path (Δ < 0): r_1 = R_n − R_1 < 0
        ([0.0, 1.0, -1.0, -2.0], 0.0, [False, True, False], [1.0, -3.0, -1.0]),
        # a flip the rest of the path undoes (R_n − R_2 < 0 while d_1 > 0): not a turning point
        ([0.0, -1.0, 1.0, 0.5], 0.0, [False, False, False], [-1.0, 2.0, -0.5]),
        # an exact tie d_0 = 0: s_0 = 0 is not < 0, so step 1 is no turning point
        ([0.0, 0.0, 1.0, 2.0], 0.0, [False, False, False], [0.0, 1.0, 1.0]),
        # a near-tie d_0 = −0.005: a turning point at step 1 with tie_eps 0 ...
        ([0.0, -0.005, 1.0, 2.0], 0.0, [False, True, False], [-0.005, 2.005, 1.0]),
        # ... and none with tie_eps 0.01 (|d_0| < ε counts as 0)
        ([0.0, -0.005, 1.0, 2.0], 0.01, [False, False, False], [-0.005, 1.005, 1.0]),
        # Δ = 0: no step agrees with the overall trend, and the first step disagrees with the rest
        ([0.0, -1.0, 1.0, 0.0], 0.0, [False, False, False], [-1.0, 2.0, -1.0]),
        # first-step turning point, a dip, then a flip on the last step (never a turning point: R_n − R_n = 0)
        ([0.0, 1.0, -1.0, 2.0], 0.0, [True, False, False], [2.0, -2.0, 3.0]),
    ],
)
def test_turning_points_and_step_rewards_on_hand_written_sequences(R, tie_eps, expected_tp, expected_r):
    seq = torch.tensor([R])
    indicator, d, delta = turning_points(seq, tie_eps)
    assert indicator[0].tolist() == expected_tp
    torch.testing.assert_close(d[0], seq[0, 1:] - seq[0, :-1])
    assert float(delta[0]) == pytest.approx(R[-1] - R[0])
    torch.testing.assert_close(step_rewards(seq, indicator)[0], torch.tensor(expected_r), rtol=0, atol=1e-6)


def test_turning_points_are_vectorised_over_paths():
    seqs = torch.tensor([[0.0, 1.0, 2.0], [0.0, 1.0, 0.5], [0.0, -1.0, -2.0]])
    indicator, _, delta = turning_points(seqs)
    assert indicator.tolist() == [[True, False], [False, False], [True, False]]
    assert delta.tolist() == [2.0, 0.5, -2.0]


def test_balancing_keeps_min_of_each_sign_largest_delta_first():
    # group 0: three Δ>0 (3, 1, 2) and one Δ<0 → keep the Δ=3 one and the negative one
    # group 1: Δ>0 only → keep none
    # group 2: two Δ>0 of equal |Δ| (gains 0.3 and 0.8) and one Δ<0 → the larger gain wins the tie
    # group 3: two of each → keep all four
    group = torch.tensor([0, 0, 0, 0, 1, 1, 2, 2, 2, 3, 3, 3, 3])
    delta = torch.tensor([3.0, 1.0, 2.0, -0.5, 1.0, 2.0, 1.0, 1.0, -1.0, 1.0, -1.0, 2.0, -2.0])
    gain = torch.tensor([3.0, 1.0, 2.0, -0.5, 1.0, 2.0, 0.3, 0.8, -1.0, 1.0, -1.0, 2.0, -2.0])
    keep = balance_signs(group, delta, gain)
    assert keep.tolist() == [True, False, False, True, False, False, False, True, True, True, True, True, True]


# ---- hand-built forests ------------------------------------------------------------------------
def chain_forest(chains: list[list[float]], groups: list[int], x0_probes: bool = False) -> Forest:
    """Chains with SDE steps 0..n−1 and one final ODE step. ``chains[c]``: R_0..R_n for TP-GRPO (values of the
    decision states at steps 0..n−1, R_n the leaf reward; ``x0_probes=False``) or R_0..R_{n−1} as the instant
    rewards of the states reached by SDE steps 0..n−1 (``x0_probes=True``; the leaf reward is 0)."""
    forest = Forest(prompts=[f"p{g}" for g in sorted(set(groups))], meta={"probe_x0": x0_probes})
    n = len(chains[0]) - (0 if x0_probes else 1)
    nodes = forest.add_roots(torch.zeros(len(chains), 1, 1, 1), groups, list(range(len(chains))))
    states = [nodes]
    for k in range(n):
        nodes = forest.add_children(
            nodes,
            torch.zeros(len(chains), 1, 1, 1),
            1.0 - (k + 1) / (n + 1),
            k + 1,
            torch.zeros(len(chains)),
            torch.ones(len(chains)),
            "flow_grpo",
            0.7,
            k,
        )
        states.append(nodes)
    leaves = forest.add_children(
        nodes,
        torch.zeros(len(chains), 1, 1, 1),
        0.0,
        n + 1,
        torch.zeros(len(chains)),
        torch.zeros(len(chains)),
        "ode",
        0.0,
        n,
    )
    table = torch.tensor(chains)
    probed = states[1:] if x0_probes else states[:-1]
    for k, s in enumerate(probed):
        forest.add_probe(s, torch.zeros(len(chains), 1, 1, 1))
        forest.value[s] = table[:, k]
    forest.reward[leaves] = 0.0 if x0_probes else table[:, -1]
    return forest


def tree_forest(x0_probes: bool) -> tuple[Forest, dict[str, int]]:
    """One prompt group: root →(SDE) a, b →(SDE) c1, c2 under a and c3, c4 under b →(ODE) leaves l1..l4."""
    forest = Forest(prompts=["p"], meta={"probe_x0": x0_probes})
    one = torch.zeros(1, 1, 1, 1)
    root = forest.add_roots(one, [0], [0])
    ab = forest.add_children(
        root.repeat(2), torch.zeros(2, 1, 1, 1), 0.66, 1, torch.zeros(2), torch.ones(2), "dance", 0.3, 0
    )
    cs = forest.add_children(
        ab.repeat_interleave(2), torch.zeros(4, 1, 1, 1), 0.33, 2, torch.zeros(4), torch.ones(4), "dance", 0.3, 1
    )
    ls = forest.add_children(cs, torch.zeros(4, 1, 1, 1), 0.0, 3, torch.zeros(4), torch.zeros(4), "ode", 0.0, 2)
    names = {"root": int(root[0]), "a": int(ab[0]), "b": int(ab[1])}
    names.update({f"c{i + 1}": int(c) for i, c in enumerate(cs)})
    names.update({f"l{i + 1}": int(leaf) for i, leaf in enumerate(ls)})
    return forest, names


def test_turning_point_credit_on_chains_with_balancing_and_a_zero_variance_group():
    chains = [
        [0.0, 1.0, 3.0],  # TP at step 0, Δ = 3: kept;  r = [3, 2]
        [0.0, 1.0, 2.0],  # TP at step 0, Δ = 2: dropped by balancing → r_0 = d_0 = 1;  r = [1, 1]
        [0.0, -1.0, -1.5],  # TP at step 0, Δ = −1.5: kept;  r = [−1.5, −0.5]
        [0.0, 1.0, 0.5],  # no TP;  r = [1, −0.5]
        [0.0, 0.0, 0.0],
        [0.0, 0.0, 0.0],
    ]  # group 1: no variance anywhere → skipped
    forest = chain_forest(chains, [0, 0, 0, 0, 1, 1])
    stats = TurningPoint().assign(forest)
    step1 = forest.step == 1  # the edges of SDE step 0 lead to step-1 states
    step2 = forest.step == 2
    torch.testing.assert_close(forest.advantage[step1][:4], z([3.0, 1.0, -1.5, 1.0]))
    torch.testing.assert_close(forest.advantage[step2][:4], z([2.0, 1.0, -0.5, -0.5]))
    # the zero-variance group's edges are flat (advantage 0, no spread to compare), not weight 0: a policy objective
    # (which trains no flat unit) skips them, one that trains flat units would not
    assert forest.weight[step1].tolist() == [1] * 6 and forest.flat[step1].tolist() == [0, 0, 0, 0, 1, 1]
    assert forest.flat[step2].tolist() == [0, 0, 0, 0, 1, 1]
    flat_edges = torch.cat([torch.nonzero(step1).flatten()[4:], torch.nonzero(step2).flatten()[4:]])
    assert not bool(torch.isin(flat_edges, forest.units("edges")).any())
    assert forest.advantage[step1][4:].tolist() == [0.0, 0.0]
    assert forest.weight[forest.step == 3].sum() == 0  # ODE edges are never trained
    assert (stats["tp/pos"], stats["tp/neg"], stats["tp/kept_pos"], stats["tp/kept_neg"]) == (2, 1, 1, 1)
    assert stats["tp/sign_balance"] == pytest.approx(1 / 3)
    assert stats["tp/rate_step0"] == pytest.approx(3 / 6) and stats["tp/rate_step1"] == 0.0
    assert stats["tp/value_step1"] == pytest.approx((1 + 1 - 1 + 1 + 0 + 0) / 6)
    assert stats["zero_std_ratio"] == pytest.approx(2 / 4) and stats["skipped_edges"] == 4

    unbalanced = chain_forest(chains, [0, 0, 0, 0, 1, 1])
    TurningPoint(balance=False).assign(unbalanced)
    torch.testing.assert_close(unbalanced.advantage[step1][:4], z([3.0, 2.0, -1.5, 1.0]))
    plain = chain_forest(chains, [0, 0, 0, 0, 1, 1])
    TurningPoint(use_turning_points=False).assign(plain)  # incremental rewards only
    torch.testing.assert_close(plain.advantage[step1][:4], z([1.0, 1.0, -1.0, 1.0]))


def test_turning_point_credit_on_a_branching_forest_averages_paths_over_the_leaves_below():
    forest, n = tree_forest(x0_probes=False)
    for name, value in {"root": 0.0, "a": 1.0, "b": -1.0}.items():
        forest.add_probe(torch.tensor([n[name]]), torch.zeros(1, 1, 1, 1))
        forest.value[n[name]] = value
    for name, reward in {"l1": 2.0, "l2": 0.5, "l3": -2.0, "l4": 1.0}.items():
        forest.reward[n[name]] = reward
    assert decision_states(forest).tolist() == [n["root"], n["a"], n["b"]]
    values = state_values(forest)  # the states after the last SDE step take their leaf's reward (ODE below)
    assert [float(values[n[c]]) for c in ("c1", "c2", "c3", "c4")] == [2.0, 0.5, -2.0, 1.0]
    stats = TurningPoint().assign(forest)
    # paths: l1 R = [0, 1, 2] (TP at step 0: r = [2, 1]); l2 [0, 1, .5] (r = [1, −.5]);
    #        l3 [0, −1, −2] (TP at step 0: r = [−2, −1]); l4 [0, −1, 1] (r = [−1, 2]); one TP of each sign: both kept
    # shared edges: root→a = mean(2, 1) = 1.5, root→b = mean(−2, −1) = −1.5
    adv = forest.advantage
    torch.testing.assert_close(adv[[n["a"], n["b"]]], z([1.5, -1.5]))
    torch.testing.assert_close(adv[[n["c1"], n["c2"], n["c3"], n["c4"]]], z([1.0, -0.5, -1.0, 2.0]))
    assert (stats["tp/kept_pos"], stats["tp/kept_neg"]) == (1, 1)
    assert forest.weight[[n[f"l{i}"] for i in range(1, 5)]].sum() == 0


def test_value_anchor_q_omega_and_advantages_on_hand_made_numbers():
    Q = discounted_values(torch.tensor([[1.0, 2.0, 3.0], [0.0, 0.0, 1.0]]), gamma=0.5)
    torch.testing.assert_close(Q, torch.tensor([[2.75, 3.5, 3.0], [0.25, 0.5, 1.0]]))
    omega = temporal_weights(Q, shift=1e-3)
    mean = (0.001 + 0.751 + 0.251) / 3
    torch.testing.assert_close(omega, torch.tensor([[0.001, 0.751, 0.251], [0.001, 0.251, 0.751]]) / mean)

    forest = chain_forest([[1.0, 2.0, 3.0], [0.0, 0.0, 1.0]], [0, 0], x0_probes=True)
    rule = ValueAnchor(gamma=0.5, k_abs=0.1, abs_steps=2)
    stats = rule.assign(forest)
    for t in range(3):
        edges = forest.step == t + 1
        alpha = 0.1 if t < 2 else 0.0
        expected = omega[:, t] * (z(Q[:, t].tolist()) + alpha * Q[:, t])
        torch.testing.assert_close(forest.advantage[edges], expected)
    assert stats["vgpo/q_step0"] == pytest.approx((2.75 + 0.25) / 2) and stats["vgpo/r_step2"] == pytest.approx(2.0)
    assert stats["vgpo/omega_step1"] == pytest.approx((0.751 + 0.251) / 2 / mean, rel=1e-5)


def test_value_anchor_keeps_the_absolute_term_when_the_group_stops_varying():
    forest = chain_forest([[0.5, 0.5, 0.5], [0.5, 0.5, 0.5]], [0, 0], x0_probes=True)
    stats = ValueAnchor(gamma=0.5, k_abs=0.1, abs_steps=2).assign(forest)
    Q = torch.tensor([0.875, 0.75, 0.5])
    omega = (Q - 0.5 + 1e-3) / (Q - 0.5 + 1e-3).mean()
    for t in range(2):  # z = 0, the absolute term remains and the edges are trained
        torch.testing.assert_close(forest.advantage[forest.step == t + 1], (omega[t] * 0.1 * Q[t]).expand(2))
        assert forest.weight[forest.step == t + 1].tolist() == [1.0, 1.0]
    assert forest.flat[forest.step == 3].tolist() == [1.0, 1.0]  # t ≥ abs_steps: nothing left, skipped (flat)
    assert stats["zero_std_ratio"] == 1.0 and stats["skipped_edges"] == 2


def test_value_anchor_on_a_branching_forest_averages_q_and_omega_over_the_leaves_below():
    forest, n = tree_forest(x0_probes=True)
    for name, value in {"a": 1.0, "b": -1.0, "c1": 2.0, "c2": 0.0, "c3": -2.0, "c4": 1.0}.items():
        forest.add_probe(torch.tensor([n[name]]), torch.zeros(1, 1, 1, 1))
        forest.value[n[name]] = value
    ValueAnchor(gamma=0.5, k_abs=0.1, abs_steps=1).assign(forest)
    # per path Q: l1 [2, 2], l2 [1, 0], l3 [−2, −2], l4 [−0.5, 1]; ω: l1 [1, 1], l2 [1.001, .001]/.501,
    # l3 [1, 1], l4 [.001, 1.501]/.751; shared edges take the means over their two leaves
    q_a, q_b = 1.5, -1.25
    w_a, w_b = (1 + 1.001 / 0.501) / 2, (1 + 0.001 / 0.751) / 2
    zab = z([q_a, q_b])
    torch.testing.assert_close(
        forest.advantage[[n["a"], n["b"]]], torch.tensor([w_a * (zab[0] + 0.1 * q_a), w_b * (zab[1] + 0.1 * q_b)])
    )
    w_c = torch.tensor([1.0, 0.001 / 0.501, 1.0, 1.501 / 0.751])
    torch.testing.assert_close(forest.advantage[[n["c1"], n["c2"], n["c3"], n["c4"]]], w_c * z([2.0, 0.0, -2.0, 1.0]))


# ---- the probed plan on a real (tiny) pipeline ----------------------------------------------------
@pytest.mark.parametrize("steps, window, shared", [(5, 3, False), (10, None, False), (5, 3, True)])
def test_tp_grpo_forward_count_matches_the_closed_form(sd3_model, steps, window, shared):
    """docs/step_credit.md, "The probed plan": T + T + Σ_{k=1}^{n−1}(T − k) forwards per chain
    (chain + reference + completions);
    with shared noise the trunk and the reference (the shared root) are one per group (Probed's docstring)."""
    win = SDEWindow(mode="all") if window is None else SDEWindow(mode="fixed", start=0, size=window)
    G, P = 2, len(PROMPTS)
    plan = Probed(inner_plan=Chains(group_size=G, steps=steps, window=win, shared_noise=shared), probe="ode_completion")
    ctx = RolloutContext(seed=4, max_batch=3)
    forest = plan.rollout(sd3_model, PROMPTS, ctx)
    T, n = steps, window or steps - 1
    completions = sum(T - k for k in range(1, n))
    if shared:
        expected_extra = P * T + P * G * completions
        expected = P * 1 + P * G * (T - 1) + expected_extra
    else:
        expected_extra = P * G * (T + completions)
        expected = P * G * (T + T + completions)
    assert forest.counters["probe_forwards"] == expected_extra
    assert forest.counters["forwards"] == expected
    counts = plan.expected_counts(P, ctx)
    assert counts["forwards"] == expected and counts["probe_forwards"] == expected_extra
    assert forest.probe_node.numel() == counts["probes"] == P * (1 if shared else G) + P * G * (n - 1)
    if window is None:
        assert T + T + completions == 64  # SD3.5's published T 10, n 9
    assert torch.equal(torch.sort(forest.probe_node).values, decision_states(forest))


def test_vgpo_probes_add_no_transformer_forward(sd3_model):
    win = SDEWindow(mode="fixed", start=1, size=3)
    plain = Chains(group_size=3, steps=6, window=win).rollout(sd3_model, PROMPTS, RolloutContext(seed=2))
    plan = Probed(inner_plan=Chains(group_size=3, steps=6, window=win), probe="x0_projection")
    probed = plan.rollout(sd3_model, PROMPTS, RolloutContext(seed=2))
    assert probed.counters["forwards"] == plain.counters["forwards"] and probed.counters["probe_forwards"] == 0
    torch.testing.assert_close(probed.all_latents(), plain.all_latents(), rtol=0, atol=0)
    reached = torch.nonzero(probed.stochastic).flatten()
    assert sorted(probed.probe_node.tolist()) == reached.tolist()
    counts = plan.expected_counts(len(PROMPTS), RolloutContext(seed=2))
    assert counts["forwards"] == plain.counters["forwards"] and counts["probes"] == reached.numel() == 2 * 3 * 3
    metrics = plan.metrics(probed)
    assert (
        metrics["probe/extra_forwards"] == 0 and metrics["probe/decodes"] == 18 and metrics["probe/reward_calls"] == 24
    )


@pytest.mark.parametrize("guidance", [1.0, 2.5])
def test_pure_ode_reference_starts_from_the_chains_own_x_T(sd3_model, guidance):
    plan = Probed(inner_plan=Chains(group_size=2, steps=4, window=SDEWindow(mode="fixed", start=0, size=2)))
    forest = plan.rollout(sd3_model, PROMPTS, RolloutContext(seed=7, guidance=guidance, max_batch=1))
    roots = forest.roots()
    seeds = forest.seed[roots].tolist()
    assert torch.equal(forest.all_latents()[roots], sd3_model.noise(seeds))  # x_T rebuilt bit-exactly from the seed
    position = {int(node): i for i, node in enumerate(forest.probe_node)}
    reference = forest.probe_latents()[[position[int(r)] for r in roots]]
    prompts = [forest.prompts[int(g)] for g in forest.group[roots]]
    expected = ode_sample(sd3_model, prompts, seeds, 4, guidance, max_batch=1, decode=False)
    assert torch.equal(reference, expected)  # the same Euler steps, batch layout and conditioning: bit-exact
    batched = plan.rollout(sd3_model, PROMPTS, RolloutContext(seed=7, guidance=guidance, max_batch=16))
    torch.testing.assert_close(batched.probe_latents()[[position[int(r)] for r in roots]], expected, rtol=0, atol=1e-5)


@pytest.mark.parametrize("probe, rule", [("ode_completion", TurningPoint()), ("x0_projection", ValueAnchor())])
def test_replay_ratio_is_one_on_the_trained_edges(probe, rule):
    model = with_lora(make_model("sd3"))
    plan = Probed(
        inner_plan=Chains(group_size=3, steps=5, window=SDEWindow(mode="fixed", start=0, size=3)), probe=probe
    )
    forest = plan.rollout(model, PROMPTS, RolloutContext(seed=0, guidance=2.0, max_batch=4))
    nodes, x0 = forest.score_requests()
    forest.record_scores(nodes, {"r": x0.mean(dim=(1, 2, 3))})
    forest.combine_scores(lambda components, groups: components["r"])
    rule.assign(forest)
    edges = forest.edges()
    assert edges.numel() == 2 * 3 * 3 and torch.isfinite(forest.advantage[edges]).all()
    cond = model.encode(forest.prompts, forest.guidance)
    for b in replay_batches(forest, edges):
        assert torch.equal(replay(model, forest, cond, b).logp.detach(), forest.logp_old[b])


def test_step_credit_needs_the_right_probes_and_unnormalised_rewards(sd3_model):
    from flowrl_rewards import MultiReward

    win = SDEWindow(mode="fixed", start=0, size=2)
    forest = Probed(inner_plan=Chains(group_size=2, steps=4, window=win), probe="x0_projection").rollout(
        sd3_model, PROMPTS[:1], RolloutContext()
    )
    forest.value[forest.probe_node] = 0.5
    forest.reward[forest.leaves()] = 1.0
    with pytest.raises(ValueError, match="ode_completion"):  # R_0 (the root) is not probed by x0 projections
        TurningPoint().assign(forest)
    plain = Chains(group_size=2, steps=4, window=win).rollout(sd3_model, PROMPTS[:1], RolloutContext())
    plain.reward[plain.leaves()] = 1.0
    with pytest.raises(ValueError, match="rollout.plan=probed"):
        ValueAnchor().assign(plain)
    probed = Probed(inner_plan=Chains(steps=4, window=win))
    with pytest.raises(ConfigError, match="reward_normalize='batch' with a probed plan"):  # at load (test_key_checks)
        probed.check_reward_normalize("batch")
    probed.setup(sd3_model, MultiReward([{"name": "brightness"}], normalize="batch"))  # nothing refused after load
    with pytest.raises(ValueError, match="rollout.probe"):
        Probed(probe="x0")
    with pytest.raises(TypeError, match="inner_args"):
        Probed(inner_args=["steps=3"])  # one nested form: rollout.inner: {plan: tree, steps: 3}
    with pytest.raises(ConfigError, match="rollout.inner.stepz is not a key of rollout.plan='tree'.*'steps'"):
        Probed(inner={"plan": "tree", "stepz": 3})
    with pytest.raises(ConfigError, match="rollout.inner.plan='no_such_plan'"):
        Probed(inner="no_such_plan")


def test_probed_wraps_any_inner_plan_and_passes_the_lifecycle_on(sd3_model):
    @dataclass
    class Recorder(Chains):
        calls: list = field(default_factory=list, metadata={"config": False})

        def setup(self, model, reward=None):
            self.calls.append("setup")

        def after_update(self, model):
            self.calls.append("after_update")

        def metrics(self, forest):
            return {"inner/leaves": float(forest.leaves().numel())}

    win = SDEWindow(mode="fixed", start=0, size=2)
    inner = Recorder(group_size=2, steps=4, window=win)
    wrapped = Probed(inner_plan=inner)
    wrapped.setup(sd3_model, None)
    wrapped.after_update(sd3_model)
    forest = wrapped.rollout(sd3_model, PROMPTS, RolloutContext(seed=5))
    assert inner.calls == ["setup", "after_update"]
    assert wrapped.metrics(forest)["inner/leaves"] == 4.0
    own = Probed(inner_plan=Chains(group_size=2, steps=4, window=win)).rollout(
        sd3_model, PROMPTS, RolloutContext(seed=5)
    )
    by_name = Probed(
        inner={
            "plan": "flowrl.rollout.chains:Chains",  # the same nested form as explore's inner
            "group_size": 2,
            "steps": 4,
            "window": {"mode": "fixed", "start": 0, "size": 2},
        }
    )
    named = by_name.rollout(sd3_model, PROMPTS, RolloutContext(seed=5))
    for other in (own, named):
        assert torch.equal(other.all_latents(), forest.all_latents())
        assert torch.equal(other.probe_latents(), forest.probe_latents())
        assert other.counters == forest.counters


@dataclass
class MiniTree(RolloutPlan):
    """A stand-in tree for the composition test: one root per prompt, two SDE splits (dance) into 2 × 2, ODE after."""

    steps: int = 4

    @property
    def schedule_steps(self) -> int:  # declared: what an ODE-completion probe completes along
        return self.steps

    def rollout(self, model, prompts, ctx):
        guidance = model.guidance if ctx.guidance is None else float(ctx.guidance)
        sigmas = model.schedule(self.steps)
        forest = ctx.new_forest(prompts, guidance, model.device)
        seeds = [derive_seed(ctx.seed, ctx.iteration, "root", ctx.group_offset + g) for g in range(len(prompts))]
        nodes = forest.add_roots(model.noise(seeds), torch.arange(len(prompts)), seeds, sigma=float(sigmas[0]))
        cond = model.encode(prompts, guidance)
        for i in range(self.steps):

            def noise_for(parents, branch, i=i):
                return torch.stack(
                    [
                        seeded_normal(
                            derive_seed(ctx.seed, ctx.iteration, "sde", int(p), int(b), i), model.latent_shape
                        )
                        for p, b in zip(parents, branch)
                    ]
                )

            split = i < 2
            nodes = advance(
                forest,
                model,
                nodes,
                cond,
                float(sigmas[i + 1]),
                i + 1,
                "dance" if split else "ode",
                0.3 if split else 0.0,
                noise_for,
                guidance,
                ctx.max_batch,
                fanout=2 if split else 1,
                observers=ctx.observers,
            )
        return forest


@pytest.mark.parametrize("probe, rule", [("ode_completion", TurningPoint()), ("x0_projection", ValueAnchor())])
def test_step_credit_composes_with_a_tree_plan(probe, rule):
    """Probed around a branching plan: the tree's internal nodes are probed like chain states, both rules
    credit every SDE edge, and replay still equals rollout."""
    model = make_model("sd3")
    plan = Probed(inner_plan=MiniTree(steps=4), probe=probe)
    forest = plan.rollout(model, PROMPTS, RolloutContext(seed=1, max_batch=3))
    P, T = len(PROMPTS), 4
    if probe == "ode_completion":  # the root (step 0) and the two states of step 1 per prompt
        assert forest.probe_node.numel() == P * 3 and forest.counters["probe_forwards"] == P * (T + 2 * (T - 1))
    else:  # the states SDE steps reached: 2 at step 1 and 4 at step 2 per prompt
        assert forest.probe_node.numel() == P * 6 and forest.counters["probe_forwards"] == 0
    nodes, x0 = forest.score_requests()
    forest.record_scores(nodes, {"r": x0.mean(dim=(1, 2, 3))})
    forest.combine_scores(lambda components, groups: components["r"])
    stats = rule.assign(forest)
    edges = forest.edges()
    assert edges.numel() == P * (2 + 4) and torch.isfinite(forest.advantage[edges]).all()
    assert stats["zero_std_ratio"] == 0.0
    cond = model.encode(forest.prompts, forest.guidance)
    for b in replay_batches(forest, edges):
        assert torch.equal(replay(model, forest, cond, b).logp.detach(), forest.logp_old[b])


@pytest.mark.parametrize(
    "path, plan, rule",
    [
        ("shapes/tp_grpo.yaml", "probed", "turning_point"),
        ("shapes/vgpo.yaml", "probed", "value_anchor"),
        ("sd35/tp_grpo_pickscore.yaml", "probed", "turning_point"),
        ("sd35/vgpo_geneval.yaml", "probed", "value_anchor"),
    ],
)
def test_presets_load(path, plan, rule):
    from flowrl.config import build

    cfg = TrainConfig.from_yaml(CONFIGS / path)
    assert (cfg.rollout.plan, cfg.credit.rule) == (plan, rule)
    built = build.build_plan(cfg.rollout)
    assert built.probe == ("ode_completion" if rule == "turning_point" else "x0_projection")
    if rule == "turning_point":  # TP-GRPO: the SDE window starts at step 0, so R_0 is the root's completion
        assert built.inner_plan.window.steps(built.inner_plan.steps, 0, 0)[0] == 0


# ---- learning through the Trainer ------------------------------------------------------------------


@pytest.mark.slow  # learning runs (10 iterations each): `pytest -m slow`, run by .ci/run; the probe metrics through
# the Trainer: test_config_cli's one iteration of every preset (sd35/tp_grpo_pickscore, sd35/vgpo_geneval)
@pytest.mark.parametrize("method", ["tp_grpo", "vgpo"])
def test_step_credit_raises_a_dense_reward_through_the_trainer(tmp_path, method):
    """Ten seeded iterations on the tiny SD3 pipeline with ``redness``: the mean reward of fixed-seed ODE
    samples rises by well above the spread between two seed sets of the same model."""
    extra = (
        ["rollout.probe=ode_completion", "credit.rule=turning_point"]
        if method == "tp_grpo"
        else ["rollout.probe=x0_projection", "credit.rule=value_anchor"]
    )
    before, after, train = train_redness(
        tmp_path,
        method,
        [
            "rollout.plan=probed",
            *extra,
            "rollout.inner={plan: chains, steps: 6, group_size: 6, window: {mode: fixed, start: 0, size: 3}}",
            "train.max_steps=10",
        ],
    )
    gain = sum(after) / 2 - sum(before) / 2
    assert gain > max(3 * abs(before[0] - before[1]), 0.01), f"before {before}, after {after}"
    assert all(r["first_step_abs_delta_logp"] == 0.0 for r in train)
    key = "tp/rate" if method == "tp_grpo" else "vgpo/q_step0"
    assert all(key in r and "probe/extra_forwards" in r for r in train)
    if method == "tp_grpo":
        assert train[0]["probe/extra_forwards"] == 4 * 6 * (6 + 5 + 4)
    else:
        assert train[0]["probe/extra_forwards"] == 0 and train[0]["probe/decodes"] == 4 * 6 * 3


# ---- step credit on pruned trees; metric keys independent of failed rewards ---------------------------
def _scored_for_step_credit(forest, seed: int = 0, nan_rewards: bool = False):
    """Random state values (every node, as probes would give) and leaf rewards (NaN when ``nan_rewards``)."""
    g = torch.Generator().manual_seed(seed)
    nodes = decision_states(forest)
    forest.add_probe(nodes, forest.all_latents()[nodes])
    forest.value[:] = torch.rand(forest.num_nodes, generator=g)
    leaves = forest.leaves()
    forest.reward[leaves] = float("nan") if nan_rewards else torch.rand(leaves.numel(), generator=g)
    return forest


@pytest.mark.parametrize("rule", [TurningPoint(), ValueAnchor()])
def test_step_credit_keeps_a_trees_depth_pruning(sd3_model, rule):
    plan = Tree(steps=5, split_steps=[0, 1], kernel="dance", eta=0.3, depth_prune_size=2)
    forest = plan.rollout(sd3_model, ["a red circle"], RolloutContext(seed=0))
    pruned = torch.nonzero(forest.stochastic & (forest.parent >= 0) & (forest.trainable == 0)).flatten()
    assert pruned.numel() > 0 and set(forest.step[pruned].tolist()) <= set(plan.layout(0, 0).pruned)
    stats = rule.assign(_scored_for_step_credit(forest))
    assert (forest.weight[pruned] == 0).all()
    assert stats["pruned_depth_edges"] == pruned.numel()
    others = forest.edges(trainable=True)
    assert bool((forest.weight[others[~torch.isin(others, pruned)]] > 0).any())


def test_turning_point_logs_the_same_keys_when_a_process_rewards_fail(sd3_model):
    plan = Chains(group_size=3, steps=4, kernel="flow_grpo", eta=0.7, window=SDEWindow(mode="fixed", start=0, size=2))

    def keys(nan_rewards: bool) -> list[str]:
        forest = _scored_for_step_credit(
            plan.rollout(sd3_model, ["a red circle"], RolloutContext(seed=0)), nan_rewards=nan_rewards
        )
        return sorted(TurningPoint().assign(forest))

    assert keys(False) == keys(True)
