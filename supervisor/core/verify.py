"""Resume verification from the steps the ranks reported: did the resume reproduce the run?

Training ranks report each finished step (``TrainingSession.step_done``):
step ``N`` is the N-th optimizer step, with its loss and the data cursor (global
samples consumed before it). The daemon stores every ``step_losses`` event
under the attempt it belongs to and, after storing reports of the current
attempt, calls :func:`check_resume` until it returns a result; the comparisons
themselves are :func:`supervisor.core.goodput.verify_resume` and
:func:`~supervisor.core.goodput.verify_cursor`. Reads go through :class:`StepSource`
(the store) and are all indexed: while waiting for data a call costs two or
three index probes; once the replay is in, one range read per attempt.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import replace
from typing import Protocol

from supervisor.core.goodput import VerifyResult, verify_cursor, verify_resume
from supervisor.store.rows import StepRow


class StepSource(Protocol):
    """The store's step reports, as :func:`check_resume` reads them."""

    def last_reported_step(self, job_id: str, attempt: int) -> int | None:
        """The highest step any rank reported in ``attempt``."""
        ...

    def first_reported_step(self, job_id: str, attempt: int) -> int | None:
        """The lowest step any rank reported in ``attempt``."""
        ...

    def reports_of_step(self, job_id: str, step: int) -> list[StepRow]:
        """Every attempt's and rank's report of ``step``, by attempt then rank."""
        ...

    def steps_for(
        self,
        job_id: str,
        attempt: int | None = None,
        *,
        first_step: int | None = None,
        last_step: int | None = None,
    ) -> list[StepRow]:
        """The reports of one attempt with steps in ``[first_step, last_step]``."""
        ...


def check_resume(
    store: StepSource,
    job_id: str,
    attempt: int,
    resume_step: int,
    same_size: bool,
    tolerance: float = 0.0,
    until_step: int | None = None,
) -> VerifyResult | None:
    """Compare launch ``attempt``, resumed from the checkpoint of ``resume_step``, with before.

    ``until_step``: the attempt rolled back past a training anomaly whose onset
    is that step, skipping its data; from there on it is meant to differ, so
    only the steps before it are compared.

    The replayed steps start at ``resume_step + 1``. **Before the fault** means
    the reports of the *reference attempt*: the newest attempt earlier than
    ``attempt`` that reported step ``resume_step + 1``; and **the last step
    before the fault** is the highest step that attempt reported. With several
    faults this is the run as it last went through these steps. Say attempt 0
    reached step 150 (checkpoint at 100) and failed; attempt 1 resumed from
    100, reached 130 and failed: attempt 2, resumed from 100 (or from a
    checkpoint attempt 1 saved at 120), is compared with attempt 1 up to step
    130, and attempt 0's steps 131-150 are not compared. An attempt that
    failed before reporting ``resume_step + 1`` is passed over.

    ``same_size``: ``attempt`` runs with the reference attempt's world size
    (normally the previous attempt's). Then every replayed step's loss must
    equal the one reported before, within ``tolerance`` (0: exactly), per
    rank, on the steps both attempts reported. A loss
    reported as None (no finite loss) on one side only is a divergence; on
    both sides the step is skipped. Resized: the cursor of step
    ``resume_step + 1`` must equal the reference's.

    None while there is not enough data: the attempt has not reported a
    replayed step yet, or (same size) has not yet reached the last step before
    the fault. Otherwise a result, not verified with ``compared == 0`` when
    nothing can be compared (no earlier report of the step, no loss, no
    cursor); its reason names both attempts. Deterministic: it depends only on
    what is stored.
    """
    if tolerance < 0 or not math.isfinite(tolerance):
        raise ValueError(f"tolerance must be finite and >= 0, got {tolerance!r}")
    first = resume_step + 1
    last_now = store.last_reported_step(job_id, attempt)
    if last_now is None or last_now < first:
        return None
    # What the ranks did, not what the supervisor told them: an attempt that
    # trained a step before the checkpoint's did not resume from it. Seeded
    # runs replay the same losses from step 1, so this is the only tell of a
    # relaunch that ignored its checkpoint.
    lowest = store.first_reported_step(job_id, attempt)
    if lowest is not None and lowest < resume_step:
        return VerifyResult(
            False,
            lowest,
            0,
            f"attempt {attempt} trained step {lowest}: it did not resume from the "
            f"checkpoint of step {resume_step} (it started afresh or from another one)",
        )
    reports = store.reports_of_step(job_id, first)
    earlier = [row.attempt for row in reports if row.attempt < attempt]
    if not earlier:
        return VerifyResult(
            False,
            None,
            0,
            f"attempt {attempt}: no earlier attempt reported step {first}, so nothing from "
            "before the fault can be compared with the resume",
        )
    reference = max(earlier)
    if same_size:
        fault_step = store.last_reported_step(job_id, reference)
        if fault_step is not None and until_step is not None:
            fault_step = min(fault_step, until_step - 1)
            if fault_step < first:
                return VerifyResult(
                    False, None, 0,
                    f"attempt {attempt} rolled back to step {resume_step} past the anomaly at "
                    f"step {until_step}: no step before the anomaly was replayed to compare",
                )  # fmt: skip
        if fault_step is None or last_now < fault_step:
            return None
        before = store.steps_for(job_id, reference, first_step=first, last_step=fault_step)
        after = store.steps_for(job_id, attempt, first_step=first, last_step=fault_step)
        result = _compare_losses(_by_rank(before), _by_rank(after), tolerance)
    else:
        result = _compare_cursors(reports, attempt, reference, first)
    return replace(result, reason=f"attempt {attempt} against attempt {reference}: {result.reason}")


def _by_rank(rows: Iterable[StepRow]) -> dict[int, dict[int, float | None]]:
    losses: dict[int, dict[int, float | None]] = {}
    for row in rows:
        losses.setdefault(row.global_rank, {})[row.step] = row.loss
    return losses


def _compare_losses(
    before: dict[int, dict[int, float | None]],
    after: dict[int, dict[int, float | None]],
    tolerance: float,
) -> VerifyResult:
    results: list[tuple[int, VerifyResult]] = []
    for rank in sorted(before.keys() & after.keys()):
        old, new = before[rank], after[rank]
        steps = [s for s in sorted(old.keys() & new.keys()) if (old[s], new[s]) != (None, None)]
        if steps:
            result = verify_resume(
                {s: _number(old[s]) for s in steps}, {s: _number(new[s]) for s in steps}, tolerance
            )
            results.append((rank, result))
    compared = sum(result.compared for _, result in results)
    if not results:
        return VerifyResult(
            False,
            None,
            0,
            "no replayed step carries a loss on both sides: pass the loss to "
            "TrainingSession.step_done(loss=...) to verify same-size resumes",
        )
    diverged = [
        (result.first_diverging_step, rank, result)
        for rank, result in results
        if result.first_diverging_step is not None
    ]
    if diverged:
        step, rank, result = min(diverged, key=lambda item: (item[0], item[1]))
        return VerifyResult(False, step, compared, f"rank {rank}, {result.reason}")
    ranks = len(results)
    return VerifyResult(
        True, None, compared, f"{compared} replayed step(s) match ({ranks} rank(s) compared)"
    )


def _number(loss: float | None) -> float:
    # NaN stands for "no finite loss": verify_resume holds NaN equal only to NaN.
    return math.nan if loss is None else loss


def _compare_cursors(
    reports: list[StepRow], attempt: int, reference: int, step: int
) -> VerifyResult:
    current = [row for row in reports if row.attempt == attempt]
    if not current:
        return VerifyResult(
            False,
            None,
            0,
            f"step {step}, the first after the resume, was not reported (its report was "
            "lost), so the data cursor cannot be compared",
        )
    after = _first_cursor(current)
    if after is None:
        return VerifyResult(
            False,
            None,
            0,
            f"step {step} was reported without a data cursor: give TrainingSession the "
            "GlobalBatchSampler to verify resized resumes",
        )
    before = _first_cursor(row for row in reports if row.attempt == reference)
    if before is None:
        return VerifyResult(
            False,
            None,
            0,
            f"step {step} was reported before the fault without a data cursor: nothing to "
            "compare the resume's cursor with",
        )
    return verify_cursor(before, after, step)


def _first_cursor(rows: Iterable[StepRow]) -> int | None:
    """The cursor of the lowest rank that reported one (every rank's is the same)."""
    return next((row.cursor for row in rows if row.cursor is not None), None)
