"""``resurgo report``: one self-contained HTML file about one job, with plots.

- a timeline: training step against time, with checkpoints, faults
  (detections), drains and relaunches marked, and the world size over time
  below it;
- a goodput/badput breakdown;
- the event table (:func:`supervisor.views.documents.events`), stack dumps collapsed
  per rank in ``<details>``.

Plots are matplotlib figures embedded as inline SVG: the file needs nothing
else to display (no scripts, no network), so it can be mailed or attached to
an incident ticket.
"""

from __future__ import annotations

import html
import io
import time
from typing import Any

import matplotlib

matplotlib.use("Agg")  # no display on a head node
import matplotlib.pyplot as plt

from agent.checkpoint.layouts import step_in_path
from supervisor.core.goodput import Badput, Goodput
from supervisor.store import Store
from supervisor.views import documents as views
from supervisor.views.timeline import goodput_of

COLORS = {
    "step": "#1f4e79",
    "checkpoint": "#2e7d32",
    "fault": "#c62828",
    "drain": "#ef6c00",
    "relaunch": "#6a1b9a",
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


def _svg(figure: Any) -> str:
    buffer = io.StringIO()
    figure.savefig(buffer, format="svg", bbox_inches="tight")
    plt.close(figure)
    text = buffer.getvalue()
    return text[text.index("<svg") :]  # drop the XML prolog: the SVG sits inside HTML


def timeline_svg(store: Store, job_id: str, start_s: float, now_s: float) -> str:
    """Step against time with markers, and the world size below (minutes since submission)."""
    progress = store.progress_for(job_id)
    checkpoints = store.checkpoints_for(job_id)
    decisions = store.decisions_for(job_id)
    attempts = store.attempts_for(job_id)
    drains = [d for d in store.open_drains() if d.job_id == job_id]
    drains += [
        d
        for node in {d.node for d in store.drains_since(0)}
        for d in store.blame_history(node)
        if d.job_id == job_id and d not in drains
    ]

    def minutes(t: float) -> float:
        return (t - start_s) / 60.0

    figure, (steps_axis, size_axis) = plt.subplots(
        2, 1, figsize=(10, 5.6), sharex=True, gridspec_kw={"height_ratios": [3, 1]}
    )
    if progress:
        steps_axis.step(
            [minutes(p.time_s) for p in progress],
            [p.step for p in progress],
            where="post",
            color=COLORS["step"],
            linewidth=1.6,
            label="training step",
        )
    if checkpoints:
        steps_axis.scatter(
            [minutes(c.committed_s) for c in checkpoints],
            [c.step for c in checkpoints],
            color=COLORS["checkpoint"],
            marker="D",
            s=28,
            zorder=3,
            label="checkpoint committed",
        )
    detected = [d for d in decisions if d.to_state == "recovering" and d.from_state != "recovering"]
    for index, decision in enumerate(detected):
        steps_axis.axvline(
            minutes(decision.decided_s),
            color=COLORS["fault"],
            linestyle="--",
            linewidth=1.2,
            label="fault detected" if index == 0 else None,
        )
    for index, drain in enumerate(sorted(drains, key=lambda d: d.drained_s)):
        steps_axis.axvline(
            minutes(drain.drained_s),
            color=COLORS["drain"],
            linestyle="-",
            linewidth=2.0,
            alpha=0.7,
            label="node drained" if index == 0 else None,
        )
        steps_axis.annotate(
            f"drain {drain.node}",
            (minutes(drain.drained_s), 0.98),
            xycoords=("data", "axes fraction"),
            rotation=90,
            va="top",
            ha="right",
            fontsize=8,
            color=COLORS["drain"],
        )
    for index, attempt in enumerate(attempts[1:]):
        step = (step_in_path(attempt.resumed_from) or 0) if attempt.resumed_from else 0
        steps_axis.axvline(
            minutes(attempt.started_s),
            color=COLORS["relaunch"],
            linestyle=":",
            linewidth=1.6,
            label="relaunch" if index == 0 else None,
        )
        steps_axis.annotate(
            f"attempt {attempt.attempt}: {len(attempt.nodes)} nodes, from step {step}",
            (minutes(attempt.started_s), 0.02),
            xycoords=("data", "axes fraction"),
            rotation=90,
            va="bottom",
            ha="left",
            fontsize=8,
            color=COLORS["relaunch"],
        )
    steps_axis.set_ylabel("step")
    steps_axis.set_title(f"job {job_id}: progress, faults and recoveries")
    steps_axis.grid(alpha=0.3)
    if steps_axis.get_legend_handles_labels()[0]:  # a job with no step yet draws no line
        steps_axis.legend(loc="upper left", fontsize=8)
    if attempts:
        times, sizes = [], []
        for attempt in attempts:
            times.append(minutes(attempt.started_s))
            sizes.append(len(attempt.nodes))
            if attempt.ended_s is not None:
                times.append(minutes(attempt.ended_s))
                sizes.append(0)
        times.append(minutes(now_s))
        sizes.append(sizes[-1])
        size_axis.step(times, sizes, where="post", color=COLORS["size"], linewidth=1.6)
        size_axis.set_ylim(0, max(sizes) + 1)
    size_axis.set_ylabel("nodes")
    size_axis.set_xlabel("minutes since submission")
    size_axis.grid(alpha=0.3)
    return _svg(figure)


def goodput_svg(goodput: Goodput) -> str:
    """One horizontal bar: productive time and each badput cause, in seconds."""
    parts = [("productive", goodput.productive_s)] + [
        (kind.value, seconds) for kind, seconds in goodput.badput_s.items() if seconds > 0
    ]
    figure, axis = plt.subplots(figsize=(10, 1.9))
    left = 0.0
    for name, seconds in parts:
        axis.barh(0, seconds, left=left, color=BADPUT_COLORS[name],
                  label=f"{name.replace('_', ' ')}: {seconds:.1f} s")  # fmt: skip
        left += seconds
    axis.set_yticks([])
    axis.set_xlabel("seconds of wall time")
    axis.set_title(f"goodput {goodput.ratio * 100:.1f}% of {goodput.wall_s:.0f} s")
    axis.legend(loc="upper center", bbox_to_anchor=(0.5, -0.45), ncol=4, fontsize=8, frameon=False)
    return _svg(figure)


def _event_rows(document: dict[str, Any], start_s: float) -> str:
    rows = []
    for entry in document["entries"]:
        stacks = "".join(
            f"<details><summary>rank {html.escape(rank)} stack "
            f"({len(text.splitlines())} lines)</summary><pre>{html.escape(text)}</pre></details>"
            for rank, text in sorted(entry["stacks"].items(), key=lambda item: int(item[0]))
        )
        cause = entry.get("cause")
        what = html.escape(entry["kind"])
        if cause and cause != "none":
            what += f" [{html.escape(cause)}]"
        cells = (
            f"{(entry['time_s'] - start_s) / 60.0:.1f}",
            html.escape(entry["type"]),
            what,
            html.escape(entry["node"] or ""),
            html.escape(entry["summary"]) + stacks,
        )
        rows.append(
            f"<tr class='{html.escape(entry['type'])}'>"
            + "".join(f"<td>{cell}</td>" for cell in cells)
            + "</tr>"
        )
    return "\n".join(rows)


STYLE = """
body { font-family: sans-serif; margin: 2em; color: #212121; max-width: 1100px; }
h1 { font-size: 1.4em; } h2 { font-size: 1.15em; margin-top: 1.6em; }
table { border-collapse: collapse; width: 100%; font-size: 0.85em; }
th, td { border-bottom: 1px solid #e0e0e0; padding: 3px 6px; text-align: left; }
td { vertical-align: top; }
tr.decision td { background: #f3e5f5; } tr.action td { background: #fff3e0; }
pre { font-size: 0.85em; background: #fafafa; padding: 6px; overflow-x: auto; }
.summary td { border: none; padding: 2px 12px 2px 0; }
"""


def _spares(status: dict[str, Any]) -> str:
    """The hot spares ready now, of those asked for, and the swaps by cause."""
    if not status["spares_wanted"]:
        return "none asked for"
    ready = ", ".join(status["spare_nodes"]) or "none left"
    swaps = ", ".join(f"{c} {n}" for c, n in sorted(status["swaps"].items())) or "no swap yet"
    return f"{len(status['spare_nodes'])} of {status['spares_wanted']} ready ({ready}); {swaps}"


_ACTIONS = {
    "rollback": "rolled back",
    "drain": "its node drained (silent data corruption)",
    "crash_loop": "the job stopped (crash loop)",
    "alert": "alerted only",
}


def _health(status: dict[str, Any]) -> str:
    """The training anomalies and what each did: the rollback's checkpoint and skip."""
    anomalies = status.get("anomalies", [])
    if not anomalies:
        return "no anomaly (NaN, loss spike, grad explosion) seen"
    parts = []
    for seen in anomalies:
        text = f"{seen['kind']} at step {seen['onset_step']}: {_ACTIONS.get(seen['action'], '')}"
        if seen["resumed_step"] is not None:
            text += f" to step {seen['resumed_step']}"
        if seen["skipped"]:
            start, end = seen["skipped"]
            text += f", global samples [{start}, {end}) skipped"
        parts.append(text)
    total = views.skipped_count(status.get("skipped_samples", []))
    return "; ".join(parts) + (f" ({total} samples skipped in all)" if total else "")


def render(store: Store, job_id: str, now_s: float | None = None) -> str:
    """The whole report as HTML text; KeyError-free: unknown jobs are the caller's check."""
    now = time.time() if now_s is None else now_s
    row = store.get_job(job_id)
    if row is None:
        raise LookupError(f"job {job_id} is not known to the supervisor")
    status = views.status_row(store, job_id, now)
    assert status is not None
    goodput = goodput_of(store, job_id, now)
    start = row.created_s
    checkpoint = status["last_checkpoint"]
    restarts = ", ".join(f"{c} {n}" for c, n in sorted(status["restarts"].items())) or "none"
    facts = [
        ("state", status["state"] + (f": {status['final_reason']}" if status["final_reason"]
                                     else "")),
        ("world size", f"{status['world_size'] or '-'} of {status['original_nodes']} nodes "
                       f"(minimum {status['min_nodes']})"),
        ("hot spares", _spares(status)),
        ("restarts", restarts),
        ("training health", _health(status)),
        ("goodput", f"{goodput.ratio * 100:.1f}%"),
        ("newest checkpoint", "none" if checkpoint is None else
         f"step {checkpoint['step']} ({checkpoint['path']})"),
        ("drained for this job", ", ".join(status["drained_nodes"]) or "none"),
    ]  # fmt: skip
    summary = "".join(
        f"<tr><td><b>{html.escape(k)}</b></td><td>{html.escape(str(v))}</td></tr>" for k, v in facts
    )
    document = views.events(store, job_id)
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8">
<title>Resurgo report: job {html.escape(job_id)} ({html.escape(row.name)})</title>
<style>{STYLE}</style></head>
<body>
<h1>Resurgo report: job {html.escape(job_id)} ({html.escape(row.name)})</h1>
<p>Generated {time.strftime("%Y-%m-%d %H:%M:%S %Z", time.localtime(now))};
times below are minutes since submission.</p>
<table class="summary">{summary}</table>
<h2>Timeline</h2>
<figure id="timeline">{timeline_svg(store, job_id, start, now)}</figure>
<h2>Goodput</h2>
<figure id="goodput">{goodput_svg(goodput)}</figure>
<h2>Events</h2>
<table id="events"><thead>
<tr><th>min</th><th>type</th><th>what</th><th>node</th><th>detail</th></tr></thead>
<tbody>
{_event_rows(document, start)}
</tbody></table>
</body></html>
"""
