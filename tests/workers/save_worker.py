"""Rank program for tests/integration/test_async_save.py, started by torchrun (gloo, CPU).

``save_worker.py suite ROOT OUT``: every Checkpointer behaviour that needs real
ranks, in one process group (torch start-up dominates the test time); each rank
writes what it saw to ``OUT/rank<r>.json`` and the test asserts on it and on
the files under ROOT.

``save_worker.py crash ROOT OUT MIB``: commit steps 1-3 (MIB MiB per rank,
retention keeping 2), start saving step 4, write this rank's pid to
``OUT/saved.<r>`` once save() returned, then keep "training" until the test
kills it.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict

from agent.checkpoint.format import StateKind
from agent.checkpoint.retention import RetentionPolicy, apply_retention
from agent.checkpoint.save import Checkpointer, SaveResult, WhenBusy
from agent.wire.errors import CheckpointError

CONTENTS = (StateKind.MODEL, StateKind.OPTIMIZER, StateKind.EXTRA)
TIMEOUT_S = 60.0


def _result(result: SaveResult) -> dict[str, Any]:
    return {
        "step": result.step,
        "path": str(result.path),
        "mode": result.mode.value,
        "stall_s": result.stall_s,
        "reason": result.reason,
    }


def _tensors(tree: Any, prefix: str = "") -> dict[str, torch.Tensor]:
    """Flatten every tensor of a nested state dict to dotted keys."""
    if isinstance(tree, torch.Tensor):
        return {prefix: tree}
    items = (
        tree.items()
        if isinstance(tree, dict)
        else enumerate(tree)
        if isinstance(tree, list | tuple)
        else ()
    )
    flat: dict[str, torch.Tensor] = {}
    for key, value in items:
        flat.update(_tensors(value, f"{prefix}.{key}" if prefix else str(key)))
    return flat


def _clone_tree(tree: Any) -> Any:
    if isinstance(tree, torch.Tensor):
        return tree.detach().clone()
    if isinstance(tree, dict):
        return {key: _clone_tree(value) for key, value in tree.items()}
    if isinstance(tree, list):
        return [_clone_tree(value) for value in tree]
    return tree


def _training_state(
    rank: int, rank_mib: float
) -> tuple[nn.Module, torch.optim.Optimizer, torch.Tensor]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 64))
    optimizer = torch.optim.Adam(model.parameters(), lr=0.1)
    _train_step(model, optimizer)  # materialise Adam's exp_avg / exp_avg_sq
    # Keyed by rank below: DCP would keep one copy of identical replicated keys.
    shard = torch.full((int(rank_mib * (1 << 20)) // 4,), float(rank), dtype=torch.float32)
    return model, optimizer, shard


def _train_step(model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    optimizer.zero_grad()
    model(torch.randn(8, 64)).square().mean().backward()
    optimizer.step()


def _state(
    model: nn.Module, optimizer: torch.optim.Optimizer, shard: torch.Tensor, rank: int
) -> dict[str, Any]:
    model_sd, optim_sd = get_state_dict(model, optimizer)
    return {"model": model_sd, "optim": optim_sd, f"shard_rank{rank}": shard}


def suite(root: Path, out: Path) -> None:
    rank = dist.get_rank()
    report: dict[str, Any] = {"rank": rank}

    # 1. async save, then mutate the live tensors the way training does.
    model, optimizer, shard = _training_state(rank, rank_mib=16)
    main = Checkpointer(root / "main", collective_timeout_s=TIMEOUT_S)
    state = _state(model, optimizer, shard, rank)
    snapshot = _clone_tree(state)
    first = main.save(1, state, CONTENTS, user={"run": "suite"})
    busy_after_return = main.busy
    steps_while_writing = 0
    while main.busy and steps_while_writing < 1000:
        _train_step(model, optimizer)
        shard.add_(1.0)
        steps_while_writing += 1
    _train_step(model, optimizer)  # at least one mutation even if the write was instant
    shard.add_(1.0)
    main.wait()
    report["first"] = _result(first)
    report["busy_after_return"] = busy_after_return
    report["steps_while_writing"] = steps_while_writing
    stats = main.stats
    report["first_stats"] = (
        None if stats is None else {"write_s": stats.write_s, "mode": stats.mode}
    )
    committed = main.last_committed
    report["last_committed"] = None if committed is None else [committed.step, str(committed.path)]
    loaded = _clone_tree(snapshot)
    for tensor in _tensors(loaded).values():
        tensor.zero_()
    dcp.load(loaded, checkpoint_id=first.path)
    expected, got = _tensors(snapshot), _tensors(loaded)
    live = _tensors(_state(model, optimizer, shard, rank))
    report["loaded_equals_snapshot"] = expected.keys() == got.keys() and all(
        torch.equal(expected[key], got[key]) for key in expected
    )
    report["live_differs_from_snapshot"] = any(
        not torch.equal(expected[key], live[key]) for key in expected
    )

    # 2. an uncommitted leftover in step-5 is renamed aside; 3. a committed one is refused.
    if rank == 0:
        leftover = root / "main" / "step-5"
        leftover.mkdir()
        (leftover / ".metadata").write_bytes(b"stale metadata from a crashed save")
        (leftover / "__0_0.distcp").write_bytes(b"half a shard")
    dist.barrier()
    report["leftover"] = _result(main.save(5, _state(model, optimizer, shard, rank), CONTENTS))
    main.wait()
    try:
        main.save(5, _state(model, optimizer, shard, rank), CONTENTS)
        report["overwrite_error"] = None
    except CheckpointError as error:
        report["overwrite_error"] = str(error)
    main.close()

    # 4. SKIP and WAIT while a save is in flight. after_commit (rank 0, background)
    # blocks on a gate, which holds every rank's save in flight deterministically.
    gate = threading.Event()

    def gated(_: Path) -> None:
        gate.wait(TIMEOUT_S)

    skipper = Checkpointer(
        root / "skip", when_busy=WhenBusy.SKIP, after_commit=gated, collective_timeout_s=TIMEOUT_S
    )
    report["skip_first"] = _result(
        skipper.save(10, _state(model, optimizer, shard, rank), CONTENTS)
    )
    report["skip_second"] = _result(
        skipper.save(11, _state(model, optimizer, shard, rank), CONTENTS)
    )
    gate.set()
    skipper.close()
    report["skip_committed"] = skipper.last_committed.step if skipper.last_committed else None

    gate.clear()
    waiter = Checkpointer(
        root / "wait", when_busy=WhenBusy.WAIT, after_commit=gated, collective_timeout_s=TIMEOUT_S
    )
    report["wait_first"] = _result(waiter.save(20, _state(model, optimizer, shard, rank), CONTENTS))
    if rank == 0:
        threading.Timer(1.0, gate.set).start()
    report["wait_second"] = _result(
        waiter.save(21, _state(model, optimizer, shard, rank), CONTENTS)
    )
    waiter.close()
    report["wait_committed"] = waiter.last_committed.step if waiter.last_committed else None

    # 5. no host memory for a staged copy: synchronous fallback, still committed.
    tight = Checkpointer(root / "mem", available_memory=lambda: 1, collective_timeout_s=TIMEOUT_S)
    report["memory"] = _result(tight.save(7, _state(model, optimizer, shard, rank), CONTENTS))
    tight.close()
    report["memory_committed"] = tight.last_committed.step if tight.last_committed else None

    (out / f"rank{rank}.json").write_text(json.dumps(report))


def crash(root: Path, out: Path, rank_mib: float) -> None:
    rank = dist.get_rank()
    model, optimizer, shard = _training_state(rank, rank_mib=rank_mib)
    # Retention keeps 2: steps 1-3 commit (step 1 is pruned), then step 4 is
    # killed mid-write and must leave the 2 kept checkpoints valid.
    policy = RetentionPolicy(keep_last=2, grace_s=0.0)
    checkpointer = Checkpointer(
        root,
        collective_timeout_s=TIMEOUT_S,
        after_commit=lambda _path: apply_retention(root, policy, now_s=time.time()),
    )
    for step in (1, 2, 3):
        checkpointer.save(step, _state(model, optimizer, shard, rank), CONTENTS)
        checkpointer.wait()
        _train_step(model, optimizer)
    checkpointer.save(4, _state(model, optimizer, shard, rank), CONTENTS)
    (out / f"saved.{rank}").write_text(str(os.getpid()))
    deadline = time.monotonic() + 30.0
    while time.monotonic() < deadline:  # the test kills us long before this
        _train_step(model, optimizer)
        time.sleep(0.01)


def main(argv: list[str]) -> None:
    warnings.simplefilter("ignore")  # DCP's FutureWarnings would bury a real failure
    dist.init_process_group("gloo")
    scenario, root, out = argv[0], Path(argv[1]), Path(argv[2])
    try:
        if scenario == "suite":
            suite(root, out)
        elif scenario == "crash":
            crash(root, out, float(argv[3]))
        else:
            raise SystemExit(f"unknown scenario {scenario!r}")
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1:])
