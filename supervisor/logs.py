"""The supervisor's log lines: JSON objects for machines, plain lines for people.

``setup_logging("auto")`` writes one JSON object per line when stderr is not
a terminal (journald, a log shipper) and human lines on a terminal. Fields
passed with ``extra=`` (``job_id``, ``from_state``, ``to_state``, ``cause``,
``actions``) become keys of the JSON object.

Messages quote text a job's owner wrote (checkpoint paths, culprit reasons,
error digests), so neither form lets it break a record: JSON escapes every
control character and non-ASCII character itself; a plain record is written
by :class:`TextFormatter` as one line with visible escapes
(:func:`supervisor.text.one_line`), and a traceback's lines follow it
indented, so a line that starts at the margin always starts a record.
"""

from __future__ import annotations

import json
import logging
import sys
from typing import Any

from supervisor.text import one_line

# Attributes every LogRecord has; anything else on a record came from ``extra=``.
_STANDARD = set(vars(logging.makeLogRecord({}))) | {"message", "asctime", "taskName"}


class JsonFormatter(logging.Formatter):
    """One JSON object per record: time, level, logger, message, and the ``extra`` fields."""

    def format(self, record: logging.LogRecord) -> str:
        document: dict[str, Any] = {
            "time": round(record.created, 3),
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
        }
        for key, value in vars(record).items():
            if key not in _STANDARD and not key.startswith("_"):
                document[key] = value
        if record.exc_info:
            document["exception"] = self.formatException(record.exc_info)
        return json.dumps(document, default=str)


class TextFormatter(logging.Formatter):
    """``fmt`` with the message on one line; traceback and stack lines indented below it."""

    def format(self, record: logging.LogRecord) -> str:
        record.message = one_line(record.getMessage())
        if self.usesTime():
            record.asctime = self.formatTime(record, self.datefmt)
        blocks = []
        if record.exc_info:
            blocks.append(self.formatException(record.exc_info))
        if record.stack_info:
            blocks.append(self.formatStack(record.stack_info))
        # Only "\n" separates lines: one_line escapes every other line break.
        return "\n".join(
            [self.formatMessage(record)]
            + ["    " + one_line(line) for block in blocks for line in block.split("\n")]
        )


def setup_logging(mode: str = "auto", level: int = logging.INFO) -> None:
    """Configure the root logger; ``mode`` is ``auto``, ``yes`` (JSON) or ``no`` (plain)."""
    as_json = mode == "yes" or (mode == "auto" and not sys.stderr.isatty())
    handler = logging.StreamHandler()
    if as_json:
        handler.setFormatter(JsonFormatter())
    else:
        handler.setFormatter(
            TextFormatter("resurgo-supervisor %(asctime)s %(levelname)s %(message)s")
        )
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)
