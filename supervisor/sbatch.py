"""What ``resurgo submit`` needs to know about sbatch options; pure.

The user's sbatch options pass through to ``sbatch`` unchanged, as argv (no
shell in between, so spaces, quotes and ``=`` arrive exactly as typed).
Resurgo reads only a few of them: the node count (``-N``/``--nodes``, a
``MIN-MAX`` range becomes the minimum size the job may shrink to), the job
name, whether the user set task counts, the time limit (for the warning
before it), a ``--signal`` of the user's own (only ``B:USR1@N`` reaches the
driver) and the output paths and ``--chdir`` (checked at submit); it refuses
job arrays and ``--no-requeue``. The same
reading applies to ``#SBATCH`` lines of a script given with ``--script``;
command-line options win over them, as in sbatch.
"""

from __future__ import annotations

import re
import shlex
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from agent.timelimit import parse_slurm_duration, warning_lead_s
from agent.wire.errors import ConfigError

_DIRECTIVE = re.compile(r"^#SBATCH\s+(.*)$")
_NODES = re.compile(r"^(\d+)(?:-(\d+))?$")

# Options Resurgo adds for supervision (the user's own settings of these win
# where it makes sense, see :func:`supervision_options`).


@dataclass(frozen=True)
class SbatchRequest:
    """The user's sbatch options (verbatim) and what Resurgo read from them."""

    options: tuple[str, ...]
    directives: tuple[str, ...]
    nodes: int
    min_nodes: int | None
    job_name: str | None
    sets_nodes: bool
    sets_tasks: bool
    sets_signal: bool
    sets_open_mode: bool = False
    # Tasks per node asked for (``--ntasks-per-node``, or ``--ntasks`` over the
    # nodes): the ranks per node of a per-rank command (srun-style, python train.py).
    tasks_per_node: int | None = None
    # ``-o``/``-e`` file patterns and ``-D``/``--chdir``, for checks at submit.
    output: str | None = None
    error: str | None = None
    chdir: str | None = None
    # ``--time``/``-t`` in seconds (None: the partition's limit); the lead of the
    # user's own ``--signal=...@N``, which then times the planned stop.
    time_limit_s: float | None = None
    signal_lead_s: float | None = None
    # ``-x``/``--exclude`` and ``-w``/``--nodelist`` as given (hostlists).
    exclude: str | None = None
    nodelist: str | None = None


def script_commands(script_text: str) -> list[str]:
    """The lines of a batch script that would run: not blank, not comments or ``#SBATCH``."""
    return [
        line.strip()
        for line in script_text.splitlines()
        if line.strip() and not line.strip().startswith("#")
    ]


def directives_of(script_text: str) -> tuple[str, ...]:
    """The options on a script's ``#SBATCH`` lines (up to the first command), shell-split."""
    found: list[str] = []
    for line in script_text.splitlines()[1:] if script_text.startswith("#!") else []:
        stripped = line.strip()
        if not stripped or (stripped.startswith("#") and not stripped.startswith("#SBATCH")):
            continue
        match = _DIRECTIVE.match(stripped)
        if match is None:
            break  # sbatch stops reading directives at the first command
        found.extend(shlex.split(match.group(1), comments=True))
    return tuple(found)


def _options(args: Sequence[str]) -> Iterator[tuple[str, str | None]]:
    """``(name, value)`` per option: ``--x=v``, ``--x v``, ``-Xv``, ``-X v``; value None for flags.

    A following word is taken as the value of a long or short option only
    when it does not start with ``-``, which is how sbatch's own parser reads
    the options Resurgo looks at.
    """
    index = 0
    while index < len(args):
        word = args[index]
        index += 1
        if word.startswith("--"):
            name, equals, value = word.partition("=")
            if equals:
                yield name, value
                continue
            if index < len(args) and not args[index].startswith("-"):
                yield name, args[index]
                index += 1
                continue
            yield name, None
        elif word.startswith("-") and len(word) >= 2:
            name = word[:2]
            if len(word) > 2:
                yield name, word[2:]
            elif index < len(args) and not args[index].startswith("-"):
                yield name, args[index]
                index += 1
            else:
                yield name, None
        else:
            yield word, None  # a stray word: sbatch will say what it thinks of it


def parse_request(options: Sequence[str], directives: Sequence[str] = ()) -> SbatchRequest:
    """Read ``options`` (command line) over ``directives`` (script); ConfigError when refused."""
    nodes: tuple[int, int | None] = (1, None)
    job_name: str | None = None
    sets_nodes = sets_tasks = sets_signal = sets_open_mode = False
    time_limit_s: float | None = None
    signal_lead_s: float | None = None
    per_node: str | None = None
    total: str | None = None
    paths: dict[str, str | None] = {}
    for name, value in [*_options(directives), *_options(options)]:
        if name in ("-a", "--array"):
            raise ConfigError(
                "job arrays are not supported: every array task would be a separate "
                "training run needing its own supervision; submit one job per task"
            )
        if name in ("-N", "--nodes"):
            nodes = _node_range(value)
            sets_nodes = True
        elif name in ("-J", "--job-name"):
            job_name = value
        elif name in ("-n", "--ntasks", "--ntasks-per-node"):
            sets_tasks = True
            if name == "--ntasks-per-node":
                per_node = value
            else:
                total = value
        elif name == "--signal":
            sets_signal = True
            signal_lead_s = _warning_lead(value or "")
        elif name == "--no-requeue":
            raise ConfigError(
                "--no-requeue: Resurgo requeues the job itself after a node fault or at its "
                "time limit, and its restart budget bounds how often; drop --no-requeue"
            )
        elif name in ("-o", "--output"):
            paths["output"] = value
        elif name in ("-e", "--error"):
            paths["error"] = value
        elif name in ("-D", "--chdir"):
            paths["chdir"] = value
        elif name in ("-x", "--exclude"):
            paths["exclude"] = value
        elif name in ("-w", "--nodelist"):
            paths["nodelist"] = value
        elif name in ("-t", "--time"):
            time_limit_s = parse_slurm_duration(value or "")
        elif name == "--open-mode":
            sets_open_mode = True
    maximum, minimum = nodes
    return SbatchRequest(
        tasks_per_node=_tasks_per_node(per_node, total, maximum),
        output=paths.get("output"),
        error=paths.get("error"),
        chdir=paths.get("chdir"),
        exclude=paths.get("exclude"),
        nodelist=paths.get("nodelist"),
        options=tuple(options),
        directives=tuple(directives),
        nodes=maximum,
        min_nodes=minimum,
        job_name=job_name,
        sets_nodes=sets_nodes,
        sets_tasks=sets_tasks,
        sets_signal=sets_signal,
        sets_open_mode=sets_open_mode,
        time_limit_s=time_limit_s,
        signal_lead_s=signal_lead_s,
    )


_USR1 = {"USR1", "SIGUSR1", "10"}


def _warning_lead(value: str) -> float | None:
    """The lead of a user's ``--signal``, which must reach the driver as the batch
    script's USR1 (``B:USR1@N``); ConfigError for any other signal or target."""
    flags, colon, rest = value.partition(":")
    if not colon:
        flags, rest = "", value
    name, _, lead = rest.partition("@")
    if "B" not in flags.upper() or name.upper() not in _USR1:
        raise ConfigError(
            f"--signal={value}: Resurgo's driver takes the time-limit warning as USR1 to the "
            "batch script and stops the ranks after a final checkpoint; another signal, or "
            "one sent to the steps, would kill the driver or the agents. Give "
            "--signal=B:USR1@SECONDS to choose the lead, or drop --signal"
        )
    return float(lead) if lead.isdigit() else None


def _tasks_per_node(per_node: str | None, total: str | None, nodes: int) -> int | None:
    if per_node is not None:
        return int(per_node) if per_node.isdigit() and int(per_node) > 0 else None
    if total is not None and total.isdigit() and int(total) > 0:
        if int(total) % nodes:
            raise ConfigError(
                f"--ntasks={total} does not split evenly over {nodes} nodes: give "
                "--ntasks-per-node, so that a smaller relaunch keeps the same ranks per node"
            )
        return int(total) // nodes
    return None


def _node_range(value: str | None) -> tuple[int, int | None]:
    """``4`` -> (4, None); ``2-4`` -> (4, 2)."""
    match = _NODES.match(value or "")
    if match is None:
        raise ConfigError(
            f"--nodes {value!r}: give a node count (e.g. --nodes=4) or a range "
            "(--nodes=2-4: start on 4, shrink down to 2 after faults)"
        )
    low = int(match.group(1))
    high = int(match.group(2)) if match.group(2) else None
    if high is None:
        return low, None
    if high < low:
        raise ConfigError(f"--nodes {value}: the range goes from fewer to more nodes")
    return high, low


def supervision_options(request: SbatchRequest) -> list[str]:
    """What Resurgo adds: requeue (it must be able to requeue the job), one task per node
    for the agents unless the user set task counts, a warning signal before the time
    limit (``USR1`` to the batch script: the driver stops the ranks gracefully), and
    appending to the output files (a requeue would otherwise truncate the log of every
    attempt before it)."""
    added = ["--requeue"]
    if not request.sets_open_mode:
        added.append("--open-mode=append")
    if not request.sets_tasks:
        added.append("--ntasks-per-node=1")
    if not request.sets_signal:
        # The lead for the limit asked for (a quarter of a short one at most); the
        # driver's own timer moves it earlier once a save has been measured.
        lead = int(warning_lead_s(request.time_limit_s))
        added.append(f"--signal=B:USR1@{lead}")
    return added


def procs_per_node(command: Sequence[str]) -> int | None:
    """torchrun's ``--nproc-per-node`` (any spelling) in the command, when it is a number."""
    for name, value in _options(command):
        if name in ("--nproc-per-node", "--nproc_per_node") and value and value.isdigit():
            return int(value)
    return None


def training_script(command: Sequence[str]) -> str | None:
    """The ``.py`` file the command runs (torchrun's or python's script argument), if any."""
    for word in command:
        if word.endswith(".py") and not word.startswith("-"):
            return word
    return None
