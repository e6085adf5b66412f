"""What a training script imports: save and restore every piece of deterministic state.

A :class:`TrainingSession` wraps the model, optimizer, LR scheduler, GradScaler,
the :class:`~agent.train.sampler.GlobalBatchSampler` and user extras, and
checkpoints them through :class:`~agent.checkpoint.save.Checkpointer` on the
schedule from :mod:`agent.train.schedule`. On every rank::

    session = TrainingSession(root, model=model, optimizer=opt, sampler=sampler,
                              lr_scheduler=sched)
    session.restore()                  # all but the global RNGs; returns the step
    batches = iter(loader)             # creating an iterator draws from the torch RNG,
    session.restore_rng()              # so the RNGs are restored after it exists
    while session.step < total_steps:
        batch = next(batches)          # (new iterator at each epoch end)
        with session.compute():        # this rank's own work, before it waits for peers
            ...forward, backward...
        ...gradient all-reduce, optimizer.step(), scheduler.step()...
        session.step_done(loss=loss.item())  # advances the sampler; saves when due
    session.close()                    # waits for the last save to commit

What is saved (DESIGN.md §5), under these top-level keys:

- ``model``, ``optim``: from ``torch.distributed.checkpoint.state_dict`` so
  FSDP2/DTensor shards are saved sharded and resharded on load;
- ``lr_scheduler``, ``grad_scaler``, ``data`` (the sampler's global cursor),
  ``extras``, ``step``: identical on every rank, so DCP's dedup keeps one copy;
- ``per_rank.rank<r>``: this rank's Python, NumPy, torch CPU and CUDA RNG
  states. Keyed by rank because DCP keeps one copy of identical keys.

Each :meth:`TrainingSession.step_done` also reports the step to the node
agent (:meth:`~agent.train.heartbeat.Heartbeat.report_step`): its number, the
loss passed in, and the sampler's global cursor before the step. The
supervisor compares these after a resume (same world size: the replayed
steps' losses; resized: the first step's cursor). Only rank 0 reports unless
``report_all_ranks`` is set: the loss a script logs is usually all-reduced,
so one rank's value speaks for all.

Time spent inside :meth:`TrainingSession.compute` during a step goes with the
step's beat from every rank. In synchronous training every rank's step takes
as long as the slowest rank's, so step times cannot tell which rank is slow;
the compute time before the collective can, and the supervisor compares it
across nodes to name a straggler. Unmarked, nothing is measured.

The resume source is ``RESURGO_RESUME_FROM`` (set by the supervisor: that
exact checkpoint, re-validated; invalid is an error) or else the newest
checkpoint under the root that passes the QUICK validation level. Rank 0
decides and broadcasts, so every rank loads the same directory. Data windows
named in ``RESURGO_SKIP_SAMPLES`` (:mod:`agent.skips`; set by the supervisor
when it rolls back past a loss anomaly) are then skipped by the sampler.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from agent.checkpoint import format as fmt
from agent.checkpoint.catalog import newest_valid, supersede_newer
from agent.checkpoint.retention import RetentionPolicy, apply_retention
from agent.checkpoint.save import Checkpointer, SaveResult, WhenBusy
from agent.checkpoint.validate import Level, validate
from agent.skips import ENV_SKIP_SAMPLES, SampleRange, format_skip_samples, parse_skip_samples
from agent.stopfiles import SaveRequest
from agent.train.heartbeat import Heartbeat, default_heartbeat
from agent.train.rng import capture_rng_state, restore_rng_state
from agent.train.sampler import GlobalBatchSampler
from agent.train.schedule import (
    CheckpointSchedule,
    IntervalSource,
    broadcast_from_rank0,
    due_on_all_ranks,
)
from agent.wire.datagram import Phase
from agent.wire.environ import ENV_CKPT_ROOT, ENV_RESUME_FROM
from agent.wire.errors import CheckpointError, CheckpointInvalid, ConfigError

log = logging.getLogger(__name__)

# Keep the last 3 committed checkpoints (a bug can take two saves to show).
DEFAULT_RETENTION = RetentionPolicy()
# After a checkpoint the node agent asked for (the time limit is near), how long
# the ranks wait for the agent's stop before they train on.
HOLD_FOR_STOP_S = 120.0


@dataclass(frozen=True)
class Loaded:
    """What :meth:`TrainingSession.restore` loaded: the checkpoint, its step, the world
    size that saved it (its manifest's) and the one that loaded it. A resharded load
    has ``saved_world_size != world_size``."""

    path: str
    step: int
    saved_world_size: int
    world_size: int

    def as_dict(self) -> dict[str, Any]:
        return {
            "path": self.path,
            "step": self.step,
            "saved_world_size": self.saved_world_size,
            "world_size": self.world_size,
        }


class TrainingSession:
    """Checkpoint/restore of a training run's complete state; one per rank.

    Construct after ``init_process_group`` (when distributed) and after the
    model is wrapped (FSDP2/DDP) and the optimizer built. Every method is
    called on every rank at the same point of the loop.

    Step reports go through ``heartbeat`` (by default the process's
    :func:`~agent.train.heartbeat.default_heartbeat`, or one made from
    ``environ`` when that is given); ``report_all_ranks`` makes every rank
    report, for scripts whose loss is not all-reduced.
    """

    def __init__(
        self,
        root: Path | str | None = None,
        *,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer | None = None,
        lr_scheduler: Any | None = None,
        grad_scaler: Any | None = None,
        sampler: GlobalBatchSampler | None = None,
        extras: Mapping[str, Any] | None = None,
        interval: IntervalSource | None = None,
        retention: RetentionPolicy | None = DEFAULT_RETENTION,
        when_busy: WhenBusy = WhenBusy.WAIT,
        environ: Mapping[str, str] | None = None,
        clock: Callable[[], float] = time.monotonic,
        heartbeat: Heartbeat | None = None,
        report_all_ranks: bool = False,
    ) -> None:
        env = os.environ if environ is None else environ
        if root is None:
            if not env.get(ENV_CKPT_ROOT):
                raise ConfigError(
                    f"no checkpoint root: pass TrainingSession(root=...) or set {ENV_CKPT_ROOT}"
                )
            root = env[ENV_CKPT_ROOT]
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self._model = model
        self._optimizer = optimizer
        self._lr_scheduler = lr_scheduler
        self._grad_scaler = grad_scaler
        self._sampler = sampler
        self._extras = dict(extras or {})
        self._env = env
        self._clock = clock
        self._distributed = dist.is_available() and dist.is_initialized()
        self.rank = dist.get_rank() if self._distributed else 0
        self.world_size = dist.get_world_size() if self._distributed else 1
        if heartbeat is None:
            heartbeat = default_heartbeat() if environ is None else Heartbeat.from_env(env)
        self._heartbeat = heartbeat
        self._reports_steps = report_all_ranks or self.rank == 0
        self._retention = retention
        self._checkpointer = Checkpointer(
            self.root,
            when_busy=when_busy,
            after_commit=self._after_commit if retention is not None else None,
        )
        self._interval = interval if interval is not None else IntervalSource(dict(env))
        # The node agent's "checkpoint now" (before the time limit): rank 0 reads it.
        self._save_request = SaveRequest.from_env(env)
        self._hold_next = False
        self.step = 0
        self._compute_s: float | None = None  # in compute() during this step
        self._schedule = CheckpointSchedule(
            self._interval.current(), start_step=0, start_s=self._clock()
        )
        self._pending_rng: dict[str, Any] | None = None
        self.resumed_from: Path | None = None
        self.loaded: Loaded | None = None  # set by restore() when it loaded a checkpoint
        self.last_save: SaveResult | None = None

    # -- restore -------------------------------------------------------------

    def restore(self) -> int:
        """Load the resume checkpoint, if any, except the global RNGs; return the step.

        Returns 0 (and changes nothing but the skipped data) when there is no
        checkpoint to resume from. Then applies ``RESURGO_SKIP_SAMPLES`` to the
        sampler, after its saved position, so that the data iterator created
        next starts past the windows. Call :meth:`restore_rng` once the data
        iterator exists.
        """
        # Read first: a malformed value fails before the (long) load, not after it.
        skips = parse_skip_samples(self._env.get(ENV_SKIP_SAMPLES, ""))
        path = self._choose_resume_path()
        if path is None:
            log.info("no checkpoint under %s: starting from step 0", self.root)
            self._supersede_newer(0)
            self._apply_skips(skips)
            return 0
        state = self._state_for_load(path)
        dcp.load(state, checkpoint_id=str(path))
        if self._optimizer is not None:
            set_state_dict(
                self._model,
                self._optimizer,
                model_state_dict=state["model"],
                optim_state_dict=state["optim"],
            )
        else:
            set_state_dict(self._model, (), model_state_dict=state["model"], optim_state_dict={})
        if self._lr_scheduler is not None:
            self._lr_scheduler.load_state_dict(state["lr_scheduler"])
        if self._grad_scaler is not None:
            self._grad_scaler.load_state_dict(state["grad_scaler"])
        if self._sampler is not None:
            self._sampler.load_state_dict(state["data"])
        for name, value in state.get("extras", {}).items():
            target = self._extras[name]
            if hasattr(target, "load_state_dict"):
                target.load_state_dict(value)
            else:
                self._extras[name] = value
        self.step = int(state["step"])
        self._pending_rng = state["per_rank"].get(f"rank{self.rank}")
        if self._pending_rng is None:
            log.warning(
                "checkpoint %s has no RNG state for rank %d (it was saved by fewer ranks): "
                "this rank continues with its current RNG state",
                path,
                self.rank,
            )
        self._schedule = CheckpointSchedule(
            self._interval.current(), start_step=self.step, start_s=self._clock()
        )
        self.resumed_from = path
        manifest = fmt.manifest_from_bytes((path / fmt.MANIFEST_NAME).read_bytes())
        self.loaded = Loaded(str(path), self.step, manifest.world_size, self.world_size)
        self._supersede_newer(self.step)
        log.info(
            "resumed from %s at step %d (saved by %d rank(s), loaded by %d)",
            path, self.step, manifest.world_size, self.world_size,
        )  # fmt: skip
        self._apply_skips(skips)
        return self.step

    def _apply_skips(self, skips: tuple[SampleRange, ...]) -> None:
        """Tell the sampler to leave out ``skips`` (ranges of its global sample cursor)."""
        if not skips:
            return
        if self._sampler is None:
            log.warning(
                "%s=%s cannot be applied: this session has no GlobalBatchSampler, so the "
                "script's data order is not known to Resurgo; training on every sample",
                ENV_SKIP_SAMPLES, format_skip_samples(skips),
            )  # fmt: skip
            return
        sampler = self._sampler
        sampler.skip_samples(skips)
        size = sampler.global_batch_size
        samples = sum(end - start for start, end in sampler.skipped)
        log.info(
            "%s=%s: skipping samples %s (widened to whole global batches: %d samples, %d "
            "batches of %d in all); the data cursor is at sample %d (batch %d)",
            ENV_SKIP_SAMPLES, format_skip_samples(skips), format_skip_samples(sampler.skipped),
            samples, samples // size, size, sampler.consumed_total, sampler.batches_consumed,
        )  # fmt: skip

    def _supersede_newer(self, step: int) -> None:
        """Rank 0 moves checkpoints after ``step`` aside: the run continues from ``step``."""
        if self.rank == 0:
            supersede_newer(self.root, step, time.time())

    def restore_rng(self) -> None:
        """Restore this rank's RNG states from the checkpoint; no-op if none are pending.

        Call after the data iterators exist (creating one draws from the global
        torch RNG) and before the first training step after :meth:`restore`.
        """
        if self._pending_rng is not None:
            restore_rng_state(self._pending_rng)
            self._pending_rng = None

    def _choose_resume_path(self) -> Path | None:
        """Rank 0 picks the checkpoint (explicit or newest valid); every rank learns it."""
        decision: list[Any] = [None]
        if self.rank == 0:
            decision[0] = self._decide_resume_path()
        if self._distributed:
            dist.broadcast_object_list(decision, src=0)
        outcome = decision[0]
        if isinstance(outcome, dict):
            raise CheckpointInvalid(outcome["error"])
        return None if outcome is None else Path(outcome)

    def _decide_resume_path(self) -> str | dict[str, str] | None:
        explicit = self._env.get(ENV_RESUME_FROM)
        if explicit:
            report = validate(explicit, Level.QUICK)
            if not report.valid:
                return {
                    "error": f"{ENV_RESUME_FROM}={explicit} is not a valid checkpoint "
                    f"({report.reason}); refusing to resume from it: pick another with "
                    "`resurgo ckpt newest`"
                }
            return explicit
        newest, rejected = newest_valid(self.root, Level.QUICK)
        for bad in rejected:
            log.warning("passing over checkpoint %s: %s", bad.path, bad.reason)
        return None if newest is None else newest.path

    def _state_for_load(self, path: Path) -> dict[str, Any]:
        """A state dict shaped like the saved one, for ``dcp.load`` to fill in place."""
        state = self._state_for_save()
        # Only this rank's RNG entry, and only if the saving world had this rank.
        # Other ranks' entries in the checkpoint are ignored by the load planner.
        metadata = dcp.FileSystemReader(str(path)).read_metadata()
        own = f"per_rank.rank{self.rank}"
        has_own = any(key.startswith(own + ".") for key in metadata.state_dict_metadata)
        state["per_rank"] = {f"rank{self.rank}": state["per_rank"][f"rank{self.rank}"]}
        if not has_own:
            state["per_rank"] = {}
        # Saved before data could be skipped: DCP refuses a key the checkpoint lacks.
        if "data" in state and "data.skipped" not in metadata.state_dict_metadata:
            del state["data"]["skipped"]
        return state

    # -- save ----------------------------------------------------------------

    @contextmanager
    def compute(self, *, cuda_sync: bool = False) -> Iterator[None]:
        """Time this rank's own work in the step (forward, backward), before it waits for peers.

        The time (host wall time, summed over every ``compute()`` in the step)
        goes with the step's report or beat in :meth:`step_done`. On a GPU the
        host only queues kernels: ``cuda_sync=True`` synchronizes the current
        device on exit so the time includes them (at the cost of one sync).
        """
        started = time.perf_counter()
        try:
            yield
        finally:
            if cuda_sync and torch.cuda.is_available() and torch.cuda.is_initialized():
                torch.cuda.synchronize()
            self._compute_s = (self._compute_s or 0.0) + time.perf_counter() - started

    def step_done(
        self, loss: float | None = None, grad_norm: float | None = None
    ) -> SaveResult | None:
        """Record one completed optimizer step; save when the schedule says so.

        Advances the sampler's global cursor (after the optimizer step, never in
        the data pipeline, since DataLoader workers prefetch). Reports the step
        to the node agent (rank 0 only, unless ``report_all_ranks``): its number
        (``step`` after this call: the first step after resuming from the
        checkpoint of step S is S + 1), ``loss`` (a float; pass ``loss.item()``,
        or None), ``grad_norm`` and the sampler's cursor before the step (None
        without a sampler), with the step's :meth:`compute` time on every rank.
        Reporting never blocks or raises.

        ``grad_norm`` is optional and feeds the supervisor's grad-norm
        explosion check: pass the total norm the script already computes, as
        a float, e.g. ``float(torch.nn.utils.clip_grad_norm_(params, max_norm))``.
        Turning the tensor into a float waits for the device, a sync that
        scripts clipping gradients already pay for their own logging; one that
        does not clip need not compute a norm just for this. A NaN or infinite
        norm is reported as such (a training-health fault), never dropped.
        """
        if self._pending_rng is not None:
            raise CheckpointError(
                "restored RNG state was never applied: call session.restore_rng() after "
                "creating the data iterator and before the first training step"
            )
        if self._hold_next:
            self._hold_for_stop()
        cursor = self._sampler.consumed_total if self._sampler is not None else None
        self.step += 1
        if self._sampler is not None:
            self._sampler.advance()
        compute_s, self._compute_s = self._compute_s, None
        if self._reports_steps:
            self._heartbeat.report_step(self.step, loss, cursor, compute_s, grad_norm)
        else:
            # Every rank's progress feeds hang detection; its compute time, stragglers.
            self._heartbeat.beat(self.step, compute_s=compute_s)
        self._schedule.set_interval(self._interval.current())
        now = self._clock()
        requested = self.rank == 0 and self._save_request.pending(now)
        if not due_on_all_ranks(self._schedule, self.step, now, rank=self.rank, force=requested):
            return None
        # Rare (once per save): every rank learns whether it was the requested one.
        requested = broadcast_from_rank0(requested)
        result = self.save()
        if requested:
            # Held at the next step's end, so what the script does with this
            # step (its log line, its metrics) still happens.
            self._save_request.honoured()
            self._hold_next = True
        return result

    def _hold_for_stop(self) -> None:
        """After the checkpoint the node agent asked for: commit it, then wait to be stopped.

        The agent asks only before the time limit, and stops the ranks once it
        sees the commit, so a step trained now would be lost. The wait is
        bounded: if no stop comes, training goes on.
        """
        self._hold_next = False
        log.info("final checkpoint before the time limit at step %d: waiting to be stopped",
                 self.step)  # fmt: skip
        self.wait()
        # The node agent stops the ranks once every one of them holds: a rank still
        # busy with the saved step (its log line) is not cut short.
        self._save_request.mark_held(self.rank)
        deadline = time.monotonic() + HOLD_FOR_STOP_S
        while time.monotonic() < deadline:
            self._heartbeat.beat(self.step, Phase.CHECKPOINT)
            time.sleep(0.5)
        log.warning("no stop came %.0f s after the requested checkpoint: training on",
                    HOLD_FOR_STOP_S)  # fmt: skip

    def save(self) -> SaveResult:
        """Save the current state as ``step-<step>/`` now (every rank)."""
        result = self._checkpointer.save(self.step, self._state_for_save(), self._contents())
        self._schedule.record_save(self.step, self._clock())
        self.last_save = result
        return result

    def wait(self) -> None:
        """Block until the in-flight save is committed (raises if it failed)."""
        self._checkpointer.wait()

    def close(self) -> None:
        """Wait for the last save to commit and release the checkpointer."""
        self._checkpointer.close()

    def _state_for_save(self) -> dict[str, Any]:
        optimizers = () if self._optimizer is None else self._optimizer
        model_state, optim_state = get_state_dict(self._model, optimizers)
        state: dict[str, Any] = {
            "model": model_state,
            "optim": optim_state,
            "step": self.step,
            "per_rank": {f"rank{self.rank}": capture_rng_state()},
        }
        if self._lr_scheduler is not None:
            state["lr_scheduler"] = self._lr_scheduler.state_dict()
        if self._grad_scaler is not None:
            state["grad_scaler"] = self._grad_scaler.state_dict()
        if self._sampler is not None:
            state["data"] = self._sampler.state_dict()
        if self._extras:
            state["extras"] = {
                name: value.state_dict() if hasattr(value, "state_dict") else value
                for name, value in self._extras.items()
            }
        return state

    def _contents(self) -> list[fmt.StateKind]:
        kinds = [fmt.StateKind.MODEL, fmt.StateKind.STEP, fmt.StateKind.RNG]
        present = (
            (self._optimizer, fmt.StateKind.OPTIMIZER),
            (self._lr_scheduler, fmt.StateKind.LR_SCHEDULER),
            (self._grad_scaler, fmt.StateKind.GRAD_SCALER),
            (self._sampler, fmt.StateKind.DATA_POSITION),
            (self._extras or None, fmt.StateKind.EXTRA),
        )
        kinds.extend(kind for value, kind in present if value is not None)
        return kinds

    def _after_commit(self, _step_dir: Path) -> None:
        assert self._retention is not None
        apply_retention(self.root, self._retention, now_s=time.time())
