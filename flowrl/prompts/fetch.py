"""``flowrl data fetch NAME`` / ``flowrl data list``: the prompt sets the GPU presets name.

The SD3.5 / FLUX / SANA presets read ``dataset/<name>/train.txt`` and ``dataset/<name>/test.txt`` (one
prompt per line; relative paths resolve against the working directory, then the repository). This module
knows where each set comes from, downloads it (``huggingface_hub`` for Hugging Face dataset repos, which
honours ``HF_HOME`` / ``HF_HUB_CACHE`` / ``HF_TOKEN``; plain HTTPS for files that live in a GitHub
repository), turns it into prompt files, checks the prompt counts (and the sha256 of each produced file
where one is recorded) and only then writes the files, each replaced atomically.

Sets (``PROMPT_SETS``), each pinned to the source the reference implementations use:

- ``pickscore``: Pick-a-Pic v1 captions, the SFW subset Flow-GRPO recommends
  (``CarperAI/pickapic_v1_no_images_training_sfw``; Flow-GRPO's own ``dataset/pickscore`` is the unfiltered
  ``yuvalkirstain/pickapic_v1``). Whitespace collapsed, unique, at least 5 spaces (Flow-GRPO's SFW filter),
  sorted, shuffled with ``random.Random(0)``; the first 2,048 are ``test.txt`` (Flow-GRPO's test split
  has about as many), the rest ``train.txt``.
- ``hpdv2``: Human Preference Dataset v2 (``ymhao/HPDv2``), the prompts of the DanceGRPO / BranchGRPO /
  MixGRPO HPS recipes. ``test.txt``: the 400 prompts of ``test.json`` in file order; ``train.txt``: the
  unique prompts of ``train.json`` in first-seen order, minus the test prompts.
- ``geneval``: ``test.txt`` = GenEval's 553 evaluation prompts (``djghosh13/geneval``,
  ``prompts/evaluation_metadata.jsonl``); ``train.txt`` = Flow-GRPO's GenEval-style training prompts
  (``yifan123/flow_grpo``, ``dataset/geneval/train_metadata.jsonl``), minus any test prompt.
  ``{train,test}_metadata.jsonl`` beside them hold the metadata line of each prompt (same order) for the
  GenEval reward server.
- ``drawbench``: the 200 DrawBench prompts (``Jialuo21/DrawBench``, ``data/test-*.parquet``), ``test.txt``
  only: an eval set (``prompts.eval=dataset/drawbench/test.txt``).

Counts: exact where the source documents them (or the split fixes them), else a floor that catches a
truncated download. ``Output.sha256`` is verified when recorded; none is recorded yet (these sets were
defined without network access), so the first fetch prints each file's sha256 and writes it to
``manifest.json`` for recording here.

Offline (``--source FOLDER`` or ``$FLOWRL_DATA_SOURCE``): a local mirror laid out as
``FOLDER/<owner>/<repo>/<path in the repo>``; nothing is downloaded then. When a file cannot be had, the
command exits with status 2 and a message naming each file's URL and where to put it.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import posixpath
import urllib.request
from pathlib import Path
from typing import Callable

from flowrl.core.choices import choose
from flowrl.prompts.sets import (  # noqa: F401 (re-exported: the prompt sets are part of this module's API)
    DEFAULT_OUT,
    MANIFEST,
    PICKSCORE_MIN_SPACES,
    PICKSCORE_SEED,
    PICKSCORE_TEST,
    PROMPT_SETS,
    SOURCE_ENV,
    DataError,
    DataUnavailable,
    Output,
    PromptSet,
    Remote,
    clean_prompt,
    convert_drawbench,
    convert_geneval,
    convert_hpdv2,
    convert_pickscore,
    get_set,
    read_json_prompts,
    read_jsonl_records,
    read_parquet_column,
    unique,
    used_by,
)


# ---- getting the source files -------------------------------------------------------------------
class NoMatch(FileNotFoundError):
    """The hub answered, but no file of the repo matches a glob."""


def _cache_dir() -> Path:
    """Where GitHub-hosted source files are kept: ``$HF_HOME/flowrl-data`` (HF_HOME as huggingface_hub
    resolves it)."""
    from huggingface_hub import constants

    return Path(constants.HF_HOME) / "flowrl-data"


def _download_url(url: str, dest: Path) -> Path:
    """``url`` to ``dest`` through a temporary file (a failed download leaves nothing at ``dest``)."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.with_name(f".{dest.name}.part-{os.getpid()}")
    try:
        with urllib.request.urlopen(url, timeout=60) as response, open(tmp, "wb") as f:
            while chunk := response.read(1 << 20):
                f.write(chunk)
        os.replace(tmp, dest)
    finally:
        tmp.unlink(missing_ok=True)
    return dest


def _obtain(remote: Remote, source: Path | None) -> list[Path]:
    """Local paths of ``remote``: from the mirror ``source`` when given (nothing is downloaded then), else
    downloaded (``hf_hub_download`` / ``snapshot_download`` for a glob; HTTPS for GitHub). Raises OSError
    (or FileNotFoundError) when it cannot be had."""
    if source is not None:
        base = source / remote.repo
        paths = sorted(base.glob(remote.path)) if remote.is_glob else [base / remote.path]
        paths = [p for p in paths if p.is_file()]
        if not paths:
            raise FileNotFoundError(f"not in --source: no file {source / remote.mirror}")
        return paths
    choose("Remote.kind", remote.kind, ("hub", "github"), error=DataError)
    if remote.kind == "hub":
        import huggingface_hub

        if remote.is_glob:
            folder = Path(
                huggingface_hub.snapshot_download(
                    remote.repo, repo_type="dataset", revision=remote.revision, allow_patterns=[remote.path]
                )
            )
            paths = sorted(p for p in folder.glob(remote.path) if p.is_file())
            if not paths:
                raise NoMatch(f"{remote.repo} @ {remote.revision} has no file matching {remote.path!r}")
            return paths
        return [
            Path(
                huggingface_hub.hf_hub_download(remote.repo, remote.path, repo_type="dataset", revision=remote.revision)
            )
        ]
    return [_download_url(remote.url, _cache_dir() / "github" / remote.repo / remote.revision / remote.path)]


def _is_http_answer(error: OSError) -> bool:
    """The server answered (HTTP 404, a gated repo, ...): the network itself works."""
    import urllib.error

    from huggingface_hub.errors import HfHubHTTPError

    return isinstance(error, (HfHubHTTPError, urllib.error.HTTPError, NoMatch))


def unavailable_message(spec: PromptSet, failures: dict[str, str], out: Path, source: Path | None) -> str:
    """What to download from where and where to put it, for each source file of ``spec``."""
    folder = str(source) if source is not None else "FOLDER"
    lines = [
        f"could not get the source files of prompt set {spec.name!r}"
        + (f" from --source {source}" if source is not None else " (no network, or the hub unreachable?)")
        + ":"
    ]
    for key, remote in spec.remotes.items():
        status = f"  (failed: {failures[key]})" if key in failures else "  (ok)"
        lines.append(f"  - {remote.label()}{status}")
        if remote.is_glob:
            lines.append(f"      download the file matching {posixpath.basename(remote.path)} from {remote.url}")
            lines.append(f"      put it in {folder}/{remote.repo}/{posixpath.dirname(remote.path)}/")
        else:
            lines.append(f"      download {remote.url}")
            lines.append(f"      put it at {folder}/{remote.mirror}")
    lines.append(
        f"then run: flowrl data fetch {spec.name} --source {folder}"
        + (f" --out {out}" if str(out) != DEFAULT_OUT else "")
        + f"   (or set {SOURCE_ENV}={folder})"
    )
    lines.append(
        f"or fetch on a machine with network access and copy {out}/{spec.name}/ "
        f"({', '.join(o.file for o in spec.outputs)}) here"
    )
    return "\n".join(lines)


# ---- producing and checking the files -----------------------------------------------------------
def render(lines: list[str]) -> bytes:
    """A prompt file's bytes: UTF-8, one line each, ending with a newline."""
    return "".join(line + "\n" for line in lines).encode("utf-8")


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def check_output(spec: PromptSet, output: Output, lines: int, digest: str, where: str) -> None:
    """``lines`` and ``digest`` of ``output`` against its expected count and sha256; else a DataError
    naming the file, what it holds and what is accepted."""
    if output.count is not None and lines != output.count:
        raise DataError(
            f"{where}: {lines:,} lines, expected exactly {output.count:,} for prompt set "
            f"{spec.name!r} (sources: {'; '.join(r.label() for r in spec.remotes.values())})"
        )
    if output.count is None and lines < output.min_count:
        raise DataError(
            f"{where}: {lines:,} lines, expected at least {output.min_count:,} for prompt set "
            f"{spec.name!r}: a truncated or wrong source file?"
        )
    if output.sha256 is not None and digest != output.sha256:
        raise DataError(
            f"{where}: sha256 {digest}, expected {output.sha256} for prompt set {spec.name!r}: "
            "the source changed since the checksum was recorded"
        )


def present(spec: PromptSet, target: Path) -> dict[str, tuple[int, str] | None]:
    """``{file: (lines, sha256) or None if missing}`` for ``spec``'s outputs under ``target``."""
    out: dict[str, tuple[int, str] | None] = {}
    for o in spec.outputs:
        path = target / o.file
        if path.is_file():
            data = path.read_bytes()
            out[o.file] = (data.count(b"\n") + (0 if not data or data.endswith(b"\n") else 1), sha256(data))
        else:
            out[o.file] = None
    return out


def up_to_date(spec: PromptSet, target: Path) -> bool:
    """Every output of ``spec`` exists under ``target`` and passes its count and checksum."""
    found = present(spec, target)
    try:
        for o in spec.outputs:
            if found[o.file] is None:
                return False
            check_output(spec, o, *found[o.file], where=str(target / o.file))
    except DataError:
        return False
    return True


def write_atomic(target: Path, files: dict[str, bytes]) -> None:
    """Write every file of ``files`` under ``target``: each is written in full to a temporary file beside
    it and fsynced before any is moved into place (``os.replace``, atomic per file), so a failure while
    writing leaves the previous files (or none) and no temporary file."""
    target.mkdir(parents=True, exist_ok=True)
    staged: list[tuple[Path, Path]] = []
    try:
        for name, data in files.items():
            final = target / name
            tmp = final.with_name(f".{final.name}.tmp-{os.getpid()}")
            staged.append((tmp, final))
            with open(tmp, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
        for tmp, final in staged:
            os.replace(tmp, final)
    finally:
        for tmp, _ in staged:
            tmp.unlink(missing_ok=True)


def fetch(
    name: str,
    out: str | Path = DEFAULT_OUT,
    source: str | Path | None = None,
    force: bool = False,
    log: Callable[[str], None] = print,
) -> dict[str, dict]:
    """Produce prompt set ``name`` under ``out/<name>/``; returns ``{file: {"lines", "sha256", "path"}}``.

    Skips the download when every file is already there and passes its checks (``force``: fetch anyway).
    Raises DataUnavailable (source files not to be had: the message says what to put where) or DataError
    (a count or checksum that does not match; nothing is written then)."""
    spec = get_set(name)
    out = Path(out)
    target = out / spec.name
    if not force and up_to_date(spec, target):
        found = present(spec, target)
        log(
            f"{spec.name}: up to date in {target} ({', '.join(f'{f} {n:,}' for f, (n, _) in found.items())}); "
            "--force fetches again"
        )
        return {f: {"lines": n, "sha256": d, "path": str(target / f)} for f, (n, d) in found.items()}
    missing = [m for m in spec.needs if importlib.util.find_spec(m) is None]
    if missing:
        raise DataError(f"prompt set {spec.name!r} needs {missing}: pip install {' '.join(missing)}")
    source = Path(source) if source else None
    files: dict[str, list[Path]] = {}
    failures: dict[str, str] = {}
    offline = False
    for key, remote in spec.remotes.items():
        if offline:  # the network failed for an earlier file: do not wait for its retries again
            failures[key] = "not tried: the network failed for the file above"
            continue
        log(f"{spec.name}: {'reading' if source else 'fetching'} {remote.label()}")
        try:
            files[key] = _obtain(remote, source)
        except OSError as e:  # offline, hub errors (LocalEntryNotFound, HTTP 404, gated), URLError, no file
            failures[key] = f"{type(e).__name__}: {' '.join(str(e).split())[:300]}"
            offline = source is None and not _is_http_answer(e)
    if failures:
        raise DataUnavailable(unavailable_message(spec, failures, out, source))
    produced = spec.convert(files)
    data = {o.file: render(produced[o.file]) for o in spec.outputs}
    result = {}
    for o in spec.outputs:  # every check before any file is written
        lines, digest = len(produced[o.file]), sha256(data[o.file])
        check_output(spec, o, lines, digest, where=str(target / o.file))
        result[o.file] = {"lines": lines, "sha256": digest, "path": str(target / o.file)}
    manifest = {
        "name": spec.name,
        "description": spec.description,
        "sources": [
            {
                "kind": r.kind,
                "repo": r.repo,
                "path": r.path,
                "revision": r.revision,
                "url": r.url,
                "files": [p.name for p in files[k]],
            }
            for k, r in spec.remotes.items()
        ],
        "from": f"mirror {source}" if source else "network",
        "files": {f: {"lines": v["lines"], "sha256": v["sha256"]} for f, v in result.items()},
    }
    data[MANIFEST] = (json.dumps(manifest, indent=2) + "\n").encode("utf-8")
    write_atomic(target, data)
    for o in spec.outputs:
        r = result[o.file]
        note = "" if o.sha256 else "  (no checksum recorded: record this one in flowrl/prompts/fetch.py)"
        log(f"wrote {r['path']}: {r['lines']:,} lines, sha256 {r['sha256']}{note}")
    return result


# ---- command line -------------------------------------------------------------------------------
def list_sets(out: str | Path = DEFAULT_OUT) -> str:
    """A description of every prompt set: sources, files with expected counts, what is present under
    ``out``, and the presets that use it."""
    blocks = []
    for spec in PROMPT_SETS.values():
        found = present(spec, Path(out) / spec.name)
        lines = [f"{spec.name}: {spec.description}"]
        lines += [f"  source: {r.label()}" for r in spec.remotes.values()]
        for o in spec.outputs:
            expected = f"{o.count:,}" if o.count is not None else f">= {o.min_count:,}"
            have = "missing" if found[o.file] is None else f"present, {found[o.file][0]:,} lines"
            lines.append(f"  {Path(out) / spec.name / o.file}: {expected} lines; {have}")
        users = used_by(spec)
        lines.append(f"  used by: {', '.join(users) if users else '(no shipped preset; name it in prompts.*)'}")
        blocks.append("\n".join(lines))
    return "\n\n".join(blocks)
