"""Training through CFG (``loss.cfg_gradient``; docs/algorithms.md, "Training through CFG").

With guidance g the training forward composes v = v_u + g·(v_c − v_u). ``cond`` (Flow-GRPO's ``train_sd3.py``, which
detaches the unconditional branch) sends a loss's gradient through g·∇v_c only; ``both`` adds (1 − g)·∇v_u. The values
(log-probs, ratios, losses) are the same either way. Checked here: the adapters' composition (the unconditional rows
of the transformer's output get no gradient under ``cond``, the conditional rows the same one), the exact decomposition
grad(both) − grad(cond) = (1 − g)·J_uᵀ·∂L/∂v for the policy objectives and DGPO's guided mode on a tiny SD3, every plan
and objective that trains through CFG honouring the key in the loop, the key's checks, and the presets' choices.
"""

from __future__ import annotations

import json

import pytest
import torch

from flowrl.config.schema import ConfigError, TrainConfig
from flowrl.models.base import CFG_GRADIENTS
from flowrl.objectives.dgpo import DGPOLoss
from flowrl.objectives.grpo_guard import GRPOGuardLoss
from flowrl.objectives.policy import LayerTuningLoss, PolicyLoss
from flowrl.rollout.base import RolloutContext
from flowrl.rollout.chains import Chains, ODEChains
from flowrl.rollout.tree import Tree
from tests.conftest import make_model, update_gradient, with_lora

G = 3.0
PROMPTS = ["a red circle", "two blue squares"]


# ---- the adapters' composition ---------------------------------------------------------------------------------
def output_grads(model, prompts, guidance, mode):
    """(v [B, ...], ∂⟨w, v⟩/∂ the transformer output's unconditional rows [B, ...], and its conditional rows) for one
    guided velocity inside ``model.cfg_gradient(mode)``; w fixed and seeded; the output ``[uncond; cond]`` caught by a
    forward hook on the trainable module (a tensor, or a list of per-row tensors)."""
    grads: dict[int, torch.Tensor] = {}

    def keep(module, args, output):
        outs = output[0]
        outs = list(outs) if isinstance(outs, (list, tuple)) else [outs]
        for i, o in enumerate(outs):
            o.register_hook(lambda g, i=i: grads.__setitem__(i, g.detach().clone()))

    handle = model.trainable.register_forward_hook(keep)
    cond = model.encode(prompts, guidance)
    try:
        with model.cfg_gradient(mode):
            v = model.velocity(model.noise([1, 2]), torch.tensor([0.7, 0.4]), cond, guidance)
        w = torch.randn(v.shape, generator=torch.Generator().manual_seed(0))
        (w * v).sum().backward()
    finally:
        handle.remove()
    out = grads[0] if len(grads) == 1 else torch.stack([grads[i] for i in sorted(grads)])
    uncond, cond_rows = out.chunk(2)
    return v.detach(), uncond, cond_rows


def tiny_model(family: str):
    """(model, the guidance its velocity is called with) for a family whose composition differs: the plain one
    (SD3), FLUX's true CFG, Qwen-Image's norm rescale, Z-Image's own split with truncation, Wan 2.2's two experts
    with their own scales."""
    from flowrl.models import wrap

    if family == "sd3":
        return make_model("sd3", guidance=G), G
    if family == "flux":
        return make_model("flux", true_cfg=G), None
    if family == "qwen_image":
        from flowrl.models.testing.qwen_image import tiny_qwen_image_pipeline

        return wrap(tiny_qwen_image_pipeline(), height=32, width=32, guidance=G), G
    if family == "zimage":
        from flowrl.models.testing.zimage import tiny_zimage_pipeline

        return wrap(tiny_zimage_pipeline(), height=32, width=32, guidance=G), G
    from flowrl.models.testing.wan import tiny_wan_pipeline

    pipe = tiny_wan_pipeline(scheduler="euler", two_experts=True)
    return wrap(pipe, height=32, width=32, num_frames=5, guidance=4.0, guidance_2=2.0), None


@pytest.mark.parametrize("family", ["sd3", "flux", "qwen_image", "zimage", "wan22"])
def test_cond_cuts_the_unconditional_rows_gradient_and_changes_no_value(family):
    """Per adapter: the same velocity bit for bit; under ``cond`` the transformer's unconditional output rows get no
    gradient at all, under ``both`` they get one; the conditional rows get the same gradient either way (the partial
    derivative in v_c does not depend on whether v_u is held)."""
    model, guidance = tiny_model(family)
    assert model.uses_cfg(guidance)
    v_cond, u_cond, c_cond = output_grads(model, PROMPTS, guidance, "cond")
    v_both, u_both, c_both = output_grads(model, PROMPTS, guidance, "both")
    assert torch.equal(v_cond, v_both)
    assert float(u_cond.abs().max()) == 0.0
    assert float(u_both.abs().max()) > 0.0
    torch.testing.assert_close(c_cond, c_both, rtol=1e-5, atol=1e-7)


def test_the_context_restores_the_mode_and_refuses_an_unknown_one():
    model = make_model("sd3", guidance=G)
    x, sigma, cond = model.noise([1]), torch.tensor([0.5]), model.encode(PROMPTS[:1], G)

    def uncond_grad() -> float:
        model.trainable.zero_grad()
        v_u = model.velocity(x, sigma, cond, 0.0)  # guidance 0: v_u + 0·(v_c − v_u) = v_u, same forward
        v_u.sum().backward()
        return sum(float(p.grad.abs().sum()) for p in model.trainable.parameters() if p.grad is not None)

    assert uncond_grad() > 0
    with model.cfg_gradient("cond"):
        assert uncond_grad() == 0.0
        with model.cfg_gradient("both"):
            assert uncond_grad() > 0
        assert uncond_grad() == 0.0
    assert uncond_grad() > 0  # outside: the model's own composition
    with pytest.raises(ConfigError, match=r"loss.cfg_gradient='conditional' is not supported.*\['cond', 'both'\]"):
        with model.cfg_gradient("conditional"):
            pass


# ---- the exact decomposition, objective by objective --------------------------------------------------------------
def capture(model) -> tuple[list[dict], object]:
    """Wrap ``model.velocity``: each call that returns a tensor with gradients records its arguments and, through a
    hook, ∂L/∂v as the backward sends it (the loop's micro-batch scaling included). Returns (the calls, the unwrapped
    method)."""
    calls, velocity = [], model.velocity

    def spy(x, sigma, cond, guidance=None):
        v = velocity(x, sigma, cond, guidance)
        if v.requires_grad:
            call = {"args": (x.detach(), torch.as_tensor(sigma).detach(), cond, guidance)}
            v.register_hook(lambda g, call=call: call.__setitem__("dv", g.detach().clone()))
            calls.append(call)
        return v

    model.velocity = spy
    return calls, velocity


def uncond_term(model, velocity, calls) -> list[torch.Tensor]:
    """Σ over the recorded calls of (1 − g)·J_uᵀ·(∂L/∂v): the gradient of Σ (1 − g)·⟨sg(∂L/∂v), v_u⟩, with v_u from the
    same [uncond; cond] forward (guidance 0 returns v_u, its gradient through both branches)."""
    model.trainable.zero_grad()
    with model.cfg_gradient("both"):
        for call in calls:
            x, sigma, cond, g = call["args"]
            ((1.0 - float(g)) * (call["dv"] * velocity(x, sigma, cond, 0.0)).sum()).backward()
    return [p.grad.clone() for p in model.trainable.parameters() if p.grad is not None]


def decomposition(objective, model, forest, micro_batch: int = 64):
    """The update's gradient under ``cond`` and under ``both``, and the (1 − g)·∇v_u term of the ``both`` run."""
    grads = {}
    for mode in CFG_GRADIENTS:
        objective.cfg_gradient = mode
        calls, velocity = capture(model)
        _, grads[mode], _ = update_gradient(objective, model, forest, objective.encode(model, forest), micro_batch)
        del model.velocity  # the spy was an instance attribute over the class's method
        assert calls and all(c["args"][3] == G and "dv" in c for c in calls)
    return grads["cond"], grads["both"], uncond_term(model, velocity, calls)


def assert_decomposes(cond, both, term):
    """both = cond + term to float tolerance, and the term is no rounding error (the setting changes the update)."""
    assert len(cond) == len(both) == len(term) > 0
    scale = max(float(g.abs().max()) for g in both)
    for a, b, t in zip(cond, both, term):
        torch.testing.assert_close(b - a, t, rtol=1e-4, atol=1e-5 * scale)
    gap = sum(float((b - a).norm() ** 2) for a, b in zip(cond, both)) ** 0.5
    assert gap > 0.05 * sum(float(b.norm() ** 2) for b in both) ** 0.5


def guided_forest(plan, model, seed: int = 0):
    forest = plan.rollout(model, PROMPTS, RolloutContext(seed=seed, guidance=G))
    assert forest.guidance == G
    edges = forest.edges()
    forest.advantage[edges] = torch.linspace(-1.5, 1.5, edges.numel())
    leaves = forest.leaves()
    forest.reward[leaves] = torch.linspace(0.0, 1.0, leaves.numel())
    return forest


PLANS = {
    "chains": lambda: Chains(group_size=2, steps=3, window={"mode": "all"}),
    "shared_trunk": lambda: Chains(
        group_size=3, steps=4, shared_noise=True, window={"mode": "fixed", "start": 1, "size": 2}
    ),
    "tree": lambda: Tree(steps=4, split_steps=[0, 1], kernel="dance", eta=0.5),
}


@pytest.mark.parametrize("plan", sorted(PLANS))
@pytest.mark.parametrize("kl_ref", [0.0, 0.04])
def test_clipped_objective_gradients_differ_by_the_unconditional_term(plan, kl_ref):
    """The clipped objective (and its KL, which reads the same replayed mean) on chains, a shared trunk and a tree:
    grad(both) − grad(cond) = (1 − g)·J_uᵀ·∂L/∂v, to float tolerance."""
    model = with_lora(make_model("sd3", guidance=G))
    forest = guided_forest(PLANS[plan](), model)
    objective = PolicyLoss(kl_ref=kl_ref, kl_form="exact")
    objective.setup(model)
    assert_decomposes(*decomposition(objective, model, forest))


def test_grpo_guard_and_layer_tuning_gradients_differ_by_the_unconditional_term():
    """GRPO-Guard's normalised ratio and LayerTuning's replayed part follow the same setting (LayerTuning's own term
    regresses the conditional velocity at guidance 1: no CFG, nothing to route)."""
    model = with_lora(make_model("sd3", guidance=G))
    forest = guided_forest(PLANS["chains"](), model)
    guard = GRPOGuardLoss(kl_ref=0.01)
    guard.setup(model)
    guard.begin_iteration(model, forest)
    assert_decomposes(*decomposition(guard, model, forest))
    layer = LayerTuningLoss(kl_ref=0.0, layer_lambda=0.0)
    layer.setup(model)
    assert_decomposes(*decomposition(layer, model, forest))


def test_dgpo_guided_mode_gradients_differ_by_the_unconditional_term():
    """DGPO with ``cfg: guided`` (the guided velocity is the policy), its groups cut over micro-batches so the
    no-grad completing forwards run too: grad(both) − grad(cond) = (1 − g)·J_uᵀ·∂L/∂v."""
    model = with_lora(make_model("sd3", guidance=G))
    forest = ODEChains(group_size=3, steps=3).rollout(model, PROMPTS, RolloutContext(seed=0, guidance=G))
    leaves = forest.leaves()
    forest.reward[leaves] = torch.tensor([0.1, 0.9, 0.4, 0.7, 0.2, 0.3])
    forest.advantage[leaves] = torch.tensor([-1.0, 1.2, -0.2, 1.1, -0.9, -0.2])
    objective = DGPOLoss(cfg="guided", draws=2, timesteps="uniform", clip=0.0, kl_ref=0.02)
    objective.setup(model)
    assert objective.training_guidance(forest) == G
    assert_decomposes(*decomposition(objective, model, forest, micro_batch=4))


# ---- every plan and objective that trains through CFG honours the key in the loop ---------------------------------
TINY = [
    "model.family=sd3",
    "model.lora.rank=2",
    f"model.guidance={G}",
    "prompts.train=a red circle|two blue squares",
    "prompts.per_step=2",
    "prompts.eval=null",
    "rewards=[{name: redness}]",
    "optim.lr=1e-2",
    "train.max_steps=1",
    "train.progress=false",
    "train.checkpoint_every=0",
    "train.async_reward=false",
    "train.num_threads=1",
]
CHAINS = "{plan: chains, group_size: 3, steps: 3, window: {mode: all}}"
LOOPS = {
    "chains": ["rollout.plan=chains", "rollout.group_size=3", "rollout.steps=3", "rollout.window.mode=all"],
    "tree": ["rollout.plan=tree", "rollout.steps=3", "rollout.split_steps=[0,1]", "credit.rule=tree"],
    "explore": [
        "rollout.plan=explore",
        f"rollout.inner={CHAINS}",
        "rollout.pool=6",
        "rollout.preview_steps=2",
        "rollout.backend=same",
    ],
    "tp_grpo": [
        "rollout.plan=probed",
        "rollout.probe=ode_completion",
        f"rollout.inner={CHAINS}",
        "credit.rule=turning_point",
    ],
    "vgpo": [
        "rollout.plan=probed",
        "rollout.probe=x0_projection",
        f"rollout.inner={CHAINS}",
        "credit.rule=value_anchor",
    ],
    "grpo_guard": [*["rollout.plan=chains", "rollout.group_size=3", "rollout.steps=3"], "loss.objective=grpo_guard"],
    "layer_tuning": ["rollout.plan=tree", "rollout.steps=3", "rollout.split_steps=[0,1]", "credit.rule=tree"]
    + ["loss.objective=layer_tuning"],
    "dgpo_guided": [
        "rollout.plan=ode",
        "rollout.group_size=3",
        "rollout.steps=3",
        "loss.objective=dgpo",
        "loss.cfg=guided",
        "loss.draws=2",
    ],
}


@pytest.mark.parametrize("loop", sorted(LOOPS))
def test_each_plan_and_objective_trains_through_cfg_as_set(tmp_path, loop):
    """One iteration per setting from the same seed: the same rollouts, rewards and first-step ratios (values do not
    change), a different update (the gradient's norm), for chains, trees, explore, both step credits, GRPO-Guard,
    LayerTuning and DGPO's guided mode."""
    from flowrl.training.trainer import Trainer

    records = {}
    for mode in CFG_GRADIENTS:
        cfg = TrainConfig.from_yaml(
            None,
            [*TINY, *LOOPS[loop], f"loss.cfg_gradient={mode}", f"train.output_dir={tmp_path}", f"train.name={mode}"],
        )
        assert cfg.loss.cfg_gradient == mode
        Trainer(cfg, model=make_model("sd3")).train()
        lines = (tmp_path / mode / "metrics.jsonl").read_text().splitlines()
        records[mode] = [r for r in map(json.loads, lines) if "grad_norm" in r][-1]
    cond, both = records["cond"], records["both"]
    assert cond["reward_mean"] == both["reward_mean"]
    for key in ("first_step_abs_delta_logp", "trained_edges", "trained_leaves"):
        assert cond.get(key) == both.get(key)
    assert cond["grad_norm"] > 0 and both["grad_norm"] > 0
    assert abs(cond["grad_norm"] - both["grad_norm"]) > 1e-3 * both["grad_norm"]


# ---- the key: default, help, checks, presets ----------------------------------------------------------------------
def test_default_is_the_references_and_the_key_is_listed_and_checked(capsys):
    from flowrl.commands.main import main

    assert PolicyLoss().cfg_gradient == GRPOGuardLoss().cfg_gradient == DGPOLoss(cfg="guided").cfg_gradient == "cond"
    assert TrainConfig.from_yaml("configs/shapes/grpo.yaml").loss.cfg_gradient == "cond"
    with pytest.raises(SystemExit):
        main(["train", "configs/shapes/grpo.yaml", "--help"])
    assert "cfg_gradient: cond" in capsys.readouterr().out
    with pytest.raises(ConfigError, match=r"loss.cfg_gradient='foo' is not supported.*accepted: \['cond', 'both'\]"):
        TrainConfig.from_yaml("configs/shapes/grpo.yaml", ["loss.cfg_gradient=foo"])


def test_dgpo_refuses_the_key_where_it_trains_no_guided_velocity():
    """``cfg: guided_rollouts`` and ``free`` train the conditional velocity alone: a ``cfg_gradient`` set there reads
    nothing and is refused at load, naming the key and why."""
    with pytest.raises(ConfigError, match=r"loss.cfg_gradient is set but.*nothing reads it.*guided_rollouts"):
        TrainConfig.from_yaml("configs/shapes/dgpo_guided_rollouts.yaml", ["loss.cfg_gradient=both"])
    cfg = TrainConfig.from_yaml(
        "configs/shapes/dgpo_guided_rollouts.yaml", ["loss.cfg=guided", "loss.cfg_gradient=both"]
    )
    assert cfg.loss.cfg_gradient == "both"


PRESET_CHOICES = {
    # Flow-GRPO's scripts/train_sd3.py detaches the unconditional branch (compute_log_prob, ac4c86e line 190)
    "configs/sd35/flow_grpo_geneval.yaml": "cond",
    "configs/sd35/flow_grpo_ocr.yaml": "cond",
    "configs/sd35/flow_grpo_pickscore.yaml": "cond",
    "configs/sd35/flow_grpo_fast.yaml": "cond",
    "configs/sd35/flow_grpo_vlm_judge.yaml": "cond",
    # its Wan 2.1 and Qwen-Image trainers (scripts/train_wan2_1.py, train_qwenimage*.py) train both branches
    "configs/wan/flow_grpo_1_3b.yaml": "both",
    "configs/wan/flow_grpo_14b_cp.yaml": "both",
    "configs/wan/flow_grpo_a14b.yaml": "both",
    "configs/wan/flow_grpo_ti2v_5b.yaml": "both",
    "configs/qwen_image/flow_grpo_pickscore.yaml": "both",
    "configs/qwen_image_edit/flow_grpo_edit.yaml": "both",
    "configs/qwen_image_edit_plus/flow_grpo_edit.yaml": "both",
}


@pytest.mark.parametrize("preset", sorted(PRESET_CHOICES))
def test_presets_use_their_recipes_choice(preset):
    assert TrainConfig.from_yaml(preset).loss.cfg_gradient == PRESET_CHOICES[preset]
