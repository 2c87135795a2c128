"""Wan 2.2 A14B's two experts as one module (:class:`WanExperts`, the trainable module of a two-expert
:class:`~flowrl.models.wan.WanFlowModel`): each row runs on its expert by its timestep, as ``WanPipeline.__call__``
switches them. A :class:`~flowrl.models.module_group.ModuleGroup`: it declares its members (both experts) and which
expert's config and adapters stand for the pair."""

from __future__ import annotations

import torch
from torch import nn

from flowrl.models.module_group import ModuleGroup

EXPERTS = {"high": ("transformer",), "low": ("transformer_2",), "both": ("transformer", "transformer_2")}
"""``model.experts`` → the components training updates."""


def _sharded(module: nn.Module) -> bool:
    """Whether FSDP2 wraps ``module`` (its class swapped for an ``FSDPModule`` subclass)."""
    from torch.distributed.fsdp import FSDPModule

    return isinstance(module, FSDPModule)


class WanExperts(ModuleGroup):
    """Wan 2.2 A14B's two experts as one module (the adapter's ``trainable``): ``transformer`` for rows whose timestep
    is ≥ ``boundary`` (high noise), ``transformer_2`` for the others, as ``WanPipeline.__call__`` picks them.

    ``forward`` takes one transformer call's keywords for B rows (every tensor with B leading rows is split), runs each
    expert on its rows (one call when they all share an expert) and returns ``(out,)`` [B, C, F, h, w] in row order.
    ``run_both``: every call runs both experts (an expert without rows on row 0, its output joined at weight 0), so
    processes whose rows differ make the same collectives (always under FSDP2). ``trained``: the components training
    updates: ``requires_grad_(True)`` and the LoRA calls (``add_adapter``, ``set_adapter``, ``disable_adapters``, …)
    reach them only; the other expert stays frozen."""

    def __init__(self, transformer: nn.Module, transformer_2: nn.Module, boundary: float, trained: tuple[str, ...]):
        super().__init__()
        self.transformer, self.transformer_2 = transformer, transformer_2
        self.boundary, self.trained, self.run_both = float(boundary), tuple(trained), False

    def config_member(self) -> nn.Module:
        """The high-noise expert: its diffusers config describes both (they share the architecture)."""
        return self.transformer

    def adapter_member(self) -> nn.Module:
        """The first trained expert: every trained expert carries the same adapters (:meth:`add_adapter`)."""
        return self.trained_experts()[0]

    def members(self) -> list[nn.Module]:
        """Both experts, high-noise first: the group's blocks are theirs (flowrl/models/blocks.py)."""
        return self.experts()

    @property
    def dtype(self) -> torch.dtype:
        return self.transformer.dtype

    def experts(self) -> list[nn.Module]:
        """Both experts, high-noise first."""
        return [self.transformer, self.transformer_2]

    def trained_experts(self) -> list[nn.Module]:
        return [getattr(self, name) for name in self.trained]

    def forward(self, hidden_states: torch.Tensor, timestep: torch.Tensor, return_dict: bool = False, **kwargs):
        rows = hidden_states.shape[0]
        t = timestep if timestep.ndim == 1 else timestep.amax(dim=1)  # per-token timesteps: the row's noise level
        high = t >= self.boundary
        index = [high.nonzero().squeeze(1), (~high).nonzero().squeeze(1)]

        def run(expert: nn.Module, rows_of: torch.Tensor) -> torch.Tensor:
            pick = lambda v: v[rows_of] if torch.is_tensor(v) and v.ndim and v.shape[0] == rows else v
            picked = {k: pick(v) for k, v in kwargs.items()}
            return expert(
                hidden_states=hidden_states[rows_of], timestep=timestep[rows_of], return_dict=False, **picked
            )[0]

        outs = [run(expert, i) if len(i) else None for expert, i in zip(self.experts(), index)]
        # an expert without rows runs on row 0, its output joined at weight 0: both under run_both, and a trained one
        # when a gradient is wanted and only the frozen expert had rows (the loss must reach the trained weights)
        trained = [e for e in self.trained_experts() if any(p.requires_grad for p in e.parameters())]
        starved = torch.is_grad_enabled() and all(o is None for e, o in zip(self.experts(), outs) if e in trained)
        both = self.run_both or _sharded(self)  # FSDP2: every process makes the same collectives
        idle = [e for e, o in zip(self.experts(), outs) if o is None and (both or (starved and e in trained))]
        unused = [run(e, index[0][:0].new_zeros(1)) for e in idle]
        if outs[1] is None or outs[0] is None:
            out = outs[0] if outs[1] is None else outs[1]
        else:
            out = torch.cat(outs)[torch.cat(index).argsort()]
        for extra in unused:
            out = out + 0.0 * extra.sum()
        return (out,)

    def requires_grad_(self, requires_grad: bool = True) -> "WanExperts":
        """Freeze both experts, or (True) make the trained ones trainable: the other expert stays frozen."""
        for expert in self.trained_experts() if requires_grad else self.experts():
            expert.requires_grad_(requires_grad)
        return self

    # ---- the LoRA calls of diffusers' models, on the trained experts ----------------------------------------
    def add_adapter(self, config, adapter_name: str = "default") -> None:
        for expert in self.trained_experts():
            expert.add_adapter(config, adapter_name=adapter_name)

    def set_adapter(self, adapter_name) -> None:
        for expert in self.trained_experts():
            expert.set_adapter(adapter_name)

    def disable_adapters(self) -> None:
        for expert in self.trained_experts():
            expert.disable_adapters()

    def enable_adapters(self) -> None:
        for expert in self.trained_experts():
            expert.enable_adapters()

    @property
    def gradient_checkpointing(self) -> bool:
        return any(getattr(expert, "gradient_checkpointing", False) for expert in self.experts())

    def enable_gradient_checkpointing(self) -> None:
        for expert in self.experts():
            expert.enable_gradient_checkpointing()

    def disable_gradient_checkpointing(self) -> None:
        for expert in self.experts():
            expert.disable_gradient_checkpointing()
