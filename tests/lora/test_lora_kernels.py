"""The multi-LoRA kernels against a float64 token-by-token reference: the Triton shrink /
expand (kvserve/ops/triton/lora.py, under Triton's interpreter on CPU) and the C++ CPU kernel
(csrc/lora.cpp), and punica.add_lora's dispatch between them and the torch path.

Every case mixes tokens of several adapters with base tokens (slot -1: their rows must stay
bit-identical) and poisons the slot no token uses with NaN (it must never be read)."""
from __future__ import annotations

import os
import shutil

import numpy as np
import pytest
import torch

if not torch.cuda.is_available():   # before the Triton kernels are defined (on import)
    os.environ.setdefault("TRITON_INTERPRET", "1")

from kvserve.lora import punica  # noqa: E402
from kvserve.lora.punica import LoRAMapping, add_lora_reference  # noqa: E402
from kvserve.ops import build, lora as cpu_lora  # noqa: E402

DEVICE = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
HAS_CPU_KERNEL = (shutil.which(os.environ.get("CXX", "c++")) is not None
                  and os.environ.get(build.DISABLE_ENV, "") in ("", "0"))
# Relative to |ref| + 1: float32 accumulation; bf16 adds one rounding of y (and of s on CUDA).
TOL = {torch.float32: 2e-5, torch.bfloat16: 1.6e-2}
UNUSED = 3     # the slot no token uses: NaN everywhere


def _slots(T: int, seed: int) -> np.ndarray:
    """Slots 0-2 and -1, in runs and scattered; slot UNUSED never."""
    rng = np.random.default_rng(seed)
    s = rng.integers(-1, 3, size=T)
    s[:3] = [2, -1, 0]
    return s


def _case(T: int, K: int, R: int, N: int, dtype: torch.dtype, wdtype: torch.dtype,
          seed: int) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, K, generator=g).to(dtype)
    a = (torch.randn(UNUSED + 1, R, K, generator=g) / K ** 0.5).to(wdtype)
    b = torch.randn(UNUSED + 1, N, R, generator=g).to(wdtype)
    a[UNUSED], b[UNUSED] = float("nan"), float("nan")
    y = torch.randn(T, N, generator=g).to(dtype)
    return x, a, b, y


def _check(got: torch.Tensor, want: torch.Tensor, y0: torch.Tensor, slots: np.ndarray) -> None:
    got = got.detach().cpu()
    assert not torch.isnan(got).any()
    err = ((got.double() - want) / (want.abs() + 1.0)).abs().max().item()
    assert err <= TOL[got.dtype], err
    base = torch.from_numpy(slots < 0)
    assert torch.equal(got[base], y0.cpu()[base])    # base tokens untouched, bit for bit


# ------------------------------------------------------------------------------------------
# Triton (CUDA; interpreted on CPU)

@pytest.fixture(scope="module")
def tri():
    pytest.importorskip("triton")
    from kvserve.ops.triton import lora
    return lora


@pytest.mark.parametrize("rank", [8, 16])
def test_triton_fused_slices_match_reference(tri, rank: int) -> None:
    """A q/k/v-like fused layer: one shrink over the 3 slices' A rows, then one expand per
    slice into its column range of y (offsets), odd widths; shrink leaves the rows of slot -1
    alone (NaN here) and expand never reads them."""
    T, K, widths = 13, 72, [40, 24, 24]
    x, a, _, y = _case(T, K, 3 * rank, sum(widths), torch.float32, torch.float32, seed=rank)
    g = torch.Generator().manual_seed(100 + rank)
    bs = [torch.randn(UNUSED + 1, w, rank, generator=g) for w in widths]
    for bi in bs:
        bi[UNUSED] = float("nan")
    slots = _slots(T, seed=rank)
    st = torch.from_numpy(slots)
    meta = tri.lora_meta(st.to(DEVICE), UNUSED + 1)
    xd, ad = x.to(DEVICE), a.to(DEVICE)
    s = tri.lora_shrink(xd, ad, meta, out=torch.full((T, 3 * rank), float("nan"), device=DEVICE))
    s_ref = torch.einsum("tk,trk->tr", x.double(), a.double()[st.clamp(min=0)])
    assert torch.allclose(s.cpu().double()[st >= 0], s_ref[st >= 0], rtol=1e-5, atol=1e-5)
    assert torch.isnan(s.cpu()[st < 0]).all()
    out = y.clone().to(DEVICE)
    b_full = torch.zeros(UNUSED + 1, sum(widths), 3 * rank)    # block-diagonal, for the reference
    off = 0
    for i, bi in enumerate(bs):
        tri.lora_expand(out, s, bi.to(DEVICE), meta, y_offset=off, s_offset=i * rank)
        b_full[:, off:off + widths[i], i * rank:(i + 1) * rank] = bi
        off += widths[i]
    _check(out, add_lora_reference(y, x, a, b_full, st), y, slots)


@pytest.mark.parametrize("T", [5, 70])      # decode-size and a prefill-size (64-row) block
def test_triton_add_lora_bf16(tri, T: int) -> None:
    """punica's Triton path end to end (mapping -> shrink -> expand), bfloat16."""
    x, a, b, y = _case(T, 40, 16, 33, torch.bfloat16, torch.bfloat16, seed=T)
    slots = _slots(T, seed=T)
    mapping = LoRAMapping()
    mapping.set(slots, DEVICE)
    out = y.clone().to(DEVICE)
    punica.add_lora_triton(out, x.to(DEVICE), a.to(DEVICE), b.to(DEVICE), mapping.groups)
    _check(out, add_lora_reference(y, x, a, b, torch.from_numpy(slots)), y, slots)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_triton_split_k_shrink(tri, dtype: torch.dtype) -> None:
    """A decode-size batch over a wide K: the shrink runs in K splits (9 tiles of 64 in 4
    splits of 3, the last one empty) whose partial sums the expand adds."""
    T, K = 9, 520
    x, a, b, y = _case(T, K, 16, 40, dtype, dtype, seed=5)
    slots = _slots(T, seed=5)
    meta = tri.lora_meta(torch.from_numpy(slots).to(DEVICE), UNUSED + 1)
    s = tri.lora_shrink(x.to(DEVICE), a.to(DEVICE), meta)
    assert s.shape == (4, T, 16)
    out = tri.lora_expand(y.clone().to(DEVICE), s, b.to(DEVICE), meta)
    _check(out, add_lora_reference(y, x, a, b, torch.from_numpy(slots)), y, slots)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_triton_path_in_a_cuda_graph(tri) -> None:
    """add_lora captured in a CUDA graph with host syncs made errors; the next step's slots
    (LoRAMapping.set refills the same buffer) are honoured by a replay."""
    T = 8
    x, a, b, y = _case(T, 64, 16, 48, torch.float32, torch.float32, seed=11)
    xd, ad, bd, yd = x.cuda(), a.cuda(), b.cuda(), y.cuda()
    out = torch.empty_like(yd)
    mapping = LoRAMapping()
    first, second = _slots(T, seed=1), _slots(T, seed=2)[::-1].copy()
    mapping.set(first, DEVICE)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):         # warm-up (compiles the kernels) off the capture
        out.copy_(yd)
        punica.add_lora(out, xd, ad, bd, mapping.groups)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    torch.cuda.set_sync_debug_mode("error")
    try:
        with torch.cuda.graph(graph):
            out.copy_(yd)
            punica.add_lora(out, xd, ad, bd, mapping.groups)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    for slots in (second, first):
        mapping.set(slots, DEVICE)
        graph.replay()
        torch.cuda.synchronize()
        _check(out, add_lora_reference(y, x, a, b, torch.from_numpy(slots)), y, slots)


# ------------------------------------------------------------------------------------------
# C++ CPU kernel

needs_cpu_kernel = pytest.mark.skipif(not HAS_CPU_KERNEL, reason="no C++ kernels here")


@pytest.fixture
def cpu_op():
    cpu_lora.set_kernels_enabled(True)
    op = cpu_lora.cpu_kernel()
    assert op is not None, "the LoRA C++ kernel failed to build (see the log)"
    yield op
    cpu_lora.set_kernels_enabled(True)


@needs_cpu_kernel
@pytest.mark.parametrize("dtype,wdtype", [(torch.float32, torch.float32),
                                          (torch.bfloat16, torch.bfloat16),
                                          (torch.float32, torch.bfloat16)],
                         ids=["f32", "bf16", "f32x-bf16w"])
@pytest.mark.parametrize("T,R", [(1, 8), (9, 16), (64, 48)])
def test_cpu_kernel_matches_reference(cpu_op, dtype: torch.dtype, wdtype: torch.dtype, T: int,
                                      R: int) -> None:
    """K = 100 and N = 37 leave tails of the 8-lane loops and of the 8-row blocks."""
    x, a, b, y = _case(T, 100, R, 37, dtype, wdtype, seed=T + R)
    slots = _slots(T, seed=T) if T > 1 else np.array([1])
    out = y.clone()
    cpu_op(out, x, a, b, torch.from_numpy(slots))
    _check(out, add_lora_reference(y, x, a, b, torch.from_numpy(slots)), y, slots)


def _fused_case(T: int, K: int, rank: int, splits: list[int], dtype: torch.dtype,
                seed: int) -> tuple[torch.Tensor, ...]:
    """A fused layer's stacks as LoRALinear lays them out: B block-diagonal over the slices
    (slice i's rows use columns [i*rank, (i+1)*rank) only) and column-major per slot."""
    n, N = len(splits), sum(splits)
    x, a, _, y = _case(T, K, n * rank, N, dtype, dtype, seed)
    g = torch.Generator().manual_seed(seed + 1)
    b = torch.zeros(UNUSED + 1, n * rank, N).transpose(1, 2)
    row = 0
    for i, size in enumerate(splits):
        b[:, row:row + size, i * rank:(i + 1) * rank] = torch.randn(UNUSED + 1, size, rank,
                                                                    generator=g)
        row += size
    b[UNUSED] = float("nan")
    return x, a, b.to(dtype), y


def _grouped_reference(y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                       slots: np.ndarray) -> torch.Tensor:
    """add_lora_reference's float64 delta per slot group (no [T, N, R] gather: large N)."""
    out = y.double().clone()
    for slot in set(slots[slots >= 0].tolist()):
        idx = torch.from_numpy(np.flatnonzero(slots == slot))
        out[idx] += (x[idx].double() @ a[slot].double().t()) @ b[slot].double().t()
    return out


@needs_cpu_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("splits", [[48, 16, 16], [37, 21, 11], [20, 20]])
@pytest.mark.parametrize("T", [9, 43])     # the per-block (decode) and the tiled (prefill) passes
def test_cpu_kernel_fused_slices_column_major(cpu_op, dtype: torch.dtype,
                                              splits: list[int], T: int) -> None:
    """LoRALinear's layout (column-major B, out_splits naming the slices; boundaries on and off
    the 16-column blocks, a short last block): the reference, and the same bits as the kernel
    reading every column (the skipped products are exact zeros). 43 tokens in 3 slots leave
    partial tiles of tokens (4 in the shrink, 6 in the expand) and of rows (3)."""
    x, a, b, y = _fused_case(T, 40, 8, splits, dtype, seed=len(splits) + splits[-1])
    assert cpu_lora.b_col_major(b) and cpu_lora.stacks_take(dtype, a, b)
    slots = _slots(T, seed=T)
    st = torch.from_numpy(slots)
    want = add_lora_reference(y, x, a, b, st)
    outs = []
    for bb, sp in ((b, splits), (b, []), (b.contiguous(), [])):
        out = y.clone()
        cpu_op(out, x, a, bb, st, sp)
        _check(out, want, y, slots)
        outs.append(out)
    assert torch.equal(outs[0], outs[1])


@needs_cpu_kernel
def test_cpu_kernel_split_over_threads(cpu_op) -> None:
    """64 tokens of a wide fused layer: the expand (> 4M multiply-adds) is split over 2
    threads -- the reference, and the same bits as on one thread."""
    splits = [4000, 4000, 11]
    x, a, b, y = _fused_case(64, 40, 16, splits, torch.float32, seed=5)
    slots = _slots(64, seed=5)
    st = torch.from_numpy(slots)
    want = _grouped_reference(y, x, a, b, slots)
    threads = torch.get_num_threads()
    outs = []
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            out = y.clone()
            cpu_op(out, x, a, b, st, splits)
            _check(out, want, y, slots)
            outs.append(out)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(outs[0], outs[1])


@needs_cpu_kernel
def test_cpu_kernel_rejects_bad_splits(cpu_op) -> None:
    x, a, b, y = _fused_case(3, 16, 8, [8, 8], torch.float32, seed=0)
    with pytest.raises(RuntimeError, match="out_splits"):
        cpu_op(y, x, a, b, torch.tensor([0, 1, -1]), [8, 9])


@needs_cpu_kernel
def test_cpu_kernel_torch_path_agree_on_lora_layout(cpu_op) -> None:
    """The demo model's gate/up shape at decode batch 8 in LoRALinear's layout: the kernel and
    the torch path (which takes the column-major B by its strides) equal the reference."""
    x, a, b, y = _fused_case(8, 576, 16, [1536, 1536], torch.float32, seed=7)
    slots = np.array([0, 1, 2, 0, -1, 1, 2, 2])
    st = torch.from_numpy(slots)
    want = add_lora_reference(y, x, a, b, st)
    out = y.clone()
    cpu_op(out, x, a, b, st, [1536, 1536])
    _check(out, want, y, slots)
    mapping = LoRAMapping()
    mapping.set(slots, torch.device("cpu"))
    ref_torch = y.clone()
    punica.add_lora_torch(ref_torch, x, a, b, mapping.groups)
    _check(ref_torch, want, y, slots)


@needs_cpu_kernel
def test_add_lora_dispatch(cpu_op, monkeypatch: pytest.MonkeyPatch) -> None:
    """add_lora on CPU: the kernel up to CPU_KERNEL_MAX_TOKENS tokens, torch above, torch
    when the kernels are disabled (KVSERVE_DISABLE_CPU_KERNELS) -- each bit-identical to the
    path it should have taken."""
    def run(T: int, fn) -> tuple[torch.Tensor, torch.Tensor]:
        x, a, b, y = _case(T, 48, 16, 40, torch.float32, torch.float32, seed=T)
        mapping = LoRAMapping()
        mapping.set(_slots(T, seed=T), torch.device("cpu"))
        got, want = y.clone(), y.clone()
        punica.add_lora(got, x, a, b, mapping.groups)
        fn(want, x, a, b, mapping.groups)
        return got, want

    # The boundary moved down (the real one, 16384, makes large tensors): the dispatch reads it
    # per call.
    monkeypatch.setattr(cpu_lora, "CPU_KERNEL_MAX_TOKENS", 64)
    small = cpu_lora.CPU_KERNEL_MAX_TOKENS
    kernel = lambda y, x, a, b, g: cpu_op(y, x, a, b, g.token_slots)   # noqa: E731
    assert torch.equal(*run(small, kernel))
    assert torch.equal(*run(small + 1, punica.add_lora_torch))
    monkeypatch.setenv(build.DISABLE_ENV, "1")
    cpu_lora.reset_dispatch()
    try:
        assert torch.equal(*run(5, punica.add_lora_torch))
    finally:
        monkeypatch.delenv(build.DISABLE_ENV)
        cpu_lora.reset_dispatch()


@needs_cpu_kernel
def test_add_lora_on_some_of_the_groups(cpu_op) -> None:
    """A layer passes only the groups whose adapter targets it (a plain list of some of
    mapping.groups' items): the kernel still runs, on those slots only."""
    T = 12
    x, a, b, y = _case(T, 48, 16, 40, torch.float32, torch.float32, seed=3)
    slots = _slots(T, seed=3)
    mapping = LoRAMapping()
    mapping.set(slots, torch.device("cpu"))
    some = [gr for gr in mapping.groups if gr[0] != 2]
    kept = np.where(np.isin(slots, [0, 1]), slots, -1)
    got, want = y.clone(), y.clone()
    punica.add_lora(got, x, a, b, some)
    cpu_op(want, x, a, b, torch.from_numpy(kept))
    assert torch.equal(got, want)
    _check(got, add_lora_reference(y, x, a, b, torch.from_numpy(kept)), y, kept)


@needs_cpu_kernel
def test_cpu_kernel_rejects_bad_slots(cpu_op) -> None:
    x, a, b, y = _case(3, 16, 8, 8, torch.float32, torch.float32, seed=0)
    with pytest.raises(RuntimeError, match="slot 4"):
        cpu_op(y, x, a, b, torch.tensor([0, 4, -1]))
