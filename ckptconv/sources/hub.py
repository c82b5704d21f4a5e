"""Hugging Face Hub ids (``org/name``) wherever an HF model directory is taken, and pushing an export.

:func:`resolve_hf` turns a SRC into a local directory: an existing path always wins; otherwise an
``org/name`` id is looked up in the Hugging Face cache first (``HF_HUB_CACHE``, or ``HF_HOME/hub``),
and downloaded with ``huggingface_hub``'s own progress bars only when it is not cached and the
network is allowed (``HF_HUB_OFFLINE`` unset). :func:`push` uploads an export with ``HfApi``.

    >>> is_hub_id("meta-llama/Llama-3.1-8B"), is_hub_id("./llama-hf"), is_hub_id("llama-hf")
    (True, False, False)
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ckptconv.core.hub_id import is_hub_id
from ckptconv.errors import ConversionError
from ckptconv.io.hf import SIDE_FILES

# What a conversion reads from a model repository: config, index and tokenizer JSON, safetensors
# weights, and the non-JSON tokenizer files ckptconv carries along. Other weight copies
# (pytorch_model*.bin, original/*.pth) are not downloaded.
DOWNLOAD_PATTERNS = ("*.json", "*.safetensors", *(name for name in SIDE_FILES if not name.endswith(".json")))



def cache_dir() -> str:
    """The Hugging Face cache ``huggingface_hub`` reads (``HF_HUB_CACHE``, else ``HF_HOME/hub``)."""
    from huggingface_hub import constants

    return str(constants.HF_HUB_CACHE)


def resolve_hf(src: str | Path, *, revision: str | None = None, quiet: bool = False, flag: str = "SRC") -> Path:
    """A local directory for ``src``: the path itself if it exists, else the snapshot of hub id ``src``.

    A path that does not exist and is not an ``org/name`` id is returned unchanged, so the caller's
    own "no such file" error names it. ``revision`` (a branch, tag or commit) is for hub ids only.
    """
    path = Path(src)
    if path.exists():
        if revision is not None:
            raise ConversionError(f"--revision {revision}: {flag} {src} is a local path; --revision is for hub ids (org/name)")
        return path
    if not is_hub_id(str(src)):
        return path
    return Path(_snapshot(str(src), revision, quiet=quiet, flag=flag))


def _snapshot(repo_id: str, revision: str | None, *, quiet: bool, flag: str) -> str:
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError
    from huggingface_hub.utils import disable_progress_bars, enable_progress_bars

    rev = revision or "main"
    where = (f"{flag} {repo_id}: no such local path, and hub model {repo_id!r} (revision {rev}) "
             f"is not in the Hugging Face cache {cache_dir()}")
    try:
        return snapshot_download(repo_id, revision=revision, local_files_only=True, allow_patterns=list(DOWNLOAD_PATTERNS))
    except LocalEntryNotFoundError:
        pass
    if constants.HF_HUB_OFFLINE:
        raise ConversionError(f"{where}; HF_HUB_OFFLINE is set, so nothing was downloaded")
    if quiet:
        disable_progress_bars()
    try:
        return snapshot_download(repo_id, revision=revision, allow_patterns=list(DOWNLOAD_PATTERNS))
    except Exception as exc:  # network, authentication, missing repo or revision: one line either way
        reason = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise ConversionError(f"{where}, and the download failed: {reason}") from None
    finally:
        if quiet:
            enable_progress_bars()


def push(folder: str | Path, repo_id: str, *, private: bool = False, revision: str | None = None) -> dict[str, Any]:
    """Create ``repo_id`` if needed and upload ``folder`` (an HF export) to it; what was pushed.

    Hidden entries (a conversion's temporary directory, lock files) are not uploaded.
    """
    if not is_hub_id(repo_id):
        raise ConversionError(f"--push-to-hub {repo_id!r}: expected a hub id org/name")
    folder = Path(folder)
    files = sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*")
                   if p.is_file() and not any(part.startswith(".") for part in p.relative_to(folder).parts))
    from huggingface_hub import HfApi

    api = HfApi()
    try:
        repo = api.create_repo(repo_id, private=private, repo_type="model", exist_ok=True)
        commit = api.upload_folder(repo_id=repo_id, folder_path=str(folder), repo_type="model", revision=revision,
                                   commit_message=f"Upload {folder.name} (ckptconv to-hf)", ignore_patterns=[".*"])
    except Exception as exc:  # network or authentication: one line, naming what was being done
        reason = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise ConversionError(f"--push-to-hub {repo_id}: upload of {folder} failed: {reason}") from None
    return {"repo": repo_id, "url": str(repo), "private": private, "revision": revision or "main",
            "commit": getattr(commit, "oid", None), "commit_url": getattr(commit, "commit_url", None), "files": files}
