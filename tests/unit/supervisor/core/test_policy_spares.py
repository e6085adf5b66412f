"""The decision core with hot spares: a blamed node is replaced, the world keeps its size.

A job submitted with ``--spares K`` holds K nodes beside its world. A fault's relaunch
puts a healthy spare in the blamed node's place (same size, same layout, no reshard);
only when no healthy spare is left does the job shrink as before. Requeues ask for the
spares as far as free nodes allow, and a job short of spares gets them back through
the grow-back path at a checkpoint commit.
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from supervisor.core.intents import (
    DrainNode,
    RelaunchStep,
    RequeueSmaller,
    ShrinkAllocation,
    StopRanks,
)
from supervisor.core.model import (
    Cause,
    ClusterView,
    JobRecord,
    JobState,
    record_from_json,
    record_to_json,
)
from supervisor.core.observations import (
    CheckpointValidated,
    HealthCheckFailed,
    SlurmJobSeen,
    SlurmNodeSeen,
    SpareCheckFailed,
)
from supervisor.core.recovery import split_allocation, swap_in
from tests.unit.policy_world import (
    CKPT,
    CLUSTER,
    KILL,
    NODES,
    NOW,
    POLICY,
    commit,
    rank_exit,
    run,
    running,
)

SWAPPED = ("node1", "node2", "node5", "node4")  # node5 in node3's place


def with_spares(*spares: str, **changes: object) -> JobRecord:
    """Job 42 running on node1-node4 with ``spares`` ready beside it."""
    return running(spares_wanted=max(1, len(spares)), spare_nodes=spares, **changes)


def sigkill_on_node3(record: JobRecord, cluster: ClusterView = CLUSTER) -> list:  # type: ignore[type-arg]
    return run(record, rank_exit("node3", sig=KILL), CheckpointValidated(100, CKPT, True),
               cluster=cluster)  # fmt: skip


def test_a_new_allocation_splits_into_the_world_first_and_the_spares_after():
    submitted = replace(running(), state=JobState.SUBMITTED, nodes=(), spares_wanted=1)
    allocation = ("node1", "node2", "node3", "node4", "node5")
    (started,) = run(submitted, SlurmJobSeen("RUNNING", allocation, 0))
    assert started.record.state is JobState.STARTING
    assert started.record.nodes == allocation[:4]
    assert started.record.spare_nodes == ("node5",)
    assert "1 of them spare" in started.explanation


@pytest.mark.parametrize(
    ("wanted", "allocation", "world", "spares"),
    [
        (0, ("a", "b", "c", "d", "e"), ("a", "b", "c", "d", "e"), ()),
        (2, ("a", "b", "c", "d", "e", "f"), ("a", "b", "c", "d"), ("e", "f")),
        # A requeue that got fewer nodes: the world first, then what is left over.
        (2, ("a", "b", "c", "d", "e"), ("a", "b", "c", "d"), ("e",)),
        (2, ("a", "b", "c"), ("a", "b", "c"), ()),
    ],
)
def test_split_allocation(wanted, allocation, world, spares):
    record = running(spares_wanted=wanted)
    assert split_allocation(record, allocation) == (world, spares)


def test_a_sigkilled_ranks_node_is_replaced_by_the_spare_and_the_world_keeps_its_size():
    crash, chosen = sigkill_on_node3(with_spares("node5"))
    assert isinstance(crash.intents[0], DrainNode) and crash.intents[0].node == "node3"
    assert chosen.record.state is JobState.RELAUNCHING
    # node3 leaves the allocation; the spare runs node3's ranks in its place.
    assert chosen.intents == (
        ShrinkAllocation("42", 2, SWAPPED),
        RelaunchStep("42", 2, SWAPPED, CKPT),
    )
    assert chosen.record.nodes == SWAPPED and chosen.record.spare_nodes == ()
    assert chosen.record.swaps == ((Cause.RANK_SIGNAL, 1),)
    assert chosen.explanation.startswith("spare node5 replaces node3; relaunch on 4 node(s)")


def test_the_spares_that_are_not_needed_stay_in_the_allocation_as_spares():
    _, chosen = sigkill_on_node3(with_spares("node5", "node6"))
    assert chosen.intents[-1] == RelaunchStep("42", 2, SWAPPED, CKPT)
    assert chosen.intents[0] == ShrinkAllocation("42", 2, (*SWAPPED, "node6"))
    assert chosen.record.spare_nodes == ("node6",)


def test_with_no_spare_left_the_next_fault_shrinks_the_job_as_before():
    _, swapped = sigkill_on_node3(with_spares("node5"))
    after = replace(swapped.record, state=JobState.RUNNING, recovery=None)
    _, shrunk = run(after, rank_exit("node2", sig=KILL), CheckpointValidated(100, CKPT, True))
    assert shrunk.intents == (
        ShrinkAllocation("42", 3, ("node1", "node5", "node4")),
        RelaunchStep("42", 3, ("node1", "node5", "node4"), CKPT),
    )
    assert shrunk.record.swaps == ((Cause.RANK_SIGNAL, 1),)  # no second swap


@pytest.mark.parametrize(
    "cluster",
    [
        replace(CLUSTER, down=frozenset({"node5"})),
        replace(CLUSTER, drained=frozenset({"node5"})),
        replace(CLUSTER, lemons=frozenset({"node5"})),
    ],
    ids=["down", "drained", "lemon"],
)
def test_a_spare_slurm_or_the_lemon_list_took_out_is_never_used(cluster):
    _, chosen = sigkill_on_node3(with_spares("node5", "node6"), cluster)
    assert chosen.intents[-1] == RelaunchStep("42", 2, ("node1", "node2", "node6", "node4"), CKPT)
    assert "node5" not in chosen.record.spare_nodes


def test_a_spare_that_fails_its_health_check_is_blamed_and_the_job_shrinks():
    _, swapped = sigkill_on_node3(with_spares("node5"))
    failed = HealthCheckFailed("node5", "h", NOW, detail="builtin:ckpt_root: read-only")
    fault, shrunk = run(swapped.record, failed, CheckpointValidated(100, CKPT, True))
    assert fault.cause is Cause.HEALTH_CHECK
    assert [i.node for i in fault.intents if isinstance(i, DrainNode)] == ["node5"]
    assert shrunk.intents[-1] == RelaunchStep("42", 3, ("node1", "node2", "node4"), CKPT)
    assert "node5" not in shrunk.record.nodes


def test_swap_in_keeps_each_spare_in_the_place_of_the_node_it_replaces():
    record = with_spares("s1", "s2", nodes=("n1", "n2", "n3", "n4"))
    assert swap_in(record, {"n2", "n4"}) == (
        ("n1", "s1", "n3", "s2"),
        (),
        (("n2", "s1"), ("n4", "s2")),
    )
    assert swap_in(record, {"n2", "s1"}) == (("n1", "s2", "n3", "n4"), (), (("n2", "s2"),))
    assert swap_in(record, {"n2", "n3", "s1", "s2"}) == (("n1", "n4"), (), ())


def test_a_requeue_asks_for_the_spares_as_far_as_free_nodes_allow():
    # The batch host is lost: the requeue path. Free now: the job's own three
    # healthy nodes and its spare, plus the idle ones.
    lost_host = [rank_exit("node1", sig=KILL), CheckpointValidated(100, CKPT, True)]
    _, none_idle = run(with_spares("node5"), *lost_host)
    assert none_idle.intents == (RequeueSmaller("42", 2, 4, ("node1",), CKPT),)
    assert none_idle.record.spare_nodes == () and none_idle.record.nodes == ()
    idle = replace(CLUSTER, idle=frozenset({"node9"}))
    _, one_idle = run(with_spares("node5"), *lost_host, cluster=idle)
    assert one_idle.intents == (RequeueSmaller("42", 2, 5, ("node1",), CKPT),)


def test_a_job_short_of_spares_gets_them_back_at_a_commit_when_nodes_are_idle():
    short = running(spares_wanted=2, spare_nodes=(), nodes=SWAPPED, blamed_nodes=("node3",))
    cluster = replace(CLUSTER, idle=frozenset({"node3", "node9"}))  # node3 stays out
    (grown,) = run(short, commit(200), cluster=cluster)
    assert grown.cause is Cause.GROW
    assert grown.intents == (
        StopRanks("42", 2, POLICY.stop_grace_s),
        RequeueSmaller("42", 2, 5, ("node3",), "/c/200"),
    )
    assert grown.explanation.startswith("idle nodes allow 1 spare(s) instead of 0")


@pytest.mark.parametrize(
    ("record", "idle", "policy"),
    [
        (running(spares_wanted=1, spare_nodes=("node5",)), {"node9"}, POLICY),
        (running(spares_wanted=2, spare_nodes=("node5",)), {"node9"}, POLICY),
        (running(spares_wanted=1), set(), POLICY),
        (running(spares_wanted=1), {"node9"}, replace(POLICY, grow_back=False)),
        (running(), {"node9"}, POLICY),
    ],
    ids=[
        "spares complete",
        "one of two left",
        "nothing idle",
        "grow_back off",
        "no spares asked for",
    ],
)
def test_no_spare_is_replenished_when_none_is_missing_or_none_is_idle(record, idle, policy):
    cluster = replace(CLUSTER, idle=frozenset(idle))
    (seen,) = run(record, commit(200), cluster=cluster, policy=policy)
    assert seen.intents == () and seen.record.state is JobState.RUNNING


def test_the_spares_survive_the_record_store_and_old_records_read_without_them():
    record = with_spares("node5", swaps=((Cause.HANG, 2),))
    assert record_from_json(record_to_json(record)) == record
    old = record_to_json(running()).replace('"spares_wanted": 0,', "")
    old = old.replace('"spare_nodes": [],', "").replace('"swaps": [],', "")
    assert "spare" not in old and "swaps" not in old
    assert record_from_json(old) == running()


def test_a_shared_checkpoint_root_failing_the_health_gate_drains_nothing_and_swaps_nothing():
    failed = HealthCheckFailed(
        "node3", "h", NOW,
        detail="FAIL builtin:ckpt_root: no space left", failed_checks=("builtin:ckpt_root",),
    )  # fmt: skip
    fault, chosen = run(with_spares("node5"), failed, CheckpointValidated(100, CKPT, True))
    assert fault.cause is Cause.HEALTH_CHECK
    assert not [i for i in fault.intents if isinstance(i, DrainNode)]
    assert chosen.intents == (RelaunchStep("42", 2, ("node1", "node2", "node3", "node4"), CKPT),)
    assert chosen.record.spare_nodes == ("node5",) and chosen.record.swaps == ()


def test_a_spare_that_stops_responding_is_released_and_training_goes_on():
    lost = SlurmNodeSeen("node5", not_responding=True)
    (seen,) = run(with_spares("node5", "node6"), lost)
    assert seen.record.state is JobState.RUNNING and seen.record.spare_nodes == ("node6",)
    assert seen.intents == (ShrinkAllocation("42", 1, (*NODES, "node6")),)
    assert seen.record.swaps == () and seen.record.restarts == ()
    assert seen.explanation.startswith("spare node5 lost")
    # During a recovery the relaunch releases it with the blamed node.
    crash, *_ = run(with_spares("node5", "node6"), rank_exit("node3", sig=KILL))
    (later,) = run(crash.record, lost)
    assert later.intents == () and later.record.spare_nodes == ("node6",)


def test_an_idle_spare_that_fails_its_health_check_is_released_and_kept_out_of_refills():
    failed = SpareCheckFailed("node5", "FAIL builtin:ckpt_root (0.01 s): /c is not writable")
    (seen,) = run(with_spares("node5", "node6"), failed)
    assert seen.record.state is JobState.RUNNING and seen.record.spare_nodes == ("node6",)
    assert seen.intents == (ShrinkAllocation("42", 1, (*NODES, "node6")),)
    assert seen.record.blamed_nodes == ("node5",)
    assert seen.record.swaps == () and seen.record.restarts == ()
    assert "health check failed on idle spare node5: FAIL builtin:ckpt_root" in seen.explanation
    # Released, it is idle to Slurm again; the refill at the next commit passes it by.
    cluster = replace(CLUSTER, idle=frozenset({"node5"}))
    (later,) = run(seen.record, SpareCheckFailed("node6", "FAIL x"), cluster=cluster)
    (kept_on,) = run(later.record, commit(200), cluster=cluster)
    assert kept_on.intents == () and kept_on.record.state is JobState.RUNNING
    # Nor does a fault's relaunch grow onto it, nor a requeue take it back.
    both_idle = replace(CLUSTER, idle=frozenset({"node5", "node6"}))
    _, relaunched = sigkill_on_node3(later.record, cluster=both_idle)
    kept = ("node1", "node2", "node4")
    assert relaunched.intents[-1] == RelaunchStep("42", 2, kept, CKPT), relaunched.explanation
    batch_host_lost = rank_exit("node1", sig=KILL), CheckpointValidated(100, CKPT, True)
    _, requeued = run(later.record, *batch_host_lost, cluster=both_idle)
    (requeue,) = [i for i in requeued.intents if isinstance(i, RequeueSmaller)]
    assert requeue.exclude == ("node1", "node5", "node6"), requeued.explanation
    assert "node5 (blamed in this job)" in requeued.explanation, requeued.explanation
    # A node that is no spare (any more) is not taken out of the world for it.
    (ignored,) = run(with_spares("node6"), failed)
    assert ignored.intents == () and ignored.record.spare_nodes == ("node6",)


def test_a_spare_slurm_took_out_is_refilled_as_if_used():
    record = with_spares("node5")
    cluster = replace(CLUSTER, idle=frozenset({"node9"}), down=frozenset({"node5"}))
    (grown,) = run(record, commit(200), cluster=cluster)
    assert grown.cause is Cause.GROW
    assert grown.intents[-1] == RequeueSmaller("42", 2, 5, (), "/c/200")


def test_nodes_the_unit_leaves_over_are_released_unless_spares_are_wanted():
    six = tuple(f"node{i}" for i in range(1, 7))
    for wanted, spares in ((0, ()), (1, ("node6",))):
        record = running(nodes=six, original_nodes=6, unit=2, spares_wanted=wanted)
        _, chosen = run(record, rank_exit("node3", sig=KILL), CheckpointValidated(100, CKPT, True))
        kept = ("node1", "node2", "node4", "node5")
        assert chosen.intents[-1] == RelaunchStep("42", 2, kept, CKPT)
        assert chosen.intents[0] == ShrinkAllocation("42", 2, (*kept, *spares))
        assert chosen.record.spare_nodes == spares
