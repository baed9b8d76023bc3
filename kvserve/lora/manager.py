"""LoRAModelManager: the worker's side of multi-LoRA.

    adapters on disk --add_adapter (RPC at add-request time)--> CPU LRU (--max-cpu-loras)
    CPU LRU --prepare_step (only adapters not in a slot yet)--> slots (--max-loras), stacked
                                                               into every LoRALinear
Per step, `prepare_step` gives every scheduled token its adapter's slot (-1: base model) and
sets the shared LoRAMapping the layers read. The scheduler admits at most --max-loras distinct
adapters among running requests, so a step's adapters always fit the slots; a slot whose
adapter the step does not use is reused, least recently used first.
"""
from __future__ import annotations

import logging
import time
from collections import OrderedDict
from typing import TYPE_CHECKING, Optional, Union

import numpy as np
import torch
from torch import nn

from kvserve.lora.config import LoRAConfig, stack_dtype
from kvserve.lora.layers import (LogitsRows, LoRAEmbedding, LoRALinear, LoRALogits, ShardId,
                                 SortedTokens)
from kvserve.lora.peft_loader import OUTSIDE_LAYERS, LoRAModel, load_adapter
from kvserve.lora.punica import LoRAMapping, triton_available
from kvserve.lora.request import LoRARequest
from kvserve.model.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from kvserve.model.layers.linear import (LinearBase, MergedColumnParallelLinear,
                                         QKVParallelLinear, RowParallelLinear)

if TYPE_CHECKING:
    from kvserve.core.sched_output import SchedulerOutput

logger = logging.getLogger(__name__)

# Base layer name -> the PEFT modules fused into it, with their shard ids in its weight_loader.
_FUSED: dict[str, list[tuple[str, ShardId]]] = {
    "qkv_proj": [("q_proj", "q"), ("k_proj", "k"), ("v_proj", "v")],
    "gate_up_proj": [("gate_proj", 0), ("up_proj", 1)],
    "o_proj": [("o_proj", None)],
    "down_proj": [("down_proj", None)],
}
_LAYER_TYPES = {"qkv_proj": QKVParallelLinear, "gate_up_proj": MergedColumnParallelLinear,
                "o_proj": RowParallelLinear, "down_proj": RowParallelLinear}


LoRALayer = Union[LoRALinear, LoRAEmbedding, LoRALogits]


def wrap_model(model: nn.Module, lora_config: LoRAConfig, mapping: LoRAMapping,
               logits_rows: LogitsRows, sorted_tokens: Optional[SortedTokens] = None
               ) -> dict[tuple[int, str], LoRALayer]:
    """Put a LoRALinear on every q/k/v/o and gate/up/down linear of this rank's layers, and
    the LoRA of the token embedding and the LM head where this rank holds them."""
    layers: dict[tuple[int, str], LoRALayer] = {}
    for name, module in model.named_modules():
        parts = name.split(".")
        if not isinstance(module, LinearBase) or len(parts) < 3 or parts[-1] not in _FUSED:
            continue
        if not isinstance(module, _LAYER_TYPES[parts[-1]]) or "layers" not in parts:
            raise ValueError(f"LoRA: {type(model).__name__}.{name} is a "
                             f"{type(module).__name__}; kvserve's LoRA layers expect the "
                             f"Llama-family layout.")
        layer_idx = int(parts[parts.index("layers") + 1])
        lora = LoRALinear(module, _FUSED[parts[-1]], lora_config.max_loras,
                          lora_config.max_lora_rank, mapping, sorted_tokens,
                          stack_dtype(lora_config.lora_dtype, module.weight.dtype,
                                      module.weight.device))
        module.lora = lora
        layers[(layer_idx, parts[-1])] = lora
    if not layers:
        raise ValueError(f"LoRA: {type(model).__name__} has no linear layer kvserve can put "
                         f"LoRA on (supported: Llama, Mistral, Qwen2, Qwen3).")
    _wrap_vocab_layers(model, lora_config, mapping, logits_rows, layers)
    # The fused small-decode C++ op runs whole layers without the Python linears: the model
    # skips it in steps with adapter tokens.
    inner = getattr(model, "model", None)
    if inner is not None and hasattr(inner, "lora_mapping"):
        inner.lora_mapping = mapping
    return layers


def _wrap_vocab_layers(model: nn.Module, lora_config: LoRAConfig, mapping: LoRAMapping,
                       logits_rows: LogitsRows, layers: dict) -> None:
    """LoRAEmbedding on model.embed_tokens, LoRALogits on lm_head (a tied head shares the base
    weight, not the adapter: PEFT keeps separate LoRA weights for the two)."""
    n, rank = lora_config.max_loras, lora_config.max_lora_rank
    embed = getattr(getattr(model, "model", None), "embed_tokens", None)
    if isinstance(embed, VocabParallelEmbedding):
        embed.lora = LoRAEmbedding(embed, n, rank, mapping, stack_dtype(
            lora_config.lora_dtype, embed.linear_weight.act_dtype, embed.weight.device))
        layers[(OUTSIDE_LAYERS, "embed_tokens")] = embed.lora
    head = getattr(model, "lm_head", None)
    if isinstance(head, ParallelLMHead):
        head.lora = LoRALogits(head, n, rank, logits_rows, stack_dtype(
            lora_config.lora_dtype, head.linear_weight.act_dtype, head.weight.device))
        layers[(OUTSIDE_LAYERS, "lm_head")] = head.lora


class LoRAModelManager:
    def __init__(self, model: nn.Module, lora_config: LoRAConfig, hf_config: dict,
                 dtype: torch.dtype, device: torch.device) -> None:
        self.config = lora_config
        self.hf_config = hf_config
        # Adapters are read in the stacks' dtype (--lora-dtype; auto: the model's).
        self.dtype = stack_dtype(lora_config.lora_dtype, dtype, device)
        self.device = device
        self.mapping = LoRAMapping()
        self.logits_rows = LogitsRows()
        self.sorted_tokens = SortedTokens()
        self.layers = wrap_model(model, lora_config, self.mapping, self.logits_rows,
                                 self.sorted_tokens)
        self._cpu_cache: "OrderedDict[int, LoRAModel]" = OrderedDict()   # LRU, oldest first
        self._requests: dict[int, LoRARequest] = {}       # every adapter seen, by id
        self._slots: list[Optional[int]] = [None] * lora_config.max_loras
        self._slot_used: list[float] = [0.0] * lora_config.max_loras
        self._req_lora: dict[str, int] = {}               # request id -> lora_int_id
        self._req_lora_version = 0                        # bumped when _req_lora changes
        # What the last mapping was built from (prepare_step reuses it while that holds).
        self._step_key: Optional[tuple] = None
        self._step_active: list[int] = []
        self.last_load_s = 0.0

    # ------------------------------------------------------------------ adapters
    def add_adapter(self, lora: LoRARequest) -> bool:
        """Load the adapter into the CPU LRU (from disk unless cached). False if it was cached."""
        known = self._requests.get(lora.lora_int_id)
        if known is not None and known.lora_path != lora.lora_path:
            self.remove_adapter(lora.lora_int_id)    # the same id now names another adapter
        self._requests[lora.lora_int_id] = lora
        if lora.lora_int_id in self._cpu_cache:
            self._cpu_cache.move_to_end(lora.lora_int_id)
            return False
        start = time.perf_counter()
        model = load_adapter(lora.lora_int_id, lora.lora_name, lora.lora_path, self.config,
                             self.hf_config, self.dtype)
        self.last_load_s = time.perf_counter() - start
        self._cpu_cache[lora.lora_int_id] = model
        # The least recently used go; slots keep their own copy of an evicted adapter.
        while len(self._cpu_cache) > self.config.max_cpu_loras:
            del self._cpu_cache[next(iter(self._cpu_cache))]
        logger.info("LoRA adapter %r (id %d, rank %d) loaded in %.3f s", lora.lora_name,
                    lora.lora_int_id, model.rank, self.last_load_s)
        return True

    def remove_adapter(self, lora_int_id: int) -> bool:
        found = self._cpu_cache.pop(lora_int_id, None) is not None
        if lora_int_id not in self._req_lora.values():   # running requests may reload it
            self._requests.pop(lora_int_id, None)
        if lora_int_id in self._slots:
            slot = self._slots.index(lora_int_id)
            self._slots[slot] = None
            for layer in self.layers.values():
                layer.clear_slot(slot)
            found = True
        return found

    def list_adapters(self) -> list[int]:
        return list(self._cpu_cache)

    # ------------------------------------------------------------------ per step
    def update_requests(self, so: "SchedulerOutput") -> None:
        for rid in so.finished_req_ids | so.preempted_req_ids:
            if self._req_lora.pop(rid, None) is not None:
                self._req_lora_version += 1
        for new in so.scheduled_new_reqs:
            lora = new.lora_request
            if lora is not None:
                self._requests.setdefault(lora.lora_int_id, lora)
                self._req_lora[new.req_id] = lora.lora_int_id
                self._req_lora_version += 1

    def prepare_step(self, req_ids: list[str], query_lens: np.ndarray) -> None:
        """Slots for this step's adapters, and the token -> slot mapping the layers read."""
        if not self._req_lora:
            self.mapping.clear()
            self.sorted_tokens.clear()
            self.logits_rows.token_slots = np.full(int(query_lens.sum()), -1, np.int64)
            self._step_key = None
            return
        if self._same_step(req_ids, query_lens):
            # A decode loop's steps: the same requests, adapters and slots as the last one, so
            # its mapping (and on CUDA the slots already on the device) still holds; only the
            # slots' LRU times move. Saves two passes over the requests, the grouping and its
            # host -> device copies (each a stream sync from pageable memory on CUDA).
            now = time.monotonic()
            for lora_id in self._step_active:
                self._slot_used[self._slots.index(lora_id)] = now
            return
        ids = np.fromiter((self._req_lora.get(r, 0) for r in req_ids), np.int64, len(req_ids))
        active = [int(i) for i in np.unique(ids) if i > 0]
        if len(active) > len(self._slots):
            raise RuntimeError(f"{len(active)} LoRA adapters in one step, more than "
                               f"--max-loras {len(self._slots)} (the scheduler's limit).")
        slot_of = {lora_id: self._activate(lora_id, active) for lora_id in active}
        req_slots = np.fromiter((slot_of.get(int(i), -1) for i in ids), np.int64, len(ids))
        token_slots = np.repeat(req_slots, query_lens)
        self.mapping.set(token_slots, self.device)
        self.logits_rows.token_slots = token_slots
        # On CUDA the Triton kernels group the tokens by slot on the device. Gathered groups
        # would take the torch path (two matmuls per adapter): a 4-adapter prefill on an
        # H100 spent 3x the base's host time there.
        if (all(isinstance(g, slice) for _, g in self.mapping.groups)
                or (self.device.type == "cuda" and triton_available())):
            self.sorted_tokens.clear()
        else:                    # interleaved adapters: one gather / scatter per layer
            self.sorted_tokens.set(token_slots, self.device)
        self._step_active = active
        self._step_key = self._key(req_ids, query_lens)

    def _key(self, req_ids: list[str], query_lens: np.ndarray) -> tuple:
        """What a step's mapping is built from: the requests in order, their query lengths,
        which adapter each request uses, which slot holds each adapter, and the mapping
        object itself (a CUDA-graph capture replaces it)."""
        return (list(req_ids), np.array(query_lens, copy=True), self._req_lora_version,
                tuple(self._slots), self.mapping.groups)

    def _same_step(self, req_ids: list[str], query_lens: np.ndarray) -> bool:
        key = self._step_key
        return (key is not None and key[2] == self._req_lora_version
                and key[3] == tuple(self._slots) and key[4] is self.mapping.groups
                and key[0] == req_ids and np.array_equal(key[1], query_lens))

    def set_logits_rows(self, token_indices: np.ndarray) -> None:
        """The step's token indices whose hidden states the next compute_logits call scores
        (LoRA on lm_head adds each row's adapter delta)."""
        self.logits_rows.rows = np.asarray(token_indices)

    def _activate(self, lora_id: int, active: list[int]) -> int:
        """The slot holding adapter `lora_id`, filling one (least recently used, not needed by
        this step) if it is not in one yet."""
        now = time.monotonic()
        if lora_id in self._slots:
            slot = self._slots.index(lora_id)
        else:
            free = [s for s, held in enumerate(self._slots) if held is None or held not in active]
            slot = min(free, key=lambda s: (self._slots[s] is not None, self._slot_used[s]))
            model = self._cpu_cache.get(lora_id)
            if model is None:    # evicted from the CPU LRU since add time: load it again
                self.add_adapter(self._requests[lora_id])
                model = self._cpu_cache[lora_id]
            self._cpu_cache.move_to_end(lora_id)
            for (layer_idx, name), layer in self.layers.items():
                layer.set_slot(slot, [model.weights.get((layer_idx, module))
                                      for module, _ in layer.modules])
            self._slots[slot] = lora_id
        self._slot_used[slot] = now
        return slot
