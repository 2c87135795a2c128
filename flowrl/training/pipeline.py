"""Rollouts that do not wait for the update (``train.pipeline: async``; docs/pipeline.md).

A rollout process beside the trainer samples and scores the next forests while the trainer updates on the current
one. The schedule is fixed by ``train.max_staleness`` (s), so a run stays reproducible and resumable:

- the weights after k optimizer steps are **version k** (version 0: the starting weights);
- forest k is sampled from version ``max(0, k − s)`` (:func:`behaviour_version`): with s = 1, forest k + 1 is
  sampled from the weights before update k, while update k runs; with s = 0 every forest waits for the update before
  it (the serial schedule, in another process);
- the trainer hands the rollout process its commands in order: ``weights`` (a version, the trainable tensors
  flattened per dtype: the LoRA adapters alone when training LoRA), ``job`` (an iteration's prompt groups, decided by
  the trainer) and ``stop``. Each job follows the weights it needs, so the rollout process loads each version once,
  when every earlier job is done, and never runs ahead of the schedule: it waits for the next command, and the wait
  is measured (``pipeline/rollout_wait``);
- the link carries them as torch does (:mod:`flowrl.training.rollout_process`: torch.multiprocessing's queues, shared
  memory on the CPU and CUDA IPC on a GPU, for a rollout process beside the trainer; the run's torch.distributed
  process group for launched rollout processes);
- every forest comes back with the version that sampled it (``pipeline/version``, ``pipeline/staleness``), its
  timings and its plan's metrics (computed where the plan ran).

A checkpoint holds the jobs in flight and the behaviour weights they need (the last s versions), so a resumed run
samples them again exactly as the uninterrupted run did. A failure on the rollout side reaches the trainer as its own
exception (:class:`RolloutFailed` its cause).
"""

from __future__ import annotations

import dataclasses
import time
from collections import deque
from dataclasses import dataclass
from typing import Any

import torch

from flowrl.config.schema import ConfigError, TrainConfig


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
    """``params`` whole (sharded ones gathered: a collective, every trainer calls it) as one flat tensor per dtype
    (detached copies: the trainer keeps updating its own), keyed by the dtype's name: one buffer per dtype."""
    from flowrl.distributed.sharding import whole

    out: dict[str, list[torch.Tensor]] = {}
    for p in params:
        out.setdefault(str(p.dtype), []).append(whole(p.detach()).reshape(-1))
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


def check_pipeline(cfg: TrainConfig, model=None, reward=None) -> None:
    """Refuse, naming the key, what ``train.pipeline=async`` cannot run with the run at hand: a model or reward given
    in code (the rollout process builds its own from the config). What the config alone decides is refused at load
    (:func:`flowrl.config.pipeline.check_pipeline_config`)."""
    if cfg.train.pipeline != "async" or (model is None and reward is None):
        return
    given = "model" if model is not None else "reward"
    raise ConfigError(
        f"train.pipeline='async' builds the rollout's copy of the policy and its rewards from the config in its "
        f"own process, but a {given} object was given to the Trainer; pass it as config keys "
        "(model.path, rewards) or use train.pipeline='sync'"
    )


def trainers_of(processes: int, launched: int) -> int:
    """The launched processes that train when ``launched`` of ``processes`` roll out (``train.rollout_processes``; 0:
    all train); a ConfigError when none would be left to train. The run's layout and the estimate both ask it."""
    if not launched:
        return processes
    if not 0 < launched < processes:
        raise ConfigError(
            f"train.rollout_processes={launched} must leave at least one of the {processes} launched processes to "
            "train (and be >= 1); launch more processes or lower it"
        )
    return processes - launched


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


class AsyncRollouts:
    """The trainer's side of the pipeline: hand the rollout side weights and jobs on the fixed schedule, take its
    forests, stop it. ``make_job(iteration)`` → :class:`RolloutJob` (the trainer decides the prompts); ``params``: the
    trainer's trainable parameters (gathered whole when sharded, :func:`flatten`); ``connect()`` → a link to
    the rollout side (:mod:`flowrl.training.rollout_process`: a process started beside this one, or a launched
    rollout process of ``train.rollout_processes``); ``sends_weights``: False when another trainer sends them to the
    same rollout process (only the version is sent then)."""

    def __init__(self, cfg: TrainConfig, params: list[torch.nn.Parameter], make_job, connect, sends_weights=True):
        self.cfg, self.params, self.make_job, self.connect = cfg, params, make_job, connect
        self.sends_weights = sends_weights
        self.staleness = int(cfg.train.max_staleness)
        self.max_steps = int(cfg.train.max_steps)
        self.link = None
        self.pending: deque[RolloutJob] = deque()  # jobs handed over, their forests not yet taken
        self.behaviour: dict[int, dict[str, torch.Tensor]] = {}  # versions in-flight jobs may still need
        self.sent_version = -1
        self.step = 0
        self._restored: dict | None = None

    # ---- the schedule --------------------------------------------------------------------------
    @property
    def started(self) -> bool:
        return self.link is not None

    def start(self, step: int) -> None:
        """Connect to the rollout side at ``step`` (the weights are version ``step``) and hand it the jobs of
        iterations ``step … step + s``: those of a resumed checkpoint as they were made, then new ones."""
        self.link = self.connect()
        self.step = step
        restored, self._restored = self._restored, None
        if restored is not None:
            self.behaviour = dict(restored["behaviour"])
        self._keep_current()
        for job in restored["pending"] if restored is not None else ():
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
            self.link.put(("weights", (version, flat if self.sends_weights else None)))
            self.sent_version = version
        self.link.put(("job", job))
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
        metrics. A failed or vanished rollout side raises its own error (:class:`RolloutFailed` the cause)."""
        if not self.pending or self.pending[0].iteration != iteration:
            raise RolloutFailed(f"the rollout of iteration {iteration} was never handed to the rollout process")
        t0 = time.perf_counter()
        while True:
            message = self.link.get()
            if message[0] == "error":
                _, error, text = message
                raise error from RolloutFailed(f"the rollout process failed:\n{text}")
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
        """Stop the rollout side (its link says how)."""
        link, self.link = self.link, None
        if link is not None:
            link.close()
        self.pending.clear()
