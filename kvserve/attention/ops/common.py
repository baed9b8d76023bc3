"""Small helpers shared by the Triton kernels' Python wrappers."""
from __future__ import annotations

import torch

from kvserve.ops.triton import interpreting

SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def next_pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


def dot_in_fp32(dtype: torch.dtype) -> bool:
    """tl.dot operands are widened to float32 (IEEE products) for float32 models, and always
    under the interpreter: there tl.dot on bfloat16 inputs returned wrong values (float32 was
    exact). On a GPU, 16-bit operands go to the tensor cores as they are."""
    return dtype == torch.float32 or interpreting()


def check_kv_cache(kv_cache: torch.Tensor, num_kv_heads: int, head_dim: int, what: str) -> None:
    if kv_cache.dim() != 5 or kv_cache.shape[0] != 2:
        raise ValueError(f"{what}: kv_cache must be [2, num_blocks, block_size, num_kv_heads, "
                         f"head_dim], got {tuple(kv_cache.shape)}")
    if kv_cache.shape[3] != num_kv_heads or kv_cache.shape[4] != head_dim:
        raise ValueError(f"{what}: kv_cache heads/head_dim {tuple(kv_cache.shape[3:])} differ "
                         f"from ({num_kv_heads}, {head_dim})")
    if kv_cache.stride(4) != 1:
        raise ValueError(f"{what}: kv_cache's last dim must be contiguous")
    if kv_cache.dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"{what}: unsupported dtype {kv_cache.dtype}")
    if kv_cache.shape[2] not in (16, 32, 64):
        raise ValueError(f"{what}: block_size {kv_cache.shape[2]} not in (16, 32, 64)")
