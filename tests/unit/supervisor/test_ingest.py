"""The supervisor's ingest path, made cheap for thousands of agents, gives the same answers.

Every heartbeat goes through decoding, the allocation check, the lease, the
compute samples and the pending-command lookup; each has a shortcut for the
common case (``bench/supervisor_load.py`` measures them). These tests pin
that each shortcut answers exactly what the full path answers.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from agent.wire import protocol
from agent.wire.protocol import (
    Command,
    CommandKind,
    HeartbeatReport,
    ProtocolError,
    RankStatus,
    Reply,
)
from supervisor.core.model import new_record
from supervisor.jobs import JobSpec
from supervisor.jobtable import TrackedJob
from supervisor.store import Store
from tests.fakes.slurm import JOB as DAEMON_JOB
from tests.fakes.slurm import NODES as DAEMON_NODES
from tests.unit.api_world import heartbeat, run, scenario
from tests.unit.daemon_world import registered_and_running
from tests.unit.daemon_world import run as run_daemon

NOW = 1_760_000_000.0
JOB = "1234"

RANK: dict[str, Any] = {
    "global_rank": 8,
    "local_rank": 0,
    "pid": 4242,
    "step": 120,
    "phase": "train",
    "last_progress_unix_s": NOW - 1.0,
    "step_time_p50_s": 0.5,
    "step_time_p99_s": 0.9,
    "step_time_mean_s": 0.55,
    "steps_observed": 100,
    "compute_p50_s": 0.4,
    "compute_observed": 50,
}

# What a field may hold on the wire: every JSON type, and the edge values of each.
WIRE_VALUES = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(1 << 70), max_value=1 << 70),
    st.sampled_from([0, 1, (1 << 63) - 1, 1 << 63, -1]),
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from([0.0, -0.0, 1e308, 5e-324]),
    st.text(max_size=8),
    st.sampled_from(["x" * 4096, "x" * 4097]),
    st.lists(st.integers(), max_size=2),
    st.dictionaries(st.text(max_size=3), st.integers(), max_size=2),
)
MISSING = object()


def decoded_both_ways(item: Any) -> tuple[RankStatus | None, RankStatus | str]:
    """The fast path's answer and the checked path's (its error message when it refuses)."""
    fast = protocol._plain_rank(item)
    try:
        checked: RankStatus | str = protocol._checked_rank(item, "heartbeat.ranks[0]")
    except ProtocolError as error:
        checked = str(error)
    return fast, checked


@settings(max_examples=600, deadline=None)
@given(
    changes=st.dictionaries(
        st.sampled_from([*RANK, "extra"]), st.one_of(WIRE_VALUES, st.just(MISSING)), max_size=3
    )
)
def test_a_heartbeat_rank_is_decoded_alike_by_the_fast_and_the_checked_path(
    changes: dict[str, Any],
) -> None:
    item = {**RANK, **changes}
    for key, value in changes.items():
        if value is MISSING:
            del item[key]
    fast, checked = decoded_both_ways(item)
    if fast is not None:
        assert fast == checked
        assert [type(value) for value in vars(fast).values()] == [
            type(value) for value in vars(checked).values()
        ]
    # The fast path never accepts what the checked path refuses.
    assert not (fast is not None and isinstance(checked, str))


def test_a_well_formed_rank_takes_the_fast_path_and_an_odd_one_the_checked_path() -> None:
    assert protocol._plain_rank(RANK) is not None
    without_compute = {k: v for k, v in RANK.items() if not k.startswith("compute")}
    assert protocol._plain_rank(without_compute) == RankStatus(
        8, 0, 4242, 120, "train", NOW - 1.0, 0.5, 0.9, 0.55, 100
    )
    # A time written as an integer is valid but goes the checked way.
    assert protocol._plain_rank({**RANK, "step_time_p50_s": 1}) is None
    report = protocol.decode_heartbeat(
        json.dumps(
            {"protocol": 1, "type": "heartbeat", "job_id": JOB, "node": "n1",
             "time_unix_s": NOW, "agent_incarnation": "0123abcd",
             "ranks": [{**RANK, "step_time_p50_s": 1}]}
        ).encode()
    )  # fmt: skip
    assert report.ranks[0].step_time_p50_s == 1.0 and type(report.ranks[0].step_time_p50_s) is float
    with pytest.raises(ProtocolError, match=r"heartbeat.ranks\[0\].pid must be an integer"):
        protocol.decode_heartbeat(
            json.dumps(
                {"protocol": 1, "type": "heartbeat", "job_id": JOB, "node": "n1",
                 "time_unix_s": NOW, "agent_incarnation": "0123abcd",
                 "ranks": [{**RANK, "pid": True}]}
            ).encode()
        )  # fmt: skip


def pairs_json(value: Any) -> str:
    """JSON of ``value``, where a list of (key, value) pairs is an object (keys may repeat)."""
    if isinstance(value, list) and value and all(isinstance(item, tuple) for item in value):
        return "{" + ",".join(f"{json.dumps(k)}:{pairs_json(v)}" for k, v in value) + "}"
    if isinstance(value, list):
        return "[" + ",".join(pairs_json(item) for item in value) + "]"
    return json.dumps(value, separators=(",", ":"))


def as_pairs(value: Any) -> Any:
    if isinstance(value, dict):
        return [(key, as_pairs(item)) for key, item in value.items()]
    if isinstance(value, list):
        return [as_pairs(item) for item in value]
    return value


WIRE_RANKS = st.builds(
    RankStatus,
    global_rank=st.integers(0, 4096),
    local_rank=st.integers(0, 64),
    pid=st.integers(1, 2**40),
    step=st.none() | st.integers(0, 2**63 - 1),
    phase=st.none() | st.sampled_from(["init", "train", "checkpoint"]),
    last_progress_unix_s=st.none() | st.floats(0, 2e9),
    step_time_p50_s=st.none() | st.floats(0, 1e4),
    step_time_p99_s=st.none() | st.floats(0, 1e4),
    step_time_mean_s=st.none() | st.floats(0, 1e4),
    steps_observed=st.integers(0, 10**6),
    compute_p50_s=st.none() | st.floats(0, 1e4),
    compute_observed=st.integers(0, 10**6),
)
WIRE_REPORTS = st.builds(
    HeartbeatReport,
    job_id=st.sampled_from([JOB, "4711.3", "a-b_c"]),
    node=st.sampled_from(["n1", "node-07", "gpu001.cluster"]),
    time_unix_s=st.floats(0, 2e9),
    ranks=st.lists(WIRE_RANKS, max_size=8, unique_by=lambda rank: rank.global_rank).map(tuple),
    agent_incarnation=st.sampled_from(["0123abcd", "9f2c1ab04d7e3310"]),
    attempt=st.none() | st.integers(1, 2**62),
)


def checked_or_error(raw: bytes) -> HeartbeatReport | str:
    try:
        return protocol._checked_heartbeat(raw)
    except ProtocolError as error:
        return str(error)


def field_types(report: HeartbeatReport) -> list[Any]:
    return [type(v) for v in vars(report).values()] + [
        type(v) for rank in report.ranks for v in vars(rank).values()
    ]


@settings(max_examples=800, deadline=None)
@given(report=WIRE_REPORTS, data=st.data())
def test_a_heartbeat_body_is_decoded_alike_by_the_canonical_and_the_checked_path(
    report: HeartbeatReport, data: st.DataObject
) -> None:
    """Edits of an encoder's body, duplicate keys included: the fast path never differs."""
    document = as_pairs(json.loads(protocol.encode_heartbeat(report)))
    ranks = next(value for key, value in document if key == "ranks")
    objects = [document, *ranks]
    for _ in range(data.draw(st.integers(0, 3))):
        target = data.draw(st.sampled_from(objects))
        if not target:
            continue
        index = data.draw(st.integers(0, len(target) - 1))
        key, value = target[index]
        if key == "ranks":
            continue
        operation = data.draw(st.sampled_from(["replace", "delete", "repeat", "extra", "swap"]))
        if operation == "replace":
            target[index] = (key, data.draw(WIRE_VALUES))
        elif operation == "delete":
            del target[index]
        elif operation == "repeat":  # the same key again, with its value or another
            target.append((key, data.draw(st.just(value) | WIRE_VALUES)))
        elif operation == "extra":
            target.insert(index, (data.draw(st.text(max_size=6)), data.draw(WIRE_VALUES)))
        elif len(target) > 1:
            other = data.draw(st.integers(0, len(target) - 1))
            target[index], target[other] = target[other], target[index]
    raw = pairs_json(document).encode()
    fast = protocol._canonical_heartbeat(raw)
    checked = checked_or_error(raw)
    if fast is not None:
        assert fast == checked
        assert isinstance(checked, HeartbeatReport)
        assert field_types(fast) == field_types(checked)
    assert protocol.decode_heartbeat(raw) == checked if not isinstance(checked, str) else True


# What agents send: times of this era, durations from a millisecond to hours,
# and a compute time only with its count.
DURATIONS = st.none() | st.floats(1e-3, 1e4)
AGENT_RANKS = st.builds(
    RankStatus,
    global_rank=st.integers(0, 4096),
    local_rank=st.integers(0, 64),
    pid=st.integers(1, 2**22),
    step=st.none() | st.integers(0, 10**9),
    phase=st.none() | st.sampled_from(["init", "train", "checkpoint"]),
    last_progress_unix_s=st.none() | st.floats(1.6e9, 2e9),
    step_time_p50_s=DURATIONS,
    step_time_p99_s=DURATIONS,
    step_time_mean_s=DURATIONS,
    steps_observed=st.integers(0, 10**6),
).flatmap(
    lambda rank: st.sampled_from([rank, replace(rank, compute_p50_s=0.25, compute_observed=50)])
)
AGENT_REPORTS = st.builds(
    HeartbeatReport,
    job_id=st.sampled_from([JOB, "4711.3"]),
    node=st.sampled_from(["n1", "node-07"]),
    time_unix_s=st.floats(1.6e9, 2e9),
    ranks=st.lists(AGENT_RANKS, max_size=8, unique_by=lambda rank: rank.global_rank).map(tuple),
    agent_incarnation=st.sampled_from(["0123abcd", "9f2c1ab04d7e3310"]),
    attempt=st.none() | st.integers(1, 1000),
)


@settings(max_examples=300, deadline=None)
@given(report=AGENT_REPORTS)
def test_what_agents_send_takes_the_canonical_path(report: HeartbeatReport) -> None:
    raw = protocol.encode_heartbeat(report)
    assert protocol._canonical_heartbeat(raw) == report


def test_a_repeated_key_or_an_integer_time_leaves_the_canonical_path() -> None:
    rank = protocol._plain_rank(RANK)
    assert rank is not None
    body = protocol.encode_heartbeat(HeartbeatReport(JOB, "n1", NOW, (rank,), "0123abcd", 2))
    assert protocol._canonical_heartbeat(body) is not None
    repeated = body.replace(b'"pid":4242', b'"pid":4242,"pid":7', 1)
    assert protocol._canonical_heartbeat(repeated) is None
    with pytest.raises(ProtocolError, match="twice"):
        protocol.decode_heartbeat(repeated)
    integer_time = body.replace(b'"step_time_p50_s":0.5', b'"step_time_p50_s":1', 1)
    assert protocol._canonical_heartbeat(integer_time) is None
    assert protocol.decode_heartbeat(integer_time).ranks[0].step_time_p50_s == 1.0
    two = protocol.encode_heartbeat(
        HeartbeatReport(JOB, "n1", NOW, (rank, replace(rank, global_rank=9)), "0123abcd", 2)
    )
    assert protocol._canonical_heartbeat(two) is not None
    twice = two.replace(b'"global_rank":9', b'"global_rank":8', 1)
    assert protocol._canonical_heartbeat(twice) is None
    with pytest.raises(ProtocolError, match="same global_rank twice"):
        protocol.decode_heartbeat(twice)
    unknown = body.replace(b'"pid":4242', b'"pid":4242,"gpu":"a100"', 1)
    assert protocol._canonical_heartbeat(unknown) is None
    assert protocol.decode_heartbeat(unknown) == protocol.decode_heartbeat(body)


def test_check_name_refuses_what_it_refused_before() -> None:
    assert protocol.check_name("node-1.a", "node") == "node-1.a"
    for bad in ("", "-x", "a b", "x" * 129, "nœud"):
        with pytest.raises(ProtocolError, match="is not a name"):
            protocol.check_name(bad, "node")


def test_a_heartbeat_with_nothing_to_say_gets_the_protocols_empty_reply() -> None:
    async def test(api: Any) -> None:
        answer = await api.send(protocol.HEARTBEAT_PATH, heartbeat())
        assert answer.status == 200
        assert answer.body == protocol.encode_reply(Reply())
        assert answer.headers["Content-Type"].startswith("application/json")

    run(scenario(test))


# ---------------------------------------------------------------------------
# Pending commands: remembered as none, never missed.


@pytest.fixture
def store(tmp_path: Path) -> Any:
    with Store.open(tmp_path / "resurgo.db") as opened:
        opened.upsert_job(
            JOB, state="running", record={}, now_s=NOW, name="toy", original_nodes=2, min_nodes=1
        )
        yield opened


def _stop(command_id: str) -> Command:
    return Command(CommandKind.STOP_RANKS, command_id, {"grace_s": 10.0})


def test_a_command_queued_after_an_empty_answer_is_pending_at_once(store: Store) -> None:
    assert store.pending_commands(JOB, "node1") == []
    assert store.pending_commands(JOB, "node1") == []  # answered from memory
    store.queue_command(JOB, "node1", _stop("c1"), NOW)
    assert store.pending_commands(JOB, "node1") == [_stop("c1")]
    interval = Command(
        CommandKind.SET_CHECKPOINT_INTERVAL, "c2", {"interval_s": 60.0, "every_steps": None}
    )
    assert store.pending_commands(JOB, "node2") == []
    store.queue_command(JOB, None, interval, NOW)  # for every node of the job
    assert store.pending_commands(JOB, "node2") == [interval]


def test_an_acknowledgement_rolled_back_leaves_the_command_pending(store: Store) -> None:
    store.queue_command(JOB, "node1", _stop("c1"), NOW)

    class Abort(Exception):
        pass

    with pytest.raises(Abort), store.transaction():
        store.ack_command("c1", "node1", NOW)
        assert store.pending_commands(JOB, "node1") == []
        raise Abort
    assert store.pending_commands(JOB, "node1") == [_stop("c1")]


def test_a_command_queued_in_a_transaction_that_rolls_back_is_not_pending(store: Store) -> None:
    assert store.pending_commands(JOB, "node1") == []

    class Abort(Exception):
        pass

    with pytest.raises(Abort), store.transaction():
        store.queue_command(JOB, "node1", _stop("c1"), NOW)
        raise Abort
    assert store.pending_commands(JOB, "node1") == []
    store.queue_command(JOB, "node1", _stop("c2"), NOW)
    assert store.pending_commands(JOB, "node1") == [_stop("c2")]


# ---------------------------------------------------------------------------
# The job table's shortcuts.


def tracked() -> TrackedJob:
    spec = JobSpec(name="toy", nodes=3, command=("true",), ckpt_root="/ckpt")
    record = replace(new_record(JOB, 3, NOW), nodes=("n1", "n2", "n3"))
    return TrackedJob(record=record, secret=b"s" * 32, spec=spec)


def test_the_allocation_follows_the_record_and_slurms_view() -> None:
    job = tracked()
    assert job.allocation() == {"n1", "n2", "n3"}
    assert job.allocation() is job.allocation()  # built once while nothing changes
    job.slurm_nodes = ("n1", "n2", "n4")
    assert job.allocation() == {"n1", "n2", "n3", "n4"}
    job.record = replace(job.record, nodes=("n1", "n2"))
    assert job.allocation() == {"n1", "n2", "n4"}
    job.slurm_nodes = ("n1", "n2")
    assert job.allocation() == {"n1", "n2"}


def test_a_ranks_compute_median_is_replaced_when_it_changes(tmp_path: Path) -> None:
    def report(node: str, compute_s: float, observed: int) -> HeartbeatReport:
        status = RankStatus(0, 0, 100, 12, "train", NOW, 1.0, 1.1, 1.0, 12, compute_s, observed)
        return HeartbeatReport(DAEMON_JOB, node, NOW, (status,), "00000000000000d0", 1)

    async def body(supervisor: Any, slurm: Any, clock: list[float]) -> None:
        await registered_and_running(supervisor)
        job = supervisor.jobs[DAEMON_JOB]
        supervisor.intake.accept_heartbeat(DAEMON_JOB, report(DAEMON_NODES[0], 0.2, 12))
        first = job.compute[0]
        supervisor.intake.accept_heartbeat(DAEMON_JOB, report(DAEMON_NODES[0], 0.2, 12))
        assert job.compute[0] is first  # the same sample again: kept
        for node, compute_s, observed in (
            (DAEMON_NODES[0], 0.3, 12),
            (DAEMON_NODES[0], 0.3, 13),
            (DAEMON_NODES[1], 0.3, 13),
        ):
            supervisor.intake.accept_heartbeat(DAEMON_JOB, report(node, compute_s, observed))
            sample = job.compute[0]
            assert (sample.node, sample.p50_s, sample.observed) == (node, compute_s, observed)

    run_daemon(body, tmp_path)
