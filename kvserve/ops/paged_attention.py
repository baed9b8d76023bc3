"""Paged decode attention: each sequence's one new query token against its paged KV cache.

    q             [N, H, D]            one query token per sequence
    kv_cache      [2, NB, BS, Hkv, D]  K = kv_cache[0], V = kv_cache[1]
    block_tables  [N, MB] int64        padded; row n's first ceil(seq_lens[n] / BS) ids are used
    seq_lens      [N] int64            tokens to attend to (including the new one), >= 1
    -> out        [N, H, D]            same dtype as q

Query head h reads kv head h // (H // Hkv), as Hugging Face's `repeat_kv` does.

Two implementations:
- a C++ CPU kernel (csrc/paged_attention.cpp), compiled on first use for the machine that runs
  it: one pass over each sequence's blocks with an online softmax, K/V read in place;
- a pure-torch path (gather + batched matmul) used on CUDA, for other dtypes, when the C++
  build fails, or when KVSERVE_DISABLE_CPU_KERNELS=1. It is also the reference the kernel
  is benchmarked against.
"""
from __future__ import annotations

import torch

from kvserve.ops.build import DISABLE_ENV, CpuKernel  # noqa: F401 (DISABLE_ENV: re-exported)

_KERNEL = CpuKernel("paged_attention.cpp", op="paged_decode_attention",
                    isa_op="paged_attention_isa", what="paged decode attention",
                    fallback="the torch implementation")
cpu_kernel, cpu_kernel_isa, _load_cpu_kernel = _KERNEL.get, _KERNEL.isa, _KERNEL.load


def paged_decode_attention(q: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor,
                           seq_lens: torch.Tensor, scale: float) -> torch.Tensor:
    """Decode attention over a paged KV cache (see the module docstring for shapes)."""
    out = _KERNEL.run_attention(q, kv_cache, block_tables, seq_lens, float(scale))
    return out if out is not None else paged_decode_attention_torch(q, kv_cache, block_tables,
                                                                    seq_lens, scale)


def paged_decode_attention_torch(q: torch.Tensor, kv_cache: torch.Tensor,
                                 block_tables: torch.Tensor, seq_lens: torch.Tensor,
                                 scale: float) -> torch.Tensor:
    """Pure-torch version: gather each sequence's K/V rows, then batched matmuls.

    The rows are gathered straight into kv-head-major order ([N, Hkv, L, D], one index_select
    per K and V): batched matmuls over the strided [N, L, Hkv, D] layout ran 5-10x slower on
    CPU, and a separate permute copy cost as much as the gather. Slots past seq_len (including
    padded table entries) may hold anything, NaN too, and 0 * NaN = NaN: they are pointed at
    the sequence's first slot (valid whenever seq_len >= 1) and their scores masked, instead
    of zeroing the gathered values in another pass."""
    n, h, d = q.shape
    _, nb, bs, hkv, _ = kv_cache.shape
    g = h // hkv
    pos = torch.arange(block_tables.shape[1] * bs, device=q.device)            # [L]
    valid = pos[None, :] < seq_lens.to(q.device)[:, None]                        # [N, L]
    slots = block_tables[:, pos // bs] * bs + pos % bs                           # [N, L]
    slots = torch.where(valid, slots, slots[:, :1])
    # Row (slot, kv head) of the cache seen as [NB * BS * Hkv, D], in (n, kv head, l) order.
    rows = slots[:, None, :] * hkv + torch.arange(hkv, device=q.device)[None, :, None]
    flat = kv_cache.view(2, nb * bs * hkv, d)
    keys = flat[0].index_select(0, rows.view(-1)).view(n, hkv, -1, d)           # [N, Hkv, L, D]
    values = flat[1].index_select(0, rows.view(-1)).view(n, hkv, -1, d)
    qg = q.reshape(n, hkv, g, d).to(keys.dtype)                                 # [N, Hkv, G, D]
    acc_dtype = torch.promote_types(keys.dtype, torch.float32)   # float64 stays float64
    scores = torch.matmul(qg, keys.transpose(-1, -2)).to(acc_dtype)             # [N, Hkv, G, L]
    scores.mul_(scale).masked_fill_(~valid[:, None, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1).to(values.dtype)
    out = torch.matmul(probs, values)                                            # [N, Hkv, G, D]
    return out.reshape(n, h, d).to(q.dtype)
