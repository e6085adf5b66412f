"""The per-job event budget: how many events one job may send a minute.

A job owner holds the job's secret and can sign as many events as they like;
four clients stored 143,000 events in 31 s (the store grew ~67 GiB an hour)
and held ``/healthz`` at a p95 of 648 ms. Each job gets a sliding-window
budget of events per minute (the ``limits`` library's counter: two numbers
per job, whatever the rate): ``events_per_minute``, or 120 per rank of the
job's world when that is more. A batch beyond the budget is refused ``429
rate_limited`` (with ``Retry-After``), stores nothing, and is logged under the
refusal log's own rate limit; the agent keeps the batch and sends it again.
An honest job sends a few events per rank a minute (step losses in batches,
checkpoints, exits), far below it; a spool replayed after a long supervisor
outage is delivered at the budget's pace.
"""

from __future__ import annotations

from limits import RateLimitItemPerMinute
from limits.aio.storage import MemoryStorage
from limits.aio.strategies import SlidingWindowCounterRateLimiter

# Events a minute each rank of a job's world may send beyond the floor.
PER_RANK_PER_MINUTE = 120
# Seconds a refused client is asked to wait (the window moves on by then).
RETRY_AFTER_S = 10


class EventBudget:
    """Per-job sliding-window event counts; ``per_minute`` the floor for every job.

    The asyncio flavour of the counter's storage: the threaded one starts a
    timer thread for its expiry whenever none is alive, which at hundreds of
    event batches a second was a thread start (a stop of the event loop while
    the new thread takes the GIL) every few batches.
    """

    def __init__(self, per_minute: int) -> None:
        self.per_minute = per_minute
        self._limiter = SlidingWindowCounterRateLimiter(MemoryStorage())
        self._items: dict[int, RateLimitItemPerMinute] = {}

    def limit_for(self, world_ranks: int | None) -> int:
        """The budget a minute of a job whose world has at most ``world_ranks`` ranks."""
        return max(self.per_minute, PER_RANK_PER_MINUTE * (world_ranks or 0))

    async def admit(self, job_id: str, count: int, world_ranks: int | None) -> bool:
        """Take ``count`` events of ``job_id`` from its budget; False (nothing taken) if
        they do not fit."""
        if self.per_minute <= 0:
            return True  # no budget configured
        amount = self.limit_for(world_ranks)
        item = self._items.get(amount)
        if item is None:
            item = self._items[amount] = RateLimitItemPerMinute(amount)
        return bool(await self._limiter.hit(item, job_id, cost=count))
