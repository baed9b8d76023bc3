"""PoolingParams: the per-request settings of a pooling (embedding) request, vLLM's names.

It lives beside SamplingParams (as vLLM's `vllm/pooling_params.py` does) because the engine's
request messages carry it. What the model allows (`dimensions` only for Matryoshka models) is
checked by the input processor against the engine's pooler configuration.
"""
from __future__ import annotations

from typing import Optional

import msgspec

from kvserve.sampling_params import RequestOutputKind

POOLING_TASKS = ("embed", "encode")


class PoolingParams(
        msgspec.Struct,
        omit_defaults=True,  # type: ignore[call-arg]
        dict=True):  # type: ignore[call-arg]
    """`dimensions`: keep the first this many values (Matryoshka models only), before
    normalising. `normalize`: None = the model's pooler config (its sentence-transformers
    Normalize module, or the decoder-embedder default). `task`: "embed" (pooled vector) or
    "encode" (the pooler's raw output: with pooling_type ALL, one row per token)."""

    dimensions: Optional[int] = None
    normalize: Optional[bool] = None
    task: Optional[str] = None
    output_kind: RequestOutputKind = RequestOutputKind.FINAL_ONLY

    def __post_init__(self) -> None:
        if self.dimensions is not None and (isinstance(self.dimensions, bool)
                                            or not isinstance(self.dimensions, int)
                                            or self.dimensions < 1):
            raise ValueError(f"dimensions must be a positive integer, got {self.dimensions!r}.")
        if self.task is not None and self.task not in POOLING_TASKS:
            raise ValueError(f"task must be one of {list(POOLING_TASKS)}, got {self.task!r}.")
        if self.output_kind != RequestOutputKind.FINAL_ONLY:
            raise ValueError("Pooling requests produce one output: output_kind must be "
                             "FINAL_ONLY.")

    # A pooling request is one sequence; the frontend's fan-out (SamplingParams.n) reads this.
    @property
    def n(self) -> int:
        return 1
