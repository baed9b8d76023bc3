"""Messages between the frontend (LLM / AsyncLLM) and the engine core, as msgspec structs.

They are msgpack-encoded when the engine core runs in its own process; in-process they are
passed as they are. Field order is the wire order (array_like), so keep it stable. They live in
core/ because the scheduler builds the outputs: the engine above imports them, core does not
import the engine.
"""
from __future__ import annotations

import enum
from typing import Any, Optional

import msgspec

from kvserve.core.sched_output import LogprobsLists  # noqa: F401  (re-exported for clients)
from kvserve.sampling_params import SamplingParams


class EngineCoreRequest(msgspec.Struct, array_like=True, omit_defaults=True):  # type: ignore[call-arg]
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: list[int]
    arrival_time: float
    priority: int = 0
    cache_salt: Optional[str] = None
    client_index: int = 0


class FinishReason(enum.IntEnum):
    STOP = 0
    LENGTH = 1
    ABORT = 2
    ERROR = 3

    def __str__(self) -> str:
        return ("stop", "length", "abort", "error")[self.value]


class EngineCoreEventType(enum.IntEnum):
    """What happened to a request in the engine core (vLLM's names); with a time.monotonic()
    timestamp, which the frontend on the same host can compare with its own clock."""
    QUEUED = 1
    SCHEDULED = 2
    PREEMPTED = 3


class EngineCoreOutput(msgspec.Struct, array_like=True, omit_defaults=True):  # type: ignore[call-arg]
    request_id: str
    new_token_ids: list[int]
    # Per new token: (token ids [k+1], logprobs [k+1], rank of sampled token).
    new_logprobs: Optional[list[tuple[list[int], list[float], int]]] = None
    new_prompt_logprobs: Optional[list[tuple[list[int], list[float], int]]] = None
    finish_reason: Optional[FinishReason] = None
    stop_reason: Any = None             # int token id or str
    num_cached_tokens: int = 0
    # (EngineCoreEventType, monotonic time) since the request's previous output.
    events: Optional[list[tuple[int, float]]] = None
    # From the KV connector when the request finished (vLLM's kv_transfer_params).
    kv_transfer_params: Optional[dict[str, Any]] = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class EngineCoreOutputs(msgspec.Struct, array_like=True, omit_defaults=True):  # type: ignore[call-arg]
    outputs: list[EngineCoreOutput] = []
    timestamp: float = 0.0
    # Requests the engine finished on its own initiative (e.g. abort acknowledged).
    finished_requests: Optional[set[str]] = None
    scheduler_stats: Optional[dict] = None
    utility_output: Optional[Any] = None
    # Which engine core sent them (data parallelism: one frontend, several engines).
    engine_index: int = 0


class EngineCoreRequestType(bytes, enum.Enum):
    """First frame of every frontend -> engine core ZMQ message."""
    ADD = b"\x00"
    ABORT = b"\x01"
    UTILITY = b"\x02"
    SHUTDOWN = b"\x03"
    # From the DP coordinator (not the frontend): join wave N.
    START_DP_WAVE = b"\x04"
