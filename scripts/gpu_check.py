#!/usr/bin/env python
"""The GPU check (issue 46): one command, ≤ --minutes on one H100/H200, one Markdown file of tables and one JSON.

Parts (each gets a share of --minutes, stops cleanly when its time is out, and the files are rewritten after
every row, so a kill leaves what was measured):

- ``presets``: SD3.5-Medium Flow-GRPO LoRA, SD3.5-Medium DiffusionNFT LoRA and FLUX.1-dev DiffusionNFT LoRA at their
  real size, resolution and steps, random weights built on the GPU from the stored architectures
  (flowrl/models/random_init.py), a cheap reward (jpeg_compressibility), inline prompts: ``flowrl bench``'s
  timings (:func:`flowrl.commands.bench.bench_iteration`: s/iteration split into rollout, reward and update, peak
  ``torch.cuda.max_memory_allocated``) after one warm-up, against ``flowrl bench --estimate`` at the same settings
  (:func:`flowrl.estimate.estimate`: its peak memory → the ratio; its FLOPs per iteration → model TFLOP/s and the
  fraction of the card's measured bf16 peak, --peak-tflops); each preset twice, side by side: at its shipped
  settings, then with ``train.fit=auto`` (:func:`flowrl.estimate.fit.fit_config` for this GPU) and
  ``model.compile=regional`` (each transformer block under ``torch.compile``);
- ``profile``: one Flow-GRPO iteration (the SD3.5-Medium preset at shipped settings, after its warm-up) under
  ``torch.profiler``: the top ops, the device's idle gaps, the synchronisations and their call sites
  (scripts/gpu_profile.py), and the gzipped Chrome trace beside gpu_check.md;
- ``shapes``: the main job (configs/shapes/nft.yaml) and guidance distillation alone (``loss.reward_term=0``) at
  1,024 images per update (16 prompts × 64), both at once (two ``flowrl train`` processes on the one GPU) for as long
  as the part's share of --minutes, held-out strict accuracy at guidance 1 every 50 updates (and at 3 before and
  after): does the reward add anything over distillation?
- ``snr``: ``flowrl snr --reward-only`` (:func:`flowrl.commands.snr.gradient_snr`) of the main job at 1,024 images per
  batch;
- ``seeds`` (issue 65, not in the default parts): the seed methods' cost claims on real-size models with random
  weights — FLUX.1-dev BranchGRPO, BranchGRPO-Mix and MixGRPO against DanceGRPO chains at 16 images per prompt
  (s/iteration, rollout forwards and trained edges against the closed forms of docs/algorithms.md ("Chains") and
  docs/trees.md ("Cost: closed forms")), TP-GRPO against chains on SD3.5-Medium (forwards per chain against
  docs/step_credit.md's), and Sol-RL's explorer (candidates/s in FP8 against BF16 on
  SD3.5-Medium and FLUX.1-dev, and which FP8 matmul ran); every row with the published claim and a verdict;
- ``async`` (not in the default parts): the SD3.5-Medium NFT preset with ``train.pipeline=sync`` against
  ``train.pipeline=async`` (``train.max_staleness=1``) on the one GPU, each a ``flowrl train`` process loading a
  real-size random-weight pipeline saved to a folder (``model.path``: the rollout process builds its own copy from
  it): s/iteration, images/s, rollout, update and the pipeline's waits after a warm-up, the device memory of both
  processes together while they run, the ratio of images/s against the 1.25× goal, and whether the card held both.

``--tiny`` runs every part on the CPU with tiny pipelines (the stored architectures shrunk,
:func:`flowrl.models.random_init.tiny_arch`) and tiny settings in well under a minute (tests/test_gpu_check.py).
On the GPU machine run it through scripts/gpu_check.sh, which first installs the carried wheels (diffusers,
omegaconf) and the repository itself; docs/gpu.md has the exact command.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import functools
import gc
import json
import math
import os
import platform
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

STARTED = time.monotonic()  # --minutes counts from here, the imports included
ROOT = Path(__file__).resolve().parents[1]
for path in (ROOT, ROOT / "scripts"):  # the checkout's flowrl when it is not installed (scripts/gpu_check.sh installs
    if str(path) not in sys.path:  # it), and this script's own modules
        sys.path.insert(0, str(path))

import gpu_profile  # noqa: E402
import gpu_report  # noqa: E402
from gpu_report import fmt, now  # noqa: E402

PARTS = ("presets", "profile", "shapes", "snr", "seeds", "async")
DEFAULT_PARTS = ("presets", "profile", "shapes", "snr")
"""What a plain run measures (issue 46's check); ``seeds`` and ``async`` are asked for by name (each its own call)."""
PROMPTS = "a photo of a cat|a red car and a blue house"
"""Inline training prompts of the presets (words of the synthetic tokenizers' vocabulary; sequences are padded to
the preset's lengths anyway)."""


@dataclass(frozen=True)
class Preset:
    name: str
    config: str
    arch: str
    prompts: int  # prompts per iteration
    images: int  # images per prompt (rollout.group_size)
    weight: float  # share of the time budget at shipped settings
    fitted_weight: float  # and with train.fit=auto + model.compile=regional (compilation in its warm-up)

    def keys(self) -> tuple[str, str]:
        """The budget's keys (and row names) of its shipped and fitted rows."""
        return self.name, f"{self.name}_fitted"


PRESETS = (  # weights ≈ expected seconds / 50 (docs/gpu.md, "The budget"): Flow-GRPO 21.7 s/iteration, NFT 4.4 s, FLUX
    # ≈ 16 s on the H200 of 2026-11-27; regional compilation ≈ 65 s of warm-up (the NFT preset ships it); a fit 15–25 s
    Preset("sd35m_flow_grpo_lora", "configs/sd35/flow_grpo_pickscore.yaml", "sd35_medium", 2, 8, 1.4, 2.2),
    Preset("sd35m_nft_lora", "configs/sd35/nft_geneval.yaml", "sd35_medium", 2, 8, 1.6, 1.8),
    # DiffusionNFT rather than the Flow-GRPO-style FLUX presets (dance_grpo_hps, 720 px, every one of 16 steps
    # replayed in the update): ≈ 0.44 against ≈ 2.4 PFLOP per image, so a warm-up and timed iterations fit
    Preset("flux1dev_nft_lora", "configs/flux/nft_pickscore.yaml", "flux1_dev", 2, 4, 1.2, 2.8),
)
FITTED = ["train.fit=auto", "model.compile=regional"]
FIT_KEYS = {
    "rollout.max_batch": "batch",
    "train.micro_batch": "micro",
    "model.gradient_checkpointing": "ckpt",
    "model.checkpoint_blocks": "ckpt blocks",
    "model.offload_encoders": "offload",
}
"""The keys train.fit chooses, and their short names in the tables."""
TINY_CAPACITY = 1.1
"""--tiny: the fit's device capacity, × the shipped settings' estimated peak: with train.memory_fraction 0.9 just
under it, so the fit must choose other settings (tiny Flow-GRPO: no checkpointing, encoders offloaded; the NFT
presets: rollouts of 1)."""
COMPILE_GUESS = 70.0
"""Seconds of a fitted row's warm-up planned for regional compilation on the GPU (SD3.5-M: 64.5 s, 2026-11-27)."""
PROFILE_PRESET, PROFILE_PROMPTS = PRESETS[0], 1
"""The profile's preset and prompts per iteration on the GPU (1 × 8 images: the shipped forwards of 8 rows, half
the iteration's events of 2 × 8, so its trace stays readable)."""
PROFILE_TRACE = "gpu_check_profile.json.gz"
PART_WEIGHTS = {"profile": 2.0, "shapes": 1.2, "snr": 0.3, "async": 5.0}
"""Shares of the budget besides the presets' (a part's time = what is left × its weight / the weights still to run)."""
SHAPES_RUNS = (("main", []), ("distill", ["loss.reward_term=0"]))
SHAPES_CONFIG = "configs/shapes/nft.yaml"
MEASURED_PEAK_TFLOPS = 790.0
"""bf16 dense matmul measured on the lent H100 and H200 (8192³ products: 798 and 788 TFLOP/s)."""
GiB = 2**30


class OutOfTime(Exception):
    """A part's share of --minutes ran out."""


# ---- arguments ------------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="scripts/gpu_check.py",
        description=__doc__.split("\n\n")[0],
        epilog='docs/gpu.md, "The GPU check": the exact run on the lent GPU machine.',
    )
    p.add_argument(
        "--out",
        default=None,
        help="folder for gpu_check.md and gpu_check.json (default: $OUT when set, else runs/gpu_check)",
    )
    p.add_argument(
        "--minutes",
        type=float,
        default=9.0,
        help="time budget of the whole check (default 9); each part gets a share and stops cleanly when it is spent",
    )
    p.add_argument(
        "--tiny",
        action="store_true",
        help="every part on the CPU with tiny pipelines and tiny settings "
        "(under a minute): the rehearsal the tests run",
    )
    p.add_argument(
        "--parts",
        default=",".join(DEFAULT_PARTS),
        help="comma-separated parts to run, in the order given (default: presets,profile,shapes,snr): presets "
        "(SD3.5-M Flow-GRPO and NFT, FLUX.1-dev NFT, LoRA, real size; shipped, then train.fit=auto + "
        "model.compile=regional), profile (torch.profiler of one SD3.5-M Flow-GRPO iteration), shapes (main job "
        "and distillation at 1,024 images per update, both at once, strict accuracy every 50 updates), snr "
        "(--reward-only at 1,024 images per batch), seeds (only when named: BranchGRPO, BranchGRPO-Mix and MixGRPO "
        "against DanceGRPO on FLUX.1-dev, TP-GRPO against chains and the Sol-RL explorer's FP8 against BF16 on "
        "SD3.5-M and FLUX.1-dev, each with the published claim and a verdict), async (only when named: SD3.5-M NFT "
        "train.pipeline=sync against async at max_staleness 1, two flowrl train processes from a saved random-weight "
        "folder: images/s, waits, staleness, both processes' device memory)",
    )
    p.add_argument(
        "--peak-tflops",
        type=float,
        default=MEASURED_PEAK_TFLOPS,
        help=f"the card's bf16 peak the model FLOP/s are set against (default {MEASURED_PEAK_TFLOPS:g}, "
        "measured on the lent H100/H200)",
    )
    p.add_argument(
        "--gpu",
        default=None,
        help="GPU class of the estimate (H100, H200, ...; default: from the device name, H100 when it names neither)",
    )
    p.add_argument(
        "--iterations",
        type=int,
        default=None,
        help="timed iterations per preset at most (default 3; fewer when the estimate says they would not fit)",
    )
    p.add_argument("--warmup", type=int, default=1, help="untimed iterations before them (default 1)")
    p.add_argument(
        "--seeds", type=int, nargs="+", default=None, help="seeds of the shapes runs (default 0; 0 1 with --tiny)"
    )
    p.add_argument(
        "--shapes-prompts", type=int, default=None, help="prompts per update of the shapes runs (default 16)"
    )
    p.add_argument("--shapes-images", type=int, default=None, help="images per prompt of the shapes runs (default 64)")
    p.add_argument(
        "--shapes-max-batch",
        type=int,
        default=None,
        help="rows per forward of the shapes runs (rollout.max_batch; default 512)",
    )
    p.add_argument(
        "--snr-batches",
        type=int,
        default=None,
        help="gradient draws of the snr part at most (default 8; at least 3, fewer when time is short)",
    )
    p.add_argument(
        "--shapes-parallel",
        type=int,
        default=None,
        help="shapes runs at once, each a flowrl train process on the one device (default 2: the main job and "
        "distillation side by side; 1 with --tiny: one after the other in this process)",
    )
    p.add_argument(
        "--shapes-eval-every",
        type=int,
        default=None,
        help="updates between the shapes runs' held-out evals at guidance 1 (eval.every; default 50, 1 with --tiny)",
    )
    p.add_argument(
        "--seeds-iterations",
        type=int,
        default=None,
        help="timed training iterations per seeds row (default 1: a FLUX.1-dev chains iteration is minutes)",
    )
    p.add_argument(
        "--seeds-warmup",
        type=int,
        default=None,
        help="untimed iterations before them (default 0: one-off costs are seconds against iterations of "
        "tens of seconds to minutes)",
    )
    p.add_argument(
        "--seeds-flux-px",
        type=int,
        default=None,
        help="height and width of the FLUX.1-dev trees-against-chains rows (default 256: their presets' 720 px "
        "would take a chains iteration past its share; 64 with --tiny)",
    )
    p.add_argument(
        "--seeds-group",
        type=int,
        default=None,
        help="chains per prompt of the TP-GRPO row and its chains baseline (default 8; the preset's 24; 2 with --tiny)",
    )
    p.add_argument(
        "--explore-batches",
        type=int,
        default=None,
        help="candidates previewed per explorer measurement, in batches of the preset's rollout.max_batch "
        "(default 4: 32 on SD3.5-M, 16 on FLUX.1-dev; 2 with --tiny)",
    )
    p.add_argument(
        "--async-iterations",
        type=int,
        default=None,
        help="timed iterations of each async-part run after its warm-up (default 3; 2 with --tiny)",
    )
    p.add_argument(
        "--async-warmup",
        type=int,
        default=None,
        help="untimed iterations first (default 1: the async run's first holds its rollout process's start)",
    )
    p.add_argument(
        "--async-compile",
        choices=("off", "regional"),
        default=None,
        help="model.compile of both async-part runs (default off: the preset's regional compilation would add about "
        "a minute per process to the warm-up; regional runs the preset as it ships)",
    )
    p.add_argument(
        "--async-launch",
        choices=("process", "inline"),
        default=None,
        help="how the async part starts its runs: process (a flowrl train process each, the default) or inline (a "
        "Trainer in this process, the async one with its spawned rollout process; the default with --tiny)",
    )
    p.add_argument(
        "--compile-backend",
        default=None,
        help="torch.compile backend of model.compile=regional in the "
        "fitted preset rows (default inductor; eager with --tiny)",
    )
    p.add_argument(
        "--profile-stack",
        action="store_true",
        help="profile the iteration with Python stacks on the GPU "
        "too (default: only with --tiny; on the GPU the warm-up's synchronising call sites are recorded "
        "instead, and the profiled iteration keeps its timing)",
    )
    p.add_argument(
        "--commit",
        default=None,
        help="the commit the copy was made from (the GPU machine's copy has no "
        ".git; default: git rev-parse HEAD when there is one)",
    )
    p.add_argument("--work", default=None, help="scratch folder for the runs (default: a new temporary folder)")
    return p


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = build_parser()
    args = p.parse_args(argv)
    parts = [x.strip() for x in args.parts.split(",") if x.strip()]
    unknown = sorted(set(parts) - set(PARTS))
    if unknown or not parts:
        p.error(f"--parts: unknown {unknown or 'empty'}; accepted: {','.join(PARTS)}")
    args.parts = list(dict.fromkeys(parts))  # each once, in the order given
    fill_defaults(args)
    return args


def fill_defaults(args: argparse.Namespace) -> None:
    """The sizes each mode uses unless given: the real check's, or --tiny's."""
    tiny = args.tiny
    defaults = {
        "iterations": 1 if tiny else 3,
        "seeds": [0, 1] if tiny else [0],
        "shapes_prompts": 2 if tiny else 16,
        "shapes_images": 4 if tiny else 64,
        "shapes_max_batch": 8 if tiny else 512,
        "snr_batches": 3 if tiny else 8,
        "compile_backend": "eager" if tiny else "inductor",
        "shapes_parallel": 1 if tiny else 2,
        "shapes_eval_every": 1 if tiny else 50,
        "seeds_iterations": 1,
        "seeds_warmup": 0,
        "seeds_flux_px": 64 if tiny else 256,
        "seeds_group": 2 if tiny else 8,
        "explore_batches": 2 if tiny else 4,
        "async_iterations": 2 if tiny else 3,
        "async_warmup": 1,
        "async_compile": "off",
        "async_launch": "inline" if tiny else "process",
    }
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.out is None:
        args.out = os.environ.get("OUT") or str(ROOT / "runs" / "gpu_check")
    args.work = Path(args.work) if args.work else None  # made in main, once nothing is missing


# ---- what is missing -----------------------------------------------------------------------------
def missing_requirements(tiny: bool) -> list[str]:
    """What this machine lacks for the check: Python modules, and a CUDA GPU unless --tiny."""
    import importlib.util

    missing = [
        m
        for m in ("torch", "diffusers", "transformers", "peft", "accelerate", "omegaconf")
        if importlib.util.find_spec(m) is None
    ]
    if not missing:
        try:  # flowrl and its rewards package, by whatever name flowrl imports it (the check never names it)
            from flowrl.config.build import build_rewards
            from flowrl.config.schema import RewardTerm

            build_rewards([RewardTerm(name="jpeg_compressibility")])
        except Exception as e:  # noqa: BLE001 - any failure here is something missing
            missing.append(
                f"an importable flowrl with its rewards ({one_line(e)}: pip install --no-deps "
                "--no-build-isolation -e . first, as scripts/gpu_check.sh does)"
            )
    if not tiny and "torch" not in missing:
        import torch

        if not torch.cuda.is_available():
            missing.append(f"a CUDA GPU (torch {torch.__version__}, built for CUDA {torch.version.cuda}, sees none)")
    return missing


# ---- time -----------------------------------------------------------------------------------------
class Budget:
    """--minutes shared out: a part's time is what is left × its weight / the weights of the parts still to run."""

    def __init__(self, seconds: float, weights: dict[str, float], start: float | None = None):
        self.start = time.monotonic() if start is None else start
        self.seconds, self.pending = seconds, dict(weights)
        self.given: dict[str, float] = {}  # the seconds each key was allotted

    def elapsed(self) -> float:
        return time.monotonic() - self.start

    def left(self) -> float:
        return self.seconds - self.elapsed()

    def allot(self, key: str) -> float:
        weight = self.pending.pop(key, 0.0)
        total = weight + sum(self.pending.values())
        self.given[key] = max(0.0, self.left() * weight / total) if total else max(0.0, self.left())
        return self.given[key]


@contextlib.contextmanager
def deadline(seconds: float, what: str):
    """Raise :class:`OutOfTime` in this (main) thread once ``seconds`` have passed."""
    if seconds <= 1:
        raise OutOfTime(f"{what}: no time left")

    def fire(signum, frame):
        raise OutOfTime(f"{what}: stopped after {seconds:.0f} s, its share of --minutes")

    previous = signal.signal(signal.SIGALRM, fire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def release_memory() -> None:
    """Drop what the last row left (models, trainers) and the allocator's cached blocks."""
    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def one_line(error: BaseException) -> str:
    text = " ".join(str(error).split()) or type(error).__name__
    return f"{type(error).__name__}: {text[:400]}"


# ---- the report -----------------------------------------------------------------------------------
COLUMNS = {
    "presets": [
        ("preset", "name"),
        ("variant", "variant"),
        ("model", "model"),
        ("prompts × images", "batch"),
        ("px / steps", "size"),
        ("settings", "settings_text"),
        ("s/iter", "seconds_per_iteration"),
        ("rollout s", "rollout_seconds"),
        ("reward s", "reward_seconds"),
        ("update s", "update_seconds"),
        ("estimate s/iter", "estimate_seconds"),
        ("model TFLOP/iter", "model_tflop_per_iteration"),
        ("TFLOP/s", "model_tflops_per_second"),
        ("of peak", "fraction_of_peak"),
        ("peak GiB", "peak_memory_gib"),
        ("estimate GiB", "estimate_peak_gib"),
        ("measured / estimate", "peak_ratio"),
        ("images/s", "images_per_second"),
        ("fitted / shipped", "speedup"),
        ("build s", "build_seconds"),
        ("warm-up s", "warmup_seconds"),
    ],
    "profile": [
        ("iteration", "name"),
        ("prompts × images", "batch"),
        ("s/iter profiled", "iteration_seconds"),
        ("busy s", "busy_seconds"),
        ("idle s", "idle_seconds"),
        ("idle share", "idle_fraction"),
        ("gaps", "gaps"),
        ("syncs", "syncs"),
        ("top op", "top_op"),
        ("stacks", "with_stack"),
        ("trace MB", "trace_mb"),
        ("warm-up s", "warmup_seconds"),
        ("analysis s", "analysis_seconds"),
    ],
    "shapes": [
        ("run", "name"),
        ("seed", "seed"),
        ("images/update", "images_per_update"),
        ("updates", "updates"),
        ("images", "images"),
        ("s/update", "seconds_per_update"),
        ("strict g1 before", "strict_g1_before"),
        ("strict g1 after", "strict_g1_after"),
        ("Δ g1", "strict_g1_change"),
        ("strict g3 before", "strict_g3_before"),
        ("strict g3 after", "strict_g3_after"),
        ("reward first → last", "reward_first_last"),
    ],
    "snr": [
        ("measure", "name"),
        ("batches", "batches"),
        ("images/batch", "samples_per_batch"),
        ("signal / error", "signal_over_error"),
        ("mean pairwise cosine", "mean_pairwise_cosine"),
        ("SNR per batch", "snr_per_batch"),
        ("images for SNR 1", "samples_for_snr_1"),
        ("s/batch", "seconds_per_batch"),
    ],
    "seeds": {  # one table per kind of row (gpu_report.Report.tables)
        "bench": (
            "**Trees and windows against chains** (one training iteration each, one prompt; forwards and edges per "
            "prompt, each against its closed form in the docs; ratio = s/iteration ÷ the baseline's):",
            [
                ("row", "name"),
                ("method", "method"),
                ("model", "model"),
                ("px · steps · prompts × images", "settings_text"),
                ("s/iter", "seconds_per_iteration"),
                ("rollout s", "rollout_seconds"),
                ("update s", "update_seconds"),
                ("forwards", "forwards"),
                ("closed form", "forwards_closed"),
                ("trained edges", "edges"),
                ("closed form", "edges_closed"),
                ("forwards / image", "forwards_per_image"),
                ("vs", "baseline"),
                ("s/iter ratio", "ratio"),
                ("claimed", "claimed_ratio"),
                ("claim", "claim"),
                ("verdict", "verdict"),
            ],
        ),
        "explore": (
            "**Sol-RL's explorer: candidates/s of its preview, FP8 against BF16** (the preset's resolution, preview "
            "steps and batch; the LoRA merged into each copy; no decode):",
            [
                ("row", "name"),
                ("model", "model"),
                ("px · steps · candidates", "settings_text"),
                ("backends", "backends"),
                ("converted layers", "quantized_layers"),
                ("BF16 candidates/s", "base_rate"),
                ("low-precision candidates/s", "low_rate"),
                ("ratio", "ratio"),
                ("the path that ran", "path"),
                ("claim", "claim"),
                ("verdict", "verdict"),
            ],
        ),
    },
    "async": [
        ("run", "name"),
        ("pipeline", "pipeline"),
        ("staleness", "staleness"),
        ("prompts × images", "batch"),
        ("px / steps", "size"),
        ("timed iterations", "timed"),
        ("s/iter", "seconds_per_iteration"),
        ("images/s", "images_per_second"),
        ("rollout s", "rollout_seconds"),
        ("reward s", "reward_seconds"),
        ("update s", "update_seconds"),
        ("update wait s", "update_wait"),
        ("rollout wait s", "rollout_wait"),
        ("warm-up s", "warmup_seconds"),
        ("memory in use GiB", "peak_memory_gib"),
        ("the run's GiB", "run_memory_gib"),
        ("processes", "processes"),
        ("held", "held"),
        ("async / sync", "ratio"),
        ("verdict", "verdict"),
    ],
}
TITLES = {
    "presets": "Real presets, real size, random weights: shipped, and train.fit=auto + model.compile=regional",
    "profile": "torch.profiler: one Flow-GRPO iteration",
    "shapes": "Shapes: the main job and distillation alone, many images per update",
    "snr": "The reward's gradient signal (flowrl snr --reward-only)",
    "seeds": "The seed methods' cost claims at real size: BranchGRPO, BranchGRPO-Mix and MixGRPO against DanceGRPO, "
    "TP-GRPO against chains, Sol-RL's FP8 explorer",
    "async": "train.pipeline: async against sync on one device (SD3.5-Medium NFT, max_staleness 1)",
}


def profile_tables(rows: list[dict]) -> list[str]:
    """The profile part's tables under its row (scripts/gpu_profile.py)."""
    return [
        line for r in rows if r.get("profile") for line in gpu_profile.markdown(r["profile"], r.get("sync_sites"), fmt)
    ]


class Report(gpu_report.Report):
    """gpu_check.json and gpu_check.md (scripts/gpu_report.py) with this check's parts."""

    titles, columns = TITLES, COLUMNS
    extras = {  # defined with their part
        "profile": profile_tables,
        "shapes": lambda rows: shapes_tables(rows),
        "async": lambda rows: async_tables(rows),
    }


def commit_of(given: str | None) -> str:
    if given:
        return given
    try:
        head = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True, timeout=10, check=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=10,
        ).stdout.strip()
        return head + (" (with uncommitted changes)" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown (no .git here: pass --commit)"


def environment(args: argparse.Namespace) -> dict:
    import diffusers
    import torch
    import transformers

    cuda = torch.cuda.is_available() and not args.tiny
    device = torch.cuda.get_device_name() if cuda else f"CPU ({platform.processor() or platform.machine()})"
    memory = torch.cuda.get_device_properties(0).total_memory / GiB if cuda else None
    return {
        "device": device,
        "device_memory_gib": memory,
        "gpu_class": gpu_class_of(args, device),
        "tiny": args.tiny,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "diffusers": diffusers.__version__,
        "transformers": transformers.__version__,
        "torchao": torchao_version(),
        "python": platform.python_version(),
        "commit": commit_of(args.commit),
        "started": now(),
        "minutes": args.minutes,
        "peak_tflops": args.peak_tflops,
        "parts": args.parts,
        "argv": sys.argv[1:],
    }


def torchao_version() -> str | None:
    """torchao's version, None when it is not installed (the seeds part's FP8 explorer needs it; never imported
    here: torchao's import makes diffusers warn)."""
    import importlib.metadata

    try:
        return importlib.metadata.version("torchao")
    except importlib.metadata.PackageNotFoundError:
        return None


def gpu_class_of(args: argparse.Namespace, device: str) -> str:
    if args.gpu:
        return args.gpu
    return "H200" if "H200" in device else "H100"


# ---- part 1: the real presets -----------------------------------------------------------------------
def preset_path(relative: str) -> str:
    """The file of the preset ``configs/<...>.yaml`` in this checkout (its top-level ``configs/``), else the
    name as given, for flowrl to find."""
    inner = Path(relative).relative_to("configs")
    for base in (ROOT / "configs",):
        if (base / inner).is_file():
            return str(base / inner)
    return relative


def preset_overrides(preset: Preset, args: argparse.Namespace, name: str) -> list[str]:
    """The preset at its resolution and steps with a cheap reward, inline prompts and ``prompts`` × ``images``;
    --tiny: 64 px, 2 steps, 8 T5 tokens, 1 prompt × 2 images on the CPU."""
    out = [
        "rewards=[{name: jpeg_compressibility}]",
        f"prompts.train={PROMPTS}",
        f"prompts.eval={PROMPTS}",
        f"prompts.per_step={preset.prompts}",
        f"rollout.group_size={preset.images}",
        "train.log_with=none",
        "train.progress=false",
        "train.overwrite=true",
        f"train.output_dir={args.work / 'runs'}",
        f"train.name={name}",
        f"model.device={'cpu' if args.tiny else 'cuda'}",
    ]
    if args.tiny:
        out += [
            "prompts.per_step=1",
            "rollout.group_size=2",
            "rollout.max_batch=2",
            "rollout.steps=2",
            "model.height=64",
            "model.width=64",
            "model.max_sequence_length=8",
            "train.num_threads=1",
        ]
    return out


def preset_estimate(cfg, arch: dict, args: argparse.Namespace, gpu: str) -> dict:
    """``flowrl bench --estimate`` of ``cfg`` (the figures the rows compare with)."""
    from flowrl.estimate import assume_gpu, estimate

    with assume_gpu(gpu):
        return estimate_figures(estimate(copy.deepcopy(cfg), gpu=gpu, arch=arch, target="cpu" if args.tiny else "cuda"))


def estimate_figures(e: dict) -> dict:
    """The figures of an estimate (:func:`flowrl.estimate.estimate`'s result) a preset row keeps."""
    return {
        "peak_gib": e["memory_gib"]["peak"],
        "peak_phase": e["memory_gib"]["peak_phase"],
        "static_gib": e["memory_gib"]["static"],
        "flops_per_iteration": e["flops"]["total"],
        "flops_split": {k: e["flops"][k] for k in ("rollout", "decode", "update", "explore")},
        "seconds_per_iteration": e["time"]["seconds_per_iteration"],
        "gpu": e["gpu"],
        "counts": e["counts"],
        "shapes": e["shapes"],
    }


def timed_iterations(seconds_left: float, per_iteration: float, args: argparse.Namespace, warmup: int) -> int:
    """As many timed iterations (1 … --iterations) as fit after ``warmup`` at ``per_iteration`` seconds each."""
    fit = int(seconds_left / max(per_iteration, 1e-9)) - warmup
    return max(1, min(args.iterations, fit))


def measured(bench: dict, est: dict, args: argparse.Namespace) -> dict:
    """A preset row's measured columns from :func:`flowrl.commands.bench.bench_iteration` and the estimate."""
    seconds = bench["seconds_per_iteration"]
    flops = est["flops_per_iteration"]
    on_gpu = "peak_memory_mb" in bench
    peak = (bench["peak_memory_mb"] if on_gpu else bench["peak_rss_mb"]) / 1024
    return {
        "seconds_per_iteration": seconds,
        "rollout_seconds": bench["time/rollout"],
        "reward_seconds": bench["time/reward"],
        "update_seconds": bench["time/update"],
        "forward_seconds": bench["forward_seconds"],
        "backward_seconds": bench["backward_seconds"],
        "overhead_seconds": bench["overhead_seconds"],
        "rollout_forwards": bench.get("rollout_forwards"),
        "model_tflop_per_iteration": flops / 1e12,
        "model_tflops_per_second": flops / seconds / 1e12,
        "fraction_of_peak": flops / seconds / (args.peak_tflops * 1e12),
        "peak_memory_gib": peak,
        "peak_memory_source": "torch.cuda.max_memory_allocated" if on_gpu else "process peak RSS (CPU: not comparable)",
        "estimate_peak_gib": est["peak_gib"],
        "peak_ratio": peak / est["peak_gib"],
        "estimate_seconds": est["seconds_per_iteration"],
        "within_estimated_time": est["seconds_per_iteration"][0] <= seconds <= est["seconds_per_iteration"][1],
    }


ITERATION_GUESS = 1.5
"""An iteration is planned at this many times the estimate's slowest (30 % of the bf16 peak): small batches."""


def fit_choices(cfg) -> dict:
    """What ``cfg`` sets for each key train.fit chooses (:data:`FIT_KEYS`; the micro-batch's effective value)."""
    out = {key: getattr(getattr(cfg, key.split(".")[0]), key.split(".")[1]) for key in FIT_KEYS}
    out["train.micro_batch"] = out["train.micro_batch"] or out["rollout.max_batch"]
    return out


def settings_text(settings: dict) -> str:
    """``batch 8 · micro 8 · ckpt yes · ckpt blocks — · offload no``: the fit's keys in a table cell."""
    return " · ".join(f"{short} {fmt(settings.get(key))}" for key, short in FIT_KEYS.items())


def fitted_config(cfg, arch: dict, args: argparse.Namespace, gpu: str, shipped: dict | None, row: dict):
    """``cfg`` as ``train.fit=auto`` makes it for ``gpu`` (:func:`flowrl.estimate.fit.fit_config`; --tiny: on a
    device of :data:`TINY_CAPACITY` × the shipped settings' estimated peak), its fit recorded in ``row``; benched as
    chosen (``train.fit`` then off: a Trainer does not fit again). Returns it and the fit's estimate of it."""
    from flowrl.estimate.fit import fit_config

    capacity = None
    if args.tiny:
        peak = (shipped or {}).get("estimate_peak_gib") or preset_estimate(cfg, arch, args, gpu)["peak_gib"]
        capacity = TINY_CAPACITY * peak
    t0 = time.monotonic()
    fit = fit_config(cfg, gpu, arch=arch, target="cpu" if args.tiny else "cuda", capacity_gib=capacity)
    summary = fit.summary()
    row["fit"] = {
        "settings": dict(fit.settings),
        "kept": list(fit.kept),
        "peak_gib": fit.peak_gib,
        "seconds_per_iteration": list(fit.seconds_per_iteration),
        "flops_per_iteration": fit.flops_per_iteration,
        "capacity_gib": capacity,
        "seconds": time.monotonic() - t0,
        "summary": summary.splitlines() if isinstance(summary, str) else list(summary),
    }
    fitted = copy.deepcopy(fit.config)
    fitted.train.fit = "off"
    return fitted, estimate_figures(fit.estimate) if getattr(fit, "estimate", None) else None


def preset_row(
    preset: Preset,
    args: argparse.Namespace,
    seconds: float,
    gpu: str,
    row: dict,
    fitted: bool = False,
    shipped: dict | None = None,
) -> dict:
    """Estimate, build on the device and bench one preset into ``row`` (what it holds when time runs out is kept):
    at its shipped settings, or ``fitted`` (:data:`FITTED`: train.fit=auto and regional compilation; ``shipped``:
    that preset's shipped row, for the ratio)."""
    import torch

    from flowrl.commands.bench import bench_iteration
    from flowrl.estimate import load_arch, load_config
    from flowrl.models.random_init import tiny_arch
    from flowrl.run.model import random_model

    t0 = time.monotonic()
    name = preset.keys()[int(fitted)]
    cfg = load_config(
        preset_path(preset.config), preset_overrides(preset, args, name) + (FITTED if fitted else []), gpu
    )
    arch = tiny_arch(preset.arch) if args.tiny else load_arch(preset.arch)
    row.update(name=name, variant="fit + compile" if fitted else "shipped", config=preset.config, model=arch["name"])
    est = None
    if fitted:
        cfg, est = fitted_config(cfg, arch, args, gpu, shipped, row)
    est = est or preset_estimate(cfg, arch, args, gpu)
    m = cfg.model
    row.update(
        {
            "status": "ok",
            "batch": f"{cfg.prompts.per_step} × {cfg.rollout.group_size}",
            "size": f"{m.height} / {cfg.rollout.steps}",
            "fit_settings": fit_choices(cfg),
            "settings_text": settings_text(fit_choices(cfg)),
            "settings": {
                "height": m.height,
                "width": m.width,
                "steps": cfg.rollout.steps,
                "max_batch": cfg.rollout.max_batch,
                "micro_batch": cfg.train.micro_batch,
                "max_sequence_length": m.max_sequence_length,
                "dtype": m.dtype,
                "lora_rank": m.lora.rank,
                "gradient_checkpointing": m.gradient_checkpointing,
                "checkpoint_blocks": m.checkpoint_blocks,
                "offload_encoders": m.offload_encoders,
                "compile": m.compile,
                "objective": cfg.loss.objective,
            },
            "estimate": est,
            "estimate_seconds_taken": time.monotonic() - t0,
        }
    )
    t1 = time.monotonic()
    model = random_model(m, "cpu" if args.tiny else "cuda", arch)
    row["build_seconds"] = time.monotonic() - t1
    per_iteration = ITERATION_GUESS * est["seconds_per_iteration"][1]
    compiles = m.compile == "regional"  # every variant compiles in the first iteration (flowrl/models/blocks.py)
    warmup = args.warmup
    compiling = COMPILE_GUESS if compiles and not args.tiny else 0.0
    iterations = timed_iterations(seconds - compiling - (time.monotonic() - t0), per_iteration, args, warmup)
    t2 = time.monotonic()
    bench = bench_iteration(cfg, iterations=iterations, warmup=warmup, model=model)
    row.update(
        measured(bench, est, args),
        iterations=iterations,
        warmup=warmup,
        bench=bench,
        warmup_seconds=time.monotonic() - t2 - iterations * bench["seconds_per_iteration"],
        images_per_second=cfg.prompts.per_step * cfg.rollout.group_size / bench["seconds_per_iteration"],
    )
    if compiles:  # the fitted rows, and a preset that ships it (SD3.5-M NFT)
        row.update(compiled(bench), backend=args.compile_backend)
    if fitted:
        base = (shipped or {}).get("images_per_second") if (shipped or {}).get("status") == "ok" else None
        row["speedup"] = row["images_per_second"] / base if base else None  # None: the shipped row did not measure
    del model
    release_memory()
    if torch.cuda.is_available() and not args.tiny:
        row["allocated_after_release_gib"] = torch.cuda.memory_allocated() / GiB  # > 0: something kept the model
    return row


def compiled(bench: dict) -> dict:
    """What regional compilation did to the benched transformer (``bench_iteration``'s ``compile``: its trainer's
    CompileStats, flowrl/models/blocks.py)."""
    stats = bench.get("compile")
    if stats is None:
        return {"compiled_blocks": 0}
    return {"compiled_blocks": stats["blocks"], "compiled_graphs": stats["graphs"], "compile_seconds": stats["seconds"]}


def guarded(
    report: Report,
    budget: Budget,
    part: str,
    name: str,
    seconds: float,
    run,
    slack: float = 1.25,
    initial: dict | None = None,
) -> dict:
    """``run(row)``'s row under a deadline of ``seconds`` (× ``slack`` while the budget has it); when it runs out of
    time or fails, what ``run`` had put in ``row`` so far (from ``initial`` on), with the status and the error."""
    t0 = time.monotonic()
    limit = max(seconds, min(slack * seconds, budget.left() - 5))
    print(f"[gpu_check] {part}: {name} ({seconds:.0f} s, stopped at {limit:.0f} s)", flush=True)
    partial: dict = {"name": name, **(initial or {})}
    try:
        with deadline(limit, f"{part}/{name}"):
            row = run(partial)
    except OutOfTime as e:
        row = {**partial, "status": "out_of_time", "error": str(e)}
    except Exception as e:  # noqa: BLE001 - one row fails, the check goes on (an OOM is a result too)
        row = {**partial, "status": "failed", "error": one_line(e)}
    if row.get("status") != "ok":
        release_memory()  # the exception's frames held the model
    row["row_seconds"] = time.monotonic() - t0
    report.add(part, row)
    print(f"[gpu_check]   → {row['status']}" + (f": {row['error']}" if row.get("error") else ""), flush=True)
    return row


def run_presets(report: Report, budget: Budget, args: argparse.Namespace) -> None:
    """Each preset at its shipped settings, then fitted and compiled (the pair side by side in the table)."""
    import torch

    gpu = report.data["meta"]["gpu_class"]
    for preset in PRESETS:
        shipped = None
        for fitted, key in enumerate(preset.keys()):
            seconds = budget.allot(key)
            try:
                row = guarded(
                    report,
                    budget,
                    "presets",
                    key,
                    seconds,
                    slack=1.5,
                    run=lambda row: preset_row(preset, args, seconds, gpu, row, fitted=bool(fitted), shipped=shipped),
                )
            finally:
                torch._dynamo.reset()  # the compiled blocks' graphs go with their model
            shipped = shipped or row


# ---- part 2: torch.profiler of one Flow-GRPO iteration ----------------------------------------------
def profile_row(args: argparse.Namespace, gpu: str, row: dict) -> dict:
    """One iteration of :data:`PROFILE_PRESET` at its shipped settings (:data:`PROFILE_PROMPTS` prompt on the GPU)
    under ``torch.profiler`` after an untimed warm-up that records the synchronising call sites; the tables and the
    gzipped trace of scripts/gpu_profile.py (--tiny: the tiny preset on the CPU, with Python stacks)."""
    from flowrl.estimate import load_arch, load_config
    from flowrl.models.random_init import tiny_arch
    from flowrl.run.model import random_model
    from flowrl.training.trainer import Trainer

    preset, cuda = PROFILE_PRESET, not args.tiny
    extra = [] if args.tiny else [f"prompts.per_step={PROFILE_PROMPTS}"]
    cfg = load_config(preset_path(preset.config), preset_overrides(preset, args, "profile") + extra, gpu)
    cfg.train.progress, cfg.prompts.eval = False, None  # as flowrl bench: no progress bar, no eval
    row.update(name=preset.name, status="ok", batch=f"{cfg.prompts.per_step} × {cfg.rollout.group_size}")
    t0 = time.monotonic()
    arch = tiny_arch(preset.arch) if args.tiny else load_arch(preset.arch)
    trainer = Trainer(cfg, model=random_model(cfg.model, "cuda" if cuda else "cpu", arch))
    row["build_seconds"] = time.monotonic() - t0
    t1 = time.monotonic()
    with gpu_profile.sync_sites(cuda) as sites:
        trainer.train_step(0)
    row.update(warmup_seconds=time.monotonic() - t1, sync_sites=dict(sites))
    t2 = time.monotonic()
    step = functools.partial(trainer.train_step, 1)
    summary = gpu_profile.profile_step(
        step, Path(args.out) / PROFILE_TRACE, args.work, cuda=cuda, with_stack=args.tiny or args.profile_stack
    )
    del trainer
    gaps = summary["gaps"]
    row.update(
        profile=summary,
        iteration_seconds=summary["iteration_seconds"],
        busy_seconds=gaps["busy_seconds"],
        idle_seconds=gaps["idle_seconds"],
        idle_fraction=gaps["idle_fraction"],
        gaps=gaps["count"],
        syncs=sum(r["count"] for r in summary["syncs"] if r["name"] != "aten::_local_scalar_dense"),
        top_op=summary["top_ops"][0]["op"] if summary["top_ops"] else None,
        with_stack=summary["with_stack"],
        trace_file=summary["trace_file"],
        trace_mb=summary["trace_mb"],
        analysis_seconds=time.monotonic() - t2 - summary["iteration_seconds"],
    )
    return row


def run_profile(report: Report, budget: Budget, args: argparse.Namespace) -> None:
    seconds = budget.allot("profile")
    gpu = report.data["meta"]["gpu_class"]
    guarded(report, budget, "profile", PROFILE_PRESET.name, seconds, lambda row: profile_row(args, gpu, row))


# ---- part 3: the shapes main job at 1,024 images per update ----------------------------------------
SHAPES_STARTUP = 20.0
"""Seconds of a shapes run on the GPU outside its training time, besides its evals: the process's start (imports,
model), the evals before and after at guidance 1 and 3, the last checkpoint."""
SHAPES_EVAL_SHARE = 0.12
"""The share of a shapes run's time planned for its held-out evals every --shapes-eval-every updates (240 prompts
× 2 images, 20 steps: about 2 s each on the GPU); the rest of the share, less :data:`SHAPES_STARTUP`, is its
``train.max_minutes``."""
SHAPES_GRACE = 30.0
"""Seconds a shapes process stopped at its deadline (SIGTERM: it saves and exits) gets before it is killed."""


def shapes_overrides(
    args: argparse.Namespace, name: str, seed: int, minutes: float, threads: int | None = None
) -> list[str]:
    """configs/shapes/nft.yaml at --shapes-prompts × --shapes-images per update for ``minutes`` of training (evals
    excluded), a held-out eval at guidance 1 every --shapes-eval-every updates, ``threads`` CPU threads (default the
    preset's; --tiny: two updates, 4 held-out prompts, 2 steps, one thread)."""
    batch = args.shapes_max_batch
    out = [
        f"prompts.per_step={args.shapes_prompts}",
        f"rollout.group_size={args.shapes_images}",
        f"rollout.max_batch={batch}",
        f"train.seed={seed}",
        "train.log_with=none",
        "train.progress=false",
        "train.overwrite=true",
        "train.checkpoint_every=0",
        f"train.output_dir={args.work / 'runs'}",
        f"train.name={name}",
        f"eval.every={args.shapes_eval_every}",
    ]
    if args.tiny:
        return out + [
            "train.max_steps=2",
            "model.device=cpu",
            "train.num_threads=1",
            "eval.num_prompts=4",
            "eval.steps=2",
            "eval.images_per_prompt=1",
            "rollout.steps=2",
        ]
    out += ["train.max_steps=1000000", f"train.max_minutes={max(minutes, 0.05):.3f}", "model.device=cuda"]
    return out + ([f"train.num_threads={threads}"] if threads else [])


def read_metrics(path: Path) -> list[dict]:
    """The records a run wrote to its metrics.jsonl (what is left when its time ran out mid-run)."""
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def shapes_summary(records: list[dict], name: str, seed: int, images_per_update: int, reward: str) -> dict:
    """A shapes row: updates, images, s/update, held-out strict at guidance 1 (``eval/…``: before, after and every
    eval between, ``curve`` = [[update, strict], ...]) and at the model's default 3 (``eval_default/…``) before and
    after, and the training reward's first and last iteration."""
    nan = float("nan")
    key = f"eval/{reward}_mean"
    evals = [r for r in records if key in r]
    steps = [r for r in records if "reward_mean" in r]
    seconds = steps[-1].get("time/train_total", nan) if steps else nan
    row = {
        "name": name,
        "seed": seed,
        "images_per_update": images_per_update,
        "updates": len(steps),
        "images": len(steps) * images_per_update,
        "train_seconds": seconds,
        "seconds_per_update": seconds / len(steps) if steps else nan,
        "reward_first": steps[0]["reward_mean"] if steps else nan,
        "reward_last": steps[-1]["reward_mean"] if steps else nan,
        "curve": [[int(r.get("step", 0)), float(r[key])] for r in evals],
    }
    for tag, prefix in (("g1", "eval"), ("g3", "eval_default")):  # guidance 3: evaluated before and after only
        own = [r for r in records if f"{prefix}/{reward}_mean" in r]
        before, after = (own[0], own[-1]) if len(own) >= 2 else (own[0] if own else {}, {})
        k = f"{prefix}/{reward}_mean"
        row[f"strict_{tag}_before"], row[f"strict_{tag}_after"] = before.get(k, nan), after.get(k, nan)
        row[f"strict_{tag}_change"] = row[f"strict_{tag}_after"] - row[f"strict_{tag}_before"]
    row["reward_first_last"] = f"{fmt(row['reward_first'])} → {fmt(row['reward_last'])}"
    row["eval_images"] = evals[0].get(f"eval/{reward}/n") if evals else None
    return row


def shapes_config(args: argparse.Namespace, name: str, seed: int, minutes: float, extra: list[str]):
    """The shapes run's config (its reward label and images per update)."""
    from flowrl.config.schema import TrainConfig

    return TrainConfig.from_yaml(preset_path(SHAPES_CONFIG), shapes_overrides(args, name, seed, minutes) + extra)


def reward_label(cfg) -> str:
    return cfg.eval.rewards[0].label or cfg.eval.rewards[0].name


def shapes_row(args: argparse.Namespace, variant: str, extra: list[str], seed: int, minutes: float) -> dict:
    """One shapes run in this process (``--shapes-parallel 1``), summarised from its metrics.jsonl."""
    from flowrl.training.trainer import Trainer

    name = f"shapes_{variant}_seed{seed}"
    cfg = shapes_config(args, name, seed, minutes, extra)
    status, error = "ok", None
    t0 = time.monotonic()
    try:
        Trainer(cfg).train()
    except OutOfTime as e:  # keep what the run wrote before its time ran out
        status, error = "out_of_time", str(e)
    records = read_metrics(Path(cfg.train.output_dir) / name / "metrics.jsonl")
    row = shapes_summary(records, variant, seed, cfg.prompts.per_step * cfg.rollout.group_size, reward_label(cfg))
    row.update(status=status, error=error, overrides=extra, wall_seconds=time.monotonic() - t0, parallel=1)
    row["eval_every"] = args.shapes_eval_every
    return row


def stop_process(proc: subprocess.Popen) -> None:
    """SIGTERM (a flowrl run saves and exits), then SIGKILL after :data:`SHAPES_GRACE` seconds."""
    if proc.poll() is not None:
        return
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(SHAPES_GRACE)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def log_tail(path: Path, lines: int = 3) -> str:
    text = path.read_text(errors="replace").strip().splitlines() if path.is_file() else []
    return " | ".join(line.strip() for line in text[-lines:]) or "no output"


def run_shapes_batch(
    report: Report, budget: Budget, args: argparse.Namespace, batch: list[tuple], share: float, t_part: float
) -> None:
    """The runs of ``batch`` at once, each a ``flowrl train`` process on the one device with ``share`` seconds
    (its training time: the share less :data:`SHAPES_STARTUP` and :data:`SHAPES_EVAL_SHARE`; stopped at 1.25 ×
    the share while the budget has it), their CPU threads split between them; a row per run from its
    metrics.jsonl, whatever ended it."""
    threads = max(1, (os.cpu_count() or 2) // len(batch))
    minutes = max(share * (1 - SHAPES_EVAL_SHARE) - SHAPES_STARTUP, 0.05 * share) / 60
    limit = max(share, min(1.25 * share, budget.left() - 5))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    started, stopped, ended = [], set(), {}
    try:
        for variant, extra, seed in batch:
            name = f"shapes_{variant}_seed{seed}"
            cfg = shapes_config(args, name, seed, minutes, extra)
            log = args.work / f"{name}.log"
            command = [sys.executable, "-m", "flowrl", "train", preset_path(SHAPES_CONFIG)]
            command += shapes_overrides(args, name, seed, minutes, None if args.tiny else threads) + extra
            print(f"[gpu_check] shapes: {variant} seed {seed} ({share:.0f} s, stopped at {limit:.0f} s)", flush=True)
            with open(log, "w") as out:
                proc = subprocess.Popen(command, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT)
            started.append((variant, extra, seed, cfg, log, proc, time.monotonic()))
        end = time.monotonic() + limit
        running = {proc.pid: proc for *_, proc, _ in started}
        while running:
            for pid, proc in list(running.items()):
                if proc.poll() is not None:
                    ended[pid] = time.monotonic()
                    del running[pid]
            if running and time.monotonic() > end:
                for pid, proc in running.items():
                    stopped.add(pid)
                    stop_process(proc)
                    ended[pid] = time.monotonic()
                running = {}
            time.sleep(0.2 if running else 0)
    finally:
        for *_, proc, _ in started:
            stop_process(proc)  # an exception here (Ctrl-C) leaves no run behind
    for variant, extra, seed, cfg, log, proc, t0 in started:
        records = read_metrics(Path(cfg.train.output_dir) / cfg.train.name / "metrics.jsonl")
        row = shapes_summary(records, variant, seed, cfg.prompts.per_step * cfg.rollout.group_size, reward_label(cfg))
        if proc.pid in stopped:
            status, error = "out_of_time", f"shapes/{variant} seed {seed}: stopped after {limit:.0f} s"
        elif proc.returncode == 0:
            status, error = "ok", None
        else:
            status, error = "failed", f"flowrl train exited {proc.returncode}: {log_tail(log)}"
        row.update(
            status=status,
            error=error,
            overrides=extra,
            parallel=len(batch),
            threads=threads,
            started_seconds=t0 - t_part,  # from the part's start: the runs of a batch overlap
            wall_seconds=ended.get(proc.pid, time.monotonic()) - t0,
            log=log.name,
            eval_every=args.shapes_eval_every,
        )
        report.add("shapes", row)


def run_shapes(report: Report, budget: Budget, args: argparse.Namespace) -> None:
    """Main job and distillation alone, seed by seed: with --shapes-parallel N > 1, N runs at once in their own
    processes (the pair of a seed side by side), else one after the other in this process (each pair first, so a
    short budget still has both). Then the part's answer (:func:`shapes_answer`)."""
    seconds = budget.allot("shapes")
    t_part = time.monotonic()
    end = t_part + seconds
    runs = [(variant, extra, seed) for seed in args.seeds for variant, extra in SHAPES_RUNS]
    if args.shapes_parallel > 1:
        batches = [runs[i : i + args.shapes_parallel] for i in range(0, len(runs), args.shapes_parallel)]
        for i, batch in enumerate(batches):
            share = (end - time.monotonic()) / (len(batches) - i)
            if share < 5 and not args.tiny:
                for variant, _, seed in batch:
                    report.add("shapes", {"name": variant, "seed": seed, "status": "skipped", "error": "no time left"})
                continue
            run_shapes_batch(report, budget, args, batch, share, t_part)
    else:
        overhead = None  # set-up, evals and the last checkpoint of a run: measured on the first
        for i, (variant, extra, seed) in enumerate(runs):
            share = (end - time.monotonic()) / (len(runs) - i)
            if share < 5 and not args.tiny:
                report.add("shapes", {"name": variant, "seed": seed, "status": "skipped", "error": "no time left"})
                continue
            guess = overhead if overhead is not None else 0.3 * share
            minutes = max(share - guess, 0.0) / 60
            row = guarded(
                report,
                budget,
                "shapes",
                f"{variant} seed {seed}",
                share,
                lambda row: shapes_row(args, variant, extra, seed, minutes),
            )
            if row.get("status") == "ok" and math.isfinite(row.get("train_seconds", float("nan"))):
                overhead = 1.1 * max(row["wall_seconds"] - row["train_seconds"], 0.0)
    report.data["parts"]["shapes"]["answer"] = shapes_answer(report.rows("shapes"))
    report.write()


def shapes_answer(rows: list[dict]) -> list[dict]:
    """Per seed with both runs measured: held-out strict at guidance 1 of the main job against distillation alone
    (``loss.reward_term=0``) at the last update both evaluated (their ends when they share no eval after the
    first), the difference, twice its binomial standard error (each eval's ``eval_images`` images) and the
    verdict: the reward adds something only if the main job is ahead by more than that."""
    out = []
    for seed in sorted({r["seed"] for r in rows if isinstance(r.get("seed"), int)}):
        pair = {r["name"]: r for r in rows if r.get("seed") == seed and r.get("curve")}
        if "main" not in pair or "distill" not in pair:
            continue
        main, distill = (dict((int(s), v) for s, v in pair[k]["curve"]) for k in ("main", "distill"))
        common = sorted(set(main) & set(distill) - {0})
        if common:
            at, a, b = f"{common[-1]:,}", main[common[-1]], distill[common[-1]]
        else:  # no shared eval after the start: each at its end
            at = f"{max(main):,} / {max(distill):,} (each at its end)"
            a, b = main[max(main)], distill[max(distill)]
        n = pair["main"].get("eval_images") or float("nan")
        two_se = 2 * math.sqrt((a * (1 - a) + b * (1 - b)) / n) if n == n and n > 0 else float("nan")
        diff = a - b
        if not (math.isfinite(diff) and math.isfinite(two_se)):
            verdict = "not measured"
        elif diff > two_se:
            verdict = f"the reward adds {diff:+.3f} over distillation (beyond 2 s.e., {two_se:.3f})"
        elif diff < -two_se:
            verdict = f"distillation alone is ahead by {-diff:.3f} (beyond 2 s.e., {two_se:.3f})"
        else:
            verdict = f"no difference beyond the eval's noise ({diff:+.3f}; 2 s.e. {two_se:.3f})"
        out.append(
            {
                "seed": seed,
                "at_updates": at,
                "updates": [pair["main"]["updates"], pair["distill"]["updates"]],
                "main": a,
                "distill": b,
                "difference": diff,
                "two_se": two_se,
                "verdict": verdict,
            }
        )
    return out


def shapes_tables(rows: list[dict]) -> list[str]:
    """Under the shapes table: strict accuracy at guidance 1 at every eval of every run, and the part's answer."""
    curves = [r for r in rows if r.get("curve")]
    if not curves:
        return []
    steps = sorted({int(s) for r in curves for s, _ in r["curve"]})
    lines = [
        "**Held-out strict accuracy at guidance 1 against updates** (one eval every "
        f"{curves[0].get('eval_every', '—')} updates of {fmt(curves[0].get('images_per_update'))} images):",
        "",
        "| run | seed | " + " | ".join(f"{s:,}" for s in steps) + " |",
        "|" + "---|" * (len(steps) + 2),
    ]
    for r in curves:
        values = {int(s): v for s, v in r["curve"]}
        lines.append(f"| {r['name']} | {r['seed']} | " + " | ".join(fmt(values.get(s)) for s in steps) + " |")
    lines += [
        "",
        "**Does the reward add anything over distillation?** The main job against `loss.reward_term=0` at the same "
        "updates; a difference counts beyond twice its binomial standard error:",
        "",
        "| seed | at update | updates main / distill | main | distill | main − distill | 2 s.e. | verdict |",
        "|---|---|---|---|---|---|---|---|",
    ]
    answer = shapes_answer(rows)
    lines += [
        f"| {a['seed']} | {a['at_updates']} | {fmt(a['updates'][0])} / {fmt(a['updates'][1])} | {fmt(a['main'])} | "
        f"{fmt(a['distill'])} | {fmt(a['difference'])} | {fmt(a['two_se'])} | {a['verdict']} |"
        for a in answer
    ] or ["| — | — | — | — | — | — | — | not measured: no seed has both runs evaluated |"]
    return lines


# ---- part 4: the reward's share of the gradient at 1,024 images per batch ---------------------------
def snr_row(args: argparse.Namespace, batches: int) -> dict:
    """``flowrl snr configs/shapes/nft.yaml --reward-only`` at the shapes runs' images per batch."""
    from flowrl.commands.snr import gradient_snr
    from flowrl.config.schema import TrainConfig

    t0 = time.monotonic()
    cfg = TrainConfig.from_yaml(preset_path(SHAPES_CONFIG), shapes_overrides(args, "snr", 0, 0.0))
    result = gradient_snr(cfg, batches=batches, progress=False, reward_only=True)
    error = result["signal_error"]
    detected = bool(result["signal_detected"])
    needed = result["samples_for_snr_1"] if detected else result["samples_for_snr_1_at_least"]
    return {
        "name": "--reward-only, shipped weights",
        "status": "ok",
        "batches": int(result["batches"]),
        "samples_per_batch": int(result["samples_per_batch"]),
        "signal_over_error": result["signal"] / error if error > 0 else float("nan"),
        "mean_pairwise_cosine": result["mean_pairwise_cosine"],
        "snr_per_batch": result["snr_per_batch"],
        "detected": detected,
        "samples_for_snr_1": f"{'≈' if detected else '≥'} {fmt(float(needed))}",
        "seconds_per_batch": (time.monotonic() - t0) / batches,
        "result": result,
    }


def run_snr(report: Report, budget: Budget, args: argparse.Namespace) -> None:
    seconds = budget.allot("snr")
    per_update = [
        r["seconds_per_update"]
        for r in report.rows("shapes")
        if isinstance(r.get("seconds_per_update"), float) and math.isfinite(r["seconds_per_update"])
    ]
    guess = 1.5 * (sum(per_update) / len(per_update)) if per_update else 3.0  # a rollout and a backward per draw
    batches = max(3, min(args.snr_batches, int(0.8 * seconds / guess)))
    guarded(report, budget, "snr", f"reward only, {batches} batches", seconds, lambda row: snr_row(args, batches))


# ---- part 5: the seed methods' cost claims on real-size models (issue 65) ------------------------------------
@dataclass(frozen=True)
class SeedRow:
    """A row of the seeds part. ``kind``: ``bench`` (training iterations of ``config`` on ``arch``: flowrl bench's
    timings, the rollout forwards and trained edges per prompt against their closed form) or ``explore`` (Sol-RL's
    explorer: candidates/s of its preview in BF16 and in FP8). ``overrides`` (``{px}``: --seeds-flux-px, ``{group}``:
    --seeds-group) on top of the common ones; ``tiny``: --tiny's, after them (the same shape, shrunk). ``baseline``:
    the row this one's s/iteration is divided by; ``claimed_ratio``: that ratio as published; ``loss_from``: a preset
    whose objective, optimiser and updates per iteration the row takes (a baseline that differs from its rows in its
    rollout plan and credit rule alone)."""

    name: str
    kind: str
    method: str
    config: str
    arch: str
    overrides: tuple[str, ...]
    tiny: tuple[str, ...]
    weight: float  # share of the budget: expected seconds on an H100 / 50
    baseline: str | None = None
    claim: str = ""
    claimed_ratio: float | None = None
    loss_from: str | None = None  # a preset whose loss, optimiser and updates per iteration this row takes


EXPLORE_CLAIM = (
    "Sol-RL: previews in low precision (FP8 on Hopper, FP4 on Blackwell) cost less than in BF16; its published "
    "speed-ups are end to end (up to 4.64× faster convergence on SD3.5-L, 2.42–3.0× on SANA/FLUX)"
)
FLUX_PX = ("model.height={px}", "model.width={px}")
CHAINS_TINY = ("rollout.group_size=4", "rollout.steps=6", "rollout.max_batch=4")
TREE_TINY = ("rollout.steps=6", "rollout.split_steps=[0,2]", "rollout.max_batch=4")
EXPLORE_TINY = ("rollout.max_batch=2", "rollout.min_params=256", "rollout.preview_steps=2")
SEEDS = (  # in this order: each baseline before its rows, the FLUX rows after the SD3.5 ones, the fp8 FLUX one last
    SeedRow(
        "sd35m_chains",
        "bench",
        "Flow-GRPO chains (CPS η 0.7, as TP-GRPO's)",
        "configs/sd35/flow_grpo_pickscore.yaml",
        "sd35_medium",
        ("rollout.kernel=cps", "rollout.group_size={group}"),
        ("rollout.steps=4",),
        0.4,
        claim="baseline (chains: T forwards and T − 1 trained edges per chain)",
        loss_from="configs/sd35/tp_grpo_pickscore.yaml",
    ),
    SeedRow(
        "sd35m_tp_grpo",
        "bench",
        "TP-GRPO (ODE-completion probes, turning points)",
        "configs/sd35/tp_grpo_pickscore.yaml",
        "sd35_medium",
        ("rollout.inner.group_size={group}",),
        ("rollout.inner.steps=4",),
        0.7,
        baseline="sd35m_chains",
        claim="TP-GRPO: 2T + Σ_{k=1}^{n−1}(T − k) forwards per chain against T: 64 vs 10 for SD3.5, T 10, n 9; "
        "n + 1 reward calls against 1",
    ),
    SeedRow(
        "sd35m_explorer",
        "explore",
        "Sol-RL explorer (configs/sd35/solrl_hps.yaml's preview on SD3.5-M)",
        "configs/sd35/solrl_hps.yaml",
        "sd35_medium",
        (),
        EXPLORE_TINY,
        0.6,
        claim=EXPLORE_CLAIM,
    ),
    SeedRow(
        "flux_dance_grpo",
        "bench",
        "DanceGRPO chains (16 per prompt, 20 steps)",
        "configs/flux/dance_grpo_hps.yaml",
        "flux1_dev",
        FLUX_PX + ("rollout.group_size=16", "rollout.steps=20"),
        CHAINS_TINY,
        2.2,
        claim="baseline (trees: 320 forwards and edges per prompt for 16 independent chains; DanceGRPO's shared x_T "
        "makes the first step one forward, its last step is ODE)",
    ),
    SeedRow(
        "flux_branchgrpo",
        "bench",
        "BranchGRPO (splits 0, 3, 6, 9; depth pruning 4)",
        "configs/flux/branchgrpo_hps.yaml",
        "flux1_dev",
        FLUX_PX,
        TREE_TINY + ("rollout.depth_prune_size=1",),
        1.2,
        baseline="flux_dance_grpo",
        claimed_ratio=0.45,
        claim="BranchGRPO: −55 % s/iteration against DanceGRPO with pruning (FLUX.1-dev, HPDv2.1); 203 forwards, "
        "154 trained edges (218 unpruned) per prompt",
    ),
    SeedRow(
        "flux_branchgrpo_mix",
        "bench",
        "BranchGRPO-Mix (SDE at the splits and steps 0–3)",
        "configs/flux/branchgrpo_hps.yaml",
        "flux1_dev",
        FLUX_PX + ("rollout.mode=mix", "rollout.mix_window=4", "rollout.depth_prune_size=0"),
        TREE_TINY + ("rollout.mix_window=2",),
        0.7,
        baseline="flux_dance_grpo",
        claimed_ratio=1 / 4.7,
        claim="BranchGRPO-Mix: 4.7× faster than DanceGRPO; trees: 203 forwards, 34 trained edges per prompt",
    ),
    SeedRow(
        "flux_mix_grpo",
        "bench",
        "MixGRPO (a 4-step SDE window, ODE elsewhere)",
        "configs/flux/mix_grpo.yaml",
        "flux1_dev",
        FLUX_PX + ("rollout.group_size=16", "rollout.steps=20", "rollout.post_solver=none"),
        CHAINS_TINY + ("rollout.window.size=2",),
        0.9,
        baseline="flux_dance_grpo",
        claimed_ratio=0.5,
        claim="MixGRPO: −50 % training time against DanceGRPO; T forwards per chain, the window's 4 trained edges",
    ),
    SeedRow(
        "flux_explorer",
        "explore",
        "Sol-RL explorer (configs/flux/solrl_pickscore.yaml's preview)",
        "configs/flux/solrl_pickscore.yaml",
        "flux1_dev",
        (),
        EXPLORE_TINY,
        1.0,
        claim=EXPLORE_CLAIM,
    ),
)
RATIO_TOLERANCE = 0.15
"""A measured s/iteration ratio up to this much (relative) above the claimed one counts as the claim's."""


def seed_overrides(spec: SeedRow, args: argparse.Namespace) -> list[str]:
    """The row's preset with :func:`common_overrides` and its own (:func:`own_overrides`)."""
    return common_overrides(spec.name, args) + own_overrides(spec, args)


def common_overrides(name: str, args: argparse.Namespace) -> list[str]:
    """Every seeds row's: a cheap reward (jpeg_compressibility), one inline prompt per iteration, no logging; --tiny:
    64 px, 8 text tokens, one thread, on the CPU."""
    out = [
        "rewards=[{name: jpeg_compressibility}]",
        f"prompts.train={PROMPTS}",
        f"prompts.eval={PROMPTS}",
        "prompts.per_step=1",
        "train.log_with=none",
        "train.progress=false",
        "train.overwrite=true",
        f"train.output_dir={args.work / 'runs'}",
        f"train.name={name}",
        f"model.device={'cpu' if args.tiny else 'cuda'}",
    ]
    if args.tiny:
        out += ["model.height=64", "model.width=64", "model.max_sequence_length=8", "train.num_threads=1"]
    return out


def own_overrides(spec: SeedRow, args: argparse.Namespace) -> list[str]:
    """The row's own overrides, its placeholders filled (and --tiny's after them)."""
    own = [o.format(px=args.seeds_flux_px, group=args.seeds_group) for o in spec.overrides]
    return own + (list(spec.tiny) if args.tiny else [])


# the closed forms, per prompt (docs/algorithms.md "Chains", docs/trees.md "Cost: closed forms", docs/step_credit.md
# "TP-GRPO"), written out here rather than asked of the plans: the row
# compares what the plan did with what the published arithmetic says
def chains_closed_form(steps: int, group: int, window: list[int], shared_noise: bool) -> dict:
    """Chains: T forwards per chain (with one x_T per group the steps up to and including the first stochastic one are
    one forward for the group), one trained edge per window step."""
    trunk = window[0] + 1 if shared_noise and window else 0
    return {"forwards": trunk + group * (steps - trunk), "trained_edges": group * len(window), "leaves": group}


def tree_closed_form(
    steps: int,
    branch: int,
    splits: list[int],
    mode: str = "sde",
    mix_window: int = 4,
    prune_size: int = 0,
    prune_every: int = 30,
    iteration: int = 0,
) -> dict:
    """Trees: n(i) = K^{#splits < i} nodes at step i; rollout forwards Σ_{i<T} n(i); trained edges Σ n(i+1) over the
    SDE steps (``sde``: all; ``mix``: the splits and steps [0, mix_window)) less the depth-pruned ones (child steps
    in a window of ``prune_size`` from the last split + 2, sliding by one every ``prune_every`` iterations)."""
    n = [branch ** sum(1 for s in splits if s < i) for i in range(steps + 1)]
    sde = range(steps) if mode == "sde" else sorted(set(splits) | set(range(min(mix_window, steps))))
    pruned_steps: set[int] = set()
    if prune_size > 0:
        lo = max(splits) + 2
        start = min(lo + iteration // prune_every, max(lo, steps + 1 - prune_size))
        pruned_steps = set(range(start, min(start + prune_size, steps + 1)))
    edges = sum(n[i + 1] for i in sde)
    pruned = sum(n[i + 1] for i in sde if i + 1 in pruned_steps)
    return {"forwards": sum(n[:steps]), "trained_edges": edges - pruned, "unpruned_edges": edges, "leaves": n[steps]}


def tp_closed_form(steps: int, group: int, sde_steps: int) -> dict:
    """TP-GRPO, a window of n SDE steps from step 0: per chain T rollout forwards, T for the pure-ODE reference R_0 and
    T − k for the completion after SDE step k = 1 … n − 1; n trained edges, n + 1 reward calls."""
    per_chain = 2 * steps + sum(steps - k for k in range(1, sde_steps))
    return {
        "forwards": group * per_chain,
        "trained_edges": group * sde_steps,
        "leaves": group,
        "reward_calls": group * (sde_steps + 1),
    }


def closed_form(plan, iteration: int, seed: int) -> dict | None:
    """The closed form of the rollout plan ``plan`` at ``iteration`` of a run of ``seed``, per prompt (None: a plan
    or setting without one here, e.g. a post-solver)."""
    from flowrl.rollout.chains import Chains
    from flowrl.rollout.probes import Probed
    from flowrl.rollout.tree import Tree

    if isinstance(plan, Tree) and plan.mode in ("sde", "mix") and plan.kernel != "cps":
        return tree_closed_form(
            plan.steps,
            plan.branch,
            plan.split_steps,
            plan.mode,
            plan.mix_window,
            plan.depth_prune_size,
            plan.depth_prune_every,
            iteration,
        )
    if isinstance(plan, Chains) and plan.post_solver == "none":
        window = plan.window.steps(plan.steps, iteration, seed)
        return chains_closed_form(plan.steps, plan.group_size, window, plan.shared_noise)
    inner = getattr(plan, "inner_plan", None)
    if isinstance(plan, Probed) and plan.probe == "ode_completion" and isinstance(inner, Chains):
        window = inner.window.steps(inner.steps, iteration, seed)
        if window == list(range(len(window))) and not inner.shared_noise and inner.post_solver == "none":
            return tp_closed_form(inner.steps, inner.group_size, len(window))
    return None


def ratio_verdict(measured: float, claimed: float) -> str:
    """A measured s/iteration ratio (this row / its baseline) against the claimed one."""
    if not math.isfinite(measured):
        return "not measured"
    if measured <= claimed * (1 + RATIO_TOLERANCE):
        return f"as claimed: ×{fmt(measured)} the baseline's s/iteration (claimed ×{fmt(claimed)})"
    if measured < 1:
        return f"faster, short of the claim: ×{fmt(measured)} (claimed ×{fmt(claimed)})"
    return f"not faster: ×{fmt(measured)} (claimed ×{fmt(claimed)})"


def seed_verdict(row: dict, base: dict | None, spec: SeedRow) -> str:
    """A bench row's verdict: its s/iteration against the baseline's and the claim, its counts against the closed
    form (TP-GRPO's claim is its forwards per chain: both rows' counts as the closed forms)."""
    counts = (
        "counts as the closed form"
        if row.get("counts_match")
        else "no closed form here"
        if row.get("forwards_closed") is None
        else f"counts differ from the closed form (forwards {fmt(row['forwards'])} vs {fmt(row['forwards_closed'])}, "
        f"edges {fmt(row['edges'])} vs {fmt(row['edges_closed'])})"
    )
    if spec.baseline is None:
        return f"baseline; {counts}"
    if base is None:
        return f"baseline {spec.baseline} not measured; {counts}"
    if spec.claimed_ratio is not None:
        return f"{ratio_verdict(row['ratio'], spec.claimed_ratio)}; {counts}"
    stated = row.get("counts_match") and base.get("counts_match")
    return (
        f"{'as stated' if stated else 'not as stated'}: {fmt(row['forwards_per_image'])} vs "
        f"{fmt(base['forwards_per_image'])} forwards per image (closed forms "
        f"{fmt(row.get('forwards_closed_per_image'))} vs {fmt(base.get('forwards_closed_per_image'))}); "
        f"s/iteration ×{fmt(row['ratio'])}"
    )


def seed_bench_row(spec: SeedRow, args: argparse.Namespace, gpu: str, row: dict, report: Report) -> dict:
    """One (or --seeds-iterations) training iteration(s) of the row's preset at real size (random weights; --tiny:
    the shrunk architecture on the CPU) after --seeds-warmup: flowrl bench's timings, the rollout forwards and trained
    edges per prompt against the closed form, and the ratio to the baseline row with the verdict."""
    import torch

    from flowrl.commands.bench import bench_iteration
    from flowrl.config.build import build_plan
    from flowrl.estimate import load_arch, load_config
    from flowrl.models.random_init import tiny_arch
    from flowrl.run.model import random_model

    cfg = load_config(preset_path(spec.config), seed_overrides(spec, args), gpu)
    if spec.loss_from:  # the same update as the rows compared with it: their objective, optimiser, updates
        donor = load_config(preset_path(spec.loss_from), common_overrides(spec.name, args), gpu)
        cfg.loss, cfg.optim = copy.deepcopy(donor.loss), copy.deepcopy(donor.optim)
        cfg.train.inner_epochs, cfg.train.updates_per_epoch = donor.train.inner_epochs, donor.train.updates_per_epoch
        row["loss_from"] = spec.loss_from
    arch = tiny_arch(spec.arch) if args.tiny else load_arch(spec.arch)
    plan = build_plan(cfg.rollout)
    closed = closed_form(plan, args.seeds_warmup, cfg.train.seed)  # the first timed iteration's
    prompts = cfg.prompts.per_step
    row.update(config=spec.config, model=arch["name"], status="ok", overrides=own_overrides(spec, args))
    row["closed_form"] = closed
    row["update_settings"] = {  # what an update costs besides the edges: a row and its baseline should agree
        "objective": cfg.loss.objective,
        "kl_ref": cfg.loss.kl_ref,
        "cfg_gradient": getattr(cfg.loss, "cfg_gradient", None),  # CFG's unconditional branch trained or detached
        "inner_epochs": cfg.train.inner_epochs,
        "updates_per_epoch": cfg.train.updates_per_epoch,
        "gradient_checkpointing": cfg.model.gradient_checkpointing,
        "lora_rank": cfg.model.lora.rank,
    }
    t0 = time.monotonic()
    model = random_model(cfg.model, "cpu" if args.tiny else "cuda", arch)
    row["build_seconds"] = time.monotonic() - t0
    bench = bench_iteration(cfg, iterations=args.seeds_iterations, warmup=args.seeds_warmup, model=model)
    del model
    release_memory()
    forwards = bench.get("rollout_forwards", float("nan")) / prompts
    edges = bench.get("trained_edges", float("nan")) / prompts
    leaves = (closed or {}).get("leaves")
    on_gpu = "peak_memory_mb" in bench
    row.update(
        settings_text=f"{cfg.model.height} px · T {plan.schedule_steps} · {prompts} × {fmt(leaves)}",
        iterations=args.seeds_iterations,
        warmup=args.seeds_warmup,
        seconds_per_iteration=bench["seconds_per_iteration"],
        rollout_seconds=bench["time/rollout"],
        reward_seconds=bench["time/reward"],
        update_seconds=bench["time/update"],
        forward_seconds=bench["forward_seconds"],
        backward_seconds=bench["backward_seconds"],
        forwards=forwards,
        edges=edges,
        nfe=bench.get("rollout_nfe", float("nan")) / prompts,
        forwards_closed=(closed or {}).get("forwards"),
        edges_closed=(closed or {}).get("trained_edges"),
        counts_match=bool(closed) and forwards == closed["forwards"] and edges == closed["trained_edges"],
        forwards_per_image=forwards / leaves if leaves else None,
        forwards_closed_per_image=closed["forwards"] / leaves if leaves else None,
        peak_memory_gib=(bench["peak_memory_mb"] if on_gpu else bench["peak_rss_mb"]) / 1024,
        bench=bench,
    )
    if on_gpu:
        row["allocated_after_release_gib"] = torch.cuda.memory_allocated() / GiB
    base = next(
        (r for r in report.rows("seeds") if r.get("name") == spec.baseline and r.get("status") == "ok"),
        None,
    )
    if base is not None:
        row.update(
            baseline=base["name"],
            ratio=row["seconds_per_iteration"] / base["seconds_per_iteration"],
            forwards_ratio=forwards / base["forwards"],
            edges_ratio=edges / base["edges"] if base["edges"] else None,
        )
    row.update(claimed_ratio=spec.claimed_ratio, verdict=seed_verdict(row, base, spec))
    return row


def explorer_rate(model, backend: str, rollout, prompts: list[str], seeds: list[int], cuda: bool) -> dict:
    """Sol-RL's preview with an explorer of ``backend`` (:func:`flowrl.rollout.explorer.make_explorer`, the
    section's ``min_params`` and ``skip``): ``rollout.preview_steps`` Euler steps of the ODE at the model's guidance
    for every candidate (``prompts[i]`` from ``seeds[i]``), in batches of ``rollout.max_batch``, no decode (the
    explorer's share of a preview), after a one-step warm-up batch; candidates/s, and the matrix products of one
    preview step under the profiler (which path the converted layers took)."""
    import torch

    from flowrl.rollout.explorer import make_explorer
    from flowrl.rollout.precision import DEFAULT_MIN_PARAMS
    from flowrl.rollout.sampling import ode_sample

    sync = torch.cuda.synchronize if cuda else (lambda: None)
    t0 = time.monotonic()
    min_params = getattr(rollout, "min_params", None)
    explorer = make_explorer(
        model,
        backend,
        min_params=DEFAULT_MIN_PARAMS if min_params is None else min_params,
        skip=getattr(rollout, "skip", None),
    )
    sync()
    built = time.monotonic() - t0
    batch = rollout.max_batch

    def preview(n: int, steps: int):
        return ode_sample(explorer.model, prompts[:n], seeds[:n], steps, max_batch=batch, decode=False)

    preview(batch, 1)  # kernels chosen, prompts encoded (the adapter's cache), the allocator grown
    sync()
    t1 = time.monotonic()
    preview(len(prompts), rollout.preview_steps)
    sync()
    seconds = time.monotonic() - t1
    counts = gpu_profile.matmul_ops(lambda: preview(batch, 1), cuda=cuda)
    layer = explorer.transformer.get_submodule(explorer.quantized[0]) if explorer.quantized else None
    weight = getattr(layer, "weight", None)
    weight = weight() if callable(weight) else weight  # torch.ao's dynamic Linear keeps it behind a method
    out = {
        "backend": backend,
        "candidates_per_second": len(prompts) / seconds,
        "seconds": seconds,
        "build_seconds": built,
        "quantized_layers": len(explorer.quantized),
        "layer_type": None if layer is None else f"{type(layer).__name__} ({type(weight).__name__} weight)",
        "path": gpu_profile.low_precision_path(counts, backend, len(explorer.quantized)),
        "matmuls": counts,
    }
    return out  # the copy goes with this frame: the caller releases the memory


def seed_explore_row(spec: SeedRow, args: argparse.Namespace, gpu: str, row: dict, report: Report) -> dict:
    """The preset's explorer settings (resolution, preview steps, batch, converted layers) on its model with the
    preset's LoRA attached (merged into each copy), --explore-batches × max_batch candidates: BF16 against FP8
    (--tiny: int8, on the CPU), candidates/s, the ratio and the FP8 path that ran."""
    import importlib.metadata
    import importlib.util

    from flowrl.config import build
    from flowrl.estimate import load_arch, load_config
    from flowrl.models.random_init import tiny_arch
    from flowrl.run.model import random_model

    cfg = load_config(preset_path(spec.config), seed_overrides(spec, args), gpu)
    arch = tiny_arch(spec.arch) if args.tiny else load_arch(spec.arch)
    base_backend, low_backend = ("bf16", "int8") if args.tiny else ("bf16", "fp8")
    r = cfg.rollout
    n = args.explore_batches * r.max_batch
    row.update(
        config=spec.config,
        model=arch["name"],
        status="ok",
        overrides=own_overrides(spec, args),
        backends=f"{base_backend} → {low_backend}",
        low_backend=low_backend,
        candidates=n,
        settings_text=f"{cfg.model.height} px · {r.preview_steps} steps · {n} candidates in batches of {r.max_batch}",
        torchao=importlib.metadata.version("torchao") if importlib.util.find_spec("torchao") else None,
    )
    t0 = time.monotonic()
    cuda = not args.tiny
    model = random_model(cfg.model, "cuda" if cuda else "cpu", arch)
    build.add_lora(model, cfg.model)
    row["build_seconds"] = time.monotonic() - t0
    words = PROMPTS.split("|")
    prompts, seeds = [words[i % len(words)] for i in range(n)], list(range(n))
    rates = {}
    for key, backend in (("base", base_backend), ("low", low_backend)):
        rates[key] = explorer_rate(model, backend, r, prompts, seeds, cuda)
        release_memory()  # the copy measured
        row[f"{key}_rate"] = rates[key]["candidates_per_second"]
        row[key] = rates[key]
    del model
    release_memory()
    low = rates["low"]
    ratio = row["low_rate"] / row["base_rate"]
    row.update(ratio=ratio, quantized_layers=low["quantized_layers"], path=low["path"], layer_type=low["layer_type"])
    if low["path"].startswith("no low-precision matmul ran"):
        verdict = f"{low_backend} weights, but no {low_backend} matmul ran: ×{fmt(ratio)} BF16's candidates/s"
    elif ratio > 1:
        verdict = f"faster: {low_backend} previews ×{fmt(ratio)} BF16's candidates/s"
    else:
        verdict = f"not faster: {low_backend} previews ×{fmt(ratio)} BF16's candidates/s"
    row["verdict"] = verdict
    return row


def run_seeds(report: Report, budget: Budget, args: argparse.Namespace) -> None:
    """Every row of :data:`SEEDS` in order, each with its share of the budget (1.5× while the budget has it)."""
    gpu = report.data["meta"]["gpu_class"]
    for spec in SEEDS:
        seconds = budget.allot(f"seeds/{spec.name}")
        run = seed_bench_row if spec.kind == "bench" else seed_explore_row
        guarded(
            report,
            budget,
            "seeds",
            spec.name,
            seconds,
            lambda row: run(spec, args, gpu, row, report),
            slack=1.5,
            initial={"kind": spec.kind, "method": spec.method, "claim": spec.claim, "baseline": spec.baseline},
        )


# ---- part 6: train.pipeline=async against sync on one device ------------------------------------------------------
ASYNC_PRESET = PRESETS[1]
"""The async part's preset: SD3.5-Medium DiffusionNFT, LoRA (configs/sd35/nft_geneval.yaml) at the presets' 2 × 8."""
ASYNC_RUNS = (
    ("sync", ["train.pipeline=sync"]),
    ("async", ["train.pipeline=async", "train.max_staleness=1"]),
)
ASYNC_WEIGHTS = {"folder": 1.0, "sync": 1.6, "async": 2.4}
"""Shares of the part's time (expected seconds on an H100 / 50): the model folder (build on the GPU, save ≈ 16.6 GB),
the sync run (start, load, warm-up and timed iterations), the async run (the same, and its rollout process's start
and load after the trainer's)."""
ASYNC_GOAL = 1.25
"""The issue's goal for train.pipeline=async: images/s ≥ 1.25 × sync's (set for the CPU main job)."""
OOM = re.compile(r"out of memory|OutOfMemoryError", re.I)
"""What a run that ran out of (device) memory says in its log or error."""


def async_folder(cfg, args: argparse.Namespace, folder: Path, row: dict) -> Path:
    """The preset's architecture built with random weights in ``model.dtype`` (on the GPU; --tiny: the tiny one on the
    CPU) and saved to ``folder`` with ``save_pretrained``: what both runs load as ``model.path``."""
    import torch

    from flowrl.estimate import load_arch
    from flowrl.models.dtypes import dtype_named
    from flowrl.models.random_init import random_pipeline, tiny_arch

    arch = tiny_arch(ASYNC_PRESET.arch) if args.tiny else load_arch(ASYNC_PRESET.arch)
    dtype = dtype_named(cfg.model.dtype) or torch.float32
    t0 = time.monotonic()
    pipe = random_pipeline(arch, "cpu" if args.tiny else "cuda", dtype)
    t1 = time.monotonic()
    pipe.save_pretrained(folder)
    del pipe
    release_memory()
    size = sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())
    row.update(
        model=arch["name"],
        dtype=str(cfg.model.dtype),
        build_seconds=t1 - t0,
        save_seconds=time.monotonic() - t1,
        gib=size / GiB,
    )
    return folder


def async_overrides(args: argparse.Namespace, name: str, folder: Path, extra: list[str]) -> list[str]:
    """The preset's row settings (:func:`preset_overrides`) loaded from ``folder``, no evals, --async-warmup +
    --async-iterations iterations, ``extra`` (the run's pipeline keys) last; --tiny: 2 CPU threads (the async run's
    split 1 / 1)."""
    base = [o for o in preset_overrides(ASYNC_PRESET, args, name) if not o.startswith(("prompts.eval=", "train.num_"))]
    out = base + [
        f"model.path={folder}",
        f"model.compile={args.async_compile}",
        "prompts.eval=null",
        "eval.at_start=false",
        "eval.every=0",
        "train.checkpoint_every=0",
        f"train.max_steps={args.async_warmup + args.async_iterations}",
    ]
    if args.tiny:
        out.append("train.num_threads=2")
        if "train.pipeline=async" in extra:
            out.append("train.rollout_threads=1")
    return out + extra


def process_tree(root: int) -> list[int]:
    """``root`` and its descendants (Linux /proc; only ``root`` elsewhere)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = entry.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        children.setdefault(int(fields[1]), []).append(int(entry.parent.name))
    out, todo = [], [root]
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo += children.get(pid, [])
    return out


def resident_bytes(pid: int) -> int:
    """The resident memory of ``pid`` (0 once it is gone, and for multiprocessing's resource tracker: a helper of
    the spawned rollout process, not one of the run's)."""
    try:
        if b"resource_tracker" in Path(f"/proc/{pid}/cmdline").read_bytes():
            return 0
        return int(Path(f"/proc/{pid}/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, IndexError, ValueError):
        return 0


def gpu_processes() -> dict[int, int]:
    """Bytes of device memory per process as nvidia-smi lists them ({} without nvidia-smi, or when it lists none:
    a container may hide them)."""
    import shutil

    if shutil.which("nvidia-smi") is None:
        return {}
    try:
        text = subprocess.run(
            ["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
            capture_output=True,
            text=True,
            timeout=10,
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return {}
    out = {}
    for line in text.splitlines():
        pid, _, mib = line.partition(",")
        if pid.strip().isdigit() and mib.strip().isdigit():
            out[int(pid)] = int(mib) * 2**20
    return out


class MemorySampler:
    """The memory in use while a run goes, sampled every ``interval`` seconds in a thread of the check: on a GPU the
    device's (``torch.cuda.mem_get_info``: every process on the card, the trainer's and its rollout process's
    together, this check's context included: ``baseline``) and each process's as nvidia-smi lists them (every 2 s;
    those it listed before the run, this check among them, left out); on
    a CPU the resident memory of the run's processes (``watch``: the root, with its descendants)."""

    def __init__(self, cuda: bool, interval: float = 0.25):
        self.cuda, self.interval, self.root = cuda, interval, None
        self.before = set(gpu_processes()) if cuda else set()  # this check's own context, whatever its pid there
        self.baseline = self.sample()
        self.peak, self.samples, self.per_process, self.processes = self.baseline, 0, {}, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="gpu_check-memory", daemon=True)

    def watch(self, root: int) -> "MemorySampler":
        """Start sampling, the run's processes being ``root`` and its descendants (on a CPU, a run in this process
        counts from what this process held before it: the baseline)."""
        self.root = root
        if not self.cuda and root == os.getpid():
            self.baseline = self.peak = self.sample()
        self._thread.start()
        return self

    def sample(self) -> int:
        if self.cuda:
            import torch

            free, total = torch.cuda.mem_get_info()
            return total - free
        if self.root is None:
            return 0
        sizes = {pid: resident_bytes(pid) for pid in process_tree(self.root)}
        self._seen(sizes)
        return sum(sizes.values())

    def _seen(self, sizes: dict[int, int]) -> None:
        live = {pid: b for pid, b in sizes.items() if b > 0}
        self.processes = max(self.processes, len(live))
        for pid, b in live.items():
            self.per_process[pid] = max(self.per_process.get(pid, 0), b)

    def _loop(self) -> None:
        smi = 0.0
        while True:
            try:
                self.peak = max(self.peak, self.sample())
                self.samples += 1
                if self.cuda and time.monotonic() - smi >= 2.0:
                    smi = time.monotonic()
                    self._seen({p: b for p, b in gpu_processes().items() if p not in self.before})
            except Exception:  # noqa: BLE001 - a failed sample is a missing sample
                pass
            if self._stop.wait(self.interval):
                return

    def stop(self) -> dict:
        """The row's memory columns: the peak in use, the baseline before the run, the run's own, per process."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(5)
        return {
            "peak_memory_gib": self.peak / GiB,
            "baseline_memory_gib": self.baseline / GiB,
            "run_memory_gib": (self.peak - self.baseline) / GiB,
            "memory_source": "torch.cuda.mem_get_info (the device: every process on it)"
            if self.cuda
            else "resident memory of the run's processes (CPU)",
            "memory_samples": self.samples,
            "processes": self.processes or None,
            "per_process_gib": {str(pid): b / GiB for pid, b in sorted(self.per_process.items())},
        }


def async_summary(records: list[dict], warmup: int) -> dict:
    """A run's columns from its metrics.jsonl records: the means over the iterations after ``warmup`` (s/iteration
    from ``time/iteration``, images/s = leaves / it, ``time/rollout``, ``time/reward``, ``time/update``, the
    pipeline's ``update_wait``, ``rollout_wait`` and ``staleness``: None where the run logs none, as a sync one)."""
    nan = float("nan")
    steps = [r for r in records if "time/iteration" in r]
    timed = steps[warmup:]

    def mean(key: str):
        values = [float(r[key]) for r in timed if key in r]
        return sum(values) / len(values) if values else (None if key.startswith("pipeline/") else nan)

    seconds = mean("time/iteration")
    leaves = mean("leaves")
    per_iteration = [float(r["time/iteration"]) for r in timed]
    return {
        "iterations": len(steps),
        "timed": len(timed),
        "seconds_per_iteration": seconds,
        "seconds_range": [min(per_iteration), max(per_iteration)] if per_iteration else None,
        "images_per_iteration": leaves,
        "images_per_second": leaves / seconds if timed and seconds > 0 else nan,
        "rollout_seconds": mean("time/rollout"),
        "reward_seconds": mean("time/reward"),
        "update_seconds": mean("time/update"),
        "update_wait": mean("pipeline/update_wait"),
        "rollout_wait": mean("pipeline/rollout_wait"),
        "staleness": mean("pipeline/staleness"),
        "versions": [int(r["pipeline/version"]) for r in steps if "pipeline/version" in r] or None,
        "warmup_seconds": sum(float(r["time/iteration"]) for r in steps[:warmup]) if steps else nan,
    }


def async_verdict(sync: dict | None, run: dict, cuda: bool) -> dict:
    """The async row's ratio (its images/s over sync's), the serial bound (sync's s/iteration over its longer side:
    what a perfect overlap on separate hardware would give) and the verdict against :data:`ASYNC_GOAL`; a run that
    ran out of memory: the card does not hold both processes."""
    if run.get("oom"):
        used = f"{fmt(run.get('peak_memory_gib'))} GiB in use at the peak"
        return {"ratio": None, "verdict": f"the card does not hold both processes: {run['oom']} ({used})"}
    base = (sync or {}).get("images_per_second")
    mine = run.get("images_per_second")
    rates = {"sync": base, "async": mine}
    missing = [k for k, v in rates.items() if not (isinstance(v, (int, float)) and math.isfinite(v) and v > 0)]
    if missing:
        return {"ratio": None, "verdict": f"not measured: {' and '.join(missing)} without images/s"}
    ratio = mine / base
    longer = max(sync["rollout_seconds"] + sync["reward_seconds"], sync["update_seconds"])
    bound = sync["seconds_per_iteration"] / longer if longer > 0 else None
    if ratio >= ASYNC_GOAL:
        verdict = f"meets the {ASYNC_GOAL:g}× goal: async ×{fmt(ratio)} sync's images/s"
    elif ratio >= 1.05:
        verdict = f"faster, short of the {ASYNC_GOAL:g}× goal: async ×{fmt(ratio)} sync's images/s"
    elif ratio > 0.95:
        verdict = f"no gain: async ×{fmt(ratio)} sync's images/s (within 5 %)"
    else:
        verdict = f"slower: async ×{fmt(ratio)} sync's images/s"
    if cuda:
        verdict += (
            f"; on one GPU both processes share its compute, so the overlap takes only what one side leaves idle "
            f"(separate devices would allow up to ×{fmt(bound)}: sync's s/iteration over its longer side)"
        )
    return {"ratio": ratio, "overlap_bound": bound, "verdict": verdict}


def async_row_inline(cfg, sampler: MemorySampler) -> None:
    """The run as a :class:`~flowrl.training.trainer.Trainer` in this process (--async-launch inline)."""
    from flowrl.training.trainer import Trainer

    sampler.watch(os.getpid())
    Trainer(cfg).train()


def async_row_process(
    args: argparse.Namespace, overrides: list[str], name: str, limit: float, row: dict, sampler: MemorySampler
) -> int | None:
    """The run as a ``flowrl train`` process, stopped (SIGTERM, then killed after :data:`SHAPES_GRACE`) at ``limit``
    seconds: its exit status, None when it was stopped."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    log = args.work / f"async_{name}.log"
    row["log"] = log.name
    command = [sys.executable, "-m", "flowrl", "train", preset_path(ASYNC_PRESET.config), *overrides]
    with open(log, "w") as out:
        proc = subprocess.Popen(command, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT)
    sampler.watch(proc.pid)
    try:
        proc.wait(limit)
    except subprocess.TimeoutExpired:
        stop_process(proc)
        return None
    finally:
        stop_process(proc)  # an exception here (Ctrl-C) leaves no run behind
    if proc.returncode != 0:
        text = log.read_text(errors="replace") if log.is_file() else ""
        found = OOM.search(text)
        tail = log_tail(log, 3)
        if found:
            row["oom"] = next((x.strip() for x in text.splitlines() if OOM.search(x)), found.group(0))[:300]
        row["error"] = f"flowrl train exited {proc.returncode}: {tail}"
    return proc.returncode


def async_run(args, name: str, extra: list[str], folder: Path, share: float, limit: float, row: dict) -> dict:
    """One run of the part (``extra``: its pipeline keys) with the memory sampled while it goes, summarised from its
    metrics.jsonl whatever ended it."""
    from flowrl.config.schema import TrainConfig

    overrides = async_overrides(args, f"async_part_{name}", folder, extra)
    cfg = TrainConfig.from_yaml(preset_path(ASYNC_PRESET.config), overrides)
    cuda = not args.tiny
    row.update(
        name=name,
        pipeline=cfg.train.pipeline,
        max_staleness=cfg.train.max_staleness if cfg.train.pipeline == "async" else None,
        config=ASYNC_PRESET.config,
        overrides=extra,
        launch=args.async_launch,
        batch=f"{cfg.prompts.per_step} × {cfg.rollout.group_size}",
        size=f"{cfg.model.height} / {cfg.rollout.steps}",
        settings={
            "dtype": cfg.model.dtype,
            "lora_rank": None if cfg.model.full_finetune else cfg.model.lora.rank,
            "full_finetune": cfg.model.full_finetune,
            "compile": cfg.model.compile,
            "gradient_checkpointing": cfg.model.gradient_checkpointing,
            "max_batch": cfg.rollout.max_batch,
            "num_threads": cfg.train.num_threads,
            "rollout_threads": cfg.train.rollout_threads,
        },
        warmup=args.async_warmup,
        share_seconds=share,
    )
    print(f"[gpu_check] async: {name} ({share:.0f} s, stopped at {limit:.0f} s)", flush=True)
    release_memory()
    sampler = MemorySampler(cuda)
    t0 = time.monotonic()
    status, error = "ok", None
    try:
        if args.async_launch == "inline":
            with deadline(limit, f"async/{name}"):
                async_row_inline(cfg, sampler)
        else:
            rc = async_row_process(args, overrides, name, limit, row, sampler)
            if rc is None:
                status, error = "out_of_time", f"async/{name}: stopped after {limit:.0f} s"
            elif rc != 0:
                status, error = "failed", row.pop("error")
    except OutOfTime as e:
        status, error = "out_of_time", str(e)
    except Exception as e:  # noqa: BLE001 - the run failed; its row says how
        status, error = "failed", one_line(e)
        if OOM.search(str(e)) or OOM.search(type(e).__name__):
            row["oom"] = one_line(e)[:300]
    finally:
        row.update(sampler.stop())
    row["wall_seconds"] = time.monotonic() - t0
    records = read_metrics(Path(cfg.train.output_dir) / cfg.train.name / "metrics.jsonl")
    row.update(async_summary(records, args.async_warmup))
    row["held"] = not row.get("oom")
    if row.get("oom") and cfg.train.pipeline == "async":
        status, error = "ok", None  # the answer: the card does not hold both processes (the verdict says so)
    row.update(status=status, error=error)
    return row


def run_async(report: Report, budget: Budget, args: argparse.Namespace) -> None:
    """The model folder, then the sync run and the async run of :data:`ASYNC_PRESET` one after the other (each its
    share of the part, stopped at 1.25 × it while the budget has it), the ratio and the verdict on the async row."""
    import shutil

    from flowrl.estimate import load_config

    seconds = budget.allot("async")
    part = Budget(seconds, ASYNC_WEIGHTS)
    gpu = report.data["meta"]["gpu_class"]
    folder = args.work / "async_model"
    info: dict = {}
    limit = lambda share: max(share, min(1.25 * share, budget.left() - 5))  # noqa: E731
    try:
        share = part.allot("folder")
        print(f"[gpu_check] async: model folder ({share:.0f} s, stopped at {limit(share):.0f} s)", flush=True)
        cfg = load_config(preset_path(ASYNC_PRESET.config), preset_overrides(ASYNC_PRESET, args, "async_part"), gpu)
        with deadline(limit(share), "async/model folder"):
            async_folder(cfg, args, folder, info)
    except Exception as e:  # noqa: BLE001 - OutOfTime too: without the folder no run can start
        shutil.rmtree(folder, ignore_errors=True)
        release_memory()
        for name, extra in ASYNC_RUNS:
            report.add("async", {"name": name, "status": "failed", "error": f"the model folder: {one_line(e)}"})
        return
    try:
        sync = None
        for name, extra in ASYNC_RUNS:
            share = part.allot(name)
            t0 = time.monotonic()
            row = async_run(args, name, extra, folder, share, limit(share), {"model_folder": info})
            row["row_seconds"] = time.monotonic() - t0
            if name == "sync":
                sync = row  # its images/s, when it measured any (a run stopped late may have)
            else:
                row.update(async_verdict(sync, row, cuda=not args.tiny))
            report.add("async", row)
            print(f"[gpu_check]   → {row['status']}" + (f": {row['error']}" if row.get("error") else ""), flush=True)
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def async_tables(rows: list[dict]) -> list[str]:
    """Under the async table: the answer (images/s of both runs, the ratio, the goal, memory, the verdict) and the
    model folder's cost."""
    runs = {r.get("name"): r for r in rows}
    sync, run = runs.get("sync", {}), runs.get("async", {})
    if not run:
        return []
    lines = [
        f"**async against sync**: {fmt(sync.get('images_per_second'))} → {fmt(run.get('images_per_second'))} images/s, "
        f"×{fmt(run.get('ratio'))} (the goal: ×{ASYNC_GOAL:g}); memory in use at the peak "
        f"{fmt(sync.get('peak_memory_gib'))} GiB (sync) and {fmt(run.get('peak_memory_gib'))} GiB (async: both "
        f"processes), the card held both: {fmt(run.get('held'))}. {run.get('verdict', '')}",
    ]
    folder = run.get("model_folder") or sync.get("model_folder") or {}
    if folder:
        lines += [
            "",
            f"The model folder (`model.path` of both runs): {folder.get('model')} in {folder.get('dtype')}, random "
            f"weights, built in {fmt(folder.get('build_seconds'))} s, saved in {fmt(folder.get('save_seconds'))} s, "
            f"{fmt(folder.get('gib'))} GiB.",
        ]
    return lines


# ---- main ---------------------------------------------------------------------------------------
RUNNERS = {
    "presets": run_presets,
    "profile": run_profile,
    "shapes": run_shapes,
    "snr": run_snr,
    "seeds": run_seeds,
    "async": run_async,
}


def quiet_libraries() -> None:
    import warnings

    import diffusers
    import transformers

    diffusers.utils.logging.set_verbosity_error()
    transformers.logging.set_verbosity_error()
    warnings.filterwarnings("ignore", message=".*should be kept in float32.*")


def budget_weights(parts: list[str]) -> dict[str, float]:
    """The budget's keys and weights of ``parts``, in their order: two per preset (shipped, fitted), one per seeds
    row, one per other part."""
    weights: dict[str, float] = {}
    for part in parts:
        if part == "presets":
            weights.update({k: w for p in PRESETS for k, w in zip(p.keys(), (p.weight, p.fitted_weight))})
        elif part == "seeds":
            weights.update({f"seeds/{s.name}": s.weight for s in SEEDS})
        else:
            weights[part] = PART_WEIGHTS[part]
    return weights


def part_keys(part: str) -> list[str]:
    """The budget's keys of ``part`` (:func:`budget_weights`)."""
    return list(budget_weights([part]))


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    os.environ.setdefault("GOMP_SPINCOUNT", "1000")  # as flowrl's CLI: no OpenMP spinning on shared cores
    missing = missing_requirements(args.tiny)
    if missing:
        print(
            f"gpu_check: cannot run here: missing {'; '.join(missing)}. Run it on the GPU machine through "
            "scripts/gpu_check.sh (docs/gpu.md), or with --tiny on a CPU.",
            file=sys.stderr,
        )
        return 2
    quiet_libraries()
    import flowrl.commands.bench  # noqa: F401 - the libraries imported once, then frozen: their objects stay out of every
    import flowrl.estimate  # noqa: F401   later gc.collect (the estimate collects once per traced phase)
    import flowrl.models.blocks
    import flowrl.training.trainer  # noqa: F401

    flowrl.models.blocks.COMPILE_BACKEND = args.compile_backend  # model.compile=regional's (eager with --tiny)
    gc.freeze()
    args.work = args.work or Path(tempfile.mkdtemp(prefix="gpu_check_"))
    args.work.mkdir(parents=True, exist_ok=True)  # a --work given may not exist yet (the shapes runs' logs go there)
    budget = Budget(args.minutes * 60, budget_weights(args.parts), start=STARTED)
    report = Report(args.out, environment(args), args.parts)
    print(
        f"[gpu_check] {report.data['meta']['device']}, {args.minutes:g} min, parts {','.join(args.parts)}; "
        f"writing {report.out}/gpu_check.{{md,json}}",
        flush=True,
    )
    for part in args.parts:
        t0 = time.monotonic()
        error = None
        try:
            RUNNERS[part](report, budget, args)
        except Exception as e:  # noqa: BLE001 - a part that breaks leaves the others their time
            error = one_line(e)
        allotted = sum(budget.given.get(k, 0.0) for k in part_keys(part))
        report.close_part(part, time.monotonic() - t0, allotted, error)
    report.data["meta"]["seconds"] = round(budget.elapsed(), 1)
    report.write()
    print(report.markdown(), flush=True)
    statuses = {entry["status"] for entry in report.data["parts"].values()}
    return 0 if statuses <= {"ok"} else 1


if __name__ == "__main__":
    sys.exit(main())
