"""Low precision end to end on CPU: the loop (rollout with log-probs, replay, update, checkpoint, resume) with
``model.dtype`` bfloat16 / float16 on the tiny SD3, FLUX and SANA pipelines; full fine-tuning under autocast;
a 2-process ``accelerate launch --mixed_precision bf16``; loading the shapes model without warnings.

The conventions tested are in :mod:`flowrl.models.dtypes`: frozen base weights in ``model.dtype``, trainable
parameters (LoRA, or the fully fine-tuned transformer) in fp32, velocities / kernels / log-probs in fp32, and
the replay at unchanged weights bit-equal to the rollout (first inner step: |Δlogp| = 0, ratio exactly 1).

Run as a script (``python tests/test_low_precision.py OUT``, under ``accelerate launch``) it is the worker of
:func:`test_accelerate_launch_bf16_two_processes`.
"""

from __future__ import annotations

import json
import logging
import math
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

if __name__ == "__main__":  # the worker of test_accelerate_launch_bf16_two_processes: repository root on the path
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from flowrl.training.trainer import Trainer  # noqa: E402
from tests.test_trainer import tiny_config  # noqa: E402

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16}


def low_model(family: str, dtype: torch.dtype | None):
    """A tiny pipeline of ``family`` wrapped with its transformer cast to ``dtype`` (fresh and seeded: two
    calls build identical models)."""
    from flowrl.models import wrap
    from flowrl.models.testing import tiny_flux_pipeline, tiny_sana_pipeline, tiny_sd3_pipeline

    if family == "sd3":
        return wrap(tiny_sd3_pipeline(), dtype=dtype)
    if family == "flux":
        return wrap(tiny_flux_pipeline(), dtype=dtype, height=16, width=16)
    if family == "sana":
        return wrap(tiny_sana_pipeline(), dtype=dtype, guidance=1.0, max_sequence_length=8)
    raise ValueError(family)


def low_config(tmp_path: Path, name: str, family: str, dtype: str, *extra: str):
    """tests/test_trainer.py's tiny LoRA config, smaller: 2 prompts × 2 chains × 3 steps (2 SDE), EMA on."""
    return tiny_config(
        tmp_path,
        name,
        f"model.family={family}",
        f"model.dtype={dtype}",
        "prompts.eval=null",
        "rollout.group_size=2",
        "rollout.steps=3",
        "rollout.window.size=2",
        "train.ema=0.5",
        *extra,
    )


def trained(trainer: Trainer) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in trainer.model.trainable.named_parameters() if p.requires_grad}


def metrics(run: Path) -> list[dict]:
    return [r for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if "reward_mean" in r]


def check_iteration(record: dict) -> None:
    """Exact replay at the first inner step, and finite metrics."""
    assert record["first_step_abs_delta_logp"] == 0.0, record
    assert record["ratio_mean"] == record["ratio_min"] == record["ratio_max"] == 1.0, record  # one step: the first
    assert record["skipped_steps"] == 0.0
    for key, value in record.items():
        assert math.isfinite(value), (key, record)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("family", ["sd3", "flux", "sana"])
def test_lora_trains_checkpoints_and_resumes_in_low_precision(tmp_path, family, dtype):
    """Base weights in ``dtype``, LoRA in fp32: 2 iterations replay with ratio exactly 1, the LoRA moves and
    stays finite, step-2 is written, and 2 + resume to 3 equals 3 straight iterations bit for bit."""
    straight = Trainer(
        low_config(tmp_path, "straight", family, dtype, "train.max_steps=3"), model=low_model(family, DTYPES[dtype])
    )
    before = trained(straight)
    assert {p.dtype for p in straight.params} == {torch.float32}  # LoRA fp32 ...
    base = [p for n, p in straight.model.trainable.named_parameters() if "base_layer.weight" in n]
    assert base and {p.dtype for p in base} == {DTYPES[dtype]}  # ... on a base in the low dtype
    records = straight.train()
    assert len(records) == 3
    for record in records:
        check_iteration(record)
    after = trained(straight)
    assert all(torch.isfinite(p).all() for p in after.values())
    assert any(not torch.equal(before[k], after[k]) for k in before)

    first = Trainer(
        low_config(tmp_path, "resumed", family, dtype, "train.max_steps=2"), model=low_model(family, DTYPES[dtype])
    )
    first.train()
    checkpoint = tmp_path / "resumed" / "checkpoints" / "step-2"
    assert (checkpoint / "pytorch_lora_weights.safetensors").is_file()
    second = Trainer(
        low_config(tmp_path, "resumed", family, dtype, "train.max_steps=3", "train.resume=latest"),
        model=low_model(family, DTYPES[dtype]),
    )
    second.train()
    a, b = metrics(tmp_path / "straight"), metrics(tmp_path / "resumed")
    assert [r["step"] for r in b] == [1, 2, 3]
    for ra, rb in zip(a, b):
        assert ra["reward_mean"] == rb["reward_mean"] and ra["policy_loss"] == rb["policy_loss"], (ra, rb)
    resumed = trained(second)
    assert {p.dtype for p in second.params} == {torch.float32}
    for k in after:
        assert torch.equal(after[k], resumed[k]), k
    for ea, eb in zip(straight.ema, second.ema):
        assert torch.equal(ea, eb)


def test_log_probs_and_gradients_are_fp32_in_bf16(tmp_path):
    """The replay's log-probs and the LoRA gradients are fp32 while the transformer computes in bf16."""
    from flowrl.objectives.replay import replay, replay_batches

    trainer = Trainer(low_config(tmp_path, "grads", "sd3", "bfloat16"), model=low_model("sd3", torch.bfloat16))
    seen = []
    first_linear = next(m for m in trainer.model.trainable.modules() if isinstance(m, torch.nn.Linear))
    first_linear.register_forward_hook(lambda m, i, o: seen.append(o.dtype))
    forest, _ = trainer.rollout(0)
    trainer.credit.assign(forest)
    assert forest.logp_old.dtype == torch.float32 and forest.all_latents().dtype == torch.float32
    cond = trainer.model.encode(forest.prompts, forest.guidance)
    batch = replay_batches(forest, forest.edges())[0]
    out = replay(trainer.model, forest, cond, batch)
    assert out.logp.dtype == out.mean.dtype == torch.float32
    assert torch.equal(out.logp.detach(), forest.logp_old[batch])
    (forest.advantage[batch] * out.logp).sum().backward()
    grads = [p.grad for p in trainer.params if p.grad is not None]
    assert grads and {g.dtype for g in grads} == {torch.float32}
    assert seen and set(seen) == {torch.bfloat16}


@pytest.mark.parametrize("family", ["sd3", "flux", "sana"])
def test_lora_loads_back_into_a_fresh_bf16_model_exactly(tmp_path, family):
    """``flowrl sample --checkpoint`` of a bf16 run: the fp32 LoRA saved is loaded into a fresh bf16 model without
    an adapter (peft creates it in bf16) and ends fp32 and bit-equal to what was saved, not rounded to bf16."""
    from safetensors.torch import load_file

    from flowrl.models.base import LoraSpec

    model = low_model(family, torch.bfloat16)
    model.add_lora(LoraSpec(rank=2, init="default"))
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.trainable.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.05)  # not representable in bf16
    model.save_lora(tmp_path)
    assert {t.dtype for t in load_file(tmp_path / "pytorch_lora_weights.safetensors").values()} == {torch.float32}
    fresh = low_model(family, torch.bfloat16)
    fresh.load_lora(tmp_path)
    saved = {n: p for n, p in model.trainable.named_parameters() if "lora_" in n}
    loaded = {n: p for n, p in fresh.trainable.named_parameters() if "lora_" in n}
    assert saved.keys() == loaded.keys()
    for name, p in saved.items():
        assert loaded[name].dtype == torch.float32 and loaded[name].requires_grad, name
        assert torch.equal(loaded[name], p), name


def test_nft_old_policy_adapter_is_fp32_in_bf16(tmp_path):
    """DiffusionNFT keeps its lagging old policy as a second LoRA adapter: fp32 as the policy's, so its EMA
    (θ_old ← d·θ_old + (1 − d)·θ) is not rounded to bf16; two iterations train with finite weights."""
    from flowrl.config.schema import TrainConfig

    cfg = TrainConfig.from_yaml(
        None,
        [
            "model.family=sd3",
            "model.dtype=bfloat16",
            "model.lora.rank=2",
            "rollout.plan=ode",
            "rollout.group_size=2",
            "rollout.steps=3",
            "prompts.train=a red circle|two blue squares",
            "prompts.per_step=2",
            "prompts.eval=null",
            "loss.objective=nft",
            "loss.draws=1",
            "train.max_steps=2",
            "train.progress=false",
            "train.async_reward=false",
            "rewards=[{name: brightness}]",
            f"train.output_dir={tmp_path}",
            "train.name=nft",
        ],
    )
    trainer = Trainer(cfg, model=low_model("sd3", torch.bfloat16))
    old = [old for old, _ in trainer.objective._old.pairs]
    assert old and {p.dtype for p in old} == {torch.float32}
    records = trainer.train()
    assert len(records) == 2 and all(math.isfinite(v) for r in records for v in r.values())
    assert trainer.updater.weights_finite()


def test_full_finetune_keeps_fp32_master_weights_under_bf16_autocast(tmp_path):
    """``model.full_finetune`` with ``model.dtype=bfloat16`` (built from a folder by build_model): the transformer
    is fp32 (what AdamW updates), its forward runs under bf16 autocast, replay is exact, weights finite."""
    from flowrl.models.testing import tiny_sd3_pipeline

    tiny_sd3_pipeline().save_pretrained(tmp_path / "pipe")
    cfg = low_config(
        tmp_path,
        "full",
        "sd3",
        "bfloat16",
        "train.max_steps=2",
        f"model.path={tmp_path / 'pipe'}",
        "model.full_finetune=true",
        "optim.lr=1e-4",
    )
    trainer = Trainer(cfg)
    model = trainer.model
    assert model.autocast == torch.bfloat16 and model.dtype == torch.float32
    assert {p.dtype for p in trainer.params} == {torch.float32} and len(trainer.params) == len(
        list(model.trainable.parameters())
    )
    before = trained(trainer)
    records = trainer.train()
    for record in records:
        check_iteration(record)
    after = trained(trainer)
    assert all(torch.isfinite(p).all() for p in after.values())
    assert any(not torch.equal(before[k], after[k]) for k in before)
    assert (tmp_path / "full" / "checkpoints" / "step-2" / "transformer").is_dir()


# ---- accelerate launch --mixed_precision bf16, 2 CPU processes ---------------------------------------
def _worker(out: str) -> None:
    """Train the tiny SD3 pipeline (fp32 weights, fp32 LoRA) 2 iterations under accelerate's bf16 mixed
    precision; write this rank's world, mixed precision, autocast dtype, a Linear's output dtypes, the
    records and the LoRA to ``OUT/rank<r>.pt``."""
    from flowrl.models.dtypes import autocast_dtype
    from tests.conftest import make_model

    torch.set_num_threads(1)
    cfg = tiny_config(
        Path(out),
        "mp",
        "train.max_steps=2",
        "prompts.eval=null",
        "rollout.group_size=2",
        "rollout.steps=3",
        "rollout.window.size=2",
        "credit.scale=global",
    )
    trainer = Trainer(cfg, model=make_model("sd3"))
    seen = set()
    linear = next(m for m in trainer.model.trainable.modules() if isinstance(m, torch.nn.Linear))
    linear.register_forward_hook(lambda m, i, o: seen.add(str(o.dtype)))
    records = trainer.train()
    torch.save(
        {
            "world": trainer.world,
            "rank": trainer.rank,
            "mixed_precision": trainer.accelerator.mixed_precision,
            "distributed_type": str(trainer.accelerator.distributed_type),
            "autocast": str(autocast_dtype(trainer.model)),
            "linear_out": sorted(seen),
            "records": records,
            "lora": trained(trainer),
            "param_dtypes": sorted({str(p.dtype) for p in trainer.params}),
        },
        Path(out) / f"rank{trainer.rank}.pt",
    )


@pytest.mark.slow  # three processes started on two cores (8–12 s): `pytest -m slow`, run by .ci/run
def test_accelerate_launch_bf16_two_processes(tmp_path):
    """``accelerate launch --multi_gpu --num_processes 2 --mixed_precision bf16`` on CPU (gloo): the transformer
    computes in bf16 (autocast follows accelerate), log-probs stay fp32 (first-step ratio exactly 1), both ranks
    end with identical LoRA weights and finite metrics."""
    import socket

    with socket.socket() as s:  # a free port for the rendezvous (the default 29500 may be taken)
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "ACCELERATE_USE_CPU": "1", "OMP_NUM_THREADS": "1"}
    cmd = [
        sys.executable,
        "-m",
        "accelerate.commands.launch",
        "--multi_gpu",
        "--num_processes",
        "2",
        "--num_machines",
        "1",
        "--mixed_precision",
        "bf16",
        "--dynamo_backend",
        "no",
        "--main_process_port",
        str(port),
        str(Path(__file__).resolve()),
        str(tmp_path),
    ]
    proc = subprocess.run(
        cmd, env=env, timeout=600, capture_output=True, text=True, cwd=Path(__file__).resolve().parents[1]
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(2)]
    assert [r["world"] for r in ranks] == [2, 2] and [r["rank"] for r in ranks] == [0, 1]  # two ranks really ran
    assert "MULTI_CPU" in ranks[0]["distributed_type"]
    for r in ranks:
        assert r["mixed_precision"] == "bf16" and r["autocast"] == "torch.bfloat16"
        assert r["linear_out"] == ["torch.bfloat16"] and r["param_dtypes"] == ["torch.float32"]
        assert len(r["records"]) == 2
        for record in r["records"]:
            check_iteration(record)
    global_keys = ("reward_mean", "reward_std", "grad_norm", "trained_edges", "rollout_forwards", "leaves", "lr")
    for ra, rb in zip(ranks[0]["records"], ranks[1]["records"]):  # gathered / all-reduced: the same on both ranks
        assert [ra[k] for k in global_keys] == [rb[k] for k in global_keys]
    for name, value in ranks[0]["lora"].items():
        assert torch.isfinite(value).all(), name
        assert torch.equal(value, ranks[1]["lora"][name]), name
    assert (tmp_path / "mp" / "checkpoints" / "step-2" / "pytorch_lora_weights.safetensors").is_file()


# ---- loading without spurious warnings ------------------------------------------------------------------
def test_building_the_shapes_model_emits_no_warnings(caplog, capfd):
    """build_model of the shipped shapes model, in fp32 and in bf16, with a LoRA saved and loaded back fresh:
    no Python warning, no diffusers/transformers/peft log record of level WARNING, nothing on stderr."""
    import diffusers
    import transformers

    libraries = [logging.getLogger(name) for name in ("diffusers", "transformers", "peft", "accelerate")]
    verbosity = [(lib, lib.utils.logging.get_verbosity()) for lib in (diffusers, transformers)]
    for lib, _ in verbosity:
        lib.utils.logging.set_verbosity_warning()  # as a Python user has it (the CLI lowers it)
    for lg in libraries:  # these loggers do not propagate to the root logger caplog listens on
        lg.addHandler(caplog.handler)
    try:
        caught = _build_save_load_shapes()
    finally:
        for lg in libraries:
            lg.removeHandler(caplog.handler)
        for lib, level in verbosity:
            lib.utils.logging.set_verbosity(level)
    assert [str(w.message) for w in caught] == []
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING] == []
    assert capfd.readouterr().err == ""


def _build_save_load_shapes() -> list:
    import tempfile

    from flowrl.config.build import build_model
    from flowrl.config.schema import ModelSection
    from flowrl.models.base import LoraSpec

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for dtype in ("float32", "bfloat16"):
            model = build_model(ModelSection(dtype=dtype), torch.device("cpu"))
            assert model.pipe.transformer.dtype == DTYPES.get(dtype, torch.float32)
        model.add_lora(LoraSpec(rank=2))
        with tempfile.TemporaryDirectory() as folder:
            model.save_lora(folder)
            fresh = build_model(ModelSection(dtype="bfloat16"), torch.device("cpu"))
            fresh.load_lora(folder)
        assert {p.dtype for p in fresh.trainable.parameters() if p.requires_grad} == {torch.float32}
    return caught


if __name__ == "__main__":
    _worker(sys.argv[1])
