"""What an idle supervisor holds in memory, and what holds it.

A real ``python -m supervisor.daemon`` with the fake Slurm (``--nodes`` nodes,
``--jobs`` running jobs of 4 nodes, no agents), after ``--settle-s`` seconds:
the resident and unique memory (RSS, USS) of the daemon and of each process it
started (the checkpoint validation child), and, for the breakdown, the RSS of
a bare interpreter and of one that imported the daemon's modules.

    python -m bench.idle_memory              # no job: an idle supervisor
    python -m bench.idle_memory --jobs 2     # jobs running: the validation child warm

The last line printed is one JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import getpass
import json
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import psutil

from bench.load_cluster import REPO, install_fake_slurm, write_jobs
from bench.load_harness import Supervisor, free_port, wait_listening

MIB = 1 << 20
IMPORTS = "import supervisor.daemon"


def imported_rss_mib(code: str) -> float:
    """The RSS of a fresh interpreter after ``code``, in MiB."""
    probe = f"{code}\nimport psutil; print(psutil.Process().memory_info().rss)"
    done = subprocess.run([sys.executable, "-c", probe], cwd=REPO, capture_output=True,
                          text=True, check=True, timeout=120)  # fmt: skip
    return int(done.stdout.split()[-1]) / MIB


def memory_of(process: psutil.Process) -> dict[str, float]:
    full = process.memory_full_info()
    return {"rss_mib": round(full.rss / MIB, 1), "uss_mib": round(full.uss / MIB, 1)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=0, help="running jobs (default 0)")
    parser.add_argument("--nodes", type=int, default=64, help="cluster nodes (default 64)")
    parser.add_argument("--settle-s", type=float, default=20.0, help="wait before reading")
    args = parser.parse_args(argv)
    if args.jobs < 0 or args.nodes < 4 * args.jobs or args.settle_s < 0:
        parser.error("--jobs >= 0, --nodes >= 4 per job, --settle-s >= 0")
    names = [f"node{i:05d}" for i in range(args.nodes)]
    # Slurm runs a job on every 4 nodes; the supervisor follows the first --jobs of them.
    listed = {str(1000 + j): names[4 * j : 4 * j + 4] for j in range(args.nodes // 4)}
    jobs = dict(list(listed.items())[: args.jobs])
    found: dict[str, Any] = {"jobs": args.jobs, "nodes": args.nodes}
    with tempfile.TemporaryDirectory(prefix="resurgo-idle-") as tmp:
        where = Path(tmp)
        bin_dir = install_fake_slurm(where, listed, getpass.getuser())
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        write_jobs(where / "state" / "jobs", jobs, 1, url, where, random.Random(0))
        supervisor = Supervisor(where, bin_dir, port)
        try:
            asyncio.run(wait_listening(url, 120))
            time.sleep(args.settle_s)
            found["daemon"] = memory_of(supervisor.ps)
            children = supervisor.ps.children(recursive=True)
            found["children"] = [
                {"cmd": " ".join(child.cmdline()[1:4]), **memory_of(child)} for child in children
            ]
            found["total_rss_mib"] = round(
                found["daemon"]["rss_mib"] + sum(c["rss_mib"] for c in found["children"]), 1
            )
        finally:
            supervisor.stop()
        print(supervisor.log_tail(5), file=sys.stderr)
    found["bare_interpreter_rss_mib"] = round(imported_rss_mib("pass"), 1)
    found["daemon_imports_rss_mib"] = round(imported_rss_mib(IMPORTS), 1)
    found["torch_import_rss_mib"] = round(imported_rss_mib("import torch"), 1)
    print(json.dumps(found))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
