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
  1,024 images per update (16 prompts × 64), as many updates as fit, seeds 0 and 1, held-out strict accuracy at
  guidance 1 (and 3) before and after;
- ``snr``: ``flowrl snr --reward-only`` (:func:`flowrl.commands.snr.gradient_snr`) of the main job at 1,024 images per
batch.

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
import signal
import subprocess
import sys
import tempfile
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

PARTS = ("presets", "profile", "shapes", "snr")
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
PART_WEIGHTS = {"profile": 2.0, "shapes": 1.2, "snr": 0.3}
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
        default=",".join(PARTS),
        help="comma-separated parts to run, in this order (default: all): presets (SD3.5-M Flow-GRPO and NFT, "
        "FLUX.1-dev NFT, LoRA, real size; shipped, then train.fit=auto + model.compile=regional), profile "
        "(torch.profiler of one SD3.5-M Flow-GRPO iteration), shapes (main job and distillation at 1,024 "
        "images per update), snr (--reward-only at 1,024 images per batch)",
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
    args.parts = parts
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
}
TITLES = {
    "presets": "Real presets, real size, random weights: shipped, and train.fit=auto + model.compile=regional",
    "profile": "torch.profiler: one Flow-GRPO iteration",
    "shapes": "Shapes: the main job and distillation alone, many images per update",
    "snr": "The reward's gradient signal (flowrl snr --reward-only)",
}


def profile_tables(rows: list[dict]) -> list[str]:
    """The profile part's tables under its row (scripts/gpu_profile.py)."""
    return [
        line for r in rows if r.get("profile") for line in gpu_profile.markdown(r["profile"], r.get("sync_sites"), fmt)
    ]


class Report(gpu_report.Report):
    """gpu_check.json and gpu_check.md (scripts/gpu_report.py) with this check's parts."""

    titles, columns, extras = TITLES, COLUMNS, {"profile": profile_tables}


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
        "python": platform.python_version(),
        "commit": commit_of(args.commit),
        "started": now(),
        "minutes": args.minutes,
        "peak_tflops": args.peak_tflops,
        "parts": args.parts,
        "argv": sys.argv[1:],
    }


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
        row.update(compiled(model), backend=args.compile_backend)
    if fitted:
        base = (shipped or {}).get("images_per_second") if (shipped or {}).get("status") == "ok" else None
        row["speedup"] = row["images_per_second"] / base if base else None  # None: the shipped row did not measure
    del model
    release_memory()
    if torch.cuda.is_available() and not args.tiny:
        row["allocated_after_release_gib"] = torch.cuda.memory_allocated() / GiB  # > 0: something kept the model
    return row


def compiled(model) -> dict:
    """What regional compilation did to ``model``'s transformer (flowrl/models/blocks.py's CompileStats)."""
    from flowrl.models.blocks import compile_stats

    stats = compile_stats(model.pipe.transformer)
    if stats is None:
        return {"compiled_blocks": 0}
    return {"compiled_blocks": stats.blocks, "compiled_graphs": dict(stats.graphs), "compile_seconds": stats.seconds}


def guarded(report: Report, budget: Budget, part: str, name: str, seconds: float, run, slack: float = 1.25) -> dict:
    """``run(row)``'s row under a deadline of ``seconds`` (× ``slack`` while the budget has it); when it runs out of
    time or fails, what ``run`` had put in ``row`` so far, with the status and the error."""
    t0 = time.monotonic()
    limit = max(seconds, min(slack * seconds, budget.left() - 5))
    print(f"[gpu_check] {part}: {name} ({seconds:.0f} s, stopped at {limit:.0f} s)", flush=True)
    partial: dict = {"name": name}
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
def shapes_overrides(args: argparse.Namespace, name: str, seed: int, minutes: float) -> list[str]:
    """configs/shapes/nft.yaml at --shapes-prompts × --shapes-images per update for ``minutes`` of training (evals
    excluded; --tiny: one update, 4 held-out prompts, 2 steps)."""
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
    ]
    if args.tiny:
        return out + [
            "train.max_steps=1",
            "model.device=cpu",
            "train.num_threads=1",
            "eval.num_prompts=4",
            "eval.steps=2",
            "eval.images_per_prompt=1",
            "rollout.steps=2",
        ]
    return out + ["train.max_steps=1000000", f"train.max_minutes={max(minutes, 0.05):.3f}", "model.device=cuda"]


def read_metrics(path: Path) -> list[dict]:
    """The records a run wrote to its metrics.jsonl (what is left when its time ran out mid-run)."""
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def shapes_summary(records: list[dict], name: str, seed: int, images_per_update: int, reward: str) -> dict:
    """A shapes row: updates, images, s/update, held-out strict at guidance 1 (``eval/…``) and the model's default
    3 (``eval_default/…``) before and after, and the training reward's first and last iteration."""
    nan = float("nan")
    evals = [r for r in records if f"eval/{reward}_mean" in r]
    steps = [r for r in records if "reward_mean" in r]
    first, last = (evals[0], evals[-1]) if len(evals) >= 2 else (evals[0] if evals else {}, {})
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
    }
    for tag, prefix in (("g1", "eval"), ("g3", "eval_default")):
        key = f"{prefix}/{reward}_mean"
        row[f"strict_{tag}_before"], row[f"strict_{tag}_after"] = first.get(key, nan), last.get(key, nan)
        row[f"strict_{tag}_change"] = row[f"strict_{tag}_after"] - row[f"strict_{tag}_before"]
    row["reward_first_last"] = f"{fmt(row['reward_first'])} → {fmt(row['reward_last'])}"
    row["eval_images"] = first.get(f"eval/{reward}/n")
    return row


def shapes_row(args: argparse.Namespace, variant: str, extra: list[str], seed: int, minutes: float) -> dict:
    from flowrl.config.schema import TrainConfig
    from flowrl.training.trainer import Trainer

    name = f"shapes_{variant}_seed{seed}"
    cfg = TrainConfig.from_yaml(preset_path(SHAPES_CONFIG), shapes_overrides(args, name, seed, minutes) + extra)
    reward = cfg.eval.rewards[0].label or cfg.eval.rewards[0].name
    status, error = "ok", None
    t0 = time.monotonic()
    try:
        Trainer(cfg).train()
    except OutOfTime as e:  # keep what the run wrote before its time ran out
        status, error = "out_of_time", str(e)
    records = read_metrics(Path(cfg.train.output_dir) / name / "metrics.jsonl")
    row = shapes_summary(records, variant, seed, cfg.prompts.per_step * cfg.rollout.group_size, reward)
    row.update(status=status, error=error, overrides=extra, wall_seconds=time.monotonic() - t0)
    return row


def run_shapes(report: Report, budget: Budget, args: argparse.Namespace) -> None:
    """Main job and distillation alone, seed by seed (each pair first, so a short budget still has both)."""
    seconds = budget.allot("shapes")
    end = time.monotonic() + seconds
    runs = [(variant, extra, seed) for seed in args.seeds for variant, extra in SHAPES_RUNS]
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


# ---- main ---------------------------------------------------------------------------------------
RUNNERS = {"presets": run_presets, "profile": run_profile, "shapes": run_shapes, "snr": run_snr}


def quiet_libraries() -> None:
    import warnings

    import diffusers
    import transformers

    diffusers.utils.logging.set_verbosity_error()
    transformers.logging.set_verbosity_error()
    warnings.filterwarnings("ignore", message=".*should be kept in float32.*")


def budget_weights(parts: list[str]) -> dict[str, float]:
    """The budget's keys and weights of ``parts``: two per preset (shipped, fitted), one per other part."""
    weights = (
        {k: w for p in PRESETS for k, w in zip(p.keys(), (p.weight, p.fitted_weight))} if "presets" in parts else {}
    )
    weights.update({k: v for k, v in PART_WEIGHTS.items() if k in parts})
    return weights


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
        keys = [k for p in PRESETS for k in p.keys()] if part == "presets" else [part]
        report.close_part(part, time.monotonic() - t0, sum(budget.given.get(k, 0.0) for k in keys), error)
    report.data["meta"]["seconds"] = round(budget.elapsed(), 1)
    report.write()
    print(report.markdown(), flush=True)
    statuses = {entry["status"] for entry in report.data["parts"].values()}
    return 0 if statuses <= {"ok"} else 1


if __name__ == "__main__":
    sys.exit(main())
