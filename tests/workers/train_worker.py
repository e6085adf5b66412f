"""A small real training run on FSDP2 (gloo, CPU) for the resume acceptance tests.

Started by torchrun. Trains a two-layer MLP (optionally with dropout) on a
synthetic regression set with a :class:`GlobalBatchSampler`, an AdamW optimizer
and a LambdaLR scheduler, through :class:`TrainingSession`, which saves every
``--save-every`` steps. Each rank appends one JSON line per step to
``OUT/steps.rank<r>.jsonl`` (global loss, the global sample indices of the
step in rank order); at the end rank 0 writes the full parameters and optimizer
state to ``OUT/final.pt``. ``--kill-after S`` SIGKILLs every rank once the
step-S checkpoint has committed, the way a node failure would.

Each start appends what it loaded to ``OUT/loads.rank<r>.jsonl``
(:class:`agent.train.session.Loaded`, or ``{"path": null}`` for a fresh
start). ``--break PART`` resumes wrongly on purpose, so that the tests show
their comparisons catch it: ``restore`` (no restore: a fresh start),
``rng`` (the RNGs reseeded after the restore), ``optimizer`` (its moments dropped after the
load), ``cursor`` (the data cursor back at 0).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.utils.data import DataLoader, TensorDataset

from agent.train.sampler import GlobalBatchSampler, loss_weight
from agent.train.session import TrainingSession

DATASET_LEN = 96
GLOBAL_BATCH = 12
FEATURES = 16


def dataset() -> TensorDataset:
    generator = torch.Generator().manual_seed(1234)
    inputs = torch.randn(DATASET_LEN, FEATURES, generator=generator)
    targets = inputs @ torch.randn(FEATURES, 1, generator=generator) + 0.1 * torch.randn(
        DATASET_LEN, 1, generator=generator
    )
    indices = torch.arange(DATASET_LEN)
    return TensorDataset(inputs, targets, indices)


def build_model(dropout: float) -> nn.Module:
    torch.manual_seed(0)  # identical initial parameters on every rank
    layers: list[nn.Module] = [nn.Linear(FEATURES, 64), nn.ReLU()]
    if dropout:
        layers.append(nn.Dropout(dropout))
    layers.append(nn.Linear(64, 1))
    return nn.Sequential(*layers)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--root", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--dropout", type=float, default=0.0)
    parser.add_argument("--kill-after", type=int, default=None)
    parser.add_argument("--break", dest="broken", choices=["restore", "rng", "optimizer", "cursor"])
    args = parser.parse_args()

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    model = build_model(args.dropout)
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (1 + 0.05 * step))
    sampler = GlobalBatchSampler(DATASET_LEN, GLOBAL_BATCH, rank=rank, world_size=world, seed=7)
    loader = DataLoader(dataset(), batch_sampler=sampler)

    session = TrainingSession(
        args.root, model=model, optimizer=optimizer, lr_scheduler=scheduler, sampler=sampler
    )
    fresh_cursor = sampler.state_dict()
    if args.broken != "restore":
        session.restore()
    if args.broken == "optimizer":
        optimizer.state.clear()
    if args.broken == "cursor":
        sampler.load_state_dict(fresh_cursor)
    batches = iter(loader)
    session.restore_rng()
    if args.broken == "rng":
        torch.manual_seed(999)  # the session refuses a run that skips restore_rng
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    with open(out / f"loads.rank{rank}.jsonl", "a") as loads:
        loaded = session.loaded.as_dict() if session.loaded else {"path": None}
        loads.write(json.dumps(loaded) + "\n")
    weight = loss_weight(GLOBAL_BATCH, world)
    with open(out / f"steps.rank{rank}.jsonl", "a") as record:
        while session.step < args.steps:
            try:
                inputs, targets, indices = next(batches)
            except StopIteration:
                batches = iter(loader)
                inputs, targets, indices = next(batches)
            per_sample = (model(inputs) - targets).pow(2).squeeze(1)
            (per_sample.sum() * weight).backward()
            optimizer.step()
            optimizer.zero_grad()
            scheduler.step()

            global_loss = per_sample.detach().sum().reshape(1) / GLOBAL_BATCH
            dist.all_reduce(global_loss)
            gathered: list[list[int]] = [[] for _ in range(world)]
            dist.all_gather_object(gathered, indices.tolist())
            step = session.step + 1
            record.write(
                json.dumps(
                    {
                        "step": step,
                        "world": world,
                        "loss": global_loss.item(),
                        "samples": [i for part in gathered for i in part],
                    }
                )
                + "\n"
            )
            record.flush()
            session.step_done()
            if args.kill_after is not None and session.step == args.kill_after:
                session.wait()  # the step-S checkpoint is committed on every rank
                dist.barrier()
                os.kill(os.getpid(), signal.SIGKILL)
    session.close()
    model_state, optim_state = get_state_dict(
        model, optimizer, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
    )
    if rank == 0:
        torch.save({"model": model_state, "optim": optim_state}, out / "final.pt")
    dist.barrier()
    dist.destroy_process_group()
    # Known issue: about one run in four under CPU load aborted a rank AFTER
    # all of this, during interpreter teardown ("terminate called without an
    # active exception", no Python frame left; torch 2.13, gloo, FSDP2
    # DTensors still referencing the destroyed group). Everything this test
    # checks is written and closed by now, so skip the teardown rather than
    # let an exit-time abort fail the run; the cause is still open.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
