"""EAGLE-1 proposer for Llama targets: a one-layer head over the target's hidden states.

The head (vLLM's EagleLlamaForCausalLM), at position p:

    x   = fc(cat(embed(token[p + 1]), h[p]))     h[p]: the target's final (normed) hidden
    out = decoder_layer(x) + residual            state at p; no input_layernorm on layer 0
                                                 and no final norm (EAGLE's cnets, as vLLM)
    draft for position p + 2 = argmax(lm_head(out))

`embed` and `lm_head` are the target's unless the checkpoint has its own. Checkpoint layout
(vLLM's for EAGLE-Llama, e.g. yuhuili/EAGLE-LLaMA3-Instruct-8B): config.json (a Llama config,
usually num_hidden_layers 1) and tensors `fc.weight` [hidden, 2 * hidden] (+ `fc.bias`),
`layers.0.*`, optionally `embed_tokens.weight` / `lm_head.weight`, with or without a
`model.` prefix; `layers.0.input_layernorm.weight` may be present and is unused (as in EAGLE).

Per step (the target's hidden states of the step's tokens come from the model runner):
  1. the head runs over every fed request's positions p in [context, min(context + q, N - 1))
     (N: tokens after this step's sampling): its KV for those positions, and for drafting
     requests its output at p = N - 2 (the last accepted position, paired with the newly
     sampled token) -> draft 1;
  2. draft j + 1 (j >= 1): position N - 2 + j, input (embed(draft j), the head's own output
     from the previous position), as vLLM does.
Drafts are argmax: q is one-hot, so the rejection sampler stays exact. The head's KV is its own
tensor indexed by the target's block ids (draft_kv.py); the scheduler allocates
`num_speculative_tokens` lookahead slots, where step 2 writes.

A request whose step the head does not see (it is not drafting: the adaptive rule switched it
off) keeps stale head KV at those positions; only the acceptance rate suffers, never outputs.
"""
from __future__ import annotations

import os
from typing import Iterator, Optional

import numpy as np
import torch
from torch import nn

from kvserve.config import KVServeConfig, ModelConfig
from kvserve.model.layers.attention import AttentionMetadata
from kvserve.model.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from kvserve.model.layers.linear import default_weight_loader
from kvserve.model.llama import LlamaDecoderLayer, LlamaForCausalLM
from kvserve.spec_decode.base import TargetHiddenStates
from kvserve.spec_decode.draft_kv import OwnKVProposer, make_draft_batch
from kvserve.worker.input_batch import InputBatch

# Checkpoint tensors EAGLE-1 never uses (vLLM skips them too).
_UNUSED = ("layers.0.input_layernorm.weight", "norm.weight")


def eagle_weight_shapes(path: str) -> dict[str, tuple[int, ...]]:
    """Tensor name (no `model.` prefix) -> shape, read from the checkpoint headers only."""
    shapes = {}
    for name, get_shape in _checkpoint_tensors(path, shapes_only=True):
        shapes[_strip(name)] = tuple(get_shape)
    return shapes


def _strip(name: str) -> str:
    return name[len("model."):] if name.startswith("model.") else name


def _checkpoint_tensors(path: str, shapes_only: bool = False) -> Iterator[tuple[str, object]]:
    """(name, tensor) from model*.safetensors, or pytorch_model.bin (EAGLE's own releases);
    with shapes_only, (name, shape) without reading the data."""
    from kvserve.model.loader import safetensors_files
    bin_file = os.path.join(path, "pytorch_model.bin")
    try:
        files = safetensors_files(path)
    except FileNotFoundError:
        if not os.path.isfile(bin_file):
            raise
        state = torch.load(bin_file, map_location="cpu", weights_only=True, mmap=True)
        for name, t in state.items():
            yield name, (t.shape if shapes_only else t)
        return
    from safetensors import safe_open
    for file in files:
        with safe_open(file, framework="pt", device="cpu") as f:
            for name in f.keys():
                yield name, (f.get_slice(name).get_shape() if shapes_only else f.get_tensor(name))


class EagleHead(nn.Module):
    """fc + the decoder layer(s); embed_tokens / lm_head only when the checkpoint has them."""

    def __init__(self, config: ModelConfig, fc_bias: bool, own_embed: bool,
                 own_lm_head: bool) -> None:
        super().__init__()
        h = config.hidden_size
        self.fc = nn.Linear(2 * h, h, bias=fc_bias)
        flags = LlamaForCausalLM.decoder_flags(config.hf_config)
        self.layers = nn.ModuleList(LlamaDecoderLayer(config, flags)
                                    for _ in range(config.num_layers))
        # EAGLE feeds fc's output to layer 0 without a norm.
        self.layers[0].input_layernorm = nn.Identity()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, h) if own_embed else None
        self.lm_head = ParallelLMHead(config.vocab_size, h) if own_lm_head else None

    def forward(self, embeds: torch.Tensor, positions: torch.Tensor, hidden: torch.Tensor,
                kv_caches: list[torch.Tensor], meta: AttentionMetadata) -> torch.Tensor:
        x = self.fc(torch.cat([embeds, hidden.to(embeds.dtype)], dim=-1))
        residual = None
        for layer, kv_cache in zip(self.layers, kv_caches):
            x, residual = layer(positions, x, residual, kv_cache, meta)
        return x + residual

    def load_weights(self, weights: Iterator[tuple[str, torch.Tensor]]) -> set[str]:
        params = dict(self.named_parameters())
        packed = LlamaForCausalLM.packed_modules_mapping
        loaded: set[str] = set()
        for raw, tensor in weights:
            name = _strip(raw)
            if name in _UNUSED or "rotary_emb.inv_freq" in name:
                continue
            parts = name.split(".")
            shard_id = None
            if len(parts) >= 2 and parts[-2] in packed:
                parts[-2], shard_id = packed[parts[-2]]
            param = params.get(".".join(parts))
            if param is None:
                raise ValueError(f"EAGLE checkpoint tensor {raw!r} matches nothing of an "
                                 "EAGLE-Llama head (fc, layers.N.*, embed_tokens, lm_head).")
            getattr(param, "weight_loader", default_weight_loader)(param, tensor, shard_id)
            loaded.add(".".join(parts))
        return loaded


class EagleProposer(OwnKVProposer):
    uses_target_hidden = True

    def __init__(self, config: KVServeConfig, device: torch.device) -> None:
        super().__init__(config, device)
        self.head: Optional[EagleHead] = None
        self.embed_tokens: Optional[nn.Module] = None
        self.lm_head: Optional[ParallelLMHead] = None

    # ------------------------------------------------------------------ set-up
    def load_model(self, target_model: nn.Module) -> None:
        from kvserve.model.loader import build_and_load
        mc = self.model_config
        shapes = eagle_weight_shapes(mc.model)
        head = build_and_load(
            lambda: EagleHead(mc, "fc.bias" in shapes, "embed_tokens.weight" in shapes,
                              "lm_head.weight" in shapes),
            _checkpoint_tensors(mc.model), mc, self.device)
        assert isinstance(head, EagleHead)
        self.head = head
        # The target's, unless the checkpoint brings its own (vLLM always uses the target's
        # embedding; see the module docstring).
        self.embed_tokens = (head.embed_tokens if head.embed_tokens is not None
                             else target_model.model.embed_tokens)
        self.lm_head = head.lm_head if head.lm_head is not None else target_model.lm_head

    def drop(self, req_ids: set[str]) -> None:
        pass   # no per-request state: the head's KV lives in the requests' blocks

    # ------------------------------------------------------------------ propose
    @torch.inference_mode()
    def propose(self, ib: InputBatch, rows: np.ndarray, num_drafts: np.ndarray,
                target: TargetHiddenStates) -> list[list[int]]:
        result: list[list[int]] = [[] for _ in rows]
        out, last_of_row = self._run_step_positions(ib, target)
        active = np.nonzero(num_drafts > 0)[0]
        if not len(active):
            return result
        rows_a, k = rows[active], num_drafts[active]
        last = last_of_row[rows_a]
        assert (last >= 0).all(), "a drafting request's step was not fed to the head"
        hidden = out[torch.from_numpy(last).to(self.device)]
        n = ib.num_tokens[rows_a].astype(np.int64)
        drafts = np.zeros((len(rows_a), int(k.max())), dtype=np.int64)
        drafts[:, 0] = self._argmax(hidden)
        for j in range(1, int(k.max())):
            on = np.nonzero(k > j)[0]
            on_t = torch.from_numpy(on).to(self.device)
            pos = n[on] - 2 + j
            step_out = self._forward(ib, rows_a[on], pos, np.ones(len(on), np.int64),
                                     drafts[on, j - 1], pos, hidden[on_t])
            hidden[on_t] = step_out
            drafts[on, j] = self._argmax(step_out)
        for i in range(len(rows_a)):
            result[active[i]] = drafts[i, :k[i]].tolist()
        return result

    def _run_step_positions(self, ib: InputBatch,
                            target: TargetHiddenStates) -> tuple[torch.Tensor, np.ndarray]:
        """Step 1: the head over the fed requests' positions of this step (those whose next
        token is known). Returns its outputs and, per input-batch row, the index of the row's
        last output (-1: not run)."""
        feed = target.feed if target.feed is not None else np.ones(len(target.rows), bool)
        rows, ctx = target.rows[feed], target.context_lens[feed]
        qlens, starts = target.query_lens[feed], target.query_starts[feed]
        n = ib.num_tokens[rows]
        m = np.maximum(np.minimum(ctx + qlens, n - 1) - ctx, 0)
        keep = m > 0
        rows, ctx, m, starts = rows[keep], ctx[keep], m[keep], starts[keep]
        last_of_row = np.full(ib.token_ids.shape[0], -1, dtype=np.int64)
        if not len(rows):
            return target.hidden[:0], last_of_row
        ends = np.cumsum(m)
        owner = np.repeat(np.arange(len(rows)), m)
        offsets = np.arange(int(ends[-1])) - (ends - m)[owner]
        positions = ctx[owner] + offsets
        input_ids = ib.token_ids[rows[owner], positions + 1]     # the token after each position
        hidden = target.hidden[torch.from_numpy(starts[owner] + offsets).to(self.device)]
        last_of_row[rows] = ends - 1
        return self._forward(ib, rows, ctx, m, input_ids, positions, hidden), last_of_row

    def _forward(self, ib: InputBatch, rows: np.ndarray, computed: np.ndarray,
                 qlens: np.ndarray, input_ids: np.ndarray, positions: np.ndarray,
                 hidden: torch.Tensor) -> torch.Tensor:
        """One head forward over `rows` (query tokens flattened in row order); returns the
        head's outputs in that order."""
        assert self.head is not None and self.embed_tokens is not None
        dev = self.device
        batch = make_draft_batch(ib.block_table, rows, computed, qlens, positions,
                                 self.block_size, dev)
        tok = torch.from_numpy(batch.token_order).to(dev)
        embeds = self.embed_tokens(torch.from_numpy(input_ids[batch.token_order]).to(dev))
        out_o = self.head(embeds, torch.from_numpy(batch.positions).to(dev), hidden[tok],
                          self.kv_caches, batch.metadata)
        out = torch.empty_like(out_o)
        out[tok] = out_o
        return out

    def _argmax(self, hidden: torch.Tensor) -> np.ndarray:
        assert self.lm_head is not None
        return self.lm_head.compute_logits(hidden).argmax(dim=-1).cpu().numpy()
