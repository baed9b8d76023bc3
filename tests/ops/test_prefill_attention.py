"""Paged prefill attention: the C++ CPU kernel and the torch fallback against a float32 reference.

Every case fills what a chunk must not see with NaN: blocks no chunk owns (which padded
block-table entries point to), the slots past context + query_len in each chunk's last block,
and the decode rows of q (which come first and belong to no chunk). One NaN read anywhere
shows up in the output.
"""
from __future__ import annotations

import os
import shutil
from typing import Callable

import pytest
import torch

from kvserve.ops import cpu_isa
from kvserve.ops import prefill_attention as pf
from kvserve.ops.build import DISABLE_ENV
from tests.utils import kernel_isa_prefix, scattered_paged_cache

HAS_COMPILER = shutil.which(os.environ.get("CXX", "c++")) is not None
needs_compiler = pytest.mark.skipif(not HAS_COMPILER, reason="no C++ compiler")

TOLERANCES = {torch.float32: dict(atol=1e-5, rtol=1e-5),
              # the output is rounded to bfloat16 (8 bits), and P V uses bfloat16 probabilities
              torch.bfloat16: dict(atol=2e-2, rtol=2e-2)}

Chunks = list[tuple[int, int]]      # (context_len, query_len) per chunk
NUM_DECODES = 3


def reference(q: torch.Tensor, kv_cache: torch.Tensor, starts: torch.Tensor,
              lens: torch.Tensor, ctxs: torch.Tensor, tables: torch.Tensor,
              scale: float) -> torch.Tensor:
    """Per chunk: gather its keys, repeat_kv, plain masked softmax attention in float32."""
    _, _, bs, hkv, _ = kv_cache.shape
    groups = q.shape[1] // hkv
    out = torch.zeros(q.shape, dtype=torch.float32)
    for p, (start, qlen, ctx) in enumerate(zip(starts.tolist(), lens.tolist(), ctxs.tolist())):
        total = ctx + qlen
        blocks = tables[p, :(total + bs - 1) // bs]
        k = kv_cache[0][blocks].flatten(0, 1)[:total].float().repeat_interleave(groups, dim=1)
        v = kv_cache[1][blocks].flatten(0, 1)[:total].float().repeat_interleave(groups, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q[start:start + qlen].float(), k) * scale
        visible = torch.arange(total)[None, :] <= torch.arange(ctx, total)[:, None]
        probs = torch.softmax(scores.masked_fill(~visible, float("-inf")), dim=-1)
        out[start:start + qlen] = torch.einsum("hqk,khd->qhd", probs, v)
    return out


def make_case(chunks: Chunks, num_kv_heads: int, groups: int, head_dim: int, block_size: int,
              dtype: torch.dtype, pad_blocks: int = 2, seed: int = 0
              ) -> tuple[torch.Tensor, ...]:
    """q, kv_cache, query_starts, query_lens, context_lens, block_tables (shuffled block ids,
    padded with blocks nobody owns)."""
    gen = torch.Generator().manual_seed(seed)
    kv_cache, tables = scattered_paged_cache([c + n for c, n in chunks], num_kv_heads, head_dim,
                                             block_size, dtype, pad_blocks, gen)
    lens = [n for _, n in chunks]
    starts = [NUM_DECODES + sum(lens[:p]) for p in range(len(chunks))]
    q = torch.randn(NUM_DECODES + sum(lens), num_kv_heads * groups, head_dim,
                    generator=gen).to(dtype)
    q[:NUM_DECODES] = float("nan")                      # decode rows: never read
    return (q, kv_cache, torch.tensor(starts), torch.tensor(lens),
            torch.tensor([c for c, _ in chunks]), tables)


def chunk_rows(starts: torch.Tensor, lens: torch.Tensor) -> torch.Tensor:
    return torch.cat([torch.arange(s, s + n) for s, n in zip(starts.tolist(), lens.tolist())])


def check(fn: Callable[..., torch.Tensor], chunks: Chunks, num_kv_heads: int, groups: int,
          head_dim: int, block_size: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    case = make_case(chunks, num_kv_heads, groups, head_dim, block_size, dtype, seed=seed)
    scale = head_dim ** -0.5
    out = fn(*case, scale)
    q = case[0]
    assert out.shape == q.shape and out.dtype == q.dtype
    rows = chunk_rows(case[2], case[3])
    assert torch.isfinite(out[rows]).all()
    torch.testing.assert_close(out[rows].float(), reference(*case, scale)[rows],
                               **TOLERANCES[dtype])
    return out


def ragged_chunks(block_size: int) -> Chunks:
    # No context and with context; lengths and contexts off the 32-lane / 64-key tiles and off
    # the block size; a single token; a context that ends exactly on a block boundary.
    return [(0, 37), (20, 1), (33, 70), (0, 1), (2 * block_size, block_size), (70, 150),
            (5, 3)]


@pytest.fixture(scope="module")
def kernel() -> Callable[..., torch.Tensor]:
    op = pf._load_cpu_kernel()       # the compiled op itself, whatever the environment says
    assert op is not None, "the C++ kernel failed to build (see the log)"
    return op


SHAPES = [pytest.param(4, 1, id="mha"), pytest.param(2, 4, id="gqa4"),
          pytest.param(2, 3, id="gqa3")]


@needs_compiler
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("num_kv_heads,groups", SHAPES)
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("block_size", [16, 32])
def test_kernel_matches_reference(kernel, dtype, num_kv_heads, groups, head_dim, block_size):
    out = check(kernel, ragged_chunks(block_size), num_kv_heads, groups, head_dim, block_size,
                dtype)
    assert (out[:NUM_DECODES] == 0).all()          # rows of no chunk are zero, not NaN


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("num_kv_heads,groups", SHAPES)
@pytest.mark.parametrize("block_size", [16, 32])
def test_torch_fallback_matches_reference(dtype, num_kv_heads, groups, block_size):
    check(pf.paged_prefill_attention_torch, ragged_chunks(block_size), num_kv_heads, groups,
          64, block_size, dtype)


@needs_compiler
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("head_dim,block_size", [(32, 16), (96, 8), (256, 16), (48, 16),
                                                 (80, 5), (64, 1)])
def test_kernel_other_shapes(kernel, dtype, head_dim, block_size):
    """Other vector widths (32, 96, 256), head dims without one (portable loops), odd blocks."""
    check(kernel, [(0, 9), (7, 33), (40, 2)], 2, 3, head_dim, block_size, dtype)


@needs_compiler
def test_kernel_uses_the_selected_tier(kernel):
    isa = torch.ops.kvserve.paged_prefill_attention_isa()
    assert isa.startswith(kernel_isa_prefix()), isa
    if cpu_isa.selected_tier() == "avx512_bf16":
        assert isa == "avx512 (f32 fma, bf16 dpbf16)"


@needs_compiler
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_kernel_many_chunks_and_thread_counts(kernel, dtype):
    """Enough work items for every thread; the result must not depend on the split."""
    gen = torch.Generator().manual_seed(3)
    lens = torch.randint(1, 120, (12,), generator=gen).tolist()
    ctxs = torch.randint(0, 100, (12,), generator=gen).tolist()
    case = make_case(list(zip(ctxs, lens)), 3, 2, 64, 16, dtype, seed=3)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = kernel(*case, 0.125)
        torch.set_num_threads(2)
        two = kernel(*case, 0.125)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, two)
    rows = chunk_rows(case[2], case[3])
    torch.testing.assert_close(one[rows].float(), reference(*case, 0.125)[rows],
                               **TOLERANCES[dtype])


@needs_compiler
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_kernel_matches_fallback(kernel, dtype):
    """The kernel against the SDPA loop it replaces (the path CUDA and disabled runs take)."""
    case = make_case(ragged_chunks(16), 2, 2, 64, 16, dtype, seed=5)
    out = kernel(*case, 0.125)
    ref = pf.paged_prefill_attention_torch(*case, 0.125)
    assert (ref[:NUM_DECODES] == 0).all()
    rows = chunk_rows(case[2], case[3])
    torch.testing.assert_close(out[rows].float(), ref[rows].float(), **TOLERANCES[dtype])


@needs_compiler
def test_kernel_strided_query_and_chunk_order(kernel):
    """q as a strided view; chunks listed out of row order, with gaps between them."""
    q, kv_cache, starts, lens, ctxs, tables = make_case([(0, 20), (9, 40), (0, 3)], 2, 2, 64,
                                                        16, torch.float32)
    wide = torch.full((q.shape[0] + 4, 4, 2, 64), float("nan"))
    wide[:q.shape[0], :, 0] = q
    qs = wide[:, :, 0]                                   # head stride 128, and 4 extra rows
    assert not qs.is_contiguous()
    order = torch.tensor([2, 0, 1])
    starts, lens, ctxs, tables = starts[order], lens[order], ctxs[order], tables[order]
    starts[0] += 4                             # the last rows' chunk moves 4 rows down
    qs[starts[0]:starts[0] + lens[0]] = q[starts[0] - 4:starts[0] - 4 + lens[0]]
    out = kernel(qs, kv_cache, starts, lens, ctxs, tables, 0.125)
    rows = chunk_rows(starts, lens)
    torch.testing.assert_close(out[rows], reference(qs, kv_cache, starts, lens, ctxs, tables,
                                                    0.125)[rows], atol=1e-5, rtol=1e-5)
    gaps = torch.ones(qs.shape[0], dtype=torch.bool)
    gaps[rows] = False
    assert (out[gaps] == 0).all()


@needs_compiler
def test_kernel_no_chunks_and_empty_chunk(kernel):
    q, kv_cache, starts, lens, ctxs, tables = make_case([(4, 6)], 2, 1, 64, 16, torch.float32)
    none = torch.zeros(0, dtype=torch.int64)
    out = kernel(q, kv_cache, none, none, none, tables[:0], 0.125)
    assert out.shape == q.shape and (out == 0).all()
    # A chunk with no queries contributes nothing (and reads nothing).
    out = kernel(q, kv_cache, torch.cat([starts, starts + 6]), torch.cat([lens, lens * 0]),
                 torch.cat([ctxs, ctxs]), torch.cat([tables, tables]), 0.125)
    rows = chunk_rows(starts, lens)
    torch.testing.assert_close(out[rows], reference(q, kv_cache, starts, lens, ctxs, tables,
                                                    0.125)[rows], atol=1e-5, rtol=1e-5)


@needs_compiler
def test_kernel_rejects_bad_inputs(kernel):
    q, kv_cache, starts, lens, ctxs, tables = make_case([(5, 20), (0, 7)], 2, 1, 32, 16,
                                                        torch.float32)
    bad = tables.clone()
    bad[0, 1] = kv_cache.shape[1]                        # read, and out of range
    with pytest.raises(RuntimeError, match="out of range"):
        kernel(q, kv_cache, starts, lens, ctxs, bad, 0.1)
    with pytest.raises(RuntimeError, match="do not fit in"):
        kernel(q, kv_cache, starts, lens, ctxs, tables[:, :1], 0.1)
    with pytest.raises(RuntimeError, match="two chunks"):
        kernel(q, kv_cache, starts - torch.tensor([0, 1]), lens, ctxs, tables, 0.1)
    with pytest.raises(RuntimeError, match="rows"):
        kernel(q, kv_cache, starts + 1, lens, ctxs, tables, 0.1)
    with pytest.raises(RuntimeError, match="dtypes differ"):
        kernel(q.double(), kv_cache, starts, lens, ctxs, tables, 0.1)


@needs_compiler
def test_dispatch_uses_kernel_and_casts_query(kernel, monkeypatch):
    monkeypatch.delenv(DISABLE_ENV, raising=False)
    assert pf.cpu_kernel() is kernel
    case = make_case([(3, 17), (0, 5)], 2, 2, 64, 16, torch.bfloat16)
    q32 = case[0].float()                                # float32 queries, bfloat16 cache
    out = pf.paged_prefill_attention(q32, *case[1:], 0.125)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, kernel(*case, 0.125).float())


def test_env_var_forces_torch_path(monkeypatch):
    monkeypatch.setenv(DISABLE_ENV, "1")
    assert pf.cpu_kernel() is None
    case = make_case(ragged_chunks(16), 2, 2, 64, 16, torch.float32)
    assert torch.equal(pf.paged_prefill_attention(*case, 0.125),
                       pf.paged_prefill_attention_torch(*case, 0.125))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_torch_fallback_matches_attention_layer(dtype):
    """The Attention layer (which writes the chunks' K/V and calls paged_prefill_attention)
    gives what the per-chunk SDPA fallback gives."""
    from kvserve.attention.backends.cpu import AttentionMetadata, CpuAttentionBackend
    from kvserve.model.layers.attention import Attention

    chunks, bs, hkv, groups, d = [(0, 37), (20, 9), (0, 5), (33, 40)], 16, 2, 3, 64
    q, kv_cache, starts, lens, ctxs, tables = make_case(chunks, hkv, groups, d, bs, dtype)
    q = q[NUM_DECODES:]                                  # no decode rows: the layer has none
    starts = starts - NUM_DECODES
    # The chunks' new K/V, as the layer gets them (already in the cache at those slots).
    pos = [torch.arange(c, c + n) for c, n in chunks]
    slots = torch.cat([tables[p, x // bs] * bs + x % bs for p, x in enumerate(pos)])
    flat = kv_cache.view(2, -1, hkv, d)
    k, v = flat[0][slots], flat[1][slots]
    meta = AttentionMetadata(num_decode_tokens=0, slot_mapping=slots, block_size=bs,
                             prefill_query_starts=starts, prefill_query_lens=lens,
                             prefill_context_lens=ctxs, prefill_block_tables=tables)
    layer = Attention(hkv * groups, d, hkv)
    layer.backend = CpuAttentionBackend(torch.device("cpu"))
    t = q.shape[0]
    expected = layer(q.reshape(t, -1), k.reshape(t, -1), v.reshape(t, -1), kv_cache, meta)
    out = pf.paged_prefill_attention_torch(q, kv_cache, starts, lens, ctxs, tables, layer.scale)
    torch.testing.assert_close(out.reshape(t, -1).float(), expected.float(), **TOLERANCES[dtype])


def test_unsupported_dtype_uses_torch_path():
    case = make_case([(0, 9), (5, 4)], 2, 2, 32, 8, torch.float64)
    out = pf.paged_prefill_attention(*case, 0.2)
    rows = chunk_rows(case[2], case[3])
    torch.testing.assert_close(out[rows].float(), reference(*case, 0.2)[rows], atol=1e-5,
                               rtol=1e-5)


def test_stack_block_tables():
    tables = pf.stack_block_tables([torch.tensor([3, 1]), torch.tensor([5]),
                                    torch.tensor([0, 2, 4])])
    assert tables.tolist() == [[3, 1, 0], [5, 0, 0], [0, 2, 4]] and tables.dtype == torch.int64


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_cuda_uses_torch_path(dtype):
    case = make_case(ragged_chunks(16), 2, 4, 64, 16, dtype)
    out = pf.paged_prefill_attention(*(t.cuda() for t in case), 0.125)
    assert out.device.type == "cuda"
    rows = chunk_rows(case[2], case[3])
    torch.testing.assert_close(out.cpu()[rows].float(), reference(*case, 0.125)[rows],
                               **TOLERANCES[dtype])
