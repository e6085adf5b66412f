"""The writing side of checkpoints: async, sharded DCP saves that commit atomically.

One :class:`Checkpointer` per training process; every rank calls the same
methods in the same order (they run collectives). A save goes through:

1. foreground, all ranks, one collective round: agree that no save is in
   flight and whether host memory can hold a staged copy; rank 0 prepares a
   FRESH ``step-<N>/`` just before voting and its vote carries the outcome;
2. foreground: this rank's tensors are copied into host buffers kept between
   saves (the only part the training loop waits for);
3. background, all ranks, on the Checkpointer's one thread: ``dcp.save`` of
   the staged copy writes and fsyncs ``__{rank}_*.distcp``, rank 0 writes
   ``.metadata``; each rank checksums the files it wrote and the entries are
   gathered to rank 0;
4. background, rank 0: manifest, then commit marker (both durable), then
   ``after_commit`` (retention); the outcome is shared with every rank so
   that ``wait()`` raises, or not, everywhere alike.

A crash at any instant leaves either a committed checkpoint or a directory
without a valid marker, which validation and retention treat as uncommitted.

Step 2 is :mod:`agent.checkpoint.staging`, what steps 1 and 4 put on disk is
:mod:`agent.checkpoint.commit`, and the documents the ranks exchange travel
through :mod:`agent.checkpoint.gather`.
"""

from __future__ import annotations

import enum
import json
import logging
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from agent.checkpoint import format as fmt
from agent.checkpoint import storage
from agent.checkpoint.commit import (
    all_files,
    discard_fresh_dir,
    own_data_files,
    prepare_step_dir,
    write_commit,
)
from agent.checkpoint.gather import all_gather_json
from agent.checkpoint.staging import (
    HostStager,
    available_host_memory,
    local_tensor_bytes,
    plain_state_dict,
)
from agent.wire.errors import CheckpointError

logger = logging.getLogger(__name__)

# Staged copy x this must fit in available host memory, else the save runs
# synchronously: allocator slack plus what training allocates while DCP writes.
DEFAULT_MEMORY_HEADROOM = 1.25
# The background thread's collectives wait this long for a slow or dead peer
# before failing the save (a gloo timeout, not a hang).
DEFAULT_COLLECTIVE_TIMEOUT_S = 1800.0


class WhenBusy(enum.Enum):
    """What :meth:`Checkpointer.save` does while the previous save is still writing."""

    WAIT = "wait"  # block until it committed, then save (the stall grows)
    SKIP = "skip"  # return at once without saving (the interval stretches)


class SaveMode(enum.Enum):
    """How a requested save ran."""

    ASYNC = "async"  # staged in memory, written in the background
    SYNC = "sync"  # written before save() returned: no memory for a staged copy
    SKIPPED = "skipped"  # not saved: a save was still in flight and when_busy=SKIP


@dataclass(frozen=True)
class SaveResult:
    """What :meth:`Checkpointer.save` did; ``stall_s`` is the time the caller was blocked."""

    step: int
    path: Path
    mode: SaveMode
    stall_s: float
    reason: str | None = None


@dataclass(frozen=True)
class CommittedCheckpoint:
    """The newest checkpoint this Checkpointer committed."""

    step: int
    path: Path


@dataclass(frozen=True)
class _Pending:
    """A save the background thread writes (when ``staged`` is set) and commits."""

    step: int
    path: Path
    contents: tuple[fmt.StateKind, ...]
    user: dict[str, Any]
    mode: SaveMode
    stall_s: float
    write_started: float
    staged: dict[str, Any] | None = field(default=None)  # None: already written (SYNC)
    stager: HostStager | None = field(default=None)


class Checkpointer:
    """Async sharded checkpoints under ``root``, one ``step-<N>/`` directory per save.

    Construct it on EVERY rank of the default process group, after
    ``init_process_group`` and in the same order relative to other
    ``new_group`` calls: it creates two gloo groups (see ``__init__``). Then
    call :meth:`save`, :meth:`wait` and :meth:`close` on every rank of
    ``process_group`` at the same points of the training loop. ``root`` must be
    one directory that all ranks see (a shared filesystem across nodes).
    """

    def __init__(
        self,
        root: Path | str,
        *,
        process_group: dist.ProcessGroup | None = None,
        when_busy: WhenBusy = WhenBusy.WAIT,
        after_commit: Callable[[Path], None] | None = None,
        memory_headroom: float = DEFAULT_MEMORY_HEADROOM,
        keep_staging_buffers: bool = True,
        available_memory: Callable[[], int] = available_host_memory,
        collective_timeout_s: float = DEFAULT_COLLECTIVE_TIMEOUT_S,
        ranks_warning_threshold: int = storage.DEFAULT_RANKS_WARNING_THRESHOLD,
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], float] = time.time,
    ) -> None:
        """Set up groups and the commit thread; nothing is written until :meth:`save`.

        ``after_commit(step_dir)`` runs on rank 0 in the background thread after
        each commit (plug retention in here); its failure is logged, and the
        checkpoint stays committed. ``keep_staging_buffers`` keeps the host copy
        between saves so that later saves only copy bytes, never allocate and
        fault in fresh pages (on CPU this is most of the stall); it costs one
        copy of this rank's state in host memory for the Checkpointer's life.
        ``available_memory`` returns free host bytes (tests inject a small one).
        """
        storage.can_stage(0, 0, memory_headroom)  # rejects a headroom < 1 now, not mid-save
        self._root = Path(root)
        self._when_busy = when_busy
        self._after_commit = after_commit
        self._headroom = memory_headroom
        self._keep_staging_buffers = keep_staging_buffers
        self._available_memory = available_memory
        self._ranks_warning_threshold = ranks_warning_threshold
        self._clock = clock
        self._wall_clock = wall_clock
        self._distributed = dist.is_available() and dist.is_initialized()
        self._control_pg: dist.ProcessGroup | None = None
        self._io_pg: dist.ProcessGroup | None = None
        self._rank, self._world_size = 0, 1
        if self._distributed:
            ranks = None if process_group is None else dist.get_process_group_ranks(process_group)
            timeout = timedelta(seconds=collective_timeout_s)
            # Two private gloo groups. The background write runs DCP's collectives
            # (plan gather, write all-reduce) from the commit thread; on the
            # training group they would interleave with the loop's own
            # collectives in a different order on each rank and deadlock or
            # mismatch. So the background thread owns _io_pg (DCP plus our
            # checksum gather), the foreground owns _control_pg (the vote that
            # carries the directory decision), and neither is used from the
            # other thread while a save is in flight. gloo because DCP and our
            # gathers move CPU tensors, which NCCL cannot.
            self._control_pg = dist.new_group(ranks=ranks, backend="gloo", timeout=timeout)
            self._io_pg = dist.new_group(ranks=ranks, backend="gloo", timeout=timeout)
            self._rank = dist.get_rank(self._io_pg)
            self._world_size = dist.get_world_size(self._io_pg)
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="resurgo-ckpt")
        self._stager: HostStager | None = HostStager() if keep_staging_buffers else None
        self._staged_bytes = 0
        self._inflight: Future[None] | None = None
        self._inflight_step: int | None = None
        self._lock = threading.Lock()
        self._last_committed: CommittedCheckpoint | None = None
        self._stats: fmt.SaveStats | None = None
        self._storage_magic: int | None = None
        self._filesystem: str | None = None
        self._storage_warned = False

    @property
    def rank(self) -> int:
        """This process's rank within the checkpointing group."""
        return self._rank

    @property
    def world_size(self) -> int:
        """Number of ranks that write each checkpoint."""
        return self._world_size

    @property
    def busy(self) -> bool:
        """True while this rank's part of the last save is still writing or committing."""
        return self._inflight is not None and not self._inflight.done()

    @property
    def last_committed(self) -> CommittedCheckpoint | None:
        """Step and path of the newest checkpoint committed by this Checkpointer."""
        with self._lock:
            return self._last_committed

    @property
    def stats(self) -> fmt.SaveStats | None:
        """Statistics of the newest committed save (as written in its manifest)."""
        with self._lock:
            return self._stats

    def save(
        self,
        step: int,
        state_dict: Mapping[str, Any],
        contents: Iterable[fmt.StateKind],
        user: dict[str, Any] | None = None,
    ) -> SaveResult:
        """Start saving ``state_dict`` as ``root/step-<step>/``; call on every rank.

        Returns once this rank's tensors are staged (mode ASYNC): the caller may
        then mutate them (``optimizer.step()``) without changing what is
        written. Values may be tensors, DTensors, nested dicts and lists, or
        ``Stateful`` objects (their ``state_dict()`` is taken now). Per-rank
        state must be keyed by rank: DCP keeps one copy of identical keys.
        ``user`` (JSON-serialisable) goes into the manifest.

        Raises :class:`CheckpointError` on every rank when ``step`` is already
        committed, when the previous save failed, or when staging fails.
        """
        started = self._clock()
        kinds = tuple(fmt.StateKind(kind) for kind in contents)
        user_doc = _json_checked(user or {})
        path = self._root / fmt.step_dir_name(step)
        if self._when_busy is WhenBusy.WAIT:
            self.wait()
        plain = plain_state_dict(state_dict)
        local_bytes = local_tensor_bytes(plain)
        # Kept staging buffers already hold the bytes of the last save; only
        # growth needs new memory.
        needed = max(0, local_bytes - self._staged_bytes)
        busy = self.busy
        # Rank 0 prepares the directory BEFORE the vote, so that one collective
        # round (not a vote, then a directory round) decides the save; the
        # directory is fresh and empty, so undoing it on a skip is an rmdir.
        prepared = self._prepare(path) if self._rank == 0 and not busy else None
        votes = self._all_gather_json(
            self._control_pg,
            {
                "busy": busy,
                "fits": storage.can_stage(needed, self._available_memory(), self._headroom),
                "needed": needed,
                "prepared": prepared,
            },
        )
        busy_ranks = [rank for rank, vote in enumerate(votes) if vote["busy"]]
        if busy_ranks:
            if prepared is not None and prepared["error"] is None:
                discard_fresh_dir(path)
            why = (
                f"step {self._inflight_step} is still being written on rank(s) {busy_ranks} "
                "and when_busy=skip; save less often or use when_busy=wait"
            )
            self._log_rank0(logging.WARNING, "checkpoint step %d skipped: %s", step, why)
            return SaveResult(step, path, SaveMode.SKIPPED, self._clock() - started, why)
        self.wait()  # nothing in flight anywhere now; surfaces a failed previous save
        decided = votes[0]["prepared"]
        if decided is None:
            raise CheckpointError(
                f"rank 0 did not prepare {path}: its previous save failed; "
                "see rank 0's log, then save again"
            )
        if decided["error"] is not None:
            raise CheckpointError(decided["error"])
        mode = SaveMode.ASYNC if all(vote["fits"] for vote in votes) else SaveMode.SYNC
        reason = None
        stager = None
        staged = None
        if mode is SaveMode.ASYNC:
            stager = self._stager if self._stager is not None else HostStager()
            staged = self._stage(step, plain, stager)
            self._staged_bytes = local_bytes if self._keep_staging_buffers else 0
            write_started = self._clock()
        else:
            short = [(rank, vote["needed"]) for rank, vote in enumerate(votes) if not vote["fits"]]
            reason = (
                f"host memory cannot hold a staged copy (rank, bytes) {short} with headroom "
                f"{self._headroom}; saved synchronously, training waited for the write"
            )
            self._log_rank0(logging.WARNING, "checkpoint step %d: %s", step, reason)
            self._release_staging_buffers()
            write_started = self._clock()
            self._run_sync(step, path, plain)
        stall_s = self._clock() - started
        pending = _Pending(
            step, path, kinds, user_doc, mode, stall_s, write_started, staged, stager
        )
        self._inflight_step = step
        self._inflight = self._executor.submit(self._finish, pending)
        self._log_rank0(
            logging.INFO,
            "checkpoint step %d: %s, stall %.3f s, writing %s",
            step,
            mode.value,
            stall_s,
            path,
        )
        return SaveResult(step, path, mode, stall_s, reason)

    def wait(self) -> None:
        """Block until the in-flight save committed; raise CheckpointError if it failed.

        A failure is raised once, then forgotten; the failed directory has no
        valid marker. Call on every rank.
        """
        future = self._inflight
        if future is None:
            return
        try:
            future.result()
        except CheckpointError:
            raise
        except Exception as error:
            raise CheckpointError(
                f"checkpoint step {self._inflight_step} failed in the background on rank "
                f"{self._rank}: {error!r}; it is not committed, the previous one stays valid"
            ) from error
        finally:
            self._inflight = None

    def close(self) -> None:
        """Wait for the in-flight save (raising its failure) and release threads and buffers."""
        try:
            self.wait()
        finally:
            self._executor.shutdown(wait=True)
            self._release_staging_buffers(reusable=False)
            self._destroy_groups()

    def _destroy_groups(self) -> None:
        # Left to interpreter exit, the private gloo groups are torn down in no
        # particular order after the default group; under load that aborted a
        # rank at exit ("terminate called without an active exception").
        for group in (self._control_pg, self._io_pg):
            if group is not None and dist.is_initialized():
                dist.destroy_process_group(group)
        self._control_pg = self._io_pg = None

    def _stage(self, step: int, plain: dict[str, Any], stager: HostStager) -> dict[str, Any]:
        """Copy this rank's tensors into the stager's host buffers (the stall)."""
        # dcp.async_save would stage, then start a new thread pool that runs
        # dcp.save; we run that dcp.save on our commit thread instead, which
        # keeps the pool's start-up (and its new thread taking the GIL from
        # the training thread) out of the stall.
        try:
            return stager.stage(plain)
        except Exception as error:
            raise CheckpointError(
                f"staging checkpoint step {step} failed on rank {self._rank}: {error!r}; "
                "training state was not saved, retry the save or check host memory"
            ) from error

    def _write(self, path: Path, state: dict[str, Any]) -> None:
        """``dcp.save`` of ``state`` into the fresh ``path``; collectives on ``_io_pg``."""
        dcp.save(
            state,
            storage_writer=_writer(path),
            process_group=self._io_pg,
            no_dist=not self._distributed,
        )

    def _run_sync(self, step: int, path: Path, plain: dict[str, Any]) -> None:
        """Write with ``dcp.save`` now, in the foreground (nothing is in flight)."""
        try:
            self._write(path, plain)
        except Exception as error:
            raise CheckpointError(
                f"synchronous save of step {step} failed on rank {self._rank}: {error!r}"
            ) from error

    def _prepare(self, path: Path) -> dict[str, Any] | None:
        """Rank 0: make ``path`` fresh; the outcome rides on rank 0's vote.

        None when the previous save failed: ``wait()`` raises that failure on
        every rank right after the vote, and no directory should be left for it.
        """
        previous = self._inflight
        if previous is not None and previous.done() and previous.exception() is not None:
            return None
        try:
            prepare_step_dir(path, self._wall_clock())
            self._check_storage()
        except (OSError, CheckpointError) as error:
            return {"error": str(error)}
        return {"error": None}

    def _check_storage(self) -> None:
        """Rank 0: learn the filesystem once and warn once if it cannot take sharded writes."""
        if self._storage_magic is None:
            # statfs through ctypes loads libc each call: milliseconds of stall.
            self._storage_magic = storage.statfs_magic(self._root)
            self._filesystem = storage.describe_magic(self._storage_magic)
        magic = self._storage_magic
        if self._storage_warned:
            return
        stats = self._stats
        throughput = stats.total_bytes / stats.write_s if stats and stats.write_s > 0 else None
        warning = storage.storage_warning(
            storage.kind_of_magic(magic),
            self._world_size,
            throughput,
            threshold=self._ranks_warning_threshold,
        )
        if warning is not None:
            logger.warning("checkpoint storage %s: %s", self._root, warning)
            self._storage_warned = True

    def _finish(self, pending: _Pending) -> None:
        """Background: wait for DCP, checksum own files, gather, commit on rank 0, share outcome."""
        local_error = None
        entries: list[dict[str, Any]] = []
        try:
            if pending.staged is not None:
                self._write(pending.path, pending.staged)
            entries = [asdict(entry) for entry in own_data_files(pending.path, self._rank)]
        except Exception as error:
            logger.exception("checkpoint step %d: write failed on this rank", pending.step)
            local_error = f"rank {self._rank}: {error!r}"
        finally:
            if pending.stager is not None and pending.stager is not self._stager:
                pending.stager.close()
        reports = self._all_gather_json(self._io_pg, {"error": local_error, "files": entries})
        outcome: dict[str, Any] = {}
        if self._rank == 0:
            outcome = self._commit(pending, reports)
        outcome = self._all_gather_json(self._io_pg, outcome)[0]
        if outcome["error"] is not None:
            raise CheckpointError(outcome["error"])
        with self._lock:
            self._last_committed = CommittedCheckpoint(pending.step, pending.path)
            self._stats = fmt.SaveStats(**outcome["stats"])

    def _commit(self, pending: _Pending, reports: list[dict[str, Any]]) -> dict[str, Any]:
        """Rank 0: manifest, marker, directory fsync, after_commit. Returns the outcome."""
        errors = [report["error"] for report in reports if report["error"] is not None]
        if errors:
            message = (
                f"checkpoint step {pending.step} was not committed: {'; '.join(errors)}; "
                f"{pending.path} has no marker and will not be restored from"
            )
            logger.error("%s", message)
            return {"error": message}
        try:
            entries = all_files(pending.path, reports)
            stats = fmt.SaveStats(
                stall_s=pending.stall_s,
                write_s=self._clock() - pending.write_started,
                total_bytes=sum(entry.bytes for entry in entries),
                filesystem=self._filesystem or "unknown",
                mode=pending.mode.value,
            )
            manifest = fmt.Manifest(
                step=pending.step,
                world_size=self._world_size,
                contents=pending.contents,
                files=tuple(entries),
                created_unix_s=self._wall_clock(),
                stats=stats,
                user=pending.user,
            )
            write_commit(pending.path, manifest)
        except Exception as error:
            logger.exception("checkpoint step %d: commit failed", pending.step)
            return {"error": f"committing step {pending.step} failed: {error!r}"}
        logger.info(
            "checkpoint step %d committed: %d bytes, stall %.3f s, write %.3f s, %s",
            pending.step,
            stats.total_bytes,
            stats.stall_s,
            stats.write_s,
            pending.path,
        )
        if self._after_commit is not None:
            try:
                self._after_commit(pending.path)
            except Exception:
                logger.exception(
                    "after_commit failed for %s; the checkpoint stays committed", pending.path
                )
        return {"error": None, "stats": asdict(stats)}

    def _all_gather_json(
        self, group: dist.ProcessGroup | None, document: dict[str, Any]
    ) -> list[dict[str, Any]]:
        """Every rank's ``document``, in rank order, over ``group`` (only ours when alone)."""
        if not self._distributed:
            return [document]
        return all_gather_json(group, document, self._world_size)

    def _release_staging_buffers(self, *, reusable: bool = True) -> None:
        """Free the kept host copy (before a sync fallback, or for good on close)."""
        if self._stager is not None:
            self._stager.close()
            self._stager = HostStager() if reusable and self._keep_staging_buffers else None
        self._staged_bytes = 0

    def _log_rank0(self, level: int, message: str, *args: Any) -> None:
        if self._rank == 0:
            logger.log(level, message, *args)


def _writer(path: Path) -> dcp.FileSystemWriter:
    # sync_files=True (the default, stated here because it is the durability
    # guarantee): every data file and .metadata.tmp is fsynced before DCP's
    # future completes. overwrite=False: the directory is fresh, so an existing
    # .metadata means something else writes here; fail rather than mix saves.
    return dcp.FileSystemWriter(path, sync_files=True, overwrite=False)


def _json_checked(user: dict[str, Any]) -> dict[str, Any]:
    try:
        json.dumps(user)
    except (TypeError, ValueError) as error:
        raise CheckpointError(
            f"user metadata must be JSON-serialisable for the manifest: {error}"
        ) from error
    return dict(user)
