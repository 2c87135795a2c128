"""The detector of the shapes world's reward: colour segmentation, connected components and shape from
moments (:mod:`flowrl_rewards.compositional.shapes` scores its detections against a prompt).

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
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from flowrl.shapes import world

DARK = 100  # brightest channel below this (of 255) = background
SOFT_DARK = 24  # … but a pixel this bright beside an object of its colour is its soft rim
FULL_COVERAGE = 0.8  # a pixel this bright (× its component's peak) is fully covered
TRIANGLE_SKEW = -0.2  # skew below this = triangle (apex up ≈ −0.57; circle, square 0)
SQUARE_QUAD = -0.2  # quad below this = square (≈ −0.6; circle 0)
MAX_CHROMA_DIST = 0.45  # chromaticity distance beyond which a pixel is "unknown"
MIN_AREA_FRAC = 12 / 1024  # component area ≥ this fraction of H·W (12 px at 32×32)
MIN_SIDE_FRAC = 4 / 32  # bounding-box sides ≥ this fraction of the image side
MAX_SIDE_FRAC = 0.6  # bounding-box sides ≤ this fraction (no canvas-filling blobs)
MAX_ASPECT = 1.75  # max(w, h) / min(w, h)
CHUNK_PIXELS = 1 << 18  # pixels processed at once by detect_batch (256 images of 32×32)

_COLOR_NAMES: tuple[str, ...] = tuple(world.COLORS)
_PALETTE = np.array([world.COLORS[c] for c in _COLOR_NAMES], dtype=np.float32) / 255.0  # [6, 3]


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
    bright = np.maximum(np.maximum(channels[0], channels[1]), channels[2])  # [B, H, W] uint8
    scale = 1.0 / np.maximum(bright, 1).astype(np.float32)
    chroma = [channel * scale for channel in channels]  # 3 × [B, H, W] in [0, 1]
    best = np.full(bright.shape, np.inf, dtype=np.float32)  # squared distance to nearest
    nearest = np.zeros(bright.shape, dtype=np.int8)
    for k, color in enumerate(_PALETTE):
        d2 = sum((chroma[c] - color[c]) ** 2 for c in range(3))
        closer = d2 < best
        best = np.where(closer, d2, best)
        np.putmask(nearest, closer, k)
    ok = (bright >= dark) & (best <= MAX_CHROMA_DIST**2)
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
    same_x = fg[:, :, 1:] & (classes[:, :, 1:] == classes[:, :, :-1])  # [B, H, W-1]
    same_y = fg[:, 1:, :] & (classes[:, 1:, :] == classes[:, :-1, :])  # [B, H-1, W]
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
        nb = np.where(inside, cand + step, cand)  # itself (unlabelled) where off the image
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


def _moments(comp: np.ndarray, weight: np.ndarray, xs: np.ndarray, ys: np.ndarray, k: int) -> dict[str, np.ndarray]:
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
    skew = mean(dy2 * dy) / var_y**1.5
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
    if not (isinstance(images, np.ndarray) and images.dtype == np.uint8 and images.ndim == 4 and images.shape[-1] == 3):
        got = f"{type(images).__name__} {getattr(images, 'dtype', '')} {getattr(images, 'shape', '')}"
        raise ValueError(f"detect_batch: images must be a uint8 numpy array [B, H, W, 3], got {got}")
    per_chunk = max(1, CHUNK_PIXELS // (images.shape[1] * images.shape[2]))
    out: list[list[Detection]] = []
    for start in range(0, images.shape[0], per_chunk):
        out.extend(_detect_chunk(images[start : start + per_chunk]))
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
    core = labels.reshape(-1)[pix] >= 0  # the bbox, area and filters use core pixels only
    comp, xs, ys = comp[core], xs[core], ys[core]
    area = np.bincount(comp, minlength=k)
    x0 = np.full(k, w)
    np.minimum.at(x0, comp, xs)
    y0 = np.full(k, h)
    np.minimum.at(y0, comp, ys)
    x1 = np.zeros(k, dtype=np.int64)
    np.maximum.at(x1, comp, xs + 1)
    y1 = np.zeros(k, dtype=np.int64)
    np.maximum.at(y1, comp, ys + 1)
    bw, bh = x1 - x0, y1 - y0
    fill = area / np.maximum(bw * bh, 1)
    side = min(h, w)
    keep = (
        (area >= MIN_AREA_FRAC * h * w)
        & (np.minimum(bw, bh) >= MIN_SIDE_FRAC * side)
        & (bw <= MAX_SIDE_FRAC * w)
        & (bh <= MAX_SIDE_FRAC * h)
        & (np.maximum(bw, bh) <= MAX_ASPECT * np.minimum(bw, bh))
    )
    shapes = _classify_shape(m["skew"], m["quad"])
    colors = classes.reshape(-1)[roots]
    batch = roots // (h * w)
    out: list[list[Detection]] = [[] for _ in range(b)]
    for i in np.nonzero(keep)[0]:
        out[int(batch[i])].append(
            Detection(
                shape=world.SHAPES[int(shapes[i])],
                color=_COLOR_NAMES[int(colors[i])],
                centroid=(float(m["cx"][i]), float(m["cy"][i])),
                area=int(area[i]),
                bbox=(int(x0[i]), int(y0[i]), int(x1[i]), int(y1[i])),
                fill=float(fill[i]),
                skew=float(m["skew"][i]),
                quad=float(m["quad"][i]),
            )
        )
    for dets in out:
        dets.sort(key=lambda d: -d.area)
    return out


def detect(image: np.ndarray) -> list[Detection]:
    """Detections in one uint8 [H, W, 3] image, largest first."""
    if not (isinstance(image, np.ndarray) and image.ndim == 3):
        raise ValueError(f"detect: image must be a uint8 numpy array [H, W, 3], got {getattr(image, 'shape', image)!r}")
    return detect_batch(image[None])[0]
