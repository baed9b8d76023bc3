"""Engine core process side: hold back the step outputs that nobody reads until later.

Each message from the engine core to the frontend costs CPU on both sides: the output IO
thread's encode and ZMQ send, ZMQ's own IO thread, and the frontend's reader thread, queue
hand-off and output processing. On a CPU host the forward pass keeps every core busy, so that
CPU is taken from the forward itself: at batch 1 (110M Llama, 2 cores, avx2 tier) offline
`LLM.generate` ran 5.5% slower with the engine core in its own process than in-process, and
without the per-step messages level with it (benchmarks/README.md, issue 16).

A request's per-step outputs are needed by nobody when:
- its frontend wants only the final output (RequestOutputKind.FINAL_ONLY: offline
  `LLM.generate`, non-streaming API requests),
- it has no stop strings (the frontend checks those on the text, step by step), and
- the engine keeps no statistics (log_stats off: the frontend's inter-token latency metrics
  need each step's arrival time).

Such requests' outputs are merged here and sent when something else needs sending. What goes
out at once: a request's first token (the frontend records its first_token_time), every output
of any other request (with everything held), every finish, and everything held before any
other message (utility results, add errors), so the frontend still sees every message in
engine order. Nothing waits longer than MAX_HOLD_S (checked at each step).
"""
from __future__ import annotations

import time
from typing import Iterable, Optional

from kvserve.core.messages import EngineCoreOutput, EngineCoreOutputs, EngineCoreRequest
from kvserve import envs
from kvserve.sampling_params import RequestOutputKind

# An upper bound on how stale the frontend's view can get (progress bars, a client polling
# LLMEngine.step); one message per MAX_HOLD_S costs nothing measurable.
MAX_HOLD_S = 0.5

# KVSERVE_HOLD_OUTPUTS=0: send every step's outputs (the behaviour before; for A/B runs).
HOLD_OUTPUTS_ENV = "KVSERVE_HOLD_OUTPUTS"


def _concat(a: Optional[list], b: Optional[list]) -> Optional[list]:
    if a is None:
        return b
    return a if b is None else a + b


def merge_outputs(a: EngineCoreOutput, b: EngineCoreOutput) -> EngineCoreOutput:
    """One output for two consecutive outputs (a, then b) of the same request."""
    return EngineCoreOutput(
        request_id=a.request_id, new_token_ids=a.new_token_ids + b.new_token_ids,
        new_logprobs=_concat(a.new_logprobs, b.new_logprobs),
        new_prompt_logprobs=_concat(a.new_prompt_logprobs, b.new_prompt_logprobs),
        finish_reason=b.finish_reason, stop_reason=b.stop_reason,
        num_cached_tokens=b.num_cached_tokens or a.num_cached_tokens,
        events=_concat(a.events, b.events),
        kv_transfer_params=b.kv_transfer_params if b.kv_transfer_params is not None
        else a.kv_transfer_params)


class OutputCoalescer:
    """Decides, step by step, what of the engine core's outputs to send now."""

    def __init__(self, log_stats: bool, max_hold_s: float = MAX_HOLD_S) -> None:
        self.enabled = not log_stats and envs.get(HOLD_OUTPUTS_ENV)
        self.max_hold_s = max_hold_s
        self._holdable: set[str] = set()     # requests whose per-step outputs may wait
        self._started: set[str] = set()      # ... whose first token has gone out
        self._held: dict[str, EngineCoreOutput] = {}
        self._held_since = 0.0               # when the oldest held output was held

    def add_request(self, request: EngineCoreRequest) -> None:
        params = request.sampling_params
        if self.enabled and params.output_kind == RequestOutputKind.FINAL_ONLY \
                and not params.stop:
            self._holdable.add(request.request_id)

    def drop(self, request_ids: Iterable[str]) -> None:
        """Aborted by the frontend, which has finished them itself: their outputs are moot."""
        for rid in request_ids:
            self._forget(rid)
            self._held.pop(rid, None)

    def num_tracked(self) -> int:
        """Requests this holds any state for (0 once every request has ended)."""
        return len(self._holdable | self._started | self._held.keys())

    def filter(self, outputs: EngineCoreOutputs) -> Optional[EngineCoreOutputs]:
        """What to send for this step's outputs: them (with anything held merged in), or None
        while everything is held."""
        if not self._holdable and not self._held:
            return outputs
        if self._must_send(outputs):
            return self._with_held(outputs)
        now = time.monotonic()
        if not self._held:
            self._held_since = now
        self._hold(outputs.outputs)
        if self._held and now - self._held_since >= self.max_hold_s:
            return self.flush()
        return None

    def flush(self) -> Optional[EngineCoreOutputs]:
        """Everything held, as one message (None when nothing is)."""
        if not self._held:
            return None
        return self._with_held(EngineCoreOutputs(timestamp=time.monotonic()))

    def _must_send(self, outputs: EngineCoreOutputs) -> bool:
        if outputs.finished_requests or outputs.scheduler_stats is not None \
                or outputs.utility_output is not None:
            return True
        return any(out.request_id not in self._holdable or out.finished
                   or (out.new_token_ids and out.request_id not in self._started)
                   for out in outputs.outputs)

    def _with_held(self, outputs: EngineCoreOutputs) -> EngineCoreOutputs:
        if self._held:
            self._hold(outputs.outputs)
            outputs.outputs = list(self._held.values())
            self._held = {}
        for out in outputs.outputs:
            if out.finished:
                self._forget(out.request_id)
            elif out.new_token_ids and out.request_id in self._holdable:
                self._started.add(out.request_id)
        for rid in outputs.finished_requests or ():
            self._forget(rid)
        return outputs

    def _hold(self, outputs: list[EngineCoreOutput]) -> None:
        for out in outputs:
            held = self._held.get(out.request_id)
            self._held[out.request_id] = out if held is None else merge_outputs(held, out)

    def _forget(self, rid: str) -> None:
        self._holdable.discard(rid)
        self._started.discard(rid)
