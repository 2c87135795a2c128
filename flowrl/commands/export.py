"""``flowrl export``: a run's (or one checkpoint's) trained weights, sharded or not, in one folder a single GPU
loads, with its model card (``README.md``, :mod:`flowrl.run.model_card`); ``--push-to-hub REPO_ID`` then uploads the
folder to the Hugging Face Hub (:mod:`flowrl.run.hub`; docs/sharing.md)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from flowrl.commands.common import OVERRIDES_HELP, Flag
from flowrl.run.model import load_model, run_config

FLAGS: list[Flag] = []


def add_parser(sub, epilog: str) -> None:
    """``flowrl export`` under ``flowrl``'s sub-parsers (``epilog``: unused, it lists config keys)."""
    p = sub.add_parser(
        "export",
        help="consolidate a run's weights (sharded or not) into one folder a single GPU loads",
        description="Write a run's newest (or a given) checkpoint's trained weights whole: a LoRA in the "
        "diffusers format, or a transformer/ folder that from_pretrained reads (docs/gpu.md), with its model card "
        "(README.md); --push-to-hub uploads them to the Hugging Face Hub (docs/sharing.md).",
    )
    p.add_argument("run", help="run folder (runs/<name>) or a checkpoints/step-N folder")
    p.add_argument(
        "--out",
        help="output folder: a new (or empty) one, or an earlier export, which is replaced "
        "(default: <run>/export); a folder it did not write is refused",
    )
    p.add_argument(
        "--push-to-hub",
        metavar="REPO_ID",
        help="then upload the export (weights, model card, config, after-grid) to this Hub model repo, created when "
        "missing; the token is HF_TOKEN's or the login's (hf auth login)",
    )
    p.add_argument("--private", action="store_true", help="with --push-to-hub: create the repo private")
    p.add_argument(
        "--revision", help="with --push-to-hub: the branch to commit to (default main; created from main when missing)"
    )
    p.add_argument("--config", help="config file (default: the run's config.yaml)")
    p.add_argument("overrides", nargs="*", help=OVERRIDES_HELP)
    p.set_defaults(func=run, flags=FLAGS)


def run(args: argparse.Namespace) -> int:
    """Consolidate a run's (or one checkpoint's) trained weights, sharded or not, into one folder that a single
    GPU loads: the LoRA in the diffusers format (``pipe.load_lora_weights``) or ``transformer/`` for
    ``SD3Transformer2DModel.from_pretrained`` and its kin (the EMA's weights where the run kept one), with the model
    card beside them. One process, on the CPU; written atomically, only where
    :func:`~flowrl.run.checkpoint.check_export_target` allows. With ``--push-to-hub`` the folder is then uploaded; a
    failed upload is one line on stderr and exit status 1, the export kept."""
    import torch

    from flowrl.errors import ConfigError
    from flowrl.run.checkpoint import check_export_target, list_checkpoints, save_weights, write_export
    from flowrl.run.hub import check_repo_id
    from flowrl.run.model_card import write_card

    repo = args.push_to_hub
    if repo is not None:
        check_repo_id(repo, "--push-to-hub")
    elif args.private or args.revision is not None:
        raise ConfigError("--private and --revision apply to an upload: add --push-to-hub REPO_ID")
    cfg, ckpt = run_config(args.run, args.config, args.overrides)
    run_dir = ckpt.parent.parent
    target = Path(args.out) if args.out is not None else run_dir / "export"
    check_export_target(target, "--out")  # before the model loads: a folder it did not write is refused
    model, guidance = load_model(cfg, ckpt, torch.device("cpu"))
    saved = list_checkpoints(run_dir / "checkpoints")
    step = next((s for s, p in saved if p.resolve() == ckpt.resolve()), None)
    last = saved[-1][0] if saved else None

    def write(folder: Path) -> None:
        save_weights(model, folder)
        write_card(folder, cfg, run_dir, step=step, last_step=last, guidance=guidance, repo_id=repo)

    out = write_export(target, write)
    what = (
        "LoRA (pipe.load_lora_weights)"
        if model.has_lora
        else "transformer (from_pretrained(..., subfolder='transformer'))"
    )
    print(f"exported the {what} of {ckpt} to {out}, with its model card (README.md)")
    return 0 if repo is None else push(out, repo, private=args.private, revision=args.revision)


def push(
    folder: Path,
    repo: str,
    *,
    private: bool = False,
    revision: str | None = None,
    command: str = "export",
    kept: str | None = None,
) -> int:
    """Upload export ``folder`` to ``repo`` (:func:`flowrl.run.hub.push_folder`): 0 and the repo's URL on stdout, or
    1 and one line on stderr ending with ``kept`` (default: the local export is kept)."""
    from flowrl.run.hub import HubError, push_folder

    try:
        url = push_folder(folder, repo, private=private, revision=revision)
    except HubError as e:
        kept = kept or f"the export in {folder} is kept"
        print(f"flowrl {command}: push to the Hub failed: {e}; {kept}", file=sys.stderr)
        return 1
    print(f"pushed {folder} to {url}")
    return 0
