"""The rendezvous port: asked of the OS on the master node, held until torchrun takes it.

A port derived from the job id (``29500 + id % 500 * 10 + attempt``) collides
for jobs 500 ids apart sharing a master node, and collides silently: torch's
c10d rendezvous backend, when it cannot bind the store's port, joins whatever
store already listens there as a client (``_create_tcp_store`` retries with
``is_server=False``), so the second job rendezvouses through the first one's
store and dies with it. Retrying on ``EADDRINUSE`` at launch is therefore no
remedy: torchrun never reports it. So the port is chosen before the launch:

- **On the master node** (``nodes[0]`` of the step, whose torchrun hosts the
  store): the driver probes in its own process when ``nodes[0]`` is the node
  it runs on (``SLURMD_NODENAME``; the batch host is kept first after a
  shrink, ``supervisor.core.recovery.relaunch``), else with a one-task
  ``srun --overlap`` step on that node running ``python -m agent.ports``.
  One design for both: the probe is the same function.
- **Asked of the OS** (bind to port 0 on every address), so a port in use by
  anything, on any address, is never chosen.
- **Held until torchrun binds it**: the probe connects to its own socket and
  closes the accepted end first, leaving the port in TIME_WAIT for 60 s. No
  other bind to port 0 on the node (another job's probe) is given it in that
  time, and a plain bind fails, while torch's TCPStore (libuv and legacy
  backends alike) sets ``SO_REUSEADDR`` and binds it at once (checked on
  torch 2.13). That closes the window between the probe and torchrun's bind
  that a probe-and-release would leave open.

If the probe fails (srun refused, no answer in time), the launch goes on with
the derived port and a warning: no worse than before, and the step's own
srun reports whatever stopped the probe.

``python -m agent.ports`` prints one reserved port.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import sys
from collections.abc import Mapping, Sequence

log = logging.getLogger("resurgo.ports")

DERIVED_PORT_BASE = 29500
PROBE_TIMEOUT_S = 30.0
PROBE_STEP_NAME = "resurgo-port-probe"


# -- pure ---------------------------------------------------------------------


def derived_port(job_id: str, attempt: int) -> int:
    """The fallback when no probe answered: a port per job id and attempt (collides for
    ids 500 apart)."""
    return DERIVED_PORT_BASE + (int(job_id) % 500) * 10 + attempt % 10


def probes_here(master_node: str, environ: Mapping[str, str]) -> bool:
    """True when the master node is the node this process runs on (Slurm's node name)."""
    return environ.get("SLURMD_NODENAME") == master_node


def probe_argv(master_node: str, python: str) -> list[str]:
    """``srun`` running the probe as one task on ``master_node``, beside any running step."""
    return [
        "srun", "--nodes=1", "--ntasks=1", "--overlap", f"--nodelist={master_node}",
        f"--job-name={PROBE_STEP_NAME}", "--quiet", python, "-m", "agent.ports",
    ]  # fmt: skip


def parse_probe_output(text: str) -> int | None:
    """The port the probe printed (its last line), or None when that is not a port."""
    lines = text.strip().splitlines()
    if not lines or not lines[-1].strip().isdecimal():
        return None
    port = int(lines[-1].strip())
    return port if 0 < port < 65536 else None


# -- the OS -------------------------------------------------------------------


def reserve_port() -> int:
    """A port free on every address of this host, left in TIME_WAIT (see the module doc)."""
    with contextlib.closing(socket.socket(socket.AF_INET, socket.SOCK_STREAM)) as server:
        server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        server.bind(("", 0))
        server.listen(1)
        port = int(server.getsockname()[1])
        with contextlib.closing(socket.create_connection(("127.0.0.1", port), timeout=5)):
            accepted, _ = server.accept()
            # The side that closes first holds TIME_WAIT: the accepted one, on `port`.
            accepted.close()
    return port


async def _probe_remote(master_node: str, python: str, environ: Mapping[str, str]) -> int | None:
    argv = probe_argv(master_node, python)
    try:
        process = await asyncio.create_subprocess_exec(
            *argv, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
            env=dict(environ),
        )  # fmt: skip
    except OSError as error:
        log.warning("port probe on %s did not start: %s", master_node, error)
        return None
    try:
        out, err = await asyncio.wait_for(process.communicate(), PROBE_TIMEOUT_S)
    except TimeoutError:
        with contextlib.suppress(ProcessLookupError):
            process.kill()
        await process.wait()
        log.warning("port probe on %s gave no answer in %.0f s", master_node, PROBE_TIMEOUT_S)
        return None
    port = parse_probe_output(out.decode(errors="replace"))
    if process.returncode != 0 or port is None:
        log.warning(
            "port probe on %s failed (exit %s): %s", master_node, process.returncode,
            err.decode(errors="replace").strip()[-500:] or out.decode(errors="replace")[-200:],
        )  # fmt: skip
        return None
    return port


async def rendezvous_port(
    master_node: str, environ: Mapping[str, str], python: str, *, job_id: str, attempt: int
) -> int:
    """The port torchrun's store will listen on at ``master_node`` for this launch."""
    port: int | None
    if probes_here(master_node, environ):
        try:
            port = reserve_port()
        except OSError as error:
            log.warning("port probe here failed: %s", error)
            port = None
    else:
        port = await _probe_remote(master_node, python, environ)
    if port is None:
        port = derived_port(job_id, attempt)
        log.warning("rendezvous on the derived port %d (no probe answered)", port)
    return port


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m agent.ports``: print one reserved port of this host."""
    del argv
    print(reserve_port(), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
