"""The model card of an export (docs/sharing.md): ``README.md`` as huggingface_hub's :class:`~huggingface_hub.ModelCard`
writes it, with the files it shows beside it, ``config.yaml`` and the after-grid (``after.png``, ``after.gif`` for a
video family).

The card's metadata: ``base_model`` (when ``model.path`` is a Hub id) and ``base_model_relation``,
``library_name: diffusers``, ``pipeline_tag``, the tags (``flowrl``, ``lora`` or ``full-finetune``, the task,
``reinforcement-learning``), the base's license where :data:`KNOWN_LICENSES` knows it, and the after-grid as the
widget's image. Its text: the method (plan × credit rule × objective, in words, with their settings), the rewards and
their settings (secrets redacted, :mod:`flowrl.config.secrets`), the held-out eval before and after from
``metrics.jsonl``, the config and command that reproduce the run with the flowrl version, and how to load the weights.
Its text sections are :mod:`flowrl.run.card_sections`. The same card is written by ``flowrl export`` and uploaded by
``--push-to-hub`` / ``train.push_to_hub`` (with the repo id in place of :data:`REPO_PLACEHOLDER`).
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path

from flowrl.config.secrets import REDACTED
from flowrl.run.card_sections import (  # noqa: F401 (re-exported)
    CREDIT_WORDS,
    LOSS_WORDS,
    PLAN_WORDS,
    SELECTORS,
    eval_records,
    eval_table,
    method_lines,
    reward_lines,
    usage_lines,
    value_text,
)

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


def shared_config(cfg) -> dict:
    """The config the card shares: the run's (secrets redacted, :meth:`TrainConfig.to_dict`) with :data:`RESET_KEYS`
    at their defaults."""
    tree = cfg.to_dict()
    tree["train"].update(RESET_KEYS)
    return tree


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
    from huggingface_hub import ModelCard

    from flowrl.version import __version__

    lora = not (folder / "transformer").is_dir()
    base = base_model_id(cfg)
    task = task_of(cfg)
    tree = shared_config(cfg)
    repo = repo_id or REPO_PLACEHOLDER
    data = _card_data(cfg, base, task, lora, image)
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
        f"(`prompts.train: {value_text(cfg.prompts.train)}`), seed {cfg.train.seed}"
        + (f"; the policy samples at guidance {guidance:g}" if guidance is not None else "")
        + ".",
        "",
        "## Rewards",
        "",
        *reward_lines(tree),
        "",
        "## Held-out eval",
        "",
        f"Prompts: `prompts.eval: {value_text(cfg.prompts.eval)}`.",
        "",
        *eval_table(evals),
        "",
    ]
    if image is not None:
        body += ["## Samples", "", f"![held-out prompts after training]({image})", ""]
        body += ["Held-out prompts after training, each labelled with its prompt and its eval mark (same seeds).", ""]
    body += ["## Use", "", *usage_lines(cfg, folder, repo, base, guidance, task), ""]
    body += _reproduce_lines(repo, tree, version)
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


def _card_data(cfg, base: str | None, task: str, lora: bool, image: str | None):
    """The card's metadata (:class:`~huggingface_hub.ModelCardData`): the base model and how the export relates to it,
    the library, task and tags, the base's license and the after-grid as the widget's image."""
    from huggingface_hub import ModelCardData

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
    return data


def _reproduce_lines(repo: str, tree: dict, version: str) -> list[str]:
    """The card's ``Reproduce`` section: the commands that train the run again from its shared ``config.yaml``, and the
    config itself."""
    from omegaconf import OmegaConf

    config_yaml = OmegaConf.to_yaml(OmegaConf.create(tree))
    return [
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
