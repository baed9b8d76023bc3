"""Find a connector class by its registered name or by module path."""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from kvserve.kv_transfer.base import KVConnectorBase, KVConnectorRole

if TYPE_CHECKING:
    from kvserve.config import KVServeConfig
    from kvserve.kv_transfer.config import KVTransferConfig


class KVConnectorFactory:
    # name -> (module, class); imported only when used (NIXL is an optional extra).
    _registry: dict[str, tuple[str, str]] = {
        "SharedStorageConnector": ("kvserve.kv_transfer.shared_storage", "SharedStorageConnector"),
        # vLLM's newer name for the same debugging connector.
        "ExampleConnector": ("kvserve.kv_transfer.shared_storage", "SharedStorageConnector"),
        "NixlConnector": ("kvserve.kv_transfer.nixl", "NixlConnector"),
    }

    @classmethod
    def register_connector(cls, name: str, module: str, class_name: str) -> None:
        if name in cls._registry:
            raise ValueError(f"KV connector {name!r} is already registered.")
        cls._registry[name] = (module, class_name)

    @classmethod
    def get_connector_class(cls, kv_config: "KVTransferConfig") -> type[KVConnectorBase]:
        name = kv_config.kv_connector
        assert name is not None
        if name in cls._registry:
            module_name, class_name = cls._registry[name]
        elif kv_config.kv_connector_module_path:
            module_name, class_name = kv_config.kv_connector_module_path, name
        elif ":" in name or "." in name:
            module_name, _, class_name = name.replace(":", ".").rpartition(".")
        else:
            raise ValueError(f"Unknown KV connector {name!r}; registered: "
                             f"{sorted(cls._registry)} (or give a class as 'package.module:Class').")
        try:
            module = importlib.import_module(module_name)
        except ImportError as e:
            raise ValueError(f"KV connector {name!r}: cannot import {module_name!r}: {e}") from None
        connector_cls = getattr(module, class_name, None)
        if not (isinstance(connector_cls, type) and issubclass(connector_cls, KVConnectorBase)):
            raise ValueError(f"KV connector {name!r}: {module_name}.{class_name} is not a "
                             f"KVConnectorBase subclass.")
        return connector_cls

    @classmethod
    def create_connector(cls, config: "KVServeConfig", role: KVConnectorRole) -> KVConnectorBase:
        assert config.kv_transfer_config is not None
        return cls.get_connector_class(config.kv_transfer_config)(config, role)
