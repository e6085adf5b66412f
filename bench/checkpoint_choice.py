"""The checkpoint choice after a fault, with and without validation ahead of it.

One committed checkpoint of ``--mib`` MiB (Resurgo's format: DCP files, a
manifest, the marker) and the supervisor's own executor and validation
process (the child that imports torch and reads the checkpoint) against a
real store. Each round times the executor's ``ValidateCheckpoints`` at the
policy's level, what runs between a fault and the relaunch:

- ``without``: ``validate_ahead = false``, the checkpoint read at the fault;
- ``with``: the checkpoint reported first (as its commit reports it), its
  background validation waited for (timed as ``background_s``), then the
  fault's choice, which takes that verdict after a look at every file's
  size, inode and times.

``--cold`` drops the page cache before each timed read (root only), as a
head node reading a checkpoint the compute nodes wrote to shared storage
would find it; without it the files stay in this machine's cache.

    python -m bench.checkpoint_choice --mib 512 --repeat 3 --cold

The last line printed is one JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from bench.checkpoint import drop_caches
from supervisor.act.executor import Executor
from supervisor.act.validation import Limits, ValidationProcess
from supervisor.core.intents import ValidateCheckpoints, ValidationLevel
from supervisor.store import Store
from tests.ckpt_helpers import make_committed_checkpoint
from tests.fakes.slurm import JOB, FakeSlurm


def state_of(mib: int) -> dict[str, Any]:
    """Model and optimizer tensors of ``mib`` MiB in all (float32), in 16 tensors."""
    per_tensor = max(1, (mib << 20) // 4 // 16)
    generator = torch.Generator().manual_seed(0)
    return {
        "model": {f"w{i}": torch.randn(per_tensor, generator=generator) for i in range(8)},
        "optimizer": {f"m{i}": torch.randn(per_tensor, generator=generator) for i in range(8)},
        "step": 100,
    }


async def one_round(
    store: Store, root: Path, path: Path, level: ValidationLevel, attempt: int, cold: bool
) -> dict[str, float]:
    """The fault's choice without and with the background validation: seconds each."""
    found: dict[str, float] = {}
    for ahead in (False, True):
        validation = ValidationProcess(Limits())
        executor = Executor(store, FakeSlurm(), checkpoint_root_of=lambda _: root,
                            validation=validation, validate_ahead=ahead)  # fmt: skip
        # Both children warm, as after a job's first checkpoint: their start is not timed.
        await validation.start()
        await executor.background.start()
        runner = None
        try:
            if executor.ahead is not None:
                runner = asyncio.create_task(executor.ahead.run())
                if cold:
                    drop_caches()
                began = time.perf_counter()
                executor.note_checkpoint(JOB, str(path), level)
                while executor.ahead.validated < 1:
                    await asyncio.sleep(0.005)
                found["background_s"] = time.perf_counter() - began
            if cold:
                drop_caches()
            began = time.perf_counter()
            intent = ValidateCheckpoints(JOB, attempt * 2 + ahead, level)
            (seen,) = await executor.execute(JOB, [intent], time.time())
            found["with_s" if ahead else "without_s"] = time.perf_counter() - began
            assert getattr(seen, "valid", False), seen
        finally:
            if runner is not None:
                runner.cancel()
                await asyncio.gather(runner, return_exceptions=True)
            await validation.aclose()
            await executor.background.aclose()
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=512, help="checkpoint size (default 512)")
    parser.add_argument("--repeat", type=int, default=3, help="rounds (default 3)")
    parser.add_argument("--level", choices=[lv.value for lv in ValidationLevel], default="full")
    parser.add_argument("--cold", action="store_true", help="drop the page cache (root)")
    args = parser.parse_args(argv)
    if args.mib < 1 or args.repeat < 1:
        parser.error("--mib and --repeat must be at least 1")
    if args.cold and not drop_caches():
        parser.error("--cold needs root and a writable /proc/sys/vm/drop_caches")
    level = ValidationLevel(args.level)
    rounds: list[dict[str, float]] = []
    with tempfile.TemporaryDirectory(prefix="resurgo-choice-") as where:
        root = Path(where) / "ckpt"
        path = make_committed_checkpoint(root, 100, state_of(args.mib))
        size = sum(f.stat().st_size for f in path.iterdir())
        store = Store.open(Path(where) / "store.db")
        store.upsert_job(JOB, state="running", record={}, now_s=time.time(), name="bench",
                         original_nodes=4, min_nodes=2)  # fmt: skip
        try:
            for index in range(args.repeat):
                found = asyncio.run(one_round(store, root, path, level, index, args.cold))
                rounds.append(found)
                told = ", ".join(f"{key} {value:.3f}" for key, value in found.items())
                print(f"bench: round {index + 1}: {told}", file=sys.stderr)
        finally:
            store.close()
    median = {key: statistics.median(r[key] for r in rounds) for key in rounds[0]}
    print(json.dumps({
        "mib": round(size / (1 << 20), 1), "level": level.value, "cold": args.cold,
        "rounds": args.repeat,
        "fault_choice_without_s": round(median["without_s"], 3),
        "fault_choice_with_s": round(median["with_s"], 3),
        "background_s": round(median["background_s"], 3),
        "without_over_with": round(median["without_s"] / median["with_s"], 1),
    }))  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
