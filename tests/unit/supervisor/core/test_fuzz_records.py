"""Job records, fuzzed: the JSON document the store keeps for each job.

Any record, recovery under way included, round-trips through
:func:`record_to_json` / :func:`record_from_json`; a document that is not a
record (fields replaced, removed, added; other versions; arbitrary text)
reads back as a :class:`JobRecord` or raises :class:`RecordFormatError`.
"""

from __future__ import annotations

import contextlib
import copy
import json
from dataclasses import replace

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from supervisor.core.model import (
    Cause,
    CrashSignature,
    ExitSeen,
    JobRecord,
    JobState,
    RecordFormatError,
    Recovery,
    Suspect,
    new_record,
    record_from_json,
    record_to_json,
)
from tests.json_slots import slots

FUZZ = settings(
    max_examples=150,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow],
)
NOW = 1_760_000_000.0
NODES = st.lists(st.sampled_from(["node1", "node2", "node3", "gpu07"]), unique=True, max_size=4)
TIMES = st.floats(0, 1e10)
STEPS = st.none() | st.integers(0, 2**62)
SUSPECTS = st.builds(
    Suspect,
    node=st.sampled_from(["node1", "node2"]),
    global_rank=st.integers(0, 4096),
    last_step=STEPS,
    in_collective=st.none() | st.booleans(),
    stopped_at_s=TIMES,
    reason=st.text(max_size=10),
)
EXITS = st.builds(
    ExitSeen,
    node=st.sampled_from(["node1", "node2"]),
    global_rank=st.none() | st.integers(0, 4096),
    exit_code=st.none() | st.integers(-255, 255),
    signal=st.none() | st.integers(1, 64),
    step=STEPS,
    died_at_s=TIMES,
    error_digest=st.none() | st.text(max_size=10),
)
RECOVERIES = st.builds(
    Recovery,
    cause=st.sampled_from(list(Cause)),
    started_s=TIMES,
    evidence_until_s=st.none() | TIMES,
    suspects=st.lists(SUSPECTS, max_size=3).map(tuple),
    exits=st.lists(EXITS, max_size=3).map(tuple),
    settled=NODES.map(tuple),
    exclude=NODES.map(tuple),
    requeue=st.booleans(),
    validated=st.booleans(),
    resume_from=st.none() | st.text(max_size=20),
    resume_step=STEPS,
    rejected=st.lists(st.text(max_size=10), max_size=3).map(tuple),
    requeue_seen=st.booleans(),
)
RECORDS = st.builds(
    lambda base, state, nodes, attempt, causes, signatures, recovery, stragglers, step: replace(
        base,
        state=state,
        nodes=tuple(nodes),
        attempt=attempt,
        restarts=tuple(sorted(causes.items(), key=lambda item: item[0].value)),
        signatures=tuple(signatures),
        recovery=recovery,
        straggler_reports=tuple(stragglers.items()),
        last_step=step,
    ),
    st.builds(
        lambda nodes, unit: new_record("4711", nodes * unit, NOW, min_nodes=unit, unit=unit),
        st.integers(1, 16),
        st.integers(1, 4),
    ),
    st.sampled_from(list(JobState)),
    NODES,
    st.integers(1, 10**6),
    st.dictionaries(st.sampled_from(list(Cause)), st.integers(1, 100), max_size=4),
    st.lists(st.builds(CrashSignature, st.text(max_size=12), STEPS), max_size=3),
    st.none() | RECOVERIES,
    st.dictionaries(st.sampled_from(["node1", "node2"]), st.integers(1, 50)),
    STEPS,
)
# Values as record_to_json writes them: finite numbers.
JSON = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(1 << 70), 1 << 70)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=12)
    | st.sampled_from([state.value for state in JobState] + [cause.value for cause in Cause]),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner),
    max_leaves=8,
)


@FUZZ
@given(record=RECORDS)
def test_any_record_round_trips_through_its_json(record: JobRecord) -> None:
    text = record_to_json(record)
    assert record_from_json(text) == record
    assert record_to_json(record_from_json(text)) == text


@FUZZ
@given(record=RECORDS, data=st.data())
def test_a_record_with_fields_replaced_reads_back_or_raises_record_format_error(
    record: JobRecord, data: st.DataObject
) -> None:
    document = json.loads(record_to_json(record))
    for _ in range(data.draw(st.integers(1, 3))):
        container, key = data.draw(st.sampled_from(slots(document)))
        operation = data.draw(st.sampled_from(["replace", "remove", "add"]))
        if operation == "replace":
            container[key] = data.draw(JSON)
        elif operation == "remove":
            del container[key]
        elif isinstance(container, dict):
            container[data.draw(st.text(max_size=8))] = copy.deepcopy(data.draw(JSON))
    try:
        read = record_from_json(json.dumps(document))
    except RecordFormatError as error:
        assert str(error)
        return
    assert isinstance(read, JobRecord)


@FUZZ
@given(text=st.text(max_size=200) | JSON.map(json.dumps))
def test_any_text_reads_as_a_record_or_raises_record_format_error(text: str) -> None:
    with contextlib.suppress(RecordFormatError):
        record_from_json(text)
