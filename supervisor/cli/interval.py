"""`resurgo interval`: the optimal checkpoint interval for a save cost and an MTBF.

    resurgo interval --save-stall-s 120 --mtbf-h 3
    resurgo interval --save-stall-s 8 --write-s 240 --mtbf-h 3 --json

``--save-stall-s`` is what one save blocks training for (the stall, with async
saves; ``resurgo ckpt list`` shows it per checkpoint under STALL, and the old
spelling ``--save-s`` still works); ``--write-s`` is how long the background
write then runs (default 0: a synchronous save). When even the best interval
spends the whole run saving or redoing lost work, there is no interval to
recommend: the command says so and what to change, and exits 1. The math lives
in :mod:`agent.checkpoint.interval`.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict
from typing import Any

from agent.checkpoint.interval import IntervalAdvice, advise
from supervisor.cli.common import BadInput, fail, fine_duration, number

_USAGE_ERROR = 2
_CANNOT_KEEP_UP = 1
# Bounds on the inputs: far beyond any real job (a save of 11 days, an MTBF of a
# century), near enough that no product or square root overflows or underflows.
_MOST_S = 1e6
_MOST_H = 1e6
# The first-order cost model's overhead at the best interval; at 100 % the run
# spends all its time saving and redoing lost work.
_NO_PROGRESS = 1.0


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
        "--save-stall-s",
        metavar="S",
        help="seconds one save blocks training (the stall, with async saves); required",
    )
    # The name before --save-stall-s (simulate's): scripts still use it.
    parser.add_argument("--save-s", dest="save_stall_s", help=argparse.SUPPRESS)
    parser.add_argument(
        "--mtbf-h",
        metavar="H",
        help="mean time between failures of the whole job, in hours; required",
    )
    parser.add_argument(
        "--write-s",
        default="0",
        metavar="W",
        help="seconds the background write runs after the stall (async saves; default 0)",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.set_defaults(func=run)


def _human(advice: IntervalAdvice) -> str:
    lines = [
        f"save stall {advice.stall_s:g} s, background write {advice.background_write_s:g} s, "
        f"MTBF {advice.mtbf_s / 3600:g} h",
        f"Young        {fine_duration(advice.young_s)}, "
        f"expected overhead {advice.young_overhead:.1%}",
        f"Daly         {fine_duration(advice.daly_s)}, "
        f"expected overhead {advice.daly_overhead:.1%}",
        f"recommended  {fine_duration(advice.recommended_s)}, "
        f"expected overhead {advice.recommended_overhead:.1%}",
    ]
    return "\n".join(lines)


def _share(overhead: float) -> str:
    """An overhead of 100 % or more, without absurd digits."""
    return "over 1000%" if overhead > 10 else f"{overhead:.0%}"


def cannot_keep_up(advice: IntervalAdvice) -> str | None:
    """Why no interval works for ``advice``'s inputs, and what to change; None when one does."""
    if advice.recommended_overhead < _NO_PROGRESS:
        return None
    return (
        f"checkpointing cannot keep up: a {advice.stall_s:g} s save against a job MTBF of "
        f"{advice.mtbf_s / 3600:g} h leaves no time to train at any interval (expected "
        f"overhead {_share(advice.recommended_overhead)}); make saves cheaper (async saves "
        "stall only for the copy to host memory: --save-stall-s is that stall, --write-s "
        "the write) or failures rarer (fewer nodes, hot spares: resurgo submit --spares)"
    )


def run(args: argparse.Namespace) -> int:
    """Print the advice; 2 on bad input, 1 when no interval works, else 0."""
    # Values are parsed here rather than by argparse so that bad input gives one
    # line naming the flag, not argparse's usage block.
    try:
        for flag, value in (("--save-stall-s", args.save_stall_s), ("--mtbf-h", args.mtbf_h)):
            if value is None:
                raise BadInput(f"{flag} is required: resurgo interval --save-stall-s S --mtbf-h H")
        save_s = number("--save-stall-s", args.save_stall_s, positive=True, most=_MOST_S)
        mtbf_h = number("--mtbf-h", args.mtbf_h, positive=True, most=_MOST_H)
        write_s = number("--write-s", args.write_s, positive=False, most=_MOST_S)
        advice = advise(save_s, mtbf_h * 3600.0, write_s)
    except (BadInput, ValueError) as error:
        return fail("interval", str(error), _USAGE_ERROR)
    problem = cannot_keep_up(advice)
    if problem is not None:
        return fail("interval", problem, _CANNOT_KEEP_UP)
    if args.json:
        print(json.dumps(asdict(advice), sort_keys=True))
    else:
        print(_human(advice))
    return 0
