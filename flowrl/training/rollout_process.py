"""The rollout side of ``train.pipeline: async`` (:mod:`flowrl.training.pipeline` has the schedule) and the links to it.

Two layouts, one loop (:func:`serve`):

- **beside each trainer** (``train.rollout_processes: 0``, the default; one machine): every trainer process starts a
  rollout process of its own (``spawn``) and talks to it through two torch.multiprocessing queues: tensors travel in
  shared memory (CUDA IPC on a GPU, where the rollout process uses the trainer's device). It dies with its trainer
  (Linux's parent-death signal; elsewhere it sees its parent gone within :data:`POLL_SECONDS`) and ignores Ctrl-C (its
  trainer stops it);
- **launched rollout processes** (``train.rollout_processes: N`` under ``accelerate launch``/``torchrun``): the last N
  of the launched processes roll out, the others train (FSDP2 among them only). Trainer t is served by rollout process
  ``t mod N``; each pair has its own torch.distributed group (NCCL on GPUs, gloo on CPUs), over which two threads per
  end send and receive the messages (``send_object_list``/``recv_object_list``), so neither side blocks the other.

A rollout process serving several trainers takes their commands in lockstep (each trainer sends the same schedule):
weights once per version, then every trainer's job of the iteration, each answered to its trainer.
"""

from __future__ import annotations

import os
import queue
import signal
import sys
import threading
import time
import traceback
from dataclasses import dataclass
from typing import Any, Callable

import torch

from flowrl.config.schema import TrainConfig
from flowrl.training.pipeline import (
    RolloutFailed,
    RolloutJob,
    config_dict,
    config_from_dict,
    trainers_of,
    unflatten_into,
)

POLL_SECONDS = 0.5  # how often a wait checks that the other side is still alive


class RolloutSide:
    """What a rollout process holds: its copy of the policy (built from the config, the same trainable parameters in
    the same order as the trainer's), the plan, the rewards and the objective's sampling teacher, and a
    :class:`~flowrl.rollout.runner.RolloutRunner` over them."""

    def __init__(self, cfg: TrainConfig):
        from flowrl.config import build
        from flowrl.config.chosen import build_components
        from flowrl.training.scoring import run_rewards
        from flowrl.training.trainable import rollout_runner, setup_trainable, teacher_weights

        c = cfg
        self.reward, _ = run_rewards(c)
        self.plan, _, objective = build_components(c)
        teacher = teacher_weights(objective)
        self.model = build.build_model(c.model, build.resolve_device(c.model.device))
        self.params = setup_trainable(self.model, c.model, c.train.seed)
        # its teacher when the plan lets one draw; no copy that only the loss reads
        objective.setup_sampling(self.model, draws_teacher=bool(self.plan.teacher_share), **teacher)
        self.plan.setup(self.model, self.reward)
        self.runner = rollout_runner(c, self.plan, self.model, self.reward, objective)

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


def serve(make_side: Callable[[], RolloutSide], links: list) -> None:
    """The rollout loop over the trainers' ``links`` (each: ``get()``, ``put(message)``): build the side, answer
    ``ready``, then take one command from every link at a time, in lockstep: ``weights`` (loaded once: the first link
    that carries tensors), ``job`` (run for each link, answered on it), ``stop`` (from every link: the end). The
    time spent waiting for commands is sent with the next forest (``pipeline/rollout_wait``)."""
    side = make_side()
    try:
        for link in links:
            link.put(("ready", os.getpid()))
        version, waited = -1, 0.0
        while True:
            t0 = time.perf_counter()
            commands = [link.get() for link in links]
            waited += time.perf_counter() - t0
            kinds = {kind for kind, _ in commands}
            if kinds == {"stop"}:
                return
            if len(kinds) != 1:
                raise RolloutFailed(f"the trainers sent different commands at once ({sorted(kinds)}): out of step")
            if kinds == {"weights"}:
                versions = {payload[0] for _, payload in commands}
                flats = [payload[1] for _, payload in commands if payload[1] is not None]
                if len(versions) != 1 or not flats:
                    raise RolloutFailed(f"the trainers sent weights versions {sorted(versions)} at once: out of step")
                version = versions.pop()
                side.load(flats[0])
                continue
            for link, (_, job) in zip(links, commands):
                forest, times, stats = side.run(job)
                link.put(("forest", job.iteration, version, forest, times, stats, waited))
                waited = 0.0
    finally:
        side.close()


def report_failure(links: list, error: BaseException) -> None:
    """Send ``error`` (itself when it pickles, so the trainer raises the same type) and its traceback to every
    trainer."""
    import pickle

    try:
        pickle.loads(pickle.dumps(error))
    except Exception:  # noqa: BLE001
        error = RuntimeError(f"{type(error).__name__}: {error}")
    for link in links:
        try:
            link.put(("error", error, traceback.format_exc()))
        except Exception:  # noqa: BLE001
            pass


# ---- beside each trainer: a spawned process and two queues ----------------------------------------------------------
class ProcessEndpoint:
    """The rollout process's end of the two queues; a wait for a command exits the process once its trainer is gone."""

    def __init__(self, commands, results, parent_pid: int):
        self.commands, self.results, self.parent_pid = commands, results, parent_pid

    def get(self):
        while True:
            try:
                return self.commands.get(timeout=POLL_SECONDS)
            except queue.Empty:
                if os.getppid() != self.parent_pid:
                    os._exit(0)

    def put(self, message) -> None:
        self.results.put(message)

    def flush(self) -> None:
        """Wait until every message put is in the pipe (before the process ends)."""
        self.results.close()
        self.results.join_thread()


def _die_with_parent() -> None:
    """Linux: the kernel kills this process when its parent dies (kill -9 of the trainer leaves no orphan)."""
    if sys.platform.startswith("linux"):
        try:
            import ctypes

            ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
        except (OSError, AttributeError):
            pass


def rollout_process_main(
    values: dict[str, Any], threads: int | None, device: str, commands, results, parent_pid: int
) -> None:
    """The spawned rollout process: :func:`serve` its trainer through the queues; a failure goes to the trainer, then
    the process exits 1."""
    _die_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole process group: the trainer stops us
    endpoint = ProcessEndpoint(commands, results, parent_pid)
    try:
        if threads:
            torch.set_num_threads(threads)
        if device.startswith("cuda"):
            torch.cuda.set_device(torch.device(device))  # the trainer's card
        serve(lambda: RolloutSide(config_from_dict(values)), [endpoint])
    except BaseException as e:  # noqa: BLE001 — every failure goes to the trainer, with its traceback
        report_failure([endpoint], e)
        endpoint.flush()
        sys.stdout.flush()
        os._exit(1)


class LocalRolloutProcess:
    """The trainer's link to a rollout process it starts beside itself (``spawn``): ``put`` a command, ``get`` the next
    message (raising when the process exited without one), ``close`` (a stop, then terminate after 10 s)."""

    def __init__(self, cfg: TrainConfig, threads: int | None, device: torch.device):
        import torch.multiprocessing as mp

        ctx = mp.get_context("spawn")
        self.commands, self.results = ctx.Queue(), ctx.Queue()
        self.process = ctx.Process(
            target=rollout_process_main,
            args=(config_dict(cfg), threads, str(device), self.commands, self.results, os.getpid()),
            name="flowrl-rollout",
            daemon=True,
        )
        self.process.start()

    def put(self, message) -> None:
        self.commands.put(message)

    def get(self):
        while True:
            try:
                return self.results.get(timeout=POLL_SECONDS)
            except queue.Empty:
                if not self.process.is_alive():
                    raise RolloutFailed(
                        f"the rollout process exited (status {self.process.exitcode}) without an error message"
                    ) from None

    def close(self) -> None:
        process = self.process
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


# ---- launched rollout processes: torch.distributed pairs ------------------------------------------------------------
@dataclass(frozen=True)
class RankLayout:
    """Which launched processes train and which roll out (``train.rollout_processes`` = N: the last N roll out), and
    the torch.distributed groups between them: ``trainer_group`` (the trainers: their collectives and FSDP2 mesh) and
    one ``pairs[t]`` group per trainer t with its rollout process. Made on every process, in the same order."""

    rank: int
    trainers: list[int]
    rollouts: list[int]
    trainer_group: Any
    pairs: dict[int, Any]

    @classmethod
    def make(cls, rank: int, world: int, rollout_processes: int) -> "RankLayout":
        import torch.distributed as dist

        trainers_of(world, rollout_processes)  # at least one trains
        trainers, rollouts = list(range(world - rollout_processes)), list(range(world - rollout_processes, world))
        trainer_group = dist.new_group(trainers)
        pairs = {t: dist.new_group([t, rollouts[t % rollout_processes]]) for t in trainers}
        return cls(rank, trainers, rollouts, trainer_group, pairs)

    @property
    def rolls_out(self) -> bool:
        return self.rank in self.rollouts

    def rollout_of(self, trainer: int) -> int:
        return self.rollouts[trainer % len(self.rollouts)]

    def served(self, rollout: int) -> list[int]:
        """The trainers ``rollout`` serves, in order."""
        return [t for t in self.trainers if self.rollout_of(t) == rollout]

    def sends_weights(self, trainer: int) -> bool:
        """Whether ``trainer`` sends the weights tensors to its rollout process (the first it serves does)."""
        return self.served(self.rollout_of(trainer))[0] == trainer


def layout_of(cfg: TrainConfig, accelerator) -> RankLayout | None:
    """The :class:`RankLayout` of an asynchronous run with ``train.rollout_processes`` (its groups made on every
    launched process), else None (every process trains; an asynchronous run starts its rollout processes itself)."""
    t = cfg.train
    if t.pipeline != "async" or not t.rollout_processes:
        return None
    return RankLayout.make(accelerator.process_index, accelerator.num_processes, t.rollout_processes)


class DistLink:
    """One end of a trainer–rollout pair over its own torch.distributed group: ``put`` queues a message for the sending
    thread, ``get`` takes the next one the receiving thread got. A message ``("stop", …)`` or ``("stopped", …)``
    ends the receiving thread after it; :meth:`close` ends the sending one after what was queued."""

    def __init__(self, peer: int, group, closing: str):
        self.peer, self.group, self.closing = peer, group, closing
        self.inbox: queue.Queue = queue.Queue()
        self.outbox: queue.Queue = queue.Queue()
        self.sender = threading.Thread(target=self._send, name="flowrl-pipeline-send", daemon=True)
        self.receiver = threading.Thread(target=self._receive, name="flowrl-pipeline-receive", daemon=True)
        self.sender.start()
        self.receiver.start()

    def _send(self) -> None:
        import torch.distributed as dist

        while (message := self.outbox.get()) is not None:
            try:
                dist.send_object_list([message], dst=self.peer, group=self.group)
            except Exception as e:  # noqa: BLE001 — the peer is gone: said by the next get()
                self.inbox.put(("error", RolloutFailed(f"process {self.peer} cannot be reached: {e}"), ""))
                return

    def _receive(self) -> None:
        import torch.distributed as dist

        while True:
            box = [None]
            try:
                dist.recv_object_list(box, src=self.peer, group=self.group)
            except Exception as e:  # noqa: BLE001
                self.inbox.put(("error", RolloutFailed(f"process {self.peer} cannot be reached: {e}"), ""))
                return
            self.inbox.put(box[0])
            if box[0][0] in ("stop", "stopped"):
                return

    def put(self, message) -> None:
        self.outbox.put(message)

    def get(self):
        return self.inbox.get()

    def close(self) -> None:
        """The trainer's end: send ``stop``, wait for the rollout's ``stopped``; the rollout's end: answer it."""
        self.outbox.put((self.closing, None))
        self.outbox.put(None)
        self.sender.join()
        if self.closing == "stop":
            self.receiver.join(60)


def serve_rollout_rank(cfg: TrainConfig, layout: RankLayout) -> None:
    """A launched rollout process: :func:`serve` the trainers it serves over their pair groups until each stops."""
    links = [DistLink(t, layout.pairs[t], closing="stopped") for t in layout.served(layout.rank)]
    try:
        serve(lambda: RolloutSide(cfg), links)
    except BaseException as e:
        report_failure(links, e)
        raise
    finally:
        for link in links:
            link.close()
