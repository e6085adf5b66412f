"""The report's plots as inline SVG: a job's timeline and its goodput bar.

The timeline's axis runs from submission to the job's end (to now only while
it runs): a report made a day after a one-minute job shows the minute, not a
sliver of a day. Its unit follows the span (seconds, minutes or hours). Each
fault (its cause, and the failure class and rule where a decision named
them), drain and relaunch is a vertical line on the step plot and a
horizontal label in a lane above it; :func:`lanes` puts a label that would
touch the one before it on the next row, so no two labels ever overlap. The
legend sits beside the plot, never on the data.
"""

from __future__ import annotations

import io
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import matplotlib

matplotlib.use("Agg")  # no display on a head node
import matplotlib.pyplot as plt

from agent.checkpoint.layouts import step_in_path
from supervisor.core.goodput import Badput, Goodput
from supervisor.store import DecisionRow, Store
from supervisor.views import words

COLORS = {
    "step": "#1f4e79",
    "checkpoint": "#2e7d32",
    "fault": "#c62828",
    "drain": "#ef6c00",
    "relaunch": "#6a1b9a",
    "requeue": "#37474f",
    "end": "#212121",
    "size": "#455a64",
}
BADPUT_COLORS = {
    "productive": "#2e7d32",
    Badput.LOST_WORK.value: "#c62828",
    Badput.DETECTION.value: "#ef6c00",
    Badput.RECOVERY.value: "#6a1b9a",
    Badput.CHECKPOINT_STALL.value: "#f9a825",
    Badput.STARTUP.value: "#546e7a",
    Badput.SHUTDOWN.value: "#78909c",
    Badput.QUEUE_WAIT.value: "#90a4ae",
}
WIDTH_IN = 11.0  # the figures' width; the plot area is PLOT_SHARE of it
PLOT_SHARE = 0.72
LABEL_PT = 8.0
# A character of an 8 pt sans label is about this wide, as a share of the font size
# (DejaVu Sans averages 0.55-0.6 em); a little over, so that estimates never touch.
CHAR_EM = 0.62
ROW_IN = 0.2  # one lane row's height


@dataclass(frozen=True)
class Mark:
    """One thing that happened at ``at`` (in the plot's unit): a line and its label."""

    at: float
    label: str
    kind: str  # a COLORS key


def unit_of(span_s: float) -> tuple[float, str]:
    """Seconds per unit and its name for an axis spanning ``span_s`` seconds."""
    if span_s <= 180:
        return 1.0, "seconds"
    if span_s <= 3 * 3600:
        return 60.0, "minutes"
    return 3600.0, "hours"


def lanes(marks: Sequence[Mark], span: float) -> list[tuple[Mark, int, bool]]:
    """Each mark with its row (0 the lowest) and whether its label runs left of its line
    (near the right edge). A label takes the lowest row where it keeps clear of the
    label before it in that row; ``span`` is the axis length in the marks' unit."""
    per_inch = span / (WIDTH_IN * PLOT_SHARE)
    gap = 0.08 * per_inch
    ends: list[float] = []  # the right edge of the last label in each row
    placed = []
    for mark in sorted(marks, key=lambda m: m.at):
        width = len(mark.label) * LABEL_PT * CHAR_EM / 72.0 * per_inch
        leftward = mark.at + width > span
        left = mark.at - width if leftward else mark.at
        row = next((i for i, end in enumerate(ends) if end + gap <= left), len(ends))
        if row == len(ends):
            ends.append(0.0)
        ends[row] = left + width
        placed.append((mark, row, leftward))
    return placed


def _svg(figure: Any) -> str:
    buffer = io.StringIO()
    figure.savefig(buffer, format="svg", bbox_inches="tight")
    plt.close(figure)
    text = buffer.getvalue()
    return text[text.index("<svg") :]  # drop the XML prolog: the SVG sits inside HTML


def _fault_cause(decisions: Sequence[DecisionRow], index: int) -> str:
    """The cause of the recovery opened at ``decisions[index]``: the first decision of it
    that names one (an exit evidence window names it when it closes)."""
    for decision in _recovery(decisions, index):
        if decision.cause not in ("none", ""):
            return str(decision.cause)
    return "fault"


def _fault_class(decisions: Sequence[DecisionRow], index: int, cause: str) -> str:
    """`` (rule kernel-oom-kill)``, `` (network, rule collective-network)``: the failure
    class (unless the cause says it) and rule a decision of the recovery opened at
    ``decisions[index]`` names; nothing when none names one."""
    for decision in _recovery(decisions, index):
        named = words.failure_in(str(decision.detail.get("explanation", "")))
        if named is not None:
            failure, rule = named
            return f" (rule {rule})" if failure == cause else f" ({failure}, rule {rule})"
    return ""


def _recovery(decisions: Sequence[DecisionRow], index: int) -> Sequence[DecisionRow]:
    """The decisions of the recovery opened at ``decisions[index]``: it and those after it
    while the job stays recovering."""
    for end in range(index + 1, len(decisions)):
        if decisions[end].from_state != "recovering":
            return decisions[index:end]
    return decisions[index:]


def marks_of(store: Store, job_id: str, start_s: float, per_unit_s: float) -> list[Mark]:
    """The faults detected, drains, relaunches, requeues and the end, in the plot's unit."""

    def at(t: float) -> float:
        return (t - start_s) / per_unit_s

    decisions = store.decisions_for(job_id)
    marks = []
    for index, decision in enumerate(decisions):
        source, target = decision.from_state, decision.to_state
        if target == "recovering" and source != "recovering":
            cause = _fault_cause(decisions, index)
            label = f"{cause} detected{_fault_class(decisions, index, cause)}"
            marks.append(Mark(at(decision.decided_s), label, "fault"))
        elif target == "requeued" and source != "requeued":
            marks.append(Mark(at(decision.decided_s), f"requeued ({decision.cause})", "requeue"))
        elif target in ("completed", "failed", "cancelled"):
            marks.append(Mark(at(decision.decided_s), target, "end"))
    drains = {d.drain_id: d for d in store.open_drains() if d.job_id == job_id}
    for node in {d.node for d in store.drains_since(0)}:
        drains.update({d.drain_id: d for d in store.blame_history(node) if d.job_id == job_id})
    marks += [Mark(at(d.drained_s), f"drain {d.node}", "drain") for d in drains.values()]
    for attempt in store.attempts_for(job_id)[1:]:
        step = (step_in_path(attempt.resumed_from) or 0) if attempt.resumed_from else 0
        label = f"attempt {attempt.attempt}: {len(attempt.nodes)} nodes, from step {step}"
        marks.append(Mark(at(attempt.started_s), label, "relaunch"))
    return marks


def timeline_svg(store: Store, job_id: str, start_s: float, end_s: float) -> str:
    """Step against time with its marks labelled in lanes above, and the world size
    below; the axis runs from submission (``start_s``) to ``end_s``."""
    per_unit_s, unit = unit_of(end_s - start_s)
    span = max((end_s - start_s) / per_unit_s, 1e-9)

    def at(t: float) -> float:
        return (t - start_s) / per_unit_s

    marks = marks_of(store, job_id, start_s, per_unit_s)
    placed = lanes(marks, span)
    rows = 1 + max((row for _, row, _ in placed), default=0)
    figure = plt.figure(figsize=(WIDTH_IN, 5.4 + rows * ROW_IN))
    grid = figure.add_gridspec(3, 1, height_ratios=[rows * ROW_IN, 3.6, 1.0], hspace=0.08)
    lane = figure.add_subplot(grid[0])
    steps_axis = figure.add_subplot(grid[1], sharex=lane)
    size_axis = figure.add_subplot(grid[2], sharex=lane)
    progress = store.progress_for(job_id)
    if progress:
        steps_axis.step([at(p.time_s) for p in progress], [p.step for p in progress],
                        where="post", color=COLORS["step"], linewidth=1.6,
                        label="training step")  # fmt: skip
    checkpoints = store.checkpoints_for(job_id)
    if checkpoints:
        steps_axis.scatter([at(c.committed_s) for c in checkpoints], [c.step for c in checkpoints],
                           color=COLORS["checkpoint"], marker="D", s=28, zorder=3,
                           label="checkpoint committed")  # fmt: skip
    styles = {"fault": "--", "drain": "-", "relaunch": ":", "requeue": "-.", "end": "-"}
    legends = {"fault": "fault detected", "drain": "node drained", "relaunch": "relaunch",
               "requeue": "requeued", "end": "job ended"}  # fmt: skip
    seen: set[str] = set()
    for mark, row, leftward in placed:
        color = COLORS[mark.kind]
        steps_axis.axvline(mark.at, color=color, linestyle=styles[mark.kind], linewidth=1.3,
                           label=None if mark.kind in seen else legends[mark.kind])  # fmt: skip
        seen.add(mark.kind)
        lane.plot([mark.at, mark.at], [row - 0.45, row + 0.45], color=color, linewidth=1.3)
        lane.annotate(mark.label, (mark.at, row), xytext=(-3 if leftward else 3, 0),
                      textcoords="offset points", ha="right" if leftward else "left",
                      va="center", fontsize=LABEL_PT, color=color)  # fmt: skip
    lane.set_ylim(-0.6, rows - 0.4)
    lane.set_yticks([])
    lane.tick_params(axis="x", labelbottom=False, bottom=False)
    for side in ("left", "right", "top"):
        lane.spines[side].set_visible(False)
    lane.set_title(f"job {job_id}: progress, faults and recoveries")
    steps_axis.set_ylabel("step")
    steps_axis.grid(alpha=0.3)
    steps_axis.tick_params(axis="x", labelbottom=False)
    if steps_axis.get_legend_handles_labels()[0]:  # a job with no step yet draws no line
        steps_axis.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8,
                          frameon=False)  # fmt: skip
    _world_size(store, job_id, size_axis, at, at(end_s))
    size_axis.set_ylabel("nodes")
    size_axis.set_xlabel(f"{unit} since submission")
    size_axis.grid(alpha=0.3)
    size_axis.set_xlim(0, span * 1.01)
    return _svg(figure)


def _world_size(store: Store, job_id: str, axis: Any, at: Any, end: float) -> None:
    """The nodes each attempt ran on, 0 between attempts, up to ``end``."""
    attempts = store.attempts_for(job_id)
    if not attempts:
        return
    times, sizes = [], []
    for attempt in attempts:
        times.append(at(attempt.started_s))
        sizes.append(len(attempt.nodes))
        if attempt.ended_s is not None:
            times.append(at(attempt.ended_s))
            sizes.append(0)
    times.append(max(end, times[-1]))
    sizes.append(sizes[-1])
    axis.step(times, sizes, where="post", color=COLORS["size"], linewidth=1.6)
    axis.set_ylim(0, max(sizes) + 1)


def goodput_svg(goodput: Goodput) -> str:
    """One horizontal bar: productive time and each badput cause, in seconds."""
    parts = [("productive", "productive", goodput.productive_s)] + [
        (kind.value, words.badput_name(kind), seconds)
        for kind, seconds in goodput.badput_s.items()
        if seconds >= 0.05
    ]
    figure, axis = plt.subplots(figsize=(WIDTH_IN * PLOT_SHARE + 0.9, 1.9))
    left = 0.0
    for key, name, seconds in parts:
        axis.barh(0, seconds, left=left, color=BADPUT_COLORS[key],
                  label=f"{name}: {words.seconds(seconds)}")  # fmt: skip
        left += seconds
    axis.set_yticks([])
    axis.set_xlim(0, max(goodput.wall_s, 1e-9))
    axis.set_xlabel("seconds of wall time")
    axis.set_title(f"goodput {goodput.ratio * 100:.1f}% of {words.seconds(goodput.wall_s)}")
    axis.legend(loc="upper center", bbox_to_anchor=(0.5, -0.45), ncol=4, fontsize=8, frameon=False)
    return _svg(figure)
