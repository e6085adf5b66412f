"""Wire messages, fuzzed: agent <-> supervisor JSON, request signing, rank -> agent datagrams.

Every decoder either returns a message or raises the protocol's one error
type (:class:`ProtocolError`; :class:`AuthError` for signatures), whatever
the bytes; what it returns re-encodes to a message that decodes the same
(one canonical form); every valid message round-trips. A datagram on the
agent's socket parses to a well-formed message or None, never an exception:
any local process may write there.
"""

from __future__ import annotations

import copy
import json
import math
import struct
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from agent.wire import datagram as hb
from agent.wire import protocol
from agent.wire.datagram import CheckpointNote, Phase, RankBeat, StepReport
from agent.wire.protocol import (
    AuthError,
    Command,
    CommandKind,
    DriverAction,
    DriverAnswer,
    DriverPhase,
    DriverRequest,
    EventKind,
    HeartbeatReport,
    ProtocolError,
    RankStatus,
    Reply,
)
from tests.json_slots import slots

FUZZ = settings(
    max_examples=150,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow],
)
NOW = 1_760_000_000
SECRET = bytes(range(32))
INCARNATION = "0123456789abcdef"

NAMES = st.from_regex(r"[A-Za-z0-9][A-Za-z0-9._:@+-]{0,20}", fullmatch=True)
SECONDS = st.floats(min_value=0, max_value=1e10)
COUNTS = st.integers(min_value=0, max_value=2**63 - 1)
JSON = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(1 << 70), max_value=1 << 70)
    | st.floats()
    | st.text(max_size=20)
    | st.sampled_from(["4711", "node1", INCARNATION, "train", "relaunch", "stop_ranks"]),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=10), inner),
    max_leaves=10,
)

# -- valid messages ------------------------------------------------------------------------

RANKS = st.builds(
    RankStatus,
    global_rank=st.integers(0, 4096),
    local_rank=st.integers(0, 64),
    pid=st.integers(1, 2**31),
    step=st.none() | COUNTS,
    phase=st.none() | st.sampled_from([phase.value for phase in Phase]),
    last_progress_unix_s=st.none() | SECONDS,
    step_time_p50_s=st.none() | SECONDS,
    step_time_p99_s=st.none() | SECONDS,
    step_time_mean_s=st.none() | SECONDS,
    steps_observed=COUNTS,
)
HEARTBEATS = st.builds(
    HeartbeatReport,
    job_id=NAMES,
    node=NAMES,
    time_unix_s=SECONDS,
    ranks=st.lists(RANKS, max_size=6, unique_by=lambda rank: rank.global_rank).map(tuple),
    agent_incarnation=st.from_regex(r"[0-9a-f]{8,64}", fullmatch=True),
    attempt=st.none() | st.integers(1, 2**62),
)
COMMANDS = st.one_of(
    st.builds(
        lambda command_id, grace_s: Command(
            CommandKind.STOP_RANKS, command_id, {"grace_s": grace_s}
        ),
        NAMES,
        SECONDS,
    ),
    st.builds(
        lambda command_id, interval_s, every: Command(
            CommandKind.SET_CHECKPOINT_INTERVAL,
            command_id,
            {"interval_s": interval_s, "every_steps": every},
        ),
        NAMES,
        st.floats(min_value=1e-3, max_value=1e9),
        st.none() | st.integers(1, 10**9),
    ),
)
REPLIES = st.builds(
    Reply,
    commands=st.lists(COMMANDS, max_size=4).map(tuple),
    accepted_event_ids=st.lists(
        st.builds(
            protocol.event_id_for,
            NAMES,
            NAMES,
            st.just(INCARNATION),
            st.integers(1, 2**62),
        ),
        max_size=4,
    ).map(tuple),
)
SHORT_TEXT = st.text(max_size=40)
DRIVER_REQUESTS = st.builds(
    lambda job_id, phase, attempt, exit_code, action_id, ok, reason: DriverRequest(
        job_id,
        phase,
        attempt,
        exit_code,
        action_id if phase is not DriverPhase.RELAUNCHED else action_id or "a/1",
        ok if phase is not DriverPhase.RELAUNCHED else bool(ok),
        reason,
    ),
    NAMES,
    st.sampled_from(list(DriverPhase)),
    st.none() | st.integers(1, 2**62),
    st.none() | st.integers(-(2**63), 2**63 - 1),
    st.none() | SHORT_TEXT,
    st.none() | st.booleans(),
    SHORT_TEXT,
)
DRIVER_ANSWERS = st.builds(
    lambda action, attempt, nodes, resume_from, action_id, reason, retry, skips: DriverAnswer(
        action,
        attempt,
        (nodes or ("node1",)) if action is DriverAction.RELAUNCH else nodes,
        resume_from,
        (action_id or "a/1") if action is DriverAction.RELAUNCH else action_id,
        reason,
        retry,
        skips,
    ),
    st.sampled_from(list(DriverAction)),
    st.integers(1, 2**62),
    st.none() | st.lists(NAMES, max_size=5).map(tuple),
    st.none() | SHORT_TEXT,
    st.none() | SHORT_TEXT,
    SHORT_TEXT,
    SECONDS,
    st.lists(
        st.tuples(st.integers(0, 2**62), st.integers(1, 2**62)).map(
            lambda pair: (pair[0], pair[0] + pair[1])
        ),
        max_size=protocol.MAX_SKIP_RANGES,
    ).map(tuple),
)

ENCODE = {
    "events": protocol.encode_events,
    "heartbeat": protocol.encode_heartbeat,
    "reply": protocol.encode_reply,
    "driver_request": protocol.encode_driver_request,
    "driver_answer": protocol.encode_driver_answer,
}
DECODE = {
    "event": protocol.decode_event,
    "events": protocol.decode_events,
    "heartbeat": protocol.decode_heartbeat,
    "reply": protocol.decode_reply,
    "driver_request": protocol.decode_driver_request,
    "driver_answer": protocol.decode_driver_answer,
}


def example_events() -> bytes:
    events = [
        protocol.make_event(
            EventKind.RANK_EXITED,
            "4711",
            "node1",
            INCARNATION,
            1,
            NOW,
            {
                "global_rank": 1,
                "local_rank": 1,
                "pid": 42,
                "exit_code": None,
                "signal": 9,
                "signal_name": "SIGKILL",
                "last_step": 7,
                "phase": "train",
            },
        ),
        protocol.make_event(
            EventKind.HANG,
            "4711",
            "node1",
            INCARNATION,
            2,
            NOW,
            {
                "hung": [
                    {
                        "global_rank": 1,
                        "local_rank": 1,
                        "pid": 42,
                        "last_step": 7,
                        "phase": "train",
                        "seconds_since_progress": 61.0,
                        "timeout_s": 60.0,
                        "detector": "stack",
                    }
                ],
                "stacks": {"1": "Thread 42\n  allreduce"},
                "culprits": [
                    {"global_rank": 1, "last_step": 7, "in_collective": True, "reason": "x"}
                ],
            },
        ),
        protocol.make_event(
            EventKind.STEP_LOSSES,
            "4711",
            "node1",
            INCARNATION,
            3,
            NOW,
            {"global_rank": 0, "steps": [{"step": 1, "loss": 0.5, "cursor": 8}]},
        ),
    ]
    return protocol.encode_events(events)


VALID = [
    json.loads(example_events()),
    json.loads(
        protocol.encode_heartbeat(
            HeartbeatReport(
                "4711",
                "node1",
                NOW,
                (RankStatus(0, 0, 42, 7, "train", NOW, 0.5, 0.9, 0.6, 7, 0.4, 7),),
                INCARNATION,
                2,
            )
        )
    ),
    json.loads(
        protocol.encode_reply(
            Reply(
                (Command(CommandKind.STOP_RANKS, "c-1", {"grace_s": 3.0}),),
                (f"4711/node1/{INCARNATION}/1",),
            )
        )
    ),
    json.loads(
        protocol.encode_driver_request(
            DriverRequest("4711", DriverPhase.RELAUNCHED, 2, 1, "4711/2/relaunch/1", True, "ok")
        )
    ),
    json.loads(
        protocol.encode_driver_answer(
            DriverAnswer(
                DriverAction.RELAUNCH,
                2,
                ("node1",),
                "/c/step-4",
                "4711/2/relaunch/1",
                skip_samples=((1024, 2048),),
            )
        )
    ),
]


def canonical(name: str, message: Any) -> None:
    """A decoded message re-encodes, and the encoding decodes to the same message."""
    if name == "event":
        again = protocol.decode_event(protocol.encode_event(message))
    else:
        again = DECODE[name](ENCODE[name](message))
    assert again == message


# -- JSON messages ---------------------------------------------------------------------------


@FUZZ
@given(data=st.data())
def test_a_valid_message_with_fields_replaced_or_removed_decodes_canonically_or_is_refused(
    data: st.DataObject,
) -> None:
    document = copy.deepcopy(data.draw(st.sampled_from(VALID)))
    for _ in range(data.draw(st.integers(1, 3))):
        found = slots(document)
        if not found:
            break
        container, key = data.draw(st.sampled_from(found))
        operation = data.draw(st.sampled_from(["replace", "remove", "add"]))
        if operation == "replace":
            container[key] = data.draw(JSON)
        elif operation == "remove":
            del container[key]
        elif isinstance(container, dict):
            container[data.draw(st.text(max_size=10))] = data.draw(JSON)
    raw = json.dumps(document).encode()
    for name, decode in DECODE.items():
        try:
            message = decode(raw)
        except ProtocolError as error:
            assert str(error)
            continue
        canonical(name, message)


@FUZZ
@given(
    raw=st.binary(max_size=300)
    | JSON.map(lambda value: json.dumps(value).encode())
    | st.sampled_from(
        [b"[" * 100_000, b'{"protocol": 1, "type": "events", "events": ' + b"[" * 50_000]
    )
)
def test_any_bytes_decode_to_a_message_or_raise_only_protocol_error(raw: bytes) -> None:
    for name, decode in DECODE.items():
        try:
            message = decode(raw)
        except ProtocolError:
            continue
        canonical(name, message)


@FUZZ
@given(report=HEARTBEATS)
def test_any_valid_heartbeat_round_trips(report: HeartbeatReport) -> None:
    assert protocol.decode_heartbeat(protocol.encode_heartbeat(report)) == report


@FUZZ
@given(reply=REPLIES)
def test_any_valid_reply_round_trips(reply: Reply) -> None:
    assert protocol.decode_reply(protocol.encode_reply(reply)) == reply


@FUZZ
@given(request=DRIVER_REQUESTS)
def test_any_valid_driver_request_round_trips(request: DriverRequest) -> None:
    assert protocol.decode_driver_request(protocol.encode_driver_request(request)) == request


@FUZZ
@given(answer=DRIVER_ANSWERS)
def test_any_valid_driver_answer_round_trips(answer: DriverAnswer) -> None:
    assert protocol.decode_driver_answer(protocol.encode_driver_answer(answer)) == answer


# -- signing ---------------------------------------------------------------------------------

METHODS = st.sampled_from(["POST", "GET"])
PATHS = st.sampled_from([protocol.EVENTS_PATH, protocol.HEARTBEAT_PATH, "/v1/jobs/4711"])


@FUZZ
@given(
    method=METHODS,
    path=PATHS,
    job_id=NAMES,
    body=st.binary(max_size=200),
    skew=st.integers(-protocol.REPLAY_WINDOW_S, protocol.REPLAY_WINDOW_S),
    part=st.sampled_from(["method", "path", "job", "timestamp", "body", "secret"]),
    data=st.data(),
)
def test_a_signature_verifies_its_request_and_no_other(
    method: str,
    path: str,
    job_id: str,
    body: bytes,
    skew: int,
    part: str,
    data: st.DataObject,
) -> None:
    timestamp = NOW + skew
    signature = protocol.sign(SECRET, method, path, job_id, timestamp, body)
    protocol.verify(SECRET, method, path, job_id, timestamp, body, signature, now_s=NOW)
    request = {"method": method, "path": path, "job": job_id, "timestamp": timestamp}
    secret = SECRET
    if part == "body":
        body = body + data.draw(st.binary(min_size=1, max_size=8))
    elif part == "secret":
        secret = bytes(32)
    elif part == "timestamp":
        request["timestamp"] = timestamp + data.draw(st.sampled_from([-1, 1, 10**6]))
    else:
        key = {"method": "method", "path": "path", "job": "job"}[part]
        request[key] = request[key] + data.draw(st.sampled_from(["x", "/", "\n", "\r\n"]))
    with pytest.raises(AuthError):
        protocol.verify(
            secret,
            request["method"],
            request["path"],
            request["job"],
            request["timestamp"],
            body,
            signature,
            now_s=NOW,
        )


@FUZZ
@given(
    signature=st.text(max_size=80) | st.from_regex(r"[0-9a-fA-F]{64}", fullmatch=True),
    timestamp=st.integers(0, 2 * NOW),
)
def test_any_signature_text_is_refused_with_auth_error_only(signature: str, timestamp: int) -> None:
    with pytest.raises(AuthError):
        protocol.verify(
            SECRET, "POST", protocol.EVENTS_PATH, "4711", timestamp, b"{}", signature, NOW
        )


@FUZZ
@given(skew=st.integers(-(10**9), 10**9))
def test_a_request_outside_the_replay_window_never_verifies(skew: int) -> None:
    timestamp = max(0, NOW + skew)
    signature = protocol.sign(SECRET, "POST", protocol.EVENTS_PATH, "4711", timestamp, b"{}")
    if abs(timestamp - NOW) <= protocol.REPLAY_WINDOW_S:
        protocol.verify(
            SECRET, "POST", protocol.EVENTS_PATH, "4711", timestamp, b"{}", signature, NOW
        )
    else:
        with pytest.raises(AuthError, match="window"):
            protocol.verify(
                SECRET, "POST", protocol.EVENTS_PATH, "4711", timestamp, b"{}", signature, NOW
            )


# -- rank -> agent datagrams -----------------------------------------------------------------

I32 = st.integers(-(2**31), 2**31 - 1)
I64 = st.integers(-(2**63), 2**63 - 1)
WALL = st.floats(allow_nan=False)


def same_float(left: float | None, right: float | None) -> bool:
    return left == right or (
        left is not None and right is not None and math.isnan(left) and math.isnan(right)
    )


def assert_well_formed(message: RankBeat | CheckpointNote | StepReport) -> None:
    for value in (message.rank, message.local_rank, message.pid):
        assert 0 <= value < 2**31
    assert 0 <= message.step < 2**63 and message.pid >= 1
    if isinstance(message, StepReport):
        assert message.cursor is None or message.cursor >= 0
        assert message.loss is None or not math.isnan(message.loss)
    if isinstance(message, RankBeat | StepReport) and message.compute_s is not None:
        assert math.isfinite(message.compute_s) and message.compute_s >= 0
    if isinstance(message, CheckpointNote):
        assert len(message.path.encode("utf-8", "surrogateescape")) <= hb.MAX_PATH_BYTES


@FUZZ
@given(
    data=st.binary(max_size=120)
    | st.builds(
        lambda header, tail: header + tail,
        st.sampled_from([b"Rh\x01\x01", b"Rh\x01\x02", b"Rh\x01\x03", b"Rh\x02\x01"]),
        st.binary(max_size=120),
    )
)
def test_any_datagram_parses_to_a_well_formed_message_or_none(data: bytes) -> None:
    message = hb.parse_datagram(data)
    if message is not None:
        assert_well_formed(message)


RANKS = st.integers(0, 2**31 - 1)
PIDS = st.integers(1, 2**31 - 1)
STEPS = st.integers(0, 2**63 - 1)


@FUZZ
@given(
    rank=RANKS,
    local_rank=RANKS,
    pid=PIDS,
    step=STEPS,
    phase=st.sampled_from(list(Phase)),
    wall=WALL,
    compute_s=st.none() | st.floats(min_value=0, allow_infinity=False),
)
def test_any_beat_round_trips(
    rank: int,
    local_rank: int,
    pid: int,
    step: int,
    phase: Phase,
    wall: float,
    compute_s: float | None,
) -> None:
    data = hb.encode_beat(
        rank=rank, local_rank=local_rank, pid=pid, step=step, phase=phase, wall_time_s=wall,
        compute_s=compute_s,
    )  # fmt: skip
    assert hb.parse_datagram(data) == RankBeat(rank, local_rank, pid, step, phase, wall, compute_s)


@FUZZ
@given(
    rank=RANKS,
    local_rank=RANKS,
    pid=PIDS,
    step=STEPS,
    loss=st.none() | st.floats(allow_nan=False),
    cursor=st.none() | st.integers(0, 2**63 - 1),
    wall=WALL,
    compute_s=st.none() | st.floats(min_value=0, allow_infinity=False),
)
def test_any_step_report_round_trips(
    rank: int,
    local_rank: int,
    pid: int,
    step: int,
    loss: float | None,
    cursor: int | None,
    wall: float,
    compute_s: float | None,
) -> None:
    data = hb.encode_step_report(
        rank=rank, local_rank=local_rank, pid=pid, step=step, loss=loss, cursor=cursor,
        wall_time_s=wall, compute_s=compute_s,
    )  # fmt: skip
    message = hb.parse_datagram(data)
    assert isinstance(message, StepReport)
    assert (message.rank, message.local_rank, message.pid, message.step, message.cursor) == (
        rank,
        local_rank,
        pid,
        step,
        cursor,
    )
    assert same_float(message.loss, loss) and same_float(message.compute_s, compute_s)
    assert message.wall_time_s == wall


@FUZZ
@given(
    rank=RANKS,
    step=STEPS,
    phase=st.sampled_from(list(Phase)),
    path=st.text(max_size=60)
    | st.binary(max_size=60).map(lambda raw: raw.decode("utf-8", "surrogateescape")),
)
def test_any_checkpoint_note_round_trips_its_path(
    rank: int, step: int, phase: Phase, path: str
) -> None:
    data = hb.encode_checkpoint(
        rank=rank, local_rank=0, pid=1, step=step, phase=phase, wall_time_s=1.0, path=path
    )
    assert hb.parse_datagram(data) == CheckpointNote(rank, 0, 1, step, phase, 1.0, path)


@FUZZ
@given(
    kind=st.sampled_from(["beat", "step", "checkpoint"]),
    cut=st.integers(0, 80),
    tail=st.binary(max_size=16),
    flip=st.tuples(st.integers(0, 79), st.integers(1, 255)) | st.none(),
)
def test_a_mangled_datagram_parses_to_a_well_formed_message_or_none(
    kind: str, cut: int, tail: bytes, flip: tuple[int, int] | None
) -> None:
    valid = {
        "beat": hb.encode_beat(
            rank=1, local_rank=1, pid=9, step=5, phase=Phase.TRAIN, wall_time_s=1.0, compute_s=0.5
        ),
        "step": hb.encode_step_report(
            rank=1, local_rank=1, pid=9, step=5, loss=0.5, cursor=3, wall_time_s=1.0
        ),
        "checkpoint": hb.encode_checkpoint(
            rank=1, local_rank=1, pid=9, step=5, phase=Phase.TRAIN, wall_time_s=1.0, path="/c/5"
        ),
    }[kind]
    data = bytearray(valid[:cut] + tail)
    if flip is not None and flip[0] < len(data):
        data[flip[0]] ^= flip[1]
    message = hb.parse_datagram(bytes(data))
    if message is not None:
        assert_well_formed(message)


def test_a_datagram_is_decoded_with_the_documented_layout() -> None:
    # Pins the table in agent/train/heartbeat.py's docstring.
    data = struct.pack("<2sBBBxiiiqd", b"Rh", 1, 1, 3, 7, 2, 99, 12, 5.5)
    assert hb.parse_datagram(data) == RankBeat(7, 2, 99, 12, Phase.EVAL, 5.5)
