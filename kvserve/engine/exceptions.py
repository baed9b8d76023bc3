"""Errors the frontend raises about the engine core."""
from __future__ import annotations

from typing import Optional


class EngineGenerateError(Exception):
    """A request failed (the engine core keeps serving the others)."""


class EngineDeadError(Exception):
    """The engine core process died or failed; it serves no more requests.

    `engine_traceback` is the engine's own traceback text when it could report one."""

    def __init__(self, message: Optional[str] = None, engine_traceback: Optional[str] = None,
                 suppress_context: bool = False) -> None:
        message = message or ("EngineCore encountered an issue. See the stack trace (above) for "
                              "the root cause.")
        if engine_traceback:
            message = f"{message}\nEngine core traceback:\n{engine_traceback}"
        super().__init__(message)
        self.engine_traceback = engine_traceback
        # Raised from inside the output handler: the handler's own context is noise.
        self.__suppress_context__ = suppress_context
