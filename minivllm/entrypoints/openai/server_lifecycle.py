"""The server's life as the request handlers see it: what is in flight, and whether the
server is shutting down (api_server.GracefulServer drives it)."""

from __future__ import annotations


class ServerLifecycle:
    """What the handlers share about the server's life: the engine requests in flight, and
    whether the server is shutting down (then new requests get a 503 and, once the grace
    period is over, the requests in flight end with an error)."""

    def __init__(self) -> None:
        self.draining = False
        self.cancelling = False
        self.active: set[str] = set()

    async def cancel_all(self, engine) -> None:
        """End every request in flight (their streams get an error event, then [DONE])."""
        self.cancelling = True
        if self.active:
            await engine.abort(list(self.active))
