"""Run by tests/test_context_parallel.py alone or under ``torch.distributed.run`` (2 CPU processes, gloo):
``context_parallel_worker.py PIPELINE OUT [--train-only] [key=value ...]`` builds a tiny Wan run from the pipeline
saved in ``PIPELINE`` (Flow-GRPO chains at guidance 2, 2 prompts × 2 videos of 5 frames, 3 steps), then writes per
rank ``OUT/rank<r>.pt``: the processes, the objective's gradient at the initial weights (flat, reduced over the
processes, and the loss's sample count; not with ``--train-only``), the metric records of a 2-iteration run and its
trained LoRA gathered whole."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from flowrl.config.schema import TrainConfig  # noqa: E402
from flowrl.distributed.sharding import full_state  # noqa: E402
from flowrl.training.trainer import Trainer  # noqa: E402

PROMPTS = "a red circle|two blue square|a green cat|a small dog"


def wan_config(pipeline: Path, out: Path, name: str, *extra: str) -> TrainConfig:
    """The tiny Wan run (module docstring) in ``out/name``."""
    return TrainConfig.from_yaml(
        None,
        [
            "model.family=wan",
            f"model.path={pipeline}",
            "model.guidance=2.0",
            "model.height=32",
            "model.width=48",
            "model.max_sequence_length=12",
            "model.kwargs={num_frames: 5}",
            "model.lora={rank: 4, alpha: 8, init: default}",
            "rollout={plan: chains, group_size: 2, steps: 3, kernel: flow_grpo, eta: 0.7, max_batch: 8}",
            "rollout.window={mode: fixed, start: 0, size: 2}",
            "rewards=[{name: brightness, kwargs: {frame_stride: 2}}, {name: temporal_consistency}]",
            "loss={clip_low: 0.2, clip_high: 0.2, kl_ref: 0.01}",
            "optim.lr=3e-3",
            f"prompts.train={PROMPTS}",
            "prompts.per_step=2",
            "prompts.eval=null",
            "eval.every=0",
            "eval.at_start=false",
            "train.max_steps=2",
            "train.checkpoint_every=1",
            "train.progress=false",
            "train.num_threads=1",
            "train.async_reward=false",
            f"train.output_dir={out}",
            f"train.name={name}",
            *extra,
        ],
    )


def main() -> None:
    pipeline, out, *extra = sys.argv[1:]
    out = Path(out)
    gradient = samples = None
    if "--train-only" not in extra:
        probe = Trainer(wan_config(pipeline, out, "gradient", *extra))
        gradient, samples = probe.policy_gradient(0)
    extra = [e for e in extra if e != "--train-only"]
    trainer = Trainer(wan_config(pipeline, out, "run", *extra))
    records = trainer.train()
    lora = full_state(trainer.model)
    torch.save(
        {
            "processes": trainer.group.processes,
            "replicas": trainer.group.world,
            "gradient": gradient,
            "samples": samples,
            "records": records,
            "lora": lora,
        },
        out / f"rank{trainer.group.global_rank}.pt",
    )
    trainer.group.close()


if __name__ == "__main__":
    main()
