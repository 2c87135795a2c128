"""The shapes reward: detector accuracy, zero for wrong images, partial credit, diagnostics."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from flowrl.shapes import world
from flowrl.shapes.world import COLORS, TASKS, parse, recolor, render, sample_spec, to_prompt
from flowrl_rewards import build_reward
from flowrl_rewards.compositional.shapes import ShapesReward, detect, detect_batch, evaluate, label_components


def _batch(n: int, seed: int, task: str | None = None) -> tuple[np.ndarray, list[str], list[world.Spec]]:
    """n fresh renders (uint8 [n, 32, 32, 3]), their prompts and specs."""
    rng = np.random.default_rng(seed)
    specs = [sample_spec(rng, task) for _ in range(n)]
    return np.stack([render(s, rng) for s in specs]), [to_prompt(s) for s in specs], specs


def _as_tensor(images: np.ndarray) -> torch.Tensor:
    """float [B, 3, H, W] in [0, 1] from uint8 [B, H, W, 3]."""
    return torch.from_numpy(images).permute(0, 3, 1, 2).float() / 255


def _draw(objects: list[tuple[str, str, int, int]], size: int = 9) -> np.ndarray:
    """uint8 [32, 32, 3] with (shape, colour, x0, y0) objects of side ``size`` drawn at fixed places."""
    image = np.zeros((32, 32, 3), dtype=np.uint8)
    for shape, color, x0, y0 in objects:
        image[y0 : y0 + size, x0 : x0 + size][world.shape_mask(shape, size)] = COLORS[color]
    return image


def _score(prompts: list[str], images: np.ndarray, mode: str = "strict") -> np.ndarray:
    return ShapesReward(mode)(_as_tensor(images), prompts).numpy()


# ------------------------------------------------------------------------------------------ detector


def test_detector_accuracy_on_2000_fresh_renders():
    images, prompts, _ = _batch(2000, seed=1234)
    result = evaluate(_as_tensor(images), prompts)
    assert result["n"] == 2000
    assert result["accuracy"] >= 0.99, result
    for task in TASKS:
        assert result[f"n/{task}"] > 300
        assert result[f"accuracy/{task}"] >= 0.98, (task, result)
    assert result["colors_found"] >= 0.99


@pytest.mark.parametrize("task", TASKS)
def test_render_detect_recovers_the_spec(task):
    images, _, specs = _batch(60, seed=7, task=task)
    for image, spec, dets in zip(images, specs, detect_batch(images)):
        want = sorted((o.shape, o.color) for o in spec.objects for _ in range(o.count))
        assert sorted((d.shape, d.color) for d in dets) == want, spec
        for d in dets:
            x0, y0, x1, y1 = d.bbox
            assert world.MIN_SIZE - 1 <= max(x1 - x0, y1 - y0) <= world.MAX_SIZE
        if task == "position":
            a = next(d for d in dets if (d.shape, d.color) == (spec.objects[0].shape, spec.objects[0].color))
            b = next(d for d in dets if (d.shape, d.color) == (spec.objects[1].shape, spec.objects[1].color))
            axis, sign = {"left of": (0, 1), "right of": (0, -1), "above": (1, 1), "below": (1, -1)}[spec.relation]
            assert sign * (b.centroid[axis] - a.centroid[axis]) >= world.RELATION_GAP


def test_detector_works_at_other_sizes_and_under_blur():
    images, prompts, _ = _batch(200, seed=11)
    x = _as_tensor(images)
    for big in (
        torch.nn.functional.interpolate(x, scale_factor=3, mode="nearest"),
        torch.nn.functional.interpolate(x, size=(48, 48), mode="bilinear", align_corners=False),
    ):
        assert evaluate(big, prompts)["accuracy"] >= 0.99
    blurred = torch.nn.functional.avg_pool2d(torch.nn.functional.pad(x, (1, 1, 1, 1), mode="replicate"), 3, 1)
    assert evaluate(blurred, prompts)["accuracy"] >= 0.97
    assert evaluate(x * 0.6, prompts)["accuracy"] >= 0.99  # dimmer colours keep their hue


def test_label_components_uses_4_connectivity_and_merges_u_shapes():
    c = np.full((1, 6, 7), -1, dtype=np.int8)
    c[0, 0:5, 0] = c[0, 0:5, 4] = c[0, 4, 0:5] = 2  # a U: its two arms meet only at the bottom
    c[0, 5, 5] = c[0, 4, 6] = 3  # diagonal neighbours: two components
    c[0, 0, 6] = 2  # isolated pixel of the U's colour
    labels = label_components(c)[0]
    assert len(np.unique(labels[c[0] == 2])) == 2  # the U and the lone pixel
    assert labels[0, 0] == labels[0, 4] == labels[4, 2]
    assert labels[5, 5] != labels[4, 6]
    assert (labels[c[0] < 0] == -1).all()


def test_detect_filters_small_and_huge_blobs_and_unknown_colours():
    img = np.zeros((32, 32, 3), dtype=np.uint8)
    img[2:5, 2:5] = COLORS["red"]  # 9 px: too small
    img[10:20, 10:20] = (255, 255, 255)  # white: not a palette colour
    img[22:30, 22:30] = (255, 128, 0)  # orange: halfway between red and yellow
    assert detect(img) == []
    assert detect(np.full((32, 32, 3), COLORS["red"], dtype=np.uint8)) == []  # fills the canvas
    with pytest.raises(ValueError, match="uint8"):
        detect_batch(img.astype(np.float32)[None])


# ----------------------------------------------------------------------------------- zero for wrong


def test_zero_for_blank_white_and_noise():
    _, prompts, _ = _batch(300, seed=21)
    n = len(prompts)
    blank = np.zeros((n, 32, 32, 3), dtype=np.uint8)
    white = np.full((n, 32, 32, 3), 255, dtype=np.uint8)
    noise = np.random.default_rng(0).integers(0, 256, (n, 32, 32, 3), dtype=np.uint8)
    for images in (blank, white, noise):
        assert _score(prompts, images).sum() == 0
    for images in (blank, white):
        assert _score(prompts, images, "partial").sum() == 0


def test_zero_for_wrong_colours():
    rng = np.random.default_rng(31)
    prompts, images = [], []
    for _ in range(300):
        spec = sample_spec(rng)
        used = sorted({o.color for o in spec.objects})
        spare = [c for c in COLORS if c not in used]
        mapping = dict(zip(used, [str(c) for c in rng.permutation(spare)]))  # every colour → an unrequested one
        prompts.append(to_prompt(spec))
        images.append(render(recolor(spec, mapping), rng))
    meta: dict = {}
    scores = ShapesReward()(_as_tensor(np.stack(images)), prompts, meta)
    assert scores.sum() == 0
    assert meta["shapes/colors_found"].sum() == 0


def test_swapped_colours_fail_color_attr_but_not_two_objects():
    rng = np.random.default_rng(41)
    spec = parse("a red square and a green circle")
    swapped = render(recolor(spec, {"red": "green", "green": "red"}), rng)
    correct = render(spec, rng)
    prompts = [to_prompt(spec)] * 2
    assert _score(prompts, np.stack([correct, swapped])).tolist() == [1.0, 0.0]
    partial = _score(prompts, np.stack([correct, swapped]), "partial")
    assert partial[0] == 1.0 and partial[1] == pytest.approx(4 / 7)  # colours and shapes, no binding
    # a leaked extra (a green square beside the right pair) breaks the binding; an unrelated extra does not
    right_pair = [("square", "red", 2, 2), ("circle", "green", 20, 2)]
    leak = _draw(right_pair + [("square", "green", 2, 20)])
    other = _draw(right_pair + [("triangle", "blue", 2, 20)])
    assert _score(prompts[:1] * 3, np.stack([_draw(right_pair), leak, other])).tolist() == [1.0, 0.0, 1.0]
    assert _score(["a red square and a red circle"], leak[None]).item() == 0.0
    assert _score(["a green square and a green circle"], leak[None]).item() == 1.0


# --------------------------------------------------------------------------------- partial credit


def test_partial_gives_intermediate_values_for_half_correct_images():
    rng = np.random.default_rng(51)
    for prompt in (
        "a red circle and a blue circle",
        "a red circle and a red square",
        "a yellow triangle and a cyan square",
        "a red circle left of a blue square",
    ):
        spec = parse(prompt)
        half = render(world.Spec("single", spec.objects[:1]), rng)  # only the first object drawn
        full = render(spec, rng)
        strict = _score([prompt] * 2, np.stack([half, full]))
        partial = _score([prompt] * 2, np.stack([half, full]), "partial")
        assert strict.tolist() == [0.0, 1.0], prompt
        assert 0.0 < partial[0] < 1.0 and partial[1] == 1.0, (prompt, partial)


def test_precise_mode_does_not_pay_for_spraying_extra_objects():
    """partial gives the same credit to a sprayed image (the requested object plus unrequested ones)
    as to a clean one; precise scales it by the fraction of detections that were requested."""
    prompt = "a red circle"
    clean = _draw([("circle", "red", 2, 2)])
    sprayed = _draw(
        [("circle", "red", 2, 2), ("square", "cyan", 20, 2), ("triangle", "green", 2, 20), ("circle", "blue", 20, 20)]
    )
    wrong_only = _draw([("square", "cyan", 20, 2), ("triangle", "green", 2, 20)])
    images = np.stack([clean, sprayed, wrong_only])
    partial = _score([prompt] * 3, images, "partial")
    precise = _score([prompt] * 3, images, "precise")
    assert partial[0] == partial[1] == 1.0
    assert precise[0] == 1.0 and precise[1] == pytest.approx(1 / 4)
    assert precise[2] == 0.0 and _score([prompt], np.zeros((1, 32, 32, 3), np.uint8), "precise")[0] == 0.0


def test_counting_is_exact_and_single_ignores_extras():
    rng = np.random.default_rng(61)
    three = render(parse("three green triangles"), rng)
    two = render(parse("two green triangles"), rng)
    prompts = ["two green triangles", "two green triangles", "a green triangle"]
    assert _score(prompts, np.stack([three, two, three])).tolist() == [0.0, 1.0, 1.0]
    assert _score(prompts[:1], three[None], "partial").item() == pytest.approx(3 / 4)


def test_wrong_relation_fails_position():
    rng = np.random.default_rng(71)
    spec = parse("a red circle left of a blue square")
    image = render(spec, rng)
    mirrored = image[:, ::-1].copy()
    prompt = [to_prompt(spec)]
    assert _score(prompt, image[None]).item() == 1.0
    assert _score(prompt, mirrored[None]).item() == 0.0
    assert _score(prompt, mirrored[None], "partial").item() == pytest.approx(6 / 7)
    assert _score(["a red circle right of a blue square"], mirrored[None]).item() == 1.0


# ------------------------------------------------------------------------------------------- API


def test_registry_meta_and_evaluate():
    reward = build_reward("shapes", mode="partial")
    assert isinstance(reward, ShapesReward) and reward.name == "shapes"
    images, prompts, specs = _batch(10, seed=81)
    meta: dict = {}
    scores = reward(_as_tensor(images), prompts, meta)
    assert scores.dtype == torch.float32 and scores.shape == (10,)
    assert meta["shapes/task"] == [s.task for s in specs]
    for key in ("shapes/strict", "shapes/partial", "shapes/colors_found"):
        assert meta[key].dtype == np.float32 and meta[key].shape == (10,)
    result = reward.evaluate(images, prompts)  # uint8 [B, H, W, 3] is accepted too
    assert result["accuracy"] == pytest.approx(float(meta["shapes/strict"].mean()))
    assert {"accuracy", "partial", "colors_found"} <= set(result)


def test_errors_name_the_bad_value():
    with pytest.raises(ValueError, match=r"shapes: mode='lenient' is not supported.*accepted: \['strict', 'partial'"):
        ShapesReward("lenient")
    with pytest.raises(ValueError, match="'hexagon'"):
        ShapesReward()(torch.zeros(1, 3, 32, 32), ["a red hexagon"])
    with pytest.raises(ValueError, match=r"\[B, 3, H, W\]"):
        ShapesReward().evaluate(torch.zeros(1, 32, 32, 3), ["a red circle"])
