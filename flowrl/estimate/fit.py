"""``train.fit: auto``: the settings that fill a device, chosen from the estimate before any weight loads
(docs/estimate.md, "Settings chosen from the estimate").

The keys it chooses (:data:`flowrl.config.checks.FIT_KEYS`): the rollout's states per forward
(``rollout.max_batch``), the update's rows per forward (``train.micro_batch``; a policy objective replays the
rollout's forwards, so for it the two are one), how many transformer blocks are gradient-checkpointed
(``model.gradient_checkpointing`` + ``model.checkpoint_blocks``, block by block) and whether the text encoders wait
in CPU memory (``model.offload_encoders``). Keys given on the command line (``key=value``) or named in
``train.fit_keep`` are kept as set, and said to win.

How it chooses, in three steps:

1. **Two probes.** :func:`~flowrl.estimate.iteration.estimate` at the smallest and the largest useful batches, every
   block checkpointed. On the meta device every activation is a linear function of the batch, and a phase's peak
   is a maximum of such functions, so it is convex in the batch: the straight line between the two probes never
   under-predicts a batch between them. Between no block and every block checkpointed the update's activations are
   interpolated per block, plus one block's worth (the recomputation of a checkpointed block is transient).
2. **The best candidate.** Every (rollout batch, update batch, checkpointed blocks, offload) the line predicts within
   ``train.memory_fraction`` × the device's memory is scored by its predicted throughput: the update's efficiency
   ``x / (x + EFFICIENCY_TOKENS)`` for ``x`` tokens per forward, over its cost ``1 + k / (3 N)`` (a checkpointed block
   adds one forward to a forward and a backward, about a third); offload only when nothing else fits. The
   rollouts take the largest batch that fits beside it.
3. **Verified.** The chosen settings are estimated in full; a choice over the budget (the interpolation is an
   approximation in the block count) falls back to the next candidate.

A config whose least-memory settings do not fit is refused with the predicted peak, the capacity and what would make
it fit, each estimated: LoRA instead of full fine-tuning, FSDP over N GPUs, a lower resolution.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass, field
from typing import Any, Iterable

from flowrl.config import build
from flowrl.config.checks import FIT_KEYS
from flowrl.errors import ConfigError
from flowrl.estimate.archs import arch_for_model
from flowrl.estimate.fit_search import (  # noqa: F401 (EFFICIENCY_TOKENS, OFFLOAD_PENALTY: this module's API)
    EFFICIENCY_TOKENS,
    OFFLOAD_PENALTY,
    _Candidate,
    _Chooser,
    _MemoryModel,
    states_of,
)
from flowrl.estimate.gpus import assume_gpu, gpu_class
from flowrl.estimate.iteration import estimate
from flowrl.estimate.report import size_text as gib

VERIFY_TRIES = 4


@dataclass
class Fit:
    """What ``train.fit: auto`` chose: ``config`` (a fitted copy), ``settings`` (every key fit may choose → its
    effective value), ``changed`` (key → (before, after)), ``kept`` (keys the user set: they win), the predicted
    ``peak_gib`` of ``budget_gib`` (= ``memory_fraction`` × ``capacity_gib``), ``seconds_per_iteration``
    [low, high] and ``flops_per_iteration`` (per process), and the ``estimate`` itself."""

    config: Any
    settings: dict[str, Any]
    changed: dict[str, tuple[Any, Any]]
    kept: list[str]
    peak_gib: float
    budget_gib: float
    capacity_gib: float
    device: str
    seconds_per_iteration: list[float]
    flops_per_iteration: float
    estimate: dict = field(repr=False, default_factory=dict)
    target: str = "cuda"

    def summary(self) -> list[str]:
        """Printable lines: the device, the predicted peak and s/iteration, each key and whether fit or the user set
        it."""
        lo, hi = self.seconds_per_iteration
        timing = f", {_seconds(lo)}–{_seconds(hi)} s/iteration" if self.target == "cuda" else ""  # a GPU's range
        lines = [
            f"train.fit=auto for {self.device}: predicted peak {gib(self.peak_gib)} of {gib(self.budget_gib)} "
            f"(train.memory_fraction × {gib(self.capacity_gib)}){timing}"
        ]
        for key, value in self.settings.items():
            if key in self.kept:
                note = "set explicitly: it wins"
            elif key in self.changed:
                note = f"chosen (the config had {_shown(self.changed[key][0])})"
            else:
                note = "chosen (as the config had it)"
            lines.append(f"  {key} = {_shown(value)}  — {note}")
        return lines

    def to_json(self) -> dict:
        return {
            "device": self.device,
            "peak_gib": self.peak_gib,
            "budget_gib": self.budget_gib,
            "capacity_gib": self.capacity_gib,
            "seconds_per_iteration": self.seconds_per_iteration,
            "flops_per_iteration": self.flops_per_iteration,
            "settings": self.settings,
            "kept": self.kept,
            "changed": {k: list(v) for k, v in self.changed.items()},
        }


def _shown(value: Any) -> str:
    return "null" if value is None else str(value).lower() if isinstance(value, bool) else str(value)


def _seconds(x: float) -> str:
    return f"{x:.0f}" if x >= 10 else f"{x:.2g}"


def settings_of(cfg) -> dict[str, Any]:
    """The effective value of every key :func:`fit_config` may choose, as ``cfg`` sets them."""
    return {
        "rollout.max_batch": int(cfg.rollout.max_batch),
        "train.micro_batch": cfg.train.micro_batch,
        "model.gradient_checkpointing": bool(cfg.model.gradient_checkpointing),
        "model.checkpoint_blocks": cfg.model.checkpoint_blocks,
        "model.offload_encoders": bool(cfg.model.offload_encoders),
    }


def with_settings(cfg, settings: dict[str, Any]):
    """A validated copy of ``cfg`` with ``settings`` (dotted keys, e.g. ``rollout.max_batch``) applied."""
    out = copy.deepcopy(cfg)
    for key, value in settings.items():
        obj = out
        *path, last = key.split(".")
        for part in path:
            obj = getattr(obj, part)
        setattr(obj, last, value)
    out.validate()
    return out


def kept_keys(overrides: Iterable[str]) -> list[str]:
    """The keys :func:`fit_config` may choose that ``key=value`` command-line ``overrides`` set (they win)."""
    keys = [o.split("=", 1)[0].strip() for o in overrides]
    return [k for k in keys if k in FIT_KEYS]


# ---- the choice (its memory model and chooser: flowrl.estimate.fit_search) -------------------------------------
def fit_config(
    cfg,
    gpu: str = "H100",
    *,
    processes: int = 1,
    capacity_gib: float | None = None,
    keep: Iterable[str] = (),
    arch: dict | None = None,
    target: str = "cuda",
    shard: str | None = None,
    device: str | None = None,
) -> Fit:
    """The settings of ``cfg`` that fill ``capacity_gib`` (default: the GPU class ``gpu``'s memory) ×
    ``train.memory_fraction`` by the estimate (see the module's docstring); ``keep``: keys (of :data:`FIT_KEYS`) to
    leave as ``cfg`` sets them, besides ``train.fit_keep``. Raises :class:`ConfigError` when even the least-memory
    settings do not fit, naming the predicted peak, the capacity and what would fit."""
    if target == "cuda":  # an explorer backend is checked against the GPU class, not this machine
        with assume_gpu(gpu):
            return _fit(cfg, gpu, processes, capacity_gib, keep, arch, target, shard, device)
    return _fit(cfg, gpu, processes, capacity_gib, keep, arch, target, shard, device)


def _fit(
    cfg,
    gpu: str,
    processes: int,
    capacity_gib: float | None,
    keep: Iterable[str],
    arch: dict | None,
    target: str,
    shard: str | None,
    device: str | None,
) -> Fit:
    spec = gpu_class(gpu)
    capacity = float(capacity_gib if capacity_gib is not None else spec.memory_gib)
    budget = capacity * float(cfg.train.memory_fraction)
    keep = {k for k in (*keep, *cfg.train.fit_keep) if k in FIT_KEYS}
    arch = arch or arch_for_model(cfg.model)
    facts = build.build_loss(cfg).describe()
    policy, unit = facts.trains_on == "edges", int(facts.rows_per_unit)
    run = dict(gpu=gpu, processes=processes, arch=arch, target=target, shard=shard)
    kept_b = int(cfg.rollout.max_batch) if "rollout.max_batch" in keep else None
    first = estimate(with_settings(cfg, _probe(cfg, kept_b or unit, unit, keep, policy)), **run)
    counts = first["counts"]
    caps = (max(unit, int(max(counts["leaves"], counts["pool"]))), max(unit, int(counts["train_rows"])))
    if policy:
        caps = (caps[0], caps[0])
    high_b = kept_b or caps[0]
    high_u = high_b if policy else (_kept_u(cfg) if "train.micro_batch" in keep else caps[1])
    second = estimate(with_settings(cfg, _probe(cfg, high_b, high_u, keep, policy)), **run)
    model = _MemoryModel(first, second, first["shapes"]["blocks"])
    caps = (min(caps[0], model.b[1]), min(caps[1], model.u[1]) if not policy else min(caps[0], model.b[1]))
    sh = first["shapes"]
    tokens = (sh["image_tokens"] + sh["text_tokens"] + sh["source_tokens"]) * (2 if sh["train_cfg"] else 1)
    chooser = _Chooser(cfg, keep, model, budget, policy, unit, caps, tokens)
    name = device or spec.name
    # the best candidates, then (the interpolation is an approximation) the least-memory settings
    for candidate in [*chooser.ranked()[:VERIFY_TRIES], chooser.least()]:
        settings = chooser.settings(candidate)
        fitted = with_settings(cfg, {k: v for k, v in settings.items() if k not in keep})
        result = estimate(fitted, **run)
        if result["memory_gib"]["peak"] <= budget:
            return _result(cfg, fitted, result, keep, budget, capacity, name, target)
    raise ConfigError(_refusal(cfg, chooser, budget, capacity, name, run, (sh["height"], sh["width"])))


def _kept_u(cfg) -> int:
    return int(cfg.train.micro_batch or cfg.rollout.max_batch)


def _probe(cfg, b: int, u: int, keep: set[str], policy: bool) -> dict[str, Any]:
    """Settings of a probe: batches ``b`` and ``u``, every block checkpointed (the estimate reports the update with
    and without), encoders on the device (the model adds their offload)."""
    settings = {
        "rollout.max_batch": b,
        "train.micro_batch": None if policy else u,
        "model.gradient_checkpointing": True,
        "model.checkpoint_blocks": None,
        "model.offload_encoders": False,
    }
    return {k: v for k, v in settings.items() if k not in keep or k == "model.checkpoint_blocks"}


def _result(cfg, fitted, result: dict, keep: set[str], budget: float, capacity: float, device: str, target: str) -> Fit:
    before, after = settings_of(cfg), settings_of(fitted)
    changed = {k: (before[k], after[k]) for k in after if before[k] != after[k]}
    return Fit(
        fitted,
        after,
        changed,
        sorted(keep),
        result["memory_gib"]["peak"],
        budget,
        capacity,
        device,
        list(result["time"]["seconds_per_iteration"]),
        float(result["flops"]["total"]),
        result,
        target,
    )


def _refusal(
    cfg, chooser: _Chooser, budget: float, capacity: float, device: str, run: dict, size: tuple[int, int]
) -> str:
    """The refusal: the least-memory settings' predicted peak, the capacity, and each remedy's estimated peak."""
    least = chooser.least()
    settings = chooser.settings(least)
    least_cfg = with_settings(cfg, {k: v for k, v in settings.items() if k not in chooser.keep})
    peak = estimate(least_cfg, **run)["memory_gib"]["peak"]
    remedies = []
    for label, overrides, extra in _remedies(least_cfg, run["processes"], size):
        try:
            trial = with_settings(least_cfg, overrides)
            got = estimate(trial, **{**run, **extra})["memory_gib"]["peak"]
        except ConfigError:
            continue
        remedies.append(f"{label}: {gib(got)}" + (" (fits)" if got <= budget else " (does not fit either)"))
    shown = ", ".join(f"{k}={_shown(v)}" for k, v in settings.items())
    return (
        f"train.fit=auto: this config cannot fit {device}: even its least-memory settings ({shown}) need "
        f"{gib(peak)} by the estimate, over {gib(budget)} (train.memory_fraction={cfg.train.memory_fraction} "
        f"× {gib(capacity)}). What the estimate says of each remedy: "
        + ("; ".join(remedies) or "none found")
        + ". (`flowrl bench CONFIG --estimate --gpu NAME [key=value ...]` estimates any other setting.)"
    )


def _remedies(cfg, processes: int, size: tuple[int, int]) -> list[tuple[str, dict[str, Any], dict[str, Any]]]:
    """(label, overrides, estimate arguments) of each remedy: LoRA for full fine-tuning, FSDP over 2/4/8 GPUs, half
    and a quarter of the resolution (``size``: the estimate's height and width)."""
    out = []
    if cfg.model.full_finetune:
        out.append(("model.full_finetune=false (LoRA)", {"model.full_finetune": False}, {}))
    per_step = int(cfg.prompts.per_step)
    for n in (2, 4, 8):
        if n > processes:
            steps = math.ceil(per_step / n) * n
            label = f"model.shard=fsdp over {n} GPUs" + (f" (prompts.per_step={steps})" if steps != per_step else "")
            out.append((label, {"model.shard": "fsdp", "prompts.per_step": steps}, {"processes": n, "shard": "fsdp"}))
    h, w = size
    for scale in (2, 4):
        if h // scale >= 128 and w // scale >= 128:
            out.append(
                (
                    f"model.height={h // scale} model.width={w // scale}",
                    {"model.height": h // scale, "model.width": w // scale},
                    {},
                )
            )
    return out
