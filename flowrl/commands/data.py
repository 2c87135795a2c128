"""``flowrl data fetch NAME... | list``: the prompt sets the GPU presets name (:mod:`flowrl.prompts.fetch` fetches
them, :mod:`flowrl.prompts.sets` says what each is)."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from flowrl.commands.common import Flag
from flowrl.paths import REPO_ROOT
from flowrl.prompts.fetch import fetch, list_sets
from flowrl.prompts.sets import DEFAULT_OUT, MANIFEST, PROMPT_SETS, SOURCE_ENV, DataError, get_set

FLAGS: list[Flag] = []


def add_parser(sub, epilog: str) -> None:
    """``flowrl data`` (``data fetch NAME...``, ``data list``) under ``flowrl``'s sub-parsers (``epilog``: unused)."""
    names = ", ".join(sorted(PROMPT_SETS))
    p = sub.add_parser(
        "data",
        help=f"fetch the prompt sets the GPU presets name ({names})",
        description="Fetch prompt sets into DIR/<name>/ (train.txt, test.txt): download, "
        "convert, check counts and checksums, write atomically.",
    )
    add_data_commands(p)


def run(args: argparse.Namespace) -> int:
    """``flowrl data fetch NAME... | list``; a prompt set that cannot be produced prints one message and
    returns 2."""
    if args.data_command == "list":
        print(list_sets(args.out))
        return 0
    source = args.source or os.environ.get(SOURCE_ENV) or None
    try:
        for name in args.names:
            get_set(name)  # every name checked before anything is downloaded
            _check_set_folder(args.out, name)  # and every folder it would write (flowrl/run/outputs.py)
        for name in args.names:
            fetch(name, args.out, source, force=args.force)
    except DataError as e:
        print(f"flowrl data: {e}", file=sys.stderr)
        return 2
    out = Path(args.out).resolve()
    if out not in (Path.cwd().resolve() / DEFAULT_OUT, REPO_ROOT.resolve() / DEFAULT_OUT):
        print(
            f"note: the presets name {DEFAULT_OUT}/<set>/...; run them from {out.parent} or point "
            f"prompts.train / prompts.eval at the files"
        )
    return 0


def _check_set_folder(out: str, name: str) -> None:
    """``OUT/<set>/`` may be written (:func:`~flowrl.run.outputs.check_output`): new, empty, or a fetch of that set
    (its ``manifest.json``, or files that already pass the set's counts and checksums). ``OUT`` itself may hold
    anything: the command adds a folder per set to it."""
    from flowrl.prompts.fetch import up_to_date
    from flowrl.run.outputs import check_output

    spec = get_set(name)

    def fetched(folder: Path) -> bool:
        try:
            manifest = json.loads((folder / MANIFEST).read_text())
        except (OSError, ValueError):
            manifest = None
        return (isinstance(manifest, dict) and manifest.get("name") == spec.name) or up_to_date(spec, folder)

    check_output(
        Path(out) / spec.name,
        "flowrl data fetch",
        f"--out {out!r} ({spec.name}/: {Path(out) / spec.name})",
        recognise=fetched,
    )


def add_data_commands(parser: argparse.ArgumentParser) -> None:
    """``fetch NAME... [--out DIR] [--source FOLDER] [--force]`` and ``list [--out DIR]`` under ``parser``."""
    names = ", ".join(sorted(PROMPT_SETS))
    sub = parser.add_subparsers(dest="data_command", required=True)
    f = sub.add_parser(
        "fetch",
        help="download and convert prompt sets",
        description=f"Prompt sets: {names}. Hugging Face downloads honour HF_HOME / HF_TOKEN; "
        f"offline, give a local mirror with --source (or ${SOURCE_ENV}). "
        "Exit status 2 when a set cannot be produced.",
    )
    f.add_argument("names", nargs="+", metavar="NAME", help=f"prompt set(s): {names}")
    f.add_argument(
        "--out",
        default=DEFAULT_OUT,
        help=f"folder that receives <name>/ (default ./{DEFAULT_OUT}, "
        "where the presets look); a <name>/ that an earlier fetch did "
        "not write is refused",
    )
    f.add_argument(
        "--source",
        default=None,
        metavar="FOLDER",
        help=f"local mirror FOLDER/<owner>/<repo>/<path> instead of downloading (default ${SOURCE_ENV})",
    )
    f.add_argument("--force", action="store_true", help="fetch again even when the files are present and check out")
    f.set_defaults(func=run, flags=FLAGS)
    ls = sub.add_parser("list", help="the prompt sets: sources, files, what is present, which presets use them")
    ls.add_argument("--out", default=DEFAULT_OUT, help=f"folder to look in (default ./{DEFAULT_OUT})")
    ls.set_defaults(func=run, flags=FLAGS)
