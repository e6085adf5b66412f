"""A rank for the node-agent tests, started by torchrun under resurgo-agent.

Instrumented (``--instrumented``: heartbeats through agent.train.heartbeat) or
plain (no Resurgo import at all: the agent must find hangs from stacks). Every
step all-reduces over gloo, so one stopped rank blocks the others inside the
collective, as in a real data-parallel job. Faults: ``--stop-rank R
--stop-step S`` SIGSTOPs rank R at step S; ``--init-sleep-s`` sleeps before
the first step; ``--checkpoint-at S --checkpoint-s T`` spends T seconds in the
checkpoint phase at step S; ``--optimizer`` takes an optimizer step each
step, which the bootstrap counts; ``--slow-rank R --slow-step-s T`` makes rank R's
steps take T seconds (with ``--no-sync``, so the others do not wait for it).
Each rank writes its pid to ``OUT/pid.<rank>``, and the torchrun and Slurm task
variables it was given to ``OUT/env.<rank>`` (JSON).
"""

import argparse
import json
import os
import signal
import time
from pathlib import Path

import torch
import torch.distributed as dist


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--steps", type=int, default=1000000)
    parser.add_argument("--step-s", type=float, default=0.05)
    parser.add_argument("--instrumented", action="store_true")
    parser.add_argument("--init-sleep-s", type=float, default=0.0)
    parser.add_argument("--stop-rank", type=int, default=-1)
    parser.add_argument("--stop-step", type=int, default=-1)
    parser.add_argument("--checkpoint-at", type=int, default=-1)
    parser.add_argument("--checkpoint-s", type=float, default=0.0)
    parser.add_argument("--slow-rank", type=int, default=-1)
    parser.add_argument("--slow-step-s", type=float, default=0.0)
    parser.add_argument("--no-sync", action="store_true", help="no all-reduce per step")
    parser.add_argument("--optimizer", action="store_true",
                        help="an optimizer step per step (the bootstrap counts them)")  # fmt: skip
    args = parser.parse_args()

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    Path(args.out, f"pid.{rank}").write_text(str(os.getpid()))
    seen = {name: os.environ.get(name) for name in ("RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE",
            "SLURM_PROCID", "SLURM_LOCALID", "SLURM_NTASKS", "SLURM_NODEID")}  # fmt: skip
    Path(args.out, f"env.{rank}").write_text(json.dumps(seen))
    heartbeat = None
    if args.instrumented:
        from agent.train.heartbeat import Heartbeat, Phase

        heartbeat = Heartbeat.from_env()
        heartbeat.beat(0, Phase.INIT)
    time.sleep(args.init_sleep_s)
    value = torch.ones(4)
    weight = torch.nn.Parameter(torch.ones(4))
    optimizer = torch.optim.SGD([weight], lr=0.0)
    for step in range(1, args.steps + 1):
        if rank == args.stop_rank and step == args.stop_step:
            Path(args.out, f"stopped.{rank}").write_text(str(step))
            os.kill(os.getpid(), signal.SIGSTOP)
        if not args.no_sync:
            dist.all_reduce(value)
            value.fill_(1.0)
        time.sleep(args.slow_step_s if rank == args.slow_rank else args.step_s)
        if args.optimizer:
            weight.sum().backward()
            optimizer.step()
        if heartbeat is not None:
            heartbeat.beat(step)
            if step == args.checkpoint_at:
                with heartbeat.phase(Phase.CHECKPOINT):
                    time.sleep(args.checkpoint_s)
        Path(args.out, f"step.{rank}").write_text(str(step))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
