"""``flowrl train | sample | export | eval | bench | compare | snr | data``: the parser and the one way every command
fails. Each subcommand is a module of :mod:`flowrl.commands` with ``add_parser(sub, epilog)``, ``run(args)`` and the
ranges of its numeric ``FLAGS``."""

from __future__ import annotations

import argparse
import os
import sys

# OpenMP threads that spin at barriers while another process holds a core made a 2-thread CPU
# iteration up to 70x slower on a shared 2-core machine; purely passive waiting avoids that but makes
# every small kernel wait for a sleeping thread (1.7x slower forwards alone). A short spin (1,000
# iterations, then sleep) is as fast as spinning alone and as safe as passive under contention
# (docs/benchmarks.md). Set before torch is imported; OMP_WAIT_POLICY or GOMP_SPINCOUNT in the
# environment win.
if "OMP_WAIT_POLICY" not in os.environ:
    os.environ.setdefault("GOMP_SPINCOUNT", "1000")

from flowrl.commands import bench, compare, data, export, rollouts, sample, snr, train  # noqa: E402
from flowrl.commands import eval as held_out_eval  # noqa: E402
from flowrl.commands.common import check_flags, defaults_epilog  # noqa: E402
from flowrl.commands.train import GUARD_STOPPED  # noqa: E402,F401 (the exit statuses: main's docstring)
from flowrl.config.schema import ConfigError  # noqa: E402

COMMANDS = (train, sample, export, held_out_eval, bench, compare, snr, data, rollouts)
"""The subcommands, in the order ``flowrl --help`` lists them."""


def build_parser(argv: list[str] | None = None) -> argparse.ArgumentParser:
    """The ``flowrl`` parser; ``argv`` (when asking for help) picks the config whose keys the help lists."""
    asking = bool(argv) and ("-h" in argv or "--help" in argv)
    epilog = defaults_epilog(argv) if asking else defaults_epilog()
    parser = argparse.ArgumentParser(
        prog="flowrl",
        description="RL alignment of flow-matching text-to-image models. "
        "Add --debug to any command to see the traceback of a failure.",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    for command in COMMANDS:  # flowrl train --help lists its rewards' settings too
        asked = asking and command is train and argv[0] == "train"
        command.add_parser(sub, epilog + train.reward_settings_epilog(argv) if asked else epilog)
    return parser


def parse_args(argv: list[str]) -> argparse.Namespace:
    """Parse ``argv``; ``key=value`` overrides may also follow an option (``snr CONFIG --batches 4 a.b=1``)."""
    parser = build_parser(argv)
    args, extra = parser.parse_known_args(argv)
    if extra:
        into = "overrides" if hasattr(args, "overrides") else "items" if hasattr(args, "items") else None
        if into is None or any(a.startswith("-") or "=" not in a for a in extra):
            parser.error(f"unrecognized arguments: {' '.join(extra)}")
        setattr(args, into, list(getattr(args, into) or []) + extra)
    return args


def main(argv: list[str] | None = None) -> int:
    """Run one command; a failure is one message on stderr (``--debug``: the traceback too) and an exit
    status: 2 a bad config or input, 3 a run stopped for non-finite values, 1 anything else; ``flowrl train``
    also exits with 4 when its eval guard stopped the run (:data:`GUARD_STOPPED`) and 130 when interrupted."""
    argv = sys.argv[1:] if argv is None else list(argv)
    debug = "--debug" in argv
    args = parse_args([a for a in argv if a != "--debug"])
    if not debug:
        _quiet_libraries()
    try:
        check_flags(args)  # every numeric flag in its range, named (each command's FLAGS)
        return args.func(args)
    except ConfigError as e:
        return _fail(args.command, f"config error: {e}", 2, debug)
    except (FileNotFoundError, ValueError, KeyError) as e:
        return _fail(args.command, f"error: {_text(e)}", 2, debug)
    except FloatingPointError as e:
        return _fail(args.command, f"stopped: {e}", 3, debug)
    except OSError as e:
        where = f" ({e.filename})" if getattr(e, "filename", None) else ""
        return _fail(args.command, f"error: {e.strerror or e}{where}", 1, debug)
    except Exception as e:  # noqa: BLE001 — anything else is still one message, not a traceback
        return _fail(args.command, f"error: {type(e).__name__}: {_text(e)}", 1, debug)


def _quiet_libraries() -> None:
    """diffusers' and transformers' loading bars and advisory warnings off: the command's own progress bar and
    messages are what a user reads (``--debug`` keeps them)."""
    import diffusers
    import transformers

    for lib in (diffusers, transformers):
        lib.utils.logging.set_verbosity_error()
        lib.utils.logging.disable_progress_bar()


def _text(e: BaseException) -> str:
    """An exception's message (KeyError's without its quotes), at most 2,000 characters."""
    text = str(e.args[0]) if isinstance(e, KeyError) and e.args else str(e)
    return text if len(text) <= 2000 else text[:2000] + f"… ({len(text):,} characters)"


def _fail(command: str, message: str, status: int, debug: bool) -> int:
    if debug:
        import traceback

        traceback.print_exc()
    hint = "" if debug else "\n(add --debug to see the traceback)" if status == 1 else ""
    print(f"flowrl {command}: {message}{hint}", file=sys.stderr)
    return status


if __name__ == "__main__":
    sys.exit(main())
