"""The executor keeps actions exactly-once across SIGKILLs of the process running it.

A worker process runs the real :class:`supervisor.act.executor.Executor` on a real
store: at start it reconciles what it finds unfinished (``Executor.reconcile``),
then records a decision and carries out one drain after another
(``Executor.execute``: plan, ``mark_started``, the side effect, ``mark_done``).
Slurm's part is played by an append-only log, one ``write()`` per drain: a
SIGKILL cannot tear it, and a drain is applied the moment the write returns,
as a drain Slurm has taken; reconciliation reads it the way it reads
``sinfo``.

The test kills the worker 20 times and checks the store after every kill.
Half the kills are aimed at the worst moment: the worker SIGKILLs itself
right after a drain was applied and before the executor recorded it (the
window this test exists for); the other half land wherever a timer finds
the worker. The test asserts that every aimed kill landed in that window,
and that the restarted executor then marked the drain done without running
it again.

Run as ``python test_store_crash.py WORKER|DRAIN DB EFFECTS KILL_AFTER`` it is
the worker (``KILL_AFTER``: the drain after which it kills itself, 0: none).
"""

from __future__ import annotations

import asyncio
import os
import random
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from supervisor.act.executor import Executor
from supervisor.core.intents import DrainNode
from supervisor.core.model import Cause
from supervisor.slurm.parse import NodeFlag, NodeState, SlurmNode
from supervisor.store import ActionState, Store

JOB = "4242"
KILLS = 20
NOW = 1_700_000_000.0


def _effects(path: Path) -> list[str]:
    return path.read_text().split() if path.exists() else []


class _Nodes:
    """``sinfo`` as the log shows it: every node exists; drained once its line is there."""

    def __init__(self, drained: set[str], reasons: dict[str, str]) -> None:
        self._drained, self._reasons = drained, reasons

    def get(self, name: str) -> SlurmNode:
        drained = name in self._drained
        return SlurmNode(
            name=name, state=NodeState.IDLE, state_raw="IDLE+DRAIN" if drained else "IDLE",
            flags=frozenset({NodeFlag.DRAIN}) if drained else frozenset(),
            flags_raw=("DRAIN",) if drained else (), reason=self._reasons.get(name, ""),
            reason_set_by=None, reason_changed_at=None, address=None, cpus=1, alloc_cpus=0,
            partitions=("debug",),
        )  # fmt: skip


class LoggedSlurm:
    """The drains of :class:`~supervisor.slurm.SlurmActions`, applied to the log."""

    def __init__(self, path: Path, kill_after: int) -> None:
        self._path = path
        self._fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        self._kill_after = kill_after
        self._applied = 0

    async def drain(self, node: str, reason: str) -> None:
        assert reason == _reason(node)
        os.write(self._fd, f"{node}\n".encode())
        self._applied += 1
        if self._applied == self._kill_after:
            os.kill(os.getpid(), signal.SIGKILL)  # applied, not yet recorded: the worst moment

    async def nodes(self) -> _Nodes:
        drained = set(_effects(self._path))
        return _Nodes(drained, {node: _reason(node) for node in drained})

    async def resume(self, node: str) -> None:
        raise AssertionError("the worker only drains")

    async def shrink(self, job_id: int, keep_nodes: Sequence[str]) -> None:
        raise AssertionError("the worker only drains")

    async def requeue_smaller(
        self, job_id: int, n_nodes: int, n_tasks: int, exclude_nodes: Sequence[str] = ()
    ) -> None:
        raise AssertionError("the worker only drains")

    async def cancel(self, job_id: int, signal: str | None = None) -> None:
        raise AssertionError("the worker only drains")

    async def job(self, job_id: int) -> None:
        raise AssertionError("the worker only drains")


def _drain(index: int) -> DrainNode:
    # One node per action: a node drained earlier cannot pass for this action's effect.
    return DrainNode(JOB, index + 1, f"n{index}", Cause.HANG, "store crash test")


def _reason(node: str) -> str:
    return _drain(int(node[1:])).slurm_reason


def _run_worker(db_path: Path, effects_path: Path, kill_after: int, drain_only: bool) -> None:
    """Reconcile what is unfinished, then decide and carry out drains until killed."""
    store = Store.open(db_path)
    if store.get_job(JOB) is None:
        store.upsert_job(
            JOB, state="running", record={}, now_s=NOW, name="crash", original_nodes=4, min_nodes=1
        )
    executor = Executor(
        store, LoggedSlurm(effects_path, kill_after), checkpoint_root_of=lambda _: None
    )

    async def work() -> None:
        await executor.reconcile(NOW)
        if drain_only:
            return
        index = len(store.list_actions())
        while True:
            intent = _drain(index)
            with store.transaction():
                store.record_decision(JOB, None, "running", "recovering", "hang", {"i": index}, NOW)
                executor.plan(JOB, [intent], NOW)
            await executor.execute(JOB, [intent], NOW)
            index += 1

    asyncio.run(work())
    store.close()


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
    by_node = {row.args["node"]: row for row in actions}
    # The intent is durable before the effect: nothing ran that is not at least started.
    assert {by_node[node].state for node in effects} <= {ActionState.STARTED, ActionState.DONE}
    for row in actions:
        if row.state is ActionState.DONE:
            assert row.args["node"] in effects, f"{row.action_id} is done but never ran"
        assert row.state is not ActionState.FAILED, (row.action_id, row.error)
    # The worker runs one action at a time: only the newest can be unfinished.
    assert len(unfinished) <= 1
    if unfinished:
        assert unfinished[0].action_id == actions[-1].action_id
    return [row.action_id for row in unfinished]


def _in_window(db_path: Path, effects_path: Path) -> str | None:
    """The action killed between its side effect and its record, if the last kill was so."""
    with Store.open(db_path, create=False) as store:
        started = [row for row in store.unfinished_actions() if row.state is ActionState.STARTED]
    effects = set(_effects(effects_path))
    return next((row.action_id for row in started if row.args["node"] in effects), None)


def test_sigkilled_executor_never_runs_an_action_twice_nor_loses_one(tmp_path: Path) -> None:
    db_path, effects_path = tmp_path / "store.db", tmp_path / "effects.log"
    rng = random.Random(20240611)
    in_window: list[str] = []
    for kill in range(KILLS):
        aimed = kill % 2 == 0
        kill_after = rng.randint(3, 40) if aimed else 0
        worker = subprocess.Popen(
            [sys.executable, __file__, "WORKER", str(db_path), str(effects_path), str(kill_after)]
        )
        if aimed:
            assert worker.wait(timeout=60) == -signal.SIGKILL, "the aimed kill did not fire"
        else:
            time.sleep(rng.uniform(0.25, 0.6))
            assert worker.poll() is None, "the worker died by itself"
            worker.send_signal(signal.SIGKILL)
            worker.wait(timeout=10)
        _check(db_path, effects_path)
        caught = _in_window(db_path, effects_path)
        if aimed:
            assert caught is not None, f"kill {kill} did not land between effect and record"
        if caught is not None:
            in_window.append(caught)
    subprocess.run(
        [sys.executable, __file__, "DRAIN", str(db_path), str(effects_path), "0"],
        check=True,
        timeout=60,
    )
    assert _check(db_path, effects_path) == []
    with Store.open(db_path, create=False) as store:
        actions = store.list_actions()
        rows = {row.action_id: row for row in actions}
    assert len(in_window) >= KILLS // 2
    # Each action killed in the window was finished by a restarted executor, which
    # found its drain in Slurm's log and did not run it again (checked above: no
    # effect twice).
    for action_id in in_window:
        row = rows[action_id]
        assert row.state is ActionState.DONE and "reconciled" in (row.result or {}), row
    done = [row for row in actions if row.state is ActionState.DONE]
    assert len(actions) > 2 * KILLS, "the worker barely ran between kills"
    assert sorted(row.args["node"] for row in done) == sorted(_effects(effects_path))
    print(f"{len(actions)} actions, {len(in_window)} kills between a drain and its record")


if __name__ == "__main__":
    mode, db_arg, effects_arg, kill_arg = sys.argv[1:]
    _run_worker(Path(db_arg), Path(effects_arg), int(kill_arg), drain_only=mode == "DRAIN")
