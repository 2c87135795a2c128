"""OCR reward: how exactly an image shows the text its prompt puts between double quotes (docs/rewards/ocr.md).

Flow-GRPO's text-rendering reward (Liu et al. 2025, arXiv 2505.05470; its ``flow_grpo/ocr.py``), written
here anew. For a prompt such as ``a sign that says "Grand Opening"``:

- target = the text between the FIRST pair of double quotes (``Grand Opening``);
- recognised = the text boxes the OCR engine keeps (confidence >= ``min_confidence``), joined in the
  engine's reading order: top to bottom, and left to right among boxes whose top edges lie within 10 px of
  each other (the PaddleOCR ``sorted_boxes`` order, which RapidOCR shares);
- both lower-cased with spaces removed;
- score = 1 if the target occurs in the recognised text, else
  1 − min(Levenshtein(recognised, target), len(target)) / len(target), in [0, 1].

Engines (kwarg ``engine``): ``rapidocr`` (default; RapidOCR on onnxruntime with the PP-OCRv4 detector and
recogniser, CPU; ``pip install 'flowrl-align[ocr]'``) and ``paddleocr`` (PaddleOCR 2.x, the reference's engine,
English models; ``pip install 'paddleocr<3' paddlepaddle``). Both are set up as the reference runs
PaddleOCR 2.x: no angle classifier, detection on the image with its longer side limited to 960 px, DB
box threshold 0.6, unclip ratio 1.5, no dilation, boxes below confidence 0.5 dropped (PaddleOCR's
``drop_score``; the reference also drops boxes of confidence 0, which that already does). Images go to
the engine one at a time (neither reads a batch per call) as 8-bit BGR arrays, the engines' own
convention for arrays (the reference passes RGB arrays).
"""

from __future__ import annotations

import hashlib
import unicodedata
from typing import Any, Sequence

import numpy as np
import torch

from flowrl_rewards.core._common import to_uint8
from flowrl_rewards.core.base import Reward

ENGINES = ("rapidocr", "paddleocr")
INSTALL = {
    "rapidocr": "pip install 'flowrl-align[ocr]'  (rapidocr-onnxruntime)",
    "paddleocr": "pip install 'paddleocr<3' paddlepaddle  (PaddleOCR's 2.x API; Flow-GRPO uses 2.9.1)",
}
PROMPT_FORM = 'a prompt with the target text between double quotes, e.g. a sign that says "OPEN"'
MAX_TEXT_SHOWN = 200  # characters of recognised text kept per image in meta["ocr/text"]

# PaddleOCR 2.x's defaults (tools/infer/utility.py), which the reference runs with.
DET_LIMIT_SIDE_LEN, DET_LIMIT_TYPE = 960, "max"
DET_BOX_THRESH, DET_UNCLIP_RATIO = 0.6, 1.5
DROP_SCORE = 0.5


# ---- the score --------------------------------------------------------------------------------------
def quoted_target(prompt: str) -> str | None:
    """The text between the first pair of double quotes of ``prompt``; None without a pair."""
    parts = prompt.split('"')
    return parts[1] if len(parts) >= 3 else None


def normalise(text: str) -> str:
    """Lower-cased, spaces removed (as the reference compares texts)."""
    return text.replace(" ", "").lower()


def edit_distance(a: str, b: str) -> int:
    """Levenshtein distance (insertions, deletions, substitutions of one character, each cost 1)."""
    if len(a) < len(b):
        a, b = b, a
    previous = list(range(len(b) + 1))
    for i, ca in enumerate(a, 1):
        current = [i]
        for j, cb in enumerate(b, 1):
            current.append(min(previous[j] + 1, current[j - 1] + 1, previous[j - 1] + (ca != cb)))
        previous = current
    return previous[-1]


def text_score(recognised: str, target: str) -> float:
    """The reward of recognised text for a target (both raw): 1 if the normalised target occurs in the
    normalised recognised text, else 1 − min(distance, len) / len over the normalised texts."""
    seen, want = normalise(recognised), normalise(target)
    if not want:
        raise ValueError(f"reward 'ocr': the target {target!r} is empty once spaces are removed")
    if want in seen:
        return 1.0
    return 1.0 - min(edit_distance(seen, want), len(want)) / len(want)


VISIBLE = ("L", "N", "P", "S")  # Unicode categories an engine can read: letters, digits, punctuation, symbols


def invisible_only(text: str) -> bool:
    """True when ``text`` holds no character an OCR engine could see (only spaces, tabs, NBSP, zero-width or
    direction marks, other control or format characters, lone combining marks)."""
    return not any(unicodedata.category(ch)[0] in VISIBLE for ch in text)


def describe_characters(text: str, limit: int = 4) -> str:
    """The distinct characters of ``text`` by code point and name, e.g. ``U+0009 (CHARACTER TABULATION)``."""
    seen = list(dict.fromkeys(text))
    names = [f"U+{ord(ch):04X} ({unicodedata.name(ch, 'a control character')})" for ch in seen[:limit]]
    return ", ".join(names) + (", …" if len(seen) > limit else "")


def prompt_target(prompt: str) -> str:
    """The target of ``prompt``; a ValueError naming the prompt and saying what is accepted when it has none, or
    when its target has no visible character (it could never be read: the score would always be 0)."""
    target = quoted_target(prompt)
    if target is None:
        raise ValueError(
            f"reward 'ocr' reads the text the prompt quotes, and this prompt has no pair of double "
            f"quotes; accepted: {PROMPT_FORM}"
        )
    if not normalise(target):
        raise ValueError(
            f"reward 'ocr': the text between the prompt's first pair of double quotes is empty; accepted: {PROMPT_FORM}"
        )
    if invisible_only(target):
        raise ValueError(
            f"reward 'ocr': the prompt {prompt[:200]!r} quotes {target!r}, which has no visible character "
            f"(only {describe_characters(target)}): no image can show it, so it would always score 0; "
            f"accepted: {PROMPT_FORM}"
        )
    return target


# ---- engines: one uint8 BGR image [H, W, 3] → [(text, confidence), ...] in reading order -------------
def _missing(engine: str, error: ImportError) -> ImportError:
    return ImportError(
        f"reward 'ocr': engine={engine!r} is not installed ({type(error).__name__}: {error}); "
        f"install it with: {INSTALL[engine]}"
    )


class RapidOcrEngine:
    """RapidOCR (onnxruntime) with PaddleOCR 2.x's detection settings; ``threads`` intra-op threads."""

    def __init__(self, threads: int, min_confidence: float):
        try:
            from rapidocr_onnxruntime import RapidOCR
        except ImportError as e:
            raise _missing("rapidocr", e) from e
        self.ocr = RapidOCR(
            intra_op_num_threads=threads,
            inter_op_num_threads=1,
            use_cls=False,
            text_score=min_confidence,
            det_limit_side_len=DET_LIMIT_SIDE_LEN,
            det_limit_type=DET_LIMIT_TYPE,
            det_box_thresh=DET_BOX_THRESH,
            det_unclip_ratio=DET_UNCLIP_RATIO,
            det_use_dilation=False,
        )

    def read(self, bgr: np.ndarray) -> list[tuple[str, float]]:
        result, _ = self.ocr(bgr)
        return [(str(box[1]), float(box[2])) for box in (result or [])]


class PaddleOcrEngine:
    """PaddleOCR 2.x as the reference builds it (English, no angle classifier, CPU), ``threads`` CPU threads."""

    def __init__(self, threads: int, min_confidence: float):
        try:
            from importlib.metadata import version

            if int(version("paddleocr").split(".")[0]) >= 3:
                raise ImportError(f"paddleocr {version('paddleocr')} is installed; its 3.x API is not supported")
            from paddleocr import PaddleOCR
        except ImportError as e:  # also PackageNotFoundError, and paddlepaddle missing under paddleocr
            raise _missing("paddleocr", e) from e
        self.ocr = PaddleOCR(
            use_angle_cls=False,
            lang="en",
            use_gpu=False,
            show_log=False,
            cpu_threads=threads,
            drop_score=min_confidence,
            det_limit_side_len=DET_LIMIT_SIDE_LEN,
            det_limit_type=DET_LIMIT_TYPE,
        )

    def read(self, bgr: np.ndarray) -> list[tuple[str, float]]:
        lines = self.ocr.ocr(bgr, cls=False)[0] or []
        return [(str(text), float(conf)) for _, (text, conf) in lines]


ENGINE_CLASSES = {"rapidocr": RapidOcrEngine, "paddleocr": PaddleOcrEngine}


# ---- the reward -------------------------------------------------------------------------------------
class OcrReward(Reward):
    """Flow-GRPO's OCR reward (module docstring): scores float32 [B] in [0, 1] for images [B, 3, H, W].

    kwargs:
      engine: ``"rapidocr"`` (default) or ``"paddleocr"``; built (and its models loaded) here, so a missing
        engine fails when the run loads, naming what to install.
      threads: CPU threads of the engine (onnxruntime intra-op threads; PaddleOCR's ``cpu_threads``), default 1.
      min_confidence: boxes recognised with a lower confidence are dropped (default 0.5, PaddleOCR's
        ``drop_score`` under the reference).

    Every prompt must quote its target (:meth:`check_prompt`). Adds ``meta["ocr/text"]``: the recognised
    text of each image (boxes joined by spaces, at most 200 characters). :meth:`evaluate` gives the
    eval's ``accuracy`` (fraction of images scoring exactly 1) and ``n``.
    """

    name = "ocr"

    def __init__(self, engine: str = "rapidocr", threads: int = 1, min_confidence: float = DROP_SCORE):
        if engine not in ENGINES:
            raise ValueError(f"reward 'ocr': engine={engine!r} is not an OCR engine; accepted: {list(ENGINES)}")
        if isinstance(threads, bool) or not isinstance(threads, int) or threads < 1:
            raise ValueError(f"reward 'ocr': threads={threads!r} must be an integer >= 1 (CPU threads of the engine)")
        if (
            isinstance(min_confidence, bool)
            or not isinstance(min_confidence, (int, float))
            or not 0 <= min_confidence <= 1
        ):
            raise ValueError(f"reward 'ocr': min_confidence={min_confidence!r} must be a number in [0, 1]")
        self.engine_name, self.threads, self.min_confidence = engine, threads, float(min_confidence)
        self.engine = ENGINE_CLASSES[engine](threads, self.min_confidence)
        self._last: tuple[str, tuple[str, ...], torch.Tensor] | None = None  # (images digest, prompts, scores)

    def check_prompt(self, prompt: str) -> None:
        prompt_target(prompt)

    def read(self, images: torch.Tensor) -> list[str]:
        """The recognised text of each image [B, 3, H, W] in [0, 1]: kept boxes joined by spaces, in reading order."""
        return self._read_all(images)[0]

    def _read_all(self, images: torch.Tensor) -> tuple[list[str | None], str]:
        """(recognised text per image, None for an image with non-finite values; fingerprint of the 8-bit images)
        for images [B, 3, H, W]; one image per engine call, each converted on its own (a large eval batch is never
        copied whole)."""
        texts: list[str | None] = []
        hasher = _hasher(images)
        for i, (rgb, finite) in enumerate(_pages(images)):
            hasher.update(rgb.tobytes() + bytes([finite]))
            if not finite:
                texts.append(None)
                continue
            boxes = self._engine_read(np.ascontiguousarray(rgb[..., ::-1]), i)
            texts.append(" ".join(text for text, conf in boxes if conf > 0 and conf >= self.min_confidence))
        return texts, hasher.hexdigest()

    def _engine_read(self, bgr: np.ndarray, index: int) -> list[tuple[str, float]]:
        """The engine's boxes for one uint8 BGR image [H, W, 3]; an engine failure re-raised naming the image's size."""
        try:
            return self.engine.read(bgr)
        except Exception as e:  # the engines' own errors can be empty (RapidOCR's ResizeImgError())
            height, width = bgr.shape[:2]
            thin = max(height, width) / max(1, min(height, width))
            hint = (
                f"; an image this thin ({height}:{width}) is beyond what the engine can resize (it scales the "
                "longer side down and rounds each side to a multiple of 32); give images closer to square"
                if thin > 100
                else ""
            )
            raise RuntimeError(
                f"reward 'ocr': the {self.engine_name} engine failed on image {index} of {height} × "
                f"{width} pixels (height × width): {error_chain(e)}{hint}"
            ) from e

    def score(self, images: torch.Tensor, prompts: Sequence[str], meta: dict[str, Any]) -> torch.Tensor:
        """float32 [B] scores for images [B, 3, H, W] in [0, 1]; NaN (a failure to count, :attr:`last_error` says
        which) for an image with non-finite values."""
        targets = [prompt_target(p) for p in prompts]
        texts, digest = self._read_all(images)
        meta["ocr/text"] = [(t or "")[:MAX_TEXT_SHOWN] for t in texts]
        scores = torch.tensor(
            [float("nan") if t is None else text_score(t, g) for t, g in zip(texts, targets)], dtype=torch.float32
        )
        broken = [i for i, t in enumerate(texts) if t is None]
        self.last_error = (
            f"{len(broken)} of {len(texts)} images hold non-finite values (NaN or inf; the first: "
            f"image {broken[0]}), scored NaN"
            if broken
            else None
        )
        self._last = (digest, tuple(prompts), scores.clone())  # the caller may change its copy
        return scores

    def evaluate(self, images: torch.Tensor, prompts: Sequence[str]) -> dict[str, float]:
        """Eval summary of images [N, 3, H, W]: ``accuracy`` (fraction scoring 1: the target read exactly, or
        inside longer text) and ``n``. Reuses the scores of the last :meth:`score` call on the same images."""
        last = self._last
        if last is not None and last[1] == tuple(prompts) and last[0] == _digest(images):
            scores = last[2]
        else:
            scores = self.score(images, prompts, {})
        return {"accuracy": float((scores == 1).float().mean()) if len(prompts) else float("nan"), "n": len(prompts)}


def _pages(images: torch.Tensor):
    """Each image of [B, 3, H, W] in [0, 1] as (uint8 RGB [H, W, 3], whether every value is finite), one at a time."""
    for i in range(images.shape[0]):
        image = images[i : i + 1]
        yield to_uint8(image)[0], bool(torch.isfinite(image).all())


def error_chain(error: BaseException) -> str:
    """``Type: message`` of ``error`` and of the errors it was raised from, skipping empty messages' text."""
    parts, seen = [], set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        parts.append(f"{type(error).__name__}: {error}" if str(error) else type(error).__name__)
        error = error.__cause__ or error.__context__
    return " ← ".join(parts)


def _hasher(images: torch.Tensor):
    hasher = hashlib.sha1()
    hasher.update(repr(tuple(images.shape)).encode())
    return hasher


def _digest(images: torch.Tensor) -> str:
    """A fingerprint of images [B, 3, H, W] as the engine sees them (8 bits), as ``OcrReward._read_all`` makes it."""
    hasher = _hasher(images)
    for rgb, finite in _pages(images):
        hasher.update(rgb.tobytes() + bytes([finite]))
    return hasher.hexdigest()
