"""`--hf-checkpoint ORG/NAME`: a Hub id resolved from the local Hugging Face cache, offline.

Runs read models from where users keep them: a directory, or a Hub id whose snapshot is in the
cache (`HF_HUB_CACHE`, or `HF_HOME/hub`, default `~/.cache/huggingface/hub`). Nothing is
downloaded at start-up -- a cluster node often has no network, and a download racing on every
rank is worse than none -- so an id that is not cached is refused with the command that fetches it.
"""

from __future__ import annotations

import os
import re

# A Hub model id: "name" or "org/name" (letters, digits, "-", "_", "."), as the Hub validates it.
_HUB_ID_RE = re.compile(r"[A-Za-z0-9][\w.-]{0,95}(/[A-Za-z0-9][\w.-]{0,95})?")


class ModelNotFound(ValueError):
    """`--hf-checkpoint` names neither a local directory nor a cached Hub model; one line with the fix."""


def looks_like_hub_id(spec: str) -> bool:
    return bool(_HUB_ID_RE.fullmatch(spec)) and not spec.startswith((".", "~")) and ".." not in spec


def resolve_hub_id(repo_id: str, *, revision: str | None = None) -> str:
    """The cached snapshot directory of `repo_id`; ModelNotFound when it is not cached (or is incomplete)."""
    try:
        from huggingface_hub import constants, snapshot_download
        from huggingface_hub.errors import LocalEntryNotFoundError
    except ImportError:
        raise ModelNotFound(
            f"--hf-checkpoint {repo_id!r} is not a local directory, and resolving it as a Hub id needs "
            "huggingface_hub (pip install huggingface_hub); or pass the model's directory"
        ) from None
    download = f"hf download {repo_id}" + (f" --revision {revision}" if revision else "")
    try:
        path = snapshot_download(repo_id, revision=revision, local_files_only=True)
    except LocalEntryNotFoundError:
        raise ModelNotFound(
            f"--hf-checkpoint {repo_id!r} is not a local directory, and the Hub model {repo_id} is not in the "
            f"Hugging Face cache ({constants.HF_HUB_CACHE}); download it first with `{download}` "
            "(or set HF_HUB_CACHE to the cache that has it, or pass the model's directory)"
        ) from None
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise ModelNotFound(
            f"--hf-checkpoint {repo_id!r}: the cached snapshot {path} has no config.json (an interrupted "
            f"download?); run `{download}` again"
        )
    return path
