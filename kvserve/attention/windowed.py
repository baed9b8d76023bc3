"""Paged attention in plain torch with a sliding window and logit softcapping (Gemma 2/3,
Mistral's windowed checkpoints): the path every backend routes such layers to.

A query at position p reads keys at positions (p - window, p] (transformers' sliding mask:
`kv_idx > q_idx - sliding_window`), all of (0, p] without a window. Softcapping bends each
scaled score s to cap * tanh(s / cap) before the softmax. The C++ kernels and the fused decode
op take neither, and a sliding-window group's table holds the null block where the window let
go, which they would read: windowed layers never reach them.

Decodes are one batched gather of only the window's rows; prefill chunks one masked attention
each (as TORCH_SDPA's fallback), over only the keys their queries' windows reach.
"""
from __future__ import annotations

from typing import Optional

import torch


def _scores_to_probs(scores: torch.Tensor, mask: torch.Tensor, softcap: Optional[float]
                     ) -> torch.Tensor:
    if softcap:
        scores = torch.tanh(scores / softcap) * softcap
    return torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1)


def windowed_decode_attention(q: torch.Tensor, kv_cache: torch.Tensor,
                              block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float,
                              window: Optional[int], softcap: Optional[float]) -> torch.Tensor:
    """q [N, H, D] (one query per sequence, at position seq_len - 1) -> [N, H, D].

    Gathers positions [seq_len - L, seq_len) with L = min(window, longest sequence); positions
    before the window or before 0 are masked and read the last slot instead (always written),
    so stale blocks are never touched."""
    n, h, d = q.shape
    _, nb, bs, hkv, _ = kv_cache.shape
    seq_lens = seq_lens.to(q.device).long()
    longest = int(block_tables.shape[1]) * bs
    span = min(window, longest) if window else longest
    pos = (seq_lens - span)[:, None] + torch.arange(span, device=q.device)[None, :]   # [N, L]
    valid = pos >= 0
    if window:
        valid &= pos > (seq_lens[:, None] - 1 - window)
    pos = torch.where(valid, pos, seq_lens[:, None] - 1)
    slots = block_tables.gather(1, pos // bs) * bs + pos % bs
    rows = slots[:, None, :] * hkv + torch.arange(hkv, device=q.device)[None, :, None]
    flat = kv_cache.view(2, nb * bs * hkv, d)
    keys = flat[0].index_select(0, rows.reshape(-1)).view(n, hkv, span, d)
    values = flat[1].index_select(0, rows.reshape(-1)).view(n, hkv, span, d)
    acc = torch.promote_types(keys.dtype, torch.float32)
    qg = q.reshape(n, hkv, h // hkv, d).to(acc)
    scores = torch.matmul(qg, keys.to(acc).transpose(-1, -2)) * scale           # [N, Hkv, G, L]
    probs = _scores_to_probs(scores, valid[:, None, None, :], softcap)
    out = torch.matmul(probs, values.to(acc))
    return out.reshape(n, h, d).to(q.dtype)


def windowed_prefill_attention(q: torch.Tensor, kv_cache: torch.Tensor,
                               query_starts: torch.Tensor, query_lens: torch.Tensor,
                               context_lens: torch.Tensor, block_tables: torch.Tensor,
                               scale: float, window: Optional[int], softcap: Optional[float],
                               out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Each chunk p: queries q[start, start + qlen) at positions ctx + i, keys from the cache
    (the chunk's own already written). Rows of other tokens in `out` are left as they are."""
    if out is None:
        out = torch.zeros_like(q)
    _, _, bs, hkv, d = kv_cache.shape
    h = q.shape[1]
    acc = torch.promote_types(kv_cache.dtype, torch.float32)
    meta = zip(query_starts.tolist(), query_lens.tolist(), context_lens.tolist())
    for p, (start, qlen, ctx) in enumerate(meta):
        if qlen == 0:
            continue
        total = ctx + qlen
        first = max(0, ctx - window + 1) if window else 0       # oldest key any query reads
        first_block = first // bs
        blocks = block_tables[p, first_block:(total + bs - 1) // bs]
        base = first_block * bs
        keys = kv_cache[0][blocks].flatten(0, 1)[first - base:total - base]     # [K, Hkv, D]
        values = kv_cache[1][blocks].flatten(0, 1)[first - base:total - base]
        pos_q = torch.arange(ctx, total, device=q.device)[:, None]
        pos_k = torch.arange(first, total, device=q.device)[None, :]
        mask = pos_k <= pos_q
        if window:
            mask &= pos_k > pos_q - window
        qg = q[start:start + qlen].to(acc).view(qlen, hkv, h // hkv, d).permute(1, 2, 0, 3)
        kt = keys.to(acc).permute(1, 2, 0)[:, None]                           # [Hkv, 1, D, K]
        scores = torch.matmul(qg, kt) * scale                                   # [Hkv, G, Q, K]
        probs = _scores_to_probs(scores, mask, softcap)
        o = torch.matmul(probs, values.to(acc).transpose(0, 1)[:, None])        # [Hkv, G, Q, D]
        out[start:start + qlen] = o.permute(2, 0, 1, 3).reshape(qlen, h, d).to(out.dtype)
    return out
