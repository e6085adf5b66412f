"""The supervisor's persistence: SQLite in WAL mode, with exactly-once actions.

``Store.open(path)`` is the entry point; ``supervisor/store/store.py`` documents
the action protocol, the durability choices and the threading rules.
"""

from supervisor.store.rows import (
    ActionRow,
    ActionState,
    Actor,
    AttemptRow,
    BlameOutcome,
    BlameRow,
    CheckpointRow,
    CheckResult,
    DecisionRow,
    DrainRow,
    EventRow,
    EventSource,
    JobRow,
    LeaseRow,
    Lemon,
    NodeCheckRow,
    ProgressRow,
    StepRow,
    TicketRow,
)
from supervisor.store.schema import SCHEMA_VERSION
from supervisor.store.store import Store

__all__ = [
    "SCHEMA_VERSION",
    "ActionRow",
    "ActionState",
    "Actor",
    "AttemptRow",
    "BlameOutcome",
    "BlameRow",
    "CheckResult",
    "CheckpointRow",
    "DecisionRow",
    "DrainRow",
    "EventRow",
    "EventSource",
    "JobRow",
    "LeaseRow",
    "Lemon",
    "NodeCheckRow",
    "ProgressRow",
    "StepRow",
    "Store",
    "TicketRow",
]
