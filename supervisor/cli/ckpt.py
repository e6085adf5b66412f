"""``resurgo ckpt``: validate, pick and list checkpoints.

Commands and exit status (2 is a usage error, as in argparse)::

    resurgo ckpt validate DIR  [--level quick|full|load] [--trust-objects] [--json]
        0 valid, 1 invalid (the reason is printed), 2 DIR missing / not a directory
    resurgo ckpt newest ROOT   [--level quick|full|load] [--json]
        prints the newest valid checkpoint's path on stdout and, on stderr, why
        each newer one was rejected; 0 found, 1 none valid, 2 ROOT missing
    resurgo ckpt list ROOT     [--json]
        one row per step-N directory, newest first (COMMITTED "plain": a
        complete DCP save without Resurgo's manifest, e.g. a script's own
        dcp.save), then the script's own torch.save files (*.pt, *.pth,
        *.ckpt, ...); 0, or 2 ROOT missing

A script's own DCP saves into ``step-N`` folders (torchtitan's layout) are
checkpoints like Resurgo's, validated without the manifest's levels (see
:mod:`agent.checkpoint.validate`). A script that keeps its own ``torch.save``
checkpoint (no step-N folders) is served too (:mod:`agent.checkpoint.plain`):
``newest`` falls back to its files when no step-N checkpoint is valid, checked
for being complete and, at ``full`` and ``load``, test-loaded with
``torch.load(weights_only=True)``.

JSON output (``--json``; one document on stdout; keys are stable, enums by value):

- ``validate``: a report::

    {"path": str, "valid": bool, "level": "quick"|"full"|"load",
     "checked": [level...], "failed_level": level|null, "reason": str|null,
     "step": int|null, "has_manifest": bool, "skipped": [str...]}

- ``newest``: ``{"root": str, "newest": report|null, "rejected": [report...],
  "file": file|null, "rejected_files": [file...]}``, rejected newest first;
  ``file`` is the newest valid torch.save file when no step-N one is valid.
  A file::

    {"path": str, "total_bytes": int, "mtime_unix_s": float, "valid": bool,
     "loaded": bool, "step": int|null, "reason": str|null}

- ``list``: ``{"root": str, "filesystem": str, "warnings": [str...],
  "checkpoints": [row...], "files": [file...]}`` (files checked at quick;
  ``filesystem`` by statfs magic, e.g. "ext4",
  "nfs", "lustre"; ``warnings`` e.g. many ranks writing shards to NFS), each row::

    {"step": int, "path": str, "committed": bool, "has_manifest": bool,
     "valid_quick": bool, "quick_reason": str|null, "total_bytes": int, "mtime_unix_s": float,
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
    file, rejected_files = (None, []) if found is not None else _newest_file(args)
    if args.json:
        print_json(
            {
                "root": args.root,
                "newest": None if found is None else found.to_json_dict(),
                "rejected": [report.to_json_dict() for report in rejected],
                "file": None if file is None else file.to_json_dict(),
                "rejected_files": [bad.to_json_dict() for bad in rejected_files],
            }
        )
    else:
        for report in rejected:
            print(f"rejected: {_report_line(report)}", file=sys.stderr)
        for bad in rejected_files:
            print(f"rejected: {bad.path}: {bad.reason}", file=sys.stderr)
        if found is not None:
            print(found.path)
        elif file is not None:
            if file.reason:
                print(f"note: {file.path}: {file.reason}", file=sys.stderr)
            print(file.path)
        else:
            print(
                f"resurgo ckpt newest: no valid checkpoint under {args.root} at level {args.level}",
                file=sys.stderr,
            )
    return EXIT_OK if found is not None or file is not None else EXIT_INVALID


def _newest_file(args: argparse.Namespace) -> tuple[Any, list[Any]]:
    """The newest valid torch.save file under the root, and the newer ones rejected."""
    from agent.checkpoint.plain import check_plain, find_plain

    now_s = time.time()
    rejected: list[Any] = []
    for path in find_plain(args.root):
        checked = check_plain(path, now_s, load=args.level != "quick")
        if checked.valid:
            return checked, rejected
        rejected.append(checked)
    return None, rejected


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
    from agent.checkpoint.plain import check_plain, find_plain

    files = [check_plain(path, now_s, load=False) for path in find_plain(args.root)]
    if args.json:
        print_json(
            {
                "root": args.root,
                "filesystem": filesystem.value,
                "warnings": warnings,
                "checkpoints": rows,
                "files": [file.to_json_dict() for file in files],
            }
        )
    else:
        if rows or not files:
            print(_table(rows) if rows else f"no step-N checkpoints under {args.root}")
        if files:
            print(_files_table(files, now_s))
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
        "has_manifest": entry.has_manifest,
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
                _committed_cell(row),
                "yes" if row["valid_quick"] else "NO",
                size(row["total_bytes"]),
                duration(row["age_s"]),
                "-" if stats is None else f"{stats['stall_s']:.2f}s",
                "-" if stats is None else f"{stats['write_s']:.2f}s",
                "-" if throughput is None else f"{size(throughput)}/s",
            )
        )
    return table(cells[0], cells[1:], right=True)


def _committed_cell(row: dict[str, Any]) -> str:
    """yes / no for Resurgo's commit marker; "plain" for a complete DCP save that has no
    manifest (a script's own ``dcp.save``), which has no marker to have."""
    if row["committed"]:
        return "yes"
    return "plain" if row["valid_quick"] and not row["has_manifest"] else "no"


def _files_table(files: list[Any], now_s: float) -> str:
    """The script's own torch.save files (quick check: complete, not growing)."""
    cells = [
        (
            Path(file.path).name,
            size(file.total_bytes),
            duration(max(0.0, now_s - file.mtime_unix_s)),
            "yes" if file.valid else f"NO: {file.reason}",
        )
        for file in files
    ]
    return table(("TORCH.SAVE FILE", "SIZE", "AGE", "VALID(quick)"), cells)
