"""Every view of every kind of job reads as a person would write it.

The store holds one job of each kind (``tests/unit/views_world.py``), all
ended or last heard of a day ago; each view is rendered as text and as JSON
and must show no ``None``, no float longer than four significant digits, no
Unix time and no traceback (``tests/unit/view_checks.py``). Each rule is shown
to catch a planted defect.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from agent.checkpoint import format as fmt
from supervisor.cli.main import main
from supervisor.store import Store
from supervisor.views.plots import Mark, lanes, marks_of
from tests.ckpt_helpers import make_committed_checkpoint
from tests.unit.view_checks import defects, json_strings, rules_broken, visible_text
from tests.unit.views_world import COMPLETED, COMPLETED_WALL_S, JOBS, OOM, recorded_state_dir

A_DAY_S = 86400.0


@pytest.fixture(scope="module")
def state_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The seven jobs, submitted a day and a minute ago (the views read the real clock)."""
    return recorded_state_dir(tmp_path_factory.mktemp("views"), time.time() - A_DAY_S - 60)


def shown(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    """What the command printed, both streams; it must have succeeded."""
    status = main(list(argv))
    captured = capsys.readouterr()
    assert status == 0, captured.err
    return captured.out + captured.err


VIEWS = [
    ["status"],
    *[["status", job] for job in JOBS],
    *[["events", job] for job in JOBS],
    *[["events", job, "--stacks"] for job in JOBS],
    ["nodes"],
]


@pytest.mark.parametrize("argv", VIEWS, ids=" ".join)
def test_every_view_of_every_kind_of_job_reads_well_as_text(
    argv: list[str], state_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert defects(shown(capsys, *argv, "--state-dir", str(state_dir))) == []


@pytest.mark.parametrize("argv", [v for v in VIEWS if "--stacks" not in v], ids=" ".join)
def test_every_json_document_reads_well_where_people_read_it(
    argv: list[str], state_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    document = json.loads(shown(capsys, *argv, "--json", "--state-dir", str(state_dir)))
    assert [found for text in json_strings(document) for found in defects(text)] == []


@pytest.mark.parametrize("job", JOBS)
def test_every_report_reads_well(
    job: str, state_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    page = tmp_path / "report.html"
    shown(capsys, "report", job, "-o", str(page), "--state-dir", str(state_dir))
    assert defects(visible_text(page.read_text())) == []


def test_a_report_made_a_day_after_a_short_job_shows_the_job_not_the_day(
    state_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    page = tmp_path / "report.html"
    shown(capsys, "report", COMPLETED, "-o", str(page), "--state-dir", str(state_dir))
    text = visible_text(page.read_text())
    assert "times below are seconds since submission" in text
    assert f"after {COMPLETED_WALL_S:.0f} s" in text
    assert "the rest: start-up 27.5 s" in text  # what the badput was, largest first
    assert "1 s before the end" in text  # the newest checkpoint's age, not a day's


def test_an_ended_jobs_checkpoint_age_stops_at_its_end(
    state_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = shown(capsys, "status", COMPLETED, "--state-dir", str(state_dir))
    assert "20 (1s before the end)" in out and "ago" not in out


def test_the_hang_evidence_names_each_ranks_innermost_frame(
    state_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = shown(capsys, "events", COMPLETED, "--state-dir", str(state_dir))
    assert "rank 0: 10 lines, innermost: all_gather_single (torch/distributed/" in out
    assert "rank 2: 10 lines, innermost: stall_forever (train_toy.py:188)" in out
    assert "<module>" not in out
    assert "rank 2 hung" in out and "ranks 2 hung" not in out


def test_status_counts_a_jobs_failures_by_class_and_the_stop_reason_keeps_the_class(
    state_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = shown(capsys, "status", OOM, "--state-dir", str(state_dir))
    assert "FAILURES" in out and "network 1, oom 2" in out
    assert 'failed (oom (rule kernel-oom-kill): "Memory' in out  # cut after the class words
    document = json.loads(shown(capsys, "status", OOM, "--json", "--state-dir", str(state_dir)))
    assert document["jobs"][0]["failures"] == {"network": 1, "oom": 2}


def test_events_name_the_class_and_rule_beside_a_recoverys_cause(
    state_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = shown(capsys, "events", OOM, "--state-dir", str(state_dir))
    assert "[user_exception; class network, rule collective-network]" in out
    assert "retry 1 of 1, no node blamed [oom; rule kernel-oom-kill]" in out
    assert "relaunch on 2 nodes from step 5 [oom]" in out  # names no class: none shown
    document = json.loads(shown(capsys, "events", OOM, "--json", "--state-dir", str(state_dir)))
    named = [e["failure"] for e in document["entries"] if e["type"] == "decision"]
    assert named.count({"class": "oom", "rule": "kernel-oom-kill"}) == 2
    assert named.count({"class": "network", "rule": "collective-network"}) == 1


def test_the_report_counts_failures_by_class_and_labels_faults_with_their_class(
    state_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    page = tmp_path / "report.html"
    shown(capsys, "report", OOM, "-o", str(page), "--state-dir", str(state_dir))
    text = visible_text(page.read_text())
    assert "failures by class" in text
    assert "network 1 (collective-network), oom 2 (kernel-oom-kill)" in text
    with Store.open(state_dir / "resurgo.db") as store:
        row = store.get_job(OOM)
        assert row is not None
        labels = [mark.label for mark in marks_of(store, OOM, row.created_s, 1.0)]
    assert "user_exception detected (network, rule collective-network)" in labels
    assert "oom detected (rule kernel-oom-kill)" in labels


def test_an_unknown_job_points_to_the_known_ones(
    state_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["status", "999", "--state-dir", str(state_dir)]) == 1
    out = capsys.readouterr().out
    assert "job 999: not known to the supervisor" in out and "no supervised jobs" not in out
    assert f"known jobs: {', '.join(JOBS)}" in out


def test_a_node_named_without_an_action_is_answered_with_undrain(
    state_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["nodes", "node3", "--state-dir", str(state_dir)]) == 2
    err = capsys.readouterr().err
    assert "resurgo nodes undrain node3" in err and "invalid choice" not in err


def test_ckpt_list_reads_well(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    stats = fmt.SaveStats(0.011354302999990296, 0.03732607900002449, 183210, "local", "async")
    for step in (10, 20):
        make_committed_checkpoint(tmp_path / "ckpt", step, stats=stats)
    root = str(tmp_path / "ckpt")
    assert defects(shown(capsys, "ckpt", "list", root)) == []
    document = json.loads(shown(capsys, "ckpt", "list", root, "--json"))
    assert [found for text in json_strings(document) for found in defects(text)] == []


def test_relaunch_labels_close_together_never_share_a_row() -> None:
    marks = [
        Mark(34.2, "rank_signal detected", "fault"),
        Mark(36.1, "drain node4", "drain"),
        Mark(38.0, "attempt 2: 3 nodes, from step 5", "relaunch"),
        Mark(38.5, "attempt 3: 2 nodes, from step 10", "relaunch"),
        Mark(66.0, "completed", "end"),
    ]
    rows = [row for _, row, _ in lanes(marks, span=66.0)]
    assert len(set(rows[:4])) == 4  # four labels within 5 s of 66: four rows
    placed = {mark.label: leftward for mark, _, leftward in lanes(marks, span=66.0)}
    assert placed["completed"] and not placed["drain node4"]  # the last ends at its line


PLANTED = [
    ("None", "attempt 2 resumed from step 5, first_diverging_step=None"),
    ("long float", "stall_s=0.011354302999990296, write_s=0.03732607900002449"),
    ("long float", "goodput 16.34567%"),
    ("epoch time", "exit_time_unix_s=1700000034.000125"),
    ("epoch time", "drained at 1764480000"),
    ("traceback", 'Traceback (most recent call last):\n  File "x.py", line 3, in <module>'),
    ("traceback", '  File "/work/supervisor/cli/status.py", line 88, in run'),
]


@pytest.mark.parametrize(("rule", "text"), PLANTED)
def test_each_rule_catches_its_planted_defect(rule: str, text: str) -> None:
    assert rule in rules_broken(text)


@pytest.mark.parametrize(
    "text",
    [
        "checkpoint step 5 (async): training stalled 11.4 ms, written in 37.3 ms, 183 kB",
        "2026-12-04 23:31:53  hang  node3  rank 2 hung",
        "innermost: all_reduce (torch/distributed/distributed_c10d.py:3252), Python v3.11.7",
        "goodput 17.4% of 66 s trained; the rest: start-up 27.5 s, lost work 4.99 s",
        "none",
    ],
)
def test_what_reads_well_passes_every_rule(text: str) -> None:
    assert defects(text) == []
