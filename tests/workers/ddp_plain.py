"""A DDP training script written the way the popular public examples are, importing
nothing from Resurgo: the supervised-as-is case.

Started by torchrun (gloo, CPU), or srun-style with ``--init slurm``: one process
per rank, the process group built from ``SLURM_PROCID``/``SLURM_NTASKS`` and
``MASTER_ADDR``/``MASTER_PORT``, the way Lightning's and Megatron's Slurm launches
read them. It keeps its own checkpoint, ``OUT_DIR/ckpt.pt``
(model, optimizer, ``iter_num``), written by rank 0 with ``torch.save`` every
``--eval-interval`` iterations and loaded on start when present, and prints
``iter N: loss X`` lines. Faults for the tests, on one rank at one iteration
(first launch only, so that a relaunch trains through):

- ``--sleep-at N --sleep-rank R --sleep-s S``: rank R sleeps inside iteration N,
  after its forward and before its backward, while its peers wait in DDP's
  backward (native code: no ``torch.distributed`` Python frame);
- ``--eval-pause-s S``: at the first evaluation every rank spends S seconds in
  eval mode, the way a long validation pass does (no optimizer step meanwhile);
- ``--save-pause-s S``: rank 0's first checkpoint write takes S seconds longer,
  while its peers wait in a barrier;
- ``--data-stall-at N --data-stall-s S`` with ``--fault-rank R``: every rank
  draws its batches from a ``DataLoader`` (the same numbers as without one),
  and rank R's loader takes S seconds over iteration N's batch, the way a slow
  file system or a restarting worker stalls it, while its peers wait in DDP's
  backward;
- ``--busy-at N --busy-s S`` with ``--fault-rank R``: rank R keeps a core busy in
  plain Python for S seconds inside iteration N (where it would sleep for
  ``--sleep-at``), the way a rank-0-only upload or a recompile works where no
  hook sees it, while its peers wait in DDP's backward;
- ``--kill-at N`` / ``--raise-at N`` / ``--stop-at N`` with ``--fault-rank R``:
  rank R SIGKILLs itself, raises a RuntimeError, or SIGSTOPs itself in iteration
  N; ``--stop-at`` stops it just before the iteration's ``all_reduce`` of the loss
  (``--reduce-loss``, for logging, as public examples do), where its peers wait;
- ``--oom-at N --oom-cgroup DIR`` with ``--fault-rank R``: rank R moves itself into
  the memory cgroup DIR (made and limited by the test, as root) and allocates
  until the kernel's out-of-memory killer ends it;
- ``--exit-at N --exit-words TEXT`` with ``--fault-rank R``: rank R prints TEXT to
  standard error and exits with status 1, the way a site's own check or a
  vendor library reports a fault it found.

``--save-buffered`` serializes the checkpoint in memory and writes the bytes
itself (as scripts that upload or hash their checkpoints do): a full disk then
raises ``OSError: [Errno 28]``, where ``torch.save`` to a path gives only its
writer's ``unexpected pos`` error.
"""

from __future__ import annotations

import argparse
import io
import os
import signal
import sys
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP


class Batches(torch.utils.data.IterableDataset):  # type: ignore[type-arg]
    """The script's random batches from ``generator``, from iteration ``start`` on; the
    one of iteration ``stall_at`` comes ``stall_s`` seconds late."""

    def __init__(
        self, generator: torch.Generator, start: int, stall_at: int, stall_s: float
    ) -> None:
        self.generator, self.start = generator, start
        self.stall_at, self.stall_s = stall_at, stall_s

    def __iter__(self):  # type: ignore[no-untyped-def]
        iter_num = self.start
        while True:
            if iter_num == self.stall_at:
                node = os.environ.get("SLURMD_NODENAME", "this node")
                print(f"loader of rank {os.environ.get('RANK')} stalling {self.stall_s} s in "
                      f"iter {iter_num} on {node} ({time.time():.3f})", flush=True)  # fmt: skip
                time.sleep(self.stall_s)
            yield torch.randn(16, 32, generator=self.generator)
            iter_num += 1


class SlowToPickle:
    """Pickles as 0 after ``seconds``: a checkpoint write that takes that much longer."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    def __reduce__(self) -> tuple[type[int], tuple[int]]:
        time.sleep(self.seconds)
        return int, (0,)


def exhaust_memory(cgroup: str) -> None:
    """Join the memory cgroup ``cgroup`` and allocate until its limit's OOM kill."""
    with open(os.path.join(cgroup, "cgroup.procs"), "w") as procs:
        procs.write(str(os.getpid()))
    hoard = []
    while True:
        hoard.append(bytearray(16 << 20))  # zero-filled: every page is touched


def spin(seconds: float) -> None:
    """Keep one core busy for ``seconds`` in plain Python: no torch call, no hook."""
    end = time.monotonic() + seconds
    total = 0
    while time.monotonic() < end:
        total += sum(range(1000))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out-dir", required=True)
    parser.add_argument("--max-iters", type=int, default=40)
    parser.add_argument("--eval-interval", type=int, default=10)
    parser.add_argument("--iter-s", type=float, default=0.2)
    parser.add_argument("--sleep-at", type=int, default=-1)
    parser.add_argument("--sleep-rank", type=int, default=-1)
    parser.add_argument("--sleep-s", type=float, default=0.0)
    parser.add_argument("--eval-pause-s", type=float, default=0.0)
    parser.add_argument("--save-pause-s", type=float, default=0.0)
    parser.add_argument("--init", choices=("torchrun", "slurm"), default="torchrun")
    parser.add_argument("--reduce-loss", action="store_true")
    parser.add_argument("--kill-at", type=int, default=-1)
    parser.add_argument("--raise-at", type=int, default=-1)
    parser.add_argument("--stop-at", type=int, default=-1)
    parser.add_argument("--oom-at", type=int, default=-1)
    parser.add_argument("--oom-cgroup", default="")
    parser.add_argument("--exit-at", type=int, default=-1)
    parser.add_argument("--exit-words", default="")
    parser.add_argument("--fault-rank", type=int, default=-1)
    parser.add_argument("--save-buffered", action="store_true")
    parser.add_argument("--data-stall-at", type=int, default=-1)
    parser.add_argument("--data-stall-s", type=float, default=0.0)
    parser.add_argument("--busy-at", type=int, default=-1)
    parser.add_argument("--busy-s", type=float, default=0.0)
    args = parser.parse_args()

    if args.init == "slurm":
        dist.init_process_group(
            backend="gloo",
            init_method=f"tcp://{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}",
            rank=int(os.environ["SLURM_PROCID"]),
            world_size=int(os.environ["SLURM_NTASKS"]),
        )
    else:
        dist.init_process_group(backend="gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    master = rank == 0
    torch.manual_seed(1337)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ckpt_path = os.path.join(args.out_dir, "ckpt.pt")
    iter_num = 0
    resumed = os.path.exists(ckpt_path)
    if resumed:
        checkpoint = torch.load(ckpt_path, map_location="cpu")
        model.load_state_dict(checkpoint["model"])
        optimizer.load_state_dict(checkpoint["optimizer"])
        iter_num = checkpoint["iter_num"]
        if master:
            print(
                f"resuming training from {ckpt_path} at iter {iter_num} ({time.time():.3f})",
                flush=True,
            )
    ddp = DDP(model)
    generator = torch.Generator().manual_seed(rank)
    first_launch = not resumed

    batches = None
    if args.data_stall_s:
        stall_at = args.data_stall_at if first_launch and rank == args.fault_rank else -1
        dataset = Batches(generator, iter_num, stall_at, args.data_stall_s)
        batches = iter(torch.utils.data.DataLoader(dataset, batch_size=None))

    while iter_num < args.max_iters:
        x = next(batches) if batches is not None else torch.randn(16, 32, generator=generator)
        y = x.sum(dim=1, keepdim=True)
        loss = nn.functional.mse_loss(ddp(x), y)
        if first_launch and iter_num == args.sleep_at and rank == args.sleep_rank:
            node = os.environ.get("SLURMD_NODENAME", "this node")
            print(
                f"rank {rank} sleeping {args.sleep_s} s in iter {iter_num} on {node} "
                f"({time.time():.3f})",
                flush=True,
            )
            time.sleep(args.sleep_s)
        faulty = first_launch and rank == args.fault_rank
        if faulty and iter_num == args.busy_at:
            print(f"rank {rank} busy {args.busy_s} s in iter {iter_num} ({time.time():.3f})",
                  flush=True)  # fmt: skip
            spin(args.busy_s)
        if faulty and iter_num == args.kill_at:
            node = os.environ.get("SLURMD_NODENAME", "this node")
            print(f"rank {rank} killing itself in iter {iter_num} on {node} ({time.time():.3f})",
                  flush=True)  # fmt: skip
            os.kill(os.getpid(), signal.SIGKILL)
        if faulty and iter_num == args.raise_at:
            raise RuntimeError(f"rank {rank} fails in iter {iter_num}")
        if faulty and iter_num == args.oom_at:
            node = os.environ.get("SLURMD_NODENAME", "this node")
            print(f"rank {rank} running out of memory in iter {iter_num} on {node} "
                  f"({time.time():.3f})", flush=True)  # fmt: skip
            exhaust_memory(args.oom_cgroup)
        if faulty and iter_num == args.exit_at:
            node = os.environ.get("SLURMD_NODENAME", "this node")
            print(f"rank {rank} exiting in iter {iter_num} on {node} ({time.time():.3f})",
                  flush=True)  # fmt: skip
            print(args.exit_words, file=sys.stderr, flush=True)
            sys.exit(1)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        time.sleep(args.iter_s)
        if args.reduce_loss:
            if faulty and iter_num == args.stop_at:
                node = os.environ.get("SLURMD_NODENAME", "this node")
                print(f"rank {rank} stopping in iter {iter_num} on {node} ({time.time():.3f})",
                      flush=True)  # fmt: skip
                os.kill(os.getpid(), signal.SIGSTOP)
            reduced = loss.detach().clone()
            dist.all_reduce(reduced)
            loss = reduced / world
        iter_num += 1
        if master:
            print(f"iter {iter_num}: loss {loss.item():.4f} ({time.time():.3f})", flush=True)
        if iter_num % args.eval_interval == 0:
            first = iter_num == args.eval_interval and first_launch
            if first and args.eval_pause_s:
                model.eval()
                with torch.no_grad():
                    time.sleep(args.eval_pause_s)
                model.train()
            if master:
                checkpoint = {
                    "model": model.state_dict(),
                    "optimizer": optimizer.state_dict(),
                    "iter_num": iter_num,
                }
                if first and args.save_pause_s:
                    checkpoint["slow"] = SlowToPickle(args.save_pause_s)
                print(f"saving checkpoint to {args.out_dir}", flush=True)
                if args.save_buffered:
                    buffer = io.BytesIO()
                    torch.save(checkpoint, buffer)
                    with open(ckpt_path + ".tmp", "wb") as out:
                        out.write(buffer.getbuffer())
                else:
                    torch.save(checkpoint, ckpt_path + ".tmp")
                os.replace(ckpt_path + ".tmp", ckpt_path)
            dist.barrier()
    if master:
        print(f"done at iter {iter_num} with world {world}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
