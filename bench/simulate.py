"""Simulator benchmark: how long 54 simulated days of a 16,384-GPU job take.

The defaults of ``resurgo simulate`` (Llama 3's cluster, failure rate and
cause mix; the supervisor's recommended interval), one simulation per seed,
each timed on its own; the first run also pays for loading NumPy. Then the
sweep behind ``resurgo simulate --plot`` (25 intervals x 4 seeds, without
drawing). Target: a simulation under 10 s.

    python -m bench.simulate [--seeds 5]

The last line printed is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

if not __package__:
    sys.exit("run the benchmarks from the repository root as modules: python -m bench.simulate")

from agent.checkpoint.interval import recommended_interval_s
from supervisor.core.simulate import llama3, simulate, sweep

TARGET_S = 10.0
SWEEP_POINTS = 25
SWEEP_SEEDS = 4


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=5, help="simulations to time (5)")
    args = parser.parse_args()

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
