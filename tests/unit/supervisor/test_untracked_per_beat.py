"""What the supervisor creates for every node's beat stays out of the garbage collector.

At 16,384 nodes a second, each beat's lease, hearing and compute sample made
the collector's young generation 90,000 objects deep: a 40-55 ms stop of the
event loop every two seconds (bench/RESULTS.md). Each holds only strings and
numbers, so no cycle can run through it and the collector need never see it.
"""

from __future__ import annotations

import gc

from supervisor.core.hang_hold import Heard
from supervisor.core.stragglers import ComputeSample
from supervisor.slurm.parse import SinfoParser
from supervisor.store.rows import LeaseRow


def test_a_beats_records_are_not_tracked_by_the_collector() -> None:
    made = [
        LeaseRow("7", "n1", "ab" * 8, 12.5),
        Heard(2, 12.5, None),
        ComputeSample("n1", 3, 0.25, 16),
    ]
    assert [type(one).__name__ for one in made if gc.is_tracked(one)] == []


def test_records_stay_frozen_values() -> None:
    lease = LeaseRow("7", "n1", "ab" * 8, 12.5)
    assert lease == LeaseRow("7", "n1", "ab" * 8, 12.5)
    assert {lease: 1}[LeaseRow("7", "n1", "ab" * 8, 12.5)] == 1
    assert (lease.job_id, lease.node, lease.incarnation, lease.last_seen_s) == (
        "7", "n1", "ab" * 8, 12.5,
    )  # fmt: skip


def test_sinfo_records_decoded_each_poll_are_not_tracked() -> None:
    text = (
        b'{"nodes": [{"name": "n1", "state": "idle", "state_flags": [],'
        b' "partitions": ["debug"], "reason": ""}], "errors": []}'
    )
    parser = SinfoParser()
    parser.parse(text)
    ((record, _),) = parser._last.values()
    assert not gc.is_tracked(record)
