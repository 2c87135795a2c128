"""The phases of one iteration traced on the meta model: rollout forward, explorer forward, VAE decode,
one training micro-batch with and without gradient checkpointing, and one AdamW step (:func:`phase_traces`)."""

from __future__ import annotations

import contextlib
import functools

import torch
from torch import nn

from flowrl.estimate.archs import ARCH_CACHE, build_vae, model_with_lora
from flowrl.estimate.autocast import MetaAutocast
from flowrl.estimate.inputs import Shapes, decode_latents, velocity
from flowrl.estimate.trace import Trace, trace
from flowrl.models.blocks import checkpoint_blocks
from flowrl.models.dtypes import DTYPES


def _drop_gradient(param: nn.Parameter) -> None:
    param.grad = None


def phase_traces(
    arch_key: str,
    dtype_name: str,
    lora: tuple | None,
    shapes: Shapes,
    rollout_states: int,
    cfg_on: bool,
    update_states: int,
    train_cfg: bool,
    before: tuple,
    after: tuple,
    explore: bool,
    use_8bit: bool,
    target: str,
    sharded: bool = False,
    checkpointed: int | None = None,
) -> dict[str, Trace]:
    """The traced phases of one iteration (:func:`trace` each, on the meta model of :func:`model_with_lora`, its
    parameters in the dtypes training holds; ``sharded``: as FSDP2 gathers them, in ``dtype_name``):

    - ``rollout``: one no-grad velocity of ``rollout_states`` states (×2 rows with ``cfg_on``);
    - ``explore``: the same with the LoRA merged (an explorer copy's cost; = ``rollout`` without LoRA);
    - ``decode``: the VAE decode of ``rollout_states`` latents to fp32 images in [0, 1];
    - ``update`` / ``update_checkpointed``: one training micro-batch of ``update_states`` states (×2 with
      ``train_cfg``), without / with gradient checkpointing of the first ``checkpointed`` blocks (None: every block;
      :func:`flowrl.models.blocks.checkpoint_blocks`): the no-grad copy forwards ``before`` (old policy,
      reference, a guided teacher's anchor: :meth:`_PhaseTracer.copy_forward`), the forward with gradients, the
      copy forwards ``after`` (the KL reference of a policy objective, while the activations are held), a loss
      over them, backward into pre-allocated gradients;
    - ``optimizer``: one AdamW step (after clipping) over the trainable parameters as training holds them (fp32).

    Full fine-tuning of a bf16/fp16 model runs the transformer under autocast in ``dtype_name`` (fp32 master
    weights: :func:`flowrl.models.dtypes.master_weights_fp32`), emulated on meta tensors by :class:`MetaAutocast`:
    the trainable weights' low-precision casts are cached through each forward, as torch caches them; the frozen
    copies' are not. Hidden states then enter in fp32 (the model's dtype), or in ``dtype_name`` when ``sharded``
    (FSDP2 casts the forward inputs to the gathered dtype). ``sharded``: each gradient is dropped as soon as
    backward has accumulated it (FSDP2 reduce-scatters a block's gradients and frees them as backward leaves it:
    :func:`~flowrl.estimate.sharding.fsdp_transients`; the sharded ones are static).

    Each piece is cached on the arguments it depends on (:func:`_sampling_traces`, :func:`_update_trace`,
    :func:`_optimizer_trace`): estimates that differ in one batch size (``train.fit``'s probes and its choice)
    trace only what that size changes.
    """
    out = dict(_sampling_traces(arch_key, dtype_name, lora, shapes, rollout_states, cfg_on, explore, target, sharded))
    update = (arch_key, dtype_name, lora, shapes, update_states, train_cfg, before, after, target, sharded)
    out["update"] = _update_trace(*update, 0)
    out["update_checkpointed"] = _update_trace(*update, checkpointed)
    out["optimizer"] = Trace(0, 0, 0) if use_8bit else _optimizer_trace(arch_key, dtype_name, lora, target)
    return out


@functools.lru_cache(maxsize=64)
def _sampling_traces(
    arch_key: str,
    dtype_name: str,
    lora: tuple | None,
    shapes: Shapes,
    rollout_states: int,
    cfg_on: bool,
    explore: bool,
    target: str,
    sharded: bool,
) -> dict[str, Trace]:
    """``rollout``, ``explore`` and ``decode`` of :func:`phase_traces`."""
    return _PhaseTracer(arch_key, dtype_name, lora, shapes, target, sharded).sampling(rollout_states, cfg_on, explore)


@functools.lru_cache(maxsize=16)
def teacher_rollout_trace(
    arch_key: str,
    dtype_name: str,
    lora: tuple | None,
    shapes: Shapes,
    rollout_states: int,
    cfg: bool,
    target: str,
    sharded: bool,
) -> Trace:
    """A rollout forward of ``rollout_states`` states at a guided teacher's CFG (``cfg``: 2 rows per state), the
    weights as the rollout's (a teacher sampling chains of its own, ``rollout.teacher_share``)."""
    tracer = _PhaseTracer(arch_key, dtype_name, lora, shapes, target, sharded)
    tracer.states, tracer.cfg_rows = rollout_states, cfg
    tracer.module.eval()
    return trace(tracer.rollout_forward, target)


@functools.lru_cache(maxsize=128)
def _update_trace(
    arch_key: str,
    dtype_name: str,
    lora: tuple | None,
    shapes: Shapes,
    update_states: int,
    train_cfg: bool,
    before: tuple,
    after: tuple,
    target: str,
    sharded: bool,
    checkpointed: int | None,
) -> Trace:
    """One training micro-batch of :func:`phase_traces` with the first ``checkpointed`` blocks checkpointed (0: none;
    None: every block)."""
    tracer = _PhaseTracer(arch_key, dtype_name, lora, shapes, target, sharded)
    return tracer.update(update_states, train_cfg, before, after, checkpointed)


@functools.lru_cache(maxsize=32)
def _optimizer_trace(arch_key: str, dtype_name: str, lora: tuple | None, target: str) -> Trace:
    return _trace_optimizer(_PhaseTracer.held_parameters(arch_key, dtype_name, lora), target)


class _PhaseTracer:
    """The meta model of :func:`phase_traces` and one method per traced piece of an iteration; the batch of the
    piece being traced is set by the method that traces it."""

    def __init__(self, arch_key: str, dtype_name: str, lora: tuple | None, shapes: Shapes, target: str, sharded: bool):
        self.arch = ARCH_CACHE[arch_key]
        self.dtype = DTYPES[dtype_name]
        self.module, _ = model_with_lora(arch_key, dtype_name, lora, sharded)
        self.vae = build_vae(self.arch, self.dtype)
        self.trainable = [p for p in self.module.parameters() if p.requires_grad]
        self.autocast = MetaAutocast(self.dtype, target) if lora is None and self.dtype != torch.float32 else None
        self.inputs = torch.float32 if self.autocast is not None and not sharded else self.dtype
        self.lora, self.shapes, self.target, self.sharded = lora, shapes, target, sharded
        self.states, self.cfg_rows, self.before, self.after = 1, False, (), ()

    @staticmethod
    def held_parameters(arch_key: str, dtype_name: str, lora: tuple | None) -> list[nn.Parameter]:
        """The trainable parameters as training holds them (fp32 LoRA or master weights), whole."""
        return [p for p in model_with_lora(arch_key, dtype_name, lora)[0].parameters() if p.requires_grad]

    def region(self, cache: bool = True):
        return self.autocast(cache) if self.autocast is not None else contextlib.nullcontext()

    def rollout_forward(self) -> None:
        with torch.no_grad(), self.region():
            velocity(self.module, self.arch, self.shapes, self.states, self.cfg_rows, self.inputs)

    def decode(self) -> None:
        with torch.no_grad():
            latents = torch.empty(self.states, *self.shapes.latent, dtype=torch.float32, device="meta").to(self.dtype)
            image = decode_latents(self.vae, self.arch, latents)
            (image.float() / 2 + 0.5).clamp(0, 1)

    def copy_forward(self, which: str) -> torch.Tensor:
        """A forward without gradients of the old policy (LoRA: its own adapter; same cost) or the reference
        (LoRA: adapters disabled, as ``FlowModel.reference``; full fine-tuning: a frozen copy, same cost), or a
        guided teacher's (:meth:`flowrl.estimate.teacher.TeacherPrice.update_copy`: ``teacher`` as the reference,
        ``teacher_loaded`` a loaded copy with its adapters; ``+cfg``: at its CFG, 2 rows per state, else 1)."""
        kind, _, guided = which.partition("+")
        cfg_rows = guided == "cfg" if kind.startswith("teacher") else self.cfg_rows
        off = kind in ("reference", "teacher") and self.lora is not None
        if off:
            self.module.disable_adapters()
        try:
            with torch.no_grad(), self.region(cache=False):  # a frozen copy's weights: not cached (no grad)
                return velocity(self.module, self.arch, self.shapes, self.states, cfg_rows, self.inputs)
        finally:
            if off:
                self.module.enable_adapters()

    def _autocast_checkpoint(self, run, *args):
        """A block's checkpointed forward inside the autocast region (:meth:`MetaAutocast.checkpoint`)."""
        return self.autocast.checkpoint(run, *args)

    def update_step(self) -> None:
        # the objective's own latent-sized fp32 tensors of the micro-batch: a policy objective's parent and child
        # states and transition mean; a forward-process objective's x0, ε, x_t and target y
        latents = [
            torch.empty(self.states, *self.shapes.latent, dtype=torch.float32, device="meta")
            for _ in range(3 if not self.before else 4)
        ]
        copies = [self.copy_forward(which) for which in self.before]
        with self.region():
            v = velocity(self.module, self.arch, self.shapes, self.states, self.cfg_rows, self.inputs)
        copies += [self.copy_forward(which) for which in self.after]
        loss = (v - torch.empty_like(v)).pow(2).mean()  # the objective's few latent-sized fp32 terms
        for h in copies:
            loss = loss + (v.detach() - h).pow(2).mean()
        del v, copies
        loss.backward()
        del latents

    def sampling(self, states: int, cfg_on: bool, explore: bool) -> dict[str, Trace]:
        """``rollout``, ``explore`` (the LoRA merged, an explorer copy's cost) and ``decode`` of ``states``."""
        self.states, self.cfg_rows = states, cfg_on
        out: dict[str, Trace] = {}
        self.module.eval()
        out["rollout"] = out["explore"] = trace(self.rollout_forward, self.target)
        if explore and self.lora is not None:
            self.module.disable_adapters()
            try:
                out["explore"] = trace(self.rollout_forward, self.target)
            finally:
                self.module.enable_adapters()
        out["decode"] = trace(self.decode, self.target)
        return out

    def update(self, states: int, train_cfg: bool, before: tuple, after: tuple, checkpointed: int | None) -> Trace:
        """One training micro-batch of ``states`` with the first ``checkpointed`` blocks checkpointed (0: none)."""
        self.states, self.cfg_rows, self.before, self.after = states, train_cfg, before, after
        self.module.train()
        for p in self.trainable:  # gradients exist from the first micro-batch on: the estimate adds them to the phase
            p.grad = torch.zeros_like(p)
        handles = [p.register_post_accumulate_grad_hook(_drop_gradient) for p in self.trainable] if self.sharded else []
        try:
            checkpoint_blocks(
                self.module, checkpointed, self._autocast_checkpoint if self.autocast is not None else None
            )
            return trace(self.update_step, self.target)
        finally:
            for handle in handles:
                handle.remove()
            checkpoint_blocks(self.module, 0)
            for p in self.trainable:
                p.grad = None
            self.module.eval()


def _trace_optimizer(params: list[nn.Parameter], target: str) -> Trace:
    """Transient bytes of one clipped AdamW step over ``params`` (state allocated by an untraced first step;
    foreach as CUDA runs it, the per-tensor loop as a CPU runs it)."""
    if not params:
        return Trace(0, 0, 0)
    for p in params:
        p.grad = torch.zeros_like(p)
    opt = torch.optim.AdamW(params, lr=1e-4, weight_decay=1e-4, foreach=target == "cuda")
    opt.step()

    def step() -> None:
        torch.nn.utils.clip_grad_norm_(params, 1.0)  # per-tensor norms: small either way
        opt.step()

    try:
        return trace(step, target)
    finally:
        opt.state.clear()
        for p in params:
            p.grad = None
