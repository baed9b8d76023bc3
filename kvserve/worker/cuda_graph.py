"""CUDA graphs for all-decode steps (TRITON_ATTN on CUDA, unless enforce_eager).

At start every batch-size bucket (vLLM's capture sizes 1, 2, 4, 8, 16, 24, ... up to
max_num_seqs) is captured once: the whole forward pass, reading its inputs from static device
buffers. A step whose requests all decode one token, and fit in a bucket, copies its inputs
into those buffers (device to device: they were uploaded once by the runner), pads the rest
of the bucket (slot -1: no KV write; seq_len 0: attends to nothing) and replays the bucket's
graph. Mixed steps, and batches above the largest bucket, run eagerly.

    static rows: [ r0 r1 r2 | pad pad pad ... ]   bucket 8 for 3 decodes; outputs [:3] used

With LoRA on (--enable-lora) the graphs hold every LoRA layer's delta in its capturable form
(LoRAMapping.set_static: the Triton shrink / expand over every slot, the grouping computed on
the device from a static slots buffer, StaticLoRASlots). Before a replay that buffer is
refilled in place with the step's per-token slots, padding rows -1 (no adapter); the adapter
stacks are allocated once, and loading an adapter copies into its slot, so a graph captured
before any adapter was loaded serves every later one. The LM head's LoRA runs after the
replay, eagerly, on the rows being scored (compute_logits is not in the graph). Each bucket
is also captured without LoRA: a step with no adapter tokens replays that one (in the LoRA
graph, 128 base requests of a 110M Llama took 4.5 ms a step on an H100; in this one 2.5-2.8).
"""
from __future__ import annotations

import bisect
import logging
import time
from typing import TYPE_CHECKING, Optional

import torch

from kvserve.attention.backends.triton import TritonAttentionMetadata

if TYPE_CHECKING:
    from kvserve.lora.manager import LoRAModelManager

logger = logging.getLogger(__name__)


def capture_sizes(max_num_seqs: int) -> list[int]:
    """vLLM's cudagraph_capture_sizes (1, 2, 4, then steps of 8 to 256 and of 16 to 512),
    keeping those <= max_num_seqs."""
    sizes = [1, 2, 4] + list(range(8, 257, 8)) + list(range(272, 513, 16))
    return [s for s in sizes if s <= max_num_seqs]


def padded_batch_size(num_reqs: int, sizes: list[int]) -> Optional[int]:
    """The smallest bucket that holds num_reqs requests; None above the largest (eager)."""
    i = bisect.bisect_left(sizes, num_reqs)
    return sizes[i] if i < len(sizes) else None


class CUDAGraphRunner:
    """Captured decode forwards, one per bucket, over shared static input buffers."""

    def __init__(self, model: torch.nn.Module, kv_caches: list[torch.Tensor],
                 sizes: list[int], max_blocks_per_req: int, device: torch.device,
                 lora: "Optional[LoRAModelManager]" = None) -> None:
        self.model, self.kv_caches, self.sizes = model, kv_caches, sorted(sizes)
        b, mb = self.sizes[-1], max_blocks_per_req
        self.input_ids = torch.zeros(b, dtype=torch.long, device=device)
        self.positions = torch.zeros(b, dtype=torch.long, device=device)
        self.slot_mapping = torch.full((b,), -1, dtype=torch.int32, device=device)
        self.query_start_loc = torch.arange(b + 1, dtype=torch.int32, device=device)
        self.seq_lens = torch.zeros(b, dtype=torch.int32, device=device)
        self.block_table = torch.zeros(b, mb, dtype=torch.int32, device=device)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        # With LoRA: the same buckets captured with no LoRA layer active (adapter-free steps).
        self.plain_graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.pool = None
        self.memory_bytes = 0      # what capture() took on the device
        self.replays = 0
        self.plain_replays = 0
        self.lora = lora
        self.lora_slots = None
        if lora is not None:
            from kvserve.lora.punica import StaticLoRASlots
            self.lora_slots = StaticLoRASlots(b, device)

    def static_bytes(self) -> int:
        """Device memory of the static input buffers every bucket reads."""
        bufs = [self.input_ids, self.positions, self.slot_mapping, self.query_start_loc,
                self.seq_lens, self.block_table]
        if self.lora_slots is not None:
            bufs.append(self.lora_slots.buf)
        return sum(t.numel() * t.element_size() for t in bufs)

    def output_bytes(self, b: int) -> int:
        """Bucket b's captured outputs (they live in the pool as long as their graphs)."""
        outs = [g[b][1] for g in (self.graphs, self.plain_graphs) if b in g]
        return sum(t.numel() * t.element_size() for t in outs)

    def _metadata(self, b: int) -> TritonAttentionMetadata:
        return TritonAttentionMetadata(
            slot_mapping=self.slot_mapping[:b], query_start_loc=self.query_start_loc[:b + 1],
            seq_lens=self.seq_lens[:b], block_table=self.block_table[:b], num_reqs=b,
            decode_only=True)

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every bucket, largest first (later ones reuse its memory pool)."""
        t0 = time.perf_counter()
        before = torch.cuda.mem_get_info()[0]
        self.capture_buckets(sorted(self.sizes, reverse=True), progress=True)
        torch.cuda.synchronize()
        self.memory_bytes = before - torch.cuda.mem_get_info()[0]
        logger.info("Graph capturing finished in %.1f s, took %.2f GiB (%d sizes, up to %d).",
                    time.perf_counter() - t0, self.memory_bytes / 2**30, len(self.sizes),
                    self.sizes[-1])

    @torch.inference_mode()
    def capture_buckets(self, sizes: list[int], progress: bool = False) -> None:
        """Capture these buckets in this order (with LoRA: each also without it)."""
        from tqdm import tqdm
        try:
            for b in (tqdm(sizes, desc="Capturing CUDA graphs (decode, FULL)")
                      if progress else sizes):
                self.static_inputs(b)
                self.graphs[b] = self._capture_one(b)
                if self.lora is not None:        # the same bucket, LoRA layers idle
                    self.lora.mapping.clear()
                    self.plain_graphs[b] = self._capture_one(b)
        finally:
            if self.lora is not None:      # eager steps set their own mapping
                self.lora.mapping.clear()

    @torch.inference_mode()
    def warm_up(self, b: int) -> None:
        """One eager run of bucket b's captured code: Triton compiles (and autotunes) here."""
        self.static_inputs(b)
        self.model(self.input_ids[:b], self.positions[:b], self.kv_caches, self._metadata(b))
        if self.lora is not None:
            self.lora.mapping.clear()

    def _capture_one(self, b: int) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        meta = self._metadata(b)
        # Warm-up outside the graph: Triton compiles (and autotunes) here, not in capture.
        self.model(self.input_ids[:b], self.positions[:b], self.kv_caches, meta)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            out = self.model(self.input_ids[:b], self.positions[:b], self.kv_caches, meta)
        if self.pool is None:
            self.pool = graph.pool()
        return graph, out

    def static_inputs(self, b: int) -> None:
        """Bucket b's LoRA inputs for a capture (or an eager run of the captured code): the
        mapping in static mode over the first b rows of the slots buffer."""
        if self.lora is not None:
            assert self.lora_slots is not None
            self.lora.sorted_tokens.clear()
            self.lora.mapping.set_static(self.lora_slots.view(b), self.lora.config.max_loras)

    def _adapter_free(self, n: int) -> bool:
        """No token of this n-token step has an adapter (prepare_step's mapping has no group)."""
        mapping = self.lora.mapping if self.lora is not None else None
        return mapping is None or not mapping.groups or mapping.num_tokens != n

    def fill_lora(self, n: int, b: int) -> None:
        """The step's per-token slots (prepare_step's mapping, already on the device) into the
        static buffer in place; rows [n, b) -1. A step without adapter tokens: all -1."""
        if self.lora_slots is None:
            return
        assert self.lora is not None
        if self._adapter_free(n):
            self.lora_slots.buf[:b].fill_(-1)
        else:        # groups from LoRAMapping.set: they carry the step's token slots
            self.lora_slots.fill(self.lora.mapping.groups.token_slots, b)

    def can_run(self, meta: object, num_tokens: int) -> bool:
        return (isinstance(meta, TritonAttentionMetadata) and meta.decode_only
                and padded_batch_size(num_tokens, self.sizes) is not None
                and meta.block_table.shape[1] <= self.block_table.shape[1])

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor,
            meta: TritonAttentionMetadata) -> torch.Tensor:
        """Replay the bucket of this all-decode step; returns hidden states [n, hidden]."""
        n = input_ids.shape[0]
        b = padded_batch_size(n, self.sizes)
        assert b is not None
        w = meta.block_table.shape[1]
        self.input_ids[:n].copy_(input_ids, non_blocking=True)
        self.positions[:n].copy_(positions, non_blocking=True)
        self.slot_mapping[:n].copy_(meta.slot_mapping, non_blocking=True)
        self.seq_lens[:n].copy_(meta.seq_lens, non_blocking=True)
        self.block_table[:n, :w].copy_(meta.block_table, non_blocking=True)
        if b > n:     # padding rows: write nothing, attend to nothing
            self.slot_mapping[n:b].fill_(-1)
            self.seq_lens[n:b].fill_(0)
        if self.plain_graphs and self._adapter_free(n):
            graph, out = self.plain_graphs[b]
            self.plain_replays += 1
        else:
            self.fill_lora(n, b)
            graph, out = self.graphs[b]
        graph.replay()
        self.replays += 1
        return out[:n]
