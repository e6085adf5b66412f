"""The supervisor's HTTP API on 127.0.0.1: every answer it gives to a single request.

200 for signed reports and job status, 401 for missing, malformed, wrong or stale
signatures, 403 for another job's or node's data, 400/405/413 for bad bodies,
methods and sizes. Faults and logging, the real agent, and the heartbeat stream are
in ``test_api_faults.py``, ``test_api_agent.py`` and ``test_api_streams.py``.

Each test starts the real server (``serve`` on a free loopback port) over a
:class:`MemoryDirectory` and talks HTTP to it with aiohttp's client; the clock
is fixed at ``NOW`` so the replay window is exact (``api_world``).
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator

import pytest

from agent.wire import protocol
from agent.wire.protocol import Command, CommandKind, EventKind, HeartbeatReport, RankStatus
from tests.unit.api_world import (
    INCARNATION,
    JOB,
    NODES,
    NOW,
    OTHER_JOB,
    OTHER_SECRET,
    SECRET,
    Api,
    assert_refused,
    event,
    heartbeat,
    run,
    scenario,
)

# -- 200 ---------------------------------------------------------------------


def test_healthz_answers_without_credentials() -> None:
    async def test(api: Api) -> None:
        async with api.session.get(api.url + "/healthz") as response:
            assert response.status == 200
            document = await response.json()
        assert document["status"] == "ok"
        assert SECRET.hex() not in json.dumps(document)

    run(scenario(test))


def test_signed_events_are_recorded_once_and_acknowledged() -> None:
    async def test(api: Api) -> None:
        events = [event(1), event(2)]
        answer = await api.send(protocol.EVENTS_PATH, protocol.encode_events(events))
        assert answer.status == 200
        reply = protocol.decode_reply(answer.body)
        assert reply.accepted_event_ids == tuple(e.event_id for e in events)
        assert api.directory.events(JOB) == events

    run(scenario(test))


def test_replay_inside_the_window_is_acknowledged_again_and_recorded_once() -> None:
    async def test(api: Api) -> None:
        body = protocol.encode_events([event(1)])
        first = await api.send(protocol.EVENTS_PATH, body)
        again = await api.send(protocol.EVENTS_PATH, body)
        assert first.status == again.status == 200
        assert first.body == again.body
        assert api.directory.events(JOB) == [event(1)]

    run(scenario(test))


def test_heartbeat_is_taken_and_an_older_one_does_not_replace_it() -> None:
    async def test(api: Api) -> None:
        newer = await api.send(protocol.HEARTBEAT_PATH, heartbeat(time_unix_s=NOW))
        older = await api.send(protocol.HEARTBEAT_PATH, heartbeat(time_unix_s=NOW - 5))
        assert newer.status == older.status == 200
        assert protocol.decode_reply(newer.body).accepted_event_ids == ()
        assert api.directory.heartbeats(JOB)["node1"].time_unix_s == NOW

    run(scenario(test))


def test_commands_ride_on_the_reply_to_their_node_once() -> None:
    async def test(api: Api) -> None:
        stop = Command(CommandKind.STOP_RANKS, "c-1", {"grace_s": 30.0})
        api.directory.queue_command(JOB, "node2", stop)
        other_node = await api.send(protocol.HEARTBEAT_PATH, heartbeat(node="node1"))
        assert protocol.decode_reply(other_node.body).commands == ()
        first = await api.send(
            protocol.EVENTS_PATH, protocol.encode_events([event(1, node="node2")])
        )
        second = await api.send(protocol.HEARTBEAT_PATH, heartbeat(node="node2"))
        assert protocol.decode_reply(first.body).commands == (stop,)
        assert protocol.decode_reply(second.body).commands == ()

    run(scenario(test))


def test_a_batch_mixing_nodes_gets_no_commands() -> None:
    async def test(api: Api) -> None:
        api.directory.queue_command(
            JOB, "node1", Command(CommandKind.STOP_RANKS, "c-1", {"grace_s": 1.0})
        )
        body = protocol.encode_events([event(1, node="node1"), event(1, node="node2")])
        answer = await api.send(protocol.EVENTS_PATH, body)
        assert answer.status == 200
        assert protocol.decode_reply(answer.body).commands == ()

    run(scenario(test))


def test_job_status_is_signed_with_the_jobs_secret() -> None:
    async def test(api: Api) -> None:
        await api.send(protocol.EVENTS_PATH, protocol.encode_events([event(1)]))
        answer = await api.send(f"/v1/jobs/{JOB}", method="GET")
        assert answer.status == 200
        document = answer.json()
        assert document["job_id"] == JOB
        assert document["status"]["nodes"] == list(NODES)
        assert document["status"]["events"] == 1
        unsigned = await api.send(f"/v1/jobs/{JOB}", method="GET", drop=[protocol.HEADER_SIGNATURE])
        assert_refused(unsigned, 401, "missing_auth")

    run(scenario(test))


# -- 401 ---------------------------------------------------------------------


@pytest.mark.parametrize(
    "header", [protocol.HEADER_JOB, protocol.HEADER_TIMESTAMP, protocol.HEADER_SIGNATURE]
)
def test_unauthenticated_request_is_refused_401(header: str) -> None:
    async def test(api: Api) -> None:
        answer = await api.send(
            protocol.EVENTS_PATH, protocol.encode_events([event(1)]), drop=[header]
        )
        assert_refused(answer, 401, "missing_auth")
        assert api.directory.events(JOB) == []

    run(scenario(test))


@pytest.mark.parametrize(
    "headers",
    [
        # Fullwidth digits: int() would take them.
        {protocol.HEADER_TIMESTAMP: "\uff11\uff17\uff16\uff10"},
        {protocol.HEADER_TIMESTAMP: "1_760_000_000"},
        {protocol.HEADER_TIMESTAMP: "-1"},
        {protocol.HEADER_TIMESTAMP: "9" * 5000},
        {protocol.HEADER_JOB: "../4711"},
    ],
)
def test_malformed_signing_headers_are_refused_401(headers: dict[str, str]) -> None:
    async def test(api: Api) -> None:
        answer = await api.send(
            protocol.EVENTS_PATH, protocol.encode_events([event(1)]), headers=headers
        )
        assert_refused(answer, 401, "malformed_auth")

    run(scenario(test))


def test_request_for_an_unknown_job_is_refused_401() -> None:
    async def test(api: Api) -> None:
        answer = await api.send(
            protocol.EVENTS_PATH, protocol.encode_events([event(1, job="9999")]), job="9999"
        )
        assert_refused(answer, 401, "unknown_job")

    run(scenario(test))


def test_wrongly_signed_request_is_refused_401() -> None:
    async def test(api: Api) -> None:
        body = protocol.encode_events([event(1)])
        wrong_secret = await api.send(protocol.EVENTS_PATH, body, secret=OTHER_SECRET)
        altered_body = await api.send(protocol.EVENTS_PATH, body, signed_body=body + b" ")
        other_path = await api.send(protocol.EVENTS_PATH, body, signed_path=protocol.HEARTBEAT_PATH)
        for answer in (wrong_secret, altered_body, other_path):
            assert_refused(answer, 401, "bad_signature")
        assert api.directory.events(JOB) == []

    run(scenario(test))


@pytest.mark.parametrize("skew_s", [-301, 301, -(10**9)])
def test_request_outside_the_replay_window_is_refused_401(skew_s: int) -> None:
    async def test(api: Api) -> None:
        answer = await api.send(
            protocol.EVENTS_PATH, protocol.encode_events([event(1)]), timestamp=max(0, NOW + skew_s)
        )
        document = assert_refused(answer, 401, "stale_timestamp")
        assert "NTP" in document["reason"]

    run(scenario(test))


def test_request_at_the_edge_of_the_window_is_accepted() -> None:
    async def test(api: Api) -> None:
        answer = await api.send(
            protocol.EVENTS_PATH, protocol.encode_events([event(1)]), timestamp=NOW - 300
        )
        assert answer.status == 200

    run(scenario(test))


# -- 403 ---------------------------------------------------------------------


def test_events_about_another_job_are_refused_403() -> None:
    async def test(api: Api) -> None:
        body = protocol.encode_events([event(1), event(1, job=OTHER_JOB, node="node7")])
        assert_refused(await api.send(protocol.EVENTS_PATH, body), 403, "cross_job")
        assert api.directory.events(JOB) == []
        assert api.directory.events(OTHER_JOB) == []

    run(scenario(test))


def test_heartbeat_about_another_job_is_refused_403() -> None:
    async def test(api: Api) -> None:
        body = heartbeat(job=OTHER_JOB, node="node7")
        assert_refused(await api.send(protocol.HEARTBEAT_PATH, body), 403, "cross_job")
        assert api.directory.heartbeats(OTHER_JOB) == {}

    run(scenario(test))


def test_job_status_of_another_job_is_refused_403() -> None:
    async def test(api: Api) -> None:
        answer = await api.send(f"/v1/jobs/{OTHER_JOB}", method="GET")
        assert_refused(answer, 403, "cross_job")

    run(scenario(test))


def test_event_about_a_node_outside_the_allocation_is_refused_403() -> None:
    async def test(api: Api) -> None:
        body = protocol.encode_events([event(1), event(1, node="node7")])
        assert_refused(await api.send(protocol.EVENTS_PATH, body), 403, "foreign_node")
        assert api.directory.events(JOB) == []

    run(scenario(test))


def test_reports_about_ranks_the_jobs_world_never_had_are_refused_400() -> None:
    def losses(rank: int) -> bytes:
        payload = {"global_rank": rank, "steps": [{"step": 1, "loss": 2.5, "cursor": 0}]}
        return protocol.encode_events(
            [
                protocol.make_event(
                    EventKind.STEP_LOSSES, JOB, "node1", INCARNATION, rank + 1, NOW, payload
                )
            ]
        )

    def beat(rank: int, local: int) -> bytes:
        status = RankStatus(rank, local, 4242, 10, "train", NOW - 1.0, 0.5, 0.9, 0.55, 10)
        report = HeartbeatReport(JOB, "node1", NOW, (status,), INCARNATION)
        return protocol.encode_heartbeat(report)

    async def test(api: Api) -> None:
        api.directory.add_job(JOB, SECRET, NODES, ranks=(4, 2))  # 2 nodes x 2 ranks
        assert (await api.send(protocol.EVENTS_PATH, losses(3))).status == 200
        refused = assert_refused(await api.send(protocol.EVENTS_PATH, losses(4)), 400,
                                 "unknown_rank")  # fmt: skip
        assert "at most 4 ranks" in refused["reason"]
        assert_refused(await api.send(protocol.EVENTS_PATH, losses(10**6)), 400, "unknown_rank")
        assert len(api.directory.events(JOB)) == 1  # the refused ones stored nothing
        # A heartbeat is never refused for its ranks: a refused one would let the
        # node's lease lapse. The daemon learns the ranks per node from them.
        assert (await api.send(protocol.HEARTBEAT_PATH, beat(9, 3))).status == 200

    run(scenario(test))


def test_events_beyond_a_jobs_budget_a_minute_are_refused_429_and_stored_nowhere() -> None:
    async def test(api: Api) -> None:
        first = protocol.encode_events([event(seq) for seq in range(1, 31)])
        assert (await api.send(protocol.EVENTS_PATH, first)).status == 200
        second = protocol.encode_events([event(seq) for seq in range(31, 61)])
        answer = await api.send(protocol.EVENTS_PATH, second)
        refused = assert_refused(answer, 429, "rate_limited")
        assert "more than 50 events in a minute" in refused["reason"]
        assert answer.headers["Retry-After"] == "10"
        assert len(api.directory.events(JOB)) == 30
        # Another job's budget is its own.
        other = protocol.encode_events([event(1, job=OTHER_JOB, node="node7")])
        assert (await api.send(protocol.EVENTS_PATH, other, secret=OTHER_SECRET,
                               job=OTHER_JOB)).status == 200  # fmt: skip

    run(scenario(test, events_per_minute=50))


def test_a_node_shrunk_out_of_the_job_is_refused_403() -> None:
    async def test(api: Api) -> None:
        assert (await api.send(protocol.HEARTBEAT_PATH, heartbeat(node="node2"))).status == 200
        api.directory.set_allocation(JOB, ["node1"])
        answer = await api.send(protocol.HEARTBEAT_PATH, heartbeat(node="node2"))
        assert_refused(answer, 403, "foreign_node")

    run(scenario(test))


# -- 400, 405, 413 -----------------------------------------------------------


@pytest.mark.parametrize(
    ("body", "in_reason"),
    [
        (b"{not json", "not valid UTF-8 JSON"),
        (b"\xff\xfe", "not valid UTF-8 JSON"),
        (b'{"protocol": 1, "type": "events", "events": []}', "events.events has 0 items"),
        (b'{"protocol": 2, "type": "events", "events": []}', "protocol version 2"),
        (b'{"protocol": 1, "type": "heartbeat"}', "expected 'events'"),
    ],
)
def test_malformed_body_is_refused_400_with_protocols_reason(body: bytes, in_reason: str) -> None:
    async def test(api: Api) -> None:
        document = assert_refused(await api.send(protocol.EVENTS_PATH, body), 400, "malformed")
        assert in_reason in document["reason"]

    run(scenario(test))


def test_wrong_protocol_header_is_refused_400() -> None:
    async def test(api: Api) -> None:
        answer = await api.send(
            protocol.EVENTS_PATH,
            protocol.encode_events([event(1)]),
            headers={protocol.HEADER_PROTOCOL: "2"},
        )
        assert_refused(answer, 400, "unsupported_protocol")

    run(scenario(test))


@pytest.mark.parametrize(
    ("method", "path"),
    [("GET", protocol.EVENTS_PATH), ("PUT", protocol.HEARTBEAT_PATH), ("POST", "/healthz")],
)
def test_wrong_method_is_refused_405(method: str, path: str) -> None:
    async def test(api: Api) -> None:
        answer = await api.send(path, method=method)
        assert_refused(answer, 405, "method_not_allowed")
        assert answer.headers["Allow"]

    run(scenario(test))


def test_oversized_body_is_refused_413() -> None:
    async def test(api: Api) -> None:
        body = protocol.encode_events([event(seq) for seq in range(1, 40)])
        assert len(body) > 1024
        answer = await api.send(protocol.EVENTS_PATH, body)
        assert_refused(answer, 413, "too_large")

    run(scenario(test, max_body_bytes=1024))


def test_oversized_chunked_body_without_length_is_refused_413() -> None:
    async def test(api: Api) -> None:
        body = protocol.encode_events([event(seq) for seq in range(1, 40)])

        async def chunks() -> AsyncIterator[bytes]:
            for start in range(0, len(body), 100):
                yield body[start : start + 100]

        headers = protocol.signed_headers(SECRET, "POST", protocol.EVENTS_PATH, JOB, NOW, body)
        async with api.session.post(
            api.url + protocol.EVENTS_PATH, data=chunks(), headers=headers
        ) as response:
            assert response.status == 413
            assert (await response.json())["error"] == "too_large"

    run(scenario(test, max_body_bytes=1024))
