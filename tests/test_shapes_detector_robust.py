"""The shapes detector on images it was not written against, and the ``geneval`` reward mode.

The renderer here is NOT the world's: shapes are drawn with area coverage (8× supersampling, box
downsampling, so edges are anti-aliased), optionally blurred (Gaussian, σ 0.5–0.7 px), with object
position and size jittered by up to ±1 px (continuous, sizes kept in 7–11 px) from the world's
layout, keeping the world's layout rules (MIN_GAP, RELATION_GAP) on the jittered boxes.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch

from flowrl.shapes import world
from flowrl.shapes.world import COLORS, TASKS, ObjectSpec, Spec, parse, recolor, sample_spec, to_prompt
from flowrl_rewards import build_reward
from flowrl_rewards.compositional.shapes import (
    MODES,
    Detection,
    ShapesReward,
    detect_batch,
    geneval_subscores,
    precision,
)

SUPERSAMPLE = 8
Box = tuple[float, float, float]  # x0, y0, size (px, continuous)


# ------------------------------------------------------------------------------------ test renderer


def _coverage(shape: str, box: Box) -> tuple[np.ndarray, int, int]:
    """Area coverage in [0, 1] of ``shape`` in ``box``: (float [h, w] patch, patch x0, patch y0)."""
    x0, y0, s = box
    px0, py0 = int(np.floor(x0)), int(np.floor(y0))
    px1, py1 = int(np.ceil(x0 + s)), int(np.ceil(y0 + s))
    sub = lambda n, start: (np.arange(n * SUPERSAMPLE) + 0.5) / SUPERSAMPLE + start  # box-relative
    x, y = np.meshgrid(sub(px1 - px0, px0 - x0), sub(py1 - py0, py0 - y0))
    inside = (x >= 0) & (x <= s) & (y >= 0) & (y <= s)
    if shape == "circle":
        inside = (x - s / 2) ** 2 + (y - s / 2) ** 2 <= (s / 2) ** 2
    elif shape == "triangle":
        inside &= np.abs(x - s / 2) <= y / 2
    h, w = py1 - py0, px1 - px0
    patch = inside.reshape(h, SUPERSAMPLE, w, SUPERSAMPLE).mean(axis=(1, 3))
    return patch, px0, py0


def _apart(a: Box, b: Box, gap: float) -> bool:
    return (
        a[0] + a[2] + gap <= b[0] or b[0] + b[2] + gap <= a[0] or a[1] + a[2] + gap <= b[1] or b[1] + b[2] + gap <= a[1]
    )


def _relation_ok(a: Box, b: Box, relation: str) -> bool:
    axis, first, second = {"left of": (0, a, b), "right of": (0, b, a), "above": (1, a, b), "below": (1, b, a)}[
        relation
    ]
    return first[axis] + first[2] + world.RELATION_GAP <= second[axis]


def _jittered_layout(spec: Spec, rng: np.random.Generator) -> list[tuple[str, str, Box]]:
    """The world's layout with every box moved and resized by U(−1, 1) px, world's rules kept."""
    for _ in range(200):
        placed = []
        for shape, color, x0, y0, size in world.layout(spec, rng):
            s = float(np.clip(size + rng.uniform(-1, 1), world.MIN_SIZE, world.MAX_SIZE))
            x, y = (float(np.clip(v + rng.uniform(-1, 1), 0, world.CANVAS - s)) for v in (x0, y0))
            placed.append((shape, color, (x, y, s)))
        boxes = [b for _, _, b in placed]
        ok = all(_apart(a, b, world.MIN_GAP) for i, a in enumerate(boxes) for b in boxes[i + 1 :])
        if ok and (spec.task != "position" or _relation_ok(boxes[0], boxes[1], spec.relation)):
            return placed
    raise RuntimeError(f"no jittered layout for {to_prompt(spec)!r}")


def _blur(image: np.ndarray, sigma: float) -> np.ndarray:
    """float [H, W, 3] convolved with a Gaussian of ``sigma`` px (separable, zero padding)."""
    r = int(np.ceil(3 * sigma))
    k = np.exp(-0.5 * (np.arange(-r, r + 1) / sigma) ** 2)
    k /= k.sum()
    conv = lambda v: np.convolve(v, k, mode="same")
    return np.apply_along_axis(conv, 1, np.apply_along_axis(conv, 0, image))


def _compose(objects: list[tuple[str, str, Box]], sigma: float = 0.0) -> np.ndarray:
    """uint8 [32, 32, 3]: (shape, colour, box) objects anti-aliased on black, blurred when ``sigma`` > 0."""
    image = np.zeros((world.CANVAS, world.CANVAS, 3))
    for shape, color, box in objects:
        patch, x0, y0 = _coverage(shape, box)
        h, w = patch.shape
        image[y0 : y0 + h, x0 : x0 + w] += patch[..., None] * np.array(COLORS[color])
    if sigma > 0:
        image = _blur(image, sigma)
    return np.clip(np.round(image), 0, 255).astype(np.uint8)


def render_aa(spec: Spec, rng: np.random.Generator, sigma: float = 0.0) -> np.ndarray:
    """uint8 [32, 32, 3]: ``spec`` in this file's style (jittered layout, anti-aliased, optional blur)."""
    return _compose(_jittered_layout(spec, rng), sigma)


def robust_batch(specs: list[Spec], seed: int) -> np.ndarray:
    """uint8 [n, 32, 32, 3]: ``specs`` by :func:`render_aa`, odd ones blurred with σ ~ U(0.5, 0.7)."""
    rng = np.random.default_rng(seed)
    return np.stack([render_aa(s, rng, float(rng.uniform(0.5, 0.7)) if i % 2 else 0.0) for i, s in enumerate(specs)])


def _specs(n: int, seed: int, tasks: tuple[str, ...] = TASKS) -> list[Spec]:
    """n random specs, cycling through ``tasks``."""
    rng = np.random.default_rng(seed)
    return [sample_spec(rng, tasks[i % len(tasks)]) for i in range(n)]


def _as_tensor(images: np.ndarray) -> torch.Tensor:
    """float [B, 3, H, W] in [0, 1] from uint8 [B, H, W, 3]."""
    return torch.from_numpy(images).permute(0, 3, 1, 2).float() / 255


def _score(prompts: list[str], images: np.ndarray, mode: str = "strict") -> np.ndarray:
    return ShapesReward(mode)(_as_tensor(images), prompts).numpy()


def _draw(objects: list[tuple[str, str, int, int]], size: int = 9) -> np.ndarray:
    """uint8 [32, 32, 3] with (shape, colour, x0, y0) objects drawn the world's way at fixed places."""
    image = np.zeros((32, 32, 3), dtype=np.uint8)
    for shape, color, x0, y0 in objects:
        image[y0 : y0 + size, x0 : x0 + size][world.shape_mask(shape, size)] = COLORS[color]
    return image


# ------------------------------------------------------------------------------ faithful robust renders


def test_faithful_robust_renders_score_at_least_098_strict():
    specs = _specs(500, seed=2024)
    strict = _score([to_prompt(s) for s in specs], robust_batch(specs, seed=1))
    assert strict.mean() >= 0.98
    assert strict[0::2].mean() >= 0.98 and strict[1::2].mean() >= 0.98  # sharp, blurred
    tasks = np.array([s.task for s in specs])
    for task in TASKS:
        assert strict[tasks == task].mean() >= 0.96, task


@pytest.mark.parametrize("sigma", [0.0, 0.6])
def test_small_objects_at_any_subpixel_offset_keep_their_shape(sigma):
    """7–8 px objects of every shape and colour at random sub-pixel places (the bbox fill-ratio
    detector read 6–9 % of these circles as triangles or squares)."""
    rng = np.random.default_rng(7)
    for shape in world.SHAPES:
        images = [
            _compose(
                [(shape, list(COLORS)[k % len(COLORS)], (rng.uniform(1, 23), rng.uniform(1, 23), rng.uniform(7, 8)))],
                sigma,
            )
            for k in range(120)
        ]
        right = [len(d) == 1 and d[0].shape == shape for d in detect_batch(np.stack(images))]
        assert np.mean(right) >= 0.98, (shape, np.mean(right))


def test_shading_inside_an_object_does_not_change_its_shape():
    """A vertical brightness ramp (1 → 0.45 either way) weighs pixels unevenly; coverage weights
    (brightness relative to the object's peak, capped) keep the shape."""
    rng = np.random.default_rng(8)
    for shape in world.SHAPES:
        images = []
        for k in range(60):
            image = _compose([(shape, "green", (rng.uniform(2, 20), rng.uniform(2, 20), rng.uniform(7, 11)))])
            ramp = np.linspace(1.0, 0.45, 32)[:: 1 if k % 2 else -1]
            images.append(np.round(image * ramp[:, None, None]).astype(np.uint8))
        assert all(len(d) == 1 and d[0].shape == shape for d in detect_batch(np.stack(images))), shape


# ------------------------------------------------------------------------------------ one fact wrong

OPPOSITE = {"left of": "right of", "right of": "left of", "above": "below", "below": "above"}


def _with_objects(spec: Spec, objects: tuple[ObjectSpec, ...]) -> Spec:
    """``spec`` drawing ``objects`` instead; an "and" pair gets the task its objects make."""
    task = spec.task
    if task in ("two_objects", "color_attr"):
        a, b = objects
        task = "two_objects" if a.shape == b.shape or a.color == b.color else "color_attr"
    return replace(spec, task=task, objects=objects)


def _change(spec: Spec, field: str, rng: np.random.Generator) -> Spec:
    """``spec`` with one object's ``field`` ("shape" or "color") set to another value, objects kept distinct."""
    i = int(rng.integers(len(spec.objects)))
    objects = list(spec.objects)
    values = world.SHAPES if field == "shape" else tuple(COLORS)
    options = [
        v for v in values if v != getattr(objects[i], field) and replace(objects[i], **{field: v}) not in objects
    ]
    objects[i] = replace(objects[i], **{field: options[int(rng.integers(len(options)))]})
    return _with_objects(spec, tuple(objects))


def _count_off(spec: Spec, rng: np.random.Generator) -> Spec:
    (o,) = spec.objects
    counts = [c for c in (o.count - 1, o.count + 1) if 1 <= c <= world.MAX_COUNT]
    return replace(spec, objects=(replace(o, count=counts[int(rng.integers(len(counts)))]),))


def _swap_colors(spec: Spec, rng: np.random.Generator) -> Spec:
    a, b = spec.objects
    return recolor(spec, {a.color: b.color, b.color: a.color})


def _drop_one(spec: Spec, rng: np.random.Generator) -> Spec:
    return Spec("single", (spec.objects[int(rng.integers(2))],))


def _mirror(spec: Spec, rng: np.random.Generator) -> Spec:
    return replace(spec, relation=OPPOSITE[spec.relation])


WRONG = {  # kind → (tasks it applies to, spec → what gets drawn instead)
    "count_off_by_one": (("counting",), _count_off),
    "relation_mirrored": (("position",), _mirror),
    "colors_swapped": (("color_attr",), _swap_colors),
    "object_dropped": (("two_objects", "color_attr", "position"), _drop_one),
    "wrong_shape": (TASKS, lambda spec, rng: _change(spec, "shape", rng)),
    "wrong_color": (TASKS, lambda spec, rng: _change(spec, "color", rng)),
}


@pytest.mark.parametrize("kind", list(WRONG))
def test_one_fact_wrong_scores_zero_strict(kind):
    tasks, wrong = WRONG[kind]
    rng = np.random.default_rng(list(WRONG).index(kind))
    specs = _specs(120, seed=100 + list(WRONG).index(kind), tasks=tasks)
    images = robust_batch([wrong(s, rng) for s in specs], seed=5)
    prompts = [to_prompt(s) for s in specs]
    assert _score(prompts, images).sum() == 0
    assert (_score(prompts, images, "geneval") < 1).all()  # every fact costs geneval credit too


def test_blank_white_and_noise_score_zero():
    prompts = [to_prompt(s) for s in _specs(200, seed=9)]
    blank = np.zeros((len(prompts), 32, 32, 3), dtype=np.uint8)
    white = np.full_like(blank, 255)
    noise = np.random.default_rng(0).integers(0, 256, blank.shape, dtype=np.uint8)
    for images in (blank, white, noise):
        for mode in ("strict", "precise", "geneval"):
            assert _score(prompts, images, mode).sum() == 0, mode


# ---------------------------------------------------------------------------------------- geneval


def _det(shape: str, color: str, x: float = 10.0, y: float = 10.0) -> Detection:
    return Detection(shape, color, (x, y), area=50, bbox=(int(x) - 4, int(y) - 4, int(x) + 4, int(y) + 4))


def test_geneval_subscores_per_task_on_hand_made_detections():
    red_circle, blue_circle = _det("circle", "red"), _det("circle", "blue")
    two = parse("a red circle and a blue circle")
    assert geneval_subscores(two, [red_circle, blue_circle], 32) == {"presence": 1.0, "color": 1.0}
    assert geneval_subscores(two, [red_circle], 32) == {"presence": 0.5, "color": 0.5}  # two circles needed
    assert geneval_subscores(two, [red_circle, _det("circle", "green")], 32) == {"presence": 1.0, "color": 0.5}
    assert geneval_subscores(parse("a red circle"), [blue_circle], 32) == {"presence": 1.0, "color": 0.0}
    assert geneval_subscores(parse("three red circles"), [red_circle] * 5, 32) == {"count": pytest.approx(1 / 3)}
    assert geneval_subscores(parse("one red circle"), [red_circle] * 3, 32) == {"count": 0.0}  # floored at 0
    attr = parse("a red square and a blue circle")
    red_square = _det("square", "red")
    assert geneval_subscores(attr, [red_square, blue_circle], 32) == {"binding": 1.0}
    assert geneval_subscores(attr, [red_square], 32) == {"binding": 0.5}
    assert geneval_subscores(attr, [red_square, blue_circle, _det("circle", "red")], 32) == {"binding": 0.5}
    assert geneval_subscores(attr, [_det("square", "blue"), red_circle], 32) == {"binding": 0.0}
    pos = parse("a red circle left of a blue circle")
    assert geneval_subscores(pos, [_det("circle", "red", 5), _det("circle", "blue", 20)], 32) == {"relation": 1.0}
    assert geneval_subscores(pos, [_det("circle", "red", 20), _det("circle", "blue", 5)], 32) == {"relation": 0.0}
    assert precision(two, [red_circle, blue_circle, _det("square", "red"), _det("triangle", "cyan")]) == 0.5
    assert precision(two, []) == 0.0


@pytest.mark.parametrize("prompt", ["three green triangles", "two green triangles", "four green triangles"])
def test_geneval_count_off_by_one_earns_one_minus_one_over_n(prompt):
    spec = parse(prompt)
    n = spec.objects[0].count
    rng = np.random.default_rng(n)
    off = [
        _with_objects(spec, (replace(spec.objects[0], count=k),)) for k in (n - 1, n + 1) if 1 <= k <= world.MAX_COUNT
    ]
    images = np.stack([world.render(s, rng) for s in off])
    assert _score([prompt] * len(images), images, "geneval") == pytest.approx(1 - 1 / n)
    assert _score([prompt] * len(images), images, "precise") == pytest.approx(0.75)  # 3 of 4 requirements


def test_geneval_mirrored_relation_earns_zero():
    image = _draw([("circle", "red", 2, 10), ("square", "blue", 20, 10)])
    prompts = ["a red circle left of a blue square", "a red circle right of a blue square"]
    assert _score(prompts, np.stack([image, image]), "geneval").tolist() == [1.0, 0.0]
    assert _score(prompts[1:], image[None], "partial").item() == pytest.approx(6 / 7)  # partial still pays


def test_geneval_perfect_image_earns_one():
    specs = _specs(100, seed=12)
    prompts = [to_prompt(s) for s in specs]
    rng = np.random.default_rng(12)
    assert (_score(prompts, np.stack([world.render(s, rng) for s in specs]), "geneval") == 1.0).all()
    assert (_score(prompts, robust_batch(specs, seed=3), "geneval") == 1.0).mean() >= 0.98


@pytest.mark.parametrize(
    "prompt, objects",
    [
        ("a red circle", [("circle", "red", 2, 2)]),
        ("a red circle and a red square", [("circle", "red", 2, 2), ("square", "red", 22, 2)]),
        ("two green triangles", [("triangle", "green", 2, 2), ("triangle", "green", 22, 2)]),
        ("a red square and a green circle", [("square", "red", 2, 2), ("circle", "green", 22, 2)]),
        ("a red circle left of a blue square", [("circle", "red", 2, 2), ("square", "blue", 22, 2)]),
    ],
)
def test_geneval_spraying_extra_objects_lowers_the_score(prompt, objects):
    extras = [("triangle", "cyan", 2, 22), ("square", "yellow", 22, 22), ("circle", "magenta", 12, 12)]
    images = np.stack([_draw(objects + extras[:k], size=8) for k in range(len(extras) + 1)])
    scores = _score([prompt] * len(images), images, "geneval")
    assert scores[0] == 1.0
    assert scores.tolist() == pytest.approx([len(objects) / (len(objects) + k) for k in range(len(extras) + 1)])


def test_geneval_mode_registry_and_details_column():
    reward = build_reward("shapes", mode="geneval")
    assert isinstance(reward, ShapesReward) and reward.mode == "geneval" and "geneval" in MODES
    image = _draw([("circle", "red", 2, 2), ("square", "blue", 20, 2)])  # the blue circle is missing
    d = reward.details(image[None], ["a red circle and a blue circle"])
    # presence 1/2 (one circle of two), color 1/2 (the red circle), precision 1/2 (the square is extra)
    assert d["geneval"].dtype == np.float32 and d["geneval"].tolist() == [0.25]
    assert reward(_as_tensor(image[None]), ["a red circle and a blue circle"]).tolist() == d["geneval"].tolist()
