"""Writing a rollout store (the format: :mod:`flowrl.rollout.offline_store`, which reads it): K ODE samples of each
prompt, decoded and scored, their latents, root seeds and rewards written part by part into a temporary folder renamed
into place, an output folder of ``flowrl rollouts`` (:mod:`flowrl.run.outputs`: new or empty, never an earlier store).

    path = write_store(out, model, prompts, reward, images_per_prompt=16, steps=10, guidance=4.5, seed=0,
                       max_batch=64, model_info={"family": cfg.model.family, "path": cfg.model.path})
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any, Callable

import torch

from flowrl.errors import ConfigError
from flowrl.models.base import FlowModel
from flowrl.rollout.base import RolloutContext
from flowrl.rollout.chains import ODEChains
from flowrl.rollout.decoding import decode
from flowrl.rollout.offline_store import (
    COMMAND,
    FORMAT,
    META_FILE,
    PART_BYTES,
    PROMPTS_FILE,
    VERSION,
    adapter_name,
    model_identity,
    sha256_of,
)
from flowrl.rollout.scoring import components_of
from flowrl.run.outputs import check_output, write_marker
from flowrl_rewards.core.port import Scorer


def write_part(
    folder: Path,
    index: int,
    first_row: int,
    latents: torch.Tensor,
    seed: torch.Tensor,
    components: dict[str, torch.Tensor],
    reward: torch.Tensor,
) -> dict[str, Any]:
    """``part-NNNNN.safetensors`` of rows [first_row, first_row + n) in ``folder``: ``latents`` [n, …], ``seed`` [n],
    ``reward`` [n] and each term's ``reward/<name>`` [n]; returns its entry of ``parts``."""
    from safetensors.torch import save_file

    name = f"part-{index:05d}.safetensors"
    tensors = {
        "latents": latents.detach().float().cpu().contiguous(),
        "seed": seed.long().cpu().contiguous(),
        "reward": reward.float().cpu().contiguous(),
    }
    tensors.update({f"reward/{k}": v.float().cpu().contiguous() for k, v in components.items()})
    save_file(tensors, str(folder / name), metadata={"format": FORMAT})
    return {
        "file": name,
        "rows": [first_row, first_row + int(latents.shape[0])],
        "bytes": (folder / name).stat().st_size,
        "sha256": sha256_of(folder / name),
    }


def sample_groups(
    model: FlowModel,
    prompts: list[str],
    reward: Scorer | None,
    *,
    images_per_prompt: int,
    steps: int,
    guidance: float,
    seed: int,
    max_batch: int,
    group_offset: int = 0,
):
    """K = ``images_per_prompt`` ODE samples (Euler, ``steps``) of each of ``prompts``, decoded and scored: (latents
    [P·K, …], root seeds [P·K], combined reward [P·K], each term's scores {name: [P·K]}), prompt-major. Root seeds
    are the ODE plan's: derive_seed(seed, 0, "root", group_offset + p, j)."""
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
    total = reward.combine(components, forest.group[leaves])
    return x0, forest.seed[leaves], total, components


def write_store(
    out: str | Path,
    model: FlowModel,
    prompts: list[str],
    reward: Scorer | None,
    *,
    images_per_prompt: int,
    steps: int,
    guidance: float,
    seed: int,
    max_batch: int,
    model_info: dict[str, Any],
    checkpoint: str | None = None,
    part_bytes: int = PART_BYTES,
    progress: Callable[[int, int], None] | None = None,
) -> Path:
    """Sample, score and write a store of ``images_per_prompt`` samples of every prompt into ``out`` (a new or empty
    folder: :func:`~flowrl.run.outputs.check_output`, never an earlier store), through a temporary folder beside it
    renamed into place. ``model_info``: ``family`` (``model.family``), ``path`` (``model.path``), recorded beside the
    model's identity (:func:`~flowrl.rollout.offline_store.model_identity`, which a run replaying the store must
    match); ``progress(done, total)`` is called after each part of prompts. Returns ``out``."""
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
            block = prompts[start : start + per_part]
            names, latents, seeds, comps, total = _sample_block(
                model, block, reward, chunk, start, images_per_prompt, steps, guidance, seed, max_batch
            )
            terms = names if terms is None else terms
            rewards.append(total)
            parts.append(write_part(tmp, len(parts), start * images_per_prompt, latents, seeds, comps, total))
            if progress is not None:
                progress(min(start + per_part, len(prompts)), len(prompts))
        allr = torch.cat(rewards)
        meta = _store_meta(
            model, model_info, prompts, images_per_prompt, steps, guidance, seed, checkpoint, terms, allr, parts
        )
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


def _sample_block(
    model: FlowModel,
    block: list[str],
    reward: Scorer | None,
    chunk: int,
    start: int,
    images_per_prompt: int,
    steps: int,
    guidance: float,
    seed: int,
    max_batch: int,
) -> tuple[list[str], torch.Tensor, torch.Tensor, dict[str, torch.Tensor], torch.Tensor]:
    """One part's prompts ``block`` (the first the ``start``-th of the store) sampled and scored ``chunk`` prompts at a
    time (:func:`sample_groups`): the reward terms' names and the part's concatenated tensors."""
    pieces = [
        sample_groups(
            model,
            block[a : a + chunk],
            reward,
            images_per_prompt=images_per_prompt,
            steps=steps,
            guidance=guidance,
            seed=seed,
            max_batch=max_batch,
            group_offset=start + a,
        )
        for a in range(0, len(block), chunk)
    ]
    names = sorted(pieces[0][3])
    comps = {k: torch.cat([p[3][k] for p in pieces]) for k in names}
    return (
        names,
        torch.cat([p[0] for p in pieces]),
        torch.cat([p[1] for p in pieces]),
        comps,
        torch.cat([p[2] for p in pieces]),
    )


def _store_meta(
    model: FlowModel,
    model_info: dict[str, Any],
    prompts: list[str],
    images_per_prompt: int,
    steps: int,
    guidance: float,
    seed: int,
    checkpoint: str | None,
    terms: list[str] | None,
    allr: torch.Tensor,
    parts: list,
) -> dict[str, Any]:
    """The store's ``meta.json``: the model (and its identity), the sampler, the prompts, the rewards and the parts."""
    ok = allr[torch.isfinite(allr)]
    return {
        "format": FORMAT,
        "version": VERSION,
        "written_by": COMMAND,
        "model": {
            "family": model_info.get("family"),
            "path": model_info.get("path"),
            "adapter": adapter_name(model),
            "latent_shape": [int(d) for d in model.latent_shape],
            "height": int(model.height),
            "width": int(model.width),
            "identity": model_identity(model),
        },
        "sampler": {
            "plan": "ode",
            "solver": "euler",
            "steps": int(steps),
            "guidance": float(guidance),
            "seed": int(seed),
        },
        "checkpoint": checkpoint,
        "images_per_prompt": int(images_per_prompt),
        "prompts": list(prompts),
        "rewards": terms or [],
        "reward_mean": float(ok.mean()) if ok.numel() else None,
        "rows": len(prompts) * images_per_prompt,
        "parts": parts,
    }
