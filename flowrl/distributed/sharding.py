"""FSDP2 sharding of the trained transformer over the run's processes (``model.shard: fsdp``; docs/gpu.md).

``fully_shard`` (torch's FSDP2, :mod:`torch.distributed.fsdp`) wraps every transformer block (each
``nn.ModuleList`` attribute named ``*blocks``: SD3's and SANA's ``transformer_blocks``, FLUX's two lists),
then the transformer itself (embeddings, norms, the output projection). Each of N processes then holds a
dim-0 shard (1/N, padded) of every parameter, of its gradient and of its AdamW state; a forward gathers one
block at a time and frees it after (``reshard_after_forward``), the backward reduce-scatters the gradients
(mean over processes, in fp32 with a low-precision model: ``MixedPrecisionPolicy(param_dtype=model.dtype,
reduce_dtype=fp32)``, fp32 master shards).

Rules this module keeps, each learned the hard way:

- the LoRA (and the old policy's second adapter) is added *before* sharding, with the same seed on every
  process: added after, its parameters would stay whole and their gradients never averaged (the ranks drift);
- the frozen full copies of full fine-tuning (KL reference, old policy, teacher) are made before sharding
  and sharded the same way (:func:`flowrl.models.frozen.frozen_copy` records them on the model);
- every process must run the same transformer calls in the same order, since each gathers collectively: the
  updater pads micro-batches to the processes' maximum (:mod:`flowrl.training.updater`), and rollouts and evals run
  with the whole transformer gathered once (``model.shard_rollouts: whole``, collective-free sampling) or block
  by block (``per_block``: least memory, only for plans whose forwards do not depend on the draws);
- safetensors cannot write a sharded tensor: every consolidated write gathers first (:func:`full_state`).
"""

from __future__ import annotations

import contextlib
import os
from typing import Iterator

import torch
from torch import nn

from flowrl.errors import ConfigError
from flowrl.models.blocks import block_lists
from flowrl.models.frozen import frozen_copies


def is_sharded(module: nn.Module) -> bool:
    from torch.distributed.fsdp import FSDPModule

    return isinstance(module, FSDPModule)


def local(t: torch.Tensor) -> torch.Tensor:
    """This process's part of ``t`` (a DTensor's local shard; a plain tensor itself)."""
    return t.to_local() if hasattr(t, "to_local") else t


def whole(t: torch.Tensor) -> torch.Tensor:
    """``t`` gathered whole (a collective for a DTensor: every process must call it); a plain tensor itself."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def compute_dtype(model) -> torch.dtype:
    """The dtype ``model``'s transformer computes in: its autocast dtype (fp32 master weights, or accelerate's
    ``mixed_precision``), else its dtype."""
    from flowrl.models.dtypes import autocast_dtype

    return autocast_dtype(model) or model.dtype


def resolve_shard(value: str) -> str:
    """``model.shard``: ``auto`` is ``fsdp`` when accelerate launched the run with its FSDP plugin
    (``distributed_type: FSDP``, e.g. configs/accelerate/fsdp.yaml; it must be FSDP2), else ``ddp``."""
    if value != "auto":
        return value
    from accelerate.utils import parse_flag_from_env

    if not parse_flag_from_env("ACCELERATE_USE_FSDP"):
        return "ddp"
    version = os.environ.get("FSDP_VERSION", "1")
    if version != "2":
        raise ConfigError(
            f"accelerate's FSDP plugin is on with fsdp_version: {version}; flowrl shards with FSDP2: set "
            "fsdp_version: 2 in the launch file's fsdp_config (configs/accelerate/fsdp.yaml)"
        )
    return "fsdp"


def offload_requested() -> bool:
    """Whether the launch file asks for parameters offloaded to the CPU (accelerate's ``fsdp_offload_params``)."""
    from accelerate.utils import parse_flag_from_env

    return parse_flag_from_env("FSDP_OFFLOAD_PARAMS")


def check_shard_settings(cfg, world: int, shard: str) -> None:
    """Refuse sharding settings that cannot run, naming the key (at load, before the model is built); ``shard``:
    ``model.shard`` resolved (:func:`resolve_shard`)."""
    m = cfg.model
    if shard != "fsdp":
        return
    if world < 2:
        how = "model.shard=fsdp" if m.shard == "fsdp" else "accelerate's FSDP plugin (model.shard=auto)"
        raise ConfigError(
            f"{how} shards the model over the processes, but this run has 1 process: launch several "
            "(accelerate launch --config_file configs/accelerate/fsdp.yaml … or torchrun "
            "--nproc_per_node N …), or set model.shard=ddp for one"
        )
    if m.dtype == "float16":
        raise ConfigError(
            "model.shard=fsdp with model.dtype=float16 is not supported (fp16 needs loss scaling of "
            "sharded gradients); use model.dtype=bfloat16"
        )
    if cfg.optim.use_8bit:
        raise ConfigError(
            "model.shard=fsdp with optim.use_8bit=true is not supported (bitsandbytes' AdamW8bit does "
            "not take sharded parameters); sharding already divides AdamW's state by the processes"
        )


def check_sharded_objective(objective) -> None:
    """Refuse an objective whose extra loss term (:meth:`~flowrl.objectives.base.Objective.auxiliary`) runs forwards
    that differ between processes (each forward of a sharded transformer gathers collectively)."""
    from flowrl.core.components import name_of
    from flowrl.objectives.base import Objective

    if type(objective).auxiliary is not Objective.auxiliary:
        raise ConfigError(
            f"loss.objective={name_of(objective)} adds an auxiliary loss term whose forwards differ "
            "between processes; it cannot run with model.shard=fsdp (use model.shard=ddp)"
        )


class Sharding:
    """The FSDP2 state of one run: the mesh, the sharded modules (the transformer and its frozen copies) and
    the context rollouts and evals sample in (:meth:`sampling`)."""

    def __init__(self, model, group, device: torch.device, rollouts: str = "whole", offload: bool = False):
        """``group``: the run's :class:`~flowrl.distributed.process_group.ProcessGroup`; the model is sharded over all
        its processes, and the gradients are the sum over every process / its data replicas (``world``: with context
        parallelism a replica's gradient is the sum over its context group)."""
        from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

        self.model, self.rollouts, self.offload = model, rollouts, offload and device.type == "cuda"
        if group.dist_group is not None:  # the trainers of an asynchronous run: a mesh over them alone
            self.mesh = DeviceMesh.from_group(group.dist_group, device.type)
        else:
            self.mesh = init_device_mesh(device.type, (group.processes,))
        self.replicas = group.world

    def mixed_precision(self, compute: torch.dtype):
        """Gather and compute in ``compute``, reduce gradients in fp32 (None in fp32: nothing to cast)."""
        from torch.distributed.fsdp import MixedPrecisionPolicy

        if compute == torch.float32:
            return None
        return MixedPrecisionPolicy(param_dtype=compute, reduce_dtype=torch.float32)

    def shard(self, compute: torch.dtype) -> None:
        """Shard ``model.trainable`` and every recorded frozen copy: each block, then the module itself."""
        from torch.distributed.fsdp import fully_shard

        policy = self.mixed_precision(compute)
        # resharded after every forward, the root too (FSDP2 keeps a root whole after a forward by default, for
        # the backward that follows; a frozen copy's forwards have none, and the weights must be shards again
        # before the optimizer, the EMA or an old-policy update touches them)
        kwargs = {"mesh": self.mesh, "reshard_after_forward": True}
        if policy is not None:
            kwargs["mp_policy"] = policy
        if self.offload:  # shards, gradients and AdamW state in CPU memory, copied in for each use
            from torch.distributed.fsdp import CPUOffloadPolicy

            kwargs["offload_policy"] = CPUOffloadPolicy()
        for module in [self.model.trainable, *frozen_copies(self.model)]:
            blocks = block_lists(module)
            if not blocks:
                raise ConfigError(
                    f"model.shard=fsdp: {type(module).__name__} has no block list (no ModuleList "
                    "attribute named *blocks) to shard"
                )
            for block in blocks:
                fully_shard(block, **kwargs)
            fully_shard(module, **kwargs)
            if self.replicas != self.mesh.size():  # context groups: FSDP2 divides by the processes otherwise
                for m in module.modules():
                    if is_sharded(m):
                        m.set_gradient_divide_factor(float(self.replicas))
                        m.set_force_sum_reduction_for_comms(True)  # a sum, then the division (gloo has no PREMUL_SUM)

    @contextlib.contextmanager
    def sampling(self) -> Iterator[None]:
        """Sample inside: with ``rollouts == "whole"`` the transformer is gathered once here and kept whole
        through every forward (no collective while sampling, so processes may make different calls), then
        sharded again; with ``per_block`` each forward gathers and frees block by block."""
        if self.rollouts != "whole":
            yield
            return
        root = self.model.trainable
        fsdp_modules = [m for m in root.modules() if is_sharded(m)]
        for m in fsdp_modules:
            m.set_reshard_after_forward(False, recurse=False)
        for m in fsdp_modules:
            m.unshard()
        try:
            yield
        finally:
            for m in fsdp_modules:
                m.reshard()
                m.set_reshard_after_forward(True, recurse=False)


def full_state(model) -> dict[str, torch.Tensor]:
    """The trained weights whole, on the CPU (a collective under sharding: every process calls it): the LoRA's
    peft state dict (the diffusers LoRA keys' source), or the full transformer's state dict."""
    if model.has_lora:
        from flowrl.models.module_group import adapter_state

        layers = adapter_state(model.trainable, "default")
        return {k: whole(v).detach().cpu() for k, v in layers.items()}
    return {k: whole(v).detach().cpu() for k, v in model.trainable.state_dict().items()}
