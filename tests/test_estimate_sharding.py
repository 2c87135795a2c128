"""The estimate under FSDP2 (``flowrl bench --estimate --gpus N --shard fsdp``; docs/estimate.md): per-process
static memory against what two CPU processes (gloo) really hold after sharding the tiny SD3 transformer block by
block with ``fully_shard`` and one AdamW step; the sharded parts against the DDP estimate; the CLI flags.

Run as a script under ``torch.distributed.run`` (``python -m torch.distributed.run --nproc_per_node 2
tests/test_estimate_sharding.py OUT``) it is the worker: it writes each rank's bytes to ``OUT/rank<r>.json``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from flowrl import estimate as E
from flowrl.config.schema import ConfigError, TrainConfig
from flowrl.paths import CONFIG_DIR

ROOT = Path(__file__).resolve().parents[1]
SHAPES_NFT = str(CONFIG_DIR / "shapes" / "nft.yaml")
PROMPTS = ["a red circle", "a blue square"]
CASES = {  # id → config overrides (besides BASE): LoRA (no reference copy; rank 3: lora_A's 3 rows split 2 + 1, so
    "lora": ["model.lora.rank=3"],  # FSDP2 pads the second rank's shards) and full fine-tuning (a reference copy)
    "full": ["model.full_finetune=true"],
    # bf16: fp32 master weights (their shards, gradients, AdamW state and the reference copy fp32), gathered in bf16
    "full-bf16": ["model.full_finetune=true", "model.dtype=bfloat16"],
    "lora-bf16": ["model.lora.rank=3", "model.dtype=bfloat16"],  # fp32 LoRA on a bf16 base
}
BASE = [
    f"prompts.train={'|'.join(PROMPTS)}",
    "prompts.eval=null",
    "prompts.per_step=2",
    "rollout.max_batch=8",
    "rollout.group_size=4",
    "rollout.steps=4",
    "rewards=[{name: brightness}]",
    "model.family=sd3",
    "model.path=in-memory",
    "model.dtype=float32",
    "model.guidance=1",
    "model.height=16",
    "model.width=16",
    "model.max_sequence_length=16",
]


def tiny_config(*overrides: str) -> TrainConfig:
    return TrainConfig.from_yaml(None, BASE + list(overrides))


def tiny_arch(num_layers: int = 2) -> dict:
    """The architecture of ``tests/conftest.py``'s ``make_model("sd3")`` pipeline (``num_layers`` blocks)."""
    from flowrl.models.testing import tiny_sd3_pipeline

    return E.arch_from_pipeline(tiny_sd3_pipeline(num_layers=num_layers))


def one_row_each(tensors) -> int:
    """Bytes of one dim-0 row of every tensor: what padding adds at most per tensor to a ⌈R/N⌉-row shard."""
    return sum(t.numel() // t.shape[0] * t.element_size() for t in tensors if t.dim() and t.shape[0])


# ---- the worker: two processes, the transformer sharded by flowrl's own Sharding ---------------------------
def local_bytes(tensors) -> int:
    """Bytes this process allocates for ``tensors`` (DTensors: their local shard), each storage counted once:
    a padded shard's whole storage, a reduce-scatter output shared by a group's gradients once."""
    from flowrl.distributed.sharding import local

    storages = {local(t).untyped_storage().data_ptr(): local(t).untyped_storage().nbytes() for t in tensors}
    return sum(storages.values())


def measure(case: str, world: int) -> dict[str, int]:
    """One process's bytes after :class:`flowrl.distributed.sharding.Sharding` shards the tiny SD3 transformer (config
    ``case``; full fine-tuning: with a frozen KL-reference copy, as the clipped objective makes it) and one AdamW
    step: ``weights`` (parameters, LoRA included), ``buffers``, ``gradients``, ``optimizer_state`` (exp_avg,
    exp_avg_sq) and ``reference`` (the copy's parameters and buffers)."""
    from conftest import make_model

    from flowrl.distributed.sharding import Sharding, compute_dtype
    from flowrl.models.dtypes import DTYPES, master_weights_fp32
    from flowrl.models.frozen import frozen_copies, frozen_copy
    from flowrl.models.lora import LoraSpec

    cfg = tiny_config(*CASES[case]).model
    model = make_model("sd3", device="cpu", dtype=DTYPES[cfg.dtype], height=cfg.height, width=cfg.width)
    if cfg.full_finetune:  # as the trainer sets it up: master weights, then the objective's frozen copy
        master_weights_fp32(model)
        model.trainable.requires_grad_(True)
        frozen_copy(model)
    else:
        model.add_lora(
            LoraSpec(rank=cfg.lora.rank, alpha=cfg.lora.alpha, target_modules=cfg.lora.targets, init=cfg.lora.init)
        )
    group = SimpleNamespace(processes=world, world=world, dist_group=None)  # the ProcessGroup's counts, every process
    Sharding(model, group, torch.device("cpu"), cfg.shard_rollouts).shard(compute_dtype(model))
    transformer = model.trainable
    trainable = [p for p in transformer.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=1e-3)
    v = model.velocity(model.noise([0, 1]), torch.full((2,), 0.5), model.encode(PROMPTS))
    v.square().mean().backward()
    optimizer.step()
    state = [v for p in trainable for k, v in optimizer.state[p].items() if k != "step"]
    copies = frozen_copies(model)
    return {
        "weights": local_bytes(transformer.parameters()),
        "buffers": local_bytes(transformer.buffers()),
        "gradients": local_bytes(p.grad for p in trainable),
        "optimizer_state": local_bytes(state),
        "reference": sum(local_bytes([*c.parameters(), *c.buffers()]) for c in copies),
    }


def worker(out: str) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    world, rank = dist.get_world_size(), dist.get_rank()
    result = {"rank": rank, "world": world, **{c: measure(c, world) for c in CASES}}
    Path(out, f"rank{rank}.json").write_text(json.dumps(result))
    dist.destroy_process_group()


# ---- against two real processes -------------------------------------------------------------------------
@pytest.mark.slow  # two processes started on two cores (35–60 s): `pytest -m slow`, run by .ci/run; the estimate's
# sharded parts without processes: test_fsdp_halves_the_sharded_parts_and_adds_the_gathers below
def test_fsdp_estimate_matches_what_two_cpu_processes_hold(tmp_path):
    env = {**os.environ, "ACCELERATE_USE_CPU": "1", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc_per_node",
            "2",
            __file__,
            str(tmp_path),
        ],
        env=env,
        timeout=300,
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert [r["rank"] for r in ranks] == [0, 1] and [r["world"] for r in ranks] == [2, 2]
    arch = tiny_arch()
    for case, overrides in CASES.items():
        cfg = tiny_config(*overrides)
        mem = E.estimate(cfg, arch=arch, processes=2, shard="fsdp", target="cpu")["memory_gib"]
        whole = E.estimate(cfg, arch=arch, processes=2, shard="ddp", target="cpu")["memory_gib"]
        predicted = {
            k: int(round(v * E.GiB))
            for k, v in {
                "weights": mem["transformer_weights"] + mem["lora"],
                "buffers": mem["transformer_buffers"],
                "gradients": mem["gradients"],
                "optimizer_state": mem["optimizer_state"],
                "reference": mem["reference"],
            }.items()
        }
        assert (predicted["reference"] > 0) == cfg.model.full_finetune
        for part, estimate in predicted.items():
            held = [r[case][part] for r in ranks]
            print(f"{case} {part}: estimated {estimate} B per process, held {held} B")
            if part == "optimizer_state":
                # AdamW's state is unpadded (zeros_like of each local shard): the first rank holds ⌈R/2⌉ rows of
                # every tensor, as estimated, and the two ranks together the unsharded state
                assert held[0] == pytest.approx(estimate, rel=1e-9)
                assert sum(held) == pytest.approx(whole["optimizer_state"] * E.GiB, rel=1e-9)
            else:
                # parameters, their gradients and the reference's shards are padded to ⌈R/2⌉ rows on every rank
                # (buffers whole): exactly the estimate's count, no tolerance needed beyond float rounding
                assert held == pytest.approx([estimate, estimate], rel=1e-9)
        # the measurement is not trivially equal to the unsharded model: sharding really halved it
        assert ranks[0][case]["gradients"] < 0.6 * whole["gradients"] * E.GiB
        if case.startswith("lora"):  # odd rows were padded: two shards hold more than the whole, the state less
            assert 2 * predicted["gradients"] > whole["gradients"] * E.GiB
            assert ranks[1][case]["optimizer_state"] < ranks[0][case]["optimizer_state"]


# ---- the estimate's sharded parts (no processes) ---------------------------------------------------------
SHARDED = ("transformer_weights", "lora", "gradients", "optimizer_state", "ema", "old_policy", "reference")
REPLICATED = ("transformer_buffers", "text_encoders", "vae", "reward_models", "explorer", "prompt_cache")


@pytest.mark.parametrize(
    "overrides",
    [
        pytest.param(["train.ema=0.9", "loss.objective=nft", "rollout.plan=ode"], id="lora-nft-ema"),
        pytest.param(
            ["train.ema=0.9", "model.full_finetune=true", "loss.objective=nft", "rollout.plan=ode"],
            id="full-nft-ema-old-copy",
        ),
        pytest.param(["model.full_finetune=true", "loss.kl_ref=0.1"], id="full-clipped-reference"),
    ],
)
def test_fsdp_halves_the_sharded_parts_and_adds_the_gathers(overrides):
    arch = tiny_arch(num_layers=4)
    cfg = tiny_config(*overrides)
    ddp = E.estimate(cfg, arch=arch, processes=2)  # the config's model.shard: ddp
    fsdp = E.estimate(cfg, arch=arch, processes=2, shard="fsdp")
    assert (ddp["shard"], fsdp["shard"]) == ("ddp", "fsdp")
    d, f = ddp["memory_gib"], fsdp["memory_gib"]
    assert (d["sharded_over"], f["sharded_over"]) == (1, 2)
    lora = (
        None
        if cfg.model.full_finetune
        else (
            cfg.model.lora.rank,
            cfg.model.lora.alpha,
            tuple(cfg.model.lora.targets or E.default_lora_targets("sd3")),
            cfg.model.lora.init,
        )
    )
    module, _ = E.model_with_lora(arch["key"], cfg.model.dtype, lora)
    padding = one_row_each(module.parameters()) / E.GiB  # at most one row per tensor beyond half
    assert sum(d[k] > 0 for k in SHARDED) >= 4  # the config exercises most sharded parts
    for key in SHARDED:
        full_copy = key in ("old_policy", "reference") and cfg.model.full_finetune and d[key] > 0
        buffers = d["transformer_buffers"] if full_copy else 0  # a full copy's buffers stay whole
        half = (d[key] - buffers) / 2
        assert half <= f[key] - buffers + 1e-12, key
        assert f[key] - buffers <= half + (2 if key == "optimizer_state" else 1) * padding, key
    for key in REPLICATED:
        assert f[key] == d[key], key
    assert f["fsdp_gather"] > 0 and f["fsdp_reduce_scatter"] > 0 and d["fsdp_gather"] == d["fsdp_reduce_scatter"] == 0
    # the gather (root + two of the four blocks) is less than the whole transformer, and shows in the update phase
    whole_weights = d["transformer_weights"] + d["lora"]
    assert f["fsdp_gather"] < whole_weights
    assert f["static"] < d["static"]
    # the update's backward holds no whole-model gradients under FSDP2 (a block's are reduce-scattered, counted in
    # fsdp_reduce_scatter): the traced activations lose at most those the DDP trace held
    assert f["activations_rollout"] == d["activations_rollout"]
    assert 0 <= d["activations_update"] - f["activations_update"] <= d["gradients"] + 1e-12


def test_update_traces_hold_no_gradient_and_sharded_ones_drop_each_once_accumulated():
    arch = tiny_arch()
    E.ARCH_CACHE[arch["key"]] = arch
    shapes = E.preset_shapes(arch, 16, 16, 16)
    # (arch, dtype, full fine-tuning, shapes, 2 rollout states, no CFG, 2 update states, no CFG, no copies, no
    # explorer, AdamW, CPU kernels): the arguments estimate() passes to both
    args = (arch["key"], "float32", None, shapes, 2, False, 2, False, (), (), False, False, "cpu")
    module, _ = E.model_with_lora(arch["key"], "float32", None)
    ddp, fsdp = E.phases.phase_traces(*args), E.sharded_update_traces(*args)
    for name in ("update", "update_checkpointed"):
        # DDP: backward accumulates into the gradients that exist from the first micro-batch on (the estimate's
        # `gradients`, added to the phase): no allocation, so the trace ends holding nothing, as the sharded one
        # (each gradient dropped once accumulated)
        assert ddp[name].end == fsdp[name].end == 0
        assert 0 < fsdp[name].peak <= ddp[name].peak and fsdp[name].flops == ddp[name].flops  # the same work
    assert all(not p._post_accumulate_grad_hooks for p in module.parameters())  # the hooks are gone after
    assert all(p.grad is None for p in module.parameters())


def test_whole_rollouts_gather_the_whole_transformer_and_offloading_moves_encoders_to_the_cpu():
    arch = tiny_arch(num_layers=4)
    per_block = E.estimate(tiny_config(), arch=arch, processes=2, shard="fsdp")["memory_gib"]
    whole = E.estimate(tiny_config("model.shard_rollouts=whole"), arch=arch, processes=2, shard="fsdp")
    m = whole["memory_gib"]
    ddp = E.estimate(tiny_config(), arch=arch, processes=2)["memory_gib"]
    assert whole["shard_rollouts"] == "whole"
    assert m["fsdp_gather_rollout"] == pytest.approx(ddp["transformer_weights"] + ddp["lora"])  # fp32: model dtype
    assert per_block["fsdp_gather_rollout"] == per_block["fsdp_gather"] < m["fsdp_gather_rollout"]
    offload = E.estimate(tiny_config("model.offload_encoders=true"), arch=arch, processes=2, shard="fsdp")["memory_gib"]
    assert offload["text_encoders"] == 0 < offload["vae"] == per_block["vae"]  # the VAE stays on the GPU
    assert per_block["text_encoders"] > 0 and offload["offloaded_to_cpu"] == pytest.approx(per_block["text_encoders"])
    assert offload["static"] == pytest.approx(per_block["static"] - offload["offloaded_to_cpu"])
    # they come back to encode each iteration's new prompts: that visit is within the peak
    assert offload["peak"] >= offload["static"] + offload["prompt_cache"] + offload["offloaded_to_cpu"] - 1e-12
    text = E.format_estimate(whole)
    assert "(fsdp)" in text and "split over 2 GPUs" in text and "the whole transformer" in text


def test_fsdp_is_refused_where_a_run_refuses_it_and_auto_resolves_as_a_run_would(monkeypatch):
    arch = tiny_arch()
    with pytest.raises(ConfigError, match=r"model\.shard=fsdp needs at least 2 processes"):
        E.estimate(tiny_config("model.shard=fsdp"), arch=arch)  # the config's model.shard, one process
    with pytest.raises(ConfigError, match=r"model\.shard=fsdp needs at least 2 processes"):
        E.estimate(tiny_config(), arch=arch, processes=1, shard="fsdp")
    with pytest.raises(ConfigError, match=r"optim\.use_8bit"):  # flowrl.distributed.sharding.check_shard_settings' rule
        E.estimate(tiny_config("optim.use_8bit=true"), arch=arch, processes=2, shard="fsdp")
    monkeypatch.delenv("ACCELERATE_USE_FSDP", raising=False)
    assert E.estimate(tiny_config("model.shard=auto"), arch=arch, processes=2)["shard"] == "ddp"
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")  # launched with accelerate's FSDP2 plugin
    monkeypatch.setenv("FSDP_VERSION", "2")
    assert E.estimate(tiny_config("model.shard=auto"), arch=arch, processes=2)["shard"] == "fsdp"


def test_bench_estimate_gpus_and_shard_flags(capsys):
    from flowrl.commands.main import main, parse_args

    args = parse_args(["bench", SHAPES_NFT, "--estimate", "--gpus", "8", "--shard", "fsdp"])
    assert (args.processes, args.shard) == (8, "fsdp")
    defaults = parse_args(["bench", "--estimate"])
    assert (defaults.processes, defaults.shard) == (1, None)  # None: the config's model.shard
    assert parse_args(["bench", "--estimate", "--processes", "4"]).processes == 4
    with pytest.raises(SystemExit):
        parse_args(["bench", "--estimate", "--shard", "zero3"])
    capsys.readouterr()

    def run(*flags: str) -> dict:
        assert main(["bench", SHAPES_NFT, "--estimate", "--json", *flags]) == 0
        result = json.loads(capsys.readouterr().out)["estimate"]
        return {"text": E.format_estimate(result), **result}

    ddp, fsdp = run("--gpus", "2"), run("--gpus", "2", "--shard", "fsdp")
    assert (fsdp["processes"], fsdp["shard"], ddp["shard"]) == (2, "fsdp", "ddp")
    assert "2 × H100" in fsdp["text"] and "(fsdp)" in fsdp["text"] and "memory per GPU" in fsdp["text"]
    assert fsdp["memory_gib"]["optimizer_state"] < 0.6 * ddp["memory_gib"]["optimizer_state"]
    assert main(["bench", SHAPES_NFT, "--estimate", "--gpus", "1", "--shard", "fsdp"]) == 2
    assert "model.shard=fsdp needs at least 2 processes" in capsys.readouterr().err


if __name__ == "__main__":
    worker(sys.argv[1])
