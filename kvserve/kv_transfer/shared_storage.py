"""SharedStorageConnector (vLLM's debugging connector, also called ExampleConnector): KV blocks
saved as files under `shared_storage_path`, one file per full prompt block, named by a chained
SHA-256 of the model and the prefix's tokens up to that block. A later engine (any process)
with the same model loads the matching prefix instead of computing it.

Files are written whole to a temporary name and renamed. Each carries the SHA-256 of its
payload, checked on load with its dtype and shape: a corrupt or truncated file fails the
request's load, which the scheduler then computes locally; it is never used.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Optional

import torch

from kvserve.kv_transfer.base import KVConnectorBase, KVConnectorMetadata, KVConnectorRole

if TYPE_CHECKING:
    from kvserve.config import KVServeConfig
    from kvserve.core.request import Request
    from kvserve.core.sched_output import SchedulerOutput
    from kvserve.kv_transfer.config import KVTransferConfig

logger = logging.getLogger(__name__)

_MAGIC = b"KVSERVE-KV-BLOCK-1\n"


@dataclass
class SharedStorageConnectorMetadata(KVConnectorMetadata):
    # request id -> [(block id, file key)] to load before this step's forward.
    loads: dict[str, list[tuple[int, str]]] = field(default_factory=dict)
    # (block id, file key) to save after this step's forward.
    saves: list[tuple[int, str]] = field(default_factory=list)


@dataclass
class _SaveState:
    prompt_token_ids: list[int]
    cache_salt: Optional[str]
    block_ids: list[int]
    num_saved_blocks: int
    keys: list[str] = field(default_factory=list)


class SharedStorageConnector(KVConnectorBase):
    def __init__(self, config: "KVServeConfig", role: KVConnectorRole) -> None:
        super().__init__(config, role)
        self.storage_path = os.path.abspath(
            self.kv_transfer_config.get_from_extra_config("shared_storage_path", ""))
        os.makedirs(self.storage_path, exist_ok=True)
        mc = config.model_config
        # Files are only valid for this model, dtype, block size and KV layout (and a KV cache
        # dtype other than the model's).
        parts = [os.path.realpath(mc.model), mc.hf_config, str(mc.dtype), self.block_size]
        kv_dtype = config.cache_config.kv_cache_dtype
        if kv_dtype is not None and kv_dtype != mc.dtype:
            parts.append(str(kv_dtype))
        ident = json.dumps(parts, sort_keys=True, default=str)
        self._model_key = hashlib.sha256(ident.encode()).digest()
        self._pending_loads: dict[str, list[tuple[int, str]]] = {}
        self._save_state: dict[str, _SaveState] = {}
        self._salts: dict[str, Optional[str]] = {}
        self.kv_caches: list[torch.Tensor] = []
        self._finished_recving: set[str] = set()

    @classmethod
    def check_config(cls, kv_config: "KVTransferConfig") -> None:
        path = kv_config.get_from_extra_config("shared_storage_path", None)
        if not path or not isinstance(path, str):
            raise ValueError(f"{kv_config.kv_connector} needs kv_connector_extra_config."
                             f"shared_storage_path (a directory).")
        if os.path.exists(path) and not os.path.isdir(path):
            raise ValueError(f"shared_storage_path {path!r} is not a directory.")

    # ------------------------------------------------------------------ keys
    def _block_keys(self, token_ids: list[int], cache_salt: Optional[str], num_blocks: int,
                    keys: Optional[list[str]] = None) -> list[str]:
        """Chained keys of the first `num_blocks` full blocks (extends `keys` in place)."""
        keys = [] if keys is None else keys
        bs = self.block_size
        parent = bytes.fromhex(keys[-1]) if keys else hashlib.sha256(
            self._model_key + (cache_salt or "").encode()).digest()
        for i in range(len(keys), num_blocks):
            tokens = torch.tensor(token_ids[i * bs:(i + 1) * bs], dtype=torch.int64)
            parent = hashlib.sha256(parent + tokens.numpy().tobytes()).digest()
            keys.append(parent.hex())
        return keys

    def _file(self, key: str) -> str:
        return os.path.join(self.storage_path, key[:2], key + ".kv")

    # ------------------------------------------------------------------ scheduler side
    def get_num_new_matched_tokens(self, request: "Request",
                                   num_computed_tokens: int) -> tuple[int, bool]:
        # The scheduler asks for every request it admits: remember its salt for the saves.
        self._salts[request.request_id] = request.cache_salt
        if not self.kv_transfer_config.is_kv_consumer:
            return 0, False
        # Prompt blocks only, and never the last token: it must be computed for its logits.
        max_blocks = min((request.num_tokens - 1), request.num_prompt_tokens) // self.block_size
        start = num_computed_tokens // self.block_size
        if start >= max_blocks:
            return 0, False
        keys = self._block_keys(request.prompt_token_ids, request.cache_salt, max_blocks)
        n = start
        while n < max_blocks and os.path.exists(self._file(keys[n])):
            n += 1
        return max(0, n * self.block_size - num_computed_tokens), True

    def update_state_after_alloc(self, request: "Request", block_ids: list[int],
                                 num_external_tokens: int) -> None:
        if num_external_tokens <= 0:
            return
        start = request.num_computed_tokens // self.block_size
        end = start + num_external_tokens // self.block_size
        keys = self._block_keys(request.prompt_token_ids, request.cache_salt, end)
        self._pending_loads[request.request_id] = [(block_ids[i], keys[i])
                                                   for i in range(start, end)]

    def build_connector_meta(self, scheduler_output: "SchedulerOutput") -> KVConnectorMetadata:
        meta = SharedStorageConnectorMetadata(loads=self._pending_loads)
        self._pending_loads = {}
        if not self.kv_transfer_config.is_kv_producer:
            return meta
        for rid in scheduler_output.preempted_req_ids:
            self._save_state.pop(rid, None)   # it comes back as a new request
        computed: dict[str, int] = {}
        for new in scheduler_output.scheduled_new_reqs:
            self._save_state[new.req_id] = _SaveState(
                new.token_ids[:new.num_prompt_tokens], self._salts.get(new.req_id),
                list(new.block_ids), 0)
            computed[new.req_id] = new.num_computed_tokens
        cached = scheduler_output.scheduled_cached_reqs
        for rid, blocks, num in zip(cached.req_ids, cached.new_block_ids,
                                    cached.num_computed_tokens):
            state = self._save_state.get(rid)
            if state is not None:
                state.block_ids.extend(blocks)
                computed[rid] = num
        for rid, num in computed.items():
            self._add_saves(self._save_state[rid], num + scheduler_output.num_scheduled_tokens[rid],
                            meta)
        return meta

    def _add_saves(self, state: _SaveState, num_computed_after: int,
                   meta: SharedStorageConnectorMetadata) -> None:
        num_full = min(num_computed_after, len(state.prompt_token_ids)) // self.block_size
        if num_full <= state.num_saved_blocks:
            return
        self._block_keys(state.prompt_token_ids, state.cache_salt, num_full, state.keys)
        for i in range(state.num_saved_blocks, num_full):
            if not os.path.exists(self._file(state.keys[i])):
                meta.saves.append((state.block_ids[i], state.keys[i]))
        state.num_saved_blocks = num_full

    def request_finished(self, request: "Request", block_ids: list[int]):
        self._save_state.pop(request.request_id, None)
        self._salts.pop(request.request_id, None)
        self._pending_loads.pop(request.request_id, None)
        return False, None

    # ------------------------------------------------------------------ worker side
    def register_kv_caches(self, kv_caches: list[torch.Tensor]) -> None:
        self.kv_caches = kv_caches
        self._layer_index = {kv.data_ptr(): i for i, kv in enumerate(kv_caches)}
        # This step's blocks to save, per layer, copied as each layer's attention ends.
        self._staged: list[Optional[torch.Tensor]] = [None] * len(kv_caches)

    def start_load_kv(self) -> None:
        meta = self._connector_metadata
        if not isinstance(meta, SharedStorageConnectorMetadata):
            return
        for rid, blocks in meta.loads.items():
            start = time.perf_counter()
            try:
                datas = [self._read_block(key) for _, key in blocks]
            except (OSError, ValueError) as e:
                logger.warning("Request %s: stored KV rejected (%s); it is computed instead.",
                               rid, e)
                self._failed_recving.add(rid)
                continue
            for (block_id, _), data in zip(blocks, datas):
                for layer, kv in enumerate(self.kv_caches):
                    kv[:, block_id].copy_(data[layer])
            self._finished_recving.add(rid)
            self._record_transfer(sum(d.numel() * d.element_size() for d in datas),
                                  time.perf_counter() - start)

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor) -> None:
        meta = self._connector_metadata
        if not isinstance(meta, SharedStorageConnectorMetadata) or not meta.saves:
            return
        layer = self._layer_index[kv_layer.data_ptr()]
        if self._staged[layer] is not None:
            raise RuntimeError(f"save_kv_layer({layer_name!r}) called twice in one step")
        block_ids = torch.tensor([b for b, _ in meta.saves], device=kv_layer.device)
        self._staged[layer] = kv_layer.index_select(1, block_ids).cpu()   # [2, n, ...]

    def wait_for_save(self) -> None:
        meta = self._connector_metadata
        if not isinstance(meta, SharedStorageConnectorMetadata) or not meta.saves:
            return
        staged, self._staged = self._staged, [None] * len(self.kv_caches)
        missing = [i for i, t in enumerate(staged) if t is None]
        if missing:   # a file missing a layer must never be written
            raise RuntimeError(f"SharedStorageConnector: no save_kv_layer call for layers "
                               f"{missing} in a step that saves blocks")
        for j, (_, key) in enumerate(meta.saves):
            self._write_block(torch.stack([t[:, j] for t in staged]).contiguous(), key)

    def _write_block(self, data: torch.Tensor, key: str) -> None:
        payload = data.view(torch.uint8).numpy().tobytes()
        header = json.dumps({"dtype": str(data.dtype), "shape": list(data.shape),
                             "sha256": hashlib.sha256(payload).hexdigest()}).encode()
        path = self._file(key)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        tmp = f"{path}.{os.getpid()}.tmp"
        with open(tmp, "wb") as f:
            f.write(_MAGIC + header + b"\n" + payload)
        os.replace(tmp, path)

    def _read_block(self, key: str) -> torch.Tensor:
        with open(self._file(key), "rb") as f:
            raw = f.read()
        if not raw.startswith(_MAGIC) or b"\n" not in raw[len(_MAGIC):]:
            raise ValueError(f"{key}: not a KV block file")
        header_end = raw.index(b"\n", len(_MAGIC))
        try:
            header = json.loads(raw[len(_MAGIC):header_end])
        except ValueError:
            raise ValueError(f"{key}: unreadable header") from None
        payload = raw[header_end + 1:]
        expected = self.kv_caches[0][:, 0]
        shape = [len(self.kv_caches), *expected.shape]
        if header.get("shape") != shape or header.get("dtype") != str(expected.dtype):
            raise ValueError(f"{key}: layout {header.get('dtype')} {header.get('shape')} is not "
                             f"this engine's {expected.dtype} {shape}")
        if len(payload) != expected.numel() * expected.element_size() * len(self.kv_caches):
            raise ValueError(f"{key}: truncated ({len(payload)} bytes)")
        if hashlib.sha256(payload).hexdigest() != header.get("sha256"):
            raise ValueError(f"{key}: checksum mismatch")
        return torch.frombuffer(bytearray(payload), dtype=torch.uint8).view(
            expected.dtype).view(shape)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str], set[str]]:
        done = self._finished_recving | self._failed_recving
        self._finished_recving = set()
        return set(), done
