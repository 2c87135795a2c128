"""Rollout stores: a fixed set of clean samples, written once and replayed by ``rollout.plan: offline``
(:mod:`flowrl.rollout.offline`; GDRO trains fully offline on such a set, arXiv 2601.02036).

What a store holds, per prompt: K clean latents (the model's own latent space, fp32), the root seed of each
(``model.noise([seed])`` rebuilds its x_T) and its reward when written. Latents, not images: an image read back
from a PNG would need a VAE *encoder* the :class:`~flowrl.models.base.FlowModel` contract does not have, and an
8-bit PNG round trip would not give back the sampled latent; the latents replay exactly what was sampled.

A store is a folder::

    rollouts.json              what it holds (``format: flowrl-rollouts``, ``version: 1``): the model (family,
                               adapter, path, latent shape, size, ``identity``: :func:`model_identity`), the
                               sampler (steps, solver, guidance, seed), the checkpoint sampled from (or null),
                               ``images_per_prompt`` K, ``prompts`` [P], the reward terms, and ``parts``: each
                               file's rows [a, b), size and sha256
    part-00000.safetensors     rows [a, b): ``latents`` fp32 [n, *latent_shape], ``seed`` int64 [n], ``reward``
    …                          fp32 [n] (NaN: not scored or failed), ``reward/<term>`` fp32 [n]
    prompts.txt                the stored prompts, one per line (``prompts.train`` may point at it)

Rows are prompt-major: prompt p's K samples are rows p·K … p·K + K − 1. Written into a temporary folder and
renamed into place (:func:`flowrl.run.rollout_store.write_store`: an output folder of ``flowrl rollouts``); read lazily
(:class:`RolloutStore`: the metadata, seeds and rewards at
once, latents by rows, memory-mapped; each part's checksum verified the first time its latents are read).
"""

from __future__ import annotations

import hashlib
import json
import warnings
from pathlib import Path
from typing import Any

import torch

from flowrl.errors import ConfigError
from flowrl.models.base import FlowModel
from flowrl.models.module_group import diffusers_config

FORMAT, VERSION = "flowrl-rollouts", 1
META_FILE, PROMPTS_FILE = "rollouts.json", "prompts.txt"
COMMAND = "flowrl rollouts"
PART_BYTES = 512 * 2**20  # latents per part file (about): a store of any size is read and written part by part


def adapter_name(model: FlowModel) -> str:
    """What a store records as the adapter it was sampled with: the model's family, else its adapter's class name."""
    return model.family or type(model).__name__


IDENTITY_KEYS = ("family", "config_sha256", "weights")  # what must match; the path is named, not compared
SAMPLE_BYTES = 1 << 16  # bytes read at three places of each weight file for its fingerprint


def model_identity(model: FlowModel) -> dict[str, Any]:
    """What identifies the model a store was sampled with (recorded in ``rollouts.json``, compared at load):
    ``family`` (the adapter's), ``path`` (the hub id or folder its pipeline was loaded from, a local folder resolved;
    None for a pipeline built in process), ``config_sha256`` (the transformer's config, its bookkeeping keys
    ``_name_or_path``/``_diffusers_version`` left out) and ``weights``: from a local folder, ``kind: files`` with a
    sha256 over the transformer folder's files' names, sizes and three 64 KiB samples of their bytes (a fine-tune of
    the same architecture has the same names and sizes); else ``kind: parameter shapes`` with a sha256 over the
    transformer's parameter shapes (a LoRA's left out). Cheap: no weight file is read whole."""
    module = model.trainable
    config = dict(diffusers_config(module) or {})  # a diffusers model's config (a FrozenDict; a group: its lead's)
    kept = {k: v for k, v in config.items() if k not in ("_name_or_path", "_diffusers_version", "_use_default_values")}
    folder = Path(str(config.get("_name_or_path") or ""))
    if str(folder) not in ("", ".") and folder.is_dir():
        weights = {"kind": "files", "sha256": _files_fingerprint(folder)}
    else:
        shapes = sorted(
            [list(p.shape) for name, p in module.named_parameters() if "lora_" not in name], key=lambda s: (len(s), s)
        )
        weights = {"kind": "parameter shapes", "sha256": _sha256_text(json.dumps(shapes))}
    source = getattr(model.pipe, "name_or_path", None)  # a diffusers pipeline's: what from_pretrained was given
    if source is not None and Path(str(source)).is_dir():
        source = str(Path(str(source)).resolve())
    return {
        "family": adapter_name(model),
        "path": None if source is None else str(source),
        "config_sha256": _sha256_text(json.dumps(kept, sort_keys=True, default=str)),
        "weights": weights,
    }


def describe_identity(identity: dict[str, Any]) -> str:
    """One line naming ``identity`` (:func:`model_identity`): family, path and the first 12 hex of each hash."""
    weights = identity.get("weights") or {}
    return (
        f"family {identity.get('family')!r}, path {identity.get('path')!r}, config_sha256 "
        f"{str(identity.get('config_sha256'))[:12]}, weights ({weights.get('kind')}) {str(weights.get('sha256'))[:12]}"
    )


def _sha256_text(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def _files_fingerprint(folder: Path) -> str:
    """sha256 over ``folder``'s files (not hidden ones): each name, size and its bytes at the start, middle and end
    (:data:`SAMPLE_BYTES` each)."""
    h = hashlib.sha256()
    for file in sorted(p for p in folder.iterdir() if p.is_file() and not p.name.startswith(".")):
        size = file.stat().st_size
        h.update(f"{file.name}\0{size}\0".encode())
        with open(file, "rb") as f:
            for offset in sorted({0, max(0, size // 2 - SAMPLE_BYTES // 2), max(0, size - SAMPLE_BYTES)}):
                f.seek(offset)
                h.update(f.read(SAMPLE_BYTES))
    return h.hexdigest()


def sha256_of(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


class RolloutStore:
    """A store read from ``path`` (see the module docstring); every failure a :class:`ConfigError` that names ``key``
    (the setting that named the store), the path and what is accepted.

    ``prompts`` [P], ``images_per_prompt`` K, ``latent_shape``, ``seed`` int64 [N], ``reward`` fp32 [N],
    ``meta`` (the parsed ``rollouts.json``); :meth:`rows_of` a prompt's rows, :meth:`latents` rows' latents."""

    def __init__(self, path: str | Path, key: str = "rollout.source"):
        self.path, self.key = Path(path), key
        self.where = f"{key}={str(path)!r}"
        meta_file = self.path / META_FILE
        if not self.path.is_dir():
            raise ConfigError(
                f"{self.where}: no rollout store at {self.path.resolve()} (not a folder); accepted: a "
                f"folder written by `{COMMAND} CONFIG --out FOLDER`"
            )
        try:
            self.meta = json.loads(meta_file.read_text())
        except (OSError, ValueError) as e:
            raise ConfigError(
                f"{self.where}: {meta_file} cannot be read as a rollout store's metadata ({e}); accepted: "
                f"a folder written by `{COMMAND}`"
            ) from None
        self._check_meta(meta_file)
        m = self.meta
        self.prompts: list[str] = list(m["prompts"])
        self.images_per_prompt = int(m["images_per_prompt"])
        self.latent_shape = tuple(int(d) for d in m["model"]["latent_shape"])
        self.parts: list[dict[str, Any]] = list(m["parts"])
        self._verified: set[str] = set()
        self._unidentified_warned = False
        seeds, rewards = [], []
        for part in self.parts:
            seed, reward = self._small_tensors(part)
            seeds.append(seed)
            rewards.append(reward)
        self.seed = torch.cat(seeds) if seeds else torch.zeros(0, dtype=torch.long)
        self.reward = torch.cat(rewards) if rewards else torch.zeros(0)
        self._rows: dict[str, list[int]] = {}
        for p, prompt in enumerate(self.prompts):
            self._rows.setdefault(prompt, []).extend(
                range(p * self.images_per_prompt, (p + 1) * self.images_per_prompt)
            )

    def _check_meta(self, meta_file: Path) -> None:
        m = self.meta
        if not isinstance(m, dict) or m.get("format") != FORMAT:
            raise ConfigError(
                f"{self.where}: {meta_file} is not a rollout store's metadata (format "
                f"{m.get('format') if isinstance(m, dict) else None!r}, expected {FORMAT!r})"
            )
        if m.get("version") != VERSION:
            raise ConfigError(
                f"{self.where}: {meta_file} is version {m.get('version')!r} of the store format; this "
                f"flowrl reads version {VERSION}: write the store again with `{COMMAND}`"
            )
        try:
            rows = len(m["prompts"]) * int(m["images_per_prompt"])
            spans = [tuple(p["rows"]) for p in m["parts"]]
            _ = (m["model"]["latent_shape"], m["model"]["adapter"], m["sampler"])
        except (KeyError, TypeError, ValueError) as e:
            raise ConfigError(
                f"{self.where}: {meta_file} lacks {e} (a damaged or foreign file); write the store again "
                f"with `{COMMAND}`"
            ) from None
        ends = [0] + [b for _, b in spans]
        if [a for a, _ in spans] != ends[:-1] or ends[-1] != rows or int(m.get("rows", -1)) != rows:
            raise ConfigError(
                f"{self.where}: {meta_file}'s parts cover rows {spans}, not 0…{rows} for "
                f"{len(m['prompts'])} prompts × {m['images_per_prompt']} images (damaged)"
            )

    def _part_file(self, part: dict[str, Any]) -> Path:
        file = self.path / str(part["file"])
        if Path(part["file"]).name != part["file"] or not file.is_file():
            raise ConfigError(f"{self.where}: part {part['file']!r} listed in {self.path / META_FILE} is missing")
        if file.stat().st_size != int(part["bytes"]):
            raise ConfigError(
                f"{self.where}: {file} holds {file.stat().st_size} bytes, {META_FILE} says "
                f"{part['bytes']} (truncated or replaced); write the store again with `{COMMAND}`"
            )
        return file

    def _small_tensors(self, part: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
        """(seed [n], reward [n]) of ``part``, its tensors' names and shapes checked against the metadata."""
        from safetensors import SafetensorError, safe_open

        file = self._part_file(part)
        a, b = part["rows"]
        try:
            with safe_open(str(file), "pt") as f:
                shape = tuple(f.get_slice("latents").get_shape())
                seed, reward = f.get_tensor("seed"), f.get_tensor("reward")
        except (SafetensorError, OSError, KeyError, RuntimeError) as e:
            raise ConfigError(
                f"{self.where}: {file} cannot be read ({str(e).splitlines()[0][:160]}); write the store "
                f"again with `{COMMAND}`"
            ) from None
        if shape != (b - a, *self.latent_shape) or tuple(seed.shape) != (b - a,) or tuple(reward.shape) != (b - a,):
            raise ConfigError(
                f"{self.where}: {file} holds latents {list(shape)} (seed {list(seed.shape)}), "
                f"{META_FILE} says {[b - a, *self.latent_shape]} (damaged)"
            )
        return seed.long(), reward.float()

    @property
    def rows(self) -> int:
        return len(self.prompts) * self.images_per_prompt

    @property
    def fingerprint(self) -> str:
        """What identifies the stored samples: a hash of the parts' checksums (a resumed run checks it)."""
        return hashlib.sha256("".join(p["sha256"] for p in self.parts).encode()).hexdigest()[:16]

    def rows_of(self, prompt: str) -> list[int]:
        """The store's rows of ``prompt`` (every group written for it, in order); a ConfigError naming the prompt
        and the store when it has none."""
        rows = self._rows.get(prompt)
        if rows is None:
            shown = prompt if len(prompt) <= 80 else prompt[:77] + "..."
            raise ConfigError(
                f"{self.where} holds no samples of the prompt {shown!r} (drawn from prompts.train); "
                f"accepted: the store's {len(self._rows)} prompts (listed in "
                f"{self.path / PROMPTS_FILE}: set prompts.train to that file)"
            )
        return rows

    def latents(self, rows: torch.Tensor) -> torch.Tensor:
        """Latents fp32 [n, *latent_shape] of store ``rows`` [n], in that order (each part read memory-mapped; its
        checksum verified the first time)."""
        from safetensors import safe_open

        rows = torch.as_tensor(rows, dtype=torch.long).reshape(-1)
        out = torch.empty((rows.numel(), *self.latent_shape))
        for part in self.parts:
            a, b = part["rows"]
            mine = torch.nonzero((rows >= a) & (rows < b)).flatten()
            if not mine.numel():
                continue
            file = self._part_file(part)
            if part["file"] not in self._verified:
                if sha256_of(file) != part["sha256"]:
                    raise ConfigError(
                        f"{self.where}: {file} does not match its sha256 in {META_FILE} (damaged); write "
                        f"the store again with `{COMMAND}`"
                    )
                self._verified.add(part["file"])
            with safe_open(str(file), "pt") as f:
                block = f.get_slice("latents")
                for i in mine.tolist():
                    r = int(rows[i]) - a
                    out[i] = block[r : r + 1][0].float()
        return out

    def check_model(self, model: FlowModel) -> None:
        """Refuse a model whose latents differ from the store's (another family, size or VAE), or another model with
        the same latents (:func:`model_identity`: the family, the transformer's config or its weights differ): a
        ConfigError naming both and the store. A store written before identities were recorded is warned about once
        and accepted."""
        m = self.meta["model"]
        theirs = (m["adapter"], self.latent_shape)
        ours = (adapter_name(model), tuple(int(d) for d in model.latent_shape))
        if theirs != ours:
            raise ConfigError(
                f"{self.where} holds samples of model family {m.get('family')!r} (adapter {theirs[0]!r}) "
                f"with latents {list(theirs[1])}, but this run's model is adapter {ours[0]!r} with latents "
                f"{list(ours[1])}; accepted: a store written with this run's model (`{COMMAND} CONFIG "
                "--out FOLDER` with the run's config)"
            )
        recorded = m.get("identity")
        if not isinstance(recorded, dict):
            if not self._unidentified_warned:
                self._unidentified_warned = True
                warnings.warn(
                    f"{self.where} records no model identity (written by an earlier flowrl): it cannot be checked "
                    f"to hold samples of this run's model ({describe_identity(model_identity(model))}); write it "
                    f"again with `{COMMAND}` to have it checked",
                    RuntimeWarning,
                    stacklevel=2,
                )
            return
        current = model_identity(model)
        differs = [k for k in IDENTITY_KEYS if recorded.get(k) != current.get(k)]
        if differs:
            raise ConfigError(
                f"{self.where} holds samples of another model than this run's ({', '.join(differs)} differ): the "
                f"store's was {describe_identity(recorded)}; this run's is {describe_identity(current)}. Accepted: "
                f"a store written with this run's model (`{COMMAND} CONFIG --out FOLDER` with the run's config)"
            )
