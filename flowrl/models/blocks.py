"""The transformer's repeated blocks, and what is done to them one by one: gradient checkpointing of the first N
(``model.gradient_checkpointing`` + ``model.checkpoint_blocks``) and regional ``torch.compile`` (``model.compile:
regional``).

Conventions:

- the blocks are the items of every ``nn.ModuleList`` attribute of the transformer whose name ends in ``blocks``
  (SD3's and SANA's ``transformer_blocks``, FLUX's double then single blocks, Wan's ``blocks``) or, for Z-Image,
  ``refiner`` / ``layers`` (:data:`BLOCK_LIST_NAMES`), in execution order;
- a *block kind* is a block's class plus the names of its direct children: SD3.5's blocks with and without the
  second attention (``attn2``) are two kinds of one class, FLUX's double and single blocks two classes;
- a checkpointed block keeps its class's name, parameters and state-dict keys: its class is swapped for a subclass
  whose ``forward`` runs under :func:`torch.utils.checkpoint.checkpoint` while gradients are on (a deep copy — the
  objectives' frozen copies — stays a checkpointed block of its own, and FSDP2's own class swap composes). Which
  classes are such subclasses, and which blocks run another checkpoint function, this module keeps in registries of
  its own (:data:`_CHECKPOINTED`, :data:`_FUNCTIONS`): nothing is set on a block or its class;
- regional compilation compiles each block in place (``block.compile``, lazily: a LoRA added later is traced with
  it), every kind with a backend of its own that counts its graphs and their compile time (:class:`CompileStats`,
  returned to the caller, which keeps it: the trainer's ``compiled``).
  Parameters are graph inputs (dynamo's default), so one graph serves every block of a kind, and shapes are
  dynamic from the start (``dynamic=True``): a micro-batch of another size (a last chunk, a group skipped for zero
  variance) recompiles nothing. A grad mode, an input that does or does not require grad and a LoRA switched off
  (the KL reference) add one variant each, all in the first iteration.
"""

from __future__ import annotations

import os
import time
import warnings
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from flowrl.core.choices import did_you_mean
from flowrl.errors import ConfigError
from flowrl.models.module_group import ModuleGroup

BACKEND_VARIABLE = "FLOWRL_COMPILE_BACKEND"
COMPILE_BACKEND = os.environ.get(BACKEND_VARIABLE, "inductor")
"""torch.compile backend of ``model.compile: regional``: ``inductor``, or the environment's ``FLOWRL_COMPILE_BACKEND``
(``eager``/``aot_eager`` trace with dynamo but generate no code: how the CPU tests run it, and a way to tell a
dynamo problem from an inductor one); checked at load (:func:`check_compile_backend`)."""


BLOCK_LIST_NAMES = ("blocks", "refiner", "layers")
"""How the transformers name their lists of repeated blocks: ``*blocks`` (SD3, FLUX, SANA, Qwen-Image, Wan,
HunyuanImage, LTX-2); Z-Image's ``noise_refiner``, ``context_refiner`` and ``layers``, in execution order."""


def block_lists(module: nn.Module) -> list[nn.Module]:
    """Every block of ``module``: the items of each ``nn.ModuleList`` attribute whose name ends in one of
    :data:`BLOCK_LIST_NAMES`; a :class:`~flowrl.models.module_group.ModuleGroup` (Wan 2.2's two experts) has its
    members' (:meth:`~flowrl.models.module_group.ModuleGroup.members`), member by member."""
    if isinstance(module, ModuleGroup):
        return [block for member in module.members() for block in _own_blocks(member)]
    return _own_blocks(module)


def _own_blocks(module: nn.Module) -> list[nn.Module]:
    return [
        block
        for name, child in module.named_children()
        if name.endswith(BLOCK_LIST_NAMES) and isinstance(child, nn.ModuleList)
        for block in child
    ]


def block_kind(block: nn.Module) -> str:
    """``Class(child, child, ...)``: a block's class and its direct children's names (one compiled graph each)."""
    return f"{_plain_class(block).__name__}(" + ",".join(name for name, _ in block.named_children()) + ")"


# ---- gradient checkpointing, block by block ------------------------------------------------------------------
_CHECKPOINTED: dict[type, type] = {}
"""Block class → its checkpointed subclass (one per class, made by :func:`_checkpointed_class`)."""

_PLAIN: dict[type, type] = {}
"""Checkpointed subclass → the block class it was made from: how a checkpointed block is told (its class, or a class
FSDP2 swapped in around it, has one of these in its MRO)."""

_FUNCTIONS: weakref.WeakKeyDictionary[nn.Module, Callable] = weakref.WeakKeyDictionary()
"""Checkpointed block → the checkpoint function it runs instead of torch's (``checkpoint_blocks(..., function)``:
the estimate's autocast on meta tensors); an entry goes with its block, and a deep copy of a block runs torch's."""


def _run_checkpointed(block: nn.Module, forward: Callable, *args, **kwargs):
    """``forward(*args, **kwargs)`` recomputed in the backward (torch's non-reentrant checkpoint), or by the function
    :func:`checkpoint_blocks` registered for the block (:data:`_FUNCTIONS`)."""
    fn = _FUNCTIONS.get(block) if len(_FUNCTIONS) else None
    if fn is not None:
        return fn(lambda *a: forward(*a, **kwargs), *args)
    return checkpoint(forward, *args, use_reentrant=False, **kwargs)


def _checkpointed_class(cls: type) -> type:
    """The subclass of block class ``cls`` whose forward is checkpointed while gradients are on (one per class)."""
    if cls not in _CHECKPOINTED:

        def forward(self, *args, **kwargs):
            run = super(sub, self).forward
            if torch.is_grad_enabled():
                return _run_checkpointed(self, run, *args, **kwargs)
            return run(*args, **kwargs)

        attributes = {"forward": forward, "__module__": cls.__module__, "__qualname__": cls.__qualname__}
        sub = type(cls.__name__, (cls,), attributes)
        _CHECKPOINTED[cls], _PLAIN[sub] = sub, cls
    return _CHECKPOINTED[cls]


def _plain_class(block: nn.Module) -> type:
    """The block's class before any checkpointing swap (FSDP2's own swap stays outside)."""
    cls = type(block)
    return next((_PLAIN[klass] for klass in cls.__mro__ if klass in _PLAIN), cls)


def is_checkpointed(block: nn.Module) -> bool:
    """Whether :func:`checkpoint_blocks` made ``block`` checkpointed."""
    return any(klass in _PLAIN for klass in type(block).__mro__)


def checkpointed_of(count: int | None, blocks: int, name: str) -> int:
    """How many of a transformer's ``blocks`` blocks ``model.checkpoint_blocks=count`` checkpoints (None: every one).
    A count above them is every block, and said (a RuntimeWarning naming the key, both numbers and the transformer
    ``name``; once per message), so neither a run nor the estimate reports 999 checkpointed blocks of 24."""
    if count is None:
        return blocks
    if int(count) > blocks:
        warnings.warn(
            f"model.checkpoint_blocks={count} is more than the {blocks} blocks of {name}: all {blocks} are "
            "checkpointed (model.checkpoint_blocks=null says every block)",
            RuntimeWarning,
            stacklevel=1,  # one location: the run and the estimate say it once between them
        )
        return blocks
    return int(count)


def checkpoint_blocks(transformer: nn.Module, count: int | None, function: Callable | None = None) -> int:
    """Checkpoint the first ``count`` blocks of ``transformer`` (None: every block) and no other: the transformer's
    own all-or-nothing checkpointing is turned off, each of those blocks recomputes its forward in the backward.
    ``function(fn, *args)``: another checkpoint function (the estimate's autocast). Returns how many are
    checkpointed; a ``count`` above the number of blocks means every block, said (:func:`checkpointed_of`)."""
    blocks = block_lists(transformer)
    if not blocks:
        raise ValueError(
            f"{type(transformer).__name__} has no repeated blocks (an nn.ModuleList named *blocks) to checkpoint"
        )
    if getattr(transformer, "gradient_checkpointing", False) and hasattr(transformer, "disable_gradient_checkpointing"):
        transformer.disable_gradient_checkpointing()
    n = checkpointed_of(count, len(blocks), type(transformer).__name__)
    for i, block in enumerate(blocks):
        plain = _plain_class(block)
        if i < n:
            if not is_checkpointed(block):
                _swap_class(block, plain, _checkpointed_class)
            if function is not None:
                _FUNCTIONS[block] = function
            else:
                _FUNCTIONS.pop(block, None)
        elif is_checkpointed(block):
            _swap_class(block, plain, None)
            _FUNCTIONS.pop(block, None)
    return n


def _swap_class(block: nn.Module, plain: type, make: Callable[[type], type] | None) -> None:
    """Replace ``plain`` in the block's class by ``make(plain)`` (or restore it: ``make`` None), keeping any
    subclass another library swapped in around it (FSDP2's)."""
    cls = type(block)
    target = make(plain) if make is not None else plain
    if cls is plain or cls is _CHECKPOINTED.get(plain):
        block.__class__ = target
        return
    raise RuntimeError(
        f"cannot change gradient checkpointing of an already wrapped block ({cls.__name__}); set it before sharding"
    )


def checkpointed_count(transformer: nn.Module) -> int:
    """How many of ``transformer``'s blocks run checkpointed (this module's or the transformer's own flag)."""
    blocks = block_lists(transformer)
    if getattr(transformer, "gradient_checkpointing", False):
        return len(blocks)
    return sum(is_checkpointed(b) for b in blocks)


# ---- regional compilation ---------------------------------------------------------------------------------------
_DYNAMO_COMPILES = "_compile.compile_inner"  # dynamo's wall time of each frame compiled (tracing + backend), seconds


def _dynamo_compile_times() -> list[float]:
    from torch._dynamo.utils import compilation_time_metrics

    return list(compilation_time_metrics.get(_DYNAMO_COMPILES, []))


@dataclass
class CompileStats:
    """Graphs compiled per block kind (counted by their backends) and the compile time: dynamo's wall time of every
    frame compiled since :func:`compile_blocks` (tracing and backend; in a training process, the blocks')."""

    graphs: dict[str, int] = field(default_factory=dict)
    blocks: int = 0
    backend_seconds: float = 0.0
    _before: int = 0

    @property
    def total(self) -> int:
        return sum(self.graphs.values())

    @property
    def seconds(self) -> float:
        return max(sum(_dynamo_compile_times()[self._before :]), self.backend_seconds)

    def summary(self) -> str:
        kinds = ", ".join(f"{kind} ×{n}" for kind, n in sorted(self.graphs.items()))
        return (
            f"torch.compile (regional): {self.blocks} blocks of {len(self.graphs)} kinds, {self.total} graphs "
            f"compiled in {self.seconds:.1f} s ({kinds or 'none yet'})"
        )


def _counting_backend(stats: CompileStats, kind: str, backend: str | Callable) -> Callable:
    """A torch.compile backend that counts the graphs of ``kind`` and times ``backend`` compiling them."""
    from torch._dynamo import lookup_backend

    inner = lookup_backend(backend) if isinstance(backend, str) else backend

    def compile_graph(graph_module, example_inputs):
        t0 = time.perf_counter()
        try:
            return inner(graph_module, example_inputs)
        finally:
            stats.graphs[kind] = stats.graphs.get(kind, 0) + 1
            stats.backend_seconds += time.perf_counter() - t0

    return compile_graph


def _raise_recompile_limits(blocks: int) -> None:
    """Room for every block's variants: dynamo keeps one cache entry per guard set of the blocks' shared forward
    code, and its default limit of 8 left part of SD3.5-M's blocks uncompiled on an H200 (2026-11-27)."""
    import torch._dynamo

    limit = 4 * blocks
    for key in ("recompile_limit", "cache_size_limit", "accumulated_recompile_limit", "accumulated_cache_size_limit"):
        if hasattr(torch._dynamo.config, key):
            setattr(torch._dynamo.config, key, max(getattr(torch._dynamo.config, key), limit))


def check_compile_backend(backend: str | Callable | None = None) -> None:
    """At load, with ``model.compile: regional``: ``backend`` (default :data:`COMPILE_BACKEND`, the environment's
    ``FLOWRL_COMPILE_BACKEND``) is a torch.compile backend torch knows; else a ConfigError naming the variable, its
    value and the backends (it failed at the first forward, after the model loaded, without naming the variable)."""
    name = backend or COMPILE_BACKEND
    if callable(name):
        return
    from torch._dynamo import list_backends

    if name in list_backends(exclude_tags=()):
        return
    accepted = sorted({*list_backends(), "eager", "aot_eager"})
    close = [b for b in list_backends(exclude_tags=()) if b.lower() == str(name).lower()] or accepted
    raise ConfigError(
        f"{BACKEND_VARIABLE}={name!r} (the environment variable naming model.compile=regional's torch.compile "
        f"backend) is not a backend torch knows{did_you_mean(name, close)}; accepted: {accepted} (unset: inductor)"
    )


def compile_blocks(transformer: nn.Module, backend: str | Callable | None = None) -> CompileStats:
    """``torch.compile`` every block of ``transformer`` in place (``block.compile``; compiled at its first call),
    each kind through a counting backend. Returns the :class:`CompileStats`, which only the caller keeps (the trainer's
    ``compiled``): nothing is set on the transformer."""
    blocks = block_lists(transformer)
    if not blocks:
        raise ValueError(
            f"model.compile=regional: {type(transformer).__name__} has no repeated blocks (an "
            "nn.ModuleList named *blocks) to compile"
        )
    stats = CompileStats(blocks=len(blocks), _before=len(_dynamo_compile_times()))
    _raise_recompile_limits(len(blocks))
    backends: dict[str, Callable] = {}
    for block in blocks:
        kind = block_kind(block)
        if kind not in backends:
            backends[kind] = _counting_backend(stats, kind, backend or COMPILE_BACKEND)
        block.compile(backend=backends[kind], dynamic=True)  # the batch varies (last chunks, skipped groups)
    return stats


def apply_block_settings(transformer: nn.Module, section: Any) -> CompileStats | None:
    """A ``model`` section's block settings: ``checkpoint_blocks`` (with ``gradient_checkpointing``; null: every
    block) and ``compile`` (its :class:`CompileStats`, or None when off). Gradient checkpointing is also turned on
    here for a model built elsewhere (``flowrl.wrap(pipe)`` handed to the trainer)."""
    if section.gradient_checkpointing:
        checkpoint_blocks(transformer, section.checkpoint_blocks)
    if str(section.compile) == "regional":
        return compile_blocks(transformer)
    return None
