"""The exact reward of the shapes world: a colour-segmentation detector and GenEval-style scoring.

Detector (:func:`detect`, :func:`detect_batch`), for images of any size and for images it was not
written against (anti-aliased edges, blur, 7-px objects, shading):

1. Colour: a pixel whose brightest channel is below ``DARK`` is background; otherwise its chromaticity
   (RGB divided by the brightest channel, so dim or soft edges keep their hue) goes to the nearest
   palette colour, or to "unknown" if that colour is farther than ``MAX_CHROMA_DIST`` (white, grey,
   orange…). Unknown pixels are ignored. Pixels between ``SOFT_DARK`` and ``DARK`` keep their
   palette colour as *soft* pixels (an object's anti-aliased or blurred rim).
2. Components: 4-connected pixels of one colour (pure numpy: min-label propagation with pointer
   jumping, batched). Components smaller than ``MIN_AREA_FRAC`` of the image, with a bounding box
   side below ``MIN_SIDE_FRAC`` or above ``MAX_SIDE_FRAC`` of the image side, or an aspect ratio above
   ``MAX_ASPECT`` are not objects. Each component then takes in the soft pixels of its colour that
   touch it (:func:`grow_labels`, one 4-neighbour step); the rim counts for the shape and the
   centroid, not for area, bounding box or the filters.
3. Shape, from moments of the grown component, each pixel weighted by the fraction of it the object
   covers: brightness / (``FULL_COVERAGE`` × the component's peak brightness), at most 1 (so a rim
   pixel counts by its coverage, and dimming or shading inside an object does not matter). In
   coordinates standardised per axis, u = (x − cx)/σx and v = (y − cy)/σy (y down):

   - ``skew`` = E[v³], top-versus-bottom mass: an apex-up triangle's row width grows linearly from
     apex to base, so its mass sits low, skew = −2√2/5 ≈ −0.57; circle and square are symmetric, 0.
   - ``quad`` = E[u⁴ − 6u²v² + v⁴] / 4 = E[ρ⁴ cos 4θ] / 4, the four-fold (corner) harmonic: a
     square's mass reaches into its corners, −0.6; a disc has none, 0 (per-axis standardising reads
     rectangles as squares and ellipses as circles).

   Triangle if skew < ``TRIANGLE_SKEW``, else square if quad < ``SQUARE_QUAD``, else circle (the
   triangle test comes first: blunt, trapezoid triangles also have a negative quad). Anti-aliasing and
   blur are convolutions with a symmetric kernel: they leave the centroid and the third central
   moment as they are and add to the variances, so both features shrink towards 0 by the blur's
   share of the variance (σ = 0.7 px on a 7-px object: skew ≈ −0.4, quad ≈ −0.4) instead of crossing
   a threshold. The bounding-box fill ratio of the thresholded mask used before did cross them: on
   7–8-px anti-aliased objects it read 6 % of circles (9 % blurred, σ = 0.7) as triangles or squares
   and 6 % of blurred triangles as circles.

Requirements per task (``partial`` = fraction satisfied, ``strict`` = all satisfied). For each
requested object (shape s, colour c): "some object has colour c", "some object has shape s", and
"an object is a c s" (for ``counting``: "at least one c s" and "exactly k c s"). Then:

- ``single``, ``two_objects``: nothing more; extra objects never hurt.
- ``color_attr`` (the two objects differ in shape and colour): "bound": both objects present and no
  object wears the other object's colour (no c₂ s₁, no c₁ s₂), i.e. each shape carries only its
  own colour of the two requested.
- ``position``: "relation": both present and the largest detection of object 0 is
  ``relation`` the largest of object 1, its centroid at least ``RELATION_MARGIN_FRAC`` of the image
  side beyond on the relation axis (image y grows downwards; "above" = smaller y).

Extra copies of a requested shape+colour break only ``counting`` (exact count).
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, Sequence

import numpy as np
import torch

from flowrl.shapes import world
from rewards.base import Reward

DARK = 100                    # brightest channel below this (of 255) = background
SOFT_DARK = 24                # … but a pixel this bright beside an object of its colour is its soft rim
FULL_COVERAGE = 0.8           # a pixel this bright (× its component's peak) is fully covered
TRIANGLE_SKEW = -0.2          # skew below this = triangle (apex up ≈ −0.57; circle, square 0)
SQUARE_QUAD = -0.2            # quad below this = square (≈ −0.6; circle 0)
MAX_CHROMA_DIST = 0.45        # chromaticity distance beyond which a pixel is "unknown"
MIN_AREA_FRAC = 12 / 1024     # component area ≥ this fraction of H·W (12 px at 32×32)
MIN_SIDE_FRAC = 4 / 32        # bounding-box sides ≥ this fraction of the image side
MAX_SIDE_FRAC = 0.6           # bounding-box sides ≤ this fraction (no canvas-filling blobs)
MAX_ASPECT = 1.75             # max(w, h) / min(w, h)
RELATION_MARGIN_FRAC = 3 / 32 # centroid offset along the relation axis, fraction of the side
CHUNK_PIXELS = 1 << 18        # pixels processed at once by detect_batch (256 images of 32×32)

_COLOR_NAMES: tuple[str, ...] = tuple(world.COLORS)
_PALETTE = np.array([world.COLORS[c] for c in _COLOR_NAMES], dtype=np.float32) / 255.0  # [6, 3]
MODES: tuple[str, ...] = ("strict", "partial", "precise", "geneval")


@dataclass(frozen=True)
class Detection:
    """One detected object. ``centroid`` (x, y, coverage-weighted) and ``bbox`` (x0, y0, x1, y1,
    end-exclusive) in pixels; ``area`` and ``fill`` (of the bbox) count the pixels above DARK;
    ``skew`` and ``quad``: the shape features (module docstring)."""

    shape: str
    color: str
    centroid: tuple[float, float]
    area: int
    bbox: tuple[int, int, int, int]
    fill: float = 0.0
    skew: float = 0.0
    quad: float = 0.0


# ------------------------------------------------------------------------------------------ detector

def _palette_match(images: np.ndarray, dark: int) -> tuple[np.ndarray, np.ndarray]:
    """(palette index per pixel, int8 [B, H, W], −1 where the brightest channel is below ``dark`` or
    the hue is unknown; brightest channel, uint8 [B, H, W]) for uint8 [B, H, W, 3]."""
    channels = [images[..., c] for c in range(3)]
    bright = np.maximum(np.maximum(channels[0], channels[1]), channels[2])   # [B, H, W] uint8
    scale = 1.0 / np.maximum(bright, 1).astype(np.float32)
    chroma = [channel * scale for channel in channels]               # 3 × [B, H, W] in [0, 1]
    best = np.full(bright.shape, np.inf, dtype=np.float32)           # squared distance to nearest
    nearest = np.zeros(bright.shape, dtype=np.int8)
    for k, color in enumerate(_PALETTE):
        d2 = sum((chroma[c] - color[c]) ** 2 for c in range(3))
        closer = d2 < best
        best = np.where(closer, d2, best)
        np.putmask(nearest, closer, k)
    ok = (bright >= dark) & (best <= MAX_CHROMA_DIST ** 2)
    return np.where(ok, nearest, -1).astype(np.int8), bright


def classify_colors(images: np.ndarray) -> np.ndarray:
    """Palette index per pixel, int8 [B, H, W] (−1 = background or unknown) for uint8 [B, H, W, 3]."""
    return _palette_match(images, DARK)[0]


def label_components(classes: np.ndarray) -> np.ndarray:
    """Component id per pixel, int64 [B, H, W]: the smallest flat index (over B·H·W) of its
    4-connected same-class component; −1 where ``classes`` < 0."""
    b, h, w = classes.shape
    n = b * h * w
    fg = classes >= 0
    big = np.int64(n)
    labels = np.where(fg, np.arange(n, dtype=np.int64).reshape(b, h, w), big)
    same_x = fg[:, :, 1:] & (classes[:, :, 1:] == classes[:, :, :-1])   # [B, H, W-1]
    same_y = fg[:, 1:, :] & (classes[:, 1:, :] == classes[:, :-1, :])   # [B, H-1, W]
    flat_fg = fg.reshape(-1)
    while True:
        before = labels.copy()
        m = np.where(same_x, np.minimum(labels[:, :, 1:], labels[:, :, :-1]), big)
        labels[:, :, 1:] = np.minimum(labels[:, :, 1:], m)
        labels[:, :, :-1] = np.minimum(labels[:, :, :-1], m)
        m = np.where(same_y, np.minimum(labels[:, 1:, :], labels[:, :-1, :]), big)
        labels[:, 1:, :] = np.minimum(labels[:, 1:, :], m)
        labels[:, :-1, :] = np.minimum(labels[:, :-1, :], m)
        flat = labels.reshape(-1)
        while True:  # pointer jumping: a label is a pixel of the same component with a smaller index
            jumped = flat.copy()
            jumped[flat_fg] = flat[flat[flat_fg]]
            if np.array_equal(jumped, flat):
                break
            flat = jumped
        labels = flat.reshape(b, h, w)
        if np.array_equal(labels, before):
            break
    return np.where(fg, labels, -1)


def grow_labels(labels: np.ndarray, soft: np.ndarray) -> np.ndarray:
    """``labels`` (int64 [B, H, W], −1 = none) grown by one 4-neighbour step into unlabelled pixels
    whose ``soft`` class (int8 [B, H, W], −1 = none) is that neighbour's (ties: the smallest id)."""
    b, h, w = labels.shape
    flat_l, flat_s = labels.reshape(-1), soft.reshape(-1)
    cand = np.nonzero((flat_l < 0) & (flat_s >= 0))[0]
    xs, ys = cand % w, (cand // w) % h
    none = np.iinfo(np.int64).max
    best = np.full(len(cand), none)
    for inside, step in ((xs > 0, -1), (xs < w - 1, 1), (ys > 0, -w), (ys < h - 1, w)):
        nb = np.where(inside, cand + step, cand)          # itself (unlabelled) where off the image
        lab = flat_l[nb]
        ok = (lab >= 0) & (flat_s[nb] == flat_s[cand])
        best = np.where(ok, np.minimum(best, lab), best)
    out = flat_l.copy()
    out[cand] = np.where(best < none, best, -1)
    return out.reshape(b, h, w)


def _coverage(comp: np.ndarray, bright: np.ndarray, k: int) -> np.ndarray:
    """Estimated fraction of each pixel covered by its object, float64 [N], from its brightness
    (uint8 [N]) relative to the brightest pixel of its component (``comp``, int [N] in 0..k−1);
    ``FULL_COVERAGE`` of that brightness or more counts as fully covered."""
    peak = np.zeros(k)
    np.maximum.at(peak, comp, bright)
    return np.minimum(bright / (FULL_COVERAGE * peak[comp]), 1.0)


def _moments(comp: np.ndarray, weight: np.ndarray, xs: np.ndarray, ys: np.ndarray,
             k: int) -> dict[str, np.ndarray]:
    """Weighted moments per component, float64 [k] each, for pixels (centres ``xs``, ``ys``, float [N];
    weights float [N]) of components ``comp`` (int [N] in 0..k−1): centroid ``cx``, ``cy``, and in
    the coordinates u = (x − cx)/σx, v = (y − cy)/σy: ``skew`` = E[v³] and
    ``quad`` = E[u⁴ − 6u²v² + v⁴] / 4."""
    mass = np.bincount(comp, weight, k)
    mean = lambda v: np.bincount(comp, weight * v, k) / mass
    cx, cy = mean(xs), mean(ys)
    dx, dy = xs - cx[comp], ys - cy[comp]
    dx2, dy2 = dx * dx, dy * dy
    var_x, var_y = (np.maximum(mean(d2), 1e-9) for d2 in (dx2, dy2))
    skew = mean(dy2 * dy) / var_y ** 1.5
    u2, v2 = dx2 / var_x[comp], dy2 / var_y[comp]
    quad = mean(u2 * u2 - 6 * u2 * v2 + v2 * v2) / 4
    return {"cx": cx, "cy": cy, "skew": skew, "quad": quad}


def _classify_shape(skew: np.ndarray, quad: np.ndarray) -> np.ndarray:
    """Index into world.SHAPES per component: triangle if ``skew`` < TRIANGLE_SKEW (a narrow top
    comes first: the model's blunt triangles are also square-ish), else square if ``quad`` <
    SQUARE_QUAD, else circle."""
    index = world.SHAPES.index
    square_or_circle = np.where(quad < SQUARE_QUAD, index("square"), index("circle"))
    return np.where(skew < TRIANGLE_SKEW, index("triangle"), square_or_circle)


def detect_batch(images: np.ndarray) -> list[list[Detection]]:
    """Detections per image for uint8 [B, H, W, 3] (any H, W), each list sorted by area (largest first).

    Works on chunks of about CHUNK_PIXELS pixels so memory stays bounded for large images.
    """
    if not (isinstance(images, np.ndarray) and images.dtype == np.uint8 and images.ndim == 4
            and images.shape[-1] == 3):
        got = f"{type(images).__name__} {getattr(images, 'dtype', '')} {getattr(images, 'shape', '')}"
        raise ValueError(f"detect_batch: images must be a uint8 numpy array [B, H, W, 3], got {got}")
    per_chunk = max(1, CHUNK_PIXELS // (images.shape[1] * images.shape[2]))
    out: list[list[Detection]] = []
    for start in range(0, images.shape[0], per_chunk):
        out.extend(_detect_chunk(images[start:start + per_chunk]))
    return out


def _detect_chunk(images: np.ndarray) -> list[list[Detection]]:
    """:func:`detect_batch` on one chunk, uint8 [B, H, W, 3]."""
    b, h, w, _ = images.shape
    soft, bright = _palette_match(images, SOFT_DARK)
    classes = np.where(bright >= DARK, soft, -1).astype(np.int8)
    labels = label_components(classes)
    grown = grow_labels(labels, soft).reshape(-1)
    if not (grown >= 0).any():
        return [[] for _ in range(b)]
    pix = np.nonzero(grown >= 0)[0]
    roots, comp = np.unique(grown[pix], return_inverse=True)
    ys, xs = (pix // w) % h, pix % w
    k = len(roots)
    m = _moments(comp, _coverage(comp, bright.reshape(-1)[pix], k), xs + 0.5, ys + 0.5, k)
    core = labels.reshape(-1)[pix] >= 0           # the bbox, area and filters use core pixels only
    comp, xs, ys = comp[core], xs[core], ys[core]
    area = np.bincount(comp, minlength=k)
    x0 = np.full(k, w); np.minimum.at(x0, comp, xs)
    y0 = np.full(k, h); np.minimum.at(y0, comp, ys)
    x1 = np.zeros(k, dtype=np.int64); np.maximum.at(x1, comp, xs + 1)
    y1 = np.zeros(k, dtype=np.int64); np.maximum.at(y1, comp, ys + 1)
    bw, bh = x1 - x0, y1 - y0
    fill = area / np.maximum(bw * bh, 1)
    side = min(h, w)
    keep = ((area >= MIN_AREA_FRAC * h * w)
            & (np.minimum(bw, bh) >= MIN_SIDE_FRAC * side)
            & (bw <= MAX_SIDE_FRAC * w) & (bh <= MAX_SIDE_FRAC * h)
            & (np.maximum(bw, bh) <= MAX_ASPECT * np.minimum(bw, bh)))
    shapes = _classify_shape(m["skew"], m["quad"])
    colors = classes.reshape(-1)[roots]
    batch = roots // (h * w)
    out: list[list[Detection]] = [[] for _ in range(b)]
    for i in np.nonzero(keep)[0]:
        out[int(batch[i])].append(Detection(
            shape=world.SHAPES[int(shapes[i])], color=_COLOR_NAMES[int(colors[i])],
            centroid=(float(m["cx"][i]), float(m["cy"][i])), area=int(area[i]),
            bbox=(int(x0[i]), int(y0[i]), int(x1[i]), int(y1[i])), fill=float(fill[i]),
            skew=float(m["skew"][i]), quad=float(m["quad"][i]),
        ))
    for dets in out:
        dets.sort(key=lambda d: -d.area)
    return out


def detect(image: np.ndarray) -> list[Detection]:
    """Detections in one uint8 [H, W, 3] image, largest first."""
    if not (isinstance(image, np.ndarray) and image.ndim == 3):
        raise ValueError(f"detect: image must be a uint8 numpy array [H, W, 3], got {getattr(image, 'shape', image)!r}")
    return detect_batch(image[None])[0]


# ------------------------------------------------------------------------------------------- scoring

def _relation_holds(a: Detection, b: Detection, relation: str, side: int) -> bool:
    margin = RELATION_MARGIN_FRAC * side
    (ax, ay), (bx, by) = a.centroid, b.centroid
    if relation == "left of":
        return bx - ax >= margin
    if relation == "right of":
        return ax - bx >= margin
    if relation == "above":
        return by - ay >= margin
    if relation == "below":
        return ay - by >= margin
    raise ValueError(f"unknown relation {relation!r}; accepted: {world.RELATIONS}")


def requirements(spec: world.Spec, dets: Sequence[Detection], side: int) -> dict[str, bool]:
    """Named requirement → satisfied, for one image's detections (see the module docstring)."""
    def matching(o: world.ObjectSpec) -> list[Detection]:
        return [d for d in dets if d.shape == o.shape and d.color == o.color]

    req: dict[str, bool] = {}
    for i, o in enumerate(spec.objects):
        found = matching(o)
        req[f"{i}/color"] = any(d.color == o.color for d in dets)
        req[f"{i}/shape"] = any(d.shape == o.shape for d in dets)
        req[f"{i}/object"] = len(found) >= 1
        if spec.task == "counting":
            req[f"{i}/count"] = len(found) == o.count
    both = all(req[f"{i}/object"] for i in range(len(spec.objects)))
    if spec.task == "color_attr":
        a, b = spec.objects
        leak = any((d.shape, d.color) in {(a.shape, b.color), (b.shape, a.color)} for d in dets)
        req["bound"] = both and not leak
    if spec.task == "position":
        a, b = (matching(o) for o in spec.objects)
        req["relation"] = both and _relation_holds(a[0], b[0], spec.relation, side)
    return req


def geneval_subscores(spec: world.Spec, dets: Sequence[Detection], side: int) -> dict[str, float]:
    """The sub-scores (each in [0, 1]) that mode ``geneval`` averages for one image (see
    :class:`ShapesReward`)."""
    def found(shape: str, color: str | None = None) -> int:
        return sum(d.shape == shape and color in (None, d.color) for d in dets)

    objects = spec.objects
    if spec.task == "counting":
        (o,) = objects
        return {"count": max(0.0, 1 - abs(found(o.shape, o.color) - o.count) / o.count)}
    if spec.task == "color_attr":
        a, b = objects
        bound = [found(o.shape, o.color) > 0 and found(o.shape, other.color) == 0
                 for o, other in ((a, b), (b, a))]
        return {"binding": sum(bound) / 2}
    if spec.task == "position":
        return {"relation": float(requirements(spec, dets, side)["relation"])}
    wanted = Counter(o.shape for o in objects)   # two circles requested need two circles detected
    presence = sum(min(found(shape), n) for shape, n in wanted.items()) / len(objects)
    color = sum(found(o.shape, o.color) > 0 for o in objects) / len(objects)
    return {"presence": presence, "color": color}


def precision(spec: world.Spec, dets: Sequence[Detection]) -> float:
    """Fraction of ``dets`` whose (shape, colour) is a requested object's (0 when nothing is detected)."""
    requested = {(o.shape, o.color) for o in spec.objects}
    return sum((d.shape, d.color) in requested for d in dets) / len(dets) if dets else 0.0


@lru_cache(maxsize=4096)
def _parse(prompt: str) -> world.Spec:
    return world.parse(prompt)


def to_uint8_hwc(images: Any) -> np.ndarray:
    """uint8 [B, H, W, 3] from a float tensor/array [B, 3, H, W] in [0, 1] or a uint8 array [B, H, W, 3]."""
    if isinstance(images, np.ndarray) and images.dtype == np.uint8:
        if images.ndim != 4 or images.shape[-1] != 3:
            raise ValueError(f"uint8 images must be [B, H, W, 3], got shape {images.shape}")
        return images
    x = torch.as_tensor(images)
    if x.ndim != 4 or x.shape[1] != 3 or not x.is_floating_point():
        raise ValueError(
            f"images must be float [B, 3, H, W] in [0, 1] or uint8 numpy [B, H, W, 3], "
            f"got {x.dtype} shape {tuple(x.shape)}"
        )
    x = (x.detach().float().clamp(0, 1) * 255).round().to(torch.uint8)
    return x.permute(0, 2, 3, 1).cpu().numpy()


class ShapesReward(Reward):
    """GenEval-style reward of the shapes world.

    ``mode="strict"``: 1 if every requirement of the prompt is met, else 0. ``mode="partial"``: the
    fraction of requirements met (a denser signal). ``mode="precise"``: partial × the fraction of
    detected objects that are requested ones — partial credit without the reward for spraying extra
    objects of many colours and shapes (GRPO on ``partial`` learned exactly that: training reward up,
    held-out strict accuracy down). ``mode="geneval"``: the training reward of Flow-GRPO's GenEval
    reward server (partial credit per requirement, averaged over the task's sub-scores below) × the
    same precision factor as ``precise``. Adds to ``meta``: ``"shapes/task"`` (list of
    task names), ``"shapes/strict"``, ``"shapes/partial"`` and ``"shapes/colors_found"`` (float32 [B];
    colors_found = 1 if an object of every requested colour was detected).

    ``geneval`` sub-scores (:func:`geneval_subscores`), each in [0, 1], with found(s, c) = number of
    detections of shape s in colour c (any colour when c is left out):

    ============  ==============================================================================
    task          sub-scores averaged
    ============  ==============================================================================
    single,       ``presence`` = fraction of requested objects whose shape is detected in any
    two_objects   colour (GenEval's class detection; two requested circles need two circles) and
                  ``color`` = fraction of requested objects detected in their colour,
                  found(s, c) ≥ 1 (GenEval's colour check on the detected objects)
    counting      ``count`` = max(0, 1 − |found(s, c) − n| / n) (the server's count term, floored
                  at 0): one off earns 1 − 1/n
    color_attr    ``binding`` = fraction of the two objects (s₁, c₁), (s₂, c₂) found with the right
                  binding: found(sᵢ, cᵢ) ≥ 1 and no sᵢ wears the other colour
    position      ``relation`` = 1 if both objects are detected and the relation holds (the
                  ``strict`` relation test), else 0
    ============  ==============================================================================

    then × precision (:func:`precision`): the fraction of detections that are requested shape+colour
    pairs, 0 with no detection. A perfect image earns 1; spraying extra objects lowers the score.
    """

    name = "shapes"

    def __init__(self, mode: str = "strict"):
        if mode not in MODES:
            raise ValueError(f"ShapesReward: mode {mode!r} is not accepted; accepted: {', '.join(MODES)}")
        self.mode = mode

    def check_prompt(self, prompt: str) -> None:
        """A shapes-world prompt the parser reads (ValueError otherwise)."""
        _parse(prompt)

    def details(self, images: Any, prompts: Sequence[str]) -> dict[str, Any]:
        """Per-image ``task`` (list), ``strict``, ``partial``, ``precise``, ``geneval``, ``colors_found``
        (float32 numpy [B] each)."""
        arr = to_uint8_hwc(images)
        if len(prompts) != arr.shape[0]:
            raise ValueError(f"{arr.shape[0]} images but {len(prompts)} prompts")
        specs = [_parse(p) for p in prompts]
        detections = detect_batch(arr)
        side = min(arr.shape[1], arr.shape[2])
        strict, partial, precise, geneval, colors = (np.zeros(len(specs), dtype=np.float32) for _ in range(5))
        for i, (spec, dets) in enumerate(zip(specs, detections)):
            req = requirements(spec, dets, side)
            strict[i] = float(all(req.values()))
            partial[i] = sum(req.values()) / len(req)
            share = precision(spec, dets)
            precise[i] = partial[i] * share
            sub = geneval_subscores(spec, dets, side)
            geneval[i] = sum(sub.values()) / len(sub) * share
            found = {d.color for d in dets}
            colors[i] = float(all(o.color in found for o in spec.objects))
        return {"task": [s.task for s in specs], "strict": strict, "partial": partial, "precise": precise,
                "geneval": geneval, "colors_found": colors}

    def score(self, images: torch.Tensor, prompts: Sequence[str], meta: dict[str, Any]) -> torch.Tensor:
        """float32 [B] scores for images [B, 3, H, W] in [0, 1]."""
        d = self.details(images, prompts)
        meta["shapes/task"] = d["task"]
        meta["shapes/strict"] = d["strict"]
        meta["shapes/partial"] = d["partial"]
        meta["shapes/colors_found"] = d["colors_found"]
        return torch.from_numpy(d[self.mode].copy())

    def evaluate(self, images: Any, prompts: Sequence[str]) -> dict[str, float]:
        """Summary over a batch: ``accuracy`` (strict), ``partial``, ``colors_found``, and per task
        present ``accuracy/<task>`` and ``n/<task>``."""
        d = self.details(images, prompts)
        out: dict[str, float] = {
            "accuracy": float(d["strict"].mean()) if len(prompts) else float("nan"),
            "partial": float(d["partial"].mean()) if len(prompts) else float("nan"),
            "colors_found": float(d["colors_found"].mean()) if len(prompts) else float("nan"),
            "n": len(prompts),
        }
        tasks = np.array(d["task"])
        for task in world.TASKS:
            sel = tasks == task
            if sel.any():
                out[f"accuracy/{task}"] = float(d["strict"][sel].mean())
                out[f"n/{task}"] = int(sel.sum())
        return out


def evaluate(images: Any, prompts: Sequence[str]) -> dict[str, float]:
    """:meth:`ShapesReward.evaluate` with the default detector."""
    return ShapesReward().evaluate(images, prompts)
