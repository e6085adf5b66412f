"""When to checkpoint, with an interval the supervisor can change while the job runs.

Three parts, from pure to impure:

- :class:`CheckpointInterval` and :class:`CheckpointSchedule` are pure: the
  interval (seconds and/or steps) and the due/record logic, with ``now_s``
  passed in (use ``time.monotonic()``: the wall clock jumps).
- :func:`due_on_all_ranks` makes the decision collective. A checkpoint save is
  a collective operation, so every rank must decide to save at the SAME step.
  Time-based decisions differ across ranks (clocks, step jitter), and so does
  the moment each rank would notice a new interval, so rank 0 alone decides and
  broadcasts its answer; :func:`broadcast_from_rank0` does that with
  ``torch.distributed``. (A steps-only schedule with no override file would
  agree everywhere without it, but an override reaches ranks at different
  steps, so the broadcast is the safe default.)
- :class:`IntervalSource`, the impure part (environment, file, clock), reads
  the interval from the environment (``RESURGO_CKPT_INTERVAL_S``,
  ``RESURGO_CKPT_EVERY_STEPS``) and follows the override file named by
  ``RESURGO_CKPT_INTERVAL_FILE``, which the node agent rewrites atomically
  when the supervisor pushes a new interval.

The training loop, on every rank::

    source = IntervalSource()                        # ConfigError on bad env values
    schedule = CheckpointSchedule(source.current(), start_step=step,
                                  start_s=time.monotonic())
    for batch in loader:
        ...train one step...; step += 1
        schedule.set_interval(source.current())      # cheap: polls the file by mtime
        if due_on_all_ranks(schedule, step, time.monotonic(), rank=rank):
            save(step)                               # collective: every rank is here
            schedule.record_save(step, time.monotonic())

The override file is JSON, ``{"interval_s": 1530.0, "every_steps": null}``
(:func:`format_override`): a key that is present replaces that part of the
environment's interval (``null`` switches it off); a missing key leaves it.
"""

from __future__ import annotations

import json
import logging
import math
import os
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from agent.wire.errors import ConfigError

log = logging.getLogger(__name__)

ENV_INTERVAL_S = "RESURGO_CKPT_INTERVAL_S"
ENV_EVERY_STEPS = "RESURGO_CKPT_EVERY_STEPS"
ENV_INTERVAL_FILE = "RESURGO_CKPT_INTERVAL_FILE"

# The override changes rarely (when the supervisor re-estimates the MTBF); a
# stat every 10 s is invisible next to a training step and still prompt.
DEFAULT_POLL_PERIOD_S = 10.0
# The file holds two numbers; anything larger is not ours.
_OVERRIDE_MAX_BYTES = 4096
_OVERRIDE_KEYS = frozenset({"interval_s", "every_steps"})


@dataclass(frozen=True)
class CheckpointInterval:
    """How often to save: after ``seconds`` elapsed or ``steps`` steps, whichever first.

    ``None`` switches that criterion off; both ``None`` means never save on a
    schedule. Raises ValueError on a non-positive or non-finite value.
    """

    seconds: float | None = None
    steps: int | None = None

    def __post_init__(self) -> None:
        if self.seconds is not None and (
            isinstance(self.seconds, bool)
            or not isinstance(self.seconds, int | float)
            or not math.isfinite(self.seconds)
            or self.seconds <= 0
        ):
            raise ValueError(f"interval seconds must be a positive number, got {self.seconds!r}")
        if self.steps is not None and (
            isinstance(self.steps, bool) or not isinstance(self.steps, int) or self.steps < 1
        ):
            raise ValueError(f"interval steps must be an int >= 1, got {self.steps!r}")


class CheckpointSchedule:
    """Decides whether a save is due; pure (``now_s`` is always passed in).

    The clock starts at ``start_s``/``start_step`` (job start or resume) and
    restarts at every :meth:`record_save`. Changing the interval takes effect
    from the last save: shortening it below the time already elapsed makes a
    save due at once.
    """

    def __init__(self, interval: CheckpointInterval, *, start_step: int, start_s: float) -> None:
        self._interval = interval
        self._last_step = start_step
        self._last_s = start_s

    @property
    def interval(self) -> CheckpointInterval:
        """The interval in force."""
        return self._interval

    def set_interval(self, interval: CheckpointInterval) -> None:
        """Replace the interval (idempotent: call it every step with the source's value)."""
        self._interval = interval

    def set_interval_s(self, seconds: float | None) -> None:
        """Replace only the time criterion (what the supervisor pushes); ValueError if bad."""
        self._interval = replace(self._interval, seconds=seconds)

    def due(self, step: int, now_s: float) -> bool:
        """Whether a save is due after completing ``step`` at time ``now_s``.

        Never twice at one step, and never for a step at or before the last
        save. Only rank 0's answer may be acted on; see :func:`due_on_all_ranks`.
        """
        if step <= self._last_step:
            return False
        steps, seconds = self._interval.steps, self._interval.seconds
        if steps is not None and step - self._last_step >= steps:
            return True
        return seconds is not None and now_s - self._last_s >= seconds

    def record_save(self, step: int, now_s: float) -> None:
        """Note that a save started at ``step``, ``now_s``: the next interval counts from here.

        Record when the save starts, not when an async write finishes: the
        interval is between save starts, as in the Young/Daly model.
        """
        self._last_step = step
        self._last_s = now_s


def broadcast_from_rank0(flag: bool) -> bool:
    """Return rank 0's ``flag`` on every rank (a one-byte ``dist.broadcast``).

    Without an initialised process group (a single process) returns ``flag``.
    The tensor lives on the current CUDA device under NCCL, which cannot carry
    CPU tensors, and on the CPU otherwise.
    """
    # torch here, not at the top: the node agent reads this module's schedule
    # types and starts without importing torch.
    import torch
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return flag
    if dist.get_backend() == "nccl":
        device = torch.device("cuda", torch.cuda.current_device())
    else:
        device = torch.device("cpu")
    tensor = torch.tensor([1 if flag else 0], dtype=torch.uint8, device=device)
    dist.broadcast(tensor, src=0)
    return bool(tensor.item())


def due_on_all_ranks(
    schedule: CheckpointSchedule,
    step: int,
    now_s: float,
    *,
    rank: int,
    broadcast: Callable[[bool], bool] = broadcast_from_rank0,
    check_every_steps: int = 1,
    force: bool = False,
) -> bool:
    """The save decision, identical on every rank: rank 0 decides, ``broadcast`` shares it.

    Every rank must call this at every step (it is a collective). With
    ``check_every_steps = k > 1`` the collective runs only on steps divisible
    by ``k`` — every rank skips the same steps, so they stay in agreement —
    which trades a save up to ``k - 1`` steps late for one sync per ``k`` steps.
    ``broadcast`` is injectable so tests (and other frameworks) can pass their own.
    ``force`` (rank 0's) makes a save due now whatever the schedule says: the node
    agent asked for one before the time limit.
    """
    if check_every_steps < 1:
        raise ValueError(f"check_every_steps must be >= 1, got {check_every_steps!r}")
    if step % check_every_steps:
        return False
    return broadcast((force or schedule.due(step, now_s)) if rank == 0 else False)


def _env_interval_s(environ: Mapping[str, str]) -> float | None:
    text = environ.get(ENV_INTERVAL_S, "").strip()
    if not text:
        return None
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or value <= 0:
        raise ConfigError(
            f"{ENV_INTERVAL_S}={text!r} is not valid: expected a positive number of "
            f"seconds, e.g. {ENV_INTERVAL_S}=1800, or unset it to save by steps only"
        )
    return value


def _env_every_steps(environ: Mapping[str, str]) -> int | None:
    text = environ.get(ENV_EVERY_STEPS, "").strip()
    if not text:
        return None
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise ConfigError(
            f"{ENV_EVERY_STEPS}={text!r} is not valid: expected a whole number of steps "
            f">= 1, e.g. {ENV_EVERY_STEPS}=500, or unset it to save by time only"
        )
    return value


def interval_from_env(environ: Mapping[str, str]) -> CheckpointInterval:
    """The interval the environment asks for; ConfigError naming the variable if bad."""
    return CheckpointInterval(seconds=_env_interval_s(environ), steps=_env_every_steps(environ))


def format_override(interval: CheckpointInterval) -> str:
    """The override file's text for ``interval`` (the node agent writes it atomically)."""
    return json.dumps({"interval_s": interval.seconds, "every_steps": interval.steps}) + "\n"


def parse_override(text: str, base: CheckpointInterval) -> CheckpointInterval:
    """Apply the override file's ``text`` to ``base``; ValueError saying what is wrong."""
    try:
        data: Any = json.loads(text)
    except json.JSONDecodeError as error:
        raise ValueError(f"not JSON: {error}") from error
    if not isinstance(data, dict):
        raise ValueError(f"expected a JSON object, got {type(data).__name__}")
    unknown = sorted(set(data) - _OVERRIDE_KEYS)
    if unknown:
        raise ValueError(f"unknown key(s) {', '.join(unknown)}; expected interval_s, every_steps")
    seconds = data.get("interval_s", base.seconds)
    steps = data.get("every_steps", base.steps)
    return CheckpointInterval(seconds=seconds, steps=steps)


class IntervalSource:
    """The current interval: the environment's, then the override file's latest good one.

    Not pure (reads the environment, stats a file, reads a clock); never raises
    into training after construction. The file is stat-ed at most once per
    ``poll_period_s`` and re-read only when its (mtime, size, inode) changed. A
    malformed file is logged once and ignored, keeping the last good interval;
    a missing one (not written yet, or removed) keeps it too.
    """

    def __init__(
        self,
        environ: Mapping[str, str] | None = None,
        *,
        poll_period_s: float = DEFAULT_POLL_PERIOD_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        env = os.environ if environ is None else environ
        self._current = interval_from_env(env)
        self._base = self._current
        path_text = env.get(ENV_INTERVAL_FILE, "").strip()
        self._path = Path(path_text) if path_text else None
        self._poll_period_s = poll_period_s
        self._clock = clock
        self._last_poll_s: float | None = None
        self._seen: tuple[int, int, int] | None = None

    @property
    def path(self) -> Path | None:
        """The override file followed, or None when ``RESURGO_CKPT_INTERVAL_FILE`` is unset."""
        return self._path

    def current(self) -> CheckpointInterval:
        """The interval in force, polling the override file when a poll period has passed."""
        if self._path is not None:
            now = self._clock()
            if self._last_poll_s is None or now - self._last_poll_s >= self._poll_period_s:
                self._last_poll_s = now
                try:
                    self._poll(self._path)
                except Exception:
                    # A training run must never die for its checkpoint interval;
                    # anything unforeseen keeps the last good value.
                    log.exception("reading checkpoint interval override %s failed", self._path)
        return self._current

    def _poll(self, path: Path) -> None:
        try:
            stat = path.stat()
        except FileNotFoundError:
            return
        signature = (stat.st_mtime_ns, stat.st_size, stat.st_ino)
        if signature == self._seen:
            return
        # Remember the version before parsing it so a bad one is logged once,
        # not at every poll until the node agent rewrites it.
        self._seen = signature
        try:
            with path.open("rb") as handle:
                data = handle.read(_OVERRIDE_MAX_BYTES + 1)
            if len(data) > _OVERRIDE_MAX_BYTES:
                raise ValueError(f"larger than {_OVERRIDE_MAX_BYTES} bytes")
            interval = parse_override(data.decode("utf-8"), self._base)
        except (OSError, ValueError) as error:
            log.warning(
                "ignoring checkpoint interval override %s (%s); keeping %s",
                path,
                error,
                self._current,
            )
            return
        if interval != self._current:
            log.info("checkpoint interval changed from %s to %s", self._current, interval)
        self._current = interval
