"""Resolved engine configuration: what every component reads, built once from EngineArgs."""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any, Optional, Union

import torch

_DTYPES = {
    "float32": torch.float32, "float": torch.float32, "fp32": torch.float32,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float16": torch.float16, "half": torch.float16, "fp16": torch.float16,
}


def resolve_dtype(dtype: Any, hf_config: dict, device: str) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype in (None, "auto"):
        name = hf_config.get("torch_dtype") or hf_config.get("dtype") or "float32"
        resolved = _DTYPES.get(str(name).replace("torch.", ""), torch.float32)
        # float16 matmuls are ~1000x slower than bfloat16 on these CPUs; pick bf16 there.
        if device == "cpu" and resolved == torch.float16:
            resolved = torch.bfloat16
        return resolved
    if dtype not in _DTYPES:
        raise ValueError(f"Unknown dtype {dtype!r}; supported: auto, float32, bfloat16, float16.")
    return _DTYPES[dtype]


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

    @staticmethod
    def from_path(path: str, *, tokenizer: Optional[str],
                  served_model_name: Union[str, list[str], None],
                  dtype: Any, max_model_len: Optional[int], seed: int, max_logprobs: int,
                  device: str) -> "ModelConfig":
        cfg_file = os.path.join(path, "config.json")
        if not os.path.isdir(path):
            raise ValueError(f"Model path {path!r} is not a directory (a Hugging Face checkpoint "
                             f"directory with config.json, *.safetensors and tokenizer.json, or 'demo').")
        if not os.path.isfile(cfg_file):
            raise ValueError(f"Model directory {path!r} is missing config.json.")
        with open(cfg_file) as f:
            hf_config = json.load(f)
        gen_cfg: dict = {}
        gen_file = os.path.join(path, "generation_config.json")
        if os.path.isfile(gen_file):
            with open(gen_file) as f:
                gen_cfg = json.load(f)
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
        return ModelConfig(
            model=path, tokenizer=tokenizer or path,
            served_model_name=names[0], served_model_names=names,
            hf_config=hf_config, dtype=resolve_dtype(dtype, hf_config, device),
            max_model_len=max_model_len, seed=seed, max_logprobs=max_logprobs,
            generation_config=gen_cfg)


@dataclass
class CacheConfig:
    block_size: int = 16
    kv_cache_memory: Optional[int] = None       # bytes; None = default for the device
    num_gpu_blocks_override: Optional[int] = None
    enable_prefix_caching: bool = True
    num_blocks: int = 0                         # filled in once the worker has sized the cache


@dataclass
class SchedulerConfig:
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    max_model_len: int = 2048
    enable_chunked_prefill: bool = True
    long_prefill_token_threshold: int = 0
    policy: str = "fcfs"                        # "fcfs" | "priority"
    max_num_queued_requests: Optional[int] = None


@dataclass
class ParallelConfig:
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    data_parallel_size: int = 1
    distributed_executor_backend: Optional[str] = None   # None | "uni" | "mp" | "ray"

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size


@dataclass
class DeviceConfig:
    device: str = "cpu"

    @property
    def torch_device(self) -> torch.device:
        return torch.device(self.device)


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

    def __post_init__(self) -> None:
        if self.backend not in _SO_BACKENDS:
            raise ValueError(f"structured outputs backend must be one of {list(_SO_BACKENDS)}, "
                             f"got {self.backend!r}.")
        if self.max_compile_threads < 1:
            raise ValueError(f"max_compile_threads must be >= 1, got {self.max_compile_threads}.")

    @staticmethod
    def parse(value: Union[None, str, dict, "StructuredOutputsConfig"]) -> "StructuredOutputsConfig":
        if value is None:
            return StructuredOutputsConfig()
        if isinstance(value, StructuredOutputsConfig):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise ValueError(f"--structured-outputs-config is not valid JSON: {e}") from None
        if not isinstance(value, dict):
            raise ValueError(f"structured_outputs_config must be a JSON object, got {value!r}.")
        known = {f for f in StructuredOutputsConfig.__dataclass_fields__}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(f"Unknown structured_outputs_config key(s) {unknown}; known: "
                             f"{sorted(known)}.")
        return StructuredOutputsConfig(**value)


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
    enforce_eager: bool = True
    structured_outputs_config: StructuredOutputsConfig = field(
        default_factory=StructuredOutputsConfig)
