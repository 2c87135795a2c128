"""A model adapter, a transition kernel and a wrapping rollout plan defined outside flowrl/ train from YAML
alone (``path/file.py:Name`` in ``model.family``, ``rollout.kernel``, ``rollout.plan``), with replay still
exact (docs/extending.md); so does an objective of its own (``loss.objective: path/file.py:Class`` with its own
keys); and a model family written on the :class:`~flowrl.models.base.FlowModel` base alone (no adapter
subclassed), registered with ``register_model_family`` from its own file, samples and trains."""

from __future__ import annotations

import json
import textwrap

import pytest

from flowrl.commands.main import main
from flowrl.core.plugins import import_file

ADAPTER = '''
from flowrl.models.sd3 import SD3FlowModel

CALLS = []


class CountingSD3(SD3FlowModel):
    """The SD3 adapter, counting its velocity calls (a stand-in for a new family's adapter)."""

    def velocity(self, x, sigma, cond, guidance=None):
        CALLS.append(x.shape[0])
        return super().velocity(x, sigma, cond, guidance)
'''

KERNEL = '''
import torch

USED = []


def half_noise(x, v, sigma, sigma_next, eta):
    """Euler mean with half of Flow-GRPO-like noise: std = 0.5·η·sqrt(σ − σ_next)."""
    USED.append(x.shape[0])
    dt = sigma_next - sigma
    return x + v * dt, 0.5 * eta * torch.sqrt(-dt)
'''

PLAN = '''
from dataclasses import dataclass

from flowrl.core import components
from flowrl.rollout.base import RolloutPlan

ROLLOUTS = []


@dataclass
class Logged(RolloutPlan):
    """Wraps any plan (``inner``: a name or {plan: name, its keys}, built like explore's and probed's) and logs
    its rollouts."""

    inner: str | dict = "chains"

    def __post_init__(self):
        self.plan = components.build_nested(components.PLAN, self.inner, key="rollout.inner")

    def setup(self, model, reward=None):
        self.plan.setup(model, reward)

    def after_update(self, model):
        self.plan.after_update(model)

    def rollout(self, model, prompts, ctx):
        ROLLOUTS.append(len(prompts))
        return self.plan.rollout(model, prompts, ctx)

    def expected_counts(self, num_prompts, ctx=None):
        return self.plan.expected_counts(num_prompts, ctx)
'''


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory):
    from flowrl.models.testing import tiny_sd3_pipeline

    folder = tmp_path_factory.mktemp("tiny") / "tiny-sd3"
    tiny_sd3_pipeline().save_pretrained(folder)
    return folder


def _train(tmp_path, config: str) -> list[dict]:
    path = tmp_path / "config.yaml"
    path.write_text(config)
    assert main(["train", str(path), f"train.output_dir={tmp_path / 'runs'}", "train.name=oot"]) == 0
    return [json.loads(l) for l in (tmp_path / "runs" / "oot" / "metrics.jsonl").read_text().splitlines()]


COMMON = """
prompts: {{train: "a red circle|a blue square", eval: null, per_step: 2}}
rewards: [{{name: brightness}}]
loss: {{clip_low: 1.0e-3, clip_high: 1.0e-3, kl_ref: 0.0}}
optim: {{lr: 1.0e-3}}
train: {{max_steps: 2, progress: false, async_reward: "false", num_threads: 1}}
"""


def test_out_of_tree_adapter_kernel_and_wrapping_plan_train_from_yaml(tiny_folder, tmp_path):
    (tmp_path / "my_adapter.py").write_text(ADAPTER)
    (tmp_path / "my_kernel.py").write_text(KERNEL)
    (tmp_path / "my_plan.py").write_text(PLAN)
    records = _train(
        tmp_path,
        textwrap.dedent(f"""
        model:
          family: "{tmp_path}/my_adapter.py:CountingSD3"
          path: "{tiny_folder}"
          lora: {{rank: 2}}
        rollout:
          plan: "{tmp_path}/my_plan.py:Logged"
          inner: {{plan: chains, group_size: 4, steps: 3, eta: 1.0, kernel: "{tmp_path}/my_kernel.py:half_noise",
                  window: {{mode: all}}}}
        """)
        + COMMON.format(),
    )
    steps = [r for r in records if "reward_mean" in r]
    assert [r["step"] for r in steps] == [1, 2]
    for r in steps:
        assert r["first_step_abs_delta_logp"] == 0.0  # replay through the out-of-tree kernel is exact
        assert r["trained_edges"] == 2 * 4 * 2  # window "all": every step but the last (σ → 0) is an SDE edge
    adapter = import_file(str(tmp_path / "my_adapter.py"), "test")
    kernel = import_file(str(tmp_path / "my_kernel.py"), "test")
    plan = import_file(str(tmp_path / "my_plan.py"), "test")
    assert plan.ROLLOUTS == [2, 2]
    assert sum(kernel.USED) >= 2 * 2 * 4 * 3  # every rollout edge, and again in replay
    assert sum(adapter.CALLS) >= 2 * 2 * 4 * 3


def test_bad_out_of_tree_names_fail_at_load_naming_the_key(tiny_folder, tmp_path, capsys):
    (tmp_path / "my_kernel.py").write_text(KERNEL)
    for overrides, words in [
        ([f"model.family={tmp_path}/nowhere.py:X", f"model.path={tiny_folder}"], ["model.family", "nowhere.py"]),
        (
            [f"model.family={tmp_path}/my_kernel.py:half_noise", f"model.path={tiny_folder}"],
            ["model.family", "FlowModel"],
        ),
        ([f"rollout.kernel={tmp_path}/my_kernel.py:no_such", "loss.objective=clipped"], ["rollout.kernel", "no_such"]),
    ]:
        config = "configs/shapes/grpo.yaml" if "rollout.kernel" in overrides[0] else "configs/shapes/nft.yaml"
        rc = main(["train", config, *overrides, f"train.output_dir={tmp_path / 'runs'}"])
        err = capsys.readouterr().err
        assert rc == 2, err
        for w in words:
            assert w in err, (w, err)


# ---- an objective of its own, from YAML -----------------------------------------------------------

OBJECTIVE = '''
from dataclasses import dataclass
from typing import ClassVar

import torch

from flowrl.objectives.base import Batch, Objective

SEEN = []    # the keys of every instance built (the config check builds one, the trainer another)
LOSSES = []  # every loss it returned: (value, whether it carries a gradient)


@dataclass
class WeightedFlowMatching(Objective):
    """Flow matching on the leaves' clean latents at one noise level ``t``, each leaf's error weighted by
    1 + ``adv_weight``·advantage: an objective written outside flowrl/, on the Objective base alone."""

    t: float = 0.5
    adv_weight: float = 1.0
    tag: str = "none"

    trains_on: ClassVar[str] = "leaves"

    def __post_init__(self):
        if not 0.0 < self.t < 1.0:
            raise ValueError(f"loss.t={self.t} must be in (0, 1)")
        SEEN.append({"t": self.t, "adv_weight": self.adv_weight, "tag": self.tag})

    def batches(self, forest, iteration=0, seed=0, units=None):
        leaves = self.units(forest) if units is None else units
        shape = (leaves.numel(), *forest.all_latents().shape[1:])
        noise = torch.randn(shape, generator=torch.Generator().manual_seed(1000 * seed + iteration))
        return [Batch(leaves, int(leaves.numel()), {"noise": noise})]

    def loss(self, model, forest, batch, cond):
        x0 = forest.all_latents()[batch.index].to(model.device)
        eps = batch.extra["noise"].to(model.device)
        x_t = (1.0 - self.t) * x0 + self.t * eps
        t = torch.full((x0.shape[0],), self.t)
        v = model.velocity(x_t, t, cond.select(forest.group[batch.index]), forest.guidance)
        error = ((v - (eps - x0)) ** 2).flatten(1).mean(1)
        weight = 1.0 + self.adv_weight * forest.advantage[batch.index].float().to(model.device)
        loss = (weight * error).mean()
        LOSSES.append((float(loss.detach()), loss.requires_grad))
        return loss, {"wfm_loss": loss.detach(), "wfm_t": torch.tensor(self.t)}
'''

SHAPES_RUN = """
model: {{family: {family}, lora: {{rank: 2, alpha: 2}}}}
rollout: {{plan: chains, group_size: 2, steps: 3, eta: 1.0, window: {{mode: all}}}}
rewards: [{{name: shapes, kwargs: {{mode: partial}}}}]
prompts: {{train: "a red circle|a blue square", eval: null, per_step: 2}}
optim: {{lr: 1.0e-3}}
train: {{max_steps: {steps}, checkpoint_every: 0, progress: false, async_reward: "false", num_threads: 1}}
"""


def test_out_of_tree_objective_with_its_own_keys_trains_the_shapes_model_from_yaml(tmp_path):
    (tmp_path / "my_objective.py").write_text(OBJECTIVE)
    records = _train(
        tmp_path,
        SHAPES_RUN.format(family="shapes", steps=2)
        + textwrap.dedent(f"""
        loss:
          objective: "{tmp_path}/my_objective.py:WeightedFlowMatching"
          t: 0.3
          adv_weight: 2.0
          tag: mine
        """),
    )
    objective = import_file(str(tmp_path / "my_objective.py"), "test")
    assert objective.SEEN and all(s == {"t": 0.3, "adv_weight": 2.0, "tag": "mine"} for s in objective.SEEN)
    steps = [r for r in records if "reward_mean" in r]
    assert [r["step"] for r in steps] == [1, 2]
    assert len(objective.LOSSES) == 2 and all(grad for _, grad in objective.LOSSES)  # one micro-batch a step
    for r, (value, _) in zip(steps, objective.LOSSES):
        assert r["wfm_loss"] == pytest.approx(value, rel=1e-5)  # the loop trained on, and logged, its loss
        assert r["wfm_t"] == pytest.approx(0.3)
        assert r["grad_norm"] > 0


def test_a_misspelled_key_of_an_out_of_tree_objective_names_its_keys(tmp_path, capsys):
    (tmp_path / "my_objective.py").write_text(OBJECTIVE)
    config = tmp_path / "config.yaml"
    config.write_text(
        SHAPES_RUN.format(family="shapes", steps=1)
        + f'loss: {{objective: "{tmp_path}/my_objective.py:WeightedFlowMatching", adv_wieght: 2.0}}\n'
    )
    rc = main(["train", str(config), f"train.output_dir={tmp_path / 'runs'}"])
    err = capsys.readouterr().err
    assert rc == 2 and "loss.adv_wieght" in err and "adv_weight" in err, err


# ---- a model family written on the FlowModel base alone, registered out of tree ------------------

FAMILY = '''
import torch

from flowrl.models import ModelFamily, register_model_family
from flowrl.models.base import Conditioning, FlowModel

CALLS = []


class DirectShapes(FlowModel):
    """The embedded shapes pipeline behind the FlowModel contract, written on the base class alone (no
    existing adapter subclassed): text from the pipeline\\'s ``encode_prompt``, velocity from its transformer
    (timestep σ·1000, CFG composed by the base\\'s helpers); schedule, noise, decode and LoRA: the base\\'s."""

    family = "direct_shapes"
    default_lora_targets = ["to_q", "to_k", "to_v", "to_out.0"]

    def __init__(self, pipe, *, device=None, dtype=None, guidance=1.0, height=None, width=None,
                 max_sequence_length=8, negative_prompt="", gradient_checkpointing=False):
        self._init_pipeline(pipe, device, dtype, ("text_encoder", "text_encoder_2", "vae"), gradient_checkpointing)
        self.guidance, self.negative_prompt = float(guidance), negative_prompt
        self.max_sequence_length = int(max_sequence_length)
        patch = self.vae_scale_factor * pipe.transformer.config.patch_size  # latent pixels per token side
        self._init_size(height, width, pipe.transformer.config.sample_size * self.vae_scale_factor, patch,
                        "vae_scale_factor × patch_size")

    @classmethod
    def from_pretrained(cls, path=None, *, dtype=torch.float32, device="cpu", pipeline_kwargs=None, **kw):
        from flowrl.shapes.pipeline import SHIPPED_DIR, generation_defaults, load_shapes_pipeline

        path = path or SHIPPED_DIR
        defaults = generation_defaults(path)
        options = {"height": defaults["height"], "width": defaults["width"],
                   "max_sequence_length": defaults["max_sequence_length"], "guidance": defaults["guidance_scale"]}
        return cls(load_shapes_pipeline(path, device=device, dtype=dtype), device=device, dtype=dtype,
                   **{**options, **kw})

    def _encode_one(self, prompt):
        embeds, _, pooled, _ = self.pipe.encode_prompt(
            prompt=[prompt], prompt_2=None, prompt_3=None, device=self.device, do_classifier_free_guidance=False,
            max_sequence_length=self.max_sequence_length)
        return {"prompt_embeds": embeds, "pooled": pooled}

    def velocity(self, x, sigma, cond, guidance=None):
        CALLS.append(x.shape[0])
        g = self.guidance if guidance is None else float(guidance)
        sigma = self._check_inputs(x, sigma, cond)
        cfg = self.uses_cfg(g)
        text = self._cfg_text(cond, cfg)
        hidden = x.to(device=self.device, dtype=self.dtype)
        timestep = sigma * 1000.0
        if cfg:
            hidden, timestep = torch.cat([hidden, hidden]), torch.cat([timestep, timestep])
        with self.autocast_context():
            out = self.forward_module(hidden_states=hidden, timestep=timestep,
                                      encoder_hidden_states=text["prompt_embeds"].to(self.device, self.dtype),
                                      pooled_projections=text["pooled"].to(self.device, self.dtype),
                                      return_dict=False)[0].float()
        return self._cfg_combine(out, g) if cfg else out


register_model_family("direct_shapes", ModelFamily(None, f"{__file__}:DirectShapes", needs_path=False))
'''


@pytest.fixture
def direct_family(tmp_path):
    """The file of FAMILY, imported (it registers ``direct_shapes``); the registration is undone after."""
    from flowrl.models import MODEL_FAMILIES

    (tmp_path / "direct_family.py").write_text(FAMILY)
    module = import_file(str(tmp_path / "direct_family.py"), "test")
    try:
        yield module
    finally:
        MODEL_FAMILIES.pop("direct_shapes", None)


def test_a_family_written_on_the_flowmodel_base_samples_and_trains_once_registered(direct_family, tmp_path):
    import torch

    from flowrl import load_shapes_model, sample
    from flowrl.models import load_model
    from flowrl.models.sd3 import SD3FlowModel
    from flowrl.rollout.chains import Chains

    model = load_model("direct_shapes", None)
    assert type(model).__mro__[1] is direct_family.FlowModel and not isinstance(model, SD3FlowModel)
    out = sample(model, ["a red circle", "two blue squares"], Chains(group_size=2, steps=3, eta=1.0))
    assert out.images.shape == (4, 3, 32, 32) and bool(torch.isfinite(out.images).all())
    assert sum(direct_family.CALLS) > 0
    reference = load_shapes_model()  # the in-tree adapter of the same pipeline: the same velocity
    x, cond = model.noise([0, 1]), model.encode(["a red circle"] * 2, 3.0)
    same = reference.velocity(x, 0.7, reference.encode(["a red circle"] * 2, 3.0), 3.0)
    assert torch.equal(model.velocity(x, 0.7, cond, 3.0), same)

    direct_family.CALLS.clear()
    records = _train(
        tmp_path,
        SHAPES_RUN.format(family="direct_shapes", steps=1)
        + "loss: {clip_low: 1.0e-3, clip_high: 1.0e-3, kl_ref: 0.0}\n",
    )
    steps = [r for r in records if "reward_mean" in r]
    assert [r["step"] for r in steps] == [1]
    assert steps[0]["first_step_abs_delta_logp"] == 0.0  # replay through its velocity is exact
    assert steps[0]["grad_norm"] > 0
    assert sum(direct_family.CALLS) >= 2 * 2 * 3 + steps[0]["trained_edges"]  # rollout, then replay of the edges
