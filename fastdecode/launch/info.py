"""`fastdecode info`: what this machine offers the S-worker and the R-workers."""
from __future__ import annotations

import os
import platform
import re
import shutil
import subprocess

LAUNCHERS = ("mpiexec", "mpirun")
FAMILY = {"Open MPI": "Open MPI", "MPICH Hydra": "MPICH", "Intel MPI": "MPICH"}   # who launches whom


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
        amx, why = tune.amx_here()
        info["kernel_amx"] = ("AMX usable: the R-worker's start-up tune times the tiles at GQA shapes (int8 KV on AMX-INT8; "
                              "bf16 KV with --attn-probs bf16: the scores, and PV) against AVX-512 and keeps the "
                              "faster; FASTDECODE_AMX=0/1 forces" if amx == "on"
                              else why or "no (needs AMX-BF16: Xeon Sapphire Rapids or later)")
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
        info["mpi_library"] = MPI.Get_library_version().replace("\0", "").splitlines()[0].strip()   # Open MPI's ends in NUL
        info["mpi_world_size"] = MPI.COMM_WORLD.Get_size()
    except Exception as e:
        info["mpi4py"] = f"unavailable ({type(e).__name__}: {e})"
    info.update(launcher_info(info.get("mpi_library")))
    try:
        import torch
        info["torch"] = torch.__version__
        info["torch_threads"] = torch.get_num_threads()
        from fastdecode.launch.omp_binding import binding, spin
        info["torch_thread_binding"] = binding()
        info["torch_thread_spin"] = spin()
        info["cuda_available"] = torch.cuda.is_available()
        if torch.cuda.is_available():
            info["cuda_devices"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
            free, total = torch.cuda.mem_get_info(0)
            info["device_kv_tier"] = (f"cuda:0, {free / 2**30:.1f} of {total / 2**30:.1f} GiB free: a GPU S-worker keeps "
                                      "KV there beside the R-workers (--device-kv-memory, default what the weights "
                                      "and activations leave under --gpu-memory-utilization)")
        else:
            info["device_kv_tier"] = ("a CPU S-worker beside R-workers keeps KV in its in-process store, a share of "
                                      "its node's memory, used where it pays (--device-kv-memory, --no-device-kv)")
        info["fp8_weights"] = fp8_line(torch)
    except ImportError:
        info["torch"] = "not installed (R-worker-only node)"
    return info


def library_family(library_version: str | None) -> str | None:
    """"Open MPI" or "MPICH" (MPICH and its ABI kin: Intel MPI, MVAPICH, Cray MPICH) from
    MPI_Get_library_version's text; None when unknown."""
    text = library_version or ""
    if "Open MPI" in text:
        return "Open MPI"
    if re.search(r"MPICH|MVAPICH|Intel\(R\) MPI", text):
        return "MPICH"
    return None


def launcher_flavour(version_text: str) -> str:
    """What `mpiexec --version` printed, as a flavour and version: "Open MPI 4.1.4", "MPICH Hydra
    5.0.2", "Intel MPI 2021.10", or "unknown"."""
    if m := re.search(r"\((?:Open MPI|OpenRTE)\) (\S+)", version_text):
        return f"Open MPI {m.group(1)}"
    if m := re.search(r"Intel\(R\) MPI Library.*?Version (\S+)", version_text):
        return f"Intel MPI {m.group(1).rstrip(',')}"
    if "HYDRA" in version_text:
        m = re.search(r"Version:\s+(\S+)", version_text)
        return "MPICH Hydra" + (f" {m.group(1)}" if m else "")
    return "unknown"


def flavour_family(flavour: str) -> str | None:
    return next((family for name, family in FAMILY.items() if flavour.startswith(name)), None)


def probe_launcher(path: str, timeout: float = 5.0) -> str:
    """The flavour of the launcher at `path` from its --version (no MPI starts)."""
    try:
        proc = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=timeout,
                              stdin=subprocess.DEVNULL)
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return launcher_flavour(proc.stdout + proc.stderr)


def launcher_info(library_version: str | None) -> dict:
    """mpi_launcher: the flavour of `mpiexec` and `mpirun` on PATH; mpi_warning when mpi4py's
    library is another MPI (launched by it, every rank would start alone: a world of 1)."""
    found = {name: shutil.which(name) for name in LAUNCHERS}
    flavours = {name: probe_launcher(path) for name, path in found.items() if path}
    if not flavours:
        return {"mpi_launcher": "none on PATH (mpiexec, mpirun)"}
    out = {"mpi_launcher": "; ".join(f"{name}: {flavours[name]} ({found[name]})" for name in flavours)}
    family = library_family(library_version)
    wrong = [f"{name} is {flavours[name]}" for name in flavours
             if family and flavour_family(flavours[name]) not in (None, family)]
    if wrong:
        out["mpi_warning"] = (f"mpi4py uses {family} but {' and '.join(wrong)}: a job it launches starts every "
                              f"rank alone (a world of 1) and stops; launch with {family}'s launcher or build "
                              "mpi4py against the launcher's MPI (docs/site_mpi.md)")
    return out


def library_before_init() -> tuple[str, str, str | None] | None:
    """(MPI_Get_library_version, extension path, libmpi path) of the library `from mpi4py import
    MPI` would load, without starting MPI (the standard allows that call before MPI_Init): the
    extension is loaded, not imported. None when unknown."""
    import ctypes
    import importlib.util
    try:
        spec = importlib.util.find_spec("mpi4py.MPI")
        if spec is None or not spec.origin:
            return None
        lib = ctypes.CDLL(spec.origin, mode=os.RTLD_LAZY | os.RTLD_LOCAL)
        text, length = ctypes.create_string_buffer(8192), ctypes.c_int(0)   # >= every MPI's maximum
        if lib.MPI_Get_library_version(text, ctypes.byref(length)) != 0:
            return None
    except Exception:  # noqa: BLE001 - a probe: no answer is an answer
        return None
    return text.value.decode(errors="replace"), spec.origin, loaded_libmpi()


def loaded_libmpi() -> str | None:
    """The MPI library this process has loaded (Linux: /proc/self/maps), or None."""
    try:
        with open("/proc/self/maps") as f:
            paths = {line.split()[-1] for line in f if "libmpi" in line}
    except OSError:
        return None
    return next((p for p in sorted(paths) if os.path.basename(p).startswith("libmpi.")), None)


def dual_abi_hint(origin: str | None, family: str) -> str | None:
    """mpi4py >= 4 wheels from PyPI carry an extension per MPI ABI (MPI.mpich.*.so, MPI.openmpi.*.so)
    and pick one at import: MPI4PY_MPIABI chooses the other. The hint when this one has `family`'s."""
    if not origin:
        return None
    abi = {"Open MPI": "openmpi", "MPICH": "mpich"}.get(family)
    here = os.path.dirname(origin)
    if abi and os.path.isdir(here) and any(n.startswith(f"MPI.{abi}.") for n in os.listdir(here)):
        return f"export MPI4PY_MPIABI={abi} (this mpi4py carries both ABIs{'; mpirun -x MPI4PY_MPIABI' if abi == 'openmpi' else ''})"
    return None


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


def fp8_line(torch) -> str:
    """What --quantization fp8 does on this machine's S-worker device (the probe of model/fp8_gemm.py)."""
    from fastdecode.model.fp8_gemm import path_for
    device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    return f"--quantization fp8 on {device}: " + path_for(device, dtype).describe(dtype)


def model_info(model: str, revision: str | None = None) -> dict:
    """The architecture of `model` (a path, a cached HF repo id, an embedded name or a random: spec)
    as a job would serve it: read from its config alone; ConfigError if fastdecode does not serve it."""
    from fastdecode.model.config import SUPPORTED_ARCHS
    from fastdecode.model.quantization import info_line
    from fastdecode.model.source import read_config, resolve_model
    source = resolve_model(model, revision)
    c = read_config(source)
    variants = c.attention_variants()
    return {"model": model + (f" ({source.path})" if source.repo_id else ""),
            "model_architecture": f"{c.model_type}: {c.num_layers} layers, {c.num_heads} query / {c.num_kv_heads} "
                                  f"KV heads x {c.head_dim}",
            "model_attention": variants or "full attention on every layer",
            "model_kv_bytes_per_token": ", ".join(f"{dt} {c.kv_bytes_per_token(dt) / 1024:.1f} KiB"
                                                  for dt in ("bf16", "int8")),
            "model_weights": info_line(source, c),
            "model_families_served": ", ".join(sorted(SUPPORTED_ARCHS))}


def render(info: dict) -> str:
    width = max(len(k) for k in info)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in info.items())
