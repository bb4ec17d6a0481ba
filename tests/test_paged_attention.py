"""The device tier's paged decode attention (fastdecode/rpart/paged_attention.py) against a float64
attention written here, on the torch path and the Triton path (on a machine without a GPU under
Triton's CPU interpreter, TRITON_INTERPRET=1 set before triton is imported; on a CUDA machine on
the GPU, where the last tests also run at realistic sizes).

Every case is built to catch reads it must not make: page ids are shuffled and scattered,
block-table entries past a row's length are -1 or far out of range, and every cache slot a row
must not read (unowned pages, the slots past its length in its last page, the keys before its
window) holds NaN, so one such read turns the output NaN.

Tolerances, per output element, from the error model of each path against the exact result
o = sum_t p_t v_t / denom with m = sum_t p_t |v_t| / denom:
- scores: the float32 dot of D products is off by at most D u scale max_t sum_i |q_i k_ti|
  (u = 2^-24), and its later steps (soft-cap tanh, the log2 scaling, the max subtraction, exp2)
  by a few u of |s| and the cap: serr below; each weight p_t then errs by at most 2 serr
  relatively (its own score's error and the max's), so o by 2 serr (|o| + m) -- doubled for slack;
- bf16/fp16: the weights are rounded to the cache dtype before the p.v product and o to the output
  dtype once: each at most one unit roundoff u_16 relatively, i.e. u_16 m + u_16 |o|. The
  interpreter truncates instead of rounding, which doubles that: the bound is eps (|o| + m),
  eps = 2^-7 (bf16) or 2^-10 (fp16), the dtype's machine epsilon;
- float32 sums over the splits and tokens: 8 u (|o| + m).
"""
from __future__ import annotations

import os

import numpy as np
import pytest
import torch

CUDA = torch.cuda.is_available()
if not CUDA:
    os.environ["TRITON_INTERPRET"] = "1"
try:
    import triton

    from fastdecode.rpart import paged_attention_triton as pat
except Exception:      # noqa: BLE001 - no triton: the torch path's tests still run
    pat = None

from fastdecode.rpart import paged_attention as pa  # noqa: E402

DEVICE = torch.device("cuda" if CUDA else "cpu")
U32 = 2.0 ** -24
EPS = {torch.float32: 0.0, torch.bfloat16: 2.0 ** -7, torch.float16: 2.0 ** -10}
GARBAGE_PAGE = 2 ** 30                 # a block-table entry that faults (or fails) if ever used
needs_triton = pytest.mark.skipif(pat is None, reason="triton is not importable")
PATHS = ["torch", pytest.param("triton", marks=needs_triton)]


# ----------------------------------------------------------------------------- the float64 reference

def reference(q, k_cache, v_cache, block_tables, seq_lens, scale, window=0, softcap=0.0, sinks=None):
    """-> (o, m, serr): o [n, Hq, D] float64 attention; m [n, Hq, D] = sum_t p_t |v_t| / denom;
    serr [n, Hq] the float32 score error bound of the module docstring. Row by row in numpy,
    reading only [max(0, len - W), len) through the block table."""
    q = q.double().cpu().numpy()
    bt = block_tables.cpu().numpy()
    lens = seq_lens.cpu().numpy()
    n, hq, d = q.shape
    page, hkv = k_cache.shape[1], k_cache.shape[2]
    group = hq // hkv
    sink = sinks.double().cpu().numpy().reshape(hkv, group, 1) if sinks is not None else np.full((hkv, group, 1), -np.inf)
    o = np.zeros((n, hq, d))
    m = np.zeros((n, hq, d))
    serr = np.zeros((n, hq))
    for i in range(n):
        pos = torch.arange(max(0, int(lens[i]) - window) if window else 0, int(lens[i]))
        ids = torch.as_tensor(bt[i])[pos // page].long().to(k_cache.device)
        slot = (pos % page).to(k_cache.device)
        keys = k_cache[ids, slot].transpose(0, 1).double().contiguous().cpu().numpy()   # [Hkv, T, D]
        vals = v_cache[ids, slot].transpose(0, 1).double().contiguous().cpu().numpy()
        qi = q[i].reshape(hkv, group, d)                                          # [Hkv, G, D]
        # einsum, not BLAS: small batched products, and no thread pool to fight over shared cores
        s = np.einsum("hgd,htd->hgt", qi, keys) * scale                           # [Hkv, G, T]
        dots = np.einsum("hgd,htd->hgt", np.abs(qi), np.abs(keys)).max(axis=-1, initial=0.0)
        serr[i] = (U32 * (d * scale * dots + 4 * np.abs(s).max(axis=-1, initial=0.0) + 4 * softcap + 4)).ravel()
        if softcap:
            s = softcap * np.tanh(s / softcap)
        top = np.maximum(s.max(axis=-1, keepdims=True, initial=-np.inf), sink)    # [Hkv, G, 1]
        live = np.isfinite(top)                                                   # no keys, no sink: zeros
        top = np.where(live, top, 0.0)
        e = np.exp(s - top)
        denom = e.sum(axis=-1, keepdims=True) + np.exp(sink - top)
        denom = np.where(live, denom, 1.0)
        o[i] = (np.einsum("hgt,htd->hgd", e, vals) / denom).reshape(hq, d)
        m[i] = (np.einsum("hgt,htd->hgd", e, np.abs(vals)) / denom).reshape(hq, d)
    return o, m, serr


def assert_close(out, q, k_cache, v_cache, block_tables, seq_lens, scale, **variants):
    assert_within(out, reference(q, k_cache, v_cache, block_tables, seq_lens, scale, **variants))


def assert_within(out, expected):
    """out against reference()'s (o, m, serr) within the module docstring's bound."""
    o, m, serr = expected
    assert out.shape == o.shape
    got = out.double().cpu().numpy()
    assert not np.isnan(got).any(), "NaN in the output: a masked or unowned slot was read"
    tol = (4 * serr[..., None] + EPS[out.dtype] + 8 * U32) * (np.abs(o) + m) + 1e-30
    bad = np.abs(got - o) > tol
    worst = np.unravel_index(np.argmax(np.abs(got - o) / tol), o.shape)
    assert not bad.any(), (f"{int(bad.sum())} of {bad.size} elements off; worst at {worst}: "
                           f"error / bound = {float((np.abs(got - o) / tol).max()):.2f}")


# ----------------------------------------------------------------------------- cases

def build(lens, hq, hkv, d, page, dtype, cache_dtype=None, window=0, spare_pages=3, seed=0, q_scale=1.0):
    """A paged cache for rows of `lens` keys: each row's pages scattered over a shuffled pool,
    entries past its length -1 (even rows) or GARBAGE_PAGE (odd), every slot it must not read NaN."""
    g = torch.Generator().manual_seed(seed)
    cache_dtype = cache_dtype or dtype
    owned = [-(-ln // page) for ln in lens]
    num_pages = sum(owned) + spare_pages
    order = torch.randperm(num_pages, generator=g)
    width = max(owned) + 2
    bt = torch.empty(len(lens), width, dtype=torch.int32)
    k = torch.randn(num_pages, page, hkv, d, generator=g)
    v = torch.randn(num_pages, page, hkv, d, generator=g)
    readable = torch.zeros(num_pages, page, dtype=torch.bool)
    at = 0
    for i, ln in enumerate(lens):
        ids = order[at:at + owned[i]]
        at += owned[i]
        bt[i] = -1 if i % 2 == 0 else GARBAGE_PAGE
        bt[i, :owned[i]] = ids
        pos = torch.arange(max(0, ln - window) if window else 0, ln)
        readable[ids[pos // page], pos % page] = True
    k[~readable] = float("nan")
    v[~readable] = float("nan")
    q = torch.randn(len(lens), hq, d, generator=g) * q_scale
    return (q.to(dtype).to(DEVICE), k.to(cache_dtype).to(DEVICE), v.to(cache_dtype).to(DEVICE),
            bt.to(DEVICE), torch.tensor(lens, dtype=torch.int32, device=DEVICE))


def ragged(page: int) -> list[int]:
    """1 key, exactly a page, a page and one, and two longer rows."""
    return [1, page, page + 1, 3 * page + 5, 4 * page - 3]


# name: (hq, hkv, d, page, dtype, cache dtype, window, softcap, sinks)
CASES = {
    "mha-d64-p16-fp32": (2, 2, 64, 16, torch.float32, None, 0, 0.0, False),
    "smollm2-g3-d64-p16-bf16": (9, 3, 64, 16, torch.bfloat16, None, 0, 0.0, False),
    "g4-d128-p32-fp32-window-in-page": (8, 2, 128, 32, torch.float32, None, 21, 0.0, False),
    "g8-d128-p16-bf16-softcap": (8, 1, 128, 16, torch.bfloat16, None, 0, 5.0, False),
    "g4-d64-p32-fp32-sinks": (4, 1, 64, 32, torch.float32, None, 0, 0.0, True),
    "g3-d64-p16-bf16-all": (6, 2, 64, 16, torch.bfloat16, None, 19, 8.0, True),
    "g4-d64-p16-fp32-window-over-context": (4, 1, 64, 16, torch.float32, None, 1000, 0.0, False),
    "g4-d96-p16-fp16-window": (4, 1, 96, 16, torch.float16, None, 37, 0.0, False),
    "g1-d128-p32-bf16q-fp32cache-all": (2, 2, 128, 32, torch.bfloat16, torch.float32, 40, 3.0, True),
    "g2-d64-p128-fp32-window": (4, 2, 64, 128, torch.float32, None, 150, 0.0, False),   # blocks inside a page
}


def run_case(name, path, monkeypatch, **kwargs):
    hq, hkv, d, page, dtype, cache_dtype, window, softcap, with_sinks = CASES[name]
    q, k, v, bt, lens = build(ragged(page), hq, hkv, d, page, dtype, cache_dtype, window, q_scale=2.0)
    sinks = (torch.randn(hq, generator=torch.Generator().manual_seed(7)) * 2).to(DEVICE) if with_sinks else None
    monkeypatch.setenv(pa.ENV, path)
    out = pa.paged_decode_attention(q, k, v, bt, lens, d ** -0.5, window=window, softcap=softcap, sinks=sinks,
                                    **kwargs)
    return out, (q, k, v, bt, lens, d ** -0.5), {"window": window, "softcap": softcap, "sinks": sinks}


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("name", list(CASES))
def test_against_float64(name, path, monkeypatch):
    out, args, variants = run_case(name, path, monkeypatch)
    assert_close(out, *args, **variants)


def count_merges(monkeypatch) -> list:
    """The grids the split merge kernel is launched with, from now on."""
    grids, kernel = [], pat._merge_splits_kernel

    class Spy:
        def __getitem__(self, grid):
            grids.append(grid)
            return kernel[grid]
    monkeypatch.setattr(pat, "_merge_splits_kernel", Spy())
    return grids


@needs_triton
@pytest.mark.parametrize("name", ["smollm2-g3-d64-p16-bf16", "g4-d128-p32-fp32-window-in-page", "g3-d64-p16-bf16-all"])
def test_split_kv_equals_one_split(name, monkeypatch):
    """Forced splits (with one page per loop iteration, so that a split holds several) against one
    split: both within the reference's bound, and equal to each other within float32's sums."""
    monkeypatch.setattr(pat, "TILE_BYTES", 1)              # BLOCK_T = 16 tokens: many blocks per split
    merges = count_merges(monkeypatch)
    one, args, variants = run_case(name, "triton", monkeypatch, num_splits=1)
    assert merges == []
    split, _, _ = run_case(name, "triton", monkeypatch, num_splits=3)
    assert merges == [(len(ragged(CASES[name][3])), CASES[name][0])]     # the merge ran, per (row, head)
    expected = reference(*args, **variants)
    assert_within(one, expected)
    assert_within(split, expected)
    o, m, _ = expected
    diff = (one.double() - split.double()).abs().cpu().numpy()
    # the two differ by the float32 summation order, and by a rounding to the output dtype
    assert (diff <= (2 * EPS[one.dtype] + 64 * U32) * (np.abs(o) + m) + 1e-30).all(), float(diff.max())


@needs_triton
def test_automatic_splits_for_few_rows(monkeypatch):
    """One row and one KV head: the automatic plan splits it (the CPU counts as 4 SMs), and the
    result is the reference's."""
    q, k, v, bt, lens = build([300], 4, 1, 64, 16, torch.float32, seed=3)
    monkeypatch.setattr(pat, "TILE_BYTES", 1)
    splits, _ = pat.plan_splits(1, 1, bt.shape[1] * 16, 16, pat.program_slots(q.device))
    assert splits > 1
    monkeypatch.setenv(pa.ENV, "triton")
    merges = count_merges(monkeypatch)
    assert_close(pa.paged_decode_attention(q, k, v, bt, lens, 0.125), q, k, v, bt, lens, 0.125)
    assert merges == [(1, 4)]


def test_plan_splits_by_hand():
    slots = 4 * 132                                          # an H100's SMs x PROGRAMS_PER_SM
    if pat is None:
        pytest.skip("triton is not importable")
    assert pat.plan_splits(4096, 8, 8192, 64, slots) == (1, 8192)        # the rows fill the card
    assert pat.plan_splits(1, 8, 100, 64, slots) == (1, 128)             # too short to split
    # 8 programs want 66 splits: capped at 64, each ceil(8192 / 64) = 128 tokens = 2 blocks
    assert pat.plan_splits(1, 8, 8192, 64, slots) == (64, 128)
    # 64 programs want ceil(528 / 64) = 9: ceil(4096 / 9) = 456 -> 512 tokens (8 blocks), 8 splits
    assert pat.plan_splits(8, 8, 4096, 64, slots) == (8, 512)
    assert pat.block_tokens(128, 2) == 64 and pat.block_tokens(128, 4) == 32
    assert pat.block_tokens(64, 2) == 128 and pat.block_tokens(256, 4) == 16 and pat.block_tokens(8, 4) == 256


@pytest.mark.parametrize("path", PATHS)
def test_decode_after_write_kv(path, monkeypatch):
    """Tokens stored one step at a time by write_kv into scattered pages, then attended: the
    same as the reference over the stored values; a slot write_kv did not touch is never read."""
    hq, hkv, d, page = 6, 2, 64, 16
    g = torch.Generator().manual_seed(11)
    num_pages = 12
    k_cache = torch.full((num_pages, page, hkv, d), float("nan"), device=DEVICE)
    v_cache = torch.full_like(k_cache, float("nan"))
    lens = [5, 23, 40]
    order = torch.randperm(num_pages, generator=g)
    bt = torch.full((3, 4), -1, dtype=torch.int32)
    bt[0, :1], bt[1, :2], bt[2, :3] = order[:1], order[1:3], order[3:6]
    keys = [torch.randn(ln, hkv, d, generator=g) for ln in lens]
    vals = [torch.randn(ln, hkv, d, generator=g) for ln in lens]
    for step in range(max(lens)):                            # one token per live row per step
        rows = [i for i, ln in enumerate(lens) if step < ln]
        slots = torch.tensor([int(bt[i, step // page]) * page + step % page for i in rows], device=DEVICE)
        pa.write_kv(k_cache, v_cache, slots, torch.stack([keys[i][step] for i in rows]).to(DEVICE),
                    torch.stack([vals[i][step] for i in rows]).to(DEVICE))
    for i, ln in enumerate(lens):                            # what was written is where it belongs
        pos = torch.arange(ln)
        assert torch.equal(k_cache[bt[i, pos // page].long(), pos % page].cpu(), keys[i])
        assert torch.equal(v_cache[bt[i, pos // page].long(), pos % page].cpu(), vals[i])
    q = torch.randn(3, hq, d, generator=g).to(DEVICE)
    bt, seq = bt.to(DEVICE), torch.tensor(lens, dtype=torch.int32, device=DEVICE)
    monkeypatch.setenv(pa.ENV, path)
    assert_close(pa.paged_decode_attention(q, k_cache, v_cache, bt, seq, 0.125), q, k_cache, v_cache, bt, seq, 0.125)


def test_write_kv_casts_and_refuses_bad_shapes():
    k_cache = torch.zeros(2, 4, 1, 8, dtype=torch.bfloat16)
    v_cache = torch.zeros_like(k_cache)
    new = torch.randn(1, 1, 8)
    pa.write_kv(k_cache, v_cache, torch.tensor([5]), new, -new)
    assert torch.equal(k_cache[1, 1], new[0].bfloat16()) and torch.equal(v_cache[1, 1], -new[0].bfloat16())
    with pytest.raises(ValueError, match=r"k, v \[m, Hkv, D\]"):
        pa.write_kv(k_cache, v_cache, torch.tensor([5]), torch.randn(1, 2, 8), torch.randn(1, 2, 8))
    with pytest.raises(ValueError, match="no flat slot view"):
        pa.write_kv(k_cache.transpose(0, 1), v_cache.transpose(0, 1), torch.tensor([5]), new, new)


def test_backend_choice(monkeypatch):
    q = torch.zeros(1, 2, 64)
    monkeypatch.delenv(pa.ENV, raising=False)
    assert pa.backend_for(q, 64) == "torch"                  # CPU tensors: torch unless forced
    monkeypatch.setenv(pa.ENV, "torch")
    assert pa.backend_for(q, 64) == "torch"
    monkeypatch.setenv(pa.ENV, "cuda")
    with pytest.raises(ValueError, match="FASTDECODE_PAGED_ATTN='cuda': expected one of auto, torch, triton"):
        pa.backend_for(q, 64)
    if pat is not None:
        monkeypatch.setenv(pa.ENV, "triton")
        assert pa.backend_for(q, 64) == "triton"
        with pytest.raises(ValueError, match="head dim 512"):
            pa.backend_for(q, 512)


def test_bad_inputs_are_named():
    q, k, v, bt, lens = build([3, 17], 4, 2, 64, 16, torch.float32)
    call = pa.paged_decode_attention
    with pytest.raises(ValueError, match="Hq must be a multiple of Hkv"):
        call(q[:, :3], k, v, bt, lens, 0.1)
    with pytest.raises(ValueError, match="block_tables must be .* int32"):
        call(q, k, v, bt.long(), lens, 0.1)
    with pytest.raises(ValueError, match="seq_lens must be"):
        call(q, k, v, bt, lens[:1], 0.1)
    with pytest.raises(ValueError, match="must both be q's"):
        call(q.half(), k, v.half(), bt, lens, 0.1)
    with pytest.raises(ValueError, match="page_tokens must be a power of two"):
        call(q, k[:, :12], v[:, :12], bt, lens, 0.1)
    with pytest.raises(ValueError, match=r"sinks must be \[Hq=4\]"):
        call(q, k, v, bt, lens, 0.1, sinks=torch.zeros(2, device=DEVICE))
    with pytest.raises(ValueError, match=r"seq_lens\[1\] = 99 is more than block_tables row 1 holds"):
        pa.paged_decode_torch(q, k, v, bt, torch.tensor([3, 99], dtype=torch.int32, device=DEVICE), 0.1)


# ----------------------------------------------------------------------------- compiled for Hopper

HOPPER_COMPILE = """
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from fastdecode.rpart import paged_attention_triton as pat

def build(fn, pointers, consts, scalars):
    names = fn.arg_names
    sig = {n: pointers.get(n) or ("constexpr" if n in consts else scalars.get(n, "i32")) for n in names}
    div16 = {(names.index(n),): [["tt.divisibility", 16]] for n in names if n in pointers or n.startswith("stride")}
    src = ASTSource(fn, sig, {(names.index(k),): v for k, v in consts.items()}, div16)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4, "num_stages": 3})

for dt, ieee, extra in (("bf16", False, {}), ("fp32", True, {"HAS_SOFTCAP": True, "HAS_SINKS": True, "SPLIT": True, "BLOCK_T": 32})):
    consts = dict(G=3, G_PAD=16, D=128, D_PAD=128, PAGE=16, BLOCK_T=64, SPLIT=False, HAS_SOFTCAP=False,
                  HAS_SINKS=False, IEEE=ieee, DOT_FP32=False) | extra
    pointers = {n: "*" + dt for n in ("q_ptr", "k_ptr", "v_ptr", "out_ptr")}
    pointers.update({n: "*i32" for n in ("bt_ptr", "lens_ptr")})
    pointers.update({n: "*fp32" for n in ("sinks_ptr", "pacc_ptr", "pm_ptr", "pl_ptr")})
    ptx = build(pat._paged_decode_kernel, pointers, consts, {"scale": "fp32", "softcap": "fp32"}).asm["ptx"]
    # K and V tiles reach shared memory by 16-byte asynchronous copies (pipelined); bf16 by MMA
    assert "cp.async.cg.shared.global" in ptx and ("mma.sync" in ptx or ieee), dt
pointers = {n: "*fp32" for n in ("pacc_ptr", "pm_ptr", "pl_ptr", "sinks_ptr")} | {"out_ptr": "*bf16"}
build(pat._merge_splits_kernel, pointers, dict(S_PAD=64, D=128, D_PAD=128, HAS_SINKS=True), {})
print("compiled")
"""


@pytest.mark.skipif(CUDA or pat is None, reason="on a GPU every test compiles the kernels for real")
def test_compiles_for_hopper():
    """The interpreter runs what the compiler may refuse (a non-constexpr global, a dot shape):
    both kernels compiled ahead of time for sm_90 by Triton's own ptxas, no GPU needed."""
    import shutil
    import subprocess
    import sys
    ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
    if not (os.path.exists(ptxas) or shutil.which("ptxas")):
        pytest.skip("no ptxas in this triton")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["TRITON_DEFAULT_FP_FUSION"] = "1"
    proc = subprocess.run([sys.executable, "-c", HOPPER_COMPILE], capture_output=True, text=True, env=env,
                          timeout=300, check=False)
    assert proc.returncode == 0 and "compiled" in proc.stdout, proc.stderr[-3000:]


# ----------------------------------------------------------------------------- CUDA, realistic sizes

cuda_only = pytest.mark.skipif(not CUDA or pat is None, reason="needs a CUDA device and triton")


@cuda_only
@pytest.mark.parametrize("shape", [(32, 8, 128, 16), (9, 3, 64, 16), (16, 8, 256, 32)],
                         ids=["llama3-8b", "smollm2", "gemma-d256"])
@pytest.mark.parametrize("variants", [{}, {"window": 1000, "softcap": 30.0, "sinks": True}], ids=["plain", "all"])
def test_cuda_realistic(shape, variants, monkeypatch):
    """64 rows of 1 to ~4k keys (and the lengths that end pages), then 2 rows of 8k (the card
    underfilled: splits), bf16, against the float64 reference; one split and auto agree."""
    hq, hkv, d, page = shape
    rng = np.random.default_rng(5)
    lens = [1, page, page + 1, *rng.integers(2, 4200, size=61).tolist()]
    window = variants.get("window", 0)
    sinks = torch.randn(hq, device=DEVICE) if variants.get("sinks") else None
    kw = {"window": window, "softcap": variants.get("softcap", 0.0), "sinks": sinks}
    monkeypatch.setenv(pa.ENV, "triton")
    for rows in (lens, [8191, 8192]):
        q, k, v, bt, seq = build(rows, hq, hkv, d, page, torch.bfloat16, window=window, seed=len(rows))
        expected = reference(q, k, v, bt, seq, d ** -0.5, **kw)
        assert_within(pa.paged_decode_attention(q, k, v, bt, seq, d ** -0.5, **kw), expected)
        assert_within(pa.paged_decode_attention(q, k, v, bt, seq, d ** -0.5, num_splits=1, **kw), expected)
        assert_within(pa.paged_decode_torch(q, k, v, bt, seq, d ** -0.5, **kw), expected)


@cuda_only
def test_cuda_graph_capture(monkeypatch):
    """The Triton path syncs nothing: it captures into a CUDA graph and replays to the same output."""
    monkeypatch.setenv(pa.ENV, "triton")
    q, k, v, bt, seq = build([5, 300, 2000], 32, 8, 128, 16, torch.bfloat16, seed=9)
    out = torch.empty_like(q)
    pa.paged_decode_attention(q, k, v, bt, seq, 0.088, out=out)          # compile outside the capture
    expected = out.clone()
    out.zero_()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        pa.paged_decode_attention(q, k, v, bt, seq, 0.088, out=out)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, expected)
