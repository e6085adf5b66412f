"""supervisor.core.verify.check_resume over a real store: which reports it compares, and when."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest

from supervisor.core.goodput import VerifyResult
from supervisor.core.verify import check_resume
from supervisor.store import StepRow, Store

NOW = 1_700_000_000.0
JOB = "4711"


@pytest.fixture
def store(tmp_path: Path) -> Iterator[Store]:
    with Store.open(tmp_path / "resurgo.db") as opened:
        opened.upsert_job(
            JOB, state="running", record={}, now_s=NOW, name="t", original_nodes=2, min_nodes=1
        )
        yield opened


def loss(step: int) -> float:
    return 10.0 / step


def report(
    store: Store,
    attempt: int,
    steps: Sequence[int],
    *,
    rank: int = 0,
    losses: dict[int, float | None] | None = None,
    cursors: dict[int, int | None] | None = None,
) -> None:
    """``steps`` of ``attempt`` as a deterministic run reports them, except where overridden."""
    losses, cursors = losses or {}, cursors or {}
    entries = [
        {
            "step": step,
            "loss": losses.get(step, loss(step)),
            "cursor": cursors.get(step, (step - 1) * 8),
        }
        for step in steps
    ]
    store.record_steps(JOB, attempt, rank, entries, NOW)


def same_size(store: Store, attempt: int = 1, resume_step: int = 5, **kw: float) -> VerifyResult:
    result = check_resume(store, JOB, attempt, resume_step, True, **kw)
    assert result is not None
    return result


# ---------------------------------------------------------------------------
# Same world size: losses.


def test_replayed_losses_equal_to_the_bit_are_verified(store: Store) -> None:
    report(store, 0, range(1, 11))
    report(store, 1, range(6, 11))
    result = same_size(store)
    assert (result.verified, result.first_diverging_step, result.compared) == (True, None, 5)
    assert result.reason.startswith("attempt 1 against attempt 0: 5 replayed step(s) match")


def test_the_first_diverging_step_is_named(store: Store) -> None:
    report(store, 0, range(1, 11))
    report(store, 1, range(6, 11), losses={8: loss(8) + 1e-12, 9: 0.0})
    result = same_size(store)
    assert (result.verified, result.first_diverging_step, result.compared) == (False, 8, 5)
    assert "step 8" in result.reason and "nondeterministic" in result.reason


def test_a_rollback_past_an_anomaly_compares_only_the_steps_before_its_onset(
    store: Store,
) -> None:
    report(store, 0, range(1, 11), losses={9: None, 10: None})  # NaN from step 9
    # Resumed from 5, skipping the data from step 9 on: steps 9-10 differ by design.
    report(store, 1, range(6, 11), losses={9: 0.5, 10: 0.4})
    assert same_size(store).first_diverging_step == 9  # compared through the onset: diverges
    result = same_size(store, until_step=9)
    assert (result.verified, result.compared) == (True, 3)
    # Resumed from the step right before the onset: nothing before it to compare.
    report(store, 2, range(9, 11), losses={9: 0.5, 10: 0.4})
    nothing = check_resume(store, JOB, 2, 8, True, until_step=9)
    assert nothing is not None and (nothing.verified, nothing.compared) == (False, 0)
    assert "past the anomaly at step 9" in nothing.reason


def test_a_tolerance_accepts_differences_within_it(store: Store) -> None:
    report(store, 0, range(1, 11))
    report(store, 1, range(6, 11), losses={7: loss(7) + 1e-7})
    assert same_size(store, tolerance=1e-6).verified
    assert same_size(store, tolerance=0.0).first_diverging_step == 7
    with pytest.raises(ValueError, match="tolerance"):
        check_resume(store, JOB, 1, 5, True, tolerance=-1.0)


def test_the_earliest_divergence_of_any_rank_is_named(store: Store) -> None:
    report(store, 0, range(1, 11))
    report(store, 0, range(1, 11), rank=1)
    report(store, 1, range(6, 11), losses={9: 0.0})
    report(store, 1, range(6, 11), rank=1, losses={7: 0.0})
    result = same_size(store)
    assert (result.first_diverging_step, result.compared) == (7, 10)
    assert "rank 1, step 7" in result.reason


@pytest.mark.parametrize(
    ("after", "expected"),
    [
        ({7: None, 9: None}, (True, None, 3)),  # both sides: skipped, not compared
        ({7: None}, (False, 9, 4)),  # a loss before, none after: diverged
        ({7: None, 9: None, 10: None, 8: 0.5}, (False, 8, 3)),
    ],
)
def test_no_loss_on_both_sides_is_skipped_and_on_one_side_is_a_divergence(
    store: Store, after: dict[int, float | None], expected: tuple[bool, int | None, int]
) -> None:
    report(store, 0, range(1, 11), losses={7: None, 9: None})
    report(store, 1, range(6, 11), losses=after)
    result = same_size(store)
    assert (result.verified, result.first_diverging_step, result.compared) == expected


def test_replayed_steps_without_any_loss_verify_nothing(store: Store) -> None:
    none: dict[int, float | None] = dict.fromkeys(range(1, 11))
    report(store, 0, range(1, 11), losses=none)
    report(store, 1, range(6, 11), losses=none)
    result = same_size(store)
    assert (result.verified, result.first_diverging_step, result.compared) == (False, None, 0)
    assert "step_done(loss=" in result.reason


# ---------------------------------------------------------------------------
# When there is enough data.


def test_not_enough_data_until_the_replay_reaches_the_last_step_before_the_fault(
    store: Store,
) -> None:
    report(store, 0, range(1, 11))
    assert check_resume(store, JOB, 1, 5, True, 0.0) is None  # nothing replayed yet
    report(store, 1, range(6, 10), losses={7: 0.0})
    assert check_resume(store, JOB, 1, 5, True, 0.0) is None  # steps 6-9 of 6-10
    report(store, 1, [10])
    assert same_size(store).first_diverging_step == 7


def test_an_attempt_past_the_last_step_before_the_fault_compares_up_to_that_step(
    store: Store,
) -> None:
    report(store, 0, range(1, 11))
    report(store, 1, range(6, 21), losses={15: 0.0})
    result = same_size(store)
    assert (result.verified, result.compared) == (True, 5)


def test_a_report_up_to_the_checkpoint_step_is_not_a_replayed_step(store: Store) -> None:
    report(store, 0, range(1, 11))
    report(store, 1, [5])
    assert check_resume(store, JOB, 1, 5, True, 0.0) is None
    assert check_resume(store, JOB, 1, 5, False, 0.0) is None


@pytest.mark.parametrize("size", [True, False])
def test_a_relaunch_that_trained_from_step_1_again_is_no_resume(store: Store, size: bool) -> None:
    # Seeded: a fresh start replays the very losses and cursors of before the fault.
    report(store, 0, range(1, 11))
    report(store, 1, range(1, 11))
    result = check_resume(store, JOB, 1, 5, size, 0.0)
    assert result is not None and not result.verified
    assert result.first_diverging_step == 1
    assert "trained step 1: it did not resume from the checkpoint of step 5" in result.reason


def test_without_a_report_from_before_the_fault_nothing_is_verified(store: Store) -> None:
    report(store, 0, range(1, 6))  # the fault came right after the checkpoint of step 5
    report(store, 1, range(6, 9))
    for size in (True, False):
        result = check_resume(store, JOB, 1, 5, size, 0.0)
        assert result is not None
        assert (result.verified, result.compared) == (False, 0)
        assert "no earlier attempt reported step 6" in result.reason


class CountingSource:
    """The store, counting range reads."""

    def __init__(self, store: Store) -> None:
        self.store = store
        self.range_reads = 0

    def last_reported_step(self, job_id: str, attempt: int) -> int | None:
        return self.store.last_reported_step(job_id, attempt)

    def first_reported_step(self, job_id: str, attempt: int) -> int | None:
        return self.store.first_reported_step(job_id, attempt)

    def reports_of_step(self, job_id: str, step: int) -> list[StepRow]:
        return self.store.reports_of_step(job_id, step)

    def steps_for(
        self,
        job_id: str,
        attempt: int | None = None,
        *,
        first_step: int | None = None,
        last_step: int | None = None,
    ) -> list[StepRow]:
        self.range_reads += 1
        return self.store.steps_for(job_id, attempt, first_step=first_step, last_step=last_step)


def test_waiting_for_data_reads_no_range_of_steps(store: Store) -> None:
    report(store, 0, range(1, 1001))
    report(store, 1, range(6, 500))
    source = CountingSource(store)
    assert check_resume(source, JOB, 1, 5, True, 0.0) is None
    assert check_resume(source, JOB, 1, 5, False, 0.0) is not None
    assert source.range_reads == 0


# ---------------------------------------------------------------------------
# Which attempt is "before the fault".


def test_the_newest_earlier_attempt_that_reported_the_first_replayed_step_is_the_reference(
    store: Store,
) -> None:
    report(store, 0, range(1, 16))  # ran to 15, checkpoint at 5, failed
    report(store, 1, range(6, 10), losses={8: 0.0})  # resumed from 5, diverged, failed at 9
    report(store, 2, range(6, 10), losses={8: 0.0})  # resumed from 5 again
    result = same_size(store, attempt=2)
    assert (result.verified, result.compared) == (True, 4)
    assert result.reason.startswith("attempt 2 against attempt 1:")


def test_an_attempt_that_failed_before_the_first_replayed_step_is_passed_over(
    store: Store,
) -> None:
    report(store, 0, range(1, 11))
    report(store, 1, [1, 2])  # restarted from scratch, then failed at step 2
    report(store, 2, range(6, 11))
    result = same_size(store, attempt=2)
    assert result.verified and result.reason.startswith("attempt 2 against attempt 0:")


# ---------------------------------------------------------------------------
# Resized: the data cursor of the first step after the resume.


def test_a_resized_resume_at_the_reported_cursor_is_verified(store: Store) -> None:
    report(store, 0, range(1, 11))
    report(store, 1, [6], losses={6: 123.0})  # another world size: the loss may differ
    result = check_resume(store, JOB, 1, 5, False, 0.0)
    assert result is not None
    assert (result.verified, result.compared) == (True, 1)
    assert "global sample 40" in result.reason


def test_a_resized_resume_at_another_cursor_names_the_step_and_the_difference(
    store: Store,
) -> None:
    report(store, 0, range(1, 11))
    report(store, 1, [6, 7], cursors={6: 48})
    result = check_resume(store, JOB, 1, 5, False, 0.0)
    assert result is not None
    assert (result.verified, result.first_diverging_step) == (False, 6)
    assert "+8 samples" in result.reason


@pytest.mark.parametrize(
    ("before", "after", "message"),
    [(None, 40, "before the fault without a data cursor"), (40, None, "without a data cursor")],
)
def test_a_resized_resume_without_cursors_verifies_nothing(
    store: Store, before: int | None, after: int | None, message: str
) -> None:
    report(store, 0, range(1, 11), cursors={6: before})
    report(store, 1, [6], cursors={6: after})
    result = check_resume(store, JOB, 1, 5, False, 0.0)
    assert result is not None
    assert (result.verified, result.compared) == (False, 0) and message in result.reason


def test_a_resized_resume_whose_first_step_report_was_lost_verifies_nothing(
    store: Store,
) -> None:
    report(store, 0, range(1, 11))
    report(store, 1, [7, 8])
    result = check_resume(store, JOB, 1, 5, False, 0.0)
    assert result is not None
    assert (result.verified, result.compared) == (False, 0) and "not reported" in result.reason
