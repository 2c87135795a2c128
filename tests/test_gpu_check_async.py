"""scripts/gpu_check.py's ``async`` part (docs/gpu.md, "The async part"): SD3.5-Medium NFT with ``train.pipeline=sync``
against ``async`` (``train.max_staleness=1``) from a saved random-weight folder. The ``--tiny`` rehearsal on the CPU
(both runs measured after a warm-up, the async one at staleness 1, the ratio from their images/s, both processes'
memory, the files as documented); the GPU runs' settings; the summary, the verdicts and a run out of memory reported
as the answer (the card does not hold both), not as a crash; the memory sampler over a process tree. The command-line
run with ``flowrl train`` processes is in the slow set."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from tests.test_gpu_check import ROOT, SCRIPT, documented_json, load_script

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")
VERDICTS = ("meets the 1.25× goal", "faster, short of the 1.25× goal", "no gain", "slower")


def script_args(tmp_path: Path, *extra: str):
    args = load_script().parse_args(["--out", str(tmp_path / "out"), "--work", str(tmp_path / "work"), *extra])
    args.work.mkdir(parents=True, exist_ok=True)
    return args


def run_part(args) -> dict:
    """The async part of ``args`` with a fresh report and a 600-s budget: its entry, JSON and Markdown."""
    s = load_script()
    report = s.Report(args.out, s.environment(args), args.parts)
    budget = s.Budget(600.0, s.budget_weights(args.parts))
    s.run_async(report, budget, args)
    report.close_part("async", budget.elapsed(), 600.0)
    return {
        "entry": report.data["parts"]["async"],
        "rows": {r["name"]: r for r in report.rows("async")},
        "json": json.loads((Path(args.out) / "gpu_check.json").read_text()),
        "md": (Path(args.out) / "gpu_check.md").read_text(),
    }


# ---- the --tiny rehearsal (inline: a Trainer in this process, the async one with its spawned rollout process) ------
@pytest.fixture(scope="module")
def tiny_async(tmp_path_factory):
    """``--tiny --parts async`` in this process (≈ 20 s on 2 busy cores: the rollout process's start is most of it)."""
    tmp = tmp_path_factory.mktemp("async")
    args = script_args(tmp, "--tiny", "--parts", "async", "--commit", "test")
    t0 = time.monotonic()
    out = run_part(args)
    return {**out, "args": args, "seconds": time.monotonic() - t0}


def test_tiny_async_rows_have_both_runs_and_the_ratio(tiny_async):
    rows = tiny_async["rows"]
    assert list(rows) == ["sync", "async"] and tiny_async["entry"]["status"] == "ok"
    for name, r in rows.items():
        assert r["status"] == "ok" and r["error"] is None and r["pipeline"] == name and r["launch"] == "inline"
        assert (r["iterations"], r["timed"], r["warmup"]) == (3, 2, 1)  # one warm-up, two timed iterations
        assert r["batch"] == "1 × 2" and r["settings"]["dtype"] == "bfloat16" and r["settings"]["compile"] == "off"
        assert r["settings"]["lora_rank"] == 32 and r["settings"]["full_finetune"] is False  # as the preset says
        assert r["seconds_per_iteration"] > 0 and r["rollout_seconds"] > 0 and r["update_seconds"] > 0
        assert r["images_per_iteration"] == 2
        assert r["images_per_second"] == pytest.approx(2 / r["seconds_per_iteration"])
        assert min(r["seconds_range"]) <= r["seconds_per_iteration"] <= max(r["seconds_range"])
        assert r["held"] is True and r["peak_memory_gib"] > 0 and r["memory_samples"] > 0
        assert r["model_folder"]["model"] == "SD3.5-Medium (tiny)" and r["model_folder"]["gib"] > 0
    sync, run = rows["sync"], rows["async"]
    assert sync["staleness"] is None and sync["update_wait"] is None and sync["max_staleness"] is None
    assert run["staleness"] == 1.0 and run["versions"] == [0, 0, 1] and run["max_staleness"] == 1
    assert run["update_wait"] >= 0 and run["rollout_wait"] >= 0
    assert run["warmup_seconds"] > run["seconds_per_iteration"]  # its first iteration waited for the rollout's start
    assert (sync["processes"], run["processes"]) == (1, 2)  # the trainer (here: this process) and its rollout process
    assert run["run_memory_gib"] > 0  # the rollout process's copy, over what this process held before
    assert run["ratio"] == pytest.approx(run["images_per_second"] / sync["images_per_second"])
    assert run["verdict"].startswith(VERDICTS) and "on one GPU" not in run["verdict"]  # the CPU goal applies
    assert not (tiny_async["args"].work / "async_model").exists()  # the folder is removed with the part


def test_tiny_async_files_are_what_the_docs_describe(tiny_async):
    documented = documented_json()["parts"]["async"]
    assert set(documented) == {"status", "seconds", "allotted_seconds", "rows"}
    (example,) = documented["rows"]
    only_async = {"ratio", "overlap_bound", "verdict"}
    none_in_sync = {"max_staleness", "update_wait", "rollout_wait", "staleness", "versions"}
    for row in tiny_async["json"]["parts"]["async"]["rows"]:
        for key, value in example.items():
            if row["name"] == "sync" and key in only_async:
                assert key not in row
                continue
            assert key in row, f"{row['name']}.{key} missing"
            got = row[key]
            if value is None or (row["name"] == "sync" and key in none_in_sync):
                continue
            if isinstance(value, bool):
                assert isinstance(got, bool), (key, got)
            elif isinstance(value, (int, float)):
                assert isinstance(got, (int, float)) and math.isfinite(got), (key, got)
            else:
                assert isinstance(got, type(value)), (key, got)
    md = tiny_async["md"]
    assert "## train.pipeline: async against sync on one device" in md
    assert "| run | pipeline | staleness | prompts × images |" in md
    line = next(x for x in md.splitlines() if x.startswith("| async | async | 1 |"))
    assert line.endswith("| ok |") and tiny_async["rows"]["async"]["verdict"] in line
    assert "**async against sync**:" in md and "The model folder (`model.path` of both runs)" in md
    docs = (ROOT / "docs" / "gpu.md").read_text()
    assert "*planned*" not in docs and "### The async part" in docs


# ---- the GPU runs' settings -----------------------------------------------------------------------------------------
def test_gpu_runs_are_the_nft_preset_from_a_saved_folder(tmp_path):
    """Both runs as the GPU check starts them (configs loaded, nothing built): the SD3.5-M NFT preset at the presets'
    2 × 8, 512 px, 10 steps, LoRA r32 in bf16, from the folder, no evals, one warm-up and three timed iterations;
    only the pipeline keys differ."""
    from flowrl.config.schema import TrainConfig

    s = load_script()
    args = script_args(tmp_path, "--parts", "async")
    assert (args.async_launch, args.async_iterations, args.async_warmup, args.async_compile) == (
        "process",
        3,
        1,
        "off",
    )
    folder = tmp_path / "model"
    cfgs = {}
    for name, extra in s.ASYNC_RUNS:
        cfgs[name] = TrainConfig.from_yaml(
            s.preset_path(s.ASYNC_PRESET.config), s.async_overrides(args, name, folder, extra)
        )
    for cfg in cfgs.values():
        m = cfg.model
        assert (m.path, m.family, m.device, m.dtype) == (str(folder), "sd3", "cuda", "bfloat16")
        assert (m.lora.rank, m.full_finetune, m.compile, m.height, cfg.rollout.steps) == (32, False, "off", 512, 10)
        assert (cfg.prompts.per_step, cfg.rollout.group_size, cfg.loss.objective) == (2, 8, "nft")
        assert cfg.prompts.eval is None and cfg.eval.every == 0 and cfg.eval.at_start is False
        assert cfg.train.max_steps == 4 and cfg.train.num_threads is None  # the machine's threads
        assert [r.name for r in cfg.rewards] == ["jpeg_compressibility"]
    assert (cfgs["sync"].train.pipeline, cfgs["async"].train.pipeline) == ("sync", "async")
    assert cfgs["async"].train.max_staleness == 1
    assert "async" in s.PARTS and "async" not in s.DEFAULT_PARTS
    assert s.budget_weights(["async"]) == {"async": s.PART_WEIGHTS["async"]}
    assert script_args(tmp_path, "--parts", "async", "--async-compile", "regional").async_compile == "regional"


# ---- the summary and the verdicts -----------------------------------------------------------------------------------
def record(step: int, seconds: float, **extra) -> dict:
    return {"step": step, "reward_mean": 0.0, "leaves": 16.0, "time/iteration": seconds, "time/rollout": 2.0,
            "time/reward": 0.1, "time/update": 1.5, **extra}  # fmt: skip


def test_summary_leaves_out_the_warmup():
    s = load_script()
    pipe = {"pipeline/update_wait": 0.5, "pipeline/rollout_wait": 0.2, "pipeline/staleness": 1.0}
    records = [record(1, 40.0, **{**pipe, "pipeline/staleness": 0.0, "pipeline/version": 0})]
    records += [record(k, t, **pipe, **{"pipeline/version": k - 2}) for k, t in ((2, 3.0), (3, 5.0))]
    out = s.async_summary(records + [{"step": 3, "eval/x": 1.0}], warmup=1)
    assert (out["iterations"], out["timed"], out["warmup_seconds"]) == (3, 2, 40.0)
    assert out["seconds_per_iteration"] == 4.0 and out["images_per_second"] == 4.0 and out["seconds_range"] == [3, 5]
    assert (out["staleness"], out["update_wait"], out["versions"]) == (1.0, 0.5, [0, 0, 1])
    sync = s.async_summary([record(1, 9.0), record(2, 4.0)], warmup=1)
    assert sync["staleness"] is None and sync["update_wait"] is None and sync["versions"] is None
    empty = s.async_summary([record(1, 9.0)], warmup=1)  # stopped in its warm-up: nothing timed
    assert empty["timed"] == 0 and math.isnan(empty["images_per_second"])


@pytest.mark.parametrize(
    "async_ips, verdict",
    [(5.2, "meets the 1.25× goal: async ×1.3"), (4.6, "faster, short of the 1.25× goal"), (4.1, "no gain"),
     (3.0, "slower: async ×0.75")],
)  # fmt: skip
def test_verdicts_against_the_goal(async_ips, verdict):
    s = load_script()
    sync = {"images_per_second": 4.0, "seconds_per_iteration": 4.0, "rollout_seconds": 2.4, "reward_seconds": 0.1,
            "update_seconds": 1.5}  # fmt: skip
    cpu = s.async_verdict(sync, {"images_per_second": async_ips}, cuda=False)
    assert cpu["verdict"].startswith(verdict) and cpu["ratio"] == pytest.approx(async_ips / 4.0)
    assert cpu["overlap_bound"] == pytest.approx(4.0 / 2.5)  # sync's s/iteration over its longer side
    gpu = s.async_verdict(sync, {"images_per_second": async_ips}, cuda=True)
    assert gpu["verdict"].startswith(verdict) and "on one GPU both processes share its compute" in gpu["verdict"]
    assert "up to ×1.6" in gpu["verdict"]
    assert (
        s.async_verdict(None, {"images_per_second": 5.0}, cuda=True)["verdict"] == "not measured: sync without images/s"
    )
    stopped = s.async_verdict({**sync, "images_per_second": float("nan")}, {"images_per_second": 5.0}, cuda=True)
    assert stopped["verdict"] == "not measured: sync without images/s" and stopped["ratio"] is None
    oom = s.async_verdict(sync, {"oom": "torch.OutOfMemoryError: CUDA out of memory", "peak_memory_gib": 79.1}, True)
    assert oom["ratio"] is None and oom["verdict"].startswith("the card does not hold both processes: torch.OutOf")
    assert "79.1 GiB in use at the peak" in oom["verdict"]


STUB = """#!{python}
# a stand-in for `python -m flowrl train`: the sync run writes 3 iterations to its metrics.jsonl, the async run dies
# as a card that cannot hold both processes makes it die
import json, pathlib, sys
args = dict(a.split("=", 1) for a in sys.argv[1:] if "=" in a)
if args.get("train.pipeline") == "async":
    print("Traceback (most recent call last):", flush=True)
    print("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity "
          "of 79.19 GiB of which 1.06 GiB is free.")
    sys.exit(1)
run = pathlib.Path(args["train.output_dir"]) / args["train.name"]
run.mkdir(parents=True, exist_ok=True)
rows = [{{"step": k, "reward_mean": 0.0, "leaves": 16.0, "time/iteration": t, "time/rollout": 2.5,
         "time/reward": 0.1, "time/update": 1.5}} for k, t in ((1, 30.0), (2, 4.0), (3, 4.0))]
run.joinpath("metrics.jsonl").write_text("".join(json.dumps(r) + "\\n" for r in rows))
"""


def test_a_run_out_of_memory_is_the_answer_not_a_crash(tmp_path, monkeypatch):
    """Through ``flowrl train`` processes (``--async-launch process``; a stand-in interpreter here): the sync row
    measured, the async row's verdict that the card does not hold both, the part ``ok``."""
    s = load_script()
    stub = tmp_path / "python"
    stub.write_text(STUB.format(python=sys.executable))
    stub.chmod(0o755)
    args = script_args(tmp_path, "--tiny", "--parts", "async", "--async-launch", "process", "--commit", "test")
    monkeypatch.setattr(s.sys, "executable", str(stub))
    out = run_part(args)
    sync, run = out["rows"]["sync"], out["rows"]["async"]
    assert (sync["status"], sync["timed"], sync["images_per_second"]) == ("ok", 2, 4.0)
    assert run["status"] == "ok" and run["held"] is False and run["error"] is None and run["timed"] == 0
    assert run["oom"].startswith("torch.OutOfMemoryError: CUDA out of memory") and run["ratio"] is None
    assert run["verdict"].startswith("the card does not hold both processes: torch.OutOfMemoryError")
    assert out["entry"]["status"] == "ok" and "the card held both: no" in out["md"]
    assert (args.work / "async_async.log").is_file() and not (args.work / "async_model").exists()


def test_a_run_that_fails_otherwise_is_failed(tmp_path, monkeypatch):
    s = load_script()
    stub = tmp_path / "python"
    stub.write_text("#!/bin/sh\necho 'ValueError: model.path does not exist'\nexit 2\n")
    stub.chmod(0o755)
    args = script_args(tmp_path, "--tiny", "--parts", "async", "--async-launch", "process", "--commit", "test")
    monkeypatch.setattr(s.sys, "executable", str(stub))
    out = run_part(args)
    for r in out["rows"].values():
        assert r["status"] == "failed" and r["error"] == "flowrl train exited 2: ValueError: model.path does not exist"
        assert r["held"] is True and "oom" not in r
    assert out["rows"]["async"]["verdict"] == "not measured: sync and async without images/s"
    assert out["entry"]["status"] == "partial"


def test_an_inline_run_out_of_memory_is_the_answer_too(tmp_path, monkeypatch):
    """``--async-launch inline``: the error raised in this process says it ran out of memory."""
    import torch

    s = load_script()

    def stand_in(cfg, sampler):
        sampler.watch(os.getpid())
        if cfg.train.pipeline == "async":
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 MiB")
        run = Path(cfg.train.output_dir) / cfg.train.name
        run.mkdir(parents=True, exist_ok=True)
        rows = [record(k, t) for k, t in ((1, 9.0), (2, 4.0), (3, 4.0))]
        (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))

    monkeypatch.setattr(s, "async_row_inline", stand_in)
    out = run_part(script_args(tmp_path, "--tiny", "--parts", "async", "--commit", "test"))
    sync, run = out["rows"]["sync"], out["rows"]["async"]
    assert sync["status"] == "ok" and sync["images_per_second"] == 4.0 and sync["held"] is True
    assert run["status"] == "ok" and run["held"] is False and run["oom"].startswith("OutOfMemoryError: CUDA out of")
    assert run["verdict"].startswith("the card does not hold both processes: OutOfMemoryError")


def test_memory_sampler_on_a_gpu_counts_the_device_and_the_new_processes(monkeypatch):
    """On a GPU: the device's memory in use (every process), each process nvidia-smi lists that was not there before
    the run (this check's own context left out, whatever pid it is listed under)."""
    import torch

    s = load_script()
    used = iter([1, 30, 50, 40] + [40] * 1000)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda: (100 * 2**30 - next(used) * 2**30, 100 * 2**30))
    listed = iter([{777: 2**29}] + [{777: 2**29, 11: 20 * 2**30, 12: 29 * 2**30}] * 1000)
    monkeypatch.setattr(s, "gpu_processes", lambda: next(listed))
    sampler = s.MemorySampler(cuda=True, interval=0.01).watch(12345)
    time.sleep(0.3)
    out = sampler.stop()
    assert (out["baseline_memory_gib"], out["peak_memory_gib"], out["run_memory_gib"]) == (1, 50, 49)
    assert out["processes"] == 2 and out["per_process_gib"] == {"11": 20, "12": 29}
    assert out["memory_source"].startswith("torch.cuda.mem_get_info")


def test_memory_sampler_sums_a_process_tree(tmp_path):
    """On a CPU: the resident memory of a process and its child together, and how many they were."""
    s = load_script()
    code = textwrap.dedent(
        """
        import subprocess, sys, time
        block = b"x" * (200 * 2**20)
        child = subprocess.Popen([sys.executable, "-c", "import time; b = b'y' * (100 * 2**20); time.sleep(2)"])
        time.sleep(2)
        child.wait()
        """
    )
    sampler = s.MemorySampler(cuda=False, interval=0.05)
    proc = subprocess.Popen([sys.executable, "-c", code])
    sampler.watch(proc.pid)
    proc.wait(30)
    out = sampler.stop()
    assert out["processes"] == 2 and out["baseline_memory_gib"] == 0
    assert out["peak_memory_gib"] * 1024 > 300 and len(out["per_process_gib"]) == 2
    assert out["run_memory_gib"] == out["peak_memory_gib"]


# ---- through the command line (slow) --------------------------------------------------------------------------------
@pytest.mark.slow
def test_tiny_async_from_the_command_line_with_processes(tmp_path):
    """``--tiny --parts async --async-launch process`` as a user starts it: both runs as ``flowrl train`` processes
    (≈ 50 s on 2 busy cores), the async one with its rollout process beside it, their logs kept."""
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--tiny", "--parts", "async", "--async-launch", "process"]
        + ["--out", str(tmp_path / "out"), "--work", str(tmp_path / "work"), "--commit", "test"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    data = json.loads((tmp_path / "out" / "gpu_check.json").read_text())
    assert data["meta"]["parts"] == ["async"] and data["parts"]["async"]["status"] == "ok"
    sync, run = data["parts"]["async"]["rows"]
    assert (sync["name"], run["name"], run["launch"], run["staleness"]) == ("sync", "async", "process", 1.0)
    assert (sync["processes"], run["processes"], sync["timed"], run["timed"]) == (1, 2, 2, 2)
    assert run["baseline_memory_gib"] == 0 and run["peak_memory_gib"] > sync["peak_memory_gib"]  # two processes
    assert run["ratio"] == pytest.approx(run["images_per_second"] / sync["images_per_second"])
    for r in (sync, run):
        assert (tmp_path / "work" / r["log"]).is_file()
    assert "**async against sync**" in proc.stdout
