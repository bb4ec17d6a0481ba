"""`fastdecode info`: what this machine offers the S-worker and the R-workers."""
from __future__ import annotations

import os
import platform


def collect() -> dict:
    import psutil

    import fastdecode
    info = {"fastdecode": fastdecode.__version__, "python": platform.python_version(),
            "platform": platform.platform()}
    try:
        import rworker
        info["kernel_isa"] = rworker.selected_isa()
        info["kernel_isas_available"] = rworker.available_isas()
        feats = rworker.cpu_features()
        info["cpu_features"] = " ".join(sorted(feats))
        if os.environ.get("FASTDECODE_ISA"):
            info["kernel_isa_forced_by"] = f"FASTDECODE_ISA={os.environ['FASTDECODE_ISA']}"
        from rworker import tune
        info["kernel_candidates"] = " ".join(tune.label(*c) for c in tune.candidates())
        info["kernel_v_pairs"] = ("yes: --attn-probs bf16 (bf16 KV) adds V token pairs to the tune"
                                  if tune.pairs_allowed(None, "bf16", True) else "no (needs AVX512-BF16)")
        info["kernel_amx"] = ("AMX-BF16 present: FASTDECODE_AMX=1 puts the scores (bf16 KV and queries, GQA 2..16) "
                              "on the tiles; off by default until measured here" if "amx-bf16" in feats
                              else "no (needs AMX-BF16: Xeon Sapphire Rapids or later)")
        info["kernel_int8"] = int8_path(feats)
        info["kv_bytes_per_token"] = kv_bytes_line()
        info["kernel_tune"] = ("at R-worker start (FASTDECODE_KERNEL_TUNE=0: off)" if tune.tune_enabled()
                               else "off (FASTDECODE_KERNEL_TUNE=0): the first candidate runs")
    except Exception as e:  # a broken build must still let info report the rest
        info["kernel_isa"] = f"unavailable ({type(e).__name__}: {e})"
    info["cpu_cores_physical"] = psutil.cpu_count(logical=False)
    info["cpu_cores_logical"] = psutil.cpu_count(logical=True)
    if hasattr(os, "sched_getaffinity"):
        info["cpu_affinity"] = len(os.sched_getaffinity(0))
    info["memory_gb"] = round(psutil.virtual_memory().total / 2**30, 1)
    info["memory_available_gb"] = round(psutil.virtual_memory().available / 2**30, 1)
    try:
        import mpi4py
        from mpi4py import MPI
        info["mpi4py"] = mpi4py.__version__
        info["mpi_library"] = MPI.Get_library_version().splitlines()[0].strip()
        info["mpi_world_size"] = MPI.COMM_WORLD.Get_size()
    except Exception as e:
        info["mpi4py"] = f"unavailable ({type(e).__name__}: {e})"
    try:
        import torch
        info["torch"] = torch.__version__
        info["torch_threads"] = torch.get_num_threads()
        info["cuda_available"] = torch.cuda.is_available()
        if torch.cuda.is_available():
            info["cuda_devices"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    except ImportError:
        info["torch"] = "not installed (R-worker-only node)"
    return info


def int8_path(features) -> str:
    """Which instructions run int8 KV's dot products here (csrc/avx512/quant.h), as a store sees it."""
    from rworker import KVStore
    store = KVStore(1, 1, 16, "int8", threads=1)
    if store.vnni:
        return "vpdpbusd (AVX512-VNNI)"
    if store.isa == "avx512":
        return "vpmaddubsw (AVX-512BW" + (", FASTDECODE_VNNI=0)" if "avx512vnni" in features else ", no VNNI)")
    return {"avx2": "vpmaddubsw (AVX2)", "avx512emu": "SIMDe emulation (tests)"}.get(store.isa, "plain C++")


def kv_bytes_line(model: str = "smollm2-135m") -> str:
    """K and V bytes per token (all layers) of the default model in each store dtype."""
    from fastdecode.model.presets import PRESETS
    from rworker.protocol.kvformat import KV_DTYPES, kv_token_bytes
    c = PRESETS[model]
    per = {dt: c["num_hidden_layers"] * kv_token_bytes(dt, c["num_key_value_heads"], c["head_dim"]) for dt in KV_DTYPES}
    return f"{model}: " + ", ".join(f"{dt} {b / 1024:.1f} KiB" for dt, b in per.items()) + " (int8: scales included)"


def model_info(model: str) -> dict:
    """The architecture of `model` (a path, an embedded name or a random: spec) as a job would serve
    it: read from its config alone; ConfigError if fastdecode does not serve it."""
    from fastdecode.model.config import SUPPORTED_ARCHS
    from fastdecode.model.source import read_config, resolve_model
    c = read_config(resolve_model(model))
    variants = c.attention_variants() if hasattr(c, "attention_variants") else ""
    return {"model": model,
            "model_architecture": f"{c.model_type}: {c.num_layers} layers, {c.num_heads} query / {c.num_kv_heads} "
                                  f"KV heads x {c.head_dim}",
            "model_attention": variants or "full attention on every layer",
            "model_kv_bytes_per_token": ", ".join(f"{dt} {c.kv_bytes_per_token(dt) / 1024:.1f} KiB"
                                                  for dt in ("bf16", "int8")),
            "model_families_served": ", ".join(sorted(SUPPORTED_ARCHS))}


def render(info: dict) -> str:
    width = max(len(k) for k in info)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in info.items())
