"""The GenEval reward and metric, in-process: GenEval's detector and colour classifier
(:mod:`flowrl_rewards.compositional.geneval_detector`) and GenEval's rules
(:mod:`flowrl_rewards.compositional.geneval_rules`, shared with the shapes
world's reward).

Per image it computes GenEval's strict verdict (the benchmark), Flow-GRPO's exact verdict and partial score (the
reward its GenEval server trains with) and the prompt's task; the training score is one of them (``score``).
Each prompt's task comes from GenEval's metadata files (``metadata``: ``dataset/geneval/*_metadata.jsonl`` from
``flowrl data fetch geneval``) or, for a prompt in none, from GenEval's templates
(:mod:`flowrl_rewards.compositional.geneval_prompts`);
a prompt that is neither fails at load, naming its file and line.
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np
import torch

from flowrl.core.choices import choose
from flowrl_rewards.compositional import geneval_rules as rules
from flowrl_rewards.compositional.geneval_detector import DEFAULT_DETECTOR, ClipColors, Mask2FormerDetector
from flowrl_rewards.compositional.geneval_prompts import COCO_CLASSES, TaskBook
from flowrl_rewards.core._common import check_batch_size, resolve_device, resolve_dtype, to_uint8
from flowrl_rewards.core.base import Reward

SCORES: tuple[str, ...] = ("partial", "strict", "exact")


class GenEvalReward(Reward):
    """GenEval, in-process.

    kwargs:
      score: the training score: ``partial`` (default; Flow-GRPO's reward server), ``strict`` (GenEval's verdict,
        0/1) or ``exact`` (Flow-GRPO's verdict: every count exact, 0/1).
      metadata: GenEval metadata JSONL file(s) giving each prompt's task (default: none, GenEval's templates);
        checked at load: a class the detector does not know, an include count above ``max_objects`` or a colour
        outside GenEval's ten (lower case) is refused, naming the file, line and field.
      detector: a transformers Mask2Former COCO instance-segmentation checkpoint, hub id or local folder (default
        ``facebook/mask2former-swin-small-coco-instance``, the architecture GenEval uses).
      clip_model / clip_pretrained: the colour classifier, an open_clip architecture and its weights (default
        ``ViT-L-14`` / ``openai``, GenEval's; a local checkpoint file works too).
      confidence, counting_threshold, max_objects, max_overlap, position_threshold: GenEval's options (0.3, 0.9,
        16, 1.0, 0.1).
      device, dtype, batch_size: as every model reward (docs/rewards.md).

    Adds to ``meta``: ``geneval/strict``, ``geneval/exact``, ``geneval/partial`` (float32 [B]) and
    ``geneval/tag`` (list). :meth:`evaluate` summarises a batch as GenEval does (per-task accuracy, overall).
    """

    name = "geneval"

    def __init__(
        self,
        score: str = "partial",
        metadata: str | Sequence[str] | None = None,
        detector: str = DEFAULT_DETECTOR,
        clip_model: str = "ViT-L-14",
        clip_pretrained: str | None = "openai",
        confidence: float = 0.3,  # a detection is kept when its score is above this (GenEval's)
        counting_threshold: float = 0.9,  # the same, for counting prompts (GenEval's)
        max_objects: int = 16,  # detections kept per class at most (GenEval's)
        max_overlap: float = 1.0,  # overlap above which a detection is suppressed (1.0: no suppression, GenEval's)
        position_threshold: float = 0.1,  # a relation's offset is shrunk by this × the boxes' summed sizes per axis
        device: str = "auto",
        dtype: str = "auto",
        batch_size: int = 8,
    ):
        choose("geneval: score", score, SCORES, error=ValueError)
        for key, value, low, high in (
            ("confidence", confidence, 0, 1),
            ("counting_threshold", counting_threshold, 0, 1),
            ("max_overlap", max_overlap, 0, 1),
            ("position_threshold", position_threshold, 0, 1),
        ):
            if not isinstance(value, (int, float)) or not low <= value <= high:
                raise ValueError(f"geneval: {key}={value!r} must be a number in [{low}, {high}]")
        if isinstance(max_objects, bool) or not isinstance(max_objects, int) or max_objects < 1:
            raise ValueError(f"geneval: max_objects={max_objects!r} must be an integer >= 1")
        self.score_kind = score
        # metadata checked before any model loads: classes, counts within max_objects, colours, fields
        self.tasks = TaskBook(
            [metadata] if isinstance(metadata, str) else list(metadata or []), max_objects=max_objects
        )
        self.thresholds = rules.Thresholds(
            float(confidence), float(counting_threshold), max_objects, float(max_overlap)
        )
        self.position_threshold = float(position_threshold)
        dev = resolve_device(device, self.name)
        dt = resolve_dtype(dtype, dev, self.name)
        check_batch_size(batch_size, self.name)
        self.detector = Mask2FormerDetector(detector, dev, dt, batch_size, owner=self.name)
        self.tasks.require_classes(set(self.detector.names) & set(COCO_CLASSES), detector)
        from flowrl_rewards.preference.clip_score import load_open_clip

        net, preprocess, tokenizer = load_open_clip(clip_model, clip_pretrained, self.name, device=dev)
        self.colors = ClipColors(net, preprocess, tokenizer, dev, dt, batch_size=max(batch_size, 1))
        self._last: tuple | None = None  # (images, prompts, verdicts) of the last call

    def check_prompt(self, prompt: str) -> None:
        """A prompt with a GenEval task (ValueError otherwise)."""
        self.tasks(prompt)

    def relation(self, a: rules.Found, b: rules.Found) -> set:
        return rules.relative_position(a, b, self.position_threshold)

    def verdicts(self, images: Any, prompts: Sequence[str]) -> list[rules.Verdict]:
        """One :class:`~flowrl_rewards.compositional.geneval_rules.Verdict` per image [B, 3, H, W] in [0, 1] (or uint8
        [B, H, W, 3]). The
        last call's are kept: an eval that scores a batch and then asks for its summary (:meth:`evaluate`, with the
        same images object) runs the detector once."""
        if self._last is not None and self._last[0] is images and self._last[1] == tuple(prompts):
            return self._last[2]
        found = self._judge(images, prompts)
        self._last = (images, tuple(prompts), found)
        return found

    def _judge(self, images: Any, prompts: Sequence[str]) -> list[rules.Verdict]:
        arr = images if isinstance(images, np.ndarray) else to_uint8(torch.as_tensor(images))
        tasks = [self.tasks(p) for p in prompts]
        out = []
        for image, task, raw in zip(arr, tasks, self.detector(arr)):
            objects = rules.keep(raw, task.tag, self.thresholds)
            for cls in task.color_classes & set(objects):
                colours = self.colors(image, objects[cls], cls)
                objects[cls] = [rules.Found(f.box, f.score, c, f.center) for f, c in zip(objects[cls], colours)]
            out.append(rules.judge(task, objects, self.relation))
        return out

    def score(self, images: torch.Tensor, prompts: Sequence[str], meta: dict[str, Any]) -> torch.Tensor:
        """float32 [B] scores (``score``: partial, strict or exact) for images [B, 3, H, W] in [0, 1]."""
        found = self.verdicts(images, prompts)
        columns = {k: torch.tensor([float(getattr(v, k)) for v in found], dtype=torch.float32) for k in SCORES}
        meta.update({f"geneval/{k}": v.numpy() for k, v in columns.items()})
        meta["geneval/tag"] = [v.tag for v in found]
        return columns[self.score_kind]

    def evaluate(self, images: Any, prompts: Sequence[str]) -> dict[str, float]:
        """GenEval's summary of a batch: ``accuracy`` (strict, over images), ``overall`` (the mean of the task
        accuracies present), ``partial``, ``accuracy/<tag>`` and ``n/<tag>`` per task present, ``n``."""
        found = self.verdicts(images, prompts)
        scores = rules.task_scores(found)
        out: dict[str, float] = {"n": len(found)}
        if found:
            out["accuracy"] = scores["images"]
            out["overall"] = scores["overall"]
            out["partial"] = float(np.mean([v.partial for v in found]))
        for tag in rules.TAGS:
            if tag in scores:
                out[f"accuracy/{tag}"] = scores[tag]
                out[f"n/{tag}"] = scores[f"n/{tag}"]
        return out
