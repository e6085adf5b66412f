"""A small real training job for the demo and the recovery tests: torchrun, gloo, CPU.

Every rank trains on its share of each global batch (:class:`GlobalBatchSampler`)
through :class:`TrainingSession`, which checkpoints every ``--save-every``
steps (waiting for each commit, so the commit is reported at once). The model
is a linear regression with its gradients all-reduced by hand
(``--model linear``, the default: fast) or a two-layer MLP with dropout under
FSDP2 (``--model fsdp``: sharded state, resharded on a resize). Rank 0 tells
its node agent about every step (loss and data cursor) and every committed
checkpoint, and prints one line per step; every rank times its forward and
backward (``session.compute()``), so the supervisor can name a straggler.

Fault injection, ``--fault KIND@STEP[:RANK][!]`` (repeatable; RANK defaults
to 0, ``*`` means every rank, a node name such as ``node2`` the ranks on that
node, whatever ranks the rendezvous gave them): when rank RANK finishes step
STEP it

- ``sigkill``: SIGKILLs itself (a node fault: the OOM killer, a bad DIMM);
- ``hang``: SIGSTOPs itself (a hang: no progress, no exit);
- ``exception``: raises (a bug in the training code);
- ``slow``: from then on computes 1 s longer per step (a straggler: the
  other ranks wait for it in every collective);
- ``idle``: stops training and waits, reporting the eval phase, until it is
  stopped (a known point at which to inject a fault from outside).

A fault fires once per job: a marker under the checkpoint root remembers it,
so the resumed run gets past it; a trailing ``!`` fires it in every attempt
(the same bug again: a crash loop). ``--no-heartbeat`` runs uninstrumented
(no heartbeats: hangs are found from stacks). ``--record DIR`` appends every
step (world size, loss, the global sample indices in rank order) to
``DIR/steps.jsonl`` on rank 0 and writes the final parameters to
``DIR/final.pt``, for comparing a faulted run with an unfaulted one.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path

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
_FAULT = re.compile(r"^(sigkill|hang|exception|slow|idle)@(\d+)(?::(\d+|\*|[A-Za-z][\w.-]*))?(!?)$")


@dataclass(frozen=True)
class Fault:
    """One ``--fault`` spec."""

    kind: str
    step: int
    rank: int | None  # None: every rank (or the ranks on ``node``)
    always: bool
    spec: str
    node: str | None = None


def parse_fault(spec: str) -> Fault:
    match = _FAULT.match(spec)
    if match is None:
        raise argparse.ArgumentTypeError(
            f"--fault {spec!r}: expected KIND@STEP[:RANK][!] with KIND one of "
            "sigkill, hang, exception, slow, idle (e.g. sigkill@12:3)"
        )
    kind, step, rank, always = match.groups()
    if rank is not None and not rank.isdigit() and rank != "*":
        return Fault(kind, int(step), None, bool(always), spec, node=rank)
    which = None if rank == "*" else int(rank or 0)
    return Fault(kind, int(step), which, bool(always), spec)


def dataset() -> TensorDataset:
    generator = torch.Generator().manual_seed(1234)
    inputs = torch.randn(DATASET_LEN, FEATURES, generator=generator)
    targets = inputs @ torch.randn(FEATURES, 1, generator=generator)
    return TensorDataset(inputs, targets, torch.arange(DATASET_LEN))


def build_model(kind: str, world: int) -> nn.Module:
    torch.manual_seed(0)  # the same initial parameters on every rank
    if kind == "linear":
        return nn.Linear(FEATURES, 1)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    model = nn.Sequential(nn.Linear(FEATURES, 32), nn.ReLU(), nn.Dropout(0.1), nn.Linear(32, 1))
    mesh = init_device_mesh("cpu", (world,))
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


class Faults:
    """The ``--fault`` specs of this rank; each fires once per job unless marked ``!``."""

    def __init__(self, faults: list[Fault], rank: int, root: Path) -> None:
        here = os.environ.get("SLURMD_NODENAME")
        self._faults = [
            fault for fault in faults if fault.rank in (None, rank) and fault.node in (None, here)
        ]
        self._markers = root / ".resurgo-faults"
        self._rank = rank
        self.extra_s = 0.0

    def after_step(self, step: int, heartbeat: Heartbeat) -> None:
        for fault in self._faults:
            if fault.step != step:
                continue
            name = re.sub(r"[^\w@:.-]", "_", fault.spec)
            marker = self._markers / f"{name}.rank{self._rank}"
            if not fault.always and marker.exists():
                continue
            self._markers.mkdir(parents=True, exist_ok=True)
            marker.touch()
            node = os.environ.get("SLURMD_NODENAME", "?")
            print(
                f"toy: injecting {fault.kind} at step {step} on {node} at {time.time():.3f}",
                flush=True,
            )
            if fault.kind == "sigkill":
                os.kill(os.getpid(), signal.SIGKILL)
            elif fault.kind == "hang":
                os.kill(os.getpid(), signal.SIGSTOP)
            elif fault.kind == "exception":
                raise RuntimeError(f"toy: injected failure at step {step}")
            elif fault.kind == "slow":
                self.extra_s += 1.0
            elif fault.kind == "idle":
                while True:
                    heartbeat.beat(step, Phase.EVAL)
                    time.sleep(1.0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--save-every", type=int, default=5)
    parser.add_argument("--step-s", type=float, default=0.2, help="extra time per step")
    parser.add_argument("--model", choices=["linear", "fsdp"], default="linear")
    parser.add_argument("--fault", type=parse_fault, action="append", default=[])
    parser.add_argument("--no-heartbeat", action="store_true", help="run uninstrumented")
    parser.add_argument("--record", type=Path, help="write steps.jsonl and final.pt here")
    args = parser.parse_args()

    os.environ.setdefault("RESURGO_CKPT_EVERY_STEPS", str(args.save_every))
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    heartbeat = Heartbeat(None) if args.no_heartbeat else Heartbeat.from_env()
    heartbeat.beat(0, Phase.INIT)
    model = build_model(args.model, world)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    sampler = GlobalBatchSampler(DATASET_LEN, GLOBAL_BATCH, rank=rank, world_size=world, seed=3)
    loader = DataLoader(dataset(), batch_sampler=sampler)
    session = TrainingSession(
        model=model, optimizer=optimizer, sampler=sampler, heartbeat=heartbeat
    )
    faults = Faults(args.fault, rank, session.root)
    start = session.restore()
    batches = iter(loader)
    session.restore_rng()
    if rank == 0:
        origin = f" from {session.resumed_from}" if session.resumed_from else ""
        print(
            f"toy: world {world}, starting at step {start}{origin} at {time.time():.3f}",
            flush=True,
        )
    weight = loss_weight(GLOBAL_BATCH, world)
    record = None
    if args.record is not None and rank == 0:
        args.record.mkdir(parents=True, exist_ok=True)
        record = open(args.record / "steps.jsonl", "a")  # noqa: SIM115 - open for the run
    while session.step < args.steps:
        try:
            inputs, targets, indices = next(batches)
        except StopIteration:
            batches = iter(loader)
            inputs, targets, indices = next(batches)
        with session.compute():  # this rank's own work, before it waits for its peers
            per_sample = (model(inputs) - targets).pow(2).squeeze(1)
            (per_sample.sum() * weight).backward()
            time.sleep(args.step_s + faults.extra_s)  # the rest of a real step's compute
        if args.model == "linear":
            for parameter in model.parameters():
                assert parameter.grad is not None
                dist.all_reduce(parameter.grad)
        optimizer.step()
        optimizer.zero_grad()
        loss = per_sample.detach().sum().reshape(1) / GLOBAL_BATCH
        dist.all_reduce(loss)
        samples: list[list[int]] = [[] for _ in range(world)]
        dist.all_gather_object(samples, indices.tolist())
        saved = session.step_done(loss=loss.item())
        if saved is not None:
            with heartbeat.phase(Phase.CHECKPOINT):
                session.wait()
            if rank == 0:  # one report per checkpoint is enough
                heartbeat.checkpoint_committed(session.step, saved.path)
        if record is not None:
            flat = [i for part in samples for i in part]
            line = {"step": session.step, "world": world, "loss": loss.item(), "samples": flat,
                    "time": time.time()}  # fmt: skip
            record.write(json.dumps(line) + "\n")
            record.flush()
        if rank == 0:
            print(f"toy: step {session.step} loss {loss.item():.6f}", flush=True)
        faults.after_step(session.step, heartbeat)
    session.close()
    _finish(model, optimizer, args, rank, world, record)


def _finish(model: nn.Module, optimizer: torch.optim.Optimizer, args: argparse.Namespace,
            rank: int, world: int, record: object) -> None:  # fmt: skip
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    if args.record is not None:  # a collective: every rank takes part, rank 0 writes
        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        model_state, _ = get_state_dict(model, optimizer, options=options)
        if rank == 0:
            torch.save(model_state, args.record / "final.pt")
    dist.barrier()
    if rank == 0:
        print(f"toy: done at step {args.steps} with world {world}", flush=True)
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    # torch 2.13 with gloo and FSDP2 DTensors can abort a rank during interpreter
    # teardown, after everything is written ("terminate called without an active
    # exception"); leave without that teardown so a finished run reads as finished.
    os._exit(0)


if __name__ == "__main__":
    main()
