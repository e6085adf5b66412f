"""`resurgo status [JOB...] [--json] [--watch]`: every supervised job at a glance.

Columns: id, name, state, world size now/original (and hot spares ready/asked
for, with the swaps so far), the newest step the job reported, restarts by
cause, failures by class (each recovery's root cause: ``oom 1, unknown 2``),
goodput, newest checkpoint step and age, nodes drained for the job. Read from
the supervisor's store, so it works while the supervisor is down (showing what
it last knew). ``--json`` prints :func:`supervisor.views.documents.status`.
"""

from __future__ import annotations

import argparse
import sys
import textwrap
import time
from collections.abc import Sequence
from typing import Any

from supervisor.cli.common import (
    add_state_dir,
    duration,
    fail,
    open_store,
    print_json,
    table,
    watch_seconds,
)
from supervisor.errors import StoreError
from supervisor.text import one_line
from supervisor.views import documents as views
from supervisor.views import words

HEADERS = (
    "JOB", "NAME", "STATE", "NODES", "STEP", "RESTARTS", "FAILURES", "GOODPUT", "CHECKPOINT",
    "DRAINED",
)  # fmt: skip
# A final reason longer than this is shortened at a word, with an ellipsis.
REASON_CHARS = 60
# An unknown job id is answered with the newest this many known ones.
KNOWN_SHOWN = 10


def register(subparsers: Any) -> None:
    """Add the `status` subcommand."""
    parser: argparse.ArgumentParser = subparsers.add_parser(
        "status",
        help="supervised jobs: state, size, restarts, failures, goodput, checkpoints",
        description="Every supervised job at a glance: state, world size (and hot spares), "
        "newest step, restarts by cause, failures by class, goodput, newest checkpoint and "
        "the nodes drained for it. Read from the supervisor's store, so it works while the "
        "supervisor is down (showing what it last knew).",
    )
    parser.add_argument("jobs", nargs="*", metavar="JOB", help="job ids (default: all)")
    parser.add_argument("--json", action="store_true", help="the documented JSON document")
    parser.add_argument("--watch", type=watch_seconds, nargs="?", const=2.0, metavar="S",
                        help="redraw every S seconds (default 2) until interrupted")  # fmt: skip
    add_state_dir(parser)
    parser.set_defaults(func=run)


def row_cells(job: dict[str, Any]) -> list[str]:
    """One table row of a status document's job."""
    size = job["world_size"]
    restarts = ", ".join(f"{cause} {count}" for cause, count in sorted(job["restarts"].items()))
    checkpoint = job["last_checkpoint"]
    return [
        one_line(job["job_id"]),
        one_line(job["name"]),
        job["state"] + (f" ({_shortened(job['final_reason'])})" if job["final_reason"] else ""),
        f"{size if size is not None else '-'}/{job['original_nodes']}" + _spares_cell(job),
        "-" if job.get("step") is None else str(job["step"]),
        (restarts or "-") + _skipped_cell(job),
        words.failures(job.get("failures", {})) if job.get("failures") else "-",
        f"{job['goodput'] * 100:.1f}%",
        "-" if checkpoint is None else _checkpoint_cell(checkpoint, job.get("ended_s")),
        one_line(",".join(job["drained_nodes"])) or "-",
    ]


def render(document: dict[str, Any], known: Sequence[str] = ()) -> str:
    """The status table, plus a line per unknown job id that names the ``known`` ones."""
    lines = [table(HEADERS, [row_cells(job) for job in document["jobs"]])]
    if not document["jobs"]:
        lines = [] if document["unknown"] else ["no supervised jobs"]
    lines.extend(f"job {job_id}: not known to the supervisor" for job_id in document["unknown"])
    if document["unknown"]:
        lines.append(_known_jobs(known))
    supervisor = document.get("supervisor")
    if supervisor is not None and supervisor.get("observe_only"):
        lines.append(
            "supervisor in observe-only mode: decisions are recorded, nothing is done "
            "(`resurgo events JOB` shows what it would have done)"
        )
    if supervisor is not None and supervisor["mode"] == "exclude":
        lines.append(one_line(f"supervisor in exclude mode: {supervisor['why']}"))
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    """Print the status once, or redraw it with ``--watch``."""
    try:
        store = open_store(args.state_dir)
    except StoreError as error:
        return fail("status", str(error))
    with store:
        while True:
            document = views.status(store, args.jobs, time.time())
            if args.json:
                print_json(document)
            else:
                if args.watch:
                    sys.stdout.write("\x1b[H\x1b[2J")  # clear the terminal, like watch(1)
                known = [row.job_id for row in store.list_jobs()] if document["unknown"] else []
                print(render(document, known), flush=True)
            if not args.watch:
                return 1 if document["unknown"] else 0
            try:
                time.sleep(args.watch)
            except KeyboardInterrupt:
                return 0


def _known_jobs(known: Sequence[str]) -> str:
    """Which jobs the store does know, the newest few: where an unknown id should point."""
    if not known:
        return "the supervisor knows no job yet (resurgo submit starts one under it)"
    shown = ", ".join(one_line(job_id) for job_id in known[-KNOWN_SHOWN:])
    more = f" and {len(known) - KNOWN_SHOWN} older" if len(known) > KNOWN_SHOWN else ""
    return f"known jobs: {shown}{more} (resurgo status lists them all)"


def _shortened(reason: str) -> str:
    """The reason on one line, cut at a word with an ellipsis when longer than the cell."""
    return textwrap.shorten(one_line(reason), REASON_CHARS, placeholder=" ...")


def _spares_cell(job: dict[str, Any]) -> str:
    """`` +1/2 spare``: hot spares ready now of those asked for (nothing without spares)."""
    wanted = job.get("spares_wanted", 0)
    if not wanted:
        return ""
    swaps = sum(job.get("swaps", {}).values())
    swapped = f", {words.plural(swaps, 'swap')}" if swaps else ""
    return f" +{len(job.get('spare_nodes', []))}/{wanted} spare{swapped}"


def _skipped_cell(job: dict[str, Any]) -> str:
    """``, 240 samples skipped``: the data rollbacks skipped (nothing when none)."""
    skipped = views.skipped_count(job.get("skipped_samples", []))
    return f", {skipped} samples skipped" if skipped else ""


def _checkpoint_cell(checkpoint: dict[str, Any], ended_s: float | None) -> str:
    """Step and age; a script's own file or DCP directory by its name (its step as
    counted or named, if known). An ended job's age is before its end: time since
    then says nothing about the job."""
    committed_s = checkpoint.get("committed_s")
    if ended_s is not None and committed_s is not None:
        age = f"{duration(max(0.0, ended_s - committed_s))} before the end"
    else:
        age = f"{duration(checkpoint['age_s'])} ago"
    if checkpoint.get("kind") != "resurgo":
        name = one_line(str(checkpoint["path"]).rsplit("/", 1)[-1])
        step = checkpoint.get("step")
        return f"{name} (step {step}, {age})" if step is not None else f"{name} ({age})"
    return f"{checkpoint['step']} ({age})"
