"""`resurgo events JOB [--json] [--stacks] [--steps]`: what happened to a job, when and why.

One line per agent event, supervisor observation, decision (with its
explanation, its cause and the failure class and rule it names) and action;
a run of identical lines in a row (the same kind, node and summary, e.g. a
driver asking every 2 s) is printed once, with its count and the time of the
last. Stack dumps of hang reports are collapsed to one
line per rank; ``--stacks`` prints them in full. ``--json`` prints
:func:`supervisor.views.documents.events`.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

from supervisor.cli.common import add_state_dir, fail, open_store, print_json
from supervisor.errors import StoreError
from supervisor.text import one_line
from supervisor.views import documents as views


def register(subparsers: Any) -> None:
    """Add the `events` subcommand."""
    parser: argparse.ArgumentParser = subparsers.add_parser(
        "events",
        help="a job's timeline: events, decisions and actions, with stack dumps",
        description="What happened to one job, when and why: each agent event, supervisor "
        "observation, decision (with its explanation) and action on a line; a run of "
        "identical lines is printed once with its count. Stack dumps of hang reports show "
        "one line per rank unless --stacks.",
    )
    parser.add_argument("job", metavar="JOB")
    parser.add_argument("--json", action="store_true", help="the documented JSON document")
    parser.add_argument("--stacks", action="store_true", help="print stack dumps in full")
    parser.add_argument("--steps", action="store_true", help="include per-step loss reports")
    add_state_dir(parser)
    parser.set_defaults(func=run)


def _stamp(time_s: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(time_s))


def runs(entries: list[dict[str, Any]]) -> list[tuple[dict[str, Any], int, float]]:
    """Entries with each run of identical ones in a row folded into its first:
    ``(entry, count, time of the last)``. Entries with stacks are never folded."""
    folded: list[tuple[dict[str, Any], int, float]] = []
    for entry in entries:
        key = (entry["type"], entry["kind"], entry["node"], entry["summary"], entry.get("cause"))
        if folded and not entry["stacks"]:
            first, count, _ = folded[-1]
            same = (first["type"], first["kind"], first["node"], first["summary"],
                    first.get("cause"))  # fmt: skip
            if same == key and not first["stacks"]:
                folded[-1] = (first, count + 1, entry["time_s"])
                continue
        folded.append((entry, 1, entry["time_s"]))
    return folded


def render(document: dict[str, Any], *, full_stacks: bool) -> str:
    """The events as lines: time, what, where, summary; stacks collapsed or in full."""
    lines = []
    for entry, count, last_s in runs(document["entries"]):
        stamp = _stamp(entry["time_s"])
        where = entry["node"] or "-"
        what = entry["kind"] if entry["type"] == "event" else f"{entry['type']} {entry['kind']}"
        cause = _cause(entry)
        summary = one_line(str(entry["summary"]))
        again = f" ({count} times, the last at {_stamp(last_s)[11:]})" if count > 1 else ""
        lines.append(f"{stamp}  {one_line(what):<28} {one_line(where):<8} {summary}{cause}{again}")
        for rank, text in sorted(entry["stacks"].items(), key=_rank_order):
            # Only "\n" splits a dump; every other control character is shown escaped.
            stack = [one_line(line) for line in text.strip().split("\n")] if text.strip() else []
            if full_stacks:
                lines.append(f"    rank {one_line(rank)} stack:")
                lines.extend(f"      {line}" for line in stack)
            else:
                innermost = one_line(entry.get("innermost", {}).get(rank, ""))
                lines.append(
                    f"    rank {one_line(rank)}: {len(stack)} lines, innermost: {innermost[:100]}"
                )
    if not full_stacks and any(entry["stacks"] for entry in document["entries"]):
        lines.append("(stack dumps collapsed: --stacks prints them in full)")
    return "\n".join(lines) if lines else f"job {document['job_id']}: no events yet"


def _cause(entry: dict[str, Any]) -> str:
    """`` [user_exception; class network, rule collective-network]``, `` [oom; rule
    kernel-oom-kill]``: a decision's cause, and the failure class (where the cause does not
    say it) and rule its explanation names; nothing for an entry without a cause."""
    cause = entry.get("cause")
    if cause in (None, "none"):
        return ""
    failure = entry.get("failure")
    named = ""
    if failure:
        named = f"; rule {failure['rule']}"
        if failure["class"] != cause:
            named = f"; class {failure['class']}, rule {failure['rule']}"
    return f" [{one_line(str(cause) + named)}]"


def _rank_order(item: tuple[str, str]) -> tuple[int, str]:
    # Ranks are decimal strings; a stored row from before strict decoding may not be.
    rank = item[0]
    return (int(rank), rank) if rank.isdecimal() and rank.isascii() else (-1, rank)


def run(args: argparse.Namespace) -> int:
    """Print the job's events."""
    try:
        store = open_store(args.state_dir)
    except StoreError as error:
        return fail("events", str(error))
    with store:
        if store.get_job(args.job) is None:
            return fail(
                "events", f"job {args.job} is not known to the supervisor; see resurgo status"
            )
        document = views.events(store, args.job, include_steps=args.steps)
    if args.json:
        print_json(document)
    else:
        print(render(document, full_stacks=args.stacks))
    return 0
