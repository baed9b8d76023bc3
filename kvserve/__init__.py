"""kvserve: a high-throughput LLM inference and serving engine (vLLM V1 architecture)."""
from kvserve.entrypoints.llm import LLM
from kvserve.engine.arg_utils import EngineArgs
from kvserve.outputs import CompletionOutput, Logprob, RequestOutput
from kvserve.sampling_params import RequestOutputKind, SamplingParams

__version__ = "0.1.0"
__all__ = ["LLM", "EngineArgs", "SamplingParams", "RequestOutputKind", "RequestOutput",
           "CompletionOutput", "Logprob", "__version__"]
