"""Recovery benchmark: the same injected faults under Resurgo and under today's usual stack.

For each fault, the demo trainer (deploy/demo/train_toy.py, 4 nodes x 1 rank,
checkpoints every 4 steps, 16 steps) runs on the live local cluster twice:

- **resurgo**: ``resurgo-supervisor`` running, the job submitted with
  ``resurgo submit`` (node agents, in-job driver);
- **baseline**: ``sbatch --requeue`` of a batch script running
  ``torchrun --max-restarts 3`` on every node (c10d rendezvous), no
  supervisor; the trainer resumes from the newest valid checkpoint itself;
- **control**: the same baseline on one node with the 4 ranks local to it,
  where torchrun's restart rounds do meet (on this one-host cluster the
  4-node rounds fail in gloo's ``connectFullMesh``): it shows what the
  baseline recovers when its restarts work, so its 4-node rows measure the
  stack, not a broken setup.

Measured per run, from the trainer's own timestamps (the same definition for
every stack) and, for Resurgo, its store:

- ``detect_s``: fault -> the first restarted trainer's start (its "starting
  at step" line): the first moment the stack visibly reacted, defined alike
  for all three. Resurgo also reports ``decide_s``, fault -> its decision to
  recover, which torchrun has no equivalent of;
- ``recover_s``: fault -> the first training step after the resume;
- ``steps_lost``: the fault's step minus the step resumed from;
- the unmodified script (``plain_*``) alike, from its own prints: the
  faulty rank's line, ``resuming training from ... at iter N``, and the
  first ``iter`` line after it, under each launch shape (torchrun given
  directly, srun-style one process per rank, a bash wrapper ending in
  ``exec torchrun``);
- ``outcome``: ``recovered`` (the job reached its last step), ``stuck`` (no
  progress until ``--timeout-s``; the job is cancelled), or ``failed``.

Run on the local cluster (``deploy/slurm/cluster up``)::

    python -m bench.recovery [--timeout-s 150] [--scenario rank_sigkill ...]

The last line printed is one JSON object:
``{"scenarios": [{"fault", "resurgo": {...}, "baseline": {...}, "control": {...}}, ...]}``.
"""

from __future__ import annotations

import argparse
import functools
import json
import re
import shlex
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

if not __package__:
    sys.exit("run the benchmarks from the repository root as modules: python -m bench.recovery")

from tests.conftest import REPO, LiveCluster, _cluster_conf
from tests.supervisor_harness import TORCHRUN, TOY, SupervisorProcess

SCENARIOS = {
    "rank_sigkill": "sigkill@6:2",  # a node fault kills one rank
    "rank_hang": "hang@6:2",  # one rank stops making progress (SIGSTOP)
    "exception": "exception@6:1",  # a bug raises once
    # A script that imports nothing (tests/workers/ddp_plain.py, its own
    # torch.save checkpoint every 10 iterations): rank 2 sleeps in iteration 15
    # while its peers wait in DDP's backward. Resurgo only: without a
    # supervisor nothing notices a hang (rank_hang's baseline rows show it).
    "plain_hang": "sleep@15:2",
    # The same script, rank 2 SIGKILLs itself in iteration 15, under each launch shape.
    "plain_sigkill": "kill@15:2",
    "plain_srun_sigkill": "kill@15:2",
    "plain_wrapper_sigkill": "kill@15:2",
}
PLAIN = REPO / "tests" / "workers" / "ddp_plain.py"
Runner = Callable[[LiveCluster, Path, str, float], dict[str, Any]]
_FAULTED = re.compile(
    r"rank \d+ (?:sleeping [\d.]+ s|killing itself) in iter (\d+) on \S+ \(([\d.]+)\)"
)
_RESUMED = re.compile(r"resuming training from \S+ at iter (\d+) \(([\d.]+)\)")
_ITER = re.compile(r"iter (\d+): loss \S+ \(([\d.]+)\)")
STEPS = 16
POLICY = {
    "max_drain_share_per_hour": "0.5",
    "backoff_base_s": "1",
    "exit_evidence_window_s": "1",
    "hang_evidence_window_s": "3",
    "validation_level": "full",
}
AGENTS = {
    "RESURGO_AGENT_HANG_FLOOR_S": "8",
    "RESURGO_AGENT_STOP_GRACE_S": "3",
    "RESURGO_AGENT_HEARTBEAT_REPORT_S": "1",
    "RESURGO_SUPERVISOR_LEASE_S": "8",
    "OMP_NUM_THREADS": "1",
}
ENDED = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL"}
_INJECTED = re.compile(r"toy: injecting \w+ at step (\d+) on \S+ at ([\d.]+)")
_STARTED = re.compile(r"toy: world \d+, starting at step (\d+).* at ([\d.]+)")

BASELINE_SCRIPT = """#!/bin/bash
# Today's usual stack: Slurm requeue plus torchrun's in-place restarts, no supervisor.
nodes=$(scontrol show hostnames "$SLURM_JOB_NODELIST")
count=$(echo "$nodes" | wc -l)
first=$(echo "$nodes" | head -n 1)
master=$(scontrol show node "$first" | sed -n 's/.*NodeAddr=\\([^ ]*\\).*/\\1/p')
srun --nodes="$count" --ntasks="$count" --ntasks-per-node=1 \\
  {python} -m torch.distributed.run --nnodes="$count" --nproc-per-node={procs} --max-restarts=3 \\
  --rdzv-backend=c10d --rdzv-endpoint="$master:$((29000 + SLURM_JOB_ID % 500))" \\
  --rdzv-id="$SLURM_JOB_ID" {toy} {args}
"""


def _wait(cluster: LiveCluster, job_id: int, timeout_s: float) -> str | None:
    """The job's end state, or None when it is still going at ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        job = cluster.job(job_id)
        if job is None or job["job_state"] in ENDED:
            return None if job is None else str(job["job_state"])
        time.sleep(0.5)
    return None


def _result(state: str | None) -> dict[str, Any]:
    """A run's figures before measuring: the outcome from Slurm's end state (None: stuck)."""
    outcome = "stuck" if state is None else ("recovered" if state == "COMPLETED" else "failed")
    return {"outcome": outcome, "detect_s": None, "recover_s": None, "steps_lost": None}


def _measure(
    output: Path, record: Path, state: str | None, detect_at: float | None
) -> dict[str, Any]:
    text = output.read_text(errors="replace") if output.exists() else ""
    injected = _INJECTED.search(text)
    steps = [json.loads(line) for line in (record / "steps.jsonl").read_text().splitlines()] if (
        record / "steps.jsonl").exists() else []  # fmt: skip
    result = _result(state)
    if state == "COMPLETED" and not any(s["step"] == STEPS for s in steps):
        result["outcome"] = "failed"
    if injected is None:
        return result
    fault_step, fault_s = int(injected.group(1)), float(injected.group(2))
    restarts = [(int(m.group(1)), float(m.group(2))) for m in _STARTED.finditer(text)]
    after = [(step, at) for step, at in restarts if at > fault_s]
    if after:
        result["detect_s"] = round(after[0][1] - fault_s, 2)
    if detect_at is not None:
        result["decide_s"] = round(detect_at - fault_s, 2)
    if after:
        resumed_step = after[0][0]
        result["steps_lost"] = fault_step - resumed_step
        first = [s["time"] for s in steps if s["time"] > after[0][1] and s["step"] > resumed_step]
        if first:
            result["recover_s"] = round(min(first) - fault_s, 2)
    return result


def _under_resurgo(
    cluster: LiveCluster,
    where: Path,
    output: Path,
    ckpt: Path,
    command: list[str],
    timeout_s: float,
) -> tuple[str | None, float | None]:
    """Submit ``command`` under a fresh supervisor; (Slurm's end state or None when stuck,
    when the supervisor decided to recover)."""
    supervisor = SupervisorProcess(cluster, where / "state", POLICY, AGENTS)
    supervisor.start()
    try:
        done = supervisor.resurgo(
            "submit", "-N", "4", "--min-nodes", "2", f"--output={output}",
            "--ckpt-root", str(ckpt), "--parsable", "--", *command,
        )  # fmt: skip
        if done.returncode != 0:
            raise SystemExit(f"bench: resurgo submit failed: {done.stderr}")
        job_id = int(done.stdout.strip())
        state = _wait(cluster, job_id, timeout_s)
        if state is None:
            cluster.run(["scancel", str(job_id)])
        with supervisor.store() as store:
            reacted = [
                d.decided_s
                for d in store.decisions_for(str(job_id))
                if d.from_state in ("running", "starting") and d.to_state == "recovering"
            ]
        return state, reacted[0] if reacted else None
    finally:
        supervisor.stop()
        _restore(cluster)


def run_resurgo(cluster: LiveCluster, where: Path, fault: str, timeout_s: float) -> dict[str, Any]:
    output, record = where / "job.out", where / "record"
    command = [
        *TORCHRUN, str(TOY), "--steps", str(STEPS), "--save-every", "4",
        "--record", str(record), "--fault", fault,
    ]  # fmt: skip
    state, reacted = _under_resurgo(cluster, where, output, where / "ckpt", command, timeout_s)
    return _measure(output, record, state, reacted)


def plain_command(name: str, where: Path, out_dir: Path) -> list[str]:
    """The unmodified script's command for scenario ``name``: its fault and launch shape."""
    what, _, at = SCENARIOS[name].partition("@")
    iteration, _, rank = at.partition(":")
    fault = (
        ["--sleep-at", iteration, "--sleep-rank", rank, "--sleep-s", "600"]
        if what == "sleep"
        else ["--kill-at", iteration, "--fault-rank", rank]
    )
    script = [str(PLAIN), "--out-dir", str(out_dir), "--max-iters", "40", "--iter-s", "0.5",
              *fault]  # fmt: skip
    if name == "plain_srun_sigkill":
        return ["srun", sys.executable, *script, "--init", "slurm"]
    if name == "plain_wrapper_sigkill":
        wrapper = where / "run.sh"
        wrapper.write_text('#!/bin/bash\nexec torchrun --standalone --nproc-per-node=1 "$@"\n')
        return ["bash", str(wrapper), *script]
    return [*TORCHRUN, *script]


def run_plain(cluster: LiveCluster, where: Path, name: str, timeout_s: float) -> dict[str, Any]:
    """The unmodified script under Resurgo, measured from the script's own prints."""
    output, out_dir = where / "job.out", where / "out"
    out_dir.mkdir()
    command = plain_command(name, where, out_dir)
    state, reacted = _under_resurgo(cluster, where, output, out_dir, command, timeout_s)
    text = output.read_text(errors="replace") if output.exists() else ""
    result = _result(state)
    faulted = _FAULTED.search(text)
    if faulted is None:
        return result
    fault_step, fault_s = int(faulted.group(1)), float(faulted.group(2))
    if reacted is not None:
        result["decide_s"] = round(reacted - fault_s, 2)
    resumed = [(int(m.group(1)), float(m.group(2))) for m in _RESUMED.finditer(text)]
    resumed = [(step, at) for step, at in resumed if at > fault_s]
    if resumed:
        step, at = resumed[0]
        result["detect_s"] = round(at - fault_s, 2)
        result["steps_lost"] = fault_step - step
        after = [float(m.group(2)) for m in _ITER.finditer(text) if float(m.group(2)) > at]
        if after:
            result["recover_s"] = round(min(after) - fault_s, 2)
    return result


def _plain_runner(
    name: str, cluster: LiveCluster, where: Path, _fault: str, timeout_s: float
) -> dict[str, Any]:
    return run_plain(cluster, where, name, timeout_s)


def run_baseline(cluster: LiveCluster, where: Path, fault: str, timeout_s: float) -> dict[str, Any]:
    return _run_torchrun(cluster, where, fault, timeout_s, nodes=4, procs=1)


def run_control(cluster: LiveCluster, where: Path, fault: str, timeout_s: float) -> dict[str, Any]:
    return _run_torchrun(cluster, where, fault, timeout_s, nodes=1, procs=4)


def _run_torchrun(
    cluster: LiveCluster, where: Path, fault: str, timeout_s: float, nodes: int, procs: int
) -> dict[str, Any]:
    output, record, ckpt = where / "job.out", where / "record", where / "ckpt"
    args = shlex.join(["--steps", str(STEPS), "--save-every", "4", "--record", str(record),
                       "--fault", fault])  # fmt: skip
    script = where / "baseline.sh"
    script.write_text(
        BASELINE_SCRIPT.format(python=sys.executable, toy=TOY, args=args, procs=procs)
    )
    job_id = cluster.sbatch(
        f"--nodes={nodes}", "--ntasks-per-node=1", "--requeue", "--open-mode=append",
        f"--output={output}", "--export=ALL", str(script),
        env={**AGENTS, "RESURGO_CKPT_ROOT": str(ckpt), "PYTHONPATH": str(REPO)},
    )  # fmt: skip
    state = _wait(cluster, job_id, timeout_s)
    if state is None:
        cluster.run(["scancel", str(job_id)])
        time.sleep(2)
    _restore(cluster)
    return _measure(output, record, state, None)


def _restore(cluster: LiveCluster) -> None:
    for job in cluster.json(["squeue", "--json"]).get("jobs", []):
        if job["job_state"] not in ENDED:
            cluster.run(["scancel", str(job["job_id"])])
    for name, node in cluster.nodes().items():
        if "DRAIN" in node.get("state_flags", []):
            cluster.run(["scontrol", "update", f"NodeName={name}", "State=RESUME"])
    time.sleep(1)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--timeout-s", type=float, default=150.0)
    parser.add_argument("--scenario", action="append", choices=sorted(SCENARIOS))
    parser.add_argument(
        "--resurgo-only", action="store_true", help="skip the baseline and control runs"
    )
    args = parser.parse_args()
    cluster = LiveCluster(conf=_cluster_conf())
    results = []
    with tempfile.TemporaryDirectory(prefix="resurgo-bench-recovery-") as tmp:
        for name in args.scenario or list(SCENARIOS):
            fault = SCENARIOS[name]
            row: dict[str, Any] = {"fault": name, "inject": fault}
            stacks: tuple[tuple[str, Runner], ...] = (
                ("resurgo", run_resurgo), ("baseline", run_baseline), ("control", run_control),
            )  # fmt: skip
            if name.startswith("plain_"):
                stacks = (("resurgo", functools.partial(_plain_runner, name)),)
            elif args.resurgo_only:
                stacks = stacks[:1]
            for stack, runner in stacks:
                where = Path(tmp) / name / stack
                where.mkdir(parents=True)
                started = time.monotonic()
                row[stack] = runner(cluster, where, fault, args.timeout_s)
                row[stack]["wall_s"] = round(time.monotonic() - started, 1)
                print(f"bench: {name} under {stack}: {row[stack]}", flush=True)
            results.append(row)
    print(json.dumps({"scenarios": results}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
