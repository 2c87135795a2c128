"""The guided teacher of a forward-process objective (``loss.teacher``; :mod:`flowrl.objectives.teacher`) as the
estimate prices it (docs/estimate.md, "How it works": a guided teacher): its frozen weights, its no-grad forwards in
the update (the anchor) and its share of the rollout's chains (``rollout.teacher_share``).

Read from the objective's :meth:`~flowrl.objectives.base.Objective.describe` (``has_teacher``, ``teacher_guidance``,
``teacher_in_update``, ``teacher_path``, ``frozen_copies``), never from the objective's type or its keys:

- **memory.** The teacher of the initial weights (no ``path``) is the KL reference's copy when the objective builds one
  (``reference`` among its frozen copies: no bytes of its own), else its own reference: the base with the adapter off
  under LoRA (nothing), a frozen copy of the fp32 transformer under full fine-tuning. With a ``path`` it is a loaded
  copy: a deep copy of the trainable module (:func:`flowrl.models.frozen.frozen_copy`), the transformer with its LoRA
  layers under LoRA, the fp32 transformer under full fine-tuning. A rollout process (``train.pipeline: async``) builds
  no reference: there its teacher is always its own copy (:attr:`TeacherPrice.own_bytes`).
- **time.** When the objective reads the teacher's velocity in its updates (``teacher_in_update``: an ``anchor`` > 0,
  or a loss centred on the teacher: NFT's ``loss.center: teacher``, DGPO's ``loss.reference: teacher``) the update runs
  the teacher's guided forward, without gradient, on every training row of every epoch, before the forward with
  gradients: 2 rows per row when its guidance runs CFG. Its sampled chains (the plan's ``teacher_forwards``) run at
  its guidance instead of the policy's.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class TeacherPrice:
    """What the estimate prices of a guided teacher: its ``guidance``, whether its forwards run CFG (``cfg``: 2 rows
    per state), whether the update runs its forward on every training row (``anchor``), whether its weights are
    loaded from ``loss.teacher.path`` (``loaded``) and whether it shares the objective's KL reference copy
    (``shares_reference``)."""

    guidance: float
    cfg: bool
    anchor: bool
    loaded: bool
    shares_reference: bool

    @property
    def rows(self) -> int:
        """Rows one state costs through the teacher: 2 with CFG, else 1."""
        return 2 if self.cfg else 1

    def update_copy(self) -> str | None:
        """The teacher's forward in the traced update (:meth:`flowrl.estimate.phases._PhaseTracer.copy_forward`):
        ``teacher`` (the initial weights: the base with the adapter off under LoRA) or ``teacher_loaded`` (a loaded
        copy, adapters on), ``+cfg`` when it runs CFG; None when the update runs none."""
        if not self.anchor:
            return None
        return ("teacher_loaded" if self.loaded else "teacher") + ("+cfg" if self.cfg else "")

    def own_bytes(self, model: dict) -> int:
        """Bytes of the teacher's own copy (``model``: :func:`~flowrl.estimate.iteration_memory.model_on_meta`'s):
        a loaded copy is the whole trainable module (LoRA layers included); the initial weights cost a full copy
        under full fine-tuning and nothing under LoRA (the adapter off)."""
        if self.loaded:
            return model["weight_bytes"] if model["lora"] is not None else model["full_copy"]
        return 0 if model["lora"] is not None else model["full_copy"]

    def held_bytes(self, model: dict) -> int:
        """Bytes the trainer holds for it: 0 when it shares the KL reference's copy, else :meth:`own_bytes`."""
        return 0 if self.shares_reference else self.own_bytes(model)


def teacher_of(facts, runs_cfg) -> TeacherPrice | None:
    """The :class:`TeacherPrice` of an objective (``facts``: its :class:`~flowrl.objectives.base.ObjectiveFacts`), None
    without a teacher. ``runs_cfg(guidance)``: whether a forward at that guidance runs CFG on this model."""
    if not facts.has_teacher:
        return None
    loaded = facts.teacher_path is not None
    return TeacherPrice(
        guidance=facts.teacher_guidance,
        cfg=bool(runs_cfg(facts.teacher_guidance)),
        anchor=facts.teacher_in_update,
        loaded=loaded,
        shares_reference=not loaded and "reference" in facts.frozen_copies,
    )
