"""The driver's loop: :class:`Driver` asks the supervisor how to launch, runs one node
agent per node in an ``srun`` step, watches the step and relaunches where told
(the whole story: :mod:`agent.driver`); :func:`main` is ``python -m agent.driver``."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import signal
import socket
import sys
import time
from collections.abc import Callable, Mapping, Sequence

import aiohttp
import tenacity

from agent.checkpoint.quarantine import newer_than, quarantine
from agent.driver.aggregator import Aggregator
from agent.driver.argv import agent_argv
from agent.driver.plannedstop import PlannedStop
from agent.driver.settings import DriverSettings, settings_from
from agent.driver.slurm import current_nodes, node_address
from agent.driver.sparechecks import SpareChecks
from agent.driver.warm import WarmPools
from agent.ports import rendezvous_port
from agent.skips import ENV_SKIP_SAMPLES, format_skip_samples
from agent.stopfiles import clear_notice
from agent.wire import protocol
from agent.wire.auth import Rejected, load_secret, signed_post
from agent.wire.errors import ResurgoError
from agent.wire.protocol import DriverAction, DriverAnswer, DriverPhase, DriverRequest

log = logging.getLogger("resurgo.driver")

# The batch script's exit code when the supervisor ended the job for good: the
# convention of torch elastic's launchers for "do not restart" (docs/operations.md).
DO_NOT_REQUEUE_EXIT = 93
# What counts as no answer, asked again: the supervisor down or refusing, and an
# answer cut off or garbled on the way (a supervisor killed while replying).
_NO_ANSWER = (aiohttp.ClientError, TimeoutError, Rejected, protocol.ProtocolError)


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
        self._stopping = False
        self._spares = SpareChecks(settings, environ, self._ask)
        self._planned = PlannedStop(
            settings, environ, clock=clock, ask=self._ask,
            stopping=lambda: self._stopping, stop_step=self._terminate_step,
        )  # fmt: skip
        # Checkpoints moved into quarantine for the last launch, not yet reported.
        self._quarantined: tuple[tuple[str, str], ...] = ()
        self._aggregator: Aggregator | None = None
        self._warm = WarmPools(settings, environ)

    async def run(self) -> int:
        """Launch, watch, relaunch as told; see the module docstring."""
        loop = asyncio.get_running_loop()
        for signum in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(signum, self._on_signal, signum)
        loop.add_signal_handler(signal.SIGUSR1, self._planned.on_slurm_warning)
        # A notice from an earlier run of this job (requeued) is not this run's.
        clear_notice(self.settings.job_dir)
        async with aiohttp.ClientSession() as session:
            self._session = session
            if self.settings.aggregate:
                self._aggregator = await self._start_aggregator(session)
            try:
                return await self._drive()
            finally:
                await self._warm.close()
                if self._aggregator is not None:
                    await self._aggregator.close()

    async def _start_aggregator(self, session: aiohttp.ClientSession) -> Aggregator | None:
        """The job's heartbeat aggregator on this host (None: it could not start, and
        the agents report straight to the supervisor)."""
        here = self._environ.get("SLURMD_NODENAME")
        try:
            host = await node_address(here, self._environ) if here else socket.gethostname()
            nodes = await current_nodes(self._environ)
            aggregator = Aggregator(
                self.settings.job_id, self._secret, self.settings.supervisor_url, nodes,
                clock=self._clock,
            )  # fmt: skip
            url = await aggregator.start(session, host)
        except (OSError, ResurgoError) as error:
            log.warning(
                "the heartbeat aggregator did not start (%s): the agents report straight "
                "to the supervisor",
                error,
            )
            return None
        log.info("heartbeat aggregator for %d node(s) at %s", len(nodes), url)
        return aggregator

    async def _drive(self) -> int:
        """Ask, launch, watch and relaunch until the job ends; its exit status."""
        self._planned.start_timer()
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
            if answer.action is DriverAction.WAIT and self._planned.begun:
                return await self._planned.await_requeue(None)
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
            if self._planned.begun:
                return await self._planned.await_requeue(returncode)
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
                    assert self._rendezvous is not None
                    self._spares.start(told.check_spares, answer.attempt, self._rendezvous)
        finally:
            await self._spares.stop()

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
        self._planned.attempt = answer.attempt
        nodes = answer.nodes or await current_nodes(self._environ)
        if answer.nodes is None and self.settings.world_nodes is not None:
            nodes = nodes[: self.settings.world_nodes]  # the rest are the job's spares
        master = await node_address(nodes[0], self._environ)
        port = await rendezvous_port(
            nodes[0], self._environ, self.settings.python,
            job_id=self.settings.job_id, attempt=answer.attempt,
        )  # fmt: skip
        self._rendezvous = (master, port)
        await self._warm.ensure()  # before the agents, which fork torchrun from the pools
        argv = agent_argv(
            self.settings, nodes, master, answer.attempt, answer.resume_from, port,
            answer.skip_samples, self._aggregator.url if self._aggregator is not None else "",
            self._warm.running,
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

    def _terminate_step(self) -> None:
        """SIGTERM the running step's srun (its agents stop their ranks)."""
        if self._step is not None and self._step.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                self._step.send_signal(signal.SIGTERM)

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
