"""`resurgo report JOB -o report.html`: a self-contained HTML report with plots.

The timeline (step against time with checkpoints, faults, drains and
relaunches marked; world size over time), the goodput breakdown and the
event table, in one file with no external resources (see
:mod:`supervisor.views.report`).
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from supervisor.cli.common import add_state_dir, fail, open_store
from supervisor.errors import StoreError


def register(subparsers: Any) -> None:
    """Add the `report` subcommand."""
    parser: argparse.ArgumentParser = subparsers.add_parser(
        "report",
        help="a self-contained HTML report of one job, with plots",
        description="Write one HTML file about a job, with no external resources: its "
        "timeline (steps over time with checkpoints, faults, drains and relaunches marked; "
        "world size over time), the goodput breakdown and the event table.",
    )
    parser.add_argument("job", metavar="JOB")
    parser.add_argument("-o", "--output", type=Path, required=True, help="the HTML file to write")
    add_state_dir(parser)
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Write the report."""
    from supervisor.views.report import render  # matplotlib: loaded only by this command

    try:
        store = open_store(args.state_dir)
    except StoreError as error:
        return fail("report", str(error))
    with store:
        if store.get_job(args.job) is None:
            return fail(
                "report", f"job {args.job} is not known to the supervisor; see resurgo status"
            )
        text = render(store, args.job)
    try:
        # A lone surrogate stored from a request before strict decoding stays visible.
        args.output.write_text(text, encoding="utf-8", errors="backslashreplace")
    except OSError as error:
        return fail("report", f"cannot write {args.output}: {error.strerror}")
    print(f"report for job {args.job} written to {args.output}")
    return 0
