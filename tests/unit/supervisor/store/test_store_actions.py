"""supervisor.store: the actions table and its exactly-once rules.

An action is planned once, then started, done or failed along allowed transitions
only; a property test checks random plan/start/done/fail sequences against a model.

Real SQLite files in tmp_path; the ``path`` and ``store`` fixtures (a store holding
job ``JOB``) are in ``tests/unit/conftest.py``, the helpers in ``store_world``.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from supervisor.errors import ActionStateError, StoreError
from supervisor.store import ActionState, Store
from tests.unit.store_world import JOB, NOW

# ---------------------------------------------------------------------------
# Actions.


def test_planning_the_same_action_twice_returns_the_first_plan(store: Store) -> None:
    first = store.plan_action("j/1/drain/node3", JOB, "drain", {"node": "node3"}, NOW)
    again = store.plan_action("j/1/drain/node3", JOB, "drain", {"node": "other"}, NOW + 5)
    assert again == first
    assert (first.state, first.starts, first.args) == (ActionState.PLANNED, 0, {"node": "node3"})
    assert len(store.list_actions()) == 1


def test_an_action_goes_planned_started_done_and_records_each_time(store: Store) -> None:
    store.plan_action("a", JOB, "requeue", {"nodes": 3}, NOW)
    started = store.mark_started("a", NOW + 1)
    assert (started.state, started.starts, started.started_s) == (ActionState.STARTED, 1, NOW + 1)
    done = store.mark_done("a", {"job": JOB}, NOW + 2)
    assert (done.state, done.result, done.finished_s) == (ActionState.DONE, {"job": JOB}, NOW + 2)
    assert store.unfinished_actions() == []


@pytest.mark.parametrize(
    ("setup", "verb", "message"),
    [
        ([], "done", "cannot finish action a: it is planned"),
        (["start", "done"], "start", "cannot start action a: it is done"),
        (["start", "done"], "fail", "cannot fail action a: it is done"),
        (["start", "done"], "done", "cannot finish action a: it is done"),
        (["start", "fail"], "start", r"it is failed \(not retryable\)"),
        (["fail"], "done", "cannot finish action a: it is failed"),
    ],
)
def test_a_forbidden_action_transition_raises_and_changes_nothing(
    store: Store, setup: list[str], verb: str, message: str
) -> None:
    store.plan_action("a", JOB, "drain", {}, NOW)
    apply = {
        "start": lambda: store.mark_started("a", NOW),
        "done": lambda: store.mark_done("a", {}, NOW),
        "fail": lambda: store.mark_failed("a", "boom", NOW, retryable=False),
    }
    for step in setup:
        apply[step]()
    before = store.get_action("a")
    with pytest.raises(ActionStateError, match=message):
        apply[verb]()
    assert store.get_action("a") == before


def test_a_retryable_failure_can_be_started_again_and_counts_starts(store: Store) -> None:
    store.plan_action("a", JOB, "drain", {}, NOW)
    store.mark_started("a", NOW)
    failed = store.mark_failed("a", "scontrol timed out", NOW + 1, retryable=True)
    assert (failed.state, failed.error, failed.retryable) == (
        ActionState.FAILED,
        "scontrol timed out",
        True,
    )
    restarted = store.mark_started("a", NOW + 2)
    assert (restarted.state, restarted.starts, restarted.error) == (ActionState.STARTED, 2, None)


def test_unfinished_actions_are_planned_or_started_in_plan_order(store: Store) -> None:
    for action_id in ("c", "a", "b", "d"):
        store.plan_action(action_id, JOB, "drain", {}, NOW)
    store.mark_started("a", NOW)
    store.mark_started("b", NOW)
    store.mark_done("b", {}, NOW)
    store.mark_failed("d", "no", NOW, retryable=True)
    assert [row.action_id for row in store.unfinished_actions()] == ["c", "a"]
    assert [row.action_id for row in store.unfinished_actions(JOB)] == ["c", "a"]
    assert store.unfinished_actions("other") == []
    failed = store.list_actions(states=[ActionState.FAILED])
    assert [row.action_id for row in failed] == ["d"]


def test_an_unplanned_action_cannot_be_started(store: Store) -> None:
    with pytest.raises(StoreError, match="plan_action"):
        store.mark_started("ghost", NOW)


# ---------------------------------------------------------------------------
# Property: random plan/start/done/fail sequences keep the action invariants.

_IDS = ("a", "b", "c", "d")
_OPS = st.lists(
    st.tuples(
        st.sampled_from(("plan", "start", "done", "fail", "fail_retry")), st.sampled_from(_IDS)
    ),
    max_size=25,
)
_ALLOWED = {
    "start": {"planned", "started", "failed_retryable"},
    "done": {"started"},
    "fail": {"planned", "started"},
    "fail_retry": {"planned", "started"},
}
_AFTER = {"start": "started", "done": "done", "fail": "failed", "fail_retry": "failed_retryable"}


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(ops=_OPS)
def test_random_action_sequences_keep_the_exactly_once_invariants(
    tmp_path: Path, ops: list[tuple[str, str]]
) -> None:
    db_path = tmp_path / f"prop-{hashlib.sha256(repr(ops).encode()).hexdigest()[:16]}.db"
    db_path.unlink(missing_ok=True)
    model: dict[str, str] = {}
    order: list[str] = []
    starts: dict[str, int] = {}
    with Store.open(db_path) as store:
        store.upsert_job(
            JOB, state="r", record={}, now_s=NOW, name="t", original_nodes=1, min_nodes=1
        )
        for op, action_id in ops:
            if op == "plan":
                store.plan_action(action_id, JOB, "drain", {}, NOW)
                if action_id not in model:
                    model[action_id] = "planned"
                    order.append(action_id)
                    starts[action_id] = 0
                continue
            allowed = model.get(action_id) in _ALLOWED[op]
            call = {
                "start": lambda i=action_id: store.mark_started(i, NOW),
                "done": lambda i=action_id: store.mark_done(i, {}, NOW),
                "fail": lambda i=action_id: store.mark_failed(i, "e", NOW, retryable=False),
                "fail_retry": lambda i=action_id: store.mark_failed(i, "e", NOW, retryable=True),
            }[op]
            if allowed:
                call()
                model[action_id] = _AFTER[op]
                starts[action_id] += op == "start"
            else:
                with pytest.raises(StoreError):
                    call()
        rows = store.list_actions()
        assert [row.action_id for row in rows] == order
        for row in rows:
            expected = model[row.action_id]
            assert row.state.value == expected.removesuffix("_retryable")
            assert row.starts == starts[row.action_id]
            assert (row.retryable is True) == (expected == "failed_retryable")
            assert (row.finished_s is not None) == (expected.startswith(("done", "failed")))
        unfinished = [i for i in order if model[i] in ("planned", "started")]
        assert [row.action_id for row in store.unfinished_actions()] == unfinished
