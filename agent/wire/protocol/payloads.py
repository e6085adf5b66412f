"""What each event kind's payload and each command kind's arguments hold, field by field."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from agent.wire.protocol.constants import MAX_STEPS_PER_EVENT
from agent.wire.protocol.fields import (
    _argv,
    _bool,
    _enum_value,
    _fail,
    _finite_float,
    _float,
    _int,
    _list,
    _name,
    _nullable,
    _objects,
    _positive_float,
    _signed_int,
    _Spec,
    _stacks,
    _str,
    _text,
)
from agent.wire.protocol.messages import (
    CommandKind,
    EventKind,
    HangDetector,
    NonFinite,
    StopMethod,
)

# agent_started.health_checks: one line per check of the launch's health gate.
MAX_HEALTH_CHECKS = 32
MAX_HEALTH_CHECK_CHARS = 1024


def _lines(document: Mapping[str, Any], key: str, where: str) -> list[str]:
    items = _list(document, key, where, max_items=MAX_HEALTH_CHECKS)
    for index, item in enumerate(items):
        if (
            not isinstance(item, str)
            or len(item) > MAX_HEALTH_CHECK_CHARS
            or "\n" in item
            or "\r" in item
        ):
            _fail(
                f"{where}.{key}[{index}] must be one line (no CR or LF) of at most "
                f"{MAX_HEALTH_CHECK_CHARS} characters"
            )
    return list(items)


def _norm(document: Mapping[str, Any], key: str, where: str) -> float:
    number = _finite_float(document, key, where)
    if number < 0:
        _fail(f"{where}.{key} is a norm, so never negative; got {number}")
    return number


_RANK_IDENTITY = (
    _Spec("global_rank", _int),
    _Spec("local_rank", _int),
    _Spec("pid", lambda d, k, w: _int(d, k, w, minimum=1)),
)
_EXIT_STATUS = (
    _Spec("exit_code", _nullable(_signed_int)),
    _Spec("signal", _nullable(lambda d, k, w: _int(d, k, w, minimum=1))),
)

_PAYLOADS: dict[EventKind, tuple[_Spec, ...]] = {
    EventKind.RANK_EXITED: (
        *_RANK_IDENTITY,
        *_EXIT_STATUS,
        _Spec("signal_name", _nullable(_str)),
        _Spec("last_step", _nullable(_int)),
        _Spec("phase", _nullable(_str)),
        # When the rank died by the shim's clock: the earliest death of a job is
        # its root cause, the others' exits follow from it.
        _Spec("exit_time_unix_s", _nullable(_float), required=False),
        # The rank's uncaught exception and when it reached the top (agent.wire.raised):
        # a rank stopped while it still unwound one raised first, whatever its exit says.
        _Spec("raised", _nullable(_str), required=False),
        _Spec("raised_time_unix_s", _nullable(_float), required=False),
        # The rank's script ran to its end before the rank exited (agent.wire.raised).
        _Spec("script_ended", _bool, required=False),
        # The node's warm pool forked the rank (agent.node.warmpool): it started without
        # importing torch.
        _Spec("warm", _bool, required=False),
        # The node's ranks still running after this one, when the agent knows them all:
        # 0 says the node's exits are all in (the exit window need not wait for its launcher).
        _Spec("ranks_left", lambda d, k, w: _int(d, k, w, minimum=0), required=False),
        # The evidence of what failed: the exception's message and an OSError's errno
        # (agent.wire.raised), the rank's last lines on standard error
        # (agent.node.rankexec), the kernel's out-of-memory kill and newest GPU Xid
        # line (agent.node.evidence). Each short text, each optional.
        _Spec("raised_message", _str, required=False),
        _Spec("errno", _int, required=False),
        _Spec("stderr_tail", _str, required=False),
        _Spec("oom_kill", _str, required=False),
        _Spec("xid", _str, required=False),
    ),
    EventKind.LAUNCHER_EXITED: (
        *_EXIT_STATUS,
        _Spec("signal_name", _nullable(_str), required=False),
        _Spec("pid", lambda d, k, w: _int(d, k, w, minimum=1), required=False),
    ),
    EventKind.HANG: (
        _Spec(
            "hung",
            _objects(
                (
                    *_RANK_IDENTITY,
                    _Spec("last_step", _nullable(_int)),
                    _Spec("phase", _nullable(_str)),
                    _Spec("seconds_since_progress", _float),
                    _Spec("timeout_s", _float),
                    _Spec("detector", _enum_value(HangDetector)),
                )
            ),
        ),
        _Spec("stacks", _stacks),
        # Most suspect first (agent.node.hang.culprit_hints): the rank behind, or
        # one whose stack is outside the collective everyone else waits in.
        _Spec(
            "culprits",
            _objects(
                (
                    _Spec("global_rank", _int),
                    _Spec("last_step", _nullable(_int)),
                    _Spec("in_collective", _nullable(_bool)),
                    _Spec("reason", _str),
                )
            ),
            required=False,
        ),
        # Evidence only: these ranks stopped past their timeout outside any
        # collective, and none on the node waits in one (agent.node.watch). Such a
        # report never starts a recovery; it names the rank that peers elsewhere
        # wait for.
        _Spec("stalled", _bool, required=False),
    ),
    EventKind.STRAGGLER: (
        _Spec("global_rank", _int),
        _Spec("local_rank", _int),
        _Spec("step_time_p50_s", _float),
        _Spec("step_time_p99_s", _float),
        _Spec("step_time_mean_s", _float),
        _Spec("steps_observed", _int),
        _Spec("node_median_step_time_s", _float),
    ),
    EventKind.HEALTH_CHECK_FAILED: (
        _Spec("command", _argv),
        _Spec("exit_code", _nullable(_signed_int)),
        _Spec("output_tail", _text),
        _Spec("timed_out", _bool, required=False),
    ),
    EventKind.CHECKPOINT_COMMITTED: (
        _Spec("step", _int),
        _Spec("path", _str),
        _Spec("global_rank", _int, required=False),
    ),
    EventKind.CHECKPOINT_WRITTEN: (
        _Spec("step", _int),
        _Spec("path", _str),
        _Spec("global_rank", _int),
        _Spec("total_bytes", _nullable(_int)),
        # Seconds from the rank's first beat in phase checkpoint to its first out of it.
        _Spec("duration_s", _nullable(_float), required=False),
    ),
    EventKind.RANKS_STOPPED: (
        _Spec("reason", _str),
        _Spec("command_id", _nullable(_name)),
        _Spec("grace_s", _float),
        _Spec(
            "ranks",
            _objects((*_RANK_IDENTITY, _Spec("method", _enum_value(StopMethod)), *_EXIT_STATUS)),
        ),
    ),
    EventKind.AGENT_STARTED: (
        _Spec("agent_version", _str),
        _Spec("pid", lambda d, k, w: _int(d, k, w, minimum=1)),
        _Spec("argv", _argv),
        _Spec("nnodes", lambda d, k, w: _int(d, k, w, minimum=1)),
        _Spec("node_rank", _int),
        # The job's launch number the in-job driver gave this agent: the
        # supervisor ignores reports of agents from an earlier launch.
        _Spec("attempt", lambda d, k, w: _int(d, k, w, minimum=1), required=False),
        # The launch's health gate, one line per check that passed (a failed gate
        # sends health_check_failed and launches nothing).
        _Spec("health_checks", _lines, required=False),
    ),
    EventKind.AGENT_STOPPED: (_Spec("reason", _str),),
    EventKind.TIME_LIMIT_NEAR: (
        _Spec("end_unix_s", _float),
        _Spec("save_by_unix_s", _float),
        _Spec("attempt", _int),
        _Spec("final_checkpoint_requested", _bool, required=False),
    ),
    EventKind.WORLD_MISMATCH: (
        _Spec("global_rank", _int),
        _Spec("pid", lambda d, k, w: _int(d, k, w, minimum=1)),
        _Spec("world_size", lambda d, k, w: _int(d, k, w, minimum=1)),
        _Spec("local_world_size", lambda d, k, w: _int(d, k, w, minimum=1)),
        _Spec("nnodes", lambda d, k, w: _int(d, k, w, minimum=1)),
    ),
    EventKind.STEP_LOSSES: (
        _Spec("global_rank", _int),
        _Spec(
            "steps",
            _objects(
                (
                    _Spec("step", _int),
                    _Spec("loss", _nullable(_finite_float)),
                    _Spec("cursor", _nullable(_int)),
                    _Spec("non_finite", _enum_value(NonFinite), required=False),
                    # Only from a script that computes its total gradient norm;
                    # null with grad_non_finite set when it was NaN or infinite.
                    _Spec("grad_norm", _nullable(_norm), required=False),
                    _Spec("grad_non_finite", _enum_value(NonFinite), required=False),
                ),
                max_items=MAX_STEPS_PER_EVENT,
            ),
        ),
    ),
}

_COMMAND_ARGS: dict[CommandKind, tuple[_Spec, ...]] = {
    CommandKind.STOP_RANKS: (
        _Spec("grace_s", _float),
        _Spec("reason", _str, required=False),
    ),
    CommandKind.SET_CHECKPOINT_INTERVAL: (
        _Spec("interval_s", _nullable(_positive_float)),
        _Spec("every_steps", _nullable(lambda d, k, w: _int(d, k, w, minimum=1))),
    ),
}


def _interval_is_set(args: Mapping[str, Any], where: str) -> None:
    if args["interval_s"] is None and args["every_steps"] is None:
        _fail(f"{where}: set interval_s, every_steps or both; both are null")


_COMMAND_EXTRA_CHECKS: dict[CommandKind, tuple[Callable[[Mapping[str, Any], str], None], ...]] = {
    CommandKind.SET_CHECKPOINT_INTERVAL: (_interval_is_set,),
}
