"""Paged decode attention: the C++ CPU kernel and the torch fallback against a float64 reference.

Every case fills what a sequence must not see with NaN: blocks no sequence owns (which padded
block-table entries point to) and the slots past seq_len in each sequence's last block. One NaN
read anywhere shows up in the output.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
from typing import Callable

import pytest
import torch

from kvserve.ops import paged_attention as pa
from tests.utils import kernel_isa_prefix, scattered_paged_cache

HAS_COMPILER = shutil.which(os.environ.get("CXX", "c++")) is not None
needs_compiler = pytest.mark.skipif(not HAS_COMPILER, reason="no C++ compiler")

TOLERANCES = {torch.float64: dict(atol=1e-10, rtol=1e-10),
              torch.float32: dict(atol=1e-5, rtol=1e-5),
              # the output is rounded to bfloat16 (8 bits); the torch path also rounds probs
              torch.bfloat16: dict(atol=2e-2, rtol=2e-2)}


def reference(q: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor,
              seq_lens: torch.Tensor, scale: float) -> torch.Tensor:
    """Per sequence: gather its tokens, repeat_kv, softmax attention in float64."""
    _, _, bs, hkv, _ = kv_cache.shape
    groups = q.shape[1] // hkv
    outs = []
    for i, n in enumerate(seq_lens.tolist()):
        blocks = block_tables[i, :(n + bs - 1) // bs]
        k = kv_cache[0][blocks].flatten(0, 1)[:n].double()        # [n, Hkv, D]
        v = kv_cache[1][blocks].flatten(0, 1)[:n].double()
        # Hugging Face's repeat_kv: query head h reads kv head h // groups.
        k = k.repeat_interleave(groups, dim=1)                     # [n, H, D]
        v = v.repeat_interleave(groups, dim=1)
        probs = torch.softmax(torch.einsum("hd,nhd->hn", q[i].double(), k) * scale, dim=-1)
        outs.append(torch.einsum("hn,nhd->hd", probs, v))
    return torch.stack(outs)


def make_case(seq_lens: list[int], num_kv_heads: int, groups: int, head_dim: int,
              block_size: int, dtype: torch.dtype, pad_blocks: int = 2, seed: int = 0
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """q, kv_cache, block_tables (padded to the longest + pad_blocks), seq_lens."""
    gen = torch.Generator().manual_seed(seed)
    kv_cache, tables = scattered_paged_cache(seq_lens, num_kv_heads, head_dim, block_size, dtype,
                                             pad_blocks, gen)
    q = torch.randn(len(seq_lens), num_kv_heads * groups, head_dim, generator=gen).to(dtype)
    return q, kv_cache, tables, torch.tensor(seq_lens)


def ragged_lens(block_size: int) -> list[int]:
    # 1 token, exactly one / two blocks, one past a boundary, longer ones.
    return [1, block_size, block_size + 1, 2 * block_size, 3 * block_size - 5, 77, 5]


@pytest.fixture(scope="module")
def kernel() -> Callable[..., torch.Tensor]:
    op = pa._load_cpu_kernel()       # the compiled op itself, whatever the environment says
    assert op is not None, "the C++ kernel failed to build (see the log)"
    return op


def check(fn: Callable[..., torch.Tensor], seq_lens: list[int], num_kv_heads: int, groups: int,
          head_dim: int, block_size: int, dtype: torch.dtype, seed: int = 0) -> None:
    q, kv_cache, tables, lens = make_case(seq_lens, num_kv_heads, groups, head_dim, block_size,
                                          dtype, seed=seed)
    scale = head_dim ** -0.5
    out = fn(q, kv_cache, tables, lens, scale)
    assert out.shape == q.shape and out.dtype == q.dtype
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.double(), reference(q, kv_cache, tables, lens, scale),
                               **TOLERANCES[dtype])


SHAPES = [pytest.param(4, 1, id="mha"), pytest.param(2, 4, id="gqa4"),
          pytest.param(3, 2, id="gqa2")]


@needs_compiler
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("num_kv_heads,groups", SHAPES)
@pytest.mark.parametrize("head_dim", [32, 64, 128])
@pytest.mark.parametrize("block_size", [16, 32])
def test_kernel_matches_reference(kernel, dtype, num_kv_heads, groups, head_dim, block_size):
    check(kernel, ragged_lens(block_size), num_kv_heads, groups, head_dim, block_size, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("num_kv_heads,groups", SHAPES)
@pytest.mark.parametrize("head_dim", [32, 64, 128])
@pytest.mark.parametrize("block_size", [16, 32])
def test_torch_fallback_matches_reference(dtype, num_kv_heads, groups, head_dim, block_size):
    check(pa.paged_decode_attention_torch, ragged_lens(block_size), num_kv_heads, groups,
          head_dim, block_size, dtype)


@needs_compiler
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("head_dim,block_size", [(80, 16), (64, 4), (48, 1), (256, 16)])
def test_kernel_other_shapes(kernel, dtype, head_dim, block_size):
    """Head dims without a dedicated vector path (portable loops), 256, tiny blocks."""
    check(kernel, [1, 2, 9, 33], 2, 3, head_dim, block_size, dtype)


@needs_compiler
def test_kernel_uses_the_selected_tier(kernel):
    assert torch.ops.kvserve.paged_attention_isa() == kernel_isa_prefix()


@needs_compiler
def test_kernel_many_sequences_and_thread_counts(kernel):
    """Enough work items for every thread; the result must not depend on the split."""
    gen = torch.Generator().manual_seed(3)
    lens = torch.randint(1, 200, (40,), generator=gen).tolist()
    q, kv_cache, tables, seq_lens = make_case(lens, 4, 2, 64, 16, torch.float32, seed=3)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = kernel(q, kv_cache, tables, seq_lens, 0.125)
        torch.set_num_threads(2)
        two = kernel(q, kv_cache, tables, seq_lens, 0.125)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, two)
    torch.testing.assert_close(one.double(), reference(q, kv_cache, tables, seq_lens, 0.125),
                               atol=1e-5, rtol=1e-5)


@needs_compiler
def test_kernel_strided_query_and_garbage_padding(kernel):
    """q as a strided view; padded table entries that are not even valid block ids."""
    q, kv_cache, tables, lens = make_case([5, 16, 40], 2, 2, 64, 16, torch.float32)
    tables[:, 3:] = -1
    tables[0, 1] = 10 ** 9
    wide = torch.randn(3, 4, 2, 64)
    wide[:, :, 0] = q
    qs = wide[:, :, 0]                                   # head stride 128, not 64
    assert not qs.is_contiguous()
    ref = reference(q, kv_cache, tables, lens, 0.125)
    torch.testing.assert_close(kernel(qs, kv_cache, tables, lens, 0.125).double(), ref,
                               atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(
        pa.paged_decode_attention_torch(qs, kv_cache, tables, lens, 0.125).double(), ref,
        atol=1e-5, rtol=1e-5)


@needs_compiler
def test_kernel_rejects_bad_inputs(kernel):
    q, kv_cache, tables, lens = make_case([5, 20], 2, 1, 32, 16, torch.float32)
    tables[1, 1] = kv_cache.shape[1]                     # read, and out of range
    with pytest.raises(RuntimeError, match="out of range"):
        kernel(q, kv_cache, tables, lens, 0.1)
    with pytest.raises(RuntimeError, match="does not fit"):
        kernel(q, kv_cache, tables[:, :1], lens, 0.1)


@needs_compiler
def test_dispatch_uses_kernel_and_casts_query(kernel, monkeypatch):
    monkeypatch.delenv(pa.DISABLE_ENV, raising=False)
    assert pa.cpu_kernel() is kernel
    q, kv_cache, tables, lens = make_case([3, 17], 2, 2, 64, 16, torch.bfloat16)
    q32 = q.float()                                      # float32 queries, bfloat16 cache
    out = pa.paged_decode_attention(q32, kv_cache, tables, lens, 0.125)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, kernel(q, kv_cache, tables, lens, 0.125).float())


def test_env_var_forces_torch_path(monkeypatch):
    monkeypatch.setenv(pa.DISABLE_ENV, "1")
    assert pa.cpu_kernel() is None
    check(pa.paged_decode_attention, ragged_lens(16), 2, 2, 64, 16, torch.float32)


@pytest.mark.timeout(180)
def test_build_failure_falls_back_to_torch(tmp_path):
    """A failing compiler (here CXX=false) is logged once and the torch path takes over."""
    script = textwrap.dedent("""
        import logging, torch
        logging.basicConfig(level=logging.INFO)
        from kvserve.ops import paged_attention as pa
        torch.manual_seed(0)
        kv = torch.randn(2, 6, 4, 2, 32)
        q = torch.randn(2, 4, 32)
        tables = torch.tensor([[0, 3, 5], [2, 1, 4]])
        lens = torch.tensor([9, 5])
        out = pa.paged_decode_attention(q, kv, tables, lens, 0.2)
        out2 = pa.paged_decode_attention(q, kv, tables, lens, 0.2)
        ref = pa.paged_decode_attention_torch(q, kv, tables, lens, 0.2)
        assert pa.cpu_kernel() is None
        assert torch.equal(out, ref) and torch.equal(out2, ref)
        print("OK")
    """)
    env = dict(os.environ, CXX="false", KVSERVE_CACHE_DIR=str(tmp_path))
    env.pop("TORCH_EXTENSIONS_DIR", None)
    env.pop(pa.DISABLE_ENV, None)
    proc = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                          text=True, timeout=170)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "OK"
    assert proc.stderr.count("C++ CPU kernel unavailable") == 1, proc.stderr


def test_unsupported_dtype_uses_torch_path():
    check(pa.paged_decode_attention, [1, 9, 30], 2, 2, 32, 8, torch.float64)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_cuda_uses_torch_path(dtype):
    q, kv_cache, tables, lens = make_case(ragged_lens(16), 2, 4, 64, 16, dtype)
    out = pa.paged_decode_attention(q.cuda(), kv_cache.cuda(), tables.cuda(), lens.cuda(), 0.125)
    assert out.device.type == "cuda"
    torch.testing.assert_close(out.cpu().double(), reference(q, kv_cache, tables, lens, 0.125),
                               **TOLERANCES[dtype])
