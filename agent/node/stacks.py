"""Python stacks of rank processes through py-spy: evidence for hangs, and hang detection
for scripts that send no heartbeats.

:func:`dump_stacks` runs ``py-spy dump --json --pid PID`` (all threads) with a
timeout and returns a :class:`StackDump`; a failure is a value whose ``error``
says what to do, never an exception. :func:`fingerprint` and
:func:`in_collective` turn a dump into an :class:`agent.node.hang.StackSample`.

What py-spy 0.4 prints for a rank blocked in a gloo ``all_reduce`` while its
peer is SIGSTOPped (recorded in ``tests/fixtures/stacks/``; frames innermost
first)::

    Thread 21906 (idle): "MainThread"
        all_reduce (torch/distributed/distributed_c10d.py:3252)
        _exception_logger.<locals>.wrapper (torch/distributed/c10d_logger.py:83)
        <module> (tw2.py:13)

With ``async_op=True`` and ``work.wait()`` the wait is C++ and the Python
stack shows only the caller's line (``<module> (tw2.py:15)``); only a native
dump (``--native``) shows it, as ``c10d::Work::wait (libtorch_cpu.so)`` under
``pthread_cond_wait``. So the classifier reads both: Python frames of
torch.distributed collectives and waits, and native ``c10d::``/``gloo::``/NCCL
frames. A native dump costs ~0.5 s against ~20 ms and pauses the rank longer:
sample Python-only, and take a native dump to confirm a frozen stack that the
Python frames cannot place.

A SIGSTOPped process cannot be dumped the default way (py-spy fails with
"Failed to suspend process"); it is already still, so :func:`dump_stacks`
retries it with ``--nonblocking``. Its stack shows where it stopped, outside
any collective, which is what blame looks for.
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# Rust backtraces add ~15 lines of noise to every py-spy error.
_PY_SPY_ENV = {**os.environ, "RUST_BACKTRACE": "0"}

# Python functions in torch/distributed whose frame means "waiting for the other
# ranks": the c10d collectives and p2p ops, barriers, store-based waits, and the
# FSDP2/functional-collective waits that wrap a Work.
_COLLECTIVE_FUNCTIONS = frozenset(
    {
        "all_reduce",
        "all_reduce_coalesced",
        "all_reduce_multigpu",
        "all_gather",
        "all_gather_into_tensor",
        "all_gather_object",
        "all_gather_coalesced",
        "_all_gather_base",
        "all_to_all",
        "all_to_all_single",
        "broadcast",
        "broadcast_object_list",
        "reduce",
        "reduce_scatter",
        "reduce_scatter_tensor",
        "_reduce_scatter_base",
        "gather",
        "gather_object",
        "scatter",
        "scatter_object_list",
        "send",
        "recv",
        "send_object_list",
        "recv_object_list",
        "batch_isend_irecv",
        "barrier",
        "monitored_barrier",
        "_store_based_barrier",
        "_wait_for_workers",
        "wait",
        "wait_tensor",
        "wait_for_unshard",
        "foreach_all_gather",
        "foreach_all_gather_copy_out",
        "foreach_reduce",
        "synchronize",
        "get_all",
    }
)
# torchrun's own agent loop lives under torch/distributed too, but sleeping there
# is its normal state, not a collective.
_LAUNCHER_PARTS = ("torch/distributed/elastic/agent/", "torch/distributed/launcher/")
_NATIVE_PREFIXES = ("c10d::", "gloo::", "nccl", "ncclKernel")


@dataclass(frozen=True)
class Frame:
    """One stack frame; ``line`` is 0 and ``native`` True for a C/C++ frame."""

    function: str
    file: str
    line: int
    native: bool = False


@dataclass(frozen=True)
class ThreadStack:
    """One thread's frames, innermost first."""

    thread_id: int
    name: str
    idle: bool
    frames: tuple[Frame, ...]


@dataclass(frozen=True)
class StackDump:
    """The result of one py-spy run; ``ok`` False means ``error`` says what went wrong.

    ``text`` is the human-readable dump (py-spy's own layout) for events and
    reports, or py-spy's error output when it failed.
    """

    pid: int
    ok: bool
    text: str
    threads: tuple[ThreadStack, ...]
    error: str | None = None
    native: bool = False


def find_py_spy() -> str | None:
    """py-spy next to this interpreter (the venv's), else on PATH; None when neither."""
    beside = Path(sys.executable).parent / "py-spy"
    if beside.is_file() and os.access(beside, os.X_OK):
        return str(beside)
    return shutil.which("py-spy")


def dump_stacks(
    pid: int, timeout_s: float = 10.0, *, native: bool = False, py_spy: str | None = None
) -> StackDump:
    """Dump every thread of ``pid`` with py-spy; never raises for an expected failure.

    ``native`` adds C/C++ frames (see the module docstring for when that is
    needed). ``py_spy`` overrides :func:`find_py_spy`.
    """
    exe = py_spy or find_py_spy()
    if exe is None:
        return _failed(
            pid,
            f"py-spy not found next to {sys.executable} or on PATH: "
            "install it in the agent's environment (pip install py-spy)",
        )
    deadline = time.monotonic() + timeout_s
    argv = [exe, "dump", "--json", "--pid", str(pid)] + (["--native"] if native else [])
    done = _run(argv, timeout_s)
    if not isinstance(done, str) and done.returncode != 0 and "Failed to suspend" in done.stderr:
        # A stopped process (SIGSTOP, or another tracer holding it) cannot be
        # suspended again; it is not running, so a non-blocking read is exact.
        done = _run([*argv, "--nonblocking"], max(0.1, deadline - time.monotonic()))
    if isinstance(done, str):
        return _failed(pid, done)
    if done.returncode != 0:
        return _failed(pid, _explain(pid, done.stderr or done.stdout), text=done.stderr)
    try:
        threads = parse_json_dump(json.loads(done.stdout))
    except (ValueError, KeyError, TypeError) as error:
        return _failed(pid, f"py-spy printed output this agent cannot parse: {error}")
    return StackDump(pid, True, render(pid, threads), threads, None, native)


def _run(argv: list[str], timeout_s: float) -> subprocess.CompletedProcess[str] | str:
    """py-spy's result, or why it could not run (a message)."""
    try:
        return subprocess.run(
            argv, capture_output=True, text=True, timeout=timeout_s, env=_PY_SPY_ENV, check=False
        )
    except subprocess.TimeoutExpired:
        return f"py-spy did not answer within {timeout_s:.1f} s (process in D state, or stuck?)"
    except OSError as error:
        return f"could not run py-spy ({argv[0]}): {error}"


def _explain(pid: int, stderr: str) -> str:
    first = next((ln.strip() for ln in stderr.splitlines() if ln.strip()), "no output")
    lowered = stderr.lower()
    if (
        "failed to get process executable name" in lowered
        or "no such process" in lowered
        or "no such file or directory" in lowered
    ):
        return f"process {pid} is gone (py-spy: {first})"
    if "permission denied" in lowered or "operation not permitted" in lowered:
        return (
            f"permission denied attaching to process {pid} (py-spy: {first}): run the agent as "
            "the job's user or root, or allow ptrace (sysctl kernel.yama.ptrace_scope=0, "
            "or CAP_SYS_PTRACE for py-spy)"
        )
    return f"py-spy failed on process {pid}: {first}"


def _failed(pid: int, error: str, *, text: str = "") -> StackDump:
    return StackDump(pid, False, text, (), error)


def parse_json_dump(data: Any) -> tuple[ThreadStack, ...]:
    """Threads from ``py-spy dump --json`` output (a list of thread objects)."""
    threads = []
    for thread in data:
        frames = tuple(
            Frame(
                function=str(frame["name"]),
                file=str(frame.get("short_filename") or frame.get("filename") or ""),
                line=int(frame.get("line") or 0),
                # Native frames name their shared object in "module"; Python ones do not.
                native=frame.get("module") is not None,
            )
            for frame in thread["frames"]
        )
        threads.append(
            ThreadStack(
                thread_id=int(thread.get("os_thread_id") or thread.get("thread_id") or 0),
                name=str(thread.get("thread_name") or ""),
                idle=not thread.get("active", False),
                frames=frames,
            )
        )
    return tuple(threads)


def render(pid: int, threads: Sequence[ThreadStack]) -> str:
    """A dump in py-spy's own text layout, for humans."""
    lines = [f"Process {pid}"]
    for thread in threads:
        state = "idle" if thread.idle else "active"
        lines.append(f'Thread {thread.thread_id} ({state}): "{thread.name}"')
        for frame in thread.frames:
            where = frame.file if frame.native else f"{frame.file}:{frame.line}"
            lines.append(f"    {frame.function} ({where})")
    return "\n".join(lines)


def _training_threads(dump: StackDump) -> tuple[ThreadStack, ...]:
    # The training loop runs on the main thread (py-spy names it "MainThread",
    # or its OS thread id is the pid). Other threads -- loader pin-memory, async
    # checkpoint writers, logging -- keep moving while the loop is stuck, so
    # they would hide a hang from the fingerprint.
    main = tuple(t for t in dump.threads if t.name == "MainThread" or t.thread_id == dump.pid)
    return main or dump.threads


def fingerprint(dump: StackDump) -> str:
    """A digest of the training thread's Python frames; equal while the stack is unchanged.

    Native frames are left out, so a native and a Python-only dump of the same
    state agree, and native addresses never make a still stack look busy. A
    failed dump fingerprints as the empty string.
    """
    if not dump.ok:
        return ""
    digest = hashlib.blake2b(digest_size=16)
    for thread in _training_threads(dump):
        digest.update(f"T{thread.thread_id}\n".encode())
        for frame in thread.frames:
            if not frame.native:
                digest.update(f"{frame.function}|{frame.file}|{frame.line}\n".encode())
    return digest.hexdigest()


def in_collective(dump: StackDump) -> bool:
    """Whether any thread sits in a torch.distributed collective or wait.

    True for a Python frame in torch/distributed (not torchrun's own agent
    loop) whose function is a collective, p2p op, barrier or wait, and for a
    native c10d/gloo/NCCL frame (``c10d::Work::wait``: a Python-only dump
    cannot see ``work.wait()``).
    """
    return any(_frame_in_collective(f) for t in dump.threads for f in t.frames)


def _frame_in_collective(frame: Frame) -> bool:
    if frame.native:
        return frame.function.startswith(_NATIVE_PREFIXES)
    path = frame.file.replace("\\", "/")
    if "torch/distributed/" not in path or any(part in path for part in _LAUNCHER_PARTS):
        return False
    return frame.function.rsplit(".", 1)[-1] in _COLLECTIVE_FUNCTIONS


def dump_all(
    pids: Iterable[int], timeout_s: float = 15.0, *, native: bool = False
) -> dict[int, StackDump]:
    """Dump every pid in parallel, all within ``timeout_s`` in total; one result per pid."""
    pids = list(dict.fromkeys(pids))
    if not pids:
        return {}
    deadline = time.monotonic() + timeout_s
    results: dict[int, StackDump] = {}
    pool = concurrent.futures.ThreadPoolExecutor(max_workers=min(16, len(pids)))
    try:
        futures = {pool.submit(dump_stacks, pid, timeout_s, native=native): pid for pid in pids}
        try:
            for future in concurrent.futures.as_completed(
                futures, timeout=max(0.0, deadline - time.monotonic())
            ):
                results[futures[future]] = future.result()
        except concurrent.futures.TimeoutError:
            pass
    finally:
        # Each py-spy run carries its own timeout, so no worker outlives it.
        pool.shutdown(wait=False, cancel_futures=True)
    for pid in pids:
        if pid not in results:
            results[pid] = _failed(
                pid, f"no stack within the {timeout_s:.1f} s deadline for all local ranks"
            )
    return {pid: results[pid] for pid in pids}


def dump_all_placed(pids: Iterable[int], timeout_s: float = 30.0) -> dict[int, StackDump]:
    """Like :func:`dump_all`, with a native dump of every process that its Python frames
    do not place in a collective: DDP's reducer and autograd wait in C++
    (``c10d::Reducer::finalize_backward`` under ``Tensor.backward``), where
    Python frames show only ``backward``. The native dump replaces the Python one
    when it succeeds; taken on suspicion only (it costs ~0.5-1 s a process).
    """
    deadline = time.monotonic() + timeout_s
    dumps = dump_all(pids, timeout_s)
    unplaced = [pid for pid, dump in dumps.items() if dump.ok and not in_collective(dump)]
    if unplaced:
        native = dump_all(unplaced, max(1.0, deadline - time.monotonic()), native=True)
        dumps.update({pid: dump for pid, dump in native.items() if dump.ok})
    return dumps
