"""One owner per run folder, names that are one folder, overwrite that only replaces a run, starts that are
stopped leaving nothing, and checkpoints verified against their manifest (docs/reliability.md, "Run
ownership and checkpoint manifests"). The tiny SD3 runs of tests/test_faults.py, through ``flowrl``."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from flowrl.commands.main import main
from tests.test_faults import snapshot, tiny_args, tiny_folder  # noqa: F401 (tiny_folder: a fixture)

CLI = [sys.executable, "-m", "flowrl", "train"]


def _tree(root: Path) -> dict[str, bytes | None]:
    """Every path under ``root`` (folders too) with the bytes of the files."""
    return {str(p.relative_to(root)): (p.read_bytes() if p.is_file() else None) for p in sorted(root.rglob("*"))}


def _wait_for(predicate, proc: subprocess.Popen, seconds: float = 180) -> None:
    deadline = time.time() + seconds
    while not predicate():
        assert proc.poll() is None, proc.communicate()[1][-2000:]
        assert time.time() < deadline, "timed out"
        time.sleep(0.05)


def _records(path: Path) -> list[dict]:
    """The whole JSON lines of a metrics file (a kill may tear the last one)."""
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            pass
    return out


# ---- one owner per run folder --------------------------------------------------------------------------
HOLD = (
    "import sys, time; from pathlib import Path; from flowrl.run.folder import FolderLock; "
    "assert FolderLock(Path(sys.argv[1])).acquire() is None; print('held', flush=True); time.sleep(600)"
)


def test_a_held_run_folder_is_refused_unchanged_and_kill_9_of_its_holder_frees_it(
    trained_run, tiny_folder, tmp_path, capsys
):
    """The cheap twin of the slow test below: a process holding a trained run's lock (no training of its own) makes
    `flowrl train` under that name refuse with status 2 naming its pid, whatever train.resume / train.overwrite say,
    changing nothing in the folder; after ``kill -9`` of the holder the run resumes and releases the folder."""
    run = _copy(trained_run, tmp_path)
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(run)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        before = _tree(run)
        for extra in (["train.overwrite=true"], ["train.resume=latest"], []):
            capsys.readouterr()
            assert main(["train", *tiny_args(tiny_folder, tmp_path, "run", "train.max_steps=3", *extra)]) == 2
            err = capsys.readouterr().err
            assert f"pid {holder.pid} on host " in err and "in use by another flowrl process" in err, err
            assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
        assert _tree(run) == before
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.communicate(timeout=60)
    assert str(holder.pid) in (run / ".flowrl.lock").read_text()  # left behind; the kernel let go of the lock
    args = tiny_args(tiny_folder, tmp_path, "run", "train.max_steps=3", "train.resume=latest", "prompts.eval=null")
    assert main(["train", *args]) == 0
    assert [r["step"] for r in _records(run / "metrics.jsonl") if "reward_mean" in r][-1] == 3
    assert not (run / ".flowrl.lock").exists()


@pytest.mark.slow  # 18 s: a training holder; its refusals and the kill -9 release: the test above, with a lock holder
def test_a_second_process_is_refused_naming_the_holder_and_kill_9_releases_the_folder(tiny_folder, tmp_path, capsys):
    """A running ``flowrl train`` owns its folder: a second one under the same name is refused with status 2
    naming the holder's pid and host, whatever train.resume / train.overwrite say, and changes nothing; the
    first one's metrics and checkpoints stay its own. ``kill -9`` of the holder frees the folder."""
    run = tmp_path / "run"
    holder = subprocess.Popen(
        CLI + tiny_args(tiny_folder, tmp_path, "run", "train.max_steps=1000", "train.keep_last=0"),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        _wait_for(
            lambda: (run / "metrics.jsonl").exists() and '"reward_mean"' in (run / "metrics.jsonl").read_text(), holder
        )
        for extra in (["train.overwrite=true"], ["train.resume=latest"], []):
            capsys.readouterr()
            assert main(["train", *tiny_args(tiny_folder, tmp_path, "run", "train.max_steps=2", *extra)]) == 2
            err = capsys.readouterr().err
            assert f"pid {holder.pid} on host " in err and "in use by another flowrl process" in err, err
            assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
            assert holder.poll() is None and run.is_dir()
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.communicate(timeout=60)
    records = _records(run / "metrics.jsonl")
    steps = [r["step"] for r in records if "reward_mean" in r]
    assert records[0]["step"] == 0 and steps == list(range(1, len(steps) + 1)), steps  # one run's records, in order
    from flowrl.run.checkpoint import list_checkpoints, read_state

    saved = list_checkpoints(run / "checkpoints")
    assert saved and [s for s, _ in saved] == list(range(1, len(saved) + 1))
    assert all(read_state(path)["config"]["train"]["max_steps"] == 1000 for _, path in saved)  # the holder's own

    # the killed holder's lock file is left behind with its pid, but the kernel let go of the lock
    assert str(holder.pid) in (run / ".flowrl.lock").read_text()
    last = saved[-1][0]
    assert (
        main(
            [
                "train",
                *tiny_args(
                    tiny_folder,
                    tmp_path,
                    "run",
                    f"train.max_steps={last + 1}",
                    "train.resume=latest",
                    "train.keep_last=0",
                ),
            ]
        )
        == 0
    )
    assert [r["step"] for r in _records(run / "metrics.jsonl") if "reward_mean" in r][-1] == last + 1
    assert not (run / ".flowrl.lock").exists()  # released (and removed) when the run ended


def test_names_that_are_not_one_folder_are_refused_writing_and_deleting_nothing(tiny_folder, tmp_path, capsys):
    out = tmp_path / "runs"
    (out / "a").mkdir(parents=True)
    (out / "config.yaml").write_text("a: 1\n")  # output_dir itself looks like a run: train.name=. must not replace it
    (out / "metrics.jsonl").write_text('{"step": 1}\n')
    (out / "a" / "notes.txt").write_text("mine")
    before = _tree(tmp_path)
    for name, value in ((".", "."), ("", "''"), ("a/b", "a/b"), ("..", "..")):
        capsys.readouterr()
        rc = main(["train", *tiny_args(tiny_folder, out, value, "train.overwrite=true", "train.max_steps=1")])
        err = capsys.readouterr().err
        assert rc == 2, (name, err)
        assert f"train.name={name!r}" in err and "Traceback" not in err and len(err.strip().splitlines()) == 1, err
        assert _tree(tmp_path) == before, name
    from flowrl.config.checks import check_run_name

    for name in ("a\\b", "x\0y"):
        with pytest.raises(ValueError, match="one folder name"):
            check_run_name(name)


def test_overwrite_refuses_to_delete_a_folder_that_is_not_a_run(tiny_folder, tmp_path, capsys):
    notes = tmp_path / "notes"
    (notes / "data").mkdir(parents=True)
    (notes / "thesis.tex").write_text("\\section{}")
    (notes / "data" / "x.csv").write_text("1,2\n")
    (notes / "checkpoints").mkdir()  # held like a run today, yet no config.yaml and metrics.jsonl beside it
    before = _tree(tmp_path)
    assert main(["train", *tiny_args(tiny_folder, tmp_path, "notes", "train.overwrite=true", "train.max_steps=1")]) == 2
    err = capsys.readouterr().err
    assert (
        "train.overwrite=true" in err
        and str(notes) in err
        and "not a flowrl run" in err
        and "nothing was deleted" in err
    )
    assert _tree(tmp_path) == before  # nothing deleted, no lock file left


# ---- a start that is stopped leaves nothing ---------------------------------------------------------
SLOW_REWARD = """
import os
import time

import torch
from flowrl_rewards.core.base import Reward


class Slow(Reward):
    name = "slow"

    def score(self, images, prompts, meta):
        open(os.environ["FLOWRL_TEST_MARKER"], "a").write("scoring\\n")
        # 120 s in short sleeps: the kernel may hand the signal to another thread (torch's), which cannot cut
        # the main thread's sleep short; Python runs the handler at the next sleep's end
        for _ in range(1200):
            time.sleep(0.1)
        return torch.zeros(len(prompts))
"""


# slow (14 s: two `flowrl train` processes); a failed start writing nothing is held in the default set by
# tests/test_faults.py::test_a_misbehaving_reward_is_one_message_and_a_failed_start_writes_nothing
@pytest.mark.slow
def test_a_start_stopped_before_its_first_iteration_leaves_no_folder(tiny_folder, tmp_path):
    """SIGTERM in the first eval, and Ctrl-C twice in the first iteration (the two started together, one
    thread each): each exits with status 130 and leaves no run folder."""
    plugin = tmp_path / "slow_reward.py"
    plugin.write_text(SLOW_REWARD)
    procs = {}
    try:
        for how in ("SIGTERM in the first eval", "Ctrl-C twice in the first iteration"):
            case = tmp_path / how.split()[0]
            extra = (
                ["eval.at_start=true"] if how.startswith("SIGTERM") else ["eval.at_start=false", "prompts.eval=null"]
            )
            procs[how] = (
                case,
                subprocess.Popen(
                    CLI + tiny_args(tiny_folder, case / "runs", "run", f"rewards=[{{name: '{plugin}:Slow'}}]", *extra),
                    stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE,
                    text=True,
                    env={**os.environ, "FLOWRL_TEST_MARKER": str(tmp_path / f"{case.name}.scoring")},
                ),
            )
        for how, (case, proc) in procs.items():
            # scoring: the eval before training, or the first iteration's rewards
            _wait_for((tmp_path / f"{case.name}.scoring").exists, proc)
            assert (case / "runs" / "run").is_dir(), how
            if how.startswith("SIGTERM"):
                proc.send_signal(signal.SIGTERM)
            else:
                proc.send_signal(signal.SIGINT)
                time.sleep(0.5)
                assert proc.poll() is None, how  # the first Ctrl-C only asks to finish the iteration
                proc.send_signal(signal.SIGINT)
        for how, (case, proc) in procs.items():
            _, err = proc.communicate(timeout=60)
            assert proc.returncode == 130, (how, err[-2000:])
            assert not (case / "runs").exists(), (how, sorted((case / "runs").rglob("*")))
    finally:
        for _, proc in procs.values():
            if proc.poll() is None:
                proc.kill()


# ---- checkpoints verified against their manifest ---------------------------------------------------
@pytest.fixture(scope="module")
def trained_run(tiny_folder, tmp_path_factory):
    """A tiny run with checkpoints step-1 and step-2 (each with a manifest), trained once for this module."""
    out = tmp_path_factory.mktemp("trained")
    assert main(["train", *tiny_args(tiny_folder, out, "run", "train.max_steps=2", "prompts.eval=null")]) == 0
    return out / "run"


def _copy(run: Path, tmp_path: Path) -> Path:
    shutil.copytree(run, tmp_path / "run")
    return tmp_path / "run"


def _damage(step: Path, how: str) -> Path:
    """Damage checkpoint folder ``step``; returns the path a refusal must name."""
    weights = step / "pytorch_lora_weights.safetensors"
    if how == "folder replaced by a file":
        shutil.rmtree(step)
        step.write_bytes(b"not a checkpoint")
        return step
    data = bytearray(weights.read_bytes())
    if how == "truncated weights":
        del data[len(data) // 2 :]
    else:  # zeroed bytes in the middle of the tensors (past the safetensors header): finite numbers, wrong ones
        start = 8 + int.from_bytes(data[:8], "little")
        mid = start + (len(data) - start) // 2 // 4 * 4
        assert any(data[mid : mid + 256])
        data[mid : mid + 256] = bytes(256)
    weights.write_bytes(bytes(data))
    return weights


@pytest.mark.parametrize("how", ["folder replaced by a file", "truncated weights", "zeroed bytes"])
def test_a_damaged_checkpoint_is_refused_for_sampling_and_resume_falls_back(
    trained_run, tiny_folder, tmp_path, capsys, how
):
    run = _copy(trained_run, tmp_path)
    named = _damage(run / "checkpoints" / "step-2", how)
    if how == "zeroed bytes":  # finite weights of the right shapes: only the manifest tells
        from safetensors.torch import load_file

        assert all(bool(torch.isfinite(t).all()) for t in load_file(named).values())
    for argv in (
        [
            "sample",
            "--checkpoint",
            str(run),
            "--prompt",
            "a red circle",
            "--num",
            "1",
            "--steps",
            "2",
            "--out",
            str(tmp_path / "png"),
        ],
        ["eval", "--checkpoint", str(run / "checkpoints" / "step-2"), "prompts.eval=a red circle"],
    ):
        capsys.readouterr()
        assert main(argv) == 2, argv
        err = capsys.readouterr().err
        assert "is damaged" in err and str(named) in err and "Traceback" not in err, err
    assert not (tmp_path / "png").exists()

    with pytest.warns(RuntimeWarning) as warned:
        assert (
            main(
                [
                    "train",
                    *tiny_args(
                        tiny_folder, tmp_path, "run", "train.max_steps=3", "prompts.eval=null", "train.resume=latest"
                    ),
                ]
            )
            == 0
        )
    fallback = [str(w.message) for w in warned if "is damaged" in str(w.message)]
    assert len(fallback) == 1 and str(run / "checkpoints" / "step-2") in fallback[0], fallback
    assert (
        str(named) in fallback[0]
        and f"falling back to the one before it, {run / 'checkpoints' / 'step-1'}" in fallback[0]
    )
    steps = [r["step"] for r in _records(run / "metrics.jsonl") if "reward_mean" in r]
    assert steps == [1, 2, 3]  # continued from step 1: its step 2 again, then 3
    assert (run / "checkpoints" / "step-3" / "manifest.json").is_file()


def test_resume_refuses_to_start_afresh_when_every_checkpoint_is_damaged(trained_run, tiny_folder, tmp_path, capsys):
    run = _copy(trained_run, tmp_path)
    _damage(run / "checkpoints" / "step-2", "folder replaced by a file")
    _damage(run / "checkpoints" / "step-1", "zeroed bytes")
    before = _tree(run)
    with pytest.warns(RuntimeWarning, match="is damaged"):
        rc = main(
            [
                "train",
                *tiny_args(
                    tiny_folder, tmp_path, "run", "train.max_steps=3", "prompts.eval=null", "train.resume=latest"
                ),
            ]
        )
    err = capsys.readouterr().err
    assert rc == 2 and "every checkpoint" in err and "is damaged" in err, err
    assert _tree(run) == before


def test_a_checkpoint_written_before_manifests_loads_with_a_notice(trained_run, tiny_folder, tmp_path, capsys):
    run = _copy(trained_run, tmp_path)
    for step in (run / "checkpoints").iterdir():  # as an older flowrl wrote them: no manifest, none recorded
        (step / "manifest.json").unlink(missing_ok=True)
        state = torch.load(step / "trainer_state.pt", weights_only=False)
        state.pop("manifest", None)
        torch.save(state, step / "trainer_state.pt")
    with pytest.warns(RuntimeWarning, match=r"step-2 has no manifest\.json \(written before manifests\)") as warned:
        assert (
            main(
                [
                    "sample",
                    "--checkpoint",
                    str(run),
                    "--prompt",
                    "a red circle",
                    "--num",
                    "1",
                    "--steps",
                    "2",
                    "--out",
                    str(tmp_path / "png"),
                ]
            )
            == 0
        )
    assert len([w for w in warned if "no manifest.json" in str(w.message)]) == 1  # one notice, not one per read
    assert (tmp_path / "png" / "grid.png").is_file()

    # a manifest missing from a checkpoint whose state says it was written with one is damage
    run2 = _copy(trained_run, tmp_path / "b")
    (run2 / "checkpoints" / "step-2" / "manifest.json").unlink()
    capsys.readouterr()
    assert (
        main(
            [
                "sample",
                "--checkpoint",
                str(run2),
                "--prompt",
                "a red circle",
                "--num",
                "1",
                "--steps",
                "2",
                "--out",
                str(tmp_path / "png2"),
            ]
        )
        == 2
    )
    err = capsys.readouterr().err
    assert "is damaged" in err and str(run2 / "checkpoints" / "step-2" / "manifest.json") in err and "is missing" in err
