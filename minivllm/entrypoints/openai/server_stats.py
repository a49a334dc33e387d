"""The engine core's scheduler statistics for /metrics and the periodic log line: polled,
never waited on longer than STATS_TIMEOUT_S (request statistics are recorded by the engine's
frontend as outputs arrive)."""

from __future__ import annotations

import asyncio
import logging

logger = logging.getLogger(__name__)

# How long /metrics and the log line wait for the engine core's statistics.
STATS_TIMEOUT_S = 5.0


class SchedulerStatsPoller:
    """Asks the engine core for its scheduler statistics, one question at a time.

    The core answers between two steps. A question that takes longer than the caller
    waits is left running, never cancelled, and the caller gets the statistics of the
    latest step meanwhile.
    """

    def __init__(self, engine) -> None:
        self.engine = engine
        self._pending: asyncio.Future | None = None

    async def poll(self, timeout: float):
        """Each engine core's statistics (one but with data parallelism; None for a core
        that died), or None."""
        if self.engine.errored:
            return None
        if self._pending is None or self._pending.done():
            self._pending = asyncio.ensure_future(self._ask())
        pending = self._pending
        done, _ = await asyncio.wait({pending}, timeout=timeout)
        if done and not pending.cancelled() and pending.exception() is None:
            return pending.result()
        last = getattr(self.engine, "last_stats", None)
        return None if last is None else [last]

    async def _ask(self) -> list:
        per_engine = getattr(self.engine, "get_engine_stats", None)
        if per_engine is None:  # an engine of one core
            return [await self.engine.get_stats()]
        return await per_engine()


async def refresh_scheduler_stats(state) -> None:
    """Record the engine cores' scheduler statistics as they are now."""
    stats = await state.stats_poller.poll(STATS_TIMEOUT_S)
    if stats is not None:
        state.stat_loggers.record_engines(stats)


async def log_stats_forever(state, interval: float) -> None:
    while True:
        await asyncio.sleep(interval)
        try:
            await refresh_scheduler_stats(state)
            state.stat_loggers.log()
        except Exception:
            logger.exception("Could not log the engine's statistics")
