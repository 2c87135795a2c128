"""The update of one iteration: optimizer steps over the objective's micro-batches of a forest.

The objective (:mod:`flowrl.objectives.base`) says what it trains on, cuts its micro-batches and computes their
loss; the :class:`Updater` only zero-grads, back-propagates (each micro-batch weighted by its share of all
processes' units), averages gradients over processes, clips, and steps — skipping a step whose loss or
gradient is not finite. With an fp16 transformer it scales the loss dynamically (``optim.loss_scaling``;
:mod:`flowrl.models.dtypes` says why). Its diagnostics are reduced over processes, so every rank logs the
global values. It also owns what changes with the weights: the optimizer, the loss scale, the
learning-rate schedule and the EMA of the weights used for evals and saving.
"""

from __future__ import annotations

import contextlib
import math
import warnings
from typing import Any, Iterator

import torch

from flowrl.config.schema import ConfigError, TrainConfig
from flowrl.core.seeding import derive_seed
from flowrl.distributed.process_group import ProcessGroup
from flowrl.distributed.sharding import local, whole
from flowrl.objectives.base import Batch, Objective
from flowrl.rollout.forest import Forest
from flowrl.training.step_sums import STEPS, UNITS, DeviceSums, fold_steps
from flowrl.training.step_sums import host_values as host_values  # re-exported: importable from here as before


@contextlib.contextmanager
def training_mode(module: torch.nn.Module) -> Iterator[None]:
    """``module`` in training mode within the block, its own mode restored after it."""
    was = module.training
    module.train()
    try:
        yield
    finally:
        module.train(was)


class Updater:
    """Optimizer, schedule and EMA of ``params``; :meth:`update` runs ``train.inner_epochs`` ×
    ``train.updates_per_epoch`` optimizer steps of ``objective`` on one forest."""

    MAX_NONFINITE_STREAK = 3  # optimizer steps skipped in a row before the run stops
    MAX_OVERFLOW_STREAK = 12  # loss-scale overflows in a row (the scale / 4096) before they count as failures

    def __init__(
        self,
        cfg: TrainConfig,
        model,
        objective: Objective,
        plan,
        params: list[torch.nn.Parameter],
        group: ProcessGroup,
        sharded: bool = False,
    ):
        self.cfg, self.model, self.objective, self.plan = cfg, model, objective, plan
        self.params, self.group, self.sharded = params, group, sharded
        # averages the gradients over processes once per optimizer step, overlapping the backward that ends
        # the accumulation: the last micro-batch's, unless the objective may add an auxiliary term after it
        # (then all of it is reduced after the backward). Sharded (FSDP2), the backward reduce-scatters itself.
        self.reducer = group.gradient_reducer(params, enabled=not sharded)
        self._overlap = type(objective).auxiliary is Objective.auxiliary
        self.optimizer = self._make_optimizer()
        self.scheduler = self._make_scheduler()
        self.ema = [p.detach().clone() for p in params] if cfg.train.ema > 0 else None
        self.nonfinite_streak = 0
        self.scaler = self._make_scaler()
        self.overflows = 0  # steps skipped by the loss scaler (scale too high; not failures)
        self.overflow_streak = 0  # overflows since the last step taken
        self._loss_finite = torch.ones(
            (), dtype=torch.bool
        )  # every loss of the step finite (on the device; read on overflow)
        self._batches: list[Batch] = []

    def _make_scaler(self) -> torch.amp.GradScaler:
        """Dynamic loss scaling (``optim.loss_scaling``; ``auto``: when the transformer computes in fp16,
        whose range the per-element gradients of a mean-reduced loss fall below). Disabled, it is the identity."""
        from flowrl.models.dtypes import computes_in_fp16

        choice = str(self.cfg.optim.loss_scaling).lower()  # YAML true/false arrive as True/False
        enabled = choice == "true" or (choice == "auto" and computes_in_fp16(self.model))
        device = self.params[0].device.type if self.params else "cpu"
        return torch.amp.GradScaler(device, enabled=enabled)

    def _make_optimizer(self) -> torch.optim.Optimizer:
        o = self.cfg.optim
        kwargs = dict(lr=o.lr, betas=tuple(o.betas), weight_decay=o.weight_decay, eps=o.eps)
        if o.use_8bit:
            try:
                import bitsandbytes as bnb
            except ImportError as e:
                raise ConfigError("optim.use_8bit=true needs bitsandbytes: pip install 'flowrl-align[quant]'") from e
            return bnb.optim.AdamW8bit(self.params, **kwargs)
        return torch.optim.AdamW(self.params, **kwargs)

    def _make_scheduler(self):
        from diffusers.optimization import get_scheduler

        o, t = self.cfg.optim, self.cfg.train
        name = "constant_with_warmup" if o.schedule == "constant" else o.schedule
        total = max(1, t.max_steps * t.inner_epochs * t.updates_per_epoch)
        return get_scheduler(name, self.optimizer, num_warmup_steps=o.warmup_steps, num_training_steps=total)

    # ---- back-propagation ---------------------------------------------------------------------
    def _backward(
        self,
        forest: Forest,
        cond,
        part: list[Batch],
        n_global: float,
        sums: DeviceSums,
        final: bool = False,
        padding: int = 0,
    ) -> int:
        """Back-propagate the objective's loss of the micro-batches ``part``, each scaled so the optimizer
        step averages over the ``n_global`` units (edges or leaves) of all processes, and fold their
        diagnostics into ``sums`` (size-weighted sums; the objective's extremes by min/max), on the device:
        no host synchronisation per micro-batch. ``final``: the last micro-batch's backward ends the
        accumulation (its gradients start reducing as they are ready). Returns the units seen."""
        count = 0
        for j, b in enumerate(part):
            loss, diag = self.objective.loss(self.model, forest, b, cond)
            if self.scaler.is_enabled():
                self._loss_finite = self._loss_finite & torch.isfinite(loss.detach())
            last = final and j == len(part) - 1
            with self.reducer.final() if last else contextlib.nullcontext():
                self.scaler.scale(loss * (b.size * self.group.world / n_global)).backward()
            sums.add(diag, b.size)
            count += b.size
        for _ in range(padding):  # sharded: as many forwards and backwards as the busiest process, at weight 0
            loss, _ = self.objective.loss(self.model, forest, self._padding(forest), cond)
            (loss * 0.0).backward()
        return count

    def _padding_count(self, part: list[Batch]) -> int:
        """The weight-0 micro-batches this process adds to ``part`` so that, sharded, every process runs as
        many (each forward gathers collectively); 0 unsharded."""
        return int(self.group.max(len(part))) - len(part) if self.sharded else 0

    def _padding(self, forest: Forest) -> Batch:
        """A micro-batch whose loss, times 0, keeps this process's forwards in step with the others' under
        sharding: one of this iteration's own, else one over every unit the plan made trainable."""
        if self._batches:
            return self._batches[0]
        every = forest.units(
            self.objective.describe().trains_on, flat=True, weighted=False
        )  # whatever the credit rule weighted
        return self.objective.batches(forest, 0, self.cfg.train.seed, units=every)[0]

    def update(self, forest: Forest, iteration: int) -> dict[str, float]:
        """:meth:`_update` with the transformer in training mode, back in eval mode after it (rollouts sample in eval
        mode: a LoRA dropout stays off, and a compiled block sees one mode per phase, so nothing recompiles)."""
        with training_mode(self.model.trainable):
            return self._update(forest, iteration)

    def _update(self, forest: Forest, iteration: int) -> dict[str, float]:
        """Inner epochs of optimizer steps over the objective's micro-batches of ``forest``; returns the
        diagnostics (the objective's, averaged per unit; its ``first_step_*`` before any weight changed;
        grad norm, skipped steps, units trained, lr)."""
        cfg, objective = self.cfg, self.objective
        facts = objective.describe()
        extremes = facts.extremes
        objective.begin_iteration(self.model, forest)
        cond = objective.encode(self.model, forest)
        batches = self._batches = objective.batches(forest, iteration, cfg.train.seed)
        step_diags: list[
            tuple[DeviceSums, float, DeviceSums | None]
        ] = []  # per optimizer step: (diagnostics, units, auxiliary)
        skipped, overflows = 0, self.overflows
        grad_norms = []
        for epoch in range(cfg.train.inner_epochs):
            order = batches
            if epoch > 0:
                gen = torch.Generator().manual_seed(derive_seed(cfg.train.seed, iteration, "shuffle", epoch))
                order = [batches[i] for i in torch.randperm(len(batches), generator=gen).tolist()]
            U = cfg.train.updates_per_epoch
            for u in range(U):
                part = order[u * len(order) // U : (u + 1) * len(order) // U]
                n_global = self.group.sum(sum(b.size for b in part))
                if n_global == 0:  # on every process alike
                    continue
                self.optimizer.zero_grad(set_to_none=True)
                self._loss_finite = torch.ones((), dtype=torch.bool)
                step_sums = DeviceSums(extremes)
                seen = self._backward(
                    forest, cond, part, n_global, step_sums, final=self._overlap, padding=self._padding_count(part)
                )
                aux = objective.auxiliary(self.model, forest, cond)
                aux_sums = None
                if aux is not None:
                    if self.scaler.is_enabled():
                        self._loss_finite = self._loss_finite & torch.isfinite(aux[0].detach())
                    self.scaler.scale(aux[0]).backward()
                    aux_sums = DeviceSums({})
                    aux_sums.add(aux[1], 1)
                step_diags.append((step_sums, float(seen), aux_sums))
                grad_norm = self._step(iteration)
                if grad_norm is None:
                    skipped += 1
                else:
                    grad_norms.append(grad_norm)
        diag_sums, aux_sums, first_sums = fold_steps(step_diags, extremes, facts.first_step_keys)
        self.optimizer.zero_grad(set_to_none=True)
        out = self._averages(diag_sums, extremes)
        out.update(self._averages(aux_sums, {}, units=STEPS))
        first = self._averages(first_sums, extremes)
        out.update({f"first_step_{k}": first.get(k, 0.0) for k in facts.first_step_keys})
        out["grad_norm"] = sum(grad_norms) / len(grad_norms) if grad_norms else 0.0  # the same on every rank
        out["skipped_steps"] = float(skipped)
        if self.scaler.is_enabled():
            out["loss_scale"] = self.scaler.get_scale()
            out["loss_scale_overflows"] = float(self.overflows - overflows)
        out[f"trained_{facts.trains_on}"] = self.group.sum(sum(b.size for b in batches))
        out["lr"] = self.scheduler.get_last_lr()[0]
        return out

    def _averages(self, sums: dict[str, float], extremes: dict, units: str = UNITS) -> dict[str, float]:
        """Per-unit averages of size-weighted sums over every process (extremes as they are): the same
        diagnostics on every rank, equal to one process's over all the units."""
        total = self.group.reduce_sums(sums, extremes)
        n = total.pop(units, 0.0)
        return {k: v if k in extremes else v / n for k, v in total.items()} if n else {}

    def _step(self, iteration: int) -> float | None:
        """Average, unscale, clip and apply the gradients; the gradient norm, or None for a skipped step. With
        loss scaling, a non-finite gradient of losses finite on every process is an overflow: the scale halves
        and the step is skipped without counting as a failure, unless the scale has fallen below 1 or
        ``MAX_OVERFLOW_STREAK`` overflows came in a row (then it counts, so a gradient that is NaN for another
        reason still stops the run). A non-finite loss keeps the scale and counts."""
        self.reducer.finish()  # the mean over processes of every grad (a missing one counts 0)
        self.scaler.unscale_(self.optimizer)  # no-op without loss scaling
        grad_norm = float(whole(torch.nn.utils.clip_grad_norm_(self.params, self.cfg.optim.grad_clip)))
        if not math.isfinite(grad_norm):  # a non-finite loss or gradient: never let it into the weights
            # grad_norm is the same on every process, so all of them are here and agree on the losses
            losses_finite = self.scaler.is_enabled() and self.group.sum(0.0 if bool(self._loss_finite) else 1.0) == 0
            if losses_finite:
                self.scaler.update()  # an overflow: halve the scale
                self.overflow_streak += 1
            else:
                self.scaler.update(self.scaler.get_scale())  # clears the step's state, keeps the scale
            tolerated = (
                losses_finite and self.scaler.get_scale() >= 1.0 and self.overflow_streak <= self.MAX_OVERFLOW_STREAK
            )
            if tolerated:
                self.optimizer.zero_grad(set_to_none=True)
                self.overflows += 1
            else:
                self._skip_step(iteration)
            return None
        self.nonfinite_streak = self.overflow_streak = 0
        self.scaler.step(self.optimizer)  # = optimizer.step(): the gradients were checked finite above
        self.scaler.update()
        self.scheduler.step()
        self._update_ema()
        self.plan.after_update(self.model)
        self.objective.after_update(self.model)
        return grad_norm

    def _skip_step(self, iteration: int) -> None:
        """Drop a step whose loss or gradient is not finite (warned, counted); several in a row stop the run."""
        self.optimizer.zero_grad(set_to_none=True)
        self.nonfinite_streak += 1
        warnings.warn(
            f"iteration {iteration}: the loss or gradient is not finite; optimizer step skipped "
            f"({self.nonfinite_streak} in a row)",
            RuntimeWarning,
            stacklevel=3,
        )
        if self.nonfinite_streak >= self.MAX_NONFINITE_STREAK:
            raise FloatingPointError(
                f"{self.nonfinite_streak} optimizer steps in a row had a non-finite loss or gradient "
                f"(iteration {iteration}); the weights were left as they were before them. Check the "
                f"reward's values, optim.lr and model.dtype{self._attention_hint()}"
            )

    def _attention_hint(self) -> str:
        """A pointer to ``model.cudnn_attention`` when torch's cuDNN attention kernel is allowed on this CUDA device."""
        from flowrl.models.attention import cudnn_attention_on

        if not cudnn_attention_on(self.model.device):
            return ""
        return (
            "; torch's cuDNN attention kernel is on (model.cudnn_attention=true), whose backward gave non-finite "
            "gradients for FLUX.1-dev on an H200: try model.cudnn_attention=false"
        )

    def gradient(self, forest: Forest, iteration: int) -> torch.Tensor:
        """The objective's gradient over all of ``forest``, flat [P] over ``params`` (mean over processes,
        before clipping), without changing any weight."""
        with training_mode(self.model.trainable):
            return self._gradient(forest, iteration)

    def _gradient(self, forest: Forest, iteration: int) -> torch.Tensor:
        self.objective.begin_iteration(self.model, forest)
        cond = self.objective.encode(self.model, forest)
        batches = self._batches = self.objective.batches(forest, iteration, self.cfg.train.seed)
        self.optimizer.zero_grad(set_to_none=True)
        n_global = self.group.sum(sum(b.size for b in batches))
        if n_global > 0:
            self._backward(
                forest,
                cond,
                batches,
                n_global,
                DeviceSums(self.objective.describe().extremes),
                final=True,
                padding=self._padding_count(batches),
            )
            self.reducer.finish()
        flat = torch.cat(
            [
                whole(p.grad if p.grad is not None else torch.zeros_like(p)).detach().reshape(-1).float().cpu()
                for p in self.params
            ]
        )
        if self.scaler.is_enabled():
            flat = flat / self.scaler.get_scale()
        self.optimizer.zero_grad(set_to_none=True)
        return flat

    # ---- EMA ------------------------------------------------------------------------------------
    def _update_ema(self) -> None:
        if self.ema is None:
            return
        d = self.cfg.train.ema
        if self.cfg.train.ema_warmup:  # DiffusionNFT's eval EMA: min((1 + s)/(10 + s), ema) after optimizer step s
            s = max(0, self.scheduler.last_epoch - 1)
            d = min(d, (1 + s) / (10 + s))
        with torch.no_grad():  # one fused multi-tensor update on CUDA
            torch._foreach_mul_(self.ema, d)
            torch._foreach_add_(self.ema, [p.detach() for p in self.params], alpha=1 - d)

    @contextlib.contextmanager
    def ema_weights(self) -> Iterator[None]:
        """Temporarily load the EMA weights into the model (no-op without EMA)."""
        if self.ema is None:
            yield
            return
        live = [p.detach().clone() for p in self.params]
        with torch.no_grad():
            for p, e in zip(self.params, self.ema):
                p.copy_(e)
        try:
            yield
        finally:
            with torch.no_grad():
                for p, saved in zip(self.params, live):
                    p.copy_(saved)

    def weights_finite(self) -> bool:
        """Whether every trained weight is finite (on every process: sharded, each checks its shards)."""
        mine = all(bool(torch.isfinite(local(p)).all()) for p in self.params)
        return self.group.sum(0.0 if mine else 1.0) == 0 if self.sharded else mine

    # ---- checkpoints -----------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Its state to checkpoint; sharded, without the optimizer's (:mod:`flowrl.run.sharded_checkpoint` writes
        it)."""
        optimizer = {} if self.sharded else {"optimizer": self.optimizer.state_dict()}
        return {
            **optimizer,
            "scheduler": self.scheduler.state_dict(),
            "ema": self.ema,
            "scaler": self.scaler.state_dict(),
            "overflow_streak": self.overflow_streak,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if not self.sharded:
            self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        if self.scaler.is_enabled() and state.get("scaler"):
            self.scaler.load_state_dict(state["scaler"])
            self.overflow_streak = int(state.get("overflow_streak", 0))
        if self.ema is not None and state.get("ema") is not None:
            self.ema = [e.to(p.device) for e, p in zip(state["ema"], self.params)]
