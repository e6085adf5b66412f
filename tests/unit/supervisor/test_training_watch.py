"""One job's training-health watch: when an anomaly settles and which nodes it names
(supervisor.training_watch)."""

from __future__ import annotations

import math

from supervisor.core.anomaly import WatchPolicy
from supervisor.training_watch import JobWatch, signals

G = 12
POLICY = WatchPolicy(window=10, warmup_steps=5)


def steps(first: int, last: int, bad: dict[int, str] | None = None, loss: float = 1.0):
    """Step entries first..last with cursors, a non-finite loss at the steps in ``bad``."""
    out = []
    for step in range(first, last + 1):
        entry = {"step": step, "loss": loss, "cursor": (step - 1) * G}
        if bad and step in bad:
            entry["loss"], entry["non_finite"] = None, bad[step]
        out.append(entry)
    return out


def test_a_nan_on_one_node_waits_for_the_others_then_names_that_node():
    watch = JobWatch(POLICY)
    assert watch.feed(1, "node1", 0, steps(1, 9), 0.0) is None
    assert watch.feed(1, "node2", 1, steps(1, 10, {10: "nan"}), 1.0) is None  # node1 due
    found = watch.feed(1, "node1", 0, steps(10, 11, {11: "nan"}), 2.0)
    assert found is not None
    assert (found.kind, found.onset_step, found.ranks, found.nodes) == (
        "non_finite", 10, (1,), ("node2",),
    )  # fmt: skip
    assert (found.cursor, found.batch) == (9 * G, G)


def test_the_rank_whose_own_loss_went_bad_names_the_node_not_the_shared_grad_norm():
    """The grad norm is taken after the all-reduce: every rank's is NaN at the onset."""
    watch = JobWatch(POLICY)
    watch.feed(1, "node1", 0, steps(1, 8), 0.0)
    watch.feed(1, "node2", 1, steps(1, 8), 0.0)
    healthy = steps(9, 9)
    healthy[-1].update(grad_norm=None, grad_non_finite="nan")
    assert watch.feed(1, "node1", 0, healthy, 1.0) is None  # node2's step 9 is due
    bad = steps(9, 9, {9: "nan"})
    bad[-1].update(grad_norm=None, grad_non_finite="nan")
    found = watch.feed(1, "node2", 1, bad, 2.0)
    assert found is not None and found.nodes == ("node2",) and found.ranks == (0, 1)
    assert found.detail.startswith("rank 1 reported a loss of nan")


def test_a_relaunch_whose_first_report_is_the_anomaly_waits_for_its_other_ranks():
    watch = JobWatch(POLICY)
    watch.feed(1, "node1", 0, steps(1, 8), 0.0, world_ranks=2)
    watch.feed(1, "node2", 1, steps(1, 8), 0.0, world_ranks=2)
    # Attempt 2 resumed from step 8: node2's NaN at step 9 is the attempt's first report.
    assert watch.feed(2, "node2", 1, steps(9, 9, {9: "nan"}), 1.0, world_ranks=2) is None
    found = watch.feed(2, "node1", 0, steps(9, 9), 2.0, world_ranks=2)
    assert found is not None and found.nodes == ("node2",)
    # A world shrunk below the ranks heard before is not waited for.
    shrunk = JobWatch(POLICY)
    shrunk.feed(1, "node1", 0, steps(1, 8), 0.0, world_ranks=2)
    shrunk.feed(1, "node2", 1, steps(1, 8), 0.0, world_ranks=2)
    assert shrunk.feed(2, "node1", 0, steps(9, 9, {9: "nan"}), 1.0, world_ranks=1) is not None


def test_every_node_bad_at_the_onset_names_none():
    watch = JobWatch(POLICY)
    watch.feed(1, "node1", 0, steps(1, 9), 0.0)
    watch.feed(1, "node2", 1, steps(1, 10, {10: "inf"}), 1.0)
    found = watch.feed(1, "node1", 0, steps(10, 10, {10: "nan"}), 2.0)
    assert found is not None and found.nodes == () and found.ranks == (0, 1)


def test_one_reporting_rank_cannot_name_a_node():
    watch = JobWatch(POLICY)
    found = watch.feed(1, "node1", 0, steps(1, 10, {10: "nan"}), 0.0)
    assert found is not None and found.nodes == ()


def test_an_unsettled_anomaly_is_handed_on_after_the_wait_or_at_an_exit():
    watch = JobWatch(POLICY, settle_s=10.0)
    watch.feed(1, "node1", 0, steps(1, 5), 0.0)
    assert watch.feed(1, "node2", 1, steps(1, 8, {8: "nan"}), 1.0) is None
    assert watch.due(5.0) is None
    found = watch.due(11.5)
    assert found is not None and found.onset_step == 8
    # An exit does not wait.
    other = JobWatch(POLICY)
    other.feed(1, "node1", 0, steps(1, 5), 0.0)
    other.feed(1, "node2", 1, steps(1, 8, {8: "nan"}), 1.0)
    assert other.due(1.0, force=True) is not None


def test_the_nan_that_stays_in_the_parameters_is_news_once_per_attempt():
    watch = JobWatch(POLICY)
    assert watch.feed(1, "node1", 0, steps(1, 10, {10: "nan"}), 0.0) is not None
    assert watch.feed(1, "node1", 0, steps(11, 12, {11: "nan", 12: "nan"}), 1.0) is None
    # The next attempt replays from a checkpoint: a new anomaly is news again.
    found = watch.feed(2, "node1", 0, steps(6, 10, {10: "nan"}), 2.0)
    assert found is not None and found.attempt == 2 and found.onset_step == 10


def test_the_batch_is_the_smallest_cursor_step_so_a_skip_does_not_inflate_it():
    watch = JobWatch(POLICY)
    entries = steps(1, 6)
    for entry in entries[3:]:
        entry["cursor"] += 20 * G  # a skipped window between steps 3 and 4
    watch.feed(1, "node1", 0, entries, 0.0)
    assert watch.batch == G


def test_signals_read_non_finite_values_and_grad_norms():
    (one, two) = signals(
        3,
        [
            {"step": 1, "loss": 2.0, "cursor": 0, "grad_norm": 0.5},
            {"step": 2, "loss": None, "non_finite": "-inf", "grad_norm": None,
             "grad_non_finite": "nan"},
        ],
    )  # fmt: skip
    assert (one.rank, one.loss, one.grad_norm) == (3, 2.0, 0.5)
    assert two.loss == -math.inf and two.grad_norm is not None and math.isnan(two.grad_norm)
