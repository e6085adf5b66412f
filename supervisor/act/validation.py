"""Checkpoint validation in a process of its own, with memory, CPU-time and wall-clock limits.

A checkpoint is the job owner's data, and validating it reads that data:
a DCP ``.metadata`` is a pickle that may expand to gigabytes on load, and a
load test runs torch's loaders over files the owner wrote. Done inside the
supervisor, one crafted checkpoint stalled ``/healthz`` for seconds and took
the daemon from 290 MiB to 4.6 GiB. :class:`ValidationProcess` keeps one
warm child (:mod:`supervisor.act.validation_child`: the validator and torch
imported once) and sends it one checkpoint at a time. The child caps its
own address space (``validation_memory_mib`` beyond its imports) and CPU
time (``validation_cpu_s`` per checkpoint); the supervisor kills it after
``validation_timeout_s`` of wall-clock time. A checkpoint that meets a limit,
or kills the child, is invalid with that reason, and the next validation
starts a fresh child. The supervisor's memory and event loop see none of it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import signal
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

log = logging.getLogger(__name__)

# The child's start imports torch: on a loaded head node that alone took 10 s.
START_TIMEOUT_S = 300.0
# One answer line: a verdict and a reason (the reasons are short; this bounds a bug).
MAX_ANSWER_BYTES = 1 << 20


# An idle supervisor stops its validation child after this long without a job.
IDLE_STOP_S = 300.0


@dataclass(frozen=True)
class Limits:
    """What one validation may take: memory beyond the imports, CPU time, wall clock."""

    memory_mib: int = 4096
    cpu_s: float = 600.0
    timeout_s: float = 900.0


class ValidationProcess:
    """One validation child, started on first use (or by :meth:`start`), one request at a time."""

    def __init__(self, limits: Limits, *, nice: int = 0) -> None:
        """``nice``: the child's niceness increment (a background validator's)."""
        self.limits = limits
        self._nice = nice
        self._child: asyncio.subprocess.Process | None = None
        self._lock = asyncio.Lock()
        self.started = 0  # children started so far (a killed one is replaced)

    @property
    def running(self) -> bool:
        """Whether a child is up (started and not ended)."""
        return self._child is not None and self._child.returncode is None

    async def start(self) -> None:
        """Start the child now and wait until it has imported the validator."""
        async with self._lock:
            await self._ready()

    async def validate(self, path: str, level: str) -> tuple[bool, str]:
        """``(valid, reason)`` of the checkpoint at ``path`` checked at ``level``."""
        async with self._lock:
            child = await self._ready()
            assert child.stdin is not None and child.stdout is not None
            request = json.dumps({"path": path, "level": level}) + "\n"
            began = time.monotonic()
            try:
                child.stdin.write(request.encode())
                await child.stdin.drain()
                line = await asyncio.wait_for(child.stdout.readline(), self.limits.timeout_s)
            except TimeoutError:
                await self._kill()
                return False, (
                    f"validating it took longer than {self.limits.timeout_s:g} s (the "
                    "supervisor's validation_timeout_s): stopped"
                )
            except (ConnectionError, ValueError):  # the child died, or sent an endless line
                line = b""
            except asyncio.CancelledError:
                # Stopped mid-read (its task cancelled): the child's answer would
                # be read as the next request's, so it goes.
                self._abandon()
                raise
            if not line:
                return False, await self._died(time.monotonic() - began)
            try:
                answer = json.loads(line)
                return bool(answer["valid"]), str(answer["reason"])
            except (ValueError, KeyError, TypeError):
                await self._kill()
                return False, f"the validation process answered {line[:200]!r}: not a verdict"

    async def aclose(self) -> None:
        """Stop the child (the supervisor is stopping)."""
        async with self._lock:
            await self._kill()

    async def _ready(self) -> asyncio.subprocess.Process:
        if self._child is not None and self._child.returncode is None:
            return self._child
        self._child = None
        child = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "supervisor.act.validation_child",
            str(self.limits.memory_mib), str(self.limits.cpu_s), str(os.getpid()), str(self._nice),
            stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
            limit=MAX_ANSWER_BYTES,
        )  # fmt: skip
        self.started += 1
        assert child.stdout is not None
        try:
            line = await asyncio.wait_for(child.stdout.readline(), START_TIMEOUT_S)
        except TimeoutError:
            line = b""
        if json.loads(line or b"null") != {"ready": True}:
            self._child = child
            await self._kill()
            raise RuntimeError(
                f"the checkpoint validation process did not start (it said {line[:200]!r}); "
                "its error is in the supervisor's log"
            )
        self._child = child
        log.info("checkpoint validation process %d ready", child.pid)
        return child

    async def _died(self, took_s: float) -> str:
        """Why the child ended mid-validation, in words; the next one starts afresh."""
        child = self._child
        self._child = None
        if child is None:
            return "the validation process is gone"
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(child.wait(), 10)
        code = child.returncode
        if code == -signal.SIGXCPU:
            return (
                f"validating it used more than {self.limits.cpu_s:g} s of CPU (the "
                "supervisor's validation_cpu_s): stopped"
            )
        if code is not None and code < 0:
            name = signal.Signals(-code).name
            return (
                f"the validation process was ended by {name} after {took_s:.1f} s while "
                f"reading it (limit: {self.limits.memory_mib} MiB of memory)"
            )
        return f"the validation process exited with {code} while reading it"

    def _abandon(self) -> None:
        """Kill the child without waiting for it (asyncio reaps it); the next one starts afresh."""
        child, self._child = self._child, None
        if child is not None and child.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                child.kill()

    async def _kill(self) -> None:
        child, self._child = self._child, None
        if child is None or child.returncode is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            child.kill()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(child.wait(), 10)


class Process(Protocol):
    """What :class:`WarmWhileNeeded` needs of a :class:`ValidationProcess`."""

    @property
    def running(self) -> bool: ...

    async def start(self) -> None: ...

    async def aclose(self) -> None: ...


class WarmWhileNeeded:
    """The validation child kept warm while the supervisor follows a job, stopped after
    :data:`IDLE_STOP_S` without one.

    The child's import of torch is most of an idle supervisor's memory (about
    250 of 310 MiB) and, started at the first validation instead, seconds
    between a fault and the relaunch (10 s on a loaded head node). So it starts
    as soon as there is a job to recover and goes when there has been none for
    a while; a validation asked for meanwhile starts it as before. With
    ``start_early`` off (the ``validation_keep_warm`` setting) the first
    validation starts it, and it goes as before.
    """

    def __init__(
        self, process: Process, *, also_stop: Sequence[Process] = (), start_early: bool = True,
        idle_stop_s: float = IDLE_STOP_S, clock: Callable[[], float] = time.monotonic,
    ) -> None:  # fmt: skip
        """``also_stop``: processes started on demand (the background validator), stopped
        with ``process``; ``start_early``: start ``process`` for a job before its first
        validation."""
        self._process = process
        self._also_stop = tuple(also_stop)
        self._start_early = start_early
        self._idle_stop_s = idle_stop_s
        self._clock = clock
        self._no_job_since: float | None = None

    async def check(self, jobs: int) -> None:
        """Start or stop the child for ``jobs`` unfinished jobs followed now."""
        if jobs:
            self._no_job_since = None
            if self._start_early and not self._process.running:
                started = self._clock()
                try:
                    await self._process.start()
                except Exception:
                    log.exception("starting the checkpoint validation process failed; the "
                                  "next check or the first validation starts it again")  # fmt: skip
                    return
                log.info("checkpoint validation ready for %d job(s) (started in %.1f s)",
                         jobs, self._clock() - started)  # fmt: skip
            return
        now = self._clock()
        if self._no_job_since is None:
            self._no_job_since = now
        elif now - self._no_job_since >= self._idle_stop_s:
            running = [p for p in (self._process, *self._also_stop) if p.running]
            if not running:
                return
            for process in running:
                await process.aclose()
            log.info(
                "checkpoint validation process stopped: no job for %.0f s", now - self._no_job_since
            )
