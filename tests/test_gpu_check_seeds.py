"""scripts/gpu_check.py's parts of issue 65 (docs/gpu.md, "The seeds part" and "The shapes question"): the closed forms
the seeds rows are held to (docs/algorithms.md "Chains", docs/trees.md "Cost: closed forms", docs/step_credit.md
"TP-GRPO") and the GPU rows' settings that give the published numbers;
the verdicts; which low-precision matmul an explorer ran; the ``--tiny`` rehearsal of both parts on the CPU (rows
measured, counts equal to their closed forms, ratios to the baselines, the shapes answer); scripts/gpu_check.sh's
install of a carried torchao wheel. The command-line runs (the shapes
runs as two processes) are in the slow set."""

from __future__ import annotations

import json
import math
import os
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.test_gpu_check import ROOT, SCRIPT, documented_json, load_script

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


def script_args(tmp_path: Path, *extra: str):
    script = load_script()
    args = script.parse_args(["--out", str(tmp_path / "out"), "--work", str(tmp_path / "work"), *extra])
    args.work.mkdir(parents=True, exist_ok=True)
    return args


def check_keys(actual: dict, documented: dict, path: str, optional: set[str] = frozenset()) -> None:
    """``actual`` has every key of ``documented`` (but ``optional``), with a value of its type; a documented null
    accepts anything (a key that may be null), a documented object is checked key by key."""
    for key, value in documented.items():
        if key in optional and key not in actual:
            continue
        assert key in actual, f"{path}.{key} missing"
        got = actual[key]
        if value is None or (key in optional and got is None):
            continue
        if isinstance(value, dict) and value:
            check_keys(got, value, f"{path}.{key}")
        elif isinstance(value, bool):
            assert isinstance(got, bool), f"{path}.{key} = {got!r}"
        elif isinstance(value, (int, float)):
            assert isinstance(got, (int, float)) and not isinstance(got, bool), f"{path}.{key} = {got!r}"
            assert math.isfinite(got), f"{path}.{key} = {got!r}"
        else:
            assert isinstance(got, type(value)), f"{path}.{key} = {got!r}, not {type(value).__name__}"


# ---- the closed forms -----------------------------------------------------------------------------------------
def test_closed_forms_are_the_published_numbers():
    s = load_script()
    tree = s.tree_closed_form(20, 2, [0, 3, 6, 9])
    assert (tree["forwards"], tree["trained_edges"], tree["leaves"]) == (203, 218, 16)  # docs/trees.md
    pruned = s.tree_closed_form(20, 2, [0, 3, 6, 9], prune_size=4, prune_every=30)
    assert (pruned["trained_edges"], pruned["unpruned_edges"]) == (154, 218)  # docs/trees.md: child steps 11–14
    for iteration in (30, 200):  # the window slides (to child steps 17–20 at most), over as many nodes
        assert s.tree_closed_form(20, 2, [0, 3, 6, 9], prune_size=4, iteration=iteration)["trained_edges"] == 154
    assert s.tree_closed_form(20, 2, [0, 3, 6, 9], mode="mix", mix_window=4)["trained_edges"] == 34
    independent = s.chains_closed_form(20, 16, list(range(19)), shared_noise=False)
    assert (independent["forwards"], independent["trained_edges"]) == (
        320,
        304,
    )  # the trees doc's 320: last step too
    assert s.chains_closed_form(20, 16, list(range(19)), shared_noise=True)["forwards"] == 305
    assert s.chains_closed_form(20, 16, [5, 6, 7, 8], shared_noise=True)["forwards"] == 6 + 16 * 14
    tp = s.tp_closed_form(10, 1, 9)
    assert (tp["forwards"], tp["trained_edges"], tp["reward_calls"]) == (64, 9, 10)  # TP-GRPO: 64 vs 10 per chain
    assert s.chains_closed_form(10, 1, list(range(9)), shared_noise=False)["forwards"] == 10


def test_gpu_rows_give_the_published_settings(tmp_path):
    """The rows as the GPU runs them (configs loaded, no model built): FLUX.1-dev at 16 images per prompt and 20 steps,
    SD3.5-M at 8 chains over 10 steps, and each row's closed form the number its claim quotes."""
    from flowrl.config.build import build_plan
    from flowrl.estimate import load_config

    s = load_script()
    args = script_args(tmp_path, "--parts", "seeds")
    expected = {  # forwards, trained edges, leaves per prompt
        "sd35m_chains": (80, 72, 8),
        "sd35m_tp_grpo": (512, 72, 8),  # 64 per chain
        "flux_dance_grpo": (305, 304, 16),
        "flux_branchgrpo": (203, 154, 16),
        "flux_branchgrpo_mix": (203, 34, 16),
        "flux_mix_grpo": (305, 64, 16),
    }
    for spec in s.SEEDS:
        cfg = load_config(s.preset_path(spec.config), s.seed_overrides(spec, args), "H100")
        assert cfg.model.device == "cuda" and cfg.prompts.per_step == 1
        assert [r.name for r in cfg.rewards] == ["jpeg_compressibility"]
        if spec.kind == "explore":
            assert cfg.rollout.plan == "explore" and cfg.rollout.preview_steps == 6
            continue
        closed = s.closed_form(build_plan(cfg.rollout), args.seeds_warmup, cfg.train.seed)
        assert (closed["forwards"], closed["trained_edges"], closed["leaves"]) == expected[spec.name], spec.name
        if spec.arch == "flux1_dev":
            assert (cfg.model.height, cfg.model.width) == (256, 256)
    assert [spec.name for spec in s.SEEDS if spec.baseline is None and spec.kind == "bench"] == [
        "sd35m_chains",
        "flux_dance_grpo",
    ]
    assert sum(spec.weight for spec in s.SEEDS) == pytest.approx(7.7)


def test_verdicts():
    s = load_script()
    assert s.ratio_verdict(0.44, 0.45).startswith("as claimed")
    assert s.ratio_verdict(0.5, 0.45).startswith("as claimed")  # within 15 %
    assert s.ratio_verdict(0.6, 0.45).startswith("faster, short of the claim")
    assert s.ratio_verdict(1.1, 0.45).startswith("not faster")
    assert s.ratio_verdict(float("nan"), 0.45) == "not measured"
    spec = next(x for x in s.SEEDS if x.name == "flux_branchgrpo")
    row = {"counts_match": False, "forwards": 210.0, "forwards_closed": 203, "edges": 154.0, "edges_closed": 154}
    verdict = s.seed_verdict({**row, "ratio": 0.4}, {"name": "flux_dance_grpo"}, spec)
    assert verdict.startswith("as claimed") and "counts differ from the closed form (forwards 210 vs 203" in verdict
    assert s.seed_verdict({**row, "ratio": 0.4}, None, spec).startswith("baseline flux_dance_grpo not measured")


@pytest.mark.parametrize(
    "counts, backend, layers, expected",
    [
        (
            {"ops": {"aten::_scaled_mm": 12, "aten::linear": 14}, "kernels": {"sm90_xmma_gemm_e4m3bf16_tn": 12}},
            "fp8",
            12,
            "torch._scaled_mm (FP8 tensor-core GEMM): aten::_scaled_mm ×12; kernel sm90_xmma_gemm_e4m3bf16_tn",
        ),
        ({"ops": {"mslk::f8f8bf16_rowwise": 5}, "kernels": {}}, "fp8", 5, "MSLK/FBGEMM f8f8bf16 rowwise"),
        ({"ops": {"quantized::linear_dynamic": 29}, "kernels": {}}, "int8", 29, "torch.ao dynamic int8"),
        ({"ops": {"aten::addmm": 30}, "kernels": {}}, "fp8", 30, "no low-precision matmul ran: 30 fp8 layers"),
        ({"ops": {"aten::addmm": 30}, "kernels": {}}, "bf16", 0, "bf16 matmuls (aten::addmm)"),
    ],
)
def test_low_precision_path_names_what_ran(counts, backend, layers, expected):
    from tests.test_gpu_check import load_profile_module

    assert load_profile_module().low_precision_path(counts, backend, layers).startswith(expected)


def test_matmul_ops_counts_the_products_of_a_call():
    import torch

    from tests.test_gpu_check import load_profile_module

    x = torch.randn(8, 8)
    layer = torch.nn.Linear(8, 8)
    counts = load_profile_module().matmul_ops(lambda: layer(x) @ x, cuda=False)
    assert counts["kernels"] == {} and counts["ops"]["aten::linear"] == 1 and counts["ops"]["aten::matmul"] == 1


def test_parts_default_planned_and_budget(tmp_path, capsys):
    s = load_script()
    assert script_args(tmp_path).parts == ["presets", "profile", "shapes", "snr"]  # seeds only when named
    assert script_args(tmp_path, "--parts", "seeds,shapes,seeds").parts == ["seeds", "shapes"]
    assert script_args(tmp_path, "--parts", "shapes,async").parts == ["shapes", "async"]  # async: its own test file
    weights = s.budget_weights(["seeds", "shapes"])
    assert list(weights)[:8] == [f"seeds/{x.name}" for x in s.SEEDS] and weights["shapes"] == 1.2
    assert s.part_keys("seeds") == list(weights)[:8] and s.part_keys("snr") == ["snr"]


def test_report_tables_by_kind():
    s = load_script()
    columns = {"a": ("**A**", [("row", "name")]), "b": ("**B**", [("row", "name")])}
    lines = s.Report.tables([{"name": "x", "kind": "b"}, {"name": "y"}, {"name": "z", "kind": "a"}], columns)
    text = "\n".join(lines)
    assert text.index("**A**") < text.index("| y |") < text.index("| z |") < text.index("**B**") < text.index("| x |")


# ---- the --tiny rehearsal of the seeds part -----------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_seeds(tmp_path_factory):
    """The seeds part at --tiny in this process (≈ 8 s on 2 cores): its report's rows and files."""
    s = load_script()
    tmp = tmp_path_factory.mktemp("seeds")
    args = script_args(tmp, "--tiny", "--parts", "seeds", "--commit", "test")
    report = s.Report(args.out, s.environment(args), args.parts)
    budget = s.Budget(600.0, s.budget_weights(args.parts))
    s.run_seeds(report, budget, args)
    report.close_part("seeds", budget.elapsed(), 600.0)
    return {
        "rows": {r["name"]: r for r in report.rows("seeds")},
        "json": json.loads((Path(args.out) / "gpu_check.json").read_text()),
        "md": (Path(args.out) / "gpu_check.md").read_text(),
    }


def test_tiny_seeds_rows_are_measured_against_their_closed_forms(tiny_seeds):
    s, rows = load_script(), tiny_seeds["rows"]
    assert list(rows) == [x.name for x in s.SEEDS] and all(r["status"] == "ok" for r in rows.values())
    bench = {n: r for n, r in rows.items() if r["kind"] == "bench"}
    expected = {  # the tiny shapes: chains of 4 over 6 steps, trees splitting at 0 and 2, TP over 2 chains of 4 steps
        "sd35m_chains": (8, 6),
        "sd35m_tp_grpo": (26, 6),
        "flux_dance_grpo": (21, 20),
        "flux_branchgrpo": (17, 16),
        "flux_branchgrpo_mix": (17, 8),
        "flux_mix_grpo": (21, 8),
    }
    for name, r in bench.items():
        assert (r["forwards"], r["edges"]) == expected[name] == (r["forwards_closed"], r["edges_closed"]), name
        assert r["counts_match"] is True and r["seconds_per_iteration"] > 0 and r["iterations"] == 1
        assert r["rollout_seconds"] + r["update_seconds"] <= r["seconds_per_iteration"] * 1.05
        if r["baseline"] is not None:
            base = rows[r["baseline"]]
            assert r["ratio"] == pytest.approx(r["seconds_per_iteration"] / base["seconds_per_iteration"])
            assert r["forwards_ratio"] == pytest.approx(r["forwards"] / base["forwards"])
    assert rows["sd35m_tp_grpo"]["verdict"].startswith("as stated: 13 vs 4 forwards per image")
    assert rows["sd35m_tp_grpo"]["nfe"] == 2 * 26  # CFG: two evaluations per forward
    # the chains baseline trains as TP-GRPO does: only the plan and the credit rule differ
    assert rows["sd35m_chains"]["loss_from"] == "configs/sd35/tp_grpo_pickscore.yaml"
    assert rows["sd35m_chains"]["update_settings"] == rows["sd35m_tp_grpo"]["update_settings"]
    for name in ("flux_branchgrpo", "flux_branchgrpo_mix", "flux_mix_grpo"):
        verdict = bench[name]["verdict"]
        assert verdict.split(":")[0] in ("as claimed", "faster, short of the claim", "not faster"), verdict
        assert verdict.endswith("counts as the closed form") and rows[name]["baseline"] == "flux_dance_grpo"
    assert rows["flux_dance_grpo"]["verdict"] == "baseline; counts as the closed form"


def test_tiny_explorer_rows_say_which_path_ran(tiny_seeds):
    for name in ("sd35m_explorer", "flux_explorer"):
        r = tiny_seeds["rows"][name]
        assert r["backends"] == "bf16 → int8" and r["candidates"] == 4 and r["quantized_layers"] > 0
        assert r["base_rate"] > 0 and r["low_rate"] > 0 and r["ratio"] == pytest.approx(r["low_rate"] / r["base_rate"])
        assert r["path"].startswith("torch.ao dynamic int8 (quantized::linear_dynamic): quantized::linear_dynamic ×")
        assert r["base"]["path"].startswith("bf16 matmuls (aten::") and r["base"]["quantized_layers"] == 0
        assert r["verdict"].startswith("faster" if r["ratio"] > 1 else "not faster")


def test_tiny_seeds_files_are_what_the_docs_describe(tiny_seeds):
    documented = documented_json()["parts"]["seeds"]["rows"]
    examples = {row["kind"]: row for row in documented}
    for row in tiny_seeds["json"]["parts"]["seeds"]["rows"]:
        optional = {"ratio", "forwards_ratio", "edges_ratio", "baseline", "claimed_ratio", "loss_from"}
        check_keys(row, examples[row["kind"]], row["name"], optional if row["kind"] == "bench" else {"torchao"})
    md = tiny_seeds["md"]
    bench_at, explore_at = md.index("**Trees and windows against chains**"), md.index("**Sol-RL's explorer")
    for name, r in tiny_seeds["rows"].items():
        line = next(x for x in md.splitlines() if x.startswith(f"| {name} |"))
        assert (md.index(line) < explore_at) == (r["kind"] == "bench") and md.index(line) > bench_at
        assert line.endswith("| ok |") and r["verdict"] in line


# ---- the --tiny rehearsal of the shapes part ----------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_shapes(tmp_path_factory):
    """The shapes part at --tiny, seed 0, in this process: main and distillation, two updates each, an eval after
    each update."""
    s = load_script()
    tmp = tmp_path_factory.mktemp("shapes")
    args = script_args(tmp, "--tiny", "--parts", "shapes", "--seeds", "0", "--commit", "test")
    report = s.Report(args.out, s.environment(args), args.parts)
    budget = s.Budget(600.0, s.budget_weights(args.parts))
    s.run_shapes(report, budget, args)
    return {"entry": report.data["parts"]["shapes"], "md": report.markdown()}


def test_tiny_shapes_runs_evaluate_every_update_and_answer(tiny_shapes):
    rows, answer = tiny_shapes["entry"]["rows"], tiny_shapes["entry"]["answer"]
    assert [(r["name"], r["seed"], r["status"]) for r in rows] == [("main", 0, "ok"), ("distill", 0, "ok")]
    for r in rows:
        assert r["updates"] == 2 and [step for step, _ in r["curve"]] == [0, 1, 2] and r["eval_every"] == 1
        assert r["curve"][0][1] == r["strict_g1_before"] and r["curve"][-1][1] == r["strict_g1_after"]
        assert r["eval_images"] == 4 and r["parallel"] == 1
    (a,) = answer
    main, distill = (dict(map(tuple, r["curve"]))[2] for r in rows)
    assert a["at_updates"] == "2" and a["difference"] == pytest.approx(main - distill) and a["updates"] == [2, 2]
    md = tiny_shapes["md"]
    assert "**Held-out strict accuracy at guidance 1 against updates**" in md and "| run | seed | 0 | 1 | 2 |" in md
    assert "**Does the reward add anything over distillation?**" in md and a["verdict"] in md


def curve_row(name: str, curve: list[tuple[int, float]], n: int = 480) -> dict:
    return {"name": name, "seed": 0, "curve": [list(p) for p in curve], "eval_images": n, "updates": curve[-1][0]}


@pytest.mark.parametrize(
    "main, distill, verdict",
    [
        ([(0, 0.385), (50, 0.50), (100, 0.62), (120, 0.63)], [(0, 0.385), (50, 0.50), (100, 0.52)], "the reward adds"),
        ([(0, 0.385), (50, 0.50), (100, 0.53)], [(0, 0.385), (50, 0.50), (100, 0.52), (110, 0.6)], "no difference"),
        ([(0, 0.385), (50, 0.40), (100, 0.41)], [(0, 0.385), (50, 0.50), (100, 0.55)], "distillation alone is ahead"),
    ],
)
def test_shapes_answer_compares_at_the_last_common_eval(main, distill, verdict):
    s = load_script()
    (a,) = s.shapes_answer([curve_row("main", main), curve_row("distill", distill)])
    assert a["at_updates"] == "100" and a["verdict"].startswith(verdict)
    b, c = dict(main)[100], dict(distill)[100]
    assert a["two_se"] == pytest.approx(2 * math.sqrt((b * (1 - b) + c * (1 - c)) / 480))


def test_shapes_answer_without_a_common_eval_compares_the_ends():
    s = load_script()
    (a,) = s.shapes_answer([curve_row("main", [(0, 0.4), (37, 0.52)]), curve_row("distill", [(0, 0.4), (42, 0.5)])])
    assert a["at_updates"] == "37 / 42 (each at its end)" and a["difference"] == pytest.approx(0.02)
    assert s.shapes_answer([curve_row("main", [(0, 0.4)])]) == []  # distillation not measured: no answer


# ---- scripts/gpu_check.sh ------------------------------------------------------------------------------------------
STUB = """#!/usr/bin/env bash
# a stand-in interpreter: logs its calls; "import diffusers, omegaconf" fails when $HAVE_DIFFUSERS is 0, the torchao
# lookup when $HAVE_TORCHAO is 0
echo "$*" >> "$CALLS"
case "$*" in
  *"import diffusers, omegaconf"*) [ "$HAVE_DIFFUSERS" = 1 ];;
  *"find_spec('torchao')"*) [ "$HAVE_TORCHAO" = 1 ];;
  *) exit 0;;
esac
"""


@pytest.mark.parametrize(
    "diffusers, torchao, wheels, installs, rc",
    [
        (1, 0, ["torchao-0.18.0-cp310-abi3-manylinux_2_28_x86_64.whl"], True, 0),  # torchao carried and missing
        (1, 1, ["torchao-0.18.0-cp310-abi3-manylinux_2_28_x86_64.whl"], False, 0),  # nothing missing
        (1, 0, [], False, 0),  # no torchao carried: the check runs, its fp8 rows say what is missing
        (0, 1, ["diffusers-0.42.1-py3-none-any.whl", "omegaconf-2.4.0-py3-none-any.whl"], True, 0),
        (0, 1, [], False, 3),  # diffusers missing and nothing carried: exit 3, naming it
    ],
)
def test_gpu_check_sh_installs_what_is_missing(tmp_path, diffusers, torchao, wheels, installs, rc):
    (tmp_path / "scripts").mkdir()
    sh = tmp_path / "scripts" / "gpu_check.sh"
    sh.write_text((ROOT / "scripts" / "gpu_check.sh").read_text())
    (tmp_path / "gpu_wheels").mkdir()
    for name in wheels:
        (tmp_path / "gpu_wheels" / name).write_text("")
    stub = tmp_path / "python"
    stub.write_text(STUB)
    stub.chmod(stub.stat().st_mode | stat.S_IEXEC)
    env = {**os.environ, "PYTHON": str(stub), "CALLS": str(tmp_path / "calls"), "HAVE_DIFFUSERS": str(diffusers)}
    env["HAVE_TORCHAO"] = str(torchao)
    proc = subprocess.run(["bash", str(sh), "--parts", "seeds"], env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == rc, proc.stderr
    calls = (tmp_path / "calls").read_text().splitlines()
    wheel_installs = [c for c in calls if c.startswith("-m pip install") and "gpu_wheels/" in c]
    assert bool(wheel_installs) == installs, calls
    if installs:
        assert all(f"gpu_wheels/{name}" in wheel_installs[0] for name in wheels) and "--no-index" in wheel_installs[0]
    if rc == 0:
        assert calls[-1] == "scripts/gpu_check.py --parts seeds" and any("-e ." in c for c in calls)
    else:
        assert "diffusers or omegaconf is missing and gpu_wheels/ holds no wheel" in proc.stderr


# ---- through the command line (slow) -------------------------------------------------------------------------------
@pytest.mark.slow
def test_tiny_seeds_and_shapes_from_the_command_line(tmp_path):
    """``--tiny --parts seeds,shapes`` as a user starts it: both parts' files; the shapes runs as two processes at once
    (``--shapes-parallel 2``), each evaluated after every update, the pair overlapping in time."""
    t0 = time.monotonic()
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--tiny", "--parts", "seeds,shapes", "--seeds", "0", "--shapes-parallel", "2"]
        + ["--out", str(tmp_path / "out"), "--work", str(tmp_path / "work"), "--commit", "test"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    data = json.loads((tmp_path / "out" / "gpu_check.json").read_text())
    assert list(data["parts"]) == ["seeds", "shapes"] and data["meta"]["parts"] == ["seeds", "shapes"]
    assert {e["status"] for e in data["parts"].values()} == {"ok"} and len(data["parts"]["seeds"]["rows"]) == 8
    rows = data["parts"]["shapes"]["rows"]
    assert [(r["name"], r["parallel"], r["status"]) for r in rows] == [("main", 2, "ok"), ("distill", 2, "ok")]
    first_end = min(r["started_seconds"] + r["wall_seconds"] for r in rows)
    assert max(r["started_seconds"] for r in rows) < first_end  # both were running at once
    for r in rows:
        assert r["updates"] == 2 and [step for step, _ in r["curve"]] == [0, 1, 2] and r["threads"] >= 1
        assert (tmp_path / "work" / r["log"]).is_file()
    assert data["parts"]["shapes"]["answer"][0]["at_updates"] == "2"
    assert time.monotonic() - t0 < 300
