"""Sizes of the static memory: reward models' weights, an explorer copy in its quantized format, tensor
bytes, and the prompts a prompt file holds (for the prompt cache's growth); and what a CPU run's decode holds
in host memory, which is its device memory."""

from __future__ import annotations

import fnmatch

from torch import nn

from flowrl.core.choices import choose
from flowrl.paths import find_file
from flowrl.rollout.precision import BACKENDS, DEFAULT_MIN_PARAMS, DEFAULT_SKIP, QUANTIZING, _shape_ok

REWARD_MODELS: dict[str, tuple[float, str]] = {
    "pickscore": (986e6, "CLIP ViT-H/14 (632 M vision + 354 M text)"),
    "hpsv2": (986e6, "open_clip ViT-H-14"),
    "clip_score": (428e6, "CLIP ViT-L/14"),
    "aesthetic": (428e6, "CLIP ViT-L/14 + MLP head"),
    "imagereward": (447e6, "BLIP ViT-L + BERT-base with cross-attention (≈ 1.8 GB fp32 checkpoint)"),
    "geneval": (497e6, "Mask2Former Swin-S (69 M) + CLIP ViT-L/14 colour classifier (428 M)"),
    "vlm_judge": (8.29e9, "Qwen2.5-VL-7B-Instruct judge in-process (backend: transformers)"),
}
"""Approximate parameters of the built-in model rewards (loaded on the GPU in fp16 unless their ``dtype``
says otherwise); rewards not listed (``remote``, ``shapes``, ``ocr`` on its CPU engine, image statistics) hold no
GPU weights, nor does a reward whose kwargs send it elsewhere (:data:`SERVED`)."""
SERVED: dict[str, tuple[str, str]] = {"vlm_judge": ("backend", "openai")}
"""Rewards that hold no weights here when a kwarg has (or defaults to) a value: a judge served over HTTP."""


_QUANT_BYTES = {  # bytes per weight element of a quantized Linear (scales included)
    "int8": 1.0 + 4 / 4096,  # per-row fp32 scales: negligible
    "fp8": 1.0 + 4 / 4096,  # e4m3 weights, per-row fp32 scales
    "nf4": 0.5 + 4 / 64,  # 4-bit codes, one fp32 absmax per 64-block
    "nvfp4": 0.5 + 1 / 16,  # 4-bit e2m1, one fp8 scale per 16-block
}


def explorer_bytes(
    module: nn.Module, backend: str, min_params: int | None = None, skip: list[str] | None = None
) -> int:
    """Bytes of an explorer copy of ``module`` (a meta transformer, LoRA attached or not) in ``backend``
    (:mod:`flowrl.rollout.precision`): LoRA merged; Linear layers the backend converts (large enough, not skipped,
    dimensions it takes) in its format, the rest in the rest dtype (bf16 on GPUs)."""
    choose("rollout.backend", backend, BACKENDS)
    if backend == "same":
        return 0
    min_params = DEFAULT_MIN_PARAMS if min_params is None else min_params
    patterns = DEFAULT_SKIP[backend] if skip is None else tuple(skip)
    rest = 2  # bf16 / fp16 on a GPU
    total = 0
    counted: set[int] = set()
    for name, layer in module.named_modules():
        base = layer.get_base_layer() if hasattr(layer, "get_base_layer") else layer
        if not isinstance(base, nn.Linear) or ".lora_" in name or name.endswith(".base_layer"):
            continue  # LoRA's own layers are merged; a wrapped layer is counted once, through its wrapper
        for p in base.parameters(recurse=False):
            counted.add(id(p))
        w = base.weight
        convert = (
            backend in QUANTIZING
            and w.numel() >= min_params
            and _shape_ok(backend, w.shape)
            and not any(fnmatch.fnmatchcase(name, p) for p in patterns)
        )
        total += int(w.numel() * (_QUANT_BYTES[backend] if convert else rest))
        if base.bias is not None:
            total += base.bias.numel() * rest
    for name, p in module.named_parameters():
        if id(p) not in counted and "lora_" not in name:
            total += p.numel() * rest
    total += sum(b.numel() * rest for b in module.buffers() if b.is_floating_point())
    return total


def host_decode_bytes(decode_peak: int, states: int, chunk: int, image_bytes: int, latent_bytes: int) -> int:
    """Peak bytes of one decode call (:func:`flowrl.training.scoring.decode`: ``states`` latents, ``chunk`` at a time,
    each
    chunk's fp32 pixels moved to the host, then concatenated) where the device *is* the host (a CPU run): the
    gathered fp32 latents, plus the larger of the last chunk's decode (``decode_peak``, its own pixels included)
    with the earlier chunks' pixels alive and the concatenation of every state's pixels beside its parts. (On a
    GPU the chunks leave the device as they are decoded: ``decode_peak`` alone.)"""
    earlier = max(states - chunk, 0)
    return states * latent_bytes + max(decode_peak + earlier * image_bytes, 2 * states * image_bytes)


def tensor_bytes(tensors) -> int:
    """Bytes of ``tensors`` (meta tensors included: their numel and dtype)."""
    return sum(t.numel() * t.element_size() for t in tensors)


def reward_model_bytes(cfg) -> tuple[int, list[str]]:
    """Bytes of the model rewards' weights of ``cfg`` (training and eval rewards, each model once) and a note
    naming each."""
    total, notes = 0, []
    seen = set()
    for term in list(cfg.rewards) + list(cfg.eval.rewards or []):
        name = str(term.name)
        key, served = SERVED.get(name, (None, None))
        if key is not None and term.kwargs.get(key, served) == served:
            continue
        if name in REWARD_MODELS and name not in seen:
            seen.add(name)
            params, what = REWARD_MODELS[name]
            size = 4 if str(term.kwargs.get("dtype", "auto")) in ("fp32", "float32") else 2
            total += int(params * size)
            notes.append(f"reward {name}: {what}, ≈ {params / 1e6:.0f} M parameters")
    return total, notes


def prompt_count(spec: str | None) -> int:
    """Prompts in a prompts file (or inline ``a|b|c``); 0 when the file is not here."""
    if not spec:
        return 0
    path = find_file(spec)
    if path is not None:
        return sum(1 for line in path.read_text().splitlines() if line.strip())
    if "|" in spec or not spec.endswith(".txt"):
        return len([p for p in spec.split("|") if p.strip()])
    return 0
