"""Every default failure rule (supervisor.core.failure_rules), on evidence as real ranks give it.

Tracebacks and argparse's error come from running Python here; the kernel's
OOM line was read from this machine's dmesg after a rank ran past its memory
cgroup's limit; gloo's text from a real gloo all_reduce whose peer died; NVIDIA's
Xid and NCCL's texts are as their documentation and logs print them.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from agent.wire import raised
from supervisor.core.failure_rules import (
    DEFAULT_RULES,
    Action,
    Evidence,
    FailureClass,
    classify,
)
from tests.paths import REPO


def _ran(code: str, *args: str) -> Evidence:
    """The evidence of a rank that ran ``code`` and died before any step: its status, the
    note of its exception (agent.wire.raised, installed as the bootstrap does) and its
    standard error."""
    with tempfile.TemporaryDirectory() as notes:
        program = f"from agent.wire import raised\nraised.install()\n{code}"
        done = subprocess.run(
            [sys.executable, "-c", program, *args], capture_output=True, text=True, timeout=60,
            check=False, cwd=REPO, env={**os.environ, "RESURGO_EXIT_DIR": notes, "RANK": "0"},
        )  # fmt: skip
        note = raised.read_note(Path(notes), 0)
    return Evidence(
        exit_code=done.returncode,
        raised=None if note is None else note.type,
        message="" if note is None else note.message,
        errno=None if note is None else note.errno,
        stderr_tail=done.stderr,
        at_start=True,
    )


GLOO = (
    "[rank0]: RuntimeError: [/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553]"
    " Connection closed by peer [127.0.0.1]:55431. This is typically caused by a remote worker "
    "crashing. Check the logs of the remote worker before reporting an error. GLHF!"
)
NCCL = (
    "torch.distributed.DistBackendError: NCCL error in: ../torch/csrc/distributed/c10d/"
    "ProcessGroupNCCL.cpp:1275, unhandled system error (run with NCCL_DEBUG=INFO for details), "
    "NCCL version 2.14.3\nncclSystemError: System call (e.g. socket, malloc) or external library "
    "call failed or device error."
)
WATCHDOG = (
    "[Rank 0] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=1, OpType=ALLREDUCE,"
    " NumelIn=1, NumelOut=1, Timeout(ms)=1800000) ran for 1800087 milliseconds before timing out."
)
OOM_LINE = (
    "Memory cgroup out of memory: Killed process 689 (python3) total-vm:82356kB, "
    "anon-rss:72192kB, file-rss:6616kB, shmem-rss:0kB, UID:0 pgtables:200kB oom_score_adj:0"
)
XID_79 = (
    "NVRM: Xid (PCI:0000:86:00): 79, pid='<unknown>', name=<unknown>, GPU has fallen off the bus."
)


def test_an_import_error_before_the_first_step_is_the_scripts() -> None:
    found = classify(_ran("import tansformers"), DEFAULT_RULES)
    assert (found.failure_class, found.action, found.rule) == (
        FailureClass.USER_ERROR, Action.STOP, "script-error-at-start",
    )  # fmt: skip
    assert found.evidence == "ModuleNotFoundError: No module named 'tansformers'"


def test_the_same_error_after_training_began_is_not_called_the_scripts() -> None:
    later = dataclasses.replace(_ran("import tansformers"), at_start=False)
    assert classify(later, DEFAULT_RULES).failure_class is FailureClass.UNKNOWN


def test_bad_arguments_are_argparses_error_with_status_2() -> None:
    code = ("import argparse; p = argparse.ArgumentParser(prog='train.py'); "
            "p.add_argument('--lr', type=float); p.parse_args()")  # fmt: skip
    found = classify(_ran(code, "--lr", "x"), DEFAULT_RULES)
    assert (found.failure_class, found.rule) == (FailureClass.USER_ERROR, "bad-arguments")
    assert found.evidence == "train.py: error: argument --lr: invalid float value: 'x'"


@pytest.mark.parametrize(
    ("evidence", "rule"),
    [
        (_ran("import errno, os\n"
              "raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), '/ckpt/s')"), "disk-full"),
        (Evidence(exit_code=1, raised="OSError", message="[Errno 122] Disk quota exceeded",
                  errno=122), "disk-full"),
        (Evidence(exit_code=1, stderr_tail="RuntimeError: [enforce fail at inline_container.cc:"
                  "595] . unexpected pos 2048 vs 1984\nOSError: [Errno 28] No space left on "
                  "device"), "disk-full-text"),
        # torch.save into a full 4 MiB tmpfs, torch 2.13: no errno, no words for it.
        (Evidence(exit_code=1, raised="RuntimeError", message="[enforce fail at "
                  "inline_container.cc:672] . unexpected pos 768 vs 662"),
         "torch-save-write-failed"),
        (Evidence(exit_code=1, stderr_tail="RuntimeError: PytorchStreamWriter failed writing "
                  "file data/0: file write failed"), "torch-save-write-failed"),
        (Evidence(exit_code=1, raised="OSError", message="[Errno 116] Stale file handle",
                  errno=116), "storage-io"),
        (Evidence(signal=signal.SIGABRT, stderr_tail="terminate called after throwing an "
                  "instance of 'c10::Error'\n  what():  [Errno 5] Input/output error"),
         "storage-io-text"),
    ],
)  # fmt: skip
def test_storage_failures_blame_no_node_and_wait(evidence: Evidence, rule: str) -> None:
    found = classify(evidence, DEFAULT_RULES)
    assert (found.failure_class, found.action, found.rule) == (
        FailureClass.STORAGE, Action.WAIT_STORAGE, rule,
    )  # fmt: skip


def test_the_kernels_oom_kill_is_the_scripts_memory_not_the_node() -> None:
    found = classify(Evidence(signal=signal.SIGKILL, oom_kill=OOM_LINE), DEFAULT_RULES)
    assert (found.failure_class, found.action, found.budget) == (FailureClass.OOM, Action.RETRY, 1)
    assert found.evidence == OOM_LINE
    # A SIGKILL with no word from the kernel stays today's decision (the node).
    assert classify(Evidence(signal=signal.SIGKILL), DEFAULT_RULES).action is Action.DEFAULT


@pytest.mark.parametrize(
    "evidence",
    [
        Evidence(exit_code=1, raised="OutOfMemoryError", message="CUDA out of memory. Tried to "
                 "allocate 2.00 GiB. GPU 0 has a total capacity of 79.15 GiB of which 1.06 GiB "
                 "is free."),
        Evidence(signal=signal.SIGABRT, stderr_tail="RuntimeError: CUDA error: out of memory"),
        _ran("raise MemoryError()"),
    ],
)  # fmt: skip
def test_device_and_python_out_of_memory_are_oom(evidence: Evidence) -> None:
    assert classify(evidence, DEFAULT_RULES).failure_class is FailureClass.OOM


@pytest.mark.parametrize(
    "evidence",
    [
        Evidence(signal=signal.SIGKILL, xid=XID_79),
        Evidence(exit_code=1, raised="RuntimeError",
                 message="CUDA error: uncorrectable ECC error encountered"),
    ],
)  # fmt: skip
def test_gpu_errors_blame_the_node(evidence: Evidence) -> None:
    found = classify(evidence, DEFAULT_RULES)
    assert (found.failure_class, found.action) == (FailureClass.HARDWARE, Action.BLAME_NODE)


@pytest.mark.parametrize("text", [GLOO, NCCL, WATCHDOG])
def test_collective_errors_are_network_and_keep_the_root_cause_rule(text: str) -> None:
    found = classify(Evidence(exit_code=1, raised="RuntimeError", stderr_tail=text), DEFAULT_RULES)
    assert (found.failure_class, found.action) == (FailureClass.NETWORK, Action.DEFAULT)


def test_an_exception_nothing_matches_is_unknown_and_decided_as_today() -> None:
    found = classify(_ran("raise ValueError('loss went sideways')"), DEFAULT_RULES)
    assert (found.failure_class, found.action, found.rule) == (
        FailureClass.UNKNOWN, Action.DEFAULT, None,
    )  # fmt: skip
    assert found.words() == "unknown"


def test_every_default_rule_sets_a_condition_and_has_its_own_name() -> None:
    assert all(rule.sets_a_condition() for rule in DEFAULT_RULES)
    assert len({rule.name for rule in DEFAULT_RULES}) == len(DEFAULT_RULES)


def test_words_name_the_class_the_rule_and_the_line() -> None:
    found = classify(Evidence(signal=signal.SIGKILL, oom_kill=OOM_LINE), DEFAULT_RULES)
    assert found.words() == f'oom (rule kernel-oom-kill): "{OOM_LINE[:240]}"'
