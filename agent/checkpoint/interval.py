"""How often to checkpoint: Young's and Daly's optimal intervals, and their cost.

The cost model (DESIGN §5, seeds): checkpointing every ``τ`` seconds with a
blocking cost ``δ`` per save spends ``δ/τ`` of the run saving; a failure lands
uniformly inside an interval and loses half of it on average, so at one failure
per MTBF ``M`` the run loses ``τ/2M`` more. Minimising ``δ/τ + τ/2M`` gives
Young's ``τ = √(2δM)``; Daly's higher-order correction (which also accounts for
the restart re-paying part of the interval) is

    τ = √(2δM)·[1 + ⅓·√(δ/2M) + (δ/2M)/9] - δ   for δ < 2M, else τ = M.

Check values: M = 24 h, δ = 5 min → Daly 116.7 min; M = 3 h, δ = 2 min →
about 26 min (Young 26.8, Daly 25.5), Llama 3's observed range.

With asynchronous saves (``dcp.async_save``) ``δ`` is the *stall* (the
device-to-host copy the training loop waits for), not the write. The write runs
in the background and only one save may be in flight, so an interval shorter
than the background write makes the next save wait for the previous one: a
hidden stall the formula does not see. :func:`recommended_interval_s` therefore
takes Daly's interval for the stall and raises it to at least the write time
plus headroom.

This module is pure: plain arithmetic, no clock, no OS. The CLI (``resurgo
interval``), the supervisor (which pushes a new interval to running jobs) and
the simulator all import it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

# Background write times vary with filesystem load (a shared Lustre/GPFS under
# other jobs' checkpoints); keeping the interval 10% above the observed write
# time keeps one slow write from stalling the next save.
WRITE_HEADROOM = 1.1


def _check_mtbf(mtbf_s: float) -> None:
    if not math.isfinite(mtbf_s) or mtbf_s <= 0:
        raise ValueError(f"MTBF must be a positive, finite number of seconds, got {mtbf_s!r}")


def _check_cost(value: float, name: str) -> None:
    if not math.isfinite(value) or value < 0:
        raise ValueError(f"{name} must be a non-negative, finite number of seconds, got {value!r}")


def young_interval_s(save_cost_s: float, mtbf_s: float) -> float:
    """Young's first-order optimal interval ``√(2δM)`` in seconds.

    ``save_cost_s`` is the blocking cost of one save (δ), ``mtbf_s`` the mean
    time between failures of the whole job (M). Raises ValueError on a negative
    or non-finite cost or a non-positive MTBF.
    """
    _check_cost(save_cost_s, "save cost")
    _check_mtbf(mtbf_s)
    return math.sqrt(2.0 * save_cost_s * mtbf_s)


def daly_interval_s(save_cost_s: float, mtbf_s: float) -> float:
    """Daly's higher-order optimal interval in seconds (see the module docstring).

    For ``δ ≥ 2M`` a save costs more than the expected run between failures
    and Daly's answer is ``τ = M``. Same validation as :func:`young_interval_s`.
    """
    _check_cost(save_cost_s, "save cost")
    _check_mtbf(mtbf_s)
    if save_cost_s >= 2.0 * mtbf_s:
        return mtbf_s
    ratio = save_cost_s / (2.0 * mtbf_s)
    young = math.sqrt(2.0 * save_cost_s * mtbf_s)
    return young * (1.0 + math.sqrt(ratio) / 3.0 + ratio / 9.0) - save_cost_s


def recommended_interval_s(stall_s: float, background_write_s: float, mtbf_s: float) -> float:
    """The interval to use, in seconds: ``max(daly(stall, M), 1.1 * write)``.

    ``stall_s`` is what each save blocks training for (the whole save when
    saving synchronously; the staging copy with ``dcp.async_save``);
    ``background_write_s`` is how long the write then runs beside training (0
    for synchronous saves). One save is in flight at a time, so the interval
    must exceed the write or the next save waits for it; see
    :data:`WRITE_HEADROOM` for the margin.
    """
    _check_cost(background_write_s, "background write time")
    return max(daly_interval_s(stall_s, mtbf_s), WRITE_HEADROOM * background_write_s)


def expected_overhead_fraction(interval_s: float, save_cost_s: float, mtbf_s: float) -> float:
    """Expected share of wall time lost, ``δ/τ + τ/2M``, for reporting.

    The seeds' cost model: saving (``δ/τ``) plus work lost to failures
    (``τ/2M``). It is first order: it can exceed 1 for absurd inputs, which is
    the honest answer ("this setting cannot make progress"). Raises ValueError
    on a non-positive interval as well as on bad cost or MTBF.
    """
    if not math.isfinite(interval_s) or interval_s <= 0:
        raise ValueError(
            f"interval must be a positive, finite number of seconds, got {interval_s!r}"
        )
    _check_cost(save_cost_s, "save cost")
    _check_mtbf(mtbf_s)
    return save_cost_s / interval_s + interval_s / (2.0 * mtbf_s)


@dataclass(frozen=True)
class IntervalAdvice:
    """Young, Daly and the recommended interval for one set of inputs, with costs.

    Every ``*_s`` field is in seconds and every ``*_overhead`` field is the
    :func:`expected_overhead_fraction` at that interval, with δ = the stall.
    """

    stall_s: float
    background_write_s: float
    mtbf_s: float
    young_s: float
    daly_s: float
    recommended_s: float
    young_overhead: float
    daly_overhead: float
    recommended_overhead: float


def _overhead_or_zero(interval_s: float, stall_s: float, mtbf_s: float) -> float:
    # A zero interval only comes out of the formulas for a free save (δ = 0,
    # no background write): nothing is spent saving and nothing is lost.
    if interval_s == 0:
        return 0.0
    return expected_overhead_fraction(interval_s, stall_s, mtbf_s)


def advise(stall_s: float, mtbf_s: float, background_write_s: float = 0.0) -> IntervalAdvice:
    """Compute every interval and its expected overhead; raises ValueError on bad input."""
    young = young_interval_s(stall_s, mtbf_s)
    daly = daly_interval_s(stall_s, mtbf_s)
    recommended = recommended_interval_s(stall_s, background_write_s, mtbf_s)
    return IntervalAdvice(
        stall_s=stall_s,
        background_write_s=background_write_s,
        mtbf_s=mtbf_s,
        young_s=young,
        daly_s=daly,
        recommended_s=recommended,
        young_overhead=_overhead_or_zero(young, stall_s, mtbf_s),
        daly_overhead=_overhead_or_zero(daly, stall_s, mtbf_s),
        recommended_overhead=_overhead_or_zero(recommended, stall_s, mtbf_s),
    )
