"""Classifier-free guidance inside one forward, a mixin of :class:`~flowrl.models.base.FlowModel`: the text rows
``[uncond; cond]`` (:meth:`CfgComposition._cfg_text`), the composition ``v_u + g·(v_c − v_u)``
(:meth:`CfgComposition._cfg_combine`) and what its gradient flows through (:meth:`CfgComposition.cfg_gradient`,
``loss.cfg_gradient``; docs/algorithms.md, "Training through CFG")."""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch

from flowrl.core.choices import choose
from flowrl.models.conditioning import Conditioning

CFG_GRADIENTS = ("cond", "both")
"""``loss.cfg_gradient``: what the guided training forward's gradient flows through — ``cond``: the conditional
branch only (the unconditional output detached, as Flow-GRPO's ``train_sd3.py``); ``both``: both branches."""


class CfgComposition:
    """Needs ``guidance_or_default`` and ``uses_cfg`` on the class it is mixed into (:class:`FlowModel`)."""

    _cfg_gradient: str = "both"
    """The mode of the innermost :meth:`cfg_gradient` context (``"both"`` outside any)."""

    def _cfg_of(self, cond: Conditioning, guidance: float | None) -> tuple[float, bool]:
        """(g, cfg) of one :meth:`velocity` call: its guidance (None → :attr:`guidance`) and whether it runs the
        rows ``[uncond; cond]`` (:meth:`uses_cfg`); raises when it does and ``cond`` has no unconditional rows."""
        g = self.guidance_or_default(guidance)
        cfg = self.uses_cfg(g)
        if cfg and cond.uncond is None:
            raise ValueError(f"guidance {g} needs the unconditional branch: call encode(prompts, guidance={g})")
        return g, cfg

    @staticmethod
    def _cfg_text(cond: Conditioning, cfg: bool) -> dict[str, torch.Tensor]:
        """Text tensors of one transformer call: ``cond.cond``, or with CFG ``[uncond; cond]`` per key
        (uncond rows first, as the diffusers pipelines lay them out). The caller checks ``cond.uncond``."""
        if not cfg:
            return cond.cond
        return {k: torch.cat([cond.uncond[k], v]) for k, v in cond.cond.items()}

    def _cfg_split(self, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(v_u, v_c)`` [B, ...] each from the output ``[uncond; cond]`` [2B, ...] of one forward; ``v_u`` detached
        inside :meth:`cfg_gradient` ``("cond")`` (same values: only its gradient is cut)."""
        v_uncond, v_cond = v.chunk(2)
        if self._cfg_gradient == "cond":
            v_uncond = v_uncond.detach()
        return v_uncond, v_cond

    def _cfg_combine(self, v: torch.Tensor, scale: float) -> torch.Tensor:
        """``v_u + scale·(v_c − v_u)`` [B, ...] from the output ``[uncond; cond]`` [2B, ...] of one forward (the
        branches from :meth:`_cfg_split`)."""
        v_uncond, v_cond = self._cfg_split(v)
        return v_uncond + scale * (v_cond - v_uncond)

    @contextlib.contextmanager
    def cfg_gradient(self, mode: str) -> Iterator[None]:
        """Within the context, a guided :meth:`velocity` sends gradients through the conditional branch only
        (``"cond"``: v_u detached, ∇v = g·∇v_c) or through both (``"both"``: ∇v = g·∇v_c + (1 − g)·∇v_u, the
        default outside any context). Values do not change; forwards without gradients are unaffected. Nests; the
        previous mode comes back on exit. ``mode`` is ``loss.cfg_gradient`` (:data:`CFG_GRADIENTS`)."""
        choose("loss.cfg_gradient", mode, CFG_GRADIENTS)
        previous = self._cfg_gradient
        self._cfg_gradient = mode
        try:
            yield
        finally:
            self._cfg_gradient = previous
