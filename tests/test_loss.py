"""Independent tests of flowrl/objectives/policy.py against docs/algorithms.md, "The clipped objective" (and the
adaptive clip
of docs/trees.md, "Dynamic-TreeRPO's loss").

Reference: L = mean_e w_e·max(−A_e·r_e, −A_e·clip(r_e, 1−ε_low, 1+ε_high)) + β·mean_e w_e·KL_e with
A clipped to ±adv_clip, computed here in float64 numpy. (Edge weights default to 1; the spec's
"mean over trained edges" is the plain mean when all weights are 1.)
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from flowrl.objectives.policy import PolicyLoss


def ref_loss(logp, logp_old, adv, kl=None, w=None, clip_low=1e-4, clip_high=1e-4, adv_clip=5.0, beta=0.04):
    logp, logp_old, adv = (np.asarray(t, dtype=np.float64) for t in (logp, logp_old, adv))
    w = np.ones_like(logp) if w is None else np.asarray(w, dtype=np.float64)
    a = np.clip(adv, -adv_clip, adv_clip)
    r = np.exp(logp - logp_old)
    rc = np.clip(r, 1 - clip_low, 1 + clip_high)
    per = np.maximum(-a * r, -a * rc)
    loss = (w * per).mean()
    if kl is not None:
        loss += beta * (w * np.asarray(kl, dtype=np.float64)).mean()
    return loss


def _t(x):
    return torch.tensor(x, dtype=torch.float32)


def _f64(t):
    return t.detach().double().numpy()


def test_default_loss_matches_reference_with_advantage_clipping():
    g = torch.Generator().manual_seed(0)
    E = 12
    logp_old = -1.0 + 0.1 * torch.randn(E, generator=g)
    delta = torch.tensor([0.0, 5e-5, -5e-5, 3e-4, -3e-4, 2e-4, -2e-4, 1e-5, 8e-4, -8e-4, 0.0, 5e-4])
    logp = (logp_old + delta).requires_grad_(True)
    adv = _t([1.0, -2.0, 0.5, 7.0, -9.0, -1.5, 2.5, 0.0, -6.0, 6.0, 3.0, -0.7])  # ±7, ±9, ±6 get clipped to ±5
    kl = _t(np.abs(np.linspace(0.0, 0.3, E)))
    loss, diag = PolicyLoss()(logp, logp_old, adv, kl)
    expected = ref_loss(_f64(logp), _f64(logp_old), _f64(adv), _f64(kl))
    assert loss.ndim == 0
    assert loss.item() == pytest.approx(expected, rel=1e-6, abs=1e-6)
    # the same without advantage clipping would differ noticeably
    unclipped = ref_loss(_f64(logp), _f64(logp_old), _f64(adv), _f64(kl), adv_clip=1e9)
    assert abs(unclipped - expected) > 1e-2
    assert float(diag["kl"]) == pytest.approx(float(kl.double().mean()), rel=1e-6)
    assert float(diag["policy_loss"]) == pytest.approx(
        ref_loss(_f64(logp), _f64(logp_old), _f64(adv)), rel=1e-6, abs=1e-6
    )


def test_beta_times_mean_kl_is_added():
    logp_old = _t([-0.5, -0.7, -0.2])
    logp = logp_old.clone().requires_grad_(True)
    adv = _t([1.0, -1.0, 2.0])
    kl = _t([0.3, 0.1, 0.8])
    base, _ = PolicyLoss(kl_ref=0.0)(logp, logp_old, adv, kl)
    with_kl, _ = PolicyLoss(kl_ref=0.25)(logp, logp_old, adv, kl)
    no_kl_arg, _ = PolicyLoss(kl_ref=0.25)(logp, logp_old, adv)
    assert base.item() == pytest.approx(-2.0 / 3.0, rel=1e-6)  # ratio 1: mean(−A)
    assert with_kl.item() == pytest.approx(-2.0 / 3.0 + 0.25 * 1.2 / 3.0, rel=1e-6)
    assert no_kl_arg.item() == pytest.approx(-2.0 / 3.0, rel=1e-6)


def _quadrant_batch():
    """Ratios around the asymmetric bounds (ε_low 0.2 → 0.8, ε_high 0.28 → 1.28) for both signs of A."""
    r = np.array([1.5, 0.6, 0.6, 1.5, 1.25, 1.25, 0.85, 0.79, 0.79, 1.0])
    a = np.array([1.0, 1.0, -1.0, -1.0, 2.0, -2.0, 1.5, -0.5, 0.5, 1.0])
    # binding-side clipped: (A>0, r>1+εh) and (A<0, r<1−εl)
    binding = np.array([True, False, True, False, False, False, False, True, False, False])
    return r, a, binding


def test_asymmetric_clip_value_and_gradient():
    r, a, binding = _quadrant_batch()
    logp_old = _t(np.linspace(-1.0, -0.2, r.size))
    logp = (logp_old + _t(np.log(r))).detach().requires_grad_(True)
    adv = _t(a)
    pl = PolicyLoss(clip_low=0.2, clip_high=0.28, adv_clip=5.0, kl_ref=0.0)
    loss, diag = pl(logp, logp_old, adv)
    lp, lo = _f64(logp), _f64(logp_old)
    assert loss.item() == pytest.approx(ref_loss(lp, lo, a, clip_low=0.2, clip_high=0.28, beta=0.0), rel=1e-6)
    # symmetric 0.2 would clip r = 1.25: the asymmetric value must differ from it
    assert abs(ref_loss(lp, lo, a, clip_low=0.2, clip_high=0.2) - loss.item()) > 1e-3
    loss.backward()
    ratio = np.exp(lp - lo)
    expected_grad = np.where(binding, 0.0, -a * ratio / r.size)  # d/dlogp of −A·r/E, or 0 when clipped
    np.testing.assert_allclose(_f64(logp.grad), expected_grad, rtol=1e-5, atol=1e-7)
    assert torch.all(logp.grad[torch.from_numpy(binding)] == 0), "clipped edges on the binding side get no gradient"
    assert torch.all(logp.grad[torch.from_numpy(~binding)] != 0)
    # diagnostics
    E = r.size
    assert float(diag["clipfrac_high"]) == pytest.approx(np.sum(ratio > 1.28) / E)  # 1.5, 1.5
    assert float(diag["clipfrac_low"]) == pytest.approx(np.sum(ratio < 0.8) / E)  # 0.6, 0.6, 0.79, 0.79
    assert float(diag["clipfrac_high"]) == pytest.approx(0.2) and float(diag["clipfrac_low"]) == pytest.approx(0.4)
    assert float(diag["ratio_min"]) == pytest.approx(0.6, rel=1e-5)
    assert float(diag["ratio_max"]) == pytest.approx(1.5, rel=1e-5)
    assert float(diag["ratio_mean"]) == pytest.approx(ratio.mean(), rel=1e-5)
    d = lp - lo
    assert float(diag["approx_kl"]) == pytest.approx(0.5 * np.mean(d**2), rel=1e-5)
    assert float(diag["abs_delta_logp"]) == pytest.approx(np.abs(d).max(), rel=1e-5)


def test_default_tiny_clip_gradient_zero_on_binding_side():
    """Flow-GRPO's ε = 1e-4 with per-element-mean log-probs: |Δ| = 3e-4 is clipped."""
    logp_old = _t([-0.9, -0.9, -0.9, -0.9, -0.9])
    delta = _t([3e-4, -3e-4, 3e-4, -3e-4, 5e-5])
    logp = (logp_old + delta).detach().requires_grad_(True)
    adv = _t([1.0, -1.0, -1.0, 1.0, 1.0])
    loss, _ = PolicyLoss(kl_ref=0.0)(logp, logp_old, adv)
    loss.backward()
    g = logp.grad
    assert g[0] == 0 and g[1] == 0, "A>0 with r > 1+ε and A<0 with r < 1−ε must be clipped (zero gradient)"
    r = np.exp(_f64(logp) - _f64(logp_old))
    np.testing.assert_allclose(_f64(g[2:]), -np.array([-1.0, 1.0, 1.0]) * r[2:] / 5, rtol=1e-5)


def test_weights_multiply_each_edge_term():
    logp_old = _t([-1.0, -1.0, -1.0, -1.0])
    logp = (logp_old + _t([0.05, -0.05, 0.0, 0.02])).detach().requires_grad_(True)
    adv = _t([1.0, 2.0, -1.0, 0.5])
    kl = _t([0.2, 0.4, 0.6, 0.8])
    w = _t([1.0, 0.5, 2.0, 1.0])
    pl = PolicyLoss(clip_low=0.1, clip_high=0.1, kl_ref=0.1)
    loss, _ = pl(logp, logp_old, adv, kl, w)
    expected = ref_loss(_f64(logp), _f64(logp_old), _f64(adv), _f64(kl), _f64(w), clip_low=0.1, clip_high=0.1, beta=0.1)
    assert loss.item() == pytest.approx(expected, rel=1e-6)
    ones, _ = pl(logp, logp_old, adv, kl, torch.ones(4))
    none, _ = pl(logp, logp_old, adv, kl)
    assert ones.item() == pytest.approx(none.item(), rel=1e-7)


def test_ratio_one_first_inner_step():
    logp_old = _t([-0.3, -1.2, -2.5])
    logp = logp_old.clone().requires_grad_(True)
    adv = _t([0.5, -1.0, 2.0])
    loss, diag = PolicyLoss(kl_ref=0.0)(logp, logp_old, adv)
    assert float(diag["abs_delta_logp"]) == 0.0
    assert float(diag["approx_kl"]) == 0.0
    assert float(diag["clipfrac_high"]) == 0.0 and float(diag["clipfrac_low"]) == 0.0
    assert float(diag["ratio_min"]) == 1.0 and float(diag["ratio_max"]) == 1.0 and float(diag["ratio_mean"]) == 1.0
    assert loss.item() == pytest.approx(-np.mean([0.5, -1.0, 2.0]), rel=1e-6)
    loss.backward()
    np.testing.assert_allclose(_f64(logp.grad), -np.array([0.5, -1.0, 2.0]) / 3, rtol=1e-6)
    for v in diag.values():
        assert not v.requires_grad


def test_adaptive_clip_widens_bound_with_advantage():
    """Adaptive clip (docs/trees.md, "Dynamic-TreeRPO's loss"):
    ε_high(A) = ε·(1 + κ·max(A,0)/adv_clip), ε_low(A) = ε·(1 + κ·max(−A,0)/adv_clip)."""
    eps, kappa, adv_clip = 0.1, 1.0, 5.0
    # A = 5 → ε_high 0.2: r = 1.15 is inside; A = −5 → ε_low 0.2: r = 0.85 inside; A = 2.5 → ε_high 0.15: r = 1.18
    # clipped
    # last edge: A = −5 with r = 1.15 (the non-binding side: the high bound stays ε, so it counts as clipped high)
    r = np.array([1.15, 0.85, 1.18, 0.85, 1.15])
    a = np.array([5.0, -5.0, 2.5, -1.0, -5.0])
    logp_old = _t([-1.0] * 5)
    logp = (logp_old + _t(np.log(r))).detach().requires_grad_(True)
    pl = PolicyLoss(clip_low=eps, clip_high=eps, adv_clip=adv_clip, kl_ref=0.0, adaptive_kappa=kappa)
    loss, diag = pl(logp, logp_old, _t(a))
    loss.backward()
    ratio = np.exp(_f64(logp) - _f64(logp_old))
    hi = eps * (1 + kappa * np.maximum(a, 0) / adv_clip)
    lo = eps * (1 + kappa * np.maximum(-a, 0) / adv_clip)
    per = np.maximum(-a * ratio, -a * np.clip(ratio, 1 - lo, 1 + hi))
    assert loss.item() == pytest.approx(per.mean(), rel=1e-6)
    g = _f64(logp.grad)
    assert g[0] != 0 and g[1] != 0, "widened bounds must leave these edges unclipped"
    assert g[2] == 0 and g[3] == 0, "beyond the widened bound (A=2.5) / the base bound (A=−1) the edge is clipped"
    assert g[4] != 0
    assert float(diag["clipfrac_high"]) == pytest.approx(np.mean(ratio > 1 + hi))  # edges 2 and 4
    assert float(diag["clipfrac_low"]) == pytest.approx(np.mean(ratio < 1 - lo))  # edge 3
    assert float(diag["clipfrac_high"]) == pytest.approx(0.4) and float(diag["clipfrac_low"]) == pytest.approx(0.2)


@pytest.mark.parametrize(
    "kwargs,key",
    [
        ({"clip_low": 0.0}, "clip_low"),
        ({"clip_low": -1e-4}, "clip_low"),
        ({"clip_high": 0.0}, "clip_high"),
        ({"clip_high": -0.2}, "clip_high"),
        ({"kl_form": "reverse"}, "kl_form"),
        ({"kl_ref": -0.1}, "kl_ref"),
        ({"reduction": "max"}, "reduction"),
        ({"adaptive_kappa": -2.0}, "adaptive_kappa"),
    ],
)
def test_bad_arguments_raise_naming_the_key(kwargs, key):
    with pytest.raises(ValueError, match=key):
        PolicyLoss(**kwargs)


def test_layer_tuning_term_is_the_same_in_any_chunking_and_skips_flat_groups():
    """The LayerTuning term (value and LoRA gradient) does not depend on ``micro_batch`` (rows per forward:
    ``rollout.max_batch``); a prompt group
    whose leaves all score the same has weight 0 and adds nothing."""
    from conftest import make_model, with_lora

    from flowrl.objectives.policy import LayerTuningLoss
    from flowrl.rollout.base import RolloutContext
    from flowrl.rollout.tree import Tree

    model = with_lora(make_model("sd3"))
    forest = Tree(steps=4, split_steps=[0, 1], kernel="dance", eta=0.5).rollout(
        model, ["a red circle", "two blue squares"], RolloutContext(seed=0)
    )
    leaves = forest.leaves()
    forest.reward[leaves] = torch.tensor([0.1, 0.9, 0.3, 0.2, 0.5, 0.5, 0.5, 0.5])  # group 1 is flat
    cond = model.encode(forest.prompts, forest.guidance)

    def term(micro_batch: int):
        model.trainable.zero_grad()
        loss, diag = LayerTuningLoss(layer_lambda=1.0, micro_batch=micro_batch).auxiliary(model, forest, cond)
        loss.backward()
        return loss.detach(), diag, [p.grad.clone() for p in model.trainable.parameters() if p.grad is not None]

    whole, diag, grads = term(64)
    chunked, _, grads_chunked = term(1)
    torch.testing.assert_close(chunked, whole, rtol=1e-5, atol=1e-7)
    for a, b in zip(grads, grads_chunked):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-7)
    r = torch.tensor([0.1, 0.9, 0.3, 0.2], dtype=torch.float64)  # group 0 only
    w = float(((r.max() - r.mean()) / (r.std(unbiased=False) + 1e-4)).clamp(0, 3)) / 3
    assert float(diag["layer_tuning_weight"]) == pytest.approx(w, rel=1e-6)
    forest.reward[leaves] = 0.5
    assert LayerTuningLoss().auxiliary(model, forest, cond) is None


def test_layer_tuning_regresses_the_conditional_velocity_at_any_guidance():
    """The term fits v_θ(x_σ, σ, prompt) to ε − x0* as flow-matching training does: the rollout's CFG scale
    does not enter it (regressing the CFG-composed velocity onto an unguided target collapsed the shapes
    model at guidance 3)."""
    from conftest import make_model, with_lora

    from flowrl.objectives.policy import LayerTuningLoss
    from flowrl.rollout.base import RolloutContext
    from flowrl.rollout.tree import Tree

    model = with_lora(make_model("sd3"))
    forest = Tree(steps=4, split_steps=[0, 1], kernel="dance", eta=0.5).rollout(
        model, ["a red circle", "two blue squares"], RolloutContext(seed=0)
    )
    forest.reward[forest.leaves()] = torch.tensor([0.1, 0.9, 0.3, 0.2, 0.5, 0.1, 0.5, 0.8])
    terms = {}
    for g in (1.0, 3.0):
        forest.guidance = g
        terms[g] = LayerTuningLoss(layer_lambda=1.0).auxiliary(model, forest, model.encode(forest.prompts, g))[0]
    assert float(terms[1.0]) > 0
    torch.testing.assert_close(terms[3.0], terms[1.0], rtol=1e-5, atol=1e-7)
