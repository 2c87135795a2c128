"""Installable like a library: the wheel carries every module, preset, prompt file and weight under the import
names pyproject gives (``flowrl``, ``flowrl_rewards``; the top-level ``configs/`` as ``flowrl/configs/``), and shipped
files are found from any directory. (.ci/run also installs the wheel into a fresh environment outside the repository
and runs ``flowrl train`` there.)"""

from __future__ import annotations

import glob
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import tomllib

from flowrl.config.schema import ConfigError, TrainConfig
from flowrl.paths import CONFIG_DIR, DEFAULT_CONFIG, config_dir, find_file, shipped_name

ROOT = Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
PRESETS = "configs"  # the repository's top-level folder of presets and prompt files (no modules)


def tracked(*paths: str) -> list[str]:
    out = subprocess.run(["git", "ls-files", *paths], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    return [line for line in out.splitlines() if line]


def folder_of(package: str) -> str:
    """The repository folder pyproject builds the import package ``package`` from (its package-dir mappings
    applied: ``flowrl_rewards`` -> ``rewards``, ``flowrl.configs`` -> ``configs``)."""
    parts = package.split(".")
    for i in range(len(parts), 0, -1):
        mapped = PYPROJECT["package-dir"].get(".".join(parts[:i]))
        if mapped is not None:
            return "/".join([mapped, *parts[i:]])
    return "/".join(parts)


def test_every_folder_of_modules_is_a_listed_package():
    folders = {str(Path(f).parent) for f in tracked("flowrl", "rewards", PRESETS) if f.endswith(".py")}
    listed = {folder_of(name) for name in PYPROJECT["packages"]} - {PRESETS}
    assert folders == listed, (
        f"pyproject packages: missing {sorted(folders - listed)}, extra {sorted(listed - folders)}"
    )


def test_configs_sit_at_the_top_and_pyproject_ships_every_file_in_them():
    presets = tracked(PRESETS)
    assert "configs/shapes/nft.yaml" in presets and not tracked("flowrl/configs"), (
        "the presets belong in the repository's top-level configs/ (README.md, Layout)"
    )
    assert "flowrl.configs" in PYPROJECT["packages"] and folder_of("flowrl.configs") == PRESETS, (
        "pyproject.toml must ship configs/ inside the package: packages lists flowrl.configs, package-dir maps it"
    )
    globs = PYPROJECT.get("package-data", {}).get("flowrl.configs", [])
    shipped = {f"{PRESETS}/{m}" for g in globs for m in glob.glob(g, root_dir=ROOT / PRESETS, recursive=True)}
    missing = sorted(set(presets) - shipped)
    assert not missing, f"package-data of flowrl.configs ({globs}) leaves out {missing[:5]}"
    assert CONFIG_DIR == ROOT / PRESETS  # a checkout (or an editable install) reads its own configs/


def test_config_dir_is_the_checkouts_in_a_checkout_and_the_shipped_copy_when_installed(tmp_path):
    checkout = tmp_path / "checkout"
    for folder in ("flowrl", "configs"):
        (checkout / folder).mkdir(parents=True)
    (checkout / "pyproject.toml").write_text("")
    assert config_dir(checkout / "flowrl") == checkout / "configs"
    site = tmp_path / "site-packages"
    (site / "flowrl" / "configs").mkdir(parents=True)
    (site / "configs").mkdir()  # another distribution's top-level configs/ is not flowrl's
    assert config_dir(site / "flowrl") == site / "flowrl" / "configs"


@pytest.fixture(scope="module")
def built_wheel(tmp_path_factory) -> tuple[zipfile.ZipFile, list[str]]:
    """The wheel built from a copy of the tracked files, and the files copied: the checkout's build/ may hold files
    since moved or deleted, which setuptools would put in the wheel."""
    source, out = tmp_path_factory.mktemp("source"), tmp_path_factory.mktemp("wheel")
    copied = [
        name for name in tracked("pyproject.toml", "README.md", "flowrl", "rewards", PRESETS) if (ROOT / name).is_file()
    ]  # not a tracked file deleted in the working tree
    for name in copied:
        (source / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / name, source / name)
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", str(source), "--no-deps", "--no-build-isolation", "-q", "-w", str(out)],
        check=True,
        capture_output=True,
    )
    (path,) = out.glob("flowrl_align-*.whl")
    return zipfile.ZipFile(path), copied


def test_the_wheel_holds_every_tracked_file_under_its_import_name(built_wheel):
    wheel, copied = built_wheel
    names = set(wheel.namelist())
    top = {"flowrl": "flowrl", "rewards": "flowrl_rewards", PRESETS: "flowrl/configs"}  # folder -> place in the wheel
    expected = {top[f.split("/", 1)[0]] + "/" + f.split("/", 1)[1] for f in copied if "/" in f}
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
