"""`resurgo interval`: the optimal checkpoint interval for a save cost and an MTBF.

    resurgo interval --save-s 120 --mtbf-h 3
    resurgo interval --save-s 8 --write-s 240 --mtbf-h 3 --json

``--save-s`` is what one save blocks training for (the stall, with async saves);
``--write-s`` is how long the background write then runs (default 0: a
synchronous save). The math lives in :mod:`agent.checkpoint.interval`.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict
from typing import Any

from agent.checkpoint.interval import IntervalAdvice, advise
from supervisor.cli.common import BadInput, number

_USAGE_ERROR = 2


def register(subparsers: Any) -> None:
    """Add the `interval` subcommand to `subparsers`."""
    parser: argparse.ArgumentParser = subparsers.add_parser(
        "interval",
        help="optimal checkpoint interval (Young and Daly) for a save cost and an MTBF",
        description=(
            "Print Young's and Daly's optimal checkpoint intervals and the expected "
            "overhead (time saving plus work lost to failures) at each."
        ),
    )
    parser.add_argument(
        "--save-s",
        required=True,
        metavar="S",
        help="seconds one save blocks training (the stall, with async saves)",
    )
    parser.add_argument(
        "--mtbf-h",
        required=True,
        metavar="H",
        help="mean time between failures of the whole job, in hours",
    )
    parser.add_argument(
        "--write-s",
        default="0",
        metavar="W",
        help="seconds the background write runs after the stall (async saves; default 0)",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.set_defaults(func=run)


def _minutes(seconds: float) -> str:
    return f"{seconds / 60:.1f} min ({seconds:.0f} s)"


def _human(advice: IntervalAdvice) -> str:
    lines = [
        f"save stall {advice.stall_s:g} s, background write {advice.background_write_s:g} s, "
        f"MTBF {advice.mtbf_s / 3600:g} h",
        f"Young        {_minutes(advice.young_s)}, expected overhead {advice.young_overhead:.1%}",
        f"Daly         {_minutes(advice.daly_s)}, expected overhead {advice.daly_overhead:.1%}",
        f"recommended  {_minutes(advice.recommended_s)}, "
        f"expected overhead {advice.recommended_overhead:.1%}",
    ]
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    """Print the advice for the parsed arguments; 2 on bad input, else 0."""
    # Values are parsed here rather than by argparse so that bad input gives one
    # line naming the flag, not argparse's usage block.
    try:
        save_s = number("--save-s", args.save_s, positive=False)
        mtbf_h = number("--mtbf-h", args.mtbf_h, positive=True)
        write_s = number("--write-s", args.write_s, positive=False)
        advice = advise(save_s, mtbf_h * 3600.0, write_s)
    except (BadInput, ValueError) as error:
        print(f"resurgo interval: {error}", file=sys.stderr)
        return _USAGE_ERROR
    if args.json:
        print(json.dumps(asdict(advice), sort_keys=True))
    else:
        print(_human(advice))
    return 0
