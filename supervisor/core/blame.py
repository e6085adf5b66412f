"""Attribution: which node is at fault for an observation, with evidence and a confidence.

Pure (STYLE.md §2): observations and the job record in, a :class:`Blame` out.
The policy drains a node only when the confidence reaches its threshold, so
the numbers here are the core's whole opinion of how sure it is:

- a rank killed by SIGKILL/SIGSEGV/SIGBUS/SIGILL points at the node (memory,
  hardware, the OOM killer): high; other signals (SIGABRT is how NCCL and c10
  errors die) are weak;
- when several ranks fail together only the first to die is the root cause
  (torchrun's rule: the failure with the earliest timestamp); its peers on
  other nodes fail moments later, when a collective sees the closed
  connection, and say nothing about their own node;
- a Python exception is never a node fault (DESIGN §3);
- a failed health check or a lost node: high;
- a collective hang: the rank that is behind (lowest last step) is strong
  evidence, one outside the collective everybody else waits in is good
  evidence, having stopped first is weak evidence (beats jitter);
- a straggler: the node is slow, which is a fact, not a fault, until persistent.
"""

from __future__ import annotations

import signal as signals
from dataclasses import dataclass, replace

from supervisor.core.model import Cause, ClusterView, ExitSeen, JobRecord, Suspect, at_step
from supervisor.core.observations import (
    AgentReport,
    HangReported,
    HealthCheckFailed,
    LeaseExpired,
    Observation,
    RankExited,
    SlurmNodeSeen,
    SpareCheckFailed,
    StragglerReported,
)

# Deaths that come from the machine, not from Python: bad memory, a bus error,
# an illegal instruction on a broken CPU, the kernel's OOM killer or a
# watchdog's SIGKILL.
NODE_SIGNALS = frozenset(
    {signals.SIGKILL.value, signals.SIGSEGV.value, signals.SIGBUS.value, signals.SIGILL.value}
)
# How a rank ends when someone stops it on purpose (torchrun tearing down the
# other ranks after one failed, our own StopRanks, scancel): not a fault.
STOP_SIGNALS = frozenset({signals.SIGTERM.value, signals.SIGINT.value, signals.SIGHUP.value})

CONFIDENCE_NODE_SIGNAL = 0.8
CONFIDENCE_OTHER_SIGNAL = 0.4
CONFIDENCE_HEALTH_CHECK = 0.9
# The health gate's checks of what the nodes share (the checkpoint root on a
# shared file system, the rendezvous address): a full or read-only file system
# fails them on every node at once, so their failure alone blames no node
# (the restart budget then ends a job that cannot save; agent.node.healthchecks).
SHARED_CHECKS = frozenset({"builtin:ckpt_root", "builtin:rdzv_addr"})
CONFIDENCE_SHARED_CHECK = 0.0
CONFIDENCE_NODE_LOST = 1.0
CONFIDENCE_HANG_BEHIND = 0.8
CONFIDENCE_HANG_OUTSIDE_COLLECTIVE = 0.6
CONFIDENCE_HANG_FIRST_STOPPED = 0.4
CONFIDENCE_HANG_ALONE = 0.3
CONFIDENCE_STRAGGLER = 0.5
# A node already on the cluster's lemon list is more likely the culprit again.
LEMON_BONUS = 0.1
# Deaths this close together count as simultaneous: shims reap at their own
# pace and NTP keeps nodes' clocks only about this close, so the order within
# it means little. A node signal then beats an exception: a peer of a SIGKILLed
# rank can raise in the same instant, but an exception makes no node kill a rank.
EXIT_TIE_TOLERANCE_S = 0.05


@dataclass(frozen=True)
class Blame:
    """The verdict: ``node`` (None: no node is at fault), why, how sure, and what shows it.

    ``hardware``: the evidence is the machine's own, which no job controls
    (Slurm reports the node not responding); a drain then needs no check of
    the supervisor's first (:mod:`supervisor.core.drains`).
    """

    node: str | None
    cause: Cause
    confidence: float
    evidence: tuple[str, ...]
    hardware: bool = False


def suspects_of(event: HangReported) -> tuple[Suspect, ...]:
    """A HANG event's culprits as :class:`Suspect` values with an absolute stop time."""
    return tuple(
        Suspect(
            node=event.node,
            global_rank=c.global_rank,
            last_step=c.last_step,
            in_collective=c.in_collective,
            stopped_at_s=event.time_s - (c.seconds_since_progress or 0.0),
            reason=c.reason,
        )
        for c in event.culprits
    )


def exit_seen(event: RankExited) -> ExitSeen:
    """A RANK_EXITED event as an :class:`ExitSeen`, dead at its exit time (else the event's);
    its uncaught exception and when it raised it, if it raised one."""
    return ExitSeen(
        node=event.node,
        global_rank=event.global_rank,
        exit_code=event.exit_code,
        signal=event.signal,
        step=event.step,
        died_at_s=event.time_s if event.exit_time_s is None else event.exit_time_s,
        error_digest=event.error_digest,
        raised=event.raised,
        raised_at_s=event.raised_time_s if event.raised is not None else None,
        script_ended=event.script_ended,
    )


def is_failure(seen: ExitSeen) -> bool:
    """False for a rank that finished (code 0) or was stopped on purpose (a stop signal)
    without an exception of its own."""
    if seen.raised is not None:
        return True
    if seen.signal is None:
        return seen.exit_code != 0
    return seen.signal not in STOP_SIGNALS


def root_cause(exits: tuple[ExitSeen, ...]) -> ExitSeen:
    """The exit that caused the others (``exits``: at least one).

    The earliest failure; among those within :data:`EXIT_TIE_TOLERANCE_S` of
    it, a node signal first, then the earliest. A rank fails when it dies, or,
    when no rank died by a node signal, when it raised its uncaught exception
    if that was earlier: the peers of a rank that raised abort on its closed
    connections while it still unwinds, and torchrun then stops it. A node
    signal's peers raise too (the same closed connections) a moment after the
    death, and the death's own record may come later than their exceptions:
    there, the deaths alone decide.
    """
    by_raise = not any(seen.signal in NODE_SIGNALS for seen in exits)

    def failed_at(seen: ExitSeen) -> float:
        if by_raise and seen.raised_at_s is not None:
            return min(seen.died_at_s, seen.raised_at_s)
        return seen.died_at_s

    first = min(failed_at(seen) for seen in exits)
    tied = [seen for seen in exits if failed_at(seen) - first <= EXIT_TIE_TOLERANCE_S]
    return min(tied, key=lambda seen: (seen.signal not in NODE_SIGNALS, failed_at(seen)))


def blame_exits(
    exits: tuple[ExitSeen, ...], record: JobRecord, lemons: frozenset[str] = frozenset()
) -> tuple[ExitSeen, Blame]:
    """The root cause among ranks that failed together (see :func:`root_cause`), and its blame.

    The evidence names the root cause and how many ranks failed after it, so
    an operator reading a drain reason sees why this node and not another.
    """
    root = root_cause(exits)
    verdict = _with_lemon(_rank_exit(root, record), lemons)
    later = sorted(seen.died_at_s - root.died_at_s for seen in exits if seen is not root)
    if not later:
        return root, verdict
    first, *rest = verdict.evidence
    others = "the other" if len(later) == 1 else "the others"
    summary = f"{first}, first of {len(exits)} failed ranks; {others} failed {_after(later)}"
    return root, replace(verdict, evidence=(summary, *rest))


def _after(later: list[float]) -> str:
    """When the other ranks died, seen from the root cause's death (sorted seconds)."""
    low, high = later[0], later[-1]
    if low < 0:
        # A peer's death was stamped first, within the tie tolerance.
        span = f"{low:+.2f}s" if low == high else f"{low:+.2f}s to {high:+.2f}s"
        return f"{span} from it (a tie goes to the node signal)"
    span = f"{low:.1f}s" if round(low, 1) == round(high, 1) else f"{low:.1f}-{high:.1f}s"
    return f"{span} later"


def _suspicion(s: Suspect) -> tuple[bool, int, bool, float, str, int]:
    # Behind first (unknown steps last), then outside the collective, then stopped first.
    return (
        s.last_step is None,
        s.last_step or 0,
        s.in_collective is not False,
        s.stopped_at_s,
        s.node,
        s.global_rank,
    )


def blame_hang(
    suspects: tuple[Suspect, ...],
    lemons: frozenset[str] = frozenset(),
    job_nodes: tuple[str, ...] = (),
) -> Blame:
    """Compare the hung ranks of every node that reported and blame the most suspect one.

    ``job_nodes`` (the job's nodes): when every reported rank waits inside a
    collective and exactly one of the job's nodes reported nothing, that node
    is the one they wait for: a rank that is stopped, or stuck outside any
    collective, does not look hung to a detector that watches collectives.
    """
    if not suspects:
        return Blame(None, Cause.HANG, 0.0, ("no hung rank was reported with evidence",))
    silent = sorted(set(job_nodes) - {s.node for s in suspects})
    if len(silent) == 1 and all(s.in_collective for s in suspects):
        waiting = ", ".join(sorted({s.node for s in suspects}))
        why = (
            f"every hung rank ({waiting}) waits in a collective and {silent[0]} reported none: "
            f"its ranks are the ones they wait for"
        )
        confidence = CONFIDENCE_HANG_OUTSIDE_COLLECTIVE
        if silent[0] in lemons:
            confidence = min(1.0, confidence + LEMON_BONUS)
        return Blame(silent[0], Cause.HANG, confidence, (why,))
    ranked = sorted(suspects, key=_suspicion)
    top, others = ranked[0], ranked[1:]
    where = f"rank {top.global_rank} on {top.node}"
    if not others:
        confidence, why = CONFIDENCE_HANG_ALONE, f"{where} is the only hung rank reported"
    elif top.last_step is not None and all(
        o.last_step is not None and o.last_step > top.last_step for o in others
    ):
        behind = min(o.last_step for o in others if o.last_step is not None) - top.last_step
        confidence = CONFIDENCE_HANG_BEHIND
        why = f"{where} is {behind} step(s) behind every other hung rank (step {top.last_step})"
    elif top.in_collective is False and all(o.in_collective for o in others):
        confidence = CONFIDENCE_HANG_OUTSIDE_COLLECTIVE
        why = f"{where} is outside the collective the others wait in"
    elif all(o.stopped_at_s > top.stopped_at_s for o in others):
        stopped_earlier = min(o.stopped_at_s for o in others) - top.stopped_at_s
        confidence = CONFIDENCE_HANG_FIRST_STOPPED
        why = f"{where} stopped {stopped_earlier:.1f}s before the others"
    else:
        return Blame(None, Cause.HANG, 0.0, (f"no hung rank stands out among {len(ranked)}",))
    if top.node in lemons:
        confidence = min(1.0, confidence + LEMON_BONUS)
    evidence = (why, *(f"{s.node} rank {s.global_rank}: {s.reason}" for s in ranked if s.reason))
    return Blame(top.node, Cause.HANG, confidence, evidence)


def _rank_exit(seen: ExitSeen, record: JobRecord) -> Blame:
    node = seen.node or record.node_of_rank(seen.global_rank or 0)
    rank = f"rank {seen.global_rank} on {node}"
    if seen.raised is not None:
        # The user's code raised: whatever ended the process after (torchrun's
        # SIGTERM while it unwound, a peer's abort) followed from it.
        ended = (
            f"ended by {_signal_name(seen.signal)}"
            if seen.signal is not None
            else f"exit code {seen.exit_code}"
        )
        return Blame(
            None,
            Cause.USER_EXCEPTION,
            0.0,
            (f"{rank} raised {seen.raised} {at_step(seen.step)} ({ended}): the user's code",),
        )
    if seen.signal is not None:
        name = _signal_name(seen.signal)
        if seen.signal in STOP_SIGNALS:
            return Blame(None, Cause.RANK_SIGNAL, 0.0, (f"{rank} was stopped by {name}",))
        confidence = (
            CONFIDENCE_NODE_SIGNAL if seen.signal in NODE_SIGNALS else CONFIDENCE_OTHER_SIGNAL
        )
        return Blame(
            node, Cause.RANK_SIGNAL, confidence, (f"{rank} died by {name} {at_step(seen.step)}",)
        )
    return Blame(
        None,
        Cause.USER_EXCEPTION,
        0.0,
        (f"{rank} exited with code {seen.exit_code} {at_step(seen.step)}: the user's code",),
    )


def _signal_name(number: int) -> str:
    try:
        return signals.Signals(number).name
    except ValueError:
        return f"signal {number}"


def blame(
    observation: Observation,
    record: JobRecord,
    cluster: ClusterView | None = None,
) -> Blame:
    """Attribute ``observation`` to a node, or to none.

    For a hang report the suspects already collected in ``record.recovery`` from
    other nodes are compared with this report's. The repeat offenders (and the
    nodes this user's jobs ticketed: :meth:`ClusterView.avoided_by`) raise the
    confidence against a node already among them.
    """
    lemons = cluster.avoided_by(record.slurm_user) if cluster is not None else frozenset()
    if isinstance(observation, RankExited):
        return of_rank_exit(observation, record, lemons)
    if isinstance(observation, HangReported):
        return of_hang(observation, record, lemons)
    if isinstance(observation, HealthCheckFailed):
        return of_health_check(observation, record, lemons)
    if isinstance(observation, StragglerReported):
        return of_straggler(observation, record, lemons)
    return _with_lemon(_blame(observation), lemons)


def _with_lemon(result: Blame, lemons: frozenset[str]) -> Blame:
    if result.node is None or result.node not in lemons:
        return result
    return replace(
        result,
        confidence=min(1.0, result.confidence + LEMON_BONUS),
        evidence=(*result.evidence, f"{result.node} is on the lemon list"),
    )


def of_rank_exit(report: RankExited, record: JobRecord, lemons: frozenset[str]) -> Blame:
    """A rank's exit alone (see :func:`blame_exits` for several): a node signal blames
    its node, an exception or an exit code the user's code."""
    return _with_lemon(_rank_exit(exit_seen(report), record), lemons)


def of_hang(report: HangReported, record: JobRecord, lemons: frozenset[str]) -> Blame:
    """A hang report compared with the suspects other nodes already reported
    (:func:`blame_hang`)."""
    earlier = record.recovery.suspects if record.recovery else ()
    return blame_hang((*earlier, *suspects_of(report)), lemons, record.nodes)


def of_health_check(report: HealthCheckFailed, record: JobRecord, lemons: frozenset[str]) -> Blame:
    """A failed health gate: its node, unless only the checks of what nodes share failed."""
    failed = report.failed_checks
    evidence = f"health check failed on {report.node}: {report.detail}".strip()
    if failed and SHARED_CHECKS.issuperset(failed):
        shared = (
            f"{', '.join(failed)} failed: something the nodes share (checkpoint root, "
            "rendezvous address), not the node; fix it, the job retries within its budget"
        )
        return Blame(None, Cause.HEALTH_CHECK, CONFIDENCE_SHARED_CHECK, (shared, evidence))
    verdict = Blame(report.node, Cause.HEALTH_CHECK, CONFIDENCE_HEALTH_CHECK, (evidence,))
    return _with_lemon(verdict, lemons)


def of_straggler(report: StragglerReported, record: JobRecord, lemons: frozenset[str]) -> Blame:
    """A straggler's node: slow is a fact, not yet a fault (:data:`CONFIDENCE_STRAGGLER`)."""
    evidence = (f"straggler on {report.node}: {report.detail}".strip(),)
    return _with_lemon(Blame(report.node, Cause.STRAGGLER, CONFIDENCE_STRAGGLER, evidence), lemons)


def _blame(observation: Observation) -> Blame:
    if isinstance(observation, LeaseExpired):
        return Blame(
            observation.node,
            Cause.NODE_LOST,
            CONFIDENCE_NODE_LOST,
            (f"the agent on {observation.node} stopped calling in (lease expired)",),
        )
    if isinstance(observation, SpareCheckFailed):
        why = f"health check failed on idle spare {observation.node}: {observation.detail}"
        return Blame(observation.node, Cause.HEALTH_CHECK, 1.0, (why,))
    if isinstance(observation, SlurmNodeSeen):
        states = [
            name
            for name, flag in (
                ("DOWN", observation.down),
                ("NOT_RESPONDING", observation.not_responding),
            )
            if flag
        ]
        if not states:
            return Blame(None, Cause.NODE_LOST, 0.0, (f"Slurm sees {observation.node} up",))
        return Blame(
            observation.node,
            Cause.NODE_LOST,
            CONFIDENCE_NODE_LOST,
            (f"Slurm reports {observation.node} {'+'.join(states)}",),
            hardware=True,
        )
    if isinstance(observation, AgentReport):
        return Blame(None, Cause.OPERATOR, 0.0, (f"{observation.KIND.value} is not a fault",))
    return Blame(None, Cause.OPERATOR, 0.0, ("not a fault observation",))
