"""GenEval's scoring rules (rewards/compositional/geneval_rules.py) on hand-made detections, GenEval's templates, and
the shapes
world's reward scored through the same rules."""

import json

import numpy as np
import pytest

from flowrl.shapes import world
from flowrl_rewards.compositional import geneval_rules as rules
from flowrl_rewards.compositional.geneval_prompts import COCO_CLASSES, TaskBook, parse_prompt
from flowrl_rewards.compositional.shapes import (
    ShapesReward,
    geneval_objects,
    geneval_task,
    requirements,
    shapes_relation,
    to_uint8_hwc,
)
from flowrl_rewards.compositional.shapes_detector import detect_batch

F = rules.Found


def box(x, y, w=40, h=40, score=0.95, color=None):
    """A detection of size w×h centred at (x, y)."""
    return F((x - w / 2, y - h / 2, x + w / 2, y + h / 2), score, color)


def task(line: dict) -> rules.Task:
    return rules.Task.from_metadata(line)


SINGLE = task({"tag": "single_object", "include": [{"class": "bench", "count": 1}], "prompt": "a photo of a bench"})
TWO = task(
    {
        "tag": "two_object",
        "include": [{"class": "cat", "count": 1}, {"class": "dog", "count": 1}],
        "prompt": "a photo of a cat and a dog",
    }
)
COUNT = task(
    {
        "tag": "counting",
        "include": [{"class": "pizza", "count": 3}],
        "exclude": [{"class": "pizza", "count": 4}],
        "prompt": "a photo of three pizzas",
    }
)
COLOR = task(
    {"tag": "colors", "include": [{"class": "car", "count": 1, "color": "red"}], "prompt": "a photo of a red car"}
)
POSITION = task(
    {
        "tag": "position",
        "include": [{"class": "dog", "count": 1}, {"class": "cat", "count": 1, "position": ["left of", 0]}],
        "prompt": "a photo of a cat left of a dog",
    }
)
ATTR = task(
    {
        "tag": "color_attr",
        "include": [{"class": "car", "count": 1, "color": "red"}, {"class": "bench", "count": 1, "color": "blue"}],
        "prompt": "a photo of a red car and a blue bench",
    }
)


# ---- each task: a pass and each way to fail ---------------------------------------------------------------
def test_single_object_pass_and_missing():
    assert rules.judge(SINGLE, {"bench": [box(50, 50)]}).strict
    missing = rules.judge(SINGLE, {"dog": [box(50, 50)]})
    assert not missing.strict and missing.reasons == ("expected bench>=1, found 0",)
    assert missing.partial == 0.0 and not missing.exact
    extra = rules.judge(SINGLE, {"bench": [box(20, 20), box(80, 80)]})  # GenEval: at least one
    assert extra.strict and not extra.exact and extra.partial == 0.0  # Flow-GRPO: exact count, 1 − |1 − 2|


def test_two_object_pass_and_one_missing():
    assert rules.judge(TWO, {"cat": [box(20, 50)], "dog": [box(80, 50)]}).strict
    v = rules.judge(TWO, {"cat": [box(20, 50)]})
    assert not v.strict and v.partial == pytest.approx(0.5)


def test_counting_exact_and_wrong_counts():
    three = {"pizza": [box(20, 20), box(50, 50), box(80, 80)]}
    assert rules.judge(COUNT, three).strict and rules.judge(COUNT, three).partial == 1.0
    two = rules.judge(COUNT, {"pizza": [box(20, 20), box(50, 50)]})
    assert not two.strict and two.partial == pytest.approx(1 - 1 / 3)
    four = rules.judge(COUNT, {"pizza": [box(10 + 25 * i, 50) for i in range(4)]})  # the exclude clause
    assert not four.strict and four.reasons == ("expected pizza<4, found 4",)
    eight = rules.judge(COUNT, {"pizza": [box(10 + 10 * i, 50, 8, 8) for i in range(8)]})
    assert eight.partial == pytest.approx(1 - 5 / 3)  # the server's count term is not floored


def test_colors_pass_wrong_colour_and_top_detection_only():
    assert rules.judge(COLOR, {"car": [box(50, 50, color="red")]}).strict
    wrong = rules.judge(COLOR, {"car": [box(50, 50, color="blue")]})
    assert not wrong.strict and "expected red car>=1, found 0 red" in wrong.reasons[0] and wrong.partial == 0.5
    # GenEval checks the colour of the most confident car only; Flow-GRPO needs the count exact first
    second = rules.judge(COLOR, {"car": [box(20, 50, 0.9, color="blue"), box(80, 50, 0.8, color="red")]})
    assert not second.strict and second.partial == 0.0


def test_position_pass_wrong_relation_and_missing_target():
    ok = {"cat": [box(20, 50)], "dog": [box(80, 50)]}
    assert rules.judge(POSITION, ok).strict and rules.judge(POSITION, ok).partial == 1.0
    wrong = rules.judge(POSITION, {"cat": [box(80, 50)], "dog": [box(20, 50)]})
    assert not wrong.strict and wrong.reasons == ("expected cat left of target, found right of target",)
    assert wrong.partial == pytest.approx(2 / 3)  # count terms 1, 1, relation 0 (the server would give 5/6)
    no_target = rules.judge(POSITION, {"cat": [box(20, 50)]})
    assert not no_target.strict and "expected dog>=1, found 0" in no_target.reasons


def test_color_attr_pass_swapped_and_missing():
    assert rules.judge(ATTR, {"car": [box(20, 50, color="red")], "bench": [box(80, 50, color="blue")]}).strict
    swapped = rules.judge(ATTR, {"car": [box(20, 50, color="blue")], "bench": [box(80, 50, color="red")]})
    assert not swapped.strict and len(swapped.reasons) == 2 and swapped.partial == 0.5
    assert not rules.judge(ATTR, {"car": [box(20, 50, color="red")]}).strict


def test_a_colour_clause_needs_classified_detections():
    with pytest.raises(ValueError, match="no colour"):
        rules.judge(COLOR, {"car": [box(50, 50)]})


# ---- GenEval's detection settings and relation -----------------------------------------------------------
def test_keep_applies_thresholds_order_limit_and_overlap():
    raw = {
        "dog": [box(10, 10, score=0.31), box(30, 30, score=0.8), box(50, 50, score=0.3)],
        "cat": [box(1, 1, score=0.2)],
    }
    kept = rules.keep(raw, "two_object")
    assert [f.score for f in kept["dog"]] == [0.8, 0.31] and "cat" not in kept  # strictly above 0.3
    assert "dog" not in rules.keep(raw, "counting")  # counting prompts keep > 0.9 only
    many = {"dog": [box(i, i, score=0.5 + i / 100) for i in range(20)]}
    assert len(rules.keep(many, "single_object")["dog"]) == 16
    overlapping = {"dog": [box(50, 50, score=0.9), box(51, 50, score=0.8), box(90, 90, score=0.7)]}
    assert len(rules.keep(overlapping, "single_object")["dog"]) == 3  # max_overlap 1.0: no suppression
    assert len(rules.keep(overlapping, "single_object", rules.Thresholds(max_overlap=0.5))["dog"]) == 2


def test_relative_position_margin_and_diagonals():
    a, b = box(20, 50, 20, 20), box(80, 50, 20, 20)
    assert rules.relative_position(a, b) == {"left of"} and rules.relative_position(b, a) == {"right of"}
    assert rules.relative_position(box(50, 20), box(50, 80)) == {"above"}
    close = box(50, 50, 40, 40), box(57, 50, 40, 40)  # offset 7 < 0.1 × (40 + 40)
    assert rules.relative_position(*close) == set()
    diag = rules.relative_position(box(10, 10, 2, 2), box(90, 90, 2, 2))
    assert diag == {"left of", "above"}  # each axis carries 0.7 of the offset


def test_metadata_round_trip_and_errors():
    for t in (SINGLE, TWO, COUNT, COLOR, POSITION, ATTR):
        assert rules.Task.from_metadata(t.to_metadata()) == t
    with pytest.raises(ValueError, match="tag='nope'"):
        rules.Task.from_metadata({"tag": "nope", "prompt": "x", "include": [{"class": "a", "count": 1}]})
    with pytest.raises(ValueError, match=r"include\[0\].count=0"):
        rules.Task.from_metadata({"tag": "counting", "prompt": "x", "include": [{"class": "a", "count": 0}]})
    with pytest.raises(ValueError, match="refers to clause 1"):
        rules.Task.from_metadata(
            {"tag": "position", "prompt": "x", "include": [{"class": "a", "count": 1, "position": ["above", 1]}]}
        )


def test_task_scores_and_geneval_summary_layout():
    v = [
        rules.Verdict("single_object", True, True, 1.0),
        rules.Verdict("single_object", False, False, 0.0),
        rules.Verdict("counting", True, True, 1.0),
        rules.Verdict("counting", True, True, 1.0),
    ]
    s = rules.task_scores(v, prompts=["a", "a", "b", "c"])
    assert s["single_object"] == 0.5 and s["counting"] == 1.0 and s["overall"] == 0.75
    assert s["images"] == 0.75 and s["prompts"] == 1.0 and s["n/counting"] == 2
    text = rules.summary_text(s, n_prompts=3)
    assert "single_object    = 50.00% (1 / 2)" in text and "Overall score (avg. over tasks): 0.75000" in text
    assert "position" not in text


# ---- GenEval's templates -----------------------------------------------------------------------------------
def test_templates_give_each_tasks_metadata():
    for t in (SINGLE, TWO, COUNT, COLOR, POSITION, ATTR):
        assert parse_prompt(t.prompt) == t
    assert parse_prompt("a photo of an orange parking meter and a white teddy bear") == rules.Task(
        "color_attr",
        "a photo of an orange parking meter and a white teddy bear",
        (rules.Clause("parking meter", 1, "orange"), rules.Clause("teddy bear", 1, "white")),
    )
    assert parse_prompt("a photo of four buses").include == (rules.Clause("bus", 4),)
    assert parse_prompt("a photo of a cat") is not None and parse_prompt("a painting of a cat") is None
    assert parse_prompt("a photo of a unicorn") is None


def test_task_book_prefers_metadata_and_names_a_bad_line(tmp_path):
    meta = tmp_path / "m.jsonl"
    record = {
        "tag": "colors",
        "include": [{"class": "giraffe", "count": 1, "color": "blue"}],
        "prompt": "a blue giraffe",
    }
    meta.write_text(json.dumps(record) + "\n\n")
    book = TaskBook([meta])
    assert book("a  blue giraffe").include[0].color == "blue"  # whitespace folded
    assert book("a photo of a dog").tag == "single_object"
    with pytest.raises(ValueError, match="not a GenEval prompt"):
        book("a blue unicorn")
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps(record) + '\n{"tag": "x"}\n')
    with pytest.raises(ValueError, match="bad.jsonl, line 2"):
        TaskBook([bad])
    assert len(COCO_CLASSES) == 80


# ---- the shapes world: its strict score is GenEval's verdict over its detector ----------------------------
def test_shapes_strict_is_geneval_verdict_with_the_shapes_requirements():
    """On renders scored against other prompts of every task (every way to fail), strict through the shared rules
    equals "every requirement of the shapes reward met", image by image."""
    rng = np.random.default_rng(0)
    images, prompts = [], []
    for task_name in world.TASKS:
        for _ in range(60):
            drawn = world.sample_spec(rng, task_name)
            asked = drawn if rng.random() < 0.3 else world.sample_spec(rng, task_name)
            images.append(world.render(drawn, rng))
            prompts.append(world.to_prompt(asked))
    arr = np.stack(images)
    side = arr.shape[1]
    relation = shapes_relation(side)
    dets = detect_batch(arr)
    strict = ShapesReward().details(arr, prompts)["strict"]
    fails = set()
    for p, d, s in zip(prompts, dets, strict):
        spec = world.parse(p)
        req = requirements(spec, d, side)
        verdict = rules.judge(geneval_task(spec, p), geneval_objects(d), relation)
        assert verdict.strict == all(req.values()) == bool(s), p
        fails |= {k.split("/")[-1] for k, ok in req.items() if not ok}
    assert {"object", "count", "bound", "relation"} <= fails  # every way to fail was exercised
    assert 0.2 < strict.mean() < 0.8


def test_shapes_geneval_task_clauses():
    spec = world.parse("three green triangles")
    t = geneval_task(spec)
    assert t.tag == "counting" and t.include == (rules.Clause("green triangle", 3),)
    assert t.exclude == (rules.Clause("green triangle", 4),)
    t = geneval_task(world.parse("a red square and a green circle"))
    assert t.tag == "color_attr" and {c.cls for c in t.exclude} == {"green square", "red circle"}
    t = geneval_task(world.parse("a yellow square left of a blue circle"))
    assert t.include == (rules.Clause("blue circle", 1), rules.Clause("yellow square", 1, position=("left of", 0)))
    arr = to_uint8_hwc(np.zeros((1, 32, 32, 3), dtype=np.uint8))
    assert geneval_objects(detect_batch(arr)[0]) == {}
