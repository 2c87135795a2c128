"""A guided teacher for forward-process objectives (issue 33): the anchor, teacher samples, schedules,
DiffusionNFT's published settings, best-of-N distillation, and bad settings refused at load."""

from __future__ import annotations

import json

import pytest
import torch

from flowrl.config.schema import ConfigError, TrainConfig
from flowrl.objectives.base import Batch
from flowrl.objectives.forward import Rows
from flowrl.objectives.nft import NFTLoss
from flowrl.objectives.teacher import Schedule, TeacherSpec, leaf_weights
from tests.conftest import make_model, with_lora, without_wall_clock
from tests.test_forward_process import tiny

TEACHER = "loss.teacher={guidance: 3.0, anchor: 1.0}"


# ---- the anchor on hand-made tensors --------------------------------------------------------------
def rows_of(v: torch.Tensor, v_teacher: torch.Tensor) -> Rows:
    """A micro-batch's rows holding only what the anchor reads: the policy's and the teacher's velocities."""
    return Rows(
        v=v,
        v_old=None,
        v_ref=None,
        v_teacher=v_teacher,
        target=torch.zeros_like(v_teacher),
        t=torch.zeros(v.shape[0]),
        adv=torch.zeros(v.shape[0]),
    )


@pytest.mark.parametrize("weight", [0.5, 2.0])
def test_anchor_gradient_is_zero_at_the_teacher_and_pulls_towards_it(weight):
    nft = NFTLoss(draws=2, teacher=TeacherSpec(anchor=1.0))
    gen = torch.Generator().manual_seed(0)
    v_t = torch.randn(4, 3, 2, 2, generator=gen)  # 2 leaves × 2 draws
    batch = Batch(torch.arange(2), 2, {"anchor": torch.full((2,), weight)})
    at = v_t.clone().requires_grad_(True)
    loss, diag = nft.total(torch.zeros(2), rows_of(at, v_t), batch)
    loss.backward()
    assert at.grad.abs().max() == 0 and diag["anchor_error"] == 0
    off = (v_t + 0.3 * torch.randn(v_t.shape, generator=gen)).requires_grad_(True)
    nft.total(torch.zeros(2), rows_of(off, v_t), batch)[0].backward()
    # d/dv of mean_leaves(w·mean_draws(mean_elements ‖v − v_T‖²)) = w·2(v − v_T)/(leaves·draws·elements per row)
    expected = weight * 2 * (off.detach() - v_t) / (2 * 2 * v_t[0].numel())
    assert torch.allclose(off.grad, expected, atol=1e-6)


def test_reward_term_zero_leaves_the_anchor_alone():
    nft = NFTLoss(draws=1, teacher=TeacherSpec(anchor=1.0), reward_term=0.0)
    v = torch.ones(2, 1, requires_grad=True)
    out, _ = nft.total(
        torch.tensor([5.0, 7.0]), rows_of(v, torch.zeros(2, 1)), Batch(torch.arange(2), 2, {"anchor": torch.ones(2)})
    )
    assert out.item() == 1.0  # the NFT term (5, 7) weighted by 0; the anchor's error 1 per leaf


def test_leaf_weights():
    reward, group = torch.tensor([0.2, 0.6, 1.0, 1.0]), torch.tensor([0, 0, 1, 1])
    adv = torch.tensor([-2.0, 0.5, 0.0, 0.0])
    assert torch.equal(leaf_weights("none", reward, group, adv), torch.ones(4))
    assert torch.allclose(leaf_weights("reward", reward, group, adv), torch.tensor([0.5, 1.5, 1.0, 1.0]))
    assert torch.allclose(leaf_weights("advantage", reward, group, adv), torch.tensor([0.0, 1.5, 1.0, 1.0]))


# ---- schedules ----------------------------------------------------------------------------------
def test_schedules():
    assert [Schedule.parse("constant", "k")(k) for k in (0, 99)] == [1.0, 1.0]
    assert [Schedule.parse("linear:10", "k")(k) for k in (0, 5, 10, 20)] == pytest.approx([1.0, 0.5, 0.0, 0.0])
    assert [Schedule.parse("off_after:3", "k")(k) for k in (0, 2, 3, 9)] == [1.0, 1.0, 0.0, 0.0]
    assert [Schedule.parse("cosine:4", "k")(k) for k in (0, 2, 4)] == pytest.approx([1.0, 0.5, 0.0])
    rew = Schedule.parse("reward:0.4:0.8", "k")
    assert [rew(0, r) for r in (0.2, 0.6, 0.9)] == pytest.approx([0.0, 0.5, 1.0])


def test_old_decay_follows_the_published_rate_schedule():
    nft = NFTLoss(old_decay=0.5, old_decay_rate=0.001, old_decay_flat=2)
    assert [nft.decay(k) for k in (1, 2, 3, 102, 502, 900)] == pytest.approx([0.0, 0.0, 0.001, 0.1, 0.5, 0.5])


def test_linear_optimality_is_the_public_codes_half_plus_a_tenth():
    nft = NFTLoss(optimality_form="linear", adv_clip=5.0)
    assert torch.allclose(
        nft.optimality(torch.tensor([-9.0, -1.0, 0.0, 2.0, 5.0])), torch.tensor([0.0, 0.4, 0.5, 0.7, 1.0])
    )


# ---- the teacher through the trainer -------------------------------------------------------------
def _spy(model):
    """Record (guidance, has uncond rows, grad enabled, which transformer) of every velocity call."""
    seen = []
    velocity = model.velocity

    def spy(x, sigma, cond, guidance=None):
        seen.append((guidance, cond.uncond is not None, torch.is_grad_enabled(), id(model.pipe.transformer)))
        return velocity(x, sigma, cond, guidance)

    model.velocity = spy
    return seen


@pytest.mark.parametrize("full", [True, False])
def test_teacher_runs_at_its_guidance_and_is_never_updated(tmp_path, full):
    from flowrl.training.trainer import Trainer

    model = make_model("sd3")
    extra = ["model.full_finetune=true"] if full else []
    trainer = Trainer(
        tiny(tmp_path, f"t{full}", TEACHER, "loss.objective=nft", "train.max_steps=2", "optim.lr=1e-2", *extra),
        model=model,
    )
    teacher = trainer.objective.teacher_model
    frozen = [p.detach().clone() for p in teacher._copy.frozen.parameters()] if full else None
    seen = _spy(model)
    records = [r for r in trainer.train() if "reward_mean" in r]
    guided = [s for s in seen if s[0] == 3.0]
    assert guided and all(has_uncond and not grad for _, has_uncond, grad, _ in guided)  # CFG rows, no gradient
    assert all(g == 1.0 for g, _, grad, _ in seen if grad)  # the policy trains CFG-free
    assert records[-1]["teacher_forwards"] == 4 * 2  # 4 leaves × 2 draws per update, one guided forward each
    assert records[-1]["anchor_error"] > 0 and records[-1]["time/teacher"] > 0
    if full:  # one frozen copy, its weights as they were
        assert all(torch.equal(a, b) for a, b in zip(frozen, teacher._copy.frozen.parameters()))
        assert not any(p.requires_grad for p in teacher._copy.frozen.parameters())
    else:  # LoRA: the teacher is the base with the adapter off, and the base never moves
        base = [p for n, p in model.trainable.named_parameters() if "lora_" not in n]
        assert all(not p.requires_grad for p in base)
    with torch.no_grad(), teacher.active():  # the teacher's velocity is the initial model's
        x = torch.randn(1, *model.latent_shape, generator=torch.Generator().manual_seed(3))
        cond = model.encode(["a red circle"], 3.0)
        v_teacher = model.velocity(x, torch.full((1,), 0.5), cond, 3.0)
    fresh = make_model("sd3")
    with torch.no_grad():
        v_initial = fresh.velocity(x, torch.full((1,), 0.5), fresh.encode(["a red circle"], 3.0), 3.0)
    assert torch.allclose(v_teacher, v_initial, atol=1e-5)


def test_teacher_samples_are_credited_in_their_group(sd3_model):
    from flowrl.credit.group import GroupAdvantage
    from flowrl.objectives.teacher import Teacher
    from flowrl.rollout.base import RolloutContext
    from flowrl.rollout.chains import ODEChains

    model = with_lora(sd3_model)
    teacher = Teacher(model, TeacherSpec(guidance=3.0))
    plan = ODEChains(group_size=4, steps=3, teacher_share=2)
    ctx = RolloutContext(seed=5, iteration=1, guidance=1.0, teacher=teacher)
    forest = plan.rollout(model, ["a red circle", "two blue squares"], ctx)
    leaves = forest.leaves()
    assert forest.group[leaves].bincount().tolist() == [4, 4]
    from_teacher = forest.from_teacher[leaves] > 0
    assert [int(from_teacher[forest.group[leaves] == g].sum()) for g in (0, 1)] == [2, 2]
    assert forest.counters["teacher_forwards"] == 2 * 2 * 3
    # the same seeds without a teacher share: the policy's chains are unchanged, the teacher's differ
    alone = ODEChains(group_size=4, steps=3).rollout(model, ["a red circle", "two blue squares"], ctx)
    by_seed = {int(alone.seed[n]): alone.all_latents()[n] for n in alone.leaves()}
    for n, t in zip(leaves.tolist(), from_teacher.tolist()):
        same = torch.equal(forest.all_latents()[n], by_seed[int(forest.seed[n])])
        assert same != t  # policy leaves identical; teacher leaves drawn at guidance 3 by the base
    forest.reward[leaves] = torch.arange(8, dtype=torch.float32)
    GroupAdvantage(scale="group").assign(forest)
    for g in (0, 1):
        mine = leaves[forest.group[leaves] == g]
        r = forest.reward[mine]
        assert torch.allclose(forest.advantage[mine], (r - r.mean()) / (r.std(unbiased=False) + 1e-4), atol=1e-5)


def test_share_schedule_gives_the_teacher_fewer_chains_as_training_goes(tmp_path):
    from flowrl.training.trainer import Trainer

    cfg = tiny(
        tmp_path,
        "sched",
        "loss.teacher={guidance: 3.0, anchor: 0.0, share_schedule: 'linear:2'}",
        "loss.objective=nft",
        "rollout.teacher_share=2",
        "rollout.group_size=2",
        "train.max_steps=3",
    )
    records = [r for r in Trainer(cfg, model=make_model("sd3")).train() if "reward_mean" in r]
    # share 2 · (1, 0.5, 0): 2 then 1 then no teacher chain per group (2 groups, 3 steps each)
    assert [r.get("rollout_teacher_forwards", 0) for r in records] == [12, 6, 0]
    assert "anchor_error" not in records[0]  # anchor 0: no teacher forward in the update


def test_raft_trains_the_top_k_of_each_group():
    from flowrl.objectives.best_of_n import RAFTLoss
    from flowrl.rollout.forest import Forest

    forest = Forest(prompts=["a", "b"])
    forest.add_roots(torch.zeros(6, 1, 1, 1), torch.tensor([0, 0, 0, 1, 1, 1]), list(range(6)), sigma=0.0)
    forest.reward[:] = torch.tensor([0.1, 0.9, 0.5, 0.3, 0.2, 0.8])
    assert RAFTLoss(top_k=2).select_leaves(forest, forest.leaves()).tolist() == [1, 2, 3, 5]
    assert RAFTLoss(top_k=1, min_reward=0.85).select_leaves(forest, forest.leaves()).tolist() == [1]


def test_sampler_timesteps_are_distinct_levels_of_the_rollout_schedule(tmp_path):
    from flowrl.rollout.base import RolloutContext
    from flowrl.rollout.chains import ODEChains

    model = make_model("sd3")
    forest = ODEChains(group_size=2, steps=4).rollout(model, ["a red circle"], RolloutContext(seed=1))
    forest.reward[forest.leaves()] = torch.tensor([0.0, 1.0])
    nft = NFTLoss(timesteps="sampler", draws=3)
    t = nft.batches(forest, iteration=0, seed=0)[0].extra["t"]
    levels = set(model.schedule(4)[:4].clamp(1e-4, 1 - 1e-4).tolist())  # σ_0 = 1 kept just inside (0, 1)
    assert all(any(abs(x - lv) < 1e-6 for lv in levels) for x in t.tolist())
    assert all(len(set(t[i : i + 3].tolist())) == 3 for i in (0, 3))  # distinct per leaf
    with pytest.raises(ValueError, match="loss.draws=5"):
        NFTLoss(timesteps="sampler", draws=5).batches(forest)


# ---- presets, resume, bad settings ----------------------------------------------------------------
def test_resume_with_a_teacher_is_exact(tmp_path):
    from flowrl.training.trainer import Trainer

    common = [
        TEACHER,
        "loss.objective=nft",
        "rollout.teacher_share=1",
        "optim.lr=1e-2",
        "train.checkpoint_every=1",
        "model.full_finetune=true",
    ]
    straight = Trainer(tiny(tmp_path, "a", *common, "train.max_steps=3"), model=make_model("sd3")).train()
    Trainer(tiny(tmp_path, "b", *common, "train.max_steps=2"), model=make_model("sd3")).train()
    resumed = Trainer(
        tiny(tmp_path, "b", *common, "train.max_steps=3", "train.resume=latest"), model=make_model("sd3")
    ).train()
    drop = without_wall_clock
    assert drop(resumed[-1]) == drop(straight[-1]) and "anchor_error" in resumed[-1]


@pytest.mark.parametrize(
    "overrides, words",
    [
        (["loss.teacher={guidance: 0.5}"], ["loss.teacher.guidance=0.5", ">= 1"]),
        (["loss.teacher={schedule: 'linear:abc'}"], ["loss.teacher.schedule='linear:abc'", "linear:N"]),
        (["loss.teacher={schedule: 'sometimes'}"], ["loss.teacher.schedule='sometimes'", "off_after:N"]),
        (["loss.teacher={weighting: loud}"], ["loss.teacher.weighting='loud'", "advantage"]),
        (["loss.teacher={anchor: -1}"], ["loss.teacher.anchor=-1", ">= 0"]),
        ([TEACHER, "rollout.teacher_share=3"], ["rollout.teacher_share=3", "rollout.group_size=2"]),
        (["rollout.teacher_share=1"], ["rollout.teacher_share=1", "loss.teacher"]),
        (["loss.center=teacher"], ["loss.center='teacher'", "loss.teacher"]),
        (["loss.reward_term=0"], ["loss.reward_term=0", "loss.teacher.anchor"]),
        (["loss.timesteps=sometimes"], ["loss.timesteps='sometimes'", "sampler"]),
    ],
)
def test_bad_teacher_settings_fail_at_load(tmp_path, overrides, words):
    with pytest.raises(ConfigError) as err:
        tiny(tmp_path, "bad", "loss.objective=nft", *overrides)
    for w in words:
        assert w in str(err.value), (w, str(err.value))


def test_a_teacher_path_that_is_not_a_model_is_refused_before_the_model_loads(tmp_path, monkeypatch):
    from flowrl.config import build
    from flowrl.training.trainer import Trainer

    missing = tmp_path / "missing"
    with pytest.raises(ConfigError) as err:  # at config load
        tiny(tmp_path, "bad", "loss.objective=nft", f"loss.teacher={{path: '{missing}'}}")
    assert f"loss.teacher.path='{missing}'" in str(err.value) and "is not a folder" in str(err.value)
    empty = tmp_path / "empty"
    empty.mkdir()
    cfg = tiny(tmp_path, "bad", "loss.objective=nft", f"loss.teacher={{path: '{empty}'}}")

    def no_load(*args, **kwargs):
        raise AssertionError("the model loaded before the teacher's folder was read")

    monkeypatch.setattr(build, "build_model", no_load)
    with pytest.raises(ConfigError) as err:  # the loop reads the folder before any weights load
        Trainer(cfg)
    assert f"loss.teacher.path='{empty}'" in str(err.value) and "holds no model" in str(err.value)


def test_a_teacher_from_a_checkpoint_is_that_checkpoints_model(tmp_path):
    from flowrl.run.checkpoint import find_checkpoint
    from flowrl.training.trainer import Trainer

    full = ["model.full_finetune=true", "optim.lr=5e-2"]
    first = Trainer(tiny(tmp_path, "first", "loss.objective=nft", "train.max_steps=1", *full), model=make_model("sd3"))
    first.train()
    x = torch.randn(1, *first.model.latent_shape, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        trained = first.model.velocity(x, torch.full((1,), 0.5), first.model.encode(["a dog"], 3.0), 3.0)
    ckpt, _ = find_checkpoint(tmp_path / "first")
    second = Trainer(
        tiny(tmp_path, "second", "loss.objective=nft", f"loss.teacher={{path: '{ckpt}'}}", *full),
        model=make_model("sd3"),
    )
    model = second.model
    with torch.no_grad():
        v = second.objective.teacher_model.velocity(x, torch.full((1,), 0.5), model.encode(["a dog"], 3.0))
        own = model.velocity(x, torch.full((1,), 0.5), model.encode(["a dog"], 3.0), 3.0)
    assert torch.allclose(v, trained, atol=1e-5) and not torch.allclose(v, own, atol=1e-4)


@pytest.mark.parametrize("preset, extra", [("nft", []), ("raft", ["rollout.teacher_share=4"])])
def test_teacher_presets_train_from_yaml_alone(tmp_path, preset, extra):
    from flowrl.commands.main import main

    args = [
        "train",
        f"configs/shapes/{preset}.yaml",
        *extra,
        "train.max_steps=1",
        "prompts.per_step=2",
        "rollout.group_size=4",
        "rollout.steps=2",
        "eval.num_prompts=2",
        "eval.steps=2",
        f"train.output_dir={tmp_path}",
        "train.name=p",
        "train.progress=false",
        "train.num_threads=1",
    ]
    assert main(args) == 0
    records = [json.loads(line) for line in (tmp_path / "p" / "metrics.jsonl").read_text().splitlines()]
    step = [r for r in records if "reward_mean" in r][0]
    assert step.get("teacher_forwards", 0) > 0 or step.get("rollout_teacher_forwards", 0) > 0


@pytest.mark.parametrize("warmup, decay", [(True, 0.1), (False, 0.9)])
def test_eval_ema_warms_up_as_diffusion_nft_does(tmp_path, warmup, decay):
    from flowrl.training.trainer import Trainer

    trainer = Trainer(
        tiny(
            tmp_path,
            f"ema{warmup}",
            "loss.objective=nft",
            "train.max_steps=1",
            "optim.lr=1e-2",
            "train.ema=0.9",
            f"train.ema_warmup={str(warmup).lower()}",
            "prompts.eval=null",
        ),
        model=make_model("sd3"),
    )
    start = [p.detach().clone() for p in trainer.params]
    trainer.train()
    # after optimizer step s = 0 the decay is min((1 + 0)/(10 + 0), 0.9) = 0.1 with the warm-up, else 0.9
    for e, p0, p in zip(trainer.ema, start, trainer.params):
        assert torch.allclose(e, decay * p0 + (1 - decay) * p.detach(), atol=1e-6)
    assert any(not torch.equal(p0, p) for p0, p in zip(start, trainer.params))


def test_the_progress_bar_shows_the_objectives_own_keys(tmp_path, capsys):
    from flowrl.training.trainer import Trainer

    Trainer(
        tiny(tmp_path, "bar", "loss.objective=nft", TEACHER, "train.max_steps=1", "train.progress=true"),
        model=make_model("sd3"),
    ).train()
    bar = capsys.readouterr().err.splitlines()[-1]
    assert "fm=" in bar and "anchor=" in bar and "clip=" not in bar and "kl=" not in bar
    from flowrl.objectives.policy import PolicyLoss

    assert PolicyLoss().describe().progress({"approx_kl": 0.002, "clipfrac_high": 0.25, "clipfrac_low": 0.5}) == {
        "kl": "2.0e-03",
        "clip": "0.75",
    }


@pytest.mark.slow
def test_the_main_job_distils_its_guided_teacher_on_the_shapes_model(tmp_path):
    """The main job (``nft.yaml``: NFT + the guided teacher's anchor) on the shipped model: in 8 iterations
    the policy's velocity at guidance 1 moves towards the frozen model's at guidance 3, at fixed points
    (x_t from fixed noise, t = 0.9 / 0.7 / 0.5), far beyond what the same run without the anchor moves."""
    from flowrl.training.trainer import Trainer
    from tests.test_shapes_learning import PROMPTS

    def distance(trainer):
        model, teacher = trainer.model, trainer.objective.teacher_model
        x = torch.randn(len(PROMPTS), *model.latent_shape, generator=torch.Generator().manual_seed(7))
        out = []
        with torch.no_grad():
            for t in (0.9, 0.7, 0.5):
                tt = torch.full((len(PROMPTS),), t)
                v_t = teacher.velocity(x, tt, model.encode(PROMPTS, 3.0))
                v = model.velocity(x, tt, model.encode(PROMPTS, 1.0), 1.0)
                out.append(float(((v - v_t) ** 2).mean()))
        return sum(out)

    def run(name, *extra):
        cfg = TrainConfig.from_yaml(
            "configs/shapes/nft.yaml",
            [
                f"prompts.train={'|'.join(PROMPTS)}",
                "prompts.per_step=4",
                "prompts.eval=null",
                "rollout.group_size=4",
                "train.max_steps=8",
                f"train.output_dir={tmp_path}",
                f"train.name={name}",
                "train.progress=false",
                "train.checkpoint_every=0",
                "train.num_threads=2",
                *extra,
            ],
        )
        trainer = Trainer(cfg)
        before = distance(trainer)
        trainer.train()
        return before, distance(trainer)

    before, anchored = run("main")
    _, reward_only = run("reward_only", "loss.teacher.anchor=0.0")
    # measured: 5.43 → 4.44 with the anchor (−18%), → 5.50 without it (+1%)
    assert anchored < 0.9 * before and anchored < 0.9 * reward_only, (before, anchored, reward_only)


def test_snr_reward_only_measures_nothing_when_the_reward_gives_no_advantage(tmp_path, monkeypatch):
    """``flowrl snr --reward-only``: with a reward equal within every prompt group (zero advantages) the
    anchor, kl_ref and the old copy contribute no gradient, so none is measured; without the flag the
    anchor's is. With a varying reward the flag measures a gradient."""
    import flowrl.config.build as build
    from flowrl.commands.snr import gradient_snr
    from flowrl_rewards import REGISTRY, Reward, register

    class PerPrompt(Reward):
        def score(self, images, prompts, meta):
            return torch.tensor([float(len(p)) for p in prompts])

    register("flowrl_test_per_prompt", PerPrompt)
    monkeypatch.setattr(build, "build_model", lambda *a, **k: make_model("sd3"))
    try:
        flat = [TEACHER, "loss.kl_ref=0.1", "loss.objective=nft", "rewards=[{name: flowrl_test_per_prompt}]"]
        assert gradient_snr(tiny(tmp_path, "a", *flat), batches=3, progress=False, reward_only=True)["noise"] == 0
        assert gradient_snr(tiny(tmp_path, "b", *flat), batches=3, progress=False)["noise"] > 0
        varying = [TEACHER, "loss.objective=nft"]  # redness varies within a group
        assert gradient_snr(tiny(tmp_path, "c", *varying), batches=3, progress=False, reward_only=True)["noise"] > 0
    finally:
        REGISTRY.pop("flowrl_test_per_prompt")
    with pytest.raises(ConfigError, match="loss.objective='raft'"):
        gradient_snr(tiny(tmp_path, "d", "loss.objective=raft", TEACHER), batches=3, progress=False, reward_only=True)


def test_the_held_out_eval_shows_a_progress_bar_of_its_images(tmp_path, capsys):
    from flowrl.training.trainer import Trainer

    Trainer(
        tiny(
            tmp_path,
            "evalbar",
            "loss.objective=nft",
            "train.max_steps=1",
            "train.progress=true",
            "prompts.eval=a red circle|two blue squares|a dog",
            "eval.images_per_prompt=2",
            "eval.steps=2",
        ),
        model=make_model("sd3"),
    ).train()
    err = capsys.readouterr().err
    assert "eval at guidance 1:" in err and "/6 [" in err and "image/s" in err  # a bar over 3 prompts × 2 images


@pytest.mark.parametrize("teacher", [True, False])
def test_a_run_with_a_teacher_and_one_without_take_the_same_declared_path(tmp_path, monkeypatch, teacher):
    """The loop asks the objective for its sampling teacher once (Objective.sampling_teacher: a Teacher or None), hands
    that to every rollout context, and logs the teacher's share through one callback (flowrl.training.callbacks);
    nothing else of the trainer
    knows whether there is a teacher."""
    from flowrl.objectives import base
    from flowrl.objectives import teacher as teacher_module
    from flowrl.rollout import runner as runner_module
    from flowrl.rollout.base import RolloutContext
    from flowrl.training.trainer import Trainer

    asked, contexts, metrics = [], [], []
    for cls in {type(o) for o in [NFTLoss()]} | {base.Objective}:
        original = cls.sampling_teacher
        monkeypatch.setattr(cls, "sampling_teacher", lambda self, f=original: asked.append(f(self)) or asked[-1])
    real_init = RolloutContext.__init__

    def record_context(self, *args, **kwargs):
        real_init(self, *args, **kwargs)
        contexts.append((self.teacher, self.teacher_fraction))

    monkeypatch.setattr(runner_module.RolloutContext, "__init__", record_context)
    original_metrics = teacher_module.teacher_share_metrics
    monkeypatch.setattr(
        teacher_module,
        "teacher_share_metrics",
        lambda forest, group: metrics.append(original_metrics(forest, group)) or metrics[-1],
    )
    extra = [TEACHER, "rollout.teacher_share=2"] if teacher else []
    trainer = Trainer(
        tiny(tmp_path, f"path{teacher}", "loss.objective=nft", "train.max_steps=2", "prompts.eval=null", *extra),
        model=make_model("sd3"),
    )
    records = trainer.train()
    assert len(asked) == 1 and (asked[0] is not None) == teacher and asked[0] is trainer.objective.teacher_model
    assert len(contexts) >= 2 and all(c is asked[0] for c, _ in contexts)  # every rollout context carries that teacher
    assert all(fraction == 1.0 for _, fraction in contexts)  # no share_schedule: the whole rollout.teacher_share
    assert len(metrics) == 2 and all(bool(m) == teacher for m in metrics)
    steps = [r for r in records if "reward_mean" in r]
    assert all(("rollout_teacher_forwards" in r) == teacher for r in steps)
