"""Low-precision backends for explorer copies of the policy (:mod:`flowrl.rollout.explorer`; Sol-RL,
docs/explore.md, "The explorer"): which backends this machine can run, and the quantized replacement of one Linear
layer.

Backends (:data:`BACKENDS`) and what they need:

| backend | what the copy is | runs on |
|---|---|---|
| ``same``  | no copy: the live model itself (the preview is cheap by its fewer steps) | anywhere |
| ``bf16``  | the LoRA-merged transformer cast to bfloat16 | CUDA with bf16; CPU (slow without native bf16) |
| ``fp16``  | the LoRA-merged transformer cast to float16 | CUDA; CPU (slow) |
| ``int8``  | Linear layers int8: CPU ``torch.ao`` dynamic quantisation (per-channel weights, dynamic per-tensor
activations); CUDA bitsandbytes ``Linear8bitLt`` (else torchao int8 weight-only) | CPU; CUDA with bitsandbytes or
torchao |
| ``nf4``   | Linear layers bitsandbytes NF4 (``Linear4bit``), compute in the rest's dtype | bitsandbytes (CPU or CUDA)
|
| ``fp8``   | Linear layers torchao float8 (dynamic activations, per-row weights), rest bf16 | CUDA, compute capability
≥ 8.9, torchao |
| ``nvfp4`` | Linear layers torchao NVFP4: W4A4 on Blackwell (≥ 10.0), weight-only with bf16 activations on Ada/Hopper
(8.9–9.x), rest bf16 | CUDA ≥ 8.9, torchao |

Only ``nn.Linear`` layers are quantized, and only those that are large enough (``min_params`` weights,
default 16,384 = 128×128) and match no pattern of the backend's skip list (``fnmatch`` on the module
name; :data:`DEFAULT_SKIP`): embedders (patch/time/text embeddings, caption projections) and the output
layers (``norm_out``, ``proj_out``) stay in the rest's precision; the 4-bit backends also keep the
adaLN modulation layers (``*norm*.linear``) there. Norms and convolutions are never quantized (SANA's
GLUMBConv feed-forward is convolutional and stays in the rest's precision). fp8 and nvfp4 also skip
layers whose dimensions are not multiples of 16 (their kernels need it).

torchao and bitsandbytes are optional and imported only when a backend that needs them is built;
:func:`unavailable_reason` checks for them without importing them.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import warnings
from typing import Iterator

import torch
from torch import nn

from flowrl.core.choices import choose
from flowrl.errors import ConfigError
from flowrl.models.dtypes import MIXED_PRECISION

BACKENDS: tuple[str, ...] = ("same", "bf16", "fp16", "int8", "nf4", "fp8", "nvfp4")
QUANTIZING: tuple[str, ...] = ("int8", "nf4", "fp8", "nvfp4")
"""Backends that replace Linear layers (the others copy or reuse the whole transformer)."""

_KEEP = ("*embed*", "*caption_projection*", "proj_out", "norm_out*")
_KEEP_4BIT = _KEEP + ("*norm*.linear",)
DEFAULT_SKIP: dict[str, tuple[str, ...]] = {
    "same": (),
    "bf16": (),
    "fp16": (),
    "int8": _KEEP,
    "fp8": _KEEP,
    "nf4": _KEEP_4BIT,
    "nvfp4": _KEEP_4BIT,
}
"""Module-name patterns (fnmatch) of Linear layers each quantizing backend leaves unquantized."""
DEFAULT_MIN_PARAMS = 16384
"""Smallest Linear weight (out·in elements) a quantizing backend converts."""


# ---- availability ---------------------------------------------------------------------------
def _installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def _torch_dynamic_int8() -> bool:
    """torch.ao eager dynamic quantisation with a quantized CPU engine (fbgemm/x86/qnnpack)."""
    try:
        from torch.ao.nn.quantized.dynamic import Linear  # noqa: F401
    except ImportError:
        return False
    return any(e != "none" for e in torch.backends.quantized.supported_engines)


def default_device() -> torch.device:
    """The device a run here would use with ``model.device: auto``."""
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def unavailable_reason(backend: str, device: torch.device | str | None = None) -> str | None:
    """Why ``backend`` cannot run on ``device`` (None → :func:`default_device`), or None if it can."""
    if backend not in BACKENDS:
        return f"unknown backend; accepted: {list(BACKENDS)}"
    device = torch.device(device) if device is not None else default_device()
    cuda = device.type == "cuda"
    if cuda and not torch.cuda.is_available():
        return "CUDA is not available here"
    capability = torch.cuda.get_device_capability(device) if cuda else (0, 0)
    if backend in ("same", "fp16"):
        return None
    if backend == "bf16":
        return "this GPU has no bfloat16 support" if cuda and not torch.cuda.is_bf16_supported() else None
    if backend == "int8":
        if cuda:
            return (
                None
                if _installed("bitsandbytes") or _installed("torchao")
                else "int8 on CUDA needs bitsandbytes (pip install 'flowrl-align[quant]') or torchao"
            )
        return (
            None if _torch_dynamic_int8() else "this torch build has no quantized CPU engine for torch.ao dynamic int8"
        )
    if backend == "nf4":
        if device.type not in ("cpu", "cuda"):
            return f"bitsandbytes nf4 does not run on {device.type}"
        return None if _installed("bitsandbytes") else "nf4 needs bitsandbytes: pip install 'flowrl-align[quant]'"
    if backend == "fp8":
        if not cuda:
            return "fp8 (torchao float8) needs a CUDA GPU with compute capability >= 8.9 (Ada, Hopper or newer)"
        if capability < (8, 9):
            return f"fp8 needs compute capability >= 8.9; this GPU has {capability[0]}.{capability[1]}"
        return None if _installed("torchao") else "fp8 needs torchao: pip install torchao"
    # nvfp4
    if not cuda:
        return (
            "nvfp4 (torchao NVFP4) needs an NVIDIA GPU: Blackwell (compute capability >= 10.0) for FP4 matmuls, "
            "or Ada/Hopper (>= 8.9) for weight-only NVFP4"
        )
    if capability < (8, 9):
        return f"nvfp4 needs compute capability >= 8.9; this GPU has {capability[0]}.{capability[1]}"
    return None if _installed("torchao") else "nvfp4 needs torchao: pip install torchao"


def available_backends(device: torch.device | str | None = None) -> list[str]:
    """The backends :func:`make_explorer` can build on ``device`` (None → :func:`default_device`)."""
    return [b for b in BACKENDS if unavailable_reason(b, device) is None]


def check_backend(backend: str, device: torch.device | str | None = None, key: str = "rollout.backend") -> None:
    """Raise :class:`ConfigError` naming ``key``, the reason and the backends this device can run
    when ``backend`` cannot run on ``device`` (None → :func:`default_device`)."""
    choose(key, backend, BACKENDS)
    reason = unavailable_reason(backend, device)
    if reason is not None:
        where = torch.device(device) if device is not None else default_device()
        raise ConfigError(
            f"{key}={backend!r} cannot run on {where}: {reason}; "
            f"backends this machine can run: {available_backends(device)}"
        )


# ---- layer conversion -----------------------------------------------------------------------
def rest_dtype(backend: str, device: torch.device, model_dtype: torch.dtype) -> torch.dtype:
    """Compute dtype of the explorer's unquantized parts (and of its inputs)."""
    if backend in MIXED_PRECISION:  # bf16, fp16
        return MIXED_PRECISION[backend]
    if backend in ("fp8", "nvfp4"):
        return torch.bfloat16
    if device.type == "cpu":
        return torch.float32
    return model_dtype if model_dtype in (torch.bfloat16, torch.float16) else torch.bfloat16


def _shape_ok(backend: str, weight_shape: torch.Size) -> bool:
    if backend in ("fp8", "nvfp4"):
        return weight_shape[0] % 16 == 0 and weight_shape[1] % 16 == 0
    return True


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """torch.ao's eager quantisation warns that it is deprecated on every conversion."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", category=DeprecationWarning)
        warnings.filterwarnings("ignore", message=".*quantiz.*", category=UserWarning)
        yield


def _plain_linear(weight: torch.Tensor, bias: torch.Tensor | None, device, dtype) -> nn.Linear:
    out_f, in_f = weight.shape
    layer = nn.Linear(in_f, out_f, bias=bias is not None, device=device, dtype=dtype)
    with torch.no_grad():
        layer.weight.copy_(weight)
        if bias is not None:
            layer.bias.copy_(bias)
    return layer.requires_grad_(False)


def _first_attr(module: str, *names: str):
    """The first of ``names`` that ``module`` defines (torchao renamed its configs between releases)."""
    mod = importlib.import_module(module)
    for name in names:
        if hasattr(mod, name):
            return getattr(mod, name)
    raise ImportError(f"{module} has none of {list(names)}: this torchao version is not supported")


def _torchao_config(backend: str, device: torch.device):
    if backend == "int8":
        return _first_attr("torchao.quantization", "Int8WeightOnlyConfig", "int8_weight_only")()
    if backend == "fp8":
        per_row = _first_attr("torchao.quantization", "PerRow")()
        return _first_attr(
            "torchao.quantization",
            "Float8DynamicActivationFloat8WeightConfig",
            "float8_dynamic_activation_float8_weight",
        )(granularity=per_row)
    # nvfp4: FP4 matmuls (W4A4) on Blackwell, weight-only below
    w4a4 = torch.cuda.get_device_capability(device) >= (10, 0)
    workflow = importlib.import_module("torchao.prototype.mx_formats.inference_workflow")
    if hasattr(workflow, "NVFP4DynamicActivationNVFP4WeightConfig"):
        if w4a4:
            return workflow.NVFP4DynamicActivationNVFP4WeightConfig(use_triton_kernel=False)
        return workflow.NVFP4WeightOnlyConfig()
    mode = _first_attr("torchao.prototype.mx_formats.nvfp4_tensor", "NVFP4MMConfig")
    return workflow.NVFP4InferenceConfig(mm_config=mode.DYNAMIC if w4a4 else mode.WEIGHT_ONLY, use_triton_kernel=False)


def _int8_impl(device: torch.device, impl: str) -> str:
    if impl != "auto":
        return impl
    if device.type == "cpu":
        return "torch"
    return "bitsandbytes" if _installed("bitsandbytes") else "torchao"


def quantize_linear(
    backend: str,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    device: torch.device,
    dtype: torch.dtype,
    impl: str = "auto",
) -> nn.Module:
    """A ``backend`` layer computing ``x @ weight.T + bias`` (weight [out, in], any float dtype), on
    ``device``, taking and returning ``dtype`` activations. ``impl`` picks int8's implementation
    (``auto``: torch on CPU, bitsandbytes else torchao on CUDA; or ``torch``/``bitsandbytes``/``torchao``)."""
    weight = weight.detach()
    bias = None if bias is None else bias.detach()
    if backend == "int8" and _int8_impl(device, impl) == "torch":
        from torch.ao.nn.quantized.dynamic import Linear as DynamicLinear
        from torch.ao.quantization import per_channel_dynamic_qconfig

        layer = _plain_linear(weight.float().cpu(), None if bias is None else bias.float().cpu(), "cpu", torch.float32)
        layer.qconfig = per_channel_dynamic_qconfig
        with _quiet():
            return DynamicLinear.from_float(layer).to(device)
    if backend in ("int8", "nf4") and (backend == "nf4" or _int8_impl(device, impl) == "bitsandbytes"):
        import bitsandbytes as bnb

        out_f, in_f = weight.shape
        w = weight.float().cpu()  # bitsandbytes quantizes on the move from the CPU to the device
        if backend == "nf4":
            layer = bnb.nn.Linear4bit(
                in_f, out_f, bias=bias is not None, compute_dtype=dtype, quant_type="nf4", device="meta"
            )
            layer.weight = bnb.nn.Params4bit(w, requires_grad=False, quant_type="nf4")
        else:
            layer = bnb.nn.Linear8bitLt(
                in_f, out_f, bias=bias is not None, has_fp16_weights=False, threshold=6.0, device="meta"
            )
            layer.weight = bnb.nn.Int8Params(w, requires_grad=False, has_fp16_weights=False)
        if bias is not None:
            layer.bias = nn.Parameter(bias.to("cpu", dtype), requires_grad=False)
        return layer.to(device)
    if backend in ("int8", "fp8", "nvfp4"):
        from torchao.quantization import quantize_

        holder = nn.Sequential(_plain_linear(weight, bias, device, dtype))
        quantize_(holder, _torchao_config(backend, device))
        return holder[0]
    raise ValueError(f"backend {backend!r} does not quantize layers; quantizing backends: {list(QUANTIZING)}")
