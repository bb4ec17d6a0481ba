"""What a job asks of the engine (EngineArgs, vLLM's name), and the defaults resolved against
the machine: device, dtypes, batch and prefill limits.
"""
from __future__ import annotations

import dataclasses
import sys
from dataclasses import dataclass

import torch

from fastdecode.model.config import ModelConfig
from rworker.protocol.control import MAX_MINIBATCHES
from rworker.protocol.kvformat import KV_DTYPES, fp8_kv_refusal

# a CPU prefill step's activations (per token: hidden * 6 + intermediate * 3 values): the embedded
# model's prefill ran 1.21x faster at ~1,000 tokens a step (16 MiB) than at 8,192 (dev box, Zen 5;
# docs/results.md, "Prompt attention on the CPU")
CPU_PREFILL_ACTIVATION_BYTES = 16 << 20


@dataclass(slots=True)
class EngineArgs:
    model: str = "smollm2-135m"
    revision: str | None = None       # branch, tag or commit of a model named by its HF repo id (local cache)
    tokenizer: str | None = None      # another model's tokenizer (a directory, .gguf or cached repo id)
    tokenizer_revision: str | None = None   # its revision, as `revision`
    device: str = "auto"              # auto | cpu | cuda[:i]
    dtype: str = "auto"               # auto (the checkpoint's: bf16 unless it stores float32; on a CPU without
                                      # AVX512-BF16 float32) | float32 | bfloat16 | float16
    quantization: str | None = None   # None | "fp8": the projections' weights in e4m3 (vLLM's name; an fp8
                                      # checkpoint is served fp8 either way; model/quantization.py)
    kv_dtype: str = "auto"            # auto (= fp32 for float32 models, else bf16) | fp32 | bf16 | fp16 | int8
    attn_probs: str = "fp32"          # fp32 | bf16: R-workers may round attention probabilities to bf16
                                      # for the PV product (V in token pairs) where their tune finds it faster
    max_batch: int | None = None      # most sequences decoding at once (default 256 on CPU, 4096 on CUDA)
    max_prefill_tokens: int | None = None  # prompt tokens per prefill step (CPU: activations of ~16 MiB, 256..8192
                                           # tokens; CUDA: up to 32768)
    max_num_batched_tokens: int | None = None  # chunked prefill: tokens per step, decode rows first, then prompt
                                      # chunks (vLLM's name; None: whole prompts, max_prefill_tokens per step)
    max_model_len: int | None = None  # longest prompt + generation (default: the model's context)
    kv_reserve: str = "full"          # full: reserve each sequence's worst case | grow: page by page, preempt
    seed: int = 0                     # seeds requests that name none
    s_threads: int | None = None      # torch threads on the S-worker (CPU)
    r_threads: int | None = None      # kernel threads per R-worker
    rworker_mem: int | None = None    # KV bytes per R-worker (default: available memory less a reserve)
    timeout: float | None = None      # seconds an R-worker may stay silent before the job aborts
    schedule: str = "fifo"            # fifo | stabilized (load-stabilizing admission, docs/design.md)
    target_batch: int | None = None   # stabilized: B (default max_batch)
    admit_every: int | None = None    # stabilized: F steps between micro-batches (default S/16)
    max_gen: int | None = None        # stabilized: S (default: estimated from requests' max_tokens)
    learn_lengths: bool = True        # stabilized: project with lengths learnt from finished sequences
    balance: bool = True              # start a sequence only while it raises tokens/s (sched/balance.py);
                                      # False: memory alone bounds the batch
    pipeline_depth: int | None = None  # mini-batches in flight: S-part of one while R-workers attend another
                                      # (None: auto_pipeline_depth)
    cuda_graphs: bool = False         # CUDA S-worker: replay each layer's dense work from a CUDA graph
    compile: bool = False             # a CPU S-part's per-layer halves under torch.compile (model/compiled.py;
                                      # off by default: slower than eager where measured, docs/results.md)
    enforce_eager: bool = False       # vLLM's: nothing compiled, no CUDA graphs
    cuda_graph_max_rows: int = 2048   # largest mini-batch run from graphs (larger ones run eagerly)
    max_logprobs: int = 20            # most logprobs / prompt_logprobs alternatives a request may ask for (vLLM's)
    max_request_mem: int = 1 << 30    # rank-0 bytes one request may pin (its tokens, logprobs, output row)
    served_model_name: str | list[str] | None = None   # names requests may give the model; the first is
                                                       # reported in responses (vLLM's; default: `model`)
    quiet: bool = False               # no start-up lines (the R-worker roster); warnings still print
    prefix_sharing: bool = True       # prompts sharing whole pages with a running one start from its KV pages
                                      # (prefilled and stored once; engine/prefix_cache.py)
    prefix_kept_tokens: int = 8192    # most shared-prefix tokens whose K/V the S-worker keeps for members'
                                      # prefills (past it, a prompt prefills in full)
    device_kv: bool | None = None     # the S-worker keeps KV of its own beside the R-workers (engine/kv_tiers.py);
                                      # None: auto (a GPU S-worker does, a CPU one does not)
    device_kv_memory: int | None = None   # its bytes (None: auto, what is free on its device or node)
    gpu_memory_utilization: float = 0.9   # GPU S-worker: the fraction of the card the job may fill (vLLM's)
    tensor_parallel_size: int = 1     # S-worker ranks (0..T-1), each with 1/T of every layer on its own GPU
                                      # (vLLM's name; the R-workers are the ranks after them; fastdecode/tp/)


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def default_max_batch(device: torch.device) -> int:
    return 4096 if device.type == "cuda" else 256


def check_batch_budget(max_num_batched_tokens: int | None, max_batch: int) -> None:
    """A chunked-prefill budget must hold a step of decode rows and still leave prompt tokens."""
    if max_num_batched_tokens is not None and max_num_batched_tokens < max_batch:
        raise ValueError(f"max_num_batched_tokens ({max_num_batched_tokens}) is below max_batch ({max_batch}): "
                         f"decode rows alone could fill every step and no prompt would be prefilled; raise it or "
                         f"lower max_batch")


def auto_pipeline_depth(device: torch.device, one_node: bool) -> int:
    """Mini-batches in flight where --pipeline-depth is not given. A CPU S-worker whose R-part
    shares its node (local mode, or every R-worker on its node) takes turns with it on every core
    (1): at depth 2 its dense layers get half the cores while the attention, a tenth of a step at
    chat lengths, idles the other half (local mode 1.69x on the dev box; `mpiexec -n 2` on one
    node from 0.55x to 0.81x vLLM's generation rate, bench/e2e/results). Everywhere else 2: the S-part of one mini-batch overlaps the R-workers' attention of
    the other on their own cores."""
    return 1 if one_node and device.type == "cpu" else 2


def resolve_batch_limits(args: EngineArgs, device: torch.device, config: ModelConfig,
                         dtype: torch.dtype, one_node: bool = False) -> EngineArgs:
    """Fill in the pipeline depth (auto_pipeline_depth; `one_node`: the R-part on the S-worker's
    node, a single S-rank) and check it against the protocol's mini-batch limit, then max_batch and
    max_prefill_tokens. A GPU S-worker exists to run thousands of rows
    per step and large prefill chunks; the chunk is capped so that its activations (about
    hidden*6 + intermediate*3 values per token, the largest live at once) take at most a quarter
    of the free device memory. A CPU S-worker's prefill runs its elementwise passes from cache
    when a step's activations stay near CPU_PREFILL_ACTIVATION_BYTES (whole prompts still go
    one per step at least)."""
    if not 0 < args.gpu_memory_utilization <= 1:
        raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {args.gpu_memory_utilization}")
    if not isinstance(args.tensor_parallel_size, int) or args.tensor_parallel_size < 1:
        raise ValueError(f"tensor_parallel_size must be a positive integer, got {args.tensor_parallel_size!r}")
    if args.enforce_eager and (args.cuda_graphs or args.compile):
        raise ValueError(f"enforce_eager contradicts {'cuda_graphs' if args.cuda_graphs else 'compile'}")
    depth = args.pipeline_depth if args.pipeline_depth is not None else auto_pipeline_depth(device, one_node)
    if not isinstance(depth, int) or not 1 <= depth <= MAX_MINIBATCHES:
        raise ValueError(f"pipeline_depth must be in 1..{MAX_MINIBATCHES}, got {depth!r}")
    cuda = device.type == "cuda"
    max_batch = args.max_batch or default_max_batch(device)
    check_batch_budget(args.max_num_batched_tokens, max_batch)
    prefill = args.max_prefill_tokens
    if prefill is None:
        per_token = (6 * config.hidden_size + 3 * config.intermediate_size) * torch.finfo(dtype).bits // 8
        if cuda:
            free, _ = torch.cuda.mem_get_info(device)
            prefill = int(min(32768, max(8192, free // 4 // per_token)))
        else:
            prefill = int(min(8192, max(256, CPU_PREFILL_ACTIVATION_BYTES // per_token)))
    return dataclasses.replace(args, pipeline_depth=depth, max_batch=max_batch, max_prefill_tokens=prefill)


NAMES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16,
         "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16}


def checkpoint_dtype(config: ModelConfig | None) -> str | None:
    """The dtype an HF checkpoint's config names (torch_dtype, or dtype as transformers v5 writes
    it); None where it names none (GGUF files, whose weights are quantized or half, random models)."""
    if config is None:
        return None
    cfg = config.hf_config or {}
    named = cfg.get("torch_dtype") or cfg.get("dtype")
    return named.removeprefix("torch.") if isinstance(named, str) else None


def auto_dtype(device: torch.device, checkpoint: str | None = None,
               features: frozenset[str] | None = None) -> tuple[torch.dtype, str]:
    """--dtype auto: (dtype, why). A GPU computes in bfloat16. A CPU S-worker takes the checkpoint's
    own dtype, as HF and vLLM read `auto` (bfloat16 for a half-precision or quantized one), where the
    CPU computes bf16 natively, else float32. features: the CPU's (rworker.isa.cpu_features)."""
    if device.type != "cpu":
        return torch.bfloat16, "bfloat16 on a GPU"
    if checkpoint == "float32":
        return torch.float32, "the checkpoint stores float32"
    if features is None:
        try:
            from rworker.isa import cpu_features
            features = cpu_features()
        except ImportError:          # no kernel build to read cpuid with: the safe choice
            return torch.float32, "this install cannot read the CPU's features (no kernel build)"
    if "avx512bf16" in features or "amx_bf16" in features:
        return torch.bfloat16, "the checkpoint's half precision, and this CPU computes bf16 (AVX512-BF16)"
    return torch.float32, "this CPU lacks AVX512-BF16 and AMX, where bfloat16 runs slower than float32"


def say_dtype(args: EngineArgs, device: torch.device, config: ModelConfig, dtype: torch.dtype) -> None:
    """The start-up line naming a CPU S-worker's dtype under `auto`, and why."""
    if args.dtype != "auto" or device.type != "cpu":
        return
    why = auto_dtype(device, checkpoint_dtype(config))[1]
    hint = "; --dtype float32 matches HF transformers' float32 outputs" if dtype != torch.float32 else ""
    print(f"fastdecode: dtype {str(dtype).removeprefix('torch.')} (auto: {why}{hint})", file=sys.stderr, flush=True)


def resolve_dtypes(args: EngineArgs, device: torch.device,
                   config: ModelConfig | None = None) -> tuple[torch.dtype, str]:
    """(S-part dtype, KV dtype name) of a job; config: the model's, for `auto` (the checkpoint's dtype)."""
    dtype = auto_dtype(device, checkpoint_dtype(config))[0] if args.dtype == "auto" else NAMES[args.dtype]
    kv = args.kv_dtype
    if kv == "auto":
        kv = "fp32" if dtype == torch.float32 else "bf16"
    refused = fp8_kv_refusal(kv)
    if refused:
        raise ValueError(refused)
    if kv not in KV_DTYPES:
        raise ValueError(f"kv_dtype must be 'auto' or one of {', '.join(KV_DTYPES)}, got {args.kv_dtype!r}")
    if args.attn_probs not in ("fp32", "bf16"):
        raise ValueError(f"attn_probs must be 'fp32' or 'bf16', got {args.attn_probs!r}")
    if args.attn_probs == "bf16" and kv != "bf16":
        raise ValueError(f"--attn-probs bf16 needs bf16 KV (--kv-dtype bf16), not {kv}"
                         + (" ('auto' is fp32 for a float32 model)" if args.kv_dtype == "auto" else ""))
    return dtype, kv
