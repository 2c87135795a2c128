"""Installable like a library: the wheel carries every module, preset, prompt file and weight under the import
names pyproject gives (``flowrl``, ``flowrl_rewards``), and shipped files are found from any directory. (.ci/run
also installs the wheel into a fresh environment outside the repository and runs ``flowrl train`` there.)"""
from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import tomllib

from flowrl.config.schema import ConfigError, TrainConfig
from flowrl.paths import CONFIG_DIR, DEFAULT_CONFIG, find_file, shipped_name

ROOT = Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
IMPORTED_AS = {folder: name for name, folder in PYPROJECT["package-dir"].items()}


def tracked(folder: str) -> list[str]:
    out = subprocess.run(["git", "ls-files", folder], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    return [line for line in out.splitlines() if line]


def test_every_folder_of_modules_is_a_listed_package():
    folders = {str(Path(f).parent) for f in tracked("flowrl") + tracked("rewards") if f.endswith(".py")}
    listed = {name.replace(".", "/") for name in PYPROJECT["packages"]}
    named = {IMPORTED_AS.get(f, f) for f in folders}
    assert named == listed, f"pyproject packages: missing {sorted(named - listed)}, extra {sorted(listed - named)}"


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> zipfile.ZipFile:
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run([sys.executable, "-m", "pip", "wheel", str(ROOT), "--no-deps", "--no-build-isolation", "-q",
                    "-w", str(out)], check=True, capture_output=True)
    (path,) = out.glob("flowrl_align-*.whl")
    return zipfile.ZipFile(path)


def test_the_wheel_holds_every_tracked_file_under_its_import_name(wheel):
    names = set(wheel.namelist())
    expected = {f for f in tracked("flowrl")} | {"flowrl_rewards/" + f.split("/", 1)[1] for f in tracked("rewards")}
    missing = sorted(expected - names)
    assert not missing, f"{len(missing)} files not in the wheel, e.g. {missing[:5]}"
    assert "flowrl/configs/shapes/nft.yaml" in names and "flowrl/configs/shapes/prompts/eval.txt" in names
    assert not any(n.startswith(("tests/", "rewards/", "configs/")) for n in names)  # no stray top-level names
    metadata = next(n for n in names if n.endswith(".dist-info/METADATA"))
    assert "Name: flowrl-align" in wheel.read(metadata).decode()


def test_shipped_files_are_found_from_any_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert find_file("configs/shapes/grpo.yaml") == CONFIG_DIR / "shapes" / "grpo.yaml"
    assert find_file("configs/shapes/prompts/eval.txt") == CONFIG_DIR / "shapes" / "prompts" / "eval.txt"
    assert shipped_name(DEFAULT_CONFIG) == "configs/shapes/nft.yaml"
    cfg = TrainConfig.from_yaml("configs/sd35/flow_grpo_pickscore.yaml")
    assert cfg.model.family == "sd3" and cfg.prompts.train == "dataset/pickscore/train.txt"
    (tmp_path / "configs").mkdir()
    (tmp_path / "configs" / "mine.yaml").write_text("train: {max_steps: 7}\n")  # the user's own file wins
    assert TrainConfig.from_yaml("configs/mine.yaml").train.max_steps == 7
    with pytest.raises(ConfigError, match=r"'configs/nope.yaml' does not exist \(looked in the working directory"):
        TrainConfig.from_yaml("configs/nope.yaml")
    assert find_file("dataset/none.txt") is None and find_file(str(tmp_path / "missing.yaml")) is None
