"""The warm pool's pure parts (agent.node.warmpool): where its socket is, and what it
refuses to fork. The pool itself, forking real ranks: tests/integration/test_warmpool.py."""

from __future__ import annotations

import os
import sys
import threading
from pathlib import Path

from agent.node.warmpool import MAX_SOCKET_PATH, after_the_imports, socket_path, why_not_warm


def test_the_socket_path_is_the_same_for_pool_and_agent_and_differs_by_job_node_and_secret(
    tmp_path: Path,
) -> None:
    secret, other = tmp_path / "secret", tmp_path / "other"
    secret.write_bytes(b"s1")
    other.write_bytes(b"s2")
    path = socket_path("12", "node1", str(secret), tmp="/tmp")
    assert path == socket_path("12", "node1", str(secret), tmp="/tmp")
    assert path.startswith("/tmp/resurgo-warm-12-")
    assert len({
        path,
        socket_path("13", "node1", str(secret), tmp="/tmp"),
        socket_path("12", "node2", str(secret), tmp="/tmp"),
        socket_path("12", "node1", str(other), tmp="/tmp"),
    }) == 4  # fmt: skip


def test_a_temporary_directory_too_long_for_a_socket_address_gives_way_to_tmp() -> None:
    long = "/scratch/" + "x" * 120
    path = socket_path("12", "node1", None, tmp=long)
    assert path.startswith("/tmp/resurgo-warm-12-")
    assert len(os.fsencode(path)) < MAX_SOCKET_PATH


def request(**changes: object) -> dict[str, object]:
    env = {key: value for key, value in os.environ.items()}
    return {"argv": ["train.py"], "cwd": "/", "env": env, "executable": sys.executable,
            **changes}  # fmt: skip


def test_the_pool_serves_a_script_or_a_module_under_its_own_interpreter_and_settings() -> None:
    # A pool runs one Python thread (this test process may run more: xdist's, others').
    assert why_not_warm(request(), dict(os.environ), python_threads=1) is None
    module = request(argv=["-m", "pkg.train", "--x"])
    assert why_not_warm(module, dict(os.environ), python_threads=1) is None
    # torchrun's own variables differ from the pool's: nothing read at the start
    extra = {**os.environ, "RANK": "3", "OMP_NUM_THREADS": "1", "TORCHELASTIC_RUN_ID": "j"}
    assert why_not_warm(request(env=extra), dict(os.environ), python_threads=1) is None


def test_the_pool_refuses_what_a_fork_would_not_start_faithfully() -> None:
    pool = {key: value for key, value in os.environ.items() if key != "PYTHONHASHSEED"}
    cases = {
        "another interpreter": request(executable="/usr/bin/python3.9"),
        "interpreter option -u": request(argv=["-u", "train.py"]),
        "no module to run": request(argv=["-m"]),
        "no script to run": request(argv=[]),
        "PYTHONHASHSEED is set differently": request(env={**pool, "PYTHONHASHSEED": "0"}),
        "LD_PRELOAD is set differently": request(env={**pool, "LD_PRELOAD": "libx.so"}),
        "TORCHINDUCTOR_CACHE_DIR is set differently": request(
            env={**pool, "TORCHINDUCTOR_CACHE_DIR": "/elsewhere"}
        ),
        "no environment": request(env=None),
    }
    for expected, refused in cases.items():
        why = why_not_warm(refused, pool, python_threads=1)
        assert why is not None and expected in why, (expected, why)


def test_the_pool_refuses_while_it_runs_a_python_thread() -> None:
    stop = threading.Event()
    thread = threading.Thread(target=stop.wait)
    thread.start()
    try:
        why = why_not_warm(request(), dict(os.environ))
    finally:
        stop.set()
        thread.join()
    assert why is not None and "threads" in why


def test_what_the_pools_imports_set_is_taken_as_a_fresh_interpreters_imports_would_set_it() -> None:
    pool = dict(os.environ)
    pool.pop("TORCHINDUCTOR_CACHE_DIR", None)
    imported = {"TORCHINDUCTOR_CACHE_DIR": "/tmp/torchinductor_user"}  # torch._dynamo's import
    # A rank that does not set it, or got the pool's from a launch forked there: served.
    for env in (pool, {**pool, **imported}):
        seen = after_the_imports(request(env=env), pool, imported)
        assert why_not_warm(*seen, python_threads=1) is None
    # A rank whose own environment sets it otherwise: a fresh import would use that one.
    elsewhere = {**pool, "TORCHINDUCTOR_CACHE_DIR": "/scratch/inductor"}
    why = why_not_warm(*after_the_imports(request(env=elsewhere), pool, imported), python_threads=1)
    assert why is not None and "TORCHINDUCTOR_CACHE_DIR" in why
