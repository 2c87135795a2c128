"""GDRO (issue 45; arXiv 2601.02036): the loss and its gradient against the paper's formula written out by hand, the
group draws, one CLI iteration of the shapes preset on a stored set, resume, refused settings, the corrected score."""

from __future__ import annotations

import argparse
import contextlib
import json
import math

import pytest
import torch

from flowrl.config.schema import ConfigError, TrainConfig
from flowrl.objectives.gdro import GDROLoss, plackett_luce_loss
from flowrl.rollout.forest import Forest
from tests.conftest import make_model, without_wall_clock

PROMPTS = ["a red circle", "two blue squares", "a green triangle"]


# ---- the loss on hand-made tensors ----------------------------------------------------------------------
class FakeModel:
    """A 'model' whose velocity is a table per (leaf, draw) row: ``v`` (the policy, with grad) or ``v_ref``."""

    device = torch.device("cpu")

    def __init__(self, v, v_ref):
        self.v, self.v_ref, self.ref, self.rows = v, v_ref, False, None

    def velocity(self, x, t, cond, guidance):
        table = self.v_ref if self.ref else self.v
        return table[self.rows].flatten(0, 1)  # [B·D, C, H, W], leaf-major


class FakeReference:
    def __init__(self, model):
        self.model = model

    @contextlib.contextmanager
    def active(self):
        self.model.ref = True
        try:
            yield
        finally:
            self.model.ref = False


class Everything:
    def select(self, rows):
        return self


def hand_forest(rewards: list[list[float]], shape=(2, 2, 2)) -> Forest:
    """Clean leaves (roots at σ = 0) of groups with these rewards, root seeds 100 + node."""
    gen = torch.Generator().manual_seed(0)
    n = sum(len(r) for r in rewards)
    forest = Forest(prompts=[f"prompt {g}" for g in range(len(rewards))])
    group = [g for g, r in enumerate(rewards) for _ in r]
    forest.add_roots(torch.randn(n, *shape, generator=gen), group, [100 + i for i in range(n)], sigma=0.0)
    forest.reward[:] = torch.tensor([x for r in rewards for x in r])
    return forest


def by_hand(forest, batch, v, v_ref, beta, tau, gamma, D, norm) -> torch.Tensor:
    """The paper's Eqs. 5, 7, 8 and 9, one scalar at a time: s_i = −β·mean_d(‖v_θ − y‖² − ‖v_ref − y‖²) (‖·‖²: the
    sum of squares, or with ``norm`` 'mean' their mean),
    L_GDRO = Σ_{i<k} [log Σ_{m≥i} e^{s_m} − Σ_{j≥i} q_i(j)·s_j] over the group ranked by reward, + γ·‖v_θ − y‖² of the
    best; the batch's loss: the mean over leaves of their group's."""
    x0 = forest.all_latents()
    eps, t = batch.extra["noise"], batch.extra["t"]
    leaves = batch.index.tolist()
    row = {n: i for i, n in enumerate(leaves)}

    def err(table, n):
        total = 0.0
        for d in range(D):
            y = eps[row[n] * D + d] - x0[n]
            sq = (table[n, d] - y) ** 2
            total = total + (sq.sum() if norm == "sum" else sq.mean())
        return total / D

    groups: dict[int, list[int]] = {}
    for n in leaves:
        groups.setdefault(int(forest.group[n]), []).append(n)
    loss, count = 0.0, 0
    for members in groups.values():
        ranked = sorted(members, key=lambda n: (-float(forest.reward[n]), n))
        s = {n: -beta * (err(v, n) - err(v_ref, n)) for n in ranked}
        ell = 0.0
        for i in range(len(ranked) - 1):
            rest = ranked[i:]
            ell = ell + torch.log(sum(torch.exp(s[m]) for m in rest))
            if tau > 0:
                z = sum(math.exp(float(forest.reward[m]) / tau) for m in rest)
                ell = ell - sum(math.exp(float(forest.reward[j]) / tau) / z * s[j] for j in rest)
            else:
                ell = ell - s[rest[0]]
        ell = ell + gamma * err(v, ranked[0])
        loss = loss + ell * len(ranked)
        count += len(ranked)
    assert t.shape[0] == len(leaves) * D
    return loss / count


@pytest.mark.parametrize("tau", [0.0, 0.05, 0.7])
@pytest.mark.parametrize("D, norm", [(1, "sum"), (2, "sum"), (2, "mean")])
def test_loss_and_gradient_equal_the_papers_formula(tau, D, norm):
    forest = hand_forest([[0.1, 0.9, 0.5], [0.3, 0.2], [0.4, 0.4, 0.4], [0.7, float("nan"), 0.6, 0.65]])
    forest.flat[torch.tensor([5, 6, 7])] = 1.0  # group 2: no spread (the credit rule's mark) → not ranked
    gdro = GDROLoss(beta=0.4 if norm == "sum" else 6.0, tau=tau, gamma=0.7, draws=D, norm=norm)
    gdro.micro_batch = 64
    gen = torch.Generator().manual_seed(1)
    v = torch.randn(forest.num_nodes, D, 2, 2, 2, generator=gen)
    v_ref = v + 0.3 * torch.randn(v.shape, generator=gen)
    model = FakeModel(v.clone().requires_grad_(True), v_ref)
    gdro._reference, gdro.teacher_model = FakeReference(model), None
    batches = gdro.batches(forest, iteration=3, seed=2)
    assert len(batches) == 1
    batch = batches[0]
    assert batch.index.tolist() == [1, 2, 0, 3, 4, 8, 11, 10] and batch.extra["sizes"] == [3, 2, 3]  # ranked, NaN out
    model.rows = batch.index
    loss, diag = gdro.loss(model, forest, batch, Everything())
    loss.backward()
    v_hand = v.clone().requires_grad_(True)
    expected = by_hand(forest, batch, v_hand, v_ref, gdro.beta, tau, 0.7, D, norm)
    expected.backward()
    assert loss.item() == pytest.approx(expected.item(), rel=1e-5)
    assert torch.allclose(model.v.grad, v_hand.grad, atol=1e-6)
    assert model.v.grad[5:8].abs().max() == 0 and model.v.grad[9].abs().max() == 0  # unranked leaves: no gradient
    assert 0.0 <= diag["implicit_acc"] <= 1.0


def test_two_samples_at_zero_temperature_are_diffusion_dpo():
    s = torch.tensor([0.3, -1.2], requires_grad=True)
    loss = plackett_luce_loss(s, torch.tensor([0.9, 0.1]), 0.0)
    assert loss.item() == pytest.approx(-torch.nn.functional.logsigmoid(s[0] - s[1]).item())
    # at a high temperature the targets are uniform over the remaining set at every position
    s3, r3 = torch.tensor([0.5, -0.2, 0.1]), torch.tensor([0.9, 0.5, 0.1])
    uniform = (torch.logsumexp(s3, 0) - s3.mean()) + (torch.logsumexp(s3[1:], 0) - s3[1:].mean())
    assert plackett_luce_loss(s3, r3, 1e6).item() == pytest.approx(uniform.item(), rel=1e-5)


@pytest.mark.parametrize("share", [True, False])
def test_a_group_shares_its_timesteps_and_noise(share):
    forest = hand_forest([[0.1, 0.9, 0.5], [0.3, 0.2]])
    gdro = GDROLoss(draws=2, share_t=share, share_noise=share)
    gdro.micro_batch = 4  # rows: a group of 3 leaves × 2 draws does not fit, and still goes whole
    batches = gdro.batches(forest, iteration=1, seed=0)
    assert [b.extra["sizes"] for b in batches] == [[3], [2]]
    t, noise = batches[0].extra["t"].view(3, 2), batches[0].extra["noise"].view(3, 2, -1)
    assert torch.equal(t[0], t[1]) == share and torch.equal(noise[0], noise[2]) == share
    assert not torch.equal(t[0, 0], t[0, 1])  # the draws differ
    again = gdro.batches(forest, iteration=1, seed=0)  # addressed draws: the same numbers again
    assert torch.equal(again[0].extra["noise"], batches[0].extra["noise"])


# ---- through the loop ---------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_store(tmp_path_factory):
    from flowrl.run.rollout_store import write_store
    from flowrl_rewards import MultiReward

    out = tmp_path_factory.mktemp("gdro") / "store"
    write_store(
        out,
        make_model("sd3"),
        PROMPTS,
        MultiReward([{"name": "redness"}]),
        images_per_prompt=4,
        steps=3,
        guidance=1.0,
        seed=0,
        max_batch=8,
        model_info={"family": "sd3"},
    )
    return out


def tiny(tmp_path, store, name, *extra):
    return TrainConfig.from_yaml(
        None,
        [
            "model.family=sd3",
            "model.lora.rank=2",
            "rollout.plan=offline",
            f"rollout.source={store}",
            "rollout.group_size=3",
            f"prompts.train={store}/prompts.txt",
            "prompts.per_step=2",
            "prompts.eval=null",
            "train.progress=false",
            "train.checkpoint_every=0",
            "train.async_reward=false",
            "rewards=[{name: redness}]",
            "loss.objective=gdro",
            "optim.lr=1e-2",
            f"train.output_dir={tmp_path}",
            f"train.name={name}",
            *extra,
        ],
    )


def test_resume_equals_a_straight_run(tmp_path, tiny_store):
    from flowrl.training.trainer import Trainer

    def sampling_refused():
        model = make_model("sd3")
        velocity = model.velocity

        def spy(x, sigma, cond, guidance=None):
            assert torch.is_grad_enabled() or not bool((sigma == 1).any()), "offline training never samples"
            return velocity(x, sigma, cond, guidance)

        model.velocity = spy
        return model

    common = ["train.checkpoint_every=1"]
    straight = Trainer(tiny(tmp_path, tiny_store, "a", *common, "train.max_steps=3"), model=sampling_refused()).train()
    Trainer(tiny(tmp_path, tiny_store, "b", *common, "train.max_steps=2"), model=sampling_refused()).train()
    resumed = Trainer(
        tiny(tmp_path, tiny_store, "b", *common, "train.max_steps=3", "train.resume=latest"), model=sampling_refused()
    ).train()
    drop = without_wall_clock
    assert drop(resumed[-1]) == drop(straight[-1])
    last = straight[-1]
    assert last["rollout_forwards"] == 0 and last["trained_leaves"] == 6 and last["offline/reward_drift"] == 0


def test_one_cli_iteration_of_the_shapes_preset_on_a_written_store(tmp_path):
    from flowrl.commands import rollouts
    from flowrl.commands.main import main

    parser = argparse.ArgumentParser()
    rollouts.add_parser(parser.add_subparsers(dest="command"), "")
    store = tmp_path / "store"
    args = parser.parse_args(
        [
            "rollouts",
            "configs/shapes/gdro.yaml",
            "prompts.train=a red circle|two blue squares",
            "train.num_threads=1",
            "--out",
            str(store),
            "--images-per-prompt",
            "3",
            "--steps",
            "2",
        ]
    )
    assert args.func(args) == 0
    meta = json.loads((store / "rollouts.json").read_text())
    assert meta["sampler"]["guidance"] == 1.0 and meta["model"]["family"] == "shapes" and meta["rows"] == 6
    corrected = (
        "{name: gdro_corrected, kwargs: {reward: {name: shapes, kwargs: "
        "{mode: strict}}, quality: [brightness, saturation]}}"
    )
    assert (
        main(
            [
                "train",
                "configs/shapes/gdro.yaml",
                f"rollout.source={store}",
                f"prompts.train={store}/prompts.txt",
                "rollout.group_size=3",
                "prompts.per_step=2",
                "prompts.eval=a red circle",
                "eval.steps=2",
                "eval.images_per_prompt=1",
                "eval.default_guidance=false",
                "eval.grid_prompts=1",
                f"eval.rewards=[{{name: shapes, kwargs: {{mode: strict}}}}, {corrected}]",
                "train.max_steps=1",
                f"train.output_dir={tmp_path}",
                "train.name=g",
                "train.progress=false",
                "train.num_threads=1",
            ]
        )
        == 0
    )
    records = [json.loads(line) for line in (tmp_path / "g" / "metrics.jsonl").read_text().splitlines()]
    step = next(r for r in records if "reward_mean" in r)
    assert step["leaves"] == 6 and step["rollout_forwards"] == 0 and step["offline/reward_drift"] == 0
    assert step["trained_leaves"] == 6 * (1 - step["groups_without_spread"])  # a flat group has nothing to rank
    evals = [r for r in records if "eval/gdro_corrected_mean" in r]
    assert len(evals) == 2 and all(math.isfinite(r["eval/gdro_corrected/corrected"]) for r in evals)


# ---- refused settings --------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "overrides, words",
    [
        (["loss.beta=0"], ["loss.beta=0", "> 0"]),
        (["loss.tau=-1"], ["loss.tau=-1", ">= 0"]),
        (["loss.gamma=-0.5"], ["loss.gamma=-0.5"]),
        (["loss.norm=l1"], ["loss.norm='l1'", "sum", "mean"]),
        (["loss.teacher={guidance: 3.0}"], ["loss.teacher", "gdro"]),
        (["loss.adv_clip=3"], ["loss.adv_clip", "nothing reads it"]),
        (["loss.old_decay=0.5"], ["loss.old_decay", "nothing reads it"]),
        (["loss.timesteps=sampler"], ["loss.timesteps='sampler'", "rollout.plan='offline'"]),
        (["loss.objective=clipped"], ["rollout.plan='offline'", "loss.objective='clipped'"]),
        (["rollout.group_size=1"], ["rollout.group_size=1", ">= 2"]),
        (["rollout.source=/nowhere/store"], ["rollout.source='/nowhere/store'", "not a folder"]),
        (["model.guidance=3"], ["loss.cfg='free'", "model.guidance=3"]),
    ],
)
def test_refused_settings_fail_at_load_naming_the_key(tmp_path, tiny_store, overrides, words):
    with pytest.raises(ConfigError) as err:
        tiny(tmp_path, tiny_store, "bad", *overrides)
    for w in words:
        assert w in str(err.value), (w, str(err.value))


def test_the_presets_load_without_a_store_and_train_only_with_one(tmp_path):
    from flowrl.config import build

    for preset in ("configs/shapes/gdro.yaml", "configs/sd35/gdro_ocr.yaml"):
        cfg = TrainConfig.from_yaml(preset)
        plan, loss = build.build_plan(cfg.rollout), build.build_loss(cfg)
        assert plan.expected_counts(8)["leaves"] == 48 and loss.describe().frozen_copies == ("reference",)
        with pytest.raises(ConfigError, match="rollout.source is not set"):
            plan.setup(None)


# ---- the corrected score --------------------------------------------------------------------------------
def test_the_corrected_score_is_reward_times_quality_above_three_plus_a_fifth():
    from flowrl_rewards.heuristics.gdro_corrected import CorrectedScore
    from flowrl_rewards.heuristics.image_stats import Brightness, Saturation

    images = torch.rand(5, 3, 8, 8, generator=torch.Generator().manual_seed(0))
    prompts = ["p"] * 5
    score = CorrectedScore(reward="redness", quality=["brightness", {"name": "saturation"}])
    r = score.reward(images, prompts)
    u = 1 + 4 * (Brightness()(images, prompts) + Saturation()(images, prompts)) / 2  # [0, 1] onto UnifiedReward's 1–5
    assert torch.allclose(score(images, prompts), r * (u - 3) + 0.2, atol=1e-6)
    summary = score.evaluate(images, prompts)
    assert summary["corrected"] == pytest.approx(float(r.mean()) * (float(u.mean()) - 3) + 0.2, rel=1e-5)
    assert summary["n"] == 5 and summary["quality"] == pytest.approx(float(u.mean()), rel=1e-5)
    on_scale = CorrectedScore(reward="redness", quality="brightness", quality_range=None)
    assert torch.allclose(on_scale(images, prompts), r * (Brightness()(images, prompts) - 3) + 0.2, atol=1e-6)
    for kwargs, words in (
        ({"quality": []}, "at least one"),
        ({"quality": "brightness", "quality_range": [1, 1]}, "quality_range"),
        ({"quality": {"nome": "x"}}, r"quality\[0\]\.nome is not a key of .*did you mean 'name'"),
    ):
        with pytest.raises(ValueError, match=words):
            CorrectedScore(reward="redness", **kwargs)
