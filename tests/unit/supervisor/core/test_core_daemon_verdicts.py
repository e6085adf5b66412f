"""The daemon's verdicts now in the core, as table tests with a fixed NOW."""

from __future__ import annotations

from dataclasses import replace

import pytest

from agent.wire.protocol import Event, EventKind
from supervisor.core import hang_hold, leases, steps
from supervisor.core.decision import Policy
from supervisor.core.model import JobRecord, JobState, new_record
from supervisor.core.observations import SlurmNodeSeen, StepEnded, Tick
from supervisor.core.periodic import tick_observation
from supervisor.store.rows import LeaseRow

NOW = 1_760_000_000.0
LEASE_S = 30.0


def running(**changes: object) -> JobRecord:
    record = new_record("7", 2, NOW - 100)
    fields: dict[str, object] = {"state": JobState.RUNNING, "nodes": ("n1", "n2"), **changes}
    return replace(record, **fields)  # type: ignore[arg-type]


def test_not_responding_alone_is_excused_while_the_agent_calls_in() -> None:
    seen = {
        "n1": SlurmNodeSeen("n1", not_responding=True),
        "n2": SlurmNodeSeen("n2", down=True),
    }
    verdicts = leases.judge_nodes(("n1", "n2"), seen, {"n1", "n2"}, set(), set())
    assert verdicts.report == (seen["n2"],)  # DOWN is lost even while its agent calls in
    assert verdicts.excused == {"n1"} and verdicts.newly_excused == ("n1",)
    again = leases.judge_nodes(("n1", "n2"), seen, set(), verdicts.flagged, verdicts.excused)
    assert again.report == (seen["n1"],)  # its lease lapsed: now it is lost
    assert again.excused == frozenset() and again.flagged == {"n1", "n2"}


def test_one_silent_agent_of_a_job_is_a_lost_node() -> None:
    rows = [LeaseRow("7", node, f"{i:016x}", NOW - (40 if node == "n1" else 1))
            for i, node in enumerate(("n1", "n2", "n3", "n4"))]  # fmt: skip
    (verdict,) = leases.expire(rows[:1], {"7": rows}, NOW, LEASE_S, Policy())
    assert verdict.drop and verdict.observation is not None
    assert verdict.observation.node == "n1"  # type: ignore[union-attr]


def test_leases_count_only_after_a_lease_and_the_longest_retry_since_the_start() -> None:
    assert leases.leases_count(NOW, NOW - 1, LEASE_S) is False
    assert leases.leases_count(NOW, NOW - 10_000, LEASE_S) is True


@pytest.mark.parametrize(
    ("exit_code", "waited_s", "last_report_s", "fallback"),
    [
        (1, LEASE_S, None, True),  # a lease of silence after the driver's word
        (1, LEASE_S - 1, None, False),  # not yet a lease
        (0, LEASE_S, None, False),  # a clean end
        (None, LEASE_S, None, False),  # no exit code yet
        (1, LEASE_S, NOW - 1, False),  # its agents still talk
    ],
)
def test_the_drivers_step_end_opens_a_recovery_only_after_a_lease_of_silence(
    exit_code: int | None, waited_s: float, last_report_s: float | None, fallback: bool
) -> None:
    note, first = steps.note_step_end(None, 1, exit_code, NOW - waited_s)
    assert first
    seen = steps.step_end_fallback(note, running(), NOW, LEASE_S, last_report_s, ())
    assert (seen == StepEnded(1, exit_code)) if fallback else seen is None


def _hang(node: str, step: int, timeout_s: float = 5.0):  # type: ignore[no-untyped-def]
    payload = {"hung": [{"last_step": step, "timeout_s": timeout_s}]}
    return Event(EventKind.HANG, "7", node, f"7/{node}/00000000000000a1/1", 1, NOW, payload)


@pytest.mark.parametrize("phase", sorted(hang_hold.BUSY_PHASES, key=lambda phase: phase.value))
def test_a_hang_report_is_held_while_another_node_is_busy_and_dropped_once_training_goes_on(
    phase: hang_hold.Phase,
) -> None:
    assert {phase.value for phase in hang_hold.BUSY_PHASES} == {
        "checkpoint", "eval", "data", "compute"
    }  # fmt: skip
    record = running()
    busy = {"n2": hang_hold.BusyRank(1, NOW - 1, 1, phase)}
    hold = hang_hold.hold(_hang("n1", 8), busy, record, NOW, LEASE_S)
    assert hold is not None and hold.busy_node == "n2" and hold.held.top_step == 8
    assert hang_hold.hold(_hang("n2", 8), busy, record, NOW, LEASE_S) is None  # its own node
    settled = hang_hold.settle([hold.held], 9, {}, record, None, NOW, LEASE_S)
    assert settled.verdict is hang_hold.Settle.DROP


def test_held_hang_reports_are_released_after_the_patience_without_progress() -> None:
    record = running()
    held = [hang_hold.HeldHang(1, 8, _hang("n1", 8, timeout_s=60.0))]
    first = hang_hold.settle(held, 8, {}, record, None, NOW, LEASE_S)
    assert first.verdict is hang_hold.Settle.KEEP and first.idle_since_s == NOW
    early = hang_hold.settle(held, 8, {}, record, NOW, NOW + 59, LEASE_S)
    assert early.verdict is hang_hold.Settle.KEEP
    late = hang_hold.settle(held, 8, {}, record, NOW, NOW + 60, LEASE_S)
    assert late.verdict is hang_hold.Settle.RELEASE


def test_a_recovering_job_is_ticked_and_a_running_one_is_not() -> None:
    policy = Policy()
    assert tick_observation(running(state=JobState.RECOVERING), (), NOW, policy) == Tick()
    assert tick_observation(running(), (), NOW, policy) is None
