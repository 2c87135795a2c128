"""GradientReducer (flowrl/distributed/process_group.py): two gloo processes average a tiny Linear's gradients once per
optimizer step, overlapping the backward that ends an accumulation, and equal the mean of the ranks' grads."""

from __future__ import annotations

import os
import socket

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from flowrl.distributed.process_group import GradientReducer

WORLD, MICRO = 2, 3


def inputs(rank: int, step: int, micro: int) -> torch.Tensor:
    return torch.randn(4, 5, generator=torch.Generator().manual_seed(100 * rank + 10 * step + micro))


def grads_of(rank: int, step: int, model: torch.nn.Module, micro_batches: int = MICRO) -> list[torch.Tensor]:
    """One rank's accumulated grads of ``step`` (no reduction), with a parameter it never reaches."""
    model.zero_grad(set_to_none=True)
    for m in range(micro_batches):
        model[0](inputs(rank, step, m)).square().mean().backward()
    if rank == 0:  # only rank 0 reaches the second layer: rank 1's grad of it is missing (counts 0)
        model[1](inputs(rank, step, 9)[:, :3]).sum().backward()
    return [p.grad.clone() if p.grad is not None else torch.zeros_like(p) for p in model.parameters()]


def make_model() -> torch.nn.Sequential:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(5, 3), torch.nn.Linear(3, 2))


def worker(rank: int, port: int, queue) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    try:
        model = make_model()
        calls = []

        def counting_all_reduce(t, **kw):
            calls.append(t.numel())
            return dist.all_reduce(t, **kw)

        # 24-byte buckets: each parameter in its own, launched as the final backward readies them
        reducer = GradientReducer(
            list(model.parameters()), WORLD, torch.device("cpu"), bucket_bytes=24, all_reduce=counting_all_reduce
        )
        out = []
        for step in range(2):
            model.zero_grad(set_to_none=True)
            before = len(calls)
            for m in range(MICRO):
                with reducer.final() if (m == MICRO - 1 and rank == 1) else _null():
                    model[0](inputs(rank, step, m)).square().mean().backward()
                if m < MICRO - 1:
                    assert len(calls) == before, calls  # nothing reduced before the accumulation ends
            if rank == 0:
                with reducer.final():
                    model[1](inputs(rank, step, 9)[:, :3]).sum().backward()
            launched_in_backward = reducer.launched
            reducer.finish()
            # numpy arrays travel by value (a tensor would travel as a shared-memory handle that dies with this process)
            out.append(([p.grad.numpy().copy() for p in model.parameters()], len(calls), launched_in_backward))
        queue.put((rank, out, len(reducer.buckets)))
    finally:
        dist.destroy_process_group()


class _null:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_processes_reduce_mean_once_per_step():
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = mp.spawn(worker, args=(free_port(), queue), nprocs=WORLD, join=False)
    results = dict((r, (out, nb)) for r, out, nb in (queue.get(timeout=300) for _ in range(WORLD)))
    procs.join(timeout=300)
    n_buckets = results[0][1]
    assert n_buckets == 4  # weight and bias of each Linear, each in its own bucket
    for step in range(2):
        expected = [(a + b) / 2 for a, b in zip(grads_of(0, step, make_model()), grads_of(1, step, make_model()))]
        for rank in range(WORLD):
            got, ncalls, launched = results[rank][0][step]
            for g, e in zip(got, expected):
                torch.testing.assert_close(torch.from_numpy(g), e, rtol=0, atol=0)
            assert ncalls == n_buckets * (step + 1)  # one all-reduce per bucket per optimizer step
        # buckets run in reverse parameter order: rank 0's final backward reaches only the second Linear,
        # buckets 0-1, launched in it; rank 1's only the first Linear, whose buckets 2-3 wait behind 0-1
        # (missing there), so all four launch in finish(), in the same order on both ranks
        assert results[0][0][step][2] == 2 and results[1][0][step][2] == 0
    assert expected[2].abs().sum() > 0 and any(e.abs().sum() > 0 for e in expected[:2])


def test_single_process_has_no_hooks():
    model = make_model()
    reducer = GradientReducer(
        list(model.parameters()),
        1,
        torch.device("cpu"),
        all_reduce=lambda *a, **k: (_ for _ in ()).throw(AssertionError("reduced")),
    )
    assert reducer.handles == []
    with reducer.final():
        model(torch.randn(2, 5)).sum().backward()
    before = [p.grad.clone() for p in model.parameters()]
    reducer.finish()
    assert all(torch.equal(a, p.grad) for a, p in zip(before, model.parameters()))
