"""The one training loop: rollout plan → rewards → credit rule → objective → optimizer step.

``Trainer(TrainConfig, model=None, reward=None).train()`` is what ``flowrl train`` runs. Each job has its
own small piece, wired here:

- :class:`~flowrl.distributed.process_group.ProcessGroup`: one and N processes (accelerate) on one code path; each
  process rolls out its own whole prompt groups, global statistics are all-reduced, gradients averaged;
- :class:`~flowrl.rollout.runner.RolloutRunner`: this process's prompt groups → the plan's forest, scored;
- the credit rule (``credit.rule``) writes advantages onto the forest;
- :class:`~flowrl.training.updater.Updater`: the objective's micro-batches → optimizer steps (the objective owns
  its batches and its loss, :mod:`flowrl.objectives.base`; the updater only zero-grads, back-propagates, steps);
- :class:`~flowrl.training.evaluation.HeldOutEval` and :class:`~flowrl.run.folder.RunFolder`: evals, checkpoints,
  resume and the protection of the run folder;
- side jobs as callbacks that control the loop (:mod:`flowrl.training.callbacks`, ``trainer.control``): the teacher's
  share metrics, the stop after a streak of failed rewards, and the eval guard (``eval.guard``): the stop when an eval
  reward falls from its start value (reward hacking); a user's callbacks after them. A callback's :class:`Stop` is the
  one way a run ends early (a signal and ``train.max_minutes`` are stops too);
- :class:`~flowrl.training.trainer_checkpoints.TrainerCheckpoints` (mixed in): what a checkpoint holds, saving, the
  export and the resume.
"""

from __future__ import annotations

import contextlib
import time
from pathlib import Path
from typing import Any, Sequence

import torch
from tqdm.auto import tqdm

from flowrl.config import build
from flowrl.config.chosen import build_components
from flowrl.config.schema import ConfigError, TrainConfig
from flowrl.distributed.context_parallel import apply_context_parallel, check_context_parallel, context_degree
from flowrl.distributed.process_group import ProcessGroup
from flowrl.distributed.sharding import (
    Sharding,
    check_shard_settings,
    check_sharded_objective,
    compute_dtype,
    offload_requested,
    resolve_shard,
)
from flowrl.models.base import FlowModel
from flowrl.models.blocks import apply_block_settings
from flowrl.prompts.source import build_prompt_source
from flowrl.rollout.forest import Forest
from flowrl.run.folder import RunFolder
from flowrl.run.signals import stop_on_first_interrupt
from flowrl.training.callbacks import Callback, Stop, TrainerControl, default_callbacks
from flowrl.training.evaluation import resolve_guidance
from flowrl.training.metrics import plot_reward_curve
from flowrl.training.perf import PerfMeter
from flowrl.training.pipeline import check_pipeline, rollout_failure, split_threads
from flowrl.training.rollout_process import serve_rollout_rank
from flowrl.training.scoring import check_modality, run_rewards
from flowrl.training.trainable import setup_trainable, teacher_weights
from flowrl.training.trainer_checkpoints import TrainerCheckpoints
from flowrl.training.trainer_evals import TrainerEvals
from flowrl.training.trainer_pipeline import TrainerPipeline
from flowrl.training.updater import Updater
from flowrl_rewards.background import RewardWaitCut


class Trainer(TrainerCheckpoints, TrainerPipeline, TrainerEvals):
    """Config + model + reward → an aligned model in ``runs/<name>/`` (TRL-style Config/Trainer pair).

    ``model``: a ready :class:`FlowModel` (e.g. ``flowrl.wrap(pipe)``); None builds it from
    ``config.model``. ``reward``: a reward name, any :class:`flowrl_rewards.Scorer` (a Reward, a MultiReward or one of
    your own; :func:`~flowrl.training.scoring.as_multi`), or None for ``config.rewards``. With
    ``train.pipeline=async`` both come from the config (the rollout process builds its own). ``perf``: the FLOPs of
    one iteration and the device's peak, for ``perf/tflops`` and ``perf/mfu`` in every iteration's metrics (``flowrl
    train`` makes it from the estimate: :func:`flowrl.estimate.device.perf_meter`); None: not reported.
    ``callbacks``: :class:`Callback` side jobs run after the built-in ones at the end of every iteration and eval.
    """

    def __init__(
        self,
        config: TrainConfig,
        model: FlowModel | None = None,
        reward: Any = None,
        accelerator=None,
        perf: PerfMeter | None = None,
        callbacks: Sequence[Callback] = (),
    ):
        from accelerate import Accelerator

        self.cfg = c = config
        self.perf = perf
        trainer_threads, rollout_threads = split_threads(c.train)
        if trainer_threads:
            torch.set_num_threads(trainer_threads)
        device = build.resolve_device(c.model.device)
        run_dir = Path(c.train.output_dir) / c.train.name
        self.accelerator = accelerator or Accelerator(
            cpu=device.type == "cpu",
            project_dir=str(run_dir),
            log_with=None if c.train.log_with == "none" else c.train.log_with,
        )
        members = self._join_layout()  # train.rollout_processes: the trainers' group (None: every process trains)
        if self.rolls_out:
            return  # a launched rollout process: train() serves the trainers
        check_context_parallel(c, len(members[1]) if members else self.accelerator.num_processes)
        self.group = ProcessGroup(self.accelerator, context=context_degree(c.model.context_parallel), members=members)
        self.world, self.rank = self.group.world, self.group.rank
        if c.prompts.per_step % self.world:
            raise ConfigError(
                f"prompts.per_step={c.prompts.per_step} must be divisible by the number of processes ({self.world})"
            )
        shard = resolve_shard(c.model.shard)
        check_shard_settings(c, self.group.processes, shard)
        check_pipeline(c, model, reward)
        self.folder = RunFolder(c, self.group)
        self._build_policy(model, reward, shard)
        self._build_loop(rollout_threads, callbacks)

    def _build_policy(self, model: FlowModel | None, reward: Any, shard: str) -> None:
        """Rewards, components, the model and what trains, their copies and compile, then the shards: in this order
        (a bad prompt line or a reward server that is down fails before the model loads)."""
        c = self.cfg
        self.reward, self.eval_reward = run_rewards(c, reward, model)  # built, each prompt line scorable, servers up
        self.plan, self.credit, self.objective = build_components(c)  # this run's own, checked; fixed for the run
        self.facts = self.objective.describe()
        teacher = teacher_weights(self.objective)  # its folder read before the model loads
        self.model = model if model is not None else build.build_model(c.model, self.accelerator.device)
        check_modality(self.model, [("rewards", self.reward), ("eval.rewards", self.eval_reward)])  # video rewards
        if shard == "fsdp":
            check_sharded_objective(self.objective)
        self.params = setup_trainable(self.model, c.model, c.train.seed)
        apply_context_parallel(self.model, c.model.context_parallel, self.group.processes, self.accelerator.device)
        self.objective.setup(self.model, **teacher)
        self.guidance = resolve_guidance(self.model.guidance, self.facts.rollout_guidance(c.model.guidance))
        self.plan.setup(self.model, self.reward)
        # after the frozen and explorer copies are made from it, before FSDP2 wraps its blocks
        self.compiled = apply_block_settings(self.model.trainable, c.model)  # per-block checkpointing, compile
        self.sharding = None  # sharded after the objective's frozen copies and the plan's explorer are made from it
        if shard == "fsdp":
            self.sharding = Sharding(
                self.model, self.group, self.accelerator.device, c.model.shard_rollouts, offload=offload_requested()
            )
            self.sharding.shard(compute_dtype(self.model))
            self.params = [p for p in self.model.trainable.parameters() if p.requires_grad]  # now the shards

    def _build_loop(self, rollout_threads: int | None, callbacks: Sequence[Callback]) -> None:
        """The loop's parts over the built policy: prompts, rollouts (here or in a rollout process), the updater, the
        evals and the callbacks."""
        c = self.cfg
        self.prompts = build_prompt_source(c.prompts, c.train.seed)
        self.runner = self._rollout_runner()  # the rollouts here (sync; snr) and the prompt groups of each job
        self.updater = Updater(
            c, self.model, self.objective, self.plan, self.params, self.group, sharded=self.sharding is not None
        )
        # train.pipeline=async: the forests come from a rollout process, on the fixed schedule of train.max_staleness
        self.rollouts = self._pipeline(rollout_threads) if c.train.pipeline == "async" else None
        self.evaluate = self._held_out_eval()
        self.callbacks = [*default_callbacks(c, self.reward, self.eval_reward), *callbacks]  # eval.guard among them
        self.control = TrainerControl()  # what the callbacks ask of the loop: save, evaluate, stop
        self.resumed_from: Path | None = None
        self.step = 0
        self.train_seconds = 0.0  # time spent in iterations (evals and checkpoints excluded), kept across resumes

    @property
    def run_dir(self) -> Path:
        return self.folder.path

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        return self.updater.optimizer

    @property
    def ema(self) -> list[torch.Tensor] | None:
        return self.updater.ema

    def ema_weights(self):
        """Temporarily load the EMA weights into the model (no-op without ``train.ema``)."""
        return self.updater.ema_weights()

    # ---- one iteration -----------------------------------------------------------------------
    def sampling(self):
        """The context rollouts and evals sample in (sharded: the transformer gathered, :class:`Sharding`)."""
        return self.sharding.sampling() if self.sharding is not None else contextlib.nullcontext()

    def rollout(self, iteration: int) -> tuple[Forest, dict[str, float]]:
        """The scored forest of ``iteration`` for this process and its timings (:class:`RolloutRunner`)."""
        with self.sampling():
            return self.runner.run(iteration, teacher_fraction=self.objective.teacher_fraction())

    def update(self, forest: Forest, iteration: int) -> dict[str, float]:
        """The optimizer steps of ``iteration`` on ``forest`` and their diagnostics (:class:`Updater`)."""
        return self.updater.update(forest, iteration)

    def train_step(self, iteration: int) -> dict[str, float]:
        """One full iteration; returns its metrics (global over processes)."""
        g = self.group
        forest, times, plan_stats = self.next_forest(iteration)
        credit_stats = self.credit.assign(forest, gather=g.gather)
        t0 = time.perf_counter()
        update_stats = self.update(forest, iteration)
        times["time/update"] = time.perf_counter() - t0
        if self.rollouts is not None:
            self.rollouts.after_update(iteration + 1)  # the next job, on the weights this update made
        leaves = forest.leaves()
        rewards = g.gather(forest.reward[leaves])
        ok = rewards[~torch.isnan(rewards)]
        record: dict[str, float] = {
            "step": iteration + 1,
            "reward_mean": float(ok.mean()) if ok.numel() else float("nan"),
            "reward_std": float(ok.std(unbiased=False)) if ok.numel() else float("nan"),
            "reward_failed": float(rewards.numel() - ok.numel()),
        }
        for name, values in forest.reward_components.items():
            record[f"reward/{name}"] = float(g.gather(values[leaves]).nanmean())
        record.update({k: g.mean(v) for k, v in {**plan_stats, **credit_stats}.items()})
        record.update(update_stats)
        record["rollout_forwards"] = g.sum(forest.counters["forwards"])
        record["rollout_nfe"] = g.sum(forest.counters["nfe"])
        record["leaves"] = g.sum(forest.leaves().numel())
        record.update(
            {k: g.sum(v) if k.endswith("_forwards") else g.mean(v) for k, v in self.objective.take_stats().items()}
        )
        record.update(self._observe_spread(forest))
        for callback in self.callbacks:
            record.update(callback.on_iteration(self, forest, record))
        record.update(times)
        return record

    def _observe_spread(self, forest: Forest) -> dict[str, float]:
        """The share of prompt groups whose rewards did not spread (they train nothing), and the prompt
        source's feedback: every group's spread, gathered over processes in global order."""
        spread = self.group.gather(forest.group_reward_std())
        flat = self.group.gather(forest.flat_groups(self.credit.zero_std_tol).float())
        scored = ~torch.isnan(spread)
        out = {"groups_without_spread": float(flat[scored].mean()) if bool(scored.any()) else float("nan")}
        out.update(self.prompts.observe(spread))
        return out

    def policy_gradient(self, iteration: int) -> tuple[torch.Tensor, int]:
        """The gradient of the objective over the whole of ``iteration``, flat [P] over the trainable
        parameters (mean over processes, before clipping), and the samples (leaves, all processes) it
        came from, without changing any weight: the gradient of its first update when
        ``train.updates_per_epoch`` is 1. An adaptive prompt source is not fed (the draws stay independent)."""
        forest, _ = self.rollout(iteration)
        self.credit.assign(forest, gather=self.group.gather)
        return self.updater.gradient(forest, iteration), int(self.group.sum(forest.leaves().numel()))

    # ---- the loop -----------------------------------------------------------------------------
    def out_of_time(self) -> bool:
        """Whether ``train.max_minutes`` (0: no limit) of iterations have run."""
        return bool(self.cfg.train.max_minutes) and self.train_seconds >= 60.0 * self.cfg.train.max_minutes

    def train(self) -> list[dict[str, Any]]:
        """Run to ``train.max_steps`` (or until ``train.max_minutes`` of training, evals excluded, when set, or until a
        callback stops it: ``control.stop`` then holds why); returns the metric records of this call. A launched
        rollout process serves its trainers until they stop, and returns no record."""
        if self.rolls_out:
            serve_rollout_rank(self.cfg, self.layout)
            return []
        try:
            with self.folder.claim(lambda: self.step):
                return self._train()
        finally:
            self.runner.close()  # the scorer's thread
            if self.rollouts is not None:
                self.rollouts.close()  # the rollout process (train.pipeline=async)

    def _train(self) -> list[dict[str, Any]]:
        cfg, main, t = self.cfg, self.group.is_main, self.cfg.train
        found = self.folder.find_resume(t.resume, self._read) if t.resume else None
        if found is not None:
            self.load_checkpoint(*found)
        log = self.folder.metrics(self.step if found is not None else None)
        if (
            found is not None
            and self.step >= t.max_steps
            and self.folder.finished(log, self.step, bool(self.eval_prompts))
        ):
            if main:
                print(
                    f"the run already finished at step {self.step} (train.max_steps={t.max_steps}); raise "
                    "train.max_steps to go on"
                )
            return []
        if found is not None:
            for callback in self.callbacks:  # e.g. the eval guard: a stop that still stands refuses to train on
                line = callback.on_resume(self, self.resumed_from, self.control)
                if main and line:
                    print(line, flush=True)
            if self.control.stop is not None:
                return []
        if main:
            (self.run_dir / "config.yaml").write_text(cfg.to_yaml())
        if t.log_with != "none":
            self.accelerator.init_trackers(t.name, config=cfg.to_flat_dict())
        self._log, self._records = log, []
        if self.rollouts is not None:
            self.rollouts.start(self.step)  # it builds its model and samples while the first eval runs
        if self.step == 0 and cfg.eval.at_start:
            self._evaluate("before")
        self._loop()
        if main and log is not None:
            plot_reward_curve(log.read(), self.run_dir / "reward_curve.png")
        if t.log_with != "none":
            self.accelerator.end_training()
        return self._records

    def _loop(self) -> None:
        """The iterations until ``train.max_steps`` or a :class:`Stop` (a callback's; Ctrl-C or SIGTERM, after the
        iteration it arrived in; ``train.max_minutes``), then the last checkpoint and the closing eval as the stop
        says. A signal ends in KeyboardInterrupt, a stop that carries an error raises it."""
        t, control = self.cfg.train, self.control
        bar = tqdm(
            total=t.max_steps, initial=self.step, disable=not (self.group.is_main and t.progress), desc="flowrl train"
        )
        with stop_on_first_interrupt() as signal:
            while self.step < t.max_steps and control.stop is None:
                try:
                    self._iteration(bar)
                except RewardWaitCut:  # a stop cut a reward wait: that iteration did not finish, the last one is saved
                    pass
                except Exception as e:
                    if rollout_failure(e):  # the rollout process failed: keep the last finished iteration
                        bar.close()
                        self.save_checkpoint()
                    raise
                if signal.requested:
                    control.request_stop(Stop("signal", "interrupted", exit_status=130))
                elif self.out_of_time():
                    control.request_stop(Stop("max_minutes", "train.max_minutes of training ran", final_eval=True))
            bar.close()
            stop = control.stop
            if stop is None or stop.save:
                self.save_checkpoint()  # the last step is saved before the final eval: an interrupt there loses nothing
                if self.sharding is not None and not signal.requested:
                    self.export()
            if not signal.requested and (stop is None or stop.final_eval):
                with self.idle_rollout_threads():  # nothing left to sample: the eval takes the rollout's threads too
                    self._evaluate("after")
                if control.stop is not stop:
                    self.save_checkpoint()  # again, holding the closing eval's stop: a resume sees it
            if signal.requested:
                if self.group.is_main:
                    print(f"\ninterrupted: saved a checkpoint at step {self.step}; resume with train.resume=latest")
                raise KeyboardInterrupt
        stop = control.stop
        if stop is not None and stop.error is not None:
            raise stop.error
        if stop is not None and stop.reason == "eval_guard" and self.group.is_main:
            print(f"\n{stop.message}\nstopped by the eval guard: saved a checkpoint at step {self.step}", flush=True)

    def _iteration(self, bar) -> None:
        """One iteration with its metrics, then a periodic eval and checkpoint when due."""
        t = self.cfg.train
        t0, seconds_before = time.perf_counter(), self.train_seconds
        record = self.train_step(self.step)
        seconds = self.group.mean(time.perf_counter() - t0)  # the same on every rank
        self.train_seconds += seconds
        self.step += 1
        record["time/train_total"] = self.train_seconds  # training time so far, evals excluded
        record["time/iteration"] = seconds
        if self.perf is not None:
            record.update(self.perf.metrics(seconds))
        if self.compiled is not None:  # model.compile=regional: graphs compiled so far and their compile time
            record.update({"compile/graphs": self.compiled.total, "compile/seconds": self.compiled.seconds})
            if record.get("compile/graphs") and self.step == 1 and self.group.is_main:
                tqdm.write(self.compiled.summary())
        self._emit(record)
        self.control.next_iteration()
        for callback in self.callbacks:
            callback.on_iteration_end(self, record, self.control)  # e.g. every reward failed N iterations in a row
        bar.update(1)
        bar.set_postfix(
            reward=f"{record['reward_mean']:.3f}",
            **self.facts.progress(record),
            **(self.perf.progress(record) if self.perf is not None else {}),
        )
        last = self.step == t.max_steps or self.out_of_time()
        control = self.control
        if (self.eval_due(seconds_before) or control.should_evaluate) and not last and control.stop is None:
            self._evaluate()
        due = bool(t.checkpoint_every) and self.step % t.checkpoint_every == 0
        if (due or control.should_save) and not last and control.stop is None:
            self.save_checkpoint()

    def _emit(self, record: dict[str, Any]) -> None:
        """Record one iteration or eval: the records of this call, ``metrics.jsonl`` and the tracker."""
        if len(record) == 1:  # an eval without eval prompts: nothing to record
            return
        self._records.append(record)
        if self._log is not None:
            self._log.write(record)
        if self.cfg.train.log_with != "none":
            self.accelerator.log({k: v for k, v in record.items() if k != "step"}, step=int(record["step"]))
