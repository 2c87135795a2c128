"""The trainer's checkpoints: what one holds (the step, the updater's, prompt source's, objective's and plan's
state, the policy's guidance, the training time, the callbacks' state: the eval guard's start values and trip, the jobs
in flight of an asynchronous pipeline), writing it (``checkpoints/step-N``, sharded or not), the consolidated
``export/``, and reading one back to resume.

:class:`TrainerCheckpoints` is mixed into :class:`~flowrl.training.trainer.Trainer`, whose parts it saves and restores:
``cfg``, ``model``, ``group``, ``folder``, ``updater``, ``prompts``, ``objective``, ``plan``, ``callbacks``,
``rollouts``, ``sharding``, ``step``, ``guidance``, ``train_seconds`` (and it uses ``ema_weights()``, ``optimizer``,
``run_dir``; a resume sets ``resumed_from``). The run folder's protection, the atomic writes and the
checks of what is read are :class:`~flowrl.run.folder.RunFolder`'s; the shards are
:mod:`flowrl.run.sharded_checkpoint`'s."""

from __future__ import annotations

from pathlib import Path

import torch

from flowrl.distributed.sharding import full_state
from flowrl.run.checkpoint import save_weights, write_export
from flowrl.run.sharded_checkpoint import SHARDED_DIR, load_shards, merge_sharded, shards_of, split_sharded


class TrainerCheckpoints:
    """Saving, exporting and resuming a :class:`~flowrl.training.trainer.Trainer` (mixed into it)."""

    def save_checkpoint(self) -> Path | None:
        """``checkpoints/step-N`` of the current step (main process); never of non-finite weights. Sharded,
        every process writes its shards into it too (:mod:`flowrl.run.sharded_checkpoint`)."""
        self.group.wait()
        if not self.updater.weights_finite():
            raise FloatingPointError(
                f"the weights at step {self.step} are not finite: no checkpoint was written, the previous one is intact"
            )
        state = {
            "step": self.step,
            **self.updater.state_dict(),
            "config": self.cfg.to_dict(),
            "torch_rng": torch.get_rng_state(),
            "prompts": self.prompts.state_dict(),
            "objective": self.objective.state_dict(),
            "plan": self.plan.state_dict(),
            "policy_guidance": self.guidance,
            "train_seconds": self.train_seconds,
            "callbacks": {cb.key: cb.state_dict() for cb in self.callbacks},  # the eval guard's under "guard"
            "pipeline": self.rollouts.state_dict() if self.rollouts is not None else None,  # jobs in flight (async)
        }
        if self.sharding is not None:
            state, extra = split_sharded(state)
            lora = None
            if self.model.has_lora:  # small: consolidated in every checkpoint (pipe.load_lora_weights reads it)
                with self.ema_weights():
                    lora = full_state(self.model)

            def write_lora(folder: Path) -> None:
                if lora is not None:
                    save_weights(self.model, folder, lora)

            path = self.folder.save_sharded(
                self.step, shards_of(self.model.trainable, self.optimizer, extra), write_lora, state
            )
            self.group.wait()
            return path
        path = None
        if self.group.is_main:

            def write_weights(folder: Path) -> None:
                with self.ema_weights():
                    save_weights(self.model, folder)
                if self.updater.ema is not None:  # live (non-EMA) weights too, so resume continues exactly
                    save_weights(self.model, folder / "live")

            path = self.folder.save(self.step, write_weights, state)
        self.group.wait()
        return path

    def export(self) -> Path | None:
        """``export/``: the trained weights consolidated (the EMA's where kept), as a LoRA in the diffusers
        format or a full ``transformer/`` folder that ``from_pretrained`` reads on one GPU; written atomically
        by the main process (every process gathers). The path, on the main process."""
        with self.ema_weights():
            whole = full_state(self.model)
        path = None
        if self.group.is_main:
            path = write_export(self.run_dir / "export", lambda folder: save_weights(self.model, folder, whole))
        self.group.wait()
        return path

    def _read(self, path: Path) -> dict:
        return self.folder.read_intact(
            path,
            self.model,
            self.updater.weights_finite,
            sharded=self._read_shards if self.sharding is not None else None,
        )

    def _read_shards(self, path: Path, state: dict) -> dict:
        """``state`` (a sharded checkpoint's, read) with the shards of ``path`` loaded: the weights and the
        optimizer into the sharded model, the trainer state's sharded tensors put back at their places."""
        template = {
            "step": 0,
            **self.updater.state_dict(),
            "objective": self.objective.state_dict(),
            "plan": self.plan.state_dict(),
        }
        _, extra = split_sharded(template)
        extra = load_shards(path / SHARDED_DIR, self.model.trainable, self.optimizer, extra, self.group.dist_group)
        return merge_sharded(state, extra)

    def load_checkpoint(self, path: Path, state: dict | None = None) -> None:
        """Continue from checkpoint ``path`` (``state``: already read; else read here, and a damaged or refused
        checkpoint raises)."""
        state = self._read(path) if state is None else state
        self.updater.load_state_dict(state)
        self.step = int(state["step"])
        self.train_seconds = float(state.get("train_seconds", 0.0))
        self.prompts.load_state_dict(state.get("prompts"), where=str(path))
        self.objective.load_state_dict(state.get("objective"))
        self.plan.load_state_dict(state.get("plan"))
        saved = dict(
            state.get("callbacks") or {"guard": state.get("guard")}
        )  # before callbacks kept state: the guard's
        for callback in self.callbacks:
            callback.load_state_dict(saved.get(callback.key))  # e.g. the eval guard's start values and trip
        if self.rollouts is not None:
            self.rollouts.load_state_dict(state.get("pipeline"))  # the jobs in flight, sampled again as they were
        self.resumed_from = path
        self.plan.after_update(self.model)  # the weights changed: a plan's copy of the policy follows them
