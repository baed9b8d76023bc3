"""EngineCore: the scheduling loop. step() = schedule -> execute -> update."""
from __future__ import annotations

import logging
import time
from collections import deque
from typing import Any, Optional

from kvserve.config import KVServeConfig
from kvserve.core.async_scheduler import AsyncScheduler
from kvserve.core.messages import EngineCoreOutputs, EngineCoreRequest
from kvserve.core.request import Request, RequestStatus
from kvserve.core.sched_hooks import SchedulerHook
from kvserve.core.sched_output import SchedulerOutput, resolve_runner_output
from kvserve.core.scheduler import Scheduler
from kvserve.executor import get_executor_class
from kvserve.executor.base import Executor
from kvserve.spec_decode import make_spec_decode_controller
from kvserve.structured_output.manager import StructuredOutputManager
from kvserve.structured_output.scheduling import StructuredOutputScheduling

logger = logging.getLogger(__name__)

# Sleep of an empty step while KV transfers are in flight (nothing else to compute).
_KV_TRANSFER_POLL_S = 0.002


class EngineCore:
    def __init__(self, config: KVServeConfig,
                 executor_class: Optional[type[Executor]] = None) -> None:
        self.config = config
        executor_class = executor_class or get_executor_class(config)
        start = time.perf_counter()
        self.model_executor = executor_class(config)
        try:
            num_blocks = self.model_executor.initialize_kv_cache()
            self._check_kv_cache_fits(num_blocks)
        except BaseException:
            self.model_executor.shutdown()
            raise
        config.cache_config.num_blocks = num_blocks
        self.structured_output_manager = StructuredOutputManager(config)
        async_scheduling = config.scheduler_config.async_scheduling
        scheduler_class = AsyncScheduler if async_scheduling else Scheduler
        self.scheduler = scheduler_class(
            config.scheduler_config, config.cache_config, hooks=self._make_scheduler_hooks(),
            num_lookahead_tokens=(config.speculative_config.num_lookahead_tokens
                                  if config.speculative_config else 0),
            send_sampled_tokens=config.parallel_config.pipeline_parallel_size > 1)
        # Pipeline parallelism: up to one batch per stage in flight, so the stages overlap.
        # Async scheduling: one step in flight while the next is scheduled (a queue of two).
        self.batch_queue_size = (2 if async_scheduling
                                 else self.model_executor.max_concurrent_batches)
        self.batch_queue: Optional[deque[tuple[Any, SchedulerOutput]]] = (
            deque() if self.batch_queue_size > 1 else None)
        self.log_stats = not config.disable_log_stats
        logger.info("Engine core ready in %.2f s", time.perf_counter() - start)

    def _make_scheduler_hooks(self) -> list[SchedulerHook]:
        """The features' parts in scheduling, in the order the scheduler calls them:
        speculation sets a request's drafts before structured outputs cut them to its grammar."""
        config = self.config
        max_model_len = config.model_config.max_model_len
        hooks: list[SchedulerHook] = []
        self.kv_connector = None
        if config.kv_transfer_config is not None:
            from kvserve.kv_transfer.base import KVConnectorRole
            from kvserve.kv_transfer.factory import KVConnectorFactory
            from kvserve.kv_transfer.scheduling import KVTransferScheduling
            self.kv_connector = KVConnectorFactory.create_connector(config,
                                                                    KVConnectorRole.SCHEDULER)
            hooks.append(KVTransferScheduling(self.kv_connector))
        spec = config.speculative_config
        if spec is not None:
            from kvserve.spec_decode.scheduling import SpecDecodeScheduling
            hooks.append(SpecDecodeScheduling(spec.num_speculative_tokens,
                                              make_spec_decode_controller(spec), max_model_len))
        if config.model_config.runner_type == "pooling":
            from kvserve.pooling.scheduling import PoolingScheduling
            hooks.append(PoolingScheduling())
        if config.lora_config is not None:
            from kvserve.lora.scheduling import LoRAScheduling
            hooks.append(LoRAScheduling(config.lora_config.max_loras, self.add_lora))
        hooks.append(StructuredOutputScheduling(
            self.structured_output_manager, max_model_len,
            config.structured_outputs_config.enable_jump_forward))
        return hooks

    def _check_kv_cache_fits(self, num_blocks: int) -> None:
        """One max_model_len request must fit: with the hybrid KV cache, its full-attention
        groups need every block, its sliding-window groups only their windows'."""
        from kvserve.core.kv_cache_utils import blocks_per_request
        cc = self.config.cache_config
        max_len = self.config.model_config.max_model_len
        need = blocks_per_request(cc.kv_cache_groups, max_len, cc.block_size,
                                  self.config.scheduler_config.max_num_batched_tokens)
        logger.info("KV cache: %d blocks of %d tokens; maximum concurrency for %d tokens per "
                    "request: %.2fx", num_blocks, cc.block_size, max_len, num_blocks / need)
        if num_blocks < need:
            groups = (f" over {len(cc.kv_cache_groups)} KV cache groups"
                      if cc.kv_cache_groups else "")
            raise ValueError(
                f"The model's max_model_len ({max_len}) does not fit in the KV cache: one such "
                f"request needs {need} blocks of {cc.block_size} tokens{groups}, the cache holds "
                f"{num_blocks}. Increase kv_cache_memory or decrease max_model_len.")

    # ------------------------------------------------------------------ requests
    def add_request(self, request: EngineCoreRequest) -> None:
        self.scheduler.add_request(Request(
            request_id=request.request_id, prompt_token_ids=request.prompt_token_ids,
            sampling_params=request.sampling_params, eos_token_ids=set(request.eos_token_ids),
            arrival_time=request.arrival_time, priority=request.priority,
            cache_salt=request.cache_salt, client_index=request.client_index,
            pooling_params=request.pooling_params,
            lora_request=self._lora_request(request)))

    def _lora_request(self, request: EngineCoreRequest) -> Any:
        if request.lora_request is None:
            return None
        if self.config.lora_config is None:
            raise ValueError("A LoRA request needs an engine started with --enable-lora.")
        from kvserve.lora.request import as_lora_request
        return as_lora_request(request.lora_request)

    # ------------------------------------------------------------------ LoRA adapters
    def add_lora(self, lora_request: Any) -> bool:
        """Load an adapter on every worker now (True if it was not loaded yet)."""
        from kvserve.lora.request import as_lora_request
        return bool(self.model_executor.collective_rpc(
            "add_lora", (as_lora_request(lora_request),))[0])

    def remove_lora(self, lora_int_id: int) -> bool:
        return bool(self.model_executor.collective_rpc("remove_lora", (lora_int_id,))[0])

    def list_loras(self) -> list[int]:
        return list(self.model_executor.collective_rpc("list_loras")[0])

    def abort_requests(self, request_ids: list[str]) -> list[str]:
        return self.scheduler.finish_requests(request_ids, RequestStatus.FINISHED_ABORTED)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    # ------------------------------------------------------------------ the loop body
    def step(self) -> EngineCoreOutputs:
        if self.batch_queue is not None:
            return self.step_with_batch_queue()
        if not self.scheduler.has_unfinished_requests():
            return EngineCoreOutputs(timestamp=time.monotonic())
        scheduler_output = self.scheduler.schedule()
        runner_output = self.model_executor.execute_model(scheduler_output)
        if scheduler_output.is_empty and self.kv_connector is not None:
            # Only KV transfers are in flight: poll them without spinning a core.
            time.sleep(_KV_TRANSFER_POLL_S)
        return self._update(scheduler_output, runner_output)

    def step_with_batch_queue(self) -> EngineCoreOutputs:
        """Schedule a new batch while the queue has room (requests in flight are skipped by
        the scheduler); when nothing new can be scheduled, wait for the oldest batch and
        update from it. Returns empty outputs when this call only scheduled."""
        assert self.batch_queue is not None
        scheduled = False
        if len(self.batch_queue) < self.batch_queue_size and self.scheduler.has_unfinished_requests():
            scheduler_output = self.scheduler.schedule()
            scheduled = not scheduler_output.is_empty
            # An empty batch still goes out when it tells the workers to drop requests.
            if scheduled or scheduler_output.finished_req_ids or scheduler_output.preempted_req_ids:
                future = self.model_executor.execute_model(scheduler_output, non_block=True)
                self.batch_queue.append((future, scheduler_output))
        if scheduled or not self.batch_queue:
            return EngineCoreOutputs(timestamp=time.monotonic())
        future, scheduler_output = self.batch_queue.popleft()
        return self._update(scheduler_output, future.result())

    def _update(self, scheduler_output: SchedulerOutput, runner_output: Any) -> EngineCoreOutputs:
        # Async scheduling: the sampled ids reach the host now (a non-blocking copy).
        runner_output = resolve_runner_output(runner_output)
        outputs = self.scheduler.update_from_output(scheduler_output, runner_output)
        outputs.timestamp = time.monotonic()
        if self.log_stats:
            outputs.scheduler_stats = self.scheduler.make_stats().to_dict()
        return outputs

    # ------------------------------------------------------------------ utilities
    def reset_prefix_cache(self) -> bool:
        return self.scheduler.reset_prefix_cache()

    def get_stats(self) -> dict[str, Any]:
        return self.scheduler.make_stats().to_dict()

    def shutdown(self) -> None:
        self.structured_output_manager.shutdown()
        self.model_executor.shutdown()
