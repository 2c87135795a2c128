"""A judge's answer as a score in [0, 1] (:mod:`flowrl_rewards.judges.vlm_judge`): P(yes) / (P(yes) + P(no)) or
VQAScore's P("Yes") from the first answer token's log-probabilities, or the number a pattern reads in the answer's
text mapped onto [0, 1]."""

from __future__ import annotations

import math
import re
from typing import Sequence

ANSWER = "Yes"
"""VQAScore's answer (t2v_metrics, ``default_answer_template``): its score is P(this first answer token)."""


def bare(token: str) -> str:
    """A token's text without spaces and BPE / SentencePiece space marks (`` Yes``, ``ĠYes``, ``▁Yes`` → ``Yes``)."""
    return token.strip().lstrip("Ġ▁").strip()


def yes_share(candidates: Sequence[tuple[str, float]]) -> float:
    """P(yes) / (P(yes) + P(no)) from (token text, log-probability) pairs, a token's text read without case,
    spaces or BPE space marks (``Yes``, `` yes``, ``ĠYES`` are yes); NaN when neither appears."""
    mass = {"yes": 0.0, "no": 0.0}
    for token, logprob in candidates:
        word = bare(token).lower()
        if word in mass:
            mass[word] += math.exp(logprob)
    total = mass["yes"] + mass["no"]
    return mass["yes"] / total if total > 0 else float("nan")


def answer_probability(candidates: Sequence[tuple[str, float]]) -> float:
    """VQAScore, P("Yes"), from the (token text, log-probability) pairs of the first answer token: the probability of
    the most probable one whose :func:`bare` text is ``Yes`` (case kept: the answer token t2v_metrics scores); 0.0
    when none is but another yes- or no-like token is (P("Yes") is then below the least probability listed); NaN
    when no token reads yes or no (the judge did not answer the question)."""
    yes = [logprob for token, logprob in candidates if bare(token) == ANSWER]
    if yes:
        return math.exp(max(yes))
    if any(bare(token).lower() in ("yes", "no") for token, _ in candidates):
        return 0.0
    return float("nan")


def read_pattern(text: str, pattern: re.Pattern, low: float, high: float) -> tuple[float, str | None]:
    """(score, None): the last match of ``pattern`` in ``text`` mapped from [low, high] to [0, 1] (clipped); or
    (NaN, why) without a match, or when the match is not a number or not a finite one ("nan", "inf")."""
    shown = (text or "")[:200]
    matches = list(pattern.finditer(text or ""))
    if not matches:
        return float("nan"), f"no number matching pattern {pattern.pattern!r} in the answer {shown!r}"
    m = matches[-1]
    found = m.group(1) if pattern.groups else m.group(0)
    try:
        value = float(found)
    except (TypeError, ValueError):
        return float("nan"), f"pattern {pattern.pattern!r} matched {found!r}, not a number, in the answer {shown!r}"
    if not math.isfinite(value):
        return float("nan"), (
            f"pattern {pattern.pattern!r} matched {found!r}, not a finite number, in the answer {shown!r}"
        )
    return min(1.0, max(0.0, (value - low) / (high - low))), None


def pattern_score(text: str, pattern: re.Pattern, low: float, high: float) -> float:
    """:func:`read_pattern`'s score alone."""
    return read_pattern(text, pattern, low, high)[0]
