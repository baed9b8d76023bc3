"""EngineCoreClient: how the frontend talks to the engine core.

InprocClient calls an EngineCore in this process. The multiprocess clients (engine core in
its own process, over ZMQ) implement the same methods.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

from kvserve.config import KVServeConfig
from kvserve.core.messages import EngineCoreOutputs, EngineCoreRequest


class EngineCoreClient(ABC):
    @staticmethod
    def make_client(config: KVServeConfig) -> "EngineCoreClient":
        if config.parallel_config.data_parallel_size > 1:
            raise ValueError("data_parallel_size > 1 runs behind the server (`kvserve serve -dp "
                             "N`, AsyncLLM); the offline LLM / LLMEngine drive one engine core.")
        if config.multiprocessing:
            from kvserve.engine.mp_client import SyncMPClient
            return SyncMPClient(config)
        return InprocClient(config)

    @abstractmethod
    def add_request(self, request: EngineCoreRequest) -> None: ...

    @abstractmethod
    def abort_requests(self, request_ids: list[str]) -> None: ...

    @abstractmethod
    def get_output(self) -> EngineCoreOutputs: ...

    @abstractmethod
    def call_utility(self, method: str, *args: Any) -> Any: ...

    @abstractmethod
    def shutdown(self) -> None: ...


class InprocClient(EngineCoreClient):
    def __init__(self, config: KVServeConfig) -> None:
        from kvserve.engine.core import EngineCore
        self.engine_core = EngineCore(config)

    def add_request(self, request: EngineCoreRequest) -> None:
        self.engine_core.add_request(request)

    def abort_requests(self, request_ids: list[str]) -> None:
        if request_ids:
            self.engine_core.abort_requests(request_ids)

    def get_output(self) -> EngineCoreOutputs:
        return self.engine_core.step()

    def call_utility(self, method: str, *args: Any) -> Any:
        return getattr(self.engine_core, method)(*args)

    def shutdown(self) -> None:
        self.engine_core.shutdown()
