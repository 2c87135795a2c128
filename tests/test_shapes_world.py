"""The shapes world: grammar round trips, parse errors, rendering rules, prompt sets."""

from __future__ import annotations

import subprocess
import sys
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from flowrl.paths import CONFIG_DIR
from flowrl.shapes import prompt_sets as sets
from flowrl.shapes import world
from flowrl.shapes.prompt_sets import prompt_sets
from flowrl.shapes.world import (
    CANVAS,
    COLORS,
    SHAPES,
    TASKS,
    ObjectSpec,
    Spec,
    parse,
    render,
    sample_spec,
    to_prompt,
    vocabulary,
)

ROOT = Path(__file__).resolve().parents[1]
PROMPT_DIR = CONFIG_DIR / "shapes" / "prompts"


# ------------------------------------------------------------------------------------------ grammar


def test_vocabulary_is_the_23_lower_case_words():
    vocab = vocabulary()
    assert vocab == sorted(set(vocab))
    assert all(w == w.lower() and w.isalpha() for w in vocab)
    assert len(vocab) == 23
    assert {"a", "and", "of", "left", "right", "above", "below", "circles", "four"} <= set(vocab)


@pytest.mark.parametrize("task", TASKS)
def test_round_trip_every_spec(task):
    specs = world.all_specs(task)
    assert len(specs) == len(set(specs)) > 0
    for spec in specs:
        prompt = to_prompt(spec)
        assert parse(prompt) == spec, prompt
        assert set(prompt.split()) <= set(vocabulary())


def test_round_trip_sampled_specs_and_task_counts():
    rng = np.random.default_rng(0)
    specs = [sample_spec(rng) for _ in range(1000)]
    assert all(parse(to_prompt(s)) == s for s in specs)
    counts = Counter(s.task for s in specs)
    assert set(counts) == set(TASKS) and min(counts.values()) > 150


def test_examples_parse_to_the_documented_specs():
    assert parse("a red circle") == Spec("single", (ObjectSpec("circle", "red"),))
    assert parse("  A Red  Circle ") == parse("a red circle")
    assert parse("one green triangle") == Spec("counting", (ObjectSpec("triangle", "green", 1),))
    assert parse("three green triangles") == Spec("counting", (ObjectSpec("triangle", "green", 3),))
    assert parse("a red circle and a red square").task == "two_objects"
    assert parse("a red circle and a blue circle").task == "two_objects"
    assert parse("a red square and a green circle").task == "color_attr"
    pos = parse("a yellow square left of a blue circle")
    assert pos == Spec("position", (ObjectSpec("square", "yellow"), ObjectSpec("circle", "blue")), "left of")
    assert to_prompt(pos) == "a yellow square left of a blue circle"


@pytest.mark.parametrize(
    "prompt, named",
    [
        ("a purple circle", "'purple'"),
        ("a red blob", "'blob'"),
        ("two red circle", "'circle'"),
        ("a red circles", "'circles'"),
        ("five red circles", "'five'"),
        ("a red circle near a blue square", "'near'"),
        ("a red circle left a blue square", "'left'"),
        ("a red circle and two blue squares", "'two'"),
        ("two red circles and a blue square", "'and'"),
        ("a red circle and a blue square please", "'please'"),
        ("a red circle and", "end of the prompt"),
        ("a red circle and a red circle", "red circle"),
        ("a red circle above a red circle", "red circle"),
        ("", "empty"),
    ],
)
def test_parse_errors_name_the_word(prompt, named):
    with pytest.raises(ValueError) as err:
        parse(prompt)
    assert named in str(err.value)


@pytest.mark.parametrize(
    "spec, named",
    [
        (Spec("single", (ObjectSpec("circle", "purple"),)), "'purple'"),
        (Spec("single", (ObjectSpec("hexagon", "red"),)), "'hexagon'"),
        (Spec("counting", (ObjectSpec("circle", "red", 5),)), "5"),
        (Spec("single", (ObjectSpec("circle", "red", 2),)), "count 1"),
        (Spec("sorting", (ObjectSpec("circle", "red"),)), "'sorting'"),
        (Spec("two_objects", (ObjectSpec("circle", "red"), ObjectSpec("square", "blue"))), "color_attr"),
        (Spec("color_attr", (ObjectSpec("circle", "red"), ObjectSpec("square", "red"))), "two_objects"),
        (Spec("position", (ObjectSpec("circle", "red"), ObjectSpec("square", "red")), "near"), "'near'"),
        (Spec("single", (ObjectSpec("circle", "red"),), "above"), "no relation"),
    ],
)
def test_invalid_specs_are_rejected(spec, named):
    with pytest.raises(ValueError) as err:
        to_prompt(spec)
    assert named in str(err.value)


def test_sample_spec_is_deterministic_and_respects_exclude():
    a = [sample_spec(np.random.default_rng(5)) for _ in range(3)]
    assert a[0] == a[1] == a[2]
    exclude = sets.held_out_pairs(0)
    rng = np.random.default_rng(1)
    for task in TASKS:
        for _ in range(200):
            spec = sample_spec(rng, task, exclude=exclude)
            assert spec.task == task
            assert not any((o.shape, o.color) in exclude for o in spec.objects)
    with pytest.raises(ValueError, match="'sorting'"):
        sample_spec(rng, "sorting")


# ---------------------------------------------------------------------------------------- rendering


def test_render_is_deterministic_and_uses_only_the_palette():
    spec = parse("a yellow square left of a blue circle")
    img = render(spec, np.random.default_rng(3))
    assert img.shape == (CANVAS, CANVAS, 3) and img.dtype == np.uint8
    assert np.array_equal(img, render(spec, np.random.default_rng(3)))
    colors = {tuple(int(v) for v in p) for p in img.reshape(-1, 3)}
    assert colors == {(0, 0, 0), COLORS["yellow"], COLORS["blue"]}


def test_layouts_keep_sizes_gaps_and_relations():
    rng = np.random.default_rng(4)
    for _ in range(600):
        spec = sample_spec(rng)
        boxes = world.layout(spec, rng)
        assert len(boxes) == sum(o.count for o in spec.objects)
        for i, (_s, _c, x0, y0, size) in enumerate(boxes):
            assert world.MIN_SIZE <= size <= world.MAX_SIZE
            assert 0 <= x0 and x0 + size <= CANVAS and 0 <= y0 and y0 + size <= CANVAS
            for _s2, _c2, x1, y1, size1 in boxes[i + 1 :]:
                assert world._boxes_apart((x0, y0, size), (x1, y1, size1), world.MIN_GAP)
        if spec.task == "position":
            (_, _, ax, ay, asz), (_, _, bx, by, bsz) = boxes
            gap = {
                "left of": bx - (ax + asz),
                "right of": ax - (bx + bsz),
                "above": by - (ay + asz),
                "below": ay - (by + bsz),
            }[spec.relation]
            assert gap >= world.RELATION_GAP


def test_shape_masks_have_the_expected_fill():
    for size in range(world.MIN_SIZE, world.MAX_SIZE + 1):
        fill = {s: world.shape_mask(s, size).mean() for s in SHAPES}
        assert fill["square"] == 1.0
        assert 0.7 < fill["circle"] < 0.9
        assert 0.4 < fill["triangle"] < 0.6


# -------------------------------------------------------------------------------------- prompt sets


def _pairs_in(prompt: str) -> set[tuple[str, str]]:
    return {(o.shape, o.color) for o in parse(prompt).objects}


def test_prompt_sets_hold_out_pairs_and_are_disjoint():
    train, eval_ = prompt_sets(0)
    held = set(sets.held_out_pairs(0))
    assert len(held) == sets.N_HELD_OUT
    assert len({s for s, _ in held}) == len({c for _, c in held}) == sets.N_HELD_OUT
    assert not any(_pairs_in(p) & held for p in train)
    assert not set(train) & set(eval_)
    assert 300 <= len(set(train)) and len(train) <= 5000
    assert len(eval_) == 5 * sets.EVAL_PER_TASK == 240
    eval_tasks = Counter(parse(p).task for p in eval_)
    assert set(eval_tasks.values()) == {sets.EVAL_PER_TASK}
    train_tasks = Counter(parse(p).task for p in train)
    assert set(train_tasks.values()) == {sets.TRAIN_PER_TASK}
    for task in TASKS:  # every task tests both novel pairs and unseen compositions of seen pairs
        prompts = {p for p in eval_ if parse(p).task == task}
        assert any(_pairs_in(p) & held for p in prompts)
        assert any(not _pairs_in(p) & held for p in prompts)
    assert prompt_sets(0) == (train, eval_)
    assert prompt_sets(1) != (train, eval_)


def test_prompt_files_match_prompt_sets_and_vocabulary():
    train, eval_ = prompt_sets(0)
    files = {name: (PROMPT_DIR / name).read_text().splitlines() for name in ("train.txt", "eval.txt")}
    assert files["train.txt"] == train, "train.txt is stale: run scripts/make_shapes_prompts.py"
    assert files["eval.txt"] == eval_, "eval.txt is stale: run scripts/make_shapes_prompts.py"
    vocab = set(vocabulary())
    words = {w for lines in files.values() for line in lines for w in line.split()}
    assert words <= vocab, words - vocab
    assert words == vocab  # the prompt files use every word


def test_make_shapes_prompts_check_mode(tmp_path):
    script = ROOT / "scripts" / "make_shapes_prompts.py"
    run = lambda *a: subprocess.run([sys.executable, str(script), *a], capture_output=True, text=True)
    assert run("--check").returncode == 0
    assert run("--out", str(tmp_path), "--check").returncode == 1
    assert run("--out", str(tmp_path), "--seed", "0").returncode == 0
    assert (tmp_path / "eval.txt").read_text() == (PROMPT_DIR / "eval.txt").read_text()
