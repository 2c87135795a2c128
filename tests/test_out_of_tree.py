"""A model adapter, a transition kernel and a wrapping rollout plan defined outside flowrl/ train from YAML
alone (``path/file.py:Name`` in ``model.family``, ``rollout.kernel``, ``rollout.plan``), with replay still
exact (docs/extending.md)."""
from __future__ import annotations

import json
import textwrap

import pytest

from flowrl.cli import main
from flowrl.plugins import import_file

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
from dataclasses import dataclass, field

from flowrl import components
from flowrl.rollout.base import RolloutPlan

ROLLOUTS = []


@dataclass
class Logged(RolloutPlan):
    """Wraps any plan (``inner`` / ``inner_args``, built like explore's and probed's) and logs its rollouts."""

    inner: str = "chains"
    inner_args: list[str] = field(default_factory=list)

    def __post_init__(self):
        self.plan = components.build_nested(components.PLAN, self.inner, self.inner_args, name_key="rollout.inner",
                                            args_key="rollout.inner_args")

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
loss: {{clip_low: 1.0e-3, clip_high: 1.0e-3, beta: 0.0}}
optim: {{lr: 1.0e-3}}
train: {{max_steps: 2, progress: false, async_reward: "false", num_threads: 1}}
"""


def test_out_of_tree_adapter_kernel_and_wrapping_plan_train_from_yaml(tiny_folder, tmp_path):
    (tmp_path / "my_adapter.py").write_text(ADAPTER)
    (tmp_path / "my_kernel.py").write_text(KERNEL)
    (tmp_path / "my_plan.py").write_text(PLAN)
    records = _train(tmp_path, textwrap.dedent(f"""
        model:
          family: "{tmp_path}/my_adapter.py:CountingSD3"
          path: "{tiny_folder}"
          lora: {{rank: 2}}
        rollout:
          plan: "{tmp_path}/my_plan.py:Logged"
          inner: chains
          inner_args: [group_size=4, steps=3, eta=1.0, "kernel={tmp_path}/my_kernel.py:half_noise", window.mode=all]
        """) + COMMON.format())
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
        ([f"model.family={tmp_path}/my_kernel.py:half_noise", f"model.path={tiny_folder}"], ["model.family", "FlowModel"]),
        ([f"rollout.kernel={tmp_path}/my_kernel.py:no_such", "loss.objective=clipped"], ["rollout.kernel", "no_such"]),
    ]:
        config = "configs/shapes/grpo.yaml" if "rollout.kernel" in overrides[0] else "configs/shapes/nft.yaml"
        rc = main(["train", config, *overrides, f"train.output_dir={tmp_path / 'runs'}"])
        err = capsys.readouterr().err
        assert rc == 2, err
        for w in words:
            assert w in err, (w, err)
