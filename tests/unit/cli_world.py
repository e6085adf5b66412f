"""The operator CLI tests' world: a state directory whose store holds one recovered job.

The unit conftest's ``state_dir`` fixture makes it for ``test_operator_cli.py``
and ``test_metrics.py``, which read the job (``JOB``) back.
"""

from __future__ import annotations

import time
from pathlib import Path

from agent.wire import protocol
from agent.wire.protocol import EventKind
from supervisor.core.model import Cause
from supervisor.store import BlameOutcome, Store

JOB = "4711"
INCARNATION = "0123456789abcdef"


def recovered_state_dir(tmp_path: Path) -> Path:
    """A store holding one recovered job: progress, a hang with stacks, a drain, a relaunch."""
    state = tmp_path / "state"
    state.mkdir()
    now = time.time() - 600
    with Store.open(state / "resurgo.db") as store:
        record = {"attempt": 2, "nodes": ["node1", "node2"], "restarts": [["hang", 1]],
                  "final_reason": "", "straggler_reports": [["node2", 3]]}  # fmt: skip
        store.upsert_job(JOB, state="running", record=record, now_s=now, name="llm",
                         original_nodes=3, min_nodes=2)  # fmt: skip
        store.record_decision(
            JOB, None, "submitted", "starting", "none", {"explanation": "x"}, now + 5
        )
        store.start_attempt(
            JOB, 1, nodes=["node1", "node2", "node3"], resumed_from=None, now_s=now + 5
        )
        for offset, step in ((20, 1), (40, 10), (60, 20)):
            store.record_progress(JOB, step, now + offset)
        store.record_checkpoint(JOB, 10, "/ckpt/step-10", now + 41)
        hang = protocol.make_event(
            EventKind.HANG, JOB, "node3", INCARNATION, 1, now + 90,
            {"hung": [{"global_rank": 2, "local_rank": 0, "pid": 7, "last_step": 20,
                       "phase": "train", "seconds_since_progress": 30.0, "timeout_s": 25.0,
                       "detector": "heartbeat"}],
             "stacks": {"2": 'Thread 7 (idle): "MainThread"\n    all_reduce (c10d.py:9)\n'
                             "    train (train.py:40)"}},
        )  # fmt: skip
        store.record_events(JOB, [hang], now_s=now + 90)
        store.record_decision(JOB, hang.event_id, "running", "recovering", "hang",
                              {"explanation": "hang on node3"}, now + 90)  # fmt: skip
        store.record_drain("node3", cause=Cause.HANG, job_id=JOB,
                           reason="resurgo: hang job=4711 rank 2 behind", now_s=now + 91,
                           action_id=f"{JOB}/2/drain/node3")  # fmt: skip
        store.record_blame("node3", job_id=JOB, attempt=1, cause=Cause.HANG,
                           outcome=BlameOutcome.DRAINED, now_s=now + 91)  # fmt: skip
        store.record_decision(JOB, None, "recovering", "relaunching", "hang",
                              {"explanation": "relaunch on 2 node(s)"}, now + 100)  # fmt: skip
        store.start_attempt(JOB, 2, nodes=["node1", "node2"], resumed_from="/ckpt/step-10",
                            now_s=now + 100)  # fmt: skip
        store.record_progress(JOB, 12, now + 130)
    return state
