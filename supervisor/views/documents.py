"""What ``resurgo status``, ``events``, ``nodes`` and ``report`` show, as JSON documents.

Built from the supervisor's store (read while the daemon runs: WAL) and, for
nodes, Slurm's view. These documents are the ``--json`` output; their fields
are documented in ``docs/cli.md`` and only ever gain fields. Human tables are
rendered from the same documents by the CLI.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from pathlib import PurePosixPath
from typing import Any

from supervisor.core.model import at_step
from supervisor.slurm.parse import SlurmNode
from supervisor.store import Store
from supervisor.views import words
from supervisor.views.timeline import CHECKPOINT_STATS_KIND, goodput_of

STATUS_VERSION = 1
TERMINAL_STATES = frozenset({"completed", "failed", "cancelled"})
STACK_PREVIEW_LINES = 3
# `resurgo nodes` lists the newest blames of the lemon window, at most this many.
MAX_BLAMES_SHOWN = 200


def status_row(store: Store, job_id: str, now_s: float) -> dict[str, Any] | None:
    """One job's status line (None when the store does not know the job)."""
    row = store.get_job(job_id)
    if row is None:
        return None
    record = row.record
    checkpoints = store.checkpoints_for(job_id)
    newest = max(checkpoints, key=lambda c: c.step) if checkpoints else None
    own = None if newest is not None else _newest_written(store, job_id, now_s)
    drained = sorted(d.node for d in store.open_drains() if d.job_id == job_id)
    goodput = goodput_of(store, job_id, now_s)
    progress = store.latest_progress(job_id)
    ended = ended_at(store, job_id)
    return {
        "job_id": job_id,
        "name": row.name,
        "state": row.state,
        "attempt": record.get("attempt", 1),
        "world_size": len(record.get("nodes", [])) or None,
        "original_nodes": row.original_nodes,
        "min_nodes": row.min_nodes,
        "nodes": list(record.get("nodes", [])),
        "spare_nodes": list(record.get("spare_nodes", [])),
        "spares_wanted": record.get("spares_wanted", 0),
        "swaps": {cause: count for cause, count in record.get("swaps", [])},
        "restarts": {cause: count for cause, count in record.get("restarts", [])},
        # Each recovery's root cause by failure class (supervisor.core.failure_rules).
        "failures": {name: count for name, count in record.get("failures", [])},
        "anomalies": [_anomaly(seen) for seen in record.get("anomalies", [])],
        "skipped_samples": [list(pair) for pair in record.get("skipped_samples", [])],
        "step": None if progress is None else progress.step,
        "step_age_s": None if progress is None else round(now_s - progress.time_s, 1),
        "goodput": round(goodput.ratio, 4),
        "badput_s": {kind.value: round(s, 3) for kind, s in goodput.badput_s.items()},
        # The same lost time by what caused each restart (a fault's cause, time_limit, ...).
        "badput_by_cause_s": {
            cause: round(s, 3) for cause, s in sorted(goodput.by_fault_cause_s.items()) if s > 0
        },
        "last_checkpoint": own
        if newest is None
        else {
            "step": newest.step,
            "path": newest.path,
            "age_s": round(now_s - newest.committed_s, 1),
            "committed_s": newest.committed_s,
            "kind": "resurgo",
        },
        "drained_nodes": drained,
        "final_reason": record.get("final_reason", ""),
        "updated_s": row.updated_s,
        # When the job ended (None while it lives): an ended job's ages count to this.
        "ended_s": ended,
    }


def ended_at(store: Store, job_id: str) -> float | None:
    """When the job reached a terminal state (its first such decision), or None."""
    for decision in store.decisions_for(job_id):
        if decision.to_state in TERMINAL_STATES:
            return decision.decided_s
    return None


def _anomaly(seen: dict[str, Any]) -> dict[str, Any]:
    """A training anomaly of the record, as status shows it."""
    keys = ("kind", "onset_step", "attempt", "nodes", "action", "skipped", "resumed_step", "detail")
    return {key: seen.get(key) for key in keys}


def skipped_count(ranges: list[list[int]]) -> int:
    """How many global samples the ranges skip."""
    return sum(end - start for start, end in ranges)


def _newest_written(store: Store, job_id: str, now_s: float) -> dict[str, Any] | None:
    """The newest checkpoint a script that imports nothing saved itself
    (``checkpoint_written``): a ``torch.save`` file or a DCP directory."""
    events = store.events_for(job_id, kinds=["checkpoint_written"])
    if not events:
        return None
    newest = events[-1]  # stored in the order they came
    path = newest.payload.get("path")
    return {
        "step": newest.payload.get("step"),
        "path": path,
        "age_s": round(now_s - newest.time_s, 1),
        "committed_s": newest.time_s,
        "kind": written_kind(path),
    }


def written_kind(path: object) -> str:
    """Which layout a script's own checkpoint path is, by its name alone (the store is all
    a view reads): ``"huggingface"`` (``checkpoint-120``), ``"deepspeed"``
    (``global_step120``), ``"lightning"`` (``*.ckpt``), ``"dcp"`` (any other
    directory: a name without a suffix, torchtitan's ``step-120``), else ``"torch.save"``."""
    name = PurePosixPath(path).name if isinstance(path, str) else ""
    if re.fullmatch(r"checkpoint-\d+", name):
        return "huggingface"
    if re.fullmatch(r"global_step\d+", name):
        return "deepspeed"
    if name.endswith(".ckpt"):
        return "lightning"
    return "dcp" if name and not PurePosixPath(name).suffix else "torch.save"


def status(store: Store, job_ids: Sequence[str], now_s: float) -> dict[str, Any]:
    """``resurgo status``: the named jobs (all when none are named), oldest first."""
    ids = list(job_ids) or [row.job_id for row in store.list_jobs()]
    rows = [status_row(store, job_id, now_s) for job_id in ids]
    rights = store.fact("rights")
    return {
        "version": STATUS_VERSION,
        "supervisor": None
        if rights is None
        else {
            "mode": rights["mode"],
            "why": rights["why"],
            "observe_only": bool(rights.get("observe_only", False)),
        },
        "jobs": [row for row in rows if row is not None],
        "unknown": [job_id for job_id, row in zip(ids, rows, strict=True) if row is None],
    }


def _summary(kind: str, payload: dict[str, Any]) -> str:
    if kind == "rank_exited":
        how = payload.get("signal_name") or f"exit code {payload.get('exit_code')}"
        step = payload.get("last_step")
        return f"rank {payload.get('global_rank')} ended ({how}) {at_step(step)}"
    if kind == "hang":
        ranks = [str(h.get("global_rank")) for h in payload.get("hung", [])]
        return f"{'rank' if len(ranks) == 1 else 'ranks'} {words.listed(ranks)} hung"
    if kind == "checkpoint_written":
        written = payload.get("total_bytes")
        how_big = "" if not isinstance(written, int) else f", {words.size(written)}"
        return (
            f"the script saved {payload.get('path')} at step {payload.get('step')}{how_big} "
            "(its own checkpoint)"
        )
    if kind == "checkpoint_committed":
        return f"checkpoint step {payload.get('step')} committed: {payload.get('path')}"
    if kind == "step_losses":
        steps = payload.get("steps", [])
        return words.plural(len(steps), "step report") + (
            f" up to step {steps[-1].get('step')}" if steps else ""
        )
    if kind == CHECKPOINT_STATS_KIND:
        return _save_cost(payload)
    if kind in ("resume_verification", "nondeterministic_resume"):
        return _resume_check(payload)
    if kind == "alert":
        return f"ALERT ({payload.get('severity')}): {payload.get('message')}"
    if kind == "checkpoint_quarantined":
        # A valid checkpoint a rollback moved aside says why; a rejected one's reason is
        # in `resurgo ckpt quarantined`.
        said = payload.get("reason") if payload.get("past_rollback") else "failed validation"
        return (
            f"checkpoint {payload.get('checkpoint')} {said}: moved to "
            f"{payload.get('moved_to')} (resurgo ckpt release moves it back)"
        )
    if kind == "training_anomaly":
        nodes = payload.get("nodes") or []
        where = f" (only {', '.join(map(str, nodes))}'s ranks)" if nodes else ""
        cursor = payload.get("cursor")
        data = "" if cursor is None else f", global sample {cursor}"
        return (
            f"training anomaly {payload.get('kind')} from step {payload.get('onset_step')}"
            f"{where}{data}: {payload.get('detail')}"
        )
    if kind == "agent_started" and isinstance(payload.get("attempt"), int):
        return f"agent started for attempt {payload['attempt']}"
    if kind == "driver_step_ended":
        code = payload.get("exit_code")
        how = "its exit code unknown" if code is None else f"exit code {code}"
        return f"the driver saw attempt {payload.get('attempt')}'s step end ({how})"
    if kind in ("agent_started", "agent_stopped", "ranks_stopped", "launcher_exited"):
        detail = payload.get("reason") or payload.get("attempt") or payload.get("exit_code")
        return f"{kind.replace('_', ' ')}" + (f": {detail}" if detail is not None else "")
    if kind == "health_check_failed":
        return f"health check failed: {str(payload.get('output_tail', ''))[-200:]}"
    if kind == "straggler" and "compute_p50_s" in payload:  # the supervisor's, across nodes
        try:
            return (
                f"rank {payload['global_rank']} computes {float(payload['compute_p50_s']):.3f}s "
                f"per step, {float(payload['ratio']):.1f}x the other ranks' "
                f"{float(payload['reference_s']):.3f}s"
            )
        except (KeyError, TypeError, ValueError):
            pass  # not the supervisor's shape: the generic line below
    return words.fields(payload)[:300]


def _save_cost(payload: dict[str, Any]) -> str:
    """``checkpoint step 24 cost 11.4 ms of training and 37.3 ms written in the
    background, 183 kB``: what the manifest said a save cost."""
    try:
        stall, write = float(payload["stall_s"]), float(payload["write_s"])
    except (KeyError, TypeError, ValueError):
        return words.fields(payload)[:300]
    written = payload.get("bytes")
    how_big = f", {words.size(written)}" if isinstance(written, int) else ""
    mode = f" ({payload['mode']})" if payload.get("mode") else ""
    return (
        f"checkpoint step {payload.get('step')}{mode}: training stalled "
        f"{words.seconds(stall)}, written in {words.seconds(write)}{how_big}"
    )


def _resume_check(payload: dict[str, Any]) -> str:
    """What comparing a resumed attempt's replayed steps with the reports before found."""
    attempt, step = payload.get("attempt"), payload.get("resume_step")
    diverged = payload.get("first_diverging_step")
    if payload.get("verified"):
        verdict = "replayed the steps as before"
    elif diverged is None:
        verdict = "could not be compared"
    else:
        verdict = f"diverged from step {diverged}"
    reason = payload.get("reason")
    return f"attempt {attempt} resumed from step {step}: {verdict}" + (
        f" ({reason})" if reason else ""
    )


def stacks_of(payload: dict[str, Any]) -> dict[str, str]:
    """The stack dump per rank of a hang event (empty for other kinds)."""
    stacks = payload.get("stacks", {})
    return (
        {str(rank): str(text) for rank, text in stacks.items()} if isinstance(stacks, dict) else {}
    )


def events(store: Store, job_id: str, *, include_steps: bool = False) -> dict[str, Any]:
    """``resurgo events``: what happened and why, oldest first.

    Entries: agent and supervisor ``event``s, the core's ``decision``s (with
    their explanation, and the failure class and rule it names) and the
    executor's ``action``s. Stack dumps are kept
    per rank under ``stacks``. Step reports are left out unless asked for.
    """
    entries: list[dict[str, Any]] = []
    for event in store.events_for(job_id):
        if event.kind == "step_losses" and not include_steps:
            continue
        entries.append(
            {
                "time_s": event.time_s,
                "type": "event",
                "source": event.source.value,
                "kind": event.kind,
                "node": event.node,
                "summary": _summary(event.kind, event.payload),
                "stacks": stacks_of(event.payload),
                # The frame each rank was in: py-spy lists it first, not last.
                "innermost": {
                    rank: words.innermost_frame(text)
                    for rank, text in stacks_of(event.payload).items()
                },
                "payload": {k: v for k, v in event.payload.items() if k != "stacks"},
            }
        )
    for decision in store.decisions_for(job_id):
        explanation = str(decision.detail.get("explanation", ""))
        named = words.failure_in(explanation)
        entries.append(
            {
                "time_s": decision.decided_s,
                "type": "decision",
                "source": "supervisor",
                "kind": f"{decision.from_state}->{decision.to_state}",
                "node": None,
                "summary": explanation,
                "cause": decision.cause,
                # The failure class and rule the explanation names (None: it names none).
                "failure": None if named is None else {"class": named[0], "rule": named[1]},
                "stacks": {},
                "innermost": {},
                "payload": decision.detail,
            }
        )
    for action in store.list_actions(job_id):
        entries.append(
            {
                "time_s": action.finished_s or action.started_s or action.planned_s,
                "type": "action",
                "source": "supervisor",
                "kind": action.kind,
                "node": action.args.get("node"),
                "summary": f"{action.action_id}: {action.state.value}"
                + (f" ({action.error})" if action.error else ""),
                "stacks": {},
                "innermost": {},
                "payload": {"args": action.args, "result": action.result, "starts": action.starts},
            }
        )
    entries.sort(key=lambda entry: entry["time_s"])
    return {"version": STATUS_VERSION, "job_id": job_id, "entries": entries}


def nodes(
    store: Store,
    slurm_nodes: dict[str, SlurmNode] | None,
    now_s: float,
    lemon_blames: int,
    lemon_window_s: float,
    lemon_users: int = 1,
) -> dict[str, Any]:
    """``resurgo nodes``: drained nodes with reasons, open drain tickets (with Slurm's
    state of their node, which shows whether an admin acted), the supervisor's own
    checks of blamed nodes (open, and those of the lemon window), blame history, the
    blames of the lemon window (each with the job's user and what was done about
    it, drained or not), the lemon list.

    ``slurm_nodes`` None means Slurm did not answer: the store's view alone.
    """
    history: dict[str, list[dict[str, Any]]] = {}
    users = store.job_users()
    open_drains = {d.node: d for d in store.open_drains()}
    names = set(open_drains) | set(slurm_nodes or {})
    for name in sorted(names):
        history[name] = [
            {
                "drained_s": d.drained_s,
                "cause": d.cause,
                "job_id": d.job_id,
                "user": users.get(d.job_id or ""),
                "reason": d.reason,
                "by": d.drained_by.value,
                "undrained_s": d.undrained_s,
                "undrained_by": None if d.undrained_by is None else d.undrained_by.value,
                "withdrawn_s": d.withdrawn_s,
                "withdrawn_by": None if d.withdrawn_by is None else d.withdrawn_by.value,
            }
            for d in store.blame_history(name)
        ]
    drained = []
    for name in sorted(names):
        node = (slurm_nodes or {}).get(name)
        # Slurm's answer wins: a Resurgo drain someone lifted is not drained,
        # whether or not the supervisor has recorded it as undone yet.
        if node is not None and not node.drained:
            continue
        drained.append(
            {
                "node": name,
                "slurm_state": None if node is None else node.state_text,
                "drained_in_slurm": None if node is None else node.drained,
                "reason": node.reason if node is not None else open_drains[name].reason,
                "by_resurgo": name in open_drains,
            }
        )
    lemons = store.lemons(lemon_blames, lemon_window_s, now_s, lemon_users)
    return {
        "version": STATUS_VERSION,
        "slurm_answered": slurm_nodes is not None,
        "drained": drained,
        "tickets": [
            {
                **ticket.document(),
                "user": users.get(ticket.job_id or ""),
                "slurm_state": None if node is None else node.state_text,
                "drained_in_slurm": None if node is None else node.drained,
            }
            for ticket in store.all_tickets()
            if ticket.closed_s is None
            for node in [(slurm_nodes or {}).get(ticket.node)]
        ],
        "checks": [
            check.document()
            for check in store.node_checks_since(now_s - lemon_window_s)[-MAX_BLAMES_SHOWN:]
        ],
        "history": {name: rows for name, rows in history.items() if rows},
        "blames": [blame.document() for blame in store.blames_since(now_s - lemon_window_s)][
            -MAX_BLAMES_SHOWN:
        ],
        "lemons": [
            {
                "node": lemon.node,
                "drains": lemon.drains,
                "users": lemon.users,
                "last_drained_s": lemon.last_drained_s,
            }
            for lemon in lemons
        ],
    }
