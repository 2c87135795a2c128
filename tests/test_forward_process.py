"""Forward-process objectives (DiffusionNFT, AWM), the ODE plan and the objective contract (issue 22)."""

from __future__ import annotations

import json

import pytest
import torch

from flowrl.config.schema import ConfigError, TrainConfig
from flowrl.objectives.awm import AWMLoss
from flowrl.objectives.nft import NFTLoss
from tests.conftest import make_model, spy_velocity, with_lora, without_wall_clock

TINY = [
    "model.family=sd3",
    "model.lora.rank=2",
    "rollout.plan=ode",
    "rollout.group_size=2",
    "rollout.steps=3",
    "prompts.train=a red circle|two blue squares",
    "prompts.per_step=2",
    "prompts.eval=null",
    "train.progress=false",
    "train.checkpoint_every=0",
    "train.async_reward=false",
    "rewards=[{name: redness}]",
]


def tiny(tmp_path, name, *extra):
    return TrainConfig.from_yaml(None, [*TINY, f"train.output_dir={tmp_path}", f"train.name={name}", *extra])


# ---- NFT on hand-made tensors -------------------------------------------------------------------
@pytest.mark.parametrize("r", [0.0, 0.2, 0.5, 0.9, 1.0])
@pytest.mark.parametrize("beta", [0.5, 1.0, 2.0])
def test_nft_row_optimum_is_old_plus_scaled_step_towards_the_sample(r, beta):
    gen = torch.Generator().manual_seed(0)
    v_old, y = torch.randn(3, 4, 2, 2, generator=gen), torch.randn(3, 4, 2, 2, generator=gen)
    nft = NFTLoss(beta=beta)
    rr = torch.full((3,), r)
    best = v_old + (2 * r - 1) / beta * (y - v_old)
    v = best.clone().requires_grad_(True)
    loss, _, _ = nft.row_loss(v, v_old, y, torch.full((3,), 0.5), rr)
    loss.sum().backward()
    assert v.grad.abs().max() < 1e-5  # a stationary point of a convex quadratic: the minimum
    for _ in range(3):  # and every other velocity scores worse
        other = best + 0.1 * torch.randn(best.shape, generator=gen)
        assert (nft.row_loss(other, v_old, y, torch.full((3,), 0.5), rr)[0] > loss.detach()).all()
    if r == 0.5:
        assert torch.allclose(best, v_old)  # neutral: the old policy


def test_nft_optimality_and_gradient_direction_at_the_old_policy():
    nft = NFTLoss(beta=1.0, adv_scale=2.0)
    assert nft.optimality(torch.tensor([-9.0, -1.0, 0.0, 1.0, 2.0, 9.0])).tolist() == [0.0, 0.25, 0.5, 0.75, 1.0, 1.0]
    v_old, y = torch.zeros(2, 1, 2, 2), torch.ones(2, 1, 2, 2)
    v = v_old.clone().requires_grad_(True)
    loss, _, _ = nft.row_loss(v, v_old, y, torch.full((2,), 0.5), torch.tensor([0.9, 0.1]))
    loss.sum().backward()
    assert (v.grad[0] < 0).all() and (v.grad[1] > 0).all()  # r > ½ moves towards y, r < ½ away
    v.grad = None
    loss, _, _ = nft.row_loss(v, v_old, y, torch.full((2,), 0.5), torch.tensor([0.5, 0.5]))
    loss.sum().backward()
    assert v.grad.abs().max() == 0  # r = ½ at the old policy: no push either way


def test_nft_adaptive_weight_is_x0_space_error_over_its_detached_scale():
    nft = NFTLoss(beta=1.0, adaptive_weight=True)
    v_old, y = torch.zeros(1, 1, 1, 2), torch.tensor([[[[1.0, 3.0]]]])
    t = torch.tensor([0.5])
    loss, pos, neg = nft.row_loss(v_old.clone(), v_old, y, t, torch.tensor([1.0]))
    # x0 error = t·(v − y) = (−0.5, −1.5): squared mean 1.25, scale mean|.| = 1.0
    assert pos.item() == pytest.approx(1.25) and loss.item() == pytest.approx(1.25)


# ---- AWM's clipped ratio -----------------------------------------------------------------------
def test_awm_ratio_is_clipped_only_where_it_would_push_further():
    awm = AWMLoss(clip=0.2)
    err = torch.tensor([1.0, 1.0, 1.0, 1.0], requires_grad=True)
    err_old = torch.tensor(
        [1.0 + torch.log(torch.tensor(1.5)).item(), 1.0 + torch.log(torch.tensor(1.5)).item(), 1.0, 1.0]
    )
    adv = torch.tensor([1.0, -1.0, 1.0, -1.0])
    obj, ratio = awm.clipped(err, err_old, adv)
    assert ratio.tolist() == pytest.approx([1.5, 1.5, 1.0, 1.0])
    assert obj.tolist() == pytest.approx([-1.2, 1.5, -1.0, 1.0])
    obj.sum().backward()
    # sample 0 (A > 0, ρ above 1 + clip): clipped, no gradient; sample 1 (A < 0): unclipped, ∂/∂L = A·ρ·(-1)·(-1)
    assert err.grad.tolist() == pytest.approx([0.0, -1.5, 1.0, -1.0])


# ---- the old copy ------------------------------------------------------------------------------
def test_old_policy_decay_schedule():
    assert [NFTLoss(old_decay=0.9).decay(k) for k in (1, 50)] == [0.9, 0.9]
    ramp = NFTLoss(old_decay=0.9, old_decay_warmup=10)
    assert [ramp.decay(k) for k in (1, 5, 10, 40)] == pytest.approx([0.09, 0.45, 0.9, 0.9])


@pytest.mark.parametrize("lora", [True, False])
def test_old_policy_is_an_ema_of_the_policy_lora_as_a_second_adapter(lora):
    from flowrl.objectives.copies import OLD_ADAPTER

    model = with_lora(make_model("sd3")) if lora else make_model("sd3")
    if not lora:
        model.trainable.requires_grad_(True)
    nft = NFTLoss(old_decay=0.75)
    nft.setup(model)
    trainable = [p for p in model.trainable.parameters() if p.requires_grad]
    if lora:
        assert nft._old.frozen is None and OLD_ADAPTER in model.trainable.peft_config  # no model copy
    x = torch.randn(2, *model.latent_shape, generator=torch.Generator().manual_seed(1))
    cond = model.encode(["a red circle", "a dog"], 1.0)

    def velocities():
        with torch.no_grad():
            live = model.velocity(x, torch.full((2,), 0.6), cond, 1.0)
            with nft._old.active():
                old = model.velocity(x, torch.full((2,), 0.6), cond, 1.0)
        return live, old

    live, old = velocities()
    assert torch.equal(live, old)  # starts equal to the policy
    before = [p.detach().clone() for p in trainable]
    with torch.no_grad():
        for p in trainable:
            p.add_(0.05)
    nft.after_update(model)  # θ_old ← 0.75·θ_old + 0.25·θ
    for (old_p, live_p), b in zip(nft._old.pairs, before):
        assert torch.allclose(old_p, 0.75 * b + 0.25 * live_p.detach(), atol=1e-6)
    live, old = velocities()
    assert not torch.allclose(live, old)
    assert [p for p in model.trainable.parameters() if p.requires_grad] == trainable  # activation left flags alone
    state = nft.state_dict()
    other = NFTLoss(old_decay=0.75)
    other.setup(model)
    other.load_state_dict(state)
    assert all(torch.equal(a, b) for (a, _), (b, _) in zip(other._old.pairs, nft._old.pairs)) and other._updates == 1


# ---- the contract through the trainer ------------------------------------------------------------
@pytest.mark.parametrize("objective", ["nft", "awm"])
def test_forward_process_objective_trains_without_replay(tmp_path, monkeypatch, objective):
    import flowrl.objectives.policy
    from flowrl.training.trainer import Trainer

    def no_replay(*a, **k):
        raise AssertionError("a forward-process objective must not replay edges")

    monkeypatch.setattr(flowrl.objectives.policy, "replay", no_replay)
    trainer = Trainer(
        tiny(tmp_path, objective, f"loss.objective={objective}", "train.max_steps=2", "optim.lr=1e-2"),
        model=make_model("sd3"),
    )
    before = [p.detach().clone() for p in trainer.params]
    records = [r for r in trainer.train() if "reward_mean" in r]
    assert [r["trained_leaves"] for r in records] == [4.0, 4.0]
    assert all(r["rollout_forwards"] == 4 * 3 for r in records)  # T forwards per chain, no trunk sharing
    assert any(not torch.equal(b, p) for b, p in zip(before, trainer.params))
    assert "fm_error" in records[0] and records[0]["grad_norm"] > 0


def test_forward_process_objective_trains_from_yaml_alone_through_the_cli(tmp_path):
    from flowrl.commands.main import main

    yaml = tmp_path / "nft.yaml"
    yaml.write_text(
        "\n".join(
            [
                "model: {family: shapes, full_finetune: true}",
                "rollout: {plan: ode, group_size: 2, steps: 2}",
                "rewards: [{name: shapes, kwargs: {mode: geneval}}]",
                "credit: {rule: group, scale: group}",
                "loss: {objective: nft, cfg: free, beta: 1.0, draws: 1}",
                "prompts: {train: 'a red circle|two blue squares', eval: 'a red circle', per_step: 2}",
                "eval: {steps: 2, images_per_prompt: 2, rewards: [{name: shapes, kwargs: {mode: strict}}]}",
                f"train: {{name: y, output_dir: {tmp_path}, max_steps: 2, progress: false, num_threads: 1}}",
            ]
        )
    )
    assert main(["train", str(yaml)]) == 0
    records = [json.loads(line) for line in (tmp_path / "y" / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in records if "eval/guidance" in r]
    assert [r["eval/guidance"] for r in evals] == [1.0, 1.0]  # CFG-free: the policy samples at 1
    assert [r["eval_default/guidance"] for r in evals] == [3.0, 3.0]  # and the model's default
    assert evals[0]["eval/shapes/n"] == 2  # two images of the one eval prompt
    from flowrl.run.checkpoint import find_checkpoint, read_state

    ckpt, _ = find_checkpoint(tmp_path / "y")
    assert read_state(ckpt)["policy_guidance"] == 1.0
    assert (tmp_path / "y" / "samples" / "after_default.png").is_file()


def test_cfg_free_trains_the_conditional_velocity_only(tmp_path):
    from flowrl.training.trainer import Trainer

    def run(mode):
        model = make_model("sd3", guidance=4.5)
        seen = spy_velocity(model)
        trainer = Trainer(
            tiny(tmp_path, mode, "loss.objective=nft", f"loss.cfg={mode}", "train.max_steps=1"), model=model
        )
        trainer.train()
        return seen

    free = run("free")
    assert {g for g, _, _ in free} == {1.0} and all(no_uncond for _, no_uncond, _ in free)
    assert any(grad for _, _, grad in free)  # the training forward ran, on the conditional path only
    guided = run("guided")
    assert {g for g, _, grad in guided if grad} == {4.5} and not any(no_uncond for _, no_uncond, grad in guided if grad)


def test_policy_objective_still_replays_with_ratio_one(tmp_path):
    from flowrl.training.trainer import Trainer

    cfg = tiny(
        tmp_path, "pol", "rollout.plan=chains", "rollout.window.mode=all", "loss.kl_ref=0.04", "train.max_steps=1"
    )
    records = [r for r in Trainer(cfg, model=make_model("sd3")).train() if "reward_mean" in r]
    assert records[0]["first_step_abs_delta_logp"] == 0.0 and records[0]["trained_edges"] > 0


def test_resume_restores_the_old_policy(tmp_path):
    from flowrl.training.trainer import Trainer

    common = ["loss.objective=nft", "optim.lr=1e-2", "train.checkpoint_every=1"]
    straight = Trainer(tiny(tmp_path, "a", *common, "train.max_steps=3"), model=make_model("sd3")).train()
    Trainer(tiny(tmp_path, "b", *common, "train.max_steps=2"), model=make_model("sd3")).train()
    resumed = Trainer(
        tiny(tmp_path, "b", *common, "train.max_steps=3", "train.resume=latest"), model=make_model("sd3")
    ).train()
    drop = without_wall_clock
    assert drop(resumed[-1]) == drop(straight[-1])  # old_drift, losses, rewards: the same third iteration


# ---- the ODE plan ------------------------------------------------------------------------------
@pytest.mark.parametrize("solver", ["euler", "dpm2"])
def test_ode_plan_keeps_clean_leaves_and_no_trainable_edge(sd3_model, solver):
    from flowrl.rollout.base import RolloutContext
    from flowrl.rollout.chains import ODEChains
    from flowrl.rollout.sampling import ode_sample

    plan = ODEChains(group_size=3, steps=4, solver=solver)
    ctx = RolloutContext(seed=5, iteration=2)
    forest = plan.rollout(sd3_model, ["a red circle", "a dog"], ctx)
    leaves = forest.leaves()
    assert leaves.numel() == 6 and forest.edges(trainable=True).numel() == 0 and not plan.has_trainable_edges
    assert bool((forest.sigma[leaves] == 0).all())
    assert forest.counters["forwards"] == plan.expected_counts(2, ctx)["forwards"] == 6 * 4
    if solver == "euler":  # the same samples as plain ODE sampling from the same seeds
        seeds = forest.seed[leaves].tolist()
        x0 = ode_sample(sd3_model, [p for p in ["a red circle", "a dog"] for _ in range(3)], seeds, 4, decode=False)
        assert torch.allclose(forest.all_latents()[leaves], x0, atol=1e-5)


def test_explore_feeds_the_ode_plan(sd3_model):
    from flowrl.rollout.base import RolloutContext
    from flowrl.rollout.explore import Explore

    plan = Explore(inner={"plan": "ode", "group_size": 2, "steps": 3}, pool=6, preview_steps=2, backend="same")
    from flowrl_rewards import MultiReward

    plan.setup(sd3_model, MultiReward([{"name": "redness"}]))
    forest = plan.rollout(sd3_model, ["a red circle"], RolloutContext(seed=1))
    assert forest.leaves().numel() == 2 and forest.edges(trainable=True).numel() == 0


# ---- bad settings fail at load -------------------------------------------------------------------
@pytest.mark.parametrize(
    "overrides, words",
    [
        (["loss.objective=nft", "loss.beta=0"], ["loss.beta=0", "> 0"]),
        (["loss.objective=nft", "loss.beta=-1"], ["loss.beta=-1", "> 0"]),
        (["loss.objective=nft", "loss.old_decay=1.0"], ["loss.old_decay=1.0", "[0, 1)"]),
        (["loss.objective=awm", "loss.old_decay=-0.1"], ["loss.old_decay=-0.1", "[0, 1)"]),
        (["loss.objective=nft", "loss.cfg=half"], ["loss.cfg='half'", "free", "guided"]),
        (["loss.objective=nft", "model.guidance=3"], ["loss.cfg='free'", "model.guidance=3"]),
        (["loss.objective=awm", "loss.t_range=[0.5,0.2]"], ["loss.t_range"]),
        (["loss.objective=clipped"], ["rollout.plan='ode'", "loss.objective='clipped'"]),
        (["rollout.solver=rk4"], ["rollout.solver='rk4'", "euler"]),
    ],
)
def test_bad_forward_process_settings_fail_at_load(tmp_path, overrides, words):
    with pytest.raises(ConfigError) as err:
        tiny(tmp_path, "bad", "loss.objective=nft", *overrides)
    for w in words:
        assert w in str(err.value), (w, str(err.value))


def test_a_plan_without_clean_latents_is_refused_for_a_forward_process_objective(tmp_path):
    plugin = tmp_path / "plans.py"
    plugin.write_text(
        "from dataclasses import dataclass\nfrom flowrl.rollout.chains import Chains\n\n"
        "@dataclass\nclass Noisy(Chains):\n    @property\n    def keeps_clean_latents(self):\n        return False\n"
    )
    with pytest.raises(ConfigError, match="keeps none"):
        tiny(tmp_path, "bad", f"rollout.plan={plugin}:Noisy", "loss.objective=nft")


# ---- learning -----------------------------------------------------------------------------------
@pytest.mark.slow  # 12 iterations of the shipped model per preset (15–45 s each): `pytest -m slow`, run by .ci/run
@pytest.mark.parametrize("preset", ["nft", "awm"])
def test_forward_process_objective_learns_on_the_shapes_model(tmp_path, preset):
    """The preset (full fine-tuning, CFG-free ODE rollouts) on 4 prompts with the dense ``redness`` reward:
    fixed-seed held-out reward rises by a margin well above seed noise in 12 iterations. (A random tiny
    pipeline is no flow model to begin with: forward-process objectives need a real one.) The objective's
    own learning: without the main job's guided teacher, whose anchor pulls towards the starting model
    (tests/test_teacher.py tests that pull)."""
    from flowrl.training.trainer import Trainer
    from tests.test_shapes_learning import PROMPTS, train_and_check_gain

    torch.set_num_threads(2)
    cfg = TrainConfig.from_yaml(
        f"configs/shapes/{preset}.yaml",
        [
            f"prompts.train={'|'.join(PROMPTS)}",
            "prompts.per_step=4",
            "prompts.eval=null",
            "rollout.group_size=8",
            "train.max_steps=12",
            "optim.lr=1e-3",
            "rewards=[{name: redness}]",
            f"train.output_dir={tmp_path}",
            f"train.name={preset}",
            "train.progress=false",
            "train.checkpoint_every=0",
            "train.num_threads=2",
            "loss.teacher=null",
        ],
    )
    train_and_check_gain(Trainer(cfg))


def test_snr_measures_a_forward_process_objective(tmp_path, monkeypatch):
    import flowrl.config.build as build
    from flowrl.commands.snr import gradient_snr

    monkeypatch.setattr(build, "build_model", lambda *a, **k: make_model("sd3"))
    out = gradient_snr(tiny(tmp_path, "snr", "loss.objective=nft"), batches=3, progress=False)
    assert out["samples_per_batch"] == 4 and out["noise"] > 0  # leaves counted on the forests


def test_a_tree_feeds_a_forward_process_objective(tmp_path):
    from flowrl.training.trainer import Trainer

    chains_only = ("rollout.group_size", "rollout.plan")
    cfg = TrainConfig.from_yaml(
        None,
        [
            *(o for o in TINY if not o.startswith(chains_only)),
            "rollout.plan=tree",
            "credit.rule=tree",
            "rollout.split_steps=[0,1]",
            "rollout.kernel=dance",
            "rollout.eta=0.5",
            "loss.objective=nft",
            "train.max_steps=1",
            f"train.output_dir={tmp_path}",
            "train.name=tree",
        ],
    )
    records = [r for r in Trainer(cfg, model=make_model("sd3")).train() if "reward_mean" in r]
    assert records[0]["trained_leaves"] == records[0]["leaves"] == 2 * 4  # 2 prompts × 2² leaves, no replay
