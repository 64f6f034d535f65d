"""NanoInfer: from checkpoint to conversation — minimal, fast, and clear.

The functional core lives here; the user-facing engine classes live in `runtime` and are
re-exported lazily (the core never imports the runtime at import time).
"""

from nanoinfer.errors import CheckpointError, ModelFetchError, NanoInferError, RequestError
from nanoinfer.sampling.sampler import SamplingParams

__all__ = ["LLM", "AsyncEngine", "SamplingParams", "RequestOutput", "CompletionOutput", "EngineError",
           "CheckpointError", "ModelFetchError", "NanoInferError", "RequestError"]

_RUNTIME_EXPORTS = {"LLM": "runtime.llm", "AsyncEngine": "runtime.async_engine", "EngineError": "runtime.async_engine",
                    "RequestOutput": "runtime.engine.outputs", "CompletionOutput": "runtime.engine.outputs"}


def __getattr__(name):
    if name in _RUNTIME_EXPORTS:
        import importlib

        return getattr(importlib.import_module(_RUNTIME_EXPORTS[name]), name)
    raise AttributeError(f"module 'nanoinfer' has no attribute {name!r}")
