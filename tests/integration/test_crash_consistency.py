"""Crash consistency: the supervisor SIGKILLed at 50 points of a scripted run of faults
and recoveries, restarted on the same store each time, finishes every recovery once.

The real ``resurgo-supervisor`` process runs against a fake Slurm CLI
(``tests/fixtures/fakeslurm``), a real SQLite store, and node agents and an
in-job driver played by the test over the real signed HTTP protocol
(``tests/integration/crash_world.py``). One round is a scripted job:

1. submitted held, registered from its job directory, released; trains on
   node1-4 (two ranks per node) and commits step 10;
2. a rank on node3 dies by SIGKILL -> node3 drained, allocation shrunk to 3
   nodes, step relaunched (attempt 2), commits step 20;
3. node2 reports a hang with its rank behind -> node2 drained, shrunk to 2,
   relaunched (attempt 3), commits step 30;
4. node1, the batch host, goes silent -> its lease expires: node1 drained
   and the job requeued on 4 nodes elsewhere (requeuehold, resize, release;
   attempt 4), commits step 40;
5. Slurm requeues the job by itself -> adopted, never requeued on top of it
   (attempt 5), commits step 50;
6. the step succeeds and the job completes.

Kill points, reproducible from ``SEED`` (``RESURGO_CRASH_SEED`` tries
others; the seed, the round and every point fired are printed in a failure).
Each round draws 13 points and attaches each to a script step; after a step
its points are played one at a time (armed, fired, the daemon restarted)
while the agents and the driver go on, and the next step waits for them.
A point is one of

- ``mutation`` (5-8 a round, on the three fault steps): the fake kills the
  daemon at its next state-changing Slurm command, just before applying it
  or just after applying and logging it (the side effect done, not yet
  recorded: the worst moment);
- ``query``: at its N-th Slurm query from arming (a poll, a reconcile
  check, the wait inside a requeue);
- ``delay``: the test SIGKILLs it some seconds after arming, wherever it is.

After each kill the daemon is restarted on the same store, at once or, for
15% of the points, after 3 s down (longer than an agent's lease), and the
script goes on. Rounds repeat until 50 kills fired and at least 12 of them
were mutation points fired after their command took effect (the worst
moment; a mutation point whose commands never come is skipped, so rounds go
on until the 12 are reached; both counts are asserted). Checked after every
restart: the store passes ``PRAGMA integrity_check``, its decisions chain
(each starts where the previous ended), attempts are numbered 1..N with at
most one open, no Slurm side effect was applied twice, and the ``_total``
counters on /metrics never went down. At the end of each round: every
action finished (none left planned or started, none failed), each drain,
shrink, requeue and relaunch happened exactly once, the job record agrees
with its attempts, decisions, drains and metrics.

The same worst moment on the live cluster, with real Slurm and real ranks:
``test_a_supervisor_killed_after_each_slurm_change_before_recording_it_recovers_once``
in tests/integration/test_recovery_live.py.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import random
import shutil
import signal
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import pytest

from agent.wire.protocol import EventKind
from supervisor.act.reconcile import command_attempt
from supervisor.jobs import JobSpec, read_secret, submit
from supervisor.jobs import job_dir as job_directory
from supervisor.slurm import SlurmClient
from tests.conftest import free_port
from tests.integration.crash_world import (
    Agent,
    Api,
    Daemon,
    Driver,
    Metrics,
    StoreView,
    fake_state,
    fakeslurm,
)

# Fixed for reproducibility; RESURGO_CRASH_SEED explores others (printed on failure).
SEED = int(os.environ.get("RESURGO_CRASH_SEED", "20251"))
KILLS = int(os.environ.get("RESURGO_CRASH_KILLS", "50"))
KILLS_PER_ROUND = 13
MAX_ROUNDS = 8
NODES = tuple(f"node{i}" for i in range(1, 9))
STEP_TIMEOUT_S = 60.0
# A mutation trigger that has not fired by then waits for commands that will not come.
MUTATION_PATIENCE_S = 8.0
TICK_S = 0.05
# Kills between a state-changing Slurm command taking effect and its record (the
# window this test exists for): rounds go on until this many fired, whatever the
# other points did.
MIN_WORST_KILLS = int(os.environ.get("RESURGO_CRASH_WORST_KILLS", "12"))
EXPECTED_RESTARTS = {"rank_signal": 1, "hang": 1, "node_lost": 1, "slurm_requeue": 1}


@dataclass(frozen=True)
class KillPoint:
    """Where the daemon dies next (see the module docstring)."""

    kind: str
    gap: int = 1
    when: str = "after"
    delay_s: float = 0.0
    down_s: float = 0.0  # how long the supervisor stays down before its restart

    def __str__(self) -> str:
        if self.kind == "mutation":
            where = f"{self.when} state-changing Slurm command #{self.gap} from arming"
        elif self.kind == "query":
            where = f"at Slurm query #{self.gap} from arming"
        else:
            where = f"{self.delay_s:.2f} s after arming"
        return f"{where}, down {self.down_s:.1f} s" if self.down_s else where


# A share of the restarts wait this long, longer than an agent's lease (2 s here).
LONG_DOWN_SHARE = 0.15
LONG_DOWN_S = 3.0


def kill_plan(rng: random.Random, count: int, steps: list[Step]) -> dict[int, list[KillPoint]]:
    """``count`` kill points by script step index: 5-8 at the state-changing Slurm
    commands the fault steps cause (first in a step's list: they aim at its first
    commands), the rest at queries or times after any step but the last, which
    only waits for the end."""
    plan: dict[int, list[KillPoint]] = {}
    slots = [index for index, step in enumerate(steps) for _ in range(step.commands)]
    at_commands = min(count, rng.randint(5, 8))
    for index in sorted(rng.sample(slots, at_commands)):
        # Mostly after: the command took effect and is not recorded yet.
        when = rng.choices(("before", "after"), weights=(1, 3))[0]
        plan.setdefault(index, []).append(KillPoint("mutation", 1, when))
    for _ in range(count - at_commands):
        index = rng.randrange(len(steps) - 1)
        if rng.random() < 0.5:
            point = KillPoint("query", rng.randint(1, 30))
        else:
            point = KillPoint("delay", delay_s=round(rng.uniform(0.05, 2.0), 2))
        plan.setdefault(index, []).append(point)
    # Some restarts take longer than an agent's lease (a slow host, systemd's
    # restart delay): the time down must not pass for lost nodes.
    for points in plan.values():
        for index, point in enumerate(points):
            if rng.random() < LONG_DOWN_SHARE:
                points[index] = replace(point, down_s=LONG_DOWN_S)
    return plan


@dataclass
class Step:
    """One scripted step: run ``act`` once ``ready`` holds."""

    name: str
    ready: Callable[[], bool]
    act: Callable[[], None]
    commands: int = 0  # the state-changing Slurm commands the daemon runs because of it


@dataclass
class Round:
    """One scripted job under kills: its world, its script, its kill plan, what it saw."""

    number: int
    root: Path
    templates: Path
    rng: random.Random
    kills: int
    timeline: list[str] = field(default_factory=list)
    fired: list[str] = field(default_factory=list)
    # mutation points fired after their command took effect, before it was recorded
    worst: int = 0
    skipped: list[str] = field(default_factory=list)
    violations: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.fake_dir = self.root / "slurm"
        fakeslurm.create(self.fake_dir, NODES)
        self.bin_dir = fakeslurm.install(self.root / "bin")
        self.daemon = Daemon(self.root / "state", free_port(), self.fake_dir, self.bin_dir)
        self.store = StoreView(self.daemon.state_dir / "resurgo.db")
        self.metrics = Metrics(self.daemon.url)
        self.ckpt_root = self.root / "ckpt"
        self.launch_counts: Counter[str] = Counter()
        self.drivers: list[Driver] = []
        self.driver: Driver | None = None
        self.job_id = ""
        self.api: Api | None = None
        self.background = 0
        self.current: KillPoint | None = None
        self.queue: list[KillPoint] = []
        self.armed_at = 0.0
        self.started = time.monotonic()

    # --- the run -------------------------------------------------------------------

    def run(self) -> None:
        """Play the script to the job's end under the kill plan; record what was violated.

        After each step its kill points are played one by one (armed, fired,
        the daemon restarted) while the world goes on; the next step waits
        for them.
        """
        self.background = fakeslurm.add_job(self.fake_dir, "other-work", NODES[4:])
        self._start_daemon()
        steps = self._script()
        plan = kill_plan(self.rng, self.kills, steps)
        index, since = 0, time.monotonic()
        next_scrape = 0.0
        try:
            while index < len(steps) or self.current is not None:
                now = time.monotonic()
                self._kills(now)
                self._world(time.time())
                if now >= next_scrape:
                    next_scrape = now + 1.0
                    self.metrics.scrape(f"{self.elapsed()} scrape")
                if self.current is None and index < len(steps):
                    step = steps[index]
                    if step.ready():
                        self.note(f"step {step.name}")
                        step.act()
                        self.queue = list(plan.get(index, []))
                        self._arm_next()
                        index, since = index + 1, now
                    elif now - since > STEP_TIMEOUT_S:
                        raise AssertionError(
                            f"step {step.name!r} not ready after {STEP_TIMEOUT_S} s"
                        )
                time.sleep(TICK_S)
            self.metrics.scrape("end of round")
        finally:
            self.daemon.close()
        self.check_after_restart("end of round")
        self.check_end()
        self.store.close()

    def elapsed(self) -> str:
        return f"+{time.monotonic() - self.started:.1f}s"

    def note(self, what: str) -> None:
        self.timeline.append(f"{self.elapsed()} {what}")

    # --- kills and restarts --------------------------------------------------------

    def _start_daemon(self) -> None:
        if not self.daemon.start():
            raise AssertionError("the supervisor was killed while starting with nothing armed")
        self.note(f"daemon start {self.daemon.starts}")

    def _arm_next(self) -> None:
        self.current = self.queue.pop(0) if self.queue else None
        self.armed_at = time.monotonic()
        if self.current is None:
            return
        if self.current.kind in ("mutation", "query"):
            fakeslurm.arm_kill(
                self.fake_dir, self.current.kind, self.current.gap, self.current.when
            )
        self.note(f"armed: {self.current}")

    def _skip_mutation_point(self) -> None:
        """Give up a mutation point that has nothing left to hit; arm the next point."""
        point = self.current
        if point is None or fakeslurm.disarm_kill(self.fake_dir) is None:
            return  # it fired meanwhile: the daemon is dying
        self.skipped.append(str(point))
        self.note(f"skipped: {point}")
        self._arm_next()

    def _kills(self, now: float) -> None:
        code = self.daemon.exit_code()
        point = self.current
        if code is None and point is not None:
            if point.kind == "delay" and now - self.armed_at >= point.delay_s:
                self.daemon.kill()
                code = self.daemon.exit_code()
            elif point.kind == "mutation" and now - self.armed_at > MUTATION_PATIENCE_S:
                self._skip_mutation_point()
        if code is None:
            return
        if code != -signal.SIGKILL or point is None:
            raise AssertionError(f"the supervisor exited with {code} by itself")
        fired = fake_state(self.fake_dir)["fired"]
        hit = ""
        if point.kind != "delay":
            last = fired[-1] if fired else {}
            hit = f": {last.get('command')} {' '.join(last.get('argv', []))}"
        self.fired.append(f"{point}{hit}")
        self.worst += point.kind == "mutation" and point.when == "after"
        self.note(f"KILLED #{len(self.fired)} {point}{hit}")
        self.current = None
        back = time.monotonic() + point.down_s
        while time.monotonic() < back:  # the agents and the driver go on meanwhile
            self._world(time.time())
            time.sleep(TICK_S)
        if not self.daemon.start():
            raise AssertionError("the supervisor was killed while starting with nothing armed")
        self.note(f"daemon start {self.daemon.starts}")
        self.metrics.scrape(f"after restart {self.daemon.starts}")
        self.check_after_restart(f"after kill #{len(self.fired)} ({point}{hit})")
        self._arm_next()

    # --- the world: the job's driver and agents --------------------------------------

    def _world(self, now: float) -> None:
        if not self.job_id:
            return
        job = fake_state(self.fake_dir)["jobs"][self.job_id]
        running = job["state_name"] == "RUNNING"
        if running and (self.driver is None or job["batch_runs"] != self.driver.batch_run):
            assert self.api is not None
            if self.driver is not None:
                self.driver.dead = True
            self.driver = Driver(self.api, job["batch_runs"], tuple(job["nodes"]),
                                 self.launch_counts)  # fmt: skip
            self.drivers.append(self.driver)
            self.note(f"batch script run {job['batch_runs']} on {','.join(job['nodes'])}")
        if self.driver is None:
            return
        if not running:
            self.driver.dead = True
            return
        self.driver.pump(now)
        for agent in self.driver.agents:
            if agent.node in job["nodes"]:
                agent.pump(now)

    def _agents(self) -> list[Agent]:
        return [] if self.driver is None else self.driver.agents

    def _record(self) -> dict[str, Any]:
        record = self.store.record(self.job_id) if self.job_id else None
        return record or {}

    def _running(self, attempt: int) -> Callable[[], bool]:
        def ready() -> bool:
            record = self._record()
            agents = self._agents()
            return (
                record.get("state") == "running"
                and record.get("attempt") == attempt
                and bool(agents)
                and all(agent.attempt == attempt for agent in agents)
            )

        return ready

    def _committed(self, step: int) -> Callable[[], bool]:
        return lambda: self._record().get("last_step") == step

    # --- the script ----------------------------------------------------------------------

    def _resume_chosen(self, attempt: int) -> Callable[[], bool]:
        # Slurm's begin time (~120 s) outlasts the validation here: a driver asking
        # before the checkpoint is chosen is told to wait, and never asks START again.
        def ready() -> bool:
            record = self._record()
            recovery = record.get("recovery") or {}
            return (
                record.get("state") == "requeued"
                and record.get("attempt") == attempt
                and bool(recovery.get("validated"))
            )

        return ready

    def _script(self) -> list[Step]:
        return [
            Step("submit the job", lambda: True, self._submit),
            Step("commit step 10", self._running(1), lambda: self._commit(10)),
            # drain node3, shrink
            Step("SIGKILL a rank on node3", self._committed(10), self._kill_rank, commands=2),
            Step("commit step 20", self._running(2), lambda: self._commit(20)),
            # drain node2, shrink
            Step("hang on node2", self._committed(20), self._hang, commands=2),
            Step("commit step 30", self._running(3), lambda: self._commit(30)),
            # drain node1, requeuehold, resize, start time, release
            Step("lose node1, the batch host", self._committed(30), self._lose_batch_host,
                 commands=5),
            Step("commit step 40", self._running(4), lambda: self._commit(40)),
            Step("Slurm requeues the job itself", self._committed(40), self._slurm_requeue),
            Step("Slurm starts it again", self._resume_chosen(5),
                 lambda: fakeslurm.release_begin_time(self.fake_dir, int(self.job_id))),
            Step("commit step 50", self._running(5), lambda: self._commit(50)),
            Step("the ranks finish", self._committed(50), self._finish),
            Step("the batch script exits 0", self._finished_reported, self._complete),
            Step("the job completed", self._settled, lambda: None),
        ]  # fmt: skip

    def _submit(self) -> None:
        jobs_dir = self.daemon.state_dir / "jobs"
        spec = JobSpec(
            name="crash", nodes=4, command=("torchrun", "train.py"),
            ckpt_root=str(self.ckpt_root), min_nodes=1, procs_per_node=2,
            supervisor_url=self.daemon.url,
        )  # fmt: skip
        client = SlurmClient(
            env={"PATH": self.daemon.env["PATH"], "FAKESLURM_DIR": str(self.fake_dir)}
        )
        self.job_id = asyncio.run(submit(spec, jobs_dir, client))
        secret = read_secret(job_directory(jobs_dir, self.job_id))
        self.api = Api(self.daemon.url, self.job_id, secret)
        self.note(f"job {self.job_id} submitted")

    def _commit(self, step: int) -> None:
        path = self.ckpt_root / f"step-{step}"
        if not path.exists():
            shutil.copytree(self.templates / f"step-{step}", path)
        leader = next(agent for agent in self._agents() if agent.node_rank == 0)
        leader.emit(EventKind.CHECKPOINT_COMMITTED, {"step": step, "path": str(path),
                                                     "global_rank": 0})  # fmt: skip

    def _kill_rank(self) -> None:
        assert self.driver is not None
        agent = self.driver.agent_on("node3")
        rank = agent.ranks[0]
        agent.emit(EventKind.RANK_EXITED, {
            "global_rank": rank, "local_rank": 0, "pid": 1000 + rank, "exit_code": None,
            "signal": 9, "signal_name": "SIGKILL", "last_step": agent.step, "phase": "train",
            "exit_time_unix_s": time.time(),
        })  # fmt: skip

    def _hang(self) -> None:
        assert self.driver is not None
        agent = self.driver.agent_on("node2")
        behind, waiting = agent.ranks
        agent.emit(EventKind.HANG, {
            "hung": [{"global_rank": rank, "local_rank": rank % 2, "pid": 1000 + rank,
                      "last_step": agent.step - lag, "phase": "train",
                      "seconds_since_progress": 30.0 + lag, "timeout_s": 30.0,
                      "detector": "heartbeat"} for rank, lag in ((behind, 3), (waiting, 0))],
            "stacks": {str(behind): "Thread 1: train_step (train.py:40)",
                       str(waiting): "Thread 1: allreduce (distributed_c10d.py:2050)"},
            "culprits": [
                {"global_rank": behind, "last_step": agent.step - 3, "in_collective": False,
                 "reason": "3 steps behind, outside the collective"},
                {"global_rank": waiting, "last_step": agent.step, "in_collective": True,
                 "reason": "waits in allreduce"},
            ],
        })  # fmt: skip

    def _lose_batch_host(self) -> None:
        assert self.driver is not None
        fakeslurm.end_job(self.fake_dir, self.background, "COMPLETED")
        self.driver.agent_on("node1").silent = True
        self.driver.dead = True  # the batch script ran on node1

    def _slurm_requeue(self) -> None:
        fakeslurm.slurm_requeue(self.fake_dir, int(self.job_id), "BeginTime")

    def _finish(self) -> None:
        for agent in self._agents():
            agent.stopped = True  # no more heartbeats: the ranks are done
            for rank in agent.ranks:
                agent.emit(EventKind.RANK_EXITED, {
                    "global_rank": rank, "local_rank": rank % 2, "pid": 1000 + rank,
                    "exit_code": 0, "signal": None, "signal_name": None,
                    "last_step": agent.step, "phase": "train",
                })  # fmt: skip
            agent.emit(EventKind.LAUNCHER_EXITED, {"exit_code": 0, "signal": None})
            agent.emit(EventKind.AGENT_STOPPED, {"reason": "launcher exited 0"})

    def _finished_reported(self) -> bool:
        return all(not agent.outbox for agent in self._agents())

    def _complete(self) -> None:
        assert self.driver is not None
        self.driver.done = True
        fakeslurm.end_job(self.fake_dir, int(self.job_id), "COMPLETED")

    def _settled(self) -> bool:
        if self._record().get("state") != "completed":
            return False
        unfinished = self.store.rows(
            "SELECT COUNT(*) FROM actions WHERE state IN ('planned', 'started')"
        )
        return bool(unfinished[0][0] == 0)

    # --- invariants -------------------------------------------------------------------------

    def violate(self, when: str, what: str) -> None:
        self.violations.append(f"{when}: {what}")

    def check_after_restart(self, when: str) -> None:
        """What must hold at any moment, checked from the store, the fake's log and /metrics."""
        integrity = self.store.integrity()
        if integrity != ["ok"]:
            self.violate(when, f"PRAGMA integrity_check: {integrity[:5]}")
        for problem in self.metrics.decreases:
            self.violate(when, f"counter went down: {problem}")
        self.metrics.decreases.clear()
        if not self.job_id:
            return
        decisions = self.store.rows(
            "SELECT from_state, to_state, detail FROM decisions WHERE job_id = ?"
            " ORDER BY decision_id",
            self.job_id,
        )
        for (_, before, _), (after, _, _) in itertools.pairwise(decisions):
            if before != after:
                self.violate(
                    when, f"decisions do not chain: one ends {before}, next starts {after}"
                )
        attempts = self.store.rows(
            "SELECT attempt, ended_s FROM attempts WHERE job_id = ? ORDER BY attempt", self.job_id
        )
        numbers = [number for number, _ in attempts]
        if numbers != list(range(1, len(numbers) + 1)):
            self.violate(when, f"attempts are not 1..N: {numbers}")
        open_attempts = [number for number, ended in attempts if ended is None]
        if len(open_attempts) > 1:
            self.violate(when, f"more than one open attempt: {open_attempts}")
        record = self._record()
        if attempts and record and record["attempt"] < numbers[-1]:
            self.violate(when, f"record at attempt {record['attempt']} behind attempts {numbers}")
        for problem in self._repeated_side_effects():
            self.violate(when, problem)

    def _daemon_calls(self) -> list[dict[str, Any]]:
        return [c for c in fakeslurm.calls(self.fake_dir) if c["caller"] == "daemon"]

    def _repeated_side_effects(self) -> list[str]:
        """Slurm side effects the daemon applied more than once (the fake's call log)."""
        problems = []
        applied = [c for c in self._daemon_calls() if c["applied"]]
        drains = Counter(c["argv"][2] for c in applied if "State=DRAIN" in c["argv"])
        shrinks = Counter(c["argv"][3] for c in applied if c["argv"][3:4]
                          and c["argv"][3].startswith("NodeList="))  # fmt: skip
        holds = [c for c in applied if c["argv"][1] == "requeuehold"]
        releases = [c for c in applied if c["argv"][1] == "release" and c["changed"]]
        cancels = [c for c in applied if c["command"] == "scancel"]
        problems += [f"{node} drained {n} times" for node, n in drains.items() if n > 1]
        problems += [f"shrink to {nodes} run {n} times" for nodes, n in shrinks.items() if n > 1]
        if len(holds) > 1:
            problems.append(f"requeuehold run {len(holds)} times (one requeue is ordered)")
        if len(releases) > 1:
            problems.append(f"held job released {len(releases)} times")
        if cancels:
            problems.append(f"scancel run {len(cancels)} times on a job that completes by itself")
        slurm_requeue = [i for i, c in enumerate(fakeslurm.calls(self.fake_dir))
                         if c["argv"][0] == "(requeue)"]  # fmt: skip
        if slurm_requeue:
            after = fakeslurm.calls(self.fake_dir)[slurm_requeue[0] :]
            if any(c["caller"] == "daemon" and c["argv"][1] == "requeuehold" for c in after):
                problems.append("requeued on top of Slurm's own requeue")
        return problems

    def check_end(self) -> None:
        """The job's whole story, once it completed."""
        when = "end of round"
        record = self._record()
        if record.get("state") != "completed" or record.get("attempt") != 5:
            self.violate(when, f"job {record.get('state')} at attempt {record.get('attempt')}, "
                         "expected completed at attempt 5")  # fmt: skip
        restarts = dict(record.get("restarts", []))
        if restarts != EXPECTED_RESTARTS:
            self.violate(when, f"restarts {restarts}, expected {EXPECTED_RESTARTS}")
        if sum(restarts.values()) != record.get("attempt", 0) - 1:
            self.violate(when, f"{sum(restarts.values())} restarts for attempt {record['attempt']}")
        actions = self.store.rows(
            "SELECT action_id, kind, state, starts, error FROM actions WHERE job_id = ?"
            " ORDER BY seq",
            self.job_id,
        )
        for action_id, _, state, starts, error in actions:
            if state != "done":
                self.violate(when, f"action {action_id} is {state} (starts {starts}): {error}")
        done = {action_id for action_id, _, state, _, _ in actions if state == "done"}
        job = self.job_id
        expected = {
            f"{job}/2/drain/node3", f"{job}/2/shrink/node1,node2,node4", f"{job}/2/relaunch/3",
            f"{job}/3/drain/node2", f"{job}/3/shrink/node1,node4", f"{job}/3/relaunch/2",
            f"{job}/4/drain/node1", f"{job}/4/requeue/4",
        }  # fmt: skip
        if not expected <= done:
            self.violate(when, f"actions never done: {sorted(expected - done)}")
        relaunches = {a for a in done if "/relaunch/" in a}
        if dict(self.launch_counts) != dict.fromkeys(relaunches, 1):
            self.violate(when, f"relaunches launched {dict(self.launch_counts)}, "
                         f"done in the store {sorted(relaunches)}")  # fmt: skip
        applied = [c for c in self._daemon_calls() if c["applied"]]
        drained = sorted(c["argv"][2] for c in applied if "State=DRAIN" in c["argv"])
        if drained != ["NodeName=node1", "NodeName=node2", "NodeName=node3"]:
            self.violate(when, f"drains applied in Slurm: {drained}")
        shrunk = sorted(c["argv"][3] for c in applied if c["argv"][3:4]
                        and c["argv"][3].startswith("NodeList="))  # fmt: skip
        if shrunk != ["NodeList=node[1,4]", "NodeList=node[1-2,4]"]:
            self.violate(when, f"shrinks applied in Slurm: {shrunk}")
        survived = self.daemon.exceptions()
        if survived:
            # Each is a step the daemon skipped; a restart may have hidden the cost.
            self.violate(when, "the supervisor logged exceptions it went on after:\n"
                         + "\n".join(survived))  # fmt: skip
        holds = [c for c in applied if c["argv"][1] == "requeuehold"]
        if len(holds) != 1:
            self.violate(when, f"{len(holds)} requeuehold(s) applied, expected 1")
        drains = self.store.rows(
            "SELECT node, cause, action_id FROM drains WHERE job_id = ? ORDER BY drain_id", job
        )
        expected_drains = [
            ("node3", "rank_signal", f"{job}/2/drain/node3"),
            ("node2", "hang", f"{job}/3/drain/node2"),
            ("node1", "node_lost", f"{job}/4/drain/node1"),
        ]
        if drains != expected_drains:
            self.violate(when, f"drain audit {drains}, expected {expected_drains}")
        attempts = self.store.rows(
            "SELECT attempt, ended_s FROM attempts WHERE job_id = ? ORDER BY attempt", job
        )
        if [a for a, _ in attempts] != [1, 2, 3, 4, 5] or any(e is None for _, e in attempts):
            self.violate(when, f"attempts {attempts}, expected 1..5 all ended")
        last = self.store.rows(
            "SELECT to_state FROM decisions WHERE job_id = ? ORDER BY decision_id DESC LIMIT 1",
            job,
        )
        if not last or last[0][0] != "completed":
            self.violate(when, f"last decision ends in {last}, the job is completed")
        for cause, count in EXPECTED_RESTARTS.items():
            seen = self.metrics.value("resurgo_job_restarts_total", cause=cause, job_id=job)
            if seen != count:
                self.violate(when, f"resurgo_job_restarts_total{{cause={cause}}} {seen}")
        for cause in ("rank_signal", "hang", "node_lost"):
            seen = self.metrics.value("resurgo_drains_total", cause=cause)
            if seen != 1:
                self.violate(when, f"resurgo_drains_total{{cause={cause}}} {seen}")
        for driver in self.drivers:
            for agent in [*driver.retired, *driver.agents]:
                for command_id in agent.stop_commands:
                    made_for = command_attempt(command_id)
                    if made_for is None or made_for <= agent.attempt:
                        self.violate(when, f"stop {command_id} reached an agent of attempt "
                                     f"{agent.attempt} on {agent.node.agent}")  # fmt: skip

    def report(self) -> str:
        return "\n".join(
            [
                f"round {self.number}: kills fired {len(self.fired)}, skipped {self.skipped}",
                *(f"  kill #{i + 1}: {kill}" for i, kill in enumerate(self.fired)),
                "  timeline:",
                *(f"    {line}" for line in self.timeline[-60:]),
            ]
        )


def make_templates(root: Path) -> Path:
    """Committed checkpoints for steps 10..50, copied into a job's root as it commits them."""
    from tests.ckpt_helpers import make_committed_checkpoint

    for step in (10, 20, 30, 40, 50):
        make_committed_checkpoint(root, step)
    return root


@pytest.mark.slow
@pytest.mark.long
def test_a_supervisor_killed_at_50_points_finishes_every_recovery_exactly_once(
    tmp_path: Path,
) -> None:
    templates = make_templates(tmp_path / "templates")
    rounds: list[Round] = []
    fired = worst = 0
    started = time.monotonic()
    while (fired < KILLS or worst < MIN_WORST_KILLS) and len(rounds) < MAX_ROUNDS:
        number = len(rounds) + 1
        rng = random.Random(f"{SEED}/{number}")
        count = max(min(KILLS_PER_ROUND, KILLS - fired), 8 if worst < MIN_WORST_KILLS else 0)
        game = Round(number, tmp_path / f"round-{number}", templates, rng, count)
        rounds.append(game)
        try:
            game.run()
        except AssertionError as error:
            pytest.fail(
                f"seed {SEED}, round {number} stuck: {error}\n{game.report()}\n"
                f"--- supervisor log ---\n{game.daemon.tail()}"
            )
        if game.violations:
            pytest.fail(
                f"seed {SEED}, round {number}: invariants violated:\n  "
                + "\n  ".join(game.violations)
                + f"\n{game.report()}\n--- supervisor log ---\n{game.daemon.tail()}"
            )
        fired += len(game.fired)
        worst += game.worst
    summary = "\n".join(
        line for game in rounds for line in game.report().split("  timeline:")[0].splitlines()
    )
    took_s = time.monotonic() - started
    print(f"seed {SEED}: {fired} kills in {len(rounds)} rounds, {worst} between a Slurm "
          f"command's effect and its record, {took_s:.0f} s\n{summary}")  # fmt: skip
    assert fired >= KILLS, f"seed {SEED}: only {fired} of {KILLS} kill points fired\n{summary}"
    assert worst >= MIN_WORST_KILLS, (
        f"seed {SEED}: only {worst} kills between a Slurm command's effect and its record "
        f"(at least {MIN_WORST_KILLS})\n{summary}"
    )
