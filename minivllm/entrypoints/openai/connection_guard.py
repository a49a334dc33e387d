"""Connection limits for uvicorn's HTTP/1.1 protocol (h11): at most `max_connections` open,
where a new connection makes room by closing the longest-idle one; a deadline for a request's
head; and the file-descriptor limit that the cap needs.

Idle sockets then cannot exhaust the process's file descriptors (accept failing, /health
timing out), and a client that opens sockets and sends nothing, or a head a byte at a time,
holds each for at most `header_timeout` seconds, and never takes the place of a request.
"""

from __future__ import annotations

import asyncio
import logging
import resource
from collections import OrderedDict

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

logger = logging.getLogger(__name__)

# File descriptors kept for everything but connections: the engine core's sockets, logs,
# the model's and tokenizer's files.
FD_RESERVE = 256
# How many of the oldest connections a new one looks at for an idle one to close.
MAX_EVICTION_SCAN = 64


def raise_fd_limit(max_connections: int) -> int:
    """Raise the soft RLIMIT_NOFILE to what max_connections needs (at most the hard limit);
    returns the number of connections the limit allows."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = max_connections + FD_RESERVE
    if hard != resource.RLIM_INFINITY:
        wanted = min(wanted, hard)
    if wanted > soft:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, hard))
            soft = wanted
        except (ValueError, OSError) as exc:
            logger.warning("Could not raise the file descriptor limit to %d: %s", wanted, exc)
    allowed = max(1, soft - FD_RESERVE)
    if allowed < max_connections:
        logger.warning(
            "The file descriptor limit (%d) allows %d connections, not --max-connections %d.",
            soft,
            allowed,
            max_connections,
        )
    return min(allowed, max_connections)


def guarded_h11_protocol(max_connections: int, header_timeout: float) -> type[H11Protocol]:
    """uvicorn's h11 protocol class with the cap and the head deadline (for Config.http)."""
    # The server's connections, the least recently active first.
    by_activity: OrderedDict[GuardedH11Protocol, None] = OrderedDict()

    class GuardedH11Protocol(H11Protocol):
        _deadline: asyncio.TimerHandle | None = None

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._touch()
            if len(by_activity) > max_connections:
                self._make_room()
            self._start_deadline()

        def connection_lost(self, exc: Exception | None) -> None:
            by_activity.pop(self, None)
            if self._deadline is not None:
                self._deadline.cancel()
            super().connection_lost(exc)

        def on_response_complete(self) -> None:
            super().on_response_complete()
            self._touch()
            self._start_deadline()

        def _touch(self) -> None:
            by_activity.pop(self, None)
            by_activity[self] = None

        def _idle(self) -> bool:
            """No request in flight: none since it opened, or its last one answered."""
            return self.cycle is None or self.cycle.response_complete

        def _start_deadline(self) -> None:
            if self._deadline is not None:
                self._deadline.cancel()
            self._deadline = self.loop.call_later(header_timeout, self._head_deadline)

        def _head_deadline(self) -> None:
            if self._idle():  # no whole request head within the timeout
                self._close()

        def _close(self) -> None:
            try:
                self.timeout_keep_alive_handler()  # uvicorn's own way to end an idle one
            except h11.LocalProtocolError:
                self.transport.close()
            by_activity.pop(self, None)

        def _make_room(self) -> None:
            """Close the longest-idle other connection; this one if all are busy."""
            for _ in range(min(MAX_EVICTION_SCAN, len(by_activity))):
                oldest, _ = by_activity.popitem(last=False)
                if oldest is not self and oldest._idle():
                    oldest._close()
                    return
                by_activity[oldest] = None  # busy (or this one): to the back
            self._close()

    return GuardedH11Protocol
