"""Simulator benchmark: how long 54 simulated days of a 16,384-GPU job take.

The defaults of ``resurgo simulate`` (Llama 3's cluster, failure rate and
cause mix; the supervisor's recommended interval), one simulation per seed,
each timed on its own; the first run also pays for loading NumPy. Then the
sweep behind ``resurgo simulate --plot`` (25 intervals x 4 seeds, without
drawing). Target: a simulation under 10 s.

    python -m bench.simulate [--seeds 5]
    python -m bench.simulate --spares 0 1 2 4 8 16 32 --seeds 10 [--save-stall-s S]

With ``--spares``, instead: goodput of Llama 3's preset with each number of
hot spares, under the adaptive and the recommended (Daly) interval, with
the partition's 16 idle nodes and with none, over ``--seeds`` seeds (mean
and min), the spares' share of the allocation and the badput that dominates.

The last line printed is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import replace

if not __package__:
    sys.exit("run the benchmarks from the repository root as modules: python -m bench.simulate")

from agent.checkpoint.interval import recommended_interval_s
from supervisor.core.goodput import Badput
from supervisor.core.simulate import IntervalPolicy, llama3, simulate, sweep

TARGET_S = 10.0
SWEEP_POINTS = 25
SWEEP_SEEDS = 4


def spares_table(counts: list[int], seeds: int, save_stall_s: float | None = None) -> None:
    """Goodput of Llama 3 with each of ``counts`` hot spares (each save stalling
    ``save_stall_s``, default the preset's); the rows, then one JSON object."""
    rows = []
    base = llama3() if save_stall_s is None else replace(llama3(), save_stall_s=save_stall_s)
    for policy in (IntervalPolicy.ADAPTIVE, IntervalPolicy.DALY):
        for idle in (16, 0):
            for spares in counts:
                params = replace(base, interval_policy=policy, spare_nodes=idle, job_spares=spares)
                outcomes = [simulate(params, seed) for seed in range(seeds)]
                goodputs = [o.goodput for o in outcomes]
                badput = {
                    kind.value: statistics.mean(
                        o.accounting.badput_s[kind] / o.accounting.wall_s for o in outcomes
                    )
                    for kind in Badput
                }
                row = {
                    "policy": policy.value,
                    "idle_nodes": idle,
                    "spares": spares,
                    "goodput_mean": round(statistics.mean(goodputs), 5),
                    "goodput_min": round(min(goodputs), 5),
                    "allocation_goodput_mean": round(
                        statistics.mean(o.allocation_goodput for o in outcomes), 5
                    ),
                    "spare_share": round(statistics.mean(o.spare_share for o in outcomes), 5),
                    "swaps": statistics.mean(o.swaps for o in outcomes),
                    "spare_faults": statistics.mean(o.spare_faults for o in outcomes),
                    "grows": statistics.mean(o.grows for o in outcomes),
                    "queued": statistics.mean(o.queued for o in outcomes),
                    "badput": {kind: round(share, 5) for kind, share in badput.items() if share},
                }
                rows.append(row)
                print(
                    f"{policy.value:8} idle {idle:2} spares {spares:2}: goodput mean "
                    f"{row['goodput_mean']:.2%} min {row['goodput_min']:.2%}, against the "
                    f"allocation {row['allocation_goodput_mean']:.2%}, spares "
                    f"{row['spare_share']:.2%} of it; swaps {row['swaps']:.0f}, spare faults "
                    f"{row['spare_faults']:.1f}, grows {row['grows']:.0f}, queued "
                    f"{row['queued']:.1f}; lost work {badput['lost_work']:.2%}, stall "
                    f"{badput['checkpoint_stall']:.2%}, recovery {badput['recovery']:.2%}, "
                    f"queue {badput['queue_wait']:.2%}"
                )
    print(json.dumps({"seeds": seeds, "save_stall_s": base.save_stall_s, "rows": rows}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=5, help="simulations to time (5)")
    parser.add_argument("--spares", type=int, nargs="+", metavar="K", help="goodput per K instead")
    parser.add_argument(
        "--save-stall-s", type=float, metavar="S", help="with --spares: each save's stall"
    )
    args = parser.parse_args()
    if args.spares:
        spares_table(args.spares, args.seeds, args.save_stall_s)
        return

    params = llama3()
    walls, outcomes = [], []
    for seed in range(args.seeds):
        started = time.perf_counter()
        outcomes.append(simulate(params, seed))
        walls.append(time.perf_counter() - started)
    for seed, (wall, outcome) in enumerate(zip(walls, outcomes, strict=True)):
        print(
            f"seed {seed}: {wall * 1000:8.1f} ms  interruptions "
            f"{sum(outcome.interruptions.values())}  goodput {outcome.goodput:.2%}  "
            f"interval {outcome.mean_interval_s / 60:.1f} min"
        )

    middle = recommended_interval_s(params.save_stall_s, params.write_s, params.job_mtbf_s())
    intervals = [middle * 4 ** (2 * i / (SWEEP_POINTS - 1) - 1) for i in range(SWEEP_POINTS)]
    started = time.perf_counter()
    sweep(params, intervals, range(SWEEP_SEEDS))
    sweep_s = time.perf_counter() - started
    print(f"sweep of {SWEEP_POINTS} intervals x {SWEEP_SEEDS} seeds: {sweep_s:.2f} s")

    first = outcomes[0]
    print(
        json.dumps(
            {
                "simulated_days": params.days,
                "gpus": params.gpus,
                "seeds": args.seeds,
                "wall_s": round(max(walls), 4),
                "wall_s_first_with_numpy_import": round(walls[0], 4),
                "wall_s_median": round(statistics.median(walls), 4),
                "target_s": TARGET_S,
                "met": max(walls) < TARGET_S,
                "interruptions": sum(first.interruptions.values()),
                "interruptions_per_seed": [sum(o.interruptions.values()) for o in outcomes],
                "goodput": round(first.goodput, 4),
                "goodput_per_seed": [round(o.goodput, 4) for o in outcomes],
                "interval_s": round(first.mean_interval_s, 1),
                "sweep_runs": SWEEP_POINTS * SWEEP_SEEDS,
                "sweep_wall_s": round(sweep_s, 3),
            }
        )
    )


if __name__ == "__main__":
    main()
