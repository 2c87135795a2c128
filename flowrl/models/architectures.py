"""The published architectures stored with the package (flowrl/models/archs/*.json): a family's transformer, VAE and
text encoders as their diffusers/transformers configs, the hub ids they are published under, and the text settings
of their pipeline. Read by the random-weight pipelines (:mod:`flowrl.models.random_init`) and by the estimate
(:mod:`flowrl.estimate.archs` builds them on the meta device)."""

from __future__ import annotations

import json
from pathlib import Path

from flowrl.errors import ConfigError

ARCH_DIR = Path(__file__).resolve().parent / "archs"


def list_archs() -> list[str]:
    """Names (file stems) of the stored architectures, e.g. ``sd35_medium``."""
    return sorted(p.stem for p in ARCH_DIR.glob("*.json"))


def load_arch(name: str) -> dict:
    """The stored architecture ``name`` (a file stem of flowrl/models/archs, e.g. ``flux1_dev``). A file with
    ``"extends": BASE`` is BASE's architecture with the file's keys over it (its ``text`` merged key by key):
    a model sharing another's transformer, VAE and encoders (Qwen-Image-Edit) states only what differs."""
    path = ARCH_DIR / f"{name}.json"
    if not path.is_file():
        raise ConfigError(f"no stored architecture {name!r}; stored: {list_archs()}")
    arch = json.loads(path.read_text())
    if "extends" in arch:
        base = load_arch(arch.pop("extends"))
        arch = {**base, **arch, "text": {**base["text"], **arch.get("text", {})}}
    arch["key"] = name
    return arch
