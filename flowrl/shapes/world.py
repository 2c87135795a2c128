"""The shapes world: a prompt grammar and a renderer (a GenEval in miniature; its prompt files come from
:mod:`flowrl.shapes.prompt_sets`).

Images are ``CANVAS``×``CANVAS`` RGB, black background, with flat pure-colour circles, squares and
(apex-up) triangles. Five tasks, as in GenEval:

============  ==========================================  =========================================
task          prompt form                                 objects
============  ==========================================  =========================================
single        ``a red circle``                            one object
two_objects   ``a red circle and a red square``           two objects that differ in exactly one
              ``a red circle and a blue circle``          attribute (shape or colour)
counting      ``one green triangle`` … ``four green       one object with count 1–4 (``one`` for 1,
              triangles``                                 so it never reads as ``single``)
color_attr    ``a red square and a green circle``         two objects that differ in shape AND
                                                          colour (so the colours can be swapped)
position      ``a yellow square left of a blue circle``   two different objects and a relation
============  ==========================================  =========================================

two_objects and color_attr share the surface form "X and Y"; which one a prompt belongs to follows
from the pair itself: objects that share their colour or their shape are a presence test
(two_objects), objects that differ in both are a binding test (color_attr), the case where a model
can put each colour on the wrong shape. :mod:`flowrl_rewards.compositional.shapes` scores them accordingly.

Every word any prompt can contain is in :func:`vocabulary` (23 words). Rendering draws every object
7–11 px wide, keeps at least ``MIN_GAP`` px of background between any two bounding boxes, and for
``position`` keeps at least ``RELATION_GAP`` px between the two boxes along the relation axis. All
randomness comes from the ``numpy.random.Generator`` passed in.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from itertools import permutations
from typing import Collection

import numpy as np

CANVAS: int = 32
SHAPES: tuple[str, ...] = ("circle", "square", "triangle")
COLORS: dict[str, tuple[int, int, int]] = {
    "red": (255, 0, 0),
    "green": (0, 255, 0),
    "blue": (0, 0, 255),
    "yellow": (255, 255, 0),
    "magenta": (255, 0, 255),
    "cyan": (0, 255, 255),
}
TASKS: tuple[str, ...] = ("single", "two_objects", "counting", "color_attr", "position")
RELATIONS: tuple[str, ...] = ("left of", "right of", "above", "below")

MIN_SIZE, MAX_SIZE = 7, 11  # object bounding-box side (px)
MIN_GAP = 2  # background px between any two bounding boxes (both axes checked)
RELATION_GAP = 6  # px between the two boxes along the relation axis (position)
MAX_COUNT = 4

NUMBER_WORDS: tuple[str, ...] = ("one", "two", "three", "four")  # index + 1 = count
PLURALS: dict[str, str] = {s: s + "s" for s in SHAPES}


@dataclass(frozen=True)
class ObjectSpec:
    """One requested object: ``count`` copies of a ``color`` ``shape``."""

    shape: str
    color: str
    count: int = 1


@dataclass(frozen=True)
class Spec:
    """What a prompt asks for. ``relation`` only for task ``position``: objects[0] <relation> objects[1]."""

    task: str
    objects: tuple[ObjectSpec, ...]
    relation: str | None = None


# ----------------------------------------------------------------------------------------- validity


def _check_object(obj: ObjectSpec) -> None:
    if obj.shape not in SHAPES:
        raise ValueError(f"unknown shape {obj.shape!r}; accepted: {', '.join(SHAPES)}")
    if obj.color not in COLORS:
        raise ValueError(f"unknown colour {obj.color!r}; accepted: {', '.join(COLORS)}")
    if not (isinstance(obj.count, int) and 1 <= obj.count <= MAX_COUNT):
        raise ValueError(f"count must be an int in 1..{MAX_COUNT}, got {obj.count!r}")


def validate(spec: Spec) -> Spec:
    """Return ``spec`` unchanged if it is a valid spec; raise ValueError naming the problem otherwise."""
    if spec.task not in TASKS:
        raise ValueError(f"unknown task {spec.task!r}; accepted: {', '.join(TASKS)}")
    for obj in spec.objects:
        _check_object(obj)
    n_objects = 1 if spec.task in ("single", "counting") else 2
    if len(spec.objects) != n_objects:
        raise ValueError(f"task {spec.task!r} takes {n_objects} object(s), got {len(spec.objects)}")
    if spec.task != "counting" and any(o.count != 1 for o in spec.objects):
        raise ValueError(f"task {spec.task!r} takes count 1 per object, got {[o.count for o in spec.objects]}")
    if spec.task == "position":
        if spec.relation not in RELATIONS:
            raise ValueError(f"task 'position' needs a relation in {RELATIONS}, got {spec.relation!r}")
    elif spec.relation is not None:
        raise ValueError(f"task {spec.task!r} takes no relation, got {spec.relation!r}")
    if n_objects == 2:
        a, b = spec.objects
        same_shape, same_color = a.shape == b.shape, a.color == b.color
        if same_shape and same_color:
            raise ValueError(f"task {spec.task!r} needs two different objects, got {a.color} {a.shape} twice")
        if spec.task == "two_objects" and not (same_shape or same_color):
            raise ValueError(
                f"two_objects pairs share their shape or their colour; {a.color} {a.shape} and "
                f"{b.color} {b.shape} differ in both, which is task 'color_attr'"
            )
        if spec.task == "color_attr" and (same_shape or same_color):
            raise ValueError(
                f"color_attr pairs differ in shape and colour; {a.color} {a.shape} and "
                f"{b.color} {b.shape} share one, which is task 'two_objects'"
            )
    return spec


# ------------------------------------------------------------------------------------------ grammar


def vocabulary() -> list[str]:
    """Every word any prompt can contain (lower-case, sorted)."""
    words = {"a", "and", "of", *NUMBER_WORDS, *COLORS, *SHAPES, *PLURALS.values()}
    for rel in RELATIONS:
        words.update(rel.split())
    return sorted(words)


def _phrase(obj: ObjectSpec, counted: bool) -> str:
    if counted:
        noun = obj.shape if obj.count == 1 else PLURALS[obj.shape]
        return f"{NUMBER_WORDS[obj.count - 1]} {obj.color} {noun}"
    return f"a {obj.color} {obj.shape}"


def to_prompt(spec: Spec) -> str:
    """The prompt of a valid spec; ``parse(to_prompt(spec)) == spec``."""
    validate(spec)
    if spec.task == "single":
        return _phrase(spec.objects[0], counted=False)
    if spec.task == "counting":
        return _phrase(spec.objects[0], counted=True)
    a, b = (_phrase(o, counted=False) for o in spec.objects)
    joiner = "and" if spec.task in ("two_objects", "color_attr") else spec.relation
    return f"{a} {joiner} {b}"


def _parse_phrase(words: list[str], start: int, prompt: str) -> tuple[ObjectSpec, bool, int]:
    """Parse ``determiner colour noun`` at ``words[start:]`` → (object, counted?, next index)."""

    def fail(i: int, what: str) -> ValueError:
        got = repr(words[i]) if i < len(words) else "the end of the prompt"
        return ValueError(f"parse({prompt!r}): expected {what} at word {i + 1}, got {got}")

    i = start
    if i >= len(words) or words[i] not in ("a", *NUMBER_WORDS):
        raise fail(i, f"a determiner (one of: a, {', '.join(NUMBER_WORDS)})")
    counted = words[i] != "a"
    count = NUMBER_WORDS.index(words[i]) + 1 if counted else 1
    i += 1
    if i >= len(words) or words[i] not in COLORS:
        raise fail(i, f"a colour (one of: {', '.join(COLORS)})")
    color = words[i]
    i += 1
    nouns = {s: s for s in SHAPES} | {p: s for s, p in PLURALS.items()}
    if i >= len(words) or words[i] not in nouns:
        raise fail(i, f"a shape (one of: {', '.join(nouns)})")
    shape = nouns[words[i]]
    plural = words[i] != shape
    if plural != (count > 1):
        want = PLURALS[shape] if count > 1 else shape
        raise ValueError(f"parse({prompt!r}): {words[i]!r} after {words[start]!r} must be {want!r} (word {i + 1})")
    return ObjectSpec(shape, color, count), counted, i + 1


def parse(prompt: str) -> Spec:
    """The spec of a prompt (case and surrounding whitespace ignored).

    Raises ValueError naming the word or phrase it does not understand.
    """
    if not isinstance(prompt, str):
        raise TypeError(f"parse: prompt must be a str, got {type(prompt).__name__}")
    words = prompt.lower().split()
    if not words:
        raise ValueError("parse(''): empty prompt; expected e.g. 'a red circle'")
    first, counted, i = _parse_phrase(words, 0, prompt)
    if i == len(words):
        return validate(Spec("counting" if counted else "single", (first,)))
    if counted:
        raise ValueError(
            f"parse({prompt!r}): a counted phrase ({words[0]!r} …) must be the whole prompt; "
            f"unexpected {words[i]!r} at word {i + 1}"
        )
    rest = words[i:]
    joiner = None
    for candidate in ("and", *RELATIONS):
        parts = candidate.split()
        if rest[: len(parts)] == parts:
            joiner = candidate
            break
    if joiner is None:
        raise ValueError(
            f"parse({prompt!r}): expected 'and' or a relation ({', '.join(RELATIONS)}) at word {i + 1}, "
            f"got {words[i]!r}"
        )
    j = i + len(joiner.split())
    second, counted2, end = _parse_phrase(words, j, prompt)
    if counted2:
        raise ValueError(f"parse({prompt!r}): the second object takes 'a', got {words[j]!r} at word {j + 1}")
    if end != len(words):
        raise ValueError(f"parse({prompt!r}): unexpected {words[end]!r} at word {end + 1} after a full prompt")
    if joiner == "and":
        task = "two_objects" if (first.shape == second.shape or first.color == second.color) else "color_attr"
        if first == second:
            raise ValueError(f"parse({prompt!r}): the two objects are the same ({first.color} {first.shape})")
        return validate(Spec(task, (first, second)))
    if first == second:
        raise ValueError(f"parse({prompt!r}): an object cannot be {joiner} itself ({first.color} {first.shape})")
    return validate(Spec("position", (first, second), joiner))


# ------------------------------------------------------------------------------------------- sampling


def _pairs(exclude: Collection[tuple[str, str]]) -> list[tuple[str, str]]:
    """(shape, colour) pairs not in ``exclude``, in a fixed order."""
    bad = set(exclude)
    for pair in bad:
        if pair[0] not in SHAPES or pair[1] not in COLORS:
            raise ValueError(f"exclude holds {pair!r}; pairs are (shape, colour) from {SHAPES} × {tuple(COLORS)}")
    return [(s, c) for s in SHAPES for c in COLORS if (s, c) not in bad]


def sample_spec(
    rng: np.random.Generator, task: str | None = None, *, exclude: Collection[tuple[str, str]] = ()
) -> Spec:
    """A random valid spec of ``task`` (uniform over TASKS when None).

    ``exclude``: (shape, colour) pairs never used (e.g. :func:`held_out_pairs` for training data).
    Every draw comes from ``rng``.
    """
    if task is None:
        task = TASKS[int(rng.integers(len(TASKS)))]
    if task not in TASKS:
        raise ValueError(f"unknown task {task!r}; accepted: {', '.join(TASKS)} (or None for any)")
    pairs = _pairs(exclude)

    def draw(ok) -> tuple[ObjectSpec, ObjectSpec]:
        candidates = [(p, q) for p in pairs for q in pairs if p != q and ok(p, q)]
        p, q = candidates[int(rng.integers(len(candidates)))]
        return ObjectSpec(*p), ObjectSpec(*q)

    if task in ("single", "counting"):
        shape, color = pairs[int(rng.integers(len(pairs)))]
        count = int(rng.integers(1, MAX_COUNT + 1)) if task == "counting" else 1
        return Spec(task, (ObjectSpec(shape, color, count),))
    if task == "two_objects":
        return Spec(task, draw(lambda p, q: (p[0] == q[0]) != (p[1] == q[1])))
    if task == "color_attr":
        return Spec(task, draw(lambda p, q: p[0] != q[0] and p[1] != q[1]))
    relation = RELATIONS[int(rng.integers(len(RELATIONS)))]
    return Spec(task, draw(lambda p, q: True), relation)


def all_specs(task: str) -> list[Spec]:
    """Every valid spec of ``task``, in a fixed order."""
    if task not in TASKS:
        raise ValueError(f"unknown task {task!r}; accepted: {', '.join(TASKS)}")
    pairs = _pairs(())
    if task == "single":
        return [Spec(task, (ObjectSpec(s, c),)) for s, c in pairs]
    if task == "counting":
        return [Spec(task, (ObjectSpec(s, c, k),)) for s, c in pairs for k in range(1, MAX_COUNT + 1)]
    out = []
    for p, q in permutations(pairs, 2):
        a, b = ObjectSpec(*p), ObjectSpec(*q)
        differ_both = p[0] != q[0] and p[1] != q[1]
        if task == "two_objects" and not differ_both:
            out.append(Spec(task, (a, b)))
        elif task == "color_attr" and differ_both:
            out.append(Spec(task, (a, b)))
        elif task == "position":
            out.extend(Spec(task, (a, b), rel) for rel in RELATIONS)
    return out


# ------------------------------------------------------------------------------------------ rendering


def shape_mask(shape: str, size: int) -> np.ndarray:
    """Boolean [size, size] mask of ``shape`` filling a size×size box (pixel centres inside the shape)."""
    if shape not in SHAPES:
        raise ValueError(f"unknown shape {shape!r}; accepted: {', '.join(SHAPES)}")
    c = np.arange(size) + 0.5
    x, y = np.meshgrid(c, c)  # [size, size], y grows downwards
    if shape == "square":
        return np.ones((size, size), dtype=bool)
    if shape == "circle":
        r = size / 2
        return (x - r) ** 2 + (y - r) ** 2 <= r * r
    # apex-up triangle: apex at (size/2, 0), base along y = size; half-width at height y is y/2
    return np.abs(x - size / 2) <= y / 2 + 1e-9


def _boxes_apart(a: tuple[int, int, int], b: tuple[int, int, int], gap: int) -> bool:
    """True if boxes (x0, y0, size) leave ≥ ``gap`` background px between them on some axis."""
    ax, ay, asz = a
    bx, by, bsz = b
    return ax + asz + gap <= bx or bx + bsz + gap <= ax or ay + asz + gap <= by or by + bsz + gap <= ay


def _relation_ok(a: tuple[int, int, int], b: tuple[int, int, int], relation: str) -> bool:
    """Box a is ``relation`` box b with ≥ RELATION_GAP px between them on the relation axis."""
    ax, ay, asz = a
    bx, by, bsz = b
    if relation == "left of":
        return ax + asz + RELATION_GAP <= bx
    if relation == "right of":
        return bx + bsz + RELATION_GAP <= ax
    if relation == "above":
        return ay + asz + RELATION_GAP <= by
    return by + bsz + RELATION_GAP <= ay  # below


def layout(spec: Spec, rng: np.random.Generator, max_tries: int = 2000) -> list[tuple[str, str, int, int, int]]:
    """Random placements (shape, colour, x0, y0, size) for every object instance of ``spec``."""
    validate(spec)
    instances = [(o.shape, o.color) for o in spec.objects for _ in range(o.count)]
    for _ in range(max_tries):
        boxes: list[tuple[int, int, int]] = []
        for _k in instances:
            size = int(rng.integers(MIN_SIZE, MAX_SIZE + 1))
            x0 = int(rng.integers(0, CANVAS - size + 1))
            y0 = int(rng.integers(0, CANVAS - size + 1))
            box = (x0, y0, size)
            if not all(_boxes_apart(box, other, MIN_GAP) for other in boxes):
                break
            boxes.append(box)
        if len(boxes) != len(instances):
            continue
        if spec.task == "position" and not _relation_ok(boxes[0], boxes[1], spec.relation):
            continue
        return [(s, c, *box) for (s, c), box in zip(instances, boxes)]
    raise RuntimeError(f"could not place {to_prompt(spec)!r} on a {CANVAS}px canvas in {max_tries} tries")


def render(spec: Spec, rng: np.random.Generator) -> np.ndarray:
    """uint8 [CANVAS, CANVAS, 3] image of ``spec`` (black background); randomness from ``rng`` only."""
    image = np.zeros((CANVAS, CANVAS, 3), dtype=np.uint8)
    for shape, color, x0, y0, size in layout(spec, rng):
        mask = shape_mask(shape, size)
        image[y0 : y0 + size, x0 : x0 + size][mask] = COLORS[color]
    return image


def recolor(spec: Spec, mapping: dict[str, str]) -> Spec:
    """``spec`` with every object colour c replaced by ``mapping.get(c, c)`` (task unchanged, not validated)."""
    objects = tuple(replace(o, color=mapping.get(o.color, o.color)) for o in spec.objects)
    return replace(spec, objects=objects)
