"""A child of the warm pool (:mod:`agent.node.warmpool`) becoming a rank.

What ``python SCRIPT ARGS...`` (or ``python -m MODULE ARGS...``) would have
set up, set up in the forked child of an interpreter that imported torch
already: the standard streams the shim passed, the working directory, the
environment (Python's and the C library's), ``sys.argv`` and the script's
directory first on ``sys.path``; Python's ``random`` and NumPy's global
generator reseeded as a fresh interpreter's are (each rank of a fork would
otherwise draw the same numbers); torch's thread count from
``OMP_NUM_THREADS``; Resurgo's rank hooks armed as the bootstrap arms them in
a fresh rank (:func:`agent.bootstrap.arm_rank`). Then the script runs from its
top as ``__main__``, and the child ends as the interpreter would: an uncaught
exception printed and status 1, ``SystemExit``'s code, a ``KeyboardInterrupt``
as SIGINT; non-daemon threads joined and ``atexit`` handlers run first.
"""

from __future__ import annotations

import atexit
import contextlib
import importlib.machinery
import io
import os
import random
import runpy
import signal
import sys
import threading
import types
from collections.abc import Callable, Mapping, Sequence

# torchrun sets it for its workers; applied here (torch.set_num_threads), since the pool's
# OpenMP runtime read its own at torch's import.
ENV_THREADS = "OMP_NUM_THREADS"
# Frames of the child's own start, left out of a script's traceback.
_OURS = frozenset({__file__, runpy.__file__, "<frozen runpy>"})


def become_rank(
    request: dict[str, object], fds: Sequence[int], set_by_imports: Mapping[str, str]
) -> None:
    """Set this process up as the worker of ``request`` and run it; raises the SystemExit
    the process ends with.
    ``set_by_imports``: what the pool's imports put in its environment."""
    argv = [str(word) for word in request["argv"]]  # type: ignore[attr-defined]
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
        os.close(fd)
    with contextlib.suppress(Exception):  # line-buffered on a terminal, as at a start
        sys.stdout.reconfigure(line_buffering=sys.stdout.isatty())  # type: ignore[union-attr]
    os.chdir(str(request["cwd"]))
    env = request["env"]
    assert isinstance(env, dict)
    os.environ.clear()
    os.environ.update({**set_by_imports, **{str(name): str(value) for name, value in env.items()}})
    _reseed()
    _threads()
    from agent.bootstrap import arm_rank

    if argv[0] == "-m":
        sys.argv = [argv[1], *argv[2:]]  # runpy puts the module's path first
        sys.path[0] = os.getcwd()
        module = argv[1]
        run: Callable[[], object] = lambda: runpy.run_module(  # noqa: E731
            module, run_name="__main__", alter_sys=True
        )
    else:
        sys.argv = list(argv)
        script = os.path.abspath(argv[0])  # __main__.__file__ is absolute, as in python 3.9+
        sys.path[0] = os.path.dirname(script)
        run = lambda: _run_script(script)  # noqa: E731
    sys.orig_argv = [sys.executable, *argv]
    arm_rank()
    # Out through the pool's frames (which let go of nothing in a child) to the
    # interpreter's own exit: threads joined, atexit run, modules torn down (an unclosed
    # file flushed, a __del__ run), as at the end of a fresh interpreter.
    raise SystemExit(_run_as_main(run))


def _run_script(path: str) -> None:
    """Run the file at ``path`` as ``python path`` runs it: in a fresh ``__main__``
    (``sys.argv`` as given; runpy's ``run_path`` would make its first word the path)."""
    if not os.path.isfile(path):  # a directory or zip with a __main__.py
        runpy.run_path(path, run_name="__main__")
        return
    main = types.ModuleType("__main__")
    main.__file__ = path
    main.__dict__["__cached__"] = None
    main.__loader__ = importlib.machinery.SourceFileLoader("__main__", path)
    sys.modules["__main__"] = main
    with io.open_code(path) as source:
        code = compile(source.read(), path, "exec", dont_inherit=True)
    exec(code, main.__dict__)


def _reseed() -> None:
    random.seed()
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        with contextlib.suppress(Exception):
            numpy.random.seed()


def _threads() -> None:
    count = os.environ.get(ENV_THREADS, "")
    torch = sys.modules.get("torch")
    if torch is not None and count.isdigit() and int(count) > 0:
        with contextlib.suppress(Exception):
            torch.set_num_threads(int(count))


def _run_as_main(run: Callable[[], object]) -> int:
    """Run ``run`` as the interpreter runs a script; the exit status it would end with
    (its uncaught exception printed). A ``KeyboardInterrupt`` ends the process as the
    interpreter ends it: threads joined, ``atexit`` run, then SIGINT."""
    try:
        run()
    except SystemExit as exiting:
        return _exit_code(exiting.code)
    except KeyboardInterrupt as error:
        _print_uncaught(error)
        with contextlib.suppress(BaseException):
            threading._shutdown()  # type: ignore[attr-defined]  # joins non-daemon threads
        with contextlib.suppress(BaseException):
            atexit._run_exitfuncs()
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(BaseException):
                stream.flush()
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
        return 1
    except BaseException as error:
        _print_uncaught(error)
        return 1
    return 0


def _print_uncaught(error: BaseException) -> None:
    """``sys.excepthook`` as the interpreter calls it, the traceback starting where the
    script's does (this module's and runpy's frames left out, as in a fresh rank)."""
    traceback = error.__traceback__
    while traceback is not None and traceback.tb_frame.f_code.co_filename in _OURS:
        traceback = traceback.tb_next
    sys.excepthook(type(error), error.with_traceback(traceback), traceback)


def _exit_code(code: object) -> int:
    """The status ``sys.exit(code)`` ends an interpreter with (a message: printed, 1)."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    with contextlib.suppress(BaseException):
        print(code, file=sys.stderr)
    return 1
