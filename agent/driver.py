"""The in-job driver: the batch script's main program (``python -m agent.driver``).

``resurgo submit`` writes a batch script that ``exec``s this. It

1. asks the supervisor how to launch (``POST /v1/driver``, phase ``start``):
   on the current allocation, resuming from the checkpoint the supervisor
   chose when the job was requeued;
2. runs one node agent per node with ``srun`` (explicit counts and node list
   from the current allocation: inherited counts are wrong after a resize),
   each agent launching the user's command (usually torchrun);
3. while the step runs, asks every few seconds whether the supervisor moved
   on (phase ``running``): a step with a task on a dead node never ends by
   itself, so when a relaunch of a later attempt (or a stop) is ordered, the
   driver ends the step (SIGTERM, then SIGKILL);
4. when a step fails, asks again (phase ``ended``) and, told so, starts a
   new step on the nodes the supervisor names, with ``RESURGO_RESUME_FROM``
   (and ``RESURGO_SKIP_SAMPLES``, the data to leave out after a rollback past
   a loss anomaly) set through the agent, and confirms the relaunch (phase
   ``relaunched``);
5. exits 0 when a step succeeds or the supervisor says the run completed (a
   rank that died in its teardown after the last step), and exits
   :data:`DO_NOT_REQUEUE_EXIT` (93)
   with the supervisor's reason when told to stop (a crash loop, a user
   error, no valid checkpoint, an operator's cancel): Slurm records the job
   FAILED with exit code 93, which tells wrappers and dependency chains not
   to start it again;
6. before the time limit (Slurm's ``USR1``, requested by ``resurgo submit``,
   or its own timer from the job's time left and the measured save time)
   runs the planned stop of :mod:`agent.timelimit`: a notice to the agents
   (final checkpoint, then a graceful stop) and to the supervisor, which
   requeues the job at its size before Slurm ends it; a supervisor that does
   not do so in time is replaced by ``scontrol requeue`` of the job itself.

A supervisor that does not answer is retried with jittered backoff
(tenacity) for ``--supervisor-wait-s``; the running step never depends on it.
If the supervisor stays unreachable at start, the job launches anyway and the
in-rank library resumes from the newest valid checkpoint by itself. After a
failure with no supervisor to ask, the driver ends the job with the step's
exit status rather than guessing where to relaunch.

This module runs ``srun`` and ``scontrol`` for its own job only; the
supervisor's Slurm adapter is the one place that administers Slurm.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import logging
import os
import re
import signal
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import tenacity

from agent.checkpoint.catalog import list_checkpoints
from agent.checkpoint.quarantine import newer_than, quarantine
from agent.node.sparecheck import parse_verdicts
from agent.ports import rendezvous_port
from agent.skips import ENV_SKIP_SAMPLES, SampleRange, format_skip_samples
from agent.stopfiles import clear_notice, write_notice
from agent.timelimit import REQUEUE_MARGIN_S, Notice, parse_slurm_duration, warning_lead_s
from agent.wire import protocol
from agent.wire.auth import Rejected, load_secret, signed_post
from agent.wire.errors import ConfigError, ResurgoError
from agent.wire.protocol import DriverAction, DriverAnswer, DriverPhase, DriverRequest

log = logging.getLogger("resurgo.driver")

# A relaunched step that fails this fast did not start (bad node list, srun refused).
START_CHECK_S = 5.0
# Slurm's USR1 this much earlier than the lead is taken as early, not as the moment.
EARLY_WARNING_SLACK_S = 5.0
# The batch script's exit code when the supervisor ended the job for good: the
# convention of torch elastic's launchers for "do not restart" (docs/operations.md).
DO_NOT_REQUEUE_EXIT = 93
# The supervisor requeues as soon as the ranks stopped; the driver does it itself
# only this close to the end (the requeue takes about two seconds).
SELF_REQUEUE_BEFORE_END_S = 5.0
# The longest an idle spares' health-check step may take: each check bounds
# itself (the agents' health timeouts); this bounds srun on a node that hangs.
SPARE_CHECK_LIMIT_S = 180.0
# What counts as no answer, asked again: the supervisor down or refusing, and an
# answer cut off or garbled on the way (a supervisor killed while replying).
_NO_ANSWER = (aiohttp.ClientError, TimeoutError, Rejected, protocol.ProtocolError)


@dataclass(frozen=True)
class DriverSettings:
    """The driver's command line (the batch script passes it)."""

    job_id: str
    job_dir: Path
    supervisor_url: str
    ckpt_root: str
    command: tuple[str, ...]
    python: str = sys.executable
    supervisor_wait_s: float = 600.0
    start_wait_s: float = 60.0
    request_timeout_s: float = 10.0
    start_check_s: float = START_CHECK_S
    watch_s: float = 2.0
    kill_grace_s: float = 10.0
    # The agents' SIGTERM-to-SIGKILL grace, counted into the time-limit warning.
    stop_grace_s: float = 30.0
    # Seconds before the time limit to start the planned stop (None: computed).
    time_limit_lead_s: float | None = None
    # Ranks per node, for the agents of a per-rank launch (srun-style, python train.py).
    procs_per_node: int = 1
    # The world's node count when the allocation holds hot spares besides it
    # (None: the world is the whole allocation). Used only when no supervisor
    # says where to launch.
    world_nodes: int | None = None


def build_parser() -> argparse.ArgumentParser:
    """``python -m agent.driver``'s flags."""
    parser = argparse.ArgumentParser(
        prog="python -m agent.driver",
        description="Resurgo's in-job driver: runs the node agents with srun and relaunches "
        "them where the supervisor says after a fault. Written into batch scripts by "
        "`resurgo submit`.",
    )
    parser.add_argument(
        "--jobs-dir", required=True, help="the supervisor's jobs directory (holds the secret)"
    )
    parser.add_argument("--supervisor-url", required=True)
    parser.add_argument("--ckpt-root", required=True)
    parser.add_argument(
        "--procs-per-node",
        type=int,
        default=1,
        help="ranks per node: the agents start this many of a per-rank command (default 1)",
    )
    parser.add_argument(
        "--supervisor-wait-s",
        type=float,
        default=600.0,
        help="after a failure, how long to keep asking an unreachable supervisor",
    )
    parser.add_argument(
        "--start-wait-s",
        type=float,
        default=60.0,
        help="at start, how long to wait for the supervisor before launching unsupervised",
    )
    parser.add_argument(
        "--time-limit-lead-s",
        type=float,
        default=None,
        help="start the planned stop this many seconds before the time limit (default: "
        "room for two saves of the measured size, the stop grace and the requeue, at "
        "most a quarter of the limit)",
    )
    parser.add_argument(
        "--world-nodes",
        type=int,
        default=None,
        help="the world's node count when the job holds hot spares besides it: without "
        "a supervisor the driver launches on the allocation's first N nodes",
    )
    parser.add_argument(
        "--stop-grace-s",
        type=float,
        default=30.0,
        help="the agents' SIGTERM-to-SIGKILL grace (counted into the time-limit warning)",
    )
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- COMMAND ...")
    return parser


def settings_from(argv: Sequence[str], environ: Mapping[str, str]) -> DriverSettings:
    """Parse the flags; the job id comes from Slurm (``SLURM_JOB_ID``)."""
    args = build_parser().parse_args(list(argv))
    job_id = environ.get("SLURM_JOB_ID", "")
    if not job_id:
        raise ConfigError("SLURM_JOB_ID is not set: the driver runs as a Slurm batch script")
    command = list(args.command)
    if command and command[0] == "--":
        command = command[1:]
    if not command:
        raise ConfigError("no command after --")
    return DriverSettings(
        job_id=job_id,
        job_dir=Path(args.jobs_dir) / job_id,
        supervisor_url=args.supervisor_url.rstrip("/"),
        ckpt_root=args.ckpt_root,
        command=tuple(command),
        supervisor_wait_s=args.supervisor_wait_s,
        start_wait_s=args.start_wait_s,
        stop_grace_s=args.stop_grace_s,
        time_limit_lead_s=args.time_limit_lead_s,
        procs_per_node=args.procs_per_node,
        world_nodes=args.world_nodes,
    )


def agent_argv(
    settings: DriverSettings,
    nodes: Sequence[str],
    master_addr: str,
    attempt: int,
    resume_from: str | None,
    master_port: int,
    skip_samples: Sequence[SampleRange] = (),
) -> list[str]:
    """``srun`` running one node agent per node of ``nodes``, each launching the command
    (``master_port``: from :func:`agent.ports.rendezvous_port`; ``skip_samples``: the
    windows of the global sample cursor the ranks leave out).

    ``--overlap``: a step with a task on a dead node stays "completing" until Slurm
    marks that node DOWN (``SlurmdTimeout``, 300 s by default), even after the job
    was shrunk off the node, and holds its CPUs on the live nodes all that time:
    without it, the relaunch after a lost node waits for them ("Requested nodes
    are busy"). Steps of one job run one after the other here, the earlier one
    ended first, so sharing its resources in Slurm's books takes nothing from
    anyone.
    """
    count = str(len(nodes))
    return [
        "srun",
        f"--nodes={count}",
        f"--ntasks={count}",
        "--ntasks-per-node=1",
        f"--nodelist={','.join(nodes)}",
        "--overlap",
        "--kill-on-bad-exit=0",
        "--export=ALL",
        settings.python, "-m", "agent.node.agent",
        "--supervisor-url", settings.supervisor_url,
        "--secret-file", str(settings.job_dir / "secret"),
        "--master-addr", master_addr,
        "--master-port", str(master_port),
        "--launch-nonce", str(attempt),
        "--attempt", str(attempt),
        "--ckpt-root", settings.ckpt_root,
        "--time-limit-file", str(settings.job_dir / "time-limit.json"),
        "--stop-grace-s", str(settings.stop_grace_s),
        "--procs-per-node", str(settings.procs_per_node),
        *(["--resume-from", resume_from] if resume_from else []),
        *(["--skip-samples", format_skip_samples(skip_samples)] if skip_samples else []),
        "--", *settings.command,
    ]  # fmt: skip


def spare_check_argv(
    settings: DriverSettings, spares: Sequence[str], master_addr: str, master_port: int
) -> list[str]:
    """``srun`` running :mod:`agent.node.sparecheck` once on each idle spare of ``spares``,
    with the rendezvous address of the world it would join. ``--overlap``: the check
    holds no resources a relaunch onto the spare would wait for."""
    count = str(len(spares))
    return [
        "srun",
        f"--nodes={count}",
        f"--ntasks={count}",
        "--ntasks-per-node=1",
        f"--nodelist={','.join(spares)}",
        "--overlap",
        "--kill-on-bad-exit=0",
        "--export=ALL",
        settings.python, "-m", "agent.node.sparecheck",
        "--master-addr", master_addr,
        "--master-port", str(master_port),
        "--ckpt-root", settings.ckpt_root,
        "--", *settings.command,
    ]  # fmt: skip


async def _capture(argv: Sequence[str], environ: Mapping[str, str]) -> str:
    process = await asyncio.create_subprocess_exec(
        *argv, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, env=dict(environ)
    )
    out, err = await asyncio.wait_for(process.communicate(), timeout=30)
    if process.returncode != 0:
        raise ResurgoError(f"`{' '.join(argv)}` failed: {err.decode(errors='replace').strip()}")
    return out.decode()


async def _run_bounded(argv: Sequence[str], environ: Mapping[str, str], limit_s: float) -> str:
    """Run ``argv`` to its end within ``limit_s`` and return its standard output, whatever
    its exit status; on timeout or cancellation its process group is killed."""
    process = await asyncio.create_subprocess_exec(
        *argv,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.DEVNULL,
        env=dict(environ),
        start_new_session=True,
    )
    try:
        out, _ = await asyncio.wait_for(process.communicate(), timeout=limit_s)
    except BaseException:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        await process.wait()
        raise
    return out.decode(errors="replace")


async def current_nodes(environ: Mapping[str, str]) -> tuple[str, ...]:
    """The batch job's nodes now (``scontrol show hostnames`` of ``SLURM_JOB_NODELIST``)."""
    node_list = environ.get("SLURM_JOB_NODELIST", "")
    if not node_list:
        raise ConfigError("SLURM_JOB_NODELIST is not set")
    argv = ["scontrol", "show", "hostnames", node_list]
    return tuple((await _capture(argv, environ)).split())


async def node_address(node: str, environ: Mapping[str, str]) -> str:
    """The address other nodes reach ``node`` at (its Slurm NodeAddr)."""
    text = await _capture(["scontrol", "show", "node", node], environ)
    found = re.search(r"NodeAddr=(\S+)", text)
    return found.group(1) if found else node


class Driver:
    """One job's driver; :meth:`run` returns the batch script's exit status."""

    def __init__(
        self,
        settings: DriverSettings,
        environ: Mapping[str, str],
        *,
        clock: Callable[[], float] = time.time,
        backoff: tenacity.wait.wait_base | None = None,
    ) -> None:
        self.settings = settings
        self._environ = environ
        self._clock = clock
        self._backoff = backoff or tenacity.wait_random_exponential(multiplier=0.5, max=10.0)
        self._secret = load_secret(settings.job_dir / "secret")
        self._step: asyncio.subprocess.Process | None = None
        self._rendezvous: tuple[str, int] | None = None  # the running step's master
        self._spare_check: asyncio.Task[None] | None = None
        self._stopping = False
        self._time_limit = False
        self._attempt = 1
        self._end_unix_s: float | None = None
        self._requeue_failed: str | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        # Checkpoints moved into quarantine for the last launch, not yet reported.
        self._quarantined: tuple[tuple[str, str], ...] = ()

    async def run(self) -> int:
        """Launch, watch, relaunch as told; see the module docstring."""
        loop = asyncio.get_running_loop()
        for signum in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(signum, self._on_signal, signum)
        loop.add_signal_handler(signal.SIGUSR1, self._on_slurm_warning)
        # A notice from an earlier run of this job (requeued) is not this run's.
        clear_notice(self.settings.job_dir)
        async with aiohttp.ClientSession() as session:
            self._session = session
            self._spawn(self._time_limit_timer())
            answer = await self._ask(
                DriverRequest(self.settings.job_id, DriverPhase.START),
                self.settings.start_wait_s,
            )
            if answer is None:
                log.warning("supervisor unreachable: launching; the ranks resume by themselves")
                answer = DriverAnswer(DriverAction.LAUNCH, 1, reason="supervisor unreachable")
            launched = False
            ended_with: int | None = None  # the exit code of the step last run
            while not self._stopping:
                if answer.action is DriverAction.DONE:
                    print(f"resurgo: the run completed: {answer.reason}", flush=True)
                    return 0
                if answer.action is DriverAction.STOP:
                    print(
                        f"resurgo: job stopped by the supervisor: {answer.reason} (exit "
                        f"{DO_NOT_REQUEUE_EXIT}: do not requeue)",
                        flush=True,
                    )
                    return DO_NOT_REQUEUE_EXIT
                if answer.action is DriverAction.WAIT and self._time_limit:
                    return await self._await_requeue(None)
                if answer.action is DriverAction.WAIT:
                    log.info("waiting: %s", answer.reason)
                    await asyncio.sleep(answer.retry_after_s)
                    # Told to wait before the first launch (a checkpoint is still
                    # being chosen): ask to start again, not about a step never run.
                    phase = DriverPhase.ENDED if launched else DriverPhase.START
                    attempt = answer.attempt if launched else None
                    # Each ask says again how the step ended: a supervisor that
                    # restarted meanwhile knows it from this request alone.
                    asked = await self._ask(
                        DriverRequest(
                            self.settings.job_id, phase, attempt=attempt, exit_code=ended_with
                        )
                    )
                    if asked is None:
                        return 1
                    answer = asked
                    continue
                launched = True
                ended_with = None
                returncode, told = await self._launch(answer)
                if told is not None:
                    answer = told  # the supervisor moved on while the step still ran
                    continue
                if returncode == 0:
                    log.info("step finished successfully")
                    return 0
                if self._time_limit:
                    return await self._await_requeue(returncode)
                if self._stopping:
                    break
                log.warning("step of attempt %d ended with %d; asking", answer.attempt, returncode)
                ended_with = returncode
                asked = await self._ask(DriverRequest(
                    self.settings.job_id, DriverPhase.ENDED, attempt=answer.attempt,
                    exit_code=returncode,
                ))  # fmt: skip
                if asked is None:
                    print("resurgo: the supervisor is unreachable after a failure; ending the job",
                          flush=True)  # fmt: skip
                    return returncode
                answer = asked
        return 143

    async def _launch(self, answer: DriverAnswer) -> tuple[int, DriverAnswer | None]:
        """Run one step to its end; or, when the supervisor moves on while it runs (a
        relaunch of a later attempt, a stop), end it and return what it said."""
        returncode = await self._start(answer)
        if returncode is not None:
            return returncode, None
        assert self._step is not None
        ended = asyncio.ensure_future(self._step.wait())
        try:
            while True:
                done, _ = await asyncio.wait({ended}, timeout=self.settings.watch_s)
                if done:
                    return ended.result(), None
                told = await self._ask(
                    DriverRequest(
                        self.settings.job_id, DriverPhase.RUNNING, attempt=answer.attempt
                    ),
                    wait_s=0.0,
                )
                moved_on = told is not None and (
                    # Done: every rank has exited, the launchers only wait in torchrun's
                    # exit barrier for the one whose rank died in its teardown (300 s).
                    told.action in (DriverAction.STOP, DriverAction.DONE)
                    or (told.action is DriverAction.RELAUNCH and told.attempt > answer.attempt)
                )
                if moved_on and told is not None:
                    log.warning("the supervisor moved on (%s): ending the step", told.reason)
                    return await self._end_step(ended), told
                if told is not None and told.check_spares:
                    self._start_spare_check(told.check_spares, answer.attempt)
        finally:
            await self._stop_spare_check()

    # -- the idle spares' health checks (agent.node.sparecheck) ---------------------

    def _start_spare_check(self, spares: Sequence[str], attempt: int) -> None:
        """Check the idle spares beside the step, unless a check still runs."""
        if self._spare_check is not None and not self._spare_check.done():
            return
        self._spare_check = asyncio.ensure_future(self._check_spares(tuple(spares), attempt))

    async def _stop_spare_check(self) -> None:
        """End a check still running: the step it ran beside is over."""
        check, self._spare_check = self._spare_check, None
        if check is not None and not check.done():
            check.cancel()
            await asyncio.gather(check, return_exceptions=True)

    async def _check_spares(self, spares: tuple[str, ...], attempt: int) -> None:
        """Run the health gate on ``spares`` and tell the supervisor what failed. A spare
        that gave no verdict (srun could not run the check there) is not reported:
        Slurm's own view of the node says what became of it."""
        assert self._rendezvous is not None
        argv = spare_check_argv(self.settings, spares, *self._rendezvous)
        try:
            output = await _run_bounded(argv, self._environ, SPARE_CHECK_LIMIT_S)
        except (OSError, TimeoutError) as error:
            log.warning("spare check on %s gave no answer: %s", ",".join(spares), error)
            return
        verdicts = parse_verdicts(output, spares)
        unhealthy = tuple(
            (node, protocol.clip_text(verdict.failures(), protocol.MAX_SPARE_DETAIL_CHARS))
            for node, verdict in sorted(verdicts.items())
            if not verdict.healthy
        )
        silent = [node for node in spares if node not in verdicts]
        log.info(
            "spare check: %d healthy, %d unhealthy%s%s",
            len(verdicts) - len(unhealthy), len(unhealthy),
            "".join(f"; {node}: {detail}" for node, detail in unhealthy),
            f"; no verdict from {','.join(silent)}" if silent else "",
        )  # fmt: skip
        if verdicts:
            await self._ask(
                DriverRequest(
                    self.settings.job_id, DriverPhase.SPARE_CHECK, attempt=attempt,
                    checked=tuple(sorted(verdicts)), unhealthy=unhealthy,
                ),
                wait_s=self.settings.request_timeout_s,
            )  # fmt: skip

    async def _end_step(self, ended: asyncio.Future[int]) -> int:
        """SIGTERM the srun step, SIGKILL it after the grace (a dead node's task never ends)."""
        assert self._step is not None
        with contextlib.suppress(ProcessLookupError):
            self._step.terminate()
        try:
            return await asyncio.wait_for(asyncio.shield(ended), self.settings.kill_grace_s)
        except TimeoutError:
            with contextlib.suppress(ProcessLookupError):
                self._step.kill()
            return await ended

    async def _start(self, answer: DriverAnswer) -> int | None:
        """Start the step; its exit status when it ended at once, else None (running)."""
        self._attempt = answer.attempt
        nodes = answer.nodes or await current_nodes(self._environ)
        if answer.nodes is None and self.settings.world_nodes is not None:
            nodes = nodes[: self.settings.world_nodes]  # the rest are the job's spares
        master = await node_address(nodes[0], self._environ)
        port = await rendezvous_port(
            nodes[0], self._environ, self.settings.python,
            job_id=self.settings.job_id, attempt=answer.attempt,
        )  # fmt: skip
        self._rendezvous = (master, port)
        argv = agent_argv(
            self.settings, nodes, master, answer.attempt, answer.resume_from, port,
            answer.skip_samples,
        )  # fmt: skip
        log.info(
            "attempt %d: %d node(s) %s, resume from %s, skipping samples %s",
            answer.attempt, len(nodes), ",".join(nodes), answer.resume_from or "(newest valid)",
            format_skip_samples(answer.skip_samples) or "(none)",
        )  # fmt: skip
        if answer.quarantine or answer.aside_after_step is not None:
            await asyncio.to_thread(self._quarantine, answer)
        env = {**self._environ, "RESURGO_CKPT_ROOT": self.settings.ckpt_root}
        # Only the answer says what to resume from and skip: never an earlier launch's.
        env.pop("RESURGO_RESUME_FROM", None)
        env.pop(ENV_SKIP_SAMPLES, None)
        try:
            self._step = await asyncio.create_subprocess_exec(*argv, env=env)
        except OSError as error:
            await self._confirm(answer, False, f"srun did not start: {error}")
            return 127
        if answer.action is DriverAction.RELAUNCH:
            try:
                returncode = await asyncio.wait_for(
                    asyncio.shield(self._step.wait()), self.settings.start_check_s
                )
            except TimeoutError:
                await self._confirm(answer, True, f"step running on {len(nodes)} node(s)")
            else:
                await self._confirm(
                    answer, returncode == 0, f"step ended with {returncode} at once"
                )
                return returncode
        return None

    def _quarantine(self, answer: DriverAnswer) -> None:
        """Move the checkpoints the supervisor rejected aside (after a rollback, also every
        one newer than the one it resumes from), so that the script's own "latest" logic
        finds the one it chose (:mod:`agent.checkpoint.quarantine`)."""
        root = self.settings.ckpt_root
        try:
            aside = dict(answer.quarantine)
            if answer.aside_after_step is not None:
                aside = newer_than(root, answer.aside_after_step) | aside
            moves, steered = quarantine(root, aside, answer.resume_from)
        except OSError as error:
            # The launch goes on: a script that loads the broken one fails again, and the
            # supervisor sees a crash loop rather than a job that never restarts.
            log.error("could not move rejected checkpoints into quarantine: %s", error)
            return
        for change in steered:
            log.info("checkpoint root: %s", change)
        self._quarantined += tuple((move.source, move.target) for move in moves)

    async def _confirm(self, answer: DriverAnswer, ok: bool, reason: str) -> None:
        if answer.action is not DriverAction.RELAUNCH:
            return
        await self._ask(DriverRequest(
            self.settings.job_id, DriverPhase.RELAUNCHED, attempt=answer.attempt,
            action_id=answer.action_id, ok=ok, reason=reason,
        ))  # fmt: skip

    async def _ask(
        self, request: DriverRequest, wait_s: float | None = None
    ) -> DriverAnswer | None:
        """Post ``request`` until answered or ``wait_s`` (default ``supervisor_wait_s``)
        passed (None then)."""
        reported = self._quarantined
        if reported and request.phase in (DriverPhase.RELAUNCHED, DriverPhase.RUNNING):
            request = dataclasses.replace(request, quarantined=reported)
        body = protocol.encode_driver_request(request)
        limit_s = self.settings.supervisor_wait_s if wait_s is None else wait_s
        started_s = time.monotonic()
        retrying = tenacity.AsyncRetrying(
            stop=tenacity.stop_after_delay(limit_s),
            wait=self._backoff,
            retry=tenacity.retry_if_exception_type(_NO_ANSWER),
            before_sleep=lambda state: log.warning(
                "supervisor: no answer for %.0f s (gives up after %.0f s): %s; retrying",
                state.seconds_since_start,
                limit_s,
                _why(state.outcome.exception() if state.outcome else None),
            ),
            reraise=True,
        )
        try:
            async for attempt in retrying:
                with attempt:
                    data = await signed_post(
                        self._session,
                        self.settings.supervisor_url + protocol.DRIVER_PATH,
                        self.settings.job_id,
                        self._secret,
                        body,
                        timeout_s=self.settings.request_timeout_s,
                        clock=self._clock,
                    )
                    answer = protocol.decode_driver_answer(data)
                    if request.quarantined:
                        self._quarantined = self._quarantined[len(request.quarantined) :]
                    return answer
        except _NO_ANSWER as error:
            log.log(
                logging.ERROR if limit_s > 0 else logging.WARNING,
                "supervisor unreachable: no answer for %.0f s (gave up after %.0f s): %s",
                time.monotonic() - started_s, limit_s, _why(error),
            )  # fmt: skip
        return None

    # -- the time limit: a planned stop (agent.timelimit) -------------------------

    def _spawn(self, coroutine: Any) -> None:
        task: asyncio.Task[None] = asyncio.ensure_future(coroutine)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _time_left(self) -> tuple[float | None, float | None]:
        """(seconds left, the time limit) of this job as Slurm has them now; None unknown."""
        argv = ["squeue", "-h", "-j", self.settings.job_id, "-o", "%L %l"]
        try:
            words = (await _capture(argv, self._environ)).split()
        except (ResurgoError, OSError, TimeoutError) as error:
            log.warning("could not read the job's time left: %s", error)
            return None, None
        if len(words) != 2:
            return None, None
        return parse_slurm_duration(words[0]), parse_slurm_duration(words[1])

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

    async def _time_limit_timer(self) -> None:
        """Start the planned stop when the time left reaches the lead: Slurm's USR1 was
        set at submit from the limit alone; this one also knows the measured save time
        (and a limit an operator changed since)."""
        while not self._time_limit and not self._stopping:
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
                self._begin_stop()
                return
            await asyncio.sleep(min(60.0, max(1.0, left_s - lead_s)))

    def _on_slurm_warning(self) -> None:
        """Slurm's USR1 (``--signal=B:USR1@LEAD``): the end is near, or not quite yet."""
        if not self._time_limit:
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
        self._begin_stop()

    def _begin_stop(self) -> None:
        """The time limit is near: begin the planned stop, once."""
        if self._time_limit:
            return
        log.warning("time limit near: final checkpoint, graceful stop, requeue")
        self._time_limit = True
        self._spawn(self._announce_time_limit())

    async def _announce_time_limit(self) -> None:
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
        notice = Notice(self._attempt, now, save_by, self._end_unix_s)
        self._spawn(self._requeue_at_deadline(self._end_unix_s))
        try:
            write_notice(self.settings.job_dir, notice)
        except OSError as error:
            log.error("could not write the time-limit notice (%s): stopping the ranks now", error)
            if self._step is not None and self._step.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    self._step.send_signal(signal.SIGTERM)
        await self._ask(
            DriverRequest(
                self.settings.job_id, DriverPhase.TIME_LIMIT, attempt=self._attempt,
                time_left_s=left_s, reason="time limit near",
            ),
            wait_s=min(10.0, left_s / 4),
        )  # fmt: skip

    async def _await_requeue(self, returncode: int | None) -> int:
        """The ranks stopped for the time limit: the supervisor requeues the job, which
        ends this script (the deadline task requeues it here if the supervisor does not)."""
        if returncode is not None:
            log.info("ranks stopped for the time limit (step exit %d); the supervisor "
                     "requeues the job", returncode)  # fmt: skip
            end_unix_s = self._end_unix_s or self._clock()
            await self._ask(
                DriverRequest(
                    self.settings.job_id, DriverPhase.TIME_LIMIT, attempt=self._attempt,
                    exit_code=returncode, time_left_s=max(0.0, end_unix_s - self._clock()),
                    reason="stopped for the time limit",
                ),
                wait_s=max(0.0, end_unix_s - self._clock() - SELF_REQUEUE_BEFORE_END_S) / 2,
            )  # fmt: skip
        while not self._stopping and self._requeue_failed is None:
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
        while not self._stopping and self._clock() < deadline:
            await asyncio.sleep(min(1.0, max(0.0, deadline - self._clock())))
        if self._stopping:
            return
        log.warning("not requeued by the supervisor with %.0f s left: requeueing the job",
                    end_unix_s - self._clock())  # fmt: skip
        try:
            await _capture(["scontrol", "requeue", self.settings.job_id], self._environ)
        except (ResurgoError, OSError, TimeoutError) as error:
            self._requeue_failed = str(error)

    def _on_signal(self, signum: int) -> None:
        self._stopping = True
        if self._step is not None and self._step.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                self._step.send_signal(signum)


def _why(error: BaseException | None) -> str:
    """Why the supervisor did not answer, in words: its refusal of a job it has not
    registered yet (a job it registers from its directory within a poll) is no fault."""
    if isinstance(error, Rejected) and error.status == 401 and "unknown_job" in error.reason:
        return "the supervisor has not registered this job yet (it does within a poll)"
    if isinstance(error, protocol.ProtocolError):
        return f"its answer was not understood ({error})"
    return str(error)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``python -m agent.driver``."""
    logging.basicConfig(
        level=logging.INFO, format="resurgo-driver %(asctime)s %(levelname)s %(message)s"
    )
    try:
        settings = settings_from(sys.argv[1:] if argv is None else argv, os.environ)
        driver = Driver(settings, dict(os.environ))
        return asyncio.run(driver.run())
    except ResurgoError as error:
        print(f"resurgo-driver: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
