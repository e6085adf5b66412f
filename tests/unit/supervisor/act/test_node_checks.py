"""The supervisor's node checks: when one is submitted, how its Slurm job's end reads.

:class:`NodeCheckRunner` over a real store and a fake ``sbatch``/``scancel``
(the live cluster runs the real ones: ``tests/e2e/test_corroboration.py``),
and the check program's verdict line.
"""

from __future__ import annotations

import asyncio
from dataclasses import replace
from pathlib import Path

import pytest

from agent.node.health import GateReport
from agent.node.healthchecks import CheckResult as GateCheck
from agent.node.nodecheck import parse_verdict, verdict_line
from supervisor.act.node_checks import CheckSettings, NodeCheckRunner, verdict_of
from supervisor.core.model import Cause
from supervisor.core.policy import Policy
from supervisor.core.probation import avoid_list, held_by_checks
from supervisor.slurm.parse import JobState, SlurmJob
from supervisor.store import CheckResult, Store
from tests.fakes.slurm import job as slurm_job

NOW = 1_000_000.0
BLAMING = "7"


class Clock:
    def __init__(self) -> None:
        self.now = NOW

    def __call__(self) -> float:
        return self.now


class Sbatch:
    """``sbatch --wrap`` and ``scancel`` as the runner calls them."""

    def __init__(self) -> None:
        self.submitted: list[tuple[list[str], list[str]]] = []
        self.cancelled: list[int] = []

    async def run_command(self, options: list[str], command: list[str]) -> int:
        self.submitted.append((list(options), list(command)))
        return 900 + len(self.submitted)

    async def cancel(self, job_id: int, signal: str | None = None) -> None:
        self.cancelled.append(job_id)


@pytest.fixture
def store(tmp_path: Path) -> Store:
    opened = Store.open(tmp_path / "resurgo.db")
    opened.upsert_job(BLAMING, state="running", record={}, now_s=NOW, name="t",
                      original_nodes=4, min_nodes=2, slurm_user="alice")  # fmt: skip
    return opened


def raise_check(store: Store, node: str = "node3", attempt: int = 2) -> int:
    row = store.record_node_check(
        node, job_id=BLAMING, attempt=attempt, cause=Cause.RANK_SIGNAL,
        evidence="rank 2 died by SIGKILL", now_s=NOW, action_id=f"{BLAMING}/{attempt}/check/{node}",
    )  # fmt: skip
    return row.check_id


def check_job(job_id: int, state: JobState, comment: str = "", code: int | None = None) -> SlurmJob:
    found = slurm_job(("node3",), state)
    return replace(found, job_id=job_id, state=state, state_raw=state.value,
                   comment=comment, exit_code=code)  # fmt: skip


def blaming(nodes: tuple[str, ...]) -> dict[int, SlurmJob]:
    return {int(BLAMING): replace(slurm_job(nodes), job_id=int(BLAMING))}


def test_a_check_waits_while_the_blaming_job_holds_the_node_then_runs_once_per_node(
    store: Store,
) -> None:
    sbatch, clock = Sbatch(), Clock()
    runner = NodeCheckRunner(store, sbatch, CheckSettings(command="nhc -q"), clock)  # type: ignore[arg-type]
    raise_check(store, attempt=2)
    raise_check(store, attempt=3)  # a second blame of the same node: one check serves both
    assert asyncio.run(runner.sweep(blaming(("node1", "node3")))) == []
    assert sbatch.submitted == []
    assert asyncio.run(runner.sweep(blaming(("node1", "node2")))) == []
    ((options, command),) = sbatch.submitted
    assert "--nodelist=node3" in options and "--job-name=resurgo-node-check" in options
    assert command[1:] == ["-m", "agent.node.nodecheck", "--timeout", "300", "--comment",
                           "--command", "nhc -q"]  # fmt: skip
    assert asyncio.run(runner.sweep({901: check_job(901, JobState.RUNNING)})) == []
    line = 'resurgo-node-check {"node":"node3","healthy":true,"lines":["ok nhc -q (1.00 s): ok"]}'
    ended = asyncio.run(runner.sweep({901: check_job(901, JobState.COMPLETED, line, 0)}))
    assert [(e.result, e.detail) for e in ended] == [
        (CheckResult.PASSED, "ok nhc -q (1.00 s): ok")
    ] * 2
    assert store.open_node_checks() == []


def test_a_check_that_never_starts_is_given_up_without_a_verdict(store: Store) -> None:
    sbatch, clock = Sbatch(), Clock()
    runner = NodeCheckRunner(store, sbatch, CheckSettings(wait_s=600), clock)  # type: ignore[arg-type]
    raise_check(store)
    asyncio.run(runner.sweep({}))
    pending = replace(check_job(901, JobState.PENDING), state_reason="Resources")
    clock.now += 599
    assert asyncio.run(runner.sweep({901: pending})) == []
    clock.now += 2
    (ended,) = asyncio.run(runner.sweep({901: pending}))
    assert ended.result is CheckResult.EXPIRED and "did not start" in ended.detail
    assert sbatch.cancelled == [901]
    # Held by its job past the wait: never submitted, no verdict either.
    raise_check(store, "node4")
    clock.now += 601
    (held,) = asyncio.run(runner.sweep(blaming(("node4",))))
    assert held.result is CheckResult.EXPIRED and "not started within" in held.detail


@pytest.mark.parametrize(
    ("state", "comment", "result", "words"),
    [
        (JobState.COMPLETED, "", CheckResult.PASSED, "the check exited 0"),
        (JobState.FAILED, 'resurgo-node-check {"node":"node3","healthy":false,"lines":['
         '"ok builtin:gpus (0.00 s): skipped","FAIL nhc (2.00 s): exit status 1: disk"]}',
         CheckResult.FAILED, "FAIL nhc (2.00 s): exit status 1: disk (FAILED, exit code 1)"),
        (JobState.FAILED, "", CheckResult.FAILED, "the check failed (FAILED, exit code 1)"),
        (JobState.TIMEOUT, "", CheckResult.FAILED, "did not finish within its time limit"),
        (JobState.NODE_FAIL, "", CheckResult.FAILED, "NODE_FAIL"),
        (JobState.CANCELLED, "", CheckResult.EXPIRED, "ended CANCELLED; no verdict"),
        (JobState.PREEMPTED, "", CheckResult.EXPIRED, "no verdict"),
    ],
)  # fmt: skip
def test_the_check_jobs_end_is_its_verdict(
    state: JobState, comment: str, result: CheckResult, words: str
) -> None:
    got, detail = verdict_of(check_job(901, state, comment, 1), "node3")
    assert got is result and words in detail


def test_the_verdict_line_round_trips_and_a_long_one_keeps_the_failures() -> None:
    report = GateReport((
        GateCheck("builtin:gpus", True, "skipped", 0.0),
        *(GateCheck(f"nhc{i}", False, "x" * 3000, 1.0) for i in range(3)),
    ))  # fmt: skip
    whole = verdict_line("node3", report)
    assert parse_verdict("noise\n" + whole + "\n", "node3") == (
        False,
        "; ".join(report.lines()[1:]),
    )
    assert parse_verdict(whole, "node4") is None
    short = verdict_line("node3", report, 1000)
    assert len(short) <= 1000 and "builtin:gpus" not in short
    healthy, words = parse_verdict(short, "node3") or (True, "")
    assert not healthy and words.startswith("FAIL nhc0") and "FAIL nhc2" in words


def test_open_checks_keep_the_node_out_of_the_blaming_users_jobs_and_failed_ones_out_of_all(
    store: Store,
) -> None:
    policy = Policy(probation_s=600.0)
    raise_check(store, "node3")
    failed = raise_check(store, "node4")
    store.end_node_check(failed, CheckResult.FAILED, "FAIL nhc", NOW)
    passed = raise_check(store, "node5")
    store.end_node_check(passed, CheckResult.PASSED, "ok", NOW)
    held = held_by_checks(store.node_checks_since(0), NOW + 1, policy)
    listed = avoid_list([], [], policy, held)
    assert [(e["node"], e.get("users")) for e in listed] == [("node3", ["alice"]), ("node4", None)]
    assert listed[1]["why"] == "failed the supervisor's check: FAIL nhc"
    assert held_by_checks(store.node_checks_since(0), NOW + 601, policy) == []


def test_resurgo_nodes_and_the_metrics_show_the_checks(store: Store) -> None:
    from supervisor.cli.nodes import render
    from supervisor.views import documents as views

    raise_check(store, "node3")
    passed = raise_check(store, "node4")
    store.end_node_check(passed, CheckResult.PASSED, "ok nhc", NOW)
    document = views.nodes(store, None, NOW + 5, 2, 86400.0)
    assert [(c["node"], c["user"], c["result"]) for c in document["checks"]] == [
        ("node3", "alice", None),
        ("node4", "alice", "passed"),
    ]
    text = render(document, NOW + 5)
    assert "node checks (one job's blame" in text
    assert "rank_signal (job 7 of alice)" in text and "waiting" in text and "passed" in text
    assert store.node_check_counts() == {"open": 1, "passed": 1}


def test_one_users_two_blames_make_a_lemon_once_the_node_failed_the_supervisors_check(
    store: Store,
) -> None:
    from supervisor.core.probation import NodeHistory, is_lemon

    for attempt in (2, 3):
        store.record_drain("node3", cause=Cause.RANK_SIGNAL, job_id=BLAMING,
                           reason="resurgo: rank_signal", now_s=NOW + attempt,
                           action_id=f"{BLAMING}/{attempt}/drain/node3")  # fmt: skip
    assert store.lemons(2, 86400.0, NOW + 10, 2) == []  # one user's word
    failed = raise_check(store, "node3")
    store.end_node_check(failed, CheckResult.FAILED, "FAIL nhc", NOW + 5)
    assert [lemon.node for lemon in store.lemons(2, 86400.0, NOW + 10, 2)] == ["node3"]
    history = NodeHistory("node3", (NOW + 2, NOW + 3), blame_users=("alice", "alice"))
    policy = Policy(lemon_window_s=86400.0)
    assert not is_lemon(history, NOW + 10, policy)
    assert is_lemon(replace(history, failed_check_s=NOW + 5), NOW + 10, policy)
