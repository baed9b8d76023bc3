"""The worker's side of a step with a KV connector: load before the forward, save after it,
report finished transfers in the ModelRunnerOutput."""
from __future__ import annotations

from typing import TYPE_CHECKING, Callable

from kvserve.kv_transfer.base import KVConnectorBase, KVConnectorOutput, KVConnectorRole

if TYPE_CHECKING:
    import torch

    from kvserve.config import KVServeConfig
    from kvserve.core.sched_output import ModelRunnerOutput, SchedulerOutput


def create_worker_connector(config: "KVServeConfig",
                            kv_caches: list["torch.Tensor"]) -> KVConnectorBase:
    from kvserve.kv_transfer.factory import KVConnectorFactory
    connector = KVConnectorFactory.create_connector(config, KVConnectorRole.WORKER)
    connector.register_kv_caches(kv_caches)
    return connector


def execute_with_connector(
        connector: KVConnectorBase, scheduler_output: "SchedulerOutput",
        execute: Callable[["SchedulerOutput"], "ModelRunnerOutput"]) -> "ModelRunnerOutput":
    connector.bind_connector_metadata(scheduler_output.kv_connector_metadata)
    try:
        connector.start_load_kv()
        output = execute(scheduler_output)
        connector.wait_for_save()
        sending, recving = connector.get_finished(scheduler_output.finished_req_ids)
        failed = connector.get_failed_recving()
        num, nbytes, seconds = connector.get_kv_connector_stats()
        started, in_flight = connector.take_num_started(), connector.num_in_flight()
    finally:
        connector.clear_connector_metadata()
    kv_out = KVConnectorOutput(finished_sending=sending, finished_recving=recving - failed,
                               failed_recving=failed, num_transfers=num, transfer_bytes=nbytes,
                               transfer_time_s=seconds, num_started=started,
                               num_in_flight=in_flight)
    # An output with nothing new is dropped; the step after the last load ends still reports
    # num_in_flight=0 because it carries that load's finished_recving / failed_recving.
    if not kv_out.is_empty():
        output.kv_connector_output = kv_out
    return output
