"""`kv_transfer_params`: the per-request field a client (or `kvserve proxy`) sends in and the
engine sends back (vLLM's keys). It travels in `SamplingParams.extra_args["kv_transfer_params"]`,
as in vLLM."""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional

if TYPE_CHECKING:
    from kvserve.kv_transfer.config import KVTransferConfig
    from kvserve.sampling_params import SamplingParams

_KEYS = {"do_remote_decode", "do_remote_prefill", "remote_engine_id", "remote_block_ids",
         "remote_host", "remote_port", "remote_request_id"}


def get_kv_transfer_params(params: "SamplingParams") -> Optional[dict[str, Any]]:
    extra = params.extra_args
    return extra.get("kv_transfer_params") if extra else None


def validate_kv_transfer_params(params: "SamplingParams",
                                kv_config: Optional["KVTransferConfig"]) -> None:
    """ValueError for malformed kv_transfer_params, before the request reaches the engine."""
    kv = get_kv_transfer_params(params)
    if kv is None:
        return
    if not isinstance(kv, dict):
        raise ValueError(f"kv_transfer_params must be an object, got {kv!r}.")
    if kv_config is None:
        raise ValueError("kv_transfer_params was given but this server has no KV connector "
                         "(start it with --kv-transfer-config).")
    unknown = sorted(set(kv) - _KEYS)
    if unknown:
        raise ValueError(f"Unknown kv_transfer_params key(s) {unknown}; known: {sorted(_KEYS)}.")
    for key in ("do_remote_decode", "do_remote_prefill"):
        if key in kv and not isinstance(kv[key], bool):
            raise ValueError(f"kv_transfer_params.{key} must be a boolean, got {kv[key]!r}.")
    if kv.get("do_remote_decode") and kv.get("do_remote_prefill"):
        raise ValueError("kv_transfer_params: do_remote_decode and do_remote_prefill exclude "
                         "each other.")
    if (kv.get("do_remote_decode") or kv.get("do_remote_prefill")) and params.n != 1:
        raise ValueError("kv_transfer_params with do_remote_decode / do_remote_prefill needs n=1.")
    if kv.get("do_remote_prefill"):
        _check_remote_prefill(kv)


def _check_remote_prefill(kv: dict[str, Any]) -> None:
    missing = [k for k in ("remote_engine_id", "remote_block_ids", "remote_host", "remote_port")
               if kv.get(k) is None]
    if missing:
        raise ValueError(f"kv_transfer_params with do_remote_prefill needs {missing}.")
    ids = kv["remote_block_ids"]
    if not isinstance(ids, list) or not all(isinstance(b, int) and b >= 0 for b in ids):
        raise ValueError("kv_transfer_params.remote_block_ids must be a list of block ids.")
    port = kv["remote_port"]
    if not isinstance(port, int) or not 0 < port < 65536:
        raise ValueError(f"kv_transfer_params.remote_port must be a port number, got {port!r}.")
    if not isinstance(kv["remote_host"], str) or not isinstance(kv["remote_engine_id"], str):
        raise ValueError("kv_transfer_params.remote_host and remote_engine_id must be strings.")
