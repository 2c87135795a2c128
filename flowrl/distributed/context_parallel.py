"""Context parallelism (``model.context_parallel: {ulysses: N, ring: M}``; docs/video.md): each sample's token sequence
split over N × M processes through diffusers' own context-parallel API (``ContextParallelConfig`` and
``ModelMixin.enable_parallelism`` with the transformer's ``_cp_plan``: the plan splits the sequence where it enters the
blocks and gathers it after the last one; Ulysses attention exchanges heads for sequence by an all-to-all, ring
attention passes key/value blocks around).

Conventions:

- the processes form *context groups* of ``degree = ulysses · ring`` consecutive ranks (ranks ``g·degree …
  g·degree + degree − 1``) and ``processes / degree`` *data replicas*; every rank of a group holds the same prompts and
  noise (it draws with its replica's index, :class:`~flowrl.distributed.process_group.ProcessGroup`'s ``rank``), so
  the transformer's gathered output, the rollouts, the rewards and the loss are the same on each, while each rank's
  activations hold 1/degree of the sequence;
- the backward leaves on each rank the part of the gradient its sequence shard contributed: the gradient of a replica
  is the *sum* over its group, and the update's gradient the mean over replicas (the DDP reducer sums over every
  process and divides by the replicas; FSDP2's reduce-scatter divides by the replicas instead of the processes);
- the device mesh is ``(data, ring, ulysses)``; diffusers gets its ``(ring, ulysses)`` sub-mesh, FSDP2 shards over
  all processes.

On a CPU (gloo; the tests) diffusers' ``rank % torch.accelerator.device_count()`` would divide by zero:
:func:`enable_context_parallel` stands in one device for the call.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch
from torch import nn

from flowrl.errors import ConfigError
from flowrl.models.module_group import diffusers_config

KEY = "model.context_parallel"


def context_degree(section) -> int:
    """Processes per context group of a ``model.context_parallel`` section: ``ulysses · ring`` (1: off)."""
    return int(section.ulysses) * int(section.ring)


def check_context_parallel(cfg, processes: int) -> None:
    """Refuse, naming the key, a context-parallel setting the run's ``processes`` cannot hold: the degree must divide
    the processes, and ``prompts.per_step`` the data replicas (at load, before the model is built)."""
    cp = cfg.model.context_parallel
    degree = context_degree(cp)
    if degree == 1:
        return
    if processes % degree:
        raise ConfigError(
            f"{KEY}={{ulysses: {cp.ulysses}, ring: {cp.ring}}} splits each sample over {degree} processes, but this "
            f"run has {processes}: launch a multiple of {degree} processes (accelerate launch --num_processes N …)"
        )
    replicas = processes // degree
    if cfg.prompts.per_step % replicas:
        raise ConfigError(
            f"prompts.per_step={cfg.prompts.per_step} must be divisible by the data replicas ({processes} processes / "
            f"{KEY} degree {degree} = {replicas})"
        )


def check_transformer(transformer: nn.Module, section, tokens: int | None = None) -> None:
    """Refuse, naming the key, a transformer diffusers cannot run in context parallel under ``section``: one without a
    context-parallel plan (``_cp_plan``), attention heads not divisible by the Ulysses degree, or a sequence of
    ``tokens`` (when known) not divisible by the degree."""
    name = type(transformer).__name__
    if getattr(type(transformer), "_cp_plan", None) is None:
        raise ConfigError(
            f"{KEY}: diffusers has no context-parallel plan for {name} (its _cp_plan is None); set {KEY}.ulysses=1 "
            f"and {KEY}.ring=1 for this family"
        )
    heads = transformer.config.get("num_attention_heads")
    if heads is not None and section.ulysses > 1 and heads % section.ulysses:
        raise ConfigError(
            f"{KEY}.ulysses={section.ulysses} must divide the attention heads of {name} ({heads}): the all-to-all "
            f"hands each process heads/ulysses of them; accepted: a divisor of {heads}"
        )
    degree = context_degree(section)
    if tokens is not None and tokens % degree:
        raise ConfigError(
            f"{KEY}: the transformer's sequence of {tokens} tokens does not split over {degree} processes; choose "
            "model.height, model.width (and frames) whose token count is a multiple of the degree"
        )


def device_mesh(device: torch.device, processes: int, section):
    """The run's ``(data, ring, ulysses)`` mesh over ``processes`` ranks (context groups of consecutive ranks)."""
    from torch.distributed.device_mesh import init_device_mesh

    degree = context_degree(section)
    return init_device_mesh(
        device.type, (processes // degree, section.ring, section.ulysses), mesh_dim_names=("data", "ring", "ulysses")
    )


@contextlib.contextmanager
def _one_cpu_device(device: torch.device) -> Iterator[None]:
    """On a CPU, ``torch.accelerator.device_count()`` is 1 inside (diffusers takes the rank modulo it)."""
    if device.type != "cpu":
        yield
        return
    count = torch.accelerator.device_count
    torch.accelerator.device_count = lambda: 1
    try:
        yield
    finally:
        torch.accelerator.device_count = count


def enable_context_parallel(transformer: nn.Module, section, mesh, device: torch.device) -> None:
    """Split ``transformer``'s sequence over the ``(ring, ulysses)`` dimensions of ``mesh`` (:func:`device_mesh`) with
    diffusers' ``enable_parallelism`` (its ``_cp_plan``); call after the LoRA is added and before the frozen copies
    are made (a deep copy keeps the hooks) and before FSDP2 shards it."""
    import logging

    from diffusers import ContextParallelConfig

    check_transformer(transformer, section)
    config = ContextParallelConfig(
        ulysses_degree=section.ulysses, ring_degree=section.ring, mesh=mesh["ring", "ulysses"]
    )
    diffusers_logger = logging.getLogger("diffusers.models.modeling_utils")
    level = diffusers_logger.level
    diffusers_logger.setLevel(logging.ERROR)  # "an experimental feature" on every process
    try:
        with _one_cpu_device(device):
            transformer.enable_parallelism(config=config)
    finally:
        diffusers_logger.setLevel(level)


def apply_context_parallel(model, section, processes: int, device: torch.device) -> None:
    """The run's context parallelism on ``model.trainable`` (nothing when ``section``'s degree is 1): its mesh over
    ``processes`` (:func:`device_mesh`) and diffusers' hooks (:func:`enable_context_parallel`), refusing, naming the
    key, a transformer that cannot run split or a latent whose tokens do not split (:func:`check_transformer`)."""
    if context_degree(section) == 1:
        return
    check_transformer(model.trainable, section, sequence_tokens(model))
    enable_context_parallel(model.trainable, section, device_mesh(device, processes, section), device)


def sequence_tokens(model) -> int | None:
    """The tokens of one sample's latent (``model.latent_shape`` [C, h, w] or [C, F, h, w]) after the transformer's
    ``patch_size`` (an int over h and w, or a (frames, h, w) tuple), or None when it declares none."""
    patch = diffusers_config(model.trainable).get("patch_size")
    shape = tuple(model.latent_shape)[1:]
    if patch is None:
        return None
    sizes = tuple(patch) if isinstance(patch, (tuple, list)) else (1,) * (len(shape) - 2) + (patch, patch)
    if len(sizes) != len(shape):
        return None
    tokens = 1
    for n, p in zip(shape, sizes):
        tokens *= n // p
    return tokens
