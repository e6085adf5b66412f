"""Training-health faults that never throw: a non-finite loss, a loss spike, a grad-norm
explosion, found in the step reports the ranks already send; pure.

A :class:`LossWatch` per job takes each rank's reported steps (``feed``) and
returns the first :class:`Anomaly` it finds, with its onset step. The rules:

- **non-finite**: a rank reported a NaN or an infinite loss (or grad norm).
  Always an anomaly, from the first step, warm-up or not.
- **spike**: the loss is far above the rank's trailing window of the
  ``window`` steps before it, by a robust score: ``(loss - median) /
  (1.4826 * MAD)`` of at least ``spike_score`` AND at least
  ``spike_min_ratio`` times the median. The first guards against the
  noise of the curve, the second against a window so flat that its MAD is
  near zero (late in training). ``spike_steps`` consecutive steps over both
  bars make the verdict (default 3: one hard batch is no fault, a model gone
  bad stays bad); its onset is the first of them.
- **grad-norm explosion**, where the script reports a grad norm: the same
  robust rule with ``grad_score`` and ``grad_min_ratio``.

No spike or explosion is judged before the window holds ``warmup_steps``
steps of the rank: early training falls fast and its noise is large. The
window is kept in step order: a report of an earlier step than the newest is
a replay after a resume, which drops that step and the ones after it (the
resumed run redoes them), so a replayed step is judged against the history
before it, never against itself or the run it replaces. The same holds after
a rollback past an anomaly (:meth:`LossWatch.rolled_back_to`): the baseline is
the good history before the restart point. Each rank's series costs O(1) a
step (appends, a bounded window, a bisect on replay).
"""

from __future__ import annotations

import bisect
import enum
import math
import statistics
from collections.abc import Iterable
from dataclasses import dataclass, field

# The MAD of a normal sample times this is its standard deviation.
MAD_TO_SIGMA = 1.4826
# Steps kept per rank, in windows: enough for a replay after a resume to find
# the history before the checkpoint it resumed from.
KEPT_WINDOWS = 8


class AnomalyAction(enum.Enum):
    """What the supervisor does about a training anomaly (policy ``anomaly_action``)."""

    OFF = "off"  # no detection at all
    ALERT = "alert"  # an alert and an event; the job trains on
    ROLLBACK = "rollback"  # stop, roll back before the onset, skip its data, relaunch


class AnomalyKind(enum.Enum):
    """What went wrong with the training signal."""

    NON_FINITE = "non_finite"  # a NaN or infinite loss or grad norm
    LOSS_SPIKE = "loss_spike"  # the loss far above its trailing window
    GRAD_EXPLOSION = "grad_explosion"  # the grad norm far above its trailing window


@dataclass(frozen=True)
class WatchPolicy:
    """The detector's thresholds (the supervisor's ``[policy]`` names them ``anomaly_*``)."""

    window: int = 50
    warmup_steps: int = 20
    spike_score: float = 8.0
    spike_min_ratio: float = 1.5
    spike_steps: int = 3
    grad_score: float = 10.0
    grad_min_ratio: float = 5.0

    def __post_init__(self) -> None:
        if self.window < 4:
            raise ValueError(f"anomaly window {self.window} must be at least 4 steps")
        if not 1 <= self.warmup_steps <= self.window:
            raise ValueError(f"anomaly warm-up {self.warmup_steps} must be 1..window")
        if self.spike_steps < 1:
            raise ValueError(f"anomaly spike_steps {self.spike_steps} must be >= 1")
        for name in ("spike_score", "spike_min_ratio", "grad_score", "grad_min_ratio"):
            value = getattr(self, name)
            if not math.isfinite(value) or value <= 0:
                raise ValueError(f"anomaly {name} {value!r} must be a positive number")


@dataclass(frozen=True)
class StepSignal:
    """What one rank reported for one step: its loss and, where the script gives one,
    its grad norm (None: not reported; a float that is not finite is kept as is)."""

    rank: int
    step: int
    loss: float | None
    grad_norm: float | None = None


@dataclass(frozen=True)
class Anomaly:
    """The first bad step (``onset_step``) of ``kind`` on ``rank``, and why, in words.

    ``on_loss``: found in the rank's own loss, not in its grad norm. A grad norm
    is usually taken after the gradients' all-reduce, so it is every rank's
    alike and cannot say which rank went bad first; the loss can.
    """

    kind: AnomalyKind
    rank: int
    onset_step: int
    value: float
    baseline: float | None
    detail: str
    on_loss: bool = True


@dataclass
class _Series:
    """One rank's values in step order. A report of a step at or before the newest
    is a replay (the rank resumed from a checkpoint): it replaces that step and
    every later one, which the resumed run will redo."""

    steps: list[int] = field(default_factory=list)
    values: list[float] = field(default_factory=list)

    def before(self, step: int, count: int) -> list[float]:
        """The finite values of the ``count`` steps reported before ``step``."""
        end = bisect.bisect_left(self.steps, step)
        return [v for v in self.values[max(0, end - count) : end] if math.isfinite(v)]

    def add(self, step: int, value: float, keep: int) -> None:
        """Record ``value`` at ``step``; keep at most about ``keep`` steps."""
        if self.steps and step <= self.steps[-1]:
            self.truncate_after(step - 1)
        self.steps.append(step)
        self.values.append(value)
        if len(self.steps) > 2 * keep:  # trimmed in batches, not per step
            del self.steps[:-keep], self.values[:-keep]

    def truncate_after(self, step: int) -> None:
        """Forget every step after ``step``."""
        end = bisect.bisect_right(self.steps, step)
        del self.steps[end:], self.values[end:]


def robust_excess(
    value: float, history: list[float], min_ratio: float = -math.inf
) -> tuple[float, float, float] | None:
    """``(score, ratio, median)`` of ``value`` against ``history``: the robust z-score
    ``(value - median) / (1.4826 * MAD)`` (infinite for a flat history that
    ``value`` exceeds), ``value / median`` (infinite for a median <= 0) and the
    median; None when the ratio is under ``min_ratio``. The score's second median
    is then not taken: most steps' values are under the median of those before."""
    median = statistics.median(history)
    ratio = value / median if median > 0 else math.inf
    if ratio < min_ratio:
        return None
    mad = statistics.median(abs(v - median) for v in history)
    excess = value - median
    flat = math.inf if excess > 0 else 0.0
    score = excess / (MAD_TO_SIGMA * mad) if mad > 0 else flat
    return score, ratio, median


class LossWatch:
    """One job's detector: feed it step reports, get the first anomaly (see the module)."""

    def __init__(self, policy: WatchPolicy | None = None) -> None:
        self.policy = policy or WatchPolicy()
        self._loss: dict[int, _Series] = {}
        self._grad: dict[int, _Series] = {}
        self._over: dict[int, list[int]] = {}  # rank -> consecutive spiking steps

    def feed(self, signals: Iterable[StepSignal]) -> Anomaly | None:
        """Take reports (any ranks, steps in the order each rank made them); the first
        anomaly among them, or None."""
        found: Anomaly | None = None
        for signal in signals:
            anomaly = self._one(signal)
            if anomaly is not None and (found is None or anomaly.onset_step < found.onset_step):
                found = anomaly
        return found

    def rolled_back_to(self, step: int) -> None:
        """The job resumes after ``step``: forget everything reported after it."""
        for series in (*self._loss.values(), *self._grad.values()):
            series.truncate_after(step)
        self._over.clear()

    def _one(self, signal: StepSignal) -> Anomaly | None:
        for value, name in ((signal.loss, "loss"), (signal.grad_norm, "grad norm")):
            if value is not None and not math.isfinite(value):
                self._record(signal)
                return Anomaly(
                    AnomalyKind.NON_FINITE, signal.rank, signal.step, value, None,
                    f"rank {signal.rank} reported a {name} of {value} at step {signal.step}",
                    on_loss=name == "loss",
                )  # fmt: skip
        spike = self._spike(signal)
        grad = self._explosion(signal)
        self._record(signal)
        return spike or grad

    def _record(self, signal: StepSignal) -> None:
        keep = KEPT_WINDOWS * self.policy.window
        for value, series in ((signal.loss, self._loss), (signal.grad_norm, self._grad)):
            if value is not None:
                series.setdefault(signal.rank, _Series()).add(signal.step, value, keep)

    def _spike(self, signal: StepSignal) -> Anomaly | None:
        policy = self.policy
        if signal.loss is None:
            return None
        history = self._loss.get(signal.rank, _Series()).before(signal.step, policy.window)
        over = self._over.setdefault(signal.rank, [])
        if len(history) < policy.warmup_steps:
            over.clear()
            return None
        excess = robust_excess(signal.loss, history, policy.spike_min_ratio)
        if excess is None or excess[0] < policy.spike_score:
            over.clear()
            return None
        score, ratio, median = excess
        if over and over[-1] != signal.step - 1:
            over.clear()
        over.append(signal.step)
        if len(over) < policy.spike_steps:
            return None
        return Anomaly(
            AnomalyKind.LOSS_SPIKE, signal.rank, over[0], signal.loss, median,
            f"rank {signal.rank}'s loss {signal.loss:.4g} at step {signal.step} is {ratio:.2f}x "
            f"the median {median:.4g} of its last {len(history)} steps (robust score "
            f"{score:.1f}, threshold {policy.spike_score:g})",
        )  # fmt: skip

    def _explosion(self, signal: StepSignal) -> Anomaly | None:
        policy = self.policy
        if signal.grad_norm is None:
            return None
        history = self._grad.get(signal.rank, _Series()).before(signal.step, policy.window)
        if len(history) < policy.warmup_steps:
            return None
        excess = robust_excess(signal.grad_norm, history, policy.grad_min_ratio)
        if excess is None or excess[0] < policy.grad_score:
            return None
        _, ratio, median = excess
        return Anomaly(
            AnomalyKind.GRAD_EXPLOSION, signal.rank, signal.step, signal.grad_norm, median,
            f"rank {signal.rank}'s grad norm {signal.grad_norm:.4g} at step {signal.step} is "
            f"{ratio:.1f}x the median {median:.4g} of its last {len(history)} steps",
            on_loss=False,
        )  # fmt: skip
