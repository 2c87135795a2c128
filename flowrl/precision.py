"""Explorer copies of the policy: a cheap model that previews candidates (Sol-RL, ALGORITHMS.md §7).

    explorer = make_explorer(model, "int8")            # quantized copy of the transformer, LoRA merged
    x0 = ode_sample(explorer.model, prompts, seeds, steps=6, decode=False)
    ...                                                 # an optimizer step changes the LoRA
    explorer.sync(model)                                # re-merge: only the layers that can change

``explorer.model`` is a view of the live adapter (same pipeline, text cache, VAE, noise, schedule)
whose transformer call goes to the explorer's copy, in the copy's compute dtype.

Backends (:data:`BACKENDS`) and what they need:

| backend | what the copy is | runs on |
|---|---|---|
| ``same``  | no copy: the live model itself (the preview is cheap by its fewer steps) | anywhere |
| ``bf16``  | the LoRA-merged transformer cast to bfloat16 | CUDA with bf16; CPU (slow without native bf16) |
| ``fp16``  | the LoRA-merged transformer cast to float16 | CUDA; CPU (slow) |
| ``int8``  | Linear layers int8: CPU ``torch.ao`` dynamic quantisation (per-channel weights, dynamic per-tensor activations); CUDA bitsandbytes ``Linear8bitLt`` (else torchao int8 weight-only) | CPU; CUDA with bitsandbytes or torchao |
| ``nf4``   | Linear layers bitsandbytes NF4 (``Linear4bit``), compute in the rest's dtype | bitsandbytes (CPU or CUDA) |
| ``fp8``   | Linear layers torchao float8 (dynamic activations, per-row weights), rest bf16 | CUDA, compute capability ≥ 8.9, torchao |
| ``nvfp4`` | Linear layers torchao NVFP4: W4A4 on Blackwell (≥ 10.0), weight-only with bf16 activations on Ada/Hopper (8.9–9.x), rest bf16 | CUDA ≥ 8.9, torchao |

Only ``nn.Linear`` layers are quantized, and only those that are large enough (``min_params`` weights,
default 16,384 = 128×128) and match no pattern of the backend's skip list (``fnmatch`` on the module
name; :data:`DEFAULT_SKIP`): embedders (patch/time/text embeddings, caption projections) and the output
layers (``norm_out``, ``proj_out``) stay in the rest's precision; the 4-bit backends also keep the
adaLN modulation layers (``*norm*.linear``) there. Norms and convolutions are never quantized (SANA's
GLUMBConv feed-forward is convolutional and stays in the rest's precision). fp8 and nvfp4 also skip
layers whose dimensions are not multiples of 16 (their kernels need it).

Following the weights (:meth:`Explorer.sync`): at build time the explorer records which layers can
change — those with trainable parameters (the LoRA-targeted ones, or every layer under full
fine-tuning). A sync rebuilds exactly these: a quantized one is re-quantized from its merged weight
W = W0 + Σ adapters B·A·scale, a full-precision one gets the merged weight copied in; frozen layers
are never touched again. Build the explorer after attaching LoRA.

torchao and bitsandbytes are optional and imported only when a backend that needs them is built;
:func:`unavailable_reason` checks for them without importing them.
"""
from __future__ import annotations

import contextlib
import copy
import fnmatch
import importlib
import importlib.util
import warnings
from dataclasses import dataclass, field
from typing import Iterator, Sequence

import torch
from torch import nn

from flowrl.errors import ConfigError

BACKENDS: tuple[str, ...] = ("same", "bf16", "fp16", "int8", "nf4", "fp8", "nvfp4")
QUANTIZING: tuple[str, ...] = ("int8", "nf4", "fp8", "nvfp4")
"""Backends that replace Linear layers (the others copy or reuse the whole transformer)."""

_KEEP = ("*embed*", "*caption_projection*", "proj_out", "norm_out*")
_KEEP_4BIT = _KEEP + ("*norm*.linear",)
DEFAULT_SKIP: dict[str, tuple[str, ...]] = {
    "same": (), "bf16": (), "fp16": (),
    "int8": _KEEP, "fp8": _KEEP, "nf4": _KEEP_4BIT, "nvfp4": _KEEP_4BIT,
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
            return None if _installed("bitsandbytes") or _installed("torchao") else \
                "int8 on CUDA needs bitsandbytes (pip install 'flowrl[quant]') or torchao"
        return None if _torch_dynamic_int8() else "this torch build has no quantized CPU engine for torch.ao dynamic int8"
    if backend == "nf4":
        if device.type not in ("cpu", "cuda"):
            return f"bitsandbytes nf4 does not run on {device.type}"
        return None if _installed("bitsandbytes") else "nf4 needs bitsandbytes: pip install 'flowrl[quant]'"
    if backend == "fp8":
        if not cuda:
            return "fp8 (torchao float8) needs a CUDA GPU with compute capability >= 8.9 (Ada, Hopper or newer)"
        if capability < (8, 9):
            return f"fp8 needs compute capability >= 8.9; this GPU has {capability[0]}.{capability[1]}"
        return None if _installed("torchao") else "fp8 needs torchao: pip install torchao"
    # nvfp4
    if not cuda:
        return ("nvfp4 (torchao NVFP4) needs an NVIDIA GPU: Blackwell (compute capability >= 10.0) for FP4 matmuls, "
                "or Ada/Hopper (>= 8.9) for weight-only NVFP4")
    if capability < (8, 9):
        return f"nvfp4 needs compute capability >= 8.9; this GPU has {capability[0]}.{capability[1]}"
    return None if _installed("torchao") else "nvfp4 needs torchao: pip install torchao"


def available_backends(device: torch.device | str | None = None) -> list[str]:
    """The backends :func:`make_explorer` can build on ``device`` (None → :func:`default_device`)."""
    return [b for b in BACKENDS if unavailable_reason(b, device) is None]


def check_backend(backend: str, device: torch.device | str | None = None, key: str = "rollout.backend") -> None:
    """Raise :class:`ConfigError` naming ``key``, the reason and the backends this device can run
    when ``backend`` cannot run on ``device`` (None → :func:`default_device`)."""
    if backend not in BACKENDS:
        raise ConfigError(f"{key}={backend!r} is not supported; accepted: {list(BACKENDS)}")
    reason = unavailable_reason(backend, device)
    if reason is not None:
        where = torch.device(device) if device is not None else default_device()
        raise ConfigError(f"{key}={backend!r} cannot run on {where}: {reason}; "
                          f"backends this machine can run: {available_backends(device)}")


# ---- layer conversion -----------------------------------------------------------------------
def rest_dtype(backend: str, device: torch.device, model_dtype: torch.dtype) -> torch.dtype:
    """Compute dtype of the explorer's unquantized parts (and of its inputs)."""
    if backend == "bf16":
        return torch.bfloat16
    if backend == "fp16":
        return torch.float16
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
        return _first_attr("torchao.quantization", "Float8DynamicActivationFloat8WeightConfig",
                           "float8_dynamic_activation_float8_weight")(granularity=per_row)
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


def quantize_linear(backend: str, weight: torch.Tensor, bias: torch.Tensor | None, device: torch.device,
                    dtype: torch.dtype, impl: str = "auto") -> nn.Module:
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
            layer = bnb.nn.Linear4bit(in_f, out_f, bias=bias is not None, compute_dtype=dtype, quant_type="nf4",
                                      device="meta")
            layer.weight = bnb.nn.Params4bit(w, requires_grad=False, quant_type="nf4")
        else:
            layer = bnb.nn.Linear8bitLt(in_f, out_f, bias=bias is not None, has_fp16_weights=False, threshold=6.0,
                                        device="meta")
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


# ---- LoRA -----------------------------------------------------------------------------------
def _lora_layers(module: nn.Module) -> dict[str, nn.Module]:
    """peft LoRA wrappers in ``module`` by name (each holds ``base_layer`` and ``lora_A``/``lora_B``)."""
    try:
        from peft.tuners.lora import LoraLayer
    except ImportError:
        return {}
    return {name: m for name, m in module.named_modules() if isinstance(m, LoraLayer)}


def merged_weight(layer: nn.Module) -> torch.Tensor:
    """The effective weight of a Linear or of a peft LoRA wrapper around one: W0 + Σ active adapters'
    B·A·scale (nothing added when merged or disabled), detached, in fp32."""
    base = layer.get_base_layer() if hasattr(layer, "get_base_layer") else layer
    weight = base.weight.detach().float()
    if base is layer or getattr(layer, "merged", False) or getattr(layer, "disable_adapters", False):
        return weight
    for name in layer.active_adapters:
        if name in layer.lora_A:
            if layer.use_dora.get(name, False):
                raise NotImplementedError("explorer copies of DoRA adapters are not supported")
            weight = weight + layer.get_delta_weight(name).detach().float()
    return weight


# ---- the explorer ---------------------------------------------------------------------------
@dataclass
class Explorer:
    """A cheap copy of a :class:`~flowrl.models.base.FlowModel`'s policy (build with :func:`make_explorer`).

    ``model``: the view that samples (shares the live adapter's pipeline, text cache, VAE, noise and
    schedule; its transformer call goes to ``transformer``). ``quantized``: names of the converted
    Linear layers. ``dtype``: compute dtype of the unquantized rest. ``syncs`` / ``refreshed``: how many
    syncs ran and how many layers they rebuilt in all.
    """

    backend: str
    model: object
    transformer: nn.Module | None
    dtype: torch.dtype
    quantized: list[str] = field(default_factory=list)
    impl: str = "auto"
    syncs: int = 0
    refreshed: int = 0
    _requantize: list[str] = field(default_factory=list, repr=False)  # trainable quantized layers
    _recopy: list[str] = field(default_factory=list, repr=False)  # trainable full-precision Linear layers
    _params: list[str] = field(default_factory=list, repr=False)  # other trainable parameters

    def sync(self, model) -> int:
        """Follow ``model``'s current weights: rebuild every layer that has trainable parameters (LoRA
        merged in); frozen layers are left as they are. Returns the number of layers rebuilt."""
        self.syncs += 1
        if self.transformer is None:  # ``same``: the live model itself
            return 0
        live = model.trainable
        with torch.no_grad():
            for name in self._requantize:
                layer = live.get_submodule(name)
                base = layer.get_base_layer() if hasattr(layer, "get_base_layer") else layer
                self.transformer.set_submodule(name, quantize_linear(
                    self.backend, merged_weight(layer), base.bias, model.device, self.dtype, self.impl))
            for name in self._recopy:
                layer = live.get_submodule(name)
                base = layer.get_base_layer() if hasattr(layer, "get_base_layer") else layer
                target = self.transformer.get_submodule(name)
                target.weight.copy_(merged_weight(layer))
                if base.bias is not None:
                    target.bias.copy_(base.bias.detach())
            for name in self._params:
                self.transformer.get_parameter(name).copy_(live.get_parameter(name).detach())
        rebuilt = len(self._requantize) + len(self._recopy) + len(self._params)
        self.refreshed += rebuilt
        return rebuilt

    def describe(self) -> dict[str, float]:
        """Sizes for logs: quantized layers and parameters of the copy."""
        n = 0 if self.transformer is None else sum(p.numel() for p in self.transformer.parameters())
        return {"quantized_layers": float(len(self.quantized)), "copy_parameters": float(n),
                "trainable_layers_followed": float(len(self._requantize) + len(self._recopy) + len(self._params))}


def _matches(name: str, patterns: Sequence[str]) -> bool:
    return any(fnmatch.fnmatchcase(name, p) for p in patterns)


def make_explorer(model, backend: str = "same", *, min_params: int = DEFAULT_MIN_PARAMS,
                  skip: Sequence[str] | None = None, impl: str = "auto") -> Explorer:
    """An :class:`Explorer` of ``model`` (a FlowModel, LoRA attached or not) in ``backend``.

    ``min_params``: smallest Linear weight (elements) to quantize; ``skip``: module-name patterns kept
    unquantized (None → :data:`DEFAULT_SKIP` of the backend; ``[]`` quantizes every large-enough
    Linear); ``impl``: int8's implementation (:func:`quantize_linear`). Raises :class:`ConfigError`
    (naming the backends this device can run) when ``backend`` cannot run on ``model.device``.
    """
    check_backend(backend, model.device, key="backend")
    if backend == "same":
        return Explorer(backend, model, None, model.dtype)
    device = torch.device(model.device)
    dtype = rest_dtype(backend, device, model.dtype)
    skip = DEFAULT_SKIP[backend] if skip is None else tuple(skip)
    live = model.trainable
    wrappers = _lora_layers(live)
    inside = tuple(f"{w}." for w in wrappers)
    units: dict[str, nn.Module] = {}  # Linear layers (or LoRA wrappers around one) by name
    for name, module in live.named_modules():
        if name.startswith(inside):
            continue
        base = module.get_base_layer() if name in wrappers else module
        if isinstance(base, nn.Linear):
            units[name] = module
        elif name in wrappers:
            raise NotImplementedError(f"explorer: LoRA on {type(base).__name__} ({name}) is not supported")
    convert = {}
    for name, module in units.items():
        base = module.get_base_layer() if name in wrappers else module
        convert[name] = (backend in QUANTIZING and base.weight.numel() >= min_params and not _matches(name, skip)
                         and _shape_ok(backend, base.weight.shape))

    # copy everything but the weights about to be replaced, cast to the rest's dtype, without gradients
    memo: dict[int, object] = {}
    for name, module in units.items():
        if convert[name]:
            base = module.get_base_layer() if name in wrappers else module
            memo[id(base.weight)] = nn.Parameter(torch.empty(0, device=device), requires_grad=False)
    for tensor in list(live.parameters()) + list(live.buffers()):
        if id(tensor) not in memo and tensor.is_floating_point():
            cast = tensor.detach().to(device=device, dtype=dtype, copy=True)
            memo[id(tensor)] = nn.Parameter(cast, requires_grad=False) if isinstance(tensor, nn.Parameter) else cast
    copy_ = copy.deepcopy(live, memo)
    for name in wrappers:  # unwrap: the copy has plain layers only
        copy_.set_submodule(name, copy_.get_submodule(name).get_base_layer())
    if hasattr(copy_, "peft_config"):
        del copy_.peft_config
    if getattr(copy_, "_hf_peft_config_loaded", False):
        copy_._hf_peft_config_loaded = False
    copy_.requires_grad_(False).eval()

    explorer = Explorer(backend, None, copy_, dtype, impl=impl)
    trainable_params = {n for n, p in live.named_parameters() if p.requires_grad}
    in_units = set()
    with torch.no_grad():
        for name, module in units.items():
            base = module.get_base_layer() if name in wrappers else module
            params = {n for n in trainable_params if n == name or n.startswith(f"{name}.")}
            in_units |= params
            changing = bool(params)
            if convert[name]:
                copy_.set_submodule(name, quantize_linear(backend, merged_weight(module), base.bias, device, dtype, impl))
                explorer.quantized.append(name)
                if changing:
                    explorer._requantize.append(name)
            elif name in wrappers:
                copy_.get_submodule(name).weight.copy_(merged_weight(module))
                if changing:
                    explorer._recopy.append(name)
            elif changing:
                explorer._recopy.append(name)
    explorer._params = sorted(trainable_params - in_units)

    view = copy.copy(model)  # same pipeline, prompt cache and settings; own forward module and dtype
    view.set_forward_module(copy_)
    view.dtype = dtype
    explorer.model = view
    return explorer
