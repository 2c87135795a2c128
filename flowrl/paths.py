"""Where the files a config or a command names are found, in a source checkout and in an installed wheel alike.

A relative path is tried from the working directory, then from a source checkout's root (:data:`REPO_ROOT`: the
``dataset/`` folder `flowrl data fetch` fills when run there), then, for ``configs/…``, among the presets and prompt
files (:data:`CONFIG_DIR`), so ``flowrl train configs/sd35/flow_grpo_pickscore.yaml`` works from any directory after
``pip install flowrl-align``. The presets live in the repository's top-level ``configs/``; the build ships them inside
the package as ``flowrl/configs/`` (pyproject.toml maps ``flowrl.configs`` to ``configs``), read with
:mod:`importlib.resources` when installed from a wheel.
"""

from __future__ import annotations

import os
from importlib.resources import files
from pathlib import Path

PACKAGE_DIR = Path(os.fspath(files("flowrl")))
REPO_ROOT = (
    PACKAGE_DIR.parent
)  # a checkout's root (site-packages when installed): relative paths are also tried from here
SHIPPED = "configs"  # the first part of a path that names a shipped file: configs/sd35/flow_grpo_pickscore.yaml


def config_dir(package_dir: Path) -> Path:
    """The presets and prompt files for the ``flowrl`` package at ``package_dir``: the checkout's top-level
    ``configs/`` when the package sits in a source checkout (run from it, or an editable install), else the copy the
    build shipped inside the package (``flowrl/configs/`` of an installed wheel)."""
    root = package_dir.parent
    if (root / "pyproject.toml").is_file() and (root / SHIPPED).is_dir():
        return root / SHIPPED
    return package_dir / SHIPPED


CONFIG_DIR = config_dir(PACKAGE_DIR)  # the presets and the shapes world's prompt files
DEFAULT_CONFIG = CONFIG_DIR / "shapes" / "nft.yaml"  # the main job (`flowrl train` with no config)


def shipped_name(path: Path) -> str:
    """How users name a shipped file: ``configs/shapes/nft.yaml`` for ``CONFIG_DIR/shapes/nft.yaml`` (others as
    given)."""
    try:
        return str(Path(SHIPPED) / Path(path).resolve().relative_to(CONFIG_DIR.resolve()))
    except ValueError:
        return str(path)


def find_file(spec: str | os.PathLike) -> Path | None:
    """The file ``spec`` names (see the module docstring for the order tried), or None when none is a file."""
    path = Path(spec).expanduser()
    if path.is_file():
        return path
    if path.is_absolute():
        return None
    candidates = [REPO_ROOT / path]
    if path.parts and path.parts[0] == SHIPPED:
        candidates.append(CONFIG_DIR.joinpath(*path.parts[1:]))
    return next((c for c in candidates if c.is_file()), None)


def where_tried(spec: str | os.PathLike) -> str:
    """The places :func:`find_file` looked, for an error message."""
    shipped = f", and among the shipped files ({CONFIG_DIR})" if Path(spec).parts[:1] == (SHIPPED,) else ""
    return f"the working directory ({Path.cwd()}), {REPO_ROOT}{shipped}"
