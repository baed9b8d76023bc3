"""Tensor-parallel linear layers that load their own shard from full checkpoint tensors.

Weights are stored as [out_features, in_features] (like nn.Linear / HF checkpoints).

    ColumnParallelLinear   splits out_features: rank r holds rows [r*n, (r+1)*n)
    RowParallelLinear      splits in_features: each rank computes a partial sum, then all-reduce
    MergedColumnParallel   several column-parallel outputs fused in one matmul (gate_proj|up_proj)
    QKVParallelLinear      q, k, v fused; each rank holds its q heads and its k/v heads

Every parameter carries `weight_loader(param, loaded_weight, shard_id=None)`: given the FULL
checkpoint tensor, it copies the part this rank owns into `param` (into the slice of a fused
parameter that `shard_id` names). The matmul goes through the weight's object (ops.cpu_weight).
"""
from __future__ import annotations

from typing import Any, Optional, Union

import torch
from torch import nn

from kvserve.distributed.parallel_state import (get_tp_rank, get_tp_world_size,
                                                tensor_model_parallel_all_gather,
                                                tensor_model_parallel_all_reduce)
from kvserve.ops import fused as fused_ops
from kvserve.ops.cpu_weight import CpuLinearWeight
from kvserve.ops.quant.weight import QuantizedRows


def quantize_linear_weights_fp8(model: nn.Module) -> int:
    """--quantization fp8 (vLLM's online fp8): every linear layer's weight object becomes an
    ops.fp8.Fp8LinearWeight (e4m3, per-channel scales); the LM head and the embeddings are no
    LinearBase and stay 16-bit, as in vLLM. Returns how many weights were quantized."""
    from kvserve.ops.fp8 import Fp8LinearWeight

    layers = [m for m in model.modules() if isinstance(m, LinearBase)]
    for m in layers:
        m.linear_weight = Fp8LinearWeight(m.weight, m.linear_weight.act_dtype)
    return len(layers)


def divide(numerator: int, denominator: int) -> int:
    if numerator % denominator:
        raise ValueError(f"{numerator} is not divisible by {denominator} (tensor parallel split).")
    return numerator // denominator


def copy_checked(dst: torch.Tensor, src: torch.Tensor) -> None:
    """copy_ without broadcasting: a shape mismatch means the checkpoint does not fit the config."""
    if dst.shape != src.shape:
        raise ValueError(f"Checkpoint tensor shape {tuple(src.shape)} does not match the parameter "
                         f"(shard) shape {tuple(dst.shape)}.")
    dst.copy_(src)


def shard(loaded_weight: torch.Tensor, dim: int, full_size: int, index: int,
          size: int) -> torch.Tensor:
    """The `index`-th slice of `size` along `dim`, after checking the full tensor's size there."""
    if loaded_weight.dim() <= dim or loaded_weight.shape[dim] != full_size:
        raise ValueError(f"Checkpoint tensor shape {tuple(loaded_weight.shape)} does not have "
                         f"size {full_size} in dim {dim}, which the config implies.")
    return loaded_weight.narrow(dim, index * size, size)


def copy_rows(param: nn.Parameter, src: object, offset: int = 0) -> None:
    """Rows [offset, offset + len(src)) of `param` from `src`: a tensor is copied; GGUF blocks
    kept packed (ops.quant.QuantizedRows) are only recorded in `param.quant_parts`, for the
    loader to pack (ops.cpu_weight.make_packed_weight); the Parameter is never written."""
    if isinstance(src, QuantizedRows):
        want = (src.shape[0], param.shape[1])
        if offset + src.shape[0] > param.shape[0] or tuple(src.shape) != want:
            raise ValueError(f"Checkpoint tensor shape {tuple(src.shape)} does not match the "
                             f"parameter (shard) rows [{offset}, {offset + src.shape[0]}) of "
                             f"{tuple(param.shape)}.")
        if not hasattr(param, "quant_parts"):
            param.quant_parts = {}
        param.quant_parts[offset] = src
        return
    whole = offset == 0 and src.shape[0] == param.shape[0]
    copy_checked(param.data if whole else param.data.narrow(0, offset, src.shape[0]), src)


def default_weight_loader(param: torch.Tensor, loaded_weight: torch.Tensor,
                          shard_id: Optional[Union[int, str]] = None) -> None:
    """Replicated parameter: copy the whole tensor (casting to the parameter's dtype/device)."""
    assert shard_id is None, shard_id
    copy_rows(param, loaded_weight) if isinstance(loaded_weight, QuantizedRows) \
        else copy_checked(param.data, loaded_weight)


def _param(*shape: int) -> nn.Parameter:
    # Created under the loader's default dtype/device context; filled by weight_loader.
    return nn.Parameter(torch.empty(*shape), requires_grad=False)


class LinearBase(nn.Module):
    def __init__(self, input_size: int, output_size: int, bias: bool) -> None:
        super().__init__()
        self.tp_rank = get_tp_rank()
        self.tp_size = get_tp_world_size()
        self.input_size = input_size        # this rank's in_features
        self.output_size = output_size      # this rank's out_features
        self.weight = _param(output_size, input_size)
        self.weight.weight_loader = self.weight_loader
        if bias:
            self.bias = _param(output_size)
            self.bias.weight_loader = self.weight_loader
        else:
            self.register_parameter("bias", None)
        # Plain until the loader applies the model's weight plan (ops.cpu_weight).
        self.linear_weight = CpuLinearWeight(self.weight, self.weight.dtype)
        # Multi-LoRA (kvserve.lora.layers.LoRALinear): adds this step's adapter deltas.
        self.lora: Optional[Any] = None

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor,
                      shard_id: Optional[Union[int, str]] = None) -> None:
        raise NotImplementedError

    def apply_linear(self, x: torch.Tensor, with_bias: bool = True) -> torch.Tensor:
        y = self.linear_weight.matmul(x, self.bias if with_bias else None)
        return y if self.lora is None else self.lora.apply(x, y)

    def extra_repr(self) -> str:
        return (f"in_features={self.input_size}, out_features={self.output_size}, "
                f"bias={self.bias is not None}, tp_size={self.tp_size}")


class ReplicatedLinear(LinearBase):
    """Every rank holds the whole weight."""

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor,
                      shard_id: Optional[Union[int, str]] = None) -> None:
        default_weight_loader(param, loaded_weight, shard_id)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.apply_linear(x)


class ColumnParallelLinear(LinearBase):
    """Y = X A with A split by columns (out_features); optionally all-gather Y to full width."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False,
                 gather_output: bool = False) -> None:
        super().__init__(input_size, divide(output_size, get_tp_world_size()), bias)
        self.gather_output = gather_output

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor,
                      shard_id: Optional[Union[int, str]] = None) -> None:
        assert shard_id is None, shard_id
        size = param.shape[0]
        src = shard(loaded_weight, 0, size * self.tp_size, self.tp_rank, size)
        copy_rows(param, src) if param is self.weight else copy_checked(param.data, src)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.apply_linear(x)
        return tensor_model_parallel_all_gather(y, dim=-1) if self.gather_output else y

    def _copy_part(self, param: nn.Parameter, offset: int, size: int, src: object) -> None:
        """One fused part's rows (a bias's too)."""
        if param is self.weight:
            copy_rows(param, src, offset)
        else:
            copy_checked(param.data.narrow(0, offset, size), src)


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel matrices with the same input, fused (gate_proj | up_proj).

    Each rank's weight is [shard of output 0 | shard of output 1 | ...]; shard_id is the index
    of the checkpoint tensor in `output_sizes`.
    """

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool = False) -> None:
        self.output_sizes = list(output_sizes)
        super().__init__(input_size, sum(output_sizes), bias)
        for size in self.output_sizes:
            divide(size, self.tp_size)

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor,
                      shard_id: Optional[Union[int, str]] = None) -> None:
        if not isinstance(shard_id, int) or not 0 <= shard_id < len(self.output_sizes):
            raise ValueError(f"MergedColumnParallelLinear needs shard_id in "
                             f"[0, {len(self.output_sizes)}), got {shard_id!r}.")
        offset = sum(self.output_sizes[:shard_id]) // self.tp_size
        size = self.output_sizes[shard_id] // self.tp_size
        self._copy_part(param, offset, size,
                        shard(loaded_weight, 0, self.output_sizes[shard_id], self.tp_rank, size))


class QKVParallelLinear(ColumnParallelLinear):
    """Fused q, k, v projections, split by heads.

    Rank r holds q heads [r*Hq, (r+1)*Hq) and its k/v heads. When tp_size > total KV heads,
    each KV head is replicated on tp_size / total_num_kv_heads consecutive ranks.
    """

    def __init__(self, hidden_size: int, head_size: int, total_num_heads: int,
                 total_num_kv_heads: Optional[int] = None, bias: bool = False) -> None:
        tp_size = get_tp_world_size()
        total_num_kv_heads = total_num_kv_heads or total_num_heads
        self.head_size = head_size
        self.total_num_heads, self.total_num_kv_heads = total_num_heads, total_num_kv_heads
        self.num_heads = divide(total_num_heads, tp_size)
        if tp_size >= total_num_kv_heads:
            self.num_kv_heads = 1
            self.num_kv_head_replicas = divide(tp_size, total_num_kv_heads)
        else:
            self.num_kv_heads = divide(total_num_kv_heads, tp_size)
            self.num_kv_head_replicas = 1
        # Sized so that ColumnParallelLinear's split gives exactly this rank's heads.
        output_size = (self.num_heads + 2 * self.num_kv_heads) * tp_size * head_size
        super().__init__(hidden_size, output_size, bias)
        self.q_size = self.num_heads * head_size
        self.kv_size = self.num_kv_heads * head_size

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor,
                      shard_id: Optional[Union[int, str]] = None) -> None:
        if shard_id == "q":
            offset, size, total_heads = 0, self.q_size, self.total_num_heads
            shard_rank = self.tp_rank
        elif shard_id in ("k", "v"):
            offset = self.q_size + (self.kv_size if shard_id == "v" else 0)
            size, total_heads = self.kv_size, self.total_num_kv_heads
            shard_rank = self.tp_rank // self.num_kv_head_replicas
        else:
            raise ValueError(f"QKVParallelLinear needs shard_id 'q', 'k' or 'v', got {shard_id!r}.")
        self._copy_part(param, offset, size,
                        shard(loaded_weight, 0, total_heads * self.head_size, shard_rank, size))


class RowParallelLinear(LinearBase):
    """Y = X A with A split by rows (in_features); X arrives already split; Y is all-reduced."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False) -> None:
        super().__init__(divide(input_size, get_tp_world_size()), output_size, bias)

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor,
                      shard_id: Optional[Union[int, str]] = None) -> None:
        assert shard_id is None, shard_id
        if param is self.bias:     # the bias is added once, after the reduction
            copy_checked(param.data, loaded_weight)
            return
        size = param.shape[1]
        copy_rows(param, shard(loaded_weight, 1, size * self.tp_size, self.tp_rank, size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return self.apply_linear(x)
        y = tensor_model_parallel_all_reduce(self.apply_linear(x, with_bias=False))
        return y + self.bias if self.bias is not None else y

    def forward_silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        """forward(silu_and_mul(x)), x [T, 2 * input_size] (a gated MLP's down projection):
        one kernel where ops.fused.silu_and_mul_linear takes the step (CUDA, batch 1, a
        plain weight, no LoRA), else the two ops."""
        y = None
        if x.is_cuda and self.lora is None and type(self.linear_weight) is CpuLinearWeight:
            y = fused_ops.silu_and_mul_linear(x, self.weight)
        if y is None:
            return self(fused_ops.silu_and_mul(x))
        if self.tp_size > 1:
            y = tensor_model_parallel_all_reduce(y)
        return y + self.bias if self.bias is not None else y
