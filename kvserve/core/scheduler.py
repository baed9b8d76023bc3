"""Scheduler: decides which requests run each step and how many tokens each computes.

One rule covers everything: each scheduled request's `num_computed_tokens` catches up with its
`num_tokens` within a per-step token budget. Running requests are served first (in order),
then waiting ones. A prefill longer than the budget (or `long_prefill_token_threshold`) is
chunked. When KV blocks run out, the lowest-priority running request is preempted: its blocks
are freed and it goes back to the waiting queue to be recomputed later.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Iterable, Optional

from kvserve.config import CacheConfig, SchedulerConfig
from kvserve.core.kv_cache_manager import KVCacheManager
from kvserve.core.request import Request, RequestStatus
from kvserve.core.request_queue import create_request_queue
from kvserve.core.sched_output import (CachedRequestData, ModelRunnerOutput, NewRequestData,
                                       SchedulerOutput)
from kvserve.engine.messages import (EngineCoreEventType, EngineCoreOutput, EngineCoreOutputs,
                                     FinishReason)
from kvserve.spec_decode.metrics import SpecDecodingStats

if TYPE_CHECKING:
    from kvserve.kv_transfer.base import KVConnectorBase
    from kvserve.spec_decode.adaptive import SpecDecodeController
    from kvserve.structured_output.manager import StructuredOutputManager

logger = logging.getLogger(__name__)

_FINISH_REASON = {
    RequestStatus.FINISHED_STOPPED: FinishReason.STOP,
    RequestStatus.FINISHED_LENGTH_CAPPED: FinishReason.LENGTH,
    RequestStatus.FINISHED_ABORTED: FinishReason.ABORT,
    RequestStatus.FINISHED_ERROR: FinishReason.ERROR,
}


@dataclass
class SchedulerStats:
    """A snapshot of the scheduler. Counters are cumulative since the engine started, so any
    number of readers (metrics, get_stats) can take deltas without resetting each other."""
    num_running_reqs: int
    num_waiting_reqs: int
    kv_cache_usage: float
    num_free_blocks: int
    num_total_blocks: int
    prefix_cache_queries: int
    prefix_cache_hits: int
    num_preemptions: int
    # Speculative decoding counters (cumulative; absent without speculation).
    spec_decoding: Optional[dict] = None
    # KV connector counters (kv_transfer.scheduling.KVTransferScheduling.stats), if any.
    kv_transfer: Optional[dict] = None

    def to_dict(self) -> dict:
        d = dict(self.__dict__)
        d.update(d.pop("kv_transfer") or {})
        return d


def check_stop(request: Request, max_model_len: int) -> bool:
    """Set the request's finished status if its last token ends it (vLLM's order of checks)."""
    if request.num_tokens >= max_model_len or request.num_output_tokens >= request.max_tokens:
        request.status = RequestStatus.FINISHED_LENGTH_CAPPED
        return True
    params = request.sampling_params
    if request.num_output_tokens < params.min_tokens:
        return False
    last = request.output_token_ids[-1]
    if not params.ignore_eos and last in request.eos_token_ids:
        request.status = RequestStatus.FINISHED_STOPPED
        return True
    if params.stop_token_ids and last in params.stop_token_ids:
        request.status = RequestStatus.FINISHED_STOPPED
        request.stop_reason = last
        return True
    return False


class Scheduler:
    def __init__(self, scheduler_config: SchedulerConfig, cache_config: CacheConfig,
                 structured_output_manager: Optional["StructuredOutputManager"] = None,
                 enable_jump_forward: bool = False, num_spec_tokens: int = 0,
                 num_lookahead_tokens: int = 0, send_sampled_tokens: bool = False,
                 kv_connector: Optional["KVConnectorBase"] = None,
                 spec_decode_controller: Optional["SpecDecodeController"] = None) -> None:
        self.config = scheduler_config
        # Pipeline parallelism: every stage (not only the sampling one) needs the sampled
        # tokens, so cached requests carry the tokens the workers have not seen yet.
        self.send_sampled_tokens = send_sampled_tokens
        self._worker_num_tokens: dict[str, int] = {}
        # Requests in a batch that is scheduled but not yet updated (the PP batch queue keeps
        # several in flight): never scheduled again, nor preempted, until their output is in.
        self.in_flight: set[str] = set()
        self.structured_output_manager = structured_output_manager
        self.enable_jump_forward = enable_jump_forward
        # Requests whose grammar is compiling (WAITING_FOR_FSM), in arrival order; they join
        # the waiting queue when it is ready, so nothing queues behind a slow compile.
        self.waiting_for_fsm: list[Request] = []
        # Requests whose grammar failed to compile: reported (finish_reason "error") next update.
        self._failed: list[Request] = []
        self.max_model_len = scheduler_config.max_model_len
        self.num_blocks = cache_config.num_blocks
        self.kv_cache_manager = KVCacheManager(
            num_blocks=cache_config.num_blocks, block_size=cache_config.block_size,
            enable_caching=cache_config.enable_prefix_caching, max_model_len=self.max_model_len)
        self.requests: dict[str, Request] = {}
        self.waiting = create_request_queue(scheduler_config.policy)
        self.running: list[Request] = []
        # Requests finished since the last step; workers drop them from their batch.
        self.finished_req_ids: set[str] = set()
        # Requests whose state the workers hold (scheduled at least once, not since preempted).
        self._on_workers: set[str] = set()
        self.num_preemptions = 0
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0
        self._step_id = 0
        # Speculative decoding: drafts scheduled in the step being built, and the counters.
        self._spec_scheduled: dict[str, list[int]] = {}
        # Slots past the scheduled tokens that a draft model writes its drafts' KV into.
        self.num_lookahead_tokens = num_lookahead_tokens
        self.spec_decoding_stats = SpecDecodingStats(num_spec_tokens) if num_spec_tokens else None
        # The adaptive rule (spec_decode/adaptive.py): who drafts, from acceptance and step times.
        self.spec_controller = spec_decode_controller
        self._step_start = 0.0
        self._last_update: tuple[int, float] = (-1, 0.0)   # (step_id, time) of the last update
        self.kv_transfer = None
        if kv_connector is not None:
            from kvserve.kv_transfer.scheduling import KVTransferScheduling
            self.kv_transfer = KVTransferScheduling(kv_connector, self.kv_cache_manager)

    # ------------------------------------------------------------------ requests in / out
    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"Request id {request.request_id!r} is already in use.")
        if request.use_structured_output:
            if self.structured_output_manager is None:
                raise ValueError("This engine has no structured output support.")
            self.structured_output_manager.grammar_init(request)
            request.status = RequestStatus.WAITING_FOR_FSM
            self.waiting_for_fsm.append(request)
        else:
            self.waiting.add(request)
        self.requests[request.request_id] = request
        request.record_event(EngineCoreEventType.QUEUED)

    def finish_requests(self, request_ids: Iterable[str], status: RequestStatus) -> list[str]:
        """Finish requests from outside the step (abort, stop string). Unknown ids are ignored."""
        done = []
        for rid in request_ids:
            request = self.requests.get(rid)
            if request is None or request.is_finished():
                continue
            if request.status == RequestStatus.RUNNING:
                self.running.remove(request)
            elif request.status == RequestStatus.WAITING_FOR_FSM:
                self.waiting_for_fsm.remove(request)
            elif request.status == RequestStatus.WAITING_FOR_REMOTE_KVS:
                assert self.kv_transfer is not None
                self.kv_transfer.abort_loading(request)   # its blocks are freed once unused
                request.status = status
                del self.requests[rid]
                done.append(rid)
                continue
            else:
                self.waiting.remove(request)
            request.status = status
            delay_free = False
            if self.kv_transfer is not None:
                delay_free, _ = self.kv_transfer.request_finished(request)
            self._free_request(request, delay_free)
            done.append(rid)
        return done

    def _free_request(self, request: Request, delay_free_blocks: bool = False) -> None:
        if not delay_free_blocks:
            self.kv_cache_manager.free(request)
        if request.structured_output_request is not None:
            assert self.structured_output_manager is not None
            self.structured_output_manager.drop(request)
        del self.requests[request.request_id]
        self._worker_num_tokens.pop(request.request_id, None)
        if self.spec_controller is not None:
            self.spec_controller.drop(request.request_id)
        if request.request_id in self._on_workers:
            self._on_workers.discard(request.request_id)
            self.finished_req_ids.add(request.request_id)

    def has_unfinished_requests(self) -> bool:
        # Blocks held for a KV transfer keep the engine stepping: the worker reports them.
        return bool(self.requests or self._failed
                    or (self.kv_transfer is not None and self.kv_transfer.has_pending))

    def get_num_unfinished_requests(self) -> int:
        return len(self.requests)

    # ------------------------------------------------------------------ schedule
    def schedule(self) -> SchedulerOutput:
        if self.waiting_for_fsm:
            self._admit_compiled()
        if self.kv_transfer is not None:
            self._admit_loaded()
        budget = self.config.max_num_batched_tokens
        num_scheduled: dict[str, int] = {}
        new_blocks: dict[str, list[int]] = {}
        preempted: list[Request] = []
        self._spec_scheduled = {}

        budget = self._schedule_running(budget, num_scheduled, new_blocks, preempted)
        scheduled_new: list[Request] = []
        if not preempted:  # out of blocks: admitting more would only thrash
            budget = self._schedule_waiting(budget, num_scheduled, new_blocks, scheduled_new)

        output = self._make_output(num_scheduled, new_blocks, scheduled_new, preempted)
        if self.spec_controller is not None:
            drafters = self.spec_controller.draft_req_ids(list(num_scheduled))
            output.spec_decode_draft_req_ids = drafters
            output.spec_decode_num_draft_tokens = self.spec_controller.num_draft_tokens(
                len(num_scheduled), drafters)
        if self.kv_transfer is not None:
            output.kv_connector_metadata = self.kv_transfer.connector.build_connector_meta(output)
        # Advance progress now: the workers compute these tokens in this step.
        for rid, n in num_scheduled.items():
            request = self.requests[rid]
            request.num_computed_tokens += n   # drafts included: rejected ones roll back
            request.spec_token_ids = []
        self.in_flight.update(num_scheduled)
        self.finished_req_ids = set()
        self._step_start = time.perf_counter()
        return output

    def _admit_compiled(self) -> None:
        """Requests whose grammar is ready join the waiting queue; failed ones finish."""
        assert self.structured_output_manager is not None
        still_compiling = []
        for request in self.waiting_for_fsm:
            if not self.structured_output_manager.take_ready(request):
                still_compiling.append(request)
                continue
            so_req = request.structured_output_request
            assert so_req is not None
            if so_req.error is not None:
                logger.warning("Request %s: grammar compilation failed: %s",
                               request.request_id, so_req.error)
                request.status = RequestStatus.FINISHED_ERROR
                request.stop_reason = f"grammar compilation failed: {so_req.error}"
                self._free_request(request)
                self._failed.append(request)
                continue
            request.status = RequestStatus.WAITING
            self.waiting.add(request)
        self.waiting_for_fsm = still_compiling

    def _admit_loaded(self) -> None:
        """Requests whose KV load ended go back to the front of the waiting queue: with the
        loaded tokens computed, or (failed load) to be computed locally."""
        assert self.kv_transfer is not None
        for request, _loaded in reversed(self.kv_transfer.take_finished_loads()):
            request.status = RequestStatus.WAITING
            self.waiting.prepend(request)

    def _num_new_tokens(self, request: Request, budget: int) -> int:
        n = request.num_tokens - request.num_computed_tokens
        threshold = self.config.long_prefill_token_threshold
        if 0 < threshold < n:
            n = threshold
        return min(n, budget)

    def _schedule_running(self, budget: int, num_scheduled: dict[str, int],
                          new_blocks: dict[str, list[int]], preempted: list[Request]) -> int:
        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            if request.request_id in self.in_flight:
                i += 1
                continue
            n = self._num_new_tokens(request, budget)
            if n <= 0:
                i += 1
                continue
            spec = self._spec_tokens_to_schedule(request, n, budget)
            n += len(spec)
            while True:
                blocks = self.kv_cache_manager.allocate_slots(
                    request, n, num_lookahead_tokens=self.num_lookahead_tokens)
                if blocks is not None:
                    break
                victim = self._pick_victim(request)
                victim_idx = self.running.index(victim)
                if victim.request_id in num_scheduled:   # already scheduled this step: undo
                    budget += num_scheduled.pop(victim.request_id)
                    new_blocks.pop(victim.request_id, None)
                    self._spec_scheduled.pop(victim.request_id, None)
                self._preempt(victim)
                preempted.append(victim)
                if victim is request:
                    break
                if victim_idx < i:
                    i -= 1
            if blocks is None:   # the request preempted itself: nothing else can run
                break
            num_scheduled[request.request_id] = n
            new_blocks[request.request_id] = [b.block_id for b in blocks]
            if spec:
                self._spec_scheduled[request.request_id] = spec
            budget -= n
            i += 1
        return budget

    def _spec_tokens_to_schedule(self, request: Request, num_new_tokens: int,
                                 budget: int) -> list[int]:
        """The request's drafts that run this step: only after its one new (decode) token,
        within the token budget, max_model_len, and max_tokens (a step yields at most
        drafts + 1 tokens). A constrained request's drafts were cut at the first token its
        grammar refuses when they arrived (_set_drafts)."""
        drafts = request.spec_token_ids
        if (not drafts or num_new_tokens != 1
                or request.num_tokens - request.num_computed_tokens != 1):
            return []
        room = min(budget - 1, self.max_model_len - request.num_tokens,
                   request.max_tokens - request.num_output_tokens - 1)
        return drafts[:max(room, 0)]

    def _pick_victim(self, request: Request) -> Request:
        # A request in an in-flight batch keeps its blocks until that batch's output is in.
        candidates = [r for r in self.running if r.request_id not in self.in_flight
                      or r is request] if self.in_flight else self.running
        if self.config.policy == "priority":
            return max(candidates)   # lowest priority, latest arrival
        return candidates[-1]

    def _preempt(self, request: Request) -> None:
        self.running.remove(request)
        self.kv_cache_manager.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.spec_token_ids = []
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.prepend(request)
        request.record_event(EngineCoreEventType.PREEMPTED)

    def _schedule_waiting(self, budget: int, num_scheduled: dict[str, int],
                          new_blocks: dict[str, list[int]], scheduled_new: list[Request]) -> int:
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            request = self.waiting.peek()
            if self.kv_cache_manager.get_blocks(request.request_id):
                # Its KV was loaded from outside: it holds its blocks already.
                computed_blocks, num_computed = [], request.num_computed_tokens
            else:
                computed_blocks, num_computed = self.kv_cache_manager.get_computed_blocks(request)
                if self.kv_transfer is not None and self._start_remote_load(
                        request, computed_blocks, num_computed):
                    continue
            n = request.num_tokens - num_computed
            threshold = self.config.long_prefill_token_threshold
            if 0 < threshold < n:
                n = threshold
            if n > budget:
                if not self.config.enable_chunked_prefill:
                    break   # the whole prompt must fit in one step
                n = budget
            blocks = self.kv_cache_manager.allocate_slots(
                request, n, num_new_computed_tokens=num_computed - request.num_computed_tokens,
                new_computed_blocks=computed_blocks,
                num_lookahead_tokens=self.num_lookahead_tokens)
            if blocks is None:
                break
            self.waiting.pop()
            request.record_event(EngineCoreEventType.SCHEDULED)
            request.status = RequestStatus.RUNNING
            request.num_computed_tokens = num_computed
            if request.num_cached_tokens < 0:
                request.num_cached_tokens = num_computed
            self.running.append(request)
            scheduled_new.append(request)
            num_scheduled[request.request_id] = n
            new_blocks[request.request_id] = [b.block_id for b in blocks]
            budget -= n
        return budget

    def _start_remote_load(self, request: Request, computed_blocks: list,
                           num_computed: int) -> bool:
        """Ask the connector for the request's tokens beyond its local prefix hit; if it has
        some, allocate the blocks and let the request wait for the load. False: no load (also
        when blocks are short: the request then stays at the head of the queue)."""
        assert self.kv_transfer is not None
        num_external = self.kv_transfer.num_external_tokens(request, num_computed)
        if num_external <= 0:
            return False
        blocks = self.kv_cache_manager.allocate_slots(
            request, num_external, num_new_computed_tokens=num_computed,
            new_computed_blocks=computed_blocks, delay_cache_blocks=True)
        if blocks is None:
            return False
        self.waiting.pop()
        request.num_computed_tokens = num_computed
        if request.num_cached_tokens < 0:
            request.num_cached_tokens = num_computed + num_external
        request.status = RequestStatus.WAITING_FOR_REMOTE_KVS
        self.kv_transfer.start_loading(request, num_external)
        return True

    def _make_output(self, num_scheduled: dict[str, int], new_blocks: dict[str, list[int]],
                     scheduled_new: list[Request], preempted: list[Request]) -> SchedulerOutput:
        preempted_ids = {r.request_id for r in preempted if r.request_id in self._on_workers}
        self._on_workers -= preempted_ids
        new_reqs = []
        for r in scheduled_new:
            new_reqs.append(NewRequestData(
                req_id=r.request_id, token_ids=list(r.all_token_ids),
                num_prompt_tokens=r.num_prompt_tokens, sampling_params=r.sampling_params,
                block_ids=self.kv_cache_manager.get_block_ids(r.request_id),
                num_computed_tokens=r.num_computed_tokens,
                eos_token_ids=[] if r.sampling_params.ignore_eos else sorted(r.eos_token_ids)))
            self._on_workers.add(r.request_id)
            self._worker_num_tokens[r.request_id] = r.num_tokens
            if r.structured_output_request is not None:   # token_ids above carry them
                r.structured_output_request.pending_tokens = []
        new_ids = {r.request_id for r in scheduled_new}
        cached = CachedRequestData()
        for rid, blocks in new_blocks.items():
            if rid in new_ids:
                continue
            cached.req_ids.append(rid)
            cached.new_block_ids.append(blocks)
            request = self.requests[rid]
            cached.num_computed_tokens.append(request.num_computed_tokens)
            so_req = request.structured_output_request
            pending = so_req.pending_tokens if so_req is not None else []
            if self.send_sampled_tokens:   # sampled and jump-forward tokens alike
                pending = request.all_token_ids[self._worker_num_tokens[rid]:]
                self._worker_num_tokens[rid] = request.num_tokens
            cached.new_token_ids.append(list(pending))
            if so_req is not None and so_req.pending_tokens:
                so_req.pending_tokens = []
        self._step_id += 1
        return SchedulerOutput(
            scheduled_new_reqs=new_reqs, scheduled_cached_reqs=cached,
            num_scheduled_tokens=num_scheduled,
            total_num_scheduled_tokens=sum(num_scheduled.values()),
            finished_req_ids=set(self.finished_req_ids), preempted_req_ids=preempted_ids,
            step_id=self._step_id, scheduled_spec_decode_tokens=self._spec_scheduled)

    # ------------------------------------------------------------------ update
    def update_from_output(self, scheduler_output: SchedulerOutput,
                           runner_output: ModelRunnerOutput) -> EngineCoreOutputs:
        if self.spec_controller is not None:
            self._observe_step_time(scheduler_output, runner_output)
        outputs = [self._error_output(r) for r in self._failed]
        self._failed = []
        self.in_flight.difference_update(scheduler_output.num_scheduled_tokens)
        if self.kv_transfer is not None:
            self.kv_transfer.update_from_output(runner_output.kv_connector_output)
        for idx, rid in enumerate(runner_output.req_ids):
            request = self.requests.get(rid)
            if request is None or request.status != RequestStatus.RUNNING:
                continue   # aborted or preempted while the step ran
            sampled = runner_output.sampled_token_ids[idx]
            if rid in scheduler_output.scheduled_spec_decode_tokens:
                self._after_spec_step(request, len(scheduler_output.scheduled_spec_decode_tokens[rid]),
                                      len(sampled))
            new_tokens: list[int] = []
            for token in sampled:
                request.append_output_token_ids([token])
                new_tokens.append(token)
                if check_stop(request, self.max_model_len):
                    break
            if request.structured_output_request is not None and new_tokens:
                new_tokens.extend(self._advance_grammar(request, new_tokens))
            new_logprobs = None
            if runner_output.logprobs and rid in runner_output.logprobs and new_tokens:
                lp = runner_output.logprobs[rid]
                new_logprobs = [(lp.logprob_token_ids[j], lp.logprobs[j], lp.sampled_token_ranks[j])
                                for j in range(len(new_tokens))]
            new_prompt_logprobs = None
            if runner_output.prompt_logprobs and rid in runner_output.prompt_logprobs:
                plp = runner_output.prompt_logprobs[rid]
                new_prompt_logprobs = list(zip(plp.logprob_token_ids, plp.logprobs,
                                               plp.sampled_token_ranks))
            finished = request.is_finished()
            if runner_output.spec_token_ids is not None and not finished:
                self._set_drafts(request, runner_output.spec_token_ids[idx])
            delay_free, kv_params = False, None
            if finished and self.kv_transfer is not None:
                delay_free, kv_params = self.kv_transfer.request_finished(request)
            if new_tokens or new_prompt_logprobs or finished:
                outputs.append(EngineCoreOutput(
                    request_id=rid, new_token_ids=new_tokens, new_logprobs=new_logprobs,
                    new_prompt_logprobs=new_prompt_logprobs,
                    finish_reason=_FINISH_REASON.get(request.status),
                    stop_reason=request.stop_reason,
                    num_cached_tokens=max(request.num_cached_tokens, 0),
                    events=request.take_events(), kv_transfer_params=kv_params))
            if finished:
                self.running.remove(request)
                self._free_request(request, delay_free)
        return EngineCoreOutputs(outputs=outputs)

    def _after_spec_step(self, request: Request, num_draft: int, num_sampled: int) -> None:
        """Roll back the rejected drafts' positions (their KV slots are rewritten next step;
        only blocks full of accepted tokens were ever cached) and count the acceptance."""
        num_accepted = max(num_sampled - 1, 0)
        request.num_computed_tokens -= num_draft - num_accepted
        if self.spec_decoding_stats is not None:
            self.spec_decoding_stats.observe(num_draft, num_accepted)
        if self.spec_controller is not None:
            self.spec_controller.record(request.request_id, num_draft, num_accepted)

    def _set_drafts(self, request: Request, drafts: list[int]) -> None:
        """Next step's drafts; a constrained request keeps only those its grammar accepts."""
        so_req = request.structured_output_request
        if drafts and so_req is not None and so_req.grammar is not None:
            drafts = so_req.grammar.validate_tokens(drafts)
        request.spec_token_ids = drafts

    def _observe_step_time(self, so: SchedulerOutput, runner_output: ModelRunnerOutput) -> None:
        """Feed the adaptive rule the cost of an all-decode step: the engine loop's period
        since the previous step's update (what drafting adds outside schedule -> update, such
        as the draft positions' grammar bitmask, included), else schedule -> update."""
        assert self.spec_controller is not None
        now = time.perf_counter()
        last_id, last_time = self._last_update
        self._last_update = (so.step_id, now)
        step_time = now - (last_time if last_id == so.step_id - 1 else self._step_start)
        spec = so.scheduled_spec_decode_tokens
        if so.is_empty or any(n != 1 + len(spec.get(rid, ()))
                              for rid, n in so.num_scheduled_tokens.items()):
            return   # a prefill chunk in the step: not a decode step's cost
        proposed = sum(map(len, runner_output.spec_token_ids or ()))
        drafters = so.spec_decode_draft_req_ids or set()
        self.spec_controller.observe_step(
            len(so.num_scheduled_tokens), sum(map(len, spec.values())), proposed, step_time,
            runner_output.spec_propose_time, num_resumed=len(drafters.difference(spec)))

    def _advance_grammar(self, request: Request, new_tokens: list[int]) -> list[int]:
        """Move the request's matcher over its new tokens; a finished grammar stops the
        request. Returns the tokens jump-forward decoding appended (the grammar forced them)."""
        mgr = self.structured_output_manager
        assert mgr is not None
        if not mgr.accept_tokens(request, new_tokens):
            # Cannot happen with the bitmask applied; finish rather than produce invalid output.
            logger.error("Request %s: token(s) %s refused by its grammar.", request.request_id,
                         new_tokens)
            if not request.is_finished():
                request.status = RequestStatus.FINISHED_ERROR
                request.stop_reason = mgr.refusal_reason(request)
            return []
        if request.is_finished():
            return []
        if mgr.is_terminated(request):
            request.status = RequestStatus.FINISHED_STOPPED
            return []
        if not self.enable_jump_forward or request.sampling_params.logprobs is not None:
            return []
        forced = mgr.jump_forward_tokens(request)
        appended: list[int] = []
        for token in forced:
            request.append_output_token_ids([token])
            appended.append(token)
            if check_stop(request, self.max_model_len):
                break
        if appended and not request.is_finished() and mgr.is_terminated(request):
            request.status = RequestStatus.FINISHED_STOPPED
        assert request.structured_output_request is not None
        request.structured_output_request.pending_tokens.extend(appended)
        return appended

    @staticmethod
    def _error_output(request: Request) -> EngineCoreOutput:
        return EngineCoreOutput(request_id=request.request_id, new_token_ids=[],
                                finish_reason=FinishReason.ERROR, stop_reason=request.stop_reason,
                                events=request.take_events())

    # ------------------------------------------------------------------ stats
    def make_stats(self) -> SchedulerStats:
        pc = self.kv_cache_manager.make_prefix_cache_stats()   # delta since the last call
        self.prefix_cache_queries += pc.queries
        self.prefix_cache_hits += pc.hits
        return SchedulerStats(
            num_running_reqs=len(self.running),
            num_waiting_reqs=len(self.waiting) + len(self.waiting_for_fsm),
            kv_cache_usage=self.kv_cache_manager.usage,
            num_free_blocks=self.kv_cache_manager.num_free_blocks, num_total_blocks=self.num_blocks,
            prefix_cache_queries=self.prefix_cache_queries, prefix_cache_hits=self.prefix_cache_hits,
            num_preemptions=self.num_preemptions,
            spec_decoding=(self.spec_decoding_stats.to_dict()
                           if self.spec_decoding_stats is not None else None),
            kv_transfer=self.kv_transfer.stats() if self.kv_transfer is not None else None)

    def reset_prefix_cache(self) -> bool:
        return self.kv_cache_manager.reset_prefix_cache()
