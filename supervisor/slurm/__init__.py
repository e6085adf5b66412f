"""The Slurm adapter: the interface (`interface`), pure parsing and command building
(`parse`), one runner over the command-line tools (`client`)."""

from supervisor.slurm.client import SlurmClient
from supervisor.slurm.interface import Slurm, SlurmActions, SlurmQueries
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
    "Slurm",
    "SlurmActions",
    "SlurmClient",
    "SlurmJob",
    "SlurmNode",
    "SlurmQueries",
    "drain_reason",
    "parse_drain_reason",
]
