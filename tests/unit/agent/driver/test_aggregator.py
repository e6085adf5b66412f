"""The job's heartbeat aggregator between real Reporters and the real supervisor API.

Each test starts the supervisor's API (``build_app`` over a
:class:`MemoryDirectory`, ``api_world``) and an :class:`Aggregator` on loopback
ports, and sends heartbeats with the agent's own :class:`Reporter`: what the
supervisor receives is the aggregator's ``POST /v1/job/heartbeats``, decoded by
the supervisor's route.
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path

import aiohttp
import pytest

from agent.driver.aggregator import CUT_OFF_S, Aggregator, due_reports, shape_of
from agent.node.client import AGGREGATOR_RETRY_S, Reporter
from agent.wire import protocol
from agent.wire.auth import new_secret
from agent.wire.protocol import Command, CommandKind, HeartbeatReport, RankStatus
from supervisor.api.refusals import Cause
from tests.unit.api_world import JOB, NODES, NOW, SECRET, Api, run, scenario


def report(
    reporter: Reporter, step: int, phase: str = "train", *, pid: int = 4242
) -> HeartbeatReport:
    rank = RankStatus(0, 0, pid, step, phase, NOW - 1.0, 0.5, 0.9, 0.55, step, 0.4, step)
    return HeartbeatReport(JOB, reporter.node, NOW, (rank,), reporter.incarnation, 1)


def reporter(api: Api, aggregator: Aggregator, node: str, tmp_path: Path, **kw: object) -> Reporter:
    return Reporter(
        api.url, JOB, node, SECRET, tmp_path / node, clock=lambda: NOW,
        aggregator_url=aggregator.url, **kw,  # type: ignore[arg-type]
    )  # fmt: skip


async def started(api: Api, **settings: float) -> Aggregator:
    aggregator = Aggregator(JOB, SECRET, api.url, NODES, clock=lambda: NOW, **settings)
    # A forward period longer than any test: each test forwards by hand.
    await aggregator.start(api.session, "127.0.0.1")
    return aggregator


def test_a_jobs_heartbeats_reach_the_supervisor_in_one_request_with_whole_reports_on_change(
    tmp_path: Path,
) -> None:
    async def test(api: Api) -> None:
        aggregator = await started(api, period_s=3600.0)
        try:
            async with (
                reporter(api, aggregator, "node1", tmp_path) as one,
                reporter(api, aggregator, "node2", tmp_path) as two,
            ):
                assert await one.heartbeat(report(one, 10))
                assert await two.heartbeat(report(two, 9))
                # Nothing reached the supervisor yet: the aggregator holds them.
                assert api.directory._jobs[JOB].job_heartbeats == []
                assert api.directory._jobs[JOB].heartbeats == {}
                await aggregator.forward()
                first = api.directory._jobs[JOB].job_heartbeats[-1]
                assert [(b.node, b.step, b.attempt) for b in first.beats] == [
                    ("node1", 10, 1),
                    ("node2", 9, 1),
                ]
                assert {r.node for r in first.reports} == {"node1", "node2"}
                # Steps moved, nothing else: beats only.
                assert await one.heartbeat(report(one, 11))
                assert await two.heartbeat(report(two, 10))
                await aggregator.forward()
                second = api.directory._jobs[JOB].job_heartbeats[-1]
                assert [b.step for b in second.beats] == [11, 10]
                assert second.reports == ()
                # A rank entering a checkpoint write: that node's whole report at once.
                assert await one.heartbeat(report(one, 12, "checkpoint"))
                assert await two.heartbeat(report(two, 11))
                await aggregator.forward()
                third = api.directory._jobs[JOB].job_heartbeats[-1]
                assert [r.node for r in third.reports] == ["node1"]
                assert third.reports[0].ranks[0].phase == "checkpoint"
                # No heartbeat since: nothing is sent.
                await aggregator.forward()
                assert len(api.directory._jobs[JOB].job_heartbeats) == 3
                assert aggregator.forwarded == 3
                assert (one.streams_opened, two.streams_opened) == (1, 1)
        finally:
            await aggregator.close()

    run(scenario(test))


def test_commands_come_back_through_the_aggregator_to_the_right_agent(tmp_path: Path) -> None:
    stop = Command(CommandKind.STOP_RANKS, "c-1", {"grace_s": 30.0})
    received: dict[str, list[Command]] = {"node1": [], "node2": []}

    async def test(api: Api) -> None:
        aggregator = await started(api, period_s=3600.0)
        try:
            async with (
                reporter(
                    api, aggregator, "node1", tmp_path, on_command=received["node1"].append
                ) as one,
                reporter(
                    api, aggregator, "node2", tmp_path, on_command=received["node2"].append
                ) as two,
            ):
                assert await one.heartbeat(report(one, 1))
                assert await two.heartbeat(report(two, 1))
                api.directory.queue_command(JOB, "node2", stop)
                await aggregator.forward()  # the supervisor's answer holds node2's stop
                assert received == {"node1": [], "node2": []}
                assert await one.heartbeat(report(one, 2))
                assert await two.heartbeat(report(two, 2))
                assert received == {"node1": [], "node2": [stop]}
        finally:
            await aggregator.close()

    run(scenario(test))


def test_an_agent_whose_aggregator_is_gone_reports_straight_to_the_supervisor(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    async def test(api: Api) -> None:
        aggregator = await started(api, period_s=3600.0)
        async with reporter(api, aggregator, "node1", tmp_path) as one:
            assert await one.heartbeat(report(one, 1))
            assert api.directory._jobs[JOB].heartbeats == {}
            await aggregator.close()  # as when the batch host dies
            with caplog.at_level(logging.WARNING):
                assert await one.heartbeat(report(one, 2))
            # This very heartbeat reached the supervisor, directly.
            assert api.directory._jobs[JOB].heartbeats["node1"].ranks[0].step == 2
            assert "heartbeats go straight to the supervisor" in caplog.text
            assert await one.heartbeat(report(one, 3))  # and so do the next ones
            assert api.directory._jobs[JOB].heartbeats["node1"].ranks[0].step == 3

    run(scenario(test))


def test_an_aggregator_cut_off_from_the_supervisor_sends_its_agents_straight_to_it(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Alive but failing every forward (its batch host cut off, say), the aggregator
    refuses its agents' heartbeats after CUT_OFF_S, so that the supervisor hears them
    directly; once it reaches the supervisor again, they come back to it."""
    now = [NOW]
    cut_off = [False]

    def clock() -> float:
        return now[0]

    async def test(api: Api) -> None:
        taken = api.directory.accept_job_heartbeats

        def accept(job_id: str, batch: protocol.JobHeartbeats) -> None:
            if cut_off[0]:
                raise Cause.UNKNOWN_JOB.refuse("as if the batch host could not reach it")
            taken(job_id, batch)

        api.directory.accept_job_heartbeats = accept  # type: ignore[method-assign]
        aggregator = Aggregator(JOB, SECRET, api.url, NODES, clock=clock, period_s=3600.0)
        await aggregator.start(api.session, "127.0.0.1")
        try:
            async with Reporter(
                api.url, JOB, "node1", SECRET, tmp_path / "node1", clock=clock,
                aggregator_url=aggregator.url,
            ) as one:  # fmt: skip
                assert await one.heartbeat(report(one, 1))
                cut_off[0] = True
                await aggregator.forward()
                now[0] += CUT_OFF_S / 2
                assert await one.heartbeat(report(one, 2))  # a passing failure: still taken
                await aggregator.forward()
                assert api.directory._jobs[JOB].heartbeats == {}  # nothing got through
                now[0] += CUT_OFF_S
                with caplog.at_level(logging.WARNING):
                    assert await one.heartbeat(report(one, 3))
                # Refused by the aggregator, this very heartbeat reached the supervisor.
                assert api.directory._jobs[JOB].heartbeats["node1"].ranks[0].step == 3
                assert "heartbeats go straight to the supervisor" in caplog.text
                # The supervisor takes the aggregator's requests again: so it does the
                # agent's heartbeats, once the agent tries it again.
                cut_off[0] = False
                await aggregator.forward()
                assert aggregator.failing_s() == 0.0
                now[0] += AGGREGATOR_RETRY_S
                batches = len(api.directory._jobs[JOB].job_heartbeats)
                assert await one.heartbeat(report(one, 4))
                assert api.directory._jobs[JOB].heartbeats["node1"].ranks[0].step == 3
                await aggregator.forward()
                assert len(api.directory._jobs[JOB].job_heartbeats) == batches + 1
                assert api.directory._jobs[JOB].job_heartbeats[-1].beats[0].step == 4
        finally:
            await aggregator.close()

    run(scenario(test))


def test_the_aggregator_refuses_what_the_job_did_not_sign_and_other_nodes(tmp_path: Path) -> None:
    async def test(api: Api) -> None:
        aggregator = await started(api, period_s=3600.0)
        try:
            path = protocol.HEARTBEAT_STREAM_PATH
            unsigned = protocol.signed_headers(new_secret(), "GET", path, JOB, NOW, b"")
            with pytest.raises(aiohttp.WSServerHandshakeError) as refused:
                await api.session.ws_connect(aggregator.url + path, headers=unsigned)
            assert refused.value.status == 401
            body = protocol.encode_heartbeat(
                HeartbeatReport(JOB, "node1", NOW, (), "9f2c1ab04d7e3310")
            )
            forged = protocol.sign_frame(new_secret(), JOB, NOW, body)
            answer = protocol.decode_stream_answer(aggregator.answer(forged))
            assert isinstance(answer, protocol.Refusal) and answer.status == 401
            stranger = protocol.encode_heartbeat(
                HeartbeatReport(JOB, "node9", NOW, (), "9f2c1ab04d7e3310")
            )
            answer = protocol.decode_stream_answer(
                aggregator.answer(protocol.sign_frame(SECRET, JOB, NOW, stranger))
            )
            assert isinstance(answer, protocol.Refusal) and answer.cause == "foreign_node"
            good = protocol.sign_frame(SECRET, JOB, NOW, body)
            assert isinstance(
                protocol.decode_stream_answer(aggregator.answer(good)), protocol.Reply
            )
            assert aggregator.heartbeats_taken == 1
        finally:
            await aggregator.close()

    run(scenario(test))


def test_whole_reports_go_again_when_due_changes_first_and_at_most_the_limit() -> None:
    rank = RankStatus(0, 0, 7, 5, "train", 1.0, 0.1, 0.1, 0.1, 5)
    reports = {
        f"n{i}": HeartbeatReport(JOB, f"n{i}", 100.0, (rank,), "9f2c1ab04d7e3310") for i in range(5)
    }
    sent = {node: (shape_of(r), 100.0 - 20 + i) for i, (node, r) in enumerate(reports.items())}
    sent["n4"] = (shape_of(reports["n4"]), 99.0)  # recent: not due
    moved = dataclasses.replace(rank, phase="eval")
    reports["n3"] = dataclasses.replace(reports["n3"], ranks=(moved,))
    due = due_reports(reports, sent, 100.0, refresh_s=10.0, limit=3)
    # n3 changed: first; then the oldest due (n0, n1); n4 was sent a second ago.
    assert [r.node for r in due] == ["n3", "n0", "n1"]


def test_a_rank_turning_straggler_or_its_compute_median_firming_up_is_a_change() -> None:
    def node(p50: float, observed: int) -> HeartbeatReport:
        rank = RankStatus(0, 0, 7, 5, "train", 1.0, 0.1, 0.1, 0.1, 5, p50, observed)
        return HeartbeatReport(JOB, "n0", 100.0, (rank,), "9f2c1ab04d7e3310")

    assert shape_of(node(0.40, 40)) == shape_of(node(0.402, 41))  # jitter, a step more
    assert shape_of(node(0.40, 40)) != shape_of(node(0.60, 41))  # 1.5 times slower
    assert shape_of(node(0.40, 60)) != shape_of(node(0.40, 70))  # past 64 steps
