"""The one training loop: rollout plan → rewards → credit rule → objective → optimizer step.

``Trainer(TrainConfig, model=None, reward=None).train()`` is what ``flowrl train`` runs. One code
path for one and N processes (accelerate): each process rolls out its own whole prompt groups,
global statistics (``credit.scale: global``, edge counts) are all-reduced, and gradients are
averaged across processes before every optimizer step, so all ranks hold the same weights.
The objective (``loss.objective``) builds its own micro-batches from the forest and computes their loss
(:mod:`flowrl.objective`); the loop only zero-grads, back-propagates and steps.
"""
from __future__ import annotations

import contextlib
import math
import pickle
import shutil
import time
import warnings
from pathlib import Path
from typing import Any, Iterator

import torch
from tqdm.auto import tqdm

from flowrl import build
from flowrl.checkpoint import list_checkpoints, load_weights, read_state, resolve_resume, save_weights, write_checkpoint
from flowrl.config import SHAPE_KEYS, ConfigError, TrainConfig, config_changes
from flowrl.errors import shown
from flowrl.evaluation import evaluate, save_labelled_grid
from flowrl.metrics import MetricsLog, plot_reward_curve
from flowrl.models.base import FlowModel
from flowrl.objective import Batch
from flowrl.prompts import build_prompt_source, check_prompts, read_prompts
from flowrl.rollout.base import RolloutContext
from flowrl.rollout.forest import Forest
from flowrl.rollout.seeding import derive_seed
from flowrl.scoring import BackgroundScorer, request_scores
from flowrl.signals import stop_on_first_interrupt


class Trainer:
    """Config + model + reward → an aligned model in ``runs/<name>/`` (TRL-style Config/Trainer pair).

    ``model``: a ready :class:`FlowModel` (e.g. ``flowrl.wrap(pipe)``); None builds it from
    ``config.model``. ``reward``: a reward name, a :class:`rewards.Reward`, a MultiReward, or None
    for ``config.rewards``.
    """

    def __init__(self, config: TrainConfig, model: FlowModel | None = None, reward: Any = None, accelerator=None):
        from accelerate import Accelerator

        self.cfg = config
        if config.train.num_threads:
            torch.set_num_threads(config.train.num_threads)
        device = build.resolve_device(config.model.device)
        self.accelerator = accelerator or Accelerator(cpu=device.type == "cpu",
                                                      log_with=None if config.train.log_with == "none" else config.train.log_with,
                                                      project_dir=str(self.run_dir))
        self.world, self.rank = self.accelerator.num_processes, self.accelerator.process_index
        if config.prompts.per_step % self.world:
            raise ConfigError(f"prompts.per_step={config.prompts.per_step} must be divisible by the number of processes ({self.world})")
        self.model = model if model is not None else build.build_model(config.model, self.accelerator.device)
        self.objective = build.build_loss(config)
        torch.manual_seed(derive_seed(config.train.seed, "init") % (2**31))  # LoRA init draws from the global RNG
        self.params = self._setup_trainable()
        self.objective.setup(self.model)
        self.plan = build.build_plan(config.rollout)
        self.objective.check_plan(self.plan)
        rollout_guidance = self.objective.rollout_guidance(config.model.guidance)
        self.guidance = float(self.model.guidance if rollout_guidance is None else rollout_guidance)
        self.reward = (self._as_multi(reward, config.reward_normalize) if reward is not None
                       else build.build_rewards(config.rewards, config.reward_normalize))
        self.eval_reward = build.build_rewards(config.eval.rewards) if config.eval.rewards else self.reward
        async_reward = {"auto": "auto", "true": True, "false": False}[config.train.async_reward]
        self.scorer = BackgroundScorer(self.reward, enabled=async_reward)
        self.credit = build.build_credit(config)
        self.plan.setup(self.model, self.reward)
        check_prompts(config.prompts.train, "prompts.train", self.reward.check_prompt)  # every line, now
        if config.prompts.eval:
            check_prompts(config.prompts.eval, "prompts.eval", self.eval_reward.check_prompt)
        self.reward.check_ready()  # e.g. a remote reward's server answers, before any model time is spent
        if self.eval_reward is not self.reward:
            self.eval_reward.check_ready()
        self.prompts = build_prompt_source(config.prompts, config.train.seed)
        self.eval_prompts = read_prompts(config.prompts.eval, "prompts.eval") if config.prompts.eval else []
        if config.eval.num_prompts:
            self.eval_prompts = self.eval_prompts[: config.eval.num_prompts]
        self.optimizer = self._make_optimizer()
        self.scheduler = self._make_scheduler()
        self.ema = [p.detach().clone() for p in self.params] if config.train.ema > 0 else None
        self.step = 0
        self.nonfinite_streak = 0  # optimizer steps skipped in a row for a non-finite loss or gradient
        self.train_seconds = 0.0  # time spent in iterations (evals and checkpoints excluded), kept across resumes
        self._claimed = False  # whether train() has checked (or replaced) the run folder

    # ---- setup ----------------------------------------------------------------------------
    @property
    def run_dir(self) -> Path:
        return Path(self.cfg.train.output_dir) / self.cfg.train.name

    def _check_run_name(self) -> None:
        """A run folder that already holds a run is continued (``train.resume``) or replaced
        (``train.overwrite``), never silently reused."""
        t = self.cfg.train
        held = [name for name in ("metrics.jsonl", "checkpoints") if (self.run_dir / name).exists()]
        if held and not t.resume and not t.overwrite:
            raise ConfigError(f"train.name={t.name!r}: {self.run_dir} already holds a run ({', '.join(held)}); continue "
                              "it with train.resume=latest, choose another train.name, or replace it with "
                              "train.overwrite=true")

    @contextlib.contextmanager
    def _run_folder(self) -> Iterator[None]:
        """The run folder for one :meth:`train` call: emptied first with ``train.overwrite``; removed again
        when this call created it and fails before its first iteration (a failed start leaves nothing)."""
        main = self.accelerator.is_main_process
        if not self._claimed:  # a second train() call of this trainer continues what the first one wrote
            self._check_run_name()
            if main and self.cfg.train.overwrite and self.run_dir.exists():
                shutil.rmtree(self.run_dir)
            self._claimed = True
        self.accelerator.wait_for_everyone()
        fresh, start = not self.run_dir.exists(), self.step
        try:
            yield
        except Exception:
            if main and fresh and self.step == start == 0:
                shutil.rmtree(self.run_dir, ignore_errors=True)
            raise

    @staticmethod
    def _as_multi(reward: Any, normalize: str = "none"):
        from rewards import MultiReward, Reward

        if isinstance(reward, MultiReward):
            return reward
        if isinstance(reward, (str, Reward)):
            return MultiReward([{"name": reward} if isinstance(reward, str) else reward], normalize=normalize)
        raise TypeError(f"reward must be a name, a rewards.Reward or a MultiReward, got {type(reward).__name__}")

    def _setup_trainable(self) -> list[torch.nn.Parameter]:
        module = self.model.trainable
        if self.cfg.model.full_finetune:
            module.requires_grad_(True)
        else:
            build.add_lora(self.model, self.cfg.model)
        params = [p for p in module.parameters() if p.requires_grad]
        if not params:
            raise ConfigError("no trainable parameters: check model.lora.targets")
        return params

    def _make_optimizer(self) -> torch.optim.Optimizer:
        o = self.cfg.optim
        kwargs = dict(lr=o.lr, betas=tuple(o.betas), weight_decay=o.weight_decay, eps=o.eps)
        if o.use_8bit:
            try:
                import bitsandbytes as bnb
            except ImportError as e:
                raise ConfigError("optim.use_8bit=true needs bitsandbytes: pip install 'flowrl[quant]'") from e
            return bnb.optim.AdamW8bit(self.params, **kwargs)
        return torch.optim.AdamW(self.params, **kwargs)

    def _make_scheduler(self):
        from diffusers.optimization import get_scheduler

        o, t = self.cfg.optim, self.cfg.train
        name = "constant_with_warmup" if o.schedule == "constant" else o.schedule
        total = max(1, t.max_steps * t.inner_epochs * t.updates_per_epoch)
        return get_scheduler(name, self.optimizer, num_warmup_steps=o.warmup_steps, num_training_steps=total)

    # ---- distributed helpers -----------------------------------------------------------------
    def _gather(self, t: torch.Tensor) -> torch.Tensor:
        if self.world == 1:
            return t
        return self.accelerator.gather(t.to(self.accelerator.device)).cpu()

    def _sum(self, value: float) -> float:
        if self.world == 1:
            return float(value)
        t = torch.tensor([float(value)], device=self.accelerator.device)
        return float(self.accelerator.reduce(t, reduction="sum").item())

    def _average_gradients(self) -> None:
        """Mean of every trainable gradient over processes (one flat all-reduce)."""
        if self.world == 1:
            return
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in self.params]
        flat = torch.cat([g.reshape(-1) for g in grads]).to(self.accelerator.device)
        flat = self.accelerator.reduce(flat, reduction="mean")
        offset = 0
        for p, g in zip(self.params, grads):
            p.grad = flat[offset: offset + g.numel()].view_as(g).to(p.device, p.dtype)
            offset += g.numel()

    # ---- one iteration -----------------------------------------------------------------------
    def local_prompts(self, iteration: int) -> tuple[list[str], int]:
        """This process's prompt groups for ``iteration`` and the global index of its first group."""
        prompts = self.prompts.batch(iteration)
        k = len(prompts) // self.world
        return prompts[self.rank * k:(self.rank + 1) * k], self.rank * k

    def rollout(self, iteration: int) -> tuple[Forest, dict[str, float]]:
        """Sample the forest of ``iteration`` and score it (no gradients): every leaf and every state the
        plan probed gets its reward terms in ``reward_components`` and its combined score in ``reward``
        (leaves) or ``value`` (probed states).

        With ``rollout.chunks`` > 1 the prompt groups are rolled out in parts; each part's states are
        decoded and handed to the reward scorer (a background thread with ``train.async_reward``)
        while the next part rolls out. Seeds are addressed by global group, so chunking changes no draw.
        The terms are combined after the last part, over the whole iteration.
        """
        prompts, offset = self.local_prompts(iteration)
        max_batch = self.cfg.rollout.max_batch
        n_chunks = min(self.cfg.rollout.chunks, len(prompts))
        bounds = [len(prompts) * k // n_chunks for k in range(n_chunks + 1)]
        self.model.trainable.eval()
        parts = []
        t_sample = t_score = 0.0
        for a, b in zip(bounds[:-1], bounds[1:]):
            ctx = RolloutContext(seed=self.cfg.train.seed, iteration=iteration, group_offset=offset + a,
                                 guidance=self.guidance, max_batch=max_batch, reduction=self.objective.reduction)
            t0 = time.perf_counter()
            forest = self.plan.rollout(self.model, prompts[a:b], ctx)
            nodes, future = request_scores(self.scorer, self.model, forest, max_batch)
            t1 = time.perf_counter()
            parts.append((forest, nodes, future))
            t_sample += t1 - t0
            t_score += time.perf_counter() - t1
        t2 = time.perf_counter()
        for forest, nodes, future in parts:
            forest.record_scores(nodes, future.result())
        forest = Forest.merge([f for f, _, _ in parts])
        forest.combine_scores(self.reward.combine)
        t_score += time.perf_counter() - t2  # waiting for the scorer after the last part
        return forest, {"time/rollout": t_sample, "time/reward": t_score}

    def _backward(self, forest: Forest, cond, part: list[Batch], n_global: float, sums: dict[str, float]) -> int:
        """Back-propagate the objective's loss of the micro-batches ``part``, each scaled so the optimizer
        step averages over the ``n_global`` units (edges or leaves) of all processes, and fold their
        diagnostics into ``sums`` (size-weighted sums; the objective's extremes by min/max). Returns the
        units seen."""
        count = 0
        extremes = self.objective.extremes
        for b in part:
            loss, diag = self.objective.loss(self.model, forest, b, cond)
            (loss * (b.size * self.world / n_global)).backward()
            for k, v in diag.items():
                _fold(sums, k, float(v) if k in extremes else float(v) * b.size, extremes)
            count += b.size
        return count

    def update(self, forest: Forest, iteration: int) -> dict[str, float]:
        """Inner epochs of optimizer steps over the objective's micro-batches of ``forest``."""
        cfg = self.cfg
        objective, extremes = self.objective, self.objective.extremes
        self.model.trainable.train()
        cond = objective.encode(self.model, forest)
        batches = objective.batches(forest, iteration, cfg.train.seed)
        diag_sums: dict[str, float] = {}
        diag_count = 0
        grad_norms = []
        first = {f"first_step_{k}": 0.0 for k in objective.first_step_keys}  # diagnostics before any weight changed
        aux_sums: dict[str, float] = {}  # the objective's auxiliary term, averaged over optimizer steps
        aux_steps = 0
        skipped = 0
        for epoch in range(cfg.train.inner_epochs):
            order = batches
            if epoch > 0:
                gen = torch.Generator().manual_seed(derive_seed(cfg.train.seed, iteration, "shuffle", epoch))
                order = [batches[i] for i in torch.randperm(len(batches), generator=gen).tolist()]
            U = cfg.train.updates_per_epoch
            for u in range(U):
                part = order[u * len(order) // U:(u + 1) * len(order) // U]
                n_global = self._sum(sum(b.size for b in part))
                if n_global == 0:
                    continue
                self.optimizer.zero_grad(set_to_none=True)
                step_sums: dict[str, float] = {}
                seen = self._backward(forest, cond, part, n_global, step_sums)
                diag_count += seen
                if epoch == 0 and u == 0:  # weights not yet updated (a policy's ratios must be exactly 1)
                    first = {f"first_step_{k}": step_sums.get(k, 0.0) if k in extremes else step_sums.get(k, 0.0) / max(seen, 1)
                             for k in objective.first_step_keys}
                aux = objective.auxiliary(self.model, forest, cond)
                if aux is not None:
                    aux_loss, aux_diag = aux
                    aux_loss.backward()
                    for k, v in aux_diag.items():
                        aux_sums[k] = aux_sums.get(k, 0.0) + float(v)
                    aux_steps += 1
                for k, v in step_sums.items():
                    _fold(diag_sums, k, v, extremes)
                self._average_gradients()
                grad_norm = float(torch.nn.utils.clip_grad_norm_(self.params, cfg.optim.grad_clip))
                if not math.isfinite(grad_norm):  # a non-finite loss or gradient: never let it into the weights
                    self._skip_step(iteration)
                    skipped += 1
                    continue
                self.nonfinite_streak = 0
                grad_norms.append(grad_norm)
                self.optimizer.step()
                self.scheduler.step()
                self._update_ema()
                self.plan.after_update(self.model)
                objective.after_update(self.model)
        self.optimizer.zero_grad(set_to_none=True)
        out = {k: v if k in extremes else v / diag_count for k, v in diag_sums.items()} if diag_count else {}
        out.update({k: v / aux_steps for k, v in aux_sums.items()})
        out.update(first)
        out["grad_norm"] = sum(grad_norms) / len(grad_norms) if grad_norms else 0.0
        out["skipped_steps"] = float(skipped)
        out[f"trained_{objective.trains_on}"] = self._sum(sum(b.size for b in batches))
        out["lr"] = self.scheduler.get_last_lr()[0]
        return out

    MAX_NONFINITE_STREAK = 3

    def _skip_step(self, iteration: int) -> None:
        """Drop a step whose loss or gradient is not finite (warned, counted); several in a row stop the run."""
        self.optimizer.zero_grad(set_to_none=True)
        self.nonfinite_streak += 1
        warnings.warn(f"iteration {iteration}: the loss or gradient is not finite; optimizer step skipped "
                      f"({self.nonfinite_streak} in a row)", RuntimeWarning, stacklevel=2)
        if self.nonfinite_streak >= self.MAX_NONFINITE_STREAK:
            raise FloatingPointError(f"{self.nonfinite_streak} optimizer steps in a row had a non-finite loss or gradient "
                                     f"(iteration {iteration}); the weights were left as they were before them. Check the "
                                     "reward's values, optim.lr and model.dtype")

    def policy_gradient(self, iteration: int) -> tuple[torch.Tensor, int]:
        """The gradient of the objective over the whole of ``iteration``, flat [P] over the trainable
        parameters (mean over processes, before clipping), and the samples (leaves, all processes) it
        came from, without changing any weight: the gradient of its first update when
        ``train.updates_per_epoch`` is 1.

        Rolls out and credits ``iteration`` as :meth:`train_step` does, then back-propagates the loss
        over all the objective's micro-batches at once (a policy's ratios are exactly 1). An adaptive
        prompt source is not fed (the draws stay independent, from the statistics the run or its
        checkpoint holds)."""
        forest, _ = self.rollout(iteration)
        self.credit.assign(forest, gather=self._gather)
        self.model.trainable.train()
        cond = self.objective.encode(self.model, forest)
        batches = self.objective.batches(forest, iteration, self.cfg.train.seed)
        self.optimizer.zero_grad(set_to_none=True)
        n_global = self._sum(sum(b.size for b in batches))
        if n_global > 0:
            self._backward(forest, cond, batches, n_global, {})
            self._average_gradients()
        flat = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).detach().reshape(-1).float().cpu()
                          for p in self.params])
        self.optimizer.zero_grad(set_to_none=True)
        return flat, int(self._sum(forest.leaves().numel()))

    def _observe_spread(self, forest: Forest) -> dict[str, float]:
        """The share of prompt groups whose rewards did not spread (they train nothing), and the prompt
        source's feedback: every group's spread, gathered over processes in global order."""
        spread = self._gather(forest.group_reward_std())
        scored = spread[~torch.isnan(spread)]
        out = {"groups_without_spread": float((scored <= 1e-8).float().mean()) if scored.numel() else float("nan")}
        out.update(self.prompts.observe(spread))
        return out

    def train_step(self, iteration: int) -> dict[str, float]:
        """One full iteration; returns its metrics (global over processes)."""
        forest, times = self.rollout(iteration)
        plan_stats = self.plan.metrics(forest)
        credit_stats = self.credit.assign(forest, gather=self._gather)
        t0 = time.perf_counter()
        update_stats = self.update(forest, iteration)
        times["time/update"] = time.perf_counter() - t0
        leaves = forest.leaves()
        rewards = self._gather(forest.reward[leaves])
        ok = rewards[~torch.isnan(rewards)]
        record: dict[str, float] = {"step": iteration + 1, "reward_mean": float(ok.mean()) if ok.numel() else float("nan"),
                                    "reward_std": float(ok.std(unbiased=False)) if ok.numel() else float("nan"),
                                    "reward_failed": float(rewards.numel() - ok.numel())}
        for name, values in forest.reward_components.items():
            record[f"reward/{name}"] = float(self._gather(values[leaves]).nanmean())
        record.update({k: self._sum(v) / self.world for k, v in {**plan_stats, **credit_stats}.items()})
        record.update(update_stats)
        record["rollout_forwards"] = self._sum(forest.counters["forwards"])
        record["rollout_nfe"] = self._sum(forest.counters["nfe"])
        record["leaves"] = self._sum(forest.leaves().numel())
        record.update(self._observe_spread(forest))
        record.update(times)
        return record

    # ---- EMA -----------------------------------------------------------------------------------
    def _update_ema(self) -> None:
        if self.ema is None:
            return
        d = self.cfg.train.ema
        with torch.no_grad():
            for e, p in zip(self.ema, self.params):
                e.mul_(d).add_(p.detach(), alpha=1 - d)

    @contextlib.contextmanager
    def ema_weights(self) -> Iterator[None]:
        """Temporarily load EMA weights into the model (no-op without EMA)."""
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
                for p, l in zip(self.params, live):
                    p.copy_(l)

    # ---- eval, checkpoints ----------------------------------------------------------------------
    def eval_guidances(self, periodic: bool = False) -> list[tuple[str, float]]:
        """(metric prefix, guidance) of an eval: ``eval`` at ``eval.guidance`` (default: the guidance the
        policy samples with) and, with ``eval.default_guidance``, ``eval_default`` at the model's default
        guidance when it differs (a CFG-free policy is also measured where the base model is used) — before
        and after training, not at the ``periodic`` evals of ``eval.every``."""
        e = self.cfg.eval
        main = float(e.guidance) if e.guidance is not None else self.guidance
        out = [("eval", main)]
        if e.default_guidance and not periodic and float(self.model.guidance) != main:
            out.append(("eval_default", float(self.model.guidance)))
        return out

    def run_eval(self, step: int, tag: str | None = None) -> dict[str, float]:
        """Evaluate on this process's share of the held-out prompts at every eval guidance; metrics
        averaged over all processes, ``<prefix>/guidance`` recorded."""
        if not self.eval_prompts:
            return {}
        e = self.cfg.eval
        mine = self.eval_prompts[self.rank::self.world]
        self.model.trainable.eval()
        out: dict[str, float] = {}
        for prefix, guidance in self.eval_guidances(periodic=tag is None):
            with self.ema_weights():
                metrics, images = evaluate(self.model, mine, self.eval_reward, steps=e.steps, guidance=guidance,
                                           seed=e.seed + self.rank, max_batch=e.batch_size, keep_images=e.grid_prompts,
                                           images_per_prompt=e.images_per_prompt, prefix=prefix)
            n = len(mine)
            out.update({k: self._sum(v * n) / self._sum(n) for k, v in metrics.items()})
            out[f"{prefix}/guidance"] = guidance
            if self.accelerator.is_main_process and images.numel():
                name = f"{tag or f'step-{step:06d}'}{'' if prefix == 'eval' else '_' + prefix.split('_', 1)[1]}"
                save_labelled_grid(images, mine, self.eval_reward, self.run_dir / "samples" / f"{name}.png")
        return out

    def save_checkpoint(self) -> Path | None:
        self.accelerator.wait_for_everyone()
        path = None
        if not self._weights_finite():
            raise FloatingPointError(f"the weights at step {self.step} are not finite: no checkpoint was written, the "
                                     "previous one is intact")
        if self.accelerator.is_main_process:
            state = {"step": self.step, "optimizer": self.optimizer.state_dict(), "scheduler": self.scheduler.state_dict(),
                     "ema": self.ema, "config": self.cfg.to_dict(), "torch_rng": torch.get_rng_state(),
                     "prompts": self.prompts.state_dict(), "objective": self.objective.state_dict(),
                     "policy_guidance": self.guidance, "train_seconds": self.train_seconds}

            def write_weights(folder: Path) -> None:
                with self.ema_weights():
                    save_weights(self.model, folder)
                if self.ema is not None:  # live (non-EMA) weights too, so resume continues exactly
                    save_weights(self.model, folder / "live")

            path = write_checkpoint(self.run_dir / "checkpoints", self.step, write_weights, state, self.cfg.train.keep_last)
        self.accelerator.wait_for_everyone()
        return path

    def _weights_finite(self) -> bool:
        return all(bool(torch.isfinite(p).all()) for p in self.params)

    def _resume(self, spec: str) -> Path | None:
        """Load ``train.resume``: a checkpoint folder, or ``latest`` — the newest intact checkpoint of the run: one
        that cannot be read or holds non-finite weights is reported and the one before it is used."""
        if spec != "latest":
            path = resolve_resume(spec, self.run_dir / "checkpoints")
            try:
                state = self._read_intact(path)
            except ValueError as e:
                raise ValueError(f"train.resume={spec!r}: {e}") from None
            self.load_checkpoint(path, state)
            return path
        found = list_checkpoints(self.run_dir / "checkpoints")
        for _, path in reversed(found):
            try:
                state = self._read_intact(path)
            except ConfigError:  # a refusal (e.g. another LoRA rank), not damage
                raise
            except (OSError, RuntimeError, ValueError, KeyError, EOFError, pickle.UnpicklingError) as e:
                warnings.warn(f"checkpoint {path} is damaged ({str(e).splitlines()[0][:200]}); trying the one before it",
                              RuntimeWarning, stacklevel=2)
                continue
            self.load_checkpoint(path, state)
            return path
        if found:
            raise ValueError(f"train.resume='latest': every checkpoint in {self.run_dir / 'checkpoints'} is damaged; "
                             "nothing was changed (move the folder away to start afresh)")
        return None

    def _read_intact(self, path: Path) -> dict:
        """The state of checkpoint ``path`` with its weights loaded into the model; raises when it is damaged
        (unreadable, or non-finite weights)."""
        state = read_state(path)
        self._check_resumed_config(state.get("config"), path)
        load_weights(self.model, path / "live" if (path / "live").is_dir() else path)
        if not self._weights_finite():
            raise ValueError("its weights are not finite")
        return state

    def _check_resumed_config(self, saved: dict | None, path: Path) -> None:
        """Name every setting that changed since checkpoint ``path`` was written: a warning, or a ConfigError
        for one that changes the trained weights' shapes (:data:`~flowrl.config.SHAPE_KEYS`)."""
        if not isinstance(saved, dict):
            return
        changes = config_changes(saved, self.cfg.to_dict())
        listed = "; ".join(f"{k}: {shown(old, 60)} → {shown(new, 60)}" for k, old, new in changes)
        shaped = [k for k, _, _ in changes if k in SHAPE_KEYS or k.startswith("model.lora.targets")]
        if shaped:
            raise ConfigError(f"cannot resume from {path}: {', '.join(shaped)} changed ({listed}); the checkpoint's "
                              "weights have other shapes. Resume with the saved values or start a new train.name")
        if changes and self.accelerator.is_main_process:
            warnings.warn(f"resuming from {path} with changed settings: {listed}", RuntimeWarning, stacklevel=3)

    def load_checkpoint(self, path: Path, state: dict | None = None) -> None:
        """Continue from checkpoint ``path`` (``state``: already read by :meth:`_read_intact`; else it is read
        here, and a damaged checkpoint raises). A mismatch
        with this run's settings (e.g. prompt sampling) raises: that is a refusal, not damage."""
        state = self._read_intact(path) if state is None else state
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        if self.ema is not None and state.get("ema") is not None:
            self.ema = [e.to(p.device) for e, p in zip(state["ema"], self.params)]
        self.step = int(state["step"])
        self.train_seconds = float(state.get("train_seconds", 0.0))
        self.prompts.load_state_dict(state.get("prompts"), where=str(path))
        self.objective.load_state_dict(state.get("objective"))

    def _finished(self, log: MetricsLog | None) -> bool:
        """Whether ``log`` ends with this step's final record (its closing eval, or the step itself without
        eval prompts): resuming a finished run again adds nothing."""
        records = log.read() if log is not None else []
        if not records or records[-1]["step"] != self.step:
            return False
        return not self.eval_prompts or any(k.startswith("eval/") for k in records[-1])

    # ---- the loop -----------------------------------------------------------------------------
    def out_of_time(self) -> bool:
        """Whether ``train.max_minutes`` (0: no limit) of iterations have run."""
        return bool(self.cfg.train.max_minutes) and self.train_seconds >= 60.0 * self.cfg.train.max_minutes

    def train(self) -> list[dict[str, float]]:
        """Run to ``train.max_steps`` (or until ``train.max_minutes`` of training, evals excluded, when set);
        returns the metric records of this call."""
        with self._run_folder():
            return self._train()

    def _train(self) -> list[dict[str, float]]:
        cfg = self.cfg
        main = self.accelerator.is_main_process
        resume_from = self._resume(cfg.train.resume) if cfg.train.resume else None
        log = MetricsLog(self.run_dir / "metrics.jsonl", resume_step=self.step if resume_from is not None else None) if main else None
        if resume_from is not None and self.step >= cfg.train.max_steps and self._sum(self._finished(log)) > 0:
            if main:
                print(f"the run already finished at step {self.step} (train.max_steps={cfg.train.max_steps}); "
                      "raise train.max_steps to go on")
            return []
        if main:
            (self.run_dir / "config.yaml").write_text(cfg.to_yaml())
        if cfg.train.log_with != "none":
            self.accelerator.init_trackers(cfg.train.name, config=cfg.to_flat_dict())
        records: list[dict[str, float]] = []

        def emit(record: dict[str, float]) -> None:
            if len(record) == 1:  # an eval without eval prompts: nothing to record
                return
            records.append(record)
            if log is not None:
                log.write(record)
            if cfg.train.log_with != "none":
                self.accelerator.log({k: v for k, v in record.items() if k != "step"}, step=int(record["step"]))

        if self.step == 0 and cfg.eval.at_start:
            emit({"step": 0, **self.run_eval(0, "before")})
        bar = tqdm(total=cfg.train.max_steps, initial=self.step, disable=not (main and cfg.train.progress), desc="flowrl train")
        with stop_on_first_interrupt() as stop:
            while self.step < cfg.train.max_steps and not stop.requested and not self.out_of_time():
                t0 = time.perf_counter()
                record = self.train_step(self.step)
                self.train_seconds += self._sum(time.perf_counter() - t0) / self.world  # the same on every rank
                self.step += 1
                emit(record)
                bar.update(1)
                bar.set_postfix(reward=f"{record['reward_mean']:.3f}", kl=f"{record.get('approx_kl', 0):.1e}",
                                clip=f"{record.get('clipfrac_high', 0) + record.get('clipfrac_low', 0):.2f}")
                last = self.step == cfg.train.max_steps or self.out_of_time()
                if cfg.eval.every and self.step % cfg.eval.every == 0 and not last:
                    emit({"step": self.step, **self.run_eval(self.step)})
                if cfg.train.checkpoint_every and self.step % cfg.train.checkpoint_every == 0 and not last:
                    self.save_checkpoint()
            bar.close()
            self.save_checkpoint()  # the last step is saved before the final eval: an interrupt there loses nothing
            if stop.requested:
                if main:
                    print(f"\ninterrupted: saved a checkpoint at step {self.step}; resume with train.resume=latest")
                raise KeyboardInterrupt
            emit({"step": self.step, **self.run_eval(self.step, "after")})
            if stop.requested:  # during the final eval: the checkpoint above holds everything
                if main:
                    print(f"\ninterrupted after the final eval; the checkpoint of step {self.step} is saved")
                raise KeyboardInterrupt
        if main and log is not None:
            plot_reward_curve(log.read(), self.run_dir / "reward_curve.png")
        if cfg.train.log_with != "none":
            self.accelerator.end_training()
        return records


def _fold(sums: dict[str, float], key: str, value: float, extremes: dict) -> None:
    """Accumulate one diagnostic: the objective's extremes combine by min/max, the rest add (size-weighted sums)."""
    if key in extremes and key in sums:
        sums[key] = extremes[key](sums[key], value)
    else:
        sums[key] = sums.get(key, 0.0) + value
