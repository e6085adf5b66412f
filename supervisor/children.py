"""Child processes of the supervisor, started without stopping its event loop.

:func:`subprocess_runner` starts a command with :class:`subprocess.Popen`,
which uses vfork (1-2 ms), not by the event loop: uvloop forks the whole
supervisor, a stop of 16-19 ms at 200 MB of memory. The start is never
cancelled half-way either: asyncio 3.11 cancelled while it connects a new
child's pipes closes them unconnected and then waits forever for the
child's exit, which left a supervisor that never finished stopping. Slurm
commands (:mod:`supervisor.slurm.client`) and manifest reads
(:mod:`supervisor.manifests`) run through it.
"""

from __future__ import annotations

import asyncio
import subprocess
from collections.abc import Mapping, Sequence
from typing import IO


async def subprocess_runner(
    argv: Sequence[str], timeout_s: float, env: Mapping[str, str] | None = None
) -> tuple[int, str, str]:
    """Run ``argv`` without a shell; kill it and raise TimeoutError past ``timeout_s``.

    Started by :class:`subprocess.Popen` (see the module docstring), twice
    every Slurm poll among others. The output is read by the event loop
    (a worker thread reading megabytes of ``sinfo`` would contend for the
    GIL with it); a worker thread only waits for the exit status.
    """
    process = subprocess.Popen(
        list(argv),
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=None if env is None else dict(env),
    )
    assert process.stdout is not None and process.stderr is not None
    try:
        async with asyncio.timeout(timeout_s):
            stdout, stderr = await asyncio.gather(_read(process.stdout), _read(process.stderr))
            code = await asyncio.to_thread(process.wait)
    except BaseException as error:
        process.kill()
        await asyncio.to_thread(process.wait)
        if isinstance(error, TimeoutError):
            raise TimeoutError(f"{argv[0]} did not finish in {timeout_s} s") from None
        raise
    return code, stdout.decode(errors="replace"), stderr.decode(errors="replace")


async def _read(pipe: IO[bytes]) -> bytes:
    """Everything ``pipe`` gives until its end, read by the event loop."""
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader(limit=1 << 20)
    transport, _ = await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), pipe)
    try:
        return await reader.read()
    finally:
        transport.close()
