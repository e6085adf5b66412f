"""An FSDP2 training script written the way public examples are (torchtitan's loop and
checkpointing, cut down), importing nothing from Resurgo: the supervised-as-is case
for sharded training.

Started by torchrun (gloo, CPU): ``fully_shard`` on a CPU device mesh, AdamW, and
its own DCP checkpoints, ``OUT_DIR/step-<N>`` every ``--save-every`` steps
(``get_state_dict`` + ``dcp.save``, or ``dcp.async_save`` on a gloo group of its
own with ``--async-save``, as torchtitan does). On start it resumes from the
newest ``step-<N>`` whose ``.metadata`` exists (DCP's coordinator writes it last,
so only a complete save has one), through ``dcp.load`` and ``set_state_dict``,
and prints ``resuming from PATH at step N``. It prints ``step N: loss X`` lines
and ``done at step N with world W``.

``--kill-at N --fault-rank R``: rank R SIGKILLs itself in step N, first launch
only, so that a relaunch trains through.
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import time
from concurrent.futures import Future

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard


def newest_checkpoint(out_dir: str) -> str | None:
    """The newest complete ``step-<N>`` directory under ``out_dir`` (None: none)."""
    steps = []
    for name in os.listdir(out_dir) if os.path.isdir(out_dir) else ():
        match = re.fullmatch(r"step-(\d+)", name)
        if match and os.path.exists(os.path.join(out_dir, name, ".metadata")):
            steps.append(int(match.group(1)))
    return os.path.join(out_dir, f"step-{max(steps)}") if steps else None


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out-dir", required=True)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--save-every", type=int, default=10)
    parser.add_argument("--step-s", type=float, default=0.1)
    parser.add_argument("--async-save", action="store_true")
    parser.add_argument("--kill-at", type=int, default=-1)
    parser.add_argument("--fault-rank", type=int, default=-1)
    args = parser.parse_args()

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    master = rank == 0
    torch.manual_seed(1337)
    model = nn.Sequential(
        nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 1)
    )
    mesh = init_device_mesh("cpu", (world,))
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    # Background saves run their collectives on a group of their own, so that they
    # never interleave with training's on the default group.
    save_group = dist.new_group(backend="gloo") if args.async_save else None
    pending: Future[None] | None = None

    step = 0
    resume = newest_checkpoint(args.out_dir)
    if resume is not None:
        model_state, optim_state = get_state_dict(model, optimizer)
        state = {"model": model_state, "optimizer": optim_state, "step": 0}
        dcp.load(state, checkpoint_id=resume)
        set_state_dict(
            model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"]
        )
        step = state["step"]
        if master:
            print(f"resuming from {resume} at step {step} ({time.time():.3f})", flush=True)
    first_launch = resume is None
    generator = torch.Generator().manual_seed(rank * 1000 + step)

    while step < args.steps:
        x = torch.randn(16, 32, generator=generator)
        y = x.sum(dim=1, keepdim=True)
        loss = nn.functional.mse_loss(model(x), y)
        if first_launch and rank == args.fault_rank and step == args.kill_at:
            node = os.environ.get("SLURMD_NODENAME", "this node")
            print(f"rank {rank} killing itself in step {step} on {node} ({time.time():.3f})",
                  flush=True)  # fmt: skip
            os.kill(os.getpid(), signal.SIGKILL)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        time.sleep(args.step_s)
        step += 1
        if master:
            print(f"step {step}: loss {loss.item():.4f} ({time.time():.3f})", flush=True)
        if step % args.save_every == 0:
            model_state, optim_state = get_state_dict(model, optimizer)
            state = {"model": model_state, "optimizer": optim_state, "step": step}
            checkpoint_id = os.path.join(args.out_dir, f"step-{step}")
            if args.async_save:
                if pending is not None:
                    pending.result()  # one save in flight at a time
                pending = dcp.async_save(
                    state, checkpoint_id=checkpoint_id, process_group=save_group
                )
            else:
                dcp.save(state, checkpoint_id=checkpoint_id)
    if pending is not None:
        pending.result()
    if master:
        print(f"done at step {step} with world {world}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
