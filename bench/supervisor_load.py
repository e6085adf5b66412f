"""Supervisor load benchmark: thousands of simulated node agents against a real supervisor.

A real ``resurgo-supervisor`` (``python -m supervisor.daemon``) runs as its own
process on a loopback port with a fresh state directory. A tiny fake Slurm CLI
on its ``PATH`` (``squeue``/``sinfo`` print Slurm 22.05 JSON built from the
records in ``tests/fixtures/slurm/``, one node record per agent;
``scontrol``/``sbatch``/``scancel`` do nothing) lists the benchmark's jobs as
RUNNING, and each job has a directory written by
:func:`supervisor.jobs.write_job_dir` (spec and 0600 secret), so the daemon
registers the jobs exactly as it registers submitted ones.

``--agents N`` simulated agents are spread over jobs of 8 to 64 nodes, one
agent per node, each with its own node name and incarnation. Load-generator
processes (one per ``--agents-per-worker`` agents, 1,024 by default: at 4,096
agents, 8 processes sharing one core cost it 10-15% more CPU than 4 and
saturated it) each run one asyncio loop;
every agent keeps its own keep-alive connections (one for heartbeats, one
for events, as the two concurrent requests of the real agent's aiohttp
session) and signs every request with the protocol's
:func:`~agent.wire.protocol.signed_headers` (``--client aiohttp`` sends through
:func:`agent.wire.auth.signed_post` instead, at several times the generator's
CPU). Each agent:

- sends ``agent_started`` (attempt 1) when it starts (start times jittered
  over the first second);
- sends a heartbeat every second: ``--ranks-per-node`` ranks, all at the
  job's current step (synchronous training), with step and compute times.
  ``--heartbeats stream`` (the default, what the real agent does) sends them
  over one WebSocket per agent to the heartbeat stream, opened with a signed
  upgrade; ``--heartbeats post`` POSTs each, as agents did before the stream;
- emits benign events at random (``--events-per-agent-min`` a minute on
  average): ``step_losses``, ``checkpoint_committed`` (after writing the
  checkpoint's manifest, which the supervisor reads) and ``straggler``, with
  per-incarnation ``seq`` numbers and ids, batched and resent until
  acknowledged (never ``rank_exited`` or ``hang``, which start recoveries).

Every request's latency is measured by the sender, from the request to the
parsed reply, during a steady-state window (``--warmup-s`` after the start,
``--measure-s`` long). A request that failed or timed out counts in the
percentiles as its timeout (or longer, if it took longer): they are over
every request sent, not only the answered ones. Over the same window: the supervisor's CPU time
(``cpu_times`` of its process; its Slurm children are excluded) divided by
the wall time, i.e. the cores it used, and per request; the generators' CPU
the same way; the machine's busy cores (what neither used is other work);
and the share of the window the supervisor was runnable but waited for a
CPU (``/proc/<pid>/task/*/schedstat``): above a few percent it was starved.
RSS is read at the end of the window. From the start to the drain's end, a
Prometheus-style scrape of ``/metrics`` every 15 s (10 s timeout,
Prometheus' default) goes to a listener of its own (``metrics_listen``, as
an operator of thousands of agents sets it): ``scrapes``, ``scrape_max_s``
and ``scrapes_failed``. The supervisor's own
``resurgo_supervisor_loop_lag_seconds`` histogram, scraped at both ends of
the window, bounds how late its event loop ran (``supervisor_loop_lag_*``,
bucket upper bounds): the supervisor's share of the latencies, which on a
small machine also hold the generators' waits for their CPU. After the window, agents stop emitting
and resend what is unacknowledged for up to ``--drain-s``; the supervisor is
stopped (SIGTERM) and its store is read: ``lost_events`` is events
acknowledged but not stored (``acknowledged_not_stored``: a broken promise)
plus events still unacknowledged when the drain ended
(``never_acknowledged``: a real agent keeps those spooled and resends them).

``--floor`` runs the same heartbeats against a bare aiohttp server that
answers every request (or every frame on a stream) with an empty reply: what
HTTP or a WebSocket alone costs here.
``--aggregated`` runs the cluster the way jobs report with their aggregator
(``agent/driver/aggregator.py``): 16,384 nodes by default, in 472 jobs of 8
to 2,048 nodes (``bench.load_cluster.plan_aggregated_jobs``), each job one
simulated aggregator that sends one frame a second on its own stream
(``/v1/job/heartbeats/stream``): a beat for every node at the job's step, and
the whole heartbeats the real aggregator sends (every node's at its first
forward, then each node's every 30 s, at most 64 a frame). The agents' events
(``agent_started`` at their job's start, the jobs starting one after another
over 80% of the warm-up, then the same random mix, with only a job's first
node reporting its checkpoints; all kinds the real aggregator relays) go
through the job's aggregator as through ``agent/driver/eventrelay.py``: the
batches that came while its previous request was answered in one signed
POST. A direct run of ``--direct-beside`` agents (4,096 by default) goes
first, and the last line holds both side by side. The latencies are the job
frames' and the events' (an agent's batch from its handing to the relay to
its answer).

``--pin`` keeps the supervisor on the first CPU and the generators on the
others. ``--profile PREFIX`` records the supervisor with py-spy.

    python -m bench.supervisor_load --agents 4096
    python -m bench.supervisor_load --all        # 256, 1024 and 4096
    python -m bench.supervisor_load --agents 1024 --heartbeats post
    python -m bench.supervisor_load --aggregated  # 4,096 direct, then 16,384 aggregated

One JSON line per run; the last line printed is one JSON object (the run
itself, or the largest run's figures with ``"runs": [...]``, every run).

The parts, each a module of ``bench``: :mod:`bench.load_cluster` (the fake Slurm, the
job directories, checkpoint manifests), :mod:`bench.load_clients` (the generators' lean
HTTP and WebSocket clients), :mod:`bench.load_workers` (one load-generator process: its
simulated agents), :mod:`bench.load_harness` (the supervisor or floor server under load)
and :mod:`bench.load_stats` (CPU, latency and loop-lag figures). This module runs them
and is the entry point: the workers and the floor server are this module again,
started with ``--worker`` or ``--floor-server``.
"""

from __future__ import annotations

import argparse
import asyncio
import getpass
import itertools
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

if not __package__:
    sys.exit(
        "run the benchmarks from the repository root as modules: python -m bench.supervisor_load"
    )

import psutil

from bench.load_cluster import (
    REPO,
    AgentPlan,
    install_fake_slurm,
    plan_aggregated_jobs,
    plan_jobs,
    write_jobs,
)
from bench.load_harness import Supervisor, floor_main, free_port, wait_listening, wait_registered
from bench.load_stats import (
    Scraper,
    lag_quantile_ms,
    loop_lag_buckets,
    read_store,
    run_figures,
    sample_usage,
)
from bench.load_workers import worker_main

SIZES = (256, 1024, 4096)
AGGREGATED_NODES = 16384
# An aggregated run's jobs start one after another over 80% of its warm-up, as a
# cluster's jobs do (16,384 agents announcing themselves in one second is a
# burst of 16,384 events no real cluster sends), and its generators take whole
# jobs of about this many agents (they cost less per agent: no heartbeat each).
AGGREGATED_WARMUP_S = 90.0
AGGREGATED_PER_WORKER = 4096
FIRST_JOB_ID = 10001


def run_one(agents: int, args: argparse.Namespace, aggregated: bool = False) -> dict[str, Any]:
    """One supervisor, ``agents`` simulated agents: the figures of one run (``aggregated``:
    each job's heartbeats through its simulated aggregator)."""
    rng = random.Random(args.seed + agents)
    warmup_s = args.warmup_s or (AGGREGATED_WARMUP_S if aggregated else 10.0)
    with tempfile.TemporaryDirectory(prefix="resurgo-load-") as tmp:
        where = Path(tmp)
        planned = plan_aggregated_jobs(agents) if aggregated else plan_jobs(agents, rng)
        jobs = {str(FIRST_JOB_ID + i): nodes for i, nodes in enumerate(planned)}
        bin_dir = install_fake_slurm(where, jobs, getpass.getuser())
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        plans = write_jobs(where / "state" / "jobs", jobs, args.ranks_per_node, url, where, rng)
        secrets_by_job = {plan.job_id: bytes.fromhex(plan.secret_hex) for plan in plans}
        supervisor = Supervisor(where, bin_dir, port, floor=args.floor, metrics_port=free_port())
        workers: list[subprocess.Popen[str]] = []
        scraper = Scraper(supervisor.metrics_url)
        try:
            if args.floor:
                asyncio.run(wait_listening(url, timeout_s=60))
            else:
                asyncio.run(wait_registered(url, secrets_by_job, timeout_s=120))
            per = args.agents_per_worker or (AGGREGATED_PER_WORKER if aggregated else 1024)
            for chunk in _chunks(plans, per, whole_jobs=aggregated):
                worker = subprocess.Popen(
                    [sys.executable, "-m", "bench.supervisor_load", "--worker"], cwd=REPO,
                    stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                )  # fmt: skip
                assert worker.stdin is not None and worker.stdout is not None
                config = {
                    "url": url, "seed": rng.random(), "client": args.client,
                    "heartbeats": args.heartbeats,
                    "results": str(where / f"worker-{len(workers)}.json"),
                    "events": not args.floor,
                    "events_per_agent_min": args.events_per_agent_min,
                    "aggregated": aggregated,
                    "start_spread_s": warmup_s * 0.8,
                    "agents": [asdict(plan) for plan in chunk],
                }  # fmt: skip
                worker.stdin.write(json.dumps(config) + "\n")
                worker.stdin.flush()
                workers.append(worker)
            for worker in workers:
                assert worker.stdout is not None
                if worker.stdout.readline().strip() != "ready":
                    raise RuntimeError("a load generator failed to start")
            start_at = time.time() + 0.5
            go = {"start_at": start_at, "measure_from": start_at + warmup_s,
                  "measure_until": start_at + warmup_s + args.measure_s}  # fmt: skip
            go["drain_until"] = go["measure_until"] + args.drain_s
            for worker in workers:
                assert worker.stdin is not None
                worker.stdin.write(json.dumps(go) + "\n")
                worker.stdin.flush()
            if not args.floor:
                scraper.start()
            generators = [psutil.Process(worker.pid) for worker in workers]
            cpus = sorted(os.sched_getaffinity(0))
            if args.pin and len(cpus) >= 2:
                # The supervisor alone on one core (its threads too); generators elsewhere.
                for thread in supervisor.ps.threads():
                    os.sched_setaffinity(thread.id, cpus[:1])
                for process in generators:
                    process.cpu_affinity(cpus[1:])
            time.sleep(max(0.0, go["measure_from"] - time.time()))
            profiler = _start_profiler(args.profile, agents, supervisor.process.pid, args)
            before = sample_usage(supervisor, generators)
            lag_before = {} if args.floor else loop_lag_buckets(supervisor.metrics_url)
            time.sleep(max(0.0, go["measure_until"] - time.time()))
            after = sample_usage(supervisor, generators)
            lag_after = {} if args.floor else loop_lag_buckets(supervisor.metrics_url)
            rss_mib = supervisor.ps.memory_info().rss / (1 << 20)
            if profiler is not None:
                profiler.wait(timeout=60)
            results = []
            for number, worker in enumerate(workers):
                worker.communicate(timeout=args.drain_s + 120)
                if worker.returncode != 0:
                    raise RuntimeError(f"a load generator failed (exit {worker.returncode})")
                results.append(json.loads((where / f"worker-{number}.json").read_text()))
        except BaseException:
            print(f"bench: supervisor log tail:\n{supervisor.log_tail()}", file=sys.stderr)
            raise
        finally:
            scraper.stop()
            for worker in workers:
                if worker.poll() is None:
                    worker.kill()
                    worker.wait()
            supervisor.stop()
        stored, job_states = (set(), {}) if args.floor else read_store(supervisor.store_path)
        if args.keep_logs:
            Path(args.keep_logs).mkdir(parents=True, exist_ok=True)
            shutil.copy(supervisor.log_path, Path(args.keep_logs) / f"supervisor-{agents}.log")
            shutil.copy(supervisor.store_path, Path(args.keep_logs) / f"store-{agents}.db")
        logs = supervisor.log_counts()
    figures = run_figures(agents, len(jobs), args, before, after, rss_mib, results, stored,
                          job_states, logs)  # fmt: skip
    figures["path"] = "aggregated" if aggregated else "direct"
    if not args.floor:
        figures.update(scraper.figures())
    if aggregated:
        figures["heartbeats"] = "job"
        figures["job_sizes"] = sorted({len(nodes) for nodes in jobs.values()})
        figures["beats_forwarded"] = sum(result["beats_forwarded"] for result in results)
    if lag_after:
        # The supervisor's own delay (its loop held), apart from the generators'
        # scheduling, which the latencies above include on a machine they share.
        figures["supervisor_loop_lag_p50_ms_at_most"] = lag_quantile_ms(lag_before, lag_after, 0.5)
        figures["supervisor_loop_lag_p99_ms_at_most"] = lag_quantile_ms(lag_before, lag_after, 0.99)
        figures["supervisor_loop_lag_max_ms_at_most"] = lag_quantile_ms(lag_before, lag_after, 1.0)
    return figures


def _chunks(plans: list[AgentPlan], per: int, *, whole_jobs: bool) -> list[list[AgentPlan]]:
    """The agents of each load generator: ``per`` each, or whole jobs of about ``per``."""
    if not whole_jobs:
        return [plans[index : index + per] for index in range(0, len(plans), per)]
    chunks: list[list[AgentPlan]] = [[]]
    for job_id, members in itertools.groupby(plans, key=lambda plan: plan.job_id):
        if len(chunks[-1]) >= per:
            chunks.append([])
        chunks[-1].extend(members)
        del job_id
    return chunks


def _start_profiler(
    prefix: str | None, agents: int, pid: int, args: argparse.Namespace
) -> subprocess.Popen[bytes] | None:
    """``py-spy record`` of the supervisor over the window, as collapsed stacks."""
    if prefix is None:
        return None
    output = f"{prefix}-{agents}.txt"
    beside = Path(sys.executable).parent / "py-spy"
    return subprocess.Popen(
        [str(beside) if beside.exists() else "py-spy", "record", "--pid", str(pid),
         "--duration", str(int(args.measure_s)), "--rate", "100", "--format", "raw",
         "--output", output, "--nonblocking"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip


def _side_by_side(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The aggregated run's figures, the direct run's beside them, and their ratios."""
    aggregated = max(
        (run for run in runs if run["path"] == "aggregated"), key=lambda r: r["agents"]
    )
    direct = next((run for run in runs if run["path"] == "direct"), None)
    summary: dict[str, Any] = {**aggregated, "runs": runs}
    if direct is not None:
        for key in ("supervisor_cpu_cores", "p99_ms", "supervisor_rss_mib"):
            summary[f"direct_{direct['agents']}_{key}"] = direct[key]
        summary["nodes_ratio"] = round(aggregated["agents"] / direct["agents"], 2)
        if direct["supervisor_cpu_cores"]:
            summary["cpu_ratio_aggregated_to_direct"] = round(
                aggregated["supervisor_cpu_cores"] / direct["supervisor_cpu_cores"], 3
            )
    return summary


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--agents", type=int, nargs="+", default=None,
                        help="simulated agents (several: one run each; default "
                        f"{SIZES[-1]}, or {AGGREGATED_NODES} with --aggregated)")  # fmt: skip
    parser.add_argument(
        "--aggregated",
        action="store_true",
        help="each job's heartbeats through its aggregator: one request a second a job "
        "(jobs of 8 to 2,048 nodes), beside a direct run of --direct-beside agents",
    )
    parser.add_argument("--direct-beside", type=int, default=4096,
                        help="with --aggregated: the direct run first (0: none)")  # fmt: skip
    parser.add_argument("--all", action="store_true", help=f"one run each for {SIZES}")
    parser.add_argument("--ranks-per-node", type=int, default=8)
    parser.add_argument("--events-per-agent-min", type=float, default=1.0)
    parser.add_argument("--agents-per-worker", type=int, default=None,
                        help="agents a load generator simulates (default 1,024; aggregated: "
                        f"whole jobs of about {AGGREGATED_PER_WORKER})")  # fmt: skip
    parser.add_argument("--warmup-s", type=float, default=None,
                        help="seconds before the window (default 10; aggregated: "
                        f"{AGGREGATED_WARMUP_S:.0f}, its jobs starting over the first "
                        "80%%)")  # fmt: skip
    parser.add_argument("--measure-s", type=float, default=30.0)
    parser.add_argument("--drain-s", type=float, default=15.0)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--client", choices=("lean", "aiohttp"), default="lean",
                        help="the generators' client (Connection, StreamConnection)")  # fmt: skip
    parser.add_argument("--heartbeats", choices=("stream", "post"), default="stream",
                        help="heartbeats on one WebSocket per agent, or a POST each")  # fmt: skip
    parser.add_argument(
        "--profile",
        metavar="PREFIX",
        help="py-spy record the supervisor over the window into PREFIX-<N>.txt",
    )
    parser.add_argument(
        "--pin",
        action="store_true",
        help="run the supervisor on the first CPU only and the generators on the others",
    )
    parser.add_argument(
        "--keep-logs", metavar="DIR", help="copy the supervisor's log and store into DIR"
    )
    parser.add_argument(
        "--floor",
        action="store_true",
        help="heartbeats only, to a bare aiohttp server instead of the supervisor",
    )
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--floor-server", type=int, metavar="PORT", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker_main()
    if args.floor_server is not None:
        return floor_main(args.floor_server)
    runs = []
    if args.aggregated:
        plan = [(args.direct_beside, False)] if args.direct_beside else []
        plan += [(agents, True) for agents in args.agents or [AGGREGATED_NODES]]
    else:
        plan = [
            (agents, False) for agents in (list(SIZES) if args.all else args.agents or [SIZES[-1]])
        ]
    for agents, aggregated in plan:
        run = run_one(agents, args, aggregated)
        print(json.dumps(run), flush=True)
        runs.append(run)
    if args.aggregated:
        print(json.dumps(_side_by_side(runs)))
        return 0
    if len(runs) == 1:
        print(json.dumps(runs[0]))
    else:
        largest = max(runs, key=lambda run: run["agents"])
        print(json.dumps({**largest, "runs": runs}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
