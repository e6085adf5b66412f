"""A run that completed, though ranks died in their teardown: not a fault to recover from.

After the last step, ranks tear down: gloo's destructor, a CUDA context, an
atexit hook. A rank that dies there by a signal (SIGABRT, SIGSEGV) fails the
srun step, and a restart would train past the end. The run completed when, of
the current attempt, every rank of the world either exited 0 or failed, every
failed one died by a signal without an exception of its own (an uncaught
exception after the loop, in a final save say, is the script's failure), and

- every failed rank's script had run to its end (Python's normal shutdown had
  begun: :mod:`agent.wire.raised`); a peer stopped by a signal after its
  script's end counts as finished (torchrun stops them all when the dying
  rank's node hosted the rendezvous); or
- at least one rank exited 0, and every failed rank had reached the last step
  the finished ranks reported (a script whose end the bootstrap could not see).
"""

from __future__ import annotations

from dataclasses import replace

from supervisor.core.model import ExitSeen, JobRecord

# Finished ranks kept per record: one world's worth of the current attempt.
MAX_FINISHED = 100_000


def finished(record: JobRecord, seen: ExitSeen) -> JobRecord:
    """``record`` noting that rank ``seen`` of the current attempt exited 0 (or was
    stopped after its script ran to its end)."""
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
    if any(e.global_rank is None or e.global_rank in done for e in failed):
        return None
    if len(done) + len({e.global_rank for e in failed}) < world:
        return None
    if any(e.signal is None or e.raised is not None for e in failed):
        return None
    dead = ", ".join(f"rank {e.global_rank} on {e.node} (signal {e.signal})" for e in failed)
    exited = f"{len(done)} finished and " if done else ""
    if all(e.script_ended for e in failed):
        steps = [step for step in (*done.values(), *(e.step for e in failed)) if step is not None]
        at = f" at step {max(steps)}" if steps else ""
        return (
            f"completed: every rank's script ran to its end{at}; {exited}{dead} died in "
            "its teardown after that, which is no fault to restart for"
        )
    last = max((step for step in done.values() if step is not None), default=None)
    if last is None or any(e.step is None or e.step < last for e in failed):
        return None
    return (
        f"completed: every rank reached step {last}; {exited}{dead} died in its teardown "
        "after the last step, which is no fault to restart for"
    )
