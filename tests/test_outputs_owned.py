"""A command writes only what it owns (issue 47, items 1 and 2; flowrl/run/outputs.py): every command that writes into
a path a user names creates a new folder or adds to its own (its marker, or a run folder's files; ``sample`` adds
files to any folder without replacing one), refuses an existing path it did not write with one message naming it
(status 2, nothing changed), never writes inside a run folder's entries, and makes the names it writes (compare's
labels) one folder each, inside ``--out``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from flowrl.commands.main import main
from flowrl.config.schema import ConfigError
from flowrl.run.outputs import MARKER, check_output
from tests.test_faults import tiny_args, tiny_folder  # noqa: F401 (tiny_folder: a fixture)


def _tree(root: Path) -> dict[str, bytes | None]:
    """Every path under ``root`` (folders too) with the bytes of the files."""
    return {str(p.relative_to(root)): (p.read_bytes() if p.is_file() else None) for p in sorted(root.rglob("*"))}


def _refused(capsys, argv: list[str], *words: str) -> str:
    """``flowrl ARGV`` exits with status 2 and one line on stderr, no traceback, holding ``words``."""
    capsys.readouterr()
    rc = main(argv)
    err = capsys.readouterr().err
    assert rc == 2, (argv, err)
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    for w in words:
        assert w in err, (w, err)
    return err


@pytest.fixture(scope="module")
def run(tiny_folder, tmp_path_factory):  # noqa: F811
    """A finished one-step run of the tiny SD3 pipeline (LoRA), with held-out prompts."""
    root = tmp_path_factory.mktemp("owned")
    assert main(["train", *tiny_args(tiny_folder, root, "run", "train.max_steps=1")]) == 0
    return root / "run"


@pytest.fixture
def user(tmp_path) -> Path:
    """A folder of the user's own files beside a file of theirs."""
    mine = tmp_path / "mine"
    (mine / "data").mkdir(parents=True)
    (mine / "thesis.tex").write_text("\\section{}")
    (mine / "data" / "x.csv").write_text("1,2\n")
    (tmp_path / "notes.txt").write_text("mine too")
    return tmp_path


# ---- export ------------------------------------------------------------------------------------------------------
def test_export_refuses_a_folder_a_file_dot_and_the_run_and_never_moves_them_aside(run, user, capsys, monkeypatch):
    before = _tree(user)
    _refused(
        capsys, ["export", str(run), "--out", str(user / "mine")], str(user / "mine"), "not written by flowrl export"
    )
    _refused(capsys, ["export", str(run), "--out", str(user / "notes.txt")], "notes.txt", "existing file")
    monkeypatch.chdir(user)
    _refused(capsys, ["export", str(run), "--out", "."], "--out='.'", "working directory")
    _refused(
        capsys, ["export", str(run), "--out", str(run / "checkpoints" / "x")], "inside the run folder", "checkpoints/"
    )
    _refused(capsys, ["export", str(run), "--out", str(run)], "run folder")
    assert _tree(user) == before  # nothing deleted, renamed to .NAME.old-PID or added
    assert not (run / "checkpoints" / "x").exists()


def test_export_writes_a_new_or_empty_folder_and_replaces_only_its_own(run, tmp_path, capsys):
    out = tmp_path / "exp"
    assert main(["export", str(run), "--out", str(out)]) == 0
    assert json.loads((out / MARKER).read_text())["command"] == "flowrl export"
    assert (out / "pytorch_lora_weights.safetensors").is_file()
    assert main(["export", str(run), "--out", str(out)]) == 0  # an earlier export: replaced
    (tmp_path / "empty").mkdir()
    assert main(["export", str(run), "--out", str(tmp_path / "empty")]) == 0
    assert main(["export", str(run)]) == 0 and (run / "export" / "pytorch_lora_weights.safetensors").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["empty", "exp"]  # no .exp.old-PID / .tmp- left


# ---- sample, eval ------------------------------------------------------------------------------------------------
SAMPLE = ["--prompt", "a red circle", "--num", "1", "--steps", "2"]


def test_sample_adds_to_a_folder_without_replacing_and_refuses_files_dot_and_run_entries(
    run, user, capsys, monkeypatch
):
    mine = user / "mine"
    before = _tree(mine)
    assert main(["sample", "--checkpoint", str(run), *SAMPLE, "--out", str(mine)]) == 0
    after = _tree(mine)
    assert {k: v for k, v in after.items() if k in before} == before  # the user's files untouched
    assert sorted(set(after) - set(before)) == ["000-a_red_circle.png", "grid.png"]  # added; no marker in theirs
    _refused(capsys, ["sample", "--checkpoint", str(run), *SAMPLE, "--out", str(user / "notes.txt")], "existing file")
    _refused(
        capsys,
        ["sample", "--checkpoint", str(run), *SAMPLE, "--out", str(run / "samples")],
        "inside the run folder",
        "samples/",
    )
    monkeypatch.chdir(user)
    _refused(capsys, ["sample", "--checkpoint", str(run), *SAMPLE, "--out", "."], "working directory")
    assert main(["sample", "--checkpoint", str(run), *SAMPLE, "--out", "new"]) == 0
    assert sorted(p.name for p in (user / "new").iterdir()) == ["000-a_red_circle.png", "grid.png"]
    (user / "ev").mkdir()
    (user / "ev" / MARKER).write_text(json.dumps({"command": "flowrl eval"}))
    _refused(capsys, ["sample", "--checkpoint", str(run), *SAMPLE, "--out", str(user / "ev")], "written by flowrl eval")


def test_eval_out_twice_keeps_both_and_a_folder_it_did_not_write_is_refused(run, user, capsys):
    out = user / "ev"
    assert main(["eval", "--checkpoint", str(run), "--out", str(out)]) == 0
    first = (out / "eval.json").read_text()
    assert main(["eval", "--checkpoint", str(run), "--out", str(out)]) == 0
    assert (out / "eval.json").read_text() == first  # not overwritten
    assert json.loads((out / "eval-2.json").read_text()) == json.loads(first)  # the second beside it
    assert "eval-2.json" in capsys.readouterr().err
    before = _tree(user / "mine")
    _refused(capsys, ["eval", "--checkpoint", str(run), "--out", str(user / "mine")], "not written by flowrl eval")
    _refused(capsys, ["eval", "--checkpoint", str(run), "--out", str(out / "eval.json")], "existing file")
    assert _tree(user / "mine") == before


def test_benchmark_out_is_a_new_or_empty_folder_only(user, capsys):
    """GenEval's layout has fixed names: an earlier benchmark's folder is refused as well as the user's (before the
    model or the reward loads)."""
    earlier = user / "bench"
    earlier.mkdir()
    (earlier / MARKER).write_text(json.dumps({"command": "flowrl eval --benchmark"}))
    (earlier / "summary.json").write_text("{}")
    for folder, words in (
        (earlier, ["holds an earlier flowrl eval --benchmark"]),
        (user / "mine", ["not written by flowrl eval --benchmark"]),
    ):
        before = _tree(folder)
        _refused(capsys, ["eval", "--benchmark", "ocr", "--out", str(folder)], str(folder), *words)
        assert _tree(folder) == before


# ---- compare -----------------------------------------------------------------------------------------------------
def test_compare_labels_are_made_into_one_folder_each_inside_out(tmp_path, capsys, monkeypatch):
    """``../../escaped=CONFIG`` writes nothing outside ``--out`` (its log used to land two folders above
    ``OUT/logs``); two configs of one name never share a run folder."""
    import dataclasses
    import sys

    from flowrl.commands import compare
    from flowrl.commands.compare import plan_runs

    def failing_at_once(*args):  # each run a process that fails as a missing prompts file makes `flowrl train` fail,
        # without its imports (what matters is where its log and results land; a real failing run: test_compare.py)
        fail = "import sys; print('prompts.train: no_such_prompts.txt not found', file=sys.stderr); sys.exit(2)"
        return [
            dataclasses.replace(r, command=[sys.executable, "-c", fail, *threads_of(r.command)])
            for r in plan_runs(*args)
        ]

    def threads_of(command: list[str]) -> list[str]:  # compare reads train.num_threads from each run's command
        return [c for c in command if c.startswith("train.num_threads=")]

    monkeypatch.setattr(compare, "plan_runs", failing_at_once)
    work = tmp_path / "w" / "x" / "y"
    work.mkdir(parents=True)
    monkeypatch.chdir(work)
    rc = main(
        [
            "compare",
            "../../escaped=configs/shapes/grpo.yaml",
            "--seeds",
            "0",
            "--budget",
            "iterations=1",
            "--out",
            "a/b",
            "prompts.train=no_such_prompts.txt",
        ]
    )  # the run fails at once: what matters is where
    assert rc == 1
    outside = [p for p in (tmp_path / "w").rglob("*") if p.is_file() and not p.is_relative_to(work / "a" / "b")]
    assert outside == []
    assert (work / "a" / "b" / "logs" / "escaped-s0.log").is_file()
    assert "| escaped |" in (work / "a" / "b" / "results.md").read_text()

    a, b = tmp_path / "a" / "grpo.yaml", tmp_path / "b" / "grpo.yaml"
    for path in (a, b):
        path.parent.mkdir()
        path.write_text("loss: {kl_ref: 0}\n")
    runs = plan_runs(
        [(Path(p).stem, str(p), []) for p in (a, b)] + [("x/../../y" * 20, str(a), [])],
        [0],
        ("iterations", 1),
        tmp_path / "cmp",
        1,
    )
    folders = [r.folder for r in runs]
    assert len(set(folders)) == 3 and all(f.parent == tmp_path / "cmp" / "runs" for f in folders)
    assert [r.label for r in runs][:2] == ["grpo", "grpo-2"] and len(runs[2].label) <= 40


def test_compare_refuses_a_folder_it_did_not_write(user, capsys):
    before = _tree(user)
    _refused(
        capsys,
        ["compare", "configs/shapes/grpo.yaml", "--seeds", "0", "--out", str(user / "mine")],
        "not written by flowrl compare",
    )
    assert _tree(user) == before


# ---- data fetch, train -------------------------------------------------------------------------------------------
def test_data_fetch_refuses_a_set_folder_it_did_not_write(tmp_path, capsys, monkeypatch):
    from tests.test_data_fetch import run as data_run
    from tests.test_data_fetch import small_hpdv2, write_hpdv2

    root = tmp_path / "mirror"
    write_hpdv2(root, n_test=3, n_train=5)
    small_hpdv2(monkeypatch)
    out = tmp_path / "dataset"
    (out / "hpdv2").mkdir(parents=True)
    (out / "hpdv2" / "train.txt").write_text("my own prompts\n")
    (out / "mine.txt").write_text("beside the sets\n")
    before = _tree(out)
    with pytest.raises(ConfigError, match=r"hpdv2.*not written by flowrl data fetch"):
        data_run(["fetch", "hpdv2", "--source", str(root), "--out", str(out)])
    assert _tree(out) == before
    (out / "hpdv2" / "train.txt").unlink()
    (out / "hpdv2").rmdir()
    assert data_run(["fetch", "hpdv2", "--source", str(root), "--out", str(out)]) == 0  # adds hpdv2/ beside mine.txt
    assert data_run(["fetch", "hpdv2", "--force", "--source", str(root), "--out", str(out)]) == 0  # its own: again
    assert (out / "mine.txt").read_text() == "beside the sets\n"


def test_train_refuses_a_folder_that_is_no_run_and_an_output_dir_inside_a_run(run, tiny_folder, user, capsys):  # noqa: F811
    before = _tree(user)
    _refused(
        capsys,
        ["train", *tiny_args(tiny_folder, user, "mine", "train.max_steps=1")],
        "train.name='mine'",
        "not written by flowrl train",
    )
    _refused(
        capsys, ["train", *tiny_args(tiny_folder, user / "notes.txt", "x", "train.max_steps=1")], "notes.txt is a file"
    )
    assert _tree(user) == before
    inside = run / "checkpoints"
    before = _tree(run)
    _refused(
        capsys,
        ["train", *tiny_args(tiny_folder, inside, "x", "train.max_steps=1")],
        "inside the run folder",
        "checkpoints/",
    )
    assert _tree(run) == before


def test_check_output_states_and_the_marker_of_another_command(tmp_path):
    assert check_output(tmp_path / "new", "flowrl sample").state == "new"
    (tmp_path / "empty").mkdir()
    made = check_output(tmp_path / "empty", "flowrl eval")
    assert made.state == "empty" and made.make() == tmp_path / "empty"
    assert check_output(tmp_path / "empty", "flowrl eval").state == "own"
    with pytest.raises(ValueError, match="written by flowrl eval"):
        check_output(tmp_path / "empty", "flowrl sample", mode="adds")
    with pytest.raises(ValueError, match=r"--out='\.\.' names a parent folder"):
        check_output("..", "flowrl sample")


def test_no_command_that_writes_skips_the_rule():
    """Every subcommand module that takes ``--out`` (or writes a run folder) goes through flowrl/run/outputs.py."""
    root = Path(__file__).resolve().parents[1] / "flowrl"
    writers = [p for p in sorted((root / "commands").glob("*.py")) if '"--out"' in p.read_text()]
    assert {p.stem for p in writers} >= {"export", "sample", "eval", "compare", "data", "rollouts"}
    for path in writers:
        text = path.read_text()
        assert "check_output" in text or "check_export_target" in text, path.name
    assert "check_output" in (root / "run" / "folder.py").read_text()  # train's run folder
    assert "check_export_target(target" in (root / "run" / "checkpoint.py").read_text()  # write_export itself
