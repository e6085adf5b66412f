"""Heartbeats from a training rank to its node agent (the datagram they travel in:
:mod:`agent.wire.datagram`).

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
"""

from __future__ import annotations

import os
import socket
import struct
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager

from agent.wire.datagram import (
    FLAG_AUTOMATIC,
    HEADER,
    MAGIC,
    PHASE_CODE,
    VERSION,
    encode_beat,
    encode_checkpoint,
    encode_step_report,
    is_grad_norm,
    usable_compute_s,
)

# Phase is part of this library's API: scripts write ``hb.beat(0, Phase.INIT)``.
from agent.wire.datagram import Phase as Phase
from agent.wire.environ import ENV_AGENT_SOCKET, ENV_LOCAL_RANK, ENV_RANK

# A dead agent costs one failed connect() per period, not one per step; short
# enough that a restarted agent hears from every rank within seconds.
RECONNECT_PERIOD_S = 2.0

# True once this process made a Heartbeat of its own (the script is
# instrumented): the automatic progress of agent.train.autohooks then stands down.
instrumented = False


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
        self._pack = HEADER.pack
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
    def current_phase(self) -> Phase:
        """The phase of the last beat (train before any)."""
        return self._phase

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
        if compute_s is not None and usable_compute_s(compute_s):
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
                    PHASE_CODE[phase],
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
        if compute_s is not None and not usable_compute_s(compute_s):
            compute_s = None
        if grad_norm is not None and not is_grad_norm(grad_norm):
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
