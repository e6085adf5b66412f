"""`resurgo status`, `events`, `nodes` and `report` over a real store (Slurm not needed)."""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import pytest

from agent.wire import protocol
from agent.wire.protocol import EventKind
from supervisor.cli.main import main
from supervisor.store import Store
from tests.unit.cli_world import INCARNATION, JOB


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    status = main(list(argv))
    captured = capsys.readouterr()
    return status, captured.out, captured.err


def test_status_shows_size_restarts_goodput_checkpoint_and_drains(
    state_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    status, out, _ = run(capsys, "status", "--state-dir", str(state_dir))
    assert status == 0
    header, row = out.strip().splitlines()
    assert header.split() == ["JOB", "NAME", "STATE", "NODES", "STEP", "RESTARTS", "FAILURES",
                              "GOODPUT", "CHECKPOINT", "DRAINED"]  # fmt: skip
    # A hang is no rank's failure: no class counted yet.
    assert re.search(
        r"4711\s+llm\s+running\s+2/3\s+12\s+hang 1\s+-\s+\d+\.\d%\s+10 \(\d+m ago\)\s+node3", row
    )


def test_status_json_is_the_documented_document(
    state_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    status, out, _ = run(capsys, "status", JOB, "nope", "--json", "--state-dir", str(state_dir))
    document = json.loads(out)
    assert status == 1  # an unknown job was asked for
    assert document["unknown"] == ["nope"]
    (job,) = document["jobs"]
    assert set(job) >= {"job_id", "name", "state", "attempt", "world_size", "original_nodes",
                        "min_nodes", "restarts", "failures", "goodput", "badput_s",
                        "last_checkpoint",
                        "drained_nodes", "final_reason"}  # fmt: skip
    assert job["last_checkpoint"]["step"] == 10
    assert 0 < job["goodput"] < 1


def test_events_collapse_stacks_per_rank_and_expand_them_on_request(
    state_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _, out, _ = run(capsys, "events", JOB, "--state-dir", str(state_dir))
    assert "rank 2 hung" in out
    assert "rank 2: 3 lines, innermost: all_reduce (c10d.py:9)" in out
    assert "train (train.py:40)" not in out
    assert "decision running->recovering" in out and "[hang]" in out
    _, full, _ = run(capsys, "events", JOB, "--stacks", "--state-dir", str(state_dir))
    assert "train (train.py:40)" in full
    _, text, _ = run(capsys, "events", JOB, "--json", "--state-dir", str(state_dir))
    entries = json.loads(text)["entries"]
    assert [e["type"] for e in entries].count("decision") == 3
    assert entries == sorted(entries, key=lambda e: e["time_s"])


def test_a_straggler_the_supervisor_found_reads_as_one_line(
    state_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with Store.open(state_dir / "resurgo.db") as store:
        payload = {"global_rank": 2, "compute_p50_s": 1.2003, "reference_s": 0.2004,
                   "ratio": 5.989, "steps_observed": 8, "attempt": 2}  # fmt: skip
        store.record_observation(JOB, "straggler", payload, time.time(), node="node2")
    _, out, _ = run(capsys, "events", JOB, "--state-dir", str(state_dir))
    assert "rank 2 computes 1.200s per step, 6.0x the other ranks' 0.200s" in out


def test_identical_events_in_a_row_read_as_one_line_with_their_count(
    state_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    start = time.time() - 30
    with Store.open(state_dir / "resurgo.db") as store:
        for index in range(5):  # a driver asking every 2 s
            payload = {"attempt": 2, "exit_code": 1}
            store.record_observation(JOB, "driver_step_ended", payload, start + 2 * index,
                                     node="node1")  # fmt: skip
        store.record_observation(JOB, "driver_step_ended", {"attempt": 3, "exit_code": 1},
                                 start + 11, node="node1")  # fmt: skip
    _, out, _ = run(capsys, "events", JOB, "--state-dir", str(state_dir))
    lines = [line for line in out.splitlines() if "driver_step_ended" in line]
    last = time.strftime("%H:%M:%S", time.localtime(start + 8))
    assert len(lines) == 2, out
    assert lines[0].endswith(f"(5 times, the last at {last})"), lines
    assert "times" not in lines[1]
    _, text, _ = run(capsys, "events", JOB, "--json", "--state-dir", str(state_dir))
    kinds = [e["kind"] for e in json.loads(text)["entries"]]
    assert kinds.count("driver_step_ended") == 6  # the document keeps every one


def test_unknown_jobs_and_a_missing_store_get_one_line_saying_what_to_do(
    state_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    status, _, err = run(capsys, "events", "999", "--state-dir", str(state_dir))
    assert status == 1 and "job 999 is not known to the supervisor" in err
    status, _, err = run(capsys, "status", "--state-dir", str(tmp_path / "elsewhere"))
    assert status == 1 and "no Resurgo store at" in err and "--state-dir" in err
    assert not (tmp_path / "elsewhere").exists()


def test_the_report_is_one_html_file_with_both_plots_and_the_events(
    state_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    output = tmp_path / "report.html"
    status, out, _ = run(capsys, "report", JOB, "-o", str(output), "--state-dir", str(state_dir))
    assert status == 0 and str(output) in out
    page = output.read_text()
    assert page.count("<svg") == 2
    assert '<figure id="timeline">' in page and '<figure id="goodput">' in page
    assert "drain node3" in page and "attempt 2: 2 nodes, from step 10" in page
    assert "<details><summary>rank 2 stack (3 lines), innermost: all_reduce (c10d.py:9)" in page
    assert "http://" not in page.split("<svg", 1)[0]  # nothing fetched from elsewhere


def test_a_backup_of_the_store_opens_and_holds_the_job(
    state_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    backup = tmp_path / "backup.db"
    status, out, _ = run(capsys, "store", "backup", str(backup), "--state-dir", str(state_dir))
    assert status == 0 and str(backup) in out
    with Store.open(backup, create=False) as copy:
        row = copy.get_job(JOB)
        assert row is not None and row.name == "llm"
        assert len(copy.decisions_for(JOB)) == 3


def test_log_lines_are_json_objects_with_the_decision_fields() -> None:
    import logging

    from supervisor.logs import JsonFormatter

    record = logging.LogRecord("resurgo", logging.INFO, "f", 1, "job %s: %s", ("7", "x"), None)
    record.job_id, record.from_state, record.to_state = "7", "running", "recovering"
    line = json.loads(JsonFormatter().format(record))
    assert line["message"] == "job 7: x" and line["level"] == "info"
    assert (line["job_id"], line["from_state"], line["to_state"]) == ("7", "running", "recovering")


@pytest.mark.parametrize(
    ("path", "kind"),
    [
        ("/ckpt/out/step-120", "dcp"),
        ("/ckpt/out/checkpoint-120/", "huggingface"),
        ("/ckpt/out/global_step120", "deepspeed"),
        ("/ckpt/out/last.ckpt", "lightning"),
        ("/ckpt/out/ckpt.pt", "torch.save"),
        ("/ckpt/out/model.safetensors.pth", "torch.save"),
        ("", "torch.save"),
        (None, "torch.save"),
    ],
)
def test_a_scripts_own_checkpoint_is_named_for_its_layout_by_its_name(
    path: str | None, kind: str
) -> None:
    from supervisor.views.documents import written_kind

    assert written_kind(path) == kind


def test_status_shows_the_scripts_own_newest_dcp_save_by_directory_and_step(
    state_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    own = "4712"
    now = time.time() - 30
    with Store.open(state_dir / "resurgo.db") as store:
        store.upsert_job(own, state="running", record={"attempt": 1, "nodes": ["node1"]},
                         now_s=now, name="fsdp", original_nodes=1, min_nodes=1)  # fmt: skip
        saves = [(100, "/out/ckpt.pt"), (110, "/out/step-110"), (120, "/out/step-120")]
        written = [
            protocol.make_event(
                EventKind.CHECKPOINT_WRITTEN,
                own,
                "node1",
                INCARNATION,
                seq,
                now + seq,
                {"step": step, "path": path, "global_rank": 0, "total_bytes": 4096},
            )
            for seq, (step, path) in enumerate(saves, 1)
        ]
        store.record_events(own, written, now_s=now + 5)
    _, out, _ = run(capsys, "status", own, "--json", "--state-dir", str(state_dir))
    (job,) = json.loads(out)["jobs"]
    newest = job["last_checkpoint"]
    assert (newest["kind"], newest["step"], newest["path"]) == ("dcp", 120, "/out/step-120")
    _, out, _ = run(capsys, "status", own, "--state-dir", str(state_dir))
    assert re.search(r"step-120 \(step 120, \d+s ago\)", out), out


def test_a_rollback_shows_in_status_events_and_the_report(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """What a person reads after a NaN: the anomaly, the resume point and the samples skipped."""
    state = tmp_path / "state"
    state.mkdir()
    now = time.time() - 600
    seen = {"kind": "non_finite", "onset_step": 9, "attempt": 1, "nodes": [], "cursor": 96,
            "batch": 12, "detail": "rank 1 reported a loss of nan at step 9",
            "action": "rollback", "skipped": [96, 132], "resumed_step": 8}  # fmt: skip
    with Store.open(state / "resurgo.db") as store:
        record = {"attempt": 2, "nodes": ["node1", "node2"], "restarts": [["training_anomaly", 1]],
                  "final_reason": "", "anomalies": [seen],
                  "skipped_samples": [[96, 132]]}  # fmt: skip
        store.upsert_job(JOB, state="running", record=record, now_s=now, name="llm",
                         original_nodes=2, min_nodes=2)  # fmt: skip
        payload = {k: seen[k] for k in ("kind", "onset_step", "attempt", "nodes", "cursor",
                                        "batch", "detail")}  # fmt: skip
        store.record_observation(JOB, "training_anomaly", {**payload, "ranks": [1]}, now + 10)
    _, out, _ = run(capsys, "status", "--state-dir", str(state))
    assert "training_anomaly 1, 36 samples skipped" in out
    _, out, _ = run(capsys, "status", "--json", "--state-dir", str(state))
    (job,) = json.loads(out)["jobs"]
    assert job["skipped_samples"] == [[96, 132]]
    assert job["anomalies"][0]["resumed_step"] == 8
    _, out, _ = run(capsys, "events", JOB, "--state-dir", str(state))
    assert "training anomaly non_finite from step 9, global sample 96" in out
    report = tmp_path / "r.html"
    run(capsys, "report", JOB, "-o", str(report), "--state-dir", str(state))
    text = report.read_text()
    assert "non_finite at step 9: rolled back to step 8, global samples [96, 132) skipped" in text
    assert "(36 samples skipped in all)" in text


def test_a_long_final_reason_is_cut_at_a_word_never_inside_one() -> None:
    from supervisor.cli.status import REASON_CHARS, _shortened

    reason = "a rank of attempt 3 ended with exit code 1 at step 8 while the job was reported"
    shown = _shortened(reason)
    assert len(shown) <= REASON_CHARS and shown.endswith(" ...")
    assert reason.startswith(shown[: -len(" ...")]) and reason[len(shown) - 4] == " "
