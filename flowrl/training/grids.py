"""Sample grids a person can read: each image (a video's frames) over its prompt and, where scored, its mark
(PASS/FAIL or the score); plain grids and single samples as PNGs, videos as animated GIFs. Written by the
held-out evals (:class:`~flowrl.training.evaluation.HeldOutEval`), ``flowrl sample`` and ``flowrl eval``."""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

import torch

from flowrl.models.image_prompts import prompt_label
from flowrl.rollout.scoring import components_of


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
    nrow = nrow or max(1, int(round(n**0.5)))
    ncol = (n + nrow - 1) // nrow
    pad = 2
    out = []
    for frame in images.unbind(1) if video else [images]:
        grid = torch.ones(3, ncol * (h + pad) + pad, nrow * (w + pad) + pad) * 0.5
        for i in range(n):
            r, c = divmod(i, nrow)
            grid[:, pad + r * (h + pad) : pad + r * (h + pad) + h, pad + c * (w + pad) : pad + c * (w + pad) + w] = (
                frame[i].clamp(0, 1)
            )
        img = _pil(grid)
        out.append(img.resize((img.width * scale, img.height * scale), Image.NEAREST) if scale > 1 else img)
    return save_frames(out, path, video)


def grid_scores(images: torch.Tensor, prompts: Sequence[str], reward) -> torch.Tensor:
    """Each image's score [N] from ``reward``'s first term (what a labelled grid marks)."""
    return next(iter(components_of(reward, images, list(prompts), {}).values())).float()


def mark(score: float, binary: bool) -> tuple[str, tuple[int, int, int]]:
    """(text, RGB colour) of a score's mark: PASS in green / FAIL in red for a pass/fail reward, else the score in
    black (``nan`` for an image the reward could not score)."""
    if binary:
        return ("PASS", (0, 140, 0)) if score == 1 else ("FAIL", (200, 0, 0))
    return f"{score:.3f}", (0, 0, 0)


def labelled_grid(
    images: torch.Tensor, prompts: Sequence[str], scores: torch.Tensor | None = None, ncol: int = 4, scale: int = 4
) -> list:
    """The frames (PIL images) of a grid a person can read: each image [N, 3, H, W] in [0, 1] (``scale``× nearest
    upsampling) over its prompt and, with ``scores`` [N], its mark (:func:`mark`: PASS/FAIL when every score is 0
    or 1, else the score). Videos [N, F, 3, H, W]: frame t is that grid of every video's frame t, same labels."""
    from PIL import Image, ImageDraw, ImageFont

    prompts = list(prompts)[: images.shape[0]]
    binary = scores is not None and bool(((scores == 0) | (scores == 1)).all())
    font = ImageFont.load_default()
    n, h, w = images.shape[0], images.shape[-2], images.shape[-1]
    cell_w, text_h, pad = max(w * scale, 128), 38, 6
    rows = (n + ncol - 1) // ncol
    out = []
    for frame in images.unbind(1) if images.ndim == 5 else [images]:
        canvas = Image.new(
            "RGB", (ncol * (cell_w + pad) + pad, rows * (h * scale + text_h + pad) + pad), (255, 255, 255)
        )
        draw = ImageDraw.Draw(canvas)
        for i in range(n):
            r, c = divmod(i, ncol)
            x0, y0 = pad + c * (cell_w + pad), pad + r * (h * scale + text_h + pad)
            canvas.paste(_pil(frame[i]).resize((w * scale, h * scale), Image.NEAREST), (x0, y0))
            if scores is not None:
                text, colour = mark(float(scores[i]), binary)
                draw.text((x0, y0 + h * scale + 1), text, fill=colour, font=font)
            label = "\n".join(_wrap(prompt_label(prompts[i]), cell_w // 6)[:2])
            draw.text((x0, y0 + h * scale + 13), label, fill=(0, 0, 0), font=font)
        out.append(canvas)
    return out


def save_labelled_grid(
    images: torch.Tensor,
    prompts: Sequence[str],
    reward,
    path: Path,
    ncol: int = 4,
    scale: int = 4,
    scores: torch.Tensor | None = None,
) -> Path | None:
    """Write :func:`labelled_grid` of images [N, 3, H, W] (a PNG at ``path``) or videos [N, F, 3, H, W] (an animated
    GIF, suffix ``.gif``): each image over its prompt and its mark from ``scores`` [N], else from ``reward``'s
    first term (:func:`grid_scores`; a green PASS / red FAIL when that term is pass/fail, e.g. the shapes checker in
    ``strict`` mode, else the score); with neither, the prompts alone. Returns the path written (None for no
    images)."""
    if images.shape[0] == 0:
        return None
    if scores is None and reward is not None:
        scores = grid_scores(images, prompts, reward)
    return save_frames(labelled_grid(images, prompts, scores, ncol, scale), path, images.ndim == 5)


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
