"""The names a job serves its model under, and the check of a request's `model` against them.

vLLM answers a request naming a model it does not serve with a 404 `NotFoundError`; a batch file
written for one model and run against another would otherwise get answers from the wrong model,
silently. A request may name the model:
  - by a name given with --served-model-name (vLLM's flag; the first one is what responses report),
  - by `-m` as given (an embedded name such as `smollm2-135m`, a path, an HF repo id found in the
    local HF cache, a `random:` spec), or that path normalized or made absolute,
  - by a name derived from the path: an HF directory's name (`Llama-2-7b-hf`) and its parent and
    name (`meta-llama/Llama-2-7b-hf`, the repo id where the files were laid out as org/name, or
    where they sit in the HF cache as models--org--name/snapshots/<rev>; a model named by its repo
    id: the snapshot directory it was found in), a GGUF file's name with
    and without `.gguf` (an embedded model's file too),
or name none at all (served).
"""
from __future__ import annotations

import os
from dataclasses import dataclass

from fastdecode.model.source import EMBEDDED_MODELS, ModelSource


@dataclass(frozen=True, slots=True)
class ServedModel:
    reported: str                   # the `model` of every response: the first served name, else `-m`
    names: tuple[str, ...]          # what the job says it serves: --served-model-name, else `-m`
    accepted: frozenset[str]        # every name a request may give (names, -m and its derived names)

    def mismatch(self, requested: str | None) -> str | None:
        """None if a request naming `requested` is served here; else the 404's message."""
        if requested is None or requested in self.accepted:
            return None
        also = sorted(self.accepted - set(self.names))
        return (f"The model `{requested}` does not exist: this job serves {_listed(self.names)}"
                + (f" (also named {_listed(also)})" if also else "") + ". Name one of these, or no model, "
                "or rerun with --served-model-name")

    def describe(self) -> str:
        """One line for the job's start: what it serves and what requests may call it."""
        also = sorted(self.accepted - set(self.names))
        return f"serving {_listed(self.names)}" + (f"; requests may also name {_listed(also)}" if also else "")


def _listed(names) -> str:
    return ", ".join(f"`{n}`" for n in names)


def derived_names(source: ModelSource) -> set[str]:
    """Names a request may use for the model beyond `-m` as given (see the module's docstring)."""
    names = {source.name}
    if source.kind == "random":
        return names
    if source.repo_id is not None:                              # org/name from the HF cache: also its snapshot
        return names | {source.repo_id, os.path.normpath(os.path.abspath(source.path))}
    if source.name not in EMBEDDED_MODELS:                    # a path: also as normalized, and absolute
        given = os.path.expanduser(source.name)
        names |= {os.path.normpath(given), os.path.abspath(given)}
    path = os.path.normpath(os.path.abspath(source.path))
    base = os.path.basename(path)
    if source.kind == "gguf":
        names |= {base, base.removesuffix(".gguf")}
        return names
    parent = os.path.dirname(path)
    names |= {base, f"{os.path.basename(parent)}/{base}"}
    cache_dir = os.path.basename(os.path.dirname(parent))        # models--org--name/snapshots/<rev>
    if os.path.basename(parent) == "snapshots" and cache_dir.startswith("models--"):
        names.add(cache_dir[len("models--"):].replace("--", "/"))
    return {n for n in names if n and n != "/"}


def served_model(source: ModelSource, served_names: str | list[str] | tuple[str, ...] | None = None) -> ServedModel:
    """The ServedModel of a job; served_names is --served-model-name (vLLM's EngineArgs field:
    one name or several)."""
    if isinstance(served_names, str):
        served_names = [served_names]
    aliases = list(dict.fromkeys(served_names or ()))          # in order, once each
    bad = [n for n in aliases if not isinstance(n, str) or not n.strip()]
    if bad:
        raise ValueError(f"served model names must be non-empty strings, got {bad[0]!r}")
    names = tuple(aliases) or (source.name,)
    return ServedModel(reported=names[0], names=names, accepted=frozenset(names) | derived_names(source))
