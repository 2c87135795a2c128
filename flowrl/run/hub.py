"""Upload an export folder (its weights, model card, config and after-grid: :mod:`flowrl.run.model_card`) to a Hugging
Face Hub model repo with ``huggingface_hub`` (docs/sharing.md): the repo created when missing (``private`` then), the
branch ``revision`` created from ``main`` when missing, every file in one commit (the card's metadata is checked by the
Hub before any weight is sent).

The token is huggingface_hub's own: ``HF_TOKEN``, else the login's (``hf auth login``); it is sent to the Hub in the
request headers only, never written or printed. ``HF_ENDPOINT`` names another Hub (a local stand-in in the tests).
Every failure — no token, a repo the token may not write (401/403), a refused card, the network — is one
:class:`HubError` line; the local folder is never changed.
"""

from __future__ import annotations

from pathlib import Path

from flowrl.run.outputs import MARKER

SKIPPED = (MARKER,)
"""Files of an export folder that are not uploaded (the marker says which flowrl command wrote the folder, and when)."""


class HubError(Exception):
    """A push that failed, in one line (no token in it)."""


def hub_token() -> str | None:
    """The token huggingface_hub resolves (``HF_TOKEN``, else the saved login), or None."""
    from huggingface_hub import get_token

    return get_token()


def check_repo_id(repo_id: str, key: str) -> None:
    """``repo_id`` is a repo id the Hub accepts, with its namespace (``owner/name``: the card's loading code names it
    whole), else a ConfigError naming ``key``."""
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id

    from flowrl.errors import ConfigError

    try:
        if not isinstance(repo_id, str) or repo_id.count("/") != 1:
            raise HFValidationError("it must be a namespace and a name, `owner/name`")
        validate_repo_id(repo_id)
    except HFValidationError as e:
        raise ConfigError(
            f"{key}={repo_id!r} is not a Hub repo id ({str(e).splitlines()[0]}); accepted: owner/name, e.g. "
            "your-name/sd35-flow-grpo"
        ) from None


def require_token(what: str) -> str:
    """The token, else a :class:`HubError` saying how to give one (``what``: what needs it)."""
    token = hub_token()
    if not token:
        raise HubError(f"{what} needs a Hugging Face token: set HF_TOKEN or run `hf auth login`")
    return token


def files_to_push(folder: Path) -> list[Path]:
    """The files of export ``folder`` that a push uploads (relative paths, sorted; :data:`SKIPPED` left out)."""
    folder = Path(folder)
    return sorted(
        p.relative_to(folder)
        for p in folder.rglob("*")
        if p.is_file() and p.name not in SKIPPED and ".git" not in p.parts
    )


def push_folder(folder: Path, repo_id: str, *, private: bool = False, revision: str | None = None) -> str:
    """Upload export ``folder`` to model repo ``repo_id`` (created when missing: private with ``private``, else with the
    namespace's default visibility; an existing repo keeps its own) on branch ``revision`` (default ``main``; created
    from ``main`` when missing), all files in one commit. The URL of the repo (at ``revision``); a :class:`HubError`
    line on any failure."""
    from huggingface_hub import CommitOperationAdd, HfApi

    token = require_token(f"pushing to {repo_id}")
    api = HfApi(token=token)  # its endpoint: huggingface_hub's (HF_ENDPOINT, else the Hub)
    files = files_to_push(folder)
    try:
        # not private: the Hub's default for the namespace (an organisation may make new repos private)
        api.create_repo(repo_id, private=True if private else None, exist_ok=True, repo_type="model")
        if revision and revision != "main":
            api.create_branch(repo_id, branch=revision, exist_ok=True, repo_type="model")
        operations = [
            CommitOperationAdd(path_in_repo=p.as_posix(), path_or_fileobj=str(Path(folder) / p)) for p in files
        ]
        api.create_commit(
            repo_id,
            operations,
            commit_message="flowrl export: weights and model card",
            revision=revision,
            repo_type="model",
        )
    except Exception as e:  # noqa: BLE001 — every failure is one line
        raise HubError(_scrub(_describe(e, repo_id, api.endpoint), token)) from None
    where = f"{api.endpoint}/{repo_id}"
    return where if not revision or revision == "main" else f"{where}/tree/{revision}"


def _describe(e: Exception, repo_id: str, endpoint: str) -> str:
    """One line for a failed push: the HTTP status and the Hub's own message, a refused card, or the network."""
    from huggingface_hub.errors import HfHubHTTPError, OfflineModeIsEnabled

    if isinstance(e, OfflineModeIsEnabled):
        return "HF_HUB_OFFLINE is set: nothing was sent to the Hub"
    if isinstance(e, HfHubHTTPError):
        status = getattr(e.response, "status_code", None)
        said = (getattr(e, "server_message", None) or str(e)).strip().splitlines()
        said = said[0] if said else ""
        if status == 401:
            return f"the Hub refused the token (401 Unauthorized): {said}".rstrip(": ")
        if status == 403:
            return (
                f"the token may not write to {repo_id} (403 Forbidden): the repo belongs to someone else or the token "
                f"lacks write access; {said}"
            ).rstrip("; ")
        return f"the Hub answered {status} for {repo_id}: {said}".rstrip(": ")
    if isinstance(e, ValueError) and "metadata" in str(e):
        return "the Hub refused the model card's metadata: " + " ".join(str(e).split())
    network = type(e).__module__.split(".")[0] in ("httpx", "httpx2", "requests", "urllib3", "h11", "ssl")
    if network or isinstance(e, (ConnectionError, TimeoutError, OSError)):
        return f"could not reach the Hub at {endpoint} ({type(e).__name__}: {' '.join(str(e).split()) or 'no answer'})"
    return f"{type(e).__name__}: {' '.join(str(e).split())}"


def _scrub(text: str, token: str | None) -> str:
    """``text`` with the token, were it ever in it, replaced."""
    return text.replace(token, "<token>") if token else text
