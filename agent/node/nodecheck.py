"""The supervisor's own check of a node one job blamed: a Slurm job of the supervisor's user.

Before a blame of one job drains a node, the supervisor runs this on the node
with ``sbatch``, once the blaming job has left it (:mod:`supervisor.act.node_checks`)::

    python -m agent.node.nodecheck [--timeout S] [--command COMMAND]

It runs what says something about the node itself, never about what nodes
share or about a job: the built-in GPU check (``nvidia-smi`` and the kernel's
Xid log, where there are GPUs) and the operator's command (e.g. ``nhc``),
concurrently, each bounded by ``--timeout``. It prints one line, :data:`MARK`
then JSON (the node, whether every check passed, each check's line), and
exits 0 when the node is healthy, 1 when not, 2 on bad flags. Slurm's record
of the exit status is the verdict; the line is the evidence a drain quotes.
No job's files or reports take part: the user whose job blamed the node has
no say in it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import subprocess
import sys
from collections.abc import Sequence

from agent.node.health import GateReport, command_report
from agent.node.healthchecks import GPUS, STUCK, bounded, check_gpus, gpus_needed

MARK = "resurgo-node-check "
DEFAULT_TIMEOUT_S = 120.0
# The verdict in the job's comment: short enough for any Slurm, long enough for the failures.
COMMENT_CHARS = 1000


async def check(command: str, timeout_s: float) -> GateReport:
    """The node's checks: the GPUs (all Slurm gave this job must be there) and ``command``."""
    gpus = bounded(
        GPUS, check_gpus(gpus_needed(os.environ, None), timeout_s, None), timeout_s, STUCK[GPUS]
    )
    if not command:
        return GateReport((await gpus,))
    builtin, operator = await asyncio.gather(gpus, command_report(command, timeout_s))
    return GateReport((builtin, *operator.results), operator.command)


def verdict_line(node: str, report: GateReport, limit: int | None = None) -> str:
    """The line the check prints: :data:`MARK` and the verdict as JSON. With ``limit``,
    a longer line keeps the failing checks only, each clipped to a share of it."""
    lines = report.lines()
    if limit is not None:
        failing = [line for line in lines if line.startswith("FAIL")] or lines[-1:]
        share = max(40, (limit - 100) // max(1, len(failing)))
        short = [line if len(line) <= share else line[: share - 3] + "..." for line in failing]
        whole = verdict_line(node, report)
        return whole if len(whole) <= limit else _line(node, report.healthy, short)
    return _line(node, report.healthy, lines)


def _line(node: str, healthy: bool, lines: list[str]) -> str:
    document = {"node": node, "healthy": healthy, "lines": lines}
    return MARK + json.dumps(document, separators=(",", ":"))


def parse_verdict(output: str, node: str) -> tuple[bool, str] | None:
    """(healthy, the failing lines or every line) from the check's output for ``node``;
    None when no well-formed line for it is there."""
    for line in reversed(output.splitlines()):
        start = line.find(MARK)
        if start < 0:
            continue
        try:
            document = json.loads(line[start + len(MARK) :])
            healthy, lines = document["healthy"], document["lines"]
        except (ValueError, KeyError, TypeError):
            continue
        if document.get("node") != node or not isinstance(healthy, bool):
            continue
        if not isinstance(lines, list):
            continue
        texts = [str(text) for text in lines]
        failing = [text for text in texts if text.startswith("FAIL")]
        return healthy, "; ".join(failing or texts)
    return None


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point: run the checks once, print the verdict; 0 healthy, 1 not, 2 bad flags."""
    parser = argparse.ArgumentParser(prog="python -m agent.node.nodecheck")
    parser.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT_S)
    parser.add_argument("--command", default="", help="the operator's health check")
    parser.add_argument(
        "--comment",
        action="store_true",
        help="also write the verdict into this Slurm job's comment",
    )
    args = parser.parse_args(list(sys.argv[1:] if argv is None else argv))
    if not args.timeout > 0:
        parser.error("--timeout must be > 0")
    node = os.environ.get("SLURMD_NODENAME") or socket.gethostname()
    report = asyncio.run(check(args.command, args.timeout))
    print(verdict_line(node, report), flush=True)
    if args.comment:
        write_comment(verdict_line(node, report, COMMENT_CHARS))
    return 0 if report.healthy else 1


def write_comment(line: str) -> None:
    """Put ``line`` in this Slurm job's comment: ``squeue`` shows it to the supervisor, which
    may share no file system with this node. A failure costs the words, not the verdict:
    the exit status carries that."""
    job_id = os.environ.get("SLURM_JOB_ID", "")
    if not job_id.isdigit():
        return
    try:
        subprocess.run(
            ["scontrol", "update", f"jobid={job_id}", f"comment={line}"],
            timeout=30, check=False, capture_output=True,
        )  # fmt: skip
    except (OSError, subprocess.SubprocessError) as error:
        print(f"resurgo-node-check: the verdict was not written to the job's comment: {error}")


if __name__ == "__main__":
    sys.exit(main())
