"""Pure Slurm layer: parse `squeue --json` / `sinfo --json`, build scontrol argv lists.

Nothing here runs a command or reads the clock; `client.py` is the only module
that executes what these functions build. The JSON shapes are those of Slurm
22.05 (openapi v0.0.38), recorded in tests/fixtures/slurm/.
"""

from __future__ import annotations

import enum
import json
import re
import reprlib
import shlex
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import hostlist  # python-hostlist: Slurm-compatible hostlist expansion
import msgspec

from supervisor.errors import SlurmParseError

__all__ = [
    "NEVER_REASONS",
    "DrainReason",
    "JobState",
    "NodeFlag",
    "NodeState",
    "SlurmJob",
    "SlurmNode",
    "cancel_argv",
    "compress_hostlist",
    "drain_argv",
    "drain_reason",
    "expand_hostlist",
    "hostnames_argv",
    "parse_drain_reason",
    "parse_sinfo_json",
    "parse_squeue_json",
    "release_argv",
    "requeue_hold_argv",
    "resume_argv",
    "shrink_argv",
    "sinfo_argv",
    "squeue_argv",
    "start_now_argv",
    "test_only_argv",
    "update_size_argv",
]


class JobState(enum.Enum):
    """A job's base state as Slurm names it; UNKNOWN for anything this code does not know."""

    PENDING = "PENDING"
    RUNNING = "RUNNING"
    SUSPENDED = "SUSPENDED"
    COMPLETING = "COMPLETING"
    COMPLETED = "COMPLETED"
    CANCELLED = "CANCELLED"
    FAILED = "FAILED"
    TIMEOUT = "TIMEOUT"
    NODE_FAIL = "NODE_FAIL"
    PREEMPTED = "PREEMPTED"
    BOOT_FAIL = "BOOT_FAIL"
    DEADLINE = "DEADLINE"
    OUT_OF_MEMORY = "OUT_OF_MEMORY"
    REQUEUED = "REQUEUED"
    REQUEUE_HOLD = "REQUEUE_HOLD"
    RESIZING = "RESIZING"
    UNKNOWN = "UNKNOWN"

    @classmethod
    def parse(cls, raw: str) -> JobState:
        """The member named by ``raw`` (case-insensitive), UNKNOWN when there is none."""
        try:
            return cls(raw.strip().upper())
        except ValueError:
            return cls.UNKNOWN

    @property
    def finished(self) -> bool:
        """True when the job will not run again unless something requeues it."""
        return self in _FINISHED


_FINISHED = frozenset(
    {
        JobState.COMPLETED,
        JobState.CANCELLED,
        JobState.FAILED,
        JobState.TIMEOUT,
        JobState.NODE_FAIL,
        JobState.PREEMPTED,
        JobState.BOOT_FAIL,
        JobState.DEADLINE,
        JobState.OUT_OF_MEMORY,
    }
)


class NodeState(enum.Enum):
    """A node's base state; DRAIN, NOT_RESPONDING etc. are flags (`NodeFlag`), not states."""

    IDLE = "IDLE"
    ALLOCATED = "ALLOCATED"
    MIXED = "MIXED"
    DOWN = "DOWN"
    ERROR = "ERROR"
    FUTURE = "FUTURE"
    UNKNOWN = "UNKNOWN"

    @classmethod
    def parse(cls, raw: str) -> NodeState:
        """The member named by ``raw`` (sinfo prints lower case), UNKNOWN when there is none."""
        try:
            return cls(raw.strip().upper())
        except ValueError:
            return cls.UNKNOWN


class NodeFlag(enum.Enum):
    """Flags Slurm adds to a node's base state (sinfo's `state_flags`)."""

    DRAIN = "DRAIN"
    NOT_RESPONDING = "NOT_RESPONDING"
    COMPLETING = "COMPLETING"
    FAIL = "FAIL"
    MAINTENANCE = "MAINTENANCE"
    REBOOT_REQUESTED = "REBOOT_REQUESTED"
    REBOOT_ISSUED = "REBOOT_ISSUED"
    RESERVED = "RESERVED"
    POWERED_DOWN = "POWERED_DOWN"
    POWERING_DOWN = "POWERING_DOWN"
    POWERING_UP = "POWERING_UP"
    CLOUD = "CLOUD"
    DYNAMIC = "DYNAMIC"
    PLANNED = "PLANNED"
    UNKNOWN = "UNKNOWN"

    @classmethod
    def parse(cls, raw: str) -> NodeFlag:
        """The member named by ``raw``, UNKNOWN for a flag newer than this code."""
        try:
            return cls(raw.strip().upper())
        except ValueError:
            return cls.UNKNOWN


@dataclass(frozen=True)
class SlurmJob:
    """One job as `squeue --json` reports it.

    Times are Unix seconds (None when Slurm has none); ``time_limit_s`` is None
    for an unlimited job. ``exit_code``/``exit_signal`` decode Slurm's raw wait
    status. ``nodes`` is the expanded current allocation (empty while pending);
    after a shrink it is the new, smaller list (unlike SLURM_JOB_NODELIST).
    """

    job_id: int
    name: str
    state: JobState
    state_raw: str
    state_reason: str
    nodes: tuple[str, ...]
    node_list: str
    node_count: int
    batch_host: str | None
    restart_count: int
    requeue: bool
    exit_code: int | None
    exit_signal: int | None
    time_limit_s: int | None
    start_time: int | None
    submit_time: int | None
    end_time: int | None
    eligible_time: int | None
    excluded_nodes: tuple[str, ...]
    comment: str
    flags: frozenset[str]
    user_name: str
    partition: str

    @property
    def held(self) -> bool:
        """True while the job waits on a hold (user, admin, or a requeuehold)."""
        return self.state is JobState.PENDING and self.state_reason.startswith("JobHeld")


@dataclass(frozen=True)
class SlurmNode:
    """One node as `sinfo --json` reports it."""

    name: str
    state: NodeState
    state_raw: str
    flags: frozenset[NodeFlag]
    flags_raw: tuple[str, ...]
    reason: str
    reason_set_by: str | None
    reason_changed_at: int | None
    address: str | None
    cpus: int
    alloc_cpus: int
    partitions: tuple[str, ...]

    @property
    def state_text(self) -> str:
        """Base state and flags as ``scontrol`` joins them, in lower case: ``idle+drain``,
        ``down+not_responding``; the base state alone (``idle``) hides a drain."""
        return "+".join(part.lower() for part in (self.state_raw, *self.flags_raw))

    @property
    def drained(self) -> bool:
        """Drained or draining: Slurm will start no new job here."""
        return NodeFlag.DRAIN in self.flags

    @property
    def down(self) -> bool:
        """Down, in error, or failing: jobs here are lost or about to be."""
        return self.state in (NodeState.DOWN, NodeState.ERROR) or NodeFlag.FAIL in self.flags

    @property
    def not_responding(self) -> bool:
        """slurmd missed its heartbeats (sinfo prints a `*` after the state)."""
        return NodeFlag.NOT_RESPONDING in self.flags

    @property
    def usable(self) -> bool:
        """Can take work now: up, responding, not drained, not in maintenance."""
        return self.state in (NodeState.IDLE, NodeState.MIXED, NodeState.ALLOCATED) and not (
            self.flags & _UNUSABLE_FLAGS
        )


_UNUSABLE_FLAGS = frozenset(
    {
        NodeFlag.DRAIN,
        NodeFlag.NOT_RESPONDING,
        NodeFlag.FAIL,
        NodeFlag.MAINTENANCE,
        NodeFlag.POWERED_DOWN,
        NodeFlag.POWERING_DOWN,
        NodeFlag.REBOOT_ISSUED,
    }
)


# --- hostlists ---------------------------------------------------------------


# More names than any cluster has: a list that would expand beyond it is
# damaged output, refused before a single name is built. python-hostlist
# bounds each range and each part, not a list of many parts; its recursion
# goes one level per bracket group, and its int() refuses numbers over 4300
# digits with a ValueError.
MAX_HOSTLIST_NAMES = 100_000
_MAX_BRACKET_GROUPS = 16
_MAX_RANGE_DIGITS = 18
_BRACKETS = re.compile(r"\[([^\[\]]*)\]")
_RANGE = re.compile(r"([0-9]+)(?:-([0-9]+))?")


def expand_hostlist(node_list: str) -> tuple[str, ...]:
    """Expand a Slurm hostlist (``node[1-3,5]``) into names; raise SlurmParseError if bad.

    Slurm prints "" or "(null)" for no nodes. A list naming more than
    :data:`MAX_HOSTLIST_NAMES` nodes is refused as malformed.
    """
    text = node_list.strip()
    if text in ("", "(null)", "None"):
        return ()
    problem = _hostlist_problem(text)
    if problem is not None:
        raise SlurmParseError(f"bad Slurm hostlist {node_list[:200]!r}: {problem}")
    try:
        return tuple(hostlist.expand_hostlist(text))
    except hostlist.BadHostlist as error:
        raise SlurmParseError(f"bad Slurm hostlist {node_list[:200]!r}: {error}") from error


def _hostlist_problem(text: str) -> str | None:
    """Why ``text`` must not be expanded (too many names, groups or digits); None if it may.

    An upper bound only: syntax errors are python-hostlist's to find.
    """
    total = 0
    for part in _top_level_parts(text):
        groups = _BRACKETS.findall(part)
        if len(groups) > _MAX_BRACKET_GROUPS:
            return f"{len(groups)} bracket groups in one name; at most {_MAX_BRACKET_GROUPS}"
        names = 1
        for group in groups:
            count = 0
            for item in group.split(","):
                match = _RANGE.fullmatch(item)
                if match is None:
                    continue  # not a range: python-hostlist refuses it
                low, high = match.group(1), match.group(2) or match.group(1)
                if max(len(low), len(high)) > _MAX_RANGE_DIGITS:
                    return f"a number with more than {_MAX_RANGE_DIGITS} digits"
                count += max(int(high) - int(low) + 1, 0)
            names *= max(count, 1)
            if names > MAX_HOSTLIST_NAMES:
                break
        total += names
        if total > MAX_HOSTLIST_NAMES:
            return f"it names more than {MAX_HOSTLIST_NAMES} nodes"
    return None


def _top_level_parts(text: str) -> list[str]:
    """``text`` split at the commas outside brackets."""
    parts, depth, start = [], 0, 0
    for index, char in enumerate(text):
        if char == "[":
            depth += 1
        elif char == "]":
            depth -= 1
        elif char == "," and depth == 0:
            parts.append(text[start:index])
            start = index + 1
    parts.append(text[start:])
    return parts


def compress_hostlist(nodes: Sequence[str]) -> str:
    """The compact hostlist of ``nodes`` (``node[1-2]``), as scontrol accepts it."""
    return str(hostlist.collect_hostlist(list(nodes)))


# --- JSON parsing --------------------------------------------------------------


def _load(text: str | bytes, key: str, command: str) -> list[Mapping[str, Any]]:
    try:
        document = json.loads(text)
    # ValueError covers JSONDecodeError, bad UTF-8 and integers beyond Python's
    # digit limit; RecursionError, nesting deeper than the parser's stack.
    except (ValueError, TypeError, RecursionError) as error:
        raise SlurmParseError(f"{command} printed no valid JSON: {error}") from error
    if not isinstance(document, dict):
        raise SlurmParseError(f"{command}: top level is {type(document).__name__}, not an object")
    errors = document.get("errors") or []
    if errors:
        # A reply that carries errors is not a trustworthy (possibly empty) list.
        raise SlurmParseError(f"{command} reported errors: {_show(errors)}")
    records = document.get(key)
    if not isinstance(records, list) or not all(isinstance(r, dict) for r in records):
        raise SlurmParseError(f"{command}: no list of objects under {key!r}")
    return records


_SHOW = reprlib.Repr()  # keyword arguments need Python 3.12
_SHOW.maxlevel, _SHOW.maxstring, _SHOW.maxother, _SHOW.maxlong = 4, 200, 200, 60


def _show(value: Any) -> str:
    """``value`` for an error message: bounded in size and depth, whatever Slurm printed."""
    return _SHOW.repr(value)


def _field(record: Mapping[str, Any], key: str, kind: type | tuple[type, ...], what: str) -> Any:
    if key not in record:
        raise SlurmParseError(f"{what}: field {key!r} missing")
    value = record[key]
    # bool is an int subclass; a bool where a number belongs is malformed output.
    if not isinstance(value, kind) or (isinstance(value, bool) and kind is int):
        raise SlurmParseError(f"{what}: field {key!r} is {_show(value)}, not {kind}")
    return value


def _optional(record: Mapping[str, Any], key: str, kind: type, what: str) -> Any:
    value = record.get(key)
    if value is None:
        return None
    if not isinstance(value, kind) or (isinstance(value, bool) and kind is not bool):
        raise SlurmParseError(f"{what}: field {key!r} is {_show(value)}, not {kind.__name__}")
    return value


def _timestamp(record: Mapping[str, Any], key: str, what: str) -> int | None:
    # Slurm 22.05 writes 0 for "no such time" (e.g. start_time of a held job).
    value = _optional(record, key, int, what)
    return value if value else None


def _decode_wait_status(raw: int | None) -> tuple[int | None, int | None]:
    # squeue 22.05 prints the raw wait(2) status: `exit 3` -> 768, SIGTERM -> 15.
    if raw is None:
        return None, None
    return (raw >> 8) & 0xFF, (raw & 0x7F) or None


def _job(record: Mapping[str, Any]) -> SlurmJob:
    job_id = _field(record, "job_id", int, "squeue job")
    what = f"squeue job {job_id}"
    node_list = _optional(record, "nodes", str, what) or ""
    state_raw = _field(record, "job_state", str, what)
    time_limit_min = _optional(record, "time_limit", int, what)
    exit_code, exit_signal = _decode_wait_status(_optional(record, "exit_code", int, what))
    flags = _optional(record, "flags", list, what) or []
    return SlurmJob(
        job_id=job_id,
        name=_optional(record, "name", str, what) or "",
        state=JobState.parse(state_raw),
        state_raw=state_raw,
        # None here means "no reason" (a running job); keep it a string.
        state_reason=_optional(record, "state_reason", str, what) or "None",
        nodes=expand_hostlist(node_list),
        node_list=node_list,
        node_count=_optional(record, "node_count", int, what) or 0,
        batch_host=_optional(record, "batch_host", str, what) or None,
        restart_count=_optional(record, "restart_cnt", int, what) or 0,
        requeue=bool(_optional(record, "requeue", bool, what)),
        exit_code=exit_code,
        exit_signal=exit_signal,
        # Minutes in the JSON; null means unlimited (partition MaxTime=INFINITE).
        time_limit_s=None if time_limit_min is None else time_limit_min * 60,
        start_time=_timestamp(record, "start_time", what),
        submit_time=_timestamp(record, "submit_time", what),
        end_time=_timestamp(record, "end_time", what),
        # When a pending job may start (its begin time, once that is set).
        eligible_time=_timestamp(record, "eligible_time", what),
        excluded_nodes=expand_hostlist(_optional(record, "excluded_nodes", str, what) or ""),
        comment=_optional(record, "comment", str, what) or "",
        flags=frozenset(str(flag) for flag in flags),
        user_name=_optional(record, "user_name", str, what) or "",
        partition=_optional(record, "partition", str, what) or "",
    )


def parse_squeue_json(text: str | bytes) -> dict[int, SlurmJob]:
    """Job id -> job, for every job in `squeue --json` output.

    Slurm 22.05 ignores `--jobs` and every other filter with `--json` and
    prints all jobs: callers select by id from this dict.
    """
    jobs = (_job(record) for record in _load(text, "jobs", "squeue --json"))
    return {job.job_id: job for job in jobs}


class _SinfoNode(msgspec.Struct, gc=False):
    """The fields of a `sinfo --json` node record that are read, with their types."""

    name: str
    state: str
    state_flags: list[str]
    partitions: list[Any] | None = None
    reason: str | None = None
    reason_set_by_user: str | None = None
    reason_changed_at: int | None = None
    address: str | None = None
    cpus: int | None = None
    alloc_cpus: int | None = None


class _SinfoReply(msgspec.Struct):
    nodes: list[_SinfoNode]
    errors: list[Any] | None = None


# msgspec skips the ~40 other fields of each node in C: at 4,096 nodes (4 MB)
# this takes 7.5 ms where json.loads and a walk over every record took 77 ms,
# all of it holding the GIL the event loop needs, every poll.
_SINFO = msgspec.json.Decoder(_SinfoReply)


def _node(record: _SinfoNode) -> SlurmNode:
    return SlurmNode(
        name=record.name,
        state=NodeState.parse(record.state),
        state_raw=record.state,
        flags=frozenset(NodeFlag.parse(flag) for flag in record.state_flags),
        flags_raw=tuple(record.state_flags),
        reason=record.reason or "",
        reason_set_by=record.reason_set_by_user or None,
        # Slurm 22.05 writes 0 for "no such time".
        reason_changed_at=record.reason_changed_at or None,
        address=record.address or None,
        cpus=record.cpus or 0,
        alloc_cpus=record.alloc_cpus or 0,
        partitions=tuple(str(p) for p in record.partitions or ()),
    )


def parse_sinfo_json(text: str | bytes) -> dict[str, SlurmNode]:
    """Node name -> node, from `sinfo --json` output.

    sinfo lists a node once per partition it belongs to; the records agree on
    node state, so the last one wins.
    """
    return SinfoParser().parse(text)


class SinfoParser:
    """:func:`parse_sinfo_json` for a poller: a node record equal to the one the last
    reply held gives back the same :class:`SlurmNode`, not a new one.

    Between two polls few nodes change; building 4,096 nodes anew took 15 ms of
    the GIL each poll, comparing the decoded records (in C) takes about 1 ms.
    """

    def __init__(self) -> None:
        self._last: dict[str, tuple[_SinfoNode, SlurmNode]] = {}

    def parse(self, text: str | bytes) -> dict[str, SlurmNode]:
        """Node name -> node, as :func:`parse_sinfo_json`."""
        try:
            reply = _SINFO.decode(text)
        except msgspec.ValidationError as error:
            raise SlurmParseError(f"sinfo --json: {error}") from error
        except (msgspec.DecodeError, RecursionError) as error:
            raise SlurmParseError(f"sinfo --json printed no valid JSON: {error}") from error
        if reply.errors:
            # A reply that carries errors is not a trustworthy (possibly empty) list.
            raise SlurmParseError(f"sinfo --json reported errors: {_show(reply.errors)}")
        last = self._last
        kept: dict[str, tuple[_SinfoNode, SlurmNode]] = {}
        for record in reply.nodes:
            known = last.get(record.name)
            kept[record.name] = (
                known if known is not None and known[0] == record else (record, _node(record))
            )
        self._last = kept
        return {name: node for name, (_, node) in kept.items()}


# --- drain reasons -------------------------------------------------------------

_REASON_PREFIX = "resurgo:"
_REASON = re.compile(r"^resurgo: (?P<cause>[A-Za-z0-9_.\-]+) job=(?P<job>[0-9]{1,18})$")


@dataclass(frozen=True)
class DrainReason:
    """A drain reason Resurgo wrote: why, and for which job."""

    cause: str
    job_id: int


def drain_reason(cause: str, job_id: int) -> str:
    """The structured reason ``resurgo: <cause> job=<id>`` that marks a drain as ours."""
    if not re.fullmatch(r"[A-Za-z0-9_.\-]+", cause):
        raise ValueError(f"drain cause {cause!r}: use letters, digits, '_', '-', '.' only")
    return f"{_REASON_PREFIX} {cause} job={job_id}"


def parse_drain_reason(reason: str) -> DrainReason | None:
    """The cause and job of a reason made by `drain_reason`; None for anyone else's."""
    match = _REASON.match(reason.strip())
    if match is None:
        return None
    return DrainReason(cause=match["cause"], job_id=int(match["job"]))


# --- command builders ------------------------------------------------------------


def squeue_argv() -> list[str]:
    """List every job (22.05 ignores filters with --json anyway)."""
    return ["squeue", "--json"]


def sinfo_argv() -> list[str]:
    """List every node with its state, flags and reason."""
    return ["sinfo", "--json"]


def hostnames_argv(node_list: str) -> list[str]:
    """Let Slurm itself expand a hostlist, one name a line."""
    return ["scontrol", "show", "hostnames", node_list]


def drain_argv(node: str, reason: str) -> list[str]:
    """Drain ``node``: running jobs go on, no new job starts there. Needs operator rights."""
    if not reason.strip():
        raise ValueError("Slurm refuses a drain without a reason")
    # One argv element: the reason may hold spaces and needs no shell quoting.
    return ["scontrol", "update", f"NodeName={node}", "State=DRAIN", f"Reason={reason}"]


def resume_argv(node: str) -> list[str]:
    """Return a drained (or down) node to service."""
    return ["scontrol", "update", f"NodeName={node}", "State=RESUME"]


def shrink_argv(job_id: int, keep_nodes: Sequence[str]) -> list[str]:
    """Shrink a RUNNING job to ``keep_nodes``: takes effect at once, kills steps on the rest."""
    if not keep_nodes:
        raise ValueError("a job cannot shrink to no nodes; cancel or requeue it instead")
    return ["scontrol", "update", f"JobId={job_id}", f"NodeList={compress_hostlist(keep_nodes)}"]


def requeue_hold_argv(job_id: int) -> list[str]:
    """Requeue the job (same id, restart count + 1) and hold it until released."""
    return ["scontrol", "requeuehold", str(job_id)]


def update_size_argv(
    job_id: int,
    n_nodes: int,
    n_tasks: int,
    exclude: Sequence[str] = (),
    cpus_per_task: int = 1,
) -> list[str]:
    """Resize a pending job to exactly ``n_nodes`` and ``n_tasks``, avoiding ``exclude``.

    NumCPUs is reset too: a requeued job keeps the CPU count of its last
    allocation as its minimum, and with more CPUs than ``n_nodes`` can hold it
    stays PENDING with reason BadConstraints (seen on 22.05).
    """
    if n_nodes < 1 or n_tasks < n_nodes:
        raise ValueError(f"need n_nodes >= 1 and n_tasks >= n_nodes, got {n_nodes}, {n_tasks}")
    argv = [
        "scontrol",
        "update",
        f"JobId={job_id}",
        f"NumNodes={n_nodes}-{n_nodes}",
        f"NumCPUs={n_tasks * cpus_per_task}",
        f"NumTasks={n_tasks}",
    ]
    if exclude:
        argv.append(f"ExcNodeList={compress_hostlist(exclude)}")
    return argv


def start_now_argv(job_id: int) -> list[str]:
    """Clear the begin time a requeue sets (~120 s on 22.05) so the job may start at once."""
    return ["scontrol", "update", f"JobId={job_id}", "StartTime=now"]


def release_argv(job_id: int) -> list[str]:
    """Release a held job so the scheduler may start it."""
    return ["scontrol", "release", str(job_id)]


def sbatch_argv(options: Sequence[str], script: str) -> list[str]:
    """Submit batch script ``script`` held (released once Resurgo registered it); prints the id."""
    return ["sbatch", "--parsable", "--hold", *options, script]


def run_argv(options: Sequence[str], command: Sequence[str]) -> list[str]:
    """Submit ``command`` as a batch job of its own (``--wrap``), to run once released by
    the scheduler as usual; prints the id."""
    return ["sbatch", "--parsable", *options, f"--wrap={shlex.join(command)}"]


def test_only_argv(options: Sequence[str], script: str) -> list[str]:
    """Ask whether (and when) Slurm would run the batch script; submits nothing.

    A held submission is accepted even when no node could ever run it (plain
    sbatch would refuse it), so ``resurgo submit`` asks first.
    """
    return ["sbatch", "--test-only", *options, script]


# Pending reasons that no amount of waiting ends: the request exceeds what the
# partition has or allows (until an administrator changes Slurm's configuration).
NEVER_REASONS = frozenset(
    {
        "BadConstraints",
        "PartitionNodeLimit",
        "PartitionTimeLimit",
        "PartitionConfig",
        "InvalidAccount",
        "InvalidQOS",
    }
)


_JOB_ID = re.compile(r"[0-9]{1,18}")


def parse_sbatch_id(text: str) -> int:
    """The job id ``sbatch --parsable`` printed (``ID`` or ``ID;cluster``)."""
    first = text.strip().split(";")[0]
    # ASCII digits only: str.isdigit() also takes "²", which int() refuses.
    if not _JOB_ID.fullmatch(first):
        raise SlurmParseError(f"sbatch printed {text.strip()[:200]!r}, not a job id")
    return int(first)


def cancel_argv(job_id: int, signal: str | None = None) -> list[str]:
    """Cancel the job, or with ``signal`` (e.g. ``"USR1"``) only signal it."""
    if signal is None:
        return ["scancel", str(job_id)]
    return ["scancel", f"--signal={signal}", str(job_id)]
