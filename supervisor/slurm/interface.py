"""What the supervisor asks of Slurm, as Protocols: the one Slurm interface.

:class:`~supervisor.slurm.client.SlurmClient` implements it over the Slurm
command-line tools; tests pass small hand-written fakes. Every user of Slurm
outside this package depends on these types, never on the client class, and
no other module declares its own copy (``tests/unit/supervisor/slurm/test_slurm_interface.py``
enforces both).

Two roles, because some users need only one: :class:`SlurmQueries` reads and
changes nothing, :class:`SlurmActions` changes the cluster (drains, resizes,
submits, cancels). :class:`Slurm` is both.

Every call ends in a value or raises :class:`~supervisor.errors.SlurmError`:
``SlurmUnavailable`` when Slurm could not be asked (unknown, never "gone"),
``SlurmCommandFailed`` when it answered no.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from supervisor.slurm.parse import SlurmJob, SlurmNode


class SlurmQueries(Protocol):
    """Reads: safe to repeat, they change nothing in the cluster."""

    async def jobs(self) -> dict[int, SlurmJob]:
        """Every job Slurm knows, by id."""
        ...

    async def job(self, job_id: int) -> SlurmJob | None:
        """The job, or None when Slurm answered and does not list it."""
        ...

    async def nodes(self) -> dict[str, SlurmNode]:
        """Every node, by name."""
        ...

    async def show_config(self) -> str:
        """``scontrol show config``."""
        ...

    async def admin_level(self, user: str) -> str:
        """``user``'s AdminLevel in the accounting database (``sacctmgr``)."""
        ...

    async def hostnames(self, node_list: str) -> tuple[str, ...]:
        """Slurm's own expansion of a hostlist."""
        ...

    async def test_only(self, options: Sequence[str], script: str) -> str | None:
        """None when ``sbatch --test-only`` accepts the request now, else Slurm's words."""
        ...

    async def never_runs(self, job_id: int, settle_s: float) -> str | None:
        """The pending reason that says the released job can never start, or None."""
        ...


class SlurmActions(Protocol):
    """Changes to the cluster: each runs once, never retried (a retry could act twice)."""

    async def drain(self, node: str, reason: str) -> None:
        """Drain ``node`` with ``reason`` (see :func:`supervisor.slurm.parse.drain_reason`)."""
        ...

    async def resume(self, node: str) -> None:
        """Return ``node`` to service."""
        ...

    async def shrink(self, job_id: int, keep_nodes: Sequence[str]) -> None:
        """Shrink a running job to ``keep_nodes``."""
        ...

    async def requeue_smaller(
        self, job_id: int, n_nodes: int, n_tasks: int, exclude_nodes: Sequence[str] = ()
    ) -> None:
        """Requeue the job under the same id with ``n_nodes`` nodes, avoiding ``exclude_nodes``."""
        ...

    async def submit_held(self, options: Sequence[str], script: str) -> int:
        """``sbatch --hold`` the batch script with ``options``; return the new job id."""
        ...

    async def run_command(self, options: Sequence[str], command: Sequence[str]) -> int:
        """``sbatch --wrap`` ``command`` with ``options``; return the new job id."""
        ...

    async def release(self, job_id: int) -> None:
        """Release a held job."""
        ...

    async def cancel(self, job_id: int, signal: str | None = None) -> None:
        """Cancel the job, or send it ``signal``."""
        ...


class Slurm(SlurmQueries, SlurmActions, Protocol):
    """All of Slurm the supervisor uses: its reads and its changes."""


__all__ = ["Slurm", "SlurmActions", "SlurmQueries"]
