"""The supervisor recovering real torchrun jobs on the live local Slurm cluster.

Each test runs ``resurgo-supervisor`` as a process, submits the toy training
job (deploy/demo/train_toy.py) the way ``resurgo submit`` does, injects a
fault, and checks the outcome in Slurm and in the supervisor's store.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import time
from collections import Counter
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
    # The default drain limit: on four nodes the share (0.1) rounds down to none,
    # and the floor (min_drains_per_hour 1) allows one drain per hour.
    "backoff_base_s": "2",
    "validation_level": "full",
    # Drain on one job's word: these tests look at the drain (tests/e2e/test_corroboration.py
    # at the check before it).
    "corroborate_drains": "false",
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


def _wait_output(
    path: Path, text: str, timeout_s: float, supervisor: SupervisorProcess, count: int = 1
) -> str:
    """The job's output once ``text`` is in it ``count`` times."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        content = path.read_text(errors="replace") if path.exists() else ""
        if content.count(text) >= count:
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


@pytest.mark.long  # over a minute in CI: started before the short tests
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
        # Every rank forked from its node's warm pool: the first launch's, and the
        # relaunch's from the pools that outlived the shrink.
        exits = [e.payload for e in store.events_for(str(job_id), kinds=["rank_exited"])]
        assert [e["exit_code"] for e in exits].count(0) == 3, exits  # the relaunch's ends
        assert all(e.get("warm") is True for e in exits), exits
        # Resized: the first sample after the resume is the checkpoint's cursor.
        checks = store.events_for(str(job_id), kinds=["resume_verification"])
        assert [e.payload["verified"] for e in checks] == [True], checks
        assert checks[0].payload["same_size"] is False
    assert f"starting at step 4 from {ckpt / 'step-4'}" in text
    assert "done at step 16 with world 3" in text

    # What an operator sees afterwards.
    status = supervisor.resurgo("status", str(job_id))
    assert status.returncode == 0
    pattern = rf"{job_id}\s+train_toy\s+completed\s+3/4\s+\d+\s+rank_signal 1\s"
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
    # Prometheus scrapes every second; on a loaded machine the scrapes after the end
    # come late: wait until every panel has data (or say which never did).
    empty: list[tuple[str, str]] = []

    def every_panel_has_data() -> bool:
        empty.clear()
        for title, expr in dashboard_expressions(str(job_id)):
            answer = prometheus.query(expr)
            assert answer["status"] == "success", (title, expr, answer)
            if not answer["data"]["result"]:
                empty.append((title, expr))
        return not empty

    try:
        supervisor.cluster.wait_for("every panel to have data", every_panel_has_data, 60)
    except AssertionError:
        raise AssertionError(f"panels without data: {empty}") from None
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

    # The driver ended it when told: FAILED with exit code 93, "do not requeue"
    # (squeue shows the raw wait status), not CANCELLED by scancel.
    assert job["job_state"] == "FAILED", supervisor.log()[-3000:]
    assert job["exit_code"] >> 8 == 93, job["exit_code"]
    assert "(exit 93: do not requeue)" in output.read_text()
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


# scontrol for the supervisor under test: the real one runs, then the caller
# (the supervisor) is SIGKILLed once for each armed pattern the command
# matches. The side effect is applied in Slurm, and the supervisor is dead
# before it can record that: the worst moment for a crash.
KILLING_SCONTROL = """#!/bin/bash
{real} "$@"
code=$?
echo "$code $*" >> {applied}
for arm in {arms}/*; do
    [[ -e $arm && " $* " == *"$(cat "$arm")"* ]] || continue
    mv "$arm" {fired}/ 2>/dev/null && kill -KILL "$PPID"
done
exit $code
"""


def _killing_scontrol(where: Path) -> tuple[dict[str, str], Path]:
    """PATH with :data:`KILLING_SCONTROL` first, and its directory (arms/, fired/, applied)."""
    real = shutil.which("scontrol")
    assert real is not None
    for sub in ("bin", "arms", "fired"):
        (where / sub).mkdir(parents=True)
    wrapper = where / "bin" / "scontrol"
    wrapper.write_text(
        KILLING_SCONTROL.format(
            real=real, applied=where / "applied", arms=where / "arms", fired=where / "fired"
        )
    )
    wrapper.chmod(0o755)
    return {"PATH": f"{where / 'bin'}:{os.environ['PATH']}"}, where


def test_a_supervisor_killed_after_each_slurm_change_before_recording_it_recovers_once(
    slurm_cluster: LiveCluster, tmp_path: Path
) -> None:
    """The live round of crash consistency: SIGKILLed right after the drain took
    effect in Slurm, and again right after the shrink did, each before the
    supervisor recorded it; restarted each time on the same store. The recovery
    finishes once: one drain, one shrink, one relaunch, the job completes on
    three nodes from the newest checkpoint."""
    env, switch = _killing_scontrol(tmp_path / "killswitch")
    arms = {"drain": "NodeName=node3 State=DRAIN", "shrink": "NodeList="}
    for name, pattern in arms.items():
        (switch / "arms" / name).write_text(pattern)
    supervisor = SupervisorProcess(slurm_cluster, tmp_path / "state", POLICY, env)
    supervisor.start()
    try:
        job_id, output, ckpt = _start_idle_job(supervisor, tmp_path)
        kill_rank_on("node3")
        for _ in arms:
            fired = {path.name for path in (switch / "fired").iterdir()}
            slurm_cluster.wait_for(
                f"the supervisor killed after one of {sorted(set(arms) - fired)}",
                lambda: supervisor.process is not None and supervisor.process.poll() is not None,
                timeout_s=120,
            )
            supervisor.stop()  # closes the log the killed process had open
            supervisor.start()
        assert sorted(path.name for path in (switch / "fired").iterdir()) == sorted(arms)

        job = _wait_ended(slurm_cluster, job_id, supervisor, output)
        assert job["job_state"] == "COMPLETED", output.read_text()[-3000:]
        assert job["restart_cnt"] == 0  # the fast path: never requeued
        _wait_recorded(supervisor, job_id, "completed")
        applied = (switch / "applied").read_text().splitlines()
        changes = [line for line in applied if " update " in f" {line} "]
        drains = [line for line in changes if "State=DRAIN" in line]
        assert len(drains) == 1 and drains[0].startswith("0 update NodeName=node3 "), applied
        assert len([line for line in changes if "NodeList=" in line]) == 1, applied
        with supervisor.store() as store:
            assert [d.node for d in store.drains_since(0)] == ["node3"]
            actions = store.list_actions(str(job_id))
            assert all(row.state is ActionState.DONE for row in actions), actions
            by_kind = Counter(row.kind for row in actions)
            assert by_kind["drain"] == by_kind["shrink"] == by_kind["relaunch"] == 1, by_kind
            assert "requeue" not in by_kind
            attempts = store.attempts_for(str(job_id))
            assert [a.attempt for a in attempts] == [1, 2]
            assert attempts[-1].nodes == ("node1", "node2", "node4")
            assert attempts[-1].resumed_from == str(ckpt / "step-8")
        text = output.read_text()
        assert "starting at step 8 from" in text and "done at step 16 with world 3" in text
    finally:
        supervisor.stop()
        _leave_cluster_clean(slurm_cluster)
