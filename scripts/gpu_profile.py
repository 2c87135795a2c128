"""The GPU check's ``profile`` part (issue 52): one training iteration under ``torch.profiler``, its Chrome trace
read back into three tables — the top ops by self CUDA time (self CPU time on a CPU), the idle gaps between
consecutive device ops, and the synchronisations with their Python call sites.

Everything is read from the Chrome trace (``prof.export_chrome_trace``), so a test can call these functions on a
trace made on the CPU: ``load_events`` → ``summarize`` → ``markdown``. What the trace's events mean here:

- ``cpu_op`` (an aten op), ``python_function`` (a Python frame, ``with_stack=True``), ``cuda_runtime`` (a CUDA API
  call, e.g. ``cudaLaunchKernel``, ``cudaStreamSynchronize``) and ``user_annotation`` (``record_function``) are
  host events, nested per thread by time;
- ``kernel``, ``gpu_memcpy`` and ``gpu_memset`` are device events; ``args["External id"]`` names the ``cpu_op``
  that launched one (that op's self CUDA time is the sum of its device events);
- the iteration is the ``user_annotation`` :data:`ITERATION` around it.

With no device events (a CPU), the "device ops" of the gap table are the top-level aten ops of the iteration's
thread, and a gap is host time spent outside any aten op (Python, the framework).
"""

from __future__ import annotations

import contextlib
import gzip
import json
import os
import traceback
import warnings
from collections import Counter, defaultdict
from pathlib import Path

ITERATION = "gpu_check_iteration"
"""``record_function`` name around the profiled iteration."""
DEVICE_CATS = ("kernel", "gpu_memcpy", "gpu_memset")
HOST_CATS = ("cpu_op", "python_function", "cuda_runtime", "user_annotation")
SYNC_HOST = (
    "cudaStreamSynchronize",
    "cudaDeviceSynchronize",
    "cudaEventSynchronize",
    "cudaMemcpy",
    "aten::item",
    "aten::_local_scalar_dense",
)
"""Host events that wait for the device (``cudaMemcpy``: the synchronous copy; ``aten::item`` and
``aten::_local_scalar_dense``: a tensor read back as a Python number)."""
D2H = "Memcpy DtoH"
"""Prefix of a device-to-host copy's device event (the host waits for it unless it is non-blocking to pinned memory)."""
LIBRARIES = (
    "torch/",
    "diffusers/",
    "transformers/",
    "peft/",
    "accelerate/",
    "<built-in",
    "threading.py",
    "contextlib.py",
    "functools.py",
    "nn.Module:",
    "scripts/gpu_profile.py",
)
"""Python frames skipped when naming a call site (the innermost frame of the project's own code is named)."""
TRACE_LIMIT_BYTES = 15 * 2**20
"""Largest gzipped trace written beside gpu_check.md (the device tool brings back files of at most 16 MiB)."""


# ---- profiling ----------------------------------------------------------------------------------------------------
def profile_step(
    step,
    trace_path: str | Path,
    scratch: str | Path,
    *,
    cuda: bool,
    with_stack: bool,
    limit_bytes: int = TRACE_LIMIT_BYTES,
) -> dict:
    """Run ``step()`` once under ``torch.profiler`` (CPU, and CUDA when ``cuda``; no shapes; stacks when
    ``with_stack``) inside a ``record_function(ITERATION)``, export its Chrome trace to the folder ``scratch``,
    summarise it and write it gzipped to ``trace_path`` (trimmed to ``limit_bytes``: :func:`write_trace`). Returns
    the summary with the trace's file name, size and trimming."""
    import torch
    from torch.profiler import ProfilerActivity, profile, record_function

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    trace_path = Path(trace_path)
    Path(scratch).mkdir(parents=True, exist_ok=True)
    raw = Path(scratch) / "profile_trace.json"  # hundreds of MB on a GPU: never beside the results
    with profile(activities=activities, record_shapes=False, with_stack=with_stack) as prof:
        with record_function(ITERATION):
            step()
        if cuda:
            torch.cuda.synchronize()
    prof.export_chrome_trace(str(raw))
    try:
        with open(raw) as f:
            trace = json.load(f)
        raw_bytes = raw.stat().st_size
    finally:
        raw.unlink(missing_ok=True)
    summary = summarize(trace["traceEvents"])
    summary.update(with_stack=with_stack, trace_raw_mb=raw_bytes / 2**20, **write_trace(trace, trace_path, limit_bytes))
    return summary


MATMUL_WORDS = ("mm", "matmul", "linear", "gemm", "scaled", "f8", "e4m3", "fp8", "int8", "quantized")
"""Op and kernel names kept by :func:`matmul_ops` (lower case substrings): the matrix products and what quantizes
for them."""
LOW_PRECISION_PATHS = (  # (name substring, the path it names), first match wins
    ("_scaled_mm", "torch._scaled_mm (FP8 tensor-core GEMM)"),
    ("f8f8", "MSLK/FBGEMM f8f8bf16 rowwise (FP8 tensor-core GEMM)"),
    ("mslk::", "MSLK (FP8 tensor-core GEMM)"),
    ("fbgemm::", "FBGEMM (FP8 tensor-core GEMM)"),
    ("quantized::linear", "torch.ao dynamic int8 (quantized::linear_dynamic)"),
    ("bitsandbytes", "bitsandbytes int8/4-bit matmul"),
    ("int8", "int8 GEMM"),
)


def matmul_ops(call, *, cuda: bool) -> dict:
    """Run ``call()`` once under ``torch.profiler`` (CPU, and CUDA when ``cuda``) and count its matrix-product ops
    and kernels (names containing a word of :data:`MATMUL_WORDS`): ``{"ops": {aten/custom op: calls}, "kernels":
    {CUDA kernel: calls}}``, most called first. What tells which path a quantized layer took
    (:func:`low_precision_path`)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities, record_shapes=False) as prof:
        call()
        if cuda:
            torch.cuda.synchronize()
    ops: Counter = Counter()
    kernels: Counter = Counter()
    for event in prof.events():
        name = event.name
        if not any(word in name.lower() for word in MATMUL_WORDS):
            continue
        on_device = str(getattr(event, "device_type", "")).endswith("CUDA")
        (kernels if on_device else ops)[name] += 1
    return {"ops": dict(ops.most_common()), "kernels": dict(kernels.most_common())}


def low_precision_path(counts: dict, backend: str, quantized_layers: int) -> str:
    """One line naming the matrix-product path that ran (:func:`matmul_ops`'s ``counts``) for an explorer of
    ``backend`` with ``quantized_layers`` converted layers: the low-precision op found (and its calls; on CUDA the
    most called kernel of that op), or what ran instead."""
    names = list(counts.get("ops", {})) + list(counts.get("kernels", {}))
    for needle, path in LOW_PRECISION_PATHS:
        found = [n for n in names if needle in n.lower()]
        if found:
            calls = sum(counts.get("ops", {}).get(n, 0) + counts.get("kernels", {}).get(n, 0) for n in found)
            fp8_kernels = [k for k in counts.get("kernels", {}) if any(w in k.lower() for w in ("e4m3", "f8", "fp8"))]
            kernel = f"; kernel {short_kernel(fp8_kernels[0])}" if fp8_kernels else ""
            return f"{path}: {found[0]} ×{calls}{kernel}"
    top = next(iter(counts.get("ops", {})), None)
    if quantized_layers and backend not in ("same", "bf16", "fp16"):
        return f"no low-precision matmul ran: {quantized_layers} {backend} layers, products as {top or 'nothing'}"
    return f"{backend} matmuls ({top or 'none recorded'})"


@contextlib.contextmanager
def sync_sites(cuda: bool):
    """Count the Python call sites of every synchronising CUDA call made inside (``torch.cuda.set_sync_debug_mode``
    warns at each; its warning's Python stack names the site; cheap: no profiler). Yields a Counter of
    ``site`` → calls, empty on a CPU (no CUDA: nothing synchronises)."""
    sites: Counter = Counter()
    if not cuda:
        yield sites
        return
    import torch

    previous = torch.cuda.get_sync_debug_mode()
    with warnings.catch_warnings():
        shown = warnings.showwarning

        def record(message, category, filename, lineno, file=None, line=None):
            if "synchronizing CUDA operation" in str(message):
                sites[site_of_stack(traceback.extract_stack()[:-1])] += 1
            else:
                shown(message, category, filename, lineno, file, line)

        warnings.showwarning = record
        warnings.filterwarnings("always", message=".*synchronizing CUDA operation.*")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            yield sites
        finally:
            torch.cuda.set_sync_debug_mode(previous)


def site_of_stack(frames) -> str:
    """``path(line): function`` of the innermost frame outside the libraries (:data:`LIBRARIES`) and this module."""
    for frame in reversed(frames):
        name = f"{short_path(frame.filename)}({frame.lineno}): {frame.name}"
        if not is_library(name) and "warnings.py" not in name:
            return name
    return "unknown"


def short_path(filename: str) -> str:
    """``flowrl/…``, ``torch/…``: a file's path from its package (site-packages or the checkout) down."""
    parts = Path(filename).parts
    for anchor in ("site-packages", "dist-packages"):
        if anchor in parts:
            return "/".join(parts[parts.index(anchor) + 1 :])
    for package in ("flowrl", "scripts", "rewards", "flowrl_rewards"):
        if package in parts:
            return "/".join(parts[len(parts) - 1 - parts[::-1].index(package) :])
    return os.path.basename(filename)


def is_library(frame_name: str) -> bool:
    return any(frame_name.startswith(prefix) or f"/{prefix}" in frame_name for prefix in LIBRARIES)


# ---- reading a trace ------------------------------------------------------------------------------------------------
def load_events(path: str | Path) -> list[dict]:
    """The ``traceEvents`` of a Chrome trace file (``.json`` or ``.json.gz``)."""
    opener = gzip.open if str(path).endswith(".gz") else open
    with opener(path, "rt") as f:
        return json.load(f)["traceEvents"]


def complete(events: list[dict], cats) -> list[dict]:
    """The complete (``ph: X``) events of the categories ``cats``."""
    return [e for e in events if e.get("ph") == "X" and e.get("cat") in cats]


def nest(events: list[dict]) -> dict[int, dict | None]:
    """Each host event's enclosing host event on its thread (``id(event)`` → parent or None), by time."""
    parents: dict[int, dict | None] = {}
    threads: dict[tuple, list[dict]] = defaultdict(list)
    for e in events:
        threads[(e.get("pid"), e.get("tid"))].append(e)
    for items in threads.values():
        items.sort(key=lambda e: (e["ts"], -e.get("dur", 0)))
        stack: list[dict] = []
        for e in items:
            while stack and stack[-1]["ts"] + stack[-1].get("dur", 0) <= e["ts"] + 1e-3:
                stack.pop()
            parents[id(e)] = stack[-1] if stack else None
            stack.append(e)
    return parents


def iteration_window(events: list[dict]) -> tuple[float, float, object]:
    """(start, end, thread) of the :data:`ITERATION` annotation in µs (the whole trace's host span when absent)."""
    marks = [e for e in complete(events, ("user_annotation",)) if e["name"] == ITERATION]
    if marks:
        m = max(marks, key=lambda e: e["dur"])
        return m["ts"], m["ts"] + m["dur"], (m.get("pid"), m.get("tid"))
    host = complete(events, HOST_CATS)
    start = min(e["ts"] for e in host)
    return start, max(e["ts"] + e["dur"] for e in host), None


def summarize(events: list[dict], top: int = 15, largest: int = 10) -> dict:
    """The profile part's tables from a trace's events: ``top_ops``, ``gaps`` (with ``largest`` of them) and
    ``syncs``; ``iteration_seconds`` and the device's busy time within the iteration."""
    start, end, thread = iteration_window(events)
    inside = [e for e in events if e.get("ph") == "X" and start <= e.get("ts", -1) <= end]
    host = complete(inside, HOST_CATS)
    device = complete(inside, DEVICE_CATS)
    parents = nest(host)
    ops = [e for e in host if e["cat"] == "cpu_op"]
    by_id = {e["args"]["External id"]: e for e in ops if "External id" in e.get("args", {})}
    return {
        "iteration_seconds": (end - start) / 1e6,
        "device_events": len(device),
        "host_events": len(host),
        "cpu_ops": len(ops),
        "source": "device" if device else "host",
        "top_ops": top_ops(ops, device, by_id, parents, top),
        "gaps": gaps(device, ops, parents, thread, by_id, start, end, largest),
        "syncs": syncs(host, device, by_id, parents),
    }


def self_times(ops: list[dict], parents: dict) -> dict[int, float]:
    """Each aten op's self host time in µs: its duration less that of the aten ops nested directly in it (through
    any Python frames or annotations between)."""
    own = {id(e): float(e["dur"]) for e in ops}
    for e in ops:
        p = parents.get(id(e))
        while p is not None and p.get("cat") != "cpu_op":
            p = parents.get(id(p))
        if p is not None:
            own[id(p)] -= e["dur"]
    return own


def top_ops(ops: list[dict], device: list[dict], by_id: dict, parents: dict, n: int) -> list[dict]:
    """The ``n`` aten ops with the most self CUDA time (the device events they launched themselves), or self CPU
    time when the trace has no device events: calls, self CUDA ms, its share of the device's busy time, self CPU ms."""
    own = self_times(ops, parents)
    rows: dict[str, dict] = {}
    for e in ops:
        r = rows.setdefault(e["name"], {"op": e["name"], "calls": 0, "self_cuda_ms": 0.0, "self_cpu_ms": 0.0})
        r["calls"] += 1
        r["self_cpu_ms"] += own[id(e)] / 1e3
    busy = sum(d["dur"] for d in device) / 1e3
    for d in device:
        op = by_id.get(d.get("args", {}).get("External id"))
        name = op["name"] if op else short_kernel(d["name"])
        r = rows.setdefault(name, {"op": name, "calls": 0, "self_cuda_ms": 0.0, "self_cpu_ms": 0.0})
        r["self_cuda_ms"] += d["dur"] / 1e3
    key = "self_cuda_ms" if device else "self_cpu_ms"
    out = sorted((r for r in rows.values() if r[key] > 0 or not device), key=lambda r: -r[key])[:n]
    for r in out:
        r["cuda_share"] = r["self_cuda_ms"] / busy if device and busy else None
        if not device:
            r["self_cuda_ms"] = None
    return out


def short_kernel(name: str, width: int = 60) -> str:
    """A kernel's name cut to ``width`` characters (templated CUDA names run to hundreds)."""
    return name if len(name) <= width else name[: width - 1] + "…"


def busy_intervals(device: list[dict], ops: list[dict], parents: dict, thread) -> tuple[list[dict], str]:
    """What the gaps are measured between: the device events (every stream merged), or with none, the top-level aten
    ops of the iteration's thread; and which of the two."""
    if device:
        return sorted(device, key=lambda e: e["ts"]), "device"
    top = [
        e
        for e in ops
        if (thread is None or (e.get("pid"), e.get("tid")) == thread) and not _has_cpu_op_parent(e, parents)
    ]
    return sorted(top, key=lambda e: e["ts"]), "host"


def _has_cpu_op_parent(e: dict, parents: dict) -> bool:
    p = parents.get(id(e))
    while p is not None:
        if p.get("cat") == "cpu_op":
            return True
        p = parents.get(id(p))
    return False


def gaps(
    device: list[dict], ops: list[dict], parents: dict, thread, by_id: dict, start: float, end: float, largest: int
) -> dict:
    """Idle time between consecutive busy intervals within the iteration: total seconds, its share of the
    iteration, how many gaps, and the ``largest`` ones, each with the op before it (``before``: the last to end) and
    the one that ended it (``after``)."""
    items, source = busy_intervals(device, ops, parents, thread)
    found, busy_end, last = [], None, None
    for e in items:
        if busy_end is not None and e["ts"] > busy_end:
            found.append(
                {
                    "ms": (e["ts"] - busy_end) / 1e3,
                    "at_ms": (busy_end - start) / 1e3,
                    "before": label(last, by_id),
                    "after": label(e, by_id),
                }
            )
        if busy_end is None or e["ts"] + e["dur"] >= busy_end:
            busy_end, last = e["ts"] + e["dur"], e
    idle = sum(g["ms"] for g in found) / 1e3
    span = max(end - start, 1e-9) / 1e6
    return {
        "source": source,
        "intervals": len(items),
        "count": len(found),
        "idle_seconds": idle,
        "idle_fraction": idle / span,
        "busy_seconds": sum(e["dur"] for e in items) / 1e6,
        "largest": sorted(found, key=lambda g: -g["ms"])[:largest],
    }


def label(event: dict | None, by_id: dict) -> str:
    """A busy interval's name: an aten op's, or a device event's launching op and its (shortened) kernel."""
    if event is None:
        return "—"
    if event.get("cat") == "cpu_op":
        return event["name"]
    op = by_id.get(event.get("args", {}).get("External id"))
    return f"{op['name']} → {short_kernel(event['name'], 40)}" if op else short_kernel(event["name"])


def syncs(host: list[dict], device: list[dict], by_id: dict, parents: dict, sites: int = 3) -> list[dict]:
    """The synchronisations by name (:data:`SYNC_HOST`, and device-to-host copies): count, total ms, and the
    ``sites`` most frequent Python call sites from the trace's stacks (``with_stack=True``; else none)."""
    found: dict[str, list[dict]] = defaultdict(list)
    for e in host:
        if e["name"] in SYNC_HOST:
            found[e["name"]].append(e)
    for d in device:
        if d["name"].startswith(D2H):
            found[D2H].append(d)
    rows = []
    for name in [*SYNC_HOST, D2H]:
        events = found.get(name, [])
        if not events:
            continue
        counted = Counter(
            call_site(by_id.get(e.get("args", {}).get("External id")) if e["cat"] in DEVICE_CATS else e, parents)
            for e in events
        )
        counted.pop(None, None)
        rows.append(
            {
                "name": name,
                "count": len(events),
                "ms": sum(e["dur"] for e in events) / 1e3,
                "sites": [f"{s} ×{n}" for s, n in counted.most_common(sites)],
            }
        )
    return rows


def call_site(event: dict | None, parents: dict) -> str | None:
    """The innermost enclosing Python frame of ``event`` outside the libraries (None: the trace has no stacks)."""
    p = parents.get(id(event)) if event is not None else None
    innermost = None
    while p is not None:
        if p.get("cat") == "python_function":
            innermost = innermost or p["name"]
            if not is_library(p["name"]):
                return p["name"]
        p = parents.get(id(p))
    return innermost


# ---- writing the trace ----------------------------------------------------------------------------------------------
def write_trace(trace: dict, path: str | Path, limit_bytes: int = TRACE_LIMIT_BYTES) -> dict:
    """The trace gzipped to ``path`` in at most ``limit_bytes``: whole if it fits; else without the Python frames;
    else also without nested aten ops, kernel launches and flow arrows; else its first part only. Returns the file's
    name, MB and what was left out (``trace_trimmed``: None when whole)."""
    events = trace["traceEvents"]
    steps = [(None, events), ("Python frames left out", [e for e in events if e.get("cat") != "python_function"])]
    parents = nest(complete(steps[-1][1], HOST_CATS))
    steps.append(
        (
            "Python frames, nested aten ops, non-synchronising CUDA calls and flow arrows left out",
            [e for e in steps[-1][1] if keep_lean(e, parents)],
        )
    )
    data, per_event = b"", 0.0
    for note, kept in steps:
        if per_event * len(kept) > 1.5 * limit_bytes and (note, kept) != steps[-1]:
            continue  # clearly too large at the last attempt's bytes per event: not compressed at all
        data = gzip.compress(json.dumps({**trace, "traceEvents": kept}, separators=(",", ":")).encode(), 3)
        per_event = len(data) / max(len(kept), 1)
        if len(data) <= limit_bytes:
            break
    else:
        timed = sorted((e for e in kept if "ts" in e), key=lambda e: e["ts"])
        share = max(0.0, 0.9 * limit_bytes / len(data))
        cut = timed[int(share * len(timed)) - 1]["ts"] if share * len(timed) >= 1 else float("-inf")
        kept = [e for e in kept if e.get("ts", cut) <= cut]
        note += f"; only its first {100 * share:.0f} % of events (to {(cut - timed[0]['ts']) / 1e6:.2f} s)"
        data = gzip.compress(json.dumps({**trace, "traceEvents": kept}, separators=(",", ":")).encode(), 3)
    Path(path).write_bytes(data)
    return {"trace_file": Path(path).name, "trace_mb": len(data) / 2**20, "trace_trimmed": note}


def keep_lean(event: dict, parents: dict) -> bool:
    """Whether the leanest full-length trace keeps ``event``: device events, annotations, top-level aten ops and
    synchronising calls (no flow arrows, kernel launches, or aten ops nested in others)."""
    if event.get("ph") in ("s", "f"):
        return False
    cat = event.get("cat")
    if cat == "cpu_op":
        return event["name"] in SYNC_HOST or not _has_cpu_op_parent(event, parents)
    if cat == "cuda_runtime":
        return event["name"] in SYNC_HOST or event["name"].startswith("cudaMemcpy")
    return True


# ---- the Markdown
# -----------------------------------------------------------------------------------------------------
def markdown(
    summary: dict, sites: dict[str, int] | None = None, fmt=lambda v: "—" if v is None else str(v)
) -> list[str]:
    """The profile's tables (top ops, gaps, synchronisations, and the synchronising call sites of the warm-up)."""
    g = summary["gaps"]
    cuda = summary["source"] == "device"
    what = "self CUDA time" if cuda else "self CPU time (no device events: a CPU)"
    lines = [
        f"**Top {len(summary['top_ops'])} ops by {what}**, one iteration ({fmt(summary['iteration_seconds'])} s):",
        "",
        "| op | calls | self CUDA ms | of busy device time | self CPU ms |",
        "|---|---|---|---|---|",
    ]
    lines += [
        f"| `{r['op']}` | {fmt(r['calls'])} | {fmt(r['self_cuda_ms'])} | {fmt(r['cuda_share'])} | "
        f"{fmt(r['self_cpu_ms'])} |"
        for r in summary["top_ops"]
    ]
    between = (
        "kernels and copies (all streams)"
        if g["source"] == "device"
        else "top-level aten ops of the iteration's thread"
    )
    lines += [
        "",
        f"**Gaps between {between}**: {fmt(g['count'])} gaps, {fmt(g['idle_seconds'])} s idle = "
        f"{fmt(g['idle_fraction'])} of the iteration ({fmt(g['busy_seconds'])} s busy); the largest:",
        "",
        "| gap ms | at ms | preceding op | next op |",
        "|---|---|---|---|",
    ]
    lines += [f"| {fmt(r['ms'])} | {fmt(r['at_ms'])} | `{r['before']}` | `{r['after']}` |" for r in g["largest"]]
    lines += [
        "",
        "**Synchronisations** (call sites from the trace's Python stacks"
        + ("" if summary.get("with_stack") else ": none, profiled without stacks")
        + "):",
        "",
        "| call | count | ms | call sites |",
        "|---|---|---|---|",
    ]
    lines += [
        f"| `{r['name']}` | {fmt(r['count'])} | {fmt(r['ms'])} | {'<br>'.join(r['sites']) or '—'} |"
        for r in summary["syncs"]
    ] or ["| none | 0 | — | — |"]
    if sites is not None:
        lines += ["", "**Synchronising call sites of the warm-up iteration** (`torch.cuda.set_sync_debug_mode`):", ""]
        lines += (
            ["| call site | calls |", "|---|---|"]
            + [f"| `{s}` | {fmt(n)} |" for s, n in sorted(sites.items(), key=lambda kv: -kv[1])[:15]]
            if sites
            else ["none recorded" + ("" if cuda else " (no CUDA: nothing synchronises on a CPU)")]
        )
    lines += [
        "",
        f"Trace: `{summary.get('trace_file', '—')}` ({fmt(summary.get('trace_mb'))} MB gzipped"
        + (f"; {summary['trace_trimmed']}" if summary.get("trace_trimmed") else "")
        + ").",
    ]
    return lines
