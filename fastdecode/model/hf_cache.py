"""Models named as Hugging Face repos (`-m meta-llama/Meta-Llama-3-8B-Instruct`): found in the
local Hugging Face cache, never downloaded.

The cache is the one `hf download` and transformers fill: `$HF_HUB_CACHE`, else `$HF_HOME/hub`,
else `~/.cache/huggingface/hub`, read when a model is resolved (so a job's environment decides).
huggingface_hub resolves the revision offline (a branch or tag through `refs/`, a full commit
hash through `snapshots/`); a model or revision not there is an error that says how to get it.
"""
from __future__ import annotations

import os
import re
import shlex

from fastdecode.model.config import ConfigError

# an HF repo id: one `/` between an owner and a name of letters, digits, `-`, `_`, `.`
_REPO_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9][A-Za-z0-9_.-]*$")


def looks_like_repo_id(name: str) -> bool:
    return bool(_REPO_ID.match(name)) and ".." not in name and not name.endswith((".gguf", ".json"))


def hub_cache_dir() -> str:
    """Where the HF cache is, by huggingface_hub's own variables, as the environment says now."""
    explicit = os.environ.get("HF_HUB_CACHE") or os.environ.get("HUGGINGFACE_HUB_CACHE")
    if explicit:
        return os.path.expanduser(explicit)
    home = os.environ.get("HF_HOME") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "huggingface")
    return os.path.join(os.path.expanduser(home), "hub")


def cached_snapshot(repo_id: str, revision: str | None = None) -> str:
    """The snapshot directory of `repo_id` at `revision` (default: main) in the local cache;
    ConfigError saying how to get it where it is not there."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError
    cache = hub_cache_dir()
    try:
        return snapshot_download(repo_id, revision=revision, cache_dir=cache, local_files_only=True)
    except (LocalEntryNotFoundError, FileNotFoundError):
        raise ConfigError(_missing_message(repo_id, revision, cache)) from None


def _missing_message(repo_id: str, revision: str | None, cache: str) -> str:
    held = cached_revisions(repo_id, cache)
    rev = f" --revision {shlex.quote(revision)}" if revision else ""
    where = f"at revision {revision!r} " if revision else ""
    found = f" (it holds {', '.join(held)})" if held else ""
    local_dir = f"./{repo_id.split('/')[1]}"
    return (f"model {repo_id!r} is not in the local Hugging Face cache {where}({cache}{found}); fastdecode never "
            f"downloads at run time: get it first with `hf download {repo_id}{rev}` (into that cache), or "
            f"`hf download {repo_id}{rev} --local-dir {local_dir}` and pass -m {local_dir} "
            f"--served-model-name {repo_id}; HF_HUB_CACHE or HF_HOME point at another cache")


def cached_revisions(repo_id: str, cache: str) -> list[str]:
    """The revisions the cache holds of a repo, as `ref (commit)` or the commit alone (error
    messages only: scanning the cache reads every repo in it)."""
    from huggingface_hub import scan_cache_dir
    from huggingface_hub.errors import CacheNotFound
    try:
        info = scan_cache_dir(cache)
    except (CacheNotFound, OSError):
        return []
    out = []
    for repo in info.repos:
        if repo.repo_id == repo_id and repo.repo_type == "model":
            for r in sorted(repo.revisions, key=lambda r: r.commit_hash):
                refs = ", ".join(sorted(r.refs))
                out.append(f"{refs} ({r.commit_hash[:12]})" if refs else r.commit_hash[:12])
    return out
