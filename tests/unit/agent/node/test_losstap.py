"""The loss tap's bookkeeping: sums per step, steps wait for their copy in order, none
raises into the training loop. (A real rank's losses: tests/integration/test_autohooks.py.)"""

from __future__ import annotations

import math

import pytest
import torch

from agent.node.hang import HangConfig
from agent.node.watch import RankMonitor
from agent.train import losstap
from agent.train.losstap import LossTap
from agent.wire.datagram import StepReport, encode_step_report, parse_datagram


def loss(value: float) -> torch.Tensor:
    return torch.tensor(value, requires_grad=True)


def test_a_step_is_the_sum_of_its_backward_passes_and_read_at_once_on_the_cpu() -> None:
    tap = LossTap()
    tap.started_backward(loss(0.25))
    tap.started_backward(loss(0.5))
    assert tap.step_ended(7) == [(7, 0.75)]
    assert tap.step_ended(8) == []  # no backward in step 8: no loss, not a zero


def test_what_is_no_loss_is_left_out() -> None:
    tap = LossTap()
    tap.started_backward(torch.ones(3, requires_grad=True))  # not a scalar
    tap.started_backward(torch.tensor(2.0))  # needs no grad: not a backward's start
    tap.started_backward(torch.tensor(3, dtype=torch.int64))
    tap.started_backward("not a tensor")
    assert tap.step_ended(1) == []


def test_a_scaled_loss_is_divided_by_its_scale() -> None:
    tap = LossTap()
    scaled = losstap.mark_scaled(loss(3.0) * 1024.0, torch.tensor(1024.0))
    tap.started_backward(scaled)
    assert tap.step_ended(1) == [(1, 3.0)]


def test_a_copy_still_on_its_way_waits_and_later_steps_wait_behind_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    done: set[int] = set()
    monkeypatch.setattr(losstap._OnItsWay, "ready", lambda self: self.step in done)
    tap = LossTap()
    tap.started_backward(loss(1.0))
    assert tap.step_ended(1) == []  # a GPU's copy is not done at the step's end
    tap.started_backward(loss(2.0))
    done.add(2)
    assert tap.step_ended(2) == []  # in order: step 2 waits for step 1
    done.add(1)
    tap.started_backward(loss(3.0))
    assert tap.step_ended(3) == [(1, 1.0), (2, 2.0)]
    assert losstap.MAX_IN_FLIGHT == 4
    for step in range(4, 12):  # never ready: only the newest 4 are kept waiting
        tap.started_backward(loss(float(step)))
        tap.step_ended(step)
    done.update(range(100))
    tap.started_backward(loss(50.0))
    assert [step for step, _ in tap.step_ended(50)] == [9, 10, 11, 50]


def test_a_non_finite_loss_is_reported_as_it_is() -> None:
    tap = LossTap()
    tap.started_backward(loss(float("nan")))
    ((step, value),) = tap.step_ended(4)
    assert step == 4 and math.isnan(value)


def test_a_loaded_checkpoint_drops_what_was_summed() -> None:
    tap = LossTap()
    tap.started_backward(loss(9.0))
    tap.forget()
    assert tap.step_ended(41) == []


def test_an_automatic_step_report_travels_flagged_and_is_a_beat_of_the_bootstrap() -> None:
    data = encode_step_report(
        rank=1, local_rank=0, pid=10, step=5, loss=float("inf"), cursor=None,
        wall_time_s=1.0, automatic=True,
    )  # fmt: skip
    report = parse_datagram(data)
    assert isinstance(report, StepReport) and report.automatic and report.loss == math.inf
    assert report.as_beat().automatic
    sent = encode_step_report(rank=1, local_rank=0, pid=10, step=5, loss=1.0, cursor=3,
                              wall_time_s=1.0)  # fmt: skip
    plain = parse_datagram(sent)
    assert isinstance(plain, StepReport) and not plain.automatic


def test_a_late_loss_report_does_not_move_its_rank_back() -> None:
    async def emit(*_: object) -> None:
        return None

    monitor = RankMonitor(HangConfig(), 1.0, emit)
    late = StepReport(0, 0, 10, 4, 1.0, None, 0.0, automatic=True)
    assert not monitor.is_behind(late)
    monitor.on_beat(StepReport(0, 0, 10, 5, None, None, 0.0, automatic=True).as_beat(), 1.0)
    assert monitor.is_behind(late)
    assert not monitor.is_behind(StepReport(0, 0, 11, 4, 1.0, None, 0.0, automatic=True))
