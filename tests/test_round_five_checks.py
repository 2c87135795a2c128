"""Issue 63 part B (round five): the checks and messages. A refusal never shows a secret-looking setting's value;
the estimate refuses what a run refuses (a one-expert Wan's ``model.experts``, edit prompts without their image or
with more than ``max_images``, context parallelism the processes cannot hold) with the run's words, first and alone;
``model.checkpoint_blocks`` past the blocks is said and clamped; ``train.peak_tflops`` is bounded and the estimate's
time and ``perf/mfu`` share one table of peaks; ``train.fit_keep`` without ``train.fit`` is refused as unread;
``FLOWRL_COMPILE_BACKEND`` is checked at load; ``flowrl bench``'s machine view is its JSON alone on stdout and its
human view the table alone."""

from __future__ import annotations

import json
import re
import warnings

import pytest
from PIL import Image

from flowrl.commands.main import main
from flowrl.config.schema import TrainConfig
from flowrl.errors import ConfigError

KEY = "sk-live-0123456789abcdef"
REMOTE = "{name: remote, kwargs: {url: 'http://127.0.0.1:9', %s: '" + KEY + "'}}"


# ---- 2: a secret-looking key's value is never shown ---------------------------------------------------------------
@pytest.mark.parametrize("key", ["api_kye", "apikey", "api_key", "tokn", "pasword", "header", "openai_secrte"])
def test_a_refused_reward_setting_that_looks_like_a_secret_never_shows_its_value(key):
    with pytest.raises(ConfigError) as e:
        TrainConfig.from_yaml(None, [f"rewards=[{REMOTE % key}]"])
    message = str(e.value)
    assert f"rewards[0].kwargs.{key}=" in message and "is not a key of reward 'remote'" in message
    assert KEY not in message and "not shown" in message


def test_a_refused_model_keyword_that_looks_like_a_secret_never_shows_its_value():
    with pytest.raises(ConfigError, match=r"model\.kwargs\.tokn=<not shown") as e:
        TrainConfig.from_yaml(None, [f"model.kwargs={{tokn: {KEY}}}"])
    assert KEY not in str(e.value)
    with pytest.raises(ConfigError, match=r"kwargs\.retires=7 is not a key of"):  # other values are still shown
        TrainConfig.from_yaml(None, ["rewards=[{name: remote, kwargs: {url: 'http://127.0.0.1:9', retires: 7}}]"])


# ---- 9, 10: the estimate refuses what a run refuses --------------------------------------------------------------
def test_the_estimate_refuses_experts_of_a_one_expert_wan_as_a_run_does(capsys):
    assert main(["bench", "configs/wan/flow_grpo_1_3b.yaml", "--estimate", "--json", "model.experts=low"]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert "model.experts='low' applies to a two-expert Wan 2.2 pipeline" in captured.err
    assert "Wan2.1-T2V-1.3B" in captured.err and "has one transformer" in captured.err


def test_a_two_expert_wan_keeps_its_experts_in_the_estimate():
    from flowrl.estimate.archs import arch_from_pipeline, load_arch
    from flowrl.estimate.run_checks import check_model_options
    from flowrl.models.testing import tiny_wan_pipeline

    cfg = TrainConfig.from_yaml(None, ["model.family=wan", "model.experts=low"])
    check_model_options(cfg, load_arch("wan22_t2v_a14b"))  # the stored A14B: two transformers
    arch = arch_from_pipeline(tiny_wan_pipeline(two_experts=True))  # a pipeline (or its folder) with transformer_2
    assert arch["transformer_2"]["config"] == arch["transformer"]["config"] and arch["boundary_ratio"] == 0.875
    check_model_options(cfg, arch)
    with pytest.raises(ConfigError, match="has one transformer"):
        check_model_options(cfg, arch_from_pipeline(tiny_wan_pipeline()))


def _edit_prompts(tmp_path, lines: list[str]) -> str:
    for i in range(4):
        Image.new("RGB", (32, 32), (60 * i, 0, 0)).save(tmp_path / f"{i}.png")
    path = tmp_path / "edits.txt"
    path.write_text("\n".join(line.format(d=tmp_path) for line in lines) + "\n")
    return str(path)


EDIT_PLUS = ["configs/qwen_image_edit_plus/flow_grpo_edit.yaml", "--estimate", "prompts.eval=null"]


@pytest.mark.parametrize(
    "line, refusal",
    [
        ("make it green", "line 2: 'make it green' has no source image"),
        ("[image: {d}/0.png] [image: {d}/1.png] [image: {d}/2.png] [image: {d}/3.png] join", "carries 4 images"),
    ],
)
def test_the_edit_plus_estimate_refuses_prompts_a_run_refuses(tmp_path, capsys, line, refusal):
    prompts = _edit_prompts(tmp_path, ["[image: {d}/0.png] make it blue", line])
    assert main(["bench", *EDIT_PLUS, f"prompts.train={prompts}"]) == 2  # max_images: 2 in the preset
    err = capsys.readouterr().err
    assert refusal in err and "prompts.train=" in err


def test_the_edit_plus_estimate_takes_up_to_max_images_per_prompt(tmp_path):
    from flowrl.estimate import load_config
    from flowrl.estimate.run_checks import check_prompts_and_rewards

    prompts = _edit_prompts(tmp_path, ["[image: {d}/0.png] [image: {d}/1.png] join them", "[image: {d}/2.png] blue"])
    cfg = load_config(EDIT_PLUS[0], [f"prompts.train={prompts}", "prompts.eval=null"])
    assert check_prompts_and_rewards(cfg) == []
    cfg = load_config(EDIT_PLUS[0], ["prompts.train=edits/not-here.txt", "prompts.eval=null"])
    assert check_prompts_and_rewards(cfg) == [
        "prompts.train='edits/not-here.txt' is not on this machine: its lines were not checked (a run checks each)"
    ]


# ---- context parallelism: the run's refusal, first and alone ------------------------------------------------------
def test_an_estimate_over_processes_the_degree_does_not_divide_says_so(capsys):
    assert main(["bench", "--estimate", "--gpus", "3", "model.context_parallel.ulysses=4"]) == 2
    err = capsys.readouterr().err
    assert "splits each sample over 4 processes, but this run has 3" in err and "0 of 3" not in err


def test_context_parallelism_on_one_process_is_refused_first_and_alone(tmp_path, capsys):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        code = main(["train", "model.context_parallel.ulysses=2", f"train.output_dir={tmp_path}", "train.max_steps=1"])
    assert code == 2
    assert [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)] == []
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "splits each sample over 2 processes, but this run has 1" in err[0]


# ---- 11: checkpoint_blocks past the blocks -------------------------------------------------------------------------
def test_checkpoint_blocks_past_the_blocks_is_said_and_clamped(recwarn):
    from flowrl.estimate import arch_from_pipeline, estimate
    from flowrl.models.blocks import block_lists, checkpoint_blocks
    from flowrl.models.testing import tiny_sd3_pipeline

    pipe = tiny_sd3_pipeline()
    blocks = len(block_lists(pipe.transformer))
    cfg = TrainConfig.from_yaml(
        None, ["model.family=sd3", "model.gradient_checkpointing=true", "model.checkpoint_blocks=999"]
    )
    shapes = estimate(cfg, arch=arch_from_pipeline(pipe), target="cpu")["shapes"]
    assert shapes["checkpoint_blocks"] == shapes["blocks"] == blocks
    assert checkpoint_blocks(pipe.transformer, 999) == blocks  # the run's blocks
    said = {str(w.message) for w in recwarn if issubclass(w.category, RuntimeWarning)}
    assert (
        f"model.checkpoint_blocks=999 is more than the {blocks} blocks of SD3Transformer2DModel: all {blocks} are "
        "checkpointed (model.checkpoint_blocks=null says every block)" in said
    )


# ---- 12: train.peak_tflops within a physical range; one table of peaks -------------------------------------------
@pytest.mark.parametrize("peak", ["1e-300", "1e300", "0.0001", "20000"])
def test_peak_tflops_outside_a_physical_range_is_refused(peak):
    shown = re.escape(f"train.peak_tflops={float(peak):g} must be in [0.001, 10,000]")
    with pytest.raises(ConfigError, match=shown):
        TrainConfig.from_yaml(None, [f"train.peak_tflops={peak}"])


def test_a_perf_meter_refuses_a_peak_no_device_has():
    from flowrl.training.perf import PerfMeter

    assert PerfMeter(1e12, 2.5).metrics(1.0)["perf/mfu"] == pytest.approx(0.4)
    for peak in (1e-300, 1e300, float("nan")):
        with pytest.raises(ValueError, match="peak_tflops"):
            PerfMeter(1e12, peak)


def test_the_estimate_and_mfu_use_one_table_of_peaks(monkeypatch):
    from flowrl.estimate import GPUS, UTILISATION, estimate
    from flowrl.estimate import device as device_module
    from flowrl.estimate.report import format_estimate

    cfg = TrainConfig.from_yaml(None, [])
    result = estimate(cfg, gpu="H100")
    t = result["time"]
    assert t["gpu_bf16_tflops"] == GPUS["H100"].peak_tflops == 798.0 and "measured" in t["peak_source"]
    assert t["seconds_per_iteration"][0] == pytest.approx(result["flops"]["total"] / (798e12 * UTILISATION[1]))
    assert "of 798 bf16 TFLOP/s (measured" in format_estimate(result)
    monkeypatch.setattr(device_module, "device_at_hand", lambda cfg: ("H100", 79.6, "cuda", "an H100"))
    meter = device_module.perf_meter(cfg, result["flops"]["total"])
    assert meter.peak_tflops == t["gpu_bf16_tflops"] and "measured" in meter.peak_source
    assert estimate(cfg, gpu="A100")["time"]["gpu_bf16_tflops"] == GPUS["A100"].bf16_tflops == 312.0  # datasheet


# ---- 13: train.fit_keep without train.fit --------------------------------------------------------------------------
def test_fit_keep_without_fit_is_refused_as_unread():
    with pytest.raises(ConfigError, match=r"train.fit_keep=\['rollout.max_batch'\] is set but nothing reads it"):
        TrainConfig.from_yaml(None, ["train.fit_keep=[rollout.max_batch]"])
    TrainConfig.from_yaml(None, ["train.fit_keep=[rollout.max_batch]", "train.fit=auto"])


# ---- FLOWRL_COMPILE_BACKEND at load --------------------------------------------------------------------------------
def test_an_unknown_compile_backend_is_refused_at_load_naming_the_variable(monkeypatch):
    from flowrl.models import blocks

    monkeypatch.setattr(blocks, "COMPILE_BACKEND", "nonsense")
    with pytest.raises(ConfigError, match=r"FLOWRL_COMPILE_BACKEND='nonsense' .* is not a backend torch knows"):
        TrainConfig.from_yaml(None, ["model.compile=regional"])
    TrainConfig.from_yaml(None, [])  # not read without model.compile=regional
    monkeypatch.setattr(blocks, "COMPILE_BACKEND", "aot_eager")
    TrainConfig.from_yaml(None, ["model.compile=regional"])


# ---- flowrl bench: the machine view is the JSON alone, the human view the table --------------------------------
def test_bench_estimate_human_view_is_the_table_and_json_view_the_json_alone(capsys):
    assert main(["bench", "--estimate", "train.max_steps=2"]) == 0
    out = capsys.readouterr().out
    assert "## estimate:" in out and "s/iteration" in out and "\n{" not in out and '"memory_gib"' not in out
    assert main(["bench", "--estimate", "--json", "train.max_steps=2"]) == 0
    assert json.loads(capsys.readouterr().out)["estimate"]["memory_gib"]["peak"] > 0


def test_bench_with_fit_auto_prints_its_json_alone_on_stdout(tmp_path, capsys):
    overrides = ["train.fit=auto", "rollout.max_batch=16", "prompts.per_step=2", "train.max_steps=1"]
    assert main(["bench", "--iterations", "1", "--warmup", "0", *overrides]) == 0
    captured = capsys.readouterr()
    assert json.loads(captured.out)["seconds_per_iteration"] > 0
    assert "train.fit=auto for this CPU" in captured.err and "rollout.max_batch = 16" in captured.err
