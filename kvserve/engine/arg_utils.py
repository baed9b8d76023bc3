"""EngineArgs: the one definition of engine settings, shared by LLM(...), the CLI and benchmarks.

Each field's name is vLLM's; `add_cli_args` turns the fields into `--kebab-case` flags with
help text, so `kvserve serve`, `kvserve generate` and `kvserve bench` accept the same flags.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
from dataclasses import dataclass, fields
from typing import Any, Callable, Optional, Union, get_type_hints

import torch

from kvserve import envs
from kvserve.attention.selector import resolve_backend_name
from kvserve.config import (CacheConfig, CompilationConfig, CpuConfig, DeviceConfig,
                            KVServeConfig, ModelConfig, ParallelConfig, SchedulerConfig,
                            StructuredOutputsConfig, resolve_kv_cache_dtype)
from kvserve.spec_decode.config import SpeculativeConfig

_HELP = {
    "model": "Path to a Hugging Face checkpoint directory or a .gguf file, 'demo' for the built-in "
             "demo model (SmolLM2-135M-Instruct, fetched once) or 'demo-random' (a tiny random Llama).",
    "tokenizer": "Tokenizer directory (defaults to the model directory; for a GGUF model, the "
                 "tokenizer in its metadata).",
    "load_format": "auto, safetensors or gguf (auto: gguf for a path ending in .gguf).",
    "hf_config_path": "Directory whose config.json replaces the model's (for GGUF files whose "
                      "metadata is not enough).",
    "served_model_name": "Model name(s) the API accepts; the first is the one reported "
                         "(defaults to the model argument).",
    "quantization": "gguf (implied by a .gguf model: its Q4_0/Q4_1/Q5_0/Q5_1/Q8_0/Q4_K/Q5_K/"
                    "Q6_K tensors stay packed: int8 kernels on CPU, Triton on CUDA) or gguf-dequantized "
                    "(dequantize them at load: the float path); fp8 (a 16-bit checkpoint's "
                    "linear weights cast to float8 e4m3 at load, per-channel scales, on a GPU "
                    "with fp8: compute capability >= 8.9).",
    "dtype": "Weight and activation dtype: auto, float32, bfloat16, float16.",
    "max_model_len": "Context length (prompt + output). Defaults to the model's max_position_embeddings.",
    "block_size": "Tokens per KV cache block.",
    "kv_cache_dtype": "KV cache dtype: auto (the model's dtype), bfloat16 or float32. On CPU "
                      "bfloat16 beside float32 activations halves the KV bytes.",
    "kv_cache_memory": "Bytes of memory for the KV cache (default: 2 GiB on CPU, 90%% of free memory on CUDA).",
    "num_gpu_blocks_override": "Use exactly this many KV cache blocks (for testing).",
    "enable_prefix_caching": "Reuse KV blocks of shared prompt prefixes.",
    "disable_hybrid_kv_cache_manager": "Sliding-window layers keep every KV block, as full "
                                       "attention does (one block table for all layers).",
    "enable_chunked_prefill": "Split long prefills across steps to fit the token budget.",
    "long_prefill_token_threshold": "Cap on a single request's prefill tokens per step (0 = no cap).",
    "max_num_seqs": "Maximum number of requests running in one step.",
    "max_num_batched_tokens": "Token budget of one step (default: 2048 on CPU, 8192 on CUDA).",
    "max_num_queued_requests": "Reject new requests (HTTP 503) while this many are waiting.",
    "async_scheduling": "Schedule and prepare step N+1 while step N runs; the tokens step N "
                        "has not sampled yet are placeholders filled on the device. Not with "
                        "speculative decoding or pipeline parallelism.",
    "scheduling_policy": "fcfs or priority (lower priority value runs first).",
    "seed": "Random seed for sampling requests that set none.",
    "max_logprobs": "Largest logprobs / prompt_logprobs a request may ask for.",
    "tensor_parallel_size": "Number of tensor-parallel ranks (worker processes).",
    "pipeline_parallel_size": "Number of pipeline stages.",
    "enable_expert_parallel": "Mixture-of-experts layers: each tensor-parallel rank holds "
                              "whole experts (num_experts / tensor_parallel_size of them) "
                              "instead of a slice of every expert.",
    "distributed_executor_backend": "uni, mp or ray.",
    "data_parallel_size": "Number of data-parallel engine cores behind the one frontend "
                          "(requests go to the least loaded: 4 x waiting + running).",
    "data_parallel_size_local": "Data-parallel engines on this node (default: all of them); "
                                "the others run on other nodes (`kvserve serve --headless`).",
    "data_parallel_start_rank": "DP rank of this node's first engine (a --headless node's).",
    "data_parallel_address": "Address of the front node (the one with the API server) that "
                             "engines on other nodes connect to.",
    "data_parallel_rpc_port": "Port of the front node's start-up handshake socket.",
    "device": "cpu, cuda or auto.",
    "multiprocessing": "Run the engine core in its own process (default; env KVSERVE_ENABLE_MULTIPROCESSING=0 turns it off).",
    "disable_log_stats": "Do not log periodic throughput statistics.",
    "enforce_eager": "Never capture CUDA graphs (all steps eager). No effect on CPU.",
    "compilation_config": "CUDA graphs as JSON (vLLM's keys): cudagraph_mode NONE, "
                          "FULL_DECODE_ONLY (default: all-decode steps) or FULL (mixed "
                          "prefill + decode steps too, up to max_cudagraph_capture_size "
                          "tokens); cudagraph_capture_sizes, max_cudagraph_capture_size.",
    "attention_backend": "CPU_ATTN (C++ kernels; default on CPU), TRITON_ATTN (Triton kernels; "
                         "default on CUDA) or TORCH_SDPA (portable torch fallback).",
    "gpu_memory_utilization": "Fraction of the GPU's memory for weights, activations (profiled) "
                              "and the KV cache (CUDA only; --kv-cache-memory overrides).",
    "structured_outputs_config": "Structured outputs settings as JSON, e.g. "
                                 "'{\"backend\": \"xgrammar\", \"disable_any_whitespace\": true, "
                                 "\"enable_jump_forward\": true}'.",
    "speculative_config": "Speculative decoding settings as JSON, e.g. '{\"method\": \"ngram\", "
                          "\"num_speculative_tokens\": 4, \"prompt_lookup_max\": 4}' or "
                          "'{\"method\": \"draft_model\", \"model\": \"/path\", "
                          "\"num_speculative_tokens\": 3}'.",
    "kv_transfer_config": "KV connector settings as JSON (disaggregated prefill/decode, KV reuse "
                          "across engines), e.g. '{\"kv_connector\": \"NixlConnector\", "
                          "\"kv_role\": \"kv_both\"}'.",
    "enable_lora": "Serve LoRA adapters (PEFT format) beside the base model, mixed in one batch.",
    "max_loras": "LoRA adapters in one batch (the workers' adapter slots).",
    "max_lora_rank": "Largest LoRA rank an adapter may have (1, 8, 16, 32, 64, 128, 256, 320, 512).",
    "max_cpu_loras": "Loaded LoRA adapters kept in memory, least recently used evicted "
                     "(default: max_loras).",
    "lora_dtype": "Data type of the LoRA weights: auto (the base model's), bfloat16, float16 "
                  "(bfloat16 on CPU), float32. bfloat16 on a float32 model halves the bytes "
                  "the adapters stream a step.",
    "cpu_isa": "ISA tier of the C++ CPU kernels; auto: the host's best (env KVSERVE_CPU_ISA).",
    "disable_cpu_kernels": "Pure-torch paths instead of the C++ CPU kernels and oneDNN "
                           "prepacking (env KVSERVE_DISABLE_CPU_KERNELS).",
    "cpu_huge_pages": "CPU weights and KV cache in transparent huge pages; auto: where THP is "
                      "madvise (env KVSERVE_CPU_HUGE_PAGES).",
}
_HELP.update({
    "runner": "auto, generate or pooling: a pooling runner returns pooled hidden states "
              "(embeddings: LLM.embed, /v1/embeddings) instead of generating (auto: pooling "
              "for --convert embed or a *Model architecture).",
    "convert": "auto, none or embed: serve a generative checkpoint as an embedding model.",
    "pooler_config": "Pooling runner settings (JSON): pooling_type (LAST, MEAN, CLS, ALL), "
                     "normalize, dimensions; unset ones come from the checkpoint's "
                     "sentence-transformers config, else LAST + normalize.",
})
_CHOICES = {"runner": ("auto", "generate", "pooling"), "convert": ("auto", "none", "embed"),
            "cpu_isa": ("auto", "generic", "avx2", "avx512", "avx512_bf16"),
            "cpu_huge_pages": ("auto", "on", "off"),
            "lora_dtype": ("auto", "bfloat16", "float16", "float32")}
_SHORT = {"tensor_parallel_size": "-tp", "pipeline_parallel_size": "-pp",
          "data_parallel_size": "-dp"}
_MULTI = {"served_model_name"}     # flags that take one or more values, as in vLLM


@dataclass
class EngineArgs:
    model: str = "demo"
    tokenizer: Optional[str] = None
    load_format: str = "auto"
    hf_config_path: Optional[str] = None
    quantization: Optional[str] = None
    served_model_name: Optional[Union[str, list[str]]] = None
    dtype: str = "auto"
    max_model_len: Optional[int] = None
    block_size: int = 16
    kv_cache_dtype: str = "auto"
    kv_cache_memory: Optional[int] = None
    num_gpu_blocks_override: Optional[int] = None
    enable_prefix_caching: bool = True
    disable_hybrid_kv_cache_manager: bool = False
    enable_chunked_prefill: bool = True
    long_prefill_token_threshold: int = 0
    max_num_seqs: int = 256
    max_num_batched_tokens: Optional[int] = None
    max_num_queued_requests: Optional[int] = None
    scheduling_policy: str = "fcfs"
    async_scheduling: bool = False
    seed: int = 0
    max_logprobs: int = 20
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    enable_expert_parallel: bool = False
    data_parallel_size: int = 1
    data_parallel_size_local: Optional[int] = None
    data_parallel_start_rank: int = 0
    data_parallel_address: Optional[str] = None
    data_parallel_rpc_port: int = 29550
    distributed_executor_backend: Optional[str] = None
    device: str = "auto"
    multiprocessing: bool = True
    disable_log_stats: bool = True
    enforce_eager: bool = False
    compilation_config: Optional[Union[str, dict]] = None
    attention_backend: Optional[str] = None
    gpu_memory_utilization: float = 0.9
    structured_outputs_config: Optional[Union[str, dict]] = None
    speculative_config: Optional[Union[str, dict]] = None
    kv_transfer_config: Optional[Union[str, dict]] = None
    enable_lora: bool = False
    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: Optional[int] = None
    lora_dtype: str = "auto"
    cpu_isa: Optional[str] = None
    disable_cpu_kernels: Optional[bool] = None
    cpu_huge_pages: Optional[str] = None
    runner: str = "auto"
    convert: str = "auto"
    pooler_config: Optional[Union[str, dict]] = None

    # ------------------------------------------------------------------
    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser, skip: tuple[str, ...] = ()) -> argparse.ArgumentParser:
        hints = get_type_hints(EngineArgs)
        for f in fields(EngineArgs):
            if f.name in skip:
                continue
            flag = "--" + f.name.replace("_", "-")
            names = [flag] + ([_SHORT[f.name]] if f.name in _SHORT else [])
            help_text = _HELP.get(f.name, "")
            hint = hints[f.name]
            if _base_type(hint) is bool:
                parser.add_argument(*names, action=argparse.BooleanOptionalAction,
                                    default=f.default, help=help_text)
                continue
            base = _base_type(hint)
            nargs = "+" if f.name in _MULTI else None
            default_text = "" if f.name in _CHOICES else f" (default: {f.default})"
            parser.add_argument(*names, type=base, default=f.default, nargs=nargs,
                                choices=_CHOICES.get(f.name), help=help_text + default_text)
        return parser

    @staticmethod
    def from_cli_args(args: argparse.Namespace) -> "EngineArgs":
        kw = {f.name: getattr(args, f.name) for f in fields(EngineArgs) if hasattr(args, f.name)}
        return EngineArgs(**kw)

    @staticmethod
    def from_kwargs(**kwargs: Any) -> "EngineArgs":
        known = {f.name for f in fields(EngineArgs)}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise TypeError(f"Unknown engine argument(s): {', '.join(unknown)}. "
                            f"Known: {', '.join(sorted(known))}.")
        return EngineArgs(**kwargs)

    def replace(self, **kwargs: Any) -> "EngineArgs":
        return dataclasses.replace(self, **kwargs)

    # ------------------------------------------------------------------
    def create_engine_config(self) -> KVServeConfig:
        """Validate the arguments and resolve them into the engine configuration. Each
        feature's checks are one `_verify_*` / `_build_*` below, run in this order."""
        device = self._resolve_device()
        cpu_config = self._make(CpuConfig)
        model_config = self._build_model_config(device, cpu_config)
        scheduler_config = self._build_scheduler_config(device, model_config.max_model_len)
        parallel = self._build_parallel_config(model_config, device)
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got "
                             f"{self.gpu_memory_utilization}.")
        attention_backend = resolve_backend_name(self.attention_backend, device,
                                                 self.block_size, model_config.head_dim)
        spec_config = SpeculativeConfig.parse(self.speculative_config)
        enable_prefix_caching = self._resolve_runner(model_config, spec_config)
        _verify_speculative(spec_config, model_config, parallel)
        _verify_async_scheduling(self.async_scheduling, spec_config, parallel)
        kv_transfer_config = self._build_kv_transfer_config(parallel)
        kv_cache_groups = _kv_cache_groups(model_config, parallel, spec_config,
                                           kv_transfer_config,
                                           self.disable_hybrid_kv_cache_manager)
        lora_config = self._build_lora_config(parallel, spec_config, kv_transfer_config)
        return KVServeConfig(
            model_config=model_config,
            cache_config=self._make(
                CacheConfig, enable_prefix_caching=enable_prefix_caching,
                kv_cache_dtype=resolve_kv_cache_dtype(self.kv_cache_dtype, model_config, device),
                kv_cache_groups=kv_cache_groups),
            scheduler_config=scheduler_config,
            parallel_config=parallel,
            device_config=DeviceConfig(device=device),
            # KVSERVE_ENABLE_MULTIPROCESSING=0 runs the engine core in-process (no extra process).
            multiprocessing=self.multiprocessing and envs.get("KVSERVE_ENABLE_MULTIPROCESSING"),
            disable_log_stats=self.disable_log_stats,
            enforce_eager=self.enforce_eager,
            compilation_config=CompilationConfig.parse(self.compilation_config),
            attention_backend=attention_backend,
            structured_outputs_config=StructuredOutputsConfig.parse(self.structured_outputs_config),
            speculative_config=spec_config,
            kv_transfer_config=kv_transfer_config,
            cpu_config=cpu_config,
            lora_config=lora_config,
        )

    def _make(self, cls: Any, **resolved: Any) -> Any:
        """cls(...) from the fields it shares with EngineArgs (vLLM's names on both sides),
        `resolved` in place of the values worked out here."""
        own = {f.name for f in fields(EngineArgs)}
        return cls(**{**{f.name: getattr(self, f.name) for f in fields(cls) if f.name in own},
                      **resolved})

    def _resolve_device(self) -> str:
        device = self.device
        if device == "auto":
            device = "cuda" if torch.cuda.is_available() else "cpu"
        if device not in ("cpu", "cuda") and not device.startswith("cuda:"):
            raise ValueError(f"Unknown device {device!r}; supported: auto, cpu, cuda.")
        return device

    def _build_model_config(self, device: str, cpu_config: CpuConfig) -> ModelConfig:
        from kvserve.model.demo import resolve_model_path
        from kvserve.model.gguf import read_gguf_config
        path = resolve_model_path(self.model, self.load_format)
        tok_path = resolve_model_path(self.tokenizer) if self.tokenizer else path
        hf_config_path = (os.path.abspath(os.path.expanduser(self.hf_config_path))
                          if self.hf_config_path else None)
        return ModelConfig.from_path(
            path, tokenizer=tok_path,
            served_model_name=self.served_model_name or self.model,
            dtype=self.dtype, max_model_len=self.max_model_len, seed=self.seed,
            max_logprobs=self.max_logprobs, device=device, load_format=self.load_format,
            hf_config_path=hf_config_path,
            gguf_config=read_gguf_config(path, self.load_format, hf_config_path),
            cpu_isa=cpu_config.cpu_isa, quantization=self.quantization)

    def _build_scheduler_config(self, device: str, max_len: int) -> SchedulerConfig:
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a positive power of two, got {self.block_size}.")
        if self.scheduling_policy not in ("fcfs", "priority"):
            raise ValueError(f"scheduling_policy must be 'fcfs' or 'priority', got {self.scheduling_policy!r}.")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}.")
        batched = self.max_num_batched_tokens
        if batched is None:
            # On CPU, big steps are slower per token: their >32 MB temporaries are mmapped and
            # page-faulted afresh every op (measured 2.5x slower at 8192 than 2048 here).
            batched = 8192 if device.startswith("cuda") else 2048
            if not self.enable_chunked_prefill:
                batched = max(batched, max_len)
        if not self.enable_chunked_prefill and batched < max_len:
            raise ValueError(
                f"max_num_batched_tokens ({batched}) is smaller than max_model_len ({max_len}) "
                f"with chunked prefill disabled: long prompts could never be scheduled.")
        if batched < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1, got {batched}.")
        return self._make(SchedulerConfig, max_num_batched_tokens=batched, max_model_len=max_len,
                          policy=self.scheduling_policy)

    def _build_parallel_config(self, model_config: ModelConfig, device: str) -> ParallelConfig:
        parallel = self._make(ParallelConfig)
        _verify_parallel(model_config, parallel)
        _verify_expert_parallel(model_config, parallel)
        _verify_device_count(device, parallel)
        return parallel

    def _build_kv_transfer_config(self, parallel: ParallelConfig) -> Any:
        from kvserve.kv_transfer.config import KVTransferConfig
        kv_transfer_config = KVTransferConfig.parse(self.kv_transfer_config)
        if kv_transfer_config is not None and self.async_scheduling:
            raise ValueError("async_scheduling does not support kv_transfer_config yet (the KV "
                             "connector's hooks expect each step's output before the next).")
        if kv_transfer_config is not None and parallel.world_size > 1:
            raise ValueError("kv_transfer_config needs tensor_parallel_size=1 and "
                             "pipeline_parallel_size=1 here.")
        return kv_transfer_config

    def _build_lora_config(self, parallel: ParallelConfig, spec_config: Any,
                           kv_transfer_config: Any) -> Any:
        """LoRAConfig with --enable-lora; the combinations not built yet are an error now."""
        if not self.enable_lora:
            return None
        from kvserve.lora.config import LoRAConfig
        for on, what in ((spec_config is not None, "speculative decoding"),
                         (parallel.pipeline_parallel_size > 1, "pipeline parallelism"),
                         (kv_transfer_config is not None, "a KV connector (P/D disaggregation)")):
            if on:
                raise ValueError(f"--enable-lora with {what} is not supported yet.")
        return self._make(LoRAConfig)

    def _resolve_runner(self, model_config: ModelConfig, spec_config: Any) -> bool:
        """Set the model's runner (and a pooling runner's pooler); returns whether prefix
        caching stays on. A pooling runner turns it off: a prompt prefix found in the cache
        is not computed again, so MEAN / CLS / ALL would miss its hidden states."""
        from kvserve.config import PoolerConfig
        from kvserve.pooling.config import resolve_pooler_config, resolve_runner
        runner, convert = resolve_runner(self.runner, self.convert, model_config.architecture)
        model_config.runner_type, model_config.convert_type = runner, convert
        if runner != "pooling":
            if self.pooler_config is not None:
                raise ValueError("--pooler-config needs --runner pooling.")
            return self.enable_prefix_caching
        if spec_config is not None:
            raise ValueError("Speculative decoding does not apply to --runner pooling.")
        model_config.pooler_config = resolve_pooler_config(
            model_config, PoolerConfig.parse(self.pooler_config))
        return False


def _kv_cache_groups(model_config: ModelConfig, parallel: ParallelConfig, spec: Any,
                     kv_transfer: Any, disable_hybrid: bool) -> list:
    """The hybrid KV cache's groups; a sliding-window model with a feature that assumes one
    block table (PP stages, speculative decoding's draft cache, KV transfer) is refused here."""
    from kvserve.config import get_kv_cache_groups, layer_sliding_windows
    windows = layer_sliding_windows(model_config.hf_config, model_config.max_model_len)
    if any(w is not None for w in windows):
        for on, what in ((parallel.pipeline_parallel_size > 1, "pipeline parallelism"),
                         (spec is not None, "speculative decoding"),
                         (kv_transfer is not None, "kv_transfer_config")):
            if on:
                raise ValueError(f"{model_config.architecture} has sliding-window layers "
                                 f"(window {max(w or 0 for w in windows)} < max_model_len "
                                 f"{model_config.max_model_len}); {what} is not supported with "
                                 "them yet. Set max_model_len <= the window to run it with "
                                 "full attention.")
    return get_kv_cache_groups(windows, disable_hybrid)


def _verify_speculative(spec_config: Optional[SpeculativeConfig], model_config: ModelConfig,
                        parallel: ParallelConfig) -> None:
    if spec_config is None:
        return
    if parallel.pipeline_parallel_size > 1:
        raise ValueError("Speculative decoding with pipeline parallelism "
                         "(pipeline_parallel_size > 1) is not supported yet.")
    spec_config.verify_with_target(model_config.hf_config, model_config.tokenizer,
                                   parallel.tensor_parallel_size, model_config.max_model_len)


def _verify_async_scheduling(async_scheduling: bool, spec_config: Optional[SpeculativeConfig],
                             parallel: ParallelConfig) -> None:
    """What async scheduling does not run with (as vLLM at its start): the drafts of a step
    are proposed from tokens the host has not read yet, and PP already keeps a batch per stage
    in flight."""
    if not async_scheduling:
        return
    if spec_config is not None:
        raise ValueError("async_scheduling does not support speculative decoding "
                         "(speculative_config): drafts are proposed from the sampled tokens the "
                         "host reads one step late. Turn one of them off.")
    if parallel.pipeline_parallel_size > 1:
        raise ValueError("async_scheduling does not support pipeline_parallel_size > 1 (the "
                         "batch queue already keeps one batch per stage in flight).")


def _verify_parallel(model_config: ModelConfig, parallel: ParallelConfig) -> None:
    tp = parallel.tensor_parallel_size
    if tp < 1:
        raise ValueError(f"tensor_parallel_size must be >= 1, got {tp}.")
    heads = model_config.num_attention_heads
    if heads % tp:
        raise ValueError(f"Total number of attention heads ({heads}) must be divisible by "
                         f"tensor_parallel_size ({tp}).")
    kv = model_config.num_kv_heads
    if (kv % tp) and (tp % kv):
        raise ValueError(f"Number of KV heads ({kv}) and tensor_parallel_size ({tp}) must "
                         f"divide one another.")
    if parallel.data_parallel_size < 1:
        raise ValueError(f"data_parallel_size must be >= 1, got {parallel.data_parallel_size}.")
    _verify_data_parallel(parallel)
    pp = parallel.pipeline_parallel_size
    if pp < 1:
        raise ValueError(f"pipeline_parallel_size must be >= 1, got {pp}.")
    if pp > 1:
        from kvserve.distributed.pp_utils import get_pp_partition
        get_pp_partition(model_config.num_layers, pp)    # a layer count PP cannot split
    backend = parallel.distributed_executor_backend
    if backend == "uni" and parallel.world_size > 1:
        raise ValueError(f"distributed_executor_backend='uni' runs one worker; tensor_parallel_size "
                         f"x pipeline_parallel_size = {parallel.world_size} needs 'mp' or 'ray'.")


def _verify_expert_parallel(model_config: ModelConfig, parallel: ParallelConfig) -> None:
    """--enable-expert-parallel needs an MoE model whose experts split evenly over the TP
    ranks (each rank holds num_experts / tensor_parallel_size whole experts)."""
    if not parallel.enable_expert_parallel:
        return
    hf = model_config.hf_config
    experts = hf.get("num_local_experts") or hf.get("num_experts") or 0
    if not experts:
        raise ValueError(f"enable_expert_parallel needs a mixture-of-experts model; "
                         f"{model_config.architecture} has no experts.")
    tp = parallel.tensor_parallel_size
    if experts % tp:
        raise ValueError(f"enable_expert_parallel: the model's {experts} experts cannot be split "
                         f"evenly over tensor_parallel_size={tp} ranks (num_experts must be a "
                         f"multiple of it).")


def _verify_data_parallel(parallel: ParallelConfig) -> None:
    """Multi-node DP flags that cannot work fail here, before any process starts."""
    dp, local, start = (parallel.data_parallel_size, parallel.local_engine_count,
                        parallel.data_parallel_start_rank)
    if local < 0 or local > dp:
        raise ValueError(f"data_parallel_size_local ({local}) must be between 0 and "
                         f"data_parallel_size ({dp}).")
    if start < 0 or start + local > dp:
        raise ValueError(f"data_parallel_start_rank ({start}) + data_parallel_size_local "
                         f"({local}) exceeds data_parallel_size ({dp}): this node's engines "
                         f"would have DP ranks {start}..{start + local - 1}.")
    if local == dp and start != 0:
        raise ValueError(f"data_parallel_start_rank ({start}) needs data_parallel_size_local < "
                         f"data_parallel_size: with all {dp} engines on this node it is 0.")
    if parallel.has_remote_engines and not parallel.data_parallel_address:
        raise ValueError(f"data_parallel_size_local ({local}) < data_parallel_size ({dp}): the "
                         f"other engines run on other nodes and need data_parallel_address "
                         f"(--data-parallel-address, the front node's address) to connect to.")
    if not 0 < parallel.data_parallel_rpc_port < 65536:
        raise ValueError(f"data_parallel_rpc_port must be a TCP port, got "
                         f"{parallel.data_parallel_rpc_port}.")


def _verify_device_count(device: str, parallel: ParallelConfig) -> None:
    """Each CUDA rank needs its own GPU: say so before any worker process starts (a worker
    asking for a missing ordinal dies with "invalid device ordinal" instead)."""
    if not device.startswith("cuda"):
        return
    visible = torch.cuda.device_count()
    if parallel.world_size > visible:
        raise ValueError(
            f"tensor_parallel_size x pipeline_parallel_size = {parallel.world_size} ranks need "
            f"{parallel.world_size} GPUs, but only {visible} visible (CUDA_VISIBLE_DEVICES="
            f"{os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')}); lower the parallel size or "
            f"use device='cpu'.")


def _base_type(hint: Any) -> Any:
    args = getattr(hint, "__args__", None)
    if args:
        non_none = [a for a in args if a is not type(None)]
        return non_none[0] if non_none else str
    return hint


def run_command(make_parser: Callable[[], argparse.ArgumentParser],
                argv: Optional[list[str]] = None) -> int:
    """Parse `argv` and run the chosen subcommand's `func(args)`; a ValueError (a bad flag, or
    a bad KVSERVE_* value read for a flag's default) is a one-line error and exit status 2.
    The `kvserve` command and its `python -m` entry points use it."""
    import logging
    import sys

    logging.basicConfig(level=logging.INFO,
                        format="%(levelname)s %(asctime)s %(name)s: %(message)s")
    try:
        args = make_parser().parse_args(argv)
        return args.func(args)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
