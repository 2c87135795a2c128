"""Real-size pipelines with random weights, built from a stored architecture directly on a device.

``flowrl bench --estimate`` builds the published architectures (flowrl/models/archs/*.json) on the meta device;
this module builds the same ones for real, with random weights, straight on the device that runs them
(``torch.device("cuda")``: a 12 B FLUX.1-dev initialises there in seconds, on a CPU in minutes), and saves nothing.
No model hub and no files are read: the transformer and VAE come from the architecture's diffusers configs, the
text encoders from its transformers configs, the scheduler from the family's published scheduler config
(:data:`SCHEDULERS`), and the tokenizers are synthetic word-level ones (:mod:`flowrl.models.tokenizers`) with the
real ``model_max_length`` (77 CLIP tokens; T5 padded to ``max_sequence_length``), so every tensor has the shape
the real model gives it. Every component is in ``dtype`` (as ``from_pretrained(dtype=...)`` loads one).

- :func:`random_pipeline`: the diffusers pipeline of an architecture (families ``sd3`` and ``flux``);
- :func:`random_section`: a ``model`` section that builds a random-weight adapter over an architecture;
  :func:`flowrl.run.model.random_model` builds the :class:`~flowrl.models.base.FlowModel` from it as a run builds its
  model (:func:`flowrl.config.build.build_model`, so LoRA, dtypes, sizes and the prompt cache are set exactly as a run
  sets them);
- :func:`tiny_arch`: a stored architecture shrunk to a few thousand parameters per component, the same
  classes and wiring, to exercise all of this on a CPU in seconds (``scripts/gpu_check.py --tiny``).

The weights are whatever the libraries' initialisers draw (seeded): good for timing and memory, not for images.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
from typing import Iterator

import torch

from flowrl.errors import ConfigError
from flowrl.models.architectures import load_arch
from flowrl.models.dtypes import cast_module
from flowrl.models.flux import FluxFlowModel
from flowrl.models.sd3 import SD3FlowModel

PIPELINES = {"sd3": "StableDiffusion3Pipeline", "flux": "FluxPipeline"}
"""The families :func:`random_pipeline` builds, and their diffusers pipeline classes."""

SCHEDULERS = {
    # stabilityai/stable-diffusion-3.5-medium scheduler/scheduler_config.json
    "sd3": {"num_train_timesteps": 1000, "shift": 3.0},
    # black-forest-labs/FLUX.1-dev scheduler/scheduler_config.json
    "flux": {
        "num_train_timesteps": 1000,
        "shift": 3.0,
        "use_dynamic_shifting": True,
        "base_shift": 0.5,
        "max_shift": 1.15,
        "base_image_seq_len": 256,
        "max_image_seq_len": 4096,
    },
}
"""``FlowMatchEulerDiscreteScheduler`` settings per family (the published scheduler configs)."""

_T5 = {"d_model": 32, "d_kv": 8, "d_ff": 64, "num_layers": 1, "num_heads": 2}
_VAE = {"block_out_channels": [8, 8, 8, 8], "layers_per_block": 1, "norm_num_groups": 4}
TINY = {
    "sd3": {
        "transformer": {
            "attention_head_dim": 8,
            "num_attention_heads": 2,
            "caption_projection_dim": 16,
            "num_layers": 2,
            "dual_attention_layers": [0],
            "joint_attention_dim": 32,
            "pooled_projection_dim": 24,
            "pos_embed_max_size": 16,
            "sample_size": 8,
        },
        "text_encoders": [
            {
                "hidden_size": 8,
                "intermediate_size": 16,
                "num_hidden_layers": 1,
                "num_attention_heads": 2,
                "projection_dim": 8,
            },
            {
                "hidden_size": 16,
                "intermediate_size": 32,
                "num_hidden_layers": 1,
                "num_attention_heads": 2,
                "projection_dim": 16,
            },
            _T5,
        ],
        "vae": _VAE,
    },
    "flux": {
        "transformer": {
            "attention_head_dim": 8,
            "num_attention_heads": 2,
            "num_layers": 1,
            "num_single_layers": 1,
            "axes_dims_rope": [2, 2, 4],
            "joint_attention_dim": 32,
            "pooled_projection_dim": 16,
        },
        "text_encoders": [
            {
                "hidden_size": 16,
                "intermediate_size": 32,
                "num_hidden_layers": 1,
                "num_attention_heads": 2,
                "projection_dim": 16,
            },
            _T5,
        ],
        "vae": _VAE,
    },
}
"""Per family, the config keys :func:`tiny_arch` overrides: the widths kept consistent (SD3: the CLIP hidden states
8 + 16 padded to the T5 width 32 = ``joint_attention_dim``, pooled 8 + 16 = 24; FLUX: the CLIP width = pooled 16,
RoPE axes adding up to the head width 8); latent channels, patching and the VAE's factor 8 as published."""


def _supported(arch: dict) -> str:
    family = arch["family"]
    if family not in PIPELINES:
        raise ConfigError(
            f"no random-weight pipeline for {arch.get('name', arch.get('key'))!r} (family {family!r}); "
            f"supported families: {sorted(PIPELINES)}"
        )
    return family


def tiny_arch(name: str) -> dict:
    """The stored architecture ``name`` (e.g. ``sd35_medium``) with the :data:`TINY` sizes: key ``tiny-<name>``."""
    arch = copy.deepcopy(load_arch(name))
    sizes = TINY[_supported(arch)]
    arch["transformer"]["config"].update(sizes["transformer"])
    arch["vae"]["config"].update(sizes["vae"])
    for spec, override in zip(arch["text_encoders"], sizes["text_encoders"]):
        spec["config"].update(override)
    arch["name"], arch["key"], arch["hub_ids"] = f"{arch['name']} (tiny)", f"tiny-{name}", []
    return arch


@contextlib.contextmanager
def _building(device: torch.device, dtype: torch.dtype) -> Iterator[None]:
    """New tensors on ``device`` and floating ones in ``dtype``: modules are initialised where they will run."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            yield
    finally:
        torch.set_default_dtype(previous)


def _public(config: dict) -> dict:
    return {k: v for k, v in config.items() if not k.startswith("_")}


def _text_encoder(spec: dict):
    """A transformers text encoder from its stored config; CLIP's special ids those of the synthetic tokenizer."""
    import transformers

    config = _public(spec["config"])
    model_type = config.pop("model_type")
    if model_type == "clip_text_model":  # build_clip_tokenizer: BOS 0, EOS (= pad) 1
        config.update(bos_token_id=0, eos_token_id=1, pad_token_id=1)
    cls = getattr(transformers, spec["class"], None)
    if cls is None:
        raise ConfigError(f"transformers has no class {spec['class']!r} (text encoder {spec['name']})")
    return cls(transformers.AutoConfig.for_model(model_type, **config))


def _tokenizer(spec: dict, clip_tokens: int):
    """A synthetic tokenizer for the encoder ``spec``: CLIP BPE (``clip_tokens`` long) or T5 Unigram (up to 512)."""
    from flowrl.models.testing import TINY_VOCAB, _tiny_t5_tokenizer
    from flowrl.models.tokenizers import build_clip_tokenizer

    if spec["class"].startswith("CLIP"):
        return build_clip_tokenizer(TINY_VOCAB, model_max_length=clip_tokens or 77)
    if spec["class"].startswith("T5"):
        return _tiny_t5_tokenizer(TINY_VOCAB, model_max_length=512)
    raise ConfigError(f"no synthetic tokenizer for the text encoder class {spec['class']!r} ({spec['name']})")


def random_pipeline(arch: dict, device: str | torch.device = "cpu", dtype: torch.dtype = torch.bfloat16, seed: int = 0):
    """The diffusers pipeline of ``arch`` (a stored architecture, :func:`flowrl.models.architectures.load_arch`, or
    :func:`tiny_arch`) with random weights drawn on ``device`` in ``dtype`` (seeded), every module in eval mode."""
    import diffusers

    family = _supported(arch)
    device = torch.device(device)
    torch.manual_seed(seed)
    components = {}
    with _building(device, dtype):
        transformer_cls = getattr(diffusers, arch["transformer"]["class"])
        components["transformer"] = transformer_cls.from_config(_public(arch["transformer"]["config"]))
        components["vae"] = getattr(diffusers, arch["vae"]["class"]).from_config(_public(arch["vae"]["config"]))
        clip_tokens = int(arch["text"].get("clip_tokens") or 77)
        for spec in arch["text_encoders"]:
            components[spec["name"]] = _text_encoder(spec)
            components[spec["name"].replace("text_encoder", "tokenizer")] = _tokenizer(spec, clip_tokens)
    components["scheduler"] = diffusers.FlowMatchEulerDiscreteScheduler(**SCHEDULERS[family])
    for module in components.values():
        if isinstance(module, torch.nn.Module):  # a buffer made from numpy on the CPU joins the rest
            torch.nn.Module.to(module, device=device)
            if isinstance(module, diffusers.ModelMixin):
                cast_module(module, dtype)  # keeps _keep_in_fp32_modules, as from_pretrained(dtype=...) does
            else:
                module.to(dtype=dtype)
            module.eval().requires_grad_(False)
    return getattr(diffusers, PIPELINES[family])(**components)


_ARCHS: dict[str, dict] = {}
"""Architectures :func:`random_model` handed to its adapters, by the key it passes as ``model.path``."""


class _RandomWeights:
    """An adapter whose ``from_pretrained(path)`` builds :func:`random_pipeline` of the registered architecture
    ``path`` on the adapter's ``device`` instead of loading weights."""

    @classmethod
    def from_pretrained(cls, path, *, dtype: torch.dtype = torch.float32, pipeline_kwargs: dict | None = None, **kw):
        if str(path) not in _ARCHS:
            raise ConfigError(f"no architecture registered as {str(path)!r}: build through random_model()")
        pipe = random_pipeline(_ARCHS[str(path)], kw.get("device") or "cpu", dtype)
        return cls(pipe, dtype=dtype, **kw)


class RandomSD3FlowModel(_RandomWeights, SD3FlowModel):
    """:class:`SD3FlowModel` over a random-weight pipeline."""


class RandomFluxFlowModel(_RandomWeights, FluxFlowModel):
    """:class:`FluxFlowModel` over a random-weight pipeline."""


ADAPTERS = {"sd3": RandomSD3FlowModel, "flux": RandomFluxFlowModel}


def random_section(section, arch: dict):
    """The ``model`` section ``section`` (a :class:`~flowrl.config.schema.ModelSection`) as one that builds a
    random-weight adapter over ``arch`` (a stored architecture or :func:`tiny_arch`): its ``family`` the adapter
    (``module:Class``) and its ``path`` the key ``arch`` is registered under. :func:`flowrl.run.model.random_model`
    builds it as a run builds its model."""
    adapter = ADAPTERS[_supported(arch)]
    _ARCHS[arch["key"]] = arch
    return dataclasses.replace(section, family=f"{__name__}:{adapter.__name__}", path=arch["key"])
