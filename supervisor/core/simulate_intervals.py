"""The best checkpoint interval for a simulated job: formulas and a fitted sweep; pure.

:func:`optima_s` gives Young's and Daly's intervals for a job's
:class:`~supervisor.core.simulate_params.Params`;
:func:`best_interval_s` finds the optimum of the goodput curve that
:func:`supervisor.core.simulate.sweep` measured, to check those formulas against.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from agent.checkpoint.interval import daly_interval_s, young_interval_s
from supervisor.core.simulate_params import Params


def optima_s(params: Params) -> tuple[float, float]:
    """Young's and Daly's intervals for the save stall and the job's MTBF at full size."""
    mtbf = params.job_mtbf_s()
    return young_interval_s(params.save_stall_s, mtbf), daly_interval_s(params.save_stall_s, mtbf)


@dataclass(frozen=True)
class SweepPoint:
    """Mean goodput at one fixed interval, over the sweep's seeds."""

    interval_s: float
    goodput: float


def best_interval_s(points: Sequence[SweepPoint], *, above_s: float = 0.0) -> float:
    """The interval of highest goodput on a cubic fitted in log(interval) to ``points``.

    Single runs are noisy near the optimum, where the curve is flat, so the
    fit uses the whole curve; a cubic, because the curve is not symmetric in
    log(interval) (lost work grows faster past the optimum than stalls grow
    before it), which would pull a parabola's vertex low. Only points above
    ``above_s`` are fitted: pass the background write time, below which saves
    wait for each other and goodput falls off a cliff of another shape. The
    answer stays within the fitted range.
    """
    import numpy as np

    used = [point for point in points if point.interval_s > above_s]
    if len(used) < 4:
        raise ValueError(f"a sweep needs at least 4 intervals above {above_s:g} s to fit")
    x = np.log([point.interval_s for point in used])
    y = np.array([point.goodput for point in used])
    fine = np.linspace(x.min(), x.max(), 2001)
    fitted = np.polyval(np.polyfit(x, y, 3), fine)
    return float(np.exp(fine[int(np.argmax(fitted))]))
