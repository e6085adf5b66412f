"""The validation child kept warm while the supervisor follows a job, stopped without one."""

from __future__ import annotations

import asyncio

from supervisor.act.validation import IDLE_STOP_S, WarmWhileNeeded


class Child:
    """A validation process that only records being started and stopped."""

    def __init__(self, fails: int = 0) -> None:
        self.running = False
        self.log: list[str] = []
        self._fails = fails

    async def start(self) -> None:
        if self._fails:
            self._fails -= 1
            raise RuntimeError("the checkpoint validation process did not start")
        self.running = True
        self.log.append("start")

    async def aclose(self) -> None:
        self.running = False
        self.log.append("stop")


def test_started_for_a_job_and_stopped_after_a_while_without_one() -> None:
    child, clock = Child(), [0.0]
    keeper = WarmWhileNeeded(child, clock=lambda: clock[0])

    async def life() -> None:
        await keeper.check(0)  # an idle supervisor: no child
        assert child.log == []
        await keeper.check(1)  # a job: the child is warm before its first fault
        await keeper.check(2)
        assert child.log == ["start"] and child.running
        await keeper.check(0)  # the job ended: kept a while for the next one
        clock[0] += IDLE_STOP_S - 1
        await keeper.check(0)
        assert child.running
        await keeper.check(1)  # a job in between resets the while
        await keeper.check(0)
        clock[0] += IDLE_STOP_S - 1
        await keeper.check(0)
        assert child.running
        clock[0] += 2
        await keeper.check(0)
        assert child.log == ["start", "stop"] and not child.running

    asyncio.run(life())


def test_a_child_that_does_not_start_is_tried_again_at_the_next_check() -> None:
    child = Child(fails=1)
    keeper = WarmWhileNeeded(child, clock=lambda: 0.0)

    async def life() -> None:
        await keeper.check(1)
        assert not child.running
        await keeper.check(1)
        assert child.running

    asyncio.run(life())


def test_the_background_validator_started_on_demand_is_stopped_with_it() -> None:
    child, background, clock = Child(), Child(), [0.0]
    keeper = WarmWhileNeeded(child, also_stop=(background,), clock=lambda: clock[0])

    async def life() -> None:
        await keeper.check(1)
        await background.start()  # a checkpoint was validated ahead of any fault
        await keeper.check(0)
        clock[0] += IDLE_STOP_S
        await keeper.check(0)
        assert not child.running and not background.running

    asyncio.run(life())


def test_kept_cold_it_is_left_to_the_first_validation_and_still_stopped_when_idle() -> None:
    child, clock = Child(), [0.0]
    keeper = WarmWhileNeeded(child, start_early=False, clock=lambda: clock[0])

    async def life() -> None:
        await keeper.check(1)
        assert child.log == [] and not child.running
        await child.start()  # a recovery's validation started it
        await keeper.check(0)
        clock[0] += IDLE_STOP_S
        await keeper.check(0)
        assert child.log == ["start", "stop"]

    asyncio.run(life())
