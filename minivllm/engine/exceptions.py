"""Errors of the engine's frontend: a request it refuses, and the engine core failing."""

from __future__ import annotations

from minivllm.engine.messages import EngineCoreError
from minivllm.utils.remote_errors import RemoteTraceback, pickle_exception, rebuild_exception

__all__ = [
    "EngineDeadError",
    "VLLMValidationError",
    "RemoteTraceback",
    "make_error_report",
    "rebuild_error",
]


class VLLMValidationError(ValueError):
    """A request the engine refuses (vLLM's name): a ValueError that says which parameter,
    so that the server can name it in its 400."""

    def __init__(self, message: str, parameter: str | None = None) -> None:
        super().__init__(message)
        self.parameter = parameter


class EngineDeadError(Exception):
    """The engine core process died or failed; the engine cannot serve any more requests.

    The cause (the core's exception, or how its process ended) is the ``__cause__``.
    """

    def __init__(self, message: str | None = None) -> None:
        super().__init__(
            message or "The engine core died; see the cause above and the engine core's log."
        )


def make_error_report(exc: BaseException, during_startup: bool, tb: str) -> EngineCoreError:
    """What the core sends when it fails: the exception itself when it pickles, and as text."""
    return EngineCoreError(
        during_startup=during_startup,
        exc_type=f"{type(exc).__module__}.{type(exc).__qualname__}",
        message=str(exc),
        traceback=tb,
        pickled=pickle_exception(exc),
    )


def rebuild_error(report: EngineCoreError) -> BaseException:
    """The core's exception, in the frontend: its own type and message where possible."""
    return rebuild_exception(
        report.pickled,
        f"{report.exc_type}: {report.message}",
        report.traceback,
        where="the engine core process",
    )
