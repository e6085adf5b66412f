"""The demo trainer's fault grammar and its training-health faults, without a process group."""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import sys
from pathlib import Path
from types import ModuleType

import pytest
import torch

from tests.paths import REPO

TOY_PATH = REPO / "deploy" / "demo" / "train_toy.py"


def _load_toy() -> ModuleType:
    spec = importlib.util.spec_from_file_location("train_toy", TOY_PATH)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


toy = _load_toy()


@pytest.mark.parametrize(
    ("spec", "kind", "at", "rank", "always", "node", "batches"),
    [
        ("sigkill@12:3", "sigkill", 12, 3, False, None, 1),
        ("hang@6", "hang", 6, 0, False, None, 1),
        ("slow@2:*!", "slow", 2, None, True, None, 1),
        ("idle@8:node2", "idle", 8, None, False, "node2", 1),
        ("nan@7", "nan", 7, 0, False, None, 1),
        ("nan@7:1!", "nan", 7, 1, True, None, 1),
        ("nan@7:*", "nan", 7, None, False, None, 1),
        ("nan@7:node3!", "nan", 7, None, True, "node3", 1),
        ("poison@0", "poison", 0, None, True, None, 1),
        ("poison@239", "poison", 239, None, True, None, 1),
        ("spike@4", "spike", 4, None, True, None, 3),
        ("spike@4+1", "spike", 4, None, True, None, 1),
        ("spike@0+10", "spike", 0, None, True, None, 10),
    ],
)
def test_parse_fault_reads_every_kind(
    spec: str, kind: str, at: int, rank: int | None, always: bool, node: str | None, batches: int
) -> None:
    fault = toy.parse_fault(spec)
    assert (fault.kind, fault.at, fault.rank, fault.always, fault.node, fault.batches) == (
        kind, at, rank, always, node, batches,
    )  # fmt: skip
    assert fault.spec == spec


@pytest.mark.parametrize(
    ("spec", "reason"),
    [
        ("poison@240", "samples 0..239"),
        ("poison@5:1", "expected"),  # the data is bad on whichever rank trains it
        ("poison@5!", "expected"),  # ... and in every attempt anyway
        ("poison@", "expected"),
        ("spike@3+0", "at least one batch"),
        ("spike@3:1", "expected"),
        ("spike@3+", "expected"),
        ("spike@-1", "expected"),
        ("nan@", "expected"),
        ("nan@x", "expected"),
        ("oom@3", "expected"),
        ("nan@3:", "expected"),
    ],
)
def test_parse_fault_refuses_a_bad_spec_and_says_why(spec: str, reason: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError, match=reason):
        toy.parse_fault(spec)


def faults(tmp_path: Path, *specs: str, rank: int = 0) -> object:
    return toy.Faults([toy.parse_fault(spec) for spec in specs], rank, tmp_path)


def test_a_poisoned_sample_makes_its_row_nan_on_whichever_rank_trains_it(tmp_path: Path) -> None:
    armed = faults(tmp_path, "poison@5", rank=1)
    inputs = torch.ones(3, toy.FEATURES)
    clean = armed.corrupt_inputs(1, torch.tensor([7, 8, 9]), inputs)
    assert clean is inputs
    corrupt = armed.corrupt_inputs(2, torch.tensor([4, 5, 6]), inputs)
    assert torch.isnan(corrupt[1]).all() and torch.isfinite(corrupt[[0, 2]]).all()
    assert torch.isfinite(inputs).all()  # the dataset itself is left alone
    # The data stays bad: trained again (another attempt, another epoch), it strikes again.
    assert torch.isnan(armed.corrupt_inputs(9, torch.tensor([5]), inputs[:1])).all()
    assert not (tmp_path / ".resurgo-faults").exists()


def test_a_nan_fault_hits_its_step_on_its_rank_once_per_job(tmp_path: Path) -> None:
    inputs = torch.ones(2, toy.FEATURES)
    indices = torch.tensor([0, 1])
    other_rank = faults(tmp_path, "nan@3:1", rank=0)
    assert other_rank.corrupt_inputs(3, indices, inputs) is inputs
    armed = faults(tmp_path, "nan@3:1", rank=1)
    assert armed.corrupt_inputs(2, indices, inputs) is inputs
    assert torch.isnan(armed.corrupt_inputs(3, indices, inputs)).all()
    resumed = faults(tmp_path, "nan@3:1", rank=1)  # the next attempt gets past it
    assert resumed.corrupt_inputs(3, indices, inputs) is inputs
    always = faults(tmp_path, "nan@3:1!", rank=1)
    assert torch.isnan(always.corrupt_inputs(3, indices, inputs)).all()
    assert torch.isnan(always.corrupt_inputs(3, indices, inputs)).all()


def test_a_spike_makes_every_prediction_of_its_global_batches_miss_by_ten(
    tmp_path: Path,
) -> None:
    armed = faults(tmp_path, "spike@2+2", rank=1)
    targets = torch.tensor([[1.0], [2.0], [-3.0]])
    predictions = torch.tensor([[0.5], [2.5], [-1.0]])
    g = toy.GLOBAL_BATCH
    for cursor in (0, 2 * g - 1, 4 * g):  # batches 0, 1 and 4: untouched
        assert armed.corrupt_targets(cursor, targets, predictions) is targets
    for cursor in (2 * g, 3 * g + 5):  # batches 2 and 3
        spiked = (predictions - armed.corrupt_targets(cursor, targets, predictions)).pow(2)
        assert torch.allclose(spiked, torch.full_like(spiked, toy.SPIKE_RESIDUAL**2))


def test_the_process_faults_leave_the_data_faults_alone(tmp_path: Path) -> None:
    armed = faults(tmp_path, "nan@1", "poison@1", "spike@1")
    armed.after_step(1, heartbeat=None)  # nothing to fire: no heartbeat needed
    assert not (tmp_path / ".resurgo-faults").exists()


def test_each_recorded_start_is_the_next_attempt(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("RESURGO_RESTART_COUNT", raising=False)
    first = toy._open_record(tmp_path, 4, 0, None)
    monkeypatch.setenv("RESURGO_RESTART_COUNT", "2")
    second = toy._open_record(tmp_path, 3, 8, tmp_path / "step-8")
    assert first.identity == {"attempt": 0, "restart_count": None}
    assert second.identity == {"attempt": 1, "restart_count": 2}
    second.write({"step": 9, "loss": math.nan})
    first.file.close()
    second.file.close()
    starts = [json.loads(line) for line in (tmp_path / "starts.jsonl").read_text().splitlines()]
    assert [(s["attempt"], s["world"], s["start_step"]) for s in starts] == [(0, 4, 0), (1, 3, 8)]
    (line,) = (tmp_path / "steps.jsonl").read_text().splitlines()
    assert math.isnan(json.loads(line)["loss"])
