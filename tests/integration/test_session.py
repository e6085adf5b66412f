"""TrainingSession in one process (no process group): choosing and refusing resume points."""

from __future__ import annotations

import logging
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from agent.checkpoint import format as fmt
from agent.skips import ENV_SKIP_SAMPLES
from agent.train.sampler import GlobalBatchSampler
from agent.train.schedule import CheckpointInterval, IntervalSource
from agent.train.session import TrainingSession
from agent.wire.environ import ENV_RESUME_FROM
from agent.wire.errors import CheckpointError, CheckpointInvalid, ConfigError


class FixedInterval(IntervalSource):
    """Every ``steps`` steps, without reading the environment."""

    def __init__(self, steps: int) -> None:
        self._fixed = CheckpointInterval(steps=steps)

    def current(self) -> CheckpointInterval:
        return self._fixed


class SamplerBeforeSkips(GlobalBatchSampler):
    """Saves the state a sampler saved before data could be skipped."""

    def state_dict(self) -> dict[str, Any]:
        state = super().state_dict()
        del state["skipped"]
        return state


def make_session(
    root: Path,
    environ: dict[str, str] | None = None,
    sampler_class: type[GlobalBatchSampler] = GlobalBatchSampler,
) -> TrainingSession:
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    sampler = sampler_class(32, 4, rank=0, world_size=1, seed=3)
    return TrainingSession(
        root,
        model=model,
        optimizer=optimizer,
        sampler=sampler,
        extras={"tokens_seen": 0},
        interval=FixedInterval(2),
        environ=environ or {},
    )


def train(session: TrainingSession, steps: int) -> None:
    model = session._model
    for _ in range(steps):
        model(torch.randn(3, 4)).sum().backward()
        assert session._optimizer is not None
        session._optimizer.step()
        session._optimizer.zero_grad()
        session.step_done()


def test_fresh_root_starts_at_step_zero_and_saves_on_schedule(tmp_path: Path) -> None:
    session = make_session(tmp_path)
    assert session.restore() == 0
    session.restore_rng()
    train(session, 5)
    session.close()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-2", "step-4"]
    manifest = fmt.manifest_from_bytes((tmp_path / "step-4" / fmt.MANIFEST_NAME).read_bytes())
    assert manifest.step == 4 and manifest.world_size == 1
    assert {fmt.StateKind.OPTIMIZER, fmt.StateKind.DATA_POSITION, fmt.StateKind.RNG} <= set(
        manifest.contents
    )


def test_restore_picks_the_newest_valid_checkpoint_and_restores_everything(
    tmp_path: Path,
) -> None:
    first = make_session(tmp_path)
    first.restore()
    first.restore_rng()
    train(first, 4)
    first.close()
    weights = first._model.state_dict()["weight"].clone()
    # A newer checkpoint whose marker is missing must be passed over.
    broken = tmp_path / "step-6"
    shutil.copytree(tmp_path / "step-4", broken)
    (broken / fmt.MARKER_NAME).unlink()

    second = make_session(tmp_path)
    assert second.restore() == 4
    assert second.resumed_from == tmp_path / "step-4"
    assert torch.equal(second._model.state_dict()["weight"], weights)
    assert second._sampler is not None and second._sampler.consumed_total == 16
    second.restore_rng()
    second.close()


def test_a_step_before_restore_rng_is_refused(tmp_path: Path) -> None:
    first = make_session(tmp_path)
    first.restore()
    first.restore_rng()
    train(first, 2)
    first.close()
    second = make_session(tmp_path)
    second.restore()
    with pytest.raises(CheckpointError, match="restore_rng"):
        second.step_done()
    second.close()


def test_an_invalid_explicit_resume_path_is_refused_with_the_reason(tmp_path: Path) -> None:
    first = make_session(tmp_path)
    first.restore()
    first.restore_rng()
    train(first, 2)
    first.close()
    (tmp_path / "step-2" / fmt.MARKER_NAME).unlink()
    second = make_session(tmp_path, {ENV_RESUME_FROM: str(tmp_path / "step-2")})
    with pytest.raises(CheckpointInvalid, match="refusing to resume"):
        second.restore()
    second.close()


def test_no_root_and_no_environment_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="RESURGO_CKPT_ROOT"):
        TrainingSession(model=nn.Linear(1, 1), environ={})


def _trained_for(root: Path, steps: int, sampler_class: type[GlobalBatchSampler]) -> None:
    session = make_session(root, sampler_class=sampler_class)
    session.restore()
    session.restore_rng()
    train(session, steps)
    session.close()


def test_skipped_samples_apply_after_the_resume_and_are_saved_with_the_position(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    _trained_for(tmp_path, 4, GlobalBatchSampler)  # step-4: the cursor at sample 16
    second = make_session(tmp_path, {ENV_SKIP_SAMPLES: "17:21"})
    with caplog.at_level(logging.INFO, logger="agent.train.session"):
        assert second.restore() == 4
    assert second._sampler is not None
    assert second._sampler.skipped == ((16, 24),)
    assert second._sampler.consumed_total == 24
    assert "skipping samples 16:24" in caplog.text and "batch 6" in caplog.text
    second.restore_rng()
    train(second, 2)  # saves step-6
    second.close()

    third = make_session(tmp_path)
    assert third.restore() == 6
    assert third._sampler is not None
    assert (third._sampler.skipped, third._sampler.consumed_total) == (((16, 24),), 32)
    third.restore_rng()
    third.close()


def test_skipped_samples_apply_to_a_fresh_start(tmp_path: Path) -> None:
    session = make_session(tmp_path, {ENV_SKIP_SAMPLES: "0:4,12:13"})
    assert session.restore() == 0
    assert session._sampler is not None
    assert session._sampler.skipped == ((0, 4), (12, 16))
    assert session._sampler.consumed_total == 4
    session.close()


def test_a_checkpoint_saved_before_skips_existed_resumes_and_takes_new_skips(
    tmp_path: Path,
) -> None:
    _trained_for(tmp_path, 2, SamplerBeforeSkips)
    session = make_session(tmp_path, {ENV_SKIP_SAMPLES: "8:12"})
    assert session.restore() == 2
    assert session._sampler is not None
    assert (session._sampler.skipped, session._sampler.consumed_total) == (((8, 12),), 12)
    session.close()


def test_without_a_sampler_skipped_samples_are_a_warning_not_an_error(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    session = TrainingSession(
        tmp_path, model=nn.Linear(1, 1), interval=FixedInterval(2),
        environ={ENV_SKIP_SAMPLES: "0:8"},
    )  # fmt: skip
    with caplog.at_level(logging.WARNING, logger="agent.train.session"):
        assert session.restore() == 0
    assert "RESURGO_SKIP_SAMPLES=0:8 cannot be applied" in caplog.text
    session.close()


def test_a_malformed_skip_is_a_config_error_before_anything_loads(tmp_path: Path) -> None:
    session = make_session(tmp_path, {ENV_SKIP_SAMPLES: "8-12"})
    with pytest.raises(ConfigError, match=r"RESURGO_SKIP_SAMPLES.*START:END"):
        session.restore()
    session.close()
