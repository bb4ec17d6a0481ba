"""vLLM's engine arguments that are not fastdecode's own, in one table for the Python API
(`LLM(**kwargs)`) and the command line (`--flag-name`).

A row either sets an EngineArgs field (`target`, its value through `convert`: `max_num_seqs` is
the max batch), or has no meaning here: then the values in `noop` (vLLM's defaults, which change
nothing) are accepted and ignored, and any other value is refused with one message naming the
argument and `why`. When a feature lands, its row gets a target (or the EngineArgs field takes the
vLLM name and the row goes). Arguments that are EngineArgs fields already under vLLM's name
(`max_model_len`, `tokenizer`, `revision`, `served_model_name`, ...) need no row.
"""
from __future__ import annotations

import difflib
from collections.abc import Callable
from dataclasses import dataclass

_ANY = object()            # noop: every value is a no-op


@dataclass(frozen=True, slots=True)
class VllmArg:
    name: str                               # vLLM's keyword argument; the flag is --name-with-dashes
    target: str | None = None               # the EngineArgs field it sets; None: no meaning here
    convert: Callable[[object], object] | None = None    # vLLM's value -> the field's (ValueError if none)
    noop: tuple = ()                        # values accepted and ignored (no target)
    why: str = ""                           # why other values are refused
    flag: type | None = None                # a generate/profile flag of this type (bool: a switch); None: API only

    @property
    def option(self) -> str:
        return "--" + self.name.replace("_", "-")


def _dtype(value) -> str:
    names = {"auto": "auto", "float32": "float32", "float": "float32", "bfloat16": "bfloat16",
             "float16": "float16", "half": "float16"}
    key = str(value).removeprefix("torch.")
    if key not in names:
        raise ValueError(f"dtype must be one of {', '.join(names)} (or a torch dtype of those), got {value!r}")
    return names[key]


def _kv_cache_dtype(value) -> str:
    from rworker.protocol.kvformat import fp8_kv_refusal
    names = {"auto": "auto", "bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}
    refused = fp8_kv_refusal(value)
    if refused:
        raise ValueError(f"kv_cache_dtype {value!r} is not supported by fastdecode: {refused}")
    if value not in names:
        raise ValueError(f"kv_cache_dtype {value!r} is not supported by fastdecode: it stores KV as "
                         f"{', '.join(names)} or kv_dtype='int8' (per-token scales, about fp8's bytes)")
    return names[value]


def _enforce_eager(value) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"enforce_eager must be a bool, got {value!r}")
    return value                  # True: no compiled CPU S-part, no CUDA graphs (those are off unless asked)


ROWS = (
    VllmArg("max_num_seqs", "max_batch"),
    VllmArg("enable_prefix_caching", "prefix_sharing", convert=bool),
    VllmArg("dtype", "dtype", convert=_dtype),
    VllmArg("kv_cache_dtype", "kv_dtype", convert=_kv_cache_dtype),
    VllmArg("seed", "seed", convert=lambda v: 0 if v is None else v),
    VllmArg("enforce_eager", "enforce_eager", convert=_enforce_eager, flag=bool),
    VllmArg("trust_remote_code", noop=(False,), flag=bool,
            why="fastdecode runs its own implementation of each model family (docs/models.md), never code "
                "shipped with a model"),
    VllmArg("pipeline_parallel_size", noop=(1,), flag=int,
            why="the S-worker runs every layer; fastdecode pipelines mini-batches between the S-worker and "
                "the R-workers instead (pipeline_depth, --pipeline-depth)"),
    VllmArg("data_parallel_size", noop=(1,),
            why="the Python API serves one S-worker group; `fastdecode generate --data-parallel-size D` serves one "
                "input file with D groups (docs/usage.md)"),
    VllmArg("tokenizer_mode", noop=("auto",), why="the tokenizer is the one transformers' AutoTokenizer picks"),
    VllmArg("skip_tokenizer_init", noop=(False,), why="prompts are tokenized and outputs detokenized on rank 0"),
    VllmArg("swap_space", noop=(4,), why="preempted sequences are recomputed, never swapped (kv_reserve='grow')"),
    VllmArg("cpu_offload_gb", noop=(0,), why="the weights stay on the S-worker's device"),
    VllmArg("download_dir", noop=(None,),
            why="fastdecode never downloads: a model is a directory, a .gguf file or an org/name in the local "
                "Hugging Face cache (HF_HUB_CACHE)"),
    VllmArg("load_format", noop=("auto",), why="weights load from safetensors or GGUF, as found"),
    VllmArg("disable_log_stats", noop=_ANY),
)
BY_NAME = {row.name: row for row in ROWS}

# vLLM flags without a counterpart of the same syntax -> the fastdecode flag with their meaning
# (a "did you mean" names it rather than a flag spelled alike: --max-num-seqs is not --max-n)
MEANINGS = {
    "--kv-cache-dtype": "--kv-dtype",                        # KV element type (fastdecode's values differ)
    "--enable-chunked-prefill": "--max-num-batched-tokens",  # chunked prefill is on when a budget is given
    "--preemption-mode": "--kv-reserve",                     # grow: preempt and recompute, as vLLM does
    "--disable-log-stats": "--quiet",                        # no periodic progress lines
}


def refusal(row: VllmArg, value, as_flag: bool = False) -> str | None:
    """None if `value` is a no-op of a row without target; else the message refusing it."""
    if row.noop is _ANY or any(_same(value, v) for v in row.noop):
        return None
    if as_flag:
        given = row.option if value is True else f"{row.option} {value}"
    else:
        given = f"{row.name}={value!r}"
    return f"{given} is not supported by fastdecode: {row.why}"


def _same(a, b) -> bool:
    """Equal values of one kind: 1 is 1.0, but False is not 0 and None is only None."""
    if a is None or b is None or isinstance(a, bool) or isinstance(b, bool):
        return a is b
    return a == b


def engine_kwargs(kwargs: dict, fields: set[str]) -> dict:
    """LLM(**kwargs) -> EngineArgs keyword arguments: fastdecode's own (`fields`) as given, vLLM's
    through the table. ValueError for a value refused, TypeError for a name neither knows."""
    out = {k: v for k, v in kwargs.items() if k in fields and k not in BY_NAME}
    for name, value in kwargs.items():
        row = BY_NAME.get(name)
        if row is None:
            if name not in fields:
                close = difflib.get_close_matches(name, sorted(fields | set(BY_NAME)), n=1)
                hint = f"; did you mean {close[0]}?" if close else ""
                raise TypeError(f"LLM() got an unexpected keyword argument {name!r}: neither fastdecode's (EngineArgs) "
                                f"nor one of vLLM's it knows{hint}")
            continue
        if row.target is None:
            message = refusal(row, value)
            if message:
                raise ValueError(message)
            continue
        converted = row.convert(value) if row.convert else value
        if converted is None:
            continue
        if row.target in kwargs and row.target != name and kwargs[row.target] != converted:
            raise ValueError(f"{name}={value!r} contradicts {row.target}={kwargs[row.target]!r}")
        out[row.target] = converted
    return out


def add_flags(parser) -> None:
    """vLLM's flags for the rows that have one (dest vllm_<name>; None when not given)."""
    for row in ROWS:
        if row.flag is None:
            continue
        dest = f"vllm_{row.name}"
        if row.flag is bool:
            parser.add_argument(row.option, dest=dest, action="store_const", const=True, default=None,
                                help=f"vLLM's flag: {_flag_help(row)}")
        else:
            parser.add_argument(row.option, dest=dest, type=row.flag, default=None, metavar=row.name.upper(),
                                help=f"vLLM's flag: {_flag_help(row)}")


def _flag_help(row: VllmArg) -> str:
    if row.name == "enforce_eager":
        return ("the S-part runs eagerly: no torch.compile, no CUDA graphs (the default unless --compile or "
                "--cuda-graphs)")
    accepted = [str(v) for v in row.noop if v is not None and v is not False]
    if not accepted:
        return f"refused: {row.why}"
    return f"accepted as {', '.join(accepted)} only: {row.why}"


def check_flags(args) -> str | None:
    """The first vLLM flag given with a value fastdecode refuses, as a one-line message; None if none."""
    for row in ROWS:
        value = getattr(args, f"vllm_{row.name}", None)
        if row.flag is None or value is None:
            continue
        if row.name == "enforce_eager":
            if getattr(args, "cuda_graphs", False):
                return "--enforce-eager contradicts --cuda-graphs (CUDA graphs are off unless --cuda-graphs is given)"
            if getattr(args, "compile", False):
                return "--enforce-eager contradicts --compile (the S-part runs eagerly unless --compile is given)"
            continue
        message = refusal(row, value, as_flag=True)
        if message:
            return message
    return None
