"""A rank that trains through TrainingSession and reports its losses, under resurgo-agent.

Started by torchrun (gloo, CPU). Each step's loss is all-reduced, as a
data-parallel script logs it, and passed to ``session.step_done(loss=...)``,
which reports it (rank 0 only) to the node agent with the sampler's cursor.
After ``--hold-at`` steps every rank waits for ``OUT/release`` to appear, so a
test can see what the agent sent while the ranks were still running. Rank 0
writes the losses it reported to ``OUT/losses.json`` (step -> loss) at the end;
each rank writes its pid to ``OUT/pid.<rank>``.
"""

import argparse
import json
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from agent.train.sampler import GlobalBatchSampler, loss_weight
from agent.train.session import TrainingSession

DATASET = 64
GLOBAL_BATCH = 8


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--ckpt", required=True)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--hold-at", type=int, default=-1)
    parser.add_argument("--step-s", type=float, default=0.02)
    args = parser.parse_args()

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    out = Path(args.out)
    (out / f"pid.{rank}").write_text(str(os.getpid()))
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    inputs = torch.randn(DATASET, 4, generator=torch.Generator().manual_seed(1))
    targets = inputs.sum(dim=1, keepdim=True)
    sampler = GlobalBatchSampler(DATASET, GLOBAL_BATCH, rank=rank, world_size=world, seed=2)
    session = TrainingSession(args.ckpt, model=model, optimizer=optimizer, sampler=sampler)
    session.restore()
    session.restore_rng()
    reported: dict[int, float] = {}
    while session.step < args.steps:
        for indices in sampler:
            if session.step >= args.steps:
                break
            error = model(inputs[indices]) - targets[indices]
            loss = (error**2).sum() * loss_weight(GLOBAL_BATCH, world)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            value = loss.detach().clone()
            dist.all_reduce(value)
            session.step_done(loss=value.item())
            reported[session.step] = value.item()
            time.sleep(args.step_s)
            if session.step == args.hold_at:
                while not (out / "release").exists():
                    time.sleep(0.05)
    session.close()
    if rank == 0:
        (out / "losses.json").write_text(json.dumps(reported))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
