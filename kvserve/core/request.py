"""Request: the engine core's view of one sequence — its tokens, progress and status.

A request owns its token ids and `num_computed_tokens`; the scheduler's single rule is to make
`num_computed_tokens` catch up with `num_tokens`, which covers prefill, chunked prefill, prefix
cache hits and decode alike.
"""
from __future__ import annotations

import enum
import time
from typing import TYPE_CHECKING, Any, Optional

from kvserve.pooling_params import PoolingParams
from kvserve.sampling_params import SamplingParams

if TYPE_CHECKING:
    from kvserve.structured_output.request import StructuredOutputRequest


class RequestStatus(enum.IntEnum):
    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2
    WAITING_FOR_FSM = 3     # its grammar is compiling; not schedulable yet
    WAITING_FOR_REMOTE_KVS = 4   # its blocks are allocated and its KV is loading from outside
    # Everything above FINISHED_STOPPED is finished.
    FINISHED_STOPPED = 10
    FINISHED_LENGTH_CAPPED = 11
    FINISHED_ABORTED = 12
    FINISHED_ERROR = 13

    @staticmethod
    def is_finished(status: "RequestStatus") -> bool:
        return status >= RequestStatus.FINISHED_STOPPED

    @staticmethod
    def get_finished_reason(status: "RequestStatus") -> Optional[str]:
        return _FINISHED_REASON.get(status)


_FINISHED_REASON = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH_CAPPED: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_ERROR: "error",
}


class Request:
    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        eos_token_ids: Optional[set[int]] = None,
        arrival_time: Optional[float] = None,
        priority: int = 0,
        cache_salt: Optional[str] = None,
        client_index: int = 0,
        pooling_params: Optional[PoolingParams] = None,
        lora_request: Optional[Any] = None,
    ) -> None:
        self.request_id = request_id
        self.sampling_params = sampling_params
        self.eos_token_ids = eos_token_ids or set()
        self.arrival_time = arrival_time if arrival_time is not None else time.time()
        self.priority = priority
        self.cache_salt = cache_salt
        self.client_index = client_index
        self.pooling_params = pooling_params
        # kvserve.lora.LoRARequest, or None for the base model (core/ sits below lora/ in
        # the import layers, so it is untyped here; it is part of the block hashes).
        self.lora_request = lora_request
        self.status = RequestStatus.WAITING
        self.stop_reason: int | str | None = None
        self.max_tokens = sampling_params.max_tokens or 0

        self.prompt_token_ids = list(prompt_token_ids)
        self.num_prompt_tokens = len(self.prompt_token_ids)
        self._output_token_ids: list[int] = []
        self._all_token_ids: list[int] = list(self.prompt_token_ids)
        self.num_computed_tokens = 0
        # Tokens found in the prefix cache when the request was first scheduled.
        self.num_cached_tokens = -1
        self.num_preemptions = 0
        # Chained hashes of this request's full blocks, extended as tokens are appended.
        self.block_hashes: list = []
        # (EngineCoreEventType, time.monotonic()) not yet sent to the frontend.
        self.events: list[tuple[int, float]] = []
        # Draft tokens proposed for the next step (speculative decoding); not yet outputs.
        self.spec_token_ids: list[int] = []
        # Async scheduling: tokens a step in flight will sample that are not appended yet.
        self.num_output_placeholders = 0
        # Set by the StructuredOutputManager for requests with structured_outputs.
        self.structured_output_request: Optional["StructuredOutputRequest"] = None

    @property
    def use_structured_output(self) -> bool:
        return self.sampling_params.structured_outputs is not None

    def record_event(self, event_type: int) -> None:
        self.events.append((int(event_type), time.monotonic()))

    def take_events(self) -> Optional[list[tuple[int, float]]]:
        if not self.events:
            return None
        events, self.events = self.events, []
        return events

    # ------------------------------------------------------------------
    @property
    def output_token_ids(self) -> list[int]:
        return self._output_token_ids

    @property
    def all_token_ids(self) -> list[int]:
        return self._all_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self._all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self._output_token_ids)

    def append_output_token_ids(self, token_ids: list[int]) -> None:
        self._output_token_ids.extend(token_ids)
        self._all_token_ids.extend(token_ids)

    def is_finished(self) -> bool:
        return RequestStatus.is_finished(self.status)

    def get_finished_reason(self) -> Optional[str]:
        return RequestStatus.get_finished_reason(self.status)

    def __lt__(self, other: "Request") -> bool:
        # Priority policy: lower value first, then earlier arrival (heap ordering).
        return (self.priority, self.arrival_time, self.request_id) < (
            other.priority, other.arrival_time, other.request_id)

    def __repr__(self) -> str:
        return (f"Request({self.request_id!r}, status={self.status.name}, "
                f"tokens={self.num_tokens}, computed={self.num_computed_tokens})")
