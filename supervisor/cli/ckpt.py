"""``resurgo ckpt``: validate, pick and list checkpoints.

Commands and exit status (2 is a usage error, as in argparse)::

    resurgo ckpt validate CKPT [--level quick|full|load] [--trust-objects] [--json]
        0 valid, 1 invalid (the reason is printed), 2 CKPT missing
    resurgo ckpt newest ROOT   [--level quick|full|load] [--json]
        prints the newest valid checkpoint's path on stdout and, on stderr, why
        each newer one was rejected; 0 found, 1 none valid, 2 ROOT missing
    resurgo ckpt list ROOT     [--level quick|full|load] [--json]
        one row per checkpoint, newest first, of every layout: Resurgo's and
        plain DCP step-N/ (COMMITTED "plain": a complete DCP save without
        Resurgo's manifest), Hugging Face checkpoint-N/, DeepSpeed
        global_stepN/, Lightning *.ckpt, a torch.save file; 0, or 2 ROOT missing.
        VALID is checked as ``newest`` checks: at --level (default full),
        newest first, down to the first valid checkpoint, which is the one
        ``newest`` prints; so ``list`` and ``newest`` never disagree. Older
        rows get the quick check only (reading every byte of every old
        checkpoint could take hours): VALID says ``unchecked`` when they pass
        it, as a flipped byte passes a quick check, and ``NO`` when they fail
        it. WHY says why a row is invalid.
    resurgo ckpt quarantined ROOT [--json]
        the checkpoints moved into ROOT/.resurgo-quarantine/ because they failed
        validation before a relaunch (:mod:`agent.checkpoint.quarantine`)
    resurgo ckpt release ROOT NAME
        moves one back to where it was; 0, 1 nothing by that name held or its
        place taken again (the message says what to do)

Each layout is found and validated by its module in
:mod:`agent.checkpoint.layouts`; a directory no layout names is taken for a
DCP checkpoint.

JSON output (``--json``; one document on stdout; keys are stable, enums by value):

- ``validate``: a report::

    {"path": str, "valid": bool, "level": "quick"|"full"|"load",
     "checked": [level...], "failed_level": level|null, "reason": str|null,
     "step": int|null, "has_manifest": bool, "skipped": [str...]}

- ``newest``: ``{"root": str, "newest": report|null, "rejected": [report...]}``,
  rejected newest first.

- ``list``: ``{"root": str, "level": level, "filesystem": str, "warnings": [str...],
  "checkpoints": [row...]}`` (``filesystem`` by statfs magic, e.g. "ext4",
  "nfs", "lustre"; ``warnings`` e.g. many ranks writing shards to NFS), each row::

    {"name": str, "layout": "resurgo"|"dcp"|"huggingface"|"deepspeed"|"lightning"|
     "torch_save", "step": int|null, "path": str, "committed": bool, "has_manifest": bool,
     "valid": bool|null (null: unchecked, passed the quick check only),
     "checked_level": level, "reason": str|null, "newest_valid": bool,
     "valid_quick": bool, "quick_reason": str|null, "total_bytes": int, "mtime_unix_s": float,
     "age_s": float, "stats": null | {"stall_s": float, "write_s": float,
     "total_bytes": int, "filesystem": str, "mode": str,
     "throughput_bytes_per_s": float|null}}
"""

from __future__ import annotations

import argparse
import re
import sys
import textwrap
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from supervisor.cli.common import duration, print_json, table
from supervisor.text import one_line
from supervisor.views.words import seconds, size

if TYPE_CHECKING:
    from agent.checkpoint.catalog import Entry
    from agent.checkpoint.layouts import Found
    from agent.checkpoint.report import Report

EXIT_OK = 0
EXIT_INVALID = 1
EXIT_USAGE = 2

# The values of agent.checkpoint.validate.Level (a test keeps them equal). The
# checkpoint modules import torch, which takes seconds: they are imported only
# when a ckpt command runs, so every other `resurgo` command starts fast.
LEVELS = ("quick", "full", "load")
# A rejection reason longer than this is shortened at a word in the list's WHY column
# (the last, so a long one runs off to the right rather than pushing columns apart);
# `--json` has it whole.
WHY_CHARS = 160
# A checksum's hex digest, kept to its first 8 digits in the WHY column: enough to
# tell two apart by eye.
_DIGEST = re.compile(r"\b([0-9a-f]{8})[0-9a-f]{16,}\b")


def register(subparsers: Any) -> None:
    """Add the ``ckpt`` subcommand and its commands (see the module docstring)."""
    parser: argparse.ArgumentParser = subparsers.add_parser(
        "ckpt",
        help="validate, pick and list checkpoints",
        description="Validate, pick and list checkpoints: Resurgo's, plain DCP, Hugging Face, "
        "DeepSpeed, Lightning and torch.save files.",
    )
    parser.set_defaults(
        func=lambda _args: parser.error(
            "which command? validate, newest, list, quarantined or release (--help says more)"
        )
    )
    commands = parser.add_subparsers(dest="ckpt_command", metavar="COMMAND")

    check = commands.add_parser(
        "validate",
        help="validate one checkpoint",
        description="Validate one checkpoint and print why it is invalid, if it is. Exit "
        "status 0: valid; 1: invalid; 2: no such checkpoint.",
    )
    check.add_argument(
        "dir", metavar="CKPT", help="a checkpoint: step-N/, checkpoint-N/, a .ckpt or .pt file"
    )
    _add_level(check)
    check.add_argument(
        "--trust-objects",
        action="store_true",
        help="at --level load, also unpickle non-tensor items that reference Python "
        "classes; this runs code from the checkpoint: only for checkpoints you wrote",
    )
    check.add_argument("--json", action="store_true", help="print the report as JSON")
    check.set_defaults(func=_validate)

    newest = commands.add_parser(
        "newest",
        help="print the newest valid checkpoint",
        description="Print the path of the newest checkpoint under a root that passes "
        "validation, and on stderr why each newer one was rejected. Exit status 0: found; "
        "1: none valid; 2: no such root.",
    )
    newest.add_argument("root", metavar="ROOT", help="the checkpoint root")
    _add_level(newest)
    newest.add_argument("--json", action="store_true", help="print the result as JSON")
    newest.set_defaults(func=_newest)

    listing = commands.add_parser(
        "list",
        help="list checkpoints with validity, size, age, save stats",
        description="List the checkpoints under a root, newest first, of every layout, with "
        "their validity (the newest checked as `ckpt newest` checks, older ones quickly), size, "
        "age and save statistics; and the filesystem they are on, with a warning where it "
        "suits checkpoints badly.",
    )
    listing.add_argument("root", metavar="ROOT", help="the checkpoint root")
    _add_level(listing)
    listing.add_argument("--json", action="store_true", help="print the rows as JSON")
    listing.set_defaults(func=_list)

    held = commands.add_parser(
        "quarantined",
        help="list the checkpoints moved into quarantine under a root",
        description="List the checkpoints moved into ROOT/.resurgo-quarantine/ because they "
        "failed validation before a relaunch, with where each was.",
    )
    held.add_argument("root", metavar="ROOT", help="the checkpoint root")
    held.add_argument("--json", action="store_true", help="print the moves as JSON")
    held.set_defaults(func=_quarantined)

    back = commands.add_parser(
        "release",
        help="move a quarantined checkpoint back",
        description="Move a quarantined checkpoint back to where it was, so that a resume may "
        "pick it again. Exit status 1: nothing by that name is held, or its place is taken "
        "(the message says what to do).",
    )
    back.add_argument("root", metavar="ROOT", help="the checkpoint root")
    back.add_argument("name", metavar="NAME", help="its name before the move (checkpoint-40)")
    back.set_defaults(func=_release)


def _add_level(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--level",
        choices=LEVELS,
        default="full",
        help="quick: files, sizes, metadata; full: + checksums; load: + test-load "
        "every item, no NaN/Inf (default: full)",
    )


def _missing_directory(command: str, path: str, what: str) -> int | None:
    if Path(path).is_dir():
        return None
    problem = "does not exist" if not Path(path).exists() else "is not a directory"
    print(f"resurgo ckpt {command}: {path} {problem}: pass {what}", file=sys.stderr)
    return EXIT_USAGE


def _validate(args: argparse.Namespace) -> int:
    if not Path(args.dir).exists():
        what = "a step-N/ or checkpoint-N/ directory, or a .ckpt/.pt file"
        print(f"resurgo ckpt validate: {args.dir} does not exist: pass one checkpoint ({what})",
              file=sys.stderr)  # fmt: skip
        return EXIT_USAGE
    report = _check(Path(args.dir), args.level, trust=args.trust_objects)
    if args.json:
        print_json(report.to_json_dict())
    else:
        print(_report_line(report))
        for note in report.skipped:
            print(f"  note: {note}")
    return EXIT_OK if report.valid else EXIT_INVALID


def _check(path: Path, level: str, *, trust: bool = False) -> Report:
    """Validate by the checkpoint's layout; any other directory is taken for a DCP one."""
    from agent.checkpoint import layouts
    from agent.checkpoint.report import Level

    layout = layouts.layout_of(path)
    if (layout is None and path.is_dir()) or (layout is not None and layout.name == "dcp"):
        from agent.checkpoint.validate import validate

        return validate(path, Level(level), trust_pickled_objects=trust)
    return layouts.check(path, Level(level))


def _newest(args: argparse.Namespace) -> int:
    usage = _missing_directory("newest", args.root, "the checkpoint root")
    if usage is not None:
        return usage
    from agent.checkpoint import layouts

    found: Report | None = None
    rejected: list[Report] = []
    for candidate in layouts.find_all(args.root):
        report = _check(Path(candidate.path), args.level)
        if report.valid:
            found = report
            break
        rejected.append(report)
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
        if found is not None:
            for note in found.skipped:
                print(f"note: {note}", file=sys.stderr)
            print(found.path)
        else:
            print(
                f"resurgo ckpt newest: no valid checkpoint under {args.root} at level {args.level}",
                file=sys.stderr,
            )
    return EXIT_OK if found is not None else EXIT_INVALID


def _list(args: argparse.Namespace) -> int:
    usage = _missing_directory("list", args.root, "the checkpoint root")
    if usage is not None:
        return usage
    from agent.checkpoint import layouts
    from agent.checkpoint.catalog import describe
    from agent.checkpoint.storage import filesystem_of

    now_s = time.time()
    rows = []
    reports = []
    newest: str | None = None
    for found in layouts.find_all(args.root):
        # Down to the first valid one at the asked level, as `newest` goes; past it,
        # the quick check only.
        level = args.level if newest is None else "quick"
        report = _check(Path(found.path), level)
        if newest is None and report.valid:
            newest = found.name
        entry = None
        if found.layout in ("resurgo", "dcp") and found.step is not None:
            entry = describe(Path(found.path), found.step)
            reports.append((entry, report))
        rows.append(_row(found, entry, report, args.level, now_s, newest=newest == found.name))
    filesystem = filesystem_of(Path(args.root))
    warnings = _storage_warnings(filesystem, reports)
    if args.json:
        print_json(
            {
                "root": args.root,
                "level": args.level,
                "filesystem": filesystem.value,
                "warnings": warnings,
                "checkpoints": rows,
            }
        )
    else:
        print(_table(rows, args.level) if rows else f"no checkpoints under {args.root}")
        for line in _legend(rows, args.level):
            print(line)
        print(f"filesystem: {filesystem.value}")
        for warning in warnings:
            print(f"warning: {warning}")
    return EXIT_OK


def _quarantined(args: argparse.Namespace) -> int:
    usage = _missing_directory("quarantined", args.root, "the checkpoint root")
    if usage is not None:
        return usage
    from agent.checkpoint.quarantine import quarantined

    moves = quarantined(args.root)
    if args.json:
        print_json({"root": args.root, "quarantined": [move.to_json_dict() for move in moves]})
        return EXIT_OK
    if not moves:
        print(f"no checkpoint in quarantine under {args.root}")
        return EXIT_OK
    now_s = time.time()
    rows = [
        (move.source, move.target, duration(max(0.0, now_s - move.time_unix_s)), move.reason)
        for move in moves
    ]
    print(table(("CHECKPOINT", "MOVED TO", "AGO", "WHY"), rows))
    print(f"`resurgo ckpt release {args.root} NAME` moves one back")
    return EXIT_OK


def _release(args: argparse.Namespace) -> int:
    usage = _missing_directory("release", args.root, "the checkpoint root")
    if usage is not None:
        return usage
    from agent.checkpoint.quarantine import release
    from agent.wire.errors import ConfigError

    try:
        move = release(args.root, args.name)
    except (ConfigError, OSError) as error:
        print(f"resurgo ckpt release: {error}", file=sys.stderr)
        return EXIT_INVALID
    print(f"{move.target} moved back to {move.source}")
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


def _row(
    found: Found, entry: Entry | None, report: Report, level: str, now_s: float, *, newest: bool
) -> dict[str, Any]:
    """One checkpoint's row; ``report`` is at ``level``, or quick for rows past the newest
    valid one (``valid`` None: unchecked)."""
    from agent.checkpoint.report import Level

    stats: dict[str, Any] | None = None
    if entry is not None and entry.stats is not None:
        write_s = entry.stats.write_s
        stats = {
            "stall_s": entry.stats.stall_s,
            "write_s": write_s,
            "total_bytes": entry.stats.total_bytes,
            "filesystem": entry.stats.filesystem,
            "mode": entry.stats.mode,
            "throughput_bytes_per_s": entry.stats.total_bytes / write_s if write_s > 0 else None,
        }
    quick_failed = report.failed_level is Level.QUICK
    return {
        "name": found.name,
        "layout": found.layout,
        "step": found.step,
        "path": found.path,
        "committed": entry.committed if entry is not None else found.complete,
        "has_manifest": entry.has_manifest if entry is not None else False,
        "valid": None if report.valid and report.level.value != level else report.valid,
        "checked_level": report.level.value,
        "reason": report.reason,
        "newest_valid": newest,
        "valid_quick": not quick_failed,
        "quick_reason": report.reason if quick_failed else None,
        "total_bytes": found.total_bytes,
        "mtime_unix_s": found.mtime_s,
        "age_s": max(0.0, now_s - found.mtime_s),
        "stats": stats,
    }


_COLUMNS = ("CHECKPOINT", "LAYOUT", "STEP", "COMMITTED", "VALID", "SIZE", "AGE", "STALL", "WRITE",
            "THROUGHPUT", "WHY")  # fmt: skip


def _table(rows: list[dict[str, Any]], level: str) -> str:
    cells = [tuple(f"VALID({level})" if name == "VALID" else name for name in _COLUMNS)]
    for row in rows:
        stats = row["stats"]
        throughput = None if stats is None else stats["throughput_bytes_per_s"]
        cells.append(
            (
                row["name"],
                row["layout"],
                "?" if row["step"] is None else str(row["step"]),
                _committed_cell(row),
                {True: "yes", False: "NO", None: "unchecked"}[row["valid"]],
                size(row["total_bytes"]),
                duration(row["age_s"]),
                "-" if stats is None else seconds(stats["stall_s"]),
                "-" if stats is None else seconds(stats["write_s"]),
                "-" if throughput is None else f"{size(throughput)}/s",
                _why(row),
            )
        )
    return table(cells[0], cells[1:])


def _why(row: dict[str, Any]) -> str:
    """The rejection reason, on one line and shortened; "-" for a row not rejected."""
    if row["valid"] is not False or not row["reason"]:
        return "-"
    # The row names the checkpoint: its path inside the reason only repeats it.
    reason = one_line(row["reason"].replace(f"{row['path']}/", ""))
    reason = _DIGEST.sub(r"\1...", reason)
    return textwrap.shorten(f"{row['checked_level']}: {reason}", WHY_CHARS, placeholder=" ...")


def _legend(rows: list[dict[str, Any]], level: str) -> list[str]:
    """What the VALID column's words mean for this listing, only where they appear."""
    lines = []
    newest = next((row for row in rows if row["newest_valid"]), None)
    if newest is not None:
        lines.append(
            f"newest valid at {level}: {newest['name']} (what `resurgo ckpt newest` picks)"
        )
    elif rows:
        lines.append(f"no checkpoint is valid at {level}")
    if any(row["valid"] is None for row in rows):
        lines.append(
            "unchecked: older than the newest valid one, so given the quick check only "
            "(files, sizes, metadata; a flipped byte passes it); "
            f"`resurgo ckpt validate PATH --level {level}` checks one"
        )
    return lines


def _committed_cell(row: dict[str, Any]) -> str:
    """yes / no for the layout's sign of a finished save (Resurgo's commit marker); "plain"
    for a complete DCP save that has no manifest (a script's own ``dcp.save``)."""
    if row["layout"] == "dcp":
        return "plain" if row["valid_quick"] else "no"
    return "yes" if row["committed"] else "no"
