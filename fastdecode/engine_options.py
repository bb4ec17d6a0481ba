"""The engine's options on the command line: the argument types, the flags every command that
builds an engine shares (generate, profile) and those only a serving run takes, and the
EngineArgs they make. The commands (cli.py, sizing/profile_cli.py, sim/cli.py) and the batch
schema's limits import them from here."""
from __future__ import annotations

import argparse

from fastdecode.flag_ranges import MIN_TIMEOUT_S, count_range_error, duration


def positive_int(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    error = count_range_error(v)
    if error:
        raise argparse.ArgumentTypeError(f"{error}, got {text!r}")
    return v


def positive_float(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}") from None
    if not 0 < v < float("inf"):
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}")
    return v


def _pipeline_depth(text: str) -> int:
    from rworker.protocol.control import MAX_MINIBATCHES
    v = positive_int(text)
    if v > MAX_MINIBATCHES:
        raise argparse.ArgumentTypeError(f"at most {MAX_MINIBATCHES} mini-batches in flight, got {v}")
    return v


def bytes_arg(text: str) -> int:
    from rworker.host.capacity import parse_bytes
    try:
        return parse_bytes(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


class Renamed(argparse.Action):
    """A flag that took another name: using it records a message naming the new one
    (`renamed_flag`), which the command then refuses as a usage error (plan's check_hardware)."""

    def __init__(self, option_strings, dest, new: str, **kw):
        super().__init__(option_strings, dest, **kw)
        self.new = new

    def __call__(self, parser, namespace, values, option_string=None):
        namespace.renamed_flag = f"{option_string} is now {self.new}"


def add_tensor_parallel_size(p) -> None:
    """--tensor-parallel-size, as generate, profile, plan and simulate all read it."""
    p.add_argument("--tensor-parallel-size", "-tp", type=positive_int, default=1, metavar="T",
                   help="the S-worker over T ranks, one per GPU (0..T-1; the R-workers are the ranks after "
                        "them: mpirun -n T+R), each holding 1/T of every layer's weights (vLLM's flag; T must "
                        "divide the heads, the KV heads and the MLP width; default 1)")


def add_data_parallel_size(p) -> None:
    """--data-parallel-size, as generate, plan and simulate read it."""
    p.add_argument("--data-parallel-size", "-dp", type=positive_int, default=1, metavar="D",
                   help="D S-workers in one job, each with its own R-workers (vLLM's flag): ranks 0..D*T-1 are "
                        "the S-workers (T: --tensor-parallel-size), the rest their R-workers in D contiguous "
                        "blocks; rank 0 deals the input's lines to the groups as their queues run low and writes "
                        "every group's rows into the one output; plan and simulate: D such groups (default 1)")


def add_quantization(p) -> None:
    """--quantization, as generate, profile, plan and simulate all read it."""
    p.add_argument("--quantization", "-q", default=None, choices=["fp8"],
                   help="fp8: the projections' weights in float8_e4m3fn with per-channel scales, half of bf16's "
                        "bytes (vLLM's flag); GEMMs in fp8 on GPUs with fp8 (sm89+), elsewhere the weights "
                        "dequantize (once at load on a CPU, at each use on older GPUs). An fp8 checkpoint "
                        "(compressed-tensors, fbgemm_fp8) is served fp8 without it; plan and simulate price a "
                        "bf16 profile's GEMMs with --fp8-speedup. Embeddings, norms and the LM head stay in "
                        "--dtype")


def kv_dtype_name(text: str) -> str:
    """--kv-dtype (generate, profile, plan, simulate): auto or a dtype the KV store holds; fp8 is
    refused with the one message naming int8 (kvformat.fp8_kv_refusal)."""
    from rworker.protocol.kvformat import KV_DTYPES, fp8_kv_refusal
    refused = fp8_kv_refusal(text)
    if refused:
        raise argparse.ArgumentTypeError(refused)
    if text not in ("auto", *KV_DTYPES):
        raise argparse.ArgumentTypeError(f"expected auto or one of {', '.join(KV_DTYPES)}, got {text!r}")
    return text


def kv_dtype_or_model(text: str) -> str | None:
    """--kv-dtype of plan and simulate: generate's values; auto (None) is the model's (or profile's)."""
    name = kv_dtype_name(text)
    return None if name == "auto" else name


def _size_or_auto(text: str) -> int | None:
    return None if text.strip().lower() == "auto" else bytes_arg(text)


def _fraction(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        v = float("nan")
    if not 0 < v <= 1:
        raise argparse.ArgumentTypeError(f"expected a fraction in (0, 1], got {text!r}")
    return v


def add_engine_options(p: argparse.ArgumentParser) -> None:
    """The engine options every command that builds an engine uses (generate, profile)."""
    p.add_argument("-m", "--model", default="smollm2-135m",
                   help="HF model directory, .gguf file, HF repo id (org/name) in the local Hugging Face cache "
                        "($HF_HUB_CACHE, $HF_HOME/hub; never downloaded), or embedded name (default: smollm2-135m)")
    p.add_argument("--revision", default=None,
                   help="branch, tag or commit of a model named org/name, among the local cache's (default: main)")
    p.add_argument("--tokenizer", default=None,
                   help="another model's tokenizer: a directory, .gguf file or cached org/name (default: the model's)")
    p.add_argument("--tokenizer-revision", default=None, help="--revision of --tokenizer")
    p.add_argument("--device", default="auto", help="S-worker device: auto | cpu | cuda[:N] (default: auto)")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                   help="S-part weights/activations (auto: bfloat16 on CUDA; on a CPU the checkpoint's dtype, "
                        "bfloat16 unless it stores float32, where the CPU has AVX512-BF16 or AMX, else float32; "
                        "float32 matches HF transformers' float32 outputs: docs/tuning.md)")
    add_quantization(p)
    p.add_argument("--kv-dtype", default="auto", type=kv_dtype_name, metavar="{auto,fp32,bf16,fp16,int8}",
                   help="KV-cache element type on the R-workers (auto: fp32 for float32 models, else bf16; int8: "
                        "per-token scales, about half of bf16's bytes read per token: docs/tuning.md; fp8 KV is "
                        "not served)")
    p.add_argument("--attn-probs", default="fp32", choices=["fp32", "bf16"],
                   help="precision of the attention probabilities in the R-workers' PV product: bf16 (with bf16 KV) "
                        "lets an R-worker with AVX512-BF16 store V in token pairs and use bf16 dot products, and one "
                        "with AMX run the scores and PV on its tiles, where its start-up tune finds that faster (as "
                        "FlashAttention rounds P; outputs within a bf16 bound, not bit-equal; default fp32)")
    p.add_argument("--max-prefill-tokens", type=positive_int, default=None,
                   help="prompt tokens prefilled per step (default 8192; on CUDA up to 32768 as memory allows)")
    p.add_argument("--max-num-batched-tokens", type=positive_int, default=None,
                   help="chunked prefill (vLLM's name): tokens per step, a decode row counting one; the running "
                        "sequences' decode rows come first, prompts are prefilled in chunks of what is left, so "
                        "a long prompt never stalls decoding (at least --max-batch; default: off, whole prompts "
                        "up to --max-prefill-tokens per step)")
    p.add_argument("--s-threads", type=positive_int, default=None, help="torch threads on a CPU S-worker")
    p.add_argument("--r-threads", type=positive_int, default=None,
                   help="kernel threads per R-worker (default: the physical cores it may use)")
    p.add_argument("--rworker-mem", type=bytes_arg, default=None,
                   help="KV-cache bytes per R-worker, e.g. 64G (default: available memory less a reserve)")
    p.add_argument("--device-kv", action=argparse.BooleanOptionalAction, default=None,
                   help="the S-worker keeps some sequences' KV in its own memory and attends to them itself "
                        "(its GPU's, or on a CPU S-worker beside R-workers its in-process store), the R-workers "
                        "the rest; each sequence goes where its step ends earliest, from the tiers' measured "
                        "speeds. Default: on for a GPU S-worker, off for a CPU one (its attention would run in "
                        "turn with the dense layers on the same cores); --no-device-kv puts all KV on the "
                        "R-workers")
    p.add_argument("--device-kv-memory", type=_size_or_auto, default=None,
                   help="bytes of the S-worker's own KV tier, e.g. 40G (default auto: on a GPU what is free "
                        "after the weights and the activations' reserve, under --gpu-memory-utilization; on a "
                        "CPU S-worker an equal share of its node's memory with the R-workers there)")
    p.add_argument("--gpu-memory-utilization", type=_fraction, default=0.9,
                   help="GPU S-worker: the fraction of the card's memory the job may fill, weights, "
                        "activations and its KV tier together (vLLM's; default 0.9)")
    add_tensor_parallel_size(p)
    p.add_argument("--timeout", type=duration(MIN_TIMEOUT_S), default=None,
                   help="seconds a rank may stay silent before the job aborts naming it, at least 1 (default: 900 "
                        "until a step was timed, then 50x the slowest step, at least 300)")
    p.add_argument("--pipeline-depth", type=_pipeline_depth, default=None,
                   help="mini-batches in flight: the S-part of one runs while the R-workers attend the "
                        "others (1 = S and R take turns on all cores; default: 1 for a CPU S-worker with its "
                        "R-part on its own node, 2 otherwise)")
    p.add_argument("--compile", action="store_true",
                   help="a CPU S-worker's layers under torch.compile (Inductor, cached in the fastdecode cache "
                        "directory); off by default: on the dev box it ran slower than eager (docs/tuning.md)")
    p.add_argument("--cuda-graphs", action="store_true",
                   help="CUDA S-worker: replay each layer's dense work of a mini-batch from a CUDA graph "
                        "(fewer launches at small batches; captured on first use per row bucket)")
    p.add_argument("--cuda-graph-max-rows", type=positive_int, default=2048,
                   help="largest mini-batch run from CUDA graphs; larger ones run eagerly (default 2048)")
    from fastdecode.vllm_args import add_flags
    add_flags(p.add_argument_group("vLLM's flags", "accepted where they mean something here, else refused "
                                                   "(exit 2) saying why"))


def add_generate_engine_options(p: argparse.ArgumentParser) -> None:
    """The engine options only a serving run uses (batching, memory per sequence, admission, seeds)."""
    p.add_argument("--max-batch", "--max-num-seqs", dest="max_batch", type=positive_int, default=None,
                   help="most sequences decoding at once (--max-num-seqs: vLLM's name; default 256 on a CPU "
                        "S-worker, 4096 on CUDA)")
    p.add_argument("--max-model-len", type=positive_int, default=None,
                   help="longest prompt + generation served (default: the model's context). Each sequence "
                        "reserves R-worker memory for prompt + max_tokens, and a request without max_tokens "
                        "for the whole context: a shorter limit lets more sequences run at once")
    p.add_argument("--kv-reserve", default="full", choices=["full", "grow"],
                   help="R-worker memory per sequence: full (its worst case, prompt + max_tokens, at admission: "
                        "never preempted; default) or grow (page by page as it grows; when a worker is full the "
                        "youngest sequences there are preempted and later recomputed, as vLLM does)")
    p.add_argument("--prefix-sharing", "--enable-prefix-caching", dest="prefix_sharing",
                   action=argparse.BooleanOptionalAction, default=True,
                   help="prompts that start with the same whole KV pages as a running one (a shared system "
                        "prompt, n samples) prefill only the rest and read those pages on its R-worker, stored "
                        "once (default; vLLM's --enable-prefix-caching); --no-prefix-sharing prefills and stores "
                        "every prompt in full")
    p.add_argument("--prefix-kept-tokens", type=positive_int, default=8192,
                   help="most shared-prefix tokens whose K/V rank 0 keeps for the prompts that start from them "
                        "(default 8192; past it a prompt prefills in full)")
    p.add_argument("--seed", type=int, default=0, help="seeds requests that carry no seed (default 0)")
    p.add_argument("--schedule", default="fifo", choices=["fifo", "stabilized"],
                   help="admission: fifo (fill up to --max-batch) or stabilized (micro-batches that keep "
                        "the R-workers' KV load steady; FastDecode's load-stabilizing schedule)")
    p.add_argument("--target-batch", type=positive_int, default=None,
                   help="stabilized: target number of running sequences B (default --max-batch)")
    p.add_argument("--admit-every", type=positive_int, default=None,
                   help="stabilized: steps F between micro-batches of B*F/S sequences (default S/16)")
    p.add_argument("--max-gen", type=positive_int, default=None,
                   help="stabilized: generation length S (default: estimated from the requests' max_tokens)")
    p.add_argument("--balance", action=argparse.BooleanOptionalAction, default=True,
                   help="start a sequence only while it raises tokens/s: the R-workers take sequences up to "
                        "their balance point against the S-side's step, not up to their memory (default on; "
                        "--no-balance: memory alone bounds the batch)")
    p.add_argument("--stabilize-lengths", default="learnt", choices=["learnt", "max-tokens"],
                   help="stabilized: project running sequences with lengths learnt from finished ones "
                        "(EOS; default), or as if each runs to its max_tokens")


def engine_args(args):
    """EngineArgs from a command's options; what a command does not offer keeps EngineArgs' default
    (profile has no admission or seed options)."""
    import dataclasses

    from fastdecode.engine.args import EngineArgs
    given = {f.name: getattr(args, f.name) for f in dataclasses.fields(EngineArgs) if hasattr(args, f.name)}
    if hasattr(args, "stabilize_lengths"):
        given["learn_lengths"] = args.stabilize_lengths == "learnt"
    given["enforce_eager"] = bool(getattr(args, "vllm_enforce_eager", None))     # vLLM's flag (vllm_args.py)
    return EngineArgs(**given)
