"""The health gate's built-in checks: what every launch needs of a node, with no configuration.

A node that cannot write a checkpoint, cannot reach the rendezvous host or has a
failing GPU starts ranks that fail later, after the whole job has rendezvoused,
and the failure then looks like the job's. Checked before the launch, it names
the node and what to do about it (:func:`agent.node.health.run_gate`).

Every check is bounded in time and returns a :class:`CheckResult`; none raises.
Blocking calls (the file system, the resolver) run in daemon threads, and
subprocesses in sessions of their own killed as a group on timeout, so a hung
mount, resolver or GPU driver costs the timeout, never the agent.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import os
import shutil
import signal
import socket
import threading
import time
import uuid
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

from agent.node.kernlog import hardware_xids

CKPT_ROOT = "builtin:ckpt_root"
RDZV_ADDR = "builtin:rdzv_addr"
GPUS = "builtin:gpus"
# After SIGKILL, how long a process is waited for: one stuck in the kernel (a
# hung GPU driver) cannot die, and the gate must not wait with it.
REAP_S = 5.0
GB = 10**9
# One result's line, well under the protocol's limit for agent_started.health_checks.
LINE_CHARS = 500
GPU_QUERY = "index,pci.bus_id,retired_pages.pending,remapped_rows.failure"

# What to look at when a check gets no answer in time.
STUCK = {
    CKPT_ROOT: "the checkpoint file system does not answer (a hung NFS or Lustre mount?): "
    "check the mount on this node",
    RDZV_ADDR: "the resolver does not answer: check this node's /etc/resolv.conf and DNS",
    GPUS: "the GPU driver may be hung: drain the node and look at it (nvidia-smi -q, dmesg)",
}

T = TypeVar("T")


@dataclass(frozen=True)
class CheckResult:
    """One check's verdict; ``detail`` says what was found and, on failure, what to do."""

    name: str
    ok: bool
    detail: str
    seconds: float
    timed_out: bool = False

    def line(self) -> str:
        """``ok|FAIL name (0.12 s): detail`` on one line, clipped: for events and the log."""
        text = f"{'ok' if self.ok else 'FAIL'} {self.name} ({self.seconds:.2f} s): {self.detail}"
        text = " ".join(text.split())
        return text if len(text) <= LINE_CHARS else text[: LINE_CHARS - 3] + "..."


@dataclass(frozen=True)
class GateInputs:
    """What the built-in checks need to know of the launch.

    ``gpus_needed`` is how many GPUs ``nvidia-smi`` must list (None: unclear,
    see :func:`gpus_needed`); ``path`` is the ``PATH`` that ``nvidia-smi`` and
    ``dmesg`` are looked up in (None: the agent's own).
    """

    ckpt_root: str
    min_free_gb: float
    master_addr: str
    master_port: int
    gpus_needed: int | None
    timeout_s: float
    path: str | None = None


@dataclass(frozen=True)
class Completed:
    """A subprocess that ended in time: its exit status and its output (stderr merged)."""

    returncode: int
    output: str


async def run_builtin_checks(inputs: GateInputs) -> list[CheckResult]:
    """Every built-in check, concurrently: the gate takes as long as its slowest check."""
    timeout = inputs.timeout_s
    checks: dict[str, Awaitable[tuple[bool, str]]] = {
        CKPT_ROOT: check_ckpt_root(inputs.ckpt_root, inputs.min_free_gb, timeout),
        RDZV_ADDR: check_rdzv_addr(inputs.master_addr, inputs.master_port, timeout),
        GPUS: check_gpus(inputs.gpus_needed, timeout, inputs.path),
    }
    return list(
        await asyncio.gather(
            *(bounded(name, check, timeout, STUCK[name]) for name, check in checks.items())
        )
    )


async def bounded(
    name: str, check: Awaitable[tuple[bool, str]], timeout_s: float, stuck: str
) -> CheckResult:
    """``check`` timed and turned into a result: a timeout or an error fails it, and never
    escapes, so the gate reports every check. The checks bound themselves (threads and
    subprocesses); this bound, a little later, is the backstop."""
    start = time.monotonic()
    try:
        ok, detail = await asyncio.wait_for(check, timeout_s + 2 * REAP_S)
    except TimeoutError as error:
        why = str(error) or f"no answer within {timeout_s:g} s"
        return CheckResult(name, False, f"timed out: {why}; {stuck}", _since(start), True)
    except Exception as error:  # an OS surprise or a bug: still a verdict, with its words
        return CheckResult(name, False, f"could not run: {error!r}", _since(start))
    return CheckResult(name, ok, detail, _since(start))


def _since(start: float) -> float:
    return time.monotonic() - start


# -- the checkpoint root --------------------------------------------------------------


async def check_ckpt_root(root: str, min_free_gb: float, timeout_s: float) -> tuple[bool, str]:
    """The root exists (or is created), takes a durable write, and has the free space."""
    if not root:
        return True, "skipped: this launch has no checkpoint root (--ckpt-root)"
    return await in_thread(lambda: probe_ckpt_root(Path(root), min_free_gb), timeout_s)


def probe_ckpt_root(root: Path, min_free_gb: float) -> tuple[bool, str]:
    """Blocking; see :func:`check_ckpt_root`. ``min_free_gb`` 0 leaves free space unchecked."""
    if root.exists() and not root.is_dir():
        return False, f"checkpoint root {root} is not a directory: point --ckpt-root at one"
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        return False, (
            f"checkpoint root {root} does not exist and cannot be created ({_why(error)}): "
            "create it on a file system every node mounts, writable by the job's user"
        )
    try:
        _write_probe(root)
        free_gb = shutil.disk_usage(root).free / GB
    except OSError as error:
        return False, (
            f"checkpoint root {root} is not writable ({_why(error)}): check its permissions "
            "and its mount on this node (read-only, full, over quota?)"
        )
    if min_free_gb > 0 and free_gb < min_free_gb:
        return False, (
            f"checkpoint root {root} has {free_gb:.2f} GB free, under health_min_free_gb "
            f"{min_free_gb:g}: delete old checkpoints or lower the setting"
        )
    return True, f"{root} is writable, {free_gb:.1f} GB free"


def _write_probe(root: Path) -> None:
    """Write, fsync and remove a file no other agent uses: fsync is where a full or
    read-only remote file system says so."""
    probe = root / f".resurgo-health-{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex}"
    descriptor = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        try:
            os.write(descriptor, b"resurgo health probe\n")
            os.fsync(descriptor)
        finally:
            os.close(descriptor)
    finally:
        with contextlib.suppress(OSError):
            probe.unlink()


def _why(error: OSError) -> str:
    return error.strerror or str(error)


# -- the rendezvous address -----------------------------------------------------------


async def check_rdzv_addr(host: str, port: int, timeout_s: float) -> tuple[bool, str]:
    """The rendezvous host resolves and this node has a route to it."""
    return await in_thread(lambda: probe_route(host, port), timeout_s)


def probe_route(host: str, port: int) -> tuple[bool, str]:
    """Blocking; ``getaddrinfo``, then a UDP ``connect`` (it sends nothing: the kernel only
    picks the route, so an unroutable address fails at once)."""
    try:
        addresses = socket.getaddrinfo(host, max(port, 1), type=socket.SOCK_DGRAM)
    except (socket.gaierror, UnicodeError) as error:
        return False, (
            f"rendezvous host {host} does not resolve ({error}): fix this node's DNS or "
            "/etc/hosts, or the master address the launch was given"
        )
    failures = []
    for family, kind, proto, _, address in addresses:
        with socket.socket(family, kind, proto) as probe:
            try:
                probe.connect(address)
            except OSError as error:
                failures.append(f"{address[0]}: {_why(error)}")
                continue
            return True, f"{host} resolves to {address[0]}, routed via {probe.getsockname()[0]}"
    return False, (
        f"rendezvous host {host} resolves but has no route from this node "
        f"({'; '.join(failures)}): check this node's network interfaces and routes"
    )


# -- GPUs -----------------------------------------------------------------------------


def gpus_needed(environ: Mapping[str, str], local_ranks: int | None) -> int | None:
    """How many GPUs ``nvidia-smi`` must list here, or None when unclear.

    Only a job Slurm gave GPUs (``SLURM_GPUS_ON_NODE``) is known to use them: a CPU
    job may run many ranks on a GPU node. Its ranks need one each, but never more
    than Slurm gave (ranks may share); with the ranks unknown (a wrapper's), all
    the GPUs Slurm gave must be there.
    """
    try:
        given = int(environ.get("SLURM_GPUS_ON_NODE", ""))
    except ValueError:
        return None
    if given < 1:
        return None
    return given if local_ranks is None else min(given, local_ranks)


async def check_gpus(needed: int | None, timeout_s: float, path: str | None) -> tuple[bool, str]:
    """Where ``nvidia-smi`` is on ``PATH``: enough GPUs, none with pending retired pages or a
    failed row remapping, and no Xid error in the kernel log since boot."""
    smi = shutil.which("nvidia-smi", path=path)
    if smi is None:
        return True, "skipped: nvidia-smi is not on PATH"
    deadline = time.monotonic() + timeout_s
    query = [smi, f"--query-gpu={GPU_QUERY}", "--format=csv,noheader,nounits"]
    count, problems = read_gpus(await run_bounded(query, timeout_s), needed)
    xid_ok, xid_detail = await check_xid(
        shutil.which("dmesg", path=path), max(deadline - time.monotonic(), 0.1)
    )
    if problems or not xid_ok:
        return False, "; ".join([*problems, *([] if xid_ok else [xid_detail])])
    return True, (
        f"{count} GPU(s), no pending retired pages or row-remapping failures; {xid_detail}"
    )


def read_gpus(answer: Completed, needed: int | None) -> tuple[int, list[str]]:
    """The GPU count in ``nvidia-smi``'s answer and the problems it shows, in words."""
    if answer.returncode != 0:
        last = (answer.output.strip().splitlines() or ["no output"])[-1]
        return 0, [
            f"nvidia-smi failed (exit status {answer.returncode}: {last}): the driver may "
            "be down or a GPU off the bus; drain the node and check it (nvidia-smi -q)"
        ]
    rows = [
        [cell.strip() for cell in line.split(",")]
        for line in answer.output.splitlines()
        if line.strip()
    ]
    gpus = [row for row in rows if len(row) == len(GPU_QUERY.split(","))]
    problems = []
    if not gpus:
        problems.append("nvidia-smi lists no GPU: drain the node and check its GPUs and driver")
    elif needed is not None and len(gpus) < needed:
        problems.append(
            f"nvidia-smi lists {len(gpus)} GPU(s), this node's ranks need {needed}: a GPU is "
            "missing (off the bus?); drain the node and check it (nvidia-smi -q, dmesg)"
        )
    for index, bus, pending, remap_failed in gpus:
        if _is_set(pending):
            problems.append(
                f"GPU {index} ({bus}) has retired pages pending: reset the GPU or reboot "
                "the node before using it"
            )
        if _is_set(remap_failed):
            problems.append(
                f"GPU {index} ({bus}) failed a row remapping: drain the node; the GPU needs "
                "replacing"
            )
    return len(gpus), problems


def _is_set(value: str) -> bool:
    """A query flag that is set; "[N/A]" and "N/A" (not supported) are not."""
    return value.lower() in ("yes", "1", "true")


async def check_xid(dmesg: str | None, timeout_s: float) -> tuple[bool, str]:
    """No ``NVRM: Xid`` line in the kernel log since boot, but for the Xids an application
    causes (:data:`agent.node.kernlog.APPLICATION_XIDS`). ``dmesg`` may be refused to a
    non-root user (kernel.dmesg_restrict): then Xid errors go unchecked, and it says so."""
    if dmesg is None:
        return True, "Xid not checked: dmesg is not on PATH"
    answer = await run_bounded([dmesg], timeout_s)
    if answer.returncode != 0:
        last = (answer.output.strip().splitlines() or ["no output"])[-1]
        return True, f"Xid not checked: dmesg exit status {answer.returncode}: {last}"
    xids = hardware_xids(answer.output)
    if xids:
        return False, (
            f"{len(xids)} Xid error(s) in the kernel log since boot, the last: {xids[-1][:200]}: "
            "look the code up in NVIDIA's Xid table; drain the node and reset the GPU or "
            "reboot it"
        )
    return True, "no Xid error in the kernel log since boot"


# -- bounded waiting ------------------------------------------------------------------


async def in_thread(work: Callable[[], T], timeout_s: float) -> T:
    """``work()`` in a daemon thread, waited for at most ``timeout_s`` (TimeoutError).

    Not the loop's executor: a call stuck in the kernel (fsync on a hung NFS mount,
    a resolver that never answers) cannot be cancelled, and the executor's threads
    are joined at exit, so the agent could not exit to refuse the launch. A daemon
    thread is abandoned instead.
    """
    loop = asyncio.get_running_loop()
    done: asyncio.Future[T] = loop.create_future()

    def run() -> None:
        try:
            result = work()
        except Exception as error:
            _settle(loop, done, functools.partial(done.set_exception, error))
        else:
            _settle(loop, done, functools.partial(done.set_result, result))

    threading.Thread(target=run, name="resurgo-health-check", daemon=True).start()
    try:
        return await asyncio.wait_for(done, timeout_s)
    except TimeoutError:
        raise TimeoutError(f"no answer within {timeout_s:g} s") from None


def _settle(
    loop: asyncio.AbstractEventLoop, future: asyncio.Future[T], how: Callable[[], None]
) -> None:
    """From the worker thread: settle ``future`` in its loop, unless it gave up waiting."""

    def settle() -> None:
        if not future.done():
            how()

    with contextlib.suppress(RuntimeError):  # the loop has closed: nobody waits
        loop.call_soon_threadsafe(settle)


async def run_bounded(argv: Sequence[str], timeout_s: float) -> Completed:
    """Run ``argv`` for at most ``timeout_s``; on timeout kill its whole process group and
    raise TimeoutError. Its own session, so children holding its output are killed too,
    and the wait after the kill is bounded: a process stuck in a driver cannot die."""
    process = await asyncio.create_subprocess_exec(
        *argv,
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        output, _ = await asyncio.wait_for(process.communicate(), timeout_s)
    except TimeoutError:
        _kill_group(process.pid)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(process.wait(), REAP_S)
        name = Path(argv[0]).name
        raise TimeoutError(f"{name} gave no answer within {timeout_s:.3g} s (killed)") from None
    except BaseException:  # cancelled: nothing it started may outlive the check
        _kill_group(process.pid)
        raise
    code = process.returncode
    return Completed(-1 if code is None else code, output.decode(errors="replace"))


def _kill_group(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGKILL)
