"""The store tests' world: one job at a fixed NOW, and the events its agents send.

Shared by the ``test_store*.py`` files and their fixtures in ``conftest.py``.
"""

from __future__ import annotations

import enum
import hashlib
from pathlib import Path

from agent.wire.protocol import Event, EventKind, make_event

NOW = 1_700_000_000.0
JOB = "1234"
INCARNATION = "0123abcd"


class JobState(enum.Enum):
    """Stands in for the decision core's job-state enum: the store keeps its values."""

    RUNNING = "running"
    RECOVERING = "recovering"
    STOPPED = "stopped"


def event(seq: int, node: str = "node1", job_id: str = JOB) -> Event:
    return make_event(
        EventKind.AGENT_STOPPED, job_id, node, INCARNATION, seq, NOW + seq, {"reason": f"r{seq}"}
    )


def digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()
