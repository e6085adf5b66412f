"""A small real training job for the demo and the recovery tests: torchrun, gloo, CPU.

Every rank trains the same linear regression model on its share of each
global batch (:class:`GlobalBatchSampler`), all-reduces the gradients, and
goes through :class:`TrainingSession`, which saves a checkpoint every
``--save-every`` steps (synchronously, so the commit is reported at once).
Rank 0 tells its node agent about every step and every committed checkpoint
(:mod:`agent.train.heartbeat`) and prints one line per step.

Fault knobs for demonstrations:

- ``--idle-at S``: on a fresh start (not a resume), after step S stop
  training and wait (reporting the ``eval`` phase) until killed; so a fault
  can be injected at a known point.
- ``--raise-at S --raise-rank R``: rank R raises an exception when it reaches
  step S, in every attempt: a bug in the user's code (a crash loop).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from agent.train.heartbeat import Heartbeat, Phase
from agent.train.sampler import GlobalBatchSampler, loss_weight
from agent.train.session import TrainingSession

DATASET_LEN = 240
GLOBAL_BATCH = 12
FEATURES = 8


def dataset() -> TensorDataset:
    generator = torch.Generator().manual_seed(1234)
    inputs = torch.randn(DATASET_LEN, FEATURES, generator=generator)
    targets = inputs @ torch.randn(FEATURES, 1, generator=generator)
    return TensorDataset(inputs, targets)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--save-every", type=int, default=5)
    parser.add_argument("--step-s", type=float, default=0.2, help="extra time per step")
    parser.add_argument("--idle-at", type=int, default=None)
    parser.add_argument("--raise-at", type=int, default=None)
    parser.add_argument("--raise-rank", type=int, default=0)
    args = parser.parse_args()

    os.environ.setdefault("RESURGO_CKPT_EVERY_STEPS", str(args.save_every))
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    heartbeat = Heartbeat.from_env()
    heartbeat.beat(0, Phase.INIT)
    torch.manual_seed(0)
    model = nn.Linear(FEATURES, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    sampler = GlobalBatchSampler(DATASET_LEN, GLOBAL_BATCH, rank=rank, world_size=world, seed=3)
    loader = DataLoader(dataset(), batch_sampler=sampler)
    session = TrainingSession(model=model, optimizer=optimizer, sampler=sampler)
    start = session.restore()
    batches = iter(loader)
    session.restore_rng()
    resumed = session.resumed_from is not None
    if rank == 0:
        print(
            f"toy: world {world}, starting at step {start}"
            f"{f' from {session.resumed_from}' if resumed else ''}",
            flush=True,
        )
    weight = loss_weight(GLOBAL_BATCH, world)
    while session.step < args.steps:
        step = session.step + 1
        if args.raise_at == step and rank == args.raise_rank:
            raise RuntimeError(f"toy: injected failure at step {step}")
        try:
            inputs, targets = next(batches)
        except StopIteration:
            batches = iter(loader)
            inputs, targets = next(batches)
        per_sample = (model(inputs) - targets).pow(2).squeeze(1)
        (per_sample.sum() * weight).backward()
        for parameter in model.parameters():
            assert parameter.grad is not None
            dist.all_reduce(parameter.grad)
        optimizer.step()
        optimizer.zero_grad()
        loss = per_sample.detach().sum().reshape(1) / GLOBAL_BATCH
        dist.all_reduce(loss)
        time.sleep(args.step_s)
        saved = session.step_done(loss=loss.item())
        heartbeat.beat(session.step)
        if saved is not None:
            with heartbeat.phase(Phase.CHECKPOINT):
                session.wait()
            if rank == 0:  # one report per checkpoint is enough
                heartbeat.checkpoint_committed(session.step, saved.path)
        if rank == 0:
            print(f"toy: step {session.step} loss {loss.item():.6f}", flush=True)
        if args.idle_at == session.step and not resumed:
            if rank == 0:
                print(f"toy: idle at step {session.step} until stopped", flush=True)
            while True:
                heartbeat.beat(session.step, Phase.EVAL)
                time.sleep(1.0)
    session.close()
    dist.barrier()
    if rank == 0:
        print(f"toy: done at step {session.step} with world {world}", flush=True)
    dist.destroy_process_group()
    sys.stdout.flush()


if __name__ == "__main__":
    main()
