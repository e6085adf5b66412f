"""Runs the supervisor's own checks of blamed nodes as Slurm jobs, and reads their verdicts.

A :class:`~supervisor.core.intents.CheckNode` decision leaves an open row in
the store (:mod:`supervisor.store.checks`). At every Slurm poll
:meth:`NodeCheckRunner.sweep`, for each open check:

- waits while the blaming job still holds the node (its fast path shrinks the
  allocation, its requeue gives it up), then submits one batch job of the
  supervisor's own user pinned to the node (``sbatch --nodelist``) that runs
  :mod:`agent.node.nodecheck`; one Slurm job serves every open check of a node;
- reads the job's end from ``squeue``: COMPLETED passed; FAILED (the check's
  exit status 1), TIMEOUT (a hung node), NODE_FAIL or OUT_OF_MEMORY failed;
  anything else (cancelled by someone, preempted, forgotten by Slurm) has no
  verdict. The check writes its verdict line into its own job's comment,
  which ``squeue`` shows: no file system need be shared with the nodes;
- gives a check that could not start within ``node_check_wait_s`` up (the
  node stayed busy): no verdict, nothing drained.

What an ended check calls for is the core's (:func:`supervisor.core.drains.after_check`).
"""

from __future__ import annotations

import logging
import math
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from agent.node.nodecheck import MARK, parse_verdict
from supervisor.errors import SlurmError
from supervisor.slurm import SlurmActions
from supervisor.slurm.parse import JobState, SlurmJob
from supervisor.store import CheckResult, NodeCheckRow, Store

log = logging.getLogger("resurgo.supervisor")

JOB_NAME = "resurgo-node-check"
# Slurm ends: the check ran and said the node is not healthy, or the node failed it.
_FAILED = {
    JobState.FAILED: "the check failed",
    JobState.TIMEOUT: "the check did not finish within its time limit (a hung node?)",
    JobState.NODE_FAIL: "Slurm: NODE_FAIL while the check ran",
    JobState.OUT_OF_MEMORY: "the check ran out of memory",
}


@dataclass(frozen=True)
class CheckSettings:
    """How checks run: the operator's command (empty: built-in checks only), extra
    ``sbatch`` options, how long one may wait to start and how long it may run."""

    command: str = ""
    sbatch_options: tuple[str, ...] = ()
    wait_s: float = 3600.0
    time_s: float = 300.0
    python: str = sys.executable


@dataclass(frozen=True)
class Ended:
    """A check that ended at this sweep, with its verdict and the words for it."""

    check: NodeCheckRow
    result: CheckResult
    detail: str


class NodeCheckRunner:
    """Submits and follows the node checks in the store (see the module docstring)."""

    def __init__(
        self,
        store: Store,
        slurm: SlurmActions,
        settings: CheckSettings,
        clock: Callable[[], float],
    ) -> None:
        self._store = store
        self._slurm = slurm
        self._settings = settings
        self._clock = clock

    def submit_options(self, node: str) -> list[str]:
        """``sbatch`` options for a check of ``node``."""
        minutes = max(1, math.ceil((self._settings.time_s + 60) / 60))
        return [
            f"--job-name={JOB_NAME}",
            f"--nodelist={node}",
            "--nodes=1",
            "--ntasks=1",
            f"--time={minutes}",
            "--output=/dev/null",
            *self._settings.sbatch_options,
        ]

    def command(self) -> list[str]:
        """What the check job runs on the node."""
        argv = [self._settings.python, "-m", "agent.node.nodecheck"]
        argv += ["--timeout", f"{self._settings.time_s:g}", "--comment"]
        if self._settings.command:
            argv += ["--command", self._settings.command]
        return argv

    async def sweep(self, slurm_jobs: Mapping[int, SlurmJob]) -> list[Ended]:
        """Advance every open check on one ``squeue`` read; return those that ended."""
        ended: list[Ended] = []
        by_node: dict[str, list[NodeCheckRow]] = {}
        for check in self._store.open_node_checks():
            by_node.setdefault(check.node, []).append(check)
        for node, checks in by_node.items():
            ended += await self._advance(node, checks, slurm_jobs)
        return ended

    async def _advance(
        self, node: str, checks: Sequence[NodeCheckRow], slurm_jobs: Mapping[int, SlurmJob]
    ) -> list[Ended]:
        now = self._clock()
        running = next((c for c in checks if c.slurm_job_id is not None), None)
        if running is None:
            expired = [c for c in checks if now - c.raised_s > self._settings.wait_s]
            if expired:
                why = (
                    f"not started within node_check_wait_s {self._settings.wait_s:g} s: the "
                    f"blaming job kept {node}"
                )
                return self._end(expired, CheckResult.EXPIRED, why, now)
            if any(_holds(slurm_jobs.get(_slurm_id(c.job_id)), node) for c in checks):
                return []  # the blaming job still has the node: check it once it left
            await self._submit(node, checks[0], now)
            return []
        assert running.slurm_job_id is not None and running.submitted_s is not None
        job = slurm_jobs.get(running.slurm_job_id)
        if job is None:
            why = f"Slurm no longer lists check job {running.slurm_job_id}; no verdict"
            return self._end(checks, CheckResult.EXPIRED, why, now)
        if job.state is JobState.PENDING:
            if now - running.submitted_s <= self._settings.wait_s:
                return []
            await self._cancel(running.slurm_job_id)
            why = (
                f"check job {running.slurm_job_id} did not start within node_check_wait_s "
                f"{self._settings.wait_s:g} s ({job.state_reason}); no verdict"
            )
            return self._end(checks, CheckResult.EXPIRED, why, now)
        if not job.state.finished:
            return []
        result, detail = verdict_of(job, node)
        return self._end(checks, result, detail, now)

    async def _submit(self, node: str, check: NodeCheckRow, now: float) -> None:
        try:
            job_id = await self._slurm.run_command(self.submit_options(node), self.command())
        except SlurmError as error:
            log.warning("node check of %s not submitted (next poll tries again): %s", node, error)
            return
        self._store.node_check_submitted(check.check_id, job_id, now)
        log.info(
            "node %s: blamed by job %s; the supervisor checks it (Slurm job %d)",
            node, check.job_id, job_id,
        )  # fmt: skip

    async def _cancel(self, slurm_job_id: int) -> None:
        try:
            await self._slurm.cancel(slurm_job_id)
        except SlurmError as error:
            log.warning("node check job %d not cancelled: %s", slurm_job_id, error)

    def _end(
        self, checks: Sequence[NodeCheckRow], result: CheckResult, detail: str, now: float
    ) -> list[Ended]:
        ended = []
        for check in checks:
            if self._store.end_node_check(check.check_id, result, detail, now):
                ended.append(Ended(check, result, detail))
        return ended


def verdict_of(job: SlurmJob, node: str) -> tuple[CheckResult, str]:
    """The check's verdict from its finished Slurm job: the state, and the verdict line
    the check wrote into the job's comment as the words."""
    said = parse_verdict(job.comment, node) if MARK.strip() in job.comment else None
    if job.state is JobState.COMPLETED:
        return CheckResult.PASSED, said[1] if said else "the check exited 0"
    if job.state in _FAILED:
        exit_words = f"exit code {job.exit_code}" if job.exit_code is not None else ""
        words = said[1] if said else _FAILED[job.state]
        return (
            CheckResult.FAILED,
            f"{words} ({job.state.value}{', ' + exit_words if exit_words else ''})",
        )
    return CheckResult.EXPIRED, f"check job {job.job_id} ended {job.state_raw}; no verdict"


def _holds(job: SlurmJob | None, node: str) -> bool:
    """Whether the blaming job (as ``squeue`` shows it) still has ``node``."""
    return job is not None and not job.state.finished and node in job.nodes


def _slurm_id(job_id: str) -> int:
    return int(job_id) if job_id.isdigit() else -1
