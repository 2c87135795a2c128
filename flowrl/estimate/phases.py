"""The phases of one iteration traced on the meta model: rollout forward, explorer forward, VAE decode,
one training micro-batch with and without gradient checkpointing, and one AdamW step (:func:`phase_traces`)."""
from __future__ import annotations

import functools

import torch
from torch import nn

from flowrl.estimate.archs import ARCH_CACHE, build_vae, model_with_lora
from flowrl.estimate.inputs import Shapes, velocity
from flowrl.estimate.trace import Trace, trace
from flowrl.models.dtypes import DTYPES


@functools.lru_cache(maxsize=64)
def phase_traces(arch_key: str, dtype_name: str, lora: tuple | None, shapes: Shapes, rollout_states: int, cfg_on: bool,
                 update_states: int, train_cfg: bool, before: tuple, after: tuple, explore: bool, use_8bit: bool,
                 target: str) -> dict[str, Trace]:
    """The traced phases of one iteration (:func:`trace` each, on the meta model of :func:`model_with_lora`):

    - ``rollout``: one no-grad velocity of ``rollout_states`` states (×2 rows with ``cfg_on``);
    - ``explore``: the same with the LoRA merged (an explorer copy's cost; = ``rollout`` without LoRA);
    - ``decode``: the VAE decode of ``rollout_states`` latents to fp32 images in [0, 1];
    - ``update`` / ``update_checkpointed``: one training micro-batch of ``update_states`` states (×2 with
      ``train_cfg``), without / with gradient checkpointing: the no-grad copy forwards ``before`` (old policy,
      reference), the forward with gradients, the copy forwards ``after`` (the KL reference of a policy
      objective, while the activations are held), a loss over them, backward into pre-allocated gradients;
    - ``optimizer``: one AdamW step (after clipping) over the trainable parameters.
    """
    arch = ARCH_CACHE[arch_key]
    dtype = DTYPES[dtype_name]
    module, _ = model_with_lora(arch_key, dtype_name, lora)
    vae = build_vae(arch, dtype)
    trainable = [p for p in module.parameters() if p.requires_grad]

    def rollout_forward() -> None:
        with torch.no_grad():
            velocity(module, arch, shapes, rollout_states, cfg_on, dtype)

    def decode() -> None:
        with torch.no_grad():
            latents = torch.empty(rollout_states, *shapes.latent, dtype=torch.float32, device="meta").to(dtype)
            image = vae.decode(latents, return_dict=False)[0]
            (image.float() / 2 + 0.5).clamp(0, 1)

    def copy_forward(which: str) -> torch.Tensor:
        """A forward without gradients of the old policy (LoRA: its own adapter; same cost) or the reference
        (LoRA: adapters disabled, as ``FlowModel.reference``; full fine-tuning: a frozen copy, same cost)."""
        off = which == "reference" and lora is not None
        if off:
            module.disable_adapters()
        try:
            with torch.no_grad():
                return velocity(module, arch, shapes, update_states, train_cfg, dtype)
        finally:
            if off:
                module.enable_adapters()

    def update_step() -> None:
        # the objective's own latent-sized fp32 tensors of the micro-batch: a policy objective's parent and child
        # states and transition mean; a forward-process objective's x0, ε, x_t and target y
        latents = [torch.empty(update_states, *shapes.latent, dtype=torch.float32, device="meta")
                   for _ in range(3 if not before else 4)]
        held = [copy_forward(which) for which in before]
        v = velocity(module, arch, shapes, update_states, train_cfg, dtype)
        held += [copy_forward(which) for which in after]
        loss = (v - torch.empty_like(v)).pow(2).mean()  # the objective's few latent-sized fp32 terms
        for h in held:
            loss = loss + (v.detach() - h).pow(2).mean()
        del v, held
        loss.backward()
        del latents

    out: dict[str, Trace] = {}
    module.eval()
    out["rollout"] = out["explore"] = trace(rollout_forward, target)
    if explore and lora is not None:
        module.disable_adapters()
        try:
            out["explore"] = trace(rollout_forward, target)
        finally:
            module.enable_adapters()
    out["decode"] = trace(decode, target)
    module.train()
    for p in trainable:  # gradients exist from the first micro-batch on: the estimate counts them as static
        p.grad = torch.zeros_like(p)
    try:
        for name, checkpointing in (("update", False), ("update_checkpointed", True)):
            if checkpointing:
                module.enable_gradient_checkpointing()
            else:
                module.disable_gradient_checkpointing()
            out[name] = trace(update_step, target)
        module.disable_gradient_checkpointing()
        out["optimizer"] = Trace(0, 0, 0) if use_8bit else _trace_optimizer(trainable, target)
    finally:
        for p in trainable:
            p.grad = None
        module.eval()
    return out


def _trace_optimizer(params: list[nn.Parameter], target: str) -> Trace:
    """Transient bytes of one clipped AdamW step over ``params`` (state allocated by an untraced first step;
    foreach as CUDA runs it, the per-tensor loop as a CPU runs it)."""
    if not params:
        return Trace(0, 0, 0)
    opt = torch.optim.AdamW(params, lr=1e-4, weight_decay=1e-4, foreach=target == "cuda")
    opt.step()

    def step() -> None:
        torch.nn.utils.clip_grad_norm_(params, 1.0)  # per-tensor norms: small either way
        opt.step()

    out = trace(step, target)
    opt.state.clear()
    return out

