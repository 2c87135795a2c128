"""Frozen copies of a model's transformer (an objective's old policy or reference under full fine-tuning, a teacher
loaded from another run), recorded on the model (its declared ``frozen_copies``) so that whatever later wraps the
transformer (FSDP2 sharding, :mod:`flowrl.distributed.sharding`) wraps its copies alike."""

from __future__ import annotations

import copy

from torch import nn


def frozen_copy(model) -> nn.Module:
    """A frozen, eval-mode deep copy of ``model.trainable``, recorded on the model (:func:`frozen_copies`)."""
    made = copy.deepcopy(model.trainable).requires_grad_(False).eval()
    model.record_frozen_copy(made)
    return made


def frozen_copies(model) -> list[nn.Module]:
    """Every copy :func:`frozen_copy` made of ``model``'s transformer, oldest first."""
    return list(model.frozen_copies)
