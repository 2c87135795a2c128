"""Run by tests/test_sharding.py alone or under ``torch.distributed.run`` (2 CPU processes, gloo):
``sharded_worker.py OUT SHARD TUNE [key=value ...]`` trains the shapes job (the main job's objective and
guided teacher, small: 2 prompt groups of 4, 4 steps) with ``model.shard=SHARD`` (ddp | fsdp) and ``TUNE``
(lora | full) through ``Trainer.train()``, then writes per rank ``OUT/rank<r>.pt``: the world, the metric
records, the trained weights gathered whole, and the bytes this process holds of the transformer's
parameters and of the AdamW state, with the whole model's for comparison.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from flowrl.config.schema import TrainConfig  # noqa: E402
from flowrl.distributed.sharding import local, whole  # noqa: E402
from flowrl.paths import DEFAULT_CONFIG  # noqa: E402
from flowrl.training.trainer import Trainer  # noqa: E402


def shapes_config(out: Path, shard: str, tune: str, *extra: str) -> TrainConfig:
    """The main job, small enough for CPU processes: 2 prompts × 4 leaves of 4 ODE steps, a 2-step eval. An
    ``extra`` item ``config=PATH`` starts from another shapes preset instead (then give its rollout sizes)."""
    configs = [e[len("config=") :] for e in extra if e.startswith("config=")]
    sizes = [] if configs else ["rollout.group_size=4", "rollout.steps=4"]
    extra = tuple(e for e in extra if not e.startswith("config="))
    return TrainConfig.from_yaml(
        configs[0] if configs else str(DEFAULT_CONFIG),
        [
            *sizes,
            "rollout.max_batch=8",
            "prompts.per_step=2",
            "eval.steps=2",
            "eval.num_prompts=2",
            "eval.images_per_prompt=1",
            "eval.grid_prompts=0",
            "eval.at_start=false",
            "train.max_steps=3",
            "train.checkpoint_every=1",
            "train.num_threads=1",
            "train.progress=false",
            "train.pipeline=sync",  # the sharded loop itself (tests/test_pipeline_layout.py: FSDP2 trainers, async)
            f"train.output_dir={out}",
            "train.name=run",
            f"model.shard={shard}",
            f"model.full_finetune={'true' if tune == 'full' else 'false'}",
            "model.lora.rank=4",
            *extra,
        ],
    )


def pipeline_images(pipe) -> torch.Tensor:
    """Images [2, 3, H, W] of two prompts from ``pipe(...)`` itself (4 steps, guidance 1, seeded)."""
    from flowrl.shapes.pipeline import generation_defaults

    d = generation_defaults()
    return pipe(
        prompt=["a red circle", "two blue squares"],
        num_inference_steps=4,
        guidance_scale=1.0,
        height=d["height"],
        width=d["width"],
        max_sequence_length=d["max_sequence_length"],
        generator=torch.Generator().manual_seed(0),
        output_type="pt",
    ).images


def nbytes(tensors) -> int:
    return sum(local(t).numel() * t.element_size() for t in tensors)


def main(out: str, shard: str, tune: str, *extra: str) -> None:
    torch.set_num_threads(1)
    trainer = Trainer(shapes_config(Path(out), shard, tune, *extra))
    records = trainer.train()
    if trainer.rolls_out:  # a launched rollout process (train.rollout_processes): it holds no trained state
        trainer.group.close()
        return
    with trainer.sampling(), torch.no_grad():  # what the next rollout samples with: the diffusers pipeline's own call
        images = pipeline_images(trainer.model.pipe)
    module = trainer.model.trainable
    weights = {n: whole(p).detach().clone() for n, p in module.named_parameters() if p.requires_grad}
    optim = [t for state in trainer.optimizer.state.values() for t in state.values() if t.dim() > 0]
    torch.save(
        {
            "world": trainer.world,
            "rank": trainer.rank,
            "records": records,
            "weights": weights,
            "images": images,
            "param_bytes": nbytes(module.parameters()),
            "optim_bytes": nbytes(optim),
            "whole_param_bytes": sum(whole(p).numel() * p.element_size() for p in module.parameters()),
            "whole_optim_bytes": sum(whole(t).numel() * t.element_size() for t in optim),
        },
        Path(out) / f"rank{trainer.rank}.pt",
    )
    trainer.group.close()  # as `flowrl train` does: exiting with gloo's threads up can abort (SIGABRT) at teardown


if __name__ == "__main__":
    main(*sys.argv[1:])
