"""Core loop benchmark on the tiny SD3 pipeline (issue: seconds/iteration and peak memory).

Settings: 8 prompts × 8 images, 10 steps — (a) no CFG, SDE on all steps; (b) CFG 4.5, all steps;
(c) no CFG, an SDE window of 2. Each setting runs in its own process (peak RSS is per process).

    python scripts/bench_core.py [--iterations 3] [--out docs/benchmarks_core.json]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

SETTINGS = {
    "no_cfg_all_steps": ["model.guidance=1.0", "rollout.window.mode=all"],
    "cfg_4.5_all_steps": ["model.guidance=4.5", "rollout.window.mode=all"],
    "no_cfg_window_2": [
        "model.guidance=1.0",
        "rollout.window.mode=fixed",
        "rollout.window.start=0",
        "rollout.window.size=2",
    ],
}
COMMON = [
    "model.family=sd3",
    "rollout.group_size=8",
    "rollout.steps=10",
    "rollout.max_batch=64",
    "prompts.per_step=8",
    "prompts.train=a red circle|two blue squares|a green cat|a small dog|a big house|a white car|one tree|a black dog",
    "loss.kl_ref=0.04",
    "model.lora.rank=8",
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--iterations", type=int, default=3)
    parser.add_argument("--out", default=None)
    parser.add_argument("--threads", type=int, default=2, help="torch threads of each benchmark process")
    args = parser.parse_args()
    from flowrl.models.testing import tiny_sd3_pipeline

    folder = Path(tempfile.mkdtemp()) / "tiny-sd3"
    tiny_sd3_pipeline().save_pretrained(folder)
    results = {}
    for name, extra in SETTINGS.items():
        overrides = (
            COMMON
            + [
                f"train.num_threads={args.threads}",
                f"model.path={folder}",
                "rewards=[{name: brightness}]",
                f"train.output_dir={folder.parent}",
            ]
            + extra
        )
        cmd = [sys.executable, "-m", "flowrl", "bench", "--iterations", str(args.iterations), *overrides]
        out = subprocess.run(cmd, capture_output=True, text=True)
        if out.returncode != 0:
            raise SystemExit(out.stderr[-3000:])
        results[name] = json.loads(out.stdout[out.stdout.index("{") :])
        print(name, json.dumps({k: round(v, 4) for k, v in results[name].items()}), flush=True)
    base = results["no_cfg_all_steps"]["seconds_per_iteration"]
    print(
        "\n| setting | s/iter | ×(no CFG) | rollout s | reward s | update s | forward s | backward s | overhead | "
        "peak RSS MB |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for name, r in results.items():
        print(
            f"| {name} | {r['seconds_per_iteration']:.3f} | {r['seconds_per_iteration'] / base:.2f} | "
            f"{r['time/rollout']:.3f} | "
            f"{r['time/reward']:.3f} | {r['time/update']:.3f} | {r['forward_seconds']:.3f} | "
            f"{r['backward_seconds']:.3f} | "
            f"{100 * r['overhead_fraction']:.0f}% | {r.get('peak_rss_mb', r.get('peak_memory_mb', 0)):.0f} |"
        )
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
