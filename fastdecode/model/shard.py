"""One tensor-parallel rank's share of a model's weights (`--tensor-parallel-size T`), Megatron's
way: every projection split across the T S-ranks so that each holds 1/T of it and a layer needs
two all-reduces of its output rows.

- column-parallel (the output rows split): Q, K and V by heads (rank r holds query heads
  r*Hq/T.. and KV heads r*Hkv/T.., so its query heads' KV heads are its own), gate and up (each
  1/T of the intermediate rows), every routed expert's gate and up, the shared expert's; a fused
  checkpoint tensor (Phi-3's qkv_proj and gate_up_proj, transformers' fused experts) is cut part
  by part, so the rank's slice is again [its q | its k | its v] or [its gate | its up];
- row-parallel (the input columns split): O, down, every expert's down, the shared expert's;
  their outputs are partial sums the S-part all-reduces, and their biases are added once, after;
- vocab-parallel: the LM head's rows, V padded up to a multiple of T with zero rows (the padded
  logits are dropped after the gather); a tied head is cut from the replicated embedding;
- replicated: the embedding, the norms, q/k norms, the MoE router and Qwen2-MoE's shared expert
  gate, the O and down biases.
fp8 weights keep their per-output-row scales: a column-parallel slice takes its rows' scales, a
row-parallel one keeps them all (each output row's scale covers the whole row, every rank's part).
A float weight quantized at load is quantized whole before a row-parallel cut, so its scales are
the whole rows' (the same numbers as T = 1).

Names are the S-part's (model.layers.N.*, weights.our_name); shapes: h = hidden, D = head_dim,
I = intermediate (MoE: the expert's), E = experts.
"""
from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass

import torch

from fastdecode.model.config import ModelConfig
from fastdecode.model.errors import ConfigError

_ATTN = r"model\.layers\.\d+\.self_attn\."
_MLP = r"model\.layers\.\d+\.(?:mlp|block_sparse_moe)\."
_COLUMN = re.compile(_ATTN + r"(q|k|v|qkv)_proj\.(weight|bias)(_scale)?"
                     r"|" + _MLP + r"(?:shared_expert\.|experts\.\d+\.)?(gate_proj|up_proj|w1|w3|gate_up_proj)"
                                   r"\.weight(_scale)?")
_FUSED_EXPERTS_UP = re.compile(_MLP + r"experts\.gate_up_proj")
_ROW = re.compile(_ATTN + r"o_proj\.weight|" + _MLP + r"(?:shared_expert\.|experts\.\d+\.)?(down_proj|w2)\.weight")
_FUSED_EXPERTS_DOWN = re.compile(_MLP + r"experts\.down_proj")
_SINKS = re.compile(_ATTN + r"sinks")


@dataclass(frozen=True, slots=True)
class Shard:
    """Rank `rank` of `size` tensor-parallel S-ranks."""
    rank: int
    size: int

    def span(self, n: int) -> slice:
        """Its 1/size of n rows (n a multiple of size)."""
        part = n // self.size
        return slice(self.rank * part, (self.rank + 1) * part)

    def vocab_rows(self, vocab: int) -> tuple[int, int, int]:
        """(first row, end row, rows per rank) of its LM-head slice: V padded to a multiple of size."""
        per = -(-vocab // self.size)
        start = min(self.rank * per, vocab)
        return start, min(start + per, vocab), per


def split_error(config: ModelConfig, size: int) -> str | None:
    """Why `size` S-ranks cannot each hold 1/size of this model (heads, KV heads, MLP widths), or None.
    The vocabulary never refuses: it is padded."""
    c = config
    if size == 1:
        return None
    if c.num_heads % size or c.num_kv_heads % size:
        return (f"--tensor-parallel-size {size} must divide the model's {c.num_heads} query heads and "
                f"{c.num_kv_heads} KV heads (each S-rank holds whole heads, its query heads' KV heads with them)")
    widths = [("intermediate_size", c.intermediate_size if len(c.moe_layers) < c.num_layers else 0),
              ("moe_intermediate_size", c.moe_intermediate_size if c.moe_layers else 0),
              ("shared_expert_intermediate_size", c.shared_expert_intermediate_size if c.moe_layers else 0)]
    for name, width in widths:
        if width % size:
            return (f"--tensor-parallel-size {size} must divide the model's {name} {width} (each S-rank holds "
                    f"1/{size} of every MLP's rows; fastdecode does not pad them)")
    if c.attn_sinks:
        return f"--tensor-parallel-size {size}: attention sinks are not split across S-ranks"
    return None


def local_config(config: ModelConfig, size: int) -> ModelConfig:
    """The config of one rank's slice: 1/size of the heads and MLP widths, an untied LM head (its
    own slice of rows); the vocabulary stays the model's (token ids and the gathered logits)."""
    error = split_error(config, size)
    if error:
        raise ConfigError(error)
    c = config
    return dataclasses.replace(
        c, num_heads=c.num_heads // size, num_kv_heads=c.num_kv_heads // size,
        intermediate_size=c.intermediate_size // size if len(c.moe_layers) < c.num_layers else c.intermediate_size,
        moe_intermediate_size=c.moe_intermediate_size // size,
        shared_expert_intermediate_size=c.shared_expert_intermediate_size // size,
        tie_word_embeddings=False)


def _parts(config: ModelConfig, name: str) -> tuple[list[int], int] | None:
    """A column-parallel tensor's fused parts (rows of each, cut separately) and the axis they lie
    on; None if `name` is not column-parallel."""
    c = config
    m = _COLUMN.fullmatch(name)
    if m is not None:
        proj = m.group(1) or m.group(4)
        if proj == "q":
            return [c.q_size], 0
        if proj in ("k", "v"):
            return [c.kv_size], 0
        if proj == "qkv":
            return [c.q_size, c.kv_size, c.kv_size], 0
        expert = ".experts." in name or ".shared_expert." in name
        width = (c.shared_expert_intermediate_size if ".shared_expert." in name else c.moe_intermediate_size) \
            if expert else c.intermediate_size
        return ([width, width] if proj == "gate_up_proj" else [width]), 0
    if _FUSED_EXPERTS_UP.fullmatch(name):
        return [c.moe_intermediate_size] * 2, 1                         # [E, 2I, h]: the rows are axis 1
    if _SINKS.fullmatch(name):
        return [c.num_heads], 0
    return None


def rule(config: ModelConfig, name: str) -> str:
    """How tensor `name` splits: "column", "row", "vocab" or "replicated"."""
    if _parts(config, name) is not None:
        return "column"
    if _ROW.fullmatch(name) or _FUSED_EXPERTS_DOWN.fullmatch(name):
        return "row"
    if name == "lm_head.weight":
        return "vocab"
    return "replicated"


def take(config: ModelConfig, shard: Shard, name: str, shape: tuple, read):
    """Rank `shard`'s part of tensor `name` (its full `shape`), reading only that part:
    read(index) returns the tensor at a tuple of slices (safetensors' get_slice takes them, as
    does a tensor). A per-tensor fp8 scale (one value) is everyone's."""
    full = tuple(slice(None) for _ in shape)
    how = rule(config, name)
    if how == "replicated" or (name.endswith("_scale") and _numel(shape) == 1):
        return read(full)
    if how == "column":
        parts, axis = _parts(config, name)
        pieces, start = [], 0
        for rows in parts:
            own = shard.span(rows)
            index = full[:axis] + (slice(start + own.start, start + own.stop),) + full[axis + 1:]
            pieces.append(read(index))
            start += rows
        return pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=axis)
    if how == "row":
        if name.endswith("_scale"):
            return read(full)                                   # per output row: unaffected
        return read(full[:-1] + (shard.span(shape[-1]),))
    first, end, per = shard.vocab_rows(shape[0])               # vocab: rows, zero-padded to `per`
    rows = read((slice(first, end),) + full[1:])
    if end - first == per:
        return rows
    return torch.cat([rows, rows.new_zeros((per - (end - first),) + tuple(shape[1:]))])


def column_cut(weight, shard: Shard, config: ModelConfig, name: str):
    """Rank `shard`'s columns of a row-parallel weight already in memory (a tensor, or an fp8
    weight whose scales stay whole)."""
    from fastdecode.model.fp8 import Fp8Weight
    cols = shard.span(weight.shape[-1])
    if isinstance(weight, Fp8Weight):
        return Fp8Weight(weight.q[..., cols].contiguous(), weight.scale, weight.act_amax_ub)
    return weight[..., cols].contiguous()


def _numel(shape: tuple) -> int:
    n = 1
    for d in shape:
        n *= d
    return n
