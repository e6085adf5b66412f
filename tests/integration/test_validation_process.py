"""The checkpoint validation process (``supervisor/act/validation.py``), for real.

One warm child validates many checkpoints; it dies with the supervisor that
started it. What a crafted checkpoint does to it is in
``test_adversarial_checkpoint.py``, against a live daemon.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import subprocess
import sys
import time
from pathlib import Path

import psutil

from supervisor.act.validation import Limits, ValidationProcess
from tests.ckpt_helpers import make_committed_checkpoint

_PARENT = """
import asyncio, sys, time
from supervisor.act.validation import Limits, ValidationProcess

async def main():
    process = ValidationProcess(Limits())
    await process.start()
    print(process._child.pid, flush=True)
    time.sleep(600)

asyncio.run(main())
"""


def corrupt(directory: Path) -> None:
    from tests.ckpt_helpers import data_files

    target = data_files(directory)[0]
    data = bytearray(target.read_bytes())
    data[len(data) // 2] ^= 0xFF
    target.write_bytes(bytes(data))


def test_one_child_validates_one_checkpoint_after_another(tmp_path: Path) -> None:
    good = make_committed_checkpoint(tmp_path / "ckpt", 100)
    bad = make_committed_checkpoint(tmp_path / "ckpt", 200)
    corrupt(bad)

    async def scenario() -> list[tuple[bool, str]]:
        process = ValidationProcess(Limits(memory_mib=1024))
        try:
            found = [
                await process.validate(str(bad), "full"),
                await process.validate(str(good), "full"),
                await process.validate(str(tmp_path / "nowhere"), "quick"),
            ]
            assert process.started == 1
            return found
        finally:
            await process.aclose()

    (bad_ok, bad_why), (good_ok, _), (none_ok, none_why) = asyncio.run(scenario())
    assert not bad_ok and "checksum" in bad_why, bad_why
    assert good_ok
    assert not none_ok and none_why


def test_the_child_dies_with_the_supervisor_that_started_it() -> None:
    parent = subprocess.Popen([sys.executable, "-c", _PARENT], stdout=subprocess.PIPE, text=True)
    child = None
    try:
        assert parent.stdout is not None
        child = psutil.Process(int(parent.stdout.readline()))
        # Stopped, it stands for a child busy reading a checkpoint: it would never see
        # its input close. Only being killed with its parent ends it.
        child.suspend()
        parent.kill()
        parent.wait(timeout=30)
        deadline = time.monotonic() + 30
        while child.is_running() and child.status() != psutil.STATUS_ZOMBIE:
            assert time.monotonic() < deadline, "the validation child outlived the supervisor"
            time.sleep(0.1)
    finally:
        parent.kill()
        if child is not None and child.is_running():
            child.kill()


def test_a_validation_stopped_mid_read_takes_its_child_along(tmp_path: Path) -> None:
    """A validation whose task is cancelled (the daemon stopping) takes its child,
    still reading (a FIFO no one writes: the read never ends), is killed, so that
    its answer is never read as the next request's; a fresh child answers that."""
    stuck = tmp_path / "model.pt"
    os.mkfifo(stuck)
    good = make_committed_checkpoint(tmp_path / "ckpt", 100)

    async def scenario() -> tuple[int, tuple[bool, str], int]:
        process = ValidationProcess(Limits(memory_mib=1024))
        try:
            await process.start()
            assert process._child is not None
            first = process._child
            reading = asyncio.create_task(process.validate(str(stuck), "full"))
            await asyncio.sleep(1.0)
            assert not reading.done()
            reading.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await reading
            await asyncio.wait_for(first.wait(), 10)
            answer = await process.validate(str(good), "full")
            return first.returncode or 0, answer, process.started
        finally:
            await process.aclose()

    killed, answer, started = asyncio.run(scenario())
    assert killed == -9 and answer == (True, "") and started == 2
