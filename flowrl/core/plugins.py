"""Load a class (or a function) named ``package.module:Class`` or ``path/to/file.py:Class``: every
:class:`~flowrl.config.registry.Registry` (plans, credit rules, objectives, rewards, kernels, model families)
resolves such names through here.

A file is imported once per process under a stable module name derived from its absolute path, so
two configs naming the same file share one class.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import os
import sys
from pathlib import Path


def is_file_target(module_path: str) -> bool:
    """``True`` for ``"dir/file.py"``-style module parts (a path, not a dotted module)."""
    return module_path.endswith(".py") or "/" in module_path or os.sep in module_path


def import_file(path: str, what: str):
    """The module of the Python file ``path``, imported once per process; ``what`` names the kind in
    errors ("reward plugin file")."""
    file = Path(path).expanduser()
    if not file.is_file():
        raise FileNotFoundError(f"{what} {path!r} does not exist (relative paths are from {os.getcwd()})")
    resolved = str(file.resolve())
    mod_name = "_flowrl_plugin_" + hashlib.sha1(resolved.encode()).hexdigest()[:16]
    module = sys.modules.get(mod_name)
    if module is None:
        spec = importlib.util.spec_from_file_location(mod_name, resolved)
        if spec is None or spec.loader is None:
            raise ImportError(f"{what} {path!r} cannot be imported as Python (a .py file is expected)")
        module = importlib.util.module_from_spec(spec)
        sys.modules[mod_name] = module
        try:
            spec.loader.exec_module(module)
        except Exception as e:
            del sys.modules[mod_name]
            raise ImportError(
                f"{what} {path!r} failed while being imported{_where(e, resolved)}: {type(e).__name__}: {e}"
            ) from e
        except BaseException:
            del sys.modules[mod_name]
            raise
    return module


def _where(error: BaseException, file: str) -> str:
    """`` (line N)``: the deepest line of ``file`` in ``error``'s traceback, or ``""``."""
    import traceback

    lines = [frame.lineno for frame in traceback.extract_tb(error.__traceback__) if frame.filename == file]
    if isinstance(error, SyntaxError) and error.lineno:
        lines.append(error.lineno)
    return f" (line {lines[-1]})" if lines else ""


def load_from_file(path: str, cls_name: str, what: str, base: type | None = None) -> type:
    """``cls_name`` from the Python file ``path``; ``what`` names the kind in errors ("reward plugin
    file"); when ``cls_name`` is missing the error lists the file's ``base`` subclasses (None: its functions)."""
    module = import_file(path, what)
    if not hasattr(module, cls_name):
        if base is None:
            found = sorted(
                k for k, v in vars(module).items() if callable(v) and not isinstance(v, type) and not k.startswith("_")
            )
            raise AttributeError(f"{what} {path!r} has no function {cls_name!r} (functions in it: {found})")
        found = sorted(
            k for k, v in vars(module).items() if isinstance(v, type) and issubclass(v, base) and v is not base
        )
        raise AttributeError(f"{what} {path!r} has no class {cls_name!r} ({base.__name__} classes in it: {found})")
    return getattr(module, cls_name)


def import_module(module_path: str, label: str):
    """The importable module ``module_path``; ``label`` starts the error, which tells a missing module
    from a missing dependency of it."""
    try:
        return importlib.import_module(module_path)
    except ModuleNotFoundError as e:
        missing = e.name or ""
        if missing and (module_path == missing or module_path.startswith(missing + ".")):
            msg = f"{label}: no module named {module_path!r} (is the package installed / on sys.path?)"
        else:
            msg = f"{label}: module {module_path!r} needs {missing!r}, which is not installed ({e})"
        raise ModuleNotFoundError(msg, name=missing) from e
    except Exception as e:  # the module itself raised while being imported
        raise ImportError(
            f"{label}: module {module_path!r} failed while being imported: {type(e).__name__}: {e}"
        ) from e


def load_from_module(module_path: str, cls_name: str, label: str, noun: str = "class") -> type:
    """``cls_name`` from the importable module ``module_path``; ``label`` starts every error."""
    module = import_module(module_path, label)
    if not hasattr(module, cls_name):
        raise AttributeError(f"{label}: module {module_path!r} has no {noun} {cls_name!r}")
    return getattr(module, cls_name)


def public_name(cls: type) -> str:
    """``flowrl_rewards.Reward``, ``flowrl.RolloutPlan``: the top-level package and the class name."""
    return f"{cls.__module__.split('.')[0]}.{cls.__name__}"


def load_target(target: str, label: str, file_what: str, base: type | None = None) -> type:
    """The class behind ``"package.module:Class"`` or ``"path/file.py:Class"``, checked to subclass ``base``;
    with ``base`` None, whatever object the name holds (e.g. a function)."""
    noun = "Class" if base is not None else "function"
    module_path, _, cls_name = target.rpartition(":")
    if not module_path or not cls_name:
        raise ValueError(f"{label}: expected 'package.module:{noun}' or 'path/to/file.py:{noun}'")
    if is_file_target(module_path):
        cls = load_from_file(module_path, cls_name, file_what, base)
    else:
        cls = load_from_module(module_path, cls_name, label, noun.lower())
    if base is not None and not (isinstance(cls, type) and issubclass(cls, base)):
        raise TypeError(f"{label} resolves to {cls!r}, which is not a subclass of {public_name(base)}")
    return cls
