"""The fault demo: a supervised 4-node training job loses a rank on node3 and recovers.

Run by ``deploy/demo/fault`` on the local cluster (already up). It starts
``resurgo-supervisor`` with its state under OUT/state, submits the toy
training job with ``resurgo submit``, SIGKILLs a training rank on node3 once
the job idles at step 8, and waits while the supervisor drains node3 and
relaunches the job on the three other nodes from the newest valid
checkpoint. Then it prints ``resurgo status`` and ``resurgo events``, writes
OUT/report.html, returns node3 to service and stops the supervisor.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
TOY = REPO / "deploy" / "demo" / "train_toy.py"


def rank_pids(node: str, marker: str = "train_toy.py") -> list[int]:
    """Pids of training ranks (not their shims or torchrun) running as Slurm node ``node``."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().split(b"\0")
            environ = (entry / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if not any(part.endswith(marker.encode()) for part in cmdline):
            continue
        if b"agent.rankexec" in cmdline or b"torch.distributed.run" in cmdline:
            continue
        if f"SLURMD_NODENAME={node}".encode() in environ and any(
            item.startswith(b"RANK=") for item in environ
        ):
            found.append(int(entry.name))
    return found


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


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("out", type=Path, help="a fresh directory for everything the demo writes")
    parser.add_argument("--port", type=int, default=18740)
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
        # Four nodes: a drain share of 1/4 per hour allows this one drain.
        "RESURGO_POLICY_MAX_DRAIN_SHARE_PER_HOUR": "0.25",
        "RESURGO_POLICY_BACKOFF_BASE_S": "2",
        "RESURGO_AGENT_HEARTBEAT_REPORT_S": "1",
        "OMP_NUM_THREADS": "1",
    }
    state.mkdir(parents=True)
    log = open(out / "supervisor.log", "wb")  # noqa: SIM115 - open for the supervisor's life
    supervisor = subprocess.Popen(
        [sys.executable, "-m", "supervisor.daemon"], env=env, stdout=log, stderr=subprocess.STDOUT
    )
    try:
        wait_for("the supervisor", lambda: _answers(url), 60)
        say(f"supervisor up at {url} (log: {out / 'supervisor.log'})")
        submitted = resurgo(
            "submit", "-N", "4", "--min-nodes", "2", f"--output={out / 'job.out'}",
            "--job-name=demo-train",
            "--ckpt-root", str(out / "ckpt"), "--",
            sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=1", str(TOY),
            "--steps", "24", "--save-every", "4", "--fault", "idle@8:*",
            env=env,
        )  # fmt: skip
        job = submitted.split()[-1]
        say(f"{submitted.strip()}: 4 nodes, may shrink to 2; checkpoints every 4 steps")
        output = out / "job.out"
        wait_for(
            "the job to reach step 8",
            lambda: output.exists() and "idle at step 8" in output.read_text(),
            300,
        )
        victims = rank_pids("node3")
        if not victims:
            raise SystemExit("demo: FAILED: no training rank found on node3")
        os.kill(victims[0], signal.SIGKILL)
        say(f"SIGKILLed training rank pid {victims[0]} on node3 (a node fault)")
        wait_for(
            "the job to finish",
            lambda: resurgo("status", job, "--json", env=env).count('"state": "completed"') == 1,
            300,
        )
        say("the job finished; what the supervisor saw and did:")
        print(resurgo("status", job, env=env))
        print(resurgo("events", job, env=env))
        print(resurgo("nodes", env=env))
        print(resurgo("report", job, "-o", str(out / "report.html"), env=env).strip())
        say("OK")
        return 0
    finally:
        supervisor.send_signal(signal.SIGTERM)
        supervisor.wait(timeout=30)
        log.close()
        subprocess.run(
            ["scontrol", "update", "NodeName=node3", "State=RESUME"],
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
