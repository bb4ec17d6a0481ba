"""Models named as Hugging Face repos (`-m meta-llama/Meta-Llama-3-8B-Instruct`): found in the
local Hugging Face cache, never downloaded.

The cache is the one `hf download` and transformers fill: `$HF_HUB_CACHE`, else `$HF_HOME/hub`,
else `~/.cache/huggingface/hub`, read when a model is resolved (so a job's environment decides).
A revision resolves offline, as huggingface_hub lays the cache out (a branch or tag through the
commit hash its `refs/` file holds, a full commit hash directly), and only to a directory under
the repo's `snapshots/`; a model or revision not there is an error that says how to get it.
"""
from __future__ import annotations

import os
import re
import shlex
import stat

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
    ConfigError saying how to get it where it is not there. A revision is a full commit hash or a
    ref (branch, tag) under the repo's `refs/`, whose file holds a commit hash; either names a
    directory under its `snapshots/`, never a path elsewhere (a `../` revision, or a ref file that
    is a device, a link out of `refs/` or holds a path, is refused naming it)."""
    from huggingface_hub.file_download import repo_folder_name
    cache = hub_cache_dir()
    repo_dir = os.path.join(cache, repo_folder_name(repo_id=repo_id, repo_type="model"))
    rev = revision or "main"
    commit = rev if _COMMIT.match(rev) else _ref_commit(repo_dir, rev)
    snapshot = os.path.join(repo_dir, "snapshots", commit) if commit else None
    if snapshot is None or not os.path.isdir(snapshot):
        raise ConfigError(_missing_message(repo_id, revision, cache))
    return snapshot


_COMMIT = re.compile(r"^[0-9a-f]{40}$")
_REF_BYTES = 256              # a ref file holds a 40-character commit hash (and perhaps a newline)


def _ref_commit(repo_dir: str, ref: str) -> str | None:
    """The commit hash a ref's file holds; None where the repo has no such ref."""
    parts = ref.split("/")
    if ref.startswith("/") or "\\" in ref or "\0" in ref or any(p in ("", ".", "..") for p in parts):
        raise ConfigError(f"--revision {ref!r} is not a branch, tag or commit: a revision names a ref under the "
                          f"cache's refs/ or a full commit hash, never a path")
    refs = os.path.join(repo_dir, "refs")
    path = os.path.join(refs, *parts)
    if not os.path.lexists(path):
        return None
    real_refs = os.path.realpath(refs)
    if not os.path.realpath(path).startswith(real_refs + os.sep) or not stat.S_ISREG(os.stat(path).st_mode):
        raise ConfigError(f"the Hugging Face cache's ref file {path} is not a file inside {refs}: a ref holds a "
                          f"commit hash; remove it, or `hf download` the revision again")
    with open(path, "rb") as f:
        held = f.read(_REF_BYTES).decode("ascii", "replace").strip()
    if not _COMMIT.match(held):
        raise ConfigError(f"the Hugging Face cache's ref file {path} holds {held[:60]!r}, not a commit hash: "
                          f"a ref names a snapshot of the repo; remove it, or `hf download` the revision again")
    return held


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
