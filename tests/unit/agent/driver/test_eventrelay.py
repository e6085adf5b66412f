"""The job's event relay between real Reporters and the real supervisor API.

As in ``test_aggregator.py``: the supervisor's API over a :class:`MemoryDirectory`
and an :class:`Aggregator` on loopback ports; the agents are the agent's own
:class:`Reporter`, so their spools show what was acknowledged.
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

import pytest

from agent.driver.aggregator import Aggregator
from agent.node.client import AGGREGATOR_RETRY_S, Reporter
from agent.wire import protocol
from agent.wire.auth import new_secret
from agent.wire.protocol import Command, CommandKind, EventKind
from tests.unit.api_world import JOB, NOW, SECRET, Api, run, scenario

MANY = tuple(f"node{index}" for index in range(1, 21))


def step_losses(step: int) -> dict[str, object]:
    return {"global_rank": 0, "steps": [{"step": step, "loss": 0.5, "cursor": step}]}


def exited(exit_code: int | None, signal: int | None) -> dict[str, object]:
    return {"global_rank": 0, "local_rank": 0, "pid": 4242, "exit_code": exit_code,
            "signal": signal, "signal_name": None, "last_step": 6, "phase": "train"}  # fmt: skip


def checkpoint(step: int) -> dict[str, object]:
    return {"step": step, "path": f"/ckpt/step_{step:08d}", "global_rank": 0}


async def started(api: Api, nodes: tuple[str, ...] = MANY) -> Aggregator:
    api.directory.set_allocation(JOB, nodes)
    aggregator = Aggregator(JOB, SECRET, api.url, nodes, clock=lambda: NOW, period_s=3600.0)
    await aggregator.start(api.session, "127.0.0.1")
    return aggregator


def reporter(api: Api, aggregator: Aggregator, node: str, tmp_path: Path, **kw: object) -> Reporter:
    return Reporter(
        api.url, JOB, node, SECRET, tmp_path / node, clock=lambda: NOW,
        aggregator_url=aggregator.url, **kw,  # type: ignore[arg-type]
    )  # fmt: skip


def test_many_agents_routine_events_reach_the_supervisor_in_few_requests_each_acked(
    tmp_path: Path,
) -> None:
    async def test(api: Api) -> None:
        aggregator = await started(api)
        reporters = [reporter(api, aggregator, node, tmp_path) for node in MANY]
        try:
            for one in reporters:
                await one.emit(EventKind.CHECKPOINT_COMMITTED, checkpoint(20))
                await one.emit(EventKind.STEP_LOSSES, step_losses(21))
            await asyncio.gather(*(one.start() for one in reporters))
            assert all(await asyncio.gather(*(one.flush(10.0) for one in reporters)))
            stored = api.directory.events(JOB)
            assert len(stored) == 2 * len(MANY)
            assert {event.node for event in stored} == set(MANY)
            assert all(one.pending == 0 for one in reporters)  # each spool acknowledged
            relay = aggregator.relay
            assert relay.batches_relayed == len(MANY)
            # Batches that came while a request was answered went in the next one.
            assert 1 <= relay.requests_sent < len(MANY), relay.requests_sent
        finally:
            await asyncio.gather(*(one.close() for one in reporters))
            await aggregator.close()

    run(scenario(test))


def test_a_rank_exit_goes_straight_to_the_supervisor_and_so_does_its_whole_batch(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    async def test(api: Api) -> None:
        aggregator = await started(api)
        try:
            async with reporter(api, aggregator, "node1", tmp_path) as one:
                await one.emit(EventKind.STEP_LOSSES, step_losses(5))
                assert await one.flush(5.0)
                assert aggregator.relay.batches_relayed == 1
                await one.emit(EventKind.STEP_LOSSES, step_losses(6))
                await one.emit(EventKind.RANK_EXITED, exited(None, 9))
                with caplog.at_level(logging.WARNING):
                    assert await one.flush(5.0)
                assert aggregator.relay.batches_relayed == 1  # not through the relay
                assert "aggregator did not take" not in caplog.text  # nor refused by it
                kinds = [event.kind for event in api.directory.events(JOB)]
                assert kinds == [EventKind.STEP_LOSSES, EventKind.STEP_LOSSES,
                                 EventKind.RANK_EXITED]  # fmt: skip
        finally:
            await aggregator.close()

    run(scenario(test))


def test_events_go_straight_to_the_supervisor_while_the_aggregator_is_gone(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    now = [NOW]

    async def test(api: Api) -> None:
        aggregator = await started(api)
        async with Reporter(
            api.url, JOB, "node1", SECRET, tmp_path / "node1", clock=lambda: now[0],
            aggregator_url=aggregator.url,
        ) as one:  # fmt: skip
            await one.emit(EventKind.STEP_LOSSES, step_losses(1))
            assert await one.flush(5.0)
            await aggregator.close()  # as when the batch host dies
            with caplog.at_level(logging.WARNING):
                await one.emit(EventKind.STEP_LOSSES, step_losses(2))
                assert await one.flush(5.0)
            assert "events and heartbeats go straight to the supervisor" in caplog.text
            assert [e.payload["steps"][0]["step"] for e in api.directory.events(JOB)] == [1, 2]
            # The aggregator is tried again after a while; gone, it costs one more miss.
            now[0] += AGGREGATOR_RETRY_S
            await one.emit(EventKind.STEP_LOSSES, step_losses(3))
            assert await one.flush(5.0)
            assert len(api.directory.events(JOB)) == 3

    run(scenario(test))


def test_one_agents_refused_batch_does_not_hold_back_the_others(tmp_path: Path) -> None:
    """node1's and node2's batches wait together while node3's is answered; the supervisor
    refuses their request (node2 left the job's allocation), so the relay sends each batch
    alone: node1's is stored, node2 is answered with the refusal and keeps its event."""

    async def test(api: Api) -> None:
        aggregator = await started(api, ("node1", "node2", "node3"))
        api.directory.set_allocation(JOB, ("node1", "node3"))
        stop = Command(CommandKind.STOP_RANKS, "c-1", {"grace_s": 30.0})
        got: list[Command] = []
        first_in, go_on = asyncio.Event(), asyncio.Event()
        refuse = api.directory.refuse_events

        async def slow_first(job_id: str, events: object) -> str | None:
            if not first_in.is_set():
                first_in.set()
                await go_on.wait()
            return await refuse(job_id, events)  # type: ignore[arg-type]

        api.directory.refuse_events = slow_first  # type: ignore[method-assign]
        try:
            async with (
                reporter(api, aggregator, "node1", tmp_path, on_command=got.append) as one,
                reporter(api, aggregator, "node2", tmp_path) as two,
                reporter(api, aggregator, "node3", tmp_path) as three,
            ):
                await three.emit(EventKind.STEP_LOSSES, step_losses(1))
                await first_in.wait()  # node3's request is at the supervisor
                api.directory.queue_command(JOB, "node1", stop)
                await one.emit(EventKind.STEP_LOSSES, step_losses(1))
                await two.emit(EventKind.STEP_LOSSES, step_losses(1))
                while len(aggregator.relay._waiting) < 2:
                    await asyncio.sleep(0.01)
                go_on.set()
                assert await one.flush(5.0) and await three.flush(5.0)
                assert [e.node for e in api.directory.events(JOB)] == ["node3", "node1"]
                assert got == [stop]  # the supervisor's answer to node1's batch alone
                assert aggregator.relay.requests_sent == 2
                assert not await two.flush(0.5)
                assert two.pending == 1  # kept, sent again
        finally:
            await aggregator.close()

    run(scenario(test))


def test_the_relay_refuses_what_the_job_did_not_sign_other_nodes_and_urgent_kinds(
    tmp_path: Path,
) -> None:
    async def test(api: Api) -> None:
        aggregator = await started(api, ("node1", "node2"))

        async def post(body: bytes, secret: bytes = SECRET) -> int:
            headers = protocol.signed_headers(secret, "POST", protocol.EVENTS_PATH, JOB, NOW, body)
            async with api.session.post(
                aggregator.url + protocol.EVENTS_PATH, data=body, headers=headers
            ) as response:
                return response.status

        def batch(kind: EventKind, payload: dict[str, object], node: str = "node1") -> bytes:
            made = protocol.make_event(kind, JOB, node, "9f2c1ab04d7e3310", 1, NOW, payload)
            return protocol.encode_events([made])

        try:
            routine = batch(EventKind.STEP_LOSSES, step_losses(1))
            assert await post(routine, new_secret()) == 401
            assert await post(batch(EventKind.STEP_LOSSES, step_losses(1), "node9")) == 403
            assert await post(batch(EventKind.RANK_EXITED, exited(1, None))) == 400
            assert await post(b"{") == 400
            assert api.directory.events(JOB) == []
            assert await post(routine) == 200
            assert len(api.directory.events(JOB)) == 1
        finally:
            await aggregator.close()

    run(scenario(test))


def test_a_batch_that_comes_while_the_relay_stops_is_sent_back_at_once(tmp_path: Path) -> None:
    """Nothing is left waiting on the listener's shutdown (which would hold the driver's
    exit for aiohttp's shutdown timeout): the agent is told to send to the supervisor."""

    async def test(api: Api) -> None:
        aggregator = await started(api, ("node1",))
        try:
            await aggregator.relay.close()
            made = protocol.make_event(
                EventKind.STEP_LOSSES, JOB, "node1", "9f2c1ab04d7e3310", 1, NOW, step_losses(1)
            )
            body = protocol.encode_events([made])
            headers = protocol.signed_headers(SECRET, "POST", protocol.EVENTS_PATH, JOB, NOW, body)
            async with (
                asyncio.timeout(2.0),
                api.session.post(
                    aggregator.url + protocol.EVENTS_PATH, data=body, headers=headers
                ) as response,
            ):
                assert response.status == 503
                assert "send the events to the supervisor" in await response.text()
        finally:
            await aggregator.close()

    run(scenario(test))
