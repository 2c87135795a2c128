"""The model card of an export (docs/sharing.md): ``README.md`` as huggingface_hub's :class:`~huggingface_hub.ModelCard`
writes it, with the files it shows beside it, ``config.yaml`` and the after-grid (``after.png``, ``after.gif`` for a
video family).

The card's metadata: ``base_model`` (when ``model.path`` is a Hub id) and ``base_model_relation``,
``library_name: diffusers``, ``pipeline_tag``, the tags (``flowrl``, ``lora`` or ``full-finetune``, the task,
``reinforcement-learning``), the base's license where :data:`KNOWN_LICENSES` knows it, and the after-grid as the
widget's image. Its text: the method (plan × credit rule × objective, in words, with their settings), the rewards and
their settings (secrets redacted, :mod:`flowrl.config.secrets`), the held-out eval before and after from
``metrics.jsonl``, the config and command that reproduce the run with the flowrl version, and how to load the weights.
The same card is written by ``flowrl export`` and uploaded by ``--push-to-hub`` / ``train.push_to_hub`` (with the repo
id in place of :data:`REPO_PLACEHOLDER`).
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path
from typing import Any

from flowrl.config.secrets import REDACTED, redact_kwargs
from flowrl.run.outputs import logged_records

CARD_FILE = "README.md"
CONFIG_FILE = "config.yaml"
REPO_PLACEHOLDER = "REPO_ID"  # the loading code of a card written before its repo is known
HUB = "https://huggingface.co"
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")

KNOWN_LICENSES: dict[str, dict[str, str]] = {
    "stabilityai/stable-diffusion-3.5-": {
        "license": "other",
        "license_name": "stabilityai-ai-community",
        "license_file": "LICENSE.md",
    },
    "black-forest-labs/FLUX.1-dev": {
        "license": "other",
        "license_name": "flux-1-dev-non-commercial-license",
        "license_file": "LICENSE.md",
    },
    "black-forest-labs/FLUX.1-Kontext-dev": {
        "license": "other",
        "license_name": "flux-1-dev-non-commercial-license",
        "license_file": "LICENSE.md",
    },
    "black-forest-labs/FLUX.1-schnell": {"license": "apache-2.0"},
    "Qwen/Qwen-Image": {"license": "apache-2.0"},  # Qwen-Image and its Edit models
    "Wan-AI/Wan2.1-": {"license": "apache-2.0"},
    "Wan-AI/Wan2.2-": {"license": "apache-2.0"},
    "Tongyi-MAI/Z-Image-Turbo": {"license": "apache-2.0"},
}
"""Hub id prefix of a base model → its license as its own card states it (``license_file``: the file of the base's
repo that ``license_link`` points to); a base not listed gets no license (the card says to read the base's)."""

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
RESET_KEYS = {"output_dir": "runs", "push_to_hub": None, "resume": None, "overwrite": False}
"""``train`` keys the shared config.yaml resets (where the run was written and shared, not how it trained)."""


def base_model_id(cfg) -> str | None:
    """``model.path`` when it names a Hub model (``owner/name``, not an existing local folder), else None."""
    path = cfg.model.path
    if not path or not _HUB_ID.match(str(path)) or Path(str(path)).exists():
        return None
    return str(path)


SHAPES_LICENSE = {"license": "apache-2.0"}  # the shapes model ships inside flowrl-align, under its license


def base_license(base: str | None) -> dict[str, str]:
    """The card metadata of ``base``'s license (:data:`KNOWN_LICENSES`), or {} when not known."""
    if base is None:
        return {}
    for prefix, known in KNOWN_LICENSES.items():
        if base.startswith(prefix):
            out = {k: v for k, v in known.items() if k != "license_file"}
            if "license_file" in known:
                out["license_link"] = f"{HUB}/{base}/blob/main/{known['license_file']}"
            return out
    return {}


def task_of(cfg) -> str:
    """The card's ``pipeline_tag``: text-to-image, text-to-video, or image-to-image / image-to-video for a family whose
    prompts carry a source image (the adapter's class attributes, nothing loaded)."""
    from flowrl.models import model_family

    adapter = model_family(cfg.model.family).adapter_class()
    source = "image" if getattr(adapter, "takes_source_image", False) else "text"
    return f"{source}-to-{'video' if getattr(adapter, 'modality', 'image') == 'video' else 'image'}"


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


def _value(value: Any, limit: int = 200) -> str:
    """``value`` as text (a string as it is, else JSON), cut at ``limit`` characters."""
    text = " ".join((value if isinstance(value, str) else json.dumps(value)).split())
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _settings(section: dict, skip: str = "") -> str:
    """``key: value`` pairs of a config section, comma separated (nested values as JSON), for a table cell."""
    text = ", ".join(f"{k}: {_value(v)}" for k, v in section.items() if k != skip) or "–"
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


def shared_config(cfg) -> dict:
    """The config the card shares: the run's (secrets redacted, :meth:`TrainConfig.to_dict`) with :data:`RESET_KEYS`
    at their defaults."""
    tree = cfg.to_dict()
    tree["train"].update(RESET_KEYS)
    return tree


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


def grid_for(run_dir: Path, step: int | None, last_step: int | None) -> Path | None:
    """The held-out grid of the exported weights: ``samples/after.png`` (``.gif``) for the run's newest step, else the
    periodic eval's ``samples/step-N.png`` of the exported step; None when there is none."""
    samples = Path(run_dir) / "samples"
    names = ["after"] if step is None or step == last_step else []
    names += [f"step-{step}"] if step is not None else []
    for name in names:
        for suffix in (".png", ".gif"):
            if (samples / f"{name}{suffix}").is_file():
                return samples / f"{name}{suffix}"
    return None


def build_card(
    cfg,
    run_dir: Path,
    folder: Path,
    *,
    step: int | None = None,
    last_step: int | None = None,
    guidance: float | None = None,
    repo_id: str | None = None,
    image: str | None = None,
):
    """The :class:`~huggingface_hub.ModelCard` of export ``folder`` (its weights already written) of the run in
    ``run_dir`` whose config is ``cfg``: ``step`` the exported checkpoint's, ``last_step`` the run's newest,
    ``guidance`` the policy's, ``repo_id`` the Hub repo (None: :data:`REPO_PLACEHOLDER` in the loading code), ``image``
    the after-grid's file name beside the card (None: no image)."""
    from huggingface_hub import ModelCard, ModelCardData
    from omegaconf import OmegaConf

    from flowrl.version import __version__

    lora = not (folder / "transformer").is_dir()
    base = base_model_id(cfg)
    task = task_of(cfg)
    tree = shared_config(cfg)
    repo = repo_id or REPO_PLACEHOLDER
    data = ModelCardData(
        base_model=base,
        library_name="diffusers",
        pipeline_tag=task,
        tags=["flowrl", "lora" if lora else "full-finetune", task, "reinforcement-learning", "diffusers"],
        **(SHAPES_LICENSE if cfg.model.family == "shapes" and cfg.model.path is None else base_license(base)),
    )
    if base is not None:
        data.base_model_relation = "adapter" if lora else "finetune"
    if image is not None:
        data.widget = [{"text": "held-out prompts after training", "output": {"url": image}}]
    kind = "LoRA" if lora else "fully fine-tuned transformer"
    of = (
        f"[{base}]({HUB}/{base})"
        if base
        else ("flowrl's embedded shapes model" if cfg.model.family == "shapes" else "")
    )
    of = of or f"a local `{cfg.model.family}` pipeline (`model.path` in config.yaml)"
    evals = eval_records(run_dir, step)
    at = f" at step {step}" if step is not None else ""
    iterations = step if step is not None else cfg.train.max_steps
    version = __version__
    license_line = (
        f"Its license is its base model's (`{data.license}`"
        + (f", [{data.license_name}]({data.license_link})" if getattr(data, "license_link", None) else "")
        + ")."
        if data.license
        else "Read the base model's card for the license these weights inherit."
    )
    body = [
        f"# {(repo_id or cfg.train.name).rsplit('/', 1)[-1]}",
        "",
        f"A {kind} of {of}, aligned with reinforcement learning by [flowrl](https://pypi.org/project/flowrl-align/) "
        f"{version} (`model.family: {cfg.model.family}`), exported{at}. {license_line}",
        "",
        "## Method",
        "",
        *method_lines(tree),
        "",
        f"Trained for {iterations} iteration{'s' if iterations != 1 else ''} "
        f"(`train.max_steps: {cfg.train.max_steps}`) of `prompts.per_step: {cfg.prompts.per_step}` prompts "
        f"(`prompts.train: {_value(cfg.prompts.train)}`), seed {cfg.train.seed}"
        + (f"; the policy samples at guidance {guidance:g}" if guidance is not None else "")
        + ".",
        "",
        "## Rewards",
        "",
        *reward_lines(tree),
        "",
        "## Held-out eval",
        "",
        f"Prompts: `prompts.eval: {_value(cfg.prompts.eval)}`.",
        "",
        *eval_table(evals),
        "",
    ]
    if image is not None:
        body += ["## Samples", "", f"![held-out prompts after training]({image})", ""]
        body += ["Held-out prompts after training, each labelled with its prompt and its eval mark (same seeds).", ""]
    body += ["## Use", "", *usage_lines(cfg, folder, repo, base, guidance, task), ""]
    config_yaml = OmegaConf.to_yaml(OmegaConf.create(tree))
    body += [
        "## Reproduce",
        "",
        f"With flowrl {version} (`pip install flowrl-align=={version}`), from this repository's `{CONFIG_FILE}`:",
        "",
        "```",
        f"hf download {repo} {CONFIG_FILE} --local-dir .",
        f"flowrl train {CONFIG_FILE}",
        "```",
        "",
        f"`{CONFIG_FILE}` is the run's resolved config with "
        + ", ".join(f"`train.{k}`" for k in RESET_KEYS)
        + " at their defaults (where the run was written and shared, not how it trained)"
        + (
            f"; a reward setting that held a secret reads `{REDACTED}`: give it again (e.g. in the environment "
            "variable its `*_env` setting names) before training"
            if REDACTED in config_yaml
            else ""
        )
        + ". Prompt files it names by a local path are not part of this repository.",
        "",
        "<details><summary>config.yaml</summary>",
        "",
        "```yaml",
        config_yaml.rstrip("\n"),
        "```",
        "",
        "</details>",
        "",
    ]
    return ModelCard(f"---\n{data.to_yaml()}\n---\n\n" + "\n".join(body))


def write_card(
    folder: Path,
    cfg,
    run_dir: Path,
    *,
    step: int | None = None,
    last_step: int | None = None,
    guidance: float | None = None,
    repo_id: str | None = None,
) -> Path:
    """Write the card (:func:`build_card`) into export ``folder`` as ``README.md``, with ``config.yaml`` (the shared
    config, :func:`shared_config`) and the after-grid (:func:`grid_for`) beside it. The card's path."""
    from omegaconf import OmegaConf

    folder = Path(folder)
    grid = grid_for(run_dir, step, last_step)
    image = None
    if grid is not None:
        image = f"after{grid.suffix}"
        shutil.copyfile(grid, folder / image)
    (folder / CONFIG_FILE).write_text(OmegaConf.to_yaml(OmegaConf.create(shared_config(cfg))))
    card = build_card(
        cfg, run_dir, folder, step=step, last_step=last_step, guidance=guidance, repo_id=repo_id, image=image
    )
    card.save(folder / CARD_FILE)
    return folder / CARD_FILE
