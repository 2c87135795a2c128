"""Resume never erases and says what it does (issue 47, item 3): ``train.resume=latest`` after a ``kill -9`` that came
before the first checkpoint refuses (status 2, naming ``train.overwrite``) instead of starting at step 0 over the
logged records; every resume prints one line naming the checkpoint and the step, on the main process only (two
processes with FSDP included)."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from flowrl.commands.main import main
from tests.test_faults import tiny_args, tiny_folder  # noqa: F401 (tiny_folder: a fixture)

CLI = [sys.executable, "-m", "flowrl", "train"]


def _lines(path: Path) -> list[str]:
    return path.read_text().splitlines() if path.exists() else []


def test_resume_of_a_run_with_records_and_no_checkpoint_refuses_and_erases_nothing(tiny_folder, tmp_path, capsys):  # noqa: F811
    """The cheap twin of the slow test below: the folder a ``kill -9`` before the first checkpoint leaves (its config,
    lock file and logged records, no checkpoint), made by a finished run whose checkpoints are then removed."""
    import shutil

    run = tmp_path / "run"
    assert main(["train", *tiny_args(tiny_folder, tmp_path, "run", "train.max_steps=1", "prompts.eval=null")]) == 0
    shutil.rmtree(run / "checkpoints")
    (run / "checkpoints").mkdir()
    before = (run / "metrics.jsonl").read_bytes()
    capsys.readouterr()
    rc = main(["train", *tiny_args(tiny_folder, tmp_path, "run", "train.max_steps=2", "train.resume=latest")])
    err = capsys.readouterr().err
    assert rc == 2 and "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    assert "no checkpoint to continue from" in err and "train.overwrite=true" in err and str(run) in err
    assert (run / "metrics.jsonl").read_bytes() == before and not any((run / "checkpoints").iterdir())


@pytest.mark.slow  # 11–21 s: a `flowrl train` process killed at a random point; the twin above holds the refusal
def test_resume_after_kill_9_before_the_first_checkpoint_refuses_and_erases_nothing(tiny_folder, tmp_path, capsys):  # noqa: F811
    run = tmp_path / "run"
    metrics = run / "metrics.jsonl"
    rng = random.Random(47)
    args = tiny_args(tiny_folder, tmp_path, "run", "train.max_steps=1000", "train.checkpoint_every=0")
    proc = subprocess.Popen(CLI + args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        target = rng.randint(1, 3)  # the eval before training, then iterations: records logged, no checkpoint yet
        deadline = time.time() + 180
        while proc.poll() is None and time.time() < deadline and len(_lines(metrics)) < target:
            time.sleep(0.01)
        time.sleep(rng.uniform(0.0, 0.2))  # a random point of the iteration after it
        assert proc.poll() is None, proc.communicate()[1][-2000:]
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.wait(timeout=60)
    assert not list((run / "checkpoints").glob("step-*")) and _lines(metrics)
    before = metrics.read_bytes()

    capsys.readouterr()
    rc = main(["train", *tiny_args(tiny_folder, tmp_path, "run", "train.max_steps=2", "train.resume=latest")])
    err = capsys.readouterr().err
    assert rc == 2 and "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    assert "no checkpoint to continue from" in err and "train.overwrite=true" in err and str(run) in err
    assert metrics.read_bytes() == before  # the logged steps are kept
    assert not (run / "checkpoints").exists() or not any((run / "checkpoints").iterdir())
    assert all("step" in json.loads(line) for line in _lines(metrics)[:-1])  # whole records (the last may be torn)


def test_every_resume_says_the_checkpoint_and_step_it_continues_from(tiny_folder, tmp_path, capsys):  # noqa: F811
    common = ["prompts.eval=null"]
    capsys.readouterr()
    assert (
        main(["train", *tiny_args(tiny_folder, tmp_path, "run", "train.max_steps=1", "train.resume=latest", *common)])
        == 0
    )
    out = capsys.readouterr().out
    assert f"train.resume=latest: no checkpoint in {tmp_path / 'run' / 'checkpoints'}; starting at step 0" in out
    assert "resuming from" not in out
    assert (
        main(["train", *tiny_args(tiny_folder, tmp_path, "run", "train.max_steps=2", "train.resume=latest", *common)])
        == 0
    )  # unchanged settings: it used to print nothing
    said = [line for line in capsys.readouterr().out.splitlines() if line.startswith("resuming from")]
    assert said == [f"resuming from {tmp_path / 'run' / 'checkpoints' / 'step-1'} at step 1"]
    step_2 = tmp_path / "run" / "checkpoints" / "step-2"
    assert (
        main(
            ["train", *tiny_args(tiny_folder, tmp_path, "run", "train.max_steps=3", f"train.resume={step_2}", *common)]
        )
        == 0
    )
    said = [line for line in capsys.readouterr().out.splitlines() if line.startswith("resuming from")]
    assert said == [f"resuming from {step_2} at step 2"]


def test_a_comparison_starts_again_a_run_stopped_before_its_first_checkpoint(tmp_path, monkeypatch):
    """``flowrl compare`` resumes its runs with ``train.resume=latest``; one of its runs killed before its first
    checkpoint (which a resume refuses to erase) is started again with ``train.overwrite=true`` instead."""
    import flowrl.commands.compare as compare
    from flowrl.run.outputs import unfinished_start

    out = tmp_path / "cmp"
    runs = [
        compare.Run(
            "a",
            seed,
            [sys.executable, "-m", "flowrl", "train", "train.resume=latest", "train.num_threads=1"],
            out / "runs" / f"a-s{seed}",
        )
        for seed in (0, 1, 2)
    ]
    runs[0].folder.mkdir(parents=True)
    (runs[0].folder / "metrics.jsonl").write_text('{"step": 0, "eval/x_mean": 0.5}\n')  # killed before step-1
    (runs[1].folder / "checkpoints" / "step-1").mkdir(parents=True)  # has a checkpoint: resumed
    (runs[1].folder / "metrics.jsonl").write_text('{"step": 1, "reward_mean": 0.5}\n')
    assert [unfinished_start(r.folder) for r in runs] == [True, False, False]  # the third: nothing yet
    commands = []
    monkeypatch.setattr(compare.subprocess, "call", lambda command, **kw: commands.append(command) or 0)
    compare.run_all(runs, out)
    assert [("train.overwrite=true" in c, "train.resume=latest" in c) for c in commands] == [
        (True, False),
        (False, True),
        (False, True),
    ]


@pytest.mark.slow
def test_a_resume_under_two_processes_with_fsdp_prints_one_line(tmp_path):
    """tests/sharded_worker.py on 2 CPU processes (gloo), ``model.shard=fsdp``: only the main process says it."""
    worker = Path(__file__).with_name("sharded_worker.py")
    env = {**os.environ, "ACCELERATE_USE_CPU": "1", "OMP_NUM_THREADS": "1"}
    launch = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node",
        "2",
        str(worker),
        str(tmp_path),
        "fsdp",
        "lora",
    ]
    outputs = []
    for extra in (["train.max_steps=1"], ["train.max_steps=2", "train.resume=latest"]):
        proc = subprocess.run(launch + extra, env=env, capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        outputs.append(proc.stdout + proc.stderr)
    said = [line for line in outputs[1].splitlines() if "resuming from" in line]
    assert len(said) == 1 and said[0].endswith(
        f"resuming from {tmp_path / 'run' / 'checkpoints' / 'step-1'} at step 1"
    ), said
    assert sum("starting at step 0" in line for line in outputs[0].splitlines()) == 0  # no resume asked: nothing said
