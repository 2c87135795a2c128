"""torch's autocast for meta tensors: full fine-tuning of a bf16/fp16 model trains fp32 master weights and runs the
transformer under ``torch.autocast`` in ``model.dtype`` (:func:`flowrl.models.dtypes.master_weights_fp32`), but
autocast only acts on CPU/CUDA tensors, not on the meta device the estimate traces on. :class:`MetaAutocast` applies
the same casts to meta tensors, so the traced memory is what autocast allocates:

- the ops autocast runs in low precision (matmuls, linear, convolutions, attention) cast their floating inputs to
  it; a cast of an fp32 leaf requiring grad (a trainable weight) is cached until the outermost autocast region
  ends, as torch caches it (so a forward of fp32 master weights holds a low-precision copy of every weight it used
  by its end, and a copy a backward needs is saved until then);
- the ops autocast runs in fp32 (on CUDA: layer/group norm, softmax, sums, pow, exp, …) take their low-precision
  inputs in fp32 (a reduction gets ``dtype=float32``, as autocast passes it);
- gradient checkpointing recomputes a block under the same casts (torch's checkpoint re-enters autocast; its
  cache then lives for that block's recomputation): :meth:`MetaAutocast.checkpoint` is the transformer's
  ``gradient_checkpointing_func``.

The op lists are torch's (``aten/src/ATen/autocast_mode.cpp``) for the ops diffusers' transformers call; ops not
listed run in their inputs' dtype (type promotion), as under autocast.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_map
from torch.utils.checkpoint import checkpoint

LOW_PRECISION_OPS = {
    "cuda": frozenset(
        {
            "linear",
            "matmul",
            "__matmul__",
            "__rmatmul__",
            "mm",
            "mv",
            "bmm",
            "addmm",
            "addmv",
            "addr",
            "baddbmm",
            "addbmm",
            "einsum",
            "chain_matmul",
            "multi_dot",
            "conv1d",
            "conv2d",
            "conv3d",
            "conv_transpose1d",
            "conv_transpose2d",
            "conv_transpose3d",
            "conv_tbc",
            "prelu",
            "scaled_dot_product_attention",
            "_scaled_dot_product_efficient_attention",
            "_scaled_dot_product_flash_attention",
        }
    ),
    "cpu": frozenset(
        {
            "linear",
            "matmul",
            "__matmul__",
            "__rmatmul__",
            "mm",
            "bmm",
            "addmm",
            "baddbmm",
            "addbmm",
            "conv1d",
            "conv2d",
            "conv3d",
            "conv_transpose1d",
            "conv_transpose2d",
            "conv_transpose3d",
            "conv_tbc",
            "prelu",
            "scaled_dot_product_attention",
            "_scaled_dot_product_flash_attention_for_cpu",
        }
    ),
}
"""Ops autocast runs in the low-precision dtype, by the name a ``TorchFunctionMode`` sees, per device type."""
FP32_OPS = {
    "cuda": frozenset(
        {
            "acos",
            "asin",
            "cosh",
            "erfinv",
            "exp",
            "expm1",
            "log",
            "log10",
            "log2",
            "log1p",
            "reciprocal",
            "rsqrt",
            "sinh",
            "tan",
            "pow",
            "__pow__",
            "softplus",
            "layer_norm",
            "group_norm",
            "cosine_similarity",
            "logsumexp",
            "mse_loss",
            "l1_loss",
            "smooth_l1_loss",
            "huber_loss",
            "kl_div",
            "nll_loss",
            "binary_cross_entropy_with_logits",
            "dist",
            "pdist",
            "cdist",
            "renorm",
        }
    ),
    "cpu": frozenset(
        {
            "mse_loss",
            "l1_loss",
            "smooth_l1_loss",
            "huber_loss",
            "kl_div",
            "nll_loss",
            "cdist",
            "binary_cross_entropy_with_logits",
            "prod",
        }
    ),
}
"""Ops autocast runs in fp32 (their low-precision inputs cast up), per device type."""
FP32_DTYPE_OPS = {"cuda": frozenset({"softmax", "log_softmax", "cumsum", "cumprod", "sum", "prod"}), "cpu": frozenset()}
"""Ops autocast runs with ``dtype=float32`` when their input is low precision and no dtype is given."""
LOW = (torch.bfloat16, torch.float16)


class _Casts(TorchFunctionMode):
    """One autocast region: the casts of :data:`LOW_PRECISION_OPS` / :data:`FP32_OPS` and its weight cache."""

    def __init__(self, dtype: torch.dtype, target: str, caching: bool):
        super().__init__()
        self.dtype, self.target, self.caching = dtype, target, caching
        self.cache: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # id(weight) → (weight, its cast)

    def low(self, t):
        if not isinstance(t, torch.Tensor) or not t.is_floating_point() or t.dtype in (self.dtype, torch.float64):
            return t
        cacheable = self.caching and t.dtype == torch.float32 and t.requires_grad and t.is_leaf and t._base is None
        if not cacheable:
            return t.to(self.dtype)
        hit = self.cache.get(id(t))
        if hit is None or hit[0] is not t:
            hit = self.cache[id(t)] = (t, t.to(self.dtype))
        return hit[1]

    @staticmethod
    def up(t):
        return t.float() if isinstance(t, torch.Tensor) and t.dtype in LOW else t

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if name in LOW_PRECISION_OPS[self.target]:
            args, kwargs = tree_map(self.low, (args, kwargs))
        elif name in FP32_OPS[self.target]:
            args, kwargs = tree_map(self.up, (args, kwargs))
        elif (
            name in FP32_DTYPE_OPS[self.target]
            and args
            and isinstance(args[0], torch.Tensor)
            and args[0].dtype in LOW
            and kwargs.get("dtype") is None
        ):
            kwargs = {**kwargs, "dtype": torch.float32}
        return func(*args, **kwargs)


class MetaAutocast:
    """``torch.autocast(target, dtype)`` for the meta tensors of a trace: ``with autocast():`` around a transformer
    call (regions nest: an inner one is part of the outer, as torch's are), ``autocast.checkpoint`` as its
    ``gradient_checkpointing_func``. ``cache=False``: a frozen copy's weights (no grad), cast per use, not cached."""

    def __init__(self, dtype: torch.dtype, target: str = "cuda"):
        if dtype not in LOW or target not in LOW_PRECISION_OPS:
            raise ValueError(f"autocast to {dtype} on {target!r}: choose bfloat16/float16 on 'cuda' or 'cpu'")
        self.dtype, self.target = dtype, target
        self._active: _Casts | None = None

    @contextlib.contextmanager
    def __call__(self, cache: bool = True) -> Iterator[None]:
        if self._active is not None:
            yield
            return
        casts = _Casts(self.dtype, self.target, cache)
        original = F.scaled_dot_product_attention  # not a torch function once fused_attention replaced it

        def attention(query, key, value, attn_mask=None, *args, **kwargs):
            query, key, value, attn_mask = (casts.low(t) for t in (query, key, value, attn_mask))
            return original(query, key, value, attn_mask, *args, **kwargs)

        self._active, F.scaled_dot_product_attention = casts, attention
        try:
            with casts:
                yield
        finally:
            self._active, F.scaled_dot_product_attention = None, original
            casts.cache.clear()

    def checkpoint(self, block, *args):
        """diffusers' ``gradient_checkpointing_func``: torch's non-reentrant checkpoint of ``block``, its forward
        (and so its recomputation in backward) inside an autocast region."""

        def run(*inputs):
            with self():
                return block(*inputs)

        return checkpoint(run, *args, use_reentrant=False)
