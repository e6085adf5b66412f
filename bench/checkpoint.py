"""Checkpoint benchmark: training stall per save, and validation throughput.

Spawns ``--ranks`` CPU processes (gloo) holding ``--gib`` GiB of model + Adam
state in total, each rank its own shard (keys carry the rank, so DCP writes
every byte once). Measures, as medians over ``--saves`` saves, the time the
training loop is blocked per save for:

- async: Resurgo's ``Checkpointer.save`` returning (staging only);
- sync: a plain synchronous ``dcp.save``;
- naive: every rank sends its full state to rank 0, which ``torch.save``s one
  file and fsyncs it; everyone waits until rank 0 is done.

A stall is the slowest rank's: the next collective waits for it. Then it
validates the last Resurgo checkpoint at each level and compares with a raw
sequential read of the same files, dropping the page cache before every timed
read when it can (root with a writable /proc/sys/vm/drop_caches).

    python -m bench.checkpoint --gib 1 --ranks 4

The last line printed is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as mp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict

if not __package__:
    # As a script, bench/ comes first on sys.path and bench/agent.py hides the
    # agent package.
    sys.exit("run the benchmarks from the repository root as modules: python -m bench.checkpoint")

from agent.checkpoint import format as fmt
from agent.checkpoint.files import iter_chunks
from agent.checkpoint.save import Checkpointer, SaveMode

WIDTH = 2048  # one Linear(2048, 2048) is 16 MiB of fp32 weights, 48 MiB with Adam state
BYTES_PER_LAYER_WITH_ADAM = 3 * (WIDTH * WIDTH + WIDTH) * 4
CONTENTS = (fmt.StateKind.MODEL, fmt.StateKind.OPTIMIZER)


def _say(message: str) -> None:
    print(message, flush=True)


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def _build(rank: int, layers: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(rank)
    # The rank in the module name keeps every rank's keys distinct, as a sharded
    # model's would be; DCP would otherwise dedup them as replicated.
    model = nn.ModuleDict(
        {f"rank{rank}": nn.Sequential(*(nn.Linear(WIDTH, WIDTH) for _ in range(layers)))}
    )
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-4)
    for param in model.parameters():
        param.grad = torch.randn_like(param) * 1e-3
    optimizer.step()  # materialise exp_avg and exp_avg_sq
    return model, optimizer


def _state(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    model_sd, optim_sd = get_state_dict(model, optimizer)
    return {"model": model_sd, "optim": optim_sd}


def _slowest(seconds: float) -> float:
    value = torch.tensor([seconds], dtype=torch.float64)
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return float(value.item())


def _timed(action: Callable[[], Any]) -> float:
    dist.barrier()
    started = time.perf_counter()
    action()
    return _slowest(time.perf_counter() - started)


def _remove(path: Path) -> None:
    dist.barrier()
    if dist.get_rank() == 0:
        shutil.rmtree(path, ignore_errors=True)
    dist.barrier()


def _naive_save(state: dict[str, Any], target: Path) -> None:
    """All ranks send their full state to rank 0, which writes one file."""
    rank, world = dist.get_rank(), dist.get_world_size()
    tensors = _flat_tensors(state)
    gathered: list[list[torch.Tensor]] = [[] for _ in range(world)]
    for tensor in tensors:
        bucket = [torch.empty_like(tensor) for _ in range(world)] if rank == 0 else None
        dist.gather(tensor.contiguous(), bucket, dst=0)
        if bucket is not None:
            for source, received in enumerate(bucket):
                gathered[source].append(received)
    if rank == 0:
        with open(target, "wb") as handle:
            torch.save({f"rank{r}": ts for r, ts in enumerate(gathered)}, handle)
            handle.flush()
            os.fsync(handle.fileno())
    dist.barrier()  # the other ranks' training waits for rank 0's write


def _flat_tensors(tree: Any) -> list[torch.Tensor]:
    if isinstance(tree, torch.Tensor):
        return [tree]
    if isinstance(tree, dict):
        return [t for key in sorted(tree, key=str) for t in _flat_tensors(tree[key])]
    if isinstance(tree, list | tuple):
        return [t for item in tree for t in _flat_tensors(item)]
    return []


def _rank_main(
    rank: int, world: int, port: int, layers: int, saves: int, work: str, results: Any
) -> None:
    warnings.simplefilter("ignore")
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    root = Path(work)
    model, optimizer = _build(rank, layers)
    state = _state(model, optimizer)
    local_bytes = sum(t.numel() * t.element_size() for t in _flat_tensors(state))
    total = torch.tensor([local_bytes], dtype=torch.int64)
    dist.all_reduce(total)

    checkpointer = Checkpointer(root / "resurgo")
    async_stalls, write_times = [], []
    for step in range(saves):
        outcome: dict[str, Any] = {}
        stall = _timed(
            lambda s=step, o=outcome: o.update(
                result=checkpointer.save(s, _state(model, optimizer), CONTENTS)
            )
        )
        assert outcome["result"].mode is SaveMode.ASYNC, outcome["result"]
        checkpointer.wait()
        async_stalls.append(stall)
        write_times.append(checkpointer.stats.write_s if checkpointer.stats else float("nan"))
        if step < saves - 1:  # keep the last one for validation
            _remove(root / "resurgo" / fmt.step_dir_name(step))
    checkpointer.close()

    sync_times = []
    for step in range(saves):
        target = root / "sync" / fmt.step_dir_name(step)
        sync_times.append(
            _timed(lambda t=target: dcp.save(_state(model, optimizer), checkpoint_id=t))
        )
        _remove(target)

    naive_times = []
    (root / "naive").mkdir(parents=True, exist_ok=True)
    for step in range(saves):
        target = root / "naive" / f"step-{step}.pt"
        naive_times.append(_timed(lambda t=target: _naive_save(_state(model, optimizer), t)))
        if rank == 0:
            target.unlink(missing_ok=True)
        dist.barrier()

    if rank == 0:
        results.update(
            state_bytes=int(total.item()),
            async_stalls=async_stalls,
            write_times=write_times,
            sync_times=sync_times,
            naive_times=naive_times,
            last_checkpoint=str(root / "resurgo" / fmt.step_dir_name(saves - 1)),
        )
    dist.destroy_process_group()


def drop_caches() -> bool:
    """Drop the page cache (root only); False when this machine does not allow it."""
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as handle:
            handle.write("3\n")
    except OSError:
        return False
    return True


def _read_all(paths: list[Path]) -> None:
    for path in paths:
        for _ in iter_chunks(path):
            pass


def _validation(path: Path, rounds: int) -> dict[str, Any]:
    """Seconds per validation level and for a raw read, on ``path``; cache dropped if possible."""
    try:
        from agent.checkpoint.validate import Level, validate
    except ImportError:  # the validator ships separately; report rather than fail
        return {"validate": "agent.checkpoint.validate is not available"}
    manifest = fmt.manifest_from_bytes((path / fmt.MANIFEST_NAME).read_bytes())
    paths = [path / entry.path for entry in manifest.files]
    dropped = True
    samples: dict[str, list[float]] = {}
    runs: list[tuple[str, Callable[[], Any]]] = [
        ("raw", lambda: _read_all(paths)),
        *((level.value, lambda lv=level: _check(validate(path, lv))) for level in Level),
    ]
    # Interleaved rounds, median per method: a shared virtual disk drifts by 2x
    # between one read and the next, and a single sample compares noise.
    for _ in range(rounds):
        for name, run in runs:
            dropped = drop_caches() and dropped
            started = time.perf_counter()
            run()
            samples.setdefault(name, []).append(time.perf_counter() - started)
    seconds = {name: statistics.median(values) for name, values in samples.items()}
    return {"seconds": seconds, "bytes": manifest.total_bytes, "dropped": dropped}


def _check(report: Any) -> None:
    if not report.valid:
        raise SystemExit(f"benchmark checkpoint failed validation: {report.reason}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gib", type=float, default=1.0, help="model + Adam state, all ranks")
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--saves", type=int, default=4, help="saves per method (median)")
    parser.add_argument("--reads", type=int, default=3, help="timed reads per method (median)")
    parser.add_argument(
        "--dir",
        type=Path,
        default=Path(tempfile.gettempdir()),
        help="parent of the scratch directory (removed afterwards)",
    )
    args = parser.parse_args()
    per_rank = args.gib * (1 << 30) / args.ranks
    layers = max(1, round(per_rank / BYTES_PER_LAYER_WITH_ADAM + 0.499))
    work = Path(tempfile.mkdtemp(prefix="resurgo-bench-", dir=args.dir))
    _say(f"{args.ranks} ranks x {layers} Linear({WIDTH},{WIDTH}) + Adam, scratch {work}")
    try:
        with mp.Manager() as manager:
            results = manager.dict()
            mp.spawn(
                _rank_main,
                nprocs=args.ranks,
                join=True,
                args=(args.ranks, _free_port(), layers, args.saves, str(work), results),
            )
            measured = dict(results)
        validation = _validation(Path(measured["last_checkpoint"]), args.reads)
    finally:
        shutil.rmtree(work, ignore_errors=True)

    stall_async = statistics.median(measured["async_stalls"])
    save_sync = statistics.median(measured["sync_times"])
    stall_naive = statistics.median(measured["naive_times"])
    _say(f"state {measured['state_bytes'] / 2**30:.2f} GiB")
    _say(
        f"async stall per save (s): {[round(s, 3) for s in measured['async_stalls']]}"
        f"  (background write {[round(s, 2) for s in measured['write_times']]})"
    )
    _say(f"sync dcp.save (s):        {[round(s, 3) for s in measured['sync_times']]}")
    _say(f"naive gather+torch.save:  {[round(s, 3) for s in measured['naive_times']]}")
    summary: dict[str, Any] = {
        "state_bytes": measured["state_bytes"],
        "ranks": args.ranks,
        "saves": args.saves,
        "stall_async_s": stall_async,
        "stall_async_first_s": measured["async_stalls"][0],
        "write_async_s": statistics.median(measured["write_times"]),
        "save_sync_s": save_sync,
        "stall_naive_s": stall_naive,
        "stall_ratio": stall_async / save_sync,
    }
    if "seconds" in validation:
        seconds, size = validation["seconds"], validation["bytes"]
        _say(
            f"validation over {size / 1e9:.2f} GB, median s: "
            f"{ {name: round(value, 3) for name, value in seconds.items()} }; "
            f"page cache {'dropped' if validation['dropped'] else 'WARM (could not drop)'}"
        )
        summary.update(
            {
                f"validate_{level}_gbps": size / seconds[level] / 1e9
                for level in ("quick", "full", "load")
            },
            raw_read_gbps=size / seconds["raw"] / 1e9,
            full_vs_raw=seconds["raw"] / seconds["full"],
            cache="dropped" if validation["dropped"] else "warm",
        )
    else:
        _say(f"VALIDATION NOT MEASURED: {validation['validate']}")
        summary.update(
            validate_quick_gbps=None,
            validate_full_gbps=None,
            validate_load_gbps=None,
            raw_read_gbps=None,
            cache=None,
        )
    print(json.dumps(summary), flush=True)


if __name__ == "__main__":
    main()
