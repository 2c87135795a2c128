"""scripts/gpu_check.py, the GPU check of issue 46 (docs/gpu.md, "The GPU check"): its ``--tiny`` rehearsal runs
every part on the CPU and writes the Markdown tables and the JSON that docs/gpu.md describes ("gpu_check.json"),
with every row measured; a row whose time runs out is recorded as such; without a GPU and without ``--tiny`` it
stops with one line naming what is missing; ``--help`` documents every flag."""

from __future__ import annotations

import functools
import importlib.util
import json
import math
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "gpu_check.py"
EXPECTED_ROWS = {"presets": 6, "profile": 1, "shapes": 4, "snr": 1}  # 3 presets × (shipped, fitted); main + distill
# × seeds 0, 1


@functools.lru_cache(maxsize=None)
def load_script():
    """scripts/gpu_check.py as a module (registered first: its dataclass looks its module up)."""
    spec = importlib.util.spec_from_file_location("gpu_check_script", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def documented_json() -> dict:
    """The JSON skeleton of docs/gpu.md (the fenced block after ``<!-- gpu_check.json -->``)."""
    text = (ROOT / "docs" / "gpu.md").read_text()
    found = re.search(r"<!-- gpu_check\.json -->\s*```json\n(.*?)```", text, re.S)
    assert found, "docs/gpu.md lost its gpu_check.json skeleton"
    return json.loads(found.group(1))


def check_like(actual, documented, path: str, nullable: bool = False) -> None:
    """``actual`` has every key of ``documented`` with a value of its type; numbers finite; a list of rows
    (documented by one example row) non-empty, every row like the example. ``nullable``: None is accepted."""
    if nullable and actual is None:
        return
    if isinstance(documented, dict):
        assert isinstance(actual, dict), f"{path}: {actual!r} is not an object"
        for key, value in documented.items():
            assert key in actual, f"{path}.{key} missing"
            check_like(actual[key], value, f"{path}.{key}", nullable)
    elif isinstance(documented, list) and documented and isinstance(documented[0], dict):
        assert isinstance(actual, list) and actual, f"{path}: no rows"
        for i, row in enumerate(actual):
            check_like(row, documented[0], f"{path}[{i}]", nullable)
    elif isinstance(documented, bool):
        assert isinstance(actual, bool), f"{path} = {actual!r}, not a boolean"
    elif isinstance(documented, (int, float)):
        assert isinstance(actual, (int, float)) and not isinstance(actual, bool), f"{path} = {actual!r}"
        assert math.isfinite(actual), f"{path} = {actual!r}"
    elif isinstance(documented, list):
        assert isinstance(actual, list), f"{path} = {actual!r}"
        for i, item in enumerate(actual[: len(documented)]):
            check_like(item, documented[i] if i < len(documented) else documented[-1], f"{path}[{i}]", nullable)
    else:
        assert isinstance(actual, str), f"{path} = {actual!r}, not a string"


# The rehearsal's tests below are the slow set's (76 s of runs): the default set holds its parts by cheaper tests,
# test_real_size_random_pipeline_wires_as_the_gpu_run_does (the presets' wiring), test_a_row_out_of_time_is_recorded_
# with_the_files (a row and its files), test_profile_of_a_cpu_step_has_top_ops_gaps_and_syncs (the profile) and
# test_without_gpu_or_tiny_it_names_what_is_missing (the script's start).
RUNS = {"presets": "presets", "rest": "profile,shapes,snr"}
"""The rehearsal in two runs (each well under a minute on 2 cores): the preset pairs, and the other parts."""


def run_tiny(out: Path, parts: str) -> dict:
    """One ``--tiny --parts parts`` run as a user starts it, its folder given by $OUT as on the GPU machine."""
    env = {**os.environ, "OUT": str(out)}
    t0 = time.monotonic()
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--tiny", "--parts", parts, "--work", str(out / "work"), "--commit", "test"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return {
        "out": out,
        "wall": time.monotonic() - t0,
        "json": json.loads((out / "gpu_check.json").read_text()),
        "md": (out / "gpu_check.md").read_text(),
        "stdout": proc.stdout,
        "parts": parts.split(","),
    }


@pytest.fixture(scope="module")
def tiny_presets(tmp_path_factory):
    return run_tiny(tmp_path_factory.mktemp("gpu_check_presets"), RUNS["presets"])


@pytest.fixture(scope="module")
def tiny_rest(tmp_path_factory):
    return run_tiny(tmp_path_factory.mktemp("gpu_check_rest"), RUNS["rest"])


@pytest.fixture(params=list(RUNS))
def tiny(request):
    return request.getfixturevalue(f"tiny_{request.param}")


@pytest.mark.slow
def test_tiny_json_is_what_the_docs_describe(tiny):
    data, documented = tiny["json"], documented_json()
    check_like(data["meta"], documented["meta"], "meta", nullable=True)
    assert data["schema"] == documented["schema"]
    assert list(documented["parts"]) == ["presets", "profile", "shapes", "snr", "seeds", "async"]  # their own files
    assert list(data["parts"]) == tiny["parts"]
    for part, entry in data["parts"].items():
        check_like(entry, documented["parts"][part], f"parts.{part}")
        assert entry["status"] == "ok", (part, entry)
        assert len(entry["rows"]) == EXPECTED_ROWS[part], (part, [r.get("name") for r in entry["rows"]])
        assert all(r["status"] == "ok" for r in entry["rows"]), entry["rows"]
    meta = data["meta"]
    assert meta["tiny"] is True and meta["commit"] == "test" and meta["device_memory_gib"] is None
    assert meta["seconds"] > 0  # its wall time is recorded (a speed target belongs to a benchmark, not a test:
    # the two runs take ≈ 45 and 25 s on 2 idle cores and more on a busy machine)


@pytest.mark.slow
def test_tiny_preset_rows_are_measured_and_consistent(tiny_presets):
    presets = tiny_presets["json"]["parts"]["presets"]["rows"]
    names = ["sd35m_flow_grpo_lora", "sd35m_nft_lora", "flux1dev_nft_lora"]
    assert [r["name"] for r in presets] == [n + suffix for n in names for suffix in ("", "_fitted")]
    assert [r["variant"] for r in presets] == ["shipped", "fit + compile"] * 3
    assert [r["model"] for r in presets] == ["SD3.5-Medium (tiny)"] * 4 + ["FLUX.1-dev (tiny)"] * 2
    for r in presets:
        assert r["seconds_per_iteration"] > 0 and r["estimate"]["flops_per_iteration"] > 0
        assert r["rollout_seconds"] + r["update_seconds"] <= r["seconds_per_iteration"] * 1.05
        assert r["model_tflops_per_second"] == pytest.approx(
            r["model_tflop_per_iteration"] / r["seconds_per_iteration"]
        )
        assert r["fraction_of_peak"] == pytest.approx(r["model_tflops_per_second"] / 790.0)
        assert r["peak_ratio"] == pytest.approx(r["peak_memory_gib"] / r["estimate_peak_gib"])
        assert r["images_per_second"] == pytest.approx(2 / r["seconds_per_iteration"])  # 1 prompt × 2 images
        assert r["bench"]["rollout_forwards"] > 0 and r["iterations"] == 1
    assert presets[0]["settings"]["objective"] == "clipped" and presets[2]["settings"]["objective"] == "nft"


@pytest.mark.slow
def test_tiny_fitted_rows_choose_their_settings_and_compile(tiny_presets):
    """The fitted row of each pair: train.fit=auto's settings on a device just too small for the shipped ones
    (so they differ), the estimate for those settings, regional compilation (eager), the ratio to the shipped row."""
    presets = tiny_presets["json"]["parts"]["presets"]["rows"]
    for shipped, fitted in zip(presets[::2], presets[1::2]):
        fit = fitted["fit"]
        assert fitted["fit_settings"] != shipped["fit_settings"], (shipped["fit_settings"], fitted["fit_settings"])
        for key, value in fit["settings"].items():  # the micro-batch: None (a policy objective's) → its effective one
            assert fitted["fit_settings"][key] == (
                value
                if value is not None or key != "train.micro_batch"
                else fitted["fit_settings"]["rollout.max_batch"]
            ), key
        assert fit["capacity_gib"] == pytest.approx(1.1 * shipped["estimate_peak_gib"])
        assert fit["peak_gib"] <= 0.9 * fit["capacity_gib"] + 1e-12
        assert fit["peak_gib"] < shipped["estimate_peak_gib"]
        assert fitted["estimate_peak_gib"] == pytest.approx(fit["peak_gib"])  # the estimate of the settings used
        assert fitted["settings"]["compile"] == "regional"
        assert fitted["backend"] == "eager" and fitted["compiled_blocks"] >= 2 and fitted["warmup"] == 1
        assert sum(fitted["compiled_graphs"].values()) > 0
        assert fitted["speedup"] == pytest.approx(fitted["images_per_second"] / shipped["images_per_second"])
        assert fitted["settings_text"] != shipped["settings_text"] and fit["summary"]
    # the shipped settings as the presets ship them: the SD3.5-M NFT preset compiles its blocks
    assert [r["settings"]["compile"] for r in presets[::2]] == ["off", "regional", "off"]
    assert presets[2]["compiled_blocks"] >= 2 and "compiled_blocks" not in presets[0]
    md = tiny_presets["md"]
    assert "| sd35m_nft_lora_fitted | fit + compile |" in md and "batch 2 · micro 2 · ckpt yes" in md


@pytest.mark.slow
def test_tiny_profile_has_its_tables_and_a_small_trace(tiny_rest):
    row = tiny_rest["json"]["parts"]["profile"]["rows"][0]
    profile = row["profile"]
    assert row["name"] == "sd35m_flow_grpo_lora" and row["batch"] == "1 × 2" and row["with_stack"] is True
    assert profile["source"] == "host" and profile["cpu_ops"] > 100 and row["iteration_seconds"] > 0
    assert len(profile["top_ops"]) == 15 and all(r["self_cpu_ms"] > 0 and r["calls"] > 0 for r in profile["top_ops"])
    gaps = profile["gaps"]
    assert gaps["count"] > 0 and 0 < gaps["idle_fraction"] < 1 and len(gaps["largest"]) == 10
    assert gaps["idle_seconds"] + gaps["busy_seconds"] <= row["iteration_seconds"] * 1.01
    syncs = {r["name"]: r for r in profile["syncs"]}
    assert syncs["aten::item"]["count"] > 0 and any("flowrl/" in s for s in syncs["aten::item"]["sites"])
    trace = tiny_rest["out"] / row["trace_file"]
    assert trace.is_file() and trace.stat().st_size < 5 * 2**20 and row["trace_mb"] > 0
    assert sorted(p.name for p in tiny_rest["out"].iterdir() if p.is_file()) == [
        "gpu_check.json",
        "gpu_check.md",
        "gpu_check_profile.json.gz",
    ]  # the raw trace stayed in the scratch folder
    md = tiny_rest["md"]
    for heading in (
        "**Top 15 ops by self CPU time",
        "**Gaps between top-level aten ops",
        "**Synchronisations**",
        "**Synchronising call sites of the warm-up iteration**",
        "Trace: `gpu_check_profile.json.gz`",
    ):
        assert heading in md, heading
    assert f"| `{profile['top_ops'][0]['op']}` |" in md and "| `aten::item` |" in md


@pytest.mark.slow
def test_tiny_shapes_and_snr_rows(tiny_rest):
    parts = tiny_rest["json"]["parts"]
    shapes = parts["shapes"]["rows"]
    assert [(r["name"], r["seed"]) for r in shapes] == [("main", 0), ("distill", 0), ("main", 1), ("distill", 1)]
    for r in shapes:
        assert r["updates"] == 2 and r["images"] == 2 * r["images_per_update"] == 16
        assert [step for step, _ in r["curve"]] == [0, 1, 2]  # an eval after every update (--shapes-eval-every 1)
        assert all(
            0 <= r[k] <= 1 for k in ("strict_g1_before", "strict_g1_after", "strict_g3_before", "strict_g3_after")
        )
    assert shapes[1]["overrides"] == ["loss.reward_term=0"] and shapes[0]["overrides"] == []
    assert [a["seed"] for a in parts["shapes"]["answer"]] == [0, 1]  # main against distillation, per seed
    snr = parts["snr"]["rows"][0]
    assert snr["batches"] == 3 and snr["samples_per_batch"] == 8 and -1 <= snr["mean_pairwise_cosine"] <= 1


@pytest.mark.slow
def test_tiny_markdown_has_every_part_and_row(tiny):
    md, script = tiny["md"], load_script()
    sections = re.split(r"^## ", md, flags=re.M)[1:]
    assert [s.splitlines()[0] for s in sections] == [script.TITLES[p] for p in tiny["parts"]]
    for section, part in zip(sections, tiny["parts"]):
        own = section.split("\n\n")[2]  # the part's own table (the profile's tables follow it)
        header = "| " + script.COLUMNS[part][0][0] + " |"
        rows = [line for line in own.splitlines() if line.startswith("| ") and not line.startswith(header)]
        assert len(rows) == EXPECTED_ROWS[part], section
        assert all(line.endswith("| ok |") for line in rows), rows
        cells = [c.strip() for line in rows for c in line.split("|")[1:-1]]
        assert not {"nan", "inf"} & set(cells), rows
        if part != "presets":  # a shipped row has no "fitted / shipped"
            assert "—" not in cells, rows
    assert tiny["md"] in tiny["stdout"]  # printed at the end too


def test_a_row_out_of_time_is_recorded_with_the_files(tmp_path):
    script = load_script()
    meta = {
        "device": "cpu",
        "torch": "x",
        "cuda": None,
        "commit": "c",
        "started": "s",
        "minutes": 1.0,
        "peak_tflops": 790.0,
        "tiny": True,
    }
    report = script.Report(tmp_path, meta, ["snr"])
    budget = script.Budget(100.0, {"snr": 1.0})
    t0 = time.monotonic()

    def sleeper(row: dict) -> dict:
        row["measured_before"] = 1.0  # what a row had measured when its time ran out is kept
        time.sleep(30)
        return row

    row = script.guarded(report, budget, "snr", "sleeper", 1.2, sleeper)
    assert 1.2 <= time.monotonic() - t0 < 5
    assert row["status"] == "out_of_time" and "sleeper" in row["error"] and row["measured_before"] == 1.0
    report.close_part("snr", 2.0, 1.2)
    data = json.loads((tmp_path / "gpu_check.json").read_text())
    assert data["parts"]["snr"]["status"] == "partial" and data["parts"]["snr"]["rows"][0]["status"] == "out_of_time"
    assert "| out_of_time: snr/sleeper: stopped after" in (tmp_path / "gpu_check.md").read_text()


def test_budget_shares_what_is_left_by_weight():
    script = load_script()
    budget = script.Budget(90.0, {"a": 1.0, "b": 2.0})
    assert budget.allot("a") == pytest.approx(30.0, abs=0.5)
    assert budget.allot("b") == pytest.approx(90.0, abs=0.5)  # the last part gets all that is left
    assert budget.given == pytest.approx({"a": 30.0, "b": 90.0}, abs=0.5)


def load_profile_module():
    """scripts/gpu_profile.py as a module."""
    if str(ROOT / "scripts") not in sys.path:
        sys.path.insert(0, str(ROOT / "scripts"))
    import gpu_profile

    return gpu_profile


def toy_step():
    """A few ops and two reads back to Python, as an iteration has (matmuls, a loss, .item())."""
    import torch

    x = torch.randn(64, 64)
    for _ in range(5):
        x = torch.tanh(x @ x.T / 64)
    loss = x.pow(2).mean()
    return loss.item() + x.sum().item()


@pytest.mark.parametrize("with_stack", [False, True])
def test_profile_of_a_cpu_step_has_top_ops_gaps_and_syncs(tmp_path, with_stack):
    """scripts/gpu_profile.py on a trace made on the CPU: the top ops by self CPU time, gaps between the top-level aten
    ops, the ``.item()`` synchronisations (with this file as their call site when stacks are on), the trace written."""
    gp = load_profile_module()
    summary = gp.profile_step(toy_step, tmp_path / "trace.json.gz", tmp_path, cuda=False, with_stack=with_stack)
    assert summary["source"] == "host" and summary["device_events"] == 0 and summary["iteration_seconds"] > 0
    ops = {r["op"]: r for r in summary["top_ops"]}
    assert {"aten::mm", "aten::tanh"} <= set(ops) and ops["aten::tanh"]["calls"] == 5
    assert all(r["self_cuda_ms"] is None and r["self_cpu_ms"] >= 0 for r in summary["top_ops"])
    assert summary["gaps"]["count"] >= 5 and summary["gaps"]["largest"][0]["ms"] >= summary["gaps"]["largest"][-1]["ms"]
    syncs = {r["name"]: r for r in summary["syncs"]}
    assert syncs["aten::item"]["count"] == 2 and syncs["aten::_local_scalar_dense"]["count"] == 2
    sites = syncs["aten::item"]["sites"]
    assert (sites and "test_gpu_check.py" in sites[0] and "toy_step" in sites[0]) if with_stack else sites == []
    assert (tmp_path / "trace.json.gz").is_file() and summary["trace_trimmed"] is None
    assert not (tmp_path / "profile_trace.json").exists()
    events = gp.load_events(tmp_path / "trace.json.gz")  # the written trace reads back to the same tables
    assert gp.summarize(events)["syncs"][0]["count"] == 2
    md = "\n".join(gp.markdown(summary, {}))
    assert "| `aten::item` | 2 |" in md and "no CUDA" in md


def test_profile_tables_of_a_gpu_shaped_trace():
    """The device path of scripts/gpu_profile.py on a hand-made trace shaped as a CUDA one (kernels and copies on a
    stream, linked to their aten op by ``External id``; a ``.item()`` that copies to the host and synchronises)."""
    gp = load_profile_module()

    def x(cat, name, ts, dur, ext=None, tid=1, pid=1):
        return {
            "ph": "X",
            "cat": cat,
            "name": name,
            "ts": ts,
            "dur": dur,
            "pid": pid,
            "tid": tid,
            "args": {} if ext is None else {"External id": ext},
        }

    events = [
        x("user_annotation", gp.ITERATION, 0, 1000),
        x("python_function", "flowrl/training/updater.py(10): _step", 10, 500),
        x("python_function", "torch/_tensor.py(5): item", 95, 210),
        x("cpu_op", "aten::mm", 20, 30, 1),
        x("cuda_runtime", "cudaLaunchKernel", 25, 5, 1),
        x("cpu_op", "aten::item", 100, 200, 2),
        x("cpu_op", "aten::_local_scalar_dense", 105, 190, 3),
        x("cuda_runtime", "cudaMemcpyAsync", 110, 5, 3),
        x("cuda_runtime", "cudaStreamSynchronize", 120, 170, 3),
        x("cpu_op", "aten::add", 390, 10, 4),
        x("kernel", "sm90_xmma_gemm_bf16", 30, 60, 1, tid=7, pid=0),
        x("gpu_memcpy", "Memcpy DtoH (Device -> Pageable)", 115, 5, 3, tid=7, pid=0),
        x("kernel", "vectorized_elementwise_kernel", 400, 50, 4, tid=7, pid=0),
        {"ph": "s", "name": "arrow", "ts": 25},
    ]
    summary = gp.summarize(events)
    assert summary["source"] == "device" and summary["device_events"] == 3 and summary["iteration_seconds"] == 1e-3
    top = {r["op"]: r for r in summary["top_ops"]}
    assert [r["op"] for r in summary["top_ops"]][:3] == ["aten::mm", "aten::add", "aten::_local_scalar_dense"]
    assert top["aten::mm"]["self_cuda_ms"] == pytest.approx(0.06) and top["aten::mm"]["cuda_share"] == pytest.approx(
        60 / 115
    )
    assert "aten::item" not in top  # no device time of its own: its copy is its nested op's
    ops = gp.complete(events, ("cpu_op",))
    own = gp.self_times(ops, gp.nest(gp.complete(events, gp.HOST_CATS)))
    assert own[id(ops[1])] == pytest.approx(10)  # aten::item: 200 µs less its nested op's 190
    gaps = summary["gaps"]
    assert gaps["source"] == "device" and gaps["count"] == 2 and gaps["idle_seconds"] == pytest.approx(305e-6)
    assert gaps["idle_fraction"] == pytest.approx(0.305) and gaps["busy_seconds"] == pytest.approx(115e-6)
    largest = gaps["largest"][0]
    assert largest["ms"] == pytest.approx(0.28) and largest["before"].startswith(
        "aten::_local_scalar_dense → Memcpy DtoH"
    )
    assert largest["after"] == "aten::add → vectorized_elementwise_kernel"
    syncs = {r["name"]: r for r in summary["syncs"]}
    assert set(syncs) == {"cudaStreamSynchronize", "aten::item", "aten::_local_scalar_dense", "Memcpy DtoH"}
    assert all(r["count"] == 1 and r["sites"] == ["flowrl/training/updater.py(10): _step ×1"] for r in syncs.values())
    md = "\n".join(gp.markdown(summary, {"flowrl/training/updater.py(10): _step": 3}))
    assert "**Top 3 ops by self CUDA time**" in md and "**Gaps between kernels and copies (all streams)**" in md
    assert "| `flowrl/training/updater.py(10): _step` | 3 |" in md


def test_profile_trace_is_trimmed_to_its_limit(tmp_path):
    gp = load_profile_module()
    gp.profile_step(toy_step, tmp_path / "full.json.gz", tmp_path, cuda=False, with_stack=True)
    trace = {"traceEvents": gp.load_events(tmp_path / "full.json.gz")}
    full = (tmp_path / "full.json.gz").stat().st_size
    lean = gp.write_trace(trace, tmp_path / "lean.json.gz", int(0.5 * full))
    assert "Python frames" in lean["trace_trimmed"] and (tmp_path / "lean.json.gz").stat().st_size <= 0.5 * full
    short = gp.write_trace(trace, tmp_path / "short.json.gz", 600)
    assert "first" in short["trace_trimmed"] and (tmp_path / "short.json.gz").stat().st_size <= 600 * 1.2


def test_sync_sites_name_the_calling_frame():
    """What the warm-up's recorder keeps of a synchronising call: its innermost frame outside the libraries."""
    import traceback

    gp = load_profile_module()
    frame = traceback.extract_stack()[-1]
    assert gp.site_of_stack([frame]) == f"test_gpu_check.py({frame.lineno}): {frame.name}"
    with gp.sync_sites(cuda=False) as sites:
        toy_step()
    assert sites == {}  # on a CPU nothing synchronises
    assert gp.short_path("/x/lib/python3.12/site-packages/torch/nn/module.py") == "torch/nn/module.py"
    assert gp.short_path("/work/main/flowrl/training/updater.py") == "flowrl/training/updater.py"


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="this machine has a GPU")
def test_without_gpu_or_tiny_it_names_what_is_missing(tmp_path):
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--out", str(tmp_path / "out")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "a CUDA GPU" in lines[0] and "--tiny" in lines[0], proc.stderr
    assert "Traceback" not in proc.stderr and not (tmp_path / "out").exists()


def test_help_documents_every_flag():
    script = load_script()
    parser = script.build_parser()
    text = parser.format_help()
    for action in parser._actions:
        assert action.help, f"{action.option_strings} has no help"
        for option in action.option_strings:
            assert option in text
    assert {"--out", "--minutes", "--tiny", "--parts", "--peak-tflops", "--commit"} <= {
        o for a in parser._actions for o in a.option_strings
    }


@pytest.mark.parametrize(
    "name, sequence, tokens, pooled, transformer",
    [
        ("sd35_medium", 256, 77 + 256, 2048, 2_243_171_520),  # configs/sd35/*: 77 CLIP + 256 T5 tokens
        ("flux1_dev", 512, 512, 768, 11_901_408_320),
    ],
)  # configs/flux/nft_pickscore.yaml: 512 T5 tokens
def test_real_size_random_pipeline_wires_as_the_gpu_run_does(name, sequence, tokens, pooled, transformer):
    """The real-size pipeline the GPU check builds on ``cuda``, built on the meta device (no memory): the stored
    architecture's parameters (the estimate's counts, docs/estimate.md), a T5-XXL among the text encoders, all in
    bf16, and the adapter's prompt encoding and velocity at the presets' lengths."""
    import torch

    from flowrl import wrap
    from flowrl.estimate.archs import load_arch
    from flowrl.models.random_init import random_pipeline

    pipe = random_pipeline(load_arch(name), "meta", torch.bfloat16)
    modules = {n: m for n, m in pipe.components.items() if isinstance(m, torch.nn.Module)}
    params = {n: sum(p.numel() for p in m.parameters()) for n, m in modules.items()}
    assert params["transformer"] == transformer
    assert max(v for n, v in params.items() if n.startswith("text_encoder")) == 4_762_310_656  # T5-XXL's encoder
    assert {p.dtype for m in modules.values() for p in m.parameters()} == {torch.bfloat16}
    model = wrap(pipe, device="meta", dtype=torch.bfloat16, height=512, width=512, max_sequence_length=sequence)
    cond = model.encode(["a photo of a cat", "a dog"])
    assert tuple(cond.cond["prompt_embeds"].shape) == (2, tokens, 4096) and tuple(cond.cond["pooled"].shape) == (
        2,
        pooled,
    )
    sigma = torch.full((2,), 0.5, device="meta")
    velocity = model.velocity(torch.zeros(2, *model.latent_shape, device="meta"), sigma, cond)
    assert tuple(velocity.shape) == (2, 16, 64, 64)
