"""``resurgo report``: one self-contained HTML file about one job, with plots.

- a summary: state, size, restarts by cause, failures by class (with the
  rules that named them), training health, goodput, the newest checkpoint;
- a timeline: training step against time, with checkpoints, faults
  (detections, with the failure class where a rule named one), drains and
  relaunches marked, and the world size over time
  below it;
- a goodput/badput breakdown;
- the event table (:func:`supervisor.views.documents.events`), stack dumps collapsed
  per rank in ``<details>``.

Plots are matplotlib figures embedded as inline SVG
(:mod:`supervisor.views.plots`): the file needs nothing else to display (no
scripts, no network), so it can be mailed or attached to an incident ticket.
Times are counted from submission, in the unit the job's span calls for; a
job that has ended is shown up to its end, however long after it the report
is made.
"""

from __future__ import annotations

import html
import time
from typing import Any

from supervisor.store import Store
from supervisor.views import documents as views
from supervisor.views import words
from supervisor.views.plots import goodput_svg, timeline_svg, unit_of
from supervisor.views.timeline import goodput_of


def _event_rows(document: dict[str, Any], start_s: float, per_unit_s: float) -> str:
    rows = []
    for entry in document["entries"]:
        stacks = "".join(
            f"<details><summary>rank {html.escape(rank)} stack "
            f"({len(text.splitlines())} lines), innermost: "
            f"{html.escape(entry['innermost'].get(rank, ''))}</summary>"
            f"<pre>{html.escape(text)}</pre></details>"
            for rank, text in sorted(entry["stacks"].items(), key=lambda item: int(item[0]))
        )
        cause = entry.get("cause")
        what = html.escape(entry["kind"])
        if cause and cause != "none":
            what += f" [{html.escape(cause)}]"
        cells = (
            f"{(entry['time_s'] - start_s) / per_unit_s:.1f}",
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


def _rules_by_class(document: dict[str, Any]) -> dict[str, list[str]]:
    """The rules that named each failure class in the job's decisions, first seen first."""
    rules: dict[str, list[str]] = {}
    for entry in document["entries"]:
        failure = entry.get("failure")
        if failure and failure["rule"] not in rules.setdefault(failure["class"], []):
            rules[failure["class"]].append(failure["rule"])
    return rules


_SHORT = {"seconds": "s", "minutes": "min", "hours": "h"}


def _ended(status: dict[str, Any], start_s: float) -> str:
    """``, ended 2024-05-01 12:01:06 after 66 s`` for an ended job, else nothing."""
    ended_s = status["ended_s"]
    if ended_s is None:
        return ""
    return f", ended {words.clock(ended_s)} after {words.seconds(ended_s - start_s)}"


def render(store: Store, job_id: str, now_s: float | None = None) -> str:
    """The whole report as HTML text; KeyError-free: unknown jobs are the caller's check."""
    now = time.time() if now_s is None else now_s
    row = store.get_job(job_id)
    if row is None:
        raise LookupError(f"job {job_id} is not known to the supervisor")
    status = views.status_row(store, job_id, now)
    assert status is not None
    # An ended job is reported as of its end: its goodput, ages and axis stop there.
    end = now if status["ended_s"] is None else min(now, status["ended_s"])
    goodput = goodput_of(store, job_id, end)
    start = row.created_s
    per_unit_s, unit = unit_of(end - start)
    checkpoint = status["last_checkpoint"]
    restarts = ", ".join(f"{c} {n}" for c, n in sorted(status["restarts"].items())) or "none"
    document = views.events(store, job_id)
    facts = [
        ("state", status["state"] + (f": {status['final_reason']}" if status["final_reason"]
                                     else "")),
        ("world size", f"{status['world_size'] or '-'} of {status['original_nodes']} nodes "
                       f"(minimum {status['min_nodes']})"),
        ("hot spares", _spares(status)),
        ("restarts", restarts),
        ("failures by class", words.failures(status["failures"], _rules_by_class(document))),
        ("training health", _health(status)),
        ("goodput", words.goodput_line(goodput)),
        ("newest checkpoint", "none" if checkpoint is None else
         f"step {checkpoint['step']} ({checkpoint['path']}), "
         f"{words.seconds(end - checkpoint['committed_s'])} before "
         + ("the end" if status["ended_s"] is not None else "now")),
        ("drained for this job", ", ".join(status["drained_nodes"]) or "none"),
    ]  # fmt: skip
    summary = "".join(
        f"<tr><td><b>{html.escape(k)}</b></td><td>{html.escape(str(v))}</td></tr>" for k, v in facts
    )
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8">
<title>Resurgo report: job {html.escape(job_id)} ({html.escape(row.name)})</title>
<style>{STYLE}</style></head>
<body>
<h1>Resurgo report: job {html.escape(job_id)} ({html.escape(row.name)})</h1>
<p>Generated {time.strftime("%Y-%m-%d %H:%M:%S %Z", time.localtime(now))}; submitted
{words.clock(start)}{_ended(status, start)}; times below are {unit} since submission.</p>
<table class="summary">{summary}</table>
<h2>Timeline</h2>
<figure id="timeline">{timeline_svg(store, job_id, start, end)}</figure>
<h2>Goodput</h2>
<figure id="goodput">{goodput_svg(goodput)}</figure>
<h2>Events</h2>
<table id="events"><thead>
<tr><th>{_SHORT[unit]}</th><th>type</th><th>what</th><th>node</th><th>detail</th></tr></thead>
<tbody>
{_event_rows(document, start, per_unit_s)}
</tbody></table>
</body></html>
"""
