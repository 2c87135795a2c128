"""The exact reward of the shapes world: GenEval-style scoring of the detections of
:mod:`flowrl_rewards.compositional.shapes_detector` (a colour-segmentation detector; its docstring says how it reads
images).

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

``strict`` is GenEval's verdict from :mod:`flowrl_rewards.compositional.geneval_rules` (the rules the neural GenEval
reward uses):
:func:`geneval_task` writes a prompt's spec as a GenEval task whose classes are "colour shape" (this detector
sees colour itself), with the requirements above as include and exclude clauses, and :func:`geneval_objects`
the detections (confidence = area, so "most confident" = largest). Only the relation differs from GenEval's:
:func:`shapes_relation` (the centroid margin above; GenEval's box-offset rule is made for photographs).
"""

from __future__ import annotations

from collections import Counter
from functools import lru_cache
from typing import Any, Sequence

import numpy as np
import torch

from flowrl.core.choices import choose
from flowrl.shapes import world
from flowrl_rewards.compositional import geneval_rules as rules
from flowrl_rewards.compositional.shapes_detector import (  # noqa: F401 (the detector's names, importable from here too)
    CHUNK_PIXELS,
    DARK,
    FULL_COVERAGE,
    MAX_ASPECT,
    MAX_CHROMA_DIST,
    MAX_SIDE_FRAC,
    MIN_AREA_FRAC,
    MIN_SIDE_FRAC,
    SOFT_DARK,
    SQUARE_QUAD,
    TRIANGLE_SKEW,
    Detection,
    classify_colors,
    detect,
    detect_batch,
    grow_labels,
    label_components,
)
from flowrl_rewards.core.base import Reward

RELATION_MARGIN_FRAC = 3 / 32  # centroid offset along the relation axis, fraction of the side
MODES: tuple[str, ...] = ("strict", "partial", "precise", "geneval")


# ------------------------------------------------------------------------------------------- scoring


def _relation_holds(a: tuple[float, float], b: tuple[float, float], relation: str, side: int) -> bool:
    """Whether centre ``a`` stands in ``relation`` to centre ``b`` by the margin, in an image of ``side`` px."""
    margin = RELATION_MARGIN_FRAC * side
    (ax, ay), (bx, by) = a, b
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
        req["relation"] = both and _relation_holds(a[0].centroid, b[0].centroid, spec.relation, side)
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
        bound = [found(o.shape, o.color) > 0 and found(o.shape, other.color) == 0 for o, other in ((a, b), (b, a))]
        return {"binding": sum(bound) / 2}
    if spec.task == "position":
        return {"relation": float(requirements(spec, dets, side)["relation"])}
    wanted = Counter(o.shape for o in objects)  # two circles requested need two circles detected
    presence = sum(min(found(shape), n) for shape, n in wanted.items()) / len(objects)
    color = sum(found(o.shape, o.color) > 0 for o in objects) / len(objects)
    return {"presence": presence, "color": color}


# ---- the same requirements as GenEval's rules (flowrl_rewards.compositional.geneval_rules): strict
# ----------------------------
TAG_OF_TASK: dict[str, str] = {
    "single": "colors",
    "two_objects": "two_object",
    "counting": "counting",
    "color_attr": "color_attr",
    "position": "position",
}
"""The GenEval tag of each shapes task (``single`` asks for one object in a colour: GenEval's ``colors``)."""


def _class(o: world.ObjectSpec | tuple[str, str]) -> str:
    shape, color = (o.shape, o.color) if isinstance(o, world.ObjectSpec) else o
    return f"{color} {shape}"


def geneval_task(spec: world.Spec, prompt: str = "") -> rules.Task:
    """``spec`` as a GenEval task over "colour shape" classes: each object at least once (``count`` times for
    counting, and fewer than ``count`` + 1: exact), for ``color_attr`` no shape in the other object's colour
    (exclude clauses), for ``position`` object 0 in the relation to object 1 (GenEval puts the target first)."""
    C = rules.Clause
    objects = spec.objects
    if spec.task == "counting":
        (o,) = objects
        return rules.Task("counting", prompt, (C(_class(o), o.count),), (C(_class(o), o.count + 1),))
    if spec.task == "position":
        a, b = objects
        return rules.Task("position", prompt, (C(_class(b), 1), C(_class(a), 1, position=(spec.relation, 0))))
    include = tuple(C(_class(o), 1) for o in objects)
    exclude = ()
    if spec.task == "color_attr":
        a, b = objects
        exclude = (C(_class((a.shape, b.color)), 1), C(_class((b.shape, a.color)), 1))
    return rules.Task(TAG_OF_TASK[spec.task], prompt, include, exclude)


def geneval_objects(dets: Sequence[Detection]) -> rules.Objects:
    """Detections as GenEval's objects: class "colour shape", confidence = area (largest first), the centroid as
    the centre."""
    out: rules.Objects = {}
    for d in sorted(dets, key=lambda d: -d.area):
        out.setdefault(_class((d.shape, d.color)), []).append(
            rules.Found(box=tuple(float(v) for v in d.bbox), score=float(d.area), center=d.centroid)
        )
    return out


def shapes_relation(side: int) -> rules.Relation:
    """The relations of one object to another in an image of ``side`` px: the centroid margin rule."""

    def relation(a: rules.Found, b: rules.Found) -> set:
        return {r for r in world.RELATIONS if _relation_holds(rules.center(a), rules.center(b), r, side)}

    return relation


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

    def __init__(
        self,
        mode: str = "strict",  # strict (all of the prompt's requirements met: 1, else 0) | partial (the fraction met) |
        # precise (partial × the fraction of detections that are requested objects) | geneval (Flow-GRPO's GenEval
        # server's partial credit × the same precision)
    ):
        choose("shapes: mode", mode, MODES, error=ValueError)
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
        relation = shapes_relation(side)
        for i, (spec, dets) in enumerate(zip(specs, detections)):
            req = requirements(spec, dets, side)
            strict[i] = float(rules.judge(geneval_task(spec), geneval_objects(dets), relation).strict)
            partial[i] = sum(req.values()) / len(req)
            share = precision(spec, dets)
            precise[i] = partial[i] * share
            sub = geneval_subscores(spec, dets, side)
            geneval[i] = sum(sub.values()) / len(sub) * share
            found = {d.color for d in dets}
            colors[i] = float(all(o.color in found for o in spec.objects))
        return {
            "task": [s.task for s in specs],
            "strict": strict,
            "partial": partial,
            "precise": precise,
            "geneval": geneval,
            "colors_found": colors,
        }

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
