"""CUDA graphs (TRITON_ATTN on CUDA, unless enforce_eager or cudagraph_mode NONE).

At start every bucket is captured once: the whole forward pass, reading its inputs from static
device buffers shared by all buckets. A step that fits a bucket copies its inputs into those
buffers (device to device: they were uploaded once by the runner), pads the rest and replays
the bucket's graph; other steps run eagerly. Two kinds of bucket (vLLM's cudagraph modes):

- decode (FULL_DECODE_ONLY, the default, and FULL): per batch size (vLLM's capture sizes 1, 2,
  4, 8, 16, 24, ... up to max_num_seqs), a step whose requests all decode one token: the
  split-KV decode kernel. Padding rows: slot -1 (no KV write), seq_len 0 (attend to nothing).

      static rows: [ r0 r1 r2 | pad pad pad ... ]   bucket 8 for 3 decodes; outputs [:3] used

- mixed (FULL): per token count up to max_cudagraph_capture_size, a step with prompt chunks
  (decodes beside them or not): the unified kernel, whose grid (tokens / BLOCK_Q + requests)
  is fixed by padding the requests to min(bucket, max_num_seqs). Padding requests have no
  query (query_start_loc repeats the step's token count) and seq_len 0; padding tokens write
  nothing, belong to no request, and their attention output is 0 (meta.padded: the unified
  kernel's output zeroed first, so no stale memory flows through their rows).

      query_start_loc: [ 0 5 6 7 | 7 7 7 ... ]      3 requests, 7 tokens, bucket 8 (8 requests)

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
from typing import TYPE_CHECKING, Optional, Sequence

import torch

from kvserve.attention.backends.triton import TritonAttentionMetadata

if TYPE_CHECKING:
    from kvserve.lora.manager import LoRAModelManager

logger = logging.getLogger(__name__)

Graph = tuple["torch.cuda.CUDAGraph", torch.Tensor]     # a captured forward and its output


def padded_batch_size(num_reqs: int, sizes: list[int]) -> Optional[int]:
    """The smallest bucket that holds num_reqs requests; None above the largest (eager)."""
    i = bisect.bisect_left(sizes, num_reqs)
    return sizes[i] if i < len(sizes) else None


class CUDAGraphRunner:
    """Captured forwards, one per bucket (decode: by requests; mixed: by tokens), over shared
    static input buffers."""

    def __init__(self, model: torch.nn.Module, kv_caches: list[torch.Tensor],
                 sizes: list[int], max_blocks_per_req: int, device: torch.device,
                 lora: "Optional[LoRAModelManager]" = None, mixed_sizes: Sequence[int] = (),
                 max_num_seqs: Optional[int] = None) -> None:
        self.model, self.kv_caches = model, kv_caches
        self.sizes, self.mixed_sizes = sorted(sizes), sorted(mixed_sizes)
        self.max_num_seqs = max_num_seqs or max(self.sizes[-1:] + [1])
        tokens = max(self.sizes[-1:] + self.mixed_sizes[-1:])
        reqs = max(self.sizes[-1:] + [self.mixed_reqs(t) for t in self.mixed_sizes[-1:]])
        self.input_ids = torch.zeros(tokens, dtype=torch.long, device=device)
        self.positions = torch.zeros(tokens, dtype=torch.long, device=device)
        self.slot_mapping = torch.full((tokens,), -1, dtype=torch.int32, device=device)
        # Decode buckets: one query a request, always. Mixed buckets: the step's, padded.
        self.query_start_loc = torch.arange(reqs + 1, dtype=torch.int32, device=device)
        self.mixed_query_start_loc = torch.zeros(reqs + 1, dtype=torch.int32, device=device)
        self.seq_lens = torch.zeros(reqs, dtype=torch.int32, device=device)
        self.block_table = torch.zeros(reqs, max_blocks_per_req, dtype=torch.int32,
                                       device=device)
        # (mixed, plain) -> bucket -> graph. Plain: with LoRA, the same bucket captured with
        # no LoRA layer active (adapter-free steps).
        self.tables: dict[tuple[bool, bool], dict[int, Graph]] = {
            (m, p): {} for m in (False, True) for p in (False, True)}
        self.graphs, self.plain_graphs = self.tables[False, False], self.tables[False, True]
        self.mixed_graphs = self.tables[True, False]
        self.pool = None
        self.memory_bytes = 0      # what capture() took on the device
        self.replays = 0
        self.plain_replays = 0
        self.mixed_replays = 0
        self.lora = lora
        self.lora_slots = None
        if lora is not None:
            from kvserve.lora.punica import StaticLoRASlots
            self.lora_slots = StaticLoRASlots(tokens, device)

    def mixed_reqs(self, tokens: int) -> int:
        """Requests a mixed bucket of this many tokens is captured for (its grid's)."""
        return min(tokens, self.max_num_seqs)

    def buckets(self) -> list[tuple[bool, int]]:
        """Every (mixed, size) bucket, largest first (later ones reuse its memory pool)."""
        return sorted([(False, b) for b in self.sizes] + [(True, t) for t in self.mixed_sizes],
                      key=lambda k: (k[1], k[0]), reverse=True)

    def static_bytes(self) -> int:
        """Device memory of the static input buffers every bucket reads."""
        bufs = [self.input_ids, self.positions, self.slot_mapping, self.query_start_loc,
                self.mixed_query_start_loc, self.seq_lens, self.block_table]
        if self.lora_slots is not None:
            bufs.append(self.lora_slots.buf)
        return sum(t.numel() * t.element_size() for t in bufs)

    def output_bytes(self, mixed: bool, b: int) -> int:
        """Bucket b's captured outputs (they live in the pool as long as their graphs)."""
        outs = [self.tables[mixed, p][b][1] for p in (False, True) if b in self.tables[mixed, p]]
        return sum(t.numel() * t.element_size() for t in outs)

    def _metadata(self, mixed: bool, b: int) -> TritonAttentionMetadata:
        if not mixed:
            return TritonAttentionMetadata(
                slot_mapping=self.slot_mapping[:b], query_start_loc=self.query_start_loc[:b + 1],
                seq_lens=self.seq_lens[:b], block_table=self.block_table[:b], num_reqs=b,
                decode_only=True)
        r = self.mixed_reqs(b)
        return TritonAttentionMetadata(
            slot_mapping=self.slot_mapping[:b], query_start_loc=self.mixed_query_start_loc[:r + 1],
            seq_lens=self.seq_lens[:r], block_table=self.block_table[:r], num_reqs=r,
            decode_only=False, padded=True)

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every bucket, largest first (later ones reuse its memory pool)."""
        t0 = time.perf_counter()
        before = torch.cuda.mem_get_info()[0]
        self.capture_buckets(self.buckets(), progress=True)
        torch.cuda.synchronize()
        torch.cuda.empty_cache()    # the warm-ups' temporaries: eager steps' memory, not graphs'
        self.memory_bytes = before - torch.cuda.mem_get_info()[0]
        logger.info("Graph capturing finished in %.1f s, took %.2f GiB (decode: %d sizes up to "
                    "%d requests; mixed: %d sizes up to %d tokens).", time.perf_counter() - t0,
                    self.memory_bytes / 2**30, len(self.sizes), max(self.sizes[-1:] + [0]),
                    len(self.mixed_sizes), max(self.mixed_sizes[-1:] + [0]))

    @torch.inference_mode()
    def capture_buckets(self, buckets: list[tuple[bool, int]], progress: bool = False) -> None:
        """Capture these (mixed, size) buckets in this order (with LoRA: each also without)."""
        from tqdm import tqdm
        try:
            for mixed, b in (tqdm(buckets, desc="Capturing CUDA graphs (FULL)")
                             if progress else buckets):
                self.static_inputs(b)
                self.tables[mixed, False][b] = self._capture_one(mixed, b)
                if self.lora is not None:        # the same bucket, LoRA layers idle
                    self.lora.mapping.clear()
                    self.tables[mixed, True][b] = self._capture_one(mixed, b)
        finally:
            if self.lora is not None:      # eager steps set their own mapping
                self.lora.mapping.clear()

    @torch.inference_mode()
    def warm_up(self, mixed: bool, b: int) -> None:
        """One eager run of a bucket's captured code: Triton compiles (and autotunes) here."""
        self.static_inputs(b)
        self._forward(mixed, b)
        if self.lora is not None:
            self.lora.mapping.clear()

    def _forward(self, mixed: bool, b: int) -> torch.Tensor:
        return self.model(self.input_ids[:b], self.positions[:b], self.kv_caches,
                          self._metadata(mixed, b))

    def _capture_one(self, mixed: bool, b: int) -> Graph:
        # Warm-up outside the graph: Triton compiles (and autotunes) here, not in capture.
        self._forward(mixed, b)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            out = self._forward(mixed, b)
        if self.pool is None:
            self.pool = graph.pool()
        return graph, out

    def static_inputs(self, b: int) -> None:
        """A b-token bucket's LoRA inputs for a capture (or an eager run of the captured code):
        the mapping in static mode over the first b rows of the slots buffer."""
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

    def bucket(self, meta: object, num_tokens: int) -> Optional[tuple[bool, int]]:
        """The (mixed, size) bucket this step replays, or None: it runs eagerly."""
        if (not isinstance(meta, TritonAttentionMetadata)
                or meta.block_table.shape[1] > self.block_table.shape[1]):
            return None
        if meta.decode_only:
            b = padded_batch_size(num_tokens, self.sizes)
            return None if b is None else (False, b)
        b = padded_batch_size(num_tokens, self.mixed_sizes)
        if b is None or meta.num_reqs > self.mixed_reqs(b):
            return None
        return True, b

    def stage(self, input_ids: torch.Tensor, positions: torch.Tensor,
              meta: TritonAttentionMetadata, bucket: tuple[bool, int]) -> None:
        """Copy this step into the static buffers, padded to its bucket (bucket()'s)."""
        n = input_ids.shape[0]
        mixed, b = bucket
        self.input_ids[:n].copy_(input_ids, non_blocking=True)
        self.positions[:n].copy_(positions, non_blocking=True)
        self.slot_mapping[:n].copy_(meta.slot_mapping, non_blocking=True)
        if b > n:     # padding tokens: write nothing
            self.slot_mapping[n:b].fill_(-1)
        self._stage_requests(meta, n, self.mixed_reqs(b) if mixed else b, mixed)

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor,
            meta: TritonAttentionMetadata, bucket: tuple[bool, int]) -> torch.Tensor:
        """Replay this step's bucket (bucket()'s, not None); returns hidden states [n, hidden]."""
        n = input_ids.shape[0]
        self.stage(input_ids, positions, meta, bucket)
        mixed, b = bucket
        if self.plain_graphs and self._adapter_free(n):
            graph, out = self.tables[mixed, True][b]
            self.plain_replays += 1
        else:
            self.fill_lora(n, b)
            graph, out = self.tables[mixed, False][b]
        graph.replay()
        self.replays += 1
        self.mixed_replays += mixed
        return out[:n]

    def _stage_requests(self, meta: TritonAttentionMetadata, n: int, reqs: int,
                        mixed: bool) -> None:
        """The step's R requests into the first R rows of the request buffers; rows [R, reqs)
        padding: seq_len 0 (attend to nothing) and, in a mixed bucket, no query."""
        R, w = meta.num_reqs, meta.block_table.shape[1]
        self.seq_lens[:R].copy_(meta.seq_lens, non_blocking=True)
        self.block_table[:R, :w].copy_(meta.block_table, non_blocking=True)
        if reqs > R:
            self.seq_lens[R:reqs].fill_(0)
        if mixed:
            self.mixed_query_start_loc[:R + 1].copy_(meta.query_start_loc, non_blocking=True)
            if reqs > R:
                self.mixed_query_start_loc[R + 1:reqs + 1].fill_(n)
