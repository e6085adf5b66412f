"""What the executor's actions say: an action in words (observe-only mode's
``would ...``), a drain ticket as the operator hook's JSON and as an alert. Pure."""

from __future__ import annotations

from typing import Any

from supervisor.act.reconcile import kind_of
from supervisor.core.intents import (
    CheckNode,
    DrainNode,
    DrainTicket,
    Intent,
    PushInterval,
    RelaunchStep,
    RequeueSmaller,
    ResumeNode,
    ShrinkAllocation,
    StopJob,
    StopRanks,
)


def would_do(intent: Intent) -> str:
    """What carrying ``intent`` out does, in words (``would ...`` in observe-only mode)."""
    match intent:
        case DrainNode():
            return f"drain {intent.node} ({intent.cause.value}): {intent.slurm_reason}"
        case ResumeNode():
            return f"resume {intent.node}"
        case DrainTicket():
            return f"raise a drain ticket for {intent.node} ({intent.cause.value})"
        case CheckNode():
            return f"check {intent.node} with a Slurm job of its own before draining it"
        case StopRanks():
            return f"stop every rank of the job (SIGTERM, SIGKILL after {intent.grace_s:g} s)"
        case PushInterval():
            return f"set the checkpoint interval to {intent.interval_s:.0f} s"
        case ShrinkAllocation():
            return f"shrink the allocation to {','.join(intent.keep_nodes)}"
        case RequeueSmaller():
            without = f" without {','.join(intent.exclude)}" if intent.exclude else ""
            return f"requeue the job on {intent.n_nodes} node(s){without}"
        case RelaunchStep():
            source = intent.resume_from or "no checkpoint"
            return f"relaunch on {','.join(intent.nodes)} from {source}"
        case StopJob():
            return f"stop the job ({intent.status.value}): {intent.reason}"
    return kind_of(intent)


def ticket_doc(intent: DrainTicket) -> dict[str, Any]:
    """The JSON object the operator hook receives for a ticket."""
    return {
        "kind": "resurgo_drain_ticket",
        "node": intent.node,
        "cause": intent.cause.value,
        "job_id": intent.job_id,
        "user": intent.user,
        "attempt": intent.attempt,
        "evidence": intent.evidence,
        "ticket": intent.action_id,
        "asks": f'scontrol update nodename={intent.node} state=drain reason="..."',
    }


def ticket_message(intent: DrainTicket) -> str:
    """The alert that goes with a ticket, in words."""
    return (
        f"drain ticket for {intent.node} ({intent.cause.value}: {intent.evidence}): this "
        f"supervisor has no Slurm operator rights, so job {intent.job_id}"
        f"{f' of {intent.user}' if intent.user else ''} goes on without "
        f"{intent.node} and your later jobs leave it out; an admin should drain and check it "
        f"(`resurgo nodes` lists the ticket; `resurgo nodes forgive {intent.node}` clears it)"
    )
