"""Run by tests/test_distributed.py under ``torch.distributed.run`` (2 CPU processes, gloo), or alone.

Trains the tiny SD3 pipeline for 2 iterations (adaptive prompt sampling, fed from every rank's groups)
and writes, per rank, the world size, the prompts drawn, the advantages of its leaves, the global
training metrics (2 optimizer steps per iteration), the prompt statistics and the final LoRA weights to
``OUT/rank<r>.pt``.

``distributed_worker.py eval OUT`` (run by tests/test_eval_reduce.py): the held-out eval of the shapes model on
each prompt list of ``tests.test_eval_reduce.PROMPT_LISTS``, its metrics to ``OUT/<list>.rank<r>.json`` as each
eval ends (so a later eval that hangs leaves the earlier ones to compare).
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from flowrl.training.trainer import Trainer  # noqa: E402
from tests.conftest import make_model  # noqa: E402
from tests.test_trainer import tiny_config  # noqa: E402


def main(out: str) -> None:
    torch.set_num_threads(1)
    cfg = tiny_config(
        Path(out),
        "dist",
        "train.max_steps=2",
        "prompts.eval=null",
        "credit.scale=global",
        "prompts.sampling=adaptive",
        "train.updates_per_epoch=2",
    )
    trainer = Trainer(cfg, model=make_model("sd3"))
    initial = {n: p.detach().clone() for n, p in trainer.model.trainable.named_parameters() if p.requires_grad}
    advantages, records, drawn = [], [], []
    for it in range(2):
        forest, _ = trainer.rollout(it)
        drawn.append(trainer.prompts.batch(it))
        trainer._observe_spread(forest)
        trainer.credit.assign(forest, gather=trainer.group.gather)
        advantages.append(forest.advantage[forest.leaves()].clone())
        records.append(trainer.update(forest, it))
    lora = {n: p.detach().clone() for n, p in trainer.model.trainable.named_parameters() if p.requires_grad}
    torch.save(
        {
            "world": trainer.world,
            "rank": trainer.rank,
            "advantages": advantages,
            "records": records,
            "lora": lora,
            "initial": initial,
            "drawn": drawn,
            "prompt_stats": trainer.prompts.state_dict(),
            "distributed_type": str(trainer.accelerator.distributed_type),
        },
        Path(out) / f"rank{trainer.rank}.pt",
    )


def main_eval(out: str) -> None:
    import json

    from accelerate import Accelerator

    from flowrl.distributed.process_group import ProcessGroup
    from tests.test_eval_reduce import PROMPT_LISTS, held_out_eval

    torch.set_num_threads(1)
    group = ProcessGroup(Accelerator(cpu=True))
    for name, prompts in PROMPT_LISTS.items():
        metrics = held_out_eval(prompts, group).run()[0]
        (Path(out) / f"{name}.rank{group.rank}.json").write_text(json.dumps({"world": group.world, **metrics}))
    group.close()


if __name__ == "__main__":
    if sys.argv[1] == "eval":
        main_eval(sys.argv[2])
    else:
        main(sys.argv[1])
