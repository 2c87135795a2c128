"""The estimate prices a forward-process objective's guided teacher (``loss.teacher``; flowrl/estimate/teacher.py,
docs/estimate.md "A guided teacher"): its frozen copy (the ``teacher`` memory part: shared with a KL reference, none
under LoRA), its anchor's no-grad forwards in the update, its sampled chains in the rollout, and the async rollout
process that holds only what sampling needs (its own teacher copy, no old copy, no KL reference)."""

from __future__ import annotations

import pytest

from flowrl import estimate as E
from flowrl.estimate.pipeline import ROLLOUT_PARTS, ROLLOUT_PHASES
from flowrl.paths import CONFIG_DIR

MAIN = str(CONFIG_DIR / "shapes" / "nft.yaml")  # the main job: full fine-tuning, teacher guidance 3, anchor 1
RAFT = str(CONFIG_DIR / "shapes" / "raft.yaml")  # the teacher samples every chain (teacher_share = group_size)
_CACHE: dict[tuple, dict] = {}


def estimate_of(path: str = MAIN, *overrides: str) -> dict:
    key = (path, overrides)
    if key not in _CACHE:
        _CACHE[key] = E.estimate(E.load_config(path, list(overrides), "H100"))
    return _CACHE[key]


def test_the_main_jobs_teacher_is_a_full_copy_held_by_the_trainer():
    est, plain = estimate_of(), estimate_of(MAIN, "loss.teacher=null")
    mem, without = est["memory_gib"], plain["memory_gib"]
    full_copy = mem["transformer_weights"] + mem["transformer_buffers"]  # the fp32 transformer, as a KL reference
    assert mem["teacher"] == pytest.approx(full_copy) and mem["teacher"] > 0
    assert mem["teacher"] == pytest.approx(
        estimate_of(MAIN, "loss.kl_ref=0.1", "loss.teacher=null")["memory_gib"]["reference"]
    )
    assert without["teacher"] == 0
    assert mem["static"] - without["static"] == pytest.approx(mem["teacher"])  # in the trainer's static memory
    assert mem["peak"] > without["peak"]
    assert "teacher (loss.teacher's frozen copy)" in E.format_estimate(est)


def test_the_anchor_adds_a_guided_no_grad_forward_per_training_row_to_the_update():
    est, plain = estimate_of(), estimate_of(MAIN, "loss.teacher=null")
    fl, counts = est["flops"], est["counts"]
    assert counts["train_rows"] == plain["counts"]["train_rows"] and counts["teacher_forwards"] == 0
    # guidance 3: two rows (unconditional and conditional) per training row, every inner epoch, at the per-row FLOPs
    # of the forwards the estimate already counts
    teacher = counts["train_rows"] * 2 * fl["per_rollout_row"] * counts["inner_epochs"]
    assert fl["update"] - plain["flops"]["update"] == pytest.approx(teacher, rel=1e-6)
    assert fl["teacher_update"] == pytest.approx(teacher, rel=1e-6) and plain["flops"]["teacher_update"] == 0
    assert fl["rollout"] == plain["flops"]["rollout"] and fl["teacher_rollout"] == 0
    split, before = est["time"]["split_seconds"]["update"], plain["time"]["split_seconds"]["update"]
    assert split[0] > before[0] and split[1] > before[1]
    # anchor 0: the teacher only samples (here: nothing), so the update runs no teacher forward
    idle = estimate_of(MAIN, "loss.teacher.anchor=0")
    assert idle["flops"]["update"] == pytest.approx(plain["flops"]["update"]) and idle["flops"]["teacher_update"] == 0
    # guidance 1: one row per training row
    unguided = estimate_of(MAIN, "loss.teacher.guidance=1.0")
    assert unguided["flops"]["update"] - plain["flops"]["update"] == pytest.approx(teacher / 2, rel=1e-6)


def test_with_a_kl_reference_the_teacher_shares_its_copy():
    shared = estimate_of(MAIN, "loss.kl_ref=0.1")
    mem = shared["memory_gib"]
    assert mem["teacher"] == 0 and mem["reference"] > 0
    assert mem["static"] == pytest.approx(
        estimate_of(MAIN, "loss.kl_ref=0.1", "loss.teacher=null")["memory_gib"]["static"]
    )
    assert mem["teacher_own_copy"] == 0  # a rollout process builds no teacher: the main job's plan lets none draw
    drawn = estimate_of(MAIN, "loss.kl_ref=0.1", "rollout.teacher_share=2")["memory_gib"]
    assert drawn["teacher_own_copy"] == pytest.approx(drawn["reference"])  # what a rollout process holds instead


def test_under_lora_the_initial_teacher_costs_nothing_and_a_loaded_one_a_copy(tmp_path):
    lora = estimate_of(MAIN, "model.full_finetune=false")
    mem = lora["memory_gib"]
    assert mem["teacher"] == 0 and mem["teacher_own_copy"] == 0 and mem["lora"] > 0
    loaded = estimate_of(MAIN, "model.full_finetune=false", f"loss.teacher.path={tmp_path}", "rollout.teacher_share=2")[
        "memory_gib"
    ]
    # a loaded copy: a deep copy of the trainable module, the transformer with its LoRA layers
    whole = loaded["transformer_weights"] + loaded["transformer_buffers"] + loaded["lora"]
    assert loaded["teacher"] == pytest.approx(whole) and loaded["teacher_own_copy"] == pytest.approx(whole)
    # a loaded teacher shares nothing, even with a KL reference
    with_ref = estimate_of(MAIN, f"loss.teacher.path={tmp_path}", "loss.kl_ref=0.1")["memory_gib"]
    assert with_ref["teacher"] == pytest.approx(with_ref["reference"]) and with_ref["teacher"] > 0


def test_the_teachers_sampled_chains_cost_its_cfg_rows():
    share = estimate_of(MAIN, "rollout.teacher_share=2")
    fl, counts = share["flops"], share["counts"]
    P, steps = share["counts"]["prompts_per_process"], 10
    assert counts["teacher_forwards"] == P * 2 * steps
    policy = counts["forwards"] - counts["teacher_forwards"]  # at guidance 1: one row per state
    expected = policy * fl["per_rollout_row"] + counts["teacher_forwards"] * 2 * fl["per_rollout_row"]
    assert fl["rollout"] == pytest.approx(expected, rel=1e-6)
    assert fl["teacher_rollout"] == pytest.approx(counts["teacher_forwards"] * 2 * fl["per_rollout_row"], rel=1e-6)
    # its forwards at CFG hold twice the rows: the rollout phase is the larger of the two
    assert share["memory_gib"]["activations_rollout"] > estimate_of()["memory_gib"]["activations_rollout"]
    raft = estimate_of(RAFT)  # every chain the teacher's: the whole rollout at its CFG
    assert raft["flops"]["rollout"] == pytest.approx(raft["counts"]["forwards"] * 2 * raft["flops"]["per_rollout_row"])
    assert raft["flops"]["teacher_rollout"] == pytest.approx(raft["flops"]["rollout"])


def _rollout_peak(est: dict) -> float:
    mem = est["memory_gib"]
    return sum(mem[k] for k in ROLLOUT_PARTS) + max(mem["phases"].get(k, 0.0) for k in ROLLOUT_PHASES)


@pytest.mark.parametrize(
    "overrides",
    [
        (),
        ("loss.kl_ref=0.1", "rollout.teacher_share=2"),
        ("model.full_finetune=false", "rollout.teacher_share=2"),
        ("loss.teacher=null",),
    ],
    ids=["main", "kl-ref-drawn", "lora-drawn", "no-teacher"],
)
def test_the_async_rollout_process_holds_what_sampling_needs(overrides):
    est = estimate_of(MAIN, "train.pipeline=async", *overrides)
    p, mem = est["pipeline"], est["memory_gib"]
    parts = p["rollout_process_parts"]
    assert "old_policy" not in parts and "reference" not in parts and "gradients" not in parts
    assert p["rollout_process_peak_gib"] == pytest.approx(_rollout_peak(est))
    # its teacher when the plan lets it draw: its own copy (no KL reference on the rollout side to share)
    full_copy = mem["transformer_weights"] + mem["transformer_buffers"]
    drawn = "rollout.teacher_share=2" in overrides and "model.full_finetune=false" not in overrides
    own = full_copy if drawn else 0
    assert parts["teacher_own_copy"] == pytest.approx(own)
    # neither the old copy (the main job keeps one) nor the KL reference is in its peak
    assert mem["old_policy"] > 0
    held = sum(parts.values()) + mem["old_policy"] + mem["reference"]
    assert p["rollout_process_peak_gib"] < held + max(mem["phases"][k] for k in ROLLOUT_PHASES)


def _copy_bytes(module) -> int:
    if module is None:
        return 0
    tensors = [*module.parameters(), *(b for b in module.buffers() if b.is_floating_point())]
    return sum(t.untyped_storage().nbytes() for t in tensors)


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_the_teacher_bytes_are_what_the_trainer_and_the_rollout_process_set_up(lora):
    """On the tiny SD3 pipeline with a KL reference: the trainer's ``setup`` shares the reference's copy (``teacher``
    0), a rollout process's ``setup_sampling`` builds the teacher on a copy of its own (``teacher_own_copy``: the
    fp32 transformer under full fine-tuning, nothing under LoRA) and neither the old copy nor the reference."""
    import torch

    from flowrl.config import build
    from flowrl.config.schema import TrainConfig
    from flowrl.models import wrap
    from flowrl.models.testing import tiny_sd3_pipeline
    from flowrl.training.trainable import setup_trainable

    cfg = TrainConfig.from_yaml(
        None,
        [
            "model.family=sd3",
            "model.path=in-memory",
            "model.guidance=1",
            "model.height=64",
            "model.width=64",
            "model.max_sequence_length=16",
            f"model.full_finetune={str(not lora).lower()}",
            "prompts.train=a red circle|a blue square",
            "prompts.eval=null",
            "prompts.per_step=2",
            "rewards=[{name: brightness}]",
            "rollout.plan=ode",
            "rollout.group_size=4",
            "rollout.steps=4",
            "loss.objective=nft",
            "loss.kl_ref=0.1",
            "loss.teacher={guidance: 3.0, anchor: 1.0}",
            "rollout.teacher_share=2",
        ],
    )
    pipe = tiny_sd3_pipeline(sample_size=32)
    mem = E.estimate(cfg, arch=E.arch_from_pipeline(pipe), target="cpu")["memory_gib"]

    def built(sampling: bool):
        model = wrap(
            tiny_sd3_pipeline(sample_size=32), device="cpu", dtype=torch.float32, guidance=1.0, height=64, width=64
        )
        setup_trainable(model, cfg.model, cfg.train.seed)
        objective = build.build_loss(cfg)
        if sampling:
            objective.setup_sampling(model, draws_teacher=True)
        else:
            objective.setup(model)
        return objective

    trainer, side = built(False), built(True)
    assert trainer.teacher_model._copy is trainer._reference  # one frozen copy serves both
    assert mem["teacher"] == 0
    assert side._old is None and side._reference is None
    own = _copy_bytes(side.teacher_model._copy.frozen)
    assert (own > 0) == (not lora)
    assert mem["teacher_own_copy"] * 2**30 == pytest.approx(own, rel=0.05)
