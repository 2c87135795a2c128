"""Before/after table of eval metrics for one or more run folders.

python scripts/summarize_runs.py runs/shapes-grpo-s0 runs/shapes-grpo-s1 [--key eval/shapes/accuracy]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def evals(run: Path) -> list[dict]:
    lines = [json.loads(l) for l in (run / "metrics.jsonl").read_text().splitlines() if l.strip()]
    return [r for r in lines if any(k.startswith("eval/") for k in r)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("runs", nargs="+", type=Path)
    parser.add_argument("--prefix", default="eval/", help="metric keys to show (prefix)")
    args = parser.parse_args()
    for run in args.runs:
        rows = evals(run)
        if len(rows) < 2:
            print(f"{run}: fewer than two evals")
            continue
        first, last = rows[0], rows[-1]
        train = [json.loads(l) for l in (run / "metrics.jsonl").read_text().splitlines() if '"reward_mean"' in l]
        seconds = sum(r.get("time/rollout", 0) + r.get("time/reward", 0) + r.get("time/update", 0) for r in train)
        print(f"\n{run}  (steps {first['step']} → {last['step']}, {seconds / 60:.1f} min in iterations)")
        for key in sorted(
            k for k in last if k.startswith(args.prefix) and k in first and "/n/" not in k and not k.endswith("/n")
        ):
            print(f"  {key:40s} {first[key]:.3f} → {last[key]:.3f}  ({last[key] - first[key]:+.3f})")


if __name__ == "__main__":
    main()
