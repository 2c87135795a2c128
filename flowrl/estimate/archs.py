"""The published architectures on the meta device: an architecture (a stored JSON of flowrl/models/archs/, read by
:mod:`flowrl.models.architectures`, a local pipeline folder's configs, or a live pipeline's) and building its diffusers
transformer and VAE and counting its text encoders on the ``meta`` device (shapes and dtypes, no memory),
with the preset's LoRA attached by peft exactly as training attaches it."""

from __future__ import annotations

import functools
import hashlib
import inspect
import json
from pathlib import Path

import diffusers
import torch
import transformers
from peft import LoraConfig
from peft.tuners.lora import LoraLayer
from torch import nn

from flowrl.errors import ConfigError
from flowrl.models import MODEL_FAMILIES, ModelFamily, model_family
from flowrl.models.architectures import ARCH_DIR, list_archs, load_arch  # noqa: F401 (ARCH_DIR: the estimate's API)
from flowrl.models.dtypes import DTYPES, cast_module, keep_adapter_fp32
from flowrl.models.estimate_spec import base_spec, estimate_spec
from flowrl.shapes.pipeline import SHIPPED_DIR, generation_defaults


def arch_for_model(section) -> dict:
    """The architecture of ``model`` (a :class:`~flowrl.config.schema.ModelSection`): a stored one when ``model.path``
    is one of its hub ids, a local pipeline folder's own configs, or the shipped shapes model."""
    path = section.path
    # a family whose model ships with flowrl (the shapes model): its architecture is its shipped pipeline folder's, of
    # the family it names as arch_family (flowrl/shapes/family.py)
    arch_family = getattr(model_family(section.family), "arch_family", None)
    family = arch_family or section.family
    if arch_family is not None and path is None:
        return arch_from_folder(SHIPPED_DIR, family=family, shapes=True)
    if path is None:
        raise ConfigError(f"model.path must name a hub id or a local folder for model.family={section.family!r}")
    for name in list_archs():
        arch = load_arch(name)
        if str(path).rstrip("/") in arch["hub_ids"]:
            return arch
    folder = Path(path)
    if folder.is_dir() and (folder / "model_index.json").is_file():
        return arch_from_folder(folder, family=family, shapes=arch_family is not None)
    known = sorted(i for n in list_archs() for i in load_arch(n)["hub_ids"])
    raise ConfigError(
        f"model.path={path!r}: no stored architecture for it and not a local pipeline folder; stored "
        f"hub ids: {known} (add a JSON file to flowrl/models/archs/ for another model)"
    )


def arch_from_folder(folder: str | Path, family: str, shapes: bool = False) -> dict:
    """The architecture of a saved diffusers pipeline folder (``model_index.json`` and the components'
    ``config.json``; tokenizers' ``model_max_length`` for the CLIP tokens of SD3)."""
    folder = Path(folder)
    index = json.loads((folder / "model_index.json").read_text())

    def component(name: str) -> dict | None:
        entry = index.get(name)
        if not entry or entry[0] is None or not (folder / name / "config.json").is_file():
            return None
        config = json.loads((folder / name / "config.json").read_text())
        return {"name": name, "class": entry[1], "config": {k: v for k, v in config.items() if not k.startswith("_")}}

    transformer, vae = component("transformer"), component("vae")
    if transformer is None or vae is None:
        raise ConfigError(f"{folder}: a pipeline folder needs transformer/ and vae/ with their config.json")
    encoders = [c for c in (component(n) for n in ("text_encoder", "text_encoder_2", "text_encoder_3")) if c]
    for enc in encoders:
        enc["config"] = {
            k: v
            for k, v in enc["config"].items()
            if k not in ("architectures", "transformers_version", "dtype", "torch_dtype")
        }
    spec, base = estimate_spec(family), base_spec(family)
    clip_tokens = 0
    if spec.clip_tokens:
        tok = folder / "tokenizer" / "tokenizer_config.json"
        clip_tokens = int(json.loads(tok.read_text()).get("model_max_length", 77)) if tok.is_file() else 77
    vae_config = vae["config"]
    blocks = vae_config.get("block_out_channels") or vae_config.get("decoder_block_out_channels") or [0]
    downsample = vae_config.get("temperal_downsample")  # the video VAEs (Qwen-Image, Wan): one ×2 per stage
    vae.update(
        scale_factor=2 ** (len(downsample) if downsample is not None else len(blocks) - 1),
        latent_channels=vae_config.get("latent_channels") or vae_config.get("z_dim"),
    )
    if base.folder_vae is not None:  # a video VAE's temporal factor (and a VAE config stating its factors)
        vae.update(base.folder_vae(vae_config))
    arch = {
        "name": folder.name,
        "key": str(folder),
        "family": family,
        "hub_ids": [],
        "transformer": transformer,
        "text_encoders": encoders,
        "vae": vae,
        "text": {"clip_tokens": clip_tokens, "max_sequence_length_limit": text_limit(family)},
    }
    second = component("transformer_2")  # Wan 2.2 A14B's low-noise expert (with the pipeline's boundary_ratio)
    if second is not None:
        arch.update(transformer_2=second, boundary_ratio=index.get("boundary_ratio"))
    if spec.vision:  # the edit models' image processor (the hub's layout, or the newer one)
        found = [
            p
            for p in (folder / "processor" / "preprocessor_config.json", folder / "processor" / "processor_config.json")
            if p.is_file()
        ]
        if found:
            config = json.loads(found[0].read_text())
            arch["text"]["vision"] = vision_settings(config.get("image_processor", config))
    if shapes:
        arch["defaults"] = generation_defaults(folder)
        arch["name"] = f"shapes model ({folder.name})"
    return arch


def pipeline_family(name: str) -> str | None:
    """The registered family whose diffusers pipeline class is named ``name`` (:data:`flowrl.models.MODEL_FAMILIES`,
    the first registered), else None."""
    for family, entry in MODEL_FAMILIES.items():
        if isinstance(entry, ModelFamily) and entry.pipeline == name:
            return family
    return None


def text_limit(family: str) -> int:
    """``max_sequence_length`` the pipeline of ``family`` (or of its base family) allows: its spec's ``text_limit``."""
    return base_spec(family).text_limit


def vision_settings(processor: dict) -> dict:
    """An edit model's source-image tokens from its image processor's config (Qwen2-VL: ``patch_size``,
    ``merge_size``, and the pixel bounds of its resize as ``min_pixels``/``max_pixels`` or, in newer configs,
    ``size.shortest_edge``/``size.longest_edge``)."""
    size = processor.get("size") or {}
    return {
        "patch_size": int(processor["patch_size"]),
        "merge_size": int(processor["merge_size"]),
        "min_pixels": int(processor.get("min_pixels") or size["shortest_edge"]),
        "max_pixels": int(processor.get("max_pixels") or size["longest_edge"]),
    }


VIDEO_DEFAULTS = ("height", "width", "num_frames", "guidance_scale", "max_sequence_length")
"""A video pipeline's call defaults the estimate takes when the config sets none (the adapter's own)."""


def arch_from_pipeline(pipe, family: str | None = None) -> dict:
    """The architecture of a live diffusers pipeline (e.g. the tiny test pipelines): the configs of its
    transformer and VAE, its text encoders' parameter counts, the CLIP tokens of SD3, the VAE's spatial factor
    (Wan: ``vae_scale_factor_spatial``, and its ``temporal_factor``) and latent channels (``latent_channels`` or
    the video VAEs' ``z_dim``), the default image size (``default_sample_size`` latent cells of the VAE) or, for
    Wan, its ``__call__`` defaults (480×832, 81 frames)."""
    name = type(pipe).__name__
    family = family or pipeline_family(name)
    if family is None:
        supported = [f.pipeline for f in MODEL_FAMILIES.values() if isinstance(f, ModelFamily) and f.pipeline]
        raise ConfigError(f"no estimate for a {name}; supported: {', '.join(supported)}")
    spec, base = estimate_spec(family), base_spec(family)
    encoders = [
        {
            "name": n,
            "class": type(m).__name__,
            "params": sum(p.numel() for p in m.parameters()),
            "dtype": str(next(m.parameters()).dtype).replace("torch.", ""),
        }
        for n in ("text_encoder", "text_encoder_2", "text_encoder_3")
        if (m := getattr(pipe, n, None)) is not None
    ]
    clip_tokens = int(pipe.tokenizer.model_max_length) if spec.clip_tokens else 0
    vae_config = pipe.vae.config
    scale = (
        getattr(pipe, "vae_scale_factor", None)
        or getattr(pipe, "vae_spatial_compression_ratio", None)
        or pipe.vae_scale_factor_spatial
    )
    vae = {
        "class": type(pipe.vae).__name__,
        "config": dict(vae_config),
        "scale_factor": int(scale),
        "latent_channels": vae_config.get("latent_channels") or vae_config.get("z_dim"),
    }
    if base.pipeline_vae is not None:  # a video VAE's temporal factor
        vae.update(base.pipeline_vae(pipe))
    text = {
        "clip_tokens": clip_tokens,
        "max_sequence_length_limit": text_limit(family),
        "default_image_size": (getattr(pipe, "default_sample_size", None) or 0) * int(scale),
    }
    if spec.vision:
        text["vision"] = vision_settings(pipe.processor.image_processor.to_dict())
    arch = {
        "name": f"{name} (in memory)",
        "family": family,
        "hub_ids": [],
        "transformer": {"class": type(pipe.transformer).__name__, "config": dict(pipe.transformer.config)},
        "vae": vae,
        "text_encoders": encoders,
        "text": text,
    }
    second = getattr(pipe, "transformer_2", None)  # Wan 2.2 A14B's low-noise expert
    if second is not None:
        arch.update(
            transformer_2={"class": type(second).__name__, "config": dict(second.config)},
            boundary_ratio=pipe.config.get("boundary_ratio"),
        )
    if base.video:
        call = inspect.signature(type(pipe).__call__).parameters
        arch["defaults"] = {k: call[k].default for k in VIDEO_DEFAULTS if k in call and call[k].default is not None}
    # the key names what the meta model is built from (cached builds and traces): the configs, not the object
    digest = hashlib.sha1(json.dumps([arch["transformer"], arch["vae"]], sort_keys=True, default=str).encode())
    arch["key"] = f"pipeline-{digest.hexdigest()[:16]}"
    return arch


def _diffusers_class(name: str):
    cls = getattr(diffusers, name, None)
    if cls is None:
        raise ConfigError(f"diffusers has no class {name!r} (needed to build the architecture on the meta device)")
    return cls


def build_transformer(arch: dict, dtype: torch.dtype = torch.bfloat16) -> nn.Module:
    """The architecture's diffusers transformer on the meta device (no memory), in ``dtype`` (cast as a run casts
    it: :func:`flowrl.models.dtypes.cast_module`), eval mode."""
    cls = _diffusers_class(arch["transformer"]["class"])
    with torch.device("meta"):
        module = cls.from_config(_public(arch["transformer"]["config"]))
    return cast_module(module, dtype).eval().requires_grad_(False)


def build_vae(arch: dict, dtype: torch.dtype = torch.bfloat16) -> nn.Module:
    """The architecture's VAE on the meta device, in ``dtype``, eval mode, frozen."""
    cls = _diffusers_class(arch["vae"]["class"])
    with torch.device("meta"):
        module = cls.from_config(_public(arch["vae"]["config"]))
    return cast_module(module, dtype).eval().requires_grad_(False)


ARCH_CACHE: dict[str, dict] = {}
"""Architectures by ``key``, for the caches keyed by it (text encoder counts, meta models, traced phases)."""


@functools.lru_cache(maxsize=None)
def _text_encoder_params(key: str, index: int) -> int:
    return _count_text_encoder(ARCH_CACHE[key]["text_encoders"][index])


def _count_text_encoder(spec: dict) -> int:
    """Parameters of one text encoder: given (``params``) or built from its config on the meta device."""
    if "params" in spec:
        return int(spec["params"])
    config = dict(spec["config"])
    model_type = config.pop("model_type")
    cls = getattr(transformers, spec["class"], None)
    if cls is None:
        raise ConfigError(f"transformers has no class {spec['class']!r} (text encoder {spec['name']})")
    with torch.device("meta"):
        module = cls(transformers.AutoConfig.for_model(model_type, **config))
    return sum(p.numel() for p in module.parameters())


def text_encoder_params(arch: dict) -> dict[str, int]:
    """Parameters of each text encoder of ``arch`` by component name (built on the meta device, cached)."""
    ARCH_CACHE[arch["key"]] = arch
    return {spec["name"]: _text_encoder_params(arch["key"], i) for i, spec in enumerate(arch["text_encoders"])}


def _public(config: dict) -> dict:
    return {k: v for k, v in config.items() if not k.startswith("_")}


def add_lora(module: nn.Module, rank: int, alpha: float, targets: list[str], init: str = "gaussian") -> int:
    """Attach a peft LoRA named ``default`` to ``module`` (as :meth:`FlowModel.add_lora`); returns the number
    of LoRA-wrapped layers. Raises :class:`ConfigError` naming the targets when none matches."""
    module.requires_grad_(False)
    try:
        with torch.device("meta"):  # peft builds the LoRA layers on the default device: keep them shapes only
            module.add_adapter(
                LoraConfig(
                    r=rank,
                    lora_alpha=alpha,
                    target_modules=list(targets),
                    init_lora_weights=init if init != "default" else True,
                )
            )
    except ValueError as e:
        raise ConfigError(f"model.lora.targets={list(targets)}: {e}") from e
    # fp32 LoRA on any base dtype, as training keeps it (peft's cast_adapter_dtype: flowrl.models.lora)
    keep_adapter_fp32(module, "default")
    return sum(isinstance(m, LoraLayer) for m in module.modules())


def default_lora_targets(family: str) -> list[str]:
    """The adapter's ``default_lora_targets`` of ``family``."""
    return list(model_family(family).adapter_class().default_lora_targets)


@functools.lru_cache(maxsize=8)
def model_with_lora(
    arch_key: str, dtype_name: str, lora: tuple | None, gathered: bool = False
) -> tuple[nn.Module, int]:
    """(meta transformer with the LoRA ``lora`` = (rank, alpha, targets, init) attached or None for full
    fine-tuning, number of LoRA layers); cached: building FLUX with LoRA takes a few seconds.

    Its parameters' dtypes are those training holds with ``model.dtype`` = ``dtype_name``: LoRA fp32 on a base in
    ``dtype_name`` (:func:`flowrl.models.dtypes.keep_adapter_fp32`); full fine-tuning fp32 master weights, every
    parameter and buffer (:func:`flowrl.models.dtypes.master_weights_fp32`; no-op for fp32). ``gathered``: every
    parameter in ``dtype_name`` instead, as FSDP2 all-gathers them to compute (``MixedPrecisionPolicy``)."""
    arch = ARCH_CACHE[arch_key]
    dtype = DTYPES[dtype_name]
    module = build_transformer(arch, torch.float32 if lora is None else dtype)
    layers = 0
    if lora is None:
        module.requires_grad_(True)
    else:
        rank, alpha, targets, init = lora
        layers = add_lora(module, rank, alpha, list(targets), init)
    if gathered:  # the parameters (fp32 master weights, fp32 LoRA) gathered in dtype; buffers are not FSDP's
        for param in module.parameters():
            param.data = param.data.to(dtype)
    return module, layers
