"""The warm pool (agent.node.warmpool, agent.node.warmchild) behind the rank shim
(agent.node.rankexec): a real pool that imported torch, real shims asking it for their
workers, each compared with the same worker started cold."""

from __future__ import annotations

import contextlib
import json
import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import psutil
import pytest

from agent.node.launch import with_bootstrap
from agent.node.procs import warm_worker
from agent.node.warmpool import LISTENING, socket_path
from agent.wire.auth import write_secret
from agent.wire.protocol import EventKind
from tests.integration.agent_harness import RunningAgent
from tests.paths import REPO

PROBE = """\
import json, os, random, sys
preloaded = "torch" in sys.modules
import numpy, torch
compiler = "torch._dynamo" in sys.modules
torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=0.1)  # imports the compiler
print(json.dumps({
    "preloaded": preloaded, "compiler": compiler, "argv": sys.argv, "name": __name__,
    "file": __file__,
    "cwd": os.getcwd(), "path0": sys.path[0], "foo": os.environ.get("FOO"),
    "stdin": sys.stdin.readline().strip(), "threads": torch.get_num_threads(),
    "random": random.random(), "numpy": float(numpy.random.random()),
    "pid": os.getpid(), "ppid": os.getppid(),
}), flush=True)
print("probe on stderr", file=sys.stderr)
import logging
logging.basicConfig(format="probe's own format: %(message)s")
logging.warning("logged")
sys.exit(int(sys.argv[1]) if len(sys.argv) > 1 else 0)
"""


@pytest.fixture(scope="module")
def pool(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[subprocess.Popen[bytes], str]]:
    """A pool on node ``n1`` for a job of this test process, its socket under a test
    directory."""
    tmp = tmp_path_factory.mktemp("warm")
    job = f"w{os.getpid()}"
    log = (tmp / "pool.log").open("wb")
    process = subprocess.Popen(
        [sys.executable, "-m", "agent.node.warmpool", "--job-id", job, "--node", "n1"],
        cwd=REPO, env={**os.environ, "TMPDIR": str(tmp)}, stdout=log, stderr=log,
    )  # fmt: skip
    path = socket_path(job, "n1", None, tmp=str(tmp))
    deadline = time.monotonic() + 120
    while not os.path.exists(path):
        assert process.poll() is None, (tmp / "pool.log").read_text()
        assert time.monotonic() < deadline, "the pool did not start serving within 120 s"
        time.sleep(0.1)
    yield process, path
    process.terminate()
    process.wait(timeout=30)


def shim(
    args: list[str], cwd: Path, *, pool_path: str | None, stdin: bytes = b"", **env: str
) -> subprocess.CompletedProcess[bytes]:
    environ = {**os.environ, "RESURGO_EXIT_DIR": str(cwd / "exits"), "RANK": "2", **env}
    environ.pop("RESURGO_WARM_SOCKET", None)
    if pool_path:
        environ["RESURGO_WARM_SOCKET"] = pool_path
    return subprocess.run(
        [sys.executable, "-m", "agent.node.rankexec", *args],
        cwd=cwd, env=environ, input=stdin, capture_output=True, timeout=120, check=False,
    )  # fmt: skip


def probe(tmp_path: Path, pool_path: str | None, *args: str) -> tuple[dict[str, object], bytes]:
    (tmp_path / "probe.py").write_text(PROBE)
    done = shim(
        ["probe.py", *args], tmp_path, pool_path=pool_path, stdin=b"a line\n",
        FOO="bar", OMP_NUM_THREADS="1",
    )  # fmt: skip
    assert done.returncode == (int(args[0]) if args else 0), done.stderr
    return json.loads(done.stdout.splitlines()[-1]), done.stderr


def test_a_warm_worker_sees_what_a_cold_one_sees_and_torch_was_imported_before_it(
    pool: tuple[subprocess.Popen[bytes], str], tmp_path: Path
) -> None:
    process, path = pool
    cold, cold_err = probe(tmp_path, None, "3")
    warm, warm_err = probe(tmp_path, path, "3")
    assert (cold["preloaded"], warm["preloaded"]) == (False, True)
    # Nor does a warm rank's first optimizer import torch's compiler (a second of CPU).
    assert (cold["compiler"], warm["compiler"]) == (False, True)
    assert warm["ppid"] == process.pid  # forked by the pool, not started by the shim
    for key in ("argv", "name", "file", "cwd", "path0", "foo", "stdin", "threads"):
        assert warm[key] == cold[key], key
    assert warm_err == cold_err == b"probe on stderr\nprobe's own format: logged\n"
    record = json.loads((tmp_path / "exits" / "rank-2.json").read_text())
    assert (record["exit_code"], record["pid"], record["warm"]) == (3, warm["pid"], True)
    assert record["stderr_tail"] == "probe on stderr\nprobe's own format: logged"
    assert warm_worker(tmp_path / "exits", "2") == warm["pid"]


def test_two_warm_workers_draw_different_random_numbers(
    pool: tuple[subprocess.Popen[bytes], str], tmp_path: Path
) -> None:
    first, _ = probe(tmp_path, pool[1])
    second, _ = probe(tmp_path, pool[1])
    assert first["preloaded"] and second["preloaded"]
    assert first["random"] != second["random"]
    assert first["numpy"] != second["numpy"]


@pytest.mark.parametrize(
    "code",
    [
        "raise ValueError('boom')",
        "import sys; sys.exit('a message')",
        "raise KeyboardInterrupt",
        "import os, signal; os.kill(os.getpid(), signal.SIGTERM)",
        "import threading, time, atexit\n"
        "atexit.register(lambda: print('atexit ran', flush=True))\n"
        "threading.Thread(target=lambda: (time.sleep(0.5), print('thread joined', flush=True)))"
        ".start()",
    ],
    ids=["exception", "exit-message", "keyboard-interrupt", "sigterm", "thread-and-atexit"],
)
def test_a_warm_worker_ends_as_a_cold_one_does(
    pool: tuple[subprocess.Popen[bytes], str], tmp_path: Path, code: str
) -> None:
    (tmp_path / "end.py").write_text(code + "\n")
    cold = shim(["end.py"], tmp_path, pool_path=None)
    warm = shim(["end.py"], tmp_path, pool_path=pool[1])
    assert warm.returncode == cold.returncode
    assert warm.stdout == cold.stdout
    assert warm.stderr == cold.stderr  # the traceback starts at the script, as a cold one's


def test_a_module_worker_runs_warm(
    pool: tuple[subprocess.Popen[bytes], str], tmp_path: Path
) -> None:
    (tmp_path / "probe_module.py").write_text(PROBE)
    done = shim(["--module", "probe_module", "4"], tmp_path, pool_path=pool[1], FOO="m")
    assert done.returncode == 4, done.stderr
    seen = json.loads(done.stdout.splitlines()[-1])
    assert (seen["preloaded"], seen["name"], seen["argv"][1:], seen["foo"]) == (
        True, "__main__", ["4"], "m"
    )  # fmt: skip


def test_a_worker_the_pool_cannot_serve_faithfully_starts_cold_and_says_why(
    pool: tuple[subprocess.Popen[bytes], str], tmp_path: Path
) -> None:
    (tmp_path / "probe.py").write_text(PROBE)
    done = shim(["probe.py"], tmp_path, pool_path=pool[1], PYTHONHASHSEED="7")
    assert done.returncode == 0
    assert json.loads(done.stdout.splitlines()[-1])["preloaded"] is False
    assert b"started cold: PYTHONHASHSEED is set differently" in done.stderr
    no_pool = shim(["probe.py"], tmp_path, pool_path=str(tmp_path / "none"))
    assert no_pool.returncode == 0 and b"started cold" not in no_pool.stderr


def start_sleeper(tmp_path: Path, path: str) -> tuple[subprocess.Popen[bytes], int]:
    (tmp_path / "sleep.py").write_text("import os, time\nprint(os.getpid(), flush=True)\n"
                                       "time.sleep(300)\n")  # fmt: skip
    environ = {**os.environ, "RESURGO_EXIT_DIR": str(tmp_path / "exits"), "RANK": "0",
               "RESURGO_WARM_SOCKET": path}  # fmt: skip
    shim_process = subprocess.Popen(
        [sys.executable, "-m", "agent.node.rankexec", "sleep.py"],
        cwd=tmp_path, env=environ, stdout=subprocess.PIPE,
    )  # fmt: skip
    assert shim_process.stdout is not None
    worker = int(shim_process.stdout.readline())
    return shim_process, worker


def gone_within(pid: int, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                return True
        except psutil.NoSuchProcess:
            return True
        time.sleep(0.05)
    return False


def test_a_warm_worker_dies_with_its_shim_and_its_shim_ends_as_it_did(
    pool: tuple[subprocess.Popen[bytes], str], tmp_path: Path
) -> None:
    shim_process, worker = start_sleeper(tmp_path, pool[1])
    shim_process.kill()  # as torchrun kills a worker group that outlived its grace
    shim_process.wait()
    assert gone_within(worker, 5), "the worker outlived its shim"
    shim_process, worker = start_sleeper(tmp_path, pool[1])
    os.kill(worker, signal.SIGKILL)  # a rank killed: its shim ends the same way
    assert shim_process.wait(timeout=30) == -signal.SIGKILL
    shim_process, worker = start_sleeper(tmp_path, pool[1])
    shim_process.send_signal(signal.SIGTERM)  # forwarded to the worker, as to a cold one
    assert shim_process.wait(timeout=30) == -signal.SIGTERM
    assert gone_within(worker, 5)


@contextlib.contextmanager
def light_pool(tmp: Path, job: str) -> Iterator[tuple[subprocess.Popen[bytes], str]]:
    """A pool that preloads nothing heavy, its sockets under ``tmp``."""
    log = (tmp / f"pool-{job}.log").open("wb")
    process = subprocess.Popen(
        [sys.executable, "-m", "agent.node.warmpool", "--job-id", job, "--node", "n1",
         "--preload", "json"],
        cwd=REPO, env={**os.environ, "TMPDIR": str(tmp)}, stdout=log, stderr=log,
    )  # fmt: skip
    path = socket_path(job, "n1", None, tmp=str(tmp))
    deadline = time.monotonic() + 60
    try:
        while not os.path.exists(path):
            assert time.monotonic() < deadline and process.poll() is None
            time.sleep(0.1)
        yield process, path
    finally:
        process.kill()
        process.wait()


def test_a_pool_says_on_its_output_that_it_listens_before_it_imports(tmp_path: Path) -> None:
    # The driver starts a launch's step only after this line from every node's pool. The
    # pool's one import waits for a file the test writes only once it has read the line.
    (tmp_path / "gate.py").write_text(
        "import os, time\n"
        f"while not os.path.exists({str(tmp_path / 'open')!r}):\n    time.sleep(0.05)\n"
    )
    job = f"l{os.getpid()}"
    environ = {**os.environ, "TMPDIR": str(tmp_path), "PYTHONPATH": f"{tmp_path}:{REPO}"}
    process = subprocess.Popen(
        [sys.executable, "-m", "agent.node.warmpool", "--job-id", job, "--node", "n1",
         "--preload", "gate"],
        cwd=REPO, env=environ, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
    )  # fmt: skip
    try:
        assert process.stdout is not None and process.stderr is not None
        said, _, _ = select.select([process.stdout], [], [], 60)
        assert said, "the pool said nothing while its imports waited"
        assert process.stdout.readline() == LISTENING + b" n1\n"
        assert os.path.exists(socket_path(job, "n1", None, tmp=str(tmp_path)))  # it listens
        (tmp_path / "open").touch()
        assert b"warm in" in process.stderr.readline()  # and imports after
    finally:
        process.kill()
        process.wait()


def test_the_workers_of_a_pool_that_dies_die_with_it(tmp_path: Path) -> None:
    with light_pool(tmp_path, f"d{os.getpid()}") as (process, path):
        shim_process, worker = start_sleeper(tmp_path, path)
        assert psutil.Process(worker).ppid() == process.pid
        process.kill()
        process.wait()
        assert gone_within(worker, 5), "the worker outlived its pool"
        assert shim_process.wait(timeout=30) == -signal.SIGKILL


def test_only_the_pools_own_user_is_served() -> None:
    base = Path(tempfile.mkdtemp(dir="/tmp", prefix="resurgo-warm-test-"))
    base.chmod(0o711)  # another user may pass through to the pool's directory, no further
    try:
        with light_pool(base, f"u{os.getpid()}") as (_, path):
            refused_to_nobody(path)
    finally:
        shutil.rmtree(base, ignore_errors=True)


def refused_to_nobody(path: str) -> None:
    directory = Path(path).parent
    assert directory.stat().st_mode & 0o777 == 0o700
    connect = (
        "import socket, sys\n"
        "s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)\n"
        "try:\n"
        "    s.connect(sys.argv[1])\n"
        "except PermissionError:\n"
        "    print('no entry'); raise SystemExit\n"
        "try:\n"
        "    socket.send_fds(s, [b'{}'], [0, 1, 2])\n"
        "    print('answer', s.recv(100))\n"
        "except OSError:\n"
        "    print('closed')\n"
    )
    nobody = dict(user=65534, group=65534, cwd="/", capture_output=True, timeout=60)
    # Debian's interpreter: the venv's may sit where another user cannot reach it.
    python = shutil.which("python3", path="/usr/bin:/bin") or "python3"
    run = [python, "-I", "-c", connect, path]
    assert subprocess.run(run, **nobody, check=True).stdout == b"no entry\n"  # type: ignore[call-overload]
    directory.chmod(0o755)  # the way in opened: the pool still refuses another user
    os.chmod(path, 0o777)
    done = subprocess.run(run, **nobody, check=True)  # type: ignore[call-overload]
    assert done.stdout in (b"closed\n", b"answer b''\n")  # closed unanswered


@dataclass
class WarmAgent:
    pool: subprocess.Popen[bytes]
    agent: RunningAgent
    job_dir: Path  # the job's secret, and what the pool describes beside it


@contextlib.contextmanager
def warm_agent(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[WarmAgent]:
    """A full pool and a real agent (the harness's job 77, two instrumented ranks under
    torchrun) asking it, with a job secret both know, as the driver starts them."""
    base = Path(tempfile.mkdtemp(dir="/tmp", prefix="resurgo-warm-agent-"))
    monkeypatch.setenv("TMPDIR", str(base))  # the agent's socket path and the pool's agree
    job_dir = base / "job"
    job_dir.mkdir()
    write_secret(job_dir / "secret", b"s" * 32)
    secret = ["--secret-file", str(job_dir / "secret")]
    try:
        with full_pool(base, "77", secret) as pool_process:
            agent = RunningAgent(tmp_path, ["--warm-pool", "true", *secret], ["--instrumented"])
            try:
                yield WarmAgent(pool_process, agent, job_dir)
            finally:
                agent.stop()
    finally:
        shutil.rmtree(base, ignore_errors=True)


def test_an_agents_torchrun_and_ranks_fork_from_the_pool_and_a_killed_rank_is_reported(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The agent asks the pool for its torchrun and the shims for their workers: every
    process of the launch but the shims is the pool's child, and a rank killed there is
    reported as a fresh one is (its pid, SIGKILL, within 2 s)."""
    with warm_agent(tmp_path, monkeypatch) as warm:
        agent = warm.agent
        pids = [int(agent.wait_file(f"pid.{rank}", 120)) for rank in (0, 1)]
        agent.wait_file("step.1")
        assert [psutil.Process(pid).ppid() for pid in pids] == [warm.pool.pid] * 2
        torchrun = [child for child in psutil.Process(warm.pool.pid).children()
                    if child.pid not in pids]  # fmt: skip
        assert len(torchrun) == 1  # the launch's one other process: its torchrun,
        shims = [child.cmdline()[1:3] for child in torchrun[0].children()]
        assert shims == [["-m", "agent.node.rankexec"]] * 2  # parent of the shims
        killed_at = time.time()
        os.kill(pids[1], signal.SIGKILL)
        event = agent.wait_event(EventKind.RANK_EXITED, 10)
        assert (event.payload["global_rank"], event.payload["pid"]) == (1, pids[1])
        assert event.payload["signal_name"] == "SIGKILL"
        assert event.payload["warm"] is True  # said in its exit, for the operator
        assert event.time_unix_s - killed_at < 2.0
        assert agent.wait_event(EventKind.LAUNCHER_EXITED, 30).payload["exit_code"] != 0


def test_an_agent_killed_with_its_step_takes_its_torchrun_shims_and_ranks_along(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Slurm ends a launch's step by killing what runs in it: the agent, not the pool's
    children. torchrun starts each shim in a session of its own, so the shims outlive a
    torchrun killed mid-stop; the pool kills a child's descendants with it, the shims'
    ends close and their ranks go too, as a cold launch's ranks go with its step."""
    with warm_agent(tmp_path, monkeypatch) as warm:
        pids = [int(warm.agent.wait_file(f"pid.{rank}", 120)) for rank in (0, 1)]
        warm.agent.wait_file("step.1")
        launch = psutil.Process(warm.pool.pid).children(recursive=True)
        assert len(launch) == 5  # torchrun, its two shims, the two ranks
        warm.agent.process.kill()  # as Slurm kills the step's processes
        warm.agent.process.wait()
        left = [p.pid for p in launch if not gone_within(p.pid, 10)]
        assert left == [], f"outlived the agent: {left} (ranks {pids})"


def test_the_first_launchs_agent_imports_no_torch_its_pool_describes_torchrun(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """torchrun's parser (to fit the command to the job) is described by the pool, which
    imported torch anyway, beside the job's secret; the agent waits for it and never
    loads libtorch (two seconds of CPU on every node of a first launch)."""
    with warm_agent(tmp_path, monkeypatch) as warm:
        warm.agent.wait_file("step.1", 120)
        maps = Path(f"/proc/{warm.agent.process.pid}/maps").read_text()
        assert "libtorch" not in maps, "the agent imported torch"
        assert list(warm.job_dir.glob("torchrun-options-*.json")), "nothing described"


@contextlib.contextmanager
def full_pool(tmp: Path, job: str, extra: Sequence[str] = ()) -> Iterator[subprocess.Popen[bytes]]:
    """The pool as the driver starts it (torch preloaded, the bootstrap first on
    ``PYTHONPATH`` as in the ranks), for job ``job`` on node1; ``extra``: its options."""
    log = (tmp / "pool.log").open("wb")
    pythonpath = with_bootstrap(os.environ.get("PYTHONPATH"))
    process = subprocess.Popen(
        [sys.executable, "-m", "agent.node.warmpool", "--job-id", job, "--node", "node1",
         *extra],
        cwd=REPO, env={**os.environ, "TMPDIR": str(tmp), "PYTHONPATH": pythonpath},
        stdout=log, stderr=log,
    )  # fmt: skip
    secret = extra[list(extra).index("--secret-file") + 1] if "--secret-file" in extra else None
    path = socket_path(job, "node1", secret, tmp=str(tmp))
    deadline = time.monotonic() + 120
    try:
        while not os.path.exists(path):
            assert process.poll() is None, (tmp / "pool.log").read_text()
            assert time.monotonic() < deadline, "the pool did not start serving within 120 s"
            time.sleep(0.1)
        yield process
    finally:
        process.kill()
        process.wait()


def test_a_warm_worker_is_torn_down_as_a_fresh_interpreter_is(
    pool: tuple[subprocess.Popen[bytes], str], tmp_path: Path
) -> None:
    """A file the script never closed is flushed and a module-level object's __del__ runs
    at its end, as the interpreter's teardown does them."""
    (tmp_path / "end.py").write_text(
        "f = open('unclosed.txt', 'w')\nf.write('kept')\n"
        "class Noisy:\n    def __del__(self):\n        print('del ran', flush=True)\n"
        "noisy = Noisy()\n"
    )
    results = []
    for pool_path in (None, pool[1]):
        done = shim(["end.py"], tmp_path, pool_path=pool_path)
        results.append((done.returncode, done.stdout, (tmp_path / "unclosed.txt").read_text()))
        (tmp_path / "unclosed.txt").unlink()
    assert results[0] == results[1] == (0, b"del ran\n", "kept")


def test_a_signal_slurm_sends_the_step_leaves_the_ranks_their_own_way_to_end(
    tmp_path: Path,
) -> None:
    """SIGUSR1 (a job's ``--signal=USR1@90``) leaves the pool serving; SIGTERM (a cancel, a
    time limit) stops its serving, but its running rank is not killed: it ends as it
    chooses, and the pool after it."""
    with light_pool(tmp_path, f"s{os.getpid()}") as (process, path):
        shim_process, worker = start_sleeper(tmp_path, path)
        process.send_signal(signal.SIGUSR1)
        time.sleep(0.5)
        assert process.poll() is None and psutil.Process(worker).is_running()
        process.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 10
        while os.path.exists(path) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not os.path.exists(path)  # no more requests taken
        time.sleep(0.5)
        assert psutil.Process(worker).status() != psutil.STATUS_ZOMBIE  # not killed
        assert process.poll() is None  # waits for its child
        os.kill(worker, signal.SIGTERM)  # the rank's own signal from Slurm
        assert shim_process.wait(timeout=30) == -signal.SIGTERM
        assert process.wait(timeout=30) == 0
