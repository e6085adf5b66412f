"""``resurgo ckpt``: validate, pick and list checkpoints.

Commands and exit status (2 is a usage error, as in argparse)::

    resurgo ckpt validate DIR  [--level quick|full|load] [--trust-objects] [--json]
        0 valid, 1 invalid (the reason is printed), 2 DIR missing / not a directory
    resurgo ckpt newest ROOT   [--level quick|full|load] [--json]
        prints the newest valid checkpoint's path on stdout and, on stderr, why
        each newer one was rejected; 0 found, 1 none valid, 2 ROOT missing
    resurgo ckpt list ROOT     [--json]
        one row per step-N directory, newest first; 0, or 2 ROOT missing

JSON output (``--json``; one document on stdout; keys are stable, enums by value):

- ``validate``: a report::

    {"path": str, "valid": bool, "level": "quick"|"full"|"load",
     "checked": [level...], "failed_level": level|null, "reason": str|null,
     "step": int|null, "has_manifest": bool, "skipped": [str...]}

- ``newest``: ``{"root": str, "newest": report|null, "rejected": [report...]}``,
  rejected newest first.
- ``list``: ``{"root": str, "filesystem": str, "warnings": [str...],
  "checkpoints": [row...]}`` (``filesystem`` by statfs magic, e.g. "ext4",
  "nfs", "lustre"; ``warnings`` e.g. many ranks writing shards to NFS), each row::

    {"step": int, "path": str, "committed": bool, "valid_quick": bool,
     "quick_reason": str|null, "total_bytes": int, "mtime_unix_s": float,
     "age_s": float, "stats": null | {"stall_s": float, "write_s": float,
     "total_bytes": int, "filesystem": str, "mode": str,
     "throughput_bytes_per_s": float|null}}
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from supervisor.cli.common import duration, print_json, size, table

if TYPE_CHECKING:
    from agent.checkpoint.catalog import Entry
    from agent.checkpoint.validate import Report

EXIT_OK = 0
EXIT_INVALID = 1
EXIT_USAGE = 2

# The values of agent.checkpoint.validate.Level (a test keeps them equal). The
# checkpoint modules import torch, which takes seconds: they are imported only
# when a ckpt command runs, so every other `resurgo` command starts fast.
LEVELS = ("quick", "full", "load")


def register(subparsers: Any) -> None:
    """Add the ``ckpt`` subcommand and its ``validate``, ``newest``, ``list`` commands."""
    parser: argparse.ArgumentParser = subparsers.add_parser(
        "ckpt",
        help="validate, pick and list checkpoints",
        description="Validate, pick and list Resurgo and plain DCP checkpoints.",
    )
    parser.set_defaults(func=lambda _args: _usage(parser))
    commands = parser.add_subparsers(dest="ckpt_command", metavar="COMMAND")

    check = commands.add_parser("validate", help="validate one checkpoint directory")
    check.add_argument("dir", metavar="DIR", help="a checkpoint directory (step-N/)")
    _add_level(check)
    check.add_argument(
        "--trust-objects",
        action="store_true",
        help="at --level load, also unpickle non-tensor items that reference Python "
        "classes; this runs code from the checkpoint: only for checkpoints you wrote",
    )
    check.add_argument("--json", action="store_true", help="print the report as JSON")
    check.set_defaults(func=_validate)

    newest = commands.add_parser("newest", help="print the newest valid checkpoint")
    newest.add_argument("root", metavar="ROOT", help="the directory holding step-N/ folders")
    _add_level(newest)
    newest.add_argument("--json", action="store_true", help="print the result as JSON")
    newest.set_defaults(func=_newest)

    listing = commands.add_parser("list", help="list checkpoints with size, age, save stats")
    listing.add_argument("root", metavar="ROOT", help="the directory holding step-N/ folders")
    listing.add_argument("--json", action="store_true", help="print the rows as JSON")
    listing.set_defaults(func=_list)


def _add_level(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--level",
        choices=LEVELS,
        default="full",
        help="quick: files, sizes, metadata; full: + checksums; load: + test-load "
        "every item, no NaN/Inf (default: full)",
    )


def _usage(parser: argparse.ArgumentParser) -> int:
    parser.print_help(sys.stderr)
    return EXIT_USAGE


def _missing_directory(command: str, path: str, what: str) -> int | None:
    if Path(path).is_dir():
        return None
    problem = "does not exist" if not Path(path).exists() else "is not a directory"
    print(f"resurgo ckpt {command}: {path} {problem}: pass {what}", file=sys.stderr)
    return EXIT_USAGE


def _validate(args: argparse.Namespace) -> int:
    usage = _missing_directory("validate", args.dir, "one checkpoint directory (step-N/)")
    if usage is not None:
        return usage
    from agent.checkpoint.validate import Level, validate

    report = validate(args.dir, Level(args.level), trust_pickled_objects=args.trust_objects)
    if args.json:
        print_json(report.to_json_dict())
    else:
        print(_report_line(report))
        for note in report.skipped:
            print(f"  note: {note}")
    return EXIT_OK if report.valid else EXIT_INVALID


def _newest(args: argparse.Namespace) -> int:
    usage = _missing_directory("newest", args.root, "the directory holding step-N/ folders")
    if usage is not None:
        return usage
    from agent.checkpoint.catalog import newest_valid
    from agent.checkpoint.validate import Level

    found, rejected = newest_valid(args.root, Level(args.level))
    if args.json:
        print_json(
            {
                "root": args.root,
                "newest": None if found is None else found.to_json_dict(),
                "rejected": [report.to_json_dict() for report in rejected],
            }
        )
    else:
        for report in rejected:
            print(f"rejected: {_report_line(report)}", file=sys.stderr)
        if found is None:
            print(
                f"resurgo ckpt newest: no valid checkpoint under {args.root} at level {args.level}",
                file=sys.stderr,
            )
        else:
            print(found.path)
    return EXIT_OK if found is not None else EXIT_INVALID


def _list(args: argparse.Namespace) -> int:
    usage = _missing_directory("list", args.root, "the directory holding step-N/ folders")
    if usage is not None:
        return usage
    from agent.checkpoint.catalog import list_checkpoints
    from agent.checkpoint.storage import filesystem_of
    from agent.checkpoint.validate import Level, validate

    now_s = time.time()
    reports = [(entry, validate(entry.path, Level.QUICK)) for entry in list_checkpoints(args.root)]
    rows = [_row(entry, report, now_s) for entry, report in reports]
    filesystem = filesystem_of(Path(args.root))
    warnings = _storage_warnings(filesystem, reports)
    if args.json:
        print_json(
            {
                "root": args.root,
                "filesystem": filesystem.value,
                "warnings": warnings,
                "checkpoints": rows,
            }
        )
    else:
        print(_table(rows) if rows else f"no step-N checkpoints under {args.root}")
        print(f"filesystem: {filesystem.value}")
        for warning in warnings:
            print(f"warning: {warning}")
    return EXIT_OK


def _storage_warnings(filesystem: Any, reports: list[tuple[Entry, Report]]) -> list[str]:
    """The storage warning for the newest checkpoint that recorded its save statistics."""
    from agent.checkpoint.storage import storage_warning

    for entry, report in reports:
        if entry.stats is None or report.manifest is None:
            continue
        write_s = entry.stats.write_s
        throughput = entry.stats.total_bytes / write_s if write_s > 0 else None
        warning = storage_warning(filesystem, report.manifest.world_size, throughput)
        return [] if warning is None else [warning]
    return []


def _report_line(report: Report) -> str:
    name = Path(report.path).name
    if report.valid:
        checked = ", ".join(level.value for level in report.checked)
        return f"valid: {report.path} (step {report.step}; checked {checked})"
    assert report.failed_level is not None
    return f"invalid at {report.failed_level.value}: {name}: {report.reason}"


def _row(entry: Entry, quick: Report, now_s: float) -> dict[str, Any]:
    stats: dict[str, Any] | None = None
    if entry.stats is not None:
        write_s = entry.stats.write_s
        stats = {
            "stall_s": entry.stats.stall_s,
            "write_s": write_s,
            "total_bytes": entry.stats.total_bytes,
            "filesystem": entry.stats.filesystem,
            "mode": entry.stats.mode,
            "throughput_bytes_per_s": entry.stats.total_bytes / write_s if write_s > 0 else None,
        }
    return {
        "step": entry.step,
        "path": entry.path,
        "committed": entry.committed,
        "valid_quick": quick.valid,
        "quick_reason": quick.reason,
        "total_bytes": entry.total_bytes,
        "mtime_unix_s": entry.mtime_s,
        "age_s": max(0.0, now_s - entry.mtime_s),
        "stats": stats,
    }


_COLUMNS = ("STEP", "COMMITTED", "VALID(quick)", "SIZE", "AGE", "STALL", "WRITE", "THROUGHPUT")


def _table(rows: list[dict[str, Any]]) -> str:
    cells = [_COLUMNS]
    for row in rows:
        stats = row["stats"]
        throughput = None if stats is None else stats["throughput_bytes_per_s"]
        cells.append(
            (
                str(row["step"]),
                "yes" if row["committed"] else "no",
                "yes" if row["valid_quick"] else "NO",
                size(row["total_bytes"]),
                duration(row["age_s"]),
                "-" if stats is None else f"{stats['stall_s']:.2f}s",
                "-" if stats is None else f"{stats['write_s']:.2f}s",
                "-" if throughput is None else f"{size(throughput)}/s",
            )
        )
    return table(cells[0], cells[1:], right=True)
