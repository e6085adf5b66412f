"""The views' world: a store with one job of each kind an operator meets.

:func:`recorded_state_dir` writes, through the store's own API, a state
directory whose jobs are: ``COMPLETED`` (the fault demo's run: 66 s, a
start-up of 27.5 s, a killed rank and a hang close together, 4 -> 3 -> 2
nodes), ``FAILED`` (a crash loop), ``REQUEUED`` (preempted), ``RECOVERING`` (a
hang of two ranks, not yet relaunched), ``SPARED`` (a hot spare swapped in; the
script keeps its own checkpoints) and ``ROLLED_BACK`` (a NaN rolled back, data
skipped) and ``OOM`` (a network failure, then two OOM kills: stopped as the
rule's retry budget is spent). Everything is dated from ``start_s``, so a test can read the store
as of any time after it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from agent.wire import protocol
from agent.wire.protocol import EventKind
from supervisor.core.model import Cause
from supervisor.store import BlameOutcome, Store

COMPLETED, FAILED, REQUEUED, RECOVERING, SPARED, ROLLED_BACK, OOM = (
    "2",
    "3",
    "4",
    "5",
    "6",
    "7",
    "8",
)
JOBS = (COMPLETED, FAILED, REQUEUED, RECOVERING, SPARED, ROLLED_BACK, OOM)
# The completed job's wall time: submission to its end.
COMPLETED_WALL_S = 66.0
INCARNATION = "0123456789abcdef"


def py_spy_dump(pid: int, frames: list[str]) -> str:
    """A stack dump in the layout the agent stores (py-spy's): innermost frame first."""
    lines = [f"Process {pid}: python train_toy.py", "Python v3.11.7 (/usr/bin/python3.11)", ""]
    lines.append(f'Thread {pid} (idle): "MainThread"')
    lines += [f"    {frame}" for frame in frames]
    lines += [f'Thread {pid + 7} (idle): "pin_memory"', "    select (selectors.py:415)"]
    return "\n".join(lines)


_OUTER = ["train_step (train_toy.py:301)", "main (train_toy.py:402)", "<module> (train_toy.py:426)"]
WAITING = py_spy_dump(
    4101, ["all_gather_single (torch/distributed/distributed_c10d.py:3252)", *_OUTER]
)
CULPRIT = py_spy_dump(4303, ["stall_forever (train_toy.py:188)", *_OUTER])


class _Recorder:
    """Writes one job's history at times relative to the world's start."""

    def __init__(self, store: Store, job_id: str, start_s: float) -> None:
        self.store, self.job_id, self.start_s = store, job_id, start_s
        self.seq = 0

    def job(self, state: str, record: dict[str, Any], **row: Any) -> None:
        self.store.upsert_job(self.job_id, state=state, record=record, now_s=self.start_s, **row)

    def decide(self, at: float, source: str, target: str, cause: str, why: str) -> None:
        self.store.record_decision(
            self.job_id, None, source, target, cause, {"explanation": why}, self.start_s + at
        )

    def attempt(self, at: float, number: int, nodes: list[str], resumed: str | None) -> None:
        if number > 1:
            self.store.end_attempt(self.job_id, number - 1, cause="fault", now_s=self.start_s + at)
        self.store.start_attempt(
            self.job_id, number, nodes=nodes, resumed_from=resumed, now_s=self.start_s + at
        )

    def steps(self, first_at: float, every_s: float, steps: range) -> None:
        for index, step in enumerate(steps):
            self.store.record_progress(self.job_id, step, self.start_s + first_at + index * every_s)

    def event(self, at: float, kind: EventKind, node: str, payload: dict[str, Any]) -> None:
        self.seq += 1
        made = protocol.make_event(
            kind, self.job_id, node, INCARNATION, self.seq, self.start_s + at, payload
        )
        self.store.record_events(self.job_id, [made], now_s=self.start_s + at)

    def observe(
        self, at: float, kind: str, payload: dict[str, Any], node: str | None = None
    ) -> None:
        self.store.record_observation(self.job_id, kind, payload, self.start_s + at, node=node)

    def drain(self, at: float, node: str, cause: Cause, attempt: int) -> None:
        action = f"{self.job_id}/{attempt}/drain/{node}"
        self.store.plan_action(action, self.job_id, "drain", {"node": node}, self.start_s + at)
        self.store.mark_started(action, self.start_s + at)
        self.store.mark_done(action, {"drained": True}, self.start_s + at + 0.2)
        self.store.record_drain(
            node, cause=cause, job_id=self.job_id, now_s=self.start_s + at, action_id=action,
            reason=f"resurgo: {cause.value} job={self.job_id}",
        )  # fmt: skip
        self.store.record_blame(node, job_id=self.job_id, attempt=attempt, cause=cause,
                                outcome=BlameOutcome.DRAINED, now_s=self.start_s + at)  # fmt: skip


def _hung(rank: int, step: int) -> dict[str, Any]:
    return {"global_rank": rank, "local_rank": rank % 2, "pid": 4101 + rank, "last_step": step,
            "phase": "train", "seconds_since_progress": 10.000213, "timeout_s": 10.0,
            "detector": "heartbeat"}  # fmt: skip


def _exited(rank: int, step: int, *, signal: int | None) -> dict[str, Any]:
    return {"global_rank": rank, "local_rank": 0, "pid": 4101 + rank, "last_step": step,
            "exit_code": None if signal else 1, "signal": signal, "phase": "train",
            "signal_name": "SIGKILL" if signal else None,
            "exit_time_unix_s": 1_700_000_034.000125}  # fmt: skip


def _completed(job: _Recorder) -> None:
    """The fault demo's run: a rank killed after step 6, a rank hung after step 14."""
    job.job("completed", {"attempt": 3, "nodes": ["node1", "node2"], "final_reason": "",
                          "restarts": [["rank_signal", 1], ["hang", 1]]},
            name="demo", original_nodes=4, min_nodes=2)  # fmt: skip
    job.decide(1, "submitted", "starting", "none", "Slurm started the job")
    job.attempt(1, 1, ["node1", "node2", "node3", "node4"], None)
    job.steps(28.5, 1.0, range(1, 7))
    job.store.record_checkpoint(job.job_id, 5, "/ckpt/demo/step-5", job.start_s + 33)
    job.observe(33.2, "checkpoint_stats", {"step": 5, "stall_s": 0.011354302999990296,
                                           "write_s": 0.03732607900002449, "bytes": 183210,
                                           "mode": "async"})  # fmt: skip
    job.decide(28.5, "starting", "running", "none", "training started")
    job.event(34, EventKind.RANK_EXITED, "node4", _exited(3, 6, signal=9))
    job.decide(34.2, "running", "recovering", "none", "rank 3 ended: waiting for the others")
    job.decide(36, "recovering", "recovering", "rank_signal", "rank 3 was killed (SIGKILL)")
    job.drain(36.1, "node4", Cause.RANK_SIGNAL, 1)
    job.decide(37, "recovering", "relaunching", "rank_signal", "relaunch on 3 nodes from step 5")
    job.attempt(38, 2, ["node1", "node2", "node3"], "/ckpt/demo/step-5")
    job.steps(41, 1.0, range(6, 15))
    job.decide(41, "relaunching", "running", "none", "training steps again")
    job.observe(42, "resume_verification", {"attempt": 2, "resume_step": 5, "same_size": False,
                                            "verified": True, "first_diverging_step": None,
                                            "compared": 1, "reason": "losses match"})  # fmt: skip
    job.store.record_checkpoint(job.job_id, 10, "/ckpt/demo/step-10", job.start_s + 45)
    for rank, node in enumerate(("node1", "node2", "node3")):
        stack = CULPRIT if rank == 2 else WAITING
        job.event(
            55, EventKind.HANG, node, {"hung": [_hung(rank, 14)], "stacks": {str(rank): stack}}
        )
    job.decide(55.5, "running", "recovering", "hang", "rank 2 on node3 hung outside a collective")
    job.drain(56, "node3", Cause.HANG, 2)
    job.decide(57, "recovering", "relaunching", "hang", "relaunch on 2 nodes from step 10")
    job.attempt(58, 3, ["node1", "node2"], "/ckpt/demo/step-10")
    job.decide(60, "relaunching", "running", "none", "training steps again")
    job.steps(60, 0.5, range(11, 21))
    job.store.record_checkpoint(job.job_id, 20, "/ckpt/demo/step-20", job.start_s + 65)
    job.decide(COMPLETED_WALL_S, "running", "completed", "slurm_ended", "every rank finished")
    job.store.end_attempt(job.job_id, 3, cause="completed", now_s=job.start_s + COMPLETED_WALL_S)


def _failed(job: _Recorder) -> None:
    reason = "crash loop: rank 0 raised ValueError at step 3 again (3 times)"
    job.job("failed", {"attempt": 3, "nodes": [], "final_reason": reason,
                       "restarts": [["user_exception", 2]]},
            name="bad-config", original_nodes=2, min_nodes=1)  # fmt: skip
    job.decide(2, "submitted", "starting", "none", "Slurm started the job")
    for attempt in (1, 2, 3):
        at = 10.0 * attempt
        if attempt > 1:
            job.attempt(at, attempt, ["node5", "node6"], "/ckpt/bad/step-2")
        else:
            job.attempt(at, 1, ["node5", "node6"], None)
        job.steps(at + 2, 1.0, range(1, 4))
        job.event(at + 6, EventKind.RANK_EXITED, "node5", _exited(0, 3, signal=None))
    job.decide(37, "running", "failed", "crash_loop", reason)


def _requeued(job: _Recorder) -> None:
    job.job("requeued", {"attempt": 2, "nodes": [], "final_reason": "",
                         "restarts": [["preempted", 1]]},
            name="low-prio", original_nodes=2, min_nodes=2)  # fmt: skip
    job.decide(3, "submitted", "starting", "none", "Slurm started the job")
    job.attempt(3, 1, ["node7", "node8"], None)
    job.steps(20, 2.0, range(1, 11))
    job.store.record_checkpoint(job.job_id, 8, "/ckpt/lp/step-8", job.start_s + 35)
    job.decide(40, "running", "requeued", "preempted", "Slurm preempted the job: it waits again")


def _recovering(job: _Recorder) -> None:
    job.job("recovering", {"attempt": 1, "nodes": ["node9", "node10"], "final_reason": "",
                           "restarts": []},
            name="moe", original_nodes=2, min_nodes=1)  # fmt: skip
    job.decide(1, "submitted", "starting", "none", "Slurm started the job")
    job.attempt(1, 1, ["node9", "node10"], None)
    job.steps(12, 1.5, range(1, 20))
    job.event(50, EventKind.HANG, "node9", {"hung": [_hung(0, 19), _hung(1, 19)],
                                            "stacks": {"0": WAITING, "1": CULPRIT}})  # fmt: skip
    job.decide(50.5, "running", "recovering", "hang", "ranks 0 and 1 on node9 hung")


def _spared(job: _Recorder) -> None:
    job.job("running", {"attempt": 2, "nodes": ["node11", "node13"], "final_reason": "",
                        "restarts": [["node_lost", 1]], "spare_nodes": ["node14"],
                        "spares_wanted": 2, "swaps": [["node_lost", 1]]},
            name="spared", original_nodes=2, min_nodes=2)  # fmt: skip
    job.decide(1, "submitted", "starting", "none", "Slurm started the job")
    job.attempt(1, 1, ["node11", "node12"], None)
    job.steps(10, 1.0, range(1, 11))
    saved = {"step": 5, "path": "/out/spared/ckpt.pt", "global_rank": 0, "total_bytes": 183210}
    job.event(15, EventKind.CHECKPOINT_WRITTEN, "node11", saved)
    job.decide(21, "running", "recovering", "node_lost", "node12 stopped answering")
    job.drain(22, "node12", Cause.NODE_LOST, 1)
    job.attempt(25, 2, ["node11", "node13"], None)
    job.steps(30, 1.0, range(6, 16))


def _rolled_back(job: _Recorder) -> None:
    seen = {"kind": "non_finite", "onset_step": 9, "attempt": 1, "nodes": [], "cursor": 96,
            "batch": 12, "detail": "rank 1 reported a loss of nan at step 9",
            "action": "rollback", "skipped": [96, 132], "resumed_step": 8}  # fmt: skip
    job.job("running", {"attempt": 2, "nodes": ["node15"], "final_reason": "",
                        "restarts": [["training_anomaly", 1]], "anomalies": [seen],
                        "skipped_samples": [[96, 132]]},
            name="nan", original_nodes=1, min_nodes=1)  # fmt: skip
    job.decide(1, "submitted", "starting", "none", "Slurm started the job")
    job.attempt(1, 1, ["node15"], None)
    job.steps(5, 1.0, range(1, 10))
    job.store.record_checkpoint(job.job_id, 8, "/ckpt/nan/step-8", job.start_s + 12.5)
    payload = {k: seen[k] for k in ("kind", "onset_step", "attempt", "nodes", "cursor", "batch",
                                    "detail")}  # fmt: skip
    job.observe(14, "training_anomaly", {**payload, "ranks": [1]})
    job.decide(14, "running", "recovering", "training_anomaly", "NaN loss at step 9: roll back")
    job.attempt(16, 2, ["node15"], "/ckpt/nan/step-8")
    job.steps(18, 1.0, range(9, 20))


OOM_LINE = "Memory cgroup out of memory: Killed process 689 (python3) total-vm:82356kB"
GLOO_LINE = "[../gloo/transport/tcp/pair.cc:553] Connection closed by peer [10.0.0.17]:41234"


def _oom(job: _Recorder) -> None:
    """A gloo connection error, then the kernel's OOM kill twice: the explanations are
    worded as the core words them (supervisor.core.failures)."""
    killed = f'oom (rule kernel-oom-kill): "{OOM_LINE}"'
    reason = (
        f"{killed}: rank 0 on node16; 2 such failures, the rule allows 1 retry: the script "
        "needs more memory than its nodes give it (a smaller batch, more nodes, or a larger "
        "allocation)"
    )
    job.job("failed", {"attempt": 3, "nodes": [], "final_reason": reason,
                       "restarts": [["oom", 1], ["user_exception", 1]],
                       "failures": [["network", 1], ["oom", 2]]},
            name="big-batch", original_nodes=2, min_nodes=2)  # fmt: skip
    job.decide(1, "submitted", "starting", "none", "Slurm started the job")
    job.attempt(1, 1, ["node16", "node17"], None)
    job.steps(5, 1.0, range(1, 8))
    job.store.record_checkpoint(job.job_id, 5, "/ckpt/big/step-5", job.start_s + 10.5)
    job.decide(12, "running", "recovering", "user_exception",
               f'user_exception: no node blamed: rank 1 on node17 raised RuntimeError; '
               f'network (rule collective-network): "RuntimeError: {GLOO_LINE}"')  # fmt: skip
    job.decide(14, "recovering", "relaunching", "user_exception", "relaunch on 2 nodes from step 5")
    job.attempt(15, 2, ["node16", "node17"], "/ckpt/big/step-5")
    job.decide(18, "relaunching", "running", "none", "training steps again")
    job.steps(18, 1.0, range(6, 9))
    job.decide(21, "running", "recovering", "oom",
               f"oom: no node blamed: rank 0 on node16: {killed}; retry 1 of 1, "
               "no node blamed")  # fmt: skip
    job.decide(23, "recovering", "relaunching", "oom", "relaunch on 2 nodes from step 5")
    job.attempt(24, 3, ["node16", "node17"], "/ckpt/big/step-5")
    job.decide(27, "relaunching", "running", "none", "training steps again")
    job.steps(27, 1.0, range(6, 8))
    job.decide(30, "running", "failed", "oom", reason)
    job.store.end_attempt(job.job_id, 3, cause="failed", now_s=job.start_s + 30)


def recorded_state_dir(parent: Path, start_s: float) -> Path:
    """``parent/state`` holding the store of the seven jobs, all submitted at ``start_s``."""
    state = parent / "state"
    state.mkdir()
    with Store.open(state / "resurgo.db") as store:
        for job_id, write in zip(
            JOBS,
            (_completed, _failed, _requeued, _recovering, _spared, _rolled_back, _oom),
            strict=True,
        ):
            write(_Recorder(store, job_id, start_s))
    return state
