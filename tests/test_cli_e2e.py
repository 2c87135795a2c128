"""The command line end to end on a tiny SD3 pipeline saved to a local folder (the hub-loading path)."""

from __future__ import annotations

import json

import pytest

from flowrl.commands.main import main


def test_train_sample_eval_from_a_local_pipeline_folder(tmp_path, capsys, monkeypatch):
    from flowrl.distributed.process_group import ProcessGroup
    from flowrl.models.testing import tiny_sd3_pipeline

    closed = []  # every command ends its process group (several processes: gloo's threads down before exit)
    real_close = ProcessGroup.close

    def counted_close(self):
        closed.append(1)
        real_close(self)

    monkeypatch.setattr(ProcessGroup, "close", counted_close)

    folder = tmp_path / "tiny-sd3"
    tiny_sd3_pipeline().save_pretrained(folder)
    common = [
        f"model.path={folder}",
        "model.family=sd3",
        "prompts.train=a red circle|a blue square",
        "prompts.eval=a red circle|a green cat",
        "prompts.per_step=2",
        "rollout.group_size=4",
        "rollout.steps=4",
        "rollout.window.mode=all",
        "rewards=[{name: brightness}]",
        "eval.rewards=null",
        "eval.steps=3",
        "model.lora.rank=4",
    ]
    assert (
        main(
            [
                "train",
                "configs/shapes/grpo.yaml",
                *common,
                "train.max_steps=2",
                f"train.output_dir={tmp_path}",
                "train.name=cli",
                "train.progress=false",
            ]
        )
        == 0
    )
    run = tmp_path / "cli"
    assert (run / "checkpoints" / "step-2" / "pytorch_lora_weights.safetensors").is_file()
    out = capsys.readouterr().out
    assert "eval/brightness_mean" in out and "run folder" in out
    assert len(closed) == 1

    assert (
        main(
            [
                "sample",
                "--checkpoint",
                str(run),
                "--prompt",
                "a red circle",
                "--prompt",
                "a blue square",
                "--num",
                "2",
                "--steps",
                "3",
                "--out",
                str(tmp_path / "png"),
            ]
        )
        == 0
    )
    pngs = sorted((tmp_path / "png").glob("0*.png"))
    assert len(pngs) == 4 and (tmp_path / "png" / "grid.png").is_file()

    capsys.readouterr()
    assert main(["eval", "--checkpoint", str(run), "--out", str(tmp_path / "ev")]) == 0
    metrics = json.loads((tmp_path / "ev" / "eval.json").read_text())
    assert metrics["num_prompts"] == 2 and 0 <= metrics["eval/brightness_mean"] <= 1
    # the run's final eval used the same prompts, seeds, steps and (EMA-free) weights
    final = [json.loads(l) for l in (run / "metrics.jsonl").read_text().splitlines()][-1]
    assert abs(final["eval/brightness_mean"] - metrics["eval/brightness_mean"]) < 1e-5


def test_missing_checkpoint_is_a_clear_error(tmp_path, capsys):
    assert main(["sample", "--checkpoint", str(tmp_path / "nope"), "--prompt", "x"]) == 2
    assert "no checkpoints/step-N/ folder" in capsys.readouterr().err


@pytest.mark.parametrize("signum", ["SIGINT", "SIGTERM"])
def test_a_signal_inside_a_run_saves_the_iteration_and_a_resume_continues(tmp_path, signum):
    """In process: a signal arriving during an iteration (sent by a callback at the end of step 1) lets the iteration
    finish, saves a checkpoint there and raises KeyboardInterrupt (`flowrl train` exits 130 on it); a resume
    continues from step 1. The two-process test below does the same to `flowrl train` itself."""
    import os
    import signal

    from flowrl.training.callbacks import Callback
    from flowrl.training.trainer import Trainer
    from tests.conftest import make_model
    from tests.test_trainer import tiny_config

    class SignalAtStepOne(Callback):
        def on_iteration(self, trainer, forest, record):
            if record["step"] == 1:
                os.kill(os.getpid(), getattr(signal, signum))
            return {}

    cfg = tiny_config(tmp_path, signum, "train.max_steps=5", "prompts.eval=null")
    with pytest.raises(KeyboardInterrupt):
        Trainer(cfg, model=make_model("sd3"), callbacks=[SignalAtStepOne()]).train()
    run = tmp_path / signum
    assert [p.name for p in (run / "checkpoints").iterdir()] == ["step-1"]
    cfg = tiny_config(tmp_path, signum, "train.max_steps=2", "prompts.eval=null", "train.resume=latest")
    Trainer(cfg, model=make_model("sd3")).train()
    assert [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()] == [1, 2]


# slow (29 s): two `flowrl train` processes; test_a_signal_inside_a_run_saves_the_iteration_and_a_resume_continues above
# holds the same stop, save and resume in process
@pytest.mark.slow
def test_ctrl_c_or_sigterm_saves_a_checkpoint_and_resume_continues(tmp_path):
    """SIGINT (Ctrl-C) to one run and SIGTERM to another, started together (one thread each, so the two
    cores run them side by side): each saves a checkpoint, exits with status 130, and a resume continues."""
    import signal
    import subprocess
    import sys
    import time

    from flowrl.models.testing import tiny_sd3_pipeline

    folder = tmp_path / "tiny-sd3"
    tiny_sd3_pipeline().save_pretrained(folder)

    def args(name: str) -> list[str]:
        return [
            "configs/shapes/grpo.yaml",
            f"model.path={folder}",
            "model.family=sd3",
            "prompts.train=a red circle|a blue square",
            "prompts.eval=null",
            "prompts.per_step=2",
            "rollout.group_size=4",
            "rollout.steps=4",
            "rollout.window.mode=all",
            "rewards=[{name: brightness}]",
            "eval.rewards=null",
            "model.lora.rank=4",
            f"train.output_dir={tmp_path}",
            f"train.name={name}",
            "train.progress=false",
            "train.num_threads=1",
        ]

    signums = ["SIGINT", "SIGTERM"]
    procs = {
        s: subprocess.Popen(
            [sys.executable, "-m", "flowrl", "train", *args(s), "train.max_steps=1000"],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for s in signums
    }
    steps, resumed = {}, {}
    try:
        for signum, proc in procs.items():
            metrics = tmp_path / signum / "metrics.jsonl"
            deadline = time.time() + 240
            while time.time() < deadline and not (metrics.exists() and '"reward_mean"' in metrics.read_text()):
                time.sleep(0.2)
            proc.send_signal(getattr(signal, signum))
        for signum, proc in procs.items():
            out, err = proc.communicate(timeout=240)
            assert proc.returncode == 130, (signum, err[-2000:])
            assert "saved a checkpoint" in out, signum
            steps[signum] = [
                json.loads(l)["step"] for l in (tmp_path / signum / "metrics.jsonl").read_text().splitlines()
            ]
            saved = sorted((tmp_path / signum / "checkpoints").iterdir())
            last = steps[signum][-1]
            assert [p.name for p in saved] == [f"step-{last}"] and 1 <= last < 1000, signum
            resumed[signum] = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "flowrl",
                    "train",
                    *args(signum),
                    f"train.max_steps={last + 1}",
                    "train.resume=latest",
                ],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE,
                text=True,
            )
        for signum, proc in resumed.items():
            _, err = proc.communicate(timeout=240)
            assert proc.returncode == 0, (signum, err[-2000:])
            after = [json.loads(l)["step"] for l in (tmp_path / signum / "metrics.jsonl").read_text().splitlines()]
            assert after == list(range(1, steps[signum][-1] + 2)), signum
    finally:  # a failure above leaves no run behind
        for proc in [*procs.values(), *resumed.values()]:
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def test_tensorboard_logging_writes_events(tmp_path):
    from flowrl.models.testing import tiny_sd3_pipeline

    folder = tmp_path / "tiny-sd3"
    tiny_sd3_pipeline().save_pretrained(folder)
    assert (
        main(
            [
                "train",
                f"model.path={folder}",
                "model.family=sd3",
                "prompts.train=a red circle|a blue square",
                "prompts.eval=null",
                "prompts.per_step=2",
                "rollout.group_size=2",
                "rollout.steps=3",
                "rewards=[{name: brightness}]",
                "eval.rewards=null",
                "model.lora.rank=2",
                "train.max_steps=1",
                f"train.output_dir={tmp_path}",
                "train.name=tb",
                "train.log_with=tensorboard",
                "train.progress=false",
            ]
        )
        == 0
    )
    events = list((tmp_path / "tb").rglob("events.out.tfevents.*"))
    assert events and events[0].stat().st_size > 0


def test_eval_summary_shows_changes_and_counts_once():
    from flowrl.commands.summary import eval_summary

    first = {"step": 0, "eval/shapes/accuracy": 0.5, "eval/shapes/n": 240.0, "eval/shapes/n/single": 48.0}
    last = {"step": 150, "eval/shapes/accuracy": 0.625, "eval/shapes/n": 240.0, "eval/shapes/n/single": 48.0}
    lines = eval_summary(first, last)
    assert lines[0] == "eval before → after (240 held-out images):"
    assert lines[1:] == ["  eval/shapes/accuracy: 0.5000 → 0.6250  (+0.1250)"]


def test_eval_summary_sets_a_cfg_free_policy_against_the_guided_base():
    from flowrl.commands.summary import eval_summary

    first = {
        "step": 0,
        "eval/shapes_mean": 0.385,
        "eval/guidance": 1.0,
        "eval_default/shapes_mean": 0.569,
        "eval_default/guidance": 3.0,
    }
    last = {
        "step": 150,
        "eval/shapes_mean": 0.6,
        "eval/guidance": 1.0,
        "eval_default/shapes_mean": 0.55,
        "eval_default/guidance": 3.0,
    }
    assert eval_summary(first, last)[-1] == (
        "the aligned model at guidance 1 (one forward per step): shapes_mean 0.6000; "
        "the base model at guidance 3: 0.5690  (+0.0310)"
    )
    same = {**last, "eval/guidance": 3.0}
    assert not any("aligned model" in line for line in eval_summary({**first, "eval/guidance": 3.0}, same))
