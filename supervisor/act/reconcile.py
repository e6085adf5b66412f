"""Intents as stored actions, and what Slurm shows about a half-done one.

The executor stores each intent as an action row: a kind label (the same word
as in its ``action_id``) and the intent's fields as JSON args, so that after a
restart :func:`intent_of` rebuilds the intent from the row alone, and
:func:`replay` rebuilds the observations a finished action reported.

:func:`effect_of` answers, for an action that was ``started`` when the
supervisor died, whether its side effect already happened: a drained node
with our reason, a job already on the smaller size. Only Slurm queries run
here; the executor acts on the answer. A failed query raises
``SlurmUnavailable``: unknown, never "not done".
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from agent.wire.protocol import Command, CommandKind
from supervisor.core.intents import (
    Alert,
    CheckNode,
    DrainNode,
    DrainTicket,
    Intent,
    PushInterval,
    RelaunchStep,
    RequeueSmaller,
    ResumeNode,
    Severity,
    ShrinkAllocation,
    StopJob,
    StopRanks,
    ValidateCheckpoints,
    ValidationLevel,
)
from supervisor.core.model import Cause, JobState
from supervisor.core.observations import CheckpointValidated, Observation, RelaunchFinished
from supervisor.errors import StoreError
from supervisor.slurm.interface import SlurmQueries
from supervisor.slurm.parse import JobState as SlurmState
from supervisor.slurm.parse import SlurmJob, parse_drain_reason
from supervisor.store import ActionRow, ActionState

KIND_OF: dict[type, str] = {
    cls: cls.KIND
    for cls in (
        DrainNode, DrainTicket, CheckNode, ResumeNode, StopRanks, ValidateCheckpoints,
        ShrinkAllocation, RelaunchStep, RequeueSmaller, Alert, StopJob, PushInterval,
    )
}  # fmt: skip
_CLASS_OF = {kind: cls for cls, kind in KIND_OF.items()}
_ENUM_FIELDS: dict[str, type[enum.Enum]] = {
    "cause": Cause,
    "severity": Severity,
    "status": JobState,
    "level": ValidationLevel,
}


def kind_of(intent: Intent) -> str:
    """The action kind stored for ``intent``."""
    return KIND_OF[type(intent)]


def args_of(intent: Intent) -> dict[str, Any]:
    """``intent``'s fields as JSON args: enums by value, tuples as lists."""
    args: dict[str, Any] = {}
    for field in dataclasses.fields(intent):
        value = getattr(intent, field.name)
        if isinstance(value, enum.Enum):
            value = value.value
        elif isinstance(value, tuple):
            value = list(value)
        args[field.name] = value
    return args


def intent_of(row: ActionRow) -> Intent:
    """The intent an action row was planned from (the inverse of kind_of/args_of)."""
    cls = _CLASS_OF.get(row.kind)
    if cls is None:
        raise StoreError(f"action {row.action_id} has kind {row.kind!r}, not an executor kind")
    kwargs: dict[str, Any] = {}
    for field in dataclasses.fields(cls):
        if field.name not in row.args:
            continue  # a field with a default that an older plan did not store
        value = row.args[field.name]
        if field.name in _ENUM_FIELDS:
            value = _ENUM_FIELDS[field.name](value)
        elif isinstance(value, list):
            value = tuple(value)
        kwargs[field.name] = value
    intent: Intent = cls(**kwargs)
    if intent.action_id != row.action_id:
        raise StoreError(
            f"action {row.action_id} rebuilds as {intent.action_id}: its args were edited; "
            "fix or fail the row by hand"
        )
    return intent


def slurm_job_id(job_id: str) -> int:
    """The Slurm job id of a Resurgo job (Resurgo jobs are keyed by their Slurm id)."""
    try:
        return int(job_id)
    except ValueError as error:
        raise ValueError(f"job {job_id!r} is not a Slurm job id; it cannot be acted on") from error


def command_id_for(action_id: str) -> str:
    """The agent command id of an action: the protocol's names allow ':' but not '/'."""
    return action_id.replace("/", ":")


def command_attempt(command_id: str) -> int | None:
    """The attempt of the action a command was made for (see :func:`command_id_for`)."""
    parts = command_id.split(":")
    return int(parts[1]) if len(parts) >= 3 and parts[1].isdigit() else None


def command_for(intent: StopRanks | PushInterval) -> Command:
    command_id = command_id_for(intent.action_id)
    if isinstance(intent, StopRanks):
        return Command(CommandKind.STOP_RANKS, command_id, {"grace_s": intent.grace_s})
    return Command(
        CommandKind.SET_CHECKPOINT_INTERVAL,
        command_id,
        {"interval_s": intent.interval_s, "every_steps": None},
    )


def validated_doc(seen: CheckpointValidated) -> dict[str, Any]:
    """A validation report as stored in the action's result (see :func:`replay`)."""
    return {"step": seen.step, "path": seen.path, "valid": seen.valid, "reason": seen.reason}


def replay(intent: Intent, row: ActionRow) -> list[Observation]:
    """The observations a finished action reported, for a caller that executes it again."""
    if isinstance(intent, ValidateCheckpoints) and row.state is ActionState.DONE:
        docs = (row.result or {}).get("checked", [])
        return [CheckpointValidated(d["step"], d["path"], d["valid"], d["reason"]) for d in docs]
    if isinstance(intent, RelaunchStep):
        return [relaunch_finished(intent, row)]
    return []


def relaunch_finished(intent: RelaunchStep, row: ActionRow) -> RelaunchFinished:
    """The driver's recorded report on a finished relaunch action."""
    if row.state is ActionState.DONE:
        return RelaunchFinished(intent.attempt, True, (row.result or {}).get("reason", ""))
    return RelaunchFinished(intent.attempt, False, row.error or "")


class Verdict(enum.Enum):
    """What Slurm shows about a started action."""

    TOOK_EFFECT = "took_effect"  # mark it done, do not run it again
    NOT_YET = "not_yet"  # run it (again); every kind is safe to repeat when not in effect
    MOOT = "moot"  # its target is gone (job ended, node unknown): fail it for good


@dataclass(frozen=True)
class Found:
    """A :class:`Verdict` and the Slurm state it rests on, for the log and the row."""

    verdict: Verdict
    detail: str


def is_our_drain(reason: str, intent: DrainNode) -> bool:
    """Whether a node's drain reason is the one ``intent`` writes (cause and job match).

    ``parse_drain_reason`` reads exactly ``resurgo: <cause> job=<id>``; our
    reasons append the evidence, so only the first three words are parsed.
    """
    parsed = parse_drain_reason(" ".join(reason.split()[:3]))
    return (
        parsed is not None
        and parsed.cause == intent.cause.value
        and str(parsed.job_id) == intent.job_id
    )


async def effect_of(
    intent: Intent, slurm: SlurmQueries, baseline: Mapping[str, Any] | None = None
) -> Found:
    """Whether the started ``intent`` already took effect in Slurm.

    ``baseline`` is what the executor saw before a requeue (``restart_count``).
    Kinds with no Slurm side effect (commands to agents, validation, alerts)
    are idempotent and always NOT_YET: running them again is the check.
    """
    if isinstance(intent, DrainNode | ResumeNode):
        node = (await slurm.nodes()).get(intent.node)
        if node is None:
            return Found(Verdict.MOOT, f"Slurm does not list node {intent.node}")
        if isinstance(intent, DrainNode):
            if node.drained and is_our_drain(node.reason, intent):
                return Found(Verdict.TOOK_EFFECT, f"{intent.node} drained: {node.reason}")
            return Found(Verdict.NOT_YET, f"{intent.node} is {node.state_raw} ({node.reason!r})")
        if not node.drained:
            return Found(Verdict.TOOK_EFFECT, f"{intent.node} is {node.state_raw}, not drained")
        return Found(Verdict.NOT_YET, f"{intent.node} still drained")
    if not isinstance(intent, ShrinkAllocation | RequeueSmaller | StopJob):
        return Found(Verdict.NOT_YET, "no Slurm effect to look for; repeating it is safe")
    job = await slurm.job(slurm_job_id(intent.job_id))
    if isinstance(intent, StopJob):
        if job is None or job.state.finished:
            return Found(Verdict.TOOK_EFFECT, "job ended in Slurm")
        return Found(Verdict.NOT_YET, f"job is {job.state_raw}")
    if job is None or job.state.finished:
        state = "not listed" if job is None else job.state_raw
        return Found(Verdict.MOOT, f"job is {state} in Slurm")
    if isinstance(intent, ShrinkAllocation):
        if job.nodes == intent.keep_nodes:
            return Found(Verdict.TOOK_EFFECT, f"job already on {','.join(job.nodes)}")
        return Found(Verdict.NOT_YET, f"job on {','.join(job.nodes)}")
    return _requeue_effect(intent, job, baseline)


def _requeue_effect(
    intent: RequeueSmaller, job: SlurmJob, baseline: Mapping[str, Any] | None
) -> Found:
    detail = f"job {job.state_raw} ({job.state_reason}) on {job.node_count} nodes, "
    detail += f"restart_count {job.restart_count}"
    # A held job is a requeue stopped between requeuehold and release, and a
    # COMPLETING one was most likely stopped right after requeuehold (22.05
    # shows it COMPLETING, restart count already incremented, until its
    # epilog ends; held only once PENDING). requeue_smaller resumes either
    # from there without requeueing twice: it holds only a RUNNING job.
    if job.held or job.state is SlurmState.COMPLETING:
        return Found(Verdict.NOT_YET, detail)
    before = None if baseline is None else baseline.get("restart_count")
    advanced = isinstance(before, int) and job.restart_count > before
    # Same size alone proves nothing when the requeue keeps the size (a spare
    # node replaces the blamed one), so the restart count decides when known.
    if advanced or (before is None and job.node_count == intent.n_nodes):
        return Found(Verdict.TOOK_EFFECT, detail)
    return Found(Verdict.NOT_YET, detail)
