"""The rank -> agent datagram format, and a sender that never blocks and never raises."""

from __future__ import annotations

import math
import os
import socket
import struct
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from agent.train import heartbeat as hbmod
from agent.train.heartbeat import Heartbeat
from agent.wire.datagram import (
    BEAT_SIZE,
    FLAG_NON_FINITE_GRAD_NORM,
    FLAG_NON_FINITE_LOSS,
    GRAD_STEP_REPORT_SIZE,
    MAX_PATH_BYTES,
    STEP_REPORT_SIZE,
    CheckpointNote,
    Phase,
    RankBeat,
    StepReport,
    encode_beat,
    encode_checkpoint,
    encode_step_report,
    parse_datagram,
)


@pytest.fixture
def sock_path(tmp_path: Path) -> Path:
    # AF_UNIX paths are limited to 107 bytes; pytest's tmp_path can be longer.
    short = Path(f"/tmp/resurgo-hb-{os.getpid()}-{tmp_path.name[-20:]}.sock")
    yield short
    short.unlink(missing_ok=True)


@pytest.fixture
def receiver(sock_path: Path) -> Iterator[socket.socket]:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(str(sock_path))
    sock.settimeout(2.0)
    yield sock
    sock.close()


def receive_all(sock: socket.socket) -> list[bytes]:
    sock.setblocking(False)
    out = []
    while True:
        try:
            out.append(sock.recv(65536))
        except BlockingIOError:
            return out


def test_beat_round_trips_through_the_format() -> None:
    data = encode_beat(
        rank=12, local_rank=3, pid=4242, step=2**40, phase=Phase.EVAL, wall_time_s=1.7e9
    )
    assert len(data) == BEAT_SIZE == 34
    assert data[:3] == b"Rh\x01"
    assert parse_datagram(data) == RankBeat(12, 3, 4242, 2**40, Phase.EVAL, 1.7e9)


def test_checkpoint_note_round_trips_with_an_undecodable_path() -> None:
    path = "/ckpt/step-100/\udcff"
    data = encode_checkpoint(
        rank=1, local_rank=1, pid=7, step=100, phase=Phase.CHECKPOINT, wall_time_s=5.0, path=path
    )
    assert parse_datagram(data) == CheckpointNote(1, 1, 7, 100, Phase.CHECKPOINT, 5.0, path)


def test_checkpoint_path_longer_than_path_max_is_refused_by_the_encoder() -> None:
    with pytest.raises(ValueError, match="bytes"):
        encode_checkpoint(
            rank=0,
            local_rank=0,
            pid=1,
            step=1,
            phase=Phase.TRAIN,
            wall_time_s=0.0,
            path="x" * (MAX_PATH_BYTES + 1),
        )


def step_report(**fields: Any) -> bytes:
    values: dict[str, Any] = {
        "rank": 0, "local_rank": 0, "pid": 1, "step": 5, "loss": 2.5, "cursor": 40,
        "wall_time_s": 1.0,
    }  # fmt: skip
    values.update(fields)
    return encode_step_report(**values)


def test_step_report_round_trips_its_loss_and_cursor() -> None:
    data = encode_step_report(
        rank=4, local_rank=2, pid=99, step=2**40, loss=0.1, cursor=2**50, wall_time_s=1.7e9
    )
    assert len(data) == STEP_REPORT_SIZE == BEAT_SIZE + 24
    assert data[:5] == b"Rh\x01\x03\x01"  # version 1, kind 3, phase train
    assert data[34:50] == struct.pack("<dq", 0.1, 2**50)
    assert math.isnan(struct.unpack_from("<d", data, 50)[0])  # compute time not measured
    report = parse_datagram(data)
    assert report == StepReport(4, 2, 99, 2**40, 0.1, 2**50, 1.7e9)
    assert isinstance(report, StepReport)
    assert report.as_beat() == RankBeat(4, 2, 99, 2**40, Phase.TRAIN, 1.7e9)


def test_compute_seconds_ride_on_a_beat_or_a_step_report() -> None:
    timed = encode_beat(
        rank=1, local_rank=1, pid=7, step=3, phase=Phase.TRAIN, wall_time_s=2.0, compute_s=0.25
    )
    assert len(timed) == BEAT_SIZE + 8
    assert parse_datagram(timed) == RankBeat(1, 1, 7, 3, Phase.TRAIN, 2.0, 0.25)
    report = parse_datagram(step_report(compute_s=1.5))
    assert isinstance(report, StepReport) and report.compute_s == 1.5
    assert report.as_beat().compute_s == 1.5
    # A report without the compute field (the 50-byte form) is still read.
    untimed = step_report()[:50]
    old = parse_datagram(untimed)
    assert isinstance(old, StepReport) and (old.loss, old.compute_s) == (2.5, None)
    # A NaN or negative compute time on the wire reads as "not measured".
    for bad in (float("nan"), -1.0):
        forged = timed[:BEAT_SIZE] + struct.pack("<d", bad)
        beat = parse_datagram(forged)
        assert isinstance(beat, RankBeat) and beat.compute_s is None
    for wrong in (BEAT_SIZE + 4, BEAT_SIZE + 9):
        assert parse_datagram((timed + b"\0")[:wrong]) is None


@pytest.mark.parametrize("field", ["rank", "local_rank", "step", "pid"])
def test_a_beat_with_a_field_out_of_range_is_dropped(field: str) -> None:
    values = {"rank": 1, "local_rank": 1, "pid": 7, "step": 3}
    values[field] = 0 if field == "pid" else -1
    data = encode_beat(phase=Phase.TRAIN, wall_time_s=0.0, **values)
    assert parse_datagram(data) is None


@pytest.mark.parametrize("compute_s", [-0.1, float("inf"), float("nan")])
def test_the_encoders_refuse_a_compute_time_that_is_no_duration(compute_s: float) -> None:
    with pytest.raises(ValueError, match="compute seconds"):
        step_report(compute_s=compute_s)
    with pytest.raises(ValueError, match="compute seconds"):
        encode_beat(
            rank=0, local_rank=0, pid=1, step=1, phase=Phase.TRAIN, wall_time_s=0.0,
            compute_s=compute_s,
        )  # fmt: skip


def test_no_loss_travels_as_nan_and_an_unknown_cursor_as_minus_one() -> None:
    data = step_report(loss=None, cursor=None)
    loss, cursor = struct.unpack_from("<dq", data, BEAT_SIZE)
    assert math.isnan(loss) and cursor == -1
    report = parse_datagram(data)
    assert isinstance(report, StepReport)
    assert (report.loss, report.cursor) == (None, None)


def test_a_nan_loss_is_told_apart_from_no_loss_by_its_flag() -> None:
    data = step_report(loss=float("nan"), cursor=0)
    assert data[5] == FLAG_NON_FINITE_LOSS
    nan_loss = parse_datagram(data)
    assert isinstance(nan_loss, StepReport) and math.isnan(nan_loss.loss or 0.0)
    assert nan_loss.cursor == 0
    # A sender that sets no flag (no loss, or a release before the flag) means no loss.
    assert step_report(loss=None)[5] == 0
    unflagged = data[:5] + b"\x00" + data[6:]
    report = parse_datagram(unflagged)
    assert isinstance(report, StepReport) and report.loss is None


def test_an_infinite_loss_is_decoded_as_sent() -> None:
    report = parse_datagram(step_report(loss=float("-inf")))
    assert isinstance(report, StepReport) and report.loss == float("-inf")


def test_a_grad_norm_rides_at_the_end_of_a_66_byte_step_report() -> None:
    data = step_report(grad_norm=3.25, compute_s=0.5)
    assert len(data) == GRAD_STEP_REPORT_SIZE == STEP_REPORT_SIZE + 8 == 66
    assert data[5] == 0  # finite: no flag
    assert struct.unpack_from("<d", data, 58) == (3.25,)
    report = parse_datagram(data)
    assert report == StepReport(0, 0, 1, 5, 2.5, 40, 1.0, 0.5, 3.25)
    assert parse_datagram(step_report(grad_norm=0)) == StepReport(
        0, 0, 1, 5, 2.5, 40, 1.0, None, 0.0
    )


def test_without_a_grad_norm_the_step_report_is_the_58_bytes_it_always_was() -> None:
    data = step_report(compute_s=0.5)
    assert data == step_report(compute_s=0.5, grad_norm=None)
    assert len(data) == STEP_REPORT_SIZE
    report = parse_datagram(data)
    assert isinstance(report, StepReport) and report.grad_norm is None
    # The 50-byte form of releases before compute seconds is read too.
    old = parse_datagram(data[:50])
    assert isinstance(old, StepReport) and (old.loss, old.compute_s, old.grad_norm) == (
        2.5,
        None,
        None,
    )


@pytest.mark.parametrize("grad_norm", [float("nan"), float("inf")])
def test_a_grad_norm_that_is_not_finite_travels_flagged_and_arrives_as_sent(
    grad_norm: float,
) -> None:
    data = step_report(grad_norm=grad_norm)
    assert data[5] == FLAG_NON_FINITE_GRAD_NORM
    report = parse_datagram(data)
    assert isinstance(report, StepReport) and report.loss == 2.5
    assert report.grad_norm is not None and str(report.grad_norm) == str(grad_norm)
    # Both flagged: the loss and the grad norm are told apart bit by bit.
    both = parse_datagram(step_report(loss=float("nan"), grad_norm=grad_norm))
    assert isinstance(both, StepReport) and both.loss is not None and math.isnan(both.loss)
    assert str(both.grad_norm) == str(grad_norm)


def test_an_unflagged_nan_grad_norm_means_none_was_given() -> None:
    data = step_report(grad_norm=float("nan"))
    unflagged = data[:5] + b"\x00" + data[6:]
    report = parse_datagram(unflagged)
    assert isinstance(report, StepReport) and report.grad_norm is None
    assert report.loss == 2.5


@pytest.mark.parametrize("grad_norm", [-0.5, float("-inf")])
def test_a_negative_grad_norm_is_refused_by_the_encoder_and_dropped_by_the_parser(
    grad_norm: float,
) -> None:
    with pytest.raises(ValueError, match="grad norm"):
        step_report(grad_norm=grad_norm)
    forged = bytearray(step_report(grad_norm=1.0))
    struct.pack_into("<d", forged, 58, grad_norm)
    assert parse_datagram(bytes(forged)) is None


@pytest.mark.parametrize("fields", [{"step": -1}, {"cursor": -1}, {"rank": -2}, {"local_rank": -1}])
def test_the_step_report_encoder_refuses_negative_numbers(fields: dict[str, int]) -> None:
    with pytest.raises(ValueError, match=">= 0"):
        step_report(**fields)


GOOD = encode_beat(rank=0, local_rank=0, pid=1, step=5, phase=Phase.TRAIN, wall_time_s=1.0)
STEP = step_report()


def _step_with(offset: int, fmt: str, value: object) -> bytes:
    data = bytearray(STEP)
    struct.pack_into(fmt, data, offset, value)
    return bytes(data)


@pytest.mark.parametrize(
    ("name", "data"),
    [
        ("empty", b""),
        ("short", GOOD[:-1]),
        ("trailing byte", GOOD + b"\0"),
        ("wrong magic", b"XX" + GOOD[2:]),
        ("future version", GOOD[:2] + b"\x02" + GOOD[3:]),
        ("unknown kind", GOOD[:3] + b"\x09" + GOOD[4:]),
        ("unknown phase", GOOD[:4] + b"\x07" + GOOD[5:]),
        ("checkpoint without length", GOOD[:3] + b"\x02" + GOOD[4:]),
        (
            "checkpoint length lies",
            GOOD[:3] + b"\x02" + GOOD[4:] + struct.pack("<H", 10) + b"abc",
        ),
        ("json", b'{"step": 5, "phase": "train", "rank": 0, "pad": "xxxxxx"}'),
        ("step report cut short", STEP[:-1]),
        ("step report with a trailing byte", STEP + b"\0"),
        ("grad step report with a trailing byte", step_report(grad_norm=1.0) + b"\0"),
        ("grad step report cut short", step_report(grad_norm=1.0)[:-1]),
        ("step report of a bare header", GOOD[:3] + b"\x03" + GOOD[4:]),
        ("step report in phase checkpoint", STEP[:4] + b"\x02" + STEP[5:]),
        ("step report with cursor -2", _step_with(42, "<q", -2)),
        ("step report of step -1", _step_with(18, "<q", -1)),
        ("step report of rank -1", _step_with(6, "<i", -1)),
        ("step report of local rank -1", _step_with(10, "<i", -1)),
    ],
)
def test_garbage_datagrams_parse_to_none(name: str, data: bytes) -> None:
    assert parse_datagram(data) is None, name


@given(st.binary(max_size=200))
def test_parse_datagram_never_raises_on_arbitrary_bytes(data: bytes) -> None:
    parse_datagram(data)


@given(st.binary(min_size=0, max_size=64), st.integers(min_value=0, max_value=BEAT_SIZE))
def test_parse_datagram_never_raises_on_mangled_valid_messages(tail: bytes, cut: int) -> None:
    note = encode_checkpoint(
        rank=0, local_rank=0, pid=1, step=1, phase=Phase.INIT, wall_time_s=0.0, path="/c"
    )
    parse_datagram(GOOD[:cut] + tail)
    parse_datagram(note[:cut] + tail)
    parse_datagram(STEP[:cut] + tail)


def test_heartbeat_delivers_beats_phases_and_checkpoint_notes(
    sock_path: Path, receiver: socket.socket
) -> None:
    hb = Heartbeat(str(sock_path), rank=5, local_rank=1)
    hb.beat(0, Phase.INIT)
    hb.beat(1)
    with hb.phase(Phase.CHECKPOINT):
        pass
    hb.checkpoint_committed(1, sock_path.parent / "step-1")
    got = [parse_datagram(d) for d in receive_all(receiver)]
    assert [(m.step, m.phase) for m in got if isinstance(m, RankBeat)] == [
        (0, Phase.INIT),
        (1, Phase.TRAIN),
        (1, Phase.CHECKPOINT),
        (1, Phase.TRAIN),
    ]
    note = got[-1]
    assert isinstance(note, CheckpointNote)
    assert (note.rank, note.local_rank, note.pid, note.step) == (5, 1, os.getpid(), 1)
    assert note.path == str(sock_path.parent / "step-1")
    assert abs(note.wall_time_s - time.time()) < 60


def test_report_step_sends_a_step_report_that_is_also_the_current_beat(
    sock_path: Path, receiver: socket.socket
) -> None:
    hb = Heartbeat(str(sock_path), rank=3, local_rank=1)
    hb.beat(0, Phase.INIT)
    hb.report_step(1, loss=0.75, cursor=0)
    hb.report_step(2)
    with hb.phase(Phase.CHECKPOINT):
        pass
    got = [parse_datagram(d) for d in receive_all(receiver)]
    reports = [m for m in got if isinstance(m, StepReport)]
    assert [(r.rank, r.local_rank, r.pid, r.step, r.loss, r.cursor) for r in reports] == [
        (3, 1, os.getpid(), 1, 0.75, 0),
        (3, 1, os.getpid(), 2, None, None),
    ]
    # The phase context returns to train at the reported step, not to init.
    beats = [(m.step, m.phase) for m in got if isinstance(m, RankBeat)]
    assert beats == [(0, Phase.INIT), (2, Phase.CHECKPOINT), (2, Phase.TRAIN)]


def test_compute_seconds_are_sent_when_usable_and_left_out_when_not(
    sock_path: Path, receiver: socket.socket
) -> None:
    hb = Heartbeat(str(sock_path), rank=2)
    hb.beat(1, compute_s=0.5)
    hb.beat(2, compute_s=-1.0)  # no duration: an untimed beat still goes
    hb.report_step(3, loss=1.0, cursor=8, compute_s=0.75)
    hb.report_step(4, loss=2.0, cursor=16, compute_s=float("nan"))
    got = [parse_datagram(d) for d in receive_all(receiver)]
    assert [(m.step, m.compute_s) for m in got if isinstance(m, RankBeat | StepReport)] == [
        (1, 0.5),
        (2, None),
        (3, 0.75),
        (4, None),
    ]
    assert [m.loss for m in got if isinstance(m, StepReport)] == [1.0, 2.0]


def test_report_step_sends_a_grad_norm_and_leaves_out_one_that_is_no_norm(
    sock_path: Path, receiver: socket.socket
) -> None:
    hb = Heartbeat(str(sock_path), rank=1)
    hb.report_step(1, loss=1.0, cursor=0, grad_norm=0.75)
    hb.report_step(2, loss=1.0, cursor=8, grad_norm=float("nan"))
    hb.report_step(3, loss=1.0, cursor=16)
    # Not a norm: the report (and its loss) still goes, without one.
    hb.report_step(4, loss=1.0, cursor=24, grad_norm=-1.0)
    hb.report_step(5, loss=1.0, cursor=32, grad_norm="2.0")  # type: ignore[arg-type]
    got = [parse_datagram(d) for d in receive_all(receiver)]
    norms = [(m.step, m.grad_norm) for m in got if isinstance(m, StepReport)]
    assert [step for step, _ in norms] == [1, 2, 3, 4, 5]
    assert norms[0] == (1, 0.75)
    assert norms[1][1] is not None and math.isnan(norms[1][1])
    assert [norm for _, norm in norms[2:]] == [None, None, None]


def test_heartbeat_reads_socket_and_ranks_from_the_environment(sock_path: Path) -> None:
    hb = Heartbeat.from_env(
        {"RESURGO_AGENT_SOCKET": str(sock_path), "RANK": "9", "LOCAL_RANK": "x"}
    )
    assert hb.enabled
    assert (hb._rank, hb._local_rank) == (9, 0)


def test_no_socket_configured_is_a_no_op() -> None:
    hb = Heartbeat.from_env({})
    assert not hb.enabled
    hb.beat(1)
    hb.checkpoint_committed(1, "/x")
    hb.report_step(1, loss=1.0, cursor=4)
    with hb.phase(Phase.EVAL):
        pass
    assert not hb.connected


def test_missing_socket_path_never_raises_and_is_retried_lazily(
    sock_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    attempts = []

    class CountingSocket(socket.socket):
        def connect(self, address: object) -> None:
            attempts.append(address)
            super().connect(address)  # type: ignore[arg-type]

    monkeypatch.setattr(hbmod.socket, "socket", CountingSocket)
    hb = Heartbeat(str(sock_path))
    for step in range(10_000):
        hb.beat(step)
    assert not hb.connected
    # One connect() per RECONNECT_PERIOD_S, not one per beat (what a beat costs
    # with the agent gone is measured by bench/agent.py, not asserted here).
    assert attempts == [str(sock_path)]


def test_agent_gone_mid_run_never_raises_and_a_restarted_agent_is_found_again(
    sock_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(hbmod, "RECONNECT_PERIOD_S", 0.0)
    first = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    first.bind(str(sock_path))
    hb = Heartbeat(str(sock_path))
    hb.beat(1)
    assert hb.connected
    first.close()
    sock_path.unlink()
    hb.beat(2)  # ECONNREFUSED from the dead peer: swallowed
    hb.beat(3)  # path missing: swallowed
    assert not hb.connected
    second = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    second.bind(str(sock_path))
    try:
        hb.beat(4)
        hb.beat(5)
        steps = [m.step for m in map(parse_datagram, receive_all(second)) if m is not None]
        assert steps[-1] == 5
    finally:
        second.close()


def test_full_receive_queue_drops_beats_without_blocking_or_raising(sock_path: Path) -> None:
    receiver = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    receiver.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1024)
    receiver.bind(str(sock_path))
    try:
        hb = Heartbeat(str(sock_path))
        # Nobody reads while the beats go out: a blocking send would wait forever
        # on the full queue, so the beats run in a thread that must finish. (What
        # a beat costs against a full queue is measured by bench/agent.py.)
        sender = threading.Thread(target=lambda: [hb.beat(step) for step in range(5_000)])
        sender.start()
        sender.join(60)
        assert not sender.is_alive(), "a beat blocked on the full queue"
        assert hb.connected, "a full queue must not drop the connection"
        received = receive_all(receiver)
        assert 0 < len(received) < 5_000
        hb.beat(99_999)  # the queue has room again: delivery resumes
        assert parse_datagram(receiver.recv(1024)) is not None
    finally:
        receiver.close()


def test_bad_arguments_never_raise_into_training(sock_path: Path, receiver: socket.socket) -> None:
    hb = Heartbeat(str(sock_path))
    hb.beat(2**70)
    hb.beat(1, "train")  # type: ignore[arg-type]
    hb.checkpoint_committed(1, "x" * (MAX_PATH_BYTES + 1))
    hb.report_step(2**70)
    hb.report_step(-1)
    hb.report_step(1, cursor=-5)
    hb.report_step(1, loss="low")  # type: ignore[arg-type]
    hb.report_step(1, cursor=2.5)  # type: ignore[arg-type]
    assert receive_all(receiver) == []


def test_module_level_beat_uses_a_lazily_created_default(
    sock_path: Path, receiver: socket.socket, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("RESURGO_AGENT_SOCKET", str(sock_path))
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setattr(hbmod, "_default", None)
    hbmod.beat(7, Phase.EVAL)
    assert hbmod.default_heartbeat() is hbmod.default_heartbeat()
    (message,) = [parse_datagram(d) for d in receive_all(receiver)]
    assert isinstance(message, RankBeat)
    assert (message.rank, message.step, message.phase) == (3, 7, Phase.EVAL)
