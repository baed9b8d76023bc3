"""The worker's side of async scheduling: sampled ids reach the host without a sync.

Step N samples on the device; its ids are copied to pinned host memory on a side stream and
an event marks the copy's end (on CPU the same path with a copy that is complete at once).
Nothing waits for it until one of two readers needs the ids:

- the model runner, in step N+1, after it has launched N+1's forward and before N+1 samples
  (the sampler's penalties, seeds and min_tokens read the token history): the ids are
  appended to the InputBatch;
- the engine core, when it processes step N's output after scheduling step N+1.

Step N+1's input ids hold a placeholder for each token step N sampled (the host does not have
it yet): `fill_placeholders` takes them from step N's ids on the device, so preparing N+1
never waits for the GPU.

    host:   prepare N │ launch N │ copy N ─┐ │ schedule N+1 │ prepare N+1 │ launch N+1 │ read N │
    device:           │ forward N, sample N│ copy ─► event │      ...       │ forward N+1 ...
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Optional

import numpy as np
import torch

from kvserve.core.sched_output import AsyncModelRunnerOutput, ModelRunnerOutput

if TYPE_CHECKING:
    from kvserve.worker.input_batch import InputBatch
    from kvserve.worker.staging import PinnedStaging


class PendingSampledTokens:
    """One step's sampled ids (one per sampling request) on their way to the host."""

    def __init__(self, req_ids: list[str], sampled: torch.Tensor,
                 copy_stream: Optional["torch.cuda.Stream"], host_buffer: Optional[torch.Tensor]
                 ) -> None:
        self.req_ids = req_ids
        self.index = {rid: j for j, rid in enumerate(req_ids)}
        self.sampled = sampled            # [S] int64 on the device: the placeholders' source
        self._tokens: Optional[list[int]] = None
        self._event: Optional["torch.cuda.Event"] = None
        if copy_stream is None or host_buffer is None:
            self._host = sampled          # CPU: the ids are on the host already
            return
        self._host = host_buffer[:len(req_ids)]
        copy_stream.wait_stream(torch.cuda.current_stream(sampled.device))
        with torch.cuda.stream(copy_stream):
            self._host.copy_(sampled, non_blocking=True)
            self._event = torch.cuda.Event()
            self._event.record(copy_stream)
        sampled.record_stream(copy_stream)

    @property
    def resolved(self) -> bool:
        return self._tokens is not None

    def tokens(self) -> list[int]:
        if self._tokens is None:
            if self._event is not None:
                self._event.synchronize()
            self._tokens = self._host.tolist()
        return self._tokens


class AsyncTokenState:
    """The model runner's async-scheduling state: the last step's pending ids and the pinned
    buffers they are copied into (two, as two steps' copies may be alive at once)."""

    def __init__(self, input_batch: "InputBatch", device: torch.device,
                 append_sampled_tokens: bool, staging: "PinnedStaging") -> None:
        self.input_batch = input_batch
        self.staging = staging
        self.append_sampled_tokens = append_sampled_tokens
        self.pending: Optional[PendingSampledTokens] = None
        self.num_filled = 0    # placeholder input ids filled on the device (for tests)
        self._stream: Optional["torch.cuda.Stream"] = None
        self._buffers: list[torch.Tensor] = []
        self._next_buffer = 0
        if device.type == "cuda":
            self._stream = torch.cuda.Stream(device)
            n = input_batch.max_num_reqs
            self._buffers = [torch.empty(n, dtype=torch.int64, pin_memory=True) for _ in range(2)]

    def begin_step(self) -> None:
        """The previous step's ids already read on the host (the engine core asked for
        them): append them now, so that this step has no placeholders for them."""
        if self.pending is not None and self.pending.resolved:
            self.resolve_pending()

    def fill_placeholders(self, input_ids: torch.Tensor, positions: np.ndarray,
                          tok_rows: np.ndarray, tok_req: np.ndarray, req_ids: list[str]) -> None:
        """Input ids at positions the host has no token for yet (a placeholder: the token
        the previous step sampled) come from that step's ids on the device."""
        fill = np.flatnonzero(positions >= self.input_batch.num_tokens[tok_rows])
        if not len(fill):
            return
        pending = self.pending
        if pending is None or pending.resolved:
            raise RuntimeError("async scheduling: a placeholder token without a step in flight")
        src = np.fromiter((pending.index[req_ids[i]] for i in tok_req[fill].tolist()),
                          np.int64, len(fill))
        self.num_filled += len(fill)
        dst_idx, src_idx = self.staging.upload(fill, src)
        input_ids[dst_idx] = pending.sampled[src_idx]

    def resolve_pending(self) -> None:
        """Append the previous step's sampled ids to the InputBatch (waits for their copy)."""
        pending, self.pending = self.pending, None
        if pending is None:
            return
        tokens = pending.tokens()
        if not self.append_sampled_tokens:
            return
        ib = self.input_batch
        for rid, token in zip(pending.req_ids, tokens):
            row = ib.req_id_to_index.get(rid)
            if row is not None:   # not finished or preempted since
                ib.append_token(row, token)

    def start(self, req_ids: list[str], sampled: torch.Tensor) -> PendingSampledTokens:
        """Start the copy of this step's ids; the next step appends them."""
        assert self.pending is None, "the previous step's ids were not appended"
        buffer = None
        if self._buffers:
            buffer = self._buffers[self._next_buffer]
            self._next_buffer ^= 1
        self.pending = PendingSampledTokens(req_ids, sampled.to(torch.int64), self._stream,
                                            buffer)
        return self.pending


class AsyncRunnerOutput(AsyncModelRunnerOutput):
    """A ModelRunnerOutput whose sampled ids (for the requests at `sample_idx`) are filled in
    from `pending` when first asked for."""

    def __init__(self, output: ModelRunnerOutput, pending: Optional[PendingSampledTokens],
                 sample_idx: np.ndarray) -> None:
        self._output = output
        self._pending = pending
        self._sample_idx = sample_idx

    def get_output(self) -> ModelRunnerOutput:
        if self._pending is not None:
            lists = self._output.sampled_token_ids
            for i, token in zip(self._sample_idx.tolist(), self._pending.tokens()):
                lists[i] = [token]
            self._pending = None
        return self._output
