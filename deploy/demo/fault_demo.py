"""The fault demo: a supervised 4-node FSDP2 training job survives two faults unattended.

Run by ``deploy/demo/fault`` on the local cluster (already up). It starts
``resurgo-supervisor`` (state under OUT/state) and Prometheus scraping it,
submits the demo trainer with ``resurgo submit``, and lets the trainer's
fault injection strike: a rank SIGKILLed after step 6 (a node fault), then a
rank hanging after step 14. The supervisor drains each culprit's node and
resumes from the newest valid checkpoint on the remaining nodes, 4 -> 3 -> 2,
until the last step. Then the demo prints ``resurgo status``, ``resurgo
nodes`` and a summary (faults, detection and recovery times, drains,
goodput), writes OUT/report.html, returns the nodes to service and stops.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
TOY = REPO / "deploy" / "demo" / "train_toy.py"


def say(text: str) -> None:
    print(f"demo: {text}", flush=True)


def wait_for(what: str, check: object, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if check():  # type: ignore[operator]
            return
        time.sleep(0.5)
    raise SystemExit(f"demo: FAILED: timed out after {timeout_s:.0f} s waiting for {what}")


def resurgo(*args: str, env: dict[str, str]) -> str:
    done = subprocess.run(
        [sys.executable, "-m", "supervisor.cli.main", *args],
        env=env, capture_output=True, text=True, check=False,
    )  # fmt: skip
    if done.returncode != 0:
        raise SystemExit(f"demo: FAILED: resurgo {' '.join(args)}: {done.stderr.strip()}")
    return done.stdout


def summary(state: Path, job: str) -> str:
    """Faults, detection and recovery times, drains and goodput, from the supervisor's store."""
    sys.path.insert(0, str(REPO))
    from supervisor.core.goodput import FactKind
    from supervisor.metrics import recovery_durations
    from supervisor.store import Store
    from supervisor.views.timeline import goodput_of, timeline_of
    from supervisor.views.words import goodput_line

    with Store.open(state / "resurgo.db", create=False) as store:
        now = time.time()
        facts = timeline_of(store, job, now)
        start = store.get_job(job).created_s  # type: ignore[union-attr]
        faults = [
            f"{fact.cause} detected {fact.time_s - start:.0f} s after submission"
            for fact in facts
            if fact.kind is FactKind.DETECTED
        ]
        detect, recover = recovery_durations(facts)
        drains = [f"{d.node} ({d.cause})" for d in store.drains_since(0) if d.job_id == job]
        goodput = goodput_of(store, job, now)
        attempts = store.attempts_for(job)
    lines = [f"faults handled: {len(faults)}"]
    lines += [f"  {index}. {fault}" for index, fault in enumerate(faults, 1)]
    lines.append("time to detect: " + ", ".join(f"{s:.1f} s" for s in detect))
    lines.append("fault to first step after resume: " + ", ".join(f"{s:.1f} s" for s in recover))
    lines.append(f"drained: {', '.join(drains) or 'none'}")
    lines.append(f"world size by attempt: {' -> '.join(str(len(a.nodes)) for a in attempts)}")
    # Where the rest went, by kind: a short demo's goodput is mostly its start-up.
    lines.append(f"goodput: {goodput_line(goodput)}")
    return "\n".join(lines)


def start_prometheus(out: Path, target: str, port: int) -> subprocess.Popen[bytes] | None:
    """Prometheus scraping the supervisor with Resurgo's rules, when it is installed."""
    binary = shutil.which("prometheus")
    if binary is None:
        say("prometheus is not installed (deploy/setup installs it): no metrics this time")
        return None
    config = out / "prometheus.yml"
    config.write_text(
        "global: {scrape_interval: 2s, evaluation_interval: 2s}\n"
        f"rule_files: [{REPO / 'deploy/prometheus/rules/resurgo.yml'}]\n"
        f"scrape_configs: [{{job_name: resurgo, static_configs: [{{targets: ['{target}']}}]}}]\n"
    )
    log = open(out / "prometheus.log", "wb")  # noqa: SIM115 - open for its life
    return subprocess.Popen(
        [binary, f"--config.file={config}", f"--storage.tsdb.path={out / 'prometheus-data'}",
         f"--web.listen-address=127.0.0.1:{port}"],
        stdout=log, stderr=subprocess.STDOUT,
    )  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("out", type=Path, help="a fresh directory for everything the demo writes")
    parser.add_argument("--port", type=int, default=18740)
    parser.add_argument("--prometheus-port", type=int, default=19090)
    args = parser.parse_args()
    out: Path = args.out
    state = out / "state"
    url = f"http://127.0.0.1:{args.port}"
    env = {
        **os.environ,
        "PYTHONPATH": str(REPO),
        "RESURGO_STATE_DIR": str(state),
        "RESURGO_URL": url,
        "RESURGO_SUPERVISOR_LISTEN_HOST": "127.0.0.1",
        "RESURGO_SUPERVISOR_LISTEN_PORT": str(args.port),
        "RESURGO_SUPERVISOR_POLL_S": "0.5",
        "RESURGO_SUPERVISOR_TICK_S": "0.5",
        "RESURGO_SUPERVISOR_LOG_JSON": "no",
        # Four nodes: a drain share of 1/2 per hour allows the two drains below.
        "RESURGO_POLICY_MAX_DRAIN_SHARE_PER_HOUR": "0.5",
        "RESURGO_POLICY_BACKOFF_BASE_S": "2",
        "RESURGO_POLICY_HANG_EVIDENCE_WINDOW_S": "8",
        "RESURGO_AGENT_HEARTBEAT_REPORT_S": "1",
        "RESURGO_AGENT_HANG_FLOOR_S": "10",
        "RESURGO_AGENT_STOP_GRACE_S": "3",
        "OMP_NUM_THREADS": "1",
    }
    state.mkdir(parents=True)
    log = open(out / "supervisor.log", "wb")  # noqa: SIM115 - open for the supervisor's life
    supervisor = subprocess.Popen(
        [sys.executable, "-m", "supervisor.daemon"], env=env, stdout=log, stderr=subprocess.STDOUT
    )
    prometheus = start_prometheus(out, f"127.0.0.1:{args.port}", args.prometheus_port)
    try:
        wait_for("the supervisor", lambda: _answers(url), 60)
        say(f"supervisor up at {url} (log: {out / 'supervisor.log'})")
        if prometheus is not None:
            say(f"prometheus at http://127.0.0.1:{args.prometheus_port} scrapes its /metrics")
        # An FSDP2 job on 4 nodes: a rank is SIGKILLed after step 6 (a node fault),
        # then a rank hangs after step 14 (SIGSTOP); it may shrink down to 2 nodes.
        submitted = resurgo(
            "submit", "-N", "4", "--min-nodes", "2", f"--output={out / 'job.out'}",
            "--job-name=demo-train", "--ckpt-root", str(out / "ckpt"), "--",
            sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=1", str(TOY),
            "--model", "fsdp", "--steps", "24", "--save-every", "4",
            "--fault", "sigkill@6:2", "--fault", "hang@14:1",
            env=env,
        )  # fmt: skip
        job = submitted.split()[-1]
        say(
            f"{submitted.strip()}: FSDP2 on 4 nodes (may shrink to 2), checkpoints every 4 "
            "steps; faults: SIGKILL of rank 2 after step 6, rank 1 hangs after step 14"
        )
        wait_for(
            "the job to finish unattended",
            lambda: resurgo("status", job, "--json", env=env).count('"state": "completed"') == 1,
            600,
        )
        say("the job reached its last step; what the supervisor saw and did:")
        print(resurgo("status", job, env=env))
        print(resurgo("nodes", env=env))
        print(summary(state, job))
        print(resurgo("report", job, "-o", str(out / "report.html"), env=env).strip())
        say(f"the full timeline: resurgo events {job} --state-dir {state}")
        say("OK")
        return 0
    finally:
        supervisor.send_signal(signal.SIGTERM)
        supervisor.wait(timeout=30)
        log.close()
        if prometheus is not None:
            prometheus.terminate()
            prometheus.wait(timeout=30)
        for node in ("node1", "node2", "node3", "node4"):
            subprocess.run(
                ["scontrol", "update", f"NodeName={node}", "State=RESUME"],
                capture_output=True, check=False,
            )  # fmt: skip


def _answers(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/healthz", timeout=2):
            return True
    except OSError:
        return False


if __name__ == "__main__":
    sys.exit(main())
