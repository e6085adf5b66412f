"""The supervisor recovering real torchrun jobs on the live local Slurm cluster.

Each test runs ``resurgo-supervisor`` as a process, submits the toy training
job (deploy/demo/train_toy.py) the way ``resurgo submit`` does, injects a
fault, and checks the outcome in Slurm and in the supervisor's store.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from agent.checkpoint.format import MANIFEST_NAME
from supervisor.store import ActionState
from tests.conftest import LiveCluster
from tests.prometheus_harness import PrometheusProcess, dashboard_expressions
from tests.supervisor_harness import (
    TORCHRUN,
    TOY,
    SupervisorProcess,
    kill_rank_on,
    render_in_chromium,
    toy_spec,
)

pytestmark = pytest.mark.slurm

POLICY = {
    # Four nodes: a share of 1/4 allows exactly one drain per hour.
    "max_drain_share_per_hour": "0.25",
    "backoff_base_s": "2",
    "validation_level": "full",
}
ENDED = {"COMPLETED", "FAILED", "CANCELLED"}


@pytest.fixture
def supervisor(slurm_cluster: LiveCluster, tmp_path: Path) -> Iterator[SupervisorProcess]:
    process = SupervisorProcess(slurm_cluster, tmp_path / "state", POLICY)
    process.start()
    try:
        yield process
    finally:
        process.stop()
        _leave_cluster_clean(slurm_cluster)


@pytest.fixture
def prometheus(supervisor: SupervisorProcess, tmp_path: Path) -> Iterator[PrometheusProcess]:
    """A real Prometheus scraping the supervisor every second, with Resurgo's alert rules."""
    process = PrometheusProcess(tmp_path / "prometheus", f"127.0.0.1:{supervisor.port}")
    process.start()
    try:
        yield process
    finally:
        process.stop()


def _leave_cluster_clean(cluster: LiveCluster) -> None:
    """Cancel leftover jobs and return nodes Resurgo drained, for the next test."""
    for job in cluster.json(["squeue", "--json"]).get("jobs", []):
        if job["job_state"] not in ENDED:
            cluster.run(["scancel", str(job["job_id"])])
    for name, node in cluster.nodes().items():
        if str(node.get("reason", "")).startswith("resurgo:"):
            cluster.run(["scontrol", "update", f"NodeName={name}", "State=RESUME"])


def _wait_output(path: Path, text: str, timeout_s: float, supervisor: SupervisorProcess) -> str:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        content = path.read_text(errors="replace") if path.exists() else ""
        if text in content:
            return content
        time.sleep(0.5)
    tail = path.read_text(errors="replace")[-3000:] if path.exists() else "(no output)"
    raise AssertionError(
        f"no {text!r} in {path} after {timeout_s} s:\n{tail}\n--- supervisor ---\n"
        f"{supervisor.log()[-4000:]}"
    )


def _wait_ended(
    cluster: LiveCluster, job_id: int, supervisor: SupervisorProcess, output: Path
) -> dict:
    try:
        return cluster.wait_job_state(job_id, ENDED, timeout_s=240)
    except AssertionError as error:
        raise AssertionError(
            f"{error}\n--- job output ---\n{output.read_text(errors='replace')[-3000:]}"
            f"\n--- supervisor ---\n{supervisor.log()[-5000:]}"
        ) from None


def _wait_recorded(supervisor: SupervisorProcess, job_id: int, state: str) -> None:
    """Wait until the supervisor's store shows the job in ``state`` (it polls Slurm)."""

    def recorded() -> bool:
        with supervisor.store() as store:
            row = store.get_job(str(job_id))
            return row is not None and row.state == state

    supervisor.cluster.wait_for(f"job {job_id} {state} in the store", recorded, timeout_s=30)


def _start_idle_job(
    supervisor: SupervisorProcess, tmp_path: Path, steps: int = 16
) -> tuple[int, Path, Path]:
    """A 4-node toy job that saves at steps 4 and 8, then idles at step 8 (first launch only)."""
    output = tmp_path / "job.out"
    ckpt = tmp_path / "ckpt"
    spec = toy_spec(
        "toy-recovery", 4, ckpt, output, supervisor.url,
        "--steps", str(steps), "--save-every", "4", "--fault", "idle@8:*",
        min_nodes=2,
    )  # fmt: skip
    job_id = supervisor.submit(spec)
    _wait_output(output, "idle at step 8", 180, supervisor)
    assert (ckpt / "step-8" / MANIFEST_NAME).exists()
    return job_id, output, ckpt


def test_a_rank_sigkilled_on_node3_drains_node3_and_the_job_resumes_on_three_nodes(
    slurm_cluster: LiveCluster,
    supervisor: SupervisorProcess,
    prometheus: PrometheusProcess,
    tmp_path: Path,
) -> None:
    # Submitted the way a user does: `resurgo submit` with sbatch options.
    output, ckpt = tmp_path / "job.out", tmp_path / "ckpt"
    submitted = supervisor.resurgo(
        "submit", "-N", "4", "--min-nodes", "2", f"--output={output}", "--comment", "live test",
        "--ckpt-root", str(ckpt), "--parsable", "--",
        *TORCHRUN, str(TOY), "--steps", "16", "--save-every", "4", "--fault", "idle@8:*",
    )  # fmt: skip
    assert submitted.returncode == 0, submitted.stderr
    job_id = int(submitted.stdout.strip())
    _wait_output(output, "idle at step 8", 180, supervisor)
    listed = supervisor.resurgo("status", "--json")
    (row,) = json.loads(listed.stdout)["jobs"]
    assert (row["job_id"], row["state"], row["world_size"]) == (str(job_id), "running", 4)
    # The newest checkpoint goes bad on disk: the recovery must reject it.
    shard = sorted((ckpt / "step-8").glob("*.distcp"))[0]
    shard.write_bytes(shard.read_bytes()[:10])
    kill_rank_on("node3")

    job = _wait_ended(slurm_cluster, job_id, supervisor, output)
    text = output.read_text(errors="replace")
    assert job["job_state"] == "COMPLETED", text[-3000:]
    assert job["comment"] == "live test"  # sbatch options passed through

    _wait_recorded(supervisor, job_id, "completed")
    node3 = slurm_cluster.nodes()["node3"]
    assert "DRAIN" in node3["state_flags"]
    assert node3["reason"].startswith(f"resurgo: rank_signal job={job_id} ")
    assert "SIGKILL" in node3["reason"]

    with supervisor.store() as store:
        drains = store.drains_since(0)
        assert [(d.node, d.job_id) for d in drains] == [("node3", str(job_id))]
        attempts = store.attempts_for(str(job_id))
        resumed = attempts[-1]
        assert resumed.nodes == ("node1", "node2", "node4")
        assert resumed.resumed_from == str(ckpt / "step-4")  # step-8 was rejected
        row = store.get_job(str(job_id))
        assert row is not None and row.state == "completed"
        rejected = [
            d
            for d in store.decisions_for(str(job_id))
            if "step-8 invalid" in d.detail["explanation"]
        ]
        assert rejected, "the corrupted step-8 was never rejected"
        # Resized: the first sample after the resume is the checkpoint's cursor.
        checks = store.events_for(str(job_id), kinds=["resume_verification"])
        assert [e.payload["verified"] for e in checks] == [True], checks
        assert checks[0].payload["same_size"] is False
    assert f"starting at step 4 from {ckpt / 'step-4'}" in text
    assert "done at step 16 with world 3" in text

    # What an operator sees afterwards.
    status = supervisor.resurgo("status", str(job_id))
    assert status.returncode == 0
    pattern = rf"{job_id}\s+train_toy\s+completed\s+3/4\s+rank_signal 1\s"
    assert re.search(pattern, status.stdout), status.stdout
    events = supervisor.resurgo("events", str(job_id))
    assert "rank_exited" in events.stdout and "died by SIGKILL" in events.stdout
    assert "action drain" in events.stdout
    nodes = supervisor.resurgo("nodes")
    assert re.search(r"node3\s+\S+\s+resurgo\s+resurgo: rank_signal", nodes.stdout), nodes.stdout
    report = tmp_path / "report.html"
    written = supervisor.resurgo("report", str(job_id), "-o", str(report))
    assert written.returncode == 0, written.stderr
    png = render_in_chromium(report, tmp_path / "report.png")
    assert png.stat().st_size > 50_000  # a page with two plots, not a blank one

    # Every dashboard panel's expression parses and returns data in Prometheus.
    time.sleep(3)  # a few scrapes after the end
    empty = []
    for title, expr in dashboard_expressions(str(job_id)):
        answer = prometheus.query(expr)
        assert answer["status"] == "success", (title, expr, answer)
        if not answer["data"]["result"]:
            empty.append((title, expr))
    assert not empty, f"panels without data: {empty}"
    firing = prometheus.query('ALERTS{alertname="ResurgoDrainRateLimitReached"}')
    assert firing["data"]["result"], "one drain of the one allowed per hour: the limit is reached"
    # An operator returns node3 to service.
    undrained = supervisor.resurgo("nodes", "undrain", "node3")
    assert undrained.returncode == 0, undrained.stderr
    assert "DRAIN" not in slurm_cluster.nodes()["node3"]["state_flags"]
    with supervisor.store() as store:
        (drain,) = store.blame_history("node3")
        assert drain.undrained_by is not None and drain.undrained_by.value == "operator"


def test_a_python_exception_at_the_same_step_twice_stops_the_job_as_a_crash_loop(
    slurm_cluster: LiveCluster, supervisor: SupervisorProcess, tmp_path: Path
) -> None:
    output = tmp_path / "job.out"
    spec = toy_spec(
        "toy-crash", 2, tmp_path / "ckpt", output, supervisor.url,
        "--steps", "12", "--save-every", "4", "--fault", "exception@6:1!",
    )  # fmt: skip
    job_id = supervisor.submit(spec)
    job = _wait_ended(slurm_cluster, job_id, supervisor, output)

    assert job["job_state"] == "CANCELLED"  # the supervisor stopped it
    _wait_recorded(supervisor, job_id, "failed")
    with supervisor.store() as store:
        row = store.get_job(str(job_id))
        assert row is not None and row.state == "failed", supervisor.log()[-3000:]
        assert row.record["final_reason"].startswith("crash loop:"), row.record
        assert store.drains_since(0) == []
        assert len(store.attempts_for(str(job_id))) == 2  # one retry, then stopped
    assert not any(
        str(node.get("reason", "")).startswith("resurgo:")
        for node in slurm_cluster.nodes().values()
    )
    assert output.read_text().count("injected failure at step 6") >= 2


def test_a_supervisor_killed_between_drain_and_relaunch_completes_the_recovery_once(
    slurm_cluster: LiveCluster, tmp_path: Path
) -> None:
    # A long backoff holds the relaunch back, so the kill lands after the drain.
    policy = {**POLICY, "backoff_base_s": "12"}
    supervisor = SupervisorProcess(slurm_cluster, tmp_path / "state", policy)
    supervisor.start()
    try:
        job_id, output, ckpt = _start_idle_job(supervisor, tmp_path)
        kill_rank_on("node3")
        slurm_cluster.wait_for(
            "node3 drained",
            lambda: str(slurm_cluster.nodes()["node3"].get("reason", "")).startswith("resurgo:"),
            timeout_s=60,
        )
        supervisor.kill()
        with supervisor.store() as store:
            kinds = {row.kind for row in store.list_actions(str(job_id))}
        assert "relaunch" not in kinds, "the kill came too late to test anything"
        drained_at = slurm_cluster.nodes()["node3"]["reason_changed_at"]
        supervisor.start()

        job = _wait_ended(slurm_cluster, job_id, supervisor, output)
        assert job["job_state"] == "COMPLETED", output.read_text()[-3000:]
        assert job["restart_cnt"] == 0  # the fast path: never requeued
        _wait_recorded(supervisor, job_id, "completed")
        assert slurm_cluster.nodes()["node3"]["reason_changed_at"] == drained_at
        with supervisor.store() as store:
            assert [d.node for d in store.drains_since(0)] == ["node3"]
            actions = store.list_actions(str(job_id))
            by_kind: dict[str, list] = {}
            for row in actions:
                by_kind.setdefault(row.kind, []).append(row)
            assert len(by_kind["drain"]) == 1 and by_kind["drain"][0].starts == 1
            assert len(by_kind["relaunch"]) == 1
            assert by_kind["relaunch"][0].state is ActionState.DONE
            assert "requeue" not in by_kind
            attempts = store.attempts_for(str(job_id))
            assert [a.attempt for a in attempts] == [1, 2]
            assert attempts[-1].nodes == ("node1", "node2", "node4")
            assert attempts[-1].resumed_from == str(ckpt / "step-8")
        assert "done at step 16 with world 3" in output.read_text()
    finally:
        supervisor.stop()
        _leave_cluster_clean(slurm_cluster)
