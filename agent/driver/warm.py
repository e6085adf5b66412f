"""The job's warm pools (:mod:`agent.node.warmpool`): one ``srun`` step with a pool on
every node of the allocation, spares included, kept beside the training steps.

The step starts just before the first launch's agents, which wait for their node's
pool and fork torchrun and the ranks from it. The launch's step is asked for only once
every pool has said on its standard output that it listens (each says so before it
imports anything), or after :data:`LISTENING_S`: a slurmd handed two step launches at
the same moment has crashed, so the two steps never start together. Each node
imports torch once, in its pool, instead of once in torchrun and again in every rank.
The step outlives the training steps (each relaunch is a step of its own), so a
relaunch's processes start without importing anything; should it end (a node lost,
the job shrunk off a node) it is started again on the allocation as it is then,
before the next launch, unless it ended within :data:`SHORT_LIVED_S` of its start: a
pool that cannot start is not retried, and the ranks start as fresh interpreters, as
they would without it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import sys
import time
from collections.abc import Callable, Mapping

from agent.driver.argv import warm_pool_argv
from agent.driver.settings import DriverSettings
from agent.driver.slurm import current_nodes
from agent.node.launch import with_bootstrap
from agent.node.warmpool import LISTENING

log = logging.getLogger("resurgo.driver")

# A pool step that ended sooner than this after its start is not started again.
SHORT_LIVED_S = 60.0
# SIGTERM to SIGKILL of the pool step when the driver ends.
STOP_GRACE_S = 5.0
# The longest the launch waits for every node's pool to say it listens.
LISTENING_S = 15.0


class WarmPools:
    """Starts, restarts and stops the pool step."""

    def __init__(
        self,
        settings: DriverSettings,
        environ: Mapping[str, str],
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.settings = settings
        self._environ = environ
        self._clock = clock
        self._step: asyncio.subprocess.Process | None = None
        self._output: asyncio.Task[None] | None = None
        self._started_at = 0.0
        self._given_up = not settings.warm_pool

    @property
    def running(self) -> bool:
        return self._step is not None and self._step.returncode is None

    async def ensure(self) -> None:
        """Start the pool step unless it runs (or was given up); called before a launch."""
        if self._given_up or self.running:
            return
        if self._step is not None:  # it ran, and ended
            lived = self._clock() - self._started_at
            if lived < SHORT_LIVED_S:
                log.warning(
                    "the warm pools ended %.0f s after their start (exit %s): ranks start "
                    "as fresh interpreters",
                    lived,
                    self._step.returncode,
                )
                self._given_up = True
                return
        try:
            nodes = await current_nodes(self._environ)
            argv = warm_pool_argv(self.settings, nodes)
            env = {
                **self._environ,
                "PYTHONPATH": with_bootstrap(self._environ.get("PYTHONPATH")),
            }
            self._step = await asyncio.create_subprocess_exec(
                *argv, env=env, stdout=asyncio.subprocess.PIPE
            )
        except Exception as error:  # the pools are a speed-up; the job goes on without
            log.warning("the warm pools did not start (%s): ranks start cold", error)
            self._given_up = True
            return
        self._started_at = self._clock()
        log.info("warm pools starting on %d node(s)", len(nodes))
        listening = asyncio.Event()
        assert self._step.stdout is not None
        self._output = asyncio.create_task(
            _forward(self._step.stdout, len(nodes), listening), name="warm pools' output"
        )
        try:
            await asyncio.wait_for(listening.wait(), LISTENING_S)
        except TimeoutError:
            log.warning(
                "not every warm pool listens after %.0f s: the launch starts anyway", LISTENING_S
            )

    async def close(self) -> None:
        """Stop the pool step (SIGTERM, SIGKILL after a grace)."""
        step, self._step = self._step, None
        output, self._output = self._output, None
        if step is not None and step.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                step.terminate()
            try:
                await asyncio.wait_for(step.wait(), STOP_GRACE_S)
            except TimeoutError:
                with contextlib.suppress(ProcessLookupError):
                    step.kill()
                await step.wait()
        if output is not None:
            output.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await output


async def _forward(stream: asyncio.StreamReader, pools: int, listening: asyncio.Event) -> None:
    """The pool step's standard output onto the driver's, ``listening`` set once ``pools``
    pools have said they listen, or once the step's output ends (the step ended)."""
    heard = 0
    try:
        while line := await stream.readline():
            if line.startswith(LISTENING):
                heard += 1
                if heard >= pools:
                    listening.set()
                continue
            sys.stdout.buffer.write(line)
            sys.stdout.flush()
    finally:
        listening.set()
