"""What a job owner's crafted checkpoint costs a live supervisor (issue 34's acceptance).

One real ``resurgo-supervisor`` (fake Slurm, one running two-node job; the
harness of ``tests/adversarial_world.py``) with the product's default
validation limits unless told otherwise. The job commits a good step-100 and
a step-200 whose plain-DCP ``.metadata`` is a class-free pickle of
``--metadata-mib`` MiB (a list of distinct integers, which passes the
unpickler's class allowlist and takes about seven times its size to load),
then a rank dies. While the supervisor validates (the crafted one first), a
thread samples its RSS and asks ``/healthz`` every 50 ms. Targets: RSS grows
by less than 64 MiB, and every ``/healthz`` answer comes within 100 ms.

Run: ``python -m bench.crafted_checkpoint [--metadata-mib 256]
[--validation-memory-mib N]``. The last line printed is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

if not __package__:
    sys.exit("run the benchmarks from the repository root: python -m bench.crafted_checkpoint")

from tests.adversarial_world import MIB, a_world, crafted_checkpoint_run, expanding_pickle

RSS_TARGET_MIB = 64
HEALTHZ_TARGET_S = 0.100
# expanding_pickle writes 5 bytes per integer.
BYTES_PER_INTEGER = 5


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--metadata-mib", type=int, default=256)
    parser.add_argument("--validation-memory-mib", type=int, default=0, help="0: the default")
    args = parser.parse_args()
    limits = {}
    if args.validation_memory_mib:
        limits["RESURGO_SUPERVISOR_VALIDATION_MEMORY_MIB"] = str(args.validation_memory_mib)
    metadata = expanding_pickle(args.metadata_mib * MIB // BYTES_PER_INTEGER)
    with a_world(limits) as world:
        seen = crafted_checkpoint_run(world, metadata)
        rejected = next(
            (line for line in seen.log.read_text(errors="replace").splitlines()
             if f"{seen.crafted} rejected" in line),
            "",
        )  # fmt: skip
    result = {
        "metadata_mib": round(len(metadata) / MIB, 1),
        "validation_memory_mib": args.validation_memory_mib or "default",
        "rss_before_mib": round(seen.before / MIB, 1),
        "rss_peak_mib": round(seen.peak / MIB, 1),
        "rss_grown_mib": round(seen.grown / MIB, 1),
        "healthz_slowest_ms": round(seen.slowest_s * 1000, 1),
        "validation_to_choice_s": round(seen.seconds, 1),
        "rejected_because": rejected.split(" rejected", 1)[-1].strip()[:300],
        "target_met": seen.grown < RSS_TARGET_MIB * MIB and seen.slowest_s < HEALTHZ_TARGET_S,
        "load_average_1m": round(os.getloadavg()[0], 2),
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
