"""Heartbeats from a training rank to its node agent, and the datagram format they use.

A training script calls :func:`beat` (or :meth:`Heartbeat.beat`) once per
step; the node agent turns the stream into hang and straggler verdicts
(:mod:`agent.node.hang`). :meth:`Heartbeat.report_step` is a beat that also carries
the step's loss and data cursor (and, where the script computes one, its total
gradient norm), which the agent forwards to the supervisor for resume
verification and its training-health watch (``TrainingSession.step_done``
sends it). A beat or a report
may carry the step's compute seconds (``TrainingSession.compute``): the time a
rank worked before waiting for its peers, from which the supervisor finds a
straggler that synchronous training otherwise hides. On every rank::

    from agent.train.heartbeat import Heartbeat, Phase

    hb = Heartbeat.from_env()                  # a no-op when no agent socket is set
    hb.beat(0, Phase.INIT)                     # before the slow setup (grace applies)
    for step in range(start, total):
        ...train one step...
        hb.beat(step + 1)                      # Phase.TRAIN; or, with the loss:
        # hb.report_step(step + 1, loss=loss.item(), cursor=samples_before_step)
        if save_due:
            with hb.phase(Phase.CHECKPOINT):   # a beat on entry and one on exit
                path = save(step + 1)
            hb.checkpoint_committed(step + 1, path)

Guarantees, because a supervisor must never be the thing that stops training:
sending never blocks (a non-blocking socket; a full receive queue drops the
datagram: the next beat carries newer news), never raises (every ``OSError``
is swallowed; a missing or dead agent is retried at most every
:data:`RECONNECT_PERIOD_S` seconds, so a restarted agent is found again), and
costs a few microseconds (one ``struct.pack`` and one ``send`` on a connected
socket; ``bench/agent.py`` measures it). A process that forks after creating a
:class:`Heartbeat` should create its own: the pid is read once.

Environment (set by the node agent, or by torchrun for the ranks):
``RESURGO_AGENT_SOCKET`` (path of the agent's Unix datagram socket), ``RANK``,
``LOCAL_RANK``.

Datagram format, version 1 (this module is its one owner; the agent decodes
with :func:`parse_datagram`). Little-endian, no padding between fields:

====== ===== ===================================================================
offset type  field
====== ===== ===================================================================
0      2s    magic ``b"Rh"``
2      u8    version, 1
3      u8    kind: 1 = beat, 2 = checkpoint committed, 3 = step report
4      u8    phase: 0 init, 1 train, 2 checkpoint, 3 eval
5      u8    flags: bit 0 set for a beat or step report of the automatic
             bootstrap (:mod:`agent.train.autohooks`); bit 1 set on a step report
             whose loss was not finite (the loss field holds the NaN or
             infinity; without the bit a NaN there means "no loss");
             bit 2 likewise for the grad norm of a step report;
             other bits 0
6      i32   global rank
10     i32   local rank
14     i32   pid of the sender
18     i64   step
26     f64   wall time of sending, seconds since the epoch (``time.time()``)
====== ===== ===================================================================

A beat is those 34 bytes, or 42 with ``f64`` compute seconds appended: the
time the rank spent on its own work in the step just finished, before it
waited for its peers (NaN: not measured). A checkpoint note appends ``u16``
path length and that many bytes of the path (UTF-8, undecodable bytes kept via
``surrogateescape``), at most :data:`MAX_PATH_BYTES`. A step report (phase
train; rank, local rank and step >= 0) appends three fields, 58 bytes in all,
and a fourth, 66 bytes, when the rank gave its grad norm (a 50-byte report
without the compute seconds is read too, and every older form stays valid):

====== ===== ===================================================================
34     f64   the step's loss; NaN: no loss (none given, or not a number)
42     i64   data cursor: global samples consumed before the step; -1: unknown
50     f64   the step's compute seconds; NaN: not measured
58     f64   the step's total gradient norm (>= 0); NaN: none given; with flag
             bit 2 the norm was not finite (NaN or infinity, as sent)
====== ===== ===================================================================

The grad norm is flagged exactly as the loss is, because a NaN norm is the
fault the supervisor most wants to see and must not read as "not reported".

The wall time is for reports and latency only: the agent measures progress
with its own monotonic clock at receipt, so rank clock skew never fakes or
hides a hang. A receiver that sees another magic, an unknown version or kind,
a wrong length or a field out of its range drops the datagram; a version 2 may
append fields after these.
"""

from __future__ import annotations

import enum
import math
import os
import socket
import struct
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass

ENV_AGENT_SOCKET = "RESURGO_AGENT_SOCKET"
ENV_RANK = "RANK"
ENV_LOCAL_RANK = "LOCAL_RANK"

MAGIC = b"Rh"
VERSION = 1
FLAG_AUTOMATIC = 1
FLAG_NON_FINITE_LOSS = 2
FLAG_NON_FINITE_GRAD_NORM = 4
# Linux PATH_MAX; a longer path cannot name a checkpoint directory anyway.
MAX_PATH_BYTES = 4096
# A dead agent costs one failed connect() per period, not one per step; short
# enough that a restarted agent hears from every rank within seconds.
RECONNECT_PERIOD_S = 2.0

# True once this process made a Heartbeat of its own (the script is
# instrumented): the automatic progress of agent.train.autohooks then stands down.
instrumented = False

_HEADER = struct.Struct("<2sBBBBiiiqd")
_PATH_LEN = struct.Struct("<H")
_STEP_TAIL = struct.Struct("<dq")
_COMPUTE = struct.Struct("<d")
_GRAD_NORM = struct.Struct("<d")
BEAT_SIZE = _HEADER.size
TIMED_BEAT_SIZE = BEAT_SIZE + _COMPUTE.size
STEP_REPORT_SIZE = BEAT_SIZE + _STEP_TAIL.size + _COMPUTE.size
_UNTIMED_STEP_REPORT_SIZE = BEAT_SIZE + _STEP_TAIL.size
GRAD_STEP_REPORT_SIZE = STEP_REPORT_SIZE + _GRAD_NORM.size
_NO_LOSS = float("nan")
_NO_GRAD_NORM = float("nan")
_NO_COMPUTE = float("nan")
_NO_CURSOR = -1


class Phase(enum.Enum):
    """What a rank is doing; each phase has its own hang timeout in the agent."""

    INIT = "init"
    TRAIN = "train"
    CHECKPOINT = "checkpoint"
    EVAL = "eval"


class Kind(enum.IntEnum):
    """Message kinds on the wire (the ``kind`` byte)."""

    BEAT = 1
    CHECKPOINT = 2
    STEP = 3


_PHASE_CODE: dict[Phase, int] = {
    Phase.INIT: 0,
    Phase.TRAIN: 1,
    Phase.CHECKPOINT: 2,
    Phase.EVAL: 3,
}
_CODE_PHASE: dict[int, Phase] = {code: phase for phase, code in _PHASE_CODE.items()}


@dataclass(frozen=True)
class RankBeat:
    """One decoded beat: ``rank`` reached ``step`` in ``phase`` at ``wall_time_s``.

    ``compute_s``: the rank's own work in the step it just finished, when measured.
    """

    rank: int
    local_rank: int
    pid: int
    step: int
    phase: Phase
    wall_time_s: float
    compute_s: float | None = None
    # Sent by the bootstrap (agent.train.autohooks) for a script that imports
    # nothing: its steps are optimizer steps, and a stop needs confirming.
    automatic: bool = False


@dataclass(frozen=True)
class CheckpointNote:
    """One decoded checkpoint-committed message: ``rank`` saw ``path`` commit at ``step``."""

    rank: int
    local_rank: int
    pid: int
    step: int
    phase: Phase
    wall_time_s: float
    path: str
    # A torch.save file the bootstrap saw written (a script that imports
    # nothing), not a committed Resurgo checkpoint.
    automatic: bool = False


@dataclass(frozen=True)
class StepReport:
    """One decoded step report: ``rank`` finished ``step`` with ``loss`` at data ``cursor``.

    ``loss`` is None when the rank gave none, NaN or an infinity when the
    rank's loss was not finite (a training-health fault); ``cursor`` (the
    global samples consumed before the step) is None when unknown; so is
    ``compute_s`` when not measured. ``grad_norm``, the step's total gradient
    norm, is None when the rank gave none, NaN or infinity when it was not
    finite (as the loss). A step report is also a beat in phase train: see
    :meth:`as_beat`.
    """

    rank: int
    local_rank: int
    pid: int
    step: int
    loss: float | None
    cursor: int | None
    wall_time_s: float
    compute_s: float | None = None
    grad_norm: float | None = None
    # Sent by the automatic bootstrap (a loss it read off ``backward()``), not the library.
    automatic: bool = False

    def as_beat(self) -> RankBeat:
        """The beat this report stands for: ``rank`` reached ``step`` in phase train."""
        return RankBeat(
            self.rank,
            self.local_rank,
            self.pid,
            self.step,
            Phase.TRAIN,
            self.wall_time_s,
            self.compute_s,
            self.automatic,
        )


def encode_beat(
    *,
    rank: int,
    local_rank: int,
    pid: int,
    step: int,
    phase: Phase,
    wall_time_s: float,
    compute_s: float | None = None,
    automatic: bool = False,
) -> bytes:
    """The datagram for one beat (the reference encoder; :class:`Heartbeat` inlines it).

    With ``compute_s`` the 42-byte timed form; ValueError when it is negative
    or not finite. ``automatic``: flag bit 0 (the bootstrap's beats).
    """
    flags = FLAG_AUTOMATIC if automatic else 0
    header = _HEADER.pack(
        MAGIC, VERSION, Kind.BEAT, _PHASE_CODE[phase], flags, rank, local_rank, pid, step,
        wall_time_s,
    )  # fmt: skip
    if compute_s is None:
        return header
    return header + _COMPUTE.pack(_checked_compute(compute_s))


def _usable(compute_s: float) -> bool:
    return isinstance(compute_s, int | float) and math.isfinite(compute_s) and compute_s >= 0


def _checked_compute(compute_s: float | None) -> float:
    if compute_s is None:
        return _NO_COMPUTE
    if not _usable(compute_s):
        raise ValueError(f"compute seconds must be finite and >= 0, got {compute_s!r}")
    return compute_s


def _read_compute(data: bytes, offset: int) -> float | None:
    (compute_s,) = _COMPUTE.unpack_from(data, offset)
    return compute_s if _usable(compute_s) else None


def _is_grad_norm(value: float) -> bool:
    """Whether ``value`` can be sent as a grad norm: a number >= 0, NaN or +inf."""
    return isinstance(value, int | float) and not isinstance(value, bool) and not value < 0


def encode_checkpoint(
    *,
    rank: int,
    local_rank: int,
    pid: int,
    step: int,
    phase: Phase,
    wall_time_s: float,
    path: str,
    automatic: bool = False,
) -> bytes:
    """The datagram for a checkpoint note; ValueError when the path exceeds MAX_PATH_BYTES.

    ``automatic``: flag bit 0, a file the bootstrap saw written (not a commit)."""
    raw = path.encode("utf-8", "surrogateescape")
    if len(raw) > MAX_PATH_BYTES:
        raise ValueError(f"checkpoint path is {len(raw)} bytes, more than {MAX_PATH_BYTES}")
    header = _HEADER.pack(
        MAGIC,
        VERSION,
        Kind.CHECKPOINT,
        _PHASE_CODE[phase],
        FLAG_AUTOMATIC if automatic else 0,
        rank,
        local_rank,
        pid,
        step,
        wall_time_s,
    )
    return header + _PATH_LEN.pack(len(raw)) + raw


def encode_step_report(
    *,
    rank: int,
    local_rank: int,
    pid: int,
    step: int,
    loss: float | None,
    cursor: int | None,
    wall_time_s: float,
    compute_s: float | None = None,
    grad_norm: float | None = None,
    automatic: bool = False,
) -> bytes:
    """The datagram for a step report; ValueError for a negative rank, step or cursor.

    ``compute_s`` None: not measured; negative or not finite: ValueError.
    ``grad_norm`` None: the 58-byte form, as before grad norms travelled;
    otherwise the 66-byte form, NaN and infinity flagged; negative: ValueError.
    ``automatic``: flag bit 0 (the bootstrap's loss of a script that imports nothing).
    """
    if min(rank, local_rank, step) < 0 or (cursor is not None and cursor < 0):
        raise ValueError(
            f"step report needs rank, local rank, step and cursor >= 0, got rank {rank}, "
            f"local rank {local_rank}, step {step}, cursor {cursor}"
        )
    if grad_norm is not None and not _is_grad_norm(grad_norm):
        raise ValueError(f"grad norm must be >= 0, NaN or infinity, got {grad_norm!r}")
    flags = FLAG_AUTOMATIC if automatic else 0
    if loss is not None and not math.isfinite(loss):
        flags |= FLAG_NON_FINITE_LOSS
    if grad_norm is not None and not math.isfinite(grad_norm):
        flags |= FLAG_NON_FINITE_GRAD_NORM
    header = _HEADER.pack(
        MAGIC,
        VERSION,
        Kind.STEP,
        _PHASE_CODE[Phase.TRAIN],
        flags,
        rank,
        local_rank,
        pid,
        step,
        wall_time_s,
    )
    tail = _STEP_TAIL.pack(
        _NO_LOSS if loss is None else loss, _NO_CURSOR if cursor is None else cursor
    )
    report = header + tail + _COMPUTE.pack(_checked_compute(compute_s))
    return report if grad_norm is None else report + _GRAD_NORM.pack(grad_norm)


def parse_datagram(data: bytes) -> RankBeat | CheckpointNote | StepReport | None:
    """Decode one datagram; None for anything that is not a well-formed version-1 message.

    Never raises: the agent's socket is writable by every local process, so
    garbage must cost a dropped datagram, not a crashed watcher.
    """
    if len(data) < BEAT_SIZE or data[:2] != MAGIC or data[2] != VERSION:
        return None
    _, _, kind, phase_code, flags, rank, local_rank, pid, step, wall = _HEADER.unpack_from(data)
    phase = _CODE_PHASE.get(phase_code)
    if phase is None or min(rank, local_rank, step) < 0 or pid < 1:
        return None
    if kind == Kind.BEAT:
        automatic = bool(flags & FLAG_AUTOMATIC)
        if len(data) == BEAT_SIZE:
            return RankBeat(rank, local_rank, pid, step, phase, wall, None, automatic)
        if len(data) == TIMED_BEAT_SIZE:
            compute_s = _read_compute(data, BEAT_SIZE)
            return RankBeat(rank, local_rank, pid, step, phase, wall, compute_s, automatic)
        return None
    if kind == Kind.STEP:
        return _step_report(data, phase, flags, rank, local_rank, pid, step, wall)
    if kind != Kind.CHECKPOINT or len(data) < BEAT_SIZE + _PATH_LEN.size:
        return None
    (length,) = _PATH_LEN.unpack_from(data, BEAT_SIZE)
    raw = data[BEAT_SIZE + _PATH_LEN.size :]
    if length > MAX_PATH_BYTES or len(raw) != length:
        return None
    return CheckpointNote(
        rank, local_rank, pid, step, phase, wall, raw.decode("utf-8", "surrogateescape"),
        bool(flags & FLAG_AUTOMATIC),
    )  # fmt: skip


def _step_report(
    data: bytes,
    phase: Phase,
    flags: int,
    rank: int,
    local_rank: int,
    pid: int,
    step: int,
    wall: float,
) -> StepReport | None:
    sizes = (GRAD_STEP_REPORT_SIZE, STEP_REPORT_SIZE, _UNTIMED_STEP_REPORT_SIZE)
    if len(data) not in sizes or phase is not Phase.TRAIN or min(rank, local_rank, step) < 0:
        return None
    loss, cursor = _STEP_TAIL.unpack_from(data, BEAT_SIZE)
    if cursor < _NO_CURSOR:
        return None
    grad_norm = None
    if len(data) == GRAD_STEP_REPORT_SIZE:
        (grad_norm,) = _GRAD_NORM.unpack_from(data, STEP_REPORT_SIZE)
        if grad_norm < 0:
            return None
        if math.isnan(grad_norm) and not flags & FLAG_NON_FINITE_GRAD_NORM:
            grad_norm = None
    timed = len(data) != _UNTIMED_STEP_REPORT_SIZE
    return StepReport(
        rank,
        local_rank,
        pid,
        step,
        None if math.isnan(loss) and not flags & FLAG_NON_FINITE_LOSS else loss,
        None if cursor == _NO_CURSOR else cursor,
        wall,
        _read_compute(data, _UNTIMED_STEP_REPORT_SIZE) if timed else None,
        grad_norm,
        bool(flags & FLAG_AUTOMATIC),
    )


class Heartbeat:
    """Sends this rank's beats to the node agent; never blocks, never raises.

    ``socket_path`` None or empty makes every method a cheap no-op (a script
    run outside Resurgo). Not thread-safe: call it from the training loop's
    thread.
    """

    def __init__(
        self,
        socket_path: str | None,
        *,
        rank: int = 0,
        local_rank: int = 0,
        automatic: bool = False,
    ) -> None:
        """``automatic``: the bootstrap's own (:mod:`agent.train.autohooks`), which
        stands down once the script makes a Heartbeat of its own."""
        global instrumented
        self._path = socket_path or None
        if self._path is not None and not automatic:
            instrumented = True
        self._rank = rank
        self._local_rank = local_rank
        self._pid = os.getpid()
        self._sock: socket.socket | None = None
        self._retry_at = 0.0
        self._step = 0
        self._phase = Phase.TRAIN
        # Bound once: attribute lookups are a measurable share of a 2 µs call.
        self._pack = _HEADER.pack
        self._clock = time.time
        self._flags = FLAG_AUTOMATIC if automatic else 0

    @classmethod
    def from_env(
        cls, environ: Mapping[str, str] | None = None, *, automatic: bool = False
    ) -> Heartbeat:
        """From ``RESURGO_AGENT_SOCKET``, ``RANK`` and ``LOCAL_RANK`` (0 when unset or bad)."""
        env = os.environ if environ is None else environ
        return cls(
            env.get(ENV_AGENT_SOCKET),
            rank=_int_or_zero(env.get(ENV_RANK)),
            local_rank=_int_or_zero(env.get(ENV_LOCAL_RANK)),
            automatic=automatic,
        )

    @property
    def enabled(self) -> bool:
        """Whether an agent socket is configured (not whether the agent is listening)."""
        return self._path is not None

    @property
    def connected(self) -> bool:
        """Whether a socket to the agent is open now."""
        return self._sock is not None

    def beat(self, step: int, phase: Phase = Phase.TRAIN, compute_s: float | None = None) -> None:
        """Tell the agent this rank reached ``step`` in ``phase``; drops it if it cannot.

        ``compute_s``: the seconds this rank worked in the step before waiting
        for its peers, when measured (a negative or non-finite value is left out).
        """
        self._step = step
        self._phase = phase
        if self._path is None:
            return
        if compute_s is not None and _usable(compute_s):
            self._send(
                lambda: encode_beat(
                    rank=self._rank,
                    local_rank=self._local_rank,
                    pid=self._pid,
                    step=step,
                    phase=phase,
                    wall_time_s=self._clock(),
                    compute_s=compute_s,
                    automatic=bool(self._flags),
                )
            )
            return
        sock = self._sock
        if sock is None:
            sock = self._reconnect()
            if sock is None:
                return
        try:
            sock.send(
                self._pack(
                    MAGIC,
                    VERSION,
                    1,  # Kind.BEAT; a literal saves an enum lookup on the hot path
                    _PHASE_CODE[phase],
                    self._flags,
                    self._rank,
                    self._local_rank,
                    self._pid,
                    step,
                    self._clock(),
                )
            )
        except BlockingIOError:
            # The agent's queue is full: drop this beat, keep the socket.
            pass
        except OSError:
            self._disconnect()
        except (struct.error, KeyError):
            # A step outside int64 or a phase that is not a Phase: not worth a crash.
            pass

    @contextmanager
    def phase(self, phase: Phase) -> Iterator[None]:
        """Beat ``phase`` at the last step on entry, and the previous phase again on exit."""
        previous = self._phase
        self.beat(self._step, phase)
        try:
            yield
        finally:
            self.beat(self._step, previous)

    def checkpoint_committed(self, step: int, path: str | os.PathLike[str]) -> None:
        """Tell the agent a checkpoint of ``step`` committed at ``path``; never raises."""
        self._checkpoint_note(step, path, automatic=False)

    def file_written(self, path: str | os.PathLike[str], step: int | None = None) -> None:
        """Tell the agent the script wrote checkpoint ``path`` (a ``torch.save`` file or
        a DCP directory: the bootstrap's note) of ``step``, the current step when None;
        never raises."""
        self._checkpoint_note(self._step if step is None else step, path, automatic=True)

    def _checkpoint_note(self, step: int, path: str | os.PathLike[str], automatic: bool) -> None:
        self._send(
            lambda: encode_checkpoint(
                rank=self._rank,
                local_rank=self._local_rank,
                pid=self._pid,
                step=step,
                phase=self._phase,
                wall_time_s=self._clock(),
                path=os.fspath(path),
                automatic=automatic,
            )
        )

    def report_step(
        self,
        step: int,
        loss: float | None = None,
        cursor: int | None = None,
        compute_s: float | None = None,
        grad_norm: float | None = None,
    ) -> None:
        """Tell the agent this rank finished ``step``, with its loss and data cursor; never raises.

        Counts as a beat of ``step`` in phase train. ``loss`` is a float (call
        ``.item()`` on a tensor), None when there is none; ``cursor`` is the
        global samples consumed BEFORE the step, None when unknown;
        ``compute_s`` as for :meth:`beat` (a negative or non-finite value is
        left out); ``grad_norm`` the step's total gradient norm as a float,
        None when not computed (NaN and infinity are sent flagged; a negative
        number or a tensor is left out, so the loss still goes). A report with
        a negative step or cursor is dropped.
        """
        if compute_s is not None and not _usable(compute_s):
            compute_s = None
        if grad_norm is not None and not _is_grad_norm(grad_norm):
            grad_norm = None
        self._step = step
        self._phase = Phase.TRAIN
        self._send(
            lambda: encode_step_report(
                rank=self._rank,
                local_rank=self._local_rank,
                pid=self._pid,
                step=step,
                loss=loss,
                cursor=cursor,
                wall_time_s=self._clock(),
                compute_s=compute_s,
                grad_norm=grad_norm,
                automatic=bool(self._flags),
            )
        )

    def _send(self, encode: Callable[[], bytes]) -> None:
        """Send what ``encode`` makes, if an agent is there; never raises, never blocks.

        A full queue drops the datagram; a dead agent closes the socket (retried
        later); an argument that does not encode (a path too long, a number out
        of range; the agent also finds commits on disk) is dropped.
        """
        if self._path is None:
            return
        sock = self._sock if self._sock is not None else self._reconnect()
        if sock is None:
            return
        try:
            sock.send(encode())
        except BlockingIOError:
            pass
        except OSError:
            self._disconnect()
        except (ValueError, struct.error, TypeError):
            pass

    def close(self) -> None:
        """Close the socket; a later beat reconnects."""
        self._disconnect()
        self._retry_at = 0.0

    def _reconnect(self) -> socket.socket | None:
        now = time.monotonic()
        if now < self._retry_at or self._path is None:
            return None
        self._retry_at = now + RECONNECT_PERIOD_S
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        try:
            sock.setblocking(False)
            sock.connect(self._path)
        except OSError:
            sock.close()
            return None
        self._sock = sock
        return sock

    def _disconnect(self) -> None:
        # The agent went away (ECONNREFUSED) or its path is gone; a restarted
        # agent binds a new socket at the same path, so connect afresh later.
        if self._sock is not None:
            self._sock.close()
            self._sock = None
        self._retry_at = time.monotonic() + RECONNECT_PERIOD_S


def _int_or_zero(value: str | None) -> int:
    try:
        return int(value) if value else 0
    except ValueError:
        return 0


_default: Heartbeat | None = None


def default_heartbeat() -> Heartbeat:
    """The process-wide :class:`Heartbeat`, created from the environment on first use."""
    global _default
    if _default is None or _default._pid != os.getpid():
        _default = Heartbeat.from_env()
    return _default


def beat(step: int, phase: Phase = Phase.TRAIN) -> None:
    """Beat through :func:`default_heartbeat`; never blocks, never raises."""
    default_heartbeat().beat(step, phase)
