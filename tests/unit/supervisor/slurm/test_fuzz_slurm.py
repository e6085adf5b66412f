"""Slurm's output, fuzzed: a typed value or SlurmParseError, never another exception, never a bomb.

The parsers read ``squeue --json`` / ``sinfo --json`` (recorded real output,
mutated field by field, plus arbitrary text and JSON), Slurm hostlists
(expanded with python-hostlist behind a bound on how many names a list may
name), ``sbatch --parsable`` output and Resurgo's own drain reasons. A
failed parse means "unknown" to the daemon, so an exception of any other
type, a parse that never ends or a list that expands to millions of names
would each take the daemon's Slurm view down with it.
"""

from __future__ import annotations

import copy
import json
import re
import tracemalloc
from collections.abc import Callable
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from supervisor.errors import SlurmParseError
from supervisor.slurm import parse
from supervisor.slurm.parse import (
    MAX_HOSTLIST_NAMES,
    DrainReason,
    JobState,
    NodeFlag,
    NodeState,
    SlurmJob,
    SlurmNode,
)
from tests.paths import TESTS

FIXTURES = TESTS / "fixtures" / "slurm"
FUZZ = settings(
    max_examples=200,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow],
)

JSON = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(1 << 70), max_value=1 << 70)
    | st.floats()
    | st.text(max_size=30)
    | st.sampled_from(["node[1-3]", "n[1-100000]", "(null)", "RUNNING", "idle", "DRAIN"]),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=10), inner),
    max_leaves=12,
)


def recorded(name: str) -> dict[str, Any]:
    document: dict[str, Any] = json.loads((FIXTURES / name).read_text())
    return document


SQUEUE = [recorded(name) for name in ("squeue_mixed.json", "squeue_requeue_updated_too_early.json")]
SINFO = [recorded(name) for name in ("sinfo_down.json", "sinfo_drained.json")]
JOB_KEYS = [
    "job_id", "job_state", "nodes", "name", "state_reason", "node_count", "batch_host",
    "restart_cnt", "requeue", "exit_code", "time_limit", "start_time", "submit_time",
    "end_time", "excluded_nodes", "comment", "flags", "user_name", "partition",
]  # fmt: skip
NODE_KEYS = [
    "name", "state", "state_flags", "reason", "reason_set_by_user", "reason_changed_at",
    "address", "cpus", "alloc_cpus", "partitions",
]  # fmt: skip


def assert_well_formed_job(job: SlurmJob) -> None:
    assert isinstance(job.job_id, int) and not isinstance(job.job_id, bool)
    assert isinstance(job.state, JobState) and isinstance(job.state_raw, str)
    assert all(isinstance(node, str) and node for node in job.nodes)
    assert len(job.nodes) <= MAX_HOSTLIST_NAMES
    assert all(isinstance(node, str) for node in job.excluded_nodes)
    assert isinstance(job.requeue, bool)
    for value in (job.node_count, job.restart_count):
        assert isinstance(value, int) and not isinstance(value, bool)
    for value in (job.exit_code, job.exit_signal, job.start_time, job.time_limit_s):
        assert value is None or (isinstance(value, int) and not isinstance(value, bool))
    for text in (job.name, job.state_reason, job.comment, job.user_name, job.partition):
        assert isinstance(text, str)


def assert_well_formed_node(node: SlurmNode) -> None:
    assert isinstance(node.name, str)
    assert isinstance(node.state, NodeState)
    assert all(isinstance(flag, NodeFlag) for flag in node.flags)
    assert all(isinstance(flag, str) for flag in node.flags_raw)
    assert isinstance(node.cpus, int) and isinstance(node.alloc_cpus, int)
    assert all(isinstance(partition, str) for partition in node.partitions)


def parsed_or_refused(parser: Callable[[str], dict[Any, Any]], text: str) -> dict[Any, Any] | None:
    """What ``parser`` made of ``text``, or None when it raised SlurmParseError."""
    try:
        return parser(text)
    except SlurmParseError as error:
        assert str(error)
        return None


# -- squeue and sinfo --------------------------------------------------------------------


@FUZZ
@given(
    text=st.text(max_size=300)
    | JSON.map(json.dumps)
    | st.sampled_from(["[" * 50_000, '{"jobs": ' + "[" * 50_000, '{"errors": [' * 2000])
)
def test_any_text_parses_to_typed_records_or_raises_slurm_parse_error(text: str) -> None:
    for job in (parsed_or_refused(parse.parse_squeue_json, text) or {}).values():
        assert_well_formed_job(job)
    for node in (parsed_or_refused(parse.parse_sinfo_json, text) or {}).values():
        assert_well_formed_node(node)


@FUZZ
@given(data=st.data())
def test_recorded_squeue_output_with_fields_replaced_parses_or_raises_slurm_parse_error(
    data: st.DataObject,
) -> None:
    document = copy.deepcopy(data.draw(st.sampled_from(SQUEUE)))
    jobs = document["jobs"]
    for _ in range(data.draw(st.integers(1, 4))):
        job = data.draw(st.sampled_from(jobs))
        key = data.draw(st.sampled_from(JOB_KEYS) | st.text(max_size=8))
        if data.draw(st.booleans()):
            job[key] = data.draw(JSON)
        else:
            job.pop(key, None)
    text = json.dumps(document)
    result = parsed_or_refused(parse.parse_squeue_json, text)
    if result is not None:
        assert set(result) <= {job.get("job_id") for job in jobs}
        for job in result.values():
            assert_well_formed_job(job)


@FUZZ
@given(data=st.data())
def test_recorded_sinfo_output_with_fields_replaced_parses_or_raises_slurm_parse_error(
    data: st.DataObject,
) -> None:
    document = copy.deepcopy(data.draw(st.sampled_from(SINFO)))
    for _ in range(data.draw(st.integers(1, 4))):
        node = data.draw(st.sampled_from(document["nodes"]))
        key = data.draw(st.sampled_from(NODE_KEYS) | st.text(max_size=8))
        if data.draw(st.booleans()):
            node[key] = data.draw(JSON)
        else:
            node.pop(key, None)
    result = parsed_or_refused(parse.parse_sinfo_json, json.dumps(document))
    for node in (result or {}).values():
        assert_well_formed_node(node)


def test_output_that_reports_errors_is_never_an_empty_list_of_jobs() -> None:
    # "No jobs" from a failing controller would read as "every job is gone".
    document = {**SQUEUE[0], "jobs": [], "errors": [{"error": "slurm_load_jobs error"}]}
    with pytest.raises(SlurmParseError, match="reported errors"):
        parse.parse_squeue_json(json.dumps(document))


# -- hostlists ---------------------------------------------------------------------------

HOSTLIST_TEXT = st.text(alphabet="abn01239-,[]", max_size=40)
NAMES = st.lists(
    st.builds(
        lambda prefix, number, width: f"{prefix}{number:0{width}d}",
        st.sampled_from(["node", "gpu", "n", "rack1-n"]),
        st.integers(0, 5000),
        st.integers(1, 4),
    ),
    unique=True,
    max_size=60,
)


@FUZZ
@given(text=HOSTLIST_TEXT | st.text(max_size=40))
def test_any_hostlist_expands_to_names_or_raises_slurm_parse_error(text: str) -> None:
    try:
        names = parse.expand_hostlist(text)
    except SlurmParseError:
        return
    assert isinstance(names, tuple) and len(names) <= MAX_HOSTLIST_NAMES
    assert all(isinstance(name, str) and name for name in names)
    assert len(set(names)) == len(names)


@FUZZ
@given(names=NAMES)
def test_compressing_then_expanding_a_hostlist_gives_the_same_names(names: list[str]) -> None:
    expanded = parse.expand_hostlist(parse.compress_hostlist(names))
    assert sorted(expanded) == sorted(names)


@pytest.mark.parametrize(
    "bomb",
    [
        ",".join(f"n{index}[0-99999]" for index in range(40)),  # many parts at the per-part cap
        "n[" + ",".join("0-99999" for _ in range(40)) + "]",  # many ranges in one group
        "n[0-999]x[0-999]",  # a product of groups
        "x[1]" * 3000,  # one recursion level per group in python-hostlist
        "n[1-" + "9" * 5000 + "]",  # beyond int()'s digit limit
        "n[" + "0" * 30 + "-" + "0" * 29 + "9]",  # zero-padded to a huge width
    ],
)
def test_a_hostlist_bomb_is_refused_before_any_name_is_built(bomb: str) -> None:
    tracemalloc.start()
    try:
        with pytest.raises(SlurmParseError, match="bad Slurm hostlist"):
            parse.expand_hostlist(bomb)
        with pytest.raises(SlurmParseError):
            parse.parse_squeue_json(
                json.dumps({"jobs": [{"job_id": 1, "job_state": "RUNNING", "nodes": bomb}]})
            )
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 4 << 20, f"{peak} bytes to refuse a {len(bomb)}-character hostlist"


def test_a_hostlist_of_the_largest_allowed_size_still_expands() -> None:
    names = parse.expand_hostlist(f"n[1-{MAX_HOSTLIST_NAMES}]")
    assert len(names) == MAX_HOSTLIST_NAMES and names[-1] == f"n{MAX_HOSTLIST_NAMES}"


# -- sbatch ids and drain reasons -------------------------------------------------------


@FUZZ
@given(text=st.text(max_size=40) | st.from_regex(r"[0-9]{1,30}(;[a-z]+)?\n?", fullmatch=True))
def test_sbatch_output_is_a_job_id_or_slurm_parse_error(text: str) -> None:
    try:
        job_id = parse.parse_sbatch_id(text)
    except SlurmParseError:
        assert not re.fullmatch(r"\s*[0-9]{1,18}(;.*)?\s*", text, re.DOTALL)
        return
    assert isinstance(job_id, int) and 0 <= job_id < 10**18
    assert str(job_id) == text.strip().split(";")[0].lstrip("0") or job_id == 0


@FUZZ
@given(
    cause=st.from_regex(r"[A-Za-z0-9_.\-]{1,20}", fullmatch=True),
    job_id=st.integers(0, 10**18 - 1),
)
def test_a_drain_reason_round_trips(cause: str, job_id: int) -> None:
    reason = parse.drain_reason(cause, job_id)
    assert parse.parse_drain_reason(reason) == DrainReason(cause, job_id)


@FUZZ
@given(
    reason=st.text(max_size=60)
    | st.builds(lambda tail: f"resurgo: hang job={tail}", st.text(max_size=30))
    | st.sampled_from(["resurgo: hang job=" + "9" * 5000, "resurgo: hang job=\u0663\u0664"])
)
def test_anyones_drain_reason_parses_to_ours_or_none(reason: str) -> None:
    found = parse.parse_drain_reason(reason)
    if found is not None:
        assert parse.drain_reason(found.cause, found.job_id) == reason.strip()
