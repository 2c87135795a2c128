"""Explorer copies of the policy: a cheap model that previews candidates (Sol-RL; docs/explore.md, "The explorer").

    explorer = make_explorer(model, "int8")            # quantized copy of the transformer, LoRA merged
    x0 = ode_sample(explorer.model, prompts, seeds, steps=6, decode=False)
    ...                                                 # an optimizer step changes the LoRA
    explorer.sync(model)                                # re-merge: only the layers that can change

``explorer.model`` is a view of the live adapter (same pipeline, text cache, VAE, noise, schedule)
whose transformer call goes to the explorer's copy, in the copy's compute dtype. The backends (bf16,
int8, nf4, fp8, …) and which layers they convert are in :mod:`flowrl.rollout.precision`.

Following the weights (:meth:`Explorer.sync`): at build time the explorer records which layers can
change — those with trainable parameters (the LoRA-targeted ones, or every layer under full
fine-tuning). A sync rebuilds exactly these: a quantized one is re-quantized from its merged weight
W = W0 + Σ adapters B·A·scale, a full-precision one gets the merged weight copied in; frozen layers
are never touched again. Build the explorer after attaching LoRA.
"""

from __future__ import annotations

import copy
import fnmatch
from dataclasses import dataclass, field
from typing import Sequence

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from flowrl.rollout.precision import (
    DEFAULT_MIN_PARAMS,
    DEFAULT_SKIP,
    QUANTIZING,
    _shape_ok,
    check_backend,
    quantize_linear,
    rest_dtype,
)


def whole(t: torch.Tensor) -> torch.Tensor:
    """``t`` gathered whole: a sharded parameter (FSDP2's DTensor) by a collective every process must call; a plain
    tensor itself."""
    return t.full_tensor() if isinstance(t, DTensor) else t


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
    weight = whole(base.weight.detach()).float()  # sharded (FSDP2): gathered, every process calling
    if base is layer or getattr(layer, "merged", False) or getattr(layer, "disable_adapters", False):
        return weight
    for name in layer.active_adapters:
        if name in layer.lora_A:
            if layer.use_dora.get(name, False):
                raise NotImplementedError("explorer copies of DoRA adapters are not supported")
            weight = weight + whole(layer.get_delta_weight(name).detach()).float()
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
                bias = None if base.bias is None else whole(base.bias.detach())
                self.transformer.set_submodule(
                    name, quantize_linear(self.backend, merged_weight(layer), bias, model.device, self.dtype, self.impl)
                )
            for name in self._recopy:
                layer = live.get_submodule(name)
                base = layer.get_base_layer() if hasattr(layer, "get_base_layer") else layer
                target = self.transformer.get_submodule(name)
                target.weight.copy_(merged_weight(layer))
                if base.bias is not None:
                    target.bias.copy_(whole(base.bias.detach()))
            for name in self._params:
                self.transformer.get_parameter(name).copy_(whole(live.get_parameter(name).detach()))
        rebuilt = len(self._requantize) + len(self._recopy) + len(self._params)
        self.refreshed += rebuilt
        return rebuilt

    def describe(self) -> dict[str, float]:
        """Sizes for logs: quantized layers and parameters of the copy."""
        n = 0 if self.transformer is None else sum(p.numel() for p in self.transformer.parameters())
        return {
            "quantized_layers": float(len(self.quantized)),
            "copy_parameters": float(n),
            "trainable_layers_followed": float(len(self._requantize) + len(self._recopy) + len(self._params)),
        }


def _matches(name: str, patterns: Sequence[str]) -> bool:
    return any(fnmatch.fnmatchcase(name, p) for p in patterns)


def _linear_units(live: nn.Module, wrappers: dict[str, nn.Module]) -> dict[str, nn.Module]:
    """The Linear layers of ``live`` (or the LoRA wrappers around one, named in ``wrappers``) by name; LoRA on any
    other layer is refused."""
    inside = tuple(f"{w}." for w in wrappers)
    units: dict[str, nn.Module] = {}
    for name, module in live.named_modules():
        if name.startswith(inside):
            continue
        base = module.get_base_layer() if name in wrappers else module
        if isinstance(base, nn.Linear):
            units[name] = module
        elif name in wrappers:
            raise NotImplementedError(f"explorer: LoRA on {type(base).__name__} ({name}) is not supported")
    return units


def _frozen_copy(
    live: nn.Module, wrappers: dict[str, nn.Module], replaced: list[torch.Tensor], device, dtype
) -> nn.Module:
    """A copy of ``live`` without gradients, in eval mode, LoRA wrappers unwrapped to their base layers: every
    floating-point tensor cast to ``dtype`` on ``device``, but the weights ``replaced`` (about to be quantized),
    which are left empty."""
    memo: dict[int, object] = {}
    for weight in replaced:
        memo[id(weight)] = nn.Parameter(torch.empty(0, device=device), requires_grad=False)
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
    return copy_.requires_grad_(False).eval()


def make_explorer(
    model,
    backend: str = "same",
    *,
    min_params: int = DEFAULT_MIN_PARAMS,
    skip: Sequence[str] | None = None,
    impl: str = "auto",
) -> Explorer:
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
    units = _linear_units(live, wrappers)
    convert = {}
    for name, module in units.items():
        base = module.get_base_layer() if name in wrappers else module
        convert[name] = (
            backend in QUANTIZING
            and base.weight.numel() >= min_params
            and not _matches(name, skip)
            and _shape_ok(backend, base.weight.shape)
        )
    replaced = [
        (module.get_base_layer() if name in wrappers else module).weight
        for name, module in units.items()
        if convert[name]
    ]
    copy_ = _frozen_copy(live, wrappers, replaced, device, dtype)

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
                copy_.set_submodule(
                    name, quantize_linear(backend, merged_weight(module), base.bias, device, dtype, impl)
                )
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
    view.autocast = None  # the copy computes in its backend's dtype (quantized layers take fp32/bf16 inputs as built)
    explorer.model = view
    return explorer
