"""Heartbeat benchmark: what a beat costs the rank, and what watching a rank costs the agent.

Rank side, ``Heartbeat.beat()`` timed call by call over ``--calls`` calls:

- live: a receiver in another process drains the socket (the normal case);
- full: the agent is alive but not reading, so every send finds the queue full;
- gone: the agent's socket is gone (closed and unlinked);
- off: no socket configured (a script run outside Resurgo).

Automatic progress (:mod:`agent.train.autohooks`, scripts that import
nothing): the optimizer-step post hook timed call by call against a live
receiver, and side by side ``optimizer.step()`` of a small model with the hook
registered and without (the median difference is what a step pays).

Agent side, per datagram: ``recv`` + :func:`parse_datagram` + :func:`observe`,
and one :func:`hang_verdicts` pass over ``--ranks`` ranks (the agent runs it
about once a second). From those: the share of one core the agent spends per
1,000 beats/s, and per rank watched at ``--steps-per-s`` steps a second.
Then a real ``resurgo-agent`` watching ``--real-ranks`` torchrun ranks, with
heartbeats and without (stack sampling by py-spy): its measured CPU per rank.

    python -m bench.agent

The last line printed is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# Run as `python bench/agent.py`, this folder would come first on sys.path and
# "agent" would import this file instead of the package: run it as a module.
if not __package__:
    sys.exit("run the benchmarks from the repository root as modules: python -m bench.agent")

from agent.node.hang import HangConfig, RankProgress, hang_verdicts, observe
from agent.train.heartbeat import Heartbeat
from agent.wire.datagram import (
    Phase,
    RankBeat,
    encode_beat,
    parse_datagram,
)

DRAIN = """
import socket, sys
s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4 << 20)
s.bind(sys.argv[1])
print("bound", flush=True)
n = 0
while True:
    if s.recv(256) == b"stop":
        break
    n += 1
print(n, flush=True)
"""


def time_calls(hb: Heartbeat, calls: int) -> dict[str, float]:
    """Median, p99 and max of one beat() each, in microseconds."""
    clock = time.perf_counter_ns
    samples = [0] * calls
    for i in range(calls):
        started = clock()
        hb.beat(i)
        samples[i] = clock() - started
    # The timer's own cost, to subtract: two back-to-back reads.
    overhead = statistics.median(-(clock() - clock()) for _ in range(10_000))
    samples.sort()
    us = [max(0.0, (s - overhead) / 1000) for s in samples]
    return {
        "p50": us[calls // 2],
        "p99": us[int(calls * 0.99)],
        "max": us[-1],
    }


def time_hook(path: str, calls: int) -> dict[str, float]:
    """The automatic hook per optimizer step: the call itself, and the step with and without."""
    import torch
    from torch.optim.optimizer import register_optimizer_step_post_hook

    from agent.train import heartbeat as heartbeat_module
    from agent.train.autohooks import AutoProgress

    # The Heartbeats timed before made this process "instrumented", which stands
    # the hook down; the hook is timed as it runs in a script that imports nothing.
    heartbeat_module.instrumented = False
    progress = AutoProgress(Heartbeat(path, automatic=True))
    model = torch.nn.Linear(64, 64)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    model(torch.randn(4, 64)).sum().backward()
    clock = time.perf_counter_ns
    overhead = statistics.median(-(clock() - clock()) for _ in range(10_000))
    direct = [0] * calls
    for i in range(calls):
        started = clock()
        progress.after_step(optimizer, (), {})
        direct[i] = clock() - started
    direct.sort()
    assert progress.step == calls, "the hook stood down: nothing was timed"
    steps = max(1000, calls // 20)

    def median_step_ns() -> float:
        samples = [0] * steps
        for i in range(steps):
            started = clock()
            optimizer.step()
            samples[i] = clock() - started
        return statistics.median(samples)

    without, with_hook = [], []
    for _ in range(5):  # interleaved rounds: the machine's noise hits both alike
        without.append(median_step_ns())
        handle = register_optimizer_step_post_hook(progress.after_step)
        with_hook.append(median_step_ns())
        handle.remove()
    return {
        "p50": max(0.0, (direct[calls // 2] - overhead) / 1000),
        "p99": max(0.0, (direct[int(calls * 0.99)] - overhead) / 1000),
        "step_us_without": statistics.median(without) / 1000,
        "step_us_with": statistics.median(with_hook) / 1000,
    }


def rank_side(calls: int, workdir: Path) -> dict[str, dict[str, float]]:
    path = str(workdir / "agent.sock")
    results = {}

    drain = subprocess.Popen([sys.executable, "-c", DRAIN, path], stdout=subprocess.PIPE, text=True)
    assert drain.stdout is not None
    drain.stdout.readline()
    hb = Heartbeat(path, rank=0, local_rank=0)
    hb.beat(0, Phase.INIT)
    results["live"] = time_calls(hb, calls)
    results["hook"] = time_hook(path, calls)
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as stopper:
        stopper.sendto(b"stop", path)
    received = int(drain.stdout.readline())
    drain.wait()
    results["live"]["delivered_share"] = received / (calls + 1)
    os.unlink(path)

    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as idle:
        idle.bind(path)
        hb = Heartbeat(path)
        hb.beat(0)
        results["full"] = time_calls(hb, calls)
        assert hb.connected
    os.unlink(path)

    hb = Heartbeat(path)
    results["gone"] = time_calls(hb, calls)
    assert not hb.connected

    results["off"] = time_calls(Heartbeat(None), calls)
    return results


def agent_side(ranks: int, beats: int) -> dict[str, float]:
    datagrams = [
        encode_beat(
            rank=r, local_rank=r, pid=1000 + r, step=i, phase=Phase.TRAIN, wall_time_s=1.7e9
        )
        for i in range(beats // ranks)
        for r in range(ranks)
    ]
    sender, receiver = socket.socketpair(socket.AF_UNIX, socket.SOCK_DGRAM)
    sender.setblocking(False)
    with sender, receiver:
        # recv cost: queue as many as the buffer takes, then time draining them.
        recv_ns = 0
        received = 0
        while received < len(datagrams):
            queued = 0
            try:
                while queued < 200:
                    sender.send(datagrams[received + queued])
                    queued += 1
            except (BlockingIOError, IndexError):
                pass
            started = time.process_time_ns()
            for _ in range(queued):
                receiver.recv(256)
            recv_ns += time.process_time_ns() - started
            received += queued

    state: dict[int, RankProgress] = {}
    started = time.process_time_ns()
    for i, data in enumerate(datagrams):
        beat = parse_datagram(data)
        assert isinstance(beat, RankBeat)
        state[beat.rank] = observe(state.get(beat.rank), beat, i * 0.01)
    update_ns = time.process_time_ns() - started

    config = HangConfig()
    passes = 2000
    started = time.process_time_ns()
    for i in range(passes):
        hang_verdicts(state, len(datagrams) * 0.01 + i * 1e-3, config)
    verdict_ns = (time.process_time_ns() - started) / passes

    per_beat_us = (recv_ns + update_ns) / len(datagrams) / 1000
    return {
        "recv_us_per_beat": recv_ns / len(datagrams) / 1000,
        "parse_observe_us_per_beat": update_ns / len(datagrams) / 1000,
        "hang_verdicts_us_per_rank": verdict_ns / ranks / 1000,
        "agent_cpu_us_per_beat": per_beat_us,
        # 1,000 beats/s x per-beat us = us of CPU per second; / 1e6 x 100 = percent.
        "agent_core_percent_per_1000_beats_s": per_beat_us * 1000 / 1e6 * 100,
    }


REPO = Path(__file__).resolve().parents[1]
WORKER = REPO / "tests" / "workers" / "agent_worker.py"


def real_agent(ranks: int, seconds: float, instrumented: bool, workdir: Path) -> float:
    """CPU of a real resurgo-agent watching ``ranks`` torchrun ranks, % of a core per rank.

    Counts the agent's own CPU and its waited children's (the py-spy runs that
    sample stacks of ranks sending no heartbeats), over ``seconds`` once every
    rank is stepping (0.05 s steps, gloo all-reduce each step).
    """
    import psutil

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    out = workdir / ("instrumented" if instrumented else "plain")
    out.mkdir()
    argv = [
        sys.executable, "-m", "agent.node.agent", "--job-id", "bench", "--node", "n1",
        "--master-port", str(port), "--run-dir", str(out / "run"), "--stack-sample-s", "5",
        "--", "torchrun", f"--nproc-per-node={ranks}", str(WORKER), "--out", str(out),
        "--step-s", "0.05", *(["--instrumented"] if instrumented else []),
    ]  # fmt: skip
    agent = subprocess.Popen(argv, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 120
        while not all((out / f"step.{r}").exists() for r in range(ranks)):
            if time.monotonic() > deadline or agent.poll() is not None:
                raise RuntimeError("the ranks under the benchmark agent never started stepping")
            time.sleep(0.2)
        process = psutil.Process(agent.pid)

        def cpu() -> float:
            times = process.cpu_times()
            return times.user + times.system + times.children_user + times.children_system

        before = cpu()
        time.sleep(seconds)
        used = cpu() - before
    finally:
        agent.terminate()
        agent.wait(timeout=60)
    return 100.0 * used / seconds / ranks


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=200_000, help="beats timed per case")
    parser.add_argument("--ranks", type=int, default=8, help="ranks on the agent side")
    parser.add_argument("--beats", type=int, default=200_000, help="datagrams on the agent side")
    parser.add_argument(
        "--steps-per-s",
        type=float,
        default=10.0,
        help="beats per rank per second, for the estimate",
    )
    parser.add_argument(
        "--real-seconds", type=float, default=30.0, help="window for the real-agent CPU figure"
    )
    parser.add_argument("--real-ranks", type=int, default=4, help="ranks under the real agent")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory(prefix="resurgo-bench-", dir="/tmp") as tmp:
        rank = rank_side(args.calls, Path(tmp))
        real_beats = real_agent(args.real_ranks, args.real_seconds, True, Path(tmp))
        real_stacks = real_agent(args.real_ranks, args.real_seconds, False, Path(tmp))
    agent = agent_side(args.ranks, args.beats)
    # Per rank watched: its beats, plus one hang_verdicts share per second.
    per_rank_us_per_s = (
        args.steps_per_s * agent["agent_cpu_us_per_beat"] + agent["hang_verdicts_us_per_rank"]
    )
    hook = rank.pop("hook")
    print(
        f"automatic hook: p50 {hook['p50']:.2f} us  p99 {hook['p99']:.2f} us; optimizer.step() "
        f"{hook['step_us_without']:.1f} us without, {hook['step_us_with']:.1f} us with"
    )
    for case, figures in rank.items():
        print(
            f"beat() {case:>4}: p50 {figures['p50']:.2f} us  p99 {figures['p99']:.2f} us  "
            f"max {figures['max']:.1f} us"
        )
    for name, value in agent.items():
        print(f"agent {name}: {value:.3f}")
    print(
        f"agent CPU per rank watched at {args.steps_per_s:g} steps/s: "
        f"{per_rank_us_per_s:.1f} us/s ({per_rank_us_per_s / 1e4:.4f} % of a core)"
    )
    print(
        f"real agent, {args.real_ranks} ranks at 20 steps/s: {real_beats:.2f} % of a core per "
        f"rank (heartbeats), {real_stacks:.2f} % (no heartbeats: py-spy every 5 s)"
    )
    result = {
        "heartbeat_send_us_p50": round(rank["live"]["p50"], 3),
        "heartbeat_send_us_p99": round(rank["live"]["p99"], 3),
        "heartbeat_send_us_max": round(rank["live"]["max"], 1),
        "heartbeat_delivered_share": round(rank["live"]["delivered_share"], 4),
        "heartbeat_full_queue_us_p50": round(rank["full"]["p50"], 3),
        "heartbeat_full_queue_us_p99": round(rank["full"]["p99"], 3),
        "heartbeat_agent_gone_us_p50": round(rank["gone"]["p50"], 3),
        "heartbeat_agent_gone_us_p99": round(rank["gone"]["p99"], 3),
        "heartbeat_off_us_p50": round(rank["off"]["p50"], 3),
        "heartbeat_off_us_p99": round(rank["off"]["p99"], 3),
        "auto_hook_us_p50": round(hook["p50"], 3),
        "auto_hook_us_p99": round(hook["p99"], 3),
        "optimizer_step_us_without_hook": round(hook["step_us_without"], 2),
        "optimizer_step_us_with_hook": round(hook["step_us_with"], 2),
        **{k: round(v, 4) for k, v in agent.items()},
        "agent_cpu_us_per_s_per_rank": round(per_rank_us_per_s, 2),
        "steps_per_s_assumed": args.steps_per_s,
        "real_agent_core_percent_per_rank_heartbeats": round(real_beats, 3),
        "real_agent_core_percent_per_rank_stack_sampling": round(real_stacks, 3),
        "real_agent_ranks": args.real_ranks,
        "calls": args.calls,
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
