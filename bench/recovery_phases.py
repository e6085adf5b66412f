"""Where a Resurgo recovery's time goes: fault -> first resumed step, phase by phase.

Every boundary is a timestamp something really recorded (all on one host's
clock): the trainer's prints and step record, and the supervisor's store
(the fault event's arrival, the decisions, the action log). A phase whose
end has no timestamp is merged with the next one (its name joined with
``+``), never estimated. The phases sum to ``recover_s``:

- ``detection``: fault -> the first fault event's arrival at the supervisor
  (``received_s`` of the event the running -> recovering decision names);
- ``evidence window``: -> the decision that starts the recovery (the one
  that plans drain, stop ranks and checkpoint validation);
- ``drain and stop ranks``: -> both actions done (stop ranks is done when its
  command is queued to the agents, not when the ranks are gone);
- ``checkpoint choice``: -> the validation action done (the checkpoint chosen);
- ``relaunch``: -> the relaunch action done (the driver confirmed the new
  srun step), or for a requeue, the decision that the new attempt started;
  the driver confirms a step once it has run ``start_check_s``, so when the
  agents started before that, the confirmation is no boundary and the phase
  is one with ``agents start``;
- ``agents start``: -> the last new node agent's start of the script's
  launcher (its ``agent_started`` event's own time: Python start, health
  gate; the event's arrival may lag it by seconds on a loaded machine, while
  the ranks already start). The driver may
  confirm its step before or after the agents are up: when this mark is not
  later than the relaunch's, the two are one phase (``relaunch + agents
  start``), ending at the later mark;
- ``process start``: -> the restarted trainer's "starting at step" line
  (torchrun, rendezvous, the ranks' torch import, process group);
- ``checkpoint load``: the trainer restores its checkpoint *before* that
  line and prints no line of its own, so it has no timestamp: it is always
  merged with ``process start`` (``checkpoint load + process start``);
- ``first step``: -> the first training step after the resume.
"""

from __future__ import annotations

import statistics
from typing import Any

from supervisor.store import Store

PHASES = (
    "detection",
    "evidence window",
    "drain and stop ranks",
    "checkpoint choice",
    "relaunch",
    "agents start",
    "checkpoint load",  # before the start line: see breakdown()
    "process start",
    "first step",
)


def store_marks(store: Store, job_id: str) -> dict[str, Any]:
    """The supervisor's side of the first recovery of ``job_id``: the phase ends it
    recorded (None where it recorded none), how the job was relaunched, and the
    fault event's kind (with the hang timeout the agent applied, for a hang)."""
    marks: dict[str, Any] = {phase: None for phase in PHASES}
    decisions = store.decisions_for(job_id)
    opened = next(
        (
            d
            for d in decisions
            if d.from_state in ("running", "starting") and d.to_state == "recovering"
        ),
        None,
    )
    if opened is None:
        return {"marks": marks}
    info: dict[str, Any] = {"decided_at": opened.decided_s}
    events = {e.event_id: e for e in store.events_for(job_id)}
    fault = events.get(opened.event_id or "")
    if fault is not None:
        marks["detection"] = fault.received_s
        info["fault_event"] = fault.kind
        timeouts = [h["timeout_s"] for h in fault.payload.get("hung", []) if "timeout_s" in h]
        if timeouts:  # the hang timeout the agent applied (adaptive, floored)
            info["hang_timeout_s"] = max(timeouts)
    actions = [a for a in store.list_actions(job_id) if a.planned_s >= opened.decided_s]
    # By the agent's clock (this host's): it emits agent_started right after starting
    # the launcher, and under load the event itself arrived seconds later, while the
    # ranks were already starting.
    started = [
        e.time_s
        for e in events.values()
        if e.kind == "agent_started" and e.time_s > opened.decided_s
    ]
    # The rendezvous waits for every node: the last agent up is the mark.
    marks["agents start"] = max(started) if started else None
    validate = next((a for a in actions if a.kind == "validate"), None)
    if validate is not None:
        marks["evidence window"] = validate.planned_s
        stops = [
            a.finished_s
            for a in actions
            if a.kind in ("drain", "stop_ranks") and a.planned_s == validate.planned_s
        ]
        if stops and None not in stops:
            marks["drain and stop ranks"] = max(s for s in stops if s is not None)
        marks["checkpoint choice"] = validate.finished_s
    relaunch = next((a for a in actions if a.kind == "relaunch"), None)
    if relaunch is not None:
        # The driver confirms a relaunch once its step has run start_check_s (5 s): the
        # agents' own start, when earlier, is the boundary, not the confirmation.
        confirmed, agents = relaunch.finished_s, marks["agents start"]
        marks["relaunch"] = (
            confirmed if agents is None or confirmed is None or confirmed < agents else None
        )
    after = [d for d in decisions if d.decided_s > opened.decided_s]
    moved = next((d for d in after if d.to_state in ("relaunching", "requeued")), None)
    if moved is not None:
        info["path"] = moved.detail.get("explanation")
        if relaunch is None:  # a requeue: the new attempt's start is the mark
            begun = next(
                (d for d in after if d.decided_s > moved.decided_s and d.to_state == "starting"),
                None,
            )
            marks["relaunch"] = None if begun is None else begun.decided_s
    return {"marks": marks, **info}


def breakdown(
    fault_s: float, marks: dict[str, float | None], started_s: float, first_step_s: float
) -> dict[str, float]:
    """Seconds per phase, from the fault; a phase without an end timestamp merged with the
    next, one ending no later than the one before merged with that one."""
    # The trainer loads its checkpoint before it prints its start line: the load
    # ends inside the process start, whose line is the first timestamp after it.
    ends = [(phase, marks.get(phase)) for phase in PHASES[:6]]
    ends += [("checkpoint load", None), ("process start", started_s), ("first step", first_step_s)]
    phases: dict[str, float] = {}
    previous, pending = fault_s, []
    for phase, end in ends:
        pending.append(phase)
        if end is None:
            continue
        if end <= previous and phases:
            # Ended no later than the phase before it (the two ran side by side):
            # one phase, ending at the later mark.
            last = list(phases)[-1]
            phases[" + ".join([last, *pending])] = phases.pop(last)
        else:
            phases[" + ".join(pending)] = round(end - previous, 2)
            previous = end
        pending = []
    return phases


def median_breakdown(breakdowns: list[dict[str, float]]) -> dict[str, float | None]:
    """Each phase's median over runs. Phases one run merged (``a + b``) are merged in
    every run (their seconds summed), so each median covers the same span in all."""
    group = {phase: {phase} for phase in PHASES}
    for phases in breakdowns:
        for key in phases:
            merged = set().union(*(group[name] for name in key.split(" + ")))
            for name in merged:
                group[name] = merged
    spans: dict[str, list[float]] = {}
    for phases in breakdowns:
        summed: dict[str, float] = {}
        for key, seconds in phases.items():
            members = group[key.split(" + ")[0]]
            name = " + ".join(p for p in PHASES if p in members)
            summed[name] = summed.get(name, 0.0) + seconds
        for name, seconds in summed.items():
            spans.setdefault(name, []).append(seconds)
    order = {name: min(PHASES.index(p) for p in name.split(" + ")) for name in spans}
    return {name: _median(spans[name]) for name in sorted(spans, key=order.__getitem__)}


def _median(values: list[float]) -> float | None:
    return round(statistics.median(values), 2) if values else None


def summarize(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Medians over one stack's runs of a scenario: recovery, detection, each phase."""
    recovered = [r for r in runs if r.get("recover_s") is not None]
    summary: dict[str, Any] = {
        "runs": len(runs),
        "recovered": sum(r["outcome"] == "recovered" for r in runs),
        "recover_s": [r["recover_s"] for r in recovered],
        "median_recover_s": _median([r["recover_s"] for r in recovered]),
    }
    breakdowns = [run["breakdown"] for run in recovered if "breakdown" in run]
    if breakdowns:
        summary["median_breakdown"] = median_breakdown(breakdowns)
    timeouts = [r["hang_timeout_s"] for r in runs if "hang_timeout_s" in r]
    if timeouts:
        summary["median_hang_timeout_s"] = _median(timeouts)
    return summary
