"""A job's weight format: what `--quantization` asks, what the checkpoint ships, which tensors
are fp8 and how they load.

fp8 covers the projections of every layer: Q/K/V, O, gate/up and down, each routed expert's and
the shared expert's. Embeddings, norms, the LM head and the MoE router (and Qwen2-MoE's shared
expert gate) stay in the compute dtype. They come either quantized at load from a float
checkpoint (`--quantization fp8`, per output channel, fp8.py) or as published, which is served
fp8 with or without the flag, as vLLM serves it:

- compressed-tensors, float 8-bit weights ("FP8-Dynamic": `quant_method: compressed-tensors`,
  weight scales per channel, [out, 1]; "FP8" with one scale per tensor also loads);
- transformers' fbgemm fp8 (`quant_method: fbgemm_fp8`, `weight_scale` [out, 1], the
  activations' `activation_scale_ub`);
- vLLM's own `quant_method: fp8` with per-tensor scales (not its block-wise form).

A weight `X.weight` in float8_e4m3fn takes its scale from `X.weight_scale`. Static input scales
(`X.input_scale`) are not used: activations always get one scale per token. Any other
quantization method, or a checkpoint's fp8 tensor without a scale of a fitting shape, is an
error naming it, found from the safetensors headers before any weight is read.
"""
from __future__ import annotations

import glob
import json
import os
import re
import sys
from dataclasses import dataclass

import torch

from fastdecode.model.config import ConfigError, ModelConfig
from fastdecode.model.fp8 import Fp8Weight, weight_bytes

QUANTIZATIONS = ("fp8",)
FP8_METHODS = ("compressed-tensors", "fbgemm_fp8", "fp8")
# the S-part's names (model.layers.N.*) of the projections fp8 covers
_PROJECTION = re.compile(
    r"model\.layers\.\d+\.(?:self_attn\.\w+_proj\.weight"
    r"|(?:mlp|block_sparse_moe)\.(?:\w+_proj\.weight|experts\.\d+\.\w+\.weight|experts\.(?:gate_up|down)_proj"
    r"|shared_expert\.\w+_proj\.weight))")
_SAFETENSORS_FP8 = {"F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2"}


def is_projection(name: str) -> bool:
    """Whether the S-part's weight `name` is one fp8 covers (not the router: `mlp.gate.weight`)."""
    return _PROJECTION.fullmatch(name) is not None


def scale_name(name: str) -> str:
    """The checkpoint name of weight `name`'s scale: X.weight -> X.weight_scale."""
    return name + "_scale"


@dataclass(frozen=True)
class CheckpointFp8:
    """What an fp8 checkpoint's quantization_config says."""
    method: str                        # its quant_method
    act_amax_ub: float | None = None   # fbgemm_fp8: the cap on a token's max |activation|
    static_input_scales: bool = False  # it carries input scales (not used: scales per token)


@dataclass(frozen=True)
class WeightFormat:
    """fp8: the projections are e4m3; checkpoint: set when the checkpoint ships them so."""
    fp8: bool = False
    checkpoint: CheckpointFp8 | None = None

    @property
    def quantize_at_load(self) -> bool:
        """Float projections become fp8 as they load (a float checkpoint; an fp8 one's float
        tensors stay as its author left them)."""
        return self.fp8 and self.checkpoint is None

    def origin(self) -> str:
        if self.checkpoint is None:
            return "quantized at load"
        return f"the checkpoint's, {self.checkpoint.method}"


def check_quantization(value) -> None:
    """EngineArgs.quantization / --quantization: None or one of QUANTIZATIONS."""
    if value is not None and value not in QUANTIZATIONS:
        raise ValueError(f"quantization must be None or one of {', '.join(QUANTIZATIONS)}, got {value!r}")


def weight_format(requested: str | None, source) -> WeightFormat:
    """The job's weights: fp8 when asked, or when the checkpoint already is (then whatever was
    asked). ConfigError for a checkpoint quantized in a way fastdecode does not serve, or an fp8
    tensor of it without a fitting scale (from the headers: before any weight loads)."""
    check_quantization(requested)
    ckpt = checkpoint_fp8(source)
    if ckpt is not None:
        check_checkpoint_tensors(source)
    return WeightFormat(fp8=ckpt is not None or requested == "fp8", checkpoint=ckpt)


def _quantization_config(source) -> dict | None:
    if source.kind != "hf":
        return None
    path = os.path.join(source.path, "config.json")
    try:
        with open(path) as f:
            qc = json.load(f).get("quantization_config")
    except (OSError, ValueError):
        return None                      # read_config reports an unreadable config
    if qc is not None and not isinstance(qc, dict):
        raise ConfigError(f"{path}: quantization_config must be an object, got {type(qc).__name__}")
    return qc


def checkpoint_fp8(source) -> CheckpointFp8 | None:
    """The checkpoint's fp8 format from its config.json, None for a float checkpoint."""
    qc = _quantization_config(source)
    if qc is None:
        return None
    where = f"{source.path}: quantization_config"
    method = qc.get("quant_method")
    if method == "compressed-tensors":
        return _compressed_tensors(qc, where)
    if method == "fbgemm_fp8":
        ub = qc.get("activation_scale_ub", 1200.0)
        return CheckpointFp8(method, act_amax_ub=float(ub) if ub is not None else None)
    if method == "fp8":
        if qc.get("weight_block_size"):
            raise ConfigError(f"{where}.weight_block_size {qc['weight_block_size']}: block-wise fp8 is not served "
                              "(fastdecode takes one scale per output channel or per tensor)")
        return CheckpointFp8(method, static_input_scales=qc.get("activation_scheme") == "static")
    raise ConfigError(f"{where}.quant_method {method!r} is not served; fastdecode serves float checkpoints and fp8 "
                      f"ones ({', '.join(FP8_METHODS)})")


def _compressed_tensors(qc: dict, where: str) -> CheckpointFp8:
    groups = qc.get("config_groups")
    if not isinstance(groups, dict) or not groups:
        raise ConfigError(f"{where}.config_groups is missing: not a compressed-tensors quantization fastdecode knows")
    static = False
    for name, group in groups.items():
        w = (group or {}).get("weights") or {}
        if (w.get("type"), w.get("num_bits")) != ("float", 8):
            raise ConfigError(f"{where}.config_groups.{name}.weights: type {w.get('type')!r}, num_bits "
                              f"{w.get('num_bits')!r}; fastdecode serves float 8-bit (FP8) weights only")
        if w.get("strategy") not in ("channel", "tensor"):
            raise ConfigError(f"{where}.config_groups.{name}.weights.strategy {w.get('strategy')!r} is not served "
                              "(fastdecode takes one scale per output channel or per tensor)")
        a = (group or {}).get("input_activations")
        if a:
            if (a.get("type"), a.get("num_bits")) != ("float", 8):
                raise ConfigError(f"{where}.config_groups.{name}.input_activations: type {a.get('type')!r}, "
                                  f"num_bits {a.get('num_bits')!r}; fastdecode runs fp8 activations only")
            static = static or not a.get("dynamic", False)
    return CheckpointFp8("compressed-tensors", static_input_scales=static)


# ----------------------------------------------------------------------------- the checkpoint's tensors

def fp8_tensor_error(name: str, dtype: str, shape: tuple, scale_shape: tuple | None) -> str | None:
    """Why checkpoint tensor `name` (an fp8 `dtype`, `shape`) cannot load with its scale of
    `scale_shape` (None: missing), or None if it can."""
    if dtype != "float8_e4m3fn":
        return f"{name} is {dtype}; fastdecode serves float8_e4m3fn weights"
    if scale_shape is None:
        return f"fp8 tensor {name} {list(shape)} has no scale {scale_name(name)} in the checkpoint"
    per_row, numel = tuple(shape[:-1]), 1
    for d in scale_shape:
        numel *= d
    if tuple(scale_shape) in (per_row, per_row + (1,)) or numel == 1:
        return None
    return (f"{scale_name(name)} has shape {list(scale_shape)}; for {name} {list(shape)} expected {list(per_row)} "
            f"or {list(per_row + (1,))} (per output channel) or one value (per tensor)")


def check_checkpoint_tensors(source) -> None:
    """ConfigError naming the first fp8 tensor of an HF checkpoint whose scale is missing or
    mis-shaped; reads the safetensors headers only."""
    if source.kind != "hf":
        return
    from safetensors import safe_open
    shapes: dict[str, tuple[str, tuple]] = {}
    for f in sorted(glob.glob(os.path.join(source.path, "*.safetensors"))):
        with safe_open(f, framework="pt") as st:
            for name in st.keys():        # noqa: SIM118 - safe_open is not iterable
                sl = st.get_slice(name)
                shapes[name] = (sl.get_dtype(), tuple(sl.get_shape()))
    for name, (dtype, shape) in shapes.items():
        if dtype in _SAFETENSORS_FP8:
            scale = shapes.get(scale_name(name))
            error = fp8_tensor_error(name, _SAFETENSORS_FP8[dtype], shape, scale[1] if scale else None)
            if error:
                raise ConfigError(f"{source.path}: {error}")


class WeightCollector:
    """Takes a checkpoint's tensors one at a time into the dict the S-part reads: float tensors
    in the compute dtype on the device, the projections as Fp8Weight where the format is fp8
    (quantized as they arrive, so a float checkpoint never sits whole on the device), fp8
    tensors with their scales (an fp8 tensor the S-part keeps in the compute dtype, dequantized)."""

    def __init__(self, fmt: WeightFormat, dtype: torch.dtype, device):
        self.fmt, self.dtype, self.device = fmt, dtype, device
        self.weights: dict = {}
        self._fp8: dict[str, tuple[str, torch.Tensor]] = {}       # ours -> (checkpoint name, e4m3 tensor)
        self._scales: dict[str, torch.Tensor] = {}                # checkpoint name of a weight -> its scale

    def add(self, name: str, ours: str, t: torch.Tensor) -> None:
        """Checkpoint tensor `name`, the S-part's `ours`."""
        if name.endswith(".weight_scale"):
            self._scales[name[:-len("_scale")]] = t
        elif name.endswith((".input_scale", ".weight_zero_point", ".input_zero_point")):
            pass                          # static activation scales (tokens get their own); symmetric: zeros
        elif t.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
            self._fp8[ours] = (name, t.to(self.device))
        elif self.fmt.quantize_at_load and is_projection(ours) and t.is_floating_point():
            self.weights[ours] = Fp8Weight.quantize(t.to(self.device))
        else:
            self.weights[ours] = t.to(device=self.device, dtype=self.dtype)

    def put(self, ours: str, weight) -> None:
        """A weight made ready by the caller (a tensor-parallel rank's cut of an fp8 weight)."""
        self.weights[ours] = weight

    def finish(self) -> dict:
        ub = self.fmt.checkpoint.act_amax_ub if self.fmt.checkpoint else None
        for ours, (name, q) in self._fp8.items():
            scale = self._scales.get(name)
            error = fp8_tensor_error(name, str(q.dtype).removeprefix("torch."), tuple(q.shape),
                                     None if scale is None else tuple(scale.shape))
            if error:
                raise ValueError(error)
            scale = scale.to(device=self.device, dtype=torch.float32)
            scale = scale.expand(q.shape[:-1]).contiguous() if scale.numel() == 1 else scale.reshape(q.shape[:-1])
            w = Fp8Weight(q, scale, ub)
            self.weights[ours] = w if is_projection(ours) else w.dequantize(self.dtype)
        return self.weights


# ----------------------------------------------------------------------------- what a job says

def fp8_inventory(model) -> tuple[int, int, int]:
    """(fp8 weights, their bytes, their bytes in the compute dtype) of an SPart."""
    from fastdecode.model.layer_weights import fp8_weights
    itemsize = torch.finfo(model.dtype).bits // 8
    ws = list(fp8_weights(model.layers))
    return len(ws), sum(weight_bytes(w) for w in ws), sum(w.q.numel() * itemsize for w in ws)


def _mib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def startup_line(fmt: WeightFormat, model, path) -> str:
    """The start-up line of an fp8 job: what is fp8 and from where, the bytes saved, how the
    GEMMs run (path: fp8_gemm.Fp8Path)."""
    count, fp8, plain = fp8_inventory(model)
    dtype = str(model.dtype).removeprefix("torch.")
    saved = f"{_mib(plain - fp8)} saved" if not path.keep_dense else f"kept in {dtype} too: nothing saved here"
    line = (f"fp8 weights ({fmt.origin()}): {count} projections of {model.config.num_layers} layers in "
            f"float8_e4m3fn with per-channel scales, {_mib(fp8)} instead of {_mib(plain)} in {dtype} "
            f"({saved}); embeddings, norms and the LM head stay {dtype}; {path.describe(model.dtype)}")
    if fmt.checkpoint is not None and fmt.checkpoint.static_input_scales:
        line += "; the checkpoint's static input scales are not used (activations get one scale per token)"
    return line


def say_fp8(fmt: WeightFormat, model) -> None:
    """Print the start-up line of a job with fp8 weights (always: fp8 changes outputs, and its
    GEMM path the speed)."""
    if model.fp8:
        print(f"fastdecode: {startup_line(fmt, model, model.fp8_path)}", file=sys.stderr, flush=True)


def projection_shapes(c: ModelConfig) -> tuple[int, int]:
    """(elements, output rows) of every projection fp8 covers, from the config alone."""
    h, params, rows = c.hidden_size, 0, 0
    for i in range(c.num_layers):
        qkv = c.q_size + 2 * c.kv_size
        params, rows = params + h * qkv + c.q_size * h, rows + qkv + h
        if i in c.moe_layers:
            e, inter, shared = c.num_experts, c.moe_intermediate_size, c.shared_expert_intermediate_size
            params += 3 * h * (e * inter + shared)
            rows += e * (2 * inter + h) + (2 * shared + h if shared else 0)
        else:
            params, rows = params + 3 * h * c.intermediate_size, rows + 2 * c.intermediate_size + h
    return params, rows


def info_line(source, config: ModelConfig) -> str:
    """`fastdecode info --model`: whether the checkpoint is fp8, and what --quantization fp8 saves."""
    ckpt = checkpoint_fp8(source)
    params, rows = projection_shapes(config)
    fp8 = params + 4 * rows
    sizes = f"{_mib(fp8)} in fp8 against {_mib(2 * params)} in bf16"
    if ckpt is not None:
        return f"fp8 checkpoint ({ckpt.method}): served fp8 without --quantization; projections {sizes}"
    return f"--quantization fp8 stores the projections in {_mib(fp8)} instead of {_mib(2 * params)} in bf16 " \
           f"({_mib(2 * params - fp8)} saved); embeddings, norms and the LM head stay in the compute dtype"
