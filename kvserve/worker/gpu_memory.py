"""Sizing the KV cache on a GPU from a profile run, under gpu_memory_utilization (vLLM's rule).

    budget = total * gpu_memory_utilization
    KV cache = budget - weights - peak activations of the largest step - non-torch memory
               - CUDA graphs (when they will be captured)

Non-torch memory (the CUDA context, NCCL buffers) is what the device reports in use beyond
torch's own reservations. Everything else on the GPU (other processes) is outside the
budget's concern but shows in `free`: the cache never takes more than is free.

The decode graphs are captured after the KV cache is allocated, into a private memory pool
the cache cannot share, so their memory is estimated here first (as vLLM's profiler does):
the largest bucket (decode or mixed) captured on the scratch cache, then the smallest into
the same pool,

    graphs = static inputs + largest + (buckets - 1) * max(smallest's increment,
                                                          the largest's outputs)

(the pool reuses the largest bucket's activations for every later bucket; each graph adds its
own outputs and executable). The log after capture says what the graphs took.
"""
from __future__ import annotations

from dataclasses import dataclass

GiB = float(1 << 30)


@dataclass
class MemoryProfile:
    total: int               # device memory, bytes
    free: int                # free after the profile run
    weights: int             # torch allocations after loading the model
    peak_activations: int    # peak torch allocations during the profile run, beyond the weights
    non_torch: int           # in use on the device but not reserved by torch
    cuda_graphs: int = 0     # estimated memory of the decode graphs (0: none captured)


def kv_cache_budget(p: MemoryProfile, utilization: float) -> int:
    """Bytes the KV cache may take (possibly <= 0)."""
    budget = (int(p.total * utilization) - p.weights - p.peak_activations - p.non_torch
              - p.cuda_graphs)
    return min(budget, p.free)


def check_kv_cache_fits(budget: int, bytes_per_block: int, blocks_per_request: int,
                        max_model_len: int, p: MemoryProfile, utilization: float) -> int:
    """Blocks that fit in `budget`; a ValueError with the numbers if not even one
    max_model_len request fits."""
    blocks = max(0, budget) // bytes_per_block
    if blocks < blocks_per_request:
        need = blocks_per_request * bytes_per_block
        raise ValueError(
            f"KV cache too small: one request of max_model_len={max_model_len} needs "
            f"{need / GiB:.2f} GiB ({blocks_per_request} blocks), but only "
            f"{max(0, budget) / GiB:.2f} GiB is left: gpu_memory_utilization={utilization} of "
            f"{p.total / GiB:.2f} GiB = {p.total * utilization / GiB:.2f} GiB, minus weights "
            f"{p.weights / GiB:.2f} GiB, peak activations {p.peak_activations / GiB:.2f} GiB, "
            f"non-torch memory {p.non_torch / GiB:.2f} GiB and CUDA graphs "
            f"{p.cuda_graphs / GiB:.2f} GiB (free now {p.free / GiB:.2f} GiB). Raise "
            f"gpu_memory_utilization, or lower max_model_len or max_num_batched_tokens "
            f"(or max_num_seqs, or enforce_eager: fewer or no graphs).")
    return blocks


def graphs_memory(largest: int, increment: int, num_buckets: int) -> int:
    """The decode graphs' memory from two captures into one pool: the largest bucket's, then
    the increment of one more (smaller) bucket, for each of the other num_buckets - 1."""
    if num_buckets <= 0:
        return 0
    return max(0, largest) + (num_buckets - 1) * max(0, increment)


def estimate_graphs_memory(runner, scratch: list) -> int:
    """Capture the largest and the smallest graph bucket over the scratch cache, measure the
    device memory each took (graph pool, executables; with LoRA both graphs of the bucket),
    release them; return the static inputs + graphs_memory for every bucket
    capture_cuda_graphs will capture."""
    import torch

    decode, mixed = runner.graph_buckets()
    # The real block table's width: the static inputs are part of what capture takes.
    graphs = runner.graph_runner(scratch, decode, mixed, runner.max_blocks_per_req)
    buckets = graphs.buckets()
    taken = [graphs.static_bytes()]
    try:
        for key in (buckets[0], buckets[-1]):
            graphs.warm_up(*key)     # compiled kernels' modules are not the graph's memory
            torch.cuda.synchronize()
            torch.cuda.empty_cache()    # nor are the warm-up's temporaries
            before = torch.cuda.mem_get_info()[0]
            graphs.capture_buckets([key])
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
            taken.append(before - torch.cuda.mem_get_info()[0])
        # Every later bucket keeps its own outputs in the pool: never count less than the
        # largest's (the smallest's increment can round to nothing in a 2 MiB segment).
        taken[2] = max(taken[2], graphs.output_bytes(*buckets[0]))
    finally:
        del graphs
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
    return taken[0] + graphs_memory(taken[1], taken[2], len(buckets))


def profile_memory(runner, utilization: float) -> tuple[int, MemoryProfile]:
    """Run the largest step once on a scratch one-block cache (every token reads and writes
    block 0) plus the logits of every request; return the KV cache budget and the profile."""
    import numpy as np
    import torch

    from kvserve.attention.backends.base import CommonAttentionMetadata

    dev, cfg = runner.device, runner.config
    sc, mc = cfg.scheduler_config, cfg.model_config
    T = min(sc.max_num_batched_tokens, sc.max_num_seqs * runner.max_model_len)
    R = max(1, min(sc.max_num_seqs, T))
    qlens = np.full(R, T // R, dtype=np.int64)
    qlens[:T % R] += 1
    starts = np.cumsum(qlens) - qlens
    width = -(-int(qlens.max()) // runner.block_size)
    common = CommonAttentionMetadata(
        num_decodes=int((qlens == 1).sum()), query_starts=starts, query_lens=qlens,
        context_lens=np.zeros(R, np.int64), block_table=np.zeros((R, width), np.int64),
        slot_mapping=np.zeros(T, np.int64), block_size=runner.block_size)
    scratch = [torch.zeros(runner.kv_cache_shape(1), dtype=runner.kv_dtype, device=dev)
               for _ in range(mc.num_layers)]
    torch.cuda.synchronize(dev)
    torch.cuda.empty_cache()
    weights = torch.cuda.memory_allocated(dev)
    torch.cuda.reset_peak_memory_stats(dev)
    with torch.inference_mode():
        meta = runner.attn_backend.build_metadata(common)
        ids = torch.zeros(T, dtype=torch.long, device=dev)
        hidden = runner.model(ids, torch.zeros_like(ids), scratch, meta)
        runner.model.compute_logits(hidden[torch.from_numpy(starts).to(dev)]).float().softmax(-1)
    torch.cuda.synchronize(dev)
    peak = torch.cuda.max_memory_allocated(dev) - weights
    del hidden, meta
    graphs = estimate_graphs_memory(runner, scratch) if runner.uses_cuda_graphs() else 0
    del scratch
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(dev)
    non_torch = max(0, (total - free) - torch.cuda.memory_reserved(dev))
    p = MemoryProfile(total=total, free=free, weights=weights, peak_activations=peak,
                      non_torch=non_torch, cuda_graphs=graphs)
    return kv_cache_budget(p, utilization), p
