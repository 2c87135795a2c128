"""Issue 54, round four, the run-side cases (docs/reliability.md, "Round four"): no command writes inside a run
folder (a later ``train.overwrite`` would delete it), ``train.overwrite`` lists what is not the run's and refuses,
a rollout store records its model's identity and refuses another model, and SIGTERM while a reward call blocks
stops within seconds with the last finished iteration's checkpoint."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from flowrl.commands.main import main
from flowrl.errors import ConfigError
from flowrl.run.outputs import check_output
from tests.test_faults import tiny_args, tiny_folder  # noqa: F401 (tiny_folder: a fixture)


def _tree(root: Path) -> dict[str, bytes | None]:
    """Every path under ``root`` (folders too) with the bytes of the files."""
    return {str(p.relative_to(root)): (p.read_bytes() if p.is_file() else None) for p in sorted(root.rglob("*"))}


def _a_run(folder: Path) -> Path:
    """A folder a run wrote: config.yaml, metrics.jsonl and a checkpoint."""
    (folder / "checkpoints" / "step-1").mkdir(parents=True)
    (folder / "config.yaml").write_text("train: {name: r}\n")
    (folder / "metrics.jsonl").write_text('{"step": 1, "reward_mean": 0.5}\n')
    (folder / "checkpoints" / "step-1" / "trainer_state.pt").write_bytes(b"state")
    return folder


# ---- 1. every path inside a run is the run's -----------------------------------------------------------
WRITERS = [
    ("flowrl eval", "own"),
    ("flowrl eval --benchmark", "new"),
    ("flowrl rollouts", "new"),
    ("flowrl sample", "adds"),
    ("flowrl compare", "own"),
    ("flowrl data fetch", "own"),
    ("flowrl export", "own"),
]


@pytest.mark.parametrize("command,mode", WRITERS)
def test_no_command_writes_anywhere_inside_a_run_folder(tmp_path, command, mode):
    """A new folder beside a run's own entries (``bench/``), deeper (``a/b/store``) or inside an existing foreign
    folder of the run is refused for every command, naming the path and the run; outside the run it is accepted."""
    run = _a_run(tmp_path / "runs" / "r")
    (run / "mine").mkdir()
    before = _tree(tmp_path)
    for inside in (run / "bench", run / "a" / "b" / "store", run / "mine"):
        with pytest.raises(ConfigError) as refused:
            check_output(inside, command, mode=mode)
        message = str(refused.value)
        assert str(inside) in message and f"inside the run folder {run}" in message, message
        assert "train.overwrite" in message and "nothing was changed" in message, message
    assert _tree(tmp_path) == before
    assert check_output(tmp_path / "runs" / "bench", command, mode=mode).state == "new"  # beside the run: fine


def test_export_still_writes_its_runs_own_export_folder_and_nothing_else_inside(tmp_path):
    from flowrl.run.checkpoint import check_export_target

    run = _a_run(tmp_path / "r")
    assert check_export_target(run / "export").state == "new"
    with pytest.raises(ConfigError, match="inside the run folder"):
        check_export_target(run / "exports")


def test_eval_benchmark_and_rollouts_refuse_an_out_inside_a_run_before_any_model_time(tmp_path, capsys):
    """The two commands of the issue, through ``flowrl``: status 2, one line naming the path and the run."""
    run = _a_run(tmp_path / "runs" / "r")
    before = _tree(tmp_path)
    for argv in (
        ["eval", "--benchmark", "geneval", "--out", str(run / "bench")],
        ["rollouts", "configs/shapes/gdro.yaml", "--out", str(run / "store")],
    ):
        capsys.readouterr()
        assert main(argv) == 2, argv
        err = capsys.readouterr().err
        assert f"inside the run folder {run}" in err and argv[-1] in err and "Traceback" not in err, err
    assert _tree(tmp_path) == before


def test_a_run_inside_another_run_is_refused(tiny_folder, tmp_path, capsys):  # noqa: F811
    outer = _a_run(tmp_path / "outer")
    before = _tree(tmp_path)
    assert main(["train", *tiny_args(tiny_folder, outer / "nested", "run", "train.max_steps=1")]) == 2
    err = capsys.readouterr().err
    assert f"inside the run folder {outer}" in err, err
    assert _tree(tmp_path) == before


# ---- 2. train.overwrite says what else would go ---------------------------------------------------------
def test_overwrite_lists_what_is_not_the_runs_and_deletes_nothing(tiny_folder, tmp_path, capsys):  # noqa: F811
    """A run folder holding a benchmark's output, a rollout store and a note beside the run's own files: the
    overwrite is refused, naming each of them, and the folder is left as it was (before: all of it was removed)."""
    run = _a_run(tmp_path / "r")
    (run / "bench").mkdir()
    (run / "bench" / "results.jsonl").write_text("{}\n")
    (run / "store").mkdir()
    (run / "store" / "rollouts.json").write_text("{}")
    (run / "notes.txt").write_text("keep me")
    before = _tree(tmp_path)
    assert main(["train", *tiny_args(tiny_folder, tmp_path, "r", "train.overwrite=true", "train.max_steps=1")]) == 2
    err = capsys.readouterr().err
    assert "train.overwrite=true" in err and str(run) in err and "nothing was deleted" in err, err
    assert err.split("that a run does not write: ")[1].split(";")[0] == "bench/, notes.txt, store/", err
    assert _tree(tmp_path) == before


def test_overwrite_still_replaces_a_run_with_its_tensorboard_folder(tmp_path):
    """What a run writes itself (its entries, and the tensorboard tracker's folder named after the run) is replaced."""
    from flowrl.config.schema import TrainConfig
    from flowrl.run.folder import RunFolder

    run = _a_run(tmp_path / "r")
    (run / "r" / "1700000000.0").mkdir(parents=True)
    (run / "r" / "events.out.tfevents.1.host").write_bytes(b"e")
    (run / "r" / "1700000000.0" / "events.out.tfevents.2.host").write_bytes(b"e")
    cfg = TrainConfig.from_yaml(
        "configs/shapes/grpo.yaml", [f"train.output_dir={tmp_path}", "train.name=r", "train.overwrite=true"]
    )
    RunFolder(cfg, None).replace()
    assert sorted(p.name for p in run.iterdir()) == []
    (run / "r").mkdir()
    (run / "r" / "results.txt").write_text("not a tracker's")
    (run / "config.yaml").write_text("a: 1\n")
    (run / "metrics.jsonl").write_text("{}\n")
    with pytest.raises(ConfigError, match=r"does not write: r/;.*nothing was deleted"):
        RunFolder(cfg, None).replace()


# ---- 3. a rollout store records its model's identity ----------------------------------------------------
PROMPTS = ["a red circle", "two blue squares"]


def _store(out: Path, model) -> Path:
    from flowrl.run.rollout_store import write_store

    return write_store(
        out,
        model,
        PROMPTS,
        None,
        images_per_prompt=2,
        steps=2,
        guidance=1.0,
        seed=0,
        max_batch=8,
        model_info={"family": "sd3"},
    )


def test_a_store_of_another_model_with_the_same_adapter_and_latents_is_refused(tmp_path):
    """Same adapter (sd3), same latents [4, 8, 8], one more transformer layer: refused at setup, naming both
    identities and the store; the same model is accepted."""
    from flowrl.models import wrap
    from flowrl.models.testing import tiny_sd3_pipeline
    from flowrl.rollout.offline import Offline

    store = _store(tmp_path / "store", wrap(tiny_sd3_pipeline()))
    identity = json.loads((store / "rollouts.json").read_text())["model"]["identity"]
    assert identity["family"] == "sd3" and identity["path"] is None
    assert len(identity["config_sha256"]) == 64 and identity["weights"]["kind"] == "parameter shapes"
    Offline(source=str(store), group_size=2).setup(wrap(tiny_sd3_pipeline(seed=1)))  # other weights, same model
    other = wrap(tiny_sd3_pipeline(num_layers=3))
    with pytest.raises(ConfigError) as refused:
        Offline(source=str(store), group_size=2).setup(other)
    message = str(refused.value)
    assert f"rollout.source={str(store)!r}" in message and "another model" in message, message
    assert identity["config_sha256"][:12] in message and "config_sha256" in message, message


def test_a_store_of_another_models_folder_with_the_same_files_is_refused_naming_both_paths(tmp_path):
    """A local model folder: the store records its path and the transformer's weight files (names, sizes, samples of
    their bytes). Another model saved in the same layout (same config, same file names and sizes, other weights) is
    refused naming both folders; a copy of the store's own model in another folder holds the same weights: accepted."""
    from flowrl import models
    from flowrl.models.testing import tiny_sd3_pipeline
    from flowrl.rollout.offline import Offline

    a, copy, other = tmp_path / "model-a", tmp_path / "copy-of-a", tmp_path / "model-b"
    tiny_sd3_pipeline().save_pretrained(a)
    shutil.copytree(a, copy)
    tiny_sd3_pipeline(seed=1).save_pretrained(other)
    sizes = lambda m: sorted((p.name, p.stat().st_size) for p in (m / "transformer").iterdir())  # noqa: E731
    assert sizes(a) == sizes(other)  # the same names and sizes: only the bytes tell them apart
    store = _store(tmp_path / "store", models.load_model("sd3", str(a)))
    identity = json.loads((store / "rollouts.json").read_text())["model"]["identity"]
    assert identity["path"] == str(a.resolve()) and identity["weights"]["kind"] == "files"
    Offline(source=str(store), group_size=2).setup(models.load_model("sd3", str(a)))
    Offline(source=str(store), group_size=2).setup(models.load_model("sd3", str(copy)))
    with pytest.raises(ConfigError) as refused:
        Offline(source=str(store), group_size=2).setup(models.load_model("sd3", str(other)))
    message = str(refused.value)
    assert str(a.resolve()) in message and str(other.resolve()) in message and "(weights differ)" in message, message


def test_an_old_store_without_the_models_identity_warns_once_and_trains(tmp_path):
    from flowrl.models import wrap
    from flowrl.models.testing import tiny_sd3_pipeline
    from flowrl.rollout.offline import Offline

    store = _store(tmp_path / "store", wrap(tiny_sd3_pipeline()))
    meta = json.loads((store / "rollouts.json").read_text())
    del meta["model"]["identity"]
    (store / "rollouts.json").write_text(json.dumps(meta))
    plan = Offline(source=str(store), group_size=2)
    with pytest.warns(RuntimeWarning, match="records no model identity") as caught:
        plan.setup(wrap(tiny_sd3_pipeline(num_layers=3)))
        plan.setup(wrap(tiny_sd3_pipeline(num_layers=3)))
    assert len([w for w in caught if "model identity" in str(w.message)]) == 1


# ---- 4. SIGTERM during a reward call stops within seconds -----------------------------------------------
class Blocking:
    """A reward whose call blocks until released (or ``seconds``): a slow served judge."""

    def __init__(self, seconds: float = 60.0):
        self.release, self.seconds, self.calls = threading.Event(), seconds, 0

    def reward(self):
        from flowrl_rewards import Reward

        outer = self

        class Slow(Reward):
            name = "slow"

            def score(self, images, prompts, meta):
                outer.calls += 1
                outer.release.wait(outer.seconds)
                return torch.zeros(len(prompts))

        return Slow()


def _signal_after(seconds: float, *signums: int, gap: float = 0.3) -> threading.Thread:
    def send():
        time.sleep(seconds)
        for s in signums:
            os.kill(os.getpid(), s)
            time.sleep(gap)

    thread = threading.Thread(target=send, daemon=True)
    thread.start()
    return thread


@pytest.mark.parametrize("threaded", [False, True], ids=["sync", "background"])
def test_the_first_sigterm_cuts_a_blocking_reward_wait_after_the_grace_period(threaded, monkeypatch):
    from flowrl.run.signals import stop_on_first_interrupt
    from flowrl_rewards.background import BackgroundScorer, reward_waits

    monkeypatch.setattr(reward_waits, "grace", 1.0)  # the mechanism at a shorter grace than the default 5 s
    GRACE_SECONDS = reward_waits.grace

    slow = Blocking(60.0)
    scorer = BackgroundScorer(slow.reward(), enabled=threaded)
    try:
        with stop_on_first_interrupt() as stop:
            _signal_after(0.5, signal.SIGTERM)
            t0 = time.monotonic()
            with pytest.raises(KeyboardInterrupt):
                scorer.submit(torch.rand(2, 3, 8, 8), ["a", "b"]).result()
            waited = time.monotonic() - t0
        assert stop.requested and GRACE_SECONDS - 0.5 <= waited < GRACE_SECONDS + 4, waited
        t1 = time.monotonic()
        scorer.close()  # the abandoned call is not waited for (the runner closes its scorer as the run ends)
        assert time.monotonic() - t1 < 1.0
    finally:
        slow.release.set()
        scorer.close()


@pytest.mark.parametrize("threaded", [False, True], ids=["sync", "background"])
def test_a_reward_that_answers_within_the_grace_period_finishes_the_iteration(threaded):
    from flowrl.run.signals import stop_on_first_interrupt
    from flowrl_rewards.background import BackgroundScorer

    slow = Blocking(0.8)  # answers 0.5 s after the stop, within the 5 s grace period
    scorer = BackgroundScorer(slow.reward(), enabled=threaded)
    try:
        with stop_on_first_interrupt() as stop:
            _signal_after(0.3, signal.SIGTERM)
            scores = scorer.submit(torch.rand(2, 3, 8, 8), ["a", "b"]).result()
            time.sleep(0.3)  # nothing else interrupts the loop afterwards
            assert stop.requested and scores["slow"].tolist() == [0.0, 0.0]
            # a wait that starts after the stop has its own grace period
            assert scorer.submit(torch.rand(2, 3, 8, 8), ["a", "b"]).result()["slow"].shape == (2,)
    finally:
        slow.release.set()
        scorer.close()


def test_a_rewards_own_timeout_error_reaches_the_caller_through_the_background_wait():
    from flowrl_rewards import Reward
    from flowrl_rewards.background import BackgroundScorer

    class TimesOut(Reward):
        name = "times_out"

        def score(self, images, prompts, meta):
            time.sleep(0.4)  # past one polling slice
            raise TimeoutError("the judge timed out")

    with BackgroundScorer(TimesOut(), enabled=True) as scorer:
        with pytest.raises(Exception, match="the judge timed out"):
            scorer.submit(torch.rand(2, 3, 8, 8), ["a", "b"]).result()
        with pytest.raises(TimeoutError):  # the caller's own timeout still applies
            BackgroundScorer(Blocking(0.5).reward(), enabled=True).submit(torch.rand(1, 3, 8, 8), ["a"]).result(0.1)


def test_a_second_signal_during_a_reward_wait_stops_at_once():
    from flowrl.run.signals import stop_on_first_interrupt
    from flowrl_rewards.background import BackgroundScorer

    slow = Blocking(60.0)
    scorer = BackgroundScorer(slow.reward(), enabled=True)
    try:
        with stop_on_first_interrupt():
            _signal_after(0.3, signal.SIGTERM, signal.SIGINT)
            t0 = time.monotonic()
            with pytest.raises(KeyboardInterrupt):
                scorer.submit(torch.rand(2, 3, 8, 8), ["a", "b"]).result()
            assert time.monotonic() - t0 < 2.5
    finally:
        slow.release.set()
        scorer.close()


SLEEPING_REWARD = """
import os
import time

import torch
from flowrl_rewards import Reward


class SleepsOnSecondCall(Reward):
    name = "sleepy"

    def score(self, images, prompts, meta):
        with open(os.environ["FLOWRL_TEST_MARKER"], "a") as f:
            f.write("call\\n")
        if len(open(os.environ["FLOWRL_TEST_MARKER"]).read().splitlines()) >= 2:
            time.sleep(60)  # a served judge that does not answer
        return torch.rand(len(prompts))
"""


# slow (15 s each: a `flowrl train` process); in the default set the cut itself is held in process by
# test_the_first_sigterm_cuts_a_blocking_reward_wait_after_the_grace_period, the save and resume after a signal by
# tests/test_cli_e2e.py::test_a_signal_inside_a_run_saves_the_iteration_and_a_resume_continues
@pytest.mark.slow
@pytest.mark.parametrize("async_reward", ["false", "true"])
def test_sigterm_while_the_reward_blocks_exits_130_within_seconds_keeping_the_finished_iteration(
    tiny_folder, tmp_path, async_reward
):  # noqa: F811
    """``flowrl train`` whose second iteration's reward sleeps 60 s: SIGTERM then exits with status 130 in about the
    grace period (not 60 s), and the last checkpoint is step 1, the iteration that finished; nothing of step 2."""
    plugin = tmp_path / "sleepy.py"
    plugin.write_text(SLEEPING_REWARD)
    marker = tmp_path / "calls"
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "flowrl",
            "train",
            *tiny_args(
                tiny_folder,
                tmp_path / "runs",
                "run",
                f"rewards=[{{name: '{plugin}:SleepsOnSecondCall'}}]",
                "train.max_steps=5",
                "eval.at_start=false",
                "prompts.eval=null",
                f"train.async_reward={async_reward}",
            ),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "FLOWRL_TEST_MARKER": str(marker)},
    )
    try:
        deadline = time.time() + 240
        while not (marker.exists() and len(marker.read_text().splitlines()) >= 2):
            assert proc.poll() is None, proc.communicate()[1][-3000:]
            assert time.time() < deadline, "the run never reached its second reward call"
            time.sleep(0.05)
        time.sleep(0.5)
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=45)
        took = time.monotonic() - t0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 130, err[-3000:]
    assert took < 12, (took, err[-3000:])
    assert "SIGTERM: finishing this iteration" in out and "the reward did not answer within 5 s" in out, out
    run = tmp_path / "runs" / "run"
    assert sorted(p.name for p in (run / "checkpoints").iterdir() if p.name.startswith("step-")) == ["step-1"]
    steps = [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    assert steps == [1], steps
