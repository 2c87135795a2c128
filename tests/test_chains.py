"""Chains plan: closed-form NFE / trained-edge counts, seeds, determinism, replay == rollout."""

from __future__ import annotations

import pytest
import torch

from flowrl.core.seeding import derive_seed, seeded_normal
from flowrl.credit.group import GroupAdvantage
from flowrl.models.base import LoraSpec
from flowrl.objectives.replay import replay, replay_batches
from flowrl.rollout import sde
from flowrl.rollout.base import RolloutContext
from flowrl.rollout.chains import Chains, SDEWindow
from tests.conftest import make_model

PROMPTS = ["a red circle", "two blue squares"]


def window_steps(forest):
    """Schedule indices (of the parent) of the forest's trainable edges, per chain."""
    edges = forest.edges(trainable=False)
    return sorted({int(forest.step[forest.parent[e]]) for e in edges if forest.stochastic[e]})


@pytest.mark.parametrize(
    "window, expected_steps",
    [
        (SDEWindow(mode="all"), list(range(5))),
        (SDEWindow(mode="fixed", start=2, size=2), [2, 3]),
        (SDEWindow(mode="progressive", start=0, size=2, stride=1, tau=3), None),
        (SDEWindow(mode="random", size=2, range=[0, 4]), None),
    ],
)
def test_counts_match_closed_form(sd3_model, window, expected_steps):
    plan = Chains(group_size=3, steps=6, kernel="flow_grpo", eta=0.7, window=window)
    for iteration in (0, 7):
        forest = plan.rollout(sd3_model, PROMPTS, RolloutContext(seed=1, iteration=iteration, max_batch=4))
        expected = plan.expected_counts(len(PROMPTS), RolloutContext(seed=1, iteration=iteration))
        chains = len(PROMPTS) * 3
        assert forest.counters["forwards"] == expected["forwards"] == chains * 6
        assert forest.edges(trainable=True).numel() == expected["trained_edges"]
        assert forest.leaves().numel() == chains
        steps = window_steps(forest)
        assert steps == plan.window.steps(6, iteration, 1)
        assert 5 not in steps  # the last step (to sigma 0) is never stochastic
        if expected_steps is not None:
            assert steps == expected_steps
        if window.mode == "progressive":
            assert steps == ([0, 1] if iteration == 0 else [2, 3])  # start 0 + 7 // 3, clamped at T-1-size = 3
        if window.mode == "random":
            assert len(steps) == 2 and steps[1] == steps[0] + 1 and 0 <= steps[0] and steps[1] < 4


def test_random_window_varies_with_iteration_and_is_seeded():
    w = SDEWindow(mode="random", size=2, range=[0, 8])
    starts = {w.steps(10, it, 0)[0] for it in range(30)}
    assert len(starts) > 3
    assert [w.steps(10, it, 0) for it in range(10)] == [w.steps(10, it, 0) for it in range(10)]


def test_dpm2_post_solver_counts(sd3_model):
    plan = Chains(
        group_size=2,
        steps=10,
        window=SDEWindow(mode="fixed", start=0, size=3),
        post_solver="dpm2",
        post_steps_ratio=0.4,
    )
    forest = plan.rollout(sd3_model, PROMPTS, RolloutContext(seed=0))
    # 3 window steps + round(0.4 * 7) = 3 DPM-Solver steps per chain
    assert forest.counters["forwards"] == plan.expected_counts(2)["forwards"] == 4 * (3 + 3)
    assert forest.edges(trainable=True).numel() == 4 * 3
    leaves = forest.leaves()
    assert torch.all(forest.sigma[leaves] == 0)
    images = sd3_model.decode(forest.all_latents()[leaves])
    assert torch.isfinite(images).all()


def test_roots_rebuild_from_seeds_and_shared_noise(sd3_model):
    for shared in (False, True):
        plan = Chains(group_size=3, steps=4, shared_noise=shared)
        forest = plan.rollout(sd3_model, PROMPTS, RolloutContext(seed=5, iteration=2))
        roots = forest.roots()
        rebuilt = sd3_model.noise(forest.seed[roots].tolist())
        assert torch.equal(rebuilt, forest.all_latents()[roots])
        leaves = forest.leaves()
        root_of_leaf = torch.tensor([forest.ancestors(int(l))[-1] for l in leaves])
        if shared:  # one x_T per group, all three chains of a group below it
            assert roots.numel() == len(PROMPTS)
            assert root_of_leaf.tolist() == roots.repeat_interleave(3).tolist()
        else:
            assert roots.numel() == len(PROMPTS) * 3 and root_of_leaf.tolist() == roots.tolist()
            assert not torch.equal(forest.all_latents()[roots[0]], forest.all_latents()[roots[1]])
        assert not torch.equal(forest.all_latents()[root_of_leaf[0]], forest.all_latents()[root_of_leaf[3]])


@pytest.mark.parametrize("start, max_batch", [(0, 4), (2, 4), (2, 1)])
def test_shared_trunk_counts_and_equals_chain_by_chain_sampling(sd3_model, start, max_batch):
    """With shared noise the ODE steps before the window run once per group; every chain still equals
    stepping that chain alone from its group's x_T with its own (group, chain, step) noise."""
    G, T = 3, 6
    plan = Chains(
        group_size=G, steps=T, eta=0.7, shared_noise=True, window=SDEWindow(mode="fixed", start=start, size=2)
    )
    forest = plan.rollout(sd3_model, PROMPTS, RolloutContext(seed=4, iteration=1, max_batch=max_batch))
    expected = plan.expected_counts(len(PROMPTS), RolloutContext(seed=4, iteration=1))
    # a forward carries at most max_batch new edges (one parent's G branches when max_batch < G)
    assert all(int((forest.batch == b).sum()) <= max(max_batch, G) for b in forest.batch.unique() if b >= 0)
    assert forest.counters["forwards"] == expected["forwards"] == 2 * (start + 1) + 6 * (T - start - 1)
    assert forest.edges(trainable=True).numel() == expected["trained_edges"] == 6 * 2
    sigmas = sd3_model.schedule(T).float()
    cond = sd3_model.encode(PROMPTS, sd3_model.guidance)
    leaves = forest.leaves()
    for k, leaf in enumerate(leaves.tolist()):
        g, j = k // G, k % G
        x = sd3_model.noise([derive_seed(4, 1, "root", g, 0)])
        for i in range(T):
            v = sd3_model.velocity(x, sigmas[i : i + 1], cond.select(torch.tensor([g])), sd3_model.guidance)
            if start <= i < start + 2:
                noise = seeded_normal(derive_seed(4, 1, "sde", g, j, i), sd3_model.latent_shape)[None]
                x, _, _ = sde.step("flow_grpo", x, v, float(sigmas[i]), float(sigmas[i + 1]), 0.7, noise)
            else:
                x, _, _ = sde.step("ode", x, v, float(sigmas[i]), float(sigmas[i + 1]))
        torch.testing.assert_close(forest.all_latents()[leaf][None], x, rtol=1e-4, atol=1e-5)


def test_rollout_is_deterministic_and_iteration_dependent(sd3_model):
    plan = Chains(group_size=2, steps=4)
    a = plan.rollout(sd3_model, PROMPTS, RolloutContext(seed=3, iteration=1))
    b = plan.rollout(sd3_model, PROMPTS, RolloutContext(seed=3, iteration=1))
    c = plan.rollout(sd3_model, PROMPTS, RolloutContext(seed=3, iteration=2))
    assert torch.equal(a.all_latents(), b.all_latents())
    assert torch.equal(a.logp_old, b.logp_old)
    assert not torch.equal(a.all_latents()[a.leaves()], c.all_latents()[c.leaves()])


def test_eta_zero_is_the_ode(sd3_model):
    sde_plan = Chains(group_size=2, steps=4, kernel="dance", eta=0.0)
    forest = sde_plan.rollout(sd3_model, PROMPTS, RolloutContext(seed=0))
    assert forest.edges(trainable=True).numel() == 0
    assert torch.isfinite(forest.logp_old).all()
    from flowrl.rollout.sampling import ode_sample

    leaves = forest.leaves()
    ode = ode_sample(
        sd3_model,
        [forest.prompts[int(g)] for g in forest.group[leaves]],
        forest.seed[leaves].tolist(),
        4,
        decode=False,
        max_batch=64,
    )
    torch.testing.assert_close(forest.all_latents()[leaves], ode, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("family", ["sd3", "flux"])
@pytest.mark.parametrize("kernel, eta", [("flow_grpo", 0.7), ("dance", 0.3), ("cps", 0.8)])
def test_replay_equals_rollout(family, kernel, eta, reduction):
    """Invariant 1: recomputing each trainable edge's log-prob with the rollout weights gives ratio 1
    bit-exactly (CPU fp32), with and without CFG, with a LoRA attached (non-zero), for either
    reduction of the log-probs (the loss owns it; the forest records it; replay follows the forest)."""
    model = make_model(family)
    model.add_lora(LoraSpec(rank=2, init="default"))  # peft default init: A random, B zero
    torch.manual_seed(0)
    with torch.no_grad():
        for name, p in model.trainable.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.05)
    guidances = (1.0, 2.5) if family == "sd3" else (3.5,)
    for guidance, shared in [(g, s) for g in guidances for s in (False, True)]:
        plan = Chains(
            group_size=3,
            steps=5,
            kernel=kernel,
            eta=eta,
            shared_noise=shared,
            window=SDEWindow(mode="fixed", start=1, size=3),
        )
        forest = plan.rollout(
            model, PROMPTS, RolloutContext(seed=0, guidance=guidance, max_batch=4, reduction=reduction)
        )
        assert forest.reduction == reduction
        forest.reward[forest.leaves()] = torch.arange(6, dtype=torch.float32)
        GroupAdvantage().assign(forest)
        cond = model.encode(forest.prompts, forest.guidance)
        batches = replay_batches(forest, forest.edges())
        assert sum(b.numel() for b in batches) == 18
        for b in batches:
            out = replay(model, forest, cond, b, kl_form="exact")
            assert torch.equal(out.logp.detach(), forest.logp_old[b]), (family, kernel, guidance, shared, reduction)
            assert out.logp.requires_grad
            assert (out.kl > 0).all()  # LoRA on: the policy differs from the reference
        other = "sum" if reduction == "mean" else "mean"
        with pytest.raises(ValueError, match="ratio would not be 1"):
            replay(model, forest, cond, batches[0], reduction=other)


def test_seeds_are_stable():
    assert derive_seed(0, 1, "root", 2) == derive_seed(0, 1, "root", 2)
    assert derive_seed(0, 1, "root", 2) != derive_seed(0, 1, "root", 3)
    assert 0 <= derive_seed("x") < 2**63


def test_invalid_plan_settings_name_the_key():
    with pytest.raises(ValueError, match="rollout.kernel"):
        Chains(kernel="euler")
    with pytest.raises(ValueError, match="rollout.window.mode"):
        Chains(window=SDEWindow(mode="sliding"))
    with pytest.raises(ValueError, match="rollout.window.start"):
        Chains(steps=6, window=SDEWindow(mode="fixed", start=4, size=2))
    with pytest.raises(ValueError, match="rollout.group_size"):
        Chains(group_size=1)
    with pytest.raises(ValueError, match="rollout.eta=0.0 with rollout.shared_noise"):
        Chains(shared_noise=True, eta=0.0)
