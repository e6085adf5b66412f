"""Slurm parsing on recorded 22.05 output, command builders, the client on a fake runner."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import Sequence

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from supervisor.children import subprocess_runner
from supervisor.errors import (
    SlurmCommandFailed,
    SlurmParseError,
    SlurmRequeueFailed,
    SlurmUnavailable,
)
from supervisor.slurm import parse
from supervisor.slurm.client import SlurmClient
from supervisor.slurm.parse import JobState, NodeFlag, NodeState
from tests.paths import TESTS

FIXTURES = TESTS / "fixtures" / "slurm"


def fixture(name: str) -> str:
    return (FIXTURES / name).read_text()


MIXED = parse.parse_squeue_json(fixture("squeue_mixed.json"))


# --- squeue --------------------------------------------------------------------


@pytest.mark.parametrize(
    ("job_id", "state", "reason", "nodes", "restarts"),
    [
        (25, JobState.COMPLETED, "None", ("node1",), 0),
        (26, JobState.FAILED, "NonZeroExitCode", ("node1",), 0),
        (27, JobState.CANCELLED, "None", ("node1",), 0),
        (28, JobState.RUNNING, "None", ("node1", "node2"), 0),
        (29, JobState.PENDING, "Resources", (), 0),
        (30, JobState.PENDING, "BeginTime", (), 1),
        (31, JobState.PENDING, "JobHeldUser", (), 1),
        (32, JobState.PENDING, "JobHeldUser", (), 0),
    ],
)
def test_recorded_squeue_jobs_parse_to_their_states(
    job_id: int, state: JobState, reason: str, nodes: tuple[str, ...], restarts: int
) -> None:
    job = MIXED[job_id]
    assert (job.state, job.state_reason, job.nodes, job.restart_count) == (
        state,
        reason,
        nodes,
        restarts,
    )


def test_shrunk_job_reports_its_new_smaller_node_list() -> None:
    job = MIXED[28]
    assert job.node_list == "node[1-2]"
    assert job.node_count == 2
    assert "JOB_RESIZED" in job.flags
    assert job.batch_host == "node1"
    assert job.requeue is True


def test_exit_code_is_decoded_from_the_raw_wait_status() -> None:
    assert (MIXED[26].exit_code, MIXED[26].exit_signal) == (3, None)  # `exit 3` -> 768
    assert (MIXED[27].exit_code, MIXED[27].exit_signal) == (0, 15)  # scancel -> SIGTERM


def test_held_and_pending_jobs_have_no_start_or_batch_host() -> None:
    held = MIXED[32]
    assert held.held and held.start_time is None and held.batch_host is None
    assert not MIXED[30].held  # requeued, waiting on its begin time, not held


def test_unlimited_time_limit_is_none_and_minutes_become_seconds() -> None:
    assert MIXED[25].time_limit_s is None
    text = json.dumps({"jobs": [{"job_id": 7, "job_state": "RUNNING", "time_limit": 90}]})
    assert parse.parse_squeue_json(text)[7].time_limit_s == 90 * 60


def test_excluded_nodes_are_expanded() -> None:
    jobs = parse.parse_squeue_json(fixture("squeue_requeue_updated_too_early.json"))
    assert jobs[35].excluded_nodes == ("node3",)
    assert jobs[35].restart_count == 1


def test_unknown_job_state_keeps_its_raw_string() -> None:
    text = json.dumps({"jobs": [{"job_id": 7, "job_state": "SPECIAL_EXIT"}], "errors": []})
    job = parse.parse_squeue_json(text)[7]
    assert (job.state, job.state_raw) == (JobState.UNKNOWN, "SPECIAL_EXIT")


# --- sinfo ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("fixture_name", "node", "state", "drained", "down", "not_responding", "usable"),
    [
        ("sinfo_drained.json", "node1", NodeState.ALLOCATED, False, False, False, True),
        ("sinfo_drained.json", "node2", NodeState.ALLOCATED, True, False, False, False),
        ("sinfo_drained.json", "node3", NodeState.IDLE, False, False, False, True),
        ("sinfo_drained.json", "node4", NodeState.IDLE, True, False, False, False),
        ("sinfo_down.json", "node1", NodeState.IDLE, False, False, False, True),
        ("sinfo_down.json", "node2", NodeState.DOWN, False, True, True, False),
    ],
)
def test_recorded_sinfo_nodes_parse_to_state_and_flags(
    fixture_name: str,
    node: str,
    state: NodeState,
    drained: bool,
    down: bool,
    not_responding: bool,
    usable: bool,
) -> None:
    parsed = parse.parse_sinfo_json(fixture(fixture_name))[node]
    assert (parsed.state, parsed.drained, parsed.down, parsed.not_responding, parsed.usable) == (
        state,
        drained,
        down,
        not_responding,
        usable,
    )


@pytest.mark.parametrize(
    ("fixture_name", "node", "shown"),
    [
        ("sinfo_drained.json", "node2", "allocated+drain"),  # draining: its job still runs
        ("sinfo_drained.json", "node4", "idle+drain"),
        ("sinfo_drained.json", "node3", "idle"),
        ("sinfo_down.json", "node2", "down+not_responding"),
    ],
)
def test_a_nodes_state_text_carries_its_drain_and_down_flags(
    fixture_name: str, node: str, shown: str
) -> None:
    assert parse.parse_sinfo_json(fixture(fixture_name))[node].state_text == shown


def test_our_drain_is_recognised_from_sinfo_reason() -> None:
    node = parse.parse_sinfo_json(fixture("sinfo_drained.json"))["node2"]
    assert node.reason_set_by == "root"
    assert parse.parse_drain_reason(node.reason) == parse.DrainReason("rank_crash", 28)
    down = parse.parse_sinfo_json(fixture("sinfo_down.json"))["node2"]
    assert parse.parse_drain_reason(down.reason) is None  # Slurm's "Not responding"
    assert NodeFlag.NOT_RESPONDING in down.flags


def test_a_poller_parser_rebuilds_only_nodes_that_changed() -> None:
    parser = parse.SinfoParser()
    drained, down = fixture("sinfo_drained.json"), fixture("sinfo_down.json")
    first = parser.parse(drained)
    again = parser.parse(drained)
    assert again == first == parse.parse_sinfo_json(drained)
    assert all(again[name] is first[name] for name in first)
    changed = parser.parse(down)
    assert changed == parse.parse_sinfo_json(down)
    assert changed["node2"].down and not first["node2"].down
    with pytest.raises(SlurmParseError):
        parser.parse("not json")
    assert parser.parse(down) == changed  # a refused reply leaves the last one known


# --- malformed output ---------------------------------------------------------------


@pytest.mark.parametrize(
    "text",
    [
        "",
        "not json",
        "[]",
        '{"jobs": 3, "errors": []}',
        '{"jobs": [{"name": "no id"}], "errors": []}',
        '{"jobs": [{"job_id": "7", "job_state": "RUNNING"}], "errors": []}',
        '{"jobs": [{"job_id": 7, "job_state": "RUNNING", "nodes": "node[1-"}], "errors": []}',
        '{"jobs": [], "errors": [{"error": "Unable to contact slurm controller"}]}',
    ],
)
def test_malformed_squeue_output_raises_slurm_parse_error(text: str) -> None:
    with pytest.raises(SlurmParseError):
        parse.parse_squeue_json(text)


def test_sinfo_without_state_flags_is_malformed() -> None:
    with pytest.raises(SlurmParseError, match="state_flags"):
        parse.parse_sinfo_json('{"nodes": [{"name": "n1", "state": "idle"}], "errors": []}')


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(), inner, max_size=4),
    max_leaves=20,
)
job_records = st.fixed_dictionaries(
    {"job_id": st.integers() | st.text(), "job_state": st.text() | st.integers()},
    optional={k: json_values for k in ("nodes", "exit_code", "time_limit", "flags", "name")},
)


@settings(max_examples=300, deadline=None)
@given(
    st.text()
    | json_values.map(json.dumps)
    | st.lists(job_records).map(
        lambda jobs: json.dumps({"jobs": jobs, "nodes": jobs, "errors": []})
    )
)
def test_parsers_raise_nothing_but_slurm_parse_error(text: str) -> None:
    for parser in (parse.parse_squeue_json, parse.parse_sinfo_json):
        with contextlib.suppress(SlurmParseError):
            parser(text)


# --- drain reasons and command builders -----------------------------------------------


def test_drain_reason_round_trips() -> None:
    reason = parse.drain_reason("hang", 1234)
    assert reason == "resurgo: hang job=1234"
    assert parse.parse_drain_reason(reason) == parse.DrainReason("hang", 1234)
    assert parse.parse_drain_reason("resurgo: integration test drain") is None


def test_drain_reason_refuses_a_cause_that_would_not_parse_back() -> None:
    with pytest.raises(ValueError):
        parse.drain_reason("two words", 1)


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (
            parse.drain_argv("node3", "resurgo: hang job=9"),
            ["scontrol", "update", "NodeName=node3", "State=DRAIN", "Reason=resurgo: hang job=9"],
        ),
        (parse.resume_argv("node3"), ["scontrol", "update", "NodeName=node3", "State=RESUME"]),
        (
            parse.shrink_argv(9, ["node1", "node2", "node4"]),
            ["scontrol", "update", "JobId=9", "NodeList=node[1-2,4]"],
        ),
        (parse.requeue_hold_argv(9), ["scontrol", "requeuehold", "9"]),
        (
            parse.update_size_argv(9, 2, 2, ["node3"]),
            [
                "scontrol",
                "update",
                "JobId=9",
                "NumNodes=2-2",
                "NumCPUs=2",
                "NumTasks=2",
                "ExcNodeList=node3",
            ],
        ),
        (parse.start_now_argv(9), ["scontrol", "update", "JobId=9", "StartTime=now"]),
        (parse.release_argv(9), ["scontrol", "release", "9"]),
        (parse.cancel_argv(9), ["scancel", "9"]),
        (parse.cancel_argv(9, "USR1"), ["scancel", "--signal=USR1", "9"]),
    ],
)
def test_command_builders_make_argv_lists(argv: list[str], expected: list[str]) -> None:
    assert argv == expected


def test_update_size_refuses_fewer_tasks_than_nodes() -> None:
    with pytest.raises(ValueError):
        parse.update_size_argv(9, 3, 2)


# --- client on a fake runner ---------------------------------------------------------


class FakeSlurm:
    """Answers argv with scripted (rc, stdout, stderr) tuples or exceptions; records calls."""

    def __init__(self, *answers: tuple[int, str, str] | BaseException) -> None:
        self.answers = list(answers)
        self.calls: list[list[str]] = []

    async def __call__(self, argv: Sequence[str], timeout_s: float) -> tuple[int, str, str]:
        self.calls.append(list(argv))
        answer = self.answers.pop(0) if len(self.answers) > 1 else self.answers[0]
        if isinstance(answer, BaseException):
            raise answer
        return answer


async def no_sleep(_: float) -> None:
    return None


def client(fake: FakeSlurm) -> SlurmClient:
    return SlurmClient(runner=fake, sleep=no_sleep, retry_wait_s=0.1, requeue_settle_s=1.0)


def squeue_with(*jobs: dict[str, object]) -> tuple[int, str, str]:
    return 0, json.dumps({"jobs": list(jobs), "errors": []}), ""


def test_failed_squeue_is_unknown_never_gone() -> None:
    fake = FakeSlurm((1, "", "squeue: error: Unable to contact slurm controller (connect failure)"))
    with pytest.raises(SlurmUnavailable):
        asyncio.run(client(fake).job(28))
    assert len(fake.calls) == 3  # retried, then gave up: still unknown, not None


def test_job_missing_from_a_good_answer_is_gone() -> None:
    fake = FakeSlurm((0, fixture("squeue_mixed.json"), ""))
    assert asyncio.run(client(fake).job(999)) is None
    assert asyncio.run(client(fake).job(28)) == MIXED[28]


def test_timeout_is_slurm_unavailable() -> None:
    with pytest.raises(SlurmUnavailable, match="no answer"):
        asyncio.run(client(FakeSlurm(TimeoutError())).nodes())


def test_missing_binary_is_slurm_unavailable() -> None:
    with pytest.raises(SlurmUnavailable, match="PATH"):
        asyncio.run(client(FakeSlurm(FileNotFoundError("sinfo"))).nodes())


def test_refusal_is_command_failed_and_not_retried() -> None:
    fake = FakeSlurm((1, "", "scontrol: error: Invalid node name specified"))
    with pytest.raises(SlurmCommandFailed) as raised:
        asyncio.run(client(fake).drain("node9", "resurgo: hang job=1"))
    assert raised.value.returncode == 1
    assert "Invalid node name" in raised.value.stderr
    assert len(fake.calls) == 1


def test_transient_unavailability_is_retried_for_reads() -> None:
    fake = FakeSlurm(TimeoutError(), (0, fixture("sinfo_drained.json"), ""))
    assert set(asyncio.run(client(fake).nodes())) == {"node1", "node2", "node3", "node4"}
    assert len(fake.calls) == 2


def test_hostnames_are_expanded_by_slurm_once_per_list() -> None:
    fake = FakeSlurm((0, "node1\nnode2\n", ""))
    slurm = client(fake)

    async def twice() -> tuple[tuple[str, ...], tuple[str, ...]]:
        return await slurm.hostnames("node[1-2]"), await slurm.hostnames("node[1-2]")

    assert asyncio.run(twice()) == (("node1", "node2"), ("node1", "node2"))
    assert fake.calls == [["scontrol", "show", "hostnames", "node[1-2]"]]


RUNNING = {"job_id": 5, "job_state": "RUNNING", "nodes": "node[1-3]", "restart_cnt": 0}
COMPLETING = {"job_id": 5, "job_state": "COMPLETING", "state_reason": "JobHeldUser"}
PENDING = {"job_id": 5, "job_state": "PENDING", "state_reason": "JobHeldUser", "restart_cnt": 1}
OK = (0, "", "")


RESTARTED = {**RUNNING, "restart_cnt": 1}


def test_requeue_smaller_waits_for_pending_before_resizing() -> None:
    fake = FakeSlurm(
        squeue_with(RUNNING), OK, squeue_with(COMPLETING), squeue_with(PENDING), OK, OK, OK,
        squeue_with(RESTARTED),
    )  # fmt: skip
    asyncio.run(client(fake).requeue_smaller(5, 2, 2, ["node3"]))
    mutations = [call for call in fake.calls if call[0] != "squeue"]
    assert mutations == [
        parse.requeue_hold_argv(5),
        parse.update_size_argv(5, 2, 2, ["node3"]),
        parse.start_now_argv(5),
        parse.release_argv(5),
    ]


def test_requeue_smaller_of_an_already_pending_job_does_not_requeue_twice() -> None:
    fake = FakeSlurm(squeue_with(PENDING), squeue_with(PENDING), OK, OK, OK, squeue_with(RESTARTED))
    asyncio.run(client(fake).requeue_smaller(5, 2, 2))
    assert parse.requeue_hold_argv(5) not in fake.calls


def test_a_requeued_job_starts_no_sooner_than_the_second_after_its_kill() -> None:
    """The nodes revoked the job's credential in the second its last run was killed (by
    then it reads PENDING): a launch in that second is refused and the job FAILS."""
    now = [1_000_000.4]
    slept: list[float] = []
    order: list[str] = []

    async def sleep(seconds: float) -> None:
        slept.append(seconds)
        order.append("slept")
        now[0] += seconds

    fake = FakeSlurm(squeue_with(PENDING), squeue_with(PENDING), OK, OK, OK,
                     squeue_with(RESTARTED))  # fmt: skip
    recorded = fake.__call__

    async def runner(argv: list[str], timeout_s: float) -> tuple[int, str, str]:
        order.append(argv[0] + " " + argv[1])
        return await recorded(argv, timeout_s)

    slurm = SlurmClient(runner=runner, sleep=sleep, retry_wait_s=0.1, clock=lambda: now[0])
    asyncio.run(slurm.requeue_smaller(5, 2, 2))
    assert slept and slept[0] == pytest.approx(0.65)
    # Size, start time and release, all after it.
    after = order[order.index("slept") + 1 :]
    assert after[:3] == ["scontrol update", "scontrol update", "scontrol release"], order


def test_a_requeue_that_sets_its_begin_time_after_the_resize_is_resized_again() -> None:
    # 22.05 under load: the requeue's 121 s begin time landed after start-now.
    late = {**PENDING, "state_reason": "BeginTime", "eligible_time": 1_000_121}
    fake = FakeSlurm(
        squeue_with(PENDING), squeue_with(PENDING), OK, OK, OK,
        squeue_with(late), OK, OK, squeue_with(RESTARTED),
    )  # fmt: skip
    slurm = SlurmClient(runner=fake, sleep=no_sleep, retry_wait_s=0.1, clock=lambda: 1_000_000.0)
    asyncio.run(slurm.requeue_smaller(5, 2, 2, ["node3"]))
    mutations = [call for call in fake.calls if call[0] != "squeue"]
    size, start_now = parse.update_size_argv(5, 2, 2, ["node3"]), parse.start_now_argv(5)
    assert mutations == [size, start_now, parse.release_argv(5), size, start_now]


def test_a_released_job_waiting_for_nodes_is_left_to_wait() -> None:
    waiting = {**PENDING, "state_reason": "Resources", "eligible_time": 1_000_000}
    fake = FakeSlurm(squeue_with(PENDING), squeue_with(PENDING), OK, OK, OK, squeue_with(waiting))
    slurm = SlurmClient(runner=fake, sleep=no_sleep, retry_wait_s=0.1, clock=lambda: 1_000_000.0)
    asyncio.run(slurm.requeue_smaller(5, 2, 2))
    assert len(fake.calls) == 6  # one look after the release, no second resize


def test_requeue_smaller_failure_names_the_step() -> None:
    fake = FakeSlurm(
        squeue_with(PENDING), squeue_with(PENDING), (1, "", "Invalid node count specified")
    )
    with pytest.raises(SlurmRequeueFailed) as raised:
        asyncio.run(client(fake).requeue_smaller(5, 2, 2))
    assert raised.value.step == "update size"
    assert isinstance(raised.value.__cause__, SlurmCommandFailed)


def test_a_busy_controller_is_unavailable_for_now_so_the_action_is_retried() -> None:
    busy = (1, "", "Job update not available right now, the DB index is being set, "
                   "try again in a bit for job 122")  # fmt: skip
    with pytest.raises(SlurmUnavailable, match="busy"):
        asyncio.run(client(FakeSlurm(busy)).shrink(122, ["node1", "node3"]))


# --- running the commands ---------------------------------------------------------


def test_the_runner_returns_status_and_both_outputs_of_a_real_command() -> None:
    argv = ["sh", "-c", "echo out; echo err >&2; exit 3"]
    assert asyncio.run(subprocess_runner(argv, 10.0)) == (3, "out\n", "err\n")


def test_the_runner_kills_a_command_past_its_timeout() -> None:
    async def scenario() -> float:
        started = time.monotonic()
        with pytest.raises(TimeoutError, match="did not finish"):
            await subprocess_runner(["sleep", "30"], 0.3)
        return time.monotonic() - started

    assert asyncio.run(scenario()) < 5.0
