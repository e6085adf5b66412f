"""Standby interpreters: one process per node that has imported torch, forking ranks.

A relaunch after a fault starts each rank again, and most of a rank's start is
the interpreter importing torch (over a second of CPU each; with several ranks
per node and torchrun besides, seconds of the recovery). The driver runs this
pool in a step of its own on every node of the allocation
(:mod:`agent.driver.warm`), started once the first launch is under way and
kept across relaunches, spares included. Each rank's shim
(:mod:`agent.node.rankexec`) asks the node's pool for its worker: the pool
forks, the child becomes the rank (:mod:`agent.node.warmchild`: its
environment, working directory, arguments and standard streams, the script run
from its top, unchanged, as ``__main__``), and the pool tells the shim the
child's pid and, at its end, its exit status.

What a fork cannot give a rank the way a fresh interpreter would, the pool
refuses, and the shim starts the worker cold as before (nothing is lost but the
time): a different interpreter, variables read only at the interpreter's start
or at torch's import (:data:`FIXED_AT_START`) set differently, a worker that
is not a Python script or module, a pool with Python threads. A rank forked
here shows the pool's command line and its initial environment in ``ps`` and
``/proc`` (its shim shows the script's); the agent finds it through the shim
(:func:`agent.node.procs.worker_of_shim`).

The socket is a node-local path private to the job's user
(:func:`socket_path`, a 0700 directory) and the pool serves only its own user
(``SO_PEERCRED``). A child dies with the pool (``PR_SET_PDEATHSIG``), and the
pool kills a child, its process group and every process descended from it when
the process that asked for it goes away (a shim or an agent killed, or its step
ended): torchrun starts each shim in a session of its own, and the shim's end
closing takes its rank along, so no rank outlives the launch it belongs to, as
Slurm's end of a step takes a cold launch's processes.

One message each way per request on a ``SOCK_SEQPACKET`` socket, JSON: the
request carries the worker's ``argv`` (a script and its arguments, or
``["-m", module, ...]``), ``cwd``, ``env`` and ``executable``, with the three
standard streams' descriptors; the pool answers ``{"pid": N}`` or
``{"refused": why}``, and later ``{"exit": returncode}`` (negative: the
signal), then closes.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import ctypes
import errno
import hashlib
import importlib
import json
import logging
import os
import selectors
import signal
import socket
import sys
import tempfile
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger("resurgo.warmpool")

# What the pool imports before it serves: what every PyTorch rank imports first.
PRELOAD = (
    "numpy",
    "torch",
    "torch.nn",
    "torch.optim",
    "torch.utils.data",
    "torch.distributed",
    "torch.distributed.checkpoint",
    # Imported by the first optimizer a rank builds (torch.optim's compiler hooks): a
    # second of CPU in every rank, 2.4 s of a warm relaunch's start on a loaded node.
    "torch._dynamo",
)
# Variables read once, when the interpreter starts or torch and its compiler are
# imported: a rank that sets one differently from the pool could not be forked from
# it faithfully.
FIXED_AT_START = (
    "PYTHON", "LD_", "MKL_", "KMP_", "GOMP_", "OPENBLAS_", "TORCH_LOGS",
    "TORCHDYNAMO_", "TORCHINDUCTOR_", "TORCH_COMPILE", "TORCH_DYNAMO", "TORCH_INDUCTOR",
)  # fmt: skip
MAX_MESSAGE = 1 << 20
# How long the pool may take to answer before the process is started cold: its imports
# at the job's start (a launch's first requests wait in its backlog until it is warm).
ANSWER_S = 120.0
# The longest path a Unix socket's address holds (108 bytes with its terminating NUL).
MAX_SOCKET_PATH = 108
STREAMS = 3
# Signals that stop the pool: it takes no more requests and ends once its children have
# (Slurm signals every process of a step alike: the ranks choose what SIGTERM means).
STOPPING = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT)
# Signals a job may have Slurm send its steps for the ranks (``--signal=USR1@90``, say):
# ignored by the pool, whose death would take its children with it.
IGNORED = (signal.SIGUSR1, signal.SIGUSR2)
PR_SET_PDEATHSIG = 1
# The line a pool prints on its standard output once it listens, its node after it: the
# driver starts a launch's step once every node's pool has (:mod:`agent.driver.warm`).
LISTENING = b"resurgo-warmpool: listening on"


def socket_path(job_id: str, node: str, secret_file: str | None, tmp: str | None = None) -> str:
    """The pool's socket on ``node`` for the job: the same for the pool and the agents
    (the job's secret in the name keeps a later job with the same id from reaching an
    earlier one's pool). Short enough for a Unix socket's 108 bytes."""
    secret = b""
    if secret_file:
        with contextlib.suppress(OSError):
            secret = Path(secret_file).read_bytes()
    digest = hashlib.sha256(f"{job_id}\0{node}\0".encode() + secret).hexdigest()[:16]
    name = f"resurgo-warm-{job_id}-{digest}/pool"
    path = os.path.join(tmp or tempfile.gettempdir(), name)
    # A long TMPDIR (a job's scratch directory) would not fit in a socket address.
    return path if len(os.fsencode(path)) < MAX_SOCKET_PATH else os.path.join("/tmp", name)


@dataclass(frozen=True)
class Forked:
    """A process the pool forked: its pid, and the connection its exit status comes on."""

    conn: socket.socket
    pid: int


def fork_from_pool(
    path: str,
    argv: Sequence[str],
    env: Mapping[str, str],
    fds: Sequence[int],
    timeout_s: float = ANSWER_S,
) -> Forked | str:
    """Ask the pool at ``path`` to fork ``python ARGV`` with ``env``, this process's working
    directory and ``fds`` as its standard streams. What it forked, or why not: the pool's
    refusal, or "" when no pool answered (none there, or it took over ``timeout_s``)."""
    request = {"argv": list(argv), "cwd": os.getcwd(), "env": dict(env),
               "executable": sys.executable}  # fmt: skip
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        conn.settimeout(timeout_s)
        conn.connect(path)
        socket.send_fds(conn, [json.dumps(request).encode()], list(fds))
        answer = json.loads(conn.recv(MAX_MESSAGE))
    except (OSError, ValueError):
        answer = None
    pid = answer.get("pid") if isinstance(answer, dict) else None
    if isinstance(pid, int):
        conn.settimeout(None)
        return Forked(conn, pid)
    conn.close()
    refused = answer.get("refused") if isinstance(answer, dict) else None
    return str(refused) if refused else ""


class WarmProcess:
    """A process the pool forked, awaited as an ``asyncio`` subprocess is (the agent's
    torchrun): ``pid``, ``returncode`` and ``wait()``."""

    def __init__(self, forked: Forked) -> None:
        self._conn = forked.conn
        self._conn.setblocking(False)
        self.pid = forked.pid
        self.returncode: int | None = None

    async def wait(self) -> int:
        if self.returncode is None:
            loop = asyncio.get_running_loop()
            try:
                code = exit_status(await loop.sock_recv(self._conn, MAX_MESSAGE))
            except OSError:
                code = None
            self._conn.close()
            # None: the pool died, and its children with it (PR_SET_PDEATHSIG, SIGKILL).
            self.returncode = -signal.SIGKILL if code is None else code
        return self.returncode


def exit_status(message: bytes) -> int | None:
    """The exit status in the pool's last message (None: the pool ended without one)."""
    try:
        code = json.loads(message or b"{}").get("exit")
    except (ValueError, AttributeError):
        return None
    return code if isinstance(code, int) else None


def fixed_at_start(environ: Mapping[str, str]) -> dict[str, str]:
    """The variables of ``environ`` that only a fresh interpreter would take in."""
    return {name: value for name, value in environ.items() if name.startswith(FIXED_AT_START)}


def after_the_imports(
    request: Mapping[str, object], pool_env: Mapping[str, str], set_by_imports: Mapping[str, str]
) -> tuple[dict[str, object], dict[str, str]]:
    """``request`` and ``pool_env`` as a fresh interpreter would have them after the pool's
    preloaded imports, for :func:`why_not_warm`: what those set (torch's compiler its
    ``TORCHINDUCTOR_CACHE_DIR``) is the child's unless its own environment sets it, and a
    launch forked from the pool passes it on to its ranks."""
    env = request.get("env")
    seen = {**request, "env": {**set_by_imports, **env}} if isinstance(env, dict) else {**request}
    return seen, {**pool_env, **set_by_imports}


def why_not_warm(
    request: Mapping[str, object], pool_env: Mapping[str, str], python_threads: int | None = None
) -> str | None:
    """Why the pool cannot fork the worker of ``request`` (None: it can); ``python_threads``:
    how many the pool runs (default: counted)."""
    argv, env = request.get("argv"), request.get("env")
    if not isinstance(argv, list) or not argv or not all(isinstance(a, str) for a in argv):
        return "no script to run"
    if argv[0] == "-m" and len(argv) < 2:
        return "no module to run"
    if argv[0].startswith("-") and argv[0] != "-m":
        return f"interpreter option {argv[0]}"
    if not isinstance(env, dict) or not isinstance(request.get("cwd"), str):
        return "no environment or working directory"
    executable = request.get("executable")
    if not isinstance(executable, str) or os.path.realpath(executable) != os.path.realpath(
        sys.executable
    ):
        return f"another interpreter ({executable}, the pool runs {sys.executable})"
    wanted, have = fixed_at_start(env), fixed_at_start(pool_env)
    if differ := sorted(set(wanted.items()) ^ set(have.items())):
        return f"{differ[0][0]} is set differently from the pool's"
    if (threading.active_count() if python_threads is None else python_threads) > 1:
        return "the pool has Python threads (a fork would inherit their locks)"
    return None


@dataclass
class _Child:
    pid: int
    conn: socket.socket


class Pool:
    """The server: accepts requests, forks, reaps and reports exits (single-threaded)."""

    def __init__(self, path: str) -> None:
        self._path = path
        self._env = dict(os.environ)
        self._selector = selectors.DefaultSelector()
        self._children: dict[int, _Child] = {}
        self._waiting: dict[int, socket.socket] = {}  # fd -> a connection not yet served
        self._stopping = False
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self._set_by_imports: dict[str, str] = {}
        self._forked = False  # True in a child on its way to become a rank

    def preload(self, modules: Sequence[str]) -> list[str]:
        """Import ``modules`` (those missing skipped); the ones imported. What the imports
        put in the environment (torch's ``CUDA_MODULE_LOADING``, say) a child gets unless
        its own environment sets it, as its own import of them would have done."""
        done = []
        for name in modules:
            try:
                importlib.import_module(name)
            except Exception as error:  # a module the user's environment lacks, or broken
                log.info("not preloaded: %s (%s)", name, error)
                continue
            done.append(name)
        self._set_by_imports = {
            name: value for name, value in os.environ.items() if self._env.get(name) != value
        }
        return done

    def listen(self) -> None:
        """Bind the socket (a stale one of a dead pool replaced) and start accepting."""
        from agent.node.rundir import private_dir

        directory = private_dir(Path(self._path).parent)
        path = directory / Path(self._path).name
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
        self._listener.bind(str(path))
        self._listener.listen(64)
        self._path = str(path)
        self._selector.register(self._listener, selectors.EVENT_READ, self._accept)
        self._selector.register(self._wake_r, selectors.EVENT_READ, self._woken)
        signal.set_wakeup_fd(self._wake_w)
        signal.signal(signal.SIGCHLD, lambda *_: None)
        for signum in STOPPING:
            signal.signal(signum, self._on_stop)
        for signum in IGNORED:
            signal.signal(signum, signal.SIG_IGN)

    def serve(self) -> None:
        """Serve until told to stop (SIGTERM, ...); then take no more requests and wait for
        the children, which got the same signal from Slurm and end as they choose (a
        checkpoint on SIGTERM); should serving fail, kill every child's group."""
        try:
            while not self._stopping or self._children:
                if self._stopping and self._path:
                    self._stop_listening()
                for key, _ in self._selector.select(timeout=1.0):
                    key.data(key.fileobj)
                self._reap()
        finally:
            if not self._forked:  # a child leaving for its exit owns none of this
                for child in self._children.values():
                    kill_launch(child.pid)
                if self._path:
                    with contextlib.suppress(OSError):
                        os.unlink(self._path)

    def _on_stop(self, _signum: int, _frame: object) -> None:
        self._stopping = True

    def _stop_listening(self) -> None:
        with contextlib.suppress(KeyError, ValueError):
            self._selector.unregister(self._listener)
        self._listener.close()
        with contextlib.suppress(OSError):
            os.unlink(self._path)
        self._path = ""

    def _woken(self, _fd: object) -> None:
        with contextlib.suppress(BlockingIOError):
            os.read(self._wake_r, 4096)

    def _accept(self, _listener: object) -> None:
        try:
            conn, _ = self._listener.accept()
        except OSError:
            return
        creds = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12)
        _pid, uid, _gid = (int.from_bytes(creds[i : i + 4], sys.byteorder) for i in (0, 4, 8))
        if uid != os.getuid():
            log.warning("refused a connection from uid %d", uid)
            conn.close()
            return
        self._waiting[conn.fileno()] = conn
        self._selector.register(conn, selectors.EVENT_READ, self._request)

    def _request(self, conn: socket.socket) -> None:
        self._selector.unregister(conn)
        self._waiting.pop(conn.fileno(), None)
        fds: list[int] = []
        try:
            data, fds, flags, _ = socket.recv_fds(conn, MAX_MESSAGE, STREAMS)
            request = json.loads(data) if data and not flags & socket.MSG_TRUNC else None
        except (OSError, ValueError):
            request = None
        why = "an unreadable request" if not isinstance(request, dict) else None
        if why is None and len(fds) != STREAMS:
            why = "not given the three standard streams"
        if why is None and self._stopping:
            why = "the pool is stopping"
        if why is None:
            assert isinstance(request, dict)
            why = why_not_warm(*after_the_imports(request, self._env, self._set_by_imports))
        if why is not None:
            _send(conn, {"refused": why})
            conn.close()
            for fd in fds:
                os.close(fd)
            return
        assert isinstance(request, dict)
        if _closed(conn):  # the shim gave up waiting and started its worker cold
            conn.close()
            for fd in fds:
                os.close(fd)
            return
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            self._in_child(conn, request, fds)
        for fd in fds:
            os.close(fd)
        self._children[pid] = _Child(pid, conn)
        _send(conn, {"pid": pid})
        self._selector.register(conn, selectors.EVENT_READ, self._shim_gone)

    def _in_child(self, conn: socket.socket, request: dict[str, object], fds: list[int]) -> None:
        """The forked child: let go of the pool's descriptors and become the rank."""
        try:
            os.setsid()  # as torchrun and the agent start theirs: a session of its own
            die_with_parent()
            signal.set_wakeup_fd(-1)
            for signum in (signal.SIGCHLD, *STOPPING, *IGNORED):
                signal.signal(signum, signal.SIG_DFL)
            signal.signal(signal.SIGINT, signal.default_int_handler)
            for held in (self._listener, conn, *self._waiting.values()):
                held.close()
            for child in self._children.values():
                child.conn.close()
            self._selector.close()
            os.close(self._wake_r)
            os.close(self._wake_w)
            for handler in list(log.handlers):
                log.removeHandler(handler)
            log.propagate, log.level = True, logging.NOTSET
            self._forked = True
            from agent.node import warmchild

            warmchild.become_rank(request, fds, self._set_by_imports)
        except SystemExit:
            raise  # the rank's end, out through serve() to the interpreter's exit
        except BaseException:
            os._exit(70)

    def _shim_gone(self, conn: socket.socket) -> None:
        """The asker's end closed while its child runs (the shim or agent died): kill the
        child and what it started."""
        self._selector.unregister(conn)
        for child in self._children.values():
            if child.conn is conn:
                kill_launch(child.pid)

    def _reap(self) -> None:
        while self._children:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            child = self._children.pop(pid, None)
            if child is None:
                continue
            with contextlib.suppress(KeyError, ValueError):
                self._selector.unregister(child.conn)
            _send(child.conn, {"exit": os.waitstatus_to_exitcode(status)})
            child.conn.close()


def kill_launch(pid: int) -> None:
    """SIGKILL the pool's child ``pid``, its process group and its descendants in other
    sessions (torchrun's shims), the group first so that nothing in it starts more."""
    import psutil  # here: the shims import this module, and a shim's start is a rank's

    try:
        descendants = psutil.Process(pid).children(recursive=True)
    except psutil.Error:
        descendants = []
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGKILL)
    for process in descendants:
        with contextlib.suppress(psutil.Error):
            process.kill()


def _closed(conn: socket.socket) -> bool:
    try:
        return conn.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b""
    except BlockingIOError:
        return False
    except OSError:
        return True


def _send(conn: socket.socket, message: dict[str, object]) -> None:
    with contextlib.suppress(OSError):
        conn.send(json.dumps(message).encode())


def die_with_parent() -> None:
    """SIGKILL this process when its parent dies (``prctl(PR_SET_PDEATHSIG)``): a
    pool's child with the pool, a shim with its torchrun."""
    parent = os.getppid()
    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != parent:  # the parent died before the call
        os._exit(70)


def describe_torchrun(job_dir: Path) -> None:
    """torchrun's parser described beside the job's secret, where the first launch's agents
    wait for it instead of importing torch for it (:mod:`agent.node.torchrun_options`);
    torch is imported here already."""
    from agent.node.torchrun_options import torchrun_parser

    try:
        torchrun_parser(job_dir)
    except Exception as error:  # the agents describe it themselves after their wait
        log.warning("torchrun's options not described: %s", error)


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m agent.node.warmpool``: preload, then serve on this node's socket."""
    # Its own handler, not the root logger's: a rank forked from here configures logging as
    # it would in a fresh interpreter (the child drops this handler).
    handler = logging.StreamHandler()
    handler.setFormatter(
        logging.Formatter("resurgo-warmpool %(asctime)s %(levelname)s %(message)s")
    )
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    log.propagate = False
    parser = argparse.ArgumentParser(prog="python -m agent.node.warmpool")
    parser.add_argument("--job-id", required=True)
    parser.add_argument("--secret-file", default=None)
    parser.add_argument("--node", default=None, help="default: SLURMD_NODENAME, else the host")
    parser.add_argument("--preload", action="append", default=None, help="modules to import")
    args = parser.parse_args(argv)
    node = args.node or os.environ.get("SLURMD_NODENAME") or socket.gethostname()
    started = time.monotonic()
    pool = Pool(socket_path(args.job_id, node, args.secret_file))
    try:
        # Listening before the imports: a launch's first requests wait in the backlog
        # for the pool to be warm instead of finding no pool and starting fresh.
        pool.listen()
    except OSError as error:
        if error.errno == errno.EADDRINUSE:
            log.warning("another pool serves this node: %s", error)
        else:
            log.error("the pool cannot listen: %s", error)
        return 1
    # The driver asks for the launch's step once every node's pool has said this.
    sys.stdout.buffer.write(LISTENING + b" " + node.encode() + b"\n")
    sys.stdout.flush()
    loaded = pool.preload(args.preload or PRELOAD)
    log.info(
        "%s: warm in %.1f s (%s), serving ranks", node, time.monotonic() - started,
        ", ".join(loaded) or "nothing preloaded",
    )  # fmt: skip
    if args.secret_file and "torch" in loaded:
        describe_torchrun(Path(args.secret_file).parent)
    pool.serve()
    return 0


if __name__ == "__main__":
    sys.exit(main())
