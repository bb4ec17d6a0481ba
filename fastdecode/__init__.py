"""fastdecode: throughput-oriented LLM batch decoding with attention on CPU R-workers over MPI.

    from fastdecode import LLM, SamplingParams
    llm = LLM("smollm2-135m")
    outs = llm.generate(["Hello"], SamplingParams(max_tokens=32, temperature=0))

Imports are lazy so that `fastdecode` on an R-worker rank never loads torch.
"""
__version__ = "0.1.0"

from fastdecode.launch.omp_binding import spin_default  # noqa: E402  (before anything loads torch)

spin_default()

_LAZY = {
    "LLM": ("fastdecode.llm", "LLM"),
    "SamplingParams": ("fastdecode.engine.sampling_params", "SamplingParams"),
    "RequestOutput": ("fastdecode.engine.sampling_params", "RequestOutput"),
    "CompletionOutput": ("fastdecode.engine.sampling_params", "CompletionOutput"),
    "Logprob": ("fastdecode.engine.sampling_params", "Logprob"),
    "EngineArgs": ("fastdecode.engine.args", "EngineArgs"),
}
__all__ = list(_LAZY)


def __getattr__(name):
    if name in _LAZY:
        import importlib
        module, attr = _LAZY[name]
        return getattr(importlib.import_module(module), attr)
    raise AttributeError(f"module 'fastdecode' has no attribute {name!r}")
