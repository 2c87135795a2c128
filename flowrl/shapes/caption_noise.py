"""Web-like caption noise for pretraining the shapes model: images drawn from a one-fact-wrong spec.

Real text-to-image models fail GenEval-style prompts in *systematic* ways because their web captions
are systematically wrong: counts are off, attributes are swapped, relations mirrored, objects left
out. Pretraining the shapes model on perfect caption–image pairs gives it only scattered capacity
errors, which a compositional reward cannot correct in a direction. :class:`CaptionNoise` gives the
world that property: for a training caption's spec it returns, with a probability per kind, the spec
of the image that is actually drawn, one fact wrong and always the *same way* for a kind:

==========  ============  ==========================================================================
kind        task          the drawn image
==========  ============  ==========================================================================
``count``   counting      one object fewer (n → n − 1 for n ≥ 2; "one" stays right)
``mirror``  position      the relation mirrored (left of ↔ right of, above ↔ below)
``swap``    color_attr    the two objects' colours swapped (skipped where that would draw a held-out
                          colour–shape pair, so held-out pairs stay unseen)
``drop``    two_objects   the second object left out
==========  ============  ==========================================================================

The caption (prompt) is never changed. A flip probability above 0.5 makes the wrong reading the
model's majority belief (a learned, biased prior), below 0.5 a minority error; a two-way flip at
exactly 0.5 leaves the caption silent on the direction. Every draw comes from the ``rng`` passed in.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from typing import Collection

import numpy as np

from flowrl.shapes import world

KINDS: dict[str, str] = {"count": "counting", "mirror": "position", "swap": "color_attr", "drop": "two_objects"}
MIRROR: dict[str, str] = {"left of": "right of", "right of": "left of", "above": "below", "below": "above"}


@dataclass(frozen=True)
class CaptionNoise:
    """Probability per kind that a caption's image is drawn one fact wrong (see module docstring)."""

    count: float = 0.0
    mirror: float = 0.0
    swap: float = 0.0
    drop: float = 0.0

    def __post_init__(self) -> None:
        for kind, p in asdict(self).items():
            if not 0.0 <= p <= 1.0:
                raise ValueError(f"caption noise {kind}={p} must be a probability in [0, 1]")

    @classmethod
    def parse(cls, text: str | None) -> "CaptionNoise":
        """``"count=0.7,mirror=0.7"`` → CaptionNoise (empty or None → no noise); names the bad item."""
        if not text:
            return cls()
        values: dict[str, float] = {}
        for item in text.split(","):
            kind, sep, value = item.strip().partition("=")
            if not sep or kind not in KINDS:
                raise ValueError(f"caption noise item {item.strip()!r} must be KIND=P with KIND in {list(KINDS)}")
            try:
                values[kind] = float(value)
            except ValueError:
                raise ValueError(f"caption noise {kind}={value!r} is not a number") from None
        return cls(**values)

    def any(self) -> bool:
        return any(p > 0 for p in asdict(self).values())

    def apply(
        self, spec: world.Spec, rng: np.random.Generator, held_out: Collection[tuple[str, str]] = ()
    ) -> tuple[world.Spec, str | None]:
        """The spec to draw for a caption of ``spec`` and the kind of error applied (None: faithful).

        One uniform draw from ``rng`` per call whatever the task, so the stream of draws does not
        depend on which kinds are switched on."""
        u = float(rng.random())
        for kind, task in KINDS.items():
            if spec.task == task and u < getattr(self, kind):
                wrong = corrupt(spec, kind, held_out)
                return (spec, None) if wrong is None else (wrong, kind)
        return spec, None


def corrupt(spec: world.Spec, kind: str, held_out: Collection[tuple[str, str]] = ()) -> world.Spec | None:
    """``spec`` with one fact wrong the ``kind`` way, or None where that kind cannot apply
    (a count of one; a swap that would draw a held-out pair). The result is a valid spec to render."""
    if kind not in KINDS:
        raise ValueError(f"unknown caption noise kind {kind!r}; accepted: {list(KINDS)}")
    if spec.task != KINDS[kind]:
        raise ValueError(f"caption noise {kind!r} applies to task {KINDS[kind]!r}, not {spec.task!r}")
    if kind == "count":
        obj = spec.objects[0]
        return None if obj.count == 1 else replace(spec, objects=(replace(obj, count=obj.count - 1),))
    if kind == "mirror":
        return replace(spec, relation=MIRROR[spec.relation])
    if kind == "drop":
        return world.Spec("single", spec.objects[:1])
    a, b = spec.objects
    swapped = world.recolor(spec, {a.color: b.color, b.color: a.color})
    if any((o.shape, o.color) in set(held_out) for o in swapped.objects):
        return None
    return world.validate(swapped)
