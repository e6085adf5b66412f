"""The one place that runs Slurm commands.

Every call is an argv list built by `parse.py` (never a shell), runs under a
timeout, and ends in a value or a typed error: `SlurmUnavailable` when Slurm
could not be asked (binary missing, timeout, controller unreachable),
`SlurmCommandFailed` when it answered no. A failed query means "unknown",
never "the job is gone".
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence

from tenacity import AsyncRetrying, retry_if_exception_type, stop_after_attempt, wait_fixed

from supervisor.children import subprocess_runner
from supervisor.errors import (
    SlurmCommandFailed,
    SlurmError,
    SlurmNotSettled,
    SlurmRequeueFailed,
    SlurmUnavailable,
)
from supervisor.slurm import parse
from supervisor.slurm.parse import JobState, SlurmJob, SlurmNode

log = logging.getLogger(__name__)

Runner = Callable[[Sequence[str], float], Awaitable[tuple[int, str, str]]]
"""Runs argv with a timeout; returns (returncode, stdout, stderr); raises TimeoutError/OSError."""

Sleep = Callable[[float], Awaitable[None]]

# Slurm clients exit 1 both for "no" and for "could not ask"; these stderr
# fragments mean the controller was never reached, so the answer is unknown.
_UNREACHABLE = (
    "unable to contact slurm controller",
    "socket timed out",
    "connection refused",
    "could not establish a configuration source",
    "slurm_load_jobs error: slurm backup controller in standby mode",
)
# slurmctld refusing for now, not for good (seen on 22.05 right after a job's
# previous update: "Job update not available right now, the DB index is being
# set, try again in a bit"): retried like an unreachable controller.
_BUSY = ("try again in a bit", "resource temporarily unavailable")


class SlurmClient:
    """Async Slurm CLI adapter: queries (retried) and admin commands (logged, not retried).

    Implements :class:`supervisor.slurm.interface.Slurm`; users depend on that.
    """

    def __init__(
        self,
        env: Mapping[str, str] | None = None,
        timeout_s: float = 15.0,
        runner: Runner | None = None,
        read_attempts: int = 3,
        retry_wait_s: float = 0.5,
        requeue_settle_s: float = 60.0,
        requeue_confirm_s: float = 10.0,
        sleep: Sleep = asyncio.sleep,
        clock: Callable[[], float] = time.time,
    ) -> None:
        """``env`` is added to os.environ (e.g. SLURM_CONF); ``runner`` replaces subprocesses."""
        self._env = {**os.environ, **env} if env is not None else None
        self._timeout_s = timeout_s
        self._runner = runner
        self._read_attempts = read_attempts
        self._retry_wait_s = retry_wait_s
        self._requeue_settle_s = requeue_settle_s
        self._requeue_confirm_s = requeue_confirm_s
        self._clock = clock
        self._sleep = sleep
        self._hostnames: dict[str, tuple[str, ...]] = {}
        self._sinfo = parse.SinfoParser()

    # --- the choke point ---------------------------------------------------------

    async def _run(self, argv: list[str]) -> str:
        """Run one command; return stdout or raise SlurmUnavailable / SlurmCommandFailed."""
        try:
            if self._runner is not None:
                code, out, err = await self._runner(argv, self._timeout_s)
            else:
                code, out, err = await subprocess_runner(argv, self._timeout_s, self._env)
        except TimeoutError as error:
            raise SlurmUnavailable(
                f"`{' '.join(argv)}` gave no answer in {self._timeout_s} s: is slurmctld up?"
            ) from error
        except OSError as error:
            raise SlurmUnavailable(
                f"cannot run `{argv[0]}` ({error}): are the Slurm client tools on PATH?"
            ) from error
        if code != 0:
            if any(fragment in err.lower() for fragment in _UNREACHABLE):
                raise SlurmUnavailable(
                    f"`{' '.join(argv)}` could not reach the controller: {err.strip()}"
                )
            if any(fragment in err.lower() for fragment in _BUSY):
                raise SlurmUnavailable(f"`{' '.join(argv)}`: slurmctld is busy: {err.strip()}")
            raise SlurmCommandFailed(argv, code, err)
        return out

    async def _query(self, argv: list[str]) -> str:
        """A read: retried a few times when Slurm was unreachable, never when it said no."""
        retrying = AsyncRetrying(
            stop=stop_after_attempt(self._read_attempts),
            wait=wait_fixed(self._retry_wait_s),
            retry=retry_if_exception_type(SlurmUnavailable),
            sleep=self._sleep,
            reraise=True,
        )
        async for attempt in retrying:
            with attempt:
                return await self._run(argv)
        raise AssertionError("unreachable: tenacity reraises the last error")

    async def _mutate(self, argv: list[str]) -> None:
        """An admin command: logged at INFO, run once (a retry could act twice)."""
        log.info("slurm: %s", " ".join(argv))
        await self._run(argv)

    # --- queries -------------------------------------------------------------------

    async def jobs(self) -> dict[int, SlurmJob]:
        """Every job Slurm knows, by id."""
        text = await self._query(parse.squeue_argv())
        # Megabytes on a large cluster: parsed off the event loop, which keeps
        # serving agents meanwhile (json.loads still holds the GIL, in shorter runs).
        return await asyncio.to_thread(parse.parse_squeue_json, text)

    async def job(self, job_id: int) -> SlurmJob | None:
        """The job, or None when Slurm answered and does not list it.

        A failed query raises SlurmUnavailable: unknown is not gone.
        """
        return (await self.jobs()).get(job_id)

    async def nodes(self) -> dict[str, SlurmNode]:
        """Every node, by name."""
        text = await self._query(parse.sinfo_argv())
        # As for jobs(); unchanged nodes are not built again (SinfoParser).
        return await asyncio.to_thread(self._sinfo.parse, text)

    async def show_config(self) -> str:
        """``scontrol show config`` (for :mod:`supervisor.slurm.rights`)."""
        return await self._query(["scontrol", "show", "config"])

    async def admin_level(self, user: str) -> str:
        """``user``'s AdminLevel in the accounting database (SlurmCommandFailed without one)."""
        return await self._query(["sacctmgr", "-nP", "show", "user", user, "format=AdminLevel"])

    async def hostnames(self, node_list: str) -> tuple[str, ...]:
        """Slurm's own expansion of a hostlist, cached per distinct list."""
        if node_list not in self._hostnames:
            text = await self._query(parse.hostnames_argv(node_list))
            self._hostnames[node_list] = tuple(text.split())
        return self._hostnames[node_list]

    # --- admin ------------------------------------------------------------------------

    async def drain(self, node: str, reason: str) -> None:
        """Drain ``node`` with ``reason`` (see `parse.drain_reason`)."""
        await self._mutate(parse.drain_argv(node, reason))

    async def resume(self, node: str) -> None:
        """Return ``node`` to service."""
        await self._mutate(parse.resume_argv(node))

    async def shrink(self, job_id: int, keep_nodes: Sequence[str]) -> None:
        """Shrink a running job to ``keep_nodes``; its steps on the other nodes are killed."""
        await self._mutate(parse.shrink_argv(job_id, keep_nodes))

    async def submit_held(self, options: Sequence[str], script: str) -> int:
        """``sbatch --hold`` the batch script with ``options``; return the new job id.

        Run once, never retried: a retry after a lost answer would submit twice.
        """
        argv = parse.sbatch_argv(options, script)
        log.info("slurm: %s", " ".join(argv))
        return parse.parse_sbatch_id(await self._run(argv))

    async def run_command(self, options: Sequence[str], command: Sequence[str]) -> int:
        """``sbatch --wrap`` ``command`` with ``options``; return the new job id.

        Run once, never retried: a retry after a lost answer would submit twice.
        """
        argv = parse.run_argv(options, command)
        log.info("slurm: %s", " ".join(argv))
        return parse.parse_sbatch_id(await self._run(argv))

    async def test_only(self, options: Sequence[str], script: str) -> str | None:
        """None when ``sbatch --test-only`` accepts the request now, else Slurm's words.

        A refusal may be for now only (a needed node drained), so it is a
        question for :meth:`never_runs` once the job is released, not a verdict.
        """
        try:
            await self._run(parse.test_only_argv(options, script))
        except SlurmCommandFailed as refused:
            return " ".join(refused.stderr.split())[:500] or f"exit code {refused.returncode}"
        return None

    async def never_runs(self, job_id: int, settle_s: float) -> str | None:
        """The pending reason that says the released job can never start, or None.

        Waits up to ``settle_s`` for the scheduler's first look at the job; a
        job that runs, ends, or pends for any other reason (resources,
        priority, an unavailable node) is None.
        """
        retrying = self._until_settled(settle_s)
        try:
            async for attempt in retrying:
                with attempt:
                    job = await self.job(job_id)
                    if job is None or job.state is not JobState.PENDING:
                        return None
                    if job.state_reason in parse.NEVER_REASONS:
                        return job.state_reason
                    if job.state_reason in ("None", "") or job.state_reason.startswith("JobHeld"):
                        raise _NotYet
                    return None
        except _NotYet:
            return None
        raise AssertionError("unreachable: tenacity reraises the last error")

    async def release(self, job_id: int) -> None:
        """Release a held job."""
        await self._mutate(parse.release_argv(job_id))

    async def cancel(self, job_id: int, signal: str | None = None) -> None:
        """Cancel the job, or send it ``signal``."""
        await self._mutate(parse.cancel_argv(job_id, signal))

    async def requeue_smaller(
        self, job_id: int, n_nodes: int, n_tasks: int, exclude_nodes: Sequence[str] = ()
    ) -> None:
        """Requeue the job under the same id with ``n_nodes`` nodes, avoiding ``exclude_nodes``.

        requeuehold -> wait until PENDING -> (the next second) -> update size ->
        StartTime=now -> release (DESIGN §4). Safe to call again after a crash part-way: a job
        already pending is not requeued twice. A failure raises
        SlurmRequeueFailed naming the step, chained to the Slurm error.
        """
        size_argv = parse.update_size_argv(job_id, n_nodes, n_tasks, exclude_nodes)
        step = "query"
        try:
            job = await self._require(job_id)
            if job.state in _REQUEUE_HOLDS:
                step = "requeuehold"
                await self._mutate(parse.requeue_hold_argv(job_id))
            step = "wait for pending"
            # requeuehold returns at once but the job is COMPLETING until its
            # epilog ends; an update made before the requeue lands is overwritten
            # by it (22.05 kept the old NumNodes and a 120 s begin time).
            await self._wait_pending(job_id)
            # Every change in the next second: an update now would have Slurm's
            # scheduler run now, and its next run may be seconds after the release.
            await self._past_the_kill_second(self._clock())
            step = "update size"
            await self._mutate(size_argv)
            step = "start now"
            started_at = self._clock()
            await self._mutate(parse.start_now_argv(job_id))
            step = "release"
            await self._mutate(parse.release_argv(job_id))
        except SlurmError as error:
            raise SlurmRequeueFailed(job_id, step, error) from error
        try:
            await self._confirm_start_now(job_id, size_argv, started_at)
        except SlurmError as error:
            # The requeue is done; only the guard against its late begin time failed.
            log.warning("slurm: could not confirm job %d's start time: %s", job_id, error)

    async def _past_the_kill_second(self, pending_at: float) -> None:
        """Wait until the second after the one the job was seen PENDING in.

        Ending the job's last run revoked its credential on every node it ran
        on, stamped in whole seconds, and a node refuses a credential created in
        or before that second ("Job credential revoked": the batch script is
        never launched and the job ends FAILED; seen when the requeued job was
        scheduled 0.14 s after its release, in the kill's second). Slurm's own
        guard is the 121 s begin time this requeue clears. The revocation came
        before the job read PENDING, so a start from the next second on is safe;
        a start time in the future is no answer: the job would then wait for the
        scheduler's next cycle (up to a minute), not for the time.
        """
        wait_s = math.floor(pending_at) + 1 + KILL_SECOND_MARGIN_S - self._clock()
        if wait_s > 0:
            await self._sleep(wait_s)

    async def _confirm_start_now(self, job_id: int, size_argv: list[str], since: float) -> None:
        """Apply size and start time again if the requeue's own begin time landed after them.

        22.05 ends a requeue (``batch_requeue_fini``) once the job's nodes are
        released, and sets its begin time to now + the credential lifetime
        (121 s) then; seen once under load, that came after a job read PENDING
        and after our update, so the released job waited two minutes. Polls
        until the scheduler has looked at the job: it started, or it pends for
        a reason other than that begin time.
        """
        retrying = self._until_settled(self._requeue_confirm_s)
        try:
            async for attempt in retrying:
                with attempt:
                    job = await self._require(job_id)
                    if job.state is not JobState.PENDING:
                        return
                    late = job.eligible_time is not None and job.eligible_time > since + 5
                    if late:
                        log.warning(
                            "slurm: job %d's requeue set its begin time after the resize; "
                            "applying size and start time again",
                            job_id,
                        )
                        await self._mutate(size_argv)
                        since = self._clock()
                        await self._mutate(parse.start_now_argv(job_id))
                        if job.held:
                            await self._mutate(parse.release_argv(job_id))
                        raise _NotYet(f"job {job_id} resized again")
                    if job.state_reason in ("None", "") or job.held:
                        raise _NotYet(f"job {job_id} not looked at yet")
        except _NotYet:
            return  # still unscheduled after the window: a question for never_runs

    def _until_settled(self, settle_s: float) -> AsyncRetrying:
        """Tries every ``retry_wait_s`` for ``settle_s`` while a step raises :class:`_NotYet`."""
        return AsyncRetrying(
            stop=stop_after_attempt(max(1, int(settle_s / self._retry_wait_s))),
            wait=wait_fixed(self._retry_wait_s),
            retry=retry_if_exception_type(_NotYet),
            sleep=self._sleep,
            reraise=True,
        )

    async def _require(self, job_id: int) -> SlurmJob:
        job = await self.job(job_id)
        if job is None:
            raise SlurmCommandFailed(parse.squeue_argv(), 0, f"job {job_id} is not listed")
        return job

    async def _wait_pending(self, job_id: int) -> None:
        retrying = self._until_settled(self._requeue_settle_s)
        async for attempt in retrying:
            with attempt:
                job = await self._require(job_id)
                if job.state is not JobState.PENDING:
                    raise _NotYet(f"job {job_id} is {job.state_raw}, not PENDING yet")


# How far past the revocation's second a requeued job starts: clocks of slurmctld's
# and this host's apart, and a second boundary's rounding.
KILL_SECOND_MARGIN_S = 0.05


# States from which requeuehold brings the job back under the same id: running
# ones, and ended ones while slurmctld still holds the job (MinJobAge): a job
# that reached its time limit (TIMEOUT) or was preempted before the supervisor
# acted (verified on Slurm 22.05). Already PENDING/COMPLETING: the requeue landed.
_REQUEUE_HOLDS = frozenset(
    {
        JobState.RUNNING,
        JobState.SUSPENDED,
        JobState.TIMEOUT,
        JobState.PREEMPTED,
        JobState.NODE_FAIL,
        JobState.FAILED,
        JobState.BOOT_FAIL,
        JobState.DEADLINE,
        JobState.OUT_OF_MEMORY,
    }
)


class _NotYet(SlurmNotSettled):
    """Internal: the job has not reached the state a step waits for (yet)."""


__all__ = ["Runner", "SlurmClient"]
