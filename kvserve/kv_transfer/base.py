"""The KV connector interface (vLLM V1's shape and names).

A connector moves KV blocks between this engine and somewhere else (another instance, a
store). Each engine makes two instances of the same class: one in the scheduler
(`KVConnectorRole.SCHEDULER`, decides what to load and save) and one in the worker
(`KVConnectorRole.WORKER`, moves the bytes). They talk only through the metadata that
`build_connector_meta` puts in each SchedulerOutput and the `KVConnectorOutput` the worker
returns in its ModelRunnerOutput::

    scheduler                                   worker
    get_num_new_matched_tokens(req, n_local)
      -> (n_external, load_async)
    update_state_after_alloc(req, blocks, n)
    build_connector_meta(sched_output) ──────► bind_connector_metadata(meta)
                                                start_load_kv()          (before the forward)
                                                [wait_for_layer_load / save_kv_layer per layer]
                                                wait_for_save()          (after the forward)
    finished_sending / finished_recving ◄────── get_finished(finished_req_ids)
    request_finished(req, block_ids)
      -> (delay_free_blocks, kv_transfer_params)

External tokens are always loaded asynchronously here: the request waits in
WAITING_FOR_REMOTE_KVS with its blocks allocated while other requests keep stepping, and a
failed load (`get_failed_recving`) makes the scheduler compute the prompt locally instead.

`wait_for_layer_load` / `save_kv_layer` are called by every attention layer, before and after
its attention (`kv_transfer.worker.bind_kv_connector`, as vLLM's attention layer does), so a
connector can overlap transfer with compute layer by layer. SharedStorageConnector copies each
layer's blocks to save in `save_kv_layer`; loads here are asynchronous and whole (the request
waits in WAITING_FOR_REMOTE_KVS), so `wait_for_layer_load` has nothing to wait for in the
connectors here. Without a connector the layers skip the hooks (one attribute test each).
"""
from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Optional

if TYPE_CHECKING:
    import torch

    from kvserve.config import KVServeConfig
    from kvserve.core.request import Request
    from kvserve.core.sched_output import SchedulerOutput
    from kvserve.kv_transfer.config import KVTransferConfig


class KVConnectorRole(enum.Enum):
    SCHEDULER = 0
    WORKER = 1


@dataclass
class KVConnectorMetadata:
    """What the scheduler side tells the worker side for one step (connectors subclass it)."""


@dataclass
class KVConnectorOutput:
    """What the worker side reports after a step, in ModelRunnerOutput.kv_connector_output."""
    finished_sending: set[str] = field(default_factory=set)   # prefill side: blocks may be freed
    finished_recving: set[str] = field(default_factory=set)   # loads that completed
    failed_recving: set[str] = field(default_factory=set)     # loads that failed: compute locally
    num_transfers: int = 0             # completed block loads (one per request) this step
    transfer_bytes: int = 0
    transfer_time_s: float = 0.0
    num_started: int = 0               # loads posted this step
    num_in_flight: int = 0             # loads posted and not yet done or failed, after this step

    def is_empty(self) -> bool:
        return not (self.finished_sending or self.finished_recving or self.failed_recving
                    or self.num_transfers or self.num_started or self.num_in_flight)


class KVConnectorBase(ABC):
    def __init__(self, config: "KVServeConfig", role: KVConnectorRole) -> None:
        assert config.kv_transfer_config is not None
        self.config = config
        self.kv_transfer_config: "KVTransferConfig" = config.kv_transfer_config
        self.role = role
        self.block_size = config.cache_config.block_size
        self._connector_metadata: Optional[KVConnectorMetadata] = None
        # Worker side: loads that failed, and (transfers, bytes, seconds), since the last report.
        self._failed_recving: set[str] = set()
        self._stats: list = [0, 0, 0.0]
        self._num_started = 0

    def _record_transfer(self, nbytes: int, seconds: float) -> None:
        self._stats[0] += 1
        self._stats[1] += nbytes
        self._stats[2] += seconds

    @classmethod
    def check_config(cls, kv_config: "KVTransferConfig") -> None:
        """Raise ValueError for settings this connector cannot use (called before start)."""

    # ------------------------------------------------------------------ scheduler side
    @abstractmethod
    def get_num_new_matched_tokens(self, request: "Request",
                                   num_computed_tokens: int) -> tuple[int, bool]:
        """Tokens beyond the `num_computed_tokens` found locally that can be loaded from
        outside, and whether they load asynchronously."""

    @abstractmethod
    def update_state_after_alloc(self, request: "Request", block_ids: list[int],
                                 num_external_tokens: int) -> None:
        """The request's blocks (all of them, local hits first) are allocated: remember which
        of them the worker must fill."""

    @abstractmethod
    def build_connector_meta(self, scheduler_output: "SchedulerOutput") -> KVConnectorMetadata:
        """This step's work for the worker side; resets the per-step state."""

    def request_finished(self, request: "Request",
                         block_ids: list[int]) -> tuple[bool, Optional[dict[str, Any]]]:
        """A request finished. Returns (keep its blocks until the worker reports it in
        finished_sending, kv_transfer_params for the client)."""
        return False, None

    # ------------------------------------------------------------------ worker side
    def register_kv_caches(self, kv_caches: list["torch.Tensor"]) -> None:
        """The worker's KV cache tensors, one per layer, once at start."""

    def bind_connector_metadata(self, metadata: Optional[KVConnectorMetadata]) -> None:
        self._connector_metadata = metadata

    def clear_connector_metadata(self) -> None:
        self._connector_metadata = None

    def start_load_kv(self) -> None:
        """Start (or do) this step's loads into the KV cache, before the forward."""

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Block until `layer_name`'s KV is loaded (per-layer connectors)."""

    def save_kv_layer(self, layer_name: str, kv_layer: "torch.Tensor") -> None:
        """Start saving one layer's KV (per-layer connectors)."""

    def wait_for_save(self) -> None:
        """After the forward: finish this step's saves."""

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str], set[str]]:
        """(requests done sending: their blocks may be freed, requests done receiving)."""
        return set(), set()

    def get_failed_recving(self) -> set[str]:
        """Requests whose load failed since the last call (they are computed locally)."""
        failed, self._failed_recving = self._failed_recving, set()
        return failed

    def get_kv_connector_stats(self) -> tuple[int, int, float]:
        """(transfers, bytes, seconds) since the last call."""
        stats, self._stats = self._stats, [0, 0, 0.0]
        return stats[0], stats[1], stats[2]

    def take_num_started(self) -> int:
        """Loads posted since the last call."""
        num, self._num_started = self._num_started, 0
        return num

    def num_in_flight(self) -> int:
        """Loads posted and not yet reported done or failed (asynchronous connectors)."""
        return 0

    def shutdown(self) -> None:
        pass
