"""The attention backend interface the model runner and the Attention layer call.

Per step the model runner describes the flattened "super-sequence" once, on the host
(CommonAttentionMetadata); the chosen backend turns that into its own device-side metadata
(`build_metadata`), and every Attention layer hands its q/k/v to `forward`, which writes this
step's K/V into the paged cache and attends. Backends know nothing about requests.

    tokens:  [ d0 d1 d2 | p0 p0 p0 p0 | p1 p1 ]      decode requests first, then prefill chunks
    request r: queries [query_starts[r], + query_lens[r]), positions context_lens[r] + i
    slot_mapping[t] = block_id * block_size + offset   (where token t's K/V is written)
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol

import numpy as np
import torch



class AttentionLayer(Protocol):
    """What a backend reads from the layer it serves (model/layers/attention.py's Attention,
    which imports this package, not the other way round)."""
    num_heads: int
    num_kv_heads: int
    head_dim: int
    scale: float


@dataclass
class CommonAttentionMetadata:
    """One step's attention inputs, on the host (numpy), in flattened token order."""
    num_decodes: int             # requests [0, num_decodes) have exactly one query token
    query_starts: np.ndarray     # [R] int64, first token of request r
    query_lens: np.ndarray       # [R] int64
    context_lens: np.ndarray     # [R] int64, tokens cached before this step
    block_table: np.ndarray      # [R, MB] int64, padded; row r's first ceil(seq_len / BS) used
    slot_mapping: np.ndarray     # [T] int64
    block_size: int

    @property
    def num_reqs(self) -> int:
        return len(self.query_lens)

    @property
    def num_tokens(self) -> int:
        return len(self.slot_mapping)

    @property
    def seq_lens(self) -> np.ndarray:
        return self.context_lens + self.query_lens


class AttentionBackend(ABC):
    """One attention implementation; instances hold no per-step state."""
    name: ClassVar[str]

    def __init__(self, device: torch.device) -> None:
        self.device = device

    @abstractmethod
    def build_metadata(self, common: CommonAttentionMetadata) -> Any:
        """This backend's device-side metadata for one step (shared by every layer)."""

    @abstractmethod
    def forward(self, layer: AttentionLayer, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                kv_cache: torch.Tensor, metadata: Any) -> torch.Tensor:
        """q [T, H, D], k/v [T, Hkv, D]: write k/v at the step's slots, return [T, H, D]."""
