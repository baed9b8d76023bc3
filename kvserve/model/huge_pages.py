"""A CPU model's weights and KV cache in transparent huge pages (Linux).

A decode step streams every weight once. With 4 KiB pages a 220 MB bf16 model is ~54,000 pages
per step, one TLB miss (a page walk) each, and the hardware prefetchers stop at every page
boundary. Where the host's THP setting is "madvise" (Ubuntu's and many clouds' default), only
memory that asks for huge pages gets them, and torch's allocations do not ask. So after loading,
the weights are moved into one arena advised MADV_HUGEPAGE before anything touches it (the
kernel then backs it with 2 MiB pages as the copy faults it in). The copy goes tensor by tensor
and each old tensor is freed as soon as its copy is done, so the peak is one tensor over the
model's size. With THP "always" torch's large allocations get huge pages already, with "never"
nothing can, so "auto" moves only under "madvise".

Measured (AMD EPYC Zen 4, 2 threads, the 110M Llama's 49 linears at 1 x row, alternating):
float32 14.35 -> 14.08 ms, tiled bf16 5.56 -> 5.09 ms (benchmarks/README.md, issue 16). A GGUF
file's packed blocks are not Parameters (_packed_blocks finds them); moved with the rest, the
0.85B Q4_K_M file's batch-1 decode went 43-48 -> 54-65 tok/s (Zen 4, with quant_linear's 4 KB
prefetch; benchmarks/HISTORY.md 2026-11-28).

The KV cache (zeroed_kv_caches) is allocated the same way: a decode step reads each
sequence's blocks, scattered through the cache, and with 4 KiB pages every 8 KiB block is two
TLB misses. Measured (Zen 5 EPYC, 2 threads, bf16 paged decode attention, 16 / 4 heads x 64,
128 sequences of 80-200 tokens, 16 layers' caches in turn): 1.20 -> 1.00 ms a call.

--cpu-huge-pages: auto (default) | on (advise whatever the setting) | off (leave as loaded).
"""
from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging
import mmap
from typing import Any, Optional

import torch
from torch import nn

from kvserve.model.layers.fused_moe.packed import PackedExperts
from kvserve.ops import cpu_isa
from kvserve.ops.cpu_weight import PackedWeight
from kvserve.ops.quant.weight import PackedQuantWeight

logger = logging.getLogger(__name__)

HUGE_PAGE = 2 << 20
_ALIGN = 64            # every weight starts on a cache line (the kernels' vector loads)
_MADV_HUGEPAGE = 14
_THP_ENABLED = "/sys/kernel/mm/transparent_hugepage/enabled"


def thp_mode() -> Optional[str]:
    """The host's THP setting ("always", "madvise", "never"), None where there is none."""
    try:
        with open(_THP_ENABLED) as f:
            text = f.read()
    except OSError:
        return None
    start, end = text.find("["), text.find("]")
    return text[start + 1:end] if 0 <= start < end else None


@functools.lru_cache(maxsize=1)
def _madvise() -> Optional[ctypes._CFuncPtr]:
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    fn = ctypes.CDLL(name, use_errno=True).madvise
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn


def _align(n: int, to: int) -> int:
    return (n + to - 1) // to * to


def _enabled() -> bool:
    mode = cpu_isa.huge_pages_mode()
    return not (mode == "off" or (mode == "auto" and thp_mode() != "madvise"))


def _advised_arena(nbytes: int) -> Optional[tuple[torch.Tensor, int]]:
    """(bytes of a fresh private anonymous mapping, offset of its first huge page), advised
    MADV_HUGEPAGE from there on; None where madvise is missing or fails. The mapping is
    untouched (zero pages), so the first writes fault in huge pages. Not torch.empty: under a
    raised malloc threshold (utils/memory.serving_thresholds, or glibc's dynamic one) that comes
    from the heap, and the advice would outlive the tensors on that heap range, reaching
    whatever is allocated there later (test_huge_pages saw a later model's plain weights
    advised)."""
    madvise = _madvise()
    if madvise is None:
        return None
    arena = torch.frombuffer(
        mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS),
        dtype=torch.uint8)
    base = arena.data_ptr()
    start = _align(base, HUGE_PAGE)
    length = (base + arena.numel()) // HUGE_PAGE * HUGE_PAGE - start
    if madvise(start, length, _MADV_HUGEPAGE) != 0:
        logger.info("madvise(MADV_HUGEPAGE) failed (errno %d); memory stays in 4 KiB pages.",
                    ctypes.get_errno())
        return None
    return arena, start - base


def _kv_caches_in_huge_pages(shape: tuple[int, ...], dtype: torch.dtype,
                             count: int) -> Optional[list[torch.Tensor]]:
    """`count` zeroed CPU tensors of `shape` in one advised arena (see the module docstring);
    None where huge pages are not to be used (--cpu-huge-pages, the host's THP setting) or
    the arena is smaller than a huge page: the caller allocates as before."""
    if not _enabled() or count == 0:
        return None
    numel = int(torch.Size(shape).numel())
    per = _align(numel * torch.empty((), dtype=dtype).element_size(), _ALIGN)
    if per * count < HUGE_PAGE:
        return None
    advised = _advised_arena(per * count)
    if advised is None:
        return None
    arena, offset = advised
    arena[offset:offset + per * count].zero_()   # faulted in now (as torch.zeros), not mid-serving
    return [arena[offset + i * per:offset + (i + 1) * per].view(dtype)[:numel].view(shape)
            for i in range(count)]


def zeroed_kv_caches(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device,
                     count: int) -> list[torch.Tensor]:
    """`count` zeroed KV tensors of `shape` (zeroed: masked-out slots are multiplied by 0 in
    attention, and garbage NaNs would survive that): on CPU in one huge-page arena where
    _kv_caches_in_huge_pages gives one, else torch.zeros each."""
    if torch.device(device).type == "cpu":
        advised = _kv_caches_in_huge_pages(tuple(shape), dtype, count)
        if advised is not None:
            return advised
    return [torch.zeros(shape, dtype=dtype, device=device) for _ in range(count)]


def _packed_blocks(model: nn.Module) -> list[Any]:
    """The GGUF blocks the model keeps packed (ops/cpu_weight's packed variant): the
    PackedQuantWeight parts of its linears and the PackedExperts stacks of its MoE layers, each
    once (a tied head shares its embedding's). They are not Parameters (those are emptied), so
    without this the whole of a packed model's weights would stay in 4 KiB pages."""
    found: dict[int, Any] = {}
    for module in model.modules():
        for value in vars(module).values():
            items = (value.parts if isinstance(value, PackedWeight)
                     else value if isinstance(value, (list, tuple)) else [value])
            for obj in items:
                if (isinstance(obj, (PackedQuantWeight, PackedExperts))
                        and obj.packed.device.type == "cpu" and obj.packed.is_contiguous()):
                    found.setdefault(id(obj), obj)
    return list(found.values())


def move_weights_to_huge_pages(model: nn.Module) -> int:
    """Move the model's CPU parameters and packed GGUF blocks into one MADV_HUGEPAGE arena
    (see the module docstring); returns the bytes moved (0: not done, and why is logged at
    debug level)."""
    if not _enabled():
        logger.debug("Weights stay in the pages they were loaded in (cpu_huge_pages=%s, THP %s).",
                     cpu_isa.huge_pages_mode(), thp_mode())
        return 0
    params, seen = [], set()
    for p in model.parameters():
        if (id(p) not in seen and p.device.type == "cpu" and p.numel() > 0
                and p.data.is_contiguous()):
            seen.add(id(p))      # a tied weight is one Parameter in two modules
            params.append(p)
    blocks = _packed_blocks(model)
    total = sum(_align(t.numel() * t.element_size(), _ALIGN)
                for t in [p.data for p in params] + [b.packed for b in blocks])
    if total < HUGE_PAGE:
        return 0
    advised = _advised_arena(total)
    if advised is None:
        return 0
    arena, offset = advised

    def moved(t: torch.Tensor) -> torch.Tensor:
        nonlocal offset
        nbytes = t.numel() * t.element_size()
        dst = arena[offset:offset + nbytes].view(t.dtype).view(t.shape)
        dst.copy_(t)
        offset += _align(nbytes, _ALIGN)
        return dst

    # Each old storage is freed as its copy replaces it: the peak stays one tensor over.
    for p in params:
        p.data = moved(p.data)
    for b in blocks:
        b.packed = moved(b.packed)
    logger.info("Model weights (%.0f MiB%s) moved into transparent huge pages (THP %s; "
                "--cpu-huge-pages off leaves them in the pages they were loaded in).",
                total / 2**20, ", packed GGUF blocks included" if blocks else "", thp_mode())
    return total
