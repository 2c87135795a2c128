"""Settings that would silently do the wrong thing fail at load, naming the key (issue 24, item 4)."""

from __future__ import annotations

import pytest

from flowrl.config.schema import ConfigError, TrainConfig


@pytest.mark.parametrize(
    "override, words",
    [
        ("optim.grad_clip=-1", ["optim.grad_clip=-1", "> 0"]),  # would reverse every update
        ("optim.grad_clip=0", ["optim.grad_clip=0", "> 0"]),  # would train nothing
        ("train.checkpoint_every=-1", ["train.checkpoint_every=-1", ">= 0"]),
        ("train.keep_last=-1", ["train.keep_last=-1", ">= 0"]),
        ("eval.every=-1", ["eval.every=-1", ">= 0"]),
        ("eval.every_minutes=-0.5", ["eval.every_minutes=-0.5", ">= 0"]),
        ("rollout.max_batch=0", ["rollout.max_batch=0", "> 0"]),
        ("eval.images_per_prompt=0", ["eval.images_per_prompt=0", "> 0"]),
        ("train.num_threads=0", ["train.num_threads=0", "> 0"]),
        ("model.lora.rank=0", ["model.lora.rank=0", "> 0"]),
        ("train.max_minutes=-2", ["train.max_minutes=-2", ">= 0"]),
        ("train.name=../../x", ["train.name='../../x'", "inside train.output_dir"]),
        ("train.name=/tmp/x", ["train.name='/tmp/x'", "inside train.output_dir"]),
    ],
)
def test_meaningless_values_fail_at_load_naming_the_key(override, words):
    with pytest.raises(ConfigError) as err:
        TrainConfig.from_yaml("configs/shapes/grpo.yaml", [override])
    for w in words:
        assert w in str(err.value), (w, str(err.value))
