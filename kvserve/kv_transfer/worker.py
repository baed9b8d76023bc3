"""The worker's side of a step with a KV connector: load before the forward, the per-layer
hooks inside it, save after it, report finished transfers in the ModelRunnerOutput."""
from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Optional

from kvserve.kv_transfer.base import KVConnectorBase, KVConnectorOutput, KVConnectorRole

if TYPE_CHECKING:
    import torch
    from torch import nn

    from kvserve.config import KVServeConfig
    from kvserve.core.sched_output import ModelRunnerOutput, SchedulerOutput


def create_worker_connector(config: "KVServeConfig", kv_caches: list["torch.Tensor"],
                            model: Optional["nn.Module"] = None) -> KVConnectorBase:
    from kvserve.kv_transfer.factory import KVConnectorFactory
    connector = KVConnectorFactory.create_connector(config, KVConnectorRole.WORKER)
    connector.register_kv_caches(kv_caches)
    if model is not None:
        bind_kv_connector(model, connector)
    return connector


def bind_kv_connector(model: "nn.Module", connector: KVConnectorBase) -> None:
    """Every Attention layer of `model` calls `connector.wait_for_layer_load(name)` before
    its attention and `connector.save_kv_layer(name, kv_cache)` after it (vLLM's per-layer
    hooks; `name` is the module's, e.g. "model.layers.0.self_attn.attn"), so a connector can
    overlap its transfers with the other layers' compute. Eager forwards only: a replayed CUDA
    graph (all-decode steps) skips them, and the connectors here only save prompt blocks."""
    from kvserve.model.layers.attention import Attention
    for name, module in model.named_modules():
        if isinstance(module, Attention):
            module.kv_connector = connector
            module.layer_name = name


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
