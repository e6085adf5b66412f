"""Properties of the decision core: any observation sequence keeps to its rules.

Random sequences of agent, Slurm and executor observations (hypothesis) never leave
TRANSITIONS, never drain beyond the hourly share, never repeat an action id, and grow
or count restarts only as the policy allows.
"""

from __future__ import annotations

from dataclasses import replace

from hypothesis import given, settings
from hypothesis import strategies as st

from supervisor.core.intents import DrainNode, RequeueSmaller
from supervisor.core.model import MAX_EXITS, TRANSITIONS, Cause, ClusterView, JobRecord
from supervisor.core.observations import (
    CheckpointCommitted,
    CheckpointValidated,
    HealthCheckFailed,
    LeaseExpired,
    Observation,
    RelaunchFinished,
    SlurmJobSeen,
    SlurmNodeSeen,
    StepProgress,
    Tick,
)
from supervisor.core.policy import decide
from tests.unit.policy_world import (
    CKPT,
    NODES,
    NOW,
    POLICY,
    hang,
    kinds,
    rank_exit,
    running,
    straggler,
)

# ---------------------------------------------------------------------------
# Properties: any observation sequence keeps to TRANSITIONS and to the drain share.

_nodes = st.sampled_from((*NODES, "node9"))
_observations = st.one_of(
    st.builds(
        rank_exit,
        _nodes,
        sig=st.sampled_from([None, 6, 9, 11, 15]),
        code=st.sampled_from([None, 0, 1]),
        step=st.integers(100, 103),
        digest=st.sampled_from([None, "x"]),
        exit_time=st.one_of(st.none(), st.floats(NOW - 10, NOW)),
    ),
    st.builds(LeaseExpired, _nodes),
    st.builds(SlurmNodeSeen, _nodes, down=st.booleans()),
    st.builds(
        SlurmJobSeen,
        st.sampled_from(
            ["RUNNING", "PENDING", "PREEMPTED", "TIMEOUT", "NODE_FAIL", "COMPLETED", "FAILED"]
        ),
        st.just(NODES),
        st.integers(0, 3),
        st.sampled_from(["", "Preempted"]),
    ),
    st.builds(
        CheckpointValidated,
        st.sampled_from([None, 100]),
        st.sampled_from([None, CKPT, "/c/old"]),
        st.booleans(),
    ),
    st.builds(RelaunchFinished, st.integers(1, 4), st.booleans()),
    st.builds(StepProgress, st.integers(0, 500)),
    st.builds(
        hang, _nodes, st.integers(0, 3), st.integers(90, 110), st.booleans(), st.floats(0, 100)
    ),
    st.just(straggler()),
    st.just(HealthCheckFailed("node2", "e", NOW)),
    st.builds(
        lambda s: CheckpointCommitted("node1", "e", NOW, step=s, path=f"/c/{s}"),
        st.integers(90, 200),
    ),
    st.just(Tick()),
    # Replies that fit the record (resolved in the test): the executor's usual answers.
    *[st.sampled_from(["relaunch_ok", "relaunch_failed", "valid", "running_again"])] * 4,
)


def _answer(token: Observation | str, record: JobRecord) -> Observation:
    if not isinstance(token, str):
        return token
    if token == "valid":
        return CheckpointValidated(100, CKPT, True)
    if token == "running_again":
        return SlurmJobSeen("RUNNING", NODES[:3], record.slurm_restart_count)
    return RelaunchFinished(record.attempt, token == "relaunch_ok")


@settings(max_examples=400, deadline=None)
@given(
    st.lists(st.tuples(_observations, st.floats(0, 120)), max_size=25),
    st.integers(4, 40),
    st.sampled_from([0.0, 0.1, 0.25]),
    st.sampled_from([0.0, 3.0]),
    st.integers(0, 4),
    st.integers(0, 2),
)
def test_random_observations_never_break_transitions_or_the_drain_share(
    steps, size, share, exit_window, idle, floor
):
    policy = replace(
        POLICY,
        max_drain_share_per_hour=share,
        min_drains_per_hour=floor,
        straggler_drain=True,
        backoff_base_s=5.0,
        backoff_max_s=60.0,
        hang_evidence_window_s=10.0,
        exit_evidence_window_s=exit_window,
    )
    cluster = ClusterView(
        usable=frozenset(f"node{i}" for i in range(1, size + 1)),
        # The job's own nodes are allocated, never idle; node9 is one of its own at times.
        idle=frozenset(f"node{i}" for i in range(max(10, size - idle + 1), size + 1)),
    )
    record, now, drained = running(nodes=NODES[:3]), NOW, 0
    for token, elapsed in steps:
        now += elapsed
        observation = _answer(token, record)
        decision = decide(
            record, observation, now, policy, replace(cluster, drains_last_hour=drained)
        )
        after = decision.record.state
        assert after is record.state or after in TRANSITIONS[record.state]
        drained += sum(isinstance(i, DrainNode) for i in decision.intents)
        assert drained <= max(int(share * size + 1e-9), floor)
        assert len({i.action_id for i in decision.intents}) == len(decision.intents)
        sizes = [i.n_nodes for i in decision.intents if isinstance(i, RequeueSmaller)]
        assert all(n <= record.original_nodes for n in sizes)
        if decision.cause is Cause.GROW:
            # A grow strictly enlarges the job, blames nothing and spends no budget.
            assert sizes and all(n > len(record.nodes) for n in sizes)
            assert DrainNode not in kinds(decision)
            assert decision.record.restarts_without_progress == record.restarts_without_progress
        pending = decision.record.recovery
        if pending is not None and pending.evidence_until_s is not None:
            # An open evidence window has counted no restart yet.
            assert decision.record.attempt == record.attempt
            assert len(pending.exits) <= MAX_EXITS
        record = decision.record
