"""The one error every model source raises."""

from __future__ import annotations


class ModelSourceError(FileNotFoundError):
    """A model that could not be found or fetched; the message is one line that names it
    and says what to do (the CLI prints it without a traceback)."""
