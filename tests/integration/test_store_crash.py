"""The store keeps actions exactly-once across SIGKILLs of the process using it.

A worker process runs the executor's protocol in a loop (decision + plan in one
transaction, ``mark_started``, the side effect, ``mark_done``), and reconciles
what it finds unfinished at start-up against its side-effect log, which plays
Slurm's part. The test SIGKILLs it at random points 20 times and checks the
store after every kill.

Run as ``python test_store_crash.py WORKER DB EFFECTS SEED`` it is the worker.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

from agent.protocol import EventKind, make_event
from supervisor.store import ActionState, Store

JOB = "4242"
KILLS = 20
NOW = 1_700_000_000.0


def _effects(path: Path) -> list[str]:
    return path.read_text().split() if path.exists() else []


def _run_worker(db_path: Path, effects_path: Path, seed: int, drain_only: bool) -> None:
    """The executor: reconcile what is unfinished, then plan and run actions until killed."""
    rng = random.Random(seed)
    store = Store.open(db_path)
    if store.get_job(JOB) is None:
        store.upsert_job(
            JOB, state="running", record={}, now_s=NOW, name="crash", original_nodes=4, min_nodes=1
        )
    effects = os.open(effects_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)

    def execute(action_id: str) -> None:
        # One write() per effect: a SIGKILL cannot tear it, and it is in the page
        # cache the moment write returns, like a drain that Slurm has applied.
        os.write(effects, f"{action_id}\n".encode())

    for row in store.unfinished_actions():
        if row.state is ActionState.STARTED and row.action_id in _effects(effects_path):
            store.mark_done(row.action_id, {"reconciled": True}, NOW)
            continue
        store.mark_started(row.action_id, NOW)
        execute(row.action_id)
        store.mark_done(row.action_id, {}, NOW)
    if drain_only:
        store.close()
        return
    index = len(store.list_actions())
    incarnation = f"{seed:08x}"
    while True:
        action_id = f"{JOB}/{index}/drain/node{index % 4}"
        store.record_events(
            JOB,
            [
                make_event(
                    EventKind.AGENT_STOPPED,
                    JOB,
                    "node1",
                    incarnation,
                    index + 1,
                    NOW,
                    {"reason": "x"},
                )
            ],
            now_s=NOW,
        )
        store.touch_lease(JOB, f"node{index % 4}", incarnation, NOW + index)
        with store.transaction():
            store.record_decision(JOB, None, "running", "recovering", "hang", {"i": index}, NOW)
            store.plan_action(action_id, JOB, "drain", {"node": f"node{index % 4}"}, NOW)
        store.mark_started(action_id, NOW)
        if rng.random() < 0.1:
            store.mark_failed(action_id, "precondition failed", NOW, retryable=False)
        else:
            execute(action_id)
            store.mark_done(action_id, {}, NOW)
        if index % 10 == 0:
            store.flush_leases()
        index += 1


def _check(db_path: Path, effects_path: Path) -> list[str]:
    """Assert the exactly-once invariants after a kill; return the unfinished action ids."""
    with Store.open(db_path, create=False) as store:
        actions = store.list_actions()
        unfinished = store.unfinished_actions()
        duplicates = store._db.execute(
            "SELECT action_id FROM actions GROUP BY action_id HAVING COUNT(*) > 1"
        ).fetchall()
    effects = _effects(effects_path)
    assert duplicates == []
    assert len(effects) == len(set(effects)), "an action's side effect ran twice"
    by_id = {row.action_id: row for row in actions}
    # The intent is durable before the effect: nothing ran that is not at least started.
    assert {by_id[action_id].state for action_id in effects} <= {
        ActionState.STARTED,
        ActionState.DONE,
    }
    for row in actions:
        if row.state is ActionState.DONE:
            assert row.action_id in effects, f"{row.action_id} is done but never ran"
        if row.state is ActionState.FAILED:
            assert row.action_id not in effects
    # The worker runs one action at a time: only the newest can be unfinished.
    assert [row.action_id for row in unfinished] == [
        row.action_id for row in actions if row.state in (ActionState.PLANNED, ActionState.STARTED)
    ]
    assert len(unfinished) <= 1
    if unfinished:
        assert unfinished[0].action_id == actions[-1].action_id
    return [row.action_id for row in unfinished]


def test_sigkilled_executor_never_runs_an_action_twice_nor_loses_one(tmp_path: Path) -> None:
    db_path, effects_path = tmp_path / "store.db", tmp_path / "effects.log"
    rng = random.Random(20240611)
    seen_unfinished = 0
    for kill in range(KILLS):
        worker = subprocess.Popen(
            [sys.executable, __file__, "WORKER", str(db_path), str(effects_path), str(kill)]
        )
        time.sleep(rng.uniform(0.25, 0.6))
        assert worker.poll() is None, "the worker died by itself"
        worker.send_signal(signal.SIGKILL)
        worker.wait(timeout=10)
        seen_unfinished += bool(_check(db_path, effects_path))
    subprocess.run(
        [sys.executable, __file__, "DRAIN", str(db_path), str(effects_path), "999"],
        check=True,
        timeout=30,
    )
    assert _check(db_path, effects_path) == []
    with Store.open(db_path, create=False) as store:
        actions = store.list_actions()
    done = [row for row in actions if row.state is ActionState.DONE]
    assert len(actions) > 2 * KILLS, "the worker barely ran between kills"
    assert sorted(row.action_id for row in done) == sorted(_effects(effects_path))
    print(f"{len(actions)} actions, {seen_unfinished} kills left one unfinished")


if __name__ == "__main__":
    mode, db_arg, effects_arg, seed_arg = sys.argv[1:]
    _run_worker(Path(db_arg), Path(effects_arg), int(seed_arg), drain_only=mode == "DRAIN")
