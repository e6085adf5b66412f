"""The agent <-> supervisor wire protocol: round trips, strict decoding, signing."""

from __future__ import annotations

import contextlib
import copy
import hashlib
import json
from collections.abc import Callable
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from agent.wire import protocol
from agent.wire.protocol import (
    AuthError,
    Command,
    CommandKind,
    Event,
    EventKind,
    HeartbeatReport,
    ProtocolError,
    RankStatus,
    Reply,
)
from tests.paths import REPO
from tests.unit.purity_rules import FORBIDDEN, imported_roots

NOW = 1_760_000_000
SECRET = bytes(range(32))
INCARNATION = "0123456789abcdef"

PAYLOADS: dict[EventKind, dict[str, Any]] = {
    EventKind.RANK_EXITED: {
        "global_rank": 5,
        "local_rank": 1,
        "pid": 4242,
        "exit_code": None,
        "signal": 9,
        "signal_name": "SIGKILL",
        "last_step": 120,
        "phase": "train",
    },
    EventKind.LAUNCHER_EXITED: {"exit_code": 1, "signal": None},
    EventKind.HANG: {
        "hung": [
            {
                "global_rank": 5,
                "local_rank": 1,
                "pid": 4242,
                "last_step": 120,
                "phase": "train",
                "seconds_since_progress": 61.5,
                "timeout_s": 60.0,
                "detector": "heartbeat",
            }
        ],
        "stacks": {"4": "Thread 1 (idle)\n  allreduce", "5": "Thread 1\n  train_step"},
    },
    EventKind.CHECKPOINT_WRITTEN: {
        "step": 40,
        "path": "/scratch/run/out/ckpt.pt",
        "global_rank": 0,
        "total_bytes": 31_436,
    },
    EventKind.STRAGGLER: {
        "global_rank": 2,
        "local_rank": 2,
        "step_time_p50_s": 1.9,
        "step_time_p99_s": 2.4,
        "step_time_mean_s": 2.0,
        "steps_observed": 50,
        "node_median_step_time_s": 1.0,
    },
    EventKind.HEALTH_CHECK_FAILED: {
        "command": ["/usr/sbin/nhc", "-t", "30"],
        "exit_code": 1,
        "output_tail": "ERROR: nhc: /dev/shm is full\n",
        "timed_out": False,
    },
    EventKind.CHECKPOINT_COMMITTED: {"step": 1000, "path": "/ckpt/job/step-1000"},
    EventKind.RANKS_STOPPED: {
        "reason": "stop command",
        "command_id": "cmd-7",
        "grace_s": 30.0,
        "ranks": [
            {
                "global_rank": 4,
                "local_rank": 0,
                "pid": 4241,
                "method": "sigterm",
                "exit_code": 0,
                "signal": None,
            },
            {
                "global_rank": 5,
                "local_rank": 1,
                "pid": 4242,
                "method": "sigkill",
                "exit_code": None,
                "signal": 9,
            },
        ],
    },
    EventKind.AGENT_STARTED: {
        "agent_version": "0.1.0",
        "pid": 100,
        "argv": ["resurgo-agent", "--", "torchrun", "train.py"],
        "nnodes": 4,
        "node_rank": 2,
        "health_checks": [
            "ok builtin:ckpt_root (0.01 s): /ckpt/job is writable, 812.4 GB free",
            "ok builtin:rdzv_addr (0.00 s): node1 resolves to 10.0.0.1, routed via 10.0.0.3",
            "ok builtin:gpus (0.41 s): 8 GPU(s), no pending retired pages or row-remapping "
            "failures; no Xid error in the kernel log since boot",
        ],
    },
    EventKind.AGENT_STOPPED: {"reason": "SIGTERM from Slurm"},
    EventKind.TIME_LIMIT_NEAR: {"end_unix_s": 1.7e9, "save_by_unix_s": 1.7e9 - 60, "attempt": 1},
    EventKind.WORLD_MISMATCH: {
        "global_rank": 0,
        "pid": 4242,
        "world_size": 1,
        "local_world_size": 1,
        "nnodes": 4,
    },
    EventKind.STEP_LOSSES: {
        "global_rank": 0,
        "steps": [
            {"step": 21, "loss": -0.5, "cursor": 640},
            {"step": 22, "loss": None, "cursor": None},
            {"step": 23, "loss": None, "cursor": 704, "non_finite": "nan"},
            {"step": 24, "loss": 0.5, "cursor": 736, "grad_norm": 1.5},
            {"step": 25, "loss": 0.5, "cursor": 768, "grad_norm": None, "grad_non_finite": "inf"},
        ],
    },
}


def make(kind: EventKind = EventKind.RANK_EXITED, seq: int = 1, **overrides: Any) -> Event:
    payload = {**PAYLOADS[kind], **overrides}
    return protocol.make_event(kind, "1234", "node3", INCARNATION, seq, NOW + 0.25, payload)


def heartbeat() -> HeartbeatReport:
    return HeartbeatReport(
        job_id="1234",
        node="node3",
        time_unix_s=NOW,
        agent_incarnation=INCARNATION,
        ranks=(
            RankStatus(4, 0, 4241, 120, "train", NOW - 1.0, 0.5, 0.9, 0.55, 100),
            RankStatus(5, 1, 4242, None, None, None, None, None, None, 0),
        ),
    )


def reply() -> Reply:
    return Reply(
        commands=(
            Command(CommandKind.STOP_RANKS, "cmd-1", {"grace_s": 30.0}),
            Command(
                CommandKind.SET_CHECKPOINT_INTERVAL,
                "cmd-2",
                {"interval_s": 1560.0, "every_steps": None},
            ),
        ),
        accepted_event_ids=("1234/node3/0123456789abcdef/1",),
    )


def events_document(*events: Event) -> dict[str, Any]:
    document: dict[str, Any] = json.loads(protocol.encode_events(events or (make(),)))
    return document


def body(document: Any) -> bytes:
    return json.dumps(document).encode()


# -- round trips ---------------------------------------------------------------


@pytest.mark.parametrize("kind", list(EventKind), ids=lambda kind: kind.value)
def test_every_event_kind_round_trips_alone_and_in_a_batch(kind: EventKind) -> None:
    event = make(kind)
    assert protocol.decode_event(protocol.encode_event(event)) == event
    assert protocol.decode_events(protocol.encode_events([event, make(kind, seq=2)]))[0] == event


def test_every_event_kind_has_an_example_here() -> None:
    assert set(PAYLOADS) == set(EventKind)


def test_event_id_is_job_node_incarnation_seq() -> None:
    event = make(seq=17)
    assert event.event_id == f"1234/node3/{INCARNATION}/17"
    assert event.incarnation == INCARNATION


def test_a_spool_line_has_no_newline_even_with_multiline_unicode_stacks() -> None:
    event = make(EventKind.HANG, stacks={"5": "Thread ü\n\u2028 line\r\n"})
    line = protocol.encode_event(event)
    assert b"\n" not in line and b"\r" not in line
    assert protocol.decode_event(line) == event


def test_heartbeat_round_trips() -> None:
    report = heartbeat()
    assert protocol.decode_heartbeat(protocol.encode_heartbeat(report)) == report


def test_reply_round_trips_with_commands() -> None:
    assert protocol.decode_reply(protocol.encode_reply(reply())) == reply()
    assert protocol.decode_reply(protocol.encode_reply(Reply())) == Reply()


def test_make_event_normalises_payload_to_its_wire_shape() -> None:
    event = make(EventKind.HANG, stacks={5: "x"})
    assert event.payload["stacks"] == {"5": "x"}
    assert isinstance(event.payload["hung"][0]["timeout_s"], float)


def test_unknown_fields_are_ignored_and_dropped() -> None:
    document = events_document()
    document["future_field"] = 1
    document["events"][0]["future_field"] = [1, 2]
    document["events"][0]["payload"]["core_dump"] = "/var/crash/x"
    (event,) = protocol.decode_events(body(document))
    assert event == make()
    assert "core_dump" not in event.payload


def test_optional_payload_fields_may_be_absent() -> None:
    payload = {k: v for k, v in PAYLOADS[EventKind.HEALTH_CHECK_FAILED].items() if k != "timed_out"}
    event = protocol.make_event(
        EventKind.HEALTH_CHECK_FAILED, "1234", "node3", INCARNATION, 1, NOW, payload
    )
    assert "timed_out" not in event.payload


def test_make_event_refuses_a_payload_the_supervisor_would_refuse() -> None:
    with pytest.raises(ProtocolError, match=r"event.payload: missing field 'global_rank'"):
        protocol.make_event(EventKind.RANK_EXITED, "1234", "node3", INCARNATION, 1, NOW, {})
    with pytest.raises(ProtocolError, match="incarnation"):
        protocol.make_event(
            EventKind.AGENT_STOPPED, "1234", "node3", "NOT-HEX", 1, NOW, {"reason": "x"}
        )
    with pytest.raises(ProtocolError, match="job_id"):
        protocol.make_event(
            EventKind.AGENT_STOPPED, "a/b", "node3", INCARNATION, 1, NOW, {"reason": "x"}
        )


def test_clip_text_keeps_the_tail() -> None:
    text = "".join(f"line {i}\n" for i in range(10_000))
    clipped = protocol.clip_text(text, 1000)
    assert len(clipped) == 1000
    assert clipped.endswith("line 9999\n")
    assert protocol.clip_text("short", 1000) == "short"


# -- strict decoding -------------------------------------------------------------

Mutation = Callable[[dict[str, Any]], Any]


def _set(path: tuple[Any, ...], value: Any) -> Mutation:
    def mutate(document: dict[str, Any]) -> Any:
        target: Any = document
        for key in path[:-1]:
            target = target[key]
        target[path[-1]] = value
        return document

    return mutate


def _delete(path: tuple[Any, ...]) -> Mutation:
    def mutate(document: dict[str, Any]) -> Any:
        target: Any = document
        for key in path[:-1]:
            target = target[key]
        del target[path[-1]]
        return document

    return mutate


EVENT = ("events", 0)
BAD_EVENTS: list[tuple[str, Mutation, str]] = [
    ("newer protocol", _set(("protocol",), 2), "protocol version 2 is not supported"),
    ("no protocol", _delete(("protocol",)), "missing field 'protocol'"),
    ("protocol true", _set(("protocol",), True), "protocol version True"),
    ("wrong type", _set(("type",), "heartbeat"), "expected 'events'"),
    ("not an object", lambda d: [d], "events must be an object"),
    ("no events", _set(("events",), []), "has 0 items"),
    ("events not a list", _set(("events",), {}), "events.events must be a list"),
    ("unknown kind", _set((*EVENT, "kind"), "meteor_strike"), "unknown EventKind 'meteor_strike'"),
    ("seq a string", _set((*EVENT, "seq"), "1"), "seq must be an integer, got str"),
    ("seq a bool", _set((*EVENT, "seq"), True), "seq must be an integer, got bool"),
    ("seq zero", _set((*EVENT, "seq"), 0), r"seq must be an integer in \[1"),
    ("missing job_id", _delete((*EVENT, "job_id")), "missing field 'job_id'"),
    ("job_id with slash", _set((*EVENT, "job_id"), "12/34"), "is not a name"),
    (
        "event_id of another seq",
        _set((*EVENT, "event_id"), "1234/node3/0123456789abcdef/2"),
        "does not match",
    ),
    ("event_id garbage", _set((*EVENT, "event_id"), "x"), "is not an event id"),
    ("time negative", _set((*EVENT, "time_unix_s"), -1), "finite number >= 0"),
    ("time huge", _set((*EVENT, "time_unix_s"), 10**400), "too large for a double"),
    ("payload a list", _set((*EVENT, "payload"), []), "payload must be an object"),
    ("payload field missing", _delete((*EVENT, "payload", "pid")), "payload: missing field 'pid'"),
    ("pid zero", _set((*EVENT, "payload", "pid"), 0), "pid must be an integer in"),
    ("signal negative", _set((*EVENT, "payload", "signal"), -9), "signal must be an integer in"),
    ("phase a number", _set((*EVENT, "payload", "phase"), 3), "phase must be a string"),
    ("phase too long", _set((*EVENT, "payload", "phase"), "x" * 5000), "the limit is 4096"),
]


@pytest.mark.parametrize(
    ("mutation", "message"),
    [(m, msg) for _, m, msg in BAD_EVENTS],
    ids=[name for name, _, _ in BAD_EVENTS],
)
def test_malformed_event_batches_are_refused_naming_the_problem(
    mutation: Mutation, message: str
) -> None:
    document = mutation(events_document())
    with pytest.raises(ProtocolError, match=message):
        protocol.decode_events(body(document))


def test_malformed_hang_payloads_are_refused() -> None:
    hang = events_document(make(EventKind.HANG))
    for mutation, message in [
        (_set((*EVENT, "payload", "stacks"), {"rank5": "x"}), "not a global rank"),
        (_set((*EVENT, "payload", "stacks"), {"5": 7}), "must be a string"),
        (_set((*EVENT, "payload", "hung", 0, "detector"), "psychic"), "unknown HangDetector"),
        (_set((*EVENT, "payload", "hung"), [{}] * 1025), "the limit is 1024|allowed 0 to 1024"),
    ]:
        with pytest.raises(ProtocolError, match=message):
            protocol.decode_events(body(mutation(copy.deepcopy(hang))))


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (b"", "not valid UTF-8 JSON"),
        (b"\xff\xfe", "not valid UTF-8 JSON"),
        (b'{"protocol": 1, "protocol": 1}', "key 'protocol' twice"),
        (b'{"protocol": NaN}', "NaN is not allowed"),
        (b"[" * 100_000, "not valid UTF-8 JSON"),
        (b" " * (protocol.MAX_BODY_BYTES + 1), "the limit is"),
    ],
    ids=["empty", "not utf-8", "duplicate key", "nan", "deep nesting", "oversized"],
)
def test_undecodable_bodies_are_refused(data: bytes, message: str) -> None:
    for decode in (protocol.decode_events, protocol.decode_heartbeat, protocol.decode_reply):
        with pytest.raises(ProtocolError, match=message):
            decode(data)


def test_a_batch_with_too_many_events_is_refused() -> None:
    document = events_document()
    document["events"] = document["events"] * (protocol.MAX_EVENTS_PER_BATCH + 1)
    with pytest.raises(ProtocolError, match="1001 items"):
        protocol.decode_events(body(document))


def test_a_batch_listing_an_event_twice_is_refused() -> None:
    with pytest.raises(ProtocolError, match="same event_id twice"):
        protocol.decode_events(protocol.encode_events([make(), make()]))


def test_malformed_heartbeats_are_refused() -> None:
    good = json.loads(protocol.encode_heartbeat(heartbeat()))
    for mutation, message in [
        (_set(("ranks", 1, "global_rank"), 4), "same global_rank twice"),
        (_set(("ranks", 0, "pid"), 0), "pid must be an integer in"),
        (_set(("ranks", 0, "step_time_p99_s"), "slow"), "must be a number"),
        (_delete(("ranks", 0, "steps_observed")), "missing field 'steps_observed'"),
        (_set(("agent_incarnation",), "XYZ"), "8-64 lowercase hex"),
        (_set(("ranks",), [good["ranks"][0]] * 1025), "1025 items"),
    ]:
        with pytest.raises(ProtocolError, match=message):
            protocol.decode_heartbeat(body(mutation(copy.deepcopy(good))))


def test_malformed_replies_are_refused() -> None:
    good = json.loads(protocol.encode_reply(reply()))
    interval = ("commands", 1, "args")
    for mutation, message in [
        (_set(("commands", 0, "kind"), "reboot_node"), "unknown CommandKind 'reboot_node'"),
        (_delete(("commands", 0, "args", "grace_s")), "missing field 'grace_s'"),
        (_set((*interval, "interval_s"), None), "both are null"),
        (_set((*interval, "interval_s"), 0), "must be > 0"),
        (_set((*interval, "every_steps"), 0), r"every_steps must be an integer in \[1"),
        (_set(("accepted_event_ids", 0), 7), "must be a string"),
        (_set(("commands",), good["commands"] * 51), "102 items"),
    ]:
        with pytest.raises(ProtocolError, match=message):
            protocol.decode_reply(body(mutation(copy.deepcopy(good))))


def test_encoding_refuses_what_decoding_would_refuse() -> None:
    bad = Command(CommandKind.STOP_RANKS, "cmd-1", {"grace_s": -1})
    with pytest.raises(ProtocolError, match="grace_s"):
        protocol.encode_reply(Reply(commands=(bad,)))
    with pytest.raises(ProtocolError, match="numbers finite"):
        protocol.encode_heartbeat(HeartbeatReport("1234", "node3", float("nan"), (), INCARNATION))


# -- property-based ------------------------------------------------------------

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(),
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=12), children, max_size=4)
    ),
    max_leaves=20,
)
DECODERS = (
    protocol.decode_event,
    protocol.decode_events,
    protocol.decode_heartbeat,
    protocol.decode_reply,
)


@given(st.binary(max_size=512))
def test_decoding_arbitrary_bytes_raises_only_protocol_error(data: bytes) -> None:
    for decode in DECODERS:
        with pytest.raises(ProtocolError):
            decode(data)


@given(json_values)
def test_decoding_arbitrary_json_raises_only_protocol_error(value: Any) -> None:
    for decode in DECODERS:
        with contextlib.suppress(ProtocolError):
            decode(body(value))


def _all_paths(value: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    paths = [prefix] if prefix else []
    if isinstance(value, dict):
        for key, child in value.items():
            paths += _all_paths(child, (*prefix, key))
    elif isinstance(value, list):
        for index, child in enumerate(value):
            paths += _all_paths(child, (*prefix, index))
    return paths


VALID_DOCUMENTS = [
    json.loads(protocol.encode_events([make(EventKind.RANK_EXITED), make(EventKind.HANG, seq=2)])),
    json.loads(protocol.encode_heartbeat(heartbeat())),
    json.loads(protocol.encode_reply(reply())),
]


@settings(max_examples=300)
@given(st.data())
def test_decoding_a_valid_message_with_one_field_replaced_raises_only_protocol_error(
    data: st.DataObject,
) -> None:
    document = copy.deepcopy(data.draw(st.sampled_from(VALID_DOCUMENTS)))
    path = data.draw(st.sampled_from(_all_paths(document)))
    _set(path, data.draw(json_values))(document)
    for decode in DECODERS:
        with contextlib.suppress(ProtocolError):
            decode(body(document))


names = st.from_regex(r"[A-Za-z0-9][A-Za-z0-9._:@+-]{0,20}", fullmatch=True)


@given(
    kind=st.sampled_from(list(EventKind)),
    job_id=names,
    node=names,
    incarnation=st.from_regex(r"[0-9a-f]{8,64}", fullmatch=True),
    seq=st.integers(min_value=1, max_value=2**63 - 1),
    time_unix_s=st.floats(min_value=0, max_value=1e10),
    text=st.text(max_size=200),
)
def test_any_valid_event_round_trips(
    kind: EventKind,
    job_id: str,
    node: str,
    incarnation: str,
    seq: int,
    time_unix_s: float,
    text: str,
) -> None:
    payload = copy.deepcopy(PAYLOADS[kind])
    for key in ("reason", "phase", "path", "output_tail"):
        if key in payload:
            payload[key] = text
    if "stacks" in payload:
        payload["stacks"]["5"] = text
    event = protocol.make_event(kind, job_id, node, incarnation, seq, time_unix_s, payload)
    assert protocol.decode_event(protocol.encode_event(event)) == event
    assert protocol.decode_events(protocol.encode_events([event])) == (event,)


# -- signing -------------------------------------------------------------------

REQUEST = {
    "method": "POST",
    "path": protocol.EVENTS_PATH,
    "job_id": "1234",
    "timestamp_s": NOW,
    "body": b'{"protocol":1}',
}


def test_canonical_string_is_exactly_as_documented() -> None:
    body_hash = hashlib.sha256(b'{"protocol":1}').hexdigest()
    assert protocol.canonical_string(**REQUEST) == (
        f"RESURGO-HMAC-SHA256\nPOST\n/v1/events\n1234\n{NOW}\n{body_hash}"
    )


def test_a_signed_request_verifies() -> None:
    signature = protocol.sign(SECRET, **REQUEST)
    assert len(signature) == 64
    protocol.verify(SECRET, **REQUEST, signature=signature, now_s=NOW)


@pytest.mark.parametrize(
    ("part", "value"),
    [
        ("method", "PUT"),
        ("path", protocol.HEARTBEAT_PATH),
        ("job_id", "1235"),
        ("timestamp_s", NOW + 1),
        ("body", b'{"protocol":2}'),
    ],
)
def test_tampering_with_any_signed_part_is_refused(part: str, value: Any) -> None:
    signature = protocol.sign(SECRET, **REQUEST)
    with pytest.raises(AuthError, match="bad signature"):
        protocol.verify(SECRET, **{**REQUEST, part: value}, signature=signature, now_s=NOW)


def test_another_jobs_secret_is_refused() -> None:
    signature = protocol.sign(bytes(32), **REQUEST)
    with pytest.raises(AuthError, match="bad signature"):
        protocol.verify(SECRET, **REQUEST, signature=signature, now_s=NOW)


@pytest.mark.parametrize(
    "signature",
    ["", "0" * 63, "G" * 64, "é" * 64, "A" * 64],
    ids=["empty", "short", "non-hex", "non-ascii", "uppercase"],
)
def test_malformed_signatures_are_refused_not_crashed_on(signature: str) -> None:
    with pytest.raises(AuthError, match="bad signature"):
        protocol.verify(SECRET, **REQUEST, signature=signature, now_s=NOW)


@pytest.mark.parametrize(
    ("skew_s", "accepted"), [(0, True), (300, True), (-300, True), (301, False), (-301, False)]
)
def test_replay_window_is_plus_or_minus_300_s(skew_s: int, accepted: bool) -> None:
    signature = protocol.sign(SECRET, **REQUEST)
    if accepted:
        protocol.verify(SECRET, **REQUEST, signature=signature, now_s=NOW + skew_s)
    else:
        with pytest.raises(AuthError, match="window is ±300 s"):
            protocol.verify(SECRET, **REQUEST, signature=signature, now_s=NOW + skew_s)


def test_a_newline_in_a_signed_field_cannot_forge_another_request() -> None:
    with pytest.raises(ProtocolError, match="newline"):
        protocol.sign(SECRET, **{**REQUEST, "path": "/v1/events\n1234"})
    with pytest.raises(AuthError):
        protocol.verify(SECRET, **{**REQUEST, "job_id": "12\n34"}, signature="0" * 64, now_s=NOW)


def test_signed_headers_carry_job_timestamp_signature_and_version() -> None:
    headers = protocol.signed_headers(SECRET, **REQUEST)
    assert headers == {
        "X-Resurgo-Job": "1234",
        "X-Resurgo-Timestamp": str(NOW),
        "X-Resurgo-Signature": protocol.sign(SECRET, **REQUEST),
        "X-Resurgo-Protocol": "1",
    }


def test_protocol_package_is_pure() -> None:
    package = REPO / "agent" / "wire" / "protocol"
    modules = sorted(package.glob("*.py"))
    assert len(modules) > 1
    for module in modules:
        assert not imported_roots(module.read_text()) & FORBIDDEN, module.name


def test_step_losses_refuse_a_loss_that_is_not_finite() -> None:
    payload = {"global_rank": 0, "steps": [{"step": 1, "loss": float("nan"), "cursor": 0}]}
    with pytest.raises(ProtocolError, match="finite"):
        protocol.make_event(EventKind.STEP_LOSSES, "1234", "node3", INCARNATION, 1, NOW, payload)


def test_rank_exited_takes_an_optional_exit_time() -> None:
    payload = dict(PAYLOADS[EventKind.RANK_EXITED], exit_time_unix_s=NOW - 0.5)
    event = protocol.make_event(
        EventKind.RANK_EXITED, "1234", "node3", INCARNATION, 1, NOW, payload
    )
    assert (
        protocol.decode_event(protocol.encode_event(event)).payload["exit_time_unix_s"] == NOW - 0.5
    )


def test_driver_messages_round_trip_and_refuse_what_cannot_be_acted_on() -> None:
    request = protocol.DriverRequest(
        "4711", protocol.DriverPhase.RELAUNCHED, attempt=2, action_id="4711/2/relaunch/3", ok=True
    )
    assert protocol.decode_driver_request(protocol.encode_driver_request(request)) == request
    answer = protocol.DriverAnswer(
        protocol.DriverAction.RELAUNCH, 2, ("node1", "node2"), "/c/step-4", "4711/2/relaunch/2"
    )
    assert protocol.decode_driver_answer(protocol.encode_driver_answer(answer)) == answer
    with pytest.raises(ProtocolError, match="relaunched needs action_id and ok"):
        protocol.encode_driver_request(
            protocol.DriverRequest("4711", protocol.DriverPhase.RELAUNCHED)
        )
    with pytest.raises(ProtocolError, match="names its nodes"):
        protocol.encode_driver_answer(protocol.DriverAnswer(protocol.DriverAction.RELAUNCH, 2))


def test_a_driver_answer_names_the_samples_to_skip_only_when_there_are_some() -> None:
    answer = protocol.DriverAnswer(
        protocol.DriverAction.LAUNCH, 3, resume_from="/c/step-4", skip_samples=((0, 8), (64, 96))
    )
    data = protocol.encode_driver_answer(answer)
    assert json.loads(data)["skip_samples"] == [[0, 8], [64, 96]]
    assert protocol.decode_driver_answer(data) == answer
    plain = protocol.encode_driver_answer(protocol.DriverAnswer(protocol.DriverAction.LAUNCH, 3))
    assert b"skip_samples" not in plain
    assert protocol.decode_driver_answer(plain).skip_samples == ()


def test_a_rollbacks_step_travels_only_with_a_rollback_and_is_a_step() -> None:
    answer = protocol.DriverAnswer(
        protocol.DriverAction.LAUNCH, 3, resume_from="/c/checkpoint-20", aside_after_step=20
    )
    data = protocol.encode_driver_answer(answer)
    assert json.loads(data)["aside_after_step"] == 20
    assert protocol.decode_driver_answer(data) == answer
    plain = protocol.encode_driver_answer(protocol.DriverAnswer(protocol.DriverAction.LAUNCH, 3))
    assert b"aside_after_step" not in plain
    assert protocol.decode_driver_answer(plain).aside_after_step is None
    document = json.loads(data)
    for bad in (-1, "20", 2.5, True):
        document["aside_after_step"] = bad
        with pytest.raises(ProtocolError, match="aside_after_step"):
            protocol.decode_driver_answer(json.dumps(document).encode())


def test_a_spare_check_travels_as_the_spares_to_check_and_the_verdicts_that_failed() -> None:
    asked = protocol.DriverAnswer(protocol.DriverAction.WAIT, 2, check_spares=("node5", "node6"))
    data = protocol.encode_driver_answer(asked)
    assert json.loads(data)["check_spares"] == ["node5", "node6"]
    assert protocol.decode_driver_answer(data) == asked
    report = protocol.DriverRequest(
        "4711", protocol.DriverPhase.SPARE_CHECK, attempt=2, checked=("node5", "node6"),
        unhealthy=(("node6", "FAIL builtin:gpus (0.2 s): 7 of 8 GPUs"),),
    )  # fmt: skip
    assert protocol.decode_driver_request(protocol.encode_driver_request(report)) == report
    # Absent when there is nothing to say: older peers read what they always read.
    plain = protocol.encode_driver_answer(protocol.DriverAnswer(protocol.DriverAction.WAIT, 2))
    assert b"check_spares" not in plain
    running = protocol.DriverRequest("4711", protocol.DriverPhase.RUNNING, attempt=2)
    assert b"unhealthy" not in protocol.encode_driver_request(running)


@pytest.mark.parametrize(
    ("key", "value", "message"),
    [
        ("unhealthy", [["node6"]], r"unhealthy\[0\] must be a \[node, detail\] pair"),
        ("unhealthy", [["node6", 3]], r"unhealthy\[0\] must be a \[node, detail\] pair"),
        ("unhealthy", [["../x", "FAIL"]], "node"),
        ("checked", ["node5", 7], "checked must hold strings"),
        ("checked", "node5", "checked must be a list"),
    ],
)
def test_a_malformed_spare_check_report_is_refused(key: str, value: Any, message: str) -> None:
    document = json.loads(protocol.encode_driver_request(
        protocol.DriverRequest("4711", protocol.DriverPhase.SPARE_CHECK, attempt=2)
    ))  # fmt: skip
    document[key] = value
    with pytest.raises(ProtocolError, match=message):
        protocol.decode_driver_request(json.dumps(document).encode())


@pytest.mark.parametrize(
    ("skips", "message"),
    [
        ([[8, 8]], r"skip_samples\[0\]\.end must be an integer in \[9"),
        ([[9, 3]], r"skip_samples\[0\]\.end"),
        ([[-1, 3]], r"skip_samples\[0\]\.start must be an integer in \[0"),
        ([[0, 1.5]], r"\.end must be an integer"),
        ([[True, 3]], r"\.start must be an integer"),
        ([[0, 3, 4]], r"skip_samples\[0\] must be a \[start, end\] pair"),
        ([{"start": 0}], "must be a \\[start, end\\] pair"),
        ({"0": 3}, "skip_samples must be a list"),
        ([[0, 1]] * (protocol.MAX_SKIP_RANGES + 1), "has 65 items"),
    ],
)
def test_a_driver_answer_with_malformed_skip_samples_is_refused(skips: Any, message: str) -> None:
    document = json.loads(
        protocol.encode_driver_answer(protocol.DriverAnswer(protocol.DriverAction.LAUNCH, 3))
    )
    document["skip_samples"] = skips
    with pytest.raises(ProtocolError, match=message):
        protocol.decode_driver_answer(json.dumps(document).encode())


def test_a_heartbeat_carries_a_ranks_compute_median_when_it_measures_one() -> None:
    timed = RankStatus(4, 0, 4241, 120, "train", NOW - 1.0, 0.5, 0.9, 0.55, 100, 0.125, 40)
    report = HeartbeatReport("4711", "node3", NOW, (timed,), INCARNATION)
    decoded = protocol.decode_heartbeat(protocol.encode_heartbeat(report))
    assert decoded.ranks[0].compute_p50_s == 0.125 and decoded.ranks[0].compute_observed == 40
    # Without a measurement the fields stay off the wire and read as none.
    assert b"compute" not in protocol.encode_heartbeat(heartbeat())
    assert protocol.decode_heartbeat(protocol.encode_heartbeat(heartbeat())) == heartbeat()


def test_a_heartbeat_may_name_its_attempt() -> None:
    report = HeartbeatReport("4711", "node3", NOW, (), INCARNATION, attempt=3)
    assert protocol.decode_heartbeat(protocol.encode_heartbeat(report)).attempt == 3
    without = HeartbeatReport("4711", "node3", NOW, (), INCARNATION)
    assert b"attempt" not in protocol.encode_heartbeat(without)
    assert protocol.decode_heartbeat(protocol.encode_heartbeat(without)).attempt is None


@pytest.mark.parametrize(
    ("lines", "message"),
    [
        (["ok a", "two\nlines"], r"health_checks\[1\] must be one line"),
        (["ok a\r"], r"health_checks\[0\] must be one line"),
        (["x" * 1025], r"health_checks\[0\] must be one line .* at most 1024"),
        ([3], r"health_checks\[0\] must be one line"),
        (["ok"] * 33, "has 33 items"),
        ("ok a", "must be a list"),
    ],
    ids=["newline", "carriage return", "too long", "not a string", "too many", "not a list"],
)
def test_agent_started_health_checks_are_lines_of_bounded_count_and_length(
    lines: Any, message: str
) -> None:
    payload = {**PAYLOADS[EventKind.AGENT_STARTED], "health_checks": lines}
    with pytest.raises(ProtocolError, match=message):
        protocol.make_event(EventKind.AGENT_STARTED, "1234", "node3", INCARNATION, 1, NOW, payload)
    del payload["health_checks"]
    without = protocol.make_event(
        EventKind.AGENT_STARTED, "1234", "node3", INCARNATION, 1, NOW, payload
    )
    assert "health_checks" not in without.payload


def test_a_failed_health_gate_names_its_failing_checks_and_carries_their_lines() -> None:
    lines = (
        "ok builtin:rdzv_addr (0.00 s): node1 resolves to 10.0.0.1, routed via 10.0.0.3\n"
        "FAIL builtin:ckpt_root (0.01 s): checkpoint root /ckpt/job has 0.20 GB free, under "
        "health_min_free_gb 1: delete old checkpoints or lower the setting\n"
    )
    payload = {"command": ["builtin:ckpt_root"], "exit_code": None, "output_tail": lines,
               "timed_out": False}  # fmt: skip
    event = protocol.make_event(
        EventKind.HEALTH_CHECK_FAILED, "1234", "node3", INCARNATION, 1, NOW, payload
    )
    assert protocol.decode_event(protocol.encode_event(event)).payload == payload


@pytest.mark.parametrize(
    ("extra", "reason"),
    [
        ({"grad_norm": -0.5}, "grad_norm"),
        # Not even encodable as JSON: refused before any field is looked at.
        ({"grad_norm": float("nan")}, "finite"),
        ({"grad_norm": float("inf")}, "finite"),
        ({"grad_norm": "1.5"}, "grad_norm"),
        ({"grad_norm": True}, "grad_norm"),
        ({"grad_norm": None, "grad_non_finite": "NaN"}, "grad_non_finite"),
        ({"grad_norm": None, "grad_non_finite": None}, "grad_non_finite"),
    ],
)
def test_a_steps_grad_norm_is_a_finite_norm_or_null_with_its_kind(
    extra: dict[str, Any], reason: str
) -> None:
    payload = {"global_rank": 0, "steps": [{"step": 1, "loss": 0.5, "cursor": 0, **extra}]}
    with pytest.raises(protocol.ProtocolError, match=reason):
        protocol.make_event(EventKind.STEP_LOSSES, "1234", "node3", INCARNATION, 1, NOW, payload)


@pytest.mark.parametrize("kind", ["nan", "inf", "-inf"])
def test_a_steps_grad_norm_kinds_are_accepted_and_kept(kind: str) -> None:
    entry = {"step": 1, "loss": None, "cursor": 0, "non_finite": "nan", "grad_norm": None,
             "grad_non_finite": kind}  # fmt: skip
    payload = {"global_rank": 0, "steps": [entry]}
    event = protocol.make_event(
        EventKind.STEP_LOSSES, "1234", "node3", INCARNATION, 1, NOW, payload
    )
    assert protocol.decode_event(protocol.encode_event(event)).payload == payload


@pytest.mark.parametrize("bad", ["NaN", "infinity", 1.0, None, ""])
def test_a_steps_non_finite_kind_is_one_of_nan_inf_minus_inf(bad: object) -> None:
    payload = {
        "global_rank": 0,
        "steps": [{"step": 1, "loss": None, "cursor": 0, "non_finite": bad}],
    }
    with pytest.raises(protocol.ProtocolError, match="non_finite"):
        protocol.make_event(EventKind.STEP_LOSSES, "1234", "node3", INCARNATION, 1, NOW, payload)
