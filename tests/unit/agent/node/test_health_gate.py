"""The health gate as a whole: built-in checks plus the operator's command, and the events
it makes (valid on the wire, the failing checks named, their lines where blame quotes)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from agent.node.config import AgentConfig
from agent.node.health import GateReport, HealthResult, run_gate, run_health_check
from agent.node.healthchecks import CKPT_ROOT, GPUS, RDZV_ADDR, CheckResult, GateInputs
from agent.wire import protocol
from agent.wire.errors import ConfigError
from agent.wire.protocol import EventKind

INCARNATION = "0123456789abcdef"


def inputs(tmp_path: Path, ckpt_root: str | None = None) -> GateInputs:
    return GateInputs(
        ckpt_root=str(tmp_path / "ckpt") if ckpt_root is None else ckpt_root,
        min_free_gb=0.0,
        master_addr="127.0.0.1",
        master_port=29500,
        gpus_needed=None,
        timeout_s=10.0,
        path=str(tmp_path),  # no nvidia-smi
    )


def event(kind: EventKind, payload: dict[str, object]) -> protocol.Event:
    return protocol.make_event(kind, "77", "node1", INCARNATION, 1, 1.7e9, payload)


def test_with_no_command_every_builtin_check_runs_and_a_healthy_node_passes(
    tmp_path: Path,
) -> None:
    report = asyncio.run(run_gate(inputs(tmp_path), "", 10.0))
    assert report.healthy and report.command is None
    assert [result.name for result in report.results] == [CKPT_ROOT, RDZV_ADDR, GPUS]
    lines = report.lines()
    assert lines[0].startswith(f"ok {CKPT_ROOT} (")
    assert lines[2].endswith("skipped: nvidia-smi is not on PATH")
    started = event(
        EventKind.AGENT_STARTED,
        {"agent_version": "0.1.0", "pid": 7, "argv": ["x"], "nnodes": 1, "node_rank": 0,
         "health_checks": lines},
    )  # fmt: skip
    assert protocol.decode_event(protocol.encode_event(started)).payload["health_checks"] == lines


def test_a_failing_builtin_check_fails_the_gate_and_is_named_in_the_event(tmp_path: Path) -> None:
    report = asyncio.run(run_gate(inputs(tmp_path, "/dev/null/ckpt"), "true", 10.0))
    assert not report.healthy
    payload = report.failure_payload()
    assert payload["command"] == [CKPT_ROOT]
    assert payload["exit_code"] is None and payload["timed_out"] is False
    tail = payload["output_tail"].splitlines()
    assert len(tail) == 4 and tail[-1].startswith(f"FAIL {CKPT_ROOT} (")
    assert "ok true (" in payload["output_tail"]  # the operator's command passed
    event(EventKind.HEALTH_CHECK_FAILED, payload)  # valid on the wire


def test_a_failing_command_brings_its_exit_status_and_output(tmp_path: Path) -> None:
    command = "sh -c 'echo checking; echo gpu 3 is missing; exit 7'"
    report = asyncio.run(run_gate(inputs(tmp_path, "/dev/null/ckpt"), command, 10.0))
    payload = report.failure_payload()
    assert payload["command"] == [CKPT_ROOT, command]
    assert payload["exit_code"] == 7
    text = payload["output_tail"]
    assert text.startswith("checking\ngpu 3 is missing\n")
    assert text.endswith(f"FAIL {command} (" + text.rsplit(f"FAIL {command} (", 1)[1])
    assert "exit status 7: gpu 3 is missing\n" in text
    event(EventKind.HEALTH_CHECK_FAILED, payload)


def test_a_command_that_times_out_says_so(tmp_path: Path) -> None:
    report = asyncio.run(run_gate(inputs(tmp_path), "sleep 30", 0.5))
    payload = report.failure_payload()
    assert payload["command"] == ["sleep 30"] and payload["timed_out"] is True
    assert "timed out after" in payload["output_tail"]


def test_an_empty_command_cannot_start_and_does_not_crash() -> None:
    result = asyncio.run(run_health_check("   ", 1.0))
    assert not result.healthy and result.reason == "could not start: the command is empty"


def test_the_event_tail_is_clipped_from_the_commands_output_keeping_every_check_line() -> None:
    command = HealthResult("nhc", False, 1, "x" * 3000 + "\n", "exit status 1")
    results = (
        *(CheckResult(f"builtin:c{i}", True, "y" * 400, 0.1) for i in range(3)),
        CheckResult("nhc", False, "exit status 1: xxx", 0.1),
    )
    tail = GateReport(results, command).failure_payload()["output_tail"]
    assert len(tail) == 4096 and tail.startswith("[...clipped...]\nxxx")
    assert [line[:13] for line in tail.splitlines()[-4:]] == [
        "ok builtin:c0",
        "ok builtin:c1",
        "ok builtin:c2",
        "FAIL nhc (0.1",
    ]


def test_the_builtin_timeout_must_be_positive() -> None:
    with pytest.raises(ConfigError, match="health_builtin_timeout_s must be > 0"):
        AgentConfig(job_id="1", health_builtin_timeout_s=0.0)
    assert AgentConfig(job_id="1").health_min_free_gb == 1.0
