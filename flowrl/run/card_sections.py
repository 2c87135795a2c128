"""The text sections of an export's model card (:func:`flowrl.run.model_card.build_card` puts them together): the
method in words (plan × credit rule × objective, with their settings), the rewards (secrets redacted), the held-out
eval before and after from ``metrics.jsonl``, and the Python that loads the weights."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from flowrl.config.secrets import redact_kwargs
from flowrl.run.outputs import logged_records

PLAN_WORDS = {
    "chains": "independent SDE chains per prompt (Flow-GRPO, DanceGRPO, MixGRPO)",
    "ode": "deterministic ODE chains per prompt, one noise seed each",
    "tree": "branching trees per prompt (BranchGRPO)",
    "explore": "explore, select and regenerate around an inner plan (Sol-RL)",
    "probed": "an inner plan whose intermediate states are scored by probes",
    "offline": "samples replayed from a stored rollout set",
}
CREDIT_WORDS = {
    "group": "one advantage per sample, its reward against its prompt group's",
    "tree": "depth-wise advantages over each tree's leaves",
    "turning_point": "incremental step rewards and turning points (TP-GRPO)",
    "value_anchor": "step values anchored in time and in the group (VGPO)",
}
LOSS_WORDS = {
    "clipped": "clipped policy ratio (GRPO), with an optional KL to the reference",
    "layer_tuning": "clipped policy ratio plus Dynamic-TreeRPO's layer-tuning term",
    "nft": "DiffusionNFT: forward-process regression towards well-scored samples and away from poor ones",
    "awm": "Advantage Weighted Matching: advantage-weighted flow matching on the samples",
    "grpo_guard": "GRPO-Guard: the clipped policy ratio, normalised",
    "dpo": "online Diffusion-DPO on each group's best and worst samples",
    "gdro": "GDRO: group-level ranking through DPO-style implicit rewards",
    "dgpo": "DGPO: maximum likelihood of group-level preferences",
    "crd": "Centered Reward Distillation: implicit rewards regressed onto the centred rewards",
    "raft": "flow matching on each prompt group's best samples (RAFT)",
}
SELECTORS = (("rollout", "plan", "rollout plan", PLAN_WORDS), ("credit", "rule", "credit rule", CREDIT_WORDS))
SELECTORS += (("loss", "objective", "objective", LOSS_WORDS),)


def eval_records(run_dir: Path, step: int | None = None) -> list[dict]:
    """The held-out eval records of ``run_dir/metrics.jsonl`` (those with ``eval/`` or ``eval_default/`` keys), up to
    ``step`` when given (the exported checkpoint's)."""
    records = logged_records(Path(run_dir) / "metrics.jsonl")
    evals = [r for r in records if any(k.startswith(("eval/", "eval_default/")) for k in r)]
    return [r for r in evals if step is None or int(r.get("step", 0)) <= step]


def _is_count(key: str) -> bool:
    return key.endswith(("/n", "_failed", "/guidance")) or "/n/" in key


def eval_table(evals: list[dict]) -> list[str]:
    """Markdown lines: the first and the last eval record side by side (metric, before, after, change), counts and
    guidance in the line above; one record: its values alone; none: a line saying so."""
    if not evals:
        return ["No held-out eval was logged in this run's metrics.jsonl."]
    first, last = evals[0], evals[-1]
    keys = sorted(k for k in last if k.startswith(("eval/", "eval_default/")) and not _is_count(k))
    keys = [k for k in keys if isinstance(last[k], (int, float)) and not isinstance(last[k], bool)]
    counts = [last[k] for k in sorted(last) if k.endswith("/n") and isinstance(last[k], (int, float))]
    details = [f"{int(counts[0])} held-out images"] if counts else []
    details += [
        f"`{p}/*` at guidance {last[p + '/guidance']:g}"
        for p in ("eval", "eval_default")
        if isinstance(last.get(f"{p}/guidance"), (int, float))
    ]
    lines = ["Held-out prompts, the same seeds at every eval" + (f" ({'; '.join(details)})" if details else "") + ":"]
    lines.append("")
    if len(evals) == 1:
        lines += [f"| metric | step {last.get('step', '?')} |", "|---|---|"]
        lines += [f"| `{k}` | {last[k]:.4f} |" for k in keys]
        return lines
    lines += [
        f"| metric | before (step {first.get('step', '?')}) | after (step {last.get('step', '?')}) | change |",
        "|---|---|---|---|",
    ]
    for k in keys:
        before = first.get(k)
        if isinstance(before, (int, float)) and not isinstance(before, bool):
            lines.append(f"| `{k}` | {before:.4f} | {last[k]:.4f} | {last[k] - before:+.4f} |")
        else:
            lines.append(f"| `{k}` | – | {last[k]:.4f} | |")
    return lines


def value_text(value: Any, limit: int = 200) -> str:
    """``value`` as text (a string as it is, else JSON), cut at ``limit`` characters."""
    text = " ".join((value if isinstance(value, str) else json.dumps(value)).split())
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _settings(section: dict, skip: str = "") -> str:
    """``key: value`` pairs of a config section, comma separated (nested values as JSON), for a table cell."""
    text = ", ".join(f"{k}: {value_text(v)}" for k, v in section.items() if k != skip) or "–"
    return text.replace("|", "\\|")


def method_lines(tree: dict) -> list[str]:
    """The method in words: rollout plan × credit rule × objective, each named, described and with its settings."""
    names, rows = [], []
    for section, selector, what, words in SELECTORS:
        part = tree.get(section) or {}
        name = str(part.get(selector))
        names.append(f"{what} `{name}`")
        rows.append(
            f"| {what} | `{name}` | {words.get(name, 'an out-of-tree component')} | {_settings(part, selector)} |"
        )
    return [
        "Every flowrl method is a rollout plan × a credit rule × an objective over one trajectory forest; this run "
        f"composed the {' × the '.join(names)}:",
        "",
        "| part | name | what it does | settings |",
        "|---|---|---|---|",
        *rows,
    ]


def reward_lines(tree: dict) -> list[str]:
    """The training rewards and the eval rewards, each with its weight and settings (secrets redacted)."""
    lines = ["| used for | reward | weight | settings |", "|---|---|---|---|"]
    evaluation = (tree.get("eval") or {}).get("rewards")
    for used, terms in (("training", tree.get("rewards") or []), ("held-out eval", evaluation or [])):
        for term in terms:
            kwargs = redact_kwargs(dict(term.get("kwargs") or {}))
            name = term.get("name")
            label = f" (label `{term['label']}`)" if term.get("label") else ""
            lines.append(f"| {used} | `{name}`{label} | {term.get('weight', 1.0):g} | {_settings(kwargs)} |")
    if evaluation is None:
        lines.append("")
        lines.append("The held-out eval scores the training rewards.")
    return lines


def _transformer_class(folder: Path, sub: str) -> str:
    try:
        return str(json.loads((folder / sub / "config.json").read_text())["_class_name"])
    except (OSError, ValueError, KeyError, TypeError):
        return "SD3Transformer2DModel"  # the shapes model's, and SD3's


def usage_lines(cfg, folder: Path, repo: str, base: str | None, guidance: float | None, task: str) -> list[str]:
    """Python that loads the export from ``repo`` onto its base pipeline and samples one prompt (unlabelled fence: it
    needs the Hub)."""
    shapes = cfg.model.family == "shapes"
    dtype = "" if shapes else ", torch_dtype=torch.bfloat16"
    full = (folder / "transformer").is_dir()
    subs = [s for s in ("transformer", "transformer_2") if (folder / s / "config.json").is_file()] if full else []
    classes = sorted({_transformer_class(folder, s) for s in subs})
    imports = ", ".join(["DiffusionPipeline", *classes]) if not shapes else ", ".join(classes)
    lines = ["```", "import torch"]
    if imports:
        lines.append(f"from diffusers import {imports}")
    if shapes:
        lines += ["from flowrl.shapes.pipeline import load_shapes_pipeline", ""]
    else:
        lines.append("")
    for sub in subs:
        lines.append(f'{sub} = {_transformer_class(folder, sub)}.from_pretrained("{repo}", subfolder="{sub}"{dtype})')
    given = "".join(f", {s}={s}" for s in subs)
    if shapes:
        lines.append("pipe = load_shapes_pipeline()  # the shapes model shipped with flowrl")
        lines += [f"pipe.{s} = {s}" for s in subs]
    else:
        where = base or "BASE_MODEL"  # a local base: model.path in config.yaml
        note = "" if base else "  # the pipeline this was trained from: model.path in config.yaml"
        lines.append(f'pipe = DiffusionPipeline.from_pretrained("{where}"{given}{dtype}).to("cuda"){note}')
    if not full:
        if (folder / "pytorch_lora_weights.safetensors").is_file() or not (folder / "transformer_2").is_dir():
            lines.append(f'pipe.load_lora_weights("{repo}")')
        if (folder / "transformer_2" / "pytorch_lora_weights.safetensors").is_file():
            lines.append(f'pipe.load_lora_weights("{repo}", subfolder="transformer_2", load_into_transformer_2=True)')
    scale = f", guidance_scale={guidance:g}" if guidance is not None else ""
    source = 'image=load_image("source.png"), ' if task.startswith("image-") else ""
    if source:
        lines.insert(2, "from diffusers.utils import load_image")
    prompt = "a photo of a cat" if not shapes else "two red circles"
    if task.endswith("video"):
        lines.append(f'video = pipe({source}prompt="{prompt}"{scale}).frames[0]')
    else:
        lines.append(f'image = pipe({source}prompt="{prompt}"{scale}).images[0]')
    lines.append("```")
    return lines
