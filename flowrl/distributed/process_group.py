"""The processes of a run, as the loop, credit rules and prompt sources see them: one object for
gathering tensors, summing numbers and averaging gradients over an accelerate process group (with one
process every call is the identity, so the single-process path has no collective in it)."""

from __future__ import annotations

import contextlib
from typing import Callable, Iterator, Sequence

import torch

WEIGHT = "__weight:"  # the prefix of the weight beside each mean in reduce_means' sums


class ProcessGroup:
    """The run's data replicas as the loop sees them: ``world`` replicas, this process's ``rank`` among them; the main
    process (global rank 0) writes the run's files.

    With context parallelism (``context`` > 1, :mod:`flowrl.distributed.context_parallel`) the ``processes`` form
    groups of ``context`` consecutive ranks that hold the same data: ``world = processes / context`` and ``rank`` is
    the group's index, so prompts, seeds and shares are the group's; gathers and sums count each group once; the
    gradient reducer sums over every process (a group's ranks hold parts of one gradient) and divides by ``world``.

    ``members``: a torch.distributed group of some of the launched processes and their global ranks (the trainers of
    ``train.pipeline=async`` with ``train.rollout_processes``, :mod:`flowrl.training.pipeline`): then ``processes``
    counts them, ``global_rank`` is this process's index among them, and every collective runs over that group
    (global rank 0 must be a member: it writes the run's files). None: every launched process."""

    def __init__(self, accelerator, context: int = 1, members: tuple[object, list[int]] | None = None):
        self.accelerator = accelerator
        self.dist_group, ranks = members if members is not None else (None, None)
        self.processes = len(ranks) if ranks is not None else accelerator.num_processes
        self.context = int(context)
        if self.context < 1 or self.processes % self.context:
            raise ValueError(f"context={context} must divide the processes ({self.processes})")
        self.world = self.processes // self.context
        self.global_rank = ranks.index(accelerator.process_index) if ranks is not None else accelerator.process_index
        self.rank = self.global_rank // self.context
        self.is_main = accelerator.is_main_process
        self.context_rank = self.global_rank % self.context  # 0: the group's leader (writes its per-replica files)

    def gather(self, t: torch.Tensor) -> torch.Tensor:
        """Every replica's ``t`` [n, ...] concatenated in rank order [world·n, ...], on the CPU."""
        if self.processes == 1:
            return t
        if self.dist_group is not None:
            import torch.distributed as dist

            local = t.to(self.accelerator.device).contiguous()
            out = torch.empty(
                (self.processes * local.shape[0], *local.shape[1:]), dtype=local.dtype, device=local.device
            )
            dist.all_gather_into_tensor(out, local, group=self.dist_group)
            every = out.cpu()
        else:
            every = self.accelerator.gather(t.to(self.accelerator.device)).cpu()
        if self.context == 1:
            return every
        return every.reshape(self.processes, *t.shape)[:: self.context].reshape(-1, *t.shape[1:])

    def sum(self, value: float) -> float:
        """``value`` summed over replicas."""
        if self.processes == 1:
            return float(value)
        t = torch.tensor([float(value)], device=self.accelerator.device)
        if self.dist_group is not None:
            import torch.distributed as dist

            dist.all_reduce(t, op=dist.ReduceOp.SUM, group=self.dist_group)
            return float(t.item()) / self.context
        return float(self.accelerator.reduce(t, reduction="sum").item()) / self.context

    def mean(self, value: float) -> float:
        return self.sum(value) / self.world

    def reduce_sums(self, sums: dict[str, float], extremes: dict[str, Callable]) -> dict[str, float]:
        """``sums`` combined over processes key by key, over the union of every process's keys: a key in
        ``extremes`` by its function (e.g. ``min``; processes without the key take no part), the others
        added (a missing key counts 0). One gather of the small dicts; the result is the same on every rank."""
        if self.processes == 1:
            return dict(sums)
        import torch.distributed as dist

        every: list[dict[str, float]] = [{} for _ in range(self.processes)]
        dist.all_gather_object(every, dict(sums), group=self.dist_group)
        out: dict[str, float] = {}
        for part in every[:: self.context]:  # rank order, so every rank folds the same numbers in the same order
            for key, value in part.items():
                fold(out, key, value, extremes)
        return out

    def reduce_means(self, values: dict[str, float], weights: dict[str, float]) -> dict[str, float]:
        """``values`` combined over processes by one :meth:`reduce_sums`, over the union of every process's
        keys: a key with a weight (the number of items behind its value, e.g. the prompts of a per-task
        accuracy) as the weighted mean sum(value·weight) / sum(weight) (processes without the key, or with
        weight 0, take no part); a key without one (a count) added. Equal on every rank to one process's
        statistics over all the items."""
        sums: dict[str, float] = {}
        for key, value in values.items():
            if key.startswith(WEIGHT):
                raise ValueError(f"reduce_means: key {key!r} starts with the reserved {WEIGHT!r}")
            weight = weights.get(key)
            if weight is None:
                sums[key] = float(value)
            elif weight:
                sums[key], sums[WEIGHT + key] = float(value) * weight, float(weight)
        total = self.reduce_sums(sums, {})
        return {
            k: v / total[WEIGHT + k] if WEIGHT + k in total else v for k, v in total.items() if not k.startswith(WEIGHT)
        }

    def max(self, value: float) -> float:
        """The largest ``value`` over processes."""
        if self.processes == 1:
            return float(value)
        import torch.distributed as dist

        t = torch.tensor([float(value)], device=self.accelerator.device)
        dist.all_reduce(
            t, op=dist.ReduceOp.MAX, group=self.dist_group
        )  # one small collective (the updater asks every optimizer step)
        return float(t.item())

    def gradient_reducer(
        self, params: Sequence[torch.nn.Parameter], bucket_mb: float = 25.0, enabled: bool = True
    ) -> "GradientReducer":
        """A :class:`GradientReducer` of ``params`` over these processes (hooks only when ``processes`` > 1 and
        ``enabled``: a sharded model reduces its own gradients): the sum over every process / ``world``."""
        reduce = None
        if self.dist_group is not None:
            import functools

            import torch.distributed as dist

            reduce = functools.partial(dist.all_reduce, group=self.dist_group)
        return GradientReducer(
            params,
            self.processes if enabled else 1,
            self.accelerator.device,
            bucket_bytes=int(bucket_mb * 2**20),
            all_reduce=reduce,
            divisor=self.world,
        )

    def broadcast(self, obj):
        """The main process's ``obj`` (any picklable value), on every process."""
        if self.processes == 1:
            return obj
        import torch.distributed as dist

        box = [obj]
        dist.broadcast_object_list(box, src=0, group=self.dist_group)  # global rank 0: always a member
        return box[0]

    def shard(self, items: list) -> tuple[list, int]:
        """This process's contiguous share of ``items`` (len divisible by ``world``) and its first index."""
        k = len(items) // self.world
        return items[self.rank * k : (self.rank + 1) * k], self.rank * k

    def wait(self) -> None:
        if self.dist_group is not None:
            import torch.distributed as dist

            dist.barrier(group=self.dist_group)
            return
        self.accelerator.wait_for_everyone()

    def close(self) -> None:
        """At the end of a command: wait for every process, then destroy the process group (a process that exits
        with gloo's threads still up can abort the interpreter: "terminate called without an active exception")."""
        if self.accelerator.num_processes > 1:
            self.accelerator.wait_for_everyone()  # every launched process, rollout processes included
            self.accelerator.state.destroy_process_group()


def fold(sums: dict[str, float], key: str, value: float, extremes: dict[str, Callable]) -> None:
    """Accumulate one diagnostic into ``sums``: keys in ``extremes`` combine by their function (min/max),
    the rest add (size-weighted sums, divided by the units at the end)."""
    if key in extremes and key in sums:
        sums[key] = extremes[key](sums[key], value)
    else:
        sums[key] = sums.get(key, 0.0) + value


class GradientReducer:
    """Replaces every ``p.grad`` of ``params`` by its mean over the ``world`` processes (a missing grad
    counts 0; afterwards every parameter has a grad), once per optimizer step, overlapping the backward as
    torch DDP does: the parameters (in reverse order, roughly that in which the backward finishes their
    gradients) are cut into buckets of about ``bucket_bytes``; during the backward that ends an
    accumulation (run under :meth:`final`) a post-accumulate-grad hook counts each parameter ready, and a
    bucket whose parameters are all ready is all-reduced asynchronously (sum, then / world on
    :meth:`finish`), buckets always launched in index order, so every process issues the same collectives
    in the same order whatever its own backward does (a parameter it does not reach, or no backward at
    all). :meth:`finish`, before the optimizer step and on every process, launches the buckets not yet
    launched (their grads as they stand), waits for all of them and writes the means into the grads.
    Between a :meth:`final` backward and :meth:`finish` no other collective may be issued. Backwards
    outside :meth:`final` (the earlier micro-batches of an accumulation) only accumulate, like DDP's
    ``no_sync``. With one process there are no hooks, and both calls do nothing."""

    def __init__(
        self,
        params: Sequence[torch.nn.Parameter],
        world: int,
        device,
        bucket_bytes: int = 25 * 2**20,
        all_reduce: Callable | None = None,
        divisor: int | None = None,
    ):
        self.params, self.world, self.device = list(params), world, device
        self.divisor = world if divisor is None else divisor  # the sum over the processes / this
        self._all_reduce = all_reduce  # torch.distributed.all_reduce unless given (tests count the calls)
        self.dtype = self.params[0].dtype if self.params else torch.float32
        for q in self.params[1:]:  # one reduce dtype, as torch.cat of the grads promotes them
            self.dtype = torch.promote_types(self.dtype, q.dtype)
        self.buckets: list[list[int]] = []  # parameter indices, in reverse parameter order
        size = 0
        for i in reversed(range(len(self.params))):
            nbytes = self.params[i].numel() * self.dtype.itemsize
            if not self.buckets or size + nbytes > bucket_bytes:
                self.buckets.append([])
                size = 0
            self.buckets[-1].append(i)
            size += nbytes
        self.bucket_of = {i: b for b, bucket in enumerate(self.buckets) for i in bucket}
        self.handles = []
        if world > 1:
            for i, p in enumerate(self.params):
                if p.requires_grad:
                    self.handles.append(p.register_post_accumulate_grad_hook(self._hook(i)))
        self._reset()

    def _reset(self) -> None:
        self.armed = False
        self.pending = [len(b) for b in self.buckets]  # parameters of each bucket not yet ready
        self.launched = 0  # buckets 0 .. launched-1 are in flight
        self.inflight: list[tuple[int, torch.Tensor, object]] = []

    def _hook(self, i: int) -> Callable:
        def ready(_param: torch.Tensor) -> None:
            if not self.armed:
                return
            b = self.bucket_of[i]
            if b < self.launched or self.pending[b] == 0:
                raise RuntimeError(
                    f"GradientReducer: parameter {i} got gradient twice in the backward that ends an "
                    "accumulation, after its bucket was counted ready (reentrant checkpointing or a "
                    "second backward under final())"
                )
            self.pending[b] -= 1
            while self.launched < len(self.buckets) and self.pending[self.launched] == 0:
                self._launch(self.launched)

        return ready

    def _launch(self, b: int) -> None:
        import torch.distributed as dist

        grads = [
            self.params[i].grad if self.params[i].grad is not None else torch.zeros_like(self.params[i])
            for i in self.buckets[b]
        ]
        flat = torch.cat([g.detach().reshape(-1).to(self.dtype) for g in grads]).to(self.device)
        reduce = self._all_reduce or dist.all_reduce
        self.inflight.append((b, flat, reduce(flat, op=dist.ReduceOp.SUM, async_op=True)))
        self.launched = b + 1

    @contextlib.contextmanager
    def final(self) -> Iterator[None]:
        """Run the backward that ends an accumulation in this block: its ready buckets start reducing."""
        if self.world == 1:
            yield
            return
        if self.armed or self.launched:
            raise RuntimeError("GradientReducer.final: a second final backward before finish()")
        self.armed = True
        try:
            yield
        finally:
            self.armed = False

    def finish(self) -> None:
        """Launch the buckets not yet launched, wait for every bucket and write the means into the grads."""
        if self.world == 1:
            return
        try:
            while self.launched < len(self.buckets):
                self._launch(self.launched)
            for b, flat, work in self.inflight:
                work.wait()
                flat.div_(self.divisor)
                offset = 0
                for i in self.buckets[b]:
                    p = self.params[i]
                    p.grad = flat[offset : offset + p.numel()].view_as(p).to(p.device, p.dtype)
                    offset += p.numel()
        finally:
            self._reset()

    def remove(self) -> None:
        """Remove the hooks."""
        for h in self.handles:
            h.remove()
        self.handles = []
