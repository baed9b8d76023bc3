"""Scheduler: decides which requests run each step and how many tokens each computes.

One rule covers everything: each scheduled request's `num_computed_tokens` catches up with its
`num_tokens` within a per-step token budget. Running requests are served first (in order),
then waiting ones. A prefill longer than the budget (or `long_prefill_token_threshold`) is
chunked. When KV blocks run out, the lowest-priority running request is preempted: its blocks
are freed and it goes back to the waiting queue to be recomputed later.

Features (structured outputs, speculative decoding, KV transfer) take part through the
SchedulerHooks the engine core hands in (sched_hooks.py); the scheduler itself knows none.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterable, Optional, Sequence

from kvserve.config import CacheConfig, SchedulerConfig
from kvserve.core.kv_cache_coordinator import make_kv_cache_manager, to_block_ids
from kvserve.core.messages import (EngineCoreEventType, EngineCoreOutput, EngineCoreOutputs,
                                   FinishReason)
from kvserve.core.request import Request, RequestStatus
from kvserve.core.request_queue import create_request_queue
from kvserve.core.sched_hooks import SchedulerHook, append_tokens, overriding
from kvserve.core.sched_output import (CachedRequestData, LogprobsLists, ModelRunnerOutput,
                                       NewRequestData, SchedulerOutput)

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
    # The hooks' counters (spec_decoding, the KV connector's), flattened into the dict.
    feature_stats: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict:
        d = dict(self.__dict__)
        d.update(d.pop("feature_stats"))
        return d


@dataclass
class _StepPlan:
    """What one schedule() call decides, as its two passes fill it."""
    budget: int
    num_scheduled: dict[str, int] = field(default_factory=dict)
    new_blocks: dict[str, list[int]] = field(default_factory=dict)
    drafts: dict[str, list[int]] = field(default_factory=dict)
    scheduled_new: list[Request] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)

    def add(self, rid: str, n: int, blocks: list, drafts: list[int]) -> None:
        self.num_scheduled[rid] = n
        self.new_blocks[rid] = to_block_ids(blocks)   # one list per KV cache group if hybrid
        if drafts:
            self.drafts[rid] = drafts
        self.budget -= n

    def drop(self, rid: str) -> None:
        """Undo a request scheduled earlier in this step (it is being preempted)."""
        if rid in self.num_scheduled:
            self.budget += self.num_scheduled.pop(rid)
            self.new_blocks.pop(rid, None)
            self.drafts.pop(rid, None)


class Scheduler:
    def __init__(self, scheduler_config: SchedulerConfig, cache_config: CacheConfig,
                 hooks: Sequence[SchedulerHook] = (), num_lookahead_tokens: int = 0,
                 send_sampled_tokens: bool = False) -> None:
        self.config = scheduler_config
        self.max_model_len = scheduler_config.max_model_len
        self.num_blocks = cache_config.num_blocks
        # One block table per request, or one per KV cache group (sliding-window layers).
        self.kv_cache_manager = make_kv_cache_manager(cache_config, self.max_model_len)
        # Called in order at every point of a step (the engine core puts speculation before
        # structured outputs: drafts are set, then cut to what the grammar accepts).
        self.hooks = list(hooks)
        for hook in self.hooks:
            hook.bind(self.kv_cache_manager)
        # The per-request points call only the hooks that take part in them (LoRA's hook
        # takes none: with it, a step no longer makes two no-op calls per request).
        self._draft_hooks = overriding(self.hooks, "draft_tokens")
        self._update_hooks = overriding(self.hooks, "update_request")
        # Slots past the scheduled tokens that a draft model writes its drafts' KV into.
        self.num_lookahead_tokens = num_lookahead_tokens
        # Pipeline parallelism: the last stage does not append what it samples; every stage
        # learns the sampled tokens from the scheduler (CachedRequestData.new_token_ids).
        self.workers_append_sampled = not send_sampled_tokens
        # Per request on the workers: how many of its tokens they hold. The rest (sampled
        # ones under PP, jump-forward ones) travel with its next CachedRequestData.
        self._worker_num_tokens: dict[str, int] = {}
        # Requests in a batch that is scheduled but not yet updated (the PP batch queue keeps
        # several in flight): never scheduled again, nor preempted, until their output is in.
        self.in_flight: set[str] = set()
        # Requests a hook failed before they ran (grammar errors): reported next update.
        self._finished_early: list[Request] = []
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

    # ------------------------------------------------------------------ requests in / out
    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"Request id {request.request_id!r} is already in use.")
        if not any(hook.add_request(request) for hook in self.hooks):
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
            elif request.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED):
                self.waiting.remove(request)
            # Otherwise a hook holds it: its request_finished lets go of it.
            request.status = status
            self._free_request(request)
            done.append(rid)
        return done

    def _free_request(self, request: Request) -> Optional[dict[str, Any]]:
        """Release a finished request everywhere; returns its kv_transfer_params, if any."""
        keep_blocks, kv_params = False, None
        for hook in self.hooks:
            keep, params = hook.request_finished(request)
            keep_blocks, kv_params = keep_blocks or keep, kv_params or params
        if not keep_blocks:
            self.kv_cache_manager.free(request)
        rid = request.request_id
        del self.requests[rid]
        self._worker_num_tokens.pop(rid, None)
        if rid in self._on_workers:
            self._on_workers.discard(rid)
            self.finished_req_ids.add(rid)
        return kv_params

    def has_unfinished_requests(self) -> bool:
        # Blocks held for a KV transfer keep the engine stepping: the worker reports them.
        return bool(self.requests or self._finished_early
                    or any(hook.has_pending for hook in self.hooks))

    def get_num_unfinished_requests(self) -> int:
        return len(self.requests)

    @property
    def num_waiting_reqs(self) -> int:
        return len(self.waiting) + sum(hook.num_waiting for hook in self.hooks)

    # ------------------------------------------------------------------ schedule
    def schedule(self) -> SchedulerOutput:
        self._take_ready()
        plan = _StepPlan(budget=self.config.max_num_batched_tokens)
        self._schedule_running(plan)
        if not plan.preempted:  # out of blocks: admitting more would only thrash
            self._schedule_waiting(plan)
        output = self._make_output(plan)
        # Advance progress now: the workers compute these tokens in this step.
        for rid, n in plan.num_scheduled.items():
            request = self.requests[rid]
            request.num_computed_tokens += n   # drafts included: rejected ones roll back
            request.spec_token_ids = []
        self.in_flight.update(plan.num_scheduled)
        self.finished_req_ids = set()
        for hook in self.hooks:
            hook.on_scheduled(output, self.requests)
        return output

    def _take_ready(self) -> None:
        """Requests the hooks held that are ready join the waiting queue; failed ones finish."""
        for hook in self.hooks:
            ready = hook.take_ready()
            for request in reversed(ready) if hook.ready_to_front else ready:
                if request.is_finished():
                    self._free_request(request)
                    self._finished_early.append(request)
                elif hook.ready_to_front:
                    self.waiting.prepend(request)
                else:
                    self.waiting.add(request)

    def _may_schedule(self, request: Request) -> bool:
        """A request in a batch still in flight (PP) waits for that batch's output."""
        return request.request_id not in self.in_flight

    def _num_new_tokens(self, request: Request, budget: int) -> int:
        # Placeholders (async scheduling) stand for tokens a step in flight samples.
        n = request.num_tokens + request.num_output_placeholders - request.num_computed_tokens
        threshold = self.config.long_prefill_token_threshold
        if 0 < threshold < n:
            n = threshold
        return min(n, budget)

    def _schedule_running(self, plan: _StepPlan) -> None:
        i = 0
        while i < len(self.running) and plan.budget > 0:
            request = self.running[i]
            n = (self._num_new_tokens(request, plan.budget) if self._may_schedule(request)
                 else 0)
            if n <= 0:
                i += 1
                continue
            drafts = [t for hook in self._draft_hooks
                      for t in hook.draft_tokens(request, n, plan.budget)]
            blocks, i = self._allocate_or_preempt(request, n + len(drafts), i, plan)
            if blocks is None:   # the request preempted itself: nothing else can run
                break
            plan.add(request.request_id, n + len(drafts), blocks, drafts)
            i += 1

    def _allocate_or_preempt(self, request: Request, n: int, i: int,
                             plan: _StepPlan) -> tuple[Optional[list], int]:
        """Slots for `n` tokens of running[i], preempting the lowest-priority running request
        while blocks are short. Returns the blocks (None: the request preempted itself) and
        i moved down for each preempted request that stood before it."""
        while True:
            blocks = self.kv_cache_manager.allocate_slots(
                request, n, num_lookahead_tokens=self.num_lookahead_tokens)
            if blocks is not None:
                return blocks, i
            victim = self._pick_victim(request)
            if self.running.index(victim) < i:
                i -= 1
            plan.drop(victim.request_id)
            self._preempt(victim)
            plan.preempted.append(victim)
            if victim is request:
                return None, i

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
        request.num_output_placeholders = 0   # its in-flight output is dropped: recomputed
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.prepend(request)
        request.record_event(EngineCoreEventType.PREEMPTED)

    def _schedule_waiting(self, plan: _StepPlan) -> None:
        skipped: list[Request] = []    # not admissible now (a hook said so): back in front
        while self.waiting and plan.budget > 0 and len(self.running) < self.config.max_num_seqs:
            request = self.waiting.peek()
            if not all(hook.admissible(request, self.running) for hook in self.hooks):
                skipped.append(self.waiting.pop())
                continue
            if self.kv_cache_manager.get_blocks(request.request_id):
                # Its KV was loaded from outside: it holds its blocks already.
                computed_blocks, num_computed = [], request.num_computed_tokens
            else:
                computed_blocks, num_computed = self.kv_cache_manager.get_computed_blocks(request)
                if any(hook.admit(request, computed_blocks, num_computed) for hook in self.hooks):
                    self.waiting.pop()   # a hook took it (its KV loads from outside)
                    continue
            n = request.num_tokens - num_computed
            threshold = self.config.long_prefill_token_threshold
            if 0 < threshold < n:
                n = threshold
            if n > plan.budget:
                if not self.config.enable_chunked_prefill:
                    break   # the whole prompt must fit in one step
                n = plan.budget
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
            plan.scheduled_new.append(request)
            plan.add(request.request_id, n, blocks, [])
        for request in reversed(skipped):
            self.waiting.prepend(request)

    def _make_output(self, plan: _StepPlan) -> SchedulerOutput:
        preempted_ids = {r.request_id for r in plan.preempted if r.request_id in self._on_workers}
        self._on_workers -= preempted_ids
        new_reqs = []
        for r in plan.scheduled_new:
            new_reqs.append(NewRequestData(
                req_id=r.request_id, token_ids=list(r.all_token_ids),
                num_prompt_tokens=r.num_prompt_tokens, sampling_params=r.sampling_params,
                block_ids=self.kv_cache_manager.get_block_ids(r.request_id),
                num_computed_tokens=r.num_computed_tokens,
                eos_token_ids=[] if r.sampling_params.ignore_eos else sorted(r.eos_token_ids),
                pooling_params=r.pooling_params,
                lora_request=r.lora_request))
            self._on_workers.add(r.request_id)
            self._worker_num_tokens[r.request_id] = r.num_tokens
        new_ids = {r.request_id for r in plan.scheduled_new}
        cached = CachedRequestData()
        for rid, blocks in plan.new_blocks.items():
            if rid in new_ids:
                continue
            request = self.requests[rid]
            cached.req_ids.append(rid)
            cached.new_block_ids.append(blocks)
            cached.num_computed_tokens.append(request.num_computed_tokens)
            cached.new_token_ids.append(request.all_token_ids[self._worker_num_tokens[rid]:])
            self._worker_num_tokens[rid] = request.num_tokens
        self._step_id += 1
        return SchedulerOutput(
            scheduled_new_reqs=new_reqs, scheduled_cached_reqs=cached,
            num_scheduled_tokens=plan.num_scheduled,
            total_num_scheduled_tokens=sum(plan.num_scheduled.values()),
            finished_req_ids=set(self.finished_req_ids), preempted_req_ids=preempted_ids,
            step_id=self._step_id, scheduled_spec_decode_tokens=plan.drafts)

    # ------------------------------------------------------------------ update
    def update_from_output(self, scheduler_output: SchedulerOutput,
                           runner_output: ModelRunnerOutput) -> EngineCoreOutputs:
        outputs = [self._error_output(r) for r in self._finished_early]
        self._finished_early = []
        self.in_flight.difference_update(scheduler_output.num_scheduled_tokens)
        for hook in self.hooks:
            hook.update_from_output(scheduler_output, runner_output)
        for idx, rid in enumerate(runner_output.req_ids):
            request = self.requests.get(rid)
            if request is None or request.status != RequestStatus.RUNNING:
                continue   # aborted or preempted while the step ran
            output = self._update_request(request, idx, scheduler_output, runner_output)
            if output is not None:
                outputs.append(output)
        return EngineCoreOutputs(outputs=outputs)

    def _update_request(self, request: Request, idx: int, scheduler_output: SchedulerOutput,
                        runner_output: ModelRunnerOutput) -> Optional[EngineCoreOutput]:
        rid = request.request_id
        sampled = append_tokens(request, runner_output.sampled_token_ids[idx], self.max_model_len)
        if self.workers_append_sampled:
            self._worker_num_tokens[rid] = request.num_tokens
        new_tokens = sampled + [t for hook in self._update_hooks for t in hook.update_request(
            request, idx, sampled, scheduler_output, runner_output)]
        new_logprobs = None
        lp = (runner_output.logprobs or {}).get(rid)
        if lp is not None and new_tokens:
            new_logprobs = [(lp.logprob_token_ids[j], lp.logprobs[j], lp.sampled_token_ranks[j])
                            for j in range(len(new_tokens))]
        plp: Optional[LogprobsLists] = (runner_output.prompt_logprobs or {}).get(rid)
        new_prompt_logprobs = None if plp is None else list(zip(
            plp.logprob_token_ids, plp.logprobs, plp.sampled_token_ranks))
        finished = request.is_finished()
        kv_params = None
        if finished:
            self.running.remove(request)
            kv_params = self._free_request(request)
        if not (new_tokens or new_prompt_logprobs or finished):
            return None
        return EngineCoreOutput(
            request_id=rid, new_token_ids=new_tokens, new_logprobs=new_logprobs,
            new_prompt_logprobs=new_prompt_logprobs, finish_reason=_FINISH_REASON.get(request.status),
            stop_reason=request.stop_reason, num_cached_tokens=max(request.num_cached_tokens, 0),
            events=request.take_events(), kv_transfer_params=kv_params,
            pooling_output=runner_output.pooler_output[idx] if runner_output.pooler_output else None)

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
        feature_stats: dict[str, Any] = {}
        for hook in self.hooks:
            feature_stats.update(hook.stats())
        return SchedulerStats(
            num_running_reqs=len(self.running), num_waiting_reqs=self.num_waiting_reqs,
            kv_cache_usage=self.kv_cache_manager.usage,
            num_free_blocks=self.kv_cache_manager.num_free_blocks,
            # The hybrid KV cache keeps one block back as its null block.
            num_total_blocks=self.kv_cache_manager.block_pool.num_usable_blocks,
            prefix_cache_queries=self.prefix_cache_queries, prefix_cache_hits=self.prefix_cache_hits,
            num_preemptions=self.num_preemptions, feature_stats=feature_stats)

    def reset_prefix_cache(self) -> bool:
        return self.kv_cache_manager.reset_prefix_cache()
