"""Held-out evaluation with ODE sampling, and sample grids: PNGs of images, animated GIFs of videos."""
from __future__ import annotations

from pathlib import Path
from typing import NamedTuple, Sequence

import torch
from tqdm.auto import tqdm

from flowrl.image_prompts import prompt_label, prompt_texts
from flowrl.models.base import FlowModel
from flowrl.rollout.sampling import ode_sample
from flowrl.rollout.seeding import derive_seed
from flowrl.scoring import components_of


# ---- guidance ---------------------------------------------------------------------------------
def resolve_guidance(model_default: float, *preferred: float | None) -> float:
    """The guidance to sample with: the first of ``preferred`` that is set, in precedence order (e.g.
    ``--guidance``, ``eval.guidance``, the rollouts' guidance), else the model's default."""
    return float(next((g for g in preferred if g is not None), model_default))


def eval_guidances(eval_guidance: float | None, policy_guidance: float | None, model_default: float,
                   default_pass: bool) -> list[tuple[str, float]]:
    """(metric prefix, guidance) of each pass of an eval: ``eval`` at ``eval.guidance``, else the guidance the
    policy samples with, else the model's default; with ``default_pass`` also ``eval_default`` at the
    model's default guidance when it differs."""
    main = resolve_guidance(model_default, eval_guidance, policy_guidance)
    out = [("eval", main)]
    if default_pass and float(model_default) != main:
        out.append(("eval_default", float(model_default)))
    return out


# ---- seeds and metrics ------------------------------------------------------------------------
def prompt_seeds(seed: int, indices: Sequence[int], seed_set: int = 0) -> list[int]:
    """The seed of image ``seed_set`` of each held-out prompt, by its index in the whole prompt list (so a
    prompt draws the same image whichever process evaluates it; set 0 is the historical one)."""
    if seed_set == 0:
        return [derive_seed(seed, "eval", i) for i in indices]
    return [derive_seed(seed, "eval", i, seed_set) for i in indices]


def eval_seeds(seed: int, n: int, seed_set: int = 0) -> list[int]:
    """Fixed per-image seeds of an evaluation of ``n`` prompts (the same at every eval, so grids compare):
    :func:`prompt_seeds` of prompts 0 … n−1."""
    return prompt_seeds(seed, range(n), seed_set)


class Evaluated(NamedTuple):
    """One process's eval: ``metrics`` key → value; ``weights`` key → the number of items behind a mean (a
    key without one is a count, added over processes); ``images`` [K, 3, H, W] (videos [K, F, 3, H, W]) for
    the grid."""

    metrics: dict[str, float]
    weights: dict[str, float]
    images: torch.Tensor


def term_weights(summary: dict[str, float], n_images: int) -> dict[str, float]:
    """The weight of each mean of a reward term's ``evaluate`` summary: ``<m>/<sub>`` by the count
    ``n/<sub>`` when the summary has it, other means by ``n`` (else ``n_images``); counts (``n``,
    ``n/<sub>``) get none."""
    base = float(summary.get("n", n_images))
    out = {}
    for key in summary:
        if key == "n" or key.startswith("n/"):
            continue
        sub = key.split("/", 1)[1] if "/" in key else None
        out[key] = float(summary[f"n/{sub}"]) if sub is not None and f"n/{sub}" in summary else base
    return out


def score_images(images: torch.Tensor, prompts: Sequence[str], reward, prefix: str) -> tuple[dict, dict]:
    """(metrics, weights) of images [N, 3, H, W] (or videos [N, F, 3, H, W]) of ``prompts``: the mean of each
    reward term (``<prefix>/<name>_mean``, weight N; an image term scores a video's frames, averaged) and the
    numeric summary of terms that offer ``evaluate`` (images only: not asked of an image term given videos)."""
    metrics: dict[str, float] = {}
    weights: dict[str, float] = {}
    for name, scores in components_of(reward, images, prompts, {}).items():
        metrics[f"{prefix}/{name}_mean"] = float(scores.mean())
        weights[f"{prefix}/{name}_mean"] = float(len(prompts))
    for term in reward.rewards:
        if hasattr(term, "evaluate") and (images.ndim == 4 or term.modality != "image"):
            summary = {k: float(v) for k, v in term.evaluate(images, prompt_texts(prompts)).items()
                       if isinstance(v, (int, float))}
            metrics.update({f"{prefix}/{term.name}/{k}": v for k, v in summary.items()})
            weights.update({f"{prefix}/{term.name}/{k}": w for k, w in term_weights(summary, len(prompts)).items()})
    return metrics, weights


@torch.no_grad()
def evaluate(model: FlowModel, prompts: Sequence[str], reward, *, steps: int, guidance: float | None, seed: int,
             max_batch: int = 64, keep_images: int = 0, images_per_prompt: int = 1, prefix: str = "eval",
             progress: bool = False, indices: Sequence[int] | None = None) -> Evaluated:
    """Mean of each reward term (``<prefix>/<name>_mean``) and per-task breakdowns of rewards that offer
    ``evaluate(images, prompts)``, over ``images_per_prompt`` images of every prompt (seed sets 0, 1, …:
    the standard error shrinks by √k), with the weight of each mean, and the first ``keep_images`` images
    [K, 3, H, W] (videos [K, F, 3, H, W]) of seed set 0. ``indices``: each prompt's index in the whole held-out list, which picks its
    seeds (default 0, 1, …). ``progress``: a bar counting the images drawn."""
    prompts = list(prompts)
    indices = list(range(len(prompts)) if indices is None else indices)
    if len(indices) != len(prompts):
        raise ValueError(f"evaluate: {len(prompts)} prompts but {len(indices)} indices")
    shown = f"guidance {guidance:g}" if guidance is not None else "the model's guidance"
    bar = tqdm(total=len(prompts) * images_per_prompt, unit="image", desc=f"{prefix} at {shown}", disable=not progress,
               leave=False)
    chunks = []
    for k in range(images_per_prompt):
        seeds = prompt_seeds(seed, indices, k)
        for start in range(0, len(prompts), max_batch):
            chunks.append(ode_sample(model, prompts[start:start + max_batch], seeds[start:start + max_batch], steps,
                                     guidance, max_batch))
            bar.update(len(chunks[-1]))
    bar.close()
    images = torch.cat(chunks)
    metrics, weights = score_images(images, prompts * images_per_prompt, reward, prefix)
    return Evaluated(metrics, weights, images[:min(keep_images, len(prompts))])


def _pil(image: torch.Tensor):
    """A PIL RGB image of one image [3, H, W] in [0, 1] (rounded to 8 bits)."""
    from PIL import Image

    return Image.fromarray((image.clamp(0, 1).permute(1, 2, 0).numpy() * 255).round().astype("uint8"))


def save_frames(frames: list, path: Path, video: bool, fps: float = 8.0) -> Path:
    """Write PIL images: one PNG at ``path`` (``video`` False), else an animated GIF of every frame, looping, at
    ``fps``, next to it with the suffix ``.gif``. Returns the path written."""
    path = path.with_suffix(".gif") if video else path
    path.parent.mkdir(parents=True, exist_ok=True)
    if video:
        frames[0].save(path, save_all=True, append_images=frames[1:], duration=round(1000 / fps), loop=0)
    else:
        frames[0].save(path)
    return path


def save_sample(sample: torch.Tensor, path: Path, fps: float = 8.0) -> Path:
    """One image [3, H, W] in [0, 1] as a PNG at ``path``, or one video [F, 3, H, W] as an animated GIF (``path``
    with the suffix ``.gif``). Returns the path written."""
    video = sample.ndim == 4
    return save_frames([_pil(frame) for frame in (sample if video else [sample])], path, video, fps)


def save_grid(images: torch.Tensor, path: Path, nrow: int | None = None, scale: int = 1) -> Path:
    """Write images [N, 3, H, W] in [0, 1] as one PNG grid (``scale``× nearest upsampling); videos
    [N, F, 3, H, W] as an animated GIF (suffix ``.gif``) whose frame t is the grid of every video's frame t.
    Returns the path written."""
    from PIL import Image

    video = images.ndim == 5
    n, h, w = images.shape[0], images.shape[-2], images.shape[-1]
    nrow = nrow or max(1, int(round(n ** 0.5)))
    ncol = (n + nrow - 1) // nrow
    pad = 2
    out = []
    for frame in (images.unbind(1) if video else [images]):
        grid = torch.ones(3, ncol * (h + pad) + pad, nrow * (w + pad) + pad) * 0.5
        for i in range(n):
            r, c = divmod(i, nrow)
            grid[:, pad + r * (h + pad): pad + r * (h + pad) + h, pad + c * (w + pad): pad + c * (w + pad) + w] = frame[i].clamp(0, 1)
        img = _pil(grid)
        out.append(img.resize((img.width * scale, img.height * scale), Image.NEAREST) if scale > 1 else img)
    return save_frames(out, path, video)


def save_labelled_grid(images: torch.Tensor, prompts: Sequence[str], reward, path: Path, ncol: int = 4,
                       scale: int = 4) -> Path | None:
    """A PNG a person can read: each image [N, 3, H, W] in [0, 1] (``scale``× nearest upsampling) over its
    prompt and its score from ``reward``'s first term — a green ✓ / red ✗ pass mark when that term is
    pass/fail (scores in {0, 1}, e.g. the shapes checker in ``strict`` mode), else the score. Videos
    [N, F, 3, H, W]: an animated GIF (suffix ``.gif``) whose frame t is that grid of every video's frame t, with
    the same labels (each video's score). Returns the path written (None for no images)."""
    from PIL import Image, ImageDraw, ImageFont

    if images.shape[0] == 0:
        return None
    prompts = list(prompts)[: images.shape[0]]
    first = next(iter(components_of(reward, images, prompts, {}).values())).float()
    binary = bool(((first == 0) | (first == 1)).all())
    font = ImageFont.load_default()
    video = images.ndim == 5
    n, h, w = images.shape[0], images.shape[-2], images.shape[-1]
    cell_w, text_h, pad = max(w * scale, 128), 38, 6
    rows = (n + ncol - 1) // ncol
    out = []
    for frame in (images.unbind(1) if video else [images]):
        canvas = Image.new("RGB", (ncol * (cell_w + pad) + pad, rows * (h * scale + text_h + pad) + pad), (255, 255, 255))
        draw = ImageDraw.Draw(canvas)
        for i in range(n):
            r, c = divmod(i, ncol)
            x0, y0 = pad + c * (cell_w + pad), pad + r * (h * scale + text_h + pad)
            canvas.paste(_pil(frame[i]).resize((w * scale, h * scale), Image.NEAREST), (x0, y0))
            score = float(first[i])
            if binary:
                mark, colour = ("PASS", (0, 140, 0)) if score == 1 else ("FAIL", (200, 0, 0))
            else:
                mark, colour = f"{score:.3f}", (0, 0, 0)
            draw.text((x0, y0 + h * scale + 1), mark, fill=colour, font=font)
            label = "\n".join(_wrap(prompt_label(prompts[i]), cell_w // 6)[:2])
            draw.text((x0, y0 + h * scale + 13), label, fill=(0, 0, 0), font=font)
        out.append(canvas)
    return save_frames(out, path, video)


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
    """The run's evals on its held-out prompts (``eval.*``), this process's share (every ``world``-th prompt,
    each drawn from the seeds of its index in the whole list, so any number of processes draws the same
    images): at ``eval.guidance``, else the guidance the policy samples with (``eval/…``) and, outside the
    periodic evals, at the model's default guidance when it differs (``eval_default/…``). Metrics are
    reduced over processes in one :meth:`~flowrl.process_group.ProcessGroup.reduce_means` (count-weighted
    means, counts added), equal to one process's over all the prompts; labelled grids in ``samples/``."""

    def __init__(self, section, model: FlowModel, prompts: Sequence[str], reward, group, samples: Path | None,
                 policy_guidance: float | None, progress: bool = False):
        self.e, self.model, self.reward, self.group, self.samples = section, model, reward, group, samples
        self.progress = progress and group.is_main  # a bar of the images drawn (the main process's share)
        prompts = list(prompts)
        self.indices = list(range(group.rank, len(prompts), group.world))  # this process's, in the whole list
        self.prompts = [prompts[i] for i in self.indices]
        self.any = bool(prompts)
        self.policy_guidance = policy_guidance

    def guidances(self, periodic: bool = False) -> list[tuple[str, float]]:
        """(metric prefix, guidance) of an eval (:func:`eval_guidances`); ``eval_default`` with
        ``eval.default_guidance``, not at the ``periodic`` evals of ``eval.every``."""
        return eval_guidances(self.e.guidance, self.policy_guidance, self.model.guidance,
                              default_pass=bool(self.e.default_guidance) and not periodic)

    def run(self, periodic: bool = False) -> tuple[dict[str, float], dict[str, torch.Tensor]]:
        """(metrics over every process, this process's grid images [K, 3, H, W] (videos [K, F, 3, H, W]) per
        prefix) of one eval; every process must call it (a process without prompts takes part in the reduction only)."""
        if not self.any:
            return {}, {}
        e = self.e
        self.model.trainable.eval()
        metrics: dict[str, float] = {}
        weights: dict[str, float] = {}
        grids: dict[str, torch.Tensor] = {}
        for prefix, guidance in self.guidances(periodic):
            if self.prompts:
                found = evaluate(self.model, self.prompts, self.reward, steps=e.steps, guidance=guidance, seed=e.seed,
                                 max_batch=e.batch_size, keep_images=e.grid_prompts,
                                 images_per_prompt=e.images_per_prompt, prefix=prefix, progress=self.progress,
                                 indices=self.indices)
                metrics.update(found.metrics)
                weights.update(found.weights)
                grids[prefix] = found.images
        out = self.group.reduce_means(metrics, weights)
        out.update({f"{prefix}/guidance": guidance for prefix, guidance in self.guidances(periodic)})
        return out, grids

    def __call__(self, step: int, tag: str | None = None) -> dict[str, float]:
        """Metrics of one eval (``tag``: ``before``/``after``; None: a periodic one, named by ``step``); the
        main process writes each pass's labelled grid to ``samples/`` (a PNG; for videos an animated GIF)."""
        out, grids = self.run(periodic=tag is None)
        if self.group.is_main and self.samples is not None:
            for prefix, images in grids.items():
                if images.numel():
                    name = f"{tag or f'step-{step:06d}'}{'' if prefix == 'eval' else '_' + prefix.split('_', 1)[1]}"
                    save_labelled_grid(images, self.prompts, self.reward, self.samples / f"{name}.png")
        return out
