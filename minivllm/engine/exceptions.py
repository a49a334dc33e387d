"""Errors the frontend raises when the engine core fails."""

from __future__ import annotations

import pickle

from minivllm.engine.messages import EngineCoreError


class EngineDeadError(Exception):
    """The engine core process died or failed; the engine cannot serve any more requests.

    The cause (the core's exception, or how its process ended) is the ``__cause__``.
    """

    def __init__(self, message: str | None = None) -> None:
        super().__init__(
            message or "The engine core died; see the cause above and the engine core's log."
        )


class RemoteTraceback(Exception):
    """The traceback of an exception raised in the engine core process, as text."""

    def __init__(self, tb: str) -> None:
        super().__init__(tb)
        self.tb = tb

    def __str__(self) -> str:
        return f"\n\nTraceback in the engine core process:\n{self.tb}"


def make_error_report(exc: BaseException, during_startup: bool, tb: str) -> EngineCoreError:
    """What the core sends when it fails: the exception itself when it pickles, and as text."""
    try:
        pickled = pickle.dumps(exc)
        pickle.loads(pickled)  # some exceptions pickle but do not unpickle
    except Exception:
        pickled = None
    return EngineCoreError(
        during_startup=during_startup,
        exc_type=f"{type(exc).__module__}.{type(exc).__qualname__}",
        message=str(exc),
        traceback=tb,
        pickled=pickled,
    )


def rebuild_error(report: EngineCoreError) -> BaseException:
    """The core's exception, in the frontend: its own type and message where possible."""
    exc: BaseException | None = None
    if report.pickled is not None:
        try:
            exc = pickle.loads(report.pickled)
        except Exception:
            exc = None
    if not isinstance(exc, BaseException):
        exc = RuntimeError(f"{report.exc_type}: {report.message}")
    if report.traceback:
        exc.__cause__ = RemoteTraceback(report.traceback)
    return exc
