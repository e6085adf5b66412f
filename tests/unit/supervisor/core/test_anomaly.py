"""The training-health detector: non-finite losses, loss spikes, grad-norm explosions.

The curves are what training logs look like: a fast fall during an LR warm-up, a slow
decay under a cosine schedule, heavy-tailed per-rank noise (a Student-t, so outliers of
several sigma happen), a small bump at each epoch boundary. Seeded: the same curve
every run. No false positive over them, or over a resume's replayed steps; the
injected faults are found at their onset.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from supervisor.core.anomaly import (
    AnomalyKind,
    LossWatch,
    StepSignal,
    WatchPolicy,
    robust_excess,
)

STEPS = 3000
RANKS = 4


def curve(seed: int, steps: int = STEPS, ranks: int = RANKS) -> np.ndarray:
    """Per-rank losses, shape (steps, ranks): warm-up, cosine decay, noise, epoch bumps."""
    rng = np.random.default_rng(seed)
    t = np.arange(1, steps + 1, dtype=float)
    warmup = 200
    lr = np.where(t < warmup, t / warmup, 0.5 * (1 + np.cos(math.pi * (t - warmup) / steps)))
    progress = np.cumsum(lr) / 150.0  # the fall follows the learning done so far
    mean = 1.8 + 8.5 * np.exp(-progress)
    mean *= 1 + 0.04 * ((t % 1000) < 15)  # a new epoch's first batches: a small bump
    noise = 1 + 0.05 * rng.standard_t(df=4, size=(steps, ranks))
    return mean[:, None] * np.clip(noise, 0.5, None)


def feed(
    watch: LossWatch, losses: np.ndarray, first_step: int = 1, grads: np.ndarray | None = None
):  # type: ignore[no-untyped-def]
    for offset, row in enumerate(losses):
        step = first_step + offset
        signals = [
            StepSignal(
                rank, step, float(loss), None if grads is None else float(grads[offset, rank])
            )
            for rank, loss in enumerate(row)
        ]
        found = watch.feed(signals)
        if found is not None:
            return found
    return None


@pytest.mark.parametrize("seed", range(10))
def test_no_false_positive_over_a_normal_noisy_curve(seed: int) -> None:
    assert feed(LossWatch(), curve(seed)) is None


@pytest.mark.parametrize("seed", range(5))
def test_no_false_positive_over_the_steps_a_resume_replays(seed: int) -> None:
    losses = curve(seed)
    watch = LossWatch()
    assert feed(watch, losses[:1200]) is None
    # The job resumed from step 1000 on other hardware: the replayed steps differ a little.
    replayed = losses[1000:1600] * (
        1 + 0.01 * np.random.default_rng(seed + 100).standard_normal((600, RANKS))
    )
    assert feed(watch, replayed, first_step=1001) is None


def test_no_false_positive_right_after_the_first_steps_of_a_run() -> None:
    # Early training: the loss falls by half in a few steps; the warm-up keeps it unjudged.
    steep = np.array([[10.0 / (1 + 0.3 * s)] * RANKS for s in range(40)])
    steep[25] *= 1.8  # a noisy early step
    assert feed(LossWatch(), steep) is None


def test_a_nan_on_one_rank_is_found_at_its_step_even_during_warm_up() -> None:
    losses = curve(1)[:300]
    losses[5, 2] = math.nan
    found = feed(LossWatch(), losses)
    assert found is not None and found.kind is AnomalyKind.NON_FINITE
    assert (found.rank, found.onset_step) == (2, 6)


def test_an_infinite_grad_norm_is_non_finite_too() -> None:
    losses = curve(2)[:100]
    grads = np.full_like(losses, 1.0)
    grads[70, 0] = math.inf
    found = feed(LossWatch(), losses, grads=grads)
    assert found is not None and found.kind is AnomalyKind.NON_FINITE and found.onset_step == 71


@pytest.mark.parametrize("factor", [2.0, 3.0, 10.0])
def test_a_loss_spike_is_found_at_its_onset(factor: float) -> None:
    losses = curve(3)
    losses[1500:, 1] *= factor  # the model went bad at step 1501 and stays bad
    found = feed(LossWatch(), losses)
    assert found is not None and found.kind is AnomalyKind.LOSS_SPIKE
    assert (found.rank, found.onset_step) == (1, 1501)
    assert "x the median" in found.detail


def test_a_spike_must_last_spike_steps_steps_and_its_onset_is_the_first() -> None:
    losses = curve(4)
    losses[1500, 0] *= 3  # one bad batch, recovered at once
    losses[1700:1702, 0] *= 3  # two
    losses[2000:2003, 0] *= 3  # three in a row
    assert feed(LossWatch(WatchPolicy(spike_steps=4)), losses.copy()) is None
    found = feed(LossWatch(WatchPolicy(spike_steps=3)), losses)
    assert found is not None and found.onset_step == 2001


def test_a_late_flat_curve_does_not_turn_noise_into_spikes() -> None:
    # Late training: the curve is nearly flat, its MAD tiny; a 5 % wobble is no spike.
    flat = np.full((400, RANKS), 1.9) + np.random.default_rng(5).normal(0, 1e-4, (400, RANKS))
    flat[300] *= 1.05
    assert feed(LossWatch(), flat) is None


def test_a_grad_norm_explosion_is_found() -> None:
    losses = curve(6)[:600]
    grads = 1.0 + 0.1 * np.random.default_rng(6).standard_normal(losses.shape)
    grads[500, 3] = 40.0
    found = feed(LossWatch(), losses, grads=grads)
    assert found is not None and found.kind is AnomalyKind.GRAD_EXPLOSION
    assert (found.rank, found.onset_step) == (3, 501)


def test_after_a_rollback_the_bad_steps_are_forgotten_and_the_good_history_is_the_baseline() -> (
    None
):
    losses = curve(7)
    bad = losses.copy()
    bad[1500:1600] *= 4
    watch = LossWatch()
    found = feed(watch, bad[:1600])
    assert found is not None and found.onset_step == 1501
    watch.rolled_back_to(1400)
    # The run resumes from step 1400 with the poisoned batches skipped: healthy again.
    assert feed(watch, losses[1400:2000], first_step=1401) is None


@pytest.mark.parametrize(
    "changes",
    [{"window": 3}, {"warmup_steps": 0}, {"warmup_steps": 60}, {"spike_steps": 0},
     {"spike_score": 0.0}, {"grad_min_ratio": math.nan}],
)  # fmt: skip
def test_bad_thresholds_are_refused_with_their_name(changes: dict[str, float]) -> None:
    with pytest.raises(ValueError, match="anomaly"):
        WatchPolicy(**changes)  # type: ignore[arg-type]


def test_a_resume_from_far_back_is_judged_against_the_steps_before_it_not_after() -> None:
    losses = curve(8)
    watch = LossWatch()
    assert feed(watch, losses[:1500]) is None
    # Resumed from an old permanent checkpoint at step 300: its steps are early-training
    # losses, several times those of step 1500. They are judged against the steps
    # before 300 where those are still kept, else once their own fill the warm-up.
    assert feed(watch, losses[300:700], first_step=301) is None


def test_an_unsettled_start_is_not_judged_before_the_warm_up() -> None:
    # The first steps of a run under LR warm-up: flat, then a rise for a few steps.
    start = np.array([[6.0 + 0.01 * (s % 3)] * RANKS for s in range(30)])
    start[12:18] *= 2.0
    assert feed(LossWatch(WatchPolicy(warmup_steps=20)), start.copy()) is None
    found = feed(LossWatch(WatchPolicy(warmup_steps=5)), start)
    assert found is not None and found.onset_step == 13  # judged early, it would be a spike


def test_the_same_spike_again_after_a_resume_is_found_again_at_the_same_onset() -> None:
    losses = curve(9)
    bad = losses.copy()
    bad[1500:1700] *= 4
    watch = LossWatch()
    first = feed(watch, bad[:1700])
    assert first is not None and first.onset_step == 1501
    # Alert-only, no rollback; a later fault resumes the job from step 1400 and it
    # meets the same data again: the replay supersedes the old steps after 1400.
    again = feed(watch, bad[1400:1700], first_step=1401)
    assert again is not None and again.onset_step == 1501


def test_the_robust_excess_is_the_same_whether_a_minimum_ratio_is_asked_or_not() -> None:
    history = [2.0, 2.1, 1.9, 2.05, 1.95, 2.2, 1.8]
    score, ratio, median = robust_excess(4.0, history)  # type: ignore[misc]
    assert (ratio, median) == (2.0, 2.0)
    assert score == pytest.approx(2.0 / (1.4826 * 0.1))
    assert robust_excess(4.0, history, min_ratio=1.5) == (score, ratio, median)
    # Under the minimum ratio: no score (its second median is not taken).
    assert robust_excess(2.5, history, min_ratio=1.5) is None
    assert robust_excess(2.5, history)[1] == 1.25  # type: ignore[index]
    # A history whose median is not positive: every value is infinitely over it.
    assert robust_excess(0.1, [0.0, 0.0, 0.0], min_ratio=1.5) == (math.inf, math.inf, 0.0)
