"""The executor against a real store and a small hand-written fake Slurm.

Crashes are simulated the way they happen: the store rows a killed supervisor
leaves behind (planned, started), or a :class:`Crash` raised out of the fake
right after Slurm took the effect, before the executor could record it.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from pathlib import Path
from typing import get_args

import pytest

from agent.wire.protocol import CommandKind, Reply, decode_reply, encode_reply
from supervisor.act.executor import (
    ALERT_KIND,
    DRIVER_STOP_GRACE_S,
    REQUEUE_ATTEMPTS,
    Executor,
    Validator,
    validate_checkpoint,
)
from supervisor.act.reconcile import args_of, intent_of, kind_of
from supervisor.core.intents import (
    Alert,
    Intent,
    PushInterval,
    RequeueSmaller,
    Severity,
    StopJob,
    StopRanks,
    ValidateCheckpoints,
    ValidationLevel,
)
from supervisor.core.model import JobState
from supervisor.core.observations import (
    CheckpointValidated,
    Observation,
    RelaunchFinished,
    StorageUnavailable,
)
from supervisor.errors import (
    SlurmCommandFailed,
    SlurmNotSettled,
    SlurmRequeueFailed,
    SlurmUnavailable,
)
from supervisor.slurm.parse import JobState as SlurmState
from supervisor.store import ActionState, Store
from tests.fakes.slurm import JOB, NODES, Crash, FakeSlurm, job, node
from tests.unit.executor_world import DRAIN, NOW, RELAUNCH, REQUEUE, SHRINK


@pytest.fixture
def store(tmp_path: Path) -> Store:
    opened = Store.open(tmp_path / "store.db")
    opened.upsert_job(
        JOB, state="running", record={}, now_s=NOW, name="toy", original_nodes=4, min_nodes=2
    )
    return opened


@pytest.fixture
def slurm() -> FakeSlurm:
    return FakeSlurm()


def executor(
    store: Store, slurm: FakeSlurm, root: Path | None = None, validate_fn: Validator | None = None
) -> Executor:
    return Executor(
        store,
        slurm,
        checkpoint_root_of=lambda job_id: root,
        validate_fn=validate_fn,
        clock=lambda: NOW + 1,
    )


def test_every_intent_type_has_exactly_one_handler(store: Store, slurm: FakeSlurm) -> None:
    table = executor(store, slurm)._handlers
    assert sorted(kind.__name__ for kind in table) == sorted(
        kind.__name__ for kind in get_args(Intent)
    )


def run_execute(ex: Executor, intents: Sequence[Intent]) -> list[object]:
    return list(asyncio.run(ex.execute(JOB, intents, NOW)))


def start_by_hand(store: Store, intent: Intent) -> None:
    """What a supervisor killed right after ``mark_started`` leaves in the store."""
    store.plan_action(intent.action_id, JOB, kind_of(intent), args_of(intent), NOW)
    store.mark_started(intent.action_id, NOW)


def state_of(store: Store, intent: Intent) -> ActionState:
    row = store.get_action(intent.action_id)
    assert row is not None
    return row.state


def test_executing_the_same_intents_twice_runs_each_slurm_call_once(
    store: Store, slurm: FakeSlurm
) -> None:
    intents: list[Intent] = [
        StopRanks(JOB, 2, 30.0),
        DRAIN,
        SHRINK,
        PushInterval(JOB, 2, 600.0),
        Alert(JOB, 2, Severity.WARNING, "node3 drained"),
    ]
    ex = executor(store, slurm)
    run_execute(ex, intents)
    run_execute(ex, intents)
    assert slurm.calls == [
        ("drain", "node3", DRAIN.slurm_reason),
        ("shrink", 4242, SHRINK.keep_nodes),
    ]
    assert all(state_of(store, intent) is ActionState.DONE for intent in intents)
    assert [(d.node, d.action_id) for d in store.open_drains()] == [("node3", DRAIN.action_id)]
    kinds = [c.kind for c in store.pending_commands(JOB, "node1")]
    assert kinds == [CommandKind.STOP_RANKS, CommandKind.SET_CHECKPOINT_INTERVAL]
    assert len(store.events_for(JOB, kinds=(ALERT_KIND,))) == 1


def test_an_alert_is_started_and_done_in_one_commit(
    store: Store, slurm: FakeSlurm, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A straggler report raises an alert: its start and its end are one commit, so a
    supervisor that dies in between leaves it planned (raised again), never started."""
    alert = Alert(JOB, 2, Severity.WARNING, "straggler on node3")
    ex = executor(store, slurm)

    def dies(*args: object, **kwargs: object) -> None:
        raise Crash("killed between the alert's start and its end")

    monkeypatch.setattr(store, "mark_done", dies)
    with pytest.raises(Crash):
        run_execute(ex, [alert])
    assert state_of(store, alert) is ActionState.PLANNED
    assert store.events_for(JOB, kinds=(ALERT_KIND,)) == []
    monkeypatch.undo()
    asyncio.run(executor(store, slurm).reconcile(NOW + 5))
    assert state_of(store, alert) is ActionState.DONE
    assert len(store.events_for(JOB, kinds=(ALERT_KIND,))) == 1


def test_queued_commands_carry_ids_the_agent_protocol_accepts(
    store: Store, slurm: FakeSlurm
) -> None:
    run_execute(executor(store, slurm), [StopRanks(JOB, 2, 30.0), PushInterval(JOB, 2, 600.0)])
    commands = tuple(store.pending_commands(JOB, "node2"))
    assert decode_reply(encode_reply(Reply(commands=commands))).commands == commands


def test_a_crash_between_mark_started_and_the_slurm_call_is_run_once_by_reconcile(
    store: Store, slurm: FakeSlurm
) -> None:
    start_by_hand(store, DRAIN)
    restarted = executor(store, slurm)
    asyncio.run(restarted.reconcile(NOW + 5))
    asyncio.run(restarted.reconcile(NOW + 6))
    assert slurm.calls == [("drain", "node3", DRAIN.slurm_reason)]
    assert state_of(store, DRAIN) is ActionState.DONE
    assert [d.action_id for d in store.open_drains()] == [DRAIN.action_id]


@pytest.mark.parametrize(
    ("intent", "method"),
    [(DRAIN, "drain"), (SHRINK, "shrink"), (REQUEUE, "requeue_smaller")],
)
def test_a_crash_after_the_slurm_call_is_reconciled_without_calling_slurm_again(
    store: Store, slurm: FakeSlurm, intent: Intent, method: str
) -> None:
    slurm.crash_after.add(method)
    with pytest.raises(Crash):
        run_execute(executor(store, slurm), [intent])
    assert state_of(store, intent) is ActionState.STARTED
    assert [call[0] for call in slurm.calls] == [method]

    asyncio.run(executor(store, slurm).reconcile(NOW + 5))
    assert [call[0] for call in slurm.calls] == [method]
    assert state_of(store, intent) is ActionState.DONE
    if intent is DRAIN:
        assert [d.action_id for d in store.open_drains()] == [DRAIN.action_id]


def test_a_requeue_that_keeps_the_size_is_done_only_once_the_restart_count_advanced(
    store: Store, slurm: FakeSlurm
) -> None:
    same_size = RequeueSmaller(JOB, 2, 4, ("node3",), None)  # a spare node replaces node3
    slurm.crash_before.add("requeue_smaller")
    with pytest.raises(Crash):
        run_execute(executor(store, slurm), [same_size])
    assert state_of(store, same_size) is ActionState.STARTED and slurm.calls == []

    asyncio.run(executor(store, slurm).reconcile(NOW + 5))  # same size, same count: not yet
    assert [call[0] for call in slurm.calls] == ["requeue_smaller"]
    assert state_of(store, same_size) is ActionState.DONE
    asyncio.run(executor(store, slurm).reconcile(NOW + 6))
    assert len(slurm.calls) == 1


def test_a_drain_by_someone_else_is_not_taken_for_ours(store: Store, slurm: FakeSlurm) -> None:
    slurm.nodes_by_name["node3"] = node("node3", drained=True, reason="admin: bad DIMM")
    start_by_hand(store, DRAIN)
    asyncio.run(executor(store, slurm).reconcile(NOW + 5))
    assert slurm.calls == [("drain", "node3", DRAIN.slurm_reason)]


def test_slurm_unavailable_fails_the_action_retryably_and_reconcile_retries_it(
    store: Store, slurm: FakeSlurm
) -> None:
    slurm.unavailable.add("drain")
    ex = executor(store, slurm)
    run_execute(ex, [DRAIN])
    row = store.get_action(DRAIN.action_id)
    assert row is not None and row.state is ActionState.FAILED and row.retryable
    assert store.open_drains() == []

    asyncio.run(ex.reconcile(NOW + 5))
    assert slurm.calls == [("drain", "node3", DRAIN.slurm_reason)]
    assert state_of(store, DRAIN) is ActionState.DONE


def test_slurm_refusing_fails_the_action_for_good(store: Store, slurm: FakeSlurm) -> None:
    class Refusing(FakeSlurm):
        async def shrink(self, job_id: int, keep_nodes: Sequence[str]) -> None:
            raise SlurmCommandFailed(["scontrol"], 1, "Invalid node name")

    refusing = Refusing()
    ex = executor(store, refusing)
    run_execute(ex, [SHRINK, RELAUNCH])
    row = store.get_action(SHRINK.action_id)
    assert row is not None and row.state is ActionState.FAILED and not row.retryable
    asyncio.run(ex.reconcile(NOW + 5))
    assert state_of(store, RELAUNCH) is ActionState.PLANNED


def test_slurm_unavailable_while_reconciling_leaves_a_started_action_unfinished(
    store: Store, slurm: FakeSlurm
) -> None:
    start_by_hand(store, DRAIN)
    slurm.unavailable.add("nodes")
    ex = executor(store, slurm)
    assert asyncio.run(ex.reconcile(NOW + 5)) == []
    assert state_of(store, DRAIN) is ActionState.STARTED and slurm.calls == []

    asyncio.run(ex.reconcile(NOW + 6))
    assert state_of(store, DRAIN) is ActionState.DONE
    assert slurm.calls == [("drain", "node3", DRAIN.slurm_reason)]


def test_a_failed_shrink_holds_the_relaunch_until_a_retry_succeeds(
    store: Store, slurm: FakeSlurm
) -> None:
    slurm.unavailable.add("shrink")
    ex = executor(store, slurm)
    run_execute(ex, [SHRINK, RELAUNCH])
    assert state_of(store, RELAUNCH) is ActionState.PLANNED
    assert ex.pending_relaunch(JOB) is None

    asyncio.run(ex.reconcile(NOW + 5))
    assert state_of(store, SHRINK) is ActionState.DONE
    assert ex.pending_relaunch(JOB) == RELAUNCH


def test_relaunch_is_handed_to_the_driver_and_confirmed_once(
    store: Store, slurm: FakeSlurm
) -> None:
    ex = executor(store, slurm)
    assert run_execute(ex, [RELAUNCH]) == []
    assert ex.pending_relaunch(JOB) == RELAUNCH
    asyncio.run(ex.reconcile(NOW + 5))  # a restart does not take it from the driver
    assert state_of(store, RELAUNCH) is ActionState.STARTED

    first = ex.confirm_relaunch(JOB, RELAUNCH.action_id, False, "srun: nodes busy", NOW + 9)
    again = ex.confirm_relaunch(JOB, RELAUNCH.action_id, True, "", NOW + 10)
    assert first == again == RelaunchFinished(2, False, "srun: nodes busy")
    assert ex.pending_relaunch(JOB) is None
    assert run_execute(ex, [RELAUNCH]) == [first]
    assert slurm.calls == []


def test_stop_job_does_not_cancel_a_job_slurm_already_ended(store: Store, slurm: FakeSlurm) -> None:
    slurm.the_job = job(NODES, SlurmState.FAILED)
    stop = StopJob(JOB, 2, JobState.FAILED, "crash loop")
    run_execute(executor(store, slurm), [stop])
    assert slurm.calls == [] and state_of(store, stop) is ActionState.DONE

    slurm.the_job = job(NODES)
    other = StopJob(JOB, 3, JobState.CANCELLED, "operator")
    run_execute(executor(store, slurm), [other])
    assert slurm.calls == [("cancel", 4242)]


def test_a_job_stopped_for_good_is_left_to_its_driver_then_cancelled_after_the_grace(
    store: Store, slurm: FakeSlurm
) -> None:
    """The driver ends it with exit 93 (do not requeue); scancel only if it does not."""
    stop = StopJob(JOB, 2, JobState.FAILED, "crash loop")
    ex = executor(store, slurm)
    run_execute(ex, [stop])
    assert slurm.calls == [] and state_of(store, stop) is ActionState.STARTED
    asyncio.run(ex.reconcile(NOW + DRIVER_STOP_GRACE_S - 5))
    assert slurm.calls == [] and state_of(store, stop) is ActionState.STARTED
    asyncio.run(ex.reconcile(NOW + DRIVER_STOP_GRACE_S + 1))
    assert slurm.calls == [("cancel", 4242)] and state_of(store, stop) is ActionState.DONE


def test_a_job_stopped_after_its_requeue_failed_for_good_is_still_cancelled(
    store: Store, slurm: FakeSlurm
) -> None:
    """Seen live under load: Slurm kept the job COMPLETING past the requeue's wait, the
    requeue failed for good, the core stopped the job (same attempt), and that stop
    waited behind the failed requeue for ever while the job stayed in Slurm."""

    class Refusing(FakeSlurm):
        async def requeue_smaller(
            self, job_id: int, n_nodes: int, n_tasks: int, exclude_nodes: Sequence[str] = ()
        ) -> None:
            raise SlurmCommandFailed(["scontrol"], 1, "job is COMPLETING, not PENDING yet")

    refusing = Refusing()
    ex = executor(store, refusing)
    run_execute(ex, [REQUEUE])
    row = store.get_action(REQUEUE.action_id)
    assert row is not None and row.state is ActionState.FAILED and not row.retryable
    stop = StopJob(JOB, REQUEUE.attempt, JobState.FAILED, "Slurm could not requeue the job")
    asyncio.run(ex.execute(JOB, [stop], NOW + 1))
    asyncio.run(ex.reconcile(NOW + DRIVER_STOP_GRACE_S + 2))
    assert refusing.calls[-1] == ("cancel", 4242)
    assert state_of(store, stop) is ActionState.DONE
    assert state_of(store, REQUEUE) is ActionState.FAILED  # never run again


def test_a_requeue_whose_job_is_still_completing_is_retried_until_slurm_lets_it_pend(
    store: Store, slurm: FakeSlurm
) -> None:
    """requeuehold landed but the old run is still ending (COMPLETING past the wait):
    reconcile tries again and the requeue resumes; only after REQUEUE_ATTEMPTS tries is
    it a failure for good."""

    class Completing(FakeSlurm):
        completing_for = 2

        async def requeue_smaller(
            self, job_id: int, n_nodes: int, n_tasks: int, exclude_nodes: Sequence[str] = ()
        ) -> None:
            if self.completing_for > 0:
                self.completing_for -= 1
                not_yet = SlurmNotSettled(f"job {job_id} is COMPLETING, not PENDING yet")
                raise SlurmRequeueFailed(job_id, "wait for pending", not_yet)
            await super().requeue_smaller(job_id, n_nodes, n_tasks, exclude_nodes)

    completing = Completing()
    ex = executor(store, completing)
    assert run_execute(ex, [REQUEUE]) == []
    row = store.get_action(REQUEUE.action_id)
    assert row is not None and row.state is ActionState.FAILED and row.retryable
    asyncio.run(ex.reconcile(NOW + 5))
    assert state_of(store, REQUEUE) is ActionState.FAILED
    asyncio.run(ex.reconcile(NOW + 10))
    assert state_of(store, REQUEUE) is ActionState.DONE
    assert completing.the_job is not None and completing.the_job.state is SlurmState.PENDING

    never = Completing()
    never.completing_for = REQUEUE_ATTEMPTS + 10
    other = RequeueSmaller(JOB, 3, 3, ("node3",), None)
    ex = executor(store, never)
    observations = asyncio.run(ex.execute(JOB, [other], NOW))
    for tick in range(1, REQUEUE_ATTEMPTS + 2):
        observations += [seen for _, seen in asyncio.run(ex.reconcile(NOW + tick))]
    row = store.get_action(other.action_id)
    assert row is not None and row.state is ActionState.FAILED and not row.retryable
    assert row.starts == REQUEUE_ATTEMPTS
    assert [type(seen).__name__ for seen in observations] == ["RequeueFailed"]


def test_a_job_its_driver_ended_is_not_cancelled(store: Store, slurm: FakeSlurm) -> None:
    stop = StopJob(JOB, 2, JobState.FAILED, "crash loop")
    ex = executor(store, slurm)
    run_execute(ex, [stop])
    slurm.the_job = job(NODES, SlurmState.FAILED)  # the driver exited 93
    asyncio.run(ex.reconcile(NOW + 5))
    assert slurm.calls == [] and state_of(store, stop) is ActionState.DONE


def test_stored_actions_rebuild_the_intents_they_were_planned_from(store: Store) -> None:
    intents: list[Intent] = [
        DRAIN,
        SHRINK,
        RELAUNCH,
        REQUEUE,
        ValidateCheckpoints(JOB, 2, ValidationLevel.LOAD, ("/a", "/b")),
        Alert(JOB, 2, Severity.CRITICAL, "stop"),
        StopJob(JOB, 2, JobState.FAILED, "x"),
    ]
    for intent in intents:
        row = store.plan_action(intent.action_id, JOB, kind_of(intent), args_of(intent), NOW)
        assert intent_of(row) == intent


# --- checkpoint validation, on real tiny checkpoints -----------------------------------


def corrupt(directory: Path) -> None:
    from tests.ckpt_helpers import data_files

    target = data_files(directory)[0]
    data = bytearray(target.read_bytes())
    data[len(data) // 2] ^= 0xFF
    target.write_bytes(bytes(data))


def test_validation_walks_newest_first_and_stops_at_the_first_valid(
    store: Store, slurm: FakeSlurm, tmp_path: Path
) -> None:
    from tests.ckpt_helpers import make_committed_checkpoint

    root = tmp_path / "ckpt"
    paths = {step: make_committed_checkpoint(root, step) for step in (100, 200, 300)}
    corrupt(paths[300])
    validated: list[str] = []

    def counting(path: str, level: ValidationLevel) -> tuple[bool, str]:
        validated.append(path)
        return validate_checkpoint(path, level)

    ex = executor(store, slurm, root, validate_fn=counting)
    intent = ValidateCheckpoints(JOB, 2, ValidationLevel.FULL)
    seen = run_execute(ex, [intent])
    assert [(s.step, s.path, s.valid) for s in seen] == [  # type: ignore[attr-defined]
        (300, str(paths[300]), False),
        (200, str(paths[200]), True),
    ]
    assert validated == [str(paths[300]), str(paths[200])]
    assert run_execute(ex, [intent]) == seen and len(validated) == 2  # replayed, not re-run

    skipping = ValidateCheckpoints(JOB, 2, ValidationLevel.FULL, (str(paths[300]),))
    assert [s.step for s in run_execute(ex, [skipping])] == [200]  # type: ignore[attr-defined]


@pytest.mark.parametrize("commits", [True, False], ids=["committed-meanwhile", "never"])
def test_a_validation_told_to_settle_awaits_the_save_still_being_written(
    store: Store, slurm: FakeSlurm, tmp_path: Path, commits: bool
) -> None:
    """A planned stop's requeue decided while the ranks still write their final
    checkpoint chooses it once committed; a save that never commits is awaited only
    until the deadline, then the newest committed checkpoint is chosen."""
    from agent.checkpoint.format import MARKER_NAME
    from tests.ckpt_helpers import make_committed_checkpoint

    root = tmp_path / "ckpt"
    older = make_committed_checkpoint(root, 200)
    writing = make_committed_checkpoint(root, 300)
    marker = (writing / MARKER_NAME).read_bytes()
    (writing / MARKER_NAME).unlink()  # still being written
    ex = Executor(
        store, slurm, checkpoint_root_of=lambda job_id: root, clock=time.time,
        validate_fn=validate_checkpoint,
    )  # fmt: skip

    async def scenario() -> list[Observation]:
        async def commit_later() -> None:
            await asyncio.sleep(0.3)
            (writing / MARKER_NAME).write_bytes(marker)

        committer = asyncio.create_task(commit_later()) if commits else None
        settle = time.time() + (60.0 if commits else 0.5)
        intent = ValidateCheckpoints(JOB, 2, ValidationLevel.QUICK, settle_until_s=settle)
        seen = await ex.execute(JOB, [intent], NOW)
        if committer is not None:
            await committer
        return seen

    started = time.monotonic()
    seen = asyncio.run(scenario())
    took = time.monotonic() - started
    chosen = seen[-1]
    assert isinstance(chosen, CheckpointValidated) and chosen.valid
    if commits:
        assert chosen.path == str(writing) and took < 30.0  # not the whole minute
    else:
        assert chosen.path == str(older) and took >= 0.4
        assert [(s.step, s.valid) for s in seen] == [(300, False), (200, True)]  # type: ignore[attr-defined]


def test_when_no_checkpoint_is_valid_the_last_report_has_no_path(
    store: Store, slurm: FakeSlurm, tmp_path: Path
) -> None:
    from tests.ckpt_helpers import make_committed_checkpoint

    root = tmp_path / "ckpt"
    corrupt(make_committed_checkpoint(root, 100))
    seen = run_execute(
        executor(store, slurm, root), [ValidateCheckpoints(JOB, 2, ValidationLevel.FULL)]
    )
    assert [(s.step, s.valid) for s in seen] == [(100, False), (None, False)]  # type: ignore[attr-defined]
    assert isinstance(seen[-1], CheckpointValidated) and seen[-1].path is None


def test_a_shrink_refused_again_and_again_gives_up_the_fast_path(store: Store) -> None:
    class Busy(FakeSlurm):
        async def shrink(self, job_id: int, keep_nodes: Sequence[str]) -> None:
            raise SlurmUnavailable("slurmctld is busy: the DB index is being set")

    ex = executor(store, Busy())
    assert run_execute(ex, [SHRINK, RELAUNCH]) == []  # first refusal: retried later
    assert asyncio.run(ex.reconcile(NOW + 5)) == []
    given_up = asyncio.run(ex.reconcile(NOW + 10))
    assert [seen for _, seen in given_up] == [
        RelaunchFinished(SHRINK.attempt, False, given_up[0][1].reason)
    ]
    assert "failed 3x" in given_up[0][1].reason
    row = store.get_action(SHRINK.action_id)
    assert row is not None and row.state is ActionState.FAILED and not row.retryable
    assert ex.pending_relaunch(JOB) is None
    assert asyncio.run(ex.reconcile(NOW + 15)) == []  # given up once, for good


def test_slurm_refusing_a_shrink_falls_back_to_the_requeue_path(store: Store) -> None:
    class Refusing(FakeSlurm):
        async def shrink(self, job_id: int, keep_nodes: Sequence[str]) -> None:
            raise SlurmCommandFailed(["scontrol"], 1, "Invalid node name")

    seen = run_execute(executor(store, Refusing()), [SHRINK, RELAUNCH])
    assert [type(s) for s in seen] == [RelaunchFinished] and not seen[0].ok


def test_a_look_at_unusable_storage_reports_it_instead_of_validating(
    store: Store, slurm: FakeSlurm, tmp_path: Path
) -> None:
    from tests.ckpt_helpers import make_committed_checkpoint

    root = tmp_path / "ckpt"
    make_committed_checkpoint(root, 100)
    look = ValidateCheckpoints(JOB, 2, ValidationLevel.FULL, storage_probe=1)
    # The policy asks for more free space than any disk here has.
    asking = Executor(store, slurm, checkpoint_root_of=lambda job_id: root,
                      clock=lambda: NOW + 1, storage_min_free_bytes=1 << 60)  # fmt: skip
    (seen,) = run_execute(asking, [look])
    assert isinstance(seen, StorageUnavailable) and seen.attempt == 2
    assert "the newest checkpoint needs 1,152,922 TB" in seen.detail
    assert seen.filesystem and str(root).startswith(seen.filesystem)
    again = ValidateCheckpoints(JOB, 2, ValidationLevel.FULL, storage_probe=2)
    seen_again = run_execute(executor(store, slurm, root), [again])
    assert [(s.step, s.valid) for s in seen_again] == [(100, True)]  # type: ignore[attr-defined]
