"""FSDP2 sharding (``model.shard: fsdp``) on 2 CPU processes (gloo): the main shapes job trains to the weights of one
process and of the unsharded (DDP) run, each process holding half of the parameters and AdamW state; a run killed
with ``kill -9`` resumes to the uninterrupted run's metrics; the consolidated export loads in a plain diffusers
pipeline and samples what the sharded model samples; bad settings fail at load, naming the setting."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from flowrl.config.schema import ConfigError
from flowrl.run.sharded_checkpoint import merge_sharded, split_sharded
from tests.conftest import without_wall_clock

WORKER = Path(__file__).with_name("sharded_worker.py")
ENV = {
    **os.environ,
    "ACCELERATE_USE_CPU": "1",
    "OMP_NUM_THREADS": "1",
    "FLOWRL_COMPILE_BACKEND": "eager",
}  # model.compile=regional: dynamo's tracing, no C++ build
LAUNCH = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
# Sol-RL's plan on the main job: an int8 explorer copy previews a pool, the chosen ones regenerated in full precision
EXPLORE = (
    "config=configs/shapes/solrl_nft.yaml",
    "rollout.inner={plan: ode, group_size: 2, steps: 4}",
    "rollout.pool=4",
    "rollout.preview_steps=2",
    "train.max_steps=2",
)


def launch(out: Path, shard: str, tune: str, processes: int, *extra: str) -> list[dict]:
    """Run tests/sharded_worker.py in ``processes`` processes; the per-rank results."""
    out.mkdir(parents=True, exist_ok=True)
    prefix = [*LAUNCH[:-1], str(processes)] if processes > 1 else [sys.executable]
    proc = subprocess.run(
        prefix + [str(WORKER), str(out), shard, tune, *extra], env=ENV, timeout=600, capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(processes)]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The shapes job, full fine-tuning and LoRA: one process, two unsharded (DDP) and two sharded."""
    root = tmp_path_factory.mktemp("sharding")
    variants = {
        "per_block": ("model.shard_rollouts=per_block", "model.gradient_checkpointing=true"),
        "bf16": ("model.dtype=bfloat16",),
        "explore": EXPLORE,
        "compiled": ("model.compile=regional", "model.gradient_checkpointing=true", "model.checkpoint_blocks=2"),
    }
    out = {}
    for shard, tune, n, *variant in [
        ("ddp", "full", 1),
        ("ddp", "full", 2),
        ("fsdp", "full", 2),
        ("ddp", "lora", 1),
        ("fsdp", "lora", 2),
        ("fsdp", "full", 2, "per_block"),
        ("fsdp", "lora", 2, "bf16"),
        ("ddp", "full", 2, "explore"),
        ("fsdp", "full", 2, "explore"),
        ("fsdp", "full", 2, "compiled"),
    ]:
        folder = root / "-".join([shard, tune, str(n), *variant])
        out[(shard, tune, n, *variant)] = (
            launch(folder, shard, tune, n, *variants[variant[0]] if variant else ()),
            folder,
        )
    return out


def max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k] - b[k]).abs().max()) for k in a)


def comparable(records: list[dict]) -> list[dict]:
    return [without_wall_clock(r) for r in records]


@pytest.mark.slow
@pytest.mark.parametrize("tune", ["full", "lora"])
def test_sharded_training_equals_one_process_and_ddp(runs, tune):
    (one,), _ = runs[("ddp", tune, 1)]
    sharded, _ = runs[("fsdp", tune, 2)]
    assert [r["world"] for r in sharded] == [2, 2] and one["world"] == 1
    # every rank holds the same weights after the updates (a run whose gradients were never averaged differs)
    assert max_diff(sharded[0]["weights"], sharded[1]["weights"]) == 0.0
    # equal to one process up to float32 reduction order (measured: 6.3e-7 full, 4.0e-6 LoRA, whose Adam
    # divides by tiny second moments), far below what 3 iterations move the weights
    tol = 2e-6 if tune == "full" else 2e-5
    assert max_diff(sharded[0]["weights"], one["weights"]) < tol
    if tune == "full":
        (ddp, _), _ = runs[("ddp", "full", 2)]
        assert max_diff(sharded[0]["weights"], ddp["weights"]) < tol
    # metrics are global: both ranks log one process's rewards, and the same grad norms
    assert len(sharded[0]["records"]) == len(one["records"]) == 4  # 3 iterations and the closing eval
    for a, b, single in zip(sharded[0]["records"], sharded[1]["records"], one["records"]):
        for key in ("reward_mean", "eval/reward_mean"):
            assert a.get(key) == b.get(key) == single.get(key)
        assert a.get("grad_norm") == b.get("grad_norm")
        if "grad_norm" in single:
            assert a["grad_norm"] == pytest.approx(single["grad_norm"], rel=1e-4)


@pytest.mark.slow
def test_block_by_block_sampling_and_gradient_checkpointing_compose_with_sharding(runs):
    """``model.shard_rollouts=per_block`` (each forward gathers block by block, collectively) with gradient
    checkpointing trains to the weights of the default (whole transformer gathered once per rollout)."""
    whole_run, _ = runs[("fsdp", "full", 2)]
    blockwise, _ = runs[("fsdp", "full", 2, "per_block")]
    assert max_diff(blockwise[0]["weights"], blockwise[1]["weights"]) == 0.0
    assert max_diff(blockwise[0]["weights"], whole_run[0]["weights"]) < 2e-6
    assert [r.get("reward_mean") for r in blockwise[0]["records"]] == [
        r.get("reward_mean") for r in whole_run[0]["records"]
    ]


@pytest.mark.slow
def test_regional_compile_and_per_block_checkpointing_compose_with_sharding(runs):
    """``model.compile=regional`` with the first 2 blocks checkpointed, under FSDP2: both ranks train to the weights
    of the uncompiled sharded run, compiling in the first iteration only."""
    plain, _ = runs[("fsdp", "full", 2)]
    compiled, _ = runs[("fsdp", "full", 2, "compiled")]
    assert max_diff(compiled[0]["weights"], compiled[1]["weights"]) == 0.0
    assert max_diff(compiled[0]["weights"], plain[0]["weights"]) < 2e-6
    graphs = [r["compile/graphs"] for r in compiled[0]["records"] if "compile/graphs" in r]
    assert len(graphs) == 3 and graphs[0] > 0 and len(set(graphs)) == 1


@pytest.mark.slow
def test_a_sharded_run_follows_its_weights_in_the_explorers_low_precision_copy(runs):
    """Sol-RL's explorer (an int8 copy of the policy, whole on each process) is re-merged from the gathered shards
    after the update and previews what the unsharded run's explorer previews: the same pools, the same seeds kept.
    (Compared with 2 unsharded processes: int8 previews quantize each batch's activations together, so a pool
    split over another number of processes previews slightly other images.)"""
    (ddp, _), _ = runs[("ddp", "full", 2, "explore")]
    sharded, _ = runs[("fsdp", "full", 2, "explore")]
    assert max_diff(sharded[0]["weights"], sharded[1]["weights"]) == 0.0
    assert len(sharded[0]["records"]) == 3  # 2 iterations, the second previewed by the re-synced explorer
    for key in (
        "reward_mean",
        "explore/pool_reward_mean",
        "explore/kept_preview_mean",
        "explore/kept_regenerated_mean",
    ):
        assert [r.get(key) for r in sharded[0]["records"]] == [r.get(key) for r in ddp["records"]], key
    assert sharded[0]["records"][1]["time/explore_sync"] > 0
    assert max_diff(sharded[0]["weights"], ddp["weights"]) < 2e-6


@pytest.mark.slow
def test_bf16_sharding_keeps_fp32_master_shards_and_equal_ranks(runs):
    """``model.dtype=bfloat16``: gathered and computed in bf16 (MixedPrecisionPolicy), gradients reduced in fp32
    into fp32 LoRA shards; both ranks end equal, and the run trained."""
    bf16, _ = runs[("fsdp", "lora", 2, "bf16")]
    assert max_diff(bf16[0]["weights"], bf16[1]["weights"]) == 0.0
    assert {v.dtype for v in bf16[0]["weights"].values()} == {torch.float32}
    assert all(bool(torch.isfinite(v).all()) for v in bf16[0]["weights"].values())
    assert max(float(v.abs().max()) for k, v in bf16[0]["weights"].items() if "lora_B" in k) > 1e-4


@pytest.mark.slow
def test_training_moves_the_weights_far_beyond_the_tolerance(runs, tmp_path):
    """The tolerance above is meaningful: the sharded LoRA moved well past it from its start."""
    (one,), _ = runs[("ddp", "lora", 1)]
    lora_b = [k for k in one["weights"] if "lora_B" in k]
    assert max(float(one["weights"][k].abs().max()) for k in lora_b) > 10 * 2e-5  # lora_B starts at 0


@pytest.mark.slow
@pytest.mark.parametrize("tune", ["full", "lora"])
def test_each_process_holds_half_of_the_parameters_and_optimizer_state(runs, tune):
    sharded, _ = runs[("fsdp", tune, 2)]
    (one,), _ = runs[("ddp", tune, 1)]
    for r in sharded:
        assert r["whole_param_bytes"] == one["param_bytes"] and r["whole_optim_bytes"] == one["optim_bytes"]
        # dim-0 shards: half, up to the padding of rows that do not split evenly
        assert abs(r["param_bytes"] / one["param_bytes"] - 0.5) < 0.01, (r["param_bytes"], one["param_bytes"])
        assert abs(r["optim_bytes"] / one["optim_bytes"] - 0.5) < 0.01, (r["optim_bytes"], one["optim_bytes"])


@pytest.mark.slow
@pytest.mark.parametrize("tune", ["full", "lora"])
def test_the_export_loads_in_a_plain_diffusers_pipeline_and_samples_what_the_sharded_model_sampled(runs, tune):
    from diffusers import SD3Transformer2DModel

    from flowrl.shapes.pipeline import load_shapes_pipeline
    from tests.sharded_worker import pipeline_images

    sharded, folder = runs[("fsdp", tune, 2)]
    export = folder / "run" / "export"
    pipe = load_shapes_pipeline()
    before = pipeline_images(pipe)
    if tune == "full":
        pipe.transformer = SD3Transformer2DModel.from_pretrained(export / "transformer")
    else:
        pipe.load_lora_weights(export)
    after = pipeline_images(pipe)
    torch.testing.assert_close(after, sharded[0]["images"], rtol=0, atol=1e-4)
    assert float((after - before).abs().max()) > 1e-3  # the trained weights reached the sampling model


@pytest.mark.slow
def test_export_command_consolidates_a_sharded_checkpoint_in_one_process(runs, tmp_path):
    sharded, folder = runs[("fsdp", "full", 2)]
    proc = subprocess.run(
        [sys.executable, "-m", "flowrl", "export", str(folder / "run"), "--out", str(tmp_path / "x")],
        env=ENV,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    from safetensors.torch import load_file

    weights = load_file(tmp_path / "x" / "transformer" / "diffusion_pytorch_model.safetensors")
    assert max_diff({k: weights[k] for k in sharded[0]["weights"]}, sharded[0]["weights"]) == 0.0


@pytest.mark.slow
def test_kill_9_mid_run_then_resume_gives_the_uninterrupted_metrics(runs, tmp_path):
    _, folder = runs[("fsdp", "full", 2)]
    out = tmp_path / "killed"
    out.mkdir()
    cmd = LAUNCH + [str(WORKER), str(out), "fsdp", "full"]
    proc = subprocess.Popen(cmd, env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    first = out / "run" / "checkpoints" / "step-1"
    deadline = time.time() + 300
    while not first.is_dir() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.05)
    assert proc.poll() is None, "the run ended before it could be killed"
    os.killpg(proc.pid, signal.SIGKILL)  # every process of the run, mid-iteration 2
    proc.wait()
    assert not (out / "run" / "checkpoints" / "step-3").exists()
    launch(out, "fsdp", "full", 2, "train.resume=latest")
    resumed = [json.loads(line) for line in (out / "run" / "metrics.jsonl").read_text().splitlines()]
    whole = [json.loads(line) for line in (folder / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in resumed] == [r["step"] for r in whole]
    assert comparable(resumed) == comparable(whole)


@pytest.mark.slow
def test_a_sharded_lora_run_resumes_as_it_would_have_gone_on(runs, tmp_path):
    """FSDP with LoRA: the shards hold the trained LoRA and the optimizer, not the frozen base or the old policy's
    adapter (the objective's state has that), and a resume reads them back (it once refused the checkpoint as
    damaged: the strict load counted every frozen parameter as missing)."""
    straight, folder = runs[("fsdp", "lora", 2)]
    launch(tmp_path, "fsdp", "lora", 2, "train.max_steps=1")
    resumed = launch(tmp_path, "fsdp", "lora", 2, "train.resume=latest")

    def trained(where: Path) -> list[dict]:  # the first launch's closing eval at step 1 stays in its log
        lines = (where / "run" / "metrics.jsonl").read_text().splitlines()
        return comparable([r for r in map(json.loads, lines) if "reward_mean" in r])

    assert [r["step"] for r in trained(tmp_path)] == [1, 2, 3]
    assert trained(tmp_path) == trained(folder)
    assert max_diff(resumed[0]["weights"], straight[0]["weights"]) == 0.0


@pytest.mark.slow
def test_a_sharded_checkpoint_resumes_on_another_number_of_processes(tmp_path):
    """DCP re-shards: a checkpoint of 2 processes resumed by 4 continues as the 2-process run does."""
    small = ("prompts.per_step=4", "eval.num_prompts=4")
    launch(tmp_path / "moved", "fsdp", "full", 2, *small, "train.max_steps=1")
    launch(tmp_path / "moved", "fsdp", "full", 4, *small, "train.max_steps=2", "train.resume=latest")
    launch(tmp_path / "straight", "fsdp", "full", 2, *small, "train.max_steps=2")

    def steps(folder: Path) -> dict[int, dict]:
        records = [json.loads(line) for line in (folder / "run" / "metrics.jsonl").read_text().splitlines()]
        return {r["step"]: comparable([r])[0] for r in records if "reward_mean" in r}

    moved, straight = steps(tmp_path / "moved"), steps(tmp_path / "straight")
    assert sorted(moved) == sorted(straight) == [1, 2]
    for step in (1, 2):
        for key, value in straight[step].items():
            assert moved[step][key] == pytest.approx(value, rel=1e-5, abs=1e-7), (step, key)


@pytest.mark.slow
def test_resuming_a_sharded_checkpoint_without_sharding_fails_naming_the_setting(runs):
    from flowrl.training.trainer import Trainer
    from tests.sharded_worker import shapes_config

    _, folder = runs[("fsdp", "lora", 2)]
    cfg = shapes_config(folder, "ddp", "lora", "train.resume=latest", "train.max_steps=4")
    with pytest.raises(ConfigError, match=r"model\.shard=fsdp"):
        Trainer(cfg).train()


class FakeAccelerator:
    """Just enough of accelerate's Accelerator for the checks before the model loads."""

    def __init__(self, processes: int):
        self.num_processes, self.process_index, self.is_main_process = processes, 0, True
        self.device = torch.device("cpu")


def test_bad_shard_settings_fail_at_load_naming_the_setting(tmp_path):
    from flowrl.config.schema import TrainConfig
    from flowrl.paths import CONFIG_DIR
    from flowrl.training.trainer import Trainer
    from tests.sharded_worker import shapes_config

    with pytest.raises(ConfigError, match=r"model\.shard=fsdp .*1 process"):
        Trainer(shapes_config(tmp_path, "fsdp", "full"))
    with pytest.raises(ConfigError, match=r"prompts\.per_step=3 must be divisible by the number of processes \(2\)"):
        Trainer(shapes_config(tmp_path, "fsdp", "full", "prompts.per_step=3"), accelerator=FakeAccelerator(2))
    with pytest.raises(ConfigError, match=r"model\.shard=fsdp with model\.dtype=float16"):
        Trainer(shapes_config(tmp_path, "fsdp", "full", "model.dtype=float16"), accelerator=FakeAccelerator(2))
    with pytest.raises(ConfigError, match=r"model\.shard.*zero3.*fsdp"):
        shapes_config(tmp_path, "zero3", "full")
    with pytest.raises(
        ConfigError, match=r"loss\.objective=layer_tuning adds an auxiliary loss term.*model\.shard=ddp"
    ):
        Trainer(
            TrainConfig.from_yaml(
                str(CONFIG_DIR / "shapes" / "dynamic_treerpo.yaml"),
                ["model.shard=fsdp", f"train.output_dir={tmp_path}"],
            ),
            accelerator=FakeAccelerator(2),
        )
    assert not (tmp_path / "run").exists()  # nothing was written


def test_split_and_merge_of_sharded_tensors_round_trip():
    """The trainer state's sharded tensors leave trainer_state.pt by their paths and come back to them."""
    from torch.distributed.tensor import DTensor

    class Fake(torch.Tensor):  # stands for a DTensor: what split_sharded looks for is full_tensor
        def full_tensor(self):
            return self

    a, b = torch.ones(2).as_subclass(Fake), torch.zeros(3).as_subclass(Fake)
    state = {"step": 4, "ema": [a, torch.ones(1)], "objective": {"old": (b,), "n": 2}, "scheduler": {"lr": 0.1}}
    plain, found = split_sharded(state)
    assert set(found) == {"ema/0", "objective/old/0"}
    assert plain["ema"][0] is None and plain["objective"]["old"] == (None,) and plain["ema"][1] is state["ema"][1]
    back = merge_sharded(plain, found)
    assert back["ema"][0] is a and back["objective"]["old"][0] is b and back["step"] == 4
    assert issubclass(DTensor, torch.Tensor) and hasattr(DTensor, "full_tensor")


@pytest.mark.slow
def test_the_fsdp_launch_file_shards_through_accelerate(tmp_path):
    """``accelerate launch --config_file configs/accelerate/fsdp.yaml`` (here --cpu, 2 processes): model.shard=auto
    becomes fsdp, so the checkpoint is sharded and the run exports consolidated weights."""
    from flowrl.paths import CONFIG_DIR

    args = [
        "rollout.group_size=2",
        "rollout.steps=2",
        "prompts.per_step=2",
        "eval.num_prompts=2",
        "eval.steps=2",
        "eval.images_per_prompt=1",
        "eval.grid_prompts=0",
        "train.max_steps=1",
        "train.num_threads=1",
        "train.progress=false",
        f"train.output_dir={tmp_path}",
        "train.name=run",
    ]
    text = (CONFIG_DIR / "accelerate" / "fsdp.yaml").read_text()
    assert "\nuse_cpu: false\n" in text
    launch_file = tmp_path / "fsdp_cpu.yaml"  # the file itself, on CPUs (accelerate's --cpu flag drops the FSDP plugin)
    launch_file.write_text(text.replace("\nuse_cpu: false\n", "\nuse_cpu: true\n"))
    proc = subprocess.run(
        [
            "accelerate",
            "launch",
            "--config_file",
            str(launch_file),
            "--num_processes",
            "2",
            "-m",
            "flowrl",
            "train",
            *args,
        ],
        env=ENV,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    assert (tmp_path / "run" / "checkpoints" / "step-1" / "sharded" / ".metadata").is_file()
    assert (tmp_path / "run" / "export" / "transformer" / "config.json").is_file()  # the main job fine-tunes fully


def test_offloaded_text_encoders_visit_the_device_once_per_batch_of_new_prompts(monkeypatch):
    """``model.offload_encoders``: the encoders wait in CPU memory and come to the device only to encode
    prompts not yet cached, all of a batch in one visit; the embeddings are the same as without offloading."""
    from tests.conftest import make_model

    model = make_model("sd3")
    reference = model.encode(["a red circle", "a dog"]).cond
    model.clear_cache()
    model.offload_encoders()
    moves: list[str] = []
    for encoder in model.text_encoders:
        original = encoder.to
        monkeypatch.setattr(encoder, "to", lambda *a, _o=original, **k: (moves.append(str(a[0])), _o(*a, **k))[1])
    assert len(model.text_encoders) >= 2
    cond = model.encode(["a red circle", "a dog"]).cond
    for key in reference:
        torch.testing.assert_close(cond[key], reference[key], rtol=0, atol=0)
    n = len(model.text_encoders)
    assert moves == [str(model.device)] * n + ["cpu"] * n  # in once, out once, for both prompts
    model.encode(["a dog", "a red circle"])
    assert len(moves) == 2 * n  # cached: the encoders stayed where they were


def test_sharded_updates_pad_micro_batches_to_the_busiest_process_without_changing_the_gradient(tmp_path, monkeypatch):
    """Sharded, each forward gathers collectively, so every process runs the busiest one's number of micro-batches:
    the extra ones at weight 0 (the gradient is unchanged), from a unit of this process even when the credit left it
    none (every weight 0)."""
    from flowrl.training.trainer import Trainer
    from tests.conftest import make_model
    from tests.test_trainer import tiny_config

    trainer = Trainer(tiny_config(tmp_path, "pad"), model=make_model("sd3"))
    forest, _ = trainer.rollout(0)
    trainer.credit.assign(forest, gather=trainer.group.gather)
    calls = []
    loss = trainer.objective.loss
    monkeypatch.setattr(trainer.objective, "loss", lambda *a: (calls.append(a[2]), loss(*a))[1])
    plain = trainer.updater.gradient(forest, 0)
    own = len(calls)
    assert own >= 1 and plain.abs().max() > 0
    trainer.updater.sharded = True
    monkeypatch.setattr(trainer.group, "max", lambda v: float(v) + 2)  # another process has 2 more
    calls.clear()
    padded = trainer.updater.gradient(forest, 0)
    assert len(calls) == own + 2
    torch.testing.assert_close(padded, plain, rtol=0, atol=0)
    # this process has nothing to train, the others do: it still runs their count, on its own units at weight 0
    forest.weight.zero_()
    monkeypatch.setattr(trainer.group, "sum", lambda v: float(v) + 5.0)
    calls.clear()
    nothing = trainer.updater.gradient(forest, 0)
    assert len(calls) == 2 and calls[0].index.numel() > 0
    assert float(nothing.abs().max()) == 0.0
    assert float(forest.weight.abs().max()) == 0.0  # the credit's weights left as they were
