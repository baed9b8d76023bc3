"""The models this server answers to: `GET /v1/models` and the 404 for an unknown name."""
from __future__ import annotations

from typing import Optional

from kvserve.entrypoints.openai.protocol import ModelCard, ModelList, ModelPermission


class OpenAIServingModels:
    """The served model names (the first is the one responses report) and the checkpoint."""

    def __init__(self, served_model_names: list[str], model_path: str, max_model_len: int) -> None:
        if not served_model_names:
            raise ValueError("At least one served model name is needed.")
        self.served_model_names = list(served_model_names)
        self.model_path = model_path
        self.max_model_len = max_model_len

    @property
    def model_name(self) -> str:
        return self.served_model_names[0]

    def response_model_name(self, requested: Optional[str]) -> str:
        """What a response reports: the name the request used, else the first (vLLM)."""
        return requested if requested and requested in self.served_model_names else self.model_name

    def is_base_model(self, name: Optional[str]) -> bool:
        """A request may leave `model` out (vLLM then uses the served model); a name given
        must be one of ours."""
        return not name or name in self.served_model_names

    def show_available_models(self) -> ModelList:
        return ModelList(data=[
            ModelCard(id=name, root=self.model_path, max_model_len=self.max_model_len,
                      permission=[ModelPermission()])
            for name in self.served_model_names])
