"""The executor tests' world: a fixed NOW and the intents of one recovery of the fake's job.

Shared by ``test_executor.py`` and ``test_crash_recovery.py``; the job and its
nodes are the fake Slurm's (:mod:`tests.fakes.slurm`).
"""

from __future__ import annotations

from supervisor.core.intents import DrainNode, RelaunchStep, RequeueSmaller, ShrinkAllocation
from supervisor.core.model import Cause
from tests.fakes.slurm import JOB

NOW = 1_700_000_000.0
DRAIN = DrainNode(JOB, 2, "node3", Cause.RANK_SIGNAL, "rank 2 SIGKILL")
SHRINK = ShrinkAllocation(JOB, 2, ("node1", "node2", "node4"))
RELAUNCH = RelaunchStep(JOB, 2, ("node1", "node2", "node4"), "/ckpt/step-200")
REQUEUE = RequeueSmaller(JOB, 2, 3, ("node3",), "/ckpt/step-200")
