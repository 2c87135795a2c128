"""``flowrl eval --benchmark NAME``: the field's benchmarks by their own protocols, on a run's weights or a base model.

- ``geneval`` (GenEval, Ghosh et al. 2023): its 553 prompts (``dataset/geneval/test_metadata.jsonl`` from ``flowrl
  data fetch geneval``) × 4 images, each scored by GenEval's rules (:mod:`flowrl_rewards.compositional.geneval`,
  strict); printed as
  GenEval's ``summary_scores.py`` prints it: correct images and prompts, the six task rows, the overall score (the
  mean of the task scores). With ``--out`` the images are written in GenEval's folder layout
  (``<out>/<00000>/metadata.jsonl``, ``samples/0000.png`` …), so GenEval's own ``evaluate_images.py`` can score them
  too (prompts from a text file get whole records, parsed from GenEval's templates: :func:`geneval_records`), with
  ``results.jsonl`` (one line per image: prompt, tag, correct, partial score, reasons) and ``summary.json``.
- ``ocr`` (Flow-GRPO's OCR test set, ``dataset/ocr/test.txt`` from ``flowrl data fetch ocr``): one image per prompt,
  scored by the ``ocr`` reward; the mean score and the share read exactly.
- ``vqascore`` (any prompt file, ``--prompts``, scored by a VLM as GenEval 2 scores its prompts): each image's
  VQAScore, P("Yes") to VQAScore's question (the ``vlm_judge`` reward with ``score: vqascore`` and VQAScore's
  question, whatever the config's term asks); the mean over the images (an image without a score, NaN, is left out
  and counted), and the mean over prompts of each prompt's mean.

The reward's settings (detector, colour model, OCR engine…) come from the config's term of the same name (in
``eval.rewards``, else ``rewards``), so a config that trains with it benchmarks with it; its training ``score`` is
replaced by the benchmark's. Images come from the config's eval settings (``eval.steps``, the guidance as
``flowrl eval`` picks it, ``eval.seed``; ``rollout.max_batch`` images per forward); under ``accelerate launch`` each
process draws every ``world``-th prompt and the scores are reduced over processes.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import torch
from tqdm.auto import tqdm

from flowrl.errors import ConfigError


@dataclass(frozen=True)
class Benchmark:
    """A benchmark: its default prompt file, images per prompt, reward (name and the kwargs that fix it to the
    benchmark's score) and how its per-image results are summarised."""

    name: str
    prompts: str
    images_per_prompt: int
    reward: str
    fixed: dict[str, Any] = field(default_factory=dict)
    source: str = ""


BENCHMARKS: dict[str, Benchmark] = {
    b.name: b
    for b in (
        Benchmark(
            "geneval",
            "dataset/geneval/test_metadata.jsonl",
            4,
            "geneval",
            {"score": "strict"},
            "flowrl data fetch geneval",
        ),
        Benchmark("ocr", "dataset/ocr/test.txt", 1, "ocr", {}, "flowrl data fetch ocr"),
        Benchmark(
            "vqascore",
            "",  # no prompt set of its own: --prompts names one
            1,
            "vlm_judge",
            {"score": "vqascore", "template": "vqascore", "question": None, "system": None},
            "a prompt file named with --prompts",
        ),
    )
}


def get_benchmark(name: str) -> Benchmark:
    if name not in BENCHMARKS:
        raise ConfigError(f"--benchmark {name!r} is not a benchmark; accepted: {', '.join(BENCHMARKS)}")
    return BENCHMARKS[name]


def read_benchmark_prompts(path: str) -> tuple[list[str], list[dict] | None]:
    """(prompts, GenEval metadata records or None) of a prompt file: a ``.jsonl`` of records with a ``prompt`` (a
    GenEval metadata file) or a text file of prompts (:func:`flowrl.prompts.source.read_prompts`)."""
    from flowrl.paths import find_file, where_tried
    from flowrl.prompts.source import read_prompts

    if not str(path).endswith(".jsonl"):
        return read_prompts(str(path), "--prompts"), None
    file = find_file(path)
    if file is None:
        raise ConfigError(f"--prompts {str(path)!r} does not exist (looked in {where_tried(path)})")
    try:
        text = file.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError(f"--prompts {str(path)!r}: not a UTF-8 text file ({e.reason} at byte {e.start})") from None
    records = []
    for number, line in enumerate(text.splitlines(), 1):
        if line.strip():
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError as e:
                raise ConfigError(f"--prompts {str(path)!r}, line {number}: not JSON ({e})") from None
            if not isinstance(records[-1], dict) or not isinstance(records[-1].get("prompt"), str):
                raise ConfigError(f"--prompts {str(path)!r}, line {number}: expected an object with a 'prompt' string")
    return [r["prompt"] for r in records], records


def benchmark_reward(cfg, bench: Benchmark, metadata: str | None):
    """The benchmark's reward: the config's term named ``bench.reward`` (eval.rewards first), its kwargs with the
    benchmark's fixed ones (and ``metadata`` for GenEval), else the reward's defaults."""
    from flowrl.config.build import build_rewards
    from flowrl.config.schema import RewardTerm

    terms = list(cfg.eval.rewards or []) + list(cfg.rewards or [])
    kwargs = next((dict(t.kwargs) for t in terms if t.name == bench.reward), {})
    kwargs.update(bench.fixed)
    if metadata is not None:
        kwargs["metadata"] = metadata
    return build_rewards([RewardTerm(name=bench.reward, kwargs=kwargs)]).rewards[0]


def geneval_records(reward, prompts: Sequence[str], progress: bool = False) -> list[dict]:
    """GenEval metadata records (tag, include with class/count/colour/position, exclude, prompt) of prompts given
    without them (a text file): each prompt's task as the reward reads it (its metadata files, else GenEval's
    templates), so GenEval's own ``evaluate_images.py`` can score the folder; a ConfigError naming the prompt (its
    number and text) when one has no task."""
    records = []
    bar = tqdm(prompts, desc="GenEval metadata", unit="prompt", disable=not progress or len(prompts) < 1000)
    for number, prompt in enumerate(bar, 1):
        try:
            task = reward.tasks(prompt)
        except ValueError as e:
            raise ConfigError(
                f"--prompts, prompt {number} ({prompt!r}): cannot write its GenEval metadata: {e}"
            ) from None
        records.append({**task.to_metadata(), "prompt": prompt})
    return records


def _prompt_folder(out: Path, index: int, prompt: str, record: dict | None) -> Path:
    """GenEval's layout: ``out/<index:05d>/metadata.jsonl`` (the record) and ``samples/``."""
    folder = out / f"{index:05d}"
    (folder / "samples").mkdir(parents=True, exist_ok=True)
    (folder / "metadata.jsonl").write_text(json.dumps(record if record is not None else {"prompt": prompt}) + "\n")
    return folder


class ImageSeeds(Sequence[int]):
    """The seed of image k of each of the prompts ``mine`` (prompt-major, ``per`` images each), derived when a batch
    asks for it (:func:`~flowrl.training.evaluation.prompt_seeds`): 100,000 prompts × 64 images computed up front held
    the first image back for a quarter of a minute, with nothing on the screen."""

    def __init__(self, seed: int, mine: Sequence[int], per: int):
        self.seed, self.mine, self.per = seed, list(mine), int(per)

    def __len__(self) -> int:
        return len(self.mine) * self.per

    def __getitem__(self, i):
        from flowrl.training.evaluation import prompt_seeds

        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        if not -len(self) <= i < len(self):
            raise IndexError(i)
        i %= len(self)
        return prompt_seeds(self.seed, [self.mine[i // self.per]], i % self.per)[0]


def run_benchmark(
    bench: Benchmark,
    model,
    cfg,
    reward,
    prompts: Sequence[str],
    records: list[dict] | None,
    group,
    guidance: float | None,
    out: Path | None,
    images_per_prompt: int,
    progress: bool = True,
) -> dict[str, float]:
    """Draw ``images_per_prompt`` images of this process's prompts (every ``group.world``-th), score each with
    ``reward`` and return the summary reduced over processes (:func:`summarise`); with ``out`` write the images,
    ``results.jsonl`` (``results-<rank>.jsonl`` under several processes) and, on the main process, ``summary.json``."""
    from flowrl.rollout.sampling import ode_batches
    from flowrl.training.grids import save_sample

    if out is not None and records is None and bench.name == "geneval":
        # a text file's prompts: GenEval's layout needs whole records
        records = geneval_records(reward, prompts, progress and group.is_main)
    mine = list(range(group.rank, len(prompts), group.world))
    indices = [i for i in mine for _ in range(images_per_prompt)]  # one entry per image, prompt-major
    all_prompts = [prompts[i] for i in indices]
    seeds = ImageSeeds(cfg.eval.seed, mine, images_per_prompt)  # each batch's, when it is drawn
    bar = tqdm(
        total=len(indices), unit="image", desc=f"{bench.name} benchmark", disable=not (progress and group.is_main)
    )
    rows: list[dict[str, Any]] = []
    results = None
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        results = open(
            out / ("results.jsonl" if group.world == 1 else f"results-{group.rank}.jsonl"), "w", encoding="utf-8"
        )
    try:
        for start, images in ode_batches(model, all_prompts, seeds, cfg.eval.steps, guidance, cfg.rollout.max_batch):
            here = slice(start, start + len(images))
            new = score_rows(bench, reward, images, all_prompts[here], indices[here])
            for j, row in enumerate(new):
                if out is not None:
                    folder = _prompt_folder(
                        out, row["index"], row["prompt"], records[row["index"]] if records else None
                    )
                    path = save_sample(images[j], folder / "samples" / f"{(start + j) % images_per_prompt:04d}.png")
                    row["filename"] = str(path.relative_to(out))
                    results.write(json.dumps(row) + "\n")
            rows += new
            bar.update(len(images))
    finally:
        bar.close()
        if results is not None:
            results.close()
    summary = summarise(bench, rows, group)
    if out is not None and group.is_main:
        (out / "summary.json").write_text(json.dumps(summary, indent=2))
    return summary


def score_rows(bench: Benchmark, reward, images: torch.Tensor, prompts: list[str], indices: list[int]) -> list[dict]:
    """One result per image [B, 3, H, W]: its prompt index and prompt, and the benchmark's per-image fields."""
    if bench.name == "geneval":
        verdicts = reward.verdicts(images, prompts)
        return [
            {
                "index": i,
                "prompt": p,
                "tag": v.tag,
                "correct": v.strict,
                "exact": v.exact,
                "partial": v.partial,
                "reason": "\n".join(v.reasons),
            }
            for i, p, v in zip(indices, prompts, verdicts)
        ]
    meta: dict[str, Any] = {}
    scores = reward(images, prompts, meta)
    if bench.name == "vqascore":  # NaN (no score) written as null
        return [
            {"index": i, "prompt": p, "score": s if math.isfinite(s) else None}
            for i, p, s in zip(indices, prompts, scores.tolist())
        ]
    texts = meta.get(f"{reward.name}/text") or [None] * len(prompts)
    return [
        {"index": i, "prompt": p, "score": float(s), "correct": float(s) == 1.0, "recognised": t}
        for i, p, s, t in zip(indices, prompts, scores.tolist(), texts)
    ]


def summarise(bench: Benchmark, rows: list[dict], group) -> dict[str, float]:
    """The benchmark's summary over every process (each a count-weighted mean, reduced in one call): for GenEval
    the share of correct images and of prompts with a correct image, each task's accuracy and the overall score
    (mean of the task accuracies); for OCR the mean score and the share read exactly."""
    from flowrl_rewards.compositional.geneval_rules import TAGS

    values: dict[str, float] = {}
    weights: dict[str, float] = {}

    def add(key: str, hits: Sequence[float]) -> None:
        values[key] = sum(hits) / len(hits) if hits else 0.0
        weights[key] = float(len(hits))

    if bench.name == "vqascore":  # the mean over scored images, and over prompts of each prompt's mean
        scored = [r for r in rows if r["score"] is not None]
        add("mean", [r["score"] for r in scored])
        per_prompt: dict[int, list[float]] = {}
        for r in scored:
            per_prompt.setdefault(r["index"], []).append(r["score"])
        add("prompt_mean", [sum(v) / len(v) for v in per_prompt.values()])
        counts = {"n/images": len(rows), "n/scored": len(scored), "n/prompts": len(per_prompt)}
        values.update({k: float(v) for k, v in counts.items()}, unscored=float(len(rows) - len(scored)))
        out = group.reduce_means(values, weights)  # one reduction: the means weighted, the counts added
        return {"mean": math.nan, "prompt_mean": math.nan, **out}  # NaN: no image had a score
    add("images", [float(r["correct"]) for r in rows])
    by_prompt: dict[int, bool] = {}
    for r in rows:
        by_prompt[r["index"]] = by_prompt.get(r["index"], False) or bool(r["correct"])
    add("prompts", [float(v) for v in by_prompt.values()])
    if bench.name == "geneval":
        add("partial", [r["partial"] for r in rows])
        for tag in TAGS:
            add(tag, [float(r["correct"]) for r in rows if r["tag"] == tag])
    else:
        add("mean", [r["score"] for r in rows])
    counts = {f"n/{k}": w for k, w in weights.items()}
    out = group.reduce_means(values, weights)
    out.update({k: group.sum(v) for k, v in counts.items()})
    if bench.name == "geneval":
        present = [t for t in TAGS if out.get(f"n/{t}", 0) > 0]
        out["overall"] = sum(out[t] for t in present) / len(present) if present else float("nan")
        for t in TAGS:
            if t not in present:
                out.pop(t, None)
                out.pop(f"n/{t}", None)
    return out


def summary_lines(bench: Benchmark, summary: dict[str, float], n_prompts: int) -> str:
    """The printed summary: GenEval's layout for ``geneval``; the mean score and exact share for ``ocr``."""
    from flowrl_rewards.compositional.geneval_rules import summary_text

    if bench.name == "geneval":
        return summary_text({**summary, "n": summary["n/images"]}, n_prompts)
    n = int(summary["n/images"])
    if bench.name == "vqascore":
        unscored = int(summary["unscored"])
        return "\n".join(
            [
                f"VQAScore benchmark: {n} images of {n_prompts} prompts"
                + (f" ({unscored} without a score, left out)" if unscored else ""),
                f'mean VQAScore (P("Yes")): {summary["mean"]:.4f}',
                f"mean over prompts: {summary['prompt_mean']:.4f}",
            ]
        )
    return "\n".join(
        [
            f"OCR benchmark: {n} images of {n_prompts} prompts",
            f"mean score (1 − normalised edit distance): {summary['mean']:.4f}",
            f"% read exactly: {summary['images']:.2%} ({round(summary['images'] * n)} / {n})",
        ]
    )
