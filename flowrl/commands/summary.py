"""The closing summary of ``flowrl train``: the first and the last eval side by side (each metric before → after),
the training reward held out beside the eval rewards (a warning when it rose while one fell: reward hacking?)
and a CFG-free policy against the guided base model."""

from __future__ import annotations

from typing import Any


def eval_summary(first: dict[str, Any], last: dict[str, Any]) -> list[str]:
    """Lines comparing two eval records: each metric before → after with its change; per-task prompt
    counts (``…/n``, ``…/n/<task>``) once in the heading, not as metrics; then the training reward held out beside
    the eval rewards (:func:`rewards_side_by_side`) and the aligned model against the guided base."""
    keys = sorted(
        k
        for k in last
        if k.startswith(("eval/", "eval_default/"))
        and k in first
        and not k.endswith("/guidance")
        and isinstance(last[k], (int, float))
    )
    is_count = lambda k: k.endswith(("/n", "_failed")) or "/n/" in k  # noqa: E731 (failures: failed_evals)
    counts = [last[k] for k in keys if k.endswith("/n")]
    at = "; ".join(
        f"{p} at guidance {last[p + '/guidance']:g}" for p in ("eval", "eval_default") if f"{p}/guidance" in last
    )
    details = [f"{int(counts[0])} held-out images"] if counts else []
    details += [at] if at else []
    heading = f"eval before → after ({', '.join(details)}):" if details else "eval before → after:"
    return (
        [heading]
        + [f"  {k}: {first[k]:.4f} → {last[k]:.4f}  ({last[k] - first[k]:+.4f})" for k in keys if not is_count(k)]
        + rewards_side_by_side(first, last)
        + against_the_guided_base(first, last)
    )


def rewards_side_by_side(first: dict[str, Any], last: dict[str, Any]) -> list[str]:
    """When the evals score other rewards than the training one (``eval.rewards``): the training reward's held-out
    mean (``eval/train/<name>/mean``) above each eval reward's (``eval/<name>_mean``), before → after, and a warning
    when the training reward rose while an eval reward fell (reward hacking?)."""
    train = sorted(k for k in last if k.startswith("eval/train/") and k.endswith("/mean") and k in first)
    guard = sorted(k for k in last if k.startswith("eval/") and k.endswith("_mean") and k in first)
    if not train or not guard:
        return []
    rows = [("training", k[len("eval/train/") : -len("/mean")], k) for k in train]
    rows += [("eval", k[len("eval/") : -len("_mean")], k) for k in guard]
    width = max(len(name) for _, name, _ in rows)
    g = last.get("eval/guidance")
    out = [
        f"training reward against the eval rewards (held-out means{f' at guidance {g:g}' if g is not None else ''}, "
        "before → after):"
    ]
    out += [
        f"  {role:<8}  {name:<{width}}  {first[k]:.4f} → {last[k]:.4f}  ({last[k] - first[k]:+.4f})"
        for role, name, k in rows
    ]
    rose = any(last[k] > first[k] for k in train)
    fell = [name for role, name, k in rows if role == "eval" and last[k] < first[k]]
    if rose and fell:
        out.append(
            f"  the training reward rose while {', '.join(fell)} fell: look at the samples for reward hacking "
            "(eval.guard stops a run when that happens)"
        )
    return out


def against_the_guided_base(first: dict[str, Any], last: dict[str, Any]) -> list[str]:
    """The line that matters for a CFG-free policy: the aligned model at its own guidance against the base
    model (the ``before`` eval) at its default guidance, when the two guidances differ."""
    g, g_base = last.get("eval/guidance"), first.get("eval_default/guidance")
    if g is None or g_base is None or g == g_base:
        return []
    out = []
    for key in sorted(k for k in last if k.startswith("eval/") and k.endswith("_mean")):
        base_key = "eval_default/" + key[len("eval/") :]
        if base_key in first:
            forwards = "one forward per step" if g == 1 else "two forwards per step"
            out.append(
                f"the aligned model at guidance {g:g} ({forwards}): {key[5:]} {last[key]:.4f}; the base model at "
                f"guidance {g_base:g}: {first[base_key]:.4f}  ({last[key] - first[base_key]:+.4f})"
            )
    return out


def failed_evals(evals: list[dict[str, Any]]) -> list[str]:
    """A warning line per eval reward that failed or was not finite for some held-out images (``eval/<name>_failed``,
    :func:`flowrl.training.evaluation.failed_key`): its name and the count at each eval where it did."""
    from flowrl.training.evaluation import failed_rewards

    found: dict[str, list[str]] = {}
    for record in evals:
        for prefix, name, failed in failed_rewards(record):
            found.setdefault(f"{prefix}/{name}", []).append(f"{failed} images at step {record.get('step')}")
    return [
        f"warning: eval reward {key.split('/', 1)[1]!r} failed or was not finite (NaN or ±inf) for "
        f"{', '.join(counts)} ({key}_failed in metrics.jsonl); its held-out mean is not a measurement"
        for key, counts in found.items()
    ]
