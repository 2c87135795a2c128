"""Held-out evaluation with ODE sampling: guidance, seeds, the reward means of an eval and the run's held-out
evals (:class:`HeldOutEval`); their labelled grids are drawn by :mod:`flowrl.training.grids`, the guard against reward
hacking that watches them is :mod:`flowrl.training.guard`."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any, Callable, NamedTuple, Sequence

import torch
from tqdm.auto import tqdm

from flowrl.core.seeding import derive_seed
from flowrl.models.base import FlowModel
from flowrl.models.image_prompts import prompt_texts
from flowrl.rollout.sampling import ode_batches
from flowrl.rollout.scoring import components_of
from flowrl.training.grids import grid_scores, labelled_grid, save_frames
from flowrl_rewards.core.port import Scorer


# ---- guidance ---------------------------------------------------------------------------------
def resolve_guidance(model_default: float, *preferred: float | None) -> float:
    """The guidance to sample with: the first of ``preferred`` that is set, in precedence order (e.g.
    ``--guidance``, ``eval.guidance``, the rollouts' guidance), else the model's default."""
    return float(next((g for g in preferred if g is not None), model_default))


def eval_guidances(
    eval_guidance: float | None, policy_guidance: float | None, model_default: float, default_pass: bool
) -> list[tuple[str, float]]:
    """(metric prefix, guidance) of each pass of an eval: ``eval`` at ``eval.guidance``, else the guidance the
    policy samples with, else the model's default; with ``default_pass`` also ``eval_default`` at the
    model's default guidance when it differs."""
    main = resolve_guidance(model_default, eval_guidance, policy_guidance)
    out = [("eval", main)]
    if default_pass and float(model_default) != main:
        out.append(("eval_default", float(model_default)))
    return out


# ---- seeds and metrics ------------------------------------------------------------------------
def prompt_seeds(seed: int, indices: Sequence[int], seed_set: int = 0) -> list[int]:
    """The seed of image ``seed_set`` of each held-out prompt, by its index in the whole prompt list (so a
    prompt draws the same image whichever process evaluates it; set 0 is the historical one)."""
    if seed_set == 0:
        return [derive_seed(seed, "eval", i) for i in indices]
    return [derive_seed(seed, "eval", i, seed_set) for i in indices]


def eval_seeds(seed: int, n: int, seed_set: int = 0) -> list[int]:
    """Fixed per-image seeds of an evaluation of ``n`` prompts (the same at every eval, so grids compare):
    :func:`prompt_seeds` of prompts 0 … n−1."""
    return prompt_seeds(seed, range(n), seed_set)


class Evaluated(NamedTuple):
    """One process's eval: ``metrics`` key → value; ``weights`` key → the number of items behind a mean (a
    key without one is a count, added over processes); ``images`` [K, 3, H, W] (videos [K, F, 3, H, W]) for
    the grid."""

    metrics: dict[str, float]
    weights: dict[str, float]
    images: torch.Tensor


def term_weights(summary: dict[str, float], n_images: int) -> dict[str, float]:
    """The weight of each mean of a reward term's ``evaluate`` summary: ``<m>/<sub>`` by the count
    ``n/<sub>`` when the summary has it, other means by ``n`` (else ``n_images``); counts (``n``,
    ``n/<sub>``) get none."""
    base = float(summary.get("n", n_images))
    out = {}
    for key in summary:
        if key == "n" or key.startswith("n/"):
            continue
        sub = key.split("/", 1)[1] if "/" in key else None
        out[key] = float(summary[f"n/{sub}"]) if sub is not None and f"n/{sub}" in summary else base
    return out


def train_key(prefix: str, name: str) -> str:
    """The metric key of training reward term ``name``'s held-out mean in eval pass ``prefix``:
    ``eval/train/<name>/mean``
    (beside the eval rewards' ``eval/<name>_mean``, so a training and an eval term of one name stay apart)."""
    return f"{prefix}/train/{name}/mean"


def failed_key(prefix: str, name: str) -> str:
    """The metric key counting eval reward ``name``'s non-finite scores (failed, timed out, NaN or ±inf) in eval pass
    ``prefix``: ``eval/<name>_failed``, recorded only when some image's score was not finite."""
    return f"{prefix}/{name}_failed"


def failed_rewards(metrics: dict[str, Any]) -> list[tuple[str, str, int]]:
    """``(metric prefix, reward name, images)`` of every eval reward with non-finite scores in an eval's metrics."""
    out = []
    for key, value in metrics.items():
        prefix, _, rest = key.partition("/")
        if prefix in ("eval", "eval_default") and rest.endswith("_failed") and value:
            out.append((prefix, rest[: -len("_failed")], int(value)))
    return out


def score_images(
    images: torch.Tensor, prompts: Sequence[str], reward: Scorer, prefix: str, train_reward: Scorer | None = None
) -> tuple[dict, dict]:
    """(metrics, weights) of images [N, 3, H, W] (or videos [N, F, 3, H, W]) of ``prompts``: the mean of each
    reward term (``<prefix>/<name>_mean``, weight N; an image term scores a video's frames, averaged), the
    numeric summary of each term's ``evaluate`` (:meth:`flowrl_rewards.core.port.Scorer.evaluate`; ``{}`` for a term
    without
    one; not asked of an image term given videos) and,
    with ``train_reward`` (the training reward, when the eval scores with others), the mean of each of its terms
    (:func:`train_key`): the training reward held out, beside the guard rewards."""
    metrics: dict[str, float] = {}
    weights: dict[str, float] = {}
    scored = [(lambda name: f"{prefix}/{name}_mean", reward)]
    if train_reward is not None:
        scored.append((lambda name: train_key(prefix, name), train_reward))
    for key, judge in scored:
        for name, scores in components_of(judge, images, prompts, {}).items():
            metrics[key(name)] = float(scores.mean())
            weights[key(name)] = float(len(prompts))
            failed = int((~torch.isfinite(scores.float())).sum())
            if failed and judge is reward:  # a count (no weight: added over processes), only when some failed
                metrics[failed_key(prefix, name)] = float(failed)
    for term in reward.terms:
        if images.ndim == 4 or term.modality != "image":
            summary = {
                k: float(v)
                for k, v in term.evaluate(images, prompt_texts(prompts)).items()
                if isinstance(v, (int, float))
            }
            metrics.update({f"{prefix}/{term.name}/{k}": v for k, v in summary.items()})
            weights.update({f"{prefix}/{term.name}/{k}": w for k, w in term_weights(summary, len(prompts)).items()})
    return metrics, weights


@torch.no_grad()
def evaluate(
    model: FlowModel,
    prompts: Sequence[str],
    reward: Scorer,
    *,
    steps: int,
    guidance: float | None,
    seed: int,
    max_batch: int = 64,
    keep_images: int = 0,
    images_per_prompt: int = 1,
    prefix: str = "eval",
    progress: bool = False,
    indices: Sequence[int] | None = None,
    train_reward=None,
) -> Evaluated:
    """Mean of each reward term (``<prefix>/<name>_mean``; ``train_reward``'s too, :func:`score_images`) and per-task
    breakdowns of the terms' ``evaluate(images, prompts)``, over ``images_per_prompt`` images of every prompt (seed
    sets 0, 1, …:
    the standard error shrinks by √k), with the weight of each mean, and the first ``keep_images`` images
    [K, 3, H, W] (videos [K, F, 3, H, W]) of seed set 0. ``indices``: each prompt's index in the whole held-out list,
    which picks its
    seeds (default 0, 1, …). ``progress``: a bar counting the images drawn."""
    prompts = list(prompts)
    indices = list(range(len(prompts)) if indices is None else indices)
    if len(indices) != len(prompts):
        raise ValueError(f"evaluate: {len(prompts)} prompts but {len(indices)} indices")
    shown = f"guidance {guidance:g}" if guidance is not None else "the model's guidance"
    bar = tqdm(
        total=len(prompts) * images_per_prompt,
        unit="image",
        desc=f"{prefix} at {shown}",
        disable=not progress,
        leave=False,
    )
    chunks = []
    for k in range(images_per_prompt):
        seeds = prompt_seeds(seed, indices, k)
        for _, images in ode_batches(model, prompts, seeds, steps, guidance, max_batch):
            chunks.append(images)
            bar.update(len(images))
    bar.close()
    images = torch.cat(chunks)
    metrics, weights = score_images(images, prompts * images_per_prompt, reward, prefix, train_reward)
    return Evaluated(metrics, weights, images[: min(keep_images, len(prompts))])


class HeldOutEval:
    """The run's evals on its held-out prompts (``eval.*``), this process's share (every ``world``-th prompt,
    each drawn from the seeds of its index in the whole list, so any number of processes draws the same
    images): at ``eval.guidance``, else the guidance the policy samples with (``eval/…``) and, outside the
    periodic evals, at the model's default guidance when it differs (``eval_default/…``). Metrics are
    reduced over processes in one :meth:`~flowrl.distributed.process_group.ProcessGroup.reduce_means` (count-weighted
    means, counts added), equal to one process's over all the prompts; labelled grids in ``samples/``.
    ``train_reward``: the training reward, scored on the same images when the eval's rewards are others
    (``eval/train/<name>/mean``); ``on_grid(tag, image, step)``: called with each grid written (its first frame
    for videos), e.g. to send it to a tracker."""

    def __init__(
        self,
        section,
        model: FlowModel,
        prompts: Sequence[str],
        reward,
        group,
        samples: Path | None,
        policy_guidance: float | None,
        progress: bool = False,
        train_reward=None,
        on_grid: Callable[[str, Any, int], None] | None = None,
        max_batch: int = 64,
    ):
        self.e, self.model, self.reward, self.group, self.samples = section, model, reward, group, samples
        self.max_batch = max_batch  # images per forward: the run's rollout.max_batch
        self.size = (section.height, section.width)  # eval.height/eval.width (None: the model's side)
        if self.size != (None, None):  # refused at the start of a run, not at its first eval
            model.check_size(
                int(self.size[0] or model.height), int(self.size[1] or model.width), "eval.height/eval.width"
            )
        self.train_reward, self.on_grid = train_reward, on_grid
        self.progress = progress and group.is_main  # a bar of the images drawn (the main process's share)
        prompts = list(prompts)
        self.indices = list(range(group.rank, len(prompts), group.world))  # this process's, in the whole list
        self.prompts = [prompts[i] for i in self.indices]
        self.any = bool(prompts)
        self.n_prompts = len(prompts)  # over every process
        self.policy_guidance = policy_guidance

    @property
    def images(self) -> int:
        """The images of one eval pass, over every process."""
        return self.n_prompts * self.e.images_per_prompt

    def guidances(self, periodic: bool = False) -> list[tuple[str, float]]:
        """(metric prefix, guidance) of an eval (:func:`eval_guidances`); ``eval_default`` with
        ``eval.default_guidance``, not at the ``periodic`` evals of ``eval.every``."""
        return eval_guidances(
            self.e.guidance,
            self.policy_guidance,
            self.model.guidance,
            default_pass=bool(self.e.default_guidance) and not periodic,
        )

    def run(self, periodic: bool = False, step: int | None = None) -> tuple[dict[str, float], dict[str, torch.Tensor]]:
        """(metrics over every process, this process's grid images [K, 3, H, W] (videos [K, F, 3, H, W]) per
        prefix) of one eval (at ``step``, named in the warning for an eval reward that failed,
        :meth:`warn_failed`); every process must call it (a process without prompts takes part in the reduction
        only)."""
        if not self.any:
            return {}, {}
        e = self.e
        self.model.trainable.eval()
        metrics: dict[str, float] = {}
        weights: dict[str, float] = {}
        grids: dict[str, torch.Tensor] = {}
        for prefix, guidance in self.guidances(periodic):
            if self.prompts:
                with self.model.sized(*self.size):  # eval.height/eval.width: the rollouts' size is kept outside
                    found = evaluate(
                        self.model,
                        self.prompts,
                        self.reward,
                        steps=e.steps,
                        guidance=guidance,
                        seed=e.seed,
                        max_batch=self.max_batch,
                        keep_images=e.grid_prompts,
                        images_per_prompt=e.images_per_prompt,
                        prefix=prefix,
                        progress=self.progress,
                        indices=self.indices,
                        train_reward=self.train_reward,
                    )
                metrics.update(found.metrics)
                weights.update(found.weights)
                grids[prefix] = found.images
        out = self.group.reduce_means(metrics, weights)
        out.update({f"{prefix}/guidance": guidance for prefix, guidance in self.guidances(periodic)})
        self.warn_failed(out, step)
        return out, grids

    def warn_failed(self, metrics: dict[str, float], step: int | None = None) -> list[str]:
        """A warning (main process) for every eval reward with non-finite scores in ``metrics``, naming it and the
        count; returns the names of those that failed for every image."""
        every = []
        for prefix, name, failed in failed_rewards(metrics):
            when = f" at the eval of step {step}" if step is not None else ""
            if failed >= self.images:
                every.append(name)
            if self.group.is_main:
                warnings.warn(
                    f"eval reward {name!r} failed or was not finite (NaN or ±inf) for {failed} of "
                    f"{self.images} images{when} ({prefix}/{name}_failed); {prefix}/{name}_mean is "
                    f"{metrics.get(f'{prefix}/{name}_mean', float('nan')):g}",
                    RuntimeWarning,
                    stacklevel=2,
                )
        return every

    def __call__(self, step: int, tag: str | None = None) -> dict[str, float]:
        """Metrics of one eval (``tag``: ``before``/``after``; None: a periodic one, named by ``step``); the
        main process writes each pass's labelled grid to ``samples/`` (a PNG; for videos an animated GIF) and hands
        it to ``on_grid`` as ``samples/<prefix>`` (``samples/eval``, ``samples/eval_default``) at ``step``."""
        out, grids = self.run(periodic=tag is None, step=step)
        if self.group.is_main and self.samples is not None:
            for prefix, images in grids.items():
                if images.numel():
                    name = f"{tag or f'step-{step:06d}'}{'' if prefix == 'eval' else '_' + prefix.split('_', 1)[1]}"
                    shown = self.prompts[: images.shape[0]]  # the grid holds the first eval.grid_prompts images
                    frames = labelled_grid(images, shown, grid_scores(images, shown, self.reward))
                    save_frames(frames, self.samples / f"{name}.png", images.ndim == 5)
                    if self.on_grid is not None:
                        self.on_grid(f"samples/{prefix}", frames[0], step)
        return out
