"""Write the shapes world's prompt files from :func:`flowrl.shapes.prompt_sets.prompt_sets`.

    python scripts/make_shapes_prompts.py                 # configs/shapes/prompts/{train,eval}.txt, seed 0
    python scripts/make_shapes_prompts.py --check         # exit 1 if the files differ from prompt_sets(0)

Deterministic: the same seed always writes the same bytes.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from flowrl.shapes.prompt_sets import held_out_pairs, prompt_sets  # noqa: E402

DEFAULT_OUT = ROOT / "configs" / "shapes" / "prompts"


def render_files(seed: int) -> dict[str, str]:
    """File name → text (one prompt per line, trailing newline)."""
    train, eval_ = prompt_sets(seed)
    return {"train.txt": "\n".join(train) + "\n", "eval.txt": "\n".join(eval_) + "\n"}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seed", type=int, default=0, help="prompt_sets seed (default 0)")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help=f"output folder (default {DEFAULT_OUT})")
    parser.add_argument("--check", action="store_true", help="compare instead of writing; exit 1 on a difference")
    args = parser.parse_args(argv)

    files = render_files(args.seed)
    if args.check:
        stale = [n for n, text in files.items() if not (args.out / n).is_file() or (args.out / n).read_text() != text]
        if stale:
            print(f"out of date in {args.out}: {', '.join(stale)} (run scripts/make_shapes_prompts.py)")
            return 1
        print(f"{args.out}: up to date")
        return 0
    args.out.mkdir(parents=True, exist_ok=True)
    for name, text in files.items():
        (args.out / name).write_text(text)
        lines = text.splitlines()
        print(f"wrote {args.out / name}: {len(lines)} lines, {len(set(lines))} distinct")
    print(f"held-out (shape, colour) pairs: {held_out_pairs(args.seed)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
