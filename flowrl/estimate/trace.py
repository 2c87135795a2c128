"""The live-bytes and FLOP tracer: runs a function on meta tensors and reports the peak and remaining
bytes of the tensor storages it creates (autograd's saved tensors included) and the FLOPs of its ops, with
attention run as the fused kernel the target device would pick."""

from __future__ import annotations

import contextlib
import gc
import weakref
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves, tree_map
from torch.utils.flop_counter import flop_registry


class _Saved:
    """What autograd keeps for backward, held through a Python object so its storage stays counted."""

    __slots__ = ("tensor", "__weakref__")

    def __init__(self, tensor: torch.Tensor):
        self.tensor = tensor


def _unpack(saved: _Saved) -> torch.Tensor:
    return saved.tensor


class LiveBytes(TorchDispatchMode):
    """Bytes of the tensor storages created while active and still alive: ``now`` and ``peak``; and the
    ``flops`` of the ops run (torch's ``flop_counter.flop_registry``: matmuls, convolutions, fused attention).

    Each op's output storages are counted once; a storage is released when the last tensor created on it
    dies (tensors keep their Python object as long as C++ holds them, and autograd's saved tensors are held
    through :class:`_Saved` while this tracer's hooks are active). An output on a storage that existed before
    the trace is no allocation and is not counted: a view of a weight (``weight.t()``), an in-place op on a
    weight or a pre-allocated gradient (backward accumulating into ``.grad``). aten's outputs are either new
    storages or alias one of the op's inputs, so such an output shares an input's storage that this tracer
    never counted. Works on any device, the meta device included; on it, an op that meets real host tensors among
    its meta ones (a model computing its token layout on the host, as Qwen-Image 2.1's transformer does from its
    ``img_mask``) runs with them on the meta device, as a real device run holds them there.
    """

    def __init__(self):
        super().__init__()
        self.now = self.peak = 0
        self._refs: dict[int, int] = {}  # storage address → tensors using it
        self._size: dict[int, int] = {}
        self._seen: set[int] = set()
        self.flops = 0

    def _release(self, key: int, tid: int) -> None:
        self._seen.discard(tid)
        self._refs[key] -= 1
        if self._refs[key] == 0:
            del self._refs[key]
            self.now -= self._size.pop(key)

    def _track(self, t: torch.Tensor, before: set[int]) -> None:
        """Count ``t``'s storage if new; ``before``: the storages of the op's inputs this tracer does not count
        (they existed before the trace): an output on one of them is a view or an in-place result, not counted."""
        if id(t) in self._seen:
            return
        storage = t.untyped_storage()
        key = storage._cdata
        if key in before:
            return
        if key not in self._refs:
            self._refs[key] = 0
            self._size[key] = storage.nbytes()
            self.now += self._size[key]
            self.peak = max(self.peak, self.now)
        self._refs[key] += 1
        self._seen.add(id(t))
        weakref.finalize(t, self._release, key, id(t))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        try:
            out = func(*args, **kwargs)
        except RuntimeError:  # devices mixed: host tensors among meta ones
            moved = _host_on_meta(args, kwargs)
            if moved is None:
                raise
            args, kwargs = moved
            out = func(*args, **kwargs)
        count = flop_registry.get(func._overloadpacket)
        if count is not None:
            self.flops += int(count(*args, **kwargs, out_val=out))
        outputs = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
        if outputs:
            before = {_storage_key(t) for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
            before -= self._refs.keys()
            for t in outputs:
                self._track(t, before)
        return out


def _host_on_meta(args, kwargs) -> tuple | None:
    """(args, kwargs) with their non-meta tensors moved to the meta device when they mix both; None if they do not."""
    devices = {t.device.type for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
    if "meta" not in devices or len(devices) == 1:
        return None
    return tree_map(lambda t: t.to("meta") if isinstance(t, torch.Tensor) else t, (args, kwargs))


def _storage_key(t: torch.Tensor) -> int | None:
    """The identity of ``t``'s storage (its C++ object: shared by every view of it); None without one."""
    try:
        return t.untyped_storage()._cdata
    except (RuntimeError, NotImplementedError):  # e.g. a sparse tensor
        return None


@dataclass
class Trace:
    """One traced phase: ``peak`` and ``end`` live bytes (created during it), ``flops``."""

    peak: int
    end: int
    flops: int


def _cpu_sdpa_kernel(query, key, value, attn_mask, dropout_p, is_causal, scale):
    """The fused CPU attention torch would pick for these inputs (``flash`` or ``math``)."""
    small = [
        torch.zeros(t.shape[0], t.shape[1], min(t.shape[2], 2), t.shape[3], dtype=t.dtype) for t in (query, key, value)
    ]
    mask = None
    if attn_mask is not None:
        shape = list(attn_mask.shape)
        shape[-1], shape[-2] = min(shape[-1], 2), min(shape[-2], 2) if len(shape) > 1 else shape[-2]
        mask = torch.zeros(shape, dtype=attn_mask.dtype)
    try:
        choice = torch._fused_sdp_choice(*small, mask, dropout_p, is_causal, scale=scale)
    except RuntimeError:
        return "math"
    return "flash" if choice == int(torch.nn.attention.SDPBackend.FLASH_ATTENTION) else "math"


@contextlib.contextmanager
def fused_attention(target: str) -> Iterator[None]:
    """Within the context, ``F.scaled_dot_product_attention`` on meta tensors runs the fused kernel a
    ``target`` device (``cuda`` or ``cpu``) would run, so the traced memory and FLOPs are the fused kernel's
    (on meta, torch would otherwise decompose attention into matmuls and keep the L×L matrix). CUDA:
    ``_scaled_dot_product_efficient_attention`` (saves the output and the log-sum-exp, as flash does); CPU:
    ``_scaled_dot_product_flash_attention_for_cpu`` where torch's CPU dispatch picks it, else the math path."""
    original = F.scaled_dot_product_attention

    def sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
        if query.device.type != "meta" or enable_gqa or query.dim() != 4:
            return original(
                query,
                key,
                value,
                attn_mask=attn_mask,
                dropout_p=dropout_p,
                is_causal=is_causal,
                scale=scale,
                enable_gqa=enable_gqa,
            )
        if attn_mask is not None and attn_mask.dtype == torch.bool:
            attn_mask = torch.zeros(attn_mask.shape, dtype=query.dtype, device=query.device).masked_fill(
                attn_mask.logical_not(), float("-inf")
            )
        if target == "cpu":
            if _cpu_sdpa_kernel(query, key, value, attn_mask, dropout_p, is_causal, scale) == "math":
                return original(
                    query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, scale=scale
                )
            return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
                query, key, value, dropout_p, is_causal, attn_mask=attn_mask, scale=scale
            )[0]
        bias = None
        if attn_mask is not None:
            bias = attn_mask.to(query.dtype).expand(query.shape[0], query.shape[1], query.shape[2], key.shape[2])
        grad = torch.is_grad_enabled() and (query.requires_grad or key.requires_grad or value.requires_grad)
        return torch.ops.aten._scaled_dot_product_efficient_attention(
            query, key, value, bias, grad, dropout_p, is_causal, scale=scale
        )[0]

    F.scaled_dot_product_attention = sdpa
    try:
        yield
    finally:
        F.scaled_dot_product_attention = original


def trace(fn: Callable[[], Any], target: str = "cuda") -> Trace:
    """Run ``fn`` (on meta tensors) under :class:`LiveBytes` and autograd's saved-tensor holders; its peak and
    remaining live bytes and its FLOPs. (torch's ``FlopCounterMode`` is not used: its module hooks keep
    checkpointed blocks' recomputed tensors alive and would inflate the memory.)"""
    live = LiveBytes()
    with _young_objects_only(), fused_attention(target), live:
        with torch.autograd.graph.saved_tensors_hooks(_Saved, _unpack):
            fn()
            gc.collect(0)
    return Trace(live.peak, live.now, live.flops)


@contextlib.contextmanager
def _young_objects_only() -> Iterator[None]:
    """The cyclic collector paused inside, so that everything created inside stays in its youngest generation and
    ``gc.collect(0)`` at the end frees the trace's own reference cycles without walking the objects that existed
    before (a full collection of a process that imported torch and diffusers costs about 0.3 s on these CPUs, and an
    estimate traces five phases)."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()
