"""Text encoders kept in CPU memory between uses (``model.offload_encoders``), a mixin of
:class:`~flowrl.models.base.FlowModel`: prompts are encoded once each and cached on the device, so the
encoders (T5-XXL: 9 GB in bf16) are needed only when a batch brings prompts not yet cached; they come to the
device for that batch, all its new prompts encoded in one visit, and go back after."""

from __future__ import annotations

import contextlib
from typing import Iterator

from torch import nn


class EncoderOffload:
    """Needs ``pipe`` (a diffusers pipeline) and ``device`` on the class it is mixed into."""

    encoders_offloaded: bool = False
    """Whether :meth:`offload_encoders` moved the text encoders to CPU memory (set by it alone)."""

    @property
    def text_encoders(self) -> list[nn.Module]:
        """The pipeline's text encoders (its ``text_encoder*`` components that are modules)."""
        return [
            m
            for name, m in self.pipe.components.items()
            if name.startswith("text_encoder") and isinstance(m, nn.Module)
        ]

    def offload_encoders(self) -> None:
        """Keep the text encoders in CPU memory between uses: :meth:`encoders_ready` brings them to the device."""
        self.encoders_offloaded = True
        for module in self.text_encoders:
            module.to("cpu")

    @contextlib.contextmanager
    def encoders_ready(self, needed: bool = True) -> Iterator[None]:
        """The text encoders on ``device`` inside (when ``needed`` and offloaded; else as they are)."""
        if not (needed and self.encoders_offloaded):
            yield
            return
        for module in self.text_encoders:
            module.to(self.device)
        try:
            yield
        finally:
            for module in self.text_encoders:
                module.to("cpu")
