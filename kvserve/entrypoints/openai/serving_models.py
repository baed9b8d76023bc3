"""The models this server answers to: `GET /v1/models` and the 404 for an unknown name.

With --enable-lora the LoRA adapters are models too (vLLM): `--lora-modules` at start, and
`/v1/load_lora_adapter` / `/v1/unload_lora_adapter` at run time when
KVSERVE_ALLOW_RUNTIME_LORA_UPDATING is on; a request picks one by its `model` field, and
`/v1/models` lists each with `parent` = the base model.
"""
from __future__ import annotations

import itertools
from typing import Any, Optional

from kvserve.entrypoints.openai.protocol import ModelCard, ModelList, ModelPermission
from kvserve.lora.request import LoRAModulePath, LoRARequest


class OpenAIServingModels:
    """The served model names (the first is the one responses report) and the checkpoint."""

    def __init__(self, served_model_names: list[str], model_path: str, max_model_len: int,
                 lora_modules: Optional[list[LoRAModulePath]] = None,
                 lora_checker: Optional[Any] = None) -> None:
        if not served_model_names:
            raise ValueError("At least one served model name is needed.")
        self.served_model_names = list(served_model_names)
        self.model_path = model_path
        self.max_model_len = max_model_len
        self.lora_checker = lora_checker      # the input processor's AdapterChecker
        self.lora_requests: dict[str, LoRARequest] = {}
        self._lora_ids = itertools.count(1)
        for module in lora_modules or []:
            self.add_lora(module.name, module.path, module.base_model_name)

    @property
    def model_name(self) -> str:
        return self.served_model_names[0]

    def response_model_name(self, requested: Optional[str]) -> str:
        """What a response reports: the name the request used, else the first (vLLM)."""
        if requested and (requested in self.served_model_names or requested in self.lora_requests):
            return requested
        return self.model_name

    def is_base_model(self, name: Optional[str]) -> bool:
        """A request may leave `model` out (vLLM then uses the served model); a name given
        must be one of ours (the base model's or a LoRA adapter's)."""
        return not name or name in self.served_model_names or name in self.lora_requests

    def lora_request(self, name: Optional[str]) -> Optional[LoRARequest]:
        """The adapter a request's `model` names (None: the base model)."""
        return self.lora_requests.get(name) if name else None

    # ------------------------------------------------------------------ adapters
    def add_lora(self, name: str, path: str, base_model_name: Optional[str] = None) -> LoRARequest:
        """Register an adapter (checked now: a bad one is a ValueError)."""
        if name in self.lora_requests or name in self.served_model_names:
            raise ValueError(f"The model name {name!r} is already in use.")
        if self.lora_checker is None:
            raise ValueError("LoRA adapters need a server started with --enable-lora.")
        lora = LoRARequest(name, next(self._lora_ids), path,
                           base_model_name=base_model_name or self.model_name)
        self.lora_checker.check(lora)
        self.lora_requests[name] = lora
        return lora

    def remove_lora(self, name: str) -> LoRARequest:
        lora = self.lora_requests.pop(name, None)
        if lora is None:
            raise KeyError(name)
        if self.lora_checker is not None:
            self.lora_checker.forget(lora.lora_int_id)
        return lora

    def show_available_models(self) -> ModelList:
        cards = [ModelCard(id=name, root=self.model_path, max_model_len=self.max_model_len,
                           permission=[ModelPermission()])
                 for name in self.served_model_names]
        cards += [ModelCard(id=lora.lora_name, root=lora.lora_path,
                            parent=lora.base_model_name or self.model_name,
                            max_model_len=self.max_model_len, permission=[ModelPermission()])
                  for lora in self.lora_requests.values()]
        return ModelList(data=cards)
