"""What the daemon's periodic checks decide per job, with ``now`` passed in.

- :func:`tick_observation`: a recovering job's waits (evidence window,
  backoff) are released by a :class:`Tick`; a relaunched step whose agents
  never called in within ``relaunch_start_timeout_s`` (Slurm kept its nodes
  busy) failed (:class:`RelaunchFinished`, not ok), and the core falls back to
  a requeue.
- :func:`next_deadline`: when a recovering job's next wait ends, so the
  decision task ticks it then instead of up to ``tick_s`` late.
- :func:`probation_due`: Resurgo's own drains whose probation is over.
- :func:`interval_due`: a running job's checkpoint interval push.
- :func:`compares_ranks`: whether a job's ranks are compared for stragglers.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence

from supervisor.core.decision import Policy
from supervisor.core.goodput import interval_push
from supervisor.core.intents import PushInterval
from supervisor.core.model import JobRecord, JobState
from supervisor.core.observations import RelaunchFinished, Tick
from supervisor.core.recovery import fast_path_started
from supervisor.store.rows import Actor, DrainRow


def tick_observation(
    record: JobRecord, agent_attempts: Collection[int], now: float, policy: Policy
) -> Tick | RelaunchFinished | None:
    """What the periodic tick tells the core about a job (``agent_attempts``: the
    attempts its agents said they were launched for)."""
    if record.state is JobState.RECOVERING:
        return Tick()
    if record.state is not JobState.STARTING or not fast_path_started(record):
        return None
    if now - record.state_since_s < policy.relaunch_start_timeout_s:
        return None
    if record.attempt in agent_attempts:
        return None
    reason = (
        f"no agent of attempt {record.attempt} called in within "
        f"{policy.relaunch_start_timeout_s:.0f} s of the relaunch"
    )
    return RelaunchFinished(record.attempt, False, reason)


def next_deadline(record: JobRecord, now: float) -> float | None:
    """The end of a recovering job's next wait after ``now`` (an evidence window, a
    backoff); None when it waits for none."""
    pending = record.recovery
    if record.state is not JobState.RECOVERING or pending is None:
        return None
    due = (pending.evidence_until_s, record.not_before_s)
    later = [at for at in due if at is not None and at > now]
    return min(later) if later else None


def probation_due(drains: Sequence[DrainRow], now: float, policy: Policy) -> list[DrainRow]:
    """Resurgo's own open drains drained at least ``probation_s`` ago."""
    return [
        drain
        for drain in drains
        if drain.drained_by is Actor.SUPERVISOR and now - drain.drained_s >= policy.probation_s
    ]


def interval_due(
    record: JobRecord,
    save_cost: tuple[float, float] | None,
    interval_s: float | None,
    node_mtbf_s: float | None,
) -> PushInterval | None:
    """A running job's new checkpoint interval, from its newest save's (stall, write)
    seconds and the node MTBF (None: keep the one it has)."""
    if record.state is not JobState.RUNNING or save_cost is None:
        return None
    stall_s, write_s = save_cost
    return interval_push(
        record.job_id, record.attempt, interval_s, node_mtbf_s, len(record.nodes), stall_s, write_s
    )


def compares_ranks(record: JobRecord) -> bool:
    """Whether the job's ranks' compute times are compared now: while it runs (a
    starting or recovering job's measurements belong to no running launch)."""
    return record.state is JobState.RUNNING
