"""``train.fit: auto`` (flowrl/estimate/fit.py): settings chosen from the estimate within the memory budget, kept
keys winning, a config that cannot fit refused with remedies; ``perf/tflops`` and ``perf/mfu``; ``flowrl bench
--estimate --json``."""

from __future__ import annotations

import json

import pytest

from flowrl.commands.main import main
from flowrl.errors import ConfigError
from flowrl.estimate import estimate, load_config
from flowrl.estimate.fit import fit_config, settings_of
from flowrl.estimate.gpus import GPUS, gpu_class_of_device

GPU_PRESETS = [
    "configs/sd35/flow_grpo_pickscore.yaml",
    "configs/sd35/nft_geneval.yaml",
    "configs/flux/nft_pickscore.yaml",
    "configs/flux/dance_grpo_hps.yaml",
    "configs/sana/solrl.yaml",
    "configs/qwen_image/nft_geneval.yaml",
    "configs/wan/flow_grpo_1_3b.yaml",
]
"""One GPU preset per family and kind of objective (policy replay, forward process, explorer; image and video):
the presets of scripts/fit_table.py (docs/gpu.md); the others differ from one of these in keys fit does not read."""


def _within(fit) -> None:
    """The fitted config's own estimate is within the budget (the check the fit made, made again)."""
    again = estimate(fit.config, gpu="H100")["memory_gib"]["peak"]
    assert again == pytest.approx(fit.peak_gib) and again <= fit.budget_gib


def test_fit_fills_the_budget_with_batches_before_checkpointing():
    cfg = load_config(None, [])  # the main job (NFT, full fine-tuning of the shapes model)
    n = estimate(cfg)["shapes"]["blocks"]
    roomy, tight, tighter = (fit_config(cfg, "H100", capacity_gib=c) for c in (0.5, 0.25, 0.15))
    for fit in (roomy, tight, tighter):
        _within(fit)
        assert fit.settings["rollout.max_batch"] == 64  # every state of a step in one forward: the rollout is cheap
    # a roomy budget: the update's batch doubled, a part of the blocks checkpointed to afford it
    assert roomy.settings["train.micro_batch"] == 128
    assert 0 < roomy.settings["model.checkpoint_blocks"] < n
    assert roomy.changed["train.micro_batch"] == (None, 128)
    # tighter budgets checkpoint every block, then halve the update's batch
    assert tight.settings["model.gradient_checkpointing"] and tight.settings["model.checkpoint_blocks"] is None
    assert tighter.settings["train.micro_batch"] < tight.settings["train.micro_batch"]
    assert not any(f.settings["model.offload_encoders"] for f in (roomy, tight, tighter))  # not needed here
    lines = roomy.summary()
    assert "predicted peak" in lines[0] and any(
        "train.micro_batch = 128" in line and "chosen" in line for line in lines
    )


def test_explicit_keys_win_and_are_said_to():
    cfg = load_config(None, ["train.fit=auto", "train.fit_keep=[model.gradient_checkpointing]"])
    fit = fit_config(cfg, "H100", capacity_gib=0.5, keep=["rollout.max_batch"])
    assert fit.settings["rollout.max_batch"] == cfg.rollout.max_batch
    assert fit.settings["model.gradient_checkpointing"] is False  # as the config sets it: no block checkpointed
    assert fit.kept == ["model.gradient_checkpointing", "rollout.max_batch"]
    assert sum("set explicitly: it wins" in line for line in fit.summary()) == 2
    _within(fit)


def test_a_policy_objective_fits_one_batch_for_rollout_and_replay():
    cfg = load_config("configs/shapes/grpo.yaml", [])
    fit = fit_config(cfg, "H100", capacity_gib=0.3)
    assert fit.settings["train.micro_batch"] is None  # the replay follows the rollout's forwards
    _within(fit)
    with pytest.raises(ConfigError, match="train.micro_batch=3.*replays the rollout's edges"):
        load_config("configs/shapes/grpo.yaml", ["train.micro_batch=3"])


def test_a_config_that_cannot_fit_is_refused_with_its_peak_the_capacity_and_remedies():
    cfg = load_config(None, [])
    with pytest.raises(ConfigError) as e:
        fit_config(cfg, "4090", capacity_gib=0.03)
    text = str(e.value)
    assert "cannot fit GeForce RTX 4090" in text and "least-memory settings" in text
    assert "train.memory_fraction=0.9" in text and "30.72 MiB" in text  # the capacity
    assert "model.full_finetune=false (LoRA)" in text and "model.shard=fsdp over 2 GPUs" in text and "(fits)" in text


@pytest.mark.parametrize(
    "name,key",
    [
        ("NVIDIA H200", "H200"),
        ("NVIDIA H100 80GB HBM3", "H100"),
        ("NVIDIA GeForce RTX 4090", "4090"),
        ("NVIDIA A100-SXM4-80GB", "A100"),
        ("NVIDIA L40S", "L40S"),
        ("Tesla T4", None),
    ],
)
def test_a_cuda_device_is_matched_to_its_gpu_class(name, key):
    assert gpu_class_of_device(name) == key


def test_mfu_is_against_the_measured_peak_where_known():
    assert GPUS["H200"].peak_tflops == 788.0 and GPUS["A100"].peak_tflops == GPUS["A100"].bf16_tflops


def test_perf_tflops_is_the_estimates_flops_over_the_iteration_time(tmp_path):
    from flowrl.estimate.device import perf_meter
    from flowrl.training.perf import PerfMeter
    from flowrl.training.trainer import Trainer
    from tests.conftest import make_model
    from tests.test_trainer import tiny_config

    cfg = tiny_config(tmp_path, "perf", "prompts.eval=null", "train.max_steps=2", "train.peak_tflops=2.5")
    model = make_model("sd3")
    from flowrl.estimate import arch_from_pipeline

    meter = perf_meter(cfg, arch=arch_from_pipeline(model.pipe))
    flops = estimate(cfg, arch=arch_from_pipeline(model.pipe), target="cpu")["flops"]["total"]
    assert meter == PerfMeter(flops, 2.5)
    records = Trainer(cfg, model=model, perf=meter).train()
    for r in records:
        assert r["perf/tflops"] == pytest.approx(flops / r["time/iteration"] / 1e12, rel=1e-12)
        assert r["perf/mfu"] == pytest.approx(r["perf/tflops"] / 2.5, rel=1e-12)
    cfg.train.peak_tflops = None
    assert perf_meter(cfg, flops).peak_tflops is None  # a CPU has no peak in the table: perf/tflops only


def test_bench_estimate_json_is_one_object_with_the_fit(capsys):
    assert main(["bench", "--estimate", "--json", "--gpu", "4090"]) == 0
    plain = json.loads(capsys.readouterr().out)
    assert set(plain) >= {"peak_gib", "seconds_per_iteration", "flops_per_iteration", "settings", "fit"}
    assert plain["fit"] is None and plain["settings"] == settings_of(load_config(None, []))
    assert main(["bench", "--estimate", "--json", "--gpu", "4090", "train.fit=auto", "rollout.max_batch=32"]) == 0
    fitted = json.loads(capsys.readouterr().out)
    assert fitted["fit"]["kept"] == ["rollout.max_batch"] and fitted["settings"]["rollout.max_batch"] == 32
    assert fitted["settings"] == fitted["fit"]["settings"] and fitted["peak_gib"] <= fitted["fit"]["budget_gib"]
    assert len(fitted["seconds_per_iteration"]) == 2


def test_flowrl_train_fits_before_loading_and_logs_perf(tmp_path, capsys):
    code = main(
        [
            "train",
            "train.fit=auto",
            "train.max_steps=1",
            "prompts.eval=null",
            "prompts.per_step=2",  # a small iteration: what is checked is the fit before it and the perf record after
            "rollout.max_batch=16",
            f"train.output_dir={tmp_path}",
            "train.name=fit",
            "train.progress=false",
        ]
    )
    assert code == 0
    out = capsys.readouterr().out
    assert "train.fit=auto for this CPU" in out and "rollout.max_batch = 16  — set explicitly: it wins" in out
    record = json.loads((tmp_path / "fit" / "metrics.jsonl").read_text().splitlines()[-1])
    assert record["perf/tflops"] > 0 and "perf/mfu" not in record
    saved = (tmp_path / "fit" / "config.yaml").read_text()
    assert "micro_batch: null" not in saved  # the fitted config is the one that ran


def _rows(settings: dict) -> int:
    return settings["train.micro_batch"] or settings["rollout.max_batch"]


def _checkpointed(settings: dict, blocks: int) -> int:
    if not settings["model.gradient_checkpointing"]:
        return 0
    return blocks if settings["model.checkpoint_blocks"] is None else settings["model.checkpoint_blocks"]


@pytest.mark.slow
@pytest.mark.parametrize("gpu", sorted(GPUS))
def test_fit_for_every_gpu_preset_and_gpu_class_is_within_the_fraction(gpu):
    """Every GPU preset on every GPU class: fit's choice is within train.memory_fraction by the estimate, and where
    the shipped settings leave room it uses more of it — a higher peak, or more rows per update with no more
    blocks recomputed (the encoders offloaded to afford them) — or it refuses, naming remedies, when nothing fits."""
    refused = []
    for preset in GPU_PRESETS:
        try:
            cfg = load_config(preset, [], gpu)
        except ConfigError as e:  # the preset itself needs another GPU (an fp8 explorer on an A100)
            assert "compute capability" in str(e)
            continue
        try:
            fit = fit_config(cfg, gpu)
        except ConfigError as e:
            assert "cannot fit" in str(e) and "remed" in str(e)
            refused.append(preset)
            continue
        assert fit.peak_gib <= fit.budget_gib
        shipped = estimate(cfg, gpu=gpu)["memory_gib"]["peak"]
        if shipped <= fit.budget_gib:  # room: more memory used, or more rows with no more recomputation
            before, blocks = settings_of(cfg), estimate(cfg, gpu=gpu)["shapes"]["blocks"]
            rows, fewer = _rows(fit.settings), _checkpointed(fit.settings, blocks)
            more_work = rows >= _rows(before) and fewer <= _checkpointed(before, blocks) and fit.settings != before
            assert fit.peak_gib >= shipped or more_work or fit.settings == before, (preset, fit.settings)
    if gpu in ("H100", "H200"):
        assert not refused
