"""The time limit as a planned stop (:mod:`agent.timelimit`): when to begin it (Slurm's
``USR1``, or the driver's own timer from ``squeue``'s time left and the measured
save time), the agents' notice and the supervisor's, and the job's requeue by
the driver itself when the supervisor does not requeue it in time."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Mapping
from typing import Any

from agent.checkpoint.catalog import list_checkpoints
from agent.driver.settings import Ask, DriverSettings
from agent.driver.slurm import capture, time_left
from agent.stopfiles import write_notice
from agent.timelimit import REQUEUE_MARGIN_S, Notice, warning_lead_s
from agent.wire.errors import ResurgoError
from agent.wire.protocol import DriverPhase, DriverRequest

log = logging.getLogger("resurgo.driver")

# Slurm's USR1 this much earlier than the lead is taken as early, not as the moment.
EARLY_WARNING_SLACK_S = 5.0
# The supervisor requeues as soon as the ranks stopped; the driver does it itself
# only this close to the end (the requeue takes about two seconds).
SELF_REQUEUE_BEFORE_END_S = 5.0


class PlannedStop:
    """One job's planned stop before its time limit; begun at most once.

    ``stopping`` says whether the driver is ending (a signal); ``stop_step`` stops
    the running step's ranks at once (the notice could not be written).
    """

    def __init__(
        self,
        settings: DriverSettings,
        environ: Mapping[str, str],
        *,
        clock: Callable[[], float],
        ask: Ask,
        stopping: Callable[[], bool],
        stop_step: Callable[[], None],
    ) -> None:
        self.settings = settings
        self._environ = environ
        self._clock = clock
        self._ask = ask
        self._stopping = stopping
        self._stop_step = stop_step
        # Whether the planned stop has begun.
        self.begun = False
        # The attempt of the step last launched: the one the notice is for.
        self.attempt = 1
        self._end_unix_s: float | None = None
        self._requeue_failed: str | None = None
        self._tasks: set[asyncio.Task[None]] = set()

    def start_timer(self) -> None:
        """Begin the stop when the time left reaches the lead (see :meth:`_timer`)."""
        self._spawn(self._timer())

    def _spawn(self, coroutine: Any) -> None:
        task: asyncio.Task[None] = asyncio.ensure_future(coroutine)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _time_left(self) -> tuple[float | None, float | None]:
        return await time_left(self.settings.job_id, self._environ)

    def _measured_save_s(self) -> float | None:
        """The newest committed checkpoint's save time (stall + background write)."""
        try:
            entries = list_checkpoints(self.settings.ckpt_root)
        except OSError:
            return None
        for entry in entries:
            if entry.committed and entry.stats is not None:
                return entry.stats.stall_s + entry.stats.write_s
        return None

    def _lead_s(self, limit_s: float | None) -> float:
        return warning_lead_s(
            limit_s,
            self._measured_save_s(),
            self.settings.stop_grace_s,
            self.settings.time_limit_lead_s,
        )

    async def _timer(self) -> None:
        """Start the planned stop when the time left reaches the lead: Slurm's USR1 was
        set at submit from the limit alone; this one also knows the measured save time
        (and a limit an operator changed since)."""
        while not self.begun and not self._stopping():
            left_s, limit_s = await self._time_left()
            if left_s is None:
                if limit_s is None:
                    return  # no limit (UNLIMITED): nothing to time
                await asyncio.sleep(60.0)
                continue
            lead_s = self._lead_s(limit_s)
            if left_s <= lead_s:
                log.info("%.0f s left of the time limit (%.0f s): planned stop", left_s,
                         limit_s or 0.0)  # fmt: skip
                self.begin()
                return
            await asyncio.sleep(min(60.0, max(1.0, left_s - lead_s)))

    def on_slurm_warning(self) -> None:
        """Slurm's USR1 (``--signal=B:USR1@LEAD``): the end is near, or not quite yet."""
        if not self.begun:
            self._spawn(self._slurm_warned())

    async def _slurm_warned(self) -> None:
        """Slurm sends the signal up to a minute early (its event resolution, man sbatch):
        when the time left is known and still longer than the lead, the timer starts the
        stop at the right moment instead (a one-minute job would lose half its run)."""
        left_s, limit_s = await self._time_left()
        lead_s = self._lead_s(limit_s)
        if left_s is not None and left_s > lead_s + EARLY_WARNING_SLACK_S:
            log.info("Slurm's warning came %.0f s before the end; the planned stop starts "
                     "%.0f s before it", left_s, lead_s)  # fmt: skip
            return
        self.begin()

    def begin(self) -> None:
        """The time limit is near: begin the planned stop, once."""
        if self.begun:
            return
        log.warning("time limit near: final checkpoint, graceful stop, requeue")
        self.begun = True
        self._spawn(self._announce())

    async def _announce(self) -> None:
        """Write the agents' notice, then tell the supervisor (which may be away)."""
        now = self._clock()
        left_s, limit_s = await self._time_left()
        if left_s is None:
            left_s = self._lead_s(limit_s)  # USR1 came: about the lead is left
        self._end_unix_s = now + left_s
        # Saving may take the time left but the grace and the requeue's room, and at
        # least half of it when the lead is short.
        save_s = max(left_s / 2, left_s - self.settings.stop_grace_s - REQUEUE_MARGIN_S)
        save_by = now + save_s
        notice = Notice(self.attempt, now, save_by, self._end_unix_s)
        self._spawn(self._requeue_at_deadline(self._end_unix_s))
        try:
            write_notice(self.settings.job_dir, notice)
        except OSError as error:
            log.error("could not write the time-limit notice (%s): stopping the ranks now", error)
            self._stop_step()
        await self._ask(
            DriverRequest(
                self.settings.job_id, DriverPhase.TIME_LIMIT, attempt=self.attempt,
                time_left_s=left_s, reason="time limit near",
            ),
            wait_s=min(10.0, left_s / 4),
        )  # fmt: skip

    async def await_requeue(self, returncode: int | None) -> int:
        """The ranks stopped for the time limit: the supervisor requeues the job, which
        ends this script (the deadline task requeues it here if the supervisor does not)."""
        if returncode is not None:
            log.info("ranks stopped for the time limit (step exit %d); the supervisor "
                     "requeues the job", returncode)  # fmt: skip
            end_unix_s = self._end_unix_s or self._clock()
            await self._ask(
                DriverRequest(
                    self.settings.job_id, DriverPhase.TIME_LIMIT, attempt=self.attempt,
                    exit_code=returncode, time_left_s=max(0.0, end_unix_s - self._clock()),
                    reason="stopped for the time limit",
                ),
                wait_s=max(0.0, end_unix_s - self._clock() - SELF_REQUEUE_BEFORE_END_S) / 2,
            )  # fmt: skip
        while not self._stopping() and self._requeue_failed is None:
            await asyncio.sleep(0.5)
        if self._requeue_failed is not None:
            print(f"resurgo: could not requeue the job before its time limit: "
                  f"{self._requeue_failed}; resubmit it with `resurgo submit` and the same "
                  "--ckpt-root: it resumes from its newest valid checkpoint",
                  flush=True)  # fmt: skip
            return 1
        return 143

    async def _requeue_at_deadline(self, end_unix_s: float) -> None:
        """Shortly before the end, requeue the job unless the supervisor did (a requeue
        ends this script, so still running then means it did not), whether or not the
        step has ended: agents still delivering their reports keep it running."""
        deadline = end_unix_s - SELF_REQUEUE_BEFORE_END_S
        while not self._stopping() and self._clock() < deadline:
            await asyncio.sleep(min(1.0, max(0.0, deadline - self._clock())))
        if self._stopping():
            return
        log.warning("not requeued by the supervisor with %.0f s left: requeueing the job",
                    end_unix_s - self._clock())  # fmt: skip
        try:
            await capture(["scontrol", "requeue", self.settings.job_id], self._environ)
        except (ResurgoError, OSError, TimeoutError) as error:
            self._requeue_failed = str(error)
