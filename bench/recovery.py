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
  progress until ``--timeout-s``; the job is cancelled), or ``failed``;
- for every Resurgo run, ``breakdown``: ``recover_s`` split into phases
  (detection, evidence window, drain and stop ranks, checkpoint choice,
  relaunch, agents start, checkpoint load + process start, first step)
  from the trainer's prints (the unmodified script's resume line and
  first iteration) and the store's event, decision and action times
  (bench/recovery_phases.py), and ``path``, the decision's words for how it
  relaunched.

Hot spares (``spare_*`` scenarios): the demo trainer on 3 nodes, the fault
on node2's rank, twice side by side:

- **spare**: ``resurgo submit -N 3 --spares 1`` (4 nodes, trains on 3); the
  spare takes the blamed node's place, the world stays at 3;
- **shrink**: the same job with no spare, with a filler job holding the 4th
  node (as the spare does, and as on a full cluster): the job goes on with 2
  nodes inside its allocation. (With that node idle, Resurgo would requeue
  the job at 3 nodes instead: a new allocation, not the shrink path.)

The fault strikes node2's rank whatever rank the rendezvous gave it: a rank
on the batch host would take both stacks through a requeue into a new
allocation instead. Each run's ``path`` says which path it took; the summary
has the medians per path (``by_path``: swap, shrink, requeue) and
``spare_vs_shrink`` compares swap with shrink.

``--repeat N`` runs each scenario N times, its stacks alternating, so load
on the machine falls on both alike; the JSON then has a ``summary`` per
scenario and stack (medians of ``recover_s`` and of each phase) and, for
the spare scenarios, ``spare_vs_shrink``: the ratio of the medians.

Run on the local cluster (``deploy/slurm/cluster up``)::

    python -m bench.recovery [--timeout-s 150] [--scenario rank_sigkill ...] [--repeat N]
                             [--defaults]

``--defaults`` runs Resurgo with the policy and agent settings it ships instead
of the benchmark's short windows (:data:`POLICY`, :data:`AGENTS`).

The last line printed is one JSON object: ``{"scenarios": [{"fault", "run",
"resurgo": {...}, "baseline": {...}, "control": {...}}, ...], "summary": {...}}``
(a spare scenario's row has ``spare`` and ``shrink`` instead).
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

from bench.recovery_phases import breakdown, store_marks, summarize
from tests.conftest import REPO, LiveCluster, cluster_conf
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
    # The demo trainer on 3 nodes, with a hot spare and without (shrink): the rank on
    # node2 faults (not the batch host's, whose loss is a requeue under both stacks).
    "spare_sigkill": "sigkill@6:node2",
    "spare_hang": "hang@6:node2",
}
SPARE_NODE = "node4"  # the cluster's 4th node: the 3+1 job's spare, the shrink run's filler
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
    "corroborate_drains": "false",  # the fault-to-drain time measured as before
}
AGENTS = {
    "RESURGO_AGENT_HANG_FLOOR_S": "8",
    "RESURGO_AGENT_STOP_GRACE_S": "3",
    "RESURGO_AGENT_HEARTBEAT_REPORT_S": "1",
    "RESURGO_SUPERVISOR_LEASE_S": "8",
    "OMP_NUM_THREADS": "1",
}
# --defaults: the policy and the agent settings Resurgo ships, as a user gets them (the
# environment the benchmark gives every stack alike, OMP_NUM_THREADS, stays).
SHIPPED_POLICY: dict[str, str] = {}
SHIPPED_AGENTS = {"OMP_NUM_THREADS": "1"}
# What the Resurgo runs use: POLICY and AGENTS, or the shipped ones with --defaults.
SETTINGS = {"policy": POLICY, "agents": AGENTS}
# --warm-vs-cold: the fault strikes late (the demo trainer's step LATE_STEP of LATE_STEPS,
# the unchanged script's iteration LATE_ITER of LATE_ITERS, 25-35 s into training), as
# in a long run. Each run twice: with the nodes' warm pools (RESURGO_WARM_POOL=1, "warm")
# and without them ("cold").
LATE = {"on": False}
LATE_STEP, LATE_STEPS, LATE_ITER, LATE_ITERS = 100, 110, 60, 70
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
    output: Path, record: Path, state: str | None, stored: dict[str, Any] | None
) -> dict[str, Any]:
    text = output.read_text(errors="replace") if output.exists() else ""
    injected = _INJECTED.search(text)
    steps = [json.loads(line) for line in (record / "steps.jsonl").read_text().splitlines()] if (
        record / "steps.jsonl").exists() else []  # fmt: skip
    result = _result(state)
    if state == "COMPLETED" and not any(s["step"] == _steps() for s in steps):
        result["outcome"] = "failed"
    if injected is None:
        return result
    fault_step, fault_s = int(injected.group(1)), float(injected.group(2))
    restarts = [(int(m.group(1)), float(m.group(2))) for m in _STARTED.finditer(text)]
    after = [(step, at) for step, at in restarts if at > fault_s]
    if after:
        result["detect_s"] = round(after[0][1] - fault_s, 2)
    stored = stored or {}
    if "decided_at" in stored:
        result["decide_s"] = round(stored["decided_at"] - fault_s, 2)
    for key in ("path", "fault_event", "hang_timeout_s"):
        if key in stored:
            result[key] = stored[key]
    if after:
        resumed_step = after[0][0]
        result["steps_lost"] = fault_step - resumed_step
        first = [s["time"] for s in steps if s["time"] > after[0][1] and s["step"] > resumed_step]
        if first:
            result["recover_s"] = round(min(first) - fault_s, 2)
            if "marks" in stored:
                result["breakdown"] = breakdown(fault_s, stored["marks"], after[0][1], min(first))
    return result


def _under_resurgo(
    cluster: LiveCluster,
    where: Path,
    output: Path,
    ckpt: Path,
    command: list[str],
    timeout_s: float,
    shape: tuple[str, ...] = ("-N", "4"),
) -> tuple[str | None, dict[str, Any]]:
    """Submit ``command`` under a fresh supervisor (``shape``: its node options);
    (Slurm's end state or None when stuck, the store's side of the recovery:
    :func:`bench.recovery_phases.store_marks`)."""
    supervisor = SupervisorProcess(cluster, where / "state", SETTINGS["policy"], SETTINGS["agents"])
    supervisor.start()
    try:
        done = supervisor.resurgo(
            "submit", *shape, "--min-nodes", "2", f"--output={output}",
            "--ckpt-root", str(ckpt), "--parsable", "--", *command,
        )  # fmt: skip
        if done.returncode != 0:
            raise SystemExit(f"bench: resurgo submit failed: {done.stderr}")
        job_id = int(done.stdout.strip())
        state = _wait(cluster, job_id, timeout_s)
        if state is None:
            cluster.run(["scancel", str(job_id)])
        with supervisor.store() as store:
            return state, store_marks(store, str(job_id))
    finally:
        supervisor.stop()
        _restore(cluster)


def run_resurgo(
    cluster: LiveCluster,
    where: Path,
    fault: str,
    timeout_s: float,
    shape: tuple[str, ...] = ("-N", "4"),
) -> dict[str, Any]:
    output, record = where / "job.out", where / "record"
    if LATE["on"]:
        what, _, at = fault.partition("@")
        fault = f"{what}@{LATE_STEP}:{at.partition(':')[2]}"
    command = [
        *TORCHRUN, str(TOY), "--steps", str(_steps()), "--save-every", "4",
        "--record", str(record), "--fault", fault,
    ]  # fmt: skip
    state, stored = _under_resurgo(
        cluster, where, output, where / "ckpt", command, timeout_s, shape
    )
    return _measure(output, record, state, stored)


def run_spare(cluster: LiveCluster, where: Path, fault: str, timeout_s: float) -> dict[str, Any]:
    """The 3+1 job: 4 nodes allocated, 3 training, the 4th the hot spare."""
    return run_resurgo(cluster, where, fault, timeout_s, ("-N", "3", "--spares", "1"))


def run_shrink(cluster: LiveCluster, where: Path, fault: str, timeout_s: float) -> dict[str, Any]:
    """The 3-node job without a spare, its 4th node held by a filler job: the shrink path."""
    filler = cluster.sbatch(
        f"--nodelist={SPARE_NODE}", "--nodes=1", f"--output={where / 'filler.out'}",
        "--wrap", "sleep 3600",
    )  # fmt: skip
    cluster.wait_job_state(filler, {"RUNNING"}, 60)
    try:
        return run_resurgo(cluster, where, fault, timeout_s, ("-N", "3"))
    finally:
        cluster.run(["scancel", str(filler)])


def plain_command(name: str, where: Path, out_dir: Path) -> list[str]:
    """The unmodified script's command for scenario ``name``: its fault and launch shape."""
    what, _, at = SCENARIOS[name].partition("@")
    iteration, _, rank = at.partition(":")
    iterations = str(LATE_ITERS if LATE["on"] else 40)
    iteration = str(LATE_ITER) if LATE["on"] else iteration
    fault = (
        ["--sleep-at", iteration, "--sleep-rank", rank, "--sleep-s", "600"]
        if what == "sleep"
        else ["--kill-at", iteration, "--fault-rank", rank]
    )
    script = [str(PLAIN), "--out-dir", str(out_dir), "--max-iters", iterations, "--iter-s",
              "0.5", *fault]  # fmt: skip
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
    state, stored = _under_resurgo(cluster, where, output, out_dir, command, timeout_s)
    text = output.read_text(errors="replace") if output.exists() else ""
    result = _result(state)
    faulted = _FAULTED.search(text)
    if faulted is None:
        return result
    fault_step, fault_s = int(faulted.group(1)), float(faulted.group(2))
    if "decided_at" in stored:
        result["decide_s"] = round(stored["decided_at"] - fault_s, 2)
    for key in ("path", "fault_event", "hang_timeout_s"):
        if key in stored:
            result[key] = stored[key]
    resumed = [(int(m.group(1)), float(m.group(2))) for m in _RESUMED.finditer(text)]
    resumed = [(step, at) for step, at in resumed if at > fault_s]
    if resumed:
        step, at = resumed[0]
        result["detect_s"] = round(at - fault_s, 2)
        result["steps_lost"] = fault_step - step
        after = [float(m.group(2)) for m in _ITER.finditer(text) if float(m.group(2)) > at]
        if after:
            result["recover_s"] = round(min(after) - fault_s, 2)
            if "marks" in stored:
                # The script's "resuming training from" line ends the process start (its
                # checkpoint loaded before it), its first iteration after it the first step.
                result["breakdown"] = breakdown(fault_s, stored["marks"], at, min(after))
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


def _steps() -> int:
    return LATE_STEPS if LATE["on"] else STEPS


def _pools(
    on: str, runner: Runner, cluster: LiveCluster, where: Path, fault: str, timeout_s: float
) -> dict[str, Any]:
    """``runner`` with the warm pools asked for (``on`` "1") or not ("0") in the job's
    environment."""
    agents = SETTINGS["agents"]
    SETTINGS["agents"] = {**agents, "RESURGO_WARM_POOL": on}
    try:
        return runner(cluster, where, fault, timeout_s)
    finally:
        SETTINGS["agents"] = agents


def _stacks(name: str, resurgo_only: bool) -> tuple[tuple[str, Runner], ...]:
    """The stacks scenario ``name`` runs under, in order."""
    if name.startswith("plain_") and LATE["on"]:
        plain = functools.partial(_plain_runner, name)
        return (("warm", functools.partial(_pools, "1", plain)),
                ("cold", functools.partial(_pools, "0", plain)))  # fmt: skip
    if LATE["on"]:
        return (("warm", functools.partial(_pools, "1", run_resurgo)),
                ("cold", functools.partial(_pools, "0", run_resurgo)))  # fmt: skip
    if name.startswith("plain_"):
        return (("resurgo", functools.partial(_plain_runner, name)),)
    if name.startswith("spare_"):
        return (("spare", run_spare), ("shrink", run_shrink))
    stacks: tuple[tuple[str, Runner], ...] = (
        ("resurgo", run_resurgo), ("baseline", run_baseline), ("control", run_control),
    )  # fmt: skip
    return stacks[:1] if resurgo_only else stacks


def path_taken(result: dict[str, Any]) -> str:
    """How a Resurgo run recovered, from its decision's words: ``swap`` (a spare took
    the blamed node's place), ``shrink`` (fewer nodes, same allocation), ``requeue``
    (a new allocation: so when the blamed node is the batch host, spare or not), or
    ``-`` (no relaunch decision)."""
    words = str(result.get("path") or "")
    if words.startswith("spare "):
        return "swap"
    if words.startswith("relaunch on"):
        return "shrink"
    return "requeue" if "requeue" in words else "-"


def _summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Per scenario and stack, medians over the runs. For spare scenarios also per
    path taken (which node the fault hits decides it), and ``spare_vs_shrink``: the
    ratio of the median swap to the median shrink, with the stacks' ratio beside it."""
    summary: dict[str, Any] = {}
    for row in rows:
        for stack, result in row.items():
            if isinstance(result, dict):
                summary.setdefault(row["fault"], {}).setdefault(stack, []).append(result)
    out: dict[str, Any] = {}
    for name, stacks in summary.items():
        out[name] = {stack: summarize(runs) for stack, runs in stacks.items()}
        if not name.startswith("spare_"):
            continue
        paths: dict[str, list[dict[str, Any]]] = {}
        for runs in stacks.values():
            for result in runs:
                paths.setdefault(path_taken(result), []).append(result)
        out[name]["by_path"] = {path: summarize(runs) for path, runs in paths.items()}
        for key, ours, theirs in (
            ("spare_vs_shrink", out[name]["by_path"].get("swap", {}),
             out[name]["by_path"].get("shrink", {})),
            ("spare_vs_shrink_stacks", out[name].get("spare", {}), out[name].get("shrink", {})),
        ):  # fmt: skip
            if ours.get("median_recover_s") and theirs.get("median_recover_s"):
                out[name][key] = round(ours["median_recover_s"] / theirs["median_recover_s"], 2)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--timeout-s", type=float, default=150.0)
    parser.add_argument("--scenario", action="append", choices=sorted(SCENARIOS))
    parser.add_argument(
        "--resurgo-only", action="store_true", help="skip the baseline and control runs"
    )
    parser.add_argument(
        "--spares", action="store_true", help="the spare scenarios (spare_sigkill, spare_hang)"
    )
    parser.add_argument(
        "--repeat", type=int, default=1, help="runs per scenario, its stacks alternating"
    )
    parser.add_argument(
        "--defaults",
        action="store_true",
        help="Resurgo with the policy and agent settings it ships (default: the benchmark's "
        "short windows: a 1 s exit window and backoff, an 8 s hang floor)",
    )
    parser.add_argument(
        "--warm-vs-cold",
        action="store_true",
        help="Resurgo alone, each run with and without the warm pools, the fault 25-35 s "
        "into training (the pools up, as in a long run)",
    )
    args = parser.parse_args()
    LATE["on"] = args.warm_vs_cold
    if args.defaults:
        SETTINGS.update(policy=SHIPPED_POLICY, agents=SHIPPED_AGENTS)
    names = list(args.scenario or ([] if args.spares else list(SCENARIOS)))
    if args.spares:
        names += [n for n in SCENARIOS if n.startswith("spare_") and n not in names]
    cluster = LiveCluster(conf=cluster_conf())
    results = []
    with tempfile.TemporaryDirectory(prefix="resurgo-bench-recovery-") as tmp:
        for name in names:
            fault = SCENARIOS[name]
            for run in range(1, args.repeat + 1):
                row: dict[str, Any] = {"fault": name, "inject": fault, "run": run}
                for stack, runner in _stacks(name, args.resurgo_only):
                    where = Path(tmp) / name / str(run) / stack
                    where.mkdir(parents=True)
                    started = time.monotonic()
                    row[stack] = runner(cluster, where, fault, args.timeout_s)
                    row[stack]["wall_s"] = round(time.monotonic() - started, 1)
                    print(f"bench: {name} #{run} under {stack}: {row[stack]}", flush=True)
                results.append(row)
    summary = _summary(results)
    for name, stacks in summary.items():
        print(f"bench: {name} summary: {stacks}", flush=True)
    settings = "shipped defaults" if args.defaults else "the benchmark's policy"
    print(json.dumps({"settings": settings, "scenarios": results, "summary": summary}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
