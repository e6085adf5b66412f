"""The decision core's test world: a fixed NOW, a running four-node job, the events it sees.

Shared by the policy tests (``test_policy*.py``) and by the other tests that feed the
core (planned stops, silences, step ends): ``running`` is job 42 on node1-node4 at step
100, ``rank_exit``, ``hang`` and ``straggler`` are what its agents report, and ``run``
feeds observations in order, checking each transition against TRANSITIONS.
"""

from __future__ import annotations

import signal
from dataclasses import replace

from supervisor.core.model import TRANSITIONS, ClusterView, JobRecord, JobState, new_record
from supervisor.core.observations import (
    CheckpointCommitted,
    Culprit,
    HangReported,
    Observation,
    RankExited,
    StragglerReported,
)
from supervisor.core.policy import Decision, Policy, decide

NOW = 1_000_000.0
NODES = ("node1", "node2", "node3", "node4")
CLUSTER = ClusterView(usable=frozenset(f"node{i}" for i in range(1, 21)))
# Evidence windows closed: every fault is decided on the observation that reports it.
POLICY = Policy(
    backoff_base_s=0.0,
    backoff_max_s=0.0,
    hang_evidence_window_s=0.0,
    exit_evidence_window_s=0.0,
    corroborate_drains=False,  # drain on one job's word: what most tests look at
)
CKPT = "/ckpt/step-100"


FOUR = ClusterView(usable=frozenset(NODES))  # the job's own four nodes, no spare
KILL = signal.SIGKILL.value


def running(**changes: object) -> JobRecord:
    record = replace(
        new_record("42", 4, NOW - 3600, min_nodes=2),
        state=JobState.RUNNING,
        nodes=NODES,
        last_step=100,
        last_checkpoint_path=CKPT,
    )
    return replace(record, **changes)  # type: ignore[arg-type]


def rank_exit(
    node: str = "node3",
    *,
    sig: int | None = None,
    code: int | None = None,
    step: int = 150,
    digest: str | None = None,
    at: float = NOW - 1,
    exit_time: float | None = None,
    raised: tuple[str, float] | None = None,
    ended: bool = False,
) -> RankExited:
    return RankExited(
        node,
        f"42/{node}/abcdef01/1",
        at,
        global_rank=int(node[-1]) - 1,
        exit_code=code,
        signal=sig,
        step=step,
        error_digest=digest,
        exit_time_s=exit_time,
        raised=None if raised is None else raised[0],
        raised_time_s=None if raised is None else raised[1],
        script_ended=ended,
    )


def run(
    record: JobRecord,
    *observations: Observation,
    policy: Policy = POLICY,
    cluster: ClusterView = CLUSTER,
    now: float = NOW,
) -> list[Decision]:
    """Feed observations in order, checking each transition against TRANSITIONS."""
    decisions = []
    for observation in observations:
        decision = decide(record, observation, now, policy, cluster)
        after = decision.record.state
        assert after is record.state or after in TRANSITIONS[record.state]
        record = decision.record
        decisions.append(decision)
    return decisions


def commit(step: int) -> CheckpointCommitted:
    """Rank 0's agent: the checkpoint of ``step`` was committed (at ``/c/STEP``)."""
    return CheckpointCommitted("node1", f"c{step}", NOW, step=step, path=f"/c/{step}")


def kinds(decision: Decision) -> list[type]:
    return [type(intent) for intent in decision.intents]


def hang(node: str, rank: int, step: int, in_collective: bool, since: float) -> HangReported:
    culprit = Culprit(rank, step, in_collective, since, "behind")
    return HangReported(node, f"42/{node}/abcdef01/7", NOW, culprits=(culprit,))


def straggler(node: str = "node2") -> StragglerReported:
    return StragglerReported(node, "e", NOW, global_rank=1, detail="2x median")
