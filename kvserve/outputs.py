"""The user-facing results of generation, shaped like vLLM's RequestOutput / CompletionOutput."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Optional, Union

if TYPE_CHECKING:
    import torch


@dataclass
class Logprob:
    logprob: float
    rank: Optional[int] = None
    decoded_token: Optional[str] = None


# One dict per position: token id -> Logprob (the sampled/prompt token plus the top-k).
SampleLogprobs = list[dict[int, Logprob]]
PromptLogprobs = list[Optional[dict[int, Logprob]]]


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: Optional[float] = None
    logprobs: Optional[SampleLogprobs] = None
    finish_reason: Optional[str] = None          # "stop" | "length" | "abort" | None
    stop_reason: Union[int, str, None] = None    # the stop string or stop token id that ended it

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: Optional[float] = None
    first_token_time: Optional[float] = None
    last_token_time: Optional[float] = None
    finished_time: Optional[float] = None


@dataclass
class RequestOutput:
    request_id: str
    prompt: Optional[str]
    prompt_token_ids: list[int]
    prompt_logprobs: Optional[PromptLogprobs]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
    metrics: Optional[RequestMetrics] = None
    kv_transfer_params: Optional[dict] = field(default=None)


# ---------------------------------------------------------------------- pooling (vLLM's shapes)
@dataclass
class PoolingOutput:
    """A pooling request's result: `data` is the pooled float32 tensor ([hidden] or, with
    pooling_type ALL, [tokens, hidden]); None when the request was aborted or failed."""
    data: Optional["torch.Tensor"]


@dataclass
class PoolingRequestOutput:
    request_id: str
    outputs: PoolingOutput
    prompt_token_ids: list[int]
    finished: bool
    prompt: Optional[str] = None
    finish_reason: Optional[str] = None      # "stop" when pooled; "abort" / "error" otherwise


@dataclass
class EmbeddingOutput:
    embedding: list[float]

    @staticmethod
    def from_base(output: PoolingOutput) -> "EmbeddingOutput":
        if output.data is None:
            raise ValueError("The pooling request has no result (aborted or failed).")
        if output.data.ndim != 1:
            raise ValueError("pooled data should be 1-D for an embedding")
        return EmbeddingOutput(output.data.tolist())

    @property
    def hidden_size(self) -> int:
        return len(self.embedding)


@dataclass
class EmbeddingRequestOutput(PoolingRequestOutput):
    outputs: EmbeddingOutput     # type: ignore[assignment]

    @staticmethod
    def from_base(out: PoolingRequestOutput) -> "EmbeddingRequestOutput":
        return EmbeddingRequestOutput(
            request_id=out.request_id, outputs=EmbeddingOutput.from_base(out.outputs),
            prompt_token_ids=out.prompt_token_ids, finished=out.finished, prompt=out.prompt,
            finish_reason=out.finish_reason)
