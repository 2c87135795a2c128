"""Rollouts that do not wait for the update (``train.pipeline: async``; docs/pipeline.md).

A rollout process beside the trainer samples and scores the next forests while the trainer updates on the current
one. The schedule is fixed by ``train.max_staleness`` (s), so a run stays reproducible and resumable:

- the weights after k optimizer steps are **version k** (version 0: the starting weights);
- forest k is sampled from version ``max(0, k − s)`` (:func:`behaviour_version`): with s = 1, forest k + 1 is
  sampled from the weights before update k, while update k runs; with s = 0 every forest waits for the update before
  it (the serial schedule, in another process);
- the trainer hands the rollout process its commands in order through a queue: ``weights`` (a version, the trainable
  tensors flattened per dtype: the LoRA adapters alone when training LoRA), ``job`` (an iteration's prompt groups,
  decided by the trainer) and ``stop``. Each job follows the weights it needs, so the rollout process loads each
  version once, when every earlier job is done, and never runs ahead of the schedule: it waits for the next command,
  and the wait is measured (``pipeline/rollout_wait``);
- tensors travel as torch.multiprocessing shares them (shared memory on the CPU, CUDA IPC on a GPU); nothing else;
- every forest comes back with the version that sampled it (``pipeline/version``, ``pipeline/staleness``), its
  timings and its plan's metrics (computed where the plan ran).

A checkpoint holds the jobs in flight and the behaviour weights they need (the last s versions), so a resumed run
samples them again exactly as the uninterrupted run did. The rollout process dies with the trainer (Linux: the
parent-death signal; elsewhere it sees its parent gone within a second), ignores Ctrl-C (the trainer stops it), and a
failure in it reaches the trainer as its own exception (:class:`RolloutFailed` on top).
"""

from __future__ import annotations

import dataclasses
import os
import queue
import signal
import sys
import time
import traceback
from collections import deque
from dataclasses import dataclass
from typing import Any

import torch

from flowrl.config.schema import ConfigError, TrainConfig

POLL_SECONDS = 0.5  # how often a wait checks that the other side is still alive
START_SECONDS = 600.0  # the longest a rollout process may take to build its model and rewards


def behaviour_version(iteration: int, staleness: int) -> int:
    """The weights version forest ``iteration`` is sampled from: ``max(0, iteration − staleness)``."""
    return max(0, iteration - staleness)


@dataclass(frozen=True)
class RolloutJob:
    """One iteration's rollout as the trainer decides it: this process's prompt groups (``offset``: the global index
    of the first), the teacher's share of each group and the guidance to sample with."""

    iteration: int
    prompts: list[str]
    offset: int
    teacher_fraction: float = 1.0
    guidance: float = 1.0


class RolloutFailed(RuntimeError):
    """The rollout process of ``train.pipeline=async`` failed or exited; the message says how."""


def flatten(params: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    """``params`` as one flat tensor per dtype (detached copies: the trainer keeps updating its own), keyed by the
    dtype's name: one shared buffer per dtype instead of one per tensor."""
    out: dict[str, list[torch.Tensor]] = {}
    for p in params:
        out.setdefault(str(p.dtype), []).append(p.detach().reshape(-1))
    return {k: torch.cat(v).clone() for k, v in out.items()}


@torch.no_grad()
def unflatten_into(params: list[torch.Tensor], flat: dict[str, torch.Tensor]) -> None:
    """Copy :func:`flatten`'s tensors back into ``params`` (same order, shapes and dtypes), in place."""
    offsets = dict.fromkeys(flat, 0)
    for p in params:
        key = str(p.dtype)
        if key not in flat:
            raise RolloutFailed(f"the weights sent hold no {key} tensor, but a trainable parameter is {key}")
        n = p.numel()
        p.copy_(flat[key][offsets[key] : offsets[key] + n].view_as(p))
        offsets[key] += n
    sizes = {k: int(v.numel()) for k, v in flat.items()}
    if offsets != sizes:
        raise RolloutFailed(f"the weights sent ({sizes} elements) do not match the rollout's parameters ({offsets})")


def config_dict(cfg: TrainConfig) -> dict[str, Any]:
    """Every value of ``cfg`` (secrets included: it goes to the rollout process in memory, never to a file)."""
    return dataclasses.asdict(cfg)


def config_from_dict(values: dict[str, Any]) -> TrainConfig:
    """:func:`config_dict` read back into the schema its components select (already validated by the trainer)."""
    from omegaconf import OmegaConf

    schema = TrainConfig.schema(
        plan=values["rollout"].get("plan"), rule=values["credit"].get("rule"), objective=values["loss"].get("objective")
    )
    return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(schema), values))


def check_pipeline(cfg: TrainConfig, model=None, reward=None, sharded: bool = False) -> None:
    """Refuse, naming the key, what ``train.pipeline=async`` cannot run with the run at hand: a model or reward given
    in code (the rollout process builds its own from the config) and sharded training. What the config alone
    decides is refused at load (:func:`flowrl.config.pipeline.check_pipeline_config`)."""
    t = cfg.train
    if t.pipeline != "async":
        return
    if model is not None or reward is not None:
        given = "model" if model is not None else "reward"
        raise ConfigError(
            f"train.pipeline='async' builds the rollout's copy of the policy and its rewards from the config in its "
            f"own process, but a {given} object was given to the Trainer; pass it as config keys "
            "(model.path, rewards) or use train.pipeline='sync'"
        )
    if sharded:
        raise ConfigError(
            "train.pipeline='async' with model.shard='fsdp' is not supported: the rollout process holds a whole copy "
            "of the policy; use model.shard='none' or train.pipeline='sync'"
        )


def split_threads(train) -> tuple[int | None, int | None]:
    """(the trainer's, the rollout process's) torch CPU threads from the ``train`` section: ``sync`` keeps
    ``train.num_threads`` (None: torch's default) and has no rollout process; ``async`` gives the rollout process
    ``train.rollout_threads`` (default: half of ``train.num_threads``, or of torch's default, at least 1) and the
    trainer the rest (at least 1)."""
    if train.pipeline != "async":
        return train.num_threads, None
    total = int(train.num_threads or torch.get_num_threads())
    rollout = int(train.rollout_threads or max(1, total // 2))
    return max(1, total - rollout), rollout


def rollout_failure(error: BaseException) -> bool:
    """Whether ``error`` came from the rollout process (:class:`RolloutFailed`, or its own error raised on top)."""
    return isinstance(error, RolloutFailed) or isinstance(error.__cause__, RolloutFailed)


class RolloutSide:
    """What the rollout process holds: its copy of the policy (built from the config, the same trainable parameters in
    the same order as the trainer's), the plan, the rewards and the objective's sampling teacher, and a
    :class:`~flowrl.rollout.runner.RolloutRunner` over them."""

    def __init__(self, cfg: TrainConfig):
        from flowrl.config import build
        from flowrl.config.chosen import build_components
        from flowrl.rollout.runner import RolloutRunner
        from flowrl.training.scoring import run_rewards
        from flowrl.training.trainable import setup_trainable, teacher_weights

        c = cfg
        self.reward, _ = run_rewards(c)
        self.plan, _, objective = build_components(c)
        teacher = teacher_weights(objective)
        self.model = build.build_model(c.model, build.resolve_device(c.model.device))
        self.params = setup_trainable(self.model, c.model, c.train.seed)
        objective.setup(self.model, **teacher)
        self.plan.setup(self.model, self.reward)
        self.runner = RolloutRunner(
            self.plan,
            self.model,
            self.reward,
            prompts=None,
            group=None,
            seed=c.train.seed,
            guidance=1.0,
            max_batch=c.rollout.max_batch,
            chunks=c.rollout.chunks,
            reduction=objective.reduction,
            teacher=objective.sampling_teacher(),
            async_reward={"auto": "auto", "true": True, "false": False}[str(c.train.async_reward).lower()],
        )

    def load(self, flat: dict[str, torch.Tensor]) -> None:
        """Take a weights version: into the trainable parameters, then the plan's copies follow (an explorer)."""
        unflatten_into(self.params, flat)
        self.plan.after_update(self.model)

    def run(self, job: RolloutJob) -> tuple[Any, dict[str, float], dict[str, float]]:
        """(scored forest, timings, the plan's metrics of it) of ``job``."""
        self.runner.guidance = job.guidance
        forest, times = self.runner.run_prompts(job.iteration, job.prompts, job.offset, job.teacher_fraction)
        forest.logp_old  # settle the host copies of the edges' values before the forest leaves the process
        return forest, times, self.plan.metrics(forest)

    def close(self) -> None:
        self.runner.close()


def _die_with_parent() -> None:
    """Linux: the kernel kills this process when its parent dies (kill -9 of the trainer leaves no orphan)."""
    if sys.platform.startswith("linux"):
        try:
            import ctypes

            ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
        except (OSError, AttributeError):
            pass


def _next_command(commands, parent_pid: int):
    """The next command; exits when the trainer is gone (checked every :data:`POLL_SECONDS`)."""
    while True:
        try:
            return commands.get(timeout=POLL_SECONDS)
        except queue.Empty:
            if os.getppid() != parent_pid:
                os._exit(0)


def rollout_process_main(values: dict[str, Any], threads: int | None, commands, results, parent_pid: int) -> None:
    """The rollout process: build a :class:`RolloutSide` from the config, answer ``ready``, then run the trainer's
    commands in order (``weights``, ``job``, ``stop``). A failure is sent to the trainer, then the process exits 1."""
    _die_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole process group: the trainer stops us
    side = None
    try:
        if threads:
            torch.set_num_threads(threads)
        side = RolloutSide(config_from_dict(values))
        results.put(("ready", os.getpid()))
        version, waited = -1, 0.0
        while True:
            t0 = time.perf_counter()
            kind, payload = _next_command(commands, parent_pid)
            waited += time.perf_counter() - t0
            if kind == "stop":
                break
            if kind == "weights":
                version, flat = payload
                side.load(flat)
                del flat
                continue
            forest, times, stats = side.run(payload)
            results.put(("forest", payload.iteration, version, forest, times, stats, waited))
            waited = 0.0
    except BaseException as e:  # noqa: BLE001 — every failure goes to the trainer, with its traceback
        try:
            results.put(("error", _picklable(e), traceback.format_exc()))
            results.close()
            results.join_thread()  # the message is in the pipe before the process ends
        except Exception:  # noqa: BLE001
            pass
        sys.stdout.flush()
        os._exit(1)
    finally:
        if side is not None:
            side.close()


def _picklable(error: BaseException) -> BaseException:
    """``error`` itself when it pickles (the trainer raises the same type), else a RuntimeError with its text."""
    import pickle

    try:
        pickle.loads(pickle.dumps(error))
        return error
    except Exception:  # noqa: BLE001
        return RuntimeError(f"{type(error).__name__}: {error}")


class AsyncRollouts:
    """The trainer's side of the rollout process (one machine): start it, hand it weights and jobs on the fixed
    schedule, take its forests, stop it. ``make_job(iteration)`` → :class:`RolloutJob` (the trainer decides the
    prompts); ``params``: the trainer's trainable parameters; ``max_steps``: no job is made at or past it."""

    def __init__(self, cfg: TrainConfig, params: list[torch.nn.Parameter], make_job, threads: int | None):
        self.cfg, self.params, self.make_job, self.threads = cfg, params, make_job, threads
        self.staleness = int(cfg.train.max_staleness)
        self.max_steps = int(cfg.train.max_steps)
        self.process = None
        self.pending: deque[RolloutJob] = deque()  # jobs handed over, their forests not yet taken
        self.behaviour: dict[int, dict[str, torch.Tensor]] = {}  # versions in-flight jobs may still need
        self.sent_version = -1
        self._restored: dict | None = None

    # ---- the schedule --------------------------------------------------------------------------
    @property
    def started(self) -> bool:
        return self.process is not None

    def start(self, step: int) -> None:
        """Start the rollout process at ``step`` (the weights are version ``step``) and hand it the jobs of
        iterations ``step … step + s``: those of a resumed checkpoint as they were made, then new ones."""
        import torch.multiprocessing as mp

        ctx = mp.get_context("spawn")
        self.commands, self.results = ctx.Queue(), ctx.Queue()
        self.process = ctx.Process(
            target=rollout_process_main,
            args=(config_dict(self.cfg), self.threads, self.commands, self.results, os.getpid()),
            name="flowrl-rollout",
            daemon=True,
        )
        self.process.start()
        self.step = step
        restored, self._restored = self._restored, None
        if restored is not None:
            self.behaviour = dict(restored["behaviour"])
        self._keep_current()
        if restored is not None:
            for job in restored["pending"]:
                self._submit(job)
        last = self.pending[-1].iteration if self.pending else step - 1
        for it in range(last + 1, min(step + self.staleness, self.max_steps - 1) + 1):
            self._submit(self.make_job(it))

    def _submit(self, job: RolloutJob) -> None:
        """Hand over ``job``, preceded by the weights version it is sampled from when not sent yet."""
        version = behaviour_version(job.iteration, self.staleness)
        if version != self.sent_version:
            flat = self.behaviour.get(version)
            if flat is None and version == self.step:
                flat = flatten(self.params)
            if flat is None:
                raise RolloutFailed(f"no weights of version {version} for the rollout of iteration {job.iteration}")
            self.commands.put(("weights", (version, flat)))
            self.sent_version = version
        self.commands.put(("job", job))
        self.pending.append(job)

    def after_update(self, step: int) -> None:
        """The weights are now version ``step``: hand over the job that waited for them (iteration ``step + s``)."""
        self.step = step
        self._keep_current()
        if step + self.staleness < self.max_steps:
            self._submit(self.make_job(step + self.staleness))

    def _keep_current(self) -> None:
        """Keep the current weights as a behaviour version (s > 0) and forget those more than s updates old:
        iterations ``step … step + s`` sample from versions ``step − s … step``, whatever ``train.max_steps`` says (a
        resume may raise it)."""
        if self.staleness > 0 and self.step not in self.behaviour:
            self.behaviour[self.step] = flatten(self.params)
        self.behaviour = {v: w for v, w in self.behaviour.items() if self.step - self.staleness <= v <= self.step}

    def receive(self, iteration: int) -> tuple[Any, dict[str, float], dict[str, float]]:
        """The forest of ``iteration`` (waiting for it), its timings with the pipeline's metrics, and its plan's
        metrics. A failed or vanished rollout process raises its own error (:class:`RolloutFailed` the cause)."""
        if not self.pending or self.pending[0].iteration != iteration:
            raise RolloutFailed(f"the rollout of iteration {iteration} was never handed to the rollout process")
        t0 = time.perf_counter()
        while True:
            message = self._message()
            if message[0] == "forest":
                break
        _, it, version, forest, times, stats, waited = message
        self.pending.popleft()
        times = {
            **times,
            "pipeline/update_wait": time.perf_counter() - t0,
            "pipeline/rollout_wait": waited,
            "pipeline/version": float(version),
            "pipeline/staleness": float(self.step - version),
        }
        return forest, times, stats

    def _message(self, timeout: float | None = None):
        """The next message of the rollout process; its failure, or its exit, raises."""
        t0 = time.perf_counter()
        while True:
            try:
                message = self.results.get(timeout=POLL_SECONDS)
            except queue.Empty:
                if not self.process.is_alive():
                    raise RolloutFailed(
                        f"the rollout process exited (status {self.process.exitcode}) without an error message"
                    ) from None
                if timeout is not None and time.perf_counter() - t0 > timeout:
                    raise RolloutFailed(f"the rollout process did not start within {timeout:g} s") from None
                continue
            if message[0] == "error":
                _, error, text = message
                raise error from RolloutFailed(f"the rollout process failed:\n{text}")
            return message

    # ---- checkpoints ---------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """The jobs in flight and the behaviour weights they need (what a resume hands the rollout process again)."""
        return {
            "staleness": self.staleness,
            "pending": [dataclasses.asdict(j) for j in self.pending],
            "behaviour": {v: {k: t.clone() for k, t in w.items()} for v, w in self.behaviour.items() if v < self.step},
        }

    def load_state_dict(self, state: dict | None) -> None:
        """Keep a checkpoint's pipeline state for :meth:`start` (None: a checkpoint of a serial run, or of step 0:
        the jobs are made anew)."""
        if state is None:
            return
        if int(state["staleness"]) != self.staleness:
            raise ConfigError(
                f"train.max_staleness={self.staleness}, but the checkpoint was written with "
                f"train.max_staleness={state['staleness']}: resume with the same staleness (it fixes which weights "
                "sampled each forest)"
            )
        self._restored = {"pending": [RolloutJob(**j) for j in state["pending"]], "behaviour": state["behaviour"]}

    def close(self) -> None:
        """Stop the rollout process (a stop command, then a terminate if it does not exit within 10 s)."""
        if self.process is None:
            return
        process, self.process = self.process, None
        if process.is_alive():
            try:
                self.commands.put(("stop", None))
            except (OSError, ValueError):
                pass
            process.join(10)
            if process.is_alive():
                process.terminate()
                process.join(5)
        for q in (self.commands, self.results):
            q.cancel_join_thread()
            q.close()
        self.pending.clear()
