"""ModelRunner: turns a SchedulerOutput into one forward pass and the sampled tokens.

Per step: update the persistent InputBatch from the scheduler's diff, flatten every scheduled
request's new tokens into one super-sequence (decodes first, then prefill chunks) with
positions and a slot mapping into the paged KV cache, run the model once, compute logits only
at the positions that sample, and sample them all in one batched call.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Optional

import numpy as np
import torch

from kvserve.config import KVServeConfig
from kvserve.core.sched_output import LogprobsLists, ModelRunnerOutput, SchedulerOutput
from kvserve.attention import CommonAttentionMetadata, get_attn_backend
from kvserve.distributed.parallel_state import (is_first_pp_rank, is_last_pp_rank, pp_recv,
                                                pp_send)
from kvserve.distributed.pp_utils import IntermediateTensors
from kvserve.ops.quant.weight import decode_step as quant_decode_step
from kvserve.pooling.pooler import Pooler
from kvserve.sample.rejection_sampler import RejectionSampler, SampleLayout, SpecDecodeMetadata
from kvserve.sample.sampler import Sampler
from kvserve.spec_decode import make_spec_decode_runner
from kvserve.spec_decode.base import TargetHiddenStates
from kvserve.structured_output.bitmask import apply_grammar_bitmask
from kvserve.worker.async_output import AsyncRunnerOutput, AsyncTokenState
from kvserve.worker.input_batch import _NO_LOGPROBS, InputBatch
from kvserve.worker.staging import PinnedStaging

if TYPE_CHECKING:
    from kvserve.lora.manager import LoRAModelManager
    from kvserve.worker.cuda_graph import CUDAGraphRunner

logger = logging.getLogger(__name__)


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass
class StepInputs:
    req_ids: list[str]            # scheduled requests in flattened order
    rows: np.ndarray              # their InputBatch rows
    query_lens: np.ndarray
    query_starts: np.ndarray
    input_ids: torch.Tensor       # [T]
    positions: torch.Tensor       # [T]
    attn_metadata: Any            # the attention backend's metadata for this step
    common_attn_metadata: CommonAttentionMetadata
    sample_mask: np.ndarray       # [num_reqs] bool: this request samples a token this step

    def decode_only(self) -> bool:
        """Every token of the step is a decode (one query token of a running request)."""
        return self.common_attn_metadata.num_decodes == len(self.input_ids)


@dataclass
class _ScheduledOrder:
    """ModelRunner._scheduled_order's result, kept for the next step while every request
    decodes (num_decodes == len(rows))."""
    version: int                  # InputBatch.version it was built at (rows are valid then)
    req_ids: list[str]
    rows: np.ndarray
    qlens: np.ndarray
    num_decodes: int

    def __post_init__(self) -> None:
        self.arange = np.arange(len(self.rows))

    def freeze(self) -> "_ScheduledOrder":
        for a in (self.rows, self.qlens, self.arange):
            a.flags.writeable = False
        return self


class ModelRunner:
    def __init__(self, config: KVServeConfig, device: torch.device) -> None:
        self.config = config
        self.device = device
        mc = config.model_config
        self.dtype = mc.dtype
        self.kv_dtype = config.cache_config.kv_cache_dtype or mc.dtype
        self.block_size = config.cache_config.block_size
        self.max_model_len = mc.max_model_len
        self.max_blocks_per_req = cdiv(self.max_model_len, self.block_size)
        self.vocab_size = mc.vocab_size
        self.model: Optional[torch.nn.Module] = None
        self.kv_caches: list[torch.Tensor] = []
        self.sampler = Sampler()
        self.rejection_sampler = RejectionSampler()
        self.spec_decode = make_spec_decode_runner(config, device)
        self.attn_backend = get_attn_backend(config.attention_backend, device)
        self.cuda_graphs: Optional["CUDAGraphRunner"] = None   # set by capture_cuda_graphs
        # --runner pooling: pooled hidden states instead of sampled tokens (no LM head).
        self.pooler: Optional[Pooler] = (Pooler(mc) if mc.runner_type == "pooling" else None)
        self.lora_manager: Optional["LoRAModelManager"] = None  # set by load_model (--enable-lora)
        pc = config.parallel_config
        # Pipeline stage (set by load_model, once the process groups exist).
        self.is_first_stage = self.is_last_stage = True
        self.num_local_layers = mc.num_layers
        # With PP the engine core sends every sampled token back to all stages
        # (new_token_ids); the last stage then must not append it a second time.
        self.append_sampled_tokens = pc.pipeline_parallel_size == 1
        # Hybrid KV cache (sliding-window layers): one block table per group; [] = one table.
        self.kv_cache_groups = config.cache_config.kv_cache_groups
        self.input_batch = InputBatch(
            max_num_reqs=config.scheduler_config.max_num_seqs, max_model_len=self.max_model_len,
            max_blocks_per_req=self.max_blocks_per_req, vocab_size=self.vocab_size,
            device=device, num_kv_cache_groups=max(1, len(self.kv_cache_groups)))
        # Inputs to the device without a sync: one pinned buffer, one copy (CUDA).
        self.staging = PinnedStaging(device)
        self._last_order: Optional[_ScheduledOrder] = None   # see _scheduled_order
        # Async scheduling: sampled ids go to the host without a sync (worker/async_output.py).
        self.async_tokens: Optional[AsyncTokenState] = (
            AsyncTokenState(self.input_batch, device, self.append_sampled_tokens, self.staging)
            if config.scheduler_config.async_scheduling else None)

    # ------------------------------------------------------------------ set-up
    def load_model(self) -> None:
        from kvserve.model.loader import load_model
        self.is_first_stage, self.is_last_stage = is_first_pp_rank(), is_last_pp_rank()
        self.model = load_model(self.config.model_config, self.device)
        if self.spec_decode is not None:
            self.spec_decode.load_model(self.model)
        from kvserve.model.layers.attention import bind_attention_backend
        bind_attention_backend(self.model, self.attn_backend)
        if self.config.lora_config is not None:
            from kvserve.lora.manager import LoRAModelManager
            mc = self.config.model_config
            self.lora_manager = LoRAModelManager(self.model, self.config.lora_config,
                                                 mc.hf_config, self.dtype, self.device)
        # This pipeline stage's layers: the KV cache holds only theirs.
        self.num_local_layers = getattr(self.model, "num_local_layers",
                                        self.config.model_config.num_layers)
        if self.kv_cache_groups:
            from kvserve.worker.kv_cache_groups import bind_kv_cache_groups
            bind_kv_cache_groups(self.model, self.kv_cache_groups)

    def lora_manager_or_error(self) -> "LoRAModelManager":
        if self.lora_manager is None:
            raise ValueError("LoRA adapters need an engine started with --enable-lora.")
        return self.lora_manager

    def kv_cache_shape(self, num_blocks: int) -> tuple[int, ...]:
        from kvserve.model.loader import get_kv_cache_shape
        return get_kv_cache_shape(self.config.model_config, num_blocks, self.block_size,
                                  self.config.parallel_config.tensor_parallel_size)

    def kv_cache_bytes_per_block(self) -> int:
        shape = self.kv_cache_shape(1)
        per_layer = int(np.prod(shape)) * torch.empty((), dtype=self.kv_dtype).element_size()
        draft = self.spec_decode.kv_cache_bytes_per_block() if self.spec_decode else 0
        # Hybrid KV cache: a block id is one page of each group's layers (the groups' i-th
        # layers share a tensor), so a block costs one group's layers.
        layers = (len(self.kv_cache_groups[0].layer_ids) if self.kv_cache_groups
                  else self.num_local_layers)
        return per_layer * layers + draft

    def initialize_kv_cache(self, num_blocks: int) -> None:
        shape = self.kv_cache_shape(num_blocks)
        if self.kv_cache_groups:
            from kvserve.worker.kv_cache_groups import shared_kv_caches
            self.kv_caches = shared_kv_caches(self.kv_cache_groups, self.num_local_layers,
                                              shape, self.kv_dtype, self.device)
        else:
            from kvserve.model.huge_pages import zeroed_kv_caches
            self.kv_caches = zeroed_kv_caches(shape, self.kv_dtype, self.device,
                                              self.num_local_layers)
        if self.spec_decode is not None:
            self.spec_decode.initialize_kv_cache(num_blocks)

    def uses_cuda_graphs(self) -> bool:
        """Whether initialize_cache captures graphs: TRITON_ATTN on CUDA, not eager, and some
        bucket to capture (none for cudagraph_mode NONE, or capture sizes all above the
        limits). Graphs hold one whole-model step: not with PP stages; sliding windows take
        the torch path."""
        return (self.device.type == "cuda" and not self.config.enforce_eager
                and self.attn_backend.name == "TRITON_ATTN"
                and self.config.parallel_config.pipeline_parallel_size == 1
                and not self.kv_cache_groups and any(self.graph_buckets()))

    def graph_buckets(self) -> tuple[list[int], list[int]]:
        """(decode buckets, mixed-step buckets) from the compilation config. No mixed buckets
        for soft-capped attention: its prompt path (attention/windowed.py) walks the requests
        on the host."""
        sc = self.config.scheduler_config
        decode, mixed = self.config.compilation_config.graph_buckets(
            sc.max_num_seqs, sc.max_num_batched_tokens)
        assert self.model is not None
        if any(getattr(m, "logits_soft_cap", None) for m in self.model.modules()):
            mixed = []
        return decode, mixed

    def graph_runner(self, kv_caches: list[torch.Tensor], decode: list[int], mixed: list[int],
                     max_blocks_per_req: int) -> "CUDAGraphRunner":
        """Graphs over these caches (with LoRA: every LoRA layer, cuda_graph.py)."""
        from kvserve.worker.cuda_graph import CUDAGraphRunner
        assert self.model is not None
        return CUDAGraphRunner(self.model, kv_caches, decode, max_blocks_per_req, self.device,
                               lora=self.lora_manager, mixed_sizes=mixed,
                               max_num_seqs=self.config.scheduler_config.max_num_seqs)

    def capture_cuda_graphs(self) -> None:
        """Capture every graph bucket (when uses_cuda_graphs)."""
        if not self.uses_cuda_graphs():
            return
        decode, mixed = self.graph_buckets()
        self.cuda_graphs = self.graph_runner(self.kv_caches, decode, mixed,
                                             self.max_blocks_per_req)
        self.cuda_graphs.capture()

    def _forward(self, step: StepInputs, intermediate: Optional[IntermediateTensors] = None) -> Any:
        """Replay a captured graph for a step that fits a bucket, else eager.
        A later pipeline stage (intermediate tensors in) always runs eagerly."""
        assert self.model is not None
        graphs = self.cuda_graphs
        bucket = (graphs.bucket(step.attn_metadata, len(step.input_ids))
                  if intermediate is None and graphs is not None else None)
        if bucket is not None:
            assert graphs is not None
            return graphs.run(step.input_ids, step.positions, step.attn_metadata, bucket)
        # A step of decode tokens only lets packed GGUF weights keep more rows on their int8
        # kernel (ops/quant/weight.py, INT8_DECODE_MAX_ROWS); prompt rows keep the float path.
        with quant_decode_step(step.decode_only()):
            return self.model(step.input_ids, step.positions, self.kv_caches,
                              step.attn_metadata, intermediate)

    # ------------------------------------------------------------------ step
    @torch.inference_mode()
    def execute_model(self, scheduler_output: SchedulerOutput
                      ) -> "ModelRunnerOutput | AsyncRunnerOutput":
        asynch = self.async_tokens
        if asynch is not None:
            asynch.begin_step()
        self._update_states(scheduler_output)
        if scheduler_output.total_num_scheduled_tokens == 0:
            return ModelRunnerOutput(req_ids=[], sampled_token_ids=[])
        step = self._prepare_inputs(scheduler_output)
        assert self.model is not None
        if self.lora_manager is not None:
            self.lora_manager.prepare_step(step.req_ids, step.query_lens)
        intermediate = None if self.is_first_stage else self._recv_intermediate(len(step.positions))
        hidden = self._forward(step, intermediate)
        if asynch is not None:   # the forward is launched: now wait for the last step's ids
            asynch.resolve_pending()
        if not self.is_last_stage:
            pp_send(hidden.pack())
            self.input_batch.num_computed_tokens[step.rows] += step.query_lens
            return ModelRunnerOutput(req_ids=[], sampled_token_ids=[])
        if self.pooler is not None:
            return self._pool(step, hidden)

        sample_idx = np.flatnonzero(step.sample_mask)
        sampled_lists: list[list[int]] = [[] for _ in step.req_ids]
        logprobs: dict[str, LogprobsLists] = {}
        if len(sample_idx):
            self._sample(scheduler_output, step, hidden, sample_idx, sampled_lists, logprobs)
        self.input_batch.num_computed_tokens[step.rows] += step.query_lens
        prompt_logprobs = self._prompt_logprobs(step, hidden)
        start = time.perf_counter()
        drafts = self._propose_drafts(scheduler_output, step, step.rows[sample_idx], hidden)
        output = ModelRunnerOutput(
            req_ids=step.req_ids, sampled_token_ids=sampled_lists,
            logprobs=logprobs or None, prompt_logprobs=prompt_logprobs or None,
            spec_token_ids=drafts, spec_propose_time=time.perf_counter() - start)
        if asynch is None:
            return output
        return AsyncRunnerOutput(output, asynch.pending, sample_idx)

    def _pool(self, step: StepInputs, hidden: torch.Tensor) -> ModelRunnerOutput:
        """Pooling runner: the pooled vectors of the prompts that end this step; no logits."""
        assert self.pooler is not None
        ib = self.input_batch
        pooled = self.pooler.pool(step.req_ids, hidden, step.query_starts, step.query_lens,
                                  ib.num_computed_tokens[step.rows],
                                  ib.num_prompt_tokens[step.rows])
        ib.num_computed_tokens[step.rows] += step.query_lens
        return ModelRunnerOutput(req_ids=step.req_ids,
                                 sampled_token_ids=[[] for _ in step.req_ids],
                                 pooler_output=pooled)

    def _sample(self, so: SchedulerOutput, step: StepInputs, hidden: torch.Tensor,
                sample_idx: np.ndarray, sampled_lists: list[list[int]],
                logprobs: dict[str, LogprobsLists]) -> None:
        """Score each sampling request's k drafts + its bonus position (k = 0 without
        speculation), mask the rows of constrained requests, sample, append the tokens."""
        assert self.model is not None
        layout = SampleLayout.make(step.req_ids, sample_idx, step.query_starts + step.query_lens,
                                   so.scheduled_spec_decode_tokens)
        if self.lora_manager is not None:    # LoRA on lm_head: each scored row's adapter
            self.lora_manager.set_logits_rows(layout.logits_indices)
        with quant_decode_step(step.decode_only()):    # as the forward (_forward)
            logits = self.model.compute_logits(self._scored_rows(hidden, layout.logits_indices))
        if so.grammar_bitmask is not None:   # one bitmask row per draft + the bonus row
            first_row = {step.req_ids[i]: int(layout.row_starts[s])
                         for s, i in enumerate(sample_idx)}
            logits = self._apply_grammar_bitmask(so, first_row, logits)
        sample_rows = step.rows[sample_idx]
        if self.async_tokens is not None and self._sample_async(step, logits, sample_idx):
            return
        tokens, lps = self._sample_tokens(logits, layout, sample_rows)
        ib = self.input_batch
        if self.append_sampled_tokens:
            if layout.draft_token_ids:
                for row, toks in zip(sample_rows.tolist(), tokens):
                    for tok in toks:
                        ib.append_token(row, tok)
            else:    # one token a request: vectorised
                ib.append_one_each(sample_rows, [t[0] for t in tokens])
        if len(sample_idx) == len(sampled_lists):   # every request samples (a decode step)
            sampled_lists[:] = tokens
        else:
            for s, i in enumerate(sample_idx.tolist()):
                sampled_lists[i] = tokens[s]
        for s, lp in enumerate(lps):
            if lp is not None:
                logprobs[step.req_ids[sample_idx[s]]] = lp

    def _scored_rows(self, hidden: torch.Tensor, logits_indices: np.ndarray) -> torch.Tensor:
        """hidden's rows at logits_indices (increasing). Rows 0..n-1 (a decode step without
        drafts: one row per request, in order) are a view: no upload, no gather kernel."""
        n = len(logits_indices)
        if n and int(logits_indices[-1]) == n - 1:
            return hidden[:n]
        rows, = self.staging.upload(logits_indices)
        return hidden[rows]

    def _sample_async(self, step: StepInputs, logits: torch.Tensor,
                      sample_idx: np.ndarray) -> bool:
        """Async scheduling, plain sampling without logprobs (the usual step): sample and
        start the non-blocking copy of the ids; False where the step needs host lists now."""
        sample_rows = step.rows[sample_idx]
        ib = self.input_batch
        if (ib.logprobs[sample_rows] != _NO_LOGPROBS).any():
            return False
        out = self.sampler(logits, ib.make_sampling_metadata(sample_rows))
        assert self.async_tokens is not None
        self.async_tokens.start([step.req_ids[i] for i in sample_idx], out.sampled_token_ids)
        return True

    def _sample_tokens(self, logits: torch.Tensor, layout: SampleLayout, sample_rows: np.ndarray
                       ) -> tuple[list[list[int]], list[Optional[LogprobsLists]]]:
        """Tokens per sampling request (accepted drafts + 1) and their logprobs (if asked).
        With no drafts in the step the RejectionSampler reduces to the plain Sampler (the
        bonus row alone, drawn the same way), which is called directly: it is cheaper."""
        ib = self.input_batch
        k = layout.num_drafts
        if layout.draft_token_ids:
            rows = np.repeat(sample_rows, np.asarray(k) + 1)
            drafts_of = np.split(np.asarray(layout.draft_token_ids, dtype=np.int64),
                                 np.cumsum(k)[:-1])
            prefixes = [d[:j].tolist() for d in drafts_of for j in range(len(d) + 1)]
            spec_meta = SpecDecodeMetadata.make(k, layout.draft_token_ids, logits.device)
            out: Any = self.rejection_sampler(logits, ib.make_sampling_metadata(rows, prefixes),
                                              spec_meta, ib.seeded_generators(sample_rows))
            counts = out.num_sampled.tolist()
            tokens = [t[:c] for t, c in zip(out.output_token_ids.tolist(), counts)]
        else:
            out = self.sampler(logits, ib.make_sampling_metadata(sample_rows))
            tokens = [[t] for t in out.sampled_token_ids.tolist()]
            counts = [1] * len(tokens)
        lps: list[Optional[LogprobsLists]] = [None] * len(k)
        if out.logprobs is not None:
            lp_ids, lp_vals = out.logprob_token_ids.tolist(), out.logprobs.tolist()
            ranks = out.sampled_token_ranks.tolist()
            for s, row in enumerate(sample_rows):
                want = ib.params[row].logprobs
                if want is None:
                    continue
                a = int(layout.row_starts[s])
                b = a + counts[s]
                width = len(lp_ids[a]) if want == -1 else want + 1
                lps[s] = LogprobsLists([r[:width] for r in lp_ids[a:b]],
                                       [r[:width] for r in lp_vals[a:b]], ranks[a:b])
        return tokens, lps

    def _propose_drafts(self, so: SchedulerOutput, step: StepInputs, sample_rows: np.ndarray,
                        hidden: torch.Tensor) -> Optional[list[list[int]]]:
        if self.spec_decode is None:
            return None
        target = None
        if self.spec_decode.uses_target_hidden:   # EAGLE reads the step's hidden states
            target = TargetHiddenStates(
                rows=step.rows, context_lens=step.common_attn_metadata.context_lens,
                query_lens=step.query_lens, query_starts=step.query_starts,
                sample_mask=step.sample_mask, hidden=hidden)
        drafts = self.spec_decode.propose(self.input_batch, sample_rows,
                                          so.spec_decode_draft_req_ids, len(step.req_ids),
                                          target=target,
                                          num_draft_tokens=so.spec_decode_num_draft_tokens)
        out: list[list[int]] = [[] for _ in step.req_ids]
        for i, d in zip(np.nonzero(step.sample_mask)[0], drafts):
            out[i] = d
        return out

    def _recv_intermediate(self, num_tokens: int) -> IntermediateTensors:
        shape = (2, num_tokens, self.config.model_config.hidden_size)
        return IntermediateTensors.unpack(pp_recv(shape, self.dtype, self.device))

    def _update_states(self, so: SchedulerOutput) -> None:
        ib = self.input_batch
        ib.remove_requests(so.finished_req_ids | so.preempted_req_ids)
        if self.pooler is not None:
            self.pooler.update_states(so)
        if self.lora_manager is not None:
            self.lora_manager.update_requests(so)
        if self.spec_decode is not None:
            self.spec_decode.drop(so.finished_req_ids | so.preempted_req_ids)
        for new in so.scheduled_new_reqs:
            ib.add_request(new)
        cached = so.scheduled_cached_reqs
        new_tokens = cached.new_token_ids or [[]] * len(cached.req_ids)
        for rid, blocks, num_computed, tokens in zip(cached.req_ids, cached.new_block_ids,
                                                     cached.num_computed_tokens, new_tokens):
            row = ib.req_id_to_index[rid]
            ib.append_blocks(row, blocks)
            ib.num_computed_tokens[row] = num_computed
            for token in tokens:   # sampled on the last PP stage, or jump-forward tokens
                ib.append_token(row, token)
        if self.spec_decode is not None and so.scheduled_spec_decode_tokens:
            self.spec_decode.write_drafts(ib, so)

    @staticmethod
    def _apply_grammar_bitmask(so: SchedulerOutput, logits_row: dict[str, int],
                               logits: torch.Tensor) -> torch.Tensor:
        """The structured output requests' rows of the bitmask, onto their logits rows: a
        request with k drafts owns k + 1 of each, from its first row (logits_row[rid]) on."""
        ids = so.structured_output_request_ids
        first = np.fromiter((logits_row[rid] for rid in ids), np.int64, len(ids))
        spec = so.scheduled_spec_decode_tokens
        counts = np.fromiter((len(spec.get(rid, ())) + 1 for rid in ids), np.int64, len(ids))
        offset = np.arange(int(counts.sum())) - np.repeat(np.cumsum(counts) - counts, counts)
        rows = np.repeat(first, counts) + offset
        return apply_grammar_bitmask(logits, so.grammar_bitmask, rows)

    def _scheduled_order(self, so: SchedulerOutput) -> _ScheduledOrder:
        """The step's requests in flattened order: single-token queries (decodes) first, as
        they share one batched attention call. A decode loop's steps schedule the same
        requests in the same order over the same batch: they reuse the last step's arrays
        (read-only, so that a consumer that wrote to them would fail at once)."""
        ib = self.input_batch
        req_ids = list(so.num_scheduled_tokens)
        cached = self._last_order
        if (cached is not None and cached.version == ib.version and cached.req_ids == req_ids
                and max(so.num_scheduled_tokens.values()) == 1):
            return cached
        n = len(req_ids)
        rows = np.fromiter((ib.req_id_to_index[r] for r in req_ids), np.int64, n)
        qlens = np.fromiter(so.num_scheduled_tokens.values(), np.int64, n)
        num_decodes = int(np.count_nonzero(qlens == 1))
        if num_decodes < n:
            order = np.argsort(qlens != 1, kind="stable")
            rows, qlens = rows[order], qlens[order]
            req_ids = [req_ids[i] for i in order]
        result = _ScheduledOrder(ib.version, req_ids, rows, qlens, num_decodes)
        self._last_order = result.freeze() if num_decodes == n else None
        return result

    def _prepare_inputs(self, so: SchedulerOutput) -> StepInputs:
        ib, bs = self.input_batch, self.block_size
        sched = self._scheduled_order(so)
        req_ids, rows, qlens, num_decodes = sched.req_ids, sched.rows, sched.qlens, sched.num_decodes
        computed = ib.num_computed_tokens[rows]
        if num_decodes == len(rows):
            # One token a request: token i is request i's, at its first uncomputed position.
            starts = tok_req = sched.arange
            positions, tok_rows = computed, rows
        else:
            ends = np.cumsum(qlens)
            starts = ends - qlens
            tok_req = np.repeat(np.arange(len(rows)), qlens)
            positions = computed[tok_req] + (np.arange(int(ends[-1])) - starts[tok_req])
            tok_rows = rows[tok_req]
        input_ids = ib.token_ids[tok_rows, positions]
        slot_mapping = ib.block_table[tok_rows, positions // bs] * bs + positions % bs
        seq_lens = computed + qlens
        sample_mask = seq_lens >= ib.num_tokens[rows]

        common = CommonAttentionMetadata(
            num_decodes=num_decodes, query_starts=starts, query_lens=qlens,
            context_lens=computed, slot_mapping=slot_mapping, block_size=bs,
            block_table=ib.block_table[rows, :cdiv(int(seq_lens.max()), bs)])
        if self.kv_cache_groups:
            from kvserve.worker.kv_cache_groups import build_group_metadata
            meta = build_group_metadata(self.attn_backend, common, ib.block_tables, rows,
                                        tok_rows, positions)
        else:
            meta = self.attn_backend.build_metadata(common)
        input_ids_dev, positions_dev = self.staging.upload(input_ids, positions)
        if self.async_tokens is not None:
            self.async_tokens.fill_placeholders(input_ids_dev, positions, tok_rows, tok_req,
                                                req_ids)
        return StepInputs(
            req_ids=req_ids, rows=rows, query_lens=qlens, query_starts=starts,
            input_ids=input_ids_dev,
            positions=positions_dev,
            attn_metadata=meta, common_attn_metadata=common, sample_mask=sample_mask)

    def _prompt_logprobs(self, step: StepInputs, hidden: torch.Tensor) -> dict[str, LogprobsLists]:
        """Logprobs of prompt tokens 1..P-1 computed in this step's chunk (for requests that
        asked): the logits at position p score prompt token p+1."""
        ib = self.input_batch
        result: dict[str, LogprobsLists] = {}
        for i, (rid, row) in enumerate(zip(step.req_ids, step.rows)):
            k = ib.params[row].prompt_logprobs
            if k is None:
                continue
            ctx = int(ib.num_computed_tokens[row] - step.query_lens[i])   # already advanced
            last = min(ctx + int(step.query_lens[i]), int(ib.num_prompt_tokens[row]) - 1)
            if last <= ctx:
                continue
            start = int(step.query_starts[i])
            h = hidden[start:start + (last - ctx)]
            if self.lora_manager is not None:
                self.lora_manager.set_logits_rows(np.arange(start, start + (last - ctx)))
            lp = torch.log_softmax(self.model.compute_logits(h).float(), dim=-1)
            targets = torch.from_numpy(ib.token_ids[row, ctx + 1:last + 1].copy()).to(lp.device)
            target_lp = lp.gather(1, targets[:, None])
            ranks = (lp > target_lp).sum(dim=1) + 1
            width = lp.shape[1] if k == -1 else k
            top_vals, top_ids = lp.topk(width, dim=1) if width else (lp[:, :0], targets[:, None][:, :0])
            ids = torch.cat([targets[:, None], top_ids], dim=1)
            vals = torch.cat([target_lp, top_vals], dim=1)
            result[rid] = LogprobsLists(ids.tolist(), vals.tolist(), ranks.tolist())
        return result
