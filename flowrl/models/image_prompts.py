r"""Prompts that carry a source image: the instruction prompts of image editing (``model.family: qwen_image_edit``).

An image prompt is one string, ``"[image: PATH] INSTRUCTION"`` — e.g. ``[image: photos/dog.png] make the dog
blue`` — so it travels wherever a prompt goes unchanged: prompt files (one per line; inline lists too), the
prompt source and its checkpointed state, per-prompt seeds, grid labels, and the embedding cache, which is keyed
by the whole string and so by both the instruction and the image. ``PATH``, like a prompt file's path, is tried
from the working directory, then from the repository root. The first ``]`` ends ``PATH``: a path holding one writes
it ``\]`` (``[image: shots/a\]b.png] …`` names ``shots/a]b.png``), and a backslash before it ``\\``; any other
backslash is itself (:func:`image_prompt` writes these escapes).

Every image is read by one function, :func:`rgb_image` (a prompt's source here, the reward server's request images,
``flowrl sample --reward``'s sources through :func:`reward_inputs`): 8-bit RGB by the image's own range, so a 16-bit
PNG is not clipped to white (PIL's own ``convert("RGB")`` does that).

Who reads the image:

- the edit adapter encodes the instruction with the image (its ``_encode_one``; :func:`load_source_image`);
- rewards receive the instruction text as ``prompts`` and the source images, resized to the samples' size, as
  ``meta["source_images"]`` [B, 3, H, W] in [0, 1] (:func:`reward_inputs`, called by
  :func:`flowrl.training.scoring.components_of`, the one place flowrl calls a reward), so a text reward scores the
  instruction and an edit reward (e.g. ``source_fidelity``) compares with the source.

At load (:mod:`flowrl.prompts.checks`): a model that edits refuses a prompt without its image, a text-to-image model
refuses one with an image, a reward that needs the source refuses text prompts, and a missing or unreadable image
fails — each naming the key, the line and what is accepted.
"""

from __future__ import annotations

import functools
import re
from pathlib import Path
from typing import Any, Sequence

import torch

from flowrl.errors import shown_path
from flowrl.paths import REPO_ROOT, find_file, where_tried

IMAGE_PROMPT = re.compile(r"^\s*\[image:\s*(?P<path>(?:[^\]\\]|\\.)*?)\s*\] ?(?P<text>.*)$", re.S)
_ESCAPED = re.compile(r"\\([\]\\])")  # \] and \\ in a path; any other backslash is itself
FORM = "'[image: PATH] INSTRUCTION' (e.g. '[image: photos/dog.png] make the dog blue')"


def split_image_prompt(prompt: str) -> tuple[str, str | None]:
    """(instruction text, image path or None) of ``prompt``; a plain text prompt gives (prompt, None). The text is
    what follows ``]`` and one space, as written (:func:`image_prompt` inverts this exactly)."""
    match = IMAGE_PROMPT.match(prompt)
    if match is None:
        return prompt, None
    return match["text"], _ESCAPED.sub(r"\1", match["path"])


def split_image_prompts(prompt: str) -> tuple[str, list[str]]:
    """(instruction text, image paths in order) of ``prompt`` with any number of leading ``[image: PATH]`` tags (the
    Qwen-Image-Edit 2509/2511 form ``[image: A] [image: B] INSTRUCTION``); a plain text prompt gives (prompt, [])."""
    paths: list[str] = []
    text, path = split_image_prompt(prompt)
    while path is not None:
        paths.append(path)
        text, path = split_image_prompt(text)
    return text, paths


def image_prompt(text: str, path: str | Path) -> str:
    r"""The image prompt of instruction ``text`` on the image at ``path`` (a ``]`` in it written ``\]``, a backslash
    ``\\``)."""
    escaped = str(path).replace("\\", "\\\\").replace("]", "\\]")
    return f"[image: {escaped}] {text}"


def prompt_texts(prompts: Sequence[str]) -> list[str]:
    """The instruction text of each prompt (plain prompts unchanged; every leading image tag removed)."""
    return [split_image_prompts(p)[0] for p in prompts]


def prompt_label(prompt: str) -> str:
    """How a grid labels ``prompt``: an image prompt as its instruction and its images' file names."""
    text, paths = split_image_prompts(prompt)
    return text if not paths else f"{text.strip()} [{', '.join(Path(p).name for p in paths)}]"


def resolve_image_path(path: str) -> Path:
    """``path`` as :func:`flowrl.paths.find_file` finds it (FileNotFoundError naming where it looked; IsADirectoryError
    for a folder)."""
    found = find_file(path)
    if found is None:
        given = Path(path).expanduser()
        if given.is_dir() or (not given.is_absolute() and (REPO_ROOT / given).is_dir()):
            raise IsADirectoryError(
                f"{shown_path(path)} is a folder, not an image file; accepted: the path of one image (PNG, JPEG, …)"
            )
        raise FileNotFoundError(f"no such image {shown_path(path)} (looked in {where_tried(path)})")
    return found


class ImageTooLarge(ValueError):
    """An image whose header claims more pixels than are read (PIL's decompression-bomb limit)."""


def rgb_image(image, what: str):
    """The PIL ``image`` as 8-bit RGB, converted by its own range: 16-bit grey (``I;16``…; ``I`` holding 0–65535) and
    float (``F``, in [0, 1]) scaled to 0–255, every other mode as PIL converts it (8 bits per channel: PIL reads a
    16-bit colour PNG so already). ValueError naming ``what`` (e.g. ``"the image 'a.png'"``) for an ``I`` or ``F``
    image whose values lie outside those ranges."""
    import numpy as np
    from PIL import Image

    mode = image.mode
    if not (mode.startswith("I") or mode == "F"):
        return image.convert("RGB")
    array = np.asarray(image, dtype=np.float64)
    low, high = (float(array.min()), float(array.max())) if array.size else (0.0, 0.0)
    full = 1.0 if mode == "F" else 65535.0
    if not (0.0 <= low and high <= full) or not np.isfinite(array).all():
        raise ValueError(
            f"{what} is a {'float' if mode == 'F' else '32-bit integer'} image (mode {mode!r}) with values from "
            f"{low:g} to {high:g}; accepted: 8- or 16-bit images{', or float ones in [0, 1]' if mode == 'F' else ''}"
        )
    grey = np.rint(array * (255.0 / full)).astype(np.uint8)
    return Image.fromarray(grey, "L").convert("RGB")


@functools.lru_cache(maxsize=256)
def read_image(path: str):
    """The image at ``path`` (:func:`resolve_image_path`) as an RGB PIL image (:func:`rgb_image`), read once per path
    (cached). One whose header claims more than ``PIL.Image.MAX_IMAGE_PIXELS`` pixels, or whose text chunks hold more
    than PIL reads, raises :class:`ImageTooLarge` before it is decoded; any other failure to read it is an OSError
    naming the image."""
    import warnings

    from PIL import Image

    found = resolve_image_path(path)
    limit = Image.MAX_IMAGE_PIXELS
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)  # refused below, by name
            image = Image.open(found)
        with image:
            if limit is not None and image.width * image.height > limit:
                raise ImageTooLarge(
                    f"the image {shown_path(path)} claims {image.width:,}×{image.height:,} pixels "
                    f"({image.width * image.height:,}), more than the {limit:,} read "
                    "(PIL.Image.MAX_IMAGE_PIXELS); accepted: a smaller image"
                )
            return rgb_image(image, f"the image {shown_path(path)}")
    except Image.DecompressionBombError as e:  # more than twice the limit: PIL refuses before reading the size
        raise ImageTooLarge(f"the image {shown_path(path)} is too large to read ({e})") from None
    except ImageTooLarge:
        raise
    except ValueError as e:
        if "text chunk" in str(e) or "Decompressed Data Too Large" in str(e):
            raise ImageTooLarge(
                f"the image {shown_path(path)} holds more text (metadata chunks) than is read ({str(e)[:160]}); "
                "accepted: the image with its metadata stripped"
            ) from None
        raise OSError(f"the image {shown_path(path)} cannot be read ({type(e).__name__}: {str(e)[:200]})") from None


def source_pil(path: str, height: int, width: int):
    """The image at ``path`` as RGB, resized (Lanczos, as diffusers' ``VaeImageProcessor.resize``) to
    ``width`` × ``height`` pixels."""
    from PIL import Image

    image = read_image(str(path))
    return image if image.size == (width, height) else image.resize((width, height), Image.LANCZOS)


@functools.lru_cache(maxsize=256)
def load_source_image(path: str, height: int, width: int) -> torch.Tensor:
    """The image at ``path`` resized to ``height`` × ``width``: fp32 [3, H, W] in [0, 1] (cached; do not modify)."""
    import numpy as np

    array = np.asarray(source_pil(path, height, width), dtype=np.float32) / 255.0
    return torch.from_numpy(array.copy()).permute(2, 0, 1).contiguous()


def reward_inputs(
    prompts: Sequence[str], meta: dict[str, Any], images: torch.Tensor
) -> tuple[list[str], dict[str, Any]]:
    """What a reward receives for ``prompts``: their instruction texts, and ``meta`` with ``"source_images"``
    [B, 3, H, W] (each prompt's image at the size of ``images`` [B, 3, H, W] / videos [B, F, 3, H, W]) when the
    prompts carry images. Plain prompts: returned as they are."""
    split = [(text, paths[0] if paths else None) for text, paths in map(split_image_prompts, prompts)]  # the first
    if all(path is None for _, path in split) or "source_images" in meta:
        return [text for text, _ in split], meta
    if any(path is None for _, path in split):
        raise ValueError("a batch mixes prompts with and without a source image; an edit run's prompts all carry one")
    h, w = images.shape[-2:]
    sources = torch.stack([load_source_image(path, int(h), int(w)) for _, path in split])
    return [text for text, _ in split], {**meta, "source_images": sources}
