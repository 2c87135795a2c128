"""GenEval's scoring rules, written once, for any detector: the neural one of
:mod:`flowrl_rewards.compositional.geneval` and the
shapes world's colour segmentation (:mod:`flowrl_rewards.compositional.shapes`). Two detectors, one scorer.

The rules are those of GenEval's evaluation script (Ghosh et al. 2023, ``evaluation/evaluate_images.py`` of
djghosh13/geneval) and of Flow-GRPO's GenEval reward server (yifan123/reward-server, ``gen_eval.py``), read and
re-written here:

- A prompt is a :class:`Task`: its tag (one of :data:`TAGS`), ``include`` clauses combined with AND (a class, a
  count, optionally a colour and a position relative to an earlier clause) and ``exclude`` clauses combined with
  OR (a class and a count it must stay below). GenEval's ``evaluation_metadata.jsonl`` records read with
  :meth:`Task.from_metadata`.
- Detections are :data:`Objects`: class → :class:`Found` (box, confidence, colour), highest confidence first,
  after :func:`keep` applied GenEval's thresholds (:class:`Thresholds`: confidence > 0.3, > 0.9 for counting
  prompts, at most 16 per class, no NMS).
- :func:`judge` returns a :class:`Verdict` per image:

  ``strict`` — GenEval's ``correct`` (the benchmark's score): for each include clause the ``count`` most
  confident detections of its class must exist; with a colour, at least ``count`` of those carry it; with a
  position, each of them stands in the relation to each object matched by the target clause
  (:func:`relative_position`); no exclude clause reaches its count.

  ``exact`` and ``partial`` — Flow-GRPO's reward server (``strict_correct`` and ``score``): every detection of
  the class counts, the count must be exact; ``partial`` averages one term per check: the count term
  1 − |n − found| / n (not floored: it goes below 0 when far more than n are found, as the server's does); a
  colour term 1 − |n − found in colour| / n when the count is exact, else 0; a position term 1/0 when the
  count (and colour) held, else 0 if the clause has a position. (The server appends a 1.0 after a failed
  position check as well, so a failed relation scores ½ there: a bug we do not copy.)
- :func:`task_scores` turns per-image verdicts into GenEval's summary: the share of correct images per tag and
  the overall score (the mean over the tags present), as ``summary_scores.py`` prints it.

A detector that sees colour itself (the shapes world) names its classes "colour shape" and needs no colour
clause; its relation may read the object's own centre (:attr:`Found.center`) instead of the box's.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Mapping, Sequence

COLORS: tuple[str, ...] = ("red", "orange", "yellow", "green", "blue", "purple", "pink", "brown", "black", "white")
"""GenEval's ten colours (the colour classifier's classes)."""
TAGS: tuple[str, ...] = ("single_object", "two_object", "counting", "colors", "position", "color_attr")
"""GenEval's six tasks, in its evaluation file's order."""
RELATIONS: tuple[str, ...] = ("left of", "right of", "above", "below")


@dataclass(frozen=True)
class Clause:
    """``count`` objects of class ``cls`` (include: at least, with an optional ``color`` they wear and a
    ``position`` = (relation, index of the include clause they stand relative to); exclude: fewer than
    ``count``)."""

    cls: str
    count: int
    color: str | None = None
    position: tuple[str, int] | None = None


@dataclass(frozen=True)
class Task:
    """What one prompt asks for (GenEval's metadata record)."""

    tag: str
    prompt: str
    include: tuple[Clause, ...]
    exclude: tuple[Clause, ...] = ()

    @classmethod
    def from_metadata(cls, record: Mapping[str, Any], where: str = "metadata") -> "Task":
        """A GenEval metadata record (``{"tag", "prompt", "include": [{"class", "count", "color"?,
        "position"?: [relation, index]}], "exclude"?: [...]}``); a ValueError naming ``where`` and the field
        otherwise."""

        def fail(what: str) -> ValueError:
            return ValueError(f"{where}: {what}; accepted: a GenEval metadata record, e.g. {EXAMPLE}")

        if not isinstance(record, Mapping):
            raise fail(f"expected an object, got {type(record).__name__}")
        tag = record.get("tag")
        if tag not in TAGS:
            raise fail(f"tag={tag!r} is not one of {TAGS}")
        if not isinstance(record.get("prompt"), str):
            raise fail("no 'prompt' string")
        include = tuple(_clause(c, f"include[{i}]", fail) for i, c in enumerate(record.get("include") or []))
        exclude = tuple(_clause(c, f"exclude[{i}]", fail) for i, c in enumerate(record.get("exclude") or []))
        if not include:
            raise fail("no 'include' clause")
        for i, c in enumerate(include):
            if c.position is not None and not 0 <= c.position[1] < i:
                raise fail(f"include[{i}].position refers to clause {c.position[1]}, not an earlier one")
        return cls(tag, record["prompt"], include, exclude)

    def to_metadata(self) -> dict[str, Any]:
        """The GenEval metadata record of this task."""

        def record(c: Clause) -> dict[str, Any]:
            out: dict[str, Any] = {"class": c.cls, "count": c.count}
            if c.color is not None:
                out["color"] = c.color
            if c.position is not None:
                out["position"] = list(c.position)
            return out

        out: dict[str, Any] = {"tag": self.tag, "include": [record(c) for c in self.include]}
        if self.exclude:
            out["exclude"] = [record(c) for c in self.exclude]
        out["prompt"] = self.prompt
        return out

    @property
    def color_classes(self) -> set[str]:
        """Classes whose detections need a colour (those of include clauses with one)."""
        return {c.cls for c in self.include if c.color is not None}


EXAMPLE = (
    '{"tag": "position", "include": [{"class": "dog", "count": 1}, {"class": "cat", "count": 1, '
    '"position": ["left of", 0]}], "prompt": "a photo of a cat left of a dog"}'
)


def _clause(raw: Any, where: str, fail: Callable[[str], ValueError]) -> Clause:
    if not isinstance(raw, Mapping) or not isinstance(raw.get("class"), str):
        raise fail(f"{where} needs a 'class' string")
    count = raw.get("count", 1)
    if isinstance(count, bool) or not isinstance(count, int) or count < 1:
        raise fail(f"{where}.count={count!r} must be an integer >= 1")
    color = raw.get("color")
    if color is not None and color not in COLORS:
        lower = color.lower() if isinstance(color, str) else None
        hint = (
            f"; GenEval's colours are lower case: write {lower!r}"
            if lower in COLORS
            else " (lower case); the colour classifier knows no other"
        )
        raise fail(f"{where}.color={color!r} is not one of GenEval's ten colours {COLORS}{hint}")
    position = raw.get("position")
    if position is not None:
        if (
            not isinstance(position, (list, tuple))
            or len(position) != 2
            or position[0] not in RELATIONS
            or isinstance(position[1], bool)
            or not isinstance(position[1], int)
        ):
            raise fail(f"{where}.position={position!r} must be [relation, clause index], relation one of {RELATIONS}")
        position = (position[0], position[1])
    return Clause(raw["class"], count, color, position)


# ---- detections ------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Found:
    """One detected object: ``box`` (x0, y0, x1, y1) in pixels, ``score`` its confidence (the order of
    detections), ``color`` (one of the colour classifier's names; None until classified) and ``center`` (x, y)
    when the detector knows a better centre than the box's (the shapes world's coverage-weighted centroid)."""

    box: tuple[float, float, float, float]
    score: float
    color: str | None = None
    center: tuple[float, float] | None = None
    mask: Any = field(default=None, compare=False, repr=False)  # bool [H, W] or None: the colour crop's cut-out


Objects = dict[str, list[Found]]
"""Class name → its detections, highest score first (what :func:`keep` returns)."""
Relation = Callable[[Found, Found], set]
"""The relations (:data:`RELATIONS`) in which object A stands to object B."""


@dataclass(frozen=True)
class Thresholds:
    """GenEval's detection settings (its script's ``--options`` defaults): ``confidence`` kept above it,
    ``counting`` (the threshold for counting prompts), ``max_objects`` per class, ``max_overlap`` (IoU above
    which a less confident box of the same class is dropped; 1 = no suppression)."""

    confidence: float = 0.3
    counting: float = 0.9
    max_objects: int = 16
    max_overlap: float = 1.0


def iou(a: Sequence[float], b: Sequence[float]) -> float:
    """Intersection over union of boxes (x0, y0, x1, y1), in GenEval's inclusive-pixel convention (+1)."""

    def area(box: Sequence[float]) -> float:
        return max(box[2] - box[0] + 1, 0) * max(box[3] - box[1] + 1, 0)

    inter = area([max(a[0], b[0]), max(a[1], b[1]), min(a[2], b[2]), min(a[3], b[3])])
    union = area(a) + area(b) - inter
    return inter / union if union else 0.0


def keep(detections: Mapping[str, Iterable[Found]], tag: str, thresholds: Thresholds = Thresholds()) -> Objects:
    """Per class, the detections GenEval keeps for a prompt with ``tag``: score strictly above the (counting)
    threshold, highest first, at most ``max_objects``, then greedy suppression of boxes overlapping a kept one
    by ``max_overlap`` or more (none at 1.0). Classes left empty are dropped."""
    floor = thresholds.counting if tag == "counting" else thresholds.confidence
    out: Objects = {}
    for cls, found in detections.items():
        ranked = sorted((f for f in found if f.score > floor), key=lambda f: -f.score)[: thresholds.max_objects]
        kept: list[Found] = []
        while ranked:
            best = ranked.pop(0)
            kept.append(best)
            if thresholds.max_overlap < 1:
                ranked = [f for f in ranked if iou(best.box, f.box) < thresholds.max_overlap]
        if kept:
            out[cls] = kept
    return out


def center(found: Found) -> tuple[float, float]:
    """The object's centre: its own (``Found.center``) or its box's."""
    if found.center is not None:
        return found.center
    x0, y0, x1, y1 = found.box
    return (x0 + x1) / 2, (y0 + y1) / 2


def relative_position(a: Found, b: Found, threshold: float = 0.1) -> set:
    """GenEval's relation of A to B: the centre offset shrunk by ``threshold`` × the sum of both box sizes on
    each axis; no relation when nothing is left, else each axis whose share of the offset's length exceeds ½
    (image y grows downwards: "above" = smaller y)."""
    (ax, ay), (bx, by) = center(a), center(b)
    dims = [abs(a.box[2] - a.box[0]) + abs(b.box[2] - b.box[0]), abs(a.box[3] - a.box[1]) + abs(b.box[3] - b.box[1])]
    offset = (ax - bx, ay - by)
    revised = [max(abs(o) - threshold * d, 0.0) * math.copysign(1.0, o) if o else 0.0 for o, d in zip(offset, dims)]
    if all(abs(r) < 1e-3 for r in revised):
        return set()
    norm = math.hypot(*offset)
    dx, dy = revised[0] / norm, revised[1] / norm
    return {
        name
        for name, hit in (("left of", dx < -0.5), ("right of", dx > 0.5), ("above", dy < -0.5), ("below", dy > 0.5))
        if hit
    }


# ---- the verdict -----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Verdict:
    """One image against one task: GenEval's ``strict`` (the benchmark), Flow-GRPO's ``exact`` (every count
    exact) and ``partial`` (its training reward), and the ``reasons`` for failing (GenEval's wording)."""

    tag: str
    strict: bool
    exact: bool
    partial: float
    reasons: tuple[str, ...] = ()


def judge(task: Task, objects: Objects, relation: Relation = relative_position) -> Verdict:
    """The verdict for ``objects`` (:func:`keep`'s output; detections of colour clauses' classes carry their
    colour) against ``task``; ``relation`` gives the relations of one object to another."""
    strict, reasons = _strict(task, objects, relation)
    exact, partial = _partial(task, objects, relation)
    return Verdict(task.tag, strict, exact, partial, tuple(reasons))


def _colours(found: Sequence[Found], cls: str) -> list[str | None]:
    missing = [f for f in found if f.color is None]
    if missing:
        raise ValueError(f"detections of {cls!r} have no colour: classify them before judging a colour clause")
    return [f.color for f in found]


def _relation_fails(found: Sequence[Found], targets: Sequence[Found], wanted: str, relation: Relation) -> set | None:
    """None when every object of ``found`` stands in ``wanted`` to every target; else the relations found for the
    first pair that does not."""
    for obj in found:
        for target in targets:
            rels = relation(obj, target)
            if wanted not in rels:
                return rels
    return None


def _strict(task: Task, objects: Objects, relation: Relation) -> tuple[bool, list[str]]:
    """GenEval's ``evaluate``: (correct, reasons)."""
    reasons: list[str] = []
    matched: list[list[Found] | None] = []
    for c in task.include:
        found = objects.get(c.cls, [])[: c.count]
        ok = len(found) >= c.count
        if not ok:
            reasons.append(f"expected {c.cls}>={c.count}, found {len(found)}")
        else:
            if c.color is not None:
                colours = _colours(found, c.cls)
                if colours.count(c.color) < c.count:
                    ok = False
                    others = ", ".join(f"{colours.count(k)} {k}" for k in dict.fromkeys(colours))
                    reasons.append(
                        f"expected {c.color} {c.cls}>={c.count}, found {colours.count(c.color)} {c.color}; and {others}"
                    )
            if c.position is not None and ok:
                wanted, target = c.position
                if matched[target] is None:
                    ok = False
                    reasons.append(f"no target for {c.cls} to be {wanted}")
                else:
                    rels = _relation_fails(found, matched[target], wanted, relation)
                    if rels is not None:
                        ok = False
                        reasons.append(f"expected {c.cls} {wanted} target, found {' and '.join(sorted(rels))} target")
        matched.append(found if ok else None)
    for c in task.exclude:
        n = len(objects.get(c.cls, []))
        if n >= c.count:
            reasons.append(f"expected {c.cls}<{c.count}, found {n}")
    return not reasons, reasons


def _partial(task: Task, objects: Objects, relation: Relation) -> tuple[bool, float]:
    """Flow-GRPO's ``evaluate_reward``: (every clause exact, mean of its terms)."""
    terms: list[float] = []
    exact = True
    matched: list[list[Found] | None] = []
    for c in task.include:
        found = objects.get(c.cls, [])
        terms.append(1 - abs(c.count - len(found)) / c.count)
        ok = len(found) == c.count
        if not ok:
            terms += [0.0] if c.color is not None or c.position is not None else []
        else:
            if c.color is not None:
                hits = _colours(found, c.cls).count(c.color)
                terms.append(1 - abs(c.count - hits) / c.count)
                ok = hits == c.count
            if c.position is not None and ok:
                wanted, target = c.position
                ok = matched[target] is not None and _relation_fails(found, matched[target], wanted, relation) is None
                terms.append(float(ok))
        exact = exact and ok
        matched.append(found if ok else None)
    return exact, sum(terms) / len(terms)


def task_scores(verdicts: Sequence[Verdict], prompts: Sequence[str] | None = None) -> dict[str, float]:
    """GenEval's summary of per-image verdicts: ``overall`` (the mean over the tags present of each tag's share
    of correct images), ``images`` (share of correct images), ``prompts`` (share of prompts with at least one
    correct image, when ``prompts`` gives each image's prompt), ``<tag>`` and ``n/<tag>`` per tag present."""
    out: dict[str, float] = {"n": len(verdicts)}
    if not verdicts:
        return out
    per_tag = {tag: [v.strict for v in verdicts if v.tag == tag] for tag in TAGS}
    present = {tag: hits for tag, hits in per_tag.items() if hits}
    for tag, hits in present.items():
        out[tag] = sum(hits) / len(hits)
        out[f"n/{tag}"] = len(hits)
    out["overall"] = sum(out[tag] for tag in present) / len(present)
    out["images"] = sum(v.strict for v in verdicts) / len(verdicts)
    if prompts is not None:
        by_prompt: dict[str, bool] = {}
        for p, v in zip(prompts, verdicts):
            by_prompt[p] = by_prompt.get(p, False) or v.strict
        out["prompts"] = sum(by_prompt.values()) / len(by_prompt)
    return out


def summary_text(scores: Mapping[str, float], n_prompts: int | None = None) -> str:
    """GenEval's printed summary (``summary_scores.py``'s layout) of :func:`task_scores`' output."""
    lines = ["Summary", "=======", f"Total images: {int(scores['n'])}"]
    if n_prompts is not None:
        lines.append(f"Total prompts: {n_prompts}")
    if "images" in scores:
        lines.append(f"% correct images: {scores['images']:.2%}")
    if "prompts" in scores:
        lines.append(f"% correct prompts: {scores['prompts']:.2%}")
    lines += ["", "Task breakdown", "=============="]
    for tag in TAGS:
        if tag in scores:
            n = int(scores[f"n/{tag}"])
            lines.append(f"{tag:<16} = {scores[tag]:.2%} ({round(scores[tag] * n)} / {n})")
    lines += ["", f"Overall score (avg. over tasks): {scores.get('overall', float('nan')):.5f}"]
    return "\n".join(lines)
