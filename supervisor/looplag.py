"""How late the supervisor's event loop runs what is due: its own measure of overload.

Every request, heartbeat frame, Slurm poll and decision runs on one event
loop. When anything holds it (a long parse, a garbage collection, a CPU
shared with other work), every agent's answer waits. A timer due every
``period_s`` observes how late it fires into
``resurgo_supervisor_loop_lag_seconds``: an operator reads overload there
before agents time out, and the load bench reads the supervisor's own share
of the latency its agents measure.
"""

from __future__ import annotations

import asyncio

from prometheus_client import CollectorRegistry, Histogram

LAG_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 10.0)


class LoopLag:
    """The lag histogram, registered in ``registry``, and the task that fills it."""

    def __init__(self, registry: CollectorRegistry, period_s: float = 0.05) -> None:
        self.period_s = period_s
        self.histogram = Histogram(
            "resurgo_supervisor_loop_lag_seconds",
            "How late the supervisor's event loop ran a timer that was due",
            buckets=LAG_BUCKETS_S,
            registry=registry,
        )

    async def run(self) -> None:
        """Observe the lag every ``period_s`` until cancelled."""
        loop = asyncio.get_running_loop()
        while True:
            due = loop.time() + self.period_s
            await asyncio.sleep(self.period_s)
            self.histogram.observe(max(0.0, loop.time() - due))
