"""`resurgo simulate`: goodput of a supervised job at cluster scale, by simulation.

    resurgo simulate                                   # Llama 3's 54 days on 16,384 GPUs
    resurgo simulate --interval-policy fixed --interval-s 1560 --json
    resurgo simulate --preset opt175b --plot goodput.svg
    resurgo simulate --spares 16 --idle-nodes 0          # the 16 nodes held as hot spares

A flag left out takes the preset's value (``--preset llama3`` by default; the
defaults and their sources are in :mod:`supervisor.core.simulate`). ``--plot``
sweeps fixed intervals on the same failures and draws goodput against the
interval, Young's and Daly's optima marked, as PNG, SVG or PDF by the file's
suffix. ``--json`` prints one object:
``goodput``, ``interval_s`` (the mean interval in force), ``interruptions``
(the count) and ``interruptions_by_cause``, ``badput_s`` (seconds by badput
kind: lost_work, detection, recovery, checkpoint_stall, startup, queue_wait)
and ``badput_by_cause_s`` (the fault-related badput by restart cause), among
others; with ``--plot``, the ``sweep`` points and ``best_interval_s`` too.
``--spares K`` gives the job K hot spares besides its world (``resurgo submit
--spares``; ``--idle-nodes`` are the partition's idle nodes, ``spare_nodes`` in
the JSON; ``--spare-nodes`` is its old spelling, still read): ``swaps``,
``spare_faults``, ``spare_share`` (the spares' share of the allocation) and
``allocation_goodput`` (goodput against the whole allocation) report them.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

from agent.checkpoint.interval import WRITE_HEADROOM, recommended_interval_s
from supervisor.cli.common import BadInput, fail, fine_duration, number
from supervisor.core.simulate import (
    HOUR_S,
    PRESETS,
    BadParameter,
    Component,
    IntervalPolicy,
    Outcome,
    Params,
    SweepPoint,
    best_interval_s,
    optima_s,
    simulate,
    sweep,
)

_USAGE_ERROR = 2
_JSON_VERSION = 1
# The sweep behind --plot: intervals from a quarter to four times the recommended one.
_SWEEP_SPAN = 4.0
# What --plot can write, by the file's suffix (matplotlib's Agg, SVG and PDF backends).
_PLOT_FORMATS = ("png", "svg", "pdf")


# Bounds on the inputs: beyond any real cluster or job, near enough that no product
# overflows and a run ends (1e308 days would run forever, a GPU MTBF of 1e-320 h
# never gets past its first failure, 1e11 GPUs would not fit in memory).
_MOST_COUNT = 1_000_000  # GPUs, nodes
_MOST_S = 1e7  # durations in seconds: 116 days
_MOST_H = 1e7  # hours: a GPU MTBF of 1,100 years
_LEAST_MTBF_H = 1e-3
_MOST_DAYS = 3650.0
_MOST_SIGMA = 5.0  # log-normal shape: e^5 is a 150-fold spread already
_MOST_SWEEP = 200


def _integer(flag: str, text: str, *, least: int, most: int = _MOST_COUNT) -> int:
    """``text`` as an integer from ``least`` to ``most``."""
    try:
        value = int(text)
    except ValueError:
        value = least - 1
    if not least <= value <= most:
        raise BadInput(f"{flag} must be a whole number from {least} to {most:,}, got {text!r}")
    return value


def _at_least(least: int) -> Callable[[str, str], int]:
    return lambda flag, text: _integer(flag, text, least=least)


def _positive(most: float, least: float | None = None) -> Callable[[str, str], float]:
    return lambda flag, text: number(flag, text, positive=True, least=least, most=most)


def _non_negative(most: float) -> Callable[[str, str], float]:
    return lambda flag, text: number(flag, text, positive=False, most=most)


def _mix(text: str, preset: Params) -> tuple[Component, ...]:
    """``NAME=SHARE,...`` over the preset's components, shares scaled to add up to 1."""
    known = {component.name: component for component in preset.mix}
    shares: dict[str, float] = {}
    for item in text.split(","):
        name, _, share = item.partition("=")
        name = name.strip()
        if name not in known:
            raise BadInput(
                f"--mix: unknown component {name!r}; the components are {', '.join(known)}"
            )
        shares[name] = number("--mix", share.strip(), positive=False)
    total = sum(shares.values())
    if total <= 0:
        raise BadInput("--mix: the shares must not all be 0")
    return tuple(replace(known[name], share=share / total) for name, share in shares.items())


def register(subparsers: Any) -> None:
    """Add the `simulate` subcommand to `subparsers`."""
    parser: argparse.ArgumentParser = subparsers.add_parser(
        "simulate",
        help="simulate goodput of a supervised job at cluster scale",
        description=(
            "Simulate one training job under Resurgo: component failures, detection, "
            "drain, a hot spare taking the blamed node's place, or a relaunch onto idle "
            "nodes or smaller or after a queue wait, lost work since the last committed "
            "checkpoint. Prints goodput, badput by cause and interruptions. Unset flags "
            "take the preset's values."
        ),
    )
    add = parser.add_argument
    add(
        "--preset",
        choices=sorted(PRESETS),
        default="llama3",
        help="the run whose values unset flags take (default: llama3)",
    )
    add("--gpus", metavar="N", help="GPUs of the job (a multiple of --gpus-per-node)")
    add("--gpus-per-node", metavar="N", help="GPUs per node (default: the preset's, 8)")
    add("--days", metavar="D", help="simulated days")
    add("--gpu-mtbf-h", metavar="H", help="hours between interruptions per GPU, all causes")
    add("--mix", metavar="NAME=SHARE,...", help="cause mix over the preset's components")
    add("--detect-s", metavar="S", help="fault -> decision, every component")
    add("--recover-s", metavar="S", help="decision -> first step after relaunch, every component")
    add("--save-stall-s", metavar="S", help="seconds each save blocks training")
    add("--write-s", metavar="S", help="seconds the background write runs after the stall")
    add("--idle-nodes", dest="spare_nodes", metavar="N",
        help="idle nodes in the partition the job can requeue onto")  # fmt: skip
    # The name before --idle-nodes: beside --spares it read as the same thing.
    add("--spare-nodes", dest="spare_nodes", help=argparse.SUPPRESS)
    add(
        "--spares",
        dest="job_spares",
        metavar="K",
        help="hot spares allocated besides the world (default: the preset's, 0 in llama3)",
    )
    add("--swap-s", metavar="S", help="decision -> first step when a spare takes over "
        "(default: each component's relaunch time)")  # fmt: skip
    add("--repair-h", metavar="H", help="hours a drained node is out")
    add("--min-nodes", metavar="N", help="smallest size the job may shrink to (default: all)")
    add("--unit-nodes", metavar="N", help="the job's size stays a multiple of this")
    add("--queue-median-s", metavar="S", help="median queue wait of a requeue (log-normal)")
    add("--queue-sigma", metavar="X", help="log-normal shape of the queue wait")
    add(
        "--interval-policy",
        choices=[p.value for p in IntervalPolicy],
        help="how the checkpoint interval is chosen (default: the preset's, daly)",
    )
    add("--interval-s", metavar="S", help="interval of the fixed policy; adaptive's first")
    add("--seed", metavar="N", default="0", help="random seed (default: 0)")
    add("--plot", metavar="PATH", type=Path,
        help="plot goodput against interval into PATH: .png, .svg or .pdf")  # fmt: skip
    add(
        "--sweep-points",
        metavar="N",
        default="25",
        help="intervals in the --plot sweep, 4 or more (default: 25)",
    )
    add("--sweep-seeds", metavar="N", default="4",
        help="runs per interval in the sweep (default: 4)")  # fmt: skip
    add("--json", action="store_true", help="print one JSON object")
    parser.set_defaults(func=run)


# Flags that set one Params field as given: (flag, field, parser).
_FIELDS: tuple[tuple[str, str, Callable[[str, str], float]], ...] = (
    ("--gpus", "gpus", _at_least(1)),
    ("--gpus-per-node", "gpus_per_node", _at_least(1)),
    ("--days", "days", _positive(_MOST_DAYS)),
    ("--gpu-mtbf-h", "gpu_mtbf_h", _positive(_MOST_H, _LEAST_MTBF_H)),
    ("--save-stall-s", "save_stall_s", _positive(_MOST_S)),
    ("--write-s", "write_s", _non_negative(_MOST_S)),
    ("--idle-nodes", "spare_nodes", _at_least(0)),
    ("--spares", "job_spares", _at_least(0)),
    ("--swap-s", "swap_s", _non_negative(_MOST_S)),
    ("--min-nodes", "min_nodes", _at_least(1)),
    ("--unit-nodes", "unit_nodes", _at_least(1)),
    ("--queue-median-s", "queue_median_s", _positive(_MOST_S)),
    ("--queue-sigma", "queue_sigma", _non_negative(_MOST_SIGMA)),
    ("--interval-s", "interval_s", _positive(_MOST_S)),
)
# The flag behind each Params field, for the checks only the whole set can make.
_FLAG_OF = {field: flag for flag, field, _ in _FIELDS} | {"mix": "--mix", "repair_s": "--repair-h"}


def _params(args: argparse.Namespace) -> Params:
    """The preset with the given flags applied; raises BadInput or BadParameter."""
    preset = PRESETS[args.preset]()
    given: dict[str, Any] = {
        field: parse(flag, getattr(args, field))
        for flag, field, parse in _FIELDS
        if getattr(args, field) is not None
    }
    if args.repair_h is not None:
        repair_h = number("--repair-h", args.repair_h, positive=False, most=_MOST_H)
        given["repair_s"] = repair_h * HOUR_S
    if args.interval_policy is not None:
        given["interval_policy"] = IntervalPolicy(args.interval_policy)
    mix = preset.mix if args.mix is None else _mix(args.mix, preset)
    if args.detect_s is not None:
        detect = number("--detect-s", args.detect_s, positive=False, most=_MOST_S)
        mix = tuple(replace(component, detect_s=detect) for component in mix)
    if args.recover_s is not None:
        recover = number("--recover-s", args.recover_s, positive=False, most=_MOST_S)
        mix = tuple(replace(component, recover_s=recover) for component in mix)
    return replace(preset, mix=mix, **given)


def _hours(span_s: float) -> str:
    return f"{span_s / HOUR_S:.1f} h"


def _mtbf(span_s: float) -> str:
    """Hours, or finer where an hour would round to 0.0 h."""
    return _hours(span_s) if span_s >= HOUR_S else fine_duration(span_s)


def _summary(params: Params, outcome: Outcome, seed: int) -> dict[str, Any]:
    young, daly = optima_s(params)
    accounting = outcome.accounting
    return {
        "version": _JSON_VERSION,
        "gpus": params.gpus,
        "nodes": params.nodes,
        "spare_nodes": params.spare_nodes,
        "job_spares": params.job_spares,
        "swap_s": params.swap_s,
        "days": params.days,
        "seed": seed,
        "interval_policy": params.interval_policy.value,
        "interval_s": outcome.mean_interval_s,
        "final_interval_s": outcome.final_interval_s,
        "young_s": young,
        "daly_s": daly,
        "job_mtbf_s": params.job_mtbf_s(),
        "save_stall_s": params.save_stall_s,
        "write_s": params.write_s,
        "goodput": outcome.goodput,
        "useful_work_share": outcome.useful_work_share,
        "interruptions": sum(outcome.interruptions.values()),
        "interruptions_by_cause": {c.value: n for c, n in outcome.interruptions.items()},
        "badput_s": {kind.value: s for kind, s in accounting.badput_s.items()},
        "badput_by_cause_s": dict(accounting.by_fault_cause_s),
        "wall_s": accounting.wall_s,
        "productive_s": accounting.productive_s,
        "saves": outcome.saves,
        "grows": outcome.grows,
        "queued": outcome.queued,
        "shrinks": outcome.shrinks,
        "swaps": outcome.swaps,
        "spare_faults": outcome.spare_faults,
        "spare_share": outcome.spare_share,
        "allocation_goodput": outcome.allocation_goodput,
    }


def _human(summary: dict[str, Any]) -> str:
    wall = summary["wall_s"]
    causes = ", ".join(
        f"{cause} {count}"
        for cause, count in sorted(summary["interruptions_by_cause"].items(), key=lambda kv: -kv[1])
    )
    spares = summary["job_spares"]
    swap = "each component's relaunch" if summary["swap_s"] is None else f"{summary['swap_s']:g} s"
    lines = [
        f"{summary['days']:g} days of {summary['gpus']:,} GPUs ({summary['nodes']:,} nodes, "
        f"{spares} hot spare{'' if spares == 1 else 's'}, {summary['spare_nodes']} idle in "
        f"the partition), seed {summary['seed']}",
        f"job MTBF {_mtbf(summary['job_mtbf_s'])}; save stall {summary['save_stall_s']:g} s, "
        f"background write {summary['write_s']:g} s",
        f"interval ({summary['interval_policy']}) {fine_duration(summary['interval_s'])}; "
        f"Young {fine_duration(summary['young_s'])}, Daly {fine_duration(summary['daly_s'])}",
        f"interruptions {summary['interruptions']}: {causes}",
        f"goodput {summary['goodput']:.1%} "
        f"(useful work at full size {summary['useful_work_share']:.1%})",
        "badput:",
    ]
    for kind, seconds in summary["badput_s"].items():
        lines.append(f"  {kind:<17}{seconds / wall:6.2%}  {_hours(seconds)}")
    lines.append(
        f"saves {summary['saves']}, requeues that waited in the queue {summary['queued']}, "
        f"grows back {summary['grows']}, shrinks {summary['shrinks']}"
    )
    if spares:
        lines.append(
            f"hot spares: {summary['swaps']} swaps ({swap}), {summary['spare_faults']} failed "
            f"idle; {summary['spare_share']:.2%} of the allocation, goodput against the "
            f"allocation {summary['allocation_goodput']:.1%}"
        )
    if "best_interval_s" in summary:
        lines.append(
            f"sweep: best interval {fine_duration(summary['best_interval_s'])}; "
            f"plot written to {summary['plot']}"
        )
    return "\n".join(lines)


def _tick(value: float, _position: int) -> str:
    """Label 1, 2 and 5 times powers of ten on the log axis, plainly; nothing between."""
    leading = f"{value:.0e}"[0]
    return f"{value:g}" if leading in "125" else ""


def _plot(path: Path, params: Params, points: list[SweepPoint], best: float, chosen: float) -> None:
    """Goodput against the checkpoint interval, the optima marked, at ``path`` in the format
    its suffix names (one of :data:`_PLOT_FORMATS`)."""
    # matplotlib is loaded only by this flag; a bare Figure keeps pyplot's global state out.
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import FuncFormatter

    young, daly = optima_s(params)
    figure = Figure(figsize=(8, 4.5))
    FigureCanvasAgg(figure)
    axes = figure.add_subplot()
    axes.plot(
        [p.interval_s / 60 for p in points],
        [100 * p.goodput for p in points],
        marker="o",
        markersize=3,
        color="#1f4e79",
        label="simulated goodput",
    )
    axes.axvline(young / 60, color="#ef6c00", linestyle="--", label=f"Young {young / 60:.1f} min")
    axes.axvline(daly / 60, color="#2e7d32", linestyle="-", label=f"Daly {daly / 60:.1f} min")
    axes.axvline(best / 60, color="#6a1b9a", linestyle=":", label=f"best {best / 60:.1f} min")
    axes.axvline(chosen / 60, color="#c62828", linestyle="-.", alpha=0.6,
                 label=f"policy {params.interval_policy.value}: {chosen / 60:.1f} min")  # fmt: skip
    axes.set_xscale("log")
    axes.xaxis.set_major_formatter(FuncFormatter(_tick))
    axes.xaxis.set_minor_formatter(FuncFormatter(_tick))
    axes.set_xlabel("checkpoint interval (min)")
    axes.set_ylabel("goodput (%)")
    axes.set_title(
        f"{params.gpus:,} GPUs, {params.days:g} days, "
        f"job MTBF {params.job_mtbf_s() / HOUR_S:.2f} h, "
        f"stall {params.save_stall_s:g} s, write {params.write_s:g} s"
    )
    axes.grid(True, which="both", alpha=0.3)
    axes.legend(loc="lower center", fontsize="small")
    figure.savefig(path, format=path.suffix[1:].lower(), dpi=100, bbox_inches="tight")


def _check_plot(path: Path) -> None:
    """BadInput unless ``path`` names a file of a format :func:`_plot` writes, in a folder
    that exists: said before the simulation runs, not after."""
    if path.is_dir():
        raise BadInput(f"--plot {path} is a directory: name the file to write in it")
    if path.suffix[1:].lower() not in _PLOT_FORMATS:
        raise BadInput(
            f"--plot {path}: name a .png, .svg or .pdf file (the suffix picks the format)"
        )
    if not path.parent.is_dir():
        raise BadInput(f"--plot {path}: the folder {path.parent} does not exist: create it first")


def _sweep_intervals(params: Params, count: int) -> list[float]:
    """``count`` intervals evenly spaced on a log scale, from a quarter to four times the
    recommended one, but all above the background write: below it saves queue behind
    each other, and :func:`best_interval_s` leaves those points out of its fit."""
    middle = recommended_interval_s(params.save_stall_s, params.write_s, params.job_mtbf_s())
    low = max(middle / _SWEEP_SPAN, WRITE_HEADROOM * params.write_s)
    high = middle * _SWEEP_SPAN
    return [low * (high / low) ** (i / (count - 1)) for i in range(count)]


def run(args: argparse.Namespace) -> int:
    """Simulate and print; 2 on bad input, 1 when the plot cannot be written, else 0."""
    # Values are parsed here rather than by argparse so that bad input gives one
    # line naming the flag, not argparse's usage block.
    try:
        seed = _integer("--seed", args.seed, least=0, most=2**32 - 1)
        points_n = _integer("--sweep-points", args.sweep_points, least=4, most=_MOST_SWEEP)
        seeds_n = _integer("--sweep-seeds", args.sweep_seeds, least=1, most=_MOST_SWEEP)
        params = _params(args)
        if args.plot is not None:
            _check_plot(args.plot)
    except BadInput as error:
        return fail("simulate", str(error), _USAGE_ERROR)
    except BadParameter as error:
        return fail("simulate", f"{_FLAG_OF.get(error.field, error.field)} {error}", _USAGE_ERROR)
    outcome = simulate(params, seed)
    summary = _summary(params, outcome, seed)
    if args.plot is not None:
        intervals = _sweep_intervals(params, points_n)
        points = sweep(params, intervals, range(seed, seed + seeds_n))
        try:
            best = best_interval_s(points, above_s=params.write_s)
        except ValueError as error:
            return fail("simulate", f"{error}: raise --sweep-points", _USAGE_ERROR)
        try:
            _plot(args.plot, params, points, best, outcome.mean_interval_s)
        except OSError as error:
            return fail("simulate", f"cannot write {args.plot}: {error.strerror or error}")
        summary["sweep"] = [{"interval_s": p.interval_s, "goodput": p.goodput} for p in points]
        summary["best_interval_s"] = best
        summary["plot"] = str(args.plot)
    print(json.dumps(summary, sort_keys=True) if args.json else _human(summary))
    return 0
