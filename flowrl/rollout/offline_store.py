"""Rollout stores: a fixed set of clean samples, written once and replayed by ``rollout.plan: offline``
(:mod:`flowrl.rollout.offline`; GDRO trains fully offline on such a set, arXiv 2601.02036).

What a store holds, per prompt: K clean latents (the model's own latent space, fp32), the root seed of each
(``model.noise([seed])`` rebuilds its x_T) and its reward when written. Latents, not images: an image read back
from a PNG would need a VAE *encoder* the :class:`~flowrl.models.base.FlowModel` contract does not have, and an
8-bit PNG round trip would not give back the sampled latent; the latents replay exactly what was sampled.

A store is a folder::

    rollouts.json              what it holds (``format: flowrl-rollouts``, ``version: 1``): the model (family,
                               adapter, path, latent shape, size), the sampler (steps, solver, guidance, seed), the
                               checkpoint sampled from (or null), ``images_per_prompt`` K, ``prompts`` [P], the
                               reward terms, and ``parts``: each file's rows [a, b), size and sha256
    part-00000.safetensors     rows [a, b): ``latents`` fp32 [n, *latent_shape], ``seed`` int64 [n], ``reward``
    …                          fp32 [n] (NaN: not scored or failed), ``reward/<term>`` fp32 [n]
    prompts.txt                the stored prompts, one per line (``prompts.train`` may point at it)

Rows are prompt-major: prompt p's K samples are rows p·K … p·K + K − 1. Written into a temporary folder and
renamed into place (:func:`write_store`); read lazily (:class:`RolloutStore`: the metadata, seeds and rewards at
once, latents by rows, memory-mapped; each part's checksum verified the first time its latents are read).
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path
from typing import Any, Callable

import torch

from flowrl.errors import ConfigError

FORMAT, VERSION = "flowrl-rollouts", 1
META_FILE, PROMPTS_FILE = "rollouts.json", "prompts.txt"
COMMAND = "flowrl rollouts"
PART_BYTES = 512 * 2**20  # latents per part file (about): a store of any size is read and written part by part


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
            raise ConfigError(f"{self.where}: no rollout store at {self.path.resolve()} (not a folder); accepted: a "
                              f"folder written by `{COMMAND} CONFIG --out FOLDER`")
        try:
            self.meta = json.loads(meta_file.read_text())
        except (OSError, ValueError) as e:
            raise ConfigError(f"{self.where}: {meta_file} cannot be read as a rollout store's metadata ({e}); accepted: "
                              f"a folder written by `{COMMAND}`") from None
        self._check_meta(meta_file)
        m = self.meta
        self.prompts: list[str] = list(m["prompts"])
        self.images_per_prompt = int(m["images_per_prompt"])
        self.latent_shape = tuple(int(d) for d in m["model"]["latent_shape"])
        self.parts: list[dict[str, Any]] = list(m["parts"])
        self._verified: set[str] = set()
        seeds, rewards = [], []
        for part in self.parts:
            seed, reward = self._small_tensors(part)
            seeds.append(seed)
            rewards.append(reward)
        self.seed = torch.cat(seeds) if seeds else torch.zeros(0, dtype=torch.long)
        self.reward = torch.cat(rewards) if rewards else torch.zeros(0)
        self._rows: dict[str, list[int]] = {}
        for p, prompt in enumerate(self.prompts):
            self._rows.setdefault(prompt, []).extend(range(p * self.images_per_prompt, (p + 1) * self.images_per_prompt))

    def _check_meta(self, meta_file: Path) -> None:
        m = self.meta
        if not isinstance(m, dict) or m.get("format") != FORMAT:
            raise ConfigError(f"{self.where}: {meta_file} is not a rollout store's metadata (format "
                              f"{m.get('format') if isinstance(m, dict) else None!r}, expected {FORMAT!r})")
        if m.get("version") != VERSION:
            raise ConfigError(f"{self.where}: {meta_file} is version {m.get('version')!r} of the store format; this "
                              f"flowrl reads version {VERSION}: write the store again with `{COMMAND}`")
        try:
            rows = len(m["prompts"]) * int(m["images_per_prompt"])
            spans = [tuple(p["rows"]) for p in m["parts"]]
            _ = (m["model"]["latent_shape"], m["model"]["adapter"], m["sampler"])
        except (KeyError, TypeError, ValueError) as e:
            raise ConfigError(f"{self.where}: {meta_file} lacks {e} (a damaged or foreign file); write the store again "
                              f"with `{COMMAND}`") from None
        ends = [0] + [b for _, b in spans]
        if [a for a, _ in spans] != ends[:-1] or ends[-1] != rows or int(m.get("rows", -1)) != rows:
            raise ConfigError(f"{self.where}: {meta_file}'s parts cover rows {spans}, not 0…{rows} for "
                              f"{len(m['prompts'])} prompts × {m['images_per_prompt']} images (damaged)")

    def _part_file(self, part: dict[str, Any]) -> Path:
        file = self.path / str(part["file"])
        if Path(part["file"]).name != part["file"] or not file.is_file():
            raise ConfigError(f"{self.where}: part {part['file']!r} listed in {self.path / META_FILE} is missing")
        if file.stat().st_size != int(part["bytes"]):
            raise ConfigError(f"{self.where}: {file} holds {file.stat().st_size} bytes, {META_FILE} says "
                              f"{part['bytes']} (truncated or replaced); write the store again with `{COMMAND}`")
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
            raise ConfigError(f"{self.where}: {file} cannot be read ({str(e).splitlines()[0][:160]}); write the store "
                              f"again with `{COMMAND}`") from None
        if shape != (b - a, *self.latent_shape) or tuple(seed.shape) != (b - a,) or tuple(reward.shape) != (b - a,):
            raise ConfigError(f"{self.where}: {file} holds latents {list(shape)} (seed {list(seed.shape)}), "
                              f"{META_FILE} says {[b - a, *self.latent_shape]} (damaged)")
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
            raise ConfigError(f"{self.where} holds no samples of the prompt {shown!r} (drawn from prompts.train); "
                              f"accepted: the store's {len(self._rows)} prompts (listed in "
                              f"{self.path / PROMPTS_FILE}: set prompts.train to that file)")
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
                    raise ConfigError(f"{self.where}: {file} does not match its sha256 in {META_FILE} (damaged); write "
                                      f"the store again with `{COMMAND}`")
                self._verified.add(part["file"])
            with safe_open(str(file), "pt") as f:
                block = f.get_slice("latents")
                for i in mine.tolist():
                    r = int(rows[i]) - a
                    out[i] = block[r:r + 1][0].float()
        return out

    def check_model(self, model) -> None:
        """Refuse a model whose latents differ from the store's (another family, size or VAE): a ConfigError naming
        both."""
        m = self.meta["model"]
        theirs = (m["adapter"], self.latent_shape)
        ours = (getattr(model, "family", type(model).__name__), tuple(int(d) for d in model.latent_shape))
        if theirs != ours:
            raise ConfigError(f"{self.where} holds samples of model family {m.get('family')!r} (adapter {theirs[0]!r}) "
                              f"with latents {list(theirs[1])}, but this run's model is adapter {ours[0]!r} with latents "
                              f"{list(ours[1])}; accepted: a store written with this run's model (`{COMMAND} CONFIG "
                              "--out FOLDER` with the run's config)")


# ---- writing ---------------------------------------------------------------------------------------------
def write_part(folder: Path, index: int, first_row: int, latents: torch.Tensor, seed: torch.Tensor,
               components: dict[str, torch.Tensor], reward: torch.Tensor) -> dict[str, Any]:
    """``part-NNNNN.safetensors`` of rows [first_row, first_row + n) in ``folder``: ``latents`` [n, …], ``seed`` [n],
    ``reward`` [n] and each term's ``reward/<name>`` [n]; returns its entry of ``parts``."""
    from safetensors.torch import save_file

    name = f"part-{index:05d}.safetensors"
    tensors = {"latents": latents.detach().float().cpu().contiguous(), "seed": seed.long().cpu().contiguous(),
               "reward": reward.float().cpu().contiguous()}
    tensors.update({f"reward/{k}": v.float().cpu().contiguous() for k, v in components.items()})
    save_file(tensors, str(folder / name), metadata={"format": FORMAT})
    return {"file": name, "rows": [first_row, first_row + int(latents.shape[0])], "bytes": (folder / name).stat().st_size,
            "sha256": sha256_of(folder / name)}


def sample_groups(model, prompts: list[str], reward, *, images_per_prompt: int, steps: int, guidance: float,
                  seed: int, max_batch: int, group_offset: int = 0):
    """K = ``images_per_prompt`` ODE samples (Euler, ``steps``) of each of ``prompts``, decoded and scored: (latents
    [P·K, …], root seeds [P·K], combined reward [P·K], each term's scores {name: [P·K]}), prompt-major. Root seeds
    are the ODE plan's: derive_seed(seed, 0, "root", group_offset + p, j)."""
    from flowrl.rollout.base import RolloutContext
    from flowrl.rollout.chains import ODEChains
    from flowrl.training.scoring import components_of, decode

    ctx = RolloutContext(seed=seed, iteration=0, group_offset=group_offset, guidance=guidance, max_batch=max_batch)
    forest = ODEChains(group_size=images_per_prompt, steps=steps).rollout(model, prompts, ctx)
    leaves = forest.leaves()
    x0 = forest.all_latents()[leaves]
    texts = [forest.prompts[int(g)] for g in forest.group[leaves]]
    if reward is None:
        nan = torch.full((leaves.numel(),), float("nan"))
        return x0, forest.seed[leaves], nan, {}
    images = decode(model, x0, max_batch)
    components = components_of(reward, images, texts, {})
    total = reward.combine(components, forest.group[leaves]) if hasattr(reward, "combine") else next(iter(components.values()))
    return x0, forest.seed[leaves], total, components


def write_store(out: str | Path, model, prompts: list[str], reward, *, images_per_prompt: int, steps: int,
                guidance: float, seed: int, max_batch: int, model_info: dict[str, Any],
                checkpoint: str | None = None, part_bytes: int = PART_BYTES,
                progress: Callable[[int, int], None] | None = None) -> Path:
    """Sample, score and write a store of ``images_per_prompt`` samples of every prompt into ``out`` (a new or empty
    folder: :func:`~flowrl.run.outputs.check_output`, never an earlier store), through a temporary folder beside it
    renamed into place. ``model_info``: ``family`` (``model.family``), ``path`` (``model.path``); ``progress(done,
    total)`` is called after each part of prompts. Returns ``out``."""
    from flowrl.run.outputs import check_output, write_marker

    if images_per_prompt < 2:
        raise ConfigError(f"--images-per-prompt={images_per_prompt} must be >= 2 (a group ranks several samples)")
    if not prompts:
        raise ConfigError("a rollout store needs at least one prompt (prompts.train is empty)")
    target = check_output(out, COMMAND, mode="new").path
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".{target.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    per_image = 4 * max(1, int(torch.tensor(model.latent_shape).prod()))
    per_part = max(1, part_bytes // (per_image * images_per_prompt))  # prompts per part file
    chunk = max(1, min(per_part, max_batch // images_per_prompt or 1))  # prompts per sampling call
    try:
        tmp.mkdir()
        parts, terms, rewards = [], None, []
        for start in range(0, len(prompts), per_part):
            block = prompts[start:start + per_part]
            pieces = [sample_groups(model, block[a:a + chunk], reward, images_per_prompt=images_per_prompt, steps=steps,
                                    guidance=guidance, seed=seed, max_batch=max_batch, group_offset=start + a)
                      for a in range(0, len(block), chunk)]
            names = sorted(pieces[0][3])
            terms = names if terms is None else terms
            comps = {k: torch.cat([p[3][k] for p in pieces]) for k in names}
            total = torch.cat([p[2] for p in pieces])
            rewards.append(total)
            parts.append(write_part(tmp, len(parts), start * images_per_prompt, torch.cat([p[0] for p in pieces]),
                                    torch.cat([p[1] for p in pieces]), comps, total))
            if progress is not None:
                progress(min(start + per_part, len(prompts)), len(prompts))
        allr = torch.cat(rewards)
        ok = allr[torch.isfinite(allr)]
        meta = {"format": FORMAT, "version": VERSION, "written_by": COMMAND,
                "model": {"family": model_info.get("family"), "path": model_info.get("path"),
                          "adapter": getattr(model, "family", type(model).__name__),
                          "latent_shape": [int(d) for d in model.latent_shape],
                          "height": int(model.height), "width": int(model.width)},
                "sampler": {"plan": "ode", "solver": "euler", "steps": int(steps), "guidance": float(guidance),
                            "seed": int(seed)},
                "checkpoint": checkpoint, "images_per_prompt": int(images_per_prompt), "prompts": list(prompts),
                "rewards": terms or [], "reward_mean": float(ok.mean()) if ok.numel() else None,
                "rows": len(prompts) * images_per_prompt, "parts": parts}
        (tmp / META_FILE).write_text(json.dumps(meta, indent=1))
        (tmp / PROMPTS_FILE).write_text("".join(p + "\n" for p in prompts))
        write_marker(tmp, COMMAND)
        if target.exists():  # an empty folder (check_output accepted it): replaced by the written one
            target.rmdir()
        os.replace(tmp, target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return target
