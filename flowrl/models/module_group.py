"""A trainable module made of several diffusers transformers (Wan 2.2 A14B's two experts), declared as such: a
:class:`ModuleGroup` names the member whose ``config`` describes the group (:meth:`ModuleGroup.config_member`) and
the member whose peft adapters stand for the group's (:meth:`ModuleGroup.adapter_member`), instead of imitating a
diffusers model's ``config`` / ``peft_config`` attributes, and its members (:meth:`ModuleGroup.members`: whose
repeated blocks are the group's, flowrl/models/blocks.py). The probes ask through :func:`diffusers_config` and
:func:`peft_configs`, which take a diffusers model and a group alike."""

from __future__ import annotations

from typing import Any

from torch import nn


class ModuleGroup(nn.Module):
    """Several diffusers transformers trained as one module; a subclass declares its members and the two below."""

    def members(self) -> list[nn.Module]:
        """The transformers the group is made of, in the order a row may run them: their repeated blocks, member by
        member, are the group's (gradient checkpointing, regional compile and FSDP2 wrap them)."""
        raise NotImplementedError

    def config_member(self) -> nn.Module:
        """The member whose diffusers ``config`` describes the group (its members share the architecture)."""
        raise NotImplementedError

    def adapter_member(self) -> nn.Module:
        """The member whose peft adapters (``peft_config``) stand for the group's: every trained member carries the
        same adapters."""
        raise NotImplementedError


def diffusers_config(module: nn.Module) -> Any:
    """The diffusers config of ``module`` (a group: its :meth:`~ModuleGroup.config_member`'s), or None when it has
    none (a module that is not a diffusers model)."""
    if isinstance(module, ModuleGroup):
        module = module.config_member()
    return getattr(module, "config", None)


def peft_configs(module: nn.Module) -> dict:
    """The peft adapters' configs of ``module`` by adapter name (a group: its :meth:`~ModuleGroup.adapter_member`'s);
    {} when none is attached."""
    if isinstance(module, ModuleGroup):
        module = module.adapter_member()
    return getattr(module, "peft_config", None) or {}


def adapter_state(module: nn.Module, adapter_name: str = "default") -> dict:
    """peft's ``get_peft_model_state_dict`` of ``module`` for ``adapter_name``; a group: each member's that carries the
    adapter, its keys prefixed by the member's name (the keys of the group's own state dict)."""
    from peft.utils import get_peft_model_state_dict

    if not isinstance(module, ModuleGroup):
        return get_peft_model_state_dict(module, adapter_name=adapter_name)
    return {
        f"{name}.{key}": value
        for name, member in module.named_children()
        if adapter_name in peft_configs(member)
        for key, value in get_peft_model_state_dict(member, adapter_name=adapter_name).items()
    }
