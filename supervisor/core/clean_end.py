"""A run that completed, though one rank died in its teardown: not a fault to recover from.

After the last step, ranks tear down: gloo's destructor, a CUDA context, an
atexit hook. A rank that dies there by a signal (SIGABRT, SIGSEGV) while every
other rank exits 0 fails the srun step, and a restart would train past the
end. The run completed when, of the current attempt,

- every rank of the world either exited 0 or failed,
- at least one exited 0, and every failed one died by a signal without an
  exception of its own (an uncaught exception after the loop, in a final save
  say, is the script's failure),
- every failed rank had reached the last step the finished ranks reported.
"""

from __future__ import annotations

from dataclasses import replace

from supervisor.core.model import ExitSeen, JobRecord

# Finished ranks kept per record: one world's worth of the current attempt.
MAX_FINISHED = 100_000


def finished(record: JobRecord, seen: ExitSeen) -> JobRecord:
    """``record`` noting that rank ``seen`` of the current attempt exited 0."""
    if seen.global_rank is None:
        return record
    kept = [entry for entry in record.finished_ranks if entry[0] == record.attempt]
    if any(rank == seen.global_rank for _, rank, _ in kept):
        return record
    kept.append((record.attempt, seen.global_rank, seen.step))
    return replace(record, finished_ranks=tuple(kept[-MAX_FINISHED:]))


def why(record: JobRecord) -> str | None:
    """Why the failed ranks of the closing exit window ended a completed run (None: they
    did not: recover)."""
    pending = record.recovery
    if pending is None or not pending.exits:
        return None
    done = {rank: step for attempt, rank, step in record.finished_ranks
            if attempt == record.attempt}  # fmt: skip
    failed = pending.exits
    world = len(record.nodes) * record.procs_per_node
    if not done or any(e.global_rank is None or e.global_rank in done for e in failed):
        return None
    if len(done) + len({e.global_rank for e in failed}) < world:
        return None
    if any(e.signal is None or e.raised is not None for e in failed):
        return None
    last = max((step for step in done.values() if step is not None), default=None)
    if last is None or any(e.step is None or e.step < last for e in failed):
        return None
    dead = ", ".join(f"rank {e.global_rank} on {e.node} (signal {e.signal})" for e in failed)
    return (
        f"completed: every rank reached step {last}; {len(done)} exited 0 and {dead} "
        "died in its teardown after the last step, which is no fault to restart for"
    )
