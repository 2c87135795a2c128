"""The checks of :class:`~flowrl_rewards.judges.vlm_judge.VlmJudge`'s settings: each names the key and the value it
refuses."""

from __future__ import annotations

import math
import re
import string
from typing import Any, Sequence


def check_choice(key: str, value: Any, accepted: Sequence[str], hint: str = "") -> str:
    """``value`` if it is one of ``accepted``, else a ValueError naming the key, the value and ``accepted``."""
    if value not in accepted:
        raise ValueError(f"vlm_judge: {key}={value!r} is not one of {tuple(accepted)}{hint}")
    return value


def check_template(key: str, value: Any) -> str:
    """A question template: text where ``{prompt}`` is the only field (literal braces doubled: ``{{ }}``)."""
    if not isinstance(value, str) or not value.strip():
        raise ValueError(f"vlm_judge: {key}={value!r} must be a non-empty string (the only field is {{prompt}})")
    try:
        fields = [f for _, f, _, _ in string.Formatter().parse(value) if f is not None]
    except ValueError as e:
        raise ValueError(
            f"vlm_judge: {key}={value!r} is not a valid template ({e}); write literal braces as {{{{ and }}}}"
        ) from e
    bad = [f for f in fields if f != "prompt"]
    if bad:
        raise ValueError(
            f"vlm_judge: {key}={value!r} has the field {{{bad[0]}}}; the only field accepted is "
            "{prompt} (the image's prompt); write literal braces as {{ and }}"
        )
    return value


def check_number(key: str, value: Any, low: float = 0.0, strict: bool = False, integer: bool = False) -> float:
    """``value`` as a number ≥ ``low`` (> with ``strict``; an int with ``integer``), else a ValueError naming it."""
    kind = int if integer else (int, float)
    if (
        isinstance(value, bool)
        or not isinstance(value, kind)
        or not math.isfinite(value)
        or value < low
        or (strict and value == low)
    ):
        what = "an integer" if integer else "a number"
        raise ValueError(f"vlm_judge: {key}={value!r} must be {what} {'>' if strict else '>='} {low:g}")
    return value


def check_range(value: Any) -> tuple[float, float]:
    """``score_range`` as (low, high) with low < high."""
    ok = (
        isinstance(value, (list, tuple))
        and len(value) == 2
        and all(isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) for v in value)
    )
    if not ok or value[0] >= value[1]:
        raise ValueError(
            f"vlm_judge: score_range={value!r} must be [low, high] with low < high, e.g. [1, 5]: "
            "the judge's scale, mapped to [0, 1]"
        )
    return float(value[0]), float(value[1])


def check_pattern(value: Any) -> re.Pattern:
    """``pattern`` compiled; its first group (or the whole match without groups) is the number."""
    try:
        return re.compile(value)
    except (re.error, TypeError) as e:
        raise ValueError(f"vlm_judge: pattern={value!r} is not a regular expression ({e})") from e
