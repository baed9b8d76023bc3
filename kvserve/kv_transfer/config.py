"""KVTransferConfig: which KV connector an engine uses and in which role (vLLM's fields)."""
from __future__ import annotations

import socket
import uuid
from dataclasses import dataclass, field
from typing import Any, Optional, Union

from kvserve.json_config import parse_json_config

KV_ROLES = ("kv_producer", "kv_consumer", "kv_both")


def _free_port(host: str) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


@dataclass
class KVTransferConfig:
    """`--kv-transfer-config` / `LLM(kv_transfer_config=...)`.

    `kv_connector`: a registered name (NixlConnector, SharedStorageConnector, ExampleConnector)
    or a class given by module path ("pkg.module:Class" or "pkg.module.Class"), or the class name
    with `kv_connector_module_path` naming its module. `kv_role`: kv_producer (only saves / sends),
    kv_consumer (only loads / reads) or kv_both. `engine_id` names this instance to its peers
    (a fresh uuid when unset). `kv_ip` / `kv_port`: where the NIXL side channel listens (a free
    port is picked once, here, when unset, so that two instances on one host never collide).
    """
    kv_connector: Optional[str] = None
    kv_role: Optional[str] = None
    kv_connector_extra_config: dict[str, Any] = field(default_factory=dict)
    kv_buffer_device: str = "cpu"
    engine_id: Optional[str] = None
    kv_connector_module_path: Optional[str] = None
    kv_ip: str = "127.0.0.1"
    kv_port: Optional[int] = None

    def __post_init__(self) -> None:
        if not self.kv_connector or not isinstance(self.kv_connector, str):
            raise ValueError("kv_transfer_config needs 'kv_connector' (e.g. \"NixlConnector\" or "
                             "\"SharedStorageConnector\").")
        if self.kv_role not in KV_ROLES:
            raise ValueError(f"kv_transfer_config: kv_role must be one of {list(KV_ROLES)}, "
                             f"got {self.kv_role!r}.")
        if not isinstance(self.kv_connector_extra_config, dict):
            raise ValueError("kv_transfer_config: kv_connector_extra_config must be an object.")
        if self.kv_buffer_device not in ("cpu", "cuda"):
            raise ValueError(f"kv_transfer_config: kv_buffer_device must be 'cpu' or 'cuda', "
                             f"got {self.kv_buffer_device!r}.")
        if self.engine_id is None:
            self.engine_id = str(uuid.uuid4())
        if self.kv_port is None:
            self.kv_port = _free_port(self.kv_ip)

    @property
    def is_kv_producer(self) -> bool:
        return self.kv_role in ("kv_producer", "kv_both")

    @property
    def is_kv_consumer(self) -> bool:
        return self.kv_role in ("kv_consumer", "kv_both")

    def get_from_extra_config(self, key: str, default: Any) -> Any:
        return self.kv_connector_extra_config.get(key, default)

    @staticmethod
    def parse(value: Union[None, str, dict, "KVTransferConfig"]) -> Optional["KVTransferConfig"]:
        """From the CLI's JSON string, a dict or a config; checks the connector exists and
        its settings now, before any process starts."""
        if value is None or isinstance(value, KVTransferConfig):
            config = value
        else:
            value = parse_json_config(value, "kv_transfer_config", KVTransferConfig)
            config = KVTransferConfig(**value)
        if config is not None:
            from kvserve.kv_transfer.factory import KVConnectorFactory
            KVConnectorFactory.get_connector_class(config).check_config(config)
        return config
