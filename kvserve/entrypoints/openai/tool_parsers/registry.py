"""Parsers by their command-line name (vLLM's names): one registry for the tool-call parsers,
one for the reasoning parsers."""
from __future__ import annotations

from typing import Callable, TypeVar

T = TypeVar("T", bound=type)


class Registry:
    def __init__(self, flag: str) -> None:
        self.flag = flag
        self._classes: dict[str, type] = {}

    def register(self, name: str) -> Callable[[T], T]:
        def register(cls: T) -> T:
            self._classes[name] = cls
            cls.name = name
            return cls
        return register

    def get(self, name: str) -> type:
        if name not in self._classes:
            raise ValueError(f"{self.flag} {name!r} is unknown; available: "
                             f"{', '.join(self.names())}.")
        return self._classes[name]

    def names(self) -> list[str]:
        return sorted(self._classes)


TOOL_PARSERS = Registry("--tool-call-parser")
register_tool_parser = TOOL_PARSERS.register
get_tool_parser = TOOL_PARSERS.get
tool_parser_names = TOOL_PARSERS.names
