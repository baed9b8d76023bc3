"""Resolved engine configuration: what every component reads, built once from EngineArgs."""
from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Optional, Union

import torch

from kvserve.json_config import parse_setting

if TYPE_CHECKING:       # the feature configs are built above config.py (engine/arg_utils.py)
    from kvserve.spec_decode.config import SpeculativeConfig

logger = logging.getLogger(__name__)

_DTYPES = {
    "float32": torch.float32, "float": torch.float32, "fp32": torch.float32,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float16": torch.float16, "half": torch.float16, "fp16": torch.float16,
}


def resolve_dtype(dtype: Any, hf_config: dict, device: str, quantization: Optional[str] = None,
                  cpu_isa: Optional[str] = None) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype in (None, "auto"):
        name = hf_config.get("torch_dtype") or hf_config.get("dtype") or "float32"
        resolved = _DTYPES.get(str(name).replace("torch.", ""), torch.float32)
        # float16 matmuls are ~1000x slower than bfloat16 on these CPUs; pick bf16 there.
        if device == "cpu" and resolved == torch.float16:
            resolved = torch.bfloat16
        if _packed_gguf_in_bf16(hf_config, device, quantization, cpu_isa):
            resolved = torch.bfloat16
        return resolved
    if dtype not in _DTYPES:
        raise ValueError(f"Unknown dtype {dtype!r}; supported: auto, float32, bfloat16, float16.")
    return _DTYPES[dtype]


# The CPU kernel tier with native bf16 math; below it bf16 is emulated (~4x float32's time).
BF16_MATH_TIER = "avx512_bf16"


def _kernel_tier(cpu_isa: Optional[str]) -> Optional[str]:
    """The CPU kernel tier `cpu_isa` (CpuConfig.cpu_isa) means; None: this process's setting."""
    from kvserve.ops import cpu_isa as isa
    return isa.selected_tier() if cpu_isa is None else isa.resolve_tier(cpu_isa)


def _packed_gguf_in_bf16(hf_config: dict, device: str, quantization: Optional[str],
                         cpu_isa: Optional[str]) -> bool:
    """dtype "auto" for a block-quantized GGUF file kept packed, on a CPU with bf16 math (the
    avx512_bf16 tier): bfloat16 activations, as vLLM runs GGUF files in 16 bits. Its prompt
    GEMMs on dequantized tiles (the legacy types') then run bf16, twice float32's rate (a 0.85B
    Q4_K 512-token prompt 276 -> 485 tok/s, Zen 5, before the K-quants took the int8 GEMM), and
    the int8 kernels quantize x either way; the demo's perplexity moves +0.57%
    (benchmarks/README.md). Other tiers emulate bf16: float32."""
    if device != "cpu" or quantization != "gguf" or not hf_config.get("gguf_block_quantized"):
        return False
    if _kernel_tier(cpu_isa) != BF16_MATH_TIER:
        return False
    logger.info("dtype=auto: a block-quantized GGUF file on a CPU with bf16 math: activations "
                "and the KV cache are bfloat16 (--dtype float32 keeps float32).")
    return True


def resolve_weight_dtype(dtype: Any, hf_config: dict, device: str,
                         cpu_isa: Optional[str] = None) -> Optional[torch.dtype]:
    """The 16-bit dtype weights keep in memory when math runs in float32, else None.

    dtype "auto" on a CPU without bf16 instructions (below the avx512_bf16 tier): bf16 math
    there is emulated (~4x slower than float32), so a bf16/fp16 checkpoint keeps its weights
    16-bit (half the bytes per decode step) and activations, math and the KV cache are float32
    (ModelConfig.dtype; kv_cache_dtype="bfloat16" keeps the cache 16-bit too). An explicit
    dtype keeps its meaning. `cpu_isa`: CpuConfig.cpu_isa (None: this process's setting)."""
    if dtype not in (None, "auto") or device != "cpu":
        return None
    name = str(hf_config.get("torch_dtype") or hf_config.get("dtype") or "float32")
    stored = _DTYPES.get(name.replace("torch.", ""))
    if stored not in (torch.bfloat16, torch.float16):
        return None
    tier = _kernel_tier(cpu_isa)
    if tier == BF16_MATH_TIER:
        return None
    logger.info("dtype=auto: %s checkpoint on a CPU without bf16 math (kernel tier %s): weights "
                "stay %s in memory; activations, math and the KV cache are float32 "
                "(kv_cache_dtype=bfloat16 keeps the KV cache 16-bit).",
                name.replace("torch.", ""), tier or "none", name.replace("torch.", ""))
    return stored


def resolve_kv_cache_dtype(kv_cache_dtype: str, model_config: "ModelConfig",
                           device: str) -> torch.dtype:
    """vLLM's --kv-cache-dtype: "auto" is the model's dtype (activations). On CPU a 16-bit
    cache beside float32 activations is also allowed ("bfloat16"): half the bytes each decode
    step reads and twice the tokens per GiB, at bf16 rounding of K, V and the query in
    attention. The CPU kernels store float32 or bfloat16; CUDA keeps the model's dtype."""
    name = str(kv_cache_dtype).replace("torch.", "")
    if name == "auto":
        return model_config.dtype
    if name.startswith("fp8"):
        raise ValueError(f"kv_cache_dtype={kv_cache_dtype!r}: fp8 KV caches are not supported; "
                         f"use auto, bfloat16 or float32.")
    dtype = _DTYPES.get(name)
    if dtype is None:
        raise ValueError(f"Unknown kv_cache_dtype {kv_cache_dtype!r}; supported: auto, "
                         f"bfloat16, float32.")
    if device.startswith("cuda"):
        if dtype != model_config.dtype:
            raise ValueError(f"kv_cache_dtype={name} with dtype {model_config.dtype}: on CUDA "
                             f"the KV cache keeps the model's dtype (kv_cache_dtype=auto).")
        return dtype
    if dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"kv_cache_dtype={name}: the CPU KV cache is float32 or bfloat16.")
    if dtype != model_config.dtype:
        logger.info("KV cache in %s beside %s activations (kv_cache_dtype=%s).",
                    name, str(model_config.dtype).replace("torch.", ""), name)
    return dtype


@dataclass
class ModelConfig:
    model: str                       # resolved local path
    tokenizer: str
    served_model_name: str           # the name the API reports (the first of served_model_names)
    hf_config: dict
    dtype: torch.dtype
    max_model_len: int
    seed: int = 0
    max_logprobs: int = 20
    generation_config: dict = field(default_factory=dict)
    # Every name the API accepts for this model (vLLM's --served-model-name A B ...).
    served_model_names: list[str] = field(default_factory=list)
    # Set when linear / embedding weights stay 16-bit in memory while `dtype` (activations,
    # math, KV cache) is float32: resolve_weight_dtype.
    weight_dtype: Optional[torch.dtype] = None
    load_format: str = "auto"        # "auto" | "safetensors" | "gguf" (vLLM's --load-format)
    # vLLM's --runner (resolved: "generate" or "pooling") and --convert ("none" or "embed");
    # a pooling runner has its pooler_config resolved (kvserve.pooling.config).
    runner_type: str = "generate"
    convert_type: str = "none"
    pooler_config: Optional["PoolerConfig"] = None
    # vLLM's --quantization, resolved: "gguf" (a GGUF file: quantized tensors stay packed on
    # CPU), "gguf-dequantized" (dequantized at load: the float path), or None.
    quantization: Optional[str] = None

    def __post_init__(self) -> None:
        if not self.served_model_names:
            self.served_model_names = [self.served_model_name]

    @property
    def architecture(self) -> str:
        archs = self.hf_config.get("architectures") or []
        return archs[0] if archs else ""

    @property
    def vocab_size(self) -> int:
        return int(self.hf_config["vocab_size"])

    @property
    def hidden_size(self) -> int:
        return int(self.hf_config["hidden_size"])

    @property
    def num_layers(self) -> int:
        return int(self.hf_config["num_hidden_layers"])

    @property
    def num_attention_heads(self) -> int:
        return int(self.hf_config["num_attention_heads"])

    @property
    def num_kv_heads(self) -> int:
        return int(self.hf_config.get("num_key_value_heads") or self.num_attention_heads)

    @property
    def head_dim(self) -> int:
        hd = self.hf_config.get("head_dim")
        return int(hd) if hd else self.hidden_size // self.num_attention_heads

    @property
    def is_matryoshka(self) -> bool:
        """The checkpoint says its embeddings may be truncated (`dimensions`), as vLLM reads it."""
        return bool(self.hf_config.get("is_matryoshka") or self.hf_config.get("matryoshka_dimensions"))

    @property
    def is_gguf(self) -> bool:
        return self.load_format == "gguf"

    @staticmethod
    def from_path(path: str, *, tokenizer: Optional[str],
                  served_model_name: Union[str, list[str], None],
                  dtype: Any, max_model_len: Optional[int], seed: int, max_logprobs: int,
                  device: str, load_format: str = "auto",
                  hf_config_path: Optional[str] = None,
                  gguf_config: Optional[dict] = None,
                  cpu_isa: Optional[str] = None,
                  quantization: Optional[str] = None) -> "ModelConfig":
        """`gguf_config`: a GGUF file's HF-style config, as plain data from the GGUF reader
        (kvserve.model.gguf.read_gguf_config); config.py reads no GGUF itself."""
        if load_format not in LOAD_FORMATS:
            raise ValueError(f"Unknown load_format {load_format!r}; supported: "
                             f"{', '.join(LOAD_FORMATS)}.")
        gguf = is_gguf(path, load_format)
        quantization = resolve_quantization(quantization, gguf, device)
        hf_config, gen_cfg = load_hf_config(path, hf_config_path, gguf, gguf_config)
        derived_max = int(hf_config.get("max_position_embeddings") or 2048)
        if max_model_len is None:
            max_model_len = derived_max
        elif max_model_len > derived_max:
            raise ValueError(f"max_model_len={max_model_len} is larger than the model's "
                             f"max_position_embeddings={derived_max}.")
        if max_model_len < 1:
            raise ValueError(f"max_model_len must be positive, got {max_model_len}.")
        if isinstance(served_model_name, str):
            served_model_name = [served_model_name]
        names = [n for n in served_model_name or [] if n] or [path]
        weight_dtype = resolve_weight_dtype(dtype, hf_config, device, cpu_isa)
        return ModelConfig(
            model=path, tokenizer=tokenizer or path,
            served_model_name=names[0], served_model_names=names, weight_dtype=weight_dtype,
            hf_config=hf_config,
            dtype=torch.float32 if weight_dtype else resolve_dtype(dtype, hf_config, device,
                                                                   quantization, cpu_isa),
            max_model_len=max_model_len, seed=seed, max_logprobs=max_logprobs,
            generation_config=gen_cfg, load_format="gguf" if gguf else "safetensors",
            quantization=quantization)


LOAD_FORMATS = ("auto", "safetensors", "gguf")
QUANTIZATIONS = ("gguf", "gguf-dequantized", "fp8")


def resolve_quantization(quantization: Optional[str], gguf: bool, device: str,
                         gpu_capability: Optional[tuple[int, int]] = None) -> Optional[str]:
    """vLLM's --quantization: "gguf" is implied by a GGUF file (its block-quantized tensors
    stay packed); "gguf-dequantized" (kvserve's) dequantizes them at load instead; "fp8"
    (vLLM's online fp8) casts a 16-bit checkpoint's linear weights to e4m3 at load, on a GPU
    with fp8 (ops.fp8; `gpu_capability` overrides the device's, for tests)."""
    if quantization in (None, "", "none"):
        return "gguf" if gguf else None
    if quantization not in QUANTIZATIONS:
        where = "on CPU " if device == "cpu" else ""
        raise ValueError(f"quantization={quantization!r} is not supported {where}by kvserve; "
                         f"supported: {', '.join(QUANTIZATIONS)} (gguf: GGUF files, implied "
                         f"by a .gguf path; fp8: 16-bit checkpoints on an fp8 GPU).")
    if quantization == "fp8":
        if gguf:
            raise ValueError("--quantization fp8 quantizes a 16-bit checkpoint at load; a GGUF "
                             "file is quantized already (its blocks stay packed without the "
                             "flag).")
        from kvserve.ops.fp8 import check_fp8_supported
        check_fp8_supported(device, gpu_capability)
        return quantization
    if not gguf:
        raise ValueError(f"quantization={quantization!r} needs a GGUF model (a .gguf file or "
                         f"--load-format gguf).")
    return quantization


GGUF_EXTENSION = ".gguf"


def is_gguf(model: str, load_format: str = "auto") -> bool:
    """Whether `model` is to be loaded as GGUF: --load-format gguf, or a path ending in .gguf."""
    return load_format == "gguf" or (load_format == "auto" and model.endswith(GGUF_EXTENSION))


def _read_json_file(path: str) -> dict:
    with open(path) as f:
        return json.load(f)


def load_hf_config(path: str, hf_config_path: Optional[str] = None,
                   gguf: Optional[bool] = None,
                   gguf_config: Optional[dict] = None) -> tuple[dict, dict]:
    """(config.json, generation_config.json) of a checkpoint directory or a GGUF file.

    `hf_config_path` (vLLM's --hf-config-path): a directory whose config.json (and
    generation_config.json) is used instead of the model's own, e.g. where a GGUF file's
    metadata does not say everything. A GGUF file's own config is `gguf_config`, made by the
    GGUF reader (kvserve.model.gguf.read_gguf_config, which also checks the file)."""
    if gguf is None:
        gguf = is_gguf(path)
    if not gguf and not os.path.isdir(path):
        raise ValueError(f"Model path {path!r} is not a directory (a Hugging Face checkpoint "
                         f"directory with config.json, *.safetensors and tokenizer.json, a .gguf "
                         f"file, or 'demo').")
    config_dir = hf_config_path or (None if gguf else path)
    gen_cfg: dict = {}
    if config_dir is None:
        if gguf_config is None:
            raise ValueError(f"GGUF model {path!r}: pass its config from "
                             f"kvserve.model.gguf.read_gguf_config (config reads no GGUF).")
        return gguf_config, gen_cfg
    cfg_file = os.path.join(config_dir, "config.json")
    if not os.path.isfile(cfg_file):
        raise ValueError(f"{'Model' if config_dir == path else 'hf_config_path'} directory "
                         f"{config_dir!r} is missing config.json.")
    gen_file = os.path.join(config_dir, "generation_config.json")
    if os.path.isfile(gen_file):
        gen_cfg = _read_json_file(gen_file)
    return _read_json_file(cfg_file), gen_cfg


@dataclass
class CacheConfig:
    block_size: int = 16
    # The KV cache's dtype (vLLM's --kv-cache-dtype, resolved): None = the model's dtype.
    kv_cache_dtype: Optional[torch.dtype] = None
    kv_cache_memory: Optional[int] = None       # bytes; None = default for the device
    num_gpu_blocks_override: Optional[int] = None
    enable_prefix_caching: bool = True
    gpu_memory_utilization: float = 0.9         # CUDA: share of the GPU for everything
    num_blocks: int = 0                         # filled in once the worker has sized the cache
    # The hybrid KV cache's groups (get_kv_cache_groups); empty = one full-attention group of
    # every layer, today's single block table.
    kv_cache_groups: list["KVCacheGroupSpec"] = field(default_factory=list)


@dataclass
class SchedulerConfig:
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    max_model_len: int = 2048
    enable_chunked_prefill: bool = True
    long_prefill_token_threshold: int = 0
    policy: str = "fcfs"                        # "fcfs" | "priority"
    max_num_queued_requests: Optional[int] = None
    # Schedule step N+1 while step N runs (placeholders for step N's unsampled tokens).
    async_scheduling: bool = False


@dataclass
class ParallelConfig:
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    data_parallel_size: int = 1
    distributed_executor_backend: Optional[str] = None   # None | "uni" | "mp" | "ray"
    # MoE layers hold whole experts, E / tensor_parallel_size per TP rank, instead of a slice
    # of every expert (vLLM's flag; the EP group is the TP group).
    enable_expert_parallel: bool = False
    # Multi-node data parallelism (vLLM's flags): this node runs engines
    # [data_parallel_start_rank, + data_parallel_size_local); engines on other nodes reach the
    # front node at data_parallel_address:data_parallel_rpc_port (the start-up handshake).
    data_parallel_size_local: Optional[int] = None        # None: all of them
    data_parallel_start_rank: int = 0
    data_parallel_address: Optional[str] = None
    data_parallel_rpc_port: int = 29550
    # Data parallelism (set by the frontend that launches the engines): the address of the
    # DP group's rendezvous store, and of the coordinator's sockets.
    data_parallel_master_addr: str = "127.0.0.1"
    data_parallel_master_port: int = 0
    dp_coordinator_input: Optional[str] = None     # engines PUSH counts / wave starts here
    dp_coordinator_engines: Optional[str] = None   # engines SUBscribe to START_DP_WAVE here

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size

    @property
    def local_engine_count(self) -> int:
        local = self.data_parallel_size_local
        return self.data_parallel_size if local is None else local

    @property
    def has_remote_engines(self) -> bool:
        """Some engines of the DP group run on other nodes (they connect over TCP)."""
        return self.local_engine_count < self.data_parallel_size


@dataclass
class CpuConfig:
    """The CPU choices (--cpu-isa, --disable-cpu-kernels, --cpu-huge-pages). A field left None
    takes its variable's value (kvserve.envs), read once here; every worker process applies
    the result (kvserve.ops.cpu_isa.configure) before loading, so TP/PP ranks agree."""
    cpu_isa: Optional[str] = None               # auto | generic | avx2 | avx512 | avx512_bf16
    disable_cpu_kernels: Optional[bool] = None  # torch paths only: no C++ kernels, no oneDNN
    cpu_huge_pages: Optional[str] = None        # auto | on | off: weights in huge pages

    def __post_init__(self) -> None:
        from kvserve import envs
        from kvserve.ops.cpu_isa import resolve_tier
        self.cpu_isa = (self.cpu_isa or envs.get("KVSERVE_CPU_ISA") or "auto").strip().lower()
        resolve_tier(self.cpu_isa)    # an unknown tier, or one this CPU lacks: an error now
        if self.disable_cpu_kernels is None:
            self.disable_cpu_kernels = envs.get("KVSERVE_DISABLE_CPU_KERNELS")
        self.cpu_huge_pages = self.cpu_huge_pages or envs.get("KVSERVE_CPU_HUGE_PAGES")
        if self.cpu_huge_pages not in ("auto", "on", "off"):
            raise ValueError(f"cpu_huge_pages must be one of auto, on, off, got "
                             f"{self.cpu_huge_pages!r}.")


@dataclass
class DeviceConfig:
    device: str = "cpu"


_SO_BACKENDS = ("auto", "xgrammar", "guidance")


@dataclass
class StructuredOutputsConfig:
    """`--structured-outputs-config` (JSON): vLLM's backend and whitespace settings, plus ours:
    `enable_jump_forward` (append the tokens a grammar forces without a model step each)."""
    backend: str = "auto"                   # auto | xgrammar | guidance
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    enable_jump_forward: bool = False
    max_compile_threads: int = 2
    # A request whose grammar takes longer to compile fails alone (the compile thread cannot
    # be stopped; it finishes into the cache).
    grammar_compile_timeout_s: float = 30.0

    def __post_init__(self) -> None:
        if not self.grammar_compile_timeout_s > 0:
            raise ValueError(f"grammar_compile_timeout_s must be > 0, got "
                             f"{self.grammar_compile_timeout_s}.")
        if self.backend not in _SO_BACKENDS:
            raise ValueError(f"structured outputs backend must be one of {list(_SO_BACKENDS)}, "
                             f"got {self.backend!r}.")
        if self.max_compile_threads < 1:
            raise ValueError(f"max_compile_threads must be >= 1, got {self.max_compile_threads}.")

    @staticmethod
    def parse(value: Union[None, str, dict, "StructuredOutputsConfig"]) -> "StructuredOutputsConfig":
        return parse_setting(StructuredOutputsConfig, value, "structured_outputs_config")


POOLING_TYPES = ("LAST", "MEAN", "CLS", "ALL")


@dataclass
class PoolerConfig:
    """vLLM's --pooler-config (JSON): how a pooling runner pools. Fields left None come from
    the checkpoint's sentence-transformers config, else the decoder-embedder defaults (LAST,
    normalised); see kvserve.pooling.config."""
    pooling_type: Optional[str] = None     # LAST | MEAN | CLS | ALL
    normalize: Optional[bool] = None
    dimensions: Optional[int] = None       # default `dimensions` of requests that set none

    def __post_init__(self) -> None:
        if self.pooling_type is not None:
            self.pooling_type = str(self.pooling_type).upper()
            if self.pooling_type not in POOLING_TYPES:
                raise ValueError(f"pooling_type must be one of {list(POOLING_TYPES)}, got "
                                 f"{self.pooling_type!r}.")
        if self.dimensions is not None and self.dimensions < 1:
            raise ValueError(f"pooler_config.dimensions must be >= 1, got {self.dimensions}.")

    @staticmethod
    def parse(value: Union[None, str, dict, "PoolerConfig"]) -> "PoolerConfig":
        return parse_setting(PoolerConfig, value, "pooler_config")


CUDAGRAPH_MODES = ("NONE", "FULL_DECODE_ONLY", "FULL")
# vLLM's default cudagraph_capture_sizes: 1, 2, 4, then steps of 8 to 256 and of 16 to 512.
DEFAULT_CAPTURE_SIZES = (1, 2, 4) + tuple(range(8, 257, 8)) + tuple(range(272, 513, 16))


@dataclass
class CompilationConfig:
    """vLLM's --compilation-config (JSON), its CUDA-graph part (CUDA with TRITON_ATTN only).

    cudagraph_mode: NONE (every step eager, as --enforce-eager); FULL_DECODE_ONLY (the
    default: an all-decode step replays its batch bucket's graph); FULL (mixed prefill +
    decode steps too, one graph per token bucket up to max_cudagraph_capture_size, their
    requests padded). vLLM's PIECEWISE modes split a torch.compile'd graph at attention;
    kvserve compiles nothing, so they are an error here. cudagraph_capture_sizes: the buckets
    (default 1, 2, 4, 8, 16, 24, ... 512); max_cudagraph_capture_size: the largest one (default
    min(2 x max_num_seqs, 512), as vLLM's)."""
    cudagraph_mode: str = "FULL_DECODE_ONLY"
    cudagraph_capture_sizes: Optional[list[int]] = None
    max_cudagraph_capture_size: Optional[int] = None

    def __post_init__(self) -> None:
        mode = str(self.cudagraph_mode).upper()
        if mode not in CUDAGRAPH_MODES:
            hint = (" (piecewise graphs need torch.compile's split at attention, which kvserve "
                    "does not do)" if "PIECEWISE" in mode else "")
            raise ValueError(f"compilation_config.cudagraph_mode must be one of "
                             f"{list(CUDAGRAPH_MODES)}, got {self.cudagraph_mode!r}{hint}.")
        self.cudagraph_mode = mode
        sizes = self.cudagraph_capture_sizes
        if sizes is not None and (not sizes or any(not isinstance(s, int) or s < 1
                                                   for s in sizes)):
            raise ValueError(f"compilation_config.cudagraph_capture_sizes must be a non-empty "
                             f"list of positive integers, got {sizes!r}.")
        cap = self.max_cudagraph_capture_size
        if cap is not None and (not isinstance(cap, int) or cap < 1):
            raise ValueError(f"compilation_config.max_cudagraph_capture_size must be a positive "
                             f"integer, got {cap!r}.")

    @staticmethod
    def parse(value: Union[None, str, dict, "CompilationConfig"]) -> "CompilationConfig":
        return parse_setting(CompilationConfig, value, "compilation_config")

    def graph_buckets(self, max_num_seqs: int, max_num_batched_tokens: int
                      ) -> tuple[list[int], list[int]]:
        """(decode buckets in requests, mixed-step buckets in tokens); both empty for NONE,
        the second for FULL_DECODE_ONLY."""
        if self.cudagraph_mode == "NONE":
            return [], []
        sizes = sorted(set(self.cudagraph_capture_sizes or DEFAULT_CAPTURE_SIZES))
        cap = self.max_cudagraph_capture_size or (
            sizes[-1] if self.cudagraph_capture_sizes else min(2 * max_num_seqs, 512))
        decode = [s for s in sizes if s <= min(cap, max_num_seqs)]
        if self.cudagraph_mode != "FULL":
            return decode, []
        return decode, [s for s in sizes if s <= min(cap, max_num_batched_tokens)]


@dataclass
class KVServeConfig:
    """Everything an engine needs, passed whole to EngineCore, executors and workers."""
    model_config: ModelConfig
    cache_config: CacheConfig
    scheduler_config: SchedulerConfig
    parallel_config: ParallelConfig
    device_config: DeviceConfig
    multiprocessing: bool = False
    disable_log_stats: bool = True
    enforce_eager: bool = False                 # True: no CUDA graphs
    attention_backend: str = "CPU_ATTN"         # resolved by kvserve.attention.selector
    structured_outputs_config: StructuredOutputsConfig = field(
        default_factory=StructuredOutputsConfig)
    speculative_config: Optional["SpeculativeConfig"] = None
    kv_transfer_config: Optional[Any] = None    # kv_transfer.config.KVTransferConfig
    lora_config: Optional[Any] = None           # lora.config.LoRAConfig (--enable-lora)
    cpu_config: CpuConfig = field(default_factory=CpuConfig)
    compilation_config: CompilationConfig = field(default_factory=CompilationConfig)


# ---------------------------------------------------------------------------- sliding windows
def layer_sliding_windows(hf_config: dict, max_model_len: int) -> list[Optional[int]]:
    """Per decoder layer: its sliding window W (a query attends to the last W positions, itself
    included, as transformers' sliding masks do) or None for full attention.

    From `layer_types` ("sliding_attention" / "full_attention", transformers >= 4.53), else
    Gemma 3's `sliding_window_pattern` (every Nth layer global), Gemma 2's alternation (even
    layers local), or one `sliding_window` for every layer (Mistral; Qwen2 with
    `use_sliding_window`). A window >= max_model_len never cuts anything: None.
    """
    n = int(hf_config["num_hidden_layers"])
    window = hf_config.get("sliding_window")
    if not window or hf_config.get("use_sliding_window") is False or window >= max_model_len:
        return [None] * n
    window = int(window)
    types = hf_config.get("layer_types")
    if types:
        if len(types) != n:
            raise ValueError(f"config.json has {len(types)} layer_types for {n} layers.")
        return [window if t == "sliding_attention" else None for t in types]
    model_type = hf_config.get("model_type", "")
    pattern = hf_config.get("sliding_window_pattern") or hf_config.get("_sliding_window_pattern")
    if model_type.startswith("gemma3") and pattern:
        return [None if (i + 1) % int(pattern) == 0 else window for i in range(n)]
    if model_type == "gemma2":
        return [window if i % 2 == 0 else None for i in range(n)]
    return [window] * n


@dataclass(frozen=True)
class KVCacheGroupSpec:
    """One KV cache group (vLLM's KVCacheGroupSpec): layers of one attention type that share a
    block table. `layer_ids` are model layer indices; the i-th layer of every group shares the
    i-th KV tensor of the worker (so one block id is one page across `group_size` tensors)."""
    layer_ids: tuple[int, ...]
    sliding_window: Optional[int] = None     # None: full attention


def get_kv_cache_groups(windows: list[Optional[int]],
                        disable_hybrid: bool = False) -> list[KVCacheGroupSpec]:
    """Group layers by attention type, vLLM's way: every group has the same number of layers
    (the smallest type's count; a type's last group may be shorter), so layer i of each group
    can share one KV tensor. All layers full (or `disable_hybrid`): [] (today's one group)."""
    kinds = sorted(set(windows), key=lambda w: (w is not None, w or 0))
    if disable_hybrid or kinds == [None]:
        return []
    by_kind = {k: [i for i, w in enumerate(windows) if w == k] for k in kinds}
    size = min(len(ids) for ids in by_kind.values())
    groups = []
    for kind, ids in by_kind.items():
        for start in range(0, len(ids), size):
            groups.append(KVCacheGroupSpec(tuple(ids[start:start + size]), kind))
    return groups
