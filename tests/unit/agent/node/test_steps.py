"""Step reports: the session sends them, the agent buffers them into step_losses payloads."""

from __future__ import annotations

import asyncio
import math
import os
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from agent.node.agent import Clocks, NodeAgent, default_run_dir
from agent.node.config import load_config
from agent.node.procs import RankExit, RankProcess
from agent.node.steps import StepBuffer
from agent.train.heartbeat import Heartbeat
from agent.train.sampler import GlobalBatchSampler
from agent.train.schedule import CheckpointInterval, IntervalSource
from agent.train.session import TrainingSession
from agent.wire import protocol
from agent.wire.auth import new_secret, write_secret
from agent.wire.datagram import (
    Phase,
    StepReport,
    encode_beat,
    encode_checkpoint,
    encode_step_report,
    parse_datagram,
)
from tests.unit.agent_socket import agent_with_socket

INCARNATION = "0123abcd"


def report(
    rank: int,
    step: int,
    loss: float | None = 1.0,
    cursor: int | None = None,
    grad_norm: float | None = None,
) -> StepReport:
    return StepReport(rank, rank % 8, 100 + rank, step, loss, cursor, 0.0, None, grad_norm)


def as_event(payload: dict[str, Any]) -> protocol.Event:
    return protocol.make_event(
        protocol.EventKind.STEP_LOSSES, "77", "node1", INCARNATION, 1, 1.0, payload
    )


def test_drain_gives_one_payload_per_rank_in_arrival_order_and_empties_the_buffer() -> None:
    buffer = StepBuffer()
    for item in (report(1, 5, 0.5, 20), report(0, 5, 0.25, 20), report(1, 6, None, 24)):
        assert buffer.add(item)
    assert len(buffer) == 3
    payloads, dropped = buffer.drain()
    assert dropped == 0
    assert payloads == [
        {"global_rank": 0, "steps": [{"step": 5, "loss": 0.25, "cursor": 20}]},
        {
            "global_rank": 1,
            "steps": [
                {"step": 5, "loss": 0.5, "cursor": 20},
                {"step": 6, "loss": None, "cursor": 24},
            ],
        },
    ]
    assert [as_event(p).payload for p in payloads] == payloads
    assert len(buffer) == 0
    assert buffer.drain() == ([], 0)


@pytest.mark.parametrize("loss", [float("inf"), float("-inf"), float("nan")])
def test_a_loss_that_is_not_finite_is_sent_as_null_with_its_kind(loss: float) -> None:
    buffer = StepBuffer()
    buffer.add(report(0, 1, loss, 0))
    buffer.add(report(0, 2, None, 8))
    (payload,), _ = buffer.drain()
    kind = {"inf": "inf", "-inf": "-inf", "nan": "nan"}[str(loss)]
    assert payload["steps"] == [
        {"step": 1, "loss": None, "cursor": 0, "non_finite": kind},
        {"step": 2, "loss": None, "cursor": 8},  # no loss reported: no kind
    ]
    as_event(payload)  # the protocol accepts it


def test_a_grad_norm_is_sent_only_when_reported() -> None:
    buffer = StepBuffer()
    buffer.add(report(0, 1, 0.5, 0, grad_norm=2.25))
    buffer.add(report(0, 2, 0.5, 8, grad_norm=0.0))
    buffer.add(report(0, 3, 0.5, 16))
    (payload,), _ = buffer.drain()
    assert payload["steps"] == [
        {"step": 1, "loss": 0.5, "cursor": 0, "grad_norm": 2.25},
        {"step": 2, "loss": 0.5, "cursor": 8, "grad_norm": 0.0},
        {"step": 3, "loss": 0.5, "cursor": 16},
    ]
    assert as_event(payload).payload == payload


@pytest.mark.parametrize(("grad_norm", "kind"), [(float("nan"), "nan"), (float("inf"), "inf")])
def test_a_grad_norm_that_is_not_finite_is_sent_as_null_with_its_kind(
    grad_norm: float, kind: str
) -> None:
    buffer = StepBuffer()
    buffer.add(report(0, 1, 0.5, 0, grad_norm=grad_norm))
    buffer.add(report(0, 2, float("nan"), 8, grad_norm=grad_norm))
    (payload,), _ = buffer.drain()
    assert payload["steps"] == [
        {"step": 1, "loss": 0.5, "cursor": 0, "grad_norm": None, "grad_non_finite": kind},
        {"step": 2, "loss": None, "cursor": 8, "non_finite": "nan", "grad_norm": None,
         "grad_non_finite": kind},
    ]  # fmt: skip
    assert as_event(payload).payload == payload


def test_more_steps_than_one_event_carries_are_split_in_step_order() -> None:
    limit = protocol.MAX_STEPS_PER_EVENT
    buffer = StepBuffer()
    for step in range(2 * limit + 1):
        buffer.add(report(3, step, float(step), step * 8))
    buffer.add(report(2, 7))
    payloads, _ = buffer.drain()
    assert [(p["global_rank"], len(p["steps"])) for p in payloads] == [
        (2, 1), (3, limit), (3, limit), (3, 1),
    ]  # fmt: skip
    steps = [entry["step"] for p in payloads[1:] for entry in p["steps"]]
    assert steps == list(range(2 * limit + 1))
    for payload in payloads:
        as_event(payload)
    one_more = {"global_rank": 3, "steps": payloads[1]["steps"] + payloads[3]["steps"]}
    with pytest.raises(protocol.ProtocolError, match="steps"):
        as_event(one_more)


def test_a_full_buffer_drops_and_counts_until_the_next_drain() -> None:
    buffer = StepBuffer(max_steps=2)
    assert [buffer.add(report(0, step)) for step in range(5)] == [True, True, False, False, False]
    payloads, dropped = buffer.drain()
    assert [entry["step"] for entry in payloads[0]["steps"]] == [0, 1] and dropped == 3
    assert buffer.add(report(0, 9))
    assert buffer.drain()[1] == 0


# ---------------------------------------------------------------------------
# The session's side: one report per step_done, with the cursor before the step.


class NeverSave(IntervalSource):
    def __init__(self) -> None:
        self._fixed = CheckpointInterval(steps=10**9)

    def current(self) -> CheckpointInterval:
        return self._fixed


@pytest.fixture
def receiver(tmp_path: Path) -> Iterator[tuple[Path, socket.socket]]:
    path = Path(f"/tmp/resurgo-steps-{os.getpid()}-{tmp_path.name[-20:]}.sock")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(str(path))
    sock.setblocking(False)
    yield path, sock
    sock.close()
    path.unlink(missing_ok=True)


def received(sock: socket.socket) -> list[StepReport]:
    out = []
    while True:
        try:
            message = parse_datagram(sock.recv(65536))
        except BlockingIOError:
            return out
        assert isinstance(message, StepReport)
        out.append(message)


def reporting_session(
    tmp_path: Path, socket_path: Path, sampler: GlobalBatchSampler | None = None
) -> TrainingSession:
    """A rank-0 session that never saves and reports its steps to ``socket_path``."""
    return TrainingSession(
        tmp_path / "ckpt",
        model=nn.Linear(2, 1),
        sampler=sampler,
        interval=NeverSave(),
        environ={},
        heartbeat=Heartbeat(str(socket_path)),
    )


def test_step_done_reports_the_step_its_loss_and_the_cursor_before_it(
    tmp_path: Path, receiver: tuple[Path, socket.socket]
) -> None:
    path, sock = receiver
    # 10 samples, batches of 4: two batches per epoch, so step 3 starts epoch 1.
    sampler = GlobalBatchSampler(10, 4, rank=0, world_size=1, seed=1)
    session = reporting_session(tmp_path, path, sampler)
    try:
        for loss in (0.5, None, 0.125):
            session.step_done(loss=loss)
        session.step_done()
    finally:
        session.close()
    got = [(r.rank, r.step, r.loss, r.cursor) for r in received(sock)]
    assert got == [(0, 1, 0.5, 0), (0, 2, None, 4), (0, 3, 0.125, 8), (0, 4, None, 12)]
    assert sampler.consumed_total == 16


def test_step_done_passes_the_grad_norm_through_nan_included(
    tmp_path: Path, receiver: tuple[Path, socket.socket]
) -> None:
    path, sock = receiver
    session = reporting_session(tmp_path, path)
    try:
        session.step_done(loss=1.0, grad_norm=4.5)
        session.step_done(loss=float("nan"), grad_norm=float("nan"))
        session.step_done(loss=1.0)
    finally:
        session.close()
    first, second, third = received(sock)
    assert (first.step, first.loss, first.grad_norm) == (1, 1.0, 4.5)
    assert second.grad_norm is not None and math.isnan(second.grad_norm)
    assert second.loss is not None and math.isnan(second.loss)
    assert third.grad_norm is None


def test_without_a_sampler_the_cursor_is_unknown(
    tmp_path: Path, receiver: tuple[Path, socket.socket]
) -> None:
    path, sock = receiver
    session = reporting_session(tmp_path, path)
    try:
        session.step_done(loss=float(torch.tensor(2.0)))
    finally:
        session.close()
    assert [(r.step, r.loss, r.cursor) for r in received(sock)] == [(1, 2.0, None)]


def test_the_time_inside_compute_goes_with_its_step_and_only_that_step(
    tmp_path: Path, receiver: tuple[Path, socket.socket]
) -> None:
    path, sock = receiver
    session = reporting_session(tmp_path, path)
    try:
        with session.compute():
            time.sleep(0.05)
        with session.compute():  # a second region in the same step adds up
            time.sleep(0.05)
        session.step_done(loss=1.0)
        session.step_done(loss=2.0)  # nothing marked: nothing measured
    finally:
        session.close()
    first, second = received(sock)
    assert first.compute_s is not None and 0.1 <= first.compute_s < 1.0
    assert second.compute_s is None


# ---------------------------------------------------------------------------
# The agent's socket: a step report is buffered and counts as a beat.


def test_the_agent_buffers_a_step_report_and_takes_it_as_progress(tmp_path: Path) -> None:
    with agent_with_socket(tmp_path) as (agent, sender):
        sender.send(encode_beat(rank=1, local_rank=1, pid=9, step=3, phase=Phase.INIT,
                                wall_time_s=0.0))  # fmt: skip
        for step, value in ((4, 0.5), (5, float("inf"))):
            sender.send(
                encode_step_report(rank=1, local_rank=1, pid=9, step=step, loss=value,
                                   cursor=step * 8, wall_time_s=0.0)
            )  # fmt: skip
        sender.send(
            encode_step_report(rank=1, local_rank=1, pid=9, step=6, loss=0.25, cursor=48,
                               wall_time_s=0.0, grad_norm=float("nan"))
        )  # fmt: skip
        agent._drain_socket()
    progress = agent.monitor.progress[1]
    assert (progress.step, progress.phase, progress.progress_s) == (6, Phase.TRAIN, 50.0)
    payloads, dropped = agent._steps.drain()
    assert dropped == 0
    assert payloads == [
        {
            "global_rank": 1,
            "steps": [
                {"step": 4, "loss": 0.5, "cursor": 32},
                {"step": 5, "loss": None, "cursor": 40, "non_finite": "inf"},
                {
                    "step": 6,
                    "loss": 0.25,
                    "cursor": 48,
                    "grad_norm": None,
                    "grad_non_finite": "nan",
                },
            ],
        }
    ]


def test_a_rank_exit_carries_the_last_step_the_rank_sent_before_it_died(tmp_path: Path) -> None:
    emitted: list[dict[str, Any]] = []

    async def emit(kind: protocol.EventKind, payload: dict[str, Any]) -> None:
        emitted.append(payload)

    with agent_with_socket(tmp_path) as (agent, sender):
        agent.events.emit = emit  # type: ignore[method-assign]
        for step in (5, 6):  # the second still in the socket when the exit is seen
            sender.send(encode_beat(rank=1, local_rank=1, pid=9, step=step, phase=Phase.TRAIN,
                                    wall_time_s=0.0))  # fmt: skip
            if step == 5:
                agent._drain_socket()
        asyncio.run(agent._emit_exit(RankExit(RankProcess(1, 1, 9), 1, None, 1.0)))
    assert [payload["last_step"] for payload in emitted] == [6]


def test_exit_records_left_by_an_earlier_life_of_the_run_directory_are_removed(
    tmp_path: Path,
) -> None:
    """A stale rank-N.json would date a death hours back and be taken for the root cause."""
    stale = tmp_path / "exits" / "rank-3.json"
    stale.parent.mkdir(parents=True)
    stale.write_text('{"global_rank": 3, "exit_code": 1, "time_unix_s": 1.0}')
    config, command = load_config(
        ["--job-id", "77", "--node", "node1", "--run-dir", str(tmp_path), "--", "true"], {}
    )
    assert asyncio.run(NodeAgent(config, command).run()) == 0
    assert not stale.exists()


def test_a_later_job_with_the_same_id_gets_another_run_directory(tmp_path: Path) -> None:
    """Job ids start over after a Slurm state reset; an old spool must not be resumed."""
    dirs = []
    for name in ("first", "second"):
        secret = tmp_path / name
        write_secret(secret, new_secret())
        config, _ = load_config(
            ["--job-id", "7", "--node", "node1", "--launch-nonce", "1",
             "--secret-file", str(secret), "--", "true"], {},
        )  # fmt: skip
        dirs.append(default_run_dir(config))
    assert dirs[0] != dirs[1]
    assert all(d.startswith("/tmp/resurgo-agent-7-node1-1-") for d in dirs)


def test_a_scripts_own_dcp_save_is_reported_with_the_bytes_of_its_files_and_its_duration(
    tmp_path: Path,
) -> None:
    saved = tmp_path / "ckpt" / "step-20"
    saved.mkdir(parents=True)
    (saved / "__0_0.distcp").write_bytes(b"x" * 1000)
    (saved / ".metadata").write_bytes(b"y" * 24)
    now = [100.0]
    config, command = load_config(
        ["--job-id", "77", "--node", "node1", "--run-dir", str(tmp_path / "run"), "--", "true"],
        {},
    )
    agent = NodeAgent(config, command, clocks=Clocks(monotonic=lambda: now[0], wall=time.time))
    emitted: list[tuple[protocol.EventKind, dict[str, Any]]] = []

    async def emit(kind: protocol.EventKind, payload: dict[str, Any]) -> None:
        emitted.append((kind, payload))

    agent.events.emit = emit  # type: ignore[method-assign]
    receiver, sender = socket.socketpair(socket.AF_UNIX, socket.SOCK_DGRAM)
    receiver.setblocking(False)
    agent._socket = receiver

    def beat(phase: Phase) -> None:
        sender.send(encode_beat(rank=0, local_rank=0, pid=9, step=20, phase=phase,
                                wall_time_s=0.0))  # fmt: skip
        agent._drain_socket()

    async def scenario() -> None:
        beat(Phase.CHECKPOINT)
        now[0] = 103.25
        beat(Phase.TRAIN)
        note = encode_checkpoint(rank=0, local_rank=0, pid=9, step=20, phase=Phase.TRAIN,
                                 wall_time_s=0.0, path=str(saved), automatic=True)  # fmt: skip
        sender.send(note)
        agent._drain_socket()
        await asyncio.sleep(0)

    try:
        asyncio.run(scenario())
    finally:
        receiver.close()
        sender.close()
    ((kind, payload),) = emitted
    assert kind is protocol.EventKind.CHECKPOINT_WRITTEN
    assert payload["total_bytes"] == 1024 and payload["duration_s"] == 3.25
