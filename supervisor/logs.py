"""The supervisor's log lines: JSON objects for machines, plain lines for people.

``setup_logging("auto")`` writes one JSON object per line when stderr is not
a terminal (journald, a log shipper) and human lines on a terminal. Fields
passed with ``extra=`` (``job_id``, ``from_state``, ``to_state``, ``cause``,
``actions``) become keys of the JSON object.
"""

from __future__ import annotations

import json
import logging
import sys
from typing import Any

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


def setup_logging(mode: str = "auto", level: int = logging.INFO) -> None:
    """Configure the root logger; ``mode`` is ``auto``, ``yes`` (JSON) or ``no`` (plain)."""
    as_json = mode == "yes" or (mode == "auto" and not sys.stderr.isatty())
    handler = logging.StreamHandler()
    if as_json:
        handler.setFormatter(JsonFormatter())
    else:
        handler.setFormatter(
            logging.Formatter("resurgo-supervisor %(asctime)s %(levelname)s %(message)s")
        )
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)
