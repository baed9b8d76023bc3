"""kvserve: a high-throughput LLM inference and serving engine (vLLM V1 architecture).

The public names are imported lazily: worker and engine-core processes import
`kvserve.<subpackage>` without paying for the whole frontend.
"""
from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_EXPORTS = {
    "LLM": "kvserve.entrypoints.llm",
    "AsyncLLM": "kvserve.engine.async_llm",
    "EngineArgs": "kvserve.engine.arg_utils",
    "SamplingParams": "kvserve.sampling_params",
    "RequestOutputKind": "kvserve.sampling_params",
    "RequestOutput": "kvserve.outputs",
    "CompletionOutput": "kvserve.outputs",
    "Logprob": "kvserve.outputs",
    "LoRARequest": "kvserve.lora.request",
}
__all__ = [*_EXPORTS, "__version__"]


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'kvserve' has no attribute {name!r}")
