"""``resurgo-agent``: the per-node agent, started by the job's batch script through srun.

One asyncio loop per node. It

1. runs the health gate (built-in checks of the checkpoint root, the rendezvous
   address and the GPUs, plus the operator's command when configured) and
   refuses to launch on an unhealthy node;
2. launches the node's share of the job (:mod:`agent.node.launch`) and finds every
   rank process (:mod:`agent.node.procs`);
3. receives the ranks' heartbeats on a Unix datagram socket
   (:mod:`agent.wire.datagram`) and samples the stacks of ranks that send
   none (:mod:`agent.node.stacks`);
4. decides hangs and stragglers with the pure functions of :mod:`agent.node.hang`,
   collecting every local rank's stack before reporting a hang;
5. reports events at once and heartbeat summaries periodically, through the
   spooling :class:`agent.node.client.Reporter` (or only to the local events log
   when no supervisor is configured), and obeys the commands that come back;
6. on SIGTERM or a stop command, SIGTERMs the ranks, waits the grace period,
   SIGKILLs what remains, and says what happened.

Signal handlers only enqueue; every decision is made in the loop. A failing
tick is logged with its traceback and the loop goes on. The steps a command,
a stop or the time limit take are in :mod:`agent.node.commands`; the ranks' save
notes in :mod:`agent.node.savenotes`; the run directory in :mod:`agent.node.rundir`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shutil
import signal
import socket
import sys
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from agent import __version__
from agent.checkpoint.catalog import newest_committed_step
from agent.node.ckptscan import SCAN_S, CheckpointScan
from agent.node.commands import (
    await_final_checkpoint,
    await_save_settled,
    notice_is_ours,
    queued,
    ranks_stopped,
    terminate,
    write_interval,
)
from agent.node.config import AgentConfig, build_parser, load_config
from agent.node.events import EventOut
from agent.node.evidence import KernelLog, kernel_evidence
from agent.node.health import GateReport, command_report, run_gate
from agent.node.healthchecks import GateInputs, gpus_needed
from agent.node.launch import (
    ENV_WARM_SOCKET,
    Allocation,
    LaunchPlan,
    LaunchSettings,
    Shape,
    launch_shape,
    plan_launch,
    torchrun_shim,
)
from agent.node.procs import RankExit, RankProcess, RankWatcher
from agent.node.rundir import default_run_dir, private_dir
from agent.node.savenotes import SaveNotes
from agent.node.steps import StepBuffer
from agent.node.torchrun_options import description_path, torchrun_parser
from agent.node.warmpool import ANSWER_S, Forked, WarmProcess, fork_from_pool, socket_path
from agent.node.watch import RankMonitor
from agent.stopfiles import clear_save_request, read_notice, write_save_request
from agent.timelimit import Notice, stop_grace_s
from agent.wire import protocol
from agent.wire.datagram import CheckpointNote, RankBeat, StepReport, parse_datagram
from agent.wire.errors import ResurgoError
from agent.wire.periodic import every

log = logging.getLogger(__name__)

# Socket receive buffer: heartbeats from every local rank must never be
# dropped for want of space while the loop is busy for a moment.
RCVBUF_BYTES = 4 << 20
STACK_SAMPLES_KEPT = 32
EXIT_STATUS_UNHEALTHY = 3
# After a clean end, how long unsent reports are still tried before the agent exits.
CLEAN_DRAIN_S = 10.0
# The module a fitted torchrun command runs (agent.node.launch.fit_torchrun).
TORCHRUN = "torch.distributed.run"
# How long the node's warm pool, started by the driver beside this agent's step, may take
# to listen (it listens before it imports).
POOL_APPEARS_S = 10.0


@dataclass(frozen=True)
class Clocks:
    """Monotonic time for timeouts, wall time for events; injectable for tests."""

    monotonic: Callable[[], float] = time.monotonic
    wall: Callable[[], float] = time.time


class NodeAgent:
    """Launches and watches this node's ranks; see the module docstring."""

    def __init__(
        self,
        config: AgentConfig,
        command: Sequence[str],
        *,
        environ: dict[str, str] | None = None,
        clocks: Clocks | None = None,
    ) -> None:
        self.config = config
        self.command = list(command)
        self._environ = dict(os.environ if environ is None else environ)
        self._clocks = clocks or Clocks()
        self.run_dir = private_dir(Path(config.run_dir or default_run_dir(config)))
        self._queue: asyncio.Queue[tuple[str, dict[str, Any]]] = asyncio.Queue()
        self._process: asyncio.subprocess.Process | WarmProcess | None = None
        self._watcher: RankWatcher | None = None
        self._kernel_log = KernelLog()
        self._plan: LaunchPlan | None = None
        self._world_reported = False
        self._saves = SaveNotes(self._clocks.monotonic)
        self._scan: CheckpointScan | None = None
        # A rank beat through the in-rank library (not only the bootstrap's hooks).
        self._library_beats = False
        self._stopping = False
        self._stop_task: asyncio.Task[None] | None = None
        self._exits: dict[int, RankExit] = {}
        self._socket: socket.socket | None = None
        self._steps = StepBuffer()
        self._time_limit: asyncio.Task[None] | None = None
        self._started_unix_s = self._clocks.wall()
        self._health_lines: list[str] = []  # the launch's health gate, for agent_started
        self.events = EventOut(config, self.run_dir, self._on_command)
        self.monitor = RankMonitor(config.hang_config(), config.stack_sample_s, self.events.emit)

    # -- lifecycle -------------------------------------------------------------

    async def run(self) -> int:
        """Launch, watch until the launcher exits, report, clean up; return the exit status."""
        exits = self.run_dir / "exits"
        exits.mkdir(exist_ok=True)
        # Records left by an earlier life of this run directory (the same job id,
        # node and launch after a Slurm state reset, or an agent restarted) are
        # not this launch's ranks': read, they would date a death hours back and
        # win the root cause.
        for stale in exits.iterdir():
            with contextlib.suppress(OSError):
                stale.unlink()
        # A request left by an earlier launch would make the new ranks save at once.
        clear_save_request(self._save_request_path())
        loop = asyncio.get_running_loop()
        for signum in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(signum, self._queue.put_nowait, ("signal", {"signum": signum}))
        await self.events.start()
        clean = False
        try:
            await self._torchrun_described_by_pool()  # the gate plans the launch already
            if not await self._healthy_before_launch():
                await self.events.emit(
                    protocol.EventKind.AGENT_STOPPED, {"reason": "health check failed"}
                )
                return EXIT_STATUS_UNHEALTHY
            self._open_socket(loop)
            status = await self._launch_and_watch()
            clean = status == 0
            await self.events.emit(
                protocol.EventKind.AGENT_STOPPED, {"reason": f"launcher exited with {status}"}
            )
            return status
        finally:
            if self._socket is not None:
                loop.remove_reader(self._socket.fileno())
                self._socket.close()
            with contextlib.suppress(FileNotFoundError):
                (self.run_dir / "agent.sock").unlink()
            # A failed launch's reports decide the recovery (they name the culprit):
            # kept for as long as a supervisor restart may take. A clean end's are
            # not needed for that (Slurm reports the job's end): a short wait, not
            # an allocation held idle while the supervisor is away.
            drain_s = self.config.drain_timeout_s
            await self.events.close(min(drain_s, CLEAN_DRAIN_S) if clean else drain_s)
            self._remove_run_dir()

    def _remove_run_dir(self) -> None:
        """Remove the default run directory once every event is delivered: one is made
        per job, node and launch under the node's ``/tmp``, and a cluster's nodes would
        gather them by the thousand. Undelivered events keep it (an agent started again
        for this launch sends them); so does an explicit ``--run-dir`` (the operator's)."""
        if self.config.run_dir or self.events.undelivered:
            return
        shutil.rmtree(self.run_dir, ignore_errors=True)

    async def _launch_and_watch(self) -> int:
        self._plan = self._build_plan()
        if self._plan.shape is Shape.WRAPPER:
            self._write_torchrun_shim()
        self._process = await self._start_launcher(self._plan)
        self._watcher = RankWatcher(
            self._process.pid,
            shape=self._plan.shape,
            exit_dir=self.run_dir / "exits",
            node_rank=self.config.node_rank,
            expected=self._plan.local_ranks,
        )
        await self.events.emit(
            protocol.EventKind.AGENT_STARTED,
            {
                "agent_version": __version__,
                "pid": os.getpid(),
                "argv": [protocol.clip_text(arg, 4096) for arg in self._plan.argv][:1024],
                "nnodes": self.config.nnodes,
                "node_rank": self.config.node_rank,
                **({"attempt": self.config.attempt} if self.config.attempt > 0 else {}),
                **({"health_checks": self._health_lines} if self._health_lines else {}),
            },
        )
        ticks = [
            self._every(self.config.watch_interval_s, self._watch_tick),
            self._every(self.config.hang_check_s, self._hang_tick),
            self._every(self.config.heartbeat_report_s, self._report_tick),
        ]
        if self.config.health_check:
            ticks.append(self._every(self.config.health_check_interval_s, self._health_tick))
        if self.config.time_limit_file:
            ticks.append(self._every(self.config.time_limit_poll_s, self._time_limit_tick))
        if self.config.node_rank == 0 and self.config.ckpt_root:
            self._scan = CheckpointScan(self.config.ckpt_root)
            ticks.append(self._every(SCAN_S, self._scan_tick))
        tasks = [asyncio.create_task(tick) for tick in ticks]
        commands = asyncio.create_task(self._serve_queue())
        try:
            returncode = await self._process.wait()
        finally:
            commands.cancel()
            for task in tasks:
                task.cancel()
            if self._time_limit is not None:
                self._time_limit.cancel()
            await asyncio.gather(commands, *tasks, return_exceptions=True)
        if self._stop_task is not None:
            await self._stop_task
        await self._final_exits(returncode)
        if self._scan is not None:
            await self._scan_tick()  # the save at the end, written after the last look
        if self._socket is not None:
            self._drain_socket()  # the ranks' last reports may still wait in the socket
        await self._emit_steps()
        await self.events.emit(
            protocol.EventKind.LAUNCHER_EXITED,
            {
                "exit_code": returncode if returncode >= 0 else None,
                "signal": -returncode if returncode < 0 else None,
                "signal_name": _signal_name(-returncode) if returncode < 0 else None,
                "pid": self._process.pid,
            },
        )
        return returncode if returncode >= 0 else 128 - returncode

    async def _start_launcher(self, plan: LaunchPlan) -> asyncio.subprocess.Process | WarmProcess:
        """torchrun forked by the node's warm pool when one serves it (no import of torch
        to wait for: :mod:`agent.node.warmpool`), else started as a fresh process."""
        path = plan.env.get(ENV_WARM_SOCKET)
        torchrun = plan.shape is not Shape.WRAPPER and plan.argv[1:3] == ("-m", TORCHRUN)
        if path and torchrun:
            if await _appears(path, POOL_APPEARS_S):
                # The pool refuses another interpreter than its own.
                forked = await asyncio.to_thread(
                    fork_from_pool, path, plan.argv[1:], plan.env, (0, 1, 2)
                )
                if isinstance(forked, Forked):
                    return WarmProcess(forked)
                if forked:
                    log.info("torchrun started as a fresh process: %s", forked)
            else:
                log.info(
                    "no warm pool at %s after %.0f s: torchrun starts fresh", path, POOL_APPEARS_S
                )
        return await asyncio.create_subprocess_exec(
            *plan.argv,
            env=plan.env,
            # Its own process group, so a stop reaches torchrun and not the agent.
            start_new_session=True,
        )

    def _build_plan(self) -> LaunchPlan:
        config = self.config
        allocation = Allocation(
            job_id=config.job_id,
            node=config.node,
            nnodes=config.nnodes,
            node_rank=config.node_rank,
            master_addr=config.master_addr,
            master_port=config.master_port,
            restart_count=config.restart_count,
            launch_nonce=config.launch_nonce,
            rdzv_host=(config.node == config.master_node) if config.master_node else None,
            static=bool(config.node_order),
        )
        options_dir = self._torchrun_options_dir()
        settings = LaunchSettings(
            agent_socket=str(self.run_dir / "agent.sock"),
            exit_dir=str(self.run_dir / "exits"),
            resume_from=config.resume_from or None,
            skip_samples=config.skip_ranges(),
            ckpt_root=config.ckpt_root or None,
            ckpt_interval_s=config.ckpt_interval_s or None,
            ckpt_interval_file=str(self.run_dir / "checkpoint-interval.json"),
            save_request_file=str(self._save_request_path()),
            procs_per_node=config.procs_per_node,
            shim_dir=str(self._shim_dir()),
            torchrun_options_dir=None if options_dir is None else str(options_dir),
            torchrun_log_dir=str(self.run_dir / "torchrun"),
            warm_pool=self._pool_socket() if config.warm_pool else None,
        )
        parser = torchrun_parser(options_dir)
        return plan_launch(
            self.command, allocation, settings, self._environ, sys.executable, parser
        )

    async def _torchrun_described_by_pool(self) -> None:
        """On a job's first launch, wait for the node's warm pool to describe torchrun's
        parser (it does once it imported torch) instead of importing torch for it: two
        seconds of CPU on every node, and no wait, since the launch's torchrun is the
        pool's to start once it is warm anyway. Bounded as a request to the pool is; the
        agent then describes it itself."""
        options_dir = self._torchrun_options_dir()
        described = None if options_dir is None else description_path(options_dir)
        if not self.config.warm_pool or described is None or described.exists():
            return
        if launch_shape(self.command) is Shape.WRAPPER:
            return  # its plan takes no parser
        if not await _appears(self._pool_socket(), POOL_APPEARS_S):
            return
        if not await _appears(str(described), ANSWER_S):
            log.info("the warm pool described no torchrun options: the agent imports torch")

    def _pool_socket(self) -> str:
        """Where this node's warm pool for the job listens."""
        return socket_path(self.config.job_id, self.config.node, self.config.secret_file or None)

    def _torchrun_options_dir(self) -> Path | None:
        """Beside the job's secret (shared by every node): torchrun's parser described once
        serves every later launch of the job (agent.node.torchrun_options)."""
        if not self.config.secret_file:
            return None
        return Path(self.config.secret_file).parent

    def _save_request_path(self) -> Path:
        return self.run_dir / "save-request.json"

    def _shim_dir(self) -> Path:
        return self.run_dir / "bin"

    def _write_torchrun_shim(self) -> None:
        """Resurgo's ``torchrun`` for the wrapper's PATH (:mod:`agent.node.torchrunshim`)."""
        self._shim_dir().mkdir(mode=0o700, exist_ok=True)
        shim = self._shim_dir() / "torchrun"
        shim.write_text(torchrun_shim(sys.executable))
        shim.chmod(0o700)

    async def _every(self, period_s: float, tick: Callable[[], Awaitable[None]]) -> None:
        await every(period_s, tick, log, "agent")

    async def _serve_queue(self) -> None:
        while True:
            what, args = await self._queue.get()
            try:
                if what == "signal":
                    self._start_stop(f"agent received {_signal_name(args['signum'])}", None)
                elif what == "stop":
                    self._start_stop(args["reason"], args["command_id"], args["grace_s"])
                elif what == "interval":
                    write_interval(self.run_dir / "checkpoint-interval.json", args)
            except Exception:
                log.exception("handling %s failed", what)

    def _start_stop(
        self, reason: str, command_id: str | None, grace_s: float | None = None
    ) -> None:
        """Run :meth:`stop` as its own task: the launcher's exit must not cut it short."""
        if self._stop_task is None:
            self._stop_task = asyncio.create_task(self.stop(reason, command_id, grace_s))

    def _on_command(self, command: protocol.Command) -> None:
        """Reporter callback: commands are only queued here, acted on in the loop."""
        item = queued(command)
        if item is not None:
            self._queue.put_nowait(item)

    # -- health ----------------------------------------------------------------

    async def _healthy_before_launch(self) -> bool:
        """The health gate (:func:`agent.node.health.run_gate`): the built-in checks always,
        the operator's command when set; every check's line is logged, and travels in
        ``agent_started`` or, on failure, ``health_check_failed``."""
        report = await run_gate(
            self._gate_inputs(), self.config.health_check, self.config.health_check_timeout_s
        )
        self._health_lines = report.lines()
        for result in report.results:
            (log.info if result.ok else log.warning)("health gate: %s", result.line())
        if not report.healthy:
            await self._report_unhealthy(report)
        return report.healthy

    def _gate_inputs(self) -> GateInputs:
        config = self.config
        return GateInputs(
            ckpt_root=config.ckpt_root,
            min_free_gb=config.health_min_free_gb,
            master_addr=config.master_addr,
            master_port=config.master_port,
            gpus_needed=gpus_needed(self._environ, self._local_ranks()),
            timeout_s=config.health_builtin_timeout_s,
            path=self._environ.get("PATH"),
        )

    def _local_ranks(self) -> int | None:
        """The ranks this launch will run here; None when unknown: a wrapper's, or a command
        the launch itself will refuse, with its own message."""
        try:
            return self._build_plan().local_ranks
        except ResurgoError:
            return None

    async def _health_tick(self) -> None:
        report = await command_report(self.config.health_check, self.config.health_check_timeout_s)
        if not report.healthy:
            await self._report_unhealthy(report)

    async def _report_unhealthy(self, report: GateReport) -> None:
        await self.events.emit(protocol.EventKind.HEALTH_CHECK_FAILED, report.failure_payload())

    # -- heartbeats ------------------------------------------------------------

    def _open_socket(self, loop: asyncio.AbstractEventLoop) -> None:
        path = self.run_dir / "agent.sock"
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, RCVBUF_BYTES)
        sock.bind(str(path))
        sock.setblocking(False)
        self._socket = sock
        loop.add_reader(sock.fileno(), self._drain_socket)

    def _drain_socket(self) -> None:
        assert self._socket is not None
        while True:
            try:
                data = self._socket.recv(8192)
            except (BlockingIOError, InterruptedError):
                return
            except OSError as error:
                log.warning("heartbeat socket: %s", error)
                return
            message = parse_datagram(data)
            if isinstance(message, RankBeat | StepReport) and self._watcher is not None:
                adopted = self._watcher.adopt(message.rank, message.local_rank, message.pid)
                if adopted is not None:
                    self._check_world([adopted])
            if isinstance(message, RankBeat):
                self._library_beats |= not message.automatic
                self._saves.on_beat(message)
                self.monitor.on_beat(message, self._clocks.monotonic())
            elif isinstance(message, StepReport):
                self._library_beats |= not message.automatic
                # A finished step is progress too: the report doubles as a beat. The
                # bootstrap may send a step's loss a step late (read off a GPU without a
                # sync): that one only carries the loss.
                if not message.automatic or not self.monitor.is_behind(message):
                    self.monitor.on_beat(message.as_beat(), self._clocks.monotonic())
                self._steps.add(message)
            elif isinstance(message, CheckpointNote):
                event = self._saves.event(message)
                if event is not None:
                    asyncio.get_running_loop().create_task(self.events.emit(*event))

    async def _scan_tick(self) -> None:
        """Report the checkpoints a framework wrote itself since the last look."""
        assert self._scan is not None
        for found in await asyncio.to_thread(self._scan.new, frozenset(self._saves.written)):
            await self.events.emit(
                protocol.EventKind.CHECKPOINT_WRITTEN,
                {"step": found.step, "path": found.path, "global_rank": 0,
                 "total_bytes": found.total_bytes},
            )  # fmt: skip

    # -- rank exits ------------------------------------------------------------

    async def _watch_tick(self) -> None:
        assert self._watcher is not None
        self._check_world(self._watcher.discover())
        await self._emit_exits(self._watcher.poll_exits(self._clocks.wall()))

    def _check_world(self, ranks: Sequence[RankProcess]) -> None:
        """Report, once, a rank whose world is not the job's: ``nnodes`` nodes of
        ``LOCAL_WORLD_SIZE`` ranks (a torchrun told ``--standalone`` or its own
        ``--nnodes`` in a wrapper, each node training a world of its own)."""
        for rank in ranks:
            if self._world_reported or rank.world_size is None or not rank.local_world_size:
                continue
            expected = self.config.nnodes * rank.local_world_size
            if rank.world_size == expected:
                continue
            self._world_reported = True
            log.error(
                "rank %d reports a world of %d, the job's is %d (%d nodes x %d)",
                rank.global_rank, rank.world_size, expected, self.config.nnodes,
                rank.local_world_size,
            )  # fmt: skip
            asyncio.get_running_loop().create_task(
                self.events.emit(
                    protocol.EventKind.WORLD_MISMATCH,
                    {
                        "global_rank": rank.global_rank,
                        "pid": rank.pid,
                        "world_size": rank.world_size,
                        "local_world_size": rank.local_world_size,
                        "nnodes": self.config.nnodes,
                    },
                )
            )

    async def _final_exits(self, returncode: int) -> None:
        """After the launcher ended: every rank's exit, reported once, before the launcher's."""
        assert self._watcher is not None
        now = self._clocks.wall()
        await self._emit_exits(self._watcher.launcher_exit(returncode, now))
        deadline = self._clocks.monotonic() + 2.0
        while self._watcher.live_ranks and self._clocks.monotonic() < deadline:
            await self._emit_exits(self._watcher.poll_exits(self._clocks.wall()))
            await asyncio.sleep(0.1)

    async def _emit_exits(self, exits: Sequence[RankExit]) -> None:
        """Report exits found together, each with the node's ranks left after it (the
        watcher counts them all as exited already)."""
        assert self._watcher is not None
        left = self._watcher.ranks_left()
        for index, rank_exit in enumerate(exits):
            after = None if left is None else left + len(exits) - 1 - index
            await self._emit_exit(rank_exit, after)

    async def _emit_exit(self, rank_exit: RankExit, ranks_left: int | None = None) -> None:
        # What the rank sent before it died may still wait in the socket: read it
        # first, or its last step depends on which the loop happened to take
        # first, and the same crash reads as two (a crash loop seen one attempt late).
        if self._socket is not None:
            self._drain_socket()
        progress = self.monitor.forget(rank_exit.rank.global_rank)
        await self.events.emit(
            protocol.EventKind.RANK_EXITED,
            {
                "global_rank": rank_exit.rank.global_rank,
                "local_rank": rank_exit.rank.local_rank,
                "pid": rank_exit.rank.pid,
                "exit_code": rank_exit.exit_code,
                "signal": rank_exit.signal,
                "signal_name": rank_exit.signal_name,
                "last_step": None if progress is None else progress.step,
                "phase": None if progress is None else progress.phase.value,
                "exit_time_unix_s": rank_exit.time_unix_s,
                **_raised_fields(rank_exit),
                **({"script_ended": True} if rank_exit.script_ended else {}),
                **({"warm": True} if rank_exit.warm else {}),
                **({"ranks_left": ranks_left} if ranks_left is not None else {}),
                **({"stderr_tail": rank_exit.stderr_tail} if rank_exit.stderr_tail else {}),
                **(await kernel_evidence(rank_exit, self._kernel_log)),
            },
        )
        self._exits[rank_exit.rank.global_rank] = rank_exit

    # -- the time limit --------------------------------------------------------

    async def _time_limit_tick(self) -> None:
        if self._time_limit is not None or self._stopping:
            return
        notice = read_notice(Path(self.config.time_limit_file))
        if notice is None or not notice_is_ours(notice, self.config.attempt, self._started_unix_s):
            return
        self._time_limit = asyncio.create_task(self._stop_for_time_limit(notice))

    async def _stop_for_time_limit(self, notice: Notice) -> None:
        """Final checkpoint, then a graceful stop (agent.timelimit): ask the ranks to save at
        their next step boundary, wait for a checkpoint newer than the notice (or the
        notice's ``save_by``), then stop them with the usual grace. Ranks that take no
        request are stopped once a save they have under way has ended."""
        await self._watch_tick()  # the exits of ranks that just ended, first
        assert self._watcher is not None
        finished = bool(self._exits) and not self._watcher.live_ranks
        root = self.config.ckpt_root
        before = newest_committed_step(root) if root else None
        # Only ranks of the in-rank library can take a save request: a script seen through
        # the bootstrap alone (its optimizer steps) saves when it saves, and waiting for its
        # next save would eat the time a short limit leaves. A save it has under way is
        # let end first: cut short, a first checkpoint leaves nothing to resume from.
        asked = bool(root) and self._library_beats and not finished
        if asked:
            write_save_request(self._save_request_path(), int(notice.warned_unix_s * 1000))
        await self.events.emit(
            protocol.EventKind.TIME_LIMIT_NEAR,
            {
                "end_unix_s": notice.end_unix_s,
                "save_by_unix_s": notice.save_by_unix_s,
                "attempt": notice.attempt,
                "final_checkpoint_requested": asked,
            },
        )
        if finished:
            # The ranks finished (or died) before the notice: a stop now would only
            # end the launcher while it winds down, and turn a finished run into
            # a stopped one.
            log.info("time limit near: the ranks have already exited; nothing to stop")
            return
        outcome = "the ranks do not use Resurgo's library, no save request reaches them"
        if root and not asked:
            settled = await await_save_settled(
                root, self._saves.saving, notice.save_by_unix_s, self._clocks.wall
            )
            outcome = f"{outcome}; {settled}" if settled else outcome
        if asked:
            assert root
            log.info("time limit near: final checkpoint requested (newest committed: %s)", before)
            watcher = self._watcher
            outcome = await await_final_checkpoint(
                root,
                before,
                notice.save_by_unix_s,
                lambda: {rank.global_rank for rank in watcher.live_ranks},
                self._save_request_path(),
                self._clocks.wall,
            )
        log.info("time limit near: %s; stopping the ranks", outcome)
        grace_s = stop_grace_s(notice, self._clocks.wall(), self.config.stop_grace_s)
        self._start_stop(f"time limit: {outcome}", None, grace_s)

    # -- hangs and stragglers --------------------------------------------------

    async def _hang_tick(self) -> None:
        if self._watcher is None or self._stopping:
            return
        live = {rank.global_rank: rank for rank in self._watcher.live_ranks}
        await self.monitor.check_hangs(live, self._clocks.monotonic())

    async def _report_tick(self) -> None:
        if self._watcher is None:
            return
        live = {rank.global_rank: rank for rank in self._watcher.live_ranks}
        await self.monitor.check_stragglers(live)
        wall = self._clocks.wall()
        report = protocol.HeartbeatReport(
            job_id=self.config.job_id,
            node=self.config.node,
            time_unix_s=wall,
            agent_incarnation=self.events.incarnation,
            ranks=self.monitor.rank_statuses(live, wall, self._clocks.monotonic()),
            attempt=self.config.attempt or None,
        )
        await self.events.heartbeat(report)
        await self._emit_steps()

    async def _emit_steps(self) -> None:
        """Send the buffered step reports: one step_losses event per rank (and chunk)."""
        payloads, dropped = self._steps.drain()
        if dropped:
            log.warning("dropped %d step report(s): too many arrived between two reports", dropped)
        for payload in payloads:
            await self.events.emit(protocol.EventKind.STEP_LOSSES, payload)

    # -- stopping --------------------------------------------------------------

    async def stop(self, reason: str, command_id: str | None, grace_s: float | None = None) -> None:
        """SIGTERM the ranks and the launcher, SIGKILL what is left after the grace period."""
        if self._stopping or self._process is None or self._watcher is None:
            return
        self._stopping = True
        grace = self.config.stop_grace_s if grace_s is None else grace_s
        self._watcher.discover()
        ranks = self._watcher.live_ranks
        log.info("stopping %d rank(s): %s (grace %.0f s)", len(ranks), reason, grace)
        killed = await terminate(ranks, self._process.pid, grace, self._clocks.monotonic)
        await self._emit_exits(self._watcher.poll_exits(self._clocks.wall()))
        await self.events.emit(
            protocol.EventKind.RANKS_STOPPED,
            ranks_stopped(reason, command_id, grace, ranks, killed, self._exits),
        )


def _raised_fields(rank_exit: RankExit) -> dict[str, object]:
    """The payload fields of the rank's uncaught exception (none when it raised none)."""
    note = rank_exit.raised
    if note is None:
        return {}
    fields: dict[str, object] = {"raised": note.type, "raised_time_unix_s": note.time_unix_s}
    if note.message:
        fields["raised_message"] = note.message
    if note.errno is not None:
        fields["errno"] = note.errno
    return fields


def _signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``resurgo-agent``."""
    arguments = list(sys.argv[1:] if argv is None else argv)
    if not arguments or arguments[0] in ("-h", "--help"):
        build_parser().print_help()
        return 0
    logging.basicConfig(
        level=logging.INFO, format="resurgo-agent %(asctime)s %(levelname)s %(message)s"
    )
    try:
        config, command = load_config(arguments, os.environ)
        agent = NodeAgent(config, command)
        return asyncio.run(agent.run())
    except ResurgoError as error:
        print(f"resurgo-agent: {error}", file=sys.stderr)
        return 2


async def _appears(path: str, within_s: float) -> bool:
    """Whether ``path`` exists, waiting up to ``within_s`` for it."""
    deadline = time.monotonic() + within_s
    while not os.path.exists(path):
        if time.monotonic() >= deadline:
            return False
        await asyncio.sleep(0.05)
    return True


if __name__ == "__main__":
    sys.exit(main())
