"""The TRITON_ATTN kernels against a float64 torch reference (on CPU: Triton's interpreter).

Every case uses a paged cache with shuffled block ids whose unused slots, unused blocks and
padded table entries all hold NaN: a kernel that reads anything it should not gives NaN.
bfloat16 / float16: the inputs are rounded to the dtype, the reference computes in float64 on
those rounded values; the kernels accumulate in float32 and round the output once (under the
interpreter tl.dot runs on float32 copies of the 16-bit operands; on a GPU on the tensor
cores), so they must agree to a few 16-bit ulps.
"""
from __future__ import annotations

import pytest
import torch

TOL = {torch.float32: 2e-5, torch.bfloat16: 2e-2, torch.float16: 4e-3}
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
IDS = ["f32", "bf16", "f16"]


def make_paged(seq_lens: list[int], hkv: int, d: int, bs: int, dtype: torch.dtype,
               device: torch.device, seed: int):
    """A NaN-poisoned cache holding random K/V for each sequence, tables over shuffled ids
    (padded with the id of an all-NaN block), and the dense [len, Hkv, D] K/V per sequence."""
    gen = torch.Generator().manual_seed(seed)
    used = [-(-n // bs) for n in seq_lens]
    nb = sum(used) + 3
    cache = torch.full((2, nb, bs, hkv, d), float("nan"), dtype=dtype)
    ids = torch.randperm(nb, generator=gen)
    nan_block = int(ids[-1])
    width = max(used) + 1
    tables = torch.full((len(seq_lens), width), nan_block, dtype=torch.int32)
    dense, k = [], 0
    for r, n in enumerate(seq_lens):
        blocks = ids[k:k + used[r]]
        k += used[r]
        tables[r, :used[r]] = blocks.to(torch.int32)
        kv = torch.randn(2, n, hkv, d, generator=gen).to(dtype)
        pos = torch.arange(n)
        cache[:, blocks[pos // bs], pos % bs] = kv
        dense.append(kv)
    return cache.to(device), tables.to(device), dense


def reference(q: torch.Tensor, dense: list[torch.Tensor], ctxs: list[int], qlens: list[int],
              scale: float) -> torch.Tensor:
    """float64 attention: query i of request r sees keys 0 .. ctx_r + i."""
    out, t = torch.zeros(q.shape, dtype=torch.float64), 0
    h = q.shape[1]
    for kv, ctx, n in zip(dense, ctxs, qlens):
        k, v = (x.double().repeat_interleave(h // x.shape[1], dim=1) for x in kv)
        s = torch.einsum("qhd,khd->hqk", q[t:t + n].double().cpu(), k) * scale
        visible = torch.arange(ctx + n)[None, :] <= (ctx + torch.arange(n))[:, None]
        s = s.masked_fill(~visible, float("-inf"))
        out[t:t + n] = torch.einsum("hqk,khd->qhd", torch.softmax(s, -1), v)
        t += n
    return out


def check(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> None:
    assert not torch.isnan(out).any()
    err = (out.double().cpu() - ref).abs().max().item()
    assert err <= TOL[dtype] * max(1.0, ref.abs().max().item()), err


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
@pytest.mark.parametrize("bs", [16, 32])
def test_unified_attention(device, bs: int, dtype: torch.dtype) -> None:
    """Decode rows first, then prefill chunks with and without cached context (a context
    crossing blocks; a 150-query chunk after 50 cached keys: several query blocks, key tiles
    spanning several cache blocks, causal edges inside a tile), GQA with 3 heads per kv head."""
    from kvserve.attention.ops.unified_attention import unified_attention

    ctxs, qlens = [9, 40, 0, 33, 0, 50], [1, 1, 21, 7, 3, 150]
    hkv, groups, d = 2, 3, 32
    seq_lens = [c + n for c, n in zip(ctxs, qlens)]
    cache, tables, dense = make_paged(seq_lens, hkv, d, bs, dtype, device, seed=bs)
    q = torch.randn(sum(qlens), hkv * groups, d, generator=torch.Generator().manual_seed(1))
    q = q.to(dtype).to(device)
    qsl = torch.tensor([0] + qlens, dtype=torch.int32).cumsum(0, dtype=torch.int32)
    out = unified_attention(q, cache, qsl.to(device), torch.tensor(seq_lens, dtype=torch.int32,
                            device=device), tables, 0.17)
    assert out.dtype == dtype
    check(out, reference(q, dense, ctxs, qlens, 0.17), dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
@pytest.mark.parametrize("bs", [16, 32])
def test_split_kv_decode(device, bs: int, dtype: torch.dtype) -> None:
    """Ragged contexts (one shorter than a block, one spanning several) with 1 and 5 splits
    (more splits than some sequences have blocks: empty splits), and a padding row (seq 0)."""
    from kvserve.attention.ops.decode_attention import split_kv_decode_attention

    seq_lens = [5, 70, 33, 1]
    hkv, groups, d = 2, 2, 16
    cache, tables, dense = make_paged(seq_lens, hkv, d, bs, dtype, device, seed=7)
    q = torch.randn(len(seq_lens) + 1, hkv * groups, d,
                    generator=torch.Generator().manual_seed(2)).to(dtype).to(device)
    tables = torch.cat([tables, tables[:1]])                      # the padding row's table
    lens = torch.tensor(seq_lens + [0], dtype=torch.int32, device=device)
    q2 = (q.float().flip(0) * 1.5).to(dtype)       # another query: stale partials show
    refs = [reference(x[:-1], dense, [n - 1 for n in seq_lens], [1] * len(seq_lens), 0.25)
            for x in (q, q2)]
    # 5 splits merged by a second kernel, then by the last split of each (request, kv head):
    # twice, so the second launch reads counters the first reset (graph replays rely on it).
    for i, (splits, fused_merge) in enumerate(((1, True), (5, False), (5, True), (5, True))):
        out = split_kv_decode_attention((q, q2)[i % 2], cache, lens, tables, 0.25, splits,
                                        fused_merge=fused_merge)
        check(out[:-1], refs[i % 2], dtype)
        assert (out[-1] == 0).all()
    from kvserve.ops.triton.counters import counters_at_rest
    assert counters_at_rest("split_kv_decode", q.device), "a merge left its arrival counter set"


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
def test_reshape_and_cache(device, dtype: torch.dtype) -> None:
    """Rows land at their slots (shuffled, across blocks); slot -1 rows and every other slot
    are left alone; strided k/v (column slices of one qkv tensor, as in the model) work."""
    from kvserve.attention.ops.reshape_and_cache import reshape_and_cache

    hkv, d, bs, nb = 2, 16, 16, 5
    cache = torch.full((2, nb, bs, hkv, d), float("nan"), dtype=dtype, device=device)
    qkv = torch.randn(6, 3 * hkv * d, generator=torch.Generator().manual_seed(3)).to(dtype)
    qkv = qkv.to(device)
    k = qkv[:, hkv * d:2 * hkv * d].view(6, hkv, d)
    v = qkv[:, 2 * hkv * d:].view(6, hkv, d)
    slots = torch.tensor([70, 3, -1, 16, 79, 31], device=device)
    reshape_and_cache(k, v, cache, slots)
    flat = cache.view(2, nb * bs, hkv, d).cpu()
    written = torch.zeros(nb * bs, dtype=torch.bool)
    for t, s in enumerate(slots.tolist()):
        if s >= 0:
            assert torch.equal(flat[0, s], k[t].cpu()) and torch.equal(flat[1, s], v[t].cpu())
            written[s] = True
    assert torch.isnan(flat[:, ~written]).all()


def test_bad_inputs_are_value_errors(device) -> None:
    from kvserve.attention.ops.unified_attention import unified_attention

    cache = torch.zeros(2, 4, 8, 2, 16, device=device)               # block size 8: no
    q = torch.zeros(3, 4, 16, device=device)
    qsl = torch.tensor([0, 3], dtype=torch.int32, device=device)
    lens = torch.tensor([3], dtype=torch.int32, device=device)
    table = torch.zeros(1, 1, dtype=torch.int32, device=device)
    with pytest.raises(ValueError, match="block_size 8"):
        unified_attention(q, cache, qsl, lens, table, 1.0)
    cache = torch.zeros(2, 4, 16, 2, 16, device=device)
    with pytest.raises(ValueError, match="disagree"):
        unified_attention(q, cache, qsl, lens, table[:0], 1.0)
