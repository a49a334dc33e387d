"""minivllm's log lines, configured as vLLM configures its own: at ``import minivllm``,
unless MINIVLLM_CONFIGURE_LOGGING=0, the ``minivllm`` logger gets vLLM's format on stderr at
MINIVLLM_LOGGING_LEVEL (INFO). Every process imports the package, so the engine core's
start-up lines (the KV cache's size, how long CUDA graph capture took) are printed too.
An application that set up the ``minivllm`` logger itself keeps its own."""

from __future__ import annotations

import logging

FORMAT = "%(levelname)s %(asctime)s [%(filename)s:%(lineno)d] %(message)s"
DATE_FORMAT = "%m-%d %H:%M:%S"


def configure_logging(level: str | int = "INFO") -> None:
    root = logging.getLogger("minivllm")
    if root.handlers:
        return
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter(FORMAT, DATE_FORMAT))
    root.addHandler(handler)
    root.setLevel(level)
    root.propagate = False
