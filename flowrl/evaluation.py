"""Held-out evaluation with ODE sampling, and PNG sample grids."""
from __future__ import annotations

from pathlib import Path
from typing import Sequence

import torch
from tqdm.auto import tqdm

from flowrl.models.base import FlowModel
from flowrl.rollout.sampling import ode_sample
from flowrl.rollout.seeding import derive_seed


def eval_seeds(seed: int, n: int, seed_set: int = 0) -> list[int]:
    """Fixed per-image seeds of an evaluation (the same at every eval, so grids compare): image i of seed
    set ``seed_set`` (set 0 is the historical one; each further set draws a new image per prompt)."""
    if seed_set == 0:
        return [derive_seed(seed, "eval", i) for i in range(n)]
    return [derive_seed(seed, "eval", i, seed_set) for i in range(n)]


@torch.no_grad()
def evaluate(model: FlowModel, prompts: Sequence[str], reward, *, steps: int, guidance: float | None, seed: int,
             max_batch: int = 64, keep_images: int = 0, images_per_prompt: int = 1, prefix: str = "eval",
             progress: bool = False) -> tuple[dict[str, float], torch.Tensor]:
    """Mean of each reward term (``<prefix>/<name>_mean``) and per-task breakdowns of rewards that offer
    ``evaluate(images, prompts)``, over ``images_per_prompt`` images of every prompt (seed sets 0, 1, …:
    the standard error shrinks by √k), and the first ``keep_images`` images [K, 3, H, W] of seed set 0.
    ``progress``: a bar counting the images drawn."""
    prompts = list(prompts)
    shown = f"guidance {guidance:g}" if guidance is not None else "the model's guidance"
    bar = tqdm(total=len(prompts) * images_per_prompt, unit="image", desc=f"{prefix} at {shown}", disable=not progress,
               leave=False)
    chunks = []
    for k in range(images_per_prompt):
        seeds = eval_seeds(seed, len(prompts), k)
        for start in range(0, len(prompts), max_batch):
            chunks.append(ode_sample(model, prompts[start:start + max_batch], seeds[start:start + max_batch], steps,
                                     guidance, max_batch))
            bar.update(len(chunks[-1]))
    bar.close()
    images = torch.cat(chunks)
    every = prompts * images_per_prompt
    metrics: dict[str, float] = {}
    for name, scores in reward.components(images, every, {}).items():
        metrics[f"{prefix}/{name}_mean"] = float(scores.mean())
    for term in reward.rewards:
        if hasattr(term, "evaluate"):
            for k, v in term.evaluate(images, every).items():
                if isinstance(v, (int, float)):
                    metrics[f"{prefix}/{term.name}/{k}"] = float(v)
    return metrics, images[:min(keep_images, len(prompts))]


def save_grid(images: torch.Tensor, path: Path, nrow: int | None = None, scale: int = 1) -> None:
    """Write images [N, 3, H, W] in [0, 1] as one PNG grid (``scale``× nearest upsampling)."""
    from PIL import Image

    n, _, h, w = images.shape
    nrow = nrow or max(1, int(round(n ** 0.5)))
    ncol = (n + nrow - 1) // nrow
    pad = 2
    grid = torch.ones(3, ncol * (h + pad) + pad, nrow * (w + pad) + pad) * 0.5
    for i in range(n):
        r, c = divmod(i, nrow)
        grid[:, pad + r * (h + pad): pad + r * (h + pad) + h, pad + c * (w + pad): pad + c * (w + pad) + w] = images[i].clamp(0, 1)
    array = (grid.permute(1, 2, 0).numpy() * 255).round().astype("uint8")
    img = Image.fromarray(array)
    if scale > 1:
        img = img.resize((img.width * scale, img.height * scale), Image.NEAREST)
    path.parent.mkdir(parents=True, exist_ok=True)
    img.save(path)


def save_labelled_grid(images: torch.Tensor, prompts: Sequence[str], reward, path: Path, ncol: int = 4,
                       scale: int = 4) -> None:
    """A PNG a person can read: each image [N, 3, H, W] in [0, 1] (``scale``× nearest upsampling) over its
    prompt and its score from ``reward``'s first term — a green ✓ / red ✗ pass mark when that term is
    pass/fail (scores in {0, 1}, e.g. the shapes checker in ``strict`` mode), else the score."""
    from PIL import Image, ImageDraw, ImageFont

    if images.shape[0] == 0:
        return
    prompts = list(prompts)[: images.shape[0]]
    first = next(iter(reward.components(images, prompts, {}).values())).float()
    binary = bool(((first == 0) | (first == 1)).all())
    font = ImageFont.load_default()
    n, _, h, w = images.shape
    cell_w, text_h, pad = max(w * scale, 128), 38, 6
    rows = (n + ncol - 1) // ncol
    canvas = Image.new("RGB", (ncol * (cell_w + pad) + pad, rows * (h * scale + text_h + pad) + pad), (255, 255, 255))
    draw = ImageDraw.Draw(canvas)
    for i in range(n):
        r, c = divmod(i, ncol)
        x0, y0 = pad + c * (cell_w + pad), pad + r * (h * scale + text_h + pad)
        array = (images[i].clamp(0, 1).permute(1, 2, 0).numpy() * 255).round().astype("uint8")
        canvas.paste(Image.fromarray(array).resize((w * scale, h * scale), Image.NEAREST), (x0, y0))
        score = float(first[i])
        if binary:
            mark, colour = ("PASS", (0, 140, 0)) if score == 1 else ("FAIL", (200, 0, 0))
        else:
            mark, colour = f"{score:.3f}", (0, 0, 0)
        draw.text((x0, y0 + h * scale + 1), mark, fill=colour, font=font)
        draw.text((x0, y0 + h * scale + 13), "\n".join(_wrap(prompts[i], cell_w // 6)[:2]), fill=(0, 0, 0), font=font)
    path.parent.mkdir(parents=True, exist_ok=True)
    canvas.save(path)


def _wrap(text: str, width: int) -> list[str]:
    """Greedy word wrap to lines of at most ``width`` characters."""
    lines, line = [], ""
    for word in text.split():
        if line and len(line) + 1 + len(word) > width:
            lines.append(line)
            line = word
        else:
            line = f"{line} {word}".strip()
    return lines + ([line] if line else [])


class HeldOutEval:
    """The run's evals on its held-out prompts (``eval.*``), this process's share, metrics averaged over
    processes: at the guidance the policy samples with (``eval/…``) and, before and after training, at the
    model's default guidance when it differs (``eval_default/…``); labelled grids in ``samples/``."""

    def __init__(self, section, model: FlowModel, prompts: Sequence[str], reward, group, samples: Path,
                 policy_guidance: float, progress: bool = False):
        self.e, self.model, self.reward, self.group, self.samples = section, model, reward, group, samples
        self.progress = progress and group.is_main  # a bar of the images drawn (the main process's share)
        self.prompts = list(prompts)[group.rank::group.world]
        self.any = bool(prompts)
        self.policy_guidance = policy_guidance

    def guidances(self, periodic: bool = False) -> list[tuple[str, float]]:
        """(metric prefix, guidance) of an eval: ``eval`` at ``eval.guidance`` (default: the guidance the
        policy samples with) and, with ``eval.default_guidance``, ``eval_default`` at the model's default
        guidance when it differs (a CFG-free policy is also measured where the base model is used) — before
        and after training, not at the ``periodic`` evals of ``eval.every``."""
        e = self.e
        main = float(e.guidance) if e.guidance is not None else self.policy_guidance
        out = [("eval", main)]
        if e.default_guidance and not periodic and float(self.model.guidance) != main:
            out.append(("eval_default", float(self.model.guidance)))
        return out

    def __call__(self, step: int, tag: str | None = None) -> dict[str, float]:
        """Metrics of one eval (``tag``: ``before``/``after``; None: a periodic one, named by ``step``)."""
        if not self.any:
            return {}
        e = self.e
        self.model.trainable.eval()
        out: dict[str, float] = {}
        for prefix, guidance in self.guidances(periodic=tag is None):
            metrics, images = evaluate(self.model, self.prompts, self.reward, steps=e.steps, guidance=guidance,
                                       seed=e.seed + self.group.rank, max_batch=e.batch_size, keep_images=e.grid_prompts,
                                       images_per_prompt=e.images_per_prompt, prefix=prefix, progress=self.progress)
            n = len(self.prompts)
            out.update({k: self.group.sum(v * n) / self.group.sum(n) for k, v in metrics.items()})
            out[f"{prefix}/guidance"] = guidance
            if self.group.is_main and images.numel():
                name = f"{tag or f'step-{step:06d}'}{'' if prefix == 'eval' else '_' + prefix.split('_', 1)[1]}"
                save_labelled_grid(images, self.prompts, self.reward, self.samples / f"{name}.png")
        return out
