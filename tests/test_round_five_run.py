"""Issue 63, round five, data loss (docs/reliability.md, "Round five"): ``train.overwrite=true`` refuses a run folder
holding a user's file at any depth (``samples/my_figure.png``, ``checkpoints/my_notes.txt``, a file inside a
checkpoint its manifest does not list), naming each, and deletes nothing; a run's own files, at every depth, are
replaced, and the message says what went."""

from __future__ import annotations

from pathlib import Path

import pytest

from flowrl.commands.main import main
from flowrl.run.manifest import unwritten, write_manifest
from flowrl.run.outputs import MARKER
from tests.test_faults import tiny_args, tiny_folder  # noqa: F401 (tiny_folder: a fixture)


def _tree(root: Path) -> dict[str, bytes | None]:
    return {str(p.relative_to(root)): (p.read_bytes() if p.is_file() else None) for p in sorted(root.rglob("*"))}


@pytest.fixture(scope="module")
def finished_run(tiny_folder, tmp_path_factory):  # noqa: F811
    """A real finished run (one iteration, a checkpoint, eval grids) and its arguments."""
    out = tmp_path_factory.mktemp("runs")
    args = tiny_args(tiny_folder, out, "r", "train.max_steps=1")
    assert main(["train", *args]) == 0
    return out / "r", args


def test_a_finished_runs_own_files_are_all_its_own(finished_run):
    run, _ = finished_run
    assert (run / "checkpoints" / "step-1" / "manifest.json").is_file()
    assert any((run / "samples").iterdir())
    assert unwritten(run, MARKER) == []


USER_FILES = ["samples/my_figure.png", "checkpoints/my_notes.txt", "checkpoints/step-1/notes.txt", "samples/old/a.png"]


def test_overwrite_refuses_a_users_file_at_any_depth_naming_it_and_deletes_nothing(finished_run, tmp_path, capsys):
    """Before: ``train.overwrite=true`` deleted them, printing only "removed the earlier run"."""
    import shutil

    source, args = finished_run
    out = tmp_path / "runs"
    shutil.copytree(source, out / "r")
    run = out / "r"
    for rel in USER_FILES:
        (run / rel).parent.mkdir(parents=True, exist_ok=True)
        (run / rel).write_bytes(b"mine")
    before = _tree(tmp_path)
    again = [a.replace(f"train.output_dir={source.parent}", f"train.output_dir={out}") for a in args]
    assert main(["train", *again, "train.overwrite=true"]) == 2
    err = capsys.readouterr().err
    assert "nothing was deleted" in err, err
    assert err.split("that a run does not write: ")[1].split(";")[0] == ", ".join(sorted(USER_FILES)), err
    assert _tree(tmp_path) == before

    for rel in USER_FILES:  # moved away: the overwrite goes ahead and says what it removed
        (run / rel).unlink()
    (run / "samples" / "old").rmdir()
    assert main(["train", *again, "train.overwrite=true"]) == 0
    said = capsys.readouterr().out
    assert f"removed the earlier run in {run} (config.yaml" in said and "1 checkpoint (step-1)" in said, said


def test_what_a_run_writes_is_decided_by_its_manifests_and_names(tmp_path):
    """A checkpoint's unlisted file, a checkpoint without a manifest holding a note, a stale temporary write, an export
    with a note: each named; weights, the state, the grids and the export's marker are the run's."""
    run = tmp_path / "r"
    step = run / "checkpoints" / "step-2"
    (step / "transformer").mkdir(parents=True)
    (step / "trainer_state.pt").write_bytes(b"s")
    (step / "transformer" / "diffusion_pytorch_model.safetensors").write_bytes(b"w")
    write_manifest(step)
    (step / "transformer" / "extra.safetensors").write_bytes(b"not listed")
    old = run / "checkpoints" / "step-1"  # written before manifests
    old.mkdir()
    (old / "trainer_state.pt").write_bytes(b"s")
    (old / "pytorch_lora_weights.safetensors").write_bytes(b"w")
    (old / "README.txt").write_text("mine")
    stale = run / "checkpoints" / ".step-3.tmp-999999"
    stale.mkdir()
    (stale / "trainer_state.pt").write_bytes(b"partial")
    (run / "samples").mkdir()
    for name in ("before.png", "step-000002.png", "after_default.png", "step-000002.gif"):
        (run / "samples" / name).write_bytes(b"g")
    (run / "export").mkdir()
    (run / "export" / MARKER).write_text("{}")
    (run / "export" / "pytorch_lora_weights.safetensors").write_bytes(b"w")
    (run / "export" / "todo.md").write_text("mine")
    (run / "checkpoints" / "empty").mkdir()
    assert unwritten(run, MARKER) == [
        "checkpoints/empty/",
        "checkpoints/step-1/README.txt",
        "checkpoints/step-2/transformer/extra.safetensors",
        "export/todo.md",
    ]
