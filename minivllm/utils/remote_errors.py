"""An exception raised in another process, sent to ours and raised again here.

The sender pickles the exception when it survives a round trip (some pickle but do not
unpickle) and always sends its text and traceback; the receiver rebuilds the original
type where it can, a RuntimeError with the text where not, with the remote traceback as
the ``__cause__``.
"""

from __future__ import annotations

import pickle


class RemoteTraceback(Exception):
    """The traceback of an exception raised in another process, as text."""

    def __init__(self, tb: str, where: str = "the engine core process") -> None:
        super().__init__(tb)
        self.tb = tb
        self.where = where

    def __reduce__(self):
        return type(self), (self.tb, self.where)

    def __str__(self) -> str:
        return f"\n\nTraceback in {self.where}:\n{self.tb}"


def pickle_exception(exc: BaseException) -> bytes | None:
    """The pickled exception, or None when it does not pickle and unpickle."""
    try:
        pickled = pickle.dumps(exc)
        pickle.loads(pickled)
    except Exception:
        return None
    return pickled


def rebuild_exception(
    pickled: bytes | None, fallback_message: str, tb: str, where: str
) -> BaseException:
    """The remote exception as it was where possible, else ``RuntimeError(fallback_message)``;
    the remote traceback (when there is one) is its ``__cause__``."""
    exc: BaseException | None = None
    if pickled is not None:
        try:
            exc = pickle.loads(pickled)
        except Exception:
            exc = None
    if not isinstance(exc, BaseException):
        exc = RuntimeError(fallback_message)
    if tb:
        exc.__cause__ = RemoteTraceback(tb, where)
    return exc
