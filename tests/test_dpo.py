"""Online Diffusion-DPO (flowrl/objectives/dpo.py) against its flow-matching form (arXiv 2311.12908 as
Flow-GRPO's ``train_sd3_dpo.py`` and Flow-Factory's ``dpo`` trainer run it): per prompt group the best and the
worst leaf by advantage form a pair, noised at shared (t, ε); per point
ℓ = −log σ(−β/2·[(e_θ(w) − e_ref(w)) − (e_θ(l) − e_ref(l))]) with e = mean‖v − (ε − x0)‖², averaged over draws
and pairs. The references here are written out independently."""

from __future__ import annotations

import json
import math
from types import SimpleNamespace

import pytest
import torch

from flowrl.config.schema import ConfigError, TrainConfig
from flowrl.objectives.dpo import DPOLoss
from tests.conftest import make_model, straight_and_resumed, with_lora

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
    "loss.objective=dpo",
]


def tiny(tmp_path, name, *extra):
    return TrainConfig.from_yaml(None, [*TINY, f"train.output_dir={tmp_path}", f"train.name={name}", *extra])


def expected_pairs(advantage, group, leaves):
    """Best vs worst of each group (first of equals), groups in order; none for a group without spread."""
    pairs = []
    for g in sorted(set(group[leaves].tolist())):
        mine = [int(n) for n in leaves if int(group[n]) == g]
        a = [float(advantage[n]) for n in mine]
        best, worst = mine[a.index(max(a))], mine[a.index(min(a))]
        if max(a) > min(a):
            pairs.append((best, worst))
    return pairs


def test_pairs_are_best_against_worst_inside_each_group_and_never_cross_groups():
    group = torch.tensor([0, 0, 0, 1, 1, 1, 1, 2, 2, 3, 3, 3, 4])
    adv = torch.tensor([0.5, -1.0, 0.2, 1.0, 1.0, -2.0, -2.0, 0.3, 0.3, -0.1, 2.0, 0.0, 9.0])
    forest = SimpleNamespace(advantage=adv, group=group)
    leaves = torch.arange(13)
    got = DPOLoss().select_leaves(forest, leaves).view(-1, 2).tolist()
    # group 1: ties go to the earlier node; group 2 has no spread and group 4 one leaf: no pair
    assert got == [[0, 1], [3, 5], [10, 9]] == [list(p) for p in expected_pairs(adv, group, leaves)]
    gen = torch.Generator().manual_seed(0)
    for _ in range(20):  # random groups and advantages, a random subset of trainable leaves
        group = torch.randint(0, 5, (30,), generator=gen)
        adv = torch.randn(30, generator=gen)
        leaves = torch.nonzero(torch.rand(30, generator=gen) < 0.8).flatten()
        pairs = DPOLoss().select_leaves(SimpleNamespace(advantage=adv, group=group), leaves).view(-1, 2).tolist()
        assert [tuple(p) for p in pairs] == expected_pairs(adv, group, leaves)
        assert all(group[w] == group[lo] and adv[w] > adv[lo] for w, lo in pairs)


def test_pair_loss_and_gradient_equal_the_bradley_terry_formula():
    gen = torch.Generator().manual_seed(1)
    P, D, beta = 3, 2, 40.0
    err = (0.5 + 0.1 * torch.randn(2 * P * D, generator=gen, dtype=torch.float64)).requires_grad_(True)
    err_ref = 0.5 + 0.1 * torch.randn(2 * P * D, generator=gen, dtype=torch.float64)
    terms = []
    for p in range(P):
        for d in range(D):
            w, lo = (2 * p) * D + d, (2 * p + 1) * D + d  # rows leaf-major, pairs interleaved (chosen, rejected)
            inside = -beta / 2 * ((err[w] - err_ref[w]) - (err[lo] - err_ref[lo]))
            terms.append(-torch.log(torch.sigmoid(inside)))
    expected = torch.stack(terms).mean()
    (expected_grad,) = torch.autograd.grad(expected, err)
    own, z = DPOLoss(beta=beta, draws=D).pair_loss(err, err_ref)
    assert own.shape == (2 * P,) and z.shape == (P, D)
    loss = own.mean()  # the objective's micro-batch loss: the mean over its leaves, each pair counted on both
    (grad,) = torch.autograd.grad(loss, err)
    assert loss.item() == pytest.approx(expected.item(), rel=1e-12)
    torch.testing.assert_close(grad, expected_grad)


def test_batches_and_loss_of_a_real_forest_equal_the_formula_written_out():
    """On the tiny SD3 pipeline: pairs whole in every micro-batch (an odd micro-batch size included), each pair at one
    (t, ε) per draw, and the micro-batch loss and its gradient equal the formula run through the model directly."""
    from flowrl.rollout.base import RolloutContext
    from flowrl.rollout.chains import ODEChains

    model = with_lora(make_model("sd3"))
    forest = ODEChains(group_size=3, steps=3).rollout(
        model, ["a red circle", "a dog", "two cats"], RolloutContext(seed=2)
    )
    leaves = forest.leaves()
    forest.reward[leaves] = torch.arange(leaves.numel(), dtype=torch.float32)
    forest.advantage[leaves] = torch.tensor([0.1, -1.0, 1.0, 0.5, 0.5, 0.5, 2.0, -0.3, 0.0])  # group 1: no spread
    obj = DPOLoss(beta=50.0, draws=2)
    obj.micro_batch = 5  # 2 leaves × 2 draws fit: one pair per micro-batch, never half of one
    obj.setup(model)
    batches = obj.batches(forest, iteration=1, seed=7)
    assert [b.index.tolist() for b in batches] == [[int(leaves[2]), int(leaves[1])], [int(leaves[6]), int(leaves[7])]]
    cond = obj.encode(model, forest)
    params = [p for p in model.trainable.parameters() if p.requires_grad]
    for b in batches:
        t, eps = b.extra["t"], b.extra["noise"]
        torch.testing.assert_close(t[:2], t[2:], rtol=0, atol=0)  # the pair's draws: the same t ...
        torch.testing.assert_close(eps[:2], eps[2:], rtol=0, atol=0)  # ... and the same ε
        loss, diag = obj.loss(model, forest, b, cond)
        got = torch.autograd.grad(loss, params)
        x0 = forest.all_latents()[b.index].repeat_interleave(2, dim=0)
        x_t = (1 - t.view(-1, 1, 1, 1)) * x0 + t.view(-1, 1, 1, 1) * eps
        c = cond.select(forest.group[b.index].repeat_interleave(2))
        e = ((model.velocity(x_t, t, c, forest.guidance) - (eps - x0)) ** 2).flatten(1).mean(1)
        with torch.no_grad(), obj._reference.active():
            e_ref = ((model.velocity(x_t, t, c, forest.guidance) - (eps - x0)) ** 2).flatten(1).mean(1)
        inside = -50.0 / 2 * ((e[:2] - e_ref[:2]) - (e[2:] - e_ref[2:]))  # draws 0, 1 of chosen vs rejected
        expected = -torch.nn.functional.logsigmoid(inside).mean()
        assert loss.item() == pytest.approx(expected.item(), rel=1e-5)
        for g_got, g_ref in zip(got, torch.autograd.grad(expected, params)):
            torch.testing.assert_close(g_got, g_ref, rtol=1e-4, atol=1e-7)
        assert float(diag["implicit_acc"]) == float((inside > 0).float().mean())
    # no spread anywhere: nothing to train; asked for a micro-batch over given units (the sharded loop's padding),
    # one self-pair whose loss is log 2 with no gradient (up to the rounding of two equal rows' backward)
    forest.advantage[leaves] = 0.0
    assert obj.batches(forest) == []
    (pad,) = obj.batches(forest, units=leaves)
    assert pad.index.tolist() == [int(leaves[0])] * 2
    loss, _ = obj.loss(model, forest, pad, cond)
    assert loss.item() == pytest.approx(math.log(2), rel=1e-6)
    # no gradient: the two rows are the same sample, so what is left is float32 rounding of the batched forward, far
    # below a real pair's gradient (a bound relative to it, not to a number that depends on torch's kernels)
    real = max(float(g.abs().max()) for g in got)
    padded = max(float(g.abs().max()) for g in torch.autograd.grad(loss, params))
    assert padded <= 1e-4 * real, (padded, real)


def test_declared_copies_and_reward_free_point():
    obj = DPOLoss()
    facts = obj.describe()
    assert facts.frozen_copies == ("reference",) and not obj.uses_old and facts.leaves_per_group == 2
    assert facts.no_reward_free_point is None and facts.reward_free_overrides == {"teacher": None, "kl_ref": 0.0}


def test_the_shapes_preset_trains_one_iteration_through_the_cli(tmp_path):
    from flowrl.commands.main import main

    assert (
        main(
            [
                "train",
                "configs/shapes/dpo.yaml",
                "train.max_steps=1",
                "prompts.per_step=2",
                "rollout.group_size=3",
                "rollout.steps=4",
                "prompts.eval=null",
                "train.checkpoint_every=0",
                "train.progress=false",
                "train.num_threads=1",
                f"train.output_dir={tmp_path}",
                "train.name=dpo",
            ]
        )
        == 0
    )
    records = [json.loads(line) for line in (tmp_path / "dpo" / "metrics.jsonl").read_text().splitlines()]
    record = next(r for r in records if "reward_mean" in r)
    assert record["trained_leaves"] % 2 == 0 and record["trained_leaves"] <= 4  # one pair per group at most
    if record["trained_leaves"]:
        assert record["dpo_loss"] == pytest.approx(math.log(2))  # at the reference: z = 0
        assert math.isfinite(record["grad_norm"])


def test_resume_equals_a_straight_run(tmp_path):
    straight, resumed = straight_and_resumed(
        lambda *o: tiny(tmp_path, *o), "optim.lr=1e-2", "train.checkpoint_every=1", "loss.kl_ref=0.1"
    )
    assert resumed == straight
    assert straight["trained_leaves"] > 0


@pytest.mark.parametrize(
    "overrides, words",
    [
        (["rollout.group_size=1"], ["rollout.group_size=1", ">= 2"]),
        (["loss.beta=0"], ["loss.beta=0", "> 0"]),
        (["loss.share_t=true"], ["loss.share_t is set but nothing reads it"]),
        (["loss.old_decay=0.5"], ["loss.old_decay is set but nothing reads it", "no old copy"]),
        (["loss.cfg=free", "model.guidance=3"], ["loss.cfg='free'", "model.guidance=3"]),
        (["rollout.plan=chains", "credit.rule=turning_point"], ["credit.rule='turning_point'", "loss.objective='dpo'"]),
    ],
)
def test_refused_combinations_fail_at_load_naming_the_key(tmp_path, overrides, words):
    with pytest.raises(ConfigError) as err:
        tiny(tmp_path, "bad", *overrides)
    for w in words:
        assert w in str(err.value), (w, str(err.value))


def test_a_plan_with_one_leaf_per_group_is_refused(tmp_path):
    plugin = tmp_path / "plans.py"
    plugin.write_text(
        "from dataclasses import dataclass\nfrom flowrl.rollout.chains import ODEChains\n\n"
        "@dataclass\nclass Single(ODEChains):\n    def expected_counts(self, num_prompts, ctx=None):\n"
        "        return {**super().expected_counts(num_prompts, ctx), 'leaves': num_prompts}\n"
    )
    with pytest.raises(ConfigError, match=r"loss.objective='dpo' pairs .* gives 1 leaf per group"):
        tiny(tmp_path, "bad", f"rollout.plan={plugin}:Single")


def test_the_estimate_counts_one_pair_per_group_not_every_leaf(tmp_path):
    """``flowrl bench --estimate`` asks the objective for its training rows: DPO trains a chosen and a rejected leaf
    of each prompt group (``draws`` points each), not the group's every leaf."""
    from flowrl.config import build
    from flowrl.estimate.counts import iteration_counts

    cfg = TrainConfig.from_yaml("configs/shapes/dpo.yaml", [f"train.output_dir={tmp_path}"])
    counts = iteration_counts(build.build_plan(cfg.rollout), build.build_loss(cfg), num_prompts=8, max_steps=10)
    assert counts["leaves"] == 8 * cfg.rollout.group_size
    assert counts["train_rows"] == 2 * 8 * cfg.loss.draws < counts["leaves"] * cfg.loss.draws
