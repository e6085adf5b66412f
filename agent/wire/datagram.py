"""The datagram a training rank sends its node agent: beats, checkpoint notes and
step reports, encoded and decoded.

Shared by the two ends of the agent's Unix datagram socket: the in-rank sender
(:mod:`agent.train.heartbeat`) and the node agent that reads it
(:mod:`agent.node.agent`, :mod:`agent.node.watch`, :mod:`agent.node.hang`).

Version 1 (this module is its one owner: the ranks'
:class:`~agent.train.heartbeat.Heartbeat` encodes with it, the agent decodes
with :func:`parse_datagram`). Little-endian, no padding between fields:

====== ===== ===================================================================
offset type  field
====== ===== ===================================================================
0      2s    magic ``b"Rh"``
2      u8    version, 1
3      u8    kind: 1 = beat, 2 = checkpoint committed, 3 = step report
4      u8    phase: 0 init, 1 train, 2 checkpoint, 3 eval, 4 data
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
import struct
from dataclasses import dataclass

MAGIC = b"Rh"
VERSION = 1
FLAG_AUTOMATIC = 1
FLAG_NON_FINITE_LOSS = 2
FLAG_NON_FINITE_GRAD_NORM = 4
# Linux PATH_MAX; a longer path cannot name a checkpoint directory anyway.
MAX_PATH_BYTES = 4096
# The 34 bytes every message starts with (the table above); public for the sender's
# hot path, which packs a plain beat itself.
HEADER = struct.Struct("<2sBBBBiiiqd")
_PATH_LEN = struct.Struct("<H")
_STEP_TAIL = struct.Struct("<dq")
_COMPUTE = struct.Struct("<d")
_GRAD_NORM = struct.Struct("<d")
BEAT_SIZE = HEADER.size
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
    # Waiting for a batch from the data loader for longer than a moment (the
    # bootstrap's hooks: agent.train.autohooks).
    DATA = "data"
    # Stopped stepping but keeping a core busy outside any collective: work no
    # hook sees. The agent says so of a rank in its heartbeat reports
    # (agent.node.watch); a rank's beat may say it too.
    COMPUTE = "compute"


class Kind(enum.IntEnum):
    """Message kinds on the wire (the ``kind`` byte)."""

    BEAT = 1
    CHECKPOINT = 2
    STEP = 3


# The ``phase`` byte of each phase.
PHASE_CODE: dict[Phase, int] = {
    Phase.INIT: 0,
    Phase.TRAIN: 1,
    Phase.CHECKPOINT: 2,
    Phase.EVAL: 3,
    Phase.DATA: 4,
    Phase.COMPUTE: 5,
}
_CODE_PHASE: dict[int, Phase] = {code: phase for phase, code in PHASE_CODE.items()}


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
    """The datagram for one beat (the reference encoder; ``Heartbeat.beat`` inlines it).

    With ``compute_s`` the 42-byte timed form; ValueError when it is negative
    or not finite. ``automatic``: flag bit 0 (the bootstrap's beats).
    """
    flags = FLAG_AUTOMATIC if automatic else 0
    header = HEADER.pack(
        MAGIC, VERSION, Kind.BEAT, PHASE_CODE[phase], flags, rank, local_rank, pid, step,
        wall_time_s,
    )  # fmt: skip
    if compute_s is None:
        return header
    return header + _COMPUTE.pack(_checked_compute(compute_s))


def usable_compute_s(compute_s: float) -> bool:
    """Whether ``compute_s`` can be sent as a step's compute seconds: finite and >= 0."""
    return isinstance(compute_s, int | float) and math.isfinite(compute_s) and compute_s >= 0


def _checked_compute(compute_s: float | None) -> float:
    if compute_s is None:
        return _NO_COMPUTE
    if not usable_compute_s(compute_s):
        raise ValueError(f"compute seconds must be finite and >= 0, got {compute_s!r}")
    return compute_s


def _read_compute(data: bytes, offset: int) -> float | None:
    (compute_s,) = _COMPUTE.unpack_from(data, offset)
    return compute_s if usable_compute_s(compute_s) else None


def is_grad_norm(value: float) -> bool:
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
    header = HEADER.pack(
        MAGIC,
        VERSION,
        Kind.CHECKPOINT,
        PHASE_CODE[phase],
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
    if grad_norm is not None and not is_grad_norm(grad_norm):
        raise ValueError(f"grad norm must be >= 0, NaN or infinity, got {grad_norm!r}")
    flags = FLAG_AUTOMATIC if automatic else 0
    if loss is not None and not math.isfinite(loss):
        flags |= FLAG_NON_FINITE_LOSS
    if grad_norm is not None and not math.isfinite(grad_norm):
        flags |= FLAG_NON_FINITE_GRAD_NORM
    header = HEADER.pack(
        MAGIC,
        VERSION,
        Kind.STEP,
        PHASE_CODE[Phase.TRAIN],
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
    _, _, kind, phase_code, flags, rank, local_rank, pid, step, wall = HEADER.unpack_from(data)
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
