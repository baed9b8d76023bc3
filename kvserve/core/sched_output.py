"""SchedulerOutput: the plain object the scheduler hands to the executor each step.

New requests travel in full (workers keep per-request state); requests already on the workers
travel as a diff (new block ids, progress). Nothing here refers to scheduler internals.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

import numpy as np

from kvserve.pooling_params import PoolingParams
from kvserve.sampling_params import SamplingParams


@dataclass
class NewRequestData:
    req_id: str
    # All tokens known so far: the prompt, plus earlier outputs for a request resumed after
    # preemption (its KV is recomputed from these).
    token_ids: list[int]
    num_prompt_tokens: int
    sampling_params: SamplingParams
    block_ids: list[int]
    num_computed_tokens: int
    eos_token_ids: list[int] = field(default_factory=list)   # for min_tokens masking
    pooling_params: Optional[PoolingParams] = None            # a pooling request's settings
    lora_request: Optional[Any] = None      # kvserve.lora.LoRARequest (None: the base model)


@dataclass
class CachedRequestData:
    req_ids: list[str] = field(default_factory=list)
    new_block_ids: list[list[int]] = field(default_factory=list)  # blocks appended this step
    num_computed_tokens: list[int] = field(default_factory=list)
    # Tokens the engine core appended itself (jump-forward decoding) that the workers have
    # not seen: per request, appended before this step's tokens are computed.
    new_token_ids: list[list[int]] = field(default_factory=list)


@dataclass
class SchedulerOutput:
    scheduled_new_reqs: list[NewRequestData]
    scheduled_cached_reqs: CachedRequestData
    num_scheduled_tokens: dict[str, int]
    total_num_scheduled_tokens: int
    finished_req_ids: set[str]            # drop these from the workers' persistent batch
    preempted_req_ids: set[str] = field(default_factory=set)
    step_id: int = 0
    # Structured outputs: int32 [len(ids), ceil(V/32)], row i for request
    # structured_output_request_ids[i] (only constrained requests that sample this step).
    grammar_bitmask: Optional[np.ndarray] = None
    structured_output_request_ids: list[str] = field(default_factory=list)
    # Speculative decoding: request id -> the draft tokens scheduled after its last token
    # (they count in num_scheduled_tokens; only requests with drafts appear).
    scheduled_spec_decode_tokens: dict[str, list[int]] = field(default_factory=dict)
    # The requests that propose drafts after this step (the adaptive rule's choice, made by
    # the scheduler so that every rank agrees); None: all of them.
    spec_decode_draft_req_ids: Optional[set[str]] = None
    # How many tokens each of them proposes (the rule's k' <= num_speculative_tokens; None: k).
    spec_decode_num_draft_tokens: Optional[int] = None
    # The KV connector's work for the workers this step (KVConnectorMetadata), if any.
    kv_connector_metadata: Optional[Any] = None

    @property
    def is_empty(self) -> bool:
        return self.total_num_scheduled_tokens == 0


@dataclass
class LogprobsLists:
    """Per sampled position: token ids [N, k+1] (sampled token first), logprobs [N, k+1],
    rank of the sampled token [N]. Plain lists so they pickle/msgpack cheaply."""
    logprob_token_ids: list[list[int]]
    logprobs: list[list[float]]
    sampled_token_ranks: list[int]


@dataclass
class ModelRunnerOutput:
    req_ids: list[str]
    # One list per request in req_ids: the tokens sampled this step (empty for a partial prefill).
    sampled_token_ids: list[list[int]]
    logprobs: Optional[dict[str, LogprobsLists]] = None
    # For requests that asked for prompt logprobs: this step's chunk of them (positions 1..).
    prompt_logprobs: Optional[dict[str, LogprobsLists]] = None
    # Speculative decoding: draft tokens proposed for each request in req_ids (for the next step).
    spec_token_ids: Optional[list[list[int]]] = None
    # Seconds the proposer took this step (the adaptive rule's cost model).
    spec_propose_time: float = 0.0
    # The KV connector's report (kv_transfer.base.KVConnectorOutput), if the engine has one.
    kv_connector_output: Optional[Any] = None
    # Pooling runner: per request in req_ids, its pooled vector (torch float32) in the step
    # that finished its prompt, else None.
    pooler_output: Optional[list[Optional[Any]]] = None


class AsyncModelRunnerOutput:
    """A step's output whose sampled ids are still on their way to the host (async
    scheduling): `get_output()` waits for that copy and returns the plain output."""

    def get_output(self) -> ModelRunnerOutput:
        raise NotImplementedError


def resolve_runner_output(output: Any) -> Any:
    """The plain ModelRunnerOutput of an executor's reply (anything else passes through)."""
    return output.get_output() if isinstance(output, AsyncModelRunnerOutput) else output
