"""``flowrl bench``: where an iteration's time goes, and its peak memory.

Reports seconds per iteration split into rollout, reward and update, the time spent inside model
forwards (``velocity``) and backwards, and the loop's own overhead = iteration − (forwards +
backwards + decode/reward). Peak memory: CUDA max allocated, or the process's peak RSS on CPU.

``flowrl bench CONFIG --vs OTHER`` (:func:`bench_versus`) runs two configs one after the other in one
process, on the same model (OTHER takes CONFIG's ``model`` section; each run gets a fresh copy of it)
and the same reward (CONFIG's ``rewards`` and ``reward_normalize``), and reports both side by side with
the ratios CONFIG / OTHER. Peak memory is then measured per run: CUDA max allocated since the run
started, or on CPU the largest resident set sampled every 20 ms while it ran (``rss_at_start_mb`` says
how much the process already held: torch's CPU allocator keeps some of the first run's memory).
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import resource
import sys
import threading
import time
from pathlib import Path

import torch

from flowrl.commands.common import OVERRIDES_HELP, Flag, load_config, split_config_arg
from flowrl.config.schema import TrainConfig
from flowrl.errors import ConfigError


class _Timed:
    """Wraps a callable and accumulates its wall time. ``sync``: called before and after each call (CUDA's
    ``synchronize``: a call returns once its kernels are queued, so without it their time would be charged to
    whatever waits for them next, and counted as the loop's overhead)."""

    def __init__(self, fn, sync=None):
        self.fn, self.seconds, self.calls, self.sync = fn, 0.0, 0, sync or (lambda: None)

    def __call__(self, *a, **k):
        self.sync()
        t0 = time.perf_counter()
        try:
            return self.fn(*a, **k)
        finally:
            self.sync()
            self.seconds += time.perf_counter() - t0
            self.calls += 1


TIMED_KEYS = (
    "time/rollout",
    "time/reward",
    "time/update",
    "rollout_forwards",
    "rollout_nfe",
    "trained_edges",
    "trained_leaves",
    "pipeline/update_wait",
    "pipeline/rollout_wait",
    "pipeline/staleness",
)
"""The iteration record's keys :func:`bench_iteration` averages over its timed iterations (those a record has)."""


def bench_iteration(cfg: TrainConfig, iterations: int = 3, warmup: int = 1, model=None, perf=None) -> dict:
    """Mean timings over ``iterations`` train steps after ``warmup`` untimed ones (no eval, no saving). On CUDA the
    timed forwards and backwards synchronise the device around them, so ``overhead_seconds`` is time the GPU was
    not running the model (at the cost of the overlap those waits remove: s/iteration is then an upper bound).
    ``model``: a ready FlowModel (default: built from ``cfg.model``). ``perf``: a
    :class:`~flowrl.training.perf.PerfMeter`: ``perf/tflops`` (and ``perf/mfu``) of the mean iteration too.
    ``model.compile=regional`` adds ``compile``: the blocks compiled, graphs per block kind and compile seconds.

    With ``train.pipeline=async`` the rollouts run in their own process (docs/pipeline.md): the forwards and backwards
    timed are the trainer's, ``time/rollout`` and ``time/reward`` the rollout process's, the ``pipeline/*`` waits are
    means too, and ``overhead_seconds`` is the trainer's time neither in its model calls nor waiting for a forest."""
    from flowrl.training.trainer import Trainer

    cfg.train.progress = False
    cfg.prompts.eval = None
    trainer = Trainer(cfg, model=model)
    backward = None
    sums: dict[str, float] = {}
    try:
        for i in range(warmup):
            trainer.train_step(i)
        sync = torch.cuda.synchronize if trainer.model.device.type == "cuda" else None  # kernels charged to their call
        velocity = _Timed(trainer.model.velocity, sync)
        trainer.model.velocity = velocity
        backward = _Timed(torch.Tensor.backward, sync)
        torch.Tensor.backward = lambda self, *a, **k: backward(self, *a, **k)
        if torch.cuda.is_available():
            torch.cuda.reset_peak_memory_stats()
        t0 = time.perf_counter()
        for i in range(warmup, warmup + iterations):
            rec = trainer.train_step(i)
            for k in TIMED_KEYS:
                if k in rec:  # an objective trains edges (policy) or leaves (forward-process); async: the waits
                    sums[k] = sums.get(k, 0.0) + rec[k]
        t1 = time.perf_counter()  # before the rollout process stops: its last job in flight is no iteration's
    finally:
        if backward is not None:
            torch.Tensor.backward = backward.fn
        if trainer.rollouts is not None:
            trainer.rollouts.close()  # the rollout process of train.pipeline=async (a failed warm-up's too)
    total = (t1 - t0) / iterations
    out = {k: v / iterations for k, v in sums.items()}
    out["seconds_per_iteration"] = total
    out["forward_seconds"] = velocity.seconds / iterations
    out["backward_seconds"] = backward.seconds / iterations
    elsewhere = out["pipeline/update_wait"] if "pipeline/update_wait" in out else out["time/reward"]
    out["overhead_seconds"] = total - out["forward_seconds"] - out["backward_seconds"] - elsewhere
    out["overhead_fraction"] = out["overhead_seconds"] / total
    if perf is not None:
        out.update(perf.metrics(total))
    if trainer.compiled is not None:  # model.compile=regional: the trainer's CompileStats
        stats = trainer.compiled
        out["compile"] = {"blocks": stats.blocks, "graphs": dict(stats.graphs), "seconds": stats.seconds}
    if torch.cuda.is_available():
        out["peak_memory_mb"] = torch.cuda.max_memory_allocated() / 2**20
    else:
        out["peak_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return out


class _PeakRSS:
    """Largest resident set size (MB) of this process while the context is open, sampled every
    ``interval`` seconds from /proc/self/statm (Linux); elsewhere the process's lifetime peak."""

    def __init__(self, interval: float = 0.02):
        self.interval, self.peak_mb = interval, 0.0
        self._stop = threading.Event()
        self._page = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096

    def _now(self) -> float | None:
        try:
            with open("/proc/self/statm") as f:
                return int(f.read().split()[1]) * self._page / 2**20
        except (OSError, ValueError, IndexError):
            return None

    def _run(self) -> None:
        while not self._stop.is_set():
            now = self._now()
            if now is not None:
                self.peak_mb = max(self.peak_mb, now)
            self._stop.wait(self.interval)

    def __enter__(self) -> "_PeakRSS":
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        now = self._now()
        if now is None:
            self.peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        else:
            self.peak_mb = max(self.peak_mb, now)


VERSUS_ROWS = (  # (result key, label) of the side-by-side table
    ("rollout_forwards", "rollout forwards"),
    ("trained_edges", "trained edges"),
    ("trained_leaves", "trained leaves"),
    ("seconds_per_iteration", "s/iter"),
    ("time/rollout", "  rollout s"),
    ("time/reward", "  reward s"),
    ("time/update", "  update s"),
    ("peak_memory_mb", "peak memory MB"),
)


def bench_versus(cfg: TrainConfig, other: TrainConfig, iterations: int = 1, warmup: int = 1) -> dict:
    """Benchmark ``cfg`` and ``other`` in this process on the same model and reward (``other`` takes
    ``cfg``'s ``model``, ``rewards`` and ``reward_normalize``). Returns ``{"config": {...}, "vs": {...},
    "ratio": {key: config / vs}}``; each run reports ``peak_memory_mb`` (CUDA allocated, or peak RSS on CPU)."""
    from flowrl.config import build

    other = copy.deepcopy(other)
    other.model = copy.deepcopy(cfg.model)
    other.rewards = copy.deepcopy(cfg.rewards)
    other.reward_normalize = cfg.reward_normalize
    results = {}
    for name, c in (("config", cfg), ("vs", other)):
        # an asynchronous run builds its model (and its rollout process's) from the config itself
        model = None
        if c.train.pipeline != "async":
            model = build.build_model(c.model, build.resolve_device(c.model.device))
        if torch.cuda.is_available():
            torch.cuda.reset_peak_memory_stats()
        with _PeakRSS() as rss:
            start = rss._now()
            out = bench_iteration(c, iterations=iterations, warmup=warmup, model=model)
        if not torch.cuda.is_available():  # CUDA: bench_iteration's max allocated of this run
            out["peak_memory_mb"] = rss.peak_mb
            out["rss_at_start_mb"] = start if start is not None else float("nan")
            out.pop("peak_rss_mb", None)
        results[name] = out
        del model
    ratio = {
        k: results["config"][k] / results["vs"][k]
        for k in results["config"]
        if k in results["vs"] and isinstance(results["vs"][k], (int, float)) and results["vs"][k]
    }
    return {**results, "ratio": ratio}


def versus_table(result: dict, names: tuple[str, str] = ("CONFIG", "OTHER")) -> str:
    """The side-by-side table of :func:`bench_versus` (markdown)."""
    a, b = names
    lines = [f"| | {a} | {b} | {a} / {b} |", "|---|---|---|---|"]
    for key, label in VERSUS_ROWS:
        if key not in result["config"] or key not in result["vs"]:
            continue
        x, y = result["config"][key], result["vs"][key]
        fmt = (
            (lambda v: f"{v:.0f}")
            if key in ("rollout_forwards", "trained_edges", "trained_leaves", "peak_memory_mb")
            else (lambda v: f"{v:.3f}")
        )
        r = result["ratio"].get(key)
        lines.append(f"| {label} | {fmt(x)} | {fmt(y)} | {'' if r is None else f'{r:.2f}'} |")
    return "\n".join(lines)


# ---- the command ----------------------------------------------------------------------------------
FLAGS: list[Flag] = [
    ("--iterations", 1, None, "timed iterations"),
    ("--warmup", 0, None, "untimed iterations first"),
    ("--processes", 1, None, "processes sharing prompts.per_step"),
]


def add_parser(sub, epilog: str) -> None:
    """``flowrl bench`` under ``flowrl``'s sub-parsers."""
    fmt = argparse.RawDescriptionHelpFormatter
    p = sub.add_parser(
        "bench",
        help="time iterations: rollout, reward, update, model-forward overhead, peak memory",
        epilog=epilog,
        formatter_class=fmt,
    )
    p.add_argument("config", nargs="?", help="YAML config file (default: configs/shapes/nft.yaml)")
    p.add_argument("--iterations", type=int, default=3)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument(
        "--vs",
        metavar="OTHER",
        help="a second config to run in the same process on CONFIG's model and "
        "reward; prints both side by side with the ratios CONFIG / OTHER",
    )
    p.add_argument(
        "--vs-set",
        action="append",
        metavar="KEY=VALUE",
        help="an override of OTHER's config (repeat for several); positional overrides apply to CONFIG",
    )
    p.add_argument(
        "--estimate",
        action="store_true",
        help="predict peak GPU memory and s/iteration without running anything (meta device; docs/estimate.md)",
    )
    p.add_argument("--gpu", default="H100", help="GPU class of --estimate: H100, H200, A100, L40S, 4090 (default H100)")
    p.add_argument(
        "--json",
        action="store_true",
        help="--estimate: print one JSON object only (peak_gib, "
        "seconds_per_iteration, flops_per_iteration, settings, fit)",
    )
    p.add_argument(
        "--processes",
        "--gpus",
        dest="processes",
        type=int,
        default=1,
        help="--estimate: processes (GPUs) sharing prompts.per_step",
    )
    p.add_argument(
        "--shard",
        choices=("ddp", "fsdp"),
        default=None,
        help="--estimate: ddp (a whole copy per GPU) or fsdp (FSDP2, split over --gpus); default: model.shard",
    )
    p.add_argument("overrides", nargs="*", help=OVERRIDES_HELP)
    p.set_defaults(func=run, flags=FLAGS)


# ---- bench ------------------------------------------------------------------------------------
def fitted_and_metered(cfg: TrainConfig, overrides: list[str]):
    """``cfg`` with ``train.fit: auto``'s settings for the device at hand (the ``key=value`` overrides win) and the
    :class:`~flowrl.training.perf.PerfMeter` of its iterations, as ``flowrl train`` makes them; what fit chose is said
    on stderr, so the benchmark's stdout is its JSON alone."""
    from flowrl.estimate.device import fit_for_run, perf_meter

    flops = None
    if cfg.train.fit == "auto":
        fit = fit_for_run(cfg, overrides)
        print("\n".join(fit.summary()), file=sys.stderr, flush=True)
        cfg, flops = fit.config, fit.flops_per_iteration
    return cfg, perf_meter(cfg, flops)


def run(args: argparse.Namespace) -> int:
    config, overrides = split_config_arg(args.config, args.overrides)
    if args.estimate:  # before loading: a preset's GPU-only explorer is checked against --gpu, not this machine
        if args.vs is not None:
            raise ConfigError("--estimate predicts one config; drop --vs")
        from flowrl.estimate import run_estimate

        return run_estimate(
            config, overrides, gpu=args.gpu, processes=args.processes, shard=args.shard, as_json=args.json
        )
    if args.json:
        raise ConfigError("--json goes with --estimate (flowrl bench prints its JSON anyway)")
    cfg = load_config(config, overrides)
    if args.vs is None:
        if args.vs_set:
            raise ConfigError("--vs-set needs --vs OTHER")
        cfg, perf = fitted_and_metered(cfg, overrides)  # train.fit=auto for this device; perf/tflops, perf/mfu
        result = bench_iteration(cfg, iterations=args.iterations, warmup=args.warmup, perf=perf)
        print(json.dumps(result, indent=2))  # stdout holds the JSON alone: what fit chose went to stderr
        return 0
    other = load_config(args.vs, args.vs_set or [])
    result = bench_versus(cfg, other, iterations=args.iterations, warmup=args.warmup)
    print(versus_table(result, (Path(config).stem if config else "default", Path(args.vs).stem)))
    print(json.dumps(result, indent=2))
    return 0
