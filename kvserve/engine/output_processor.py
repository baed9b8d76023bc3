"""OutputProcessor: engine core outputs in, user-facing RequestOutputs out (frontend side).

Per request it keeps the incremental detokenizer, the formatted logprobs and the finish
state; it applies stop strings (which only text can reveal, so the engine core never sees
them: the requests they finish are returned in `reqs_to_abort` for the caller to abort in the
core), and shapes each output as CUMULATIVE, DELTA or FINAL_ONLY. A request with n > 1 runs
as n child requests in the core; ParentRequest folds them back into one RequestOutput.

Timestamps in RequestOutput.metrics are wall-clock (time.time(), the clock of
EngineCoreRequest.arrival_time); latencies in IterationStats are measured with
time.monotonic() from the moment the request was added here.
"""
from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Optional, Union

import msgspec

from kvserve.core.messages import (EngineCoreEventType, EngineCoreOutput, EngineCoreRequest,
                                   FinishReason)
from kvserve.engine.detokenizer import IncrementalDetokenizer
from kvserve.outputs import (CompletionOutput, Logprob, PromptLogprobs, RequestMetrics,
                             RequestOutput, SampleLogprobs)
from kvserve.sampling_params import RequestOutputKind, SamplingParams
from kvserve.tokenizer import Tokenizer

# (token ids [k+1], logprobs [k+1], rank of the first one): one position as the core sends it.
_PositionLogprobs = tuple[list[int], list[float], int]


# ---------------------------------------------------------------------- logprobs
class LogprobsProcessor:
    """Turns the core's per-position (ids, logprobs, rank) triples into Logprob dicts."""

    def __init__(self, tokenizer: Optional[Tokenizer], params: SamplingParams) -> None:
        self.tokenizer = tokenizer   # None: no decoded_token strings (detokenize=False)
        self.num_logprobs = params.logprobs
        self.num_prompt_logprobs = params.prompt_logprobs
        self.logprobs: Optional[SampleLogprobs] = [] if self.num_logprobs is not None else None
        self.cumulative_logprob: Optional[float] = 0.0 if self.num_logprobs is not None else None
        # [None, {...}, {...}, ...] once the first chunk arrived: position 0 has no logprob.
        self.prompt_logprobs: Optional[PromptLogprobs] = None

    def _make_dicts(self, positions: list[_PositionLogprobs]) -> list[dict[int, Logprob]]:
        decoded: Optional[list[str]] = None
        if self.tokenizer is not None:
            # One batched (and memoized) decode for every id of the step.
            decoded = self.tokenizer.decode_tokens([t for ids, _, _ in positions for t in ids])
        dicts, pos = [], 0
        for ids, lps, rank in positions:
            # The first entry is the sampled (or prompt) token with its own rank; the top-k
            # follow with ranks 1..k. A sampled token that is also in the top-k is written
            # twice with the same values, so the dict keeps one entry for it.
            ranks = [rank, *range(1, len(ids))]
            toks = decoded[pos:pos + len(ids)] if decoded is not None else [None] * len(ids)
            pos += len(ids)
            dicts.append({t: Logprob(lp, r, s) for t, lp, r, s in zip(ids, lps, ranks, toks)})
        return dicts

    def update_from_output(self, output: EngineCoreOutput) -> None:
        if self.logprobs is not None and output.new_logprobs:
            self.logprobs.extend(self._make_dicts(output.new_logprobs))
            self.cumulative_logprob = (self.cumulative_logprob or 0.0) + sum(
                lps[0] for _, lps, _ in output.new_logprobs)
        if self.num_prompt_logprobs is not None and output.new_prompt_logprobs:
            if self.prompt_logprobs is None:
                self.prompt_logprobs = [None]
            self.prompt_logprobs.extend(self._make_dicts(output.new_prompt_logprobs))

    def pop_prompt_logprobs(self) -> Optional[PromptLogprobs]:
        """For DELTA outputs: the prompt logprobs are sent once."""
        plp, self.prompt_logprobs = self.prompt_logprobs, None
        return plp


# ---------------------------------------------------------------------- output collector
class RequestOutputCollector:
    """A one-slot stream of RequestOutputs for one request (AsyncLLM's per-request queue).

    The producer never blocks: with DELTA outputs a new output is merged into the one the
    consumer has not taken yet; otherwise the newer (cumulative) output replaces it.
    """

    def __init__(self, output_kind: RequestOutputKind) -> None:
        self.aggregate = output_kind == RequestOutputKind.DELTA
        self.output: Optional[Union[RequestOutput, Exception]] = None
        self.ready = asyncio.Event()

    def put(self, output: Union[RequestOutput, Exception]) -> None:
        if (self.output is None or isinstance(output, Exception)
                or isinstance(self.output, Exception)):
            self.output = output
        elif self.aggregate:
            _merge_delta(self.output, output)
        else:
            self.output = output
        self.ready.set()

    async def get(self) -> RequestOutput:
        while self.output is None:
            await self.ready.wait()
        return self._take()

    def get_nowait(self) -> Optional[RequestOutput]:
        return None if self.output is None else self._take()

    def _take(self) -> RequestOutput:
        output, self.output = self.output, None
        self.ready.clear()
        if isinstance(output, Exception):
            raise output
        assert output is not None
        return output


def _merge_delta(into: RequestOutput, new: RequestOutput) -> None:
    by_index = {c.index: c for c in into.outputs}
    for c in new.outputs:
        old = by_index.get(c.index)
        if old is None:
            into.outputs.append(c)
            by_index[c.index] = c
            continue
        old.text += c.text
        old.token_ids.extend(c.token_ids)
        if c.logprobs is not None:
            old.logprobs = (old.logprobs or []) + c.logprobs
        old.cumulative_logprob = c.cumulative_logprob
        old.finish_reason, old.stop_reason = c.finish_reason, c.stop_reason
    into.outputs.sort(key=lambda c: c.index)
    into.finished = new.finished
    into.metrics = new.metrics
    into.num_cached_tokens = new.num_cached_tokens
    if into.prompt_logprobs is None:
        into.prompt_logprobs = new.prompt_logprobs


# ---------------------------------------------------------------------- stats
@dataclass
class FinishedRequestStats:
    finish_reason: str
    e2e_latency: float
    num_prompt_tokens: int
    num_generation_tokens: int
    first_token_latency: float
    # From the engine core's events (vLLM's definitions); None when not known (e.g. a request
    # that finished before it was ever scheduled).
    queued_time: Optional[float] = None       # first SCHEDULED - QUEUED
    prefill_time: Optional[float] = None      # first token - first SCHEDULED
    decode_time: Optional[float] = None       # last token - first token
    inference_time: Optional[float] = None    # last token - first SCHEDULED


@dataclass
class IterationStats:
    """What one process_outputs call saw, for the metrics loggers (vLLM's names)."""
    num_generation_tokens: int = 0
    num_prompt_tokens: int = 0
    time_to_first_tokens_iter: list[float] = field(default_factory=list)
    inter_token_latencies_iter: list[float] = field(default_factory=list)
    finished_requests: list[FinishedRequestStats] = field(default_factory=list)


# ---------------------------------------------------------------------- n > 1
class ParentRequest:
    """One user request with n > 1, run as n child requests `f"{i}_{request_id}"`.

    Child i gets seed + i when a seed is set (the samples differ and stay reproducible); only
    child 0 computes prompt logprobs (they are the same for all children). The children's
    CompletionOutputs are gathered into one RequestOutput, `outputs` ordered by index:
    CUMULATIVE reports every child seen so far, DELTA the children that moved this step,
    FINAL_ONLY all of them once every child finished.
    """

    def __init__(self, request_id: str, sampling_params: SamplingParams) -> None:
        self.request_id = request_id
        self.sampling_params = sampling_params
        self.n = sampling_params.n
        self.output_kind = sampling_params.output_kind
        self.child_requests: set[str] = set()      # children not finished yet
        self.prompt: Optional[str] = None
        self.prompt_token_ids: list[int] = []
        self.prompt_logprobs: Optional[PromptLogprobs] = None
        self.metrics: Optional[RequestMetrics] = None
        self.num_cached_tokens = 0
        self.queue: Optional[RequestOutputCollector] = None   # AsyncLLM's stream, if any
        self._latest: list[Optional[CompletionOutput]] = [None] * self.n
        self._deltas: list[CompletionOutput] = []
        self._updated = False
        self._returned_final = False

    def child_request_id(self, index: int) -> str:
        return f"{index}_{self.request_id}"

    def get_child_info(self, index: int) -> tuple[str, SamplingParams]:
        """The id and sampling params of child `index` (registers it as running)."""
        return self._child_info(index, self.sampling_params)

    def _child_info(self, index: int, params: SamplingParams) -> tuple[str, SamplingParams]:
        if not 0 <= index < self.n:
            raise ValueError(f"child index {index} out of range for n={self.n}.")
        child_id = self.child_request_id(index)
        self.child_requests.add(child_id)
        changes: dict = {"n": 1}
        if params.seed is not None:
            changes["seed"] = params.seed + index
        if index > 0:
            changes["prompt_logprobs"] = None
        return child_id, msgspec.structs.replace(params, **changes)

    def make_child_request(self, request: EngineCoreRequest, index: int) -> EngineCoreRequest:
        """Child `index` of the processed request (its params already carry max_tokens)."""
        child_id, params = self._child_info(index, request.sampling_params)
        return msgspec.structs.replace(request, request_id=child_id, sampling_params=params)

    def make_child_requests(self, request: EngineCoreRequest) -> list[EngineCoreRequest]:
        return [self.make_child_request(request, i) for i in range(self.n)]

    # ------------------------------------------------------------------ assembly
    def add_child_output(self, child_request_id: str, completion: CompletionOutput,
                         state: "RequestState") -> None:
        if completion.finished():
            self.child_requests.discard(child_request_id)
        if self.output_kind == RequestOutputKind.DELTA:
            self._deltas.append(completion)
            if state.logprobs_processor.prompt_logprobs is not None:
                self.prompt_logprobs = state.logprobs_processor.pop_prompt_logprobs()
        else:
            self._latest[completion.index] = completion
            if state.logprobs_processor.prompt_logprobs is not None:
                self.prompt_logprobs = state.logprobs_processor.prompt_logprobs
        self.num_cached_tokens = max(self.num_cached_tokens, state.num_cached_tokens)
        m, cm = self.metrics, state.metrics
        if m is not None:
            if cm.first_token_time is not None and (m.first_token_time is None
                                                    or cm.first_token_time < m.first_token_time):
                m.first_token_time = cm.first_token_time
            if cm.last_token_time is not None:
                m.last_token_time = max(m.last_token_time or 0.0, cm.last_token_time)
        self._updated = True

    @property
    def finished(self) -> bool:
        return not self.child_requests

    def make_request_output(self, finished_time: float) -> Optional[RequestOutput]:
        """The RequestOutput for what the children reported since the last call, if any."""
        if not self._updated or self._returned_final:
            return None
        self._updated = False
        finished = self.finished
        if finished:
            self._returned_final = True
            if self.metrics is not None:
                self.metrics.finished_time = finished_time
        if self.output_kind == RequestOutputKind.FINAL_ONLY and not finished:
            return None
        if self.output_kind == RequestOutputKind.DELTA:
            outputs = sorted(self._deltas, key=lambda c: c.index)
            self._deltas = []
            prompt_logprobs, self.prompt_logprobs = self.prompt_logprobs, None
        else:
            outputs = [c for c in self._latest if c is not None]
            prompt_logprobs = self.prompt_logprobs
        return RequestOutput(
            request_id=self.request_id, prompt=self.prompt,
            prompt_token_ids=self.prompt_token_ids, prompt_logprobs=prompt_logprobs,
            outputs=outputs, finished=finished, num_cached_tokens=self.num_cached_tokens,
            metrics=_copy_metrics(self.metrics))


def _copy_metrics(m: Optional[RequestMetrics]) -> Optional[RequestMetrics]:
    # Outputs are snapshots: the live metrics object keeps changing.
    if m is None:
        return None
    return RequestMetrics(m.arrival_time, m.first_scheduled_time, m.first_token_time,
                          m.last_token_time, m.finished_time)


# ---------------------------------------------------------------------- per request
class RequestState:
    def __init__(self, request: EngineCoreRequest, prompt: Optional[str],
                 parent_req: Optional[ParentRequest], request_index: int,
                 tokenizer: Optional[Tokenizer], queue: Optional[RequestOutputCollector]) -> None:
        params = request.sampling_params
        self.request_id = request.request_id
        self.parent_req = parent_req
        self.request_index = request_index
        self.prompt = prompt
        self.prompt_token_ids = request.prompt_token_ids
        self.output_kind = params.output_kind
        self.queue = queue
        self.detokenizer = IncrementalDetokenizer.from_new_request(tokenizer, request)
        self.logprobs_processor = LogprobsProcessor(
            tokenizer if params.detokenize else None, params)
        self.finish_reason: Optional[str] = None
        self.stop_reason: Union[int, str, None] = None
        self.num_cached_tokens = 0
        self.kv_transfer_params: Optional[dict] = None
        self.metrics = RequestMetrics(arrival_time=request.arrival_time)
        self._num_sent_tokens = 0     # DELTA: ids (and logprob positions) already reported
        self.added_monotonic = time.monotonic()
        self.first_token_monotonic: Optional[float] = None
        self.last_token_monotonic: Optional[float] = None
        # From the engine core's events, in its (the host's) monotonic clock.
        self.queued_ts: Optional[float] = None
        self.scheduled_ts: Optional[float] = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def make_completion_output(self) -> CompletionOutput:
        delta = self.output_kind == RequestOutputKind.DELTA
        finished = self.finished
        text = self.detokenizer.get_next_output_text(finished, delta)
        ids = self.detokenizer.output_token_ids
        logprobs = self.logprobs_processor.logprobs
        if delta:
            start, self._num_sent_tokens = self._num_sent_tokens, len(ids)
            token_ids = ids[start:]
            out_logprobs = logprobs[start:] if logprobs is not None else None
        else:
            # Copies: a streamed cumulative output must not change after it was handed out.
            token_ids = list(ids)
            out_logprobs = list(logprobs) if logprobs is not None else None
        return CompletionOutput(
            index=self.request_index, text=text, token_ids=token_ids,
            cumulative_logprob=self.logprobs_processor.cumulative_logprob,
            logprobs=out_logprobs, finish_reason=self.finish_reason,
            stop_reason=self.stop_reason)

    def make_request_output(self) -> Optional[RequestOutput]:
        """For a request without a parent; None while FINAL_ONLY waits for the end."""
        finished = self.finished
        if self.output_kind == RequestOutputKind.FINAL_ONLY and not finished:
            return None
        if self.output_kind == RequestOutputKind.DELTA:
            prompt_logprobs = self.logprobs_processor.pop_prompt_logprobs()
        else:
            prompt_logprobs = self.logprobs_processor.prompt_logprobs
        return RequestOutput(
            request_id=self.request_id, prompt=self.prompt,
            prompt_token_ids=self.prompt_token_ids, prompt_logprobs=prompt_logprobs,
            outputs=[self.make_completion_output()], finished=finished,
            num_cached_tokens=self.num_cached_tokens, metrics=_copy_metrics(self.metrics),
            kv_transfer_params=self.kv_transfer_params)


@dataclass
class OutputProcessorOutput:
    request_outputs: list[RequestOutput]
    # Requests finished here (stop strings) that the engine core still runs: abort them.
    reqs_to_abort: list[str]
    iteration_stats: Optional[IterationStats] = None


class OutputProcessor:
    """Frontend state of every unfinished request (see the module docstring)."""

    def __init__(self, tokenizer: Optional[Tokenizer], log_stats: bool = False) -> None:
        self.tokenizer = tokenizer
        self.log_stats = log_stats
        self.request_states: dict[str, RequestState] = {}
        self.parent_requests: dict[str, ParentRequest] = {}
        # Engine-core ids (children for n > 1) hit by the last abort_requests call.
        self.last_aborted_child_ids: list[str] = []

    def get_num_unfinished_requests(self) -> int:
        return len(self.request_states)

    def has_unfinished_requests(self) -> bool:
        return len(self.request_states) > 0

    def add_request(self, request: EngineCoreRequest, prompt: Optional[str],
                    parent_req: Optional[ParentRequest] = None, request_index: int = 0,
                    queue: Optional[RequestOutputCollector] = None) -> None:
        """Track a request sent to the engine core. For n > 1 call it once per child with
        the ParentRequest and the child's index (queue: AsyncLLM's per-request stream)."""
        request_id = request.request_id
        if request_id in self.request_states:
            raise ValueError(f"Request id {request_id!r} is already running.")
        if parent_req is None and request.sampling_params.n > 1:
            raise ValueError(f"Request {request_id!r} has n={request.sampling_params.n}: add "
                             f"its children (ParentRequest.make_child_request) instead.")
        state = RequestState(request, prompt, parent_req, request_index, self.tokenizer, queue)
        self.request_states[request_id] = state
        if parent_req is not None:
            if parent_req.request_id not in self.parent_requests:
                self.parent_requests[parent_req.request_id] = parent_req
                parent_req.prompt = prompt
                parent_req.prompt_token_ids = request.prompt_token_ids
                parent_req.metrics = RequestMetrics(arrival_time=request.arrival_time)
            if queue is not None:
                parent_req.queue = queue
            parent_req.child_requests.add(request_id)

    # ------------------------------------------------------------------ per step
    def process_outputs(self, outputs: list[EngineCoreOutput]) -> OutputProcessorOutput:
        now = time.time()
        now_mono = time.monotonic()
        stats = IterationStats() if self.log_stats else None
        request_outputs: list[RequestOutput] = []
        reqs_to_abort: list[str] = []
        touched_parents: dict[str, ParentRequest] = {}

        for eco in outputs:
            state = self.request_states.get(eco.request_id)
            if state is None:
                continue   # finished here (stop string / abort) while the core was stepping
            new_ids = eco.new_token_ids
            finish_reason = eco.finish_reason
            stop_reason = eco.stop_reason
            if eco.num_cached_tokens:
                state.num_cached_tokens = eco.num_cached_tokens
            if eco.kv_transfer_params is not None:
                state.kv_transfer_params = eco.kv_transfer_params
            if eco.events:
                self._record_events(state, eco.events, now, now_mono)
            if new_ids:
                self._record_token_times(state, len(new_ids), now, now_mono, stats)

            # The engine finished it on EOS or a stop token id: that token's text is left out.
            stop_terminated = finish_reason == FinishReason.STOP
            stop_string = state.detokenizer.update(new_ids, stop_terminated,
                                                   finished=finish_reason is not None)
            if stop_string is not None:
                if finish_reason is None:
                    reqs_to_abort.append(eco.request_id)
                finish_reason, stop_reason = FinishReason.STOP, stop_string
            state.logprobs_processor.update_from_output(eco)

            if finish_reason is not None:
                self._finish(state, str(finish_reason), stop_reason, now, now_mono, stats)
            elif not new_ids:
                continue   # a prefill chunk (prompt logprobs only): nothing to report yet
            self._emit(state, request_outputs, touched_parents)

        for parent in touched_parents.values():
            self._emit_parent(parent, now, request_outputs)
        return OutputProcessorOutput(request_outputs, reqs_to_abort, stats)

    def abort_requests(self, request_ids: list[str],
                       stats: Optional[IterationStats] = None) -> list[RequestOutput]:
        """Finish these requests with "abort" (user ids; a parent id aborts its children).
        Returns their final outputs; `last_aborted_child_ids` lists the engine-core ids;
        `stats`, when given, gets each one's finished-request record."""
        now, now_mono = time.time(), time.monotonic()
        request_outputs: list[RequestOutput] = []
        touched_parents: dict[str, ParentRequest] = {}
        core_ids: list[str] = []
        for rid in request_ids:
            parent = self.parent_requests.get(rid)
            ids = sorted(parent.child_requests) if parent is not None else [rid]
            for cid in ids:
                state = self.request_states.get(cid)
                if state is None:
                    continue
                core_ids.append(cid)
                state.detokenizer.update([], False, finished=True)
                self._finish(state, str(FinishReason.ABORT), None, now, now_mono, stats)
                self._emit(state, request_outputs, touched_parents)
        for parent in touched_parents.values():
            self._emit_parent(parent, now, request_outputs)
        self.last_aborted_child_ids = core_ids
        return request_outputs

    # ------------------------------------------------------------------ helpers
    def _record_token_times(self, state: RequestState, num_new: int, now: float,
                            now_mono: float, stats: Optional[IterationStats]) -> None:
        if state.metrics.first_token_time is None:
            state.metrics.first_token_time = now
            state.first_token_monotonic = now_mono
            if stats is not None:
                stats.num_prompt_tokens += len(state.prompt_token_ids)
                stats.time_to_first_tokens_iter.append(now_mono - state.added_monotonic)
        elif stats is not None and state.last_token_monotonic is not None:
            stats.inter_token_latencies_iter.append(now_mono - state.last_token_monotonic)
        state.metrics.last_token_time = now
        state.last_token_monotonic = now_mono
        if stats is not None:
            stats.num_generation_tokens += num_new

    @staticmethod
    def _record_events(state: RequestState, events: list[tuple[int, float]], now: float,
                       now_mono: float) -> None:
        for event_type, ts in events:
            if event_type == EngineCoreEventType.QUEUED:
                state.queued_ts = ts
            elif event_type == EngineCoreEventType.SCHEDULED and state.scheduled_ts is None:
                state.scheduled_ts = ts
                # RequestMetrics holds wall-clock times: shift by the clocks' offset.
                state.metrics.first_scheduled_time = now - (now_mono - ts)

    def _finish(self, state: RequestState, finish_reason: str, stop_reason: Union[int, str, None],
                now: float, now_mono: float, stats: Optional[IterationStats]) -> None:
        state.finish_reason = finish_reason
        state.stop_reason = stop_reason
        state.metrics.finished_time = now
        self.request_states.pop(state.request_id, None)
        if stats is not None:
            first, last = state.first_token_monotonic, state.last_token_monotonic
            finished = FinishedRequestStats(
                finish_reason=finish_reason, e2e_latency=now_mono - state.added_monotonic,
                num_prompt_tokens=len(state.prompt_token_ids),
                num_generation_tokens=state.detokenizer.num_output_tokens,
                first_token_latency=(first - state.added_monotonic) if first is not None else 0.0)
            sched = state.scheduled_ts
            if sched is not None:
                if state.queued_ts is not None:
                    finished.queued_time = max(sched - state.queued_ts, 0.0)
                if first is not None and last is not None:
                    finished.prefill_time = max(first - sched, 0.0)
                    finished.decode_time = last - first
                    finished.inference_time = max(last - sched, 0.0)
            stats.finished_requests.append(finished)

    def _emit(self, state: RequestState, request_outputs: list[RequestOutput],
              touched_parents: dict[str, ParentRequest]) -> None:
        parent = state.parent_req
        if parent is None:
            out = state.make_request_output()
            if out is not None:
                self._deliver(out, state.queue, request_outputs)
            return
        if state.output_kind == RequestOutputKind.FINAL_ONLY and not state.finished:
            return
        parent.add_child_output(state.request_id, state.make_completion_output(), state)
        touched_parents[parent.request_id] = parent

    def _emit_parent(self, parent: ParentRequest, now: float,
                     request_outputs: list[RequestOutput]) -> None:
        out = parent.make_request_output(now)
        if parent.finished:
            self.parent_requests.pop(parent.request_id, None)
        if out is not None:
            self._deliver(out, parent.queue, request_outputs)

    @staticmethod
    def _deliver(out: RequestOutput, queue: Optional[RequestOutputCollector],
                 request_outputs: list[RequestOutput]) -> None:
        if queue is not None:
            queue.put(out)
        else:
            request_outputs.append(out)
