"""Sliding-window and soft-capped attention through every backend against a float64 dense
reference: decodes and prefill chunks with cached context in one step, and every block wholly
outside a query's window replaced by a NaN-filled block (the hybrid KV cache's null block), so
reading anything outside the window shows."""
from __future__ import annotations

import math
from typing import Optional

import numpy as np
import pytest
import torch

from kvserve.attention import CommonAttentionMetadata, get_attn_backend
from kvserve.model.layers.attention import Attention, bind_attention_backend

BS, H, HKV, D = 16, 4, 2, 16
# (context, query) per request: two decodes, then prefill chunks with and without context.
REQS = [(40, 1), (7, 1), (35, 20), (0, 30)]


def _reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ctx: int, window: Optional[int],
               softcap: Optional[float], scale: float) -> torch.Tensor:
    """q [Q, H, D] at positions ctx.., k/v [ctx + Q, Hkv, D]; float64."""
    out = torch.empty(q.shape, dtype=torch.float64)
    g = H // HKV
    for i in range(q.shape[0]):
        p = ctx + i
        lo = max(0, p - window + 1) if window else 0
        for h in range(H):
            s = (k[lo:p + 1, h // g].double() @ q[i, h].double()) * scale
            if softcap:
                s = torch.tanh(s / softcap) * softcap
            out[i, h] = torch.softmax(s, 0) @ v[lo:p + 1, h // g].double()
    return out


@pytest.mark.parametrize("backend_name", ["CPU_ATTN", "TORCH_SDPA", "TRITON_ATTN"])
@pytest.mark.parametrize("window,softcap", [(5, None), (20, 7.0)])
def test_windowed_attention_matches_reference(backend_name: str, window: Optional[int],
                                              softcap: Optional[float]) -> None:
    torch.manual_seed(0)
    # TRITON_ATTN runs on the GPU where there is one (its kernels take no CPU tensors then).
    dev = torch.device("cuda" if backend_name == "TRITON_ATTN" and torch.cuda.is_available()
                       else "cpu")
    backend = get_attn_backend(backend_name, dev)
    layer = Attention(H, D, HKV, sliding_window=window, logits_soft_cap=softcap)
    bind_attention_backend(torch.nn.Sequential(layer), backend)
    max_blocks = max(math.ceil((c + n) / BS) for c, n in REQS)
    num_blocks = 1 + len(REQS) * max_blocks
    kv_cache = torch.zeros(2, num_blocks, BS, HKV, D)
    kv_cache[:, 0] = float("nan")                       # the null block
    table = np.zeros((len(REQS), max_blocks), dtype=np.int64)
    qs, ks, vs, slots, refs = [], [], [], [], []
    for r, (ctx, n) in enumerate(REQS):
        total = ctx + n
        k, v, q = torch.randn(total, HKV, D), torch.randn(total, HKV, D), torch.randn(n, H, D)
        blocks = 1 + r * max_blocks + np.arange(max_blocks)
        first = (max(0, ctx - window + 1) if window else 0) // BS
        table[r] = blocks
        table[r, :first] = 0                            # outside every query's window
        for p in range(ctx):                            # the cached context
            kv_cache[0, table[r, p // BS], p % BS] = k[p]
            kv_cache[1, table[r, p // BS], p % BS] = v[p]
        pos = np.arange(ctx, total)
        slots.append(table[r, pos // BS] * BS + pos % BS)
        qs.append(q), ks.append(k[ctx:]), vs.append(v[ctx:])
        refs.append(_reference(q, k, v, ctx, window, softcap, layer.scale))
    qlens = np.array([n for _, n in REQS])
    common = CommonAttentionMetadata(
        num_decodes=2, query_starts=np.cumsum(qlens) - qlens, query_lens=qlens,
        context_lens=np.array([c for c, _ in REQS]), block_table=table,
        slot_mapping=np.concatenate(slots), block_size=BS)
    meta = backend.build_metadata(common)
    T = int(qlens.sum())
    out = layer(torch.cat(qs).view(T, H * D).to(dev), torch.cat(ks).view(T, HKV * D).to(dev),
                torch.cat(vs).view(T, HKV * D).to(dev), kv_cache.to(dev), meta).view(T, H, D)
    out, want = out.cpu(), torch.cat(refs)
    assert torch.isfinite(out).all(), "read a block outside the window"
    torch.testing.assert_close(out.double(), want, atol=2e-5, rtol=1e-5)
