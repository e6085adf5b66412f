"""TrainingSession in one process (no process group): choosing and refusing resume points."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from torch import nn

from agent.checkpoint import format as fmt
from agent.train.sampler import GlobalBatchSampler
from agent.train.schedule import CheckpointInterval, IntervalSource
from agent.train.session import ENV_RESUME_FROM, TrainingSession
from agent.wire.errors import CheckpointError, CheckpointInvalid, ConfigError


class FixedInterval(IntervalSource):
    """Every ``steps`` steps, without reading the environment."""

    def __init__(self, steps: int) -> None:
        self._fixed = CheckpointInterval(steps=steps)

    def current(self) -> CheckpointInterval:
        return self._fixed


def make_session(root: Path, environ: dict[str, str] | None = None) -> TrainingSession:
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    sampler = GlobalBatchSampler(32, 4, rank=0, world_size=1, seed=3)
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
