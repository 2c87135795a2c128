"""Context parallelism (``model.context_parallel``; flowrl/distributed/context_parallel.py): a tiny Wan run split over
2 CPU processes (gloo) by diffusers' Ulysses attention gives the one-process gradient, metrics and LoRA, alone and
with FSDP2 over the same 2 processes (a 1 × 2 mesh: one data replica, the context axis sharded); a run killed with
``kill -9`` resumes to the uninterrupted run's metrics; the data view of the processes counts each context group
once; settings diffusers cannot run split are refused naming the key. The 2-process runs are in the slow set
(`pytest -m slow`); the default set holds the checks and the process-group arithmetic they rest on."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from flowrl.config.schema import ConfigError, TrainConfig
from flowrl.distributed.context_parallel import check_context_parallel, check_transformer, sequence_tokens
from flowrl.distributed.process_group import ProcessGroup
from tests.conftest import without_wall_clock

WORKER = Path(__file__).with_name("context_parallel_worker.py")
ENV = {**os.environ, "ACCELERATE_USE_CPU": "1", "OMP_NUM_THREADS": "1"}
LAUNCH = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
ULYSSES = "model.context_parallel.ulysses=2"


# ---- the checks at load ---------------------------------------------------------------------------------------------
def test_bad_context_parallel_settings_are_refused_naming_the_key():
    with pytest.raises(ConfigError, match=r"model\.context_parallel\.ulysses=0 must be > 0"):
        TrainConfig.from_yaml(None, ["model.context_parallel.ulysses=0"])
    cfg = TrainConfig.from_yaml(None, [ULYSSES, "model.context_parallel.ring=2", "prompts.per_step=6"])
    with pytest.raises(ConfigError, match=r"splits each sample over 4 processes, but this run has 6"):
        check_context_parallel(cfg, 6)
    with pytest.raises(ConfigError, match=r"prompts\.per_step=6 must be divisible by the data replicas \(16 processes"):
        check_context_parallel(cfg, 16)  # 4 replicas
    check_context_parallel(cfg, 12)  # 3 replicas of 2 prompts
    check_context_parallel(TrainConfig.from_yaml(None, ["prompts.per_step=3"]), 2)  # off: nothing to check


def test_a_transformer_diffusers_cannot_split_is_refused_naming_the_key():
    from diffusers import SD3Transformer2DModel

    from flowrl.models.testing.wan import tiny_wan_pipeline

    two = SimpleNamespace(ulysses=2, ring=1)
    with pytest.raises(ConfigError, match=r"no context-parallel plan for SD3Transformer2DModel"):
        check_transformer(SD3Transformer2DModel(num_layers=1, attention_head_dim=8, num_attention_heads=2), two)
    wan = tiny_wan_pipeline().transformer  # 2 heads
    check_transformer(wan, two, tokens=12)
    with pytest.raises(
        ConfigError, match=r"model\.context_parallel\.ulysses=4 must divide the attention heads .*\(2\)"
    ):
        check_transformer(wan, SimpleNamespace(ulysses=4, ring=1))
    with pytest.raises(ConfigError, match=r"sequence of 9 tokens does not split over 2 processes"):
        check_transformer(wan, two, tokens=9)


def test_sequence_tokens_follow_the_latent_and_the_patch():
    from flowrl.models import wrap
    from flowrl.models.testing.wan import tiny_wan_pipeline

    model = wrap(tiny_wan_pipeline(), height=32, width=48, num_frames=5, max_sequence_length=12)
    assert tuple(model.latent_shape) == (4, 2, 4, 6) and sequence_tokens(model) == 2 * 2 * 3  # patch (1, 2, 2)
    image = SimpleNamespace(latent_shape=(16, 8, 12), trainable=SimpleNamespace(config={"patch_size": 2}))
    assert sequence_tokens(image) == 4 * 6
    assert sequence_tokens(SimpleNamespace(latent_shape=(64, 16), trainable=SimpleNamespace(config={}))) is None


# ---- the data view of the processes ----------------------------------------------------------------------------------
class FourProcesses:
    """An accelerator of 4 processes whose collectives see every rank's value (``values[r]`` for rank r)."""

    num_processes = 4
    device = torch.device("cpu")

    def __init__(self, rank: int, values: list[torch.Tensor]):
        self.process_index, self.is_main_process, self.values = rank, rank == 0, values

    def gather(self, t: torch.Tensor) -> torch.Tensor:
        return torch.cat(self.values)

    def reduce(self, t: torch.Tensor, reduction: str) -> torch.Tensor:
        return torch.stack([v[:1].float().sum() for v in self.values]).sum().reshape(1)


def test_context_groups_are_one_replica_each_in_gathers_sums_and_shares():
    # ranks 0, 1 hold replica 0's data and ranks 2, 3 replica 1's, as context parallelism leaves them
    values = [torch.tensor([1.0, 2.0]), torch.tensor([1.0, 2.0]), torch.tensor([5.0, 6.0]), torch.tensor([5.0, 6.0])]
    group = ProcessGroup(FourProcesses(3, values), context=2)
    assert (group.processes, group.world, group.rank, group.context_rank, group.global_rank) == (4, 2, 1, 1, 3)
    assert group.gather(values[3]).tolist() == [1.0, 2.0, 5.0, 6.0]  # each replica once, in rank order
    assert group.sum(float(values[3][0])) == 6.0 and group.mean(float(values[3][0])) == 3.0
    assert group.shard(list(range(6))) == ([3, 4, 5], 3)  # the replica's share, the same on both of its ranks
    plain = ProcessGroup(FourProcesses(3, values))
    assert (plain.world, plain.rank) == (4, 3) and plain.gather(values[3]).numel() == 8 and plain.sum(1.0) == 12.0
    reducer = group.gradient_reducer([torch.nn.Parameter(torch.zeros(2))])
    assert (reducer.world, reducer.divisor) == (4, 2)  # the sum over every process, over the replicas
    with pytest.raises(ValueError, match="context=3 must divide the processes"):
        ProcessGroup(FourProcesses(0, values), context=3)


def test_reduce_sums_count_each_context_group_once(monkeypatch):
    import torch.distributed as dist

    parts = [{"a": 1.0}, {"a": 1.0}, {"a": 2.0, "b": 1.0}, {"a": 2.0, "b": 1.0}]

    def all_gather_object(out, obj, group=None):
        out[:] = parts

    monkeypatch.setattr(dist, "all_gather_object", all_gather_object)
    group = ProcessGroup(FourProcesses(0, [torch.zeros(1)] * 4), context=2)
    assert group.reduce_sums({"a": 1.0}, {}) == {"a": 3.0, "b": 1.0}


# ---- 2 processes, gloo (slow) ----------------------------------------------------------------------------------------
def launch(pipeline: Path, out: Path, processes: int, *extra: str) -> list[dict]:
    """Run tests/context_parallel_worker.py in ``processes`` processes; the per-rank results."""
    out.mkdir(parents=True, exist_ok=True)
    prefix = LAUNCH if processes > 1 else [sys.executable]
    proc = subprocess.run(
        [*prefix, str(WORKER), str(pipeline), str(out), *extra], env=ENV, timeout=600, capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(processes)]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The tiny Wan run in one process, and split over 2 (Ulysses 2) without and with FSDP2."""
    from flowrl.models.testing.wan import tiny_wan_pipeline

    root = tmp_path_factory.mktemp("context-parallel")
    tiny_wan_pipeline().save_pretrained(root / "pipe")
    return {
        "one": launch(root / "pipe", root / "one", 1),
        "ulysses": launch(root / "pipe", root / "ulysses", 2, ULYSSES),
        "ulysses-fsdp": launch(root / "pipe", root / "ulysses-fsdp", 2, ULYSSES, "model.shard=fsdp"),
        "pipe": root / "pipe",
        "root": root,
    }


def close_records(a: list[dict], b: list[dict], rel: float = 1e-5) -> None:
    a, b = [without_wall_clock(r) for r in a], [without_wall_clock(r) for r in b]
    assert [sorted(r) for r in a] == [sorted(r) for r in b]
    for ra, rb in zip(a, b):
        for key, value in ra.items():
            if isinstance(value, float):
                assert rb[key] == pytest.approx(value, rel=rel, abs=1e-7), key
            else:
                assert rb[key] == value, key


@pytest.mark.slow
@pytest.mark.parametrize("variant", ["ulysses", "ulysses-fsdp"])
def test_a_split_run_gives_the_one_process_gradient_metrics_and_lora(runs, variant):
    one, ranks = runs["one"][0], runs[variant]
    assert [(r["processes"], r["replicas"]) for r in ranks] == [(2, 1), (2, 1)]
    g = one["gradient"]
    assert g.norm() > 0
    for r in ranks:
        assert r["samples"] == one["samples"]
        # measured: 5e-7 of the largest entry; a reducer dividing by the 2 processes instead of the 1 replica (each rank
        # holds the part of the gradient its half of the sequence gave) would be off by half
        assert (r["gradient"] - g).abs().max() <= 1e-5 * g.abs().max()
        close_records(one["records"], r["records"])
        assert max(float((r["lora"][k] - one["lora"][k]).abs().max()) for k in one["lora"]) <= 1e-5
    assert torch.equal(ranks[0]["gradient"], ranks[1]["gradient"])  # every rank of a group steps the same


@pytest.mark.slow
def test_kill_9_mid_run_then_resume_gives_the_uninterrupted_metrics(runs, tmp_path):
    steps = "train.max_steps=4"
    straight = tmp_path / "straight"
    launch(runs["pipe"], straight, 2, "--train-only", ULYSSES, steps)
    out = tmp_path / "killed"
    out.mkdir()
    cmd = [*LAUNCH, str(WORKER), str(runs["pipe"]), str(out), "--train-only", ULYSSES, steps]
    proc = subprocess.Popen(cmd, env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    first = out / "run" / "checkpoints" / "step-1"
    deadline = time.time() + 300
    while not first.is_dir() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.05)
    assert proc.poll() is None, "the run ended before it could be killed"
    os.killpg(proc.pid, signal.SIGKILL)  # both processes, mid-iteration 2
    proc.wait()
    assert not (out / "run" / "checkpoints" / "step-4").exists()
    launch(runs["pipe"], out, 2, "--train-only", ULYSSES, steps, "train.resume=latest")

    def metrics(folder: Path) -> list[dict]:
        lines = (folder / "run" / "metrics.jsonl").read_text().splitlines()
        return [without_wall_clock(r) for r in map(json.loads, lines)]

    assert [r["step"] for r in metrics(out)] == [1, 2, 3, 4]
    assert metrics(out) == metrics(straight)


# ---- the estimate ----------------------------------------------------------------------------------------------------
def test_the_estimate_splits_a_forwards_activations_and_flops_over_the_context_group():
    import flowrl.estimate as E
    from flowrl.models.testing.wan import tiny_wan_pipeline

    arch = E.arch_from_pipeline(tiny_wan_pipeline())
    base = [
        "model.family=wan",
        "model.height=32",
        "model.width=48",
        "model.kwargs={num_frames: 5}",
        "model.max_sequence_length=12",
        "prompts.per_step=4",
        "rollout.group_size=2",
        "rollout.steps=2",
        "rollout.max_batch=2",  # forwards of 2 rows in both: one replica's 2 prompts fill the same batches
    ]
    whole = E.estimate(TrainConfig.from_yaml(None, base), processes=4, arch=arch)
    split = E.estimate(TrainConfig.from_yaml(None, [*base, ULYSSES]), processes=4, arch=arch)
    assert (whole["context_parallel"], split["context_parallel"]) == (1, 2)
    assert (whole["counts"]["prompts_per_process"], split["counts"]["prompts_per_process"]) == (1, 2)  # 2 replicas
    # per GPU: twice the prompts, each forward's activations and FLOPs halved; the decode of every sample whole
    for phase in ("rollout", "update"):
        assert split["flops"][phase] == pytest.approx(whole["flops"][phase], rel=0.01)
    assert split["flops"]["decode"] == pytest.approx(2 * whole["flops"]["decode"], rel=0.01)
    rows = whole["shapes"]["update_rows"]
    assert split["shapes"]["update_rows"] == rows  # the same micro-batch, half of its sequence per GPU
    for phase in ("rollout", "update"):
        key = f"activations_{phase}"
        assert split["memory_gib"][key] == pytest.approx(whole["memory_gib"][key] / 2, rel=0.02), phase
    assert any("model.context_parallel" in a for a in split["assumptions"])
    with pytest.raises(ConfigError, match=r"context_parallel\.ulysses=4 must divide the attention heads"):
        E.estimate(TrainConfig.from_yaml(None, [*base, "model.context_parallel.ulysses=4"]), processes=4, arch=arch)
