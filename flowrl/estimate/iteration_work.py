"""The work of one iteration (:func:`~flowrl.estimate.iteration.estimate`'s parts but its memory): the preset's
shapes and guidance, the work per process (from what the plan and the objective declare), the traced phases, and the
FLOPs and time; the adapters' defaults of the sequence length and guidance (:data:`SEQ_DEFAULT`,
:data:`GUIDANCE_DEFAULT`)."""

from __future__ import annotations

from collections.abc import Mapping

from flowrl.errors import ConfigError
from flowrl.estimate.counts import iteration_counts
from flowrl.estimate.gpus import UTILISATION, GPUClass
from flowrl.estimate.inputs import Shapes, preset_shapes, with_sources
from flowrl.estimate.iteration_memory import checkpointed_blocks
from flowrl.estimate.phases import phase_traces, teacher_rollout_trace
from flowrl.estimate.teacher import teacher_of
from flowrl.models import MODEL_FAMILIES, model_family
from flowrl.models.estimate_spec import adapter_default, adapter_spec, estimate_spec


class AdapterDefaults(Mapping):
    """Family → the default of one keyword of its adapter's constructor (read from its signature, or the spec's
    ``defaults`` where that says None: :func:`flowrl.models.estimate_spec.adapter_default`), for every registered
    family whose adapter declares an estimate spec."""

    def __init__(self, keyword: str):
        self.keyword = keyword

    def __getitem__(self, family: str):
        return adapter_default(family, self.keyword)

    def _families(self) -> list[str]:
        return [f for f in MODEL_FAMILIES if adapter_spec(model_family(f).adapter_class()) is not None]

    def __iter__(self):
        return iter(self._families())

    def __len__(self) -> int:
        return len(self._families())


SEQ_DEFAULT = AdapterDefaults("max_sequence_length")
"""``max_sequence_length`` when neither the config nor the architecture sets it: the adapter's default."""
GUIDANCE_DEFAULT = AdapterDefaults("guidance")
"""``guidance`` when the config sets none: the adapter's default (Qwen-Image: true_cfg_scale, 2.1: none; FLUX/FLUX.2:
the distilled embedding)."""


def shapes_and_guidance(cfg, arch: dict, objective) -> tuple[Shapes, int | None, float, bool]:
    """The preset's sizes (image, latent, tokens), a video family's frames (None for images), the rollouts' guidance
    and whether they run CFG (a guidance-distilled family: FLUX's true CFG only)."""
    m, family = cfg.model, arch["family"]
    defaults = arch.get("defaults", {})
    height = int(m.height or defaults.get("height") or default_size(arch))
    width = int(m.width or defaults.get("width") or default_size(arch))
    max_seq = int(m.max_sequence_length or defaults.get("max_sequence_length") or SEQ_DEFAULT[family])
    video = model_family(family).adapter_class().modality == "video"  # as the family declares it
    frames = int(m.kwargs.get("num_frames") or defaults.get("num_frames", 81)) if video else None
    shapes = preset_shapes(with_sources(arch, m.kwargs), height, width, max_seq, frames)
    guidance_default = defaults.get("guidance_scale", GUIDANCE_DEFAULT[family])
    rollout_guidance = objective.describe().rollout_guidance(m.guidance)
    guidance = float(guidance_default if rollout_guidance is None else rollout_guidance)
    return shapes, frames, guidance, runs_cfg(cfg, family, guidance)


def default_size(arch: dict) -> int:
    """The image side in pixels an architecture samples at when neither the config nor its defaults say: its text
    config's ``default_image_size``, else the transformer's ``sample_size`` (64) × the VAE's scale factor."""
    px = arch["text"].get("default_image_size")
    if px:
        return int(px)
    scale = arch["vae"].get("scale_factor")
    if scale is None:
        raise ConfigError(
            "model.height and model.width are not set and this architecture gives no default size (its VAE's scale "
            "factor is unknown); set both"
        )
    return int(arch["transformer"]["config"].get("sample_size") or 64) * int(scale)


def runs_cfg(cfg, family: str, guidance: float) -> bool:
    """Whether a forward of ``family`` at ``guidance`` runs CFG (two rows per state): a guidance value that is an
    embedding (FLUX, FLUX.2) runs it only as FLUX's true CFG (``model.true_cfg``)."""
    kind = estimate_spec(family).guidance
    if kind != "cfg":  # the guidance value is an embedding: FLUX's CFG is true_cfg, FLUX.2's none
        return kind == "true_cfg" and float(cfg.model.true_cfg or 1.0) != 1.0
    return float(guidance) != 1.0


def iteration_work(cfg, plan, objective, P: int, cfg_on: bool, family: str) -> dict:
    """One iteration's work per process (:func:`iteration_counts`), the states one rollout forward and one traced
    update hold (a policy objective replays ``max_batch`` states; a forward-process one whole leaves' points) and the
    objective's guided teacher (:func:`~flowrl.estimate.teacher.teacher_of`; None without one)."""
    counts = iteration_counts(plan, objective, P, cfg.train.max_steps, cfg.train.seed)
    max_batch = int(cfg.rollout.max_batch)
    facts = objective.describe()
    per_unit = facts.rows_per_unit
    update_states = max(1, int(facts.micro_batch) // per_unit) * per_unit  # train.micro_batch or max_batch
    return {
        "counts": counts,
        "train_cfg": facts.training_cfg(cfg_on),
        "update_states": max(1, min(update_states, int(max(counts["train_rows"], 1)))),
        "rollout_states": max(1, min(max_batch, int(max(counts["forwards"], 1)))),
        "teacher": teacher_of(facts, lambda guidance: runs_cfg(cfg, family, guidance)),
    }


def traced_phases(
    cfg, arch: dict, model: dict, objective, shapes: Shapes, work: dict, cfg_on: bool, target: str, shards: int
) -> dict:
    """The traced phases (cached: presets sharing a model, shapes and batch layout share them). The objective's frozen
    copies run before the policy's forward in a forward-process update (its guided teacher's forward after them, when
    the update reads it), the reference after it in a replay; ``teacher_rollout``: a rollout forward at the teacher's
    CFG, when the teacher samples chains and its CFG is not the rollout's."""
    facts, teacher = objective.describe(), work["teacher"]
    anchor = teacher.update_copy() if teacher is not None else None
    copies, policy = facts.frozen_copies + ((anchor,) if anchor else ()), facts.trains_on == "edges"
    before = () if policy else copies
    after = copies if policy else ()
    trace_args = (
        arch["key"],
        cfg.model.dtype,
        model["lora"],
        shapes,
        work["rollout_states"],
        cfg_on,
        work["update_states"],
        work["train_cfg"],
        before,
        after,
        bool(work["counts"]["explore_forwards"]),
        bool(cfg.optim.use_8bit),
        target,
    )
    # FSDP2: the weights gathered in model.dtype, a block's gradients reduce-scattered and freed as backward leaves
    # it (fsdp["update"] below)
    traces = phase_traces(*trace_args, shards > 1, checkpointed_blocks(cfg, model))
    traces["updates"] = {False: traces["update"], True: traces["update_checkpointed"]}
    if teacher is not None and work["counts"]["teacher_forwards"] and teacher.cfg != cfg_on:
        traces["teacher_rollout"] = teacher_rollout_trace(*trace_args[:5], teacher.cfg, target, shards > 1)
    return traces


def flops_and_time(cfg, plan, gpu_spec: GPUClass, traces: dict, work: dict, cfg_on: bool) -> dict:
    """FLOPs per phase from the traced forwards and the iteration's counts, and seconds per iteration at the assumed
    utilisation range of the GPU's bf16 peak (an fp8 explorer previews faster). A guided teacher's sampled chains
    (``teacher_forwards``) run at its CFG; its anchor's forwards are in the traced update."""
    counts, rollout_states = work["counts"], work["rollout_states"]
    cfg_rows = 2 if cfg_on else 1
    f_row = traces["rollout"].flops / (rollout_states * cfg_rows)
    f_explore_row = traces["explore"].flops / (rollout_states * cfg_rows)
    f_decode = traces["decode"].flops / rollout_states
    upd = traces["updates"][bool(cfg.model.gradient_checkpointing)]
    train_rows_per_trace = work["update_states"] * (2 if work["train_cfg"] else 1)
    f_train_row = upd.flops / train_rows_per_trace
    teacher = work["teacher"]
    t_rows, sampled = (teacher.rows, counts["teacher_forwards"]) if teacher is not None else (1, 0)
    t_trace = traces.get("teacher_rollout", traces["rollout"])  # the teacher's rollout forward at its own CFG
    f_teacher_row = t_trace.flops / (rollout_states * t_rows)
    flops = {
        "rollout": (counts["forwards"] - sampled) * cfg_rows * f_row + sampled * t_rows * f_teacher_row,
        "explore": counts["explore_forwards"] * cfg_rows * f_explore_row,
        "decode": counts["decodes"] * f_decode,
        "update": counts["train_rows"] * (2 if work["train_cfg"] else 1) * f_train_row * int(cfg.train.inner_epochs),
    }
    anchor_rows = counts["train_rows"] if teacher is not None and teacher.anchor else 0
    speed = {k: 1.0 for k in flops}
    if (plan.explorer_spec() or ("same",))[0] == "fp8":
        speed["explore"] = gpu_spec.fp8_speedup
    effective = sum(flops[k] / speed[k] for k in flops)
    peak_flops = gpu_spec.peak_tflops * 1e12  # the one table of peaks: perf/mfu divides by the same
    seconds = [effective / (peak_flops * UTILISATION[1]), effective / (peak_flops * UTILISATION[0])]
    split = {k: [flops[k] / speed[k] / (peak_flops * u) for u in (UTILISATION[1], UTILISATION[0])] for k in flops}
    return {
        "flops": {
            **flops,
            "total": sum(flops.values()),
            "per_rollout_row": f_row,
            "per_update_row": f_train_row,
            "per_decode": f_decode,
            # of the rollout's and the update's: the teacher's sampled chains and its anchor (no-grad forwards of
            # every training row at its CFG, priced at the rollout's FLOPs per row)
            "teacher_rollout": sampled * t_rows * f_teacher_row,
            "teacher_update": anchor_rows * t_rows * f_row * int(cfg.train.inner_epochs),
        },
        "time": {
            "seconds_per_iteration": seconds,
            "split_seconds": split,
            "gpu_bf16_tflops": gpu_spec.peak_tflops,
            "peak_source": gpu_spec.peak_source,
            "utilisation": list(UTILISATION),
            "explorer_speedup": speed["explore"],
        },
    }
