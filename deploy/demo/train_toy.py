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
``--report-all-ranks`` makes every rank report its own loss (the mean over
its share of the batch) instead of rank 0 the all-reduced one: the first rank
to go bad names the node. Each report carries the step's total gradient norm,
taken after the gradients are all-reduced, for the supervisor's grad-norm
check.

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

Training-health faults act on the step's data, before its forward and
backward, so the loss and the gradients go bad for real:

- ``nan@STEP[:RANK][!]``: rank RANK computes step STEP on NaN inputs (a
  model or hardware fault, not the data's: it hits that step whatever the
  batch). Its loss and gradients are NaN, and through the gradient
  all-reduce every rank's parameters are NaN from then on.
- ``poison@INDEX``: dataset sample INDEX (0..239) is corrupt: whichever
  rank's share of a batch holds it computes that step with a NaN row, with the
  same consequences. The sample is bad data, so it strikes each time it is
  trained on, in every attempt, and skipping its batch avoids it.
- ``spike@BATCH[+N]``: the global batches numbered BATCH to BATCH+N-1 (N
  defaults to 3; a batch's number is the global cursor before its step over
  the global batch size, counted over all epochs) have targets so far off
  that every rank's loss is about 100 (the untrained model's is about 10):
  a finite loss spike caused by the data, in every attempt, avoided by
  skipping them.

A step-numbered fault fires once per job: a marker under the checkpoint root
remembers it, so the resumed run gets past it; a trailing ``!`` fires it in
every attempt (the same bug again: a crash loop). ``--no-heartbeat`` runs
uninstrumented (no heartbeats: hangs are found from stacks). ``--record DIR``
appends one line per step to ``DIR/steps.jsonl`` on rank 0: ``step``,
``world``, ``cursor`` (global samples consumed before the step), ``samples``
(the global sample indices of the whole batch, in rank order), ``loss`` (the
all-reduced one; NaN when it was), ``rank_losses`` (each rank's own, in rank
order), ``grad_norm``, ``attempt`` (this run's number among the starts
recorded in ``DIR/starts.jsonl``, from 0) and ``restart_count`` (Slurm's, from
``RESURGO_RESTART_COUNT``; null outside Resurgo), so a test can rebuild the
timeline a replayed step belongs to. At the end it writes the final
parameters to ``DIR/final.pt``, for comparing a faulted run with an
unfaulted one.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader, TensorDataset

from agent.train.heartbeat import Heartbeat, Phase
from agent.train.sampler import GlobalBatchSampler, loss_weight
from agent.train.session import TrainingSession

DATASET_LEN = 240
GLOBAL_BATCH = 12
FEATURES = 8
# In a spike every prediction misses its target by this much (a squared error of 100:
# ten times the untrained model's loss, hundreds of times a trained one's).
SPIKE_RESIDUAL = 10.0
SPIKE_BATCHES = 3
_FAULT = re.compile(
    r"^(sigkill|hang|exception|slow|idle|nan)@(\d+)(?::(\d+|\*|[A-Za-z][\w.-]*))?(!?)$"
)
_POISON = re.compile(r"^poison@(\d+)$")
_SPIKE = re.compile(r"^spike@(\d+)(?:\+(\d+))?$")


@dataclass(frozen=True)
class Fault:
    """One ``--fault`` spec."""

    kind: str
    at: int  # the step; for poison the sample index, for spike the first global batch
    rank: int | None  # None: every rank (or the ranks on ``node``)
    always: bool  # fires in every attempt; the data faults always do
    spec: str
    node: str | None = None
    batches: int = 1  # spike: how many global batches from ``at``


def parse_fault(spec: str) -> Fault:
    """The fault a ``--fault`` spec names; ArgumentTypeError, with the grammar, for a bad one."""
    if (poison := _POISON.match(spec)) is not None:
        index = int(poison[1])
        if index >= DATASET_LEN:
            raise argparse.ArgumentTypeError(
                f"--fault {spec!r}: the dataset has samples 0..{DATASET_LEN - 1}, not {index}"
            )
        return Fault("poison", index, None, True, spec)
    if (spike := _SPIKE.match(spec)) is not None:
        batches = SPIKE_BATCHES if spike[2] is None else int(spike[2])
        if batches < 1:
            raise argparse.ArgumentTypeError(
                f"--fault {spec!r}: a spike lasts at least one batch (spike@BATCH+N, N >= 1)"
            )
        return Fault("spike", int(spike[1]), None, True, spec, batches=batches)
    match = _FAULT.match(spec)
    if match is None:
        raise argparse.ArgumentTypeError(
            f"--fault {spec!r}: expected KIND@STEP[:RANK][!] with KIND one of "
            "sigkill, hang, exception, slow, idle, nan (e.g. sigkill@12:3), "
            f"poison@INDEX (a sample 0..{DATASET_LEN - 1}) or spike@BATCH[+N]"
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
        poisoned = [fault.at for fault in self._faults if fault.kind == "poison"]
        self._poisoned = torch.tensor(poisoned, dtype=torch.int64)

    def _fires(self, fault: Fault, step: int) -> bool:
        """Whether ``fault`` fires now at ``step``; marks it fired for the resumed runs."""
        if fault.at != step:
            return False
        name = re.sub(r"[^\w@:.-]", "_", fault.spec)
        marker = self._markers / f"{name}.rank{self._rank}"
        if not fault.always and marker.exists():
            return False
        self._markers.mkdir(parents=True, exist_ok=True)
        marker.touch()
        node = os.environ.get("SLURMD_NODENAME", "?")
        print(
            f"toy: injecting {fault.kind} at step {step} on {node} at {time.time():.3f}",
            flush=True,
        )
        return True

    def corrupt_inputs(
        self, step: int, indices: torch.Tensor, inputs: torch.Tensor
    ) -> torch.Tensor:
        """This rank's inputs of ``step`` as the faults leave them: a poisoned sample's
        row NaN, every row NaN under a ``nan`` fault of the step."""
        bad = torch.isin(indices, self._poisoned)
        if bool(bad.any()):
            print(
                f"toy: rank {self._rank} trains poisoned sample(s) {indices[bad].tolist()} "
                f"at step {step}",
                flush=True,
            )
        fired = [
            fault for fault in self._faults if fault.kind == "nan" and self._fires(fault, step)
        ]
        if fired:
            bad[:] = True
        if not bool(bad.any()):
            return inputs
        corrupt = inputs.clone()
        corrupt[bad] = math.nan
        return corrupt

    def corrupt_targets(
        self, cursor: int, targets: torch.Tensor, predictions: torch.Tensor
    ) -> torch.Tensor:
        """The targets of the global batch at ``cursor``: moved, in a spike, SPIKE_RESIDUAL
        away from the predictions.

        A fixed miss, not a multiple of the batch's own loss: this noise-free
        regression converges a hundredfold within a few steps, and a spike must
        stand out against the losses of the steps before it, as a real one does."""
        batch = cursor // GLOBAL_BATCH
        if not any(
            fault.kind == "spike" and fault.at <= batch < fault.at + fault.batches
            for fault in self._faults
        ):
            return targets
        if self._rank == 0:
            print(f"toy: global batch {batch} is a loss spike", flush=True)
        return predictions + SPIKE_RESIDUAL

    def after_step(self, step: int, heartbeat: Heartbeat) -> None:
        """Fire the process faults (sigkill, hang, exception, slow, idle) of ``step``."""
        for fault in self._faults:
            if fault.kind in ("nan", "poison", "spike") or not self._fires(fault, step):
                continue
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
    parser.add_argument(
        "--report-all-ranks", action="store_true", help="every rank reports its own loss"
    )
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
        model=model,
        optimizer=optimizer,
        sampler=sampler,
        heartbeat=heartbeat,
        report_all_ranks=args.report_all_ranks,
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
        record = _open_record(args.record, world, start, session.resumed_from)
    while session.step < args.steps:
        try:
            inputs, targets, indices = next(batches)
        except StopIteration:
            batches = iter(loader)
            inputs, targets, indices = next(batches)
        cursor = sampler.consumed_total
        inputs = faults.corrupt_inputs(session.step + 1, indices, inputs)
        with session.compute():  # this rank's own work, before it waits for its peers
            predictions = model(inputs)
            targets = faults.corrupt_targets(cursor, targets, predictions.detach())
            per_sample = (predictions - targets).pow(2).squeeze(1)
            (per_sample.sum() * weight).backward()
            time.sleep(args.step_s + faults.extra_s)  # the rest of a real step's compute
        if args.model == "linear":
            for parameter in model.parameters():
                assert parameter.grad is not None
                dist.all_reduce(parameter.grad)
        grad_norm = _total_grad_norm(model)
        optimizer.step()
        optimizer.zero_grad()
        loss = per_sample.detach().sum().reshape(1) / GLOBAL_BATCH
        dist.all_reduce(loss)
        own_loss = per_sample.detach().mean().item()
        shares: list[tuple[list[int], float]] = [([], 0.0) for _ in range(world)]
        dist.all_gather_object(shares, (indices.tolist(), own_loss))
        reported = own_loss if args.report_all_ranks else loss.item()
        saved = session.step_done(loss=reported, grad_norm=grad_norm)
        # The step's record before its checkpoint's commit: a stop that lands once the
        # commit is durable (the resume starts after this step) must not lose its line.
        if record is not None:
            line = {
                "step": session.step,
                "world": world,
                "cursor": cursor,
                "samples": [i for part, _ in shares for i in part],
                "loss": loss.item(),
                "rank_losses": [part_loss for _, part_loss in shares],
                "grad_norm": grad_norm,
                "time": time.time(),
                **record.identity,
            }
            record.write(line)
        if saved is not None:
            with heartbeat.phase(Phase.CHECKPOINT):
                session.wait()
            if rank == 0:  # one report per checkpoint is enough
                heartbeat.checkpoint_committed(session.step, saved.path)
        if rank == 0:
            print(f"toy: step {session.step} loss {loss.item():.6f}", flush=True)
        faults.after_step(session.step, heartbeat)
    session.close()
    _finish(model, optimizer, args, rank, world, record)


@dataclass
class _Record:
    """Rank 0's ``steps.jsonl``, and what every line says about this run (its attempt)."""

    file: TextIO
    identity: dict[str, int | None]

    def write(self, line: dict[str, Any]) -> None:
        # A NaN loss is written as the bare NaN that Python's json reads back: the
        # record of a poisoned run must show the NaN, not drop the line.
        self.file.write(json.dumps(line) + "\n")
        self.file.flush()


def _open_record(directory: Path, world: int, start: int, resumed_from: object) -> _Record:
    """Count this run among ``starts.jsonl``'s and open ``steps.jsonl`` for appending.

    The count is the attempt: ``RESURGO_RESTART_COUNT`` counts Slurm requeues
    only, not the relaunches within one allocation."""
    directory.mkdir(parents=True, exist_ok=True)
    starts = directory / "starts.jsonl"
    attempt = len(starts.read_text().splitlines()) if starts.exists() else 0
    restarts = os.environ.get("RESURGO_RESTART_COUNT", "")
    identity = {
        "attempt": attempt,
        "restart_count": int(restarts) if restarts.isdigit() else None,
    }
    with starts.open("a") as out:
        at = {"world": world, "start_step": start, "resumed_from": str(resumed_from or "")}
        out.write(json.dumps({**identity, **at, "time": time.time()}) + "\n")
    file = (directory / "steps.jsonl").open("a")  # open for the run; each line is flushed
    return _Record(file, identity)


def _total_grad_norm(model: nn.Module) -> float:
    """The L2 norm of all gradients together, after they are reduced; NaN when one is.

    Under FSDP each rank holds a shard of each gradient: the norm of the
    shards is combined across ranks (a collective every rank takes part in)."""
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    norm = torch.nn.utils.get_total_norm(grads)
    if isinstance(norm, DTensor):
        norm = norm.full_tensor()
    return norm.item()


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
