"""The shapes world's train and eval prompt files (configs/shapes/prompts/*.txt, written by
scripts/make_shapes_prompts.py): every composition of :mod:`flowrl.shapes.world`, three colour–shape pairs
held out of training, tasks balanced and interleaved."""

from __future__ import annotations

import numpy as np

from flowrl.shapes.world import COLORS, SHAPES, TASKS, Spec, all_specs, to_prompt

N_HELD_OUT = 3  # colour–shape pairs that appear only in eval prompts
EVAL_PER_TASK = 48  # eval lines per task (240 in all)
EVAL_DISTINCT_HALF = 24  # at most this many novel-pair and this many seen-pair eval prompts
TRAIN_PER_TASK = 400  # train lines per task (2,000 in all)


def held_out_pairs(seed: int = 0) -> list[tuple[str, str]]:
    """The N_HELD_OUT (shape, colour) pairs kept out of training: one per shape, all colours distinct."""
    rng = np.random.default_rng([seed, 1])
    colors = list(COLORS)
    picked = rng.permutation(len(colors))[:N_HELD_OUT]
    return [(shape, colors[int(i)]) for shape, i in zip(SHAPES, picked)]


def _uses(spec: Spec, pairs: set[tuple[str, str]]) -> bool:
    return any((o.shape, o.color) in pairs for o in spec.objects)


def _cycle(items: list[str], n: int) -> list[str]:
    return [items[i % len(items)] for i in range(n)]


def prompt_sets(seed: int = 0) -> tuple[list[str], list[str]]:
    """(train, eval) prompt lists, deterministic in ``seed``.

    - Held out: :func:`held_out_pairs` (3 colour–shape pairs) appear in no train prompt.
    - Eval, per task: up to EVAL_DISTINCT_HALF prompts using a held-out pair ("novel") and as many
      unseen compositions of seen pairs; cycled to EVAL_PER_TASK lines (240 in all; `single` has
      only 6 distinct eval prompts, `counting` 24, so those lines repeat).
    - Train, per task: every remaining prompt of seen pairs, subsampled or cycled to TRAIN_PER_TASK
      lines so the tasks are balanced (2,000 lines; small tasks repeat).
    - No eval prompt is a train prompt. Both lists interleave the tasks (line k has task k mod 5)
      so any prefix is balanced.
    """
    rng = np.random.default_rng([seed, 2])
    held = set(held_out_pairs(seed))
    train_by_task, eval_by_task = [], []
    for task in TASKS:
        prompts = [to_prompt(s) for s in all_specs(task)]
        novel_mask = [_uses(s, held) for s in all_specs(task)]
        novel = [p for p, m in zip(prompts, novel_mask) if m]
        seen = [p for p, m in zip(prompts, novel_mask) if not m]
        n = min(EVAL_DISTINCT_HALF, len(novel))
        novel_pick = [novel[i] for i in rng.permutation(len(novel))[:n]]
        seen_order = rng.permutation(len(seen))
        seen_pick = [seen[i] for i in seen_order[:n]]
        train_pool = [seen[i] for i in seen_order[n:]]
        eval_distinct = [p for pair in zip(novel_pick, seen_pick) for p in pair]
        eval_by_task.append(_cycle(eval_distinct, EVAL_PER_TASK))
        train_by_task.append(_cycle(train_pool, TRAIN_PER_TASK))
    interleave = lambda per_task: [lines[k] for k in range(len(per_task[0])) for lines in per_task]
    return interleave(train_by_task), interleave(eval_by_task)
