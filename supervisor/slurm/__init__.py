"""The Slurm adapter: pure parsing and command building (`parse`), one runner (`client`)."""

from supervisor.slurm.client import SlurmClient
from supervisor.slurm.parse import (
    JobState,
    NodeFlag,
    NodeState,
    SlurmJob,
    SlurmNode,
    drain_reason,
    parse_drain_reason,
)

__all__ = [
    "JobState",
    "NodeFlag",
    "NodeState",
    "SlurmClient",
    "SlurmJob",
    "SlurmNode",
    "drain_reason",
    "parse_drain_reason",
]
