"""A torchrun below a wrapper script, fitted to the job like one given directly.

The agent runs a wrapper (``bash run.sh`` ending in ``exec torchrun ...``, a
Makefile, ``bash -c``) as it is. Without help, each node's torchrun would
start a world of its own. Two ways in, both landing in :func:`exec_fitted`,
which fits torchrun's arguments to the job exactly as a torchrun given to
``resurgo submit`` is fitted (the job's node count and rendezvous, no
in-place restarts, each worker under the rank shim:
:func:`agent.node.launch.fit_torchrun`) and replaces the process with the result:

- ``torchrun`` found on ``PATH``: the agent puts its own first
  (:func:`agent.node.launch.torchrun_shim`), which runs :func:`main`;
- ``python -m torch.distributed.run`` or a torchrun named by its full path:
  the bootstrap (``agent/bootstrap/sitecustomize.py``) calls
  :func:`refit_if_torchrun` at the start of every Python process under the
  agent, which reads how the process was started (``sys.orig_argv``).

:data:`ENV_FITTED` marks the fitted torchrun, so that it is not fitted again.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from pathlib import Path, PurePath

from agent.node.launch import (
    ENV_ALLOCATION,
    ENV_TORCHRUN_OPTIONS_DIR,
    allocation_from_env,
    fit_torchrun,
)
from agent.node.torchrun_options import torchrun_parser
from agent.wire.errors import ConfigError

ENV_FITTED = "RESURGO_TORCHRUN_FITTED"


def torchrun_args(orig_argv: Sequence[str]) -> list[str] | None:
    """torchrun's arguments when ``orig_argv`` started torchrun, else None."""
    words = list(orig_argv[1:])
    if len(words) >= 2 and words[0] == "-m" and words[1] == "torch.distributed.run":
        return words[2:]
    if words and PurePath(words[0]).name == "torchrun":
        return words[1:]
    return None


def exec_fitted(args: Sequence[str]) -> None:
    """Replace this process with torchrun ``args`` fitted to the job; SystemExit with what
    is wrong when they cannot be fitted."""
    options_dir = os.environ.get(ENV_TORCHRUN_OPTIONS_DIR)
    parser = torchrun_parser(Path(options_dir) if options_dir else None)
    try:
        allocation = allocation_from_env(os.environ)
        argv, _ = fit_torchrun(["torchrun", *args], allocation, sys.executable, parser)
    except ConfigError as error:
        raise SystemExit(f"resurgo: torchrun: {error}") from None
    sys.stdout.flush()
    os.execve(argv[0], list(argv), {**os.environ, ENV_FITTED: "1"})


def refit_if_torchrun() -> None:
    """Called by the bootstrap: a torchrun below a wrapper is fitted before it starts."""
    if ENV_ALLOCATION not in os.environ or os.environ.get(ENV_FITTED):
        return
    args = torchrun_args(sys.orig_argv)
    if args is not None and not any(arg in ("-h", "--help") for arg in args):
        exec_fitted(args)


def main(args: Sequence[str]) -> None:
    if any(arg in ("-h", "--help") for arg in args[:1]):
        os.execv(sys.executable, [sys.executable, "-m", "torch.distributed.run", *args])
    exec_fitted(args)


if __name__ == "__main__":
    main(sys.argv[1:])
