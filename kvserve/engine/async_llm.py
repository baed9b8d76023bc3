"""AsyncLLM: the asyncio frontend. The engine core always runs in its own process.

    generate() ─► InputProcessor (validate, tokenize) ─► AsyncMPClient ─► engine core process
        ▲                                                                      │
        └── RequestOutputCollector (one per request) ◄── output handler task ◄─┘
                                                         OutputProcessor (detokenize,
                                                         stop strings, output kinds)

Detokenization stays in this process. One output handler task per AsyncLLM reads the engine
core's outputs and feeds every request's collector; when the engine dies every open stream
raises EngineDeadError.
"""
from __future__ import annotations

import asyncio
import logging
import weakref
from collections.abc import AsyncGenerator
from typing import Any, Callable, Optional, Union

from kvserve.config import KVServeConfig
from kvserve.core.messages import EngineCoreOutputs
from kvserve.engine.arg_utils import EngineArgs
from kvserve.engine.exceptions import EngineDeadError, EngineGenerateError
from kvserve.engine.input_processor import InputProcessor, PromptType
from kvserve.engine.launch import ClientAddresses
from kvserve.engine.mp_client import AsyncMPClient, cancel_task
from kvserve.engine.output_processor import (IterationStats, OutputProcessor, ParentRequest,
                                             RequestOutputCollector)
from kvserve.outputs import RequestOutput
from kvserve.sampling_params import SamplingParams
from kvserve.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

# Outputs of one engine step are processed in slices this large, yielding to the event loop
# in between, so that a big batch does not stall the other tasks (HTTP handlers).
OUTPUT_PROC_CHUNK_SIZE = 128

# stat_loggers entries: called with (scheduler_stats, iteration_stats) per output batch.
StatLogger = Callable[[Optional[dict], Optional[IterationStats]], None]


class AsyncLLM:
    def __init__(self, config: KVServeConfig,
                 stat_loggers: Optional[list[StatLogger]] = None,
                 client_addresses: Optional[ClientAddresses] = None) -> None:
        """`client_addresses`: one of several API servers (engines started by the launcher)."""
        config.multiprocessing = True
        self.config = config
        self.model_config = config.model_config
        self.log_stats = not config.disable_log_stats
        self.tokenizer = Tokenizer.from_pretrained(config.model_config.tokenizer)
        self.input_processor = InputProcessor(config.model_config, self.tokenizer,
                                              config.structured_outputs_config,
                                              config.kv_transfer_config)
        self.output_processor = OutputProcessor(self.tokenizer, log_stats=self.log_stats)
        # Metrics hooks (the server's Prometheus metrics). The stats are None when the engine
        # runs with disable_log_stats=True.
        self.stat_loggers: list[StatLogger] = list(stat_loggers or [])
        self.last_scheduler_stats: Optional[dict] = None
        # Data parallelism: per engine index, the stat loggers of that engine's outputs
        # (default: stat_loggers).
        self.stat_loggers_per_engine: dict[int, list[StatLogger]] = {}
        self.client_index = client_addresses.client_index if client_addresses else 0
        if config.parallel_config.data_parallel_size > 1:
            from kvserve.engine.dp_client import DPAsyncMPClient
            self.engine_core: AsyncMPClient = DPAsyncMPClient(config, client_addresses)
        else:
            self.engine_core = AsyncMPClient(config, client_addresses)
        self.output_handler: Optional[asyncio.Task] = None
        self._background_tasks: set[asyncio.Task] = set()
        self._shut_down = False
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            pass        # started by the first request
        else:
            self._run_output_handler()

    @classmethod
    def from_engine_args(cls, engine_args: EngineArgs,
                         stat_loggers: Optional[list[StatLogger]] = None) -> "AsyncLLM":
        if stat_loggers:
            # A logger needs the per-step stats the engine core only sends when asked.
            engine_args = engine_args.replace(disable_log_stats=False)
        return cls(engine_args.create_engine_config(), stat_loggers=stat_loggers)

    # ------------------------------------------------------------------ state
    @property
    def errored(self) -> bool:
        return self.engine_core.is_dead or self._shut_down

    @property
    def is_running(self) -> bool:
        return not self.errored and (self.output_handler is None or not self.output_handler.done())

    @property
    def dead_error(self) -> BaseException:
        return self.engine_core.resources.make_dead_error()

    async def check_health(self) -> None:
        if self.errored:
            raise self.dead_error
        check = getattr(self.engine_core, "check_health_async", None)
        if check is not None:     # DP: one dead engine is enough for 503
            await check()

    # ------------------------------------------------------------------ requests
    async def add_request(self, request_id: str, prompt: PromptType, params: SamplingParams,
                          priority: int = 0,
                          cache_salt: Optional[str] = None) -> RequestOutputCollector:
        """Validate and send one request; its outputs arrive in the returned collector."""
        if self.errored:
            raise self.dead_error
        self._run_output_handler()
        request, prompt_text = self.input_processor.process_inputs(
            request_id, prompt, params, priority=priority, cache_salt=cache_salt)
        queue = RequestOutputCollector(params.output_kind)
        if params.n == 1:
            self.output_processor.add_request(request, prompt_text, None, 0, queue)
            children = [request]
        else:
            parent = ParentRequest(request_id, params)
            children = parent.make_child_requests(request)
            for idx, child in enumerate(children):
                self.output_processor.add_request(child, prompt_text, parent, idx, queue)
        sent: list[str] = []
        try:
            for child in children:
                await self.engine_core.add_request_async(child)
                sent.append(child.request_id)
        except BaseException:
            # Registered but not (all) sent: forget it here, and free what the core got.
            self.output_processor.abort_requests([request_id])
            if sent and not self.errored:
                self._background(self.engine_core.abort_requests_async(sent))
            raise
        return queue

    def _background(self, coro: Any) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._background_tasks.add(task)      # keep a reference until it is done
        task.add_done_callback(self._background_tasks.discard)

    async def generate(self, prompt: PromptType, sampling_params: SamplingParams,
                       request_id: str, *, priority: int = 0,
                       cache_salt: Optional[str] = None) -> AsyncGenerator[RequestOutput, None]:
        """Stream the request's RequestOutputs (CUMULATIVE / DELTA / FINAL_ONLY as
        `sampling_params.output_kind` says). Cancelling the consumer aborts the request."""
        queue: Optional[RequestOutputCollector] = None
        try:
            # ValueError (bad input) is raised here, before anything is streamed.
            queue = await self.add_request(request_id, prompt, sampling_params,
                                           priority=priority, cache_salt=cache_salt)
            finished = False
            while not finished:
                # Take what is there without a context switch; wait otherwise.
                out = queue.get_nowait() or await queue.get()
                finished = out.finished
                yield out
        except (asyncio.CancelledError, GeneratorExit):
            if queue is not None:
                await self.abort(request_id)
            raise
        except (EngineDeadError, ValueError):
            raise
        except Exception as e:
            if queue is not None:
                await self.abort(request_id)
            raise EngineGenerateError(f"Request {request_id} failed: {e}") from e

    async def abort(self, request_id: Union[str, list[str]]) -> None:
        """Abort requests (user ids; a parent id aborts all its n children). Their streams end
        with a final output whose finish_reason is "abort"."""
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        # Aborted requests are finished requests too (request_success{finished_reason="abort"},
        # latencies): without this they would vanish from the metrics.
        stats = IterationStats() if self.output_processor.log_stats else None
        self.output_processor.abort_requests(ids, stats)
        await self.engine_core.abort_requests_async(self.output_processor.last_aborted_child_ids)
        if stats is not None and stats.finished_requests:
            for stat_logger in self.stat_loggers:
                try:
                    stat_logger(None, stats)
                except Exception:
                    logger.exception("A stat logger failed.")

    # ------------------------------------------------------------------ output handler
    def _run_output_handler(self) -> None:
        if self.output_handler is not None:
            return
        # Locals only: the task must not keep `self` alive.
        engine_core = self.engine_core
        output_processor = self.output_processor
        stat_loggers = self.stat_loggers
        per_engine = self.stat_loggers_per_engine
        holder = _StatsHolder(self)

        async def output_handler() -> None:
            try:
                while True:
                    outputs = await engine_core.get_output_async()
                    if not isinstance(outputs, EngineCoreOutputs):   # a DP engine died
                        _fail_requests(output_processor, outputs.request_ids, outputs.message)
                        continue
                    eco = outputs.outputs
                    iteration_stats: Optional[IterationStats] = None
                    for start in range(0, max(len(eco), 1), OUTPUT_PROC_CHUNK_SIZE):
                        chunk = eco[start:start + OUTPUT_PROC_CHUNK_SIZE]
                        processed = output_processor.process_outputs(chunk)
                        iteration_stats = _merge_stats(iteration_stats, processed.iteration_stats)
                        # Requests finished here by stop strings: free them in the core.
                        if processed.reqs_to_abort:
                            await engine_core.abort_requests_async(processed.reqs_to_abort)
                        if start + OUTPUT_PROC_CHUNK_SIZE < len(eco):
                            await asyncio.sleep(0)
                    if outputs.scheduler_stats is not None:
                        holder.set(outputs.scheduler_stats)
                    for stat_logger in per_engine.get(outputs.engine_index, stat_loggers):
                        try:
                            stat_logger(outputs.scheduler_stats, iteration_stats)
                        except Exception:
                            logger.exception("A stat logger failed.")
            except asyncio.CancelledError:
                raise
            except Exception as e:
                error = e if isinstance(e, EngineDeadError) else EngineDeadError(
                    f"The output handler failed: {type(e).__name__}: {e}")
                if not isinstance(e, EngineDeadError):
                    logger.exception("AsyncLLM output handler failed.")
                _propagate_error(output_processor, error)

        self.output_handler = asyncio.get_running_loop().create_task(
            output_handler(), name="AsyncLLMOutputHandler")

    # ------------------------------------------------------------------ utilities
    async def get_stats(self) -> dict[str, Any]:
        return await self.engine_core.call_utility_async("get_stats")

    async def get_stats_per_engine(self) -> dict[int, dict[str, Any]]:
        """Every live engine's scheduler stats, by engine index (data parallelism: all of
        them, not only engine 0)."""
        return await self.engine_core.call_utility_all_async("get_stats")

    async def reset_prefix_cache(self) -> bool:
        return await self.engine_core.call_utility_async("reset_prefix_cache")

    async def get_tokenizer(self) -> Tokenizer:
        return self.tokenizer

    def shutdown(self) -> None:
        self._shut_down = True
        handler, self.output_handler = self.output_handler, None
        if handler is not None:
            cancel_task(handler)
        self.engine_core.shutdown()
        # Open streams end with EngineDeadError ("shut down") rather than waiting forever.
        _propagate_error(self.output_processor, self.dead_error)


class _StatsHolder:
    """Lets the output handler update `last_scheduler_stats` without a strong reference."""

    def __init__(self, llm: AsyncLLM) -> None:
        self._ref = weakref.ref(llm)

    def set(self, stats: dict) -> None:
        llm = self._ref()
        if llm is not None:
            llm.last_scheduler_stats = stats


def _merge_stats(a: Optional[IterationStats],
                 b: Optional[IterationStats]) -> Optional[IterationStats]:
    if a is None or b is None:
        return a or b
    a.num_generation_tokens += b.num_generation_tokens
    a.num_prompt_tokens += b.num_prompt_tokens
    a.time_to_first_tokens_iter += b.time_to_first_tokens_iter
    a.inter_token_latencies_iter += b.inter_token_latencies_iter
    a.finished_requests += b.finished_requests
    return a


def _fail_requests(output_processor: OutputProcessor, request_ids: list[str],
                   message: str) -> None:
    """These (engine-core) requests' streams raise EngineDeadError; the others go on."""
    for rid in request_ids:
        state = output_processor.request_states.get(rid)
        if state is None:
            continue
        queue = state.parent_req.queue if state.parent_req is not None else state.queue
        output_processor.abort_requests([rid])
        if queue is not None:     # after the abort: an error replaces a pending output
            queue.put(EngineDeadError(message))


def _propagate_error(output_processor: OutputProcessor, error: BaseException) -> None:
    """Every open stream raises `error` (its consumer sees it on the next get)."""
    queues = {id(s.queue): s.queue for s in output_processor.request_states.values()
              if s.queue is not None}
    queues.update({id(p.queue): p.queue for p in output_processor.parent_requests.values()
                   if p.queue is not None})
    for q in queues.values():
        # A copy each: one instance raised in many tasks would pile up their tracebacks.
        q.put(EngineDeadError(str(error)) if isinstance(error, EngineDeadError) else error)
