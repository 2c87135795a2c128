"""Dynamic loss scaling when the transformer computes in fp16 (``optim.loss_scaling``, flowrl/training/updater.py).

A log-prob is a mean over latent elements, so the gradient reaching each activation is ~1/N of the loss's:
in fp16 it falls below the smallest normal number and is truncated. The updater scales the loss (torch's
``GradScaler``), unscales before clipping, treats an overflow of a finite loss as a skipped step that halves
the scale (not as a failure), and checkpoints the scale.
"""

from __future__ import annotations

import functools

import pytest
import torch

from flowrl.training.trainer import Trainer
from tests.test_low_precision import low_config, low_model, metrics, trained


def gradient_error(tmp_path, *extra: str) -> float:
    """Relative error of the fp16 model's gradient against the fp32 model's, on the same forest (rolled out
    by the fp16 model) and the same LoRA initialisation."""
    torch.manual_seed(0)
    half = Trainer(
        low_config(tmp_path, "half", "sd3", "float16", "rollout.group_size=4", *extra),
        model=low_model("sd3", torch.float16),
    )
    full = Trainer(low_config(tmp_path, "full", "sd3", "float32", "rollout.group_size=4"), model=low_model("sd3", None))
    forest, _ = half.rollout(0)
    half.credit.assign(forest)
    g_half, g_full = half.updater.gradient(forest, 0), full.updater.gradient(forest, 0)
    assert float(g_full.norm()) > 0
    return float((g_half - g_full).norm() / g_full.norm())


def test_fp16_gradients_match_fp32_with_loss_scaling(tmp_path):
    scaled = gradient_error(tmp_path / "a")  # auto: on, the transformer computes in fp16
    unscaled = gradient_error(tmp_path / "b", "optim.loss_scaling=false")
    assert scaled < 0.005, scaled  # measured 0.0011
    assert unscaled > 5 * scaled, (unscaled, scaled)  # measured 0.022: truncated gradients, even on a tiny latent


def test_scaler_is_on_for_fp16_only(tmp_path):
    on = {
        dtype: Trainer(low_config(tmp_path, dtype, "sd3", dtype), model=low_model("sd3", dtype_of(dtype))).updater
        for dtype in ("float16", "bfloat16", "float32")
    }
    assert on["float16"].scaler.is_enabled() and not on["bfloat16"].scaler.is_enabled()
    assert not on["float32"].scaler.is_enabled()
    forced = Trainer(
        low_config(tmp_path, "forced", "sd3", "float32", "optim.loss_scaling=true"), model=low_model("sd3", None)
    )
    assert forced.updater.scaler.is_enabled()


def dtype_of(name: str) -> torch.dtype | None:
    return None if name == "float32" else getattr(torch, name)


def test_overflows_halve_the_scale_skip_the_step_and_resume_exactly(tmp_path, monkeypatch):
    """A scale far too high (2^30) overflows the fp16 backward: each such step is skipped and halves the
    scale, the run does not stop (three non-finite steps in a row stop a run when the loss itself is not
    finite; here six overflows come before the first step that fits), the weights stay
    finite, and 2 iterations + resume to 6 equal 6 straight iterations (the scale is checkpointed)."""
    monkeypatch.setattr(
        torch.amp, "GradScaler", functools.partial(torch.amp.GradScaler, init_scale=2.0**30, growth_interval=1)
    )
    extra = ("train.updates_per_epoch=2", "train.ema=0")
    straight = Trainer(
        low_config(tmp_path, "straight", "sd3", "float16", "train.max_steps=6", *extra),
        model=low_model("sd3", torch.float16),
    )
    records = straight.train()
    overflows = [r["loss_scale_overflows"] for r in records]
    assert sum(overflows) >= 4 and records[0]["skipped_steps"] == 2  # both steps of iteration 1 overflowed
    scales = [r["loss_scale"] for r in records]
    assert scales[0] == 2.0**28 and min(scales) <= 2.0**25  # measured: 2^24 fits this model's gradients
    assert any(r["skipped_steps"] < 2 for r in records)  # once the scale fits, steps are taken
    weights = trained(straight)
    assert all(torch.isfinite(w).all() for w in weights.values())

    first = Trainer(
        low_config(tmp_path, "resumed", "sd3", "float16", "train.max_steps=2", *extra),
        model=low_model("sd3", torch.float16),
    )
    first.train()
    second = Trainer(
        low_config(tmp_path, "resumed", "sd3", "float16", "train.max_steps=6", "train.resume=latest", *extra),
        model=low_model("sd3", torch.float16),
    )
    second.train()
    a, b = metrics(tmp_path / "straight"), metrics(tmp_path / "resumed")
    assert [r["loss_scale"] for r in a] == [r["loss_scale"] for r in b]
    assert [r["policy_loss"] for r in a] == [r["policy_loss"] for r in b]
    resumed = trained(second)
    for k in weights:
        assert torch.equal(weights[k], resumed[k]), k


def test_a_non_finite_loss_still_stops_the_run_under_loss_scaling(tmp_path):
    trainer = Trainer(
        low_config(tmp_path, "nan", "sd3", "float16", "train.max_steps=4"), model=low_model("sd3", torch.float16)
    )
    loss = trainer.objective.loss
    trainer.objective.loss = lambda *a, **k: (lambda out: (out[0] * float("nan"), out[1]))(loss(*a, **k))
    with pytest.raises(FloatingPointError, match="non-finite"):
        trainer.train()


def test_a_non_finite_loss_keeps_the_scale(tmp_path):
    """The failure is the loss's, not the scale's: three NaN losses stop the run with the scale untouched
    (halving it would leave fp16 gradients truncated for thousands of steps after a transient NaN)."""
    trainer = Trainer(
        low_config(tmp_path, "keep", "sd3", "float16", "train.max_steps=4"), model=low_model("sd3", torch.float16)
    )
    start = trainer.updater.scaler.get_scale()
    loss = trainer.objective.loss
    trainer.objective.loss = lambda *a, **k: (lambda out: (out[0] * float("nan"), out[1]))(loss(*a, **k))
    with pytest.raises(FloatingPointError):
        trainer.train()
    assert trainer.updater.scaler.get_scale() == start and trainer.updater.overflows == 0


def test_a_non_finite_auxiliary_loss_is_a_failure_not_an_overflow(tmp_path):
    trainer = Trainer(
        low_config(tmp_path, "aux", "sd3", "float16", "train.max_steps=4"), model=low_model("sd3", torch.float16)
    )
    params = trainer.updater.params
    trainer.objective.auxiliary = lambda *a: (sum(p.float().sum() for p in params) * float("nan"), {})
    with pytest.raises(FloatingPointError, match="3 optimizer steps in a row"):
        trainer.train()
    assert trainer.updater.overflows == 0


def test_overflows_in_a_row_end_up_counting_as_failures(tmp_path):
    """A gradient that is NaN whatever the scale (a finite loss, a broken backward) is first taken for an
    overflow; after ``MAX_OVERFLOW_STREAK`` of them in a row the next ones count, and the run stops instead of
    halving the scale for ever."""
    trainer = Trainer(
        low_config(tmp_path, "streak", "sd3", "float16", "train.max_steps=10"), model=low_model("sd3", torch.float16)
    )
    trainer.updater.MAX_OVERFLOW_STREAK = 2
    for p in trainer.updater.params:
        p.register_hook(lambda g: g * float("nan"))
    with pytest.raises(FloatingPointError, match="iteration 4"):  # 0-based: 2 overflows, then 3 failures
        trainer.train()
    assert trainer.updater.overflows == 2
