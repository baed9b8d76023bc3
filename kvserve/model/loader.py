"""Build a model from a local Hugging Face checkpoint directory (config.json + safetensors)
or a GGUF file (`gguf.py`).

The model is constructed directly on the target device in the target dtype, then each
checkpoint tensor is read on its own (never the whole checkpoint at once) and handed to its
parameter's weight_loader, which copies this TP rank's shard.
"""
from __future__ import annotations

import contextlib
import json
import logging
import os
from typing import Any, Callable, Iterable, Iterator, Optional

import torch
from safetensors import safe_open
from torch import nn

from kvserve.config import ModelConfig
from kvserve.model.file_checks import check_safetensors_files
from kvserve.model.huge_pages import move_weights_to_huge_pages
from kvserve.model.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from kvserve.model.layers.linear import LinearBase, quantize_linear_weights_fp8
from kvserve.model.registry import get_model_class
from kvserve.ops import cpu_isa, linear
from kvserve.ops.cpu_weight import (CpuLinearWeight, WeightPlan, choose_weight_plan, keep_packed,
                                   make_packed_weight, make_weight)
from kvserve.ops.quant import kernel as quant_kernel
from kvserve.utils.memory import release_freed_heap

logger = logging.getLogger(__name__)

SAFE_WEIGHTS_NAME = "model.safetensors"
SAFE_WEIGHTS_INDEX_NAME = "model.safetensors.index.json"


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


def safetensors_files(model_dir: str) -> list[str]:
    """The checkpoint's safetensors files: the shards of the index, or model.safetensors."""
    index_file = os.path.join(model_dir, SAFE_WEIGHTS_INDEX_NAME)
    if os.path.isfile(index_file):
        with open(index_file) as f:
            weight_map = json.load(f).get("weight_map") or {}
        files = [os.path.join(model_dir, name) for name in sorted(set(weight_map.values()))]
        missing = [os.path.basename(p) for p in files if not os.path.isfile(p)]
        if missing or not files:
            raise FileNotFoundError(
                f"{index_file} lists weight files that are missing from {model_dir!r}: "
                f"{', '.join(missing) or '(the index lists none)'}.")
        return files
    single = os.path.join(model_dir, SAFE_WEIGHTS_NAME)
    if os.path.isfile(single):
        return [single]
    present = sorted(n for n in os.listdir(model_dir)
                     if n.endswith((".safetensors", ".bin", ".pt", ".pth", ".gguf")))
    raise FileNotFoundError(
        f"No weights in {model_dir!r}: expected {SAFE_WEIGHTS_NAME} or {SAFE_WEIGHTS_INDEX_NAME} "
        f"(kvserve loads safetensors only; weight-like files present: {', '.join(present) or 'none'}).")


def iterate_weights(model_dir: str, skip: Optional[Callable[[str], bool]] = None
                    ) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (name, tensor) for every checkpoint tensor, one at a time, on the CPU; the
    tensors `skip` names are never read (expert parallelism: other ranks' experts)."""
    for path in safetensors_files(model_dir):
        with safe_open(path, framework="pt", device="cpu") as f:
            for name in f.keys():
                if skip is None or not skip(name):
                    yield name, f.get_tensor(name)


def checkpoint_weights(model_config: ModelConfig, packed: bool = False,
                       skip: Optional[Callable[[str], bool]] = None
                       ) -> Iterator[tuple[str, torch.Tensor]]:
    """The checkpoint's (HF name, tensor) stream: safetensors, or a GGUF file dequantized
    (`packed`: its block-quantized tensors as raw blocks, kept packed by the layers); the
    tensors `skip` names (by HF name) are left out unread."""
    if model_config.is_gguf:
        from kvserve.model.gguf import iterate_gguf_weights
        return iterate_gguf_weights(model_config.model, model_config.hf_config, packed, skip)
    check_safetensors_files(safetensors_files(model_config.model))   # fail before allocating
    return iterate_weights(model_config.model, skip)


def load_model(model_config: ModelConfig, device: torch.device,
               plan: Optional[WeightPlan] = None) -> nn.Module:
    """Build the model for `model_config` on `device` and load this TP rank's weights
    (`plan`: the weights' variant; None: choose_weight_plan's choice)."""
    model_cls = get_model_class(model_config.architecture)
    hf = model_config.hf_config
    packed = model_config.is_gguf and keep_packed(
        model_config.quantization, device=device.type,
        quant_kernel=device.type == "cpu" and quant_kernel.ops() is not None,
        moe=bool(hf.get("num_local_experts") or hf.get("num_experts")))
    skip = getattr(model_cls, "checkpoint_skip", None)    # MoE: other EP ranks' experts
    weights = checkpoint_weights(model_config, packed,     # fails before allocating anything
                                 skip(model_config) if skip is not None else None)
    return build_and_load(lambda: model_cls(model_config), weights, model_config, device, plan)


def build_and_load(build: Callable[[], nn.Module], weights: Iterable[tuple[str, torch.Tensor]],
                   model_config: ModelConfig, device: torch.device,
                   plan: Optional[WeightPlan] = None) -> nn.Module:
    """`build()` the module in the config's dtype on `device`, load `weights` through its
    load_weights (every parameter must get one), apply_weight_plan, then the
    process_weights_after_loading hooks. Shared by the model and proposer heads (EAGLE)."""
    # 16-bit weights with float32 math: built (and loaded) 16-bit, then widened.
    with _default_dtype(model_config.weight_dtype or model_config.dtype), torch.device(device):
        model = build()
    loaded = model.load_weights(weights)
    never_loaded = sorted(set(name for name, _ in model.named_parameters()) - loaded)
    if never_loaded:
        shown = ", ".join(never_loaded[:8]) + (" ..." if len(never_loaded) > 8 else "")
        raise ValueError(f"Checkpoint {model_config.model!r} has no weights for "
                         f"{len(never_loaded)} parameter(s) of {type(model).__name__}: {shown}")
    apply_weight_plan(model, model_config.dtype, device, plan)
    if model_config.quantization == "fp8":      # checked at config resolution (ops.fp8)
        logger.info("fp8: %d linear weights cast to float8_e4m3fn (per-channel scales).",
                    quantize_linear_weights_fp8(model))
    # Work that needs the loaded weights (vLLM's hook name), e.g. building the fused op.
    for module in model.modules():
        process = getattr(module, "process_weights_after_loading", None)
        if process is not None:
            process()
    if device.type == "cpu":
        move_weights_to_huge_pages(model)
        # The load's temporaries and the storages the move replaced, where they were heap
        # blocks (an in-process engine keeps glibc's dynamic malloc thresholds).
        release_freed_heap()
    # Counted now, before the KV cache or step buffers exist (benchmarks read it back).
    model.weight_bytes = weight_memory_bytes(model)
    logger.info("Model weights take %.1f MiB in memory.", model.weight_bytes / 2**20)
    return model.eval()


def weight_memory_bytes(model: nn.Module) -> int:
    """Bytes of the distinct tensor storages the model holds: parameters, buffers and the
    weight objects its modules keep (packed GGUF blocks and expert stacks, prepacked or
    small-batch copies). A tied head or a table shared by layers counts once."""
    storages: dict[int, int] = {}

    def visit(obj: Any, depth: int) -> None:
        if isinstance(obj, torch.Tensor):
            if obj.device.type == "meta":
                return
            try:
                storage = obj.untyped_storage()
                storages[storage.data_ptr()] = storage.nbytes()
            except NotImplementedError:     # oneDNN's prepacked (opaque) weights
                storages[id(obj)] = obj.numel() * obj.element_size()
        elif depth > 0 and isinstance(obj, (list, tuple)):
            for item in obj:
                visit(item, depth - 1)
        elif depth > 0 and hasattr(obj, "__dict__") and not isinstance(obj, (nn.Module, type)):
            for item in vars(obj).values():     # weight objects: dataclasses of tensors
                visit(item, depth - 1)

    for module in model.modules():
        for tensor in list(module.parameters(recurse=False)) + list(module.buffers(recurse=False)):
            visit(tensor, 0)
        for name, value in vars(module).items():
            if not name.startswith("_"):
                visit(value, 3)
    return sum(storages.values())


def apply_weight_plan(model: nn.Module, act_dtype: torch.dtype, device: torch.device,
                      plan: Optional[WeightPlan] = None) -> None:
    """Give every linear, embedding and LM-head weight its object (ops.cpu_weight), all by
    one plan (`plan`, else choose_weight_plan's); a tied LM head and its embedding share one.
    Every other parameter (norms, biases: a few KB) is cast to the activations' dtype, unless it
    says `keep_loaded_dtype` (FusedMoE's bf16 experts under float32 math): only 16-bit weights
    with float32 math (dtype "auto" without bf16 instructions) stay 16-bit. Modules with a
    `choose_cpu_layout(act_dtype)` hook (FusedMoE) then pick their experts' layout."""
    embeds = [m for m in model.modules() if type(m) is VocabParallelEmbedding]
    matmuls = [m for m in model.modules() if isinstance(m, (LinearBase, ParallelLMHead))]
    kept = {id(m.weight) for m in [*embeds, *matmuls]}
    # GGUF blocks kept packed (the layers' loaders recorded them): the packed variant.
    packed = {id(m.weight): m for m in [*embeds, *matmuls] if hasattr(m.weight, "quant_parts")}
    for m in packed.values():
        m.linear_weight = make_packed_weight(m.weight, act_dtype)
    for m in [*embeds, *matmuls]:
        if id(m.weight) in packed:
            m.linear_weight = packed[id(m.weight)].linear_weight   # a tied head shares it
            if isinstance(m, ParallelLMHead):
                m.linear_weight.precise = True      # the logits: see PackedWeight.precise
    embeds = [m for m in embeds if id(m.weight) not in packed]
    matmuls = [m for m in matmuls if id(m.weight) not in packed]
    for param in model.parameters():
        if getattr(param, "keep_loaded_dtype", False):      # e.g. FusedMoE's bf16 experts
            continue
        if id(param) not in kept and param.is_floating_point() and param.dtype != act_dtype:
            param.data = param.data.to(act_dtype)
    for m in model.modules():       # FusedMoE: bf16 experts panel-packed on dpbf16 CPUs
        choose = getattr(m, "choose_cpu_layout", None)
        if choose is not None:
            choose(act_dtype)
    tied = {id(m.weight) for m in embeds}
    if plan is None and matmuls:
        import psutil
        cpu, weight_dtype = device.type == "cpu", matmuls[0].weight.dtype
        plan = choose_weight_plan(
            weight_dtype, act_dtype, device=device.type,
            tier=cpu_isa.selected_tier() if cpu else None,
            kernel=cpu and linear.cpu_kernel() is not None,
            packing=cpu and linear.packing_works(act_dtype),
            numel=sum(m.weight.numel() for m in matmuls),
            tied_numel=sum(m.weight.numel() for m in matmuls if id(m.weight) in tied),
            # Copies may take a quarter of the available memory (as the CPU KV cache may).
            budget=psutil.virtual_memory().available // 4)
        logger.info("Weights: %s (%s, %s math%s).", plan.variant, weight_dtype, act_dtype,
                    ", a prepacked float32 copy" if plan.float32_copy else "")
    for m in matmuls:
        m.linear_weight = make_weight(m.weight, plan, act_dtype, keep_plain=id(m.weight) in tied)
    shared = {id(m.weight): m.linear_weight for m in matmuls}
    for m in embeds:
        m.linear_weight = shared.get(id(m.weight)) or CpuLinearWeight(m.weight, act_dtype)


def num_kv_heads_per_rank(model_config: ModelConfig, tp_size: int) -> int:
    """KV heads each rank holds (a KV head is replicated when tp_size exceeds their number)."""
    return max(1, model_config.num_kv_heads // tp_size)


def get_kv_cache_shape(model_config: ModelConfig, num_blocks: int, block_size: int,
                       tp_size: int) -> tuple[int, ...]:
    """Shape of one layer's KV cache: [2 (k, v), num_blocks, block_size, kv_heads, head_dim]."""
    return (2, num_blocks, block_size, num_kv_heads_per_rank(model_config, tp_size),
            model_config.head_dim)
