"""The scheduler's hook for KV transfers (a SchedulerHook: the Scheduler knows none of this).

Decode side: a request whose prompt KV can be loaded from outside leaves the waiting queue
(`admit`) with its blocks allocated (not yet registered in the prefix cache: their KV is not
there yet) and waits in WAITING_FOR_REMOTE_KVS while the worker loads; others keep stepping.
When the worker reports the load done, it rejoins the front of the waiting queue
(`take_ready`) with those tokens computed; when the load failed, its blocks are freed and it
is computed locally (counted in `num_local_fallbacks`).

Prefill side: a finished request whose KV a decode instance will read keeps its blocks
(`request_finished` said so) until the worker reports it in finished_sending (read, or its
timeout passed).
"""
from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, Optional

from kvserve.core.request import RequestStatus
from kvserve.core.sched_hooks import SchedulerHook
from kvserve.kv_transfer.base import KVConnectorBase, KVConnectorOutput

if TYPE_CHECKING:
    from kvserve.core.request import Request
    from kvserve.core.sched_output import ModelRunnerOutput, SchedulerOutput

logger = logging.getLogger(__name__)


class KVTransferScheduling(SchedulerHook):
    ready_to_front = True   # loaded requests were admitted once already

    def __init__(self, connector: KVConnectorBase) -> None:
        self.connector = connector
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
    def admit(self, request: "Request", computed_blocks: list, num_computed: int) -> bool:
        """Ask the connector for the request's tokens beyond its local prefix hit; if it has
        some, allocate the blocks and let the request wait for the load. False: no load (also
        when blocks are short: the request then stays at the head of the queue)."""
        num_external = self._num_external_tokens(request, num_computed)
        if num_external <= 0:
            return False
        blocks = self.kv_cache_manager.allocate_slots(
            request, num_external, num_new_computed_tokens=num_computed,
            new_computed_blocks=computed_blocks, delay_cache_blocks=True)
        if blocks is None:
            return False
        request.num_computed_tokens = num_computed
        if request.num_cached_tokens < 0:
            request.num_cached_tokens = num_computed + num_external
        request.status = RequestStatus.WAITING_FOR_REMOTE_KVS
        block_ids = self.kv_cache_manager.get_block_ids(request.request_id)
        self.connector.update_state_after_alloc(request, block_ids, num_external)
        self.loading[request.request_id] = (request, num_external)
        return True

    def _num_external_tokens(self, request: "Request", num_computed_tokens: int) -> int:
        if request.request_id in self.local_only:
            return 0
        num, _load_async = self.connector.get_num_new_matched_tokens(request, num_computed_tokens)
        # kvserve always loads asynchronously (load_async is informative only).
        self.external_prefix_cache_queries += request.num_tokens
        self.external_prefix_cache_hits += num
        return num

    def take_ready(self) -> list["Request"]:
        """Requests whose load ended since the last call, back to WAITING: with the loaded
        tokens computed, or (failed load: blocks freed) to be computed locally."""
        ready: list["Request"] = []
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
            else:
                # At least the last token is computed here: its logits give the next token.
                request.num_computed_tokens = min(request.num_computed_tokens + num_external,
                                                  request.num_tokens - 1)
            request.status = RequestStatus.WAITING
            ready.append(request)
        self.done_recving.clear()
        self.failed_recving.clear()
        return ready

    # ------------------------------------------------------------------ both sides
    def request_finished(self, request: "Request") -> tuple[bool, Optional[dict[str, Any]]]:
        rid = request.request_id
        self.local_only.discard(rid)
        if self.loading.pop(rid, None) is not None:
            # Aborted while loading: the worker may still write its blocks.
            self.loading_aborted[rid] = request
            self.connector.request_finished(request, [])   # its per-request state goes
            return True, None
        block_ids = self.kv_cache_manager.get_block_ids(rid)
        delay, params = self.connector.request_finished(request, block_ids)
        if delay:
            self.delayed_free[rid] = request
        return delay, params

    def on_scheduled(self, output: "SchedulerOutput", requests: dict[str, "Request"]) -> None:
        output.kv_connector_metadata = self.connector.build_connector_meta(output)

    def update_from_output(self, scheduler_output: "SchedulerOutput",
                           runner_output: "ModelRunnerOutput") -> None:
        out: Optional[KVConnectorOutput] = runner_output.kv_connector_output
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
