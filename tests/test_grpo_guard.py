"""GRPO-Guard (flowrl/objectives/grpo_guard.py) against its published form (arXiv 2510.22319; Flow-Factory's
and verl-omni's ``grpo_guard`` losses): log r̃ = s·(logp_θ − logp_old) + mean(‖μ_θ − μ_old‖²)/(2s) with s the
transition std, L = mean_e w_e·δ_e·max(−A_e·r̃_e, −A_e·clip(r̃_e, 1−ε_low, 1+ε_high)) + β·mean_e w_e·KL_e with
δ_e = 1/|dt_e|. The reference below writes that form out in float64 (Gaussian log-densities with constants), not the
ξ·Δμ form the class computes.
"""

from __future__ import annotations

import json
import math
import re

import pytest
import torch

from flowrl.config.schema import ConfigError, TrainConfig
from flowrl.objectives.grpo_guard import GRPOGuardLoss
from tests.conftest import make_model, perturb_lora, straight_and_resumed, with_lora

TINY = [
    "model.family=sd3",
    "model.lora.rank=2",
    "rollout.plan=chains",
    "rollout.group_size=2",
    "rollout.steps=3",
    "rollout.window.mode=all",
    "prompts.train=a red circle|two blue squares",
    "prompts.per_step=2",
    "prompts.eval=null",
    "train.progress=false",
    "train.checkpoint_every=0",
    "train.async_reward=false",
    "rewards=[{name: redness}]",
    "loss.objective=grpo_guard",
]


def tiny(tmp_path, name, *extra):
    return TrainConfig.from_yaml(None, [*TINY, f"train.output_dir={tmp_path}", f"train.name={name}", *extra])


def gauss_logp(x, mu, s, reduction):
    """Gaussian log-density per row, constants kept, reduced over the latent elements [E]."""
    lp = -((x - mu) ** 2) / (2 * s**2) - torch.log(s) - 0.5 * math.log(2 * math.pi)
    return lp.flatten(1).mean(1) if reduction == "mean" else lp.flatten(1).sum(1)


def published_loss(mean, mean_old, x, s, dt, adv, kl, w, reweight, reduction, lo, hi, beta, adv_clip=5.0):
    """The published normalised-ratio loss, float64 (see the module docstring)."""
    sb = s.view(-1, 1, 1, 1)
    drift = (mean - mean_old) ** 2
    drift = drift.flatten(1).mean(1) if reduction == "mean" else drift.flatten(1).sum(1)
    log_r = s * (gauss_logp(x, mean, sb, reduction) - gauss_logp(x, mean_old, sb, reduction)) + drift / (2 * s)
    r = torch.exp(log_r)
    a = adv.clamp(-adv_clip, adv_clip)
    per = torch.maximum(-a * r, -a * r.clamp(1 - lo, 1 + hi))
    delta = 1 / dt.abs() if reweight == "dt" else torch.ones_like(dt)
    return (w * delta * per).mean() + beta * (w * kl).mean(), log_r


@pytest.mark.parametrize("reweight", ["dt", "none"])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_loss_and_gradient_equal_the_published_normalised_ratio(reweight, reduction):
    g = torch.Generator().manual_seed(0)
    E, shape = 8, (2, 3, 3)
    n = math.prod(shape)
    mean_old = torch.randn(E, *shape, generator=g, dtype=torch.float64)
    s = torch.linspace(0.05, 0.6, E, dtype=torch.float64)  # every step its own std
    x = mean_old + s.view(-1, 1, 1, 1) * torch.randn(E, *shape, generator=g, dtype=torch.float64)
    # mean shifts of several sizes: some ratios inside the clip band, some beyond it on either side
    scale = torch.tensor([0.0, 1e-4, 3e-4, 1e-3, 3e-3, 1e-2, 3e-2, 0.1], dtype=torch.float64)
    scale = scale / (1.0 if reduction == "mean" else n)
    drift = scale.view(-1, 1, 1, 1) * torch.randn(E, *shape, generator=g, dtype=torch.float64)
    dt = -torch.linspace(0.05, 0.3, E, dtype=torch.float64)
    adv = torch.tensor([1.0, -2.0, 0.5, 7.0, -9.0, -1.5, 2.5, -0.7], dtype=torch.float64)  # ±7, ±9 get clipped to ±5
    kl = torch.linspace(0.0, 0.3, E, dtype=torch.float64)
    w = torch.tensor([1.0, 1.0, 0.5, 1.0, 2.0, 1.0, 1.0, 0.0], dtype=torch.float64)
    obj = GRPOGuardLoss(clip_low=1e-3, clip_high=2e-3, kl_ref=0.04, reweight=reweight)

    ref_mean = (mean_old + drift).requires_grad_(True)
    expected, ref_log_r = published_loss(
        ref_mean, mean_old, x, s, dt, adv, kl, w, reweight, reduction, 1e-3, 2e-3, 0.04
    )
    (expected_grad,) = torch.autograd.grad(expected, ref_mean)

    mean = (mean_old + drift).float().requires_grad_(True)
    loss, diag = obj.guarded(
        mean,
        mean_old.float(),
        x.float(),
        s.float(),
        dt.float(),
        adv.float(),
        kl.float(),
        w.float(),
        reduction=reduction,
    )
    loss.backward()
    assert loss.item() == pytest.approx(expected.item(), rel=1e-5, abs=1e-7)
    torch.testing.assert_close(
        mean.grad.double(), expected_grad, rtol=1e-4, atol=1e-7 * expected_grad.abs().max().item()
    )
    r = torch.exp(ref_log_r)
    assert 0 < float(diag["clipfrac_high"] + diag["clipfrac_low"]) < 1  # the data reaches both regimes
    assert float(diag["clipfrac_high"]) == pytest.approx(float((r > 1 + 2e-3).double().mean()))
    assert float(diag["abs_delta_logp"]) == pytest.approx(float(ref_log_r.detach().abs().max()), rel=1e-4)
    assert float(diag["kl"]) == pytest.approx(float((w * kl).mean()), rel=1e-6)


def test_normalisation_removes_the_bias_and_the_per_step_scale_of_the_raw_ratio():
    """E[log r] = −mean(Δμ²)/(2s²) < 0 with a spread ∝ 1/s; log r̃ is centred with a spread that does not depend on s."""
    g = torch.Generator().manual_seed(1)
    N, shape = 4000, (4, 4)
    drift = 0.05 * torch.randn(1, *shape, generator=g).expand(N, *shape)
    obj = GRPOGuardLoss()
    spreads = []
    for s in (0.1, 0.4):
        std = torch.full((N,), s)
        x = s * torch.randn(N, *shape, generator=g)  # μ_old = 0
        raw = gauss_logp(x.double(), drift.double(), std.double().view(-1, 1, 1), "mean") - gauss_logp(
            x.double(), torch.zeros_like(x).double(), std.double().view(-1, 1, 1), "mean"
        )
        bias = float((drift[0] ** 2).mean()) / (2 * s * s)
        assert float(raw.mean()) == pytest.approx(-bias, rel=0.1)
        normed = obj.normalised_log_ratio(drift, torch.zeros_like(x), x, std)
        assert abs(float(normed.mean())) < 4 * float(normed.std()) / math.sqrt(N)
        spreads.append((float(raw.std()), float(normed.std())))
    assert spreads[0][0] / spreads[1][0] == pytest.approx(4.0, rel=0.1)  # raw: ∝ 1/s
    assert spreads[0][1] / spreads[1][1] == pytest.approx(1.0, rel=0.1)  # normalised: the same at every step


def test_the_rollout_weights_give_mu_old_after_an_optimizer_step():
    """Before the iteration's first step μ_old is the replay's own mean (ratio exactly 1); after a step it comes from
    the kept rollout weights, not the moved policy; the next iteration's begin_iteration moves the kept copy to the
    weights."""
    from flowrl.objectives.replay import replay
    from flowrl.rollout.base import RolloutContext
    from flowrl.rollout.chains import Chains

    model = with_lora(make_model("sd3"))
    plan = Chains(group_size=2, steps=3, window={"mode": "all"})
    forest = plan.rollout(model, ["a red circle", "a dog"], RolloutContext(seed=3))
    forest.advantage[forest.edges()] = torch.linspace(-1.0, 1.0, forest.edges().numel())
    obj = GRPOGuardLoss(kl_ref=0.0)
    obj.setup(model)
    obj.begin_iteration(model, forest)
    cond = obj.encode(model, forest)
    batch = obj.batches(forest)[0]
    seen = {}
    guarded = obj.guarded
    obj.guarded = lambda mean, mean_old, *a, **k: (
        seen.update(mean_old=mean_old.clone()) or guarded(mean, mean_old, *a, **k)
    )
    _, diag = obj.loss(model, forest, batch, cond)
    assert float(diag["abs_delta_logp"]) == 0.0
    rollout_mean = replay(model, forest, cond, batch.index).mean.detach()
    perturb_lora(model.trainable, seed=4, scale=0.1, part=".default.")  # an optimizer step (the policy's adapter)
    obj.after_update(model)
    _, diag = obj.loss(model, forest, batch, cond)
    torch.testing.assert_close(seen["mean_old"], rollout_mean)
    assert float(diag["abs_delta_logp"]) > 0
    fresh = plan.rollout(model, ["a red circle", "a dog"], RolloutContext(seed=3, iteration=1))
    obj.begin_iteration(model, fresh)
    _, diag = obj.loss(model, fresh, obj.batches(fresh)[0], obj.encode(model, fresh))
    assert float(diag["abs_delta_logp"]) == 0.0  # the kept copy followed the weights to the new iteration


def test_frozen_copies_are_declared():
    assert GRPOGuardLoss(kl_ref=0.0).describe().frozen_copies == ("old",)
    assert GRPOGuardLoss(kl_ref=0.04).describe().frozen_copies == ("reference", "old")
    facts = GRPOGuardLoss().describe()
    assert facts.reward_free_overrides is None and facts.no_reward_free_point is not None


def test_the_shapes_preset_trains_one_iteration_through_the_cli(tmp_path):
    from flowrl.commands.main import main

    assert (
        main(
            [
                "train",
                "configs/shapes/grpo_guard.yaml",
                "train.max_steps=1",
                "train.inner_epochs=2",
                "prompts.per_step=2",
                "rollout.group_size=2",
                "prompts.eval=null",
                "train.checkpoint_every=0",
                "train.progress=false",
                "train.num_threads=1",
                f"train.output_dir={tmp_path}",
                "train.name=guard",
            ]
        )
        == 0
    )
    records = [json.loads(line) for line in (tmp_path / "guard" / "metrics.jsonl").read_text().splitlines()]
    record = next(r for r in records if "reward_mean" in r)
    assert record["first_step_abs_delta_logp"] == 0.0 and record["trained_edges"] > 0
    assert math.isfinite(record["grad_norm"]) and "raw_delta_logp" in record


def test_resume_equals_a_straight_run(tmp_path):
    straight, resumed = straight_and_resumed(
        lambda *o: tiny(tmp_path, *o),
        "optim.lr=1e-2",
        "train.checkpoint_every=1",
        "train.inner_epochs=2",
        "loss.kl_ref=0.04",
    )
    assert resumed == straight
    assert straight["abs_delta_logp"] > 0  # the second inner epoch replayed at moved weights


@pytest.mark.parametrize(
    "overrides, words",
    [
        (["rollout.plan=ode"], ["loss.objective='grpo_guard'", "rollout.plan='ode'", "deterministic ODE"]),
        (["loss.reweight=sigma"], ["loss.reweight='sigma'", "accepted", "dt", "none"]),
        (["loss.clip_low=0"], ["loss.clip_low=0"]),
        (["loss.kl_ref=0", "loss.kl_form=flow_grpo"], ["loss.kl_form is set but nothing reads it"]),
    ],
)
def test_refused_combinations_fail_at_load_naming_the_key(tmp_path, overrides, words):
    chains_only = ["rollout.window.mode=all"] if "rollout.plan=ode" in overrides else []  # the ODE plan has no window
    with pytest.raises(ConfigError) as err:
        TrainConfig.from_yaml(None, [*(o for o in TINY if o not in chains_only), *overrides])
    for w in words:
        assert re.search(re.escape(w), str(err.value)), (w, str(err.value))
