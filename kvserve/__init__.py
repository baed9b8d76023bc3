"""kvserve: a high-throughput LLM inference and serving engine (vLLM V1 architecture).

The public names are imported lazily: worker and engine-core processes import
`kvserve.<subpackage>` without paying for the whole frontend.
"""
from __future__ import annotations

import importlib
import os
from typing import Any

__version__ = "0.1.0"

# libgomp (torch's OpenMP) reads GOMP_SPINCOUNT once, when it loads. Its default keeps a
# finished parallel region's threads spinning ~300,000 rounds, holding a core that another
# thread or process may need. It was set for the packed GGUF kernels' own thread pool (demo
# decode, quiet 2-core Zen 3: default 58-63 tok/s, 1000: 80-88); they now run on OpenMP too
# (ops/csrc/quant_linear.cpp), where 1000, 30000 and the default measured level (demo Q8_0,
# Zen 5, 3 rounds each: 236-255, 229-266, 225-254 tok/s), and a short spin still frees the core
# on a loaded machine. Set before torch loads where kvserve is imported first, and for every
# process kvserve spawns (they inherit it); a value the user set (or OMP_WAIT_POLICY) wins.
if "GOMP_SPINCOUNT" not in os.environ and "OMP_WAIT_POLICY" not in os.environ:
    os.environ["GOMP_SPINCOUNT"] = "1000"

_EXPORTS = {
    "LLM": "kvserve.entrypoints.llm",
    "AsyncLLM": "kvserve.engine.async_llm",
    "EngineArgs": "kvserve.engine.arg_utils",
    "SamplingParams": "kvserve.sampling_params",
    "RequestOutputKind": "kvserve.sampling_params",
    "RequestOutput": "kvserve.outputs",
    "CompletionOutput": "kvserve.outputs",
    "Logprob": "kvserve.outputs",
    "BeamSearchParams": "kvserve.sampling_params",
    "BeamSearchOutput": "kvserve.entrypoints.beam_search",
    "BeamSearchSequence": "kvserve.entrypoints.beam_search",
    "LoRARequest": "kvserve.lora.request",
}
__all__ = [*_EXPORTS, "__version__"]


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'kvserve' has no attribute {name!r}")
