"""A toy multi-node torchrun job: every rank all-reduces its rank number over gloo.

Run by deploy/demo/run through sbatch/srun/torchrun on the local Slurm cluster;
prints one line per rank and, on rank 0, the sum and whether it is right.
"""

import os
import socket

import torch
import torch.distributed as dist


def main() -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    value = torch.tensor([float(rank)])
    dist.all_reduce(value)
    node = os.environ.get("SLURMD_NODENAME", socket.gethostname())
    print(f"rank {rank}/{world} on {node}: all_reduce sum = {value.item():.0f}", flush=True)
    dist.barrier()
    if rank == 0:
        expected = world * (world - 1) / 2
        verdict = "OK" if value.item() == expected else "WRONG"
        print(f"RESULT world={world} sum={value.item():.0f} expected={expected:.0f} {verdict}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
