"""Phase data: a long wait for the data loader's next batch, told by the bootstrap's hooks.

The rule on a fake clock (:class:`DataWait` alone), then the real thing: a
torch DataLoader whose dataset stalls, iterated under the installed hooks, with
the beats read off a real agent socket.
"""

from __future__ import annotations

import os
import signal
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from torch.utils.data import DataLoader, Dataset

from agent.train import heartbeat as heartbeat_module
from agent.train.autohooks import AutoProgress, DataWait
from agent.train.heartbeat import Heartbeat
from agent.wire.datagram import Phase, RankBeat, parse_datagram


class Beats:
    """Shaped like the Heartbeat the hooks use: records each beat."""

    def __init__(self) -> None:
        self.sent: list[tuple[int, Phase]] = []
        self.current_phase = Phase.TRAIN

    def beat(self, step: int, phase: Phase = Phase.TRAIN) -> None:
        self.sent.append((step, phase))
        self.current_phase = phase


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_short_wait_sends_nothing_and_a_long_one_is_phase_data_until_it_ends() -> None:
    beats, clock = Beats(), Clock()
    wait = DataWait(beats, after_s=1.0, clock=clock)  # type: ignore[arg-type]
    wait.began(7)
    clock.now += 0.9
    assert not wait.check()
    wait.ended()
    assert beats.sent == []
    wait.began(8)
    clock.now += 1.1
    assert wait.check() and not wait.check()  # told once a wait
    wait.ended()
    assert beats.sent == [(8, Phase.DATA), (8, Phase.TRAIN)]


def test_a_long_wait_during_an_evaluation_goes_back_to_eval() -> None:
    beats, clock = Beats(), Clock()
    beats.current_phase = Phase.EVAL
    wait = DataWait(beats, after_s=1.0, clock=clock)  # type: ignore[arg-type]
    wait.began(3)
    clock.now += 5
    wait.check()
    wait.ended()
    assert beats.sent == [(3, Phase.DATA), (3, Phase.EVAL)]


def test_the_end_of_a_wait_is_never_followed_by_a_late_data_beat() -> None:
    beats, clock = Beats(), Clock()
    wait = DataWait(beats, after_s=1.0, clock=clock)  # type: ignore[arg-type]
    wait.began(3)
    clock.now += 5
    wait.ended()
    assert not wait.check()
    assert beats.sent == []


def test_a_process_forked_while_the_watch_holds_the_lock_starts_afresh() -> None:
    beats, clock = Beats(), Clock()
    wait = DataWait(beats, after_s=1.0, clock=clock)  # type: ignore[arg-type]
    with wait._lock:  # the watch thread, mid-check, as a data loader worker is forked
        child = os.fork()
        if child == 0:  # the worker: a wait there must not block on the parent's lock
            signal.signal(signal.SIGALRM, signal.SIG_DFL)  # not pytest-timeout's handler
            signal.alarm(5)  # a deadlock ends the child, and the test fails, not hangs
            wait.began(1)
            wait.ended()
            os._exit(0)
    _, status = os.waitpid(child, 0)
    assert os.waitstatus_to_exitcode(status) == 0


class Stalls(Dataset[torch.Tensor]):
    """Item ``stall_at`` takes ``stall_s``; the others none."""

    def __init__(self, stall_at: int, stall_s: float) -> None:
        self.stall_at, self.stall_s = stall_at, stall_s

    def __len__(self) -> int:
        return 6

    def __getitem__(self, index: int) -> torch.Tensor:
        if index == self.stall_at:
            time.sleep(self.stall_s)
        return torch.tensor([float(index)])


@pytest.fixture
def agent_socket(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> Iterator[tuple[str, socket.socket]]:
    # A Heartbeat of an earlier test in this process made it "instrumented": the hooks
    # would stand down.
    monkeypatch.setattr(heartbeat_module, "instrumented", False)
    path = str(tmp_path / "agent.sock")
    server = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    server.bind(path)
    server.setblocking(False)
    yield path, server
    server.close()


def received(server: socket.socket) -> list[RankBeat]:
    beats = []
    while True:
        try:
            data = server.recv(4096)
        except BlockingIOError:
            return beats
        decoded = parse_datagram(data)
        if isinstance(decoded, RankBeat):
            beats.append(decoded)


def test_a_stalled_loader_under_the_hooks_beats_data_then_train_again(
    agent_socket: tuple[str, socket.socket],
) -> None:
    path, server = agent_socket
    progress = AutoProgress(Heartbeat(path, rank=0, automatic=True))
    progress.step = 4  # training is under way: the first steps are init's
    next_batch = progress.wrap_next(type(iter(DataLoader(Stalls(-1, 0)))).__next__)
    loader = DataLoader(Stalls(stall_at=2, stall_s=1.6), batch_size=1)
    iterator = iter(loader)
    batches = [next_batch(iterator) for _ in range(len(loader))]
    assert [float(b) for b in batches] == [0, 1, 2, 3, 4, 5]
    phases = [(beat.step, beat.phase) for beat in received(server)]
    assert phases == [(4, Phase.DATA), (4, Phase.TRAIN)], phases


def test_before_the_first_step_a_stalled_loader_sends_nothing(
    agent_socket: tuple[str, socket.socket],
) -> None:
    path, server = agent_socket
    progress = AutoProgress(Heartbeat(path, rank=0, automatic=True))
    next_batch = progress.wrap_next(type(iter(DataLoader(Stalls(-1, 0)))).__next__)
    iterator = iter(DataLoader(Stalls(stall_at=0, stall_s=1.6), batch_size=1))
    next_batch(iterator)
    assert received(server) == []
