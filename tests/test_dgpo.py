"""DGPO (loss.objective: dgpo; arXiv 2510.08425) and the group-aligned forward process it shares with CRD."""

from __future__ import annotations

import json

import pytest
import torch

from flowrl.config.schema import ConfigError, TrainConfig
from flowrl.objectives.dgpo import DGPOLoss, GroupedForward, GroupTable
from flowrl.objectives.forward import Rows
from tests.conftest import make_model, perturb_lora, spy_velocity, straight_and_resumed, update_gradient, with_lora

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
    "loss.objective=dgpo",
    "loss.draws=2",
]


def tiny(tmp_path, name, *extra):
    return TrainConfig.from_yaml(None, [*TINY, f"train.output_dir={tmp_path}", f"train.name={name}", *extra])


# ---- hand-made tensors: the loss and its gradient against the published formula ---------------------------------
def hand_made(groups, D, seed=0):
    """Rows of groups of ``groups`` leaves at ``D`` draws: (v [R] leaf with grad, v_ref, v_old, y, adv [L], batch)."""
    gen = torch.Generator().manual_seed(seed)
    L = sum(groups)
    shape = (L * D, 2, 2, 2)
    y = torch.randn(shape, generator=gen)
    v = (y + 0.7 * torch.randn(shape, generator=gen)).requires_grad_(True)
    v_ref = y + 0.7 * torch.randn(shape, generator=gen)
    v_old = v.detach() + 0.3 * torch.randn(shape, generator=gen)
    adv = torch.randn(L, generator=gen)
    spans, start = {}, 0
    for g, n in enumerate(groups):
        spans[g], start = (start, start + n), start + n
    table = GroupTable(
        torch.arange(L),
        torch.full((L * D,), 0.5),
        torch.zeros(shape),
        None,
        spans,
        {"teacher_cond": None, "anchor_weight": None},
    )
    return v, v_ref, v_old, y, adv, table.batch(0, L, D)


def dgpo_loss(obj, v, v_ref, v_old, y, adv, batch):
    obj._updates = 0
    obj.forward_rows = lambda *a, **k: Rows(v, v_old, v_ref, None, y, torch.full((v.shape[0],), 0.5), adv)
    return obj.loss(None, None, batch, None)


def published(v, v_ref, v_old, y, adv, spans, D, beta, clip):
    """The public code's surrogate, written out: per group g and draw d, S = β/n_g Σ_i A_i (e_i − e_ref,i) (no
    gradient), loss = mean over (i, d) of σ(S)·A_i·ẽ_i with ẽ detached where PPO's clip binds."""
    L = adv.numel()
    e = ((v - y) ** 2).mean(dim=(1, 2, 3)).view(L, D)
    e_ref = ((v_ref - y) ** 2).mean(dim=(1, 2, 3)).view(L, D)
    e_old = ((v_old - y) ** 2).mean(dim=(1, 2, 3)).view(L, D)
    total = 0.0
    for a, b in spans.values():
        for d in range(D):
            S = beta * sum(adv[i] * (e[i, d] - e_ref[i, d]) for i in range(a, b)).detach() / (b - a)
            for i in range(a, b):
                ratio = torch.exp(e_old[i, d] - e[i, d]).detach()
                hit = clip > 0 and bool(ratio > 1 + clip if adv[i] > 0 else ratio < 1 - clip)
                total = total + torch.sigmoid(S) * adv[i] * (e[i, d].detach() if hit else e[i, d])
    return total / (L * D)


@pytest.mark.parametrize("clip", [0.0, 0.05])
@pytest.mark.parametrize("groups", [(3, 2), (4,)])
def test_dgpo_loss_and_gradient_are_the_published_group_weighted_errors(groups, clip):
    D, beta = 2, 3.0
    v, v_ref, v_old, y, adv, batch = hand_made(groups, D)
    obj = DGPOLoss(beta=beta, clip=clip, kl_ref=0.0, draws=D)
    loss, diag = dgpo_loss(obj, v, v_ref, v_old, y, adv, batch)
    loss.backward()
    got = v.grad.clone()
    v.grad = None
    want = published(v, v_ref, v_old, y, adv, batch.extra["table"].spans, D, beta, clip)
    want.backward()
    assert loss.item() == pytest.approx(want.item(), rel=1e-5)
    assert torch.allclose(got, v.grad, atol=1e-7)
    if clip:
        assert 0 < diag["clipfrac"] < 1  # some rows clipped (no gradient), some not


def test_dgpo_gradient_is_the_group_preference_likelihoods_up_to_a_constant():
    """With equal groups, ∇loss = n/(β·L·D)·∇Σ_{g,d} −log σ(−S_g,d), S = β·mean_g A·(e − e_ref) with gradient:
    the paper's maximum likelihood of G⁺ ≻ G⁻ (R_θ(G⁺) − R_θ(G⁻) = −S)."""
    D, beta, n = 2, 5.0, 3
    v, v_ref, v_old, y, adv, batch = hand_made((n, n), D, seed=3)
    loss, _ = dgpo_loss(DGPOLoss(beta=beta, clip=0.0, kl_ref=0.0, draws=D), v, v_ref, v_old, y, adv, batch)
    loss.backward()
    got = v.grad.clone()
    v.grad = None
    e = ((v - y) ** 2).mean(dim=(1, 2, 3)).view(-1, D)
    e_ref = ((v_ref - y) ** 2).mean(dim=(1, 2, 3)).view(-1, D)
    nll = sum(
        -torch.nn.functional.logsigmoid(-beta * (adv[a:b, None] * (e[a:b] - e_ref[a:b])).mean(0)).sum()
        for a, b in ((0, n), (n, 2 * n))
    )
    nll.backward()
    assert torch.allclose(got, v.grad * n / (beta * 2 * n * D), atol=1e-7)


def test_a_group_the_policy_already_prefers_weighs_little():
    """σ(S) → 0 when the policy's errors already favour the group's good samples over the reference's."""
    D = 1
    y = torch.zeros(2, 1, 1, 1)
    v_ref = torch.ones(2, 1, 1, 1)
    good = torch.tensor([[[[0.1]]], [[[1.9]]]], requires_grad=True)  # sample 0 (A > 0) fitted, sample 1 (A < 0) not
    adv = torch.tensor([1.0, -1.0])
    *_, batch = hand_made((2,), D)
    _, diag = dgpo_loss(DGPOLoss(beta=10.0, clip=0.0, kl_ref=0.0, draws=D), good, v_ref, good.detach(), y, adv, batch)
    assert diag["group_weight"] < 1e-6
    bad = torch.tensor([[[[1.9]]], [[[0.1]]]], requires_grad=True)
    _, diag = dgpo_loss(DGPOLoss(beta=10.0, clip=0.0, kl_ref=0.0, draws=D), bad, v_ref, bad.detach(), y, adv, batch)
    assert diag["group_weight"] > 1 - 1e-6


def test_group_aligned_cuts():
    obj = DGPOLoss(draws=2)
    obj.micro_batch = 6  # 3 leaves per forward
    assert obj.cuts({0: (0, 3), 1: (3, 5), 2: (5, 6)}) == [(0, 3), (3, 6)]
    assert obj.cuts({0: (0, 7), 1: (7, 8)}) == [(0, 3), (3, 6), (6, 8)]  # a big group in chunks, the next beside


# ---- real forests: shared noise, sampler levels, split groups --------------------------------------------------
def scored_forest(model, prompts=("a red circle", "two blue squares"), group=3, steps=4, seed=5):
    from flowrl.credit.group import GroupAdvantage
    from flowrl.rollout.base import RolloutContext
    from flowrl.rollout.chains import ODEChains

    forest = ODEChains(group_size=group, steps=steps).rollout(
        model, list(prompts), RolloutContext(seed=seed, iteration=0)
    )
    leaves = forest.leaves()
    forest.reward[leaves] = torch.rand(leaves.numel(), generator=torch.Generator().manual_seed(seed))
    GroupAdvantage(scale="group").assign(forest)
    return forest


def test_a_group_shares_its_noise_and_timesteps_at_each_draw(sd3_model):
    forest = scored_forest(sd3_model, group=3, steps=4)
    obj = DGPOLoss(draws=3, level_fraction=0.5)
    batches = obj.batches(forest, iteration=2, seed=9)
    assert len(batches) == 1 and batches[0].size == 6  # 2 groups × 3 leaves × 3 draws = 18 rows ≤ 64: one forward
    b = batches[0]
    group = forest.group[b.index]
    noise, t = b.extra["noise"].view(6, 3, -1), b.extra["t"].view(6, 3)
    levels = torch.unique(forest.sigma[forest.sigma > 0]).clamp(1e-4, 1 - 1e-4)
    assert set(t.flatten().tolist()) <= set(levels[-2:].tolist())  # the highest half of 4 levels
    for g in (0, 1):
        mine = (group == g).nonzero().flatten()
        assert all(torch.equal(noise[i], noise[mine[0]]) and torch.equal(t[i], t[mine[0]]) for i in mine)
        assert not torch.equal(noise[mine[0], 0], noise[mine[0], 1])  # a fresh ε per draw
    assert not torch.equal(noise[group == 0][0], noise[group == 1][0])
    again = obj.batches(forest, iteration=2, seed=9)[0]
    assert torch.equal(again.extra["noise"], b.extra["noise"])  # addressed, not drawn from a global RNG
    free = DGPOLoss(draws=3, share_noise=False).batches(forest, iteration=2, seed=9)[0].extra["noise"].view(6, 3, -1)
    assert not torch.equal(free[0], free[1])


@pytest.mark.parametrize("reference", ["initial", "old"])
def test_a_group_cut_over_micro_batches_trains_as_one_forward(reference):
    model = with_lora(make_model("sd3"))
    forest = scored_forest(model, group=4, steps=3)
    obj = DGPOLoss(draws=2, reference=reference, clip=0.0, beta=50.0, kl_ref=0.0, level_fraction=1.0)
    obj.setup(model)
    perturb_lora(model.trainable, seed=1, scale=0.05, part="lora_B.default")  # the policy moves from its copies
    cond = obj.encode(model, forest)

    whole, g_whole, diag = update_gradient(obj, model, forest, cond, 64)
    split, g_split, _ = update_gradient(
        obj, model, forest, cond, 2
    )  # one leaf per forward: every group completed without gradient
    assert (whole, split) == (1, 8) and diag["group_weight"] != 0.5
    assert all(torch.allclose(a, b, atol=1e-6, rtol=1e-4) for a, b in zip(g_whole, g_split))


# ---- the loop: CFG modes, the CLI, resume -----------------------------------------------------------------
def test_guided_rollouts_sample_with_cfg_and_train_the_conditional_velocity(tmp_path):
    from flowrl.training.trainer import Trainer

    model = make_model("sd3", guidance=4.5)
    seen = spy_velocity(model)
    Trainer(tiny(tmp_path, "gr", "train.max_steps=1"), model=model).train()
    assert {g for g, _, grad in seen if not grad} == {4.5, 1.0}  # rollouts guided; the reference at 1
    assert {(g, no_uncond) for g, no_uncond, grad in seen if grad} == {(1.0, True)}  # the policy: conditional only


PRESETS = ["dgpo", "dgpo_guided_rollouts"]


@pytest.mark.parametrize("preset", PRESETS)
def test_the_shapes_preset_trains_one_iteration_through_the_cli(tmp_path, preset):
    from flowrl.commands.main import main

    assert (
        main(
            [
                "train",
                f"configs/shapes/{preset}.yaml",
                "rollout.steps=2",
                "rollout.group_size=2",
                "prompts.per_step=2",
                "prompts.train=a red circle|two blue squares",
                "prompts.eval=null",
                "loss.draws=2",
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
    trained = [r for r in records if "group_weight" in r]
    assert len(trained) == 1 and trained[0]["trained_leaves"] == 4 and trained[0]["grad_norm"] > 0


def test_resume_equals_a_straight_run(tmp_path):  # old copy, split groups
    straight, resumed = straight_and_resumed(
        lambda *o: tiny(tmp_path, *o),
        "optim.lr=1e-2",
        "train.checkpoint_every=1",
        "loss.clip=0.05",
        "rollout.max_batch=2",
    )
    assert "group_weight" in resumed and resumed == straight


# ---- bad settings fail at load naming the key --------------------------------------------------------------
@pytest.mark.parametrize(
    "overrides, words",
    [
        (["loss.beta=0"], ["loss.beta=0", "> 0"]),
        (["loss.clip=-0.1"], ["loss.clip=-0.1", ">= 0"]),
        (["loss.reference=teacher"], ["loss.reference='teacher'", "loss.teacher"]),
        (["loss.reference=ema"], ["loss.reference='ema'", "initial", "teacher", "old"]),
        (["loss.cfg=half"], ["loss.cfg='half'", "guided_rollouts"]),
        (["model.guidance=1"], ["loss.cfg='guided_rollouts'", "model.guidance=1"]),
        (["loss.cfg=free", "model.guidance=3"], ["loss.cfg='free'", "model.guidance=3"]),
        (["loss.level_fraction=0"], ["loss.level_fraction=0", "(0, 1]"]),
        (["loss.timesteps=uniform", "loss.level_fraction=0.3"], ["loss.level_fraction", "nothing reads it"]),
        (["rollout.group_size=1"], ["rollout.group_size=1", ">= 2"]),
        (["loss.clip=0", "loss.reference=initial", "loss.old_decay=0.5"], ["loss.old_decay", "nothing reads it"]),
    ],
)
def test_bad_dgpo_settings_fail_at_load(tmp_path, overrides, words):
    with pytest.raises(ConfigError) as err:
        tiny(tmp_path, "bad", *overrides)
    for w in words:
        assert w in str(err.value), (w, str(err.value))


def test_grouped_forward_is_the_shared_base():
    from flowrl.objectives.crd import CRDLoss

    assert issubclass(CRDLoss, GroupedForward) and issubclass(DGPOLoss, GroupedForward)
