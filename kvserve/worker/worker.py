"""Worker: one device (CPU or one GPU), one model replica (or TP shard), one ModelRunner."""
from __future__ import annotations

import logging
import os
import time
from typing import Any, Optional

import torch

from kvserve.config import KVServeConfig
from kvserve.core.kv_cache_utils import blocks_per_request
from kvserve.core.sched_output import ModelRunnerOutput, SchedulerOutput, resolve_runner_output
from kvserve.utils.memory import serving_thresholds
from kvserve.worker.model_runner import ModelRunner

logger = logging.getLogger(__name__)

_DEFAULT_CPU_KV_CACHE_BYTES = 2 << 30


class Worker:
    def __init__(self, config: KVServeConfig, local_rank: int = 0, rank: int = 0,
                 distributed_init_method: Optional[str] = None) -> None:
        self.config = config
        self.local_rank = local_rank
        self.rank = rank
        self.distributed_init_method = distributed_init_method
        self.model_runner: Optional[ModelRunner] = None
        # (start, end) time.time() of each execute_model while a benchmark records them.
        self._timeline: Optional[list[tuple[float, float]]] = None
        self.kv_connector = None     # the KV connector's worker side, when configured
        self.memory_profile = None   # a GPU's profile run (gpu_memory.MemoryProfile)
        # In-process (UniProcExecutor): the engine core reads async outputs itself, after it
        # has scheduled the next step; a worker process replies with plain lists.
        self.keep_async_output = False

    @property
    def is_output_rank(self) -> bool:
        """The rank that answers execute_model: the first TP rank of the last PP stage."""
        pc = self.config.parallel_config
        return self.rank == pc.world_size - pc.tensor_parallel_size

    def init_device(self) -> None:
        dc, pc = self.config.device_config, self.config.parallel_config
        if dc.device.startswith("cuda"):
            self.device = torch.device("cuda", self.local_rank)
            torch.cuda.set_device(self.device)
        else:
            self.device = torch.device("cpu")
            if pc.world_size > 1:
                # Each rank gets its share of the cores; oversubscription is far slower.
                torch.set_num_threads(max(1, (os.cpu_count() or 1) // pc.world_size))
        if pc.world_size > 1:
            from kvserve.distributed.parallel_state import init_distributed
            backend = "nccl" if self.device.type == "cuda" else "gloo"
            assert self.distributed_init_method is not None
            init_distributed(self.rank, pc.world_size, self.distributed_init_method, backend,
                             tensor_parallel_size=pc.tensor_parallel_size,
                             enable_expert_parallel=pc.enable_expert_parallel)
        torch.manual_seed(self.config.model_config.seed)
        if self.device.type == "cpu":
            # This process's CPU settings come from the config (the same in every worker);
            # then build (first run) or load the CPU kernels now, not in the first steps.
            from kvserve.ops import cpu_isa, load_cpu_kernels
            cpu_isa.configure(self.config.cpu_config)
            load_cpu_kernels()
        self.model_runner = ModelRunner(self.config, self.device)

    def load_model(self) -> None:
        assert self.model_runner is not None
        self.model_runner.load_model()

    def determine_num_kv_blocks(self) -> int:
        """How many KV blocks fit in the configured memory (capped by what can ever be used)."""
        assert self.model_runner is not None
        cc, sc = self.config.cache_config, self.config.scheduler_config
        if cc.num_gpu_blocks_override:
            return cc.num_gpu_blocks_override
        memory = cc.kv_cache_memory
        per_block = self.model_runner.kv_cache_bytes_per_block()
        # Hybrid KV cache: a request holds blocks in every group (sliding ones: their window's).
        per_request = blocks_per_request(cc.kv_cache_groups, self.model_runner.max_model_len,
                                         cc.block_size, sc.max_num_batched_tokens)
        useful = sc.max_num_seqs * per_request
        if memory is None and self.device.type == "cuda":
            # Profiled: weights + the largest step's activations, under gpu_memory_utilization.
            from kvserve.worker.gpu_memory import check_kv_cache_fits, profile_memory
            budget, profile = profile_memory(self.model_runner, cc.gpu_memory_utilization)
            self.memory_profile = profile
            blocks = check_kv_cache_fits(budget, per_block, per_request,
                                         self.model_runner.max_model_len, profile,
                                         cc.gpu_memory_utilization)
            logger.info("Available KV cache memory: %.2f GiB (%s)", budget / 2**30, profile)
            return min(blocks, useful)
        if memory is None:
            import psutil
            memory = min(_DEFAULT_CPU_KV_CACHE_BYTES, psutil.virtual_memory().available // 4)
        return max(1, min(memory // per_block, useful))

    def initialize_cache(self, num_blocks: int) -> None:
        assert self.model_runner is not None
        self.model_runner.initialize_kv_cache(num_blocks)
        self.model_runner.capture_cuda_graphs()
        graphs = self.model_runner.cuda_graphs
        if graphs is not None and self.memory_profile is not None:
            logger.info("CUDA graphs took %.2f GiB; %.2f GiB was set aside for them.",
                        graphs.memory_bytes / 2**30, self.memory_profile.cuda_graphs / 2**30)
        if self.config.kv_transfer_config is not None:
            from kvserve.kv_transfer.worker import create_worker_connector
            self.kv_connector = create_worker_connector(self.config, self.model_runner.kv_caches,
                                                        self.model_runner.model)
        # Model and cache in place: what is allocated from here on lives one step.
        serving_thresholds(f"Worker rank {self.rank}")

    def execute_model(self, scheduler_output: SchedulerOutput) -> Optional[ModelRunnerOutput]:
        assert self.model_runner is not None
        start = time.time() if self._timeline is not None else 0.0
        if self.kv_connector is not None:
            from kvserve.kv_transfer.worker import execute_with_connector
            runner = self.model_runner
            output = execute_with_connector(
                self.kv_connector, scheduler_output,
                lambda so: resolve_runner_output(runner.execute_model(so)))
        else:
            output = self.model_runner.execute_model(scheduler_output)
            if not self.keep_async_output:   # the reply leaves this process: plain lists
                output = resolve_runner_output(output)
        if self._timeline is not None:
            self._timeline.append((start, time.time()))
        return output if self.is_output_rank else None

    def record_timeline(self, on: bool) -> list[tuple[float, float]]:
        """Benchmarks: start (on) or stop recording execute_model's times; returns them."""
        timeline, self._timeline = self._timeline or [], [] if on else None
        return timeline

    def add_lora(self, lora_request: Any) -> bool:
        assert self.model_runner is not None
        return self.model_runner.lora_manager_or_error().add_adapter(lora_request)

    def remove_lora(self, lora_int_id: int) -> bool:
        assert self.model_runner is not None
        return self.model_runner.lora_manager_or_error().remove_adapter(lora_int_id)

    def list_loras(self) -> list[int]:
        assert self.model_runner is not None
        return self.model_runner.lora_manager_or_error().list_adapters()

    def get_num_local_layers(self) -> int:
        """Decoder layers this rank's pipeline stage holds."""
        assert self.model_runner is not None
        return self.model_runner.num_local_layers

    def check_health(self) -> bool:
        return True

    def shutdown(self) -> None:
        if self.kv_connector is not None:
            self.kv_connector.shutdown()
        if self.config.parallel_config.world_size > 1:
            from kvserve.distributed.parallel_state import destroy_distributed
            destroy_distributed()
