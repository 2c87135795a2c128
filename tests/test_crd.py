"""Centered Reward Distillation (loss.objective: crd; arXiv 2603.14128, as its authors ship it in Flow-Factory)."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from flowrl.config.schema import ConfigError, TrainConfig
from flowrl.objectives.crd import CRDLoss
from flowrl.objectives.forward import Rows
from tests.conftest import make_model, perturb_lora, straight_and_resumed, update_gradient, with_lora
from tests.test_dgpo import hand_made, scored_forest

TINY = [
    "model.family=sd3",
    "model.lora.rank=2",
    "rollout.plan=ode",
    "rollout.group_size=3",
    "rollout.steps=3",
    "prompts.train=a red circle|two blue squares",
    "prompts.per_step=2",
    "prompts.eval=null",
    "train.progress=false",
    "train.checkpoint_every=0",
    "train.async_reward=false",
    "rewards=[{name: redness}]",
    "loss.objective=crd",
    "loss.draws=2",
]


def tiny(tmp_path, name, *extra):
    return TrainConfig.from_yaml(None, [*TINY, f"train.output_dir={tmp_path}", f"train.name={name}", *extra])


# ---- hand-made tensors: the loss and its gradient against the published formula ---------------------------------
def published(v, v_old, y, adv, spans, D, beta, form, adaptive, c=5.0):
    """Flow-Factory's CRD loss (trainers/crd.py, uniform centring), centred over each prompt group at each draw:
    r = −(e_θ/u_θ − e_old/u_old), a = clamp(clip(A, ±c)/c/2 + ½, 0, 1), loss = mean over (i, d) of
    (β·(r − sg r̄) − (a − ā))² (or BCE(β·(r − sg r̄), σ(a − ā))), times c/β."""
    L = adv.numel()
    e = ((v - y) ** 2).mean(dim=(1, 2, 3)).view(L, D)
    e_old = ((v_old - y) ** 2).mean(dim=(1, 2, 3)).view(L, D)
    if adaptive:
        e = e / (v - y).detach().abs().mean(dim=(1, 2, 3)).clamp(min=1e-5).view(L, D)
        e_old = e_old / (v_old - y).abs().mean(dim=(1, 2, 3)).clamp(min=1e-5).view(L, D)
    r = -(e - e_old)
    a = (adv.clamp(-c, c) / c / 2.0 + 0.5).clamp(0, 1)
    total = 0.0
    for lo, hi in spans.values():
        for d in range(D):
            r_c = r[lo:hi, d] - r[lo:hi, d].mean().detach()
            a_c = a[lo:hi] - a[lo:hi].mean()
            if form == "mse":
                total = total + ((beta * r_c - a_c) ** 2).sum()
            else:
                total = total + F.binary_cross_entropy_with_logits(beta * r_c, torch.sigmoid(a_c), reduction="sum")
    return total / (L * D) * c / beta


def crd_loss(obj, v, v_old, y, adv, batch):
    obj._updates = 0
    obj.forward_rows = lambda *a, **k: Rows(v, v_old, None, None, y, torch.full((v.shape[0],), 0.5), adv)
    return obj.loss(None, SimpleNamespace(advantage=adv), batch, None)


@pytest.mark.parametrize("form", ["mse", "bce"])
@pytest.mark.parametrize("adaptive", [True, False])
@pytest.mark.parametrize("groups", [(3, 2), (4,)])
def test_crd_loss_and_gradient_are_the_published_centred_regression(groups, adaptive, form):
    D, beta = 2, 2.0
    v, _, v_old, y, adv, batch = hand_made(groups, D, seed=1)
    obj = CRDLoss(beta=beta, loss_form=form, adaptive_weight=adaptive, draws=D)
    loss, diag = crd_loss(obj, v, v_old, y, adv, batch)
    loss.backward()
    got = v.grad.clone()
    v.grad = None
    want = published(v, v_old, y, adv, batch.extra["table"].spans, D, beta, form, adaptive)
    want.backward()
    assert loss.item() == pytest.approx(want.item(), rel=1e-5)
    assert torch.allclose(got, v.grad, atol=1e-7)
    assert diag["crd_loss"] == pytest.approx(want.item(), rel=1e-5)


def test_at_the_old_policy_the_gradient_pulls_good_samples_in_and_bad_ones_out():
    """r = 0 at v = v_old: the gradient is −2·ã·β·∇r·c/β, so the error of a sample above its group's mean target
    falls (towards y) and one below rises."""
    y = torch.zeros(2, 1, 1, 1)
    v = torch.full((2, 1, 1, 1), 0.5, requires_grad=True)
    *_, batch = hand_made((2,), 1)
    loss, _ = crd_loss(
        CRDLoss(draws=1, adaptive_weight=False), v, v.detach().clone(), y, torch.tensor([1.0, -1.0]), batch
    )
    loss.backward()
    assert v.grad[0].item() > 0 and v.grad[1].item() < 0  # gradient descent moves v0 towards y = 0, v1 away


def test_reward_adaptive_kl_is_flow_factorys_weight():
    obj = CRDLoss(teacher={"guidance": 3.0, "anchor": 0.1})
    adv = torch.tensor([-9.0, -2.5, 0.0, 2.5, 9.0])
    forest = SimpleNamespace(advantage=adv)
    w = obj.leaf_anchor(forest, torch.arange(5), torch.full((5,), 0.1), 0.1)
    a = (adv.clamp(-5, 5) / 5 / 2 + 0.5).clamp(0, 1)
    kl_beta, min_coef = 0.1, 1e-4 / 0.1  # trainers/crd.py: kl_beta·(min_coef + a·(1 − min_coef))
    assert torch.allclose(w, kl_beta * (min_coef + a * (1 - min_coef)))
    assert w[0].item() == pytest.approx(1e-4) and w[-1].item() == pytest.approx(0.1)


def test_old_copy_decay_is_the_linear_ramp_from_a_start():
    obj = CRDLoss()  # "0-0.25-0.005-0.999"
    assert [obj.decay(k) for k in (0, 1, 10, 149, 1000)] == pytest.approx([0.25, 0.255, 0.3, 0.995, 0.999])
    assert CRDLoss(old_decay_flat=75, old_decay_start=0.0, old_decay_rate=0.0075).decay(74) == 0.0


# ---- real forests: split groups centre like one forward -------------------------------------------------------
def test_a_group_cut_over_micro_batches_centres_as_one_forward():
    model = with_lora(make_model("sd3"))
    forest = scored_forest(model, group=4, steps=3)
    obj = CRDLoss(draws=2, beta=3.0)
    obj.setup(model)
    perturb_lora(model.trainable, seed=1, scale=0.05, part="lora_B.default")  # the policy moves from its old copy
    cond = obj.encode(model, forest)

    whole, g_whole, diag = update_gradient(obj, model, forest, cond, 64)
    split, g_split, _ = update_gradient(obj, model, forest, cond, 2)
    assert (whole, split) == (1, 8) and diag["implicit_reward_centred_abs"] > 0
    assert all(torch.allclose(a, b, atol=1e-6, rtol=1e-4) for a, b in zip(g_whole, g_split))


# ---- the loop: the CLI, resume -----------------------------------------------------------------------------
def test_the_shapes_preset_trains_one_iteration_through_the_cli(tmp_path):
    from flowrl.commands.main import main

    assert (
        main(
            [
                "train",
                "configs/shapes/crd.yaml",
                "rollout.steps=2",
                "rollout.group_size=2",
                "prompts.per_step=2",
                "prompts.train=a red circle|two blue squares",
                "prompts.eval=null",
                "train.max_steps=1",
                "train.checkpoint_every=0",
                "train.progress=false",
                "train.num_threads=1",
                f"train.output_dir={tmp_path}",
                "train.name=run",
            ]
        )
        == 0
    )
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    trained = [r for r in records if "crd_loss" in r]
    assert len(trained) == 1 and trained[0]["trained_leaves"] == 4 and trained[0]["grad_norm"] > 0
    assert trained[0]["anchor_weight"] == pytest.approx(0.1) and trained[0]["teacher_forwards"] > 0


def test_resume_equals_a_straight_run(tmp_path):
    straight, resumed = straight_and_resumed(
        lambda *o: tiny(tmp_path, *o),
        "optim.lr=1e-2",
        "train.checkpoint_every=1",
        "rollout.max_batch=2",
        "loss.teacher={guidance: 3.0, anchor: 0.1}",
    )
    assert "crd_loss" in resumed and resumed == straight


# ---- bad settings fail at load naming the key --------------------------------------------------------------
@pytest.mark.parametrize(
    "overrides, words",
    [
        (["loss.beta=0"], ["loss.beta=0", "> 0"]),
        (["loss.loss_form=l1"], ["loss.loss_form='l1'", "mse", "bce"]),
        (["loss.old_decay_start=1.5"], ["loss.old_decay_start=1.5", "[0, 1)"]),
        (["loss.old_decay_rate=0", "loss.old_decay_start=0.5"], ["loss.old_decay_start", "nothing reads it"]),
        (
            ["loss.teacher={guidance: 3.0, weighting: advantage}"],
            ["loss.teacher.weighting='advantage'", "loss.adaptive_kl"],
        ),
        (["loss.adaptive_kl=false"], ["loss.adaptive_kl", "nothing reads it"]),
        (["model.guidance=3"], ["loss.cfg='free'", "model.guidance=3"]),
        (["rollout.group_size=1"], ["rollout.group_size=1", ">= 2"]),
    ],
)
def test_bad_crd_settings_fail_at_load(tmp_path, overrides, words):
    with pytest.raises(ConfigError) as err:
        tiny(tmp_path, "bad", *overrides)
    for w in words:
        assert w in str(err.value), (w, str(err.value))
