"""The scheduler's bookkeeping for KV transfers, kept out of Scheduler itself.

Decode side: a request whose prompt KV can be loaded from outside leaves the waiting queue
with its blocks allocated (not yet registered in the prefix cache: their KV is not there yet)
and waits in WAITING_FOR_REMOTE_KVS while the worker loads; others keep stepping. When the
worker reports the load done, it rejoins the waiting queue with those tokens computed; when
the load failed, its blocks are freed and it is computed locally (counted in
`num_local_fallbacks`).

Prefill side: a finished request whose KV a decode instance will read keeps its blocks
(`request_finished` said so) until the worker reports it in finished_sending (read, or its
timeout passed).
"""
from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, Optional

from kvserve.kv_transfer.base import KVConnectorBase, KVConnectorOutput

if TYPE_CHECKING:
    from kvserve.core.kv_cache_manager import KVCacheManager
    from kvserve.core.request import Request

logger = logging.getLogger(__name__)


class KVTransferScheduling:
    def __init__(self, connector: KVConnectorBase, kv_cache_manager: "KVCacheManager") -> None:
        self.connector = connector
        self.kv_cache_manager = kv_cache_manager
        # request id -> (request, tokens being loaded) while its load runs.
        self.loading: dict[str, tuple["Request", int]] = {}
        # Aborted while loading: their blocks are freed once the worker is done with them.
        self.loading_aborted: dict[str, "Request"] = {}
        self.done_recving: set[str] = set()
        self.failed_recving: set[str] = set()
        # Finished requests whose blocks wait for a remote read.
        self.delayed_free: dict[str, "Request"] = {}
        # Requests whose load failed once: computed locally from now on.
        self.local_only: set[str] = set()
        # Cumulative counters (metrics take deltas).
        self.external_prefix_cache_queries = 0
        self.external_prefix_cache_hits = 0
        self.num_local_fallbacks = 0
        self.num_kv_transfers = 0
        self.kv_transfer_bytes = 0
        self.kv_transfer_time_s = 0.0
        self.num_kv_transfers_started = 0
        self.num_kv_transfers_in_flight = 0   # the worker's last report

    @property
    def has_pending(self) -> bool:
        return bool(self.delayed_free or self.loading_aborted)

    # ------------------------------------------------------------------ decode side
    def num_external_tokens(self, request: "Request", num_computed_tokens: int) -> int:
        if request.request_id in self.local_only:
            return 0
        num, _load_async = self.connector.get_num_new_matched_tokens(request, num_computed_tokens)
        # kvserve always loads asynchronously (load_async is informative only).
        self.external_prefix_cache_queries += request.num_tokens
        self.external_prefix_cache_hits += num
        return num

    def start_loading(self, request: "Request", num_external_tokens: int) -> None:
        block_ids = self.kv_cache_manager.get_block_ids(request.request_id)
        self.connector.update_state_after_alloc(request, block_ids, num_external_tokens)
        self.loading[request.request_id] = (request, num_external_tokens)

    def take_finished_loads(self) -> list[tuple["Request", bool]]:
        """Requests whose load ended since the last call: (request, loaded?). Their
        num_computed_tokens is set; failed ones have had their blocks freed."""
        ready: list[tuple["Request", bool]] = []
        for rid in self.done_recving | self.failed_recving:
            entry = self.loading.pop(rid, None)
            if entry is None:
                continue
            request, num_external = entry
            if rid in self.failed_recving:
                logger.warning("Request %s: loading its KV failed; computing it locally.", rid)
                self.kv_cache_manager.free(request)
                request.num_computed_tokens = 0
                self.local_only.add(rid)
                self.num_local_fallbacks += 1
                ready.append((request, False))
            else:
                # At least the last token is computed here: its logits give the next token.
                request.num_computed_tokens = min(request.num_computed_tokens + num_external,
                                                  request.num_tokens - 1)
                ready.append((request, True))
        self.done_recving.clear()
        self.failed_recving.clear()
        return ready

    def abort_loading(self, request: "Request") -> None:
        """Aborted while WAITING_FOR_REMOTE_KVS: the worker may still write its blocks."""
        self.loading.pop(request.request_id, None)
        self.loading_aborted[request.request_id] = request
        self.local_only.discard(request.request_id)
        self.connector.request_finished(request, [])   # its per-request state goes

    # ------------------------------------------------------------------ both sides
    def request_finished(self, request: "Request") -> tuple[bool, Optional[dict[str, Any]]]:
        self.local_only.discard(request.request_id)
        block_ids = self.kv_cache_manager.get_block_ids(request.request_id)
        delay, params = self.connector.request_finished(request, block_ids)
        if delay:
            self.delayed_free[request.request_id] = request
        return delay, params

    def update_from_output(self, out: Optional[KVConnectorOutput]) -> None:
        if out is None:
            self.num_kv_transfers_in_flight = 0
            return
        self.num_kv_transfers_started += out.num_started
        self.num_kv_transfers_in_flight = out.num_in_flight
        for rid in out.finished_sending:
            request = self.delayed_free.pop(rid, None)
            if request is not None:
                self.kv_cache_manager.free(request)
        for rid in out.finished_recving | out.failed_recving:
            request = self.loading_aborted.pop(rid, None)
            if request is not None:
                self.kv_cache_manager.free(request)
        self.done_recving |= out.finished_recving
        self.failed_recving |= out.failed_recving
        self.num_kv_transfers += out.num_transfers
        self.kv_transfer_bytes += out.transfer_bytes
        self.kv_transfer_time_s += out.transfer_time_s

    def stats(self) -> dict[str, Any]:
        return dict(external_prefix_cache_queries=self.external_prefix_cache_queries,
                    external_prefix_cache_hits=self.external_prefix_cache_hits,
                    kv_local_fallbacks=self.num_local_fallbacks,
                    kv_transfers=self.num_kv_transfers, kv_transfer_bytes=self.kv_transfer_bytes,
                    kv_transfer_time_s=self.kv_transfer_time_s,
                    kv_transfers_started=self.num_kv_transfers_started,
                    num_kv_transfers_in_flight=self.num_kv_transfers_in_flight,
                    num_waiting_for_remote_kvs=len(self.loading),
                    num_kv_blocks_held_for_transfer_reqs=len(self.delayed_free))
