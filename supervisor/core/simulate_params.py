"""What the goodput simulator is given: the job, its cluster, their faults; pure.

:class:`Params` holds one simulation's inputs, checked when made (a bad one
raises :class:`BadParameter` naming its field). :data:`LLAMA3_MIX` splits the
interruptions of Llama 3's published run into :class:`Component` kinds, with
detection and recovery times measured by ``bench/recovery.py``; the presets
(:data:`PRESETS`) are the published runs the defaults come from.
:mod:`supervisor.core.simulate` runs them.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Sequence
from dataclasses import dataclass

from supervisor.core.model import Cause

HOUR_S = 3600.0
DAY_S = 86400.0

# Llama 3 report (Llama Team, "The Llama 3 Herd of Models", 2024, §3.3.4 and
# Table 5): a 54-day snapshot of pre-training on 16,384 H100 GPUs had 419
# unexpected interruptions, 58.7% of them GPU issues (faulty GPU, HBM3, SRAM,
# GPU system processor, silent data corruption, thermal interface).
LLAMA3_GPUS = 16_384
LLAMA3_DAYS = 54.0
LLAMA3_INTERRUPTIONS = 419
LLAMA3_GPU_SHARE = 0.587
# The other 41.3%, split by Table 5's counts: software bugs and dependencies
# (54 + 2), network switches, cables and NICs (35 + 7), host maintenance and
# host hardware (32 + 3 + 3 + 2 + 2 + 2 + 2), NCCL watchdog timeouts of
# unknown origin (7).
_LLAMA3_OTHER_COUNTS = {"software": 56, "network": 42, "host": 46, "unknown": 7}

# OPT-175B (Zhang et al. 2022) trained on 992 A100 GPUs; its logbook (seeds):
# 35-plus manual and 70-plus automatic restarts, 105 in all, in two months.
OPT175B_GPUS = 992
OPT175B_DAYS = 60.0
OPT175B_RESTARTS = 105

# bench/recovery.py on the local cluster (bench/RESULTS.md, one run): fault ->
# the supervisor's decision, and fault -> the first step after the resume.
_BENCH_SIGKILL_S = (0.04, 13.7)
_BENCH_HANG_S = (8.07, 25.0)
_BENCH_EXCEPTION_S = (1.07, 18.0)
# A lost node is noticed when its agent's lease expires: 8 s in that bench's
# configuration (a setting, not a measurement); the relaunch is a SIGKILL's.
_BENCH_LEASE_S = 8.0


class BadParameter(ValueError):
    """A parameter is unusable; ``field`` names it (the CLI maps it to its flag)."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


class IntervalPolicy(enum.Enum):
    """How the checkpoint interval is chosen, at every (re)start of the job.

    - ``FIXED``: ``interval_s``, always.
    - ``YOUNG``: Young's ``√(2δM)`` for the save stall δ and the job's true MTBF M.
    - ``DALY``: what the supervisor recommends for the true MTBF: Daly's
      interval for the stall, raised above the background write.
    - ``ADAPTIVE``: what the daemon does: ``interval_s`` until a node fault is
      seen, then the interval it pushes from its MTBF estimate over the faults
      observed so far (node faults over the partition's nodes, as the daemon
      counts them over the cluster's).
    """

    FIXED = "fixed"
    YOUNG = "young"
    DALY = "daly"
    ADAPTIVE = "adaptive"


@dataclass(frozen=True)
class Component:
    """One kind of interruption and how the supervisor handles it.

    ``share``: its share of all interruptions; ``cause``: the cause recorded;
    ``takes_node``: the node is drained and repaired (else the job restarts
    on the same nodes); ``detect_s``: fault -> decision; ``recover_s``:
    decision -> first step after a relaunch on nodes the job can have at once.
    """

    name: str
    share: float
    cause: Cause
    takes_node: bool
    detect_s: float
    recover_s: float


def _component(
    name: str,
    share: float,
    cause: Cause,
    takes_node: bool,
    bench: tuple[float, float],
    detect_s: float | None = None,
) -> Component:
    """A component whose detection and recovery times are a bench scenario's."""
    detected, resumed = bench
    detect = detected if detect_s is None else detect_s
    return Component(name, share, cause, takes_node, detect, resumed - detected)


_OTHER_SHARE = 1.0 - LLAMA3_GPU_SHARE
_OTHER_TOTAL = sum(_LLAMA3_OTHER_COUNTS.values())


def _other(name: str) -> float:
    return _OTHER_SHARE * _LLAMA3_OTHER_COUNTS[name] / _OTHER_TOTAL


# A GPU fault kills its rank (Xid, ECC): the node is blamed and drained. A
# switch or NIC fault hangs the collectives and the hang points at a node. A
# NCCL watchdog timeout of unknown origin hangs with no culprit: same nodes.
LLAMA3_MIX = (
    _component("gpu", LLAMA3_GPU_SHARE, Cause.RANK_SIGNAL, True, _BENCH_SIGKILL_S),
    _component("software", _other("software"), Cause.USER_EXCEPTION, False, _BENCH_EXCEPTION_S),
    _component("network", _other("network"), Cause.HANG, True, _BENCH_HANG_S),
    _component("host", _other("host"), Cause.NODE_LOST, True, _BENCH_SIGKILL_S, _BENCH_LEASE_S),
    _component("unknown", _other("unknown"), Cause.HANG, False, _BENCH_HANG_S),
)


@dataclass(frozen=True)
class Params:
    """Everything one simulation needs; durations in seconds unless the name says.

    Defaults: Llama 3's run (see :data:`LLAMA3_MIX` and the constants above),
    async saves with a 2-minute background write (the seeds' save time) and a
    5 s stall (the seeds' "a few seconds" device-to-host copy), the
    supervisor's recommended (Daly) interval. Without a published figure, the
    spare nodes (16), the repair time (a day), the queue wait (median 10 min,
    log-normal shape 1) are assumptions: set them for your cluster.
    ``requeue_start_s``: a requeue that finds its nodes idle starts in about
    2 s (DESIGN §4); ``grow_recover_s``: stopping and restarting the ranks for
    a planned grow, as a SIGKILL's relaunch. ``min_nodes`` None: the job
    needs all its nodes; ``unit_nodes``: its size must stay a multiple of it.

    Hot spares: ``job_spares`` nodes allocated besides the world
    (``resurgo submit --spares K``); the partition holds them on top of its
    ``spare_nodes`` idle ones; 0, the default, is a job without them.
    ``swap_s``: a spare's takeover, from the decision to the first resumed
    step (the component's ``detect_s`` is charged before it, as before every
    relaunch); None, the default: the component's own ``recover_s``, the
    relaunch bench/recovery.py measured (13.7 s for a killed rank and a lost
    node, 16.9 s after a hang or an exception; bench/RESULTS.md,
    2026-11-30), because a swap is that relaunch, a new srun step from the
    newest checkpoint, with the spare in the blamed node's place. No swap
    has been measured on its own yet.
    """

    gpus: int = LLAMA3_GPUS
    gpus_per_node: int = 8
    days: float = LLAMA3_DAYS
    gpu_mtbf_h: float = LLAMA3_GPUS * LLAMA3_DAYS * 24.0 / LLAMA3_INTERRUPTIONS
    mix: tuple[Component, ...] = LLAMA3_MIX
    save_stall_s: float = 5.0
    write_s: float = 120.0
    interval_policy: IntervalPolicy = IntervalPolicy.DALY
    interval_s: float = 1800.0
    spare_nodes: int = 16
    repair_s: float = DAY_S
    min_nodes: int | None = None
    unit_nodes: int = 1
    queue_median_s: float = 600.0
    queue_sigma: float = 1.0
    requeue_start_s: float = 2.0
    grow_recover_s: float = _BENCH_SIGKILL_S[1] - _BENCH_SIGKILL_S[0]
    grow_back: bool = True
    job_spares: int = 0
    swap_s: float | None = None

    def __post_init__(self) -> None:
        if self.gpus_per_node < 1:
            raise BadParameter("gpus_per_node", "must be at least 1")
        if self.gpus < 1 or self.gpus % self.gpus_per_node:
            raise BadParameter(
                "gpus",
                f"must be a positive multiple of {self.gpus_per_node} (GPUs per node), "
                f"got {self.gpus}",
            )
        for name in ("days", "gpu_mtbf_h", "save_stall_s", "interval_s", "queue_median_s"):
            _positive(name, getattr(self, name))
        for name in ("write_s", "repair_s", "queue_sigma", "requeue_start_s", "grow_recover_s"):
            _non_negative(name, getattr(self, name))
        if self.spare_nodes < 0:
            raise BadParameter("spare_nodes", "must be 0 or more")
        if self.job_spares < 0:
            raise BadParameter("job_spares", f"must be 0 or more, got {self.job_spares}")
        if self.swap_s is not None:
            _non_negative("swap_s", self.swap_s)
        if self.unit_nodes < 1 or self.nodes % self.unit_nodes:
            raise BadParameter("unit_nodes", f"must divide the job's {self.nodes} nodes")
        if self.min_nodes is not None and not 1 <= self.min_nodes <= self.nodes:
            raise BadParameter("min_nodes", f"must be between 1 and the job's {self.nodes} nodes")
        _check_mix(self.mix)

    @property
    def nodes(self) -> int:
        """The job's full size in nodes."""
        return self.gpus // self.gpus_per_node

    def job_mtbf_s(self, nodes: int | None = None) -> float:
        """Mean time between interruptions of the job on ``nodes`` (default: all of them)."""
        size = self.nodes if nodes is None else nodes
        return self.gpu_mtbf_h * HOUR_S / (size * self.gpus_per_node)


def _positive(name: str, value: float) -> None:
    if not math.isfinite(value) or value <= 0:
        raise BadParameter(name, f"must be a positive number, got {value!r}")


def _non_negative(name: str, value: float) -> None:
    if not math.isfinite(value) or value < 0:
        raise BadParameter(name, f"must be a number >= 0, got {value!r}")


def _check_mix(mix: Sequence[Component]) -> None:
    if not mix:
        raise BadParameter("mix", "needs at least one component")
    for component in mix:
        _non_negative("mix", component.share)
        _non_negative("mix", component.detect_s)
        _non_negative("mix", component.recover_s)
    if abs(sum(c.share for c in mix) - 1.0) > 1e-6:
        raise BadParameter("mix", "shares must add up to 1")


def llama3() -> Params:
    """Llama 3's 54-day snapshot: the defaults."""
    return Params()


def opt175b() -> Params:
    """OPT-175B's two months: 992 GPUs and the logbook's restart rate (Llama 3's mix)."""
    gpu_mtbf_h = OPT175B_GPUS * OPT175B_DAYS * 24.0 / OPT175B_RESTARTS
    return Params(gpus=OPT175B_GPUS, days=OPT175B_DAYS, gpu_mtbf_h=gpu_mtbf_h)


def llama3_spares() -> Params:
    """Llama 3's run with the partition's 16 spare nodes held by the job as hot spares.

    The same 2,064 nodes as :func:`llama3`: none idle, so a spare comes back
    only from repair (bench/RESULTS.md compares the two).
    """
    return Params(job_spares=16, spare_nodes=0)


PRESETS = {"llama3": llama3, "llama3-spares": llama3_spares, "opt175b": opt175b}
